//! Files the server keeps beside its data — the ledger's, alerts' and deliveries' state,
//! stored and exported reports: each written whole and atomically (a crash leaves the
//! old file or the new one, never half of either), its directory made first, and a
//! failure that names the file.

use std::path::{Path, PathBuf};

/// A state or report file that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("{}: {detail}", path.display())]
pub struct FileError {
    pub path: PathBuf,
    pub detail: String,
}

impl FileError {
    fn new(path: &Path, detail: impl ToString) -> FileError {
        FileError { path: path.to_owned(), detail: detail.to_string() }
    }
}

/// Writes `bytes` to `path` atomically, making its directory first.
pub(crate) fn write(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| FileError::new(dir, e))?;
    }
    apron_collector::write_atomic(path, bytes).map_err(|e| FileError::new(path, e))
}

/// Writes `value` as pretty JSON to `path` ([`write`]).
pub(crate) fn save_json(path: &Path, value: &impl serde::Serialize) -> Result<(), FileError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| FileError::new(path, e))?;
    write(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_written_with_its_directory_and_a_failure_names_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a/b/state.json");
        save_json(&path, &serde_json::json!({"k": 1})).expect("saved");
        let back: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        assert_eq!(back["k"], 1);
        // A directory where the file's directory should be.
        std::fs::write(dir.path().join("plain"), b"x").expect("file");
        let e = write(&dir.path().join("plain/state.json"), b"{}").expect_err("not a directory");
        assert!(e.to_string().contains("plain"), "{e}");
    }
}
