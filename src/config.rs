//! The config file: TOML in, a checked [`Config`] out.
//!
//! This module owns the config contract (reference in `docs/config.md`): the
//! sections and keys, their defaults, and every error a user sees for bad input. It
//! reads the file in two layers: serde fills `raw` structs whose fields keep their
//! source spans ([`serde_spanned::Spanned`]), then [`Config::from_toml`] checks them and
//! builds the typed [`Config`]. Semantic checks the planner also makes
//! ([`Mesh::check`], [`ModelSpec::check`], [`ParamSpec::check`], [`Planner::new`]) are
//! called here rather than copied, and their [`PlanError`]s are mapped to the key and
//! line that caused them.
//!
//! The invariant it keeps: a [`Config`] exists only if its [`PlanSpec`] is accepted by
//! [`Planner::new`], its gate list is non-empty, and every number is in range; anything
//! else is a [`ConfigError`] naming the file, the dotted key (`param[2].route`), the
//! line and column where possible, and what to do about it. Nothing here panics on
//! any input.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::str::FromStr;

use overlap_executor::{ClipConfig, HyperTable, LrSchedule, OnNonFinite, ParamGroup, ScheduleKind};
use overlap_graph::{
    Bindings, DType, ForwardSpec, Gate, Mesh, ModelSpec, ParamSpec, PlanError, PlanSpec, Planner,
    ReduceOp, ReduceSpec, Route, Schedule, Stream, Transport, UpdateRates, MAX_MICRO_BATCHES,
};
use overlap_ops::{AdamwParams, MuonParams, NsDtype};
use serde::Deserialize;
use serde_spanned::Spanned;
use toml::de::{DeTable, DeValue};

/// The default largest bucket: 25 MiB, as in PyTorch DDP/FSDP.
pub use overlap_graph::DEFAULT_BUCKET_CAP_BYTES;

/// A checked config: the planner's input plus everything a run needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file name as given to [`Config::from_file`], or the source name given to
    /// [`Config::from_toml`] (`"<inline>"` by convention).
    pub source: String,
    /// Mesh, parameters (the `[model]`'s first, then `[[param]]` in file order),
    /// reduction, bucket cap and stream bindings.
    pub plan: PlanSpec,
    /// The gate of each micro-batch of a step; never empty.
    pub gates: Vec<Gate>,
    /// `[run]`: steps, seed, backend.
    pub run: RunConfig,
    /// `[overlap]`: scheduling knobs of the executor.
    pub overlap: OverlapConfig,
    /// `[optimizer.adamw]`: used by the `adamw`, `sharded_adamw` and `fsdp` routes.
    pub adamw: AdamwParams,
    /// `[optimizer.muon]`: used by the `muon` route.
    pub muon: MuonParams,
    /// `[[optimizer.group]]`, in file order: settings for the parameters whose names
    /// match (first match wins); every group gets at least one parameter.
    pub groups: Vec<ParamGroup>,
    /// `[schedule]`: the learning-rate factor of each step (constant 1 without it).
    pub schedule: LrSchedule,
    /// `[metrics]`: the Prometheus exporter, and which steps are timed.
    pub metrics: MetricsConfig,
    /// `[clip]`: global-norm clipping and what a step with NaN or Inf gradients does;
    /// `None` without the table (no norm nodes, no host read). With it,
    /// `plan.grad_norm` is on.
    pub clip: Option<ClipConfig>,
}

/// `[run]`: how many steps to run, with which seed, on which backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunConfig {
    /// Training steps (at least 1; default 3).
    pub steps: u32,
    /// Seed of the synthetic gradients and initial parameters (default 42).
    pub seed: u64,
    /// The backend to run on (default [`BackendChoice::Auto`]).
    pub backend: BackendChoice,
    /// Synthetic backward cost per layer and micro-batch, in microseconds (default 0):
    /// each `grad_ready` keeps the compute stream busy this long, so that a run on the
    /// CPU backend, whose trainer's backward is not on the compute stream, shows how
    /// communication overlaps compute. At most [`MAX_BACKWARD_US`].
    pub backward_us_per_layer: u32,
    /// The step timeout in seconds (`step_timeout`; 0 or absent: [`DEFAULT_STEP_TIMEOUT_S`],
    /// at most [`MAX_STEP_TIMEOUT_S`]): a step whose device work has not finished this
    /// long after it began (its first micro-batch) fails on every rank, naming the streams and nodes it waited
    /// on. The first step gets [`overlap_executor::FIRST_STEP_TIMEOUT_FACTOR`] times as
    /// long (warm-up).
    pub step_timeout_s: u32,
    /// Where the synthetic trainer's gradients come from (`grads`; default
    /// [`GradSource::Host`]).
    pub grads: GradSource,
}

/// `run.grads`: how `overlap run`'s synthetic trainer hands its gradients in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GradSource {
    /// Each step's gradients are written on the host and handed in with
    /// `Session::grad_ready` (on CUDA: uploaded).
    #[default]
    Host,
    /// One set of gradients per micro-batch is written into backend buffers before the
    /// first step and handed in where it is, every step, with
    /// `Session::grad_ready_device`, as a trainer whose backward runs on the GPU does:
    /// no host writes and no uploads during the steps (the gradients are the same every
    /// step).
    Device,
}

impl GradSource {
    /// Every source, in the order the docs list them.
    pub const ALL: [GradSource; 2] = [GradSource::Host, GradSource::Device];

    /// The name used in configs: `host`, `device`.
    pub fn name(self) -> &'static str {
        match self {
            GradSource::Host => "host",
            GradSource::Device => "device",
        }
    }
}

impl FromStr for GradSource {
    type Err = String;

    /// Parses `host` or `device`; the error lists the valid names.
    fn from_str(s: &str) -> Result<Self, String> {
        GradSource::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| format!("unknown gradient source `{s}`; expected host or device"))
    }
}

/// The default `run.step_timeout`, in seconds.
pub const DEFAULT_STEP_TIMEOUT_S: u32 = 300;

/// The largest `run.step_timeout`: a day.
pub const MAX_STEP_TIMEOUT_S: u32 = 86_400;

/// The largest `run.backward_us_per_layer`: one second per layer.
pub const MAX_BACKWARD_US: u32 = 1_000_000;

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            steps: 3,
            seed: 42,
            backend: BackendChoice::Auto,
            backward_us_per_layer: 0,
            step_timeout_s: DEFAULT_STEP_TIMEOUT_S,
            grads: GradSource::Host,
        }
    }
}

/// `[overlap]`: scheduling knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverlapConfig {
    /// Backpressure: at most this many Stage-1 buffers in flight per rank (at least 1;
    /// default 2).
    pub stage1_window: u32,
    /// Copy transport on GPUs: bytes of one slot of a communicator's receive ring, in
    /// MiB (default 32); a larger message moves in pieces of this size. Each
    /// communicator of `n` members holds `copy_ring_depth × (n − 1)` slots per rank
    /// (twice that where it also gathers).
    pub copy_slot_mib: u32,
    /// Copy transport on GPUs: slots per peer in a receive ring (default 2): how many
    /// pieces a member may send a peer before the peer has drained the oldest.
    pub copy_ring_depth: u32,
    /// At most this many CTAs (SMs) per NCCL collective, through `ncclConfig_t`
    /// (`None`, the default: NCCL's own choice).
    pub nccl_max_ctas: Option<u32>,
    /// What `transport` said; `auto` is settled by [`Config::settle_transport`] once the
    /// job's placement is known (the plan spec holds NCCL until then).
    pub transport: TransportChoice,
}

/// What a command line changes in a loaded config ([`Config::apply`]): each `Some`
/// replaces the file's value. Start from [`Overrides::none`] and add with the `with_`
/// methods.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Overrides {
    /// `[run] backend`.
    pub backend: Option<BackendChoice>,
    /// `[run] seed`.
    pub seed: Option<u64>,
    /// `[overlap] transport` (and the plan's schedule with it).
    pub transport: Option<TransportChoice>,
    /// The step's gates (`[accumulation]`): 1 to `MAX_MICRO_BATCHES` micro-batches.
    pub gates: Option<Vec<Gate>>,
    /// `[reduce] dtype`, the wire type of the reductions.
    pub wire_dtype: Option<DType>,
    /// `[metrics] listen`.
    pub metrics_listen: Option<SocketAddr>,
    /// `[metrics] timing_every`.
    pub timing_every: Option<u32>,
}

impl Overrides {
    /// Nothing overridden.
    pub fn none() -> Overrides {
        Overrides::default()
    }

    /// With `[run] backend` replaced, when `b` is `Some`.
    pub fn with_backend(mut self, b: Option<BackendChoice>) -> Overrides {
        self.backend = b.or(self.backend);
        self
    }

    /// With `[run] seed` replaced, when `seed` is `Some`.
    pub fn with_seed(mut self, seed: Option<u64>) -> Overrides {
        self.seed = seed.or(self.seed);
        self
    }

    /// With `[overlap] transport` replaced, when `t` is `Some`.
    pub fn with_transport(mut self, t: Option<TransportChoice>) -> Overrides {
        self.transport = t.or(self.transport);
        self
    }

