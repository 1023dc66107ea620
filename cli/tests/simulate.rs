//! `overlap simulate`: the replay of recorded GPU measurements against the shipped
//! profile (`tests/data/measured.json`, each row naming its log under docs/perf/), its
//! determinism, `--svg`, configs, and bad profiles refused with the key and line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn overlap(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run overlap")
}

fn json(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "overlap failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("not one JSON line: {e}: {out}"))
}

fn simulate(hardware: &str, args: &[String]) -> serde_json::Value {
    let mut all = vec!["simulate", "--hardware", hardware, "--json"];
    all.extend(args.iter().map(String::as_str));
    json(&overlap(&all))
}

fn scratch(name: &str, contents: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("overlap-simulate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p
}

/// Every recorded measurement of `tests/data/measured.json` replayed on the shipped
/// profile: the predicted `overlap_ms` within the row's bound (10 % for the transports'
/// defaults and docs/performance.md's tuned settings, 15 % for the other levers).
#[test]
fn recorded_measurements_replay_within_their_bound() {
    let text = std::fs::read_to_string(root().join("cli/tests/data/measured.json")).unwrap();
    let data: serde_json::Value = serde_json::from_str(&text).unwrap();
    let hardware = data["hardware"].as_str().unwrap();
    let rows = data["rows"].as_array().unwrap();
    assert!(rows.len() >= 50, "{} rows", rows.len());
    let mut predicted: BTreeMap<Vec<String>, serde_json::Value> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut worst: BTreeMap<String, f64> = BTreeMap::new();
    for row in rows {
        let args: Vec<String> = row["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let log = row["log"].as_str().unwrap();
        assert!(
            root().join(log).exists(),
            "row {} cites a log that is not there: {log}",
            row["run"]
        );
        let p = predicted
            .entry(args.clone())
            .or_insert_with(|| simulate(hardware, &args));
        let measured = row["overlap_ms"].as_f64().unwrap();
        let got = p["overlap_ms"].as_f64().unwrap();
        let err = got / measured - 1.0;
        let bound = row["bound"].as_f64().unwrap();
        let key = format!(
            "{} {} {}",
            row["workload"].as_str().unwrap(),
            row["transport"].as_str().unwrap(),
            row["setting"].as_str().unwrap()
        );
        let w = worst.entry(key).or_insert(0.0);
        *w = w.max(err.abs());
        eprintln!(
            "{:>5.1} %  measured {measured:6.3}  predicted {got:6.3}  {} {} ({log})",
            err * 100.0,
            row["run"].as_str().unwrap(),
            args.join(" ")
        );
        if err.abs() > bound {
            failures.push(format!(
                "{} of {log} ({}): measured {measured:.3} ms, predicted {got:.3} ms, {:+.1} % (bound {:.0} %)",
                row["run"].as_str().unwrap(),
                args.join(" "),
                err * 100.0,
                bound * 100.0
            ));
        }
    }
    for (k, w) in &worst {
        eprintln!("worst |error| {k}: {:.1} %", w * 100.0);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn simulate_is_deterministic_and_draws_the_predicted_step() {
    let svg = scratch("a.svg", "");
    let svg2 = scratch("b.svg", "");
    let run = |svg: &Path| {
        overlap(&[
            "simulate",
            "--hardware",
            "hardware/h200-nvlink.toml",
            "--transport",
            "copy",
            "--gemms",
            "1",
            "--json",
            "--svg",
            svg.to_str().unwrap(),
        ])
    };
    let (a, b) = (run(&svg), run(&svg2));
    assert_eq!(a.stdout, b.stdout);
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(picture, std::fs::read_to_string(&svg2).unwrap());
    assert!(picture.starts_with("<svg") && picture.trim_end().ends_with("</svg>"));
    assert!(picture.contains("exchange") && picture.contains("combine"));
    let r = json(&a);
    for key in [
        "compute_only_ms",
        "comm_only_ms",
        "serial_ms",
        "overlap_ms",
        "ideal_ms",
        "eta",
        "exposed_comm_ms",
    ] {
        assert!(r[key].as_f64().is_some(), "{key} missing in {r}");
    }
    assert_eq!(r["backend"], "simulated");
    assert_eq!(r["mesh"], "2x1");
    let busy = &r["busy_ms"];
    assert!(busy["compute"].as_f64().unwrap() > 0.0 && busy["copy"].as_f64().unwrap() > 0.0);
    // The text form.
    let o = overlap(&["simulate", "--hardware", "hardware/h200-nvlink.toml"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && text.contains("overlap ") && text.contains("eta"),
        "{text}"
    );
}

/// `--window` and a config's `[overlap] stage1_window` reach the simulation (the
/// executor's backpressure, docs/simulate.md).
#[test]
fn the_stage1_window_changes_the_predicted_step() {
    let hw = "hardware/h200-nvlink.toml";
    let rs1 = |window: &str| {
        let args: Vec<String> = ["--gemms", "1", "--transport", "copy", "--window", window]
            .iter()
            .map(|a| a.to_string())
            .collect();
        simulate(hw, &args)
    };
    let ms = |r: &serde_json::Value| r["overlap_ms"].as_f64().unwrap();
    let (w1, w2, w8, w16) = (rs1("1"), rs1("2"), rs1("8"), rs1("16"));
    assert_eq!(w2["window"], 2);
    // Window 2: before each pack the host waits for the combine of the layer two back
    // (deferred by `combine_lag = 1`, beside the next backward), which holds back the
    // next layer's backward. Window 1 lets each buffer go before its combine was issued,
    // so, as in the executor, it waits for nothing; from 8 the combines waited for have
    // long completed.
    assert!(ms(&w2) > ms(&w8) + 0.1, "{} vs {}", ms(&w2), ms(&w8));
    assert_eq!(ms(&w1), ms(&w8));
    // 16 layers, 16 packs: a window of 16 never waits.
    assert_eq!(ms(&w16), ms(&w8));
    // A config's window.
    let text = std::fs::read_to_string(root().join("examples/hsdp_2x2.toml")).unwrap();
    assert!(text.contains("\nstage1_window = 8\n"));
    let config = |window: u32| {
        let p = scratch(
            &format!("hsdp-w{window}.toml"),
            &text.replace(
                "\nstage1_window = 8\n",
                &format!("\nstage1_window = {window}\n"),
            ),
        );
        ms(&json(&overlap(&[
            "simulate",
            "--hardware",
            "hardware/h200-8x-400g.toml",
            "--config",
            p.to_str().unwrap(),
            "--json",
        ])))
    };
    assert!(config(1) > config(64), "{} vs {}", config(1), config(64));
}

#[test]
fn simulate_runs_configs_and_multi_node_meshes() {
    let r = json(&overlap(&[
        "simulate",
        "--hardware",
        "hardware/h200-8x-400g.toml",
        "--config",
        "examples/hsdp_2x2.toml",
        "--json",
    ]));
    assert!(r["overlap_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(r["plan_transport"], "copy");
    // HSDP across two nodes: NCCL collectives over the network.
    let r = json(&overlap(&[
        "simulate",
        "--hardware",
        "hardware/h200-8x-400g.toml",
        "--mesh",
        "8x2",
        "--json",
    ]));
    assert!(r["comm_only_ms"].as_f64().unwrap() > 0.0);
    // More ranks than the one-node profile has GPUs: refused, naming the group.
    let o = overlap(&[
        "simulate",
        "--hardware",
        "hardware/h200-nvlink.toml",
        "--mesh",
        "4x1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("[network]") && err.contains("shard-group"),
        "{err}"
    );
    // A config and the bench's flags together: refused.
    let o = overlap(&[
        "simulate",
        "--hardware",
        "hardware/h200-nvlink.toml",
        "--config",
        "examples/hsdp_2x2.toml",
        "--layers",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--config describes the workload"));
}

#[test]
fn bad_profiles_are_refused_with_file_key_line_and_reason() {
    let good = std::fs::read_to_string(root().join("hardware/h200-nvlink.toml")).unwrap();
    let bad = good.replacen("peer_gbs = 358", "peer_gbs = 0", 1);
    assert_ne!(bad, good);
    let line = bad.lines().position(|l| l == "peer_gbs = 0").unwrap() + 1;
    let path = scratch("bad.toml", &bad);
    let o = overlap(&["simulate", "--hardware", path.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("bad.toml:{line}:")) && err.contains("`copy_engine.peer_gbs`"),
        "{err}"
    );
    assert!(err.contains("must be above 0"), "{err}");
    // A file that is not there.
    let o = overlap(&["simulate", "--hardware", "no/such/profile.toml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot read the hardware profile"));
}
