//! The GPU models the simulator knows, with the figures their NVML answers are built from.
//!
//! Names and memory sizes are what NVML reports on real boards; power, clock and
//! thermal figures are typical of SXM (H100, A100) and PCIe (L4) boards in a cooled
//! data-centre rack. What a model lacks is absent, not zero: GPM metrics exist only on
//! Hopper, NVLink only on SXM boards, memory temperature only with HBM.

use serde::Deserialize;

/// A GPU model in `sim.models`. Accepts the short name or NVML's exact name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
pub enum SimModel {
    #[serde(rename = "h100-80gb", alias = "NVIDIA H100 80GB HBM3", alias = "h100")]
    H100Sxm80,
    #[serde(rename = "a100-80gb", alias = "NVIDIA A100-SXM4-80GB")]
    A100Sxm80,
    #[serde(rename = "a100-40gb", alias = "NVIDIA A100-SXM4-40GB")]
    A100Sxm40,
    #[serde(rename = "l4", alias = "NVIDIA L4")]
    L4,
}

impl SimModel {
    pub const ALL: [SimModel; 4] = [SimModel::H100Sxm80, SimModel::A100Sxm80, SimModel::A100Sxm40, SimModel::L4];

    /// NVML's model name.
    pub const fn name(self) -> &'static str {
        self.spec().name
    }

    pub(crate) const fn spec(self) -> &'static Spec {
        match self {
            SimModel::H100Sxm80 => &H100_SXM_80,
            SimModel::A100Sxm80 => &A100_SXM_80,
            SimModel::A100Sxm40 => &A100_SXM_40,
            SimModel::L4 => &L4,
        }
    }
}

/// The figures of one model.
#[derive(Debug)]
pub(crate) struct Spec {
    pub name: &'static str,
    pub memory_mib: f64,
    /// Framebuffer the driver and firmware keep (NVML v2 `reserved`).
    pub reserved_mib: f64,
    /// Power with no CUDA context (P8).
    pub idle_w: f64,
    /// Power with a context held but no kernels running.
    pub context_w: f64,
    /// Enforced power limit (the TDP).
    pub limit_w: f64,
    pub sm_idle_mhz: f64,
    pub sm_max_mhz: f64,
    /// Where the SM clock settles when the board is at its power limit.
    pub sm_capped_mhz: f64,
    pub mem_idle_mhz: f64,
    pub mem_max_mhz: f64,
    /// Die temperature at idle power and its rise at the power limit, °C.
    pub temp_idle_c: f64,
    pub temp_rise_c: f64,
    /// HBM runs a few degrees above the die; `None` for GDDR boards (no sensor in NVML).
    pub hbm_offset_c: Option<f64>,
    /// Hopper: NVML GPM metrics (SM activity, tensor activity, …).
    pub gpm: bool,
    /// NVLink bandwidth per direction, all links, bytes/s; `None` without NVLink.
    pub nvlink_bytes_per_s: Option<f64>,
    /// PCIe bandwidth per direction, bytes/s.
    pub pcie_bytes_per_s: f64,
}

pub(crate) static H100_SXM_80: Spec = Spec {
    name: "NVIDIA H100 80GB HBM3",
    memory_mib: 81_559.0,
    reserved_mib: 579.0,
    idle_w: 70.0,
    context_w: 118.0,
    limit_w: 700.0,
    sm_idle_mhz: 345.0,
    sm_max_mhz: 1980.0,
    sm_capped_mhz: 1755.0,
    mem_idle_mhz: 2619.0,
    mem_max_mhz: 2619.0,
    temp_idle_c: 29.0,
    temp_rise_c: 42.0,
    hbm_offset_c: Some(4.0),
    gpm: true,
    // 18 NVLink4 links × 25 GB/s per direction.
    nvlink_bytes_per_s: Some(450e9),
    // PCIe Gen5 x16.
    pcie_bytes_per_s: 63e9,
};

pub(crate) static A100_SXM_80: Spec = Spec {
    name: "NVIDIA A100-SXM4-80GB",
    memory_mib: 81_920.0,
    reserved_mib: 598.0,
    idle_w: 55.0,
    context_w: 82.0,
    limit_w: 400.0,
    sm_idle_mhz: 210.0,
    sm_max_mhz: 1410.0,
    sm_capped_mhz: 1275.0,
    mem_idle_mhz: 1593.0,
    mem_max_mhz: 1593.0,
    temp_idle_c: 31.0,
    temp_rise_c: 36.0,
    hbm_offset_c: Some(3.0),
    gpm: false,
    // 12 NVLink3 links × 25 GB/s per direction.
    nvlink_bytes_per_s: Some(300e9),
    pcie_bytes_per_s: 31.5e9,
};

pub(crate) static A100_SXM_40: Spec = Spec {
    name: "NVIDIA A100-SXM4-40GB",
    memory_mib: 40_960.0,
    reserved_mib: 448.0,
    idle_w: 50.0,
    context_w: 76.0,
    limit_w: 400.0,
    sm_idle_mhz: 210.0,
    sm_max_mhz: 1410.0,
    sm_capped_mhz: 1275.0,
    mem_idle_mhz: 1215.0,
    mem_max_mhz: 1215.0,
    temp_idle_c: 30.0,
    temp_rise_c: 36.0,
    hbm_offset_c: Some(3.0),
    gpm: false,
    nvlink_bytes_per_s: Some(300e9),
    pcie_bytes_per_s: 31.5e9,
};

pub(crate) static L4: Spec = Spec {
    name: "NVIDIA L4",
    memory_mib: 23_034.0,
    reserved_mib: 290.0,
    idle_w: 16.0,
    context_w: 21.0,
    limit_w: 72.0,
    sm_idle_mhz: 210.0,
    sm_max_mhz: 2040.0,
    sm_capped_mhz: 1830.0,
    mem_idle_mhz: 405.0,
    mem_max_mhz: 6251.0,
    // Passively cooled, single slot: runs warmer.
    temp_idle_c: 36.0,
    temp_rise_c: 40.0,
    hbm_offset_c: None,
    gpm: false,
    nvlink_bytes_per_s: None,
    pcie_bytes_per_s: 31.5e9,
};

/// PCI bus numbers of the eight GPUs of an HGX baseboard, in NVML index order.
const HGX_BUSES: [u8; 8] = [0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb];

/// The PCI bus id NVML prints (`00000000:18:00.0`) for GPU `index` of a node.
pub(crate) fn pci_bus_id(index: u32) -> String {
    let bus = HGX_BUSES.get(index as usize).copied().unwrap_or_else(|| 0xe0u8.wrapping_add(index as u8));
    format!("00000000:{bus:02X}:00.0")
}
