//! `overlap run`: the configured steps with seeded synthetic gradients, a line per step,
//! and what `--metrics/--trace/--svg/--checkpoint` ask for.

use std::process::ExitCode;

use overlap::checkpoint::{SaveJob, SaveTicket, Saved};
use overlap::config::{Config, GradSource};
use overlap::faults::Faults;
use overlap::graph::Gate;
use overlap::{drive, observe, Error, Session};

use crate::args::{CheckpointArgs, ObserveArgs};
use crate::host_kinds::HostKinds;
use crate::job::{cpu_world, end_job, watch_host, watch_job};
use crate::verify::use_cuda;

pub(crate) async fn run(
    cfg: &Config,
    steps: u32,
    observe: &ObserveArgs,
    ckpt: &CheckpointArgs,
) -> Result<ExitCode, Error> {
    let cuda = use_cuda(cfg.run.backend)?;
    // Before anything else: a malformed fault variable is refused here.
    let faults = Faults::from_env()?;
    if !cuda && overlap_dist::cpu::rank_env(cfg.plan.mesh)?.is_none() {
        // Before any file, listener or thread: the rank limit and the memory estimate
        // (a process of a job checks its own when the ranks meet, `cpu_world`).
        overlap::resources::check_cpu(cfg, 1)?;
    }
    // In a multi-process job only rank 0 writes the trace and picture, and each rank
    // serves metrics on the base port plus its local rank.
    let rank_env = overlap_dist::env::RankEnv::from_env()?;
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
    if cuda {
        return crate::cuda::run(cfg, (steps, faults), observe, ckpt, recording).await;
    }
    let Some(mut world) = cpu_world(cfg, "run", (u64::from(steps), cfg.run.seed), 1)? else {
        // One process: every rank of the mesh in it.
        let mut session = Session::cpu(cfg)?;
        session.inject_faults(faults);
        watch_host(session.step_deadline())?;
        return run_steps(session, cfg, steps, observe, ckpt, recording, "cpu").await;
    };
    let mut session = overlap_dist::cpu::session(cfg, &world)?;
    session.inject_faults(faults);
    share_save_job(Some(&mut world.rendezvous), &mut session)?;
    watch_job(Some(&mut world.rendezvous), session.peer_abort())?;
    watch_host(session.step_deadline())?;
    let result = run_steps(session, cfg, steps, observe, ckpt, recording, "cpu").await;
    end_job(Some(&world.rendezvous), &result);
    result
}

/// The transport a run uses, and whether `auto` chose it: `copy (auto)`.
pub(crate) fn transport_label(cfg: &Config) -> String {
    let name = cfg.plan.schedule.transport.name();
    if cfg.overlap.transport == overlap::config::TransportChoice::Auto {
        format!("{name} (auto)")
    } else {
        name.to_string()
    }
}

/// Gives every process of a job the same [`SaveJob`] (rank 0 draws its id and sends it
/// to the others), so that their checkpoint saves meet in one partial directory that no
/// earlier job wrote (`docs/checkpoints.md`). Outside a job there is nothing to share.
pub(crate) fn share_save_job<B: overlap::ops::Backend>(
    rdv: Option<&mut overlap_dist::rendezvous::Rendezvous>,
    session: &mut Session<B>,
) -> Result<(), Error> {
    let Some(rdv) = rdv else {
        return Ok(());
    };
    let timeout = overlap_dist::rendezvous::start_timeout(std::time::Duration::from_secs(180))?;
    let got = rdv.broadcast(&SaveJob::fresh().id.to_le_bytes(), timeout)?;
    let id = <[u8; 8]>::try_from(got.as_slice()).map_err(|_| {
        Error::Usage(format!(
            "rank 0 sent a checkpoint job id of {} bytes, not 8",
            got.len()
        ))
    })?;
    session.set_save_job(SaveJob::new(u64::from_le_bytes(id)));
    Ok(())
}

