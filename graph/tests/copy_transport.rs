//! The copy transport's failure modes as rejected plans.
//!
//! A copy-transport stage is two nodes: an exchange (a cross-rank call that only moves
//! chunks) and a combine (local arithmetic, on any stream, possibly layers later). Each
//! test starts from a valid plan on mesh 2x2 with every route (buckets as in
//! `seed_bugs.rs`: b0 fsdp, b1 muon owned by (0, 0), b2 adamw owned by (1, 0), b3
//! sharded_adamw), combines on the compute stream one layer behind, and edits it into a
//! plan a hand-written implementation could produce. The validator must name the
//! invariant, rank, stream and node.

mod common;

use common::*;
use overlap_graph::dag::{lower_rank, Segment};
use overlap_graph::{
    validate, Gate, Instr, Mode, Op, Plan, Planner, Schedule, Stream, Transport, Violation,
};

fn copy_plan(gates: &[Gate]) -> Plan {
    let mut s = spec(2, 2, four_routes(), 1 << 20);
    s.bindings.combine = Stream::Compute;
    s.schedule = Schedule::default()
        .with_transport(Transport::Copy)
        .with_combine_lag(1);
    Planner::new(s).unwrap().plan(gates).unwrap()
}

fn violations(plan: &Plan) -> Vec<Violation> {
    validate(plan, Mode::Step)
}

/// The first node of a rank matching `pred`.
fn node_id(plan: &Plan, rank: u32, pred: impl Fn(&Op) -> bool) -> u32 {
    plan.ranks[rank as usize]
        .nodes
        .iter()
        .find(|n| pred(&n.op))
        .unwrap_or_else(|| panic!("no such node on rank {rank}"))
        .id
}

fn has(vs: &[Violation], invariant: &str, rank: u32, node: u32) -> bool {
    vs.iter()
        .any(|v| v.invariant == invariant && v.rank == rank && v.node == Some(node))
}

#[test]
fn the_fixture_validates_and_uses_the_copy_transport() {
    use Gate::*;
    for gates in [&[On][..], &[ReplicateOff, On], &[NoSync, ReplicateOff, On]] {
        let plan = copy_plan(gates);
        assert_eq!(violations(&plan), vec![], "{}", Gate::pattern_label(gates));
        let ops: Vec<&str> = plan.ranks[0].nodes.iter().map(|n| n.op.kind()).collect();
        assert!(ops.contains(&"exchange") && ops.contains(&"combine"));
        assert!(!ops.contains(&"stage1") && !ops.contains(&"stage2"));
    }
}

#[test]
fn a_dropped_combine_loses_the_exchanged_chunks() {
    let plan = copy_plan(&[Gate::On]);
    let mut v = to_value(&plan);
    // Rank 0 forgets the Stage-1 combine of b0 (fsdp) and everything after it.
    let combine = |op: &serde_json::Value| {
        op_matches(op, "combine", &serde_json::json!({"bucket": 0, "stage": 1}))
    };
    assert_eq!(remove_nodes(&mut v, 0, combine), 1);
    let plan = from_value(&v);
    let vs = violations(&plan);
    let exchange = node_id(&plan, 0, |op| {
        matches!(
            op,
            Op::Exchange {
                bucket: 0,
                stage: 1,
                ..
            }
        )
    });
    assert!(has(&vs, "exchange-combined-once", 0, exchange), "{vs:#?}");
    assert!(vs.iter().any(|x| x.detail.contains("never combined")));
}

#[test]
fn a_combine_run_twice_counts_the_gradient_twice() {
    let mut plan = copy_plan(&[Gate::On]);
    let first = node_id(&plan, 0, |op| {
        matches!(
            op,
            Op::Combine {
                bucket: 0,
                stage: 1,
                ..
            }
        )
    });
    let dup = plan.ranks[0].nodes[first as usize].clone();
    let at = first + 1;
    insert_node(&mut plan, 0, at, dup);
    let prog = program_mut(&mut plan, 0, Stream::Compute);
    let pos = run_position(prog, first);
    prog.insert(pos + 1, Instr::Run(at));
    let vs = violations(&plan);
    let exchange = node_id(&plan, 0, |op| {
        matches!(
            op,
            Op::Exchange {
                bucket: 0,
                stage: 1,
                ..
            }
        )
    });
    assert!(has(&vs, "exchange-combined-once", 0, exchange), "{vs:#?}");
    assert!(vs.iter().any(|x| x.detail.contains("combined 2 times")));
}

#[test]
fn a_combine_that_does_not_wait_for_its_exchange_is_a_race() {
    let mut plan = copy_plan(&[Gate::On]);
    let combine = node_id(&plan, 1, |op| {
        matches!(
            op,
            Op::Combine {
                bucket: 0,
                stage: 1,
                ..
            }
        )
    });
    // Drop the compute stream's last wait before the combine: the one on the exchange.
    let prog = program_mut(&mut plan, 1, Stream::Compute);
    let pos = run_position(prog, combine);
    let w = prog[..pos]
        .iter()
        .rposition(|i| matches!(i, Instr::Wait(_)))
        .expect("the combine waits for its exchange");
    prog.remove(w);
    let vs = violations(&plan);
    assert!(has(&vs, "ordered-access", 1, combine), "{vs:#?}");
}

