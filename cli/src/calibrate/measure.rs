//! `overlap calibrate`'s measurements: every figure [`overlap_sim::calibrate::derive`] needs, taken
//! on the job's backend ([`measure`]), and on GPUs under `overlap launch` through
//! [`crate::cuda::calibrate`].
//!
//! [`measure`] is generic over the backend, so the CPU tests run every step of it with
//! small sizes (the CPU backend's times fit nothing: only the GPU's are figures). It
//! reuses what the other probes run: `overlap bench` (the GEMM rate and the host's cost
//! per node), `overlap bench-interference` split into pieces (a kernel's fixed cost and
//! the combine's rate), [`bench::repeat_timed`] (every sweep of direct calls) and
//! [`interference::beside`] (each kind of communication kernel beside the GEMMs).
//!
//! Invariant: every rank of the job issues the same kernels in the same order, whatever
//! its timings say (no size or count depends on a measurement), so cross-rank calls
//! always meet; the figures are the first local rank's.

use std::sync::Arc;

use overlap::{Error, Mesh};
use overlap_graph::{Collective, CollectiveKind, DType, Group, ReduceOp, Stream};
use overlap_ops::{
    collective_roles, exchange_roles, Backend, CommId, Kernel, MuonParams, NsDtype, Tag,
};

use crate::bench::{self, drain, repeat_timed, BenchArgs};
use crate::interference::{self, BesideArgs, InterferenceArgs};
use overlap_sim::calibrate::{
    size_text, BesideProbe, CollectiveSample, CrossGpu, Environment, ExchangeSample, Measurements,
    Sample, KINDS,
};

/// The sizes and repeats of one calibration.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    /// Ranks in the job (mesh `world × 1`: one shard group of every rank).
    pub world: u32,
    /// Sizes of the sweeps, bytes (collectives: nccl-tests' size; exchanges: per peer).
    pub sizes: Vec<u64>,
    /// Untimed calls, steps or rounds before the timed ones.
    pub warmup: u32,
    /// Timed ones.
    pub iters: u32,
    /// `overlap bench` on the job's mesh: the GEMM rate and the host's cost per node.
    pub bench: BenchArgs,
    /// `overlap bench-interference`, run once per number of pieces.
    pub interference: InterferenceArgs,
    /// The numbers of pieces the combine is split into.
    pub pieces: Vec<u32>,
    /// The GEMM block and the kernels of each probe beside it.
    pub beside: BesideArgs,
    /// The gradient whose share each probe beside the GEMMs moves, bytes.
    pub beside_bytes: u64,
    /// Muon's matrix: rows, columns.
    pub muon: (usize, usize),
    /// The copy ring's slot (the exchanges' pieces), bytes.
    pub slot_bytes: u64,
    /// Elements of the small kernels of the event probe.
    pub event_elems: usize,
}

impl Sweep {
    /// The calibration of `overlap calibrate` on `world` GPUs: sizes `mib` (MiB), and the
    /// workloads of the figures the shipped profiles were derived from (`overlap bench`'s
    /// defaults; 16 layers of three bf16 GEMMs of 4096³; a 64 MiB gradient; combines in
    /// 1, 2, 4 and 8 pieces; the config's default 32 MiB ring slot; Muon on 4096 × 4096).
    // Called only by `crate::cuda`, which a build without CUDA replaces by `cuda_stub.rs`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn gpu(world: u32, mib: &[u32], warmup: u32, iters: u32) -> Result<Sweep, Error> {
        let mesh = Mesh::new(world, 1).map_err(|e| Error::Usage(e.to_string()))?;
        let (layers, gemms, d, grad_mib) = (16, 3, 4096, 64);
        Ok(Sweep {
            world,
            sizes: mib.iter().map(|&m| u64::from(m) << 20).collect(),
            warmup,
            iters,
            bench: BenchArgs {
                warmup,
                iters,
                ..BenchArgs::new(mesh)
            },
            interference: InterferenceArgs {
                layers,
                gemms,
                d,
                grad_mib,
                pieces: 1,
                combine_ctas: None,
                iters,
                warmup,
            },
            pieces: vec![1, 2, 4, 8],
            beside: BesideArgs {
                layers,
                gemms,
                d,
                ops: 8,
                warmup,
                iters,
            },
            beside_bytes: u64::from(grad_mib) << 20,
            muon: (4096, 4096),
            slot_bytes: u64::from(overlap::config::OverlapConfig::default().copy_slot_mib) << 20,
            event_elems: 4096,
        })
    }
}

