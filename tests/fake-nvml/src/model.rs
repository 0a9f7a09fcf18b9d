//! The validated, precomputed machine that the exported functions read.
//!
//! A [`Model`] is built once per `nvmlInit` (when the reference count leaves zero)
//! from the scenario file, and is immutable afterwards; everything that changes
//! with time is a pure function of the clock (timelines, counters, events).

use crate::codes::{self, Ret};
use crate::scenario::{self, Architecture, Counter, ProcessType, Profile, Scenario, Values};
use crate::timeline::{M, N_METRICS, Row, Timeline};
use std::collections::{BTreeMap, HashSet};

pub const MIB: f64 = 1024.0 * 1024.0;
/// Compute slices of a full A100/H100 (the `7` in `7g.80gb`).
pub const MIG_MAX_SLICES: u32 = 7;
/// MIG device handles per GPU (NVML's nvmlDeviceGetMaxMigDeviceCount on A100/H100).
pub const MAX_MIG_DEVICES: usize = 7;
pub const MAX_GPUS: usize = 64;

/// The scenario used when `FAKE_NVML_SCENARIO` is unset.
pub const DEFAULT_SCENARIO: &str = include_str!("../scenarios/basic.toml");

#[derive(Debug)]
pub struct Model {
    pub driver_version: String,
    pub nvml_version: String,
    pub cuda_driver_version: i32,
    pub init_error: Option<Ret>,
    pub latency_sleep: bool,
    pub latency_us: BTreeMap<String, u64>,
    pub gpus: Vec<GpuModel>,
}

#[derive(Debug)]
pub struct GpuModel {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
    pub pci_device_id: u32,
    pub pci_subsystem_id: u32,
    pub serial: String,
    pub minor_number: u32,
    pub arch: Architecture,
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    pub reserved_bytes: u64,
    pub power_limit_mw: u32,
    pub power_default_limit_mw: u32,
    pub sm_count: u32,
    pub nvlink_links: u32,
    pub max_sm_clock_mhz: u32,
    pub max_mem_clock_mhz: u32,
    pub sample_period_us: u64,
    pub sample_buffer_depth: u32,
    pub ecc_enabled: bool,
    pub mig_capable: bool,
    pub mig_mode: bool,
    pub unsupported: HashSet<String>,
    pub unsupported_fields: HashSet<u32>,
    /// Nanoseconds after init at which the GPU is lost.
    pub lost_after_ns: Option<i64>,
    /// XIDs as (ns after init, code), in time order, including the one raised on loss.
    pub xids: Vec<(i64, u64)>,
    pub health: scenario::Health,
    pub timeline: Timeline,
    pub processes: Vec<ProcModel>,
    pub mig: Vec<MigModel>,
}

#[derive(Debug)]
pub struct MigModel {
    pub gi_id: u32,
    pub ci_id: u32,
    pub profile: String,
    pub gi_slices: u32,
    pub ci_slices: u32,
    pub memory_bytes: u64,
    pub sm_count: u32,
    pub uuid: String,
    pub name: String,
    pub timeline: Timeline,
    pub processes: Vec<ProcModel>,
}

#[derive(Debug, Clone)]
pub struct ProcModel {
    pub pid: u32,
    pub name: String,
    pub used_bytes: u64,
    pub kind: ProcessType,
    pub sm_share: f64,
    pub mem_share: f64,
}

impl GpuModel {
    /// Hopper and later have GPM; Ampere/Ada answer NOT_SUPPORTED like real drivers.
    pub fn gpm_supported(&self) -> bool {
        matches!(self.arch, Architecture::Hopper | Architecture::Blackwell)
    }

    pub fn arch_code(&self) -> u32 {
        match self.arch {
            Architecture::Kepler => 2,
            Architecture::Maxwell => 3,
            Architecture::Pascal => 4,
            Architecture::Volta => 5,
            Architecture::Turing => 6,
            Architecture::Ampere => 7,
            Architecture::Ada => 8,
            Architecture::Hopper => 9,
            Architecture::Blackwell => 10,
        }
    }

    pub fn bus_id(&self) -> String {
        format!("{:08X}:{:02X}:{:02X}.0", self.domain, self.bus, self.device)
    }

    pub fn bus_id_legacy(&self) -> String {
        format!("{:04X}:{:02X}:{:02X}.0", self.domain, self.bus, self.device)
    }

