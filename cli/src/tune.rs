//! `overlap tune`: the command line of `overlap_sim::tune` (the search: a fixed grid of
//! bucket caps, transports, combine lags, copy rings and stream bindings, each setting
//! simulated on a hardware profile with a few Stage-1 windows; docs/simulate.md). It
//! prints the winner as config sections ready to paste, the predicted gain over the
//! config's own setting and the best settings, progress on stderr; `--confirm N` writes
//! the best N as configs and, in a `cuda` build, measures each on this node's GPUs
//! (`overlap launch ... run --backend cuda`, rank 0's device span of every step after the
//! first) and prints the prediction beside the measurement; without the `cuda` feature
//! it prints the commands that would.
//!
//! Invariant: without `--confirm`, stdout is a pure function of the arguments, the config
//! and the profile.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use overlap::config::Config;
use overlap::Error;
use overlap_graph::Gate;
use overlap_sim::tune::{replace_sections, sections, tune, TuneReport};

/// `overlap tune`'s arguments.
#[derive(clap::Args)]
pub(crate) struct TuneArgs {
    /// The config file (TOML) whose step is tuned.
    #[arg(long)]
    pub(crate) config: PathBuf,
    /// The hardware profile (TOML; `hardware/h200-nvlink.toml`, docs/simulate.md).
    #[arg(long)]
    pub(crate) hardware: PathBuf,
    /// The gate pattern of the step, e.g. `off*3,on` (default: the config's).
    #[arg(long)]
    pub(crate) gates: Option<String>,
    /// Memory budget per GPU in GiB (default: unbounded; the profiles have no device
    /// memory key). Settings whose estimate exceeds it are pruned.
    #[arg(long)]
    pub(crate) memory_gib: Option<f64>,
    /// How many settings to list, the winner included.
    #[arg(long, default_value_t = 5)]
    pub(crate) top: usize,
    /// Print one JSON line.
    #[arg(long)]
    pub(crate) json: bool,
    /// Write the best N settings (all listed, whatever --top says) as full configs
    /// (`tune-1.toml` ... under --confirm-dir) and measure each on this node's GPUs
    /// (`overlap launch --nproc-per-node W -- run --backend cuda`; needs the `cuda`
    /// feature and W GPUs), printing the prediction beside the measurement.
    #[arg(long, value_name = "N")]
    pub(crate) confirm: Option<usize>,
    /// Where --confirm writes its configs.
    #[arg(long, default_value = "tune-confirm", requires = "confirm")]
    pub(crate) confirm_dir: PathBuf,
    /// Steps --confirm runs per config; the first (start-up) is not counted.
    #[arg(long, default_value_t = 6, requires = "confirm", value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub(crate) confirm_steps: u32,
}

fn usage(e: impl std::fmt::Display) -> Error {
    Error::Usage(e.to_string())
}

