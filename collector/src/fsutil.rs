//! Small file-system helpers shared by the WAL, the persister and the checkpoint.
//!
//! Durability on POSIX needs two fsyncs for a new name: the file's data, then the
//! directory that holds the name. These helpers keep that pattern in one place.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

/// fsyncs a directory so that names created, renamed or removed in it survive a crash.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` (and parents) and fsyncs each parent whose entry was new, so a freshly
/// created partition directory cannot vanish in a crash after a file was renamed into it.
pub fn create_dir_durable(dir: &Path) -> io::Result<()> {
    // "" is the parent of a relative single-component path: the current directory.
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    create_dir_durable(parent)?;
    match fs::create_dir(dir) {
        Ok(()) => {}
        // Another thread may have created it in between; that is fine.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(e),
    }
    sync_dir(parent)
}

/// Writes `bytes` to `path` atomically: a temp file beside it, fsync, rename, fsync the
/// directory. A crash leaves either the old content or the new, never a mix.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| io::Error::other("path has no file name"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if result.is_err() {
        // Best effort: a leftover temp file is harmless but untidy.
        let _ = fs::remove_file(&tmp);
    }
    result
}

pub const MICROS_PER_DAY: i64 = 86_400_000_000;

/// The UTC day (days since the epoch) a microsecond timestamp falls on.
pub fn day_of_micros(t: i64) -> i64 {
    t.div_euclid(MICROS_PER_DAY)
}

/// The day number of a `YYYY-MM-DD` partition date; `None` when it is not one.
pub use apron_common::parse_date as parse_day;

/// `YYYY-MM-DD` of a day number.
pub use apron_common::date_string;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(date_string(0), "1970-01-01");
        assert_eq!(date_string(-1), "1969-12-31");
        // 2026-11-23 is day 20_780.
        assert_eq!(date_string(20_780), "2026-11-23");
        assert_eq!(date_string(day_of_micros(951_782_400_000_000)), "2000-02-29");
        assert_eq!(day_of_micros(-1), -1);
    }

    #[test]
    fn creates_nested_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        let deep = dir.path().join("a/b/date=2026-01-01");
        create_dir_durable(&deep).expect("create");
        assert!(deep.is_dir());
        create_dir_durable(&deep).expect("exists already");
        create_dir_durable(Path::new("")).expect("the current directory");
    }

    #[test]
    fn atomic_write_replaces() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("x.json");
        write_atomic(&p, b"one").expect("write");
        write_atomic(&p, b"two").expect("write");
        assert_eq!(fs::read(&p).expect("read"), b"two");
        assert_eq!(fs::read_dir(dir.path()).expect("ls").count(), 1, "no temp file left");
    }
}
