//! Classified seconds × the price book → the money columns of `gpu_cost_hourly`.
//!
//! For every `(hour, team)` cell of one GPU:
//!
//! - `cost_usd` = Σ over the cell's **known** time (every state but unknown) of
//!   price-in-force × duration;
//! - `idle_cost_usd` = the same over allocated idle + stranded + unallocated idle;
//! - `stranded_cost_usd` = the same over stranded time;
//! - `price_per_gpu_hour` = the time-weighted mean of the prices in force over the whole
//!   hour — simply the price when it does not change inside the hour.
//!
//! The classified spans are split at hour boundaries **and** at every `effective_from`
//! boundary of the price book, each piece contributes `price_µ$ × µs` to an exact `i128`
//! numerator, and each column is rounded once, half-even, to micro-dollars (see
//! [`crate::money`]). A price change at 12:30 therefore prices 12:00–12:30 at the old and
//! 12:30–13:00 at the new price, exactly.
//!
//! If any part of an hour has no price ([`Unpriced`]), that hour's cells carry no money
//! (NULL in the table) and the reason — never a silent 0.

use std::collections::BTreeMap;

use crate::classify::{Classified, State, StateMicros};
use crate::money::{Micros, cost_numerator, numerator_to_micros};
use crate::pricebook::{GpuKey, Lookup, PriceBook, PriceBookError, Unpriced};
use crate::time::{US_PER_HOUR, hour_floor};

/// Why costs could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error(transparent)]
    PriceBook(#[from] PriceBookError),
    #[error("arithmetic overflow pricing [{start_us}, {end_us})")]
    Overflow { start_us: i64, end_us: i64 },
    #[error("interval [{start_us}, {end_us}) is empty or reversed")]
    BadInterval { start_us: i64, end_us: i64 },
}

/// A stretch `[start_us, end_us)` with one price (or none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PriceSegment {
    pub start_us: i64,
    pub end_us: i64,
    pub price: Result<Micros, Unpriced>,
}

/// The price book's prices for one GPU over `[from_us, to_us)`, split at every change.
pub fn price_segments(
    book: &PriceBook,
    gpu: &GpuKey<'_>,
    from_us: i64,
    to_us: i64,
) -> Result<Vec<PriceSegment>, CostError> {
    if from_us >= to_us {
        return Err(CostError::BadInterval { start_us: from_us, end_us: to_us });
    }
    let mut out = Vec::new();
    let mut t = from_us;
    while t < to_us {
        let (price, next) = match book.price_at(gpu, t)? {
            Lookup::Priced(q) => (Ok(q.usd_per_gpu_hour), q.next_change_us),
            Lookup::Unpriced(u) => {
                let next = match &u {
                    Unpriced::NotYetInForce { first_us, .. } => Some(*first_us),
                    _ => None,
                };
                (Err(u), next)
            }
        };
        let end = next.filter(|n| *n > t).map_or(to_us, |n| n.min(to_us));
        out.push(PriceSegment { start_us: t, end_us: end, price });
        t = end;
    }
    Ok(out)
}

/// The money of one cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HourMoney {
    pub price_per_gpu_hour: Micros,
    pub cost_usd: Micros,
    pub idle_cost_usd: Micros,
    pub stranded_cost_usd: Micros,
}

/// One `gpu_cost_hourly` row of one GPU (identity columns are the caller's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CostRow {
    pub hour_us: i64,
    pub team: String,
    pub micros: StateMicros,
    /// `None` when part of the hour is unpriced; see `unpriced`.
    pub money: Option<HourMoney>,
    pub unpriced: Option<Unpriced>,
}

#[derive(Default)]
struct Numerators {
    known: i128,
    idle: i128,
    stranded: i128,
}

