//! `overlap tune`: the command line of `overlap::tune` (the search: a fixed grid of
//! bucket caps, transports, combine lags, copy rings and stream bindings, each setting
//! simulated on a hardware profile with a few Stage-1 windows; docs/simulate.md). It
//! prints the winner as config sections ready to paste, the predicted gain over the
//! config's own setting and the best settings, progress on stderr; `--confirm N` writes
//! the best N as configs and prints the GPU commands that measure them (it runs no GPU
//! itself).
//!
//! Invariant: stdout is a pure function of the arguments, the config and the profile.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use overlap::config::Config;
use overlap::tune::{replace_sections, sections, tune, TuneReport};
use overlap::Error;
use overlap_graph::Gate;

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
    /// (`tune-1.toml` ... under --confirm-dir) and print the GPU commands that measure
    /// them; tune itself runs no GPU.
    #[arg(long, value_name = "N")]
    pub(crate) confirm: Option<usize>,
    /// Where --confirm writes its configs.
    #[arg(long, default_value = "tune-confirm", requires = "confirm")]
    pub(crate) confirm_dir: PathBuf,
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
    let profile = overlap::hardware::from_file(&a.hardware).map_err(usage)?;
    let text = std::fs::read_to_string(&a.config)
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
    if let Some(n) = a.confirm {
        confirm(a, &text, &r, n)?;
    }
    if a.json {
        println!("{}", serde_json::to_string(&r).map_err(usage)?);
    } else {
        print!("{}", render(&r));
    }
    Ok(ExitCode::SUCCESS)
}

/// `--confirm N`: the best N settings as full configs, and the commands that measure
/// them on GPUs.
fn confirm(a: &TuneArgs, text: &str, r: &TuneReport, n: usize) -> Result<(), Error> {
    let dir: &Path = &a.confirm_dir;
    std::fs::create_dir_all(dir).map_err(|e| {
        usage(format!(
            "--confirm-dir: cannot create {}: {e}",
            dir.display()
        ))
    })?;
    let source = Config::from_toml(text, "config").map_err(usage)?;
    for s in r.top.iter().take(n) {
        let setting = s.setting;
        let body = replace_sections(text, &sections(&source, &setting));
        let path = dir.join(format!("tune-{}.toml", s.rank));
        // What is written must load: the pasted sections are config text.
        Config::from_toml(&body, &path.display().to_string())?;
        std::fs::write(&path, body)
            .map_err(|e| usage(format!("--confirm: cannot write {}: {e}", path.display())))?;
        eprintln!(
            "tune: wrote {} (predicted {:.3} ms); measure it on GPUs with: overlap launch --nproc-per-node {} -- run --config {} --backend cuda --svg {}.svg",
            path.display(),
            s.overlap_ms,
            r.world,
            path.display(),
            path.with_extension("").display()
        );
    }
    Ok(())
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
