//! Hand-broken plans that train differently from the no_sync reference, each rejected
//! by name: `contributions-exactly-once`, `optimizer-coverage` and `publish-coverage`.
//!
//! Every test edits the JSON of a valid plan the way a user would (a node duplicated,
//! deleted or retargeted; a bucket table edited) and checks the invariant, rank, stream
//! and node of the rejection. The fixture is [`four_routes_plan`] on mesh 2x2 (ranks
//! `g = r·2 + s`): b0 `norm` (fsdp), b1 `w` (muon, owner (0, 0) = rank 0), b2 `b` (adamw,
//! owner (1, 0) = rank 1), b3 `embed` (sharded_adamw); parameter ids 0 `embed`,
//! 1 `norm`, 2 `w`, 3 `b`.

mod common;

use common::*;
use overlap_graph::{validate, Gate, Mode, Plan, Planner, Route, Stream, Violation};
use serde_json::{json, Value};

use Gate::{NoSync, On, ReplicateOff as Off};

const EMBED: u64 = 0;
const NORM: u64 = 1;
const W: u64 = 2;

fn check(v: &Value) -> Vec<Violation> {
    let plan: Plan = from_value(v);
    validate(&plan, Mode::Step)
}

#[track_caller]
fn expect<'a>(
    vs: &'a [Violation],
    invariant: &str,
    rank: u32,
    node: Option<u64>,
    needle: &str,
) -> &'a Violation {
    vs.iter()
        .find(|x| {
            x.invariant == invariant
                && x.rank == rank
                && (node.is_none() || x.node == node.map(|n| n as u32))
                && x.detail.contains(needle)
        })
        .unwrap_or_else(|| {
            panic!("expected `{invariant}` on rank {rank}, node {node:?}, with {needle:?}; got {vs:#?}")
        })
}

#[test]
fn a_fold_partial_duplicated_right_after_itself_is_rejected_as_contributions_exactly_once() {
    let mut v = to_value(&four_routes_plan(&[Off, On]));
    let fp = find_node(
        &v,
        0,
        "fold_partial",
        json!({ "bucket": 0, "micro_batch": 1 }),
    );
    duplicate_node(&mut v, 0, fp);
    let vs = check(&v);
    let x = expect(
        &vs,
        "contributions-exactly-once",
        0,
        Some(fp + 1),
        "already handed on",
    );
    assert_eq!(x.stream, Some(Stream::Reduce));
    assert!(x.detail.contains("partial[b0]"), "{}", x.detail);
    // The optimizer of `norm` on rank 0 would see micro-batch 0 twice.
    let opt = find_node(&v, 0, "optimizer", json!({ "param": NORM }));
    expect(&vs, "gradient-accounting", 0, Some(opt), "m0x2");
}

#[test]
fn an_accumulate_duplicated_on_a_rank_that_does_not_receive_the_result_is_rejected() {
    // `w` (muon) is reduced to its owner, rank 0; rank 1 (shard index 1) only sends.
    // Its no_sync accumulate of micro-batch 0 runs twice: rank 1's contribution would
    // reach the owner twice, and rank 1 itself never sees the result.
    let mut v = to_value(&four_routes_plan(&[NoSync, On]));
    let acc = find_node(
        &v,
        1,
        "accumulate",
        json!({ "bucket": 1, "micro_batch": 0 }),
    );
    duplicate_node(&mut v, 1, acc);
    // The copy adds to what the original initialised.
    v["ranks"][1]["nodes"][acc as usize + 1]["op"]["accumulate"] = json!(true);
    let vs = check(&v);
    let x = expect(&vs, "contributions-exactly-once", 1, Some(acc + 1), "grad[");
    assert_eq!(x.stream, Some(Stream::Compute));
    let opt = find_node(&v, 0, "optimizer", json!({ "param": W }));
    let owner = expect(&vs, "gradient-accounting", 0, Some(opt), "`w`");
    assert!(owner.detail.contains("m0x2"), "{}", owner.detail);
}

