//! The pure half of `overlap calibrate`: from what was measured ([`Measurements`]) to a
//! hardware profile ([`Calibrated`]) and its TOML text with a comment on every figure.
//!
//! Each key of [`KEYS`] is, in the profile this module derives, one of:
//!
//! - **measured**: fitted or computed from the measurements, by the cost model's own
//!   formula inverted (`sim/src/simulate/cost.rs`, beside this module): collectives as `latency + bus
//!   bytes / bus bandwidth` (least squares per kind, then the latencies as `base + ring
//!   steps · hop`), copy-engine copies as `pieces · piece_us + bytes / rate`, kernels as
//!   `kernel_us + bytes / rate`, the slowdowns beside the GEMMs as the model applies them;
//! - **derived** from other figures (`compute.backward_us_per_layer`);
//! - **kept from the base profile** (`--base`): exactly the keys [`unmeasured`] names for
//!   the job's number of GPUs, and nothing else;
//! - **assumed** (`copy_engine.concurrency` = 1) where it is not measured and there is
//!   no base. The `[network]` keys are never measured: kept from a base that has them,
//!   absent otherwise.
//!
//! Invariants: a [`Calibrated`] profile passes [`Profile::check`]; every figure is
//! rounded to four significant digits before anything uses it, and [`to_toml`] writes it
//! in Rust's shortest round-trip form, so the text parses back
//! ([`crate::hardware::from_toml`]) to the same profile bit for bit; every written key
//! has a comment saying which of the four it is and how it was obtained. Nothing here
//! reads a clock, a file or a device.

use std::fmt::Write as _;

use serde::Serialize;

use crate::simulate::{Profile, Rule, KEYS};
use overlap::Error;
use overlap_graph::CollectiveKind;

/// The keys one GPU cannot measure: they need two or more GPUs of one node.
pub const CROSS_GPU: &[&str] = &[
    "gpus_per_node",
    "copy_engine.peer_gbs",
    "copy_engine.piece_us",
    "nvlink.base_us",
    "nvlink.hop_us",
    "nvlink.busbw_gbs.reduce_scatter",
    "nvlink.busbw_gbs.all_reduce",
    "nvlink.busbw_gbs.all_gather",
    "nvlink.busbw_gbs.broadcast",
    "nvlink.busbw_gbs.reduce",
    "interference.nccl.gemm_cost",
    "interference.nccl.stretch",
    "interference.copy_engine.gemm_cost",
    "interference.copy_engine.stretch",
];

/// The keys `overlap calibrate` never measures: how many copy-engine transfers run at
/// full rate at once, and the network between nodes (it measures one node).
pub const NEVER_MEASURED: &[&str] = &[
    "copy_engine.concurrency",
    "network.hop_us",
    "network.nic_gbs",
    "host.launch_us",
];

/// The collective kinds swept, in the order of the profile's keys.
pub const KINDS: [CollectiveKind; 5] = [
    CollectiveKind::ReduceScatter,
    CollectiveKind::AllReduce,
    CollectiveKind::AllGather,
    CollectiveKind::Broadcast,
    CollectiveKind::Reduce,
];

/// The keys a calibration on `world` GPUs does not measure ([`CROSS_GPU`] on one GPU, and
/// always [`NEVER_MEASURED`]), in [`KEYS`] order.
pub fn unmeasured(world: u32) -> Vec<&'static str> {
    KEYS.iter()
        .map(|k| k.path)
        .filter(|p| NEVER_MEASURED.contains(p) || (world < 2 && CROSS_GPU.contains(p)))
        .collect()
}

/// Checks that a job of `world` ranks, `local` of them on this node (the launcher's
/// `LOCAL_WORLD_SIZE`, when it says), can be calibrated with or without a base profile:
/// one node only, and on one GPU only with a base, which supplies what one GPU cannot
/// measure.
pub fn check_job(world: u32, local: Option<u32>, has_base: bool) -> Result<(), Error> {
    if let Some(l) = local.filter(|&l| l != world) {
        return Err(Error::Usage(format!(
            "calibrate measures the GPUs of one node, and this job has {world} ranks of which {l} on this node (LOCAL_WORLD_SIZE): run it with --nnodes 1 (a [network] table is kept from --base)"
        )));
    }
    if world < 2 && !has_base {
        let keys: Vec<String> = CROSS_GPU.iter().map(|k| format!("`{k}`")).collect();
        return Err(Error::Usage(format!(
            "calibrate on one GPU cannot measure {} (they need two or more GPUs of one node): pass --base PROFILE (e.g. hardware/h200-nvlink.toml) to keep them from that profile, or run it on N ≥ 2 GPUs: `overlap launch --nproc-per-node N -- calibrate ...`",
            keys.join(", ")
        )));
    }
    Ok(())
}

/// A size and the mean time of one call of that size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Bytes (what each sweep says it counts).
    pub bytes: f64,
    /// Mean seconds of one call.
    pub seconds: f64,
}

/// One size of the collective sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveSample {
    /// The collective.
    pub kind: CollectiveKind,
    /// nccl-tests' size: the whole send buffer of a reduce-scatter, the whole receive
    /// buffer of an all-gather, the buffer of the others; bytes.
    pub bytes: f64,
    /// Mean seconds of one call.
    pub seconds: f64,
}

/// One size of the exchange sweep (copy transport, receives copied out of the ring).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExchangeSample {
    /// Bytes sent to each peer (and received from each).
    pub message_bytes: f64,
    /// Ring-slot pieces per message: `⌈message / slot⌉`.
    pub pieces: u32,
    /// Mean seconds of one exchange.
    pub seconds: f64,
}

