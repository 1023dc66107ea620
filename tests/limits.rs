//! Issue 12, item 4: no input aborts or panics. Each test is an input that used to
//! abort (allocation failure), panic or run away, and now is an error naming the key
//! and the limit (exit 2 from the command line: `cli/tests/limits.rs`); and names with control characters,
//! quotes and markup come out escaped in text, DOT and SVG.

use std::path::PathBuf;

use overlap::config::{Config, ConfigError};
use overlap::graph::{
    export, Gate, Mesh, ModelSpec, ParamSpec, PlanSpec, Planner, Route, MAX_MICRO_BATCHES,
    MAX_PARAMS, MAX_WORLD,
};

use overlap::resources;

const FILE: &str = "job.toml";

fn err(text: &str) -> ConfigError {
    match Config::from_toml(text, FILE) {
        Ok(c) => panic!("expected an error, got {:?}", c.plan.mesh),
        Err(e) => e,
    }
}

/// Asserts the key, the line and phrases of the reason.
#[track_caller]
fn expect(text: &str, key: &str, line: usize, phrases: &[&str]) {
    let e = err(text);
    assert_eq!(e.key, key, "{e}");
    assert_eq!(e.line, Some(line), "{e}");
    for p in phrases {
        assert!(e.reason.contains(p), "reason lacks {p:?}: {e}");
    }
}

const MESH: &str = "[mesh]\nshard = 2\nreplicate = 2\n";
const PARAM: &str = "[[param]]\nname = \"w\"\nshape = [4, 3]\nroute = \"muon\"\n";

fn model(layers: &str, hidden: &str, vocab: &str) -> String {
    format!("{MESH}[model]\nlayers = {layers}\nhidden = {hidden}\nvocab = {vocab}\n")
}

#[test]
fn huge_model_layers_are_a_limit_not_an_allocation_failure() {
    for layers in ["4000000000", "4294967295", "4097"] {
        expect(
            &model(layers, "8", "8"),
            "model.layers",
            5,
            &["more than the limit of 4096 blocks"],
        );
    }
}

#[test]
fn a_hidden_size_that_overflows_blames_model_hidden() {
    // 18446744073709551615 made `3 * hidden` overflow (a panic).
    for hidden in ["18446744073709551615", "100000", "32768"] {
        expect(
            &model("2", hidden, "8"),
            "model.hidden",
            6,
            &["blocks.*.fc1", "4294967295"],
        );
    }
}

#[test]
fn a_huge_vocabulary_blames_model_vocab() {
    expect(
        &model("2", "8", "100000000000"),
        "model.vocab",
        7,
        &["`embed` and `head`", "4294967295"],
    );
}

#[test]
fn billions_of_micro_batches_are_a_limit() {
    // 4000000000 allocated a gate per micro-batch (4 GB) and aborted.
    let text = format!("{MESH}{PARAM}[accumulation]\nmicro_batches = 4000000000\n");
    expect(
        &text,
        "accumulation.micro_batches",
        9,
        &["more than the limit of 65536"],
    );
    assert_eq!(MAX_MICRO_BATCHES, 65_536);
}

#[test]
fn a_step_plan_past_the_node_limit_blames_the_micro_batches() {
    let text = "[mesh]\nshard = 128\nreplicate = 128\n[model]\nlayers = 8\nhidden = 8\nvocab = 8\n[accumulation]\nmicro_batches = 64\n";
    expect(
        text,
        "accumulation.micro_batches",
        9,
        &["plan nodes", "more than the limit of 16777216"],
    );
}

#[test]
fn meshes_past_the_planners_rank_limit_blame_the_mesh() {
    // 4294967295x1 aborted allocating per-rank tables; 65536x1 planned for minutes.
    for (s, r) in [
        ("4294967295", "1"),
        ("65536", "1"),
        ("1", "16385"),
        ("100000", "100000"),
    ] {
        let text = format!("[mesh]\nshard = {s}\nreplicate = {r}\n{PARAM}");
        expect(
            &text,
            "mesh",
            1,
            &["more than the planner's limit of 16384"],
        );
    }
    assert_eq!(MAX_WORLD, 16_384);
}

#[test]
fn huge_shapes_blame_the_shape() {
    for shape in [
        "[4294967295, 4294967295]",
        "[1000000, 1000000]",
        "[65536, 65536]",
        "[18446744073709551615, 2]",
    ] {
        let text = format!("{MESH}[[param]]\nname = \"w\"\nshape = {shape}\nroute = \"fsdp\"\n");
        expect(&text, "param[0].shape", 6, &["limit", "4294967295"]);
    }
}

#[test]
fn newton_schulz_steps_are_bounded() {
    let text = format!("{MESH}{PARAM}[optimizer.muon]\nns_steps = 4000000000\n");
    expect(
        &text,
        "optimizer.muon.ns_steps",
        9,
        &["between 1 and 100 iterations"],
    );
}

