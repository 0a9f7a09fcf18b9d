//! The NVML source: the real driver through `nvml-wrapper`, loaded at run time.
//!
//! Opening the source initialises NVML once (symbol loading is expensive; the handle
//! lives as long as the process), enumerates GPUs and, where MIG is enabled, their MIG
//! instances, each of which becomes its own inventory slot with its parent's UUID and
//! its profile. Each field group is one small sampler file, listed once in
//! [`SAMPLERS`]; they share the device handles and nothing else.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use apron_common::{ClusterName, GpuIdentity, GpuUuid, HostName};
use nvml_wrapper::Device;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

use crate::attribution::Attributor;
use crate::sampler::{FieldGroup, Sampler, Slot};
use crate::source::GpuSource;

mod call;
mod clocks;
mod gpm;
mod health;
mod memory;
mod nvlink;
mod pcie;
mod per_device;
mod power;
pub mod probe;
mod processes;
mod raw;
mod thermal;
mod utilization;

pub use call::{Guard, Outcome, classify};
pub use raw::RawNvml;

/// The library name NVML is loaded by when no path is given (as nvml-wrapper does).
pub const DEFAULT_LIB: &str = "libnvidia-ml.so";

#[derive(Debug, thiserror::Error)]
pub enum NvmlSourceError {
    // The NVML error is part of the one-line message, not a `source`: error chains would
    // print it twice.
    #[error(
        "NVML: cannot load {lib} ({error}). Is the NVIDIA driver installed? Point --nvml-lib at libnvidia-ml.so, or run the simulator instead: apron-agent --source sim"
    )]
    Load { lib: String, error: NvmlError },
    #[error(
        "NVML: nvmlInit failed with {lib}: {error}. Is the NVIDIA kernel driver loaded? Or run the simulator instead: apron-agent --source sim"
    )]
    Init { lib: String, error: NvmlError },
    #[error("NVML ({lib}) found no GPUs. Run the simulator instead: apron-agent --source sim")]
    NoGpus { lib: String },
    #[error("NVML: cannot enumerate GPU {index}: {error}")]
    Enumerate { index: u32, error: NvmlError },
}

/// One inventory slot's handles.
pub struct NvmlGpu {
    pub identity: GpuIdentity,
    pub device: Device<'static>,
    /// For a MIG instance: the parent's handle and this instance's GPU instance id.
    pub mig_parent: Option<(Device<'static>, u32)>,
    /// A MIG-enabled parent: utilisation and per-process calls are unsupported on MIG,
    /// and its instances carry the activity.
    pub mig_enabled: bool,
}

impl NvmlGpu {
    pub fn is_mig_instance(&self) -> bool {
        self.mig_parent.is_some()
    }
}

/// Shared by every NVML sampler.
pub struct NvmlShared {
    pub nvml: &'static Nvml,
    pub raw: Option<RawNvml>,
    pub gpus: Vec<NvmlGpu>,
    /// The row window, for samplers that pace work to window boundaries.
    pub window: Duration,
}

impl NvmlShared {
    pub fn slots(&self) -> impl Iterator<Item = (Slot, &NvmlGpu)> {
        self.gpus.iter().enumerate()
    }
}

type MakeSampler = fn(&Arc<NvmlShared>, &Arc<Attributor>) -> Box<dyn Sampler>;

/// Every NVML sampler, one per field group. The one place to add a group.
const SAMPLERS: &[(FieldGroup, MakeSampler)] = &[
    (FieldGroup::Utilization, |s, _| Box::new(utilization::UtilizationSampler::new(s.clone()))),
    (FieldGroup::Gpm, |s, _| Box::new(gpm::GpmSampler::new(s.clone()))),
    (FieldGroup::Memory, |s, _| Box::new(memory::MemorySampler::new(s.clone()))),
    (FieldGroup::Power, |s, _| Box::new(power::PowerSampler::new(s.clone()))),
    (FieldGroup::Thermal, |s, _| Box::new(thermal::ThermalSampler::new(s.clone()))),
    (FieldGroup::Clocks, |s, _| Box::new(clocks::ClocksSampler::new(s.clone()))),
    (FieldGroup::Pcie, |s, _| Box::new(pcie::PcieSampler::new(s.clone()))),
    (FieldGroup::Nvlink, |s, _| Box::new(nvlink::NvlinkSampler::new(s.clone()))),
    (FieldGroup::Health, |s, _| Box::new(health::HealthSampler::new(s.clone()))),
    (FieldGroup::Processes, |s, a| Box::new(processes::ProcessesSampler::new(s.clone(), a.clone()))),
];

pub struct NvmlSource {
    shared: Arc<NvmlShared>,
    inventory: Vec<GpuIdentity>,
    driver_version: Option<String>,
}

impl NvmlSource {
    /// Loads NVML from `lib` (or the default name through the loader path) and
    /// enumerates GPUs and MIG instances.
    pub fn open(
        lib: Option<&Path>,
        host: &HostName,
        cluster: Option<&ClusterName>,
        window: Duration,
    ) -> Result<Self, NvmlSourceError> {
        let lib_os: &OsStr = lib.map_or(OsStr::new(DEFAULT_LIB), Path::as_os_str);
        let lib_name = lib_os.to_string_lossy().into_owned();
        let nvml = Nvml::builder().lib_path(lib_os).init().map_err(|error| match error {
            NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound | NvmlError::FailedToLoadSymbol(_) => {
                NvmlSourceError::Load { lib: lib_name.clone(), error }
            }
            error => NvmlSourceError::Init { lib: lib_name.clone(), error },
        })?;
        // NVML is initialised once and used for the life of the process; leaking the
        // handle lets device handles be `'static` and shared by sampler threads.
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));
        let raw = RawNvml::open(lib_os).ok();
        let driver_version = nvml.sys_driver_version().ok();