/// A probe of one kind of communication kernel beside the GEMMs.
#[derive(Debug, Clone, PartialEq)]
pub struct BesideProbe {
    /// What ran beside the GEMMs, for the comments (`a 64 MiB reduce-scatter`).
    pub what: String,
    /// What it measured.
    pub times: BesideTimes,
}

/// Where and how the measurements were taken.
#[derive(Debug, Clone, PartialEq)]
pub struct Environment {
    /// The GPU's name.
    pub gpu: String,
    /// The driver's version.
    pub driver: String,
    /// NCCL's version.
    pub nccl: String,
    /// The day (UTC, `YYYY-MM-DD`).
    pub date: String,
    /// The command line, for the header.
    pub command: String,
    /// Ranks (GPUs) in the job.
    pub world: u32,
    /// Untimed calls or steps before the timed ones, per measurement.
    pub warmup: u32,
    /// Timed calls or steps per measurement.
    pub iters: u32,
}

/// What the measurements that need two or more GPUs found.
#[derive(Debug, Clone, PartialEq)]
pub struct CrossGpu {
    /// Every kind of [`KINDS`] at every size.
    pub collectives: Vec<CollectiveSample>,
    /// Exchanges at every size.
    pub exchanges: Vec<ExchangeSample>,
    /// The copy ring's slot size, bytes.
    pub slot_bytes: u64,
    /// An NCCL collective beside the GEMMs.
    pub nccl: BesideProbe,
    /// An exchange beside the GEMMs, and its message per peer (bytes).
    pub exchange: (BesideProbe, f64),
}

/// Everything `overlap calibrate` measured (rank 0's figures).
#[derive(Debug, Clone, PartialEq)]
pub struct Measurements {
    /// Where.
    pub env: Environment,
    /// `overlap bench`'s `compute_only` on the job's mesh: (layers, GEMMs per layer, `d`,
    /// seconds per step).
    pub gemm: (u32, u32, u32, f64),
    /// `overlap bench`'s host µs per node of the `overlap` variant (timings on).
    pub host_us_per_node: f64,
    /// The combine split into pieces: bytes read plus written by the whole combine, and
    /// per number of pieces the mean seconds per launch.
    pub combine: (f64, Vec<(u32, f64)>),
    /// The executor's copy kernel (`Kernel::Add`), bytes read plus written.
    pub elementwise: Vec<Sample>,
    /// Copy-engine copies within the GPU, bytes copied.
    pub local_copy: Vec<Sample>,
    /// Muon alone: (rows, columns, seconds).
    pub muon: (u64, u64, f64),
    /// Gaps between small kernels: across two streams through an event, and back to
    /// back on one stream (seconds, means).
    pub event_gap: (f64, f64),
    /// The combine beside the GEMMs.
    pub combine_beside: BesideProbe,
    /// A copy-engine copy within the GPU beside the GEMMs.
    pub local_copy_beside: BesideProbe,
    /// With two or more GPUs.
    pub cross: Option<CrossGpu>,
}

/// How a figure of the profile was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Fitted or computed from the measurements.
    Measured,
    /// Computed from other figures.
    Derived,
    /// Not measured; the base profile's.
    Base,
    /// Not measured and no base: a stated assumption.
    Assumed,
}

impl Source {
    /// One word for the summary.
    pub fn word(self) -> &'static str {
        match self {
            Source::Measured => "measured",
            Source::Derived => "derived",
            Source::Base => "base",
            Source::Assumed => "assumed",
        }
    }
}

/// What the comment of one key says.
#[derive(Debug, Clone, PartialEq)]
pub struct Note {
    /// The dotted key.
    pub key: &'static str,
    /// How the figure was obtained.
    pub source: Source,
    /// The comment (one paragraph).
    pub text: String,
}

/// A calibrated profile with its comments.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibrated {
    /// The figures.
    pub profile: Profile,
    /// One note per key the profile has, in [`KEYS`] order.
    pub notes: Vec<Note>,
    /// The header's paragraphs.
    pub header: Vec<String>,
}

/// `y = intercept + slope · x`, fitted by least squares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    /// At `x = 0`.
    pub intercept: f64,
    /// Per unit of `x`.
    pub slope: f64,
    /// Root mean square of the residuals relative to each `y`.
    pub rms: f64,
}

