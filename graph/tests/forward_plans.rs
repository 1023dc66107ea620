//! Forward plans (`PlanSpec::forward`): the planner's gathers validate on every mesh,
//! transport, prefetch depth and reshard policy, hold at most `prefetch + 1` layers of
//! full parameters per pass, and leave plans without the forward as they were; the
//! validator rejects, by name, a read before a gather, a gather of stale parameters and
//! a use after free, each made by editing a valid plan's JSON.
//!
//! The fixture is [`four_routes`] with two more layers (`up` fsdp in layer 2, `head`
//! muon in layer 3), so that prefetching has layers to run ahead over: parameter ids
//! 0 `embed` (sharded_adamw, layer 0), 1 `norm` (fsdp, 1), 2 `w` (muon, 1), 3 `b`
//! (adamw, 1), 4 `up` (fsdp, 2), 5 `head` (muon, 3).

mod common;

use common::*;
use overlap_graph::{
    validate, Buffer, ForwardSpec, Gate, Mode, Op, Pass, Plan, PlanSpec, Planner, Route, Schedule,
    Transport, Violation,
};
use serde_json::{json, Value};

use Gate::{NoSync, On, ReplicateOff as Off};

fn params() -> Vec<overlap_graph::ParamSpec> {
    let mut p = four_routes();
    p.push(param("up", &[6, 5], Route::Fsdp, 2));
    p.push(param("head", &[3, 4], Route::Muon, 3));
    p
}

fn forward_spec(s: u32, r: u32, fw: ForwardSpec, transport: Transport) -> PlanSpec {
    spec(s, r, params(), 1 << 20)
        .with_schedule(Schedule::default().with_transport(transport))
        .with_forward(Some(fw))
}

fn plan(s: u32, r: u32, fw: ForwardSpec, gates: &[Gate]) -> Plan {
    Planner::new(forward_spec(s, r, fw, Transport::Nccl))
        .unwrap()
        .plan(gates)
        .unwrap()
}

const MESHES: [(u32, u32); 6] = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (3, 2)];

fn policies() -> Vec<ForwardSpec> {
    let mut out = Vec::new();
    for prefetch in [0, 1, 2, 9] {
        for reshard_after_forward in [true, false] {
            out.push(
                ForwardSpec::default()
                    .with_prefetch(prefetch)
                    .with_reshard_after_forward(reshard_after_forward),
            );
        }
    }
    out
}

#[test]
fn forward_plans_validate_on_every_mesh_transport_prefetch_and_policy() {
    let patterns: [&[Gate]; 3] = [&[On], &[Off, On], &[NoSync, Off, On]];
    for (s, r) in MESHES {
        for transport in [Transport::Nccl, Transport::Copy] {
            for fw in policies() {
                let planner = Planner::new(forward_spec(s, r, fw, transport)).unwrap();
                for gates in patterns {
                    let plan = planner.plan(gates).unwrap();
                    let what = format!("{s}x{r} {transport:?} {fw:?} {gates:?}");
                    assert_eq!(validate(&plan, Mode::Step), Vec::new(), "{what}");
                    let prefix = planner.plan_prefix(&gates[..1]).unwrap();
                    assert_eq!(validate(&prefix, Mode::Prefix), Vec::new(), "{what}");
                    // The prefix property: the prefix's programs begin every program.
                    for (a, b) in prefix.ranks.iter().zip(&plan.ranks) {
                        assert_eq!(a.nodes[..], b.nodes[..a.nodes.len()], "{what}");
                    }
                    let bound = planner.step_nodes_bound(gates.len());
                    let nodes: u64 = plan.ranks.iter().map(|r| r.nodes.len() as u64).sum();
                    assert!(nodes <= bound, "{what}: {nodes} > {bound}");
                }
            }
        }
    }
}

/// Gathered bytes of a layer on a rank.
fn layer_full_bytes(plan: &Plan, layer: u32) -> u64 {
    plan.layer_params(layer)
        .map(|p| plan.full_elems(p) * 4)
        .sum()
}

