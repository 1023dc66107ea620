//! `overlap bench-interference`: what a copy-transport combine costs the GEMMs it runs
//! beside, on one GPU, without any communication.
//!
//! The combine is what keeps the copy transport's η below 0.9 (docs/performance.md,
//! *Why not 0.9*): it needs SMs, and beside a GEMM it slows the GEMM. This probe
//! isolates that effect. Each step runs `layers` layers of `gemms` bf16 GEMMs on the
//! compute stream. Variants:
//!
//! - `gemms`: the GEMMs alone;
//! - `combines`: one combine per layer alone, back to back on the reduce stream;
//! - `beside`: both, each combine one layer behind, on the high-priority reduce stream
//!   (as the copy transport's defaults place it);
//! - `beside_normal`: the same with the combine's plain loads and stores instead of
//!   cache-streaming ones (CUDA only; elsewhere equal to `beside`);
//! - `beside_low`: as `beside` on a stream of ordinary priority (`publish`), so the
//!   combine's blocks do not go ahead of the GEMMs' waiting ones;
//! - `serial`: each combine on the compute stream after its layer's GEMMs;
//! - `copy_beside`: instead of the combine, a copy of the layer's chunk on the copy
//!   stream (`cuMemcpyDtoDAsync`, copy engines: the memory traffic an exchange brings a
//!   GPU, a chunk read and one written), one layer behind;
//! - `both_beside`: the copy and the combine, both one layer behind;
//! - `copy_then_combine`: the same, but each combine waits for its layer's copy, so
//!   the two never contend for memory bandwidth beside the GEMMs.
//!
//! A layer's combine reduces a group of two's chunk of a `grad_mib` gradient: it reads
//! two chunks of `grad_mib / 2` MiB and writes one, in `pieces` launches. Every layer
//! has buffers of its own (as every layer's gradient does), so no combine finds its
//! operands in L2 because an earlier one left them there. The variants take turns step by step (as
//! in `overlap bench`, so a drift of the GPU's clocks weighs on all alike); each figure
//! is the mean device span of the timed steps.
//!
//! [`beside`] is the probe `overlap calibrate` runs for each kind of communication
//! kernel (combine, copy-engine copy, NCCL collective, exchange): a block of GEMMs alone,
//! a run of the kernels back to back alone, then both at once, round after round; what
//! the GEMMs lose and how much longer the kernels take are the simulator's
//! `[interference.*]` figures ([`BesideTimes::gemm_cost`], [`BesideTimes::stretch`]).
//! Cross-rank kernels run back to back rather than one per layer, so that no rank's
//! kernel waits for a peer whose GEMMs run behind: the first of each round meets the
//! peers, the others run in step.

use overlap_graph::{Collective, CollectiveKind, DType, Group, ReduceOp, Stream};
use overlap_ops::{Backend, Kernel, Tag};
use serde::Serialize;

use crate::bench::{drain, span};
use overlap::Error;
use overlap_executor::Backward;

/// The probe's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::Args)]
pub struct InterferenceArgs {
    /// Layers per step.
    #[arg(long, default_value_t = 16)]
    pub layers: u32,
    /// bf16 GEMMs per layer.
    #[arg(long, default_value_t = 3)]
    pub gemms: u32,
    /// GEMM size (each is `d × d · d × d`).
    #[arg(long, default_value_t = 4096)]
    pub d: u32,
    /// The gradient whose group-of-two chunk each layer's combine reduces, MiB.
    #[arg(long, default_value_t = 64)]
    pub grad_mib: u32,
    /// Each layer's combine as this many combines of equal size, one after another (as
    /// `overlap bench --buckets-per-layer` splits a layer's reduction).
    #[arg(long, default_value_t = 1)]
    pub pieces: u32,
    /// Cap every combine at this many CTAs of 512 threads (the wide, unrolled kernel
    /// of `overlap bench --combine-ctas`; default: the full-grid kernels).
    #[arg(long)]
    pub combine_ctas: Option<u32>,
    /// Timed steps per variant.
    #[arg(long, default_value_t = 10)]
    pub iters: u32,
    /// Untimed steps per variant before them.
    #[arg(long, default_value_t = 2)]
    pub warmup: u32,
}

