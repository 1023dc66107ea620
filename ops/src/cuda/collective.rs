//! [`Kernel::Collective`] on NCCL: the member's communicator, its role's buffers checked
//! (`checks.rs`), bf16 staging through the stream's scratch, and a group of one as a
//! device copy.
//!
//! Invariant: a member that is poisoned or whose call is invalid still joins the NCCL
//! call, on scratch buffers of the size its role needs, so its peers never hang.

use cudarc::driver::sys;
use overlap_graph::{Collective, CollectiveKind, DType, Stream};

use super::backend::Shared;
use super::checks::check_collective;
use super::device;
use super::issue::Issue;
use super::memory::CudaBuffer;
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
        if valid && size == 1 && desc.dtype == DType::F32 {
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
