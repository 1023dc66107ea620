//! The command line's contract: exit codes, the `--json` line of verify, and clear
//! errors (file, key, reason) with a non-zero exit and no panic on bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

fn overlap(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("the binary runs")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn scratch(name: &str, contents: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p
}

fn assert_clean_failure(o: &Output, phrases: &[&str]) {
    let (_, err) = text(o);
    assert!(!o.status.success(), "expected failure, stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    for p in phrases {
        assert!(err.contains(p), "stderr lacks {p:?}: {err}");
    }
}

const GOOD: &str = "[mesh]\nshard = 2\nreplicate = 2\n[[param]]\nname = \"w\"\nshape = [5, 3]\nroute = \"muon\"\nlayer = 0\n[[param]]\nname = \"n\"\nshape = [7]\nroute = \"fsdp\"\nlayer = 1\n";

#[test]
fn run_prints_a_line_per_step_and_honours_steps() {
    let o = overlap(&["run", "--config", "examples/hsdp_2x2.toml", "--steps", "2"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("step 1/2") && out.contains("step 2/2") && !out.contains("step 3/"),
        "{out}"
    );
    assert!(out.contains("partials left 0"), "{out}");
    // `transport = "auto"` on the CPU backend: its collectives.
    assert!(out.contains("transport nccl (auto)"), "{out}");
}

#[test]
fn run_with_device_gradients_is_the_host_runs_first_step() {
    // `[run] grads = "device"` hands in step 0's gradients, kept on the backend, every
    // step: one step of it is one step of the host path, bit for bit; two are not.
    let host = scratch("grads_host.toml", GOOD);
    let device = scratch(
        "grads_device.toml",
        &format!("{GOOD}[run]\ngrads = \"device\"\n"),
    );
    let digest = |config: &PathBuf, steps: &str| {
        let o = overlap(&[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--steps",
            steps,
            "--param-digest",
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{err}");
        let lines: Vec<String> = out
            .lines()
            .filter(|l| l.starts_with("params rank"))
            .map(str::to_string)
            .collect();
        assert_eq!(lines.len(), 4, "{out}");
        (out, lines)
    };
    let (out, one) = digest(&device, "1");
    assert!(out.contains("gradients on the device"), "{out}");
    assert_eq!(one, digest(&host, "1").1);
    assert_ne!(digest(&device, "2").1, digest(&host, "2").1);
}

#[test]
fn run_with_timing_every_runs_and_prints_every_step() {
    let config = scratch(
        "timing_every.toml",
        &format!("{GOOD}[metrics]\ntiming_every = 2\n"),
    );
    let config = config.to_str().unwrap();
    let svg = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/timing_every.svg");
    let svg = svg.to_str().unwrap();
    for extra in [
        &[][..],
        &["--timing-every", "3"][..],
        // Step 4 is drawn, so it is timed whatever `timing_every` says.
        &["--timing-every", "2", "--svg", svg][..],
    ] {
        let mut args = vec![
            "run",
            "--config",
            config,
            "--steps",
            "4",
            "--backend",
            "cpu",
        ];
        args.extend_from_slice(extra);
        let o = overlap(&args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{err}");
        let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("step ")).collect();
        assert_eq!(lines.len(), 4, "{out}");
        // The CPU backend times every step whatever it is asked (`set_timings` is the
        // CUDA backend's), so no step goes without its device figures.
        for l in lines {
            assert!(l.contains("exposed comm ") && l.contains("overlap "), "{l}");
            assert!(!l.contains("untimed"), "{l}");
        }
        assert_eq!(
            out.contains("schedule picture: "),
            extra.contains(&"--svg"),
            "{out}"
        );
    }
}

#[test]
fn verify_json_ends_with_one_json_line() {
    let o = overlap(&[
        "verify",
        "--config",
        "examples/hsdp_2x2.toml",
        "--steps",
        "2",
        "--seed",
        "7",
        "--json",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let last = out.lines().last().unwrap();
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["steps"], 2);
    assert_eq!(v["ranks"], 4);
    assert_eq!(v["partials_left"], 0);
    assert!(v["worst_rel_err"].as_f64().unwrap() <= 1e-6);
    for route in ["fsdp", "sharded_adamw", "muon", "adamw"] {
        assert!(
            v["per_route"][route].is_number(),
            "per_route lacks {route}: {last}"
        );
    }
}

#[test]
fn plan_formats_and_check_round_trip() {
    let json = overlap(&[
        "plan",
        "--config",
        "examples/hsdp_2x2.toml",
        "--format",
        "json",
        "--gates",
        "no_sync,off,on",
    ]);
    assert!(json.status.success());
    let file = scratch("plan.json", &String::from_utf8_lossy(&json.stdout));
    let check = overlap(&["check", "--plan", file.to_str().unwrap()]);
    let (out, err) = text(&check);
    assert!(check.status.success(), "{err}");
    assert!(out.contains("valid"), "{out}");
    let dot = overlap(&[
        "plan",
        "--config",
        "examples/hsdp_2x2.toml",
        "--format",
        "dot",
        "--ranks",
        "0",
    ]);
    assert!(String::from_utf8_lossy(&dot.stdout).starts_with("digraph plan {"));
    let txt = overlap(&["plan", "--config", "examples/hsdp_2x2.toml"]);
    assert!(String::from_utf8_lossy(&txt.stdout).contains("rank 3"));
}

#[test]
fn check_names_the_invariant_of_an_edited_plan() {
    let json = overlap(&[
        "plan",
        "--config",
        "examples/hsdp_2x2.toml",
        "--format",
        "json",
    ]);
    let mut plan: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    // Seed bug 3: rank 0's first fold moved to the compute stream, with no event after
    // its Stage-1 collective (the fold races the collective's output).
    let rank0 = &mut plan["ranks"][0];
    let fold = rank0["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["op"]["kind"] == "fold")
        .unwrap()["id"]
        .as_u64()
        .unwrap();
    rank0["nodes"][fold as usize]["stream"] = "compute".into();
    let streams = rank0["streams"].as_array_mut().unwrap();
    for s in streams.iter_mut() {
        s["instrs"]
            .as_array_mut()
            .unwrap()
            .retain(|i| i["run"].as_u64() != Some(fold));
    }
    let compute = streams
        .iter_mut()
        .find(|s| s["stream"] == "compute")
        .unwrap()["instrs"]
        .as_array_mut()
        .unwrap();
    let at = compute
        .iter()
        .position(|i| i["run"].as_u64().is_some_and(|n| n > fold))
        .unwrap_or(compute.len());
    compute.insert(at, serde_json::json!({ "run": fold }));
    let file = scratch("fold_on_compute.json", &plan.to_string());
    let o = overlap(&["check", "--plan", file.to_str().unwrap()]);
    assert_clean_failure(
        &o,
        &[
            "ordered-access",
            "rank 0, stream compute",
            &format!("node {fold}"),
        ],
    );
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn bad_configs_fail_with_file_key_and_reason() {
    let cases: &[(&str, String, &[&str])] = &[
        (
            "unknown_key.toml",
            GOOD.replace("[mesh]\n", "[mesh]\nshards = 3\n"),
            &["unknown_key.toml", "mesh.shards"],
        ),
        (
            "zero_mesh.toml",
            GOOD.replace("shard = 2", "shard = 0"),
            &["zero_mesh.toml", "mesh.shard"],
        ),
        (
            "gates.toml",
            format!(
                "{GOOD}[accumulation]\nmicro_batches = 3\nreplicate_gate = [\"off\", \"on\"]\n"
            ),
            &["gates.toml", "accumulation.replicate_gate"],
        ),
        (
            "route.toml",
            GOOD.replace("route = \"muon\"", "route = \"moun\""),
            &["route.toml", "param[0].route", "moun"],
        ),
        (
            "zero_dim.toml",
            GOOD.replace("shape = [5, 3]", "shape = [5, 0]"),
            &["zero_dim.toml", "param[0].shape"],
        ),
    ];
    for (name, body, phrases) in cases {
        let f = scratch(name, body);
        for cmd in ["run", "verify", "plan"] {
            let o = overlap(&[cmd, "--config", f.to_str().unwrap()]);
            assert_clean_failure(&o, phrases);
            assert_eq!(o.status.code(), Some(2), "{cmd} {name}");
        }
    }
    let o = overlap(&["run", "--config", "no/such/file.toml"]);
    assert_clean_failure(&o, &["no/such/file.toml"]);
}

#[test]
fn bad_plan_files_fail_cleanly() {
    let cases = [
        ("not_json.json", "{ this is not json", "line 1"),
        (
            "wrong_format.json",
            r#"{"format":"other","version":1}"#,
            "format",
        ),
        ("empty.json", "", "plan JSON"),
    ];
    for (name, body, phrase) in cases {
        let f = scratch(name, body);
        let o = overlap(&["check", "--plan", f.to_str().unwrap()]);
        assert_clean_failure(&o, &[name, phrase]);
    }
    let o = overlap(&["check", "--plan", "no/such/plan.json"]);
    assert_clean_failure(&o, &["no/such/plan.json"]);
}

#[test]
fn bad_arguments_fail_cleanly() {
    assert_clean_failure(
        &overlap(&[
            "plan",
            "--config",
            "examples/hsdp_2x2.toml",
            "--gates",
            "off,maybe",
        ]),
        &["--gates", "maybe"],
    );
    // A count past a step's limit is refused before anything is allocated for it.
    for cmd in ["plan", "verify"] {
        assert_clean_failure(
            &overlap(&[
                cmd,
                "--config",
                "examples/hsdp_2x2.toml",
                "--gates",
                "on*10000000000000",
            ]),
            &["--gates", "more than 65536 micro-batches"],
        );
    }
    assert_clean_failure(
        &overlap(&["plan", "--config", "examples/hsdp_2x2.toml", "--ranks", "9"]),
        &["--ranks"],
    );
    assert_clean_failure(
        &overlap(&[
            "plan",
            "--config",
            "examples/hsdp_2x2.toml",
            "--gates",
            "on,off",
        ]),
        &["unflushed"],
    );
    assert_clean_failure(
        &overlap(&[
            "run",
            "--config",
            "examples/hsdp_2x2.toml",
            "--backend",
            "cuda",
        ]),
        &["cuda"],
    );
    for bad in ["0", "1000001", "often"] {
        assert_clean_failure(
            &overlap(&[
                "run",
                "--config",
                "examples/hsdp_2x2.toml",
                "--timing-every",
                bad,
            ]),
            &["--timing-every", "between 1 and 1000000"],
        );
    }
    for cmd in ["run", "verify"] {
        assert_clean_failure(
            &overlap(&[cmd, "--config", "examples/hsdp_2x2.toml", "--steps", "0"]),
            &["--steps", "0"],
        );
    }
}

#[test]
fn closed_stdout_ends_quietly_without_a_panic() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args([
            "plan",
            "--config",
            "examples/hsdp_2x2.toml",
            "--format",
            "json",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert_eq!(first.trim(), "{");
    // The reader is dropped here, as `| head -1` would.
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn plan_prints_the_groups_and_run_prints_the_learning_rate() {
    let o = overlap(&["plan", "--config", "examples/groups_schedule_2x2.toml"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for line in [
        "optimizer groups (4; first match wins):",
        "  group 0  match \"*norm*\"  weight_decay = 0  -> 5 params: blocks.0.attn_norm, blocks.0.mlp_norm, blocks.1.attn_norm, blocks.1.mlp_norm, final_norm",
        "  group 1  match \"*.bias\"  lr_scale = 2, weight_decay = 0  -> 1 param: blocks.0.bias",
        "  group 2  match \"blocks.0.*\"  lr_scale = 0.5, momentum = 0.9, ns_steps = 3  -> 4 params: blocks.0.qkv, blocks.0.proj, blocks.0.fc1, blocks.0.fc2",
        "schedule: cosine, warmup_steps = 2, total_steps = 5, final_lr_frac = 0.1",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
    assert!(
        out.lines().any(
            |l| l.starts_with("  no group: base [optimizer.adamw] lr = 0.001")
                && l.ends_with(
                    "-> 5 params: blocks.1.qkv, blocks.1.proj, blocks.1.fc1, blocks.1.fc2, head"
                )
        ),
        "{out}"
    );
    let o = overlap(&[
        "run",
        "--config",
        "examples/groups_schedule_2x2.toml",
        "--steps",
        "3",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let steps: Vec<&str> = out.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 3, "{out}");
    assert!(
        steps[0].ends_with("lr x0.500 (adamw 5.00e-4, muon 1.00e-2)"),
        "{out}"
    );
    assert!(
        steps[1].ends_with("lr x1.000 (adamw 1.00e-3, muon 2.00e-2)"),
        "{out}"
    );
    assert!(
        steps[2].ends_with("lr x0.775 (adamw 7.75e-4, muon 1.55e-2)"),
        "{out}"
    );
}

#[test]
fn verify_passes_with_groups_and_a_schedule() {
    let o = overlap(&[
        "verify",
        "--config",
        "examples/groups_schedule_2x2.toml",
        "--json",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["ok"], true, "{out}");
    assert_eq!(last["steps"], 6, "{out}");
}

/// GPT-2 small with its embeddings on `adamw` and its block matrices on `muon`, as
/// `[[param]]` entries on a `shard × replicate` mesh.
fn gpt2_small_config(shard: u32, replicate: u32, ns_dtype: &str) -> String {
    let mut s = format!(
        "[mesh]\nshard = {shard}\nreplicate = {replicate}\n[optimizer.muon]\nns_dtype = \"{ns_dtype}\"\n"
    );
    let mut param = |name: String, shape: &[u64], route: &str, layer: u32| {
        s.push_str(&format!(
            "[[param]]\nname = \"{name}\"\nshape = {shape:?}\nroute = \"{route}\"\nlayer = {layer}\n"
        ));
    };
    param("wte".into(), &[50257, 768], "adamw", 0);
    param("wpe".into(), &[1024, 768], "adamw", 0);
    for l in 0..12u32 {
        for (n, shape, route) in [
            ("ln_1.w", &[768][..], "adamw"),
            ("ln_1.b", &[768], "adamw"),
            ("attn.c_attn.w", &[768, 2304], "muon"),
            ("attn.c_attn.b", &[2304], "adamw"),
            ("attn.c_proj.w", &[768, 768], "muon"),
            ("attn.c_proj.b", &[768], "adamw"),
            ("ln_2.w", &[768], "adamw"),
            ("ln_2.b", &[768], "adamw"),
            ("mlp.c_fc.w", &[768, 3072], "muon"),
            ("mlp.c_fc.b", &[3072], "adamw"),
            ("mlp.c_proj.w", &[3072, 768], "muon"),
            ("mlp.c_proj.b", &[768], "adamw"),
        ] {
            param(format!("h.{l}.{n}"), shape, route, l + 1);
        }
    }
    param("ln_f.w".into(), &[768], "adamw", 13);
    param("ln_f.b".into(), &[768], "adamw", 13);
    s
}

/// The largest over the mean of `overlap plan`'s modelled optimizer time per rank.
fn plan_optimizer_imbalance(config: &str, name: &str) -> (f64, String) {
    let path = scratch(name, config);
    let o = overlap(&[
        "plan",
        "--config",
        path.to_str().unwrap(),
        "--format",
        "text",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let line = out
        .lines()
        .find(|l| l.contains("max/mean"))
        .unwrap_or_else(|| panic!("no optimizer time in the listing: {out}"));
    let ratio = line.rsplit(' ').next().unwrap().parse().unwrap();
    let start = out.find("optimizer time per rank").unwrap();
    (ratio, out[start..].to_string())
}

#[test]
fn plan_lists_optimizer_time_per_rank_balanced_by_work() {
    for (s, r, dtype) in [(4, 1, "bf16"), (2, 2, "bf16"), (4, 1, "f32")] {
        let config = gpt2_small_config(s, r, dtype);
        let (ratio, listing) =
            plan_optimizer_imbalance(&config, &format!("gpt2_{s}x{r}_{dtype}.toml"));
        assert!(ratio <= 1.10, "{s}x{r} {dtype}: {listing}");
        assert_eq!(
            listing.matches("owned updates").count(),
            (s * r) as usize,
            "{listing}"
        );
    }
    // f32 Newton–Schulz is weighed at its own (slower) rate.
    let (_, f32_listing) =
        plan_optimizer_imbalance(&gpt2_small_config(4, 1, "f32"), "gpt2_f32.toml");
    assert!(
        f32_listing.contains("Newton–Schulz at 50 TFLOP/s"),
        "{f32_listing}"
    );
}
