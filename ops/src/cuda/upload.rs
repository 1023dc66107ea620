//! The flush's words into the stream's scratch, writing only what changed.
//!
//! A flush uploads its words (`flush.rs`: the scalars and the tables of addresses)
//! before its launches. From one step to the next most of them are the same: the
//! tables change only where the step's gradients or norm landed elsewhere in the pool,
//! the scalars only with the step count and the learning rate. A `cuMemcpyHtoDAsync`
//! of the whole array costs the host about 10 µs whatever it holds, so each stream keeps
//! a copy of the words it last uploaded ([`Shadow`]) and, when the scratch still holds
//! them, writes only the words that differ ([`UploadMode`]): none at all when nothing
//! changed, the span from the first to the last changed word, or each changed word as a
//! 64-bit stream write (`cuStreamBatchMemOp`, one call for up to [`MAX_WRITES`]).
//!
//! Invariant: the words are skipped only where the scratch is provably the one they
//! were written to (the same allocation, by serial) and nothing used it since (the
//! stream's scratch was handed out once since, to this flush): every other user of the
//! scratch asks for it through `Issue::scratch`, which counts the hand-outs, and a flush
//! writes nothing of its own over its words (its Muon regions end before them, its
//! norm's partial sums start after them). Writes are ordered on the stream like the
//! copy, so the launches after them read this flush's words.

use cudarc::driver::sys;

use super::device::Device;
use crate::OpsError;

/// Most words written one by one (`cuStreamBatchMemOp`); more are copied as a span.
pub(super) const MAX_WRITES: usize = 64;

/// How a flush writes the words that changed since the last upload to its scratch
/// (`OVERLAP_UPLOAD`: `full`, `span`, `writes`; the default is [`UploadMode::Span`],
/// and [`UploadMode::Writes`] where the device cannot is [`UploadMode::Span`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum UploadMode {
    /// Every word, every flush.
    Full,
    /// Nothing when nothing changed, else one copy from the first to the last changed
    /// word.
    Span,
    /// Nothing when nothing changed, else each changed word as a 64-bit stream write
    /// (up to [`MAX_WRITES`], a span beyond), where the device allows them.
    Writes,
}

impl UploadMode {
    /// The mode `OVERLAP_UPLOAD` names (unset or unknown: [`UploadMode::Span`]).
    pub(super) fn from_env() -> UploadMode {
        match std::env::var("OVERLAP_UPLOAD").as_deref() {
            Ok("full") => UploadMode::Full,
            Ok("writes") => UploadMode::Writes,
            _ => UploadMode::Span,
        }
    }
}

/// The mode `OVERLAP_UPLOAD` names, as far as `device` allows it.
pub(super) fn mode_for(device: &Device) -> UploadMode {
    let writes = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS;
    match UploadMode::from_env() {
        UploadMode::Writes if device.attribute(writes) != Some(1) => UploadMode::Span,
        mode => mode,
    }
}

/// What a stream's scratch holds of the last words uploaded to it.
#[derive(Debug)]
pub(super) struct Shadow {
    /// The scratch allocation's serial and the stream's count of scratch hand-outs
    /// when the words were written.
    scratch: (u64, u64),
    /// Where the words start.
    at: u64,
    words: Vec<u64>,
}

/// The words of one flush and where they go.
pub(super) struct Target<'a> {
    pub(super) stream: sys::CUstream,
    /// The scratch allocation's serial and the stream's count of scratch hand-outs,
    /// this flush's own included.
    pub(super) scratch: (u64, u64),
    /// The device address of the first word.
    pub(super) at: u64,
    pub(super) words: &'a [u64],
}

/// What an upload writes.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Nothing,
    Copy(std::ops::Range<usize>),
    Writes(Vec<usize>),
}

/// What to write of `t`'s words as `mode` says over what `shadow` knows is there, and
/// the words that differ from it (`None`: the scratch holds none of them).
fn decide(shadow: Option<&Shadow>, mode: UploadMode, t: &Target<'_>) -> (Action, Option<usize>) {
    let known = shadow.filter(|s| {
        s.scratch.0 == t.scratch.0
            && s.scratch.1 + 1 == t.scratch.1
            && s.at == t.at
            && s.words.len() == t.words.len()
    });
    let Some(c) = known.map(|s| changed(&s.words, t.words)) else {
        return (Action::Copy(0..t.words.len()), None);
    };
    let n = Some(c.len());
    let action = match mode {
        UploadMode::Full => Action::Copy(0..t.words.len()),
        _ if c.is_empty() => Action::Nothing,
        UploadMode::Writes if c.len() <= MAX_WRITES => Action::Writes(c),
        _ => Action::Copy(c[0]..c[c.len() - 1] + 1),
    };
    (action, n)
}

