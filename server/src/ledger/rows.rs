//! The ledger's output as Arrow batches: `gpu_cost_hourly` rows from classified hours,
//! and `allocations` rows from holder runs (stored ones read back, new ones built).

use apron_collector::Table;
use apron_cost::Resolved;
use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Decimal128Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use datafusion::arrow::datatypes::TimestampMicrosecondType;

use super::{GpuWindows, LedgerError};

/// `gpu_cost_hourly` rows being built, in its wire schema.
#[derive(Default)]
pub(super) struct CostRows {
    pub(super) hour: Vec<i64>,
    pub(super) cluster: Vec<Option<String>>,
    pub(super) host: Vec<String>,
    pub(super) gpu_uuid: Vec<String>,
    pub(super) gpu_model: Vec<String>,
    pub(super) team: Vec<String>,
    pub(super) seconds: [Vec<i128>; 7],
    pub(super) money: [Vec<Option<i128>>; 4],
}

impl CostRows {
    pub(super) fn push(
        &mut self,
        hour: i64,
        g: &GpuWindows,
        uuid: &str,
        team: &str,
        m: &apron_cost::StateMicros,
        money: Option<&apron_cost::HourMoney>,
    ) {
        self.hour.push(hour);
        self.cluster.push(g.meta.cluster.clone());
        self.host.push(g.meta.host.clone());
        self.gpu_uuid.push(uuid.to_owned());
        self.gpu_model.push(g.meta.model.clone());
        self.team.push(team.to_owned());
        // Microseconds are the Decimal128(18, 6) seconds' unscaled integer.
        let secs =
            [m.active, m.allocated_idle, m.stranded, m.unallocated_idle, m.unallocated_busy, m.unknown, m.underused];
        for (col, v) in self.seconds.iter_mut().zip(secs) {
            col.push(i128::from(v));
        }
        let cash = money.map(|x| [x.price_per_gpu_hour, x.cost_usd, x.idle_cost_usd, x.stranded_cost_usd]);
        for (k, col) in self.money.iter_mut().enumerate() {
            col.push(cash.map(|c| i128::from(c[k].0)));
        }
    }

    pub(super) fn finish(self) -> Result<RecordBatch, LedgerError> {
        let schema = Table::GpuCostHourly.schema();
        let dec = |v: Vec<Option<i128>>| -> Result<ArrayRef, LedgerError> {
            Ok(std::sync::Arc::new(
                Decimal128Array::from(v)
                    .with_precision_and_scale(18, 6)
                    .map_err(|source| LedgerError::Arrow { what: "money", source })?,
            ))
        };
        let mut cols: Vec<ArrayRef> = vec![
            std::sync::Arc::new(TimestampMicrosecondArray::from(self.hour).with_timezone("UTC")),
            std::sync::Arc::new(StringArray::from(self.cluster)),
            std::sync::Arc::new(StringArray::from(self.host)),
            std::sync::Arc::new(StringArray::from(self.gpu_uuid)),
            std::sync::Arc::new(StringArray::from(self.gpu_model)),
            std::sync::Arc::new(StringArray::from(self.team)),
        ];
        for s in self.seconds {
            cols.push(dec(s.into_iter().map(Some).collect())?);
        }
        for m in self.money {
            cols.push(dec(m)?);
        }
        RecordBatch::try_new(schema, cols).map_err(|source| LedgerError::Arrow { what: "gpu_cost_hourly rows", source })
    }
}

/// One `allocations` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct AllocRow {
    pub(super) gpu_uuid: String,
    pub(super) host: String,
    pub(super) start: i64,
    pub(super) end: Option<i64>,
    pub(super) owner_kind: String,
    pub(super) owner: String,
    pub(super) team: String,
    pub(super) workload_kind: Option<String>,
    pub(super) interruptible: bool,
    pub(super) source: String,
    pub(super) cluster: Option<String>,
    pub(super) held_through: i64,
}

