//! Observing the executed schedule: what each step did on each stream, and whether
//! communication hid behind compute.
//!
//! This module owns the *analysis* of a step (`docs/observe.md`; `docs/performance.md`): from a [`StepReport`]'s
//! kernel [`Timing`]s and the step's [`Plan`] it derives, per local rank, how long each
//! stream was busy, when communication ran while compute did not (exposed
//! communication), the overlap efficiency `η`, the bytes and bus bandwidth of every kind
//! of collective and the partial bytes the schedule holds. Its submodules turn that into
//! outputs: [`metrics`] (Prometheus, through the `metrics` crate), [`trace`] (Chrome
//! trace JSON for Perfetto) and [`svg`] (a Gantt picture of one step). [`Recording`]
//! is what `overlap run --trace/--svg` drives.
//!
//! Definitions, per rank, over the kernels of one step (times are the backend's: CUDA
//! events on GPUs, the stream thread's clock on the CPU backend). Only kernels `overlap`
//! launches are seen: a trainer's own backward kernels on the compute stream are not (on
//! the CPU backend, `[run] backward_us_per_layer` puts a synthetic backward there).
//! - *busy(s)*: the length of the union of the kernel intervals of stream `s`;
//! - *compute* `C` = busy(compute); *communication* `K` = the length of the union of the
//!   intervals of the communication streams (reduce, replicate, publish, copy);
//! - *exposed communication*: the time some communication stream is busy while the
//!   compute stream is not (the union of the communication intervals minus the compute
//!   intervals);
//! - *actual*: the rank's device span, from its first kernel's start to its last
//!   kernel's end;
//! - *serial* = `C + K` (compute, then communication); *ideal* = `max(C, K) + K/L` with
//!   `L` the number of layers that have parameters (the last layer's reduction cannot
//!   hide);
//! - *overlap efficiency* `η = (serial − actual) / (serial − ideal)`: 1 when the step took
//!   the ideal time, 0 when it took as long as running everything serially. It is
//!   undefined (`None`) when `serial − ideal` is at most [`MIN_HIDEABLE_SECONDS`] or
//!   [`MIN_HIDEABLE_FRACTION`] of `serial` (no communication worth the name, as on one
//!   GPU where only copies and the publish's no-ops run on communication streams, or no
//!   compute to hide it behind): a ratio of two tiny differences says nothing. It is not clamped: below 0 the step
//!   was longer than serial execution (idle gaps: the host issued too slowly), above 1
//!   it beat the model of `ideal`.
//!
//! Across the local ranks, times are averaged and `η` is the ratio of the summed
//! numerators and denominators of the ranks where it is defined.
//!
//! A step run with timings off (`[metrics] timing_every`,
//! [`Backend::set_timings`](overlap_ops::Backend::set_timings)) is *untimed*: it has no
//! device figures ([`StepAnalysis::timed`] is false), while what the plan says
//! (collective calls and bytes, partial bytes held) still counts.
//!
//! The invariant it keeps: the analysis is a pure function of the report and the plan;
//! it reads no clock of its own, so what it reports on a GPU was measured by the device.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use overlap_graph::{Buffer, Collective, CollectiveKind, Gate, Op, Plan, Stream};
use overlap_ops::Timing;

use crate::session::StepReport;
use crate::Error;

pub mod metrics;
pub mod svg;
pub mod trace;

/// Below this many seconds of hideable communication (`serial − ideal`), `η` is
/// undefined.
pub const MIN_HIDEABLE_SECONDS: f64 = 1e-9;

/// Below this fraction of `serial` of hideable communication, `η` is undefined.
pub const MIN_HIDEABLE_FRACTION: f64 = 0.01;

/// Whether `serial − ideal = hideable` is enough for `η` to mean something.
fn hideable(hideable: f64, serial: f64) -> bool {
    hideable > MIN_HIDEABLE_SECONDS.max(MIN_HIDEABLE_FRACTION * serial)
}

