//! The seam between the WAL writer and the file system.
//!
//! The writer only needs to create a segment, append, fsync, cut back and fsync the
//! directory. Behind a trait, tests can make any of those fail (see [`super::FaultyIo`])
//! and prove that a failed append leaves a log that later appends and replay accept.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::path::Path;

/// An open segment, positioned at its end.
pub trait WalFile: Send {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()>;
    /// Makes everything written durable (`fdatasync`).
    fn sync(&mut self) -> io::Result<()>;
    /// Cuts the file to `len` bytes and positions the next write there.
    fn truncate(&mut self, len: u64) -> io::Result<()>;
}

/// Creates segment files and syncs their directory.
pub trait WalIo: Send + Sync + fmt::Debug {
    /// Creates a new, empty file (failing if it exists).
    fn create(&self, path: &Path) -> io::Result<Box<dyn WalFile>>;
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdIo;

impl WalIo for StdIo {
    fn create(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        let f = OpenOptions::new().write(true).create_new(true).open(path)?;
        Ok(Box::new(StdFile(f)))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        crate::fsutil::sync_dir(dir)
    }
}

struct StdFile(File);

impl WalFile for StdFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.0.write_all(buf)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.0.set_len(len)?;
        self.0.seek(SeekFrom::Start(len))?;
        Ok(())
    }
}
