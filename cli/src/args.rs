//! The command line's arguments (clap) and their parsers.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use overlap::config::BackendChoice;
use overlap::graph::Gate;
use overlap::Error;

use crate::{bench, calibrate, interference, simulate, tune};

#[derive(Parser)]
#[command(
    name = "overlap",
    version,
    about = "The gradient path of sharded data-parallel training as a validated task graph"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run the configured training steps with seeded synthetic gradients and print a
    /// summary per step.
    Run {
        /// The config file (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Steps to run (overrides `run.steps`).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        steps: Option<u32>,
        /// Backend (overrides `run.backend`): auto, cpu or cuda.
        #[arg(long)]
        backend: Option<BackendChoice>,
        /// Seed of the synthetic gradients (overrides `run.seed`).
        #[arg(long)]
        seed: Option<u64>,
        #[command(flatten)]
        observe: ObserveArgs,
        #[command(flatten)]
        checkpoint: CheckpointArgs,
    },
    /// Run the gated schedule and the no_sync reference side by side and compare what
    /// every optimizer consumes; exits 0 only when every comparison is within tolerance.
    Verify {
        /// The config file (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Steps to run (overrides `run.steps`).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        steps: Option<u32>,
        /// Seed (overrides `run.seed`).
        #[arg(long)]
        seed: Option<u64>,
        /// End with one JSON line: ok, worst_rel_err, per_route, partials_left, steps, ranks, ...
        #[arg(long)]
        json: bool,
        /// Backend (overrides `run.backend`): auto, cpu or cuda. With cuda, run one process
        /// per GPU (`overlap launch --nproc-per-node N -- verify ...`); the GPUs' results are
        /// compared with the exact reference and with the CPU backend.
        #[arg(long)]
        backend: Option<BackendChoice>,
        /// Gate pattern, e.g. `no_sync,off,on` or `off*7,on` (overrides the config's).
        #[arg(long)]
        gates: Option<String>,
        /// Reduction dtype on the wire (overrides `reduce.dtype`).
        #[arg(long, value_enum)]
        dtype: Option<WireDType>,
        /// How stages over groups of two or more move their bytes (overrides
        /// `overlap.transport`).
        #[arg(long, value_enum)]
        transport: Option<TransportArg>,
    },
    /// Print the lowered plan of one step.
    Plan {
        /// The config file (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        /// Gate pattern, e.g. `no_sync,off,on` or `off*7,on` (default: the config's).
        #[arg(long)]
        gates: Option<String>,
        /// Only these ranks, comma-separated (text and dot formats).
        #[arg(long)]
        ranks: Option<String>,
    },
    /// Validate a plan in the JSON format of `overlap plan --format json`; exits non-zero
    /// naming the broken invariant.
    Check {
        /// The plan file (JSON).
        #[arg(long)]
        plan: PathBuf,
    },
    /// Start N local ranks of a job, as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
    /// MASTER_ADDR, MASTER_PORT), each running `overlap <ARGS>` (or, when ARGS start with
    /// a program rather than an overlap subcommand, that program: a trainer embedding the
    /// library); their output is prefixed with `[rank k]`, and the first rank to fail
    /// stops the others and sets the exit code.
    Launch {
        /// Processes on this node (one per GPU).
        #[arg(long)]
        nproc_per_node: u32,
        /// Nodes in the job.
        #[arg(long, default_value_t = 1)]
        nnodes: u32,
        /// This node's index.
        #[arg(long, default_value_t = 0)]
        node_rank: u32,
        /// Host of rank 0.
        #[arg(long, default_value = "127.0.0.1")]
        master_addr: String,
        /// Port of rank 0's rendezvous.
        #[arg(long, default_value_t = overlap_dist::env::DEFAULT_MASTER_PORT)]
        master_port: u16,
        /// When a rank fails, stop the others and start every rank of this node again, up
        /// to N times, with OVERLAP_RESTART_COUNT set to the restart's number (0 on the
        /// first attempt); `run --checkpoint DIR --resume-latest` then goes on from the
        /// latest checkpoint (docs/checkpoints.md). One node only.
        #[arg(long, value_name = "N", default_value_t = 0)]
        max_restarts: u32,
        /// What each rank runs, after `--`: an overlap subcommand and its options, or a
        /// program and its arguments.
        #[arg(last = true, required = true, value_name = "ARGS")]
        args: Vec<std::ffi::OsString>,
    },
    /// GPU benchmark of `docs/performance.md`'s workload through the executor (under `overlap
    /// launch`): L layers of bf16 GEMMs, one f32 gradient per layer reduced on mesh 2x1
    /// (reduce-scatter) or 1x2 (all-reduce); compute_only, comm_only, serial, overlap,
    /// ideal, eta and host µs per node. Needs the `cuda` feature.
    Bench {
        #[command(flatten)]
        args: bench::BenchArgs,
        /// Write rank 0's last timed overlap step as an SVG timeline to this path (and
        /// its kernels, one JSON object per line, next to it with `.jsonl`).
        #[arg(long)]
        timeline: Option<std::path::PathBuf>,
        /// Print one JSON line (rank 0).
        #[arg(long)]
        json: bool,
    },
    /// GPU benchmark of the executor's collective nodes against direct NCCL calls on the
    /// same communicator, 1 to 256 MiB (under `overlap launch`; `cuda` feature).
    BenchCollectives {
        /// `2x1` (reduce-scatter) or `1x2` (all-reduce).
        #[arg(long, default_value = "2x1")]
        mesh: String,
        /// Sizes in MiB, comma-separated.
        #[arg(long, default_value = "1,2,4,8,16,32,64,128,256")]
        mib: String,
        /// Timed steps (and direct calls) per size.
        #[arg(long, default_value_t = 20)]
        iters: u32,
        /// Untimed ones before them.
        #[arg(long, default_value_t = 3)]
        warmup: u32,
    },
    /// GPU benchmark of the step's optimizer tail (AdamW, Muon) on one GPU, on the
    /// shapes of a model (`cuda` feature; docs/performance.md).
    BenchOptimizer {
        #[command(flatten)]
        args: crate::bench_optim::BenchOptimizerArgs,
    },
    /// GPU probe of what a copy-transport combine costs the GEMMs beside it, on one GPU
    /// without communication (`cuda` feature; docs/performance.md).
    BenchInterference {
        #[command(flatten)]
        args: interference::InterferenceArgs,
    },
    /// Predict what `overlap bench` (or a config's step) would measure on the hardware a
    /// profile describes: a discrete-event simulation of the lowered plan, no device
    /// (docs/simulate.md).
    Simulate {
        #[command(flatten)]
        args: simulate::SimulateArgs,
    },
    /// Search a config's scheduling levers (bucket cap, transport, combine lag, copy
    /// rings, Stage-1 window, stream bindings) for the smallest step the simulator
    /// predicts on a hardware profile, and print the winner as config sections
    /// (docs/simulate.md).
    Tune {
        #[command(flatten)]
        args: tune::TuneArgs,
    },
    /// Measure on GPUs what the simulator's cost model needs (collectives, copy-engine
    /// copies, kernels, GEMMs alone and beside each kind of communication kernel) and
    /// write a hardware profile for `overlap simulate --hardware`. One process per GPU
    /// (`overlap launch --nproc-per-node N -- calibrate --out FILE`); on one GPU with
    /// `--base PROFILE`, which supplies what needs two or more. Progress on stderr, a
    /// summary on stdout; `cuda` feature (docs/simulate.md).
    Calibrate {
        #[command(flatten)]
        args: calibrate::CalibrateArgs,
    },
    /// Print this process's rank environment as JSON (for checking a launcher).
    #[command(hide = true)]
    Env {
        /// Also meet the other ranks at rank 0's rendezvous; rank 0 prints who arrived.
        #[arg(long)]
        rendezvous: bool,
    },
    /// Check a GPU job: libraries, every collective, the kernels against the reference
    /// math, and all-reduce bandwidth (run under `overlap launch`).
    #[command(hide = true)]
    CudaSmoke {
        /// All-reduce sizes to time, in MiB per rank, comma-separated.
        #[arg(long, default_value = "1,16,64,256")]
        mib: String,
        /// Timed calls per size.
        #[arg(long, default_value_t = 20)]
        iters: u32,
    },
}

