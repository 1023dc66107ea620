//! Opening a CPU job's links: one authenticated TCP connection per pair of ranks.
//!
//! Rank `k > 0` listens on an ephemeral port, bound as the rendezvous binds
//! ([`crate::rendezvous::listen`]: `OVERLAP_BIND_ADDR` when set, else the address this
//! host reaches rank 0 from) and serves the ranks below it; rank 0 gathers every
//! listening address and broadcasts the table; each rank then connects to every rank
//! above it. Both ends prove the job's secret with the rendezvous's HMAC
//! challenge-response, under labels that name the serving rank
//! (`crate::rendezvous::Handshake`), so a connection reaches the rank it meant to and a
//! stranger is dropped and logged without delaying the ranks.
//!
//! Invariant: every wait has the start-up deadline; the links handed to the backend
//! are exactly one authenticated connection to every other rank.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use overlap::Error;
use overlap_ops::cpu::CpuLinks;

use crate::rendezvous::{accept_links, connect_link, listen, JobSecret, Rendezvous, BIND_VAR};
use crate::DistError;

/// This rank's links to every other rank of the job, through its rendezvous, proving
/// `secret`.
pub(crate) fn connect(
    rendezvous: &mut Rendezvous,
    secret: &JobSecret,
    timeout: Duration,
) -> Result<CpuLinks, Error> {
    let (me, world) = (rendezvous.rank(), rendezvous.world());
    // Rank k serves the ranks below it: rank 0 serves nobody.
    let listener = if me > 0 {
        Some(bind(rendezvous)?)
    } else {
        None
    };
    let mine = listener
        .as_ref()
        .map_or(String::new(), |(_, a)| a.to_string());
    let table = share_table(rendezvous, &mine, world, timeout)?;
    let accepting = match listener {
        Some((l, _)) => {
            let secret = secret.clone();
            let spawned = std::thread::Builder::new()
                .name("cpu-links-accept".into())
                .spawn(move || accept_links(l, (me, world), &secret, timeout));
            Some(spawned.map_err(|e| {
                DistError::Rendezvous(format!("rank {me}: cannot start accepting CPU links: {e}"))
            })?)
        }
        None => None,
    };
    let mut peers = Vec::new();
    for peer in me + 1..world {
        let addr = &table[peer as usize];
        peers.push((
            peer,
            connect_link(addr, (me, peer, world), secret, timeout)?,
        ));
    }
    if let Some(accepting) = accepting {
        let accepted = accepting.join().map_err(|_| {
            DistError::Rendezvous(format!("rank {me}: accepting CPU links panicked"))
        })?;
        peers.extend(accepted?);
    }
    CpuLinks::new(me, world, peers).map_err(|e| Error::Backend(e.to_string()))
}

/// A listener on a fresh port and the address the other ranks reach it at.
fn bind(rendezvous: &Rendezvous) -> Result<(TcpListener, SocketAddr), Error> {
    let me = rendezvous.rank();
    let ip = rendezvous.local_ip().ok_or_else(|| {
        DistError::Rendezvous(format!(
            "rank {me}: cannot tell this host's address from its connection to rank 0; set {BIND_VAR}"
        ))
    })?;
    let var = std::env::var(BIND_VAR)
        .ok()
        .filter(|v| !v.trim().is_empty());
    let listener = listen(&ip.to_string(), 0, var.as_deref())?;
    let mut addr = listener
        .local_addr()
        .map_err(|e| DistError::Rendezvous(format!("rank {me}: the CPU links' listener: {e}")))?;
    if addr.ip().is_unspecified() {
        // Bound to every interface: the others reach this host as rank 0 does.
        addr.set_ip(ip);
    }
    Ok((listener, addr))
}

