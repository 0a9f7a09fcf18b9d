//! Behaviour of the simulated fleet as the rest of the agent sees it: through samplers,
//! the aggregator, the attributor and backfill.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use apron_common::{Field, GpuWindow, UnixMicros};

use super::fleet::{CLOCKS_GPU_IDLE, XID_FELL_OFF_THE_BUS};
use super::scenario::{HOUR, MIN, SEC};
use super::*;
use crate::attribution::{AttributionConfig, Attributor};
use crate::sampler::{IssueKind, Readings};
use crate::window::Aggregator;

/// 2026-11-19T16:53:20Z.
const T0: i64 = 1_795_000_000_000_000;

fn source_with(config: SimConfig) -> SimSource {
    SimSource::starting_at(&config, None, UnixMicros(T0)).expect("valid config")
}

fn source(seed: u64) -> SimSource {
    source_with(SimConfig { seed, ..SimConfig::default() })
}

fn read(src: &SimSource, group: FieldGroup, t: i64) -> Readings {
    let mut sampler = SimSampler::new(src.fleet().clone(), group, None);
    let mut out = Readings::default();
    sampler.sample(UnixMicros(t), &mut out).expect("sim samplers do not fail");
    out
}

fn value(r: &Readings, slot: usize, field: Field) -> Option<f64> {
    r.values.iter().find(|v| v.slot == slot && v.field == field).map(|v| v.value)
}

fn slots_of(src: &SimSource, scenario: Scenario) -> Vec<usize> {
    (0..src.inventory().len()).filter(|&s| src.fleet().scenario(s) == Some(scenario)).collect()
}

/// The first instant from `from` (10-minute steps, up to 10 days) where `slot` is in `kind`.
fn find_phase(src: &SimSource, slot: usize, kind: PhaseKind, from: i64) -> i64 {
    (0..1440)
        .map(|i| from + i * 10 * MIN)
        .find(|&t| src.fleet().phase(slot, UnixMicros(t)) == Some(kind))
        .expect("phase reached within 10 days")
}

#[test]
fn same_seed_same_values_other_seed_other_uuids() {
    let (a, b, c) = (source(42), source(42), source(43));
    assert_eq!(a.inventory(), b.inventory());
    for t in [T0 - 5 * HOUR, T0 + 1234, T0 + 3 * 86_400 * SEC] {
        for &g in FieldGroup::WINDOW {
            assert_eq!(read(&a, g, t).values, read(&b, g, t).values, "{g} at {t}");
        }
    }
    let uuids: BTreeSet<_> = a.inventory().iter().map(|g| g.gpu_uuid.clone()).collect();
    assert_eq!(uuids.len(), 16, "UUIDs are unique");
    assert!(c.inventory().iter().all(|g| !uuids.contains(&g.gpu_uuid)));
    let first = a.inventory()[0].gpu_uuid.as_str();
    assert!(first.starts_with("GPU-") && first.len() == 40, "{first}");
    assert_eq!(a.inventory()[0].pci_bus_id, "00000000:18:00.0");
}

#[test]
fn default_fleet_covers_every_scenario_and_both_first_models() {
    let src = source(42);
    let present: BTreeSet<_> = (0..16).filter_map(|s| src.fleet().scenario(s)).collect();
    // Every scenario but notebook-idle-resume (opt-in through `sim.scenarios`).
    assert_eq!(present, Scenario::ALL.into_iter().filter(|s| *s != Scenario::NotebookIdleResume).collect());
    let inv = src.inventory();
    assert_eq!(inv[0].gpu_model, "NVIDIA H100 80GB HBM3");
    assert_eq!(inv[8].gpu_model, "NVIDIA A100-SXM4-80GB");
    assert_eq!(inv[8].host.as_str(), "sim-node-1");
    assert_eq!((inv[9].gpu_index, inv[9].minor_number), (1, Some(1)));
    assert_eq!(slots_of(&src, Scenario::MultiGpuUnderused), vec![10, 11, 12, 13]);
    assert_eq!(src.kind(), "sim");
    assert_eq!(src.driver_version().as_deref(), Some("sim"));
}

