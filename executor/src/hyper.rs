//! Optimizer hyper-parameters per parameter: parameter groups chosen by name, and the
//! learning-rate schedule.
//!
//! A [`ParamGroup`] overrides some of the base [`AdamwParams`] / [`MuonParams`] for the
//! parameters whose names match its glob pattern ([`glob_match`]: `*` any run of
//! characters, `?` one character, anything else itself). Each parameter belongs to the
//! first group that matches it, or to none (the base settings). [`HyperTable::resolve`]
//! does that once for a session's parameters; the executor then asks it for the
//! hyper-parameters of each optimizer launch, with the step's learning-rate factor.
//!
//! The learning rate a parameter's optimizer uses in step `t` is
//! `base lr × lr_scale of its group × factor(t)`, where the base lr is `AdamwParams::lr`
//! or `MuonParams::lr` (by the parameter's route), `lr_scale` is 1 outside any group, and
//! the factor is the [`LrSchedule`]'s (or the trainer's, when it sets one). The product
//! is computed in `f64` and rounded to `f32` once.
//!
//! Invariant: everything here is a pure function of its inputs; nothing panics on any
//! input (a bad group or schedule is an error value naming the key).

use std::fmt;

use overlap_graph::{OptimizerKind, ParamId, ParamSpec, Route};
use overlap_ops::{AdamwParams, MuonParams, NsDtype};

/// Optimizer settings for the parameters whose names match `pattern` (the first group
/// that matches a parameter wins). Settings left `None` keep the base value; each
/// applies to the parameters of the optimizer it belongs to (`beta1`, `beta2`, `eps`:
/// AdamW; `momentum`, `ns_steps`, `ns_dtype`: Muon; `lr_scale` and `weight_decay`: both).
///
/// Build one with [`ParamGroup::new`] and the `with_*` methods.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ParamGroup {
    /// A glob over the parameter name: `*` any run of characters (dots too), `?` one
    /// character, every other character itself ([`glob_match`]).
    pub pattern: String,
    /// Multiplies the base learning rate (≥ 0, finite; default 1).
    pub lr_scale: f32,
    /// Decoupled weight decay (≥ 0), for both optimizers.
    pub weight_decay: Option<f32>,
    /// AdamW's first-moment decay, in [0, 1).
    pub beta1: Option<f32>,
    /// AdamW's second-moment decay, in [0, 1).
    pub beta2: Option<f32>,
    /// AdamW's denominator epsilon (> 0).
    pub eps: Option<f32>,
    /// Muon's momentum, in [0, 1).
    pub momentum: Option<f32>,
    /// Muon's Newton–Schulz iterations (≥ 1).
    pub ns_steps: Option<u32>,
    /// The precision of Muon's Newton–Schulz on a GPU.
    pub ns_dtype: Option<NsDtype>,
}

impl ParamGroup {
    /// A group of `pattern` that changes nothing yet (`lr_scale` 1, every other setting
    /// the base's).
    pub fn new(pattern: impl Into<String>) -> Self {
        ParamGroup {
            pattern: pattern.into(),
            lr_scale: 1.0,
            weight_decay: None,
            beta1: None,
            beta2: None,
            eps: None,
            momentum: None,
            ns_steps: None,
            ns_dtype: None,
        }
    }

    /// The same group with another [`ParamGroup::lr_scale`] (multiplies the base learning
    /// rate).
    pub fn with_lr_scale(mut self, lr_scale: f32) -> Self {
        self.lr_scale = lr_scale;
        self
    }

    /// The same group with another [`ParamGroup::weight_decay`] (`None`: the base's).
    pub fn with_weight_decay(mut self, weight_decay: Option<f32>) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// The same group with another [`ParamGroup::beta1`] (`None`: the base's).
    pub fn with_beta1(mut self, beta1: Option<f32>) -> Self {
        self.beta1 = beta1;
        self
    }

    /// The same group with another [`ParamGroup::beta2`] (`None`: the base's).
    pub fn with_beta2(mut self, beta2: Option<f32>) -> Self {
        self.beta2 = beta2;
        self
    }