/// Least squares of `y` against `x` over `(x, y)` points: at least two distinct `x`,
/// every value finite.
pub fn fit_line(points: &[(f64, f64)]) -> Result<Line, String> {
    if points.iter().any(|(x, y)| !x.is_finite() || !y.is_finite()) {
        return Err("a measured value is not a finite number".into());
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if points.len() < 2 || sxx <= f64::EPSILON * mx * mx * n || sxx == 0.0 {
        return Err(format!(
            "a line needs two or more distinct sizes, got {}",
            points.len()
        ));
    }
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    let rms = rms_rel(points.iter().map(|&(x, y)| (y, intercept + slope * x)));
    Ok(Line {
        intercept,
        slope,
        rms,
    })
}

/// Least squares of `y = p · a + q · b` (no intercept) over `(a, b, y)` points; returns
/// `(p, q, rms)`. The columns must not be proportional.
pub fn fit_two(points: &[(f64, f64, f64)]) -> Result<(f64, f64, f64), String> {
    if points
        .iter()
        .any(|p| ![p.0, p.1, p.2].iter().all(|v| v.is_finite()))
    {
        return Err("a measured value is not a finite number".into());
    }
    // Scaled columns keep the normal equations well conditioned (pieces ~1, bytes ~1e8).
    let norm = |f: &dyn Fn(&(f64, f64, f64)) -> f64| {
        (points.iter().map(|p| f(p).powi(2)).sum::<f64>() / points.len().max(1) as f64).sqrt()
    };
    let (na, nb) = (norm(&|p| p.0), norm(&|p| p.1));
    if points.len() < 2 || na == 0.0 || nb == 0.0 {
        return Err(format!(
            "two figures need two or more sizes, got {}",
            points.len()
        ));
    }
    let (mut saa, mut sab, mut sbb, mut say, mut sby) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(a, b, y) in points {
        let (a, b) = (a / na, b / nb);
        saa += a * a;
        sab += a * b;
        sbb += b * b;
        say += a * y;
        sby += b * y;
    }
    let det = saa * sbb - sab * sab;
    if det <= 1e-9 * saa * sbb {
        return Err(
            "the sizes give every call the same bytes per piece: the piece cost and the rate cannot be told apart (use sizes both below and above the slot)".into(),
        );
    }
    let p = (say * sbb - sby * sab) / det / na;
    let q = (sby * saa - say * sab) / det / nb;
    let rms = rms_rel(points.iter().map(|&(a, b, y)| (y, p * a + q * b)));
    Ok((p, q, rms))
}

/// Root mean square of `(measured − fitted) / measured`.
fn rms_rel(pairs: impl Iterator<Item = (f64, f64)>) -> f64 {
    let (mut s, mut n) = (0.0, 0usize);
    for (y, f) in pairs {
        if y != 0.0 {
            s += ((y - f) / y).powi(2);
        }
        n += 1;
    }
    (s / n.max(1) as f64).sqrt()
}

/// `v` rounded to four significant digits (the figures a profile keeps).
pub fn round4(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let e = v.abs().log10().floor() as i32;
    let shift = 3 - e;
    if shift >= 0 {
        let f = 10f64.powi(shift);
        (v * f).round() / f
    } else {
        let f = 10f64.powi(-shift);
        (v / f).round() * f
    }
}

/// The calendar day (UTC, `YYYY-MM-DD`) of `secs` seconds after the Unix epoch.
pub fn date_utc(secs: u64) -> String {
    // Howard Hinnant's `civil_from_days`.
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// A size for the comments: `64 MiB`, `16 KiB` or `100 bytes`.
pub fn size_text(bytes: f64) -> String {
    let b = bytes.round() as u64;
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} bytes")
    }
}

/// `a, b and c`.
fn list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// The distinct sizes of `bytes`, in order, as text: `1, 4 and 16 MiB` when all are
/// whole MiB.
fn sizes_text(bytes: impl Iterator<Item = f64>) -> String {
    let mut v: Vec<f64> = bytes.collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    let mib: Vec<String> = v.iter().map(|&b| size_text(b)).collect();
    match mib
        .iter()
        .map(|t| t.strip_suffix(" MiB"))
        .collect::<Option<Vec<_>>>()
    {
        Some(n) if n.len() > 1 => format!(
            "{} MiB",
            list(&n.into_iter().map(str::to_string).collect::<Vec<_>>())
        ),
        _ => list(&mib),
    }
}

/// A profile name for `gpu` on `world` GPUs: `nvidia-h200-x2`.
pub fn default_name(gpu: &str, world: u32) -> String {
    let mut s = String::new();
    for c in gpu.chars() {
        if c.is_ascii_alphanumeric() {
            s.push(c.to_ascii_lowercase());
        } else if !s.ends_with('-') && !s.is_empty() {
            s.push('-');
        }
    }
    let s = s.trim_end_matches('-');
    let s = if s.is_empty() { "gpu" } else { s };
    format!("{s}-x{world}")
}

/// Checks a profile name (`--name`): 1 to 64 characters of letters, digits, `.`, `_`
/// and `-`.
pub fn check_name(name: &str) -> Result<(), Error> {
    let ok = (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "--name `{}`: 1 to 64 letters, digits, `.`, `_` or `-`",
            name.escape_debug()
        )))
    }
}

/// Builds the profile in [`KEYS`] order, one key at a time.
struct Builder {
    profile: Profile,
    notes: Vec<Note>,
}

impl Builder {
    /// Sets `key` to `v` rounded ([`round4`]; counts whole; a base profile's figure as
    /// it is) with its note, and returns the value set.
    fn set(&mut self, key: &'static str, v: f64, source: Source, text: String) -> f64 {
        let v = match KEYS.iter().find(|k| k.path == key).map(|k| k.rule) {
            _ if source == Source::Base => v,
            Some(Rule::Count) => v.round(),
            _ => round4(v),
        };
        self.profile.set(key, v);
        self.notes.push(Note { key, source, text });
        v
    }
}

impl Builder {
    /// Sets a kind's `gemm_cost` and `stretch` keys from its probe.
    fn beside(&mut self, (gemm_cost, stretch): (&'static str, &'static str), p: &BesideProbe) {
        let (cost_note, stretch_note) = beside_notes(p);
        self.set(gemm_cost, p.times.gemm_cost(), Source::Measured, cost_note);
        self.set(stretch, p.times.stretch(), Source::Measured, stretch_note);
    }
}

fn bad(key: &str, why: impl std::fmt::Display) -> Error {
    Error::Backend(format!("calibrate: `{key}`: {why}"))
}

/// A rate in GB/s from a slope in seconds per byte, refused unless positive.
fn rate(key: &str, slope: f64) -> Result<f64, Error> {
    if slope > 0.0 && slope.is_finite() {
        Ok(1.0 / slope / 1e9)
    } else {
        Err(bad(
            key,
            format!("the measured times do not grow with the bytes (slope {slope:e} s/byte): nothing to fit a rate to; measure again"),
        ))
    }
}

