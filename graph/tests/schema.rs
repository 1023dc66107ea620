//! docs/plan.schema.json describes exactly the JSON that `Plan::to_json` writes and
//! `Plan::from_json` reads.
//!
//! There is no JSON-schema crate here: a small checker below implements the subset of
//! draft 2020-12 the schema uses (`$ref` into `$defs`, `type`, `properties`, `required`,
//! `additionalProperties: false`, `enum`, `const`, `items`, `oneOf`, and the bounds
//! `minimum`, `maximum`, `minItems`, `maxItems`, `minLength`). Any other keyword fails
//! the tests, so the schema cannot use one the checker would silently ignore.

mod common;

use std::collections::BTreeSet;

use common::*;
use overlap_graph::{
    Bindings, Collective, CollectiveKind, DType, ForwardSpec, Gate, Group, Op, OptimizerKind, Pass,
    Plan, Planner, ReduceOp, ReduceSpec, Route, Stream,
};
use serde::{de::DeserializeOwned, Serialize};
use serde_json::{json, Value};

const SCHEMA: &str = include_str!("../../docs/plan.schema.json");

fn schema() -> Value {
    serde_json::from_str(SCHEMA).expect("docs/plan.schema.json is JSON")
}

// --- The checker ------------------------------------------------------------------------

/// Validates JSON values against the subset of JSON Schema used by the plan schema.
struct Checker {
    root: Value,
}

/// Keywords that only annotate.
const ANNOTATIONS: [&str; 5] = ["$schema", "$id", "$defs", "title", "description"];

impl Checker {
    fn new(root: Value) -> Checker {
        Checker { root }
    }

    /// The schema a `$ref` names; only local `#/$defs/...` references are used.
    fn target(&self, reference: &str) -> &Value {
        let name = reference
            .strip_prefix("#/$defs/")
            .unwrap_or_else(|| panic!("unsupported $ref `{reference}`"));
        self.root["$defs"]
            .get(name)
            .unwrap_or_else(|| panic!("$ref `{reference}` names no definition"))
    }

    /// Every violation of `schema` by `value`, as `path: reason`.
    fn errors(&self, schema: &Value, value: &Value, path: &str) -> Vec<String> {
        let mut out = Vec::new();
        self.check(schema, value, path, &mut out);
        out
    }

    fn check(&self, schema: &Value, v: &Value, path: &str, out: &mut Vec<String>) {
        let schema = schema
            .as_object()
            .unwrap_or_else(|| panic!("schema at {path} is not an object"));
        let fail = |out: &mut Vec<String>, reason: String| out.push(format!("{path}: {reason}"));
        for (keyword, arg) in schema {
            match keyword.as_str() {
                k if ANNOTATIONS.contains(&k) => {}
                "$ref" => self.check(self.target(arg.as_str().unwrap()), v, path, out),
                "type" => {
                    let types: Vec<&str> = match arg {
                        Value::String(t) => vec![t.as_str()],
                        Value::Array(ts) => ts.iter().map(|t| t.as_str().unwrap()).collect(),
                        _ => panic!("bad `type` at {path}"),
                    };
                    if !types.iter().any(|t| has_type(v, t)) {
                        fail(out, format!("expected {}, got {v}", types.join(" or ")));
                    }
                }
                "properties" => {
                    if let Some(obj) = v.as_object() {
                        for (name, sub) in arg.as_object().unwrap() {
                            if let Some(x) = obj.get(name) {
                                self.check(sub, x, &format!("{path}.{name}"), out);
                            }
                        }
                    }
                }
                "required" => {
                    if let Some(obj) = v.as_object() {
                        for name in arg.as_array().unwrap() {
                            if !obj.contains_key(name.as_str().unwrap()) {
                                fail(out, format!("missing required field {name}"));
                            }
                        }
                    }
                }
                "additionalProperties" => {
                    assert_eq!(
                        *arg,
                        json!(false),
                        "only `additionalProperties: false` is supported ({path})"
                    );
                    let declared = schema.get("properties").and_then(Value::as_object);
                    if let Some(obj) = v.as_object() {
                        for name in obj.keys() {
                            if !declared.is_some_and(|d| d.contains_key(name)) {
                                fail(out, format!("field `{name}` is not allowed"));
                            }
                        }
                    }
                }
                "enum" => {
                    if !arg.as_array().unwrap().contains(v) {
                        fail(out, format!("{v} is not one of {arg}"));
                    }
                }
                "const" => {
                    if arg != v {
                        fail(out, format!("expected {arg}, got {v}"));
                    }
                }
                "items" => {
                    if let Some(xs) = v.as_array() {
                        for (i, x) in xs.iter().enumerate() {
                            self.check(arg, x, &format!("{path}[{i}]"), out);
                        }
                    }
                }
                "oneOf" => {
                    let branches = arg.as_array().unwrap();
                    let passing = branches
                        .iter()
                        .filter(|b| self.errors(b, v, path).is_empty())
                        .count();
                    if passing != 1 {
                        fail(
                            out,
                            format!(
                                "{v} matches {passing} of the {} alternatives, not exactly one",
                                branches.len()
                            ),
                        );
                    }
                }
                "minimum" | "maximum" => {
                    if let (Some(x), Some(bound)) = (number(v), number(arg)) {
                        let ok = if keyword == "minimum" {
                            x >= bound
                        } else {
                            x <= bound
                        };
                        if !ok {
                            fail(out, format!("{v} is outside the {keyword} {arg}"));
                        }
                    }
                }
                "minItems" | "maxItems" => {
                    if let Some(xs) = v.as_array() {
                        let bound = arg.as_u64().unwrap() as usize;
                        let ok = if keyword == "minItems" {
                            xs.len() >= bound
                        } else {
                            xs.len() <= bound
                        };
                        if !ok {
                            fail(
                                out,
                                format!("{} items is outside the {keyword} {bound}", xs.len()),
                            );
                        }
                    }
                }
                "minLength" => {
                    if let Some(s) = v.as_str() {
                        if (s.chars().count() as u64) < arg.as_u64().unwrap() {
                            fail(out, format!("{v} is shorter than {arg}"));
                        }
                    }
                }
                other => {
                    panic!("schema keyword `{other}` at {path} is not supported by this checker")
                }
            }
        }
    }

