//! `overlap simulate`: what `overlap bench` (or a config's step) would measure on the
//! hardware a profile describes, predicted by the discrete-event simulation of the lowered
//! plan (`overlap_sim::simulate`, `docs/simulate.md`), with no device.
//!
//! The bench workload's four variants are simulated as `overlap bench` runs them: the
//! GEMMs alone (`compute_only`), the plan with markers for the backward (`comm_only`),
//! the plan with every node on the compute stream (`serial`) and the plan as configured
//! (`overlap`), each figure the span of one rank's step; `ideal` and `eta` follow
//! `bench::ideal_ms` and `bench::eta`. A config's step is simulated the same way, its
//! backward per layer the config's `run.backward_us_per_layer` (when above 0) or the
//! profile's. Exposed communication and busy time per stream are the observe module's
//! figures (`overlap::observe::StepAnalysis`) over the predicted timings, and `--svg`
//! draws them with the renderer of a measured step.
//!
//! Invariant: the output is a pure function of the arguments, the config and the profile
//! (the simulation's own run time is printed in the text form only).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use overlap::config::Config;
use overlap::observe::StepAnalysis;
use overlap::session::StepReport;
use overlap::{Error, Mesh};
use overlap_graph::{Bindings, Gate, Mode, Plan, Planner, Stream};
use overlap_ops::{Tag, Timing};
use overlap_sim::simulate::{self, Backward, CopyRing, Options, Profile, Simulation, Stage1Window};
use serde::Serialize;

use crate::bench::{self, BenchArgs};

/// `overlap simulate`'s arguments.
#[derive(clap::Args)]
pub(crate) struct SimulateArgs {
    /// The hardware profile (TOML; `hardware/h200-nvlink.toml`, docs/simulate.md).
    #[arg(long)]
    pub(crate) hardware: PathBuf,
    /// Simulate this config's step instead of the bench workload (the workload flags
    /// then stay at their defaults).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// With --config: the gate pattern, e.g. `off*7,on` (default: the config's).
    #[arg(long, requires = "config")]
    pub(crate) gates: Option<String>,
    /// The bench workload (`overlap bench`'s flags; --iters and --warmup do not change
    /// a simulation).
    #[command(flatten)]
    pub(crate) bench: BenchArgs,
    /// Report this rank's figures (and draw its streams).
    #[arg(long, default_value_t = 0)]
    pub(crate) rank: u32,
    /// Print one JSON line (the fields of `overlap bench --json` that a simulation has,
    /// and the exposed communication and busy time per stream).
    #[arg(long)]
    pub(crate) json: bool,
    /// Draw the predicted `overlap` step as an SVG Gantt picture (the renderer of
    /// `overlap run --svg` and `overlap bench --timeline`).
    #[arg(long, value_name = "FILE")]
    pub(crate) svg: Option<PathBuf>,
}

/// What `overlap simulate` prints.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SimReport {
    /// `bench` or the config file.
    pub workload: String,
    /// The profile's name.
    pub hardware: String,
    /// The bench workload's flags (absent for a config).
    #[serde(flatten)]
    pub args: Option<BenchArgs>,
    /// Ranks in the mesh.
    pub world: u32,
    /// The transport the plan uses.
    pub plan_transport: &'static str,
    /// Gates of the step.
    pub gates: String,
    /// The rank reported.
    pub rank: u32,
    /// `simulated`.
    pub backend: &'static str,
    /// What `overlap bench` prints: the four variants, the ideal and η.
    #[serde(flatten)]
    pub figures: bench::StepFigures,
    /// Communication while the compute stream idles, in the `overlap` step.
    pub exposed_comm_ms: f64,
    /// Busy time per stream in the `overlap` step.
    pub busy_ms: BTreeMap<&'static str, f64>,
    /// Nodes of the rank's step.
    pub nodes_per_step: usize,
    /// Layers `L` of a config's plan (the bench's is its `layers` flag).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<u32>,
    /// Host time the three simulations took (`comm_only`, `serial`, `overlap`), ms (text
    /// output only: not deterministic).
    #[serde(skip)]
    pub simulate_wall_ms: f64,
    #[serde(skip)]
    svg: Option<String>,
}

fn usage(e: impl std::fmt::Display) -> Error {
    Error::Usage(e.to_string())
}

/// The plans and options of one simulation: the `overlap` and `serial` plans, the
/// backward, the rings.
struct Workload {
    name: String,
    args: Option<BenchArgs>,
    plan: Arc<Plan>,
    serial: Arc<Plan>,
    backward: Backward,
    compute_ms_per_grad: f64,
    ring: CopyRing,
    aliasing: bool,
    /// Stage-1 buffers in flight per rank (`--window`, `[overlap] stage1_window`).
    window: u32,
    /// Per parameter, Muon's Newton–Schulz precision and iterations (a config's groups;
    /// empty for the bench workload: the defaults).
    newton_schulz: Vec<(overlap::NsDtype, u32)>,
}

