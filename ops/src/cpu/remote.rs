//! The CPU backend across processes: one rank per process, its communicators' other
//! members reached over TCP ([`CpuLinks`]), the role gloo plays for PyTorch.
//!
//! The transport favours simplicity over bandwidth. When a member of this process calls
//! a collective, an exchange or a gather, its whole arrival (the call kind, the
//! [`Collective`], whether it can take part and why not, and the whole contents of its
//! send buffer) goes to every other member of the communicator, one frame per member;
//! each process then completes the round from every member's arrival in member order
//! with the in-process code ([`super::comm`]) and keeps only its own output. So the
//! numbers are the in-process backend's bit for bit, and a round moves `(n − 1)·|send|`
//! bytes out of each member, more than a ring or tree would.
//!
//! Framing, little-endian, on one connection per pair of ranks: a 14-byte header (the
//! magic `OVCL`, a version byte, a kind byte, the body's length as a `u64`) and the
//! body. An `Arrival` body names the backend on the links (`namespace`: the backends
//! made over one [`CpuLinks`] are numbered in creation order, the same in every
//! process), the communicator, the sender's generation (resets) and call number, the
//! sender's rank, then the arrival. A process that ends sends `Bye` (empty) to every
//! peer and waits until each answers `ByeAck` (empty; its reader has read everything
//! before), so closing never discards what a peer has not read yet. A process that gives
//! up on the job (a timed-out step, another rank's failure: [`crate::Backend::abort`])
//! sends `Farewell` (the reason, UTF-8) first, so that its peers name the cause when its
//! connection closes. The connections come
//! authenticated from the caller (`overlap_dist::cpu` proves the job's secret with an
//! HMAC challenge-response before handing them over); the frames after that carry no
//! tag and nothing is encrypted, as with gloo and NCCL: keep the job on a trusted
//! network.
//!
//! A reader thread per peer deposits what arrives at the communicator it names (frames
//! for a backend not made yet wait for it). A connection that closes, or a peer that
//! says goodbye, fails at once every round still waiting for that peer, naming it; a
//! frame that does not decode or does not fit is treated the same way. A send that the
//! peer does not read within [`SEND_TIMEOUT`] counts as a lost peer too.
//!
//! Invariant: nothing here waits without a bound while a communicator's lock is held,
//! and a round never waits for a peer whose connection is gone.

use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread;
use std::time::{Duration, Instant};

use overlap_graph::{Collective, CollectiveKind, DType, Group, ReduceOp, Stream};

use super::buffer::CpuBuffer;
use super::comm::{Arrival, Call, Failure};
use super::{lock, Shared};
use crate::{CommId, OpsError};

/// How long a send may wait for the peer to read before the peer counts as lost.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a farewell waits for each peer to take it ([`Outbox::farewell`]).
const FAREWELL_WAIT: Duration = Duration::from_millis(200);

/// How long dropping the links waits for the peers to acknowledge the goodbye (so that
/// this process's closing never discards what a peer has not read yet).
const LINGER: Duration = Duration::from_secs(5);

const MAGIC: [u8; 4] = *b"OVCL";
const VERSION: u8 = 1;
const HEADER: usize = 4 + 1 + 1 + 8;
/// The largest frame body read (a stray length is not allocated).
const MAX_BODY: u64 = 1 << 40;

const ARRIVAL: u8 = 1;
const BYE: u8 = 2;
const BYE_ACK: u8 = 3;
const FAREWELL: u8 = 4;

const KINDS: [CollectiveKind; 5] = [
    CollectiveKind::ReduceScatter,
    CollectiveKind::AllReduce,
    CollectiveKind::Reduce,
    CollectiveKind::Broadcast,
    CollectiveKind::AllGather,
];

/// This process's connections to every other rank of a job, for CPU backends that drive
/// one rank each ([`super::CpuBackend::one_rank`]). Cloning shares the links; dropping
/// the last handle (and every backend over them) says goodbye to the peers and closes.
#[derive(Clone)]
pub struct CpuLinks {
    links: Arc<Links>,
}

