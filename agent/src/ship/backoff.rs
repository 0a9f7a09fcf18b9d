//! Exponential backoff with jitter.
//!
//! Attempt n waits a random time in `[c/2, c]` where `c = min(cap, base · 2ⁿ)` ("equal
//! jitter"): it never retries sooner than half the schedule, and a fleet of agents that
//! lost the collector at the same moment spreads its retries instead of arriving
//! together when it comes back.

use std::time::Duration;

/// The first retry waits about this long.
pub const BASE: Duration = Duration::from_millis(500);

#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
    rng: u64,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration, seed: u64) -> Self {
        Self { base: base.min(cap), cap, attempt: 0, rng: seed }
    }

    /// The upper bound of the wait before retry number `attempt` (0-based).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The wait before the next retry.
    pub fn next_delay(&mut self) -> Duration {
        let c = self.ceiling(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let half = c / 2;
        let span = u64::try_from((c - half).as_micros()).unwrap_or(u64::MAX);
        let jitter = if span == 0 { 0 } else { self.random() % (span + 1) };
        half + Duration::from_micros(jitter)
    }

    /// After a success: the next failure starts the schedule again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// SplitMix64: plenty for jitter, no dependency.
    fn random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_doubles_to_the_cap() {
        let b = Backoff::new(BASE, Duration::from_secs(30), 1);
        let secs: Vec<f64> = (0..9).map(|n| b.ceiling(n).as_secs_f64()).collect();
        assert_eq!(secs, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]);
        assert_eq!(b.ceiling(1000), Duration::from_secs(30), "no overflow on long outages");
    }

    #[test]
    fn delays_stay_within_half_to_full_ceiling_and_vary() {
        let mut b = Backoff::new(BASE, Duration::from_secs(30), 7);
        let mut seen = std::collections::BTreeSet::new();
        for n in 0..40 {
            let c = b.ceiling(n);
            let d = b.next_delay();
            assert!(d >= c / 2 && d <= c, "attempt {n}: {d:?} outside [{:?}, {c:?}]", c / 2);
            seen.insert(d);
        }
        assert!(seen.len() > 20, "jitter varies: {seen:?}");
        assert_eq!(b.attempts(), 40);
        b.reset();
        assert!(b.next_delay() <= BASE);
    }

    #[test]
    fn base_above_cap_is_clamped() {
        let mut b = Backoff::new(Duration::from_secs(5), Duration::from_secs(1), 3);
        assert!(b.next_delay() <= Duration::from_secs(1));
    }
}
