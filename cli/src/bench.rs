//! `overlap bench`: the anchor workload of `docs/performance.md`, run through the executor's graph.
//!
//! The workload is `anchors/torch_reduce_overlap.py`'s: `L` layers of synthetic backward
//! (`gemms` GEMMs of `d × d · d × d` per layer on the compute stream, a
//! [`overlap_ops::Kernel::Gemm`]), one f32 gradient of `grad_mib` MiB per layer with route `fsdp`,
//! one bucket per layer, every micro-batch gate `on`: a reduce-scatter on mesh `2x1`
//! (then Stage 2 over a replicate group of one, a device copy) or an all-reduce on mesh
//! `1x2` (after Stage 1 over a shard group of one). Gradients are device buffers handed
//! in with [`Executor::grad_ready_bound`] (no upload), and the step's plan is the prefix
//! plan of the one micro-batch, so the optimizer tail is not part of what is timed: the
//! anchor measures the backward and the reduction only.
//!
//! Four variants, each timed over `iters` steps after `warmup` steps, by the device span
//! of a step (first kernel start to last kernel end, from the backend's timing events);
//! the variants take turns step by step, so a drift of the GPU's clocks over the run
//! (sustained GEMMs heat it: 8.3 to 9.5 ms for the same step within one run) weighs on
//! each alike:
//!
//! - `compute_only`: the GEMMs alone, launched on the compute stream;
//! - `comm_only`: the plan with no backward (markers): pack, collectives, unpack;
//! - `serial`: the plan with every node kind bound to the compute stream, so each
//!   layer's GEMMs and its reduction run strictly one after the other;
//! - `overlap`: the plan as the executor runs it (FSDP2's default binding).
//!
//! Then `ideal = max(compute, comm) + comm / L` and `η = (serial − overlap) / (serial −
//! ideal)` ([`ideal_ms`], [`eta`]), as `docs/performance.md` defines them.
//!
//! Invariant: every variant runs the same kernels with the same sizes on the same
//! backend; only the stream bindings and the backward model differ.

use std::sync::Arc;

use overlap_executor::{Backward, ExecConfig, Executor, StepStats};
use overlap_graph::{
    Bindings, Collective, Gate, Mode, ParamSpec, Plan, PlanSpec, Planner, Route, Schedule, Stream,
    Transport, Validated,
};
use overlap_ops::{Backend, Kernel, Tag, Timing};
use serde::Serialize;

use overlap::{Error, Mesh};

/// What `overlap bench` runs; also its command-line flags (`--layers`, `--grad-mib`, ...,
/// each with the default [`BenchArgs::new`] takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::Args)]
pub struct BenchArgs {
    /// `2x1` (reduce-scatter) or `1x2` (all-reduce), or any mesh for tests.
    #[serde(serialize_with = "mesh_str")]
    #[arg(long, default_value = "2x1", value_parser = mesh_arg)]
    pub mesh: Mesh,
    /// Layers `L`.
    #[arg(long, default_value_t = 16)]
    pub layers: u32,
    /// Gradient per layer, MiB of f32.
    #[arg(long, default_value_t = 64)]
    pub grad_mib: u32,
    /// bf16 GEMMs of `d³` per layer (the synthetic backward).
    #[arg(long, default_value_t = 3)]
    pub gemms: u32,
    /// GEMM size `d` (each is `d × d · d × d`).
    #[arg(long, default_value_t = 4096)]
    pub d: u32,
    /// Timed steps per variant.
    #[arg(long, default_value_t = 10)]
    pub iters: u32,
    /// Untimed steps per variant before them.
    #[arg(long, default_value_t = 3)]
    pub warmup: u32,
    /// Stage-1 buffers in flight per rank (backpressure, `[overlap] stage1_window`).
    #[arg(long, default_value_t = 8)]
    pub window: u32,
    /// Run every copy: no buffer aliasing in the executor (for comparison).
    #[arg(long)]
    pub no_alias: bool,
    /// How a stage over the group of two moves its bytes: `nccl` (one collective) or
    /// `copy` (copy engines over NVLink, then a combine kernel).
    #[serde(serialize_with = "transport_str")]
    #[arg(long, default_value = "nccl", value_parser = transport_arg)]
    pub transport: Transport,
    /// Copy transport: layers each combine is issued behind its exchange (`[overlap]
    /// combine_lag`).
    #[arg(long, default_value_t = 1)]
    pub combine_lag: u32,
    /// Copy transport: issue lagging all-reduce chains after the last layer's exchange
    /// like every other layer's (for comparison; by default they go out before it, so
    /// their gathers do not wait for the last backward: `Schedule::early_tail_gathers`).
    #[arg(long)]
    pub no_early_tail_gathers: bool,
    /// Copy transport: each combine waits for the exchanges issued before it, so it
    /// never runs beside one (`Schedule::combine_after_exchanges`; a lever).
    #[arg(long)]
    pub combine_after_exchanges: bool,
    /// Copy transport: the stream combines run on (`[streams] combine`).
    #[arg(long, default_value = "reduce", value_parser = Stream::parse)]
    pub combine_stream: Stream,
    /// Copy transport: the stream exchanges run on (`[streams] exchange`).
    #[arg(long, default_value = "copy", value_parser = Stream::parse)]
    pub exchange_stream: Stream,
    /// The stream packs run on (`[streams] pack`; FSDP2's: reduce).
    #[arg(long, default_value = "reduce", value_parser = Stream::parse)]
    pub pack_stream: Stream,
    /// Copy transport: receive-ring slot size, MiB (`[overlap] copy_slot_mib`).
    #[arg(long, default_value_t = 32)]
    pub copy_slot_mib: u32,
    /// Each layer's gradient as this many parameters of equal size, one bucket each:
    /// smaller collectives, interleaved with the backward (the last layer's combine
    /// then overlaps its later buckets' exchanges). In place on the copy transport
    /// with `--combine-lag 1` needs `--copy-ring-depth` of about twice this (with lag 0
    /// every combine follows its exchange, and the default depth does).
    #[arg(long, default_value_t = 1)]
    pub buckets_per_layer: u32,
    /// Copy transport: receive-ring slots per peer (`[overlap] copy_ring_depth`).
    #[arg(long, default_value_t = 2)]
    pub copy_ring_depth: u32,
    /// At most this many CTAs (SMs) per NCCL collective (default: NCCL's choice).
    #[arg(long)]
    pub nccl_max_ctas: Option<u32>,
    /// Copy transport: at most this many CTAs per combine kernel (default: the whole
    /// GPU; measured, not kept: no config key).
    #[arg(long)]
    pub combine_ctas: Option<u32>,
    /// Copy transport: `streaming` (default) combines load and store with
    /// cache-streaming hints, sparing the GEMMs' L2; `normal` without (for comparison).
    #[arg(long, value_enum, default_value_t = CombineCache::Streaming)]
    pub combine_cache: CombineCache,
    /// Every stream at the same priority (by default the reduce stream is high).
    #[arg(long)]
    pub uniform_priority: bool,
    /// Keep the last timed `overlap` step's timeline (set by `overlap bench
    /// --timeline FILE`).
    #[arg(skip)]
    pub timeline: bool,
    /// Copy transport: exchanges copy what they receive out of the ring even where the
    /// combine could read it in place (for comparison).
    #[arg(long)]
    pub no_in_place: bool,
}