/// Every rank's listening address, in rank order (rank 0's empty), from rank 0.
fn share_table(
    rendezvous: &mut Rendezvous,
    mine: &str,
    world: u32,
    timeout: Duration,
) -> Result<Vec<String>, Error> {
    let table = match rendezvous.gather(mine.as_bytes(), timeout)? {
        Some(all) => all
            .iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect::<Vec<_>>()
            .join("\n"),
        None => String::new(),
    };
    let table = rendezvous.broadcast(table.as_bytes(), timeout)?;
    let table: Vec<String> = String::from_utf8_lossy(&table)
        .split('\n')
        .map(str::to_string)
        .collect();
    if table.len() != world as usize {
        return Err(DistError::Rendezvous(format!(
            "rank 0 sent {} addresses of CPU links for {world} ranks",
            table.len()
        ))
        .into());
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::Duration;

    use overlap_graph::{Collective, CollectiveKind, DType, Group, Mesh, ReduceOp, Stream};
    use overlap_ops::cpu::CpuBackend;
    use overlap_ops::{Backend, CommId, Kernel, Tag};

    use super::*;

    fn secret() -> JobSecret {
        JobSecret::new(b"test secret of this job, 32 byte".to_vec()).unwrap()
    }

    /// A job of `world` ranks on threads: each meets at a loopback rendezvous, opens its
    /// links and sums its rank + 1 over the world (a 1 x world mesh's replicate group).
    #[test]
    fn ranks_open_authenticated_links_and_reduce_over_them() {
        let world = 3u32;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = Duration::from_secs(20);
        let run = move |mut rdv: Rendezvous| -> Vec<f32> {
            let links = connect(&mut rdv, &secret(), t).unwrap();
            let mesh = Mesh::new(1, world).unwrap();
            let b = CpuBackend::one_rank(mesh, rdv.rank(), &links).unwrap();
            let desc = Collective {
                kind: CollectiveKind::AllReduce,
                group: Group::Replicate { shard: 0 },
                count: 1,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                root: None,
            };
            let me = rdv.rank();
            let x = b.alloc(me, 1).unwrap();
            b.upload(&x, &[me as f32 + 1.0]).unwrap();
            let tag = Tag {
                node: 0,
                op: "stage2",
                micro_batch: 0,
            };
            let kernel = Kernel::Collective {
                desc,
                comm: CommId::of(&desc, Stream::Replicate),
                send: Some(x.clone()),
                recv: Some(x.clone()),
            };
            b.launch(me, Stream::Replicate, tag, kernel);
            let ev = b.event(me);
            b.record(me, Stream::Replicate, &ev);
            while b.status(&ev) == overlap_ops::EventStatus::Pending {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(b.errors(), vec![]);
            b.download(&x).unwrap()
        };
        let peers: Vec<_> = (1..world)
            .map(|rank| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    run(Rendezvous::join(&addr, rank, world, &secret(), t).unwrap())
                })
            })
            .collect();
        let root = Rendezvous::serve(l, world, &secret(), t).unwrap();
        assert_eq!(run(root), vec![6.0]);
        for p in peers {
            assert_eq!(p.join().unwrap(), vec![6.0]);
        }
    }

    #[test]
    fn a_link_refuses_strangers_and_a_rank_it_was_not_meant_for() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = Duration::from_secs(20);
        // Rank 2 of 3 serves ranks 0 and 1.
        let serving = std::thread::spawn(move || accept_links(l, (2, 3), &secret(), t));
        let short = Duration::from_millis(600);
        let other = JobSecret::new(b"someone else's secret, 32 bytes!".to_vec()).unwrap();
        let e = connect_link(&addr, (0, 2, 3), &other, short)
            .unwrap_err()
            .to_string();
        assert!(e.contains("could not open its CPU link to rank 2"), "{e}");
        // The right secret, but meant for rank 1: the proofs name the serving rank, so
        // rank 2 drops it as it drops a stranger.
        let e = connect_link(&addr, (0, 1, 3), &secret(), short)
            .unwrap_err()
            .to_string();
        assert!(e.contains("could not open its CPU link to rank 1"), "{e}");
        let s0 = connect_link(&addr, (0, 2, 3), &secret(), t).unwrap();
        let s1 = connect_link(&addr, (1, 2, 3), &secret(), t).unwrap();
        let got = serving.join().unwrap().unwrap();
        assert_eq!(got.iter().map(|(r, _)| *r).collect::<Vec<_>>(), [0, 1]);
        let port = |s: &std::net::TcpStream| s.local_addr().unwrap().port();
        assert_eq!(port(&s0), got[0].1.peer_addr().unwrap().port());
        assert_eq!(port(&s1), got[1].1.peer_addr().unwrap().port());
    }
}
