//! Tests of one rank per backend over TCP links ([`CpuBackend::one_rank`]): the same
//! bits as the in-process backend, and the failure semantics across processes (here
//! backends of one test process over loopback connections).

use std::time::{Duration, Instant};

use overlap_graph::{Collective, CollectiveKind, DType, Group, Mesh, ReduceOp, Stream};

use super::remote::loopback;
use super::{CpuBackend, CpuBuffer, CpuEvent, CpuLinks};
use crate::{Backend, CommId, Kernel, OpsError, Tag};

/// The ranks of a mesh: one in-process backend, or one backend per rank over links.
struct Job {
    mesh: Mesh,
    backends: Vec<CpuBackend>,
    _links: Vec<CpuLinks>,
}

impl Job {
    fn in_process(mesh: Mesh) -> Job {
        Job {
            mesh,
            backends: vec![CpuBackend::new(mesh)],
            _links: Vec::new(),
        }
    }

    fn one_rank_each(mesh: Mesh) -> Job {
        let links = loopback(mesh.world());
        let backends = (0..mesh.world())
            .map(|r| CpuBackend::one_rank(mesh, r, &links[r as usize]).unwrap())
            .collect();
        Job {
            mesh,
            backends,
            _links: links,
        }
    }

    fn with_timeout(mut self, t: Duration) -> Job {
        self.backends = self
            .backends
            .into_iter()
            .map(|b| b.with_collective_timeout(t))
            .collect();
        self
    }

    /// The backend that drives `rank`.
    fn at(&self, rank: u32) -> &CpuBackend {
        match self.backends.len() {
            1 => &self.backends[0],
            _ => &self.backends[rank as usize],
        }
    }

    fn sync(&self) {
        for b in &self.backends {
            super::tests::sync(b);
        }
    }

    /// Every backend's errors, by rank.
    fn errors(&self) -> Vec<(u32, Stream, Tag, OpsError)> {
        let mut all: Vec<_> = self.backends.iter().flat_map(|b| b.errors()).collect();
        all.sort_by_key(|e| (e.0, e.1.index()));
        all
    }

    fn buffer(&self, rank: u32, data: &[f32]) -> CpuBuffer {
        let b = self.at(rank);
        let buf = b.alloc_uninit(rank, data.len()).unwrap();
        b.upload(&buf, data).unwrap();
        buf
    }

    fn record(&self, rank: u32, stream: Stream) -> CpuEvent {
        let b = self.at(rank);
        let ev = b.event(rank);
        b.record(rank, stream, &ev);
        ev
    }
}

fn tag(node: u32, op: &'static str) -> Tag {
    Tag {
        node,
        op,
        micro_batch: 0,
    }
}

/// Member `m`'s data of `len` elements: magnitudes from 1e-3 to 1e3 (the sum's
/// rounding depends on the order of the additions), values bf16 rounds, and `-0.0`s.
fn input(m: u32, len: usize) -> Vec<f32> {
    (0..len)
        .map(|k| {
            if k % 5 == 0 {
                return -0.0;
            }
            let scale = [1.0, 1e3, 1e-3][k % 3];
            ((k * 7 + m as usize * 13 + 1) as f32 * 0.731).sin() * scale
        })
        .collect()
}

/// Every group of the mesh.
fn groups(mesh: Mesh) -> Vec<Group> {
    let shard = (0..mesh.replicate).map(|replicate| Group::Shard { replicate });
    shard
        .chain((0..mesh.shard).map(|shard| Group::Replicate { shard }))
        .collect()
}

/// The collectives of the scenario on a group of `n`.
fn collectives(group: Group, n: u32) -> Vec<Collective> {
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::Bf16] {
        for op in [ReduceOp::Avg, ReduceOp::Sum] {
            for (kind, count, root) in [
                (CollectiveKind::ReduceScatter, 5, None),
                (CollectiveKind::AllReduce, 7, None),
                (CollectiveKind::Reduce, 6, Some(n - 1)),
                (CollectiveKind::Broadcast, 4, Some(n / 2)),
                (CollectiveKind::AllGather, 3, None),
            ] {
                out.push(Collective {
                    kind,
                    group,
                    count,
                    dtype,
                    op,
                    root,
                });
            }
        }
    }
    out
}

