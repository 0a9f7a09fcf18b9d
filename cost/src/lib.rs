//! Apron's cost model as pure logic: no Arrow, no DataFusion, no I/O beyond parsing the
//! strings it is handed. The server feeds it rows and writes what it returns.
//!
//! Data flow, per GPU (or MIG instance):
//!
//! ```text
//!  gpu_samples windows ─┐
//!  allocations (holders)┼─► classify ──► Classified spans ──► hourly(): µs per state per (hour, team)
//!  ClassifyConfig ──────┘                      │
//!  PriceBook (TOML / SkyPilot CSV) ────────────┴─► cost::hourly_cost ──► gpu_cost_hourly money
//!  gpu_cost_hourly rows + stranded facts ─► report::WeeklyReport ─► JSON / CSV / HTML
//! ```
//!
//! - [`money`]: [`money::Micros`] (the integer of a `Decimal128(18, 6)`), [`money::Cents`],
//!   exact decimal parsing, the one rounding rule (exact `i128`, then half-even once),
//!   cost of a duration, monthly savings.
//! - [`time`]: UTC calendar arithmetic and the date spellings configs accept.
//! - [`pricebook`]: the versioned TOML price book (cloud rates, on-prem amortisation,
//!   per-cluster overrides, `effective_from`, MIG slices by n/7), lookups with the next
//!   change boundary, the price table, and the SkyPilot catalog import.
//! - [`team`]: team resolution in the design brief's order, workload kind and
//!   interruptible rules; [`owner`]: who holds a GPU (the windows' holder, a static map
//!   entry, a mapped user's process) as one [`Owner`] type, resolved to a team.
//! - [`classify`]: the idle rule (one definition, also generated as SQL for the
//!   evaluators' queries), every second into exactly one of active, allocated idle, stranded,
//!   unallocated idle, unallocated busy, unknown (+ under-used ⊂ active), per hour and
//!   team; the incremental-recompute contract ([`classify::recompute_plan`]).
//! - [`idlerun`]: the one idle-run rule (a run of one holder continues across a gap of
//!   at most `max_idle_gap`; busy time, another holder or a longer gap end it), used by
//!   the classifier and the alert tracker.
//! - [`runs`]: allocation runs (one holder, no break longer than a window) → the
//!   `allocations` rows.
//! - [`cost`]: classified seconds × prices in force (split at price changes) → the money
//!   columns of `gpu_cost_hourly`.
//! - [`report`]: ISO weeks, the weekly finance report model (per team, unallocated line or
//!   shared, fleet totals that are sums of rounded lines, week-over-week, top stranded)
//!   and its JSON, CSV and HTML renderings.
//!
//! - [`alert`]: live per-GPU run tracking, the alert conditions (stranded allocation,
//!   zombie memory, unallocated busy, GPU lost, XID), exemptions and the lifecycle.
//! - [`recommend`]: reclaim, right-size, pack, downsize, spot and rebalance-quota
//!   recommendations with savings and confidence; [`mig`] (profiles, smallest fit, a
//!   parent's free capacity),
//!   [`pack`] (2-D first-fit decreasing) and [`replay`] (what-if replay) serve it.
//!
//! Every module has its own `thiserror` error enum; nothing here panics on input.

pub mod alert;
pub mod classify;
pub mod cost;
pub mod idlerun;
pub mod mig;
pub mod money;
pub mod owner;
pub mod pack;
pub mod pricebook;
pub mod recommend;
pub mod replay;
pub mod report;
pub mod runs;
pub mod team;
pub mod time;

pub use classify::{
    Classified, ClassifyConfig, Holder, HolderId, HourTeam, RecomputePlan, State, StateMicros, UNALLOCATED, Window,
    classify, recompute_plan,
};
pub use cost::{CostRow, HourMoney, hourly_cost, interval_cost, price_segments};
pub use money::{Cents, Micros, Ratio};
pub use owner::{Owner, OwnerKind, PROCESS_SAMPLE_REACH_US, ProcessUsers, Resolved};
pub use pricebook::{GpuKey, Lookup, PriceBook, PriceKind, Quote, Unpriced};
pub use report::{HourlyRow, IsoWeek, ReportInput, ShareUnallocated, StrandedFact, WeeklyReport};
pub use runs::{OPEN_RUN_STALE_US, Run, contiguous, holder_runs, run_ended};
pub use team::{AllocationFacts, TeamConfig, UNASSIGNED};