/// The streams whose work counts as communication.
pub const COMMUNICATION_STREAMS: [Stream; 4] = [
    Stream::Reduce,
    Stream::Replicate,
    Stream::Publish,
    Stream::Copy,
];

/// A stream's lane name in the pictures and traces of a rank: the stream's name, and
/// `+ unshard` on the lane that runs a forward plan's parameter gathers (the forward
/// lane: the publish stream by default, idle until the step's tail).
pub fn lane_name(plan: &Plan, rank: u32, stream: Stream) -> String {
    let gathers = plan.forward.is_some()
        && plan.ranks.get(rank as usize).is_some_and(|rp| {
            rp.nodes
                .iter()
                .any(|n| n.stream == stream && matches!(n.op, Op::Unshard { .. }))
        });
    if gathers {
        format!("{} + unshard", stream.name())
    } else {
        stream.name().to_string()
    }
}

/// Bytes per element of the buffers the executor allocates (partials, accumulations).
const BUFFER_ELEM_BYTES: u64 = 4;

/// A time interval `[start, end)` in seconds since the backend's epoch.
pub type Interval = (f64, f64);

/// Sorts and merges intervals into disjoint ones (touching intervals merge).
pub fn union(mut intervals: Vec<Interval>) -> Vec<Interval> {
    intervals.retain(|(s, e)| e >= s);
    intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<Interval> = Vec::with_capacity(intervals.len());
    for (s, e) in intervals {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Total length of disjoint intervals.
pub fn length(intervals: &[Interval]) -> f64 {
    intervals.iter().map(|(s, e)| e - s).sum()
}

/// `a` minus `b`, both disjoint and sorted (as [`union`] returns them).
pub fn subtract(a: &[Interval], b: &[Interval]) -> Vec<Interval> {
    let mut out = Vec::new();
    let mut j = 0;
    for &(s, e) in a {
        let mut cur = s;
        while j < b.len() && b[j].1 <= cur {
            j += 1;
        }
        let mut k = j;
        while k < b.len() && b[k].0 < e {
            if b[k].0 > cur {
                out.push((cur, b[k].0));
            }
            cur = cur.max(b[k].1);
            k += 1;
        }
        if cur < e {
            out.push((cur, e));
        }
    }
    out
}

/// What one local rank's streams did in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct RankAnalysis {
    /// Global rank.
    pub rank: u32,
    /// First kernel start, seconds since the backend's epoch.
    pub start: f64,
    /// Last kernel end.
    pub end: f64,
    /// Busy intervals of each stream, indexed by [`Stream::index`].
    pub busy: [Vec<Interval>; Stream::COUNT],
    /// Busy intervals of the communication streams together.
    pub communication: Vec<Interval>,
    /// Communication intervals during which the compute stream was idle.
    pub exposed: Vec<Interval>,
}

impl RankAnalysis {
    /// Busy seconds of a stream.
    pub fn busy_seconds(&self, stream: Stream) -> f64 {
        length(&self.busy[stream.index()])
    }

    /// `C`: busy seconds of the compute stream.
    pub fn compute_seconds(&self) -> f64 {
        self.busy_seconds(Stream::Compute)
    }

    /// `K`: seconds some communication stream was busy.
    pub fn communication_seconds(&self) -> f64 {
        length(&self.communication)
    }

    /// Exposed communication, in seconds.
    pub fn exposed_seconds(&self) -> f64 {
        length(&self.exposed)
    }

    /// `actual`: the device span.
    pub fn span_seconds(&self) -> f64 {
        (self.end - self.start).max(0.0)
    }

    /// `serial = C + K`.
    pub fn serial_seconds(&self) -> f64 {
        self.compute_seconds() + self.communication_seconds()
    }

    /// `ideal = max(C, K) + K/L` for `layers = L` (at least 1).
    pub fn ideal_seconds(&self, layers: u32) -> f64 {
        let (c, k) = (self.compute_seconds(), self.communication_seconds());
        c.max(k) + k / f64::from(layers.max(1))
    }

    /// `(serial − actual, serial − ideal)`: η's numerator and denominator.
    pub fn efficiency_terms(&self, layers: u32) -> (f64, f64) {
        let serial = self.serial_seconds();
        (
            serial - self.span_seconds(),
            serial - self.ideal_seconds(layers),
        )
    }

    /// `η`, or `None` where it is undefined (see the module docs).
    pub fn efficiency(&self, layers: u32) -> Option<f64> {
        let (num, den) = self.efficiency_terms(layers);
        hideable(den, self.serial_seconds()).then(|| num / den)
    }
}

/// The collectives of one kind issued by one kind of node in a step, over local ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectiveStats {
    /// The node kind: `stage1`, `stage2`, `exchange` or `publish`.
    pub op: &'static str,
    /// The collective kind.
    pub kind: CollectiveKind,
    /// Collective calls the plan's nodes make.
    pub calls: u64,
    /// Data bytes per member, summed over calls (nccl-tests' size: the input of a
    /// reduce-scatter, the output of an all-gather, the buffer otherwise).
    pub bytes: u64,
    /// `bytes` times NCCL's bus-bandwidth factor ([`bus_factor`]).
    pub bus_bytes: f64,
    /// Seconds the collective kernels ran, summed over the timed calls (0 on an untimed
    /// step).
    pub seconds: f64,
}

