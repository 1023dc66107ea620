//! The copy transport of [`crate::Kernel::Exchange`]: CUDA IPC receive rings written by
//! the copy engines, synchronised with stream memory operations. No SM runs a kernel.
//!
//! # Rings
//!
//! Every communicator of more than one member gets, on each member, one [`CopyRing`]: a
//! plain `cuMemAlloc` allocation (CUDA IPC cannot export pool memory) that every other
//! member of the group maps with `cuIpcOpenMemHandle`. For a group of `n` members, with
//! the peers of member `i` numbered by [`crate::exchange_slot`]`(i, j)` (`k` below):
//!
//! ```text
//! flags: for each lane: ready[k] (u32, written by peer k), then ack[k] (u32, written
//!        by peer k), each on its own 64-byte line; the data area starts at the next
//!        4 KiB
//! data:  for each lane, for k in 0..n-1, for r in 0..depth: a slot of slot_bytes that
//!        peer k fills
//! ```
//!
//! A ring has one lane, or two when its communicator gathers ([`CopySetup::gather_lane`]):
//! then gathers use lane 1, with counters of their own, and exchanges lane 0, so an
//! exchange read in place (acknowledged by its combine, later) and a gather
//! (acknowledged at once) never share a slot counter. A ring costs `lanes · depth ·
//! slot_bytes · (n − 1)` bytes of device memory (plus 4 KiB of flags) on every member:
//! with [`DEFAULT_COPY_SLOT_BYTES`] and [`DEFAULT_COPY_RING_DEPTH`], 64 MiB per peer and
//! lane ([`copy_ring_bytes`]).
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
//! # One exchange ([`schedule`], [`CopyRing::exchange`])
//!
//! A message of more than `slot_bytes` (per peer) is split into pieces of at most
//! `slot_bytes`. Every ordered pair of members `(from → to)` that moves data has its
//! own piece counter `t` (1, 2, ...), kept by both ends: `from` counts the pieces it
//! sent to `to`, `to` those it received from `from`; both advance them identically
//! because every member issues the same exchanges in the same order and derives from
//! the kind and root alone which pairs move data. Piece `t` of a pair uses ring slot
//! `t mod depth`. For each piece, on the exchange's stream, in this order:
//!
//! 1. for each peer `j` I send to (group order): if `t > depth`, wait until my `ack[j]`
//!    ≥ `t − depth` (`j` drained the slot I am about to overwrite); copy my chunk for
//!    `j` into `j`'s ring (a copy-engine copy into peer memory over NVLink); write
//!    `t` to `j`'s `ready[me]` (the write's default memory barrier makes the copied
//!    data visible before the flag);
//! 2. for each peer `j` I receive from (group order): wait until my `ready[j]` ≥ `t`;
//!    copy the slot into my receive buffer (a local copy-engine copy); write `t` to
//!    `j`'s `ack[me]`.
//!
//! Reduce-scatter and all-reduce move data between every pair. A reduce moves data from
//! every non-root to the root only: the root issues no step 1, a non-root no step 2,
//! and the counters of pairs that move nothing do not advance, so no member ever waits
//! for a flag nobody writes. (A single counter per ring, advanced for every piece, would
//! not do: once reduces with different roots are interleaved with other exchanges, a
//! pair's `t − depth` would name a piece that pair never moved, and the wait would never
//! end.)
//!
//! Progress: step 1 of a piece waits only for acks of earlier pieces, and step 2 only
//! for step 1 of the same piece on the peers, so by induction over the pieces (numbered
//! alike on every member) every member completes every piece, provided that the
//! streams' other work is ordered alike on every member, as for NCCL collectives.
//!
//! Flags are compared with `CU_STREAM_WAIT_VALUE_GEQ`, which CUDA defines as the cyclic
//! `(int32_t)(*addr − value) ≥ 0`: a counter may wrap past `u32::MAX` (values never run
//! more than `depth` apart, far below 2³¹).
//!
//! Invariant: a slot is overwritten only after its previous piece was copied out, and
//! copied out only after it was completely written.

use std::ffi::c_uint;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use overlap_graph::{Collective, CollectiveKind};

use super::device::{describe, Device};
use super::loader;
use super::memory::Memory;
use super::nccl::Comm;
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

/// Distance between two flags (each on its own cache line).
const FLAG_STRIDE: usize = 64;
/// Alignment of the data area and of the ring's total size.
const PAGE: usize = 4096;
/// Slot sizes are rounded up to this, so every piece starts aligned.
const SLOT_ALIGN: usize = 256;
/// Bytes of one element: exchanges move the f32 buffers as they are.
const ELEM: usize = 4;

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

/// Where things are in a ring (identical on every member of a group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    /// Members other than the owner.
    peers: usize,
    /// Slots per peer.
    depth: usize,
    /// Bytes per slot (a multiple of [`SLOT_ALIGN`]).
    slot_bytes: usize,
    /// Bytes of the flags area (a multiple of [`PAGE`]).
    flags_bytes: usize,
    /// Bytes of the whole ring.
    bytes: usize,
    /// Lanes of the ring: independent sets of flags and slots (1, or 2 with a gather
    /// lane).
    lanes: usize,
    /// The lane this view addresses ([`Layout::lane`]; 0 for the ring's own layout).
    lane: usize,
}

impl Layout {
    fn new(size: u32, slot_bytes: usize, depth: usize, lanes: usize) -> Result<Layout, String> {
        if size < 2 {
            return Err(format!("a group of {size} member(s) has no copy ring"));
        }
        if slot_bytes == 0 || depth == 0 || lanes == 0 {
            return Err(format!(
                "a copy ring needs slots of at least one byte, a depth and a lane count of at least one (got {slot_bytes} bytes × {depth} × {lanes} lanes)"
            ));
        }
        let peers = size as usize - 1;
        let too_big = || {
            format!("a copy ring of {lanes} lanes × {depth} × {slot_bytes} bytes × {peers} peers does not fit in memory")
        };
        let slot_bytes = slot_bytes
            .checked_next_multiple_of(SLOT_ALIGN)
            .ok_or_else(too_big)?;
        let flags_bytes = lanes
            .checked_mul(2 * peers * FLAG_STRIDE)
            .and_then(|f| f.checked_next_multiple_of(PAGE))
            .ok_or_else(too_big)?;
        let bytes = peers
            .checked_mul(depth)
            .and_then(|s| s.checked_mul(lanes))
            .and_then(|s| s.checked_mul(slot_bytes))
            .and_then(|d| d.checked_add(flags_bytes))
            .ok_or_else(too_big)?;
        Ok(Layout {
            peers,
            depth,
            slot_bytes,
            flags_bytes,
            bytes,
            lanes,
            lane: 0,
        })
    }

    /// The same ring, addressing lane `lane`'s flags and slots.
    fn lane(&self, lane: usize) -> Layout {
        debug_assert!(lane < self.lanes);
        Layout { lane, ..*self }
    }

    /// Offset of `ready[k]` (of this view's lane).
    fn ready(&self, k: usize) -> usize {
        debug_assert!(k < self.peers);
        (self.lane * 2 * self.peers + k) * FLAG_STRIDE
    }

    /// Offset of `ack[k]`.
    fn ack(&self, k: usize) -> usize {
        debug_assert!(k < self.peers);
        (self.lane * 2 * self.peers + self.peers + k) * FLAG_STRIDE
    }

    /// Offset of slot `slot` of peer `k`'s data.
    fn data(&self, k: usize, slot: usize) -> usize {
        debug_assert!(k < self.peers && slot < self.depth);
        self.flags_bytes + ((self.lane * self.peers + k) * self.depth + slot) * self.slot_bytes
    }
}