#[test]
fn too_many_parameters_blame_param() {
    let mut text = String::from("[mesh]\nshard = 1\nreplicate = 1\n");
    for i in 0..=MAX_PARAMS {
        text.push_str(&format!(
            "[[param]]\nname = \"p{i}\"\nshape = [1]\nroute = \"fsdp\"\n"
        ));
    }
    let e = err(&text);
    assert_eq!(e.key, "param", "{e}");
    assert!(e.reason.contains("more than the limit of 32768"), "{e}");
}

#[test]
fn duplicate_keys_name_the_key_and_the_first_line() {
    expect(
        "[mesh]\nshard = 2\nshard = 3\nreplicate = 1\n",
        "mesh.shard",
        3,
        &["duplicate key `mesh.shard`", "line 2 has it too"],
    );
    expect(
        &format!("{MESH}{PARAM}[mesh]\nshard = 1\n"),
        "mesh",
        8,
        &["duplicate key `mesh`", "line 1 has it too"],
    );
    expect(
        &format!("{MESH}{PARAM}{PARAM}route = \"fsdp\"\n"),
        "param[1].route",
        12,
        &["duplicate key `param[1].route`", "line 11 has it too"],
    );
    expect(
        &format!("{MESH}{PARAM}[optimizer.adamw]\nlr = 0.1\nlr = 0.2\n"),
        "optimizer.adamw.lr",
        10,
        &["duplicate key `optimizer.adamw.lr`", "line 9"],
    );
}

#[test]
fn control_characters_in_names_are_rejected_escaped() {
    for name in ["w\\u001b[31m", "a\\nb", "tab\\there", "\\u0000"] {
        let text = format!("{MESH}[[param]]\nname = \"{name}\"\nshape = [4]\nroute = \"fsdp\"\n");
        let e = err(&text);
        assert_eq!(e.key, "param[0].name", "{e}");
        assert!(e.reason.contains("control character"), "{e}");
        assert!(!e.to_string().chars().any(char::is_control), "{e:?}");
    }
    // Quotes, markup and unicode are fine in names.
    let text = format!(
        "{MESH}[[param]]\nname = \"<a href=\\\"x\\\">&amp; 名前 ü\"\nshape = [4]\nroute = \"fsdp\"\n"
    );
    Config::from_toml(&text, FILE).unwrap();
}

fn spec(mesh: Mesh, params: Vec<ParamSpec>) -> PlanSpec {
    PlanSpec::new(mesh, params).with_bucket_cap_bytes(1 << 20)
}

fn param(name: &str, shape: Vec<u64>, route: Route) -> ParamSpec {
    ParamSpec::new(name, shape, route, 0)
}

#[test]
fn the_library_path_returns_errors_for_absurd_specs() {
    let w = || vec![param("w", vec![4, 3], Route::Muon)];
    let huge_mesh = Mesh {
        shard: u32::MAX,
        replicate: 1,
    };
    assert!(Planner::new(spec(huge_mesh, w())).is_err());
    assert!(spec(huge_mesh, w()).check().is_err());
    let overflowing = vec![param("w", vec![u64::MAX, u64::MAX, 2], Route::Fsdp)];
    let e = Planner::new(spec(Mesh::new(2, 2).unwrap(), overflowing)).unwrap_err();
    assert!(e.to_string().contains("limit is 4294967295"), "{e}");
    // An unchecked generator does not panic, and the planner rejects what it made.
    let m = ModelSpec::new(1, u64::MAX, 8);
    assert!(m.check().is_err());
    assert!(Planner::new(spec(Mesh::new(1, 1).unwrap(), m.params())).is_err());
    let planner = Planner::new(spec(Mesh::new(2, 2).unwrap(), w())).unwrap();
    assert!(planner.check_step(MAX_MICRO_BATCHES + 1).is_err());
    planner.check_step(4).unwrap();
    planner.plan(&[Gate::ReplicateOff, Gate::On]).unwrap();
}

#[test]
fn names_with_control_characters_and_markup_are_escaped_in_text_and_dot() {
    let odd = "x\u{1b}[31m\n\"q\"\\<&>\u{7}";
    let planner = Planner::new(spec(
        Mesh::new(2, 1).unwrap(),
        vec![
            param(odd, vec![4, 3], Route::Muon),
            param("n", vec![5], Route::Fsdp),
        ],
    ))
    .unwrap();
    let plan = planner.plan(&[Gate::On]).unwrap();
    let text = export::to_text(&plan);
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "raw control character in the listing"
    );
    assert!(
        text.contains("x\\u{1b}[31m\\u{a}\"q\"\\<&>\\u{7}"),
        "{text}"
    );
    // The listing has as many lines as without the odd name.
    let plain = Planner::new(spec(
        Mesh::new(2, 1).unwrap(),
        vec![
            param("plain", vec![4, 3], Route::Muon),
            param("n", vec![5], Route::Fsdp),
        ],
    ))
    .unwrap()
    .plan(&[Gate::On])
    .unwrap();
    assert_eq!(
        text.lines().count(),
        export::to_text(&plain).lines().count()
    );
    let dot = export::to_dot(&plan, None);
    assert!(!dot.chars().any(|c| c.is_control() && c != '\n'));
    // Every label is one DOT string: the quote and backslash are escaped.
    assert!(
        dot.contains("x\\\\u{1b}[31m\\\\u{a}\\\"q\\\"\\\\<&>\\\\u{7}"),
        "{dot}"
    );
    for line in dot.lines().filter(|l| l.contains("label=\"optimizer x")) {
        let unescaped_quotes = line
            .char_indices()
            .filter(|&(i, c)| c == '"' && !escaped_at(line, i))
            .count();
        assert_eq!(unescaped_quotes % 2, 0, "{line}");
    }
    let svg = overlap::observe::svg::escape(odd);
    assert!(!svg.chars().any(char::is_control), "{svg}");
    assert!(!svg.contains('<') && !svg.contains('"'), "{svg}");
}

