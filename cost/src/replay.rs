//! What-if replay: the window's stored samples, re-run under a proposed placement.
//!
//! Input is one series of buckets (one minute each, from `gpu_samples`) per workload, as
//! it really ran on its own GPU: whether its allocation held the GPU in the bucket,
//! whether it computed, its mean SM activity (share of a whole GPU) and its peak memory.
//! The replay walks the buckets in time order and answers, bucket by bucket:
//!
//! - **GPUs in use before**: workloads whose allocation held their GPU;
//! - **GPUs in use after**: target GPUs holding at least one such workload;
//! - **collisions**, by sharing mode —
//!   - MIG: each workload must fit its slice: SM activity above the slice's compute
//!     share (`g/7`) is `slice_compute`, memory above the slice's size is `slice_memory`;
//!   - MPS / time-slicing (shared): summed SM activity over 1.0 is `contention`, summed
//!     memory over the GPU's capacity is `out_of_memory`;
//!   - right-size (a job keeping `k` of its GPUs): more than `k` of its GPUs busy at once
//!     is `exceeds_kept` — work the released GPUs did would have had nowhere to run.
//!
//! Consecutive colliding buckets of one kind on one target GPU merge into one interval.
//! GPU-time is exact microseconds: before, each workload counts for the time it held its
//! GPU in the bucket; after, each target GPU for the longest of its members (so the
//! partial minutes at a window's edges count for what they hold). Saved = before − after;
//! the caller prices it.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::mig::MigProfile;

/// One bucket of one workload (or one GPU of a job).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Bucket {
    pub start_us: i64,
    /// The time its allocation held the GPU within the bucket (≤ the bucket's length).
    pub len_us: i64,
    /// Its allocation held the GPU in this bucket.
    pub held: bool,
    /// It computed in this bucket (some window was not idle).
    pub busy: bool,
    /// Mean SM activity as a share of a whole GPU (GPM `sm_active`, else `gpu_util` —
    /// an over-estimate, which errs towards reporting collisions).
    pub sm: Option<f64>,
    /// Peak framebuffer use.
    pub mem_bytes: Option<i64>,
}

/// A workload's series, in time order.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    pub name: String,
    pub buckets: Vec<Bucket>,
}

/// How co-located workloads share a target GPU.
#[derive(Clone, Debug, PartialEq)]
pub enum Sharing {
    /// MIG: `slices[i]` is workload `i`'s profile.
    Mig { slices: Vec<MigProfile> },
    /// MPS or time-slicing: no isolation; capacity is the GPU's framebuffer.
    Shared { capacity_bytes: i64 },
}

/// One interval in which the proposal would not have held.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Collision {
    /// Index of the target GPU (into the placement's bins).
    pub gpu: usize,
    pub from_us: i64,
    pub to_us: i64,
    /// `slice_compute`, `slice_memory`, `contention`, `out_of_memory`, `exceeds_kept`.
    pub kind: &'static str,
    /// The workloads involved.
    pub workloads: Vec<String>,
    /// The worst value seen: SM share, bytes, or busy GPUs.
    pub peak: f64,
    /// The limit it crossed.
    pub limit: f64,
}

/// What the replay found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Outcome {
    pub buckets: usize,
    /// GPU-µs in use as things ran, and under the proposal.
    pub gpu_us_before: i64,
    pub gpu_us_after: i64,
    pub gpu_us_saved: i64,
    pub peak_gpus_before: usize,
    pub peak_gpus_after: usize,
    pub collisions: Vec<Collision>,
    /// Total length of the collision intervals (overlaps on different GPUs both count).
    pub collision_us: i64,
}

/// The buckets of all `workloads`, keyed by start, each with `(workload, bucket)`.
fn by_time(workloads: &[Workload]) -> BTreeMap<i64, Vec<(usize, Bucket)>> {
    let mut t: BTreeMap<i64, Vec<(usize, Bucket)>> = BTreeMap::new();
    for (i, w) in workloads.iter().enumerate() {
        for b in &w.buckets {
            t.entry(b.start_us).or_default().push((i, *b));
        }
    }
    t
}

/// Appends a collision, merging it into the previous one of the same GPU and kind when
/// the two touch.
fn record(out: &mut Vec<Collision>, c: Collision) {
    if let Some(prev) = out.iter_mut().rev().find(|p| p.gpu == c.gpu && p.kind == c.kind && p.workloads == c.workloads)
        && prev.to_us == c.from_us
    {
        prev.to_us = c.to_us;
        prev.peak = prev.peak.max(c.peak);
        return;
    }
    out.push(c);
}

