//! `overlap tune`: the known optimum of synthetic profiles (copy engines much faster or
//! much slower than NCCL, a host slow enough that the Stage-1 window matters),
//! determinism, bad inputs refused with the name of what is
//! wrong, and the printed sections loading back as a config that plans and validates.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use overlap::config::Config;
use overlap_graph::{validate, Mode, Planner};

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

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "overlap failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn json(o: &Output) -> serde_json::Value {
    let out = ok(o);
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("not one JSON line: {e}: {out}"))
}

fn scratch(name: &str, contents: &str) -> String {
    let dir = std::env::temp_dir().join(format!("overlap-tune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p.display().to_string()
}

/// A small two-rank job, within one node of either shipped profile.
const CONFIG: &str = "[mesh]\nshard = 2\nreplicate = 1\n\n[model]\nlayers = 4\nhidden = 256\nvocab = 512\n\n[accumulation]\nmicro_batches = 2\n\n[run]\nbackward_us_per_layer = 100\n";

/// The shipped two-GPU profile with the copy engines' bandwidth set to `peer_gbs` and
/// NCCL's bus bandwidth within the node to `busbw_gbs`.
fn profile(name: &str, peer_gbs: u32, busbw_gbs: u32) -> String {
    tweaked(name, |table, key| match (table, key) {
        ("copy_engine", "peer_gbs") => Some(peer_gbs.to_string()),
        ("nvlink.busbw_gbs", _) => Some(busbw_gbs.to_string()),
        // A fast host, so that the transport decides: with the shipped host figure
        // the test config's step is bound by issuing its Muon nodes (30 device
        // operations each), where the transport with fewer nodes wins whatever the
        // links.
        ("host", "issue_us_per_node") => Some("0.5".into()),
        _ => None,
    })
}

/// The shipped two-GPU profile with the values `set(table, key)` returns.
fn tweaked(name: &str, set: impl Fn(&str, &str) -> Option<String>) -> String {
    let text = std::fs::read_to_string(root().join("hardware/h200-nvlink.toml")).unwrap();
    let mut out = String::new();
    let mut table = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            table = t.trim_matches(|c| c == '[' || c == ']').to_string();
        }
        let key = t.split('=').next().unwrap_or("").trim();
        match set(&table, key) {
            Some(v) if t.contains('=') && !t.starts_with('#') => {
                out.push_str(&format!("{key} = {v}\n"))
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    scratch(name, &out)
}

fn tune(config: &str, hardware: &str, extra: &[&str]) -> Output {
    let mut args = vec!["tune", "--config", config, "--hardware", hardware];
    args.extend_from_slice(extra);
    overlap(&args)
}

#[test]
fn tune_finds_the_transport_a_synthetic_profile_favours() {
    let config = scratch("job.toml", CONFIG);
    // Copy engines 100 times faster than NCCL: the copy transport wins.
    let fast_copy = profile("fast-copy.toml", 20_000, 20);
    let r = json(&tune(&config, &fast_copy, &["--json"]));
    assert_eq!(r["top"][0]["transport"], "copy", "{r}");
    assert!(r["best_ms"].as_f64().unwrap() <= r["own_ms"].as_f64().unwrap());
    // Copy engines 100 times slower: NCCL wins, and the config's own setting (auto,
    // settled to copy on one node) loses to it.
    let slow_copy = profile("slow-copy.toml", 2, 2_000);
    let r = json(&tune(&config, &slow_copy, &["--json"]));
    assert_eq!(r["top"][0]["transport"], "nccl", "{r}");
    assert!(r["gain_ms"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["top"].as_array().unwrap().len() == 5);
    let ms: Vec<f64> = r["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["overlap_ms"].as_f64().unwrap())
        .collect();
    assert!(ms.windows(2).all(|w| w[0] <= w[1]), "{ms:?}");
}

#[test]
fn tune_finds_the_bucket_cap_a_synthetic_profile_favours() {
    // Eight 4 MiB parameters of one layer: one bucket each at a 1 or 4 MiB cap, four
    // buckets at 16 MiB, one from 32 MiB up.
    let mut text = String::from("[mesh]\nshard = 2\nreplicate = 1\n\n");
    for i in 0..8 {
        text.push_str(&format!(
            "[[param]]\nname = \"w{i}\"\nshape = [1024, 1024]\nroute = \"fsdp\"\nlayer = 1\n\n"
        ));
    }
    text.push_str("[accumulation]\nmicro_batches = 2\n\n[run]\nbackward_us_per_layer = 100\n");
    let config = scratch("cap.toml", &text);
    // Every kernel and NCCL collective costs 5 ms whatever its size: the fewest buckets
    // win.
    let fixed_cost = tweaked("fixed-cost.toml", |table, key| match (table, key) {
        ("nvlink", "base_us") | ("memory", "kernel_us") => Some("5000".into()),
        _ => None,
    });
    let r = json(&tune(&config, &fixed_cost, &["--json"]));
    for s in r["top"].as_array().unwrap() {
        assert!(
            s["bucket_cap_bytes"].as_u64().unwrap() >= 32 << 20,
            "{s} is not one bucket: {r}"
        );
    }
    // Equal predictions go to the smaller memory, then the grid's order: the smallest
    // cap that makes one bucket of the grid, 64 MiB.
    assert_eq!(r["top"][0]["bucket_cap_bytes"], 64u64 << 20, "{r}");
    assert!(r["gain_ms"].as_f64().unwrap() > 5.0, "{r}");
}

#[test]
fn tune_finds_the_stage1_window_a_slow_host_favours() {
    let config = scratch("window.toml", CONFIG);
    // 200 µs of host time per node: the step is host-bound. With a window of 1, before
    // each pack the host waits for the node that frees the previous Stage-1 buffer (its
    // fold, issued just before) to run on the device, and each wait adds to the step; a
    // window of 2 or more never waits for a node still running.
    let slow_host = tweaked("slow-host.toml", |table, key| match (table, key) {
        ("host", "issue_us_per_node") => Some("200".into()),
        _ => None,
    });
    let all = json(&tune(&config, &slow_host, &["--json", "--top", "100000"]));
    let top = all["top"].as_array().unwrap();
    assert_eq!(
        top.len() as u64,
        all["candidates"].as_u64().unwrap(),
        "{all}"
    );
    let best = &top[0];
    // Equal steps go to the smaller memory: the smallest window that does not wait.
    assert_eq!(best["stage1_window"], 2, "{best}");
    assert!(
        all["sections"]
            .as_str()
            .unwrap()
            .contains("stage1_window = 2\n"),
        "{all}"
    );
    // The same setting with each window: 1 is slower, the larger ones predict the same
    // step and hold more memory.
    let setting = |s: &serde_json::Value| {
        let w = format!("window {}", s["stage1_window"]);
        s["label"].as_str().unwrap().replacen(&w, "window", 1)
    };
    let same: Vec<&serde_json::Value> =
        top.iter().filter(|s| setting(s) == setting(best)).collect();
    let ms = |s: &serde_json::Value| s["overlap_ms"].as_f64().unwrap();
    let gib = |s: &serde_json::Value| s["memory_gib"].as_f64().unwrap();
    let mut windows: Vec<u64> = same
        .iter()
        .map(|s| s["stage1_window"].as_u64().unwrap())
        .collect();
    windows.sort_unstable();
    assert_eq!(windows, [1, 2, 4, 8, 16], "{same:?}");
    for s in &same {
        match s["stage1_window"].as_u64().unwrap() {
            1 => assert!(
                ms(s) > ms(best) + 0.05 && gib(s) < gib(best),
                "{s} vs {best}"
            ),
            2 => {}
            _ => assert!(ms(s) == ms(best) && gib(s) > gib(best), "{s} vs {best}"),
        }
    }
    // A budget between the memory of window 1 and of window 2 of that setting: the
    // winner is the fastest setting that fits, which here holds one Stage-1 buffer.
    let one = same.iter().find(|s| s["stage1_window"] == 1).unwrap();
    let budget = (gib(one) + gib(best)) / 2.0;
    let fits = top.iter().find(|s| gib(s) <= budget).unwrap();
    let r = json(&tune(
        &config,
        &slow_host,
        &["--json", "--memory-gib", &budget.to_string()],
    ));
    assert_eq!(r["top"][0]["label"], fits["label"], "{r}");
    assert_eq!(r["top"][0]["stage1_window"], 1, "{r}");
    assert!(r["pruned_memory"].as_u64().unwrap() > 0, "{r}");
    assert!(r["best_ms"].as_f64().unwrap() > ms(best), "{r}");
}

#[test]
fn tune_is_deterministic() {
    let config = scratch("det.toml", CONFIG);
    let a = ok(&tune(&config, "hardware/h200-nvlink.toml", &[]));
    let b = ok(&tune(&config, "hardware/h200-nvlink.toml", &[]));
    assert_eq!(a, b);
    let a = ok(&tune(&config, "hardware/h200-nvlink.toml", &["--json"]));
    let b = ok(&tune(&config, "hardware/h200-nvlink.toml", &["--json"]));
    assert_eq!(a, b);
    assert_eq!(a.lines().count(), 1);
}

#[test]
fn bad_inputs_are_refused_with_what_is_wrong() {
    let config = scratch("bad.toml", CONFIG);
    let hw = "hardware/h200-nvlink.toml";
    for (extra, named) in [
        (&["--memory-gib", "0"][..], "--memory-gib"),
        (&["--memory-gib", "nan"][..], "--memory-gib"),
        (&["--top", "0"][..], "--top"),
        (&["--confirm", "0"][..], "--confirm"),
        (&["--gates", "sideways"][..], "--gates"),
        // A budget no setting fits in.
        (&["--memory-gib", "0.000001"][..], "--memory-gib"),
    ] {
        let o = tune(&config, hw, extra);
        assert_eq!(o.status.code(), Some(2), "{extra:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(named), "{extra:?}: {err}");
    }
    let typo = scratch(
        "typo.toml",
        &format!("{CONFIG}\n[overlap]\ncombine_lagg = 1\n"),
    );
    let o = tune(&typo, hw, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("combine_lagg"));
    let bad_hw = scratch("bad-hw.toml", "name = \"x\"\ngpus_per_node = 0\n");
    let o = tune(&config, &bad_hw, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("gpus_per_node"));
}

#[test]
fn printed_sections_load_back_as_a_valid_config() {
    let config = scratch("paste.toml", CONFIG);
    let fast_copy = profile("paste-hw.toml", 20_000, 20);
    let out = ok(&tune(&config, &fast_copy, &[]));
    let sections: String = out
        .lines()
        .skip_while(|l| !l.starts_with("# paste"))
        .skip(1)
        .take_while(|l| !l.starts_with("# the best"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(sections.contains("[buckets]") && sections.contains("[streams]"));
    let pasted = format!("{CONFIG}\n{sections}");
    let cfg = Config::from_toml(&pasted, "pasted.toml").unwrap_or_else(|e| panic!("{e}"));
    let planner = Planner::new(cfg.plan.clone()).unwrap();
    let plan = planner.plan(&cfg.gates).unwrap();
    assert!(validate(&plan, Mode::Step).is_empty());
    // And the JSON's best is the same setting.
    let r = json(&tune(&config, &fast_copy, &["--json"]));
    assert_eq!(r["sections"].as_str().unwrap().trim(), sections.trim());
    assert_eq!(
        cfg.plan.bucket_cap_bytes,
        r["top"][0]["bucket_cap_bytes"].as_u64().unwrap()
    );
}

#[test]
fn confirm_writes_configs_that_load() {
    let config = scratch("confirm.toml", CONFIG);
    let dir = std::env::temp_dir().join(format!("overlap-tune-confirm-{}", std::process::id()));
    let d = dir.display().to_string();
    let o = tune(
        &config,
        "hardware/h200-nvlink.toml",
        &["--confirm", "2", "--confirm-dir", &d],
    );
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("overlap launch --nproc-per-node 2"), "{err}");
    // A build without `cuda` says so rather than measuring.
    assert!(
        err.contains("no `cuda` feature, so it is not measured"),
        "{err}"
    );
    for i in 1..=2 {
        let p = dir.join(format!("tune-{i}.toml"));
        let c = Config::from_file(&p).unwrap_or_else(|e| panic!("{e}"));
        // The written config spins for the backward the simulation assumed: the
        // config's own 100 µs per layer.
        assert_eq!(c.run.backward_us_per_layer, 100, "{}", p.display());
    }
    // A config without one gets the profile's (558 µs per layer in h200-nvlink).
    let bare = scratch(
        "confirm-bare.toml",
        &CONFIG.replace("backward_us_per_layer = 100", "seed = 3"),
    );
    let dir2 = dir.join("bare");
    let o = tune(
        &bare,
        "hardware/h200-nvlink.toml",
        &[
            "--confirm",
            "1",
            "--confirm-dir",
            &dir2.display().to_string(),
        ],
    );
    ok(&o);
    let c = Config::from_file(&dir2.join("tune-1.toml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.run.backward_us_per_layer, 558);
    assert_eq!(c.run.seed, 3);
}
