//! What the executor precomputes once per (plan, rank) so that issuing a node is a few
//! table lookups: each node's accesses, its slice of the host issue order, the pack and
//! unpack copies of each bucket, where each transient buffer can be released, how each
//! buffer is allocated, and which nodes alias their output to their input.
//!
//! # Aliasing
//!
//! Some nodes copy a buffer unchanged: a pack whose segments lay one gradient out as it
//! is (an owned route's one-parameter bucket, a sharded one on a shard group of one, an
//! `fsdp` parameter whose chunks need no padding) and that adds no no_sync accumulation;
//! a Stage-1 or Stage-2 collective over a group of one in f32 (the identity: `avg`
//! divides by 1); an unpack of one parameter that is one whole-buffer copy with
//! `accumulate = false`. For such a node `X` reading name `A` and writing name `B`, the
//! executor can make `B` *be* `A`'s memory and launch a marker instead of the copy. The
//! plan and the validator do not change: `X` stays, with its waits and records. It is
//! done only when no execution order the plan allows can tell the difference:
//!
//! 1. `B` does not exist before `X` (its first access in serial order is `X`), and `X`
//!    writes all of it with `A`'s values, bit for bit.
//! 2. No name of `A`'s memory (`A` and whatever it already aliases, the group `G`) is
//!    written after `X` in serial order, and none is accessed after the first write to
//!    `B` after `X`: every read of `G` sees the values `X` would have copied, and every
//!    read of `B` the values `X` would have written.
//! 3. No new race: the plan is race-free per name, so only pairs of an access to `G`
//!    and an access to `B` (one of them a write) are new; each such pair must be ordered
//!    by the plan's streams and events (checked on the issue order's happens-before).
//!    When `B` is a step buffer (a reduced gradient, which later micro-batches of a
//!    longer gate prefix may accumulate into, and the optimizer reads), every other
//!    access to `G` must happen before `X`, so that accesses added by a plan that extends
//!    this one are ordered after all of `G` through `B`'s own (validated) order.
//! 4. Memory the caller owns (a gradient handed in with `grad_ready_bound`) is never
//!    written: a group holding a gradient only grows by transient names never written
//!    after `X`, and never becomes a reduced gradient that outlives the step.
//!
//! The transient names of one micro-batch are only accessed by that micro-batch's
//! nodes, so the decisions for a prefix plan's nodes are the same in every plan that
//! extends it. A group's memory is released once, after the last accessor of any of its
//! names; a group that holds a step buffer is never pooled (it is that buffer).
//!
//! # Allocation
//!
//! A new buffer is zeroed only when its first access in serial order does not write all
//! of it (a pack zeroes its padding itself, a collective writes its whole output, `Add`
//! and `Unpack` with `accumulate = false` overwrite what they cover); otherwise it is
//! allocated without zeroing ([`overlap_ops::Backend::alloc_uninit`]: on the CUDA
//! backend no memset and no synchronisation).
//!
//! # Runs
//!
//! The step's tail is a long row of nodes of one kind on one stream: a rank's
//! optimizers back to back, then its publishes (`docs/plan-format.md` §7.4). The
//! executor issues such a row as one unit ([`Prepared::runs`]): every wait of the row
//! first, then every node's kernels in order, then every record, and one release event
//! for the row. Moving a wait earlier and a record later on the same stream only adds
//! ordering, and cannot deadlock: a wait can only name an event recorded before the row
//! on the host (the row's own records, on its own stream, are excluded), so what it
//! waits for never waits for the row. A row is a maximal sequence of optimizer, or of
//! publish, nodes on one stream whose instructions are waits before the node's run and
//! records after it, none waiting for an event recorded in the row.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::Arc;

use overlap_graph::order::issue_order;
use overlap_graph::HappensBefore;
use overlap_graph::{
    Access, BucketId, Buffer, Collective, CopySeg, DType, Instr, Op, Plan, Stream,
};
use overlap_ops::Tag;

use crate::order::{group, issue_ends};

