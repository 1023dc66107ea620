//! The executed schedule as a Chrome trace (JSON object format), which Perfetto
//! (<https://ui.perfetto.dev>) and `chrome://tracing` open.
//!
//! Layout: one process per rank (`pid` = global rank) and in it one thread per stream
//! (`tid` = [`Stream::index`]), holding one complete (`X`) event per node that ran, from
//! its first kernel's start to its last kernel's end, named by the plan's label and
//! categorised by node kind. Two more threads per rank: `steps` (one span per step) and
//! `exposed communication` (the intervals where communication ran while compute did
//! not). Micro-batches are async spans (`b`/`e`) of the rank, since consecutive
//! micro-batches overlap. Every cross-stream edge of the plan (an event recorded after a
//! node and waited for before a node of another stream) is a flow arrow (`s`/`f`) from
//! the recording node to the waiting node, bound to each slice at its midpoint (which
//! lies inside it).
//!
//! The invariant it keeps: events are written as steps arrive (memory does not grow with
//! the run) and the file is valid JSON once [`ChromeTrace::finish`] returns; timestamps
//! are the backend's, in microseconds since its epoch.

use std::collections::HashMap;
use std::io::{self, Write};
use std::sync::Arc;

use overlap_graph::{Instr, NodeId, Plan, Stream};
use serde_json::{json, Value};

use super::StepAnalysis;
use crate::session::StepReport;

/// `tid` of the lane of step spans.
pub const STEPS_TID: u32 = 4;
/// `tid` of the lane of exposed communication.
pub const EXPOSED_TID: u32 = 5;

/// A cross-stream edge of a rank's plan: the event `event` is recorded after node
/// `from` and waited for before node `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// The rank.
    pub rank: u32,
    /// The plan event.
    pub event: u32,
    /// The last node run on the recording stream before the record.
    pub from: NodeId,
    /// The first node run on the waiting stream after the wait.
    pub to: NodeId,
}

/// Every cross-stream edge of a plan, per rank in rank order. A record with no node
/// before it, or a wait with no node after it, draws nothing.
pub fn flows(plan: &Plan) -> Vec<Flow> {
    let mut out = Vec::new();
    for rp in &plan.ranks {
        let mut recorded_after: HashMap<u32, NodeId> = HashMap::new();
        let mut waited_before: Vec<(u32, NodeId)> = Vec::new();
        for sp in &rp.streams {
            let mut last_run = None;
            let mut pending = Vec::new();
            for ins in &sp.instrs {
                match *ins {
                    Instr::Run(n) => {
                        last_run = Some(n);
                        waited_before.extend(pending.drain(..).map(|e| (e, n)));
                    }
                    Instr::Record(e) => {
                        if let Some(n) = last_run {
                            recorded_after.insert(e, n);
                        }
                    }
                    Instr::Wait(e) => pending.push(e),
                }
            }
        }
        waited_before.sort_unstable();
        for (event, to) in waited_before {
            if let Some(&from) = recorded_after.get(&event) {
                out.push(Flow {
                    rank: rp.rank,
                    event,
                    from,
                    to,
                });
            }
        }
    }
    out
}

/// Writes a Chrome trace to `W`, one step at a time.
pub struct ChromeTrace<W: Write> {
    out: W,
    events: u64,
    ranks_named: Vec<u32>,
    next_id: u64,
    cached: Option<(Arc<Plan>, Vec<Flow>)>,
}

/// Microseconds, rounded to nanoseconds, from seconds.
fn us(seconds: f64) -> f64 {
    (seconds * 1e9).round() / 1e3
}

impl<W: Write> ChromeTrace<W> {
    /// Starts the trace (writes the opening of the JSON object).
    pub fn new(mut out: W) -> io::Result<Self> {
        out.write_all(b"{\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"overlap\"},\"traceEvents\":[\n")?;
        Ok(ChromeTrace {
            out,
            events: 0,
            ranks_named: Vec::new(),
            next_id: 0,
            cached: None,
        })
    }

    fn emit(&mut self, event: Value) -> io::Result<()> {
        if self.events > 0 {
            self.out.write_all(b",\n")?;
        }
        serde_json::to_writer(&mut self.out, &event)?;
        self.events += 1;
        Ok(())
    }

    fn name_rank(&mut self, plan: &Plan, rank: u32) -> io::Result<()> {
        if self.ranks_named.contains(&rank) {
            return Ok(());
        }
        self.ranks_named.push(rank);
        let c = plan.mesh.coord(rank);
        let name = format!("rank {rank} (s={}, r={})", c.shard, c.replicate);
        self.emit(json!({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": name}}))?;
        self.emit(json!({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}))?;
        let lanes = Stream::ALL
            .iter()
            .map(|&s| (s.index() as u32, super::lane_name(plan, rank, s)))
            .chain([
                (STEPS_TID, "steps".to_string()),
                (EXPOSED_TID, "exposed communication".to_string()),
            ]);
        for (tid, lane) in lanes {
            self.emit(json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}}))?;
            self.emit(json!({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}))?;
        }
        Ok(())
    }

    fn flows_of(&mut self, plan: &Arc<Plan>) -> Vec<Flow> {
        match &self.cached {
            Some((p, f)) if Arc::ptr_eq(p, plan) => f.clone(),
            _ => {
                let f = flows(plan);
                self.cached = Some((plan.clone(), f.clone()));
                f
            }
        }
    }