/// `overlap bench --combine-cache`: how the copy transport's combines use L2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CombineCache {
    /// Cache-streaming (evict-first) loads and stores: the default.
    Streaming,
    /// Plain loads and stores (for comparison).
    Normal,
}

/// `--mesh`, for clap.
fn mesh_arg(s: &str) -> Result<Mesh, String> {
    parse_mesh(s).map_err(|e| e.to_string())
}

/// `--transport`, for clap.
fn transport_arg(s: &str) -> Result<Transport, String> {
    [Transport::Nccl, Transport::Copy]
        .into_iter()
        .find(|t| t.name() == s)
        .ok_or_else(|| format!("`{s}` is not a transport: nccl or copy"))
}

fn transport_str<S: serde::Serializer>(t: &Transport, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(t.name())
}

fn mesh_str<S: serde::Serializer>(m: &Mesh, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&m.to_string())
}

/// Parses a mesh written `SxR` (`2x1`, `1x2`), for `--mesh`.
pub fn parse_mesh(s: &str) -> Result<Mesh, Error> {
    s.parse::<Mesh>().map_err(|e| {
        Error::Usage(format!(
            "--mesh {}",
            e.to_string().replacen("mesh: ", ": ", 1)
        ))
    })
}

impl BenchArgs {
    /// The workload of `docs/performance.md` on `mesh` with `overlap bench`'s defaults (the flags'):
    /// 16 layers of 64 MiB behind 3 GEMMs of 4096³, 10 steps after 3, NCCL collectives
    /// (the copy transport's knobs at the config's defaults).
    pub fn new(mesh: Mesh) -> BenchArgs {
        use clap::{Args, FromArgMatches};
        let cmd = BenchArgs::augment_args(clap::Command::new("bench"));
        let defaults = BenchArgs::from_arg_matches(&cmd.get_matches_from(["bench"]))
            .expect("every flag of BenchArgs has a default");
        BenchArgs { mesh, ..defaults }
    }

    /// Checks the sizes and knobs: at least one layer and one timed step, a gradient of
    /// 1 to 4096 MiB that `--buckets-per-layer` divides, and the config's bounds on the
    /// copy transport's and NCCL's knobs. (Any gradient splits over the shard group: the
    /// planner pads its chunks.)
    pub fn check(&self) -> Result<(), Error> {
        if self.layers == 0 || self.iters == 0 {
            return Err(Error::Usage(
                "--layers and --iters must be at least 1".into(),
            ));
        }
        if self.grad_mib == 0 || self.grad_mib > 4096 {
            return Err(Error::Usage(format!(
                "--grad-mib {}: between 1 and 4096",
                self.grad_mib
            )));
        }
        let k = self.buckets_per_layer;
        if k == 0 || k > 64 || self.grad_elems() % u64::from(k) != 0 {
            return Err(Error::Usage(format!(
                "--buckets-per-layer {k}: between 1 and 64, dividing the gradient's {} elements",
                self.grad_elems()
            )));
        }
        // The config's bounds on the same knobs.
        use overlap::config::{MAX_COPY_RING_DEPTH, MAX_COPY_SLOT_MIB, MAX_NCCL_CTAS};
        const MAX_COMBINE_CTAS: u32 = 4096;
        if !(1..=MAX_COPY_SLOT_MIB).contains(&self.copy_slot_mib) {
            return Err(Error::Usage(format!(
                "--copy-slot-mib {}: between 1 and {MAX_COPY_SLOT_MIB}",
                self.copy_slot_mib
            )));
        }
        if !(1..=MAX_COPY_RING_DEPTH).contains(&self.copy_ring_depth) {
            return Err(Error::Usage(format!(
                "--copy-ring-depth {}: between 1 and {MAX_COPY_RING_DEPTH}",
                self.copy_ring_depth
            )));
        }
        if let Some(c) = self
            .nccl_max_ctas
            .filter(|c| !(1..=MAX_NCCL_CTAS).contains(c))
        {
            return Err(Error::Usage(format!(
                "--nccl-max-ctas {c}: between 1 and {MAX_NCCL_CTAS}"
            )));
        }
        if let Some(c) = self
            .combine_ctas
            .filter(|c| !(1..=MAX_COMBINE_CTAS).contains(c))
        {
            return Err(Error::Usage(format!(
                "--combine-ctas {c}: between 1 and {MAX_COMBINE_CTAS}"
            )));
        }
        Ok(())
    }

    /// Elements of one layer's gradient.
    pub fn grad_elems(&self) -> u64 {
        u64::from(self.grad_mib) << 18
    }

    /// Elements of one parameter (`grad_elems / buckets_per_layer`).
    pub fn param_elems(&self) -> u64 {
        self.grad_elems() / u64::from(self.buckets_per_layer.max(1))
    }

    /// The plan spec: `buckets_per_layer` `fsdp` parameters per layer (`layer{l}.grad`,
    /// or `layer{l}.grad{k}`, vectors of `grad_mib / buckets_per_layer` MiB), one bucket
    /// each, f32 `avg`, with `bindings`.
    pub fn spec(&self, bindings: Bindings) -> PlanSpec {
        let k = self.buckets_per_layer.max(1);
        PlanSpec::new(
            self.mesh,
            (0..self.layers)
                .flat_map(|l| {
                    (0..k).map(move |j| {
                        ParamSpec::new(
                            if k == 1 {
                                format!("layer{l}.grad")
                            } else {
                                format!("layer{l}.grad{j}")
                            },
                            vec![self.param_elems()],
                            Route::Fsdp,
                            l,
                        )
                    })
                })
                .collect(),
        )
        .with_bucket_cap_bytes(self.param_elems() * 4)
        .with_bindings(if bindings == serial_bindings() {
            bindings
        } else {
            bindings
                .with_combine(self.combine_stream)
                .with_exchange(self.exchange_stream)
                .with_pack(self.pack_stream)
        })
        .with_schedule(
            Schedule::default()
                .with_transport(self.transport)
                .with_combine_lag(self.combine_lag)
                .with_early_tail_gathers(!self.no_early_tail_gathers)
                .with_combine_after_exchanges(self.combine_after_exchanges),
        )
    }
}

/// Every node kind bound to the compute stream: the `serial` variant (each layer's
/// backward, then its reduction, strictly in order on one stream).
pub fn serial_bindings() -> Bindings {
    Bindings::all_on(Stream::Compute)
}

/// The validated plan of one gate-`on` micro-batch without the optimizer tail.
pub fn bench_plan(args: &BenchArgs, bindings: Bindings) -> Result<Validated, Error> {
    let planner = Planner::new(args.spec(bindings))?;
    Ok(planner.plan_checked(&[Gate::On], Mode::Prefix)?)
}

/// `ideal = max(compute, comm) + comm / L` (`docs/performance.md`: the last layer's reduction
/// cannot hide).
pub fn ideal_ms(compute: f64, comm: f64, layers: u32) -> f64 {
    compute.max(comm) + comm / f64::from(layers.max(1))
}

/// `η = (serial − actual) / (serial − ideal)`; `None` when serial is not above ideal
/// (nothing to hide).
pub fn eta(serial: f64, actual: f64, ideal: f64) -> Option<f64> {
    (serial > ideal).then(|| (serial - actual) / (serial - ideal))
}