/// What a backend offers beyond [`Backend`] that the probes use.
pub struct Hooks<'a, B: Backend> {
    /// Copies all of rank `r`'s buffer `src` into its `dst` on a stream the way an
    /// exchange moves bytes (CUDA: the copy engines), timed as a kernel tagged with the
    /// tag: `(r, stream, tag, dst, src)`.
    pub engine_copy: &'a EngineCopy<'a, B>,
    /// Switches the combine's cache-streaming loads and stores.
    pub streaming: &'a dyn Fn(bool),
}

/// [`Hooks::engine_copy`].
pub type EngineCopy<'a, B> = dyn Fn(u32, Stream, Tag, &<B as Backend>::Buffer, &<B as Backend>::Buffer) -> Result<(), Error>
    + 'a;

/// Buffers of `lens` on every local rank (`None` lengths allocate nothing).
type RankBufs<B> = Vec<(u32, Vec<Option<<B as Backend>::Buffer>>)>;

fn alloc_all<B: Backend>(
    b: &B,
    lens: impl Fn(u32) -> Vec<Option<usize>>,
) -> Result<RankBufs<B>, Error> {
    b.local_ranks()
        .into_iter()
        .map(|r| {
            let bufs = lens(r)
                .into_iter()
                .map(|len| len.map(|n| b.alloc(r, n)).transpose())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| Error::Backend(e.to_string()))?;
            Ok((r, bufs))
        })
        .collect()
}

/// Rank `r`'s buffers of [`alloc_all`].
fn of<B: Backend>(all: &RankBufs<B>, r: u32) -> Result<&[Option<B::Buffer>], Error> {
    all.iter()
        .find(|(x, _)| *x == r)
        .map(|(_, v)| v.as_slice())
        .ok_or_else(|| Error::Backend(format!("no buffers on rank {r}")))
}

/// Buffer `i` of a rank's, which must be there.
fn buf<B: Backend>(bufs: &[Option<B::Buffer>], i: usize) -> Result<B::Buffer, Error> {
    bufs.get(i)
        .cloned()
        .flatten()
        .ok_or_else(|| Error::Backend(format!("calibrate: buffer {i} missing")))
}

/// The mean of `t`, refused when empty (the backend recorded no timings of `what`).
fn mean(t: &[f64], what: &str) -> Result<f64, Error> {
    if t.is_empty() {
        return Err(Error::Backend(format!(
            "calibrate: {what}: the backend recorded no timings"
        )));
    }
    Ok(t.iter().sum::<f64>() / t.len() as f64)
}

fn tag(node: u32, op: &'static str) -> Tag {
    Tag {
        node,
        op,
        micro_batch: 0,
    }
}

/// The one shard group of mesh `world × 1`, on `stream`.
fn comm(stream: Stream) -> CommId {
    CommId {
        group: Group::Shard { replicate: 0 },
        stream,
    }
}

/// A collective over the job's group (f32 sum; rooted kinds at member 0).
fn collective(kind: CollectiveKind, count: u64) -> Collective {
    Collective {
        kind,
        group: Group::Shard { replicate: 0 },
        count,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: kind.rooted().then_some(0),
    }
}

/// Launches `kernel` of rank `r`'s buffers on `stream`.
fn launch<B: Backend>(
    b: &B,
    r: u32,
    stream: Stream,
    t: Tag,
    kernel: Kernel<B::Buffer>,
) -> Result<(), Error> {
    b.launch(r, stream, t, kernel);
    Ok(())
}

