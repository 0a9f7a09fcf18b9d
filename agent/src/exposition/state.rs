//! What `/metrics` shows: the agent's state, updated by the sampling side as windows
//! close and read by scrapes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use apron_common::{Field, GpuIdentity, GpuWindow, ProcessRow, UnixMicros};

use crate::sampler::{FieldGroup, IssueKind, Slot};

/// Who holds a GPU, for the `pod`/`namespace`/`container` labels.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnerLabels {
    pub pod: Option<String>,
    pub namespace: Option<String>,
    pub container: Option<String>,
}

/// Per-GPU state kept between windows.
#[derive(Debug, Default)]
pub struct GpuState {
    pub last: Option<GpuWindow>,
    /// ∫ gpu_util dt over windows with a utilisation reading.
    pub busy_seconds: f64,
    pub sm_active_seconds: f64,
    pub tensor_active_seconds: f64,
    /// Window seconds with a reading of each signal, so rate(busy)/rate(observed) is the
    /// exact utilisation over known time even across gaps.
    pub util_observed_seconds: f64,
    pub sm_observed_seconds: f64,
    pub lost: bool,
    /// The last XID ever seen (dcgm-exporter's semantics for DCGM_FI_DEV_XID_ERRORS).
    pub xid_last: Option<f64>,
    pub owner: OwnerLabels,
    /// Per field (by index): the end of the window its reading in `last` came from.
    pub field_time_us: Vec<i64>,
}

/// Bookkeeping per sampler.
#[derive(Debug, Default, Clone)]
pub struct SamplerStats {
    pub interval_seconds: f64,
    pub runs: u64,
    pub errors: u64,
    pub duration_seconds_total: f64,
    pub last_duration_seconds: f64,
    pub up: bool,
}

/// Batches and rows a table has had acknowledged.
#[derive(Debug, Default, Clone, Copy)]
pub struct TableShipped {
    pub batches: u64,
    pub rows: u64,
}

/// Shipping to the collector (`crate::ship`); present only when a collector is set.
#[derive(Debug, Default, Clone)]
pub struct ShipStats {
    /// Acknowledged batches and rows per table.
    pub sent: BTreeMap<&'static str, TableShipped>,
    /// Acknowledgements that said the collector already had the batch.
    pub duplicates: u64,
    /// Attempts that failed and will be retried.
    pub retries: u64,
    /// Batches the collector refused for good (moved to `rejected/`).
    pub rejected_batches: u64,
    /// Batches written to the spool.
    pub spooled_batches: u64,
    pub spool_bytes: u64,
    pub spool_files: u64,
    /// Batches (rows) dropped because the spool was full or could not be written.
    pub spool_dropped_batches: u64,
    pub spool_dropped_rows: u64,
    /// Unix seconds of the last acknowledgement.
    pub last_success_time: Option<f64>,
    /// Seconds from request to acknowledgement, summed over acknowledged batches.
    pub ack_seconds: f64,
    /// Whether the collector took the last request (2xx or a final 4xx), `None` before
    /// the first; false while requests fail and are retried.
    pub collector_up: Option<bool>,
}

/// Everything `/metrics` shows. Updated by the sampling side, read by scrapes.
#[derive(Debug, Default)]
pub struct AgentState {
    pub source: &'static str,
    pub driver_version: Option<String>,
    pub start_time: f64,
    pub gpus: Vec<(GpuIdentity, GpuState)>,
    pub samplers: BTreeMap<FieldGroup, SamplerStats>,
    /// (sampler, call, GPU slot) found unsupported; each is logged once.
    pub unsupported: BTreeSet<(FieldGroup, &'static str, Option<Slot>)>,
    pub processes: Vec<ProcessRow>,
    pub windows_total: u64,
    pub late_readings: u64,
    pub dropped_windows: u64,
    pub ship: Option<ShipStats>,
    /// Pod labels from the API server; `None` where the agent does not ask it.
    #[cfg(feature = "kubernetes")]
    pub kubernetes: Option<crate::attribution::kube::KubeStats>,
}

impl AgentState {
    /// The GPUs that answer (not lost), with their state.
    pub(super) fn live_gpus(&self) -> impl Iterator<Item = &(GpuIdentity, GpuState)> {
        self.gpus.iter().filter(|(_, s)| !s.lost)
    }

    pub fn new(source: &'static str, driver_version: Option<String>, inventory: &[GpuIdentity]) -> Self {
        Self {
            source,
            driver_version,
            start_time: UnixMicros::now().as_secs_f64(),
            gpus: inventory.iter().map(|g| (g.clone(), GpuState::default())).collect(),
            ..Self::default()
        }
    }

    /// Folds closed windows into the per-GPU state and counters.
    pub fn apply_windows(&mut self, rows: &[GpuWindow]) {
        for row in rows {
            self.windows_total += 1;
            let Some((_, st)) = self.gpus.iter_mut().find(|(g, _)| g.gpu_uuid == row.gpu.gpu_uuid) else {
                continue;
            };
            let w = row.window_secs();
            st.lost = row.lost;
            if let Some(u) = row.value(Field::GpuUtil) {
                st.busy_seconds += u * w;
                st.util_observed_seconds += w;
            }
            if let Some(s) = row.value(Field::SmActive) {
                st.sm_active_seconds += s * w;
                st.sm_observed_seconds += w;
            }
            if let Some(t) = row.value(Field::TensorActive) {
                st.tensor_active_seconds += t * w;
            }
            if let Some(x) = row.value(Field::XidLast) {
                st.xid_last = Some(x);
            }
            // A field whose sampler runs slower than the window (health every 10 s, say)
            // keeps its last reading on /metrics for up to a minute, so the family does
            // not vanish between its readings and Prometheus never sees it flap to stale.
            let mut merged = row.clone();
            st.field_time_us.resize(merged.fields.len(), i64::MIN);
            for (i, f) in merged.fields.iter_mut().enumerate() {
                if f.is_some() {
                    st.field_time_us[i] = row.time.0;
                } else if !row.lost && row.time.0.saturating_sub(st.field_time_us[i]) <= HOLD_LAST_US {
                    *f = st.last.as_ref().and_then(|p| p.fields.get(i).cloned().flatten());
                }
            }
            st.last = Some(merged);
        }
    }

    pub fn record_issue(&mut self, group: FieldGroup, what: &'static str, kind: IssueKind, slot: Option<Slot>) -> bool {
        kind == IssueKind::Unsupported && self.unsupported.insert((group, what, slot))
    }
}

/// How long a slow sampler's last reading stays on /metrics without a new one.
const HOLD_LAST_US: i64 = 60_000_000;

/// Shared handle to the agent state.
#[derive(Clone, Debug, Default)]
pub struct SharedState(Arc<Mutex<AgentState>>);

impl SharedState {
    pub fn new(state: AgentState) -> Self {
        Self(Arc::new(Mutex::new(state)))
    }

    /// A poisoned lock only means a panic elsewhere mid-update; the numbers are still
    /// the best we have, so keep serving them.
    pub fn lock(&self) -> MutexGuard<'_, AgentState> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