/// What `overlap bench` measures of a workload, and `overlap simulate` predicts: each
/// variant's step span in milliseconds, the ideal and η ([`ideal_ms`], [`eta`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepFigures {
    /// The backward alone.
    pub compute_only_ms: f64,
    /// The reduction path alone (pack, collectives, unpack).
    pub comm_only_ms: f64,
    /// Backward then reduction per layer, on one stream.
    pub serial_ms: f64,
    /// The executor's plan.
    pub overlap_ms: f64,
    /// `max(compute, comm) + comm / L`.
    pub ideal_ms: f64,
    /// `(serial − overlap) / (serial − ideal)` (null when undefined).
    pub eta: Option<f64>,
}

impl StepFigures {
    /// The figures of the four variants' spans over `layers` layers.
    pub fn new(compute: f64, comm: f64, serial: f64, overlap: f64, layers: u32) -> StepFigures {
        let ideal = ideal_ms(compute, comm, layers);
        StepFigures {
            compute_only_ms: compute,
            comm_only_ms: comm,
            serial_ms: serial,
            overlap_ms: overlap,
            ideal_ms: ideal,
            eta: eta(serial, overlap, ideal),
        }
    }
}

/// The figures' line of the text outputs.
impl std::fmt::Display for StepFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let eta = self.eta.map_or_else(|| "n/a".into(), |e| format!("{e:.2}"));
        write!(
            f,
            "compute_only {:.3} ms  comm_only {:.3} ms  serial {:.3} ms  overlap {:.3} ms  ideal {:.3} ms  eta {eta}",
            self.compute_only_ms, self.comm_only_ms, self.serial_ms, self.overlap_ms, self.ideal_ms
        )
    }
}

/// One rank's figures, milliseconds per step (mean over the timed steps).
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// The workload.
    #[serde(flatten)]
    pub args: BenchArgs,
    /// The rank these figures are from.
    pub rank: u32,
    /// Backend name.
    pub backend: String,
    /// The four variants' spans, the ideal and η.
    #[serde(flatten)]
    pub figures: StepFigures,
    /// Host time issuing the overlap plan's nodes, µs per node (StepStats).
    pub host_us_per_node: f64,
    /// The same with kernel timings off (`Backend::set_timings`), µs per node.
    pub host_us_per_node_untimed: f64,
    /// Host time per node of the `comm_only` variant, whose `grad_ready` nodes launch
    /// markers instead of the trainer's GEMMs: what issuing costs `overlap` itself.
    pub host_us_per_node_comm_only: f64,
    /// Host µs per node by node kind in the `overlap` variant (`grad_ready` includes
    /// launching the trainer's GEMMs).
    pub host_us_by_kind: std::collections::BTreeMap<String, f64>,
    /// The same in the `comm_only` variant.
    pub host_us_by_kind_comm_only: std::collections::BTreeMap<String, f64>,
    /// Of `host_us_by_kind`, the µs per node spent inside the backend's launch (its
    /// checks and driver calls; StepStats::launch_by_kind); the rest is the executor's.
    pub host_us_in_backend_by_kind: std::collections::BTreeMap<String, f64>,
    /// The same in the `comm_only` variant.
    pub host_us_in_backend_by_kind_comm_only: std::collections::BTreeMap<String, f64>,
    /// `host_us_per_node_comm_only` with kernel timings off: what issuing costs
    /// `overlap` itself, without the profiling events (issue 5's host figure).
    pub host_us_per_node_comm_only_untimed: f64,
    /// The same by node kind.
    pub host_us_by_kind_comm_only_untimed: std::collections::BTreeMap<String, f64>,
    /// Of that, inside the backend's launch.
    pub host_us_in_backend_by_kind_comm_only_untimed: std::collections::BTreeMap<String, f64>,
    /// Nodes per step on this rank (overlap variant).
    pub nodes_per_step: usize,
    /// Mean kernel time of the plan's collective nodes in `comm_only`, ms per layer.
    pub collective_ms_per_layer: f64,
    /// Mean kernel time of the other reduction nodes in `comm_only` (packs, unpacks, a
    /// group-of-one copy; with the copy transport, the combines), ms per layer: the
    /// work beside the collective or exchange.
    pub copies_ms_per_layer: f64,
    /// Every variant's per-step spans, ms, in order (for spread).
    pub steps_ms: VariantSteps,
    /// With [`BenchArgs::timeline`]: the last timed `overlap` step of this rank as an
    /// SVG timeline (one lane per stream), and its kernels as JSON lines.
    #[serde(skip)]
    pub timeline_svg: Option<String>,
    /// The same step's kernels, one JSON object per line: stream, op, node, start and
    /// end in µs from the step's first kernel.
    #[serde(skip)]
    pub timeline_json: Option<String>,
}

/// Per-step device spans of each variant, ms.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VariantSteps {
    /// compute_only
    pub compute_only: Vec<f64>,
    /// comm_only
    pub comm_only: Vec<f64>,
    /// serial
    pub serial: Vec<f64>,
    /// overlap
    pub overlap: Vec<f64>,
}

/// The device span of a set of kernel timings, seconds (last end − first start).
pub fn span(timings: &[Timing]) -> f64 {
    overlap_sim::simulate::span_of(timings.iter().map(|t| (t.start, t.end)))
}

fn ops(e: overlap_ops::OpsError) -> Error {
    Error::Backend(e.to_string())
}

fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        0.0
    } else {
        x.iter().sum::<f64>() / x.len() as f64
    }
}

/// Runs the four variants on `backend` (its one local rank, or every rank of a CPU
/// backend: figures are then rank `ranks[0]`'s) and returns the figures. The backend
/// must record kernel timings.
// Called only by `crate::cuda`, which a build without CUDA replaces by `cuda_stub.rs`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub async fn run<B: Backend>(backend: Arc<B>, args: &BenchArgs) -> Result<BenchReport, Error> {
    args.check()?;
    let ranks = backend.local_ranks();
    let me = *ranks
        .first()
        .ok_or_else(|| Error::Backend("the backend drives no rank".into()))?;
    let overlap_plan = bench_plan(args, Bindings::default())?;
    let serial_plan = bench_plan(args, serial_bindings())?;
    let grads = alloc_grads(&*backend, &ranks, args)?;
    let mut tally = Tally::default();
    let plans = [&overlap_plan, &serial_plan];
    timed_steps(&backend, &ranks, me, args, plans, &grads, &mut tally).await?;
    untimed_steps(&backend, args, &overlap_plan, &grads, &mut tally).await?;
    Ok(tally.report(backend.name(), args, &ranks, me, &overlap_plan))
}

/// Per local rank, its gradient buffers by parameter.
type Grads<B> = Vec<(u32, Vec<<B as Backend>::Buffer>)>;

/// The gradients: one device buffer per (rank, parameter), handed in by reference.
fn alloc_grads<B: Backend>(
    backend: &B,
    ranks: &[u32],
    args: &BenchArgs,
) -> Result<Grads<B>, Error> {
    let n = args.param_elems() as usize;
    let mut grads = Vec::new();
    for &r in ranks {
        let mut row = Vec::new();
        for _ in 0..args.layers * args.buckets_per_layer.max(1) {
            row.push(backend.alloc(r, n).map_err(ops)?);
        }
        grads.push((r, row));
    }
    Ok(grads)
}

