//! A stream's flush planned once per shape and patched each step.
//!
//! A trainer's step holds the same kernels over the same shapes on the same stream every
//! step; what changes is which buffers hold its gradients and its norm (a pool hands them
//! out in any order) and its scalars (the learning rate, AdamW's step). Planning a flush
//! (`flush.rs`) walks every held kernel; here it is done once per *shape* of flush, with
//! stand-in addresses, and each later flush of that shape only writes its buffers'
//! addresses and its scalars into the planned words.
//!
//! The shape ([`Shape::key`]) is everything planning reads but buffer addresses and the
//! scalars' values: each held kernel's kind, lengths, matrix shape and Newton–Schulz
//! precision and steps, the group it falls in (the same rule as `flush.rs`'s grouping:
//! equal settings, step, guard and fused clip), whether it applies the clip; the norm's
//! and the clip's buffers and lengths and the threshold; and which of all these buffers
//! are one buffer (each buffer is numbered where it is first named). Planned with buffer
//! `t` at the stand-in address `SYMBOL + (t << SHIFT)`, every word that names an address
//! is one buffer's stand-in plus an offset (`FlushPlan::with_addresses`), and no other
//! word reaches `SYMBOL` outside the scalar blocks: the relocations are those words.
//!
//! Invariant: a cached plan is used only for a flush of the same key, and only once the
//! plan it gives with the real addresses was found equal, word for word and launch for
//! launch, to the one planned directly from them (checked each time a shape is planned).

use std::collections::HashMap;

use super::defer::{Entry, Held, HeldClip, HeldNorm};
use super::fast_hash::WordHash;
use super::flush::FlushPlan;
use super::memory::CudaBuffer;
use crate::OpsError;

/// Where the stand-in addresses start: no scalar table word, count or length reaches it.
const SYMBOL: u64 = 1 << 63;
/// Stand-in addresses are `1 << SHIFT` bytes apart: room for any offset into a buffer.
const SHIFT: u32 = 40;

/// A flush's shape and its buffers' real addresses, numbered in the order the key names
/// them. Kept by the stream's cache and refilled each flush, so that a steady step
/// allocates nothing and grows no table here.
#[derive(Default)]
struct Shape {
    key: Vec<u64>,
    /// Per buffer number: its device address.
    ptrs: Vec<u64>,
    /// Buffer identity ([`CudaBuffer::id`]) to number.
    ids: HashMap<usize, u32, WordHash>,
}

impl Shape {
    /// Refills `s` with the shape of the flush of `held` behind `norm` and `clip`.
    fn fill(s: &mut Shape, (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>), held: &[Entry]) {
        s.key.clear();
        s.ptrs.clear();
        s.ids.clear();
        match norm {
            Some(n) => {
                let dst = s.number(&n.dst);
                s.key.extend([1, dst, n.srcs.len() as u64]);
                for b in n.srcs.iter() {
                    let t = s.number(b);
                    s.key.extend([t, b.len as u64]);
                }
            }
            None => s.key.push(0),
        }
        match clip {
            Some(c) => {
                let norm = s.number(&c.norm);
                s.key.extend([1, norm, u64::from(c.max_norm.to_bits())]);
                s.key.push(c.bufs.len() as u64);
                for b in c.bufs.iter() {
                    let t = s.number(b);
                    s.key.extend([t, b.len as u64]);
                }
            }
            None => s.key.push(0),
        }
        let mut adamw = Vec::new();
        let mut muon = Vec::new();
        for (_, h, guard, clipped) in held {
            let g = guard.as_ref().map_or(u64::MAX, |b| s.number(b));
            let clipped = u64::from(*clipped);
            match h {
                Held::Adamw {
                    param,
                    grad,
                    state,
                    hp,
                    step,
                } => {
                    let group = group_of(&mut adamw, (*hp, *step, g, clipped));
                    let (p, gr, st) = (s.number(param), s.number(grad), s.number(state));
                    s.key
                        .extend([2, p, param.len as u64, gr, st, g, clipped, group]);
                }
                Held::Muon {
                    param,
                    grad,
                    momentum,
                    rows,
                    cols,
                    hp,
                } => {
                    let shape = (*rows as u64, *cols as u64);
                    let group = group_of(&mut muon, (shape, *hp, g, clipped));
                    let (p, gr, m) = (s.number(param), s.number(grad), s.number(momentum));
                    s.key
                        .extend([3, p, shape.0, shape.1, gr, m, g, clipped, group]);
                    s.key.extend([u64::from(hp.ns_steps), hp.ns_dtype as u64]);
                }
            }
        }
    }

    /// Buffer `b`'s number, given where it is first named.
    fn number(&mut self, b: &CudaBuffer) -> u64 {
        let next = self.ptrs.len() as u32;
        let n = *self.ids.entry(b.id()).or_insert(next);
        if n == next {
            self.ptrs.push(b.ptr());
        }
        u64::from(n)
    }

    /// Buffer `b`'s stand-in address (`None` for a buffer the key does not name).
    fn symbol(&self, b: &CudaBuffer) -> Option<u64> {
        self.ids
            .get(&b.id())
            .map(|&n| SYMBOL + (u64::from(n) << SHIFT))
    }
}

/// The index of `key` among `keys` (appended when new): `flush.rs`'s groups.
fn group_of<K: PartialEq>(keys: &mut Vec<K>, key: K) -> u64 {
    match keys.iter().position(|k| *k == key) {
        Some(i) => i as u64,
        None => {
            keys.push(key);
            keys.len() as u64 - 1
        }
    }
}

