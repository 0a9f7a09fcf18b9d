//! Live alerts: per-GPU run tracking, the alert conditions, exemptions and the
//! firing → resolved lifecycle. No I/O: the server feeds windows and delivers.
//!
//! ```text
//!  gpu_samples windows (per GPU, in time order, newer than the GPU's last)
//!    └─► Tracker::feed: current owner, idle run start, unowned busy run start,
//!                       zombie-memory run start, lost since, last XID
//!  Tracker::conditions(now, last process seen per GPU)
//!    ├─ stranded_allocation  one per allocation: its GPUs whose idle run ≥ stranded_after
//!    ├─ zombie_memory        idle, memory ≥ zombie_min_memory for zombie_after, no process
//!    ├─ unallocated_busy     busy for unallocated_busy_after with no holder
//!    ├─ gpu_lost             the agent reports GPU_IS_LOST
//!    └─ xid_error            an XID within xid_hold
//!  Exemptions::allows ─► Lifecycle::update ─► transitions (fired, resolved)
//! ```
//!
//! Idle runs use the classifier's own idle test ([`crate::classify::window_is_idle`]), its
//! `stranded_after` (team override, else workload kind, else default) and the one
//! idle-run rule ([`crate::idlerun`]: a gap of at most `max_idle_gap` inside a run of one
//! holder does not end it; busy time, another holder or a longer gap does), so an alert
//! and the hourly `stranded_s` agree on what is stranded and since when. A stranded
//! run's duration ends at its last idle window (gap seconds inside it count toward its
//! length, as in the ledger, never after it). A GPU whose newest window is older than
//! `stale_after` raises nothing (the agent may be down: that time is unknown, not idle).
//!
//! A condition is identified by its key (kind + allocation, or kind + GPU); while the key
//! keeps appearing the alert stays one firing alert (deduplicated) whose figures update;
//! when it stops, the alert resolves at the evaluation time. A key that comes back later
//! is a new alert with a new id.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::classify::{ClassifyConfig, Holder, Window, de_duration, duration_us, window_is_idle};
use crate::idlerun::{Activity, IdleRuns};
use crate::money::{Micros, cost_of_duration};

/// `[alerts.rules]`: the thresholds.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertRules {
    /// Zombie memory: at least this much framebuffer in use ...
    pub zombie_min_memory_bytes: i64,
    /// ... while idle with no process on the GPU, for this long.
    #[serde(deserialize_with = "de_duration")]
    pub zombie_after: Duration,
    /// Compute with no holder for this long.
    #[serde(deserialize_with = "de_duration")]
    pub unallocated_busy_after: Duration,
    /// How long an XID keeps its alert firing.
    #[serde(deserialize_with = "de_duration")]
    pub xid_hold: Duration,
    /// A GPU whose newest window is older than this raises nothing.
    #[serde(deserialize_with = "de_duration")]
    pub stale_after: Duration,
}

impl Default for AlertRules {
    fn default() -> Self {
        AlertRules {
            zombie_min_memory_bytes: 1 << 30,
            zombie_after: Duration::from_secs(300),
            unallocated_busy_after: Duration::from_secs(120),
            xid_hold: Duration::from_secs(600),
            stale_after: Duration::from_secs(120),
        }
    }
}

/// Who never gets an alert: teams, Unix users, allocations (owner strings), pod labels.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Exemptions {
    pub teams: BTreeSet<String>,
    pub users: BTreeSet<String>,
    pub owners: BTreeSet<String>,
    /// `key = "value"`; an allocation with any of these labels is exempt.
    pub labels: BTreeMap<String, String>,
}

impl Exemptions {
    /// Whether a condition may alert.
    pub fn allows(&self, c: &Condition) -> bool {
        let Some(o) = &c.holder else { return !self.teams.contains(&c.team) };
        !(self.teams.contains(&o.team)
            || o.user.as_ref().is_some_and(|u| self.users.contains(u))
            || self.owners.contains(&o.owner)
            || self.labels.iter().any(|(k, v)| o.labels.get(k) == Some(v)))
    }
}

/// An allocation as the alert rules see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderFacts {
    pub owner_kind: String,
    pub owner: String,
    pub team: String,
    pub workload_kind: Option<String>,
    pub user: Option<String>,
    pub labels: BTreeMap<String, String>,
}

impl From<&crate::owner::Resolved> for HolderFacts {
    fn from(r: &crate::owner::Resolved) -> HolderFacts {
        HolderFacts {
            owner_kind: r.owner.kind.as_str().to_owned(),
            owner: r.owner.owner.clone(),
            team: r.team.clone(),
            workload_kind: r.workload_kind.clone(),
            user: r.owner.user.clone(),
            labels: r.owner.label_map(),
        }
    }
}

