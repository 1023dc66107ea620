//! The `overlap` command line: wires the libraries together; no logic of its own that a
//! library user would want. The GPU benchmarks (`bench`, `bench-collectives`,
//! `bench-interference`, `cuda-smoke`) and the launcher live here too, so that a trainer
//! linking the `overlap` library pays for none of them.

mod bench;
mod interference;
mod launch;
#[cfg(feature = "cuda")]
mod smoke;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use overlap::config::{BackendChoice, Config};
use overlap::graph::{export, validate, Gate, Mode, Plan, Planner};
use overlap::{drive, observe, verify, Error, Session};

#[derive(Parser)]
#[command(
    name = "overlap",
    version,
    about = "The gradient path of sharded data-parallel training as a validated task graph"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
    /// MASTER_ADDR, MASTER_PORT), each running `overlap <ARGS>`; their output is prefixed
    /// with `[rank k]`, and the first rank to fail stops the others and sets the exit code.
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
        #[arg(long, default_value_t = overlap::dist::DEFAULT_MASTER_PORT)]
        master_port: u16,
        /// The overlap subcommand each rank runs, after `--`.
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
    /// GPU probe of what a copy-transport combine costs the GEMMs beside it, on one GPU
    /// without communication (`cuda` feature; docs/performance.md).
    BenchInterference {
        #[command(flatten)]
        args: interference::InterferenceArgs,
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
enum WireDType {
    F32,
    Bf16,
}

/// `[overlap] transport` on the command line.
#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
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
struct ObserveArgs {
    /// Serve Prometheus metrics on this address while running, e.g. 127.0.0.1:9464
    /// (overrides `metrics.listen`).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// Time one step in N: steps 1, 1+N, 1+2N, ... (overrides `metrics.timing_every`).
    /// The others skip the kernel timing events and report no device figures.
    #[arg(long, value_name = "N", value_parser = parse_timing_every)]
    timing_every: Option<u32>,
    /// Write the executed schedule of every step as a Chrome trace (JSON; open it in
    /// https://ui.perfetto.dev).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Draw one step's schedule as an SVG Gantt picture (the last step, or --svg-step).
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// The step --svg draws (1-based).
    #[arg(long, value_name = "N", requires = "svg")]
    svg_step: Option<u64>,
    /// Pause this long after each step, so that a run can be watched (and scraped).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    step_interval_ms: u64,
}

/// Checkpoints of `overlap run` (docs/checkpoints.md).
#[derive(clap::Args)]
struct CheckpointArgs {
    /// Save a checkpoint into DIR after the last step (and every --save-every steps).
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// Save a checkpoint after every N steps (step numbers divisible by N), and after
    /// the last step.
    #[arg(long, value_name = "N", requires = "checkpoint", value_parser = clap::value_parser!(u64).range(1..))]
    save_every: Option<u64>,
    /// Load the checkpoint in DIR (a checkpoint root, whose `latest` is followed, or one
    /// step directory) before the first step, and go on from its step: --steps more steps.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Dot,
    Json,
}

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    init_logging();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", printable_lines(&e.to_string()));
            if matches!(e, Error::Exec(overlap::executor::ExecError::Timeout { .. })) {
                exit_now(2);
            }
            ExitCode::from(2)
        }
    }
}

/// Ends the process at once, without exit handlers or destructors: after a timed-out
/// step the device may still run a kernel that never ends, and the CUDA driver's and
/// NCCL's exit handlers wait for the device. The kernel ends with the process.
fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    #[cfg(unix)]
    // SAFETY: `_exit` only ends the process; the output was flushed above.
    unsafe {
        libc::_exit(code)
    }
    #[cfg(not(unix))]
    std::process::exit(code)
}

/// A message as it may reach a terminal: control characters of names quoted in it
/// escaped, its own line breaks kept.
fn printable_lines(s: &str) -> String {
    s.split('\n')
        .map(export::printable)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Warnings of the libraries (a stranger dropped at the rendezvous, a rank retrying)
/// go to stderr; `OVERLAP_LOG` (a `tracing` filter such as `overlap=debug`) says more
/// or less.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OVERLAP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// Rust ignores SIGPIPE, so `overlap plan ... | head` would panic on the closed pipe;
/// like other command-line tools, end quietly instead.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in main, before any other thread exists; SIG_DFL is a
    // valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn load(path: &Path) -> Result<Config, Error> {
    Ok(Config::from_file(path)?)
}

