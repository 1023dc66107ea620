//! Pinned host staging for a flush's words (`flush.rs`): two page-locked areas per
//! stream, used in turn.
//!
//! A flush uploads its words (the scalars and the tables of addresses, some 12 KB for
//! GPT-2 small's 148 tensors) before its launches. From pageable memory the driver
//! first copies them into a staging buffer of its own, inside the call; from
//! page-locked memory the copy is a DMA the call only queues. The DMA reads the host
//! memory when the stream gets to it, so an area is written again only once the record
//! made after the flush that last used it reports complete. That record is the one the
//! flush lands its deferred events on when it has any (no extra event), else one of
//! its own.
//!
//! Nothing here waits: an area whose last copy has not run yet (the stream is behind,
//! or blocked on a peer) is passed over, and with both busy the words go from pageable
//! memory as before, which is always correct. A failed page-locked allocation leaves
//! the stream on pageable uploads for good.
//!
//! Invariant: an area's bytes are written only while no copy queued from it can still
//! be pending on the device; an area is freed only then, or leaked.

use std::sync::Arc;

use cudarc::driver::sys;

use super::event::Record;

/// Page-locked bytes at least this large, so that a growing flush rarely reallocates.
const MIN_BYTES: usize = 64 << 10;

/// One page-locked area and the record made after the last flush that read it.
struct Area {
    ptr: *mut u8,
    bytes: usize,
    /// `None`: no copy from it is pending (never used, or the flush's record failed,
    /// in which case the copy was behind a synchronising fallback).
    after: Option<Arc<Record>>,
}

impl Area {
    /// Whether nothing queued from the area can still read it.
    fn idle(&self) -> bool {
        self.after
            .as_ref()
            .map_or(true, |r| matches!(r.query(), Ok(true)))
    }
}

/// A stream's two areas (module docs).
#[derive(Default)]
pub(super) struct Staging {
    areas: [Option<Area>; 2],
    /// The area the next flush tries first.
    next: usize,
    /// The area the current flush copied from, until [`Self::seal`] names its record.
    unsealed: Option<usize>,
    /// Page-locked memory could not be had: pageable uploads only.
    off: bool,
    /// Uploads that went from pageable memory because both areas were busy.
    pub(super) busy: u64,
}

// SAFETY: the areas are plain host memory owned here, used under the issue lock.
unsafe impl Send for Staging {}

impl Staging {
    /// A page-locked copy of `words` for a flush on its way: the address to copy from,
    /// or `None` when none is free (copy from `words` itself). The caller queues the copy
    /// and then [`Self::seal`]s the area with a record made after the flush.
    pub(super) fn stage(&mut self, words: &[u64]) -> Option<*const u8> {
        if self.off {
            return None;
        }
        let bytes = std::mem::size_of_val(words);
        let i = [self.next, 1 - self.next]
            .into_iter()
            .find(|&i| self.areas[i].as_ref().map_or(true, Area::idle));
        let Some(i) = i else {
            self.busy += 1;
            return None;
        };
        if self.areas[i].as_ref().is_some_and(|a| a.bytes < bytes) {
            if let Some(a) = self.areas[i].take() {
                free(a);
            }
        }
        if self.areas[i].is_none() {
            match alloc(bytes.max(MIN_BYTES).next_power_of_two()) {
                Some(a) => self.areas[i] = Some(a),
                None => {
                    self.off = true;
                    return None;
                }
            }
        }
        let area = self.areas[i].as_mut()?;
        // SAFETY: the area holds at least `bytes` bytes and no pending copy reads it
        // (`idle` above, or new); `words` is a live slice of `bytes` bytes.
        unsafe { std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>(), area.ptr, bytes) };
        area.after = None;
        self.unsealed = Some(i);
        self.next = 1 - i;
        Some(area.ptr.cast_const())
    }

    /// Names the record made after the flush that copied from the area [`Self::stage`]
    /// gave last: the area is written again only once it is complete. Without a record
    /// (it could not be made) the area is left alone until the stream is known to have
    /// passed it: the caller synchronises the stream or stops using the area.
    pub(super) fn seal(&mut self, record: Option<&Arc<Record>>) {
        let Some(i) = self.unsealed.take() else {
            return;
        };
        match (record, self.areas[i].as_mut()) {
            (Some(r), Some(a)) => a.after = Some(Arc::clone(r)),
            // No record to tell when the copy ran: the area is leaked, never reused.
            (None, Some(_)) => self.areas[i] = None,
            _ => {}
        }
    }

    /// Whether the flush on its way copied from an area that still needs its record.
    pub(super) fn needs_seal(&self) -> bool {
        self.unsealed.is_some()
    }

    /// Frees the areas no pending copy reads; leaks the others (the device may still
    /// read them).
    pub(super) fn release(&mut self) {
        for a in self.areas.iter_mut().filter_map(Option::take) {
            if a.idle() {
                free(a);
            }
        }
    }

    /// Forgets the areas without freeing them (a device that did not drain may still
    /// read them).
    pub(super) fn leak(&mut self) {
        self.areas = [None, None];
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.release();
    }
}

/// A page-locked area of `bytes`, or `None` when the driver has none to give.
fn alloc(bytes: usize) -> Option<Area> {
    let mut ptr = std::ptr::null_mut();
    // SAFETY: a plain page-locked allocation of the bound context; flags 0 (portable
    // across nothing, not mapped, not write-combined: the host writes, the DMA reads).
    let ok = unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, 0) }.result();
    (ok.is_ok() && !ptr.is_null()).then(|| Area {
        ptr: ptr.cast(),
        bytes,
        after: None,
    })
}

/// Frees an area no pending copy reads.
fn free(a: Area) {
    // SAFETY: allocated by `cuMemHostAlloc` and idle; a failure leaves it leaked.
    let _ = unsafe { sys::cuMemFreeHost(a.ptr.cast()) };
}
