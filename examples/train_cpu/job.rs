//! `examples/train.rs --backend cpu` started as one process per rank (`overlap launch
//! --nproc-per-node N`, torchrun, Slurm or Open MPI): the CPU backend's job of one rank
//! per process, the way a CPU trainer embeds `overlap` across processes.
//!
//! ```sh
//! cargo build --release --example train && cargo build --release --bin overlap
//! target/release/overlap launch --nproc-per-node 4 -- target/release/examples/train --mesh 2x2 --json
//! ```
//!
//! Each process joins the job for its rank (`overlap_dist::cpu::open`: the rendezvous,
//! the agreement on the trainer's arguments, an authenticated link to every other rank)
//! and trains the example's model on its own samples through a [`Session`] over that
//! rank's backend ([`CpuBackend::one_rank`]), handing in only its own gradients. Then it
//! trains the same example with every rank in this process and compares its rank's loss
//! curve, the global gradient norms, its parameter pieces and its optimizer states:
//! they must be equal bit for bit, since the CPU backend across processes computes the
//! bits of the CPU backend in one process. Each rank prints one JSON line (or a
//! summary); the exit status is 0 when everything is bit-exact and the rank's loss went
//! down, 1 otherwise (the in-process run's own checks, against the independent
//! reference, are `--backend cpu` in one process).

use std::process::ExitCode;

use overlap::{CpuBackend, Session};
use overlap_dist::env::RankEnv;
use overlap_dist::fingerprint::Fingerprint;
use serde::Serialize;

use super::{new_session, plan_spec, rank_state, train, Args, Error, Hyper, Task};

/// What a rank found: its JSON line.
#[derive(Debug, Clone, Serialize)]
pub struct JobReport {
    /// Always `"cpu"`.
    pub backend: &'static str,
    /// This process's rank.
    pub rank: u32,
    /// Processes in the job.
    pub world: u32,
    /// The mesh, `SxR`.
    pub mesh: String,
    /// Steps trained.
    pub steps: u64,
    /// This rank's first and last loss (mean over its micro-batches).
    pub loss_first: f64,
    /// See `loss_first`.
    pub loss_last: f64,
    /// This rank's losses and the global gradient norms, step by step, equal the
    /// in-process run's bit for bit.
    pub curve_bit_exact: bool,
    /// This rank's parameter pieces and optimizer states after the last step equal the
    /// in-process run's bit for bit.
    pub state_bit_exact: bool,
    /// Both are bit-exact and the rank's loss went down.
    pub ok: bool,
}

/// Runs this rank and prints its report; the exit status says whether it is `ok`.
pub fn main(args: &Args, env: RankEnv) -> ExitCode {
    match run(args, env) {
        Ok(r) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string(&r).expect("a report serialises")
                );
            } else {
                println!(
                    "rank {} of {}: loss {:.4} -> {:.4}; against every rank in one process: curve {}, state {}; {}",
                    r.rank,
                    r.world,
                    r.loss_first,
                    r.loss_last,
                    exact(r.curve_bit_exact),
                    exact(r.state_bit_exact),
                    if r.ok { "ok" } else { "FAILED" }
                );
            }
            if r.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("train: {e}");
            ExitCode::from(1)
        }
    }
}

fn exact(b: bool) -> &'static str {
    if b {
        "bit-exact"
    } else {
        "DIFFERS"
    }
}

/// This rank's run over the links, then every rank in this process, compared.
pub fn run(args: &Args, env: RankEnv) -> Result<JobReport, Error> {
    super::check_args(args)?;
    let hyper = Hyper::new(args.steps);
    let task = Task::new(args);
    let mut what = Fingerprint::build();
    what.push("train.mesh", args.mesh.to_string());
    what.push("train.steps", args.steps.to_string());
    what.push("train.micro_batches", args.micro_batches.to_string());
    what.push("train.batch", args.batch.to_string());
    what.push("train.seed", args.seed.to_string());
    let world = overlap_dist::cpu::open(env, args.mesh, what)?;
    let rank = world.env.rank;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let log = !args.json && rank == 0;

    let mut session = Session::new(plan_spec(&task), world.backend.clone(), hyper.exec_config())?;
    session.init_params(|i, _| task.init[i as usize].clone())?;
    let curve = runtime.block_on(train(&mut session, &task, &hyper, args.steps, None, log))?;
    let state = rank_state(&session, rank)?;
    drop(session);

    // The same example with every rank in this process.
    let (all_curve, all_state) = runtime.block_on(async {
        let mut s: Session<CpuBackend> = new_session(&task, &hyper)?;
        s.init_params(|i, _| task.init[i as usize].clone())?;
        let curve = train(&mut s, &task, &hyper, args.steps, None, false).await?;
        Ok::<_, Error>((curve, rank_state(&s, rank)?))
    })?;
    let bits = |x: f64| x.to_bits();
    let curve_bit_exact = curve.len() == all_curve.len()
        && curve.iter().zip(&all_curve).all(|(a, b)| {
            bits(a.rank_loss[rank as usize]) == bits(b.rank_loss[rank as usize])
                && bits(a.grad_norm) == bits(b.grad_norm)
        });
    let state_bit_exact = state == all_state && state.iter().any(Option::is_some);
    let (first, last) = (&curve[0], &curve[curve.len() - 1]);
    let (loss_first, loss_last) = (
        first.rank_loss[rank as usize],
        last.rank_loss[rank as usize],
    );
    Ok(JobReport {
        backend: "cpu",
        rank,
        world: world.env.world_size,
        mesh: args.mesh.to_string(),
        steps: args.steps,
        loss_first,
        loss_last,
        curve_bit_exact,
        state_bit_exact,
        ok: curve_bit_exact && state_bit_exact && loss_last < loss_first,
    })
}
