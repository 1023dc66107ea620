//! Fault injection for tests: make one rank's first node of a kind, in one step, fail,
//! hang, or (for the global norm) see a NaN gradient ([`ExecConfig::fault`], set from
//! the `OVERLAP_FAULT` environment variable by the `overlap` CLI).
//!
//! The executor does it on every backend by launching an extra kernel on the node's
//! stream just before the node's own: for `fail`, a kernel that fails its checks (an add
//! of a 2-element buffer into a 1-element one), which poisons the stream as any device
//! failure does; for `hang`, a [`Kernel::Spin`] of `u32::MAX` µs (71 minutes), which the
//! step timeout catches; for `nan` (only before a `grad_norm` node, i.e. with `[clip]`),
//! a one-element [`Kernel::Unpack`] that writes NaN into element 0 of the first reduced
//! gradient the rank counts in the global norm, so the norm is NaN on every rank and the
//! step is skipped or refused (`[clip] on_nonfinite`), as a NaN from a real backward
//! would make it. All carry the tag [`FAULT_OP`], so reports and timelines name the
//! injection.
//!
//! The value of `OVERLAP_FAULT` ([`FaultSpec::parse`]) is
//! `rank=R,kind=K,step=S[,mode=fail|hang|nan][,attempt=A]`: global rank `R`'s first node
//! of kind `K` (`Op::KINDS`) in step `S` (from 1, the executor's step number, which a
//! resumed run numbers on from its checkpoint); `mode` `fail` by default, `nan` only with
//! `kind=grad_norm`; `attempt=A` fires only in attempt `A` of a job that `overlap launch
//! --max-restarts` restarts (where [`RESTART_COUNT_VAR`], which the launcher sets in every
//! rank, is `A`; unset counts as 0), so a test can fail the first attempt and let the
//! restart finish; without it the fault fires on every attempt. Each key at most once and
//! no other key; a malformed value of either variable is an error naming it.
//!
//! [`ExecConfig::fault`]: crate::ExecConfig::fault
//! [`Kernel::Spin`]: overlap_ops::Kernel::Spin
//! [`Kernel::Unpack`]: overlap_ops::Kernel::Unpack

use overlap_graph::Op;

/// The environment variable the `overlap` CLI reads a [`Fault`] from.
pub const FAULT_VAR: &str = "OVERLAP_FAULT";

/// The environment variable `overlap launch` sets in every rank it starts: 0 on the
/// first attempt of the job, `K` on the `K`-th restart (`--max-restarts`; torchrun's
/// `TORCHELASTIC_RESTART_COUNT`). `attempt=K` of [`FAULT_VAR`] compares with it.
pub const RESTART_COUNT_VAR: &str = "OVERLAP_RESTART_COUNT";

/// The tag (`Tag::op`) of an injected kernel.
pub const FAULT_OP: &str = "injected_fault";

/// The node kind a [`FaultMode::Nan`] fault names.
pub(crate) const NAN_KIND: &str = "grad_norm";

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultMode {
    /// The kernel fails: the stream is poisoned, its collectives fail on every member.
    Fail,
    /// The kernel never ends (until the process exits or the CPU backend is dropped).
    Hang,
    /// Element 0 of the first reduced gradient the rank counts in the global norm
    /// (`Plan::norm_params`) becomes NaN just before its `grad_norm` node: a test hook
    /// for non-finite steps (`[clip]`). Only with `kind=grad_norm`.
    Nan,
}

impl FaultMode {
    /// The name in `mode=`.
    pub fn name(self) -> &'static str {
        match self {
            FaultMode::Fail => "fail",
            FaultMode::Hang => "hang",
            FaultMode::Nan => "nan",
        }
    }
}

