//! The copy transport of [`crate::Kernel::Exchange`] on CUDA: CUDA IPC receive rings
//! written by the copy engines, synchronised with stream memory operations. No SM runs
//! a kernel. The protocol itself (the ring layout, who sends what, the order of copies
//! and flag operations, why it cannot deadlock) is `crate::copy_protocol`, pure and
//! model-checked without a GPU; this file allocates the rings, maps them between the
//! members and issues the protocol's operations.
//!
//! # Rings
//!
//! Every communicator of more than one member gets, on each member, one [`CopyRing`]: a
//! plain `cuMemAlloc` allocation (CUDA IPC cannot export pool memory) that every other
//! member of the group maps with `cuIpcOpenMemHandle`, laid out as the protocol's
//! `Layout` says: flags, then for each lane a slot per peer and depth. A ring has one
//! lane, or two when its communicator gathers ([`CopySetup::gather_lane`]). A ring costs
//! `lanes · depth · slot_bytes · (n − 1)` bytes of device memory (plus 4 KiB of flags)
//! on every member: with [`DEFAULT_COPY_SLOT_BYTES`] and [`DEFAULT_COPY_RING_DEPTH`],
//! 64 MiB per peer and lane ([`copy_ring_bytes`]).
//!
//! # Setup ([`connect`])
//!
//! Collective over every communicator in the backend's (global) order, like NCCL's own
//! creation: each member allocates and zeroes its ring (synchronously: the zeroes are
//! in memory before any peer can map it), and all members all-gather a 128-byte record
//! (IPC handle, slot size, depth, lanes, node id) over the communicator's NCCL communicator.
//! Each member checks that the records agree and that the members share a node, opens
//! every peer's handle with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, and a second
//! all-gather tells every member whether all others could: either every member of a
//! group has a working ring or every member reports an error. A member that failed
//! still takes part in every later all-gather, so no peer is left waiting in setup.
//!
//! Ranks that share a GPU have no NCCL (it refuses two ranks on one device):
//! [`connect_shared`] gives every communicator of two or more members a ring, on any
//! stream, and swaps the records and the verdicts through two all-gathers the caller
//! supplies (the job's rendezvous), every rank's in one round.
//!
//! # One exchange ([`CopyRing::exchange`])
//!
//! The protocol's `schedule` gives the member's operations, advancing the ring's
//! counters; each copy goes out as one `cuMemcpyDtoDAsync` (into a peer's ring over
//! NVLink, or out of the member's own) and each run of flag operations between two
//! copies as one `cuStreamBatchMemOp` ([`flags`]: waits are `CU_STREAM_WAIT_VALUE_GEQ`,
//! writes carry the default memory barrier). A piece received in place is left in the
//! ring: the exchange hands where its pieces are to the combine ([`InPlace`]), which
//! acknowledges them afterwards ([`CopyRing::ack`]).
//!
//! Invariant: a ring's operations are issued in the schedule's order on its
//! communicator's stream; a ring whose issue failed half-way is broken (its counters no
//! longer match the peers') and refuses every later exchange.

use std::ffi::c_uint;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::device::{describe, Device};
use super::loader;
use super::memory::Memory;
use super::nccl::Comm;
use crate::copy_protocol::{calls, schedule, Call, Counters, Flag, Layout, Op, Plan};
use crate::{exchange_slot, CommId, OpsError};

/// The default size of one ring slot: the largest piece of one message to one peer.
pub const DEFAULT_COPY_SLOT_BYTES: usize = 32 << 20;

/// The default number of slots per peer in a ring (`[overlap] copy_ring_depth`): while a
/// member copies piece `t` out of its ring (or its combine reads it there), the peer
/// may already write piece `t + 1`.
pub const DEFAULT_COPY_RING_DEPTH: usize = 2;

/// The most slots per peer a ring may have.
pub const MAX_COPY_RING_DEPTH: usize = 16;

/// How the copy transport's rings are set up ([`super::CudaBackend::connect_copy`]): the
/// same on every member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopySetup {
    /// Bytes of one ring slot (`[overlap] copy_slot_mib`), rounded up to 256.
    pub slot_bytes: usize,
    /// Slots per peer and lane (`[overlap] copy_ring_depth`, 1 to
    /// [`MAX_COPY_RING_DEPTH`]).
    pub depth: usize,
    /// The streams exchanges are bound to (`[streams] exchange`): a ring for every
    /// communicator of two or more members on one of them.
    pub streams: Vec<overlap_graph::Stream>,
    /// The communicators whose exchanges leave what they receive in the ring for their
    /// combines to read there, and acknowledge.
    pub in_place: Vec<CommId>,
    /// The communicators whose rings get a second lane, with its own slots, flags and
    /// counters, for gathers: their immediate acknowledgements then never share a
    /// counter with an in-place exchange's deferred ones.
    pub gather_lane: Vec<CommId>,
}

/// The device memory one ring takes on every member of a group of `size` members with
/// `depth` slots of `slot_bytes` (rounded up to 256 bytes) per peer and lane: `lanes ·
/// depth · slot · (size − 1)` plus one page of flags; 0 for a group of one (which has
/// no ring). `None` if it does not fit in memory, or `slot_bytes`, `depth` or `lanes`
/// is 0.
pub fn copy_ring_bytes(size: u32, slot_bytes: usize, depth: usize, lanes: usize) -> Option<usize> {
    if size <= 1 {
        return Some(0);
    }
    Layout::new(size, slot_bytes, depth, lanes)
        .ok()
        .map(|l| l.bytes)
}

/// One member's ring of one communicator.
pub(super) struct CopyRing {
    /// The communicator.
    pub(super) id: CommId,
    size: u32,
    index: u32,
    layout: Layout,
    /// This member's ring.
    local: sys::CUdeviceptr,
    /// The peers' rings as mapped here, by peer slot; 0 where not (yet) opened.
    remote: Vec<sys::CUdeviceptr>,
    /// Per lane: lane 0 carries exchanges (and gathers when there is no second lane),
    /// lane 1 gathers.
    counters: Vec<Counters>,
    /// Set when issuing failed half-way: the counters no longer match the peers'.
    broken: Option<String>,
    /// Exchanges leave what they receive in the ring for the combine to read in place
    /// ([`InPlace`], [`CopySetup::in_place`]).
    in_place: bool,
    /// Exchanges issued on lane 0 so far ([`InPlace::seq`]).
    exchanges: u64,
}

