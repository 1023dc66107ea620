//! NCCL communicators: one per (group, stream) the plan uses, each created from its own
//! unique id, and the collectives issued on them.
//!
//! Rank 0 generates one unique id per communicator of the whole mesh
//! ([`super::unique_ids`]) and shares them (the facade's TCP rendezvous); every rank
//! then creates the communicators it is a member of *in the one global order of
//! [`super::mesh_comms`]*, each with `ncclCommInitRank` (blocking until its members
//! join). Every rank walks a subsequence of the same total order, so the smallest
//! communicator not yet created always has all its members waiting for it: creation
//! cannot deadlock, whatever the mesh.
//!
//! A communicator is bound to the stream of its [`CommId`]: the backend refuses a
//! collective issued on another stream. Collectives of all communicators are issued
//! from one host thread at a time in plan order (the backend's issue lock), which is the
//! same order on every rank.
//!
//! Invariant: a communicator is aborted exactly once, when the backend is dropped.

use std::ffi::c_void;

use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;
use overlap_graph::{CollectiveKind, DType, ReduceOp};

use super::device::c_str;
use crate::{CommId, OpsError};

/// An NCCL unique id: 128 opaque bytes that rank 0 generates and every member of one
/// communicator must pass to `ncclCommInitRank`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId(pub [u8; 128]);

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclUniqueId({:02x?}..)", &self.0[..8])
    }
}

impl NcclUniqueId {
    fn to_sys(self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }

    fn from_sys(id: sys::ncclUniqueId) -> NcclUniqueId {
        NcclUniqueId(id.internal.map(|c| c as u8))
    }
}

/// An NCCL error as text: the code's description and NCCL's last message.
pub(super) fn describe(e: &nccl::NcclError, comm: Option<sys::ncclComm_t>) -> String {
    // SAFETY: both return static or thread-local NUL-terminated strings.
    let code = c_str(unsafe { sys::ncclGetErrorString(e.0) });
    let last = c_str(unsafe { sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut())) });
    if last.is_empty() {
        format!("{code} ({:?})", e.0)
    } else {
        format!("{code} ({:?}): {last}", e.0)
    }
}

/// Fresh unique ids (NCCL must be loadable).
pub(super) fn generate(n: usize) -> Result<Vec<NcclUniqueId>, OpsError> {
    (0..n)
        .map(|_| {
            nccl::get_uniqueid()
                .map(NcclUniqueId::from_sys)
                .map_err(|e| OpsError::Backend(format!("ncclGetUniqueId: {}", describe(&e, None))))
        })
        .collect()
}

/// NCCL's version as `major.minor.patch`.
pub(super) fn version() -> String {
    match nccl::get_nccl_version() {
        Ok(v) if v >= 10000 => format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100),
        Ok(v) => format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100),
        Err(_) => "unknown".into(),
    }
}

/// `NCCL_CONFIG_UNDEF_INT`: a config field NCCL should choose itself.
const UNDEF_INT: i32 = i32::MIN;
/// `NCCL_CONFIG_INITIALIZER`'s magic.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// The config version we fill in: NCCL 2.28.0's, the layout of the system NCCL (2.28.3)
/// on the GPU machine. The bindings' struct is NCCL 2.30's, which appends fields; `size`
/// says where the 2.28 layout ends, so no NCCL reads past what it knows.
const CONFIG_VERSION: u32 = 22800;