    /// The same group with another [`ParamGroup::eps`] (`None`: the base's).
    pub fn with_eps(mut self, eps: Option<f32>) -> Self {
        self.eps = eps;
        self
    }

    /// The same group with another [`ParamGroup::momentum`] (`None`: the base's).
    pub fn with_momentum(mut self, momentum: Option<f32>) -> Self {
        self.momentum = momentum;
        self
    }

    /// The same group with another [`ParamGroup::ns_steps`] (`None`: the base's).
    pub fn with_ns_steps(mut self, ns_steps: Option<u32>) -> Self {
        self.ns_steps = ns_steps;
        self
    }

    /// The same group with another [`ParamGroup::ns_dtype`] (`None`: the base's).
    pub fn with_ns_dtype(mut self, ns_dtype: Option<NsDtype>) -> Self {
        self.ns_dtype = ns_dtype;
        self
    }

    /// Checks every setting's range; the error names the setting (`lr_scale`, `beta1`,
    /// ...; `match` for an empty pattern).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.pattern.is_empty() {
            return Err(("match", "the pattern is empty".into()));
        }
        const NON_NEGATIVE: &str = ">= 0";
        const FRACTION: &str = "in [0, 1)";
        const POSITIVE: &str = "> 0";
        let checks = [
            ("lr_scale", Some(self.lr_scale), NON_NEGATIVE),
            ("weight_decay", self.weight_decay, NON_NEGATIVE),
            ("beta1", self.beta1, FRACTION),
            ("beta2", self.beta2, FRACTION),
            ("eps", self.eps, POSITIVE),
            ("momentum", self.momentum, FRACTION),
        ];
        for (key, value, what) in checks {
            let Some(x) = value else { continue };
            let ok = x.is_finite()
                && match what {
                    NON_NEGATIVE => x >= 0.0,
                    FRACTION => (0.0..1.0).contains(&x),
                    _ => x > 0.0,
                };
            if !ok {
                return Err((key, format!("must be a finite number {what}, got {x}")));
            }
        }
        if self.ns_steps == Some(0) {
            return Err(("ns_steps", "must be at least 1".into()));
        }
        Ok(())
    }

    /// The settings this group changes, as `key = value` pairs (for listings).
    pub fn settings(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if self.lr_scale != 1.0 {
            out.push(("lr_scale", self.lr_scale.to_string()));
        }
        let floats = [
            ("weight_decay", self.weight_decay),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("momentum", self.momentum),
        ];
        for (k, v) in floats {
            if let Some(v) = v {
                out.push((k, v.to_string()));
            }
        }
        if let Some(n) = self.ns_steps {
            out.push(("ns_steps", n.to_string()));
        }
        if let Some(d) = self.ns_dtype {
            out.push(("ns_dtype", d.name().to_string()));
        }
        out
    }
}

/// Whether `name` matches the glob `pattern`: `*` matches any run of characters (empty,
/// and dots included), `?` exactly one character, any other character itself. The whole
/// name must match (`*.bias` matches `blocks.0.bias`, not `blocks.0.bias_scale`).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    let (mut i, mut j) = (0usize, 0usize);
    // The last `*` seen, and the name position it was tried at: on a mismatch the `*`
    // takes one more character (linear backtracking, enough for a single-star-class glob).
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        match p.get(i) {
            Some('*') => {
                star = Some((i, j));
                i += 1;
            }
            Some(&c) if c == '?' || c == n[j] => {
                i += 1;
                j += 1;
            }
            _ => match star {
                Some((si, sj)) => {
                    i = si + 1;
                    j = sj + 1;
                    star = Some((si, sj + 1));
                }
                None => return false,
            },
        }
    }
    p[i.min(p.len())..].iter().all(|&c| c == '*')
}

