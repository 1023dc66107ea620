//! A small authenticated TCP rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`,
//! every other rank connects and proves it holds the job's secret, rank 0 proves the
//! same to it, and the connections stay open for the job so rank 0 can broadcast a
//! payload (the NCCL unique ids), gather small results (verify's figures) and compare
//! what every rank will run ([`Rendezvous::agree`]).
//!
//! Every message is a frame: the magic `OVRZ`, a protocol version, a kind, the sender's
//! rank and world size, a payload length and the payload. The handshake
//! (HMAC-SHA256 with the job's secret, [`JobSecret`]; the secret never travels):
//!
//! 1. rank 0 → rank: `Challenge`, payload a fresh 32-byte nonce `n0`;
//! 2. rank → rank 0: `Hello` with its rank `k` and world size `w`, payload a fresh nonce
//!    `nk` and `HMAC(secret, "overlap-rendezvous-2 hello" ‖ T)`, where the transcript
//!    `T = n0 ‖ nk ‖ k ‖ w` (little-endian `u32`s);
//! 3. rank 0 → rank: `Welcome`, payload `HMAC(secret, "overlap-rendezvous-2 welcome" ‖ T)`;
//! 4. every later frame on the connection carries a 32-byte tag
//!    `HMAC(K, direction ‖ sequence number ‖ header ‖ payload)` with the session key
//!    `K = HMAC(secret, "overlap-rendezvous-2 session" ‖ T)`: `Ready` once every rank
//!    arrived, `Reject` with a reason, then broadcasts and gathers.
//!
//! Rank 0 handles every connection on a thread of its own with its own deadline, so a
//! silent or slow client delays nobody; a stranger (no or a wrong secret, garbage, an
//! oversized length) is dropped and logged, never fatal. A rank that holds the secret
//! but claims a rank outside the job, another world size, or a rank that already
//! arrived, is told why (`Reject`) and the job goes on waiting for the right one.
//!
//! Invariant: every blocking step has a deadline; on any error the rendezvous is left
//! unusable (the caller exits), never half-synchronised; nothing a peer sends can make
//! rank 0 panic or give up before its deadline.

use std::fmt;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::env::RankEnv;
use crate::fingerprint::Fingerprint;
use crate::DistError;
use overlap_executor::{PeerAbort, PeerFailure};

type HmacSha256 = Hmac<Sha256>;

const MAGIC: [u8; 4] = *b"OVRZ";
/// The protocol version: 2 is the authenticated one.
pub const PROTOCOL_VERSION: u32 = 2;
/// Largest payload accepted after the handshake (protects a rank from a stray length).
const MAX_PAYLOAD: u64 = 256 << 20;
const HEADER: usize = 4 + 4 + 1 + 4 + 4 + 8;
const NONCE: usize = 32;
const TAG: usize = 32;
/// How long rank 0 gives one new connection to complete its handshake.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// At most this many connections in their handshake at once; more are closed at once.
pub const MAX_PENDING: usize = 512;
/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;

/// The variable that holds the job's secret.
pub const SECRET_VAR: &str = "OVERLAP_JOB_SECRET";
/// The variable that names a file holding the job's secret.
pub const SECRET_FILE_VAR: &str = "OVERLAP_JOB_SECRET_FILE";
/// The variable that overrides the address rank 0 listens on (e.g. `0.0.0.0`).
pub const BIND_VAR: &str = "OVERLAP_BIND_ADDR";

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    Broadcast = 2,
    Gather = 3,
    Challenge = 4,
    Welcome = 5,
    Ready = 6,
    Reject = 7,
    /// A rank failed (payload: its rank, little-endian `u32`, then its error).
    Abort = 8,
    /// A rank ended well and closes its connection.
    Bye = 9,
}

impl Kind {
    fn of(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Broadcast,
            3 => Kind::Gather,
            4 => Kind::Challenge,
            5 => Kind::Welcome,
            6 => Kind::Ready,
            7 => Kind::Reject,
            8 => Kind::Abort,
            9 => Kind::Bye,
            _ => return None,
        })
    }
}

/// The variable that overrides how long ranks wait for each other at start, in seconds.
pub const TIMEOUT_VAR: &str = "OVERLAP_RENDEZVOUS_TIMEOUT_S";

/// The longest start timeout `OVERLAP_RENDEZVOUS_TIMEOUT_S` may ask for: a week.
pub const MAX_START_TIMEOUT_S: u64 = 7 * 24 * 3600;

/// How long to wait for the other ranks at start: `OVERLAP_RENDEZVOUS_TIMEOUT_S`
/// seconds when set (and not empty), else `default`. A value that is not a whole number
/// of seconds from 1 to [`MAX_START_TIMEOUT_S`] is an error naming the variable.
pub fn start_timeout(default: Duration) -> Result<Duration, DistError> {
    timeout_from(std::env::var(TIMEOUT_VAR).ok().as_deref(), default)
}

fn timeout_from(value: Option<&str>, default: Duration) -> Result<Duration, DistError> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(default);
    };
    match v.parse::<u64>() {
        Ok(s) if (1..=MAX_START_TIMEOUT_S).contains(&s) => Ok(Duration::from_secs(s)),
        _ => Err(DistError::Env {
            var: TIMEOUT_VAR.into(),
            reason: format!(
                "`{v}` is not a whole number of seconds from 1 to {MAX_START_TIMEOUT_S} (a week)"
            ),
        }),
    }
}

/// The job's shared secret: what a rank proves it holds before rank 0 accepts it (and
/// rank 0 to it). Never printed: its `Debug` shows only its length.
#[derive(Clone)]
pub struct JobSecret(Arc<Vec<u8>>);

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobSecret({} bytes)", self.0.len())
    }
}

/// How to set a secret, for error messages.
pub const SECRET_ADVICE: &str = "set OVERLAP_JOB_SECRET to the same random value on every rank, e.g. `export OVERLAP_JOB_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')` before torchrun, srun or mpirun (passed on with `mpirun -x OVERLAP_JOB_SECRET`), or OVERLAP_JOB_SECRET_FILE to a file only the job's user can read that holds it; `overlap launch` on one node sets one itself";

impl JobSecret {
    /// A secret from bytes; at least [`MIN_SECRET_BYTES`] of them.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<JobSecret, DistError> {
        let bytes = bytes.into();
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(DistError::Env {
                var: SECRET_VAR.into(),
                reason: format!(
                    "the job secret has {} bytes, fewer than {MIN_SECRET_BYTES}; {SECRET_ADVICE}",
                    bytes.len()
                ),
            });
        }
        Ok(JobSecret(Arc::new(bytes)))
    }

    /// A fresh random secret (32 bytes from the OS), as `overlap launch` makes per job.
    pub fn generate() -> Result<JobSecret, DistError> {
        let hex: String = random::<32>()?.iter().map(|b| format!("{b:02x}")).collect();
        JobSecret::new(hex)
    }

    /// The text to hand to ranks in [`SECRET_VAR`] (the secret itself: never print it).
    pub fn expose(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    /// The secret from the environment: `OVERLAP_JOB_SECRET`, or the contents of the
    /// file `OVERLAP_JOB_SECRET_FILE` names (one trailing newline dropped); `None` when
    /// neither is set.
    pub fn from_env() -> Result<Option<JobSecret>, DistError> {
        JobSecret::from_vars(|k| std::env::var(k).ok())
    }

    /// [`JobSecret::from_env`] through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<JobSecret>, DistError> {
        if let Some(v) = get(SECRET_VAR).filter(|v| !v.is_empty()) {
            return JobSecret::new(v.into_bytes()).map(Some);
        }
        let Some(path) = get(SECRET_FILE_VAR).filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let mut bytes = std::fs::read(&path).map_err(|e| DistError::Env {
            var: SECRET_FILE_VAR.into(),
            reason: format!("cannot read `{path}`: {e}"),
        })?;
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
        }
        JobSecret::new(bytes)
            .map_err(|e| DistError::Env {
                var: SECRET_FILE_VAR.into(),
                reason: format!("`{path}`: {e}"),
            })
            .map(Some)
    }

    /// The secret a rank of `env` must use: from the environment; a job of two or more
    /// ranks without one is refused, whether its rendezvous is on loopback or not (any
    /// local user can reach a loopback port). A job of one rank has nobody to meet: it
    /// uses the variable if set, else a random secret nobody else knows.
    pub fn for_job(env: &RankEnv) -> Result<JobSecret, DistError> {
        if env.world_size <= 1 {
            if let Some(s) = JobSecret::from_env()? {
                return Ok(s);
            }
            return JobSecret::new(random::<32>()?.to_vec());
        }
        JobSecret::from_env()?.ok_or_else(|| DistError::Env {
            var: SECRET_VAR.into(),
            reason: format!(
                "is not set, and a job of {} ranks authenticates its rendezvous at {}:{} with it: {SECRET_ADVICE}",
                env.world_size, env.master_addr, env.master_port
            ),
        })
    }

    fn mac(&self, label: &[u8], transcript: &[u8]) -> HmacSha256 {
        // HMAC accepts a key of any length.
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        m.update(transcript);
        m
    }
}