/// Runs the steps of `overlap run` on a session and prints a line per step.
pub(crate) async fn run_steps<B: overlap::ops::Backend>(
    mut session: Session<B>,
    cfg: &Config,
    steps: u32,
    observe: &ObserveArgs,
    ckpt: &CheckpointArgs,
    mut recording: observe::Recording,
    backend: &str,
) -> Result<ExitCode, Error> {
    let saves = Saves::new(&session, ckpt)?;
    let (start, steps) = resume_point(&mut session, cfg, ckpt, steps)?;
    let last = start + u64::from(steps);
    println!(
        "overlap run {}: mesh {} ({} ranks), {} params, {} buckets, gates {}, backend {backend}, transport {}, {steps} steps{}",
        cfg.source,
        cfg.plan.mesh,
        cfg.plan.mesh.world(),
        session.params().len(),
        session.buckets().len(),
        Gate::pattern_label(&cfg.gates),
        transport_label(cfg),
        match cfg.run.grads {
            GradSource::Host => "",
            GradSource::Device => ", gradients on the device",
        },
    );
    let local_ranks = session.local_ranks();
    let mut host = HostKinds::default();
    let device_grads = match cfg.run.grads {
        GradSource::Host => None,
        GradSource::Device => Some(drive::DeviceGrads::new(
            &session,
            cfg.run.seed,
            cfg.gates.len(),
        )?),
    };
    for step in start..last {
        let on = timed(cfg, observe, steps, step - start + 1);
        session.backend().set_timings(on);
        let stepped = match &device_grads {
            Some(g) => drive::device_step(&mut session, g, &cfg.gates).await,
            None => drive::synthetic_step(&mut session, cfg.run.seed, step, &cfg.gates).await,
        };
        let r = match stepped {
            Ok(r) => r,
            Err(e) => return Err(abandon_if_stuck(session, e)),
        };
        let plan = session.step_plan(&r.gates)?;
        recording.step(&r, &plan)?;
        host.add(&r.stats);
        let analysis = observe::StepAnalysis::on_ranks(&r, &plan, &local_ranks);
        let ticket = saves.after_step(&session, cfg, r.step, last)?;
        if let Some(t) = &ticket {
            saves.report(t.previous.clone());
        }
        println!(
            "{}{}",
            step_line(cfg, &r, last, &analysis),
            ticket.as_ref().map_or_else(String::new, save_figures)
        );
        saves.report(session.poll_save()?);
        if observe.step_interval_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(observe.step_interval_ms)).await;
        }
    }
    for line in host.table() {
        println!("{line}");
    }
    saves.report(session.wait_for_saves()?);
    for line in recording.finish()? {
        println!("{line}");
    }
    if observe.param_digest {
        for line in param_digests(&session)? {
            println!("{line}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `--param-digest`: a line per local rank, `params rank R: HASH`, the 64-bit FNV-1a
/// hash of the parameter pieces the rank holds and then of the reduced gradients its
/// last step's optimizers consumed (each in parameter order: the id and the length as
/// little-endian `u64`s, then every element's bits; the gradients too, since an
/// optimizer's update can absorb a difference in the last bits of its input), so that
/// two runs can be compared bit for bit (one process against a job of one process per
/// rank, say). Not a security checksum.
fn param_digests<B: overlap::ops::Backend>(session: &Session<B>) -> Result<Vec<String>, Error> {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let fnv = |h: u64, bytes: &[u8]| {
        bytes
            .iter()
            .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
    };
    let params = session.params().len() as overlap::ParamId;
    let mut lines = Vec::new();
    for rank in session.local_ranks() {
        let mut pieces = Vec::new();
        for id in 0..params {
            pieces.push((id, session.param_values(rank, id)?));
        }
        for id in 0..params {
            pieces.push((id, session.reduced_grad(rank, id)?));
        }
        let mut h = OFFSET;
        for (id, values) in pieces {
            let Some(values) = values else { continue };
            h = fnv(h, &u64::from(id).to_le_bytes());
            h = fnv(h, &(values.len() as u64).to_le_bytes());
            h = values
                .iter()
                .fold(h, |h, x| fnv(h, &x.to_bits().to_le_bytes()));
        }
        lines.push(format!("params rank {rank}: {h:016x}"));
    }
    Ok(lines)
}

/// A step's line (`step 3/4  gates ...`), without the checkpoint's figures.
fn step_line(
    cfg: &Config,
    r: &overlap::StepReport,
    last: u64,
    analysis: &observe::StepAnalysis,
) -> String {
    let per_node = if r.stats.nodes > 0 {
        r.stats.issue_seconds * 1e6 / r.stats.nodes as f64
    } else {
        0.0
    };
    format!(
        "step {}/{last}  gates {}  nodes {}  wall {:.2} ms  host {:.2} us/node  stage2 {} (saved {})  partials left {}  {}  {}  {}{}",
        r.step,
        Gate::pattern_label(&r.gates),
        r.stats.nodes,
        r.stats.wall_seconds * 1e3,
        per_node,
        bytes(r.stage2_bytes),
        bytes(r.stage2_bytes_saved),
        r.stats.partials_left,
        memory_figures(r),
        device_figures(analysis),
        lr_figures(cfg, r),
        norm_figures(r),
    )
}

/// Where the run starts and how many steps it runs: `--resume DIR` loads DIR and runs
/// `steps` more; `--resume-latest` loads `--checkpoint DIR`'s latest checkpoint when
/// there is one (`DIR/latest`; one it names that cannot be loaded is an error, not a
/// fresh start) and runs up to step `steps`, refusing a checkpoint past it; otherwise
/// `steps` steps from the session's first.
fn resume_point<B: overlap::ops::Backend>(
    session: &mut Session<B>,
    cfg: &Config,
    ckpt: &CheckpointArgs,
    steps: u32,
) -> Result<(u64, u32), Error> {
    if let Some(dir) = &ckpt.resume {
        resume(session, cfg, dir, &format!("--resume {}", dir.display()))?;
        return Ok((session.steps_done(), steps));
    }
    let root = match (&ckpt.checkpoint, ckpt.resume_latest) {
        (_, false) => return Ok((session.steps_done(), steps)),
        (Some(root), true) => root,
        (None, true) => {
            return Err(Error::Usage(
                "--resume-latest resumes from the latest checkpoint of --checkpoint DIR: give --checkpoint".into(),
            ))
        }
    };
    let flag = format!("--resume-latest (--checkpoint {})", root.display());
    if root.join(overlap::checkpoint::LATEST).exists() {
        resume(session, cfg, root, &flag)?;
    } else {
        println!(
            "resume-latest: {} holds no checkpoint yet (no `{}`): starting at step {}",
            root.display(),
            overlap::checkpoint::LATEST,
            session.steps_done()
        );
        ignored(&overlap::checkpoint::unfinished(root));
    }
    let start = session.steps_done();
    let left = u64::from(steps).checked_sub(start).ok_or_else(|| {
        Error::Usage(format!(
            "{flag}: the latest checkpoint is at step {start}, past --steps {steps}, the step a run with --resume-latest ends at"
        ))
    })?;
    Ok((start, u32::try_from(left).unwrap_or(steps)))
}

/// Loads the checkpoint `dir` names before the first step (`--resume DIR`, or
/// `--resume-latest`'s root: `flag` names which in errors), refuses another seed's run,
/// and says what it loaded and what unfinished saves left that it ignored.
fn resume<B: overlap::ops::Backend>(
    session: &mut Session<B>,
    cfg: &Config,
    dir: &std::path::Path,
    flag: &str,
) -> Result<(), Error> {
    let t0 = std::time::Instant::now();
    let loaded = session.load(dir)?;
    if let Some(seed) = loaded.seed.filter(|&s| s != cfg.run.seed) {
        return Err(Error::Usage(format!(
            "{flag}: the checkpoint's run used seed {seed}, this one {}; pass --seed {seed} to continue it",
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
    ignored(&loaded.unfinished);
    Ok(())
}

/// A line for each leftover of an unfinished save that the resume did not read.
fn ignored(unfinished: &[std::path::PathBuf]) {
    for path in unfinished {
        println!(
            "resume: ignored {}, left by a save that did not finish",
            path.display()
        );
    }
}

/// What `--checkpoint DIR --save-every N` asks of this process.
struct Saves<'a> {
    /// The checkpoint root, when this process saves (see [`Saves::new`]).
    dir: Option<&'a std::path::Path>,
    save_every: Option<u64>,
}

impl<'a> Saves<'a> {
    /// Every process of a job whose session drives only its own ranks writes their
    /// files; of a job whose processes each run the whole mesh (the CPU backend, unless
    /// it runs one rank per process), only rank 0's process saves, since they all hold
    /// the same state. A session that cannot save is refused here, before the first step
    /// rather than after the steps it would have saved.
    fn new<B: overlap::ops::Backend>(
        session: &Session<B>,
        ckpt: &'a CheckpointArgs,
    ) -> Result<Saves<'a>, Error> {
        let whole = session.local_ranks().len() as u64 == u64::from(session.spec().mesh.world());
        let rank = overlap_dist::env::RankEnv::from_env()?.map_or(0, |e| e.rank);
        let dir = ckpt.checkpoint.as_deref().filter(|_| !whole || rank == 0);
        if dir.is_some() {
            session.check_can_save()?;
        }
        Ok(Saves {
            dir,
            save_every: ckpt.save_every,
        })
    }

    /// Starts the save after step `step` if one is due (the last step, and every
    /// `--save-every`): staged now, written in the background.
    fn after_step<B: overlap::ops::Backend>(
        &self,
        session: &Session<B>,
        cfg: &Config,
        step: u64,
        last: u64,
    ) -> Result<Option<SaveTicket>, Error> {
        let Some(dir) = self.dir else {
            return Ok(None);
        };
        if step != last && !self.save_every.is_some_and(|n| step % n == 0) {
            return Ok(None);
        }
        session
            .save_in_background_with_seed(dir, cfg.run.seed)
            .map(Some)
    }

    /// Says that a background save finished.
    fn report(&self, saved: Option<Saved>) {
        let Some(s) = saved else {
            return;
        };
        let written = s.written.as_secs_f64() * 1e3;
        if s.committed {
            println!(
                "checkpoint: step {} saved to {} (written in the background in {written:.1} ms)",
                s.step,
                s.path.display()
            );
        } else {
            println!(
                "checkpoint: step {}: this process's ranks written for {} in {written:.1} ms (rank 0's process commits it)",
                s.step,
                s.path.display()
            );
        }
    }
}

/// What a save cost the step it follows: `  save stall 1.20 ms (copy 1.15, wait 0.05)`.
fn save_figures(t: &SaveTicket) -> String {
    format!(
        "  save stall {:.2} ms (copy {:.2}, wait {:.2})",
        t.stall().as_secs_f64() * 1e3,
        t.staged.as_secs_f64() * 1e3,
        t.waited.as_secs_f64() * 1e3
    )
}

/// After a step timed out, or another rank failed, the device may still be running it
/// (a hung kernel, a collective whose peer is gone, a copy-transport wait for a flag
/// the dead peer will never write): dropping the session would synchronise the device
/// (the CUDA backend does, to free its memory) and so hang the exit. The session is
/// leaked instead and the process exits with the error; the operating system and the
/// driver reclaim the rest. Any other error drops the session as usual.
pub(crate) fn abandon_if_stuck<B: overlap::ops::Backend>(session: Session<B>, e: Error) -> Error {
    use overlap::executor::ExecError;
    if matches!(
        e,
        Error::Exec(ExecError::Timeout { .. } | ExecError::PeerFailed { .. })
    ) {
        std::mem::forget(session);
    }
    e
}

/// The learning rate of a step: its factor and the base rates it gives, for the
/// optimizers that have parameters (`lr x0.500 (adamw 5.00e-4, muon 1.00e-2)`).
/// `  grad_norm X` with `[clip]`, and `  skipped (nonfinite)` for a skipped step.
pub(crate) fn norm_figures(r: &overlap::StepReport) -> String {
    let mut out = String::new();
    if let Some(n) = r.grad_norm {
        out.push_str(&format!("  grad_norm {n:.4e}"));
    }
    if let Some(why) = r.skipped {
        out.push_str(&format!("  skipped ({why})"));
    }
    out
}

/// The step plan's peak parameter and gradient bytes, the most any local rank holds,
/// against a full replica's (`peak/rank params 1.2 MiB grads 3.4 MiB (replica 9.6 MiB)`).
pub(crate) fn memory_figures(r: &overlap::StepReport) -> String {
    let params = r
        .memory
        .iter()
        .map(|m| m.param_peak_bytes)
        .max()
        .unwrap_or(0);
    let grads = r
        .memory
        .iter()
        .map(|m| m.grad_peak_bytes)
        .max()
        .unwrap_or(0);
    format!(
        "peak/rank params {} grads {} (replica {})",
        bytes(params),
        bytes(grads),
        bytes(r.replica_bytes)
    )
}

pub(crate) fn lr_figures(cfg: &Config, r: &overlap::StepReport) -> String {
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
pub(crate) fn timed(cfg: &Config, observe: &ObserveArgs, steps: u32, n: u64) -> bool {
    let drawn = observe
        .svg
        .as_ref()
        .map(|_| observe.svg_step.unwrap_or(u64::from(steps)));
    observe.trace.is_some() || drawn == Some(n) || cfg.metrics.timed(n)
}

/// The device figures of a step's line; `n/a` on an untimed step, where they were not
/// measured (0 would claim perfect overlap).
pub(crate) fn device_figures(a: &observe::StepAnalysis) -> String {
    if !a.timed() {
        return "span n/a  exposed comm n/a  overlap n/a (untimed)".into();
    }
    format!(
        "span {:.3} ms  exposed comm {:.2} ms  overlap {}",
        a.span_seconds() * 1e3,
        a.exposed_seconds() * 1e3,
        a.efficiency()
            .map_or_else(|| "n/a".into(), |e| format!("{e:.2}")),
    )
}

pub(crate) fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::args::parse_timing_every;

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
            param_digest: false,
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
            timed.starts_with("span ")
                && timed.contains(" ms  exposed comm ")
                && timed.contains(" ms  overlap ")
                && !timed.contains("n/a"),
            "{timed}"
        );
        r.stats.timings.clear();
        assert_eq!(
            device_figures(&observe::StepAnalysis::on_ranks(&r, &plan, &local)),
            "span n/a  exposed comm n/a  overlap n/a (untimed)"
        );
    }
}