impl CollectiveStats {
    /// Achieved bus bandwidth in bytes per second, `None` when no time was measured (an
    /// untimed step).
    pub fn bus_bandwidth(&self) -> Option<f64> {
        (self.seconds > 0.0).then(|| self.bus_bytes / self.seconds)
    }
}

/// NCCL's bus-bandwidth factor of a collective over `n` members (as nccl-tests
/// reports busbw): all-reduce `2(n−1)/n`, reduce-scatter and all-gather `(n−1)/n`,
/// reduce and broadcast 1.
pub fn bus_factor(kind: CollectiveKind, n: u32) -> f64 {
    let n = f64::from(n.max(1));
    match kind {
        CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
        CollectiveKind::ReduceScatter | CollectiveKind::AllGather => (n - 1.0) / n,
        CollectiveKind::Reduce | CollectiveKind::Broadcast => 1.0,
    }
}

/// Data bytes per member of one collective call (see [`CollectiveStats::bytes`]).
pub fn collective_bytes(plan: &Plan, c: &Collective) -> u64 {
    let n = u64::from(plan.mesh.group_size(c.group));
    let elems = match c.kind {
        CollectiveKind::ReduceScatter | CollectiveKind::AllGather => c.count * n,
        _ => c.count,
    };
    elems * c.dtype.size()
}

/// Everything observed about one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepAnalysis {
    /// 1-based step number.
    pub step: u64,
    /// The gate of each micro-batch.
    pub gates: Vec<Gate>,
    /// `L`: layers that have parameters.
    pub layers: u32,
    /// Host wall time of the step, seconds.
    pub wall_seconds: f64,
    /// One entry per local rank that ran a timed kernel, in rank order (none on an
    /// untimed step).
    pub ranks: Vec<RankAnalysis>,
    /// Collectives by (node kind, collective kind).
    pub collectives: Vec<CollectiveStats>,
    /// Largest bytes of partials held at once in the step's serial order, over local
    /// ranks.
    pub partial_bytes: u64,
    /// Largest bytes of no_sync accumulations held at once, over local ranks.
    pub accumulation_bytes: u64,
}

impl StepAnalysis {
    /// Analyses a timed step from its report and the plan it ran, over the ranks its
    /// timings name. A step that may be untimed needs [`StepAnalysis::on_ranks`].
    pub fn new(report: &StepReport, plan: &Plan) -> StepAnalysis {
        let mut timed: Vec<u32> = report.stats.timings.iter().map(|t| t.rank).collect();
        timed.sort_unstable();
        timed.dedup();
        StepAnalysis::on_ranks(report, plan, &timed)
    }