/// What an exchange received in place: member `j`'s data starts at `base + slot(j) ·
/// stride` bytes (its slots in this member's ring), and once the combine has read it,
/// `acks` (peer, piece) go to the peers ([`CopyRing::ack`]), in issue order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct InPlace {
    pub(super) base: sys::CUdeviceptr,
    pub(super) stride: usize,
    pub(super) acks: Vec<(u32, u32)>,
    /// The exchange's place among this ring's exchanges (acknowledgements must go out
    /// in this order).
    pub(super) seq: u64,
}

// SAFETY: device addresses only, used with the context bound under the backend's issue
// lock.
unsafe impl Send for CopyRing {}

impl CopyRing {
    /// Whether exchanges leave what they receive in the ring ([`CopySetup::in_place`]).
    pub(super) fn in_place(&self) -> bool {
        self.in_place
    }

    fn err(&self, reason: String) -> OpsError {
        OpsError::Collective {
            comm: self.id.to_string(),
            reason,
        }
    }

    /// Enqueues one exchange on `stream` (the communicator's stream). `send` and `recv`
    /// are the member's buffers, or `None` for a member that cannot take part (poisoned
    /// or invalid): it still writes and waits for every flag, so its peers finish (with
    /// undefined data from it), but copies nothing.
    pub(super) fn exchange(
        &mut self,
        stream: sys::CUstream,
        plan: &Plan,
        send: Option<sys::CUdeviceptr>,
        recv: Option<sys::CUdeviceptr>,
    ) -> Result<Option<InPlace>, OpsError> {
        if let Some(cause) = &self.broken {
            return Err(self.err(format!(
                "the copy ring is unusable after an earlier failure ({cause})"
            )));
        }
        if (plan.size, plan.index) != (self.size, self.index) {
            return Err(self.err(format!(
                "an exchange for member {} of {} on the ring of member {} of {}",
                plan.index, plan.size, self.index, self.size
            )));
        }
        // In place only for a reduction's exchange whose every message is one piece,
        // all received in the same ring slot index (true on shard groups, whose
        // exchanges all move between the same pairs). Every member checks the largest
        // message of any pair, so all of them refuse the same exchange, before issuing
        // anything: no member waits for a piece another will not send.
        // A gather (or a relay) has its own lane where the ring has one.
        let lane = usize::from(plan.acks_at_once() && self.layout.lanes > 1);
        if self.in_place && plan.acks_at_once() && lane == 0 {
            return Err(self.err(
                "a gather or relay on a ring whose receives are read in place and that has no gather lane: its immediate acknowledgements could overtake the combines' (CopySetup::gather_lane names the communicators that gather)".into(),
            ));
        }
        let in_place = self.in_place && lane == 0;
        if in_place {
            let largest = (0..plan.size)
                .flat_map(|i| (0..plan.size).map(move |j| (i, j)))
                .filter(|&(i, j)| plan.moves(i, j))
                .map(|(i, j)| plan.bytes(i, j))
                .max()
                .unwrap_or(0);
            if largest > self.layout.slot_bytes {
                return Err(self.err(format!(
                    "a combine reads this ring in place, but a message of {largest} bytes per peer does not fit one slot of {} bytes (raise [overlap] copy_slot_mib)",
                    self.layout.slot_bytes
                )));
            }
        }
        let layout = self.layout.lane(lane);
        let before = self.counters[lane].clone();
        let ops = schedule(plan, &layout, &mut self.counters[lane], in_place);
        let kept = if in_place {
            match self.kept(plan, &ops) {
                Ok(kept) => kept,
                Err(reason) => {
                    self.counters[lane] = before;
                    return Err(self.err(reason));
                }
            }
        } else {
            None
        };
        if let Err(reason) = self.issue_all(stream, &layout, &ops, send, recv) {
            self.broken = Some(reason.clone());
            return Err(self.err(reason));
        }
        if lane == 0 {
            self.exchanges += 1;
        }
        // Also for a member that cannot take part (it copied nothing): its combine, run
        // or skipped, acknowledges in combine order, so an acknowledgement never
        // overtakes an earlier exchange's deferred one.
        Ok(kept)
    }

    /// Where the pieces an in-place exchange kept are, or why they cannot be read in
    /// place (then nothing was issued).
    fn kept(&self, plan: &Plan, ops: &[Op]) -> Result<Option<InPlace>, String> {
        let keeps: Vec<(u32, usize, u32)> = ops
            .iter()
            .filter_map(|op| match *op {
                Op::Keep { peer, ring, value } => Some((peer, ring, value)),
                _ => None,
            })
            .collect();
        let Some(&(_, ring, _)) = keeps.first() else {
            return Ok(None);
        };
        let senders = (0..plan.size)
            .filter(|&j| plan.moves(j, plan.index) && plan.bytes(j, plan.index) > 0)
            .count();
        if keeps.len() != senders || keeps.iter().any(|k| k.1 != ring) {
            return Err(format!(
                "the pieces this exchange keeps in place are not one per peer in one slot index ({keeps:?}); only shard groups' exchanges, all between the same pairs, are read in place"
            ));
        }
        Ok(Some(InPlace {
            base: self.local + self.layout.data(0, ring) as u64,
            stride: self.layout.depth * self.layout.slot_bytes,
            acks: keeps.iter().map(|&(j, _, t)| (j, t)).collect(),
            seq: self.exchanges,
        }))
    }