#[test]
fn at_most_prefetch_plus_one_layers_are_held_per_pass() {
    for (s, r) in MESHES {
        for fw in policies() {
            let plan = plan(s, r, fw, &[Off, On]);
            let layers = plan.layers_desc();
            // The largest `prefetch + 1` consecutive layers, or every layer when the
            // forward's are kept for the backward.
            let window = (fw.prefetch as usize + 1).min(layers.len());
            let sizes: Vec<u64> = layers.iter().map(|&l| layer_full_bytes(&plan, l)).collect();
            let bound = if fw.reshard_after_forward {
                sizes
                    .windows(window)
                    .map(|w| w.iter().sum::<u64>())
                    .max()
                    .unwrap()
            } else {
                sizes.iter().sum()
            };
            for rank in plan.mesh.ranks() {
                let m = plan.memory(rank);
                assert!(
                    m.full_peak_bytes <= bound,
                    "{s}x{r} {fw:?} rank {rank}: {} > {bound}",
                    m.full_peak_bytes
                );
                assert_eq!(m.param_peak_bytes, m.shard_bytes + m.full_peak_bytes);
                assert!(m.full_peak_bytes > 0);
            }
        }
    }
}

#[test]
fn a_plan_without_the_forward_has_none_of_its_nodes_and_no_forward_key() {
    let spec = spec(2, 2, params(), 1 << 20);
    let plan = Planner::new(spec.clone())
        .unwrap()
        .plan(&[Off, On])
        .unwrap();
    assert!(plan.forward.is_none());
    assert!(!plan.to_json().contains("\"forward\""));
    for rp in &plan.ranks {
        assert!(rp.nodes.iter().all(|n| !n.op.is_forward()));
        let m = plan.memory(rp.rank);
        assert_eq!(m.full_peak_bytes, 0);
    }
    // The forward adds its nodes around the same gradient path.
    let with = Planner::new(spec.with_forward(Some(ForwardSpec::default())))
        .unwrap()
        .plan(&[Off, On])
        .unwrap();
    for (a, b) in plan.ranks.iter().zip(&with.ranks) {
        let ops = |rp: &overlap_graph::RankProgram| -> Vec<Op> {
            rp.nodes
                .iter()
                .filter(|n| !n.op.is_forward())
                .map(|n| n.op)
                .collect()
        };
        assert_eq!(ops(a), ops(b));
    }
    let v: Value = serde_json::from_str(&with.to_json()).unwrap();
    assert_eq!(
        v["forward"],
        json!({"prefetch": 1, "reshard_after_forward": true})
    );
}

#[test]
fn every_micro_batch_gathers_each_parameter_for_each_pass_and_frees_it() {
    for fw in policies() {
        let plan = plan(2, 2, fw, &[NoSync, Off, On]);
        for rp in &plan.ranks {
            for m in 0..3 {
                for p in 0..plan.params.len() as u32 {
                    for pass in [Pass::Forward, Pass::Backward] {
                        let count =
                            |f: &dyn Fn(&Op) -> bool| rp.nodes.iter().filter(|n| f(&n.op)).count();
                        let gathers = count(
                            &|op| matches!(*op, Op::Unshard { param, micro_batch, pass: x, .. } if param == p && micro_batch == m && x == pass),
                        );
                        let frees = count(
                            &|op| matches!(*op, Op::Reshard { param, micro_batch, pass: x } if param == p && micro_batch == m && x == pass),
                        );
                        let want = usize::from(pass == Pass::Forward || fw.reshard_after_forward);
                        assert_eq!(
                            (gathers, frees),
                            (want, want),
                            "{fw:?} rank {} p{p} m{m} {pass:?}",
                            rp.rank
                        );
                    }
                }
            }
        }
    }
}

// --- The validator on edited plans ---------------------------------------------------

fn check(v: &Value) -> Vec<Violation> {
    validate(&from_value(v), Mode::Step)
}

#[track_caller]
fn expect<'a>(vs: &'a [Violation], invariant: &str, rank: u32, needle: &str) -> &'a Violation {
    vs.iter()
        .find(|x| x.invariant == invariant && x.rank == rank && x.detail.contains(needle))
        .unwrap_or_else(|| {
            panic!("expected `{invariant}` on rank {rank} with {needle:?}; got {vs:#?}")
        })
}