impl HolderFacts {
    fn same(&self, o: &HolderFacts) -> bool {
        self.owner_kind == o.owner_kind && self.owner == o.owner
    }
}

/// A window's holder as the idle-run rule compares it: the same allocation (owner kind
/// and owner), or nobody.
#[derive(Clone, Debug)]
struct HolderKey(Option<Arc<HolderFacts>>);

impl PartialEq for HolderKey {
    fn eq(&self, o: &HolderKey) -> bool {
        match (&self.0, &o.0) {
            (Some(a), Some(b)) => a.same(b),
            (None, None) => true,
            _ => false,
        }
    }
}

/// A GPU's identity and price.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuMeta {
    pub gpu_uuid: String,
    pub host: String,
    pub cluster: Option<String>,
    pub gpu_model: String,
    pub usd_per_hour: Option<Micros>,
}

/// One `gpu_samples` window as the tracker needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub end_us: i64,
    pub window_us: i64,
    pub sm_active_max: Option<f64>,
    pub gpu_util_max: Option<f64>,
    pub fb_used_bytes: Option<i64>,
    pub lost: bool,
    pub xid: Option<i64>,
    pub holder: Option<Arc<HolderFacts>>,
}

#[derive(Clone, Debug)]
struct Track {
    meta: GpuMeta,
    /// Start of the first window fed: a run starting here may have started earlier.
    first_start_us: i64,
    last_end_us: i64,
    holder: Option<Arc<HolderFacts>>,
    /// Idle runs by the one rule ([`crate::idlerun`]).
    idle: IdleRuns<HolderKey>,
    unowned_busy_since: Option<i64>,
    zombie_since: Option<i64>,
    lost_since: Option<i64>,
    xid: Option<(i64, i64)>,
    fb_used_bytes: Option<i64>,
}

/// Per-GPU run state, fed window by window.
#[derive(Debug, Default)]
pub struct Tracker {
    gpus: BTreeMap<String, Track>,
}

/// The alert kinds.
pub const KINDS: [&str; 5] = ["stranded_allocation", "zombie_memory", "unallocated_busy", "gpu_lost", "xid_error"];

/// An alert condition holding now.
#[derive(Clone, Debug, PartialEq)]
pub struct Condition {
    pub key: String,
    pub kind: &'static str,
    pub severity: &'static str,
    pub team: String,
    pub cluster: Option<String>,
    pub hosts: Vec<String>,
    pub gpus: Vec<String>,
    pub holder: Option<Arc<HolderFacts>>,
    pub starts_at_us: i64,
    /// The longest idle (or busy, lost) run behind it.
    pub duration_us: i64,
    /// Dollars burnt so far: each affected GPU's run × its price (stranded, zombie).
    pub cost: Option<Micros>,
    pub gpus_affected: usize,
    pub gpus_total: usize,
    pub summary: String,
}

fn human(us: i64) -> String {
    let s = us.max(0) / 1_000_000;
    match (s / 3600, s % 3600 / 60) {
        (0, m) => format!("{m}m"),
        (h, m) => format!("{h}h{m:02}m"),
    }
}

impl Tracker {
    /// The newest window end seen for a GPU.
    pub fn last_end(&self, gpu_uuid: &str) -> Option<i64> {
        self.gpus.get(gpu_uuid).map(|t| t.last_end_us)
    }

    /// Feeds one window of one GPU; windows not newer than the GPU's last are ignored.
    pub fn feed(&mut self, meta: GpuMeta, s: &Sample, cfg: &ClassifyConfig) {
        let t = self.gpus.entry(meta.gpu_uuid.clone()).or_insert_with(|| Track {
            meta: meta.clone(),
            first_start_us: s.end_us - s.window_us,
            last_end_us: i64::MIN,
            holder: None,
            idle: IdleRuns::new(cfg.max_idle_gap_us()),
            unowned_busy_since: None,
            zombie_since: None,
            lost_since: None,
            xid: None,
            fb_used_bytes: None,
        });
        if s.end_us <= t.last_end_us {
            return;
        }
        t.meta = meta;
        let start = s.end_us - s.window_us;
        let contiguous = t.last_end_us != i64::MIN && start <= t.last_end_us + s.window_us;
        let same_holder = match (&t.holder, &s.holder) {
            (Some(a), Some(b)) => a.same(b),
            (None, None) => true,
            _ => false,
        };
        if !contiguous || !same_holder {
            t.unowned_busy_since = None;
        }
        t.holder = s.holder.clone();
        t.last_end_us = s.end_us;
        t.fb_used_bytes = s.fb_used_bytes;
        if s.lost {
            t.lost_since.get_or_insert(start);
        } else {
            t.lost_since = None;
        }
        if let Some(code) = s.xid {
            t.xid = Some((code, s.end_us));
        }
        let w = Window {
            end_us: s.end_us,
            window_us: s.window_us,
            sm_active_max: s.sm_active_max,
            gpu_util_max: s.gpu_util_max,
            sm_active_mean: None,
            holder: None,
        };
        let activity = Activity::from_idle(if s.lost { None } else { window_is_idle(&w, cfg) });
        // The one idle-run rule; a zombie run lives inside the idle run it began in.
        if t.idle.feed(start, s.end_us, HolderKey(s.holder.clone()), activity).is_some() {
            t.zombie_since = None;
        }
        match activity {
            Activity::Idle => {
                t.unowned_busy_since = None;
                if t.fb_used_bytes.is_some() {
                    t.zombie_since.get_or_insert(start);
                }
            }
            Activity::Busy => {
                t.zombie_since = None;
                if t.holder.is_none() {
                    t.unowned_busy_since.get_or_insert(start);
                } else {
                    t.unowned_busy_since = None;
                }
            }
            // Gap time inside a run (or the end of one, above).
            Activity::NoSignal => t.unowned_busy_since = None,
        }
        if t.idle.open().is_none() {
            t.zombie_since = None;
        }
    }

