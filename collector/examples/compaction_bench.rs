//! How much compaction rewrites over a day of persists: a store on a scratch directory
//! takes `--persists` persists of `--gpus` GPUs × `--secs` one-second windows each (the
//! day split evenly), runs a maintenance pass after each persist as the background
//! task would, then the end-of-day pass. Prints, for the day: rows written by
//! compaction and their ratio to the day's rows (write amplification), merges, time
//! spent merging, the largest single merge, files left, and the process's peak RSS.
//!
//! ```text
//! cargo run --release -p apron-collector --example compaction_bench -- \
//!     --gpus 64 --persists 500 --secs 60 --max-files 48
//! ```
//!
//! Uses only the store's public API, so the same file measures an older commit too.

use std::time::{Duration, Instant};

use apron_collector::{IngestRequest, Store, StoreConfig, Table};
use apron_common::wire::{encode_ipc, windows_to_batch};
use apron_common::{Field, FieldStats, GpuIdentity, GpuUuid, GpuWindow, HostName, UnixMicros};

/// 2026-11-19T00:00:00Z, µs.
const MIDNIGHT: i64 = 20_776 * 86_400_000_000;
const DAY: i64 = 86_400_000_000;

fn arg(args: &[String], name: &str, default: i64) -> Result<i64, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args.get(i + 1).and_then(|v| v.parse().ok()).ok_or_else(|| format!("{name} needs a whole number")),
    }
}

fn vm_hwm_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Persist `n`: every GPU's windows over `secs` seconds from `start_us`, with varied values
/// so that the files compress like real ones rather than to nothing.
fn batch(gpus: usize, start_us: i64, secs: i64) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut rows = Vec::with_capacity(gpus * secs as usize);
    for s in 0..secs {
        for g in 0..gpus {
            let identity = GpuIdentity::gpu(
                HostName::new(format!("node-{:04}", g / 8))?,
                GpuUuid::new(format!("GPU-{g:06}"))?,
                (g % 8) as u32,
                "NVIDIA H100 80GB HBM3",
            );
            let t = start_us + s * 1_000_000;
            let phase = ((t / 1_000_000) as usize + g * 37) % 997;
            let mut w = GpuWindow::new(UnixMicros(t), Duration::from_secs(1), identity);
            let util = (phase % 101) as f64 / 100.0;
            w.fields[Field::GpuUtil.index()] = Some(FieldStats::single(util));
            w.fields[Field::SmActive.index()] = Some(FieldStats::single(util * 0.8));
            w.fields[Field::PowerWatts.index()] = Some(FieldStats::single(90.0 + 6.0 * (phase % 97) as f64));
            w.fields[Field::GpuTempC.index()] = Some(FieldStats::single(35.0 + (phase % 40) as f64));
            w.fields[Field::FbUsedBytes.index()] = Some(FieldStats::single(((phase % 80) as f64) * 1e9));
            rows.push(w);
        }
    }
    Ok(encode_ipc(&windows_to_batch(&rows)?)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let gpus = usize::try_from(arg(&args, "--gpus", 64)?)?;
    let persists = arg(&args, "--persists", 500)?;
    let secs = arg(&args, "--secs", 60)?;
    let max_files = usize::try_from(arg(&args, "--max-files", 48)?)?;
    if persists * secs > 86_400 {
        return Err("--persists × --secs must fit in one day".into());
    }
    let dir = tempfile::tempdir()?;
    let config = StoreConfig {
        data_dir: dir.path().to_path_buf(),
        persist_interval: Duration::from_secs(86_400),
        maintenance_interval: Duration::from_secs(86_400),
        superseded_grace: Duration::ZERO,
        compaction_max_files: max_files,
        ..StoreConfig::default()
    };
    let store = Store::open(config)?;
    let step = 86_400 / persists;
    let (mut merges, mut rows_merged, mut largest, mut merging) = (0usize, 0usize, 0usize, Duration::ZERO);
    let mut account = |report: apron_collector::MaintenanceReport| -> Result<(), String> {
        if !report.errors.is_empty() {
            return Err(report.errors.join("; "));
        }
        for c in report.compacted {
            merges += 1;
            rows_merged += c.rows;
            largest = largest.max(c.rows);
        }
        Ok(())
    };
    let started = Instant::now();
    for n in 0..persists {
        let start = MIDNIGHT + n * step * 1_000_000;
        let body = batch(gpus, start, secs)?;
        let request = IngestRequest {
            table: Table::GpuSamples,
            agent: "bench",
            epoch: "0192f0c1-7c4d-7e2a-9b1d-5f3e2a1b0c9d",
            sequence: u64::try_from(n)?,
            body: &body,
        };
        store.ingest(request)?;
        store.persist_now()?;
        let t = Instant::now();
        account(store.maintain_at(start + secs * 1_000_000))?;
        merging += t.elapsed();
    }
    let t = Instant::now();
    account(store.maintain_at(MIDNIGHT + DAY + 2 * 3_600_000_000))?;
    let day_merge = t.elapsed();
    merging += day_merge;
    let day_rows = gpus * (persists * secs) as usize;
    println!(
        "gpus={gpus} persists={persists} secs={secs} max_files={max_files} day_rows={day_rows} \
         merges={merges} rows_merged={rows_merged} amplification={:.2} largest_merge_rows={largest} \
         merge_s={:.2} end_of_day_merge_s={:.2} files_left={} total_s={:.1} vm_hwm_mib={}",
        rows_merged as f64 / day_rows as f64,
        merging.as_secs_f64(),
        day_merge.as_secs_f64(),
        store.persisted_files(Table::GpuSamples).len(),
        started.elapsed().as_secs_f64(),
        vm_hwm_kib().map_or(0, |k| k / 1024),
    );
    Ok(())
}
