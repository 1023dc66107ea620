//! A row of optimizers ([`crate::Kernel::Optimizers`]) held as one.
//!
//! The executor hands a rank's optimizer row in as the same list of steps every step
//! (each step's parameter, state and settings: `Arc<[OptimizerStep]>`), with this
//! step's reduced gradients, the global norm that guards it, the step count and the
//! learning-rate factor. Held step by step (`tail.rs`, `defer.rs`), each step is
//! checked, its three buffers and its guard named in the flush's shape (four map
//! operations) and its handles cloned: 0.23–0.27 µs a step on the host of one H200
//! (docs/performance.md, "The optimizer row kept from step to step"). Held as one, a
//! row is checked
//! against what is known of its list ([`RowMemo`], made once per list: lengths,
//! ranks, addresses), its gradients against the held norm's list (the same buffers, in
//! order), and its steps' part of the shape is written from the numbers the step by
//! step hold would give them ([`super::flush_cache::RowNames`]); nothing of its
//! parameters and states is touched, nothing is cloned.
//!
//! A row is held as one only where that numbering is certain: behind nothing and
//! unguarded, or behind the held norm of exactly its gradients (and that norm's clip,
//! if any), guarded by that norm; with every parameter and state distinct, and no
//! gradient nor the norm among them. Anything else is held step by step, as before.
//! A stream that holds a row holds nothing after it (the next kernel held there
//! flushes it first).
//!
//! Invariant: a row held as one flushes to the same shape key, buffer addresses,
//! scalars and launches as its steps held one by one (checked at every flush whose
//! shape is planned anew: the row is expanded into its steps and the shape built again
//! step by step, `flush_cache.rs`; tested against the step by step hold in
//! `defer.rs`).

use std::sync::{Arc, Weak};

use super::checks::muon_fits;
use super::defer::{Entry, Held, StepScalars};
use super::memory::CudaBuffer;
use crate::{OptimizerStep, Tag, Update};

/// A row of optimizers held as one on a stream (`defer.rs`).
#[derive(Debug)]
pub(super) struct HeldRow {
    pub(super) steps: Arc<[OptimizerStep<CudaBuffer>]>,
    /// Each step's gradient, in the steps' order.
    pub(super) grads: Vec<CudaBuffer>,
    /// The global norm every step is guarded by, if any.
    pub(super) guard: Option<CudaBuffer>,
    pub(super) step: u64,
    pub(super) lr_factor: f64,
    /// Whether its steps apply the held clip to their gradients (all or none).
    pub(super) clipped: bool,
}

impl HeldRow {
    /// The first step's tag (a row held as one has at least one step).
    pub(super) fn first_tag(&self) -> Option<Tag> {
        self.steps.first().map(|s| s.tag)
    }

    /// How many of its steps are Muon updates.
    pub(super) fn muon_count(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| matches!(s.update, Update::Muon { .. }))
            .count()
    }

    /// Step `i`'s scalar settings, as its held kernel would have them.
    pub(super) fn scalars(&self, i: usize) -> StepScalars {
        let f = self.lr_factor;
        match self.steps[i].update {
            Update::Adamw { hp, lr } => StepScalars::Adamw(hp.with_lr((lr * f) as f32), self.step),
            Update::Muon { rows, cols, hp, lr } => {
                StepScalars::Muon(hp.with_lr((lr * f) as f32), (rows, cols))
            }
        }
    }

    /// Its steps as the step by step hold holds them, appended to `out`.
    pub(super) fn expand_into(self, out: &mut Vec<Entry>) {
        for (s, grad) in self.steps.iter().zip(self.grads) {
            let Ok(held) = Held::of(s.kernel(grad, self.step, self.lr_factor)) else {
                unreachable!("an optimizer step is an AdamW or a Muon kernel");
            };
            out.push((s.tag, held, self.guard.clone(), self.clipped));
        }
    }
}