    /// Counter value at `now`, counted from init.
    pub fn counter(c: Counter, init_ns: i64, now: i64) -> u64 {
        match c {
            Counter::Constant(v) => v,
            Counter::Growing(g) => {
                let secs = ((now - init_ns).max(0)) as f64 / 1e9;
                g.start.saturating_add((g.per_s * secs).floor().max(0.0) as u64)
            }
        }
    }
}

/// Parses "00000000:18:00.0" or "0000:18:00.0" into (domain, bus, device).
pub fn parse_bus_id(s: &str) -> Option<(u32, u32, u32)> {
    let s = s.trim();
    let (domain, rest) = s.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    if function.is_empty() || u32::from_str_radix(function, 16).is_err() {
        return None;
    }
    Some((
        u32::from_str_radix(domain, 16).ok()?,
        u32::from_str_radix(bus, 16).ok()?,
        u32::from_str_radix(device, 16).ok()?,
    ))
}

fn idle_defaults(arch: Architecture, power_limit_w: f64, max_mem_clock: u32) -> Row {
    let mut r = [0.0; N_METRICS];
    r[M::PowerW as usize] = (power_limit_w * 0.1).round();
    r[M::SmClock as usize] = match arch {
        Architecture::Hopper | Architecture::Blackwell => 345.0,
        _ => 210.0,
    };
    r[M::MemClock as usize] = f64::from(max_mem_clock);
    r[M::TempC as usize] = 32.0;
    r[M::MemTempC as usize] = 30.0;
    // nvmlClocksEventReasonGpuIdle: what an idle board reports.
    r[M::Throttle as usize] = 1.0;
    r
}

/// The value row a `Values` layer gives, as `Option`s so layers can be stacked.
fn layer(v: &Values) -> [Option<f64>; N_METRICS] {
    let mut r = [None; N_METRICS];
    let set = |r: &mut [Option<f64>; N_METRICS], m: M, x: Option<f64>| r[m as usize] = x;
    set(&mut r, M::GpuUtil, v.gpu_util);
    set(&mut r, M::MemUtil, v.mem_util);
    set(&mut r, M::EncUtil, v.enc_util);
    set(&mut r, M::DecUtil, v.dec_util);
    set(&mut r, M::GrActive, v.gr_active);
    set(&mut r, M::SmActive, v.sm_active);
    set(&mut r, M::SmOccupancy, v.sm_occupancy);
    set(&mut r, M::IntActive, v.int_active);
    set(&mut r, M::TensorActive, v.tensor_active);
    set(&mut r, M::TensorDfma, v.tensor_dfma_active);
    set(&mut r, M::TensorHmma, v.tensor_hmma_active);
    set(&mut r, M::TensorImma, v.tensor_imma_active);
    set(&mut r, M::DramActive, v.dram_active);
    set(&mut r, M::Fp64, v.fp64_active);
    set(&mut r, M::Fp32, v.fp32_active);
    set(&mut r, M::Fp16, v.fp16_active);
    set(&mut r, M::PowerW, v.power_w);
    set(&mut r, M::FbUsedMib, v.fb_used_mib);
    set(&mut r, M::PcieTx, v.pcie_tx_bytes_per_s);
    set(&mut r, M::PcieRx, v.pcie_rx_bytes_per_s);
    set(&mut r, M::NvlinkTx, v.nvlink_tx_bytes_per_s);
    set(&mut r, M::NvlinkRx, v.nvlink_rx_bytes_per_s);
    set(&mut r, M::SmClock, v.sm_clock_mhz);
    set(&mut r, M::MemClock, v.mem_clock_mhz);
    set(&mut r, M::TempC, v.temp_c);
    set(&mut r, M::MemTempC, v.mem_temp_c);
    set(&mut r, M::Throttle, v.throttle_reasons.map(|b| b as f64));
    r
}

fn resolve(seg: &[Option<f64>; N_METRICS], idle: &[Option<f64>; N_METRICS], defaults: &Row) -> Row {
    let mut row = *defaults;
    for i in 0..N_METRICS {
        if let Some(v) = seg[i].or(idle[i]) {
            row[i] = v;
        }
    }
    // GPM's GRAPHICS_UTIL is "time any context was active", the same notion as
    // NVML's gpu_util, so it follows gpu_util unless a scenario says otherwise.
    let gr = M::GrActive as usize;
    if seg[gr].is_none() && idle[gr].is_none() {
        row[gr] = row[M::GpuUtil as usize] / 100.0;
    }
    row
}

