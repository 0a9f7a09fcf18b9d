#!/usr/bin/env python3
"""Writes Apron's Grafana dashboards (Python standard library only).

    python3 dashboards/grafana/generate.py           # (re)write prometheus/*.json, postgres/*.json
    python3 dashboards/grafana/generate.py --check   # exit 1 if a committed file differs

The JSON files next to this script are the artefacts users import; this script is their
source, so that the eight dashboards share one set of conventions (datasource inputs,
variables, units, state colours). Edit a query here, run it, commit both. Every query is
run against real data by tests/dashboards/check.py (see README.md in this folder).

Two datasources:
  * prometheus/ - Prometheus scraping the agent (:9401, dcgm-exporter-compatible and
    native apron_gpu_* families) and the server (:9402, apron_idle_cost_dollars_total,
    apron_gpu_seconds_total, apron_stranded_*, apron_alerts_firing); docs/metrics.md.
  * postgres/ - Grafana's PostgreSQL datasource pointed at the server's PostgreSQL wire
    port (:5433). The SQL engine behind it is Apache DataFusion, not PostgreSQL: the
    queries use only what both Grafana's macro expansion and DataFusion accept (see
    README.md, "SQL dialect").
"""

import argparse
import copy
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GRAFANA_VERSION = "10.4.0"
SCHEMA_VERSION = 39

PROM = {
    "kind": "prometheus",
    "input": "DS_PROMETHEUS",
    "plugin": "prometheus",
    "plugin_name": "Prometheus",
    "label": "Prometheus",
    "description": "Prometheus that scrapes apron-agent (:9401) and the apron server (:9402)",
}
PG = {
    "kind": "postgres",
    "input": "DS_POSTGRES",
    "plugin": "grafana-postgresql-datasource",
    "plugin_name": "PostgreSQL",
    "label": "Apron SQL (PostgreSQL wire)",
    "description": "Grafana's PostgreSQL datasource on the apron server's PostgreSQL wire port (:5433, read-only)",
}


def ds_ref(ds):
    return {"type": ds["plugin"], "uid": "${%s}" % ds["input"]}


# --------------------------------------------------------------------------- panels

GPU_STATE_MAPPINGS = [
    {
        "type": "value",
        "options": {
            "0": {"text": "idle", "color": "orange", "index": 0},
            "1": {"text": "busy", "color": "green", "index": 1},
            "2": {"text": "no data", "color": "text", "index": 2},
            "3": {"text": "lost", "color": "red", "index": 3},
        },
    }
]

# Codes for the ledger's exclusive states (docs/cost.md), used by the hourly state
# timelines of the SQL dashboards.
LEDGER_STATE_MAPPINGS = [
    {
        "type": "value",
        "options": {
            "0": {"text": "active", "color": "green", "index": 0},
            "1": {"text": "unallocated busy", "color": "blue", "index": 1},
            "2": {"text": "allocated idle", "color": "yellow", "index": 2},
            "3": {"text": "unallocated idle", "color": "orange", "index": 3},
            "4": {"text": "stranded", "color": "red", "index": 4},
            "5": {"text": "unknown", "color": "text", "index": 5},
        },
    }
]

STATE_COLOURS = {
    "active": "green",
    "unallocated_busy": "blue",
    "allocated_idle": "yellow",
    "unallocated_idle": "orange",
    "stranded": "red",
    "unknown": "text",
    "underused": "purple",
}


def colour_overrides(names):
    """Fixed colours for series/fields named after ledger states or idle kinds."""
    out = []
    for name, colour in names.items():
        out.append(
            {
                "matcher": {"id": "byName", "options": name},
                "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": colour}}],
            }
        )
    return out


def base_thresholds(steps=None):
    return {
        "mode": "absolute",
        "steps": steps or [{"color": "green", "value": None}],
    }


class Board:
    """Collects panels and lays them out left to right, top to bottom (24 columns)."""

    def __init__(self, ds, uid, title, description, tags):
        self.ds = ds
        self.uid = uid
        self.title = title
        self.description = description
        self.tags = tags
        self.panels = []
        self.variables = []
        self.links = []
        self._x = 0
        self._y = 0
        self._row_h = 0
        self._id = 0

    # -- layout
    def _place(self, w, h):
        if self._x + w > 24:
            self._x = 0
            self._y += self._row_h
            self._row_h = 0
        pos = {"h": h, "w": w, "x": self._x, "y": self._y}
        self._x += w
        self._row_h = max(self._row_h, h)
        return pos

    def row(self, title):
        if self._x:
            self._x = 0
            self._y += self._row_h
            self._row_h = 0
        self._id += 1
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "id": self._id,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self._y},
                "panels": [],
            }
        )
        self._y += 1

    # -- targets
    def prom(self, expr, legend="__auto", instant=False, fmt="time_series", interval=None):
        t = {
            "datasource": ds_ref(self.ds),
            "editorMode": "code",
            "expr": expr,
            "legendFormat": legend,
            "range": not instant,
            "instant": instant,
            "format": fmt,
        }
        if interval:
            t["interval"] = interval
        return t

    def sql(self, raw, fmt="table"):
        return {
            "datasource": ds_ref(self.ds),
            "editorMode": "code",
            "format": fmt,
            "rawQuery": True,
            "rawSql": raw,
        }

    # -- panels
    def panel(self, ptype, title, targets, w, h, description="", unit=None, options=None,
              custom=None, defaults=None, overrides=None, transformations=None,
              interval=None, max_data_points=None):
        self._id += 1
        refids = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        tgs = []
        for i, t in enumerate(targets):
            t = dict(t)
            t["refId"] = refids[i]
            tgs.append(t)
        fd = {"color": {"mode": "palette-classic"}, "mappings": [], "thresholds": base_thresholds()}
        if unit:
            fd["unit"] = unit
        if custom is not None:
            fd["custom"] = custom
        if defaults:
            fd.update(defaults)
        p = {
            "type": ptype,
            "title": title,
            "description": description,
            "id": self._id,
            "datasource": ds_ref(self.ds),
            "gridPos": self._place(w, h),
            "fieldConfig": {"defaults": fd, "overrides": overrides or []},
            "options": options or {},
            "targets": tgs,
        }
        if transformations:
            p["transformations"] = transformations
        if interval:
            p["interval"] = interval
        if max_data_points:
            p["maxDataPoints"] = max_data_points
        self.panels.append(p)
        return p

    def timeseries(self, title, targets, w=12, h=8, unit=None, stack=False, bars=False,
                   description="", min_=None, max_=None, overrides=None, interval=None):
        custom = {
            "drawStyle": "bars" if bars else "line",
            "lineWidth": 1,
            "fillOpacity": 60 if bars else (25 if stack else 8),
            "gradientMode": "none",
            "showPoints": "never",
            "spanNulls": False,
            "axisPlacement": "auto",
            "axisSoftMin": 0,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "barAlignment": -1 if bars else 0,
        }
        defaults = {}
        if min_ is not None:
            defaults["min"] = min_
        if max_ is not None:
            defaults["max"] = max_
        return self.panel(
            "timeseries", title, targets, w, h, description, unit,
            options={
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"},
            },
            custom=custom, defaults=defaults, overrides=overrides, interval=interval,
        )

    def stat(self, title, targets, w=4, h=4, unit=None, description="", decimals=None,
             steps=None, mappings=None, text_mode="auto", graph=False, color_mode="value",
             calc="lastNotNull", interval=None):
        defaults = {"thresholds": base_thresholds(steps)}
        if decimals is not None:
            defaults["decimals"] = decimals
        if mappings:
            defaults["mappings"] = mappings
        defaults["color"] = {"mode": "thresholds"}
        return self.panel(
            "stat", title, targets, w, h, description, unit,
            options={
                "reduceOptions": {"calcs": [calc], "fields": "", "values": False},
                "colorMode": color_mode,
                "graphMode": "area" if graph else "none",
                "justifyMode": "auto",
                "orientation": "auto",
                "textMode": text_mode,
                "wideLayout": True,
                "showPercentChange": False,
            },
            defaults=defaults, interval=interval,
        )

    def bargauge(self, title, targets, w=12, h=8, unit=None, description="", values=False,
                 fields="", decimals=None, steps=None, max_=None):
        defaults = {"thresholds": base_thresholds(steps), "color": {"mode": "continuous-GrYlRd"}, "min": 0}
        if decimals is not None:
            defaults["decimals"] = decimals
        if max_ is not None:
            defaults["max"] = max_
        return self.panel(
            "bargauge", title, targets, w, h, description, unit,
            options={
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": fields, "values": values},
                "orientation": "horizontal",
                "displayMode": "gradient",
                "valueMode": "color",
                "namePlacement": "auto",
                "showUnfilled": True,
                "sizing": "auto",
                "minVizHeight": 16,
                "minVizWidth": 8,
                "maxVizHeight": 300,
            },
            defaults=defaults,
        )

    def table(self, title, targets, w=24, h=8, unit=None, description="", transformations=None,
              overrides=None, sort_by=None):
        options = {
            "showHeader": True,
            "cellHeight": "sm",
            "footer": {"show": False, "reducer": ["sum"], "countRows": False, "fields": ""},
        }
        if sort_by:
            options["sortBy"] = [{"displayName": sort_by, "desc": True}]
        return self.panel(
            "table", title, targets, w, h, description, unit, options=options,
            custom={"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False,
                    "filterable": True},
            defaults={"color": {"mode": "thresholds"}},
            overrides=overrides, transformations=transformations,
        )

    def state_timeline(self, title, targets, w=24, h=10, description="", mappings=None,
                       interval=None):
        return self.panel(
            "state-timeline", title, targets, w, h, description, None,
            options={
                "mergeValues": True,
                "showValue": "never",
                "alignValue": "left",
                "rowHeight": 0.9,
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "single", "sort": "none"},
            },
            custom={"fillOpacity": 80, "lineWidth": 0, "spanNulls": False},
            defaults={"mappings": mappings or GPU_STATE_MAPPINGS, "color": {"mode": "thresholds"}},
            interval=interval,
        )

    def heatmap(self, title, targets, w=24, h=9, unit="percentunit", description="",
                interval=None):
        return self.panel(
            "heatmap", title, targets, w, h, description, None,
            options={
                "calculate": True,
                "calculation": {"yBuckets": {"mode": "count", "value": "10", "scale": {"type": "linear"}}},
                "cellGap": 1,
                "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "exponent": 0.5,
                          "fill": "dark-orange", "reverse": False},
                "exemplars": {"color": "rgba(255,0,255,0.7)"},
                "filterValues": {"le": 1e-9},
                "legend": {"show": True},
                "rowsFrame": {"layout": "auto"},
                "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
                "yAxis": {"axisPlacement": "left", "unit": unit, "reverse": False},
                "showValue": "never",
            },
            custom={"hideFrom": {"legend": False, "tooltip": False, "viz": False},
                    "scaleDistribution": {"type": "linear"}},
            interval=interval,
        )

    def piechart(self, title, targets, w=8, h=8, unit=None, description="", overrides=None,
                 values=False):
        return self.panel(
            "piechart", title, targets, w, h, description, unit,
            options={
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": values},
                "pieType": "donut",
                "legend": {"displayMode": "table", "placement": "right", "showLegend": True,
                           "values": ["value", "percent"]},
                "tooltip": {"mode": "single", "sort": "none"},
                "displayLabels": [],
            },
            custom={"hideFrom": {"legend": False, "tooltip": False, "viz": False}},
            overrides=overrides,
        )

    # -- variables
    def ds_variable(self):
        self.variables.append(
            {
                "name": self.ds["input"],
                "label": "Datasource",
                "type": "datasource",
                "query": self.ds["plugin"],
                "current": {},
                "hide": 0,
                "includeAll": False,
                "multi": False,
                "options": [],
                "refresh": 1,
                "regex": "",
                "skipUrlSync": False,
            }
        )

    def query_variable(self, name, label, query, multi=True, all_value=None, sort=1,
                       description=""):
        if self.ds is PROM:
            q = {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"}
        else:
            q = query
        v = {
            "name": name,
            "label": label,
            "description": description,
            "type": "query",
            "datasource": ds_ref(self.ds),
            "definition": query,
            "query": q,
            "refresh": 2,
            "regex": "",
            "sort": sort,
            "multi": multi,
            "includeAll": multi,
            "current": {},
            "hide": 0,
            "options": [],
            "skipUrlSync": False,
        }
        if multi and all_value is not None:
            v["allValue"] = all_value
        self.variables.append(v)

    def link(self, title, tags):
        self.links.append(
            {"title": title, "type": "dashboards", "tags": tags, "asDropdown": True,
             "includeVars": False, "keepTime": True, "icon": "external link",
             "targetBlank": False, "tooltip": "", "url": ""}
        )

    # -- output
    def to_json(self):
        ds = self.ds
        panel_types = sorted({p["type"] for p in self.panels if p["type"] != "row"})
        names = {
            "bargauge": "Bar gauge", "heatmap": "Heatmap", "piechart": "Pie chart",
            "stat": "Stat", "state-timeline": "State timeline", "table": "Table",
            "timeseries": "Time series",
        }
        requires = [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA_VERSION},
            {"type": "datasource", "id": ds["plugin"], "name": ds["plugin_name"], "version": "1.0.0"},
        ] + [{"type": "panel", "id": t, "name": names[t], "version": ""} for t in panel_types]
        return {
            "__inputs": [
                {
                    "name": ds["input"],
                    "label": ds["label"],
                    "description": ds["description"],
                    "type": "datasource",
                    "pluginId": ds["plugin"],
                    "pluginName": ds["plugin_name"],
                }
            ],
            "__elements": {},
            "__requires": requires,
            "annotations": {
                "list": [
                    {
                        "builtIn": 1,
                        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                        "enable": True,
                        "hide": True,
                        "iconColor": "rgba(0, 211, 255, 1)",
                        "name": "Annotations & Alerts",
                        "type": "dashboard",
                    }
                ]
            },
            "description": self.description,
            "editable": True,
            "fiscalYearStartMonth": 0,
            "graphTooltip": 1,
            "id": None,
            "links": self.links,
            "liveNow": False,
            "panels": self.panels,
            "refresh": "1m",
            "schemaVersion": SCHEMA_VERSION,
            "tags": self.tags,
            "templating": {"list": self.variables},
            "time": {"from": "now-6h", "to": "now"},
            "timepicker": {},
            "timezone": "utc",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
            "weekStart": "",
        }


