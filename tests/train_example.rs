//! `examples/train.rs`, the trainer: it learns, its session agrees with its independent
//! reference trainer, and its mid-run checkpoint resumes bit for bit. The first test is the
//! documented run, `cargo run --release --example train -- --steps 50 --json`.

#[allow(dead_code)]
#[path = "../examples/train.rs"]
mod train;

use train::{Args, TOLERANCE};

#[test]
fn the_trainer_learns_matches_its_reference_and_resumes_bit_exact() {
    // The documented run: 50 steps on HSDP 2x2, 4 micro-batches.
    let args = Args {
        json: true,
        ..Args::default()
    };
    let r = train::run(&args).unwrap();
    assert_eq!((r.steps, r.mesh.as_str(), r.micro_batches), (50, "2x2", 4));
    assert!(
        r.loss_last <= 0.5 * r.loss_first,
        "the loss must at least halve: {} -> {}",
        r.loss_first,
        r.loss_last
    );
    assert!(
        r.reference_rel_err <= TOLERANCE,
        "loss curve against the reference: {:e}",
        r.reference_rel_err
    );
    assert!(
        r.clip_norm_rel_err <= TOLERANCE,
        "global norm against the reference: {:e}",
        r.clip_norm_rel_err
    );
    assert!(
        r.param_rel_err <= 1e-4,
        "final parameters: {:e}",
        r.param_rel_err
    );
    assert!(
        r.clipped_steps > 0 && r.clipped_steps < r.steps,
        "clipping must engage on some steps and not all: {}",
        r.clipped_steps
    );
    assert!(r.resume_bit_exact);
    assert!(r.ok);
    // The JSON line carries every field the docs promise.
    let json = serde_json::to_value(&r).unwrap();
    for key in [
        "steps",
        "mesh",
        "micro_batches",
        "loss_first",
        "loss_last",
        "reference_rel_err",
        "clip_norm_rel_err",
        "resume_bit_exact",
        "clipped_steps",
        "ok",
    ] {
        assert!(json.get(key).is_some(), "{key} missing from {json}");
    }
}

#[test]
fn a_reference_whose_learning_rates_are_off_by_one_part_in_ten_thousand_is_caught() {
    let args = Args {
        steps: 10,
        json: true,
        reference_lr_scale: 1.0001,
        ..Args::default()
    };
    let r = train::run(&args).unwrap();
    assert!(
        r.reference_rel_err > TOLERANCE,
        "a 0.01% learning-rate difference must show in the loss curve: {:e}",
        r.reference_rel_err
    );
    assert!(!r.ok);
    // The session itself is untouched by the reference's rates.
    assert!(r.resume_bit_exact);
}

#[test]
fn the_trainer_runs_on_other_meshes() {
    // Padded shards (3 ranks per shard group), three replicate groups, an odd number of
    // micro-batches.
    let args = Args {
        steps: 6,
        json: true,
        mesh: overlap::Mesh::new(3, 3).unwrap(),
        micro_batches: 3,
        ..Args::default()
    };
    let r = train::run(&args).unwrap();
    assert!(
        r.reference_rel_err <= TOLERANCE,
        "{:e}",
        r.reference_rel_err
    );
    assert!(
        r.clip_norm_rel_err <= TOLERANCE,
        "{:e}",
        r.clip_norm_rel_err
    );
    assert!(r.resume_bit_exact);
    assert!(r.loss_last < r.loss_first);
}

/// `--backend cuda` (with the `cuda` feature): on a machine with a GPU the trainer runs
/// on it and matches the CPU backend; without one it fails at start with an error that
/// names what is missing, rather than panicking inside the CUDA bindings.
#[cfg(feature = "cuda")]
#[test]
fn the_gpu_trainer_matches_the_cpu_backend_or_names_what_is_missing() {
    let args = Args {
        backend: "cuda".into(),
        mesh: "1x1".parse().unwrap(),
        steps: 6,
        json: true,
        ..Args::default()
    };
    match train::gpu::run(&args) {
        Ok(r) => {
            assert!(r.ok, "{r:?}");
            assert!(r.loss_rel_err <= train::gpu::GPU_TOLERANCE, "{r:?}");
        }
        Err(e) => {
            let m = e.to_string();
            assert!(
                ["CUDA", "libcuda", "NCCL", "NVRTC", "cuBLAS", "device"]
                    .iter()
                    .any(|w| m.contains(w)),
                "{m}"
            );
        }
    }
}

/// The trainer's own kernels compile with NVRTC where it is installed (no GPU needed).
#[cfg(feature = "cuda")]
#[test]
fn the_gpu_trainers_kernels_compile_when_nvrtc_is_available() {
    use overlap::ops::cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    if let Err(e) = overlap::ops::cuda::check_libraries() {
        // On a GPU machine a missing library is a failure, not a skip.
        assert!(
            std::env::var("OVERLAP_GPU_TESTS").as_deref() != Ok("1"),
            "OVERLAP_GPU_TESTS=1 but the CUDA libraries are not all here: {e}"
        );
        eprintln!("the CUDA libraries are not all here ({e}): skipped");
        return;
    }
    let opts = CompileOptions {
        fmad: Some(false),
        options: vec!["--gpu-architecture=compute_90".into()],
        ..Default::default()
    };
    if let Err(e) = compile_ptx_with_opts(include_str!("../examples/train_cuda/kernels.cu"), opts) {
        panic!("examples/train_cuda/kernels.cu does not compile: {e:?}");
    }
}

/// Set in the processes [`one_process_per_rank_trains_the_in_process_bits`] starts.
const JOB_RANK: &str = "OVERLAP_TEST_TRAIN_JOB_RANK";

/// `examples/train.rs --backend cpu` as a job of one process per rank (mesh 2x1): this
/// test binary started twice as ranks 0 and 1 of the job (each runs
/// [`one_rank_of_a_cpu_job`]), each rank's session over the CPU links ends with its
/// loss curve, gradient norms, parameters and optimizer states equal to the in-process
/// run's bit for bit.
#[test]
fn one_process_per_rank_trains_the_in_process_bits() {
    if std::env::var_os(JOB_RANK).is_some() {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::process::Command::new(std::env::current_exe().expect("this test binary"))
                .args(["--exact", "one_rank_of_a_cpu_job", "--nocapture"])
                .env(JOB_RANK, "1")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OVERLAP_JOB_SECRET", "a secret of this test job, 32 B.")
                .env("OVERLAP_RENDEZVOUS_TIMEOUT_S", "60")
                .env_remove("OVERLAP_FAULT")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("the rank starts")
        })
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().expect("the rank runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("\"rank\":{rank},\"world\":2"))
                && stdout.contains("\"curve_bit_exact\":true,\"state_bit_exact\":true"),
            "rank {rank}: {stdout}"
        );
    }
}

/// One rank of [`one_process_per_rank_trains_the_in_process_bits`]'s job (nothing
/// outside it).
#[test]
fn one_rank_of_a_cpu_job() {
    if std::env::var_os(JOB_RANK).is_none() {
        return;
    }
    let mesh: overlap::Mesh = "2x1".parse().unwrap();
    let env = overlap_dist::cpu::rank_env(mesh).unwrap().expect("a job");
    let args = Args {
        mesh,
        steps: 8,
        micro_batches: 2,
        batch: 8,
        json: true,
        ..Args::default()
    };
    let r = train::cpu_job::run(&args, env).unwrap();
    println!("{}", serde_json::to_string(&r).unwrap());
    assert!(r.curve_bit_exact && r.state_bit_exact && r.ok, "{r:?}");
}
