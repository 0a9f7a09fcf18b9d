//! The store's configuration: a plain struct the server embeds in its TOML config.
//! No environment reads here; the binary layers flags and `APRON_*` variables on top.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// Configuration of [`crate::Store`]. Durations are humantime strings (`10m`, `7d`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Root of the WAL, the checkpoint and the Parquet tables.
    pub data_dir: PathBuf,
    /// A WAL segment is closed once it reaches this size.
    pub wal_segment_bytes: u64,
    /// Persist the memtable to Parquet at least this often.
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub persist_interval: Duration,
    /// … or as soon as the memtable holds this many Arrow bytes.
    pub persist_max_bytes: u64,
    /// The memory budget of rows not yet persisted (the active memtable, the one being
    /// persisted, and batches between their WAL append and their insert). Ingest that
    /// would pass it is refused with 503 and `Retry-After` until a persist frees room;
    /// agents keep such batches in their spool, so nothing is lost. At least twice
    /// `persist_max_bytes`, so ingest goes on while a full memtable persists.
    pub memtable_max_bytes: u64,
    /// Requests with more rows are refused (413).
    pub max_rows_per_batch: usize,
    /// Requests whose Arrow buffers would decode (decompress) to more bytes are
    /// refused (413) before anything is allocated.
    pub max_batch_bytes: u64,
    /// Dedup forgets an (agent, epoch) not seen for this long. Must exceed the longest
    /// time an agent may keep retrying an old batch (its spool drains after outages).
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub dedup_retention: Duration,
    /// Rows per Parquet row group.
    pub row_group_rows: usize,
    /// zstd level of the Parquet pages written by persists, compactions and derived
    /// partitions (1–22): higher is smaller and slower to write, never slower to read.
    pub zstd_level: i32,
    /// Parquet encoding of activity and gauge readings: `delta` (every reader) or
    /// `byte_stream_split` (about 16 % smaller; DuckDB 2.0, Spark 4, pyarrow 16 or
    /// later to read the lake directly).
    pub reading_encoding: crate::persist::ReadingEncoding,
    /// How often compaction, retention and the deletion of superseded files run.
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub maintenance_interval: Duration,
    /// A finished day's partition is merged into one file this long after the day ends
    /// (late batches of the day usually are in by then; later ones are tiered beside it).
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub compaction_delay: Duration,
    /// A size tier of a partition (persists' files, merges of those, …) with more files
    /// than this is merged into one file of the next tier, also before the day is over.
    pub compaction_max_files: usize,
    /// Rows a merge holds in memory at once (it works through GPU ranges of this size).
    pub compaction_memory_rows: usize,
    /// Decoded bytes a merge holds in memory at once (estimated from the storage
    /// schema's row width); the smaller of this and `compaction_memory_rows` wins.
    pub compaction_memory_bytes: usize,
    /// Merged inputs stay on disk (hidden from listings) this long, so queries planned
    /// before the merge can still read them.
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub superseded_grace: Duration,
    /// Raw tables (`gpu_samples`, `gpu_processes`): partitions whose day ended longer ago
    /// are deleted.
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub retention_raw: Duration,
    /// Derived tables (`gpu_samples_1m`, `allocations`, `gpu_cost_hourly`).
    #[serde(deserialize_with = "apron_common::duration::deserialize")]
    pub retention_derived: Duration,
    /// Keep the published Parquet files in an S3-compatible bucket instead of
    /// `data_dir` (which still holds the WAL, the checkpoint and files being written).
    pub object_store: Option<crate::storage::ObjectStoreConfig>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            data_dir: PathBuf::from("apron-data"),
            wal_segment_bytes: 64 << 20,
            persist_interval: Duration::from_secs(600),
            // 1,000 GPUs at 1 s windows fill 128 MiB in ~5 minutes; a persist of 64 MiB
            // takes ~0.4 s. Half the budgets until 2026-12-06 took a 1,000-GPU server's
            // peak from 1,032 to 969 MiB (docs/benchmarks.md, run L).
            persist_max_bytes: 64 << 20,
            memtable_max_bytes: 128 << 20,
            max_rows_per_batch: 100_000,
            max_batch_bytes: 512 << 20,
            dedup_retention: Duration::from_secs(7 * 86_400),
            row_group_rows: 100_000,
            zstd_level: crate::persist::PersistOptions::DEFAULT_ZSTD_LEVEL,
            reading_encoding: crate::persist::ReadingEncoding::Delta,
            maintenance_interval: Duration::from_secs(60),
            compaction_delay: Duration::from_secs(3600),
            compaction_max_files: 48,
            compaction_memory_rows: 2_000_000,
            compaction_memory_bytes: 128 << 20,
            superseded_grace: Duration::from_secs(300),
            retention_raw: Duration::from_secs(30 * 86_400),
            retention_derived: Duration::from_secs(400 * 86_400),
            object_store: None,
        }
    }
}

