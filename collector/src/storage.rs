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
//! | publish a staged file | rename temp → final, fsync dir | PUT the temp file's bytes to `<prefix>/<table>/date=D/<uuid>.parquet` (`date=D/shard=S/` for a collector of a cluster) (atomic: the object appears whole or not at all) — a multipart upload of `part_bytes` parts read from disk one at a time when larger — then delete the temp file |
//! | list | `read_dir` of the partitions | LIST `<prefix>/<table>/`, keeping this store's own layout: its shard's files (`<table>/date=D/shard=S/…`, `[cluster] shard`) or, unsharded, the files of no shard |
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

use apron_common::ShardName;
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
    /// The shard this store publishes under (`[cluster] shard`, set by the server, not
    /// a key of this table): files go to `<table>/date=D/shard=S/<name>` and only the
    /// shard's own files are listed, compacted and deleted. `None`: the unsharded layout
    /// `<table>/date=D/<name>`, which never lists a shard's files either.
    #[serde(skip)]
    pub shard: Option<ShardName>,
}

/// Keys read from outside the file (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, which
/// the binaries read), so that a ConfigMap or a unit's config holds no secret.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
}

impl ObjectStoreConfig {
    /// Fills the keys the file leaves out from `c`: the file's win.
    pub fn fill_credentials(&mut self, c: &Credentials) {
        if self.access_key_id.is_none() {
            self.access_key_id.clone_from(&c.access_key_id);
        }
        if self.secret_access_key.is_none() {
            self.secret_access_key.clone_from(&c.secret_access_key);
        }
    }
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
            shard: None,
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
    shard: Option<ShardName>,
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
            shard: config.shard.clone(),
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

    /// The object key of a path relative to the data directory: the same components
    /// under the prefix, with `shard=S` after the `date=` partition of a table file
    /// (`<table>/date=D/<name>`) when the store has a shard.
    fn key(&self, relative: &Path) -> ObjectPath {
        object_key(&self.prefix, self.shard.as_ref(), relative)
    }

    /// The key of `relative` (`/`-separated) under the prefix, as is.
    fn plain_key(&self, relative: &str) -> ObjectPath {
        relative.split('/').filter(|p| !p.is_empty()).fold(self.prefix.clone(), |k, p| k.join(p))
    }

    /// The URL of the bucket (`s3://bucket`) and the store, for readers.
    pub fn store(&self) -> (String, Arc<dyn ObjectStore>) {
        (self.url.clone(), self.store.clone())
    }

    /// PUTs a small object (a shard's status) at `relative` under the prefix.
    pub fn put_small(&self, relative: &str, bytes: Vec<u8>) -> Result<(), StorageError> {
        let key = self.plain_key(relative);
        let store = self.store.clone();
        Ok(self.wait(async move { store.put(&key, PutPayload::from(bytes)).await.map(|_| ()) })?)
    }

    /// The bytes of the small object at `relative` under the prefix; `None` when there
    /// is none.
    pub fn get_small(&self, relative: &str) -> Result<Option<Vec<u8>>, StorageError> {
        let key = self.plain_key(relative);
        let store = self.store.clone();
        Ok(self.wait(async move {
            match store.get(&key).await {
                Ok(r) => Ok(Some(r.bytes().await?.to_vec())),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })?)
    }

    /// The objects directly or deeper under `relative` with their bytes, for small
    /// objects only (shard statuses): `(key relative to the prefix, bytes)`.
    pub fn get_all_small(&self, relative: &str) -> Result<Vec<(String, Vec<u8>)>, StorageError> {
        let dir = self.plain_key(relative);
        let prefix_parts = self.prefix.parts().count();
        let store = self.store.clone();
        Ok(self.wait(async move {
            let listed: Vec<object_store::ObjectMeta> = store.list(Some(&dir)).try_collect().await?;
            let mut out = Vec::new();
            for m in listed {
                let bytes = match store.get(&m.location).await {
                    Ok(r) => r.bytes().await?,
                    // Replaced between the LIST and the GET.
                    Err(object_store::Error::NotFound { .. }) => continue,
                    Err(e) => return Err(e),
                };
                let rel: Vec<String> = m.location.parts().skip(prefix_parts).map(|p| p.as_ref().to_owned()).collect();
                out.push((rel.join("/"), bytes.to_vec()));
            }
            Ok(out)
        })?)
    }
}

/// The object key of `relative` (a path relative to the data directory) under
/// `prefix`: the same components, with `shard=S` after the `date=` partition of a table
/// file (`<table>/date=D/<name>`) when there is a shard.
fn object_key(prefix: &ObjectPath, shard: Option<&ShardName>, relative: &Path) -> ObjectPath {
    let parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let mut key = prefix.clone();
    for (i, part) in parts.iter().enumerate() {
        key = key.join(part.as_str());
        if i == 1
            && parts.len() == 3
            && part.starts_with("date=")
            && let Some(shard) = shard
        {
            key = key.join(format!("{SHARD_PREFIX}{shard}"));
        }
    }
    key
}

/// `shard=` of the Hive partition that names a file's shard.
pub const SHARD_PREFIX: &str = "shard=";

/// One published file of the lake, as [`Storage::list`] reads a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LakeFile {
    pub table: Table,
    /// `YYYY-MM-DD` of its `date=` partition.
    pub date: String,
    /// Its shard; `None` for the unsharded layout.
    pub shard: Option<String>,
    /// The object key (relative to the bucket).
    pub key: String,
    pub bytes: u64,
}