/// Moves node `id` of `rank` to serial position `to` (`to < id`), renumbering the nodes
/// and the `run`s that name them; its `run` moves to the position of its stream's
/// program that keeps serial order.
fn move_node_earlier(v: &mut Value, rank: usize, id: u64, to: u64) {
    let mut plan = from_value(v);
    let rp = &mut plan.ranks[rank];
    let node = rp.nodes.remove(id as usize);
    let stream = node.stream;
    rp.nodes.insert(to as usize, node);
    let map = |n: u32| -> u32 {
        let (n, id, to) = (n as u64, id, to);
        (if n == id {
            to
        } else if n >= to && n < id {
            n + 1
        } else {
            n
        }) as u32
    };
    for (i, n) in rp.nodes.iter_mut().enumerate() {
        n.id = i as u32;
    }
    for sp in &mut rp.streams {
        let moved = sp.stream == stream;
        let mut instrs: Vec<overlap_graph::Instr> = sp
            .instrs
            .iter()
            .filter(|&&ins| !(moved && ins == overlap_graph::Instr::Run(id as u32)))
            .map(|&ins| match ins {
                overlap_graph::Instr::Run(n) => overlap_graph::Instr::Run(map(n)),
                other => other,
            })
            .collect();
        if moved {
            let pos = instrs
                .iter()
                .position(|i| matches!(*i, overlap_graph::Instr::Run(r) if r as u64 > to))
                .unwrap_or(instrs.len());
            instrs.insert(pos, overlap_graph::Instr::Run(to as u32));
        }
        sp.instrs = instrs;
    }
    *v = to_value(&plan);
}

#[test]
fn a_read_before_its_gather_is_rejected_as_read_after_unshard() {
    // Rank 1's forward of layer 1 in micro-batch 0 moves before the gathers of its
    // parameters: it would read full parameters nothing gathered yet.
    let fw = ForwardSpec::default()
        .with_prefetch(0)
        .with_reshard_after_forward(true);
    let mut v = to_value(&plan(2, 2, fw, &[Off, On]));
    let point = find_node(&v, 1, "forward", json!({"layer": 1}));
    let first_gather = find_node(
        &v,
        1,
        "unshard",
        json!({"param": 1, "micro_batch": 0, "pass": "forward"}),
    );
    assert!(first_gather < point);
    move_node_earlier(&mut v, 1, point, first_gather);
    let vs = check(&v);
    let x = expect(
        &vs,
        "read-after-unshard",
        1,
        "no unshard gathered before it",
    );
    assert_eq!(x.node, Some(first_gather as u32));
    assert!(
        x.detail.starts_with("forward L1 m0 reads full_fwd[p1,m0]"),
        "{}",
        x.detail
    );
}

#[test]
fn a_gather_whose_wait_is_dropped_is_rejected_as_read_after_unshard() {
    // The forward point waits for its gather on the compute stream; without the wait it
    // would read the full parameters while they arrive.
    let mut plan = plan(2, 1, ForwardSpec::default(), &[On]);
    let rp = &plan.ranks[0];
    let point = rp
        .nodes
        .iter()
        .find(|n| n.op == Op::Forward { layer: 0 })
        .unwrap()
        .id;
    let compute = program_mut(&mut plan, 0, overlap_graph::Stream::Compute);
    let at = run_position(compute, point);
    assert!(matches!(compute[at - 1], overlap_graph::Instr::Wait(_)));
    compute.remove(at - 1);
    let vs = validate(&plan, Mode::Step);
    let x = expect(&vs, "read-after-unshard", 0, "without an event chain");
    assert_eq!(x.node, Some(point));
}