#[test]
fn a_pack_that_re_reads_a_consumed_no_sync_accumulation_is_rejected() {
    // no_sync, on, no_sync... no: the accumulation of m0 is packed with m1; m2's pack
    // claims it again although it was consumed and nothing accumulated since.
    let mut v = to_value(&four_routes_plan(&[NoSync, On, On]));
    let pack = find_node(&v, 2, "pack", json!({ "bucket": 0, "micro_batch": 2 }));
    v["ranks"][2]["nodes"][pack as usize]["op"]["with_accum"] = json!(true);
    let vs = check(&v);
    let x = expect(
        &vs,
        "contributions-exactly-once",
        2,
        Some(pack),
        "no_sync accumulation of `norm`",
    );
    assert!(x.detail.contains("already handed on"), "{}", x.detail);
}

#[test]
fn a_duplicated_pack_and_a_duplicated_fold_are_rejected() {
    let mut v = to_value(&four_routes_plan(&[Off, On]));
    let pack = find_node(&v, 3, "pack", json!({ "bucket": 3, "micro_batch": 1 }));
    duplicate_node(&mut v, 3, pack);
    let fold = find_node(&v, 3, "fold", json!({ "bucket": 3, "micro_batch": 0 }));
    duplicate_node(&mut v, 3, fold);
    v["ranks"][3]["nodes"][fold as usize + 1]["op"]["accumulate"] = json!(true);
    let vs = check(&v);
    let pack = find_nodes(&v, 3, "pack", json!({ "bucket": 3, "micro_batch": 1 }))[1];
    expect(
        &vs,
        "contributions-exactly-once",
        3,
        Some(pack),
        "already handed on",
    );
    expect(
        &vs,
        "contributions-exactly-once",
        3,
        Some(fold + 1),
        "counted twice",
    );
}

#[test]
fn every_optimizer_of_an_fsdp_parameter_deleted_is_rejected_on_every_rank() {
    let mut v = to_value(&four_routes_plan(&[Off, On]));
    for rank in 0..4 {
        let removed = remove_nodes(&mut v, rank, |op| {
            op_matches(op, "optimizer", &json!({ "param": NORM }))
        });
        assert_eq!(removed, 1);
    }
    let vs = check(&v);
    for rank in 0..4 {
        expect(
            &vs,
            "optimizer-coverage",
            rank,
            None,
            "no optimizer node updates it",
        );
    }
}

#[test]
fn an_optimizer_pointed_at_another_parameter_is_rejected_twice_and_never() {
    // Rank 0 holds `norm` and `embed`; its `norm` optimizer now updates `embed`.
    let mut v = to_value(&four_routes_plan(&[Off, On]));
    let opt = find_node(&v, 0, "optimizer", json!({ "param": NORM }));
    v["ranks"][0]["nodes"][opt as usize]["op"]["param"] = json!(EMBED);
    let vs = check(&v);
    expect(
        &vs,
        "optimizer-coverage",
        0,
        None,
        "`norm` but no optimizer node",
    );
    expect(&vs, "optimizer-coverage", 0, None, "updates `embed` again");
}

#[test]
fn muon_on_a_sharded_adamw_parameter_is_rejected() {
    let mut v = to_value(&four_routes_plan(&[Off, On]));
    let opt = find_node(&v, 2, "optimizer", json!({ "param": EMBED }));
    v["ranks"][2]["nodes"][opt as usize]["op"]["optimizer"] = json!("muon");
    let vs = check(&v);
    expect(&vs, "optimizer-coverage", 2, Some(opt), "requires adamw");
}

#[test]
fn an_optimizer_on_a_rank_that_does_not_own_the_parameter_is_rejected() {
    // Rank 2 (shard index 0, replicate 1) holds `w` through publish but does not own
    // it; its `norm` optimizer is turned into a Muon step of `w`.
    let mut v = to_value(&four_routes_plan(&[Off, On]));
    let opt = find_node(&v, 2, "optimizer", json!({ "param": NORM }));
    v["ranks"][2]["nodes"][opt as usize]["op"] =
        json!({ "kind": "optimizer", "param": W, "optimizer": "muon" });
    let vs = check(&v);
    expect(
        &vs,
        "optimizer-coverage",
        2,
        Some(opt),
        "which does not hold it",
    );
    expect(
        &vs,
        "optimizer-coverage",
        2,
        None,
        "`norm` but no optimizer node",
    );
}