#[test]
fn stranded_notebook_holds_30_gb_and_runs_nothing() {
    let src = source(42);
    let slot = slots_of(&src, Scenario::NotebookStranded)[0];
    let t = find_phase(&src, slot, PhaseKind::Stranded, T0);
    let mem = read(&src, FieldGroup::Memory, t);
    let used = value(&mem, slot, Field::FbUsedBytes).expect("memory read");
    assert!((29.5e9..31e9).contains(&used), "{used}");
    for i in 0..600 {
        let ti = t + i * 100_000;
        assert_eq!(value(&read(&src, FieldGroup::Utilization, ti), slot, Field::GpuUtil), Some(0.0));
        if i % 3 == 0 {
            assert_eq!(value(&read(&src, FieldGroup::Gpm, ti), slot, Field::SmActive), Some(0.0));
        }
    }
    assert_eq!(value(&read(&src, FieldGroup::Clocks, t), slot, Field::ClocksEventReasons), Some(CLOCKS_GPU_IDLE));
    let mut procs = Vec::new();
    assert!(src.fleet().processes(slot, t, &mut procs));
    assert_eq!(procs.len(), 1);
    assert!(procs[0].fb_used_bytes > 29_000_000_000);
    // It was busy once: the session starts with bursts.
    let active = find_phase(&src, slot, PhaseKind::Active, t);
    let busy = (0..3000)
        .any(|i| value(&read(&src, FieldGroup::Utilization, active + i * 100_000), slot, Field::GpuUtil) > Some(0.0));
    assert!(busy);
}

#[test]
fn small_inference_is_packable() {
    let src = source(42);
    for slot in slots_of(&src, Scenario::SmallInference) {
        assert!(src.inventory()[slot].gpu_model.contains("H100"), "layout puts it on Hopper");
        let (mut sm_max, mut util_max, mut util_sum) = (0.0f64, 0.0f64, 0.0);
        for i in 0..3600 {
            let t = T0 + i * 1_000_700;
            let util = value(&read(&src, FieldGroup::Utilization, t), slot, Field::GpuUtil).expect("util");
            let sm = value(&read(&src, FieldGroup::Gpm, t), slot, Field::SmActive).expect("gpm on Hopper");
            (sm_max, util_max, util_sum) = (sm_max.max(sm), util_max.max(util), util_sum + util);
        }
        assert!(sm_max < 0.1 && util_max < 0.1, "sm {sm_max} util {util_max}");
        assert!(util_sum > 0.0, "busy, not idle");
        let used = value(&read(&src, FieldGroup::Memory, T0), slot, Field::FbUsedBytes).expect("memory");
        assert!(used < 10e9 && used > 4e9, "{used}");
    }
}

#[test]
fn training_is_busy_and_multi_gpu_job_uses_one_of_four() {
    let src = source(42);
    let train = slots_of(&src, Scenario::Training)[0];
    let t = find_phase(&src, train, PhaseKind::Run, T0) + 5 * MIN;
    let sm = value(&read(&src, FieldGroup::Gpm, t), train, Field::SmActive).expect("H100");
    assert!((0.7..=0.95).contains(&sm), "{sm}");
    let watts = value(&read(&src, FieldGroup::Power, t), train, Field::PowerWatts).expect("power");
    assert!((450.0..=700.0).contains(&watts), "{watts}");
    assert!(value(&read(&src, FieldGroup::Nvlink, t), train, Field::NvlinkTxBytesPerS) > Some(1e10), "2-GPU pod talks");

    let multi = slots_of(&src, Scenario::MultiGpuUnderused);
    let t = find_phase(&src, multi[0], PhaseKind::Run, T0) + 5 * MIN;
    let util = read(&src, FieldGroup::Utilization, t);
    assert!(value(&util, multi[0], Field::GpuUtil) > Some(0.3));
    for &s in &multi[1..] {
        assert_eq!(value(&util, s, Field::GpuUtil), Some(0.0));
        let used = value(&read(&src, FieldGroup::Memory, t), s, Field::FbUsedBytes).expect("memory");
        assert_eq!(used, 613.0 * 1_048_576.0);
    }
}

