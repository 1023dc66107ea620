//! The dependency DAG of a rank's step, and its lowering to stream programs.
//!
//! Edges come from buffer accesses in serial order: read-after-write, write-after-read
//! and write-after-write on the same buffer. Lowering binds each node to its stream and
//! turns every cross-stream edge that stream order and earlier events do not already
//! imply into an event record/wait pair (a transitive reduction computed with vector
//! clocks), so the programs carry the fewest events that keep every dependency.
//!
//! A step is lowered in segments (one per micro-batch, then the optimizer tail). Within a
//! segment events are exact. Each micro-batch segment ends with one record per stream it
//! used, and a dependency on an earlier segment is kept by one wait, at the segment's
//! start, on that end event of the producer stream's latest segment. So a segment's
//! program depends only on the segments before it: the plan of a gate prefix is a prefix
//! of the plan of the whole step, the executor can issue micro-batches as the trainer
//! sets their gates, and a GPU backend can capture each segment per gate pattern.

use std::collections::HashMap;

use petgraph::graph::{DiGraph, NodeIndex};

use crate::node::{Buffer, EventId, Instr, Node, NodeId, Stream};
use crate::plan::{Plan, RankProgram, StreamProgram};

/// A contiguous range of node ids forming one micro-batch or the step tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// First node id.
    pub start: usize,
    /// One past the last node id.
    pub end: usize,
    /// Whether this is the step's optimizer/publish tail (the last segment).
    pub tail: bool,
}

/// Why one node depends on another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dep {
    /// The later node reads what the earlier wrote.
    ReadAfterWrite(Buffer),
    /// The later node overwrites what the earlier read.
    WriteAfterRead(Buffer),
    /// The later node overwrites what the earlier wrote.
    WriteAfterWrite(Buffer),
    /// No buffer in common: the schedule orders the later node after the earlier
    /// (`Schedule::combine_after_exchanges`).
    Order,
}

/// The dependency DAG of one rank's nodes: graph index `i` is node id `i`, and edges
/// point from producer to consumer.
pub fn dependencies(plan: &Plan, rank: u32, nodes: &[Node]) -> DiGraph<NodeId, Dep> {
    let mut g = DiGraph::with_capacity(nodes.len(), nodes.len() * 2);
    for n in nodes {
        g.add_node(n.id);
    }
    let mut last_write: HashMap<Buffer, NodeId> = HashMap::new();
    let mut readers: HashMap<Buffer, Vec<NodeId>> = HashMap::new();
    let mut edges: Vec<(NodeId, NodeId, Dep)> = Vec::new();
    for n in nodes {
        let a = plan.access(rank, n);
        for r in &a.reads {
            if let Some(&w) = last_write.get(r) {
                edges.push((w, n.id, Dep::ReadAfterWrite(*r)));
            }
        }
        for w in &a.writes {
            if let Some(rs) = readers.get(w) {
                edges.extend(
                    rs.iter()
                        .filter(|&&r| r != n.id)
                        .map(|&r| (r, n.id, Dep::WriteAfterRead(*w))),
                );
            }
            if let Some(&pw) = last_write.get(w) {
                edges.push((pw, n.id, Dep::WriteAfterWrite(*w)));
            }
        }
        for r in &a.reads {
            readers.entry(*r).or_default().push(n.id);
        }
        for w in &a.writes {
            last_write.insert(*w, n.id);
            readers.insert(*w, Vec::new());
        }
    }
    edges.sort_by_key(|&(a, b, _)| (a, b));
    edges.dedup_by_key(|&mut (a, b, _)| (a, b));
    for (a, b, d) in edges {
        g.add_edge(NodeIndex::new(a as usize), NodeIndex::new(b as usize), d);
    }
    g
}

type Clock = [u32; Stream::COUNT];

fn join(a: &mut Clock, b: &Clock) {
    for i in 0..Stream::COUNT {
        a[i] = a[i].max(b[i]);
    }
}

/// Lowers one rank's nodes (in serial order, split into segments) to stream programs;
/// `order`: extra (earlier, later) edges the schedule adds to the buffers' ([`Dep::Order`]).
pub fn lower_rank(
    plan: &Plan,
    rank: u32,
    nodes: Vec<Node>,
    segments: &[Segment],
    order: &[(NodeId, NodeId)],
) -> RankProgram {
    let mut g = dependencies(plan, rank, &nodes);
    add_order_edges(&mut g, order);
    let seg_of = {
        let mut v = vec![0usize; nodes.len()];
        for (k, s) in segments.iter().enumerate() {
            v[s.start..s.end].fill(k);
        }
        v
    };
    let mut events: EventId = 0;
    let mut instrs: [Vec<Instr>; Stream::COUNT] = Default::default();
    // The end event of the latest earlier segment with work on each stream.
    let mut last_end: [Option<EventId>; Stream::COUNT] = [None; Stream::COUNT];
    for (k, seg) in segments.iter().enumerate() {
        let seg_nodes = &nodes[seg.start..seg.end];
        let edges = SegmentEdges::of(&g, &nodes, seg_nodes, (k, &seg_of), &mut events);
        let started = edges.emit(seg_nodes, &last_end, &mut instrs);
        // Every micro-batch segment ends with one event per stream it used, so that the
        // next segment's program does not depend on what follows it.
        if !seg.tail {
            for (y, list) in instrs.iter_mut().enumerate() {
                if started[y] {
                    let e = next_event(&mut events);
                    list.push(Instr::Record(e));
                    last_end[y] = Some(e);
                }
            }
        }
    }
    let streams = Stream::ALL
        .into_iter()
        .zip(instrs)
        .filter(|(_, v)| !v.is_empty())
        .map(|(stream, instrs)| StreamProgram { stream, instrs })
        .collect();
    RankProgram {
        rank,
        nodes,
        events,
        streams,
    }
}

