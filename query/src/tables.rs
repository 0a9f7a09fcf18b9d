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

/// Every stored table of the SQL API (the derived ones are written by the server's
/// maintenance, in the same layout).
pub const TABLES: &[TableDef] = &[
    TableDef { name: "gpu_samples", time_column: "time", sort_order: &["gpu_uuid", "time"] },
    TableDef { name: "gpu_processes", time_column: "time", sort_order: &["gpu_uuid", "time"] },
    TableDef { name: "gpu_samples_1m", time_column: "time", sort_order: &["gpu_uuid", "time"] },
    TableDef { name: "allocations", time_column: "start_time", sort_order: &["gpu_uuid", "start_time"] },
    TableDef { name: "gpu_cost_hourly", time_column: "hour", sort_order: &["gpu_uuid", "hour"] },
];

/// The definition of `name`, if it is a table of the SQL API.
pub fn table_def(name: &str) -> Option<&'static TableDef> {
    TABLES.iter().find(|t| t.name == name)
}

#[cfg(test)]
mod tests {
    use apron_collector::Table;

    #[test]
    fn every_stored_table_is_served_with_its_own_time_column() {
        for t in Table::ALL {
            let def = super::table_def(t.name()).expect("listed");
            assert_eq!(def.time_column, t.time_column());
            assert_eq!(def.sort_order, ["gpu_uuid", t.time_column()]);
        }
    }
}