/// `N` random bytes from the operating system.
fn random<const N: usize>() -> Result<[u8; N], DistError> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| DistError::Rendezvous(format!("cannot read /dev/urandom: {e}")))?;
    Ok(b)
}

const HELLO_LABEL: &[u8] = b"overlap-rendezvous-2 hello";
const WELCOME_LABEL: &[u8] = b"overlap-rendezvous-2 welcome";
const SESSION_LABEL: &[u8] = b"overlap-rendezvous-2 session";

/// Which handshake a connection makes: the rendezvous's (rank 0 serves ranks
/// `1..world`), or a CPU link's (`overlap-cpu-link-1`, [`crate::cpu`]: rank `k` serves
/// the ranks below it, and its rank is part of every label, so that a client proves the
/// secret to, and hears it proved by, the rank it meant to reach). The labels keep the
/// two protocols' proofs apart.
#[derive(Debug, Clone)]
pub(crate) struct Handshake {
    hello: Vec<u8>,
    welcome: Vec<u8>,
    session: Vec<u8>,
    /// The serving rank.
    server: u32,
    /// The ranks it accepts.
    clients: std::ops::Range<u32>,
}

impl Handshake {
    /// Rank 0's rendezvous of `world` ranks.
    fn rendezvous(world: u32) -> Handshake {
        Handshake {
            hello: HELLO_LABEL.to_vec(),
            welcome: WELCOME_LABEL.to_vec(),
            session: SESSION_LABEL.to_vec(),
            server: 0,
            clients: 1..world,
        }
    }

    /// The CPU link served by rank `server`, for the ranks below it.
    pub(crate) fn cpu_link(server: u32) -> Handshake {
        let label = |what: &str| {
            let mut l = format!("overlap-cpu-link-1 {what}").into_bytes();
            l.extend_from_slice(&server.to_le_bytes());
            l
        };
        Handshake {
            hello: label("hello"),
            welcome: label("welcome"),
            session: label("session"),
            server,
            clients: 0..server,
        }
    }
}

fn transcript(n0: &[u8; NONCE], nk: &[u8; NONCE], rank: u32, world: u32) -> Vec<u8> {
    let mut t = Vec::with_capacity(2 * NONCE + 8);
    t.extend_from_slice(n0);
    t.extend_from_slice(nk);
    t.extend_from_slice(&rank.to_le_bytes());
    t.extend_from_slice(&world.to_le_bytes());
    t
}

/// One authenticated connection: the stream, its session key and sequence numbers.
/// Sending goes through [`Out`], which the job's watch threads share; once the job is
/// watched ([`Rendezvous::watch`]) a thread reads the stream and hands the frames that
/// are not about failures to `inbox`.
struct Conn {
    stream: TcpStream,
    key: [u8; 32],
    /// 0 on rank 0's side (it sends direction 0), 1 on a rank's.
    side: u8,
    received: u64,
    out: Arc<Mutex<Out>>,
    inbox: Option<mpsc::Receiver<Result<Frame, String>>>,
}

/// A received frame: `(kind, rank, world, payload)`.
type Frame = (Kind, u32, u32, Vec<u8>);

/// The sending half of a connection.
struct Out {
    stream: TcpStream,
    key: [u8; 32],
    side: u8,
    sent: u64,
}

fn tag(key: &[u8; 32], direction: u8, seq: u64, header: &[u8], payload: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(&[direction]);
    m.update(&seq.to_le_bytes());
    m.update(header);
    m.update(payload);
    m
}

