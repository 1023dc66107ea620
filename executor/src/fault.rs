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
//! [`ExecConfig::fault`]: crate::ExecConfig::fault
//! [`Kernel::Spin`]: overlap_ops::Kernel::Spin
//! [`Kernel::Unpack`]: overlap_ops::Kernel::Unpack

use overlap_graph::Op;

/// The environment variable the `overlap` CLI reads a [`Fault`] from.
pub const FAULT_VAR: &str = "OVERLAP_FAULT";

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Parses `rank=R,kind=K,step=S[,mode=fail|hang|nan]` (mode `fail` by default;
    /// `nan` needs `kind=grad_norm`). Every key at most once, no other key; the error
    /// says what is wrong.
    pub fn parse(s: &str) -> Result<Fault, String> {
        let (mut rank, mut kind, mut step, mut mode) = (None, None, None, None);
        for part in s.split(',') {
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!("`{part}` is not key=value"));
            };
            let (key, value) = (key.trim(), value.trim());
            let dup = |set: bool| {
                if set {
                    Err(format!("`{key}` is given twice"))
                } else {
                    Ok(())
                }
            };
            match key {
                "rank" => {
                    dup(rank.is_some())?;
                    rank =
                        Some(value.parse::<u32>().map_err(|_| {
                            format!("rank `{value}` is not a rank number (0, 1, ...)")
                        })?);
                }
                "kind" => {
                    dup(kind.is_some())?;
                    kind = Some(Op::KINDS.iter().copied().find(|&k| k == value).ok_or_else(
                        || {
                            format!(
                                "kind `{value}` is not a node kind (one of {})",
                                Op::KINDS.join(", ")
                            )
                        },
                    )?);
                }
                "step" => {
                    dup(step.is_some())?;
                    step = Some(value.parse::<u64>().ok().filter(|&s| s >= 1).ok_or_else(
                        || format!("step `{value}` is not a step number (1, 2, ...)"),
                    )?);
                }
                "mode" => {
                    dup(mode.is_some())?;
                    mode = Some(match value {
                        "fail" => FaultMode::Fail,
                        "hang" => FaultMode::Hang,
                        "nan" => FaultMode::Nan,
                        _ => return Err(format!("mode `{value}` is not `fail`, `hang` or `nan`")),
                    });
                }
                _ => {
                    return Err(format!(
                        "unknown key `{key}` (expected rank, kind, step and optionally mode)"
                    ))
                }
            }
        }
        let missing = |what: &str| format!("`{what}=` is missing");
        let fault = Fault {
            rank: rank.ok_or_else(|| missing("rank"))?,
            kind: kind.ok_or_else(|| missing("kind"))?,
            step: step.ok_or_else(|| missing("step"))?,
            mode: mode.unwrap_or(FaultMode::Fail),
        };
        if fault.mode == FaultMode::Nan && fault.kind != NAN_KIND {
            return Err(format!(
                "mode `nan` writes NaN into a reduced gradient just before the rank's global norm: it needs kind={NAN_KIND}, got kind={}",
                fault.kind
            ));
        }
        Ok(fault)
    }

    /// The fault `OVERLAP_FAULT` names, if it is set (and not empty); a malformed value
    /// is an error naming the variable.
    pub fn from_env() -> Result<Option<Fault>, String> {
        match std::env::var(FAULT_VAR) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => Fault::parse(&v)
                .map(Some)
                .map_err(|e| format!("{FAULT_VAR}={v:?}: {e}")),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(format!("{FAULT_VAR} is not valid UTF-8"))
            }
        }
    }

    /// Whether this fault fires on `rank`'s node of `kind` in `step`.
    pub fn hits(&self, rank: u32, kind: &str, step: u64) -> bool {
        self.rank == rank && self.kind == kind && self.step == step
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
