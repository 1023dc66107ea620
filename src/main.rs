//! The `overlap` command line: wires the libraries together; no logic of its own that a
//! library user would want.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use overlap::config::{BackendChoice, Config};
use overlap::graph::{export, validate, Gate, Mode, Plan, Planner};
use overlap::{drive, verify, Error, Session};

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
        #[arg(long)]
        steps: Option<u32>,
        /// Backend (overrides `run.backend`): auto, cpu or cuda.
        #[arg(long)]
        backend: Option<BackendChoice>,
        /// Seed of the synthetic gradients (overrides `run.seed`).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Run the gated schedule and the no_sync reference side by side and compare what
    /// every optimizer consumes; exits 0 only when every comparison is within tolerance.
    Verify {
        /// The config file (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Steps to run (overrides `run.steps`).
        #[arg(long)]
        steps: Option<u32>,
        /// Seed (overrides `run.seed`).
        #[arg(long)]
        seed: Option<u64>,
        /// End with one JSON line: ok, worst_rel_err, per_route, partials_left, steps, ranks, ...
        #[arg(long)]
        json: bool,
    },
    /// Print the lowered plan of one step.
    Plan {
        /// The config file (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        /// Gate pattern, e.g. `no_sync,off,on` (default: the config's).
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
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Dot,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
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
        } => {
            let mut cfg = load(&config)?;
            if let Some(b) = backend {
                cfg.run.backend = b;
            }
            if let Some(s) = seed {
                cfg.run.seed = s;
            }
            run(&cfg, steps.unwrap_or(cfg.run.steps)).await
        }
        Command::Verify {
            config,
            steps,
            seed,
            json,
        } => {
            let cfg = load(&config)?;
            let steps = u64::from(steps.unwrap_or(cfg.run.steps));
            let seed = seed.unwrap_or(cfg.run.seed);
            let report = verify::verify(&cfg, steps, seed, |s| {
                if !json {
                    eprintln!("verify: step {s}/{steps} done");
                }
            })
            .await?;
            if !json {
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
                println!(
                    "  parameters     worst {:.3e} gated vs no_sync (tolerance {:.0e})",
                    report.param_rel_err, report.param_tolerance
                );
                println!("  partials left  {}", report.partials_left);
                println!("{}", if report.ok { "OK" } else { "FAILED" });
            } else {
                println!(
                    "{}",
                    serde_json::to_string(&report).map_err(|e| Error::Usage(e.to_string()))?
                );
            }
            Ok(if report.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
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
                    eprintln!("{name}: {x}");
                }
                Ok(ExitCode::from(1))
            }
        }
    }
}

fn parse_gates(s: &str) -> Result<Vec<Gate>, Error> {
    s.split(',')
        .map(|g| Gate::parse(g.trim()).map_err(|e| Error::Usage(format!("--gates: {e}"))))
        .collect()
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

async fn run(cfg: &Config, steps: u32) -> Result<ExitCode, Error> {
    let backend = match cfg.run.backend {
        BackendChoice::Cuda => {
            return Err(Error::Backend(
                "backend \"cuda\" is not in this build: rebuild with `--features cuda`".into(),
            ));
        }
        BackendChoice::Auto | BackendChoice::Cpu => "cpu",
    };
    let mut session = Session::cpu(cfg)?;
    let planner = session.planner();
    println!(
        "overlap run {}: mesh {} ({} ranks), {} params, {} buckets, gates {}, backend {backend}, {steps} steps",
        cfg.source,
        cfg.plan.mesh,
        cfg.plan.mesh.world(),
        planner.params().len(),
        planner.buckets().len(),
        Gate::pattern_label(&cfg.gates),
    );
    for step in 0..u64::from(steps) {
        let r = drive::synthetic_step(&mut session, cfg.run.seed, step, &cfg.gates).await?;
        let per_node = if r.stats.nodes > 0 {
            r.stats.issue_seconds * 1e6 / r.stats.nodes as f64
        } else {
            0.0
        };
        println!(
            "step {}/{steps}  gates {}  nodes {}  wall {:.2} ms  host {:.2} us/node  stage2 {} (saved {})  partials left {}",
            r.step,
            Gate::pattern_label(&r.gates),
            r.stats.nodes,
            r.stats.wall_seconds * 1e3,
            per_node,
            bytes(r.stage2_bytes),
            bytes(r.stage2_bytes_saved),
            r.stats.partials_left
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}
