//! The four seed bugs the README describes (a well-known distributed-Muon implementation's), and their relatives, as rejected plans.
//!
//! Each test starts from a valid plan built by the [`Planner`] (mesh 2x2, a parameter of
//! every route) and edits it into the buggy plan a hand-written implementation (or a
//! user hand-editing a plan) would produce: through the plan JSON where a user would,
//! through the [`Plan`] struct where that reads better. The validator must reject the
//! result, name the invariant, and point at the rank, stream and node at fault.
//!
//! The fixture on mesh 2x2 (ranks `g = r·2 + s`), buckets in issue order:
//!
//! | bucket | route | params | held after Stage 1 by |
//! | --- | --- | --- | --- |
//! | b0 | fsdp | `norm` | every rank |
//! | b1 | muon, owner (0, 0) | `w` | ranks 0 and 2 (shard index 0) |
//! | b2 | adamw, owner (1, 0) | `b` | ranks 1 and 3 (shard index 1) |
//! | b3 | sharded_adamw | `embed` | every rank |

mod common;

use common::*;
use overlap_graph::{
    validate, Collective, CollectiveKind, Gate, Group, Instr, Mode, Node, Op, Plan, PlanError,
    Planner, Route, Stream, Violation,
};
use serde_json::{json, Value};

use Gate::{NoSync, On, ReplicateOff as Off};

/// The fsdp bucket of the fixture: held by every rank.
const FSDP: u64 = 0;
/// The sharded_adamw bucket of the fixture: held by every rank.
const SHARDED_ADAMW: u64 = 3;

fn violations(plan: &Plan) -> Vec<Violation> {
    validate(plan, Mode::Step)
}

/// The violation of `invariant` at exactly this rank, stream and node, if there is one.
fn at<'a>(
    vs: &'a [Violation],
    invariant: &str,
    rank: u32,
    stream: Stream,
    node: u64,
) -> Option<&'a Violation> {
    vs.iter().find(|v| {
        v.invariant == invariant
            && v.rank == rank
            && v.stream == Some(stream)
            && v.node == Some(node as u32)
    })
}

/// Asserts the violation is there and returns it.
#[track_caller]
fn expect<'a>(
    vs: &'a [Violation],
    invariant: &str,
    rank: u32,
    stream: Stream,
    node: u64,
) -> &'a Violation {
    at(vs, invariant, rank, stream, node).unwrap_or_else(|| {
        panic!(
            "expected `{invariant}` on rank {rank}, stream {stream}, node {node}; got {:#?}",
            vs
        )
    })
}

fn invariants(vs: &[Violation]) -> Vec<&'static str> {
    let mut names: Vec<_> = vs.iter().map(|v| v.invariant).collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// The id of a bucket's Stage-1 node of a micro-batch on a rank, in a plan's JSON.
fn stage1_of(v: &Value, rank: usize, bucket: u64, micro_batch: u64) -> u64 {
    find_node(
        v,
        rank,
        "stage1",
        json!({ "bucket": bucket, "micro_batch": micro_batch }),
    )
}

/// Whether a rank holds a bucket's Stage-1 output (has a fold, or a Stage 2, for it).
fn holds_stage1(plan: &Plan, bucket: u64, rank: u32) -> bool {
    plan.holds_stage1(bucket as u32, rank)
}

#[test]
fn fixture_plans_are_valid() {
    for gates in [&[Off, On][..], &[Off, Off, On], &[NoSync, Off, On]] {
        let plan = four_routes_plan(gates);
        assert_eq!(
            violations(&plan),
            vec![],
            "gates {}",
            Gate::pattern_label(gates)
        );
        assert_eq!(plan.bucket(FSDP as u32).route, Route::Fsdp);
        assert_eq!(plan.bucket(SHARDED_ADAMW as u32).route, Route::ShardedAdamw);
    }
}

// --- Bug 1: unreachable stash -------------------------------------------------------

