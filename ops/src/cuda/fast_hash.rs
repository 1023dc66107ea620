//! A fast hasher for the tail's own integer keys: buffer identities in `flush_cache.rs`'s
//! sets and the flush keys of `tail_graph.rs` (a few thousand addresses and sizes,
//! hashed once per flush). These keys are made by the backend, never by a user, so
//! SipHash's resistance to chosen collisions buys nothing and costs most of a
//! flush's planning time; this is a multiply-and-rotate over 8-byte words (the scheme
//! of rustc's FxHasher, written here).

use std::hash::{BuildHasherDefault, Hasher};

/// A 64-bit multiply-rotate hasher over 8-byte words.
#[derive(Default, Clone, Copy)]
pub(super) struct WordHasher(u64);

/// An odd constant with well-spread bits (2^64 / φ).
const K: u64 = 0x9e37_79b9_7f4a_7c15;

impl WordHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            self.add(u64::from_le_bytes(b));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(b) ^ ((rest.len() as u64) << 56));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The hasher's builder, for `HashMap` and `HashSet`.
pub(super) type WordHash = BuildHasherDefault<WordHasher>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};
    use std::hash::{BuildHasher, Hash};

    fn hash<T: Hash + ?Sized>(t: &T) -> u64 {
        WordHash::default().hash_one(t)
    }

    #[test]
    fn keys_that_differ_anywhere_hash_apart_and_equal_keys_alike() {
        let key: Vec<u64> = (0..2000).map(|i| 0x7f00_0000_0000 + i * 4096).collect();
        assert_eq!(hash(&key), hash(&key.clone()));
        for at in [0, 1, 999, 1999] {
            let mut other = key.clone();
            other[at] += 256;
            assert_ne!(hash(&key), hash(&other), "a change at {at}");
        }
        assert_ne!(hash(&key), hash(&key[..1999].to_vec()), "a shorter key");
        // Tails of odd length are hashed too.
        assert_ne!(hash(&[1u8, 2, 3][..]), hash(&[1u8, 2, 4][..]));
    }

    #[test]
    fn maps_and_sets_work_with_it() {
        let mut m: HashMap<Vec<u64>, u32, WordHash> = HashMap::default();
        m.insert(vec![1, 2, 3], 7);
        assert_eq!(m.get(&vec![1, 2, 3]), Some(&7));
        assert_eq!(m.get(&vec![1, 2]), None);
        let s: HashSet<usize, WordHash> = (0..1000).map(|i| i * 8).collect();
        assert!(s.contains(&800) && !s.contains(&801));
    }
}
