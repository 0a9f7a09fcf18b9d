//! A cheap walk over an Arrow IPC stream's framing before it is decoded.
//!
//! Arrow's `StreamReader` trusts the lengths a stream declares: a 20-byte body whose
//! first word reads as a 1.7 GB metadata length makes it allocate and zero 1.7 GB (≈10 s
//! in a debug build), and a zstd buffer may declare any decompressed size, which it
//! reserves up front (an absurd one aborts the process). An ingest endpoint cannot let
//! a client choose its allocations, so every message is checked first, without
//! decompressing anything: metadata and body lengths must lie inside the request, the
//! declared row count within the limit, and the declared decoded size within a budget.
//!
//! Arrow's schema conversion also panics on some malformed type descriptions (a `NONE`
//! type, a type whose parameters are missing, an unknown width or unit, a list without
//! its child): a schema message may only declare flat columns of the types the wire
//! schemas use (found by fuzzing, `docs/fuzzing.md`); anything else is refused here,
//! and a well-formed schema of the wrong shape still gets the decoder's schema error.

use arrow_ipc::{MessageHeader, Precision, TimeUnit, Type, root_as_message};

const CONTINUATION: u32 = 0xFFFF_FFFF;
/// A compressed buffer's prefix: the decompressed length, or -1 when stored raw.
const UNCOMPRESSED: i64 = -1;

/// Why a stream's framing was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    #[error("{0}")]
    Malformed(String),
    #[error("the stream declares {rows} rows; at most {max} are accepted per request")]
    TooManyRows { rows: u64, max: u64 },
    #[error("the stream would decode to {bytes} bytes; at most {max} are accepted per request")]
    TooLarge { bytes: u64, max: u64 },
    #[error("the schema message has no field list")]
    NoFields,
    #[error("column {index} ({name:?}) declares a type no wire schema uses ({kind})")]
    UnsupportedColumn { index: usize, name: String, kind: String },
}

/// Checks every message of the IPC stream `body` (see the module docs).
pub fn check(body: &[u8], max_rows: u64, max_decoded_bytes: u64) -> Result<(), FramingError> {
    let bad = |s: String| FramingError::Malformed(s);
    let mut at = 0usize;
    let mut rows = 0u64;
    let mut decoded = 0u64;
    loop {
        let Some(mut len) = read_u32(body, at) else {
            // A stream may end without the end-of-stream marker.
            return if at == body.len() { Ok(()) } else { Err(bad(format!("truncated message header at byte {at}"))) };
        };
        at += 4;
        if len == CONTINUATION {
            len = read_u32(body, at).ok_or_else(|| bad(format!("truncated message header at byte {at}")))?;
            at += 4;
        }
        if len == 0 {
            return Ok(());
        }
        let len = len as usize;
        let meta = body
            .get(at..at + len)
            .ok_or_else(|| bad(format!("message metadata of {len} bytes at byte {at} runs past the body")))?;
        let message = root_as_message(meta).map_err(|e| bad(format!("invalid message metadata: {e}")))?;
        at += len;
        let body_len = usize::try_from(message.bodyLength())
            .ok()
            .filter(|n| at.checked_add(*n).is_some_and(|end| end <= body.len()))
            .ok_or_else(|| bad(format!("message body of {} bytes runs past the request", message.bodyLength())))?;
        let data = &body[at..at + body_len];
        at += body_len;

        if let Some(schema) = message.header_as_schema() {
            check_schema(schema)?;
        }
        let batch = match message.header_type() {
            MessageHeader::RecordBatch => message.header_as_record_batch(),
            MessageHeader::DictionaryBatch => message.header_as_dictionary_batch().and_then(|d| d.data()),
            _ => None,
        };
        let Some(batch) = batch else { continue };
        if message.header_type() == MessageHeader::RecordBatch {
            rows = rows.saturating_add(u64::try_from(batch.length()).map_err(|_| bad("negative row count".into()))?);
            if rows > max_rows {
                return Err(FramingError::TooManyRows { rows, max: max_rows });
            }
        }
        let compressed = batch.compression().is_some();
        for b in batch.buffers().into_iter().flatten() {
            let (offset, length) = (b.offset(), b.length());
            let start = usize::try_from(offset).ok();
            let end = start.zip(usize::try_from(length).ok()).and_then(|(s, l)| s.checked_add(l));
            let Some((start, end)) = start.zip(end).filter(|(_, e)| *e <= data.len()) else {
                return Err(bad(format!("buffer at {offset}+{length} lies outside its message body")));
            };
            let size = if compressed && end - start >= 8 {
                let declared = i64::from_le_bytes(data[start..start + 8].try_into().unwrap_or([0; 8]));
                if declared == UNCOMPRESSED {
                    (end - start - 8) as u64
                } else {
                    u64::try_from(declared).unwrap_or(u64::MAX)
                }
            } else {
                (end - start) as u64
            };
            decoded = decoded.saturating_add(size);
            if decoded > max_decoded_bytes {
                return Err(FramingError::TooLarge { bytes: decoded, max: max_decoded_bytes });
            }
        }
    }
}

