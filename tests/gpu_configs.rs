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
