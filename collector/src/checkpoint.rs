//! The checkpoint: the commit point of a persist.
//!
//! `<data>/checkpoint.json`, replaced atomically (temp, fsync, rename, fsync dir). It
//! says which WAL segments are persisted (`wal_through`), the dedup state as of that
//! point, and the Parquet files that persist produced (`publish`: temp name → final
//! name). A persist is committed the moment this file is renamed into place:
//!
//! 1. files are written under hidden temp names (a crash here: they are orphans,
//!    removed at start-up; the WAL still has the rows);
//! 2. the checkpoint is written (the commit);
//! 3. the files are renamed to their final names, then WAL segments `<= wal_through`
//!    are deleted (a crash here: start-up finishes the renames from the checkpoint and
//!    skips those segments, so no row is lost and none is stored twice).

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dedup::DedupState;

pub const FILE_NAME: &str = "checkpoint.json";
const VERSION: u32 = 1;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub version: u32,
    /// WAL segments with an id `<=` this are persisted (0: none).
    pub wal_through: u64,
    /// Renames still to do (paths relative to the data directory).
    pub publish: Vec<Rename>,
    pub dedup: DedupState,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rename {
    pub from: PathBuf,
    pub to: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("checkpoint {path} is not valid: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("checkpoint {path} has version {found}; this build reads version {VERSION}")]
    Version { path: PathBuf, found: u32 },
}

impl CheckpointError {
    pub fn is_storage_full(&self) -> bool {
        matches!(self, CheckpointError::Io { source, .. } if crate::wal::is_full(source))
    }
}

impl Checkpoint {
    pub fn new(wal_through: u64, publish: Vec<Rename>, dedup: DedupState) -> Checkpoint {
        Checkpoint { version: VERSION, wal_through, publish, dedup }
    }

    /// Reads the checkpoint of `data_dir`; a missing file is a fresh store.
    pub fn load(data_dir: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
        let path = data_dir.join(FILE_NAME);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(CheckpointError::Io { path, source }),
        };
        let c: Checkpoint =
            serde_json::from_slice(&bytes).map_err(|source| CheckpointError::Parse { path: path.clone(), source })?;
        if c.version != VERSION {
            return Err(CheckpointError::Version { path, found: c.version });
        }
        Ok(Some(c))
    }

    /// Replaces the checkpoint atomically.
    pub fn store(&self, data_dir: &Path) -> Result<(), CheckpointError> {
        let path = data_dir.join(FILE_NAME);
        let bytes = serde_json::to_vec(self).map_err(|source| CheckpointError::Parse { path: path.clone(), source })?;
        crate::fsutil::write_atomic(&path, &bytes).map_err(|source| CheckpointError::Io { path, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dedup::Dedup;

    #[test]
    fn round_trip_and_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(Checkpoint::load(dir.path()).expect("load"), None);
        let mut d = Dedup::new();
        d.commit("a", "e1", 5, 7);
        let c = Checkpoint::new(
            4,
            vec![Rename { from: "t/date=x/.a.parquet.tmp".into(), to: "t/date=x/a.parquet".into() }],
            d.to_state(),
        );
        c.store(dir.path()).expect("store");
        assert_eq!(Checkpoint::load(dir.path()).expect("load"), Some(c));
    }

    #[test]
    fn garbage_is_an_error_not_a_fresh_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(FILE_NAME), b"{not json").expect("write");
        assert!(matches!(Checkpoint::load(dir.path()), Err(CheckpointError::Parse { .. })));
    }
}