impl std::fmt::Debug for CpuLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CpuLinks(rank {} of {})",
            self.links.net.rank, self.links.world
        )
    }
}

/// What the backends over the links hold: dropping the last one says goodbye.
pub(super) struct Links {
    world: u32,
    net: Arc<Net>,
}

/// The connections, shared with the reader threads.
struct Net {
    rank: u32,
    /// By rank: the connection to that rank (`None` for this one).
    outs: Vec<Option<Mutex<TcpStream>>>,
    state: Mutex<NetState>,
    closing: AtomicBool,
    /// By rank: whether the peer acknowledged this process's goodbye or its connection
    /// ended (this rank's own entry is `true`); and the signal of a change.
    done: Mutex<Vec<bool>>,
    changed: Condvar,
}

struct NetState {
    /// By namespace: the backends made over the links.
    sinks: Vec<Weak<Shared>>,
    /// Arrivals for a namespace no backend has yet, in arrival order.
    early: Vec<Delivery>,
    /// By rank: why a peer can no longer send.
    lost: Vec<Option<String>>,
}

/// A remote member's arrival as received.
pub(super) struct Delivery {
    namespace: u32,
    comm: CommId,
    generation: u64,
    call: u64,
    sender: u32,
    kind: Call,
    desc: Collective,
    failed: Option<String>,
    send: Option<Vec<f32>>,
}

/// What a reader thread received.
enum Received {
    Arrival(Delivery),
    Bye,
    ByeAck,
    /// The peer gives up on the job, for this reason; its connection closes next.
    Farewell(String),
}

/// Where a communicator with remote members sends its local members' arrivals.
#[derive(Clone)]
pub(super) struct Outbox {
    links: Arc<Links>,
    namespace: u32,
}

impl CpuLinks {
    /// Links from this process (`rank` of `world`) over connections to every other
    /// rank, each already authenticated by the caller: `peers` holds `(rank, stream)`
    /// for every rank but this one, exactly once. Starts a reader thread per peer.
    pub fn new(rank: u32, world: u32, peers: Vec<(u32, TcpStream)>) -> Result<CpuLinks, OpsError> {
        let bad = |why: String| OpsError::Backend(format!("CPU links of rank {rank}: {why}"));
        if rank >= world {
            return Err(bad(format!(
                "rank {rank} is not below the world size {world}"
            )));
        }
        let mut outs: Vec<Option<Mutex<TcpStream>>> = (0..world).map(|_| None).collect();
        let mut readers = Vec::new();
        for (peer, stream) in peers {
            let slot = outs
                .get_mut(peer as usize)
                .filter(|s| s.is_none() && peer != rank)
                .ok_or_else(|| bad(format!("a connection to rank {peer}, which is not another rank of the {world}, or a second one")))?;
            let reader =
                setup(&stream).map_err(|e| bad(format!("the connection to rank {peer}: {e}")))?;
            *slot = Some(Mutex::new(stream));
            readers.push((peer, reader));
        }
        if let Some(missing) = (0..world).find(|&r| r != rank && outs[r as usize].is_none()) {
            return Err(bad(format!("no connection to rank {missing}")));
        }
        let net = Arc::new(Net {
            rank,
            outs,
            state: Mutex::new(NetState {
                sinks: Vec::new(),
                early: Vec::new(),
                lost: vec![None; world as usize],
            }),
            closing: AtomicBool::new(false),
            done: Mutex::new((0..world).map(|r| r == rank).collect()),
            changed: Condvar::new(),
        });
        let links = Arc::new(Links { world, net });
        for (peer, stream) in readers {
            let net = links.net.clone();
            let spawned = thread::Builder::new()
                .name(format!("link-r{peer}"))
                .spawn(move || net.read_from(peer, stream));
            if let Err(e) = spawned {
                return Err(bad(format!("cannot start reading from rank {peer}: {e}")));
            }
        }
        Ok(CpuLinks { links })
    }

    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.links.net.rank
    }

    /// Ranks in the job.
    pub fn world(&self) -> u32 {
        self.links.world
    }

    /// Registers a backend's shared state, built by `make` from its namespace (the next
    /// one), and hands it what arrived for it before it existed.
    pub(super) fn register(&self, make: impl FnOnce(Outbox) -> Arc<Shared>) -> Arc<Shared> {
        let net = &self.links.net;
        let (shared, early, lost) = {
            let mut st = lock(&net.state);
            let namespace = st.sinks.len() as u32;
            let shared = make(Outbox {
                links: self.links.clone(),
                namespace,
            });
            st.sinks.push(Arc::downgrade(&shared));
            let (early, keep) = std::mem::take(&mut st.early)
                .into_iter()
                .partition(|d| d.namespace == namespace);
            st.early = keep;
            (shared, early, st.lost.clone())
        };
        for d in early {
            let sender = d.sender;
            if let Err(why) = shared.deposit(d) {
                net.lose(
                    sender,
                    format!("rank {sender} sent an arrival that does not fit: {why}"),
                );
            }
        }
        for (rank, why) in lost.iter().enumerate() {
            if let Some(why) = why {
                shared.peer_lost(rank as u32, why);
            }
        }
        shared
    }
}

