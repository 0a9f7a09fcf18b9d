//! Health: XID errors (NVML events), ECC error totals, remapped rows, PCIe replays.
//!
//! XIDs arrive as events: the sampler registers every GPU for critical XID events once
//! and drains the event set without blocking on each tick, so an XID between ticks is
//! never missed. Counters are read as they stand.

use std::sync::Arc;

use apron_common::{Field, UnixMicros};
use nvml_wrapper::EventSet;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;

use super::{Guard, NvmlShared};
use crate::sampler::{FieldGroup, IssueKind, Readings, Sampler, SamplerError};

pub struct HealthSampler {
    shared: Arc<NvmlShared>,
    guard: Guard,
    events: Option<EventSet<'static>>,
    startup: Readings,
}

impl HealthSampler {
    pub fn new(shared: Arc<NvmlShared>) -> Self {
        let mut startup = Readings::default();
        let mut guard = Guard::default();
        let events = match shared.nvml.create_event_set() {
            Ok(mut set) => {
                for (slot, gpu) in shared.slots() {
                    if gpu.is_mig_instance() {
                        continue;
                    }
                    match gpu.device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                        Ok(s) => set = s,
                        Err(e) => {
                            guard.record(slot, "nvmlDeviceRegisterEvents(XID)", &mut startup, &e.error);
                            // The set is consumed on error; start a fresh one for the rest.
                            match shared.nvml.create_event_set() {
                                Ok(s) => set = s,
                                Err(_) => return Self { shared: shared.clone(), guard, events: None, startup },
                            }
                        }
                    }
                }
                Some(set)
            }
            Err(e) => {
                startup.issue(None, "nvmlEventSetCreate", IssueKind::Unsupported, e.to_string());
                None
            }
        };
        Self { shared, guard, events, startup }
    }

    fn drain_xids(&mut self, now: UnixMicros, out: &mut Readings) {
        let Some(set) = &self.events else { return };
        // Bounded: a storm of events cannot hold the sampler forever.
        for _ in 0..1024 {
            match set.wait(0) {
                Ok(ev) => {
                    let Ok(uuid) = ev.device.uuid() else { continue };
                    let Some(slot) = self.shared.gpus.iter().position(|g| g.identity.gpu_uuid.as_str() == uuid) else {
                        continue;
                    };
                    if let Some(XidError::Value(code)) = ev.event_data {
                        tracing::warn!(gpu = %uuid, xid = code, "XID error");
                        out.push(slot, Field::XidLast, code as f64, now);
                    }
                }
                Err(NvmlError::Timeout) => return,
                Err(NvmlError::GpuLost) => return,
                Err(e) => {
                    out.issue(None, "nvmlEventSetWait", IssueKind::Failed, e.to_string());
                    return;
                }
            }
        }
    }
}

impl Sampler for HealthSampler {
    fn group(&self) -> FieldGroup {
        FieldGroup::Health
    }

    fn sample(&mut self, now: UnixMicros, out: &mut Readings) -> Result<(), SamplerError> {
        out.issues.append(&mut self.startup.issues);
        self.drain_xids(now, out);
        let shared = self.shared.clone();
        for (slot, gpu) in shared.slots() {
            if gpu.is_mig_instance() {
                continue;
            }
            let d = &gpu.device;
            let g = &mut self.guard;
            if let Some(n) = g.call(slot, "nvmlDeviceGetTotalEccErrors(CORRECTED)", out, || {
                d.total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate)
            }) {
                out.push(slot, Field::EccSbeTotal, n as f64, now);
            }
            if let Some(n) = g.call(slot, "nvmlDeviceGetTotalEccErrors(UNCORRECTED)", out, || {
                d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Aggregate)
            }) {
                out.push(slot, Field::EccDbeTotal, n as f64, now);
            }
            if let Some(n) = g.call(slot, "nvmlDeviceGetPcieReplayCounter", out, || d.pcie_replay_counter()) {
                out.push(slot, Field::PcieReplays, f64::from(n), now);
            }
            let remapped = match &shared.raw {
                // SAFETY: the handle is live for the life of the process.
                Some(raw) => {
                    g.call(slot, "nvmlDeviceGetRemappedRows", out, || unsafe { raw.remapped_rows(d.handle()) })
                }
                None => None,
            };
            if let Some((corr, unc, pending, failure)) = remapped {
                out.push(slot, Field::RemappedRowsCorrectable, f64::from(corr), now);
                out.push(slot, Field::RemappedRowsUncorrectable, f64::from(unc), now);
                out.push(slot, Field::RowRemapPending, f64::from(u8::from(pending)), now);
                out.push(slot, Field::RowRemapFailure, f64::from(u8::from(failure)), now);
            }
        }
        Ok(())
    }
}
