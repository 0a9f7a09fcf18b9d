#!/usr/bin/env python3
"""Checks of rendered Kubernetes manifests that a per-object schema cannot make.

    check_manifests.py split RENDERED OUT_DIR
        Writes OUT_DIR/core.yaml (built-in kinds, for kubernetes-validate) and
        OUT_DIR/custom.yaml (the custom resources). A custom kind without a schema in
        this directory fails: kubernetes-validate only warns about such a kind.

    check_manifests.py custom OUT_DIR/custom.yaml
        Validates every custom resource against its strict schema here
        (servicemonitor.schema.json).

    check_manifests.py refs RENDERED [--external-secret NAME=KEY,KEY ...]
        Cross-object references and the security floor: selectors that select,
        named ports that exist, volumes, ConfigMaps and Secrets that are there (or are
        the documented external Secret, with exactly the documented keys), service
        accounts and roles, and no container that may escalate, write its root
        filesystem or a host path other than the agent's spool.

Exits 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema
import yaml

HERE = Path(__file__).resolve().parent

# Built-in API groups kubernetes-validate has schemas for; anything else is custom.
CORE_GROUPS = {"", "apps", "batch", "rbac.authorization.k8s.io", "policy", "networking.k8s.io",
               "autoscaling", "scheduling.k8s.io", "storage.k8s.io"}
CUSTOM_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.schema.json"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass",
                  "StorageClass", "CustomResourceDefinition"}
WORKLOADS = {"DaemonSet", "StatefulSet", "Deployment"}
# The only host path a container may write: the agent's spool survives restarts there.
WRITABLE_HOST_PATHS = ("/var/lib/apron-agent",)


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def group(obj: dict) -> str:
    api = obj.get("apiVersion", "")
    return api.split("/")[0] if "/" in api else ""


def ident(obj: dict) -> str:
    meta = obj.get("metadata", {})
    ns = meta.get("namespace")
    return f"{obj.get('kind')}/{ns + '/' if ns else ''}{meta.get('name')}"


def cmd_split(args: argparse.Namespace) -> list[str]:
    problems = []
    core, custom = [], []
    for obj in load(args.rendered):
        if group(obj) in CORE_GROUPS:
            core.append(obj)
        elif (obj.get("apiVersion"), obj.get("kind")) in CUSTOM_SCHEMAS:
            custom.append(obj)
        else:
            problems.append(f"{ident(obj)}: no schema for {obj.get('apiVersion')} {obj.get('kind')}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "core.yaml").write_text(yaml.safe_dump_all(core, sort_keys=False), encoding="utf-8")
    (out / "custom.yaml").write_text(yaml.safe_dump_all(custom, sort_keys=False), encoding="utf-8")
    if not core:
        problems.append(f"{args.rendered}: no objects")
    return problems


def cmd_custom(args: argparse.Namespace) -> list[str]:
    problems = []
    for obj in load(args.custom):
        name = CUSTOM_SCHEMAS[(obj["apiVersion"], obj["kind"])]
        schema = json.loads((HERE / name).read_text(encoding="utf-8"))
        validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
        for err in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
            where = ".".join(str(p) for p in err.absolute_path) or "(root)"
            problems.append(f"{ident(obj)}: {where}: {err.message}")
    return problems


def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class Refs:
    def __init__(self, objs: list[dict], external: dict[str, set[str]]):
        self.objs = objs
        self.external = external
        self.external_keys_used: dict[str, set[str]] = {name: set() for name in external}
        self.problems: list[str] = []
        self.by_kind: dict[str, dict[tuple[str, str], dict]] = {}
        for obj in objs:
            meta = obj.get("metadata", {})
            key = (meta.get("namespace", ""), meta.get("name", ""))
            table = self.by_kind.setdefault(obj["kind"], {})
            if key in table:
                self.problems.append(f"{ident(obj)}: defined twice")
            table[key] = obj

    def get(self, kind: str, ns: str, name: str) -> dict | None:
        return self.by_kind.get(kind, {}).get((ns, name))

    def bad(self, obj: dict, text: str) -> None:
        self.problems.append(f"{ident(obj)}: {text}")

    def secret_keys(self, obj: dict, ns: str, name: str, keys: set[str], what: str) -> None:
        """A Secret (or the documented external one) must hold these keys."""
        secret = self.get("Secret", ns, name)
        if secret is not None:
            have = set(secret.get("data", {}) or {}) | set(secret.get("stringData", {}) or {})
            for key in sorted(keys - have):
                self.bad(obj, f"{what}: Secret {name} has no key {key!r}")
        elif name in self.external:
            self.external_keys_used[name] |= keys
        else:
            self.bad(obj, f"{what}: Secret {name} is neither rendered nor the documented external Secret")

    def check(self) -> list[str]:
        names = {(o.get("metadata", {}).get("namespace", "")) for o in self.objs
                 if o["kind"] not in CLUSTER_SCOPED}
        if len(names) != 1:
            self.problems.append(f"namespaced objects are spread over {sorted(names)}; expected one namespace")
        namespaces = {n for (_, n) in self.by_kind.get("Namespace", {})}
        for ns in names - namespaces:
            self.problems.append(f"namespace {ns!r} is used but not rendered")
        for obj in self.objs:
            kind = obj["kind"]
            if kind in WORKLOADS:
                self.workload(obj)
            elif kind == "Service":
                self.service(obj)
            elif kind == "ServiceMonitor":
                self.service_monitor(obj)
            elif kind in ("ClusterRoleBinding", "RoleBinding"):
                self.binding(obj)
        for name, keys in sorted(self.external.items()):
            used = self.external_keys_used.get(name, set())
            # Rendered (an overlay generates it): its keys were checked like any other.
            if used and used != keys:
                self.problems.append(
                    f"external Secret {name}: the manifests use keys {sorted(used)}, the documented keys are {sorted(keys)}")
        return self.problems

    def workload(self, obj: dict) -> None:
        ns = obj["metadata"].get("namespace", "")
        spec = obj["spec"]
        tpl = spec["template"]
        labels = tpl.get("metadata", {}).get("labels", {})
        if not matches(spec.get("selector", {}).get("matchLabels", {}), labels):
            self.bad(obj, "selector.matchLabels does not select its own pod template")
        pod = tpl["spec"]
        sa = pod.get("serviceAccountName")
        if sa and self.get("ServiceAccount", ns, sa) is None:
            self.bad(obj, f"serviceAccountName {sa} is not rendered")
        if obj["kind"] == "StatefulSet" and self.get("Service", ns, spec.get("serviceName", "")) is None:
            self.bad(obj, f"serviceName {spec.get('serviceName')!r} is not a rendered Service")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for claim in spec.get("volumeClaimTemplates", []):
            volumes[claim["metadata"]["name"]] = {"name": claim["metadata"]["name"], "persistentVolumeClaim": {}}
        for v in volumes.values():
            if "configMap" in v:
                cm = self.get("ConfigMap", ns, v["configMap"]["name"])
                if cm is None:
                    self.bad(obj, f"volume {v['name']}: ConfigMap {v['configMap']['name']} is not rendered")
                else:
                    for item in v["configMap"].get("items", []):
                        if item["key"] not in cm.get("data", {}):
                            self.bad(obj, f"volume {v['name']}: ConfigMap has no key {item['key']!r}")
            if "secret" in v:
                keys = {i["key"] for i in v["secret"].get("items", [])}
                self.secret_keys(obj, ns, v["secret"]["secretName"], keys, f"volume {v['name']}")
        for c in pod.get("initContainers", []) + pod["containers"]:
            self.container(obj, ns, c, volumes)

    def container(self, obj: dict, ns: str, c: dict, volumes: dict) -> None:
        where = f"container {c['name']}"
        ports = {p.get("name") for p in c.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            for action in ("httpGet", "tcpSocket"):
                target = c.get(probe, {}).get(action)
                if target and isinstance(target["port"], str) and target["port"] not in ports:
                    self.bad(obj, f"{where}: {probe} names port {target['port']!r}, which it does not declare")
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                self.secret_keys(obj, ns, ref["name"], {ref["key"]}, f"{where} env {env['name']}")
        for m in c.get("volumeMounts", []):
            v = volumes.get(m["name"])
            if v is None:
                self.bad(obj, f"{where}: mount {m['mountPath']} names no volume {m['name']!r}")
                continue
            if "subPath" in m and "configMap" in v:
                cm = self.get("ConfigMap", ns, v["configMap"]["name"])
                if cm is not None and m["subPath"] not in cm.get("data", {}):
                    self.bad(obj, f"{where}: mount {m['mountPath']}: ConfigMap has no key {m['subPath']!r}")
            host = v.get("hostPath", {}).get("path")
            if host and not m.get("readOnly") and not host.startswith(WRITABLE_HOST_PATHS):
                self.bad(obj, f"{where}: host path {host} is mounted writable")
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            self.bad(obj, f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            self.bad(obj, f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("readOnlyRootFilesystem") is not True:
            self.bad(obj, f"{where}: readOnlyRootFilesystem is not true")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            self.bad(obj, f"{where}: capabilities are not dropped (drop: [ALL])")

    def pods_selected(self, ns: str, selector: dict) -> list[dict]:
        return [c for kind in WORKLOADS for (n, _), w in self.by_kind.get(kind, {}).items() if n == ns
                if matches(selector, w["spec"]["template"].get("metadata", {}).get("labels", {}))
                for c in w["spec"]["template"]["spec"]["containers"]]

    def service(self, obj: dict) -> None:
        ns = obj["metadata"].get("namespace", "")
        containers = self.pods_selected(ns, obj["spec"].get("selector", {}))
        if not containers:
            self.bad(obj, "selector selects no rendered pod template")
            return
        names = {p.get("name") for c in containers for p in c.get("ports", [])}
        numbers = {p["containerPort"] for c in containers for p in c.get("ports", [])}
        for p in obj["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            if target not in (names if isinstance(target, str) else numbers):
                self.bad(obj, f"port {p.get('name')}: targetPort {target!r} is not a port of the selected pods")

    def service_monitor(self, obj: dict) -> None:
        ns = obj["metadata"].get("namespace", "")
        selector = obj["spec"].get("selector", {}).get("matchLabels", {})
        services = [s for (n, _), s in self.by_kind.get("Service", {}).items()
                    if n == ns and matches(selector, s["metadata"].get("labels", {}))]
        if not services:
            self.bad(obj, "selector selects no rendered Service")
            return
        ports = {p.get("name") for s in services for p in s["spec"]["ports"]}
        for e in obj["spec"]["endpoints"]:
            if e.get("port") not in ports:
                self.bad(obj, f"endpoint port {e.get('port')!r} is not a port of the selected Services")

    def binding(self, obj: dict) -> None:
        ref = obj["roleRef"]
        ns = obj["metadata"].get("namespace", "")
        role = self.get(ref["kind"], "" if ref["kind"] == "ClusterRole" else ns, ref["name"])
        if role is None:
            self.bad(obj, f"roleRef {ref['kind']}/{ref['name']} is not rendered")
        for s in obj.get("subjects", []):
            if s["kind"] == "ServiceAccount" and self.get("ServiceAccount", s.get("namespace", ns), s["name"]) is None:
                self.bad(obj, f"subject ServiceAccount {s.get('namespace')}/{s['name']} is not rendered")


def cmd_refs(args: argparse.Namespace) -> list[str]:
    external = {}
    for spec in args.external_secret:
        name, _, keys = spec.partition("=")
        external[name] = {k for k in keys.split(",") if k}
    return Refs(load(args.rendered), external).check()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("split")
    p.add_argument("rendered")
    p.add_argument("out_dir")
    p.set_defaults(fn=cmd_split)
    p = sub.add_parser("custom")
    p.add_argument("custom")
    p.set_defaults(fn=cmd_custom)
    p = sub.add_parser("refs")
    p.add_argument("rendered")
    p.add_argument("--external-secret", action="append", default=[], metavar="NAME=KEY,KEY")
    p.set_defaults(fn=cmd_refs)
    args = parser.parse_args()
    problems = args.fn(args)
    for line in problems:
        print(f"FAIL {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
