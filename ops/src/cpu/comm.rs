//! Communicators: one rendezvous per group of the mesh and stream, shared by the stream
//! threads of its members.
//!
//! Each member numbers its calls; call `k` of every member meets in one [`Round`]. The
//! last member to arrive checks that every member issued the same call and then
//! computes every member's output (reading all inputs before writing any output, so a
//! send buffer may be its recv buffer); the others wait, with a timeout.
//!
//! A call is a collective ([`crate::Kernel::Collective`]) or a copy-transport exchange
//! or gather ([`crate::Kernel::Exchange`], [`crate::Kernel::Gather`]): all share the
//! numbering, the rendezvous, the failure handling and the timeout, and a round where
//! some members issued an exchange and others a collective is a disagreement like any
//! other.
//!
//! Members may live in other processes ([`super::CpuBackend::one_rank`]): then a local
//! member's arrival is also sent to every remote member ([`super::remote`]), and each
//! remote member's arrival, received by a reader thread, is deposited here as if that
//! member had arrived in this process (its send buffer a copy, no receive buffer). Every
//! process thus completes each round from the same arrivals in member order with the
//! same code, and writes only its own members' outputs: the numbers are those of the
//! in-process rendezvous, bit for bit. Remote arrivals carry the sender's generation
//! (its count of `reset`s); one of a later generation waits until this process resets
//! as often.
//!
//! Invariants: a round completes exactly once, with one result per member, and every
//! local member that arrived is released with its result: on success, on a
//! disagreement, on a member that could not take part (it still arrives, so peers never
//! hang), on timeout, on a remote member whose connection closed (at once, naming it),
//! on `reset`, on `abort` and on shutdown. Reductions add members in group-index order,
//! so results are deterministic.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use overlap_graph::{Collective, CollectiveKind, DType, ReduceOp, Stream};

use super::buffer::CpuBuffer;
use super::kernels::expect;
use super::lock;
use super::remote::Outbox;
use crate::math::round_bf16;
use crate::{CommId, OpsError};

/// What a member calls on a communicator: the collective `desc`, or the copy-transport
/// exchange of `desc` (the moving half of the reduction, without arithmetic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    /// [`crate::Kernel::Collective`].
    Collective,
    /// [`crate::Kernel::Exchange`].
    Exchange,
    /// [`crate::Kernel::Gather`] (its buffer is the arrival's `send`).
    Gather,
}

impl Call {
    /// The kernel name, for errors: the collective's kind (`reduce_scatter`, ...) or
    /// `exchange`.
    pub(super) fn kernel(self, desc: &Collective) -> &'static str {
        match self {
            Call::Collective => desc.kind.name(),
            Call::Exchange => "exchange",
            Call::Gather => "gather",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Call::Collective => "a collective",
            Call::Exchange => "a copy-transport exchange",
            Call::Gather => "a copy-transport gather",
        }
    }
}

/// One member's call as it arrives at the rendezvous.
pub(super) struct Arrival {
    /// Whether the member issued the collective or its exchange.
    pub(super) call: Call,
    /// What the member issued.
    pub(super) desc: Collective,
    /// Its input.
    pub(super) send: Option<CpuBuffer>,
    /// Its output.
    pub(super) recv: Option<CpuBuffer>,
    /// Why the member cannot take part (its stream is poisoned, or its call is invalid).
    pub(super) failed: Option<Failure>,
}

/// Why a member cannot take part in a call.
#[derive(Debug, Clone)]
pub(super) enum Failure {
    /// A member of this process: its error, which is its result.
    Local(OpsError),
    /// A member of another process: its error in words (its result is that process's).
    Remote(String),
}

impl Failure {
    /// The member's own result.
    fn error(&self) -> OpsError {
        match self {
            Failure::Local(e) => e.clone(),
            Failure::Remote(why) => OpsError::Cancelled(why.clone()),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Local(e) => e.fmt(f),
            Failure::Remote(why) => f.write_str(why),
        }
    }
}

