//! What a stream's flush issues (`defer.rs` holds the kernels, this plans their
//! launches): the held global norm (two passes through the scratch), the held clip for
//! the gradients no held optimizer reads, the multi-tensor
//! AdamW launches (grouped by hyper-parameters, step, guard and fused clip), and the
//! Muon batches (grouped by shape, hyper-parameters, guard and fused clip, at most
//! [`MUON_MATS`] matrices each) in lockstep classes (`muon.rs`).
//!
//! Every scalar that changes from step to step (AdamW's seven, each Muon batch's
//! three) goes into one array that the flush uploads to the end of the stream's
//! scratch before its launches; the launches take its device address. So the launches
//! of a flush are a function of addresses and sizes only ([`FlushPlan::key`]), and a
//! flush that repeats is replayed as one captured graph (`tail_graph.rs`).
//!
//! Invariant: the scratch holds the largest Muon class's regions from its start (the
//! classes run one after another on the stream), the scalars after them, then the
//! norm's partial sums; nothing else of the flush touches it.

use std::collections::HashSet;

use cudarc::driver::sys;

use super::defer::{Entry, Held, HeldClip, HeldNorm};
use super::fast_hash::WordHash;
use super::kernels::{self, Kernels, Span, SumSqLaunch};
use super::memory::CudaBuffer;
use super::muon::{self, Blas, ClassLayout};
use super::optim::{
    adamw_scalars, adamw_tables, muon_scalars, AdamwTable, AdamwTensor, FusedClip, MuonMats,
    MUON_MATS,
};
use super::tail_graph::TailKey;
use crate::{AdamwParams, MuonParams, NsDtype, OpsError};

/// Alignment of the scalars in the scratch.
const ALIGN: usize = 256;

/// AdamW groups: tensors sharing hyper-parameters, step, guard and fused clip, in
/// first-seen order.
type AdamwGroups = Vec<(
    (AdamwParams, u64, sys::CUdeviceptr, FusedClip),
    Vec<AdamwTensor>,
)>;
/// Muon groups: matrices sharing shape, hyper-parameters, guard and fused clip.
type MuonKey = ((usize, usize), MuonParams, sys::CUdeviceptr, FusedClip);
type MuonGroups = Vec<(MuonKey, Vec<(u64, u64, u64)>)>;

/// The held norm's launches: its sources, destination, passes and partial sums.
struct NormPlan {
    spans: Vec<Span>,
    dst: sys::CUdeviceptr,
    launches: Vec<SumSqLaunch>,
    partials: u64,
}

/// One flush's launches, planned on the host.
pub(super) struct FlushPlan {
    norm: Option<NormPlan>,
    /// The held clip's norm, threshold and the gradients no held step reads.
    clip: Option<(sys::CUdeviceptr, f32, Vec<Span>)>,
    /// Each AdamW group's tensors, guard and fused clip, and where its scalars start.
    adamw: Vec<(Vec<AdamwTensor>, (sys::CUdeviceptr, FusedClip), usize)>,
    /// The Muon batches, each with where its scalars start.
    batches: Vec<(muon::Batch, usize)>,
    /// Lockstep classes: their batches' indices and scratch layout.
    classes: Vec<(Vec<usize>, ClassLayout)>,
    /// Every scalar of the flush, uploaded before it.
    scalars: Vec<f64>,
    /// Where the scalars start in the scratch (after the largest class).
    scalars_at: usize,
    /// Where the norm's partial sums start (after the scalars).
    partials_at: usize,
}