    /// The schema that declares the fields of `value`: `$ref`s followed, and of a `oneOf`
    /// the alternative the value matches (or, failing that, whose `kind` it names).
    fn declaring<'a>(
        &'a self,
        mut schema: &'a Value,
        value: &Value,
        path: &str,
    ) -> Result<&'a Value, String> {
        loop {
            if let Some(r) = schema.get("$ref") {
                schema = self.target(r.as_str().unwrap());
            } else if let Some(branches) = schema.get("oneOf").and_then(Value::as_array) {
                let matching = branches
                    .iter()
                    .find(|b| self.errors(b, value, path).is_empty());
                let by_kind = || {
                    branches.iter().find(|b| {
                        let b = b
                            .get("$ref")
                            .map_or(*b, |r| self.target(r.as_str().unwrap()));
                        b.pointer("/properties/kind/const")
                            .is_some_and(|k| Some(k) == value.get("kind"))
                    })
                };
                schema = matching.or_else(by_kind).ok_or_else(|| {
                    format!("{path}: no alternative of the oneOf describes {value}")
                })?;
            } else {
                return Ok(schema);
            }
        }
    }

    /// Every field of `value` that the schema does not declare at the same place.
    fn undeclared(&self, schema: &Value, value: &Value, path: &str, out: &mut Vec<String>) {
        let schema = match self.declaring(schema, value, path) {
            Ok(s) => s,
            Err(e) => return out.push(e),
        };
        match value {
            Value::Object(obj) => {
                for (name, x) in obj {
                    let here = format!("{path}.{name}");
                    match schema.pointer(&format!("/properties/{name}")) {
                        Some(sub) => self.undeclared(sub, x, &here, out),
                        None => out.push(format!("{here} is not declared in the schema")),
                    }
                }
            }
            Value::Array(xs) => match schema.get("items") {
                Some(items) => xs
                    .iter()
                    .enumerate()
                    .for_each(|(i, x)| self.undeclared(items, x, &format!("{path}[{i}]"), out)),
                None if xs.is_empty() => {}
                None => out.push(format!("{path} is an array but its schema has no `items`")),
            },
            _ => {}
        }
    }
}

fn has_type(v: &Value, t: &str) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "integer" => v.is_u64() || v.is_i64(),
        "number" => v.is_number(),
        other => panic!("unknown type `{other}`"),
    }
}