#[test]
fn unreachable_stash_is_rejected_as_stage1_consumed_once() {
    // The gate-off branch never runs: micro-batch 0's Stage-1 outputs are never folded
    // into the partial, on any rank, for any route.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    for rank in 0..4 {
        let removed = remove_nodes(&mut v, rank, |op| {
            op_matches(op, "fold", &json!({ "micro_batch": 0 }))
        });
        assert!(removed > 0);
    }
    let buggy = from_value(&v);
    let vs = violations(&buggy);

    for rank in 0..4u32 {
        for bucket in 0..4u64 {
            let stage1 = stage1_of(&v, rank as usize, bucket, 0);
            let found = at(&vs, "stage1-consumed-once", rank, Stream::Reduce, stage1);
            if holds_stage1(&buggy, bucket, rank) {
                let found = found.unwrap_or_else(|| panic!("rank {rank} bucket {bucket}: {vs:#?}"));
                assert!(found.detail.contains("never consumed"), "{}", found.detail);
            } else {
                assert!(
                    found.is_none(),
                    "rank {rank} does not hold bucket {bucket}'s Stage-1 output: {found:?}"
                );
            }
        }
    }
    // The optimizer would also see a gradient missing micro-batch 0.
    assert!(invariants(&vs).contains(&"gradient-accounting"), "{vs:#?}");
}

#[test]
fn stash_never_folded_nor_flushed_is_rejected_and_the_optimizer_sees_an_incomplete_gradient() {
    // The same bug where the gate-on micro-batch does not fold the partial either: the
    // rank looks self-consistent, but micro-batch 0 vanishes from every gradient.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    for rank in 0..4 {
        remove_nodes(&mut v, rank, |op| {
            op["kind"] == "fold" || op["kind"] == "fold_partial"
        });
    }
    let buggy = from_value(&v);
    let vs = violations(&buggy);

    let norm_stage1 = stage1_of(&v, 1, FSDP, 0);
    expect(&vs, "stage1-consumed-once", 1, Stream::Reduce, norm_stage1);
    let norm_optimizer = find_node(&v, 1, "optimizer", json!({ "param": 1 }));
    let accounting = expect(
        &vs,
        "gradient-accounting",
        1,
        Stream::Compute,
        norm_optimizer,
    );
    assert!(
        accounting.detail.contains("`norm`") && accounting.detail.contains("{m1}"),
        "{}",
        accounting.detail
    );
}

// --- Bug 2: double counting ---------------------------------------------------------

#[test]
fn double_counting_is_rejected_as_stage1_consumed_once() {
    // Micro-batch 0 (gate off) folds the fsdp bucket's Stage-1 output into the partial
    // and also leaves it in the unpack list: Stage 2 and unpack run on it as well, with
    // correct events and matching collectives on every rank. Only the accounting is wrong.
    let mut plan = four_routes_plan(&[Off, On]);
    let count = plan.stage1_elems(FSDP as u32);
    let reduce = plan.reduce;
    for rank in 0..4u32 {
        let v = to_value(&plan);
        let stage1 = stage1_of(&v, rank as usize, FSDP, 0) as u32;
        let fold = find_node(
            &v,
            rank as usize,
            "fold",
            json!({ "bucket": FSDP, "micro_batch": 0 }),
        ) as u32;
        let later_unpack = find_node(
            &v,
            rank as usize,
            "unpack",
            json!({ "bucket": FSDP, "micro_batch": 1 }),
        ) as usize;
        let group = Group::Replicate {
            shard: plan.mesh.coord(rank).shard,
        };
        let collective = Collective {
            kind: CollectiveKind::AllReduce,
            group,
            count,
            dtype: reduce.dtype,
            op: reduce.op,
            root: None,
        };
        let (stage2, unpack) = (fold + 1, fold + 2);
        let node = |op| Node {
            id: 0,
            micro_batch: Some(0),
            stream: Stream::Replicate,
            op,
        };
        insert_node(
            &mut plan,
            rank,
            stage2,
            node(Op::Stage2 {
                bucket: FSDP as u32,
                micro_batch: 0,
                collective,
            }),
        );
        insert_node(
            &mut plan,
            rank,
            unpack,
            node(Op::Unpack {
                bucket: FSDP as u32,
                micro_batch: 0,
                accumulate: false,
            }),
        );
        // The later unpack now adds to the reduced gradient.
        if let Op::Unpack { accumulate, .. } =
            &mut plan.ranks[rank as usize].nodes[later_unpack + 2].op
        {
            *accumulate = true;
        }
        let e = new_event(&mut plan, rank);
        let red = program_mut(&mut plan, rank, Stream::Reduce);
        let after_stage1 = run_position(red, stage1) + 1;
        red.insert(after_stage1, Instr::Record(e));
        let rep = program_mut(&mut plan, rank, Stream::Replicate);
        rep.splice(
            0..0,
            [Instr::Wait(e), Instr::Run(stage2), Instr::Run(unpack)],
        );
    }
    let buggy = Plan::from_json(&plan.to_json()).expect("the edited plan is well formed");
    let vs = violations(&buggy);

    let v = to_value(&buggy);
    for rank in 0..4u32 {
        let stage1 = stage1_of(&v, rank as usize, FSDP, 0);
        let found = expect(&vs, "stage1-consumed-once", rank, Stream::Reduce, stage1);
        assert!(
            found.detail.contains("consumed 2 times"),
            "{}",
            found.detail
        );
        assert!(found.detail.contains("fsdp: norm"), "{}", found.detail);
    }
    // The optimizer of `norm` would see micro-batch 0 twice.
    let norm_optimizer = find_node(&v, 0, "optimizer", json!({ "param": 1 }));
    let accounting = expect(
        &vs,
        "gradient-accounting",
        0,
        Stream::Compute,
        norm_optimizer,
    );
    assert!(accounting.detail.contains("m0x2"), "{}", accounting.detail);
    assert!(
        !invariants(&vs).contains(&"ordered-access"),
        "the events are right: {vs:#?}"
    );
    assert!(
        !invariants(&vs).contains(&"collective-match"),
        "the collectives match: {vs:#?}"
    );
}