    /// With the step's gates replaced, when `gates` is `Some`.
    pub fn with_gates(mut self, gates: Option<Vec<Gate>>) -> Overrides {
        self.gates = gates.or(self.gates.take());
        self
    }

    /// With `[reduce] dtype` replaced, when `d` is `Some`.
    pub fn with_wire_dtype(mut self, d: Option<DType>) -> Overrides {
        self.wire_dtype = d.or(self.wire_dtype);
        self
    }

    /// With `[metrics] listen` replaced, when `addr` is `Some`.
    pub fn with_metrics_listen(mut self, addr: Option<SocketAddr>) -> Overrides {
        self.metrics_listen = addr.or(self.metrics_listen);
        self
    }

    /// With `[metrics] timing_every` replaced, when `n` is `Some`.
    pub fn with_timing_every(mut self, n: Option<u32>) -> Overrides {
        self.timing_every = n.or(self.timing_every);
        self
    }
}

/// `[overlap] transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// The copy transport on GPUs when every rank of the job is on one node; NCCL
    /// collectives otherwise, and on the CPU backend its collectives.
    #[default]
    Auto,
    /// Always NCCL collectives (the CPU backend's collectives on the CPU).
    Nccl,
    /// Always the copy transport (every group's members must share a node on GPUs).
    Copy,
}

impl Default for OverlapConfig {
    fn default() -> Self {
        OverlapConfig {
            stage1_window: 8,
            copy_slot_mib: 32,
            copy_ring_depth: 2,
            nccl_max_ctas: None,
            transport: TransportChoice::Auto,
        }
    }
}

/// The largest `overlap.copy_slot_mib` (4 GiB slots).
pub const MAX_COPY_SLOT_MIB: u32 = 4096;

/// The largest `forward.prefetch`, in layers (a model's most layers: a larger one
/// prefetches every layer all the same).
pub const MAX_FORWARD_PREFETCH: u32 = overlap_graph::MAX_MODEL_LAYERS;

/// The largest `overlap.copy_ring_depth` (the CUDA backend's `MAX_COPY_RING_DEPTH`).
pub const MAX_COPY_RING_DEPTH: u32 = 16;

/// The largest `overlap.nccl_max_ctas`.
pub const MAX_NCCL_CTAS: u32 = 1024;

/// The largest `optimizer.muon.ns_steps`: Newton–Schulz converges in about 5
/// iterations; each costs three matrix products per Muon parameter and step.
pub const MAX_NS_STEPS: u32 = 100;

/// `[metrics]`: the Prometheus exporter, and which steps are timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsConfig {
    /// Address to serve `/metrics` on; `None` (the default) serves nothing.
    pub listen: Option<SocketAddr>,
    /// Time one step in this many (steps 1, 1 + N, 1 + 2N, ...; default 1, every step):
    /// kernel timings cost the host two event records per kernel on GPUs. At most
    /// [`MAX_TIMING_EVERY`].
    pub timing_every: u32,
}

impl MetricsConfig {
    /// Whether `timing_every` times the 1-based `step`; a trainer passes it to
    /// [`Backend::set_timings`](overlap_ops::Backend::set_timings) before the step.
    pub fn timed(&self, step: u64) -> bool {
        step.saturating_sub(1) % u64::from(self.timing_every.max(1)) == 0
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: None,
            timing_every: 1,
        }
    }
}

/// The largest `metrics.timing_every`.
pub const MAX_TIMING_EVERY: u32 = 1_000_000;

/// Which backend runs the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackendChoice {
    /// CUDA when a GPU and the `cuda` feature are available, else CPU.
    #[default]
    Auto,
    /// Ranks as threads with the exact CPU reference math.
    Cpu,
    /// One GPU per rank, NCCL collectives.
    Cuda,
}

impl BackendChoice {
    /// Every choice, in the order the docs list them.
    pub const ALL: [BackendChoice; 3] =
        [BackendChoice::Auto, BackendChoice::Cpu, BackendChoice::Cuda];

    /// The name used in configs and on the command line: `auto`, `cpu`, `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
        }
    }
}

impl FromStr for BackendChoice {
    type Err = String;

    /// Parses `auto`, `cpu` or `cuda`; the error lists the valid names.
    fn from_str(s: &str) -> Result<Self, String> {
        BackendChoice::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("unknown backend `{s}`; expected auto, cpu or cuda"))
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a config could not be loaded. Displays as
/// `{file}:{line}:{column}: `{key}`: {reason}`; the position is left out when unknown,
/// and the key when the error is about the whole file (it cannot be read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(.file, .key, *.line, *.column, .reason))]
pub struct ConfigError {
    /// The file, as given (or the source name of an inline config).
    pub file: String,
    /// The dotted key at fault, with array indices: `param[2].route`,
    /// `accumulation.replicate_gate[1]`. Empty when the file itself cannot be read.
    pub key: String,
    /// 1-based line of the offending text, when it is known.
    pub line: Option<usize>,
    /// 1-based column (in characters) of the offending text, when it is known.
    pub column: Option<usize>,
    /// What is wrong and what is allowed.
    pub reason: String,
}

fn render(
    file: &str,
    key: &str,
    line: Option<usize>,
    column: Option<usize>,
    reason: &str,
) -> String {
    let mut s = file.to_string();
    if let Some(l) = line {
        s.push_str(&format!(":{l}"));
        if let Some(c) = column {
            s.push_str(&format!(":{c}"));
        }
    }
    if !key.is_empty() {
        s.push_str(&format!(": `{key}`"));
    }
    s.push_str(&format!(": {reason}"));
    s
}

impl Config {
    /// Reads and checks a config file. The error's `file` is `path` as given.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let source = path.display().to_string();
        let limit = crate::resources::MAX_CONFIG_BYTES;
        let text = crate::resources::read_text_bounded(path, limit).map_err(|e| {
            let reason = format!("cannot read the config file: {e}");
            ConfigError {
                file: source.clone(),
                key: String::new(),
                line: None,
                column: None,
                reason,
            }
        })?;
        Config::from_toml(&text, &source)
    }

    /// Applies what a command line changes ([`Overrides`]), keeping what depends on each
    /// value consistent (the transport's plan schedule) and checking each as the file's
    /// own value would be; an error names the key overridden and leaves the config as
    /// it was.
    pub fn apply(&mut self, o: &Overrides) -> Result<(), ConfigError> {
        let refuse = |key: &str, reason: String| ConfigError {
            file: self.source.clone(),
            key: key.into(),
            line: None,
            column: None,
            reason: format!("{reason} (as overridden)"),
        };
        if let Some(gates) = &o.gates {
            if gates.is_empty() || gates.len() > MAX_MICRO_BATCHES {
                return Err(refuse(
                    "accumulation.gates",
                    format!(
                        "{} micro-batches; a step needs 1 to {MAX_MICRO_BATCHES}",
                        gates.len()
                    ),
                ));
            }
        }
        if o.gates.is_some() || o.wire_dtype.is_some() {
            // As at load: the step's plan within the planner's limits (buckets are sized
            // in bytes of the wire type, so the dtype moves it too).
            let mut plan = self.plan.clone();
            if let Some(d) = o.wire_dtype {
                plan.reduce.dtype = d;
            }
            let m = o.gates.as_ref().map_or(self.gates.len(), Vec::len);
            let key = if o.gates.is_some() {
                "accumulation.gates"
            } else {
                "reduce.dtype"
            };
            Planner::new(plan)
                .and_then(|p| p.check_step(m))
                .map_err(|e| refuse(key, plan_reason(e)))?;
        }
        if let Some(n) = o.timing_every {
            if !(1..=MAX_TIMING_EVERY).contains(&n) {
                return Err(refuse(
                    "metrics.timing_every",
                    format!("must be between 1 and {MAX_TIMING_EVERY} steps, got {n}"),
                ));
            }
        }
        if let Some(t) = o.transport {
            self.overlap.transport = t;
            // As the file's `transport` would: `auto` waits for `settle_transport`.
            self.plan.schedule.transport = match t {
                TransportChoice::Copy => Transport::Copy,
                TransportChoice::Nccl | TransportChoice::Auto => Transport::Nccl,
            };
        }
        if let Some(gates) = &o.gates {
            self.gates = gates.clone();
        }
        if let Some(d) = o.wire_dtype {
            self.plan.reduce.dtype = d;
        }
        if let Some(b) = o.backend {
            self.run.backend = b;
        }
        if let Some(seed) = o.seed {
            self.run.seed = seed;
        }
        if let Some(addr) = o.metrics_listen {
            self.metrics.listen = Some(addr);
        }
        if let Some(n) = o.timing_every {
            self.metrics.timing_every = n;
        }
        Ok(())
    }

    /// Settles `[overlap] transport = "auto"` for a GPU job: the copy transport when
    /// every rank runs on one node (`one_node`), NCCL collectives otherwise. `nccl` and
    /// `copy` are left as they are.
    pub fn settle_transport(&mut self, one_node: bool) {
        if self.overlap.transport == TransportChoice::Auto {
            self.plan.schedule.transport = if one_node {
                Transport::Copy
            } else {
                Transport::Nccl
            };
        }
    }

