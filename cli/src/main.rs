//! The `overlap` command line: wires the libraries together; no logic of its own that a
//! library user would want. The GPU benchmarks (`bench`, `bench-collectives`,
//! `bench-interference`, `cuda-smoke`), the GPU calibration of hardware profiles
//! (`calibrate`) and the launcher live here too, so that a trainer
//! linking the `overlap` library pays for none of them.

mod args;
mod bench;
mod bench_optim;
mod calibrate;
// The GPU side of every command: `cuda/` with the `cuda` feature, else `cuda_stub.rs`,
// the same entry points returning the error that says how to get a CUDA build.
#[cfg_attr(not(feature = "cuda"), path = "cuda_stub.rs")]
mod cuda;
mod gpu;
mod host_kinds;
mod interference;
mod job;
mod launch;
mod run;
mod simulate;
mod tune;
mod verify;

use std::path::Path;
use std::process::ExitCode;

use clap::Parser;
use overlap::config::{BackendChoice, Config, Overrides, TransportChoice};
use overlap::graph::{export, validate, Gate, Mode, Plan, Planner};
use overlap::Error;

use args::{parse_gates, parse_ranks};
use args::{CheckpointArgs, Cli, Command, Format, ObserveArgs, TransportArg, WireDType};
use gpu::{bench_interference, env};
use verify::{print_verify, use_cuda, verify_cpu_job};

/// `overlap bench-optimizer`: the report as text or JSON.
fn bench_optimizer(args: &bench_optim::BenchOptimizerArgs) -> Result<ExitCode, Error> {
    let r = cuda::bench_optimizer(args)?;
    if args.json {
        let line = serde_json::to_string(&r).map_err(|e| Error::Usage(e.to_string()))?;
        println!("{line}");
    } else {
        print!("{}", bench_optim::render(&r));
    }
    Ok(ExitCode::SUCCESS)
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
            // After a timeout or another rank's failure the device may still run (or
            // wait in) kernels that never end.
            if matches!(
                e,
                Error::Exec(
                    overlap::executor::ExecError::Timeout { .. }
                        | overlap::executor::ExecError::PeerFailed { .. }
                )
            ) {
                exit_now(2);
            }
            ExitCode::from(2)
        }
    }
}

/// Ends the process at once, without exit handlers or destructors: after a timed-out
/// step the device may still run a kernel that never ends, and the CUDA driver's and
/// NCCL's exit handlers wait for the device. The kernel ends with the process.
pub(crate) fn exit_now(code: i32) -> ! {
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

/// Runs one subcommand: each arm hands the command's arguments to the function that
/// carries it out.
async fn dispatch(cmd: Command) -> Result<ExitCode, Error> {
    match cmd {
        Command::Run {
            config,
            steps,
            backend,
            seed,
            observe,
            checkpoint,
        } => run_steps(&config, steps, backend, seed, &observe, &checkpoint).await,
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
            let cfg = verify_config(&config, transport, gates.as_deref(), dtype, backend)?;
            verify_steps(&cfg, steps, seed, json).await
        }
        Command::Launch {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            max_restarts,
            args,
        } => launch_ranks(
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            max_restarts,
            args,
        ),
        Command::Env { rendezvous } => env(rendezvous),
        Command::BenchInterference { args } => bench_interference(&args).await,
        Command::Simulate { args } => simulate::run(&args),
        Command::Tune { args } => tune::run(&args),
        Command::Calibrate { args } => calibrate::run(&args).await,
        Command::Bench {
            args,
            timeline,
            json,
        } => bench_step(args, timeline.as_deref(), json).await,
        Command::BenchCollectives {
            mesh,
            mib,
            iters,
            warmup,
        } => bench_collectives(&mesh, &mib, iters, warmup).await,
        Command::CudaSmoke { mib, iters } => cuda::smoke(&mib, iters).await,
        Command::BenchOptimizer { args } => bench_optimizer(&args),
        Command::Plan {
            config,
            format,
            gates,
            ranks,
        } => print_plan(&config, format, gates.as_deref(), ranks.as_deref()),
        Command::Check { plan } => check_plan(&plan),
    }
}