#[test]
fn a_combine_on_a_rank_that_does_not_receive_is_rejected() {
    // b1 (muon) is reduced to its owner's shard index 0: rank 1 (shard index 1) sends
    // its Stage-1 chunk and receives nothing, so it must not combine.
    let mut plan = copy_plan(&[Gate::On]);
    let src = plan.ranks[0]
        .nodes
        .iter()
        .find(|n| {
            matches!(
                n.op,
                Op::Combine {
                    bucket: 1,
                    stage: 1,
                    ..
                }
            )
        })
        .unwrap()
        .clone();
    let exchange = node_id(&plan, 1, |op| {
        matches!(
            op,
            Op::Exchange {
                bucket: 1,
                stage: 1,
                ..
            }
        )
    });
    let at = exchange + 1;
    let mut node = src;
    // Rank 1's own collective (its group is shard(r=0) too).
    if let Op::Combine { collective, .. } = &mut node.op {
        *collective = plan.stage_collective(1, 1, 1);
    }
    insert_node(&mut plan, 1, at, node);
    let prog = program_mut(&mut plan, 1, Stream::Compute);
    let pos = prog
        .iter()
        .position(|i| matches!(i, Instr::Run(n) if *n > at))
        .unwrap_or(prog.len());
    prog.insert(pos, Instr::Run(at));
    let vs = violations(&plan);
    assert!(has(&vs, "exchange-combined-once", 1, at), "{vs:#?}");
}

#[test]
fn an_exchange_facing_an_nccl_collective_would_hang() {
    // Rank 1 runs b0's Stage 1 as an NCCL reduce-scatter while rank 0 exchanges:
    // on hardware one waits in NCCL, the other for copies that never come.
    let plan = copy_plan(&[Gate::On]);
    let mut v = to_value(&plan);
    let id = find_node(
        &v,
        1,
        "exchange",
        serde_json::json!({"bucket": 0, "stage": 1}),
    );
    let op = &mut v["ranks"][1]["nodes"][id as usize]["op"];
    op["kind"] = serde_json::json!("stage1");
    op.as_object_mut().unwrap().remove("stage");
    // Its combine now has nothing to combine; take it out so the mismatch is the story.
    remove_nodes(&mut v, 1, |op| {
        op_matches(op, "combine", &serde_json::json!({"bucket": 0, "stage": 1}))
    });
    let plan = from_value(&v);
    let vs = violations(&plan);
    assert!(
        vs.iter()
            .any(|x| x.invariant == "collective-match" && x.detail.contains("exchange")),
        "{vs:#?}"
    );
}

#[test]
fn a_stage2_exchange_with_the_replicate_gate_off_is_rejected() {
    let plan = copy_plan(&[Gate::ReplicateOff, Gate::On]);
    let mut v = to_value(&plan);
    // Move micro-batch 1's Stage-2 exchange of b0 into micro-batch 0 on rank 0.
    let id = find_node(
        &v,
        0,
        "exchange",
        serde_json::json!({"bucket": 0, "stage": 2, "micro_batch": 1}),
    );
    let node = &mut v["ranks"][0]["nodes"][id as usize];
    node["micro_batch"] = serde_json::json!(0);
    node["op"]["micro_batch"] = serde_json::json!(0);
    let plan = from_value(&v);
    let vs = violations(&plan);
    assert!(
        vs.iter()
            .any(|x| x.invariant == "gate-conformance" && x.node == Some(id as u32)),
        "{vs:#?}"
    );
}

/// An all-reduce (Stage 2 of fsdp b0 on mesh 2x2) moves as exchange, combine of the
/// rank's chunk, then gather of the chunks, on every replica.
#[test]
fn an_all_reduce_is_exchanged_combined_then_gathered() {
    let plan = copy_plan(&[Gate::On]);
    for rank in 0..4u32 {
        let kinds: Vec<(&str, Stream)> = plan.ranks[rank as usize]
            .nodes
            .iter()
            .filter(|n| n.op.bucket() == Some(0) && n.op.stage() == Some(2))
            .map(|n| (n.op.kind(), n.stream))
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("exchange", Stream::Copy),
                ("combine", Stream::Compute),
                ("gather", Stream::Copy)
            ],
            "rank {rank}"
        );
    }
    // Reduce-scatters and reduces have no gather.
    assert!(plan.ranks.iter().all(|rp| rp
        .nodes
        .iter()
        .filter(|n| n.op.kind() == "gather")
        .all(|n| n.op.bucket() == Some(0) || n.op.bucket() == Some(3))));
}