# --------------------------------------------------------------------------- PromQL

def gpu_state_expr(sel):
    """Per GPU: 3 lost, 1 busy, 0 idle, as the cost classifier decides idleness (SM
    activity where the GPU reports it, else the window's max utilisation)."""
    by = "max by (hostname, gpu_uuid, gpu_index)"
    return (
        f"(({by} (apron_gpu_lost{{{sel}}}) == 1) * 3)\n"
        f"or ({by} (apron_gpu_sm_active_max_ratio{{{sel}}}) >= bool 0.01)\n"
        f"or ({by} (apron_gpu_util_max_ratio{{{sel}}}) > bool 0)"
    )


def prom_fleet_overview():
    b = Board(PROM, "apron-prom-fleet-overview", "Apron / Fleet overview (Prometheus)",
              "Every GPU the agents see: how busy, how many idle, power and memory, and the "
              "server's idle dollars. Agent families on :9401, server families on :9402.",
              ["apron", "gpu", "prometheus"])
    b.link("Apron dashboards", ["apron"])
    b.ds_variable()
    b.query_variable("hostname", "Host", "label_values(apron_gpu_info, hostname)", all_value=".*")
    b.query_variable("gpu_model", "Model", 'label_values(apron_gpu_info{hostname=~"$hostname"}, gpu_model)',
                     all_value=".*")
    s = 'hostname=~"$hostname", gpu_model=~"$gpu_model"'
    state = gpu_state_expr(s)

    b.row("Now")
    b.stat("GPUs", [b.prom(f"count(apron_gpu_info{{{s}}})", instant=True)],
           description="GPUs and MIG instances reporting (apron_gpu_info).", steps=[{"color": "blue", "value": None}])
    b.stat("Busy GPUs", [b.prom(f"count(({state}) == 1) or vector(0)", instant=True)],
           description="GPUs whose last 1 s window had SM activity >= 1 % (GPM) or any utilisation.")
    b.stat("Idle GPUs", [b.prom(f"count(({state}) == 0) or vector(0)", instant=True)],
           description="GPUs whose last window ran no work (the cost classifier's idle rule).",
           steps=[{"color": "green", "value": None}, {"color": "orange", "value": 1}])
    b.stat("Lost GPUs", [b.prom(f"sum(apron_gpu_lost{{{s}}})", instant=True)],
           description="GPUs answering GPU_IS_LOST (apron_gpu_lost).",
           steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}])
    b.stat("Utilisation over the range",
           [b.prom(f"sum(increase(apron_gpu_busy_seconds_total{{{s}}}[$__range]))\n/\n"
                   f"sum(increase(apron_gpu_observed_seconds_total{{signal=\"gpu_util\", {s}}}[$__range]))",
                   instant=True)],
           unit="percentunit", decimals=1,
           description="Busy seconds / observed seconds over the dashboard range: exact at any "
                       "scrape interval, gaps excluded.")
    b.stat("Power draw", [b.prom(f"sum(apron_gpu_power_watts{{{s}}})", instant=True)], unit="watt",
           graph=True, description="Sum of the last window's mean power.", steps=[{"color": "blue", "value": None}])

    b.stat("Idle $ over the range (all teams)",
           [b.prom("sum(increase(apron_idle_cost_dollars_total[$__range]))", instant=True)],
           w=6, unit="currencyUSD", decimals=2,
           description="Allocated idle + stranded + unallocated idle dollars priced by the server's "
                       "ledger (apron_idle_cost_dollars_total). Not filtered by host.",
           steps=[{"color": "orange", "value": None}])
    b.stat("Stranded allocations now", [b.prom("count(apron_stranded_allocation) or vector(0)", instant=True)],
           w=6, description="Allocations with GPUs stranded now (apron_stranded_allocation).",
           steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}])
    b.stat("Alerts firing", [b.prom("sum(apron_alerts_firing)", instant=True)], w=6,
           description="All alert kinds (apron_alerts_firing).",
           steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}])
    b.stat("Agent samplers down",
           [b.prom("count(apron_agent_sampler_up == 0) or vector(0)", instant=True)], w=6,
           description="Samplers whose last tick read nothing (apron_agent_sampler_up).",
           steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}])

    b.row("Utilisation")
    b.timeseries(
        "Utilisation by host",
        [b.prom(f"sum by (hostname) (rate(apron_gpu_busy_seconds_total{{{s}}}[$__rate_interval]))\n/\n"
                f"sum by (hostname) (rate(apron_gpu_observed_seconds_total{{signal=\"gpu_util\", {s}}}[$__rate_interval]))",
                legend="{{hostname}}")],
        unit="percentunit", min_=0, max_=1,
        description="Exact: rate of busy seconds over rate of observed seconds (docs/metrics.md).")
    b.timeseries(
        "SM active by model (GPM, Hopper and newer)",
        [b.prom(f"sum by (gpu_model) (rate(apron_gpu_sm_active_seconds_total{{{s}}}[$__rate_interval]))\n/\n"
                f"sum by (gpu_model) (rate(apron_gpu_observed_seconds_total{{signal=\"sm_active\", {s}}}[$__rate_interval]))",
                legend="{{gpu_model}}")],
        unit="percentunit", min_=0, max_=1,
        description="SM activity integrated over windows. Only GPUs with GPM report it.")
    b.state_timeline(
        "GPU busy / idle", [b.prom(state, legend="{{hostname}} / {{gpu_index}}")],
        h=12, description="Per GPU: busy, idle (no work in the window) or lost.")
    b.heatmap("Utilisation distribution",
              [b.prom(f"max by (hostname, gpu_uuid) (apron_gpu_util_ratio{{{s}}})",
                      legend="{{hostname}} {{gpu_uuid}}")],
              description="How many GPUs sat at each utilisation level over time (apron_gpu_util_ratio).")
    b.timeseries(
        "DCGM_FI_DEV_GPU_UTIL by host (dcgm-exporter names)",
        [b.prom('avg by (Hostname) (DCGM_FI_DEV_GPU_UTIL{Hostname=~"$hostname", modelName=~"$gpu_model"})',
                legend="{{Hostname}}")],
        unit="percent", min_=0, max_=100,
        description="The same signal under dcgm-exporter's name and labels, for dashboards built on "
                    "dcgm-exporter (mean of the last window, %).")
    b.timeseries(
        "Tensor core activity by model (GPM)",
        [b.prom(f"sum by (gpu_model) (rate(apron_gpu_tensor_active_seconds_total{{{s}}}[$__rate_interval]))\n/\n"
                f"sum by (gpu_model) (rate(apron_gpu_observed_seconds_total{{signal=\"sm_active\", {s}}}[$__rate_interval]))",
                legend="{{gpu_model}}")],
        unit="percentunit", min_=0, max_=1)

    b.row("Memory, power, temperature")
    b.timeseries(
        "Framebuffer used by host",
        [b.prom(f"sum by (hostname) (apron_gpu_memory_used_bytes{{{s}}})\n/\n"
                f"sum by (hostname) (apron_gpu_memory_total_bytes{{{s}}})", legend="{{hostname}}")],
        w=8, unit="percentunit", min_=0, max_=1)
    b.timeseries("Power by host",
                 [b.prom(f"sum by (hostname) (apron_gpu_power_watts{{{s}}})", legend="{{hostname}}")],
                 w=8, unit="watt")
    b.timeseries("Hottest GPU by host",
                 [b.prom(f"max by (hostname) (apron_gpu_temperature_celsius{{{s}}})", legend="{{hostname}}")],
                 w=8, unit="celsius")

    b.row("Inventory and alerts")
    b.timeseries("Alerts firing by kind",
                 [b.prom("sum by (kind) (apron_alerts_firing)", legend="{{kind}}")], w=24, h=6,
                 unit="short", stack=True,
                 description="Stranded allocations, zombie memory, unallocated busy GPUs, lost GPUs "
                             "and XIDs (docs/alerts-and-recommendations.md).")
    b.table(
        "GPUs",
        [b.prom(f"max by (hostname, gpu_index, gpu_uuid, gpu_model, driver_version) (apron_gpu_info{{{s}}})",
                instant=True, fmt="table"),
         b.prom(f"max by (hostname, gpu_uuid) (apron_gpu_util_ratio{{{s}}})", instant=True, fmt="table"),
         b.prom(f"max by (hostname, gpu_uuid) (apron_gpu_memory_used_bytes{{{s}}})", instant=True, fmt="table"),
         b.prom(f"max by (hostname, gpu_uuid) (apron_gpu_power_watts{{{s}}})", instant=True, fmt="table")],
        h=10, description="Last window per GPU.",
        transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True, "Value #A": True},
                "indexByName": {"hostname": 0, "gpu_index": 1, "gpu_uuid": 2, "gpu_model": 3,
                                "Value #B": 4, "Value #C": 5, "Value #D": 6, "driver_version": 7},
                "renameByName": {"Value #B": "utilisation", "Value #C": "memory used",
                                 "Value #D": "power"}}},
        ],
        overrides=[
            {"matcher": {"id": "byName", "options": "utilisation"},
             "properties": [{"id": "unit", "value": "percentunit"},
                            {"id": "custom.cellOptions", "value": {"type": "gauge", "mode": "basic"}},
                            {"id": "min", "value": 0}, {"id": "max", "value": 1}]},
            {"matcher": {"id": "byName", "options": "memory used"},
             "properties": [{"id": "unit", "value": "bytes"}]},
            {"matcher": {"id": "byName", "options": "power"},
             "properties": [{"id": "unit", "value": "watt"}]},
        ])
    return b