/// A `[storage]` setting that serde accepted but that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreConfigError {
    #[error("[storage] compaction_memory_bytes and compaction_memory_rows must be positive")]
    CompactionMemory,
    #[error("[storage] zstd_level ({0}) must be between 1 and 22")]
    ZstdLevel(i32),
    #[error(
        "[storage.object_store] part_bytes ({part_bytes}) must be at least 5 MiB ({min}): S3 refuses smaller parts",
        min = crate::storage::MIN_PART_BYTES
    )]
    PartBytes { part_bytes: usize },
    #[error(
        "[storage] memtable_max_bytes ({memtable}) must be at least twice persist_max_bytes ({persist}): ingest \
         would stall whenever a full memtable is being persisted"
    )]
    MemtableBudget { memtable: u64, persist: u64 },
}

impl StoreConfig {
    /// Checks what serde cannot: limits that only make sense together.
    pub fn validate(&self) -> Result<(), StoreConfigError> {
        if self.compaction_memory_bytes == 0 || self.compaction_memory_rows == 0 {
            return Err(StoreConfigError::CompactionMemory);
        }
        if !(1..=22).contains(&self.zstd_level) {
            return Err(StoreConfigError::ZstdLevel(self.zstd_level));
        }
        if let Some(o) = &self.object_store
            && o.part_bytes < crate::storage::MIN_PART_BYTES
        {
            return Err(StoreConfigError::PartBytes { part_bytes: o.part_bytes });
        }
        if self.memtable_max_bytes < self.persist_max_bytes.saturating_mul(2) {
            return Err(StoreConfigError::MemtableBudget {
                memtable: self.memtable_max_bytes,
                persist: self.persist_max_bytes,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_humantime_and_unknown_fields() {
        let c: StoreConfig = serde_json::from_str(r#"{"persist_interval": "30s", "data_dir": "/d"}"#).expect("parse");
        assert_eq!(c.persist_interval, Duration::from_secs(30));
        assert_eq!(c.data_dir, PathBuf::from("/d"));
        assert_eq!(c.wal_segment_bytes, 64 << 20);
        assert_eq!((c.memtable_max_bytes, c.persist_max_bytes), (128 << 20, 64 << 20));
        assert_eq!(c.dedup_retention, Duration::from_secs(7 * 86_400));
        assert_eq!(c.retention_raw, Duration::from_secs(30 * 86_400));
        assert_eq!(c.retention_derived, Duration::from_secs(400 * 86_400));
        let err = serde_json::from_str::<StoreConfig>(r#"{"persist_intervall": "30s"}"#).expect_err("unknown");
        assert!(err.to_string().contains("unknown field"), "{err}");
        assert!(serde_json::from_str::<StoreConfig>(r#"{"persist_interval": "soon"}"#).is_err());
        use crate::persist::ReadingEncoding;
        assert_eq!(c.reading_encoding, ReadingEncoding::Delta, "what every lake reader opens");
        let c: StoreConfig = serde_json::from_str(r#"{"reading_encoding": "byte_stream_split"}"#).expect("parse");
        assert_eq!(c.reading_encoding, ReadingEncoding::ByteStreamSplit);
        let err = serde_json::from_str::<StoreConfig>(r#"{"reading_encoding": "gorilla"}"#).expect_err("unknown");
        assert!(err.to_string().contains("unknown variant"), "{err}");
    }

    #[test]
    fn object_store_parts_are_at_least_what_s3_takes() {
        let with = |part_bytes| StoreConfig {
            object_store: Some(crate::storage::ObjectStoreConfig {
                url: "s3://b".into(),
                part_bytes,
                ..Default::default()
            }),
            ..StoreConfig::default()
        };
        assert_eq!(with(16 << 20).validate(), Ok(()));
        assert_eq!(crate::storage::ObjectStoreConfig::default().part_bytes, 16 << 20);
        let err = with(1 << 20).validate().expect_err("too small").to_string();
        assert!(err.contains("part_bytes (1048576) must be at least 5 MiB"), "{err}");
    }

    #[test]
    fn zstd_level_is_one_zstd_knows() {
        let with = |zstd_level| StoreConfig { zstd_level, ..StoreConfig::default() };
        for ok in [1, 3, 9, 22] {
            assert_eq!(with(ok).validate(), Ok(()), "{ok}");
        }
        for bad in [0, -1, 23] {
            let err = with(bad).validate().expect_err("out of range").to_string();
            assert!(err.contains(&format!("zstd_level ({bad}) must be between 1 and 22")), "{err}");
        }
    }
}
