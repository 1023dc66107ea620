//! The dependency DAG of a rank's step, and its lowering to stream programs.
//!
//! Edges come from buffer accesses in serial order: read-after-write, write-after-read
//! and write-after-write on the same buffer. Lowering binds each node to its stream and
//! turns every cross-stream edge that stream order and earlier events do not already
//! imply into an event record/wait pair (a transitive reduction computed with vector
//! clocks), so the programs carry the fewest events that keep every dependency.
//!
//! A step is lowered in segments (one per micro-batch, then the optimizer tail). Within a
//! segment events are exact; a dependency on an earlier segment is kept by one wait, at
//! the segment's start, on the end event of the producer stream's latest segment. That
//! keeps each segment's program a function of its gate and what came before, so the
//! executor can reuse it (and a GPU backend capture it) per gate pattern.

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
                edges.extend(rs.iter().filter(|&&r| r != n.id).map(|&r| (r, n.id, Dep::WriteAfterRead(*w))));
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

type Clock = [u32; 4];

fn join(a: &mut Clock, b: &Clock) {
    for i in 0..4 {
        a[i] = a[i].max(b[i]);
    }
}

/// Lowers one rank's nodes (in serial order, split into segments) to stream programs.
pub fn lower_rank(plan: &Plan, rank: u32, nodes: Vec<Node>, segments: &[Segment]) -> RankProgram {
    let g = dependencies(plan, rank, &nodes);
    let seg_of = {
        let mut v = vec![0usize; nodes.len()];
        for (k, s) in segments.iter().enumerate() {
            v[s.start..s.end].fill(k);
        }
        v
    };
    let mut events: EventId = 0;
    let mut record_after: HashMap<NodeId, EventId> = HashMap::new();
    let mut waits_before: HashMap<NodeId, Vec<EventId>> = HashMap::new();
    // entry[k][x] = streams whose earlier-segment work stream x must wait for in segment k.
    let mut entry: Vec<[[bool; 4]; 4]> = vec![[[false; 4]; 4]; segments.len()];
    for (k, seg) in segments.iter().enumerate() {
        let mut pos = [0u32; 4];
        let mut known: [Clock; 4] = [[0; 4]; 4];
        let mut clock_of: HashMap<NodeId, (u32, Clock)> = HashMap::new();
        for n in &nodes[seg.start..seg.end] {
            let x = n.stream.index();
            let mut preds: Vec<NodeId> = g
                .neighbors_directed(NodeIndex::new(n.id as usize), petgraph::Direction::Incoming)
                .map(|i| nodes[i.index()].id)
                .filter(|&p| nodes[p as usize].stream != n.stream)
                .collect();
            preds.sort_unstable_by(|a, b| b.cmp(a));
            preds.dedup();
            for p in preds {
                let y = nodes[p as usize].stream.index();
                if seg_of[p as usize] != k {
                    entry[k][x][y] = true;
                    continue;
                }
                let (ppos, pclock) = clock_of[&p];
                if known[x][y] >= ppos {
                    continue;
                }
                let ev = *record_after.entry(p).or_insert_with(|| {
                    events += 1;
                    events - 1
                });
                waits_before.entry(n.id).or_default().push(ev);
                join(&mut known[x], &pclock);
            }
            pos[x] += 1;
            known[x][x] = pos[x];
            clock_of.insert(n.id, (pos[x], known[x]));
        }
    }
    // End events: the latest earlier segment with work on stream y records one when a
    // later segment's entry needs it.
    let has_work = |k: usize, s: usize| nodes[segments[k].start..segments[k].end].iter().any(|n| n.stream.index() == s);
    let mut end_event: HashMap<(usize, usize), EventId> = HashMap::new();
    let mut entry_waits: Vec<[Vec<EventId>; 4]> = vec![Default::default(); segments.len()];
    for k in 0..segments.len() {
        for x in 0..4 {
            for y in 0..4 {
                if !entry[k][x][y] {
                    continue;
                }
                if let Some(j) = (0..k).rev().find(|&j| has_work(j, y)) {
                    let ev = *end_event.entry((j, y)).or_insert_with(|| {
                        events += 1;
                        events - 1
                    });
                    entry_waits[k][x].push(ev);
                }
            }
        }
    }
    let mut instrs: [Vec<Instr>; 4] = Default::default();
    for (k, seg) in segments.iter().enumerate() {
        let mut started = [false; 4];
        for n in &nodes[seg.start..seg.end] {
            let x = n.stream.index();
            if !std::mem::replace(&mut started[x], true) {
                instrs[x].extend(entry_waits[k][x].iter().map(|&e| Instr::Wait(e)));
            }
            if let Some(ws) = waits_before.get(&n.id) {
                instrs[x].extend(ws.iter().map(|&e| Instr::Wait(e)));
            }
            instrs[x].push(Instr::Run(n.id));
            if let Some(&e) = record_after.get(&n.id) {
                instrs[x].push(Instr::Record(e));
            }
        }
        for (y, list) in instrs.iter_mut().enumerate() {
            if let Some(&e) = end_event.get(&(k, y)) {
                list.push(Instr::Record(e));
            }
        }
    }
    let streams = Stream::ALL
        .into_iter()
        .zip(instrs)
        .filter(|(_, v)| !v.is_empty())
        .map(|(stream, instrs)| StreamProgram { stream, instrs })
        .collect();
    RankProgram { rank, nodes, events, streams }
}
