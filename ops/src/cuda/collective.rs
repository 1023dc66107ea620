//! [`Kernel::Collective`] on NCCL: the member's communicator, its role's buffers checked
//! (`checks.rs`), bf16 staging through the stream's scratch, and a group of one as a
//! device copy.
//!
//! Invariant: a member that is poisoned or whose call is invalid still joins the NCCL
//! call, on scratch buffers of the size its role needs, so its peers never hang.

use cudarc::driver::sys;
use overlap_graph::{Collective, CollectiveKind, DType, ReduceOp, Stream};

use super::backend::Shared;
use super::checks::check_collective;
use super::device;
use super::exchange::copy;
use super::issue::Issue;
use super::memory::CudaBuffer;
use crate::copy_protocol::Plan;
#[cfg(doc)]
use crate::Kernel;
use crate::{collective_roles, CommId, OpsError};

impl Issue {
    /// Where this rank's communicator `id` is, or the error `kernel` reports (the
    /// poison, when the stream has one).
    pub(super) fn comm_index(
        &self,
        shared: &Shared,
        id: CommId,
        kernel: &'static str,
        poison: &Option<OpsError>,
    ) -> Result<usize, OpsError> {
        self.comms.iter().position(|c| c.id == id).ok_or_else(|| {
            poison.clone().unwrap_or_else(|| OpsError::Shape {
                kernel,
                reason: format!(
                    "rank {} has no communicator {id} (mesh {}); only the (group, stream) pairs of the plan's bindings are created",
                    shared.rank, shared.mesh
                ),
            })
        })
    }

    /// Issues a collective. A member that is poisoned or whose call is invalid still
    /// joins, on scratch buffers of the size its role needs, so its peers never hang.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn collective(
        &mut self,
        shared: &Shared,
        stream: Stream,
        raw: sys::CUstream,
        desc: &Collective,
        id: CommId,
        send: Option<CudaBuffer>,
        recv: Option<CudaBuffer>,
        poison: Option<OpsError>,
    ) -> Result<u64, OpsError> {
        let kernel = desc.kind.name();
        let shape = |reason: String| OpsError::Shape { kernel, reason };
        let ci = self.comm_index(shared, id, kernel, &poison)?;
        let (size, index) = (self.comms[ci].size, self.comms[ci].index);
        let roles = collective_roles(desc, size, index).map_err(shape)?;
        let own = match poison.clone() {
            Some(p) => Err(p),
            None => {
                check_collective(shared.rank, stream, id, desc, &roles, &send, &recv).map_err(shape)
            }
        };
        let elem = desc.dtype.size() as usize;
        let send_len = roles.send.unwrap_or(0);
        let recv_len = roles.recv.unwrap_or(0);
        let count = usize::try_from(desc.count).map_err(|_| shape("count too large".into()))?;
        let root = desc.root.unwrap_or(0);
        let valid = own.is_ok();
        if self.comms[ci].is_copy_only() && !(size == 1 && desc.dtype == DType::F32) {
            let (s, r) = (send.filter(|_| valid), recv.filter(|_| valid));
            self.copy_collective(shared, (stream, raw), desc, id, (size, index), (s, r))?;
        } else if valid && size == 1 && desc.dtype == DType::F32 {
            // A group of one: every collective is the identity (avg divides by 1), so
            // it is a device copy, or nothing in place; no NCCL launch.
            let s = send.as_ref().map_or(0, CudaBuffer::ptr);
            let r = recv.as_ref().map_or(0, CudaBuffer::ptr);
            if s != 0 && r != 0 && s != r && count > 0 {
                // SAFETY: both buffers hold `count` floats (checked above); the copy is
                // ordered on the collective's stream like the NCCL call it replaces.
                unsafe { sys::cuMemcpyDtoDAsync_v2(r, s, count * 4, raw) }
                    .result()
                    .map_err(|e| device::failed(kernel, e))?;
            }
        } else if valid && desc.dtype == DType::F32 {
            let s = send.as_ref().map_or(0, CudaBuffer::ptr);
            let r = recv.as_ref().map_or(0, CudaBuffer::ptr);
            let (s, r) = endpoints(desc.kind, s, r);
            self.comms[ci].issue(raw, desc.kind, desc.dtype, desc.op, root, s, r, count)?;
        } else {
            // Staging in the wire dtype: bf16 conversion, or the scratch a member that
            // cannot take part joins with.
            let s_bytes = (send_len * elem).next_multiple_of(256);
            let r_bytes = (recv_len * elem).next_multiple_of(256);
            let base = self.scratch(shared, stream, (s_bytes + r_bytes).max(256))?;
            let (s16, r16) = (base, base + s_bytes as u64);
            if valid {
                if let Some(src) = &send {
                    self.kernels
                        .round_bf16(raw, s16, src.ptr(), send_len as u64)?;
                }
            }
            let (s, r) = endpoints(
                desc.kind,
                if roles.send.is_some() { s16 } else { 0 },
                if roles.recv.is_some() { r16 } else { 0 },
            );
            self.comms[ci].issue(raw, desc.kind, desc.dtype, desc.op, root, s, r, count)?;
            if valid {
                if let Some(dst) = &recv {
                    self.kernels
                        .widen_bf16(raw, dst.ptr(), r16, recv_len as u64)?;
                }
            }
        }
        // Bytes this member contributes, as the CPU backend counts them.
        own.map(|()| (roles.send.unwrap_or(count) * elem) as u64)
    }
}

