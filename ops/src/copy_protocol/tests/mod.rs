//! The protocol's unit tests: the ring layout, who sends what to whom, how messages
//! become pieces and counters, and how flag operations are grouped into driver calls.
//! The model checker runs whole schedules: `model.rs` (receives copied out) and
//! `in_place.rs` (combines that read the ring in place).

use super::*;
use crate::tests::coll as desc;

mod in_place;
mod model;

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
    assert!(g.is_gather() && !ar.is_gather() && !rs.is_gather());
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
fn a_relay_moves_the_roots_buffer_or_every_members_whole_buffer() {
    let b = Plan::relay(&desc(CollectiveKind::Broadcast, 5, Some(2)), 3, 0).unwrap();
    assert!(b.moves(2, 0) && b.moves(2, 1) && !b.moves(0, 2) && !b.moves(0, 1));
    assert!(b.acks_at_once() && !b.is_gather());
    assert_eq!(
        (b.bytes(2, 0), b.send_offset(1), b.recv_offset(2)),
        (20, 0, 0)
    );
    let g = Plan::relay(&desc(CollectiveKind::AllGather, 5, None), 3, 1).unwrap();
    assert!(g.moves(0, 1) && g.moves(1, 2) && g.moves(2, 0) && !g.moves(1, 1));
    assert_eq!((g.bytes(0, 1), g.send_offset(2)), (20, 0));
    assert_eq!((g.recv_offset(0), g.recv_offset(2)), (0, 40));
    // An exchange's plan is not a relay, nor the reverse.
    let ar = Plan::new(&desc(CollectiveKind::AllReduce, 5, None), 3, 0).unwrap();
    assert!(!ar.acks_at_once() && ar.at_once().acks_at_once());
    assert_eq!(ar.at_once().bytes(1, 0), ar.bytes(1, 0));
    assert!(Plan::relay(&desc(CollectiveKind::AllReduce, 5, None), 3, 0).is_err());
    assert!(Plan::relay(&desc(CollectiveKind::Broadcast, 5, Some(3)), 3, 0).is_err());
    assert!(Plan::relay(&desc(CollectiveKind::Broadcast, 5, None), 3, 0).is_err());
    // A broadcast's pieces advance only the root's pairs.
    let l = Layout::new(3, 256, 2, 1).unwrap();
    let mut c = Counters::new(2);
    let ops = schedule(&b, &l, &mut c, false);
    assert_eq!(c.received, vec![0, 1]);
    assert_eq!(c.sent, vec![0, 0]);
    assert!(ops.iter().all(|op| !matches!(op, Op::Send { .. })));
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
            Op::WaitAck { value, .. } | Op::WaitReady { value, .. } => Some(Flag::Wait(at, value)),
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

/// A model `Send`: `data` from member `me` lands in `peer`'s ring, `me`'s slot `ring`.
fn deliver(rings: &mut [Vec<u8>], l: &Layout, me: u32, (peer, ring): (u32, usize), data: &[u8]) {
    let at = l.data(exchange_slot(peer, me), ring);
    rings[peer as usize][at..at + data.len()].copy_from_slice(data);
}

/// A model `Take`: member `me` copies `peer`'s piece in its ring slot `ring` to `out`.
fn take(rings: &[Vec<u8>], l: &Layout, me: u32, (peer, ring): (u32, usize), out: &mut [u8]) {
    let at = l.data(exchange_slot(me, peer), ring);
    out.copy_from_slice(&rings[me as usize][at..at + out.len()]);
}