/// The figures, ms per step (means over the timed steps).
#[derive(Debug, Clone, Serialize)]
pub struct InterferenceReport {
    /// The sizes.
    #[serde(flatten)]
    pub args: InterferenceArgs,
    /// The backend.
    pub backend: String,
    /// GEMMs alone.
    pub gemms_ms: f64,
    /// Combines alone.
    pub combines_ms: f64,
    /// Both, each combine one layer behind on the reduce stream.
    pub beside_ms: f64,
    /// The same with plain loads and stores.
    pub beside_normal_ms: f64,
    /// As `beside`, the combines on a stream of ordinary priority.
    pub beside_low_ms: f64,
    /// Each combine on the compute stream after its layer.
    pub serial_ms: f64,
    /// What the combines cost the step beside the GEMMs, per layer: `(beside − gemms −
    /// one combine alone) / layers` (the last combine runs after the last GEMM).
    pub cost_per_layer_ms: f64,
    /// The same for `serial`: a combine's time on the compute stream.
    pub serial_cost_per_layer_ms: f64,
    /// GEMMs with each layer's chunk copied on the copy engines one layer behind.
    pub copy_beside_ms: f64,
    /// GEMMs with both the copy and the combine one layer behind.
    pub both_beside_ms: f64,
    /// What the copies cost the GEMMs, per layer: `(copy_beside − gemms) / layers`
    /// (the last copy, after the last GEMM, included: a copy alone is not timed).
    pub copy_cost_per_layer_ms: f64,
    /// The same for `both_beside`, less one combine alone.
    pub both_cost_per_layer_ms: f64,
    /// GEMMs with each layer's copy and then its combine one layer behind.
    pub copy_then_combine_ms: f64,
    /// The same for `copy_then_combine`.
    pub copy_then_combine_cost_per_layer_ms: f64,
}

/// Which variant a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Gemms,
    Combines,
    Beside,
    BesideNormal,
    BesideLow,
    Serial,
    CopyBeside,
    BothBeside,
    CopyThenCombine,
}

const VARIANTS: [Variant; 9] = [
    Variant::Gemms,
    Variant::Combines,
    Variant::Beside,
    Variant::BesideNormal,
    Variant::BesideLow,
    Variant::Serial,
    Variant::CopyBeside,
    Variant::BothBeside,
    Variant::CopyThenCombine,
];

fn tag(node: u32, op: &'static str) -> Tag {
    Tag {
        node,
        op,
        micro_batch: 0,
    }
}

/// Runs the probe on `backend`'s first local rank. `streaming` switches the combine's
/// cache-streaming loads and stores (a no-op where the backend has none);
/// `engine_copy(stream, tag, dst, src)` copies a whole buffer the way an exchange moves
/// bytes (CUDA: `cuMemcpyDtoDAsync`, the copy engines), timed as a kernel.
// Called only by `crate::cuda`, which a build without CUDA replaces by `cuda_stub.rs`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub async fn run<B: Backend>(
    backend: &B,
    args: &InterferenceArgs,
    streaming: impl Fn(bool),
    engine_copy: impl Fn(Stream, Tag, &B::Buffer, &B::Buffer) -> Result<(), Error>,
) -> Result<InterferenceReport, Error> {
    let chunk = checked_chunk(args)?;
    let rank = *backend
        .local_ranks()
        .first()
        .ok_or_else(|| Error::Backend("the backend drives no rank".into()))?;
    let probe = Probe::new(backend, rank, args, chunk, engine_copy)?;
    let sums = probe.time_variants(&streaming).await?;
    Ok(report(backend.name(), args, &sums))
}

