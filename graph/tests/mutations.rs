//! Mutation testing of the validator: broken plans generated systematically from valid
//! ones, each judged by an oracle written independently of the validator, and every
//! mutant the oracle calls harmful must be rejected by `validate`.
//!
//! **Mutants.** From valid plans of meshes 2x1, 1x2 and 2x2, both transports, and gate
//! patterns with `no_sync`, `off` and `on` micro-batches, and forward plans (the
//! parameter gathers before each layer's forward and backward, prefetched or not, freed
//! after the forward or kept): every node of the mutated ranks
//! deleted, duplicated right after itself, its flag (`accumulate`, `with_accum`)
//! flipped, its micro-batch, bucket or parameter retargeted, its optimizer kind
//! swapped, rebound to another stream (its `run` moved to the place of the other
//! stream's program that keeps serial order, no event added); every `wait` and every
//! `record` dropped; every collective changed on one rank only (count, root, group,
//! kind).
//!
//! **The oracle** decides what a mutant *means*, from first principles and without the
//! validator's code:
//!
//! - *Data.* All ranks' nodes are interpreted in serial order, collectives when every
//!   member reached them, on exact values: per parameter of a buffer, a multiset of
//!   `(micro-batch, source rank)` contributions with the number of reductions applied.
//!   Reading what nothing wrote, a partial after the `fold_partial` that released it, a
//!   no_sync accumulation after the pack that released it, or an all-reduce's output
//!   before its gather yields *garbage*. The observables are what every optimizer
//!   consumes (in order, per rank and parameter) and what every rank holding a
//!   parameter ends the step with (the updates applied, and those received by publish).
//!   In forward plans, a gather hands each member the whole parameter at the version its
//!   suppliers hold (all-gather: every member holds a shard of a sharded parameter, all
//!   at one version; broadcast: the root holds the whole owned parameter), anything else
//!   garbage, and a freed gather reads as garbage; what each trainer's `forward` and
//!   `backward` point reads, every time it runs, is an observable too.
//! - *Order.* On each rank, for every two accesses of one buffer (one a write) the
//!   later one in serial order must be reachable from the earlier through stream order
//!   and record→wait edges (a wait binds to the latest record of its event issued before
//!   it; one issued before any record waits for nothing, as on a GPU).
//! - *Hangs.* A collective whose members issue different calls, a member that never
//!   arrives, or ranks that cannot all advance in serial order.
//!
//! A mutant is **harmful** if its observables differ from the original plan's, if it
//! has an unordered conflicting access, or if it hangs. Everything else keeps the plan's
//! meaning: a redundant wait or record (the order it gave is implied by another chain),
//! a rebinding whose order is still implied by the events in place, a duplicated
//! `stage1` that rewrites its output with the same values before anyone read it, a
//! flag flipped on an `accumulate` whose destination is empty. Such mutants may be
//! rejected or accepted: the
//! validator is allowed to be conservative (it rejects, for instance, every duplicated
//! pack), never lenient. The test fails on any harmful mutant `validate` accepts, and
//! prints the kill ratio.

mod common;

use std::collections::{BTreeMap, HashMap};

use common::*;
use overlap_graph::validate::issue_order;
use overlap_graph::{
    validate, Buffer, CollectiveKind, ForwardSpec, Gate, Group, Instr, Mode, Node, NodeId, Op,
    OptimizerKind, ParamId, Pass, Plan, PlanSpec, Planner, Schedule, Stream, Transport,
};

use Gate::{NoSync, On, ReplicateOff as Off};

// ---------------------------------------------------------------------------------
// The oracle: data

type Counts = BTreeMap<(u32, u32), u32>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Val {
    Garbage,
    /// `reductions` collectives applied; `chunk`: an all-reduce output before its gather.
    V {
        reductions: u8,
        counts: Counts,
        chunk: bool,
    },
}

fn add(a: &Val, b: &Val) -> Val {
    match (a, b) {
        (
            Val::V {
                reductions: la,
                counts: ca,
                chunk: false,
            },
            Val::V {
                reductions: lb,
                counts: cb,
                chunk: false,
            },
        ) if la == lb => {
            let mut c = ca.clone();
            for (k, v) in cb {
                *c.entry(*k).or_insert(0) += v;
            }
            Val::V {
                reductions: *la,
                counts: c,
                chunk: false,
            }
        }
        _ => Val::Garbage,
    }
}

fn reduced_once(v: &Val, chunk: bool) -> Val {
    match v {
        Val::V {
            reductions,
            counts,
            chunk: false,
        } => Val::V {
            reductions: reductions + 1,
            counts: counts.clone(),
            chunk,
        },
        _ => Val::Garbage,
    }
}