// --- Bug 3: stream ordering ---------------------------------------------------------

/// Moves rank 1's fold of the fsdp bucket in micro-batch 0 onto the compute stream, where
/// a hook firing after backward would run it: right after the `grad_ready` of its layer.
fn fold_on_compute_stream(v: &mut Value) -> u64 {
    let rank = 1;
    let fold = find_node(v, rank, "fold", json!({ "bucket": FSDP, "micro_batch": 0 }));
    let grad_ready = find_node(v, rank, "grad_ready", json!({ "layer": 1 }));
    v["ranks"][rank]["nodes"][fold as usize]["stream"] = json!("compute");
    instrs_mut(v, rank, "reduce").retain(|i| *i != json!({ "run": fold }));
    let compute = instrs_mut(v, rank, "compute");
    let mut pos = compute
        .iter()
        .position(|i| *i == json!({ "run": grad_ready }))
        .unwrap()
        + 1;
    while compute[pos].get("record").is_some() {
        pos += 1;
    }
    compute.insert(pos, json!({ "run": fold }));
    fold
}

#[test]
fn fold_on_the_compute_stream_without_an_event_after_stage1_is_rejected_as_ordered_access() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let fold = fold_on_compute_stream(&mut v);
    let buggy = from_value(&v);
    let vs = violations(&buggy);

    let found = expect(&vs, "ordered-access", 1, Stream::Compute, fold);
    assert!(
        found.detail.contains("stage1_out[b0,m0]"),
        "{}",
        found.detail
    );
    assert!(
        found.detail.contains("stream reduce"),
        "names the producer's stream: {}",
        found.detail
    );
    assert!(
        vs.iter().all(|v| v.rank == 1),
        "only rank 1 was edited: {vs:#?}"
    );
}

#[test]
fn fold_on_the_compute_stream_after_an_event_from_stage1_is_accepted() {
    // The same binding made correct: Stage 1 records an event, the compute stream waits
    // on it before the fold. Any stream is allowed when the events keep the order.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let fold = fold_on_compute_stream(&mut v) as u32;
    let stage1 = stage1_of(&v, 1, FSDP, 0) as u32;
    let mut fixed = from_value(&v);
    let e = new_event(&mut fixed, 1);
    let red = program_mut(&mut fixed, 1, Stream::Reduce);
    let after_stage1 = run_position(red, stage1) + 1;
    red.insert(after_stage1, Instr::Record(e));
    let compute = program_mut(&mut fixed, 1, Stream::Compute);
    let before_fold = run_position(compute, fold);
    compute.insert(before_fold, Instr::Wait(e));

    assert_eq!(violations(&fixed), vec![]);
}

#[test]
fn fold_bound_to_the_compute_stream_by_the_planner_is_accepted() {
    let mut s = spec(2, 2, four_routes(), 1 << 20);
    s.bindings.fold = Stream::Compute;
    let plan = Planner::new(s).unwrap().plan(&[Off, Off, On]).unwrap();
    assert!(plan
        .ranks
        .iter()
        .flat_map(|r| &r.nodes)
        .any(|n| matches!(n.op, Op::Fold { .. }) && n.stream == Stream::Compute));
    assert_eq!(violations(&plan), vec![]);
}