/// Runs `overlap tune`.
pub(crate) fn run(a: &TuneArgs) -> Result<ExitCode, Error> {
    if a.top == 0 {
        return Err(usage("--top: must be at least 1"));
    }
    if let Some(m) = a.memory_gib {
        if !(m.is_finite() && m > 0.0) {
            return Err(usage(format!("--memory-gib: must be above 0, got {m}")));
        }
    }
    if a.confirm == Some(0) {
        return Err(usage("--confirm: must be at least 1"));
    }
    let profile = overlap_sim::hardware::from_file(&a.hardware).map_err(usage)?;
    let text =
        overlap::resources::read_text_bounded(&a.config, overlap::resources::MAX_CONFIG_BYTES)
            .map_err(|e| usage(format!("--config: cannot read {}: {e}", a.config.display())))?;
    let mut cfg = Config::from_toml(&text, &a.config.display().to_string())?;
    let gates = match &a.gates {
        Some(g) => Gate::parse_pattern(g).map_err(|e| usage(format!("--gates: {e}")))?,
        None => cfg.gates.clone(),
    };
    let mut progress = |done: usize, total: usize, best: Option<f64>| {
        let best = best.map_or_else(|| "none yet".into(), |b| format!("{b:.3} ms"));
        eprintln!("tune: {done}/{total} settings, best {best}");
    };
    // --confirm N needs the best N: list at least that many.
    let top = a.top.max(a.confirm.unwrap_or(0));
    let r = tune(&mut cfg, &gates, &profile, a.memory_gib, top, &mut progress)?;
    // The backward the simulation used: the config's, else the profile's.
    let backward_us = match cfg.run.backward_us_per_layer {
        0 => profile.backward_us_per_layer.round() as u32,
        us => us,
    };
    let confirmed = match a.confirm {
        Some(n) => confirm(a, &text, &r, n, backward_us)?,
        None => Vec::new(),
    };
    if a.json {
        println!("{}", serde_json::to_string(&r).map_err(usage)?);
        for c in &confirmed {
            println!("{}", serde_json::to_string(c).map_err(usage)?);
        }
    } else {
        print!("{}", render(&r));
        if !confirmed.is_empty() {
            println!("\n# measured on this node's GPUs (rank 0's device span, median of the steps after the first):");
        }
        for c in &confirmed {
            println!(
                "{:>2}. predicted {:.3} ms, measured {:.3} ms over {} steps: {:+.1} %  ({})",
                c.confirm, c.predicted_ms, c.measured_ms, c.steps, c.error_pct, c.config
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One setting `--confirm` measured: its prediction and rank 0's measured device span.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Confirmed {
    /// The setting's place in the ranking (1: the winner).
    pub(crate) confirm: usize,
    /// The config written for it.
    pub(crate) config: String,
    /// `overlap_ms` predicted.
    pub(crate) predicted_ms: f64,
    /// Median over the steps after the first of rank 0's device span (`span` of `overlap
    /// run`'s step line: first kernel start to last kernel end, as `overlap_ms`).
    pub(crate) measured_ms: f64,
    /// Steps in the median.
    pub(crate) steps: usize,
    /// `100 · (predicted − measured) / measured`.
    pub(crate) error_pct: f64,
}

/// `--confirm N`: the best N settings as full configs, each measured on this node's GPUs
/// where the build can (the commands printed otherwise).
fn confirm(
    a: &TuneArgs,
    text: &str,
    r: &TuneReport,
    n: usize,
    backward_us: u32,
) -> Result<Vec<Confirmed>, Error> {
    let dir: &Path = &a.confirm_dir;
    std::fs::create_dir_all(dir).map_err(|e| {
        usage(format!(
            "--confirm-dir: cannot create {}: {e}",
            dir.display()
        ))
    })?;
    let source = Config::from_toml(text, "config").map_err(usage)?;
    let mut out = Vec::new();
    for s in r.top.iter().take(n) {
        let setting = s.setting;
        // The GPU run spins for the backward the simulation assumed.
        let body = overlap_sim::tune::with_backward_us(
            &replace_sections(text, &sections(&source, &setting)),
            backward_us,
        );
        let path = dir.join(format!("tune-{}.toml", s.rank));
        // What is written must load: the pasted sections are config text.
        Config::from_toml(&body, &path.display().to_string())?;
        std::fs::write(&path, body)
            .map_err(|e| usage(format!("--confirm: cannot write {}: {e}", path.display())))?;
        let command = format!(
            "overlap launch --nproc-per-node {} -- run --config {} --backend cuda --steps {} --timing-every 1",
            r.world,
            path.display(),
            a.confirm_steps
        );
        if !crate::cuda::IN_BUILD {
            eprintln!(
                "tune: wrote {} (predicted {:.3} ms); this build has no `cuda` feature, so it is not measured; on GPUs: {command}",
                path.display(),
                s.overlap_ms,
            );
            continue;
        }
        eprintln!(
            "tune: measuring {} on {} GPU(s), {} steps: {command}",
            path.display(),
            r.world,
            a.confirm_steps
        );
        let spans = measure(&path, r.world, a.confirm_steps)?;
        let measured = median(&spans);
        let c = Confirmed {
            confirm: s.rank,
            config: path.display().to_string(),
            predicted_ms: s.overlap_ms,
            measured_ms: measured,
            steps: spans.len(),
            error_pct: 100.0 * (s.overlap_ms - measured) / measured,
        };
        eprintln!(
            "tune: #{} predicted {:.3} ms, measured {:.3} ms ({:+.1} %)",
            c.confirm, c.predicted_ms, c.measured_ms, c.error_pct
        );
        out.push(c);
    }
    Ok(out)
}

/// Runs a written config under `overlap launch` on this node's GPUs and returns rank 0's
/// device span of every step after the first, in ms.
fn measure(path: &Path, world: u32, steps: u32) -> Result<Vec<f64>, Error> {
    let exe = std::env::current_exe()
        .map_err(|e| usage(format!("--confirm: cannot find this executable: {e}")))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| usage(format!("--confirm: no free port for the job: {e}")))?;
    let out = std::process::Command::new(exe)
        .args(["launch", "--nproc-per-node", &world.to_string()])
        .args(["--master-port", &port.to_string(), "--", "run", "--config"])
        .arg(path)
        .args(["--backend", "cuda", "--steps", &steps.to_string()])
        .args(["--timing-every", "1"])
        .output()
        .map_err(|e| usage(format!("--confirm: cannot start overlap launch: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
        return Err(usage(format!(
            "--confirm: measuring {} failed ({}): {}",
            path.display(),
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )));
    }
    let spans = rank0_spans(&stdout);
    if spans.is_empty() {
        return Err(usage(format!(
            "--confirm: the run of {} reported no timed step after the first",
            path.display()
        )));
    }
    Ok(spans)
}

/// Rank 0's `span X ms` of each step line after the first, from `overlap launch`'s
/// output.
fn rank0_spans(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] step "))
        .filter(|l| !l.starts_with("1/"))
        .filter_map(|l| {
            let rest = l.split("  span ").nth(1)?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .collect()
}

/// The median of a non-empty list (the mean of the middle two of an even one).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The human-readable form.
fn render(r: &TuneReport) -> String {
    use std::fmt::Write;
    let mut t = String::new();
    let budget = r
        .memory_budget_gib
        .map_or_else(|| "unbounded".into(), |g| format!("{g} GiB"));
    let _ = writeln!(
        t,
        "overlap tune ({}: {} ranks, gates {}) on {}: {} settings, {} with their stage1_window, {} refused by the planner or placement, {} over the memory budget ({budget})",
        r.config,
        r.world,
        r.gates,
        r.hardware,
        r.settings,
        r.candidates,
        r.pruned_invalid,
        r.pruned_memory
    );
    let _ = writeln!(
        t,
        "predicted step: config's own setting {:.3} ms ({:.2} GiB), best {:.3} ms ({:.2} GiB): {:.3} ms ({:.1} %) less",
        r.own_ms, r.own_memory_gib, r.best_ms, r.top[0].memory_gib, r.gain_ms, r.gain_pct
    );
    let _ = writeln!(t);
    let _ = writeln!(t, "# paste in place of the config's sections:");
    t.push_str(&r.sections);
    let _ = writeln!(t, "\n# the best {} settings:", r.top.len());
    for s in &r.top {
        let _ = writeln!(
            t,
            "{:>2}. {:.3} ms  {:.2} GiB  {}",
            s.rank, s.overlap_ms, s.memory_gib, s.label
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_measured_spans_are_rank_0s_after_the_first_step() {
        let out = "\
[rank 0] overlap run t.toml: mesh 1x1 (1 ranks), 5 params
[rank 0] step 1/4  gates off,on  nodes 44  wall 9.1 ms  host 3.5 us/node  stage2 0 B (saved 0 B)  partials left 0  peak params 1 MiB  span 7.500 ms  exposed comm 0.10 ms  overlap 0.9
[rank 1] step 2/4  gates off,on  nodes 44  wall 1.0 ms  host 3.5 us/node  span 9.000 ms  exposed comm 0.10 ms  overlap 0.9
[rank 0] step 2/4  gates off,on  nodes 44  wall 1.0 ms  host 3.5 us/node  span 1.250 ms  exposed comm 0.10 ms  overlap 0.9
[rank 0] step 3/4  gates off,on  nodes 44  wall 1.0 ms  host 3.5 us/node  span n/a  exposed comm n/a  overlap n/a (untimed)
[rank 0] step 4/4  gates off,on  nodes 44  wall 1.0 ms  host 3.5 us/node  span 1.750 ms  exposed comm 0.10 ms  overlap 0.9
";
        assert_eq!(rank0_spans(out), vec![1.25, 1.75]);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