/// What stops every wait of a backend's communicators.
#[derive(Debug, Default)]
pub(super) struct Halt {
    /// The backend is being dropped.
    pub(super) shutdown: AtomicBool,
    /// [`crate::Backend::abort`] was called (a multi-process backend only).
    pub(super) aborted: AtomicBool,
}

impl Halt {
    /// Why waits must end now, if they must.
    fn reason(&self) -> Option<&'static str> {
        if self.shutdown.load(Ordering::Acquire) {
            Some("the backend shut down")
        } else if self.aborted.load(Ordering::Acquire) {
            Some("the backend was aborted (a rank of the job failed or a step timed out)")
        } else {
            None
        }
    }
}

/// A communicator of one group bound to one stream.
pub(super) struct Comm {
    id: CommId,
    /// Global ranks by index within the group.
    members: Vec<u32>,
    /// Whether each member (by index) is driven by this backend.
    local: Vec<bool>,
    /// Members that leave each round: the local ones.
    locals: usize,
    /// Where local arrivals go when some members live in other processes.
    outbox: Option<Outbox>,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// Bumped by `reset`, so a waiter of an abandoned round notices.
    generation: u64,
    /// Per member index, the number of its next call.
    next_call: Vec<u64>,
    /// Calls some member has arrived at and not every local member has left.
    rounds: HashMap<u64, Round>,
    /// Remote arrivals of a later generation than this process's, in arrival order:
    /// `(generation, member index, call, arrival)`.
    later: Vec<(u64, usize, u64, Arrival)>,
    /// Per member index, why it can no longer arrive (its connection closed).
    lost: Vec<Option<String>>,
}

/// One call number's meeting.
struct Round {
    /// By member index; taken when the round completes.
    arrivals: Vec<Option<Arrival>>,
    arrived: usize,
    /// Set once: every member's result.
    results: Option<Vec<Result<(), OpsError>>>,
    departed: usize,
}

impl Comm {
    /// A communicator whose members `is_local` says this backend drives; the others
    /// (if any) are reached through `outbox`.
    pub(super) fn new(
        id: CommId,
        members: Vec<u32>,
        is_local: impl Fn(u32) -> bool,
        outbox: Option<Outbox>,
    ) -> Comm {
        let state = State {
            generation: 0,
            next_call: vec![0; members.len()],
            rounds: HashMap::new(),
            later: Vec::new(),
            lost: vec![None; members.len()],
        };
        let local: Vec<bool> = members.iter().map(|&r| is_local(r)).collect();
        Comm {
            id,
            locals: local.iter().filter(|&&l| l).count(),
            local,
            members,
            outbox,
            state: Mutex::new(state),
            changed: Condvar::new(),
        }
    }

    /// A rank's index within the group.
    pub(super) fn index_of(&self, rank: u32) -> Option<usize> {
        self.members.iter().position(|&r| r == rank)
    }

    /// Checks one member's call against the communicator and the buffers its role needs
    /// ([`crate::collective_roles`], or [`crate::exchange_roles`] for an exchange);
    /// returns the bytes the member moves: for a collective, what it contributes (the
    /// dtype's size times `n·count` for reduce-scatter, `count` otherwise); for an
    /// exchange, what it receives (its f32 receive buffer, `(n − 1)·count` elements or
    /// nothing).
    pub(super) fn check(
        &self,
        stream: Stream,
        index: usize,
        call: Call,
        desc: &Collective,
        send: Option<&CpuBuffer>,
        recv: Option<&CpuBuffer>,
    ) -> Result<u64, OpsError> {
        let kernel = call.kernel(desc);
        let shape = |reason: String| OpsError::Shape { kernel, reason };
        if desc.group != self.id.group || stream != self.id.stream {
            return Err(shape(format!(
                "{} on {} issued from the {stream} stream cannot use communicator {}",
                call.describe(),
                desc.group,
                self.id
            )));
        }
        let n = self.members.len();
        let rank = self.members[index];
        let (roles, received) = match call {
            Call::Collective => {
                crate::collective_roles(desc, n as u32, index as u32).map(|r| (r, 0))
            }
            Call::Exchange | Call::Gather => {
                crate::copy_roles(desc, n as u32, index as u32, call == Call::Gather)
            }
        }
        .map_err(shape)?;
        let (want_send, want_recv) = (roles.send, roles.recv);
        for (what, buf, want) in [("send", send, want_send), ("recv", recv, want_recv)] {
            match (buf, want) {
                (None, None) => {}
                (Some(buf), Some(len)) => expect(kernel, rank, what, buf, len)?,
                (None, Some(len)) => {
                    return Err(shape(format!(
                        "member {index} (rank {rank}) needs a {what} buffer of {len} elements"
                    )))
                }
                (Some(buf), None) => {
                    return Err(shape(format!(
                        "member {index} (rank {rank}) takes no {what} buffer, got {buf:?}"
                    )))
                }
            }
        }
        Ok(match call {
            Call::Collective => want_send.unwrap_or(desc.count as usize) as u64 * desc.dtype.size(),
            // The copy transport moves the f32 buffers as they are (no bf16 wire format).
            Call::Exchange | Call::Gather => received as u64 * 4,
        })
    }