// --- Bug 4: a route forgotten -------------------------------------------------------

#[test]
fn forgotten_sharded_adamw_stash_is_rejected_naming_the_parameter() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    for rank in 0..4 {
        let removed = remove_nodes(&mut v, rank, |op| {
            op_matches(op, "fold", &json!({ "bucket": SHARDED_ADAMW }))
        });
        assert_eq!(removed, 1);
    }
    let buggy = from_value(&v);
    let vs = violations(&buggy);

    for rank in 0..4u32 {
        let stage1 = stage1_of(&v, rank as usize, SHARDED_ADAMW, 0);
        let found = expect(&vs, "stage1-consumed-once", rank, Stream::Reduce, stage1);
        assert!(
            found.detail.contains("sharded_adamw: embed"),
            "{}",
            found.detail
        );
    }
    let others: Vec<_> = vs
        .iter()
        .filter(|x| x.invariant == "stage1-consumed-once" && !x.detail.contains("sharded_adamw"))
        .collect();
    assert!(
        others.is_empty(),
        "the other routes still fold: {others:#?}"
    );
}

#[test]
fn micro_batch_overwriting_the_previous_partial_is_rejected_as_gradient_accounting() {
    // Bug 4's symptom: with two gate-off micro-batches, the second one's fold of the
    // sharded_adamw bucket initialises the partial instead of adding to it.
    let plan = four_routes_plan(&[Off, Off, On]);
    let mut v = to_value(&plan);
    let mut folds = Vec::new();
    for rank in 0..4 {
        let fold = find_node(
            &v,
            rank,
            "fold",
            json!({ "bucket": SHARDED_ADAMW, "micro_batch": 1 }),
        );
        let op = &mut v["ranks"][rank]["nodes"][fold as usize]["op"];
        assert_eq!(op["accumulate"], json!(true));
        op["accumulate"] = json!(false);
        folds.push(fold);
    }
    let buggy = from_value(&v);
    let vs = violations(&buggy);

    for (rank, &fold) in folds.iter().enumerate() {
        let found = expect(
            &vs,
            "gradient-accounting",
            rank as u32,
            Stream::Reduce,
            fold,
        );
        assert!(
            found.detail.contains("overwrites the live partial"),
            "{}",
            found.detail
        );
    }
    let embed_optimizer = find_node(&v, 0, "optimizer", json!({ "param": 0 }));
    let accounting = expect(
        &vs,
        "gradient-accounting",
        0,
        Stream::Compute,
        embed_optimizer,
    );
    assert!(
        accounting.detail.contains("`embed`"),
        "{}",
        accounting.detail
    );
}

// --- The end of the step ------------------------------------------------------------

#[test]
fn step_ending_gate_off_is_rejected_as_partials_flushed_naming_the_parameters() {
    let plan = four_routes_plan(&[Off]);
    let v = to_value(&plan);
    let vs = violations(&plan);

    let names = ["norm", "w", "b", "embed"];
    for rank in 0..4u32 {
        for bucket in 0..4u64 {
            let folds = find_nodes(&v, rank as usize, "fold", json!({ "bucket": bucket }));
            if !holds_stage1(&plan, bucket, rank) {
                assert!(folds.is_empty());
                continue;
            }
            let found = expect(&vs, "partials-flushed", rank, Stream::Reduce, folds[0]);
            assert!(
                found.detail.contains(&format!(
                    "partial of bucket {bucket} ({})",
                    names[bucket as usize]
                )),
                "{}",
                found.detail
            );
        }
    }
}

#[test]
fn step_ending_no_sync_is_rejected_as_partials_flushed_naming_the_parameters() {
    let plan = four_routes_plan(&[On, NoSync]);
    let v = to_value(&plan);
    let vs = violations(&plan);

    let accumulate = find_node(&v, 3, "accumulate", json!({ "bucket": FSDP }));
    let found = expect(&vs, "partials-flushed", 3, Stream::Compute, accumulate);
    assert!(
        found.detail.contains("no_sync accumulation of `norm`"),
        "{}",
        found.detail
    );
}