/// A connection's options; its clone for the reader.
fn setup(s: &TcpStream) -> std::io::Result<TcpStream> {
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(SEND_TIMEOUT))?;
    s.set_read_timeout(None)?;
    s.try_clone()
}

impl Drop for Links {
    /// Says goodbye to every peer and waits (at most [`LINGER`]) until each has read it
    /// (it acknowledges) or its connection ended, so that closing never discards what a
    /// peer has not read yet; then closes the connections.
    fn drop(&mut self) {
        let net = &self.net;
        net.closing.store(true, Ordering::SeqCst);
        let bye = frame(BYE, &[]);
        for (rank, out) in net.outs.iter().enumerate() {
            if out.is_some() {
                net.send_to(rank as u32, &bye);
            }
        }
        let deadline = Instant::now() + LINGER;
        let mut done = lock(&net.done);
        while !done.iter().all(|&d| d) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            done = net
                .changed
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(done);
        for out in net.outs.iter().flatten() {
            let _ = lock(out).shutdown(Shutdown::Both);
        }
    }
}

impl Net {
    /// Sends a frame to `rank`; a failure makes the peer lost.
    fn send_to(&self, rank: u32, frame: &[u8]) {
        let Some(Some(out)) = self.outs.get(rank as usize) else {
            return;
        };
        let Err(e) = lock(out).write_all(frame) else {
            return;
        };
        let why = if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            format!(
                "rank {rank} did not read what rank {} sent within {} s",
                self.rank,
                SEND_TIMEOUT.as_secs()
            )
        } else {
            format!(
                "rank {} cannot send to rank {rank} ({e}): that process exited, was killed or lost its machine",
                self.rank
            )
        };
        self.lose(rank, why);
        self.mark_done(rank);
    }

    fn mark_done(&self, rank: u32) {
        if let Some(d) = lock(&self.done).get_mut(rank as usize) {
            *d = true;
        }
        self.changed.notify_all();
    }

    /// A reader thread: deposits every arrival from `peer` until its connection ends.
    fn read_from(self: Arc<Self>, peer: u32, stream: TcpStream) {
        let mut r = BufReader::with_capacity(1 << 16, stream);
        let mut said_bye = false;
        loop {
            let why = match read_frame(&mut r) {
                Ok(Received::Bye) => {
                    said_bye = true;
                    self.lose(peer, format!("rank {peer} ended its part of the job (it said goodbye) without taking part"));
                    self.send_to(peer, &frame(BYE_ACK, &[]));
                    continue;
                }
                Ok(Received::ByeAck) => {
                    self.mark_done(peer);
                    continue;
                }
                Ok(Received::Farewell(why)) => {
                    said_bye = true;
                    self.lose(peer, format!("rank {peer} stopped: {why}"));
                    continue;
                }
                Ok(Received::Arrival(d)) if d.sender != peer => {
                    format!("rank {peer}'s connection sent an arrival as rank {}", d.sender)
                }
                Ok(Received::Arrival(d)) => match self.deliver(d) {
                    Ok(()) => continue,
                    Err(e) => format!("rank {peer} sent an arrival that does not fit: {e}"),
                },
                Err(_) if said_bye || self.closing.load(Ordering::SeqCst) => break,
                Err(e) => format!(
                    "rank {peer}'s connection to rank {} closed without a goodbye ({e}): the process exited, was killed or lost its machine",
                    self.rank
                ),
            };
            self.lose(peer, why);
            break;
        }
        self.mark_done(peer);
    }

    /// Hands an arrival to its backend, or keeps it until that backend exists.
    fn deliver(&self, d: Delivery) -> Result<(), String> {
        let sink = {
            let mut st = lock(&self.state);
            match st.sinks.get(d.namespace as usize) {
                Some(weak) => weak.upgrade(),
                None => {
                    st.early.push(d);
                    return Ok(());
                }
            }
        };
        // A backend already dropped has nothing left to receive.
        sink.map_or(Ok(()), |s| s.deposit(d))
    }

    /// `rank` can no longer send: every backend's rounds waiting for it fail with `why`
    /// (the first reason is kept).
    fn lose(&self, rank: u32, why: String) {
        let sinks: Vec<Arc<Shared>> = {
            let mut st = lock(&self.state);
            match st.lost.get_mut(rank as usize) {
                Some(slot) if slot.is_none() => *slot = Some(why.clone()),
                _ => return,
            }
            st.sinks.iter().filter_map(Weak::upgrade).collect()
        };
        for s in sinks {
            s.peer_lost(rank, &why);
        }
    }
}