/// The elements of a layer's group-of-two chunk (half the gradient), once the sizes are
/// checked.
fn checked_chunk(args: &InterferenceArgs) -> Result<u64, Error> {
    let chunk = u64::from(args.grad_mib) << 17;
    if args.layers == 0
        || args.iters == 0
        || args.grad_mib == 0
        || args.grad_mib > 4096
        || args.pieces == 0
        || chunk % u64::from(args.pieces) != 0
    {
        return Err(Error::Usage(
            "--layers and --iters at least 1, --grad-mib between 1 and 4096, --pieces dividing the chunk".into(),
        ));
    }
    Ok(chunk)
}

/// A backend's error as the probe's.
fn backend_error(e: overlap_ops::OpsError) -> Error {
    Error::Backend(e.to_string())
}

/// The probe's buffers and kernels on one rank.
struct Probe<'a, B: Backend, C> {
    backend: &'a B,
    rank: u32,
    args: &'a InterferenceArgs,
    /// Per layer and piece: own, received, combined, and where the copy variants copy
    /// own to.
    bufs: Vec<Vec<B::Buffer>>,
    /// A piece's combine.
    desc: Collective,
    engine_copy: C,
}

impl<'a, B, C> Probe<'a, B, C>
where
    B: Backend,
    C: Fn(Stream, Tag, &B::Buffer, &B::Buffer) -> Result<(), Error>,
{
    /// Allocates every layer's buffers: a group of two's chunk of `chunk` elements in
    /// `pieces`.
    fn new(
        backend: &'a B,
        rank: u32,
        args: &'a InterferenceArgs,
        chunk: u64,
        engine_copy: C,
    ) -> Result<Self, Error> {
        let n = (chunk / u64::from(args.pieces)) as usize;
        let mut bufs = Vec::new();
        for _ in 0..args.layers * args.pieces {
            let mut layer_bufs = Vec::new();
            for _ in 0..4 {
                layer_bufs.push(backend.alloc(rank, n).map_err(backend_error)?);
            }
            bufs.push(layer_bufs);
        }
        let desc = Collective {
            kind: CollectiveKind::Reduce,
            group: Group::Shard { replicate: 0 },
            count: n as u64,
            dtype: DType::F32,
            op: ReduceOp::Avg,
            root: Some(0),
        };
        Ok(Probe {
            backend,
            rank,
            args,
            bufs,
            desc,
            engine_copy,
        })
    }

    /// Layer `l`'s buffers of piece `p`.
    fn piece(&self, l: u32, p: u32) -> &[B::Buffer] {
        &self.bufs[(l * self.args.pieces + p) as usize]
    }

    /// Launches layer `l`'s combine, in its pieces, on `stream`.
    fn combine(&self, stream: Stream, l: u32) {
        for p in 0..self.args.pieces {
            let b = self.piece(l, p);
            self.backend.launch(
                self.rank,
                stream,
                tag(l, "combine"),
                Kernel::Combine {
                    desc: self.desc,
                    size: 2,
                    index: 0,
                    own: b[0].clone(),
                    own_offset: 0,
                    recv: b[1].clone(),
                    dst: b[2].clone(),
                },
            );
        }
    }

    /// The copy engines' share of an exchange: the layer's own chunk copied, on `copy`.
    fn copy(&self, l: u32) -> Result<(), Error> {
        for p in 0..self.args.pieces {
            let b = self.piece(l, p);
            (self.engine_copy)(Stream::Copy, tag(l, "exchange"), &b[3], &b[0])?;
        }
        Ok(())
    }

    /// Launches layer `l`'s GEMMs on the compute stream.
    fn gemm(&self, l: u32) {
        let d = self.args.d;
        self.backend.launch(
            self.rank,
            Stream::Compute,
            tag(l, "grad_ready"),
            Kernel::Gemm {
                m: d,
                n: d,
                k: d,
                count: self.args.gemms,
            },
        )
    }

    /// Layer `l`'s combine and/or copy once `ready` (its GEMMs) has run.
    fn behind(
        &self,
        variant: Variant,
        beside: Stream,
        ready: &B::Event,
        l: u32,
    ) -> Result<(), Error> {
        let (backend, rank) = (self.backend, self.rank);
        if variant != Variant::CopyBeside {
            backend.wait(rank, beside, ready);
        }
        if matches!(
            variant,
            Variant::CopyBeside | Variant::BothBeside | Variant::CopyThenCombine
        ) {
            backend.wait(rank, Stream::Copy, ready);
            self.copy(l)?;
            if variant == Variant::CopyThenCombine {
                let copied = backend.event(rank);
                backend.record(rank, Stream::Copy, &copied);
                backend.wait(rank, beside, &copied);
            }
        }
        if variant != Variant::CopyBeside {
            self.combine(beside, l);
        }
        Ok(())
    }

    /// Issues one step of `variant`: every layer's GEMMs and its combines or copies.
    fn issue(&self, variant: Variant) -> Result<(), Error> {
        let (backend, rank) = (self.backend, self.rank);
        let mut ready = Vec::new();
        let beside = if variant == Variant::BesideLow {
            Stream::Publish
        } else {
            Stream::Reduce
        };
        for l in 0..self.args.layers {
            if variant != Variant::Combines {
                self.gemm(l);
            }
            match variant {
                Variant::Combines => self.combine(Stream::Reduce, l),
                Variant::Serial => self.combine(Stream::Compute, l),
                Variant::Beside
                | Variant::BesideNormal
                | Variant::BesideLow
                | Variant::CopyBeside
                | Variant::BothBeside
                | Variant::CopyThenCombine => {
                    let ev = backend.event(rank);
                    backend.record(rank, Stream::Compute, &ev);
                    ready.push(ev);
                    // The previous layer's combine or copy, beside this layer's
                    // GEMMs.
                    if l > 0 {
                        self.behind(variant, beside, &ready[l as usize - 1], l - 1)?;
                    }
                }
                Variant::Gemms => {}
            }
        }
        if let Some(last) = ready.last() {
            self.behind(variant, beside, last, self.args.layers - 1)?;
        }
        Ok(())
    }

    /// Waits on the host for everything issued on the probe's streams.
    async fn drain_streams(&self) -> Result<(), Error> {
        for s in [
            Stream::Compute,
            Stream::Reduce,
            Stream::Publish,
            Stream::Copy,
        ] {
            let end = self.backend.event(self.rank);
            self.backend.record(self.rank, s, &end);
            self.backend.host_wait(&end).await.map_err(backend_error)?;
        }
        Ok(())
    }

    /// Runs the variants in turn, step by step; returns, per variant of [`VARIANTS`],
    /// the sum of the timed steps' spans, ms.
    async fn time_variants(
        &self,
        streaming: &impl Fn(bool),
    ) -> Result<[f64; VARIANTS.len()], Error> {
        let backend = self.backend;
        let mut sums = [0.0f64; VARIANTS.len()];
        backend.set_timings(true);
        for i in 0..self.args.warmup + self.args.iters {
            for (v, &variant) in VARIANTS.iter().enumerate() {
                backend.take_timings();
                streaming(variant != Variant::BesideNormal);
                self.issue(variant)?;
                self.drain_streams().await?;
                let timings = backend.take_timings();
                if let Some((_, _, _, e)) = backend.errors().into_iter().next() {
                    backend.reset();
                    streaming(true);
                    return Err(Error::Backend(e.to_string()));
                }
                if i >= self.args.warmup {
                    sums[v] += span(&timings) * 1e3;
                }
            }
        }
        streaming(true);
        Ok(sums)
    }
}