impl LakeFile {
    /// `…/<table>/date=D[/shard=S]/<name>.parquet`; anything else (hidden files, other
    /// depths) is not a table file.
    fn parse(table: Table, meta: object_store::ObjectMeta) -> Option<LakeFile> {
        let owned: Vec<String> = meta.location.parts().map(|p| p.as_ref().to_owned()).collect();
        let parts: Vec<&str> = owned.iter().map(String::as_str).collect();
        let n = parts.len();
        let name = *parts.last()?;
        if name.starts_with('.') || !name.ends_with(".parquet") {
            return None;
        }
        let (date_part, shard) = match parts.get(n.checked_sub(2)?)?.strip_prefix(SHARD_PREFIX) {
            Some(s) => (*parts.get(n.checked_sub(3)?)?, Some(s.to_owned())),
            None => (parts[n - 2], None),
        };
        let date = date_part.strip_prefix("date=")?;
        let table_at = if shard.is_some() { n.checked_sub(4)? } else { n.checked_sub(3)? };
        if parts.get(table_at) != Some(&table.name()) {
            return None;
        }
        Some(LakeFile { table, date: date.to_owned(), shard, key: meta.location.as_ref().to_owned(), bytes: meta.size })
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

    /// The bucket, when files live in one (the lake's reads and the shard status).
    pub fn remote(&self) -> Option<&Remote> {
        match self {
            Storage::Local { .. } => None,
            Storage::Remote { remote, .. } => Some(remote),
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
            // Only this store's own layout: its shard's files, or (unsharded) the files
            // of no shard.
            let Some(f) = LakeFile::parse(table, meta) else { continue };
            if f.shard.as_deref() != remote.shard.as_ref().map(ShardName::as_str) {
                continue;
            }
            let name = f.key.rsplit('/').next().unwrap_or_default();
            let local_dir = crate::persist::table_dir(data_dir, table).join(format!("date={}", f.date));
            let superseded = crate::compact::read_journal(&local_dir)?.map(|j| j.inputs).unwrap_or_default();
            if superseded.iter().any(|s| s == name) {
                continue;
            }
            out.push(PersistedFile { table, date: f.date, path: PathBuf::from(&f.key), bytes: f.bytes });
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

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(key: &str) -> object_store::ObjectMeta {
        object_store::ObjectMeta {
            location: ObjectPath::from(key),
            last_modified: Default::default(),
            size: 7,
            e_tag: None,
            version: None,
        }
    }

    #[test]
    fn a_shard_is_a_hive_partition_after_the_date() {
        let prefix = ObjectPath::from("lake/cluster-a");
        let shard = ShardName::new("rack-a").expect("shard");
        let file = Path::new("gpu_samples/date=2026-12-01/0193.parquet");
        assert_eq!(
            object_key(&prefix, Some(&shard), file).as_ref(),
            "lake/cluster-a/gpu_samples/date=2026-12-01/shard=rack-a/0193.parquet"
        );
        assert_eq!(object_key(&prefix, None, file).as_ref(), "lake/cluster-a/gpu_samples/date=2026-12-01/0193.parquet");
        // Table prefixes (listing) and other paths are not table files: no shard.
        assert_eq!(object_key(&prefix, Some(&shard), Path::new("gpu_samples")).as_ref(), "lake/cluster-a/gpu_samples");
    }

    #[test]
    fn lake_listing_reads_both_layouts_and_nothing_else() {
        let t = Table::GpuSamples;
        let f = LakeFile::parse(t, meta("p/gpu_samples/date=2026-12-01/shard=rack-b/x.parquet")).expect("sharded");
        assert_eq!((f.date.as_str(), f.shard.as_deref(), f.bytes), ("2026-12-01", Some("rack-b"), 7));
        let f = LakeFile::parse(t, meta("gpu_samples/date=2026-12-01/y.parquet")).expect("unsharded");
        assert_eq!(f.shard, None);
        for not_a_file in [
            "gpu_samples/date=2026-12-01/shard=a/.x.parquet.tmp",
            "gpu_samples/date=2026-12-01/shard=a/x.json",
            "gpu_processes/date=2026-12-01/shard=a/x.parquet",
            "gpu_samples/x.parquet",
            "gpu_samples/date=2026-12-01/deeper/shard=a/x.parquet",
        ] {
            assert_eq!(LakeFile::parse(t, meta(not_a_file)), None, "{not_a_file}");
        }
    }
}