impl Outbox {
    /// Tells every peer that this process gives up on the job, and why: each fails its
    /// rounds waiting for this rank with `rank R stopped: why` instead of learning of
    /// it from the connection's close, which says nothing of the cause.
    ///
    /// It never holds the caller up for long: a connection another thread keeps
    /// writing to for [`FAREWELL_WAIT`] is skipped, and a peer that does not take the
    /// frame within as long (its machine lost, its buffers full) does without it.
    pub(super) fn farewell(&self, why: &str) {
        let frame = frame(FAREWELL, why.as_bytes());
        for out in self.links.net.outs.iter().flatten() {
            let deadline = Instant::now() + FAREWELL_WAIT;
            let mut stream = loop {
                match out.try_lock() {
                    Ok(s) => break Some(s),
                    Err(_) if Instant::now() >= deadline => break None,
                    Err(_) => thread::sleep(Duration::from_millis(1)),
                }
            };
            if let Some(stream) = stream.as_mut() {
                // The process gives up on the job: later sends may wait as little.
                let _ = stream.set_write_timeout(Some(FAREWELL_WAIT));
                let _ = stream.write_all(&frame);
            }
        }
    }

    /// Sends member `sender`'s arrival at call `call` of generation `generation` on
    /// `comm` to the ranks `to`.
    pub(super) fn send(
        &self,
        comm: CommId,
        to: impl Iterator<Item = u32>,
        sender: u32,
        (generation, call): (u64, u64),
        arrival: &Arrival,
    ) {
        let mut body = Vec::new();
        put_u32(&mut body, self.namespace);
        put_comm(&mut body, comm);
        put_u64(&mut body, generation);
        put_u64(&mut body, call);
        put_u32(&mut body, sender);
        put_arrival(&mut body, arrival);
        let frame = frame(ARRIVAL, &body);
        for rank in to {
            self.links.net.send_to(rank, &frame);
        }
    }
}

