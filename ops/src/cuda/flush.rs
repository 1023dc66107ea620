//! What a stream's flush issues (`defer.rs` holds the kernels, this plans their
//! launches): the held global norm (two passes through the scratch), the held clip for
//! the gradients no held optimizer reads, the multi-tensor
//! AdamW launches (grouped by hyper-parameters, step, guard and fused clip), and the
//! Muon batches (grouped by shape, hyper-parameters, guard and fused clip, at most
//! [`MUON_MATS`] matrices each) in lockstep classes (`muon.rs`).
//!
//! Everything that changes from step to step goes into one array of words that the
//! flush uploads to the stream's scratch before its launches: the scalars (AdamW's
//! seven, each Muon batch's three) and the tables of buffer addresses (each AdamW
//! launch's tensors and guard, each Muon batch's matrices and guard, the norm's sources
//! and destination, the clip's gradients and norm). The launches take device addresses
//! into the scratch only. So the launches of a flush are a function of sizes only
//! ([`FlushPlan::key`]): a flush of the same shapes is replayed as one captured graph
//! (`tail_graph.rs`) whichever buffers the step's gradients, guards and norm are in
//! (a pool hands them out in any order; a trainer's own gradients move every step).
//!
//! Invariant: the scratch holds the largest Muon class's regions from its start (the
//! classes run one after another on the stream), the words after them, then the
//! norm's partial sums; nothing else of the flush touches it.

use std::collections::HashSet;

use cudarc::driver::sys;

use super::defer::{Entry, Held, HeldClip, HeldNorm, HeldSteps};
use super::fast_hash::WordHash;
use super::flush_cache::Reloc;
use super::kernels::{self, Kernels, Span, SumSqLaunch};
use super::memory::CudaBuffer;
use super::muon::{self, Blas, ClassLayout};
use super::optim::{
    adamw_scalars, adamw_tables, muon_scalars, AdamwTensor, FusedClip, MuonMats, MUON_MATS,
};
use super::tail_graph::TailKey;
use crate::{AdamwParams, MuonParams, NsDtype, OpsError};

/// Alignment of the scalars in the scratch.
const ALIGN: usize = 256;

/// AdamW groups: tensors sharing hyper-parameters, step, guard and fused clip, in
/// first-seen order.
type AdamwGroups = Vec<(
    (AdamwParams, u64, sys::CUdeviceptr, FusedClip),
    (usize, Vec<AdamwTensor>),
)>;
/// Muon groups: matrices sharing shape, hyper-parameters, guard and fused clip.
type MuonKey = ((usize, usize), MuonParams, sys::CUdeviceptr, FusedClip);
type MuonGroups = Vec<(MuonKey, (usize, Vec<(u64, u64, u64)>))>;

/// The held norm's launches: per first-pass launch its grid, where its partial sums
/// start and where its spans' table is in the flush's words; where the destination's
/// address is; the partial sums.
struct NormPlan {
    launches: Vec<(u32, u64, usize)>,
    dst_at: usize,
    partials: u64,
}

/// The held clip's launches over the gradients no held step reads (each one's grid and
/// the place of its spans' table in the flush's words), where the norm's address is,
/// and the threshold.
struct ClipPlan {
    launches: Vec<((u32, u32), usize)>,
    norm_at: usize,
    max_norm: f32,
}

/// One flush's launches, planned on the host.
///
/// Everything a launch reads that changes from step to step (the scalars, and every
/// buffer's address: the tensors' tables, the guards, the norm's sources and
/// destination) is in `words`, which the flush uploads to the scratch before its
/// launches; the launches take device addresses into the scratch only. So the same
/// shapes give the same launches, whichever buffers hold them ([`Self::key`]).
pub(super) struct FlushPlan {
    norm: Option<NormPlan>,
    clip: Option<ClipPlan>,
    /// The multi-tensor AdamW launches: grid, tensors and the place of the table.
    adamw: Vec<(u32, u64, usize)>,
    /// The Muon batches: shape, count, precision and steps, and the places of their
    /// scalars and of their `MuonMats`.
    batches: Vec<(muon::Batch, usize, usize)>,
    /// Lockstep classes: their batches' indices and scratch layout.
    classes: Vec<(Vec<usize>, ClassLayout)>,
    /// The flush's words: scalars (f64 bits) and tables, uploaded before it.
    words: Vec<u64>,
    /// Words that hold the device address of another word (an AdamW table's scalars):
    /// `(word, target)`, filled in once the scratch is known.
    links: Vec<(usize, usize)>,
    /// Where the words start in the scratch (after the largest class).
    scalars_at: usize,
    /// Where the norm's partial sums start (after the words).
    partials_at: usize,
    /// Where each scalar block is in `words`, with the held step (its index) whose
    /// settings give it: AdamW's seven (hyper-parameters and step), a Muon batch's
    /// three (hyper-parameters and shape). `flush_cache.rs` rewrites them each flush.
    pub(super) scalars: Vec<(usize, usize)>,
}