impl Out {
    fn send(&mut self, kind: Kind, rank: u32, world: u32, payload: &[u8]) -> std::io::Result<()> {
        let header = header(kind, rank, world, payload.len() as u64);
        let tag = tag(&self.key, self.side, self.sent, &header, payload)
            .finalize()
            .into_bytes();
        self.sent += 1;
        let mut buf = Vec::with_capacity(HEADER + payload.len() + TAG);
        buf.extend_from_slice(&header);
        buf.extend_from_slice(payload);
        buf.extend_from_slice(&tag);
        (&self.stream).write_all(&buf)?;
        (&self.stream).flush()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Conn {
    fn new(
        stream: TcpStream,
        secret: &JobSecret,
        (label, t): (&[u8], &[u8]),
        side: u8,
    ) -> Result<Conn, String> {
        let key: [u8; 32] = secret.mac(label, t).finalize().into_bytes().into();
        let out = Out {
            stream: stream.try_clone().map_err(|e| e.to_string())?,
            key,
            side,
            sent: 0,
        };
        Ok(Conn {
            stream,
            key,
            side,
            received: 0,
            out: Arc::new(Mutex::new(out)),
            inbox: None,
        })
    }

    fn send(&self, kind: Kind, rank: u32, world: u32, payload: &[u8]) -> std::io::Result<()> {
        lock(&self.out).send(kind, rank, world, payload)
    }

    /// Reads the next tagged frame, one of `kinds`: `(kind, rank, world, payload)`.
    fn recv(&mut self, kinds: &[Kind], deadline: Instant) -> Result<Frame, String> {
        let Some(inbox) = &self.inbox else {
            return self.read(kinds, deadline);
        };
        let left = deadline.saturating_duration_since(Instant::now());
        match inbox.recv_timeout(left) {
            Ok(Ok(f)) if kinds.contains(&f.0) => Ok(f),
            Ok(Ok(f)) => Err(format!(
                "expected a {kinds:?} frame, got {:?} (the ranks disagree on what happens next)",
                f.0
            )),
            Ok(Err(e)) => Err(e),
            Err(mpsc::RecvTimeoutError::Timeout) => Err("timed out".into()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err("the connection closed (did that rank exit?)".into())
            }
        }
    }

    /// Reads the next tagged frame from the stream itself.
    fn read(&mut self, kinds: &[Kind], deadline: Instant) -> Result<Frame, String> {
        let (header, kind, rank, world, len) =
            read_header(&self.stream, kinds, MAX_PAYLOAD, deadline)?;
        let mut payload = vec![0u8; len as usize];
        read_exact(&self.stream, &mut payload, deadline)?;
        let mut t = [0u8; TAG];
        read_exact(&self.stream, &mut t, deadline)?;
        tag(&self.key, 1 - self.side, self.received, &header, &payload)
            .verify_slice(&t)
            .map_err(|_| {
                "a frame failed its integrity check (tampered with, or not from this job's rank)"
                    .to_string()
            })?;
        self.received += 1;
        Ok((kind, rank, world, payload))
    }
}

/// One rank's end of the rendezvous.
pub struct Rendezvous {
    rank: u32,
    world: u32,
    /// Where rank 0 listens (for messages).
    addr: String,
    role: Role,
    /// Set when this end closes its connections: its watch threads then end quietly.
    closed: Arc<AtomicBool>,
    /// Rank 0: set once it has told the other ranks of a failure (by its watch or
    /// [`Rendezvous::pass_on`]); it tells them only once.
    forwarded: Arc<AtomicBool>,
}

/// Closing the rendezvous closes its connections: a rank that did not say
/// [`Rendezvous::bye`] first is taken for failed by the ranks that watch it.
impl Drop for Rendezvous {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::SeqCst);
        let conns: Vec<&Conn> = match &self.role {
            Role::Root(peers) => peers.iter().collect(),
            Role::Peer(c) => vec![c],
        };
        for c in conns {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

enum Role {
    /// Rank 0: one connection per other rank, at `rank - 1`.
    Root(Vec<Conn>),
    /// Another rank: its connection to rank 0.
    Peer(Conn),
}

fn err(msg: String) -> DistError {
    DistError::Rendezvous(msg)
}

/// What a handshake thread hands rank 0's main loop.
struct Arrival {
    rank: u32,
    from: SocketAddr,
    conn: Conn,
}

impl Rendezvous {
    /// Joins the job of a mesh and compares
    /// `what` with every rank's: refuses a job whose size is not the mesh's, connects
    /// ([`Rendezvous::connect`]) and agrees ([`Rendezvous::agree`]), each within the
    /// start timeout ([`start_timeout`] of `default`), which it returns for the steps
    /// that follow.
    pub fn meet(
        env: &RankEnv,
        mesh: overlap_graph::Mesh,
        what: &Fingerprint,
        default: Duration,
    ) -> Result<(Rendezvous, Duration), DistError> {
        if env.world_size != mesh.world() {
            return Err(DistError::Inconsistent(format!(
                "the job has {} ranks but mesh {mesh} needs {}",
                env.world_size,
                mesh.world()
            )));
        }
        let timeout = start_timeout(default)?;
        let mut rendezvous = Rendezvous::connect(env, timeout)?;
        rendezvous.agree(what, timeout)?;
        Ok((rendezvous, timeout))
    }

    /// Joins the job's rendezvous with the secret from the environment
    /// ([`JobSecret::for_job`]): rank 0 listens on the address `MASTER_ADDR` resolves
    /// to (or `OVERLAP_BIND_ADDR`) and waits for every other rank; the others connect
    /// to `MASTER_ADDR:MASTER_PORT`, retrying until `timeout`.
    pub fn connect(env: &RankEnv, timeout: Duration) -> Result<Rendezvous, DistError> {
        let secret = JobSecret::for_job(env)?;
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        if env.rank == 0 {
            let bind = std::env::var(BIND_VAR)
                .ok()
                .filter(|v| !v.trim().is_empty());
            let listener = listen(&env.master_addr, env.master_port, bind.as_deref())?;
            Rendezvous::serve(listener, env.world_size, &secret, timeout)
        } else {
            Rendezvous::join(&addr, env.rank, env.world_size, &secret, timeout)
        }
    }

    /// Rank 0's side on a listener: accepts the other `world - 1` ranks, each after it
    /// proved it holds `secret`.
    pub fn serve(
        listener: TcpListener,
        world: u32,
        secret: &JobSecret,
        timeout: Duration,
    ) -> Result<Rendezvous, DistError> {
        let local = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let hs = Handshake::rendezvous(world);
        let mut peers = accept_ranks(listener, world, secret, timeout, &hs)?;
        for (i, p) in peers.iter_mut().enumerate() {
            // Tell each peer it is in: `join` returns only then.
            p.send(Kind::Ready, 0, world, &[])
                .map_err(|e| err(format!("rank 0 cannot greet rank {}: {e}", i + 1)))?;
        }
        Ok(Rendezvous {
            rank: 0,
            world,
            addr: local,
            role: Role::Root(peers),
            closed: Arc::new(AtomicBool::new(false)),
            forwarded: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Another rank's side: connects to rank 0 at `addr` (`host:port`), retrying until
    /// `timeout`, proves it holds `secret`, checks that rank 0 does too, and waits
    /// until rank 0 has seen every rank.
    pub fn join(
        addr: &str,
        rank: u32,
        world: u32,
        secret: &JobSecret,
        timeout: Duration,
    ) -> Result<Rendezvous, DistError> {
        if rank == 0 || rank >= world {
            return Err(err(format!(
                "rank {rank} cannot join a rendezvous of {world} ranks"
            )));
        }
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no attempt");
        // A failed proof says more than the timeouts after it.
        let mut impostor: Option<String> = None;
        let mut conn = loop {
            if let Some(s) = try_connect(addr, deadline, &mut last) {
                let _ = s.set_nodelay(true);
                let by = deadline.min(Instant::now() + HELLO_TIMEOUT);
                match hello(s, (rank, world), secret, by, &Handshake::rendezvous(world)) {
                    Ok(c) => break c,
                    Err(e) => {
                        tracing::warn!("rank {rank}: the rendezvous at {addr}: {e}; retrying");
                        if e.contains("did not prove") {
                            impostor = Some(e.clone());
                        }
                        last = e;
                    }
                }
            }
            if Instant::now() >= deadline {
                let last = impostor.unwrap_or(last);
                return Err(err(format!(
                    "rank {rank} could not reach rank 0 at {addr} within {timeout:?} ({last}); is rank 0 running, and are MASTER_ADDR, MASTER_PORT and OVERLAP_JOB_SECRET the same on every rank?"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        match conn.recv(&[Kind::Ready, Kind::Reject], deadline) {
            Ok((Kind::Ready, ..)) => {}
            Ok((_, _, _, why)) => {
                return Err(err(format!(
                    "rank 0 at {addr} refused rank {rank}: {}",
                    String::from_utf8_lossy(&why)
                )))
            }
            Err(e) => {
                return Err(err(format!(
                    "rank {rank} connected to {addr} but rank 0 did not confirm within {timeout:?}: {e} (did every rank start?)"
                )))
            }
        }
        Ok(Rendezvous {
            rank,
            world,
            addr: addr.to_string(),
            role: Role::Peer(conn),
            closed: Arc::new(AtomicBool::new(false)),
            forwarded: Arc::new(AtomicBool::new(false)),
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the job.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// The address of this host that the job reaches it by: rank 0's listening address,
    /// or the local end of another rank's connection to rank 0 (the interface that
    /// routes to the job). `None` if the operating system cannot say.
    pub fn local_ip(&self) -> Option<IpAddr> {
        match &self.role {
            Role::Root(_) => self.addr.parse::<SocketAddr>().ok().map(|a| a.ip()),
            Role::Peer(c) => c.stream.local_addr().ok().map(|a| a.ip()),
        }
    }

    /// Rank 0 sends `payload` to every rank; every rank returns it (the others' argument
    /// is ignored). Waits at most `timeout` for rank 0.
    pub fn broadcast(&mut self, payload: &[u8], timeout: Duration) -> Result<Vec<u8>, DistError> {
        let deadline = Instant::now() + timeout;
        let world = self.world;
        match &mut self.role {
            Role::Root(peers) => {
                for (i, p) in peers.iter_mut().enumerate() {
                    p.send(Kind::Broadcast, 0, world, payload)
                        .map_err(|e| err(format!("rank 0 cannot send to rank {}: {e}", i + 1)))?;
                }
                Ok(payload.to_vec())
            }
            Role::Peer(s) => s
                .recv(&[Kind::Broadcast], deadline)
                .map(|(.., p)| p)
                .map_err(|e| {
                    err(format!(
                        "rank {} waited {timeout:?} for rank 0's broadcast from {}: {e}",
                        self.rank, self.addr
                    ))
                }),
        }
    }

    /// Every rank sends `payload` to rank 0, which returns all of them in rank order
    /// (`None` on the other ranks). Rank 0 waits at most `timeout` for each rank.
    pub fn gather(
        &mut self,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Option<Vec<Vec<u8>>>, DistError> {
        let deadline = Instant::now() + timeout;
        let (me, world) = (self.rank, self.world);
        match &mut self.role {
            Role::Root(peers) => {
                let mut all = vec![payload.to_vec()];
                for (i, p) in peers.iter_mut().enumerate() {
                    let rank = i as u32 + 1;
                    let (_, from, _, data) = p.recv(&[Kind::Gather], deadline).map_err(|e| {
                        err(format!(
                            "rank 0 waited {timeout:?} for rank {rank}'s result: {e}"
                        ))
                    })?;
                    if from != rank {
                        return Err(err(format!(
                            "the connection of rank {rank} sent a result as rank {from}"
                        )));
                    }
                    all.push(data);
                }
                Ok(Some(all))
            }
            Role::Peer(s) => {
                s.send(Kind::Gather, me, world, payload).map_err(|e| {
                    err(format!(
                        "rank {me} cannot send its result to rank 0 at {}: {e}",
                        self.addr
                    ))
                })?;
                Ok(None)
            }
        }
    }

    /// Every rank's `payload`, in rank order, on every rank: a [`Rendezvous::gather`]
    /// at rank 0, then its [`Rendezvous::broadcast`] of all of them. Each step waits at
    /// most `timeout`.
    pub fn all_gather(
        &mut self,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, DistError> {
        let packed = self
            .gather(payload, timeout)?
            .map(|all| {
                all.iter()
                    .flat_map(|p| {
                        (p.len() as u64)
                            .to_le_bytes()
                            .into_iter()
                            .chain(p.iter().copied())
                    })
                    .collect::<Vec<u8>>()
            })
            .unwrap_or_default();
        let packed = self.broadcast(&packed, timeout)?;
        let mut out = Vec::with_capacity(self.world as usize);
        let mut rest = &packed[..];
        while let Some((len, tail)) = rest.split_first_chunk::<8>() {
            let len = usize::try_from(u64::from_le_bytes(*len)).unwrap_or(usize::MAX);
            let Some((one, tail)) = (len <= tail.len()).then(|| tail.split_at(len)) else {
                break;
            };
            out.push(one.to_vec());
            rest = tail;
        }
        if out.len() != self.world as usize || !rest.is_empty() {
            return Err(err(format!(
                "rank {} got a malformed all-gather from rank 0 ({} bytes for {} ranks)",
                self.rank,
                packed.len(),
                self.world
            )));
        }
        Ok(out)
    }

    /// Watches the job from here on, on a thread per connection: a rank that reports a
    /// failure ([`Rendezvous::abort`]) or whose connection closes without a goodbye
    /// ([`Rendezvous::bye`]: it exited, was killed, or its machine failed) triggers
    /// `abort` on every rank of the job (rank 0 passes a rank's report on to the
    /// others), naming that rank and its error. Broadcasts and gathers keep working.
    /// Idempotent.
    pub fn watch(&mut self, abort: PeerAbort) -> Result<(), DistError> {
        let (me, world) = (self.rank, self.world);
        let conns: Vec<(u32, &mut Conn)> = match &mut self.role {
            Role::Root(peers) => peers
                .iter_mut()
                .enumerate()
                .map(|(i, c)| (i as u32 + 1, c))
                .collect(),
            Role::Peer(c) => vec![(0, c)],
        };
        let outs: Vec<(u32, Arc<Mutex<Out>>)> =
            conns.iter().map(|(r, c)| (*r, c.out.clone())).collect();
        for (peer, conn) in conns {
            if conn.inbox.is_some() {
                continue;
            }
            let stream = conn.stream.try_clone().map_err(|e| {
                err(format!(
                    "rank {me}: watching the connection of rank {peer}: {e}"
                ))
            })?;
            let reader = Conn {
                stream,
                key: conn.key,
                side: conn.side,
                received: conn.received,
                out: conn.out.clone(),
                inbox: None,
            };
            let (tx, rx) = mpsc::channel();
            let (abort, outs) = (abort.clone(), outs.clone());
            let (closed, forwarded) = (self.closed.clone(), self.forwarded.clone());
            std::thread::Builder::new()
                .name(format!("watch-rank-{peer}"))
                .stack_size(128 << 10)
                .spawn(move || {
                    let flags = (&*closed, &*forwarded);
                    watch_conn(reader, (me, peer, world), &tx, &abort, &outs, flags)
                })
                .map_err(|e| err(format!("rank {me}: cannot start watching rank {peer}: {e}")))?;
            conn.inbox = Some(rx);
        }
        Ok(())
    }

    /// Tells the job that this rank failed with `reason`: rank 0 tells every rank, any
    /// other rank tells rank 0, which passes it on. Best effort (a peer that is gone is
    /// skipped); call it before exiting with an error.
    pub fn abort(&self, reason: &str) {
        let reason = truncated(reason);
        for out in self.outs() {
            let _ = lock(&out).send(Kind::Abort, self.rank, self.world, reason.as_bytes());
        }
    }

    /// Passes on another rank's failure that this rank learned of by itself (through a
    /// data link rather than this rendezvous' watch): rank 0 tells every other rank that
    /// `rank` failed with `reason`, so that a rank sharing no link with it hears its name
    /// before it sees rank 0 go away. Only rank 0 speaks for other ranks; elsewhere this
    /// does nothing. Best effort, like [`Rendezvous::abort`].
    pub fn pass_on(&self, rank: u32, reason: &str) {
        let Role::Root(peers) = &self.role else {
            return;
        };
        // Even when the watch told them already: its thread may still be sending when
        // this process exits. A second report is ignored by its receivers.
        self.forwarded.store(true, Ordering::SeqCst);
        let reason = truncated(reason);
        for (i, c) in peers.iter().enumerate() {
            if i as u32 + 1 != rank {
                let _ = lock(&c.out).send(Kind::Abort, rank, self.world, reason.as_bytes());
            }
        }
    }

    /// Tells the job that this rank ended well, so that closing its connection is not
    /// taken for a failure. Call it last, after any gather.
    pub fn bye(&self) {
        for out in self.outs() {
            let _ = lock(&out).send(Kind::Bye, self.rank, self.world, &[]);
        }
    }

    fn outs(&self) -> Vec<Arc<Mutex<Out>>> {
        match &self.role {
            Role::Root(peers) => peers.iter().map(|c| c.out.clone()).collect(),
            Role::Peer(c) => vec![c.out.clone()],
        }
    }

    /// Every rank hands in the fingerprint of what it will run; rank 0 compares them and
    /// tells every rank the verdict. Agreement returns `Ok`; a difference is the same
    /// [`DistError::Disagree`] on every rank, naming two ranks and the first field in
    /// which they differ.
    pub fn agree(&mut self, mine: &Fingerprint, timeout: Duration) -> Result<(), DistError> {
        let all = self.gather(&mine.encode(), timeout)?;
        let verdict = match all {
            Some(all) => match crate::fingerprint::compare(&all) {
                None => vec![0u8],
                Some(msg) => [vec![1u8], msg.into_bytes()].concat(),
            },
            None => Vec::new(),
        };
        let verdict = self.broadcast(&verdict, timeout)?;
        match verdict.split_first() {
            Some((0, _)) => Ok(()),
            Some((1, msg)) => Err(DistError::Disagree(
                String::from_utf8_lossy(msg).into_owned(),
            )),
            _ => Err(err(format!(
                "rank 0 sent a verdict of {} bytes on the ranks' fingerprints",
                verdict.len()
            ))),
        }
    }
}

/// The longest failure message passed on to the other ranks.
const MAX_REASON: usize = 4096;

fn truncated(reason: &str) -> &str {
    if reason.len() <= MAX_REASON {
        return reason;
    }
    let mut end = MAX_REASON;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// One connection's watch (`me` watches `peer`'s connection in a job of `world`):
/// failures trigger `abort` (rank 0 also tells the other ranks through `outs`), other
/// frames go to `inbox` for the broadcasts and gathers.
fn watch_conn(
    mut conn: Conn,
    (me, peer, world): (u32, u32, u32),
    inbox: &mpsc::Sender<Result<Frame, String>>,
    abort: &PeerAbort,
    outs: &[(u32, Arc<Mutex<Out>>)],
    (closed, forwarded): (&AtomicBool, &AtomicBool),
) {
    let report = |rank: u32, reason: String| {
        abort.trigger(PeerFailure {
            rank,
            reason: reason.clone(),
        });
        // Rank 0 tells the others once, and what it recorded first (perhaps through a
        // data link before this watch saw anything): later failures are mostly ranks
        // exiting because of that one, and would name the wrong rank.
        if me == 0 && !forwarded.swap(true, Ordering::SeqCst) {
            let first = abort.failure().unwrap_or(PeerFailure { rank, reason });
            for (r, out) in outs {
                if *r != peer && *r != first.rank {
                    let why = truncated(&first.reason).as_bytes();
                    let _ = lock(out).send(Kind::Abort, first.rank, world, why);
                }
            }
        }
    };
    let all = [
        Kind::Broadcast,
        Kind::Gather,
        Kind::Ready,
        Kind::Reject,
        Kind::Abort,
        Kind::Bye,
    ];
    loop {
        // Years: the watch lasts as long as the job.
        let forever = Instant::now() + Duration::from_secs(1 << 30);
        match conn.read(&all, forever) {
            Ok((Kind::Bye, ..)) => return,
            Ok((Kind::Abort, rank, _, reason)) => {
                // Only rank 0 speaks for other ranks.
                let rank = if peer == 0 { rank } else { peer };
                report(rank, String::from_utf8_lossy(&reason).into_owned());
                let _ = inbox.send(Err(format!("rank {rank} failed")));
                return;
            }
            Ok(frame) => {
                if inbox.send(Ok(frame)).is_err() {
                    return;
                }
            }
            Err(_) if closed.load(Ordering::SeqCst) => return,
            Err(e) => {
                let why = format!(
                    "its connection to rank {me} closed without a goodbye ({e}): the process exited, was killed or lost its machine"
                );
                report(peer, why.clone());
                let _ = inbox.send(Err(why));
                return;
            }
        }
    }
}

/// The serving rank's side on a listener (`hs` says which protocol and which ranks it
/// serves): accepts every rank of `hs.clients`, each after it proved it holds `secret`,
/// each handshake on a thread of its own with its own deadline so that strangers (no or
/// a wrong secret, garbage, silence) are dropped and logged without delaying the ranks;
/// a second process claiming a rank already in is refused. The connections in rank
/// order, or an error naming the ranks that did not arrive within `timeout`.
fn accept_ranks(
    listener: TcpListener,
    world: u32,
    secret: &JobSecret,
    timeout: Duration,
    hs: &Handshake,
) -> Result<Vec<Conn>, DistError> {
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let deadline = Instant::now() + timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| err(format!("listener on {local}: {e}")))?;
    let (tx, rx) = mpsc::channel::<Arrival>();
    let pending = Arc::new(AtomicUsize::new(0));
    let mut peers: Vec<Option<Conn>> = hs.clients.clone().map(|_| None).collect();
    while peers.iter().any(Option::is_none) {
        let mut idle = true;
        match listener.accept() {
            Ok((stream, from)) => {
                idle = false;
                let by = deadline.min(Instant::now() + HELLO_TIMEOUT);
                let ctx = (tx.clone(), pending.clone(), secret.clone(), hs.clone());
                spawn_greeting(stream, from, (world, by), &local, ctx);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of file descriptors, a reset before accept: not fatal.
                tracing::warn!("rendezvous on {local}: accept: {e}");
            }
        }
        while let Ok(a) = rx.try_recv() {
            idle = false;
            let Some(slot) =
                (a.rank.checked_sub(hs.clients.start)).and_then(|i| peers.get_mut(i as usize))
            else {
                continue;
            };
            if slot.is_some() {
                let why = format!(
                    "rank {} already joined; this second process with RANK={} (from {}) is refused: give every process its own rank",
                    a.rank, a.rank, a.from
                );
                tracing::warn!("rendezvous on {local}: {why}");
                let _ = a.conn.send(Kind::Reject, hs.server, world, why.as_bytes());
                continue;
            }
            *slot = Some(a.conn);
        }
        if Instant::now() >= deadline && peers.iter().any(Option::is_none) {
            let missing: Vec<u32> = (hs.clients.clone().zip(&peers))
                .filter(|(_, p)| p.is_none())
                .map(|(r, _)| r)
                .collect();
            return Err(err(format!(
                "rank {} waited {timeout:?} on {local}: ranks {missing:?} of {world} did not arrive (a rank with another OVERLAP_JOB_SECRET is dropped and logged here)",
                hs.server
            )));
        }
        if idle {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(peers.into_iter().flatten().collect())
}

/// Greets one new connection on a thread of its own (at most [`MAX_PENDING`] at once;
/// beyond, the connection is closed): a rank that proves the secret is handed to the
/// accepting loop through `tx`, anything else is dropped and logged.
fn spawn_greeting(
    stream: TcpStream,
    from: SocketAddr,
    (world, by): (u32, Instant),
    local: &str,
    (tx, pending, secret, hs): (
        mpsc::Sender<Arrival>,
        Arc<AtomicUsize>,
        JobSecret,
        Handshake,
    ),
) {
    if pending.load(Ordering::SeqCst) >= MAX_PENDING {
        tracing::warn!(
            "rendezvous on {local}: {MAX_PENDING} handshakes in progress; closing a connection from {from}"
        );
        return;
    }
    pending.fetch_add(1, Ordering::SeqCst);
    let at = local.to_string();
    let counter = pending.clone();
    let spawned = std::thread::Builder::new()
        .name("rendezvous-hello".into())
        .stack_size(64 << 10)
        .spawn(move || {
            match greet(stream, world, &secret, by, &hs) {
                Ok((rank, conn)) => {
                    // The accepting loop may be gone (it finished): then the connection
                    // just closes.
                    let _ = tx.send(Arrival { rank, from, conn });
                }
                Err(e) => {
                    tracing::warn!("rendezvous on {at}: dropped a connection from {from}: {e}")
                }
            }
            counter.fetch_sub(1, Ordering::SeqCst);
        });
    if let Err(e) = spawned {
        pending.fetch_sub(1, Ordering::SeqCst);
        tracing::warn!("rendezvous on {local}: cannot handle a connection from {from}: {e}");
    }
}

/// A CPU link's serving side ([`crate::cpu`]): rank `me` of `world` accepts the ranks
/// below it on `listener`, each proving the secret (and hearing it proved by rank `me`),
/// within `timeout`; their connections in rank order.
pub(crate) fn accept_links(
    listener: TcpListener,
    (me, world): (u32, u32),
    secret: &JobSecret,
    timeout: Duration,
) -> Result<Vec<(u32, TcpStream)>, DistError> {
    let conns = accept_ranks(listener, world, secret, timeout, &Handshake::cpu_link(me))?;
    Ok((0..me).zip(conns.into_iter().map(|c| c.stream)).collect())
}

/// A CPU link's connecting side ([`crate::cpu`]): rank `me` of `world` connects to rank
/// `peer` at `addr`, retrying until `timeout`, and the two prove the job's secret to
/// each other.
pub(crate) fn connect_link(
    addr: &str,
    (me, peer, world): (u32, u32, u32),
    secret: &JobSecret,
    timeout: Duration,
) -> Result<TcpStream, DistError> {
    let deadline = Instant::now() + timeout;
    let hs = Handshake::cpu_link(peer);
    let mut last = String::from("no attempt");
    loop {
        if let Some(s) = try_connect(addr, deadline, &mut last) {
            let _ = s.set_nodelay(true);
            let by = deadline.min(Instant::now() + HELLO_TIMEOUT);
            match hello(s, (me, world), secret, by, &hs) {
                Ok(c) => return Ok(c.stream),
                Err(e) => {
                    tracing::warn!(
                        "rank {me}: the CPU link to rank {peer} at {addr}: {e}; retrying"
                    );
                    last = e;
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(err(format!(
                "rank {me} could not open its CPU link to rank {peer} at {addr} within {timeout:?} ({last})"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The serving rank's handshake with one new connection (`hs` says which protocol):
/// `(rank, connection)` of a rank that proved it holds the secret and claims a rank and
/// world size that fit the job.
fn greet(
    stream: TcpStream,
    world: u32,
    secret: &JobSecret,
    by: Instant,
    hs: &Handshake,
) -> Result<(u32, Conn), String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let n0 = random::<NONCE>().map_err(|e| e.to_string())?;
    write_raw(&stream, Kind::Challenge, hs.server, world, &n0).map_err(|e| e.to_string())?;
    let (_, _, rank, peer_world, len) =
        read_header(&stream, &[Kind::Hello], (NONCE + TAG) as u64, by)?;
    if len != (NONCE + TAG) as u64 {
        return Err(format!("a hello of {len} bytes, not {}", NONCE + TAG));
    }
    let mut body = [0u8; NONCE + TAG];
    read_exact(&stream, &mut body, by)?;
    let mut nk = [0u8; NONCE];
    nk.copy_from_slice(&body[..NONCE]);
    let t = transcript(&n0, &nk, rank, peer_world);
    secret
        .mac(&hs.hello, &t)
        .verify_slice(&body[NONCE..])
        .map_err(|_| {
            format!("it claims rank {rank} of {peer_world} but does not hold this job's secret (OVERLAP_JOB_SECRET differs, or it is not one of this job's ranks)")
        })?;
    let proof = secret.mac(&hs.welcome, &t).finalize().into_bytes();
    write_raw(&stream, Kind::Welcome, hs.server, world, &proof).map_err(|e| e.to_string())?;
    let conn = Conn::new(stream, secret, (&hs.session, &t), 0)?;
    let why = if peer_world != world {
        Some(format!(
            "rank {rank} says the world has {peer_world} ranks, rank {} has {world}: WORLD_SIZE differs between ranks",
            hs.server
        ))
    } else if !hs.clients.contains(&rank) {
        Some(format!(
            "rank {rank} is not a rank {}..{} of this job",
            hs.clients.start, hs.clients.end
        ))
    } else {
        None
    };
    if let Some(why) = why {
        let _ = conn.send(Kind::Reject, hs.server, world, why.as_bytes());
        return Err(why);
    }
    Ok((rank, conn))
}

/// A rank's handshake on a fresh connection to the serving rank (`hs` says which
/// protocol), before `by`.
fn hello(
    stream: TcpStream,
    (rank, world): (u32, u32),
    secret: &JobSecret,
    by: Instant,
    hs: &Handshake,
) -> Result<Conn, String> {
    let (_, _, _, _, len) = read_header(&stream, &[Kind::Challenge], NONCE as u64, by)?;
    if len != NONCE as u64 {
        return Err(format!("a challenge of {len} bytes, not {NONCE}"));
    }
    let mut n0 = [0u8; NONCE];
    read_exact(&stream, &mut n0, by)?;
    let nk = random::<NONCE>().map_err(|e| e.to_string())?;
    let t = transcript(&n0, &nk, rank, world);
    let mac = secret.mac(&hs.hello, &t).finalize().into_bytes();
    write_raw(
        &stream,
        Kind::Hello,
        rank,
        world,
        &[&nk[..], &mac[..]].concat(),
    )
    .map_err(|e| e.to_string())?;
    let (_, _, _, _, len) = read_header(&stream, &[Kind::Welcome], TAG as u64, by)?;
    let mut proof = [0u8; TAG];
    if len != TAG as u64 {
        return Err(format!("a welcome of {len} bytes, not {TAG}"));
    }
    read_exact(&stream, &mut proof, by)?;
    secret
        .mac(&hs.welcome, &t)
        .verify_slice(&proof)
        .map_err(|_| {
            format!(
                "the process there did not prove it holds this job's secret as rank {} (another job on that port, or OVERLAP_JOB_SECRET differs)",
                hs.server
            )
        })?;
    Conn::new(stream, secret, (&hs.session, &t), 1)
}

/// One connection attempt to every address `addr` resolves to.
fn try_connect(addr: &str, deadline: Instant, last: &mut String) -> Option<TcpStream> {
    let addrs = match addr.to_socket_addrs() {
        Ok(a) => a,
        Err(e) => {
            *last = format!("cannot resolve {addr}: {e}");
            return None;
        }
    };
    for a in addrs {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(10), Duration::from_secs(5));
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => return Some(s),
            Err(e) => *last = format!("{a}: {e}"),
        }
    }
    None
}

/// Rank 0's listener: on `bind` (an IP address, from `OVERLAP_BIND_ADDR`) when given,
/// else on the first address `MASTER_ADDR` resolves to that can be bound on this host;
/// never on the wildcard unless asked.
pub fn listen(host: &str, port: u16, bind: Option<&str>) -> Result<TcpListener, DistError> {
    let bound = |a: SocketAddr| {
        TcpListener::bind(a)
            .map_err(|e| format!("rank 0 cannot listen on {a} (MASTER_PORT={port}): {e}"))
    };
    if let Some(b) = bind {
        let ip: IpAddr = b.trim().parse().map_err(|_| DistError::Env {
            var: BIND_VAR.into(),
            reason: format!("`{b}` is not an IP address (e.g. 0.0.0.0 for every interface)"),
        })?;
        return bound(SocketAddr::new(ip, port)).map_err(err);
    }
    let resolved: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            err(format!(
                "cannot resolve MASTER_ADDR `{host}`: {e}; set it to rank 0's host name or address"
            ))
        })?
        .collect();
    let mut last = format!("MASTER_ADDR `{host}` resolves to no address");
    for a in resolved {
        match bound(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = e,
        }
    }
    Err(err(format!(
        "{last}; is another job using the port? If MASTER_ADDR is not an address of this host (NAT, a load balancer), set {BIND_VAR} to the local address to listen on"
    )))
}

fn header(kind: Kind, rank: u32, world: u32, len: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&MAGIC);
    h[4..8].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[8] = kind as u8;
    h[9..13].copy_from_slice(&rank.to_le_bytes());
    h[13..17].copy_from_slice(&world.to_le_bytes());
    h[17..25].copy_from_slice(&len.to_le_bytes());
    h
}

/// An untagged frame (the handshake's).
fn write_raw(
    mut s: &TcpStream,
    kind: Kind,
    rank: u32,
    world: u32,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut buf = header(kind, rank, world, payload.len() as u64).to_vec();
    buf.extend_from_slice(payload);
    s.write_all(&buf)?;
    s.flush()
}

/// Reads and checks one frame header, of one of `kinds`, announcing at most `max`
/// payload bytes: `(header, kind, rank, world, length)`.
#[allow(clippy::type_complexity)]
fn read_header(
    s: &TcpStream,
    kinds: &[Kind],
    max: u64,
    deadline: Instant,
) -> Result<([u8; HEADER], Kind, u32, u32, u64), String> {
    let mut h = [0u8; HEADER];
    read_exact(s, &mut h, deadline)?;
    if h[..4] != MAGIC {
        return Err(format!(
            "not an overlap rendezvous peer (it sent {:02x?})",
            &h[..4]
        ));
    }
    let word = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
    let version = word(4);
    if version != PROTOCOL_VERSION {
        return Err(format!(
            "rendezvous protocol version {version}, this overlap speaks {PROTOCOL_VERSION}: run the same overlap build on every rank"
        ));
    }
    let kind = Kind::of(h[8])
        .filter(|k| kinds.contains(k))
        .ok_or_else(|| {
            format!(
                "expected a {kinds:?} frame, got kind {} (the ranks disagree on what happens next)",
                h[8]
            )
        })?;
    let mut len = [0u8; 8];
    len.copy_from_slice(&h[17..25]);
    let len = u64::from_le_bytes(len);
    if len > max {
        return Err(format!(
            "a {kind:?} payload of {len} bytes is larger than {max}"
        ));
    }
    Ok((h, kind, word(9), word(13), len))
}

fn read_exact(mut s: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), String> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("timed out".into());
        }
        s.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err("the connection closed (did that rank exit?)".into()),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (l, addr)
    }

    fn secret() -> JobSecret {
        JobSecret::new(b"test secret of this job, 32 byte".to_vec()).unwrap()
    }

    fn other_secret() -> JobSecret {
        JobSecret::new(b"someone else's secret, 32 bytes!".to_vec()).unwrap()
    }

    /// Starts ranks `ranks` of `world` joining `addr` on threads.
    fn join_all(
        addr: &str,
        ranks: std::ops::Range<u32>,
        world: u32,
        s: &JobSecret,
        t: Duration,
    ) -> Vec<std::thread::JoinHandle<Result<Rendezvous, DistError>>> {
        ranks
            .map(|rank| {
                let (addr, s) = (addr.to_string(), s.clone());
                std::thread::spawn(move || Rendezvous::join(&addr, rank, world, &s, t))
            })
            .collect()
    }

    #[test]
    fn ranks_meet_broadcast_and_gather_over_loopback() {
        let (l, addr) = listener();
        let t = Duration::from_secs(10);
        let s = secret();
        let peers: Vec<_> = (1..3u32)
            .map(|rank| {
                let (addr, s) = (addr.clone(), s.clone());
                std::thread::spawn(move || {
                    let mut r = Rendezvous::join(&addr, rank, 3, &s, t).unwrap();
                    let got = r.broadcast(&[], t).unwrap();
                    assert_eq!(got, b"ids");
                    assert!(r.gather(&[rank as u8; 2], t).unwrap().is_none());
                    let all = r.all_gather(&vec![rank as u8; rank as usize], t).unwrap();
                    assert_eq!(all, vec![vec![], vec![1], vec![2, 2]]);
                })
            })
            .collect();
        let mut root = Rendezvous::serve(l, 3, &s, t).unwrap();
        assert_eq!(root.broadcast(b"ids", t).unwrap(), b"ids");
        let all = root.gather(&[0, 0], t).unwrap().unwrap();
        assert_eq!(all, vec![vec![0, 0], vec![1, 1], vec![2, 2]]);
        let all = root.all_gather(&[], t).unwrap();
        assert_eq!(all, vec![vec![], vec![1], vec![2, 2]]);
        peers.into_iter().for_each(|p| p.join().unwrap());
    }

    /// A job of `world` ranks on loopback, every rank watched: `(rendezvous, signal)`
    /// in rank order.
    fn watched_job(world: u32) -> Vec<(Rendezvous, PeerAbort)> {
        let (l, addr) = listener();
        let t = Duration::from_secs(10);
        let s = secret();
        let peers = join_all(&addr, 1..world, world, &s, t);
        let root = Rendezvous::serve(l, world, &s, t).unwrap();
        std::iter::once(root)
            .chain(peers.into_iter().map(|p| p.join().unwrap().unwrap()))
            .map(|mut r| {
                let a = PeerAbort::new();
                r.watch(a.clone()).unwrap();
                (r, a)
            })
            .collect()
    }

    fn wait_for(a: &PeerAbort) -> PeerFailure {
        let by = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(f) = a.failure() {
                return f;
            }
            assert!(Instant::now() < by, "no failure reported");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn a_ranks_failure_reaches_every_rank_through_rank_0() {
        let job = watched_job(3);
        job[2].0.abort("step 2 failed: out of memory");
        for (rank, (_, a)) in job.iter().enumerate() {
            if rank == 2 {
                continue;
            }
            let f = wait_for(a);
            assert_eq!(f.rank, 2, "rank {rank}");
            assert_eq!(f.reason, "step 2 failed: out of memory");
        }
        assert!(
            job[2].1.failure().is_none(),
            "a rank is not told its own failure"
        );
        // Rank 0's own failure reaches the others.
        let job = watched_job(3);
        job[0].0.abort("rank 0 broke");
        for (_, a) in &job[1..] {
            assert_eq!(wait_for(a).rank, 0);
        }
    }

    #[test]
    fn the_start_timeout_is_read_strictly() {
        let d = Duration::from_secs(180);
        assert_eq!(timeout_from(None, d).unwrap(), d);
        assert_eq!(timeout_from(Some(" "), d).unwrap(), d);
        assert_eq!(timeout_from(Some("5"), d).unwrap(), Duration::from_secs(5));
        for bad in ["0", "-1", "1.5", "soon", "18446744073709551615", "604801"] {
            let e = timeout_from(Some(bad), d).unwrap_err().to_string();
            assert!(e.contains(TIMEOUT_VAR) && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn rank_0_passes_on_a_failure_it_learned_of_elsewhere_before_it_exits() {
        let mut job = watched_job(4);
        // Rank 0 learned of it through its data link to rank 1, so its own signal is
        // already set, and it exits right after passing it on.
        job[0].1.trigger(PeerFailure {
            rank: 1,
            reason: "link".into(),
        });
        let (root, _) = job.remove(0);
        root.pass_on(1, "rank 1's connection to rank 0 closed without a goodbye");
        drop(root);
        // The ranks that share no link with rank 1 name rank 1, not rank 0's exit.
        for (r, a) in &job[1..] {
            let f = wait_for(a);
            assert_eq!(f.rank, 1, "rank {}", r.rank());
            assert!(f.reason.starts_with("rank 1's connection"), "{}", f.reason);
        }
        // Another rank cannot speak for others: nothing is sent. Each rank's gather
        // frame follows whatever it sent before on the same connection, so once rank 0
        // has every rank's gather, anything sent earlier has been read.
        let t = Duration::from_secs(10);
        let mut job = watched_job(3);
        job[1].0.pass_on(2, "hearsay");
        let (mut root, a0) = job.remove(0);
        let peers: Vec<_> = job
            .into_iter()
            .map(|(mut r, a)| {
                std::thread::spawn(move || {
                    assert!(r.gather(&[1], t).unwrap().is_none());
                    (r, a)
                })
            })
            .collect();
        assert_eq!(root.gather(&[1], t).unwrap().unwrap().len(), 3);
        let peers: Vec<_> = peers.into_iter().map(|p| p.join().unwrap()).collect();
        assert!(a0.failure().is_none(), "{:?}", a0.failure());
        assert!(peers.iter().all(|(_, a)| a.failure().is_none()));
    }

    #[test]
    fn a_connection_closed_without_a_goodbye_is_a_failure_of_that_rank() {
        let mut job = watched_job(3);
        let (gone, _) = job.remove(1);
        drop(gone);
        for (r, a) in &job {
            let f = wait_for(a);
            assert_eq!(f.rank, 1, "rank {}", r.rank());
            assert!(f.reason.contains("without a goodbye"), "{}", f.reason);
        }
        // Rank 0 gone: the others name it.
        let mut job = watched_job(2);
        drop(job.remove(0));
        assert_eq!(wait_for(&job[0].1).rank, 0);
    }

    #[test]
    fn ranks_that_say_goodbye_are_no_failure_and_gathers_work_while_watched() {
        let t = Duration::from_secs(10);
        let mut job = watched_job(3);
        let (mut root, a0) = job.remove(0);
        let peers: Vec<_> = job
            .into_iter()
            .map(|(mut r, a)| {
                std::thread::spawn(move || {
                    assert_eq!(r.broadcast(&[], t).unwrap(), b"go");
                    let me = r.rank() as u8;
                    assert!(r.gather(&[me], t).unwrap().is_none());
                    r.bye();
                    (r, a)
                })
            })
            .collect();
        assert_eq!(root.broadcast(b"go", t).unwrap(), b"go");
        let all = root.gather(&[0], t).unwrap().unwrap();
        assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        let peers: Vec<_> = peers.into_iter().map(|p| p.join().unwrap()).collect();
        drop(peers);
        root.bye();
        // Every watch thread of rank 0 has ended (its inbox is disconnected) once it read
        // its peer's goodbye: whatever it would report, it has reported.
        watches_ended(&root);
        assert!(a0.failure().is_none(), "{:?}", a0.failure());
    }

    /// Waits until every watch thread of `r` has ended: each drops its inbox's sender.
    fn watches_ended(r: &Rendezvous) {
        let Role::Root(peers) = &r.role else {
            panic!("rank 0 expected")
        };
        for c in peers {
            let inbox = c.inbox.as_ref().expect("watched");
            loop {
                match inbox.recv_timeout(Duration::from_secs(10)) {
                    Ok(_) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    Err(mpsc::RecvTimeoutError::Timeout) => panic!("a watch thread did not end"),
                }
            }
        }
    }

    #[test]
    fn a_rank_that_never_arrives_is_named_in_the_timeout() {
        let (l, addr) = listener();
        let t = Duration::from_millis(400);
        let peer = join_all(&addr, 1..2, 3, &secret(), Duration::from_secs(5));
        let e = Rendezvous::serve(l, 3, &secret(), t)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("ranks [2] of 3 did not arrive"), "{e}");
        // The rank that did arrive is told, not left waiting forever.
        assert!(peer.into_iter().next().unwrap().join().unwrap().is_err());
    }

    #[test]
    fn a_peer_without_rank_0_times_out_with_advice() {
        let (l, addr) = listener();
        drop(l);
        let e = Rendezvous::join(&addr, 1, 2, &secret(), Duration::from_millis(300))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("could not reach rank 0")
                && e.contains("MASTER_PORT")
                && e.contains("OVERLAP_JOB_SECRET"),
            "{e}"
        );
    }

    /// A client that speaks the protocol and claims `rank` of `world`, with `key` as
    /// the secret: what a forged or misconfigured rank sends.
    fn forged_hello(addr: &str, rank: u32, world: u32, key: &JobSecret) -> Result<Conn, String> {
        let s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        let by = Instant::now() + Duration::from_secs(5);
        hello(s, (rank, world), key, by, &Handshake::rendezvous(world))
    }

    #[test]
    fn strangers_forgeries_and_garbage_are_dropped_and_the_job_still_meets() {
        let (l, addr) = listener();
        let t = Duration::from_secs(20);
        let s = secret();
        let root = std::thread::spawn(move || Rendezvous::serve(l, 3, &s, t));
        // A forged hello claiming rank 1 (wrong secret): rank 0 proves nothing to it
        // and it never takes rank 1's place.
        let e = forged_hello(&addr, 1, 3, &other_secret()).err().unwrap();
        assert!(e.contains("closed") || e.contains("reset"), "{e}");
        // Claims of rank 0, of a wrong world size, of a rank outside the job, without
        // the secret: dropped the same way.
        for (rank, world) in [(0, 3), (1, 7), (9, 3)] {
            assert!(forged_hello(&addr, rank, world, &other_secret()).is_err());
        }
        // Garbage, an HTTP request, and a valid header announcing an enormous hello.
        let mut g = TcpStream::connect(&addr).unwrap();
        g.write_all(b"\x00\x01garbage garbage garbage garbage")
            .unwrap();
        let mut h = TcpStream::connect(&addr).unwrap();
        h.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut big = TcpStream::connect(&addr).unwrap();
        big.write_all(&header(Kind::Hello, 1, 3, u64::MAX)).unwrap();
        // The real ranks still meet.
        let s = secret();
        let peers = join_all(&addr, 1..3, 3, &s, t);
        let root = root.join().unwrap().unwrap();
        assert_eq!((root.rank(), root.world()), (0, 3));
        for p in peers {
            p.join().unwrap().unwrap();
        }
    }

    #[test]
    fn a_rank_with_the_secret_but_a_wrong_world_rank_or_duplicate_is_refused_alone() {
        let (l, addr) = listener();
        let t = Duration::from_secs(20);
        let s = secret();
        let root = {
            let s = s.clone();
            std::thread::spawn(move || Rendezvous::serve(l, 3, &s, t))
        };
        let wrong_world = Rendezvous::join(&addr, 1, 4, &s, t)
            .err()
            .unwrap()
            .to_string();
        assert!(
            wrong_world.contains("refused") && wrong_world.contains("WORLD_SIZE differs"),
            "{wrong_world}"
        );
        let mut c = forged_hello(&addr, 5, 3, &s).unwrap();
        let (kind, .., why) = c
            .recv(&[Kind::Ready, Kind::Reject], Instant::now() + t)
            .unwrap();
        assert_eq!(kind, Kind::Reject);
        assert!(String::from_utf8_lossy(&why).contains("not a rank 1..3"));
        // Two processes claim rank 1 (and rank 2 comes too): rank 0 keeps whichever
        // completes its handshake first and refuses the other, so exactly one gets in.
        let first = join_all(&addr, 1..2, 3, &s, t);
        let second = {
            let (addr, s) = (addr.clone(), s.clone());
            std::thread::spawn(move || Rendezvous::join(&addr, 1, 3, &s, t))
        };
        let rank2 = join_all(&addr, 2..3, 3, &s, t);
        assert!(root.join().unwrap().is_ok());
        rank2.into_iter().for_each(|p| {
            p.join().unwrap().unwrap();
        });
        let first = first.into_iter().next().unwrap().join().unwrap();
        let second = second.join().unwrap();
        assert!(
            first.is_ok() != second.is_ok(),
            "both or neither got in: {:?} / {:?}",
            first.as_ref().err().map(|e| e.to_string()),
            second.as_ref().err().map(|e| e.to_string())
        );
        let refused = first.err().or(second.err()).unwrap().to_string();
        // The loser is refused as a duplicate, or (had it come after the meeting) finds
        // the rendezvous closed; it never joins.
        assert!(
            refused.contains("already joined") || refused.contains("rank 0"),
            "{refused}"
        );
    }

    #[test]
    fn a_job_of_one_rank_needs_no_secret() {
        let env = RankEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: None,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            launcher: crate::env::Launcher::Torchrun,
        };
        // Whether or not another test set the variable, one rank always has a secret.
        assert!(JobSecret::for_job(&env).is_ok());
    }

    #[test]
    fn a_rank_refuses_an_impostor_rank_0() {
        // One with another secret: neither side accepts the other.
        let (l, addr) = listener();
        let t = Duration::from_millis(1200);
        let impostor = std::thread::spawn(move || Rendezvous::serve(l, 2, &other_secret(), t));
        assert!(Rendezvous::join(&addr, 1, 2, &secret(), Duration::from_millis(800)).is_err());
        assert!(impostor.join().unwrap().is_err());
        // One that answers every hello with a made-up proof.
        let (l, addr) = listener();
        std::thread::spawn(move || {
            for stream in l.incoming().take(50) {
                let Ok(stream) = stream else { return };
                let by = Instant::now() + Duration::from_secs(5);
                let _ = write_raw(&stream, Kind::Challenge, 0, 2, &[7; NONCE]);
                let mut hello = [0u8; HEADER + NONCE + TAG];
                if read_exact(&stream, &mut hello, by).is_ok() {
                    let _ = write_raw(&stream, Kind::Welcome, 0, 2, &[9; TAG]);
                }
            }
        });
        let e = Rendezvous::join(&addr, 1, 2, &secret(), Duration::from_millis(800))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("did not prove it holds this job's secret"),
            "{e}"
        );
    }

    #[test]
    fn idle_and_garbage_connections_do_not_delay_the_ranks() {
        let (l, addr) = listener();
        let t = Duration::from_secs(60);
        let s = secret();
        let root = {
            let s = s.clone();
            std::thread::spawn(move || Rendezvous::serve(l, 3, &s, t))
        };
        // 100 idle sockets and 100 that send garbage, all before the real ranks.
        let mut held = Vec::new();
        for i in 0..200 {
            let mut c = TcpStream::connect(&addr).unwrap();
            if i % 2 == 1 {
                let _ = c.write_all(b"\xde\xad\xbe\xef not a frame at all ................");
            }
            held.push(c);
        }
        let start = Instant::now();
        let peers = join_all(&addr, 1..3, 3, &s, t);
        for p in peers {
            p.join().unwrap().unwrap();
        }
        let delay = start.elapsed();
        assert!(root.join().unwrap().is_ok());
        println!("ranks met {delay:?} after 100 idle and 100 garbage connections");
        // Handled one at a time, each idle socket would hold rank 0 for HELLO_TIMEOUT.
        assert!(delay < HELLO_TIMEOUT, "{delay:?}");
        drop(held);
    }

    #[test]
    fn ranks_agree_or_every_rank_gets_the_same_disagreement() {
        let t = Duration::from_secs(10);
        let s = secret();
        let base = Fingerprint::build();
        let mut other = base.clone();
        other.push("buckets.cap_bytes", "1");
        let mut a = base.clone();
        a.push("buckets.cap_bytes", "26214400");
        for (fps, want) in [
            (vec![a.clone(), a.clone(), a.clone()], None),
            (
                vec![a.clone(), a.clone(), other.clone()],
                Some("ranks 0 and 2 disagree on `buckets.cap_bytes`: 26214400 vs 1"),
            ),
        ] {
            let (l, addr) = listener();
            let peers: Vec<_> = (1..3u32)
                .map(|rank| {
                    let (addr, s, fp) = (addr.clone(), s.clone(), fps[rank as usize].clone());
                    std::thread::spawn(move || {
                        Rendezvous::join(&addr, rank, 3, &s, t)
                            .unwrap()
                            .agree(&fp, t)
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            let root = Rendezvous::serve(l, 3, &s, t).unwrap().agree(&fps[0], t);
            let mut results = vec![root.map_err(|e| e.to_string())];
            results.extend(peers.into_iter().map(|p| p.join().unwrap()));
            for r in results {
                assert_eq!(r.err().as_deref(), want);
            }
        }
    }

    #[test]
    fn secrets_come_from_the_variable_or_a_file_and_are_never_shown() {
        let get = |pairs: Vec<(&'static str, String)>| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        };
        assert!(JobSecret::from_vars(get(vec![])).unwrap().is_none());
        let e = JobSecret::from_vars(get(vec![(SECRET_VAR, "short".into())]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("fewer than 16"), "{e}");
        let s = JobSecret::from_vars(get(vec![(SECRET_VAR, "a".repeat(20))]))
            .unwrap()
            .unwrap();
        assert_eq!(format!("{s:?}"), "JobSecret(20 bytes)");
        let dir = std::env::temp_dir().join(format!("overlap-secret-{}", std::process::id()));
        std::fs::write(&dir, format!("{}\n", "b".repeat(24))).unwrap();
        let f = JobSecret::from_vars(get(vec![(SECRET_FILE_VAR, dir.display().to_string())]))
            .unwrap()
            .unwrap();
        assert_eq!(f.expose(), "b".repeat(24));
        std::fs::remove_file(&dir).unwrap();
        let e = JobSecret::from_vars(get(vec![(SECRET_FILE_VAR, dir.display().to_string())]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(SECRET_FILE_VAR), "{e}");
        let g = JobSecret::generate().unwrap();
        assert_eq!(g.expose().len(), 64);
        assert_ne!(g.expose(), JobSecret::generate().unwrap().expose());
    }

    #[test]
    fn rank_0_listens_on_master_addr_not_the_wildcard() {
        let l = listen("127.0.0.1", 0, None).unwrap();
        assert_eq!(l.local_addr().unwrap().ip(), IpAddr::from([127, 0, 0, 1]));
        let l = listen("localhost", 0, Some("127.0.0.1")).unwrap();
        assert!(l.local_addr().unwrap().ip().is_loopback());
        let e = listen("127.0.0.1", 0, Some("everywhere"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(BIND_VAR), "{e}");
        // An address that is not this host's cannot be bound: the error says what to set.
        let e = listen("192.0.2.1", 0, None).unwrap_err().to_string();
        assert!(e.contains(BIND_VAR), "{e}");
    }
}
