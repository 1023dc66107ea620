//! The model checker of copied-out receives: every member's schedule runs on rings,
//! flags and buffers in host memory, every operation atomic, the members interleaved at
//! random or greedily; every receive buffer must end holding what the contract of
//! `Kernel::Exchange` (or of `Kernel::Gather`) says, and nothing may deadlock.

use super::*;

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
            if is_relay(&plans[0].desc) {
                wrong.extend(self.relay_mismatches(e));
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

    /// A relay's receive buffers against the collective's contract, independently of
    /// `Plan`: a broadcast's non-roots hold the root's buffer, an all-gather's members
    /// member `j`'s buffer at `j · count` for every other `j`.
    fn relay_mismatches(&self, e: usize) -> Vec<String> {
        let d = self.plans[e][0].desc;
        let n = self.plans[e].len();
        let c = d.count as usize * ELEM;
        let mut wrong = Vec::new();
        for i in 0..n {
            let froms: Vec<usize> = match d.root {
                Some(root) if d.kind == CollectiveKind::Broadcast => vec![root as usize],
                _ => (0..n).collect(),
            };
            for j in froms.into_iter().filter(|&j| j != i) {
                let at = if d.kind == CollectiveKind::Broadcast {
                    0
                } else {
                    j * c
                };
                if self.recvs[e][i][at..at + c] != self.sends[e][j][..c] {
                    wrong.push(format!(
                        "{} {e}: member {i}'s copy of member {j}'s buffer",
                        d.kind.name()
                    ));
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
            let relay = !gather && is_relay(d);
            let roles = if relay {
                crate::collective_roles(d, n, i).unwrap()
            } else {
                crate::copy_roles(d, n, i, gather).unwrap().0
            };
            let plan = if gather {
                Plan::gather(d, n, i).unwrap()
            } else if relay {
                Plan::relay(d, n, i).unwrap()
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

/// Twelve random exchanges (with `relays`, broadcasts and all-gathers among them);
/// each all-reduce's gather follows it, at once or after the next exchange (as a
/// combine lag places it).
fn mixed(n: u32, seed: u64, relays: bool) -> Vec<(Collective, bool)> {
    let mut s = seed;
    let mut out = Vec::new();
    let mut pending: Option<Collective> = None;
    for _ in 0..12 {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let count = (s >> 33) % 600;
        let d = match (s >> 20) % 6 {
            0 => desc(CollectiveKind::ReduceScatter, count, None),
            1 => desc(CollectiveKind::AllReduce, count, None),
            2 if relays => desc(
                CollectiveKind::Broadcast,
                count,
                Some(((s >> 40) % u64::from(n)) as u32),
            ),
            3 if relays => desc(CollectiveKind::AllGather, count, None),
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

/// Whether `d` moves no reduction: a broadcast or an all-gather (a relay).
fn is_relay(d: &Collective) -> bool {
    matches!(
        d.kind,
        CollectiveKind::Broadcast | CollectiveKind::AllGather
    )
}

fn exchanges(descs: &[Collective]) -> Vec<(Collective, bool)> {
    descs.iter().map(|&d| (d, false)).collect()
}

#[test]
fn every_interleaving_delivers_every_chunk_without_deadlock() {
    for n in 2..=4 {
        for depth in 1..=3 {
            for seed in 1..=25u64 {
                let descs = mixed(n, seed * 7919 + u64::from(n), seed % 2 == 0);
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
    let descs = mixed(3, 99, true);
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