/// How planning reads a buffer's device address: the real one, or a stand-in
/// (`flush_cache.rs`).
pub(super) type Addr<'a> = &'a dyn Fn(&CudaBuffer) -> u64;

impl FlushPlan {
    /// Plans the launches of `held` behind the held `norm` and `clip`, taking every
    /// buffer's address from `addr`: the launches and every word but the addresses are
    /// the same whatever `addr` gives, and each address word is `addr` of one buffer
    /// plus an offset (`flush_cache.rs` relies on both).
    pub(super) fn with_addresses(
        addr: Addr<'_>,
        (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>),
        held: &[Entry],
    ) -> Result<FlushPlan, OpsError> {
        let mut words = Vec::new();
        let norm = norm
            .map(|n| NormPlan::new(n, addr, &mut words))
            .transpose()?;
        let fused = clip.map_or(FusedClip::default(), |c| FusedClip {
            norm: addr(&c.norm),
            max_norm: c.max_norm,
        });
        let clip = clip.map(|c| ClipPlan::new(c, held, addr, &mut words));
        let (adamw_groups, muon_groups) = groups(held, fused, addr);
        let (mut adamw, mut links, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for ((hp, step, guard, clip), (first, tensors)) in adamw_groups {
            let scalars = words.len();
            slots.push((scalars, first));
            words.extend(adamw_scalars(&hp, step).map(f64::to_bits));
            for (table, grid) in adamw_tables(&tensors, 0, (guard, clip)) {
                // The table's first word is its scalars' address.
                links.push((words.len(), scalars));
                adamw.push((grid, table.count(), words.len()));
                words.extend(table.words());
            }
        }
        let mut batches = Vec::new();
        for ((shape, hp, guard, clip), (first, mats)) in muon_groups {
            for chunk in mats.chunks(MUON_MATS) {
                let scalars = words.len();
                slots.push((scalars, first));
                words.extend(muon_scalars(&hp, shape).map(f64::to_bits));
                let mats = MuonMats::of(chunk, clip, guard);
                let at = words.len();
                words.extend(mats.words());
                let count = chunk.len();
                batches.push((
                    muon::Batch {
                        shape,
                        mats,
                        count,
                        hp,
                    },
                    scalars,
                    at,
                ));
            }
        }
        let classes = muon_classes(&batches)?;
        let largest = classes.iter().map(|(_, l)| l.bytes).max().unwrap_or(0);
        let overflow = || OpsError::Shape {
            kernel: "optimizer",
            reason: "the tail's scratch overflows".into(),
        };
        let scalars_at = largest
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(overflow)?;
        let partials_at = words
            .len()
            .checked_mul(8)
            .and_then(|b| b.checked_add(scalars_at))
            .and_then(|b| b.checked_next_multiple_of(ALIGN))
            .ok_or_else(overflow)?;
        let partial_bytes = norm
            .as_ref()
            .map_or(0, |n| n.partials.max(1).saturating_mul(8));
        usize::try_from(partial_bytes)
            .ok()
            .and_then(|b| b.checked_add(partials_at))
            .ok_or_else(overflow)?;
        Ok(FlushPlan {
            norm,
            clip,
            adamw,
            batches,
            classes,
            words,
            links,
            scalars_at,
            partials_at,
            scalars: slots,
        })
    }

    /// Writes this flush's buffer addresses (`ptrs[t] + offset` at each relocation,
    /// `flush_cache.rs`) and each scalar block (from its held step's settings) into the
    /// words.
    pub(super) fn patch(&mut self, relocs: &[Reloc], ptrs: &[u64], held: HeldSteps<'_>) {
        for &(i, t, off) in relocs {
            self.words[i] = ptrs[t as usize] + off;
        }
        for &(at, e) in &self.scalars {
            held.scalars(e).write(&mut self.words[at..]);
        }
    }

    /// The flush's words.
    pub(super) fn words(&self) -> &[u64] {
        &self.words
    }

    /// Whether the flush launches anything.
    pub(super) fn is_empty(&self) -> bool {
        self.norm.is_none()
            && self.clip.as_ref().map_or(true, |c| c.launches.is_empty())
            && self.adamw.is_empty()
            && self.batches.is_empty()
    }

    /// The scratch bytes the flush needs: the largest class, the scalars, then the
    /// norm's partial sums (checked not to overflow in [`Self::new`]).
    pub(super) fn scratch_bytes(&self) -> usize {
        self.partials_at
            + self
                .norm
                .as_ref()
                .map_or(0, |n| n.partials.max(1) as usize * 8)
    }

    /// Copies the words (the scalars and the tables, the links to the scalars filled
    /// in) to their place in `scratch`, on `stream`, before the flush.
    pub(super) fn upload(&mut self, stream: sys::CUstream, scratch: u64) -> Result<(), OpsError> {
        if self.words.is_empty() {
            return Ok(());
        }
        for &(word, target) in &self.links {
            self.words[word] = self.at(scratch, target);
        }
        // SAFETY: the scratch holds `scratch_bytes`; the host memory is pageable, so the
        // driver has staged it before the call returns, and the copy is ordered on the
        // stream before the launches that read it and after everything earlier that
        // used the scratch.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                scratch + self.scalars_at as u64,
                self.words.as_ptr().cast(),
                self.words.len() * 8,
                stream,
            )
        }
        .result()
        .map_err(|e| super::device::failed("optimizer", e))
    }

    /// The device address of word `i` of the flush in `scratch`.
    fn at(&self, scratch: u64, i: usize) -> u64 {
        scratch + (self.scalars_at + i * 8) as u64
    }

    /// Everything the launches depend on but the words' values, with the flush's
    /// scratch at `scratch` (`tail_graph.rs`): the scratch, the sizes, grids, shapes,
    /// precisions and where each launch's words are. No buffer address: the tables
    /// carry those, so a flush over other buffers of the same sizes replays the graph.
    pub(super) fn key(&self, scratch: u64) -> TailKey {
        let mut k: Vec<u64> = vec![scratch, self.scalars_at as u64, self.words.len() as u64];
        if let Some(n) = &self.norm {
            k.extend([0, n.dst_at as u64, n.partials, n.launches.len() as u64]);
            k.extend(
                n.launches
                    .iter()
                    .flat_map(|&(g, a, t)| [u64::from(g), a, t as u64]),
            );
        }
        if let Some(c) = &self.clip {
            k.extend([1, c.norm_at as u64, u64::from(c.max_norm.to_bits())]);
            k.push(c.launches.len() as u64);
            k.extend(
                c.launches
                    .iter()
                    .flat_map(|&((x, y), t)| [u64::from(x), u64::from(y), t as u64]),
            );
        }
        for &(grid, count, at) in &self.adamw {
            k.extend([2, u64::from(grid), count, at as u64]);
        }
        for (b, sc, at) in &self.batches {
            let (rows, cols) = b.shape;
            k.extend([3, rows as u64, cols as u64, b.count as u64]);
            k.extend([*sc as u64, *at as u64]);
            k.extend([dtype_code(b.hp.ns_dtype), u64::from(b.hp.ns_steps)]);
        }
        for (members, _) in &self.classes {
            k.push(4);
            k.extend(members.iter().map(|&i| i as u64));
        }
        k
    }

    /// Issues the flush on `stream` (its words already uploaded to `scratch`).
    pub(super) fn issue(
        &self,
        kernels: &Kernels,
        blas: &Blas,
        stream: sys::CUstream,
        scratch: u64,
    ) -> Result<(), OpsError> {
        let at = |i: usize| self.at(scratch, i);
        if let Some(n) = &self.norm {
            let partial = scratch + self.partials_at as u64;
            let launches: Vec<_> = n.launches.iter().map(|&(g, a, t)| (g, a, at(t))).collect();
            kernels.sum_squares(stream, &launches, (partial, n.partials), at(n.dst_at))?;
        }
        if let Some(c) = &self.clip {
            let launches: Vec<_> = c.launches.iter().map(|&(g, t)| (g, at(t))).collect();
            kernels.clip(stream, &launches, at(c.norm_at), c.max_norm)?;
        }
        for &(grid, _, table) in &self.adamw {
            kernels.optim.adamw_multi(stream, at(table), grid)?;
        }
        for (members, layout) in &self.classes {
            let batches: Vec<(&muon::Batch, u64, u64)> = members
                .iter()
                .map(|&i| {
                    let (b, sc, mats) = &self.batches[i];
                    (b, at(*sc), at(*mats))
                })
                .collect();
            muon::run_class(kernels, blas, stream, (scratch, layout), &batches)?;
        }
        Ok(())
    }
}