    /// Adds a finished step: its nodes, flows, step and micro-batch spans, exposed
    /// communication.
    pub fn add_step(&mut self, report: &StepReport, plan: &Arc<Plan>) -> io::Result<()> {
        // Each node's span: (stream, first start, last end, kernels, micro-batch tag).
        let mut spans: HashMap<(u32, NodeId), (Stream, f64, f64, u32)> = HashMap::new();
        for t in &report.stats.timings {
            let e = spans
                .entry((t.rank, t.tag.node))
                .or_insert((t.stream, t.start, t.end, 0));
            e.1 = e.1.min(t.start);
            e.2 = e.2.max(t.end);
            e.3 += 1;
        }
        let mut keys: Vec<(u32, NodeId)> = spans.keys().copied().collect();
        keys.sort_unstable();
        let gates = report.gates.clone();
        for &(rank, node) in &keys {
            self.name_rank(plan, rank)?;
            let (stream, start, end, kernels) = spans[&(rank, node)];
            let Some(n) = plan
                .ranks
                .get(rank as usize)
                .and_then(|rp| rp.nodes.get(node as usize))
            else {
                continue;
            };
            let mut args = json!({"step": report.step, "node": node, "kernels": kernels});
            if let Some(m) = n.micro_batch {
                args["micro_batch"] = json!(m);
                if let Some(g) = gates.get(m as usize) {
                    args["gate"] = json!(g.label());
                }
            }
            if let Some(c) = n.op.collective() {
                args["collective"] = json!(c.to_string());
                args["bytes"] = json!(super::collective_bytes(plan, c));
            }
            self.emit(json!({
                "ph": "X", "name": plan.label(n), "cat": n.op.kind(),
                "pid": rank, "tid": stream.index(),
                "ts": us(start), "dur": us(end - start), "args": args,
            }))?;
        }
        for f in self.flows_of(plan) {
            let (Some(a), Some(b)) = (spans.get(&(f.rank, f.from)), spans.get(&(f.rank, f.to)))
            else {
                continue;
            };
            if a.0 == b.0 {
                continue;
            }
            self.next_id += 1;
            let (id, name) = (self.next_id, format!("event e{}", f.event));
            self.emit(json!({"ph": "s", "id": id, "name": name, "cat": "event", "pid": f.rank, "tid": a.0.index(), "ts": us((a.1 + a.2) / 2.0)}))?;
            self.emit(json!({"ph": "f", "bp": "e", "id": id, "name": name, "cat": "event", "pid": f.rank, "tid": b.0.index(), "ts": us((b.1 + b.2) / 2.0)}))?;
        }
        let analysis = StepAnalysis::new(report, plan);
        let label = overlap_graph::Gate::pattern_label(&gates);
        // Each (rank, micro-batch)'s first kernel start and last kernel end, in one pass
        // over the timings (not one per micro-batch).
        let mut mb_spans: HashMap<(u32, u32), (f64, f64)> = HashMap::new();
        for t in &report.stats.timings {
            let e = mb_spans
                .entry((t.rank, t.tag.micro_batch))
                .or_insert((f64::INFINITY, f64::NEG_INFINITY));
            e.0 = e.0.min(t.start);
            e.1 = e.1.max(t.end);
        }
        for r in &analysis.ranks {
            let eta = r.efficiency(analysis.layers);
            self.emit(json!({
                "ph": "X", "name": format!("step {} ({label})", report.step), "cat": "step",
                "pid": r.rank, "tid": STEPS_TID, "ts": us(r.start), "dur": us(r.span_seconds()),
                "args": {
                    "compute_s": r.compute_seconds(),
                    "communication_s": r.communication_seconds(),
                    "exposed_communication_s": r.exposed_seconds(),
                    "overlap_efficiency": eta,
                    "wall_s": report.stats.wall_seconds,
                },
            }))?;
            for &(s, e) in &r.exposed {
                self.emit(json!({
                    "ph": "X", "name": "exposed communication", "cat": "exposed",
                    "pid": r.rank, "tid": EXPOSED_TID, "ts": us(s), "dur": us(e - s),
                }))?;
            }
            // Micro-batch spans from the rank's kernels tagged with each micro-batch.
            for (m, gate) in gates.iter().enumerate() {
                let Some(&(s, e)) = mb_spans.get(&(r.rank, m as u32)) else {
                    continue;
                };
                if s > e {
                    continue;
                }
                self.next_id += 1;
                let id = format!("mb{}", self.next_id);
                let name = format!("step {} m{m} ({})", report.step, gate.label());
                self.emit(json!({"ph": "b", "cat": "micro_batch", "id": id, "name": name, "pid": r.rank, "tid": STEPS_TID, "ts": us(s)}))?;
                self.emit(json!({"ph": "e", "cat": "micro_batch", "id": id, "name": name, "pid": r.rank, "tid": STEPS_TID, "ts": us(e)}))?;
            }
        }
        Ok(())
    }

    /// Closes the JSON and flushes; returns the number of events written.
    pub fn finish(mut self) -> io::Result<u64> {
        self.out.write_all(b"\n]}\n")?;
        self.out.flush()?;
        Ok(self.events)
    }
}
