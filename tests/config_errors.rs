//! The config contract's errors: every bad input names the file, the key, the line and
//! a reason; and a good config parses to exactly the expected [`Config`].

use std::path::Path;

use overlap::config::{
    BackendChoice, Config, ConfigError, GradSource, MetricsConfig, OverlapConfig, Overrides,
    RunConfig, TransportChoice, DEFAULT_BUCKET_CAP_BYTES,
};
use overlap::executor::LrSchedule;
use overlap_graph::{
    Bindings, DType, Gate, Mesh, ModelSpec, ParamSpec, ReduceOp, ReduceSpec, Route, Schedule,
    Stream, Transport,
};
use overlap_ops::{AdamwParams, MuonParams};

const FILE: &str = "job.toml";

/// A valid mesh and parameter, lines 1-7, for tests that break something after them.
const BASE: &str = "[mesh]
shard = 2
replicate = 2
[[param]]
name = \"w\"
shape = [4, 3]
route = \"muon\"
";

fn err(text: &str) -> ConfigError {
    match Config::from_toml(text, FILE) {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => e,
    }
}

/// Asserts the error's file, key, line and a phrase of its reason.
#[track_caller]
fn expect(text: &str, key: &str, line: Option<usize>, phrase: &str) -> ConfigError {
    let e = err(text);
    assert_eq!(e.file, FILE, "{e}");
    assert_eq!(e.key, key, "{e}");
    assert_eq!(e.line, line, "{e}");
    assert_eq!(e.line.is_some(), e.column.is_some(), "{e}");
    assert!(e.reason.contains(phrase), "reason lacks {phrase:?}: {e}");
    e
}

fn with_base(rest: &str) -> String {
    format!("{BASE}{rest}")
}

#[test]
fn missing_file_names_the_path() {
    let e = Config::from_file(Path::new("no/such/config.toml")).unwrap_err();
    assert_eq!(e.file, "no/such/config.toml");
    assert_eq!(e.key, "");
    assert_eq!(e.line, None);
    assert!(e.reason.contains("cannot read"), "{e}");
    assert!(
        e.to_string()
            .starts_with("no/such/config.toml: cannot read"),
        "{e}"
    );
}

#[test]
fn syntax_error_points_at_the_line() {
    let e = expect(
        "[mesh]\nshard = 2\nreplicate = \n",
        "mesh.replicate",
        Some(3),
        "invalid TOML",
    );
    assert_eq!(e.column, Some(13));
    expect("[mesh\nshard = 2\n", "mesh", Some(1), "invalid TOML");
    expect(
        &with_base("[mesh]\nshard = 1\n"),
        "mesh",
        Some(8),
        "duplicate key",
    );
}

#[test]
fn unknown_top_level_section_lists_the_allowed_ones() {
    let e = expect(
        &with_base("[trainer]\nlr = 1\n"),
        "trainer",
        Some(8),
        "unknown key `trainer`",
    );
    assert!(
        e.reason.contains("mesh")
            && e.reason.contains("accumulation")
            && e.reason.contains("metrics"),
        "{e}"
    );
}

#[test]
fn unknown_key_in_a_section_lists_the_allowed_ones() {
    let e = expect(
        "[mesh]\nshard = 2\nreplicas = 2\n",
        "mesh.replicas",
        Some(3),
        "unknown key `replicas`",
    );
    assert!(e.reason.contains("shard, replicate"), "{e}");
    expect(
        &with_base("sizes = [1]\n"),
        "param[0].sizes",
        Some(8),
        "allowed keys here: name, shape, route, layer",
    );
    expect(
        &with_base("[optimizer.sgd]\nlr = 1\n"),
        "optimizer.sgd",
        Some(8),
        "adamw, muon",
    );
    expect(
        &with_base("[optimizer.adamw]\nbeta = 0.9\n"),
        "optimizer.adamw.beta",
        Some(9),
        "unknown key `beta`",
    );
}

#[test]
fn wrong_type_says_what_was_expected() {
    let e = expect(
        "[mesh]\nshard = \"two\"\nreplicate = 2\n",
        "mesh.shard",
        Some(2),
        "wrong type",
    );
    assert!(e.reason.contains("whole number"), "{e}");
    expect(
        &with_base("[run]\nsteps = 1.5\n"),
        "run.steps",
        Some(9),
        "wrong type",
    );
    expect(
        &with_base("[accumulation]\ngates = \"on\"\n"),
        "accumulation.gates",
        Some(9),
        "expected an array",
    );
}

#[test]
fn negative_integer_is_out_of_range() {
    expect(
        "[mesh]\nshard = -1\nreplicate = 2\n",
        "mesh.shard",
        Some(2),
        "out of range",
    );
    expect(
        &with_base("[[param]]\nname = \"v\"\nshape = [3, -2]\nroute = \"fsdp\"\n"),
        "param[1].shape[1]",
        Some(10),
        "out of range",
    );
}

#[test]
fn zero_sized_mesh_is_rejected() {
    expect(
        "[mesh]\nshard = 0\nreplicate = 2\n",
        "mesh.shard",
        Some(2),
        "at least 1",
    );
    expect(
        "[mesh]\nshard = 2\nreplicate = 0\n",
        "mesh.replicate",
        Some(3),
        "at least 1",
    );
}

