//! Deterministic wire batches for unit tests.

use std::time::Duration;

use apron_common::wire::{processes_to_batch, windows_to_batch};
use apron_common::{Field, FieldStats, GpuIdentity, GpuUuid, GpuWindow, HostName, ProcessRow, UnixMicros};
use arrow_array::RecordBatch;

fn stats(v: f64) -> Option<FieldStats> {
    Some(FieldStats::single(v))
}

/// 2026-11-19T00:00:00Z, µs.
pub const MIDNIGHT: i64 = 20_776 * 86_400_000_000;

pub fn identity(g: usize) -> GpuIdentity {
    GpuIdentity::gpu(
        HostName::new(format!("node-{}", g / 8)).expect("host"),
        GpuUuid::new(format!("GPU-{g:04}")).expect("uuid"),
        (g % 8) as u32,
        "NVIDIA H100 80GB HBM3",
    )
}

/// The gpu_util value of GPU `g` at second `s` (exact at 1e-4).
pub fn util(g: usize, s: i64) -> f64 {
    ((g as i64 * 7 + s) % 101) as f64 / 100.0
}

/// `gpus` × `secs` one-second windows starting at `start_us`, in time-major order
/// (as an agent would send them: not sorted by GPU).
pub fn samples(gpus: usize, start_us: i64, secs: i64) -> RecordBatch {
    let mut rows = Vec::new();
    for s in 0..secs {
        for g in 0..gpus {
            let mut w = GpuWindow::new(UnixMicros(start_us + s * 1_000_000), Duration::from_secs(1), identity(g));
            w.fields[Field::GpuUtil.index()] = stats(util(g, s));
            w.fields[Field::SmActive.index()] = stats(util(g, s) / 2.0);
            w.fields[Field::PowerWatts.index()] = stats(300.125 + g as f64);
            w.fields[Field::GpuTempC.index()] = stats(50.0 + g as f64);
            w.fields[Field::FbUsedBytes.index()] = stats(1_048_576.0 * g as f64);
            w.fields[Field::EnergyJoules.index()] = stats(1.0e9 + s as f64 * 300.125);
            w.fields[Field::PcieTxBytesPerS.index()] = stats(123_456.0);
            rows.push(w);
        }
    }
    windows_to_batch(&rows).expect("batch")
}

pub fn processes(gpus: usize, start_us: i64) -> RecordBatch {
    let rows: Vec<ProcessRow> = (0..gpus)
        .rev()
        .map(|g| ProcessRow {
            time: UnixMicros(start_us),
            host: identity(g).host,
            gpu_uuid: identity(g).gpu_uuid,
            pid: 1000 + g as u32,
            process_name: Some("python".into()),
            user: Some("alice".into()),
            fb_used_bytes: Some(1 << 30),
            sm_util: Some(0.25),
            container_id: None,
            pod: Some(format!("train-{g}")),
            namespace: Some("ml".into()),
            container: None,
            pod_uid: None,
            job_id: None,
        })
        .collect();
    processes_to_batch(&rows).expect("batch")
}