/// The shape of a learning-rate schedule ([`LrSchedule`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScheduleKind {
    /// Factor 1 after the warm-up.
    #[default]
    Constant,
    /// Linear decay from 1 to the floor between the warm-up's end and `total_steps`.
    Linear,
    /// Cosine decay from 1 to the floor between the warm-up's end and `total_steps`.
    Cosine,
}

impl ScheduleKind {
    /// Every kind, in the order the docs list them.
    pub const ALL: [ScheduleKind; 3] = [
        ScheduleKind::Constant,
        ScheduleKind::Cosine,
        ScheduleKind::Linear,
    ];

    /// The name in configs: `constant`, `cosine`, `linear`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Linear => "linear",
            ScheduleKind::Cosine => "cosine",
        }
    }

    /// Parses a name; the error lists the valid ones.
    pub fn parse(s: &str) -> Result<ScheduleKind, String> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown schedule `{s}`; expected constant, cosine or linear"))
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A learning-rate schedule: a factor of the step number that multiplies every
/// parameter's learning rate. Steps are numbered from 1 (the first step). With
/// `W = warmup_steps`, `T = total_steps`, `r = final_lr_frac`:
///
/// - warm-up, `t ≤ W`: `factor = t / W` (so step 1 already moves, and step `W` is at 1);
/// - `constant`: `factor = 1` after the warm-up;
/// - `linear` / `cosine`, `W < t ≤ T`: with `p = (t − W) / (T − W)`,
///   `factor = 1 − (1 − r)·p` (linear) or `r + (1 − r)·(1 + cos(π·p))/2` (cosine);
/// - after `T`: `factor = r`.
///
/// A pure function of the step, so a run resumed at step `k` gets the rates it would
/// have had.
///
/// Build one with [`LrSchedule::constant`] or [`LrSchedule::decay`], then
/// [`LrSchedule::with_warmup`]; [`LrSchedule::check`] says whether it is valid.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct LrSchedule {
    /// The shape after the warm-up.
    pub kind: ScheduleKind,
    /// Steps of linear warm-up (0: none).
    pub warmup_steps: u64,
    /// The step at which the decay reaches the floor (warm-up included); more than
    /// `warmup_steps` for `linear` and `cosine`, unused by `constant`.
    pub total_steps: u64,
    /// The floor, as a fraction of the peak rate, in [0, 1]; unused by `constant`.
    pub final_lr_frac: f64,
}

impl Default for LrSchedule {
    /// Constant, no warm-up: factor 1 at every step.
    fn default() -> Self {
        LrSchedule {
            kind: ScheduleKind::Constant,
            warmup_steps: 0,
            total_steps: 0,
            final_lr_frac: 0.0,
        }
    }
}

impl LrSchedule {
    /// Factor 1 at every step (after a warm-up, if one is added).
    pub fn constant() -> LrSchedule {
        LrSchedule::default()
    }

    /// A decay of shape `kind` (`Linear` or `Cosine`) from the peak rate at the end of
    /// the warm-up to `final_lr_frac` of it at step `total_steps`.
    pub fn decay(kind: ScheduleKind, total_steps: u64, final_lr_frac: f64) -> LrSchedule {
        LrSchedule {
            kind,
            total_steps,
            final_lr_frac,
            ..LrSchedule::default()
        }
    }

    /// The same schedule after `steps` steps of linear warm-up.
    pub fn with_warmup(mut self, steps: u64) -> LrSchedule {
        self.warmup_steps = steps;
        self
    }