    /// Acknowledges pieces read in place, on `stream` (after the combine that read them).
    pub(super) fn ack(
        &mut self,
        stream: sys::CUstream,
        acks: &[(u32, u32)],
    ) -> Result<(), OpsError> {
        let writes: Vec<Flag> = acks
            .iter()
            .map(|&(j, value)| {
                let at = self.remote[exchange_slot(self.index, j)]
                    + self.layout.ack(exchange_slot(j, self.index)) as u64;
                Flag::Write(at, value)
            })
            .collect();
        flags(stream, &writes).map_err(|reason| {
            self.broken = Some(reason.clone());
            self.err(reason)
        })
    }

    /// Enqueues the operations of lane `l` in order, each run of flag operations
    /// between two copies in one driver call ([`calls`], [`flags`]).
    fn issue_all(
        &self,
        stream: sys::CUstream,
        l: &Layout,
        ops: &[Op],
        send: Option<sys::CUdeviceptr>,
        recv: Option<sys::CUdeviceptr>,
    ) -> Result<(), String> {
        for call in calls(ops, |op| self.flag(l, op)) {
            match call {
                Call::Flags(run) => flags(stream, &run)?,
                Call::Copy(op) => self.issue(stream, l, op, send, recv)?,
            }
        }
        Ok(())
    }

    /// The flag operation `op` of lane `l` is, or `None` for a copy or a kept piece.
    fn flag(&self, l: &Layout, op: Op) -> Option<Flag> {
        let me = self.index;
        let at = |base: sys::CUdeviceptr, offset: usize| base + offset as u64;
        let peer = |j: u32| self.remote[exchange_slot(me, j)];
        match op {
            Op::WaitAck { peer: j, value } => Some(Flag::Wait(
                at(self.local, l.ack(exchange_slot(me, j))),
                value,
            )),
            Op::Ready { peer: j, value } => Some(Flag::Write(
                at(peer(j), l.ready(exchange_slot(j, me))),
                value,
            )),
            Op::WaitReady { peer: j, value } => Some(Flag::Wait(
                at(self.local, l.ready(exchange_slot(me, j))),
                value,
            )),
            Op::Ack { peer: j, value } => {
                Some(Flag::Write(at(peer(j), l.ack(exchange_slot(j, me))), value))
            }
            Op::Send { .. } | Op::Take { .. } | Op::Keep { .. } => None,
        }
    }

    /// Enqueues one copy of lane `l` (flag operations go through [`CopyRing::flag`]).
    fn issue(
        &self,
        stream: sys::CUstream,
        l: &Layout,
        op: Op,
        send: Option<sys::CUdeviceptr>,
        recv: Option<sys::CUdeviceptr>,
    ) -> Result<(), String> {
        let me = self.index;
        let at = |base: sys::CUdeviceptr, offset: usize| base + offset as u64;
        let peer = |j: u32| self.remote[exchange_slot(me, j)];
        match op {
            Op::Send {
                peer: j,
                ring,
                src,
                bytes,
            } => match send {
                Some(s) => copy(
                    stream,
                    at(peer(j), l.data(exchange_slot(j, me), ring)),
                    at(s, src),
                    bytes,
                ),
                None => Ok(()),
            },
            Op::Take {
                peer: j,
                ring,
                dst,
                bytes,
            } => match recv {
                Some(r) => copy(
                    stream,
                    at(r, dst),
                    at(self.local, l.data(exchange_slot(me, j), ring)),
                    bytes,
                ),
                None => Ok(()),
            },
            op => match self.flag(l, op) {
                Some(f) => flags(stream, &[f]),
                None => Ok(()),
            },
        }
    }

    /// Enqueues on `stream` (the communicator's) a wait for every peer's acknowledgement
    /// of the last piece this member sent it: the peers' final writes into this
    /// member's ring (their acks) land before the ring may be freed. Call before
    /// draining the device at shutdown; a peer that never acknowledges keeps the
    /// device from draining, and the ring is then leaked rather than freed.
    pub(super) fn await_acks(&self, stream: sys::CUstream) -> Result<(), String> {
        if self.broken.is_some() {
            return Ok(());
        }
        for (lane, counters) in self.counters.iter().enumerate() {
            let layout = self.layout.lane(lane);
            for (slot, &sent) in counters.sent.iter().enumerate() {
                if sent > 0 {
                    wait(stream, self.local + layout.ack(slot) as u64, sent as u32)?;
                }
            }
        }
        Ok(())
    }

    /// Ends every wait issued on this member's flags so far, for good: writes each
    /// flag of its ring, on `stream` (one that no copy-transport work is queued on), to
    /// the last value any of its waits names. After an abort (a peer died and will
    /// never write them, or this rank timed out): the streams blocked on them drain, on
    /// whatever data the ring holds, and the ring refuses every later exchange. What
    /// they then send a live peer is undefined; that peer's step is failing too (the
    /// job's watch tells it this rank stopped), and no checkpoint commits a step
    /// without this rank's report.
    pub(super) fn release(&mut self, stream: sys::CUstream) -> Result<(), String> {
        let mut writes = Vec::new();
        for (lane, c) in self.counters.iter().enumerate() {
            let l = self.layout.lane(lane);
            for (k, (&received, &sent)) in c.received.iter().zip(&c.sent).enumerate() {
                writes.push(Flag::Write(self.local + l.ready(k) as u64, received as u32));
                writes.push(Flag::Write(self.local + l.ack(k) as u64, sent as u32));
            }
        }
        self.broken
            .get_or_insert_with(|| "its waits were released after an abort".into());
        flags(stream, &writes)
    }

    /// The communicator the ring belongs to.
    pub(super) fn comm(&self) -> CommId {
        self.id
    }

    /// Unmaps the peers' rings and frees this member's. The caller has the context
    /// bound and the device idle (no copy or flag operation of this ring in flight).
    pub(super) fn close(self) {
        for &p in self.remote.iter().filter(|&&p| p != 0) {
            // SAFETY: `p` was returned by cuIpcOpenMemHandle and is closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
        }
        // SAFETY: `local` was allocated by `connect` and is freed once, unused.
        let _ = unsafe { cu::free_sync(self.local) };
    }
}