#[test]
fn prefix_ending_gate_off_is_accepted_in_prefix_mode() {
    // The same plans are fine as the micro-batches issued so far.
    let planner = Planner::new(spec(2, 2, four_routes(), 1 << 20)).unwrap();
    for gates in [&[Off][..], &[On, NoSync], &[NoSync, Off]] {
        let prefix = planner.plan_prefix(gates).unwrap();
        assert_eq!(
            validate(&prefix, Mode::Prefix),
            vec![],
            "gates {}",
            Gate::pattern_label(gates)
        );
    }
}

// --- Collectives ----------------------------------------------------------------------

#[test]
fn collective_count_differing_on_one_rank_is_rejected_as_collective_shape_and_collective_match() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let stage1 = stage1_of(&v, 1, FSDP, 0);
    let count = &mut v["ranks"][1]["nodes"][stage1 as usize]["op"]["collective"]["count"];
    assert_eq!(*count, json!(3));
    *count = json!(4);
    let vs = violations(&from_value(&v));

    let shape = expect(&vs, "collective-shape", 1, Stream::Reduce, stage1);
    assert!(
        shape.detail.contains("issues reduce_scatter of 4"),
        "{}",
        shape.detail
    );
    assert!(
        shape.detail.contains("needs reduce_scatter of 3"),
        "{}",
        shape.detail
    );
    // Two members disagree and neither is a majority: the one whose call its route does
    // not require (rank 1) is blamed, and the detail names both calls.
    let matching = vs
        .iter()
        .find(|x| x.invariant == "collective-match")
        .unwrap_or_else(|| panic!("{vs:#?}"));
    assert_eq!(
        (matching.rank, matching.stream, matching.node),
        (1, Some(Stream::Reduce), Some(stage1 as u32))
    );
    assert!(
        matching.detail.contains("the call its route requires"),
        "{}",
        matching.detail
    );
    assert!(
        matching.detail.contains("reduce_scatter of 3")
            && matching.detail.contains("reduce_scatter of 4"),
        "{}",
        matching.detail
    );
    assert_eq!(
        invariants(&vs),
        vec!["collective-match", "collective-shape"]
    );
}

#[test]
fn collective_mismatch_is_blamed_on_the_odd_rank_out() {
    // Mesh 4x1: rank 0 alone issues a different count; ranks 1 to 3 agree.
    let plan = four_routes_plan_on(4, 1, &[Off, On]);
    let mut v = to_value(&plan);
    let stage1 = stage1_of(&v, 0, FSDP, 0);
    v["ranks"][0]["nodes"][stage1 as usize]["op"]["collective"]["count"] = json!(99);
    let vs = violations(&from_value(&v));

    expect(&vs, "collective-match", 0, Stream::Reduce, stage1);
    let blamed: Vec<u32> = vs
        .iter()
        .filter(|x| x.invariant == "collective-match")
        .map(|x| x.rank)
        .collect();
    assert_eq!(blamed, vec![0], "{vs:#?}");
}

#[test]
fn stage1_collectives_issued_in_another_order_on_one_rank_are_rejected_as_collective_match() {
    // Mesh 4x1. Rank 1 runs the chains (pack, Stage 1, fold) of buckets b0 and b2 in
    // swapped order: the rank is consistent by itself, every collective has the shape
    // its bucket needs, but its shard group would hang.
    let plan = four_routes_plan_on(4, 1, &[Off, On]);
    let mut v = to_value(&plan);
    let chain = |v: &Value, bucket: u64| -> Vec<u64> {
        let m0 = json!({ "bucket": bucket, "micro_batch": 0 });
        ["pack", "stage1", "fold"]
            .iter()
            .map(|k| find_node(v, 1, k, m0.clone()))
            .collect()
    };
    let (a, b) = (chain(&v, FSDP), chain(&v, 2));
    let nodes = v["ranks"][1]["nodes"].as_array_mut().unwrap();
    for (&x, &y) in a.iter().zip(&b) {
        let ox = nodes[x as usize]["op"].take();
        let oy = std::mem::replace(&mut nodes[y as usize]["op"], ox);
        nodes[x as usize]["op"] = oy;
    }
    let vs = violations(&from_value(&v));

    let first_stage1_of_rank1 = a[1];
    let found = expect(
        &vs,
        "collective-match",
        1,
        Stream::Reduce,
        first_stage1_of_rank1,
    );
    assert!(
        found.detail.contains("stage1 b2 m0") && found.detail.contains("stage1 b0 m0"),
        "{}",
        found.detail
    );
    assert_eq!(
        invariants(&vs),
        vec!["collective-match"],
        "rank 1 is consistent by itself: {vs:#?}"
    );
}