/// What the step leaves behind: per (rank, parameter), the values its optimizers
/// consumed (with their kind), and for the ranks holding the parameter, the updates its
/// values carry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Ran {
        consumed: BTreeMap<(u32, ParamId), Vec<(OptimizerKind, Val)>>,
        held: BTreeMap<(u32, ParamId), Vec<Val>>,
        /// Forward plans: what the trainer's points read, per (rank, micro-batch,
        /// forward 0 / backward 1, layer), once per time the point runs.
        trainer: BTreeMap<(u32, u32, u8, u32), Vec<Vec<Full>>>,
    },
    Hangs(String),
}

/// Forward plans: a gathered parameter as the oracle sees it: parameter `p` whole, at
/// the version that carries these updates, or garbage (a member without the values, a
/// mix of versions, memory freed or never gathered).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Full {
    Garbage,
    Whole(ParamId, Vec<Val>),
}

/// Forward plans: every rank's gathered parameters and what the trainer read.
#[derive(Default)]
struct Gathered {
    full: HashMap<(u32, ParamId, u32, Pass), Full>,
    trainer: BTreeMap<(u32, u32, u8, u32), Vec<Vec<Full>>>,
}

impl Gathered {
    /// A point of the trainer on rank `g` reads the full values of every parameter of
    /// its layer, of the pass the plan's forward says.
    fn point(&mut self, plan: &Plan, g: u32, n: &Node) {
        let m = n.micro_batch.unwrap_or(0);
        let (which, layer, pass) = match n.op {
            Op::Forward { layer } => (0, layer, Pass::Forward),
            Op::Backward { layer } => {
                let keep = plan.forward.is_some_and(|f| !f.reshard_after_forward);
                (1, layer, if keep { Pass::Forward } else { Pass::Backward })
            }
            _ => unreachable!(),
        };
        let reads = plan
            .params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.spec.layer == layer)
            .map(|(i, _)| {
                self.full
                    .get(&(g, i as ParamId, m, pass))
                    .cloned()
                    .unwrap_or(Full::Garbage)
            })
            .collect();
        self.trainer
            .entry((g, m, which, layer))
            .or_default()
            .push(reads);
    }
}

/// One rank's buffers: a value per parameter of the bucket (or one for a parameter's own
/// buffers).
type Buffers = HashMap<Buffer, Vec<Val>>;

fn interpret(plan: &Plan) -> Outcome {
    let world = plan.mesh.world();
    let mut bufs: Vec<Buffers> = vec![HashMap::new(); world as usize];
    let mut consumed: BTreeMap<(u32, ParamId), Vec<(OptimizerKind, Val)>> = BTreeMap::new();
    let mut updates: BTreeMap<(u32, ParamId), Vec<Val>> = BTreeMap::new();
    let mut gathered = Gathered::default();
    let mut next = vec![0usize; world as usize];
    let mut calls: HashMap<(u32, Group, Stream), u32> = HashMap::new();
    let mut waiting: HashMap<(Group, Stream, u32), Vec<(u32, NodeId)>> = HashMap::new();
    let mut ready: Vec<u32> = (0..world).collect();
    let width = |b: &Buffer| -> usize {
        match *b {
            Buffer::Send { bucket, .. }
            | Buffer::Stage1Out { bucket, .. }
            | Buffer::Stage2Out { bucket, .. }
            | Buffer::Partial { bucket }
            | Buffer::Recv { bucket, .. } => plan.bucket(bucket).params.len(),
            _ => 1,
        }
    };
    let read = |bufs: &Buffers, b: Buffer| -> Vec<Val> {
        bufs.get(&b)
            .cloned()
            .unwrap_or_else(|| vec![Val::Garbage; width(&b)])
    };
    while let Some(g) = ready.pop() {
        while let Some(n) = plan.rank(g).nodes.get(next[g as usize]) {
            if let Some(c) = n.op.collective() {
                if plan.mesh.index_in(c.group, g).is_none() {
                    return Outcome::Hangs(format!("rank {g} is not in {}", c.group));
                }
                let k = calls.get(&(g, c.group, n.stream)).copied().unwrap_or(0);
                let at = waiting.entry((c.group, n.stream, k)).or_default();
                at.push((g, n.id));
                if at.len() < plan.mesh.group_size(c.group) as usize {
                    break;
                }
                let members = waiting.remove(&(c.group, n.stream, k)).unwrap();
                let call = |r: u32, id: NodeId| {
                    let m = &plan.rank(r).nodes[id as usize];
                    (
                        m.op.kind(),
                        m.op.bucket(),
                        m.op.micro_batch(),
                        *m.op.collective().unwrap(),
                        match m.op {
                            Op::Publish { param, .. } | Op::Unshard { param, .. } => Some(param),
                            _ => None,
                        },
                    )
                };
                let first = call(members[0].0, members[0].1);
                if members.iter().any(|&(r, id)| call(r, id) != first) {
                    return Outcome::Hangs("members issue different calls".into());
                }
                if let Op::Unshard { .. } = n.op {
                    unshard(plan, &mut gathered, &updates, &members);
                } else {
                    run_collective(plan, &mut bufs, &mut updates, &members, &read);
                }
                for (r, _) in members {
                    next[r as usize] += 1;
                    *calls.entry((r, c.group, n.stream)).or_insert(0) += 1;
                    if r != g {
                        ready.push(r);
                    }
                }
                continue;
            }
            match n.op {
                Op::Forward { .. } | Op::Backward { .. } => {
                    gathered.point(plan, g, n);
                    next[g as usize] += 1;
                    continue;
                }
                Op::Reshard {
                    param,
                    micro_batch,
                    pass,
                } => {
                    // The memory goes back: what is read there later is garbage.
                    gathered.full.remove(&(g, param, micro_batch, pass));
                    next[g as usize] += 1;
                    continue;
                }
                _ => {}
            }
            run_local(
                plan,
                g,
                n,
                &mut bufs[g as usize],
                &mut consumed,
                &mut updates,
                &read,
            );
            next[g as usize] += 1;
        }
    }
    if (0..world).any(|g| next[g as usize] < plan.rank(g).nodes.len()) {
        return Outcome::Hangs("not every rank can advance in serial order".into());
    }
    let mut held = BTreeMap::new();
    for (i, p) in plan.params.iter().enumerate() {
        for g in 0..world {
            if p.owner
                .map_or(true, |o| plan.mesh.coord(g).shard == o.shard)
            {
                let k = (g, i as ParamId);
                held.insert(k, updates.get(&k).cloned().unwrap_or_default());
            }
        }
    }
    Outcome::Ran {
        consumed,
        held,
        trainer: gathered.trainer,
    }
}