/// A word of a plan that names an address: its index, the buffer number, the offset.
pub(super) type Reloc = (usize, u32, u64);

/// The words of `words` at or above [`SYMBOL`] outside `skip` (the scalar blocks, as
/// `(start, len)`): each a buffer's stand-in address plus an offset.
fn relocations(words: &[u64], skip: &[(usize, usize)]) -> Vec<Reloc> {
    let mut scalar = vec![false; words.len()];
    for &(at, len) in skip {
        scalar[at..at + len].fill(true);
    }
    words
        .iter()
        .enumerate()
        .filter(|&(i, &w)| !scalar[i] && w >= SYMBOL)
        .map(|(i, &w)| {
            let rel = w - SYMBOL;
            (i, (rel >> SHIFT) as u32, rel & ((1 << SHIFT) - 1))
        })
        .collect()
}

/// The scalar blocks of `plan`'s words: `(start, len)`.
fn scalar_blocks(plan: &FlushPlan, held: &[Entry]) -> Vec<(usize, usize)> {
    plan.scalars
        .iter()
        .map(|&(at, e)| match held[e].1 {
            Held::Adamw { .. } => (at, 7),
            Held::Muon { .. } => (at, 3),
        })
        .collect()
}

/// A planned shape: its key, the plan (its words hold the last flush's addresses and
/// scalars) and where the addresses go.
struct Cached {
    key: Vec<u64>,
    plan: FlushPlan,
    relocs: Vec<Reloc>,
}

/// One stream's planned flush (module docs).
#[derive(Default)]
pub(super) struct FlushCache {
    /// The shape of the flush being issued.
    shape: Shape,
    cached: Option<Cached>,
    /// A flush whose shape could not be cached, planned directly.
    direct: Option<FlushPlan>,
    /// Flushes that reused a planned shape ([`super::CudaBackend::tail_plan_reuses`]).
    pub(super) reuses: u64,
}

impl std::fmt::Debug for FlushCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FlushCache(reuses: {})", self.reuses)
    }
}

impl FlushCache {
    /// The plan of the flush of `held` behind `norm` and `clip`, with this flush's
    /// addresses and scalars.
    pub(super) fn plan(
        &mut self,
        (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>),
        held: &[Entry],
    ) -> Result<&mut FlushPlan, OpsError> {
        Shape::fill(&mut self.shape, (norm, clip), held);
        let shape = &self.shape;
        let hit = self.cached.as_ref().is_some_and(|c| c.key == shape.key);
        if hit {
            self.reuses += 1;
        } else {
            self.cached = None;
            let direct = FlushPlan::with_addresses(&|b| b.ptr(), (norm, clip), held)?;
            match Self::learn(shape, (norm, clip), held, &direct)? {
                Some((plan, relocs)) => {
                    self.cached = Some(Cached {
                        key: shape.key.clone(),
                        plan,
                        relocs,
                    });
                }
                None => return Ok(self.direct.insert(direct)),
            }
        }
        let Some(c) = self.cached.as_mut() else {
            unreachable!("a shape was cached above");
        };
        c.plan.patch(&c.relocs, &shape.ptrs, held);
        Ok(&mut c.plan)
    }

    /// Plans `shape` with stand-in addresses; the plan and its relocations when, patched
    /// with the real addresses, it is `direct` word for word and launch for launch.
    fn learn(
        shape: &Shape,
        (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>),
        held: &[Entry],
        direct: &FlushPlan,
    ) -> Result<Option<(FlushPlan, Vec<Reloc>)>, OpsError> {
        let unknown = std::cell::Cell::new(false);
        let addr = |b: &CudaBuffer| {
            shape.symbol(b).unwrap_or_else(|| {
                unknown.set(true);
                0
            })
        };
        let mut plan = FlushPlan::with_addresses(&addr, (norm, clip), held)?;
        if unknown.get() {
            return Ok(None);
        }
        let relocs = relocations(plan.words(), &scalar_blocks(&plan, held));
        if relocs.iter().any(|r| r.1 as usize >= shape.ptrs.len()) {
            return Ok(None);
        }
        plan.patch(&relocs, &shape.ptrs, held);
        let same = plan.words() == direct.words() && plan.key(0) == direct.key(0);
        debug_assert!(same, "a flush planned with stand-in addresses differs");
        Ok(same.then_some((plan, relocs)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relocations_are_the_stand_in_words_outside_the_scalars() {
        let sym = |t: u64, off: u64| SYMBOL + (t << SHIFT) + off;
        // A scalar block at 1..3 whose second word has the top bit set (a negative f64).
        let words = [
            sym(0, 0),
            7,
            (-1.5f64).to_bits(),
            sym(2, 4 * 768),
            96,
            sym(1, 0),
        ];
        let relocs = relocations(&words, &[(1, 2)]);
        assert_eq!(relocs, vec![(0, 0, 0), (3, 2, 4 * 768), (5, 1, 0)]);
    }

    #[test]
    fn groups_are_numbered_where_first_seen() {
        let mut keys = Vec::new();
        let got: Vec<u64> = [5, 3, 5, 9, 3]
            .into_iter()
            .map(|k| group_of(&mut keys, k))
            .collect();
        assert_eq!(got, vec![0, 1, 0, 2, 1]);
    }
}