def prom_idle_cost_by_team():
    b = Board(PROM, "apron-prom-idle-cost-by-team", "Apron / Idle cost by team (Prometheus)",
              "Idle GPU dollars and GPU time by team and kind, from the server's cost ledger "
              "(apron_idle_cost_dollars_total, apron_gpu_seconds_total on :9402). The ledger "
              "recomputes every [cost] interval, so the counters move in steps; a recomputed day "
              "can lower them (docs/metrics.md), which increase() reads as a reset. The SQL "
              "dashboard of the same name is exact.",
              ["apron", "cost", "prometheus"])
    b.link("Apron dashboards", ["apron"])
    b.ds_variable()
    b.query_variable("team", "Team", "label_values(apron_idle_cost_dollars_total, team)", all_value=".*")
    t = 'team=~"$team"'

    b.row("Over the dashboard range")
    b.stat("Idle $", [b.prom(f"sum(increase(apron_idle_cost_dollars_total{{{t}}}[$__range]))", instant=True)],
           unit="currencyUSD", decimals=2, w=5, steps=[{"color": "orange", "value": None}],
           description="Allocated idle + stranded + unallocated idle.")
    b.stat("Stranded $",
           [b.prom(f'sum(increase(apron_idle_cost_dollars_total{{kind="stranded", {t}}}[$__range]))', instant=True)],
           unit="currencyUSD", decimals=2, w=5, steps=[{"color": "red", "value": None}],
           description="Idle runs of allocated GPUs that reached stranded_after, in full from their start.")
    b.stat("Allocated idle $",
           [b.prom(f'sum(increase(apron_idle_cost_dollars_total{{kind="allocated_idle", {t}}}[$__range]))',
                   instant=True)],
           unit="currencyUSD", decimals=2, w=5, steps=[{"color": "yellow", "value": None}])
    b.stat("Unallocated idle $",
           [b.prom('sum(increase(apron_idle_cost_dollars_total{kind="unallocated_idle"}[$__range]))', instant=True)],
           unit="currencyUSD", decimals=2, w=5, steps=[{"color": "orange", "value": None}],
           description="GPUs nobody held (team unallocated); not filtered by team.")
    b.stat("Idle GPU-hours",
           [b.prom(f'sum(increase(apron_gpu_seconds_total{{state=~"allocated_idle|stranded|unallocated_idle", {t}}}[$__range])) / 3600',
                   instant=True)],
           unit="h", decimals=1, w=4, steps=[{"color": "blue", "value": None}])

    b.bargauge("Idle $ by team",
               [b.prom(f"sort_desc(sum by (team) (increase(apron_idle_cost_dollars_total{{{t}}}[$__range])))",
                       legend="{{team}}", instant=True)],
               unit="currencyUSD", decimals=2, w=10, h=9)
    b.piechart("Idle $ by kind",
               [b.prom(f"sum by (kind) (increase(apron_idle_cost_dollars_total{{{t}}}[$__range]))",
                       legend="{{kind}}", instant=True)],
               unit="currencyUSD", w=7, h=9, overrides=colour_overrides(STATE_COLOURS))
    b.bargauge("Utilisation of held GPUs by team",
               [b.prom(f'sum by (team) (increase(apron_gpu_seconds_total{{state="active", {t}}}[$__range]))\n/\n'
                       f'sum by (team) (increase(apron_gpu_seconds_total{{state=~"active|allocated_idle|stranded", {t}}}[$__range]))',
                       legend="{{team}}", instant=True)],
               unit="percentunit", w=7, h=9, max_=1,
               steps=[{"color": "red", "value": None}, {"color": "yellow", "value": 0.4},
                      {"color": "green", "value": 0.7}],
               description="Active seconds / seconds held (active + allocated idle + stranded).")

    b.row("Over time")
    b.timeseries("Idle $ over the trailing hour, by team",
                 [b.prom(f"sum by (team) (increase(apron_idle_cost_dollars_total{{{t}}}[1h]))", legend="{{team}}")],
                 unit="currencyUSD",
                 description="A 1 h window smooths the ledger's step-wise updates.")
    b.timeseries("GPU-hours by state over the trailing hour",
                 [b.prom(f'sum by (state) (increase(apron_gpu_seconds_total{{state!="underused", {t}}}[1h])) / 3600',
                         legend="{{state}}")],
                 unit="h", stack=True, overrides=colour_overrides(STATE_COLOURS),
                 description="Exclusive states (docs/cost.md); under-used is a part of active and left out.")

    b.row("Breakdown")
    b.table("GPU-hours by team and state",
            [b.prom(f'sum by (team, state) (increase(apron_gpu_seconds_total{{{t}}}[$__range])) / 3600',
                    instant=True, fmt="table")],
            unit="h", h=9,
            transformations=[
                {"id": "groupingToMatrix", "options": {"columnField": "state", "rowField": "team",
                                                       "valueField": "Value", "emptyValue": "zero"}},
                {"id": "organize", "options": {"renameByName": {"team\\state": "team"}}},
            ],
            description="Over the dashboard range; the states of one GPU-hour add up to 1 h across teams.")
    return b


