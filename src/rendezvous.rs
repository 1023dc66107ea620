//! A small TCP rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every other
//! rank connects, and the connections stay open for the job so rank 0 can broadcast a
//! payload (the NCCL unique ids) and gather small results (verify's figures).
//!
//! Every message is a frame: the magic `OVRZ`, a protocol version, a kind, the sender's
//! rank and world size, a payload length and the payload. A peer that speaks another
//! protocol (or another version) is refused with an error naming what it sent; a rank
//! that does not arrive, or does not answer, in time is named in a timeout error.
//!
//! Invariant: every blocking step has a deadline; on any error the rendezvous is left
//! unusable (the caller exits), never half-synchronised.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::dist::{DistError, RankEnv};

const MAGIC: [u8; 4] = *b"OVRZ";
const VERSION: u32 = 1;
/// Largest payload accepted (protects rank 0 from a stray client's length).
const MAX_PAYLOAD: u64 = 256 << 20;
const HEADER: usize = 4 + 4 + 1 + 4 + 4 + 8;
/// How long rank 0 waits for a new connection's greeting.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    Broadcast = 2,
    Gather = 3,
}

/// The variable that overrides how long ranks wait for each other at start, in seconds.
pub const TIMEOUT_VAR: &str = "OVERLAP_RENDEZVOUS_TIMEOUT_S";