impl AllocRow {
    pub(super) fn new(
        uuid: &str,
        g: &GpuWindows,
        (start, end, held): (i64, Option<i64>, i64),
        h: &Resolved,
    ) -> AllocRow {
        AllocRow {
            gpu_uuid: uuid.to_owned(),
            host: g.meta.host.clone(),
            start,
            end,
            owner_kind: h.owner.kind.as_str().to_owned(),
            owner: h.owner.owner.clone(),
            team: h.team.clone(),
            workload_kind: h.workload_kind.clone(),
            interruptible: h.interruptible,
            source: h.owner.kind.source().to_owned(),
            cluster: g.meta.cluster.clone(),
            held_through: end.unwrap_or(held),
        }
    }

    /// Whether a stored row is `h`'s: the owner and everything resolved from it (the
    /// row does not keep the owner's labels, so a relabelled holder of the same name
    /// whose team did not change counts as the same).
    pub(super) fn same_holder(&self, h: &Resolved) -> bool {
        self.owner_kind == h.owner.kind.as_str()
            && self.owner == h.owner.owner
            && self.team == h.team
            && self.workload_kind == h.workload_kind
            && self.interruptible == h.interruptible
    }

    /// The rows of a batch in the `allocations` schema.
    pub(super) fn read(b: &RecordBatch) -> Vec<AllocRow> {
        let s = |i: usize| b.column(i).as_string::<i32>();
        let opt = |i: usize, r: usize| (!s(i).is_null(r)).then(|| s(i).value(r).to_owned());
        let t = |i: usize| b.column(i).as_primitive::<TimestampMicrosecondType>();
        let tv = |i: usize, r: usize| (!t(i).is_null(r)).then(|| t(i).value(r));
        let flag = b.column(8).as_boolean();
        (0..b.num_rows())
            .map(|r| {
                let end = tv(3, r);
                AllocRow {
                    gpu_uuid: s(0).value(r).to_owned(),
                    host: s(1).value(r).to_owned(),
                    start: t(2).value(r),
                    end,
                    owner_kind: s(4).value(r).to_owned(),
                    owner: s(5).value(r).to_owned(),
                    team: s(6).value(r).to_owned(),
                    workload_kind: opt(7, r),
                    interruptible: flag.value(r),
                    source: s(9).value(r).to_owned(),
                    cluster: opt(10, r),
                    // Files written before the column: the end, or the start.
                    held_through: tv(11, r).or(end).unwrap_or_else(|| t(2).value(r)),
                }
            })
            .collect()
    }
}

/// `allocations` rows being built.
#[derive(Default)]
pub(super) struct AllocRows {
    pub(super) rows: Vec<AllocRow>,
}

impl AllocRows {
    pub(super) fn finish(self) -> Result<RecordBatch, LedgerError> {
        let t = |v: Vec<Option<i64>>| std::sync::Arc::new(TimestampMicrosecondArray::from(v).with_timezone("UTC"));
        let col = |f: &dyn Fn(&AllocRow) -> Option<String>| -> ArrayRef {
            std::sync::Arc::new(StringArray::from(self.rows.iter().map(f).collect::<Vec<_>>()))
        };
        let cols: Vec<ArrayRef> = vec![
            col(&|r| Some(r.gpu_uuid.clone())),
            col(&|r| Some(r.host.clone())),
            t(self.rows.iter().map(|r| Some(r.start)).collect()),
            t(self.rows.iter().map(|r| r.end).collect()),
            col(&|r| Some(r.owner_kind.clone())),
            col(&|r| Some(r.owner.clone())),
            col(&|r| Some(r.team.clone())),
            col(&|r| r.workload_kind.clone()),
            std::sync::Arc::new(BooleanArray::from(self.rows.iter().map(|r| r.interruptible).collect::<Vec<_>>())),
            col(&|r| Some(r.source.clone())),
            col(&|r| r.cluster.clone()),
            t(self.rows.iter().map(|r| Some(r.held_through)).collect()),
        ];
        RecordBatch::try_new(Table::Allocations.schema(), cols)
            .map_err(|source| LedgerError::Arrow { what: "allocations rows", source })
    }
}