/// A JSON number, exact for every integer a plan holds.
fn number(v: &Value) -> Option<i128> {
    v.as_u64()
        .map(i128::from)
        .or_else(|| v.as_i64().map(i128::from))
}

// --- Plans to check -------------------------------------------------------------------

/// A plan with a node of every kind: no_sync, gate-off and gate-on micro-batches, every
/// route (so fold, fold_partial, stage2, unpack, optimizer and publish all appear), the
/// global norm (grad_norm, norm_reduce, clip) and the forward's gathers (unshard,
/// forward, backward, reshard).
fn every_node_kind() -> Plan {
    Planner::new(
        spec(2, 2, four_routes(), 1 << 20)
            .with_grad_norm(true)
            .with_forward(Some(ForwardSpec::default())),
    )
    .unwrap()
    .plan(&[Gate::NoSync, Gate::ReplicateOff, Gate::On])
    .unwrap()
}

/// The copy transport's plan (exchange and combine nodes) on a 2x2 mesh.
fn copy_transport_plan() -> Plan {
    let mut copy = spec(2, 2, four_routes(), 1 << 20);
    copy.schedule = overlap_graph::Schedule::default()
        .with_transport(overlap_graph::Transport::Copy)
        .with_combine_lag(1);
    Planner::new(copy)
        .unwrap()
        .plan(&[Gate::ReplicateOff, Gate::On])
        .unwrap()
}

/// More plans: other meshes, reductions, bindings, bucket caps and transports.
fn assorted_plans() -> Vec<Plan> {
    let mut plans = vec![every_node_kind(), copy_transport_plan()];
    let mut bf16 = spec(3, 2, four_routes(), 16);
    bf16.reduce = ReduceSpec::default()
        .with_op(ReduceOp::Sum)
        .with_dtype(DType::Bf16);
    bf16.bindings = Bindings::default()
        .with_fold(Stream::Compute)
        .with_stage2(Stream::Reduce)
        .with_publish(Stream::Replicate);
    plans.push(
        Planner::new(bf16)
            .unwrap()
            .plan(&[Gate::ReplicateOff, Gate::On, Gate::NoSync, Gate::On])
            .unwrap(),
    );
    let single = spec(1, 1, four_routes(), 1 << 20);
    plans.push(Planner::new(single).unwrap().plan(&[Gate::On]).unwrap());
    plans.push(
        Planner::new(spec(2, 3, four_routes(), 64).with_grad_norm(true))
            .unwrap()
            .plan(&[Gate::ReplicateOff, Gate::On])
            .unwrap(),
    );
    plans.push(
        Planner::new(spec(2, 2, four_routes(), 1 << 20))
            .unwrap()
            .plan_prefix(&[Gate::NoSync])
            .unwrap(),
    );
    plans
}

fn op_kinds(plan: &Plan) -> BTreeSet<&'static str> {
    plan.ranks
        .iter()
        .flat_map(|r| &r.nodes)
        .map(|n| n.op.kind())
        .collect()
}

// --- (a) every field the plan writes is declared where it appears ---------------------

#[test]
fn the_plan_fixture_has_a_node_of_every_kind() {
    let all: BTreeSet<&str> = one_op_of_each_kind().iter().map(|op| op.kind()).collect();
    let mut kinds = op_kinds(&every_node_kind());
    kinds.extend(op_kinds(&copy_transport_plan()));
    assert_eq!(kinds, all);
}

#[test]
fn every_field_of_a_written_plan_is_declared_in_the_schema_at_its_place() {
    let checker = Checker::new(schema());
    for plan in assorted_plans() {
        let mut out = Vec::new();
        checker.undeclared(&checker.root, &to_value(&plan), "plan", &mut out);
        assert!(out.is_empty(), "{out:#?}");
    }
}

#[test]
fn every_field_of_every_operation_is_declared_in_the_schema() {
    // Straight from the Rust enum, so a new field is caught before a plan uses it.
    let checker = Checker::new(schema());
    let op_schema = json!({ "$ref": "#/$defs/Op" });
    for op in one_op_of_each_kind() {
        let v = serde_json::to_value(op).unwrap();
        let mut out = Vec::new();
        checker.undeclared(&op_schema, &v, op.kind(), &mut out);
        assert!(out.is_empty(), "{out:#?}");
        assert_eq!(
            checker.errors(&op_schema, &v, op.kind()),
            Vec::<String>::new()
        );
    }
}