/// Runs `overlap simulate`.
pub(crate) fn run(a: &SimulateArgs) -> Result<ExitCode, Error> {
    let profile = overlap_sim::hardware::from_file(&a.hardware).map_err(usage)?;
    let w = match &a.config {
        Some(path) => config_workload(a, path, &profile)?,
        None => bench_workload(&a.bench, &profile)?,
    };
    let r = report(a, &w, &profile)?;
    if let (Some(path), Some(svg)) = (&a.svg, &r.svg) {
        std::fs::write(path, svg)
            .map_err(|e| usage(format!("--svg: cannot write {}: {e}", path.display())))?;
    }
    if a.json {
        println!("{}", serde_json::to_string(&r).map_err(usage)?);
    } else {
        println!("{}", render(&r));
    }
    Ok(ExitCode::SUCCESS)
}

fn bench_workload(b: &BenchArgs, p: &Profile) -> Result<Workload, Error> {
    b.check()?;
    let plan = bench::bench_plan(b, Bindings::default())?.plan().clone();
    let serial = bench::bench_plan(b, bench::serial_bindings())?
        .plan()
        .clone();
    let backward = Backward::Gemms {
        count: b.gemms,
        d: b.d,
    };
    Ok(Workload {
        name: "bench".into(),
        args: Some(*b),
        plan,
        serial,
        backward,
        compute_ms_per_grad: f64::from(b.gemms) * 2.0 * f64::from(b.d).powi(3)
            / (p.gemm_tflops * 1e12)
            * 1e3,
        ring: CopyRing {
            slot_bytes: u64::from(b.copy_slot_mib) << 20,
            depth: b.copy_ring_depth,
            in_place: !b.no_in_place,
        },
        aliasing: !b.no_alias,
        // As the bench hands it to the executor.
        window: b.window.max(1),
        newton_schulz: Vec::new(),
    })
}

fn config_workload(
    a: &SimulateArgs,
    path: &std::path::Path,
    p: &Profile,
) -> Result<Workload, Error> {
    if a.bench != BenchArgs::new(Mesh::new(2, 1).expect("2x1 is a mesh")) {
        return Err(usage(
            "--config describes the workload: the bench flags (--mesh, --layers, --transport, ...) do not apply to it",
        ));
    }
    let mut cfg = Config::from_file(path)?;
    // `auto` as a GPU job would settle it: the copy transport when the mesh fits one node.
    cfg.settle_transport(cfg.plan.mesh.world() <= p.gpus_per_node);
    let gates = match &a.gates {
        Some(g) => Gate::parse_pattern(g).map_err(|e| usage(format!("--gates: {e}")))?,
        None => cfg.gates.clone(),
    };
    let planned = |bindings: Option<Bindings>| -> Result<Arc<Plan>, Error> {
        let mut spec = cfg.plan.clone();
        if let Some(b) = bindings {
            spec.bindings = b;
        }
        let planner = Planner::new(spec)?;
        planner.check_step(gates.len())?;
        Ok(planner.plan_checked(&gates, Mode::Step)?.plan().clone())
    };
    let backward_us = cfg.run.backward_us_per_layer;
    let backward = if backward_us > 0 {
        Backward::Seconds(f64::from(backward_us) * 1e-6)
    } else {
        Backward::Profile
    };
    let per_grad_ms = if backward_us > 0 {
        f64::from(backward_us) * 1e-3
    } else {
        p.backward_us_per_layer * 1e-3
    };
    Ok(Workload {
        name: path.display().to_string(),
        args: None,
        plan: planned(None)?,
        serial: planned(Some(bench::serial_bindings()))?,
        backward,
        compute_ms_per_grad: per_grad_ms,
        ring: CopyRing {
            slot_bytes: u64::from(cfg.overlap.copy_slot_mib) << 20,
            depth: cfg.overlap.copy_ring_depth,
            in_place: true,
        },
        aliasing: true,
        window: cfg.overlap.stage1_window,
        newton_schulz: cfg.newton_schulz(),
    })
}

fn options(plan: &Arc<Plan>, w: &Workload, backward: Backward) -> Options {
    Options {
        backward,
        aliased: if w.aliasing {
            (0..plan.mesh.world())
                .map(|r| overlap_executor::aliased_nodes(plan, r))
                .collect()
        } else {
            Vec::new()
        },
        copy: w.ring,
        stage1: Some(Stage1Window {
            window: w.window,
            releases: (0..plan.mesh.world())
                .map(|r| overlap_executor::stage1_releases(plan, r, w.aliasing))
                .collect(),
        }),
        newton_schulz: w.newton_schulz.clone(),
    }
}

fn sim(plan: &Arc<Plan>, p: &Profile, o: &Options) -> Result<Simulation, Error> {
    simulate::simulate(plan, p, o).map_err(usage)
}