/// Forward plans: a gather every member reached. All-gather: every member holds a
/// shard of a sharded parameter, all at one version, so the concatenation is the
/// parameter; broadcast: the root holds the whole parameter (an owned one, on the
/// owner's shard column). Anything else hands out garbage.
fn unshard(
    plan: &Plan,
    gathered: &mut Gathered,
    updates: &BTreeMap<(u32, ParamId), Vec<Val>>,
    members: &[(u32, NodeId)],
) {
    let node = |r: u32, id: NodeId| &plan.rank(r).nodes[id as usize];
    let Op::Unshard {
        param, collective, ..
    } = node(members[0].0, members[0].1).op
    else {
        unreachable!()
    };
    let placed = plan.param(param);
    let version = |r: u32| updates.get(&(r, param)).cloned().unwrap_or_default();
    let shard = plan.mesh.shard;
    let value = match (collective.kind, placed.owner) {
        (CollectiveKind::AllGather, None)
            if collective.count == placed.spec.chunk(shard)
                && members
                    .iter()
                    .all(|&(r, _)| version(r) == version(members[0].0)) =>
        {
            Full::Whole(param, version(members[0].0))
        }
        (CollectiveKind::Broadcast, Some(o)) if collective.count == placed.spec.numel() => {
            let root = plan.mesh.members(collective.group)[collective.root.unwrap_or(0) as usize];
            if plan.mesh.coord(root).shard == o.shard {
                Full::Whole(param, version(root))
            } else {
                Full::Garbage
            }
        }
        _ => Full::Garbage,
    };
    for &(r, id) in members {
        if let Op::Unshard {
            param,
            micro_batch,
            pass,
            ..
        } = node(r, id).op
        {
            gathered
                .full
                .insert((r, param, micro_batch, pass), value.clone());
        }
    }
}