fn check_ranges(row: &Row, what: &str) -> Result<(), String> {
    let pct = [M::GpuUtil, M::MemUtil, M::EncUtil, M::DecUtil];
    for m in pct {
        let v = row[m as usize];
        if !(0.0..=100.0).contains(&v) {
            return Err(format!("{what}: {m:?} = {v} is outside 0–100"));
        }
    }
    let ratios = [
        M::GrActive,
        M::SmActive,
        M::SmOccupancy,
        M::IntActive,
        M::TensorActive,
        M::TensorDfma,
        M::TensorHmma,
        M::TensorImma,
        M::DramActive,
        M::Fp64,
        M::Fp32,
        M::Fp16,
    ];
    for m in ratios {
        let v = row[m as usize];
        if !(0.0..=1.0).contains(&v) {
            return Err(format!("{what}: {m:?} = {v} is outside 0–1 (ratios, not percent)"));
        }
    }
    for (i, v) in row.iter().enumerate() {
        if !v.is_finite() || *v < 0.0 {
            return Err(format!("{what}: value #{i} = {v} must be finite and ≥ 0"));
        }
    }
    Ok(())
}

fn build_timeline(profile: Option<&Profile>, idle: &Values, defaults: &Row, what: &str) -> Result<Timeline, String> {
    let idle_layer = layer(idle);
    let none = [None; N_METRICS];
    let idle_row = resolve(&none, &idle_layer, defaults);
    check_ranges(&idle_row, &format!("{what} idle"))?;
    let Some(p) = profile else {
        return Ok(Timeline::new(1_000_000_000, &[], idle_row));
    };
    if p.period_ms == 0 {
        return Err(format!("{what}: profile.period_ms must be > 0"));
    }
    let period = i64::try_from(p.period_ms).map_err(|_| format!("{what}: period too long"))?.saturating_mul(1_000_000);
    let mut spans = Vec::new();
    let mut segs: Vec<_> = p.segments.iter().collect();
    segs.sort_by_key(|s| s.start_ms);
    let mut last_end = 0;
    for s in segs {
        if s.start_ms >= s.end_ms || s.end_ms > p.period_ms {
            return Err(format!(
                "{what}: segment [{}, {}) must satisfy start < end <= period_ms ({})",
                s.start_ms, s.end_ms, p.period_ms
            ));
        }
        if s.start_ms < last_end {
            return Err(format!("{what}: segment starting at {} ms overlaps the previous one", s.start_ms));
        }
        last_end = s.end_ms;
        let row = resolve(&layer(&s.values()), &idle_layer, defaults);
        check_ranges(&row, &format!("{what} segment at {} ms", s.start_ms))?;
        spans.push((s.start_ms as i64 * 1_000_000, s.end_ms as i64 * 1_000_000, row));
    }
    Ok(Timeline::new(period, &spans, idle_row))
}

fn build_processes(ps: &[scenario::Process], what: &str) -> Result<Vec<ProcModel>, String> {
    let set_sm: f64 = ps.iter().filter_map(|p| p.sm_share).sum();
    let set_mem: f64 = ps.iter().filter_map(|p| p.mem_share).sum();
    let unset_sm = ps.iter().filter(|p| p.sm_share.is_none()).count();
    let unset_mem = ps.iter().filter(|p| p.mem_share.is_none()).count();
    if set_sm > 1.0 + 1e-9 || set_mem > 1.0 + 1e-9 {
        return Err(format!("{what}: process sm_share/mem_share add up to more than 1"));
    }
    let fill = |set: f64, unset: usize| {
        if unset == 0 { 0.0 } else { (1.0 - set) / unset as f64 }
    };
    let mut pids = HashSet::new();
    ps.iter()
        .map(|p| {
            if !pids.insert(p.pid) {
                return Err(format!("{what}: pid {} listed twice", p.pid));
            }
            for s in [p.sm_share, p.mem_share].into_iter().flatten() {
                if !(0.0..=1.0).contains(&s) {
                    return Err(format!("{what}: pid {} share {s} is outside 0–1", p.pid));
                }
            }
            Ok(ProcModel {
                pid: p.pid,
                name: p.name.clone(),
                used_bytes: p.used_memory_mib * 1024 * 1024,
                kind: p.kind,
                sm_share: p.sm_share.unwrap_or(fill(set_sm, unset_sm)),
                mem_share: p.mem_share.unwrap_or(fill(set_mem, unset_mem)),
            })
        })
        .collect()
}