/// The line through `samples` (time against bytes) and the rate in GB/s its slope
/// gives; errors name `key`.
fn fit_samples(key: &str, samples: &[Sample]) -> Result<(Line, f64), Error> {
    let points: Vec<(f64, f64)> = samples.iter().map(|s| (s.bytes, s.seconds)).collect();
    let line = fit_line(&points).map_err(|e| bad(key, e))?;
    Ok((line, rate(key, line.slope)?))
}

fn us(s: f64) -> f64 {
    s * 1e6
}

fn ms(s: f64) -> f64 {
    s * 1e3
}

/// The profile a calibration's measurements give: `base` (the profile and the file it
/// was read from) supplies exactly the keys [`unmeasured`] names, and must be there on
/// one GPU ([`check_job`]); `name` defaults to [`default_name`].
pub fn derive(
    m: &Measurements,
    base: Option<(&Profile, &str)>,
    name: Option<&str>,
) -> Result<Calibrated, Error> {
    let env = &m.env;
    let world = env.world;
    check_job(world, None, base.is_some())?;
    if (world >= 2) != m.cross.is_some() {
        return Err(Error::Backend(format!(
            "calibrate: a job of {world} GPUs {} the cross-GPU measurements",
            if world >= 2 { "lacks" } else { "cannot have" }
        )));
    }
    let name = name.map_or_else(|| default_name(&env.gpu, world), str::to_string);
    check_name(&name)?;
    let reps = format!("{} timed after {} untimed", env.iters, env.warmup);
    let mut b = Builder {
        profile: Profile::neutral(&name),
        notes: Vec::new(),
    };
    b.profile.network = None;
    keep_unmeasured(&mut b, base, world)?;
    let gemm_tflops = gemms(&mut b, m, &reps)?;
    let (kernel_us, hbm, combine_gbs) = kernels(&mut b, m, &reps)?;
    muon(&mut b, m, &reps, kernel_us, hbm)?;
    backward(&mut b, m, gemm_tflops);
    event_gap(&mut b, m, &reps);
    b.set(
        "combine.gbs",
        combine_gbs,
        Source::Measured,
        format!(
            "The combine's rate beyond its launch, from the fit of `memory.kernel_us`: it reads two chunks and writes one ({} a whole combine).",
            size_text(m.combine.0)
        ),
    );
    let local_gbs = local_copies(&mut b, m, &reps)?;
    if let Some(c) = &m.cross {
        peer_copies(&mut b, c, world, local_gbs, &reps)?;
        nvlink(&mut b, c, world, &reps)?;
    }
    interference(&mut b, m, local_gbs);
    b.set(
        "host.issue_us_per_node",
        m.host_us_per_node,
        Source::Measured,
        format!(
            "Host time per node issuing `overlap bench`'s `overlap` variant on mesh {world}x1 with timing events on ({reps} steps): {:.2} µs.",
            m.host_us_per_node
        ),
    );
    finish(b, env)
}

/// The comment of a key kept from the base profile `file`: why it was not measured.
fn base_note(key: &str, file: &str) -> String {
    let why = if NEVER_MEASURED.contains(&key) {
        if key.starts_with("network.") {
            "calibrate measures the GPUs of one node, not the network between nodes"
        } else if key == "host.launch_us" {
            "calibrate does not time the host's further device operations of a node (Muon's)"
        } else {
            "calibrate does not measure how many copy-engine transfers run at full rate at once"
        }
    } else {
        "one GPU cannot measure it (it needs two or more GPUs of one node)"
    };
    format!("Not measured: {why}; kept from --base {file}.")
}

/// The keys a job of `world` GPUs does not measure: kept from `base`, assumed, left out
/// when optional, or refused; the `[network]` keys only from a base that has them.
fn keep_unmeasured(
    b: &mut Builder,
    base: Option<(&Profile, &str)>,
    world: u32,
) -> Result<(), Error> {
    let kept = |key: &str| base.and_then(|(p, file)| p.get(key).map(|v| (v, file)));
    for key in unmeasured(world)
        .into_iter()
        .filter(|k| !k.starts_with("network."))
    {
        match kept(key) {
            Some((v, file)) => {
                b.set(key, v, Source::Base, base_note(key, file));
            }
            None if key == "copy_engine.concurrency" => {
                b.set(
                    key,
                    1.0,
                    Source::Assumed,
                    "Not measured, and no --base: assumed 1 (concurrent copy-engine transfers share one rate, as the H200s of docs/perf/2026-11-30-ce-probe.log showed).".into(),
                );
            }
            // Optional: without it the simulation charges `host.issue_us_per_node`.
            None if key == "host.launch_us" => {}
            None => {
                return Err(bad(
                    key,
                    "not measured on one GPU and no --base to keep it from",
                ))
            }
        }
    }
    let network_from = base.and_then(|(p, file)| p.network.map(|_| file));
    if let Some(file) = network_from {
        for key in ["network.hop_us", "network.nic_gbs"] {
            if let Some((v, _)) = kept(key) {
                b.set(key, v, Source::Base, base_note(key, file));
            }
        }
    }
    Ok(())
}

/// `compute.gemm_tflops` from the bench's compute_only; returns the figure set.
fn gemms(b: &mut Builder, m: &Measurements, reps: &str) -> Result<f64, Error> {
    let world = m.env.world;
    let (layers, gemms, d, step) = m.gemm;
    let per_gemm_ops = 2.0 * f64::from(d).powi(3);
    let launched = f64::from(layers) * f64::from(gemms);
    if step.is_nan() || step <= 0.0 || launched == 0.0 {
        return Err(bad("compute.gemm_tflops", "the GEMMs took no time"));
    }
    Ok(b.set(
        "compute.gemm_tflops",
        per_gemm_ops * launched / step / 1e12,
        Source::Measured,
        format!(
            "bf16 GEMMs alone: `overlap bench`'s compute_only on mesh {world}x1 ({layers} layers of {gemms} GEMMs of {d}³, {reps} steps): {:.3} ms a step, 2·{d}³ × {} / {:.3} ms.",
            ms(step),
            launched,
            ms(step)
        ),
    ))
}