/// A fault to inject: rank `rank`'s first node of kind `kind` in step `step` (1-based,
/// the executor's step number) fails, hangs, or reads a NaN gradient.
/// Made by [`Fault::new`] or [`Fault::parse`], which check it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Fault {
    /// Global rank.
    pub rank: u32,
    /// A node kind (`Op::KINDS`: `grad_ready`, `pack`, `stage1`, ...).
    pub kind: &'static str,
    /// The step, from 1.
    pub step: u64,
    /// Fail, hang or NaN.
    pub mode: FaultMode,
}

impl Fault {
    /// Rank `rank`'s first node of kind `kind` (one of `Op::KINDS`) in step `step`
    /// (from 1) fails, hangs or (`FaultMode::Nan`, only with kind `grad_norm`) reads a
    /// NaN gradient. The error says which argument is wrong.
    pub fn new(rank: u32, kind: &str, step: u64, mode: FaultMode) -> Result<Fault, String> {
        let kind = kind_value(kind)?;
        if step == 0 {
            return Err("step 0 is not a step number (1, 2, ...)".into());
        }
        if mode == FaultMode::Nan && kind != NAN_KIND {
            return Err(format!(
                "mode `nan` writes NaN into a reduced gradient just before the rank's global norm: it needs kind={NAN_KIND}, got kind={kind}"
            ));
        }
        Ok(Fault {
            rank,
            kind,
            step,
            mode,
        })
    }

    /// Parses `rank=R,kind=K,step=S[,mode=fail|hang|nan]` (mode `fail` by default;
    /// `nan` needs `kind=grad_norm`). Every key at most once, no other key; the error
    /// says what is wrong. `attempt=K` is [`FaultSpec::parse`]'s (the environment says
    /// which attempt a process belongs to), refused here.
    pub fn parse(s: &str) -> Result<Fault, String> {
        let spec = FaultSpec::parse(s)?;
        if let Some(a) = spec.attempt {
            return Err(format!(
                "`attempt={a}` says on which attempt of a restarted job the fault fires: only {FAULT_VAR} (FaultSpec::parse) takes it"
            ));
        }
        Ok(spec.fault)
    }

    /// The fault `OVERLAP_FAULT` names, if it is set (and not empty) and, when it has
    /// `attempt=K`, `OVERLAP_RESTART_COUNT` is `K` (unset: 0, the first attempt); a
    /// malformed value of either is an error naming the variable.
    pub fn from_env() -> Result<Option<Fault>, String> {
        let Some(spec) = FaultSpec::from_env()? else {
            return Ok(None);
        };
        if spec.attempt.is_none() {
            return Ok(Some(spec.fault));
        }
        Ok(spec.on_attempt(restart_count()?))
    }

    /// Whether this fault fires on `rank`'s node of `kind` in `step`.
    pub fn hits(&self, rank: u32, kind: &str, step: u64) -> bool {
        self.rank == rank && self.kind == kind && self.step == step
    }
}

/// `OVERLAP_FAULT`'s value: a [`Fault`] and the attempt of a job restarted by `overlap
/// launch --max-restarts` it fires on (`attempt=K`: only where `OVERLAP_RESTART_COUNT`
/// is `K`; without it, on every attempt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultSpec {
    /// The fault.
    pub fault: Fault,
    /// The attempt it fires on (0: the first), `None` for every attempt.
    pub attempt: Option<u32>,
}