async fn dispatch(cmd: Command) -> Result<ExitCode, Error> {
    match cmd {
        Command::Run {
            config,
            steps,
            backend,
            seed,
            observe,
            checkpoint,
        } => {
            let mut cfg = load(&config)?;
            if let Some(b) = backend {
                cfg.run.backend = b;
            }
            if let Some(s) = seed {
                cfg.run.seed = s;
            }
            if let Some(addr) = observe.metrics {
                cfg.metrics.listen = Some(addr);
            }
            if let Some(n) = observe.timing_every {
                cfg.metrics.timing_every = n;
            }
            run(&cfg, steps.unwrap_or(cfg.run.steps), &observe, &checkpoint).await
        }
        Command::Verify {
            config,
            steps,
            seed,
            json,
            backend,
            gates,
            dtype,
            transport,
        } => {
            let mut cfg = load(&config)?;
            if let Some(t) = transport {
                cfg.plan.schedule.transport = t.into();
                cfg.overlap.transport = match t {
                    TransportArg::Nccl => overlap::config::TransportChoice::Nccl,
                    TransportArg::Copy => overlap::config::TransportChoice::Copy,
                };
            }
            if let Some(g) = gates {
                cfg.gates = parse_gates(&g)?;
            }
            if let Some(d) = dtype {
                cfg.plan.reduce.dtype = match d {
                    WireDType::F32 => overlap::graph::DType::F32,
                    WireDType::Bf16 => overlap::graph::DType::Bf16,
                };
            }
            let steps = u64::from(steps.unwrap_or(cfg.run.steps));
            let seed = seed.unwrap_or(cfg.run.seed);
            if let Some(b) = backend {
                cfg.run.backend = b;
            }
            if use_cuda(cfg.run.backend)? {
                return verify_cuda(&cfg, steps, seed, json).await;
            }
            meet_cpu(&cfg, "verify", steps, seed)?;
            let report = verify::verify(&cfg, steps, seed, |s| {
                if !json {
                    eprintln!("verify: step {s}/{steps} done");
                }
            })
            .await?;
            print_verify(&cfg, &report, json)
        }
        Command::Launch {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            args,
        } => {
            let spec = launch::LaunchSpec {
                nproc_per_node,
                nnodes,
                node_rank,
                master_addr,
                master_port,
                args,
            };
            Ok(ExitCode::from(launch::launch(&spec)?))
        }
        Command::Env { rendezvous } => env(rendezvous),
        Command::BenchInterference { args } => bench_interference(&args).await,
        Command::Bench {
            mut args,
            timeline,
            json,
        } => {
            args.timeline = timeline.is_some();
            args.check()?;
            if let Some(r) = bench::bench_cuda(&args).await? {
                if let (Some(path), Some(svg), Some(lines)) =
                    (&timeline, &r.timeline_svg, &r.timeline_json)
                {
                    let write = |p: &std::path::Path, text: &str| {
                        std::fs::write(p, text).map_err(|e| {
                            Error::Usage(format!("--timeline: cannot write {}: {e}", p.display()))
                        })
                    };
                    write(path, svg)?;
                    write(&path.with_extension("jsonl"), lines)?;
                }
                if json {
                    println!(
                        "{}",
                        serde_json::to_string(&r).map_err(|e| Error::Usage(e.to_string()))?
                    );
                } else {
                    println!("{}", bench::render(&r));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchCollectives {
            mesh,
            mib,
            iters,
            warmup,
        } => {
            let mesh = bench::parse_mesh(&mesh)?;
            let sizes = mib
                .split(',')
                .map(|m| {
                    m.trim().parse::<u32>().map_err(|_| {
                        Error::Usage(format!("--mib: `{m}` is not a whole number of MiB"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(rows) = bench::collectives_cuda(mesh, &sizes, iters, warmup).await? {
                for r in rows {
                    println!(
                        "{}",
                        serde_json::to_string(&r).map_err(|e| Error::Usage(e.to_string()))?
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::CudaSmoke { mib, iters } => cuda_smoke(&mib, iters).await,
        Command::Plan {
            config,
            format,
            gates,
            ranks,
        } => {
            let cfg = load(&config)?;
            let gates = match gates {
                Some(g) => parse_gates(&g)?,
                None => cfg.gates.clone(),
            };
            let planner = Planner::new(cfg.plan.clone())?;
            planner.check_step(gates.len())?;
            if let Some(params) = overlap::session::unflushed(&planner, &gates) {
                return Err(Error::Unflushed {
                    gates: Gate::pattern_label(&gates),
                    params,
                });
            }
            let plan = planner.plan(&gates)?;
            let v = validate(&plan, Mode::Step);
            if !v.is_empty() {
                return Err(Error::Invalid(v));
            }
            let ranks = ranks
                .map(|r| parse_ranks(&r, plan.mesh.world()))
                .transpose()?;
            match format {
                Format::Json => println!("{}", plan.to_json()),
                Format::Dot => print!("{}", export::to_dot(&plan, ranks.as_deref())),
                Format::Text => {
                    let mut p = plan.clone();
                    if let Some(rs) = &ranks {
                        p.ranks.retain(|r| rs.contains(&r.rank));
                    }
                    print!("{}", export::to_text(&p));
                    print!("{}", cfg.optimizer_text());
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { plan } => {
            let name = plan.display().to_string();
            let text = std::fs::read_to_string(&plan).map_err(|source| Error::Io {
                path: name.clone(),
                source,
            })?;
            let plan = match Plan::from_json(&text) {
                Ok(p) => p,
                Err(e) => {
                    let e = export::printable(&e.to_string()).into_owned();
                    eprintln!("{name}: invariant `well-formed` violated: {e}");
                    return Ok(ExitCode::from(1));
                }
            };
            let v = validate(&plan, Mode::Step);
            if v.is_empty() {
                let nodes: usize = plan.ranks.iter().map(|r| r.nodes.len()).sum();
                println!(
                    "{name}: valid ({} ranks, {nodes} nodes, gates {})",
                    plan.ranks.len(),
                    Gate::pattern_label(&plan.gates)
                );
                Ok(ExitCode::SUCCESS)
            } else {
                for x in &v {
                    eprintln!("{name}: {}", export::printable(&x.to_string()));
                }
                Ok(ExitCode::from(1))
            }
        }
    }
}

fn parse_gates(s: &str) -> Result<Vec<Gate>, Error> {
    Gate::parse_pattern(s).map_err(|e| Error::Usage(format!("--gates: {e}")))
}

/// `--timing-every N`, in the range of `[metrics] timing_every`.
fn parse_timing_every(s: &str) -> Result<u32, String> {
    let max = overlap::config::MAX_TIMING_EVERY;
    match s.parse::<u32>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "must be a whole number between 1 and {max} steps, got `{s}`"
        )),
    }
}

fn parse_ranks(s: &str, world: u32) -> Result<Vec<u32>, Error> {
    s.split(',')
        .map(|r| match r.trim().parse::<u32>() {
            Ok(x) if x < world => Ok(x),
            _ => Err(Error::Usage(format!(
                "--ranks: `{r}` is not a rank of this mesh (0..{world})"
            ))),
        })
        .collect()
}

async fn run(
    cfg: &Config,
    steps: u32,
    observe: &ObserveArgs,
    ckpt: &CheckpointArgs,
) -> Result<ExitCode, Error> {
    let cuda = use_cuda(cfg.run.backend)?;
    let backend = if cuda { "cuda" } else { "cpu" };
    if !cuda {
        // Before any file, listener or thread: the rank limit and the memory estimate.
        overlap::resources::check_cpu(cfg, 1)?;
    }
    // In a multi-process job only rank 0 writes the trace and picture, and each rank
    // serves metrics on the base port plus its local rank.
    let rank_env = overlap::dist::RankEnv::from_env()?;
    let primary = rank_env.as_ref().map_or(true, |e| e.rank == 0);
    if let Some(n) = observe.svg_step.filter(|&n| n == 0 || n > u64::from(steps)) {
        return Err(Error::Usage(format!(
            "--svg-step {n}: the run has steps 1 to {steps}"
        )));
    }
    let recording = observe::Recording::new(
        observe.trace.as_deref().filter(|_| primary),
        observe.svg.as_deref().filter(|_| primary),
        observe.svg_step,
    )?;
    if let Some(addr) = cfg.metrics.listen {
        let addr = observe::metrics::rank_addr(addr, rank_env.as_ref().map(|e| e.local_rank))?;
        observe::metrics::install_prometheus(addr)?;
        println!("metrics: serving http://{addr}/metrics");
    }
    #[cfg(feature = "cuda")]
    if cuda {
        let env = overlap::cuda::rank_env(cfg.plan.mesh)?;
        let mut cfg = cfg.clone();
        cfg.settle_transport(env.one_node());
        let cfg = &cfg;
        let what = overlap::fingerprint::Fingerprint::of_config(
            cfg,
            "run",
            backend,
            u64::from(steps),
            cfg.run.seed,
        )?;
        let world = overlap::cuda::world(cfg, env, true, what)?;
        let session = Session::cuda(cfg, world.backend.clone())?;
        return run_steps(session, cfg, steps, observe, ckpt, recording, backend).await;
    }
    meet_cpu(cfg, "run", u64::from(steps), cfg.run.seed)?;
    run_steps(
        Session::cpu(cfg)?,
        cfg,
        steps,
        observe,
        ckpt,
        recording,
        backend,
    )
    .await
}

/// The transport a run uses, and whether `auto` chose it: `copy (auto)`.
fn transport_label(cfg: &Config) -> String {
    let name = cfg.plan.schedule.transport.name();
    if cfg.overlap.transport == overlap::config::TransportChoice::Auto {
        format!("{name} (auto)")
    } else {
        name.to_string()
    }
}

/// Runs the steps of `overlap run` on a session and prints a line per step.
async fn run_steps<B: overlap::ops::Backend>(
    mut session: Session<B>,
    cfg: &Config,
    steps: u32,
    observe: &ObserveArgs,
    ckpt: &CheckpointArgs,
    mut recording: observe::Recording,
    backend: &str,
) -> Result<ExitCode, Error> {
    if ckpt.checkpoint.is_some() {
        // Refused before the first step rather than after the steps it would have saved.
        session.check_can_save()?;
    }
    if let Some(dir) = &ckpt.resume {
        let t0 = std::time::Instant::now();
        let loaded = session.load(dir)?;
        if let Some(seed) = loaded.seed.filter(|&s| s != cfg.run.seed) {
            return Err(Error::Usage(format!(
                "--resume {}: the checkpoint's run used seed {seed}, this one {}; pass --seed {seed} to continue it",
                dir.display(),
                cfg.run.seed
            )));
        }
        println!(
            "resumed from {} at step {} (saved on mesh {}, {:.1} ms)",
            loaded.path.display(),
            loaded.step,
            loaded.saved_mesh,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    let start = session.steps_done();
    let last = start + u64::from(steps);
    let planner = session.planner();
    println!(
        "overlap run {}: mesh {} ({} ranks), {} params, {} buckets, gates {}, backend {backend}, transport {}, {steps} steps",
        cfg.source,
        cfg.plan.mesh,
        cfg.plan.mesh.world(),
        planner.params().len(),
        planner.buckets().len(),
        Gate::pattern_label(&cfg.gates),
        transport_label(cfg),
    );
    let local_ranks = session.local_ranks();
    for step in start..last {
        let on = timed(cfg, observe, steps, step - start + 1);
        session.executor().backend().set_timings(on);
        let r = match drive::synthetic_step(&mut session, cfg.run.seed, step, &cfg.gates).await {
            Ok(r) => r,
            Err(e) => return Err(abandon_on_timeout(session, e)),
        };
        let plan = session.step_plan(&r.gates)?;
        recording.step(&r, &plan)?;
        let analysis = observe::StepAnalysis::on_ranks(&r, &plan, &local_ranks);
        let per_node = if r.stats.nodes > 0 {
            r.stats.issue_seconds * 1e6 / r.stats.nodes as f64
        } else {
            0.0
        };
        println!(
            "step {}/{last}  gates {}  nodes {}  wall {:.2} ms  host {:.2} us/node  stage2 {} (saved {})  partials left {}  {}  {}{}",
            r.step,
            Gate::pattern_label(&r.gates),
            r.stats.nodes,
            r.stats.wall_seconds * 1e3,
            per_node,
            bytes(r.stage2_bytes),
            bytes(r.stage2_bytes_saved),
            r.stats.partials_left,
            device_figures(&analysis),
            lr_figures(cfg, &r),
            norm_figures(&r),
        );
        if let Some(dir) = &ckpt.checkpoint {
            if r.step == last || ckpt.save_every.is_some_and(|n| r.step % n == 0) {
                let t0 = std::time::Instant::now();
                let path = session.save_with_seed(dir, cfg.run.seed)?;
                println!(
                    "checkpoint: step {} saved to {} ({:.1} ms)",
                    r.step,
                    path.display(),
                    t0.elapsed().as_secs_f64() * 1e3
                );
            }
        }
        if observe.step_interval_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(observe.step_interval_ms)).await;
        }
    }
    for line in recording.finish()? {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// After a step timed out the device may still be running it (a hung kernel, a
/// collective whose peer is gone): dropping the session would synchronise the device
/// (the CUDA backend does, to free its memory) and so hang the exit. The session is
/// leaked instead and the process exits with the error; the operating system and the
/// driver reclaim the rest. Any other error drops the session as usual.
fn abandon_on_timeout<B: overlap::ops::Backend>(session: Session<B>, e: Error) -> Error {
    if matches!(e, Error::Exec(overlap::executor::ExecError::Timeout { .. })) {
        std::mem::forget(session);
    }
    e
}

/// The learning rate of a step: its factor and the base rates it gives, for the
/// optimizers that have parameters (`lr x0.500 (adamw 5.00e-4, muon 1.00e-2)`).
/// `  grad_norm X` with `[clip]`, and `  skipped (nonfinite)` for a skipped step.
fn norm_figures(r: &overlap::StepReport) -> String {
    let mut out = String::new();
    if let Some(n) = r.grad_norm {
        out.push_str(&format!("  grad_norm {n:.4e}"));
    }
    if let Some(why) = r.skipped {
        out.push_str(&format!("  skipped ({why})"));
    }
    out
}

fn lr_figures(cfg: &Config, r: &overlap::StepReport) -> String {
    use overlap::graph::OptimizerKind;
    let mut rates = Vec::new();
    for (kind, name, base) in [
        (OptimizerKind::Adamw, "adamw", cfg.adamw.lr),
        (OptimizerKind::Muon, "muon", cfg.muon.lr),
    ] {
        if r.lr.iter().any(|g| g.optimizer == kind) {
            rates.push(format!("{name} {:.2e}", f64::from(base) * r.lr_factor));
        }
    }
    format!("lr x{:.3} ({})", r.lr_factor, rates.join(", "))
}

/// Whether step `n` (1-based) of a run of `steps` records kernel timings: one step in
/// `timing_every`, every step for a trace, and the step a picture draws (the last by
/// default). Every rank follows it, whichever of them writes the files.
fn timed(cfg: &Config, observe: &ObserveArgs, steps: u32, n: u64) -> bool {
    let drawn = observe
        .svg
        .as_ref()
        .map(|_| observe.svg_step.unwrap_or(u64::from(steps)));
    observe.trace.is_some() || drawn == Some(n) || cfg.metrics.timed(n)
}

/// The device figures of a step's line; `n/a` on an untimed step, where they were not
/// measured (0 would claim perfect overlap).
fn device_figures(a: &observe::StepAnalysis) -> String {
    if !a.timed() {
        return "exposed comm n/a  overlap n/a (untimed)".into();
    }
    format!(
        "exposed comm {:.2} ms  overlap {}",
        a.exposed_seconds() * 1e3,
        a.efficiency()
            .map_or_else(|| "n/a".into(), |e| format!("{e:.2}")),
    )
}

fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// Prints a verification report (text, or one JSON line) and picks the exit code.
fn print_verify(
    cfg: &Config,
    report: &verify::VerifyReport,
    json: bool,
) -> Result<ExitCode, Error> {
    if json {
        println!(
            "{}",
            serde_json::to_string(report).map_err(|e| Error::Usage(e.to_string()))?
        );
    } else {
        println!(
            "verify {}: mesh {} ({} ranks), gates {}, {} steps",
            cfg.source, cfg.plan.mesh, report.ranks, report.gates, report.steps
        );
        for (route, e) in &report.per_route {
            println!("  {route:<14} worst relative error {e:.3e}");
        }
        println!(
            "  gradients      worst {:.3e} at {} (tolerance {:.0e})",
            report.worst_rel_err, report.worst_at, report.grad_tolerance
        );
        let against = if report.update_rel_err.is_empty() {
            "gated vs no_sync"
        } else {
            "GPU vs CPU backend"
        };
        println!(
            "  parameters     worst {:.3e} {against} (tolerance {:.0e})",
            report.param_rel_err, report.param_tolerance
        );
        for (opt, e) in &report.update_rel_err {
            println!("  {opt:<14} update relative error {e:.3e} (GPU vs CPU backend)");
        }
        println!("  partials left  {}", report.partials_left);
        println!("{}", if report.ok { "OK" } else { "FAILED" });
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Whether a backend choice means the CUDA backend: `cuda`, or `auto` in a build with
/// it, started as a rank of a job (a launcher's variables are set) whose CUDA libraries
/// load.
fn use_cuda(choice: BackendChoice) -> Result<bool, Error> {
    match choice {
        BackendChoice::Cpu => Ok(false),
        BackendChoice::Cuda if cfg!(feature = "cuda") => Ok(true),
        BackendChoice::Cuda => Err(Error::Backend(
            "backend \"cuda\" is not in this build: rebuild with `cargo build --release --features cuda`".into(),
        )),
        BackendChoice::Auto => Ok(auto_cuda()),
    }
}

#[cfg(feature = "cuda")]
fn auto_cuda() -> bool {
    matches!(overlap::dist::RankEnv::from_env(), Ok(Some(_)))
        && overlap::ops::cuda::check_libraries().is_ok()
}

#[cfg(not(feature = "cuda"))]
fn auto_cuda() -> bool {
    false
}

#[cfg(feature = "cuda")]
async fn verify_cuda(cfg: &Config, steps: u64, seed: u64, json: bool) -> Result<ExitCode, Error> {
    let env = overlap::cuda::rank_env(cfg.plan.mesh)?;
    let mut cfg = cfg.clone();
    cfg.settle_transport(env.one_node());
    let cfg = &cfg;
    let what = overlap::fingerprint::Fingerprint::of_config(cfg, "verify", "cuda", steps, seed)?;
    let mut world = overlap::cuda::world(cfg, env, false, what)?;
    let report = overlap::cuda::verify(cfg, steps, seed, &mut world, |s| {
        if !json {
            eprintln!("verify: step {s}/{steps} done");
        }
    })
    .await?;
    match report {
        Some(report) => print_verify(cfg, &report, json),
        None => Ok(ExitCode::SUCCESS),
    }
}

#[cfg(not(feature = "cuda"))]
async fn verify_cuda(_: &Config, _: u64, _: u64, _: bool) -> Result<ExitCode, Error> {
    use_cuda(BackendChoice::Cuda).map(|_| ExitCode::from(2))
}

/// On the CPU backend every process runs the whole mesh; started as ranks of a job
/// (`overlap launch`, torchrun, ...), the processes still meet at the rendezvous and
/// check that they run the same thing, so that a job that would disagree on GPUs
/// disagrees here too.
fn meet_cpu(cfg: &Config, command: &str, steps: u64, seed: u64) -> Result<(), Error> {
    let Some(env) = overlap::dist::RankEnv::from_env()? else {
        return Ok(());
    };
    if env.world_size < 2 {
        return Ok(());
    }
    let what = overlap::fingerprint::Fingerprint::of_config(cfg, command, "cpu", steps, seed)?;
    let timeout = overlap::rendezvous::start_timeout(std::time::Duration::from_secs(180));
    let mut rdv = overlap::rendezvous::Rendezvous::connect(&env, timeout)?;
    rdv.agree(&what, timeout)?;
    if env.rank == 0 {
        eprintln!(
            "rendezvous: {} ranks agree on what they run (fingerprint {})",
            env.world_size,
            &what.digest()[..16]
        );
    }
    Ok(())
}

/// `overlap env`: the detected rank environment, and optionally a rendezvous.
fn env(rendezvous: bool) -> Result<ExitCode, Error> {
    let env = overlap::dist::RankEnv::from_env()?.unwrap_or_else(overlap::dist::RankEnv::single);
    println!(
        "{}",
        serde_json::to_string(&env).map_err(|e| Error::Usage(e.to_string()))?
    );
    if rendezvous {
        let timeout = overlap::rendezvous::start_timeout(std::time::Duration::from_secs(60));
        let mut rdv = overlap::rendezvous::Rendezvous::connect(&env, timeout)?;
        let me = format!("rank {} pid {}", env.rank, std::process::id());
        if let Some(all) = rdv.gather(me.as_bytes(), timeout)? {
            let names: Vec<String> = all
                .iter()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .collect();
            println!(
                "rendezvous: {} ranks arrived: {}",
                all.len(),
                names.join(", ")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "cuda")]
async fn bench_interference(args: &interference::InterferenceArgs) -> Result<ExitCode, Error> {
    let r = interference::run_cuda(args).await?;
    println!(
        "{}",
        serde_json::to_string(&r).map_err(|e| Error::Usage(e.to_string()))?
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "cuda"))]
async fn bench_interference(_: &interference::InterferenceArgs) -> Result<ExitCode, Error> {
    Err(Error::Usage(
        "bench-interference runs on a GPU: build with `--features cuda`".into(),
    ))
}

#[cfg(feature = "cuda")]
async fn cuda_smoke(mib: &str, iters: u32) -> Result<ExitCode, Error> {
    let sizes = mib
        .split(',')
        .map(|m| {
            m.trim()
                .parse::<u64>()
                .map(|m| m << 20)
                .map_err(|_| Error::Usage(format!("--mib: `{m}` is not a whole number of MiB")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let env = overlap::dist::RankEnv::from_env()?.unwrap_or_else(overlap::dist::RankEnv::single);
    let mesh = overlap::Mesh {
        shard: 1,
        replicate: env.world_size,
    };
    let comms = overlap::ops::cuda::mesh_comms(mesh, &overlap::graph::Bindings::default(), false);
    let mut what = overlap::fingerprint::Fingerprint::build();
    what.push("command", "cuda-smoke");
    what.push("cuda_smoke.args", format!("MiB {mib}, iters {iters}"));
    let mut world = overlap::cuda::open(env, mesh, comms, false, Default::default(), what)?;
    let report = smoke::smoke(&mut world, &sizes, iters).await?;
    println!(
        "{}",
        serde_json::to_string(&report).map_err(|e| Error::Usage(e.to_string()))?
    );
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[cfg(not(feature = "cuda"))]
async fn cuda_smoke(_: &str, _: u32) -> Result<ExitCode, Error> {
    use_cuda(BackendChoice::Cuda).map(|_| ExitCode::from(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_every_takes_the_configs_range() {
        assert_eq!(parse_timing_every("1"), Ok(1));
        assert_eq!(parse_timing_every("1000000"), Ok(1_000_000));
        for bad in ["0", "1000001", "-1", "ten", ""] {
            let e = parse_timing_every(bad).unwrap_err();
            assert!(e.contains("between 1 and 1000000"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_trace_times_every_step_and_a_picture_the_step_it_draws() {
        let mut cfg = Config::from_toml(
            include_str!("../../examples/hsdp_2x2.toml"),
            "hsdp_2x2.toml",
        )
        .unwrap();
        cfg.metrics.timing_every = 4;
        let args = |trace: Option<&str>, svg: Option<&str>, svg_step: Option<u64>| ObserveArgs {
            metrics: None,
            timing_every: None,
            trace: trace.map(PathBuf::from),
            svg: svg.map(PathBuf::from),
            svg_step,
            step_interval_ms: 0,
        };
        let timed_of =
            |o: &ObserveArgs| -> Vec<u64> { (1..=10).filter(|&n| timed(&cfg, o, 10, n)).collect() };
        assert_eq!(timed_of(&args(None, None, None)), [1, 5, 9]);
        assert_eq!(timed_of(&args(None, Some("s.svg"), None)), [1, 5, 9, 10]);
        assert_eq!(timed_of(&args(None, Some("s.svg"), Some(6))), [1, 5, 6, 9]);
        assert_eq!(
            timed_of(&args(Some("t.json"), None, None)),
            (1..=10).collect::<Vec<_>>()
        );
    }

    #[test]
    fn an_untimed_step_shows_its_device_figures_as_not_available() {
        let cfg = Config::from_toml(
            include_str!("../../examples/hsdp_2x2.toml"),
            "hsdp_2x2.toml",
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (mut r, plan, local) = rt.block_on(async {
            let mut s = Session::cpu(&cfg).unwrap();
            let r = drive::synthetic_step(&mut s, cfg.run.seed, 0, &cfg.gates)
                .await
                .unwrap();
            (r, s.step_plan(&cfg.gates).unwrap(), s.local_ranks())
        });
        let timed = device_figures(&observe::StepAnalysis::on_ranks(&r, &plan, &local));
        assert!(
            timed.starts_with("exposed comm ")
                && timed.contains(" ms  overlap ")
                && !timed.contains("n/a"),
            "{timed}"
        );
        r.stats.timings.clear();
        assert_eq!(
            device_figures(&observe::StepAnalysis::on_ranks(&r, &plan, &local)),
            "exposed comm n/a  overlap n/a (untimed)"
        );
    }
}
