//! The scenario file: what the fake driver's GPUs are and what they do over time.
//!
//! These are the serde shapes of the TOML file only; `model` turns them into the
//! validated, precomputed form that the exported functions read. The format is
//! documented with examples in `tests/fake-nvml/README.md`; keep the two in step.

use serde::Deserialize;

/// The whole file. `deny_unknown_fields` everywhere: a typo in a test scenario must
/// fail loudly at `nvmlInit`, not silently model a different machine.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// `nvmlSystemGetDriverVersion`. nvml-wrapper picks its field-ID numbering from it.
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    /// `nvmlSystemGetNVMLVersion`; defaults to "12." + driver version like real drivers.
    pub nvml_version: Option<String>,
    /// `nvmlSystemGetCudaDriverVersion(_v2)`, e.g. 12080 for CUDA 12.8.
    #[serde(default = "default_cuda_version")]
    pub cuda_driver_version: i32,
    /// Makes `nvmlInit*` fail with this code ("DRIVER_NOT_LOADED", "NO_PERMISSION", ...).
    pub init_error: Option<String>,
    /// How `[latency_us]` is spent: "spin" (busy-wait, like a driver ioctl that burns
    /// CPU) or "sleep".
    #[serde(default)]
    pub latency_mode: LatencyMode,
    /// Added latency per exported function name, in microseconds.
    #[serde(default)]
    pub latency_us: std::collections::BTreeMap<String, u64>,
    #[serde(default)]
    pub gpus: Vec<Gpu>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LatencyMode {
    #[default]
    Spin,
    Sleep,
}

fn default_driver_version() -> String {
    "570.172.08".to_owned()
}

fn default_cuda_version() -> i32 {
    12080
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Kepler,
    Maxwell,
    Pascal,
    Volta,
    Turing,
    Ampere,
    Ada,
    Hopper,
    Blackwell,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// Must equal the position in `gpus` (NVML indices are dense from 0).
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// "00000000:18:00.0" (a 4-digit domain is accepted and widened).
    pub pci_bus_id: String,
    /// Combined device/vendor id as NVML reports it (0x233010DE for H100 SXM5).
    pub pci_device_id: Option<u32>,
    pub pci_subsystem_id: Option<u32>,
    pub serial: Option<String>,
    pub minor_number: Option<u32>,
    pub architecture: Architecture,
    /// (major, minor); defaults from the architecture.
    pub compute_capability: Option<(i32, i32)>,
    pub memory_total_mib: u64,
    #[serde(default = "default_reserved_mib")]
    pub memory_reserved_mib: u64,
    pub power_limit_w: f64,
    pub power_default_limit_w: Option<f64>,
    pub sm_count: Option<u32>,
    /// Active NVLink links; 0 means no NVLink (PCIe card): NVLink fields are NOT_SUPPORTED.
    #[serde(default)]
    pub nvlink_links: u32,
    pub max_sm_clock_mhz: Option<u32>,
    pub max_mem_clock_mhz: Option<u32>,
    /// Driver utilisation sample period (µs); real drivers use 1/6 s on most boards.
    #[serde(default = "default_sample_period_us")]
    pub sample_period_us: u64,
    /// Samples kept in the driver's ring buffer.
    #[serde(default = "default_depth")]
    pub sample_buffer_depth: u32,
    #[serde(default = "default_true")]
    pub ecc_enabled: bool,
    /// Defaults to true for A100/A30 and Hopper/Blackwell, false otherwise.
    pub mig_capable: Option<bool>,
    #[serde(default)]
    pub mig_mode: bool,
    /// Exported function names that return NOT_SUPPORTED for this GPU.
    #[serde(default)]
    pub unsupported: Vec<String>,
    /// Field ids (`nvmlDeviceGetFieldValues`) that report NOT_SUPPORTED for this GPU.
    #[serde(default)]
    pub unsupported_fields: Vec<u32>,
    /// Seconds after `nvmlInit` at which the GPU falls off the bus.
    pub lost_after_s: Option<f64>,
    /// XID raised when the GPU is lost (79 = fallen off the bus); 0 raises none.
    #[serde(default = "default_lost_xid")]
    pub lost_xid: u64,
    #[serde(default)]
    pub xids: Vec<Xid>,
    #[serde(default)]
    pub health: Health,
    /// Baseline values: what the GPU reads outside profile segments.
    #[serde(default)]
    pub idle: Values,
    pub profile: Option<Profile>,
    #[serde(default)]
    pub processes: Vec<Process>,
    #[serde(default)]
    pub mig: Vec<MigInstance>,
}

