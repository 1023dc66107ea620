//! Sets of contributions: which (micro-batch, source rank) gradients a buffer holds.
//!
//! The no_sync reference sums every rank's gradient of every micro-batch once. A buffer
//! on the gradient path holds some of those terms; the validator follows them as a set
//! of `(micro-batch, source rank)` pairs. The sets the planner produces are products of
//! micro-batch runs and rank groups (`{m0..m7} × shard group`), so a set is stored as
//! disjoint micro-batch ranges, each with a bit set of source ranks: a union, an
//! intersection or a difference costs the number of ranges times `world / 64` words,
//! whatever the number of micro-batches, which keeps validation linear in a step's size.

use std::fmt::Write as _;
use std::ops::Range;
use std::rc::Rc;

/// Words of a rank set kept inline: worlds of up to 256 ranks allocate nothing.
const INLINE_WORDS: usize = 4;

/// A set of source ranks, one bit per global rank.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ranks {
    /// Worlds of at most `64 · INLINE_WORDS` ranks.
    Inline([u64; INLINE_WORDS]),
    /// Larger worlds.
    Heap(Vec<u64>),
}

impl Ranks {
    fn empty(world: u32) -> Ranks {
        let words = (world as usize).div_ceil(64);
        if words <= INLINE_WORDS {
            Ranks::Inline([0; INLINE_WORDS])
        } else {
            Ranks::Heap(vec![0; words])
        }
    }

    fn words(&self) -> &[u64] {
        match self {
            Ranks::Inline(w) => w,
            Ranks::Heap(w) => w,
        }
    }

    fn words_mut(&mut self) -> &mut [u64] {
        match self {
            Ranks::Inline(w) => w,
            Ranks::Heap(w) => w,
        }
    }

    fn one(world: u32, rank: u32) -> Ranks {
        let mut r = Ranks::empty(world);
        r.words_mut()[(rank / 64) as usize] |= 1 << (rank % 64);
        r
    }

    fn all(world: u32) -> Ranks {
        let mut r = Ranks::empty(world);
        let w = r.words_mut();
        for g in 0..world {
            w[(g / 64) as usize] |= 1 << (g % 64);
        }
        r
    }

    fn is_empty(&self) -> bool {
        self.words().iter().all(|&w| w == 0)
    }

    fn zip(&self, other: &Ranks, f: impl Fn(u64, u64) -> u64) -> Ranks {
        match (self, other) {
            (Ranks::Inline(a), Ranks::Inline(b)) => {
                Ranks::Inline(std::array::from_fn(|i| f(a[i], b[i])))
            }
            _ => Ranks::Heap(
                self.words()
                    .iter()
                    .zip(other.words())
                    .map(|(&a, &b)| f(a, b))
                    .collect(),
            ),
        }
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words().iter().enumerate().flat_map(|(i, &w)| {
            (0..64u32)
                .filter(move |b| w & (1 << b) != 0)
                .map(move |b| i as u32 * 64 + b)
        })
    }

    /// `rank 1`, `ranks 0-3`, `ranks 0, 2`, `every rank`.
    fn describe(&self, world: u32) -> String {
        if *self == Ranks::all(world) {
            return "every rank".into();
        }
        let ranks: Vec<u32> = self.iter().collect();
        let mut runs: Vec<String> = Vec::new();
        let mut i = 0;
        while i < ranks.len() {
            let mut j = i;
            while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
                j += 1;
            }
            runs.push(if j > i + 1 {
                format!("{}-{}", ranks[i], ranks[j])
            } else if j == i + 1 {
                format!("{}, {}", ranks[i], ranks[j])
            } else {
                ranks[i].to_string()
            });
            i = j + 1;
        }
        let s = if ranks.len() == 1 { "" } else { "s" };
        format!("rank{s} {}", runs.join(", "))
    }
}

/// A set of `(micro-batch, source rank)` contributions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Contribs {
    world: u32,
    /// Disjoint, sorted by range, non-empty rank sets; adjacent ranges with equal rank
    /// sets are merged, so equal sets have equal representations. Shared: a buffer's
    /// value is copied far more often than changed.
    blocks: Rc<[(Range<u32>, Ranks)]>,
}

impl Contribs {
    /// No contribution.
    pub(super) fn empty(world: u32) -> Contribs {
        Contribs {
            world,
            blocks: Rc::new([]),
        }
    }

    /// One rank's gradient of one micro-batch.
    pub(super) fn one(world: u32, micro_batch: u32, rank: u32) -> Contribs {
        Contribs {
            world,
            blocks: Rc::new([(micro_batch..micro_batch + 1, Ranks::one(world, rank))]),
        }
    }