/// `overlap run`: the config with the command line's overrides, run for its steps.
async fn run_steps(
    config: &Path,
    steps: Option<u32>,
    backend: Option<BackendChoice>,
    seed: Option<u64>,
    observe: &ObserveArgs,
    checkpoint: &CheckpointArgs,
) -> Result<ExitCode, Error> {
    let mut cfg = load(config)?;
    cfg.apply(
        &Overrides::none()
            .with_backend(backend)
            .with_seed(seed)
            .with_metrics_listen(observe.metrics)
            .with_timing_every(observe.timing_every),
    )?;
    run::run(&cfg, steps.unwrap_or(cfg.run.steps), observe, checkpoint).await
}

/// `overlap verify`'s config: the file with the transport, gates, wire dtype and
/// backend the command line overrides.
fn verify_config(
    config: &Path,
    transport: Option<TransportArg>,
    gates: Option<&str>,
    dtype: Option<WireDType>,
    backend: Option<BackendChoice>,
) -> Result<Config, Error> {
    let mut cfg = load(config)?;
    let transport = transport.map(|t| match t {
        TransportArg::Nccl => TransportChoice::Nccl,
        TransportArg::Copy => TransportChoice::Copy,
    });
    let dtype = dtype.map(|d| match d {
        WireDType::F32 => overlap::graph::DType::F32,
        WireDType::Bf16 => overlap::graph::DType::Bf16,
    });
    cfg.apply(
        &Overrides::none()
            .with_transport(transport)
            .with_gates(gates.map(parse_gates).transpose()?)
            .with_wire_dtype(dtype)
            .with_backend(backend),
    )?;
    Ok(cfg)
}

/// `overlap verify`: the steps run on the config's backend and compared with the serial
/// reference, reported as text or JSON.
async fn verify_steps(
    cfg: &Config,
    steps: Option<u32>,
    seed: Option<u64>,
    json: bool,
) -> Result<ExitCode, Error> {
    let steps = u64::from(steps.unwrap_or(cfg.run.steps));
    let seed = seed.unwrap_or(cfg.run.seed);
    // Before any job forms: a malformed fault variable is refused here.
    let faults = overlap::faults::Faults::from_env()?;
    if use_cuda(cfg.run.backend)? {
        return cuda::verify(cfg, (steps, seed), &faults, json).await;
    }
    // The processes of a CPU job each verify their rank.
    if let Some(code) = verify_cpu_job(cfg, (steps, seed), &faults, json).await? {
        return Ok(code);
    }
    let report = overlap::verify::verify_with_faults(cfg, steps, seed, &faults, |s| {
        if !json {
            eprintln!("verify: step {s}/{steps} done");
        }
    })
    .await?;
    print_verify(cfg, &report, json)
}

/// `overlap launch`: starts the ranks of this node and waits for them.
fn launch_ranks(
    nproc_per_node: u32,
    nnodes: u32,
    node_rank: u32,
    master_addr: String,
    master_port: u16,
    max_restarts: u32,
    args: Vec<std::ffi::OsString>,
) -> Result<ExitCode, Error> {
    let subcommands: Vec<String> = <Cli as clap::CommandFactory>::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    let spec = launch::LaunchSpec {
        nproc_per_node,
        nnodes,
        node_rank,
        master_addr,
        master_port,
        program: launch::program_of(&args, &subcommands),
        max_restarts,
        args,
    };
    Ok(ExitCode::from(launch::launch(&spec)?))
}