    /// Idle runs that begin at the first window fed, so may be older than what was fed:
    /// `(gpu, holder, that start)`. The caller looks further back ([`Tracker::extend_idle`]).
    pub fn open_runs(&self) -> Vec<(String, Option<Arc<HolderFacts>>, i64)> {
        self.gpus
            .values()
            .filter_map(|t| {
                let run = t.idle.current(t.last_end_us).filter(|r| r.start_us == t.first_start_us)?;
                Some((t.meta.gpu_uuid.clone(), run.holder.0.clone(), t.first_start_us))
            })
            .collect()
    }

    /// Moves the start of an idle run that begins at the first window fed to `start_us`
    /// (the end of the last earlier window that was busy or someone else's).
    pub fn extend_idle(&mut self, gpu_uuid: &str, start_us: i64) {
        let Some(t) = self.gpus.get_mut(gpu_uuid) else { return };
        if t.idle.open().is_some_and(|r| r.start_us == t.first_start_us) && start_us < t.first_start_us {
            t.idle.extend_start(start_us);
            if t.zombie_since == Some(t.first_start_us) {
                t.zombie_since = Some(start_us);
            }
        }
    }

    /// Forgets GPUs not heard from for `older_than` µs before `now_us`.
    pub fn prune(&mut self, now_us: i64, older_than_us: i64) {
        self.gpus.retain(|_, t| now_us - t.last_end_us <= older_than_us);
    }