/// The trainer's backward of the `serial` and `overlap` variants: each layer's GEMMs.
fn gemms_backward(args: &BenchArgs) -> Backward {
    Backward::Gemms {
        count: args.gemms,
        d: args.d,
    }
}

/// The executor's settings of every variant, with `backward` as the trainer's.
fn exec_config(args: &BenchArgs, backward: Backward) -> ExecConfig {
    ExecConfig::default()
        .with_backward(backward)
        .with_stage1_window(args.window.max(1) as usize)
        .with_aliasing(!args.no_alias)
}

/// Runs the warm-up and timed steps of every variant and adds the timed ones to
/// `tally`; `plans` are the overlap and the serial plan, `me` the rank whose spans count.
async fn timed_steps<B: Backend>(
    backend: &Arc<B>,
    ranks: &[u32],
    me: u32,
    args: &BenchArgs,
    plans: [&Validated; 2],
    grads: &[(u32, Vec<B::Buffer>)],
    tally: &mut Tally,
) -> Result<(), Error> {
    let gemms = gemms_backward(args);
    // The variants take turns, one step each, so that a drift of the GPU's clocks over
    // the run (sustained GEMMs heat it) weighs on every variant alike.
    let variants = [
        ("comm_only", plans[0], Backward::None),
        ("serial", plans[1], gemms),
        ("overlap", plans[0], gemms),
    ];
    let mut executors: Vec<Executor<B>> = variants
        .iter()
        .map(|&(_, _, backward)| Executor::new(backend.clone(), exec_config(args, backward)))
        .collect();
    for i in 0..(args.warmup + args.iters) as usize {
        let timed = i >= args.warmup as usize;
        // compute_only: the backward's kernels alone.
        let t = gemms_only(&**backend, ranks, args, gemms).await?;
        if timed {
            tally.steps.compute_only.push(span_of(&t, me) * 1e3);
        }
        for ((variant, plan, _), ex) in variants.iter().zip(&mut executors) {
            let stats = plan_step(ex, plan, grads).await?;
            if !timed {
                continue;
            }
            let ms = span_of(&stats.timings, me) * 1e3;
            match *variant {
                "comm_only" => tally.comm_only(ms, &stats, plan, me),
                "serial" => tally.steps.serial.push(ms),
                _ => tally.overlap(ms, stats, args.timeline),
            }
        }
    }
    Ok(())
}

/// The host cost without timing events (two event records per kernel on the CUDA
/// backend): the overlap plan again, then comm_only, `iters` steps each, timings off.
async fn untimed_steps<B: Backend>(
    backend: &Arc<B>,
    args: &BenchArgs,
    overlap_plan: &Validated,
    grads: &[(u32, Vec<B::Buffer>)],
    tally: &mut Tally,
) -> Result<(), Error> {
    backend.set_timings(false);
    for (v, backward) in [gemms_backward(args), Backward::None]
        .into_iter()
        .enumerate()
    {
        let mut ex = Executor::new(backend.clone(), exec_config(args, backward));
        for _ in 0..args.iters {
            let stats = plan_step(&mut ex, overlap_plan, grads).await;
            let stats = match stats {
                Ok(s) => s,
                Err(e) => {
                    backend.set_timings(true);
                    return Err(e);
                }
            };
            tally.untimed[v].0 += stats.issue_seconds;
            tally.untimed[v].1 += stats.nodes;
            if v == 1 {
                tally.add_kinds(2, &stats);
            }
        }
    }
    backend.set_timings(true);
    Ok(())
}

/// What the bench's steps add up to, before the means of [`BenchReport`].
#[derive(Default)]
struct Tally {
    /// Every variant's per-step spans, ms.
    steps: VariantSteps,
    /// `comm_only`'s kernel seconds on the first rank (transfers over groups of two or
    /// more, the other reduction kernels) and its steps.
    comm_kernels: (f64, f64, usize),
    /// The `overlap` variant's host seconds issuing, and its nodes.
    host: (f64, usize),
    /// The same of `comm_only`.
    comm_host: (f64, usize),
    /// Per variant (overlap, comm_only, comm_only untimed): by kind, (seconds, nodes,
    /// seconds in the backend).
    by_kind: [std::collections::BTreeMap<String, (f64, usize, f64)>; 3],
    /// Host seconds and nodes with timings off: overlap, comm_only.
    untimed: [(f64, usize); 2],
    /// The last timed `overlap` step, kept for the timeline.
    last_overlap: Option<StepStats>,
}

impl Tally {
    /// Adds a step's host time by node kind to variant `i`'s of [`Tally::by_kind`].
    fn add_kinds(&mut self, i: usize, stats: &StepStats) {
        for (&(kind, secs, n), &(_, inside)) in
            stats.issue_by_kind.iter().zip(&stats.launch_by_kind)
        {
            let e = self.by_kind[i]
                .entry(kind.to_string())
                .or_insert((0.0, 0, 0.0));
            e.0 += secs;
            e.1 += n;
            e.2 += inside;
        }
    }

    /// Adds a timed `comm_only` step of `plan` (span `ms`) with rank `me`'s kernels.
    fn comm_only(&mut self, ms: f64, stats: &StepStats, plan: &Plan, me: u32) {
        self.steps.comm_only.push(ms);
        self.comm_host.0 += stats.issue_seconds;
        self.comm_host.1 += stats.nodes;
        self.add_kinds(1, stats);
        for t in stats.timings.iter().filter(|t| t.rank == me) {
            let d = t.end - t.start;
            if t.bytes > 0 && is_wide(plan, t) {
                self.comm_kernels.0 += d;
            } else if t.tag.op != "grad_ready" {
                self.comm_kernels.1 += d;
            }
        }
        self.comm_kernels.2 += 1;
    }

    /// Adds a timed `overlap` step (span `ms`), kept when a timeline is asked for.
    fn overlap(&mut self, ms: f64, stats: StepStats, timeline: bool) {
        self.steps.overlap.push(ms);
        self.host.0 += stats.issue_seconds;
        self.host.1 += stats.nodes;
        self.add_kinds(0, &stats);
        if timeline {
            self.last_overlap = Some(stats);
        }
    }

