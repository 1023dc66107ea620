//! The event loop of the simulation (module docs of [`super`]).

use std::collections::HashMap;

use overlap_graph::mesh::Group;
use overlap_graph::node::{Instr, NodeId, Op, Stream};
use overlap_graph::order::issue_order;
use overlap_graph::plan::{Plan, RankProgram};

use super::cost::{node_cost, Class, Cost};
use super::profile::Profile;
use super::{in_place_comms, NodeTime, Options, SimError, Simulation, Stage1Window};

/// The backward keeps at least this share of its rate beside communication.
const MIN_COMPUTE_RATE: f64 = 0.05;

/// One stream of one rank.
struct StreamSim {
    stream: Stream,
    instrs: Vec<Instr>,
    /// Per instruction: for a wait, whether its event's record was issued before it
    /// (otherwise it waits for nothing).
    live: Vec<bool>,
    ip: usize,
    /// Running a node, or waiting at a rendezvous for it.
    busy: bool,
}

/// A rendezvous: the communicator and the member's position on it.
type Comm = (Group, Stream);

/// One rank's host: it issues the rank's nodes in the host issue order, each costing
/// `host.issue_us_per_node`, and before a pack the Stage-1 window holds back it waits for
/// the completion of the nodes that free the buffer `window` packs earlier.
struct Host {
    /// The rank's nodes in the host issue order.
    runs: Vec<NodeId>,
    /// The position in `runs` of the next node to issue.
    next: usize,
    /// When the host issued its last node.
    t: f64,
    /// Per pack the window holds back: the nodes the host waits for before issuing it.
    waits: HashMap<NodeId, Vec<NodeId>>,
}

/// Work in progress: one node, or one collective's nodes on all its members.
struct Act {
    members: Vec<(u32, NodeId)>,
    class: Class,
    remaining: f64,
    rate: f64,
    /// How many times longer it takes beside the backward.
    stretch: f64,
}

struct Sim<'a> {
    plan: &'a Plan,
    profile: &'a Profile,
    streams: Vec<Vec<StreamSim>>,
    /// Per rank, per node: its stream's index in `streams[rank]`.
    stream_of: Vec<Vec<usize>>,
    /// Per rank, per node: when its host issued it (infinite until then).
    issued_at: Vec<Vec<f64>>,
    /// Per rank, per node: the device operations its host issues (`cost::launches`).
    launches: Vec<Vec<u32>>,
    hosts: Vec<Host>,
    costs: Vec<Vec<Cost>>,
    recorded: Vec<Vec<Option<f64>>>,
    times: Vec<Vec<Option<NodeTime>>>,
    /// Per rank, per node: whether it has completed.
    done: Vec<Vec<bool>>,
    /// Per rank, per node: the rendezvous it belongs to (communicator, sequence number).
    seq: Vec<Vec<Option<(Comm, u32)>>>,
    /// Per rank, per exchange node on an in-place communicator: the combine of the
    /// exchange `depth` earlier on that communicator, which frees its slot.
    slot_after: Vec<HashMap<NodeId, NodeId>>,
    arrived: HashMap<(Comm, u32), Vec<(u32, NodeId)>>,
    /// Rendezvous every member reached whose ring slot is not free yet.
    blocked: Vec<(Comm, u32)>,
    acts: Vec<Act>,
    now: f64,
    /// Per rank: the next host-issue time a stream waits for.
    wake: Vec<Option<f64>>,
    dirty: Vec<bool>,
    work: Vec<u32>,
}

/// Simulates one step of `plan` on the hardware `profile` describes (module docs).
pub fn simulate(plan: &Plan, profile: &Profile, opts: &Options) -> Result<Simulation, SimError> {
    profile.check()?;
    plan.check_well_formed()
        .map_err(|e| SimError::Plan(e.to_string()))?;
    if let Some(w) = &opts.stage1 {
        check_window(plan, w)?;
    }
    let in_place = in_place_comms(plan, opts.copy);
    let is_in_place =
        |c: &overlap_graph::node::Collective, s: Stream| in_place.contains(&(c.group, s));
    let mut sim = Sim::new(plan, profile);
    for rp in &plan.ranks {
        let costs = rp
            .nodes
            .iter()
            .map(|node| node_cost(plan, profile, opts, &is_in_place, rp.rank, node))
            .collect::<Result<Vec<Cost>, SimError>>()?;
        sim.add_rank(rp, costs, opts, &in_place);
    }
    sim.run()?;
    Ok(sim.into_simulation())
}