/// Runs every measurement of `sweep` on `backend` (module docs): `say` gets one line per
/// measurement, named; `env` is where they were taken.
// Called only by `crate::cuda`, which a build without CUDA replaces by `cuda_stub.rs`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub async fn measure<B: Backend>(
    backend: Arc<B>,
    sweep: &Sweep,
    env: Environment,
    hooks: &Hooks<'_, B>,
    say: &dyn Fn(String),
) -> Result<Measurements, Error> {
    let b = &*backend;
    if b.local_ranks().is_empty() {
        return Err(Error::Backend("the backend drives no rank".into()));
    }
    b.set_timings(true);
    let (gemm, host_us_per_node) = bench_gemms(backend.clone(), sweep, say).await?;
    let combine = combine_pieces(b, sweep, hooks, say).await?;
    let (elementwise, local_copy) = copy_sweeps(b, sweep, hooks, say).await?;
    let muon = muon_alone(b, sweep, say).await?;
    let event_gap = event_gap(b, sweep.event_elems, sweep.warmup, sweep.iters).await?;
    say(format!(
        "event wait across streams: {:.2} µs between kernels, {:.2} µs on one stream",
        event_gap.0 * 1e6,
        event_gap.1 * 1e6
    ));
    let (combine_beside, local_copy_beside) = beside_gemms(b, sweep, hooks, say).await?;
    let cross = if sweep.world >= 2 {
        Some(cross_gpu(b, sweep, say).await?)
    } else {
        None
    };
    Ok(Measurements {
        env,
        gemm,
        host_us_per_node,
        combine,
        elementwise,
        local_copy,
        muon,
        event_gap,
        combine_beside,
        local_copy_beside,
        cross,
    })
}

/// The GEMMs alone and the host's cost per node: `overlap bench` on the job's mesh;
/// returns [`Measurements::gemm`] and the host's µs per node.
async fn bench_gemms<B: Backend>(
    backend: Arc<B>,
    sweep: &Sweep,
    say: &dyn Fn(String),
) -> Result<((u32, u32, u32, f64), f64), Error> {
    let a = &sweep.bench;
    say(format!(
        "bench on mesh {} ({} layers of {} GEMMs of {}³, {} MiB gradients)...",
        a.mesh, a.layers, a.gemms, a.d, a.grad_mib
    ));
    let r = bench::run(backend, a).await?;
    say(format!(
        "bench: compute_only {:.3} ms, host {:.2} µs per node",
        r.figures.compute_only_ms, r.host_us_per_node
    ));
    let gemm = (a.layers, a.gemms, a.d, r.figures.compute_only_ms / 1e3);
    Ok((gemm, r.host_us_per_node))
}

/// A kernel's fixed cost and the combine's rate: the combine in pieces; returns
/// [`Measurements::combine`].
async fn combine_pieces<B: Backend>(
    b: &B,
    sweep: &Sweep,
    hooks: &Hooks<'_, B>,
    say: &dyn Fn(String),
) -> Result<(f64, Vec<(u32, f64)>), Error> {
    let ia = sweep.interference;
    let first = b.local_ranks()[0];
    let combine_bytes = 3.0 * f64::from(ia.grad_mib) * f64::from(1u32 << 20) / 2.0;
    let mut pieces = Vec::new();
    for &p in &sweep.pieces {
        let args = InterferenceArgs { pieces: p, ..ia };
        let r = interference::run(
            b,
            &args,
            |on| (hooks.streaming)(on),
            |s, t, d, src| (hooks.engine_copy)(first, s, t, d, src),
        )
        .await?;
        let per = r.combines_ms / 1e3 / f64::from(ia.layers * p);
        say(format!(
            "combine of a {} gradient's chunk in {p} piece(s): {:.2} µs per launch",
            size_text(combine_bytes / 1.5),
            per * 1e6
        ));
        pieces.push((p, per));
    }
    Ok((combine_bytes, pieces))
}