    /// The report of rank `me`'s figures (of `ranks`, the local ranks), the timeline
    /// drawn from `overlap_plan`.
    fn report(
        self,
        backend: &str,
        args: &BenchArgs,
        ranks: &[u32],
        me: u32,
        overlap_plan: &Plan,
    ) -> BenchReport {
        let (host, comm_host, comm_kernels) = (self.host, self.comm_host, self.comm_kernels);
        let (by_kind, untimed) = (&self.by_kind, self.untimed);
        let per_node_of = |(secs, n): (f64, usize)| {
            if n > 0 {
                secs * 1e6 / n as f64
            } else {
                0.0
            }
        };
        let steps = self.steps;
        let compute = mean(&steps.compute_only);
        let comm = mean(&steps.comm_only);
        let serial = mean(&steps.serial);
        let overlap = mean(&steps.overlap);
        let per_layer = |s: f64| s * 1e3 / (comm_kernels.2.max(1) as f64 * f64::from(args.layers));
        BenchReport {
            args: *args,
            rank: me,
            backend: backend.into(),
            figures: StepFigures::new(compute, comm, serial, overlap, args.layers),
            host_us_per_node: if host.1 > 0 {
                host.0 * 1e6 / host.1 as f64
            } else {
                0.0
            },
            host_us_per_node_untimed: per_node_of(untimed[0]),
            host_us_per_node_comm_only_untimed: per_node_of(untimed[1]),
            host_us_by_kind_comm_only_untimed: per_node(&by_kind[2], |k| k.0),
            host_us_in_backend_by_kind_comm_only_untimed: per_node(&by_kind[2], |k| k.2),
            host_us_by_kind: per_node(&by_kind[0], |k| k.0),
            host_us_by_kind_comm_only: per_node(&by_kind[1], |k| k.0),
            host_us_in_backend_by_kind: per_node(&by_kind[0], |k| k.2),
            host_us_in_backend_by_kind_comm_only: per_node(&by_kind[1], |k| k.2),
            host_us_per_node_comm_only: if comm_host.1 > 0 {
                comm_host.0 * 1e6 / comm_host.1 as f64
            } else {
                0.0
            },
            nodes_per_step: host.1 / (args.iters as usize * ranks.len()).max(1),
            collective_ms_per_layer: per_layer(comm_kernels.0),
            copies_ms_per_layer: per_layer(comm_kernels.1),
            steps_ms: steps,
            timeline_svg: self
                .last_overlap
                .as_ref()
                .map(|st| timeline_svg(overlap_plan, me, st)),
            timeline_json: self
                .last_overlap
                .as_ref()
                .map(|st| timeline_json(overlap_plan, me, st)),
        }
    }
}

/// One bench step as the observe module draws a step of `overlap run` (rank `me`'s
/// lanes).
fn timeline_svg(plan: &Plan, me: u32, stats: &StepStats) -> String {
    let mut stats = stats.clone();
    stats.timings.retain(|t| t.rank == me);
    let report = overlap::session::StepReport::of_stats(plan.gates.clone(), stats);
    let analysis = overlap::observe::StepAnalysis::new(&report, plan);
    overlap::observe::svg::render(&report, plan, &analysis)
}

/// Rank `me`'s kernels of one step, one JSON object per line, times in µs from the
/// step's first kernel.
fn timeline_json(plan: &Plan, me: u32, stats: &StepStats) -> String {
    let mine: Vec<&Timing> = stats.timings.iter().filter(|t| t.rank == me).collect();
    let t0 = mine.iter().map(|t| t.start).fold(f64::INFINITY, f64::min);
    let mut out = String::new();
    for t in mine {
        let label = plan
            .ranks
            .get(me as usize)
            .and_then(|rp| rp.nodes.get(t.tag.node as usize))
            .map(|n| plan.label(n))
            .unwrap_or_default();
        let line = serde_json::json!({
            "stream": t.stream.name(),
            "op": t.tag.op,
            "node": t.tag.node,
            "label": label,
            "start_us": (t.start - t0) * 1e6,
            "end_us": (t.end - t0) * 1e6,
        });
        out.push_str(&line.to_string());
        out.push('\n');
    }
    out
}

/// Whether a timing is the transfer of a stage over a group of two or more (not a
/// group-of-one copy): its collective (Stage 1 on a mesh with shard > 1, Stage 2 with
/// replicate > 1), or with the copy transport its exchange and an all-reduce's gather.
fn is_wide(plan: &Plan, t: &Timing) -> bool {
    match t.tag.op {
        "stage1" => plan.mesh.shard > 1,
        "stage2" => plan.mesh.replicate > 1,
        "exchange" | "gather" => true,
        _ => false,
    }
}

/// Seconds and nodes by kind, as µs per node.
fn per_node(
    m: &std::collections::BTreeMap<String, (f64, usize, f64)>,
    secs: impl Fn(&(f64, usize, f64)) -> f64,
) -> std::collections::BTreeMap<String, f64> {
    m.iter()
        .map(|(k, v)| (k.clone(), secs(v) * 1e6 / v.1.max(1) as f64))
        .collect()
}

/// Waits for `ends` (one event per local rank), then fails with the first error any
/// stream reported (`what` names the work).
pub(crate) async fn drain<B: Backend>(
    backend: &B,
    ends: &[B::Event],
    what: &str,
) -> Result<(), Error> {
    for ev in ends {
        backend
            .host_wait(ev)
            .await
            .map_err(|e| Error::Backend(e.to_string()))?;
    }
    match backend.errors().first() {
        Some((_, _, _, e)) => Err(Error::Backend(format!("{what}: {e}"))),
        None => Ok(()),
    }
}

/// Issues `warmup + iters` kernels back to back on `stream` of every local rank
/// (`issue(rank, tag)`, the tags named `op` and numbered from 0), draining after the
/// warm-up ones and after the timed ones, and returns the timed kernels' durations on the
/// first local rank, in seconds and in the order they ran. The backend must record
/// kernel timings; timings left from earlier work are dropped first.
pub async fn repeat_timed<B: Backend>(
    backend: &B,
    stream: Stream,
    op: &'static str,
    warmup: u32,
    iters: u32,
    issue: impl Fn(u32, Tag) -> Result<(), Error>,
) -> Result<Vec<f64>, Error> {
    let ranks = backend.local_ranks();
    let me = *ranks
        .first()
        .ok_or_else(|| Error::Backend("the backend drives no rank".into()))?;
    backend.take_timings();
    let mut out = Vec::new();
    for (timed, count) in [(false, warmup), (true, iters)] {
        if count == 0 {
            continue;
        }
        let mut ends = Vec::new();
        for &r in &ranks {
            for node in 0..count {
                issue(
                    r,
                    Tag {
                        node,
                        op,
                        micro_batch: 0,
                    },
                )?;
            }
            let ev = backend.event(r);
            backend.record(r, stream, &ev);
            ends.push(ev);
        }
        drain(backend, &ends, op).await?;
        let timings = backend.take_timings();
        if timed {
            out = crate::interference::intervals(&timings, me, op)
                .into_iter()
                .map(|(start, end)| end - start)
                .collect();
        }
    }
    Ok(out)
}

fn span_of(timings: &[Timing], rank: u32) -> f64 {
    let mine: Vec<Timing> = timings.iter().filter(|t| t.rank == rank).copied().collect();
    span(&mine)
}

/// One step of `plan`: one gate-`on` micro-batch, every layer handed in (highest
/// first) with its device gradient, then the device drained.
pub async fn plan_step<B: Backend>(
    ex: &mut Executor<B>,
    plan: &Validated,
    grads: &[(u32, Vec<B::Buffer>)],
) -> Result<StepStats, Error> {
    ex.adopt(plan);
    for layer in plan.layers_desc() {
        ex.grad_ready_bound(0, layer, |rank, param| {
            grads
                .iter()
                .find(|(r, _)| *r == rank)
                .and_then(|(_, g)| g.get(param as usize))
                .cloned()
                .ok_or_else(|| {
                    overlap_executor::ExecError::Usage(format!(
                        "no gradient of parameter {param} on rank {rank}"
                    ))
                })
        })
        .await?;
    }
    Ok(ex.finish_step().await?)
}