#[test]
fn missing_mesh_section_says_what_to_add() {
    expect(
        "[[param]]\nname = \"w\"\nshape = [4]\nroute = \"fsdp\"\n",
        "mesh",
        None,
        "missing [mesh]",
    );
}

#[test]
fn missing_required_key_names_it() {
    expect(
        "[mesh]\nshard = 2\n",
        "mesh.replicate",
        Some(1),
        "missing required key `replicate`",
    );
    expect(
        &with_base("[[param]]\nname = \"v\"\nroute = \"fsdp\"\n"),
        "param[1].shape",
        Some(8),
        "missing required key `shape`",
    );
}

#[test]
fn gate_list_of_the_wrong_length() {
    let e = expect(
        &with_base("[accumulation]\nmicro_batches = 3\nreplicate_gate = [\"off\", \"on\"]\n"),
        "accumulation.replicate_gate",
        Some(10),
        "has 2 entries but micro_batches is 3",
    );
    assert_eq!(e.column, Some(18));
    expect(
        &with_base("[accumulation]\nreplicate_gate = [\"off\", \"on\"]\nreduce_gate = [\"on\"]\n"),
        "accumulation.reduce_gate",
        Some(10),
        "has 1 entries but `replicate_gate` has 2",
    );
    expect(
        &with_base("[accumulation]\nreduce_gate = []\n"),
        "accumulation.reduce_gate",
        Some(9),
        "empty",
    );
}

#[test]
fn gate_value_other_than_on_off() {
    let e = expect(
        &with_base("[accumulation]\nreplicate_gate = [\"off\", \"no_sync\"]\n"),
        "accumulation.replicate_gate[1]",
        Some(9),
        "unknown gate value `no_sync`; expected \"on\" or \"off\"",
    );
    assert_eq!(e.column, Some(26));
    expect(
        &with_base("[accumulation]\nreduce_gate = [\"true\"]\n"),
        "accumulation.reduce_gate[0]",
        Some(9),
        "\"on\" or \"off\"",
    );
    expect(
        &with_base("[accumulation]\ngates = [\"on\", \"sync\"]\n"),
        "accumulation.gates[1]",
        Some(9),
        "expected no_sync, off or on",
    );
}

#[test]
fn gates_together_with_the_two_lists() {
    expect(
        &with_base("[accumulation]\nreplicate_gate = [\"on\"]\ngates = [\"on\"]\n"),
        "accumulation.gates",
        Some(10),
        "cannot be combined",
    );
}

#[test]
fn zero_micro_batches() {
    expect(
        &with_base("[accumulation]\nmicro_batches = 0\n"),
        "accumulation.micro_batches",
        Some(9),
        "at least 1",
    );
}

#[test]
fn unknown_route_lists_the_valid_ones() {
    let e = expect("[mesh]\nshard = 1\nreplicate = 1\n[[param]]\nname = \"w\"\nshape = [4, 4]\nroute = \"sgd\"\n", "param[0].route", Some(7), "unknown route `sgd`");
    assert!(e.reason.contains("muon, adamw, sharded_adamw, fsdp"), "{e}");
}

#[test]
fn shape_with_a_zero_dimension_or_empty() {
    expect(
        &with_base("[[param]]\nname = \"v\"\nshape = [3, 0]\nroute = \"fsdp\"\n"),
        "param[1].shape",
        Some(10),
        "dimension 1 of shape [3, 0] is zero",
    );
    expect(
        &with_base("[[param]]\nname = \"v\"\nshape = []\nroute = \"fsdp\"\n"),
        "param[1].shape",
        Some(10),
        "the shape is empty",
    );
}

#[test]
fn empty_parameter_name() {
    expect(
        &with_base("[[param]]\nname = \"\"\nshape = [3]\nroute = \"fsdp\"\n"),
        "param[1].name",
        Some(9),
        "the name is empty",
    );
}

#[test]
fn muon_route_on_a_vector() {
    expect(
        &with_base("[[param]]\nname = \"bias\"\nshape = [8]\nroute = \"muon\"\n"),
        "param[1].route",
        Some(11),
        "needs a matrix",
    );
}

#[test]
fn duplicate_parameter_names() {
    let e = expect(
        &with_base("[[param]]\nname = \"w\"\nshape = [3]\nroute = \"fsdp\"\n"),
        "param[1].name",
        Some(9),
        "duplicate parameter name `w`",
    );
    assert!(e.reason.contains("param[0] (line 5)"), "{e}");
    let model = "[mesh]\nshard = 1\nreplicate = 1\n[model]\nlayers = 1\nhidden = 4\nvocab = 8\n[[param]]\nname = \"head\"\nshape = [3]\nroute = \"fsdp\"\n";
    let e = expect(
        model,
        "param[0].name",
        Some(9),
        "duplicate parameter name `head`",
    );
    assert!(e.reason.contains("generated by [model]"), "{e}");
}

#[test]
fn no_parameters_at_all() {
    expect(
        "[mesh]\nshard = 2\nreplicate = 2\n",
        "param",
        None,
        "no parameters",
    );
}