// --- (b) every enum string is listed --------------------------------------------------

/// One operation of each kind; the match makes a new variant a compile error here.
fn one_op_of_each_kind() -> Vec<Op> {
    let collective = Collective {
        kind: CollectiveKind::Reduce,
        group: Group::Shard { replicate: 0 },
        count: 1,
        dtype: DType::F32,
        op: ReduceOp::Avg,
        root: Some(0),
    };
    let ops = vec![
        Op::GradReady { layer: 0 },
        Op::Accumulate {
            bucket: 0,
            micro_batch: 0,
            accumulate: true,
        },
        Op::Pack {
            bucket: 0,
            micro_batch: 0,
            with_accum: true,
        },
        Op::Stage1 {
            bucket: 0,
            micro_batch: 0,
            collective,
        },
        Op::Fold {
            bucket: 0,
            micro_batch: 0,
            accumulate: true,
        },
        Op::FoldPartial {
            bucket: 0,
            micro_batch: 0,
        },
        Op::Stage2 {
            bucket: 0,
            micro_batch: 0,
            collective,
        },
        Op::Exchange {
            bucket: 0,
            micro_batch: 0,
            stage: 1,
            collective,
        },
        Op::Combine {
            bucket: 0,
            micro_batch: 0,
            stage: 2,
            collective,
        },
        Op::Gather {
            bucket: 0,
            micro_batch: 0,
            stage: 2,
            collective,
        },
        Op::Unpack {
            bucket: 0,
            micro_batch: 0,
            accumulate: true,
        },
        Op::Optimizer {
            param: 0,
            optimizer: OptimizerKind::Muon,
        },
        Op::Publish {
            param: 0,
            collective,
        },
        Op::GradNorm,
        Op::NormReduce { collective },
        Op::Clip,
        Op::Unshard {
            param: 0,
            micro_batch: 0,
            pass: Pass::Backward,
            collective,
        },
        Op::Forward { layer: 0 },
        Op::Backward { layer: 0 },
        Op::Reshard {
            param: 0,
            micro_batch: 0,
            pass: Pass::Forward,
        },
    ];
    for op in &ops {
        match op {
            Op::GradReady { .. }
            | Op::Accumulate { .. }
            | Op::Pack { .. }
            | Op::Stage1 { .. }
            | Op::Fold { .. }
            | Op::FoldPartial { .. }
            | Op::Stage2 { .. }
            | Op::Exchange { .. }
            | Op::Combine { .. }
            | Op::Gather { .. }
            | Op::Unpack { .. }
            | Op::Optimizer { .. }
            | Op::Publish { .. }
            | Op::GradNorm
            | Op::NormReduce { .. }
            | Op::Clip
            | Op::Unshard { .. }
            | Op::Forward { .. }
            | Op::Backward { .. }
            | Op::Reshard { .. } => {}
        }
    }
    ops
}

