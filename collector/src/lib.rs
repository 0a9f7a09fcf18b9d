//! Apron's collector write path: durable ingest of agents' Arrow batches into sorted,
//! day-partitioned Parquet, in the InfluxDB 3 / GreptimeDB shape.
//!
//! ```text
//!  ingest(table, agent, epoch, seq, body)
//!    │  decode_ipc + schema/row-limit check + exact conversion  ── refused: 400/413/422, nothing written
//!    │  dedup.reserve(agent, epoch, seq)                         ── seen: Ok(duplicate), nothing written
//!    ▼
//!  WAL append (group commit: one fsync for all queued appenders) ── failed: 507/503, log stays consistent
//!    ▼
//!  apply: dedup.commit + memtable.insert   ◄── start-up replay of the WAL takes this same path
//!    ▼                                         (after finishing an interrupted persist)
//!  memtable (Arrow, storage schema) ── view()/snapshot(): queryable at once
//!    ▼  persist: every 10 min or past a size (background thread), or persist_now()
//!  freeze (roll WAL) → Parquet temp files → checkpoint (commit) → rename → delete WAL segments
//! ```
//!
//! Modules:
//! - [`wal`]: segmented write-ahead log, CRC32C-framed records, group commit, torn-tail
//!   replay, a file seam for fault injection.
//! - [`dedup`]: seen (agent, epoch, sequence) as ranges per stream.
//! - [`ipc_guard`]: refuses IPC streams whose declared lengths would make Arrow
//!   allocate what the client chooses, before decoding.
//! - [`schema`]: the storage schema (measurements as exact decimals/integers) and the
//!   conversion from the wire schema.
//! - [`memtable`]: batches per table since the last persist.
//! - [`changes`]: per (table, day), the time span ingest wrote since a deriver last
//!   looked, so derived tables are recomputed from new data only.
//! - [`persist`]: sorted, encoded, day-partitioned Parquet files.
//! - [`checkpoint`]: the atomic record of what is persisted (WAL point, dedup, renames).
//! - [`store`]: the facade ([`Store`]) the HTTP layer calls; [`error`]: its errors with
//!   HTTP status classification; [`config`]: [`StoreConfig`].
//! - [`http`]: `POST /api/v1/ingest` (bearer token, protocol headers, body limit, the
//!   store in `spawn_blocking`, clock skew), as an `axum::Router` the server merges
//!   further routes into.
//!
//! On-disk layout under `data_dir`: `LOCK`, `checkpoint.json`, `wal/<seq>.wal`,
//! `<table>/date=YYYY-MM-DD/<uuid>.parquet`. See `README.md` for the formats.

pub mod changes;
pub mod checkpoint;
pub mod compact;
pub mod config;
pub mod dedup;
pub mod error;
mod fsutil;
pub mod http;
pub mod ipc_guard;
pub mod memtable;
pub mod persist;
pub mod schema;
pub mod storage;
pub mod store;
pub mod wal;

#[cfg(test)]
mod testdata;

pub use apron_common::wire::Table;
pub use config::StoreConfig;
pub use error::{IngestError, StoreError};
/// Replace a small file atomically and durably (temp, fsync, rename, fsync the directory):
/// the one implementation the server's state files, reports and endpoints use too.
pub use fsutil::write_atomic;
pub use memtable::TableStats;
pub use persist::{PersistedFile, ReadingEncoding};
pub use storage::{ObjectStoreConfig, Remote, Storage, StorageError};
pub use store::{
    Compacted, INGEST_PATIENCE, IngestOutcome, IngestRequest, MaintenanceReport, OpenReport, PersistReport, Store,
    TableView,
};