#[test]
fn identically_shaped_buckets_swapped_on_one_rank_are_rejected_as_collective_match() {
    // Mesh 3x1, two fsdp buckets of the same size: rank 1 reduces b1 where ranks 0 and 2
    // reduce b0. It would not hang, but each reduction would mix two parameters' gradients.
    let params = vec![
        param("a", &[6], Route::Fsdp, 0),
        param("b", &[6], Route::Fsdp, 0),
    ];
    let plan = Planner::new(spec(3, 1, params, 8))
        .unwrap()
        .plan(&[On])
        .unwrap();
    assert_eq!(plan.buckets.len(), 2);
    let mut v = to_value(&plan);
    for n in v["ranks"][1]["nodes"].as_array_mut().unwrap() {
        if let Some(b) = n["op"].get("bucket").and_then(Value::as_u64) {
            n["op"]["bucket"] = json!(1 - b);
        }
    }
    let vs = violations(&from_value(&v));

    let stage1 = stage1_of(&v, 1, 1, 0);
    expect(&vs, "collective-match", 1, Stream::Reduce, stage1);
    assert!(!invariants(&vs).contains(&"collective-shape"), "{vs:#?}");
}

/// Sets a field of the collective of every node of `kind` (and `fields`) on every rank.
fn set_collective(
    v: &mut Value,
    kind: &str,
    fields: Value,
    set: impl Fn(usize, &mut Value),
) -> Vec<(u32, u64)> {
    let mut edited = Vec::new();
    for rank in 0..v["ranks"].as_array().unwrap().len() {
        for id in find_nodes(v, rank, kind, fields.clone()) {
            set(
                rank,
                &mut v["ranks"][rank]["nodes"][id as usize]["op"]["collective"],
            );
            edited.push((rank as u32, id));
        }
    }
    edited
}

#[test]
fn stage1_count_that_disagrees_with_the_bucket_size_is_rejected_as_collective_shape() {
    // Every rank agrees on the wrong count: no hang, but a truncated reduction.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let edited = set_collective(&mut v, "stage1", json!({ "bucket": FSDP }), |_, c| {
        c["count"] = json!(1)
    });
    let vs = violations(&from_value(&v));

    for (rank, node) in edited {
        let found = expect(&vs, "collective-shape", rank, Stream::Reduce, node);
        assert!(
            found.detail.contains("needs reduce_scatter of 3"),
            "{}",
            found.detail
        );
    }
}

#[test]
fn stage1_on_the_replicate_group_is_rejected_as_collective_shape() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let edited = set_collective(&mut v, "stage1", json!({ "bucket": FSDP }), |rank, c| {
        c["group"] = json!({ "kind": "replicate", "shard": rank % 2 });
    });
    let vs = violations(&from_value(&v));

    for (rank, node) in edited {
        expect(&vs, "collective-shape", rank, Stream::Reduce, node);
    }
}

#[test]
fn stage1_rooted_away_from_the_owner_is_rejected_as_collective_shape() {
    // b1 (muon) is owned by (0, 0): its Stage 1 must reduce to shard index 0.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let edited = set_collective(&mut v, "stage1", json!({ "bucket": 1 }), |_, c| {
        c["root"] = json!(1)
    });
    let vs = violations(&from_value(&v));

    for (rank, node) in edited {
        let found = expect(&vs, "collective-shape", rank, Stream::Reduce, node);
        assert!(found.detail.contains("root 0"), "{}", found.detail);
    }
}

#[test]
fn publish_rooted_away_from_the_owner_is_rejected_as_collective_shape() {
    // Owners are at r = 0; a broadcast from r = 1 would overwrite the update with a
    // stale parameter.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let edited = set_collective(&mut v, "publish", json!({}), |_, c| c["root"] = json!(1));
    assert!(!edited.is_empty());
    let vs = violations(&from_value(&v));

    for (rank, node) in edited {
        expect(&vs, "collective-shape", rank, Stream::Publish, node);
    }
}

#[test]
fn reduction_op_other_than_the_plans_is_rejected_as_collective_shape() {
    // The plan averages; a Stage 1 that sums on every rank would scale gradients by S.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let edited = set_collective(&mut v, "stage1", json!({}), |_, c| c["op"] = json!("sum"));
    let vs = violations(&from_value(&v));

    for (rank, node) in edited {
        expect(&vs, "collective-shape", rank, Stream::Reduce, node);
    }
}