fn default_reserved_mib() -> u64 {
    512
}
fn default_sample_period_us() -> u64 {
    166_667
}
fn default_depth() -> u32 {
    120
}
fn default_true() -> bool {
    true
}
fn default_lost_xid() -> u64 {
    79
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Xid {
    pub at_after_init_s: f64,
    pub code: u64,
}

/// A counter that is either constant or grows linearly from `nvmlInit`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Counter {
    Constant(u64),
    Growing(GrowingCounter),
}

impl Default for Counter {
    fn default() -> Self {
        Counter::Constant(0)
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrowingCounter {
    #[serde(default)]
    pub start: u64,
    pub per_s: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Health {
    #[serde(default)]
    pub ecc_sbe_volatile: Counter,
    #[serde(default)]
    pub ecc_dbe_volatile: Counter,
    #[serde(default)]
    pub ecc_sbe_aggregate: Counter,
    #[serde(default)]
    pub ecc_dbe_aggregate: Counter,
    #[serde(default)]
    pub remapped_corr: Counter,
    #[serde(default)]
    pub remapped_unc: Counter,
    #[serde(default)]
    pub remapped_pending: bool,
    #[serde(default)]
    pub remapped_failure: bool,
    #[serde(default)]
    pub pcie_replay: Counter,
}

/// A periodic, piecewise-constant activity pattern anchored at the Unix epoch:
/// at wall-clock time `t` the pattern is at offset `t mod period`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub period_ms: u64,
    #[serde(default)]
    pub segments: Vec<Segment>,
}

/// Declares [`Values`] and [`Segment`] from one field list: a segment is the same
/// set of quantities plus its time span, and serde's `flatten` cannot be combined
/// with `deny_unknown_fields`.
macro_rules! values_structs {
    ($($(#[$doc:meta])* $field:ident : $ty:ty,)*) => {
        /// Every quantity the fake can vary over time. Unset in a segment means "the
        /// baseline (`idle`) value"; unset in the baseline means the built-in idle default.
        #[derive(Debug, Clone, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Values {
            $($(#[$doc])* pub $field: Option<$ty>,)*
        }

        /// One constant stretch `[start_ms, end_ms)` of a [`Profile`] period.
        #[derive(Debug, Clone, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Segment {
            pub start_ms: u64,
            pub end_ms: u64,
            $(pub $field: Option<$ty>,)*
        }

        impl Segment {
            pub fn values(&self) -> Values {
                Values { $($field: self.$field,)* }
            }
        }
    };
}

values_structs! {
    /// Percent 0–100: time a kernel ran (NVML "GPU utilisation").
    gpu_util: f64,
    /// Percent 0–100: time device memory was read or written.
    mem_util: f64,
    enc_util: f64,
    dec_util: f64,
    /// Ratios 0–1 (DCGM profiling semantics); GPM reports them ×100.
    gr_active: f64,
    sm_active: f64,
    sm_occupancy: f64,
    int_active: f64,
    tensor_active: f64,
    tensor_dfma_active: f64,
    tensor_hmma_active: f64,
    tensor_imma_active: f64,
    dram_active: f64,
    fp64_active: f64,
    fp32_active: f64,
    fp16_active: f64,
    power_w: f64,
    fb_used_mib: f64,
    pcie_tx_bytes_per_s: f64,
    pcie_rx_bytes_per_s: f64,
    nvlink_tx_bytes_per_s: f64,
    nvlink_rx_bytes_per_s: f64,
    sm_clock_mhz: f64,
    mem_clock_mhz: f64,
    temp_c: f64,
    mem_temp_c: f64,
    /// `nvmlClocksEventReason*` bitmask.
    throttle_reasons: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum ProcessType {
    #[default]
    #[serde(rename = "C")]
    Compute,
    #[serde(rename = "G")]
    Graphics,
    #[serde(rename = "C+G")]
    Both,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Process {
    pub pid: u32,
    pub name: String,
    #[serde(default)]
    pub used_memory_mib: u64,
    #[serde(default, rename = "type")]
    pub kind: ProcessType,
    /// Share (0–1) of the GPU's (or MIG instance's) utilisation this process accounts
    /// for; unset shares split what the set ones leave equally.
    pub sm_share: Option<f64>,
    pub mem_share: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigInstance {
    pub gi_id: u32,
    #[serde(default)]
    pub ci_id: u32,
    /// "3g.40gb", "1g.10gb", ...: gives the slice count and the MIG device's name.
    pub mig_profile: String,
    pub gi_slices: Option<u32>,
    pub ci_slices: Option<u32>,
    pub memory_mib: u64,
    pub sm_count: Option<u32>,
    pub uuid: String,
    #[serde(default)]
    pub idle: Values,
    pub profile: Option<Profile>,
    #[serde(default)]
    pub processes: Vec<Process>,
}