fn run_local(
    plan: &Plan,
    g: u32,
    n: &Node,
    bufs: &mut Buffers,
    consumed: &mut BTreeMap<(u32, ParamId), Vec<(OptimizerKind, Val)>>,
    updates: &mut BTreeMap<(u32, ParamId), Vec<Val>>,
    read: &dyn Fn(&Buffers, Buffer) -> Vec<Val>,
) {
    let one = |b: &Buffers, x: Buffer| read(b, x).remove(0);
    match n.op {
        Op::GradReady { layer } => {
            let mb = n.micro_batch.unwrap_or(0);
            for (i, p) in plan.params.iter().enumerate() {
                if p.spec.layer == layer {
                    let v = Val::V {
                        reductions: 0,
                        counts: [((mb, g), 1)].into(),
                        chunk: false,
                    };
                    bufs.insert(
                        Buffer::Grad {
                            param: i as ParamId,
                            micro_batch: mb,
                        },
                        vec![v],
                    );
                }
            }
        }
        Op::Accumulate {
            bucket,
            micro_batch,
            accumulate,
        } => {
            for &p in &plan.bucket(bucket).params {
                let grad = one(
                    bufs,
                    Buffer::Grad {
                        param: p,
                        micro_batch,
                    },
                );
                let acc = Buffer::Accum { param: p };
                let v = if accumulate {
                    add(&one(bufs, acc), &grad)
                } else {
                    grad
                };
                bufs.insert(acc, vec![v]);
            }
        }
        Op::Pack {
            bucket,
            micro_batch,
            with_accum,
        } => {
            let mut send = Vec::new();
            for &p in &plan.bucket(bucket).params {
                let grad = one(
                    bufs,
                    Buffer::Grad {
                        param: p,
                        micro_batch,
                    },
                );
                let acc = Buffer::Accum { param: p };
                send.push(if with_accum {
                    let v = add(&one(bufs, acc), &grad);
                    bufs.remove(&acc); // released: the executor frees it
                    v
                } else {
                    grad
                });
            }
            bufs.insert(
                Buffer::Send {
                    bucket,
                    micro_batch,
                },
                send,
            );
        }
        Op::Fold {
            bucket,
            micro_batch,
            accumulate,
        } => {
            let s1 = read(
                bufs,
                Buffer::Stage1Out {
                    bucket,
                    micro_batch,
                },
            );
            let partial = Buffer::Partial { bucket };
            let v = if accumulate {
                read(bufs, partial)
                    .iter()
                    .zip(&s1)
                    .map(|(a, b)| add(a, b))
                    .collect()
            } else {
                s1
            };
            bufs.insert(partial, v);
        }
        Op::FoldPartial {
            bucket,
            micro_batch,
        } => {
            let s1b = Buffer::Stage1Out {
                bucket,
                micro_batch,
            };
            let partial = read(bufs, Buffer::Partial { bucket });
            bufs.remove(&Buffer::Partial { bucket }); // released
            let v = read(bufs, s1b)
                .iter()
                .zip(&partial)
                .map(|(a, b)| add(a, b))
                .collect();
            bufs.insert(s1b, v);
        }
        Op::Combine {
            bucket,
            micro_batch,
            stage,
            collective,
        } => {
            let (src, _) = plan.stage_input(bucket, micro_batch, stage, g);
            let own = read(bufs, src);
            let recv = read(
                bufs,
                Buffer::Recv {
                    bucket,
                    micro_batch,
                    stage,
                },
            );
            let chunk = collective.kind == CollectiveKind::AllReduce;
            let v = own
                .iter()
                .zip(&recv)
                .map(|(a, b)| reduced_once(&add(a, b), chunk))
                .collect();
            bufs.insert(Plan::stage_output(bucket, micro_batch, stage), v);
        }
        Op::Unpack {
            bucket,
            micro_batch,
            accumulate,
        } => {
            let s2 = read(
                bufs,
                Buffer::Stage2Out {
                    bucket,
                    micro_batch,
                },
            );
            for (i, &p) in plan.bucket(bucket).params.iter().enumerate() {
                let r = Buffer::Reduced { param: p };
                // An all-reduce's output before its gather holds one chunk only.
                let whole = match &s2[i] {
                    Val::V { chunk: true, .. } => Val::Garbage,
                    v => v.clone(),
                };
                let v = if accumulate {
                    add(&one(bufs, r), &whole)
                } else {
                    whole
                };
                bufs.insert(r, vec![v]);
            }
        }
        Op::Optimizer { param, optimizer } => {
            let v = one(bufs, Buffer::Reduced { param });
            consumed
                .entry((g, param))
                .or_default()
                .push((optimizer, v.clone()));
            updates.entry((g, param)).or_default().push(v);
        }
        _ => unreachable!("collectives run in run_collective"),
    }
}

