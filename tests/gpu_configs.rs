//! The GPU validation configs (`examples/gpu/`, docs/gpu-validation.md) also pass on the
//! CPU backend, so CI checks what the GPU runs are compared with.

use overlap::config::{BackendChoice, Config};
use overlap::graph::{DType, Gate};

fn check(file: &str, gates: &[Gate], dtype: DType) {
    let path = format!("{}/examples/gpu/{file}", env!("CARGO_MANIFEST_DIR"));
    let mut cfg = Config::from_file(path.as_ref()).expect("the config parses");
    assert_eq!(
        cfg.run.backend,
        BackendChoice::Cuda,
        "{file} is a GPU config"
    );
    cfg.run.backend = BackendChoice::Cpu;
    cfg.gates = gates.to_vec();
    cfg.plan.reduce.dtype = dtype;
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    let report = rt
        .block_on(overlap::verify::verify(&cfg, 3, cfg.run.seed, |_| {}))
        .expect("verify runs");
    assert!(report.ok, "{file} {gates:?} {dtype:?}: {report:?}");
    assert_eq!(report.partials_left, 0);
    // With `[clip]`, the norm was checked on every step and no step was skipped.
    assert_eq!(report.norm.is_some(), cfg.clip.is_some(), "{file}");
    if let Some(n) = &report.norm {
        assert_eq!(n.grad_norms.len(), 3, "{file}");
        assert_eq!((n.skipped_steps, n.expected_skips), (0, 0), "{file}");
        if let Some(max_norm) = cfg.clip.and_then(|c| c.max_norm) {
            assert!(
                n.grad_norms
                    .iter()
                    .all(|g| g.unwrap() > 10.0 * f64::from(max_norm)),
                "{file}: every step clips: {n:?}"
            );
        }
    }
}

#[test]
fn gpu_validation_configs_verify_on_the_cpu_backend() {
    use Gate::{NoSync, On, ReplicateOff as Off};
    for file in [
        "gpu_2x1.toml",
        "gpu_1x2.toml",
        "gpu_2x1_in_place.toml",
        "gpu_1x2_in_place.toml",
        "gpu_2x1_depth3.toml",
    ] {
        check(file, &[NoSync, Off, On], DType::F32);
        check(file, &[Off, Off, On], DType::Bf16);
    }
}

/// The clipping configs (one GPU): the norm is checked and every step clips.
#[test]
fn gpu_clip_configs_verify_on_the_cpu_backend() {
    use Gate::{NoSync, On, ReplicateOff as Off};
    for file in ["gpu_1x1_clip.toml", "gpu_1x1_nonfinite.toml"] {
        check(file, &[Off, On], DType::F32);
    }
    check("gpu_1x1_clip.toml", &[NoSync, On], DType::Bf16);
}