impl<'a> Sim<'a> {
    /// A simulation of `plan`'s ranks, none added yet, at time 0 with every rank to look at.
    fn new(plan: &'a Plan, profile: &'a Profile) -> Sim<'a> {
        let world = plan.ranks.len();
        Sim {
            plan,
            profile,
            streams: Vec::with_capacity(world),
            stream_of: Vec::with_capacity(world),
            issued_at: Vec::with_capacity(world),
            launches: Vec::with_capacity(world),
            hosts: Vec::with_capacity(world),
            costs: Vec::with_capacity(world),
            recorded: Vec::with_capacity(world),
            times: Vec::with_capacity(world),
            done: Vec::with_capacity(world),
            seq: Vec::with_capacity(world),
            slot_after: Vec::with_capacity(world),
            arrived: HashMap::new(),
            blocked: Vec::new(),
            acts: Vec::new(),
            now: 0.0,
            wake: vec![None; world],
            dirty: vec![true; world],
            work: (0..world as u32).collect(),
        }
    }

    /// Adds rank `rp`, its nodes costing `costs`: its streams, its host's issue order
    /// and Stage-1 waits, its rendezvous and its ring slots (`in_place`: the
    /// communicators whose combines read their exchanges in place).
    fn add_rank(&mut self, rp: &RankProgram, costs: Vec<Cost>, opts: &Options, in_place: &[Comm]) {
        let n = rp.nodes.len();
        let (runs, live) = host_issue(rp);
        let (streams, stream_of) = stream_sims(rp, live);
        let (seq, exchanges) = rendezvous(rp, &costs);
        let slot_after = ring_slots(rp, &exchanges, in_place, opts.copy.depth as usize);
        self.streams.push(streams);
        self.stream_of.push(stream_of);
        let waits = match &opts.stage1 {
            Some(w) => window_waits(rp, &runs, w),
            None => HashMap::new(),
        };
        self.issued_at.push(vec![f64::INFINITY; n]);
        self.launches.push(
            rp.nodes
                .iter()
                .map(|x| super::cost::launches(&x.op))
                .collect(),
        );
        self.hosts.push(Host {
            runs,
            next: 0,
            t: 0.0,
            waits,
        });
        self.costs.push(costs);
        self.recorded.push(vec![None; rp.events as usize]);
        self.times.push(vec![None; n]);
        self.done.push(vec![false; n]);
        self.seq.push(seq);
        self.slot_after.push(slot_after);
    }

    /// The simulated step: every node's times (a node that never ran: a marker at 0).
    fn into_simulation(self) -> Simulation {
        Simulation {
            ranks: self
                .times
                .into_iter()
                .map(|v| {
                    v.into_iter()
                        .map(|t| {
                            t.unwrap_or(NodeTime {
                                start: 0.0,
                                end: 0.0,
                                class: Class::Marker,
                            })
                        })
                        .collect()
                })
                .collect(),
        }
    }
}

/// Rank `rp`'s host issue: its nodes in the order the host issues them (each once its
/// host has issued everything before it and, past the Stage-1 window, the nodes that
/// free an earlier buffer have completed), and per stream, per instruction whether it
/// is live (a wait is when its event's record was issued before it).
fn host_issue(rp: &RankProgram) -> (Vec<NodeId>, Vec<Vec<bool>>) {
    let order = issue_order(rp);
    let mut runs = Vec::with_capacity(rp.nodes.len());
    let mut seen_record = vec![false; rp.events as usize];
    let mut pos = [0usize; Stream::COUNT];
    let mut index_of = [usize::MAX; Stream::COUNT];
    for (i, s) in rp.streams.iter().enumerate() {
        index_of[s.stream.index()] = i;
    }
    let mut live: Vec<Vec<bool>> = rp
        .streams
        .iter()
        .map(|s| vec![true; s.instrs.len()])
        .collect();
    for &(s, ins) in &order {
        let si = index_of[s.index()];
        let at = pos[si];
        pos[si] += 1;
        match ins {
            Instr::Run(id) => runs.push(id),
            Instr::Record(e) => seen_record[e as usize] = true,
            Instr::Wait(e) => live[si][at] = seen_record[e as usize],
        }
    }
    (runs, live)
}

