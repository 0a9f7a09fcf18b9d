//! Fault injection for the WAL's file seam: the real file system, with writes, fsyncs or
//! segment creation made to fail on demand, as a full disk or a failing device would.
//!
//! Public so that the collector's integration tests (and later the server's) can drive
//! the store into its storage-failure paths without root or a tiny file system.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::file::{StdIo, WalFile, WalIo};

/// What to break.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Everything works.
    None,
    /// A write stores the first half of its buffer and then fails with ENOSPC — the
    /// worst case, a torn record on disk.
    DiskFull,
    /// fsync fails with EIO (after the data was handed to the kernel).
    SyncFails,
    /// Creating a segment fails with ENOSPC.
    CreateFails,
    /// fsync works but takes this long (to observe group commit deterministically).
    SlowSync(Duration),
}

/// [`StdIo`] with an injectable [`Fault`]; clones share the switch.
#[derive(Clone, Debug)]
pub struct FaultyIo {
    fault: Arc<Mutex<Fault>>,
    syncs: Arc<AtomicU64>,
}

impl Default for FaultyIo {
    fn default() -> Self {
        FaultyIo { fault: Arc::new(Mutex::new(Fault::None)), syncs: Arc::new(AtomicU64::new(0)) }
    }
}

impl FaultyIo {
    pub fn new() -> FaultyIo {
        FaultyIo::default()
    }

    pub fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap_or_else(PoisonError::into_inner) = fault;
    }

    /// Successful file fsyncs so far (segment headers included).
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    fn get(&self) -> Fault {
        *self.fault.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn enospc() -> io::Error {
    io::Error::from(io::ErrorKind::StorageFull)
}

impl WalIo for FaultyIo {
    fn create(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        if self.get() == Fault::CreateFails {
            return Err(enospc());
        }
        let inner = StdIo.create(path)?;
        Ok(Box::new(FaultyFile { inner, io: self.clone() }))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        StdIo.sync_dir(dir)
    }
}

struct FaultyFile {
    inner: Box<dyn WalFile>,
    io: FaultyIo,
}

impl WalFile for FaultyFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        if self.io.get() == Fault::DiskFull {
            self.inner.write_all(&buf[..buf.len() / 2])?;
            return Err(enospc());
        }
        self.inner.write_all(buf)
    }

    fn sync(&mut self) -> io::Result<()> {
        match self.io.get() {
            Fault::SyncFails => return Err(io::Error::other("injected fsync failure (EIO)")),
            Fault::SlowSync(d) => std::thread::sleep(d),
            _ => {}
        }
        self.inner.sync()?;
        self.io.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.inner.truncate(len)
    }
}