/// The report from the sums of [`Probe::time_variants`].
fn report(
    backend: &str,
    args: &InterferenceArgs,
    sums: &[f64; VARIANTS.len()],
) -> InterferenceReport {
    let mean = |v: Variant| {
        let i = VARIANTS.iter().position(|&x| x == v).unwrap_or(0);
        sums[i] / f64::from(args.iters)
    };
    let layers = f64::from(args.layers);
    let (gemms, combines) = (mean(Variant::Gemms), mean(Variant::Combines));
    let (beside, serial) = (mean(Variant::Beside), mean(Variant::Serial));
    InterferenceReport {
        args: *args,
        backend: backend.into(),
        gemms_ms: gemms,
        combines_ms: combines,
        beside_ms: beside,
        beside_normal_ms: mean(Variant::BesideNormal),
        beside_low_ms: mean(Variant::BesideLow),
        serial_ms: serial,
        cost_per_layer_ms: (beside - gemms - combines / layers) / layers,
        serial_cost_per_layer_ms: (serial - gemms) / layers,
        copy_beside_ms: mean(Variant::CopyBeside),
        both_beside_ms: mean(Variant::BothBeside),
        copy_cost_per_layer_ms: (mean(Variant::CopyBeside) - gemms) / layers,
        both_cost_per_layer_ms: (mean(Variant::BothBeside) - gemms - combines / layers) / layers,
        copy_then_combine_ms: mean(Variant::CopyThenCombine),
        copy_then_combine_cost_per_layer_ms: (mean(Variant::CopyThenCombine)
            - gemms
            - combines / layers)
            / layers,
    }
}