    /// The conditions holding at `now_us`. `last_process_us`: the newest `gpu_processes`
    /// sample per GPU.
    pub fn conditions(
        &self,
        now_us: i64,
        classify: &ClassifyConfig,
        rules: &AlertRules,
        last_process_us: &BTreeMap<String, i64>,
    ) -> Vec<Condition> {
        let stale = duration_us(rules.stale_after);
        let mut out = Vec::new();
        // Allocation → (its fresh GPUs, the stranded ones with their run starts).
        type Held<'a> = (Arc<HolderFacts>, Vec<&'a Track>, Vec<(&'a Track, i64, i64)>);
        let mut allocations: BTreeMap<(String, String), Held<'_>> = BTreeMap::new();
        for t in self.gpus.values() {
            if now_us - t.last_end_us > stale {
                continue;
            }
            let m = &t.meta;
            let one = |kind: &'static str, severity, since: i64, summary: String, cost: Option<Micros>| Condition {
                key: format!("{kind}|{}", m.gpu_uuid),
                kind,
                severity,
                team: t.holder.as_ref().map_or_else(|| crate::classify::UNALLOCATED.to_owned(), |h| h.team.clone()),
                cluster: m.cluster.clone(),
                hosts: vec![m.host.clone()],
                gpus: vec![m.gpu_uuid.clone()],
                holder: t.holder.clone(),
                starts_at_us: since,
                duration_us: t.last_end_us - since,
                cost,
                gpus_affected: 1,
                gpus_total: 1,
                summary,
            };
            if let Some(h) = &t.holder {
                let e = allocations
                    .entry((h.owner_kind.clone(), h.owner.clone()))
                    .or_insert_with(|| (h.clone(), Vec::new(), Vec::new()));
                e.1.push(t);
                let after = classify
                    .stranded_after_us(&Holder { team: h.team.clone(), workload_kind: h.workload_kind.clone() });
                // The run by the one rule, stranded as the ledger prices it: its length up
                // to its last idle window reaches `stranded_after`.
                if let Some(run) = t.idle.current(t.last_end_us)
                    && run.holder.0.as_ref().is_some_and(|rh| rh.same(h))
                    && run.len_us() >= after
                {
                    e.2.push((t, run.start_us, run.end_us));
                }
            }
            if let (Some(since), Some(fb)) = (t.zombie_since, t.fb_used_bytes)
                && t.idle.current(t.last_end_us).is_some()
                && fb >= rules.zombie_min_memory_bytes
                && t.last_end_us - since >= duration_us(rules.zombie_after)
                && last_process_us.get(&m.gpu_uuid).is_none_or(|p| *p < since)
            {
                let cost = m.usd_per_hour.and_then(|p| cost_of_duration(p, t.last_end_us - since).ok());
                let summary = format!(
                    "{} on {} holds {:.1} GiB with no compute and no process for {}",
                    m.gpu_uuid,
                    m.host,
                    fb as f64 / (1u64 << 30) as f64,
                    human(t.last_end_us - since)
                );
                out.push(one("zombie_memory", "warning", since, summary, cost));
            }
            if let Some(since) = t.unowned_busy_since
                && t.holder.is_none()
                && t.last_end_us - since >= duration_us(rules.unallocated_busy_after)
            {
                let summary = format!(
                    "{} on {} computes with no allocation any scheduler knows, for {}",
                    m.gpu_uuid,
                    m.host,
                    human(t.last_end_us - since)
                );
                out.push(one("unallocated_busy", "warning", since, summary, None));
            }
            if let Some(since) = t.lost_since {
                let summary = format!(
                    "{} on {} is lost (fell off the bus) since {}",
                    m.gpu_uuid,
                    m.host,
                    human(t.last_end_us - since)
                );
                out.push(one("gpu_lost", "critical", since, summary, None));
            }
            if let Some((code, at)) = t.xid
                && now_us - at <= duration_us(rules.xid_hold)
            {
                let mut c =
                    one("xid_error", "critical", at, format!("{} on {} reported XID {code}", m.gpu_uuid, m.host), None);
                c.key = format!("xid_error|{}|{code}", m.gpu_uuid);
                c.duration_us = 0;
                out.push(c);
            }
        }
        for (holder, held, stranded) in allocations.into_values() {
            if stranded.is_empty() {
                continue;
            }
            let since = stranded.iter().map(|(_, s, _)| *s).min().unwrap_or(now_us);
            let longest = stranded.iter().map(|(_, s, e)| e - s).max().unwrap_or(0);
            let mut cost: Option<Micros> = None;
            for (t, s, e) in &stranded {
                if let Some(c) = t.meta.usd_per_hour.and_then(|p| cost_of_duration(p, e - s).ok()) {
                    cost = Some(cost.unwrap_or(Micros::ZERO).checked_add(c).unwrap_or(c));
                }
            }
            let hosts: BTreeSet<String> = stranded.iter().map(|(t, ..)| t.meta.host.clone()).collect();
            let summary = format!(
                "{} {} (team {}) has {} of {} GPUs idle for {}",
                holder.owner_kind,
                holder.owner,
                holder.team,
                stranded.len(),
                held.len(),
                human(longest)
            );
            out.push(Condition {
                key: format!("stranded_allocation|{}|{}", holder.owner_kind, holder.owner),
                kind: "stranded_allocation",
                severity: "warning",
                team: holder.team.clone(),
                cluster: stranded.first().and_then(|(t, ..)| t.meta.cluster.clone()),
                hosts: hosts.into_iter().collect(),
                gpus: stranded.iter().map(|(t, ..)| t.meta.gpu_uuid.clone()).collect(),
                holder: Some(holder.clone()),
                starts_at_us: since,
                duration_us: longest,
                cost,
                gpus_affected: stranded.len(),
                gpus_total: held.len(),
                summary,
            });
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }
}

/// Firing or resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlertState {
    Firing,
    Resolved,
}

/// An alert episode, as listed and stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AlertRecord {
    pub id: String,
    pub key: String,
    pub kind: String,
    pub severity: String,
    pub state: AlertState,
    pub team: String,
    pub cluster: Option<String>,
    pub host: String,
    pub gpu_uuids: Vec<String>,
    pub owner_kind: Option<String>,
    pub owner: Option<String>,
    pub workload_kind: Option<String>,
    pub starts_at_us: i64,
    pub ends_at_us: Option<i64>,
    pub updated_at_us: i64,
    pub idle_s: f64,
    /// Micro-dollars burnt so far (stranded, zombie memory).
    pub cost_micros: Option<i64>,
    pub gpus_stranded: usize,
    pub gpus_total: usize,
    pub summary: String,
    /// Delivery bookkeeping, per receiver name: what was last delivered (`firing` or
    /// `resolved`).
    #[serde(default)]
    pub delivered: BTreeMap<String, AlertState>,
}