/// Enqueues `flags` on `stream` in order, in one driver call (`cuStreamBatchMemOp`: the
/// operations run in array order, exactly as the same calls one by one would); one
/// operation goes through its own call.
pub(super) fn flags(stream: sys::CUstream, flags: &[Flag]) -> Result<(), String> {
    match flags {
        [] => return Ok(()),
        [Flag::Wait(addr, value)] => return wait(stream, *addr, *value),
        [Flag::Write(addr, value)] => return write(stream, *addr, *value),
        _ => {}
    }
    use sys::CUstreamBatchMemOpType::{
        CU_STREAM_MEM_OP_WAIT_VALUE_32 as WAIT, CU_STREAM_MEM_OP_WRITE_VALUE_32 as WRITE,
    };
    let mut params: Vec<sys::CUstreamBatchMemOpParams> = flags
        .iter()
        .map(|f| {
            // SAFETY: the parameter union is plain old data; all zeros is a valid value
            // (every unused field, `alias` included, must be zero).
            let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
            match *f {
                Flag::Wait(address, value) => {
                    // SAFETY: writes into the zeroed union's wait variant.
                    let w = unsafe { &mut p.waitValue };
                    w.operation = WAIT;
                    w.address = address;
                    w.__bindgen_anon_1.value = value;
                    w.flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as c_uint;
                }
                Flag::Write(address, value) => {
                    // SAFETY: writes into the zeroed union's write variant.
                    let w = unsafe { &mut p.writeValue };
                    w.operation = WRITE;
                    w.address = address;
                    w.__bindgen_anon_1.value = value;
                    w.flags =
                        sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as c_uint;
                }
            }
            p
        })
        .collect();
    // The driver takes fewer than 256 operations per call.
    for batch in params.chunks_mut(MAX_BATCH) {
        // SAFETY: `batch` holds initialised operations on 4-byte aligned flags of live
        // rings (this member's, or peers' mapped by cuIpcOpenMemHandle); the driver
        // copies them before returning; `stream` is a live stream of the bound context.
        unsafe { sys::cuStreamBatchMemOp_v2(stream, batch.len() as c_uint, batch.as_mut_ptr(), 0) }
            .result()
            .map_err(|e| format!("cuStreamBatchMemOp: {}", describe(e)))?;
    }
    Ok(())
}

/// Most operations per `cuStreamBatchMemOp` call (the driver requires fewer than 256).
const MAX_BATCH: usize = 255;

/// Waits on `stream` until the flag at `addr` is at least `value` (cyclic).
fn wait(stream: sys::CUstream, addr: sys::CUdeviceptr, value: u32) -> Result<(), String> {
    let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as c_uint;
    // SAFETY: `addr` is a 4-byte aligned flag of this member's live ring; `stream` is a
    // live stream of the bound context.
    unsafe { sys::cuStreamWaitValue32_v2(stream, addr, value, flags) }
        .result()
        .map_err(|e| format!("cuStreamWaitValue32: {}", describe(e)))
}

/// Writes `value` to the flag at `addr` on `stream`, after a memory barrier that makes
/// every earlier write of the stream visible first (the default flags).
fn write(stream: sys::CUstream, addr: sys::CUdeviceptr, value: u32) -> Result<(), String> {
    let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as c_uint;
    // SAFETY: `addr` is a 4-byte aligned flag of a live ring (this member's, or a peer's
    // mapped by cuIpcOpenMemHandle); `stream` is a live stream of the bound context.
    unsafe { sys::cuStreamWriteValue32_v2(stream, addr, value, flags) }
        .result()
        .map_err(|e| format!("cuStreamWriteValue32: {}", describe(e)))
}

/// Copies `bytes` from `src` to `dst` on `stream` (a copy-engine copy).
pub(super) fn copy(
    stream: sys::CUstream,
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
) -> Result<(), String> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller checked the buffers' lengths against the plan, and ring
    // offsets stay inside the ring (`Layout`); both are live device memory of this
    // member or mapped peer memory; `stream` is live.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) }
        .result()
        .map_err(|e| format!("cuMemcpyDtoDAsync: {}", describe(e)))
}

/// The 128-byte record each member contributes to the setup all-gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    /// Whether the member has a ring to share (`handle` is valid).
    ok: bool,
    /// The member's global rank, for messages.
    rank: u32,
    slot_bytes: u64,
    depth: u32,
    lanes: u32,
    /// The node's boot id (all zeros when unknown).
    node: [u8; 16],
    /// The ring's CUDA IPC handle.
    handle: [u8; 64],
}

const RECORD_BYTES: usize = 128;
const RECORD_MAGIC: u32 = 0x5243_564f; // "OVCR" in little endian

impl Record {
    fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&u32::from(self.ok).to_le_bytes());
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b[12..16].copy_from_slice(&self.depth.to_le_bytes());
        b[16..24].copy_from_slice(&self.slot_bytes.to_le_bytes());
        b[24..40].copy_from_slice(&self.node);
        b[40..44].copy_from_slice(&self.lanes.to_le_bytes());
        b[64..128].copy_from_slice(&self.handle);
        b
    }

    fn decode(b: &[u8]) -> Option<Record> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        if b.len() != RECORD_BYTES || u32_at(0) != RECORD_MAGIC {
            return None;
        }
        Some(Record {
            ok: u32_at(4) == 1,
            rank: u32_at(8),
            depth: u32_at(12),
            slot_bytes: u64::from_le_bytes(b[16..24].try_into().ok()?),
            node: b[24..40].try_into().ok()?,
            lanes: u32_at(40),
            handle: b[64..128].try_into().ok()?,
        })
    }
}

/// This machine's boot id (`/proc/sys/kernel/random/boot_id`) as 16 bytes, or zeros when
/// it cannot be read: processes with the same id run on the same node.
fn node_id() -> [u8; 16] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    parse_node_id(&text)
}