    /// Analyses a step that `local_ranks` ran. What the plan says (collective calls and
    /// bytes, held partials) counts whether or not the step was timed; the device figures
    /// (`ranks`, collective seconds) come from the timings, so an untimed step has none.
    pub fn on_ranks(report: &StepReport, plan: &Plan, local_ranks: &[u32]) -> StepAnalysis {
        let timings: Vec<&Timing> = report
            .stats
            .timings
            .iter()
            .filter(|t| local_ranks.contains(&t.rank))
            .collect();
        let mut timed: Vec<u32> = timings.iter().map(|t| t.rank).collect();
        timed.sort_unstable();
        timed.dedup();
        let ranks = timed
            .iter()
            .map(|&r| analyse_rank(r, timings.iter().copied().filter(|t| t.rank == r)))
            .collect();
        let (partial_bytes, accumulation_bytes) = held_bytes(plan, local_ranks);
        StepAnalysis {
            step: report.step,
            gates: report.gates.clone(),
            layers: plan.layers_desc().len() as u32,
            wall_seconds: report.stats.wall_seconds,
            ranks,
            collectives: collectives(plan, local_ranks, &timings),
            partial_bytes,
            accumulation_bytes,
        }
    }

    /// Whether the step has kernel timings. Without them (`[metrics] timing_every`) the
    /// device figures are absent, not zero: exposed communication, spans and busy times
    /// read 0 and `η` is `None` only because nothing was measured.
    pub fn timed(&self) -> bool {
        !self.ranks.is_empty()
    }

    fn mean(&self, f: impl Fn(&RankAnalysis) -> f64) -> f64 {
        if self.ranks.is_empty() {
            return 0.0;
        }
        self.ranks.iter().map(f).sum::<f64>() / self.ranks.len() as f64
    }

    /// Busy seconds of a stream, averaged over local ranks.
    pub fn busy_seconds(&self, stream: Stream) -> f64 {
        self.mean(|r| r.busy_seconds(stream))
    }

    /// Exposed communication seconds, averaged over local ranks.
    pub fn exposed_seconds(&self) -> f64 {
        self.mean(RankAnalysis::exposed_seconds)
    }

    /// Device span seconds (`actual`), averaged over local ranks.
    pub fn span_seconds(&self) -> f64 {
        self.mean(RankAnalysis::span_seconds)
    }

    /// `η` of the step: the summed numerators over the summed denominators of the ranks
    /// where it is defined; `None` where it is undefined on every rank.
    pub fn efficiency(&self) -> Option<f64> {
        let (num, den, serial) = self
            .ranks
            .iter()
            .map(|r| {
                let (n, d) = r.efficiency_terms(self.layers);
                (n, d, r.serial_seconds())
            })
            .filter(|&(_, d, s)| hideable(d, s))
            .fold((0.0, 0.0, 0.0), |(n, d, s), (a, b, c)| {
                (n + a, d + b, s + c)
            });
        hideable(den, serial).then(|| num / den)
    }

    /// Start of the step on the device: the earliest kernel start over local ranks.
    pub fn start(&self) -> f64 {
        self.ranks
            .iter()
            .map(|r| r.start)
            .fold(f64::INFINITY, f64::min)
    }

    /// End of the step on the device: the latest kernel end over local ranks.
    pub fn end(&self) -> f64 {
        self.ranks
            .iter()
            .map(|r| r.end)
            .fold(f64::NEG_INFINITY, f64::max)
    }
}

fn analyse_rank<'a>(rank: u32, timings: impl Iterator<Item = &'a Timing>) -> RankAnalysis {
    let mut per_stream: [Vec<Interval>; Stream::COUNT] = Default::default();
    let (mut start, mut end) = (f64::INFINITY, f64::NEG_INFINITY);
    for t in timings {
        per_stream[t.stream.index()].push((t.start, t.end));
        start = start.min(t.start);
        end = end.max(t.end);
    }
    let busy = per_stream.map(union);
    let communication = union(
        COMMUNICATION_STREAMS
            .iter()
            .flat_map(|s| busy[s.index()].iter().copied())
            .collect(),
    );
    let exposed = subtract(&communication, &busy[Stream::Compute.index()]);
    RankAnalysis {
        rank,
        start,
        end,
        busy,
        communication,
        exposed,
    }
}