/// `memory.hbm_gbs` from the copy kernel and `memory.kernel_us` from the combine in
/// pieces; returns those two as set and the combine's rate (`combine.gbs`, not yet set).
fn kernels(b: &mut Builder, m: &Measurements, reps: &str) -> Result<(f64, f64, f64), Error> {
    let (combine_bytes, pieces) = &m.combine;
    let points: Vec<(f64, f64)> = pieces
        .iter()
        .map(|&(p, s)| (combine_bytes / f64::from(p.max(1)), s))
        .collect();
    let line = fit_line(&points).map_err(|e| bad("memory.kernel_us", e))?;
    let combine_gbs = rate("combine.gbs", line.slope)?;
    let per_launch: Vec<String> = pieces
        .iter()
        .map(|&(p, s)| format!("{:.1} µs in {p}", us(s)))
        .collect();
    let (elementwise, hbm) = fit_samples("memory.hbm_gbs", &m.elementwise)?;
    let hbm = b.set(
        "memory.hbm_gbs",
        hbm,
        Source::Measured,
        format!(
            "The executor's copy kernel (a copy, `Kernel::Add`) of {} ({reps} each): least squares of time against bytes read plus written: {:.2} µs + bytes / {:.1} GB/s (RMS residual {:.1} %).",
            sizes_text(m.elementwise.iter().map(|s| s.bytes / 2.0)),
            us(elementwise.intercept),
            hbm,
            elementwise.rms * 100.0
        ),
    );
    let kernel_us = b.set(
        "memory.kernel_us",
        us(line.intercept).max(0.0),
        Source::Measured,
        format!(
            "Fixed device time of a kernel launch: a {} gradient's group-of-two combine (`overlap bench-interference`'s `combines_ms` over the launches, {reps} steps) split into pieces takes per launch {}: least squares against bytes per launch: {:.2} µs + bytes / {:.1} GB/s (RMS residual {:.1} %){}.",
            size_text(combine_bytes / 1.5),
            list(&per_launch),
            us(line.intercept),
            combine_gbs,
            line.rms * 100.0,
            if line.intercept < 0.0 { "; the intercept, below 0, is taken as 0" } else { "" }
        ),
    );
    Ok((kernel_us, hbm, combine_gbs))
}

/// `compute.fp32_tflops`: Muon's measured time inverted through the model, less its
/// launches (`kernel_us` each) and its memory traffic at `hbm` GB/s.
fn muon(
    b: &mut Builder,
    m: &Measurements,
    reps: &str,
    kernel_us: f64,
    hbm: f64,
) -> Result<(), Error> {
    let (rows, cols, muon_s) = m.muon;
    // A matrix alone: a batch of one.
    let launches = crate::simulate::muon_batch_launches(crate::simulate::MUON_NS_STEPS);
    let flops = overlap_graph::owner::ns_flops(rows, cols, crate::simulate::MUON_NS_STEPS);
    let traffic = 5.0 * (rows * cols) as f64 * 4.0;
    let gemm_s = muon_s - f64::from(launches) * kernel_us * 1e-6 - traffic / (hbm * 1e9);
    if gemm_s.is_nan() || gemm_s <= 0.0 {
        return Err(bad(
            "compute.fp32_tflops",
            format!(
                "Muon took {:.1} µs, no more than its launch and memory traffic: nothing left for its GEMMs",
                us(muon_s)
            ),
        ));
    }
    b.set(
        "compute.fp32_tflops",
        flops / gemm_s / 1e12,
        Source::Measured,
        format!(
            "Muon alone on a {rows}×{cols} f32 matrix, Newton–Schulz in f32 (`Kernel::Muon`, `ns_dtype = \"f32\"`, {reps}): {:.3} ms, less {launches} × `memory.kernel_us` (its device operations) and its memory traffic (5 × {} at `memory.hbm_gbs`): {:.3} ms for the cost model's 5 Newton–Schulz iterations of 4m²k + 2m³ operations ({flops:.3e}).",
            ms(muon_s),
            size_text((rows * cols * 4) as f64),
            ms(gemm_s)
        ),
    );
    Ok(())
}

/// `compute.backward_us_per_layer`, derived: the bench's layer of GEMMs at `gemm_tflops`.
fn backward(b: &mut Builder, m: &Measurements, gemm_tflops: f64) {
    let (_, gemms, d, _) = m.gemm;
    let per_gemm_ops = 2.0 * f64::from(d).powi(3);
    let layer_us = f64::from(gemms) * per_gemm_ops / (gemm_tflops * 1e12) * 1e6;
    b.set(
        "compute.backward_us_per_layer",
        layer_us,
        Source::Derived,
        format!(
            "A config's backward per layer when its `run.backward_us_per_layer` is 0: the bench's layer of {gemms} GEMMs of {d}³ at `compute.gemm_tflops` ({gemms} × {:.1} µs).",
            layer_us / f64::from(gemms.max(1))
        ),
    );
}

/// `sync.event_us`: the gap between kernels across two streams less the gap on one.
fn event_gap(b: &mut Builder, m: &Measurements, reps: &str) {
    let (cross_s, same_s) = m.event_gap;
    b.set(
        "sync.event_us",
        us(cross_s - same_s).max(0.0),
        Source::Measured,
        format!(
            "Small kernels alternating between two streams, each waiting on an event recorded after the other's ({reps}), start {:.2} µs after the previous one ends, against {:.2} µs back to back on one stream: the difference (at least 0).",
            us(cross_s),
            us(same_s)
        ),
    );
}