impl Issue {
    /// A collective on a communicator without NCCL (ranks sharing a GPU,
    /// [`super::CudaBackend::connect_copy_only`]), on its copy ring: a broadcast or an
    /// all-gather as a relay of the copy engines (bf16 rounded first, as NCCL's bf16
    /// carries it); a reduction as an exchange into the stream's scratch, the combine
    /// kernel (every member's value summed in member order, so every member of an
    /// all-reduce gets the same bits) and, for an all-reduce, a gather. `send` and
    /// `recv` are `None` for a member that cannot take part: it still writes and waits
    /// for every flag, so its peers finish.
    fn copy_collective(
        &mut self,
        shared: &Shared,
        (stream, raw): (Stream, sys::CUstream),
        desc: &Collective,
        id: CommId,
        (size, index): (u32, u32),
        (send, recv): (Option<CudaBuffer>, Option<CudaBuffer>),
    ) -> Result<(), OpsError> {
        let kernel = desc.kind.name();
        let shape = |reason: String| OpsError::Shape { kernel, reason };
        let failed = |reason| OpsError::Failed { kernel, reason };
        let count = usize::try_from(desc.count).map_err(|_| shape("count too large".into()))?;
        let (s, r) = (
            send.as_ref().map(CudaBuffer::ptr),
            recv.as_ref().map(CudaBuffer::ptr),
        );
        if size == 1 {
            // Only bf16 reaches here: the identity, rounded.
            if let (Some(s), Some(r)) = (s, r) {
                let rounded = self.rounded(shared, (stream, raw), s, count)?;
                copy(raw, r, rounded, count * 4).map_err(failed)?;
            }
            return Ok(());
        }
        let ri = self
            .copy
            .iter()
            .position(|ring| ring.id == id)
            .ok_or_else(|| no_ring(id))?;
        match desc.kind {
            CollectiveKind::Broadcast | CollectiveKind::AllGather => {
                let plan = Plan::relay(desc, size, index).map_err(shape)?;
                let s = match (s, desc.dtype) {
                    (Some(s), DType::Bf16) => {
                        Some(self.rounded(shared, (stream, raw), s, count)?)
                    }
                    (s, _) => s,
                };
                if desc.kind == CollectiveKind::AllGather {
                    // This member's own place, unless it gathers in place.
                    let own = r.map(|r| r + (index as usize * count * 4) as u64);
                    if let (Some(s), Some(own)) = (s, own.filter(|&o| Some(o) != s)) {
                        copy(raw, own, s, count * 4).map_err(failed)?;
                    }
                }
                self.copy[ri].exchange(raw, &plan, s, r)?;
            }
            CollectiveKind::ReduceScatter | CollectiveKind::AllReduce | CollectiveKind::Reduce => {
                // Copied out at once: the combine follows, and on a ring read in place
                // the acknowledgements go on the gather lane.
                let plan = Plan::new(desc, size, index).map_err(shape)?.at_once();
                let (at, k) = desc.member_chunk(size, index);
                let (at, k) = (at as usize, k as usize);
                let receives = crate::exchange_roles(desc, size, index)
                    .map_err(shape)?
                    .recv
                    .is_some();
                let bytes = (k * (size as usize - 1) * 4).max(256);
                let scratch = self.scratch(shared, stream, bytes)?;
                let into = (receives && s.is_some()).then_some(scratch);
                // An exchange acknowledged at once keeps nothing in the ring.
                let _ = self.copy[ri].exchange(raw, &plan, s, into)?;
                if let (true, Some(s), Some(r)) = (receives, s, r) {
                    // The reduced chunk: all of a reduce-scatter's or a reduce's output,
                    // this member's chunk of an all-reduce's.
                    let dst = match desc.kind {
                        CollectiveKind::AllReduce => r + (at * 4) as u64,
                        _ => r,
                    };
                    self.kernels.combine(
                        raw,
                        (None, self.combine_streaming),
                        (dst, s + (at * 4) as u64, scratch),
                        (k as u64, k as u64),
                        size,
                        index,
                        desc.dtype == DType::Bf16,
                        desc.op == ReduceOp::Avg,
                    )?;
                }
                if desc.kind == CollectiveKind::AllReduce {
                    let plan = Plan::gather(desc, size, index).map_err(shape)?;
                    let r = r.filter(|_| s.is_some());
                    self.copy[ri].exchange(raw, &plan, r, r)?;
                }
            }
        }
        Ok(())
    }

