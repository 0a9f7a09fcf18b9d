//! Where published Parquet files live: the data directory (default) or an S3-compatible
//! object store (`[storage.object_store] url = "s3://bucket/prefix"`), behind one seam.
//!
//! Only published files move. The WAL, the checkpoint, compaction journals and every
//! file being written stay in the local data directory, because they need what object
//! stores do not offer (fsync, atomic rename, appends). Publishing is where the two
//! differ:
//!
//! | step | local | object store |
//! | --- | --- | --- |
//! | publish a staged file | rename temp → final, fsync dir | PUT the temp file's bytes to `<prefix>/<table>/date=D/<uuid>.parquet` (atomic: the object appears whole or not at all) — a multipart upload of `part_bytes` parts read from disk one at a time when larger — then delete the temp file |
//! | list | `read_dir` of the partitions | LIST `<prefix>/<table>/` |
//! | read (compaction) | the file itself | GET, streamed into a scratch file next to the partition's journal |
//! | remove | unlink | DELETE |
//!
//! Publishing is idempotent in both: a temp file that is gone was published before a
//! crash (it is deleted only after its PUT succeeded), so start-up can redo the list in
//! the checkpoint or a compaction journal safely. For an object store the
//! [`PersistedFile::path`] of a published file is its object key (relative to the
//! bucket), which the query layer reads through [`Storage::object_store`].

use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use apron_common::wire::Table;
use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde::Deserialize;

use crate::fsutil;
use crate::persist::{PersistError, PersistedFile};

/// `[storage.object_store]`: an S3-compatible bucket as the root of the Parquet tables.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectStoreConfig {
    /// `s3://bucket` or `s3://bucket/prefix`.
    pub url: String,
    /// For S3-compatible servers (MinIO, Ceph, s3s): `http://host:port`.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    /// Allow a plain-HTTP endpoint (never for a real deployment across a network).
    #[serde(default)]
    pub allow_http: bool,
    /// Files larger than this are uploaded in parts of this size (at least 5 MiB, S3's
    /// smallest part); an upload holds one part in memory, whatever the file's size.
    #[serde(default = "default_part_bytes")]
    pub part_bytes: usize,
}

/// S3's smallest part (all but the last).
pub const MIN_PART_BYTES: usize = 5 << 20;

fn default_part_bytes() -> usize {
    16 << 20
}

impl Default for ObjectStoreConfig {
    fn default() -> ObjectStoreConfig {
        ObjectStoreConfig {
            url: String::new(),
            endpoint: None,
            region: None,
            access_key_id: None,
            secret_access_key: None,
            allow_http: false,
            part_bytes: default_part_bytes(),
        }
    }
}

/// Why the object store could not be set up or used.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("object store URL {url:?}: {detail}")]
    Url { url: String, detail: String },
    #[error("object store: {0}")]
    ObjectStore(#[from] object_store::Error),
    #[error("object store runtime: {0}")]
    Runtime(io::Error),
}

/// The bucket, the key prefix and a small runtime of its own for the HTTP client: the
/// store's threads are plain threads, and some callers sit inside another runtime.
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    url: String,
    prefix: ObjectPath,
    part_bytes: usize,
    runtime: OwnRuntime,
}

/// Shut down without blocking: the store may be dropped inside an async context,
/// where dropping a runtime would panic.
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl fmt::Debug for Remote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remote").field("url", &self.url).field("prefix", &self.prefix).finish()
    }
}

impl Remote {
    pub fn open(config: &ObjectStoreConfig) -> Result<Remote, StorageError> {
        let bad = |detail: &str| StorageError::Url { url: config.url.clone(), detail: detail.to_owned() };
        let rest = config.url.strip_prefix("s3://").ok_or_else(|| bad("only s3:// URLs are supported"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(bad("no bucket"));
        }
        let prefix = ObjectPath::parse(prefix.trim_end_matches('/')).map_err(|e| bad(&e.to_string()))?;
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_region(config.region.clone().unwrap_or_else(|| "us-east-1".to_owned()))
            .with_allow_http(config.allow_http);
        if let Some(e) = &config.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(k) = &config.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(k) = &config.secret_access_key {
            b = b.with_secret_access_key(k);
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("apron-objstore")
            .enable_all()
            .build()
            .map_err(StorageError::Runtime)?;
        Ok(Remote {
            store: Arc::new(b.build()?),
            url: format!("s3://{bucket}"),
            prefix,
            part_bytes: config.part_bytes.max(1),
            runtime: OwnRuntime(Some(runtime)),
        })
    }

    /// Runs `f` on the remote's runtime and waits, from any thread (also one inside
    /// another runtime, where `block_on` would panic).
    fn wait<T: Send + 'static>(
        &self,
        f: impl Future<Output = Result<T, object_store::Error>> + Send + 'static,
    ) -> Result<T, object_store::Error> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        if let Some(rt) = &self.runtime.0 {
            rt.spawn(async move {
                let _ = tx.send(f.await);
            });
        }
        rx.recv().unwrap_or_else(|_| {
            Err(object_store::Error::Generic { store: "S3", source: "object store task ended".into() })
        })
    }