/// The reduction dtype on the wire.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum WireDType {
    F32,
    Bf16,
}

/// `[overlap] transport` on the command line.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum TransportArg {
    /// One NCCL collective per stage.
    Nccl,
    /// Copy engines over NVLink for the bytes, a combine kernel for the reduction.
    Copy,
}

impl From<TransportArg> for overlap::graph::Transport {
    fn from(t: TransportArg) -> Self {
        match t {
            TransportArg::Nccl => overlap::graph::Transport::Nccl,
            TransportArg::Copy => overlap::graph::Transport::Copy,
        }
    }
}

/// What `overlap run` shows besides its summary lines.
#[derive(clap::Args)]
pub(crate) struct ObserveArgs {
    /// Serve Prometheus metrics on this address while running, e.g. 127.0.0.1:9464
    /// (overrides `metrics.listen`).
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics: Option<std::net::SocketAddr>,
    /// Time one step in N: steps 1, 1+N, 1+2N, ... (overrides `metrics.timing_every`).
    /// The others skip the kernel timing events and report no device figures.
    #[arg(long, value_name = "N", value_parser = parse_timing_every)]
    pub(crate) timing_every: Option<u32>,
    /// Write the executed schedule of every step as a Chrome trace (JSON; open it in
    /// https://ui.perfetto.dev).
    #[arg(long, value_name = "FILE")]
    pub(crate) trace: Option<PathBuf>,
    /// Draw one step's schedule as an SVG Gantt picture (the last step, or --svg-step).
    #[arg(long, value_name = "FILE")]
    pub(crate) svg: Option<PathBuf>,
    /// The step --svg draws (1-based).
    #[arg(long, value_name = "N", requires = "svg")]
    pub(crate) svg_step: Option<u64>,
    /// Pause this long after each step, so that a run can be watched (and scraped).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub(crate) step_interval_ms: u64,
    /// After the last step, print `params rank R: HASH` for each rank this process
    /// drives: a 64-bit FNV-1a hash of the bits of every parameter piece the rank holds
    /// and of the reduced gradients its last step's optimizers consumed, to compare runs
    /// bit for bit (not a security checksum).
    #[arg(long)]
    pub(crate) param_digest: bool,
}