/// Issues every collective of the scenario, then the copy transport's exchanges,
/// combines and gathers, on every group; returns every output's bits in issue order.
fn scenario(job: &Job) -> Vec<Vec<u32>> {
    let mut outs: Vec<(u32, CpuBuffer)> = Vec::new();
    for group in groups(job.mesh) {
        let members = job.mesh.members(group);
        let n = members.len() as u32;
        for desc in collectives(group, n) {
            let comm = CommId::of(&desc, Stream::Reduce);
            for (i, &rank) in (0u32..).zip(&members) {
                let roles = crate::collective_roles(&desc, n, i).unwrap();
                let send = roles.send.map(|len| job.buffer(rank, &input(rank, len)));
                let recv = roles.recv.map(|len| job.buffer(rank, &vec![f32::NAN; len]));
                let kernel = Kernel::Collective {
                    desc,
                    comm,
                    send,
                    recv: recv.clone(),
                };
                job.at(rank)
                    .launch(rank, Stream::Reduce, tag(1, "stage1"), kernel);
                outs.extend(recv.map(|r| (rank, r)));
            }
        }
        for kind in [
            CollectiveKind::ReduceScatter,
            CollectiveKind::AllReduce,
            CollectiveKind::Reduce,
        ] {
            let root = (kind == CollectiveKind::Reduce).then_some(0);
            let desc = Collective {
                kind,
                group,
                count: 200,
                dtype: DType::Bf16,
                op: ReduceOp::Avg,
                root,
            };
            outs.extend(copy_chain(job, &members, desc));
        }
    }
    job.sync();
    assert_eq!(job.errors(), vec![]);
    outs.iter()
        .map(|(rank, b)| {
            let v = job.at(*rank).download(b).unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

/// The exchange of `desc` on every member, the combine where a member receives, and
/// for an all-reduce the gather: each member's output.
fn copy_chain(job: &Job, members: &[u32], desc: Collective) -> Vec<(u32, CpuBuffer)> {
    let n = members.len() as u32;
    let comm = CommId::of(&desc, Stream::Copy);
    let mut outs = Vec::new();
    for (i, &rank) in (0u32..).zip(members) {
        let b = job.at(rank);
        let roles = crate::exchange_roles(&desc, n, i).unwrap();
        let send = job.buffer(rank, &input(rank, roles.send.unwrap()));
        let recv = roles.recv.map(|len| b.alloc_uninit(rank, len).unwrap());
        let exchange = Kernel::Exchange {
            desc,
            comm,
            send: Some(send.clone()),
            recv: recv.clone(),
        };
        b.launch(rank, Stream::Copy, tag(2, "exchange"), exchange);
        let Some(recv) = recv else { continue };
        let exchanged = job.record(rank, Stream::Copy);
        b.wait(rank, Stream::Compute, &exchanged);
        let all_reduce = desc.kind == CollectiveKind::AllReduce;
        let (at, k) = desc.member_chunk(n, i);
        let len = if all_reduce { desc.count } else { k };
        let dst = b.alloc_uninit(rank, len as usize).unwrap();
        let combine = Kernel::Combine {
            desc,
            size: n,
            index: i,
            own: send,
            own_offset: at as usize,
            recv,
            dst: dst.clone(),
        };
        b.launch(rank, Stream::Compute, tag(3, "combine"), combine);
        if all_reduce {
            let combined = job.record(rank, Stream::Compute);
            b.wait(rank, Stream::Copy, &combined);
            let gather = Kernel::Gather {
                desc,
                comm,
                buf: Some(dst.clone()),
            };
            b.launch(rank, Stream::Copy, tag(4, "gather"), gather);
        }
        outs.push((rank, dst));
    }
    outs
}

#[test]
fn one_rank_per_backend_computes_the_in_process_bits() {
    for (shard, replicate) in [(2, 1), (1, 2), (2, 2), (3, 2)] {
        let mesh = Mesh::new(shard, replicate).unwrap();
        let want = scenario(&Job::in_process(mesh));
        let got = scenario(&Job::one_rank_each(mesh));
        assert_eq!(got.len(), want.len(), "{mesh}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{mesh}: output {i}");
        }
    }
}

/// An all-reduce of one element on the shard group of a 2x1 mesh, on every rank given.
fn all_reduce(job: &Job, ranks: &[u32], node: u32) -> Vec<CpuBuffer> {
    let desc = Collective {
        kind: CollectiveKind::AllReduce,
        group: Group::Shard { replicate: 0 },
        count: 1,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: None,
    };
    let comm = CommId::of(&desc, Stream::Reduce);
    ranks
        .iter()
        .map(|&rank| {
            let x = job.buffer(rank, &[rank as f32 + 1.0]);
            let kernel = Kernel::Collective {
                desc,
                comm,
                send: Some(x.clone()),
                recv: Some(x.clone()),
            };
            job.at(rank)
                .launch(rank, Stream::Reduce, tag(node, "stage1"), kernel);
            x
        })
        .collect()
}

#[test]
fn a_member_that_cannot_take_part_fails_the_round_in_every_process_as_in_one() {
    let mesh = Mesh::new(2, 1).unwrap();
    let mut seen = Vec::new();
    for job in [Job::in_process(mesh), Job::one_rank_each(mesh)] {
        job.at(1).inject_fault(1, "stage1");
        all_reduce(&job, &[0, 1], 7);
        job.sync();
        let errors = job.errors();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].0, 1);
        // Rank 0's stream is poisoned by rank 1's failure, named in its cause.
        let ev = job.record(0, Stream::Reduce);
        job.sync();
        let crate::EventStatus::Failed(OpsError::Cancelled(cause)) = job.at(0).status(&ev) else {
            panic!("rank 0 was not cancelled")
        };
        assert!(
            cause.contains("rank 1 could not take part") && cause.contains("injected fault"),
            "{cause}"
        );
        seen.push(cause);
    }
    assert_eq!(seen[0], seen[1], "the same words in both modes");
}