/// What one member moves in one exchange or gather: who sends to whom, and which chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    kind: Moves,
    size: u32,
    index: u32,
    /// The stage's collective (its count and kind give the chunks).
    desc: Collective,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Moves {
    /// Reduce-scatter and all-reduce: member `j` gets chunk `j`
    /// ([`Collective::member_chunk`]) of every other member's send buffer.
    Chunks,
    /// Reduce: the root gets every other member's whole send buffer.
    ToRoot(u32),
    /// All-reduce, after the combine: every member gets chunk `j` of member `j`'s
    /// buffer, in place in its own buffer (send and receive buffer are one).
    Gather,
}

impl Plan {
    /// Member `index`'s part of an exchange of `desc` over `size` members.
    pub(super) fn new(desc: &Collective, size: u32, index: u32) -> Result<Plan, String> {
        let kind = match (desc.kind, desc.root) {
            (CollectiveKind::ReduceScatter | CollectiveKind::AllReduce, _) => Moves::Chunks,
            (CollectiveKind::Reduce, Some(root)) if root < size => Moves::ToRoot(root),
            (CollectiveKind::Reduce, root) => {
                return Err(format!(
                    "root {root:?} is not a member index of {} ({size} members)",
                    desc.group
                ))
            }
            (kind, _) => {
                return Err(format!(
                    "{} reduces nothing and has no copy-transport exchange",
                    kind.name()
                ))
            }
        };
        Plan::checked(kind, desc, size, index)
    }

    /// Member `index`'s part of the gather that completes an all-reduce `desc`.
    pub(super) fn gather(desc: &Collective, size: u32, index: u32) -> Result<Plan, String> {
        if desc.kind != CollectiveKind::AllReduce {
            return Err(format!(
                "only an all-reduce's chunks are gathered, not a {}'s",
                desc.kind.name()
            ));
        }
        Plan::checked(Moves::Gather, desc, size, index)
    }

    fn checked(kind: Moves, desc: &Collective, size: u32, index: u32) -> Result<Plan, String> {
        if index >= size {
            return Err(format!(
                "member {index} is not a member of a group of {size}"
            ));
        }
        usize::try_from(desc.count)
            .ok()
            .filter(|&c| c.checked_mul(size as usize * ELEM).is_some())
            .ok_or_else(|| format!("count {} is too large", desc.count))?;
        Ok(Plan {
            kind,
            size,
            index,
            desc: *desc,
        })
    }

    /// Whether this is an all-reduce's gather (which receives into its output).
    fn is_gather(&self) -> bool {
        self.kind == Moves::Gather
    }

    /// Chunk `j` as `(offset, len)` in bytes.
    fn chunk(&self, j: u32) -> (usize, usize) {
        let (at, len) = self.desc.member_chunk(self.size, j);
        // `checked` bounded `size · count · ELEM`.
        (at as usize * ELEM, len as usize * ELEM)
    }

    /// Whether member `from` sends to member `to` (`from ≠ to`).
    fn moves(&self, from: u32, to: u32) -> bool {
        from != to
            && match self.kind {
                Moves::Chunks | Moves::Gather => true,
                Moves::ToRoot(root) => to == root,
            }
    }

    /// Bytes member `from` sends to member `to` (the same on both ends).
    fn bytes(&self, from: u32, to: u32) -> usize {
        match self.kind {
            Moves::Chunks => self.chunk(to).1,
            Moves::Gather => self.chunk(from).1,
            Moves::ToRoot(_) => self.desc.count as usize * ELEM,
        }
    }

    /// Where what goes to member `to` starts in this member's send buffer, in bytes.
    fn send_offset(&self, to: u32) -> usize {
        match self.kind {
            Moves::Chunks => self.chunk(to).0,
            Moves::Gather => self.chunk(self.index).0,
            Moves::ToRoot(_) => 0,
        }
    }

    /// Where member `from`'s data goes in this member's receive buffer, in bytes: its
    /// slot (the others in group order) of this member's chunk length, or for a gather
    /// its own chunk's place.
    fn recv_offset(&self, from: u32) -> usize {
        match self.kind {
            Moves::Gather => self.chunk(from).0,
            Moves::Chunks | Moves::ToRoot(_) => {
                exchange_slot(self.index, from) * self.bytes(from, self.index)
            }
        }
    }
}

/// The piece counters of one member's ring, per peer slot: pieces sent to the peer and
/// pieces received from it. 64-bit on the host (they never wrap); the flags carry them
/// modulo 2³².
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Counters {
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl Counters {
    fn new(peers: usize) -> Counters {
        Counters::starting_at(peers, 0)
    }

    /// Counters as if `start` pieces had moved between every pair (tests of wrap-around;
    /// the flags must then hold `start` too).
    fn starting_at(peers: usize, start: u64) -> Counters {
        Counters {
            sent: vec![start; peers],
            received: vec![start; peers],
        }
    }
}

/// One stream operation of an exchange, from the issuing member's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    /// Wait until my `ack[slot of peer]` ≥ `value` (cyclic).
    WaitAck { peer: u32, value: u32 },
    /// Copy `bytes` from my send buffer at byte `src` into `peer`'s ring, my slot
    /// `ring` there.
    Send {
        peer: u32,
        ring: usize,
        src: usize,
        bytes: usize,
    },
    /// Write `value` to `peer`'s `ready[slot of me]`.
    Ready { peer: u32, value: u32 },
    /// Wait until my `ready[slot of peer]` ≥ `value` (cyclic).
    WaitReady { peer: u32, value: u32 },
    /// Copy `bytes` from my ring, `peer`'s slot `ring`, into my receive buffer at byte
    /// `dst`.
    Take {
        peer: u32,
        ring: usize,
        dst: usize,
        bytes: usize,
    },
    /// Write `value` to `peer`'s `ack[slot of me]`.
    Ack { peer: u32, value: u32 },
    /// Receiving in place: `peer`'s piece `value` stays in my ring, slot `ring`, for the
    /// combine to read there; the combine acknowledges it. Issues nothing.
    Keep { peer: u32, ring: usize, value: u32 },
}

/// The stream operations of one exchange on one member, advancing its counters (the
/// protocol of the module documentation). With `in_place`, a received piece is not
/// copied out and acknowledged: [`Op::Keep`] marks it for the combine.
pub(super) fn schedule(
    plan: &Plan,
    layout: &Layout,
    counters: &mut Counters,
    in_place: bool,
) -> Vec<Op> {
    let me = plan.index;
    let depth = layout.depth as u64;
    // Piece `p` of the message `from → to`, as (offset, bytes), if it has one.
    let piece = |from: u32, to: u32, p: usize| {
        let message = plan.bytes(from, to);
        let offset = p * layout.slot_bytes;
        (offset < message).then(|| (offset, layout.slot_bytes.min(message - offset)))
    };
    let pieces = (0..plan.size)
        .flat_map(|j| [plan.bytes(me, j), plan.bytes(j, me)])
        .map(|b| b.div_ceil(layout.slot_bytes))
        .max()
        .unwrap_or(0);
    let mut ops = Vec::new();
    for p in 0..pieces {
        for j in (0..plan.size).filter(|&j| plan.moves(me, j)) {
            let Some((offset, bytes)) = piece(me, j, p) else {
                continue;
            };
            let k = exchange_slot(me, j);
            counters.sent[k] += 1;
            let t = counters.sent[k];
            if t > depth {
                ops.push(Op::WaitAck {
                    peer: j,
                    value: (t - depth) as u32,
                });
            }
            ops.push(Op::Send {
                peer: j,
                ring: (t % depth) as usize,
                src: plan.send_offset(j) + offset,
                bytes,
            });
            ops.push(Op::Ready {
                peer: j,
                value: t as u32,
            });
        }
        for j in (0..plan.size).filter(|&j| plan.moves(j, me)) {
            let Some((offset, bytes)) = piece(j, me, p) else {
                continue;
            };
            let k = exchange_slot(me, j);
            counters.received[k] += 1;
            let t = counters.received[k];
            ops.push(Op::WaitReady {
                peer: j,
                value: t as u32,
            });
            if in_place {
                ops.push(Op::Keep {
                    peer: j,
                    ring: (t % depth) as usize,
                    value: t as u32,
                });
                continue;
            }
            ops.push(Op::Take {
                peer: j,
                ring: (t % depth) as usize,
                dst: plan.recv_offset(j) + offset,
                bytes,
            });
            ops.push(Op::Ack {
                peer: j,
                value: t as u32,
            });
        }
    }
    ops
}