#[test]
fn only_hopper_has_gpm_and_only_sxm_has_nvlink() {
    let config = SimConfig { nodes: 4, ..SimConfig::default() };
    let src = source_with(config);
    let mut gpm = SimSampler::new(src.fleet().clone(), FieldGroup::Gpm, None);
    let mut first = Readings::default();
    gpm.sample(UnixMicros(T0), &mut first).expect("gpm");
    for (slot, gpu) in src.inventory().iter().enumerate() {
        let hopper = gpu.gpu_model.contains("H100");
        assert_eq!(first.values.iter().any(|v| v.slot == slot), hopper, "{}", gpu.gpu_model);
        let unsupported = first.issues.iter().any(|i| i.slot == Some(slot) && i.kind == IssueKind::Unsupported);
        assert_eq!(unsupported, !hopper);
        let nvlink = read(&src, FieldGroup::Nvlink, T0 + SEC);
        assert_eq!(value(&nvlink, slot, Field::NvlinkRxBytesPerS).is_some(), gpu.gpu_model != "NVIDIA L4");
        let thermal = read(&src, FieldGroup::Thermal, T0 + SEC);
        assert!(value(&thermal, slot, Field::GpuTempC).is_some());
        assert_eq!(value(&thermal, slot, Field::MemTempC).is_some(), gpu.gpu_model != "NVIDIA L4");
    }
    let mut second = Readings::default();
    gpm.sample(UnixMicros(T0 + 250_000), &mut second).expect("gpm");
    assert!(second.issues.is_empty(), "unsupported is reported once");
}

#[test]
fn lost_gpu_reports_xid_then_lost() {
    let src = source(42);
    let slot = slots_of(&src, Scenario::FellOffTheBus)[0];
    let lost_at = T0 + 10 * MIN;
    let before = read(&src, FieldGroup::Health, lost_at - 5 * SEC);
    assert_eq!(value(&before, slot, Field::XidLast), Some(XID_FELL_OFF_THE_BUS));
    assert!(before.lost.is_empty());
    assert!(value(&read(&src, FieldGroup::Health, T0 + MIN), slot, Field::XidLast).is_none(), "no XID when healthy");
    for &g in FieldGroup::WINDOW {
        let after = read(&src, g, lost_at + SEC);
        assert_eq!(after.lost, vec![slot], "{g}");
        assert!(after.values.iter().all(|v| v.slot != slot));
    }
    // Backfill: lost in the 2 h before the start, healthy before that.
    assert!(src.fleet().is_lost(slot, UnixMicros(T0 - HOUR)));
    assert!(!src.fleet().is_lost(slot, UnixMicros(T0 - 3 * HOUR)));
    assert!(!src.fleet().is_lost(slot, UnixMicros(T0)));
    let short = source_with(SimConfig { lost_gpu_after: Duration::from_secs(30), ..SimConfig::default() });
    assert!(short.fleet().is_lost(slot, UnixMicros(T0 + 31 * SEC)));
}