/// Only flat columns of the types the wire schemas are made of (Utf8, Boolean, signed
/// or unsigned integers, floats, timestamps), with their parameters present and valid.
fn check_schema(schema: arrow_ipc::Schema<'_>) -> Result<(), FramingError> {
    let fields = schema.fields().ok_or(FramingError::NoFields)?;
    for (i, f) in fields.iter().enumerate() {
        let supported = f.dictionary().is_none()
            && f.children().is_none_or(|c| c.is_empty())
            && match f.type_type() {
                Type::Utf8 => f.type_as_utf_8().is_some(),
                Type::Bool => f.type_as_bool().is_some(),
                Type::Int => f.type_as_int().is_some_and(|t| matches!(t.bitWidth(), 8 | 16 | 32 | 64)),
                Type::FloatingPoint => f
                    .type_as_floating_point()
                    .is_some_and(|t| matches!(t.precision(), Precision::HALF | Precision::SINGLE | Precision::DOUBLE)),
                Type::Timestamp => f.type_as_timestamp().is_some_and(|t| {
                    matches!(
                        t.unit(),
                        TimeUnit::SECOND | TimeUnit::MILLISECOND | TimeUnit::MICROSECOND | TimeUnit::NANOSECOND
                    )
                }),
                _ => false,
            };
        if !supported {
            return Err(FramingError::UnsupportedColumn {
                index: i,
                name: f.name().unwrap_or_default().to_owned(),
                kind: format!("{:?}", f.type_type()),
            });
        }
    }
    Ok(())
}

fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    let bytes = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

#[cfg(test)]
mod tests {
    use apron_common::wire::encode_ipc;

    use super::*;
    use crate::testdata;

    #[test]
    fn accepts_real_streams_and_counts_rows() {
        let body = encode_ipc(&testdata::samples(4, testdata::MIDNIGHT, 5)).expect("ipc");
        assert_eq!(check(&body, 20, 1 << 30), Ok(()));
        assert_eq!(check(&body, 19, 1 << 30), Err(FramingError::TooManyRows { rows: 20, max: 19 }));
        assert!(matches!(check(&body, 20, 100), Err(FramingError::TooLarge { .. })));
        assert_eq!(check(&body[..body.len() - 8], 20, 1 << 30), Ok(()), "without the end marker");
    }

    #[test]
    fn refuses_lying_lengths_without_allocating() {
        let start = std::time::Instant::now();
        assert!(matches!(check(b"definitely not arrow", 10, 1 << 30), Err(FramingError::Malformed(_))));
        let mut huge = vec![0xff, 0xff, 0xff, 0xff];
        huge.extend_from_slice(&0x7fff_fff0u32.to_le_bytes());
        huge.extend_from_slice(&[0; 16]);
        assert!(matches!(check(&huge, 10, 1 << 30), Err(FramingError::Malformed(_))));
        assert!(start.elapsed() < std::time::Duration::from_secs(1));

        // A compressed buffer declaring 2^62 decompressed bytes.
        let body = encode_ipc(&testdata::samples(1, testdata::MIDNIGHT, 1)).expect("ipc");
        let mut bomb = body.clone();
        let patched = patch_first_compressed_length(&mut bomb, 1 << 62);
        assert!(patched, "the test stream has a compressed buffer");
        assert!(matches!(check(&bomb, 10, 1 << 30), Err(FramingError::TooLarge { .. })));
        for cut in [1, 7, 9, body.len() / 2] {
            assert!(check(&body[..body.len() - 8 - cut], 10, 1 << 30).is_err(), "cut {cut}");
        }
    }

    #[test]
    fn refuses_schemas_arrow_cannot_convert() {
        // Found by fuzzing (docs/fuzzing.md): a column of type NONE made Arrow's schema
        // conversion panic. The guard refuses it before the reader sees it.
        let body = include_bytes!("../../fuzz/regressions/ingest_decode/arrow-schema-type-none.arrows");
        let err = check(body, 100_000, 1 << 30).expect_err("NONE type");
        assert!(matches!(&err, FramingError::UnsupportedColumn { kind, .. } if kind.contains("NONE")), "{err}");
        let good = encode_ipc(&testdata::samples(1, testdata::MIDNIGHT, 1)).expect("ipc");
        assert_eq!(check(&good, 10, 1 << 30), Ok(()), "the wire schema passes");
    }

    /// Overwrites the decompressed-length prefix of the first non-empty buffer of the
    /// first record batch in `body`.
    fn patch_first_compressed_length(body: &mut [u8], value: i64) -> bool {
        let mut at = 0;
        while let Some(mut len) = read_u32(body, at) {
            at += 4;
            if len == CONTINUATION {
                len = read_u32(body, at).unwrap_or(0);
                at += 4;
            }
            if len == 0 {
                return false;
            }
            let meta_end = at + len as usize;
            let (offset, body_len) = {
                let m = root_as_message(&body[at..meta_end]).expect("message");
                let target = m.header_as_record_batch().and_then(|rb| {
                    rb.buffers().into_iter().flatten().find(|b| b.length() >= 8).map(|b| b.offset() as usize)
                });
                (target, m.bodyLength() as usize)
            };
            if let Some(off) = offset {
                body[meta_end + off..meta_end + off + 8].copy_from_slice(&value.to_le_bytes());
                return true;
            }
            at = meta_end + body_len;
        }
        false
    }
}
