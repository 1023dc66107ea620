//! What the executor precomputes once per (plan, rank) so that issuing a node is a few
//! table lookups: each node's accesses, its slice of the host issue order, the pack and
//! unpack copies of each bucket, and where each transient buffer can be released.

use std::collections::HashMap;
use std::sync::Arc;

use overlap_graph::validate::issue_order;
use overlap_graph::{Access, BucketId, Buffer, CopySeg, Instr, Op, Plan, Stream};

/// A plan prepared for one rank.
pub(crate) struct Prepared {
    pub plan: Arc<Plan>,
    /// Per node: what it reads and writes.
    pub access: Vec<Access>,
    /// The host issue order of the rank's instructions.
    pub issue: Vec<(Stream, Instr)>,
    /// Per node: one past its last instruction in `issue` (its run and trailing records).
    pub issue_end: Vec<usize>,
    /// Per node: transient buffers this node is a final accessor of, and whether it is
    /// the last one in serial order (the buffer goes back to the pool after it).
    pub finals: Vec<Vec<(Buffer, bool)>>,
    /// Pack copies per bucket.
    pub pack: HashMap<BucketId, Arc<[CopySeg]>>,
    /// Unpack copies per bucket on this rank.
    pub unpack: HashMap<BucketId, Arc<[CopySeg]>>,
}

impl Prepared {
    pub fn new(plan: Arc<Plan>, rank: u32) -> Prepared {
        let rp = plan.rank(rank);
        let access: Vec<Access> = rp.nodes.iter().map(|n| plan.access(rank, n)).collect();
        let issue = issue_order(rp);
        let mut issue_end = vec![0; rp.nodes.len()];
        let mut i = 0;
        while i < issue.len() {
            if let Instr::Run(n) = issue[i].1 {
                let mut j = i + 1;
                while matches!(issue.get(j), Some((_, Instr::Record(_)))) {
                    j += 1;
                }
                issue_end[n as usize] = j;
                i = j;
            } else {
                i += 1;
            }
        }
        // Final accessors of transient buffers: the last write and every read after it.
        let mut last: HashMap<Buffer, (u32, Vec<u32>)> = HashMap::new();
        for (n, a) in access.iter().enumerate() {
            let n = n as u32;
            for b in a.reads.iter().filter(|b| b.is_transient()) {
                last.entry(*b).or_insert_with(|| (n, Vec::new())).1.push(n);
            }
            for b in a.writes.iter().filter(|b| b.is_transient()) {
                last.insert(*b, (n, Vec::new()));
            }
        }
        let mut finals = vec![Vec::new(); rp.nodes.len()];
        for (b, (w, reads)) in last {
            let mut who: Vec<u32> = reads.into_iter().filter(|&r| r != w).collect();
            who.push(w);
            who.sort_unstable();
            who.dedup();
            let lastn = *who.last().unwrap_or(&w);
            for n in who {
                finals[n as usize].push((b, n == lastn));
            }
        }
        for f in &mut finals {
            f.sort();
        }
        let mut pack = HashMap::new();
        let mut unpack = HashMap::new();
        for n in &rp.nodes {
            match n.op {
                Op::Pack { bucket, .. } => {
                    pack.entry(bucket)
                        .or_insert_with(|| plan.pack_segments(bucket).into());
                }
                Op::Unpack { bucket, .. } => {
                    unpack
                        .entry(bucket)
                        .or_insert_with(|| plan.unpack_segments(bucket, rank).into());
                }
                _ => {}
            }
        }
        Prepared {
            plan,
            access,
            issue,
            issue_end,
            finals,
            pack,
            unpack,
        }
    }

    /// The slice of the issue order that issues node `n`.
    pub fn group(&self, n: usize) -> std::ops::Range<usize> {
        let start = if n == 0 { 0 } else { self.issue_end[n - 1] };
        start..self.issue_end[n]
    }
}