/// Writes `t`'s words as `mode` says over what `shadow` knows is there, and updates
/// it (forgotten on a failure); the number of words that differed from the last
/// upload (`None`: the scratch held none of them).
pub(super) fn upload(
    shadow: &mut Option<Shadow>,
    mode: UploadMode,
    t: &Target<'_>,
) -> Result<Option<usize>, OpsError> {
    let (action, changed) = decide(shadow.as_ref(), mode, t);
    let result = match &action {
        Action::Nothing => Ok(()),
        Action::Copy(range) => copy(t, range.clone()),
        Action::Writes(idx) => writes(t, idx),
    };
    match result {
        Ok(()) => {
            let s = shadow.get_or_insert_with(|| Shadow {
                scratch: t.scratch,
                at: t.at,
                words: Vec::new(),
            });
            s.scratch = t.scratch;
            s.at = t.at;
            s.words.clear();
            s.words.extend_from_slice(t.words);
            Ok(changed)
        }
        Err(e) => {
            *shadow = None;
            Err(e)
        }
    }
}

/// The indices where `now` differs from `before` (same length).
fn changed(before: &[u64], now: &[u64]) -> Vec<usize> {
    before
        .iter()
        .zip(now)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, _)| i)
        .collect()
}

/// Copies `t`'s words in `range` to their place (pageable memory: staged by the
/// driver before the call returns, ordered on the stream).
fn copy(t: &Target<'_>, range: std::ops::Range<usize>) -> Result<(), OpsError> {
    let words = &t.words[range.clone()];
    if words.is_empty() {
        return Ok(());
    }
    // SAFETY: the scratch holds every word from `t.at` on; the host memory is pageable
    // and staged before the call returns; the copy is ordered on the stream before the
    // launches that read it and after everything earlier that used the scratch.
    unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            t.at + 8 * range.start as u64,
            words.as_ptr().cast(),
            words.len() * 8,
            t.stream,
        )
    }
    .result()
    .map_err(|e| super::device::failed("optimizer", e))
}

/// Writes `t`'s words at `idx` one by one as 64-bit stream writes, in one call.
fn writes(t: &Target<'_>, idx: &[usize]) -> Result<(), OpsError> {
    let mut ops: Vec<sys::CUstreamBatchMemOpParams> = idx
        .iter()
        .map(|&i| {
            // SAFETY: a plain-data union, all of it zero before the fields are set.
            let mut op: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
            op.writeValue.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64;
            op.writeValue.address = t.at + 8 * i as u64;
            op.writeValue.__bindgen_anon_1.value64 = t.words[i];
            op.writeValue.flags = 0;
            op
        })
        .collect();
    // SAFETY: `ops` holds `idx.len()` write operations to words of the scratch; the
    // writes are ordered on the stream like a copy (flags 0: with a memory barrier).
    unsafe { sys::cuStreamBatchMemOp_v2(t.stream, ops.len() as u32, ops.as_mut_ptr(), 0) }
        .result()
        .map_err(|e| super::device::failed("optimizer", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(scratch: (u64, u64), at: u64, words: &[u64]) -> Target<'_> {
        Target {
            stream: std::ptr::null_mut(),
            scratch,
            at,
            words,
        }
    }

    #[test]
    fn only_what_changed_is_written_where_the_scratch_still_holds_the_last_words() {
        let before: Vec<u64> = (0..200).collect();
        let shadow = Shadow {
            scratch: (7, 3),
            at: 4096,
            words: before.clone(),
        };
        let mut now = before.clone();
        now[5] = 99;
        now[150] = 98;
        let t = target((7, 4), 4096, &now);
        let span = decide(Some(&shadow), UploadMode::Span, &t);
        assert_eq!(span, (Action::Copy(5..151), Some(2)));
        let writes = decide(Some(&shadow), UploadMode::Writes, &t);
        assert_eq!(writes, (Action::Writes(vec![5, 150]), Some(2)));
        let full = decide(Some(&shadow), UploadMode::Full, &t);
        assert_eq!(full, (Action::Copy(0..200), Some(2)));
        // Nothing changed: nothing written.
        let same = target((7, 4), 4096, &before);
        assert_eq!(
            decide(Some(&shadow), UploadMode::Span, &same).0,
            Action::Nothing
        );
        // More changes than stream writes: a span.
        let many: Vec<u64> = before.iter().map(|w| w + 1).collect();
        let t = target((7, 4), 4096, &many);
        let got = decide(Some(&shadow), UploadMode::Writes, &t);
        assert_eq!(got, (Action::Copy(0..200), Some(200)));
    }

    #[test]
    fn everything_is_written_where_the_scratch_may_hold_anything_else() {
        let words: Vec<u64> = (0..10).collect();
        let shadow = Shadow {
            scratch: (7, 3),
            at: 4096,
            words: words.clone(),
        };
        let cases = [
            // Another allocation, the scratch handed out twice since, the words
            // elsewhere in it, another count of words, no upload known.
            (target((8, 4), 4096, &words), Some(&shadow)),
            (target((7, 5), 4096, &words), Some(&shadow)),
            (target((7, 4), 8192, &words), Some(&shadow)),
            (target((7, 4), 4096, &words[..9]), Some(&shadow)),
            (target((7, 4), 4096, &words), None),
        ];
        for (t, s) in &cases {
            for mode in [UploadMode::Span, UploadMode::Writes] {
                let len = t.words.len();
                assert_eq!(decide(*s, mode, t), (Action::Copy(0..len), None));
            }
        }
    }
}