fn default_cc(arch: Architecture, name: &str) -> (i32, i32) {
    match arch {
        Architecture::Kepler => (3, 7),
        Architecture::Maxwell => (5, 2),
        Architecture::Pascal => (6, 0),
        Architecture::Volta => (7, 0),
        Architecture::Turing => (7, 5),
        // A100/A30 are sm_80; the rest of the Ampere line (A10, A40, RTX 30) is sm_86.
        Architecture::Ampere if name.contains("A100") || name.contains("A30") => (8, 0),
        Architecture::Ampere => (8, 6),
        Architecture::Ada => (8, 9),
        Architecture::Hopper => (9, 0),
        Architecture::Blackwell => (10, 0),
    }
}

fn default_sm_count(arch: Architecture, name: &str) -> u32 {
    match arch {
        Architecture::Hopper if name.contains("PCIe") => 114,
        Architecture::Hopper => 132,
        Architecture::Ampere if name.contains("A100") => 108,
        Architecture::Ampere if name.contains("A30") => 56,
        Architecture::Ada if name.contains("L4") => 58,
        Architecture::Blackwell => 148,
        _ => 80,
    }
}

fn mig_slices_from_profile(profile: &str) -> Option<u32> {
    // "3g.40gb" → 3; "1c.3g.40gb" (compute-instance profiles) → the gi part.
    let gi = profile.split('.').find(|p| p.ends_with('g'))?;
    gi.trim_end_matches('g').parse().ok()
}

impl Model {
    pub fn from_toml(text: &str, exported: &[&str]) -> Result<Model, String> {
        let sc: Scenario = toml::from_str(text).map_err(|e| e.to_string())?;
        Model::from_scenario(sc, exported)
    }

