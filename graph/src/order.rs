//! Happens-before on one rank's nodes: the one definition of "node `a` completes before
//! node `b` starts" that the validator proves plans against and the executor's buffer
//! aliasing relies on.
//!
//! The host issues a rank's instructions in [`issue_order`]: to issue node `n` it issues
//! the instructions of `n`'s stream up to `Run(n)`, then the records that follow it. A
//! stream runs its instructions in order; a `wait` orders the stream after the latest
//! `record` of its event issued before it (a wait issued before any record of its event
//! waits for nothing, as on a GPU). So `a` completes before `b` starts when `a` runs
//! earlier on `b`'s stream, or when a chain of records and waits leads from after `a` to
//! before `b`. Vector clocks over the streams compute it in one pass.

use crate::node::{EventId, Instr, NodeId, Stream};
use crate::plan::RankProgram;

type Clock = [u32; Stream::COUNT];

/// Happens-before of one rank's nodes, computed from its host issue order.
#[derive(Debug, Clone)]
pub struct HappensBefore {
    /// Per node: its stream index and 1-based position on that stream (0: never run).
    pos: Vec<(usize, u32)>,
    /// Per node: the stream positions known complete when it starts (itself included).
    clock: Vec<Clock>,
}

impl HappensBefore {
    /// Happens-before of a rank's program, and the waits issued before any record of
    /// their event (each with its stream), which order nothing.
    pub fn of(rp: &RankProgram) -> (HappensBefore, Vec<(Stream, EventId)>) {
        HappensBefore::from_issue(rp.nodes.len(), &issue_order(rp))
    }

    /// Happens-before of `nodes` nodes issued in `issue` (an [`issue_order`]).
    pub fn from_issue(
        nodes: usize,
        issue: &[(Stream, Instr)],
    ) -> (HappensBefore, Vec<(Stream, EventId)>) {
        let mut cur: [Clock; Stream::COUNT] = [[0; Stream::COUNT]; Stream::COUNT];
        let mut recorded: std::collections::HashMap<EventId, Clock> =
            std::collections::HashMap::new();
        let mut unmatched = Vec::new();
        let mut hb = HappensBefore {
            pos: vec![(0, 0); nodes],
            clock: vec![[0; Stream::COUNT]; nodes],
        };
        for &(s, ins) in issue {
            let x = s.index();
            match ins {
                Instr::Run(id) => {
                    cur[x][x] += 1;
                    if let Some(p) = hb.pos.get_mut(id as usize) {
                        *p = (x, cur[x][x]);
                        hb.clock[id as usize] = cur[x];
                    }
                }
                Instr::Record(e) => {
                    recorded.insert(e, cur[x]);
                }
                Instr::Wait(e) => match recorded.get(&e) {
                    Some(c) => {
                        for k in 0..Stream::COUNT {
                            cur[x][k] = cur[x][k].max(c[k]);
                        }
                    }
                    None => unmatched.push((s, e)),
                },
            }
        }
        (hb, unmatched)
    }

    /// Whether node `a` completes before node `b` starts.
    pub fn before(&self, a: NodeId, b: NodeId) -> bool {
        let (s, k) = self.pos[a as usize];
        a != b && k > 0 && k <= self.clock[b as usize][s]
    }

    /// Whether one of `a` and `b` completes before the other starts.
    pub fn ordered(&self, a: NodeId, b: NodeId) -> bool {
        self.before(a, b) || self.before(b, a)
    }
}

/// The host issue order of a rank's instructions: `(stream, instruction)` pairs.
pub fn issue_order(rp: &RankProgram) -> Vec<(Stream, Instr)> {
    let mut cursor = vec![0usize; rp.streams.len()];
    let mut index_of = [usize::MAX; Stream::COUNT];
    for (i, s) in rp.streams.iter().enumerate() {
        index_of[s.stream.index()] = i;
    }
    let mut out = Vec::with_capacity(rp.streams.iter().map(|s| s.instrs.len()).sum());
    for n in &rp.nodes {
        let si = index_of[n.stream.index()];
        let Some(sp) = rp.streams.get(si) else {
            continue;
        };
        while cursor[si] < sp.instrs.len() {
            let ins = sp.instrs[cursor[si]];
            cursor[si] += 1;
            out.push((sp.stream, ins));
            if ins == Instr::Run(n.id) {
                while let Some(&Instr::Record(e)) = sp.instrs.get(cursor[si]) {
                    cursor[si] += 1;
                    out.push((sp.stream, Instr::Record(e)));
                }
                break;
            }
        }
    }
    for (si, sp) in rp.streams.iter().enumerate() {
        out.extend(sp.instrs[cursor[si]..].iter().map(|&i| (sp.stream, i)));
    }
    out
}