    /// Per parameter of the plan (by id), the precision and iteration count of its
    /// Muon Newton–Schulz as the optimizer groups give them (`ns_dtype`, `ns_steps`):
    /// what `overlap simulate` and `overlap tune` cost Muon by. A parameter on another
    /// route gets the values a Muon step of its group would use.
    pub fn newton_schulz(&self) -> Vec<(NsDtype, u32)> {
        newton_schulz_runs((self.adamw, self.muon), &self.groups, &self.plan.params)
            // A checked config always resolves; the base settings otherwise.
            .unwrap_or_else(|| {
                vec![(self.muon.ns_dtype, self.muon.ns_steps); self.plan.params.len()]
            })
    }

    /// The optimizer settings in effect, as `overlap plan --format text` prints them: one
    /// line per `[[optimizer.group]]` (its match, the settings it changes, the parameters
    /// it got), a line for the parameters in no group (the base `[optimizer.adamw]` /
    /// `[optimizer.muon]` settings), and the learning-rate schedule.
    pub fn optimizer_text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let table =
            match HyperTable::resolve(self.adamw, self.muon, &self.groups, &self.plan.params) {
                Ok(t) => t,
                // A checked config always resolves; say so rather than print nothing.
                Err(e) => return format!("optimizer: {e}\n"),
            };
        let names = |ids: Vec<overlap_graph::ParamId>| {
            let list: Vec<&str> = ids
                .iter()
                .filter_map(|&i| self.plan.params.get(i as usize))
                .map(|p| p.name.as_str())
                .collect();
            let noun = if list.len() == 1 { "param" } else { "params" };
            format!("{} {noun}: {}", list.len(), list.join(", "))
        };
        let _ = writeln!(
            s,
            "optimizer groups ({}; first match wins):",
            self.groups.len()
        );
        for (i, g) in self.groups.iter().enumerate() {
            let settings: Vec<String> = g
                .settings()
                .into_iter()
                .map(|(k, v)| format!("{k} = {v}"))
                .collect();
            let settings = if settings.is_empty() {
                "(no changes)".to_string()
            } else {
                settings.join(", ")
            };
            let _ = writeln!(
                s,
                "  group {i}  match {:?}  {settings}  -> {}",
                g.pattern,
                names(table.members(Some(i)))
            );
        }
        let a = self.adamw;
        let m = self.muon;
        let _ = writeln!(
            s,
            "  no group: base [optimizer.adamw] lr = {}, beta1 = {}, beta2 = {}, eps = {}, weight_decay = {}; [optimizer.muon] lr = {}, momentum = {}, ns_steps = {}, weight_decay = {}  -> {}",
            a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, m.lr, m.momentum, m.ns_steps, m.weight_decay,
            names(table.members(None))
        );
        let sc = self.schedule;
        let _ = match sc.kind {
            ScheduleKind::Constant if sc.warmup_steps == 0 => {
                writeln!(s, "schedule: constant (lr factor 1 at every step)")
            }
            ScheduleKind::Constant => writeln!(
                s,
                "schedule: constant, warmup_steps = {} (lr factor t/{} up to step {}, then 1)",
                sc.warmup_steps, sc.warmup_steps, sc.warmup_steps
            ),
            kind => writeln!(
                s,
                "schedule: {kind}, warmup_steps = {}, total_steps = {}, final_lr_frac = {} (lr factor {} at step 1, 1 at the end of the warm-up, {} from step {} on)",
                sc.warmup_steps,
                sc.total_steps,
                sc.final_lr_frac,
                sc.factor(1),
                sc.final_lr_frac,
                sc.total_steps
            ),
        };
        s
    }

    /// Parses and checks config text; `source` names it in errors (a file name, or
    /// `"<inline>"`).
    pub fn from_toml(text: &str, source: &str) -> Result<Config, ConfigError> {
        let doc = Doc {
            text,
            file: source,
            external: None,
        };
        let table = DeTable::parse(text).map_err(|e| doc.syntax_error(&e))?;
        let raw = raw::Root::deserialize(toml::de::Deserializer::from(table))
            .map_err(|e| doc.serde_error(&e))?;
        doc.build(raw)
    }

    /// Parses and checks config text whose parameters come from the trainer's model
    /// rather than the file: `params` take the place of `[model]` and `[[param]]`, which
    /// the text must not have (an error names the key). Everything else (mesh, buckets,
    /// gates, groups, schedule, clipping, `[forward]`) is read and checked as
    /// [`Config::from_toml`] does, against these parameters: a group whose pattern
    /// matches none of them is an error, and so is a parameter the planner rejects
    /// (named, with the reason). Framework integrations such as `overlap-candle` build
    /// their config this way.
    pub fn from_toml_with_params(
        text: &str,
        source: &str,
        params: Vec<ParamSpec>,
    ) -> Result<Config, ConfigError> {
        let doc = Doc {
            text,
            file: source,
            external: Some(params),
        };
        let table = DeTable::parse(text).map_err(|e| doc.syntax_error(&e))?;
        let raw = raw::Root::deserialize(toml::de::Deserializer::from(table))
            .map_err(|e| doc.serde_error(&e))?;
        doc.build(raw)
    }
}

/// The text being read, for turning spans into positions and keys.
struct Doc<'a> {
    text: &'a str,
    file: &'a str,
    /// Parameters given in code ([`Config::from_toml_with_params`]) instead of the
    /// file's `[model]` and `[[param]]`.
    external: Option<Vec<ParamSpec>>,
}