/// The collectives the local ranks' nodes issue, from the plan (so that an untimed step
/// counts its bytes too), with the seconds their timings measured.
fn collectives(plan: &Plan, local_ranks: &[u32], timings: &[&Timing]) -> Vec<CollectiveStats> {
    let mut out: Vec<CollectiveStats> = Vec::new();
    for &rank in local_ranks {
        let Some(rp) = plan.ranks.get(rank as usize) else {
            continue;
        };
        for node in &rp.nodes {
            let Some(c) = node.op.collective() else {
                continue;
            };
            // An exchange or gather moves the f32 buffers as they are, whatever the
            // reduce dtype; an all-reduce's exchange and gather each move what a
            // reduce-scatter (or all-gather) of the buffer does.
            let (bytes, kind) = match node.op {
                Op::Exchange { .. } | Op::Gather { .. } => (
                    collective_bytes(plan, c) / c.dtype.size() * 4,
                    match c.kind {
                        CollectiveKind::AllReduce => CollectiveKind::ReduceScatter,
                        k => k,
                    },
                ),
                _ => (collective_bytes(plan, c), c.kind),
            };
            let factor = bus_factor(kind, plan.mesh.group_size(c.group));
            let s = stats_of(&mut out, node.op.kind(), c.kind);
            s.calls += 1;
            s.bytes += bytes;
            s.bus_bytes += bytes as f64 * factor;
        }
    }
    for t in timings {
        let Some(node) = plan
            .ranks
            .get(t.rank as usize)
            .and_then(|rp| rp.nodes.get(t.tag.node as usize))
        else {
            continue;
        };
        if let Some(c) = node.op.collective() {
            stats_of(&mut out, node.op.kind(), c.kind).seconds += (t.end - t.start).max(0.0);
        }
    }
    out
}

/// The entry of `(op, kind)`, added at zero if it is not there yet.
fn stats_of<'a>(
    out: &'a mut Vec<CollectiveStats>,
    op: &'static str,
    kind: CollectiveKind,
) -> &'a mut CollectiveStats {
    let i = match out.iter().position(|s| s.op == op && s.kind == kind) {
        Some(i) => i,
        None => {
            out.push(CollectiveStats {
                op,
                kind,
                calls: 0,
                bytes: 0,
                bus_bytes: 0.0,
                seconds: 0.0,
            });
            out.len() - 1
        }
    };
    &mut out[i]
}

/// The largest bytes of partials and of no_sync accumulations held at once by a rank,
/// walking its nodes in serial order: a write of one starts holding it, a read flushes it.
fn held_bytes(plan: &Plan, ranks: &[u32]) -> (u64, u64) {
    let (mut partial_peak, mut accum_peak) = (0, 0);
    for &rank in ranks {
        let Some(rp) = plan.ranks.get(rank as usize) else {
            continue;
        };
        let mut live: Vec<Buffer> = Vec::new();
        let size = |b: &Buffer| plan.buffer_len(rank, b) * BUFFER_ELEM_BYTES;
        // Only these kinds read or write partials and accumulations (`Plan::access`);
        // skipping the others keeps the walk cheap on plans of many thousand nodes.
        let touches_held = |op: &Op| {
            matches!(
                op,
                Op::Fold { .. }
                    | Op::FoldPartial { .. }
                    | Op::Accumulate { .. }
                    | Op::Pack {
                        with_accum: true,
                        ..
                    }
            )
        };
        for node in rp.nodes.iter().filter(|n| touches_held(&n.op)) {
            let access = plan.access(rank, node);
            live.retain(|b| !access.reads.contains(b));
            for w in access.writes {
                if matches!(w, Buffer::Partial { .. } | Buffer::Accum { .. }) && !live.contains(&w)
                {
                    live.push(w);
                }
            }
            let (mut partial, mut accum) = (0, 0);
            for b in &live {
                match b {
                    Buffer::Partial { .. } => partial += size(b),
                    _ => accum += size(b),
                }
            }
            partial_peak = partial_peak.max(partial);
            accum_peak = accum_peak.max(accum);
        }
    }
    (partial_peak, accum_peak)
}