/// The executor's copy kernel and the copy engines within the GPU, per size of the
/// sweep; returns [`Measurements::elementwise`] and [`Measurements::local_copy`].
async fn copy_sweeps<B: Backend>(
    b: &B,
    sweep: &Sweep,
    hooks: &Hooks<'_, B>,
    say: &dyn Fn(String),
) -> Result<(Vec<Sample>, Vec<Sample>), Error> {
    let (warmup, iters) = (sweep.warmup, sweep.iters);
    let mut elementwise = Vec::new();
    let mut local_copy = Vec::new();
    for &size in &sweep.sizes {
        let len = (size / 4) as usize;
        let bufs = alloc_all(b, |_| vec![Some(len), Some(len)])?;
        let t = repeat_timed(b, Stream::Compute, "add", warmup, iters, |r, t| {
            let v = of::<B>(&bufs, r)?;
            let (src, dst) = (buf::<B>(v, 0)?, buf::<B>(v, 1)?);
            launch(
                b,
                r,
                Stream::Compute,
                t,
                Kernel::Add {
                    dst,
                    src,
                    accumulate: false,
                },
            )
        })
        .await?;
        let s = mean(&t, "copy kernel")?;
        say(format!(
            "copy kernel of {}: {:.2} µs",
            size_text(size as f64),
            s * 1e6
        ));
        elementwise.push(Sample {
            bytes: 2.0 * size as f64,
            seconds: s,
        });
        let t = repeat_timed(b, Stream::Copy, "copy", warmup, iters, |r, t| {
            let v = of::<B>(&bufs, r)?;
            (hooks.engine_copy)(r, Stream::Copy, t, &buf::<B>(v, 1)?, &buf::<B>(v, 0)?)
        })
        .await?;
        let s = mean(&t, "copy-engine copy")?;
        say(format!(
            "copy-engine copy of {} within the GPU: {:.2} µs",
            size_text(size as f64),
            s * 1e6
        ));
        local_copy.push(Sample {
            bytes: size as f64,
            seconds: s,
        });
    }
    Ok((elementwise, local_copy))
}

/// Muon alone on the sweep's matrix; returns [`Measurements::muon`].
async fn muon_alone<B: Backend>(
    b: &B,
    sweep: &Sweep,
    say: &dyn Fn(String),
) -> Result<(u64, u64, f64), Error> {
    let (rows, cols) = sweep.muon;
    let numel = rows * cols;
    let bufs = alloc_all(b, |_| vec![Some(numel); 3])?;
    for (_, v) in &bufs {
        for (i, x) in v.iter().flatten().enumerate() {
            let data: Vec<f32> = overlap_ops::math::pseudo_random(numel, 7 + i as u64)
                .iter()
                .map(|v| v * 0.01)
                .collect();
            b.upload(x, &data)
                .map_err(|e| Error::Backend(e.to_string()))?;
        }
    }
    let t = repeat_timed(
        b,
        Stream::Compute,
        "muon",
        sweep.warmup,
        sweep.iters,
        |r, t| {
            let v = of::<B>(&bufs, r)?;
            let kernel = Kernel::Muon {
                param: buf::<B>(v, 0)?,
                grad: buf::<B>(v, 1)?,
                momentum: buf::<B>(v, 2)?,
                rows,
                cols,
                // The f32 rate is what `compute.fp32_tflops` stands for (the bf16 and
                // TF32 products run at `compute.gemm_tflops`, measured by the GEMMs).
                hp: MuonParams::default().with_ns_dtype(NsDtype::F32),
            };
            launch(b, r, Stream::Compute, t, kernel)
        },
    )
    .await?;
    drop(bufs);
    let muon_s = mean(&t, "Muon")?;
    say(format!("Muon on {rows}×{cols}: {:.3} ms", muon_s * 1e3));
    Ok((rows as u64, cols as u64, muon_s))
}