impl FaultSpec {
    /// Parses `rank=R,kind=K,step=S[,mode=fail|hang|nan][,attempt=A]` (mode `fail` by
    /// default; `nan` needs `kind=grad_norm`). Every key at most once, no other key;
    /// the error says what is wrong.
    pub fn parse(s: &str) -> Result<FaultSpec, String> {
        let (mut rank, mut kind, mut step, mut mode, mut attempt) = (None, None, None, None, None);
        for part in s.split(',') {
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!("`{part}` is not key=value"));
            };
            let (key, value) = (key.trim(), value.trim());
            match key {
                "rank" => once(&mut rank, key, || rank_value(value))?,
                "kind" => once(&mut kind, key, || kind_value(value))?,
                "step" => once(&mut step, key, || step_value(value))?,
                "mode" => once(&mut mode, key, || mode_value(value))?,
                "attempt" => once(&mut attempt, key, || attempt_value(value))?,
                _ => {
                    return Err(format!(
                        "unknown key `{key}` (expected rank, kind, step and optionally mode and attempt)"
                    ))
                }
            }
        }
        let missing = |what: &str| format!("`{what}=` is missing");
        let fault = Fault::new(
            rank.ok_or_else(|| missing("rank"))?,
            kind.ok_or_else(|| missing("kind"))?,
            step.ok_or_else(|| missing("step"))?,
            mode.unwrap_or(FaultMode::Fail),
        )?;
        Ok(FaultSpec { fault, attempt })
    }

    /// What `OVERLAP_FAULT` says, if it is set (and not empty); a malformed value is an
    /// error naming the variable.
    pub fn from_env() -> Result<Option<FaultSpec>, String> {
        match std::env::var(FAULT_VAR) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => FaultSpec::parse(&v)
                .map(Some)
                .map_err(|e| format!("{FAULT_VAR}={v:?}: {e}")),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(format!("{FAULT_VAR} is not valid UTF-8"))
            }
        }
    }

    /// The fault on attempt `attempt` of the job (0: the first): none when `attempt=`
    /// names another.
    pub fn on_attempt(&self, attempt: u32) -> Option<Fault> {
        self.attempt
            .map_or(true, |a| a == attempt)
            .then_some(self.fault)
    }
}

/// Sets `slot` to what `parse` makes of the value, refusing a key given twice.
fn once<T>(
    slot: &mut Option<T>,
    key: &str,
    parse: impl FnOnce() -> Result<T, String>,
) -> Result<(), String> {
    if slot.is_some() {
        return Err(format!("`{key}` is given twice"));
    }
    *slot = Some(parse()?);
    Ok(())
}

fn rank_value(value: &str) -> Result<u32, String> {
    value
        .parse::<u32>()
        .map_err(|_| format!("rank `{value}` is not a rank number (0, 1, ...)"))
}

fn kind_value(value: &str) -> Result<&'static str, String> {
    Op::KINDS
        .iter()
        .copied()
        .find(|&k| k == value)
        .ok_or_else(|| {
            format!(
                "kind `{value}` is not a node kind (one of {})",
                Op::KINDS.join(", ")
            )
        })
}

fn step_value(value: &str) -> Result<u64, String> {
    value
        .parse::<u64>()
        .ok()
        .filter(|&s| s >= 1)
        .ok_or_else(|| format!("step `{value}` is not a step number (1, 2, ...)"))
}

fn mode_value(value: &str) -> Result<FaultMode, String> {
    match value {
        "fail" => Ok(FaultMode::Fail),
        "hang" => Ok(FaultMode::Hang),
        "nan" => Ok(FaultMode::Nan),
        _ => Err(format!("mode `{value}` is not `fail`, `hang` or `nan`")),
    }
}

fn attempt_value(value: &str) -> Result<u32, String> {
    value.parse::<u32>().map_err(|_| {
        format!("attempt `{value}` is not an attempt number (0 for the first, 1 for the first restart, ...)")
    })
}

/// This process's attempt of a job restarted by `overlap launch --max-restarts`:
/// `OVERLAP_RESTART_COUNT`, 0 when it is unset (or empty).
pub fn restart_count() -> Result<u32, String> {
    match std::env::var(RESTART_COUNT_VAR) {
        Ok(v) if v.trim().is_empty() => Ok(0),
        Ok(v) => v.trim().parse::<u32>().map_err(|_| {
            format!("{RESTART_COUNT_VAR}={v:?} is not a restart count (0, 1, ...), which {FAULT_VAR}'s `attempt=` is compared with")
        }),
        Err(std::env::VarError::NotPresent) => Ok(0),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("{RESTART_COUNT_VAR} is not valid UTF-8"))
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank={},kind={},step={},mode={}",
            self.rank,
            self.kind,
            self.step,
            self.mode.name()
        )
    }
}

