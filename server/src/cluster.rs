//! `[cluster]`: more than one machine over one object-store lake.
//!
//! ```text
//!  agents ──► apron serve (role collector, shard rack-a) ─┐ PUT <table>/date=D/shard=rack-a/…
//!  agents ──► apron serve (role collector, shard rack-b) ─┤ PUT _apron/shards/<shard>.json
//!                                                         ▼   (every heartbeat)
//!                                          S3-compatible bucket (the lake)
//!                                                         ▲ LIST/GET, cached (apron_query::lake)
//!  clients ─► load balancer ─► apron serve (role query) ×N ┘ SQL, pg, reports, alerts,
//!                                                            recommendations over every shard
//! ```
//!
//! A collector is today's server with its files under its shard's Hive partition: it
//! ingests, persists (at least every `freshness`), compacts and expires only its own
//! files, and computes its shard's derived tables and alerts. Every `heartbeat` it
//! writes its status ([`apron_query::ShardStatus`]: the time, the rollup's record of
//! what each stored day read, its alerts). A query server ingests nothing and writes
//! nothing to the lake; it reads every shard's files, merges the statuses, and says
//! which shards are stale (no status for `stale_after`: a collector that is down or cut
//! off from the bucket) in every answer that spans shards.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use apron_collector::{Store, StoreConfig};
use apron_common::{ShardName, UnixMicros};
use apron_cost::alert::{AlertRecord, AlertState};
use apron_query::lake::{ShardStatus, StatusFile, status_key};
use apron_query::rollup::{RollupState, STATE_FILE};
use apron_query::{LakeConfig, LakeSource};
use serde::Deserialize;

use crate::config::ConfigError;

/// `[cluster]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// `collector` or `query`; no section: one server holding everything.
    pub role: Option<String>,
    /// The collector's shard (its files' `shard=` partition).
    pub shard: Option<String>,
    /// Collector: persist at least this often (caps `[storage] persist_interval`), so
    /// acknowledged rows reach the lake within it. Default 30 s.
    pub freshness: Option<String>,
    /// Collector: its status is written this often. Default 10 s.
    pub heartbeat: Option<String>,
    /// Query: the shards' statuses (their files) are re-read this often. Default 5 s.
    pub refresh: Option<String>,
    /// Query: a shard whose status is older is reported stale. Default 60 s.
    pub stale_after: Option<String>,
}

/// What this server is in a cluster.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum Cluster {
    /// No `[cluster]`: one server holds everything.
    #[default]
    Single,
    /// Ingests and stores one shard of the lake.
    Collector { shard: ShardName, heartbeat: Duration },
    /// Answers over the whole lake; ingests nothing.
    Query { lake: LakeConfig },
}

fn invalid(key: &str, value: &str, expected: &str) -> ConfigError {
    ConfigError::Invalid { key: format!("cluster.{key}"), value: value.to_owned(), expected: expected.to_owned() }
}

fn duration(key: &str, v: Option<&str>, default: Duration) -> Result<Duration, ConfigError> {
    let Some(text) = v else { return Ok(default) };
    let d = humantime::parse_duration(text)
        .map_err(|e| invalid(key, text, &format!("a duration such as \"10s\" ({e})")))?;
    if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&d) {
        return Err(invalid(key, text, "between 1s and 1h"));
    }
    Ok(d)
}

