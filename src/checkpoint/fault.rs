//! A test hook: stop a save, or make one of its writes fail with a full disk, at a named
//! phase (`OVERLAP_CHECKPOINT_FAULT`), so that tests can kill a process at every moment
//! of the save protocol and check what survives (`docs/checkpoints.md`, "Crashes").
//!
//! The value is `phase=P[,rank=R][,step=S][,mode=stop|enospc]`:
//!
//! - `phase`: `shard` (a rank's safetensors file), `report` (its report), `manifest`,
//!   `rename` (the partial directory renamed to `step-NNNNNN/`) or `latest` (the switch
//!   of `latest`);
//! - `rank`: for `shard` and `report`, which rank's file (any by default);
//! - `step`: which save, by its step (any by default);
//! - `mode`: `stop` (the default) writes the first half of the file (for `rename`,
//!   nothing), syncs it, prints [`STOP_MARKER`] and the phase and file on stderr and
//!   hangs, for the test to kill the process; `enospc` writes the first half and then
//!   fails as a full disk does (`ENOSPC`), which the save reports naming the file.
//!
//! The library never reads the variable by itself: `crate::faults::Faults::from_env`
//! does, for the command line and for tests, and a session injects what it is given.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use crate::Error;

/// The environment variable a save reads its test fault from.
pub const FAULT_VAR: &str = "OVERLAP_CHECKPOINT_FAULT";

/// The start of the line a stopped save prints on stderr before it hangs.
pub const STOP_MARKER: &str = "OVERLAP_CHECKPOINT_FAULT: save stopped at";

/// A moment of the save protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Shard,
    Report,
    Manifest,
    Rename,
    Latest,
}

impl Phase {
    const ALL: [Phase; 5] = [
        Phase::Shard,
        Phase::Report,
        Phase::Manifest,
        Phase::Rename,
        Phase::Latest,
    ];

    fn name(self) -> &'static str {
        match self {
            Phase::Shard => "shard",
            Phase::Report => "report",
            Phase::Manifest => "manifest",
            Phase::Rename => "rename",
            Phase::Latest => "latest",
        }
    }
}

/// What the fault does when its phase comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Stop,
    NoSpace,
}

/// A fault to inject into a save ([`crate::faults`]): the value of
/// `OVERLAP_CHECKPOINT_FAULT`, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaveFault {
    phase: Phase,
    rank: Option<u32>,
    step: Option<u64>,
    mode: Mode,
}

/// Where a save is: the phase, the rank whose file it writes (`None` for the commit's
/// phases) and the step saved.
#[derive(Debug, Clone, Copy)]
pub(crate) struct At {
    pub(crate) phase: Phase,
    pub(crate) rank: Option<u32>,
    pub(crate) step: u64,
}

impl SaveFault {
    /// The fault [`FAULT_VAR`] names, if it is set (and not empty); a malformed value is
    /// an error naming the variable.
    pub fn from_env() -> Result<Option<SaveFault>, Error> {
        match std::env::var(FAULT_VAR) {
            Ok(v) if !v.trim().is_empty() => SaveFault::parse(&v)
                .map(Some)
                .map_err(|e| Error::Usage(format!("{FAULT_VAR}={v}: {e}"))),
            _ => Ok(None),
        }
    }

    /// Parses `phase=P[,rank=R][,step=S][,mode=stop|enospc]` (the module's
    /// documentation says what each key means); the error says what is wrong.
    pub fn parse(s: &str) -> Result<SaveFault, String> {
        let (mut phase, mut rank, mut step, mut mode) = (None, None, None, Mode::Stop);
        for part in s.split(',') {
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!("`{part}` is not key=value"));
            };
            let value = value.trim();
            let number = |what: &str| {
                value
                    .parse::<u64>()
                    .map_err(|_| format!("{what} `{value}` is not a whole number"))
            };
            match key.trim() {
                "phase" => phase = Some(parse_phase(value)?),
                "rank" => {
                    let r = number("rank")?;
                    rank = Some(u32::try_from(r).map_err(|_| format!("rank {r} is too large"))?);
                }
                "step" => step = Some(number("step")?),
                "mode" => mode = parse_mode(value)?,
                other => return Err(format!("unknown key `{other}` (phase, rank, step, mode)")),
            }
        }
        let phase = phase.ok_or("no phase= (shard, report, manifest, rename, latest)")?;
        Ok(SaveFault {
            phase,
            rank,
            step,
            mode,
        })
    }

    fn hits(&self, at: At) -> bool {
        self.phase == at.phase
            && self.step.map_or(true, |s| s == at.step)
            && (self.rank.is_none() || at.rank.is_none() || self.rank == at.rank)
    }
}