#[test]
fn zero_model_sizes() {
    let model = |l: u32, h: u32, v: u32| {
        format!(
            "[mesh]\nshard = 1\nreplicate = 1\n[model]\nlayers = {l}\nhidden = {h}\nvocab = {v}\n"
        )
    };
    expect(
        &model(0, 4, 8),
        "model.layers",
        Some(5),
        "`layers` must be at least 1",
    );
    expect(
        &model(1, 0, 8),
        "model.hidden",
        Some(6),
        "`hidden` must be at least 1",
    );
    expect(
        &model(1, 4, 0),
        "model.vocab",
        Some(7),
        "`vocab` must be at least 1",
    );
}

#[test]
fn oversized_model_is_rejected_at_the_model() {
    expect(
        "[mesh]\nshard = 1\nreplicate = 1\n[model]\nlayers = 1\nhidden = 100000\nvocab = 8\n",
        "model.hidden",
        Some(6),
        "more than the limit of 4294967295 (2^32 - 1) elements per parameter",
    );
}

#[test]
fn zero_steps() {
    expect(
        &with_base("[run]\nseed = 1\nsteps = 0\n"),
        "run.steps",
        Some(10),
        "at least 1",
    );
}

#[test]
fn zero_stage1_window() {
    expect(
        &with_base("[overlap]\nstage1_window = 0\n"),
        "overlap.stage1_window",
        Some(9),
        "at least 1",
    );
}

#[test]
fn unknown_transport() {
    let e = expect(
        &with_base("[overlap]\ntransport = \"nvlink\"\n"),
        "overlap.transport",
        Some(9),
        "unknown transport `nvlink`",
    );
    assert!(e.reason.contains("auto, nccl or copy"), "{e}");
}

#[test]
fn auto_transport_is_settled_by_the_jobs_placement() {
    let mut c = Config::from_toml(BASE, FILE).unwrap();
    assert_eq!(c.overlap.transport, TransportChoice::Auto);
    // Until settled (and on the CPU backend): NCCL-style collectives.
    assert_eq!(c.plan.schedule.transport, Transport::Nccl);
    c.settle_transport(true);
    assert_eq!(c.plan.schedule.transport, Transport::Copy);
    c.settle_transport(false);
    assert_eq!(c.plan.schedule.transport, Transport::Nccl);
    // An explicit choice is kept whatever the placement.
    for (text, want) in [("nccl", Transport::Nccl), ("copy", Transport::Copy)] {
        let mut c = Config::from_toml(
            &with_base(&format!("[overlap]\ntransport = \"{text}\"\n")),
            FILE,
        )
        .unwrap();
        c.settle_transport(true);
        assert_eq!(c.plan.schedule.transport, want, "{text}");
        c.settle_transport(false);
        assert_eq!(c.plan.schedule.transport, want, "{text}");
    }
}

#[test]
fn copy_ring_depth_out_of_range() {
    for bad in ["0", "17"] {
        expect(
            &with_base(&format!("[overlap]\ncopy_ring_depth = {bad}\n")),
            "overlap.copy_ring_depth",
            Some(9),
            "between 1 and 16 slots",
        );
    }
}

#[test]
fn copy_slot_out_of_range() {
    for bad in ["0", "4097"] {
        expect(
            &with_base(&format!("[overlap]\ncopy_slot_mib = {bad}\n")),
            "overlap.copy_slot_mib",
            Some(9),
            "between 1 and 4096",
        );
    }
}

#[test]
fn nccl_ctas_out_of_range() {
    for bad in ["0", "1025"] {
        expect(
            &with_base(&format!("[overlap]\nnccl_max_ctas = {bad}\n")),
            "overlap.nccl_max_ctas",
            Some(9),
            "between 1 and 1024",
        );
    }
}

#[test]
fn negative_combine_lag() {
    expect(
        &with_base("[overlap]\ncombine_lag = -1\n"),
        "overlap.combine_lag",
        Some(9),
        "",
    );
}

#[test]
fn unknown_combine_stream() {
    expect(
        &with_base("[streams]\ncombine = \"copy_engine\"\n"),
        "streams.combine",
        Some(9),
        "unknown stream `copy_engine`",
    );
}

#[test]
fn zero_bucket_cap() {
    expect(
        &with_base("[buckets]\ncap_bytes = 0\n"),
        "buckets.cap_bytes",
        Some(9),
        "at least 1",
    );
}

#[test]
fn unknown_stream_name() {
    let e = expect(
        &with_base("[streams]\nfold = \"nvlink\"\n"),
        "streams.fold",
        Some(9),
        "unknown stream `nvlink`",
    );
    assert!(
        e.reason
            .contains("compute, reduce, replicate, publish or copy"),
        "{e}"
    );
}

#[test]
fn unknown_binding_key() {
    let e = expect(
        &with_base("[streams]\nstage3 = \"reduce\"\n"),
        "streams.stage3",
        Some(9),
        "unknown key `stage3`",
    );
    assert!(
        e.reason
            .contains("accumulate, pack, stage1, fold, stage2, unpack, optimizer, publish"),
        "{e}"
    );
}

