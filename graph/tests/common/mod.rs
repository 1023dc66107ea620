//! Fixtures and plan-editing helpers shared by the integration tests.
//!
//! Plans are edited the way a user would: through their JSON (`to_json`, edit the
//! `serde_json::Value`, `Plan::from_json`), or through the [`Plan`] struct. Removing or
//! inserting a node renumbers the later nodes and the `run` instructions that name them,
//! so an edited plan stays well formed unless a test means otherwise.

#![allow(dead_code)]

use overlap_graph::{
    Gate, Instr, Mesh, Node, NodeId, ParamSpec, Plan, PlanSpec, Planner, Route, Stream,
};
use serde_json::{json, Value};

/// One parameter.
pub fn param(name: &str, shape: &[u64], route: Route, layer: u32) -> ParamSpec {
    ParamSpec::new(name, shape.to_vec(), route, layer)
}

/// A small model with a parameter of every route. Sizes do not divide by 2.
///
/// On mesh 2x2 with a large bucket cap the buckets are, in issue order:
/// b0 `norm` (fsdp, layer 1), b1 `w` (muon, owner (0, 0)), b2 `b` (adamw, owner (1, 0)),
/// b3 `embed` (sharded_adamw, layer 0).
pub fn four_routes() -> Vec<ParamSpec> {
    vec![
        param("embed", &[10, 3], Route::ShardedAdamw, 0),
        param("norm", &[5], Route::Fsdp, 1),
        param("w", &[4, 3], Route::Muon, 1),
        param("b", &[7], Route::Adamw, 1),
    ]
}

/// A planner input with the default (FSDP2) bindings and reduction.
pub fn spec(shard: u32, replicate: u32, params: Vec<ParamSpec>, bucket_cap_bytes: u64) -> PlanSpec {
    PlanSpec::new(Mesh::new(shard, replicate).unwrap(), params)
        .with_bucket_cap_bytes(bucket_cap_bytes)
}

/// The plan of [`four_routes`] on mesh 2x2 with one bucket per (layer, route, owner).
pub fn four_routes_plan(gates: &[Gate]) -> Plan {
    Planner::new(spec(2, 2, four_routes(), 1 << 20))
        .unwrap()
        .plan(gates)
        .unwrap()
}

/// The plan of [`four_routes`] on another mesh, one bucket per (layer, route, owner).
///
/// On meshes 3x1 and 4x1 the buckets are those of mesh 2x2 (b0 fsdp, b1 muon owned by
/// shard index 0, b2 adamw owned by shard index 1, b3 sharded_adamw), with shard groups
/// large enough for a majority.
pub fn four_routes_plan_on(shard: u32, replicate: u32, gates: &[Gate]) -> Plan {
    Planner::new(spec(shard, replicate, four_routes(), 1 << 20))
        .unwrap()
        .plan(gates)
        .unwrap()
}

/// A plan as a JSON value.
pub fn to_value(plan: &Plan) -> Value {
    serde_json::from_str(&plan.to_json()).unwrap()
}

/// A JSON value read back as a plan; panics with the loader's error.
pub fn from_value(v: &Value) -> Plan {
    Plan::from_json(&v.to_string()).unwrap_or_else(|e| panic!("edited plan does not load: {e}"))
}

/// The id of the first node of `rank` whose operation has `kind` and matches every
/// field of `fields` (e.g. `json!({"bucket": 0, "micro_batch": 1})`).
pub fn find_node(plan: &Value, rank: usize, kind: &str, fields: Value) -> u64 {
    find_nodes(plan, rank, kind, fields)
        .first()
        .copied()
        .unwrap_or_else(|| panic!("rank {rank} has no {kind} node matching"))
}

/// The ids of every node of `rank` whose operation has `kind` and matches `fields`.
pub fn find_nodes(plan: &Value, rank: usize, kind: &str, fields: Value) -> Vec<u64> {
    plan["ranks"][rank]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| op_matches(&n["op"], kind, &fields))
        .map(|n| n["id"].as_u64().unwrap())
        .collect()
}

/// Whether an operation has `kind` and every field of `fields`.
pub fn op_matches(op: &Value, kind: &str, fields: &Value) -> bool {
    op["kind"] == kind && fields.as_object().unwrap().iter().all(|(k, v)| op[k] == *v)
}

/// The stream program of `stream` in a rank's JSON, as the array of its instructions.
pub fn instrs_mut<'a>(plan: &'a mut Value, rank: usize, stream: &str) -> &'a mut Vec<Value> {
    plan["ranks"][rank]["streams"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|s| s["stream"] == stream)
        .unwrap_or_else(|| panic!("rank {rank} has no {stream} program"))["instrs"]
        .as_array_mut()
        .unwrap()
}

