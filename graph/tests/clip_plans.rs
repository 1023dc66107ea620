//! Global-norm clipping in the plan: hand-broken norm tails are rejected by name.

mod common;

use common::*;
use overlap_graph::{validate, Gate, Mode, Op, Plan, Planner};

fn clip_plan(shard: u32, replicate: u32) -> Plan {
    Planner::new(spec(shard, replicate, four_routes(), 256).with_grad_norm(true))
        .unwrap()
        .plan(&[Gate::ReplicateOff, Gate::On])
        .unwrap()
}

fn invariants(plan: &Plan) -> Vec<&'static str> {
    validate(plan, Mode::Step)
        .into_iter()
        .map(|v| v.invariant)
        .collect()
}

#[test]
fn the_clip_plan_validates_and_round_trips() {
    let plan = clip_plan(2, 3);
    assert!(invariants(&plan).is_empty());
    let back = from_value(&to_value(&plan));
    assert_eq!(back, plan);
    assert!(plan.to_json().contains("\"grad_norm\": true"));
    // Without the norm, the JSON has no `grad_norm` key (older plans load unchanged).
    let plain = four_routes_plan(&[Gate::On]);
    assert!(!plain.to_json().contains("grad_norm"));
}

#[test]
fn a_rank_without_its_norm_is_rejected() {
    let plan = clip_plan(2, 2);
    let mut v = to_value(&plan);
    assert_eq!(remove_nodes(&mut v, 1, |op| op["kind"] == "grad_norm"), 1);
    let got = invariants(&from_value(&v));
    assert!(got.contains(&"clip-coverage"), "{got:?}");
}

#[test]
fn a_missing_norm_all_reduce_is_rejected() {
    let plan = clip_plan(2, 2);
    let mut v = to_value(&plan);
    let removed = remove_nodes(&mut v, 3, |op| {
        op["kind"] == "norm_reduce" && op["collective"]["group"]["kind"] == "replicate"
    });
    assert_eq!(removed, 1);
    let got = invariants(&from_value(&v));
    assert!(got.contains(&"clip-coverage"), "{got:?}");
    assert!(got.contains(&"collective-match"), "{got:?}");
}

#[test]
fn a_clip_after_an_optimizer_is_rejected() {
    let mut plan = clip_plan(2, 1);
    let nodes = &mut plan.ranks[0].nodes;
    let clip = nodes.iter().position(|n| n.op == Op::Clip).unwrap();
    let opt = nodes
        .iter()
        .position(|n| matches!(n.op, Op::Optimizer { .. }))
        .unwrap();
    assert_eq!(nodes[clip].stream, nodes[opt].stream);
    let (a, b) = (nodes[clip].op, nodes[opt].op);
    nodes[clip].op = b;
    nodes[opt].op = a;
    let got = invariants(&plan);
    assert!(got.contains(&"clip-coverage"), "{got:?}");
}

#[test]
fn norm_nodes_in_a_plan_without_the_norm_are_rejected() {
    let mut plan = clip_plan(1, 1);
    plan.grad_norm = false;
    let got = invariants(&plan);
    assert!(got.contains(&"clip-coverage"), "{got:?}");
}

#[test]
fn the_norm_all_reduce_has_the_right_shape() {
    let mut plan = clip_plan(2, 2);
    for n in &mut plan.ranks[0].nodes {
        if let Op::NormReduce { collective } = &mut n.op {
            collective.count = 2;
        }
    }
    let got = invariants(&plan);
    assert!(got.contains(&"collective-shape"), "{got:?}");
}
