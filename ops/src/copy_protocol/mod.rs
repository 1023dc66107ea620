//! The copy transport's protocol ([`crate::Kernel::Exchange`], [`crate::Kernel::Gather`]),
//! as pure functions: where things are in a member's receive ring ([`Layout`]), who
//! sends what to whom in one exchange or gather ([`Plan`]), the copies and flag
//! operations each member issues, in order ([`schedule`], advancing the pair counters
//! of [`Counters`]), and the driver calls that issue them ([`calls`]: each run of flag
//! operations in one).
//!
//! Nothing here touches a device. The CUDA backend (`cuda/exchange.rs`) allocates the
//! rings, maps them between the members through CUDA IPC and issues the operations as
//! copy-engine copies and stream memory operations. The tests run every member's
//! schedule on a model of the rings in host memory, under many interleavings
//! (`tests/model.rs`; `tests/in_place.rs` for combines that read the ring in place), so
//! the protocol is checked without a GPU. The module is compiled with the `cuda`
//! feature and for tests: nothing else uses it.
//!
//! # Rings
//!
//! Every communicator of more than one member has, on each member, one ring that every
//! other member of the group writes into. For a group of `n` members, with the peers of
//! member `i` numbered by [`crate::exchange_slot`]`(i, j)` (`k` below):
//!
//! ```text
//! flags: for each lane: ready[k] (u32, written by peer k), then ack[k] (u32, written
//!        by peer k), each on its own 64-byte line; the data area starts at the next
//!        4 KiB
//! data:  for each lane, for k in 0..n-1, for r in 0..depth: a slot of slot_bytes that
//!        peer k fills
//! ```
//!
//! A ring has one lane, or two when its communicator gathers (`CopySetup::gather_lane`):
//! then gathers use lane 1, with counters of their own, and exchanges lane 0, so an
//! exchange read in place (acknowledged by its combine, later) and a gather
//! (acknowledged at once) never share a slot counter. A ring takes `lanes · depth ·
//! slot_bytes · (n − 1)` bytes (plus 4 KiB of flags) on every member.
//!
//! # One exchange ([`schedule`])
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
//! for a flag nobody writes. A relay (a broadcast or an all-gather between ranks that
//! share a GPU and have no NCCL, `Plan::relay`) moves the root's buffer to every other
//! member, or every member's buffer to every other, under the same rules. (A single counter per ring, advanced for every piece, would
//! not do: once reduces with different roots are interleaved with other exchanges, a
//! pair's `t − depth` would name a piece that pair never moved, and the wait would never
//! end.) Received in place, a piece is neither copied out nor acknowledged in step 2
//! ([`Op::Keep`]): the combine reads it in the ring and acknowledges it.
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

use overlap_graph::{Collective, CollectiveKind};

use crate::exchange_slot;

#[cfg(test)]
mod tests;

/// Distance between two flags (each on its own cache line).
const FLAG_STRIDE: usize = 64;
/// Alignment of the data area and of the ring's total size.
const PAGE: usize = 4096;
/// Slot sizes are rounded up to this, so every piece starts aligned.
const SLOT_ALIGN: usize = 256;
/// Bytes of one element: exchanges move the f32 buffers as they are.
const ELEM: usize = 4;

/// Where things are in a ring (identical on every member of a group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Members other than the owner.
    peers: usize,
    /// Slots per peer.
    pub(crate) depth: usize,
    /// Bytes per slot (a multiple of [`SLOT_ALIGN`]).
    pub(crate) slot_bytes: usize,
    /// Bytes of the flags area (a multiple of [`PAGE`]).
    flags_bytes: usize,
    /// Bytes of the whole ring.
    pub(crate) bytes: usize,
    /// Lanes of the ring: independent sets of flags and slots (1, or 2 with a gather
    /// lane).
    pub(crate) lanes: usize,
    /// The lane this view addresses ([`Layout::lane`]; 0 for the ring's own layout).
    lane: usize,
}

impl Layout {
    pub(crate) fn new(
        size: u32,
        slot_bytes: usize,
        depth: usize,
        lanes: usize,
    ) -> Result<Layout, String> {
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
    pub(crate) fn lane(&self, lane: usize) -> Layout {
        debug_assert!(lane < self.lanes);
        Layout { lane, ..*self }
    }

    /// Offset of `ready[k]` (of this view's lane).
    pub(crate) fn ready(&self, k: usize) -> usize {
        debug_assert!(k < self.peers);
        (self.lane * 2 * self.peers + k) * FLAG_STRIDE
    }

    /// Offset of `ack[k]`.
    pub(crate) fn ack(&self, k: usize) -> usize {
        debug_assert!(k < self.peers);
        (self.lane * 2 * self.peers + self.peers + k) * FLAG_STRIDE
    }

    /// Offset of slot `slot` of peer `k`'s data.
    pub(crate) fn data(&self, k: usize, slot: usize) -> usize {
        debug_assert!(k < self.peers && slot < self.depth);
        self.flags_bytes + ((self.lane * self.peers + k) * self.depth + slot) * self.slot_bytes
    }
}

/// What one member moves in one exchange or gather: who sends to whom, and which chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    kind: Moves,
    pub(crate) size: u32,
    pub(crate) index: u32,
    /// The stage's collective (its count and kind give the chunks).
    desc: Collective,
    /// An exchange whose receives are copied out and acknowledged at once, like a
    /// gather's ([`Plan::at_once`]).
    at_once: bool,
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
    /// Broadcast (a relay): every other member gets the root's whole send buffer, at
    /// the start of its receive buffer.
    FromRoot(u32),
    /// All-gather (a relay): every member gets member `j`'s whole send buffer at `j ·
    /// count` of its receive buffer (its own place is the caller's local copy).
    All,
}

