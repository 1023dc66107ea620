//! `overlap verify` and `overlap run` with `[clip]` on the CPU backend (the library's
//! clipping is tested in `tests/clip.rs`).

/// `overlap verify` with `[clip]` (CPU backend, any mesh): clipping that engages is
/// compared against the clipped reference, the norm against the reference's; an
/// `OVERLAP_FAULT` NaN step is expected, skipped and reported; a NaN with
/// `on_nonfinite = "error"` stops `overlap run` naming the setting. The same commands
/// the GPU validation runs with `--backend cuda` (`examples/gpu/gpu_1x1_clip.toml`).
#[test]
fn verify_checks_the_norm_the_clip_and_the_injected_nan() {
    use std::process::Command;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("clip");
    std::fs::create_dir_all(&dir).unwrap();
    let config = |name: &str, clip: &str| {
        let text = format!(
            "[mesh]\nshard = 2\nreplicate = 2\n[model]\nlayers = 2\nhidden = 8\nvocab = 16\n\
             [[param]]\nname = \"odd\"\nshape = [7]\nroute = \"fsdp\"\nlayer = 1\n\
             [accumulation]\ngates = [\"off\", \"on\"]\n[clip]\n{clip}\n[run]\nsteps = 3\n"
        );
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let clip = config("clip.toml", "max_norm = 0.05");
    let refuse = config("refuse.toml", "on_nonfinite = \"error\"");
    let overlap = |args: &[&str], fault: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_overlap"));
        c.args(args).env_remove("OVERLAP_FAULT");
        if let Some(f) = fault {
            c.env("OVERLAP_FAULT", f);
        }
        c.output().expect("overlap runs")
    };
    let json = |o: &std::process::Output| -> serde_json::Value {
        let out = String::from_utf8_lossy(&o.stdout);
        serde_json::from_str(out.lines().last().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}: {out} {}", String::from_utf8_lossy(&o.stderr)))
    };
    let path = clip.to_str().unwrap();
    let verify = ["verify", "--config", path, "--backend", "cpu", "--json"];
    let o = overlap(&verify, None);
    let v = json(&o);
    assert!(o.status.success() && v["ok"] == true, "{v}");
    assert_eq!(v["skipped_steps"], 0);
    let norms = v["grad_norms"].as_array().unwrap();
    assert_eq!(norms.len(), 3);
    assert!(
        norms.iter().all(|n| n.as_f64().unwrap() > 1.0),
        "clipping engages: {v}"
    );
    assert!(v["grad_norm_rel_err"].as_f64().unwrap() <= 1e-6, "{v}");
    // Rank 3 (replicate index 1) owns some parameters' norm share; rank 1 its shards.
    for rank in [1, 3] {
        let fault = format!("rank={rank},kind=grad_norm,step=2,mode=nan");
        let o = overlap(&verify, Some(&fault));
        let v = json(&o);
        assert!(o.status.success() && v["ok"] == true, "{fault}: {v}");
        assert_eq!(
            (v["skipped_steps"].as_u64(), v["expected_skips"].as_u64()),
            (Some(1), Some(1))
        );
        assert!(
            v["grad_norms"][1].is_null() && v["grad_norms"][2].is_f64(),
            "{v}"
        );
    }
    let run = [
        "run",
        "--config",
        refuse.to_str().unwrap(),
        "--backend",
        "cpu",
    ];
    let o = overlap(&run, Some("rank=0,kind=grad_norm,step=2,mode=nan"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("step 2") && err.contains("on_nonfinite"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("step 1/3"));
}