fn run_collective(
    plan: &Plan,
    bufs: &mut [Buffers],
    updates: &mut BTreeMap<(u32, ParamId), Vec<Val>>,
    members: &[(u32, NodeId)],
    read: &dyn Fn(&Buffers, Buffer) -> Vec<Val>,
) {
    let node = |r: u32, id: NodeId| &plan.rank(r).nodes[id as usize];
    let first = node(members[0].0, members[0].1);
    match first.op {
        Op::Stage1 {
            bucket,
            micro_batch,
            ..
        }
        | Op::Stage2 {
            bucket,
            micro_batch,
            ..
        }
        | Op::Exchange {
            bucket,
            micro_batch,
            ..
        } => {
            let stage = first.op.stage().unwrap();
            let exchange = matches!(first.op, Op::Exchange { .. });
            let inputs: Vec<(u32, Vec<Val>)> = members
                .iter()
                .map(|&(r, _)| {
                    let (src, _) = plan.stage_input(bucket, micro_batch, stage, r);
                    (r, read(&bufs[r as usize], src))
                })
                .collect();
            let want = stage - 1;
            for &(r, _) in members {
                let (_, holds) = plan.stage_input(bucket, micro_batch, stage, r);
                if !holds {
                    continue;
                }
                let width = plan.bucket(bucket).params.len();
                let mut sum: Option<Vec<Val>> = None;
                for (q, v) in &inputs {
                    if exchange && *q == r {
                        continue;
                    }
                    let v: Vec<Val> = v
                        .iter()
                        .map(|x| match x {
                            Val::V { reductions, .. } if *reductions == want => x.clone(),
                            _ => Val::Garbage,
                        })
                        .collect();
                    sum = Some(match sum {
                        Some(s) => s.iter().zip(&v).map(|(a, b)| add(a, b)).collect(),
                        None => v,
                    });
                }
                let sum = sum.unwrap_or_else(|| vec![Val::Garbage; width]);
                if exchange {
                    bufs[r as usize].insert(
                        Buffer::Recv {
                            bucket,
                            micro_batch,
                            stage,
                        },
                        sum,
                    );
                } else {
                    let out = sum.iter().map(|v| reduced_once(v, false)).collect();
                    bufs[r as usize].insert(Plan::stage_output(bucket, micro_batch, stage), out);
                }
            }
        }
        Op::Gather {
            bucket,
            micro_batch,
            stage,
            ..
        } => {
            let out = Plan::stage_output(bucket, micro_batch, stage);
            let vals: Vec<Vec<Val>> = members
                .iter()
                .map(|&(r, _)| read(&bufs[r as usize], out))
                .collect();
            let whole = |v: &Val| match v {
                Val::V {
                    reductions,
                    counts,
                    chunk: true,
                } => Val::V {
                    reductions: *reductions,
                    counts: counts.clone(),
                    chunk: false,
                },
                _ => Val::Garbage,
            };
            let agree = vals
                .iter()
                .all(|v| v.iter().map(whole).eq(vals[0].iter().map(whole)));
            for (i, &(r, _)) in members.iter().enumerate() {
                let v = if agree {
                    vals[i].iter().map(whole).collect()
                } else {
                    vec![Val::Garbage; vals[i].len()]
                };
                bufs[r as usize].insert(out, v);
            }
        }
        Op::Publish { param, collective } => {
            let root = collective.root.unwrap_or(0);
            let src = plan.mesh.members(collective.group)[root as usize];
            let v = updates.get(&(src, param)).cloned().unwrap_or_default();
            for &(r, _) in members {
                updates.insert((r, param), v.clone());
            }
        }
        _ => unreachable!(),
    }
}

// ---------------------------------------------------------------------------------
// The oracle: order

/// Whether every conflicting pair of accesses on every rank is ordered by stream order
/// and events.
fn ordered(plan: &Plan) -> bool {
    plan.ranks.iter().all(|rp| {
        let n = rp.nodes.len();
        let words = n.div_ceil(64).max(1);
        // before[id]: the nodes that complete before node `id` starts.
        let mut before = vec![vec![0u64; words]; n];
        let mut stream_reach: HashMap<Stream, Vec<u64>> = HashMap::new();
        let mut recorded: HashMap<u32, Vec<u64>> = HashMap::new();
        for (s, ins) in issue_order(rp) {
            let cur = stream_reach
                .entry(s)
                .or_insert_with(|| vec![0; words])
                .clone();
            match ins {
                Instr::Run(id) => {
                    before[id as usize] = cur.clone();
                    let mut next = cur;
                    next[id as usize / 64] |= 1 << (id % 64);
                    stream_reach.insert(s, next);
                }
                Instr::Record(e) => {
                    recorded.insert(e, cur);
                }
                Instr::Wait(e) => {
                    if let Some(r) = recorded.get(&e) {
                        let next = cur.iter().zip(r).map(|(a, b)| a | b).collect();
                        stream_reach.insert(s, next);
                    }
                }
            }
        }
        let mut accesses: HashMap<Buffer, Vec<(usize, bool)>> = HashMap::new();
        for node in &rp.nodes {
            let a = plan.access(rp.rank, node);
            for b in a.reads {
                accesses
                    .entry(b)
                    .or_default()
                    .push((node.id as usize, false));
            }
            for b in a.writes {
                accesses
                    .entry(b)
                    .or_default()
                    .push((node.id as usize, true));
            }
        }
        accesses.values().all(|list| {
            list.iter().enumerate().all(|(i, &(a, wa))| {
                list[i + 1..].iter().all(|&(b, wb)| {
                    a == b || !(wa || wb) || before[b][a / 64] & (1 << (a % 64)) != 0
                })
            })
        })
    })
}