impl ClusterSection {
    /// Validates the section against `[storage]` and sets what the role implies there
    /// (the collector's shard and its persist interval).
    pub fn resolve(self, store: &mut StoreConfig) -> Result<Cluster, ConfigError> {
        let Some(role) = self.role.as_deref() else {
            if let Some(s) = &self.shard {
                return Err(invalid("shard", s, "with role = \"collector\" (a shard is a collector's)"));
            }
            return Ok(Cluster::Single);
        };
        let lake_missing = || invalid("role", role, "with [storage.object_store]: a cluster shares one bucket");
        match role {
            "collector" => {
                let Some(object_store) = store.object_store.as_mut() else { return Err(lake_missing()) };
                let text = self.shard.as_deref().unwrap_or_default();
                let shard = ShardName::new(text).map_err(|e| invalid("shard", text, &e.to_string()))?;
                let freshness = duration("freshness", self.freshness.as_deref(), Duration::from_secs(30))?;
                let heartbeat = duration("heartbeat", self.heartbeat.as_deref(), Duration::from_secs(10))?;
                for (key, v) in [("refresh", &self.refresh), ("stale_after", &self.stale_after)] {
                    if let Some(v) = v {
                        return Err(invalid(key, v, "only with role = \"query\""));
                    }
                }
                object_store.shard = Some(shard.clone());
                store.persist_interval = store.persist_interval.min(freshness);
                Ok(Cluster::Collector { shard, heartbeat })
            }
            "query" => {
                if store.object_store.is_none() {
                    return Err(lake_missing());
                }
                if let Some(s) = &self.shard {
                    return Err(invalid("shard", s, "no shard: a query server reads every shard"));
                }
                for (key, v) in [("freshness", &self.freshness), ("heartbeat", &self.heartbeat)] {
                    if let Some(v) = v {
                        return Err(invalid(key, v, "only with role = \"collector\""));
                    }
                }
                let d = LakeConfig::default();
                let lake = LakeConfig {
                    refresh: duration("refresh", self.refresh.as_deref(), d.refresh)?,
                    stale_after: duration("stale_after", self.stale_after.as_deref(), d.stale_after)?,
                };
                if lake.stale_after <= lake.refresh {
                    return Err(invalid(
                        "stale_after",
                        self.stale_after.as_deref().unwrap_or_default(),
                        "longer than cluster.refresh",
                    ));
                }
                Ok(Cluster::Query { lake })
            }
            other => Err(invalid("role", other, "\"collector\" or \"query\"")),
        }
    }
}

/// A collector's status writer: every `interval`, [`ShardStatus`] to
/// `_apron/shards/<shard>.json` in the lake.
pub struct Heartbeat {
    pub store: Arc<Store>,
    pub shard: ShardName,
    pub interval: Duration,
    pub alerts: Option<Arc<crate::alerts::Alerts>>,
    /// This collector's identity ([`Heartbeat::claim`]).
    pub instance: String,
}

/// `<data_dir>/shard.json`: which shard a collector's data directory belongs to, and
/// the collector's identity in its statuses.
const CLAIM_FILE: &str = "shard.json";

#[derive(Debug, serde::Serialize, Deserialize)]
struct Claim {
    shard: String,
    instance: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("the store has no object store: a shard needs one")]
    NoLake,
    #[error("writing the shard status: {0}")]
    Lake(#[from] apron_collector::StorageError),
    #[error("reading the rollup state: {0}")]
    Rollup(#[from] apron_query::rollup::StateError),
    #[error("the status task: {0}")]
    Task(#[from] tokio::task::JoinError),
    #[error(
        "this data directory holds shard {held:?}, not {configured:?}: its WAL and files belong to that shard (use another data_dir for another shard)"
    )]
    OtherShard { held: String, configured: String },
    #[error(
        "shard {shard:?} is served by another collector (its status was written {ago_s} s ago): give each collector its own [cluster] shard"
    )]
    Taken { shard: String, ago_s: i64 },
    #[error("{path}: {detail}")]
    ClaimFile { path: String, detail: String },
}

impl Heartbeat {
    /// Before a collector serves: its data directory must be new or hold this shard
    /// (`shard.json`, written on first use with a new identity), and no other collector
    /// may have written this shard's status within three heartbeats. Returns the
    /// identity. A restart of the same collector (same directory) passes at once.
    pub fn claim(store: &Store, shard: &ShardName, heartbeat: Duration) -> Result<String, ClusterError> {
        let path = store.data_dir().join(CLAIM_FILE);
        let bad = |detail: String| ClusterError::ClaimFile { path: path.display().to_string(), detail };
        let claim = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<Claim>(&bytes).map_err(|e| bad(e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let c = Claim { shard: shard.to_string(), instance: uuid::Uuid::now_v7().to_string() };
                crate::statefile::save_json(&path, &c).map_err(|e| bad(e.to_string()))?;
                c
            }
            Err(e) => return Err(bad(e.to_string())),
        };
        if claim.shard != shard.as_str() {
            return Err(ClusterError::OtherShard { held: claim.shard, configured: shard.to_string() });
        }
        let lake = store.lake().ok_or(ClusterError::NoLake)?;
        if let Some(bytes) = lake.get_small(&status_key(shard.as_str()))?
            && let Ok(other) = serde_json::from_slice::<ShardStatus>(&bytes)
        {
            let ago_us = UnixMicros::now().0.saturating_sub(other.updated_us);
            let window = i64::try_from(heartbeat.as_micros()).unwrap_or(i64::MAX).saturating_mul(3);
            if other.instance != claim.instance && ago_us < window {
                return Err(ClusterError::Taken { shard: shard.to_string(), ago_s: ago_us / 1_000_000 });
            }
        }
        Ok(claim.instance)
    }