#[test]
fn a_gather_of_stale_parameters_is_rejected_as_unshard_reads_latest() {
    // Mesh 2x2: `w` (muon) is owned by rank 0 = (0, 0); the last step's optimizer and
    // publish left it up to date on shard index 0 only (ranks 0 and 2). Shard group
    // r=1 (ranks 2 and 3) broadcasts its copy from rank 2. Edited on both members to
    // broadcast from rank 3 instead, the gather would hand out what rank 3 holds of
    // `w`: no copy of the latest update.
    let mut v = to_value(&plan(2, 2, ForwardSpec::default(), &[Off, On]));
    let mut rooted = 0;
    for rank in [2usize, 3] {
        for id in find_nodes(
            &v,
            rank,
            "unshard",
            json!({"param": W, "micro_batch": 0, "pass": "forward"}),
        ) {
            v["ranks"][rank]["nodes"][id as usize]["op"]["collective"]["root"] = json!(1);
            rooted += 1;
        }
    }
    assert_eq!(rooted, 2);
    let vs = check(&v);
    let x = expect(&vs, "unshard-reads-latest", 3, "stale values");
    assert!(
        x.detail
            .contains("unshard w m0 fwd (broadcast on shard-group(r=1))"),
        "{}",
        x.detail
    );
    // The route's collective is named too; nothing else is wrong with the plan.
    assert!(vs
        .iter()
        .any(|x| x.invariant == "collective-shape" && x.rank == 3));
    assert!(vs
        .iter()
        .all(|x| ["unshard-reads-latest", "collective-shape"].contains(&x.invariant)));
}

#[test]
fn a_gather_after_this_steps_update_is_rejected_as_unshard_reads_latest() {
    // Rank 1's optimizer of `norm` (fsdp) moved before micro-batch 1's gathers: its
    // shard would carry this step's update (computed from part of the gradient) into the
    // forward, while the other members send the values the step started with.
    let mut v = to_value(&plan(2, 1, ForwardSpec::default(), &[Off, On]));
    let opt = find_node(&v, 1, "optimizer", json!({"param": NORM}));
    let gather = find_node(
        &v,
        1,
        "unshard",
        json!({"param": NORM, "micro_batch": 1, "pass": "forward"}),
    );
    move_node_earlier(&mut v, 1, opt, gather);
    let vs = check(&v);
    let x = expect(&vs, "unshard-reads-latest", 1, "of this step wrote it");
    assert_eq!(x.node, Some(gather as u32 + 1));
}

#[test]
fn a_use_after_free_is_rejected_as_reshard_after_last_read() {
    // Rank 0 frees `up`'s forward gather of micro-batch 0 before the forward of layer 2
    // reads it: the gather's memory would be handed to the next gather while read.
    let fw = ForwardSpec::default()
        .with_prefetch(1)
        .with_reshard_after_forward(true);
    let mut v = to_value(&plan(2, 2, fw, &[Off, On]));
    let free = find_node(
        &v,
        0,
        "reshard",
        json!({"param": UP, "micro_batch": 0, "pass": "forward"}),
    );
    let point = find_node(&v, 0, "forward", json!({"layer": 2}));
    assert!(point < free);
    move_node_earlier(&mut v, 0, free, point);
    let vs = check(&v);
    let x = expect(&vs, "reshard-after-last-read", 0, "after reshard up m0 fwd");
    assert_eq!(x.node, Some(point as u32 + 1));
    assert!(
        x.detail.starts_with("forward L2 m0 reads full_fwd[p4,m0]"),
        "{}",
        x.detail
    );
}