/// The files `overlap run --trace FILE --svg FILE [--svg-step N]` writes: a Chrome trace
/// of every step and a picture of one.
pub struct Recording {
    trace: Option<(
        PathBuf,
        trace::ChromeTrace<std::io::BufWriter<std::fs::File>>,
    )>,
    svg: Option<SvgRequest>,
}

struct SvgRequest {
    path: PathBuf,
    step: Option<u64>,
    kept: Option<(StepReport, Arc<Plan>)>,
}

impl Recording {
    /// Opens the trace file (so that a path that cannot be written fails before the run)
    /// and notes where the picture goes: of step `svg_step`, or of the last step.
    pub fn new(
        trace: Option<&Path>,
        svg: Option<&Path>,
        svg_step: Option<u64>,
    ) -> Result<Recording, Error> {
        let trace = match trace {
            None => None,
            Some(p) => {
                let file = std::fs::File::create(p).map_err(|e| io_error(p, e))?;
                let t = trace::ChromeTrace::new(std::io::BufWriter::new(file))
                    .map_err(|e| io_error(p, e))?;
                Some((p.to_path_buf(), t))
            }
        };
        let svg = svg.map(|p| SvgRequest {
            path: p.to_path_buf(),
            step: svg_step,
            kept: None,
        });
        Ok(Recording { trace, svg })
    }

    /// Adds a finished step.
    pub fn step(&mut self, report: &StepReport, plan: &Arc<Plan>) -> Result<(), Error> {
        if let Some((path, t)) = &mut self.trace {
            t.add_step(report, plan).map_err(|e| io_error(path, e))?;
        }
        if let Some(svg) = &mut self.svg {
            if svg.step.map_or(true, |s| s == report.step) {
                svg.kept = Some((report.clone(), plan.clone()));
            }
        }
        Ok(())
    }