// ---------------------------------------------------------------------------------
// Mutants

fn renumber(plan: &mut Plan, rank: usize, map: impl Fn(NodeId) -> Option<NodeId>) {
    let rp = &mut plan.ranks[rank];
    for (i, n) in rp.nodes.iter_mut().enumerate() {
        n.id = i as NodeId;
    }
    for sp in &mut rp.streams {
        sp.instrs = sp
            .instrs
            .iter()
            .filter_map(|&ins| match ins {
                Instr::Run(r) => map(r).map(Instr::Run),
                other => Some(other),
            })
            .collect();
    }
}

fn delete(plan: &Plan, rank: usize, id: NodeId) -> Plan {
    let mut p = plan.clone();
    p.ranks[rank].nodes.remove(id as usize);
    renumber(&mut p, rank, |r| match r.cmp(&id) {
        std::cmp::Ordering::Less => Some(r),
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Greater => Some(r - 1),
    });
    p
}

fn duplicate(plan: &Plan, rank: usize, id: NodeId) -> Plan {
    let mut p = plan.clone();
    let copy = p.ranks[rank].nodes[id as usize].clone();
    p.ranks[rank].nodes.insert(id as usize + 1, copy);
    renumber(&mut p, rank, |r| Some(if r > id { r + 1 } else { r }));
    for sp in &mut p.ranks[rank].streams {
        if let Some(pos) = sp.instrs.iter().position(|&i| i == Instr::Run(id)) {
            sp.instrs.insert(pos + 1, Instr::Run(id + 1));
        }
    }
    p
}

fn with_op(plan: &Plan, rank: usize, id: NodeId, f: impl Fn(&mut Node) -> bool) -> Option<Plan> {
    let mut p = plan.clone();
    f(&mut p.ranks[rank].nodes[id as usize]).then_some(p)
}

fn rebind(plan: &Plan, rank: usize, id: NodeId, to: Stream) -> Option<Plan> {
    let mut p = plan.clone();
    let rp = &mut p.ranks[rank];
    let from = rp.nodes[id as usize].stream;
    if from == to {
        return None;
    }
    rp.nodes[id as usize].stream = to;
    for sp in &mut rp.streams {
        sp.instrs.retain(|&i| i != Instr::Run(id));
    }
    if !rp.streams.iter().any(|s| s.stream == to) {
        rp.streams.push(overlap_graph::StreamProgram {
            stream: to,
            instrs: Vec::new(),
        });
    }
    let sp = rp.streams.iter_mut().find(|s| s.stream == to).unwrap();
    let pos = sp
        .instrs
        .iter()
        .position(|&i| matches!(i, Instr::Run(r) if r > id))
        .unwrap_or(sp.instrs.len());
    sp.instrs.insert(pos, Instr::Run(id));
    Some(p)
}

fn drop_instr(plan: &Plan, rank: usize, stream: usize, at: usize) -> Plan {
    let mut p = plan.clone();
    p.ranks[rank].streams[stream].instrs.remove(at);
    p
}

