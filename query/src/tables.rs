//! The tables the SQL session serves: the one place to add a table.
//!
//! A table is registered when its [`crate::TableSource`] knows it (has a schema), so
//! listing `gpu_samples_1m`, `allocations` or `gpu_cost_hourly` here is all the query
//! layer needs once the collector stores them: the provider reads their memtable batches
//! and `<table>/date=YYYY-MM-DD/*.parquet` files the same way.

/// How one stored table is laid out, for the scan's tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableDef {
    /// The SQL name (the contract's), also the directory under the data dir.
    pub name: &'static str,
    /// The Timestamp(µs, UTC) column the `date=` day partitions are cut by (UTC day of
    /// its value).
    /// A filter on it prunes whole partition directories and memtable batches.
    pub time_column: &'static str,
    /// The order rows have inside each Parquet file (all ascending), declared to
    /// DataFusion so it can skip or shorten sorts and use ordered aggregation.
    pub sort_order: &'static [&'static str],
}

/// Every table of the SQL API. Later tables (`gpu_samples_1m` on `time`, `allocations`
/// on `start_time`, `gpu_cost_hourly` on `hour`) are one line each.
pub const TABLES: &[TableDef] = &[
    TableDef { name: "gpu_samples", time_column: "time", sort_order: &["gpu_uuid", "time"] },
    TableDef { name: "gpu_processes", time_column: "time", sort_order: &["gpu_uuid", "time"] },
];

/// The definition of `name`, if it is a table of the SQL API.
pub fn table_def(name: &str) -> Option<&'static TableDef> {
    TABLES.iter().find(|t| t.name == name)
}