#[test]
fn every_publish_of_an_owned_parameter_deleted_is_rejected_as_publish_coverage() {
    let mut v = to_value(&four_routes_plan(&[Off, On]));
    for rank in 0..4 {
        remove_nodes(&mut v, rank, |op| {
            op_matches(op, "publish", &json!({ "param": W }))
        });
    }
    let vs = check(&v);
    // Rank 2 is `w`'s other replica (shard index 0, replicate 1).
    let x = expect(&vs, "publish-coverage", 2, None, "`w`");
    assert!(x.detail.contains("no publish"), "{}", x.detail);
    assert_eq!(
        vs.iter()
            .filter(|x| x.invariant == "publish-coverage")
            .count(),
        1,
        "{vs:#?}"
    );
}

#[test]
fn a_publish_before_the_owners_optimizer_is_rejected_as_publish_coverage() {
    // Move the owner's publish of `w` onto the compute stream before its optimizer: the
    // broadcast sends the step's old values.
    let plan = four_routes_plan(&[Off, On]);
    let mut v = to_value(&plan);
    let opt = find_node(&v, 0, "optimizer", json!({ "param": W }));
    let publish = find_node(&v, 0, "publish", json!({ "param": W }));
    // Swap the two nodes in serial order and on their streams.
    let nodes = v["ranks"][0]["nodes"].as_array_mut().unwrap();
    let (a, b) = (opt as usize, publish as usize);
    let pub_node = nodes.remove(b);
    nodes.insert(a, pub_node);
    for (i, n) in nodes.iter_mut().enumerate() {
        n["id"] = json!(i);
    }
    for sp in v["ranks"][0]["streams"].as_array_mut().unwrap() {
        for ins in sp["instrs"].as_array_mut().unwrap() {
            if let Some(r) = ins.get("run").and_then(Value::as_u64) {
                let r = r as usize;
                let new = if r == b {
                    a
                } else if r >= a && r < b {
                    r + 1
                } else {
                    r
                };
                *ins = json!({ "run": new });
            }
        }
    }
    let vs = check(&v);
    expect(
        &vs,
        "publish-coverage",
        0,
        Some(a as u64),
        "before any optimizer updated it",
    );
}

#[test]
fn a_parameter_in_no_bucket_is_rejected_as_optimizer_coverage() {
    // Two fsdp parameters of one layer share a bucket; the table drops one of them.
    let spec = spec(
        2,
        1,
        vec![
            param("a", &[4, 2], Route::Fsdp, 0),
            param("b", &[6], Route::Fsdp, 0),
        ],
        1 << 20,
    );
    let plan = Planner::new(spec).unwrap().plan(&[Off, On]).unwrap();
    assert!(validate(&plan, Mode::Step).is_empty());
    let mut v = to_value(&plan);
    assert_eq!(v["buckets"][0]["params"], json!([0, 1]));
    v["buckets"][0]["params"] = json!([0]);
    let vs = check(&v);
    let x = expect(&vs, "optimizer-coverage", 0, None, "`b` is in no bucket");
    assert_eq!(x.node, None);
}

#[test]
fn a_parameter_in_two_buckets_is_rejected_as_optimizer_coverage() {
    let mut v = to_value(&four_routes_plan(&[Off, On]));
    // `norm` (fsdp, layer 1) joins... the only other fsdp bucket is its own; add a copy
    // of bucket 0 as bucket 4 naming `norm` again.
    let mut b = v["buckets"][0].clone();
    b["id"] = json!(4);
    v["buckets"].as_array_mut().unwrap().push(b);
    let vs = check(&v);
    expect(
        &vs,
        "optimizer-coverage",
        0,
        None,
        "`norm` is in buckets b0, b4",
    );
}
