//! The search behind `overlap tune`: the scheduling levers of a config (`[buckets]
//! cap_bytes`, `[overlap]` transport, `combine_lag`, `copy_ring_depth`,
//! `copy_slot_mib`, the `[streams]` bindings) tried on a fixed grid ([`grid`]), each
//! setting planned and validated once, then simulated on a hardware profile
//! (`crate::simulate`, docs/simulate.md) with each `[overlap] stage1_window` of
//! [`windows`] (the window changes how the host issues the plan, not the plan), within
//! a memory budget; the winner as config sections ready to paste ([`sections`]).
//!
//! Settings whose plan the planner or validator refuses, or that the simulator refuses
//! (the copy transport across nodes), are pruned, as are settings over the memory
//! budget. Equal predictions go to the smaller memory, then the grid's order (windows
//! ascending within a grid point), so the result is a pure function of the config, the
//! gates and the profile.

use std::sync::Arc;

use crate::simulate::{self, Backward, CopyRing, Options, Profile, Stage1Window};
use overlap_graph::{Bindings, Gate, Mode, Op, Plan, Planner, Stream, Transport};
use serde::Serialize;

use overlap::config::Config;
use overlap::Error;

fn usage(e: impl std::fmt::Display) -> Error {
    Error::Usage(e.to_string())
}

/// A named set of stream bindings the search tries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// Its name in reports (`config`, `default`, `one-comm-stream`, ...).
    pub name: &'static str,
    /// The bindings.
    pub bindings: Bindings,
}

/// One point of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    /// `[buckets] cap_bytes`.
    pub cap_bytes: u64,
    /// `[overlap] transport`.
    pub transport: Transport,
    /// `[overlap] combine_lag` (the config's, unchanged, with NCCL).
    pub combine_lag: u32,
    /// `[overlap] copy_ring_depth` (likewise).
    pub copy_ring_depth: u32,
    /// `[overlap] copy_slot_mib` (likewise).
    pub copy_slot_mib: u32,
    /// `[overlap] stage1_window` ([`grid`] gives the config's; the search tries
    /// [`windows`]).
    pub stage1_window: u32,
    /// `[streams]`.
    pub binding: Binding,
}

impl Setting {
    fn label(&self) -> String {
        let cap = if self.cap_bytes % (1 << 20) == 0 {
            format!("{} MiB", self.cap_bytes >> 20)
        } else {
            format!("{} B", self.cap_bytes)
        };
        match self.transport {
            Transport::Nccl => format!(
                "cap {cap}, nccl, window {}, streams {}",
                self.stage1_window, self.binding.name
            ),
            Transport::Copy => format!(
                "cap {cap}, copy, lag {}, ring {}x{} MiB, window {}, streams {}",
                self.combine_lag,
                self.copy_ring_depth,
                self.copy_slot_mib,
                self.stage1_window,
                self.binding.name
            ),
        }
    }
}

/// The bucket caps tried besides the config's own, MiB.
pub const CAPS_MIB: [u64; 7] = [1, 4, 16, 25, 64, 256, 1024];
/// `combine_lag` values tried (copy transport).
pub const LAGS: [u32; 3] = [0, 1, 2];
/// `copy_ring_depth` values tried (copy transport).
pub const DEPTHS: [u32; 4] = [2, 3, 4, 8];
/// `copy_slot_mib` values tried besides the config's own (copy transport).
pub const SLOTS_MIB: [u32; 2] = [32, 256];
/// `stage1_window` values tried besides the config's own ([`windows`]).
pub const WINDOWS: [u32; 5] = [1, 2, 4, 8, 16];

/// The `stage1_window` values tried on a plan whose ranks issue at most `packs` packs (one
/// per Stage-1 buffer) in the step: [`WINDOWS`] and the config's `own`, ascending, of
/// those at or above `packs` only the smallest (the host never waits with any of them:
/// the same step).
pub fn windows(own: u32, packs: usize) -> Vec<u32> {
    let mut v: Vec<u32> = WINDOWS.to_vec();
    v.push(own.max(1));
    v.sort_unstable();
    v.dedup();
    match v.iter().position(|&w| w as usize >= packs) {
        Some(i) => v[..=i].to_vec(),
        None => v,
    }
}