/// Waits for `ev` on `b`, failing the test after `within`.
fn wait_failed(b: &CpuBackend, ev: &CpuEvent, within: Duration) -> String {
    let start = Instant::now();
    loop {
        match b.status(ev) {
            crate::EventStatus::Failed(e) => return e.to_string(),
            crate::EventStatus::Complete => panic!("completed"),
            crate::EventStatus::Pending => {}
        }
        assert!(start.elapsed() < within, "still waiting after {within:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_peer_that_ends_fails_the_calls_waiting_for_it_at_once() {
    let mesh = Mesh::new(2, 1).unwrap();
    let mut job = Job::one_rank_each(mesh);
    all_reduce(&job, &[0], 1);
    let ev = job.record(0, Stream::Reduce);
    // Rank 1's process ends: its backend and links go, saying goodbye.
    let gone = job.backends.remove(1);
    let links = job._links.remove(1);
    drop((gone, links));
    let why = wait_failed(job.at(0), &ev, Duration::from_secs(10));
    assert!(why.contains("rank 1 ended its part of the job"), "{why}");
}

#[test]
fn a_connection_closed_without_a_goodbye_fails_the_waiting_calls_naming_the_peer() {
    use std::net::{TcpListener, TcpStream};
    let mesh = Mesh::new(2, 1).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mine, _) = l.accept().unwrap();
    let links = CpuLinks::new(0, 2, vec![(1, mine)]).unwrap();
    let b = CpuBackend::one_rank(mesh, 0, &links).unwrap();
    let job = Job {
        mesh,
        backends: vec![b],
        _links: vec![links],
    };
    all_reduce(&job, &[0], 1);
    let ev = job.record(0, Stream::Reduce);
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    drop(peer);
    let why = wait_failed(job.at(0), &ev, Duration::from_secs(10));
    assert!(
        why.contains("rank 1's connection to rank 0 closed without a goodbye"),
        "{why}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    // Later calls fail at once too.
    all_reduce(&job, &[0], 2);
    let ev = job.record(0, Stream::Reduce);
    wait_failed(job.at(0), &ev, Duration::from_secs(2));
}

#[test]
fn a_missing_remote_member_times_out_naming_it_and_abort_ends_a_wait_at_once() {
    let mesh = Mesh::new(2, 1).unwrap();
    let job = Job::one_rank_each(mesh).with_timeout(Duration::from_millis(200));
    all_reduce(&job, &[0], 1);
    job.sync();
    let errors = job.errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    let e = errors[0].3.to_string();
    assert!(
        e.contains("timed out") && e.contains("ranks [1] did not arrive"),
        "{e}"
    );

    let job = Job::one_rank_each(mesh);
    all_reduce(&job, &[0], 1);
    let ev = job.record(0, Stream::Reduce);
    std::thread::sleep(Duration::from_millis(20));
    job.at(0).abort("a test gives up");
    let why = wait_failed(job.at(0), &ev, Duration::from_secs(2));
    assert!(why.contains("aborted"), "{why}");
}

#[test]
fn a_rank_that_gives_up_tells_the_others_why() {
    let mesh = Mesh::new(2, 1).unwrap();
    let job = Job::one_rank_each(mesh);
    all_reduce(&job, &[0], 1);
    let ev = job.record(0, Stream::Reduce);
    std::thread::sleep(Duration::from_millis(20));
    let start = Instant::now();
    job.at(1)
        .abort("rank 3 of the job failed: its connection closed");
    let why = wait_failed(job.at(0), &ev, Duration::from_secs(5));
    assert!(
        why.contains("rank 1 stopped: rank 3 of the job failed: its connection closed"),
        "{why}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn arrivals_wait_for_their_backend_and_for_the_reset_of_their_generation() {
    let mesh = Mesh::new(2, 1).unwrap();
    let links = loopback(2);
    // Rank 1's backend exists and calls before rank 0's backend is made.
    let b1 = CpuBackend::one_rank(mesh, 1, &links[1])
        .unwrap()
        .with_collective_timeout(Duration::from_millis(300));
    let job1 = Job {
        mesh,
        backends: vec![CpuBackend::new(mesh), b1],
        _links: Vec::new(),
    };
    let x1 = all_reduce(&job1, &[1], 1);
    std::thread::sleep(Duration::from_millis(50));
    let b0 = CpuBackend::one_rank(mesh, 0, &links[0]).unwrap();
    let job = Job {
        mesh,
        backends: vec![b0, job1.backends.into_iter().nth(1).unwrap()],
        _links: Vec::new(),
    };
    let x0 = all_reduce(&job, &[0], 1);
    job.sync();
    assert_eq!(job.errors(), vec![]);
    assert_eq!(job.at(0).download(&x0[0]).unwrap(), vec![3.0]);
    assert_eq!(job.at(1).download(&x1[0]).unwrap(), vec![3.0]);
    // Rank 0 resets and calls in its next generation; rank 1, not yet reset, calls in
    // the old one and times out; once it resets, the two meet.
    job.at(0).reset();
    let y0 = all_reduce(&job, &[0], 2);
    all_reduce(&job, &[1], 2);
    super::tests::sync(job.at(1));
    let errors = job.at(1).errors();
    assert!(
        errors.len() == 1 && errors[0].3.to_string().contains("ranks [0] did not arrive"),
        "{errors:?}"
    );
    job.at(1).reset();
    let y1 = all_reduce(&job, &[1], 3);
    job.sync();
    assert_eq!(job.errors(), vec![]);
    assert_eq!(job.at(0).download(&y0[0]).unwrap(), vec![3.0]);
    assert_eq!(job.at(1).download(&y1[0]).unwrap(), vec![3.0]);
    drop((job, links));
}

#[test]
fn links_refuse_what_does_not_fit_the_job() {
    let links = loopback(2);
    let mesh = Mesh::new(2, 2).unwrap();
    let e = CpuBackend::one_rank(mesh, 0, &links[0]).err().unwrap();
    assert!(
        e.to_string()
            .contains("cannot run over the links of rank 0 of 2"),
        "{e}"
    );
    let e = CpuBackend::one_rank(Mesh::new(2, 1).unwrap(), 1, &links[0])
        .err()
        .unwrap();
    assert!(e.to_string().contains("rank 1 of mesh 2x1"), "{e}");
    let e = CpuLinks::new(0, 2, vec![]).err().unwrap();
    assert!(e.to_string().contains("no connection to rank 1"), "{e}");
}
