//! A stream's flush planned once per shape and patched each step.
//!
//! A trainer's step holds the same kernels over the same shapes on the same stream every
//! step; what changes is which buffers hold its gradients and its norm (a pool hands them
//! out in any order) and its scalars (the learning rate, AdamW's step). Planning a flush
//! (`flush.rs`) walks every held kernel; here it is done once per *shape* of flush, with
//! stand-in addresses, and each later flush of that shape only writes its buffers'
//! addresses and its scalars into the planned words.
//!
//! The shape (the key of a [`Shape`]) is everything planning reads but buffer addresses and the
//! scalars' values: each held kernel's kind, lengths, matrix shape and Newton–Schulz
//! precision and steps, the group it falls in (the same rule as `flush.rs`'s grouping:
//! equal settings, step, guard and fused clip), whether it applies the clip; the norm's
//! and the clip's buffers and lengths and the threshold; and which of all these buffers
//! are one buffer (each buffer is numbered where it is first named). Planned with buffer
//! `t` at the stand-in address `SYMBOL + (t << SHIFT)`, every word that names an address
//! is one buffer's stand-in plus an offset (`FlushPlan::with_addresses`), and no other
//! word reaches `SYMBOL` outside the scalar blocks: the relocations are those words.
//!
//! The shape is built as the kernels are held (`defer.rs` adds each one), with the
//! roles each buffer has among them, which is what a new kernel is checked against: a
//! buffer is hashed once per kernel that names it, for both.
//!
//! Invariant: a cached plan is used only for a flush of the same key, and only once the
//! plan it gives with the real addresses was found equal, word for word and launch for
//! launch, to the one planned directly from them (checked each time a shape is planned).

use std::collections::HashMap;

use super::defer::{Entry, Held, HeldClip, HeldNorm, HeldSteps, StepScalars};
use super::fast_hash::WordHash;
use super::flush::FlushPlan;
use super::memory::CudaBuffer;
use super::row::HeldRow;
use crate::OpsError;
use crate::{AdamwParams, MuonParams};

/// Where the stand-in addresses start: no scalar table word, count or length reaches it.
const SYMBOL: u64 = 1 << 63;
/// Stand-in addresses are `1 << SHIFT` bytes apart: room for any offset into a buffer.
const SHIFT: u32 = 40;

/// What a held buffer is to the held kernels ([`Shape::roles`]): bits of a byte.
pub(super) mod role {
    /// A held step's parameter, gradient or state.
    pub(in super::super) const HELD: u8 = 1;
    /// A held step's guard (the norm it reads).
    pub(in super::super) const GUARD: u8 = 2;
    /// One of the held norm's sources.
    pub(in super::super) const NORM_SRC: u8 = 4;
    /// The held norm's result.
    pub(in super::super) const NORM_DST: u8 = 8;
    /// One of the held clip's buffers (when the clip has a list of its own).
    pub(in super::super) const CLIP_BUF: u8 = 16;
    /// The norm the held clip reads.
    pub(in super::super) const CLIP_NORM: u8 = 32;
}

/// A buffer the held kernels name: its number in the shape and its roles.
#[derive(Debug, Clone, Copy)]
struct Named {
    number: u32,
    roles: u8,
}

/// A step's guard and buffers as [`Shape::name_step`] named them: their numbers and
/// the roles they had before (each `[guard, param, grad, state]`; a step without a
/// guard has number `u64::MAX` and no roles there).
pub(super) struct StepNames {
    numbers: [u64; 4],
    /// The roles before the step was named.
    pub(super) roles: [u8; 4],
}

/// How a row held as one (`row.rs`) numbers its steps' buffers: as holding its steps
/// one by one would.
pub(super) enum RowNames {
    /// Behind the held norm of exactly its gradients (which named its result 0 and
    /// gradient `i` as `i + 1`), guarded by it: each step's parameter and state are new,
    /// in the steps' order.
    BehindNorm,
    /// Behind nothing, unguarded: each step's parameter, gradient (its address here)
    /// and state are new, in the steps' order.
    Alone(Vec<u64>),
}