/// An `ncclConfig_t` as `NCCL_CONFIG_INITIALIZER` makes it, with 1 to `max` CTAs per
/// collective: NCCL's kernels then occupy at most `max` SMs beside the compute stream's.
fn config_with_max_ctas(max: u32) -> sys::ncclConfig_t {
    let max = max.clamp(1, i32::MAX as u32) as i32;
    // The 2.28 layout ends after `nvlinkCentricSched`, padded to the struct's alignment.
    let end = std::mem::offset_of!(sys::ncclConfig_t, graphUsageMode);
    let align = std::mem::align_of::<sys::ncclConfig_t>();
    sys::ncclConfig_t {
        size: end.div_ceil(align) * align,
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: UNDEF_INT,
        cgaClusterSize: UNDEF_INT,
        minCTAs: 1,
        maxCTAs: max,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// One communicator of this rank.
pub(super) struct Comm {
    pub(super) id: CommId,
    /// Null for a communicator without NCCL ([`Comm::copy_only`]).
    raw: sys::ncclComm_t,
    /// Members of the group.
    pub(super) size: u32,
    /// This rank's index in the group.
    pub(super) index: u32,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are
// not concurrent; the backend issues under one lock.
unsafe impl Send for Comm {}

impl Comm {
    /// Creates this rank's member of a communicator (blocks until all members join).
    /// The caller has the device's context bound.
    pub(super) fn init(
        id: CommId,
        uid: NcclUniqueId,
        size: u32,
        index: u32,
        max_ctas: Option<u32>,
    ) -> Result<Comm, OpsError> {
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let result = match max_ctas {
            // SAFETY: `raw` is an out-parameter; size and index were checked by the caller.
            None => unsafe {
                nccl::comm_init_rank(&mut raw, size as i32, uid.to_sys(), index as i32)
            },
            Some(max) => {
                let mut config = config_with_max_ctas(max);
                // SAFETY: as above; `config` is a fully initialised ncclConfig_t (every
                // field NCCL's "undefined" but the CTA limits) that outlives the call.
                unsafe {
                    nccl::comm_init_rank_config(
                        &mut raw,
                        size as i32,
                        uid.to_sys(),
                        index as i32,
                        &mut config,
                    )
                }
            }
        };
        result.map_err(|e| OpsError::Collective {
            comm: id.to_string(),
            reason: format!(
                "ncclCommInitRank (member {index} of {size}) failed: {}",
                describe(&e, None)
            ),
        })?;
        Ok(Comm {
            id,
            raw,
            size,
            index,
        })
    }

    /// This rank's member of a communicator that has no NCCL communicator: ranks that
    /// share a GPU (which NCCL refuses) move all of its collectives over the copy
    /// transport's ring (`collective.rs`). Creates nothing and waits for nobody.
    pub(super) fn copy_only(id: CommId, size: u32, index: u32) -> Comm {
        Comm {
            id,
            raw: std::ptr::null_mut(),
            size,
            index,
        }
    }

    /// Whether the communicator has no NCCL communicator ([`Comm::copy_only`]).
    pub(super) fn is_copy_only(&self) -> bool {
        self.raw.is_null()
    }

    /// The error of an NCCL call on a communicator without NCCL.
    fn no_nccl(&self, what: &str) -> OpsError {
        OpsError::Collective {
            comm: self.id.to_string(),
            reason: format!(
                "{what} on a communicator without NCCL (ranks sharing a GPU move every collective over the copy transport)"
            ),
        }
    }

    fn err(&self, e: nccl::NcclError, what: &str) -> OpsError {
        OpsError::Collective {
            comm: self.id.to_string(),
            reason: format!("{what}: {}", describe(&e, Some(self.raw))),
        }
    }

    /// Issues one collective on `stream` over device buffers of `dtype` elements. For
    /// rooted kinds `root` is the root's index; `count` follows [`crate::Kernel`]'s
    /// convention (the output chunk for reduce-scatter, the input chunk for all-gather).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn issue(
        &self,
        stream: cudarc::driver::sys::CUstream,
        kind: CollectiveKind,
        dtype: DType,
        op: ReduceOp,
        root: u32,
        send: u64,
        recv: u64,
        count: usize,
    ) -> Result<(), OpsError> {
        if self.is_copy_only() {
            return Err(self.no_nccl(kind.name()));
        }
        let dt = match dtype {
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        };
        let red = match op {
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        };
        let s = send as *const c_void;
        let r = recv as *mut c_void;
        let st = stream as sys::cudaStream_t;
        let root = root as i32;
        // SAFETY: the caller passes device buffers of the sizes the kind needs on this
        // member, a live stream of the communicator's device, and issues under the
        // backend's lock (no concurrent call on this communicator).
        let result = unsafe {
            match kind {
                CollectiveKind::ReduceScatter => {
                    nccl::reduce_scatter(s, r, count, dt, red, self.raw, st)
                }
                CollectiveKind::AllReduce => nccl::all_reduce(s, r, count, dt, red, self.raw, st),
                CollectiveKind::Reduce => nccl::reduce(s, r, count, dt, red, root, self.raw, st),
                CollectiveKind::Broadcast => nccl::broadcast(s, r, count, dt, root, self.raw, st),
                CollectiveKind::AllGather => nccl::all_gather(s, r, count, dt, self.raw, st),
            }
        };
        result.map(|_| ()).map_err(|e| self.err(e, kind.name()))
    }

    /// All-gathers `bytes` bytes from every member into `recv` (`size · bytes`, member
    /// order) on `stream`: setup traffic of the copy transport. The caller has the
    /// context bound and passes device buffers of those sizes.
    pub(super) fn all_gather_bytes(
        &self,
        stream: cudarc::driver::sys::CUstream,
        send: u64,
        recv: u64,
        bytes: usize,
    ) -> Result<(), OpsError> {
        if self.is_copy_only() {
            return Err(self.no_nccl("all-gather (copy transport setup)"));
        }
        // SAFETY: as in `issue`: device buffers of the sizes the all-gather needs, a live
        // stream of the communicator's device, no concurrent call on this communicator.
        unsafe {
            nccl::all_gather(
                send as *const c_void,
                recv as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                self.raw,
                stream as sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(|e| self.err(e, "all-gather (copy transport setup)"))
    }

    /// The communicator's asynchronous error, if NCCL reported one.
    pub(super) fn async_error(&self) -> Option<OpsError> {
        if self.is_copy_only() {
            return None;
        }
        let mut code = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and an out-parameter.
        let r = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut code) };
        match (r.result(), code.result()) {
            (Ok(_), Ok(_)) => None,
            (Err(e), _) | (_, Err(e)) => Some(self.err(e, "asynchronous error")),
        }
    }

    /// Frees the communicator with `ncclCommAbort`: local and immediate (unlike
    /// `ncclCommDestroy`, which may wait for peers that already exited), and harmless on
    /// an idle communicator.
    pub(super) fn close(self) {
        if self.is_copy_only() {
            return;
        }
        // SAFETY: the communicator is closed once (this consumes it).
        let _ = unsafe { nccl::comm_abort(self.raw) };
    }
}
