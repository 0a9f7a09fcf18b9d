//! One store per data directory: an exclusive `flock` on `<data>/LOCK`.
//!
//! The kernel drops the lock when the process dies (kill -9 included), so a restart
//! never finds a stale lock, while two live collectors on one directory — which would
//! interleave WAL segments — are refused.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::error::StoreError;

pub(super) struct DirLock {
    _file: File,
}

impl DirLock {
    pub(super) fn acquire(data: &Path) -> Result<DirLock, StoreError> {
        let path = data.join("LOCK");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| StoreError::Io { op: "open lock file", path: path.clone(), source })?;
        // SAFETY: flock on a file descriptor we own and keep open for the lock's life.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::WouldBlock {
                return Err(StoreError::Locked(data.to_path_buf()));
            }
            return Err(StoreError::Io { op: "lock", path, source: err });
        }
        Ok(DirLock { _file: file })
    }
}