/// Rank `rp`'s streams at their start, given each one's `live` instructions, and per
/// node the index of its stream.
fn stream_sims(rp: &RankProgram, mut live: Vec<Vec<bool>>) -> (Vec<StreamSim>, Vec<usize>) {
    let mut stream_of = vec![0usize; rp.nodes.len()];
    let mut streams = Vec::new();
    for (si, sp) in rp.streams.iter().enumerate() {
        for ins in &sp.instrs {
            if let Instr::Run(id) = *ins {
                stream_of[id as usize] = si;
            }
        }
        streams.push(StreamSim {
            stream: sp.stream,
            instrs: sp.instrs.clone(),
            live: std::mem::take(&mut live[si]),
            ip: 0,
            busy: false,
        });
    }
    (streams, stream_of)
}

/// Rank `rp`'s rendezvous: per node whose cost is a collective's, its communicator and
/// sequence number on it (in stream order), and per communicator its exchanges in order.
type Rendezvous = (Vec<Option<(Comm, u32)>>, HashMap<Comm, Vec<NodeId>>);

/// [`Rendezvous`] of rank `rp`, whose nodes cost `costs`.
fn rendezvous(rp: &RankProgram, costs: &[Cost]) -> Rendezvous {
    let mut seq = vec![None; rp.nodes.len()];
    let mut counters: HashMap<Comm, u32> = HashMap::new();
    let mut exchanges: HashMap<Comm, Vec<NodeId>> = HashMap::new();
    for sp in &rp.streams {
        for ins in &sp.instrs {
            let Instr::Run(id) = *ins else { continue };
            let node = &rp.nodes[id as usize];
            if !costs[id as usize].class.is_collective() {
                continue;
            }
            if let Some(c) = node.op.collective() {
                let comm = (c.group, sp.stream);
                let k = counters.entry(comm).or_insert(0);
                seq[id as usize] = Some((comm, *k));
                *k += 1;
                if matches!(node.op, Op::Exchange { .. }) {
                    exchanges.entry(comm).or_default().push(id);
                }
            }
        }
    }
    (seq, exchanges)
}

/// Rank `rp`'s ring slots: on each in-place communicator, the exchange `depth` later
/// than an exchange waits for that exchange's combine (exchange → combine).
fn ring_slots(
    rp: &RankProgram,
    exchanges: &HashMap<Comm, Vec<NodeId>>,
    in_place: &[Comm],
    depth: usize,
) -> HashMap<NodeId, NodeId> {
    let mut slot_after = HashMap::new();
    for (comm, list) in exchanges {
        if !in_place.contains(comm) {
            continue;
        }
        for (k, &x) in list.iter().enumerate().skip(depth) {
            let earlier = &rp.nodes[list[k - depth] as usize];
            if let Some(c) = combine_of(rp, earlier) {
                slot_after.insert(x, c);
            }
        }
    }
    slot_after
}

/// Refuses a Stage-1 window of 0 and releases that do not fit the plan.
fn check_window(plan: &Plan, w: &Stage1Window) -> Result<(), SimError> {
    if w.window == 0 {
        return Err(SimError::Options(
            "the Stage-1 window must be at least 1 buffer".into(),
        ));
    }
    if w.releases.len() != plan.ranks.len() {
        return Err(SimError::Options(format!(
            "the Stage-1 window's releases cover {} ranks, the plan has {}",
            w.releases.len(),
            plan.ranks.len()
        )));
    }
    for (rp, list) in plan.ranks.iter().zip(&w.releases) {
        let n = rp.nodes.len() as u32;
        for rel in list {
            if let Some(bad) = std::iter::once(rel.after)
                .chain(rel.nodes.iter().copied())
                .find(|&m| m >= n)
            {
                return Err(SimError::Options(format!(
                    "a Stage-1 release of rank {} (bucket {}, micro-batch {}) names node {bad}, but the rank has {n} nodes",
                    rp.rank, rel.bucket, rel.micro_batch
                )));
            }
        }
    }
    Ok(())
}