/// The `compute_only` variant: each layer's backward kernel on the compute stream of
/// every local rank, then a drain; returns the kernels' timings.
async fn gemms_only<B: Backend>(
    backend: &B,
    ranks: &[u32],
    args: &BenchArgs,
    backward: Backward,
) -> Result<Vec<Timing>, Error> {
    let mut ends = Vec::new();
    for &r in ranks {
        for l in 0..args.layers {
            let tag = Tag {
                node: l,
                op: "grad_ready",
                micro_batch: 0,
            };
            backend.launch(r, Stream::Compute, tag, backward.kernel::<B::Buffer>());
        }
        let ev = backend.event(r);
        backend.record(r, Stream::Compute, &ev);
        ends.push(ev);
    }
    drain(backend, &ends, "compute_only").await?;
    Ok(backend.take_timings())
}

/// One size of `overlap bench-collectives`: the executor's collective node against the
/// same NCCL call issued directly on the same communicator.
#[derive(Debug, Clone, Serialize)]
pub struct CollectiveRow {
    /// `reduce_scatter` (mesh `2x1`) or `all_reduce` (mesh `1x2`).
    pub op: String,
    /// Bytes per rank (the gradient; nccl-tests' size).
    pub bytes: u64,
    /// Mean time of the direct call, ms (timing events around each call).
    pub nccl_ms: f64,
    /// Mean kernel time of the executor's node, ms.
    pub node_ms: f64,
    /// The executor's whole path per bucket (pack, the collectives, unpack), ms: the
    /// span of the step of back-to-back buckets over their number.
    pub path_ms: f64,
    /// Bus bandwidth of the direct call, GB/s.
    pub nccl_busbw_gbs: f64,
    /// Bus bandwidth of the executor's node, GB/s.
    pub node_busbw_gbs: f64,
    /// Bus bandwidth of the executor's whole path, GB/s.
    pub path_busbw_gbs: f64,
    /// `node_busbw / nccl_busbw`.
    pub ratio: f64,
}

/// `overlap bench-collectives` on this backend's rank: for each size (MiB), a plan of
/// `warmup + iters` layers of one `fsdp` gradient each (its wide collective:
/// reduce-scatter on `S×1`, all-reduce on `1×R`) run as one step, so its collectives are
/// issued back to back, and the same collective launched directly `warmup + iters`
/// times; the first `warmup` of each are not counted.
// Called only by `crate::cuda`, which a build without CUDA replaces by `cuda_stub.rs`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub async fn collectives<B: Backend>(
    backend: Arc<B>,
    mesh: Mesh,
    sizes_mib: &[u32],
    iters: u32,
    warmup: u32,
) -> Result<Vec<CollectiveRow>, Error> {
    let ranks = backend.local_ranks();
    let me = *ranks
        .first()
        .ok_or_else(|| Error::Backend("the backend drives no rank".into()))?;
    let mut rows = Vec::new();
    for &mib in sizes_mib {
        let args = BenchArgs {
            mesh,
            layers: 1,
            grad_mib: mib,
            gemms: 0,
            d: 0,
            iters,
            warmup,
            ..BenchArgs::new(mesh)
        };
        args.check()?;
        let plan = bench_plan(&args, Bindings::default())?;
        let (desc, stream) = wide_collective(&plan, me)?;
        let (node, path) = node_timings(&backend, &args).await?;
        let direct = direct_timings(&backend, &args, desc, stream).await?;
        rows.push(collective_row(&args, desc, (&direct, &node, &path)));
    }
    Ok(rows)
}

/// The wide collective of a bench plan on `me`'s nodes (reduce-scatter on `S×1`,
/// all-reduce on `1×R`) and the stream it runs on.
fn wide_collective(plan: &Plan, me: u32) -> Result<(Collective, Stream), Error> {
    let mesh = plan.mesh;
    plan.rank(me)
        .nodes
        .iter()
        .find_map(|n| match n.op {
            overlap_graph::Op::Stage1 { collective, .. } if mesh.shard > 1 => {
                Some((collective, n.stream))
            }
            overlap_graph::Op::Stage2 { collective, .. } if mesh.replicate > 1 => {
                Some((collective, n.stream))
            }
            _ => None,
        })
        .ok_or_else(|| Error::Usage(format!("mesh {mesh} has no group of two or more")))
}

/// The executor's wide collective node of `args`' gradient, seconds per call, and its
/// whole path per bucket: one step of `warmup + iters` layers, one bucket each, so
/// that the executor issues its collectives back to back as the direct loop of
/// [`direct_timings`] does (a step per call would time each call with the ranks' skew
/// at its start, which back-to-back calls absorb). The first `warmup` are not counted.
async fn node_timings<B: Backend>(
    backend: &Arc<B>,
    args: &BenchArgs,
) -> Result<(Vec<f64>, Vec<f64>), Error> {
    let ranks = backend.local_ranks();
    let me = ranks[0];
    let elems = args.grad_elems() as usize;
    let layered = BenchArgs {
        layers: args.warmup + args.iters,
        ..*args
    };
    let plan = bench_plan(&layered, Bindings::default())?;
    let mut grads = Vec::new();
    for &r in &ranks {
        let mut row = Vec::new();
        for _ in 0..layered.layers {
            row.push(backend.alloc(r, elems).map_err(ops)?);
        }
        grads.push((r, row));
    }
    let mut ex = Executor::new(backend.clone(), ExecConfig::default());
    // An untimed step first: pools, communicators and kernels warm.
    plan_step(&mut ex, &plan, &grads).await?;
    let stats = plan_step(&mut ex, &plan, &grads).await?;
    let mine: Vec<Timing> = stats
        .timings
        .iter()
        .filter(|t| t.rank == me)
        .copied()
        .collect();
    let mut calls: Vec<(f64, f64)> = mine
        .iter()
        .filter(|t| t.bytes > 0 && is_wide(&plan, t))
        .map(|t| (t.start, t.end - t.start))
        .collect();
    calls.sort_by(|a, b| a.0.total_cmp(&b.0));
    let node: Vec<f64> = calls
        .iter()
        .skip(args.warmup as usize)
        .map(|c| c.1)
        .collect();
    let path = vec![span(&mine) / f64::from(layered.layers)];
    Ok((node, path))
}

/// The same collective as the executor's node (`desc` on `stream`), launched directly
/// `warmup + iters` times on every local rank: seconds per counted call.
async fn direct_timings<B: Backend>(
    backend: &Arc<B>,
    args: &BenchArgs,
    desc: Collective,
    stream: Stream,
) -> Result<Vec<f64>, Error> {
    let n = args.mesh.group_size(desc.group);
    let elems = args.grad_elems() as usize;
    let recv_len = match desc.kind {
        overlap_graph::CollectiveKind::ReduceScatter => elems / n as usize,
        _ => elems,
    };
    let mut bufs = Vec::new();
    for r in backend.local_ranks() {
        bufs.push((
            r,
            backend.alloc(r, elems).map_err(ops)?,
            backend.alloc(r, recv_len).map_err(ops)?,
        ));
    }
    let comm = overlap_ops::CommId {
        group: desc.group,
        stream,
    };
    // Meshes S×1 and 1×R have one wide group, the same on every rank.
    repeat_timed(
        &**backend,
        stream,
        "nccl",
        args.warmup,
        args.iters,
        |r, tag| {
            let (_, send, recv) = bufs
                .iter()
                .find(|(x, _, _)| *x == r)
                .ok_or_else(|| Error::Backend(format!("no buffers on rank {r}")))?;
            backend.launch(
                r,
                stream,
                tag,
                Kernel::Collective {
                    desc,
                    comm,
                    send: Some(send.clone()),
                    recv: Some(recv.clone()),
                },
            );
            Ok(())
        },
    )
    .await
}

