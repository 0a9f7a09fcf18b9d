//! Writes a small store with synthetic `gpu_samples` and `gpu_processes` and persists
//! it to Parquet, so external readers (pyarrow, DuckDB) can be checked against it:
//!
//! ```text
//! cargo run -p apron-collector --example write_sample -- /tmp/apron-sample
//! python3 collector/tests/read_parquet.py /tmp/apron-sample
//! ```

use std::time::Duration;

use apron_collector::{IngestRequest, Store, StoreConfig, Table};
use apron_common::wire::{encode_ipc, processes_to_batch, windows_to_batch};
use apron_common::{Field, FieldStats, GpuIdentity, GpuUuid, GpuWindow, HostName, ProcessRow, UnixMicros};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: write_sample DATA_DIR")?;
    let store = Store::open(StoreConfig { data_dir: dir.into(), ..StoreConfig::default() })?;
    let t0 = 1_795_000_000_000_000; // 2026-11-18T11:06:40Z
    let gpu = |g: usize| {
        GpuIdentity::gpu(
            HostName::new(format!("node-{}", g / 4)).expect("valid host"),
            GpuUuid::new(format!("GPU-{g:04}")).expect("valid uuid"),
            (g % 4) as u32,
            "NVIDIA H100 80GB HBM3",
        )
    };
    let one = |v: f64| Some(FieldStats::single(v));
    for batch in 0..6i64 {
        let mut rows = Vec::new();
        for s in 0..10 {
            for g in 0..8 {
                let t = t0 + (batch * 10 + s) * 1_000_000;
                let mut w = GpuWindow::new(UnixMicros(t), Duration::from_secs(1), gpu(g));
                w.fields[Field::GpuUtil.index()] = one(((g as i64 * 13 + s) % 100) as f64 / 100.0);
                w.fields[Field::SmActive.index()] = one(0.4321);
                w.fields[Field::PowerWatts.index()] = one(312.456);
                w.fields[Field::GpuTempC.index()] = one(61.0);
                w.fields[Field::FbUsedBytes.index()] = one(42.0 * 1024.0 * 1024.0 * 1024.0);
                w.fields[Field::EnergyJoules.index()] = one(123_456_789.123);
                rows.push(w);
            }
        }
        let body = encode_ipc(&windows_to_batch(&rows)?)?;
        let req = IngestRequest {
            table: Table::GpuSamples,
            agent: "sample",
            epoch: "e1",
            sequence: batch as u64,
            body: &body,
        };
        store.ingest(req)?;
    }
    let procs: Vec<ProcessRow> = (0..8)
        .map(|g| ProcessRow {
            time: UnixMicros(t0),
            host: gpu(g).host,
            gpu_uuid: gpu(g).gpu_uuid,
            pid: 1000 + g as u32,
            process_name: Some("python".into()),
            user: Some("alice".into()),
            fb_used_bytes: Some(1 << 30),
            sm_util: Some(0.37),
            container_id: None,
            pod: Some(format!("train-{g}")),
            namespace: Some("ml".into()),
            container: None,
            pod_uid: None,
            job_id: None,
        })
        .collect();
    let body = encode_ipc(&processes_to_batch(&procs)?)?;
    store.ingest(IngestRequest {
        table: Table::GpuProcesses,
        agent: "sample",
        epoch: "e1",
        sequence: 100,
        body: &body,
    })?;
    let report = store.persist_now()?;
    for f in &report.files {
        println!("{}", f.path.display());
    }
    Ok(())
}