/// Per pack that the Stage-1 window holds back on rank `rp` (whose nodes the host issues
/// in the order `runs`): the nodes the host waits for before issuing it. As the executor
/// does (`rank.rs`, `backpressure`): the packs' buffers are in flight first in, first
/// out; before the `k`-th pack, with `window` in flight, the host lets go of the oldest,
/// the `(k − window)`-th, waiting for the releases of it that it has issued by then (a
/// release issued after that pack is never waited for).
fn window_waits(
    rp: &overlap_graph::plan::RankProgram,
    runs: &[NodeId],
    w: &Stage1Window,
) -> HashMap<NodeId, Vec<NodeId>> {
    let mut pos = vec![usize::MAX; rp.nodes.len()];
    for (i, &id) in runs.iter().enumerate() {
        pos[id as usize] = i;
    }
    let packs: Vec<(NodeId, (u32, u32))> = runs
        .iter()
        .filter_map(|&id| match rp.nodes[id as usize].op {
            Op::Pack {
                bucket,
                micro_batch,
                ..
            } => Some((id, (bucket, micro_batch))),
            _ => None,
        })
        .collect();
    let mut by_key: HashMap<(u32, u32), Vec<&super::Stage1Release>> = HashMap::new();
    if let Some(list) = w.releases.get(rp.rank as usize) {
        for rel in list {
            by_key
                .entry((rel.bucket, rel.micro_batch))
                .or_default()
                .push(rel);
        }
    }
    let window = w.window.max(1) as usize;
    let mut waits = HashMap::new();
    for k in window..packs.len() {
        let (pack, _) = packs[k];
        let (opened, key) = packs[k - window];
        let (from, to) = (pos[opened as usize], pos[pack as usize]);
        let mut nodes: Vec<NodeId> = by_key
            .get(&key)
            .into_iter()
            .flatten()
            .filter(|rel| (from..to).contains(&pos[rel.after as usize]))
            .flat_map(|rel| rel.nodes.iter().copied())
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        if !nodes.is_empty() {
            waits.insert(pack, nodes);
        }
    }
    waits
}

/// The combine of an exchange's stage on the same rank.
fn combine_of(
    rp: &overlap_graph::plan::RankProgram,
    exchange: &overlap_graph::node::Node,
) -> Option<NodeId> {
    let Op::Exchange {
        bucket,
        micro_batch,
        stage,
        ..
    } = exchange.op
    else {
        return None;
    };
    rp.nodes[exchange.id as usize..]
        .iter()
        .find(|n| {
            matches!(n.op, Op::Combine { bucket: b, micro_batch: m, stage: s, .. }
                if b == bucket && m == micro_batch && s == stage)
        })
        .map(|n| n.id)
}

