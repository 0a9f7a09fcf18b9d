//! Apron's query layer: a read-only DataFusion 55 SQL session over the collector's tables
//! (Parquet files + memtable, so a sample is queryable as soon as it is ingested), with
//! results in the contract's formats.
//!
//! ```text
//!  TableSource (Store: memtable + Parquet │ DirectorySource: Parquet of a data dir)
//!    ▼  snapshot(table) per scan: batches + files, no row in both
//!  ApronTable providers (one per entry of tables::TABLES)
//!    time filters → skip date= partitions and memtable batches; time and gpu_uuid
//!    bounds → skip memtable rows
//!    Parquet scan (predicate + page index pushdown, declared (gpu_uuid, time) order)
//!    UNION memtable scan
//!    ▼
//!  SessionContext (information_schema, no table factories, no spill)
//!    ▼  parse → readonly::check_statement → plan → readonly::check_plan (+ SQLOptions)
//!  execution under limits: query slot (Busy), timeout, per-query memory pool, row cap
//!    (here, or on a Ballista cluster: distributed)
//!    ▼
//!  QueryResult → render: JSON {"columns","rows"} │ CSV │ Arrow IPC stream │ Parquet │ table
//! ```
//!
//! ```no_run
//! # async fn f(store: std::sync::Arc<apron_collector::Store>) -> Result<(), apron_query::QueryError> {
//! use apron_query::{Format, QueryConfig, QueryEngine};
//! let engine = QueryEngine::new(QueryConfig::default(), store)?;
//! let result = engine.execute("SELECT gpu_uuid, avg(gpu_util) FROM gpu_samples GROUP BY 1").await?;
//! let body = result.render(Format::Json).expect("render");
//! # Ok(()) }
//! ```
//!
//! Modules: [`engine`] (session, limits, execution), [`source`] (where data comes from),
//! [`provider`] (the table scan), [`prune`] (time bounds of filters), [`readonly`] (what
//! is refused and how), [`render`] (result formats), [`error`] (errors → HTTP status),
//! [`config`], [`tables`] (the table list), [`scope`] (team scoping, scope first),
//! [`lake`] (the whole lake of a sharded cluster, for the query role), [`distributed`]
//! (a query server's heavy scans on a Ballista cluster: the codec, what goes),
//! [`guard`] (statement shape limits and capped string functions), [`sketch`] (mergeable
//! quantile sketches: `ddsketch`, `ddsketch_merge`, `ddsketch_quantile`).

pub mod config;
pub mod distributed;
pub mod engine;
pub mod error;
pub mod funcs;
pub mod guard;
pub mod lake;
pub mod pgcompat;
pub mod provider;
pub mod prune;
pub mod readonly;
pub mod render;
pub mod rollup;
pub mod scope;
pub mod sketch;
pub mod slots;
pub mod snapshot;
pub mod source;
pub mod tables;

pub use config::QueryConfig;
pub use distributed::BallistaConfig;
pub use engine::{Described, QueryEngine, Request};
pub use error::QueryError;
pub use lake::{LakeConfig, LakeSource, ShardStatus, ShardView};
pub use render::{Format, QueryResult, RenderError};
pub use scope::Scope;
pub use snapshot::SnapshotTable;
pub use source::{DataFile, DirectorySource, SourceError, TableSnapshot, TableSource};
pub use tables::{TABLES, TableDef};