    /// The no_sync reference: every rank's gradient of every micro-batch.
    pub(super) fn reference(world: u32, micro_batches: u32) -> Contribs {
        if micro_batches == 0 {
            return Contribs::empty(world);
        }
        Contribs {
            world,
            blocks: Rc::new([(0..micro_batches, Ranks::all(world))]),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Applies `f` to the rank sets of both operands on every elementary micro-batch
    /// range, and normalises the result.
    fn combine(&self, other: &Contribs, f: impl Fn(u64, u64) -> u64) -> Contribs {
        let mut cuts: Vec<u32> = Vec::with_capacity(2 * (self.blocks.len() + other.blocks.len()));
        for (r, _) in self.blocks.iter().chain(other.blocks.iter()) {
            cuts.push(r.start);
            cuts.push(r.end);
        }
        cuts.sort_unstable();
        cuts.dedup();
        let empty = Ranks::empty(self.world);
        let (mut i, mut j) = (0, 0);
        let mut out: Vec<(Range<u32>, Ranks)> = Vec::new();
        for w in cuts.windows(2) {
            let (lo, hi) = (w[0], w[1]);
            while i < self.blocks.len() && self.blocks[i].0.end <= lo {
                i += 1;
            }
            while j < other.blocks.len() && other.blocks[j].0.end <= lo {
                j += 1;
            }
            let a = self
                .blocks
                .get(i)
                .filter(|b| b.0.start <= lo)
                .map_or(&empty, |b| &b.1);
            let b = other
                .blocks
                .get(j)
                .filter(|b| b.0.start <= lo)
                .map_or(&empty, |b| &b.1);
            let r = a.zip(b, &f);
            if r.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some((prev, bits)) if prev.end == lo && *bits == r => prev.end = hi,
                _ => out.push((lo..hi, r)),
            }
        }
        Contribs {
            world: self.world,
            blocks: out.into(),
        }
    }

    pub(super) fn union(&self, other: &Contribs) -> Contribs {
        self.combine(other, |a, b| a | b)
    }

    pub(super) fn intersection(&self, other: &Contribs) -> Contribs {
        self.combine(other, |a, b| a & b)
    }

    /// What `self` holds and `other` does not.
    pub(super) fn minus(&self, other: &Contribs) -> Contribs {
        self.combine(other, |a, b| a & !b)
    }

    /// `{m0, m1} of every rank`, `{m0x2, m1..m7} of ranks 0-3`,
    /// `{m0 of rank 1; m1 of every rank}`. Micro-batches in `twice` carry `x2`.
    pub(super) fn describe(&self, twice: &Contribs) -> String {
        if self.blocks.is_empty() {
            return "{}".into();
        }
        let doubled = |r: &Range<u32>| -> Vec<(Range<u32>, bool)> {
            // Split `r` where `twice` starts or stops holding a micro-batch.
            let mut cuts = vec![r.start, r.end];
            for (t, _) in twice.blocks.iter() {
                for c in [t.start, t.end] {
                    if r.start < c && c < r.end {
                        cuts.push(c);
                    }
                }
            }
            cuts.sort_unstable();
            cuts.dedup();
            cuts.windows(2)
                .map(|w| {
                    let x2 = twice
                        .blocks
                        .iter()
                        .any(|(t, _)| t.start <= w[0] && w[0] < t.end);
                    (w[0]..w[1], x2)
                })
                .collect()
        };
        let mbs = |r: &Range<u32>| -> String {
            let mut s = String::new();
            for (k, (piece, x2)) in doubled(r).into_iter().enumerate() {
                if k > 0 {
                    s.push_str(", ");
                }
                let x = if x2 { "x2" } else { "" };
                match piece.end - piece.start {
                    1 => write!(s, "m{}{x}", piece.start),
                    2 => write!(s, "m{}{x}, m{}{x}", piece.start, piece.start + 1),
                    _ => write!(s, "m{}{x}..m{}{x}", piece.start, piece.end - 1),
                }
                .ok();
            }
            s
        };
        let first = &self.blocks[0].1;
        if self.blocks.iter().all(|(_, r)| r == first) {
            let list: Vec<String> = self.blocks.iter().map(|(r, _)| mbs(r)).collect();
            format!("{{{}}} of {}", list.join(", "), first.describe(self.world))
        } else {
            let list: Vec<String> = self
                .blocks
                .iter()
                .map(|(r, ranks)| format!("{} of {}", mbs(r), ranks.describe(self.world)))
                .collect();
            format!("{{{}}}", list.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_of_one_group_merge_into_one_range() {
        let mut c = Contribs::empty(4);
        for m in 0..100 {
            for g in 0..2 {
                c = c.union(&Contribs::one(4, m, g));
            }
        }
        assert_eq!(c.blocks.len(), 1);
        assert_eq!(c.describe(&Contribs::empty(4)), "{m0..m99} of ranks 0, 1");
    }

    #[test]
    fn intersection_finds_a_contribution_counted_twice() {
        let a = Contribs::one(4, 0, 1).union(&Contribs::one(4, 1, 1));
        let b = Contribs::one(4, 1, 1);
        assert_eq!(a.intersection(&b), b);
        assert!(Contribs::one(4, 0, 0).intersection(&b).is_empty());
    }

    #[test]
    fn the_reference_minus_a_set_is_what_it_misses() {
        let full = Contribs::reference(4, 2);
        let have = Contribs::reference(4, 1);
        let missing = full.minus(&have);
        assert_eq!(missing.describe(&Contribs::empty(4)), "{m1} of every rank");
        assert_eq!(have.union(&missing), full);
    }

    #[test]
    fn worlds_beyond_the_inline_words_keep_their_ranks() {
        let world = 300;
        let a = Contribs::one(world, 0, 299).union(&Contribs::one(world, 0, 3));
        assert_eq!(a.describe(&Contribs::empty(world)), "{m0} of ranks 3, 299");
        let all = Contribs::reference(world, 1);
        assert_eq!(all.minus(&a).union(&a), all);
        assert_eq!(all.intersection(&a), a);
    }

    #[test]
    fn descriptions_mark_doubled_micro_batches_and_uneven_ranks() {
        let full = Contribs::reference(4, 3);
        let twice = Contribs::reference(4, 1);
        assert_eq!(full.describe(&twice), "{m0x2, m1, m2} of every rank");
        let uneven = Contribs::one(130, 0, 1).union(&Contribs::one(130, 1, 129));
        assert_eq!(
            uneven.describe(&Contribs::empty(130)),
            "{m0 of rank 1; m1 of rank 129}"
        );
    }
}