def prom_stranded():
    b = Board(PROM, "apron-prom-stranded-allocations", "Apron / Stranded allocations (Prometheus)",
              "Allocations whose GPUs sit idle past stranded_after, from the server's alert "
              "evaluator (apron_stranded_allocation, apron_stranded_seconds, apron_alerts_firing) "
              "and the cost ledger.",
              ["apron", "alerts", "prometheus"])
    b.link("Apron dashboards", ["apron"])
    b.ds_variable()
    b.query_variable("team", "Team", "label_values(apron_idle_cost_dollars_total, team)", all_value=".*")
    t = 'team=~"$team"'

    b.row("Now")
    b.stat("Stranded allocations", [b.prom(f"count(apron_stranded_allocation{{{t}}}) or vector(0)", instant=True)],
           w=6, steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}])
    b.stat("Stranded-allocation alerts firing",
           [b.prom('sum(apron_alerts_firing{kind="stranded_allocation"})', instant=True)],
           w=6, steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
           description="All teams.")
    b.stat("Longest stranded run", [b.prom(f"max(apron_stranded_seconds{{{t}}}) or vector(0)", instant=True)],
           w=6, unit="s", steps=[{"color": "green", "value": None}, {"color": "orange", "value": 1800},
                                 {"color": "red", "value": 7200}])
    b.stat("Stranded $ over the range",
           [b.prom(f'sum(increase(apron_idle_cost_dollars_total{{kind="stranded", {t}}}[$__range]))', instant=True)],
           w=6, unit="currencyUSD", decimals=2, steps=[{"color": "red", "value": None}])
    b.table("Stranded now",
            [b.prom(f"max by (team, host, owner, workload_kind, gpu) (apron_stranded_seconds{{{t}}})",
                    instant=True, fmt="table")],
            h=8, description="One row per allocation; gpu lists its stranded GPU UUIDs.",
            sort_by="idle for",
            transformations=[{"id": "organize", "options": {
                "excludeByName": {"Time": True},
                "indexByName": {"team": 0, "owner": 1, "workload_kind": 2, "host": 3, "gpu": 4, "Value": 5},
                "renameByName": {"Value": "idle for", "gpu": "stranded GPUs"}}}],
            overrides=[{"matcher": {"id": "byName", "options": "idle for"},
                        "properties": [{"id": "unit", "value": "s"}]}])

    b.row("Over time")
    b.timeseries("Stranded allocations by team",
                 [b.prom(f"count by (team) (apron_stranded_allocation{{{t}}})", legend="{{team}}")],
                 stack=True, unit="short")
    b.timeseries("Idle run length by allocation",
                 [b.prom(f"max by (team, owner) (apron_stranded_seconds{{{t}}})", legend="{{team}} {{owner}}")],
                 unit="s")
    b.timeseries("Stranded $ over the trailing hour, by team",
                 [b.prom(f'sum by (team) (increase(apron_idle_cost_dollars_total{{kind="stranded", {t}}}[1h]))',
                         legend="{{team}}")],
                 unit="currencyUSD")
    b.timeseries("Alerts firing by kind",
                 [b.prom("sum by (kind) (apron_alerts_firing)", legend="{{kind}}")], unit="short")
    b.bargauge("Stranded GPU-hours by team over the range",
               [b.prom(f'sort_desc(sum by (team) (increase(apron_gpu_seconds_total{{state="stranded", {t}}}[$__range])) / 3600)',
                       legend="{{team}}", instant=True)],
               w=24, h=7, unit="h", decimals=1)
    return b


def prom_gpu_detail():
    b = Board(PROM, "apron-prom-gpu-detail", "Apron / GPU detail (Prometheus)",
              "One GPU (or MIG instance): activity, memory, power, clocks, interconnect, "
              "processes and health, from apron-agent's /metrics.",
              ["apron", "gpu", "prometheus"])
    b.link("Apron dashboards", ["apron"])
    b.ds_variable()
    b.query_variable("hostname", "Host", "label_values(apron_gpu_info, hostname)", multi=False)
    b.query_variable("gpu", "GPU", 'label_values(apron_gpu_info{hostname="$hostname"}, gpu_uuid)', multi=False)
    g = 'gpu_uuid="$gpu"'
    by = "max by (gpu_uuid)"

    b.row("Now")
    b.stat("Model", [b.prom(f"max by (gpu_model) (apron_gpu_info{{{g}}})", legend="{{gpu_model}}", instant=True)],
           w=6, text_mode="name", color_mode="none")
    b.stat("State", [b.prom(gpu_state_expr(g), legend="{{gpu_uuid}}", instant=True)], w=3,
           mappings=GPU_STATE_MAPPINGS, text_mode="value", color_mode="background")
    b.stat("Utilisation over the range",
           [b.prom(f"sum(increase(apron_gpu_busy_seconds_total{{{g}}}[$__range]))\n/\n"
                   f"sum(increase(apron_gpu_observed_seconds_total{{signal=\"gpu_util\", {g}}}[$__range]))",
                   instant=True)],
           w=4, unit="percentunit", decimals=1)
    b.stat("Framebuffer used",
           [b.prom(f"{by} (apron_gpu_memory_used_bytes{{{g}}}) / {by} (apron_gpu_memory_total_bytes{{{g}}})",
                   instant=True)],
           w=4, unit="percentunit", decimals=1)
    b.stat("Power", [b.prom(f"{by} (apron_gpu_power_watts{{{g}}})", instant=True)], w=4, unit="watt",
           steps=[{"color": "blue", "value": None}])
    b.stat("Last XID", [b.prom('max(DCGM_FI_DEV_XID_ERRORS{UUID="$gpu"})', instant=True)], w=3,
           description="DCGM_FI_DEV_XID_ERRORS: the last critical XID seen, 0 if none.",
           steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}])

    b.row("Activity")
    b.timeseries(
        "Utilisation and activity",
        [b.prom(f"{by} (apron_gpu_util_ratio{{{g}}})", legend="gpu_util (mean)"),
         b.prom(f"{by} (apron_gpu_util_max_ratio{{{g}}})", legend="gpu_util (max)"),
         b.prom(f"{by} (apron_gpu_sm_active_ratio{{{g}}})", legend="sm_active"),
         b.prom(f"{by} (apron_gpu_sm_occupancy_ratio{{{g}}})", legend="sm_occupancy"),
         b.prom(f"{by} (apron_gpu_tensor_active_ratio{{{g}}})", legend="tensor_active"),
         b.prom(f"{by} (apron_gpu_dram_active_ratio{{{g}}})", legend="dram_active")],
        w=16, h=9, unit="percentunit", min_=0, max_=1,
        description="Last-window means. SM, occupancy, tensor and DRAM activity come from GPM "
                    "(Hopper and newer); other GPUs have no such series.")
    b.state_timeline("Busy / idle", [b.prom(gpu_state_expr(g), legend="state")], w=8, h=9)
    b.timeseries(
        "Utilisation (exact, from busy seconds)",
        [b.prom(f"sum(rate(apron_gpu_busy_seconds_total{{{g}}}[$__rate_interval]))\n/\n"
                f"sum(rate(apron_gpu_observed_seconds_total{{signal=\"gpu_util\", {g}}}[$__rate_interval]))",
                legend="gpu_util")],
        w=12, unit="percentunit", min_=0, max_=1)
    b.timeseries(
        "Framebuffer",
        [b.prom(f"{by} (apron_gpu_memory_used_bytes{{{g}}})", legend="used"),
         b.prom(f"{by} (apron_gpu_memory_reserved_bytes{{{g}}})", legend="reserved"),
         b.prom(f"{by} (apron_gpu_memory_total_bytes{{{g}}})", legend="total")],
        w=12, unit="bytes")

    b.row("Power, thermals, clocks, interconnect")
    b.timeseries(
        "Power",
        [b.prom(f"{by} (apron_gpu_power_watts{{{g}}})", legend="power"),
         b.prom(f"sum(rate(apron_gpu_energy_joules_total{{{g}}}[$__rate_interval]))", legend="energy rate")],
        w=8, unit="watt")
    b.timeseries(
        "Temperature",
        [b.prom(f"{by} (apron_gpu_temperature_celsius{{{g}}})", legend="GPU"),
         b.prom(f"{by} (apron_gpu_memory_temperature_celsius{{{g}}})", legend="memory")],
        w=8, unit="celsius")
    b.timeseries(
        "Clocks",
        [b.prom(f"{by} (apron_gpu_sm_clock_hertz{{{g}}})", legend="SM"),
         b.prom(f"{by} (apron_gpu_memory_clock_hertz{{{g}}})", legend="memory")],
        w=8, unit="hertz")
    b.timeseries(
        "PCIe and NVLink",
        [b.prom(f"{by} (apron_gpu_pcie_transmit_bytes_per_second{{{g}}})", legend="PCIe tx"),
         b.prom(f"{by} (apron_gpu_pcie_receive_bytes_per_second{{{g}}})", legend="PCIe rx"),
         b.prom(f"{by} (apron_gpu_nvlink_transmit_bytes_per_second{{{g}}})", legend="NVLink tx"),
         b.prom(f"{by} (apron_gpu_nvlink_receive_bytes_per_second{{{g}}})", legend="NVLink rx")],
        w=12, unit="Bps")
    b.timeseries(
        "Health counters",
        [b.prom(f"max by (type) (last_over_time(apron_gpu_ecc_errors_total{{{g}}}[1m]))", legend="ECC {{type}}"),
         b.prom(f"max by (cause) (last_over_time(apron_gpu_remapped_rows_total{{{g}}}[1m]))",
                legend="remapped rows {{cause}}"),
         b.prom(f"max(last_over_time(apron_gpu_pcie_replays_total{{{g}}}[1m]))", legend="PCIe replays")],
        w=12, unit="short",
        description="Read by the health sampler every 10 s; last_over_time bridges the windows "
                    "without a reading.")

    b.row("Processes")
    b.table("Processes now",
            [b.prom(f"max by (pid, process_name, user, pod, namespace, container, job_id) "
                    f"(apron_gpu_process_memory_bytes{{{g}}})", instant=True, fmt="table")],
            w=12, h=8, sort_by="memory",
            transformations=[{"id": "organize", "options": {
                "excludeByName": {"Time": True},
                "renameByName": {"Value": "memory"}}}],
            overrides=[{"matcher": {"id": "byName", "options": "memory"},
                        "properties": [{"id": "unit", "value": "bytes"}]}])
    b.timeseries("Process memory",
                 [b.prom(f"sum by (pid, process_name) (apron_gpu_process_memory_bytes{{{g}}})",
                         legend="{{pid}} {{process_name}}")],
                 w=12, unit="bytes", stack=True)
    return b