/// A stream's held flush as it grows (`defer.rs` adds each kernel as it is held): its
/// shape's key, its buffers' real addresses numbered in the order the key names them,
/// and every named buffer's roles, which is what a new kernel is checked against. Built
/// once per held kernel, so a flush finds its key ready; cleared after each flush with
/// its memory kept, so that a steady step allocates nothing and grows no table here.
#[derive(Default)]
pub(super) struct Shape {
    /// The norm's part of the key (empty: none held).
    norm: Vec<u64>,
    /// The clip's part of the key (empty: none held).
    clip: Vec<u64>,
    /// The held steps' part of the key.
    steps: Vec<u64>,
    /// The whole key, put together at the flush.
    key: Vec<u64>,
    /// Per buffer number: its device address.
    ptrs: Vec<u64>,
    /// Buffer identity ([`CudaBuffer::id`]) to number and roles.
    ids: HashMap<usize, Named, WordHash>,
    /// AdamW's groups (`flush.rs`'s grouping) by (settings, step, guard, clipped).
    adamw: Vec<(AdamwParams, u64, u64, u64)>,
    /// Muon's groups by (shape, settings, guard, clipped).
    muon: Vec<((u64, u64), MuonParams, u64, u64)>,
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Shape({} buffers)", self.ptrs.len())
    }
}

impl Shape {
    /// The held buffers' addresses, by number.
    pub(super) fn addresses(&self) -> &[u64] {
        &self.ptrs
    }

    /// Forgets everything held (the memory stays).
    pub(super) fn clear(&mut self) {
        self.norm.clear();
        self.clip.clear();
        self.steps.clear();
        self.key.clear();
        self.ptrs.clear();
        self.ids.clear();
        self.adamw.clear();
        self.muon.clear();
    }

    /// Buffer `b`'s number (given where it is first named), adding `roles` to it.
    fn name(&mut self, b: &CudaBuffer, roles: u8) -> u64 {
        self.name_was(b, roles).0
    }

    /// [`Self::name`], and the roles `b` had before.
    fn name_was(&mut self, b: &CudaBuffer, roles: u8) -> (u64, u8) {
        let next = self.ptrs.len() as u32;
        let named = self.ids.entry(b.id()).or_insert(Named {
            number: next,
            roles: 0,
        });
        let before = named.roles;
        named.roles |= roles;
        let n = named.number;
        if n == next {
            self.ptrs.push(b.ptr());
        }
        (u64::from(n), before)
    }

    /// Names a step's guard and buffers (in the key's order: the guard, then the
    /// parameter, the gradient, the state or momentum): their numbers and the roles they
    /// had before, which is what the step is checked against ([`StepNames::roles`]).
    /// A step that conflicts is not added: the stream is flushed, which clears the
    /// shape, and the step named again.
    pub(super) fn name_step(&mut self, h: &Held, guard: Option<&CudaBuffer>) -> StepNames {
        let (g, guard_roles) = guard.map_or((u64::MAX, 0), |b| self.name_was(b, role::GUARD));
        let [p, gr, st] = h.buffers().map(|b| {
            let (n, before) = self.name_was(b, role::HELD);
            // A buffer that is also the step's guard had the guard's roles before.
            match guard {
                Some(gb) if gb.id() == b.id() => (n, guard_roles),
                _ => (n, before),
            }
        });
        StepNames {
            numbers: [g, p.0, gr.0, st.0],
            roles: [guard_roles, p.1, gr.1, st.1],
        }
    }

    /// The held norm (held first: nothing else is).
    pub(super) fn add_norm(&mut self, n: &HeldNorm) {
        let dst = self.name(&n.dst, role::NORM_DST);
        self.norm.extend([1, dst, n.srcs.len() as u64]);
        for b in n.srcs.iter() {
            let t = self.name(b, role::NORM_SRC);
            self.norm.extend([t, b.len as u64]);
        }
    }

    /// The held clip (held behind nothing but the norm). A clip of the norm's own list
    /// names its buffers through the norm's part of the key.
    pub(super) fn add_clip(&mut self, c: &HeldClip) {
        let norm = self.name(&c.norm, role::CLIP_NORM);
        let bits = u64::from(c.max_norm.to_bits());
        if c.norms_list {
            self.clip.extend([2, norm, bits]);
            return;
        }
        self.clip.extend([1, norm, bits, c.bufs.len() as u64]);
        for b in c.bufs.iter() {
            let t = self.name(b, role::CLIP_BUF);
            self.clip.extend([t, b.len as u64]);
        }
    }

    /// A held step, named by [`Self::name_step`]: its kind, lengths, matrix shape and
    /// Newton–Schulz settings, its group, its buffers, its guard and whether it applies
    /// the clip.
    pub(super) fn add_step(&mut self, (_, h, _, clipped): &Entry, names: &StepNames) {
        let len = h.buffers()[0].len;
        self.push_step(names.numbers, (len, h.scalars()), *clipped);
    }