/// Every mutant of the plan on the given ranks, with a label.
fn mutants(plan: &Plan, ranks: &[usize]) -> Vec<(String, Plan)> {
    let mut out: Vec<(String, Plan)> = Vec::new();
    let buckets = plan.buckets.len() as u32;
    let params = plan.params.len() as u32;
    let m = plan.micro_batches();
    for &g in ranks {
        let rp = plan.rank(g as u32);
        for n in &rp.nodes {
            let id = n.id;
            let label = |what: &str| format!("rank {g} node {id} ({}): {what}", plan.label(n));
            out.push((label("deleted"), delete(plan, g, id)));
            out.push((label("duplicated"), duplicate(plan, g, id)));
            let flip = with_op(plan, g, id, |n| match &mut n.op {
                Op::Accumulate { accumulate, .. }
                | Op::Fold { accumulate, .. }
                | Op::Unpack { accumulate, .. } => {
                    *accumulate = !*accumulate;
                    true
                }
                Op::Pack { with_accum, .. } => {
                    *with_accum = !*with_accum;
                    true
                }
                Op::Optimizer { optimizer, .. } => {
                    *optimizer = match optimizer {
                        OptimizerKind::Adamw => OptimizerKind::Muon,
                        OptimizerKind::Muon => OptimizerKind::Adamw,
                    };
                    true
                }
                _ => false,
            });
            out.extend(flip.map(|p| (label("flag or optimizer kind flipped"), p)));
            for b in [1, buckets - 1] {
                let retarget = with_op(plan, g, id, |n| {
                    let next = |x: u32, k: u32| (x + b) % k;
                    match &mut n.op {
                        Op::Optimizer { param, .. }
                        | Op::Publish { param, .. }
                        | Op::Unshard { param, .. }
                        | Op::Reshard { param, .. } => {
                            *param = next(*param, params);
                            params > 1
                        }
                        op => match op.bucket() {
                            Some(_) if buckets > 1 => {
                                set_bucket(op, next(op.bucket().unwrap(), buckets));
                                true
                            }
                            _ => false,
                        },
                    }
                });
                out.extend(retarget.map(|p| (label(&format!("retargeted by {b}")), p)));
            }
            if m > 1 {
                if let Some(mb) = n.micro_batch {
                    let other = (mb + 1) % m;
                    let retarget = with_op(plan, g, id, |n| {
                        n.micro_batch = Some(other);
                        set_micro_batch(&mut n.op, other)
                    });
                    out.extend(retarget.map(|p| (label("moved to the next micro-batch"), p)));
                }
            }
            for s in [
                Stream::Compute,
                Stream::Reduce,
                Stream::Replicate,
                Stream::Copy,
            ] {
                out.extend(rebind(plan, g, id, s).map(|p| (label(&format!("rebound to {s}")), p)));
            }
            if let Some(c) = n.op.collective().copied() {
                let other_group = match c.group {
                    Group::Shard { .. } => plan.mesh.replicate_group(g as u32),
                    Group::Replicate { .. } => plan.mesh.shard_group(g as u32),
                };
                let edits: [(&str, Edit); 4] = [
                    ("count + 1 on one rank", Box::new(|c| c.count += 1)),
                    (
                        "root moved on one rank",
                        Box::new(|c| c.root = Some(c.root.map_or(1, |r| r ^ 1))),
                    ),
                    (
                        "group swapped on one rank",
                        Box::new(move |c| c.group = other_group),
                    ),
                    (
                        "kind changed on one rank",
                        Box::new(|c| {
                            c.kind = match c.kind {
                                CollectiveKind::AllReduce => CollectiveKind::ReduceScatter,
                                _ => CollectiveKind::AllReduce,
                            }
                        }),
                    ),
                ];
                for (what, edit) in edits {
                    let p = with_op(plan, g, id, |n| {
                        if let Some(c) = collective_mut(&mut n.op) {
                            edit(c);
                        }
                        true
                    });
                    out.extend(p.map(|p| (label(what), p)));
                }
            }
        }
        for (si, sp) in rp.streams.iter().enumerate() {
            for (k, ins) in sp.instrs.iter().enumerate() {
                if !matches!(ins, Instr::Run(_)) {
                    out.push((
                        format!(
                            "rank {g} stream {} instruction {k} ({ins:?}) dropped",
                            sp.stream
                        ),
                        drop_instr(plan, g, si, k),
                    ));
                }
            }
        }
    }
    out
}

/// An edit of one rank's collective.
type Edit = Box<dyn Fn(&mut overlap_graph::Collective)>;

fn set_bucket(op: &mut Op, b: u32) {
    match op {
        Op::Accumulate { bucket, .. }
        | Op::Pack { bucket, .. }
        | Op::Stage1 { bucket, .. }
        | Op::Fold { bucket, .. }
        | Op::FoldPartial { bucket, .. }
        | Op::Stage2 { bucket, .. }
        | Op::Exchange { bucket, .. }
        | Op::Combine { bucket, .. }
        | Op::Gather { bucket, .. }
        | Op::Unpack { bucket, .. } => *bucket = b,
        _ => {}
    }
}

fn set_micro_batch(op: &mut Op, m: u32) -> bool {
    match op {
        Op::Accumulate { micro_batch, .. }
        | Op::Pack { micro_batch, .. }
        | Op::Stage1 { micro_batch, .. }
        | Op::Fold { micro_batch, .. }
        | Op::FoldPartial { micro_batch, .. }
        | Op::Stage2 { micro_batch, .. }
        | Op::Exchange { micro_batch, .. }
        | Op::Combine { micro_batch, .. }
        | Op::Gather { micro_batch, .. }
        | Op::Unpack { micro_batch, .. }
        | Op::Unshard { micro_batch, .. }
        | Op::Reshard { micro_batch, .. } => {
            *micro_batch = m;
            true
        }
        Op::GradReady { .. } | Op::Forward { .. } | Op::Backward { .. } => true,
        _ => false,
    }
}