/// Beside the GEMMs: the combine, a copy within the GPU; returns
/// [`Measurements::combine_beside`] and [`Measurements::local_copy_beside`].
async fn beside_gemms<B: Backend>(
    b: &B,
    sweep: &Sweep,
    hooks: &Hooks<'_, B>,
    say: &dyn Fn(String),
) -> Result<(BesideProbe, BesideProbe), Error> {
    let chunk = (sweep.beside_bytes / 8) as usize;
    let ops = sweep.beside.ops as usize;
    let bufs = alloc_all(b, |_| vec![Some(chunk); 3 * ops])?;
    let what = format!(
        "a combine of a {} gradient's group-of-two chunk (on the reduce stream)",
        size_text(sweep.beside_bytes as f64)
    );
    let desc = collective(CollectiveKind::Reduce, chunk as u64);
    let times = interference::beside(b, &sweep.beside, Stream::Reduce, "combine", |r, t| {
        let v = of::<B>(&bufs, r)?;
        let k = 3 * (t.node as usize % ops);
        let kernel = Kernel::Combine {
            desc,
            size: 2,
            index: 0,
            own: buf::<B>(v, k)?,
            own_offset: 0,
            recv: buf::<B>(v, k + 1)?,
            dst: buf::<B>(v, k + 2)?,
        };
        launch(b, r, Stream::Reduce, t, kernel)
    })
    .await?;
    say(beside_line(&what, &times));
    let combine_beside = BesideProbe { what, times };
    let what = format!(
        "a copy-engine copy of {} within the GPU",
        size_text((chunk * 4) as f64)
    );
    let times = interference::beside(b, &sweep.beside, Stream::Copy, "copy", |r, t| {
        let v = of::<B>(&bufs, r)?;
        let k = 3 * (t.node as usize % ops);
        (hooks.engine_copy)(r, Stream::Copy, t, &buf::<B>(v, k + 2)?, &buf::<B>(v, k)?)
    })
    .await?;
    drop(bufs);
    say(beside_line(&what, &times));
    Ok((combine_beside, BesideProbe { what, times }))
}

fn beside_line(what: &str, t: &interference::BesideTimes) -> String {
    format!(
        "{what} beside the GEMMs: {:.1} µs (alone {:.1}); GEMMs {:.3} ms (alone {:.3})",
        t.op_beside_s * 1e6,
        t.op_alone_s * 1e6,
        t.gemms_beside_s * 1e3,
        t.gemms_alone_s * 1e3
    )
}

/// A cross-rank call over the job's group: an NCCL collective on the high-priority
/// reduce stream, or the copy transport's exchange of a reduction on the copy stream
/// (`exchange`).
#[derive(Debug, Clone, Copy)]
struct Call {
    desc: Collective,
    exchange: bool,
}

impl Call {
    fn stream(self) -> Stream {
        if self.exchange {
            Stream::Copy
        } else {
            Stream::Reduce
        }
    }

    fn op(self) -> &'static str {
        if self.exchange {
            "exchange"
        } else {
            "collective"
        }
    }

    /// Each local rank's send and receive buffers for the call on mesh `world × 1`.
    fn alloc<B: Backend>(self, b: &B, world: u32) -> Result<RankBufs<B>, Error> {
        let mesh = Mesh::new(world, 1).map_err(|e| Error::Usage(e.to_string()))?;
        let group = Group::Shard { replicate: 0 };
        let roles = |r: u32| {
            let index = mesh.index_in(group, r).unwrap_or(0);
            if self.exchange {
                exchange_roles(&self.desc, world, index)
            } else {
                collective_roles(&self.desc, world, index)
            }
        };
        roles(0).map_err(|e| Error::Usage(format!("--mib: {e}")))?;
        alloc_all(b, |r| {
            roles(r).map_or_else(|_| vec![None, None], |x| vec![x.send, x.recv])
        })
    }

    /// Launches the call on rank `r` with its buffers of [`Call::alloc`].
    fn issue<B: Backend>(self, b: &B, bufs: &RankBufs<B>, r: u32, t: Tag) -> Result<(), Error> {
        let v = of::<B>(bufs, r)?;
        let (desc, send, recv) = (self.desc, v[0].clone(), v[1].clone());
        let kernel = if self.exchange {
            Kernel::Exchange {
                desc,
                comm: comm(Stream::Copy),
                send,
                recv,
            }
        } else {
            Kernel::Collective {
                desc,
                comm: comm(Stream::Reduce),
                send,
                recv,
            }
        };
        launch(b, r, self.stream(), t, kernel)
    }

    /// The mean time of one call, back to back ([`repeat_timed`]).
    async fn timed<B: Backend>(self, b: &B, sweep: &Sweep) -> Result<f64, Error> {
        let bufs = self.alloc(b, sweep.world)?;
        let t = repeat_timed(
            b,
            self.stream(),
            self.op(),
            sweep.warmup,
            sweep.iters,
            |r, t| self.issue(b, &bufs, r, t),
        )
        .await?;
        mean(&t, self.op())
    }

    /// The call beside the GEMMs ([`interference::beside`]).
    async fn beside<B: Backend>(
        self,
        b: &B,
        sweep: &Sweep,
    ) -> Result<interference::BesideTimes, Error> {
        let bufs = self.alloc(b, sweep.world)?;
        interference::beside(b, &sweep.beside, self.stream(), self.op(), |r, t| {
            self.issue(b, &bufs, r, t)
        })
        .await
    }
}