/// Prices a classification: one row per `(hour, team)` cell of [`Classified::hourly`].
pub fn hourly_cost(c: &Classified, book: &PriceBook, gpu: &GpuKey<'_>) -> Result<Vec<CostRow>, CostError> {
    let segs = price_segments(book, gpu, c.from_us, c.to_us)?;
    let overflow = |s: i64, e: i64| CostError::Overflow { start_us: s, end_us: e };
    // Per hour: the price numerator over the whole hour, or the first reason it is unpriced.
    let mut hour_price: BTreeMap<i64, Result<i128, Unpriced>> = BTreeMap::new();
    for seg in &segs {
        let mut s = seg.start_us;
        while s < seg.end_us {
            let hour = hour_floor(s);
            let e = seg.end_us.min(hour.saturating_add(US_PER_HOUR));
            let slot = hour_price.entry(hour).or_insert(Ok(0));
            match (&seg.price, &mut *slot) {
                (Ok(p), Ok(n)) => {
                    *n = n.checked_add(cost_numerator(*p, e - s).ok_or(overflow(s, e))?).ok_or(overflow(s, e))?
                }
                (Err(u), Ok(_)) => *slot = Err(u.clone()),
                (_, Err(_)) => {}
            }
            s = e;
        }
    }
    // Per (hour, team): exact numerators of the three money columns.
    let mut nums: BTreeMap<(i64, String), Numerators> = BTreeMap::new();
    let mut si = 0;
    for sp in &c.spans {
        let team = c.team_of(sp.holder);
        let mut s = sp.start_us;
        while s < sp.end_us {
            while si < segs.len() && segs[si].end_us <= s {
                si += 1;
            }
            let Some(seg) = segs.get(si) else { break };
            let hour = hour_floor(s);
            let e = sp.end_us.min(hour.saturating_add(US_PER_HOUR)).min(seg.end_us);
            let n = nums.entry((hour, team.to_owned())).or_default();
            if let Ok(p) = seg.price
                && sp.state != State::Unknown
            {
                let v = cost_numerator(p, e - s).ok_or(overflow(s, e))?;
                n.known = n.known.checked_add(v).ok_or(overflow(s, e))?;
                if sp.state.is_idle() {
                    n.idle = n.idle.checked_add(v).ok_or(overflow(s, e))?;
                }
                if sp.state == State::Stranded {
                    n.stranded = n.stranded.checked_add(v).ok_or(overflow(s, e))?;
                }
            }
            s = e;
        }
    }
    let mut rows = Vec::new();
    for cell in c.hourly() {
        let (money, unpriced) = match hour_price.get(&cell.hour_us) {
            Some(Ok(price_num)) => {
                let n = nums.get(&(cell.hour_us, cell.team.clone()));
                let r = |v: i128| {
                    numerator_to_micros(v).ok_or(overflow(cell.hour_us, cell.hour_us.saturating_add(US_PER_HOUR)))
                };
                let money = HourMoney {
                    price_per_gpu_hour: r(*price_num)?,
                    cost_usd: r(n.map_or(0, |n| n.known))?,
                    idle_cost_usd: r(n.map_or(0, |n| n.idle))?,
                    stranded_cost_usd: r(n.map_or(0, |n| n.stranded))?,
                };
                (Some(money), None)
            }
            Some(Err(u)) => (None, Some(u.clone())),
            None => (None, None),
        };
        rows.push(CostRow { hour_us: cell.hour_us, team: cell.team, micros: cell.micros, money, unpriced });
    }
    Ok(rows)
}

/// The cost of holding one GPU over `[start_us, end_us)` (e.g. one stranded run, for the
/// report's top stranded allocations), from price segments covering it: rounded once,
/// half-even. `Ok(None)` when part of the interval is unpriced or not covered.
pub fn interval_cost(segments: &[PriceSegment], start_us: i64, end_us: i64) -> Result<Option<Micros>, CostError> {
    if start_us >= end_us {
        return Err(CostError::BadInterval { start_us, end_us });
    }
    let mut num: i128 = 0;
    let mut covered = 0i64;
    for seg in segments {
        let (s, e) = (seg.start_us.max(start_us), seg.end_us.min(end_us));
        if s >= e {
            continue;
        }
        let Ok(p) = seg.price else { return Ok(None) };
        let v = cost_numerator(p, e - s).ok_or(CostError::Overflow { start_us, end_us })?;
        num = num.checked_add(v).ok_or(CostError::Overflow { start_us, end_us })?;
        covered += e - s;
    }
    if covered != end_us - start_us {
        return Ok(None);
    }
    numerator_to_micros(num).map(Some).ok_or(CostError::Overflow { start_us, end_us })
}

#[cfg(test)]
mod tests;