#[test]
fn energy_is_the_integral_of_power() {
    let src = source(42);
    for slot in 0..src.inventory().len() {
        let t0 = T0 + 20 * MIN; // after the lost GPU's fall: check it separately below
        let start = if src.fleet().is_lost(slot, UnixMicros(t0)) { T0 - 3 * HOUR } else { t0 };
        let energy = |t| value(&read(&src, FieldGroup::Power, t), slot, Field::EnergyJoules).expect("energy");
        let (mut sum_p, mut prev) = (0.0, energy(start));
        for i in 1..=600 {
            let t = start + i * SEC;
            let p = value(&read(&src, FieldGroup::Power, t), slot, Field::PowerWatts).expect("power");
            sum_p += p;
            let e = energy(t);
            assert!(e >= prev, "energy never decreases");
            prev = e;
        }
        let delta = prev - energy(start);
        assert!((delta - sum_p).abs() <= 0.003 * delta + 1.0, "slot {slot}: ΔE {delta} vs ΣP·Δt {sum_p}");
    }
}

/// Live samplers at the instants their default intervals tick, through the agent's own
/// aggregator.
fn live_windows(src: &SimSource, start: i64, end: i64) -> Vec<GpuWindow> {
    let mut agg = Aggregator::new(src.inventory().to_vec(), Duration::from_secs(1), Duration::ZERO);
    for &g in FieldGroup::WINDOW {
        let every = i64::try_from(g.default_interval().as_micros()).expect("small");
        let mut sampler = SimSampler::new(src.fleet().clone(), g, None);
        let mut t = crate::runtime::next_tick(UnixMicros(start), g.default_interval(), crate::sampler::Phase::Mid).0;
        while t <= end {
            let mut r = Readings::default();
            sampler.sample(UnixMicros(t), &mut r).expect("sample");
            agg.add(&r, UnixMicros(t));
            t += every;
        }
    }
    agg.close_due(UnixMicros(end + HOUR))
}

#[test]
fn history_rows_equal_live_sampling() {
    let src = source(42);
    let n = src.inventory().len();
    for (start, end) in [(T0 - 20 * SEC, T0), (T0 + 10 * MIN - 10 * SEC, T0 + 10 * MIN + 10 * SEC)] {
        let history = src.history(UnixMicros(start), UnixMicros(end), Duration::from_secs(1));
        assert_eq!(history.size_hint(), (n * 20, Some(n * 20)));
        let rows: Vec<_> = history.collect();
        assert_eq!(rows.len(), n * 20);
        let live = live_windows(&src, start, end);
        assert_eq!(live.len(), rows.len());
        for (h, l) in rows.iter().zip(&live) {
            assert_eq!((h.time, &h.gpu.gpu_uuid, h.lost), (l.time, &l.gpu.gpu_uuid, l.lost));
            assert_eq!(h.fields, l.fields, "{} at {}", h.gpu.gpu_uuid, h.time.0);
        }
        assert!(rows.iter().any(|r| r.lost) && rows.iter().any(|r| !r.lost));
        let util = rows[0].get(Field::GpuUtil).expect("util");
        assert_eq!(util.count, 10, "10 utilisation samples per 1 s window");
    }
}

#[test]
fn history_windows_and_intervals() {
    let src = source(7);
    let day: Vec<_> = src
        .history(UnixMicros(T0 - HOUR), UnixMicros(T0), Duration::from_secs(60))
        .intervals(|g| (g != FieldGroup::Gpm).then(|| g.default_interval()))
        .collect();
    assert_eq!(day.len(), 16 * 60);
    assert!(day.iter().all(|r| r.get(Field::SmActive).is_none()), "GPM switched off");
    let r = day.iter().find(|r| !r.lost).expect("a live GPU");
    assert_eq!(r.get(Field::PowerWatts).map(|s| s.count), Some(60));
    assert_eq!(r.get(Field::EccSbeTotal).map(|s| s.count), Some(6));
    // Unaligned bounds: windows end on the epoch-aligned grid inside (start, end].
    let n = src.history(UnixMicros(T0 + 300_000), UnixMicros(T0 + 3_300_000), Duration::from_secs(1)).count();
    assert_eq!(n, 16 * 3);
}