fn parse_node_id(text: &str) -> [u8; 16] {
    let hex: Vec<u8> = text
        .bytes()
        .filter_map(|c| (c as char).to_digit(16).map(|d| d as u8))
        .collect();
    let mut id = [0u8; 16];
    if hex.len() == 32 {
        for (i, pair) in hex.chunks(2).enumerate() {
            id[i] = pair[0] << 4 | pair[1];
        }
    }
    id
}

/// Whether the driver has what the copy transport uses: CUDA IPC and the (v2) stream
/// memory operations, which CUDA 11.7 and later provide on every platform without the
/// `NVreg_EnableStreamMemOPs` module parameter (the legacy v1 operations, which
/// `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1` reports on, are not used).
fn check_support() -> Result<(), String> {
    loader::COPY.check().map_err(|e| e.to_string())?;
    let mut version = 0;
    // SAFETY: a plain out-parameter.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| format!("cuDriverGetVersion: {}", describe(e)))?;
    if version < 11070 {
        return Err(format!(
            "the copy transport needs the stream memory operations of CUDA 11.7 or newer; the driver supports CUDA {}.{}",
            version / 1000,
            (version % 1000) / 10
        ));
    }
    Ok(())
}

/// All-gathers `mine` (the same length on every member) over `comm`, in member order.
/// Synchronous. The caller has the context bound.
fn gather(
    comm: &Comm,
    device: &Device,
    memory: &Arc<Memory>,
    mine: &[u8],
) -> Result<Vec<u8>, OpsError> {
    let n = comm.size as usize;
    let b = mine.len();
    let mem = memory.alloc_raw(b * (n + 1))?;
    let (send, recv) = (mem.ptr(), mem.ptr() + b as u64);
    let host = device.host_stream();
    let fail = |what: &str, e| OpsError::Collective {
        comm: comm.id.to_string(),
        reason: format!("setting up the copy transport: {what}: {}", describe(e)),
    };
    // SAFETY: `mem` holds `(n + 1)·b` bytes and nothing else uses it; `mine` outlives
    // the synchronised copy.
    unsafe { sys::cuMemcpyHtoDAsync_v2(send, mine.as_ptr().cast(), b, host) }
        .result()
        .map_err(|e| fail("cuMemcpyHtoDAsync", e))?;
    device.sync_host_stream("setting up the copy transport")?;
    let stream = device.stream(comm.id.stream);
    comm.all_gather_bytes(stream, send, recv, b)?;
    // SAFETY: a live stream of the bound context.
    unsafe { cu::stream::synchronize(stream) }.map_err(|e| fail("cuStreamSynchronize", e))?;
    let mut out = vec![0u8; n * b];
    // SAFETY: `out` holds `n·b` bytes and outlives the synchronised copy.
    unsafe { sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), recv, n * b, host) }
        .result()
        .map_err(|e| fail("cuMemcpyDtoHAsync", e))?;
    device.sync_host_stream("setting up the copy transport")?;
    Ok(out)
}

/// Allocates, zeroes and exports this member's ring.
fn allocate(device: &Device, layout: &Layout) -> Result<(sys::CUdeviceptr, [u8; 64]), String> {
    // SAFETY: a plain allocation of the bound context (not pooled: IPC exports whole
    // cuMemAlloc allocations).
    let local = unsafe { cu::malloc_sync(layout.bytes) }.map_err(|e| {
        format!(
            "cannot allocate its copy ring of {} bytes on GPU {}: {}",
            layout.bytes,
            device.ordinal,
            describe(e)
        )
    })?;
    let free = |reason: String| {
        // SAFETY: allocated above, unused and not exported to anyone yet.
        let _ = unsafe { cu::free_sync(local) };
        reason
    };
    // Zero the flags (and the data) and wait for it: no peer can map the ring before
    // the all-gather that follows, so no flag write can precede the zeroes.
    let host = device.host_stream();
    // SAFETY: the ring holds `bytes` (a multiple of 4) bytes and nothing uses it.
    if let Err(e) = unsafe { sys::cuMemsetD32Async(local, 0, layout.bytes / 4, host) }.result() {
        return Err(free(format!("zeroing its copy ring: {}", describe(e))));
    }
    if let Err(e) = device.sync_host_stream("zeroing the copy ring") {
        return Err(free(e.to_string()));
    }
    let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: `handle` is an out-parameter; `local` is a live cuMemAlloc allocation.
    if let Err(e) = unsafe { sys::cuIpcGetMemHandle(&mut handle, local) }.result() {
        return Err(free(format!("cuIpcGetMemHandle: {}", describe(e))));
    }
    Ok((local, handle.reserved.map(|c| c as u8)))
}

/// Creates this member's ring of every communicator of more than one member, in the
/// order of `comms` (the same global order on every rank: a collective call, see the
/// module documentation). On error every ring made so far is closed and the first
/// error is returned; every member of a group whose setup failed reports an error.
pub(super) fn connect(
    comms: &[Comm],
    device: &Device,
    memory: &Arc<Memory>,
    rank: u32,
    setup: &CopySetup,
) -> Result<Vec<CopyRing>, OpsError> {
    // A local problem does not skip the all-gathers: the peers must not hang in them.
    let support = check_support();
    let node = node_id();
    let mut rings = Vec::new();
    let mut first: Option<OpsError> = None;
    for comm in comms
        .iter()
        .filter(|c| c.size > 1 && setup.streams.contains(&c.id.stream))
    {
        match connect_one(comm, device, memory, rank, setup, &support, node) {
            Ok(ring) => rings.push(ring),
            Err(e) => {
                let fatal = matches!(&e, Failure::Fatal(_));
                let e = e.into_error();
                first.get_or_insert(e);
                if fatal {
                    break;
                }
            }
        }
    }
    match first {
        None => Ok(rings),
        Some(e) => {
            rings.into_iter().for_each(CopyRing::close);
            Err(e)
        }
    }
}