# --------------------------------------------------------------------------- SQL

# Hours that overlap the dashboard range. `$__timeFilter(hour)` would drop the hour the
# range starts in (its `hour` is before $__timeFrom()).
HOURS = "hour >= date_trunc('hour', $__timeFrom()) AND hour <= $__timeTo()"


def alloc_overlap(start, end):
    return f"{start} <= $__timeTo() AND ({end} IS NULL OR {end} >= $__timeFrom())"


def pg_fleet_overview():
    b = Board(PG, "apron-pg-fleet-overview", "Apron / Fleet overview (SQL)",
              "Every GPU from the stored tables (gpu_samples_1m, gpu_cost_hourly, alerts) "
              "through the server's PostgreSQL wire port.",
              ["apron", "gpu", "sql"])
    b.link("Apron dashboards", ["apron"])
    b.ds_variable()
    b.query_variable("hostname", "Host", f"SELECT DISTINCT host FROM gpu_cost_hourly WHERE {HOURS} ORDER BY 1")
    b.query_variable("gpu_model", "Model",
                     f"SELECT DISTINCT gpu_model FROM gpu_cost_hourly WHERE {HOURS} AND host IN ($hostname) ORDER BY 1")
    f = "host IN ($hostname) AND gpu_model IN ($gpu_model)"

    b.row("Over the dashboard range")
    b.stat("GPUs", [b.sql(f"SELECT count(DISTINCT gpu_uuid) AS gpus\nFROM gpu_samples_1m\n"
                          f"WHERE $__timeFilter(time) AND {f}")],
           description="GPUs and MIG instances with samples in the range.",
           steps=[{"color": "blue", "value": None}])
    b.stat("Utilisation",
           [b.sql("SELECT sum(gpu_util_mean * covered_s) / sum(CASE WHEN gpu_util_mean IS NOT NULL THEN covered_s END) AS utilisation\n"
                  f"FROM gpu_samples_1m\nWHERE $__timeFilter(time) AND {f}")],
           unit="percentunit", decimals=1,
           description="Minute means of gpu_util weighted by the seconds each minute covers.")
    b.stat("Active share of known time",
           [b.sql("SELECT sum(CAST(active_s + unallocated_busy_s AS DOUBLE))\n"
                  "     / sum(CAST(active_s + allocated_idle_s + stranded_s + unallocated_idle_s + unallocated_busy_s AS DOUBLE)) AS busy_share\n"
                  f"FROM gpu_cost_hourly\nWHERE {HOURS} AND {f}")],
           unit="percentunit", decimals=1,
           description="Busy GPU time / known GPU time, from the ledger (hours overlapping the range).")
    b.stat("Cost",
           [b.sql(f"SELECT sum(CAST(cost_usd AS DOUBLE)) AS cost_usd\nFROM gpu_cost_hourly\nWHERE {HOURS} AND {f}")],
           unit="currencyUSD", decimals=2, steps=[{"color": "blue", "value": None}],
           description="Every known second priced (hours overlapping the range).")
    b.stat("Idle $",
           [b.sql(f"SELECT sum(CAST(idle_cost_usd AS DOUBLE)) AS idle_usd\nFROM gpu_cost_hourly\nWHERE {HOURS} AND {f}")],
           unit="currencyUSD", decimals=2, steps=[{"color": "orange", "value": None}])
    b.stat("Alerts firing",
           [b.sql("SELECT count(*) AS firing FROM alerts WHERE state = 'firing'")],
           steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
           description="All kinds, all hosts (the alerts table holds the current set).")

    b.row("Utilisation")
    b.timeseries(
        "Utilisation by host",
        [b.sql("SELECT $__timeGroupAlias(time, $__interval), host AS metric,\n"
               "       sum(gpu_util_mean * covered_s) / sum(CASE WHEN gpu_util_mean IS NOT NULL THEN covered_s END) AS value\n"
               f"FROM gpu_samples_1m\nWHERE $__timeFilter(time) AND {f}\nGROUP BY 1, 2\nORDER BY 1",
               fmt="time_series")],
        unit="percentunit", min_=0, max_=1, interval="1m")
    b.timeseries(
        "SM active by model (GPM, Hopper and newer)",
        [b.sql("SELECT $__timeGroupAlias(time, $__interval), gpu_model AS metric, avg(sm_active_mean) AS value\n"
               f"FROM gpu_samples_1m\nWHERE $__timeFilter(time) AND {f} AND sm_active_mean IS NOT NULL\n"
               "GROUP BY 1, 2\nORDER BY 1", fmt="time_series")],
        unit="percentunit", min_=0, max_=1, interval="1m")
    b.state_timeline(
        "GPU busy / idle by minute",
        [b.sql("SELECT \"time\", metric,\n"
               "       CASE WHEN sm IS NOT NULL THEN CASE WHEN sm >= 0.01 THEN 1 ELSE 0 END\n"
               "            WHEN util IS NOT NULL THEN CASE WHEN util > 0 THEN 1 ELSE 0 END\n"
               "            ELSE 2 END AS state\n"
               "FROM (\n"
               "  SELECT $__timeGroupAlias(time, $__interval), host || ' / ' || CAST(gpu_index AS VARCHAR) AS metric,\n"
               "         max(CAST(sm_active_max_max AS DOUBLE)) AS sm, max(CAST(gpu_util_max_max AS DOUBLE)) AS util\n"
               f"  FROM gpu_samples_1m\n  WHERE $__timeFilter(time) AND {f}\n  GROUP BY 1, 2\n) s\nORDER BY 1",
               fmt="time_series")],
        h=12, interval="1m",
        description="Busy when any window of the interval ran work (SM activity >= 1 % where "
                    "reported, else utilisation > 0). The ledger's hourly states are on the "
                    "idle-cost dashboard.")
    b.heatmap(
        "Utilisation distribution",
        [b.sql("SELECT $__timeGroupAlias(time, $__interval), host || ' / ' || CAST(gpu_index AS VARCHAR) AS metric,\n"
               "       avg(gpu_util_mean) AS value\n"
               f"FROM gpu_samples_1m\nWHERE $__timeFilter(time) AND {f}\nGROUP BY 1, 2\nORDER BY 1",
               fmt="time_series")],
        interval="1m", description="How many GPUs sat at each utilisation level over time.")

    b.row("Memory and power")
    b.timeseries(
        "Framebuffer used by host",
        [b.sql("SELECT \"time\", host AS metric, sum(used) / sum(total) AS value\nFROM (\n"
               "  SELECT $__timeGroupAlias(time, $__interval), host, gpu_uuid,\n"
               "         avg(fb_used_bytes_mean) AS used, max(CAST(fb_total_bytes_max AS DOUBLE)) AS total\n"
               f"  FROM gpu_samples_1m\n  WHERE $__timeFilter(time) AND {f}\n  GROUP BY 1, 2, 3\n) s\n"
               "GROUP BY 1, 2\nORDER BY 1", fmt="time_series")],
        unit="percentunit", min_=0, max_=1, interval="1m")
    b.timeseries(
        "Power by host",
        [b.sql("SELECT \"time\", host AS metric, sum(watts) AS value\nFROM (\n"
               "  SELECT $__timeGroupAlias(time, $__interval), host, gpu_uuid, avg(power_watts_mean) AS watts\n"
               f"  FROM gpu_samples_1m\n  WHERE $__timeFilter(time) AND {f}\n  GROUP BY 1, 2, 3\n) s\n"
               "GROUP BY 1, 2\nORDER BY 1", fmt="time_series")],
        unit="watt", interval="1m")

    b.row("Inventory")
    b.table(
        "GPUs",
        [b.sql("SELECT host, gpu_index, gpu_uuid, gpu_model, max(mig_profile) AS mig_profile,\n"
               "       max(time) AS last_seen,\n"
               "       sum(gpu_util_mean * covered_s) / sum(CASE WHEN gpu_util_mean IS NOT NULL THEN covered_s END) AS utilisation,\n"
               "       max(fb_used_bytes_max) AS peak_memory, avg(power_watts_mean) AS mean_power\n"
               f"FROM gpu_samples_1m\nWHERE $__timeFilter(time) AND {f}\nGROUP BY 1, 2, 3, 4\nORDER BY 1, 2")],
        h=10,
        overrides=[
            {"matcher": {"id": "byName", "options": "utilisation"},
             "properties": [{"id": "unit", "value": "percentunit"},
                            {"id": "custom.cellOptions", "value": {"type": "gauge", "mode": "basic"}},
                            {"id": "min", "value": 0}, {"id": "max", "value": 1}]},
            {"matcher": {"id": "byName", "options": "peak_memory"}, "properties": [{"id": "unit", "value": "bytes"}]},
            {"matcher": {"id": "byName", "options": "mean_power"}, "properties": [{"id": "unit", "value": "watt"}]},
        ])
    b.table(
        "Alerts",
        [b.sql("SELECT state, severity, kind, team, host, gpu_uuids, owner, starts_at, ends_at, summary\n"
               f"FROM alerts\nWHERE {alloc_overlap('starts_at', 'ends_at')}\n"
               "ORDER BY state, starts_at DESC")],
        h=8, description="Alert episodes that overlap the range (firing, or resolved within "
                         "[alerts] keep_resolved), every host.")
    return b