impl AlertRecord {
    fn from_condition(c: &Condition, now_us: i64) -> AlertRecord {
        let id = {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in c.key.bytes().chain(c.starts_at_us.to_le_bytes()) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
            format!("{h:016x}")
        };
        let mut r = AlertRecord {
            id,
            key: c.key.clone(),
            kind: c.kind.to_owned(),
            severity: c.severity.to_owned(),
            state: AlertState::Firing,
            team: String::new(),
            cluster: None,
            host: String::new(),
            gpu_uuids: Vec::new(),
            owner_kind: None,
            owner: None,
            workload_kind: None,
            starts_at_us: c.starts_at_us,
            ends_at_us: None,
            updated_at_us: now_us,
            idle_s: 0.0,
            cost_micros: None,
            gpus_stranded: 0,
            gpus_total: 0,
            summary: String::new(),
            delivered: BTreeMap::new(),
        };
        r.refresh(c, now_us);
        r
    }

    fn refresh(&mut self, c: &Condition, now_us: i64) {
        self.team = c.team.clone();
        self.cluster = c.cluster.clone();
        self.host = c.hosts.join(",");
        self.gpu_uuids = c.gpus.clone();
        self.owner_kind = c.holder.as_ref().map(|h| h.owner_kind.clone());
        self.owner = c.holder.as_ref().map(|h| h.owner.clone());
        self.workload_kind = c.holder.as_ref().and_then(|h| h.workload_kind.clone());
        self.updated_at_us = now_us;
        self.idle_s = c.duration_us as f64 / 1e6;
        self.cost_micros = c.cost.map(|m| m.0);
        self.gpus_stranded = c.gpus_affected;
        self.gpus_total = c.gpus_total;
        self.summary = c.summary.clone();
    }
}

/// A change the receivers hear about.
#[derive(Clone, Debug, PartialEq)]
pub enum Transition {
    Fired(String),
    Resolved(String),
}

/// Every alert episode, firing and recently resolved.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Lifecycle {
    pub alerts: Vec<AlertRecord>,
}

impl Lifecycle {
    /// Applies the conditions holding at `now_us`; resolved alerts older than
    /// `keep_resolved_us` are dropped.
    pub fn update(&mut self, conditions: &[Condition], now_us: i64, keep_resolved_us: i64) -> Vec<Transition> {
        let mut changes = Vec::new();
        let current: BTreeMap<&str, &Condition> = conditions.iter().map(|c| (c.key.as_str(), c)).collect();
        for a in self.alerts.iter_mut().filter(|a| a.state == AlertState::Firing) {
            match current.get(a.key.as_str()) {
                Some(c) => a.refresh(c, now_us),
                None => {
                    a.state = AlertState::Resolved;
                    a.ends_at_us = Some(now_us);
                    a.updated_at_us = now_us;
                    changes.push(Transition::Resolved(a.id.clone()));
                }
            }
        }
        let firing: BTreeSet<String> =
            self.alerts.iter().filter(|a| a.state == AlertState::Firing).map(|a| a.key.clone()).collect();
        for c in conditions {
            if !firing.contains(&c.key) {
                let r = AlertRecord::from_condition(c, now_us);
                changes.push(Transition::Fired(r.id.clone()));
                self.alerts.push(r);
            }
        }
        self.alerts.retain(|a| a.ends_at_us.is_none_or(|e| now_us - e <= keep_resolved_us));
        changes
    }

    pub fn get(&self, id: &str) -> Option<&AlertRecord> {
        self.alerts.iter().find(|a| a.id == id)
    }

