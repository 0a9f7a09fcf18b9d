//! Counter-based randomness: every random number is a pure function of its coordinates
//! (seed, GPU, time bucket, …), so any instant can be evaluated in any order, live or in
//! backfill, and gives the same answer.
//!
//! The mixer is SplitMix64's finaliser; it passes BigCrush as a counter-based generator
//! and costs a handful of multiplications, which matters at millions of evaluations per
//! second in backfill.

/// SplitMix64's output function.
#[inline]
pub(crate) const fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A hash of a seed and two coordinates.
#[inline]
pub(crate) const fn hash2(seed: u64, a: u64, b: u64) -> u64 {
    mix(mix(mix(seed) ^ a) ^ b)
}

/// A hash of a seed and three coordinates.
#[inline]
pub(crate) const fn hash3(seed: u64, a: u64, b: u64, c: u64) -> u64 {
    mix(hash2(seed, a, b) ^ c)
}

/// Uniform in `[-1, 1)` from 16-bit lane `lane` (0–3) of `h`: one hash feeds four
/// independent-enough noise terms.
#[inline]
pub(crate) fn lane(h: u64, lane: u32) -> f64 {
    let bits = (h >> (16 * (lane & 3))) & 0xFFFF;
    bits as f64 / 32_768.0 - 1.0
}

/// One element of `items`, chosen by `h`.
pub(crate) fn pick<T: Copy>(h: u64, items: &[T]) -> Option<T> {
    if items.is_empty() {
        return None;
    }
    items.get((h % items.len() as u64) as usize).copied()
}

/// Lower-case hex of `n` 64-bit words derived from `h`.
pub(crate) fn hex(h: u64, words: usize) -> String {
    let mut s = String::with_capacity(words * 16);
    for i in 0..words {
        s.push_str(&format!("{:016x}", mix(h ^ i as u64)));
    }
    s
}

/// A UUID-shaped string (`8-4-4-4-12` lower-case hex) derived from `h`.
pub(crate) fn uuid(h: u64) -> String {
    let (a, b) = (mix(h), mix(h ^ 0x5555));
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xFFFF,
        // Version 4, variant 10xx, as Kubernetes' pod UIDs are.
        0x4000 | (a & 0x0FFF),
        0x8000 | ((b >> 48) & 0x3FFF),
        b & 0xFFFF_FFFF_FFFF
    )
}

/// Kubernetes' random suffix alphabet (no vowels, no look-alikes), `n` characters.
pub(crate) fn k8s_suffix(h: u64, n: usize) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut h = mix(h);
    (0..n)
        .map(|_| {
            let c = ALPHABET[(h % ALPHABET.len() as u64) as usize];
            h /= ALPHABET.len() as u64;
            char::from(c)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_shapes() {
        for i in 0..1000u64 {
            let h = hash2(42, i, 7);
            for l in 0..4 {
                assert!((-1.0..1.0).contains(&lane(h, l)));
            }
        }
        let u = uuid(1);
        assert_eq!(u.len(), 36);
        assert_eq!(u.as_bytes()[14], b'4');
        assert_eq!(hex(3, 4).len(), 64);
        assert_eq!(k8s_suffix(9, 5).len(), 5);
        assert_ne!(hash2(1, 2, 3), hash2(1, 3, 2));
        assert_eq!(pick::<u8>(5, &[]), None);
    }
}
