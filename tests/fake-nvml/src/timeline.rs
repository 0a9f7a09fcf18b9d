//! Time as the fake driver sees it, and the periodic activity timelines.
//!
//! Every quantity is a periodic, piecewise-constant function of CLOCK_REALTIME,
//! anchored at the Unix epoch (offset = `t mod period`). Because of that anchor a
//! test can compute, for any window, exactly what the driver "did" without asking
//! the fake. Means and counters come from exact integrals: whole periods are
//! counted, and only the two partial periods at the ends are summed piece by
//! piece, so nothing accumulates floating-point error over 1.7e9 seconds.

use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch (CLOCK_REALTIME), the single time base.
pub fn now_ns() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        // A clock before 1970 is not a case worth modelling; treat it as the epoch.
        Err(_) => 0,
    }
}

pub const NS_PER_S: f64 = 1e9;

/// The time-varying quantities, as indices into a value row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum M {
    GpuUtil,
    MemUtil,
    EncUtil,
    DecUtil,
    GrActive,
    SmActive,
    SmOccupancy,
    IntActive,
    TensorActive,
    TensorDfma,
    TensorHmma,
    TensorImma,
    DramActive,
    Fp64,
    Fp32,
    Fp16,
    PowerW,
    FbUsedMib,
    PcieTx,
    PcieRx,
    NvlinkTx,
    NvlinkRx,
    SmClock,
    MemClock,
    TempC,
    MemTempC,
    Throttle,
}

pub const N_METRICS: usize = M::Throttle as usize + 1;

pub type Row = [f64; N_METRICS];

#[derive(Debug, Clone)]
struct Piece {
    start: i64,
    row: Row,
    /// Integral (value × seconds) of each metric from the period start to `start`.
    cum: Row,
}

/// One entity's (GPU's or MIG instance's) values over a period.
#[derive(Debug, Clone)]
pub struct Timeline {
    period: i64,
    pieces: Vec<Piece>,
    /// Integral of each metric over one whole period.
    total: Row,
}

impl Timeline {
    /// `spans` are non-overlapping `[start, end)` offsets within `[0, period)`, sorted;
    /// the gaps between them take `idle`.
    pub fn new(period: i64, spans: &[(i64, i64, Row)], idle: Row) -> Timeline {
        let mut flat: Vec<(i64, Row)> = Vec::new();
        let mut cursor = 0;
        for &(start, end, row) in spans {
            if start > cursor {
                flat.push((cursor, idle));
            }
            flat.push((start, row));
            cursor = end;
        }
        if cursor < period || flat.is_empty() {
            flat.push((cursor, idle));
        }
        let mut pieces = Vec::with_capacity(flat.len());
        let mut acc = [0.0; N_METRICS];
        for (i, &(start, row)) in flat.iter().enumerate() {
            let end = flat.get(i + 1).map_or(period, |next| next.0);
            pieces.push(Piece { start, row, cum: acc });
            let secs = (end - start) as f64 / NS_PER_S;
            for (a, v) in acc.iter_mut().zip(row.iter()) {
                *a += v * secs;
            }
        }
        Timeline { period, pieces, total: acc }
    }

    fn piece_at(&self, offset: i64) -> &Piece {
        let i = self.pieces.partition_point(|p| p.start <= offset);
        // `partition_point` is ≥ 1 because the first piece starts at offset 0.
        &self.pieces[i.saturating_sub(1)]
    }

    /// The instantaneous value at `t` (ns since the epoch).
    pub fn at(&self, m: M, t: i64) -> f64 {
        self.piece_at(t.rem_euclid(self.period)).row[m as usize]
    }

    /// All values at `t`.
    pub fn row_at(&self, t: i64) -> Row {
        self.piece_at(t.rem_euclid(self.period)).row
    }

    fn partial(&self, m: M, offset: i64) -> f64 {
        let p = self.piece_at(offset);
        p.cum[m as usize] + p.row[m as usize] * (offset - p.start) as f64 / NS_PER_S
    }

    /// ∫ m dt over `[a, b]` in value × seconds (`a <= b`, ns since the epoch).
    pub fn integral(&self, m: M, a: i64, b: i64) -> f64 {
        let (ka, xa) = (a.div_euclid(self.period), a.rem_euclid(self.period));
        let (kb, xb) = (b.div_euclid(self.period), b.rem_euclid(self.period));
        (kb - ka) as f64 * self.total[m as usize] + self.partial(m, xb) - self.partial(m, xa)
    }

    /// Time-weighted mean of m over `[a, b]`; the instantaneous value when empty.
    pub fn mean(&self, m: M, a: i64, b: i64) -> f64 {
        if b <= a {
            return self.at(m, a);
        }
        self.integral(m, a, b) / ((b - a) as f64 / NS_PER_S)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(v: f64) -> Row {
        [v; N_METRICS]
    }

    #[test]
    fn integral_matches_brute_force_across_periods() {
        let s = 1_000_000_000;
        // period 2 s: [0, 0.5) = 100, [1.0, 1.5) = 50, rest idle 10.
        let tl = Timeline::new(2 * s, &[(0, s / 2, row(100.0)), (s, 3 * s / 2, row(50.0))], row(10.0));
        assert_eq!(tl.at(M::GpuUtil, 0), 100.0);
        assert_eq!(tl.at(M::GpuUtil, s / 2), 10.0);
        assert_eq!(tl.at(M::GpuUtil, 1_700_000_001 * s + s / 4), 50.0);
        // One whole period: 0.5*100 + 0.5*10 + 0.5*50 + 0.5*10 = 85.
        let t0 = 1_700_000_000 * s;
        assert!((tl.integral(M::GpuUtil, t0, t0 + 2 * s) - 85.0).abs() < 1e-9);
        // A window straddling a period boundary: [1.75, 2.25] → 0.25*10 + 0.25*100.
        let a = t0 + 7 * s / 4;
        assert!((tl.integral(M::GpuUtil, a, a + s / 2) - 27.5).abs() < 1e-9);
        assert!((tl.mean(M::GpuUtil, a, a + s / 2) - 55.0).abs() < 1e-9);
    }

    #[test]
    fn no_spans_is_constant() {
        let tl = Timeline::new(1_000_000_000, &[], row(7.0));
        assert_eq!(tl.at(M::PowerW, 123_456_789_012), 7.0);
        assert!((tl.mean(M::PowerW, 5, 3_000_000_005) - 7.0).abs() < 1e-12);
    }
}