    pub fn firing(&self) -> impl Iterator<Item = &AlertRecord> {
        self.alerts.iter().filter(|a| a.state == AlertState::Firing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000;
    const MIN: i64 = 60 * S;

    fn meta(uuid: &str) -> GpuMeta {
        GpuMeta {
            gpu_uuid: uuid.into(),
            host: "n0".into(),
            cluster: None,
            gpu_model: "NVIDIA H100 80GB HBM3".into(),
            usd_per_hour: Some(Micros(3_600_000)),
        }
    }

    fn holder(owner: &str, team: &str, kind: Option<&str>) -> Arc<HolderFacts> {
        Arc::new(HolderFacts {
            owner_kind: "pod".into(),
            owner: owner.into(),
            team: team.into(),
            workload_kind: kind.map(str::to_owned),
            user: Some("alice".into()),
            labels: BTreeMap::from([("app".to_owned(), "jupyter".to_owned())]),
        })
    }

    /// Feeds 10 s windows from `from` (exclusive) to `to` (inclusive).
    #[allow(clippy::too_many_arguments)]
    fn run(
        tr: &mut Tracker,
        uuid: &str,
        from: i64,
        to: i64,
        sm: f64,
        fb: i64,
        h: Option<Arc<HolderFacts>>,
        cfg: &ClassifyConfig,
    ) {
        let mut t = from + 10 * S;
        while t <= to {
            let s = Sample {
                end_us: t,
                window_us: 10 * S,
                sm_active_max: Some(sm),
                gpu_util_max: None,
                fb_used_bytes: Some(fb),
                lost: false,
                xid: None,
                holder: h.clone(),
            };
            tr.feed(meta(uuid), &s, cfg);
            t += 10 * S;
        }
    }

    #[test]
    fn stranded_allocation_fires_at_stranded_after_counts_gpus_and_resolves_on_work() {
        let cfg = ClassifyConfig::default();
        let rules = AlertRules::default();
        let nb = holder("data-science/jupyter-alice", "data-science", Some("notebook"));
        let mut tr = Tracker::default();
        // Two GPUs of one notebook pod: busy until 10 min, then GPU a idle; b busy.
        run(&mut tr, "GPU-a", 0, 10 * MIN, 0.5, 30 << 30, Some(nb.clone()), &cfg);
        run(&mut tr, "GPU-b", 0, 10 * MIN, 0.5, 30 << 30, Some(nb.clone()), &cfg);
        run(&mut tr, "GPU-a", 10 * MIN, 39 * MIN + 50 * S, 0.0, 30 << 30, Some(nb.clone()), &cfg);
        run(&mut tr, "GPU-b", 10 * MIN, 39 * MIN + 50 * S, 0.5, 30 << 30, Some(nb.clone()), &cfg);
        let procs = BTreeMap::from([("GPU-a".to_owned(), 39 * MIN)]);
        // 29 min 50 s idle: not yet.
        assert!(tr.conditions(40 * MIN, &cfg, &rules, &procs).is_empty());
        run(&mut tr, "GPU-a", 39 * MIN + 50 * S, 40 * MIN, 0.0, 30 << 30, Some(nb.clone()), &cfg);
        run(&mut tr, "GPU-b", 39 * MIN + 50 * S, 40 * MIN, 0.5, 30 << 30, Some(nb.clone()), &cfg);
        let c = tr.conditions(40 * MIN, &cfg, &rules, &procs);
        assert_eq!(c.len(), 1);
        let c = &c[0];
        assert_eq!((c.kind, c.gpus_affected, c.gpus_total, c.starts_at_us), ("stranded_allocation", 1, 2, 10 * MIN));
        assert_eq!(c.duration_us, 30 * MIN);
        // 30 min at $3.60/h = $1.80 burnt.
        assert_eq!(c.cost, Some(Micros(1_800_000)));
        assert!(c.summary.contains("1 of 2 GPUs idle for 30m"), "{}", c.summary);
        let mut life = Lifecycle::default();
        let t = life.update(std::slice::from_ref(c), 40 * MIN, 3_600 * S);
        assert!(matches!(t.as_slice(), [Transition::Fired(_)]));
        // Same condition later: one alert, figures updated, no new transition.
        run(&mut tr, "GPU-a", 40 * MIN, 45 * MIN, 0.0, 30 << 30, Some(nb.clone()), &cfg);
        run(&mut tr, "GPU-b", 40 * MIN, 45 * MIN, 0.5, 30 << 30, Some(nb.clone()), &cfg);
        let c2 = tr.conditions(45 * MIN, &cfg, &rules, &procs);
        assert!(life.update(&c2, 45 * MIN, 3_600 * S).is_empty());
        assert_eq!(life.alerts.len(), 1);
        assert_eq!(life.alerts[0].idle_s, 35.0 * 60.0);
        // Work resumes: resolved at the evaluation.
        run(&mut tr, "GPU-a", 45 * MIN, 46 * MIN, 0.4, 30 << 30, Some(nb.clone()), &cfg);
        let c3 = tr.conditions(46 * MIN, &cfg, &rules, &procs);
        assert!(c3.is_empty());
        assert!(matches!(life.update(&c3, 46 * MIN, 3_600 * S).as_slice(), [Transition::Resolved(_)]));
        assert_eq!((life.alerts[0].state, life.alerts[0].ends_at_us), (AlertState::Resolved, Some(46 * MIN)));
        // Exempt by label, user, team or owner.
        let ex = Exemptions { labels: BTreeMap::from([("app".into(), "jupyter".into())]), ..Exemptions::default() };
        assert!(!ex.allows(c));
        assert!(!Exemptions { users: BTreeSet::from(["alice".into()]), ..Exemptions::default() }.allows(c));
        assert!(Exemptions { teams: BTreeSet::from(["research".into()]), ..Exemptions::default() }.allows(c));
    }

    #[test]
    fn kind_override_and_gaps_end_runs() {
        let mut cfg = ClassifyConfig::default();
        cfg.stranded_after_kind.insert("notebook".into(), Duration::from_secs(600));
        // A gap longer than `max_idle_gap` ends a run: with the bound at 1 min, the 2-minute
        // gap below does (at the default 2 min it would not: a gap of exactly the bound
        // continues the run, see `a_short_gap_keeps_the_run_a_long_one_ends_it`).
        cfg.max_idle_gap = Duration::from_secs(60);
        let rules = AlertRules::default();
        let nb = holder("nb", "ds", Some("notebook"));
        let mut tr = Tracker::default();
        run(&mut tr, "GPU-a", 0, 5 * MIN, 0.0, 1 << 30, Some(nb.clone()), &cfg);
        // A 2-minute gap: the run restarts at 7 min.
        run(&mut tr, "GPU-a", 7 * MIN, 16 * MIN, 0.0, 1 << 30, Some(nb.clone()), &cfg);
        assert!(
            tr.conditions(16 * MIN, &cfg, &rules, &BTreeMap::new()).iter().all(|c| c.kind != "stranded_allocation")
        );
        run(&mut tr, "GPU-a", 16 * MIN, 17 * MIN, 0.0, 1 << 30, Some(nb), &cfg);
        let c = tr.conditions(17 * MIN, &cfg, &rules, &BTreeMap::new());
        let s = c.iter().find(|c| c.kind == "stranded_allocation").expect("stranded at 10 min");
        assert_eq!(s.starts_at_us, 7 * MIN);
        // Stale data raises nothing.
        assert!(tr.conditions(30 * MIN, &cfg, &rules, &BTreeMap::new()).is_empty());
        // A run that began before the first window fed can be moved back.
        let mut fresh = Tracker::default();
        run(&mut fresh, "GPU-a", 20 * MIN, 25 * MIN, 0.0, 1 << 30, Some(holder("nb", "ds", Some("notebook"))), &cfg);
        assert_eq!(fresh.open_runs().iter().map(|r| r.2).collect::<Vec<_>>(), [20 * MIN]);
        fresh.extend_idle("GPU-a", 2 * MIN);
        let c = fresh.conditions(25 * MIN, &cfg, &rules, &BTreeMap::new());
        let s = c.iter().find(|c| c.kind == "stranded_allocation").expect("stranded since 2 min");
        assert_eq!((s.starts_at_us, s.duration_us), (2 * MIN, 23 * MIN));
        assert!(fresh.open_runs().is_empty());
    }

    /// The `stranded_allocation` condition at `now` (data never stale here).
    fn stranded_of(tr: &Tracker, now: i64, cfg: &ClassifyConfig) -> Option<Condition> {
        let rules = AlertRules { stale_after: Duration::from_secs(24 * 3600), ..AlertRules::default() };
        tr.conditions(now, cfg, &rules, &BTreeMap::new()).into_iter().find(|c| c.kind == "stranded_allocation")
    }

    #[test]
    fn a_short_gap_keeps_the_run_a_long_one_ends_it() {
        const H: i64 = 60 * MIN;
        let cfg = ClassifyConfig::default();
        assert_eq!(cfg.max_idle_gap, Duration::from_secs(120));
        let nb = holder("data-science/jupyter-erik", "data-science", Some("notebook"));
        let other = holder("data-science/jupyter-zoe", "data-science", Some("notebook"));
        let mut tr = Tracker::default();
        // Idle for 10 h, then the agent restarts: 40 s without windows, then idle again.
        run(&mut tr, "GPU-a", 0, 10 * H, 0.0, 0, Some(nb.clone()), &cfg);
        let c = stranded_of(&tr, 10 * H, &cfg).expect("stranded");
        assert_eq!((c.starts_at_us, c.duration_us), (0, 10 * H));
        run(&mut tr, "GPU-a", 10 * H + 40 * S, 10 * H + 5 * MIN, 0.0, 0, Some(nb.clone()), &cfg);
        // The run continues from its start: 10 h 5 min long (the 40 s gap inside it), the
        // same alert (same key and start, hence the same id).
        let c = stranded_of(&tr, 10 * H + 5 * MIN, &cfg).expect("still stranded");
        assert_eq!((c.starts_at_us, c.duration_us), (0, 10 * H + 5 * MIN));
        assert!(c.summary.contains("1 of 1 GPUs idle for 10h05m"), "{}", c.summary);
        // Signal-less windows of the holder are gap time too: 2 min of them (the bound)
        // keep the run, whose idle duration stops at its last idle window meanwhile.
        let mut t = 10 * H + 5 * MIN;
        while t < 10 * H + 7 * MIN {
            t += 10 * S;
            let s = Sample {
                end_us: t,
                window_us: 10 * S,
                sm_active_max: None,
                gpu_util_max: None,
                fb_used_bytes: None,
                lost: false,
                xid: None,
                holder: Some(nb.clone()),
            };
            tr.feed(meta("GPU-a"), &s, &cfg);
        }
        let c = stranded_of(&tr, 10 * H + 7 * MIN, &cfg).expect("gap within the bound");
        assert_eq!((c.starts_at_us, c.duration_us), (0, 10 * H + 5 * MIN));
        run(&mut tr, "GPU-a", 10 * H + 7 * MIN, 10 * H + 8 * MIN, 0.0, 0, Some(nb.clone()), &cfg);
        assert_eq!(stranded_of(&tr, 10 * H + 8 * MIN, &cfg).map(|c| c.starts_at_us), Some(0));
        // A gap longer than the bound (2 min 10 s): a new run from 10:10:10, not stranded.
        run(&mut tr, "GPU-a", 10 * H + 10 * MIN + 10 * S, 10 * H + 15 * MIN, 0.0, 0, Some(nb.clone()), &cfg);
        assert_eq!(stranded_of(&tr, 10 * H + 15 * MIN, &cfg), None);
        // A holder change ends a run whatever the gap: another pod's idle windows after a
        // 10 s gap start their own run; back to the first pod, a run again from scratch.
        let mut tr = Tracker::default();
        run(&mut tr, "GPU-b", 0, H, 0.0, 0, Some(nb.clone()), &cfg);
        run(&mut tr, "GPU-b", H + 10 * S, H + 5 * MIN, 0.0, 0, Some(other.clone()), &cfg);
        assert_eq!(stranded_of(&tr, H + 5 * MIN, &cfg), None);
        run(&mut tr, "GPU-b", H + 5 * MIN, H + 6 * MIN, 0.0, 0, Some(nb), &cfg);
        assert_eq!(stranded_of(&tr, H + 6 * MIN, &cfg), None);
    }

    #[test]
    fn zombie_unallocated_busy_lost_and_xid() {
        let cfg = ClassifyConfig::default();
        let rules = AlertRules::default();
        let mut tr = Tracker::default();
        // GPU z: unallocated, idle, 4 GiB held for 6 min, no process → zombie after 5 min.
        run(&mut tr, "GPU-z", 0, 6 * MIN, 0.0, 4 << 30, None, &cfg);
        // GPU u: busy with nobody holding it for 3 min → unallocated busy after 2 min.
        run(&mut tr, "GPU-u", 3 * MIN, 6 * MIN, 0.7, 2 << 30, None, &cfg);
        // GPU l: lost in its last window, after an XID 79.
        run(&mut tr, "GPU-l", 5 * MIN, 5 * MIN + 40 * S, 0.5, 1 << 30, None, &cfg);
        let lost = |end: i64, xid: Option<i64>| Sample {
            end_us: end,
            window_us: 10 * S,
            sm_active_max: None,
            gpu_util_max: None,
            fb_used_bytes: None,
            lost: xid.is_none(),
            xid,
            holder: None,
        };
        tr.feed(meta("GPU-l"), &lost(5 * MIN + 50 * S, Some(79)), &cfg);
        tr.feed(meta("GPU-l"), &lost(6 * MIN, None), &cfg);
        let c = tr.conditions(6 * MIN, &cfg, &rules, &BTreeMap::new());
        let kinds: Vec<(&str, &str)> = c.iter().map(|c| (c.kind, c.gpus[0].as_str())).collect();
        assert_eq!(
            kinds,
            [("gpu_lost", "GPU-l"), ("unallocated_busy", "GPU-u"), ("xid_error", "GPU-l"), ("zombie_memory", "GPU-z")]
        );
        let z = c.iter().find(|c| c.kind == "zombie_memory").expect("zombie");
        // 6 min at $3.60/h = $0.36.
        assert_eq!((z.duration_us, z.cost), (6 * MIN, Some(Micros(360_000))));
        // A process seen on z since its run began: not a zombie.
        let procs = BTreeMap::from([("GPU-z".to_owned(), 5 * MIN)]);
        assert!(tr.conditions(6 * MIN, &cfg, &rules, &procs).iter().all(|c| c.kind != "zombie_memory"));
        // The XID holds for 10 minutes after it was seen.
        let later = tr.conditions(
            5 * MIN + 50 * S + 10 * MIN + S,
            &cfg,
            &AlertRules { stale_after: Duration::from_secs(3600), ..rules },
            &BTreeMap::new(),
        );
        assert!(later.iter().all(|c| c.kind != "xid_error"));
    }
}