/// Adds the schedule's (earlier, later) edges that the buffers do not already give.
fn add_order_edges(g: &mut DiGraph<NodeId, Dep>, order: &[(NodeId, NodeId)]) {
    for &(a, b) in order {
        if a < b
            && g.find_edge(NodeIndex::new(a as usize), NodeIndex::new(b as usize))
                .is_none()
        {
            g.add_edge(
                NodeIndex::new(a as usize),
                NodeIndex::new(b as usize),
                Dep::Order,
            );
        }
    }
}

/// The next event id (ids are handed out in order from 0).
fn next_event(events: &mut EventId) -> EventId {
    *events += 1;
    *events - 1
}

/// The cross-stream edges of one segment, as events.
struct SegmentEdges {
    /// `entry[x][y]`: stream `x`'s work in the segment depends on stream `y`'s in an
    /// earlier one (kept by one wait, at `x`'s start, on `y`'s latest end event).
    entry: [[bool; Stream::COUNT]; Stream::COUNT],
    /// The event recorded after a node that another stream waits for.
    record_after: HashMap<NodeId, EventId>,
    /// The events a node waits for before it runs.
    waits_before: HashMap<NodeId, Vec<EventId>>,
}

impl SegmentEdges {
    /// The fewest record/wait pairs that keep every dependency of `seg_nodes` (segment
    /// `k`; `seg_of` gives each node's segment) within it: a wait is needed only where
    /// the consumer's stream does not already know of the producer (vector clocks, one
    /// per stream, joined along each wait). Events are numbered from `events` on.
    fn of(
        g: &DiGraph<NodeId, Dep>,
        nodes: &[Node],
        seg_nodes: &[Node],
        (k, seg_of): (usize, &[usize]),
        events: &mut EventId,
    ) -> SegmentEdges {
        let mut edges = SegmentEdges {
            entry: [[false; Stream::COUNT]; Stream::COUNT],
            record_after: HashMap::new(),
            waits_before: HashMap::new(),
        };
        let mut pos = [0u32; Stream::COUNT];
        let mut known: [Clock; Stream::COUNT] = [[0; Stream::COUNT]; Stream::COUNT];
        let mut clock_of: HashMap<NodeId, (u32, Clock)> = HashMap::new();
        for n in seg_nodes {
            let x = n.stream.index();
            let mut preds: Vec<NodeId> = g
                .neighbors_directed(NodeIndex::new(n.id as usize), petgraph::Direction::Incoming)
                .map(|i| nodes[i.index()].id)
                .filter(|&p| nodes[p as usize].stream != n.stream)
                .collect();
            // Latest first: a later producer's clock may cover an earlier one.
            preds.sort_unstable_by(|a, b| b.cmp(a));
            preds.dedup();
            for p in preds {
                let y = nodes[p as usize].stream.index();
                if seg_of[p as usize] != k {
                    edges.entry[x][y] = true;
                    continue;
                }
                let (ppos, pclock) = clock_of[&p];
                if known[x][y] >= ppos {
                    continue;
                }
                let ev = *edges
                    .record_after
                    .entry(p)
                    .or_insert_with(|| next_event(events));
                edges.waits_before.entry(n.id).or_default().push(ev);
                join(&mut known[x], &pclock);
            }
            pos[x] += 1;
            known[x][x] = pos[x];
            clock_of.insert(n.id, (pos[x], known[x]));
        }
        edges
    }

    /// Appends the segment's instructions to each stream's program: a stream's first
    /// node in the segment is preceded by its waits on earlier segments' end events
    /// (`last_end`), each node by its waits, and followed by its record. Returns which
    /// streams have work in the segment.
    fn emit(
        &self,
        seg_nodes: &[Node],
        last_end: &[Option<EventId>; Stream::COUNT],
        instrs: &mut [Vec<Instr>; Stream::COUNT],
    ) -> [bool; Stream::COUNT] {
        let mut started = [false; Stream::COUNT];
        for n in seg_nodes {
            let x = n.stream.index();
            if !std::mem::replace(&mut started[x], true) {
                for (y, end) in last_end.iter().enumerate() {
                    if let (true, Some(e)) = (self.entry[x][y], *end) {
                        instrs[x].push(Instr::Wait(e));
                    }
                }
            }
            if let Some(ws) = self.waits_before.get(&n.id) {
                instrs[x].extend(ws.iter().map(|&e| Instr::Wait(e)));
            }
            instrs[x].push(Instr::Run(n.id));
            if let Some(&e) = self.record_after.get(&n.id) {
                instrs[x].push(Instr::Record(e));
            }
        }
        started
    }
}
