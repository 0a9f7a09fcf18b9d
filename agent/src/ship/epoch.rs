//! The epoch: a fresh id at every agent process start.
//!
//! The collector drops retried duplicates on (agent, epoch, sequence) and the sequence
//! restarts at 1 with each process, so the epoch must never repeat. It is a UUIDv7
//! string (RFC 9562): 48 bits of Unix milliseconds, then 74 random bits. The leading
//! time also makes epochs sort by creation, which keeps a spool that holds batches of
//! several runs in send order.

use std::hash::{BuildHasher as _, Hasher as _};
use std::io::Read as _;

/// 16 random bytes from the kernel; where `/dev/urandom` cannot be read (a sandbox
/// without it), std's per-process randomly keyed hasher mixed with time and PID, which
/// is still unique per process start.
pub fn random_bytes() -> [u8; 16] {
    let mut out = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut out)).is_ok() {
        return out;
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(now);
        h.write_u32(std::process::id());
        h.write_usize(i);
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

pub fn random_u64() -> u64 {
    let b = random_bytes();
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// A UUIDv7 for `unix_ms` with the given random bits.
pub fn uuid_v7(unix_ms: u64, random: [u8; 16]) -> String {
    let mut b = random;
    let ms = unix_ms.to_be_bytes();
    b[..6].copy_from_slice(&ms[2..]);
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// A new epoch for this process.
pub fn new_epoch() -> String {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    uuid_v7(u64::try_from(ms).unwrap_or(u64::MAX), random_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_v7_layout_and_order() {
        let a = uuid_v7(0x0190_a1b2_c3d4, [0xff; 16]);
        assert_eq!(a, "0190a1b2-c3d4-7fff-bfff-ffffffffffff");
        let b = uuid_v7(0x0190_a1b2_c3d5, [0; 16]);
        assert!(a < b, "later epochs sort after earlier ones");
        assert_ne!(new_epoch(), new_epoch());
        assert_eq!(new_epoch().len(), 36);
    }
}