    /// Finishes the trace and writes the picture; returns one line per file written.
    pub fn finish(self) -> Result<Vec<String>, Error> {
        let mut written = Vec::new();
        if let Some((path, t)) = self.trace {
            let events = t.finish().map_err(|e| io_error(&path, e))?;
            written.push(format!(
                "trace: {} ({events} events; open it in https://ui.perfetto.dev)",
                path.display()
            ));
        }
        if let Some(svg) = self.svg {
            let Some((report, plan)) = svg.kept else {
                return Err(Error::Usage(match svg.step {
                    Some(s) => format!("--svg-step {s}: the run has no step {s}"),
                    None => "--svg: the run finished no step".into(),
                }));
            };
            let analysis = StepAnalysis::new(&report, &plan);
            let picture = svg::render(&report, &plan, &analysis);
            std::fs::write(&svg.path, picture).map_err(|e| io_error(&svg.path, e))?;
            written.push(format!(
                "schedule picture: {} (step {})",
                svg.path.display(),
                report.step
            ));
        }
        Ok(written)
    }
}

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{drive, Config, Session};
    use overlap_graph::Transport;

    /// A real first step of `examples/hsdp_2x2.toml` on the CPU backend (every step
    /// timed), with these gates and transport: the report, its plan and the local ranks.
    pub(crate) async fn cpu_step(
        gates: &[Gate],
        transport: Transport,
    ) -> (StepReport, Arc<Plan>, Vec<u32>) {
        let mut cfg = Config::from_toml(
            include_str!("../../examples/hsdp_2x2.toml"),
            "hsdp_2x2.toml",
        )
        .unwrap();
        cfg.plan.schedule.transport = transport;
        let mut s = Session::cpu(&cfg).unwrap();
        let r = drive::synthetic_step(&mut s, cfg.run.seed, 0, gates)
            .await
            .unwrap();
        let plan = s.step_plan(gates).unwrap();
        (r, plan, s.local_ranks())
    }

    const PATTERNS: [&[Gate]; 2] = [
        &[Gate::ReplicateOff, Gate::On],
        &[Gate::NoSync, Gate::ReplicateOff, Gate::On],
    ];

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timed_step_counts_one_call_per_collective_node_as_its_timings_do() {
        for transport in [Transport::Nccl, Transport::Copy] {
            for gates in PATTERNS {
                let (r, plan, local) = cpu_step(gates, transport).await;
                let a = StepAnalysis::on_ranks(&r, &plan, &local);
                assert!(a.timed());
                assert_eq!(a, StepAnalysis::new(&r, &plan));
                // What the timings alone say: one timed kernel per collective node.
                for c in &a.collectives {
                    let timed = r
                        .stats
                        .timings
                        .iter()
                        .filter(|t| {
                            let op = &plan.rank(t.rank).nodes[t.tag.node as usize].op;
                            op.kind() == c.op && op.collective().is_some_and(|x| x.kind == c.kind)
                        })
                        .count();
                    assert_eq!(c.calls, timed as u64, "{transport:?} {gates:?} {c:?}");
                    assert!(c.bytes > 0 && c.bus_bandwidth().is_some(), "{c:?}");
                }
                assert!(!a.collectives.is_empty());
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_untimed_step_keeps_the_plans_figures_and_has_no_device_ones() {
        for transport in [Transport::Nccl, Transport::Copy] {
            for gates in PATTERNS {
                let (r, plan, local) = cpu_step(gates, transport).await;
                let timed = StepAnalysis::on_ranks(&r, &plan, &local);
                let mut untimed_report = r.clone();
                untimed_report.stats.timings.clear();
                let u = StepAnalysis::on_ranks(&untimed_report, &plan, &local);
                assert!(!u.timed());
                assert!(u.ranks.is_empty());
                assert_eq!(u.efficiency(), None);
                assert_eq!(u.partial_bytes, timed.partial_bytes);
                assert_eq!(u.accumulation_bytes, timed.accumulation_bytes);
                assert!(u.partial_bytes > 0);
                assert_eq!(u.accumulation_bytes > 0, gates.contains(&Gate::NoSync));
                assert_eq!(u.collectives.len(), timed.collectives.len());
                for (c, t) in u.collectives.iter().zip(&timed.collectives) {
                    assert_eq!(
                        (c.op, c.kind, c.calls, c.bytes),
                        (t.op, t.kind, t.calls, t.bytes)
                    );
                    assert_eq!(c.bus_bytes, t.bus_bytes);
                    assert_eq!(c.seconds, 0.0);
                    assert_eq!(c.bus_bandwidth(), None);
                }
                // Without the local ranks, an untimed report names none: nothing to count.
                let blind = StepAnalysis::new(&untimed_report, &plan);
                assert!(blind.collectives.is_empty() && blind.partial_bytes == 0);
            }
        }
    }

    const EPS: f64 = 1e-12;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < EPS
    }

    #[test]
    fn union_merges_overlapping_and_touching_intervals() {
        let u = union(vec![
            (3.0, 4.0),
            (0.0, 1.0),
            (0.5, 2.0),
            (2.0, 2.5),
            (5.0, 5.0),
        ]);
        assert_eq!(u, vec![(0.0, 2.5), (3.0, 4.0), (5.0, 5.0)]);
        assert!(close(length(&u), 3.5));
    }

    #[test]
    fn subtract_removes_every_covered_piece() {
        let a = union(vec![(0.0, 10.0), (12.0, 14.0)]);
        let b = union(vec![(1.0, 2.0), (3.0, 4.0), (9.0, 13.0)]);
        assert_eq!(
            subtract(&a, &b),
            vec![(0.0, 1.0), (2.0, 3.0), (4.0, 9.0), (13.0, 14.0)]
        );
        assert_eq!(subtract(&b, &a), vec![(10.0, 12.0)]);
        assert_eq!(subtract(&a, &[]), a);
    }

    fn rank(compute: Vec<Interval>, reduce: Vec<Interval>) -> RankAnalysis {
        let mut busy: [Vec<Interval>; Stream::COUNT] = Default::default();
        busy[Stream::Compute.index()] = union(compute);
        busy[Stream::Reduce.index()] = union(reduce);
        let all: Vec<Interval> = busy.iter().flatten().copied().collect();
        let communication = busy[Stream::Reduce.index()].clone();
        RankAnalysis {
            rank: 0,
            start: all.iter().map(|i| i.0).fold(f64::INFINITY, f64::min),
            end: all.iter().map(|i| i.1).fold(f64::NEG_INFINITY, f64::max),
            exposed: subtract(&communication, &busy[Stream::Compute.index()]),
            busy,
            communication,
        }
    }

    #[test]
    fn exposed_communication_is_communication_while_compute_idles() {
        // Compute 0..4, reduce 1..3 (hidden) and 4..6 (exposed).
        let r = rank(vec![(0.0, 4.0)], vec![(1.0, 3.0), (4.0, 6.0)]);
        assert!(close(r.exposed_seconds(), 2.0));
        assert!(close(r.compute_seconds(), 4.0));
        assert!(close(r.communication_seconds(), 4.0));
    }

    #[test]
    fn efficiency_is_one_at_ideal_and_zero_when_serial() {
        // C = 4, K = 2, L = 2: serial 6, ideal 4 + 1 = 5.
        let ideal = rank(vec![(0.0, 4.0)], vec![(2.0, 3.0), (4.0, 5.0)]);
        assert!(close(ideal.efficiency(2).unwrap(), 1.0));
        let serial = rank(vec![(0.0, 4.0)], vec![(4.0, 6.0)]);
        assert!(close(serial.efficiency(2).unwrap(), 0.0));
        // Half of the hideable second hidden: span 5.5.
        let half = rank(vec![(0.0, 4.0)], vec![(3.5, 5.5)]);
        assert!(close(half.efficiency(2).unwrap(), 0.5));
    }

    #[test]
    fn efficiency_is_undefined_without_communication_or_without_compute() {
        assert_eq!(rank(vec![(0.0, 4.0)], vec![]).efficiency(4), None);
        // One layer, no compute: ideal = K + K = 2K > serial = K.
        assert_eq!(rank(vec![], vec![(0.0, 1.0)]).efficiency(1), None);
    }

    #[test]
    fn efficiency_is_undefined_when_communication_is_a_sliver_of_the_step() {
        // One GPU: 50 ms of compute, 10 µs of copies on a communication stream, and a
        // step 5 ms longer than serial: a ratio of tiny differences (-500), not η.
        let r = rank(vec![(0.0, 0.050)], vec![(0.055, 0.055_01)]);
        assert_eq!(r.efficiency(4), None);
        // A millisecond of it over four layers (1.5 % of serial to hide) is enough.
        let r = rank(vec![(0.0, 0.050)], vec![(0.050, 0.051)]);
        assert!(r.efficiency(4).is_some());
    }

    #[test]
    fn efficiency_goes_negative_when_idle_gaps_make_the_step_longer_than_serial() {
        // serial 2, ideal 1.25, actual 4.
        let r = rank(vec![(0.0, 1.0)], vec![(3.0, 4.0)]);
        assert!(r.efficiency(4).unwrap() < 0.0);
    }

    #[test]
    fn bus_factors_are_nccls() {
        assert!(close(bus_factor(CollectiveKind::AllReduce, 4), 1.5));
        assert!(close(bus_factor(CollectiveKind::ReduceScatter, 4), 0.75));
        assert!(close(bus_factor(CollectiveKind::AllGather, 2), 0.5));
        assert!(close(bus_factor(CollectiveKind::Reduce, 8), 1.0));
        assert!(close(bus_factor(CollectiveKind::Broadcast, 8), 1.0));
        assert!(close(bus_factor(CollectiveKind::AllReduce, 1), 0.0));
    }
}