fn parse_phase(value: &str) -> Result<Phase, String> {
    Phase::ALL
        .into_iter()
        .find(|p| p.name() == value)
        .ok_or_else(|| {
            format!("phase `{value}` is none of shard, report, manifest, rename, latest")
        })
}

fn parse_mode(value: &str) -> Result<Mode, String> {
    match value {
        "stop" => Ok(Mode::Stop),
        "enospc" => Ok(Mode::NoSpace),
        _ => Err(format!("mode `{value}` is neither stop nor enospc")),
    }
}

/// Writes `bytes` to the open file `f` at `path`, unless the fault hits this moment of
/// the save: then half of them, and it stops or fails as the fault says.
pub(crate) fn write(
    fault: Option<&SaveFault>,
    at: At,
    path: &Path,
    f: &mut File,
    bytes: &[u8],
) -> std::io::Result<()> {
    let Some(fault) = fault.filter(|x| x.hits(at)) else {
        return f.write_all(bytes);
    };
    f.write_all(&bytes[..bytes.len() / 2])?;
    f.sync_all()?;
    act(fault, at, path)
}

/// At a moment with no file to write (the rename): stops or fails if the fault hits it.
pub(crate) fn point(fault: Option<&SaveFault>, at: At, path: &Path) -> std::io::Result<()> {
    match fault.filter(|x| x.hits(at)) {
        Some(fault) => act(fault, at, path),
        None => Ok(()),
    }
}

fn act(fault: &SaveFault, at: At, path: &Path) -> std::io::Result<()> {
    if fault.mode == Mode::NoSpace {
        return Err(no_space());
    }
    let rank = at.rank.map_or_else(String::new, |r| format!(", rank {r}"));
    eprintln!(
        "{STOP_MARKER} {} (step {}{rank}): {}",
        at.phase.name(),
        at.step,
        path.display()
    );
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The error a full disk gives.
fn no_space() -> std::io::Error {
    #[cfg(unix)]
    return std::io::Error::from_raw_os_error(28);
    #[cfg(not(unix))]
    return std::io::Error::other("no space left on device (injected)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_parses_with_defaults_and_names_what_is_wrong() {
        let f = SaveFault::parse("phase=shard,rank=1,step=4").unwrap();
        assert_eq!(
            (f.phase, f.rank, f.step, f.mode),
            (Phase::Shard, Some(1), Some(4), Mode::Stop)
        );
        let f = SaveFault::parse("phase=latest,mode=enospc").unwrap();
        assert_eq!((f.rank, f.step, f.mode), (None, None, Mode::NoSpace));
        for (bad, phrase) in [
            ("rank=1", "no phase="),
            ("phase=disk", "none of shard"),
            ("phase=shard,mode=crash", "neither stop nor enospc"),
            ("phase=shard,rank=x", "not a whole number"),
            ("phase=shard,when=now", "unknown key `when`"),
            ("phase", "not key=value"),
        ] {
            let e = SaveFault::parse(bad).unwrap_err();
            assert!(e.contains(phrase), "{bad}: {e}");
        }
    }

    #[test]
    fn a_fault_hits_its_phase_step_and_rank_only() {
        let f = SaveFault::parse("phase=shard,rank=1,step=4").unwrap();
        let at = |phase, rank, step| At { phase, rank, step };
        assert!(f.hits(at(Phase::Shard, Some(1), 4)));
        assert!(!f.hits(at(Phase::Shard, Some(0), 4)));
        assert!(!f.hits(at(Phase::Shard, Some(1), 2)));
        assert!(!f.hits(at(Phase::Report, Some(1), 4)));
        let f = SaveFault::parse("phase=rename").unwrap();
        assert!(f.hits(at(Phase::Rename, None, 7)));
    }
}