    /// `n` floats at `src` rounded to bfloat16 (ties to even) and widened back, in the
    /// stream's scratch: what a bf16 collective carries.
    fn rounded(
        &mut self,
        shared: &Shared,
        (stream, raw): (Stream, sys::CUstream),
        src: u64,
        n: usize,
    ) -> Result<u64, OpsError> {
        let half = (n * 2).next_multiple_of(256);
        let base = self.scratch(shared, stream, (half + n * 4).max(256))?;
        let wide = base + half as u64;
        self.kernels.round_bf16(raw, base, src, n as u64)?;
        self.kernels.widen_bf16(raw, wide, base, n as u64)?;
        Ok(wide)
    }
}

/// The error of a collective on a communicator without NCCL and without a ring.
fn no_ring(id: CommId) -> OpsError {
    OpsError::Collective {
        comm: id.to_string(),
        reason: "a communicator without NCCL has no copy ring (CudaBackend::connect_copy_only sets them up)".into(),
    }
}

/// NCCL's send and receive addresses for a member's buffers: a broadcast root sends in
/// place, a non-root receives in place, and a reduce's non-root passes its send buffer
/// as the (unused) receive address.
fn endpoints(kind: CollectiveKind, send: u64, recv: u64) -> (u64, u64) {
    match kind {
        CollectiveKind::Broadcast if recv == 0 => (send, send),
        CollectiveKind::Broadcast => (recv, recv),
        CollectiveKind::Reduce if recv == 0 => (send, send),
        _ => (send, recv),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_and_reduce_endpoints_are_in_place_where_nccl_needs_them() {
        assert_eq!(endpoints(CollectiveKind::Broadcast, 8, 0), (8, 8));
        assert_eq!(endpoints(CollectiveKind::Broadcast, 0, 16), (16, 16));
        assert_eq!(endpoints(CollectiveKind::Reduce, 8, 0), (8, 8));
        assert_eq!(endpoints(CollectiveKind::Reduce, 8, 16), (8, 16));
        assert_eq!(endpoints(CollectiveKind::AllReduce, 8, 8), (8, 8));
    }
}
