//! One place that decides what an NVML error means for a sampler.
//!
//! - A symbol the driver lacks, or NOT_SUPPORTED: the field is NULL for that GPU from now
//!   on; reported once, never retried (saves the call's cost every tick).
//! - GPU_IS_LOST: the GPU is reported lost; the other GPUs go on.
//! - NOT_FOUND from a sample buffer: no new samples, which the caller interprets.
//! - Anything else: a failure for this tick, retried next tick.

use std::collections::HashSet;

use nvml_wrapper::error::NvmlError;

use crate::sampler::{IssueKind, Readings, Slot};

/// What an error means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Unsupported,
    Lost,
    NotFound,
    Failed,
}

pub fn classify(e: &NvmlError) -> Outcome {
    match e {
        NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_) | NvmlError::FunctionNotFound => {
            Outcome::Unsupported
        }
        NvmlError::GpuLost => Outcome::Lost,
        NvmlError::NotFound => Outcome::NotFound,
        _ => Outcome::Failed,
    }
}

/// Remembers which (GPU, call) pairs are unsupported, and routes errors into `Readings`.
#[derive(Debug, Default)]
pub struct Guard {
    unsupported: HashSet<(Slot, &'static str)>,
}

impl Guard {
    /// False when `what` is already known unsupported on `slot`: skip the call.
    pub fn supported(&self, slot: Slot, what: &'static str) -> bool {
        !self.unsupported.contains(&(slot, what))
    }

    /// Runs `f` unless known unsupported; on error, records it and returns `None`.
    pub fn call<T>(
        &mut self,
        slot: Slot,
        what: &'static str,
        out: &mut Readings,
        f: impl FnOnce() -> Result<T, NvmlError>,
    ) -> Option<T> {
        if !self.supported(slot, what) {
            return None;
        }
        match f() {
            Ok(v) => Some(v),
            Err(e) => {
                self.record(slot, what, out, &e);
                None
            }
        }
    }

    /// Records an error already obtained. Returns its classification.
    pub fn record(&mut self, slot: Slot, what: &'static str, out: &mut Readings, e: &NvmlError) -> Outcome {
        let outcome = classify(e);
        match outcome {
            Outcome::Unsupported => {
                self.unsupported.insert((slot, what));
                out.issue(Some(slot), what, IssueKind::Unsupported, e.to_string());
            }
            Outcome::Lost => out.lost(slot),
            Outcome::NotFound | Outcome::Failed => out.issue(Some(slot), what, IssueKind::Failed, e.to_string()),
        }
        outcome
    }

    /// True when every GPU in `slots` is unsupported for `what` (the sampler has nothing
    /// left to do).
    pub fn all_unsupported(&self, slots: impl IntoIterator<Item = Slot>, what: &'static str) -> bool {
        slots.into_iter().all(|s| !self.supported(s, what))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_is_sticky_and_reported_once() {
        let mut g = Guard::default();
        let mut out = Readings::default();
        assert_eq!(g.call(0, "x", &mut out, || Err::<(), _>(NvmlError::NotSupported)), None);
        assert_eq!(out.issues.len(), 1);
        let mut called = false;
        assert_eq!(
            g.call(0, "x", &mut out, || {
                called = true;
                Ok(())
            }),
            None
        );
        assert!(!called, "an unsupported call is not retried");
        assert_eq!(g.call(1, "x", &mut out, || Ok(7)), Some(7), "other GPUs unaffected");
    }

    #[test]
    fn lost_marks_the_gpu() {
        let mut g = Guard::default();
        let mut out = Readings::default();
        let _ = g.call(3, "y", &mut out, || Err::<(), _>(NvmlError::GpuLost));
        assert_eq!(out.lost, vec![3]);
        assert!(out.issues.is_empty());
        assert!(g.supported(3, "y"), "a lost GPU is retried: it may come back after a reset");
    }

    #[test]
    fn missing_symbol_is_unsupported() {
        assert_eq!(classify(&NvmlError::FailedToLoadSymbol("nvmlGpmSampleGet".into())), Outcome::Unsupported);
    }
}