    /// The factor of 1-based `step` (step 0 counts as step 1).
    pub fn factor(&self, step: u64) -> f64 {
        let t = step.max(1);
        let w = self.warmup_steps;
        if t <= w {
            return t as f64 / w as f64;
        }
        let r = self.final_lr_frac;
        match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear | ScheduleKind::Cosine => {
                if t >= self.total_steps || self.total_steps <= w {
                    return r;
                }
                let p = (t - w) as f64 / (self.total_steps - w) as f64;
                match self.kind {
                    ScheduleKind::Linear => 1.0 - (1.0 - r) * p,
                    _ => r + (1.0 - r) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
                }
            }
        }
    }

    /// Checks the schedule; the error names the key (`total_steps`, `final_lr_frac`).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.kind == ScheduleKind::Constant {
            return Ok(());
        }
        if self.total_steps <= self.warmup_steps {
            return Err((
                "total_steps",
                format!(
                    "must be greater than warmup_steps ({}) for a {} decay, got {}",
                    self.warmup_steps, self.kind, self.total_steps
                ),
            ));
        }
        let r = self.final_lr_frac;
        if !(r.is_finite() && (0.0..=1.0).contains(&r)) {
            return Err((
                "final_lr_frac",
                format!("must be a finite number in [0, 1], got {r}"),
            ));
        }
        Ok(())
    }
}

/// Why groups could not be resolved against the parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupError {
    /// A setting of group `group` is out of range.
    Setting {
        /// The group's index.
        group: usize,
        /// The setting (`lr_scale`, `beta1`, ..., `match`).
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Group `group` gets no parameter: its pattern matches none, or only parameters an
    /// earlier group took (first match wins).
    Unmatched {
        /// The group's index.
        group: usize,
        /// What it matched, and why it got nothing.
        reason: String,
    },
}

impl fmt::Display for GroupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupError::Setting { group, key, reason } => {
                write!(f, "optimizer group {group}: `{key}`: {reason}")
            }
            GroupError::Unmatched { group, reason } => {
                write!(f, "optimizer group {group}: `match`: {reason}")
            }
        }
    }
}

/// One parameter's settings before the learning-rate factor.
#[derive(Debug, Clone, Copy)]
struct ParamHyper {
    group: Option<usize>,
    optimizer: OptimizerKind,
    adamw: AdamwParams,
    muon: MuonParams,
    /// Base lr × lr_scale of the parameter's optimizer, unrounded.
    lr: f64,
}

/// The learning rate in effect for a group's parameters of one optimizer.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupRate {
    /// The group's index, `None` for the parameters in no group (the base settings).
    pub group: Option<usize>,
    /// The group's pattern, or `base`.
    pub label: String,
    /// Which optimizer's parameters.
    pub optimizer: OptimizerKind,
    /// The rate: base lr × lr_scale × factor.
    pub lr: f64,
}

/// The optimizer name of a kind (`adamw`, `muon`), as metrics and listings show it.
pub fn optimizer_name(kind: OptimizerKind) -> &'static str {
    match kind {
        OptimizerKind::Adamw => "adamw",
        OptimizerKind::Muon => "muon",
    }
}

/// Every parameter's optimizer settings, resolved once from the base settings and the
/// groups ([`HyperTable::resolve`]).
#[derive(Debug, Clone)]
pub struct HyperTable {
    adamw: AdamwParams,
    muon: MuonParams,
    groups: Vec<ParamGroup>,
    params: Vec<ParamHyper>,
    /// (group, optimizer, base lr × lr_scale) for every pair that has a parameter, groups
    /// in order and the base last.
    rates: Vec<(Option<usize>, OptimizerKind, f64)>,
}

impl HyperTable {
    /// The base settings for every parameter (no groups).
    pub fn base(adamw: AdamwParams, muon: MuonParams) -> Self {
        HyperTable {
            adamw,
            muon,
            groups: Vec::new(),
            params: Vec::new(),
            rates: Vec::new(),
        }
    }