/// `CU_STREAM_WAIT_VALUE_GEQ` as CUDA defines it: `(int32_t)(flag − value) ≥ 0`.
#[cfg(test)]
fn reached(flag: u32, value: u32) -> bool {
    (flag.wrapping_sub(value) as i32) >= 0
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
        // A gather has its own lane where the ring has one.
        let lane = usize::from(plan.is_gather() && self.layout.lanes > 1);
        if self.in_place && plan.is_gather() && lane == 0 {
            return Err(self.err(
                "a gather on a ring whose receives are read in place and that has no gather lane: its immediate acknowledgements could overtake the combines' (CopySetup::gather_lane names the communicators that gather)".into(),
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

/// One driver call of an exchange: a run of flag operations, or a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Flags(Vec<Flag>),
    Copy(Op),
}

/// The driver calls that issue `ops` in order: each maximal run of flag operations
/// (`flag` maps an operation to its flag, `None` for a copy or a kept piece) is one call,
/// each copy one; a kept piece issues nothing and does not break a run.
fn calls(ops: &[Op], flag: impl Fn(Op) -> Option<Flag>) -> Vec<Call> {
    let mut out = Vec::new();
    let mut run = Vec::new();
    for &op in ops {
        match flag(op) {
            Some(f) => run.push(f),
            None if matches!(op, Op::Keep { .. }) => {}
            None => {
                if !run.is_empty() {
                    out.push(Call::Flags(std::mem::take(&mut run)));
                }
                out.push(Call::Copy(op));
            }
        }
    }
    if !run.is_empty() {
        out.push(Call::Flags(run));
    }
    out
}

/// One stream memory operation on a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flag {
    /// Wait until the flag at the address is at least the value (cyclic), as [`wait`].
    Wait(sys::CUdeviceptr, u32),
    /// Write the value to the flag at the address after a memory barrier, as [`write`].
    Write(sys::CUdeviceptr, u32),
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
fn copy(
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

    #[test]
    fn the_ring_layout_keeps_flags_apart_and_slots_aligned() {
        let l = Layout::new(4, 1000, 2, 1).unwrap();
        assert_eq!(l.slot_bytes, 1024);
        assert_eq!(l.flags_bytes, PAGE);
        assert_eq!(
            (l.ready(0), l.ready(2), l.ack(0), l.ack(2)),
            (0, 128, 192, 320)
        );
        assert_eq!(l.data(0, 0), PAGE);
        assert_eq!(l.data(0, 1), PAGE + 1024);
        assert_eq!(l.data(1, 0), PAGE + 2048);
        assert_eq!(l.bytes, PAGE + 3 * 2 * 1024);
        assert_eq!(l.data(2, 1) + l.slot_bytes, l.bytes);
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

    #[test]
    fn a_gather_lane_has_flags_and_slots_of_its_own() {
        let l = Layout::new(3, 1000, 2, 2).unwrap();
        let (a, b) = (l.lane(0), l.lane(1));
        assert_eq!(a, l);
        // Lane 1's flags follow lane 0's, on lines of their own, in the same page.
        assert_eq!((a.ready(0), a.ack(1)), (0, 192));
        assert_eq!(
            (b.ready(0), b.ready(1), b.ack(0), b.ack(1)),
            (256, 320, 384, 448)
        );
        assert_eq!(l.flags_bytes, PAGE);
        // Lane 1's slots follow lane 0's; together they fill the ring.
        assert_eq!(a.data(1, 1) + l.slot_bytes, b.data(0, 0));
        assert_eq!(b.data(1, 1) + l.slot_bytes, l.bytes);
        assert_eq!(l.bytes, PAGE + 2 * 2 * 2 * 1024);
        // Every flag and slot of one lane is distinct from every one of the other.
        let places = |x: &Layout| {
            let mut v = vec![x.ready(0), x.ready(1), x.ack(0), x.ack(1)];
            v.extend(
                (0..2)
                    .flat_map(|k| (0..2).map(move |r| (k, r)))
                    .map(|(k, r)| x.data(k, r)),
            );
            v
        };
        assert!(places(&a).iter().all(|p| !places(&b).contains(p)));
    }

    #[test]
    fn who_sends_to_whom_follows_the_kernel_contract() {
        let rs = Plan::new(&desc(CollectiveKind::ReduceScatter, 5, None), 3, 1).unwrap();
        assert!(rs.moves(1, 0) && rs.moves(0, 1) && rs.moves(2, 1) && !rs.moves(1, 1));
        assert_eq!((rs.send_offset(0), rs.send_offset(2)), (0, 40));
        assert_eq!((rs.recv_offset(0), rs.recv_offset(2)), (0, 20));
        // All-reduce: chunks of ⌈count / n⌉ rounded up to 64 elements; the last ones may
        // be short or empty.
        let ar = Plan::new(&desc(CollectiveKind::AllReduce, 300, None), 3, 2).unwrap();
        assert!(ar.moves(2, 0) && ar.moves(0, 2));
        // Chunks of 128, 128 and 44 floats.
        assert_eq!((ar.send_offset(0), ar.send_offset(1)), (0, 512));
        assert_eq!(
            (ar.bytes(2, 0), ar.bytes(2, 1), ar.bytes(0, 2)),
            (512, 512, 176)
        );
        assert_eq!((ar.recv_offset(0), ar.recv_offset(1)), (0, 176));
        let g = Plan::gather(&desc(CollectiveKind::AllReduce, 300, None), 3, 1).unwrap();
        assert!(g.moves(1, 0) && g.moves(0, 1) && g.moves(2, 1));
        assert_eq!((g.send_offset(0), g.send_offset(2)), (512, 512));
        assert_eq!(
            (g.bytes(1, 0), g.bytes(2, 1), g.bytes(0, 1)),
            (512, 176, 512)
        );
        assert_eq!((g.recv_offset(0), g.recv_offset(2)), (0, 1024));
        assert!(Plan::gather(&desc(CollectiveKind::ReduceScatter, 5, None), 3, 1).is_err());
        let red = Plan::new(&desc(CollectiveKind::Reduce, 5, Some(1)), 3, 0).unwrap();
        assert!(red.moves(0, 1) && red.moves(2, 1));
        assert!(!red.moves(1, 0) && !red.moves(0, 2) && !red.moves(2, 0));
        assert!(Plan::new(&desc(CollectiveKind::Reduce, 5, Some(3)), 3, 0).is_err());
        assert!(Plan::new(&desc(CollectiveKind::Reduce, 5, None), 3, 0).is_err());
        assert!(Plan::new(&desc(CollectiveKind::AllGather, 5, None), 3, 0).is_err());
        assert!(Plan::new(&desc(CollectiveKind::AllReduce, 5, None), 3, 3).is_err());
        assert!(Plan::new(&desc(CollectiveKind::AllReduce, u64::MAX / 4, None), 3, 0).is_err());
    }

    #[test]
    fn messages_are_split_into_pieces_and_slots_alternate() {
        // 2 members, reduce-scatter of 1000 floats per member (4000 bytes, chunk 1 at
        // byte 4000) in slots of 1024 bytes.
        let l = Layout::new(2, 1024, 2, 1).unwrap();
        let plan = Plan::new(&desc(CollectiveKind::ReduceScatter, 1000, None), 2, 0).unwrap();
        let mut c = Counters::new(1);
        let ops = schedule(&plan, &l, &mut c, false);
        let sends: Vec<(usize, usize, usize)> = ops
            .iter()
            .filter_map(|op| match *op {
                Op::Send {
                    ring, src, bytes, ..
                } => Some((ring, src, bytes)),
                _ => None,
            })
            .collect();
        assert_eq!(
            sends,
            vec![
                (1, 4000, 1024),
                (0, 5024, 1024),
                (1, 6048, 1024),
                (0, 7072, 928)
            ]
        );
        // The first `depth` pieces need no ack; piece t waits for ack t − 2.
        let acks: Vec<u32> = ops
            .iter()
            .filter_map(|op| match *op {
                Op::WaitAck { value, .. } => Some(value),
                _ => None,
            })
            .collect();
        assert_eq!(acks, vec![1, 2]);
        assert_eq!(
            c,
            Counters {
                sent: vec![4],
                received: vec![4]
            }
        );
        // The first piece in full (send half, then receive half), then piece 2's send.
        assert_eq!(
            ops[..6],
            [
                Op::Send {
                    peer: 1,
                    ring: 1,
                    src: 4000,
                    bytes: 1024
                },
                Op::Ready { peer: 1, value: 1 },
                Op::WaitReady { peer: 1, value: 1 },
                Op::Take {
                    peer: 1,
                    ring: 1,
                    dst: 0,
                    bytes: 1024
                },
                Op::Ack { peer: 1, value: 1 },
                Op::Send {
                    peer: 1,
                    ring: 0,
                    src: 5024,
                    bytes: 1024,
                },
            ]
        );
        // An empty message moves nothing and leaves the counters alone.
        let empty = Plan::new(&desc(CollectiveKind::AllReduce, 0, None), 2, 0).unwrap();
        assert!(schedule(&empty, &l, &mut c, false).is_empty());
        assert_eq!(c.sent, vec![4]);
    }

    #[test]
    fn uneven_chunks_move_as_many_pieces_as_each_pair_needs() {
        // All-reduce of 1000 floats over 2: chunk 0 is 512 floats (2048 bytes, 2
        // pieces), chunk 1 is 488 (1952 bytes, 2 pieces); over 3, 384 / 384 / 232
        // floats. Both ends of a pair count the same pieces.
        let l = Layout::new(3, 1024, 2, 1).unwrap();
        let d = desc(CollectiveKind::AllReduce, 1000, None);
        let mut c: Vec<Counters> = (0..3).map(|_| Counters::new(2)).collect();
        for i in 0..3 {
            schedule(&Plan::new(&d, 3, i).unwrap(), &l, &mut c[i as usize], false);
        }
        // Member 2 receives 928 bytes per peer (1 piece) and sends 1536 (2 pieces).
        assert_eq!(c[2].received, vec![1, 1]);
        assert_eq!(c[2].sent, vec![2, 2]);
        assert_eq!((c[0].sent[1], c[2].received[0]), (1, 1));
        for i in 0..3 {
            schedule(
                &Plan::gather(&d, 3, i).unwrap(),
                &l,
                &mut c[i as usize],
                false,
            );
        }
        // The gather sends each member's own chunk: member 2's 928 bytes are 1 piece.
        assert_eq!(c[2].sent, vec![3, 3]);
        assert_eq!(c[0].received, vec![4, 3]);
    }

    #[test]
    fn a_reduce_advances_only_the_pairs_that_move_data() {
        let l = Layout::new(3, 64, 2, 1).unwrap();
        let d = desc(CollectiveKind::Reduce, 16, Some(1)); // 64 bytes: one piece
        let mut root = Counters::new(2);
        let ops = schedule(&Plan::new(&d, 3, 1).unwrap(), &l, &mut root, false);
        assert!(ops
            .iter()
            .all(|op| !matches!(op, Op::Send { .. } | Op::WaitAck { .. })));
        assert_eq!(
            root,
            Counters {
                sent: vec![0, 0],
                received: vec![1, 1]
            }
        );
        let mut leaf = Counters::new(2);
        let ops = schedule(&Plan::new(&d, 3, 2).unwrap(), &l, &mut leaf, false);
        assert_eq!(
            ops,
            vec![
                Op::Send {
                    peer: 1,
                    ring: 1,
                    src: 0,
                    bytes: 64
                },
                Op::Ready { peer: 1, value: 1 },
            ]
        );
        assert_eq!(
            leaf,
            Counters {
                sent: vec![0, 1],
                received: vec![0, 0]
            }
        );
    }

    #[test]
    fn runs_of_flag_operations_go_out_in_one_call_each() {
        // Member 1 of 3, in place, its third piece per pair with depth 2: per peer a
        // wait for a free slot, the copy, the ready write; then the waits for both
        // peers' pieces, which it keeps.
        let l = Layout::new(3, 256, 2, 1).unwrap();
        let plan = Plan::new(&desc(CollectiveKind::ReduceScatter, 64, None), 3, 1).unwrap();
        let mut counters = Counters::starting_at(2, 2);
        let ops = schedule(&plan, &l, &mut counters, true);
        // Flags at made-up addresses: the op's index in `ops`.
        let flag = |op: Op| {
            let at = ops.iter().position(|o| *o == op).unwrap() as u64;
            match op {
                Op::WaitAck { value, .. } | Op::WaitReady { value, .. } => {
                    Some(Flag::Wait(at, value))
                }
                Op::Ready { value, .. } | Op::Ack { value, .. } => Some(Flag::Write(at, value)),
                _ => None,
            }
        };
        let got = calls(&ops, flag);
        let shape: Vec<String> = got
            .iter()
            .map(|c| match c {
                Call::Flags(f) => format!("flags {}", f.len()),
                Call::Copy(_) => "copy".into(),
            })
            .collect();
        // wait ack 0 | copy 0 | ready 0, wait ack 2 | copy 2 | ready 2, wait ready 0,
        // wait ready 2 (the kept pieces do not break the run).
        assert_eq!(shape, ["flags 1", "copy", "flags 2", "copy", "flags 3"]);
        // Order is kept: the flags, flattened, are the flag operations in order.
        let flat: Vec<Flag> = got
            .into_iter()
            .flat_map(|c| match c {
                Call::Flags(f) => f,
                Call::Copy(_) => Vec::new(),
            })
            .collect();
        let want: Vec<Flag> = ops.iter().filter_map(|&op| flag(op)).collect();
        assert_eq!(flat, want);
        // Copying out: every take breaks the run.
        let mut counters = Counters::new(2);
        let ops = schedule(&plan, &l, &mut counters, false);
        let copies = calls(&ops, |op| match op {
            Op::Send { .. } | Op::Take { .. } | Op::Keep { .. } => None,
            _ => Some(Flag::Write(0, 0)),
        })
        .iter()
        .filter(|c| matches!(c, Call::Copy(_)))
        .count();
        assert_eq!(copies, 4);
    }

    #[test]
    fn cyclic_comparison_survives_wrap_around() {
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(0, u32::MAX) && reached(1, u32::MAX - 1));
        assert!(!reached(u32::MAX, 0));
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

    /// A model of `n` members running their schedules: rings, flags and buffers in host
    /// memory, every operation atomic, the members interleaved by `pick`.
    struct Sim {
        layout: Layout,
        rings: Vec<Vec<u8>>,
        /// Per exchange, per member: send and receive buffers.
        sends: Vec<Vec<Vec<u8>>>,
        recvs: Vec<Vec<Vec<u8>>>,
        queues: Vec<std::collections::VecDeque<(usize, Op)>>,
        /// Per exchange, per member: the plan (for the expected result).
        plans: Vec<Vec<Plan>>,
        /// Per exchange: the gather of this all-reduce, if it is one (its send buffer is
        /// its receive buffer: the model reads and writes `recvs`).
        gathers: Vec<Option<Collective>>,
    }

    impl Sim {
        fn flag(&self, member: usize, at: usize) -> u32 {
            u32::from_le_bytes(self.rings[member][at..at + 4].try_into().unwrap())
        }

        fn set_flag(&mut self, member: usize, at: usize, v: u32) {
            self.rings[member][at..at + 4].copy_from_slice(&v.to_le_bytes());
        }

        /// Runs member `m`'s next operation if it can; whether it did.
        fn step(&mut self, m: usize) -> bool {
            if !self.can_step(m) {
                return false;
            }
            let Some(&(e, op)) = self.queues[m].front() else {
                return false;
            };
            let me = m as u32;
            let l = self.layout;
            match op {
                Op::WaitAck { .. } | Op::WaitReady { .. } | Op::Keep { .. } => {}
                Op::Send {
                    peer,
                    ring,
                    src,
                    bytes,
                } => {
                    // A gather sends from the buffer it also receives into.
                    let from = if self.gathers[e].is_some() {
                        &self.recvs[e][m]
                    } else {
                        &self.sends[e][m]
                    };
                    deliver(
                        &mut self.rings,
                        &l,
                        me,
                        (peer, ring),
                        &from[src..src + bytes],
                    )
                }
                Op::Take {
                    peer,
                    ring,
                    dst,
                    bytes,
                } => take(
                    &self.rings,
                    &l,
                    me,
                    (peer, ring),
                    &mut self.recvs[e][m][dst..dst + bytes],
                ),
                Op::Ready { peer, value } => {
                    self.set_flag(peer as usize, l.ready(exchange_slot(peer, me)), value)
                }
                Op::Ack { peer, value } => {
                    self.set_flag(peer as usize, l.ack(exchange_slot(peer, me)), value)
                }
            }
            self.queues[m].pop_front();
            true
        }

        /// Runs to completion, choosing among runnable members with `pick`; panics on a
        /// deadlock.
        fn run(&mut self, mut pick: impl FnMut(&[usize]) -> usize) {
            loop {
                let runnable: Vec<usize> = (0..self.queues.len())
                    .filter(|&m| self.can_step(m))
                    .collect();
                if runnable.is_empty() {
                    let left: Vec<_> = self.queues.iter().map(|q| q.front().copied()).collect();
                    assert!(
                        self.queues.iter().all(|q| q.is_empty()),
                        "deadlock: next operations {left:?}"
                    );
                    return;
                }
                let m = runnable[pick(&runnable)];
                assert!(self.step(m));
            }
        }

        fn can_step(&self, m: usize) -> bool {
            let me = m as u32;
            let l = self.layout;
            match self.queues[m].front() {
                None => false,
                Some((_, Op::WaitAck { peer, value })) => {
                    reached(self.flag(m, l.ack(exchange_slot(me, *peer))), *value)
                }
                Some((_, Op::WaitReady { peer, value })) => {
                    reached(self.flag(m, l.ready(exchange_slot(me, *peer))), *value)
                }
                Some(_) => true,
            }
        }

        /// The receive-buffer chunks that differ from what the contract of
        /// `Kernel::Exchange` says they hold.
        fn mismatches(&self) -> Vec<String> {
            let mut wrong = Vec::new();
            for (e, plans) in self.plans.iter().enumerate() {
                if let Some(d) = &self.gathers[e] {
                    // Independently of `Plan`: every member's buffer ends with chunk j
                    // of member j's starting bytes, for every j (its own unchanged).
                    let n = plans.len() as u32;
                    for i in 0..plans.len() {
                        for j in 0..n {
                            let (at, len) = d.member_chunk(n, j);
                            let r = at as usize * ELEM..(at + len) as usize * ELEM;
                            if self.recvs[e][i][r.clone()] != self.sends[e][j as usize][r] {
                                wrong.push(format!("gather {e}: member {i}'s chunk {j}"));
                            }
                        }
                    }
                    continue;
                }
                for (i, plan) in plans.iter().enumerate() {
                    for j in (0..plan.size).filter(|&j| plan.moves(j, i as u32)) {
                        let c = plan.bytes(j, i as u32);
                        let src = plans[j as usize].send_offset(i as u32);
                        let want = &self.sends[e][j as usize][src..src + c];
                        let at = plan.recv_offset(j);
                        if &self.recvs[e][i][at..at + c] != want {
                            wrong.push(format!("exchange {e}: member {i}'s chunk from member {j}"));
                        }
                    }
                }
            }
            wrong
        }

        fn check(&self) {
            let wrong = self.mismatches();
            assert!(wrong.is_empty(), "wrong data: {wrong:?}");
        }
    }

    /// A model `Send`: `data` from member `me` lands in `peer`'s ring, `me`'s slot `ring`.
    fn deliver(
        rings: &mut [Vec<u8>],
        l: &Layout,
        me: u32,
        (peer, ring): (u32, usize),
        data: &[u8],
    ) {
        let at = l.data(exchange_slot(peer, me), ring);
        rings[peer as usize][at..at + data.len()].copy_from_slice(data);
    }

    /// A model `Take`: member `me` copies `peer`'s piece in its ring slot `ring` to `out`.
    fn take(rings: &[Vec<u8>], l: &Layout, me: u32, (peer, ring): (u32, usize), out: &mut [u8]) {
        let at = l.data(exchange_slot(me, peer), ring);
        out.copy_from_slice(&rings[me as usize][at..at + out.len()]);
    }

    /// Builds the simulation of a sequence of exchanges, and gathers where the flag is
    /// set (every member issues all of them, in order), with counters and flags
    /// starting at `start`. A gather's buffer is both its send and its receive buffer:
    /// the model starts both with the same bytes (a gather never writes the chunk it
    /// sends).
    fn simulate(
        n: u32,
        slot: usize,
        depth: usize,
        start: u64,
        descs: &[(Collective, bool)],
        strip_acks: bool,
    ) -> Sim {
        let layout = Layout::new(n, slot, depth, 1).unwrap();
        let mut rings = vec![vec![0u8; layout.bytes]; n as usize];
        for ring in &mut rings {
            for k in 0..layout.peers {
                for at in [layout.ready(k), layout.ack(k)] {
                    ring[at..at + 4].copy_from_slice(&(start as u32).to_le_bytes());
                }
            }
        }
        let mut counters = vec![Counters::starting_at(layout.peers, start); n as usize];
        let mut queues = vec![std::collections::VecDeque::new(); n as usize];
        let (mut sends, mut recvs, mut plans) = (Vec::new(), Vec::new(), Vec::new());
        for (e, &(d, gather)) in descs.iter().enumerate() {
            let d = &d;
            let mut s = Vec::new();
            let mut r = Vec::new();
            let mut p = Vec::new();
            for i in 0..n {
                // A gather's one buffer is its send side, and also where it receives.
                let (roles, _) = crate::copy_roles(d, n, i, gather).unwrap();
                let plan = if gather {
                    Plan::gather(d, n, i).unwrap()
                } else {
                    Plan::new(d, n, i).unwrap()
                };
                let send_len = roles.send.unwrap_or(0) * ELEM;
                let recv_len = if gather {
                    send_len
                } else {
                    roles.recv.unwrap_or(0) * ELEM
                };
                let bytes: Vec<u8> = (0..send_len)
                    .map(|b| {
                        // A different byte almost everywhere, with no period.
                        let x = b as u64 ^ u64::from(i) << 32 ^ (e as u64) << 48;
                        (x.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8
                    })
                    .collect();
                r.push(if gather {
                    bytes.clone()
                } else {
                    vec![0xee; recv_len]
                });
                s.push(bytes);
                for op in schedule(&plan, &layout, &mut counters[i as usize], false) {
                    if !(strip_acks && matches!(op, Op::WaitAck { .. })) {
                        queues[i as usize].push_back((e, op));
                    }
                }
                p.push(plan);
            }
            sends.push(s);
            recvs.push(r);
            plans.push(p);
        }
        Sim {
            layout,
            rings,
            sends,
            recvs,
            queues,
            plans,
            gathers: descs.iter().map(|&(d, g)| g.then_some(d)).collect(),
        }
    }

    /// xorshift, for reproducible interleavings.
    fn rng(seed: u64) -> impl FnMut(&[usize]) -> usize {
        let mut s = seed.max(1);
        move |choices: &[usize]| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % choices.len() as u64) as usize
        }
    }

    /// Twelve random exchanges; each all-reduce's gather follows it, at once or after
    /// the next exchange (as a combine lag places it).
    fn mixed(n: u32, seed: u64) -> Vec<(Collective, bool)> {
        let mut s = seed;
        let mut out = Vec::new();
        let mut pending: Option<Collective> = None;
        for _ in 0..12 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let count = (s >> 33) % 600;
            let d = match (s >> 20) % 4 {
                0 => desc(CollectiveKind::ReduceScatter, count, None),
                1 => desc(CollectiveKind::AllReduce, count, None),
                _ => desc(
                    CollectiveKind::Reduce,
                    count,
                    Some(((s >> 40) % u64::from(n)) as u32),
                ),
            };
            out.push((d, false));
            if let Some(g) = pending.take() {
                out.push((g, true));
            }
            if d.kind == CollectiveKind::AllReduce {
                if (s >> 50) % 2 == 0 {
                    out.push((d, true));
                } else {
                    pending = Some(d);
                }
            }
        }
        out.extend(pending.map(|g| (g, true)));
        out
    }

    fn exchanges(descs: &[Collective]) -> Vec<(Collective, bool)> {
        descs.iter().map(|&d| (d, false)).collect()
    }

    #[test]
    fn every_interleaving_delivers_every_chunk_without_deadlock() {
        for n in 2..=4 {
            for depth in 1..=3 {
                for seed in 1..=25u64 {
                    let descs = mixed(n, seed * 7919 + u64::from(n));
                    // Slots of 256 bytes: messages of up to 299 floats take up to 5 pieces.
                    let mut sim = simulate(n, 256, depth, 0, &descs, false);
                    sim.run(rng(seed));
                    sim.check();
                    // Greedy schedules: one member runs ahead as far as it can.
                    let mut sim = simulate(n, 256, depth, 0, &descs, false);
                    sim.run(|r| r.len() - 1);
                    sim.check();
                    let mut sim = simulate(n, 256, depth, 0, &descs, false);
                    sim.run(|_| 0);
                    sim.check();
                }
            }
        }
    }

    #[test]
    fn reduces_with_changing_roots_between_other_exchanges_do_not_deadlock() {
        // Slots of 256 bytes (64 floats): 1 to 4 pieces per message.
        let descs = [
            desc(CollectiveKind::AllReduce, 16, None),
            desc(CollectiveKind::Reduce, 256, Some(0)),
            desc(CollectiveKind::Reduce, 192, Some(1)),
            desc(CollectiveKind::Reduce, 130, Some(2)),
            desc(CollectiveKind::ReduceScatter, 70, None),
            desc(CollectiveKind::AllReduce, 256, None),
        ];
        for seed in 1..=50 {
            let mut sim = simulate(3, 256, 2, 0, &exchanges(&descs), false);
            sim.run(rng(seed));
            sim.check();
        }
    }

    #[test]
    fn counters_may_wrap_past_u32_max() {
        let descs = mixed(3, 99);
        for seed in 1..=20 {
            let mut sim = simulate(3, 256, 2, u64::from(u32::MAX) - 3, &descs, false);
            sim.run(rng(seed));
            sim.check();
        }
    }

    #[test]
    fn the_model_catches_a_slot_overwritten_before_it_was_drained() {
        // Without the ack waits, a sender that runs ahead overwrites a slot its peer has
        // not copied out yet: the model must notice (it is not vacuous). Member 0 runs
        // whenever it can: it posts piece 1, member 1 posts its piece 1, and member 0
        // takes it and posts piece 2 over the piece 1 member 1 has not taken yet.
        // An all-reduce of 512 floats: each member's chunk of 256 floats moves in 4
        // pieces of 256 bytes.
        let descs = exchanges(&[desc(CollectiveKind::AllReduce, 512, None)]);
        let mut sim = simulate(2, 256, 1, 0, &descs, true);
        sim.run(|_| 0);
        assert!(
            !sim.mismatches().is_empty(),
            "an overwritten slot went unnoticed"
        );
        // With them, the same schedule is correct.
        let mut sim = simulate(2, 256, 1, 0, &descs, false);
        sim.run(|_| 0);
        sim.check();
    }

    /// What a stream of [`InPlaceSim`] runs next, for one exchange.
    #[derive(Debug, Clone, Copy)]
    enum Item {
        /// An operation of the exchange (lane 0, in place).
        Exchange(Op),
        /// The exchange's combine: reads the kept pieces, acknowledges them and writes
        /// the member's reduced chunk into its gather buffer.
        Combine,
        /// An operation of the all-reduce's gather (lane 1, copying out), after the
        /// combine.
        Gather(Op),
    }

    /// One stream of a member in [`InPlaceSim`].
    type Lane = std::collections::VecDeque<(usize, Item)>;

    /// Whether and how [`InPlaceSim`] gathers.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Gathers {
        /// No gathers (reduce-scatters and reduces).
        No,
        /// All-reduces, their gathers on the ring's second lane (what the backend does).
        OwnLane,
        /// All-reduces, their gathers on the exchanges' lane and counters (what the
        /// backend refuses: the model must show why).
        SharedLane,
    }

    /// Where [`InPlaceSim`] puts the combines.
    #[derive(Debug, Clone, Copy)]
    struct Placement {
        /// Exchanges issued between an exchange and its combine.
        lag: usize,
        /// On a stream of their own (else on the exchange's, in issue order).
        own_stream: bool,
    }

    /// In-place receives: exchanges leave their pieces in the rings, and a combine per
    /// exchange (on its own stream or on the exchange's, issued `lag` exchanges later)
    /// reads them there once its exchange is done, then acknowledges them. With
    /// `gathers` (all-reduces), each combine is followed, on the exchange's stream, by
    /// the gather of its chunk on the ring's second lane (copying out, acknowledging
    /// at once), as the executor issues them. Every member runs its two streams; any
    /// interleaving.
    struct InPlaceSim {
        layout: Layout,
        /// The gathers' lane, and whether there are gathers.
        gather_lane: usize,
        gathers_on: bool,
        rings: Vec<Vec<u8>>,
        /// Per exchange, per member: send buffer and plan.
        sends: Vec<Vec<Vec<u8>>>,
        plans: Vec<Vec<Plan>>,
        /// Per exchange, per member: the gather's buffer and plan.
        outs: Vec<Vec<Vec<u8>>>,
        gathers: Vec<Vec<Plan>>,
        /// Per member, per stream: (exchange, item).
        queues: Vec<[Lane; 2]>,
        /// Per member, per exchange: operations not yet run.
        left: Vec<Vec<usize>>,
        /// Per member, per exchange: whether its combine ran.
        combined: Vec<Vec<bool>>,
        /// Per member, per exchange: what the exchange kept in place.
        kept: Vec<Vec<Vec<(u32, usize, u32)>>>,
        wrong: Vec<String>,
    }

    /// The bytes member `i` sends in exchange `e` (or, reduced, gathers), as a pattern.
    fn pattern(e: usize, i: u32, len: usize) -> Vec<u8> {
        (0..len)
            .map(|b| (b as u64 * 31 + u64::from(i) * 7 + e as u64 * 131) as u8)
            .collect()
    }

    impl InPlaceSim {
        fn new(
            n: u32,
            slot: usize,
            depth: usize,
            descs: &[Collective],
            at: Placement,
            how: Gathers,
        ) -> Self {
            let gathers = how != Gathers::No;
            let gather_lane = usize::from(how == Gathers::OwnLane);
            let layout = Layout::new(n, slot, depth, 1 + gather_lane).unwrap();
            let mut counters = vec![Counters::new(layout.peers); n as usize];
            let mut gather_counters = counters.clone();
            let m_all = n as usize;
            let mut sim = InPlaceSim {
                layout,
                gather_lane,
                gathers_on: gathers,
                rings: vec![vec![0u8; layout.bytes]; m_all],
                sends: Vec::new(),
                plans: Vec::new(),
                outs: Vec::new(),
                gathers: Vec::new(),
                queues: (0..n).map(|_| Default::default()).collect(),
                left: vec![Vec::new(); m_all],
                combined: vec![vec![false; descs.len()]; m_all],
                kept: vec![Vec::new(); m_all],
                wrong: Vec::new(),
            };
            let combine_stream = usize::from(at.own_stream);
            // The combine of exchange `c` and, for all-reduces, its gather (counted on
            // `gc`: the gather lane's counters, or the exchanges' when they share one).
            let finish = |sim: &mut InPlaceSim, gc: &mut Counters, m: usize, c: usize| {
                sim.queues[m][combine_stream].push_back((c, Item::Combine));
                if gathers {
                    let plan = sim.gathers[c][m];
                    let ops = schedule(&plan, &layout.lane(gather_lane), gc, false);
                    sim.queues[m][0].extend(ops.into_iter().map(|op| (c, Item::Gather(op))));
                }
            };
            let shared = how == Gathers::SharedLane;
            for (e, d) in descs.iter().enumerate() {
                let (mut sends, mut plans) = (Vec::new(), Vec::new());
                for i in 0..n {
                    let plan = Plan::new(d, n, i).unwrap();
                    let len = crate::exchange_roles(d, n, i).unwrap().send.unwrap_or(0) * ELEM;
                    sends.push(pattern(e, i, len));
                    plans.push(plan);
                }
                sim.sends.push(sends);
                sim.plans.push(plans);
                sim.outs
                    .push(vec![vec![0u8; d.count as usize * ELEM]; m_all]);
                sim.gathers.push(
                    (0..n)
                        .map(|i| match gathers {
                            true => Plan::gather(d, n, i).unwrap(),
                            false => Plan::new(d, n, i).unwrap(),
                        })
                        .collect(),
                );
                for m in 0..m_all {
                    let plan = sim.plans[e][m];
                    let ops = schedule(&plan, &layout, &mut counters[m], true);
                    sim.kept[m].push(
                        ops.iter()
                            .filter_map(|op| match *op {
                                Op::Keep { peer, ring, value } => Some((peer, ring, value)),
                                _ => None,
                            })
                            .collect(),
                    );
                    sim.left[m].push(ops.len());
                    sim.queues[m][0].extend(ops.into_iter().map(|op| (e, Item::Exchange(op))));
                    if e >= at.lag {
                        let gc = if shared {
                            &mut counters[m]
                        } else {
                            &mut gather_counters[m]
                        };
                        finish(&mut sim, gc, m, e - at.lag);
                    }
                }
            }
            // The last `lag` combines come after the last exchange.
            for m in 0..m_all {
                for c in descs.len().saturating_sub(at.lag)..descs.len() {
                    let gc = if shared {
                        &mut counters[m]
                    } else {
                        &mut gather_counters[m]
                    };
                    finish(&mut sim, gc, m, c);
                }
            }
            sim
        }

        fn flag(&self, m: usize, at: usize) -> u32 {
            u32::from_le_bytes(self.rings[m][at..at + 4].try_into().unwrap())
        }

        fn can_step(&self, m: usize, s: usize) -> bool {
            let me = m as u32;
            let waits = |l: Layout, op: &Op| match *op {
                Op::WaitAck { peer, value } => {
                    reached(self.flag(m, l.ack(exchange_slot(me, peer))), value)
                }
                Op::WaitReady { peer, value } => {
                    reached(self.flag(m, l.ready(exchange_slot(me, peer))), value)
                }
                _ => true,
            };
            match self.queues[m][s].front() {
                None => false,
                Some((e, Item::Combine)) => self.left[m][*e] == 0,
                Some((_, Item::Exchange(op))) => waits(self.layout, op),
                // The gather waits for its combine (the executor's event).
                Some((e, Item::Gather(op))) => {
                    self.combined[m][*e] && waits(self.layout.lane(self.gather_lane), op)
                }
            }
        }

        fn step(&mut self, m: usize, s: usize) {
            let me = m as u32;
            let (e, item) = self.queues[m][s].pop_front().unwrap();
            let set = |rings: &mut Vec<Vec<u8>>, peer: u32, at: usize, v: u32| {
                rings[peer as usize][at..at + 4].copy_from_slice(&v.to_le_bytes())
            };
            match item {
                Item::Combine => {
                    // Check what the ring holds, acknowledge, then write the member's
                    // chunk of the result (what its gather sends).
                    let l = self.layout;
                    for &(j, ring, value) in &self.kept[m][e] {
                        let plan = &self.plans[e][m];
                        let bytes = plan.bytes(j, me);
                        let src = self.plans[e][j as usize].send_offset(me);
                        let at = l.data(exchange_slot(me, j), ring);
                        if self.rings[m][at..at + bytes]
                            != self.sends[e][j as usize][src..src + bytes]
                        {
                            self.wrong
                                .push(format!("exchange {e}: member {m}'s piece from {j}"));
                        }
                        set(&mut self.rings, j, l.ack(exchange_slot(j, me)), value);
                    }
                    if self.gathers_on {
                        let (at, len) = self.gathers[e][m].chunk(me);
                        let mine = pattern(e, me, at + len);
                        self.outs[e][m][at..at + len].copy_from_slice(&mine[at..]);
                    }
                    self.combined[m][e] = true;
                }
                Item::Exchange(op) => {
                    let l = self.layout;
                    match op {
                        Op::Send {
                            peer,
                            ring,
                            src,
                            bytes,
                        } => deliver(
                            &mut self.rings,
                            &l,
                            me,
                            (peer, ring),
                            &self.sends[e][m][src..src + bytes],
                        ),
                        Op::Ready { peer, value } => set(
                            &mut self.rings,
                            peer,
                            l.ready(exchange_slot(peer, me)),
                            value,
                        ),
                        Op::Ack { .. } | Op::Take { .. } => {
                            panic!("an in-place exchange copied out")
                        }
                        _ => {}
                    }
                    self.left[m][e] -= 1;
                }
                Item::Gather(op) => {
                    let l = self.layout.lane(self.gather_lane);
                    match op {
                        Op::Send {
                            peer,
                            ring,
                            src,
                            bytes,
                        } => {
                            let data = self.outs[e][m][src..src + bytes].to_vec();
                            deliver(&mut self.rings, &l, me, (peer, ring), &data);
                        }
                        Op::Ready { peer, value } => set(
                            &mut self.rings,
                            peer,
                            l.ready(exchange_slot(peer, me)),
                            value,
                        ),
                        Op::Take {
                            peer,
                            ring,
                            dst,
                            bytes,
                        } => take(
                            &self.rings,
                            &l,
                            me,
                            (peer, ring),
                            &mut self.outs[e][m][dst..dst + bytes],
                        ),
                        Op::Ack { peer, value } => {
                            set(&mut self.rings, peer, l.ack(exchange_slot(peer, me)), value)
                        }
                        Op::Keep { .. } => panic!("a gather kept its pieces in place"),
                        _ => {}
                    }
                }
            }
        }

        fn run(&mut self, mut pick: impl FnMut(&[usize]) -> usize) {
            loop {
                let runnable: Vec<usize> = (0..self.queues.len() * 2)
                    .filter(|&x| self.can_step(x / 2, x % 2))
                    .collect();
                if runnable.is_empty() {
                    let stuck: Vec<_> = self
                        .queues
                        .iter()
                        .map(|q| [q[0].front().copied(), q[1].front().copied()])
                        .collect();
                    assert!(
                        self.queues
                            .iter()
                            .all(|q| q[0].is_empty() && q[1].is_empty()),
                        "deadlock: {stuck:?}"
                    );
                    break;
                }
                let x = runnable[pick(&runnable)];
                self.step(x / 2, x % 2);
            }
            if self.gathers_on {
                // Every member holds every member's reduced chunk.
                for (e, outs) in self.outs.iter().enumerate() {
                    for (m, out) in outs.iter().enumerate() {
                        for j in 0..outs.len() as u32 {
                            let (at, len) = self.gathers[e][m].chunk(j);
                            if out[at..at + len] != pattern(e, j, at + len)[at..] {
                                self.wrong
                                    .push(format!("gather {e}: member {m}'s chunk of {j}"));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every placement of the combines the in-place rule allows with `depth`: on their
    /// own stream or the exchange's, up to `depth − 1` exchanges behind.
    fn placements(depth: usize) -> impl Iterator<Item = Placement> {
        (0..depth).flat_map(|lag| [true, false].map(|own_stream| Placement { lag, own_stream }))
    }

    /// Runs `descs` in place under every allowed placement and three schedules.
    fn check_in_place(n: u32, seed: u64, descs: &[Collective], gathers: Gathers) {
        for depth in 1..=3 {
            for at in placements(depth) {
                for pick in 0..3 {
                    let mut sim = InPlaceSim::new(n, 256, depth, descs, at, gathers);
                    match pick {
                        0 => sim.run(rng(seed)),
                        1 => sim.run(|r| r.len() - 1),
                        _ => sim.run(|_| 0),
                    }
                    assert!(
                        sim.wrong.is_empty(),
                        "n {n} depth {depth} {at:?} gathers {gathers:?}: {:?}",
                        sim.wrong
                    );
                }
            }
        }
    }

    /// `len` counts from `seed`, each in `1..=most`.
    fn counts(seed: u64, len: usize, most: u64) -> Vec<u64> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                1 + (s >> 33) % most
            })
            .collect()
    }

    #[test]
    fn combines_reading_in_place_get_every_piece_and_nothing_deadlocks() {
        for n in 2..=4u32 {
            for seed in 1..=30u64 {
                // Shard-group exchanges whose messages fit one slot of 256 bytes (64
                // floats per peer): reduce-scatters of up to 64 and reduces of up to 64,
                // with roots that change.
                let descs: Vec<Collective> = counts(seed * 977 + u64::from(n), 10, 64)
                    .into_iter()
                    .enumerate()
                    .map(|(k, count)| match (count * 7 + k as u64) % 3 {
                        0 => desc(
                            CollectiveKind::Reduce,
                            count,
                            Some(((count + k as u64) % u64::from(n)) as u32),
                        ),
                        _ => desc(CollectiveKind::ReduceScatter, count, None),
                    })
                    .collect();
                check_in_place(n, seed, &descs, Gathers::No);
            }
        }
    }

    #[test]
    fn all_reduces_read_in_place_with_gathers_on_their_own_lane() {
        for n in 2..=4u32 {
            for seed in 1..=30u64 {
                // All-reduces whose chunks fit one slot of 256 bytes: up to 64 floats
                // per member (some members' chunks empty when the count is small).
                let descs: Vec<Collective> =
                    counts(seed * 613 + u64::from(n), 10, 64 * u64::from(n))
                        .into_iter()
                        .map(|count| desc(CollectiveKind::AllReduce, count, None))
                        .collect();
                check_in_place(n, seed, &descs, Gathers::OwnLane);
            }
        }
    }

    #[test]
    #[should_panic(expected = "deadlock")]
    fn a_combine_queued_behind_the_exchange_that_needs_its_ack_deadlocks() {
        // Depth 2, combines on the exchange's stream 2 exchanges behind: exchange e + 2
        // waits for the acknowledgement of exchange e, which only the combine behind it
        // writes. The model must find it (why the lag must stay below the depth).
        let descs: Vec<Collective> = (0..6)
            .map(|_| desc(CollectiveKind::ReduceScatter, 64, None))
            .collect();
        let at = Placement {
            lag: 2,
            own_stream: false,
        };
        let mut sim = InPlaceSim::new(2, 256, 2, &descs, at, Gathers::No);
        sim.run(|_| 0);
    }

    #[test]
    fn gathers_sharing_the_exchanges_lane_break_in_place_receives() {
        // Why the gather lane: on one lane with one set of counters, a gather's
        // immediate acknowledgement lets a peer reuse a slot whose in-place piece the
        // combine has not read yet. The model must find it (wrong data or a hang) under
        // some allowed placement and schedule, for the same all-reduces that pass with
        // a lane of their own.
        let descs: Vec<Collective> = (0..8)
            .map(|_| desc(CollectiveKind::AllReduce, 128, None))
            .collect();
        let mut broken = 0;
        for depth in 1..=3 {
            for at in placements(depth) {
                for seed in 1..=20u64 {
                    let failed = std::panic::catch_unwind(|| {
                        let mut sim =
                            InPlaceSim::new(2, 256, depth, &descs, at, Gathers::SharedLane);
                        sim.run(rng(seed));
                        sim.wrong.is_empty()
                    });
                    broken += usize::from(!matches!(failed, Ok(true)));
                    let mut sim = InPlaceSim::new(2, 256, depth, &descs, at, Gathers::OwnLane);
                    sim.run(rng(seed));
                    assert!(sim.wrong.is_empty(), "{:?}", sim.wrong);
                }
            }
        }
        assert!(broken > 0, "a shared lane passed every run");
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
