//! MIG profiles per GPU class, and the smallest profile that holds a workload.
//!
//! A profile is `<g>g.<m>gb`: `g` compute slices of 7 and a memory share of 8 slices
//! (NVIDIA's "Supported MIG Profiles"; mig-parted's default config). The memory we check a
//! workload against is the profile's **nominal** size in decimal gigabytes (`10gb` =
//! 10·10⁹ bytes), which is slightly below what the slice really holds (1g.10gb on an
//! H100 80GB is 9.75 GiB ≈ 10.47 GB), so a fit is conservative.
//!
//! The choice follows Kruize: the smallest profile whose compute share (g/7) and memory
//! both cover the workload's need, smallest by compute slices, then memory slices.

use serde::Serialize;

/// One MIG profile of a GPU class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MigProfile {
    pub name: &'static str,
    /// Compute slices out of 7 (its share of the SMs is `compute / 7`).
    pub compute: u8,
    /// Memory slices out of 8.
    pub memory: u8,
    /// Nominal memory in bytes (decimal GB from the name).
    pub memory_bytes: i64,
}

impl MigProfile {
    /// The share of the GPU's SMs this profile holds.
    pub fn compute_share(&self) -> f64 {
        f64::from(self.compute) / 7.0
    }
}

const GB: i64 = 1_000_000_000;

const fn p(name: &'static str, compute: u8, memory: u8, gb: i64) -> MigProfile {
    MigProfile { name, compute, memory, memory_bytes: gb * GB }
}

/// A100 40GB.
pub const A100_40GB: &[MigProfile] = &[
    p("1g.5gb", 1, 1, 5),
    p("2g.10gb", 2, 2, 10),
    p("3g.20gb", 3, 4, 20),
    p("4g.20gb", 4, 4, 20),
    p("7g.40gb", 7, 8, 40),
];
/// A100 80GB and H100 80GB.
pub const GB80: &[MigProfile] = &[
    p("1g.10gb", 1, 1, 10),
    p("1g.20gb", 1, 2, 20),
    p("2g.20gb", 2, 2, 20),
    p("3g.40gb", 3, 4, 40),
    p("4g.40gb", 4, 4, 40),
    p("7g.80gb", 7, 8, 80),
];
/// H100 94GB (NVL).
pub const H100_94GB: &[MigProfile] = &[
    p("1g.12gb", 1, 1, 12),
    p("1g.24gb", 1, 2, 24),
    p("2g.24gb", 2, 2, 24),
    p("3g.47gb", 3, 4, 47),
    p("4g.47gb", 4, 4, 47),
    p("7g.94gb", 7, 8, 94),
];
/// H200 141GB.
pub const H200_141GB: &[MigProfile] = &[
    p("1g.18gb", 1, 1, 18),
    p("1g.35gb", 1, 2, 35),
    p("2g.35gb", 2, 2, 35),
    p("3g.71gb", 3, 4, 71),
    p("4g.71gb", 4, 4, 71),
    p("7g.141gb", 7, 8, 141),
];

/// The MIG profiles of a GPU, from its NVML model name and (to tell 40 from 80 GB, and
/// 80 from 94 GB, where the name does not) its total memory. `None`: no MIG (L4, T4,
/// consumer cards) or a class we do not list (A30's 4-slice profiles).
pub fn profiles_for(model_name: &str, fb_total_bytes: Option<i64>) -> Option<&'static [MigProfile]> {
    let name = model_name.to_ascii_uppercase();
    let gib = fb_total_bytes.map(|b| b as f64 / (1u64 << 30) as f64);
    if name.contains("H200") {
        return Some(H200_141GB);
    }
    if name.contains("H100") {
        let big = name.contains("94GB") || name.contains("NVL") || gib.is_some_and(|g| g > 85.0);
        return Some(if big { H100_94GB } else { GB80 });
    }
    if name.contains("A100") {
        let small = name.contains("40GB") || gib.is_some_and(|g| g < 48.0);
        return Some(if small { A100_40GB } else { GB80 });
    }
    None
}

/// The smallest profile with `compute_share >= sm` and `memory_bytes >= mem_bytes`.
pub fn smallest_fitting(profiles: &'static [MigProfile], sm: f64, mem_bytes: i64) -> Option<MigProfile> {
    profiles
        .iter()
        .filter(|p| p.compute_share() >= sm && p.memory_bytes >= mem_bytes)
        .min_by_key(|p| (p.compute, p.memory))
        .copied()
}

/// The compute slices of a MIG parent that none of its instances holds: 7 − Σ the
/// instances' slices (by [`crate::pricebook::mig_slices`]; a profile it cannot read holds
/// none), never below 0. The parent's unallocated capacity is priced at `free/7` of its
/// price, through [`unallocated_profile`].
pub fn free_slices<'a>(instance_profiles: impl IntoIterator<Item = Option<&'a str>>) -> u8 {
    let used: u32 =
        instance_profiles.into_iter().map(|p| u32::from(p.and_then(crate::pricebook::mig_slices).unwrap_or(0))).sum();
    u8::try_from(7u32.saturating_sub(used)).unwrap_or(0)
}

/// The profile under which a parent's `free` unheld slices are priced: the price book
/// reads `<n>g.` as n/7 of the parent's price.
pub fn unallocated_profile(free: u8) -> String {
    format!("{free}g.unallocated")
}