/// Whether the character at byte `i` follows an odd number of backslashes.
fn escaped_at(s: &str, i: usize) -> bool {
    s[..i].chars().rev().take_while(|&c| c == '\\').count() % 2 == 1
}

#[test]
fn an_estimate_of_terabytes_is_refused_and_a_small_job_is_not() {
    let big = Config::from_toml(
        "[mesh]\nshard = 32\nreplicate = 32\n[[param]]\nname = \"w\"\nshape = [65535, 65537]\nroute = \"fsdp\"\n",
        FILE,
    )
    .unwrap();
    let planner = Planner::new(big.plan.clone()).unwrap();
    let e = resources::estimate_cpu(&big, &planner, 1);
    assert!(e.total() > 1 << 44, "{e}");
    let msg = resources::check_memory(&e, Some(64 << 30), "job")
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("needs about") && msg.contains("64.0 GiB available"),
        "{msg}"
    );
    let small = Config::from_file(&example("hsdp_2x2.toml")).unwrap();
    let est = resources::check_cpu(&small, 2).unwrap();
    assert!(est.total() < 64 << 20, "{est}");
    // verify's two sessions cost about twice one.
    let one = resources::estimate_cpu(&small, &Planner::new(small.plan.clone()).unwrap(), 1);
    assert!(est.total() >= 2 * one.total() - one.host, "{est} vs {one}");
    // `[forward]` adds the gathered full parameters: a few layers of them, or every
    // layer when the forward's are kept for the backward.
    let mut fwd = small.clone();
    let estimate =
        |c: &Config| resources::estimate_cpu(c, &Planner::new(c.plan.clone()).unwrap(), 1).params;
    fwd.plan.forward = Some(overlap::graph::ForwardSpec::default());
    let some = estimate(&fwd);
    fwd.plan.forward = Some(
        overlap::graph::ForwardSpec::default()
            .with_prefetch(1)
            .with_reshard_after_forward(false),
    );
    let all = estimate(&fwd);
    assert!(
        one.params < some && some < all,
        "{} {some} {all}",
        one.params
    );
}

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(name)
}

#[test]
fn a_process_of_a_job_counts_its_own_ranks_and_its_machine_counts_every_process() {
    let cfg = Config::from_file(&example("hsdp_2x2.toml")).unwrap();
    let mesh = cfg.plan.mesh;
    let planner = Planner::new(cfg.plan.clone()).unwrap();
    let all: Vec<u32> = (0..mesh.world()).collect();
    let whole = resources::estimate_cpu_ranks(&cfg, &planner, 1, &all, false);
    // The ranks' parameters, state and gradients add up to the whole mesh's: the owned
    // parameters sit on their owners' shard columns only.
    let ranks: Vec<_> = all
        .iter()
        .map(|&r| resources::estimate_cpu_ranks(&cfg, &planner, 1, &[r], false))
        .collect();
    let sum = |f: fn(&resources::MemoryEstimate) -> u64| ranks.iter().map(f).sum::<u64>();
    assert_eq!(sum(|e| e.params), whole.params);
    assert_eq!(sum(|e| e.optimizer), whole.optimizer);
    assert_eq!(sum(|e| e.gradients), whole.gradients);
    assert!(
        ranks.iter().any(|e| e.params != ranks[0].params),
        "owners differ"
    );
    // A linked rank also holds what the other ranks send it.
    let linked = resources::estimate_cpu_ranks(&cfg, &planner, 1, &[1], true);
    assert!(linked.host > ranks[1].host, "{linked} vs {}", ranks[1]);

    // Processes on a machine: launchers number them consecutively.
    let here = resources::RanksHere::one(mesh, 3, 1, Some(2));
    assert_eq!(here.process, vec![3]);
    assert_eq!(here.machine, vec![vec![2], vec![3]]);
    let unknown = resources::RanksHere::one(mesh, 3, 1, None);
    assert_eq!(
        unknown.machine.len(),
        4,
        "every rank taken to share the machine"
    );
    assert_eq!(resources::RanksHere::all(mesh).machine, vec![all]);
    assert!(resources::check_cpu_ranks(&cfg, 2, &here).is_ok());
}