/// The most packs (Stage-1 buffers opened) any rank of `plan` issues.
fn packs(plan: &Plan) -> usize {
    plan.ranks
        .iter()
        .map(|rp| {
            rp.nodes
                .iter()
                .filter(|n| matches!(n.op, Op::Pack { .. }))
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// The bindings tried: the config's, FSDP2's default, and variants of the default.
fn bindings(own: Bindings, copy: bool) -> Vec<Binding> {
    let d = Bindings::default();
    let mut v = vec![
        Binding {
            name: "config",
            bindings: own,
        },
        Binding {
            name: "default",
            bindings: d,
        },
        Binding {
            name: "one-comm-stream",
            bindings: d.with_stage2(Stream::Reduce).with_unpack(Stream::Reduce),
        },
        Binding {
            name: "pack-on-compute",
            bindings: d.with_pack(Stream::Compute),
        },
    ];
    if copy {
        v.push(Binding {
            name: "combine-on-compute",
            bindings: d.with_combine(Stream::Compute),
        });
        v.push(Binding {
            name: "combine-on-replicate",
            bindings: d.with_combine(Stream::Replicate),
        });
    }
    // Drop repeats (the config's bindings are often the default), keeping the first.
    let mut out: Vec<Binding> = Vec::new();
    for b in v {
        if !out.iter().any(|o| o.bindings == b.bindings) {
            out.push(b);
        }
    }
    out
}

/// Whether every group of the mesh lies within one node of `gpus_per_node` GPUs (where
/// the copy transport can run).
pub fn copy_fits(cfg: &Config, gpus_per_node: u32) -> bool {
    let m = cfg.plan.mesh;
    let world = m.world();
    if world <= gpus_per_node {
        return true;
    }
    // Shard groups are consecutive ranks; replicate groups stride by `shard`.
    let shard_ok = m.shard == 1 || gpus_per_node % m.shard == 0;
    shard_ok && m.replicate == 1
}

/// The grid, in search order: for each bucket cap, NCCL then (where the mesh fits one
/// node per group) the copy transport over lags, ring depths and slots, each with every
/// binding.
pub fn grid(cfg: &Config, copy: bool) -> Vec<Setting> {
    let mut caps: Vec<u64> = CAPS_MIB.iter().map(|m| m << 20).collect();
    caps.push(cfg.plan.bucket_cap_bytes);
    caps.sort_unstable();
    caps.dedup();
    let mut slots: Vec<u32> = SLOTS_MIB.to_vec();
    slots.push(cfg.overlap.copy_slot_mib);
    slots.sort_unstable();
    slots.dedup();
    let own = cfg.plan.bindings;
    let o = cfg.overlap;
    let mut v = Vec::new();
    for &cap in &caps {
        for b in bindings(own, false) {
            v.push(Setting {
                cap_bytes: cap,
                transport: Transport::Nccl,
                combine_lag: cfg.plan.schedule.combine_lag,
                copy_ring_depth: o.copy_ring_depth,
                copy_slot_mib: o.copy_slot_mib,
                stage1_window: o.stage1_window,
                binding: b,
            });
        }
        if !copy {
            continue;
        }
        for &lag in &LAGS {
            for &depth in &DEPTHS {
                for &slot in &slots {
                    for b in bindings(own, true) {
                        v.push(Setting {
                            cap_bytes: cap,
                            transport: Transport::Copy,
                            combine_lag: lag,
                            copy_ring_depth: depth,
                            copy_slot_mib: slot,
                            stage1_window: o.stage1_window,
                            binding: b,
                        });
                    }
                }
            }
        }
    }
    v
}

/// A setting applied to the config.
fn apply(cfg: &Config, s: &Setting) -> Config {
    let mut c = cfg.clone();
    c.plan.bucket_cap_bytes = s.cap_bytes;
    c.plan.schedule.transport = s.transport;
    c.plan.schedule.combine_lag = s.combine_lag;
    c.plan.bindings = s.binding.bindings;
    c.overlap.copy_ring_depth = s.copy_ring_depth;
    c.overlap.copy_slot_mib = s.copy_slot_mib;
    c.overlap.stage1_window = s.stage1_window;
    c.overlap.transport = match s.transport {
        Transport::Nccl => overlap::config::TransportChoice::Nccl,
        Transport::Copy => overlap::config::TransportChoice::Copy,
    };
    c
}

/// The validated step plan of `cfg` with `gates`.
fn plan_of(cfg: &Config, gates: &[Gate]) -> Result<Arc<Plan>, Error> {
    let planner = Planner::new(cfg.plan.clone())?;
    planner.check_step(gates.len())?;
    Ok(planner.plan_checked(gates, Mode::Step)?.plan().clone())
}

/// Estimated device memory per rank, bytes: the CPU backend's estimate of parameters,
/// optimizer state, gradients and partials (`overlap::resources::estimate_cpu`) over
/// the ranks, the Stage-1 buffers in flight (`stage1_window` buckets of the largest, at
/// most as many as a rank packs in the step), and the copy transport's receive rings
/// (`copy_ring_depth × slot × (n − 1)` per communicator of `n` members, twice that where
/// it gathers). An estimate, not a measurement.
pub fn memory_bytes(cfg: &Config, plan: &Plan) -> u64 {
    let world = u64::from(cfg.plan.mesh.world());
    let base = Planner::new(cfg.plan.clone())
        .map(|p| {
            let e = overlap::resources::estimate_cpu(cfg, &p, 1);
            (e.params + e.optimizer + e.gradients) / world.max(1)
        })
        .unwrap_or(0);
    let mut largest_bucket = 0u64;
    let mut comms: Vec<(String, u64, bool)> = Vec::new();
    for n in &plan.ranks[0].nodes {
        match &n.op {
            Op::Exchange { collective, .. } | Op::Gather { collective, .. } => {
                let key = format!("{:?}/{:?}", collective.group, n.stream);
                let gathers = matches!(n.op, Op::Gather { .. });
                let size = u64::from(plan.mesh.group_size(collective.group));
                match comms.iter_mut().find(|c| c.0 == key) {
                    Some(c) => c.2 |= gathers,
                    None => comms.push((key, size, gathers)),
                }
            }
            _ => {}
        }
        if let Some(c) = n.op.collective() {
            largest_bucket = largest_bucket.max(overlap::observe::collective_bytes(plan, c));
        }
    }
    let slot = u64::from(cfg.overlap.copy_slot_mib) << 20;
    let rings: u64 = comms
        .iter()
        .map(|(_, n, gathers)| {
            u64::from(cfg.overlap.copy_ring_depth)
                * slot
                * n.saturating_sub(1)
                * if *gathers { 2 } else { 1 }
        })
        .sum();
    let in_flight = u64::from(cfg.overlap.stage1_window).min(packs(plan) as u64);
    base + in_flight * largest_bucket + rings
}

/// What the simulation of a plan needs of the executor, whatever the window: per rank,
/// which nodes it runs as aliases and what frees each Stage-1 buffer.
struct Issue {
    aliased: Vec<Vec<bool>>,
    releases: Vec<Vec<simulate::Stage1Release>>,
}

impl Issue {
    fn of(plan: &Arc<Plan>) -> Issue {
        let ranks = 0..plan.mesh.world();
        Issue {
            aliased: ranks
                .clone()
                .map(|r| overlap_executor::aliased_nodes(plan, r))
                .collect(),
            releases: ranks
                .map(|r| overlap_executor::stage1_releases(plan, r, true))
                .collect(),
        }
    }
}

/// The predicted `overlap` step of rank 0, ms.
fn predict(cfg: &Config, plan: &Arc<Plan>, issue: &Issue, p: &Profile) -> Result<f64, Error> {
    let us = cfg.run.backward_us_per_layer;
    let backward = if us > 0 {
        Backward::Seconds(f64::from(us) * 1e-6)
    } else {
        Backward::Profile
    };
    let o = Options {
        backward,
        aliased: issue.aliased.clone(),
        copy: CopyRing {
            slot_bytes: u64::from(cfg.overlap.copy_slot_mib) << 20,
            depth: cfg.overlap.copy_ring_depth,
            in_place: true,
        },
        stage1: Some(Stage1Window {
            window: cfg.overlap.stage1_window,
            releases: issue.releases.clone(),
        }),
        newton_schulz: cfg.newton_schulz(),
    };
    let s = simulate::simulate(plan, p, &o).map_err(usage)?;
    Ok(s.span(0) * 1e3)
}

/// One evaluated setting.
#[derive(Debug, Clone, Serialize)]
pub struct Scored {
    /// 1 for the best.
    pub rank: usize,
    /// The predicted step of rank 0 (`overlap simulate`'s `overlap_ms`).
    pub overlap_ms: f64,
    /// The estimated device memory per rank ([`memory_bytes`]), GiB.
    pub memory_gib: f64,
    /// `[buckets] cap_bytes`.
    pub bucket_cap_bytes: u64,
    /// `nccl` or `copy`.
    pub transport: &'static str,
    /// `combine_lag` (copy transport only).
    pub combine_lag: Option<u32>,
    /// `copy_ring_depth` (copy transport only).
    pub copy_ring_depth: Option<u32>,
    /// `copy_slot_mib` (copy transport only).
    pub copy_slot_mib: Option<u32>,
    /// `stage1_window`.
    pub stage1_window: u32,
    /// The bindings' name.
    pub streams: &'static str,
    /// One line saying all of it.
    pub label: String,
    /// The setting itself.
    #[serde(skip)]
    pub setting: Setting,
}

/// What `overlap tune` prints.
#[derive(Debug, Clone, Serialize)]
pub struct TuneReport {
    /// The config's source (its file).
    pub config: String,
    /// The profile's name.
    pub hardware: String,
    /// Ranks in the mesh.
    pub world: u32,
    /// The step's gates.
    pub gates: String,
    /// Settings in the grid (each planned once).
    pub settings: usize,
    /// Settings with their `stage1_window`s ([`windows`]) whose memory was estimated:
    /// those simulated and those over the budget.
    pub candidates: usize,
    /// Settings the planner or validator refused, and candidates the simulator refused.
    pub pruned_invalid: usize,
    /// Candidates over the memory budget.
    pub pruned_memory: usize,
    /// The budget, GiB per rank (`None`: unbounded).
    pub memory_budget_gib: Option<f64>,
    /// The predicted step with the config's own setting, ms.
    pub own_ms: f64,
    /// Its estimated memory per rank, GiB.
    pub own_memory_gib: f64,
    /// The best predicted step, ms.
    pub best_ms: f64,
    /// `own_ms − best_ms`.
    pub gain_ms: f64,
    /// The same in percent of `own_ms`.
    pub gain_pct: f64,
    /// The best settings, fastest first.
    pub top: Vec<Scored>,
    /// The best as `[buckets]`, `[overlap]` and `[streams]` sections ([`sections`]).
    pub sections: String,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Searches the grid for `cfg`'s step with `gates` on `p` (settling `cfg`'s `auto`
/// transport as a GPU job would), keeping settings within `memory_gib` GiB per rank, and
/// reports the best `top`; `progress(done, total, best_ms)` is called about 20 times.
pub fn tune(
    cfg: &mut Config,
    gates: &[Gate],
    p: &Profile,
    memory_gib: Option<f64>,
    top: usize,
    progress: &mut dyn FnMut(usize, usize, Option<f64>),
) -> Result<TuneReport, Error> {
    let copy = copy_fits(cfg, p.gpus_per_node);
    // The config's own setting, `auto` settled as a GPU job would.
    cfg.settle_transport(cfg.plan.mesh.world() <= p.gpus_per_node);
    let own_plan = plan_of(cfg, gates)?;
    let own_ms = predict(cfg, &own_plan, &Issue::of(&own_plan), p)?;
    let own_mem = memory_bytes(cfg, &own_plan);
    let budget = memory_gib.map(|g| (g * GIB) as u64);
    let grid = grid(cfg, copy);
    let total = grid.len();
    let mut search = Search::default();
    let every = (total / 20).max(1);
    for (i, s) in grid.iter().enumerate() {
        search.score(cfg, gates, p, budget, (i, s));
        if (i + 1) % every == 0 || i + 1 == total {
            progress(i + 1, total, search.best_ms());
        }
    }
    let Search {
        candidates,
        invalid,
        over,
        ..
    } = search;
    if search.scored.is_empty() {
        return Err(usage(format!(
            "no setting fits: {invalid} refused by the planner or validator, {over} settings with their stage1_window over --memory-gib"
        )));
    }
    let top = search.ranked(top);
    let best = top[0].setting;
    let best_ms = top[0].overlap_ms;
    Ok(TuneReport {
        config: cfg.source.clone(),
        hardware: p.name.clone(),
        world: cfg.plan.mesh.world(),
        gates: Gate::pattern_label(gates),
        settings: total,
        candidates,
        pruned_invalid: invalid,
        pruned_memory: over,
        memory_budget_gib: memory_gib,
        own_ms,
        own_memory_gib: own_mem as f64 / GIB,
        best_ms,
        gain_ms: own_ms - best_ms,
        gain_pct: if own_ms > 0.0 {
            (own_ms - best_ms) / own_ms * 100.0
        } else {
            0.0
        },
        sections: sections(cfg, &best),
        top,
    })
}

/// What [`tune`]'s search of the grid found so far.
#[derive(Default)]
struct Search {
    /// The candidates within the budget the simulator predicted: (ms, memory, grid
    /// index, window, setting).
    scored: Vec<(f64, u64, usize, u32, Setting)>,
    /// Settings with their windows whose memory was estimated.
    candidates: usize,
    /// Settings the planner or validator refused, and candidates the simulator refused.
    invalid: usize,
    /// Candidates over the memory budget.
    over: usize,
}

impl Search {
    /// Plans setting `i` of the grid (`s`) and, for each of its `stage1_window`s
    /// ([`windows`]) whose memory fits `budget` bytes per rank, predicts the step.
    fn score(
        &mut self,
        cfg: &Config,
        gates: &[Gate],
        p: &Profile,
        budget: Option<u64>,
        (i, s): (usize, &Setting),
    ) {
        let Ok(plan) = plan_of(&apply(cfg, s), gates) else {
            self.invalid += 1;
            return;
        };
        let mut issue = None;
        for w in windows(cfg.overlap.stage1_window, packs(&plan)) {
            let s = Setting {
                stage1_window: w,
                ..*s
            };
            let c = apply(cfg, &s);
            self.candidates += 1;
            let mem = memory_bytes(&c, &plan);
            if budget.is_some_and(|b| mem > b) {
                self.over += 1;
                continue;
            }
            let issue = issue.get_or_insert_with(|| Issue::of(&plan));
            match predict(&c, &plan, issue, p) {
                Ok(ms) => self.scored.push((ms, mem, i, w, s)),
                Err(_) => self.invalid += 1,
            }
        }
    }

    /// The best predicted step so far, ms.
    fn best_ms(&self) -> Option<f64> {
        let best = self
            .scored
            .iter()
            .map(|x| x.0)
            .fold(f64::INFINITY, f64::min);
        best.is_finite().then_some(best)
    }

    /// The best `top` candidates, fastest first; among equal predictions the smaller
    /// memory, then grid order, then the smaller window.
    fn ranked(mut self, top: usize) -> Vec<Scored> {
        self.scored.sort_by(|x, y| {
            x.0.total_cmp(&y.0)
                .then(x.1.cmp(&y.1))
                .then(x.2.cmp(&y.2))
                .then(x.3.cmp(&y.3))
        });
        self.scored
            .iter()
            .take(top)
            .enumerate()
            .map(|(k, &(ms, mem, _, _, s))| {
                let copy = s.transport == Transport::Copy;
                Scored {
                    rank: k + 1,
                    overlap_ms: ms,
                    memory_gib: mem as f64 / GIB,
                    bucket_cap_bytes: s.cap_bytes,
                    transport: s.transport.name(),
                    combine_lag: copy.then_some(s.combine_lag),
                    copy_ring_depth: copy.then_some(s.copy_ring_depth),
                    copy_slot_mib: copy.then_some(s.copy_slot_mib),
                    stage1_window: s.stage1_window,
                    streams: s.binding.name,
                    label: s.label(),
                    setting: s,
                }
            })
            .collect()
    }
}

/// The `[buckets]`, `[overlap]` and `[streams]` sections of `s` (with the config's
/// `nccl_max_ctas`), ready to paste in place of the config's.
pub fn sections(cfg: &Config, s: &Setting) -> String {
    use std::fmt::Write;
    let mut t = String::new();
    let _ = writeln!(t, "[buckets]\ncap_bytes = {}\n", s.cap_bytes);
    let _ = writeln!(t, "[overlap]");
    let _ = writeln!(t, "transport = \"{}\"", s.transport.name());
    let _ = writeln!(t, "stage1_window = {}", s.stage1_window);
    if s.transport == Transport::Copy {
        let _ = writeln!(t, "combine_lag = {}", s.combine_lag);
        let _ = writeln!(t, "copy_ring_depth = {}", s.copy_ring_depth);
        let _ = writeln!(t, "copy_slot_mib = {}", s.copy_slot_mib);
    }
    if let Some(n) = cfg.overlap.nccl_max_ctas {
        let _ = writeln!(t, "nccl_max_ctas = {n}");
    }
    let b = s.binding.bindings;
    let _ = writeln!(t, "\n[streams]");
    for (k, v) in [
        ("accumulate", b.accumulate),
        ("pack", b.pack),
        ("stage1", b.stage1),
        ("fold", b.fold),
        ("stage2", b.stage2),
        ("unpack", b.unpack),
        ("optimizer", b.optimizer),
        ("publish", b.publish),
        ("exchange", b.exchange),
        ("combine", b.combine),
    ] {
        let _ = writeln!(t, "{k} = \"{}\"", v.name());
    }
    t
}

/// `text` with its `[buckets]`, `[overlap]` and `[streams]` tables replaced by
/// `sections`.
pub fn replace_sections(text: &str, sections: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            let name = t
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .trim();
            skipping = !t.starts_with("[[") && matches!(name, "buckets" | "overlap" | "streams");
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push('\n');
    out.push_str(sections);
    out
}

/// `text` (a config) with `[run] backward_us_per_layer = us`: the key replaced where the
/// `[run]` table sets it, added to the table where it does not, or a `[run]` table
/// appended. `tune --confirm` writes it so that a GPU run spins for the backward the
/// simulation assumed (the profile's, when the config's is 0).
pub fn with_backward_us(text: &str, us: u32) -> String {
    let line = format!("backward_us_per_layer = {us}");
    let mut out = String::new();
    let (mut in_run, mut seen_run, mut set) = (false, false, false);
    for l in text.lines() {
        let t = l.trim();
        if t.starts_with('[') {
            if in_run && !set {
                out.push_str(&line);
                out.push('\n');
                set = true;
            }
            in_run =
                t == "[run]" || (t.starts_with("[run]") && t[5..].trim_start().starts_with('#'));
            seen_run |= in_run;
        } else if in_run && t.split('=').next().map(str::trim) == Some("backward_us_per_layer") {
            if !set {
                out.push_str(&line);
                out.push('\n');
                set = true;
            }
            continue;
        }
        out.push_str(l);
        out.push('\n');
    }
    if in_run && !set {
        out.push_str(&line);
        out.push('\n');
    } else if !seen_run {
        out.push_str("\n[run]\n");
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_backward_of_the_simulation_is_written_into_the_run_table() {
        let base =
            "[mesh]\nshard = 1\nreplicate = 1\n[model]\nlayers = 2\nhidden = 8\nvocab = 13\n";
        let cases = [
            base.to_string(),
            format!("{base}[run]\nsteps = 3\n"),
            format!(
                "{base}[run]\nbackward_us_per_layer = 7\nsteps = 3\n[buckets]\ncap_bytes = 1024\n"
            ),
        ];
        for text in &cases {
            let out = with_backward_us(text, 558);
            let cfg = Config::from_toml(&out, "t.toml").unwrap_or_else(|e| panic!("{e}\n{out}"));
            assert_eq!(cfg.run.backward_us_per_layer, 558, "{out}");
            assert_eq!(out.matches("backward_us_per_layer").count(), 1, "{out}");
            if text.contains("steps = 3") {
                assert_eq!(cfg.run.steps, 3, "{out}");
            }
        }
    }

    use super::*;

    const JOB: &str = "[mesh]\nshard = 2\nreplicate = 1\n\n[model]\nlayers = 2\nhidden = 32\nvocab = 96\n\n[overlap]\ncombine_lag = 2\n\n[[param]]\nname = \"extra\"\nshape = [4, 4]\nroute = \"adamw\"\n\n[optimizer.adamw]\nlr = 0.01\n";

    #[test]
    fn the_grid_has_the_documented_size_and_no_repeats() {
        let cfg = Config::from_toml(JOB, "job.toml").unwrap();
        let g = grid(&cfg, true);
        assert_eq!(g.len(), 7 * (3 + 3 * 4 * 2 * 5));
        for (i, a) in g.iter().enumerate() {
            assert!(!g[..i].contains(a), "{a:?} twice");
        }
        assert_eq!(grid(&cfg, false).len(), 7 * 3);
    }

    #[test]
    fn windows_at_or_above_the_packs_are_tried_once() {
        assert_eq!(windows(8, 100), [1, 2, 4, 8, 16]);
        assert_eq!(windows(3, 100), [1, 2, 3, 4, 8, 16]);
        assert_eq!(windows(64, 100), [1, 2, 4, 8, 16, 64]);
        // Three packs: every window from 3 up never waits; 4 stands for them.
        assert_eq!(windows(8, 3), [1, 2, 4]);
        assert_eq!(windows(3, 3), [1, 2, 3]);
        assert_eq!(windows(8, 1), [1]);
        assert_eq!(windows(8, 0), [1]);
    }

    #[test]
    fn replaced_sections_keep_the_other_tables() {
        let cfg = Config::from_toml(JOB, "job.toml").unwrap();
        let g = grid(&cfg, true);
        let s = g
            .iter()
            .find(|s| s.transport == Transport::Copy && s.combine_lag == 0)
            .unwrap();
        let text = replace_sections(JOB, &sections(&cfg, s));
        let back = Config::from_toml(&text, "pasted.toml").unwrap();
        assert_eq!(back.plan.schedule.combine_lag, 0);
        assert_eq!(back.overlap.stage1_window, s.stage1_window);
        assert_eq!(back.plan.bucket_cap_bytes, s.cap_bytes);
        assert_eq!(back.plan.params.len(), cfg.plan.params.len());
        assert_eq!(back.adamw, cfg.adamw);
    }
}