/// How a node allocates a buffer it is the first writer of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Alloc {
    /// From the transient pool (the memory goes back to it after its last accessor).
    pub pooled: bool,
    /// Zeroed: the first access does not write every element.
    pub zero: bool,
}

/// A plan prepared for one rank.
pub(crate) struct Prepared {
    pub plan: Arc<Plan>,
    /// Per node: what it reads and writes.
    pub access: Vec<Access>,
    /// The host issue order of the rank's instructions.
    pub issue: Vec<(Stream, Instr)>,
    /// Per node: one past its last instruction in `issue` (its run and trailing records).
    pub issue_end: Vec<usize>,
    /// Per node: transient memory (named by its group's first name) this node is a final
    /// accessor of, and whether it is the last one in serial order (the memory goes back
    /// to the pool after it).
    pub finals: Vec<Vec<(Buffer, bool)>>,
    /// Per group's first name: every name of the group (one piece of memory).
    pub names: HashMap<Buffer, Vec<Buffer>>,
    /// Per node: `(A, B)` when the node's output `B` is its input `A`'s memory (see the
    /// module docs); the node then launches a marker.
    pub alias: Vec<Option<(Buffer, Buffer)>>,
    /// Per node: the buffers it allocates (first writes of new memory) and how.
    pub allocs: Vec<Vec<(Buffer, Alloc)>>,
    /// Pack copies per bucket.
    pub pack: HashMap<BucketId, Arc<[CopySeg]>>,
    /// Unpack copies per bucket on this rank.
    pub unpack: HashMap<BucketId, Arc<[CopySeg]>>,
    /// Per node: one past the last node of the row issued as a unit from it (see the
    /// module docs); `n + 1` where node `n` is issued alone.
    pub runs: Vec<usize>,
    /// The parameters whose reduced gradients the rank's `grad_norm` sums
    /// ([`Plan::norm_params`]).
    pub norm_params: Vec<overlap_graph::ParamId>,
    /// The parameters whose reduced gradients the rank's `clip` scales
    /// ([`Plan::held_params`]).
    pub held_params: Vec<overlap_graph::ParamId>,
    /// Whether the clip scales exactly the parameters the norm sums, in its order (then
    /// it scales the list the norm was bound to).
    pub clip_is_norm: bool,
    /// Per node: its tag (node, kind, micro-batch), as the backend reports it.
    pub tags: Vec<Tag>,
    /// Per node: whether issuing it is only its marker: a publish or a norm's
    /// all-reduce over a group of one (`bind.rs`), which allocates, aliases and
    /// releases nothing. A row skips everything else for it.
    pub noop: Vec<bool>,
    /// Per node: whether it aliases nothing and allocates nothing (no first write of new
    /// memory, nor of a persistent buffer such as an optimizer's state, which its first
    /// step allocates), so issuing it needs no allocation before its binding.
    pub plain: Vec<bool>,
    /// Per node: whether it reads or writes a partial or a no_sync accumulation (whose
    /// liveness the rank tracks as it issues).
    pub partials: Vec<bool>,
    /// Per node: whether the row issued from it ([`Self::runs`]) is optimizer nodes
    /// only, none aliasing: the executor binds it as one [`overlap_ops::Kernel::Optimizers`]
    /// whose buffers it keeps from step to step (`rank.rs`).
    pub optimizers: Vec<bool>,
}

/// Whether `segs` copy one parameter's `len` elements to the same offsets, each once.
fn identity(segs: &[CopySeg], param: u32, len: u64) -> bool {
    segs.iter().all(|s| s.param == param && s.src == s.dst) && covers(segs.iter(), len)
}

/// Whether the destinations of `segs` tile `0..len` exactly: each element once.
fn covers<'a>(segs: impl Iterator<Item = &'a CopySeg>, len: u64) -> bool {
    let mut spans: Vec<(u64, u64)> = segs.map(|s| (s.dst, s.dst + s.len)).collect();
    spans.sort_unstable();
    let mut at = 0;
    for (a, b) in spans {
        if a != at {
            return false;
        }
        at = b;
    }
    at == len
}