#[test]
fn unknown_reduce_op_and_dtype() {
    expect(
        &with_base("[reduce]\nop = \"max\"\n"),
        "reduce.op",
        Some(9),
        "unknown value `max`; expected `avg` or `sum`",
    );
    expect(
        &with_base("[reduce]\ndtype = \"f16\"\n"),
        "reduce.dtype",
        Some(9),
        "`f32` or `bf16`",
    );
}

#[test]
fn unknown_backend() {
    expect(
        &with_base("[run]\nbackend = \"rocm\"\n"),
        "run.backend",
        Some(9),
        "unknown backend `rocm`; expected auto, cpu or cuda",
    );
}

#[test]
fn unknown_gradient_source() {
    expect(
        &with_base("[run]\ngrads = \"disk\"\n"),
        "run.grads",
        Some(9),
        "unknown gradient source `disk`; expected host or device",
    );
}

#[test]
fn gradient_source_round_trips_its_names() {
    for g in GradSource::ALL {
        assert_eq!(g.name().parse::<GradSource>(), Ok(g));
    }
}

#[test]
fn backward_cost_above_one_second_per_layer() {
    expect(
        &with_base("[run]\nbackward_us_per_layer = 5000000\n"),
        "run.backward_us_per_layer",
        Some(9),
        "must be at most 1000000 (one second per layer), got 5000000",
    );
}

#[test]
fn step_timeout_above_a_day() {
    expect(
        &with_base("[run]\nstep_timeout = 100000\n"),
        "run.step_timeout",
        Some(9),
        "must be at most 86400 seconds (a day; 0 means the default 300), got 100000",
    );
}

#[test]
fn step_timeout_zero_means_the_default() {
    let c = Config::from_toml(&with_base("[run]\nstep_timeout = 0\n"), FILE).unwrap();
    assert_eq!(c.run.step_timeout_s, 300);
}

#[test]
fn negative_learning_rate() {
    expect(
        &with_base("[optimizer.adamw]\nlr = -0.1\n"),
        "optimizer.adamw.lr",
        Some(9),
        "finite number >= 0",
    );
    expect(
        &with_base("[optimizer.muon]\nlr = -1\n"),
        "optimizer.muon.lr",
        Some(9),
        "finite number >= 0",
    );
}

#[test]
fn non_finite_learning_rate() {
    expect(
        &with_base("[optimizer.adamw]\nlr = nan\n"),
        "optimizer.adamw.lr",
        Some(9),
        "finite",
    );
    expect(
        &with_base("[optimizer.muon]\nlr = inf\n"),
        "optimizer.muon.lr",
        Some(9),
        "finite",
    );
    // Finite in f64 but not in f32.
    expect(
        &with_base("[optimizer.muon]\nlr = 1e300\n"),
        "optimizer.muon.lr",
        Some(9),
        "finite",
    );
}

#[test]
fn other_hyper_parameters_out_of_range() {
    expect(
        &with_base("[optimizer.adamw]\nbeta2 = 1.0\n"),
        "optimizer.adamw.beta2",
        Some(9),
        "in [0, 1)",
    );
    expect(
        &with_base("[optimizer.adamw]\neps = 0\n"),
        "optimizer.adamw.eps",
        Some(9),
        "> 0",
    );
    expect(
        &with_base("[optimizer.muon]\nns_steps = 0\n"),
        "optimizer.muon.ns_steps",
        Some(9),
        "must be between 1 and 100 iterations, got 0",
    );
}

#[test]
fn an_unknown_newton_schulz_precision() {
    expect(
        &with_base("[optimizer.muon]\nns_dtype = \"fp8\"\n"),
        "optimizer.muon.ns_dtype",
        Some(9),
        "must be \"bf16\", \"tf32\" or \"f32\", got \"fp8\"",
    );
}

#[test]
fn bad_metrics_listen_address() {
    let e = expect(
        &with_base("[metrics]\nlisten = \"localhost\"\n"),
        "metrics.listen",
        Some(9),
        "not a socket address",
    );
    assert!(e.reason.contains("127.0.0.1:9464"), "{e}");
}

#[test]
fn timing_every_out_of_range_or_of_the_wrong_type() {
    for bad in ["0", "1000001"] {
        let e = expect(
            &with_base(&format!("[metrics]\ntiming_every = {bad}\n")),
            "metrics.timing_every",
            Some(9),
            "between 1 and 1000000 steps",
        );
        assert_eq!(
            e.to_string(),
            format!("{FILE}:9:16: `metrics.timing_every`: must be between 1 and 1000000 steps, got {bad}")
        );
    }
    let e = expect(
        &with_base("[metrics]\ntiming_every = \"10\"\n"),
        "metrics.timing_every",
        Some(9),
        "wrong type",
    );
    assert!(
        e.to_string().starts_with(&format!(
            "{FILE}:9:16: `metrics.timing_every`: wrong type: "
        )),
        "{e}"
    );
    for bad in ["1.5", "true"] {
        expect(
            &with_base(&format!("[metrics]\ntiming_every = {bad}\n")),
            "metrics.timing_every",
            Some(9),
            "wrong type",
        );
    }
    expect(
        &with_base("[metrics]\ntiming_every = -1\n"),
        "metrics.timing_every",
        Some(9),
        "out of range",
    );
}