        let count = nvml.device_count().map_err(|error| NvmlSourceError::Init { lib: lib_name.clone(), error })?;
        if count == 0 {
            return Err(NvmlSourceError::NoGpus { lib: lib_name });
        }
        let mut gpus = Vec::new();
        for index in 0..count {
            let device = nvml.device_by_index(index).map_err(|error| NvmlSourceError::Enumerate { index, error })?;
            let identity = match identify(&device, index, host, cluster) {
                Ok(id) => id,
                Err(NvmlError::GpuLost) => {
                    tracing::error!(index, "GPU is lost at start-up; skipping it");
                    continue;
                }
                Err(error) => return Err(NvmlSourceError::Enumerate { index, error }),
            };
            let mig_enabled = device.mig_mode().is_ok_and(|m| m.current == 1);
            let instances =
                if mig_enabled { mig_instances(nvml, raw.as_ref(), &device, &identity) } else { Vec::new() };
            gpus.push(NvmlGpu { identity, device, mig_parent: None, mig_enabled });
            gpus.extend(instances);
        }
        let inventory = gpus.iter().map(|g| g.identity.clone()).collect();
        Ok(Self { shared: Arc::new(NvmlShared { nvml, raw, gpus, window }), inventory, driver_version })
    }
}

fn identify(
    device: &Device<'static>,
    index: u32,
    host: &HostName,
    cluster: Option<&ClusterName>,
) -> Result<GpuIdentity, NvmlError> {
    let uuid = device.uuid()?;
    Ok(GpuIdentity {
        cluster: cluster.cloned(),
        host: host.clone(),
        gpu_uuid: GpuUuid::new(uuid).map_err(|_| NvmlError::Unknown)?,
        gpu_index: index,
        gpu_model: device.name()?,
        pci_bus_id: device.pci_info().map(|p| p.bus_id).unwrap_or_default(),
        minor_number: device.minor_number().ok(),
        parent_gpu_uuid: None,
        mig_profile: None,
        mig_gpu_instance_id: None,
    })
}

/// The MIG profile name NVIDIA uses: `<slices>g.<memory GB>gb`, memory rounded up to
/// whole GB (9728 MiB → `10gb`, 4864 MiB → `5gb`, 40192 MiB → `40gb`).
pub fn mig_profile_name(slices: u32, memory_mib: u64) -> String {
    format!("{slices}g.{}gb", memory_mib.div_ceil(1024))
}

fn mig_instances(
    nvml: &'static Nvml,
    raw: Option<&RawNvml>,
    parent: &Device<'static>,
    parent_id: &GpuIdentity,
) -> Vec<NvmlGpu> {
    let max = match parent.mig_device_count() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(gpu = %parent_id.gpu_uuid, "MIG is enabled but instances cannot be listed: {e}");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for i in 0..max {
        // Empty MIG slots answer NOT_FOUND; that is the end of nothing, just a gap.
        let Ok(mig) = parent.mig_device_by_index(i) else { continue };
        let Ok(uuid) = mig.uuid() else { continue };
        let Ok(gpu_uuid) = GpuUuid::new(uuid) else { continue };
        let attrs = mig.attributes().ok();
        // SAFETY: `mig` is a live handle from this NVML.
        let gi = raw.and_then(|r| unsafe { r.gpu_instance_id(mig.handle()) }.ok());
        let identity = GpuIdentity {
            gpu_uuid,
            gpu_model: parent_id.gpu_model.clone(),
            parent_gpu_uuid: Some(parent_id.gpu_uuid.clone()),
            mig_profile: attrs.map(|a| mig_profile_name(a.gpu_instance_slice_count, a.memory_size_mb)),
            mig_gpu_instance_id: gi,
            ..parent_id.clone()
        };
        let Ok(parent_again) = nvml.device_by_index(parent_id.gpu_index) else { continue };
        out.push(NvmlGpu {
            identity,
            device: mig,
            mig_parent: Some((parent_again, gi.unwrap_or(0))),
            mig_enabled: false,
        });
    }
    out
}

impl GpuSource for NvmlSource {
    fn kind(&self) -> &'static str {
        "nvml"
    }

    fn inventory(&self) -> &[GpuIdentity] {
        &self.inventory
    }

    fn driver_version(&self) -> Option<String> {
        self.driver_version.clone()
    }

    fn sampler(&self, group: FieldGroup, attribution: &Arc<Attributor>) -> Option<Box<dyn Sampler>> {
        SAMPLERS.iter().find(|(g, _)| *g == group).map(|(_, make)| make(&self.shared, attribution))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_profile_names_match_nvidia() {
        assert_eq!(mig_profile_name(1, 9856), "1g.10gb");
        assert_eq!(mig_profile_name(1, 4864), "1g.5gb");
        assert_eq!(mig_profile_name(3, 40192), "3g.40gb");
        assert_eq!(mig_profile_name(7, 81408), "7g.80gb");
    }

    #[test]
    fn missing_library_names_what_was_tried_and_the_simulator() {
        let host = HostName::new("h").expect("valid");
        let err =
            NvmlSource::open(Some(Path::new("/nonexistent/libnvidia-ml.so")), &host, None, Duration::from_secs(1))
                .err()
                .expect("no such library");
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/libnvidia-ml.so"), "{msg}");
        assert!(msg.contains("--source sim"), "{msg}");
    }
}