impl Plan {
    /// Member `index`'s part of an exchange of `desc` over `size` members.
    pub(crate) fn new(desc: &Collective, size: u32, index: u32) -> Result<Plan, String> {
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

    /// Member `index`'s part of a relay: a broadcast or an all-gather `desc` moved by
    /// the copy engines, for communicators without NCCL (several ranks on one GPU).
    /// Like a gather, a relay's receives are copied out and acknowledged at once.
    pub(crate) fn relay(desc: &Collective, size: u32, index: u32) -> Result<Plan, String> {
        let kind = match (desc.kind, desc.root) {
            (CollectiveKind::Broadcast, Some(root)) if root < size => Moves::FromRoot(root),
            (CollectiveKind::Broadcast, root) => {
                return Err(format!(
                    "root {root:?} is not a member index of {} ({size} members)",
                    desc.group
                ))
            }
            (CollectiveKind::AllGather, _) => Moves::All,
            (kind, _) => {
                return Err(format!(
                    "a {} reduces and is an exchange, not a relay",
                    kind.name()
                ))
            }
        };
        Plan::checked(kind, desc, size, index)
    }

    /// Member `index`'s part of the gather that completes an all-reduce `desc`.
    pub(crate) fn gather(desc: &Collective, size: u32, index: u32) -> Result<Plan, String> {
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
            at_once: false,
        })
    }

    /// The same moves, its receives copied out and acknowledged at once (on the gather
    /// lane of a ring read in place): for a reduction whose combine runs right after it
    /// (a collective on a communicator without NCCL), whose acknowledgements must not
    /// overtake the deferred ones of exchanges still waiting for their combines.
    pub(crate) fn at_once(self) -> Plan {
        Plan {
            at_once: true,
            ..self
        }
    }

    /// Whether this is an all-reduce's gather (which receives into its output).
    #[cfg(test)]
    pub(crate) fn is_gather(&self) -> bool {
        self.kind == Moves::Gather
    }

    /// Whether its receives are acknowledged at once (a gather or a relay): on a ring
    /// whose exchanges are read in place, it needs the gather lane, where its
    /// acknowledgements cannot overtake a combine's deferred ones.
    pub(crate) fn acks_at_once(&self) -> bool {
        self.at_once || matches!(self.kind, Moves::Gather | Moves::FromRoot(_) | Moves::All)
    }

    /// Chunk `j` as `(offset, len)` in bytes.
    fn chunk(&self, j: u32) -> (usize, usize) {
        let (at, len) = self.desc.member_chunk(self.size, j);
        // `checked` bounded `size · count · ELEM`.
        (at as usize * ELEM, len as usize * ELEM)
    }

    /// Whether member `from` sends to member `to` (`from ≠ to`).
    pub(crate) fn moves(&self, from: u32, to: u32) -> bool {
        from != to
            && match self.kind {
                Moves::Chunks | Moves::Gather | Moves::All => true,
                Moves::ToRoot(root) => to == root,
                Moves::FromRoot(root) => from == root,
            }
    }

    /// Bytes member `from` sends to member `to` (the same on both ends).
    pub(crate) fn bytes(&self, from: u32, to: u32) -> usize {
        match self.kind {
            Moves::Chunks => self.chunk(to).1,
            Moves::Gather => self.chunk(from).1,
            Moves::ToRoot(_) | Moves::FromRoot(_) | Moves::All => self.desc.count as usize * ELEM,
        }
    }

    /// Where what goes to member `to` starts in this member's send buffer, in bytes.
    fn send_offset(&self, to: u32) -> usize {
        match self.kind {
            Moves::Chunks => self.chunk(to).0,
            Moves::Gather => self.chunk(self.index).0,
            Moves::ToRoot(_) | Moves::FromRoot(_) | Moves::All => 0,
        }
    }

    /// Where member `from`'s data goes in this member's receive buffer, in bytes: its
    /// slot (the others in group order) of this member's chunk length; for a gather
    /// its own chunk's place; for a broadcast the start; for an all-gather its place in
    /// member order.
    fn recv_offset(&self, from: u32) -> usize {
        match self.kind {
            Moves::Gather => self.chunk(from).0,
            Moves::FromRoot(_) => 0,
            Moves::All => from as usize * self.desc.count as usize * ELEM,
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
pub(crate) struct Counters {
    pub(crate) sent: Vec<u64>,
    pub(crate) received: Vec<u64>,
}

impl Counters {
    pub(crate) fn new(peers: usize) -> Counters {
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
pub(crate) enum Op {
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
pub(crate) fn schedule(
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

/// One driver call of an exchange: a run of flag operations, or a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    Flags(Vec<Flag>),
    Copy(Op),
}

/// The driver calls that issue `ops` in order: each maximal run of flag operations
/// (`flag` maps an operation to its flag, `None` for a copy or a kept piece) is one call,
/// each copy one; a kept piece issues nothing and does not break a run.
pub(crate) fn calls(ops: &[Op], flag: impl Fn(Op) -> Option<Flag>) -> Vec<Call> {
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
pub(crate) enum Flag {
    /// Wait until the flag at the device address is at least the value (cyclic:
    /// `CU_STREAM_WAIT_VALUE_GEQ`).
    Wait(u64, u32),
    /// Write the value to the flag at the device address, after a memory barrier that
    /// makes every earlier write of the stream visible first.
    Write(u64, u32),
}