#[test]
fn timing_every_times_steps_one_and_every_nth_after() {
    let c = Config::from_toml(&with_base("[metrics]\ntiming_every = 3\n"), FILE).unwrap();
    assert_eq!(c.metrics.timing_every, 3);
    let timed: Vec<u64> = (1..=10).filter(|&s| c.metrics.timed(s)).collect();
    assert_eq!(timed, [1, 4, 7, 10]);
    let every = MetricsConfig::default();
    assert_eq!(every.timing_every, 1);
    assert!((1..=10).all(|s| every.timed(s)));
}

#[test]
fn display_names_file_line_column_key_and_reason() {
    let e = err("[mesh]\nshard = 0\nreplicate = 2\n");
    assert_eq!(
        e.to_string(),
        format!("{FILE}:2:9: `mesh.shard`: {}", e.reason)
    );
    let e = err("[model]\nlayers = 1\nhidden = 4\nvocab = 4\n");
    assert_eq!(e.to_string(), format!("{FILE}: `mesh`: {}", e.reason));
}

#[test]
fn byte_offsets_become_character_columns() {
    let e = expect("# é ü\n[mesh]\nshard = 2\nreplicate = 2\n[[param]]\nname = \"ü\"\nshape = [4]\nroute = \"x\"\n", "param[0].route", Some(8), "unknown route");
    assert_eq!(e.column, Some(9));
}

#[test]
fn full_config_parses_to_the_expected_value() {
    let text = r#"
[mesh]
shard = 2
replicate = 3

[model]
layers = 1
hidden = 8
vocab = 16

[[param]]
name = "extra.proj"
shape = [5, 3]
route = "muon"
layer = 2

[[param]]
name = "extra.bias"
shape = [7]
route = "adamw"

[buckets]
cap_bytes = 4096

[accumulation]
micro_batches = 4
replicate_gate = ["off", "on", "on", "on"]
reduce_gate = ["off", "off", "on", "on"]

[reduce]
op = "sum"
dtype = "bf16"

[run]
steps = 5
seed = 7
backend = "cpu"
backward_us_per_layer = 250
grads = "device"
step_timeout = 30

[overlap]
stage1_window = 4
transport = "copy"
combine_lag = 2
copy_slot_mib = 8
copy_ring_depth = 3
nccl_max_ctas = 16

[streams]
fold = "compute"
stage2 = "reduce"
combine = "reduce"

[optimizer.adamw]
lr = 0.5
weight_decay = 0

[optimizer.muon]
momentum = 0.9
ns_steps = 3

[metrics]
listen = "127.0.0.1:9464"
timing_every = 10
"#;
    let c = Config::from_toml(text, "<inline>").unwrap();
    let mut params = ModelSpec::new(1, 8, 16).params();
    params.push(ParamSpec::new("extra.proj", vec![5, 3], Route::Muon, 2));
    params.push(ParamSpec::new("extra.bias", vec![7], Route::Adamw, 0));
    let expected = Config {
        source: "<inline>".into(),
        plan: overlap_graph::PlanSpec::new(
            Mesh {
                shard: 2,
                replicate: 3,
            },
            params,
        )
        .with_reduce(
            ReduceSpec::default()
                .with_op(ReduceOp::Sum)
                .with_dtype(DType::Bf16),
        )
        .with_bucket_cap_bytes(4096)
        .with_bindings(
            Bindings::default()
                .with_fold(Stream::Compute)
                .with_stage2(Stream::Reduce)
                .with_combine(Stream::Reduce),
        )
        .with_schedule(
            Schedule::default()
                .with_transport(Transport::Copy)
                .with_combine_lag(2),
        ),
        // reduce off wins over replicate; then replicate decides.
        gates: vec![Gate::NoSync, Gate::NoSync, Gate::On, Gate::On],
        run: RunConfig {
            steps: 5,
            seed: 7,
            backend: BackendChoice::Cpu,
            backward_us_per_layer: 250,
            step_timeout_s: 30,
            grads: GradSource::Device,
        },
        overlap: OverlapConfig {
            stage1_window: 4,
            copy_slot_mib: 8,
            copy_ring_depth: 3,
            nccl_max_ctas: Some(16),
            transport: TransportChoice::Copy,
        },
        adamw: AdamwParams::default().with_lr(0.5).with_weight_decay(0.0),
        muon: MuonParams::default().with_momentum(0.9).with_ns_steps(3),
        groups: Vec::new(),
        schedule: LrSchedule::default(),
        metrics: MetricsConfig {
            listen: Some("127.0.0.1:9464".parse().unwrap()),
            timing_every: 10,
        },
        clip: None,
    };
    assert_eq!(c, expected);
    assert_eq!(c.plan.params[0].name, "embed");
    assert_eq!(c.plan.params[c.plan.params.len() - 2].name, "extra.proj");
}

#[test]
fn gate_combination_replicate_off_with_reduce_on() {
    let c = Config::from_toml(&with_base("[accumulation]\nreplicate_gate = [\"off\", \"on\", \"off\", \"on\"]\nreduce_gate = [\"on\", \"on\", \"off\", \"on\"]\n"), FILE).unwrap();
    assert_eq!(
        c.gates,
        vec![Gate::ReplicateOff, Gate::On, Gate::NoSync, Gate::On]
    );
}