/// [`connect`] for ranks without NCCL (several ranks on one GPU): a ring for every
/// communicator of `comms` with more than one member, whatever its stream, set up in
/// two rounds of `all_gather` (every rank's bytes, in rank order; every rank calls it
/// exactly twice, whether or not it has a ring): the records of every ring, then every
/// rank's verdict. Either every rank has all its rings or every rank returns an error
/// (the first failed rank's).
pub(super) fn connect_shared(
    comms: &[Comm],
    device: &Device,
    rank: u32,
    setup: &CopySetup,
    all_gather: &mut AllGather<'_>,
) -> Result<Vec<CopyRing>, OpsError> {
    let support = check_support();
    let node = node_id();
    let setup_error = |reason: String| OpsError::Collective {
        comm: "copy transport".into(),
        reason,
    };
    let mut rings = Vec::new();
    let mut problem: Option<String> = None;
    let mut mine = Vec::new();
    for comm in comms.iter().filter(|c| c.size > 1) {
        let (ring, record, p) = prepare_ring(comm, device, rank, setup, &support, node);
        rings.extend(ring);
        if problem.is_none() {
            problem = p;
        }
        shared_entry(&mut mine, comm, &record);
    }
    let close = |rings: Vec<CopyRing>| rings.into_iter().for_each(CopyRing::close);
    let all = match all_gather(&mine) {
        Ok(all) => all,
        Err(e) => {
            close(rings);
            return Err(setup_error(format!("exchanging the rings' records: {e}")));
        }
    };
    if problem.is_none() {
        for ring in &mut rings {
            let comm = comms.iter().find(|c| c.id == ring.id);
            let Some(comm) = comm else { continue };
            let records = shared_records(&all, comm);
            let me = records.get(comm.index as usize).copied().flatten();
            problem = match me {
                Some(me) => agree(&records, comm, &me)
                    .or_else(|| open_peers(ring, &records, comm, device, rank)),
                None => Some(format!(
                    "rank {rank} finds no record of its own ring of {}",
                    comm.id
                )),
            };
            if problem.is_some() {
                break;
            }
        }
    }
    let verdict = match &problem {
        None => vec![1u8],
        Some(p) => [vec![0u8], p.clone().into_bytes()].concat(),
    };
    let verdicts = match all_gather(&verdict) {
        Ok(v) => v,
        Err(e) => {
            close(rings);
            return Err(setup_error(format!("exchanging the setup verdicts: {e}")));
        }
    };
    let failed = verdicts
        .iter()
        .enumerate()
        .find(|(_, v)| v.first() != Some(&1));
    match (problem, failed) {
        (None, None) => Ok(rings),
        (Some(p), _) => {
            close(rings);
            Err(setup_error(p))
        }
        (None, Some((r, v))) => {
            close(rings);
            Err(setup_error(format!(
                "rank {r} could not set up the copy transport: {}",
                String::from_utf8_lossy(v.get(1..).unwrap_or_default())
            )))
        }
    }
}

/// An all-gather of every rank's bytes, in rank order, supplied by the caller of
/// [`connect_shared`] (the job's rendezvous).
pub(super) type AllGather<'a> = dyn FnMut(&[u8]) -> Result<Vec<Vec<u8>>, String> + 'a;

/// Appends one ring's entry to a rank's setup bytes: the communicator's name (length
/// first), the member index, the record.
fn shared_entry(out: &mut Vec<u8>, comm: &Comm, record: &Record) {
    let name = comm.id.to_string().into_bytes();
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(&name);
    out.extend_from_slice(&comm.index.to_le_bytes());
    out.extend_from_slice(&record.encode());
}

/// The records of `comm`'s members, by member index, from every rank's setup bytes
/// (`None` where a member sent none or a malformed one).
fn shared_records(all: &[Vec<u8>], comm: &Comm) -> Vec<Option<Record>> {
    let name = comm.id.to_string().into_bytes();
    let mut out = vec![None; comm.size as usize];
    for bytes in all {
        let mut at = 0;
        while let Some(len) = bytes.get(at..at + 4) {
            let len = u32::from_le_bytes(len.try_into().unwrap_or_default()) as usize;
            let end = at + 4 + len + 4 + RECORD_BYTES;
            let Some(entry) = bytes.get(at + 4..end) else {
                break;
            };
            let index = u32::from_le_bytes(entry[len..len + 4].try_into().unwrap_or_default());
            if entry[..len] == name[..] {
                if let Some(slot) = out.get_mut(index as usize) {
                    *slot = Record::decode(&entry[len + 4..]);
                }
            }
            at = end;
        }
    }
    out
}

/// Why one ring could not be set up.
enum Failure {
    /// The group agreed that setup failed: the next communicator can still be set up.
    Agreed(OpsError),
    /// An all-gather failed: the members may disagree; stop.
    Fatal(OpsError),
}

impl Failure {
    fn into_error(self) -> OpsError {
        match self {
            Failure::Agreed(e) | Failure::Fatal(e) => e,
        }
    }
}

/// Sets up this rank's ring of `comm` with the other members: allocates it, shares the
/// setup records, maps the peers' rings and agrees on the outcome.
fn connect_one(
    comm: &Comm,
    device: &Device,
    memory: &Arc<Memory>,
    rank: u32,
    setup: &CopySetup,
    support: &Result<(), String>,
    node: [u8; 16],
) -> Result<CopyRing, Failure> {
    let id = comm.id;
    let error = |reason: String| OpsError::Collective {
        comm: id.to_string(),
        reason,
    };
    let (mut ring, mine, mut problem) = prepare_ring(comm, device, rank, setup, support, node);
    let close = |ring: Option<CopyRing>| ring.into_iter().for_each(CopyRing::close);
    let records = match gather(comm, device, memory, &mine.encode()) {
        Ok(r) => r,
        Err(e) => {
            close(ring);
            return Err(Failure::Fatal(e));
        }
    };
    let records: Vec<Option<Record>> = records.chunks(RECORD_BYTES).map(Record::decode).collect();
    // What every member can tell from the records alone (the same verdict everywhere).
    if problem.is_none() {
        problem = agree(&records, comm, &mine);
    }
    if let (None, Some(r)) = (&problem, ring.as_mut()) {
        problem = open_peers(r, &records, comm, device, rank);
    }
    // Tell each other whether every member could open every ring.
    let status = [u8::from(problem.is_none()), 0, 0, 0];
    let statuses = match gather(comm, device, memory, &status) {
        Ok(s) => s,
        Err(e) => {
            close(ring);
            return Err(Failure::Fatal(e));
        }
    };
    if problem.is_none() {
        if let Some(j) = statuses.chunks(4).position(|s| s[0] != 1) {
            let other = records[j].map_or_else(|| "?".into(), |r| r.rank.to_string());
            problem = Some(format!(
                "member {j} (rank {other}) could not set up the copy transport (see that rank's error)"
            ));
        }
    }
    match (problem, ring) {
        (None, Some(ring)) => Ok(ring),
        (problem, ring) => {
            close(ring);
            Err(Failure::Agreed(error(
                problem.unwrap_or_else(|| "no ring was allocated".into()),
            )))
        }
    }
}