impl std::fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.fault)?;
        match self.attempt {
            Some(a) => write!(f, ",attempt={a}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_made_in_code_is_checked_as_a_parsed_one() {
        let f = Fault::new(2, "pack", 3, FaultMode::Hang).unwrap();
        assert_eq!(
            f,
            Fault::parse("rank=2,kind=pack,step=3,mode=hang").unwrap()
        );
        let bad = |e: Result<Fault, String>, what: &str| {
            let e = e.unwrap_err();
            assert!(e.contains(what), "{e}");
        };
        bad(
            Fault::new(0, "packing", 1, FaultMode::Fail),
            "`packing` is not a node kind",
        );
        bad(Fault::new(0, "pack", 0, FaultMode::Fail), "step 0");
        bad(
            Fault::new(0, "pack", 1, FaultMode::Nan),
            "needs kind=grad_norm",
        );
    }

    #[test]
    fn faults_parse_strictly() {
        let f = Fault::parse("rank=1,kind=stage1,step=2,mode=hang").unwrap();
        assert_eq!(
            f,
            Fault {
                rank: 1,
                kind: "stage1",
                step: 2,
                mode: FaultMode::Hang
            }
        );
        assert_eq!(Fault::parse(&f.to_string()).unwrap(), f);
        assert_eq!(
            Fault::parse("step=1, rank=0, kind=pack").unwrap().mode,
            FaultMode::Fail
        );
        let nan = Fault::parse("rank=0,kind=grad_norm,step=2,mode=nan").unwrap();
        assert_eq!((nan.mode, nan.kind), (FaultMode::Nan, "grad_norm"));
        assert_eq!(Fault::parse(&nan.to_string()).unwrap(), nan);
        for (bad, says) in [
            ("rank=1,kind=stage1", "`step=` is missing"),
            ("rank=x,kind=stage1,step=1", "rank `x`"),
            (
                "rank=1,kind=stage9,step=1",
                "kind `stage9` is not a node kind",
            ),
            ("rank=1,kind=pack,step=0", "step `0`"),
            ("rank=1,kind=pack,step=1,mode=slow", "mode `slow`"),
            ("rank=1,kind=pack,step=1,mode=nan", "needs kind=grad_norm"),
            ("rank=1,rank=2,kind=pack,step=1", "`rank` is given twice"),
            ("rank=1,kind=pack,step=1,node=3", "unknown key `node`"),
            (
                "rank=1;kind=pack,step=1",
                "rank `1;kind=pack` is not a rank number",
            ),
            ("rank=1,kind=pack,step", "`step` is not key=value"),
            ("", "is not key=value"),
        ] {
            let e = Fault::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn an_attempt_limits_the_fault_to_one_attempt_of_a_restarted_job() {
        let spec = FaultSpec::parse("rank=1,kind=stage1,step=5,attempt=0").unwrap();
        assert_eq!(spec.attempt, Some(0));
        assert_eq!(FaultSpec::parse(&spec.to_string()).unwrap(), spec);
        assert_eq!(spec.on_attempt(0), Some(spec.fault));
        assert_eq!(spec.on_attempt(1), None);
        let every = FaultSpec::parse("rank=1,kind=stage1,step=5").unwrap();
        assert_eq!(
            (every.on_attempt(0), every.on_attempt(3)),
            (Some(every.fault), Some(every.fault))
        );
        for (bad, says) in [
            (
                "rank=1,kind=pack,step=1,attempt=-1",
                "attempt `-1` is not an attempt number",
            ),
            ("rank=1,kind=pack,step=1,attempt=first", "attempt `first`"),
            (
                "rank=1,kind=pack,step=1,attempt=0,attempt=1",
                "`attempt` is given twice",
            ),
        ] {
            let e = FaultSpec::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = Fault::parse("rank=1,kind=pack,step=1,attempt=0").unwrap_err();
        assert!(e.contains("only OVERLAP_FAULT"), "{e}");
    }
}