/// What is known of one list of steps, made once per list: whether it can be held as
/// one, its parameters' and states' addresses, its gradients' lengths.
#[derive(Debug)]
pub(super) struct RowMemo {
    /// The list (not kept alive: a list let go of is forgotten, its memo made again
    /// for whatever list comes next).
    row: Weak<[OptimizerStep<CudaBuffer>]>,
    rank: u32,
    /// Each step's parameter and state addresses, in the steps' order.
    pub(super) ptrs: Vec<u64>,
    /// The same, sorted: what a gradient or a norm must not be.
    sorted: Vec<u64>,
    /// Each step's gradient length.
    lens: Vec<usize>,
    /// Whether the list can be held as one (module docs); `false` holds it step by step.
    ok: bool,
}

impl RowMemo {
    /// The memo of `steps` on `rank`, at most `max` steps held as one.
    fn new(rank: u32, steps: &Arc<[OptimizerStep<CudaBuffer>]>, max: usize) -> RowMemo {
        let mut ok = !steps.is_empty() && steps.len() <= max;
        let mut lens = Vec::with_capacity(steps.len());
        let mut ptrs = Vec::with_capacity(2 * steps.len());
        for s in steps.iter() {
            let (p, st) = (&s.param, &s.state);
            ok &= p.rank == rank && st.rank == rank;
            let len = match s.update {
                Update::Adamw { .. } => {
                    ok &= p.len > 0 && Some(st.len) == p.len.checked_mul(2);
                    p.len
                }
                Update::Muon { rows, cols, .. } => {
                    let n = rows.checked_mul(cols).unwrap_or(0);
                    ok &= n > 0 && p.len == n && st.len == n && muon_fits((rows, cols));
                    n
                }
            };
            lens.push(len);
            ptrs.extend([p.ptr(), st.ptr()]);
        }
        let mut sorted = ptrs.clone();
        sorted.sort_unstable();
        // Every parameter and state distinct (a live buffer has an address of its own).
        ok &= sorted.windows(2).all(|w| w[0] != w[1]);
        RowMemo {
            row: Arc::downgrade(steps),
            rank,
            ptrs,
            sorted,
            lens,
            ok,
        }
    }

    /// Whether this is the memo of `steps` (the same list, still alive).
    fn is(&self, steps: &Arc<[OptimizerStep<CudaBuffer>]>) -> bool {
        self.row.strong_count() > 0 && std::ptr::addr_eq(self.row.as_ptr(), Arc::as_ptr(steps))
    }

    /// Whether `row` (of this memo's list) can be held as one, as far as the list and
    /// its gradients go: the list can, the step count is 1-based, and each gradient
    /// lives on the rank with its step's length.
    pub(super) fn fits(&self, row: &HeldRow) -> bool {
        self.ok
            && row.step != 0
            && row.grads.len() == self.lens.len()
            && row
                .grads
                .iter()
                .zip(&self.lens)
                .all(|(g, &len)| g.rank == self.rank && g.len == len)
    }

    /// Whether none of `addrs` is a parameter's or a state's.
    pub(super) fn clear_of(&self, addrs: &[u64]) -> bool {
        addrs.iter().all(|a| self.sorted.binary_search(a).is_err())
    }
}

/// The memos of the lists last held as one (a few: a trainer alternating plans has a
/// list per plan).
#[derive(Debug, Default)]
pub(super) struct RowMemos(Vec<RowMemo>);

/// Most memos kept.
const MEMOS: usize = 4;

impl RowMemos {
    /// The memo of `steps` on `rank`, made when there is none (forgetting the lists let
    /// go of, and the oldest beyond [`MEMOS`]).
    pub(super) fn of(
        &mut self,
        rank: u32,
        steps: &Arc<[OptimizerStep<CudaBuffer>]>,
        max: usize,
    ) -> &RowMemo {
        let found = self.0.iter().position(|m| m.is(steps) && m.rank == rank);
        let at = match found {
            Some(at) => at,
            None => {
                self.0.retain(|m| m.row.strong_count() > 0);
                if self.0.len() >= MEMOS {
                    self.0.remove(0);
                }
                self.0.push(RowMemo::new(rank, steps, max));
                self.0.len() - 1
            }
        };
        &self.0[at]
    }
}