impl Sim<'_> {
    fn run(&mut self) -> Result<(), SimError> {
        loop {
            while let Some(r) = self.work.pop() {
                self.dirty[r as usize] = false;
                self.advance(r)?;
            }
            if self
                .streams
                .iter()
                .flatten()
                .all(|s| s.ip >= s.instrs.len())
            {
                return Ok(());
            }
            self.rates();
            // The next event: an activity's completion or a host issue.
            let mut next = f64::INFINITY;
            let mut first = None;
            for (i, a) in self.acts.iter().enumerate() {
                let t = self.now + a.remaining / a.rate;
                if t < next {
                    next = t;
                    first = Some(i);
                }
            }
            let wake = self
                .wake
                .iter()
                .flatten()
                .copied()
                .fold(f64::INFINITY, f64::min);
            if wake < next {
                next = wake;
                first = None;
            }
            if !next.is_finite() {
                return Err(SimError::Stalled(self.stalled()));
            }
            let dt = next - self.now;
            for a in &mut self.acts {
                a.remaining -= a.rate * dt;
            }
            if let Some(i) = first {
                self.acts[i].remaining = 0.0;
            }
            self.now = next;
            for r in 0..self.wake.len() {
                if self.wake[r].is_some_and(|t| t <= self.now) {
                    self.wake[r] = None;
                    self.touch(r as u32);
                }
            }
            let mut done = Vec::new();
            let mut i = 0;
            while i < self.acts.len() {
                if self.acts[i].remaining <= 1e-15 {
                    done.push(self.acts.remove(i));
                } else {
                    i += 1;
                }
            }
            let freed_slot = !done.is_empty();
            for a in done {
                for &(r, n) in &a.members {
                    self.finish(r, n);
                }
            }
            if freed_slot && !self.blocked.is_empty() {
                let blocked = std::mem::take(&mut self.blocked);
                for key in blocked {
                    self.try_start(key);
                }
            }
        }
    }

    fn touch(&mut self, r: u32) {
        if !self.dirty[r as usize] {
            self.dirty[r as usize] = true;
            self.work.push(r);
        }
    }

    fn finish(&mut self, r: u32, n: NodeId) {
        let now = self.now;
        if let Some(t) = &mut self.times[r as usize][n as usize] {
            t.end = now;
        }
        self.done[r as usize][n as usize] = true;
        let si = self.stream_of[r as usize][n as usize];
        let s = &mut self.streams[r as usize][si];
        s.busy = false;
        s.ip += 1;
        self.touch(r);
    }

    /// Rank `r`'s host issues its nodes as far as it can (up to a pack whose Stage-1
    /// window waits for nodes not completed yet); whether it issued any.
    fn issue(&mut self, r: u32) -> bool {
        let ri = r as usize;
        let (first, further) = (
            self.profile.issue_us_per_node * 1e-6,
            self.profile.launch_us() * 1e-6,
        );
        let host = &mut self.hosts[ri];
        let start = host.next;
        while let Some(&n) = host.runs.get(host.next) {
            if let Some(wait) = host.waits.get(&n) {
                if !wait.iter().all(|&m| self.done[ri][m as usize]) {
                    break;
                }
                // The host goes on when the last of them completed (if after its clock).
                host.t = wait
                    .iter()
                    .filter_map(|&m| self.times[ri][m as usize].map(|t| t.end))
                    .fold(host.t, f64::max);
            }
            host.t += first + further * f64::from(self.launches[ri][n as usize] - 1);
            self.issued_at[ri][n as usize] = host.t;
            host.next += 1;
        }
        host.next > start
    }

    /// Runs rank `r`'s streams as far as they go at the current time.
    fn advance(&mut self, r: u32) -> Result<(), SimError> {
        let ri = r as usize;
        loop {
            let mut progressed = self.issue(r);
            for si in 0..self.streams[ri].len() {
                loop {
                    let s = &self.streams[ri][si];
                    if s.busy || s.ip >= s.instrs.len() {
                        break;
                    }
                    match s.instrs[s.ip] {
                        Instr::Record(e) => {
                            self.recorded[ri][e as usize] = Some(self.now);
                            self.streams[ri][si].ip += 1;
                            progressed = true;
                        }
                        Instr::Wait(e) => {
                            if s.live[s.ip] {
                                let Some(at) = self.recorded[ri][e as usize] else {
                                    break;
                                };
                                let at = at + self.profile.event_us * 1e-6;
                                if at > self.now {
                                    let w = &mut self.wake[ri];
                                    *w = Some(w.map_or(at, |x| x.min(at)));
                                    break;
                                }
                            }
                            self.streams[ri][si].ip += 1;
                            progressed = true;
                        }
                        Instr::Run(n) => {
                            let at = self.issued_at[ri][n as usize];
                            if at > self.now {
                                // Not issued yet (the host waits for the window): the
                                // completion it waits for wakes the rank.
                                if at.is_finite() {
                                    let w = &mut self.wake[ri];
                                    *w = Some(w.map_or(at, |x| x.min(at)));
                                }
                                break;
                            }
                            progressed = true;
                            self.start(r, n);
                        }
                    }
                }
            }
            if !progressed {
                return Ok(());
            }
        }
    }

    /// Rank `r`'s stream reaches node `n`.
    fn start(&mut self, r: u32, n: NodeId) {
        let ri = r as usize;
        let cost = self.costs[ri][n as usize];
        self.times[ri][n as usize] = Some(NodeTime {
            start: self.now,
            end: self.now,
            class: cost.class,
        });
        let si = self.stream_of[ri][n as usize];
        match self.seq[ri][n as usize] {
            Some(key) => {
                self.streams[ri][si].busy = true;
                let list = self.arrived.entry(key).or_default();
                list.push((r, n));
                if list.len() as u32 == self.plan.mesh.group_size(key.0 .0) {
                    self.try_start(key);
                }
            }
            None if cost.class == Class::Marker || cost.seconds <= 0.0 => {
                self.done[ri][n as usize] = true;
                self.streams[ri][si].ip += 1;
            }
            None => {
                self.streams[ri][si].busy = true;
                self.acts.push(Act {
                    members: vec![(r, n)],
                    class: cost.class,
                    remaining: cost.seconds,
                    rate: 1.0,
                    stretch: self.stretch(&cost),
                });
            }
        }
    }

    /// Starts a rendezvous every member has reached, unless a ring slot holds it back.
    fn try_start(&mut self, key: (Comm, u32)) {
        let Some(members) = self.arrived.get(&key) else {
            return;
        };
        let slot_free = members.iter().all(|&(r, n)| {
            self.slot_after[r as usize]
                .get(&n)
                .map_or(true, |&c| self.done[r as usize][c as usize])
        });
        if !slot_free {
            if !self.blocked.contains(&key) {
                self.blocked.push(key);
            }
            return;
        }
        let members = self.arrived.remove(&key).unwrap_or_default();
        // The slowest member's side sets the work.
        let cost = members
            .iter()
            .map(|&(r, n)| self.costs[r as usize][n as usize])
            .fold(None, |best: Option<Cost>, c| match best {
                Some(b) if b.seconds >= c.seconds => Some(b),
                _ => Some(c),
            })
            .unwrap_or(Cost {
                class: Class::Marker,
                seconds: 0.0,
                local_seconds: 0.0,
            });
        let (work, class) = (cost.seconds, cost.class);
        if work <= 0.0 {
            for &(r, n) in &members {
                self.finish(r, n);
            }
            return;
        }
        let stretch = self.stretch(&cost);
        self.acts.push(Act {
            members,
            class,
            remaining: work,
            rate: 1.0,
            stretch,
        });
    }

    /// How many times longer work of this cost takes beside the backward.
    fn stretch(&self, c: &Cost) -> f64 {
        let p = self.profile;
        match c.class {
            Class::Nccl => p.nccl_beside.stretch,
            Class::Memory => p.combine_beside.stretch,
            Class::Copy if c.seconds > 0.0 => {
                let local = c.local_seconds.min(c.seconds);
                ((c.seconds - local) * p.copy_beside.stretch + local * p.copy_local_stretch)
                    / c.seconds
            }
            _ => 1.0,
        }
    }

    /// The rates of every activity at the current time (module docs of [`super`]).
    fn rates(&mut self) {
        let world = self.streams.len();
        let mut count = vec![[0u32; 5]; world];
        for a in &self.acts {
            for &(r, _) in &a.members {
                count[r as usize][a.class as usize] += 1;
            }
        }
        let p = self.profile;
        let mut loss = vec![0.0f64; world];
        for a in self.acts.iter_mut().filter(|a| a.class != Class::Compute) {
            let beside = match a.class {
                Class::Nccl => p.nccl_beside,
                Class::Copy => p.copy_beside,
                _ => p.combine_beside,
            };
            let mut rate = f64::INFINITY;
            for &(r, _) in &a.members {
                let c = &count[r as usize];
                let share = match a.class {
                    Class::Copy => {
                        (f64::from(p.ce_concurrency) / f64::from(c[Class::Copy as usize])).min(1.0)
                    }
                    k => 1.0 / f64::from(c[k as usize].max(1)),
                };
                let stretch = if c[Class::Compute as usize] > 0 {
                    a.stretch
                } else {
                    1.0
                };
                rate = rate.min(share / stretch);
            }
            a.rate = rate;
            for &(r, _) in &a.members {
                loss[r as usize] += beside.gemm_cost * rate;
            }
        }
        for a in self.acts.iter_mut().filter(|a| a.class == Class::Compute) {
            let (r, _) = a.members[0];
            let c = &count[r as usize];
            a.rate = (1.0 - loss[r as usize]).max(MIN_COMPUTE_RATE)
                / f64::from(c[Class::Compute as usize].max(1));
        }
    }

    /// What each unfinished stream is stuck on.
    fn stalled(&self) -> String {
        let mut out = Vec::new();
        for (r, streams) in self.streams.iter().enumerate() {
            for s in streams {
                if s.ip >= s.instrs.len() {
                    continue;
                }
                let what = match s.instrs[s.ip] {
                    Instr::Wait(e) => format!("waits for event {e}, never recorded"),
                    Instr::Run(n) if !self.issued_at[r][n as usize].is_finite() => {
                        let node = &self.plan.ranks[r].nodes[n as usize];
                        let host = &self.hosts[r];
                        let pack = host.runs.get(host.next).copied().unwrap_or(n);
                        let pending: Vec<String> = host
                            .waits
                            .get(&pack)
                            .into_iter()
                            .flatten()
                            .filter(|&&m| !self.done[r][m as usize])
                            .map(|m| m.to_string())
                            .collect();
                        format!(
                            "node {n} ({}) is not issued: the host waits for the Stage-1 window before node {pack}, for nodes {}",
                            self.plan.label(node),
                            pending.join(", ")
                        )
                    }
                    Instr::Run(n) => {
                        let node = &self.plan.ranks[r].nodes[n as usize];
                        format!(
                            "node {n} ({}) waits for the other members of its communicator",
                            self.plan.label(node)
                        )
                    }
                    Instr::Record(_) => "cannot record".into(),
                };
                out.push(format!("rank {r} stream {}: {what}", s.stream));
            }
        }
        out.truncate(8);
        out.join("; ")
    }
}