/// Allocates this rank's ring of `comm` where the transport is supported and the
/// layout valid: the ring, this rank's setup record, and why there is no ring.
fn prepare_ring(
    comm: &Comm,
    device: &Device,
    rank: u32,
    setup: &CopySetup,
    support: &Result<(), String>,
    node: [u8; 16],
) -> (Option<CopyRing>, Record, Option<String>) {
    let id = comm.id;
    let lanes = if setup.gather_lane.contains(&id) {
        2
    } else {
        1
    };
    let (slot_bytes, depth) = (setup.slot_bytes, setup.depth);
    let layout = if depth > MAX_COPY_RING_DEPTH {
        Err(format!(
            "a copy ring of depth {depth}: at most {MAX_COPY_RING_DEPTH} slots per peer"
        ))
    } else {
        Layout::new(comm.size, slot_bytes, depth, lanes)
    };
    let prepared = support
        .clone()
        .and_then(|()| layout.clone())
        .and_then(|l| allocate(device, &l).map(|(local, handle)| (l, local, handle)));
    let mut ring = None;
    let mut mine = Record {
        ok: false,
        rank,
        slot_bytes: slot_bytes as u64,
        depth: depth as u32,
        lanes: lanes as u32,
        node,
        handle: [0; 64],
    };
    let mut problem = None;
    match prepared {
        Ok((layout, local, handle)) => {
            mine.ok = true;
            mine.handle = handle;
            ring = Some(CopyRing {
                id,
                size: comm.size,
                index: comm.index,
                layout,
                local,
                remote: vec![0; comm.size as usize - 1],
                counters: vec![Counters::new(comm.size as usize - 1); lanes],
                broken: None,
                in_place: setup.in_place.contains(&id),
                exchanges: 0,
            });
        }
        Err(reason) => problem = Some(format!("rank {rank} could not set up its ring: {reason}")),
    }
    (ring, mine, problem)
}

/// Maps the peers' rings of `comm` into `ring` through their IPC handles in `records`;
/// on the first that cannot be mapped, says why.
fn open_peers(
    ring: &mut CopyRing,
    records: &[Option<Record>],
    comm: &Comm,
    device: &Device,
    rank: u32,
) -> Option<String> {
    for (j, rec) in records.iter().enumerate() {
        let j = j as u32;
        let Some(rec) = rec.filter(|_| j != comm.index) else {
            continue;
        };
        let handle = sys::CUipcMemHandle_st {
            reserved: rec.handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
        // SAFETY: `ptr` is an out-parameter; the handle came from a live peer that
        // keeps its ring until it closes the backend.
        match unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) }.result() {
            Ok(()) => ring.remote[exchange_slot(comm.index, j)] = ptr,
            Err(e) => {
                return Some(format!(
                    "the copy transport needs every member of {} on one node with peer access between their GPUs: \
                     rank {rank} (GPU {}) cannot map the ring of member {j} (rank {}): {}",
                    comm.id.group,
                    device.ordinal,
                    rec.rank,
                    describe(e)
                ));
            }
        }
    }
    None
}

