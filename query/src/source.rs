//! Where table data comes from: [`TableSource`], implemented for the live
//! [`apron_collector::Store`] (memtable + Parquet) and for a data directory opened
//! read-only without a server ([`DirectorySource`], Parquet only).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use apron_collector::persist::{self, PersistError};
use apron_collector::schema::storage_schema;
use apron_collector::{PersistedFile, Store, Table};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::object_store::ObjectStore;

/// One persisted Parquet file of a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataFile {
    pub path: PathBuf,
    pub bytes: u64,
    /// The UTC day (days since 1970-01-01) of its `date=` partition: every row's time
    /// column falls in that day. `None` when unknown (the file is then never pruned).
    pub day: Option<i64>,
}

/// A consistent view of one table: rows still in memory and the Parquet files, with no
/// row in both.
#[derive(Clone, Debug, Default)]
pub struct TableSnapshot {
    /// In the table's schema ([`TableSource::schema`]).
    pub batches: Vec<RecordBatch>,
    pub files: Vec<DataFile>,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("data directory {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("listing Parquet files: {0}")]
    List(#[from] PersistError),
    #[error("reading the lake: {0}")]
    Lake(String),
}

/// What the query layer reads: per table name, the schema, the memtable batches and the
/// Parquet files. `snapshot` is called once per table scan (at planning), so each query
/// sees the data as of its start.
pub trait TableSource: Send + Sync + fmt::Debug {
    /// The schema shared by the batches and files of `table`; `None` when this source
    /// does not hold the table (it is then not registered).
    fn schema(&self, table: &str) -> Option<SchemaRef>;

    /// The table's data now.
    fn snapshot(&self, table: &str) -> Result<TableSnapshot, SourceError>;

    /// The object store the files live in and its URL (`s3://bucket`), in which each
    /// [`DataFile::path`] is then a key; `None` (the default) for local paths.
    fn object_store(&self) -> Option<(String, Arc<dyn ObjectStore>)> {
        None
    }

    /// The record of what each stored `gpu_samples_1m` day read, when this source keeps
    /// it itself (the lake: merged from the shards' statuses); `None` (the default) when
    /// it is the materializer's state file the engine was given.
    fn rollup_state(&self) -> Option<Result<crate::rollup::RollupState, SourceError>> {
        None
    }

    /// True when the files come from several shards whose derived rows must be merged
    /// ([`crate::lake::MergedCostTable`]).
    fn merges_shards(&self) -> bool {
        false
    }

    /// Shards whose collectors are not current (a cluster's lake); may block on the
    /// network. None for a single store.
    fn stale_shards(&self) -> Vec<String> {
        Vec::new()
    }
}

fn data_files(files: Vec<PersistedFile>) -> Vec<DataFile> {
    files.into_iter().map(|f| DataFile { day: parse_date(&f.date), path: f.path, bytes: f.bytes }).collect()
}

/// The live store: memtable batches (queryable as soon as ingested) and published files,
/// taken under the store's lock so no row is in both.
impl TableSource for Store {
    fn schema(&self, table: &str) -> Option<SchemaRef> {
        Table::from_name(table).map(storage_schema)
    }

    fn snapshot(&self, table: &str) -> Result<TableSnapshot, SourceError> {
        let Some(t) = Table::from_name(table) else { return Ok(TableSnapshot::default()) };
        let view = self.view(t);
        Ok(TableSnapshot { batches: view.batches, files: data_files(view.files) })
    }

    fn object_store(&self) -> Option<(String, Arc<dyn ObjectStore>)> {
        Store::object_store(self)
    }
}

/// A data directory read without a server (`apron sql --data DIR`): the published
/// Parquet files of each table's `date=` partitions, listed afresh at every query. Rows
/// still in the WAL (not yet persisted, at most one persist interval) are not visible:
/// replaying the WAL would need the store's lock and writes, which a reader must not take.
#[derive(Clone, Debug)]
pub struct DirectorySource {
    data_dir: PathBuf,
}

impl DirectorySource {
    /// Opens `data_dir` for reading; nothing in it is created, locked or changed.
    pub fn open(data_dir: impl AsRef<Path>) -> Result<DirectorySource, SourceError> {
        let path = data_dir.as_ref();
        let meta = std::fs::metadata(path).map_err(|source| SourceError::Io { path: path.to_path_buf(), source })?;
        if !meta.is_dir() {
            return Err(SourceError::NotADirectory { path: path.to_path_buf() });
        }
        // Absolute, so file paths stay valid whatever the process's working directory.
        let data_dir =
            std::path::absolute(path).map_err(|source| SourceError::Io { path: path.to_path_buf(), source })?;
        Ok(DirectorySource { data_dir })
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }
}

impl TableSource for DirectorySource {
    fn schema(&self, table: &str) -> Option<SchemaRef> {
        Table::from_name(table).map(storage_schema)
    }

    fn snapshot(&self, table: &str) -> Result<TableSnapshot, SourceError> {
        let Some(t) = Table::from_name(table) else { return Ok(TableSnapshot::default()) };
        Ok(TableSnapshot { batches: Vec::new(), files: data_files(persist::list_files(&self.data_dir, t)?) })
    }
}

pub use apron_common::parse_date;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_source_refuses_missing_dir_and_lists_nothing_in_empty_one() {
        assert!(matches!(DirectorySource::open("/nonexistent/apron"), Err(SourceError::Io { .. })));
        let dir = tempfile::tempdir().expect("tempdir");
        let src = DirectorySource::open(dir.path()).expect("open");
        let snap = src.snapshot("gpu_samples").expect("snapshot");
        assert!(snap.files.is_empty() && snap.batches.is_empty());
        assert!(src.schema("gpu_samples").is_some());
        assert!(src.schema("nope").is_none());
        // Reading created nothing.
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 0);
    }
}