#[test]
fn minimal_config_takes_the_defaults() {
    let c = Config::from_toml(BASE, FILE).unwrap();
    assert_eq!(c.source, FILE);
    assert_eq!(c.gates, vec![Gate::On]);
    assert_eq!(c.plan.reduce, ReduceSpec::default());
    assert_eq!(c.plan.bucket_cap_bytes, DEFAULT_BUCKET_CAP_BYTES);
    assert_eq!(c.plan.bindings, Bindings::default());
    assert_eq!(c.plan.params[0].layer, 0);
    assert_eq!(
        c.run,
        RunConfig {
            steps: 3,
            seed: 42,
            backend: BackendChoice::Auto,
            backward_us_per_layer: 0,
            step_timeout_s: 300,
            grads: GradSource::Host,
        }
    );
    assert_eq!(c.overlap, OverlapConfig::default());
    assert_eq!(c.overlap.copy_slot_mib, 32);
    assert_eq!(c.overlap.copy_ring_depth, 2);
    assert_eq!(c.plan.schedule, Schedule::default());
    assert_eq!(c.plan.schedule.transport, Transport::Nccl);
    assert_eq!(c.adamw, AdamwParams::default());
    assert_eq!(c.muon, MuonParams::default());
    assert_eq!(c.metrics, MetricsConfig::default());
    assert_eq!(c.metrics.timing_every, 1);
}

#[test]
fn micro_batches_alone_defaults_to_replicate_off_but_the_last() {
    let c = Config::from_toml(&with_base("[accumulation]\nmicro_batches = 3\n"), FILE).unwrap();
    assert_eq!(
        c.gates,
        vec![Gate::ReplicateOff, Gate::ReplicateOff, Gate::On]
    );
    let c = Config::from_toml(
        &with_base("[accumulation]\nreduce_gate = [\"off\", \"on\"]\n"),
        FILE,
    )
    .unwrap();
    assert_eq!(c.gates, vec![Gate::NoSync, Gate::On]);
}

#[test]
fn backend_choice_round_trips_its_names() {
    for b in BackendChoice::ALL {
        assert_eq!(b.name().parse::<BackendChoice>(), Ok(b));
    }
    assert!("gpu"
        .parse::<BackendChoice>()
        .unwrap_err()
        .contains("auto, cpu or cuda"));
}

#[test]
fn example_hsdp_2x2_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/hsdp_2x2.toml");
    let c = Config::from_file(&path).unwrap();
    assert_eq!(c.source, path.display().to_string());
    assert_eq!(
        c.plan.mesh,
        Mesh {
            shard: 2,
            replicate: 2
        }
    );
    assert_eq!(c.gates, vec![Gate::ReplicateOff, Gate::On]);
    assert_eq!(
        c.run,
        RunConfig {
            steps: 3,
            seed: 42,
            backend: BackendChoice::Auto,
            backward_us_per_layer: 400,
            step_timeout_s: 300,
            grads: GradSource::Host,
        }
    );
    for r in Route::ALL {
        assert!(
            c.plan.params.iter().any(|p| p.route == r),
            "no {r} parameter"
        );
    }
    assert!(c.plan.params.iter().any(|p| p.shape == [33, 7]));
}

#[test]
fn other_examples_load() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let c = Config::from_file(&dir.join("no_sync_1x4.toml")).unwrap();
    assert_eq!(
        c.plan.mesh,
        Mesh {
            shard: 1,
            replicate: 4
        }
    );
    assert_eq!(c.gates, vec![Gate::NoSync, Gate::ReplicateOff, Gate::On]);
    let c = Config::from_file(&dir.join("pure_fsdp_4x1.toml")).unwrap();
    assert_eq!(
        c.plan.mesh,
        Mesh {
            shard: 4,
            replicate: 1
        }
    );
    assert_eq!(c.gates, vec![Gate::On, Gate::On]);
    assert_eq!(c.plan.reduce.dtype, DType::Bf16);
}

/// BASE plus a vector, so groups have an AdamW and a Muon parameter to match (lines 1-11).
fn with_bias(rest: &str) -> String {
    with_base(&format!(
        "[[param]]\nname = \"w.bias\"\nshape = [4]\nroute = \"fsdp\"\n{rest}"
    ))
}

#[test]
fn a_group_matching_no_parameter_names_its_match_key() {
    let e = expect(
        &with_bias("[[optimizer.group]]\nmatch = \"w.bais\"\nweight_decay = 0\n"),
        "optimizer.group[0].match",
        Some(13),
        "`w.bais` matches no parameter",
    );
    assert!(
        e.to_string()
            .starts_with("job.toml:13:9: `optimizer.group[0].match`: "),
        "{e}"
    );
}

#[test]
fn a_group_whose_parameters_an_earlier_group_took_is_an_error() {
    expect(
        &with_bias(
            "[[optimizer.group]]\nmatch = \"w*\"\n[[optimizer.group]]\nmatch = \"*.bias\"\nweight_decay = 0\n",
        ),
        "optimizer.group[1].match",
        Some(15),
        "earlier group already took (first match wins): `w.bias`",
    );
}