impl Prepared {
    pub(crate) fn new(plan: Arc<Plan>, rank: u32, aliasing: bool) -> Prepared {
        let rp = plan.rank(rank);
        let access: Vec<Access> = rp.nodes.iter().map(|n| plan.access(rank, n)).collect();
        let issue = issue_order(rp);
        let (pack, unpack) = copy_tables(&plan, rank);
        let mut groups = Groups::new(rp.nodes.len());
        if aliasing {
            groups.decide(&plan, rank, &issue, &access, (&pack, &unpack));
        }
        let allocs = groups.allocations(&plan, rank, &access, &unpack);
        let finals = groups.final_accessors(&access);
        let Groups { alias, names, .. } = groups;
        let tags = rp.nodes.iter().map(tag).collect();
        let noop: Vec<bool> = (0..rp.nodes.len())
            .map(|n| {
                crate::bind::moves_nothing(&plan, &rp.nodes[n].op)
                    && allocs[n].is_empty()
                    && finals[n].is_empty()
                    && alias[n].is_none()
            })
            .collect();
        let partial = |b: &Buffer| matches!(b, Buffer::Partial { .. } | Buffer::Accum { .. });
        let plain = (0..rp.nodes.len())
            .map(|n| alias[n].is_none() && allocs[n].is_empty())
            .collect();
        let partials = access
            .iter()
            .map(|a| a.reads.iter().chain(&a.writes).any(partial))
            .collect();
        let streams: Vec<Stream> = rp.nodes.iter().map(|n| n.stream).collect();
        let issue = crate::order::thin(&streams, &noop, issue, |issue, ends| {
            runs(&plan, rank, issue, ends)
        });
        let issue_end = issue_ends(rp.nodes.len(), &issue);
        let runs = runs(&plan, rank, &issue, &issue_end);
        let optimizers = (0..rp.nodes.len())
            .map(|n| {
                (n..runs[n])
                    .all(|m| matches!(rp.nodes[m].op, Op::Optimizer { .. }) && alias[m].is_none())
            })
            .collect();
        Prepared {
            optimizers,
            tags,
            noop,
            plain,
            partials,
            runs,
            clip_is_norm: plan.norm_params(rank) == plan.held_params(rank),
            norm_params: plan.norm_params(rank),
            held_params: plan.held_params(rank),
            plan,
            access,
            issue,
            issue_end,
            finals,
            names,
            alias,
            allocs,
            pack,
            unpack,
        }
    }

    /// The slice of the issue order that issues node `n`.
    pub(crate) fn group(&self, n: usize) -> std::ops::Range<usize> {
        group(&self.issue_end, n)
    }

    /// Every name of the memory a group's first name stands for.
    pub(crate) fn names_of<'a>(&'a self, root: &'a Buffer) -> &'a [Buffer] {
        self.names
            .get(root)
            .map_or(std::slice::from_ref(root), Vec::as_slice)
    }
}

/// The tag the backend reports node `node` by.
fn tag(node: &overlap_graph::Node) -> Tag {
    Tag {
        node: node.id,
        op: node.op.kind(),
        micro_batch: node.micro_batch.unwrap_or(u32::MAX),
    }
}

/// Per node: one past the last node of the row of optimizers, or of publishes, issued
/// as a unit from it (the module docs' conditions), or `n + 1`.
fn runs(plan: &Plan, rank: u32, issue: &[(Stream, Instr)], issue_end: &[usize]) -> Vec<usize> {
    let nodes = &plan.rank(rank).nodes;
    let row_kind = |n: usize| match nodes[n].op {
        Op::Optimizer { .. } => Some(0),
        Op::Publish { .. } => Some(1),
        _ => None,
    };
    let plain = |n: usize| crate::order::plain(&issue[group(issue_end, n)], nodes[n].stream);
    let mut runs: Vec<usize> = (1..=nodes.len()).collect();
    let mut n = 0;
    while n < nodes.len() {
        let (Some(kind), true) = (row_kind(n), plain(n)) else {
            n += 1;
            continue;
        };
        let mut recorded = HashSet::default();
        let mut m = n;
        while m < nodes.len()
            && row_kind(m) == Some(kind)
            && nodes[m].stream == nodes[n].stream
            && plain(m)
        {
            let group = &issue[group(issue_end, m)];
            if group
                .iter()
                .any(|(_, i)| matches!(i, Instr::Wait(e) if recorded.contains(e)))
            {
                break;
            }
            recorded.extend(group.iter().filter_map(|(_, i)| match i {
                Instr::Record(e) => Some(*e),
                _ => None,
            }));
            m += 1;
        }
        for (k, r) in runs.iter_mut().enumerate().take(m).skip(n) {
            *r = m.max(k + 1);
        }
        n = m.max(n + 1);
    }
    runs
}

