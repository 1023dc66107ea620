//! Issue 12, item 5: a fuzz test over configs and plan JSON. Mutations of valid inputs
//! (lines dropped and duplicated, values replaced by huge, negative, fractional, odd or
//! control-character values; JSON numbers replaced, fields dropped, arrays truncated or
//! duplicated) must never panic in the library (`Config::from_toml`, planning,
//! validation, `Plan::from_json`) and must never kill the binary with a signal (an
//! abort is SIGABRT): its exit status is 0, 1 or 2.
//!
//! Case counts: `PROPTEST_CASES` (default 512) for each in-process property, a
//! twentieth of it (default 25) for the binary. Planning runs only where the step's plan is small
//! (the limits themselves are `tests/limits.rs`'s), and the binary runs `verify` only on
//! small meshes and models, so that no case trains at an absurd size.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use overlap::config::Config;
use overlap::graph::{export, validate, Mode, Plan, Planner};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::Value;

/// The most plan nodes a fuzz case plans and validates in-process.
const PLAN_BUDGET: u64 = 50_000;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    })
}

/// `examples/hsdp_2x2.toml` without comments: every section and key, one per line.
fn base_config() -> Vec<String> {
    include_str!("../../examples/hsdp_2x2.toml")
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim_end().to_string())
        .filter(|l| !l.trim().is_empty())
        .collect()
}

/// Values a fuzzed key may get: out of range, of the wrong type, or odd text.
const ODD_VALUES: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "-1",
    "-9223372036854775808",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "4000000000",
    "65536",
    "0.5",
    "-0.0",
    "1e400",
    "nan",
    "inf",
    "-inf",
    "true",
    "\"\"",
    "\"on\"",
    "\"no_sync\"",
    "\"muon\"",
    "\"x\\u001b[31m\"",
    "\"line\\nbreak\"",
    "\"<&'\\\">\"",
    "\"名前\"",
    "[]",
    "[0]",
    "[\"on\", \"off\", \"on\"]",
    "[4294967295, 4294967295]",
    "[1000000, 1000000]",
    "[18446744073709551615, 2]",
    "{}",
    "{ a = 1 }",
];

#[derive(Debug, Clone)]
enum Edit {
    Drop(usize),
    Duplicate(usize),
    Replace(usize, usize),
    Insert(usize, String),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        any::<usize>().prop_map(Edit::Drop),
        any::<usize>().prop_map(Edit::Duplicate),
        (any::<usize>(), 0..ODD_VALUES.len()).prop_map(|(l, v)| Edit::Replace(l, v)),
        (any::<usize>(), "[ -~\\n\\t\\u{1b}é]{0,24}").prop_map(|(l, s)| Edit::Insert(l, s)),
    ]
}

fn mutate_config(edits: &[Edit]) -> String {
    let mut lines = base_config();
    for e in edits {
        if lines.is_empty() {
            break;
        }
        let at = |i: usize| i % lines.len();
        match e {
            Edit::Drop(i) => {
                lines.remove(at(*i));
            }
            Edit::Duplicate(i) => {
                let l = lines[at(*i)].clone();
                lines.insert(at(*i), l);
            }
            Edit::Replace(i, v) => {
                let i = at(*i);
                if let Some((key, _)) = lines[i].split_once('=') {
                    lines[i] = format!("{key}= {}", ODD_VALUES[*v]);
                }
            }
            Edit::Insert(i, s) => lines.insert(at(*i), s.clone()),
        }
    }
    lines.join("\n") + "\n"
}

/// Loads, plans and validates a config text; whether it loaded and was planned.
fn load_and_plan(text: &str) -> bool {
    let Ok(cfg) = Config::from_toml(text, "fuzz.toml") else {
        return false;
    };
    let planner = Planner::new(cfg.plan.clone()).expect("a loaded config plans");
    planner
        .check_step(cfg.gates.len())
        .expect("a loaded config's step is within the limits");
    if planner.step_nodes_bound(cfg.gates.len()) > PLAN_BUDGET {
        return false;
    }
    // A gate pattern the validator rejects (a step leaving partials) is an error, not
    // a panic.
    let plan = planner.plan(&cfg.gates).expect("a checked step plans");
    let _ = validate(&plan, Mode::Step);
    let _ = export::to_text(&plan);
    let _ = export::to_dot(&plan, Some(&[0]));
    true
}