/// `copy_engine.local_gbs` from the copies within the GPU; returns the figure set.
fn local_copies(b: &mut Builder, m: &Measurements, reps: &str) -> Result<f64, Error> {
    let (local, local_gbs) = fit_samples("copy_engine.local_gbs", &m.local_copy)?;
    Ok(b.set(
        "copy_engine.local_gbs",
        local_gbs,
        Source::Measured,
        format!(
            "Copy-engine copies within the GPU (`cuMemcpyDtoDAsync`) of {} ({reps} each): least squares of time against the bytes copied: {:.2} µs + bytes / {:.1} GB/s (RMS residual {:.1} %; the model has no fixed cost for them).",
            sizes_text(m.local_copy.iter().map(|s| s.bytes)),
            us(local.intercept),
            local_gbs,
            local.rms * 100.0
        ),
    ))
}

/// `gpus_per_node`, `copy_engine.peer_gbs` and `copy_engine.piece_us` from the exchange
/// sweep, less each receive's copy out of the ring at `local_gbs`.
fn peer_copies(
    b: &mut Builder,
    c: &CrossGpu,
    world: u32,
    local_gbs: f64,
    reps: &str,
) -> Result<(), Error> {
    b.set(
        "gpus_per_node",
        f64::from(world),
        Source::Measured,
        format!(
            "The job's {world} GPUs, on one node: the collectives and exchanges below ran over all of them."
        ),
    );
    let peers = f64::from(world - 1);
    let pts: Vec<(f64, f64, f64)> = c
        .exchanges
        .iter()
        .map(|e| {
            let y = e.seconds / peers - e.message_bytes / (local_gbs * 1e9);
            (f64::from(e.pieces), e.message_bytes, y)
        })
        .collect();
    let (piece_s, inv, rms) = fit_two(&pts).map_err(|e| bad("copy_engine.peer_gbs", e))?;
    let peer = rate("copy_engine.peer_gbs", inv)?;
    b.set(
        "copy_engine.peer_gbs",
        peer,
        Source::Measured,
        format!(
            "Copy-transport exchanges (a reduce-scatter's) over the job's {world} GPUs with {} per peer ({reps} each), each receive copied out of the ring (slots of {}): each exchange's time per peer ({} of them), less the copy out at `copy_engine.local_gbs`, fitted by least squares as pieces × piece_us + bytes / peer_gbs: {:.2} µs a piece, {:.1} GB/s (RMS residual {:.1} %).",
            sizes_text(c.exchanges.iter().map(|e| e.message_bytes)),
            size_text(c.slot_bytes as f64),
            world - 1,
            us(piece_s),
            peer,
            rms * 100.0
        ),
    );
    b.set(
        "copy_engine.piece_us",
        us(piece_s).max(0.0),
        Source::Measured,
        format!(
            "Fixed cost per ring-slot piece (its copy and flag round trip), from the fit of `copy_engine.peer_gbs`{}.",
            if piece_s < 0.0 { "; below 0 there, taken as 0" } else { "" }
        ),
    );
    Ok(())
}

/// The `interference.*` keys from the probes beside the GEMMs (NCCL and the copy
/// engine's peer copies only with two or more GPUs).
fn interference(b: &mut Builder, m: &Measurements, local_gbs: f64) {
    let cross = m.cross.as_ref();
    if let Some(c) = cross {
        b.beside(
            ("interference.nccl.gemm_cost", "interference.nccl.stretch"),
            &c.nccl,
        );
    }
    b.beside(
        (
            "interference.combine.gemm_cost",
            "interference.combine.stretch",
        ),
        &m.combine_beside,
    );
    let (_, local_note) = beside_notes(&m.local_copy_beside);
    let local_stretch = round4(m.local_copy_beside.times.stretch());
    if let Some(c) = cross {
        exchange_beside(b, c, m.env.world, local_gbs, local_stretch);
    }
    b.set(
        "interference.copy_engine.local_stretch",
        local_stretch,
        Source::Measured,
        local_note,
    );
}

/// `interference.copy_engine.gemm_cost` and `.stretch` from the exchange beside the
/// GEMMs, its copy out of the ring (at `local_gbs`) stretched by `local_stretch`.
fn exchange_beside(b: &mut Builder, c: &CrossGpu, world: u32, local_gbs: f64, local_stretch: f64) {
    let (probe, message) = &c.exchange;
    let (gemm_cost, _) = beside_notes(probe);
    b.set(
        "interference.copy_engine.gemm_cost",
        probe.times.gemm_cost(),
        Source::Measured,
        gemm_cost,
    );
    // The exchange copies its receive out of the ring: that part stretches by
    // `local_stretch`; the rest is the peer copies' stretch.
    let t = &probe.times;
    let whole = t.op_alone_s;
    let out = (f64::from(world) - 1.0) * message / (local_gbs * 1e9);
    let factor = t.op_beside_s / whole.max(f64::MIN_POSITIVE);
    let stretch = if whole > out {
        (factor * whole - out * local_stretch) / (whole - out)
    } else {
        factor
    };
    b.set(
        "interference.copy_engine.stretch",
        stretch.max(1.0),
        Source::Measured,
        format!(
            "Beside the GEMMs one exchange lasted {:.1} µs against {:.1} µs alone ({factor:.2} times longer); less its copy out of the ring ({:.1} µs alone, stretched by `interference.copy_engine.local_stretch`), its copies into the peers took {:.2} times longer (at least 1).",
            us(t.op_beside_s),
            us(whole),
            us(out),
            stretch
        ),
    );
}