    /// Resolves `groups` for `params` (in parameter-id order): each parameter gets the
    /// first group whose pattern matches its name. A group whose settings are out of
    /// range, or that gets no parameter, is an error.
    pub fn resolve<'a>(
        adamw: AdamwParams,
        muon: MuonParams,
        groups: &[ParamGroup],
        params: impl IntoIterator<Item = &'a ParamSpec>,
    ) -> Result<Self, GroupError> {
        for (i, g) in groups.iter().enumerate() {
            g.check().map_err(|(key, reason)| GroupError::Setting {
                group: i,
                key,
                reason,
            })?;
        }
        let params: Vec<&ParamSpec> = params.into_iter().collect();
        let mut table = HyperTable {
            adamw,
            muon,
            groups: groups.to_vec(),
            params: Vec::with_capacity(params.len()),
            rates: Vec::new(),
        };
        let mut members = vec![0usize; groups.len()];
        for p in &params {
            let group = groups.iter().position(|g| glob_match(&g.pattern, &p.name));
            if let Some(g) = group {
                members[g] += 1;
            }
            let optimizer = match p.route {
                Route::Muon => OptimizerKind::Muon,
                _ => OptimizerKind::Adamw,
            };
            table.params.push(table.settle(group, optimizer));
        }
        for (i, g) in groups.iter().enumerate() {
            if members[i] > 0 {
                continue;
            }
            let matched: Vec<&str> = params
                .iter()
                .filter(|p| glob_match(&g.pattern, &p.name))
                .map(|p| p.name.as_str())
                .collect();
            let reason = if matched.is_empty() {
                format!(
                    "`{}` matches no parameter; patterns are globs over the whole name (`*` any characters, `?` one)",
                    g.pattern
                )
            } else {
                format!(
                    "`{}` matches only parameters an earlier group already took (first match wins): {}",
                    g.pattern,
                    names(&matched)
                )
            };
            return Err(GroupError::Unmatched { group: i, reason });
        }
        for group in (0..groups.len()).map(Some).chain([None]) {
            for kind in [OptimizerKind::Adamw, OptimizerKind::Muon] {
                if let Some(p) = table
                    .params
                    .iter()
                    .find(|p| p.group == group && p.optimizer == kind)
                {
                    table.rates.push((group, kind, p.lr));
                }
            }
        }
        Ok(table)
    }

    /// The settings of a parameter in `group` (or none) using `optimizer`.
    fn settle(&self, group: Option<usize>, optimizer: OptimizerKind) -> ParamHyper {
        let mut adamw = self.adamw;
        let mut muon = self.muon;
        let mut scale = 1.0f64;
        if let Some(g) = group.and_then(|g| self.groups.get(g)) {
            scale = f64::from(g.lr_scale);
            if let Some(wd) = g.weight_decay {
                adamw.weight_decay = wd;
                muon.weight_decay = wd;
            }
            adamw.beta1 = g.beta1.unwrap_or(adamw.beta1);
            adamw.beta2 = g.beta2.unwrap_or(adamw.beta2);
            adamw.eps = g.eps.unwrap_or(adamw.eps);
            muon.momentum = g.momentum.unwrap_or(muon.momentum);
            muon.ns_steps = g.ns_steps.unwrap_or(muon.ns_steps);
            muon.ns_dtype = g.ns_dtype.unwrap_or(muon.ns_dtype);
        }
        let base = match optimizer {
            OptimizerKind::Adamw => adamw.lr,
            OptimizerKind::Muon => muon.lr,
        };
        ParamHyper {
            group,
            optimizer,
            adamw,
            muon,
            lr: f64::from(base) * scale,
        }
    }

    /// The groups, in order.
    pub fn groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    /// The base AdamW settings.
    pub fn base_adamw(&self) -> AdamwParams {
        self.adamw
    }

    /// The base Muon settings.
    pub fn base_muon(&self) -> MuonParams {
        self.muon
    }

    /// The group a parameter belongs to (`None`: the base settings, or a parameter this
    /// table was not resolved for).
    pub fn group_of(&self, param: ParamId) -> Option<usize> {
        self.params.get(param as usize).and_then(|p| p.group)
    }

    /// The parameters of a group (`None`: those in no group), in id order.
    pub fn members(&self, group: Option<usize>) -> Vec<ParamId> {
        self.params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.group == group)
            .map(|(i, _)| i as ParamId)
            .collect()
    }

    /// The learning rate of a parameter under `factor`: base lr × lr_scale × factor, in
    /// `f64` (the kernels get it rounded to `f32`).
    pub fn lr(&self, param: ParamId, optimizer: OptimizerKind, factor: f64) -> f64 {
        let unscaled = match self.params.get(param as usize) {
            Some(p) => p.lr,
            None => f64::from(match optimizer {
                OptimizerKind::Adamw => self.adamw.lr,
                OptimizerKind::Muon => self.muon.lr,
            }),
        };
        unscaled * factor
    }

    /// A parameter's AdamW settings in a step of learning-rate factor `factor`.
    pub fn adamw(&self, param: ParamId, factor: f64) -> AdamwParams {
        let base = self
            .params
            .get(param as usize)
            .map_or(self.adamw, |p| p.adamw);
        base.with_lr(self.lr(param, OptimizerKind::Adamw, factor) as f32)
    }

    /// A parameter's Muon settings in a step of learning-rate factor `factor`.
    pub fn muon(&self, param: ParamId, factor: f64) -> MuonParams {
        let base = self
            .params
            .get(param as usize)
            .map_or(self.muon, |p| p.muon);
        base.with_lr(self.lr(param, OptimizerKind::Muon, factor) as f32)
    }

    /// The rate of every (group, optimizer) pair that has parameters, groups in order
    /// and the parameters in no group (`base`) last.
    pub fn rates(&self, factor: f64) -> Vec<GroupRate> {
        self.rates
            .iter()
            .map(|&(group, optimizer, lr)| GroupRate {
                group,
                label: match group.and_then(|g| self.groups.get(g)) {
                    Some(g) => g.pattern.clone(),
                    None => "base".to_string(),
                },
                optimizer,
                lr: lr * factor,
            })
            .collect()
    }
}

