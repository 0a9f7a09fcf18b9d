//! The query layer's limits: a plain struct the server embeds in its TOML config (section
//! `[query]`). No environment reads here; the binary layers flags and `APRON_*` on top.

use std::time::Duration;

use serde::Deserialize;

/// Limits applied to every query. Durations are humantime strings (`30s`, `2m`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueryConfig {
    /// Wall-clock limit of one query: planning, execution and collecting the result.
    /// Past it the query is cancelled and answers [`crate::QueryError::Timeout`].
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub timeout: Duration,
    /// Memory one query may reserve in DataFusion's memory pool (hash tables, sort
    /// buffers, join build sides). Each query gets its own pool, so the server's worst
    /// case is `max_concurrent × memory_limit_bytes` on top of the memtable. Nothing
    /// spills to disk: a query past the limit fails with
    /// [`crate::QueryError::MemoryLimit`].
    pub memory_limit_bytes: u64,
    /// Queries running at once; further queries wait in line up to `queue_timeout`.
    pub max_concurrent: usize,
    /// Of those, how many one principal (all unscoped clients together, and the most a
    /// team may have) may hold at once, so no principal takes every slot; further
    /// queries of it wait in line up to `queue_timeout` like the rest. 0 (the default):
    /// all but one of `max_concurrent` (at least 1) — the viewers' Grafana panels run
    /// side by side — but never the last slot.
    pub max_concurrent_per_principal: usize,
    /// How many one team may hold at once (also at most `max_concurrent_per_principal`).
    /// 0 (the default): a quarter of `max_concurrent`, at least 1 — with the default 4
    /// slots, three teams each running slow queries still leave a slot for a fourth
    /// principal. Whatever the shares, a principal that already holds a slot never takes
    /// the last free one ([`crate::slots`]).
    pub max_concurrent_per_team: usize,
    /// Slots reserved for the server's own passes (ledger, rollups, alerts,
    /// recommendations, import), on top of `max_concurrent`: clients cannot starve them.
    /// Two by default: with one, the passes' queries took turns and an alert pass
    /// waited behind a recommendation run's 7-day scans (at 1,000 GPUs: incremental
    /// alert passes took 16.7 s at the median instead of 2.8 s) for no lower peak.
    pub reserved_internal: usize,
    /// How long a query waits for a free slot before [`crate::QueryError::Busy`].
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub queue_timeout: Duration,
    /// A result with more rows is refused ([`crate::QueryError::TooManyRows`]): the
    /// result is held in memory to be rendered, so this bounds it. 0 = no limit.
    pub max_result_rows: usize,
    /// A result whose Arrow batches hold more bytes is refused
    /// ([`crate::QueryError::ResultTooLarge`]); rows alone do not bound a result of wide
    /// string columns. 0 = no limit.
    pub max_result_bytes: u64,
    /// DataFusion's `target_partitions` (parallelism of one query); 0 = CPU count.
    pub target_partitions: usize,
    /// `target_partitions` of the server's own passes' queries; 0 (the default) =
    /// `target_partitions`. 1 makes a pass's aggregation one hash table on one core, but
    /// also plans its joins with one side collected whole: at 1,000 GPUs the alert
    /// pass's look-back join then passed the 1 GiB query limit (RSS 1.1 → 2.3 GiB for
    /// 5 s; docs/benchmarks.md, run H), so it is not the default.
    pub pass_partitions: usize,
    /// How deep expressions, subqueries and set operations of one statement may nest
    /// (`1+1+…+1` is as deep as it has terms); deeper statements are refused before
    /// planning ([`crate::QueryError::TooComplex`]).
    pub max_expr_depth: usize,
    /// How many expressions, tables and set operations one statement may have.
    pub max_expr_nodes: usize,
    /// The most bytes one function that builds a variable-size value (every string,
    /// binary, list, map and struct function, `||`; [`crate::funcs`]) may produce for one
    /// batch of rows, and one `string_agg`/`array_agg` value may hold; bounded from the
    /// arguments before anything is allocated where they can amplify it, and measured
    /// after, since these allocations are not counted by the memory pool. A query's
    /// values built from constants alone (constant folding's literals, copied by every
    /// optimizer pass) are held to 1/64 of this together, at least 1 MiB.
    pub max_string_result_bytes: u64,
    /// `[query.ballista]`: run the heavy scans of a query server (`[cluster] role =
    /// "query"`) on an Apache DataFusion Ballista cluster ([`crate::distributed`]).
    /// Unset: every query runs in this process.
    pub ballista: Option<crate::BallistaConfig>,
}

impl QueryConfig {
    /// The effective [`QueryConfig::max_concurrent_per_principal`].
    pub fn principal_share(&self) -> usize {
        let all = self.max_concurrent.max(1);
        match self.max_concurrent_per_principal {
            0 => all.saturating_sub(1).max(1),
            n => n.min(all),
        }
    }

    /// The effective [`QueryConfig::max_concurrent_per_team`].
    pub fn team_share(&self) -> usize {
        let team = match self.max_concurrent_per_team {
            0 => (self.max_concurrent.max(1) / 4).max(1),
            n => n,
        };
        team.min(self.principal_share())
    }
}

impl Default for QueryConfig {
    fn default() -> Self {
        QueryConfig {
            timeout: Duration::from_secs(60),
            memory_limit_bytes: 1 << 30,
            max_concurrent: 4,
            max_concurrent_per_principal: 0,
            max_concurrent_per_team: 0,
            reserved_internal: 2,
            queue_timeout: Duration::from_secs(2),
            max_result_rows: 1_000_000,
            max_result_bytes: 256 << 20,
            target_partitions: 0,
            pass_partitions: 0,
            max_expr_depth: 500,
            max_expr_nodes: 20_000,
            max_string_result_bytes: 64 << 20,
            ballista: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_humantime_and_unknown_fields() {
        let c: QueryConfig = serde_json::from_str(r#"{"timeout": "1m 30s", "max_concurrent": 2}"#).expect("parse");
        assert_eq!(c.timeout, Duration::from_secs(90));
        assert_eq!(c.max_concurrent, 2);
        assert_eq!(c.memory_limit_bytes, 1 << 30);
        assert_eq!(c.queue_timeout, Duration::from_secs(2));
        assert_eq!(c.principal_share(), 1, "all but one of 2");
        assert_eq!(QueryConfig::default().principal_share(), 3);
        let c = QueryConfig { max_concurrent: 4, max_concurrent_per_principal: 9, ..QueryConfig::default() };
        assert_eq!(c.principal_share(), 4);
        assert_eq!(QueryConfig::default().team_share(), 1);
        assert_eq!(QueryConfig { max_concurrent: 16, ..QueryConfig::default() }.team_share(), 4);
        let c = QueryConfig { max_concurrent: 4, max_concurrent_per_team: 9, ..QueryConfig::default() };
        assert_eq!(c.team_share(), 3, "never above the principal share");
        let err = serde_json::from_str::<QueryConfig>(r#"{"time_out": "1s"}"#).expect_err("unknown field");
        assert!(err.to_string().contains("unknown field"), "{err}");
        assert!(serde_json::from_str::<QueryConfig>(r#"{"timeout": "soon"}"#).is_err());
    }
}