/// A MIG parent's windows as its unallocated capacity: held by nobody and idle (its
/// activity is its instances', each priced on its own), so the classifier counts them
/// unallocated and the parent is priced at `free/7` of its price under
/// [`unallocated_profile`]`(free)`.
pub fn parent_as_free_capacity(windows: &mut [crate::classify::Window]) {
    for w in windows {
        w.holder = None;
        w.sm_active_max = Some(0.0);
        w.gpu_util_max = Some(0.0);
        w.sm_active_mean = Some(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parent_with_free_slices_is_unallocated_idle_capacity() {
        use crate::classify::{ClassifyConfig, HolderId, Window};
        // Two busy, held 60 s windows of a parent whose instances hold 3g + 2g: 2 slices free.
        let busy = |end_s: i64| Window {
            end_us: end_s * 1_000_000,
            window_us: 60_000_000,
            sm_active_max: Some(0.9),
            gpu_util_max: Some(95.0),
            sm_active_mean: Some(0.8),
            holder: Some(HolderId(0)),
        };
        let mut windows = vec![busy(60), busy(120)];
        assert_eq!(free_slices([Some("3g.40gb"), Some("2g.20gb")]), 2);
        parent_as_free_capacity(&mut windows);
        assert!(windows.iter().all(|w| w.holder.is_none()));
        let classified =
            crate::classify(&windows, &[], &ClassifyConfig::default(), 0, 3_600_000_000).expect("classify");
        let hours = classified.hourly();
        assert_eq!(hours.len(), 1, "{hours:?}");
        assert_eq!(hours[0].micros.unallocated_idle, 120_000_000, "{:?}", hours[0]);
        assert_eq!(hours[0].micros.active + hours[0].micros.unallocated_busy, 0);
        assert_eq!(unallocated_profile(2), "2g.unallocated");
    }

    #[test]
    fn classes_from_names_and_memory() {
        assert_eq!(profiles_for("NVIDIA H100 80GB HBM3", Some(85_520_809_984)), Some(GB80));
        assert_eq!(profiles_for("NVIDIA H100 NVL", None), Some(H100_94GB));
        assert_eq!(profiles_for("NVIDIA H200", None), Some(H200_141GB));
        assert_eq!(profiles_for("NVIDIA A100-SXM4-40GB", None), Some(A100_40GB));
        assert_eq!(profiles_for("NVIDIA A100-PCIE", Some(40 << 30)), Some(A100_40GB));
        assert_eq!(profiles_for("NVIDIA A100-SXM4-80GB", None), Some(GB80));
        assert_eq!(profiles_for("NVIDIA L4", None), None);
    }

    #[test]
    fn smallest_profile_covers_both_needs() {
        // 8 GiB and 4.5% SM: 1g.10gb (10 GB ≥ 8.59 GB; 1/7 ≥ 0.045).
        assert_eq!(smallest_fitting(GB80, 0.045, 8 << 30).map(|p| p.name), Some("1g.10gb"));
        // 12 GB at 10% SM: the 1g.20gb (one compute slice, two memory slices).
        assert_eq!(smallest_fitting(GB80, 0.10, 12 * GB).map(|p| p.name), Some("1g.20gb"));
        // 20% SM needs 2 slices (1/7 = 0.143 < 0.2 ≤ 2/7).
        assert_eq!(smallest_fitting(GB80, 0.20, GB).map(|p| p.name), Some("2g.20gb"));
        // 30 GB and 50% SM: 4g.40gb (3/7 = 0.43 < 0.5).
        assert_eq!(smallest_fitting(GB80, 0.50, 30 * GB).map(|p| p.name), Some("4g.40gb"));
        assert_eq!(smallest_fitting(GB80, 0.9, GB).map(|p| p.name), Some("7g.80gb"));
        assert_eq!(smallest_fitting(A100_40GB, 0.1, 41 * GB), None);
    }
    #[test]
    fn free_capacity_is_seven_minus_the_instances_slices() {
        // 3g.40gb + 2g.20gb + 1g.10gb hold 6 of 7 slices: one is free.
        assert_eq!(free_slices([Some("3g.40gb"), Some("2g.20gb"), Some("1g.10gb")]), 1);
        // `1c.3g.40gb` is a compute instance holding one slice; an unknown profile holds none.
        assert_eq!(free_slices([Some("1c.3g.40gb"), None, Some("gibberish")]), 6);
        assert_eq!(free_slices([Some("7g.80gb"), Some("1g.10gb")]), 0, "never below zero");
        assert_eq!(free_slices([]), 7);
        // The book prices `2g.unallocated` at 2/7 of the parent: $7.00/h → $2.00/h.
        let book = crate::PriceBook::from_toml(
            "version = \"t\"\n[[price]]\nmodel = \"H100\"\nkind = \"on_demand\"\nusd_per_gpu_hour = \"7.00\"\n",
        )
        .expect("book");
        let profile = unallocated_profile(2);
        let key = crate::GpuKey { model_name: "NVIDIA H100 80GB HBM3", mig_profile: Some(&profile), cluster: None };
        match book.price_at(&key, 0).expect("lookup") {
            crate::Lookup::Priced(q) => assert_eq!(q.usd_per_gpu_hour.to_string(), "2.000000"),
            other => panic!("not priced: {other:?}"),
        }
    }
}