#[test]
fn fuzzed_configs_never_panic_in_loading_planning_or_validation() {
    let strategy = proptest::collection::vec(edit(), 1..6);
    let planned = AtomicU32::new(0);
    runner(cases())
        .run(&strategy, |edits| {
            let text = mutate_config(&edits);
            let outcome = catch_unwind(AssertUnwindSafe(|| load_and_plan(&text)));
            prop_assert!(outcome.is_ok(), "panicked on:\n{text}");
            if matches!(outcome, Ok(true)) {
                planned.fetch_add(1, Relaxed);
            }
            Ok(())
        })
        .unwrap();
    // Not vacuous: some mutations keep the config valid and reach the planner.
    assert!(cases() < 50 || planned.load(Relaxed) > 0);
}

/// A valid plan of the 2x2 example, as `overlap plan --format json` writes it.
fn base_plan() -> Value {
    let cfg = Config::from_toml(
        include_str!("../../examples/hsdp_2x2.toml"),
        "hsdp_2x2.toml",
    )
    .unwrap();
    let plan = Planner::new(cfg.plan.clone())
        .unwrap()
        .plan(&cfg.gates)
        .unwrap();
    serde_json::from_str(&plan.to_json()).unwrap()
}

/// Numbers a fuzzed JSON number may become.
fn odd_number(i: usize) -> Value {
    let v: [Value; 10] = [
        0.into(),
        1.into(),
        (-1).into(),
        3.into(),
        u64::from(u32::MAX).into(),
        (u64::from(u32::MAX) + 1).into(),
        4_000_000_000u64.into(),
        u64::MAX.into(),
        1e300.into(),
        0.5.into(),
    ];
    v[i % v.len()].clone()
}

#[derive(Debug, Clone)]
enum JsonEdit {
    /// Replace the n-th number (in document order) by an odd one.
    Number(usize, usize),
    /// Drop a field of the n-th object.
    DropField(usize, usize),
    /// Truncate the n-th array to a length.
    Truncate(usize, usize),
    /// Duplicate an element of the n-th array.
    DuplicateElement(usize, usize),
    /// Replace the n-th string.
    String(usize, String),
}

fn json_edit() -> impl Strategy<Value = JsonEdit> {
    prop_oneof![
        4 => (any::<usize>(), any::<usize>()).prop_map(|(n, v)| JsonEdit::Number(n, v)),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(n, f)| JsonEdit::DropField(n, f)),
        1 => (any::<usize>(), 0usize..4).prop_map(|(n, l)| JsonEdit::Truncate(n, l)),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(n, e)| JsonEdit::DuplicateElement(n, e)),
        1 => (any::<usize>(), "[a-z_\\u{1b}\\n\"<&]{0,12}").prop_map(|(n, s)| JsonEdit::String(n, s)),
    ]
}

/// JSON pointers of every value of a document satisfying `keep`, in document order.
fn pointers(v: &Value, here: String, keep: &dyn Fn(&Value) -> bool, out: &mut Vec<String>) {
    if keep(v) {
        out.push(here.clone());
    }
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{here}/{i}"), keep, out);
            }
        }
        Value::Object(o) => {
            for (k, x) in o {
                pointers(x, format!("{here}/{k}"), keep, out);
            }
        }
        _ => {}
    }
}

fn apply(doc: &mut Value, e: &JsonEdit) {
    let pick = |doc: &Value, keep: &dyn Fn(&Value) -> bool, n: usize| -> Option<String> {
        let mut all = Vec::new();
        pointers(doc, String::new(), keep, &mut all);
        (!all.is_empty()).then(|| all[n % all.len()].clone())
    };
    match e {
        JsonEdit::Number(n, v) => {
            if let Some(p) = pick(doc, &Value::is_number, *n) {
                *doc.pointer_mut(&p).unwrap() = odd_number(*v);
            }
        }
        JsonEdit::DropField(n, f) => {
            if let Some(p) = pick(doc, &|v| v.as_object().is_some_and(|o| !o.is_empty()), *n) {
                let o = doc.pointer_mut(&p).unwrap().as_object_mut().unwrap();
                let key = o.keys().nth(f % o.len()).unwrap().clone();
                o.remove(&key);
            }
        }
        JsonEdit::Truncate(n, l) => {
            if let Some(p) = pick(doc, &Value::is_array, *n) {
                doc.pointer_mut(&p)
                    .unwrap()
                    .as_array_mut()
                    .unwrap()
                    .truncate(*l);
            }
        }
        JsonEdit::DuplicateElement(n, i) => {
            if let Some(p) = pick(doc, &|v| v.as_array().is_some_and(|a| !a.is_empty()), *n) {
                let a = doc.pointer_mut(&p).unwrap().as_array_mut().unwrap();
                let x = a[i % a.len()].clone();
                a.insert(i % a.len(), x);
            }
        }
        JsonEdit::String(n, s) => {
            if let Some(p) = pick(doc, &Value::is_string, *n) {
                *doc.pointer_mut(&p).unwrap() = s.clone().into();
            }
        }
    }
}

