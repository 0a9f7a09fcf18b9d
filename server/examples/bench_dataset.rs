//! The storage benchmark's dataset (`scripts/bench-storage.sh`, docs/benchmarks.md,
//! "Storage: Apron vs Prometheus, VictoriaMetrics, DuckDB").
//!
//! ```text
//!  gen:  SimSource::history (the fleet `apron up` backfills, fixed seed and start)
//!          ├─► wire batches, Arrow IPC (zstd) ─► DIR/apron/NNNNNN.arrows   (for `post`)
//!          └─► collector::schema::to_storage (the values exactly as Apron stores them)
//!                ├─► DIR/prom.txt         Prometheus text, ms timestamps   (VictoriaMetrics)
//!                └─► DIR/openmetrics.txt  OpenMetrics, s timestamps, # EOF (promtool)
//!              DIR/meta.json: rows, values (non-NULL measurement cells), series, span
//!  post: DIR/apron/*.arrows ─► POST /api/v1/ingest of a running `apron serve`, in order
//! ```
//!
//! One sample in the text files per non-NULL measurement cell of `gpu_samples`: a series
//! per GPU per measurement column (`apron_gpu_util{host,gpu_uuid,gpu_index,gpu_model}`),
//! with the decimal the collector stores (ratios to 1e-4, watts to mW), so every system
//! receives the same values.
//!
//! ```sh
//! cargo run --release -p apron --example bench_dataset -- gen --gpus 64 --hours 2 --end 1795953600 --out DIR
//! cargo run --release -p apron --example bench_dataset -- post --dir DIR --server http://127.0.0.1:9402 --token T
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use apron_agent::source::sim::{SimConfig, SimSource};
use apron_collector::schema::to_storage;
use apron_common::UnixMicros;
use apron_common::wire::{OWNER_COLUMNS, Table, encode_ipc, headers, windows_to_batch};
use arrow_array::cast::AsArray;
use arrow_array::types::{Decimal128Type, Float64Type, Int32Type, Int64Type, TimestampMicrosecondType};
use arrow_array::{Array, RecordBatch};
use clap::Parser;

/// The identity columns of `gpu_samples`; with the flags and the owner columns
/// ([`OWNER_COLUMNS`]), every other column is a measurement.
const IDENTITY: &[&str] =
    &["time", "window_s", "cluster", "host", "gpu_uuid", "gpu_index", "gpu_model", "parent_gpu_uuid", "mig_profile"];
/// Stored by Apron, not a measurement, not exported to the peers (a per-row flag).
const FLAGS: &[&str] = &["gpu_lost"];

#[derive(Debug, Parser)]
#[command(about = "The storage benchmark's dataset: generate it, or post it to `apron serve`.")]
enum Args {
    /// Generate the dataset from the simulated fleet.
    Gen {
        /// GPUs in the fleet (a multiple of --gpus-per-node).
        #[arg(long, default_value_t = 64)]
        gpus: u32,
        #[arg(long, default_value_t = 8)]
        gpus_per_node: u32,
        /// Hours of history.
        #[arg(long, default_value_t = 2.0)]
        hours: f64,
        /// End of the span, Unix seconds (windows end in (end - hours, end]).
        #[arg(long)]
        end: i64,
        /// Row window (humantime).
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        window: Duration,
        /// Rows per Arrow IPC batch (what one POST carries; `apron up`'s backfill uses 20 000).
        #[arg(long, default_value_t = 20_000)]
        chunk_rows: usize,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Output directory (created).
        #[arg(long)]
        out: PathBuf,
    },
    /// POST every batch of DIR/apron to a server's /api/v1/ingest, in order, one at a time.
    Post {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        server: String,
        #[arg(long, env = "APRON_INGEST_TOKEN", hide_env_values = true)]
        token: String,
    },
}

fn main() -> anyhow::Result<()> {
    match Args::parse() {
        Args::Gen { gpus, gpus_per_node, hours, end, window, chunk_rows, seed, out } => {
            generate(gpus, gpus_per_node, hours, end, window, chunk_rows.max(1), seed, &out)
        }
        Args::Post { dir, server, token } => post(&dir, &server, &token),
    }
}

/// One measurement column's OpenMetrics lines, written apart so that the final file has
/// each metric family in one piece (OpenMetrics forbids interleaving families).
struct Family {
    name: String,
    path: PathBuf,
    out: BufWriter<File>,
    values: u64,
    /// Per GPU (label set id): whether this series has a sample.
    series: Vec<bool>,
}