/// Checkpoints of `overlap run` (docs/checkpoints.md).
#[derive(clap::Args)]
pub(crate) struct CheckpointArgs {
    /// Save a checkpoint into DIR after the last step (and every --save-every steps),
    /// written in the background while the next steps run. In a multi-process job every
    /// process writes its own ranks' files and rank 0's commits the checkpoint: DIR must
    /// be a directory every process sees (one host, or a shared file system).
    #[arg(long, value_name = "DIR")]
    pub(crate) checkpoint: Option<PathBuf>,
    /// Save a checkpoint after every N steps (step numbers divisible by N), and after
    /// the last step.
    #[arg(long, value_name = "N", requires = "checkpoint", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) save_every: Option<u64>,
    /// Load the checkpoint in DIR (a checkpoint root, whose `latest` is followed, or one
    /// step directory) before the first step, and go on from its step: --steps more steps.
    #[arg(long, value_name = "DIR")]
    pub(crate) resume: Option<PathBuf>,
    /// Resume from --checkpoint DIR's latest checkpoint when it has one, and start at
    /// step 0 when it has none, so that one command line serves every attempt of a
    /// restarted job (`overlap launch --max-restarts`, a scheduler's requeue). --steps
    /// is then the step the run ends at, not a number of more steps.
    #[arg(long, requires = "checkpoint", conflicts_with = "resume")]
    pub(crate) resume_latest: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Format {
    Text,
    Dot,
    Json,
}

pub(crate) fn parse_gates(s: &str) -> Result<Vec<Gate>, Error> {
    Gate::parse_pattern(s).map_err(|e| Error::Usage(format!("--gates: {e}")))
}

/// `--timing-every N`, in the range of `[metrics] timing_every`.
pub(crate) fn parse_timing_every(s: &str) -> Result<u32, String> {
    let max = overlap::config::MAX_TIMING_EVERY;
    match s.parse::<u32>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "must be a whole number between 1 and {max} steps, got `{s}`"
        )),
    }
}

/// `--ranks 0,2`: ranks of the mesh, each listed once (a repeat is dropped), in the
/// order given.
pub(crate) fn parse_ranks(s: &str, world: u32) -> Result<Vec<u32>, Error> {
    let mut ranks = Vec::new();
    for r in s.split(',') {
        match r.trim().parse::<u32>() {
            Ok(x) if x < world => {
                if !ranks.contains(&x) {
                    ranks.push(x);
                }
            }
            _ => {
                return Err(Error::Usage(format!(
                    "--ranks: `{r}` is not a rank of this mesh (0..{world})"
                )))
            }
        }
    }
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_listed_once_in_the_order_given_and_out_of_range_is_named() {
        assert_eq!(parse_ranks("2, 0,2,0", 4).unwrap(), vec![2, 0]);
        let e = parse_ranks("0,4", 4).unwrap_err().to_string();
        assert!(e.contains("`4` is not a rank of this mesh (0..4)"), "{e}");
    }
}