LEDGER_DOMINANT_STATE = (
    "CASE greatest(active, unallocated_busy, allocated_idle, unallocated_idle, stranded, unknown)\n"
    "            WHEN stranded THEN 4 WHEN allocated_idle THEN 2 WHEN unallocated_idle THEN 3\n"
    "            WHEN active THEN 0 WHEN unallocated_busy THEN 1 ELSE 5 END"
)


def pg_idle_cost_by_team():
    b = Board(PG, "apron-pg-idle-cost-by-team", "Apron / Idle cost by team (SQL)",
              "Exact idle dollars and GPU time by team from gpu_cost_hourly (the ledger's "
              "hourly rows; money is Decimal(18, 6), summed as double here for display). Hours "
              "overlapping the dashboard range are counted whole.",
              ["apron", "cost", "sql"])
    b.link("Apron dashboards", ["apron"])
    b.ds_variable()
    b.query_variable("team", "Team", f"SELECT DISTINCT team FROM gpu_cost_hourly WHERE {HOURS} ORDER BY 1")
    f = f"{HOURS} AND team IN ($team)"

    b.row("Over the dashboard range")
    b.stat("Cost", [b.sql(f"SELECT sum(CAST(cost_usd AS DOUBLE)) AS cost_usd FROM gpu_cost_hourly WHERE {f}")],
           w=5, unit="currencyUSD", decimals=2, steps=[{"color": "blue", "value": None}])
    b.stat("Idle $", [b.sql(f"SELECT sum(CAST(idle_cost_usd AS DOUBLE)) AS idle_usd FROM gpu_cost_hourly WHERE {f}")],
           w=5, unit="currencyUSD", decimals=2, steps=[{"color": "orange", "value": None}])
    b.stat("Stranded $",
           [b.sql(f"SELECT sum(CAST(stranded_cost_usd AS DOUBLE)) AS stranded_usd FROM gpu_cost_hourly WHERE {f}")],
           w=5, unit="currencyUSD", decimals=2, steps=[{"color": "red", "value": None}])
    b.stat("Idle share of cost",
           [b.sql(f"SELECT sum(CAST(idle_cost_usd AS DOUBLE)) / sum(CAST(cost_usd AS DOUBLE)) AS idle_share\n"
                  f"FROM gpu_cost_hourly WHERE {f}")],
           w=5, unit="percentunit", decimals=1,
           steps=[{"color": "green", "value": None}, {"color": "orange", "value": 0.2}, {"color": "red", "value": 0.4}])
    b.stat("Unpriced GPU-hours",
           [b.sql("SELECT COALESCE(sum(CASE WHEN price_per_gpu_hour IS NULL THEN CAST(active_s + allocated_idle_s + stranded_s + unallocated_idle_s + unallocated_busy_s AS DOUBLE) END), 0) / 3600 AS unpriced_hours\n"
                  f"FROM gpu_cost_hourly WHERE {f}")],
           w=4, unit="h", decimals=1,
           steps=[{"color": "green", "value": None}, {"color": "orange", "value": 0.001}],
           description="Known GPU time of models the price book does not list: their money is NULL, never $0.")

    b.bargauge("Idle $ by team",
               [b.sql("SELECT team, sum(CAST(idle_cost_usd AS DOUBLE)) AS idle_usd\n"
                      f"FROM gpu_cost_hourly\nWHERE {f}\nGROUP BY team\nORDER BY idle_usd DESC")],
               w=10, h=9, unit="currencyUSD", decimals=2, values=True, fields="/^idle_usd$/")
    b.piechart("Idle $ by kind",
               [b.sql("SELECT sum(CASE WHEN team <> 'unallocated' THEN CAST(idle_cost_usd - stranded_cost_usd AS DOUBLE) ELSE 0 END) AS allocated_idle,\n"
                      "       sum(CAST(stranded_cost_usd AS DOUBLE)) AS stranded,\n"
                      "       sum(CASE WHEN team = 'unallocated' THEN CAST(idle_cost_usd AS DOUBLE) ELSE 0 END) AS unallocated_idle\n"
                      f"FROM gpu_cost_hourly\nWHERE {f}")],
               w=7, h=9, unit="currencyUSD", overrides=colour_overrides(STATE_COLOURS))
    b.bargauge("Utilisation of held GPUs by team",
               [b.sql("SELECT team, sum(CAST(active_s AS DOUBLE)) / sum(CAST(active_s + allocated_idle_s + stranded_s AS DOUBLE)) AS utilisation\n"
                      f"FROM gpu_cost_hourly\nWHERE {f} AND team <> 'unallocated'\nGROUP BY team\n"
                      "HAVING sum(CAST(active_s + allocated_idle_s + stranded_s AS DOUBLE)) > 0\nORDER BY utilisation")],
               w=7, h=9, unit="percentunit", values=True, fields="/^utilisation$/", max_=1,
               steps=[{"color": "red", "value": None}, {"color": "yellow", "value": 0.4},
                      {"color": "green", "value": 0.7}])

    b.row("Per hour")
    b.timeseries("Idle $ per hour by team",
                 [b.sql("SELECT $__timeGroupAlias(hour, 1h), team AS metric, sum(CAST(idle_cost_usd AS DOUBLE)) AS value\n"
                        f"FROM gpu_cost_hourly\nWHERE {f}\nGROUP BY 1, 2\nORDER BY 1", fmt="time_series")],
                 unit="currencyUSD", bars=True, stack=True)
    b.timeseries("GPU-hours by state",
                 [b.sql("SELECT $__timeGroupAlias(hour, 1h),\n"
                        "       sum(CAST(active_s AS DOUBLE)) / 3600 AS active,\n"
                        "       sum(CAST(unallocated_busy_s AS DOUBLE)) / 3600 AS unallocated_busy,\n"
                        "       sum(CAST(allocated_idle_s AS DOUBLE)) / 3600 AS allocated_idle,\n"
                        "       sum(CAST(stranded_s AS DOUBLE)) / 3600 AS stranded,\n"
                        "       sum(CAST(unallocated_idle_s AS DOUBLE)) / 3600 AS unallocated_idle,\n"
                        "       sum(CAST(unknown_s AS DOUBLE)) / 3600 AS unknown\n"
                        f"FROM gpu_cost_hourly\nWHERE {f}\nGROUP BY 1\nORDER BY 1", fmt="time_series")],
                 unit="h", bars=True, stack=True, overrides=colour_overrides(STATE_COLOURS))
    b.state_timeline(
        "Dominant state per GPU-hour",
        [b.sql("SELECT \"time\", metric,\n"
               f"       {LEDGER_DOMINANT_STATE} AS state\n"
               "FROM (\n"
               "  SELECT $__timeGroupAlias(hour, 1h), host || ' / ' || gpu_uuid AS metric,\n"
               "         sum(active_s) AS active, sum(unallocated_busy_s) AS unallocated_busy,\n"
               "         sum(allocated_idle_s) AS allocated_idle, sum(unallocated_idle_s) AS unallocated_idle,\n"
               "         sum(stranded_s) AS stranded, sum(unknown_s) AS unknown\n"
               f"  FROM gpu_cost_hourly\n  WHERE {f}\n  GROUP BY 1, 2\n) s\nORDER BY 1",
               fmt="time_series")],
        h=12, mappings=LEDGER_STATE_MAPPINGS,
        description="The ledger's exclusive state that took most of each GPU-hour (docs/cost.md).")

    b.row("Breakdown")
    b.table("Teams",
            [b.sql("SELECT team,\n"
                   "       sum(CAST(active_s + allocated_idle_s + stranded_s AS DOUBLE)) / 3600 AS held_h,\n"
                   "       sum(CAST(active_s AS DOUBLE)) / 3600 AS active_h,\n"
                   "       sum(CAST(underused_s AS DOUBLE)) / 3600 AS underused_h,\n"
                   "       sum(CAST(allocated_idle_s AS DOUBLE)) / 3600 AS allocated_idle_h,\n"
                   "       sum(CAST(stranded_s AS DOUBLE)) / 3600 AS stranded_h,\n"
                   "       sum(CAST(unallocated_idle_s + unallocated_busy_s AS DOUBLE)) / 3600 AS unallocated_h,\n"
                   "       sum(CAST(unknown_s AS DOUBLE)) / 3600 AS unknown_h,\n"
                   "       sum(CAST(cost_usd AS DOUBLE)) AS cost_usd,\n"
                   "       sum(CAST(idle_cost_usd AS DOUBLE)) AS idle_usd,\n"
                   "       sum(CAST(stranded_cost_usd AS DOUBLE)) AS stranded_usd\n"
                   f"FROM gpu_cost_hourly\nWHERE {f}\nGROUP BY team\nORDER BY idle_usd DESC")],
            h=9,
            overrides=[
                {"matcher": {"id": "byRegexp", "options": ".*_h$"},
                 "properties": [{"id": "unit", "value": "h"}, {"id": "decimals", "value": 1}]},
                {"matcher": {"id": "byRegexp", "options": ".*_usd$"},
                 "properties": [{"id": "unit", "value": "currencyUSD"}, {"id": "decimals", "value": 2}]},
            ])
    b.table("GPUs with the most idle $",
            [b.sql("SELECT host, gpu_uuid, gpu_model, team,\n"
                   "       sum(CAST(allocated_idle_s + stranded_s + unallocated_idle_s AS DOUBLE)) / 3600 AS idle_h,\n"
                   "       sum(CAST(idle_cost_usd AS DOUBLE)) AS idle_usd\n"
                   f"FROM gpu_cost_hourly\nWHERE {f}\nGROUP BY 1, 2, 3, 4\n"
                   "HAVING sum(CAST(idle_cost_usd AS DOUBLE)) > 0\nORDER BY idle_usd DESC\nLIMIT 20")],
            w=12, h=9,
            overrides=[
                {"matcher": {"id": "byName", "options": "idle_h"},
                 "properties": [{"id": "unit", "value": "h"}, {"id": "decimals", "value": 1}]},
                {"matcher": {"id": "byName", "options": "idle_usd"},
                 "properties": [{"id": "unit", "value": "currencyUSD"}, {"id": "decimals", "value": 2}]},
            ])
    b.table("Recommendations",
            [b.sql("SELECT kind, team, owner_kind, owner, host, gpu_count,\n"
                   "       CAST(monthly_savings_usd AS DOUBLE) AS monthly_savings_usd, savings_kind, confidence, summary\n"
                   "FROM recommendations\nWHERE holder_live\nORDER BY monthly_savings_usd DESC")],
            w=12, h=9, description="The latest run over [recommend] window (not the dashboard range); "
                                   "only holders that still hold their GPUs.",
            overrides=[
                {"matcher": {"id": "byName", "options": "monthly_savings_usd"},
                 "properties": [{"id": "unit", "value": "currencyUSD"}, {"id": "decimals", "value": 0}]},
                {"matcher": {"id": "byName", "options": "confidence"},
                 "properties": [{"id": "unit", "value": "percentunit"}]},
            ])
    return b