#[allow(clippy::too_many_arguments)]
fn generate(
    gpus: u32,
    gpus_per_node: u32,
    hours: f64,
    end_s: i64,
    window: Duration,
    chunk_rows: usize,
    seed: u64,
    out: &Path,
) -> anyhow::Result<()> {
    if gpus_per_node == 0 || gpus == 0 || !gpus.is_multiple_of(gpus_per_node) {
        bail!("--gpus {gpus} must be a positive multiple of --gpus-per-node {gpus_per_node}");
    }
    if !(hours > 0.0 && hours.is_finite()) {
        bail!("--hours must be positive");
    }
    let started = Instant::now();
    let end = UnixMicros(end_s.checked_mul(1_000_000).context("--end out of range")?);
    let span = Duration::from_secs_f64(hours * 3600.0);
    let start = end.minus(span);
    let config = SimConfig { nodes: gpus / gpus_per_node, gpus_per_node, seed, ..SimConfig::default() };
    // The lost-GPU scenario counts from the start of the span: the same data at every run.
    let sim = SimSource::starting_at(&config, None, start).context("building the simulated fleet")?;

    let ipc_dir = out.join("apron");
    let om_dir = out.join("openmetrics.parts");
    std::fs::create_dir_all(&ipc_dir).with_context(|| format!("creating {}", ipc_dir.display()))?;
    std::fs::create_dir_all(&om_dir).with_context(|| format!("creating {}", om_dir.display()))?;
    let prom_path = out.join("prom.txt");
    let mut prom = BufWriter::with_capacity(1 << 20, File::create(&prom_path).context("creating prom.txt")?);

    let schema = Table::GpuSamples.schema();
    // Per column of the schema: Some(family) for a measurement.
    let mut families: Vec<Option<Family>> = Vec::with_capacity(schema.fields().len());
    for f in schema.fields() {
        let col = f.name().as_str();
        if IDENTITY.contains(&col) || FLAGS.contains(&col) || OWNER_COLUMNS.contains(&col) {
            families.push(None);
            continue;
        }
        let name = metric_name(col);
        let path = om_dir.join(format!("{col}.part"));
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        families.push(Some(Family {
            name,
            path,
            out: BufWriter::with_capacity(1 << 18, file),
            values: 0,
            series: Vec::new(),
        }));
    }
    let col_index = |name: &str| schema.index_of(name).with_context(|| format!("no column {name}"));
    let (i_time, i_host, i_uuid, i_index, i_model) = (
        col_index("time")?,
        col_index("host")?,
        col_index("gpu_uuid")?,
        col_index("gpu_index")?,
        col_index("gpu_model")?,
    );

    // gpu_uuid → (label set, id).
    let mut labels: HashMap<String, (String, usize)> = HashMap::new();
    let mut rows_total = 0u64;
    let mut chunks = 0u64;
    let mut ipc_bytes = 0u64;
    let mut first_time = i64::MAX;
    let mut last_time = i64::MIN;
    let mut line = String::with_capacity(256);
    let mut value = String::with_capacity(32);
    let mut rows = Vec::with_capacity(chunk_rows);
    let mut history = sim.history(start, end, window).peekable();
    while history.peek().is_some() {
        rows.clear();
        rows.extend(history.by_ref().take(chunk_rows));
        let wire = windows_to_batch(&rows).context("building a wire batch")?;
        let body = encode_ipc(&wire).context("encoding a wire batch")?;
        chunks += 1;
        ipc_bytes += body.len() as u64;
        std::fs::write(ipc_dir.join(format!("{chunks:06}.arrows")), &body).context("writing an IPC batch")?;

        let stored = to_storage(Table::GpuSamples, &wire).context("converting to the storage schema")?;
        let times = stored
            .column(i_time)
            .as_primitive_opt::<TimestampMicrosecondType>()
            .context("time is not Timestamp(µs)")?;
        let text = |i: usize| stored.column(i).as_string_opt::<i32>().context("an identity column is not Utf8");
        let (hosts, uuids, models) = (text(i_host)?, text(i_uuid)?, text(i_model)?);
        let indexes = stored.column(i_index).as_primitive_opt::<Int32Type>().context("gpu_index is not Int32")?;
        for row in 0..stored.num_rows() {
            let t_us = times.value(row);
            first_time = first_time.min(t_us);
            last_time = last_time.max(t_us);
            let uuid = uuids.value(row);
            if !labels.contains_key(uuid) {
                let set = format!(
                    "{{host=\"{}\",gpu_uuid=\"{}\",gpu_index=\"{}\",gpu_model=\"{}\"}}",
                    hosts.value(row),
                    uuid,
                    indexes.value(row),
                    models.value(row)
                );
                let id = labels.len();
                labels.insert(uuid.to_owned(), (set, id));
            }
            let Some((set, id)) = labels.get(uuid).map(|(s, id)| (s.as_str(), *id)) else { continue };
            let (secs, micros) = (t_us.div_euclid(1_000_000), t_us.rem_euclid(1_000_000));
            let millis = t_us.div_euclid(1000);
            for (c, family) in families.iter_mut().enumerate() {
                let Some(family) = family else { continue };
                value.clear();
                if !format_value(&stored, c, row, &mut value)? {
                    continue;
                }
                family.values += 1;
                if family.series.len() <= id {
                    family.series.resize(id + 1, false);
                }
                family.series[id] = true;
                line.clear();
                let _ = writeln!(line, "{}{} {} {}", family.name, set, value, millis);
                prom.write_all(line.as_bytes())?;
                line.clear();
                if micros == 0 {
                    let _ = writeln!(line, "{}{} {} {}", family.name, set, value, secs);
                } else {
                    let _ = writeln!(line, "{}{} {} {}.{:06}", family.name, set, value, secs, micros);
                }
                family.out.write_all(line.as_bytes())?;
            }
        }
        rows_total += stored.num_rows() as u64;
    }
    prom.flush()?;

    // openmetrics.txt: each family in one piece, then # EOF.
    let om_path = out.join("openmetrics.txt");
    let mut om = BufWriter::with_capacity(1 << 20, File::create(&om_path).context("creating openmetrics.txt")?);
    let mut columns = Vec::new();
    let mut values_total = 0u64;
    let mut series_total = 0usize;
    for (c, family) in families.into_iter().enumerate() {
        let Some(mut family) = family else { continue };
        family.out.flush()?;
        drop(family.out);
        if family.values > 0 {
            writeln!(om, "# TYPE {} gauge", family.name)?;
            let mut part = File::open(&family.path)?;
            std::io::copy(&mut part, &mut om)?;
            columns.push(serde_json::json!({
                "column": schema.field(c).name(),
                "metric": family.name,
                "values": family.values,
            }));
        }
        values_total += family.values;
        series_total += family.series.iter().filter(|s| **s).count();
        std::fs::remove_file(&family.path)?;
    }
    writeln!(om, "# EOF")?;
    om.flush()?;
    let _ = std::fs::remove_dir(&om_dir);

    let meta = serde_json::json!({
        "gpus": gpus,
        "gpus_per_node": gpus_per_node,
        "hours": hours,
        "window_s": window.as_secs_f64(),
        "seed": seed,
        "start_s": start.0 as f64 / 1e6,
        "end_s": end_s,
        "first_time_s": first_time as f64 / 1e6,
        "last_time_s": last_time as f64 / 1e6,
        "rows": rows_total,
        "values": values_total,
        "series": series_total,
        "gpus_seen": labels.len(),
        "chunks": chunks,
        "chunk_rows": chunk_rows,
        "ipc_bytes": ipc_bytes,
        "columns": columns,
        "generate_s": started.elapsed().as_secs_f64(),
    });
    std::fs::write(out.join("meta.json"), serde_json::to_vec_pretty(&meta)?).context("writing meta.json")?;
    println!(
        "bench_dataset: {rows_total} rows, {values_total} values, {} series, {chunks} IPC batches in {:.1} s",
        series_total,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `apron_gpu_util` for `gpu_util`, `apron_gpu_sm_active` for `sm_active`.
fn metric_name(column: &str) -> String {
    if column.starts_with("gpu_") { format!("apron_{column}") } else { format!("apron_gpu_{column}") }
}

/// Writes the cell as text; false for NULL.
fn format_value(batch: &RecordBatch, column: usize, row: usize, out: &mut String) -> anyhow::Result<bool> {
    let array = batch.column(column);
    if array.is_null(row) {
        return Ok(false);
    }
    if let Some(a) = array.as_primitive_opt::<Decimal128Type>() {
        out.push_str(&a.value_as_string(row));
    } else if let Some(a) = array.as_primitive_opt::<Int64Type>() {
        let _ = write!(out, "{}", a.value(row));
    } else if let Some(a) = array.as_primitive_opt::<Int32Type>() {
        let _ = write!(out, "{}", a.value(row));
    } else if let Some(a) = array.as_primitive_opt::<Float64Type>() {
        let _ = write!(out, "{}", a.value(row));
    } else if let Some(a) = array.as_boolean_opt() {
        out.push_str(if a.value(row) { "1" } else { "0" });
    } else {
        bail!("column {} has an unexpected type {}", batch.schema().field(column).name(), array.data_type());
    }
    Ok(true)
}

fn post(dir: &Path, server: &str, token: &str) -> anyhow::Result<()> {
    let ipc_dir = dir.join("apron");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&ipc_dir)
        .with_context(|| format!("reading {}", ipc_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "arrows"))
        .collect();
    files.sort();
    let url = format!("{}/api/v1/ingest", server.trim_end_matches('/'));
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let epoch = "bench-storage-1";
    let auth = format!("Bearer {token}");
    let started = Instant::now();
    let mut bytes = 0u64;
    for (i, path) in files.iter().enumerate() {
        let body = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        bytes += body.len() as u64;
        let sequence = (i + 1).to_string();
        let mut resp = agent
            .post(&url)
            .header("Authorization", &auth)
            .header("Content-Type", headers::ARROW_STREAM)
            .header(headers::TABLE, Table::GpuSamples.name())
            .header(headers::AGENT, "bench-storage")
            .header(headers::EPOCH, epoch)
            .header(headers::SEQUENCE, &sequence)
            .send(&body[..])
            .with_context(|| format!("posting to {url}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            bail!("{url} answered {status} to {}: {text}", path.display());
        }
    }
    println!(
        "bench_dataset: posted {} batches ({bytes} bytes) in {:.3} s",
        files.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