/// Replays `workloads` placed on target GPUs `bins` (indices into `workloads`).
pub fn replay_placement(workloads: &[Workload], bins: &[Vec<usize>], sharing: &Sharing) -> Outcome {
    let mut target = vec![usize::MAX; workloads.len()];
    for (g, members) in bins.iter().enumerate() {
        for &w in members {
            if let Some(t) = target.get_mut(w) {
                *t = g;
            }
        }
    }
    let mut out = Outcome::default();
    for (start, items) in by_time(workloads) {
        out.buckets += 1;
        // Each workload counts for the time it held its GPU in the bucket; a target GPU
        // for the longest of its members (buckets at the window's edges are partial).
        let len = items.iter().map(|(_, b)| b.len_us).max().unwrap_or(0);
        let held: Vec<(usize, Bucket)> = items.into_iter().filter(|(_, b)| b.held).collect();
        let before = held.len();
        let mut per_gpu: BTreeMap<usize, Vec<(usize, Bucket)>> = BTreeMap::new();
        for (w, b) in &held {
            per_gpu.entry(target.get(*w).copied().unwrap_or(usize::MAX)).or_default().push((*w, *b));
        }
        let after = per_gpu.len();
        out.gpu_us_before += held.iter().map(|(_, b)| b.len_us).sum::<i64>();
        out.gpu_us_after += per_gpu.values().map(|m| m.iter().map(|(_, b)| b.len_us).max().unwrap_or(0)).sum::<i64>();
        out.peak_gpus_before = out.peak_gpus_before.max(before);
        out.peak_gpus_after = out.peak_gpus_after.max(after);
        for (gpu, members) in per_gpu {
            let name = |w: usize| workloads[w].name.clone();
            let mut hit = |kind, who: Vec<String>, peak: f64, limit: f64| {
                record(
                    &mut out.collisions,
                    Collision { gpu, from_us: start, to_us: start + len, kind, workloads: who, peak, limit },
                );
            };
            match sharing {
                Sharing::Mig { slices } => {
                    for (w, b) in &members {
                        let Some(slice) = slices.get(*w) else { continue };
                        if let Some(sm) = b.sm
                            && sm > slice.compute_share() + 1e-9
                        {
                            hit("slice_compute", vec![name(*w)], sm, slice.compute_share());
                        }
                        if let Some(mem) = b.mem_bytes
                            && mem > slice.memory_bytes
                        {
                            hit("slice_memory", vec![name(*w)], mem as f64, slice.memory_bytes as f64);
                        }
                    }
                }
                Sharing::Shared { capacity_bytes } => {
                    if members.len() < 2 {
                        continue;
                    }
                    let who: Vec<String> = members.iter().map(|(w, _)| name(*w)).collect();
                    let sm: f64 = members.iter().filter_map(|(_, b)| b.sm).sum();
                    if sm > 1.0 + 1e-9 {
                        hit("contention", who.clone(), sm, 1.0);
                    }
                    let mem: i64 = members.iter().filter_map(|(_, b)| b.mem_bytes).sum();
                    if mem > *capacity_bytes {
                        hit("out_of_memory", who, mem as f64, *capacity_bytes as f64);
                    }
                }
            }
        }
    }
    out.gpu_us_saved = out.gpu_us_before - out.gpu_us_after;
    out.collision_us = out.collisions.iter().map(|c| c.to_us - c.from_us).sum();
    out
}