// --- Events ---------------------------------------------------------------------------

#[test]
fn wait_on_an_event_never_recorded_is_rejected_as_event_order() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let e = v["ranks"][2]["events"].as_u64().unwrap();
    v["ranks"][2]["events"] = json!(e + 1);
    instrs_mut(&mut v, 2, "replicate").insert(0, json!({ "wait": e }));
    let vs = violations(&from_value(&v));

    let found = vs
        .iter()
        .find(|x| x.invariant == "event-order")
        .unwrap_or_else(|| panic!("{vs:#?}"));
    assert_eq!(
        (found.rank, found.stream, found.node),
        (2, Some(Stream::Replicate), None)
    );
    assert!(
        found.detail.contains(&format!("event {e}")),
        "{}",
        found.detail
    );
}

#[test]
fn wait_issued_before_its_record_is_rejected_as_event_order() {
    // Rank 0's compute stream records the "layer 1 gradients ready" event one node late:
    // the reduce stream's wait on it is issued first and would not wait at all.
    let mut plan = four_routes_plan(&[Off, On]);
    let compute = program_mut(&mut plan, 0, Stream::Compute);
    assert_eq!(compute[0], Instr::Run(0));
    let Instr::Record(e) = compute.remove(1) else {
        panic!("grad_ready records an event: {compute:?}")
    };
    let next_run = 1 + compute[1..]
        .iter()
        .position(|i| matches!(i, Instr::Run(_)))
        .unwrap();
    compute.insert(next_run + 1, Instr::Record(e));
    let waiter = plan.ranks[0]
        .streams
        .iter()
        .find(|s| s.instrs.contains(&Instr::Wait(e)))
        .map(|s| s.stream)
        .expect("someone waits on the event");
    let vs = violations(&plan);

    let found = vs
        .iter()
        .find(|x| x.invariant == "event-order")
        .unwrap_or_else(|| panic!("{vs:#?}"));
    assert_eq!((found.rank, found.stream), (0, Some(waiter)));
    assert!(
        found.detail.contains(&format!("event {e}")),
        "{}",
        found.detail
    );
}

// --- Malformed plans: a PlanError naming the JSON path --------------------------------

/// Where loading a plan failed: path, reason, and the rank, stream and node at fault.
#[derive(Debug)]
struct Malformed {
    path: String,
    reason: String,
    at: (u32, Option<Stream>, Option<u32>),
}

#[track_caller]
fn load_error(v: &Value) -> Malformed {
    match Plan::from_json(&v.to_string()) {
        Err(PlanError::Malformed {
            path,
            reason,
            rank,
            stream,
            node,
        }) => Malformed {
            path,
            reason,
            at: (rank, stream, node),
        },
        other => panic!("expected PlanError::Malformed, got {other:?}"),
    }
}

/// Index of a stream's program in a rank's `streams` array.
fn stream_index(v: &Value, rank: usize, stream: &str) -> usize {
    v["ranks"][rank]["streams"]
        .as_array()
        .unwrap()
        .iter()
        .position(|s| s["stream"] == stream)
        .unwrap()
}

#[test]
fn node_listed_on_a_stream_it_is_not_bound_to_is_a_plan_error_naming_the_instruction() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let stage1 = stage1_of(&v, 1, FSDP, 0);
    v["ranks"][1]["nodes"][stage1 as usize]["stream"] = json!("replicate");
    let si = stream_index(&v, 1, "reduce");
    let ii = instrs_mut(&mut v, 1, "reduce")
        .iter()
        .position(|i| *i == json!({ "run": stage1 }))
        .unwrap();

    let e = load_error(&v);
    assert_eq!(e.path, format!("ranks[1].streams[{si}].instrs[{ii}]"));
    assert!(
        e.reason
            .contains("bound to stream replicate but listed on reduce"),
        "{}",
        e.reason
    );
    assert_eq!(e.at, (1, Some(Stream::Reduce), Some(stage1 as u32)));
}

#[test]
fn run_of_a_node_id_out_of_range_is_a_plan_error_naming_the_instruction() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    instrs_mut(&mut v, 1, "compute").insert(3, json!({ "run": 999 }));
    let si = stream_index(&v, 1, "compute");

    let e = load_error(&v);
    assert_eq!(e.path, format!("ranks[1].streams[{si}].instrs[3]"));
    assert!(e.reason.contains("node 999 does not exist"), "{}", e.reason);
    assert_eq!(e.at, (1, Some(Stream::Compute), None));
}