    /// Takes part in the member's next call: deposits the arrival and waits until the
    /// round has a result for it, or `timeout` passes (which fails the round for all).
    pub(super) fn call(
        &self,
        index: usize,
        arrival: Arrival,
        timeout: Duration,
        halt: &Halt,
    ) -> Result<(), OpsError> {
        let deadline = Instant::now().checked_add(timeout);
        if let Some(outbox) = &self.outbox {
            // Outside the lock: a send may wait for a peer, whose reader thread may be
            // waiting for a lock of its own process, never for this one.
            let (generation, call) = {
                let st = lock(&self.state);
                (st.generation, st.next_call[index])
            };
            let remote = (self.members.iter().zip(&self.local))
                .filter(|(_, &local)| !local)
                .map(|(&rank, _)| rank);
            let at = (generation, call);
            outbox.send(self.id, remote, self.members[index], at, &arrival);
        }
        let mut st = lock(&self.state);
        let generation = st.generation;
        let call = self.arrive(&mut st, index, arrival);
        loop {
            if let Some(why) = halt.reason() {
                return Err(OpsError::Cancelled(format!(
                    "{}: {why} during call #{call}",
                    self.id
                )));
            }
            if st.generation != generation {
                return Err(OpsError::Cancelled(format!(
                    "{}: the backend was reset during call #{call}",
                    self.id
                )));
            }
            let st_ = &mut *st;
            let Some(round) = st_.rounds.get_mut(&call) else {
                return Err(OpsError::Cancelled(format!(
                    "{}: call #{call} was abandoned",
                    self.id
                )));
            };
            if round.results.is_none() {
                self.fail_if_lost(round, call, &st_.lost);
            }
            if let Some(results) = &mut round.results {
                let result = std::mem::replace(&mut results[index], Ok(()));
                round.departed += 1;
                if round.departed == self.locals {
                    st_.rounds.remove(&call);
                }
                return result;
            }
            let now = Instant::now();
            match deadline {
                Some(deadline) if now >= deadline => self.time_out(round, call, timeout),
                Some(deadline) => {
                    st = self
                        .changed
                        .wait_timeout(st, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// Deposits the member's `arrival` at the round of its next call, completing the
    /// round when it is the last to arrive; returns the call's number.
    fn arrive(&self, st: &mut State, index: usize, arrival: Arrival) -> u64 {
        let call = st.next_call[index];
        st.next_call[index] += 1;
        self.deposit(st, index, call, arrival);
        call
    }

    /// Deposits member `index`'s arrival at call `call`'s round, completing the round
    /// when it is the last to arrive. A late arrival at a round that already failed
    /// only collects its result; a second arrival of one member (a remote peer's
    /// protocol error) is ignored.
    fn deposit(&self, st: &mut State, index: usize, call: u64, arrival: Arrival) {
        let n = self.members.len();
        let round = st.rounds.entry(call).or_insert_with(|| Round {
            arrivals: (0..n).map(|_| None).collect(),
            arrived: 0,
            results: None,
            departed: 0,
        });
        if round.results.is_none() && round.arrivals[index].is_none() {
            round.arrivals[index] = Some(arrival);
            round.arrived += 1;
            if round.arrived == n {
                let arrivals: Vec<Arrival> = round.arrivals.drain(..).flatten().collect();
                round.results = Some(self.complete(call, &arrivals));
                self.changed.notify_all();
            }
        }
    }

    /// Deposits a remote member's arrival at call `call` of its `generation` (its count
    /// of resets): now when it is this process's generation, after this process's next
    /// resets when it is later, never when it is earlier (a round this process
    /// abandoned). Errors name what does not fit (the member is not remote here).
    pub(super) fn deposit_remote(
        &self,
        index: usize,
        (generation, call): (u64, u64),
        arrival: Arrival,
    ) -> Result<(), String> {
        if self.local.get(index) != Some(&false) {
            return Err(format!(
                "an arrival at {} as member {index}, which is not a remote member here",
                self.id
            ));
        }
        let mut st = lock(&self.state);
        match generation.cmp(&st.generation) {
            std::cmp::Ordering::Less => {}
            std::cmp::Ordering::Greater => st.later.push((generation, index, call, arrival)),
            std::cmp::Ordering::Equal => self.deposit(&mut st, index, call, arrival),
        }
        Ok(())
    }

    /// Member `index` (remote) can no longer arrive: every round still missing its
    /// arrival, and every later one, fails on the local members at once with `why`.
    pub(super) fn member_lost(&self, index: usize, why: &str) {
        let mut st = lock(&self.state);
        if let Some(slot) = st.lost.get_mut(index).filter(|l| l.is_none()) {
            *slot = Some(why.to_string());
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Fails `round` (call `call`, not complete) when a member that has not arrived was
    /// lost, naming it.
    fn fail_if_lost(&self, round: &mut Round, call: u64, lost: &[Option<String>]) {
        let why = round
            .arrivals
            .iter()
            .zip(lost)
            .find_map(|(a, l)| l.as_ref().filter(|_| a.is_none()));
        if let Some(why) = why {
            let err = OpsError::Collective {
                comm: self.id.to_string(),
                reason: format!("call #{call}: {why}"),
            };
            round.arrivals.clear();
            round.results = Some(vec![Err(err); self.members.len()]);
            self.changed.notify_all();
        }
    }

    /// Fails call `call`'s round for every member, naming those that did not arrive
    /// within `timeout`, and wakes the waiters.
    fn time_out(&self, round: &mut Round, call: u64, timeout: Duration) {
        let missing: Vec<u32> = (round.arrivals.iter().zip(&self.members))
            .filter(|(a, _)| a.is_none())
            .map(|(_, &r)| r)
            .collect();
        let err = OpsError::Collective {
            comm: self.id.to_string(),
            reason: format!(
                "call #{call} timed out after {timeout:?}: ranks {missing:?} did not arrive"
            ),
        };
        round.arrivals.clear();
        round.results = Some(vec![Err(err); self.members.len()]);
        self.changed.notify_all();
    }

    /// Abandons every round and restarts call numbering (the backend's `reset`).
    /// Remote arrivals of the new generation, held until now, are deposited.
    pub(super) fn reset(&self) {
        let mut st = lock(&self.state);
        st.generation += 1;
        st.next_call.fill(0);
        st.rounds.clear();
        let generation = st.generation;
        let later = std::mem::take(&mut st.later);
        for (g, index, call, arrival) in later {
            match g.cmp(&generation) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Greater => st.later.push((g, index, call, arrival)),
                std::cmp::Ordering::Equal => self.deposit(&mut st, index, call, arrival),
            }
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Wakes every waiter so it can notice shutdown or an abort (taking the lock orders
    /// the wake-up after any waiter's check of the flag).
    pub(super) fn wake_all(&self) {
        let _st = lock(&self.state);
        self.changed.notify_all();
    }

    /// Every member's result of a round all members arrived at, computing the outputs
    /// when every member could take part and all issued the same collective.
    fn complete(&self, call: u64, arrivals: &[Arrival]) -> Vec<Result<(), OpsError>> {
        let failed = arrivals
            .iter()
            .zip(&self.members)
            .find_map(|(a, &rank)| Some((rank, a.failed.as_ref()?)));
        if let Some((rank, cause)) = failed {
            let peer = OpsError::Cancelled(format!(
                "{} call #{call}: rank {rank} could not take part: {cause}",
                self.id
            ));
            return arrivals
                .iter()
                .map(|a| {
                    Err(a
                        .failed
                        .as_ref()
                        .map_or_else(|| peer.clone(), Failure::error))
                })
                .collect();
        }
        if let Some(reason) = self.mismatch(arrivals) {
            let err = OpsError::Collective {
                comm: self.id.to_string(),
                reason: format!("call #{call}: {reason}"),
            };
            return vec![Err(err); arrivals.len()];
        }
        match arrivals[0].call {
            Call::Collective => execute(arrivals),
            Call::Exchange => exchange(arrivals),
            Call::Gather => gather(arrivals),
        }
        vec![Ok(()); arrivals.len()]
    }

    /// How the first member whose call differs from member 0's differs (an exchange
    /// where member 0 issued the collective of the same `desc`, or the reverse, is a
    /// difference).
    fn mismatch(&self, arrivals: &[Arrival]) -> Option<String> {
        let head = arrivals.first()?;
        let (first, call) = (&head.desc, head.call);
        let (other, rank) = arrivals
            .iter()
            .zip(&self.members)
            .find(|(a, _)| a.desc != *first || a.call != call)?;
        let d = &other.desc;
        let fields = [
            (other.call != call).then(|| {
                format!(
                    "{} vs {} (of {} on {})",
                    call.describe(),
                    other.call.describe(),
                    first.kind.name(),
                    first.group
                )
            }),
            (d.kind != first.kind)
                .then(|| format!("kind {} vs {}", first.kind.name(), d.kind.name())),
            (d.group != first.group).then(|| format!("group {} vs {}", first.group, d.group)),
            (d.count != first.count).then(|| format!("count {} vs {}", first.count, d.count)),
            (d.dtype != first.dtype).then(|| format!("dtype {:?} vs {:?}", first.dtype, d.dtype)),
            (d.op != first.op).then(|| format!("op {:?} vs {:?}", first.op, d.op)),
            (d.root != first.root).then(|| format!("root {:?} vs {:?}", first.root, d.root)),
        ];
        let diff: Vec<String> = fields.into_iter().flatten().collect();
        Some(format!(
            "rank {} and rank {rank} issued different collectives: {}",
            self.members[0],
            diff.join(", ")
        ))
    }
}

/// Moves every member's chunks of a validated, agreed exchange ([`crate::Kernel::Exchange`]):
/// member `i`'s receive buffer gets, at slot [`crate::exchange_slot`]`(i, j)`, member
/// `j`'s chunk `i` ([`Collective::member_chunk`]: reduce-scatter, all-reduce) or whole
/// send buffer (reduce), copied as is (no bf16 rounding: that is the combine's).
///
/// Every send buffer is read, each lock held alone, before any receive buffer is
/// written, so a member's send buffer may be its receive buffer.
fn exchange(arrivals: &[Arrival]) {
    let Some(desc) = arrivals.first().map(|a| a.desc) else {
        return;
    };
    // The count was checked against memory when each member validated its call.
    let c = desc.count as usize;
    // Appending the senders in member order, skipping the receiver itself, fills the
    // receive buffer slot by slot.
    let n = arrivals.len() as u32;
    let mut incoming: Vec<Option<Vec<f32>>> = arrivals
        .iter()
        .map(|a| a.recv.as_ref().map(|r| Vec::with_capacity(r.len())))
        .collect();
    for (j, a) in arrivals.iter().enumerate() {
        let Some(send) = &a.send else { continue };
        let s = send.lock();
        for (i, into) in incoming.iter_mut().enumerate() {
            let Some(into) = into.as_mut().filter(|_| i != j) else {
                continue;
            };
            let chunk = match desc.kind {
                CollectiveKind::ReduceScatter | CollectiveKind::AllReduce => {
                    let (at, len) = desc.member_chunk(n, i as u32);
                    s.get(at as usize..(at + len) as usize)
                }
                _ => s.get(..c),
            };
            into.extend_from_slice(chunk.unwrap_or_default());
        }
    }
    for (a, data) in arrivals.iter().zip(incoming) {
        let (Some(recv), Some(data)) = (&a.recv, data) else {
            continue;
        };
        recv.lock().iter_mut().zip(data).for_each(|(r, x)| *r = x);
    }
}

/// Completes every member's buffer of a validated, agreed gather ([`crate::Kernel::Gather`]):
/// chunk `j` ([`Collective::member_chunk`]) of member `j`'s buffer is copied into chunk
/// `j` of every other member's. Every chunk is read, each lock held alone, before any
/// buffer is written.
fn gather(arrivals: &[Arrival]) {
    let Some(desc) = arrivals.first().map(|a| a.desc) else {
        return;
    };
    let n = arrivals.len() as u32;
    let chunks: Vec<Option<Vec<f32>>> = arrivals
        .iter()
        .enumerate()
        .map(|(j, a)| {
            let (at, len) = desc.member_chunk(n, j as u32);
            let buf = a.send.as_ref()?.lock();
            buf.get(at as usize..(at + len) as usize)
                .map(<[f32]>::to_vec)
        })
        .collect();
    for (i, a) in arrivals.iter().enumerate() {
        let Some(buf) = &a.send else { continue };
        let mut b = buf.lock();
        for (j, chunk) in chunks.iter().enumerate().filter(|&(j, _)| j != i) {
            let (Some(chunk), (at, _)) = (chunk, desc.member_chunk(n, j as u32)) else {
                continue;
            };
            if let Some(dst) = b.get_mut(at as usize..at as usize + chunk.len()) {
                dst.copy_from_slice(chunk);
            }
        }
    }
}

/// Computes and writes every member's output of a validated, agreed collective.
///
/// Inputs are read (and for `bf16` rounded) member by member, each lock held alone,
/// before any output is written.
fn execute(arrivals: &[Arrival]) {
    let Some(desc) = arrivals.first().map(|a| a.desc) else {
        return;
    };
    let n = arrivals.len();
    // The count was checked against memory when each member validated its call.
    let c = desc.count as usize;
    let wire = |x: f32| {
        if desc.dtype == DType::Bf16 {
            round_bf16(x)
        } else {
            x
        }
    };
    let sends = arrivals.iter().filter_map(|a| a.send.as_ref());
    let data: Vec<f32> = if desc.kind == CollectiveKind::AllGather {
        let mut data = Vec::with_capacity(n * c);
        sends.for_each(|send| data.extend(send.lock().iter().map(|&x| wire(x))));
        data
    } else {
        // Broadcast has a single sender (the root); the reductions sum in member order.
        let mut sum: Option<Vec<f32>> = None;
        for send in sends {
            let s = send.lock();
            if let Some(acc) = sum.as_mut() {
                acc.iter_mut()
                    .zip(s.iter())
                    .for_each(|(a, &x)| *a += wire(x));
            } else {
                sum = Some(s.iter().map(|&x| wire(x)).collect());
            }
        }
        let mut data = sum.unwrap_or_default();
        if desc.kind != CollectiveKind::Broadcast && desc.op == ReduceOp::Avg {
            let size = n as f32;
            data.iter_mut().for_each(|x| *x /= size);
        }
        data
    };
    for (i, a) in arrivals.iter().enumerate() {
        let Some(recv) = &a.recv else { continue };
        let part = if desc.kind == CollectiveKind::ReduceScatter {
            data.get(i * c..(i + 1) * c)
        } else {
            Some(&data[..])
        };
        recv.lock()
            .iter_mut()
            .zip(part.unwrap_or_default())
            .for_each(|(r, &x)| *r = x);
    }
}