    /// The status now.
    pub fn status(&self) -> Result<ShardStatus, ClusterError> {
        let path = self.store.data_dir().join(STATE_FILE);
        let rollup = path.exists().then(|| RollupState::load(&path)).transpose()?;
        let alerts = self
            .alerts
            .as_ref()
            .map(|a| a.list().iter().filter_map(|r| serde_json::to_value(r).ok()).collect())
            .unwrap_or_default();
        let memtable_rows = [apron_collector::Table::GpuSamples, apron_collector::Table::GpuProcesses]
            .iter()
            .map(|t| self.store.memtable_stats(*t).rows as u64)
            .sum();
        let files = apron_collector::Table::ALL
            .iter()
            .flat_map(|t| self.store.files(*t))
            .map(|f| StatusFile {
                table: f.table.name().to_owned(),
                date: f.date,
                key: f.path.to_string_lossy().into_owned(),
                bytes: f.bytes,
            })
            .collect();
        Ok(ShardStatus {
            shard: self.shard.to_string(),
            instance: self.instance.clone(),
            updated_us: UnixMicros::now().0,
            memtable_rows,
            files,
            rollup,
            alerts,
        })
    }

    /// Writes the status once (blocking: the lake's client waits on its own runtime).
    pub fn publish_once(&self) -> Result<(), ClusterError> {
        let lake = self.store.lake().ok_or(ClusterError::NoLake)?;
        let status = self.status()?;
        let bytes = serde_json::to_vec(&status).unwrap_or_default();
        lake.put_small(&status_key(self.shard.as_str()), bytes)?;
        Ok(())
    }

    pub async fn run(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            let me = self.clone();
            let r = tokio::task::spawn_blocking(move || me.publish_once())
                .await
                .map_err(ClusterError::from)
                .and_then(|r| r);
            match r {
                Ok(()) if failing => {
                    tracing::info!(shard = %self.shard, "the shard status reaches the lake again");
                    failing = false;
                }
                Ok(()) => {}
                Err(e) => {
                    // Query servers then report this shard stale; its data stays safe in
                    // its WAL and goes up with the next persist that works.
                    if !failing {
                        tracing::warn!(shard = %self.shard, error = %e, "cannot write the shard status");
                    }
                    failing = true;
                }
            }
        }
    }
}

/// The query server's view of every shard's alerts, refreshed from the statuses.
#[derive(Default)]
pub struct FleetAlerts {
    alerts: Mutex<Vec<(String, AlertRecord)>>,
}

impl FleetAlerts {
    /// Every shard's episodes with their shard, firing first, then newest first.
    pub fn list(&self) -> Vec<(String, AlertRecord)> {
        self.alerts.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Re-reads the statuses (blocking) and refreshes the `alerts` table and the alert
    /// families of `/metrics`.
    pub fn refresh(
        &self,
        lake: &LakeSource,
        table: &apron_query::SnapshotTable,
        metrics: &crate::alerts::AlertMetrics,
    ) -> Result<(), apron_query::SourceError> {
        let mut all: Vec<(String, AlertRecord)> = lake
            .alerts()?
            .into_iter()
            .filter_map(|(shard, v)| serde_json::from_value::<AlertRecord>(v).ok().map(|a| (shard, a)))
            .collect();
        all.sort_by(|(_, a), (_, b)| {
            (a.state != AlertState::Firing)
                .cmp(&(b.state != AlertState::Firing))
                .then(b.starts_at_us.cmp(&a.starts_at_us))
        });
        let records: Vec<AlertRecord> = all.iter().map(|(_, a)| a.clone()).collect();
        crate::alerts::publish_records(&records, table, metrics);
        *self.alerts.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = all;
        Ok(())
    }

    /// Refreshes every `every` until dropped.
    pub async fn run(
        self: Arc<Self>,
        lake: Arc<LakeSource>,
        table: Arc<apron_query::SnapshotTable>,
        metrics: crate::alerts::AlertMetrics,
        every: Duration,
    ) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let (me, lake, table, metrics) = (self.clone(), lake.clone(), table.clone(), metrics.clone());
            match tokio::task::spawn_blocking(move || me.refresh(&lake, &table, &metrics)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot read the shards' alerts"),
                Err(e) => tracing::warn!(error = %e, "the shards' alerts task"),
            }
        }
    }
}

/// `GET /api/v1/cluster`: every shard and whether it is stale (a query server), or
/// this collector's shard.
pub fn router(view: ClusterView, access: crate::access::Access) -> axum::Router {
    axum::Router::new().route("/api/v1/cluster", axum::routing::get(cluster_route)).with_state((view, access))
}