fn mutate_plan(base: &Value, edits: &[JsonEdit]) -> String {
    let mut doc = base.clone();
    for e in edits {
        apply(&mut doc, e);
    }
    doc.to_string()
}

#[test]
fn fuzzed_plan_json_never_panics_in_loading_or_validation() {
    let base = base_plan();
    let strategy = proptest::collection::vec(json_edit(), 1..4);
    let loaded = AtomicU32::new(0);
    runner(cases())
        .run(&strategy, |edits| {
            let text = mutate_plan(&base, &edits);
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                let Ok(plan) = Plan::from_json(&text) else {
                    return false;
                };
                let _ = validate(&plan, Mode::Step);
                let _ = validate(&plan, Mode::Prefix);
                let _ = export::to_text(&plan);
                true
            }));
            prop_assert!(outcome.is_ok(), "panicked on edits {edits:?}");
            if matches!(outcome, Ok(true)) {
                loaded.fetch_add(1, Relaxed);
            }
            Ok(())
        })
        .unwrap();
    // Not vacuous: some mutated plans are well formed and reach the validator.
    assert!(cases() < 50 || loaded.load(Relaxed) > 0);
    // Nesting past serde_json's recursion limit is an error, not a stack overflow.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(Plan::from_json(&deep).is_err());
}

fn scratch(name: &str, contents: &str) -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p.to_str().unwrap().to_string()
}

/// Runs the binary and asserts it exited by itself with 0, 1 or 2, without a panic.
fn run_binary(args: &[&str], input: &str) -> Result<(), TestCaseError> {
    let o = Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("the binary runs");
    let err = String::from_utf8_lossy(&o.stderr);
    prop_assert!(
        matches!(o.status.code(), Some(0..=2)),
        "{args:?} ended with {:?} on:\n{input}\nstderr: {err}",
        o.status
    );
    prop_assert!(
        !err.contains("panicked"),
        "{args:?} panicked on:\n{input}\n{err}"
    );
    Ok(())
}

/// Whether a loaded config is small enough to run `verify` on in a test.
fn small(cfg: &Config) -> bool {
    let numel: u64 = cfg.plan.params.iter().map(|p| p.numel()).sum();
    cfg.plan.mesh.world() <= 8
        && numel <= 200_000
        && cfg.gates.len() <= 8
        && cfg.muon.ns_steps <= 10
        && cfg.run.backward_us_per_layer <= 1000
}

#[test]
fn the_binary_exits_0_1_or_2_on_fuzzed_configs_and_plans() {
    let n = (cases() / 20).max(1);
    let base = base_plan();
    let strategy = (
        proptest::collection::vec(edit(), 1..5),
        proptest::collection::vec(json_edit(), 1..3),
        0usize..3,
    );
    let case = AtomicU32::new(0);
    runner(n)
        .run(&strategy, |(edits, json_edits, format)| {
            let case = case.fetch_add(1, Relaxed);
            let text = mutate_config(&edits);
            let config = scratch(&format!("config{case}.toml"), &text);
            let loaded = catch_unwind(AssertUnwindSafe(|| {
                Config::from_toml(&text, "fuzz.toml").ok()
            }))
            .ok()
            .flatten();
            let format = ["text", "dot", "json"][format];
            run_binary(&["plan", "--config", &config, "--format", format], &text)?;
            if loaded.as_ref().is_some_and(small) {
                run_binary(
                    &[
                        "verify",
                        "--config",
                        &config,
                        "--steps",
                        "1",
                        "--backend",
                        "cpu",
                    ],
                    &text,
                )?;
            }
            let plan = mutate_plan(&base, &json_edits);
            let file = scratch(&format!("plan{case}.json"), &plan);
            run_binary(&["check", "--plan", &file], &format!("{json_edits:?}"))
        })
        .unwrap();
}