#[test]
fn processes_are_attributed_through_the_attributor() {
    let src = source(42);
    let attribution = Arc::new(Attributor::new(&AttributionConfig::default(), src.host_view().expect("sim host")));
    let mut sampler = src.sampler(FieldGroup::Processes, &attribution).expect("processes sampler");
    let multi = slots_of(&src, Scenario::MultiGpuUnderused);
    let t = find_phase(&src, multi[0], PhaseKind::Run, T0 + 11 * MIN);
    let mut out = Readings::default();
    sampler.sample(UnixMicros(t), &mut out).expect("processes");
    assert!(out.issues.is_empty(), "{:?}", out.issues);
    let fleet = src.fleet();
    let slot_of = |uuid| src.inventory().iter().position(|g| &g.gpu_uuid == uuid).expect("known GPU");
    let mut seen = BTreeSet::new();
    for row in &out.processes {
        let slot = slot_of(&row.gpu_uuid);
        let scenario = fleet.scenario(slot).expect("slot");
        seen.insert(scenario);
        assert_eq!(row.time, UnixMicros(t));
        match scenario {
            Scenario::MultiGpuUnderused => {
                assert!(row.job_id.is_some() && row.pod.is_none());
                assert_eq!(row.user.as_deref(), Some("carol"));
            }
            Scenario::NotebookStranded => {
                assert_eq!(row.namespace.as_deref(), Some("data-science"));
                assert_eq!(row.container.as_deref(), Some("notebook"));
                assert!(row.pod.as_deref().is_some_and(|p| p.starts_with("jupyter-")));
                assert_eq!(row.user.as_deref(), Some("1000"), "container uid, not in the host's passwd");
            }
            Scenario::Training => {
                assert_eq!(row.namespace.as_deref(), Some("ml-research"));
                assert_eq!(row.user.as_deref(), Some("root"));
            }
            _ => assert!(row.pod.is_some() && row.namespace.is_some(), "{scenario:?}"),
        }
        if row.pod.is_some() {
            assert!(row.pod_uid.is_some() && row.container_id.as_ref().is_some_and(|c| c.len() == 64));
        }
    }
    assert!(!seen.contains(&Scenario::UnallocatedIdle));
    assert!(!seen.contains(&Scenario::FellOffTheBus), "lost GPUs list no processes");
    assert!(out.lost.contains(&slots_of(&src, Scenario::FellOffTheBus)[0]));
    let pids: BTreeSet<_> =
        out.processes.iter().filter(|p| multi.contains(&slot_of(&p.gpu_uuid))).map(|p| p.pid).collect();
    assert_eq!(pids.len(), 1, "one process spans the whole Slurm job");

    let unallocated = &src.inventory()[slots_of(&src, Scenario::UnallocatedIdle)[0]];
    assert_eq!(attribution.gpu_owner(unallocated), None);
    let owner = attribution.gpu_owner(&src.inventory()[multi[1]]).expect("held by the job");
    assert_eq!((owner.account.as_deref(), owner.partition.as_deref()), (Some("vision"), Some("gpu")));
}

#[test]
fn process_history_attributes_every_row() {
    let src = source(42);
    let host = src.history_host();
    let attribution = Attributor::new(&AttributionConfig::default(), Box::new(host.clone()));
    let (start, end) = (T0 - 6 * HOUR, T0 - 6 * HOUR + 30 * SEC);
    let rows: Vec<_> =
        src.process_history(&host, &attribution, UnixMicros(start), UnixMicros(end), Duration::from_secs(5)).collect();
    let ticks: BTreeSet<_> = rows.iter().map(|r| r.time).collect();
    assert_eq!(ticks.len(), 6);
    assert!(rows.len() >= 6 * 8, "{}", rows.len());
    assert!(rows.iter().all(|r| r.pod.is_some() || r.job_id.is_some()), "every process has an owner");
    assert_eq!(host.time(), UnixMicros(end));
}

