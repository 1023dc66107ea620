//! Embedding `overlap` in a Rust trainer: the loop a trainer author copies.
//!
//! Run it with `cargo run --example embed`. It builds a session in code (no config
//! file), accumulates two micro-batches per step with the replicate gate off on the
//! first (HSDP's inter-node all-reduce runs once per step), and prints what the
//! optimizers consumed.

use std::sync::Arc;

use overlap::{CpuBackend, ExecConfig, Gate, Mesh, ParamSpec, PlanSpec, Route, Session};

// Any tokio runtime works; a current-thread one is enough (the backend has its own threads).
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), overlap::Error> {
    // 1. Describe the mesh and the parameters: 2 ranks per node, 2 nodes. `PlanSpec::new`
    //    takes the defaults (avg in f32, 25 MiB buckets, FSDP2's streams, NCCL
    //    collectives); `with_*` methods change them.
    let spec = PlanSpec::new(
        Mesh::new(2, 2)?,
        vec![
            ParamSpec::new("embed", [64, 16], Route::ShardedAdamw, 0),
            ParamSpec::new("block.attn", [48, 16], Route::Muon, 1),
            ParamSpec::new("block.norm", [16], Route::Fsdp, 1),
            ParamSpec::new("block.bias", [21], Route::Adamw, 1),
            ParamSpec::new("head", [64, 16], Route::ShardedAdamw, 2),
        ],
    );

    // 2. A session on the CPU backend (every rank is a set of threads here; on GPUs each
    //    process drives its own rank).
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    let mut session = Session::new(spec, backend, ExecConfig::default())?;
    session.init_params(|_, param| vec![0.01; param.spec.numel() as usize])?;

    for step in 0..3u32 {
        // 3. Per micro-batch: set the gate, then hand in gradients as backward makes
        //    them, highest layer first.
        for gate in [Gate::ReplicateOff, Gate::On] {
            session.begin_micro_batch(gate).await?;
            for layer in session.layers() {
                session
                    .grad_ready(layer, |rank, param, out| {
                        // Your backward's gradient of `param` on `rank` goes here.
                        for (i, g) in out.iter_mut().enumerate() {
                            *g = ((i as u32 + rank + param + step) % 7) as f32 * 0.1;
                        }
                    })
                    .await?;
            }
        }
        // 4. Optimizers and publishes; errors anywhere in the step come back here.
        let report = session.step().await?;
        println!(
            "step {}: {} nodes, {:.2} ms, Stage 2 moved {} B and saved {} B",
            report.step,
            report.stats.nodes,
            report.stats.wall_seconds * 1e3,
            report.stage2_bytes,
            report.stage2_bytes_saved
        );
    }

    // 5. What rank 0's optimizer consumed for the norm weight (its shard).
    let norm = session.param_id("block.norm").expect("declared above");
    println!(
        "rank 0 reduced gradient of block.norm: {:?}",
        session.reduced_grad(0, norm)?
    );
    Ok(())
}