/// The lockstep classes of `batches` (`muon.rs`) with their scratch layouts.
fn muon_classes(
    batches: &[(muon::Batch, usize, usize)],
) -> Result<Vec<(Vec<usize>, ClassLayout)>, OpsError> {
    let only: Vec<&muon::Batch> = batches.iter().map(|(b, _, _)| b).collect();
    let mut classes = Vec::new();
    for members in muon::classes(&only) {
        let dims: Vec<_> = members
            .iter()
            .map(|&i| (only[i].shape, only[i].count))
            .collect();
        let dtype = only[members[0]].hp.ns_dtype;
        let layout = ClassLayout::new(&dims, dtype).ok_or_else(|| OpsError::Shape {
            kernel: "muon",
            reason: format!(
                "Muon matrices of shapes {dims:?} need more scratch than fits in memory"
            ),
        })?;
        classes.push((members, layout));
    }
    Ok(classes)
}

impl NormPlan {
    /// The held norm's launches, their tables and the destination's address appended
    /// to `words`.
    fn new(n: &HeldNorm, addr: Addr<'_>, words: &mut Vec<u64>) -> Result<NormPlan, OpsError> {
        let spans: Vec<Span> = n.srcs.iter().map(|b| span(b, addr)).collect();
        let (launches, partials) = kernels::sumsq_launches(&spans);
        if usize::try_from(partials)
            .ok()
            .and_then(|p| p.checked_mul(8))
            .is_none()
        {
            return Err(OpsError::Shape {
                kernel: "sum_squares",
                reason: format!("{} sources need too many partial sums", spans.len()),
            });
        }
        let launches = launches
            .iter()
            .map(|l: &SumSqLaunch| {
                let table = words.len();
                words.extend(kernels::sumsq_words(&spans[l.spans.clone()]));
                (l.grid, l.at, table)
            })
            .collect();
        let dst_at = words.len();
        words.push(addr(&n.dst));
        Ok(NormPlan {
            launches,
            dst_at,
            partials,
        })
    }
}