/// One row of [`collectives`] from the seconds per call of the direct collective, of
/// the executor's node and of its whole path.
fn collective_row(
    args: &BenchArgs,
    desc: Collective,
    (direct, node, path): (&[f64], &[f64], &[f64]),
) -> CollectiveRow {
    let bytes = args.grad_elems() * 4;
    let factor = overlap::observe::bus_factor(desc.kind, args.mesh.group_size(desc.group));
    let bw = |sec: f64| {
        if sec > 0.0 {
            bytes as f64 / sec / 1e9 * factor
        } else {
            0.0
        }
    };
    let (nccl_s, node_s, path_s) = (mean(direct), mean(node), mean(path));
    CollectiveRow {
        op: desc.kind.name().into(),
        bytes,
        nccl_ms: nccl_s * 1e3,
        node_ms: node_s * 1e3,
        path_ms: path_s * 1e3,
        nccl_busbw_gbs: bw(nccl_s),
        node_busbw_gbs: bw(node_s),
        path_busbw_gbs: bw(path_s),
        ratio: if nccl_s > 0.0 {
            nccl_s / node_s.max(f64::MIN_POSITIVE)
        } else {
            0.0
        },
    }
}

/// The human-readable form of a bench report.
pub fn render(r: &BenchReport) -> String {
    format!(
        "overlap bench: mesh {} ({}), {} layers, {} MiB f32 grad/layer, {} GEMMs of {}^3/layer, {} iters after {} warm-up, window {} (rank {}, backend {})\n\
         {}\n\
         host {:.2} us/node ({} nodes/step); per layer: collective {:.3} ms, executor copies {:.3} ms",
        r.args.mesh,
        if r.args.mesh.shard > 1 { "reduce-scatter" } else { "all-reduce" },
        r.args.layers,
        r.args.grad_mib,
        r.args.gemms,
        r.args.d,
        r.args.iters,
        r.args.warmup,
        r.args.window,
        r.rank,
        r.backend,
        r.figures,
        r.host_us_per_node,
        r.nodes_per_step,
        r.collective_ms_per_layer,
        r.copies_ms_per_layer,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use overlap_graph::{CollectiveKind, Op};
    use overlap_ops::cpu::CpuBackend;

    fn args(mesh: Mesh) -> BenchArgs {
        BenchArgs {
            mesh,
            layers: 3,
            grad_mib: 1,
            gemms: 2,
            d: 16,
            iters: 2,
            warmup: 1,
            ..BenchArgs::new(mesh)
        }
    }

    #[test]
    fn the_defaults_are_the_flags_defaults_and_design_section_6() {
        let mesh = Mesh::new(1, 2).unwrap();
        let a = BenchArgs::new(mesh);
        let want = BenchArgs {
            mesh,
            layers: 16,
            grad_mib: 64,
            gemms: 3,
            d: 4096,
            iters: 10,
            warmup: 3,
            window: 8,
            no_alias: false,
            transport: Transport::Nccl,
            combine_lag: 1,
            no_early_tail_gathers: false,
            combine_after_exchanges: false,
            combine_stream: Stream::Reduce,
            exchange_stream: Stream::Copy,
            pack_stream: Stream::Reduce,
            copy_slot_mib: 32,
            buckets_per_layer: 1,
            copy_ring_depth: 2,
            nccl_max_ctas: None,
            combine_ctas: None,
            combine_cache: CombineCache::Streaming,
            uniform_priority: false,
            timeline: false,
            no_in_place: false,
        };
        assert_eq!(a, want);
        let config = overlap::config::OverlapConfig::default();
        assert_eq!(config.copy_slot_mib, a.copy_slot_mib);
        assert_eq!(config.copy_ring_depth, a.copy_ring_depth);
    }

    #[test]
    fn copy_and_nccl_knobs_keep_the_configs_bounds() {
        let mesh = Mesh::new(2, 1).unwrap();
        assert!(BenchArgs::new(mesh).check().is_ok());
        let with = |f: &dyn Fn(&mut BenchArgs)| {
            let mut a = BenchArgs::new(mesh);
            f(&mut a);
            a
        };
        for bad in [
            with(&|a| a.copy_slot_mib = 0),
            with(&|a| a.copy_slot_mib = overlap::config::MAX_COPY_SLOT_MIB + 1),
            with(&|a| a.nccl_max_ctas = Some(0)),
            with(&|a| a.copy_ring_depth = 0),
            with(&|a| a.copy_ring_depth = overlap::config::MAX_COPY_RING_DEPTH + 1),
            with(&|a| a.buckets_per_layer = 0),
            with(&|a| a.buckets_per_layer = 3),
            with(&|a| a.combine_ctas = Some(4097)),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains("between 1 and"), "{e}");
        }
    }

    #[test]
    fn meshes_parse_and_bad_ones_are_named() {
        assert_eq!(parse_mesh("2x1").unwrap(), Mesh::new(2, 1).unwrap());
        assert_eq!(parse_mesh("1X2").unwrap(), Mesh::new(1, 2).unwrap());
        for bad in ["2", "2x", "ax1", "0x2"] {
            let e = parse_mesh(bad).unwrap_err().to_string();
            assert!(e.contains("--mesh"), "{bad}: {e}");
        }
    }

    #[test]
    fn ideal_and_eta_follow_design_section_6() {
        // The PyTorch anchor's published reduce-scatter row (`docs/performance.md`): compute 8.67, comm 2.70, L 16.
        let ideal = ideal_ms(8.67, 2.70, 16);
        assert!((ideal - 8.83875).abs() < 1e-9);
        let e = eta(11.57, 10.93, ideal).unwrap();
        assert!((e - 0.2343).abs() < 1e-3, "{e}");
        assert_eq!(eta(5.0, 4.0, 5.0), None);
        assert_eq!(eta(10.0, 8.0, 8.0), Some(1.0));
        assert_eq!(ideal_ms(1.0, 4.0, 4), 5.0);
        assert_eq!(
            overlap::observe::bus_factor(CollectiveKind::AllReduce, 2),
            1.0
        );
        assert_eq!(
            overlap::observe::bus_factor(CollectiveKind::ReduceScatter, 2),
            0.5
        );
    }

    #[test]
    fn variant_plans_validate_with_one_bucket_per_layer_and_no_optimizer() {
        for (mesh, wide) in [
            (Mesh::new(2, 1).unwrap(), CollectiveKind::ReduceScatter),
            (Mesh::new(1, 2).unwrap(), CollectiveKind::AllReduce),
        ] {
            let a = args(mesh);
            for bindings in [Bindings::default(), serial_bindings()] {
                let plan = bench_plan(&a, bindings).unwrap();
                assert_eq!(plan.buckets.len(), 3);
                for rp in &plan.ranks {
                    assert!(!rp
                        .nodes
                        .iter()
                        .any(|n| matches!(n.op, Op::Optimizer { .. })));
                    let kinds: Vec<_> = rp
                        .nodes
                        .iter()
                        .filter_map(|n| n.op.collective())
                        .filter(|c| mesh.group_size(c.group) > 1)
                        .map(|c| c.kind)
                        .collect();
                    assert_eq!(kinds, vec![wide; 3]);
                    if bindings == serial_bindings() {
                        assert!(rp.nodes.iter().all(|n| n.stream == Stream::Compute));
                    }
                }
            }
        }
        let mut bad = args(Mesh::new(2, 1).unwrap());
        bad.iters = 0;
        assert!(bad.check().is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bench_runs_every_variant_on_the_cpu_backend() {
        let a = args(Mesh::new(2, 1).unwrap());
        let backend = Arc::new(CpuBackend::new(a.mesh));
        let r = run(backend, &a).await.unwrap();
        assert_eq!(r.steps_ms.overlap.len(), 2);
        assert_eq!(r.steps_ms.compute_only.len(), 2);
        let f = r.figures;
        for x in [f.compute_only_ms, f.comm_only_ms, f.serial_ms, f.overlap_ms] {
            assert!(x > 0.0, "{r:?}");
        }
        assert!(r.host_us_per_node > 0.0 && r.nodes_per_step > 0);
        assert!(r.host_us_per_node_comm_only_untimed > 0.0);
        // By kind: the same kinds with and without timings, and the backend's share of
        // each kind's time is part of it.
        assert_eq!(
            r.host_us_by_kind_comm_only.keys().collect::<Vec<_>>(),
            r.host_us_by_kind_comm_only_untimed
                .keys()
                .collect::<Vec<_>>()
        );
        for (all, inside) in [
            (&r.host_us_by_kind, &r.host_us_in_backend_by_kind),
            (
                &r.host_us_by_kind_comm_only,
                &r.host_us_in_backend_by_kind_comm_only,
            ),
            (
                &r.host_us_by_kind_comm_only_untimed,
                &r.host_us_in_backend_by_kind_comm_only_untimed,
            ),
        ] {
            for (kind, us) in all {
                assert!(
                    (0.0..=*us).contains(&inside[kind]),
                    "{kind}: {inside:?} of {all:?}"
                );
            }
        }
        assert!(r.collective_ms_per_layer > 0.0);
        let json = serde_json::to_string(&r).unwrap();
        for key in [
            "compute_only_ms",
            "comm_only_ms",
            "serial_ms",
            "overlap_ms",
            "ideal_ms",
            "eta",
            "host_us_per_node",
            "\"mesh\":\"2x1\"",
        ] {
            assert!(json.contains(key), "{key}: {json}");
        }
        assert!(render(&r).contains("reduce-scatter"));
        assert!(r.timeline_svg.is_none() && r.timeline_json.is_none());
    }

    /// The kernels of a report's timeline, one JSON object each.
    fn timeline_lines(r: &BenchReport) -> Vec<serde_json::Value> {
        r.timeline_json
            .as_deref()
            .expect("json lines")
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// How many of `lines` are kernels of node kind `op`.
    fn count_op(lines: &[serde_json::Value], op: &str) -> usize {
        lines.iter().filter(|l| l["op"] == op).count()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_timeline_is_the_last_overlap_step_as_svg_and_json_lines() {
        // The copy transport on 1x2: exchanges, combines and gathers on their lanes.
        let a = BenchArgs {
            timeline: true,
            transport: Transport::Copy,
            ..args(Mesh::new(1, 2).unwrap())
        };
        let backend = Arc::new(CpuBackend::new(a.mesh));
        let r = run(backend, &a).await.unwrap();
        let svg = r.timeline_svg.as_deref().expect("an svg");
        assert!(svg.starts_with("<svg") && svg.contains("gather"), "{svg}");
        let lines = timeline_lines(&r);
        // One grad_ready, exchange, combine, gather per layer at least, on rank 0.
        let count = |op: &str| count_op(&lines, op);
        for op in ["grad_ready", "exchange", "combine", "gather"] {
            assert_eq!(count(op), a.layers as usize, "{op}: {lines:?}");
        }
        assert!(lines
            .iter()
            .all(|l| l["end_us"].as_f64().unwrap() >= l["start_us"].as_f64().unwrap()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn several_buckets_per_layer_split_each_gradient() {
        let a = BenchArgs {
            buckets_per_layer: 4,
            timeline: true,
            transport: Transport::Copy,
            ..args(Mesh::new(2, 1).unwrap())
        };
        let spec = a.spec(Bindings::default());
        assert_eq!(spec.params.len(), 12);
        assert!(spec
            .params
            .iter()
            .all(|p| p.shape == vec![a.grad_elems() / 4]));
        assert_eq!(spec.params[5].name, "layer1.grad1");
        let backend = Arc::new(CpuBackend::new(a.mesh));
        let r = run(backend, &a).await.unwrap();
        let lines = timeline_lines(&r);
        let count = |op: &str| count_op(&lines, op);
        assert_eq!(count("grad_ready"), 3);
        assert_eq!(count("exchange"), 12);
        assert_eq!(count("combine"), 12);
    }

    /// The schedule levers reach the plan: the tail rule on mesh 1x2 (all-reduces) moves
    /// the second-to-last layer's gather before the last exchange, and ordering edges
    /// change the waits; every variant still runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_schedule_levers_change_the_plan_and_run() {
        let base = BenchArgs {
            transport: Transport::Copy,
            ..args(Mesh::new(1, 2).unwrap())
        };
        let plan_of = |a: &BenchArgs| bench_plan(a, Bindings::default()).unwrap();
        let gather_before_last_exchange = |p: &Plan| {
            let nodes = &p.ranks[0].nodes;
            let last = nodes
                .iter()
                .rposition(|n| matches!(n.op, Op::Exchange { .. }))
                .unwrap();
            nodes[..last]
                .iter()
                .filter(|n| matches!(n.op, Op::Gather { .. }))
                .count()
        };
        let late = BenchArgs {
            no_early_tail_gathers: true,
            ..base
        };
        assert_eq!(
            gather_before_last_exchange(&plan_of(&base)),
            gather_before_last_exchange(&plan_of(&late)) + 1
        );
        let after = BenchArgs {
            combine_after_exchanges: true,
            ..base
        };
        // (Which waits: graph/tests/plans_validate.rs.)
        assert_ne!(plan_of(&after).ranks, plan_of(&base).ranks);
        for a in [late, after] {
            let r = run(Arc::new(CpuBackend::new(a.mesh)), &a).await.unwrap();
            assert!(r.figures.overlap_ms > 0.0, "{r:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn collective_sweep_compares_the_node_with_the_direct_call_on_the_cpu_backend() {
        let mesh = Mesh::new(1, 2).unwrap();
        let backend = Arc::new(CpuBackend::new(mesh));
        let rows = collectives(backend, mesh, &[1, 2], 2, 1).await.unwrap();
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!(r.op, "all_reduce");
            assert!(r.nccl_ms > 0.0 && r.node_ms > 0.0 && r.ratio > 0.0, "{r:?}");
        }
        assert_eq!(rows[1].bytes, 2 << 20);
    }
}