/// The calibrated profile: notes in [`KEYS`] order, one for every key it has, the
/// profile checked, and the header written.
fn finish(b: Builder, env: &Environment) -> Result<Calibrated, Error> {
    // The figures were set in the order they depend on each other; the notes go in KEYS
    // order, and every key the profile has must have one.
    let Builder { profile, notes } = b;
    let notes: Vec<Note> = KEYS
        .iter()
        .filter_map(|k| notes.iter().find(|n| n.key == k.path).cloned())
        .collect();
    if let Some(k) = KEYS.iter().find(|k| {
        (k.required || profile.get(k.path).is_some()) && !notes.iter().any(|n| n.key == k.path)
    }) {
        return Err(bad(k.path, "no figure was derived for it"));
    }
    profile.check().map_err(|e| {
        bad(
            &e.key,
            format!("{}; the measurements do not make a valid profile", e.reason),
        )
    })?;
    let header = header(env, &profile);
    Ok(Calibrated {
        profile,
        notes,
        header,
    })
}

/// The header's paragraphs: where and how `env` measured, and whether `profile` has a
/// `[network]`.
fn header(env: &Environment, profile: &Profile) -> Vec<String> {
    let world = env.world;
    let mut header = vec![
        format!(
            "Written by `overlap calibrate` on {}: {} × {world} ({}), driver {}, NCCL {}.",
            env.date,
            env.gpu,
            if world > 1 { "one node" } else { "one GPU" },
            env.driver,
            env.nccl
        ),
        format!("Command: {}", env.command),
        "Each figure says what was measured and how the figure follows from it (the cost model of docs/simulate.md, inverted), or that it was kept from the base profile or assumed. The figures are rank 0's (a collective's or an exchange's time is every member's).".into(),
    ];
    if profile.network.is_none() {
        header.push(
            "No [network]: calibrate measures one node (a --base with a [network] table keeps it)."
                .into(),
        );
    }
    header
}

/// The comments of a probe's `gemm_cost` and `stretch`.
fn beside_notes(p: &BesideProbe) -> (String, String) {
    let t = &p.times;
    (
        format!(
            "{} beside GEMMs on the compute stream: the GEMMs took {:.3} ms instead of {:.3} ms alone while {:.3} ms of its work (its time alone) ran beside them: {:.3} ms lost per ms of its work (at least 0).",
            capital(&p.what),
            ms(t.gemms_beside_s),
            ms(t.gemms_alone_s),
            ms(t.work_beside_s),
            t.gemm_cost()
        ),
        format!(
            "{} lasted {:.1} µs beside the GEMMs against {:.1} µs alone (back to back, the first of each round left out): {:.2} times longer (at least 1).",
            capital(&p.what),
            us(t.op_beside_s),
            us(t.op_alone_s),
            t.stretch()
        ),
    )
}

fn capital(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().chain(c).collect())
        .unwrap_or_default()
}

/// `nvlink.base_us`, `nvlink.hop_us` and `nvlink.busbw_gbs.*` from the collective sweep.
fn nvlink(b: &mut Builder, c: &CrossGpu, world: u32, reps: &str) -> Result<(), Error> {
    let n = world;
    let lines = bandwidth_fits(c, n)?;
    let (base, hop, how) = latency_fit(&lines, n);
    let intercepts: Vec<String> = lines
        .iter()
        .map(|(k, l, _, _)| format!("{} {:.1} µs", k.name().replace('_', "-"), us(l.intercept)))
        .collect();
    b.set(
        "nvlink.base_us",
        us(base),
        Source::Measured,
        format!(
            "NCCL's latency over the job's {world} GPUs: the intercepts of the five fits below ({}) fitted by least squares as base + ring steps × hop (n − 1 = {} steps, an all-reduce's 2(n − 1) = {}): {:.2} µs + {:.2} µs a step{how}.",
            list(&intercepts),
            n - 1,
            2 * (n - 1),
            us(base),
            us(hop)
        ),
    );
    b.set(
        "nvlink.hop_us",
        us(hop),
        Source::Measured,
        "Latency per ring step, from the fit of `nvlink.base_us`.".into(),
    );
    for (kind, line, bw, samples) in lines {
        let factor = overlap::observe::bus_factor(kind, n);
        b.set(
            busbw_key(kind),
            bw,
            Source::Measured,
            format!(
                "{} over the job's {world} GPUs: direct NCCL calls (f32) of {} (nccl-tests' size), {reps} each: least squares of time against bus bytes ({} of the size): {:.1} µs + bytes / {:.1} GB/s (RMS residual {:.1} %).",
                capital(&kind.name().replace('_', "-")),
                sizes_text(samples.iter().map(|s| s.bytes)),
                if factor == 1.0 { "all".to_string() } else { format!("{factor:.3}") },
                us(line.intercept),
                bw,
                line.rms * 100.0
            ),
        );
    }
    Ok(())
}

/// One collective kind's fit: its line of time against bus bytes, its bus bandwidth
/// (GB/s) and the samples it was fitted on.
type KindFit<'c> = (CollectiveKind, Line, f64, Vec<&'c CollectiveSample>);

/// Per collective kind of the sweep over `n` GPUs: time against bus bytes, fitted by
/// least squares.
fn bandwidth_fits(c: &CrossGpu, n: u32) -> Result<Vec<KindFit<'_>>, Error> {
    let mut lines = Vec::new();
    for kind in KINDS {
        let key = busbw_key(kind);
        let samples: Vec<&CollectiveSample> =
            c.collectives.iter().filter(|s| s.kind == kind).collect();
        let factor = overlap::observe::bus_factor(kind, n);
        let line = fit_line(
            &samples
                .iter()
                .map(|s| (s.bytes * factor, s.seconds))
                .collect::<Vec<_>>(),
        )
        .map_err(|e| bad(key, e))?;
        let bw = rate(key, line.slope)?;
        lines.push((kind, line, bw, samples));
    }
    Ok(lines)
}

