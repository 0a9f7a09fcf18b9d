//! GPU processes: who runs on each GPU, with how much memory and SM time.
//!
//! Compute and graphics process lists give PIDs and memory; the driver's per-process
//! utilisation buffer (`nvmlDeviceGetProcessUtilization`, read with the last-seen
//! timestamp like the device buffer) gives each PID's SM share since the last tick.
//! Every PID then goes through the [`Attributor`] (cgroup → container/pod, Slurm job,
//! user). Per-process utilisation is not available on MIG instances.

use std::collections::HashMap;
use std::sync::Arc;

use apron_common::UnixMicros;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use super::{Guard, NvmlShared};
use crate::attribution::{Attributor, ProcessSample};
use crate::sampler::{FieldGroup, IssueKind, Readings, Sampler, SamplerError};

pub struct ProcessesSampler {
    shared: Arc<NvmlShared>,
    attribution: Arc<Attributor>,
    guard: Guard,
    last_seen: Vec<Option<u64>>,
    names: HashMap<u32, String>,
}

impl ProcessesSampler {
    pub fn new(shared: Arc<NvmlShared>, attribution: Arc<Attributor>) -> Self {
        let n = shared.gpus.len();
        Self { shared, attribution, guard: Guard::default(), last_seen: vec![None; n], names: HashMap::new() }
    }
}

impl Sampler for ProcessesSampler {
    fn group(&self) -> FieldGroup {
        FieldGroup::Processes
    }

    fn sample(&mut self, now: UnixMicros, out: &mut Readings) -> Result<(), SamplerError> {
        for problem in self.attribution.refresh() {
            out.issue(None, "attribution", IssueKind::Failed, problem);
        }
        let shared = self.shared.clone();
        let mut alive = Vec::new();
        for (slot, gpu) in shared.slots() {
            if gpu.mig_enabled {
                // The instances hold the processes.
                continue;
            }
            let d = &gpu.device;
            let mut procs: Vec<(u32, Option<i64>)> = Vec::new();
            for (what, list) in [
                (
                    "nvmlDeviceGetComputeRunningProcesses",
                    self.guard
                        .call(slot, "nvmlDeviceGetComputeRunningProcesses", out, || d.running_compute_processes()),
                ),
                (
                    "nvmlDeviceGetGraphicsRunningProcesses",
                    self.guard
                        .call(slot, "nvmlDeviceGetGraphicsRunningProcesses", out, || d.running_graphics_processes()),
                ),
            ] {
                let _ = what;
                for p in list.unwrap_or_default() {
                    let mem = match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => i64::try_from(b).ok(),
                        UsedGpuMemory::Unavailable => None,
                    };
                    match procs.iter_mut().find(|(pid, _)| *pid == p.pid) {
                        Some(existing) => existing.1 = existing.1.or(mem),
                        None => procs.push((p.pid, mem)),
                    }
                }
            }
            // Per-process SM utilisation since the last tick: mean of the driver's samples.
            let mut sm: HashMap<u32, (f64, u32)> = HashMap::new();
            if !gpu.is_mig_instance() {
                let since =
                    self.last_seen[slot].unwrap_or_else(|| u64::try_from(now.0).unwrap_or(0).saturating_sub(5_000_000));
                match d.process_utilization_stats(since) {
                    Ok(samples) => {
                        for s in &samples {
                            let e = sm.entry(s.pid).or_insert((0.0, 0));
                            e.0 += f64::from(s.sm_util) / 100.0;
                            e.1 += 1;
                            self.last_seen[slot] = Some(self.last_seen[slot].unwrap_or(0).max(s.timestamp));
                        }
                    }
                    // Nothing since last seen: no process used the SMs.
                    Err(NvmlError::NotFound) => {}
                    Err(e) => {
                        self.guard.record(slot, "nvmlDeviceGetProcessUtilization", out, &e);
                    }
                }
                if self.last_seen[slot].is_none() {
                    self.last_seen[slot] = Some(u64::try_from(now.0).unwrap_or(0));
                }
            }
            for (pid, fb) in procs {
                alive.push(pid);
                let nvml = shared.nvml;
                let name = self
                    .names
                    .entry(pid)
                    .or_insert_with(|| nvml.sys_process_name(pid, 256).unwrap_or_default())
                    .clone();
                let sm_util = match sm.get(&pid) {
                    Some(&(sum, n)) => Some(sum / f64::from(n)),
                    // Listed but absent from the utilisation samples: it used no SM time.
                    None if !gpu.is_mig_instance() && self.guard.supported(slot, "nvmlDeviceGetProcessUtilization") => {
                        Some(0.0)
                    }
                    None => None,
                };
                let sample =
                    ProcessSample { pid, name: (!name.is_empty()).then_some(name), fb_used_bytes: fb, sm_util };
                out.processes.push(self.attribution.process(&gpu.identity, pid).into_row(now, &gpu.identity, sample));
            }
        }
        self.names.retain(|pid, _| alive.contains(pid));
        Ok(())
    }
}
