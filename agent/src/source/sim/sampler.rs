//! The simulator's samplers: one type for every field group, reading the shared model.

use std::sync::Arc;

use apron_common::UnixMicros;

use super::fleet::{Fleet, SimProcess};
use super::host::SimHost;
use crate::attribution::{Attributor, ProcessSample};
use crate::sampler::{FieldGroup, IssueKind, Readings, Sampler, SamplerError};

/// Reads one field group of every simulated GPU at the tick's `now`.
pub struct SimSampler {
    fleet: Arc<Fleet>,
    group: FieldGroup,
    /// Unsupported fields are reported on the first tick only: they never change.
    reported: bool,
    /// Processes only: the host whose cursor the attributor reads, and the attributor.
    attribution: Option<(SimHost, Arc<Attributor>)>,
    scratch: Vec<SimProcess>,
}

impl SimSampler {
    pub(crate) fn new(fleet: Arc<Fleet>, group: FieldGroup, attribution: Option<(SimHost, Arc<Attributor>)>) -> Self {
        Self { fleet, group, reported: false, attribution, scratch: Vec::new() }
    }
}

impl Sampler for SimSampler {
    fn group(&self) -> FieldGroup {
        self.group
    }

    fn sample(&mut self, now: UnixMicros, out: &mut Readings) -> Result<(), SamplerError> {
        let slots = self.fleet.inventory().len();
        if !self.reported {
            self.reported = true;
            for slot in 0..slots {
                if let Some((what, detail)) = self.fleet.unsupported(slot, self.group) {
                    out.issue(Some(slot), what, IssueKind::Unsupported, detail);
                }
            }
        }
        if self.group == FieldGroup::Processes {
            if let Some((host, attribution)) = &self.attribution {
                host.set_time(now);
                process_rows(&self.fleet, attribution, now, &mut self.scratch, out);
            }
            return Ok(());
        }
        for slot in 0..slots {
            let alive =
                self.fleet.sample(slot, self.group, now.0, &mut |field, value| out.push(slot, field, value, now));
            if !alive {
                out.lost(slot);
            }
        }
        Ok(())
    }
}

/// One process tick: refresh attribution, then one row per process with its owner as the
/// attributor parses it from the host's facts. The caller has set the host's cursor.
pub(crate) fn process_rows(
    fleet: &Fleet,
    attribution: &Attributor,
    now: UnixMicros,
    scratch: &mut Vec<SimProcess>,
    out: &mut Readings,
) {
    for warning in attribution.refresh() {
        out.issue(None, "attribution", IssueKind::Failed, warning);
    }
    for (slot, gpu) in fleet.inventory().iter().enumerate() {
        scratch.clear();
        if !fleet.processes(slot, now.0, scratch) {
            out.lost(slot);
            continue;
        }
        for p in scratch.iter() {
            let sample = ProcessSample {
                pid: p.pid,
                name: Some(p.name.to_owned()),
                fb_used_bytes: Some(p.fb_used_bytes),
                sm_util: Some(p.sm_util),
            };
            out.processes.push(attribution.process(gpu, p.pid).into_row(now, gpu, sample));
        }
    }
}