#[test]
fn event_id_out_of_range_is_a_plan_error_naming_the_instruction() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let events = v["ranks"][2]["events"].as_u64().unwrap();
    instrs_mut(&mut v, 2, "reduce").insert(0, json!({ "wait": events }));
    let si = stream_index(&v, 2, "reduce");

    let e = load_error(&v);
    assert_eq!(e.path, format!("ranks[2].streams[{si}].instrs[0]"));
    assert!(
        e.reason.contains(&format!(
            "event {events} is past the program's {events} events"
        )),
        "{}",
        e.reason
    );
    assert_eq!(e.at, (2, Some(Stream::Reduce), None));
}

#[test]
fn node_run_twice_or_never_is_a_plan_error() {
    let plan = four_routes_plan(&[Off, On]);
    let mut twice = to_value(&plan);
    let compute = instrs_mut(&mut twice, 0, "compute");
    let first = compute[0].clone();
    compute.insert(1, first);
    let e = load_error(&twice);
    assert_eq!(
        e.path,
        format!(
            "ranks[0].streams[{}].instrs[1]",
            stream_index(&twice, 0, "compute")
        )
    );
    assert!(e.reason.contains("node 0 runs twice"), "{}", e.reason);
    assert_eq!(e.at, (0, Some(Stream::Compute), Some(0)));

    let mut never = to_value(&plan);
    instrs_mut(&mut never, 3, "compute").retain(|i| *i != json!({ "run": 0 }));
    let e = load_error(&never);
    assert_eq!(e.path, "ranks[3].nodes[0]");
    assert!(e.reason.contains("never run"), "{}", e.reason);
    assert_eq!(e.at, (3, Some(Stream::Compute), Some(0)));
}

#[test]
fn node_ids_out_of_order_are_a_plan_error() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    v["ranks"][1]["nodes"][4]["id"] = json!(5);
    let e = load_error(&v);
    assert_eq!(e.path, "ranks[1].nodes[4].id");
    assert!(e.reason.contains("expected 4, got 5"), "{}", e.reason);
    assert_eq!(e.at.0, 1);
    assert_eq!(e.at.2, Some(4));
}

#[test]
fn unknown_field_in_a_node_is_a_json_error() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    v["ranks"][0]["nodes"][1]["op"]["accumulate"] = json!(true); // pack has no such field
    match Plan::from_json(&v.to_string()) {
        Err(PlanError::Json(msg)) => assert!(msg.contains("unknown field `accumulate`"), "{msg}"),
        other => panic!("expected PlanError::Json, got {other:?}"),
    }
}

#[test]
fn unknown_field_in_a_parameter_is_a_json_error() {
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    v["params"][1]["rout"] = json!("muon");
    match Plan::from_json(&v.to_string()) {
        Err(PlanError::Json(msg)) => assert!(msg.contains("unknown field `rout`"), "{msg}"),
        other => panic!("expected PlanError::Json, got {other:?}"),
    }
}

#[test]
fn well_formed_violation_names_the_rank_stream_and_node_at_fault() {
    // A plan built in memory (not through from_json) whose rank 3 lists a node on the
    // wrong stream: validate reports `well-formed` and points at rank 3.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let stage1 = stage1_of(&v, 3, FSDP, 0);
    v["ranks"][3]["nodes"][stage1 as usize]["stream"] = json!("publish");
    let unchecked: Plan = serde_json::from_value(v).unwrap();
    let vs = violations(&unchecked);

    let found = expect(&vs, "well-formed", 3, Stream::Reduce, stage1);
    assert!(found.detail.contains("ranks[3]"), "{}", found.detail);
    assert_eq!(vs.len(), 1);
}

#[test]
fn gates_edited_without_their_nodes_are_rejected_as_gate_conformance() {
    // The plan of `off, on` relabelled `on, on`: micro-batch 0 folds into the partial
    // although its gate says Stage 2 should run.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    v["gates"][0] = json!("on");
    let vs = violations(&from_value(&v));
    let fold = find_node(&v, 0, "fold", json!({ "micro_batch": 0 }));
    expect(&vs, "gate-conformance", 0, Stream::Reduce, fold);
}