/// How long to wait for the other ranks at start: `OVERLAP_RENDEZVOUS_TIMEOUT_S`
/// seconds when set to a number, else `default`.
pub fn start_timeout(default: Duration) -> Duration {
    std::env::var(TIMEOUT_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(default, Duration::from_secs)
}

/// One rank's end of the rendezvous.
pub struct Rendezvous {
    rank: u32,
    world: u32,
    /// Where rank 0 listens (for messages).
    addr: String,
    role: Role,
}

enum Role {
    /// Rank 0: one connection per other rank, at `rank - 1`.
    Root(Vec<TcpStream>),
    /// Another rank: its connection to rank 0.
    Peer(TcpStream),
}

fn err(msg: String) -> DistError {
    DistError::Rendezvous(msg)
}

impl Rendezvous {
    /// Joins the job's rendezvous: rank 0 listens on `MASTER_PORT` and waits for every
    /// other rank; the others connect to `MASTER_ADDR:MASTER_PORT`, retrying until
    /// `timeout`.
    pub fn connect(env: &RankEnv, timeout: Duration) -> Result<Rendezvous, DistError> {
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        if env.rank == 0 {
            let bind = bind_addr(&env.master_addr, env.master_port)?;
            let listener = TcpListener::bind(bind).map_err(|e| {
                err(format!(
                    "rank 0 cannot listen on {bind} (MASTER_PORT={}): {e}; is another job using the port?",
                    env.master_port
                ))
            })?;
            Rendezvous::serve(listener, env.world_size, timeout)
        } else {
            Rendezvous::join(&addr, env.rank, env.world_size, timeout)
        }
    }

    /// Rank 0's side on a listener: accepts the other `world - 1` ranks.
    pub fn serve(
        listener: TcpListener,
        world: u32,
        timeout: Duration,
    ) -> Result<Rendezvous, DistError> {
        let local = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let deadline = Instant::now() + timeout;
        listener
            .set_nonblocking(true)
            .map_err(|e| err(format!("listener on {local}: {e}")))?;
        let mut peers: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
        while peers.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((stream, from)) => {
                    // A silent stranger may hold the accept loop for a few seconds at most.
                    let hello_by = deadline.min(Instant::now() + HELLO_TIMEOUT);
                    let accepted = stream
                        .set_nonblocking(false)
                        .map_err(|e| e.to_string())
                        .and_then(|()| read_frame(&stream, Kind::Hello, hello_by));
                    let (rank, peer_world, _) = match accepted {
                        Ok(f) => f,
                        Err(e) => {
                            // Not one of ours (a port scanner, another job): ignore it.
                            tracing::warn!(
                                "rendezvous on {local}: ignoring a connection from {from}: {e}"
                            );
                            continue;
                        }
                    };
                    if peer_world != world {
                        return Err(err(format!(
                            "rank {rank} (from {from}) says the world has {peer_world} ranks, rank 0 has {world}: WORLD_SIZE differs between ranks"
                        )));
                    }
                    let slot = rank
                        .checked_sub(1)
                        .and_then(|i| peers.get_mut(i as usize))
                        .ok_or_else(|| {
                            err(format!(
                                "a peer from {from} claims rank {rank}, not a rank 1..{world}"
                            ))
                        })?;
                    if slot.is_some() {
                        return Err(err(format!(
                            "rank {rank} arrived twice (the second from {from}): two processes have RANK={rank}"
                        )));
                    }
                    *slot = Some(stream);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<u32> = peers
                            .iter()
                            .enumerate()
                            .filter(|(_, p)| p.is_none())
                            .map(|(i, _)| i as u32 + 1)
                            .collect();
                        return Err(err(format!(
                            "rank 0 waited {timeout:?} on {local}: ranks {missing:?} of {world} did not arrive"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(err(format!("accepting on {local}: {e}"))),
            }
        }
        let peers: Vec<TcpStream> = peers.into_iter().flatten().collect();
        for (i, p) in peers.iter().enumerate() {
            // Tell each peer it is in (an empty broadcast): `join` returns only then.
            write_frame(p, Kind::Hello, 0, world, &[])
                .map_err(|e| err(format!("rank 0 cannot greet rank {}: {e}", i + 1)))?;
        }
        Ok(Rendezvous {
            rank: 0,
            world,
            addr: local,
            role: Role::Root(peers),
        })
    }

    /// Another rank's side: connects to rank 0 at `addr` (`host:port`), retrying until
    /// `timeout`, and waits until rank 0 has seen every rank.
    pub fn join(
        addr: &str,
        rank: u32,
        world: u32,
        timeout: Duration,
    ) -> Result<Rendezvous, DistError> {
        if rank == 0 || rank >= world {
            return Err(err(format!(
                "rank {rank} cannot join a rendezvous of {world} ranks"
            )));
        }
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no attempt");
        let stream = loop {
            if let Some(s) = try_connect(addr, deadline, &mut last) {
                break s;
            }
            if Instant::now() >= deadline {
                return Err(err(format!(
                    "rank {rank} could not reach rank 0 at {addr} within {timeout:?} ({last}); is rank 0 running, and are MASTER_ADDR and MASTER_PORT the same on every rank?"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let _ = stream.set_nodelay(true);
        write_frame(&stream, Kind::Hello, rank, world, &[])
            .map_err(|e| err(format!("rank {rank} cannot greet rank 0 at {addr}: {e}")))?;
        read_frame(&stream, Kind::Hello, deadline).map_err(|e| {
            err(format!(
                "rank {rank} connected to {addr} but rank 0 did not confirm within {timeout:?}: {e} (did every rank start?)"
            ))
        })?;
        Ok(Rendezvous {
            rank,
            world,
            addr: addr.to_string(),
            role: Role::Peer(stream),
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

    /// Rank 0 sends `payload` to every rank; every rank returns it (the others' argument
    /// is ignored). Waits at most `timeout` for rank 0.
    pub fn broadcast(&mut self, payload: &[u8], timeout: Duration) -> Result<Vec<u8>, DistError> {
        let deadline = Instant::now() + timeout;
        match &self.role {
            Role::Root(peers) => {
                for (i, p) in peers.iter().enumerate() {
                    write_frame(p, Kind::Broadcast, 0, self.world, payload)
                        .map_err(|e| err(format!("rank 0 cannot send to rank {}: {e}", i + 1)))?;
                }
                Ok(payload.to_vec())
            }
            Role::Peer(s) => read_frame(s, Kind::Broadcast, deadline)
                .map(|(_, _, p)| p)
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
        match &self.role {
            Role::Root(peers) => {
                let mut all = vec![payload.to_vec()];
                for (i, p) in peers.iter().enumerate() {
                    let rank = i as u32 + 1;
                    let (from, _, data) = read_frame(p, Kind::Gather, deadline).map_err(|e| {
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
                write_frame(s, Kind::Gather, self.rank, self.world, payload).map_err(|e| {
                    err(format!(
                        "rank {} cannot send its result to rank 0 at {}: {e}",
                        self.rank, self.addr
                    ))
                })?;
                Ok(None)
            }
        }
    }
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

/// Where rank 0 listens: the loopback address when `MASTER_ADDR` is one (a one-node job
/// stays off the network), every interface otherwise (as torchrun does).
fn bind_addr(host: &str, port: u16) -> Result<SocketAddr, DistError> {
    let resolved: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            err(format!(
                "cannot resolve MASTER_ADDR `{host}`: {e}; set it to rank 0's host name or address"
            ))
        })?
        .collect();
    if !resolved.is_empty() && resolved.iter().all(|a| a.ip().is_loopback()) {
        return Ok(resolved[0]);
    }
    Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port))
}

fn write_frame(
    mut s: &TcpStream,
    kind: Kind,
    rank: u32,
    world: u32,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&MAGIC);
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.push(kind as u8);
    buf.extend_from_slice(&rank.to_le_bytes());
    buf.extend_from_slice(&world.to_le_bytes());
    buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf)?;
    s.flush()
}

/// Reads one frame of `kind` before `deadline`: `(rank, world, payload)`.
fn read_frame(s: &TcpStream, kind: Kind, deadline: Instant) -> Result<(u32, u32, Vec<u8>), String> {
    let mut header = [0u8; HEADER];
    read_exact(s, &mut header, deadline)?;
    if header[..4] != MAGIC {
        return Err(format!(
            "not an overlap rendezvous peer (it sent {:02x?})",
            &header[..4]
        ));
    }
    let word = |at: usize| {
        u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    let version = word(4);
    if version != VERSION {
        return Err(format!(
            "protocol version {version}, this overlap speaks {VERSION}: run the same overlap build on every rank"
        ));
    }
    if header[8] != kind as u8 {
        return Err(format!(
            "expected a {kind:?} frame, got kind {} (the ranks disagree on what happens next)",
            header[8]
        ));
    }
    let (rank, world) = (word(9), word(13));
    let mut len = [0u8; 8];
    len.copy_from_slice(&header[17..25]);
    let len = u64::from_le_bytes(len);
    if len > MAX_PAYLOAD {
        return Err(format!(
            "a payload of {len} bytes is larger than {MAX_PAYLOAD}"
        ));
    }
    let mut payload = vec![0u8; len as usize];
    read_exact(s, &mut payload, deadline)?;
    Ok((rank, world, payload))
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

    #[test]
    fn ranks_meet_broadcast_and_gather_over_loopback() {
        let (l, addr) = listener();
        let t = Duration::from_secs(10);
        let peers: Vec<_> = (1..3u32)
            .map(|rank| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let mut r = Rendezvous::join(&addr, rank, 3, t).unwrap();
                    let got = r.broadcast(&[], t).unwrap();
                    assert_eq!(got, b"ids");
                    assert!(r.gather(&[rank as u8; 2], t).unwrap().is_none());
                })
            })
            .collect();
        let mut root = Rendezvous::serve(l, 3, t).unwrap();
        assert_eq!(root.broadcast(b"ids", t).unwrap(), b"ids");
        let all = root.gather(&[0, 0], t).unwrap().unwrap();
        assert_eq!(all, vec![vec![0, 0], vec![1, 1], vec![2, 2]]);
        peers.into_iter().for_each(|p| p.join().unwrap());
    }

    #[test]
    fn a_rank_that_never_arrives_is_named_in_the_timeout() {
        let (l, addr) = listener();
        let t = Duration::from_millis(400);
        let peer =
            std::thread::spawn(move || Rendezvous::join(&addr, 1, 3, Duration::from_secs(5)));
        let e = Rendezvous::serve(l, 3, t).err().unwrap().to_string();
        assert!(e.contains("ranks [2] of 3 did not arrive"), "{e}");
        // The rank that did arrive is told, not left waiting forever.
        assert!(peer.join().unwrap().is_err());
    }

    #[test]
    fn a_peer_without_rank_0_times_out_with_advice() {
        let (l, addr) = listener();
        drop(l);
        let e = Rendezvous::join(&addr, 1, 2, Duration::from_millis(300))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("could not reach rank 0") && e.contains("MASTER_PORT"),
            "{e}"
        );
    }

    #[test]
    fn mismatched_world_sizes_and_duplicate_ranks_are_refused() {
        let (l, addr) = listener();
        let t = Duration::from_secs(5);
        let peer = std::thread::spawn(move || Rendezvous::join(&addr, 1, 4, t));
        let e = Rendezvous::serve(l, 3, t).err().unwrap().to_string();
        assert!(e.contains("WORLD_SIZE differs"), "{e}");
        let _ = peer.join();

        let (l, addr) = listener();
        let a2 = addr.clone();
        let p1 = std::thread::spawn(move || Rendezvous::join(&addr, 1, 3, t));
        let p2 = std::thread::spawn(move || Rendezvous::join(&a2, 1, 3, t));
        let e = Rendezvous::serve(l, 3, t).err().unwrap().to_string();
        assert!(e.contains("arrived twice"), "{e}");
        let _ = (p1.join(), p2.join());
    }

    #[test]
    fn a_stranger_on_the_port_is_ignored() {
        let (l, addr) = listener();
        let t = Duration::from_secs(5);
        let a = addr.clone();
        let stranger = std::thread::spawn(move || {
            let mut s = TcpStream::connect(&a).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n\r\n-------").unwrap();
        });
        stranger.join().unwrap();
        let peer = std::thread::spawn(move || Rendezvous::join(&addr, 1, 2, t).map(|_| ()));
        assert!(Rendezvous::serve(l, 2, t).is_ok());
        peer.join().unwrap().unwrap();
    }
}