def pg_stranded():
    b = Board(PG, "apron-pg-stranded-allocations", "Apron / Stranded allocations (SQL)",
              "Stranded allocations from the alerts table (current and recently resolved "
              "episodes) and their cost from allocations joined with gpu_cost_hourly.",
              ["apron", "alerts", "sql"])
    b.link("Apron dashboards", ["apron"])
    b.ds_variable()
    b.query_variable("team", "Team", f"SELECT DISTINCT team FROM gpu_cost_hourly WHERE {HOURS} ORDER BY 1")
    f = f"{HOURS} AND team IN ($team)"
    a = "kind = 'stranded_allocation' AND team IN ($team)"

    b.row("Now")
    b.stat("Stranded allocations",
           [b.sql(f"SELECT count(*) AS firing FROM alerts WHERE {a} AND state = 'firing'")],
           w=6, steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}])
    b.stat("Stranded GPUs",
           [b.sql(f"SELECT COALESCE(sum(gpus_stranded), 0) AS gpus FROM alerts WHERE {a} AND state = 'firing'")],
           w=6, steps=[{"color": "green", "value": None}, {"color": "red", "value": 1}])
    b.stat("Stranded $ over the range",
           [b.sql(f"SELECT sum(CAST(stranded_cost_usd AS DOUBLE)) AS stranded_usd FROM gpu_cost_hourly WHERE {f}")],
           w=6, unit="currencyUSD", decimals=2, steps=[{"color": "red", "value": None}])
    b.stat("Stranded GPU-hours over the range",
           [b.sql(f"SELECT sum(CAST(stranded_s AS DOUBLE)) / 3600 AS stranded_h FROM gpu_cost_hourly WHERE {f}")],
           w=6, unit="h", decimals=1, steps=[{"color": "red", "value": None}])
    b.table("Stranded-allocation alerts",
            [b.sql("SELECT state, team, owner_kind, owner, workload_kind, host, gpus_stranded, gpus_total,\n"
                   "       starts_at, ends_at, idle_s, CAST(cost_usd AS DOUBLE) AS cost_usd, summary\n"
                   f"FROM alerts\nWHERE {a}\n  AND {alloc_overlap('starts_at', 'ends_at')}\n"
                   "ORDER BY state, cost_usd DESC")],
            h=8, description="Episodes that overlap the range; ends_at is empty while firing.",
            overrides=[
                {"matcher": {"id": "byName", "options": "idle_s"}, "properties": [{"id": "unit", "value": "s"}]},
                {"matcher": {"id": "byName", "options": "cost_usd"},
                 "properties": [{"id": "unit", "value": "currencyUSD"}, {"id": "decimals", "value": 2}]},
            ])

    b.row("Cost")
    b.table("Allocations with stranded time in the range",
            [b.sql("SELECT a.team, a.owner_kind, a.owner, a.workload_kind, a.host,\n"
                   "       min(a.start_time) AS start_time, max(a.end_time) AS end_time,\n"
                   "       count(DISTINCT a.gpu_uuid) AS gpus,\n"
                   "       sum(CAST(c.stranded_s AS DOUBLE)) / 3600 AS stranded_h,\n"
                   "       sum(CAST(c.stranded_cost_usd AS DOUBLE)) AS stranded_usd\n"
                   "FROM allocations a\n"
                   "JOIN gpu_cost_hourly c\n"
                   "  ON c.gpu_uuid = a.gpu_uuid AND c.team = a.team\n"
                   " AND c.hour + INTERVAL '1 hour' > a.start_time\n"
                   " AND (a.end_time IS NULL OR c.hour < a.end_time)\n"
                   "WHERE c.hour >= date_trunc('hour', $__timeFrom()) AND c.hour <= $__timeTo()\n"
                   f"  AND {alloc_overlap('a.start_time', 'a.end_time')}\n"
                   "  AND a.team IN ($team) AND c.stranded_s > 0\n"
                   "GROUP BY 1, 2, 3, 4, 5\nORDER BY stranded_usd DESC")],
            h=8,
            description="Stranded dollars of the GPU-hours each allocation overlaps (as the weekly "
                        "report counts them: hour granularity).",
            overrides=[
                {"matcher": {"id": "byName", "options": "stranded_h"},
                 "properties": [{"id": "unit", "value": "h"}, {"id": "decimals", "value": 1}]},
                {"matcher": {"id": "byName", "options": "stranded_usd"},
                 "properties": [{"id": "unit", "value": "currencyUSD"}, {"id": "decimals", "value": 2}]},
            ])
    b.timeseries("Stranded GPU-hours per hour by team",
                 [b.sql("SELECT $__timeGroupAlias(hour, 1h), team AS metric, sum(CAST(stranded_s AS DOUBLE)) / 3600 AS value\n"
                        f"FROM gpu_cost_hourly\nWHERE {f} AND stranded_s > 0\nGROUP BY 1, 2\nORDER BY 1",
                        fmt="time_series")],
                 unit="h", bars=True, stack=True)
    b.timeseries("Stranded $ per hour by team",
                 [b.sql("SELECT $__timeGroupAlias(hour, 1h), team AS metric, sum(CAST(stranded_cost_usd AS DOUBLE)) AS value\n"
                        f"FROM gpu_cost_hourly\nWHERE {f} AND stranded_s > 0\nGROUP BY 1, 2\nORDER BY 1",
                        fmt="time_series")],
                 unit="currencyUSD", bars=True, stack=True)
    b.bargauge("Stranded $ by team",
               [b.sql("SELECT team, sum(CAST(stranded_cost_usd AS DOUBLE)) AS stranded_usd\n"
                      f"FROM gpu_cost_hourly\nWHERE {f}\nGROUP BY team\nHAVING sum(stranded_s) > 0\n"
                      "ORDER BY stranded_usd DESC")],
               unit="currencyUSD", decimals=2, values=True, fields="/^stranded_usd$/")
    b.table("Reclaim and right-size recommendations",
            [b.sql("SELECT kind, team, owner_kind, owner, host, gpu_count, gpu_uuids,\n"
                   "       CAST(monthly_savings_usd AS DOUBLE) AS monthly_savings_usd, confidence, summary\n"
                   "FROM recommendations\n"
                   "WHERE kind IN ('reclaim', 'right-size') AND team IN ($team) AND holder_live\n"
                   "ORDER BY monthly_savings_usd DESC")],
            w=12, description="The latest recommendation run (its own window, not the dashboard range); "
                              "only holders that still hold their GPUs.",
            overrides=[
                {"matcher": {"id": "byName", "options": "monthly_savings_usd"},
                 "properties": [{"id": "unit", "value": "currencyUSD"}, {"id": "decimals", "value": 0}]},
                {"matcher": {"id": "byName", "options": "confidence"},
                 "properties": [{"id": "unit", "value": "percentunit"}]},
            ])
    return b