/// Removes the nodes of `rank` whose operation satisfies `pred`, with their `run`
/// instructions, and renumbers the rest. Returns how many were removed.
pub fn remove_nodes(plan: &mut Value, rank: usize, pred: impl Fn(&Value) -> bool) -> usize {
    let nodes = plan["ranks"][rank]["nodes"].as_array_mut().unwrap();
    let mut new_id: Vec<Option<u64>> = Vec::with_capacity(nodes.len());
    let mut next = 0;
    for n in nodes.iter() {
        if pred(&n["op"]) {
            new_id.push(None);
        } else {
            new_id.push(Some(next));
            next += 1;
        }
    }
    let removed = nodes.len() - next as usize;
    nodes.retain(|n| !pred(&n["op"]));
    for (i, n) in nodes.iter_mut().enumerate() {
        n["id"] = json!(i);
    }
    for sp in plan["ranks"][rank]["streams"].as_array_mut().unwrap() {
        let instrs = sp["instrs"].as_array_mut().unwrap();
        instrs.retain(|ins| match ins.get("run") {
            Some(r) => new_id[r.as_u64().unwrap() as usize].is_some(),
            None => true,
        });
        for ins in instrs.iter_mut() {
            if let Some(r) = ins.get("run").and_then(Value::as_u64) {
                *ins = json!({ "run": new_id[r as usize].unwrap() });
            }
        }
    }
    removed
}

/// A rank's program of one stream (panics when the rank has none).
pub fn program_mut(plan: &mut Plan, rank: u32, stream: Stream) -> &mut Vec<Instr> {
    let rp = &mut plan.ranks[rank as usize];
    if !rp.streams.iter().any(|s| s.stream == stream) {
        rp.streams.push(overlap_graph::StreamProgram {
            stream,
            instrs: Vec::new(),
        });
    }
    &mut rp
        .streams
        .iter_mut()
        .find(|s| s.stream == stream)
        .unwrap()
        .instrs
}

/// Inserts `node` at serial position `at` of a rank (its id becomes `at`), shifting later
/// nodes and the `run` instructions that name them. The caller places its `Run`.
pub fn insert_node(plan: &mut Plan, rank: u32, at: NodeId, node: Node) {
    let rp = &mut plan.ranks[rank as usize];
    for sp in &mut rp.streams {
        for ins in &mut sp.instrs {
            if let Instr::Run(n) = ins {
                if *n >= at {
                    *n += 1;
                }
            }
        }
    }
    rp.nodes.insert(at as usize, Node { id: at, ..node });
    for (i, n) in rp.nodes.iter_mut().enumerate() {
        n.id = i as NodeId;
    }
}

/// A fresh event id on a rank.
pub fn new_event(plan: &mut Plan, rank: u32) -> u32 {
    let rp = &mut plan.ranks[rank as usize];
    rp.events += 1;
    rp.events - 1
}

/// Position of `Run(node)` in a stream program.
pub fn run_position(instrs: &[Instr], node: NodeId) -> usize {
    instrs
        .iter()
        .position(|&i| i == Instr::Run(node))
        .unwrap_or_else(|| panic!("node {node} is not run here"))
}

/// Duplicates node `id` of `rank` right after itself (the copy gets id `id + 1`, and a
/// `run` right after the original's on the same stream), renumbering later nodes.
pub fn duplicate_node(plan: &mut Value, rank: usize, id: u64) {
    let nodes = plan["ranks"][rank]["nodes"].as_array_mut().unwrap();
    let copy = nodes[id as usize].clone();
    nodes.insert(id as usize + 1, copy);
    for (i, n) in nodes.iter_mut().enumerate() {
        n["id"] = json!(i);
    }
    for sp in plan["ranks"][rank]["streams"].as_array_mut().unwrap() {
        let instrs = sp["instrs"].as_array_mut().unwrap();
        let mut out = Vec::with_capacity(instrs.len() + 1);
        for ins in instrs.iter() {
            match ins.get("run").and_then(Value::as_u64) {
                Some(r) if r == id => {
                    out.push(json!({ "run": r }));
                    out.push(json!({ "run": r + 1 }));
                }
                Some(r) if r > id => out.push(json!({ "run": r + 1 })),
                _ => out.push(ins.clone()),
            }
        }
        *instrs = out;
    }
}