/// What `GET /api/v1/cluster` describes.
#[derive(Clone)]
pub enum ClusterView {
    Single,
    Collector(ShardName),
    /// The lake, and the engine (its queries on Ballista, when `[query.ballista]`).
    Query(Arc<LakeSource>, Arc<apron_query::QueryEngine>),
}

async fn cluster_route(
    axum::extract::State((view, access)): axum::extract::State<(ClusterView, crate::access::Access)>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if let Err(answer) = access.read_scope(&headers) {
        return *answer;
    }
    match view {
        ClusterView::Single => axum::Json(serde_json::json!({ "role": "single" })).into_response(),
        ClusterView::Collector(shard) => {
            axum::Json(serde_json::json!({ "role": "collector", "shard": shard.as_str() })).into_response()
        }
        ClusterView::Query(lake, engine) => match tokio::task::spawn_blocking(move || lake.shards()).await {
            Ok(Ok(shards)) => {
                let stale: Vec<&str> = shards.iter().filter(|s| s.stale).map(|s| s.shard.as_str()).collect();
                let mut body = serde_json::json!({ "role": "query", "shards": shards, "stale_shards": stale });
                if let (Some(b), Some((answered, failed))) = (&engine.config().ballista, engine.cluster_stats()) {
                    body["ballista"] = serde_json::json!({
                        "scheduler": b.scheduler,
                        "min_scan_bytes": b.min_scan_bytes,
                        "fallback_local": b.fallback_local,
                        "answered": answered,
                        "failed": failed,
                    });
                }
                axum::Json(body).into_response()
            }
            Ok(Err(e)) => apron_collector::http::json_error(
                axum::http::StatusCode::BAD_GATEWAY,
                "lake_unavailable",
                // Never the bucket's URL (docs/security.md).
                &apron_query::error::redact_paths(&format!("cannot read the shards' statuses: {e}")),
            ),
            Err(e) => apron_collector::http::json_error(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                &e.to_string(),
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(text: &str) -> ClusterSection {
        toml::from_str(text).expect("section")
    }

    fn lake_store() -> StoreConfig {
        StoreConfig {
            object_store: Some(apron_collector::ObjectStoreConfig { url: "s3://b".into(), ..Default::default() }),
            ..StoreConfig::default()
        }
    }

    #[test]
    fn a_collector_names_its_shard_and_persists_within_the_freshness() {
        let mut store = lake_store();
        let c =
            section("role = \"collector\"\nshard = \"rack-a\"\nfreshness = \"20s\"").resolve(&mut store).expect("ok");
        assert_eq!(
            c,
            Cluster::Collector { shard: ShardName::new("rack-a").expect("s"), heartbeat: Duration::from_secs(10) }
        );
        assert_eq!(store.persist_interval, Duration::from_secs(20));
        assert_eq!(store.object_store.as_ref().and_then(|o| o.shard.as_ref()).map(ShardName::as_str), Some("rack-a"));
    }

    #[test]
    fn bad_cluster_sections_say_what_is_wrong() {
        let cases = [
            ("role = \"collector\"", "cluster.shard"),
            ("role = \"collector\"\nshard = \"a/b\"", "cluster.shard"),
            ("role = \"query\"\nshard = \"a\"", "cluster.shard"),
            ("shard = \"a\"", "cluster.shard"),
            ("role = \"leader\"", "cluster.role"),
            ("role = \"query\"\nrefresh = \"0s\"", "cluster.refresh"),
            ("role = \"query\"\nrefresh = \"10s\"\nstale_after = \"5s\"", "cluster.stale_after"),
            ("role = \"collector\"\nshard = \"a\"\nstale_after = \"1m\"", "cluster.stale_after"),
            ("role = \"query\"\nheartbeat = \"1m\"", "cluster.heartbeat"),
        ];
        for (text, key) in cases {
            let e = section(text).resolve(&mut lake_store()).expect_err(text);
            assert!(e.to_string().contains(key), "{text}: {e}");
        }
        let e = section("role = \"query\"").resolve(&mut StoreConfig::default()).expect_err("no lake");
        assert!(e.to_string().contains("object_store"), "{e}");
        assert_eq!(section("").resolve(&mut StoreConfig::default()).expect("single"), Cluster::Single);
        assert!(matches!(section("role = \"query\"").resolve(&mut lake_store()), Ok(Cluster::Query { .. })));
    }
}