fn names(list: &[&str]) -> String {
    const SHOWN: usize = 6;
    let mut s = list
        .iter()
        .take(SHOWN)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if list.len() > SHOWN {
        s.push_str(&format!(" and {} more", list.len() - SHOWN));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_stars_and_question_marks_match_the_whole_name() {
        assert!(glob_match("*.bias", "blocks.0.bias"));
        assert!(!glob_match("*.bias", "blocks.0.bias_scale"));
        assert!(glob_match("*norm*", "blocks.1.attn_norm"));
        assert!(glob_match("*norm*", "final_norm"));
        assert!(glob_match("blocks.?.qkv", "blocks.3.qkv"));
        assert!(!glob_match("blocks.?.qkv", "blocks.12.qkv"));
        assert!(glob_match("embed", "embed"));
        assert!(!glob_match("embed", "embedding"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*c", "aXbYbZc"));
        assert!(!glob_match("a*b*c", "aXbYbZ"));
        assert!(glob_match("**x", "yx"));
        assert!(!glob_match("", "x"));
    }

    fn cosine() -> LrSchedule {
        LrSchedule {
            kind: ScheduleKind::Cosine,
            warmup_steps: 10,
            total_steps: 110,
            final_lr_frac: 0.1,
        }
    }

    #[test]
    fn cosine_schedule_follows_the_documented_formula() {
        let s = cosine();
        assert_eq!(s.factor(1), 0.1);
        assert_eq!(s.factor(5), 0.5);
        assert_eq!(s.factor(10), 1.0);
        // Half-way through the decay: r + (1 − r)/2.
        assert!((s.factor(60) - 0.55).abs() < 1e-12);
        let p = 0.25f64;
        let want = 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * p).cos());
        assert!((s.factor(35) - want).abs() < 1e-12);
        assert_eq!(s.factor(110), 0.1);
        assert_eq!(s.factor(1_000_000), 0.1);
        assert_eq!(s.factor(0), s.factor(1));
    }

    #[test]
    fn linear_and_constant_schedules_follow_the_documented_formula() {
        let s = LrSchedule {
            kind: ScheduleKind::Linear,
            ..cosine()
        };
        assert_eq!(s.factor(10), 1.0);
        assert!((s.factor(60) - 0.55).abs() < 1e-12);
        assert!((s.factor(85) - (1.0 - 0.9 * 0.75)).abs() < 1e-12);
        assert_eq!(s.factor(200), 0.1);
        let c = LrSchedule {
            kind: ScheduleKind::Constant,
            warmup_steps: 4,
            ..LrSchedule::default()
        };
        assert_eq!(c.factor(1), 0.25);
        assert_eq!(c.factor(4), 1.0);
        assert_eq!(c.factor(5000), 1.0);
        assert_eq!(LrSchedule::default().factor(1), 1.0);
    }

    #[test]
    fn a_decay_needs_room_after_the_warm_up_and_a_floor_in_range() {
        let s = LrSchedule {
            total_steps: 10,
            ..cosine()
        };
        assert_eq!(s.check().unwrap_err().0, "total_steps");
        let s = LrSchedule {
            final_lr_frac: 1.5,
            ..cosine()
        };
        assert_eq!(s.check().unwrap_err().0, "final_lr_frac");
        assert!(cosine().check().is_ok());
    }

    fn spec(name: &str, route: Route) -> ParamSpec {
        ParamSpec::new(name, vec![4, 4], route, 0)
    }

    #[test]
    fn first_matching_group_wins_and_the_rest_keep_the_base() {
        let params = [
            spec("a.norm", Route::Fsdp),
            spec("a.w", Route::Muon),
            spec("b.norm", Route::Fsdp),
        ];
        let mut g0 = ParamGroup::new("a.*");
        g0.lr_scale = 0.5;
        g0.ns_steps = Some(3);
        let mut g1 = ParamGroup::new("*.norm");
        g1.weight_decay = Some(0.0);
        let t = HyperTable::resolve(
            AdamwParams::default(),
            MuonParams::default(),
            &[g0, g1],
            &params,
        )
        .unwrap();
        assert_eq!(t.group_of(0), Some(0));
        assert_eq!(t.group_of(1), Some(0));
        assert_eq!(t.group_of(2), Some(1));
        assert_eq!(t.members(None), Vec::<ParamId>::new());
        // a.norm took group 0's settings only: its weight decay stays the base's.
        assert_eq!(
            t.adamw(0, 1.0).weight_decay,
            AdamwParams::default().weight_decay
        );
        assert_eq!(t.adamw(0, 1.0).lr, (1e-3f32 as f64 * 0.5) as f32);
        assert_eq!(t.muon(1, 0.5).ns_steps, 3);
        assert_eq!(t.muon(1, 0.5).lr, (0.02f32 as f64 * 0.5 * 0.5) as f32);
        assert_eq!(t.adamw(2, 1.0).weight_decay, 0.0);
        // Parameters it was not resolved for get the base.
        assert_eq!(t.adamw(9, 1.0), AdamwParams::default());
        let rates = t.rates(2.0);
        assert_eq!(rates.len(), 3);
        assert_eq!(rates[2].label, "*.norm");
        assert_eq!(rates[2].lr, f64::from(1e-3f32) * 2.0);
    }

    #[test]
    fn a_group_that_gets_no_parameter_is_an_error() {
        let params = [spec("a.norm", Route::Fsdp)];
        let e = HyperTable::resolve(
            AdamwParams::default(),
            MuonParams::default(),
            &[ParamGroup::new("*.nrom")],
            &params,
        )
        .unwrap_err();
        assert!(matches!(e, GroupError::Unmatched { group: 0, .. }), "{e}");
        let e = HyperTable::resolve(
            AdamwParams::default(),
            MuonParams::default(),
            &[ParamGroup::new("a.*"), ParamGroup::new("*.norm")],
            &params,
        )
        .unwrap_err();
        assert!(e.to_string().contains("earlier group"), "{e}");
        let mut bad = ParamGroup::new("a.*");
        bad.beta2 = Some(1.0);
        let e = HyperTable::resolve(
            AdamwParams::default(),
            MuonParams::default(),
            &[bad],
            &params,
        )
        .unwrap_err();
        assert!(matches!(e, GroupError::Setting { key: "beta2", .. }), "{e}");
    }
}