/// What needs two or more GPUs: the collective and exchange sweeps over the job's group,
/// and both beside the GEMMs.
async fn cross_gpu<B: Backend>(
    b: &B,
    sweep: &Sweep,
    say: &dyn Fn(String),
) -> Result<CrossGpu, Error> {
    let n = sweep.world;
    let collectives = collective_sweep(b, sweep, say).await?;
    let exchanges = exchange_sweep(b, sweep, say).await?;
    // Both beside the GEMMs: a reduce-scatter of the probes' gradient.
    let count = (sweep.beside_bytes / 4 / u64::from(n)).max(1);
    let desc = collective(CollectiveKind::ReduceScatter, count);
    let what = format!(
        "a {} reduce-scatter over the job's {n} GPUs (NCCL, on the reduce stream)",
        size_text(sweep.beside_bytes as f64)
    );
    let times = Call {
        desc,
        exchange: false,
    }
    .beside(b, sweep)
    .await?;
    say(beside_line(&what, &times));
    let nccl = BesideProbe { what, times };
    let message = (count * 4) as f64;
    let what = format!(
        "an exchange of a {} reduce-scatter ({} per peer) over the job's {n} GPUs",
        size_text(sweep.beside_bytes as f64),
        size_text(message)
    );
    let times = Call {
        desc,
        exchange: true,
    }
    .beside(b, sweep)
    .await?;
    say(beside_line(&what, &times));
    Ok(CrossGpu {
        collectives,
        exchanges,
        slot_bytes: sweep.slot_bytes,
        nccl,
        exchange: (BesideProbe { what, times }, message),
    })
}

/// Every collective kind at every size of the sweep (nccl-tests' size: the send buffer
/// of a reduce-scatter, the receive buffer of an all-gather) over the job's group.
async fn collective_sweep<B: Backend>(
    b: &B,
    sweep: &Sweep,
    say: &dyn Fn(String),
) -> Result<Vec<CollectiveSample>, Error> {
    let n = sweep.world;
    let mut collectives = Vec::new();
    for kind in KINDS {
        for &size in &sweep.sizes {
            let spread = matches!(
                kind,
                CollectiveKind::ReduceScatter | CollectiveKind::AllGather
            );
            let members = if spread { u64::from(n) } else { 1 };
            let desc = collective(kind, (size / 4 / members).max(1));
            let s = Call {
                desc,
                exchange: false,
            }
            .timed(b, sweep)
            .await?;
            let bytes = (desc.count * members * 4) as f64;
            say(format!(
                "{} of {} over {n} GPUs: {:.2} µs",
                kind.name(),
                size_text(bytes),
                s * 1e6
            ));
            collectives.push(CollectiveSample {
                kind,
                bytes,
                seconds: s,
            });
        }
    }
    Ok(collectives)
}

/// The exchanges of a reduce-scatter over the job's group, each size of the sweep per
/// peer.
async fn exchange_sweep<B: Backend>(
    b: &B,
    sweep: &Sweep,
    say: &dyn Fn(String),
) -> Result<Vec<ExchangeSample>, Error> {
    let n = sweep.world;
    let mut exchanges = Vec::new();
    for &size in &sweep.sizes {
        let desc = collective(CollectiveKind::ReduceScatter, (size / 4).max(1));
        let s = Call {
            desc,
            exchange: true,
        }
        .timed(b, sweep)
        .await?;
        let message = desc.count * 4;
        let pieces = message.div_ceil(sweep.slot_bytes.max(1)).max(1) as u32;
        say(format!(
            "exchange of {} per peer over {n} GPUs ({pieces} piece(s)): {:.2} µs",
            size_text(message as f64),
            s * 1e6
        ));
        exchanges.push(ExchangeSample {
            message_bytes: message as f64,
            pieces,
            seconds: s,
        });
    }
    Ok(exchanges)
}