def pg_gpu_detail():
    b = Board(PG, "apron-pg-gpu-detail", "Apron / GPU detail (SQL)",
              "One GPU (or MIG instance) from gpu_samples (1 s windows, grouped to the "
              "dashboard interval), gpu_processes, allocations and gpu_cost_hourly.",
              ["apron", "gpu", "sql"])
    b.link("Apron dashboards", ["apron"])
    b.ds_variable()
    b.query_variable("hostname", "Host", f"SELECT DISTINCT host FROM gpu_cost_hourly WHERE {HOURS} ORDER BY 1",
                     multi=False)
    b.query_variable("gpu", "GPU",
                     f"SELECT DISTINCT gpu_uuid FROM gpu_cost_hourly WHERE {HOURS} AND host = '$hostname' ORDER BY 1",
                     multi=False)
    g = "gpu_uuid = '$gpu' AND $__timeFilter(time)"

    def grouped(cols):
        return b.sql("SELECT $__timeGroupAlias(time, $__interval),\n       " + ",\n       ".join(cols)
                     + f"\nFROM gpu_samples\nWHERE {g}\nGROUP BY 1\nORDER BY 1", fmt="time_series")

    b.row("Over the dashboard range")
    b.table("GPU",
            [b.sql("SELECT host, gpu_index, gpu_model, max(mig_profile) AS mig_profile, max(parent_gpu_uuid) AS parent_gpu_uuid,\n"
                   "       min(time) AS first_seen, max(time) AS last_seen, sum(window_s) AS observed_s\n"
                   f"FROM gpu_samples\nWHERE {g}\nGROUP BY 1, 2, 3")],
            w=12, h=4,
            overrides=[{"matcher": {"id": "byName", "options": "observed_s"},
                        "properties": [{"id": "unit", "value": "s"}]}])
    b.stat("Utilisation",
           [b.sql("SELECT sum(CAST(gpu_util AS DOUBLE) * window_s) / sum(CASE WHEN gpu_util IS NOT NULL THEN window_s END) AS utilisation\n"
                  f"FROM gpu_samples WHERE {g}")],
           w=4, unit="percentunit", decimals=1)
    b.stat("Cost",
           [b.sql(f"SELECT sum(CAST(cost_usd AS DOUBLE)) AS cost_usd FROM gpu_cost_hourly WHERE gpu_uuid = '$gpu' AND {HOURS}")],
           w=4, unit="currencyUSD", decimals=2, steps=[{"color": "blue", "value": None}])
    b.stat("Idle $",
           [b.sql(f"SELECT sum(CAST(idle_cost_usd AS DOUBLE)) AS idle_usd FROM gpu_cost_hourly WHERE gpu_uuid = '$gpu' AND {HOURS}")],
           w=4, unit="currencyUSD", decimals=2, steps=[{"color": "orange", "value": None}])

    b.row("Activity")
    b.timeseries("Utilisation and activity",
                 [grouped(["avg(CAST(gpu_util AS DOUBLE)) AS gpu_util",
                           "max(CAST(gpu_util_max AS DOUBLE)) AS gpu_util_max",
                           "avg(CAST(sm_active AS DOUBLE)) AS sm_active",
                           "avg(CAST(sm_occupancy AS DOUBLE)) AS sm_occupancy",
                           "avg(CAST(tensor_active AS DOUBLE)) AS tensor_active",
                           "avg(CAST(dram_active AS DOUBLE)) AS dram_active"])],
                 w=16, h=9, unit="percentunit", min_=0, max_=1,
                 description="Means of the 1 s windows in each interval; gpu_util_max is the "
                             "interval's peak. GPM fields are empty on GPUs without GPM.")
    b.state_timeline(
        "Busy / idle",
        [b.sql("SELECT \"time\",\n"
               "       CASE WHEN lost THEN 3\n"
               "            WHEN sm IS NOT NULL THEN CASE WHEN sm >= 0.01 THEN 1 ELSE 0 END\n"
               "            WHEN util IS NOT NULL THEN CASE WHEN util > 0 THEN 1 ELSE 0 END\n"
               "            ELSE 2 END AS state\n"
               "FROM (\n"
               "  SELECT $__timeGroupAlias(time, $__interval), bool_or(gpu_lost) AS lost,\n"
               "         max(CAST(sm_active_max AS DOUBLE)) AS sm, max(CAST(gpu_util_max AS DOUBLE)) AS util\n"
               f"  FROM gpu_samples\n  WHERE {g}\n  GROUP BY 1\n) s\nORDER BY 1", fmt="time_series")],
        w=8, h=9)
    b.timeseries("Framebuffer",
                 [grouped(["avg(CAST(fb_used_bytes AS DOUBLE)) AS used",
                           "avg(CAST(fb_reserved_bytes AS DOUBLE)) AS reserved",
                           "max(fb_total_bytes) AS total"])],
                 w=12, unit="bytes")
    b.timeseries("Power",
                 [grouped(["avg(CAST(power_watts AS DOUBLE)) AS power",
                           "max(CAST(power_watts AS DOUBLE)) AS peak"])],
                 w=12, unit="watt")

    b.row("Thermals, clocks, interconnect, health")
    b.timeseries("Temperature",
                 [grouped(["avg(gpu_temp_c) AS gpu", "avg(mem_temp_c) AS memory"])],
                 w=8, unit="celsius")
    b.timeseries("Clocks",
                 [grouped(["avg(sm_clock_mhz) AS sm", "avg(mem_clock_mhz) AS memory"])],
                 w=8, unit="rotmhz")
    b.timeseries("PCIe and NVLink",
                 [grouped(["avg(CAST(pcie_tx_bytes_per_s AS DOUBLE)) AS pcie_tx",
                           "avg(CAST(pcie_rx_bytes_per_s AS DOUBLE)) AS pcie_rx",
                           "avg(CAST(nvlink_tx_bytes_per_s AS DOUBLE)) AS nvlink_tx",
                           "avg(CAST(nvlink_rx_bytes_per_s AS DOUBLE)) AS nvlink_rx"])],
                 w=8, unit="Bps")
    b.timeseries("Health counters",
                 [grouped(["max(ecc_sbe_total) AS ecc_corrected",
                           "max(ecc_dbe_total) AS ecc_uncorrected",
                           "max(remapped_rows_correctable) AS remapped_correctable",
                           "max(remapped_rows_uncorrectable) AS remapped_uncorrectable",
                           "max(pcie_replays) AS pcie_replays",
                           "max(xid_last) AS xid_last"])],
                 w=24, h=7, unit="short",
                 description="As read at window end by the 10 s health sampler (NULL in other windows).")

    b.row("Who held it and what it cost")
    b.table("Allocations",
            [b.sql("SELECT start_time, end_time, owner_kind, owner, team, workload_kind, interruptible, source\n"
                   f"FROM allocations\nWHERE gpu_uuid = '$gpu' AND {alloc_overlap('start_time', 'end_time')}\n"
                   "ORDER BY start_time DESC")],
            w=12, h=8)
    b.table("Processes",
            [b.sql("SELECT pid, process_name, \"user\", max(pod) AS pod, max(namespace) AS namespace, max(job_id) AS job_id,\n"
                   "       min(time) AS first_seen, max(time) AS last_seen,\n"
                   "       max(fb_used_bytes) AS peak_memory, avg(CAST(sm_util AS DOUBLE)) AS mean_sm_util\n"
                   f"FROM gpu_processes\nWHERE {g}\nGROUP BY 1, 2, 3\nORDER BY last_seen DESC\nLIMIT 50")],
            w=12, h=8,
            overrides=[
                {"matcher": {"id": "byName", "options": "peak_memory"}, "properties": [{"id": "unit", "value": "bytes"}]},
                {"matcher": {"id": "byName", "options": "mean_sm_util"},
                 "properties": [{"id": "unit", "value": "percentunit"}]},
            ])
    b.timeseries("Cost per hour",
                 [b.sql("SELECT $__timeGroupAlias(hour, 1h),\n"
                        "       sum(CAST(cost_usd AS DOUBLE)) AS cost,\n"
                        "       sum(CAST(idle_cost_usd AS DOUBLE)) AS idle,\n"
                        "       sum(CAST(stranded_cost_usd AS DOUBLE)) AS stranded\n"
                        f"FROM gpu_cost_hourly\nWHERE gpu_uuid = '$gpu' AND {HOURS}\nGROUP BY 1\nORDER BY 1",
                        fmt="time_series")],
                 unit="currencyUSD", bars=True,
                 overrides=colour_overrides({"cost": "blue", "idle": "orange", "stranded": "red"}))
    b.timeseries("GPU time by state per hour",
                 [b.sql("SELECT $__timeGroupAlias(hour, 1h),\n"
                        "       sum(CAST(active_s AS DOUBLE)) / 60 AS active,\n"
                        "       sum(CAST(unallocated_busy_s AS DOUBLE)) / 60 AS unallocated_busy,\n"
                        "       sum(CAST(allocated_idle_s AS DOUBLE)) / 60 AS allocated_idle,\n"
                        "       sum(CAST(stranded_s AS DOUBLE)) / 60 AS stranded,\n"
                        "       sum(CAST(unallocated_idle_s AS DOUBLE)) / 60 AS unallocated_idle,\n"
                        "       sum(CAST(unknown_s AS DOUBLE)) / 60 AS unknown\n"
                        f"FROM gpu_cost_hourly\nWHERE gpu_uuid = '$gpu' AND {HOURS}\nGROUP BY 1\nORDER BY 1",
                        fmt="time_series")],
                 unit="m", bars=True, stack=True, overrides=colour_overrides(STATE_COLOURS))
    return b


BOARDS = {
    "prometheus/fleet-overview.json": prom_fleet_overview,
    "prometheus/idle-cost-by-team.json": prom_idle_cost_by_team,
    "prometheus/stranded-allocations.json": prom_stranded,
    "prometheus/gpu-detail.json": prom_gpu_detail,
    "postgres/fleet-overview.json": pg_fleet_overview,
    "postgres/idle-cost-by-team.json": pg_idle_cost_by_team,
    "postgres/stranded-allocations.json": pg_stranded,
    "postgres/gpu-detail.json": pg_gpu_detail,
}


def render(fn):
    return json.dumps(fn().to_json(), indent=2, ensure_ascii=False) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed dashboard differs from this script's output")
    ap.add_argument("--out", default=HERE, help="directory to write into (default: next to this script)")
    args = ap.parse_args()
    stale = []
    for rel, fn in BOARDS.items():
        text = render(fn)
        path = os.path.join(args.out, rel)
        if args.check:
            try:
                with open(path, encoding="utf-8") as fh:
                    if fh.read() != text:
                        stale.append(rel)
            except FileNotFoundError:
                stale.append(rel)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {path}")
    if stale:
        print("stale (run python3 dashboards/grafana/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
