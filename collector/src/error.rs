//! The store's errors, classified for the HTTP layer without depending on it.

use std::path::PathBuf;

use apron_common::wire::WireError;

use crate::checkpoint::CheckpointError;
use crate::ipc_guard::FramingError;
use crate::persist::PersistError;
use crate::schema::ConvertError;
use crate::wal::WalError;

/// Why an ingest request was refused. Nothing of a refused request is stored.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// The request itself is unusable (bad agent id, …). HTTP 400.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The body is not an Arrow IPC stream. HTTP 400.
    #[error("malformed body: {0}")]
    Malformed(String),
    /// The stream's schema is not the table's. HTTP 422.
    #[error("wrong schema: {0}")]
    WrongSchema(String),
    /// A value cannot be stored exactly at the column's resolution. HTTP 422.
    #[error("unrepresentable value: {0}")]
    Unrepresentable(#[from] ConvertError),
    /// HTTP 413.
    #[error("too many rows: {rows} in one request; at most {max} are accepted")]
    TooManyRows { rows: usize, max: usize },
    /// The batch would decode to more bytes than allowed. HTTP 413.
    #[error("too large: the batch would decode to {bytes} bytes; at most {max} are accepted")]
    TooLarge { bytes: u64, max: u64 },
    /// Another copy of this (agent, epoch, sequence) is being written now; the client
    /// should retry (the answer then is "duplicate" or a fresh attempt). HTTP 503.
    #[error("a copy of this batch is being stored right now; retry")]
    InFlight,
    /// Rows not yet persisted would pass `memtable_max_bytes`; the client should retry
    /// after a persist has freed room. HTTP 503 with `Retry-After`.
    #[error(
        "the server holds {held} bytes of rows not yet persisted and this batch adds {incoming}; \
         over the budget of {budget} bytes ([storage] memtable_max_bytes); retry shortly"
    )]
    Backpressure { held: u64, incoming: u64, budget: u64 },
    /// The disk is full: the WAL append failed, nothing was acknowledged. HTTP 507.
    #[error("storage full: {0}")]
    StorageFull(WalError),
    /// The WAL append failed for another reason (I/O error). HTTP 503.
    #[error("storage unavailable: {0}")]
    Storage(WalError),
}

impl IngestError {
    /// The HTTP status this error maps to.
    pub fn status(&self) -> u16 {
        match self {
            IngestError::BadRequest(_) | IngestError::Malformed(_) => 400,
            IngestError::TooManyRows { .. } | IngestError::TooLarge { .. } => 413,
            IngestError::WrongSchema(_) | IngestError::Unrepresentable(_) => 422,
            IngestError::InFlight | IngestError::Backpressure { .. } | IngestError::Storage(_) => 503,
            IngestError::StorageFull(_) => 507,
        }
    }

    /// A short machine-readable code for the JSON `error` field.
    pub fn code(&self) -> &'static str {
        match self {
            IngestError::BadRequest(_) => "bad_request",
            IngestError::Malformed(_) => "malformed_body",
            IngestError::WrongSchema(_) => "wrong_schema",
            IngestError::Unrepresentable(_) => "unrepresentable_value",
            IngestError::TooManyRows { .. } => "too_many_rows",
            IngestError::TooLarge { .. } => "too_large",
            IngestError::InFlight => "in_flight",
            IngestError::Backpressure { .. } => "memtable_full",
            IngestError::StorageFull(_) => "storage_full",
            IngestError::Storage(_) => "storage_unavailable",
        }
    }

    /// True when retrying the same request later may succeed (5xx).
    pub fn is_retryable(&self) -> bool {
        self.status() >= 500
    }

    pub(crate) fn from_wire(e: WireError) -> IngestError {
        match e {
            WireError::Malformed(e) => IngestError::Malformed(e.to_string()),
            WireError::Schema { .. } => IngestError::WrongSchema(e.to_string()),
            WireError::TooManyRows { rows, max } => IngestError::TooManyRows { rows, max },
            WireError::Encode(e) => IngestError::Malformed(e.to_string()),
        }
    }

    pub(crate) fn from_framing(e: FramingError) -> IngestError {
        match e {
            FramingError::Malformed(s) => IngestError::Malformed(s),
            FramingError::TooManyRows { rows, max } => {
                IngestError::TooManyRows { rows: usize::try_from(rows).unwrap_or(usize::MAX), max: max as usize }
            }
            FramingError::TooLarge { bytes, max } => IngestError::TooLarge { bytes, max },
            e @ (FramingError::NoFields | FramingError::UnsupportedColumn { .. }) => {
                IngestError::Malformed(e.to_string())
            }
        }
    }

    pub(crate) fn from_wal(e: WalError) -> IngestError {
        match e {
            WalError::TooLarge(_) | WalError::FieldTooLong(_) => IngestError::BadRequest(e.to_string()),
            e if e.is_storage_full() => IngestError::StorageFull(e),
            e => IngestError::Storage(e),
        }
    }
}

/// Errors opening or persisting the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("configuration: {0}")]
    Config(#[from] crate::config::StoreConfigError),
    #[error("data directory {0} is in use by another process")]
    Locked(PathBuf),
    #[error(transparent)]
    Wal(#[from] WalError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error(transparent)]
    Storage(#[from] crate::storage::StorageError),
    /// A WAL record passed its checksum but could not be applied (written by an
    /// incompatible build?). Start-up stops rather than drop acknowledged data.
    #[error("replaying the WAL: record {agent}/{epoch}/{sequence} for table {table:?}: {detail}")]
    Replay { table: String, agent: String, epoch: String, sequence: u64, detail: String },
    /// A derived table's partition could not be replaced with what was given.
    #[error("replacing {table} partition {date}: {detail}")]
    Derived { table: &'static str, date: String, detail: String },
}

impl StoreError {
    pub fn is_storage_full(&self) -> bool {
        match self {
            StoreError::Io { source, .. } => crate::wal::is_full(source),
            StoreError::Wal(e) => e.is_storage_full(),
            StoreError::Checkpoint(e) => e.is_storage_full(),
            StoreError::Persist(e) => e.is_storage_full(),
            _ => false,
        }
    }
}