/// The GEMM block and the kernels of [`beside`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BesideArgs {
    /// GEMM launches on the compute stream per block.
    pub layers: u32,
    /// bf16 GEMMs per launch.
    pub gemms: u32,
    /// GEMM size (each is `d × d · d × d`).
    pub d: u32,
    /// Kernels of the probed kind per round, back to back (at least 2: the first of
    /// each round is not counted).
    pub ops: u32,
    /// Untimed rounds.
    pub warmup: u32,
    /// Timed rounds.
    pub iters: u32,
}

pub use overlap_sim::calibrate::BesideTimes;

/// The work of `ops` (each `(start, end)`, each `each` seconds of work alone) done
/// within `window`: each kernel's work in proportion to the part of it inside.
pub fn work_beside(ops: &[(f64, f64)], window: (f64, f64), each: f64) -> f64 {
    ops.iter()
        .filter(|(s, e)| e > s)
        .map(|&(s, e)| {
            let inside = (e.min(window.1) - s.max(window.0)).max(0.0);
            each * inside / (e - s)
        })
        .sum()
}

/// The `(start, end)` of `rank`'s kernels tagged `op` among `timings`, sorted by start.
pub fn intervals(timings: &[overlap_ops::Timing], rank: u32, op: &str) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = timings
        .iter()
        .filter(|t| t.rank == rank && t.tag.op == op)
        .map(|t| (t.start, t.end))
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// Runs one phase of [`beside`] on every local rank: the GEMM block (when `gemms`) on
/// the compute stream, then (when `ops`) the kernels on `stream`, after the first GEMM
/// launch when both run; drains and returns the first local rank's timings as `(gemm
/// window, kernel intervals sorted by start)`.
async fn beside_phase<B: Backend>(
    backend: &B,
    args: &BesideArgs,
    (stream, op): (Stream, &'static str),
    (gemms, ops): (bool, bool),
    issue: &dyn Fn(u32, Tag) -> Result<(), Error>,
) -> Result<((f64, f64), Vec<(f64, f64)>), Error> {
    let ranks = backend.local_ranks();
    let me = ranks[0];
    let block = Backward::Gemms {
        count: args.gemms,
        d: args.d,
    };
    backend.take_timings();
    let mut ends = Vec::new();
    for &r in &ranks {
        if gemms {
            for l in 0..args.layers {
                backend.launch(r, Stream::Compute, tag(l, "gemm"), block.kernel());
                if l == 0 && ops {
                    // The kernels start once the first GEMMs ran: beside the others.
                    let first = backend.event(r);
                    backend.record(r, Stream::Compute, &first);
                    backend.wait(r, stream, &first);
                }
            }
        }
        if ops {
            for k in 0..args.ops {
                issue(r, tag(k, op))?;
            }
        }
        for s in [Stream::Compute, stream] {
            let ev = backend.event(r);
            backend.record(r, s, &ev);
            ends.push(ev);
        }
    }
    drain(backend, &ends, op).await?;
    let timings = backend.take_timings();
    let mine = |name: &str| intervals(&timings, me, name);
    let g = mine("gemm");
    let window = (
        g.iter().map(|x| x.0).fold(f64::INFINITY, f64::min),
        g.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max),
    );
    Ok((window, mine(op)))
}