    /// A step's part of the key: numbered `[guard, param, grad, state]`, of `len`
    /// elements and these settings.
    fn push_step(&mut self, [g, p, gr, st]: [u64; 4], (len, s): (usize, StepScalars), clip: bool) {
        let clipped = u64::from(clip);
        match s {
            StepScalars::Adamw(hp, step) => {
                let group = group_of(&mut self.adamw, (hp, step, g, clipped));
                self.steps
                    .extend([2, p, len as u64, gr, st, g, clipped, group]);
            }
            StepScalars::Muon(hp, (rows, cols)) => {
                let shape = (rows as u64, cols as u64);
                let group = group_of(&mut self.muon, (shape, hp, g, clipped));
                self.steps
                    .extend([3, p, shape.0, shape.1, gr, st, g, clipped, group]);
                self.steps
                    .extend([u64::from(hp.ns_steps), hp.ns_dtype as u64]);
            }
        }
    }

    /// A row held as one (`row.rs`): its steps' part of the key and their new buffers'
    /// addresses, numbered as `names` says (`param_state`: each step's parameter and
    /// state addresses, in the steps' order). Its buffers are not named in the map:
    /// nothing is held after a row, and a flush that plans its shape anew builds it again
    /// step by step ([`Self::rebuild`]).
    pub(super) fn add_row(&mut self, row: &HeldRow, names: &RowNames, param_state: &[u64]) {
        let base = self.ptrs.len() as u64;
        for (i, s) in row.steps.iter().enumerate() {
            let (at, ps) = (i as u64, &param_state[2 * i..2 * i + 2]);
            let numbers = match names {
                RowNames::BehindNorm => {
                    self.ptrs.extend_from_slice(ps);
                    [0, base + 2 * at, at + 1, base + 2 * at + 1]
                }
                RowNames::Alone(grads) => {
                    self.ptrs.extend([ps[0], grads[i], ps[1]]);
                    let p = base + 3 * at;
                    [u64::MAX, p, p + 1, p + 2]
                }
            };
            self.push_step(numbers, (s.param.len, row.scalars(i)), row.clipped);
        }
    }

    /// Forgets the shape and builds it again from the held norm, clip and steps, step
    /// by step (the steps named in order, as they were held).
    pub(super) fn rebuild(
        &mut self,
        (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>),
        held: &[Entry],
    ) {
        self.clear();
        if let Some(n) = norm {
            self.add_norm(n);
        }
        if let Some(c) = clip {
            self.add_clip(c);
        }
        for e in held {
            let names = self.name_step(&e.1, e.2.as_ref());
            self.add_step(e, &names);
        }
    }

    /// Puts the key together: the norm's part (or 0), the clip's (or 0), the steps'.
    fn assemble(&mut self) {
        self.key.clear();
        for part in [&self.norm, &self.clip] {
            if part.is_empty() {
                self.key.push(0);
            } else {
                self.key.extend_from_slice(part);
            }
        }
        self.key.extend_from_slice(&self.steps);
    }

    /// The key as a flush would see it (put together now).
    #[cfg(test)]
    pub(super) fn assembled_key(&mut self) -> Vec<u64> {
        self.assemble();
        self.key.clone()
    }

    /// Buffer `b`'s stand-in address (`None` for a buffer the key does not name).
    fn symbol(&self, b: &CudaBuffer) -> Option<u64> {
        self.ids
            .get(&b.id())
            .map(|n| SYMBOL + (u64::from(n.number) << SHIFT))
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
    /// The plan of the flush of `held` behind `norm` and `clip`, whose shape is `shape`
    /// (built as they were held), with this flush's addresses and scalars.
    ///
    /// A row held as one (`row`) stays so when the shape was planned before; else it is
    /// expanded into `held` and the shape built again step by step before planning, so
    /// that what is cached is always planned from the steps one by one.
    pub(super) fn plan(
        &mut self,
        shape: &mut Shape,
        (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>),
        (held, row): (&mut Vec<Entry>, &mut Option<HeldRow>),
    ) -> Result<&mut FlushPlan, OpsError> {
        shape.assemble();
        let hit = self.cached.as_ref().is_some_and(|c| c.key == shape.key);
        if !hit {
            if let Some(r) = row.take() {
                r.expand_into(held);
                let fast = std::mem::take(&mut shape.key);
                shape.rebuild((norm, clip), held);
                shape.assemble();
                debug_assert_eq!(fast, shape.key, "a row held as one keys its flush apart");
            }
        }
        let shape = &*shape;
        let steps = match row {
            Some(r) => HeldSteps::Row(r),
            None => HeldSteps::Entries(held),
        };
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
        c.plan.patch(&c.relocs, &shape.ptrs, steps);
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
        plan.patch(&relocs, &shape.ptrs, HeldSteps::Entries(held));
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