    pub fn from_scenario(sc: Scenario, exported: &[&str]) -> Result<Model, String> {
        let init_error = match &sc.init_error {
            None => None,
            Some(n) => Some(codes::by_name(n).ok_or_else(|| format!("init_error: unknown NVML error name {n:?}"))?),
        };
        for f in sc.latency_us.keys() {
            if !exported.contains(&f.as_str()) {
                return Err(format!("latency_us: {f:?} is not a function this library exports"));
            }
        }
        if sc.gpus.len() > MAX_GPUS {
            return Err(format!("at most {MAX_GPUS} GPUs are modelled"));
        }
        let mut uuids = HashSet::new();
        let mut buses = HashSet::new();
        let mut gpus = Vec::new();
        for (pos, g) in sc.gpus.into_iter().enumerate() {
            let what = format!("gpus[{pos}]");
            if g.index as usize != pos {
                return Err(format!("{what}: index {} must equal its position {pos}", g.index));
            }
            if !g.uuid.starts_with("GPU-") || !uuids.insert(g.uuid.clone()) {
                return Err(format!("{what}: uuid {:?} must start with GPU- and be unique", g.uuid));
            }
            let (domain, bus, device) =
                parse_bus_id(&g.pci_bus_id).ok_or_else(|| format!("{what}: bad pci_bus_id {:?}", g.pci_bus_id))?;
            if !buses.insert((domain, bus, device)) {
                return Err(format!("{what}: pci_bus_id {} is used twice", g.pci_bus_id));
            }
            for f in &g.unsupported {
                if !exported.contains(&f.as_str()) {
                    return Err(format!("{what}: unsupported: {f:?} is not a function this library exports"));
                }
            }
            if g.sample_period_us == 0 || g.sample_buffer_depth == 0 {
                return Err(format!("{what}: sample_period_us and sample_buffer_depth must be > 0"));
            }
            if g.memory_reserved_mib >= g.memory_total_mib {
                return Err(format!("{what}: memory_reserved_mib must be below memory_total_mib"));
            }
            // A100/A30 and every Hopper/Blackwell data-centre part can run MIG.
            let mig_capable = g.mig_capable.unwrap_or(
                g.mig_mode
                    || matches!(g.architecture, Architecture::Hopper | Architecture::Blackwell)
                    || g.name.contains("A100")
                    || g.name.contains("A30"),
            );
            if g.mig_mode && !mig_capable {
                return Err(format!("{what}: mig_mode needs mig_capable"));
            }
            if !g.mig_mode && !g.mig.is_empty() {
                return Err(format!("{what}: MIG instances listed but mig_mode = false"));
            }
            let max_mem_clock = g.max_mem_clock_mhz.unwrap_or(match g.architecture {
                Architecture::Hopper => 2619,
                Architecture::Ampere => 1593,
                Architecture::Ada => 6251,
                _ => 1750,
            });
            let max_sm_clock = g.max_sm_clock_mhz.unwrap_or(match g.architecture {
                Architecture::Hopper => 1980,
                Architecture::Ampere => 1410,
                Architecture::Ada => 2040,
                _ => 1500,
            });
            let defaults = idle_defaults(g.architecture, g.power_limit_w, max_mem_clock);
            let timeline = build_timeline(g.profile.as_ref(), &g.idle, &defaults, &what)?;
            let sm_count = g.sm_count.unwrap_or(default_sm_count(g.architecture, &g.name));

            let mut mig = Vec::new();
            let mut gi_ids = HashSet::new();
            let mut slices = 0;
            let mut mig_mem = 0;
            if g.mig.len() > MAX_MIG_DEVICES {
                return Err(format!("{what}: at most {MAX_MIG_DEVICES} MIG devices"));
            }
            for (j, m) in g.mig.iter().enumerate() {
                let mwhat = format!("{what}.mig[{j}]");
                if !m.uuid.starts_with("MIG-") || !uuids.insert(m.uuid.clone()) {
                    return Err(format!("{mwhat}: uuid {:?} must start with MIG- and be unique", m.uuid));
                }
                if !gi_ids.insert(m.gi_id) {
                    return Err(format!("{mwhat}: gi_id {} used twice", m.gi_id));
                }
                let gi_slices = m
                    .gi_slices
                    .or_else(|| mig_slices_from_profile(&m.mig_profile))
                    .ok_or_else(|| format!("{mwhat}: cannot tell slices from {:?}; set gi_slices", m.mig_profile))?;
                slices += gi_slices;
                mig_mem += m.memory_mib;
                let mut mdefaults = [0.0; N_METRICS];
                // Device-level quantities belong to the parent; an instance only
                // carries activity and its own memory use.
                mdefaults[M::Throttle as usize] = 0.0;
                let timeline = build_timeline(m.profile.as_ref(), &m.idle, &mdefaults, &mwhat)?;
                mig.push(MigModel {
                    gi_id: m.gi_id,
                    ci_id: m.ci_id,
                    profile: m.mig_profile.clone(),
                    gi_slices,
                    ci_slices: m.ci_slices.unwrap_or(gi_slices),
                    memory_bytes: m.memory_mib * 1024 * 1024,
                    sm_count: m.sm_count.unwrap_or(gi_slices * sm_count / MIG_MAX_SLICES),
                    uuid: m.uuid.clone(),
                    name: format!("{} MIG {}", g.name, m.mig_profile),
                    timeline,
                    processes: build_processes(&m.processes, &mwhat)?,
                });
            }
            if slices > MIG_MAX_SLICES {
                return Err(format!("{what}: MIG instances use {slices} slices, more than {MIG_MAX_SLICES}"));
            }
            if mig_mem > g.memory_total_mib {
                return Err(format!("{what}: MIG instances use more memory than the GPU has"));
            }

            let init_relative = |s: f64, field: &str| -> Result<i64, String> {
                if s.is_finite() && s >= 0.0 {
                    Ok((s * 1e9).round() as i64)
                } else {
                    Err(format!("{what}: {field} must be a finite number ≥ 0"))
                }
            };
            let lost_after_ns = g.lost_after_s.map(|s| init_relative(s, "lost_after_s")).transpose()?;
            let mut xids = g
                .xids
                .iter()
                .map(|x| Ok((init_relative(x.at_after_init_s, "xids.at_after_init_s")?, x.code)))
                .collect::<Result<Vec<_>, String>>()?;
            if let (Some(at), true) = (lost_after_ns, g.lost_xid != 0) {
                xids.push((at, g.lost_xid));
            }
            xids.sort_by_key(|x| x.0);

            let processes = build_processes(&g.processes, &what)?;
            gpus.push(GpuModel {
                index: g.index,
                uuid: g.uuid.clone(),
                serial: g.serial.clone().unwrap_or_else(|| format!("165292201{:04}", g.index)),
                minor_number: g.minor_number.unwrap_or(g.index),
                pci_device_id: g.pci_device_id.unwrap_or(0x2330_10DE),
                pci_subsystem_id: g.pci_subsystem_id.unwrap_or(0x16C1_10DE),
                compute_capability: g.compute_capability.unwrap_or(default_cc(g.architecture, &g.name)),
                name: g.name,
                domain,
                bus,
                device,
                arch: g.architecture,
                total_bytes: g.memory_total_mib * 1024 * 1024,
                reserved_bytes: g.memory_reserved_mib * 1024 * 1024,
                power_limit_mw: (g.power_limit_w * 1000.0).round() as u32,
                power_default_limit_mw: (g.power_default_limit_w.unwrap_or(g.power_limit_w) * 1000.0).round() as u32,
                sm_count,
                nvlink_links: g.nvlink_links,
                max_sm_clock_mhz: max_sm_clock,
                max_mem_clock_mhz: max_mem_clock,
                sample_period_us: g.sample_period_us,
                sample_buffer_depth: g.sample_buffer_depth,
                ecc_enabled: g.ecc_enabled,
                mig_capable,
                mig_mode: g.mig_mode,
                unsupported: g.unsupported.into_iter().collect(),
                unsupported_fields: g.unsupported_fields.into_iter().collect(),
                lost_after_ns,
                xids,
                health: g.health,
                timeline,
                processes,
                mig,
            });
        }
        let nvml_version = sc.nvml_version.unwrap_or_else(|| format!("12.{}", sc.driver_version));
        Ok(Model {
            driver_version: sc.driver_version,
            nvml_version,
            cuda_driver_version: sc.cuda_driver_version,
            init_error,
            latency_sleep: sc.latency_mode == scenario::LatencyMode::Sleep,
            latency_us: sc.latency_us,
            gpus,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_parse_in_both_widths() {
        assert_eq!(parse_bus_id("00000000:18:00.0"), Some((0, 0x18, 0)));
        assert_eq!(parse_bus_id("0001:AF:1f.0"), Some((1, 0xAF, 0x1F)));
        assert_eq!(parse_bus_id("18:00.0"), None);
    }

    #[test]
    fn shipped_scenarios_are_valid() {
        for (name, text) in [
            ("basic", include_str!("../scenarios/basic.toml")),
            ("mixed", include_str!("../scenarios/mixed.toml")),
            ("lost", include_str!("../scenarios/lost.toml")),
            ("init_fail", include_str!("../scenarios/init_fail.toml")),
            ("unsupported", include_str!("../scenarios/unsupported.toml")),
        ] {
            if let Err(e) = Model::from_toml(text, crate::EXPORTED) {
                panic!("{name}.toml: {e}");
            }
        }
    }

    #[test]
    fn typos_are_rejected() {
        let base = "[[gpus]]\nindex = 0\nuuid = \"GPU-1\"\nname = \"x\"\npci_bus_id = \"0000:01:00.0\"\narchitecture = \"hopper\"\nmemory_total_mib = 1000\npower_limit_w = 100\n";
        assert!(Model::from_toml(base, crate::EXPORTED).is_ok());
        assert!(Model::from_toml(&format!("{base}gpu_utl = 3\n"), crate::EXPORTED).is_err());
        assert!(
            Model::from_toml(&format!("{base}unsupported = [\"nvmlDeviceGetSample\"]\n"), crate::EXPORTED).is_err()
        );
        let overlap = format!(
            "{base}[gpus.profile]\nperiod_ms = 100\nsegments = [{{ start_ms = 0, end_ms = 50, gpu_util = 1 }}, {{ start_ms = 40, end_ms = 60 }}]\n"
        );
        assert!(Model::from_toml(&overlap, crate::EXPORTED).unwrap_err().contains("overlaps"));
        let pct = format!("{base}[gpus.idle]\nsm_active = 50\n");
        assert!(Model::from_toml(&pct, crate::EXPORTED).unwrap_err().contains("ratios"));
    }

    #[test]
    fn mig_profile_slices() {
        assert_eq!(mig_slices_from_profile("3g.40gb"), Some(3));
        assert_eq!(mig_slices_from_profile("1g.10gb"), Some(1));
        assert_eq!(mig_slices_from_profile("1c.3g.40gb"), Some(3));
    }
}