/// The serialised names of every variant of a unit-variant enum.
fn names<T: Serialize>(variants: &[T]) -> BTreeSet<String> {
    variants
        .iter()
        .map(|v| {
            serde_json::to_value(v)
                .unwrap()
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

/// The strings a `$defs` entry lists in its `enum`.
fn schema_enum(schema: &Value, def: &str) -> BTreeSet<String> {
    schema["$defs"][def]["enum"]
        .as_array()
        .unwrap_or_else(|| panic!("$defs.{def} has no enum"))
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

/// Every name the schema lists reads back as a value of the Rust type.
fn parse_all<T: DeserializeOwned>(names: &BTreeSet<String>) {
    for n in names {
        serde_json::from_value::<T>(json!(n))
            .unwrap_or_else(|e| panic!("`{n}` is in the schema but not accepted: {e}"));
    }
}

#[test]
fn schema_enums_list_exactly_the_serialised_names_of_each_rust_enum() {
    let s = schema();
    let gates = [Gate::NoSync, Gate::ReplicateOff, Gate::On];
    let collectives = [
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllReduce,
        CollectiveKind::Reduce,
        CollectiveKind::Broadcast,
        CollectiveKind::AllGather,
    ];
    // Exhaustive matches: a new variant fails to compile until it is listed above.
    for g in gates {
        match g {
            Gate::NoSync | Gate::ReplicateOff | Gate::On => {}
        }
    }
    for c in collectives {
        match c {
            CollectiveKind::ReduceScatter
            | CollectiveKind::AllReduce
            | CollectiveKind::Reduce
            | CollectiveKind::Broadcast
            | CollectiveKind::AllGather => {}
        }
    }
    for d in [DType::F32, DType::Bf16] {
        match d {
            DType::F32 | DType::Bf16 => {}
        }
    }
    for o in [ReduceOp::Avg, ReduceOp::Sum] {
        match o {
            ReduceOp::Avg | ReduceOp::Sum => {}
        }
    }
    for o in [OptimizerKind::Adamw, OptimizerKind::Muon] {
        match o {
            OptimizerKind::Adamw | OptimizerKind::Muon => {}
        }
    }

    assert_eq!(schema_enum(&s, "Route"), names(&Route::ALL));
    assert_eq!(schema_enum(&s, "Stream"), names(&Stream::ALL));
    assert_eq!(schema_enum(&s, "Gate"), names(&gates));
    assert_eq!(schema_enum(&s, "CollectiveKind"), names(&collectives));
    assert_eq!(schema_enum(&s, "DType"), names(&[DType::F32, DType::Bf16]));
    assert_eq!(
        schema_enum(&s, "ReduceOp"),
        names(&[ReduceOp::Avg, ReduceOp::Sum])
    );
    assert_eq!(
        schema_enum(&s, "OptimizerKind"),
        names(&[OptimizerKind::Adamw, OptimizerKind::Muon])
    );
    for p in [Pass::Forward, Pass::Backward] {
        match p {
            Pass::Forward | Pass::Backward => {}
        }
    }
    assert_eq!(
        schema_enum(&s, "Pass"),
        names(&[Pass::Forward, Pass::Backward])
    );
    parse_all::<Pass>(&schema_enum(&s, "Pass"));

    parse_all::<Route>(&schema_enum(&s, "Route"));
    parse_all::<Stream>(&schema_enum(&s, "Stream"));
    parse_all::<Gate>(&schema_enum(&s, "Gate"));
    parse_all::<CollectiveKind>(&schema_enum(&s, "CollectiveKind"));
    parse_all::<DType>(&schema_enum(&s, "DType"));
    parse_all::<ReduceOp>(&schema_enum(&s, "ReduceOp"));
    parse_all::<OptimizerKind>(&schema_enum(&s, "OptimizerKind"));
}

#[test]
fn schema_lists_exactly_the_operation_kinds_and_group_kinds() {
    let s = schema();
    let consts = |def: &str| -> BTreeSet<String> {
        s["$defs"][def]["oneOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                b.pointer("/properties/kind/const")
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    let op_kinds: BTreeSet<String> = one_op_of_each_kind()
        .iter()
        .map(|op| op.kind().to_owned())
        .collect();
    assert_eq!(consts("Op"), op_kinds);
    for plan in assorted_plans() {
        for k in op_kinds_in_json(&to_value(&plan)) {
            assert!(
                consts("Op").contains(&k),
                "operation kind `{k}` is missing from the schema"
            );
        }
    }
    let groups = [Group::Shard { replicate: 0 }, Group::Replicate { shard: 0 }];
    let group_kinds: BTreeSet<String> = groups
        .iter()
        .map(|g| {
            serde_json::to_value(g).unwrap()["kind"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(consts("Group"), group_kinds);
}

fn op_kinds_in_json(plan: &Value) -> BTreeSet<String> {
    plan["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["nodes"].as_array().unwrap())
        .map(|n| n["op"]["kind"].as_str().unwrap().to_owned())
        .collect()
}

// --- (c) real plans validate against the schema ---------------------------------------

#[test]
fn written_plans_validate_against_the_schema() {
    let checker = Checker::new(schema());
    for plan in assorted_plans() {
        let errors = checker.errors(&checker.root, &to_value(&plan), "plan");
        assert!(errors.is_empty(), "{errors:#?}");
    }
}

#[test]
fn every_definition_is_used_and_every_reference_resolves() {
    let s = schema();
    let mut refs = BTreeSet::new();
    collect_refs(&s, &mut refs);
    let defs: BTreeSet<String> = s["$defs"]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| format!("#/$defs/{k}"))
        .collect();
    assert_eq!(refs, defs);
}

fn collect_refs(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(obj) => {
            if let Some(r) = obj.get("$ref").and_then(Value::as_str) {
                out.insert(r.to_owned());
            }
            obj.values().for_each(|x| collect_refs(x, out));
        }
        Value::Array(xs) => xs.iter().for_each(|x| collect_refs(x, out)),
        _ => {}
    }
}

/// An edit of a written plan's JSON.
type Edit = fn(&mut Value);

#[test]
fn schema_and_loader_reject_the_same_malformed_shapes() {
    // The checker is not vacuous, and the schema is not looser than the loader.
    let edits: Vec<(&str, Edit)> = vec![
        ("unknown top-level field", |v| v["comment"] = json!("hi")),
        ("unknown node field", |v| {
            v["ranks"][0]["nodes"][0]["label"] = json!("x")
        }),
        ("unknown operation field", |v| {
            v["ranks"][0]["nodes"][0]["op"]["bucket"] = json!(0)
        }),
        ("unknown operation kind", |v| {
            v["ranks"][0]["nodes"][0]["op"]["kind"] = json!("backward")
        }),
        ("missing required field", |v| {
            v["ranks"][0].as_object_mut().unwrap().remove("events");
        }),
        ("unknown stream", |v| {
            v["ranks"][0]["nodes"][0]["stream"] = json!("nvlink")
        }),
        ("unknown gate", |v| v["gates"][0] = json!("replicate_off")),
        ("negative node id in an instruction", |v| {
            v["ranks"][0]["streams"][0]["instrs"][0] = json!({ "run": -1 })
        }),
        ("instruction with two tags", |v| {
            v["ranks"][0]["streams"][0]["instrs"][0] = json!({ "run": 0, "wait": 0 })
        }),
        ("instruction as a string", |v| {
            v["ranks"][0]["streams"][0]["instrs"][0] = json!("run")
        }),
        ("count as a string", |v| {
            let n = v["ranks"][0]["nodes"]
                .as_array_mut()
                .unwrap()
                .iter_mut()
                .find(|n| n["op"]["kind"] == "stage1")
                .unwrap();
            n["op"]["collective"]["count"] = json!("3");
        }),
        ("group of an unknown kind", |v| {
            let n = v["ranks"][0]["nodes"]
                .as_array_mut()
                .unwrap()
                .iter_mut()
                .find(|n| n["op"]["kind"] == "stage1")
                .unwrap();
            n["op"]["collective"]["group"] = json!({ "kind": "world" });
        }),
        ("unknown mesh field", |v| v["mesh"]["pipeline"] = json!(1)),
        ("unknown parameter field", |v| {
            v["params"][0]["rout"] = json!("muon")
        }),
        ("wrong format tag", |v| {
            v["format"] = json!("overlap-plan-v2")
        }),
        ("empty gate list", |v| v["gates"] = json!([])),
        ("zero mesh dimension", |v| v["mesh"]["shard"] = json!(0)),
        ("empty shape", |v| v["params"][0]["shape"] = json!([])),
    ];
    let checker = Checker::new(schema());
    let good = to_value(&every_node_kind());
    for (what, edit) in edits {
        let mut v = good.clone();
        edit(&mut v);
        assert!(
            !checker.errors(&checker.root, &v, "plan").is_empty(),
            "the schema accepts: {what}"
        );
        assert!(
            Plan::from_json(&v.to_string()).is_err(),
            "the loader accepts: {what}"
        );
    }
}

#[test]
fn schema_and_loader_accept_null_for_optional_fields_and_a_missing_micro_batch() {
    let checker = Checker::new(schema());
    let mut v = to_value(&every_node_kind());
    v["params"][1]["owner"] = json!(null); // an fsdp parameter
    v["buckets"][0]["owner"] = json!(null); // its bucket
    let tail = v["ranks"][0]["nodes"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|n| n["micro_batch"].is_null())
        .unwrap();
    tail.as_object_mut().unwrap().remove("micro_batch");
    let stage1 = v["ranks"][0]["nodes"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|n| n["op"]["kind"] == "stage1")
        .unwrap();
    assert!(
        stage1["op"]["collective"].get("root").is_none(),
        "the first Stage 1 is a reduce-scatter"
    );
    stage1["op"]["collective"]["root"] = json!(null);

    assert_eq!(
        checker.errors(&checker.root, &v, "plan"),
        Vec::<String>::new()
    );
    assert_eq!(Plan::from_json(&v.to_string()).unwrap(), every_node_kind());
}