#[test]
fn a_free_on_another_stream_than_the_trainers_is_rejected() {
    // The free rebound to the reduce stream, even ordered after the forward point by an
    // event, would not wait for the trainer's kernels that follow the point.
    let mut v = to_value(&plan(2, 1, ForwardSpec::default(), &[On]));
    let free = find_node(
        &v,
        0,
        "reshard",
        json!({"param": EMBED, "micro_batch": 0, "pass": "forward"}),
    );
    let mut plan = from_value(&v);
    plan.ranks[0].nodes[free as usize].stream = overlap_graph::Stream::Reduce;
    let compute = program_mut(&mut plan, 0, overlap_graph::Stream::Compute);
    let at = run_position(compute, free as u32);
    compute.remove(at);
    let e = new_event(&mut plan, 0);
    let compute = program_mut(&mut plan, 0, overlap_graph::Stream::Compute);
    compute.insert(at, overlap_graph::Instr::Record(e));
    let reduce = program_mut(&mut plan, 0, overlap_graph::Stream::Reduce);
    let mut pos = reduce
        .iter()
        .position(|i| matches!(*i, overlap_graph::Instr::Run(r) if r > free as u32))
        .unwrap_or(reduce.len());
    // Before the waits of the later node, which belong to its issue.
    while pos > 0 && matches!(reduce[pos - 1], overlap_graph::Instr::Wait(_)) {
        pos -= 1;
    }
    reduce.insert(pos, overlap_graph::Instr::Run(free as u32));
    reduce.insert(pos, overlap_graph::Instr::Wait(e));
    v = to_value(&plan);
    let vs = check(&v);
    let x = expect(
        &vs,
        "reshard-after-last-read",
        0,
        "the trainer's own kernels follow that point",
    );
    assert_eq!(x.node, Some(free as u32));
    assert!(
        !vs.iter().any(|x| x.invariant == "ordered-access"),
        "{vs:#?}"
    );
}

#[test]
fn a_gather_never_freed_and_a_double_free_are_rejected() {
    let mut v = to_value(&plan(2, 1, ForwardSpec::default(), &[On]));
    let removed = remove_nodes(&mut v, 0, |op| {
        op_matches(op, "reshard", &json!({"param": NORM, "pass": "backward"}))
    });
    assert_eq!(removed, 1);
    let vs = check(&v);
    expect(
        &vs,
        "reshard-after-last-read",
        0,
        "full_bwd[p1,m0], gathered by unshard norm m0 bwd",
    );
    let mut v = to_value(&plan(2, 1, ForwardSpec::default(), &[On]));
    let free = find_node(&v, 0, "reshard", json!({"param": NORM, "pass": "backward"}));
    duplicate_node(&mut v, 0, free);
    let vs = check(&v);
    let x = expect(&vs, "reshard-after-last-read", 0, "again");
    assert_eq!(x.node, Some(free as u32 + 1));
}

#[test]
fn a_missing_or_misplaced_point_is_rejected_as_forward_coverage() {
    let mut v = to_value(&plan(2, 1, ForwardSpec::default(), &[Off, On]));
    let removed = remove_nodes(&mut v, 1, |op| {
        op_matches(op, "backward", &json!({"layer": 2}))
    });
    assert_eq!(removed, 2);
    let vs = check(&v);
    expect(&vs, "forward-coverage", 1, "needs backward L2");
    // A plan without `forward` may not carry its nodes.
    let mut v = to_value(&plan(2, 1, ForwardSpec::default(), &[On]));
    v.as_object_mut().unwrap().remove("forward");
    let e = Plan::from_json(&v.to_string()).unwrap_err();
    assert!(
        e.to_string().contains("node in a plan without `forward`"),
        "{e}"
    );
}

#[test]
fn the_gathers_collectives_are_the_routes() {
    let plan = plan(2, 2, ForwardSpec::default(), &[On]);
    for rp in &plan.ranks {
        for n in &rp.nodes {
            let Op::Unshard {
                param, collective, ..
            } = n.op
            else {
                continue;
            };
            let placed = plan.param(param);
            match placed.owner {
                None => {
                    assert_eq!(collective.kind, overlap_graph::CollectiveKind::AllGather);
                    assert_eq!(collective.count, placed.spec.chunk(2));
                }
                Some(o) => {
                    assert_eq!(collective.kind, overlap_graph::CollectiveKind::Broadcast);
                    assert_eq!(collective.root, Some(o.shard));
                    assert_eq!(collective.count, placed.spec.numel());
                }
            }
            assert_eq!(collective.group, plan.mesh.shard_group(rp.rank));
            // Only a supplying member reads its piece.
            let a = plan.access(rp.rank, n);
            assert_eq!(
                a.reads.contains(&Buffer::Param { param }),
                plan.unshard_supplies(rp.rank, &collective)
            );
        }
    }
}

const EMBED: u64 = 0;
const NORM: u64 = 1;
const W: u64 = 2;
const UP: u64 = 4;