/// `overlap bench`: the benchmark's report as text or JSON, and its timeline written
/// where `--timeline` says.
async fn bench_step(
    mut args: bench::BenchArgs,
    timeline: Option<&Path>,
    json: bool,
) -> Result<ExitCode, Error> {
    args.timeline = timeline.is_some();
    args.check()?;
    if let Some(r) = cuda::bench(&args).await? {
        if let (Some(path), Some(svg), Some(lines)) = (timeline, &r.timeline_svg, &r.timeline_json)
        {
            write_timeline(path, svg)?;
            write_timeline(&path.with_extension("jsonl"), lines)?;
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

/// Writes one file of `overlap bench --timeline`.
fn write_timeline(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text)
        .map_err(|e| Error::Usage(format!("--timeline: cannot write {}: {e}", path.display())))
}

/// `overlap bench-collectives`: one JSON line per collective and size.
async fn bench_collectives(
    mesh: &str,
    mib: &str,
    iters: u32,
    warmup: u32,
) -> Result<ExitCode, Error> {
    let mesh = bench::parse_mesh(mesh)?;
    let sizes = mib
        .split(',')
        .map(|m| {
            m.trim()
                .parse::<u32>()
                .map_err(|_| Error::Usage(format!("--mib: `{m}` is not a whole number of MiB")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(rows) = cuda::collectives(mesh, &sizes, iters, warmup).await? {
        for r in rows {
            println!(
                "{}",
                serde_json::to_string(&r).map_err(|e| Error::Usage(e.to_string()))?
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `overlap plan`: the config's checked plan for a gate pattern, as text (with the
/// optimizers and memory), DOT or JSON, optionally for some ranks only.
fn print_plan(
    config: &Path,
    format: Format,
    gates: Option<&str>,
    ranks: Option<&str>,
) -> Result<ExitCode, Error> {
    let cfg = load(config)?;
    let gates = match gates {
        Some(g) => parse_gates(g)?,
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
    let plan = planner.plan_checked(&gates, Mode::Step)?;
    let ranks = ranks
        .map(|r| parse_ranks(r, plan.mesh.world()))
        .transpose()?;
    match format {
        Format::Json => println!("{}", plan.to_json()),
        Format::Dot => print!("{}", export::to_dot(&plan, ranks.as_deref())),
        Format::Text => {
            let mut p = Plan::clone(&plan);
            if let Some(rs) = &ranks {
                p.ranks.retain(|r| rs.contains(&r.rank));
            }
            print!("{}", export::to_text(&p));
            print!("{}", cfg.optimizer_text());
            let shown: Vec<u32> = p.ranks.iter().map(|r| r.rank).collect();
            print!("{}", export::memory_text(&plan, &shown));
            print!("{}", optimizer_time_text(&planner, &shown));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Each shown rank's optimizer time as the owner balance weighs it
/// ([`overlap::graph::owner`]): the updates it owns, its share of the sharded routes,
/// and the largest over the mean of all ranks.
fn optimizer_time_text(planner: &Planner, shown: &[u32]) -> String {
    use overlap::graph::owner::optimizer_seconds;
    let spec = planner.spec();
    let params: Vec<_> = planner.params().iter().map(|p| p.spec.clone()).collect();
    let owners: Vec<_> = planner.params().iter().map(|p| p.owner).collect();
    let t = optimizer_seconds(spec.mesh, &params, &owners, spec.update_rates);
    let mean = t.iter().sum::<f64>() / t.len().max(1) as f64;
    let max = t.iter().cloned().fold(0.0, f64::max);
    let mut out = format!(
        "optimizer time per rank (owners balanced by it; Newton–Schulz at {} TFLOP/s, memory at {} GB/s; ms):\n",
        spec.update_rates.ns_gflops / 1000,
        spec.update_rates.memory_gbs
    );
    for &r in shown {
        let owned = owners
            .iter()
            .filter(|o| o.is_some_and(|c| spec.mesh.rank(c) == r))
            .count();
        out.push_str(&format!(
            "  rank {r}: {:.3} ({owned} owned updates)\n",
            t[r as usize] * 1e3
        ));
    }
    let ratio = if mean > 0.0 { max / mean } else { 1.0 };
    out.push_str(&format!(
        "  max {:.3}, mean {:.3}, max/mean {ratio:.3}\n",
        max * 1e3,
        mean * 1e3
    ));
    out
}

/// `overlap check`: validates a plan file, printing each violated invariant; exit code 1
/// when there is one.
fn check_plan(path: &Path) -> Result<ExitCode, Error> {
    let name = path.display().to_string();
    let limit = overlap::resources::MAX_PLAN_BYTES;
    let text = overlap::resources::read_text_bounded(path, limit).map_err(|source| Error::Io {
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