/// Replays a job of `gpus.len()` GPUs (one series per GPU) keeping `keep` of them: in
/// each bucket the job uses `min(held, keep)` GPUs instead of `held`; more than `keep`
/// busy at once is `exceeds_kept`.
pub fn replay_right_size(gpus: &[Workload], keep: usize) -> Outcome {
    let mut out = Outcome::default();
    let everyone: Vec<String> = gpus.iter().map(|w| w.name.clone()).collect();
    for (start, items) in by_time(gpus) {
        out.buckets += 1;
        let len = items.iter().map(|(_, b)| b.len_us).max().unwrap_or(0);
        let mut lens: Vec<i64> = items.iter().filter(|(_, b)| b.held).map(|(_, b)| b.len_us).collect();
        let held = lens.len();
        let busy = items.iter().filter(|(_, b)| b.held && b.busy).count();
        let after = held.min(keep);
        lens.sort_unstable_by(|a, b| b.cmp(a));
        out.gpu_us_before += lens.iter().sum::<i64>();
        out.gpu_us_after += lens.iter().take(keep).sum::<i64>();
        out.peak_gpus_before = out.peak_gpus_before.max(held);
        out.peak_gpus_after = out.peak_gpus_after.max(after);
        if busy > keep {
            record(
                &mut out.collisions,
                Collision {
                    gpu: 0,
                    from_us: start,
                    to_us: start + len,
                    kind: "exceeds_kept",
                    workloads: everyone.clone(),
                    peak: busy as f64,
                    limit: keep as f64,
                },
            );
        }
    }
    out.gpu_us_saved = out.gpu_us_before - out.gpu_us_after;
    out.collision_us = out.collisions.iter().map(|c| c.to_us - c.from_us).sum();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::GB80;

    const MIN: i64 = 60_000_000;
    const GIB: i64 = 1 << 30;

    fn series(name: &str, points: &[(bool, f64, i64)]) -> Workload {
        Workload {
            name: name.into(),
            buckets: points
                .iter()
                .enumerate()
                .map(|(i, &(held, sm, gib))| Bucket {
                    start_us: i as i64 * MIN,
                    len_us: MIN,
                    held,
                    busy: sm > 0.0,
                    sm: Some(sm),
                    mem_bytes: Some(gib * GIB),
                })
                .collect(),
        }
    }

    #[test]
    fn mig_packing_saves_a_gpu_and_flags_a_slice_overflow() {
        // Two embedders on 1g.10gb slices of one GPU, 4 minutes; b is gone in minute 3,
        // and a bursts to 0.2 SM (over 1/7) in minute 1.
        let a = series("a", &[(true, 0.05, 6), (true, 0.2, 6), (true, 0.05, 6), (true, 0.05, 6)]);
        let b = series("b", &[(true, 0.04, 8), (true, 0.04, 8), (false, 0.0, 0), (true, 0.04, 11)]);
        let slices = vec![GB80[0], GB80[0]];
        let o = replay_placement(&[a, b], &[vec![0, 1]], &Sharing::Mig { slices });
        // Before: 2+2+1+2 = 7 GPU-minutes; after: 1 per minute = 4; saved 3.
        assert_eq!((o.gpu_us_before, o.gpu_us_after, o.gpu_us_saved), (7 * MIN, 4 * MIN, 3 * MIN));
        assert_eq!((o.peak_gpus_before, o.peak_gpus_after), (2, 1));
        // a over its compute share in minute 1; b over 10 GB (11 GiB = 11.8 GB) in minute 3.
        assert_eq!(o.collisions.len(), 2);
        assert_eq!(
            (o.collisions[0].kind, o.collisions[0].from_us, o.collisions[0].to_us),
            ("slice_compute", MIN, 2 * MIN)
        );
        assert_eq!((o.collisions[1].kind, o.collisions[1].from_us), ("slice_memory", 3 * MIN));
        assert_eq!(o.collision_us, 2 * MIN);
    }

    #[test]
    fn shared_mode_reports_contention_and_oom_as_merged_intervals() {
        let a = series("a", &[(true, 0.6, 30), (true, 0.6, 30), (true, 0.6, 30), (true, 0.1, 30)]);
        let b = series("b", &[(true, 0.5, 40), (true, 0.5, 40), (true, 0.3, 60), (true, 0.3, 40)]);
        let o = replay_placement(&[a, b], &[vec![0, 1]], &Sharing::Shared { capacity_bytes: 80 * GIB });
        // Contention (1.1 > 1.0) in minutes 0–1, merged into one interval; OOM (90 GiB) in minute 2.
        let kinds: Vec<_> = o.collisions.iter().map(|c| (c.kind, c.from_us / MIN, c.to_us / MIN)).collect();
        assert_eq!(kinds, vec![("contention", 0, 2), ("out_of_memory", 2, 3)]);
        assert!((o.collisions[0].peak - 1.1).abs() < 1e-9);
        assert_eq!(o.gpu_us_saved, 4 * MIN);
    }

    #[test]
    fn right_size_keeps_k_and_reports_when_more_were_busy() {
        // A 4-GPU job; GPU 0 busy throughout, GPU 1 busy in minute 2 only.
        let g0 = series("g0", &[(true, 0.6, 40), (true, 0.6, 40), (true, 0.6, 40)]);
        let g1 = series("g1", &[(true, 0.0, 1), (true, 0.0, 1), (true, 0.3, 1)]);
        let g2 = series("g2", &[(true, 0.0, 1), (true, 0.0, 1), (true, 0.0, 1)]);
        let g3 = series("g3", &[(true, 0.0, 1), (true, 0.0, 1), (false, 0.0, 0)]);
        let o = replay_right_size(&[g0, g1, g2, g3], 1);
        // Before 4+4+3 = 11, after 3, saved 8 GPU-minutes; minute 2 had 2 busy > 1 kept.
        assert_eq!((o.gpu_us_before, o.gpu_us_after, o.gpu_us_saved), (11 * MIN, 3 * MIN, 8 * MIN));
        assert_eq!(o.collisions.len(), 1);
        assert_eq!(
            (o.collisions[0].kind, o.collisions[0].from_us, o.collisions[0].peak),
            ("exceeds_kept", 2 * MIN, 2.0)
        );
    }
}