#[test]
fn a_dropped_gather_leaves_the_other_replicas_without_the_chunk() {
    let plan = copy_plan(&[Gate::On]);
    let mut v = to_value(&plan);
    let gather = |op: &serde_json::Value| {
        op_matches(op, "gather", &serde_json::json!({"bucket": 0, "stage": 2}))
    };
    assert_eq!(remove_nodes(&mut v, 0, gather), 1);
    let plan = from_value(&v);
    let vs = violations(&plan);
    let combine = node_id(&plan, 0, |op| {
        matches!(
            op,
            Op::Combine {
                bucket: 0,
                stage: 2,
                ..
            }
        )
    });
    assert!(has(&vs, "exchange-combined-once", 0, combine), "{vs:#?}");
    assert!(vs.iter().any(|x| x.detail.contains("never gathered")));
    // Its peer still gathers: on hardware it would wait for copies that never come.
    assert!(vs.iter().any(|x| x.invariant == "collective-match"));
}

#[test]
fn a_gather_without_its_combine_hands_out_an_unreduced_chunk() {
    let plan = copy_plan(&[Gate::On]);
    let mut v = to_value(&plan);
    let combine = |op: &serde_json::Value| {
        op_matches(op, "combine", &serde_json::json!({"bucket": 0, "stage": 2}))
    };
    assert_eq!(remove_nodes(&mut v, 2, combine), 1);
    let plan = from_value(&v);
    let vs = violations(&plan);
    let gather = node_id(&plan, 2, |op| {
        matches!(
            op,
            Op::Gather {
                bucket: 0,
                stage: 2,
                ..
            }
        )
    });
    assert!(has(&vs, "exchange-combined-once", 2, gather), "{vs:#?}");
    assert!(vs
        .iter()
        .any(|x| x.detail.contains("no earlier combine reduced")));
}

#[test]
fn only_an_all_reduce_is_gathered() {
    // Rank 0 gathers after b1's (muon, reduce to its owner) Stage-1 combine.
    let plan = copy_plan(&[Gate::On]);
    let mut v = to_value(&plan);
    let id = find_node(
        &v,
        0,
        "gather",
        serde_json::json!({"bucket": 0, "stage": 2}),
    );
    let want = serde_json::to_value(plan.stage_collective(1, 0, 1)).unwrap();
    let op = &mut v["ranks"][0]["nodes"][id as usize]["op"];
    op["bucket"] = serde_json::json!(1);
    op["stage"] = serde_json::json!(1);
    op["collective"] = want;
    let plan = from_value(&v);
    let vs = violations(&plan);
    assert!(
        vs.iter().any(|x| x.invariant == "exchange-combined-once"
            && x.node == Some(id as u32)
            && x.detail.contains("only an all-reduce")),
        "{vs:#?}"
    );
}

/// Lowers rank `r`'s nodes again after an edit of their operations or streams (a
/// one-micro-batch plan: the micro-batch, then the tail), as a planner that made the
/// edited choice would have.
fn relower(plan: &mut Plan, r: u32, edit: impl FnOnce(&mut Vec<overlap_graph::Node>)) {
    let mut nodes = plan.ranks[r as usize].nodes.clone();
    edit(&mut nodes);
    let tail = nodes
        .iter()
        .position(|n| n.micro_batch.is_none())
        .unwrap_or(nodes.len());
    let segments = [
        Segment {
            start: 0,
            end: tail,
            tail: false,
        },
        Segment {
            start: tail,
            end: nodes.len(),
            tail: true,
        },
    ];
    plan.ranks[r as usize] = lower_rank(plan, r, nodes, &segments, &[]);
}

#[test]
fn reading_an_all_reduce_output_before_its_gather_sees_unreduced_chunks() {
    // Rank 0 unpacks b0's Stage-2 output right after its combine, before the gather
    // (the two operations trade places): only its own chunk is reduced there yet.
    let mut plan = copy_plan(&[Gate::On]);
    let at = |plan: &Plan, kind: &str| {
        node_id(plan, 0, |op| {
            op.kind() == kind && op.bucket() == Some(0) && op.stage() != Some(1)
        }) as usize
    };
    let (gather, unpack) = (at(&plan, "gather"), at(&plan, "unpack"));
    relower(&mut plan, 0, |nodes| {
        let (g, u) = (nodes[gather].clone(), nodes[unpack].clone());
        (nodes[gather].op, nodes[gather].stream) = (u.op, u.stream);
        (nodes[unpack].op, nodes[unpack].stream) = (g.op, g.stream);
    });
    let vs = violations(&plan);
    assert!(
        vs.iter().any(|x| x.invariant == "exchange-combined-once"
            && x.rank == 0
            && x.node == Some(gather as u32)
            && x.detail.contains("its gather")),
        "{vs:#?}"
    );
}

#[test]
fn a_gather_off_its_exchanges_communicator_is_rejected() {
    let mut plan = copy_plan(&[Gate::On]);
    let gather = node_id(&plan, 1, |op| {
        op.kind() == "gather" && op.bucket() == Some(0)
    });
    relower(&mut plan, 1, |nodes| {
        nodes[gather as usize].stream = Stream::Replicate
    });
    let vs = violations(&plan);
    assert!(
        vs.iter().any(|x| x.invariant == "exchange-combined-once"
            && x.node == Some(gather)
            && x.detail.contains("exchange's communicator")),
        "{vs:#?}"
    );
}