impl Doc<'_> {
    /// An error at a span of the text (or nowhere).
    fn err(
        &self,
        key: impl Into<String>,
        span: Option<Range<usize>>,
        reason: impl Into<String>,
    ) -> ConfigError {
        let (line, column) = match span {
            Some(s) => {
                let (l, c) = self.position(s.start);
                (Some(l), Some(c))
            }
            None => (None, None),
        };
        ConfigError {
            file: self.file.to_string(),
            key: key.into(),
            line,
            column,
            reason: reason.into(),
        }
    }

    /// 1-based line and column (in characters) of a byte offset.
    fn position(&self, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        (line, before[line_start..].chars().count() + 1)
    }

    fn syntax_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span();
        if e.message().starts_with("duplicate key") {
            if let Some((key, first)) = span.as_ref().and_then(|s| self.duplicate(s)) {
                let before = match first {
                    Some(line) => format!(" (line {line} has it too)"),
                    None => String::new(),
                };
                return self.err(
                    key.clone(),
                    span,
                    format!(
                        "invalid TOML: duplicate key `{key}`{before}; a key or table may appear only once"
                    ),
                );
            }
        }
        let key = span
            .as_ref()
            .map(|s| self.locate(s.start, true))
            .unwrap_or_default();
        self.err(key, span, format!("invalid TOML: {}", e.message()))
    }

    /// The dotted key a `duplicate key` error's span names, and the line where it first
    /// appears when it can be found: the key's own text, under the table header (`[a.b]`,
    /// or `[[param]]` counted to `param[i]`) in force where it stands; a duplicated
    /// header is its own key.
    fn duplicate(&self, span: &Range<usize>) -> Option<(String, Option<usize>)> {
        let name = self.text.get(span.clone())?.trim();
        if name.is_empty() {
            return None;
        }
        let clean = |k: &str| -> String {
            k.split('.')
                .map(|p| join_key("", p.trim().trim_matches(|c| c == '"' || c == '\'')))
                .collect::<Vec<_>>()
                .join(".")
        };
        let line_start = self.text[..span.start].rfind('\n').map_or(0, |i| i + 1);
        let on_header = self.text[line_start..span.start]
            .trim_start()
            .starts_with('[');
        // Table headers up to the span: (byte offset, name, is an array of tables).
        let mut headers: Vec<(usize, String, bool)> = Vec::new();
        let mut offset = 0;
        for line in self.text.split_inclusive('\n') {
            if offset >= span.start && !(on_header && offset == line_start) {
                break;
            }
            let t = line.trim_start();
            if let Some(rest) = t.strip_prefix("[[") {
                headers.push((offset, clean(rest.split("]]").next().unwrap_or("")), true));
            } else if let Some(rest) = t.strip_prefix('[') {
                headers.push((offset, clean(rest.split(']').next().unwrap_or("")), false));
            }
            offset += line.len();
        }
        let first_line = |pred: &dyn Fn(usize, &str) -> bool| -> Option<usize> {
            let mut off = 0;
            for line in self.text.split_inclusive('\n') {
                if off >= line_start {
                    break;
                }
                if pred(off, line) {
                    return Some(self.position(off).0);
                }
                off += line.len();
            }
            None
        };
        if on_header {
            let key = headers.last().map(|h| h.1.clone())?;
            let first = first_line(&|_, line: &str| {
                let t = line.trim_start();
                t.starts_with('[')
                    && !t.starts_with("[[")
                    && clean(t[1..].split(']').next().unwrap_or("")) == key
            });
            return Some((key, first));
        }
        let key = clean(name);
        let Some((start, table, array)) = headers.last().cloned() else {
            let first =
                first_line(&|_, line: &str| clean(line.split('=').next().unwrap_or("")) == key);
            return Some((key, first));
        };
        let table = if array {
            let n = headers.iter().filter(|h| h.2 && h.1 == table).count();
            format!("{table}[{}]", n - 1)
        } else {
            table
        };
        let first = first_line(&|off, line: &str| {
            off > start && line.contains('=') && clean(line.split('=').next().unwrap_or("")) == key
        });
        Some((format!("{table}.{key}"), first))
    }

    fn serde_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span();
        let mut key = span
            .as_ref()
            .map(|s| self.locate(s.start, false))
            .unwrap_or_default();
        let msg = e.message();
        if let Some(field) = msg
            .strip_prefix("missing field `")
            .and_then(|r| r.strip_suffix('`'))
        {
            key = join_key(&key, field);
        }
        let mut reason = humanize(msg);
        if key == "param" && msg.starts_with("invalid type: map") {
            reason.push_str("; write each parameter as a `[[param]]` table");
        }
        self.err(key, span, reason)
    }

    /// The dotted key whose key or value holds a byte offset (the innermost one). For a
    /// syntax error, which may lie past everything parsed, falls back to the last key
    /// starting before the offset on the same line.
    fn locate(&self, offset: usize, syntax: bool) -> String {
        let (table, _) = DeTable::parse_recoverable(self.text);
        let mut entries = Vec::new();
        collect_keys(table.get_ref(), "", &mut entries);
        let holds = |s: &Range<usize>| {
            (s.start <= offset && offset < s.end) || (s.is_empty() && s.start == offset)
        };
        let mut best: Option<(usize, &str)> = None;
        for e in &entries {
            for s in [e.key.as_ref(), Some(&e.value)].into_iter().flatten() {
                if holds(s) && best.map_or(true, |(len, _)| s.len() <= len) {
                    best = Some((s.len(), &e.path));
                }
            }
        }
        if let Some((_, path)) = best {
            return path.to_string();
        }
        if !syntax {
            return String::new();
        }
        let line = self.position(offset).0;
        let on_line = entries
            .iter()
            .filter_map(|e| e.key.as_ref().map(|k| (k.start, &e.path)))
            .filter(|&(start, _)| start <= offset && self.position(start).0 == line)
            .max_by_key(|&(start, _)| start)
            .map(|(_, p)| p.clone());
        // A broken table header is dropped by the parser: name it from the text.
        on_line.unwrap_or_else(|| {
            let text = self.text.lines().nth(line - 1).unwrap_or("").trim();
            match text.strip_prefix('[') {
                Some(h) => h
                    .trim_start_matches('[')
                    .split(']')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_string(),
                None => String::new(),
            }
        })
    }

    /// Checks the raw config and builds the [`Config`].
    fn build(&self, raw: raw::Root) -> Result<Config, ConfigError> {
        let Some(raw_mesh) = raw.mesh else {
            return Err(self.err(
                "mesh",
                None,
                "missing [mesh] section; add `[mesh]` with `shard` (ranks per shard group) and `replicate` (replicate groups)",
            ));
        };
        let mesh = self.mesh(&raw_mesh)?;
        let params = match &self.external {
            Some(external) => self.external_params(raw.model.as_ref(), &raw.param, external)?,
            None => self.params(raw.model.as_ref(), &raw.param)?,
        };
        let reduce = ReduceSpec::default()
            .with_op(
                raw.reduce
                    .op
                    .map_or(ReduceOp::default(), Spanned::into_inner),
            )
            .with_dtype(
                raw.reduce
                    .dtype
                    .map_or(DType::default(), Spanned::into_inner),
            );
        let bucket_cap_bytes = match raw.buckets.cap_bytes {
            None => DEFAULT_BUCKET_CAP_BYTES,
            Some(c) if *c.get_ref() == 0 => {
                return Err(self.err(
                    "buckets.cap_bytes",
                    Some(c.span()),
                    "must be at least 1 byte",
                ))
            }
            Some(c) => c.into_inner(),
        };
        let bindings = self.bindings(&raw.streams)?;
        let transport = self.transport(&raw.overlap)?;
        let schedule = Schedule::default()
            .with_transport(if transport == TransportChoice::Copy {
                Transport::Copy
            } else {
                // `auto` is settled by `settle_transport` once the placement is known.
                Transport::Nccl
            })
            .with_combine_lag(
                raw.overlap
                    .combine_lag
                    .as_ref()
                    .map_or(Schedule::default().combine_lag, |v| *v.get_ref()),
            );
        let clip = self.clip(raw.clip.as_ref())?;
        let plan = PlanSpec::new(mesh, params)
            .with_reduce(reduce)
            .with_bucket_cap_bytes(bucket_cap_bytes)
            .with_bindings(bindings)
            .with_schedule(schedule)
            .with_grad_norm(clip.is_some())
            .with_forward(self.forward(raw.forward.as_ref())?);
        let adamw = self.adamw(&raw.optimizer.adamw)?;
        let muon = self.muon(&raw.optimizer.muon)?;
        let groups = self.groups(&raw.optimizer.group, adamw, muon, &plan.params)?;
        let rates = update_rates((adamw, muon), &groups, &plan.params);
        let plan = plan.with_update_rates(rates);
        // The planner's own checks, as a backstop: whatever it rejects, the config rejects;
        // then the size of a step's plan, now that the buckets and micro-batches are known.
        let planner = plan
            .check()
            .and_then(|()| Planner::new(plan.clone()))
            .map_err(|e| self.plan_error(e, &raw_mesh, raw.model.as_ref(), &raw.param))?;
        let gates = self.gates(&raw.accumulation)?;
        if let Err(e) = planner.check_step(gates.len()) {
            let a = &raw.accumulation;
            let span = match &e {
                PlanError::Input { key, .. } if key == "accumulation.micro_batches" => {
                    a.micro_batches.as_ref().map(Spanned::span).or_else(|| {
                        [&a.gates, &a.replicate_gate, &a.reduce_gate]
                            .into_iter()
                            .flatten()
                            .map(Spanned::span)
                            .next()
                    })
                }
                _ => None,
            };
            return Err(match (&e, span) {
                (PlanError::Input { key, .. }, Some(span)) => {
                    self.err(key.clone(), Some(span), plan_reason(e))
                }
                _ => self.plan_error(e, &raw_mesh, raw.model.as_ref(), &raw.param),
            });
        }
        Ok(Config {
            source: self.file.to_string(),
            plan,
            gates,
            run: self.run(raw.run)?,
            overlap: OverlapConfig {
                stage1_window: self.at_least_one(
                    "overlap.stage1_window",
                    raw.overlap.stage1_window,
                    OverlapConfig::default().stage1_window,
                )?,
                copy_slot_mib: self
                    .between(
                        "overlap.copy_slot_mib",
                        &raw.overlap.copy_slot_mib,
                        MAX_COPY_SLOT_MIB,
                        " MiB",
                    )?
                    .unwrap_or(OverlapConfig::default().copy_slot_mib),
                copy_ring_depth: self
                    .between(
                        "overlap.copy_ring_depth",
                        &raw.overlap.copy_ring_depth,
                        MAX_COPY_RING_DEPTH,
                        " slots",
                    )?
                    .unwrap_or(OverlapConfig::default().copy_ring_depth),
                transport,
                nccl_max_ctas: self.between(
                    "overlap.nccl_max_ctas",
                    &raw.overlap.nccl_max_ctas,
                    MAX_NCCL_CTAS,
                    "",
                )?,
            },
            adamw,
            muon,
            groups,
            schedule: self.schedule(raw.schedule.as_ref())?,
            metrics: self.metrics(raw.metrics)?,
            clip,
        })
    }

    /// `[forward]`: present, each micro-batch gathers the full parameters for the
    /// trainer's forward and backward; `prefetch` 0 to [`MAX_FORWARD_PREFETCH`] (default
    /// 1), `reshard_after_forward` (default true).
    fn forward(
        &self,
        raw: Option<&Spanned<raw::Forward>>,
    ) -> Result<Option<ForwardSpec>, ConfigError> {
        let Some(f) = raw else { return Ok(None) };
        let f = f.get_ref();
        let d = ForwardSpec::default();
        let prefetch = match &f.prefetch {
            None => d.prefetch,
            Some(v) if *v.get_ref() > MAX_FORWARD_PREFETCH => {
                return Err(self.err(
                    "forward.prefetch",
                    Some(v.span()),
                    format!(
                        "must be between 0 and {MAX_FORWARD_PREFETCH} layers, got {}",
                        v.get_ref()
                    ),
                ))
            }
            Some(v) => *v.get_ref(),
        };
        Ok(Some(
            ForwardSpec::default()
                .with_prefetch(prefetch)
                .with_reshard_after_forward(
                    f.reshard_after_forward.unwrap_or(d.reshard_after_forward),
                ),
        ))
    }

    /// `[clip]`: `max_norm` finite and > 0 (absent: the norm is computed and checked,
    /// nothing is clipped), `on_nonfinite` `skip` (default) or `error`.
    fn clip(&self, raw: Option<&Spanned<raw::Clip>>) -> Result<Option<ClipConfig>, ConfigError> {
        let Some(c) = raw else { return Ok(None) };
        let c = c.get_ref();
        let max_norm = match &c.max_norm {
            None => None,
            Some(_) => Some(self.float("clip.max_norm", &c.max_norm, 1.0, Bound::Positive)?),
        };
        let on_nonfinite = match &c.on_nonfinite {
            None => OnNonFinite::default(),
            Some(v) => match v.get_ref().as_str() {
                "skip" => OnNonFinite::Skip,
                "error" => OnNonFinite::Error,
                other => {
                    return Err(self.err(
                        "clip.on_nonfinite",
                        Some(v.span()),
                        format!("unknown value `{other}`; expected \"skip\" or \"error\""),
                    ))
                }
            },
        };
        Ok(Some(
            ClipConfig::default()
                .with_max_norm(max_norm)
                .with_on_nonfinite(on_nonfinite),
        ))
    }

    /// `[[optimizer.group]]`: each group's settings in range, then every group must get
    /// a parameter (first match wins).
    fn groups(
        &self,
        raw: &[Spanned<raw::Group>],
        adamw: AdamwParams,
        muon: MuonParams,
        params: &[ParamSpec],
    ) -> Result<Vec<ParamGroup>, ConfigError> {
        let mut groups = Vec::with_capacity(raw.len());
        for (i, g) in raw.iter().enumerate() {
            let r = g.get_ref();
            let k = |name: &str| format!("optimizer.group[{i}].{name}");
            if r.pattern.get_ref().is_empty() {
                return Err(self.err(
                    k("match"),
                    Some(r.pattern.span()),
                    "the pattern is empty; give a glob over parameter names, e.g. \"*.bias\"",
                ));
            }
            let opt = |name: &str, v: &Option<Spanned<f64>>, bound: Bound| match v {
                None => Ok(None),
                Some(_) => self.float(&k(name), v, 0.0, bound).map(Some),
            };
            groups.push(
                ParamGroup::new(r.pattern.get_ref().clone())
                    .with_lr_scale(self.float(
                        &k("lr_scale"),
                        &r.lr_scale,
                        1.0,
                        Bound::NonNegative,
                    )?)
                    .with_weight_decay(opt("weight_decay", &r.weight_decay, Bound::NonNegative)?)
                    .with_beta1(opt("beta1", &r.beta1, Bound::Fraction)?)
                    .with_beta2(opt("beta2", &r.beta2, Bound::Fraction)?)
                    .with_eps(opt("eps", &r.eps, Bound::Positive)?)
                    .with_momentum(opt("momentum", &r.momentum, Bound::Fraction)?)
                    .with_ns_steps(self.between(
                        &k("ns_steps"),
                        &r.ns_steps,
                        MAX_NS_STEPS,
                        " iterations",
                    )?)
                    .with_ns_dtype(self.ns_dtype(&k("ns_dtype"), &r.ns_dtype)?),
            );
        }
        HyperTable::resolve(adamw, muon, &groups, params).map_err(|e| match e {
            overlap_executor::GroupError::Unmatched { group, reason } => self.err(
                format!("optimizer.group[{group}].match"),
                raw.get(group).map(|g| g.get_ref().pattern.span()),
                reason,
            ),
            overlap_executor::GroupError::Setting { group, key, reason } => self.err(
                format!("optimizer.group[{group}].{key}"),
                raw.get(group).map(Spanned::span),
                reason,
            ),
        })?;
        Ok(groups)
    }

    /// `[schedule]`: the learning-rate schedule, or a constant factor of 1 without it.
    fn schedule(&self, raw: Option<&Spanned<raw::Schedule>>) -> Result<LrSchedule, ConfigError> {
        let Some(raw) = raw else {
            return Ok(LrSchedule::default());
        };
        let r = raw.get_ref();
        let kind = ScheduleKind::parse(r.kind.get_ref())
            .map_err(|reason| self.err("schedule.kind", Some(r.kind.span()), reason))?;
        let mut s = LrSchedule::decay(kind, 0, LrSchedule::default().final_lr_frac)
            .with_warmup(r.warmup_steps.as_ref().map_or(0, |v| *v.get_ref()));
        if kind == ScheduleKind::Constant {
            let unused = [
                ("total_steps", r.total_steps.as_ref().map(Spanned::span)),
                ("final_lr_frac", r.final_lr_frac.as_ref().map(Spanned::span)),
            ];
            if let Some((key, span)) = unused.into_iter().find(|(_, s)| s.is_some()) {
                return Err(self.err(
                    format!("schedule.{key}"),
                    span,
                    "has no effect with kind = \"constant\" (no decay); remove it, or choose kind = \"cosine\" or \"linear\"",
                ));
            }
            return Ok(s);
        }
        let Some(total) = &r.total_steps else {
            return Err(self.err(
                "schedule.total_steps",
                Some(raw.span()),
                format!(
                    "missing required key `total_steps`: a {kind} schedule decays until that step"
                ),
            ));
        };
        s.total_steps = *total.get_ref();
        if s.total_steps <= s.warmup_steps {
            return Err(self.err(
                "schedule.total_steps",
                Some(total.span()),
                format!(
                    "must be greater than warmup_steps ({}), got {}: the decay runs from the end of the warm-up to this step",
                    s.warmup_steps, s.total_steps
                ),
            ));
        }
        if let Some(v) = &r.final_lr_frac {
            let x = *v.get_ref();
            if !(x.is_finite() && (0.0..=1.0).contains(&x)) {
                return Err(self.err(
                    "schedule.final_lr_frac",
                    Some(v.span()),
                    format!("must be a finite number in [0, 1], got {x}"),
                ));
            }
            s.final_lr_frac = x;
        }
        // The executor's own check, as a backstop.
        s.check().map_err(|(key, reason)| {
            self.err(format!("schedule.{key}"), Some(raw.span()), reason)
        })?;
        Ok(s)
    }

    fn mesh(&self, raw: &Spanned<raw::Mesh>) -> Result<Mesh, ConfigError> {
        let r = raw.get_ref();
        let mesh = Mesh {
            shard: *r.shard.get_ref(),
            replicate: *r.replicate.get_ref(),
        };
        mesh.check().map_err(|e| {
            let (key, span) = if mesh.shard == 0 {
                ("mesh.shard", r.shard.span())
            } else if mesh.replicate == 0 {
                ("mesh.replicate", r.replicate.span())
            } else {
                ("mesh", raw.span())
            };
            self.err(key, Some(span), plan_reason(e))
        })?;
        Ok(mesh)
    }

    /// The `[model]`'s parameters, then the explicit ones, each checked; names unique.
    /// The parameters given in code: checked one by one (names unique), with the file
    /// holding none of its own.
    fn external_params(
        &self,
        model: Option<&Spanned<raw::Model>>,
        explicit: &[Spanned<raw::Param>],
        external: &[ParamSpec],
    ) -> Result<Vec<ParamSpec>, ConfigError> {
        let from_code = "the parameters come from the trainer's model; remove it from the config";
        if let Some(m) = model {
            return Err(self.err("model", Some(m.span()), from_code));
        }
        if let Some(p) = explicit.first() {
            return Err(self.err("param[0]", Some(p.span()), from_code));
        }
        let mut seen = HashMap::new();
        for (i, spec) in external.iter().enumerate() {
            let name = overlap_graph::export::printable(&spec.name);
            spec.check()
                .map_err(|e| self.err(format!("parameter `{name}`"), None, plan_reason(e)))?;
            if let Some(j) = seen.insert(spec.name.as_str(), i) {
                return Err(self.err(
                    format!("parameter `{name}`"),
                    None,
                    format!("duplicate parameter name: parameters {j} and {i} both have it; names must be unique"),
                ));
            }
        }
        if external.is_empty() {
            return Err(self.err("param", None, "no parameters: the model has none"));
        }
        Ok(external.to_vec())
    }

    fn params(
        &self,
        model: Option<&Spanned<raw::Model>>,
        explicit: &[Spanned<raw::Param>],
    ) -> Result<Vec<ParamSpec>, ConfigError> {
        let mut params = Vec::new();
        if let Some(m) = model {
            let r = m.get_ref();
            let spec = ModelSpec::new(*r.layers.get_ref(), *r.hidden.get_ref(), *r.vocab.get_ref());
            if let Some((key, reason)) = spec.fault() {
                let span = match key {
                    "layers" => r.layers.span(),
                    "hidden" => r.hidden.span(),
                    _ => r.vocab.span(),
                };
                return Err(self.err(format!("model.{key}"), Some(span), reason));
            }
            for p in spec.params() {
                p.check().map_err(|e| {
                    self.err(
                        "model",
                        Some(m.span()),
                        format!("the generated parameter `{}`: {}", p.name, plan_reason(e)),
                    )
                })?;
                params.push(p);
            }
        }
        let mut seen: HashMap<String, Option<usize>> =
            params.iter().map(|p| (p.name.clone(), None)).collect();
        for (i, p) in explicit.iter().enumerate() {
            let r = p.get_ref();
            let at = |field: &str| format!("param[{i}].{field}");
            let route = Route::parse(r.route.get_ref())
                .map_err(|reason| self.err(at("route"), Some(r.route.span()), reason))?;
            if let Some(c) = r.name.get_ref().chars().find(|c| c.is_control()) {
                return Err(self.err(
                    at("name"),
                    Some(r.name.span()),
                    format!(
                        "the name {:?} holds the control character {c:?}; names are printed in listings, pictures and errors, so they must be printable",
                        r.name.get_ref()
                    ),
                ));
            }
            let spec = ParamSpec::new(
                r.name.get_ref().clone(),
                r.shape.get_ref().clone(),
                route,
                r.layer.as_ref().map_or(0, |l| *l.get_ref()),
            );
            spec.check().map_err(|e| {
                let (field, span) = if spec.name.is_empty() {
                    ("name", r.name.span())
                } else if route == Route::Muon && spec.shape.len() == 1 {
                    ("route", r.route.span())
                } else {
                    ("shape", r.shape.span())
                };
                self.err(at(field), Some(span), plan_reason(e))
            })?;
            if let Some(prev) = seen.insert(spec.name.clone(), Some(i)) {
                let other = match prev {
                    Some(j) => format!(
                        "param[{j}] (line {})",
                        self.position(explicit[j].get_ref().name.span().start).0
                    ),
                    None => "a parameter generated by [model]".to_string(),
                };
                return Err(self.err(
                    at("name"),
                    Some(r.name.span()),
                    format!(
                        "duplicate parameter name `{}`: {other} has it too; names must be unique",
                        overlap_graph::export::printable(&spec.name)
                    ),
                ));
            }
            params.push(spec);
        }
        if params.is_empty() {
            return Err(self.err(
                "param",
                None,
                "no parameters: add [[param]] entries or a [model] section",
            ));
        }
        Ok(params)
    }

    /// Maps an error of [`Planner::new`] to the key that caused it.
    fn plan_error(
        &self,
        e: PlanError,
        mesh: &Spanned<raw::Mesh>,
        model: Option<&Spanned<raw::Model>>,
        explicit: &[Spanned<raw::Param>],
    ) -> ConfigError {
        match &e {
            PlanError::Mesh(_) => self.err("mesh", Some(mesh.span()), plan_reason(e)),
            PlanError::Param { name, .. } => match explicit
                .iter()
                .position(|p| p.get_ref().name.get_ref() == name)
            {
                Some(i) => self.err(
                    format!("param[{i}]"),
                    Some(explicit[i].span()),
                    plan_reason(e),
                ),
                None if self.external.is_some() => self.err(
                    format!("parameter `{}`", overlap_graph::export::printable(name)),
                    None,
                    plan_reason(e),
                ),
                None => self.err("model", model.map(Spanned::span), plan_reason(e)),
            },
            PlanError::Model(_) => self.err("model", model.map(Spanned::span), plan_reason(e)),
            PlanError::Input { key, .. } if key == "mesh" => {
                self.err("mesh", Some(mesh.span()), plan_reason(e))
            }
            PlanError::Input { key, .. } => self.err(key.clone(), None, plan_reason(e)),
            PlanError::Json(_) | PlanError::Malformed { .. } => self.err("", None, plan_reason(e)),
        }
    }

    /// The gate of each micro-batch from `[accumulation]`.
    fn gates(&self, a: &raw::Accumulation) -> Result<Vec<Gate>, ConfigError> {
        if let Some(g) = &a.gates {
            if a.replicate_gate.is_some() || a.reduce_gate.is_some() {
                return Err(self.err(
                    "accumulation.gates",
                    Some(g.span()),
                    "`gates` cannot be combined with `replicate_gate` or `reduce_gate`; give either `gates` or the two lists",
                ));
            }
        }
        // Values first, so a typo is reported at its element.
        let flags =
            |name: &str, list: &Option<raw::Names>| -> Result<Option<Vec<bool>>, ConfigError> {
                let Some(list) = list else { return Ok(None) };
                let values =
                    list.get_ref()
                        .iter()
                        .enumerate()
                        .map(|(i, v)| match v.get_ref().as_str() {
                            "on" => Ok(true),
                            "off" => Ok(false),
                            other => Err(self.err(
                                format!("accumulation.{name}[{i}]"),
                                Some(v.span()),
                                format!("unknown gate value `{other}`; expected \"on\" or \"off\""),
                            )),
                        });
                values.collect::<Result<Vec<_>, _>>().map(Some)
            };
        let replicate = flags("replicate_gate", &a.replicate_gate)?;
        let reduce = flags("reduce_gate", &a.reduce_gate)?;
        let combined = match &a.gates {
            None => None,
            Some(list) => Some(
                list.get_ref()
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        Gate::parse(v.get_ref()).map_err(|reason| {
                            self.err(format!("accumulation.gates[{i}]"), Some(v.span()), reason)
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        // The number of micro-batches: given, else the first list's length, else 1.
        let lists = [
            ("gates", &a.gates),
            ("replicate_gate", &a.replicate_gate),
            ("reduce_gate", &a.reduce_gate),
        ];
        let given: Vec<(&str, &raw::Names)> = lists
            .iter()
            .filter_map(|&(n, l)| l.as_ref().map(|l| (n, l)))
            .collect();
        let m = match (&a.micro_batches, given.first()) {
            (Some(mb), _) if *mb.get_ref() == 0 => {
                return Err(self.err(
                    "accumulation.micro_batches",
                    Some(mb.span()),
                    "must be at least 1 (a step needs a micro-batch)",
                ))
            }
            (Some(mb), _) => *mb.get_ref() as usize,
            (None, Some(&(name, list))) if list.get_ref().is_empty() => {
                return Err(self.err(
                    format!("accumulation.{name}"),
                    Some(list.span()),
                    "the list is empty; a step needs at least one micro-batch",
                ))
            }
            (None, Some((_, list))) => list.get_ref().len(),
            (None, None) => 1,
        };
        if m > MAX_MICRO_BATCHES {
            let (key, span) = match (&a.micro_batches, given.first()) {
                (Some(mb), _) => ("accumulation.micro_batches".to_string(), mb.span()),
                (None, Some(&(name, list))) => (format!("accumulation.{name}"), list.span()),
                (None, None) => ("accumulation.micro_batches".to_string(), 0..0),
            };
            return Err(self.err(
                key,
                Some(span),
                format!("{m} micro-batches, more than the limit of {MAX_MICRO_BATCHES}"),
            ));
        }
        for &(name, list) in &given {
            let n = list.get_ref().len();
            if n != m {
                let source = match (&a.micro_batches, given.first()) {
                    (Some(_), _) | (None, None) => format!("micro_batches is {m}"),
                    (None, Some((first, _))) => format!("`{first}` has {m}"),
                };
                return Err(self.err(
                    format!("accumulation.{name}"),
                    Some(list.span()),
                    format!("has {n} entries but {source}; give one entry per micro-batch"),
                ));
            }
        }
        if let Some(g) = combined {
            return Ok(g);
        }
        Ok((0..m)
            .map(|i| {
                let rep = replicate.as_ref().map_or(i + 1 == m, |v| v[i]);
                let red = reduce.as_ref().map_or(true, |v| v[i]);
                Gate::from_flags(red, rep)
            })
            .collect())
    }

    fn transport(&self, raw: &raw::Overlap) -> Result<TransportChoice, ConfigError> {
        Ok(match &raw.transport {
            None => TransportChoice::default(),
            Some(t) => match t.get_ref().as_str() {
                "auto" => TransportChoice::Auto,
                "nccl" => TransportChoice::Nccl,
                "copy" => TransportChoice::Copy,
                other => {
                    return Err(self.err(
                        "overlap.transport",
                        Some(t.span()),
                        format!("unknown transport `{other}`; expected auto, nccl or copy"),
                    ))
                }
            },
        })
    }

    fn bindings(&self, raw: &raw::Streams) -> Result<Bindings, ConfigError> {
        let mut b = Bindings::default();
        let slots: [(&str, &Option<Spanned<String>>, &mut Stream); 11] = [
            ("accumulate", &raw.accumulate, &mut b.accumulate),
            ("pack", &raw.pack, &mut b.pack),
            ("stage1", &raw.stage1, &mut b.stage1),
            ("fold", &raw.fold, &mut b.fold),
            ("stage2", &raw.stage2, &mut b.stage2),
            ("unpack", &raw.unpack, &mut b.unpack),
            ("optimizer", &raw.optimizer, &mut b.optimizer),
            ("publish", &raw.publish, &mut b.publish),
            ("combine", &raw.combine, &mut b.combine),
            ("exchange", &raw.exchange, &mut b.exchange),
            ("unshard", &raw.unshard, &mut b.unshard),
        ];
        for (name, value, slot) in slots {
            if let Some(v) = value {
                *slot = Stream::parse(v.get_ref()).map_err(|reason| {
                    self.err(format!("streams.{name}"), Some(v.span()), reason)
                })?;
            }
        }
        Ok(b)
    }

    fn run(&self, raw: raw::Run) -> Result<RunConfig, ConfigError> {
        let d = RunConfig::default();
        let backend = match raw.backend {
            None => d.backend,
            Some(b) => b
                .get_ref()
                .parse()
                .map_err(|reason: String| self.err("run.backend", Some(b.span()), reason))?,
        };
        let grads = match raw.grads {
            None => d.grads,
            Some(g) => g
                .get_ref()
                .parse()
                .map_err(|reason: String| self.err("run.grads", Some(g.span()), reason))?,
        };
        Ok(RunConfig {
            grads,
            steps: self.at_least_one("run.steps", raw.steps, d.steps)?,
            seed: raw.seed.unwrap_or(d.seed),
            backend,
            backward_us_per_layer: match raw.backward_us_per_layer {
                None => d.backward_us_per_layer,
                Some(v) if *v.get_ref() > MAX_BACKWARD_US => {
                    return Err(self.err(
                        "run.backward_us_per_layer",
                        Some(v.span()),
                        format!(
                            "must be at most {MAX_BACKWARD_US} (one second per layer), got {}",
                            v.get_ref()
                        ),
                    ))
                }
                Some(v) => v.into_inner(),
            },
            step_timeout_s: match raw.step_timeout {
                None => d.step_timeout_s,
                Some(v) if *v.get_ref() == 0 => d.step_timeout_s,
                Some(v) if *v.get_ref() > MAX_STEP_TIMEOUT_S => {
                    return Err(self.err(
                        "run.step_timeout",
                        Some(v.span()),
                        format!(
                            "must be at most {MAX_STEP_TIMEOUT_S} seconds (a day; 0 means the default {DEFAULT_STEP_TIMEOUT_S}), got {}",
                            v.get_ref()
                        ),
                    ))
                }
                Some(v) => v.into_inner(),
            },
        })
    }

    /// An optional integer between 1 and `max` (`unit` follows `max` in the error).
    fn between(
        &self,
        key: &str,
        v: &Option<Spanned<u32>>,
        max: u32,
        unit: &str,
    ) -> Result<Option<u32>, ConfigError> {
        match v {
            Some(v) if *v.get_ref() == 0 || *v.get_ref() > max => Err(self.err(
                key,
                Some(v.span()),
                format!("must be between 1 and {max}{unit}, got {}", v.get_ref()),
            )),
            v => Ok(v.as_ref().map(|v| *v.get_ref())),
        }
    }

    fn at_least_one(
        &self,
        key: &str,
        v: Option<Spanned<u32>>,
        default: u32,
    ) -> Result<u32, ConfigError> {
        match v {
            None => Ok(default),
            Some(v) if *v.get_ref() == 0 => {
                Err(self.err(key, Some(v.span()), "must be at least 1"))
            }
            Some(v) => Ok(v.into_inner()),
        }
    }

    fn adamw(&self, raw: &raw::Adamw) -> Result<AdamwParams, ConfigError> {
        let d = AdamwParams::default();
        let k = |name: &str| format!("optimizer.adamw.{name}");
        Ok(AdamwParams::default()
            .with_lr(self.float(&k("lr"), &raw.lr, d.lr, Bound::NonNegative)?)
            .with_beta1(self.float(&k("beta1"), &raw.beta1, d.beta1, Bound::Fraction)?)
            .with_beta2(self.float(&k("beta2"), &raw.beta2, d.beta2, Bound::Fraction)?)
            .with_eps(self.float(&k("eps"), &raw.eps, d.eps, Bound::Positive)?)
            .with_weight_decay(self.float(
                &k("weight_decay"),
                &raw.weight_decay,
                d.weight_decay,
                Bound::NonNegative,
            )?))
    }

    fn muon(&self, raw: &raw::Muon) -> Result<MuonParams, ConfigError> {
        let d = MuonParams::default();
        let k = |name: &str| format!("optimizer.muon.{name}");
        Ok(MuonParams::default()
            .with_lr(self.float(&k("lr"), &raw.lr, d.lr, Bound::NonNegative)?)
            .with_momentum(self.float(
                &k("momentum"),
                &raw.momentum,
                d.momentum,
                Bound::Fraction,
            )?)
            .with_ns_steps(
                self.between(&k("ns_steps"), &raw.ns_steps, MAX_NS_STEPS, " iterations")?
                    .unwrap_or(d.ns_steps),
            )
            .with_weight_decay(self.float(
                &k("weight_decay"),
                &raw.weight_decay,
                d.weight_decay,
                Bound::NonNegative,
            )?)
            .with_ns_dtype(
                self.ns_dtype(&k("ns_dtype"), &raw.ns_dtype)?
                    .unwrap_or(d.ns_dtype),
            ))
    }

    /// Newton–Schulz's precision on a GPU (`"bf16"`, `"tf32"` or `"f32"`), if set.
    fn ns_dtype(
        &self,
        key: &str,
        v: &Option<Spanned<String>>,
    ) -> Result<Option<NsDtype>, ConfigError> {
        let Some(v) = v else { return Ok(None) };
        NsDtype::parse(v.get_ref()).map(Some).ok_or_else(|| {
            self.err(
                key,
                Some(v.span()),
                format!(
                    "must be \"bf16\", \"tf32\" or \"f32\", got \"{}\"",
                    v.get_ref()
                ),
            )
        })
    }

    /// A finite `f32` hyper-parameter within `bound`, or its default.
    fn float(
        &self,
        key: &str,
        v: &Option<Spanned<f64>>,
        default: f32,
        bound: Bound,
    ) -> Result<f32, ConfigError> {
        let Some(v) = v else { return Ok(default) };
        let x = *v.get_ref();
        let fail = |what: &str| {
            Err(self.err(
                key,
                Some(v.span()),
                format!("must be a finite number {what}, got {x}"),
            ))
        };
        // Narrowing to f32 is the point: a value f32 cannot hold is out of range.
        let y = x as f32;
        if !y.is_finite() {
            return fail(bound.describe());
        }
        let ok = match bound {
            Bound::NonNegative => y >= 0.0,
            Bound::Positive => y > 0.0,
            Bound::Fraction => (0.0..1.0).contains(&y),
        };
        if ok {
            Ok(y)
        } else {
            fail(bound.describe())
        }
    }

    fn metrics(&self, raw: raw::Metrics) -> Result<MetricsConfig, ConfigError> {
        let listen = match raw.listen {
            None => None,
            Some(l) => Some(l.get_ref().parse::<SocketAddr>().map_err(|e| {
                self.err(
                    "metrics.listen",
                    Some(l.span()),
                    format!("`{}` is not a socket address ({e}); give an IP address and port, e.g. \"127.0.0.1:9464\" or \"[::]:9464\"", l.get_ref()),
                )
            })?),
        };
        let timing_every = self
            .between(
                "metrics.timing_every",
                &raw.timing_every,
                MAX_TIMING_EVERY,
                " steps",
            )?
            .unwrap_or(MetricsConfig::default().timing_every);
        Ok(MetricsConfig {
            listen,
            timing_every,
        })
    }
}

/// The range a float hyper-parameter must lie in.
#[derive(Clone, Copy)]
enum Bound {
    NonNegative,
    Positive,
    Fraction,
}

impl Bound {
    fn describe(self) -> &'static str {
        match self {
            Bound::NonNegative => ">= 0",
            Bound::Positive => "> 0",
            Bound::Fraction => "in [0, 1)",
        }
    }
}

/// The reason inside a [`PlanError`], without its category prefix.
/// The rates that balance owners by optimizer time ([`UpdateRates`]): the memory rate of
/// the H200 profile and the Newton–Schulz rate of the dtype most of the Muon products
/// run in (by floating-point operations, each parameter with its own `ns_dtype` and
/// `ns_steps` as the optimizer groups resolve them): bf16 at the profile's 739 TFLOP/s
/// GEMM rate, TF32 at half of it (the H200 datasheet's ratio of dense TF32 to bf16), f32
/// at its 50 TFLOP/s.
fn update_rates(
    (adamw, muon): (AdamwParams, MuonParams),
    groups: &[ParamGroup],
    params: &[ParamSpec],
) -> UpdateRates {
    // The groups were checked against these parameters already.
    let Some(runs) = newton_schulz_runs((adamw, muon), groups, params) else {
        return UpdateRates::default();
    };
    let mut flops = [0.0f64; 3];
    for (p, (dtype, steps)) in params.iter().zip(runs) {
        if p.route != Route::Muon {
            continue;
        }
        let (rows, cols) = p.matrix_dims();
        let slot = match dtype {
            NsDtype::Bf16 => 0,
            NsDtype::Tf32 => 1,
            NsDtype::F32 => 2,
        };
        flops[slot] += overlap_graph::owner::ns_flops(rows, cols, steps);
    }
    let gflops = [739_000, 369_500, 50_000];
    let most = (0..3).fold(0, |best, i| if flops[i] > flops[best] { i } else { best });
    UpdateRates::default().with_ns_gflops(gflops[most])
}

/// Per parameter, the precision and iteration count of its Newton–Schulz as the
/// optimizer groups resolve them (every parameter, whatever its route); `None` when
/// the groups do not resolve against `params`.
fn newton_schulz_runs(
    (adamw, muon): (AdamwParams, MuonParams),
    groups: &[ParamGroup],
    params: &[ParamSpec],
) -> Option<Vec<(NsDtype, u32)>> {
    let table = HyperTable::resolve(adamw, muon, groups, params).ok()?;
    let runs = (0..params.len())
        .map(|id| {
            let hp = table.muon(id as overlap_graph::ParamId, 1.0);
            (hp.ns_dtype, hp.ns_steps)
        })
        .collect();
    Some(runs)
}

fn plan_reason(e: PlanError) -> String {
    match e {
        PlanError::Mesh(r) | PlanError::Model(r) | PlanError::Json(r) => r,
        PlanError::Param { reason, .. }
        | PlanError::Input { reason, .. }
        | PlanError::Malformed { reason, .. } => reason,
    }
}

/// A key or value of the document, with its dotted path.
struct Entry {
    path: String,
    key: Option<Range<usize>>,
    value: Range<usize>,
}

fn collect_keys(table: &DeTable<'_>, prefix: &str, out: &mut Vec<Entry>) {
    for (k, v) in table.iter() {
        let path = join_key(prefix, k.get_ref());
        out.push(Entry {
            path: path.clone(),
            key: Some(k.span()),
            value: v.span(),
        });
        collect_value(v, &path, out);
    }
}

fn collect_value(v: &Spanned<DeValue<'_>>, path: &str, out: &mut Vec<Entry>) {
    match v.get_ref() {
        DeValue::Table(t) => collect_keys(t, path, out),
        DeValue::Array(a) => {
            for (i, e) in a.iter().enumerate() {
                let p = format!("{path}[{i}]");
                out.push(Entry {
                    path: p.clone(),
                    key: None,
                    value: e.span(),
                });
                collect_value(e, &p, out);
            }
        }
        _ => {}
    }
}

/// `prefix.key`, quoting a key that is not a bare TOML key.
fn join_key(prefix: &str, key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    let key = if bare {
        key.to_string()
    } else {
        format!("{key:?}")
    };
    if prefix.is_empty() {
        key
    } else {
        format!("{prefix}.{key}")
    }
}

/// Rewrites serde's messages in the config's words.
fn humanize(msg: &str) -> String {
    if let Some(rest) = msg.strip_prefix("unknown field `") {
        if let Some((name, allowed)) = rest.split_once('`') {
            let allowed = allowed.trim_start_matches(", ");
            let allowed = allowed
                .strip_prefix("expected one of ")
                .or_else(|| allowed.strip_prefix("expected "))
                .map(|a| a.replace(" or ", ", ").replace('`', ""))
                .unwrap_or_else(|| "none".to_string());
            return format!("unknown key `{name}`; allowed keys here: {allowed}");
        }
    }
    if let Some(rest) = msg.strip_prefix("unknown variant `") {
        if let Some((name, allowed)) = rest.split_once('`') {
            let allowed = allowed
                .trim_start_matches(", ")
                .trim_start_matches("expected ")
                .trim_start_matches("one of ");
            return format!("unknown value `{name}`; expected {allowed}");
        }
    }
    if let Some(field) = msg
        .strip_prefix("missing field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        return format!("missing required key `{field}`");
    }
    for (prefix, word) in [
        ("invalid type: ", "wrong type"),
        ("invalid value: ", "out of range"),
    ] {
        if let Some(rest) = msg.strip_prefix(prefix) {
            if let Some((found, expected)) = rest.split_once(", expected ") {
                return format!(
                    "{word}: found {}, expected {}",
                    found
                        .replace("map", "a table")
                        .replace("sequence", "an array"),
                    expected_in_words(expected)
                );
            }
        }
    }
    msg.to_string()
}

/// serde's name of an expected type, as a user would say it.
fn expected_in_words(expected: &str) -> String {
    match expected {
        "u32" => "a whole number from 0 to 4294967295".into(),
        "u64" => "a whole number >= 0".into(),
        "f64" => "a number".into(),
        "a string" => "a string (in quotes)".into(),
        "a sequence" => "an array".into(),
        other => other
            .replace("struct ", "a table ")
            .replace("map", "a table"),
    }
}

/// The file as serde sees it: every field keeps its span so checks can point at it.
mod raw {
    use overlap_graph::{DType, ReduceOp};
    use serde::Deserialize;
    use serde_spanned::Spanned;

    /// A list of strings with the span of the list and of each element.
    pub(super) type Names = Spanned<Vec<Spanned<String>>>;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Root {
        pub mesh: Option<Spanned<Mesh>>,
        pub model: Option<Spanned<Model>>,
        #[serde(default)]
        pub param: Vec<Spanned<Param>>,
        #[serde(default)]
        pub buckets: Buckets,
        #[serde(default)]
        pub accumulation: Accumulation,
        #[serde(default)]
        pub reduce: Reduce,
        #[serde(default)]
        pub run: Run,
        #[serde(default)]
        pub overlap: Overlap,
        #[serde(default)]
        pub streams: Streams,
        #[serde(default)]
        pub optimizer: Optimizer,
        #[serde(default)]
        pub metrics: Metrics,
        pub schedule: Option<Spanned<Schedule>>,
        pub clip: Option<Spanned<Clip>>,
        pub forward: Option<Spanned<Forward>>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Mesh {
        pub shard: Spanned<u32>,
        pub replicate: Spanned<u32>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Model {
        pub layers: Spanned<u32>,
        pub hidden: Spanned<u64>,
        pub vocab: Spanned<u64>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Param {
        pub name: Spanned<String>,
        pub shape: Spanned<Vec<u64>>,
        pub route: Spanned<String>,
        pub layer: Option<Spanned<u32>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Buckets {
        pub cap_bytes: Option<Spanned<u64>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Accumulation {
        pub micro_batches: Option<Spanned<u32>>,
        pub replicate_gate: Option<Names>,
        pub reduce_gate: Option<Names>,
        pub gates: Option<Names>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Reduce {
        pub op: Option<Spanned<ReduceOp>>,
        pub dtype: Option<Spanned<DType>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Run {
        pub steps: Option<Spanned<u32>>,
        pub seed: Option<u64>,
        pub backend: Option<Spanned<String>>,
        pub backward_us_per_layer: Option<Spanned<u32>>,
        pub step_timeout: Option<Spanned<u32>>,
        pub grads: Option<Spanned<String>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Overlap {
        pub stage1_window: Option<Spanned<u32>>,
        pub transport: Option<Spanned<String>>,
        pub combine_lag: Option<Spanned<u32>>,
        pub copy_slot_mib: Option<Spanned<u32>>,
        pub copy_ring_depth: Option<Spanned<u32>>,
        pub nccl_max_ctas: Option<Spanned<u32>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Streams {
        pub accumulate: Option<Spanned<String>>,
        pub pack: Option<Spanned<String>>,
        pub stage1: Option<Spanned<String>>,
        pub fold: Option<Spanned<String>>,
        pub stage2: Option<Spanned<String>>,
        pub unpack: Option<Spanned<String>>,
        pub optimizer: Option<Spanned<String>>,
        pub publish: Option<Spanned<String>>,
        pub combine: Option<Spanned<String>>,
        pub exchange: Option<Spanned<String>>,
        pub unshard: Option<Spanned<String>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Optimizer {
        #[serde(default)]
        pub adamw: Adamw,
        #[serde(default)]
        pub muon: Muon,
        #[serde(default)]
        pub group: Vec<Spanned<Group>>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Group {
        #[serde(rename = "match")]
        pub pattern: Spanned<String>,
        pub lr_scale: Option<Spanned<f64>>,
        pub weight_decay: Option<Spanned<f64>>,
        pub beta1: Option<Spanned<f64>>,
        pub beta2: Option<Spanned<f64>>,
        pub eps: Option<Spanned<f64>>,
        pub momentum: Option<Spanned<f64>>,
        pub ns_steps: Option<Spanned<u32>>,
        pub ns_dtype: Option<Spanned<String>>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Schedule {
        pub kind: Spanned<String>,
        pub warmup_steps: Option<Spanned<u64>>,
        pub total_steps: Option<Spanned<u64>>,
        pub final_lr_frac: Option<Spanned<f64>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Adamw {
        pub lr: Option<Spanned<f64>>,
        pub beta1: Option<Spanned<f64>>,
        pub beta2: Option<Spanned<f64>>,
        pub eps: Option<Spanned<f64>>,
        pub weight_decay: Option<Spanned<f64>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Muon {
        pub lr: Option<Spanned<f64>>,
        pub momentum: Option<Spanned<f64>>,
        pub ns_steps: Option<Spanned<u32>>,
        pub weight_decay: Option<Spanned<f64>>,
        pub ns_dtype: Option<Spanned<String>>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Forward {
        pub prefetch: Option<Spanned<u32>>,
        pub reshard_after_forward: Option<bool>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Clip {
        pub max_norm: Option<Spanned<f64>>,
        pub on_nonfinite: Option<Spanned<String>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Metrics {
        pub listen: Option<Spanned<String>>,
        pub timing_every: Option<Spanned<u32>>,
    }
}