impl Shared {
    /// Deposits a remote member's arrival at its communicator.
    pub(super) fn deposit(&self, d: Delivery) -> Result<(), String> {
        let comm = self.comms.get(&d.comm).ok_or_else(|| {
            format!(
                "communicator {} is not one of rank {}'s",
                d.comm, self.local.start
            )
        })?;
        let index = comm
            .index_of(d.sender)
            .ok_or_else(|| format!("rank {} is not a member of {}", d.sender, d.comm))?;
        let arrival = Arrival {
            call: d.kind,
            desc: d.desc,
            send: d.send.map(|data| CpuBuffer::remote(d.sender, data)),
            recv: None,
            failed: d.failed.map(Failure::Remote),
        };
        comm.deposit_remote(index, (d.generation, d.call), arrival)
    }

    /// `rank` can no longer arrive anywhere.
    pub(super) fn peer_lost(&self, rank: u32, why: &str) {
        for comm in self.comms.values() {
            if let Some(i) = comm.index_of(rank) {
                comm.member_lost(i, why);
            }
        }
    }
}

/// A frame: header and body.
fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + body.len());
    f.extend_from_slice(&MAGIC);
    f.push(VERSION);
    f.push(kind);
    f.extend_from_slice(&(body.len() as u64).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// Reads one frame.
fn read_frame(r: &mut impl Read) -> Result<Received, String> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "the connection closed".to_string(),
        _ => e.to_string(),
    })?;
    if h[..4] != MAGIC || h[4] != VERSION {
        return Err(format!(
            "not a frame of this overlap build's CPU links (it starts {:02x?})",
            &h[..5]
        ));
    }
    let len = u64::from_le_bytes(h[6..14].try_into().unwrap_or_default());
    if len > MAX_BODY {
        return Err(format!("a frame of {len} bytes, more than {MAX_BODY}"));
    }
    let mut body = Vec::new();
    body.try_reserve_exact(len as usize)
        .map_err(|e| format!("cannot hold a frame of {len} bytes: {e}"))?;
    body.resize(len as usize, 0);
    r.read_exact(&mut body)
        .map_err(|e| format!("a frame cut short: {e}"))?;
    match h[5] {
        BYE => Ok(Received::Bye),
        BYE_ACK => Ok(Received::ByeAck),
        FAREWELL => Ok(Received::Farewell(
            String::from_utf8_lossy(&body).into_owned(),
        )),
        ARRIVAL => decode_delivery(&body).map(Received::Arrival),
        k => Err(format!("a frame of unknown kind {k}")),
    }
}

fn put_u32(b: &mut Vec<u8>, x: u32) {
    b.extend_from_slice(&x.to_le_bytes());
}

fn put_u64(b: &mut Vec<u8>, x: u64) {
    b.extend_from_slice(&x.to_le_bytes());
}

fn put_group(b: &mut Vec<u8>, g: Group) {
    match g {
        Group::Shard { replicate } => {
            b.push(0);
            put_u32(b, replicate);
        }
        Group::Replicate { shard } => {
            b.push(1);
            put_u32(b, shard);
        }
    }
}

fn put_comm(b: &mut Vec<u8>, c: CommId) {
    put_group(b, c.group);
    b.push(c.stream.index() as u8);
}

fn put_arrival(b: &mut Vec<u8>, a: &Arrival) {
    b.push(match a.call {
        Call::Collective => 0,
        Call::Exchange => 1,
        Call::Gather => 2,
    });
    let d = &a.desc;
    b.push(KINDS.iter().position(|&k| k == d.kind).unwrap_or(0) as u8);
    put_group(b, d.group);
    put_u64(b, d.count);
    b.push(match d.dtype {
        DType::F32 => 0,
        DType::Bf16 => 1,
    });
    b.push(match d.op {
        ReduceOp::Avg => 0,
        ReduceOp::Sum => 1,
    });
    match d.root {
        Some(r) => {
            b.push(1);
            put_u32(b, r);
        }
        None => b.push(0),
    }
    match &a.failed {
        Some(why) => {
            let why = why.to_string();
            b.push(1);
            put_u64(b, why.len() as u64);
            b.extend_from_slice(why.as_bytes());
        }
        None => b.push(0),
    }
    // A member that cannot take part fails the round before anyone reads its data.
    match a.send.as_ref().filter(|_| a.failed.is_none()) {
        Some(send) => {
            let data = send.lock();
            b.push(1);
            put_u64(b, data.len() as u64);
            b.reserve(data.len() * 4);
            data.iter()
                .for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        }
        None => b.push(0),
    }
}

