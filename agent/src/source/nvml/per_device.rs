//! The shape most field groups share: for every GPU, a few independent calls.
//!
//! A field-group file supplies one `read` function; [`PerDevice`] owns the shared
//! handles, the [`Guard`] and the loop, so that every group reports failures the same
//! way and no group can fail another.

use std::sync::Arc;

use apron_common::UnixMicros;

use super::{Guard, NvmlGpu, NvmlShared};
use crate::sampler::{FieldGroup, Phase, Readings, Sampler, SamplerError, Slot};

/// Which inventory slots a group reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Whole GPUs only: device-level fields (power, temperature, clocks, links) belong to
    /// the parent row, per the contract.
    Physical,
    /// Whole GPUs and MIG instances.
    All,
}

pub type ReadFn<S> = fn(&mut S, &NvmlShared, Slot, &NvmlGpu, UnixMicros, &mut Guard, &mut Readings);

pub struct PerDevice<S: Send> {
    group: FieldGroup,
    scope: Scope,
    shared: Arc<NvmlShared>,
    guard: Guard,
    state: S,
    read: ReadFn<S>,
    phase: Phase,
}

impl<S: Send> PerDevice<S> {
    pub fn new(group: FieldGroup, scope: Scope, shared: Arc<NvmlShared>, state: S, read: ReadFn<S>) -> Self {
        Self { group, scope, shared, guard: Guard::default(), state, read, phase: Phase::Mid }
    }

    /// For groups whose readings describe the interval since the last tick.
    pub fn on_boundaries(mut self) -> Self {
        self.phase = Phase::Boundary;
        self
    }
}

impl<S: Send> Sampler for PerDevice<S> {
    fn group(&self) -> FieldGroup {
        self.group
    }

    fn phase(&self) -> Phase {
        self.phase
    }

    fn sample(&mut self, now: UnixMicros, out: &mut Readings) -> Result<(), SamplerError> {
        let before = out.values.len();
        let mut attempted = false;
        for (slot, gpu) in self.shared.slots() {
            if self.scope == Scope::Physical && gpu.is_mig_instance() {
                continue;
            }
            attempted = true;
            (self.read)(&mut self.state, &self.shared, slot, gpu, now, &mut self.guard, out);
        }
        let read_any = out.values.len() > before;
        let all_lost = self.shared.slots().all(|(s, _)| out.lost.contains(&s));
        if attempted && !read_any && !out.issues.is_empty() && !all_lost {
            // Every call failed this tick; say so once at sampler level as well.
            let unsupported_only = out.issues.iter().all(|i| i.kind == crate::sampler::IssueKind::Unsupported);
            if !unsupported_only {
                return Err(SamplerError { group: self.group, detail: "no GPU answered this tick".into() });
            }
        }
        Ok(())
    }
}
