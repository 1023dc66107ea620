//! The copy transport's kernels as issued: [`Kernel::Exchange`] and [`Kernel::Gather`]
//! on their communicator's ring (`exchange.rs`), and [`Kernel::Combine`], which reads
//! what an exchange received, in its receive buffer or in place in the ring; in-place
//! receives are kept by their receive buffer's address until their combine (or a reset)
//! acknowledges them.
//!
//! Invariant: every in-place receive is acknowledged exactly once, in the order its
//! ring issued it, whether or not its combine runs; a member that cannot take part in
//! an exchange still writes and waits for every flag.

use cudarc::driver::sys;
use overlap_graph::{Collective, DType, ReduceOp, Stream};

use super::backend::Shared;
use super::checks::{check_collective, check_combine};
use super::exchange::InPlace;
use super::issue::Issue;
use super::memory::CudaBuffer;
use crate::copy_protocol::Plan;
#[cfg(doc)]
use crate::Kernel;
use crate::{CommId, OpsError};

impl Issue {
    /// The in-place receive a combine of `desc` names by its `recv` key, taken out:
    /// only an exchange of the combine's own group (a stale entry of another
    /// communicator at a reused address stays for its own combine or the reset).
    pub(super) fn take_in_place(
        &mut self,
        recv: &CudaBuffer,
        desc: &Collective,
    ) -> Option<(CommId, InPlace)> {
        let key = recv.ptr();
        if self.in_place.get(&key)?.0.group != desc.group {
            return None;
        }
        self.in_place.remove(&key)
    }

    /// [`Kernel::Combine`]: validated, then this rank's chunk reduced from `own` (at
    /// `own_offset`) and what was received, read from the ring when it was received in
    /// place (acknowledged afterwards, whether or not the combine ran).
    pub(super) fn combine(
        &mut self,
        rank: u32,
        raw: sys::CUstream,
        desc: &Collective,
        (size, index): (u32, u32),
        (own, own_offset): (&CudaBuffer, usize),
        (recv, dst): (&CudaBuffer, &CudaBuffer),
    ) -> Result<(), OpsError> {
        // Received in place: read the ring, then acknowledge (also when the
        // combine cannot run: the peers must not wait for it).
        let kept = self.take_in_place(recv, desc);
        // Read in place, `recv` was only the key: its length does not matter.
        let recv_len = match &kept {
            Some(_) => None,
            None => Some(recv.len),
        };
        let ran = check_combine(
            rank,
            desc,
            (size, index),
            (own, own_offset),
            (recv, recv_len),
            dst,
        )
        .and_then(|(c, at)| {
            let (from, stride) = match &kept {
                Some((_, k)) => (k.base, (k.stride / 4) as u64),
                None => (recv.ptr(), c as u64),
            };
            self.kernels.combine(
                raw,
                (self.combine_ctas, self.combine_streaming),
                (dst.at(at as u64), own.at(own_offset as u64), from),
                (c as u64, stride),
                size,
                index,
                desc.dtype == DType::Bf16,
                desc.op == ReduceOp::Avg,
            )
        });
        if let Some((id, k)) = kept {
            self.ack_in_place(raw, id, &k)?;
        }
        ran
    }

    /// Issues a copy-transport exchange on its communicator's ring. Like a collective,
    /// a member that is poisoned or whose call is invalid still joins (writing and
    /// waiting for every flag, copying no data), so its peers never hang. Returns the
    /// bytes this member receives.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn exchange(
        &mut self,
        shared: &Shared,
        stream: Stream,
        raw: sys::CUstream,
        desc: &Collective,
        id: CommId,
        (send, recv): (Option<CudaBuffer>, Option<CudaBuffer>),
        gather: bool,
        poison: Option<OpsError>,
    ) -> Result<u64, OpsError> {
        let kernel = if gather { "gather" } else { "exchange" };
        let shape = |reason: String| OpsError::Shape { kernel, reason };
        let ci = self.comm_index(shared, id, kernel, &poison)?;
        let (size, index) = (self.comms[ci].size, self.comms[ci].index);
        let (mut roles, received) = crate::copy_roles(desc, size, index, gather).map_err(shape)?;
        let recv_checked = if gather { None } else { recv.clone() };
        // On a ring read in place the receive buffer is only the combine's key
        // (`Backend::receives_in_place`): it must be this rank's, of any length, and
        // nothing is copied into it.
        let ri = self.copy.iter().position(|r| r.id == id);
        let keyed = !gather && ri.is_some_and(|ri| self.copy[ri].in_place());
        if let (Some(key), true, Some(_)) = (&recv_checked, keyed, roles.recv) {
            roles.recv = Some(key.len);
        }
        let own = match poison {
            Some(p) => Err(p),
            None => check_collective(shared.rank, stream, id, desc, &roles, &send, &recv_checked)
                .map_err(shape),
        };
        // What this member receives: f32 chunks as they are (the combine rounds).
        let bytes = (received * 4) as u64;
        if size > 1 {
            let plan = if gather {
                Plan::gather(desc, size, index)
            } else {
                Plan::new(desc, size, index)
            }
            .map_err(shape)?;
            let ri = ri.ok_or_else(|| not_set_up(id))?;
            let valid = own.is_ok();
            let s = send.as_ref().filter(|_| valid).map(CudaBuffer::ptr);
            // In place every received piece stays in the ring (`Op::Keep`): no address
            // to copy into, so a key of one element is never written past.
            let r = recv
                .as_ref()
                .filter(|_| valid && !keyed)
                .map(CudaBuffer::ptr);
            // A gather's buffer is its output, never a pending in-place receive.
            let key = recv.as_ref().filter(|_| !gather).map(CudaBuffer::ptr);
            // A receive buffer reused before its combine ran (a step cut short): release
            // the older pieces first, before this exchange waits for free slots.
            if let Some((old_id, old)) = key.and_then(|k| self.in_place.remove(&k)) {
                self.ack_in_place(raw, old_id, &old)?;
            }
            if let Some(kept) = self.copy[ri].exchange(raw, &plan, s, r)? {
                // Keyed by the receive buffer the combine will name, also when this
                // member could not take part: its combine (run or skipped) acknowledges
                // in order. Without a receive buffer there is no combine: acknowledge now.
                match key {
                    Some(key) => {
                        self.in_place.insert(key, (id, kept));
                    }
                    None => self.ack_in_place(raw, id, &kept)?,
                }
            }
        }
        own.map(|()| bytes)
    }

    /// Acknowledges the pieces an in-place exchange kept, on `raw` (the combine's stream).
    pub(super) fn ack_in_place(
        &mut self,
        raw: sys::CUstream,
        id: CommId,
        kept: &InPlace,
    ) -> Result<(), OpsError> {
        match self.copy.iter_mut().find(|r| r.id == id) {
            Some(ring) => ring.ack(raw, &kept.acks),
            None => Err(OpsError::Collective {
                comm: id.to_string(),
                reason: "an in-place receive outlived its copy ring".into(),
            }),
        }
    }
}

/// The error of an exchange or gather on a communicator without a copy ring.
fn not_set_up(id: CommId) -> OpsError {
    OpsError::Collective {
        comm: id.to_string(),
        reason: "the copy transport was not set up on this communicator: call CudaBackend::connect_copy after connect (the run's transport must be `copy` on every rank)".into(),
    }
}