impl FlushPlan {
    /// Plans the launches of `held` behind the held `norm` and `clip`.
    pub(super) fn new(
        (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>),
        held: &[Entry],
    ) -> Result<FlushPlan, OpsError> {
        let norm = norm.map(NormPlan::new).transpose()?;
        let fused = clip.map_or(FusedClip::default(), |c| FusedClip {
            norm: c.norm.ptr(),
            max_norm: c.max_norm,
        });
        let clip = clip.map(|c| (c.norm.ptr(), c.max_norm, unread(c, held)));
        let (adamw_groups, muon_groups) = groups(held, fused);
        let mut scalars = Vec::new();
        let mut adamw = Vec::with_capacity(adamw_groups.len());
        for ((hp, step, guard, clip), tensors) in adamw_groups {
            adamw.push((tensors, (guard, clip), scalars.len()));
            scalars.extend(adamw_scalars(&hp, step));
        }
        let mut batches = Vec::new();
        for ((shape, hp, guard, clip), mats) in muon_groups {
            for chunk in mats.chunks(MUON_MATS) {
                let batch = muon::Batch {
                    shape,
                    mats: MuonMats::of(chunk, clip),
                    count: chunk.len(),
                    hp,
                    guard,
                };
                batches.push((batch, scalars.len()));
                scalars.extend(muon_scalars(&hp, shape));
            }
        }
        let only: Vec<&muon::Batch> = batches.iter().map(|(b, _)| b).collect();
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
        let largest = classes.iter().map(|(_, l)| l.bytes).max().unwrap_or(0);
        let overflow = || OpsError::Shape {
            kernel: "optimizer",
            reason: "the tail's scratch overflows".into(),
        };
        let scalars_at = largest
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(overflow)?;
        let partials_at = scalars
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
            scalars,
            scalars_at,
            partials_at,
        })
    }

    /// Whether the flush launches anything.
    pub(super) fn is_empty(&self) -> bool {
        self.norm.is_none()
            && self.clip.as_ref().map_or(true, |c| c.2.is_empty())
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

    /// Copies the scalars to their place in `scratch`, on `stream`, before the flush.
    pub(super) fn upload(&self, stream: sys::CUstream, scratch: u64) -> Result<(), OpsError> {
        if self.scalars.is_empty() {
            return Ok(());
        }
        // SAFETY: the scratch holds `scratch_bytes`; the host memory is pageable, so the
        // driver has staged it before the call returns, and the copy is ordered on the
        // stream before the launches that read it and after everything earlier that
        // used the scratch.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                scratch + self.scalars_at as u64,
                self.scalars.as_ptr().cast(),
                self.scalars.len() * 8,
                stream,
            )
        }
        .result()
        .map_err(|e| super::device::failed("optimizer", e))
    }

    /// The AdamW launches, reading their scalars in `scratch`.
    fn tables(&self, scratch: u64) -> Vec<(AdamwTable, u32)> {
        let at = |i: usize| scratch + (self.scalars_at + i * 8) as u64;
        self.adamw
            .iter()
            .flat_map(|(tensors, gc, i)| adamw_tables(tensors, at(*i), *gc))
            .collect()
    }

    /// Everything the launches depend on but the scalars' values, with the flush's
    /// scratch at `scratch` (`tail_graph.rs`).
    pub(super) fn key(&self, scratch: u64) -> TailKey {
        let mut k: Vec<u64> = vec![scratch, self.scalars_at as u64, self.scalars.len() as u64];
        if let Some(n) = &self.norm {
            k.extend([0, n.dst, n.spans.len() as u64]);
            k.extend(n.spans.iter().flat_map(|s| [s.p, s.len]));
        }
        if let Some((norm, max_norm, spans)) = &self.clip {
            k.extend([1, *norm, u64::from(max_norm.to_bits()), spans.len() as u64]);
            k.extend(spans.iter().flat_map(|s| [s.p, s.len]));
        }
        for (tensors, (guard, clip), i) in &self.adamw {
            k.extend([2, *guard, clip.norm, u64::from(clip.max_norm.to_bits())]);
            k.extend([*i as u64, tensors.len() as u64]);
            k.extend(tensors.iter().flat_map(|t| [t.p, t.g, t.m, t.v, t.n]));
        }
        for (b, i) in &self.batches {
            let (rows, cols) = b.shape;
            k.extend([
                3,
                rows as u64,
                cols as u64,
                b.count as u64,
                b.guard,
                *i as u64,
            ]);
            k.extend([dtype_code(b.hp.ns_dtype), u64::from(b.hp.ns_steps)]);
            k.extend(b.mats.key());
        }
        for (members, _) in &self.classes {
            k.push(4);
            k.extend(members.iter().map(|&i| i as u64));
        }
        k
    }

    /// Issues the flush on `stream` (its scalars already uploaded to `scratch`).
    pub(super) fn issue(
        &self,
        kernels: &Kernels,
        blas: &Blas,
        stream: sys::CUstream,
        scratch: u64,
    ) -> Result<(), OpsError> {
        if let Some(n) = &self.norm {
            let partial = scratch + self.partials_at as u64;
            kernels.sum_squares(stream, &n.spans, (&n.launches, n.partials), partial, n.dst)?;
        }
        if let Some((norm, max_norm, spans)) = &self.clip {
            if !spans.is_empty() {
                kernels.clip(stream, spans, *norm, *max_norm)?;
            }
        }
        for launch in self.tables(scratch) {
            kernels.optim.adamw_multi(stream, &launch)?;
        }
        let sc = |i: usize| scratch + (self.scalars_at + i * 8) as u64;
        for (members, layout) in &self.classes {
            let batches: Vec<(&muon::Batch, u64)> = members
                .iter()
                .map(|&i| (&self.batches[i].0, sc(self.batches[i].1)))
                .collect();
            muon::run_class(kernels, blas, stream, (scratch, layout), &batches)?;
        }
        Ok(())
    }
}

impl NormPlan {
    fn new(n: &HeldNorm) -> Result<NormPlan, OpsError> {
        let spans: Vec<Span> = n.srcs.iter().map(span).collect();
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
        Ok(NormPlan {
            spans,
            dst: n.dst.ptr(),
            launches,
            partials,
        })
    }
}

/// A buffer as the tail's kernels take it.
fn span(b: &CudaBuffer) -> Span {
    Span {
        p: b.ptr(),
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
fn unread(c: &HeldClip, held: &[Entry]) -> Vec<Span> {
    let read: HashSet<usize, WordHash> = held
        .iter()
        .filter(|e| e.3)
        .map(|e| e.1.buffers()[1].id())
        .collect();
    c.bufs
        .iter()
        .filter(|b| !read.contains(&b.id()))
        .map(span)
        .collect()
}

/// The held kernels grouped for their launches; `clip` is what a step that applies the
/// held clip passes its kernel.
fn groups(held: &[Entry], clip: FusedClip) -> (AdamwGroups, MuonGroups) {
    let mut adamw: AdamwGroups = Vec::new();
    let mut muon: MuonGroups = Vec::new();
    for (_, h, guard, clipped) in held {
        let g = guard.as_ref().map_or(0, |b| b.ptr());
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
                let t = AdamwTensor {
                    p: param.ptr(),
                    g: grad.ptr(),
                    m: state.ptr(),
                    v: state.at(param.len as u64),
                    n: param.len as u64,
                    block0: 0,
                };
                match adamw.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(t),
                    None => adamw.push((key, vec![t])),
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
                let m = (param.ptr(), momentum.ptr(), grad.ptr());
                match muon.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(m),
                    None => muon.push((key, vec![m])),
                }
            }
        }
    }
    (adamw, muon)
}