#[test]
fn unknown_and_missing_keys_of_a_group() {
    expect(
        &with_bias("[[optimizer.group]]\nmatch = \"w\"\nbeta = 0.9\n"),
        "optimizer.group[0].beta",
        Some(14),
        "unknown key `beta`; allowed keys here: match, lr_scale, weight_decay, beta1, beta2, eps, momentum, ns_steps",
    );
    expect(
        &with_bias("[[optimizer.group]]\nweight_decay = 0\n"),
        "optimizer.group[0].match",
        Some(12),
        "missing required key `match`",
    );
    expect(
        &with_bias("[[optimizer.group]]\nmatch = \"\"\n"),
        "optimizer.group[0].match",
        Some(13),
        "the pattern is empty",
    );
}

#[test]
fn group_settings_out_of_range() {
    for (line, key, phrase) in [
        ("lr_scale = -1", "lr_scale", ">= 0"),
        ("lr_scale = inf", "lr_scale", "finite"),
        ("weight_decay = -0.5", "weight_decay", ">= 0"),
        ("beta1 = 1", "beta1", "in [0, 1)"),
        ("beta2 = -0.1", "beta2", "in [0, 1)"),
        ("eps = 0", "eps", "> 0"),
        ("momentum = 1.5", "momentum", "in [0, 1)"),
        ("ns_steps = 0", "ns_steps", "between 1 and 100"),
        ("ns_steps = 4000000000", "ns_steps", "between 1 and 100"),
    ] {
        expect(
            &with_bias(&format!("[[optimizer.group]]\nmatch = \"w\"\n{line}\n")),
            &format!("optimizer.group[0].{key}"),
            Some(14),
            phrase,
        );
    }
}

#[test]
fn schedule_errors_name_the_key() {
    expect(
        &with_base("[schedule]\nkind = \"exp\"\n"),
        "schedule.kind",
        Some(9),
        "unknown schedule `exp`; expected constant, cosine or linear",
    );
    expect(
        &with_base("[schedule]\nwarmup_steps = 3\n"),
        "schedule.kind",
        Some(8),
        "missing required key `kind`",
    );
    expect(
        &with_base("[schedule]\nkind = \"cosine\"\nwarmup_steps = 10\n"),
        "schedule.total_steps",
        Some(8),
        "missing required key `total_steps`",
    );
    expect(
        &with_base("[schedule]\nkind = \"linear\"\nwarmup_steps = 10\ntotal_steps = 10\n"),
        "schedule.total_steps",
        Some(11),
        "must be greater than warmup_steps (10), got 10",
    );
    expect(
        &with_base("[schedule]\nkind = \"cosine\"\ntotal_steps = 10\nfinal_lr_frac = 1.5\n"),
        "schedule.final_lr_frac",
        Some(11),
        "in [0, 1], got 1.5",
    );
    expect(
        &with_base("[schedule]\nkind = \"constant\"\ntotal_steps = 10\n"),
        "schedule.total_steps",
        Some(10),
        "has no effect with kind = \"constant\"",
    );
    expect(
        &with_base("[schedule]\nkind = \"cosine\"\ntotal_steps = 10\nmin_lr = 1e-5\n"),
        "schedule.min_lr",
        Some(11),
        "unknown key `min_lr`; allowed keys here: kind, warmup_steps, total_steps, final_lr_frac",
    );
}

#[test]
fn groups_and_schedule_parse_to_their_values() {
    let c = Config::from_toml(
        &with_bias(
            "[[optimizer.group]]\nmatch = \"*.bias\"\nweight_decay = 0\nlr_scale = 2\n\
             [[optimizer.group]]\nmatch = \"w\"\nmomentum = 0.5\nns_steps = 3\n\
             [schedule]\nkind = \"linear\"\nwarmup_steps = 2\ntotal_steps = 8\nfinal_lr_frac = 0.25\n",
        ),
        FILE,
    )
    .unwrap();
    let mut bias = overlap::executor::ParamGroup::new("*.bias");
    bias.weight_decay = Some(0.0);
    bias.lr_scale = 2.0;
    let mut w = overlap::executor::ParamGroup::new("w");
    w.momentum = Some(0.5);
    w.ns_steps = Some(3);
    assert_eq!(c.groups, vec![bias, w]);
    assert_eq!(
        c.schedule,
        LrSchedule::decay(overlap::executor::ScheduleKind::Linear, 8, 0.25).with_warmup(2)
    );
    let plain = Config::from_toml(BASE, FILE).unwrap();
    assert!(plain.groups.is_empty());
    assert_eq!(plain.schedule, LrSchedule::default());
}

