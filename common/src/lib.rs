//! Apron's shared vocabulary.
//!
//! Every part of Apron — the node agent, the collector, the query layer — speaks about
//! the same things: a GPU identified by its UUID, a point in time in UTC microseconds,
//! the measurement fields of the `gpu_samples` table and the one-row-per-GPU-per-window
//! record that agents produce. They live here so that names and units are written down
//! exactly once.
//!
//! - [`ids`]: newtypes for identities (GPU UUID, host, cluster) and time ([`UnixMicros`]).
//! - [`field`]: the catalogue of measurement fields ([`Field`]), with their `gpu_samples`
//!   column names, base units and device resolution.
//! - [`window`]: [`GpuWindow`] (a `gpu_samples` row) and [`ProcessRow`] (a
//!   `gpu_processes` row), the records an agent emits.
//!
//! - [`wire`] (feature `arrow`): the Arrow schemas of the shipped tables and the IPC
//!   encoding agents send to `POST /api/v1/ingest`.
//! - [`duration`], [`size`]: how config files spell durations (humantime text) and byte
//!   sizes (`"512MiB"`), one deserializer each for every crate's config.
//!
//! Serving HTTP (TLS, the accept loop, web-config) is `apron-http`'s.
//!
//! This crate is deliberately dependency-light: the agent links it and must stay small.

pub mod chain;
pub mod duration;
pub mod field;
pub mod ids;
pub mod size;
pub mod window;
#[cfg(feature = "arrow")]
pub mod wire;

pub use chain::error_chain;
pub use field::{Aggregation, Field, FieldKind};
pub use ids::{
    ClusterName, GpuUuid, HostName, ShardName, TeamName, UnixMicros, civil_from_days, date_string, days_from_civil,
    parse_date,
};
pub use window::{FieldStats, GpuHolder, GpuIdentity, GpuWindow, HolderKind, ProcessRow};