impl ClipPlan {
    /// The held clip's launches over the gradients no held step reads, their tables
    /// and the norm's address appended to `words`.
    fn new(c: &HeldClip, held: &[Entry], addr: Addr<'_>, words: &mut Vec<u64>) -> ClipPlan {
        let launches = kernels::clip_launches(&unread(c, held, addr))
            .into_iter()
            .map(|(table, grid)| {
                let at = words.len();
                words.extend(table);
                (grid, at)
            })
            .collect();
        let norm_at = words.len();
        words.push(addr(&c.norm));
        ClipPlan {
            launches,
            norm_at,
            max_norm: c.max_norm,
        }
    }
}

/// A buffer as the tail's kernels take it.
fn span(b: &CudaBuffer, addr: Addr<'_>) -> Span {
    Span {
        p: addr(b),
        len: b.len as u64,
    }
}

fn dtype_code(d: NsDtype) -> u64 {
    match d {
        NsDtype::Bf16 => 0,
        NsDtype::Tf32 => 1,
        NsDtype::F32 => 2,
    }
}

/// The held clip's gradients that no held step reads as its gradient (those steps
/// apply the clip themselves).
fn unread(c: &HeldClip, held: &[Entry], addr: Addr<'_>) -> Vec<Span> {
    let read: HashSet<usize, WordHash> = held
        .iter()
        .filter(|e| e.3)
        .map(|e| e.1.buffers()[1].id())
        .collect();
    c.bufs
        .iter()
        .filter(|b| !read.contains(&b.id()))
        .map(|b| span(b, addr))
        .collect()
}

/// The held kernels grouped for their launches, each group with its first step's
/// index; `clip` is what a step that applies the held clip passes its kernel.
fn groups(held: &[Entry], clip: FusedClip, addr: Addr<'_>) -> (AdamwGroups, MuonGroups) {
    let mut adamw: AdamwGroups = Vec::new();
    let mut muon: MuonGroups = Vec::new();
    for (i, (_, h, guard, clipped)) in held.iter().enumerate() {
        let g = guard.as_ref().map_or(0, addr);
        let c = if *clipped { clip } else { FusedClip::default() };
        match h {
            Held::Adamw {
                param,
                grad,
                state,
                hp,
                step,
            } => {
                let key = (*hp, *step, g, c);
                let m = addr(state);
                let t = AdamwTensor {
                    p: addr(param),
                    g: addr(grad),
                    m,
                    // `CudaBuffer::at`: the second moment follows the first.
                    v: m + param.len as u64 * 4,
                    n: param.len as u64,
                    block0: 0,
                };
                match adamw.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, (_, v))) => v.push(t),
                    None => adamw.push((key, (i, vec![t]))),
                }
            }
            Held::Muon {
                param,
                grad,
                momentum,
                rows,
                cols,
                hp,
            } => {
                let key = ((*rows, *cols), *hp, g, c);
                let m = (addr(param), addr(momentum), addr(grad));
                match muon.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, (_, v))) => v.push(m),
                    None => muon.push((key, (i, vec![m]))),
                }
            }
        }
    }
    (adamw, muon)
}