/// The gaps between small kernels (`elems` elements copied): alternating between the
/// compute and the reduce stream, each waiting on an event recorded after the other's,
/// and back to back on the compute stream; seconds, means over the timed ones. A spin
/// first keeps the device behind the host, so every gap is the device's own.
async fn event_gap<B: Backend>(
    b: &B,
    elems: usize,
    warmup: u32,
    iters: u32,
) -> Result<(f64, f64), Error> {
    let ranks = b.local_ranks();
    let me = ranks[0];
    let total = warmup + iters;
    let bufs = alloc_all(b, |_| vec![Some(elems), Some(elems)])?;
    b.take_timings();
    let mut ends = Vec::new();
    for &r in &ranks {
        let v = of::<B>(&bufs, r)?;
        let (src, dst) = (buf::<B>(v, 0)?, buf::<B>(v, 1)?);
        let add = || Kernel::Add {
            dst: dst.clone(),
            src: src.clone(),
            accumulate: false,
        };
        let micros = 2_000u32.max(150 * total);
        b.launch(r, Stream::Compute, tag(0, "spin"), Kernel::Spin { micros });
        for k in 0..total {
            b.launch(r, Stream::Compute, tag(k, "gap_a"), add());
            let ev = b.event(r);
            b.record(r, Stream::Compute, &ev);
            b.wait(r, Stream::Reduce, &ev);
            b.launch(r, Stream::Reduce, tag(k, "gap_b"), add());
            let ev = b.event(r);
            b.record(r, Stream::Reduce, &ev);
            b.wait(r, Stream::Compute, &ev);
        }
        // One more than the others: `iters` gaps after the warm-up ones.
        for k in 0..=total {
            b.launch(r, Stream::Compute, tag(k, "gap_s"), add());
        }
        for s in [Stream::Compute, Stream::Reduce] {
            let ev = b.event(r);
            b.record(r, s, &ev);
            ends.push(ev);
        }
    }
    drain(b, &ends, "event gaps").await?;
    let timings = b.take_timings();
    let mine = |name: &str| interference::intervals(&timings, me, name);
    let (a, c, s) = (mine("gap_a"), mine("gap_b"), mine("gap_s"));
    let from = warmup as usize;
    let mut cross = Vec::new();
    for k in from..a.len().min(c.len()) {
        cross.push(c[k].0 - a[k].1);
        if let Some(next) = a.get(k + 1) {
            cross.push(next.0 - c[k].1);
        }
    }
    let same: Vec<f64> = (from + 1..s.len()).map(|k| s[k].0 - s[k - 1].1).collect();
    Ok((mean(&cross, "event gaps")?, mean(&same, "kernel gaps")?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use overlap_ops::cpu::{CpuBackend, CpuBuffer};

    /// A calibration of small sizes on the CPU backend.
    fn small(world: u32) -> Sweep {
        let mesh = Mesh::new(world, 1).unwrap();
        Sweep {
            world,
            sizes: vec![4096, 16384],
            warmup: 1,
            iters: 2,
            bench: BenchArgs {
                layers: 2,
                grad_mib: 1,
                gemms: 1,
                d: 16,
                iters: 2,
                warmup: 1,
                ..BenchArgs::new(mesh)
            },
            interference: InterferenceArgs {
                layers: 2,
                gemms: 1,
                d: 16,
                grad_mib: 1,
                pieces: 1,
                combine_ctas: None,
                iters: 1,
                warmup: 0,
            },
            pieces: vec![1, 2],
            // Long enough that the kernels run beside the GEMMs even when the test
            // machine is loaded and one rank's threads start late.
            beside: BesideArgs {
                layers: 8,
                gemms: 1,
                d: 128,
                ops: 3,
                warmup: 0,
                iters: 1,
            },
            beside_bytes: 1024,
            muon: (8, 12),
            slot_bytes: 8192,
            event_elems: 64,
        }
    }

    fn env(world: u32) -> Environment {
        Environment {
            gpu: "cpu".into(),
            driver: "none".into(),
            nccl: "none".into(),
            date: "1970-01-01".into(),
            command: "test".into(),
            world,
            warmup: 1,
            iters: 2,
        }
    }

    /// The CPU backend has no copy engines: a whole-buffer pack stands in.
    fn pack_copy(
        backend: &CpuBackend,
    ) -> impl Fn(u32, Stream, Tag, &CpuBuffer, &CpuBuffer) -> Result<(), Error> + '_ {
        move |rank, stream, tag, dst, src| {
            let seg = overlap_graph::CopySeg {
                param: 0,
                src: 0,
                dst: 0,
                len: backend.len(src) as u64,
            };
            let segs = std::sync::Arc::from(vec![(seg, vec![src.clone()])]);
            let dst = dst.clone();
            backend.launch(rank, stream, tag, Kernel::Pack { dst, segs });
            Ok(())
        }
    }

    async fn run(world: u32) -> Measurements {
        let backend = Arc::new(CpuBackend::new(Mesh::new(world, 1).unwrap()));
        let copy = pack_copy(&backend);
        let hooks = Hooks {
            engine_copy: &copy,
            streaming: &|_| {},
        };
        let lines = std::sync::Mutex::new(Vec::new());
        let say = |l: String| lines.lock().unwrap().push(l);
        let m = measure(backend.clone(), &small(world), env(world), &hooks, &say)
            .await
            .unwrap();
        let lines = lines.into_inner().unwrap();
        for name in [
            "bench",
            "combine",
            "copy kernel",
            "copy-engine copy",
            "Muon",
            "event wait",
        ] {
            assert!(
                lines
                    .iter()
                    .any(|l| l.starts_with(name) || l.contains(name)),
                "{name}: {lines:?}"
            );
        }
        m
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_event_gaps_need_no_warm_up_and_one_timed_round() {
        let backend = CpuBackend::new(Mesh::new(1, 1).unwrap());
        backend.set_timings(true);
        let (cross, same) = event_gap(&backend, 16, 0, 1).await.unwrap();
        assert!(cross.is_finite() && same.is_finite(), "{cross} {same}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_measurement_runs_on_one_rank_of_the_cpu_backend() {
        let m = run(1).await;
        assert!(m.cross.is_none());
        assert_eq!(m.combine.1.len(), 2);
        assert_eq!((m.elementwise.len(), m.local_copy.len()), (2, 2));
        assert_eq!(m.elementwise[1].bytes, 2.0 * 16384.0);
        assert_eq!((m.muon.0, m.muon.1), (8, 12));
        assert!(m.gemm.3 > 0.0 && m.muon.2 > 0.0 && m.host_us_per_node > 0.0);
        for p in [&m.combine_beside, &m.local_copy_beside] {
            assert!(
                p.times.op_alone_s > 0.0 && p.times.gemms_alone_s > 0.0,
                "{p:?}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_cross_gpu_measurements_run_on_two_ranks_of_the_cpu_backend() {
        let m = run(2).await;
        let c = m.cross.expect("two ranks measure across them");
        assert_eq!(c.collectives.len(), 5 * 2);
        for kind in KINDS {
            let sizes: Vec<f64> = c
                .collectives
                .iter()
                .filter(|s| s.kind == kind)
                .map(|s| s.bytes)
                .collect();
            // nccl-tests' size: the whole buffer, whatever the kind.
            assert_eq!(sizes, vec![4096.0, 16384.0], "{kind:?}");
        }
        assert_eq!(
            c.exchanges
                .iter()
                .map(|e| (e.message_bytes, e.pieces))
                .collect::<Vec<_>>(),
            vec![(4096.0, 1), (16384.0, 2)]
        );
        assert!(c.exchanges.iter().all(|e| e.seconds > 0.0));
        assert!(c.nccl.times.op_alone_s > 0.0 && c.exchange.0.times.op_alone_s > 0.0);
        assert_eq!(c.exchange.1, 512.0);
    }
}