/// Reads the fields of a frame body in order.
struct Fields<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.body.len());
        let end =
            end.ok_or_else(|| format!("a frame body of {} bytes is cut short", self.body.len()))?;
        let s = &self.body[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }

    fn group(&mut self) -> Result<Group, String> {
        match (self.u8()?, self.u32()?) {
            (0, replicate) => Ok(Group::Shard { replicate }),
            (1, shard) => Ok(Group::Replicate { shard }),
            (k, _) => Err(format!("group kind {k}")),
        }
    }

    fn comm(&mut self) -> Result<CommId, String> {
        let group = self.group()?;
        let s = self.u8()?;
        let stream = *Stream::ALL
            .get(s as usize)
            .ok_or_else(|| format!("stream {s}"))?;
        Ok(CommId { group, stream })
    }

    fn flag(&mut self) -> Result<bool, String> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            f => Err(format!("flag {f}")),
        }
    }

    fn len(&mut self, unit: usize) -> Result<usize, String> {
        let n = self.u64()?;
        let left = (self.body.len() - self.at) / unit;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| format!("a length of {n} past the frame's end"))
    }
}

fn decode_delivery(body: &[u8]) -> Result<Delivery, String> {
    let mut f = Fields { body, at: 0 };
    let namespace = f.u32()?;
    let comm = f.comm()?;
    let (generation, call, sender) = (f.u64()?, f.u64()?, f.u32()?);
    let kind = match f.u8()? {
        0 => Call::Collective,
        1 => Call::Exchange,
        2 => Call::Gather,
        k => return Err(format!("call kind {k}")),
    };
    let k = f.u8()?;
    let desc = Collective {
        kind: *KINDS
            .get(k as usize)
            .ok_or_else(|| format!("collective kind {k}"))?,
        group: f.group()?,
        count: f.u64()?,
        dtype: match f.u8()? {
            0 => DType::F32,
            1 => DType::Bf16,
            d => return Err(format!("dtype {d}")),
        },
        op: match f.u8()? {
            0 => ReduceOp::Avg,
            1 => ReduceOp::Sum,
            o => return Err(format!("reduce op {o}")),
        },
        root: if f.flag()? { Some(f.u32()?) } else { None },
    };
    let failed = if f.flag()? {
        let n = f.len(1)?;
        Some(String::from_utf8_lossy(f.take(n)?).into_owned())
    } else {
        None
    };
    let send = if f.flag()? {
        let n = f.len(4)?;
        let bytes = f.take(n * 4)?;
        Some(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect(),
        )
    } else {
        None
    };
    if f.at != body.len() {
        return Err(format!("{} bytes after an arrival", body.len() - f.at));
    }
    Ok(Delivery {
        namespace,
        comm,
        generation,
        call,
        sender,
        kind,
        desc,
        failed,
        send,
    })
}

#[cfg(test)]
pub(super) fn loopback(world: u32) -> Vec<CpuLinks> {
    use std::net::TcpListener;
    let mut ends: Vec<Vec<(u32, TcpStream)>> = (0..world).map(|_| Vec::new()).collect();
    for a in 0..world {
        for b in a + 1..world {
            let l = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
            let c = TcpStream::connect(l.local_addr().expect("an address")).expect("connects");
            let (s, _) = l.accept().expect("accepts");
            ends[a as usize].push((b, c));
            ends[b as usize].push((a, s));
        }
    }
    ends.into_iter()
        .enumerate()
        .map(|(r, peers)| CpuLinks::new(r as u32, world, peers).expect("links"))
        .collect()
}