/// The pack copies of every bucket the rank packs, and the unpack copies of every
/// bucket it unpacks.
fn copy_tables(plan: &Plan, rank: u32) -> (CopyTable, CopyTable) {
    let mut pack = HashMap::default();
    let mut unpack = HashMap::default();
    for n in &plan.rank(rank).nodes {
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
    (pack, unpack)
}

/// Copies per bucket.
type CopyTable = HashMap<BucketId, Arc<[CopySeg]>>;

/// Which names share one piece of memory (module docs, aliasing).
struct Groups {
    /// Per node: `(A, B)` when it makes its output `B` its input `A`'s memory.
    alias: Vec<Option<(Buffer, Buffer)>>,
    /// Per aliased name: its group's first name.
    group: HashMap<Buffer, Buffer>,
    /// Per group's first name: every name of the group.
    names: HashMap<Buffer, Vec<Buffer>>,
}

impl Groups {
    /// Every name its own memory.
    fn new(nodes: usize) -> Groups {
        Groups {
            alias: vec![None; nodes],
            group: HashMap::default(),
            names: HashMap::default(),
        }
    }

    /// Decides, in serial order, which identity nodes alias their output to their
    /// input: those for which [`safe_alias`] holds.
    fn decide(
        &mut self,
        plan: &Plan,
        rank: u32,
        issue: &[(Stream, Instr)],
        access: &[Access],
        (pack, unpack): (&CopyTable, &CopyTable),
    ) {
        let nodes = &plan.rank(rank).nodes;
        let acc = accesses_by_name(access);
        let (order, _) = HappensBefore::from_issue(nodes.len(), issue);
        for (x, node) in nodes.iter().enumerate() {
            let Some((a, b)) = identity_node(plan, rank, node.op, pack, unpack) else {
                continue;
            };
            let x = x as u32;
            let root = self.group.get(&a).copied().unwrap_or(a);
            let g = self.names.get(&root).cloned().unwrap_or_else(|| vec![a]);
            if safe_alias(&order, &acc, x, &g, b) {
                self.alias[x as usize] = Some((a, b));
                self.group.insert(a, root);
                self.group.insert(b, root);
                let list = self.names.entry(root).or_insert_with(|| vec![a]);
                list.push(b);
            }
        }
    }

    /// The first name of `b`'s group.
    fn root_of(&self, b: &Buffer) -> Buffer {
        self.group.get(b).copied().unwrap_or(*b)
    }

    /// Whether every name of the group `root` stands for is transient.
    fn transient(&self, root: &Buffer) -> bool {
        match self.names.get(root) {
            Some(list) => list.iter().all(Buffer::is_transient),
            None => root.is_transient(),
        }
    }

    /// Per node: the first write of each group's memory, pooled when the group is
    /// transient, zeroed when that first access does not write all of it.
    fn allocations(
        &self,
        plan: &Plan,
        rank: u32,
        access: &[Access],
        unpack: &CopyTable,
    ) -> Vec<Vec<(Buffer, Alloc)>> {
        let nodes = &plan.rank(rank).nodes;
        let mut allocs = vec![Vec::new(); nodes.len()];
        let mut seen = HashSet::default();
        for (n, a) in access.iter().enumerate() {
            for w in &a.writes {
                if self.alias[n].is_some_and(|(_, b)| b == *w) || !seen.insert(self.root_of(w)) {
                    continue;
                }
                let zero = !overwrites(nodes[n].op, w, unpack, plan.buffer_len(rank, w));
                allocs[n].push((
                    *w,
                    Alloc {
                        pooled: self.transient(&self.root_of(w)),
                        zero,
                    },
                ));
            }
        }
        allocs
    }

    /// Per node: the transient groups it is a final accessor of (the last write and
    /// every read after it), and whether it is the last one in serial order.
    fn final_accessors(&self, access: &[Access]) -> Vec<Vec<(Buffer, bool)>> {
        let mut last: HashMap<Buffer, (u32, Vec<u32>)> = HashMap::default();
        for (n, a) in access.iter().enumerate() {
            let n = n as u32;
            let transient = |b: &Buffer| Some(self.root_of(b)).filter(|r| self.transient(r));
            for b in a.reads.iter().filter_map(transient) {
                last.entry(b).or_insert_with(|| (n, Vec::new())).1.push(n);
            }
            for b in a.writes.iter().filter_map(transient) {
                last.insert(b, (n, Vec::new()));
            }
        }
        let mut finals = vec![Vec::new(); access.len()];
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
        finals
    }
}

/// Every access of every name, in serial order: (node, writes).
fn accesses_by_name(access: &[Access]) -> HashMap<Buffer, Vec<(u32, bool)>> {
    let mut acc: HashMap<Buffer, Vec<(u32, bool)>> = HashMap::default();
    for (n, a) in access.iter().enumerate() {
        for b in &a.reads {
            acc.entry(*b).or_default().push((n as u32, false));
        }
        for b in &a.writes {
            let list = acc.entry(*b).or_default();
            match list.last_mut() {
                Some(last) if last.0 == n as u32 => last.1 = true,
                _ => list.push((n as u32, true)),
            }
        }
    }
    acc
}

/// `(A, B)` when node `op` writes its output `B` as an unchanged copy of its input `A`.
fn identity_node(
    plan: &Plan,
    rank: u32,
    op: Op,
    pack: &HashMap<BucketId, Arc<[CopySeg]>>,
    unpack: &HashMap<BucketId, Arc<[CopySeg]>>,
) -> Option<(Buffer, Buffer)> {
    let single = |bucket: BucketId| match plan.bucket(bucket).params.as_slice() {
        [p] => Some(*p),
        _ => None,
    };
    match op {
        Op::Pack {
            bucket,
            micro_batch,
            with_accum: false,
        } => {
            let param = single(bucket)?;
            let a = Buffer::Grad { param, micro_batch };
            let b = Buffer::Send {
                bucket,
                micro_batch,
            };
            let n = plan.buffer_len(rank, &b);
            (plan.buffer_len(rank, &a) == n && identity(pack.get(&bucket)?, param, n))
                .then_some((a, b))
        }
        Op::Stage1 {
            bucket,
            micro_batch,
            collective,
        } => stage_identity(plan, rank, (bucket, micro_batch, 1), &collective),
        Op::Stage2 {
            bucket,
            micro_batch,
            collective,
        } => stage_identity(plan, rank, (bucket, micro_batch, 2), &collective),
        Op::Unpack {
            bucket,
            micro_batch,
            accumulate: false,
        } => {
            let param = single(bucket)?;
            let a = Buffer::Stage2Out {
                bucket,
                micro_batch,
            };
            let b = Buffer::Reduced { param };
            let n = plan.buffer_len(rank, &b);
            (plan.buffer_len(rank, &a) == n && identity(unpack.get(&bucket)?, param, n))
                .then_some((a, b))
        }
        _ => None,
    }
}

/// `(A, B)` when Stage `stage` of a bucket and micro-batch copies its input `A` as
/// its output `B`: the rank holds the stage's output, and the collective is an f32 one
/// over a group of one whose count is both buffers' length (the identity: `avg` divides
/// by 1).
fn stage_identity(
    plan: &Plan,
    rank: u32,
    (bucket, micro_batch, stage): (BucketId, u32, u8),
    collective: &Collective,
) -> Option<(Buffer, Buffer)> {
    let (a, b, held) = if stage == 1 {
        (
            Buffer::Send {
                bucket,
                micro_batch,
            },
            Buffer::Stage1Out {
                bucket,
                micro_batch,
            },
            plan.holds_stage1(bucket, rank),
        )
    } else {
        (
            Buffer::Stage1Out {
                bucket,
                micro_batch,
            },
            Buffer::Stage2Out {
                bucket,
                micro_batch,
            },
            plan.holds_stage2(bucket, rank),
        )
    };
    let n = plan.buffer_len(rank, &b);
    (held
        && plan.mesh.group_size(collective.group) == 1
        && collective.dtype == DType::F32
        && collective.count == n
        && plan.buffer_len(rank, &a) == n)
        .then_some((a, b))
}

/// Whether node `x` may make `b` the memory of group `g` (module docs, rules 1–4).
fn safe_alias(
    order: &HappensBefore,
    acc: &HashMap<Buffer, Vec<(u32, bool)>>,
    x: u32,
    g: &[Buffer],
    b: Buffer,
) -> bool {
    let none = Vec::new();
    let of_b = acc.get(&b).unwrap_or(&none);
    // 1. `B` is new at `x`.
    if of_b.first().map(|&(n, _)| n) != Some(x) {
        return false;
    }
    let b_later: Vec<(u32, bool)> = of_b.iter().copied().filter(|&(n, _)| n != x).collect();
    let first_b_write = b_later.iter().find(|&&(_, w)| w).map(|&(n, _)| n);
    let of_g: Vec<(u32, bool)> = g
        .iter()
        .flat_map(|n| acc.get(n).unwrap_or(&none).iter().copied())
        .filter(|&(n, _)| n != x)
        .collect();
    for &(z, w) in &of_g {
        // 2. `G` is not written after `x`, nor accessed after `B`'s next write; its
        //    writes before `x` complete before `x`.
        if z > x && (w || first_b_write.is_some_and(|f| z >= f)) {
            return false;
        }
        if z < x && w && !order.before(z, x) {
            return false;
        }
    }
    // 4. Caller-owned memory is never written nor outlives the step.
    let caller = g.iter().any(|n| matches!(n, Buffer::Grad { .. }));
    if caller && (!b.is_transient() || first_b_write.is_some()) {
        return false;
    }
    // 3. No new race.
    if b.is_transient() {
        of_g.iter().all(|&(z1, w1)| {
            b_later
                .iter()
                .all(|&(z2, w2)| !(w1 || w2) || order.ordered(z1, z2))
        })
    } else {
        of_g.iter().all(|&(z, _)| z < x && order.before(z, x))
    }
}

/// Whether node `op`, the first to access `w` in serial order, writes every element.
fn overwrites(op: Op, w: &Buffer, unpack: &HashMap<BucketId, Arc<[CopySeg]>>, len: u64) -> bool {
    match (op, w) {
        // A pack zeroes what its segments do not cover.
        (Op::Pack { .. }, Buffer::Send { .. }) => true,
        // A collective writes its whole output where the rank holds one.
        (Op::Stage1 { .. }, Buffer::Stage1Out { .. }) => true,
        (Op::Stage2 { .. }, Buffer::Stage2Out { .. }) => true,
        // An exchange fills its receive buffer; a combine writes its whole output, but
        // for an all-reduce only its own chunk, and its gather (which the validator's
        // `exchange-combined-once` requires, and which writes the output, so it runs
        // before any reader) writes the others'.
        (Op::Exchange { .. }, Buffer::Recv { .. }) => true,
        (Op::Combine { stage: 1, .. }, Buffer::Stage1Out { .. }) => true,
        (Op::Combine { stage: 2, .. }, Buffer::Stage2Out { .. }) => true,
        // A gather writes the whole full buffer (the broadcast's root by its copy).
        (Op::Unshard { .. }, Buffer::Full { .. }) => true,
        // The sum of squares stores its one element (`dst[0] = Σ x²`, 0 without sources).
        (Op::GradNorm, Buffer::Norm) => true,
        (Op::Fold { accumulate, .. }, Buffer::Partial { .. }) => !accumulate,
        (Op::Accumulate { accumulate, .. }, Buffer::Accum { .. }) => !accumulate,
        (
            Op::Unpack {
                bucket,
                accumulate: false,
                ..
            },
            Buffer::Reduced { param },
        ) => {
            let segs = unpack.get(&bucket).map(|s| &s[..]).unwrap_or_default();
            covers(segs.iter().filter(|s| s.param == *param), len)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use overlap_graph::{Gate, Mesh, ParamSpec, PlanSpec, Planner, Route};

    use super::*;

    /// GPT-2-like rows: block matrices on Muon, vectors on AdamW, behind the global norm.
    fn plan(mesh: Mesh) -> Arc<Plan> {
        let mut params = Vec::new();
        for layer in 0..4 {
            let p = |n: &str, shape: Vec<u64>, route| {
                ParamSpec::new(format!("h.{layer}.{n}"), shape, route, layer)
            };
            params.push(p("w", vec![8, 16], Route::Muon));
            params.push(p("b", vec![16], Route::Adamw));
            params.push(p("ln", vec![8], Route::Adamw));
        }
        let spec = PlanSpec::new(mesh, params).with_grad_norm(true);
        Arc::new(Planner::new(spec).unwrap().plan(&[Gate::On]).unwrap())
    }

    /// Every rank of each mesh `shard x replicate`, with its plan and its prepared plan.
    fn prepared_ranks(meshes: &[(u32, u32)]) -> Vec<(Arc<Plan>, u32, Prepared)> {
        let mut out = Vec::new();
        for &(shard, replicate) in meshes {
            let plan = plan(Mesh::new(shard, replicate).unwrap());
            for rank in plan.mesh.ranks() {
                out.push((plan.clone(), rank, Prepared::new(plan.clone(), rank, true)));
            }
        }
        out
    }

    /// The rows of `p` as `(start, end)`, each checked against the module docs'
    /// conditions.
    fn rows(plan: &Plan, rank: u32, p: &Prepared) -> Vec<(usize, usize)> {
        let nodes = &plan.rank(rank).nodes;
        let mut out = Vec::new();
        let mut n = 0;
        while n < nodes.len() {
            let end = p.runs[n];
            assert!(end > n && end <= nodes.len());
            if end > n + 1 {
                let (kind, stream) = (nodes[n].op.kind(), nodes[n].stream);
                assert!(matches!(kind, "optimizer" | "publish"), "{kind}");
                let mut recorded = HashSet::default();
                for (m, node) in nodes.iter().enumerate().take(end).skip(n) {
                    assert_eq!((node.op.kind(), node.stream), (kind, stream));
                    assert_eq!(p.runs[m], end, "every node of a row names its end");
                    let group = &p.issue[p.group(m)];
                    let run = group.iter().position(|i| i.1 == Instr::Run(m as u32));
                    let run = run.expect("a node's group runs it");
                    for (j, &(s, ins)) in group.iter().enumerate() {
                        assert_eq!(s, stream);
                        match ins {
                            Instr::Wait(e) => assert!(j < run && !recorded.contains(&e)),
                            Instr::Record(e) => {
                                assert!(j > run);
                                recorded.insert(e);
                            }
                            Instr::Run(_) => assert_eq!(j, run),
                        }
                    }
                }
                out.push((n, end));
            }
            n = end;
        }
        out
    }

    #[test]
    fn a_ranks_optimizers_and_its_publishes_are_issued_as_two_rows() {
        let plan = plan(Mesh::new(1, 1).unwrap());
        let p = Prepared::new(plan.clone(), 0, true);
        let nodes = &plan.rank(0).nodes;
        let of = |kind: &str| nodes.iter().filter(|n| n.op.kind() == kind).count();
        let rows = rows(&plan, 0, &p);
        let lens: Vec<(&str, usize)> = rows
            .iter()
            .map(|&(a, b)| (nodes[a].op.kind(), b - a))
            .collect();
        assert_eq!(
            lens,
            [("optimizer", of("optimizer")), ("publish", of("publish"))]
        );
        assert_eq!(of("optimizer"), 12);
    }

    #[test]
    fn only_collectives_over_a_group_of_one_are_no_ops_and_tags_name_their_nodes() {
        for (plan, rank, p) in prepared_ranks(&[(1, 1), (2, 1), (1, 2)]) {
            for (n, node) in plan.rank(rank).nodes.iter().enumerate() {
                assert_eq!((p.tags[n].node, p.tags[n].op), (n as u32, node.op.kind()));
                let one = match node.op {
                    Op::Publish { collective, .. } | Op::NormReduce { collective } => {
                        plan.mesh.group_size(collective.group) == 1
                    }
                    _ => false,
                };
                assert_eq!(p.noop[n], one, "{}", plan.label(node));
                if one {
                    assert!(p.allocs[n].is_empty() && p.finals[n].is_empty());
                }
            }
        }
    }

    /// The instructions of `p`'s issue order after its last node.
    fn trailing(p: &Prepared) -> &[(Stream, Instr)] {
        &p.issue[p.issue_end.last().copied().unwrap_or(0)..]
    }

    #[test]
    fn without_replicas_the_tail_waits_only_at_the_end_of_the_step() {
        let plan = plan(Mesh::new(1, 1).unwrap());
        let p = Prepared::new(plan.clone(), 0, true);
        let nodes = &plan.rank(0).nodes;
        let waits = |n: usize| {
            p.issue[p.group(n)]
                .iter()
                .filter(|i| matches!(i.1, Instr::Wait(_)))
                .count()
        };
        let records = |n: usize| {
            p.issue[p.group(n)]
                .iter()
                .filter(|i| matches!(i.1, Instr::Record(_)))
                .count()
        };
        let of = |kind: &'static str| (0..nodes.len()).filter(move |&n| nodes[n].op.kind() == kind);
        // The norm's all-reduces and the publishes are no-ops: nothing waits for them,
        // and they wait for nothing; the clip, on the norm's stream, waits for nothing.
        for kind in ["norm_reduce", "publish", "clip"] {
            assert!(of(kind).count() > 0, "{kind}");
            for n in of(kind) {
                assert_eq!((waits(n), records(n)), (0, 0), "{}", plan.label(&nodes[n]));
            }
        }
        // The optimizers' records are one, made after the row.
        let optimizers: Vec<usize> = of("optimizer").collect();
        let made: usize = optimizers.iter().map(|&n| records(n)).sum();
        assert_eq!(made, 1);
        assert_eq!(records(*optimizers.last().unwrap()), 1);
        // What the no-ops waited for is waited for at the end of the step, once per
        // stream and event.
        let end = trailing(&p);
        let mut seen = HashSet::default();
        for &(s, ins) in end {
            if let Instr::Wait(e) = ins {
                assert!(seen.insert((s, e)), "{s} waits twice for e{e}");
            }
        }
        assert!(end.iter().any(|i| i.0 == Stream::Publish));
    }

    #[test]
    fn the_executors_order_is_thinned_on_every_rank_of_every_mesh() {
        for (plan, rank, p) in prepared_ranks(&[(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]) {
            let plans = issue_order(plan.rank(rank));
            let count = |issue: &[(Stream, Instr)]| {
                issue
                    .iter()
                    .filter(|i| !matches!(i.1, Instr::Run(_)))
                    .count()
            };
            assert!(
                count(&p.issue) < count(&plans),
                "mesh {} rank {rank}: {} of {} waits and records",
                plan.mesh,
                count(&p.issue),
                count(&plans)
            );
        }
    }

    #[test]
    fn rows_keep_their_conditions_on_every_rank_of_larger_meshes() {
        for (plan, rank, p) in prepared_ranks(&[(2, 1), (1, 2), (2, 2)]) {
            let rows = rows(&plan, rank, &p);
            let optimizers = plan.rank(rank).nodes.iter();
            if optimizers.filter(|n| n.op.kind() == "optimizer").count() > 1 {
                assert!(!rows.is_empty(), "mesh {} rank {rank}", plan.mesh);
            }
        }
    }
}