/// The first disagreement among the setup records, or `None`.
fn agree(records: &[Option<Record>], comm: &Comm, mine: &Record) -> Option<String> {
    if records.len() != comm.size as usize {
        return Some(format!(
            "the setup all-gather returned {} records for {} members",
            records.len(),
            comm.size
        ));
    }
    for (j, rec) in records.iter().enumerate() {
        let Some(rec) = rec else {
            return Some(format!("member {j} sent a malformed setup record"));
        };
        if !rec.ok {
            return Some(format!(
                "member {j} (rank {}) could not set up its copy ring (see that rank's error)",
                rec.rank
            ));
        }
        if (rec.slot_bytes, rec.depth, rec.lanes) != (mine.slot_bytes, mine.depth, mine.lanes) {
            return Some(format!(
                "members disagree on the copy ring: rank {} has {} lane(s) of {} × {} bytes, rank {} has {} lane(s) of {} × {} bytes",
                mine.rank, mine.lanes, mine.depth, mine.slot_bytes, rec.rank, rec.lanes, rec.depth, rec.slot_bytes
            ));
        }
        if rec.node != mine.node && rec.node != [0; 16] && mine.node != [0; 16] {
            return Some(format!(
                "the copy transport needs every member of {} on one node (CUDA IPC over NVLink), \
                 but rank {} and rank {} run on different nodes",
                comm.id.group, mine.rank, rec.rank
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::coll as desc;
    use overlap_graph::CollectiveKind;

    #[test]
    fn a_ring_takes_its_slots_per_peer_and_lane_plus_a_page_of_flags() {
        const PAGE: usize = 4096;
        let d = DEFAULT_COPY_RING_DEPTH;
        assert_eq!(
            copy_ring_bytes(2, DEFAULT_COPY_SLOT_BYTES, d, 1),
            Some(PAGE + 2 * DEFAULT_COPY_SLOT_BYTES)
        );
        assert_eq!(
            copy_ring_bytes(2, DEFAULT_COPY_SLOT_BYTES, 3, 2),
            Some(PAGE + 6 * DEFAULT_COPY_SLOT_BYTES)
        );
        assert_eq!(copy_ring_bytes(1, DEFAULT_COPY_SLOT_BYTES, d, 1), Some(0));
        assert_eq!(copy_ring_bytes(2, 0, d, 1), None);
        assert_eq!(copy_ring_bytes(2, 256, 0, 1), None);
        assert_eq!(copy_ring_bytes(2, 256, d, 0), None);
        assert_eq!(copy_ring_bytes(3, usize::MAX / 2, d, 1), None);
    }

    /// The setup bytes of ranks that share a GPU: each rank's entries for its rings,
    /// read back per communicator by member index, whatever the order of the ranks'
    /// entries; entries of other communicators and truncated bytes are skipped, never
    /// a panic.
    #[test]
    fn shared_setup_entries_are_found_per_communicator_and_member() {
        use overlap_graph::{Group, Stream};
        let id = |stream| CommId {
            group: Group::Shard { replicate: 0 },
            stream,
        };
        let record = |rank: u32| Record {
            ok: true,
            rank,
            slot_bytes: 256,
            depth: 2,
            lanes: 1,
            node: [1; 16],
            handle: [rank as u8; 64],
        };
        let (a, b) = (id(Stream::Copy), id(Stream::Publish));
        let bytes = |rank: u32| {
            let mut out = Vec::new();
            shared_entry(&mut out, &Comm::copy_only(b, 2, rank), &record(rank + 10));
            shared_entry(&mut out, &Comm::copy_only(a, 2, rank), &record(rank));
            out
        };
        let all = vec![bytes(1), bytes(0)];
        let got = shared_records(&all, &Comm::copy_only(a, 2, 0));
        assert_eq!(got, vec![Some(record(0)), Some(record(1))]);
        let got = shared_records(&all, &Comm::copy_only(b, 2, 1));
        assert_eq!(got, vec![Some(record(10)), Some(record(11))]);
        // A rank that sent nothing, or bytes cut anywhere: no record for its member.
        for cut in 0..bytes(1).len() {
            let all = vec![bytes(0), bytes(1)[..cut].to_vec()];
            let got = shared_records(&all, &Comm::copy_only(a, 2, 0));
            assert_eq!(got[0], Some(record(0)));
        }
        assert_eq!(
            shared_records(&[], &Comm::copy_only(a, 2, 0)),
            vec![None, None]
        );
    }

    #[test]
    fn setup_records_round_trip() {
        let r = Record {
            ok: true,
            rank: 7,
            slot_bytes: 32 << 20,
            depth: 2,
            lanes: 2,
            node: [3; 16],
            handle: std::array::from_fn(|i| i as u8),
        };
        assert_eq!(Record::decode(&r.encode()), Some(r));
        assert_eq!(Record::decode(&[0; RECORD_BYTES]), None);
        let id = parse_node_id("6f1c1d0e-2b4a-4c47-9d8e-0a1b2c3d4e5f\n");
        assert_eq!(id[0], 0x6f);
        assert_eq!(id[15], 0x5f);
        assert_eq!(parse_node_id(""), [0; 16]);
    }

    #[test]
    fn an_in_place_exchange_names_where_its_pieces_are_or_why_they_do_not_fit() {
        let layout = Layout::new(3, 256, 2, 1).unwrap();
        let mut ring = CopyRing {
            id: CommId {
                group: overlap_graph::Group::Shard { replicate: 0 },
                stream: overlap_graph::Stream::Copy,
            },
            size: 3,
            index: 1,
            layout,
            local: 0x10_0000,
            remote: vec![0x20_0000, 0x30_0000],
            counters: vec![Counters::new(2)],
            broken: None,
            in_place: true,
            exchanges: 0,
        };
        // 64 floats per peer: one piece each, slot index 1 for piece 1.
        let plan = Plan::new(&desc(CollectiveKind::ReduceScatter, 64, None), 3, 1).unwrap();
        let ops = schedule(&plan, &layout, &mut ring.counters[0].clone(), true);
        let kept = ring.kept(&plan, &ops).unwrap().unwrap();
        assert_eq!(kept.base, 0x10_0000 + layout.data(0, 1) as u64);
        assert_eq!(kept.stride, 2 * 256);
        assert_eq!(kept.acks, vec![(0, 1), (2, 1)]);
        // 65 floats do not fit a slot of 256 bytes: every member refuses the exchange
        // before issuing anything (no device call is reached), the counters unchanged;
        // a reduce's non-root refuses it too.
        let big = Plan::new(&desc(CollectiveKind::ReduceScatter, 65, None), 3, 1).unwrap();
        let e = ring
            .exchange(std::ptr::null_mut(), &big, None, None)
            .unwrap_err();
        assert!(
            e.to_string().contains("does not fit one slot of 256 bytes"),
            "{e}"
        );
        assert_eq!(ring.counters, vec![Counters::new(2)]);
        let leaf = Plan::new(&desc(CollectiveKind::Reduce, 65, Some(0)), 3, 1).unwrap();
        let e = ring
            .exchange(std::ptr::null_mut(), &leaf, None, None)
            .unwrap_err();
        assert!(e.to_string().contains("does not fit one slot"), "{e}");
        // Two pieces per peer as kept() would see them (a ring that is not a shard
        // group's would produce them): refused.
        let ops = schedule(&big, &layout, &mut ring.counters[0].clone(), true);
        assert!(ring.kept(&big, &ops).is_err());
        // A member that sends only (a reduce's non-root) keeps nothing.
        let red = Plan::new(&desc(CollectiveKind::Reduce, 64, Some(0)), 3, 1).unwrap();
        let ops = schedule(&red, &layout, &mut ring.counters[0].clone(), true);
        assert_eq!(ring.kept(&red, &ops).unwrap(), None);
        ring.in_place = false;
    }
}
