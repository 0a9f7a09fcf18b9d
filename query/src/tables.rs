//! The tables the SQL session serves, and how a team sees each: the one list a table
//! is added to (`docs/architecture.md`, "How to add a table").
//!
//! A stored table's shape — schema, time column, sort order — is its
//! [`apron_common::wire::Table`]; it is registered when its [`crate::TableSource`] holds
//! it, and the provider reads its memtable batches and
//! `<table>/date=YYYY-MM-DD/*.parquet` files like every other's.

use apron_common::wire::Table;

use crate::scope::{Held, Rule};

/// One table of the SQL API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableDef {
    /// The SQL name (the contract's), also the directory under the data dir.
    pub name: &'static str,
    /// Which rows a team's session sees ([`crate::scope`]).
    pub scope: Rule,
    /// The stored table (its schema, time column — the UTC day of which cuts the
    /// `date=` partitions, and so prunes them — and the sort order of its files);
    /// `None` for a table the server keeps in memory and registers itself.
    pub stored: Option<Table>,
}

impl TableDef {
    const fn stored(table: Table, scope: Rule) -> TableDef {
        TableDef { name: table.name(), scope, stored: Some(table) }
    }

    const fn served(name: &'static str, scope: Rule) -> TableDef {
        TableDef { name, scope, stored: None }
    }
}

/// Every table of the SQL API: the stored ones are registered when the
/// [`crate::TableSource`] holds them; the server registers the others.
pub const TABLES: &[TableDef] = &[
    TableDef::stored(Table::GpuSamples, Rule::AllocatedIntervals(Held::Window)),
    TableDef::stored(Table::GpuProcesses, Rule::AllocatedIntervals(Held::Process)),
    TableDef::stored(Table::GpuSamples1m, Rule::AllocatedIntervals(Held::Minute)),
    TableDef::stored(Table::Allocations, Rule::TeamColumn),
    TableDef::stored(Table::GpuCostHourly, Rule::TeamColumn),
    TableDef::served("alerts", Rule::TeamColumn),
    TableDef::served("recommendations", Rule::TeamColumn),
];

/// The definition of `name`, if it is a table of the SQL API.
pub fn table_def(name: &str) -> Option<&'static TableDef> {
    TABLES.iter().find(|t| t.name == name)
}

#[cfg(test)]
mod tests {
    use apron_collector::Table;

    #[test]
    fn every_stored_table_is_served() {
        for t in Table::ALL {
            let def = super::table_def(t.name()).expect("listed");
            assert_eq!(def.stored, Some(t));
            assert_eq!(t.sort_order(), ["gpu_uuid", t.time_column()]);
        }
    }
}