/// Measures what kernels of one kind (`issue(rank, tag)` launches one on `stream`, tagged
/// `op`) and a block of GEMMs do to each other (module docs), on every local rank alike
/// (a cross-rank kind's members all issue it); the figures are the first local rank's.
/// Each round: the kernels alone, the GEMMs alone, then the GEMMs with the kernels
/// beside them (started once the first GEMM launch has run, so that they start within
/// the block).
pub async fn beside<B: Backend>(
    backend: &B,
    args: &BesideArgs,
    stream: Stream,
    op: &'static str,
    issue: impl Fn(u32, Tag) -> Result<(), Error>,
) -> Result<BesideTimes, Error> {
    if args.layers == 0 || args.gemms == 0 || args.ops < 2 || args.iters == 0 {
        return Err(Error::Usage(
            "beside: at least one GEMM launch, two kernels and one timed round".into(),
        ));
    }
    if stream == Stream::Compute || op == "gemm" || backend.local_ranks().is_empty() {
        return Err(Error::Usage(format!(
            "beside: `{op}` on the {} stream cannot run beside the GEMMs",
            stream.name()
        )));
    }
    let mut sum = BesideTimes::default();
    let (mut beside_sum, mut beside_count) = (0.0, 0usize);
    let kind = (stream, op);
    for round in 0..args.warmup + args.iters {
        let (_, alone) = beside_phase(backend, args, kind, (false, true), &issue).await?;
        let each: Vec<f64> = alone.iter().skip(1).map(|(s, e)| e - s).collect();
        let each = each.iter().sum::<f64>() / each.len().max(1) as f64;
        let (g, _) = beside_phase(backend, args, kind, (true, false), &issue).await?;
        let (w, ops) = beside_phase(backend, args, kind, (true, true), &issue).await?;
        if round < args.warmup {
            continue;
        }
        sum.gemms_alone_s += g.1 - g.0;
        sum.gemms_beside_s += w.1 - w.0;
        sum.op_alone_s += each;
        sum.work_beside_s += work_beside(&ops, w, each);
        for (s, e) in ops.iter().skip(1) {
            if *s >= w.0 && *e <= w.1 {
                beside_sum += e - s;
                beside_count += 1;
            }
        }
    }
    if beside_count == 0 {
        return Err(Error::Backend(format!(
            "beside: no `{op}` after the first of its round ran wholly beside the GEMMs ({} launches of {} GEMMs of {}³): the GEMM block is too short for {} of them",
            args.layers, args.gemms, args.d, args.ops
        )));
    }
    let rounds = f64::from(args.iters);
    Ok(BesideTimes {
        gemms_alone_s: sum.gemms_alone_s / rounds,
        gemms_beside_s: sum.gemms_beside_s / rounds,
        op_alone_s: sum.op_alone_s / rounds,
        op_beside_s: beside_sum / beside_count as f64,
        work_beside_s: sum.work_beside_s / rounds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use overlap_ops::cpu::{CpuBackend, CpuBuffer};

    /// The CPU backend has no copy engines: a whole-buffer pack stands in.
    fn pack_copy(
        backend: &CpuBackend,
    ) -> impl Fn(Stream, Tag, &CpuBuffer, &CpuBuffer) -> Result<(), Error> + '_ {
        move |stream, tag, dst, src| {
            let seg = overlap_graph::CopySeg {
                param: 0,
                src: 0,
                dst: 0,
                len: backend.len(src) as u64,
            };
            backend.launch(
                0,
                stream,
                tag,
                Kernel::Pack {
                    dst: dst.clone(),
                    segs: std::sync::Arc::from(vec![(seg, vec![src.clone()])]),
                },
            );
            Ok(())
        }
    }

    #[test]
    fn beside_counts_the_work_inside_the_gemms_and_derives_the_model_figures() {
        // Window (1, 10): half of the first, all of the second, half of the third, none
        // of the fourth; an empty interval counts nothing.
        let ops = [
            (0.0, 2.0),
            (2.0, 4.0),
            (9.0, 11.0),
            (12.0, 13.0),
            (5.0, 5.0),
        ];
        assert_eq!(work_beside(&ops, (1.0, 10.0), 3.0), 1.5 + 3.0 + 1.5);
        let t = BesideTimes {
            gemms_alone_s: 9.0,
            gemms_beside_s: 9.4,
            op_alone_s: 0.1,
            op_beside_s: 0.55,
            work_beside_s: 1.0,
        };
        assert!((t.gemm_cost() - 0.4).abs() < 1e-12 && (t.stretch() - 5.5).abs() < 1e-12);
        // Faster beside than alone, GEMMs faster with company: clamped to the model's
        // ranges; nothing measured: no effect.
        let t = BesideTimes {
            gemms_beside_s: 8.9,
            op_beside_s: 0.05,
            ..t
        };
        assert_eq!((t.gemm_cost(), t.stretch()), (0.0, 1.0));
        assert_eq!(
            (
                BesideTimes::default().gemm_cost(),
                BesideTimes::default().stretch()
            ),
            (0.0, 1.0)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn beside_runs_a_kind_of_kernel_beside_the_gemms_on_the_cpu_backend() {
        let backend = CpuBackend::new(overlap_graph::Mesh::new(1, 1).unwrap());
        let (src, dst) = (
            backend.alloc(0, 256).unwrap(),
            backend.alloc(0, 256).unwrap(),
        );
        // Long enough for a loaded test machine (calibrate's CPU tests use the same).
        let args = BesideArgs {
            layers: 8,
            gemms: 1,
            d: 128,
            ops: 3,
            warmup: 1,
            iters: 2,
        };
        let copy = pack_copy(&backend);
        let issue = |_: u32, t: Tag| copy(Stream::Copy, t, &dst, &src);
        let t = beside(&backend, &args, Stream::Copy, "copy", issue)
            .await
            .unwrap();
        assert!(t.gemms_alone_s > 0.0 && t.gemms_beside_s > 0.0, "{t:?}");
        assert!(t.op_alone_s > 0.0 && t.op_beside_s > 0.0, "{t:?}");
        // Every kernel started after the first GEMMs: its work all ran beside them.
        assert!(t.work_beside_s > 0.0, "{t:?}");
        for (bad, stream) in [
            (BesideArgs { ops: 1, ..args }, Stream::Copy),
            (BesideArgs { iters: 0, ..args }, Stream::Copy),
            (args, Stream::Compute),
        ] {
            let e = beside(&backend, &bad, stream, "copy", issue).await;
            assert!(matches!(e, Err(Error::Usage(_))), "{e:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_variant_runs_on_the_cpu_backend() {
        let backend = CpuBackend::new(overlap_graph::Mesh::new(1, 1).unwrap());
        let args = InterferenceArgs {
            layers: 3,
            gemms: 1,
            d: 16,
            grad_mib: 1,
            pieces: 2,
            combine_ctas: None,
            iters: 2,
            warmup: 1,
        };
        let r = run(&backend, &args, |_| {}, pack_copy(&backend))
            .await
            .unwrap();
        for x in [
            r.gemms_ms,
            r.combines_ms,
            r.beside_ms,
            r.beside_normal_ms,
            r.beside_low_ms,
            r.serial_ms,
            r.copy_beside_ms,
            r.both_beside_ms,
            r.copy_then_combine_ms,
        ] {
            assert!(x > 0.0, "{r:?}");
        }
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"cost_per_layer_ms\"") && json.contains("\"layers\":3"));
        for bad in [
            InterferenceArgs { iters: 0, ..args },
            InterferenceArgs { pieces: 0, ..args },
            InterferenceArgs { pieces: 3, ..args },
        ] {
            assert!(run(&backend, &bad, |_| {}, pack_copy(&backend))
                .await
                .is_err());
        }
    }
}