fn collective_mut(op: &mut Op) -> Option<&mut overlap_graph::Collective> {
    match op {
        Op::Stage1 { collective, .. }
        | Op::Stage2 { collective, .. }
        | Op::Exchange { collective, .. }
        | Op::Combine { collective, .. }
        | Op::Gather { collective, .. }
        | Op::Publish { collective, .. }
        | Op::Unshard { collective, .. } => Some(collective),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------

fn base_plans() -> Vec<(String, Plan)> {
    let mut out = Vec::new();
    for (s, r) in [(2, 1), (1, 2), (2, 2)] {
        for transport in [Transport::Nccl, Transport::Copy] {
            for gates in [&[Off, On][..], &[NoSync, Off, On], &[On, NoSync, On]] {
                let mut spec: PlanSpec = spec(s, r, four_routes(), 1 << 20);
                spec.schedule = Schedule::default().with_transport(transport);
                let plan = Planner::new(spec).unwrap().plan(gates).unwrap();
                let name = format!(
                    "mesh {s}x{r}, {transport:?}, gates {}",
                    Gate::pattern_label(gates)
                );
                assert!(validate(&plan, Mode::Step).is_empty(), "{name}");
                out.push((name, plan));
            }
        }
    }
    // Several buckets per layer (a small cap) with combines right after their exchanges.
    let mut spec: PlanSpec = spec(2, 2, four_routes(), 16);
    spec.schedule = Schedule::default()
        .with_transport(Transport::Copy)
        .with_combine_lag(0);
    let gates = [NoSync, Off, On];
    let plan = Planner::new(spec).unwrap().plan(&gates).unwrap();
    assert!(validate(&plan, Mode::Step).is_empty());
    out.push((
        "mesh 2x2, Copy, lag 0, cap 16 B, gates no_sync,off,on".into(),
        plan,
    ));
    out
}

/// Forward plans: the gathers before each layer's forward and backward, on meshes whose
/// shard groups all-gather (2x1, 2x2) or hold everything (1x2), with the gathers right
/// before their use or one layer ahead, freed after the forward or kept for the backward.
fn forward_plans() -> Vec<(String, Plan)> {
    let mut out = Vec::new();
    for (s, r) in [(2, 1), (1, 2), (2, 2)] {
        for (prefetch, reshard_after_forward) in [(1, true), (0, false)] {
            let gates = [NoSync, Off, On];
            let spec = spec(s, r, four_routes(), 1 << 20).with_forward(Some(
                ForwardSpec::default()
                    .with_prefetch(prefetch)
                    .with_reshard_after_forward(reshard_after_forward),
            ));
            let plan = Planner::new(spec).unwrap().plan(&gates).unwrap();
            let name = format!(
                "mesh {s}x{r}, forward prefetch {prefetch} reshard {reshard_after_forward}, gates {}",
                Gate::pattern_label(&gates)
            );
            assert!(validate(&plan, Mode::Step).is_empty(), "{name}");
            out.push((name, plan));
        }
    }
    out
}

#[test]
fn every_harmful_mutant_is_rejected() {
    let (mut total, mut harmful, mut killed_harmful, mut harmless_rejected) = (0, 0, 0, 0);
    let mut survivors: Vec<String> = Vec::new();
    // Mutants of the plans without the forward, then of the forward plans.
    let mut of_forward = 0;
    for (name, plan) in base_plans().into_iter().chain(forward_plans()) {
        if plan.forward.is_some() && of_forward == 0 {
            of_forward = total;
        }
        let base = interpret(&plan);
        assert!(matches!(base, Outcome::Ran { .. }), "{name}: {base:?}");
        assert!(ordered(&plan), "{name}");
        // Ranks 0 and 1 differ in every role the fixture has (owner of `w`, of `b`).
        let ranks: Vec<usize> = (0..plan.mesh.world().min(2) as usize).collect();
        for (what, mutant) in mutants(&plan, &ranks) {
            total += 1;
            let rejected = !validate(&mutant, Mode::Step).is_empty();
            let bad = mutant.check_well_formed().is_err()
                || !ordered(&mutant)
                || interpret(&mutant) != base;
            if bad {
                harmful += 1;
                if rejected {
                    killed_harmful += 1;
                } else {
                    survivors.push(format!("{name}: {what}"));
                }
            } else if rejected {
                harmless_rejected += 1;
            }
        }
    }
    println!(
        "mutants: {total} ({of_forward} of plans without the forward, {} of forward plans)",
        total - of_forward
    );
    println!(
        "mutants: {total}; harmful {harmful}, rejected {killed_harmful} ({:.1}%); harmless {}, of which rejected {harmless_rejected}",
        100.0 * killed_harmful as f64 / harmful.max(1) as f64,
        total - harmful
    );
    assert!(
        survivors.is_empty(),
        "{} harmful mutants accepted, e.g.:\n{}",
        survivors.len(),
        survivors
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
