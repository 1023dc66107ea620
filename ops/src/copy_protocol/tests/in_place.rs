//! The model checker of in-place receives: exchanges leave their pieces in the rings and
//! a combine per exchange reads them there and acknowledges them, placed as the
//! executor may place it; with all-reduces, a gather on the ring's own lane follows each
//! combine. Also the counter-examples: a combine queued too far behind, and gathers
//! sharing the exchanges' lane.

use super::*;

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
                    if self.rings[m][at..at + bytes] != self.sends[e][j as usize][src..src + bytes]
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
            let descs: Vec<Collective> = counts(seed * 613 + u64::from(n), 10, 64 * u64::from(n))
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
                    let mut sim = InPlaceSim::new(2, 256, depth, &descs, at, Gathers::SharedLane);
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