#[test]
fn history_rows_carry_their_owners() {
    use apron_common::HolderKind;
    let src = source(42);
    let notebook = slots_of(&src, Scenario::NotebookStranded)[0];
    let t = find_phase(&src, notebook, PhaseKind::Stranded, T0 - 5 * 86_400 * SEC);
    let rows: Vec<_> = src.history(UnixMicros(t), UnixMicros(t + 10 * SEC), Duration::from_secs(1)).collect();
    let owner_of = |slot: usize| {
        let uuid = &src.inventory()[slot].gpu_uuid;
        rows.iter().filter(|r| &r.gpu.gpu_uuid == uuid).map(|r| r.owner.clone()).collect::<Vec<_>>()
    };
    for owner in owner_of(notebook) {
        let owner = owner.expect("a stranded notebook is held");
        assert_eq!(owner.kind, HolderKind::Pod);
        assert_eq!(owner.namespace.as_deref(), Some("data-science"));
        assert_eq!(owner.container.as_deref(), Some("notebook"));
        let pod = owner.pod.as_deref().expect("pod named");
        assert!(pod.starts_with("jupyter-"), "{pod}");
        assert_eq!(owner.owner, format!("data-science/{pod}"));
    }
    for owner in owner_of(slots_of(&src, Scenario::UnallocatedIdle)[0]) {
        assert_eq!(owner, None, "nobody holds an unallocated GPU");
    }

    // The 4-GPU Slurm job: all four GPUs, idle or not, carry the job while it runs.
    let multi = slots_of(&src, Scenario::MultiGpuUnderused);
    assert_eq!(multi.len(), 4);
    let t = find_phase(&src, multi[0], PhaseKind::Run, T0 - 3 * 86_400 * SEC);
    let rows: Vec<_> = src.history(UnixMicros(t), UnixMicros(t + 10 * SEC), Duration::from_secs(1)).collect();
    let jobs: BTreeSet<_> = rows
        .iter()
        .filter(|r| multi.iter().any(|&s| src.inventory()[s].gpu_uuid == r.gpu.gpu_uuid))
        .map(|r| {
            let o = r.owner.clone().expect("held by the job");
            assert_eq!(o.kind, HolderKind::SlurmJob);
            assert_eq!(o.job_id.as_deref(), Some(o.owner.as_str()));
            assert_eq!(o.user.as_deref(), Some("carol"));
            (o.owner, o.account, o.partition, o.qos)
        })
        .collect();
    assert_eq!(jobs.len(), 1, "one job on all four GPUs: {jobs:?}");
    let (_, account, partition, qos) = jobs.into_iter().next().expect("one");
    assert_eq!(
        (account.as_deref(), partition.as_deref(), qos.as_deref()),
        (Some("vision"), Some("gpu"), Some("normal"))
    );
    assert_eq!(rows.len(), src.inventory().len() * 10);
}

#[test]
fn a_phase_origin_puts_every_job_in_the_same_phase_whenever_the_fleet_starts() {
    // Ten hours after the origin (what `apron up` gives a new data directory), whatever
    // the origin: training runs, the notebook is stranded, the 4-GPU job holds its GPUs.
    for origin in [T0, T0 + 7 * HOUR + 13 * MIN, T0 + 29 * HOUR] {
        let src = source_with(SimConfig { phase_origin: Some(UnixMicros(origin)), ..SimConfig::default() });
        let at = UnixMicros(origin + 10 * HOUR + 30 * MIN);
        let all_in = |scenario, kinds: &[PhaseKind]| {
            let slots = slots_of(&src, scenario);
            !slots.is_empty() && slots.iter().all(|&s| src.fleet().phase(s, at).is_some_and(|k| kinds.contains(&k)))
        };
        assert!(all_in(Scenario::Training, &[PhaseKind::Run]), "origin {origin}");
        assert!(all_in(Scenario::NotebookStranded, &[PhaseKind::Stranded]), "origin {origin}");
        assert!(all_in(Scenario::MultiGpuUnderused, &[PhaseKind::Run, PhaseKind::Stranded]), "origin {origin}");
    }
}