/// NCCL's latency over `n` GPUs as base + ring steps × hop (an all-reduce takes
/// 2(n − 1) steps, the others n − 1), least squares over the kinds' intercepts; neither
/// is negative. Returns the base, the hop and how the fit was adjusted (empty when it
/// was not), in seconds.
fn latency_fit(lines: &[KindFit<'_>], n: u32) -> (f64, f64, &'static str) {
    let steps = |k: CollectiveKind| -> f64 {
        let s = f64::from(n - 1);
        if k == CollectiveKind::AllReduce {
            2.0 * s
        } else {
            s
        }
    };
    let pts: Vec<(f64, f64)> = lines
        .iter()
        .map(|(k, l, _, _)| (steps(*k), l.intercept))
        .collect();
    match fit_line(&pts) {
        Ok(l) if l.slope >= 0.0 && l.intercept >= 0.0 => (l.intercept, l.slope, ""),
        Ok(l) if l.slope < 0.0 => {
            let mean = pts.iter().map(|p| p.1).sum::<f64>() / pts.len() as f64;
            (mean.max(0.0), 0.0, "; the fit's latency per step was below 0, so none is taken and the base is their mean")
        }
        _ => {
            // An intercept below 0 (or one step count only): the steps carry it all.
            let s: f64 = pts.iter().map(|p| p.0 * p.0).sum();
            let hop = if s > 0.0 {
                (pts.iter().map(|p| p.0 * p.1).sum::<f64>() / s).max(0.0)
            } else {
                0.0
            };
            (
                0.0,
                hop,
                "; the fit's base was below 0, so it is 0 and the steps carry the latency",
            )
        }
    }
}

/// The profile key of a kind's bus bandwidth.
pub fn busbw_key(kind: CollectiveKind) -> &'static str {
    match kind {
        CollectiveKind::ReduceScatter => "nvlink.busbw_gbs.reduce_scatter",
        CollectiveKind::AllReduce => "nvlink.busbw_gbs.all_reduce",
        CollectiveKind::AllGather => "nvlink.busbw_gbs.all_gather",
        CollectiveKind::Broadcast => "nvlink.busbw_gbs.broadcast",
        CollectiveKind::Reduce => "nvlink.busbw_gbs.reduce",
    }
}

/// `text` as `# ` comment lines of at most about 88 characters; control characters
/// become spaces (a TOML comment may not hold them).
fn comment(out: &mut String, text: &str) {
    let clean: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let mut line = String::from("#");
    for word in clean.split_whitespace() {
        if line.chars().count() + 1 + word.chars().count() > 88 && line != "#" {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
}

/// The profile as TOML: the header, `name`, then every key in [`KEYS`] order under its
/// table, each after its comment. Numbers are written in Rust's shortest round-trip
/// form (counts as integers), so the text parses back to the same figures.
pub fn to_toml(c: &Calibrated) -> String {
    let mut out = String::new();
    for h in &c.header {
        comment(&mut out, h);
    }
    // `check_name` allows no character a TOML basic string must escape.
    let _ = writeln!(out, "name = \"{}\"", c.profile.name);
    let mut table = "";
    for note in &c.notes {
        let Some(key) = KEYS.iter().find(|k| k.path == note.key) else {
            continue;
        };
        let Some(v) = c.profile.get(key.path) else {
            continue;
        };
        let (t, leaf) = key.path.rsplit_once('.').unwrap_or(("", key.path));
        if t != table {
            let _ = writeln!(out, "\n[{t}]");
            table = t;
        }
        comment(&mut out, &note.text);
        if key.rule == Rule::Count {
            let _ = writeln!(out, "{leaf} = {}", v as u64);
        } else {
            let _ = writeln!(out, "{leaf} = {v:?}");
        }
    }
    out
}

/// The table `overlap calibrate` prints: every figure, its source and its value.
pub fn summary(c: &Calibrated) -> String {
    let mut out = format!("{:<40} {:>12}  source\n", "key", "value");
    for note in &c.notes {
        if let Some(v) = c.profile.get(note.key) {
            let _ = writeln!(out, "{:<40} {:>12}  {}", note.key, v, note.source.word());
        }
    }
    out
}

/// What `overlap calibrate`'s probe of a kernel beside the GEMMs measured, in seconds, means over the timed rounds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct BesideTimes {
    /// The GEMM block alone (first start to last end).
    pub gemms_alone_s: f64,
    /// The GEMM block with the kernels beside it.
    pub gemms_beside_s: f64,
    /// One kernel alone, back to back (the first of each round left out).
    pub op_alone_s: f64,
    /// One kernel wholly beside the GEMMs (the first of each round left out).
    pub op_beside_s: f64,
    /// Of the kernels' work (their time alone), what ran while the GEMMs ran, per round
    /// (`work_beside` in the command line).
    pub work_beside_s: f64,
}

impl BesideTimes {
    /// Seconds the GEMMs lose per second of the kernels' work beside them (at least 0):
    /// the simulator's `interference.*.gemm_cost`, which slows the backward by that much
    /// times the kernel's progress rate.
    pub fn gemm_cost(&self) -> f64 {
        if self.work_beside_s > 0.0 {
            ((self.gemms_beside_s - self.gemms_alone_s) / self.work_beside_s).max(0.0)
        } else {
            0.0
        }
    }

    /// How many times longer a kernel takes beside the GEMMs than alone (at least 1): the
    /// simulator's `interference.*.stretch`.
    pub fn stretch(&self) -> f64 {
        if self.op_alone_s > 0.0 {
            (self.op_beside_s / self.op_alone_s).max(1.0)
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests;