#[test]
fn clip_table_sets_the_threshold_the_policy_and_the_plan_norm() {
    let c = Config::from_toml(
        &with_base("[clip]\nmax_norm = 1.5\non_nonfinite = \"error\"\n"),
        FILE,
    )
    .unwrap();
    let clip = c.clip.unwrap();
    assert_eq!(clip.max_norm, Some(1.5));
    assert_eq!(clip.on_nonfinite, overlap::OnNonFinite::Error);
    assert!(c.plan.grad_norm);
    // `on_nonfinite` alone: the norm without clipping, skipping by default.
    let c = Config::from_toml(&with_base("[clip]\n"), FILE).unwrap();
    assert_eq!(c.clip, Some(overlap::ClipConfig::default()));
    assert!(c.plan.grad_norm);
    let plain = Config::from_toml(BASE, FILE).unwrap();
    assert!(plain.clip.is_none() && !plain.plan.grad_norm);
}

#[test]
fn clip_errors_name_their_key() {
    for bad in ["0", "-1.0", "inf", "nan", "1e40"] {
        expect(
            &with_base(&format!("[clip]\nmax_norm = {bad}\n")),
            "clip.max_norm",
            Some(9),
            "finite number > 0",
        );
    }
    expect(
        &with_base("[clip]\non_nonfinite = \"ignore\"\n"),
        "clip.on_nonfinite",
        Some(9),
        "expected \"skip\" or \"error\"",
    );
    let e = err(&with_base("[clip]\nmax_nrom = 1.0\n"));
    assert!(e.to_string().contains("max_nrom"), "{e}");
}

#[test]
fn forward_table_sets_the_gathers_and_its_absence_leaves_them_out() {
    let c = Config::from_toml(
        &with_base("[forward]\nprefetch = 2\nreshard_after_forward = false\n[streams]\nunshard = \"reduce\"\n"),
        FILE,
    )
    .unwrap();
    assert_eq!(
        c.plan.forward,
        Some(
            overlap::graph::ForwardSpec::default()
                .with_prefetch(2)
                .with_reshard_after_forward(false)
        )
    );
    assert_eq!(c.plan.bindings.unshard, Stream::Reduce);
    // An empty table: FSDP2's defaults.
    let c = Config::from_toml(&with_base("[forward]\n"), FILE).unwrap();
    assert_eq!(c.plan.forward, Some(overlap::graph::ForwardSpec::default()));
    assert_eq!(c.plan.bindings.unshard, Stream::Publish);
    let plain = Config::from_toml(BASE, FILE).unwrap();
    assert!(plain.plan.forward.is_none());
}

#[test]
fn forward_errors_name_their_key() {
    expect(
        &with_base("[forward]\nprefetch = 5000\n"),
        "forward.prefetch",
        Some(9),
        "between 0 and 4096 layers",
    );
    let e = err(&with_base("[forward]\nreshard = true\n"));
    assert!(e.to_string().contains("reshard"), "{e}");
    expect(
        &with_base("[streams]\nunshard = \"gather\"\n"),
        "streams.unshard",
        Some(9),
        "unknown stream",
    );
}

#[test]
fn overrides_are_checked_as_the_files_values_and_keep_the_transport_consistent() {
    let base = Config::from_toml(BASE, FILE).unwrap();
    let mut cfg = base.clone();
    cfg.apply(
        &Overrides::none()
            .with_transport(Some(TransportChoice::Copy))
            .with_seed(Some(9))
            .with_gates(Some(vec![Gate::NoSync, Gate::On])),
    )
    .unwrap();
    assert_eq!(cfg.overlap.transport, TransportChoice::Copy);
    assert_eq!(cfg.plan.schedule.transport, Transport::Copy);
    assert_eq!((cfg.run.seed, cfg.gates.len()), (9, 2));
    // `auto` goes back to what the file's `auto` gives until the placement is known.
    cfg.apply(&Overrides::none().with_transport(Some(TransportChoice::Auto)))
        .unwrap();
    assert_eq!(cfg.plan.schedule.transport, Transport::Nccl);

    let refused = [
        (
            Overrides::none().with_gates(Some(Vec::new())),
            "accumulation.gates",
            "a step needs 1 to",
        ),
        (
            Overrides::none()
                .with_gates(Some(vec![Gate::On; overlap_graph::MAX_MICRO_BATCHES + 1])),
            "accumulation.gates",
            "65537 micro-batches",
        ),
        (
            Overrides::none().with_timing_every(Some(0)),
            "metrics.timing_every",
            "must be between 1 and",
        ),
    ];
    for (o, key, phrase) in refused {
        let mut cfg = base.clone();
        let e = cfg.apply(&o.with_seed(Some(5))).unwrap_err();
        assert_eq!(e.key, key, "{e}");
        assert!(
            e.reason.contains(phrase) && e.reason.contains("overridden"),
            "{e}"
        );
        assert_eq!(cfg, base, "a refused override changes nothing");
    }
    // Within the micro-batch limit but past the planner's node limit, as a file's
    // `[accumulation]` would be.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/hsdp_2x2.toml");
    let file = Config::from_file(Path::new(path)).unwrap();
    let mut cfg = file.clone();
    let many = vec![Gate::NoSync; overlap_graph::MAX_MICRO_BATCHES];
    let e = cfg
        .apply(&Overrides::none().with_gates(Some(many)))
        .unwrap_err();
    assert_eq!(e.key, "accumulation.gates", "{e}");
    assert!(e.reason.contains("plan nodes"), "{e}");
    assert_eq!(cfg, file);
}