/// The simulated step of `plan` as a report the observe module reads (rank `rank`'s
/// nodes as kernel timings).
fn step_report(plan: &Plan, s: &Simulation, rank: u32) -> StepReport {
    let timings = plan.ranks[rank as usize]
        .nodes
        .iter()
        .map(|n| {
            let t = s.node(rank, n.id);
            Timing {
                rank,
                stream: n.stream,
                tag: Tag {
                    node: n.id,
                    op: n.op.kind(),
                    micro_batch: n.micro_batch.unwrap_or(u32::MAX),
                },
                start: t.start,
                end: t.end,
                bytes: n
                    .op
                    .collective()
                    .map_or(0, |c| overlap::observe::collective_bytes(plan, c)),
            }
        })
        .collect();
    StepReport::of_stats(
        plan.gates.clone(),
        overlap::StepStats {
            nodes: plan.ranks[rank as usize].nodes.len(),
            timings,
            ..Default::default()
        },
    )
}

fn report(a: &SimulateArgs, w: &Workload, p: &Profile) -> Result<SimReport, Error> {
    let world = w.plan.mesh.world();
    if a.rank >= world {
        return Err(usage(format!(
            "--rank {}: the mesh has ranks 0 to {}",
            a.rank,
            world - 1
        )));
    }
    let plan_options = options(&w.plan, w, w.backward);
    let serial_options = options(&w.serial, w, w.backward);
    let comm_options = Options {
        backward: Backward::None,
        ..plan_options.clone()
    };
    let t0 = Instant::now();
    let comm = sim(&w.plan, p, &comm_options)?;
    let serial = sim(&w.serial, p, &serial_options)?;
    let over = sim(&w.plan, p, &plan_options)?;
    let wall = t0.elapsed().as_secs_f64() * 1e3;
    let r = a.rank;
    let grads = w.plan.ranks[r as usize]
        .nodes
        .iter()
        .filter(|n| matches!(n.op, overlap_graph::Op::GradReady { .. }))
        .count();
    let layers = w.plan.layers_desc().len() as u32;
    let compute = grads as f64 * w.compute_ms_per_grad;
    let comm_ms = comm.span(r) * 1e3;
    let figures = bench::StepFigures::new(
        compute,
        comm_ms,
        serial.span(r) * 1e3,
        over.span(r) * 1e3,
        layers,
    );
    let step = step_report(&w.plan, &over, r);
    let analysis = StepAnalysis::new(&step, &w.plan);
    let busy_ms = Stream::ALL
        .into_iter()
        // `+ 0.0`: an idle stream reads 0, not −0.
        .map(|s| (s.name(), analysis.busy_seconds(s) * 1e3 + 0.0))
        .collect();
    Ok(SimReport {
        workload: w.name.clone(),
        hardware: p.name.clone(),
        args: w.args,
        world,
        plan_transport: transport(&w.plan),
        gates: Gate::pattern_label(&w.plan.gates),
        rank: r,
        backend: "simulated",
        figures,
        exposed_comm_ms: analysis.exposed_seconds() * 1e3,
        busy_ms,
        nodes_per_step: w.plan.ranks[r as usize].nodes.len(),
        layers: w.args.is_none().then_some(layers),
        simulate_wall_ms: wall,
        svg: a
            .svg
            .as_ref()
            .map(|_| predicted_svg(&step, &w.plan, &analysis, p)),
    })
}

/// The transport a plan runs on: `copy` when it exchanges, else `nccl`.
fn transport(plan: &Plan) -> &'static str {
    let exchanges = plan
        .ranks
        .iter()
        .flat_map(|rp| &rp.nodes)
        .any(|n| matches!(n.op, overlap_graph::Op::Exchange { .. }));
    if exchanges {
        "copy"
    } else {
        "nccl"
    }
}

/// The timeline of a predicted step: the renderer of a measured step, its title saying
/// what this one is.
fn predicted_svg(step: &StepReport, plan: &Plan, analysis: &StepAnalysis, p: &Profile) -> String {
    overlap::observe::svg::render(step, plan, analysis).replacen(
        ">overlap · step 1 · ",
        &format!(
            ">overlap simulate · predicted on {} · ",
            overlap::observe::svg::escape(&p.name)
        ),
        1,
    )
}

/// The human-readable form.
fn render(r: &SimReport) -> String {
    let busy: Vec<String> = r
        .busy_ms
        .iter()
        .filter(|(_, &v)| v > 0.0)
        .map(|(k, v)| format!("{k} {v:.3}"))
        .collect();
    let workload = match &r.args {
        Some(b) => format!(
            "bench: mesh {}, {} layers, {} MiB f32 grad/layer, {} GEMMs of {}^3/layer, transport {}",
            b.mesh,
            b.layers,
            b.grad_mib,
            b.gemms,
            b.d,
            b.transport.name()
        ),
        None => format!(
            "{}: {} ranks, gates {}, transport {}",
            r.workload, r.world, r.gates, r.plan_transport
        ),
    };
    format!(
        "overlap simulate ({workload}) on {} (rank {}, {} nodes, simulated in {:.1} ms)\n\
         {}\n\
         exposed communication {:.3} ms; busy ms: {}",
        r.hardware,
        r.rank,
        r.nodes_per_step,
        r.simulate_wall_ms,
        r.figures,
        r.exposed_comm_ms,
        busy.join(", ")
    )
}