    fn key(&self, relative: &Path) -> ObjectPath {
        let mut key = self.prefix.clone();
        for part in relative.iter() {
            key = key.join(part.to_string_lossy().as_ref());
        }
        key
    }
}

/// Local directory or object store; see the module docs.
#[derive(Debug)]
pub enum Storage {
    Local { data_dir: PathBuf },
    Remote { data_dir: PathBuf, remote: Remote },
}

/// A published file's bytes on the local disk; see [`Storage::local_copy`].
#[derive(Debug)]
pub struct LocalCopy {
    path: PathBuf,
    scratch: bool,
}

impl LocalCopy {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LocalCopy {
    fn drop(&mut self) {
        if self.scratch {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Up to `n` bytes of `file` from its current position (fewer only at its end).
fn read_part(file: &fs::File, n: usize) -> Result<Vec<u8>, object_store::Error> {
    let mut part = Vec::with_capacity(n);
    file.take(n as u64).read_to_end(&mut part).map_err(generic)?;
    Ok(part)
}

fn generic(e: io::Error) -> object_store::Error {
    object_store::Error::Generic { store: "S3", source: Box::new(e) }
}

fn io_error(op: &'static str, path: &Path, e: impl std::error::Error + Send + Sync + 'static) -> PersistError {
    PersistError::Io { op, path: path.to_path_buf(), source: io::Error::other(e) }
}

impl Storage {
    pub fn open(data_dir: &Path, object_store: Option<&ObjectStoreConfig>) -> Result<Storage, StorageError> {
        Ok(match object_store {
            None => Storage::Local { data_dir: data_dir.to_path_buf() },
            Some(c) => Storage::Remote { data_dir: data_dir.to_path_buf(), remote: Remote::open(c)? },
        })
    }

    pub fn data_dir(&self) -> &Path {
        match self {
            Storage::Local { data_dir } | Storage::Remote { data_dir, .. } => data_dir,
        }
    }

    /// The object store and its URL (`s3://bucket`), when files live in one; the paths
    /// of published files are then keys in it.
    pub fn object_store(&self) -> Option<(String, Arc<dyn ObjectStore>)> {
        match self {
            Storage::Local { .. } => None,
            Storage::Remote { remote, .. } => Some((remote.url.clone(), remote.store.clone())),
        }
    }

    /// The published form of a file staged at local path `local` (its final local
    /// name): the same path, or its object key.
    pub fn published(&self, mut file: PersistedFile) -> PersistedFile {
        if let Storage::Remote { data_dir, remote } = self {
            let rel = file.path.strip_prefix(data_dir).unwrap_or(&file.path);
            file.path = PathBuf::from(remote.key(rel).as_ref());
        }
        file
    }

    /// Makes staged files visible: `(temp, final local path)` pairs. Idempotent.
    pub fn publish(&self, pairs: &[(PathBuf, PathBuf)]) -> Result<(), PersistError> {
        let (data_dir, remote) = match self {
            Storage::Local { .. } => return crate::persist::publish(pairs),
            Storage::Remote { data_dir, remote } => (data_dir, remote),
        };
        for (tmp, path) in pairs {
            let len = match fs::metadata(tmp) {
                Ok(m) => m.len(),
                // Uploaded before a crash: the temp file is removed only after the PUT.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(PersistError::Io { op: "stat", path: tmp.clone(), source: e }),
            };
            let key = remote.key(path.strip_prefix(data_dir).unwrap_or(path));
            let store = remote.store.clone();
            let part_bytes = remote.part_bytes;
            let file =
                fs::File::open(tmp).map_err(|e| PersistError::Io { op: "open", path: tmp.clone(), source: e })?;
            remote
                .wait(async move {
                    if len <= part_bytes as u64 {
                        let bytes = read_part(&file, part_bytes)?;
                        return store.put(&key, PutPayload::from(bytes)).await.map(|_| ());
                    }
                    // One part in flight: the upload holds one part in memory. Not
                    // object_store's `WriteMultipart`: its `finish` returns on a failed
                    // part without aborting, which would leave the parts billed in the
                    // bucket until a lifecycle rule removes them.
                    let mut upload = store.put_multipart(&key).await?;
                    let uploaded = async {
                        loop {
                            let part = read_part(&file, part_bytes)?;
                            if part.is_empty() {
                                break;
                            }
                            upload.put_part(PutPayload::from(part)).await?;
                        }
                        upload.complete().await.map(|_| ())
                    }
                    .await;
                    if uploaded.is_err() {
                        let _ = upload.abort().await;
                    }
                    uploaded
                })
                .map_err(|e| io_error("upload", path, e))?;
            fs::remove_file(tmp).map_err(|e| PersistError::Io { op: "remove", path: tmp.clone(), source: e })?;
        }
        Ok(())
    }

    /// The published files of `table`, in path order; inputs of a committed compaction
    /// (named in its local journal) are left out.
    pub fn list(&self, table: Table) -> Result<Vec<PersistedFile>, PersistError> {
        let (data_dir, remote) = match self {
            Storage::Local { data_dir } => return crate::persist::list_files(data_dir, table),
            Storage::Remote { data_dir, remote } => (data_dir, remote),
        };
        let prefix = remote.key(Path::new(table.name()));
        let store = remote.store.clone();
        let listed: Vec<object_store::ObjectMeta> = remote
            .wait(async move { store.list(Some(&prefix)).try_collect().await })
            .map_err(|e| io_error("list", Path::new(table.name()), e))?;
        let mut out = Vec::new();
        for meta in listed {
            let parts: Vec<String> = meta.location.parts().map(|p| p.as_ref().to_owned()).collect();
            let [.., partition, name] = parts.as_slice() else { continue };
            let Some(date) = partition.strip_prefix("date=") else { continue };
            if name.starts_with('.') || !name.ends_with(".parquet") {
                continue;
            }
            let local_dir = crate::persist::table_dir(data_dir, table).join(partition);
            let superseded = crate::compact::read_journal(&local_dir)?.map(|j| j.inputs).unwrap_or_default();
            if superseded.iter().any(|s| s == name) {
                continue;
            }
            out.push(PersistedFile {
                table,
                date: date.to_owned(),
                path: PathBuf::from(meta.location.as_ref()),
                bytes: meta.size,
            });
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// A local file with the bytes of published `file`, to be read a row group at a
    /// time: the file itself, or (object store) a download streamed into a hidden
    /// scratch file in `scratch_dir`, deleted when the copy is dropped (and at start-up,
    /// with the other temp files, after a crash).
    pub fn local_copy(&self, file: &PersistedFile, scratch_dir: &Path) -> Result<LocalCopy, PersistError> {
        let remote = match self {
            Storage::Local { .. } => return Ok(LocalCopy { path: file.path.clone(), scratch: false }),
            Storage::Remote { remote, .. } => remote,
        };
        let path = scratch_dir.join(format!(".{}.download.parquet.tmp", uuid::Uuid::now_v7()));
        let mut out =
            fs::File::create(&path).map_err(|e| PersistError::Io { op: "create", path: path.clone(), source: e })?;
        // From here on the scratch file goes on drop, also on error.
        let copy = LocalCopy { path, scratch: true };
        let store = remote.store.clone();
        let key = ObjectPath::from(file.path.to_string_lossy().as_ref());
        remote
            .wait(async move {
                let mut pieces = store.get(&key).await?.into_stream();
                while let Some(piece) = pieces.try_next().await? {
                    out.write_all(&piece).map_err(generic)?;
                }
                // No fsync: a scratch copy is read now and never survives a crash.
                Ok(())
            })
            .map_err(|e| io_error("download", &file.path, e))?;
        Ok(copy)
    }

    /// Removes published file `name` of a partition (`local_dir` is the partition's
    /// local directory). A file already gone is fine.
    pub fn remove(&self, local_dir: &Path, name: &str) -> Result<(), PersistError> {
        let path = local_dir.join(name);
        match self {
            Storage::Local { .. } => match fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(PersistError::Io { op: "remove", path, source: e }),
            },
            Storage::Remote { data_dir, remote } => {
                let key = remote.key(path.strip_prefix(data_dir).unwrap_or(&path));
                let store = remote.store.clone();
                match remote.wait(async move { store.delete(&key).await }) {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(io_error("delete", &path, e)),
                }
            }
        }
    }

    /// Removes a whole partition (retention): its published files and its local directory.
    pub fn drop_partition(&self, table: Table, date: &str) -> Result<(), PersistError> {
        let local = crate::persist::table_dir(self.data_dir(), table).join(format!("date={date}"));
        if let Storage::Remote { .. } = self {
            for f in self.list(table)?.into_iter().filter(|f| f.date == date) {
                let name = f.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                self.remove(&local, &name)?;
            }
        }
        match fs::remove_dir_all(&local) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(PersistError::Io { op: "remove partition", path: local, source: e }),
        }
        if let Some(parent) = local.parent() {
            fsutil::sync_dir(parent).map_err(|e| PersistError::Io {
                op: "sync directory",
                path: parent.into(),
                source: e,
            })?;
        }
        Ok(())
    }
}
