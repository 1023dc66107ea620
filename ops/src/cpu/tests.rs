//! Tests of the CPU backend: stream order, events, collectives, poisoning, kernels.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use overlap_graph::{Collective, CollectiveKind, CopySeg, DType, Group, Mesh, ReduceOp, Stream};

use super::{CpuBackend, CpuBuffer, CpuEvent, MAX_RANKS};
use crate::{math, AdamwParams, Backend, CommId, EventStatus, Kernel, MuonParams, OpsError, Tag};

/// Wakes a parked thread.
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

fn waker() -> Waker {
    Arc::new(Unpark(thread::current())).into()
}

/// Drives a future to completion on this thread.
fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = pin!(fut);
    let waker = waker();
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        thread::park();
    }
}

fn mesh(shard: u32, replicate: u32) -> Mesh {
    Mesh::new(shard, replicate).unwrap()
}

fn tag(node: u32, op: &'static str) -> Tag {
    Tag {
        node,
        op,
        micro_batch: 0,
    }
}

fn buffer(b: &CpuBackend, rank: u32, data: &[f32]) -> CpuBuffer {
    let buf = b.alloc(rank, data.len()).unwrap();
    b.upload(&buf, data).unwrap();
    buf
}

/// Records an event on a stream.
fn record(b: &CpuBackend, rank: u32, stream: Stream) -> CpuEvent {
    let ev = b.event(rank);
    b.record(rank, stream, &ev);
    ev
}

/// Waits until every stream has executed everything issued so far.
pub(super) fn sync(b: &CpuBackend) {
    let events: Vec<CpuEvent> = b
        .local_ranks()
        .into_iter()
        .flat_map(|r| Stream::ALL.map(|s| record(b, r, s)))
        .collect();
    for ev in &events {
        // A failed record is still executed: the stream has reached it.
        let _ = block_on(b.host_wait(ev));
    }
}

fn desc(
    kind: CollectiveKind,
    group: Group,
    count: u64,
    op: ReduceOp,
    dtype: DType,
    root: Option<u32>,
) -> Collective {
    Collective {
        kind,
        group,
        count,
        dtype,
        op,
        root,
    }
}

/// Issues `desc` on every member of its group on `stream`, member `i` with send data
/// `inputs[i]` and a recv buffer of `outputs[i]` elements; returns the recv contents.
fn collective(
    b: &CpuBackend,
    desc: Collective,
    stream: Stream,
    inputs: &[Option<Vec<f32>>],
    outputs: &[Option<usize>],
) -> Vec<Option<Vec<f32>>> {
    let members = b.shared.mesh.members(desc.group);
    let comm = CommId {
        group: desc.group,
        stream,
    };
    let recvs: Vec<Option<CpuBuffer>> = members
        .iter()
        .zip(outputs)
        .map(|(&rank, len)| len.map(|len| b.alloc(rank, len).unwrap()))
        .collect();
    for ((&rank, input), recv) in members.iter().zip(inputs).zip(&recvs) {
        let send = input.as_ref().map(|data| buffer(b, rank, data));
        b.launch(
            rank,
            stream,
            tag(1, "stage1"),
            Kernel::Collective {
                desc,
                comm,
                send,
                recv: recv.clone(),
            },
        );
    }
    sync(b);
    assert_eq!(b.errors(), vec![]);
    recvs
        .iter()
        .map(|r| r.as_ref().map(|r| b.download(r).unwrap()))
        .collect()
}

fn all(data: &[Vec<f32>]) -> Vec<Option<Vec<f32>>> {
    data.iter().cloned().map(Some).collect()
}

#[test]
fn a_stream_runs_its_commands_in_issue_order() {
    let b = CpuBackend::new(mesh(1, 1));
    let (x, a, c) = (
        buffer(&b, 0, &[0.0; 3]),
        buffer(&b, 0, &[1.0, 2.0, 3.0]),
        buffer(&b, 0, &[10.0; 3]),
    );
    let add = |dst: &CpuBuffer, src: &CpuBuffer, accumulate| Kernel::Add {
        dst: dst.clone(),
        src: src.clone(),
        accumulate,
    };
    b.launch(0, Stream::Compute, tag(0, "accumulate"), add(&x, &a, false));
    b.launch(0, Stream::Compute, tag(1, "accumulate"), add(&x, &c, true));
    b.launch(0, Stream::Compute, tag(2, "accumulate"), add(&x, &x, true));
    for node in 3..100 {
        b.launch(0, Stream::Compute, tag(node, "grad_ready"), Kernel::Marker);
    }
    sync(&b);
    assert_eq!(b.download(&x).unwrap(), vec![22.0, 24.0, 26.0]);
    let timings = b.take_timings();
    let nodes: Vec<u32> = timings.iter().map(|t| t.tag.node).collect();
    assert_eq!(nodes, (0..100).collect::<Vec<_>>());
    assert!(timings.windows(2).all(|w| w[0].end <= w[1].start));
    assert!(b.take_timings().is_empty(), "take_timings drains");
}

#[test]
fn wait_orders_a_stream_after_the_record_issued_before_it() {
    let b = CpuBackend::new(mesh(2, 1));
    let g = Group::Shard { replicate: 0 };
    let d = desc(
        CollectiveKind::AllReduce,
        g,
        2,
        ReduceOp::Sum,
        DType::F32,
        None,
    );
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    let (s0, r0) = (buffer(&b, 0, &[1.0, 2.0]), b.alloc(0, 2).unwrap());
    let out = b.alloc(0, 2).unwrap();
    // Rank 0's reduce stream blocks in the all-reduce until rank 1 joins.
    let launch = |rank, send: &CpuBuffer, recv: &CpuBuffer| {
        let k = Kernel::Collective {
            desc: d,
            comm,
            send: Some(send.clone()),
            recv: Some(recv.clone()),
        };
        b.launch(rank, Stream::Reduce, tag(1, "stage1"), k);
    };
    launch(0, &s0, &r0);
    let ev = record(&b, 0, Stream::Reduce);
    b.wait(0, Stream::Compute, &ev);
    b.launch(
        0,
        Stream::Compute,
        tag(2, "fold"),
        Kernel::Add {
            dst: out.clone(),
            src: r0.clone(),
            accumulate: false,
        },
    );
    let done = record(&b, 0, Stream::Compute);
    // Re-recording the event elsewhere does not change what the earlier wait waits for.
    b.record(0, Stream::Publish, &ev);

    let mut host = pin!(b.host_wait(&done));
    let waker = waker();
    assert!(host
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    thread::sleep(Duration::from_millis(50));
    assert_eq!(b.status(&done), EventStatus::Pending);
    assert_eq!(b.download(&out).unwrap(), vec![0.0, 0.0]);

    let (s1, r1) = (buffer(&b, 1, &[10.0, 20.0]), b.alloc(1, 2).unwrap());
    launch(1, &s1, &r1);
    assert_eq!(block_on(host), Ok(()));
    assert_eq!(b.status(&done), EventStatus::Complete);
    assert_eq!(b.download(&out).unwrap(), vec![11.0, 22.0]);
}

#[test]
fn a_never_recorded_event_is_complete_and_waiting_on_it_is_a_no_op() {
    let b = CpuBackend::new(mesh(1, 1));
    let ev = b.event(0);
    assert_eq!(b.status(&ev), EventStatus::Complete);
    assert_eq!(block_on(b.host_wait(&ev)), Ok(()));
    b.wait(0, Stream::Compute, &ev);
    b.launch(0, Stream::Compute, tag(0, "grad_ready"), Kernel::Marker);
    sync(&b);
    assert_eq!(b.take_timings().len(), 1);
}

#[test]
fn reduce_scatter_reduces_each_members_chunk() {
    let b = CpuBackend::new(mesh(3, 1));
    let g = Group::Shard { replicate: 0 };
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|m| (0..6).map(|j| (10 * m + j) as f32).collect())
        .collect();
    let sum = collective(
        &b,
        desc(
            CollectiveKind::ReduceScatter,
            g,
            2,
            ReduceOp::Sum,
            DType::F32,
            None,
        ),
        Stream::Reduce,
        &all(&inputs),
        &[Some(2); 3],
    );
    // Element j of the sum is 30 + 3j; member i gets elements 2i and 2i + 1.
    assert_eq!(
        sum,
        vec![
            Some(vec![30.0, 33.0]),
            Some(vec![36.0, 39.0]),
            Some(vec![42.0, 45.0])
        ]
    );
    let avg = collective(
        &b,
        desc(
            CollectiveKind::ReduceScatter,
            g,
            2,
            ReduceOp::Avg,
            DType::F32,
            None,
        ),
        Stream::Reduce,
        &all(&inputs),
        &[Some(2); 3],
    );
    assert_eq!(
        avg,
        vec![
            Some(vec![10.0, 11.0]),
            Some(vec![12.0, 13.0]),
            Some(vec![14.0, 15.0])
        ]
    );
    let bytes: Vec<u64> = b.take_timings().iter().map(|t| t.bytes).collect();
    assert_eq!(bytes, vec![24; 6], "each member contributes 3 × 2 f32");
}

#[test]
fn all_reduce_averages_over_replicate_groups_in_place() {
    let b = CpuBackend::new(mesh(2, 2));
    for shard in 0..2 {
        let g = Group::Replicate { shard };
        let members = b.shared.mesh.members(g);
        let d = desc(
            CollectiveKind::AllReduce,
            g,
            2,
            ReduceOp::Avg,
            DType::F32,
            None,
        );
        let comm = CommId {
            group: g,
            stream: Stream::Replicate,
        };
        // Send and recv are the same buffer.
        let bufs: Vec<CpuBuffer> = members
            .iter()
            .map(|&r| buffer(&b, r, &[r as f32, 1.0 + 2.0 * r as f32]))
            .collect();
        for (&rank, buf) in members.iter().zip(&bufs) {
            let k = Kernel::Collective {
                desc: d,
                comm,
                send: Some(buf.clone()),
                recv: Some(buf.clone()),
            };
            b.launch(rank, Stream::Replicate, tag(2, "stage2"), k);
        }
        sync(&b);
        // Members are ranks s and s + 2.
        let s = shard as f32;
        for buf in &bufs {
            assert_eq!(b.download(buf).unwrap(), vec![s + 1.0, 2.0 * s + 3.0]);
        }
    }
    assert_eq!(b.errors(), vec![]);
    let sums = collective(
        &b,
        desc(
            CollectiveKind::AllReduce,
            Group::Shard { replicate: 1 },
            1,
            ReduceOp::Sum,
            DType::F32,
            None,
        ),
        Stream::Reduce,
        &all(&[vec![0.5], vec![0.25]]),
        &[Some(1); 2],
    );
    assert_eq!(sums, vec![Some(vec![0.75]); 2]);
}

#[test]
fn reduce_writes_the_root_only() {
    let b = CpuBackend::new(mesh(3, 1));
    let g = Group::Shard { replicate: 0 };
    let inputs = all(&[vec![1.0, 2.0], vec![3.0, 4.0], vec![5.0, 9.0]]);
    let outputs = [None, Some(2), None];
    let sum = collective(
        &b,
        desc(
            CollectiveKind::Reduce,
            g,
            2,
            ReduceOp::Sum,
            DType::F32,
            Some(1),
        ),
        Stream::Reduce,
        &inputs,
        &outputs,
    );
    assert_eq!(sum, vec![None, Some(vec![9.0, 15.0]), None]);
    let avg = collective(
        &b,
        desc(
            CollectiveKind::Reduce,
            g,
            2,
            ReduceOp::Avg,
            DType::F32,
            Some(1),
        ),
        Stream::Reduce,
        &inputs,
        &outputs,
    );
    assert_eq!(avg, vec![None, Some(vec![3.0, 5.0]), None]);
}

#[test]
fn broadcast_copies_the_roots_buffer() {
    let b = CpuBackend::new(mesh(1, 3));
    let g = Group::Replicate { shard: 0 };
    let out = collective(
        &b,
        desc(
            CollectiveKind::Broadcast,
            g,
            3,
            ReduceOp::Avg,
            DType::F32,
            Some(2),
        ),
        Stream::Publish,
        &[None, None, Some(vec![7.0, 8.0, 9.0])],
        &[Some(3), Some(3), None],
    );
    assert_eq!(
        out,
        vec![Some(vec![7.0, 8.0, 9.0]), Some(vec![7.0, 8.0, 9.0]), None]
    );
}

#[test]
fn all_gather_concatenates_in_member_order() {
    let b = CpuBackend::new(mesh(2, 2));
    let g = Group::Shard { replicate: 1 };
    let out = collective(
        &b,
        desc(
            CollectiveKind::AllGather,
            g,
            2,
            ReduceOp::Sum,
            DType::F32,
            None,
        ),
        Stream::Reduce,
        &all(&[vec![1.0, 2.0], vec![3.0, 4.0]]),
        &[Some(4); 2],
    );
    assert_eq!(out, vec![Some(vec![1.0, 2.0, 3.0, 4.0]); 2]);
}

#[test]
fn bf16_rounds_every_input_before_reducing_in_f32() {
    let b = CpuBackend::new(mesh(2, 1));
    let g = Group::Shard { replicate: 0 };
    let x = 1.0 + 2f32.powi(-10);
    let inputs = all(&[vec![x, 3.0], vec![x, 2f32.powi(-9)]]);
    let f32_sum = collective(
        &b,
        desc(
            CollectiveKind::AllReduce,
            g,
            2,
            ReduceOp::Sum,
            DType::F32,
            None,
        ),
        Stream::Reduce,
        &inputs,
        &[Some(2); 2],
    );
    assert_eq!(f32_sum[0], Some(vec![2.0 * x, 3.0 + 2f32.powi(-9)]));
    let bf16_sum = collective(
        &b,
        desc(
            CollectiveKind::AllReduce,
            g,
            2,
            ReduceOp::Sum,
            DType::Bf16,
            None,
        ),
        Stream::Reduce,
        &inputs,
        &[Some(2); 2],
    );
    // 1 + 2^-10 rounds to 1 in bf16; 2^-9 is exact; the sum 3 + 2^-9 is kept in f32.
    assert_eq!(bf16_sum[0], Some(vec![2.0, 3.0 + 2f32.powi(-9)]));
    let bytes: Vec<u64> = b.take_timings().iter().map(|t| t.bytes).collect();
    assert_eq!(bytes, vec![8, 8, 4, 4]);
}

#[test]
fn mismatched_collectives_fail_on_every_member_without_hanging() {
    let b = CpuBackend::new(mesh(2, 1)).with_collective_timeout(Duration::from_secs(30));
    let g = Group::Shard { replicate: 0 };
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    let started = Instant::now();
    for (rank, count) in [(0, 2), (1, 3)] {
        let d = desc(
            CollectiveKind::AllReduce,
            g,
            count,
            ReduceOp::Sum,
            DType::F32,
            None,
        );
        let buf = b.alloc(rank, count as usize).unwrap();
        b.launch(
            rank,
            Stream::Reduce,
            tag(4, "stage1"),
            Kernel::Collective {
                desc: d,
                comm,
                send: Some(buf.clone()),
                recv: Some(buf),
            },
        );
    }
    let after = [record(&b, 0, Stream::Reduce), record(&b, 1, Stream::Reduce)];
    sync(&b);
    assert!(started.elapsed() < Duration::from_secs(10));
    let mut errors = b.errors();
    errors.sort_by_key(|e| e.0);
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (rank, (r, stream, t, e)) in errors.iter().enumerate() {
        assert_eq!((*r, *stream, t.op), (rank as u32, Stream::Reduce, "stage1"));
        let OpsError::Collective { comm, reason } = e else {
            panic!("{e:?}")
        };
        assert_eq!(comm, "shard-group(r=0)@reduce");
        assert!(reason.contains("count 2 vs 3"), "{reason}");
    }
    for ev in &after {
        assert!(matches!(
            b.status(ev),
            EventStatus::Failed(OpsError::Cancelled(_))
        ));
    }
}

#[test]
fn a_missing_member_times_out_and_reset_restarts_the_communicator() {
    let b = CpuBackend::new(mesh(2, 1)).with_collective_timeout(Duration::from_millis(100));
    let g = Group::Shard { replicate: 0 };
    let d = desc(
        CollectiveKind::AllReduce,
        g,
        1,
        ReduceOp::Sum,
        DType::F32,
        None,
    );
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    let k = |buf: &CpuBuffer| Kernel::Collective {
        desc: d,
        comm,
        send: Some(buf.clone()),
        recv: Some(buf.clone()),
    };
    let x0 = buffer(&b, 0, &[1.0]);
    b.launch(0, Stream::Reduce, tag(1, "stage1"), k(&x0));
    sync(&b);
    let errors = b.errors();
    assert_eq!(errors.len(), 1);
    let OpsError::Collective { reason, .. } = &errors[0].3 else {
        panic!("{errors:?}")
    };
    assert!(
        reason.contains("timed out") && reason.contains("[1]"),
        "{reason}"
    );

    b.reset();
    assert_eq!(b.errors(), vec![]);
    let x1 = buffer(&b, 1, &[2.0]);
    b.launch(0, Stream::Reduce, tag(1, "stage1"), k(&x0));
    b.launch(1, Stream::Reduce, tag(1, "stage1"), k(&x1));
    sync(&b);
    assert_eq!(b.errors(), vec![]);
    assert_eq!(
        (b.download(&x0).unwrap(), b.download(&x1).unwrap()),
        (vec![3.0], vec![3.0])
    );
}

#[test]
fn an_injected_fault_poisons_its_stream_its_waiters_and_its_collective() {
    let b = CpuBackend::new(mesh(2, 1));
    let g = Group::Shard { replicate: 0 };
    let d = desc(
        CollectiveKind::AllReduce,
        g,
        1,
        ReduceOp::Sum,
        DType::F32,
        None,
    );
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    let k = |buf: &CpuBuffer| Kernel::Collective {
        desc: d,
        comm,
        send: Some(buf.clone()),
        recv: Some(buf.clone()),
    };
    let (x0, x1) = (buffer(&b, 0, &[1.0]), buffer(&b, 1, &[2.0]));
    let (dst, src) = (buffer(&b, 0, &[5.0]), buffer(&b, 0, &[9.0]));
    let copy = || Kernel::Add {
        dst: dst.clone(),
        src: src.clone(),
        accumulate: false,
    };
    b.inject_fault(0, "pack");

    let before = record(&b, 0, Stream::Reduce);
    let pack_tag = tag(3, "pack");
    b.launch(
        0,
        Stream::Reduce,
        pack_tag,
        Kernel::Pack {
            dst: dst.clone(),
            segs: Arc::from(vec![]),
        },
    );
    let after = record(&b, 0, Stream::Reduce);
    b.launch(0, Stream::Reduce, tag(4, "fold"), copy());
    b.launch(0, Stream::Reduce, tag(5, "stage1"), k(&x0));
    b.wait(0, Stream::Compute, &after);
    b.launch(0, Stream::Compute, tag(6, "accumulate"), copy());
    let waiter = record(&b, 0, Stream::Compute);
    b.launch(1, Stream::Reduce, tag(5, "stage1"), k(&x1));
    let peer = record(&b, 1, Stream::Reduce);
    sync(&b);

    assert_eq!(b.status(&before), EventStatus::Complete);
    for ev in [&after, &waiter] {
        let EventStatus::Failed(OpsError::Cancelled(cause)) = b.status(ev) else {
            panic!()
        };
        assert!(
            cause.contains("pack (node 3) on rank 0") && cause.contains("injected fault"),
            "{cause}"
        );
    }
    let EventStatus::Failed(OpsError::Cancelled(cause)) = b.status(&peer) else {
        panic!()
    };
    assert!(
        cause.contains("rank 0 could not take part") && cause.contains("injected fault"),
        "{cause}"
    );
    assert_eq!(
        b.errors(),
        vec![(
            0,
            Stream::Reduce,
            pack_tag,
            OpsError::Failed {
                kernel: "pack",
                reason: "injected fault".into()
            }
        )]
    );
    // Skipped kernels did not run: dst keeps its value and the collective wrote nothing.
    assert_eq!(b.download(&dst).unwrap(), vec![5.0]);
    assert_eq!(
        (b.download(&x0).unwrap(), b.download(&x1).unwrap()),
        (vec![1.0], vec![2.0])
    );

    b.reset();
    assert_eq!(b.errors(), vec![]);
    b.launch(
        0,
        Stream::Reduce,
        pack_tag,
        Kernel::Pack {
            dst: dst.clone(),
            segs: Arc::from(vec![]),
        },
    );
    b.launch(0, Stream::Reduce, tag(5, "stage1"), k(&x0));
    b.launch(1, Stream::Reduce, tag(5, "stage1"), k(&x1));
    let ok = [record(&b, 0, Stream::Reduce), record(&b, 1, Stream::Reduce)];
    sync(&b);
    assert_eq!(b.errors(), vec![], "the fault fired once");
    assert!(ok.iter().all(|ev| b.status(ev) == EventStatus::Complete));
    assert_eq!(
        (b.download(&x0).unwrap(), b.download(&dst).unwrap()),
        (vec![3.0], vec![0.0])
    );
}

#[test]
fn clear_faults_disarms_pending_faults() {
    let b = CpuBackend::new(mesh(1, 1));
    b.inject_fault(0, "grad_ready");
    b.clear_faults();
    b.launch(0, Stream::Compute, tag(0, "grad_ready"), Kernel::Marker);
    sync(&b);
    assert_eq!(b.errors(), vec![]);
}

#[test]
fn pack_zeroes_then_sums_segments_and_unpack_scatters() {
    let b = CpuBackend::new(mesh(1, 1));
    let (g0, acc, g1) = (
        buffer(&b, 0, &[1.0, 2.0, 3.0]),
        buffer(&b, 0, &[10.0, 20.0, 30.0]),
        buffer(&b, 0, &[5.0, 6.0]),
    );
    let send = buffer(&b, 0, &[-1.0; 6]);
    let seg = |param, src, dst, len| CopySeg {
        param,
        src,
        dst,
        len,
    };
    let segs = vec![
        (seg(0, 1, 0, 2), vec![g0.clone(), acc.clone()]),
        (seg(1, 0, 3, 2), vec![g1.clone()]),
    ];
    b.launch(
        0,
        Stream::Reduce,
        tag(0, "pack"),
        Kernel::Pack {
            dst: send.clone(),
            segs: Arc::from(segs),
        },
    );
    sync(&b);
    assert_eq!(
        b.download(&send).unwrap(),
        vec![22.0, 33.0, 0.0, 5.0, 6.0, 0.0]
    );

    let (r0, r1) = (buffer(&b, 0, &[100.0, 100.0]), buffer(&b, 0, &[7.0]));
    let unpack = |accumulate| Kernel::Unpack {
        src: send.clone(),
        segs: Arc::from(vec![
            (seg(0, 0, 0, 2), r0.clone()),
            (seg(1, 4, 0, 1), r1.clone()),
        ]),
        accumulate,
    };
    b.launch(0, Stream::Replicate, tag(1, "unpack"), unpack(true));
    sync(&b);
    assert_eq!(
        (b.download(&r0).unwrap(), b.download(&r1).unwrap()),
        (vec![122.0, 133.0], vec![13.0])
    );
    b.launch(0, Stream::Replicate, tag(1, "unpack"), unpack(false));
    sync(&b);
    assert_eq!(
        (b.download(&r0).unwrap(), b.download(&r1).unwrap()),
        (vec![22.0, 33.0], vec![6.0])
    );
    assert_eq!(b.errors(), vec![]);
}

#[test]
fn optimizer_kernels_equal_the_reference_math() {
    let b = CpuBackend::new(mesh(1, 1));
    let values = |n: usize, k: f32| {
        (0..n)
            .map(|i| ((i as f32 + k) * 0.37).sin())
            .collect::<Vec<f32>>()
    };

    // The second moments (the upper half of the state) must be non-negative.
    let (p, g, st) = (
        values(5, 0.0),
        values(5, 1.0),
        values(10, 2.0).iter().map(|x| x.abs()).collect::<Vec<_>>(),
    );
    let hp = AdamwParams::default();
    let bufs = [buffer(&b, 0, &p), buffer(&b, 0, &g), buffer(&b, 0, &st)];
    let [param, grad, state] = bufs.clone();
    b.launch(
        0,
        Stream::Compute,
        tag(0, "optimizer"),
        Kernel::Adamw {
            param,
            grad,
            state,
            hp,
            step: 3,
        },
    );
    let (mut p_ref, mut st_ref) = (p, st);
    let (m, v) = st_ref.split_at_mut(5);
    math::adamw(&mut p_ref, &g, m, v, &hp, 3);

    let (rows, cols) = (6, 4);
    let (mp, mg, mm) = (values(24, 3.0), values(24, 4.0), values(24, 5.0));
    let hp = MuonParams {
        weight_decay: 0.1,
        ..MuonParams::default()
    };
    let mbufs = [buffer(&b, 0, &mp), buffer(&b, 0, &mg), buffer(&b, 0, &mm)];
    let [param, grad, momentum] = mbufs.clone();
    b.launch(
        0,
        Stream::Compute,
        tag(1, "optimizer"),
        Kernel::Muon {
            param,
            grad,
            momentum,
            rows,
            cols,
            hp,
        },
    );
    let (mut mp_ref, mut mm_ref) = (mp, mm);
    math::muon(&mut mp_ref, &mg, &mut mm_ref, rows, cols, &hp);

    sync(&b);
    assert_eq!(b.errors(), vec![]);
    assert_eq!(b.download(&bufs[0]).unwrap(), p_ref);
    assert_eq!(b.download(&bufs[2]).unwrap(), st_ref);
    assert_eq!(b.download(&mbufs[0]).unwrap(), mp_ref);
    assert_eq!(b.download(&mbufs[2]).unwrap(), mm_ref);
}

/// A row of optimizers over `n` fresh sets of buffers (AdamW, Muon, AdamW, ...) of
/// values seeded by `seed`: the steps, their gradients, and each step's parameter and
/// state as handles.
fn optimizer_row(
    b: &CpuBackend,
    seed: f32,
) -> (Vec<crate::OptimizerStep<CpuBuffer>>, Vec<CpuBuffer>) {
    let values = |n: usize, k: f32| {
        (0..n)
            .map(|i| ((i as f32 + k + seed) * 0.37).sin())
            .collect::<Vec<f32>>()
    };
    let mut steps = Vec::new();
    let mut grads = Vec::new();
    for i in 0..3u32 {
        let k = i as f32 * 3.0;
        let (update, len, state_len) = if i == 1 {
            let hp = MuonParams::default().with_weight_decay(0.1);
            let update = crate::Update::Muon {
                rows: 4,
                cols: 3,
                hp,
                lr: 0.02,
            };
            (update, 12, 12)
        } else {
            let hp = AdamwParams::default().with_weight_decay(0.01);
            (crate::Update::Adamw { hp, lr: 1e-3 }, 5, 10)
        };
        let state: Vec<f32> = values(state_len, k + 2.0).iter().map(|x| x.abs()).collect();
        steps.push(crate::OptimizerStep {
            tag: tag(10 + i, "optimizer"),
            param: buffer(b, 0, &values(len, k)),
            state: buffer(b, 0, &state),
            update,
        });
        grads.push(buffer(b, 0, &values(len, k + 1.0)));
    }
    (steps, grads)
}

#[test]
fn a_row_of_optimizers_is_its_steps_launched_one_by_one() {
    for finite in [true, false] {
        let b = CpuBackend::new(mesh(1, 1));
        let (row, row_grads) = optimizer_row(&b, 0.0);
        let (one, one_grads) = optimizer_row(&b, 0.0);
        let norm = if finite { 4.0 } else { f32::NAN };
        let (g1, g2) = (buffer(&b, 0, &[norm]), buffer(&b, 0, &[norm]));
        let (step, factor) = (7, 0.3);
        for (s, g) in one.iter().zip(&one_grads) {
            b.launch(
                0,
                Stream::Compute,
                s.tag,
                s.guarded(g.clone(), (step, factor), Some(&g2)),
            );
        }
        let steps: Arc<[crate::OptimizerStep<CpuBuffer>]> = row.clone().into();
        b.launch(
            0,
            Stream::Compute,
            tag(10, "optimizer"),
            Kernel::Optimizers(crate::OptimizerRow {
                steps,
                grads: row_grads,
                guard: Some(g1),
                step,
                lr_factor: factor,
            }),
        );
        sync(&b);
        assert_eq!(b.errors(), vec![]);
        for (r, o) in row.iter().zip(&one) {
            assert_eq!(b.download(&r.param).unwrap(), b.download(&o.param).unwrap());
            assert_eq!(b.download(&r.state).unwrap(), b.download(&o.state).unwrap());
        }
        // The learning rate is `lr · factor` in f64, stored in f32; a non-finite
        // guard leaves every step undone.
        let (fresh, _) = optimizer_row(&b, 0.0);
        let moved = b.download(&row[0].param).unwrap() != b.download(&fresh[0].param).unwrap();
        assert_eq!(moved, finite);
    }
}

/// `row` as one unguarded kernel of step 1 at learning-rate factor 1, reading `grads`.
fn step_one(row: &[crate::OptimizerStep<CpuBuffer>], grads: Vec<CpuBuffer>) -> Kernel<CpuBuffer> {
    Kernel::Optimizers(crate::OptimizerRow {
        steps: row.into(),
        grads,
        guard: None,
        step: 1,
        lr_factor: 1.0,
    })
}

#[test]
fn a_row_of_optimizers_fails_at_its_bad_step_or_as_a_whole() {
    // A bad step is reported under its own tag; the steps before it ran, the ones
    // after it are skipped (the stream is poisoned), as when launched one by one.
    let b = CpuBackend::new(mesh(1, 1));
    let (row, mut grads) = optimizer_row(&b, 1.0);
    let (fresh, _) = optimizer_row(&b, 1.0);
    grads[1] = buffer(&b, 0, &[1.0]);
    b.launch(
        0,
        Stream::Compute,
        tag(10, "optimizer"),
        step_one(&row, grads),
    );
    sync(&b);
    let errors = b.errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].2, row[1].tag);
    assert!(matches!(
        errors[0].3,
        OpsError::Shape { kernel: "muon", .. }
    ));
    let param = |s: &crate::OptimizerStep<CpuBuffer>| b.download(&s.param).unwrap();
    assert_ne!(param(&row[0]), param(&fresh[0]));
    assert_eq!(param(&row[2]), param(&fresh[2]));

    // Gradients that do not match the steps fail the row under its tag, running none.
    let b = CpuBackend::new(mesh(1, 1));
    let (row, mut grads) = optimizer_row(&b, 2.0);
    let (fresh, _) = optimizer_row(&b, 2.0);
    grads.pop();
    b.launch(
        0,
        Stream::Compute,
        tag(9, "optimizer"),
        step_one(&row, grads),
    );
    sync(&b);
    let errors = b.errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].2, tag(9, "optimizer"));
    assert!(
        errors[0].3.to_string().contains("2 gradients for 3 steps"),
        "{}",
        errors[0].3
    );
    for (r, f) in row.iter().zip(&fresh) {
        assert_eq!(b.download(&r.param).unwrap(), b.download(&f.param).unwrap());
    }
}

#[test]
fn bad_kernels_report_shape_errors_and_write_nothing() {
    let b = CpuBackend::new(mesh(2, 1));
    let (a, short) = (buffer(&b, 0, &[1.0, 2.0]), buffer(&b, 0, &[3.0]));
    let (p1, state1) = (buffer(&b, 1, &[4.0, 5.0]), buffer(&b, 1, &[0.0; 4]));
    let seg = CopySeg {
        param: 7,
        src: 1,
        dst: 0,
        len: 2,
    };
    let adamw = |param: &CpuBuffer, grad: &CpuBuffer, state: &CpuBuffer, step| Kernel::Adamw {
        param: param.clone(),
        grad: grad.clone(),
        state: state.clone(),
        hp: AdamwParams::default(),
        step,
    };
    // One case per stream, so no case is skipped behind another's poison.
    let cases: Vec<(u32, Stream, Kernel<CpuBuffer>, &str)> = vec![
        (
            0,
            Stream::Compute,
            Kernel::Add {
                dst: a.clone(),
                src: short.clone(),
                accumulate: true,
            },
            "add: src must be a buffer of 2 elements on rank 0",
        ),
        (
            0,
            Stream::Reduce,
            Kernel::Pack {
                dst: a.clone(),
                segs: Arc::from(vec![(seg, vec![a.clone()])]),
            },
            "is both a source and the destination",
        ),
        (
            0,
            Stream::Replicate,
            Kernel::Unpack {
                src: a.clone(),
                segs: Arc::from(vec![(seg, short.clone())]),
                accumulate: false,
            },
            "segment of param 7 (source offset 1, 2 elements) exceeds",
        ),
        (
            0,
            Stream::Publish,
            adamw(&a, &p1, &short, 1),
            "grad must be a buffer of 2 elements on rank 0, got CpuBuffer",
        ),
        (
            1,
            Stream::Compute,
            Kernel::Muon {
                param: p1.clone(),
                grad: p1.clone(),
                momentum: p1.clone(),
                rows: usize::MAX,
                cols: 2,
                hp: MuonParams::default(),
            },
            "matrix has more elements than fit",
        ),
        (
            1,
            Stream::Reduce,
            adamw(&p1, &p1, &state1, 1),
            "adamw: its buffers must be distinct",
        ),
        (
            1,
            Stream::Replicate,
            adamw(&p1, &state1, &state1, 0),
            "grad must be a buffer of 2 elements",
        ),
        (
            1,
            Stream::Publish,
            adamw(&p1, &short, &state1, 0),
            "on rank 1, got CpuBuffer",
        ),
    ];
    let expected: Vec<(u32, Stream, &str)> =
        cases.iter().map(|(r, s, _, msg)| (*r, *s, *msg)).collect();
    for (node, (rank, stream, kernel, _)) in cases.into_iter().enumerate() {
        b.launch(rank, stream, tag(node as u32, "fold"), kernel);
    }
    sync(&b);
    let errors = b.errors();
    assert_eq!(errors.len(), expected.len(), "{errors:?}");
    for (rank, stream, t, e) in &errors {
        let (want_rank, want_stream, msg) = expected[t.node as usize];
        assert_eq!((*rank, *stream), (want_rank, want_stream));
        assert!(
            matches!(e, OpsError::Shape { .. }) && e.to_string().contains(msg),
            "{e} does not say {msg}"
        );
    }
    for (buf, data) in [
        (&a, vec![1.0, 2.0]),
        (&p1, vec![4.0, 5.0]),
        (&state1, vec![0.0; 4]),
    ] {
        assert_eq!(b.download(buf).unwrap(), data);
    }
}

#[test]
fn an_invalid_member_fails_its_collective_on_every_member() {
    let b = CpuBackend::new(mesh(2, 1));
    let g = Group::Shard { replicate: 0 };
    let d = desc(
        CollectiveKind::ReduceScatter,
        g,
        2,
        ReduceOp::Sum,
        DType::F32,
        None,
    );
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    // Rank 0's send holds one chunk instead of two.
    let (s0, r0) = (b.alloc(0, 2).unwrap(), b.alloc(0, 2).unwrap());
    let (s1, r1) = (b.alloc(1, 4).unwrap(), b.alloc(1, 2).unwrap());
    b.launch(
        0,
        Stream::Reduce,
        tag(1, "stage1"),
        Kernel::Collective {
            desc: d,
            comm,
            send: Some(s0),
            recv: Some(r0),
        },
    );
    b.launch(
        1,
        Stream::Reduce,
        tag(1, "stage1"),
        Kernel::Collective {
            desc: d,
            comm,
            send: Some(s1),
            recv: Some(r1),
        },
    );
    let peer = record(&b, 1, Stream::Reduce);
    sync(&b);
    let errors = b.errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0]
            .3
            .to_string()
            .contains("reduce_scatter: send must be a buffer of 4 elements"),
        "{}",
        errors[0].3
    );
    assert!(matches!(
        b.status(&peer),
        EventStatus::Failed(OpsError::Cancelled(_))
    ));
}

#[test]
fn misuse_of_ranks_is_reported_not_panicked() {
    let b = CpuBackend::new(mesh(1, 1));
    assert!(matches!(b.alloc(3, 4), Err(OpsError::Backend(_))));
    b.launch(3, Stream::Compute, tag(0, "fold"), Kernel::Marker);
    let ev = record(&b, 3, Stream::Reduce);
    assert!(matches!(
        b.status(&ev),
        EventStatus::Failed(OpsError::Backend(_))
    ));
    b.wait(0, Stream::Compute, &ev);
    let after = record(&b, 0, Stream::Compute);
    sync(&b);
    let errors = b.errors();
    assert_eq!(
        errors.iter().map(|e| (e.0, e.2.op)).collect::<Vec<_>>(),
        vec![(3, "fold"), (3, "record")]
    );
    // Waiting on the failed record poisons the waiting stream.
    assert!(matches!(
        b.status(&after),
        EventStatus::Failed(OpsError::Cancelled(_))
    ));
    let bad = CpuBackend::new(Mesh {
        shard: 0,
        replicate: 2,
    });
    assert!(bad.local_ranks().is_empty());
}

#[test]
fn dropping_the_backend_releases_a_blocked_collective() {
    let b = CpuBackend::new(mesh(2, 1));
    let g = Group::Shard { replicate: 0 };
    let d = desc(
        CollectiveKind::AllReduce,
        g,
        1,
        ReduceOp::Sum,
        DType::F32,
        None,
    );
    let x = b.alloc(0, 1).unwrap();
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    b.launch(
        0,
        Stream::Reduce,
        tag(1, "stage1"),
        Kernel::Collective {
            desc: d,
            comm,
            send: Some(x.clone()),
            recv: Some(x),
        },
    );
    b.launch(0, Stream::Reduce, tag(2, "fold"), Kernel::Marker);
    let ev = record(&b, 0, Stream::Reduce);
    let host = b.host_wait(&ev);
    thread::sleep(Duration::from_millis(20));
    let started = Instant::now();
    drop(b);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(block_on(host), Err(OpsError::Cancelled(_))));
}

/// Host cost of `launch`; meaningful in release builds only
/// (`cargo test -p overlap-ops --release -- --ignored launch_cost`).
#[test]
#[ignore = "timing measurement; run with --release"]
fn launch_cost() {
    let b = CpuBackend::new(mesh(1, 1));
    let n = 200_000u32;
    let started = Instant::now();
    for node in 0..n {
        b.launch(0, Stream::Compute, tag(node, "grad_ready"), Kernel::Marker);
    }
    let per_launch = started.elapsed() / n;
    sync(&b);
    println!("launch: {per_launch:?} per kernel");
    assert!(
        cfg!(debug_assertions) || per_launch < Duration::from_micros(2),
        "{per_launch:?}"
    );
}

#[test]
fn spin_kernel_keeps_its_stream_busy_and_lets_other_streams_run() {
    let b = CpuBackend::new(mesh(1, 1));
    b.launch(
        0,
        Stream::Compute,
        tag(0, "grad_ready"),
        Kernel::Spin { micros: 200_000 },
    );
    let after = b.event(0);
    b.record(0, Stream::Compute, &after);
    b.launch(0, Stream::Reduce, tag(1, "pack"), Kernel::Marker);
    let reduce_done = record(&b, 0, Stream::Reduce);
    // The reduce stream is not held up by the compute stream's spin.
    block_on(b.host_wait(&reduce_done)).unwrap();
    assert_eq!(
        b.status(&after),
        EventStatus::Pending,
        "the spin is still running"
    );
    sync(&b);
    let timings = b.take_timings();
    let spin = timings.iter().find(|t| t.tag.node == 0).unwrap();
    let busy = spin.end - spin.start;
    assert!((0.2..5.0).contains(&busy), "spin lasted {busy} s");
    assert_eq!((spin.stream, spin.bytes), (Stream::Compute, 0));
}

#[test]
fn gemm_is_exact_on_small_integers_and_refuses_huge_products() {
    // A (2×3) and B (3×2) as gemm_operand fills them, multiplied by hand.
    let a = super::gemm_operand(6, 1);
    let b = super::gemm_operand(6, 2);
    let mut want = vec![0.0f32; 4];
    for i in 0..2 {
        for j in 0..2 {
            want[i * 2 + j] = (0..3).map(|p| a[i * 3 + p] * b[p * 2 + j]).sum();
        }
    }
    assert_eq!(super::gemm(2, 2, 3).unwrap(), want);
    assert!(a.iter().all(|x| (-2.0..=2.0).contains(x)));
    match super::gemm(4096, 4096, 4096) {
        Err(OpsError::Shape {
            kernel: "gemm",
            reason,
        }) => {
            assert!(reason.contains("CUDA backend"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn gemm_kernel_runs_on_its_stream_and_a_huge_one_poisons_it() {
    let b = CpuBackend::new(mesh(1, 1));
    let k = |d| Kernel::Gemm {
        m: d,
        n: d,
        k: d,
        count: 2,
    };
    b.launch(0, Stream::Compute, tag(0, "grad_ready"), k(16));
    sync(&b);
    assert!(b.errors().is_empty());
    let t = b.take_timings();
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].stream, Stream::Compute);
    b.launch(0, Stream::Compute, tag(1, "grad_ready"), k(4096));
    sync(&b);
    let errors = b.errors();
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].2.node, 1);
}

// Copy transport: Exchange (the moving half of a reduction) and Combine (its arithmetic).

/// The element bits of each member's output, so comparisons tell `-0.0` from `0.0`.
fn bits(outs: &[Option<Vec<f32>>]) -> Vec<Option<Vec<u32>>> {
    outs.iter()
        .map(|o| o.as_ref().map(|v| v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// Member `m`'s send data of `len` elements: magnitudes from 1e-3 to 1e3 so the sum's
/// rounding depends on the order of the additions, values that bf16 rounds, and the
/// first element of every `c`-element chunk `-0.0` on every member (a sum started from
/// `+0.0` would give `+0.0`).
fn copy_input(m: usize, len: usize, c: usize) -> Vec<f32> {
    (0..len)
        .map(|k| {
            if k % c == 0 {
                return -0.0;
            }
            let scale = [1.0, 1e3, 1e-3][k % 3];
            ((k * 7 + m * 13 + 1) as f32 * 0.731).sin() * scale
        })
        .collect()
}

/// The exchange of `desc` on every member of its group (on the reduce stream) and the
/// combine on every member that receives the result (on the compute stream, after the
/// exchange through an event), and for an all-reduce the gather (back on the reduce
/// stream, after the combine), each member `i` sending `inputs[i]`; returns each
/// member's output (`None` where it receives nothing). Receive and output buffers start
/// as NaN, so an element nobody wrote shows.
fn exchange_and_combine(
    b: &CpuBackend,
    desc: Collective,
    inputs: &[Vec<f32>],
) -> Vec<Option<Vec<f32>>> {
    let members = b.shared.mesh.members(desc.group);
    let n = members.len() as u32;
    let c = desc.count as usize;
    let comm = CommId {
        group: desc.group,
        stream: Stream::Reduce,
    };
    let mut dsts = Vec::new();
    for (i, (&rank, input)) in (0u32..).zip(members.iter().zip(inputs)) {
        let roles = crate::exchange_roles(&desc, n, i).unwrap();
        let send = buffer(b, rank, input);
        let recv = roles.recv.map(|len| b.alloc_uninit(rank, len).unwrap());
        b.launch(
            rank,
            Stream::Reduce,
            tag(1, "exchange"),
            Kernel::Exchange {
                desc,
                comm,
                send: Some(send.clone()),
                recv: recv.clone(),
            },
        );
        let Some(recv) = recv else {
            dsts.push(None);
            continue;
        };
        let exchanged = record(b, rank, Stream::Reduce);
        b.wait(rank, Stream::Compute, &exchanged);
        let all_reduce = desc.kind == CollectiveKind::AllReduce;
        let (at, k) = desc.member_chunk(n, i);
        let dst = b
            .alloc_uninit(rank, if all_reduce { c } else { k as usize })
            .unwrap();
        let own_offset = at as usize;
        b.launch(
            rank,
            Stream::Compute,
            tag(2, "combine"),
            Kernel::Combine {
                desc,
                size: n,
                index: i,
                own: send,
                own_offset,
                recv,
                dst: dst.clone(),
            },
        );
        if all_reduce {
            let combined = record(b, rank, Stream::Compute);
            b.wait(rank, Stream::Reduce, &combined);
            b.launch(
                rank,
                Stream::Reduce,
                tag(3, "gather"),
                Kernel::Gather {
                    desc,
                    comm,
                    buf: Some(dst.clone()),
                },
            );
        }
        dsts.push(Some(dst));
    }
    sync(b);
    assert_eq!(b.errors(), vec![]);
    dsts.iter()
        .map(|d| d.as_ref().map(|d| b.download(d).unwrap()))
        .collect()
}

#[test]
fn combine_of_exchange_equals_the_collective_bit_for_bit() {
    // 7: every all-reduce chunk but the first is empty; 200: chunks of 128 and 72
    // (2 members), 128, 72 and 0 (3), 64, 64, 64 and 8 (4).
    let mut cases = 0;
    for c in [7usize, 200] {
        // Groups of 2, 3 (non-adjacent ranks 1, 3, 5) and 4 members.
        let groups = [
            (mesh(2, 1), Group::Shard { replicate: 0 }),
            (mesh(2, 3), Group::Replicate { shard: 1 }),
            (mesh(4, 1), Group::Shard { replicate: 0 }),
        ];
        let kinds = [
            (CollectiveKind::ReduceScatter, None),
            (CollectiveKind::AllReduce, None),
            (CollectiveKind::Reduce, Some(0)),
            (CollectiveKind::Reduce, Some(1)),
        ];
        for (m, group) in groups {
            let b = CpuBackend::new(m);
            let members = m.members(group);
            let n = members.len();
            for (kind, root) in kinds {
                for dtype in [DType::F32, DType::Bf16] {
                    for op in [ReduceOp::Sum, ReduceOp::Avg] {
                        let d = desc(kind, group, c as u64, op, dtype, root);
                        let what =
                            format!("{n} members, {kind:?} root {root:?}, {dtype:?}, {op:?}");
                        let len = if kind == CollectiveKind::ReduceScatter {
                            n * c
                        } else {
                            c
                        };
                        let inputs: Vec<Vec<f32>> = (0..n).map(|i| copy_input(i, len, c)).collect();
                        let outputs: Vec<Option<usize>> = (0..n as u32)
                            .map(|i| crate::collective_roles(&d, n as u32, i).unwrap().recv)
                            .collect();
                        let want = collective(&b, d, Stream::Reduce, &all(&inputs), &outputs);
                        b.take_timings();
                        let got = exchange_and_combine(&b, d, &inputs);
                        assert_eq!(bits(&got), bits(&want), "{what}");
                        assert!(
                            got.iter().flatten().flatten().all(|x| !x.is_nan()),
                            "{what}: {got:?}"
                        );
                        if kind == CollectiveKind::AllReduce {
                            let replicas = bits(&got);
                            assert!(replicas.iter().all(|r| *r == replicas[0]), "{what}");
                        }
                        // Element 0 is -0.0 everywhere; its sum keeps the sign.
                        assert!(got
                            .iter()
                            .flatten()
                            .all(|v| v[0].to_bits() == (-0.0f32).to_bits()));
                        // An exchange moves, per member, the f32 chunks it receives; an
                        // all-reduce's gather every other member's chunk.
                        let timings = b.take_timings();
                        let moved = |op: &str| {
                            let mut m: Vec<(u32, u64)> = timings
                                .iter()
                                .filter(|t| t.tag.op == op)
                                .map(|t| (t.rank, t.bytes))
                                .collect();
                            m.sort_unstable();
                            m
                        };
                        let expected: Vec<(u32, u64)> = (0u32..)
                            .zip(&members)
                            .map(|(i, &r)| {
                                let recv = crate::exchange_roles(&d, n as u32, i).unwrap().recv;
                                (r, recv.unwrap_or(0) as u64 * 4)
                            })
                            .collect();
                        assert_eq!(moved("exchange"), expected, "{what}");
                        let gathered: Vec<(u32, u64)> = (0u32..)
                            .zip(&members)
                            .filter(|_| kind == CollectiveKind::AllReduce)
                            .map(|(i, &r)| (r, (c as u64 - d.member_chunk(n as u32, i).1) * 4))
                            .collect();
                        assert_eq!(moved("gather"), gathered, "{what}");
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 3 * 4 * 2 * 2);
}

#[test]
fn exchange_places_each_members_chunk_at_its_slot() {
    let b = CpuBackend::new(mesh(3, 1));
    let g = Group::Shard { replicate: 0 };
    let d = desc(
        CollectiveKind::ReduceScatter,
        g,
        2,
        ReduceOp::Sum,
        DType::Bf16,
        None,
    );
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    // Member m's chunk i is [100m + 10i, 100m + 10i + 1], plus a value bf16 would round:
    // the exchange moves it as is.
    let odd = 1.0 + 2f32.powi(-10);
    let recvs: Vec<CpuBuffer> = (0..3)
        .map(|m| {
            let data: Vec<f32> = (0..6)
                .map(|k| (100 * m + 10 * (k / 2) + k % 2) as f32 + odd)
                .collect();
            let send = buffer(&b, m, &data);
            let recv = b.alloc(m, 4).unwrap();
            b.launch(
                m,
                Stream::Reduce,
                tag(1, "exchange"),
                Kernel::Exchange {
                    desc: d,
                    comm,
                    send: Some(send),
                    recv: Some(recv.clone()),
                },
            );
            recv
        })
        .collect();
    sync(&b);
    assert_eq!(b.errors(), vec![]);
    let got: Vec<Vec<f32>> = recvs.iter().map(|r| b.download(r).unwrap()).collect();
    let chunk = |m: u32, i: u32| {
        let x = (100 * m + 10 * i) as f32 + odd;
        [x, x + 1.0]
    };
    assert_eq!(got[0], [chunk(1, 0), chunk(2, 0)].concat());
    assert_eq!(got[1], [chunk(0, 1), chunk(2, 1)].concat());
    assert_eq!(got[2], [chunk(0, 2), chunk(1, 2)].concat());
}

#[test]
fn combine_in_place_reads_before_it_writes() {
    let b = CpuBackend::new(mesh(2, 1));
    // A reduce to member 1, which combines the whole count.
    let d = desc(
        CollectiveKind::Reduce,
        Group::Shard { replicate: 0 },
        3,
        ReduceOp::Avg,
        DType::F32,
        Some(1),
    );
    let combine = |own: &CpuBuffer, recv: &CpuBuffer, dst: &CpuBuffer| Kernel::Combine {
        desc: d,
        size: 2,
        index: 1,
        own: own.clone(),
        own_offset: 0,
        recv: recv.clone(),
        dst: dst.clone(),
    };
    // dst is own; then dst is recv (a group of two: recv holds one chunk).
    let (own, recv) = (
        buffer(&b, 0, &[1.0, 2.0, 3.0]),
        buffer(&b, 0, &[3.0, 6.0, 9.0]),
    );
    b.launch(
        0,
        Stream::Compute,
        tag(0, "combine"),
        combine(&own, &recv, &own),
    );
    sync(&b);
    assert_eq!(b.download(&own).unwrap(), vec![2.0, 4.0, 6.0]);
    let (own, recv) = (
        buffer(&b, 0, &[1.0, 2.0, 3.0]),
        buffer(&b, 0, &[3.0, 6.0, 9.0]),
    );
    b.launch(
        0,
        Stream::Compute,
        tag(1, "combine"),
        combine(&own, &recv, &recv),
    );
    sync(&b);
    assert_eq!(b.download(&recv).unwrap(), vec![2.0, 4.0, 6.0]);
    assert_eq!(b.errors(), vec![]);
}

#[test]
fn an_exchange_meeting_a_collective_is_a_mismatch_on_every_member() {
    let b = CpuBackend::new(mesh(3, 1)).with_collective_timeout(Duration::from_secs(30));
    let g = Group::Shard { replicate: 0 };
    let d = desc(
        CollectiveKind::ReduceScatter,
        g,
        2,
        ReduceOp::Sum,
        DType::F32,
        None,
    );
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    let started = Instant::now();
    // Ranks 0 and 1 issue the exchange, rank 2 the collective of the same desc.
    let mut recvs = Vec::new();
    for rank in 0..3 {
        let send = Some(buffer(&b, rank, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        let kernel = if rank < 2 {
            let recv = buffer(&b, rank, &[7.0; 4]);
            recvs.push((recv.clone(), vec![7.0; 4]));
            Kernel::Exchange {
                desc: d,
                comm,
                send,
                recv: Some(recv),
            }
        } else {
            let recv = buffer(&b, rank, &[7.0; 2]);
            recvs.push((recv.clone(), vec![7.0; 2]));
            Kernel::Collective {
                desc: d,
                comm,
                send,
                recv: Some(recv),
            }
        };
        b.launch(rank, Stream::Reduce, tag(4, "stage1"), kernel);
    }
    let after: Vec<CpuEvent> = (0..3).map(|r| record(&b, r, Stream::Reduce)).collect();
    sync(&b);
    assert!(started.elapsed() < Duration::from_secs(10));
    let mut errors = b.errors();
    errors.sort_by_key(|e| e.0);
    assert_eq!(errors.len(), 3, "{errors:?}");
    for (rank, (r, stream, _, e)) in errors.iter().enumerate() {
        assert_eq!((*r, *stream), (rank as u32, Stream::Reduce));
        let OpsError::Collective { comm, reason } = e else {
            panic!("{e:?}")
        };
        assert_eq!(comm, "shard-group(r=0)@reduce");
        assert!(
            reason.contains("rank 0 and rank 2 issued different collectives")
                && reason.contains("a copy-transport exchange vs a collective"),
            "{reason}"
        );
    }
    for ev in &after {
        assert!(matches!(
            b.status(ev),
            EventStatus::Failed(OpsError::Cancelled(_))
        ));
    }
    for (recv, data) in recvs {
        assert_eq!(b.download(&recv).unwrap(), data, "nothing was written");
    }

    // The reverse (member 0 issues the collective) is reported from member 0's side, and
    // a kind that differs as well is named too.
    b.reset();
    // An all-reduce of 192: chunks of 64, so member 1 receives 2 × 64.
    let exchange = Kernel::Exchange {
        desc: desc(
            CollectiveKind::AllReduce,
            g,
            192,
            ReduceOp::Sum,
            DType::F32,
            None,
        ),
        comm,
        send: Some(b.alloc(1, 192).unwrap()),
        recv: Some(b.alloc(1, 128).unwrap()),
    };
    let coll = |rank| Kernel::Collective {
        desc: d,
        comm,
        send: Some(b.alloc(rank, 6).unwrap()),
        recv: Some(b.alloc(rank, 2).unwrap()),
    };
    b.launch(0, Stream::Reduce, tag(5, "stage1"), coll(0));
    b.launch(1, Stream::Reduce, tag(5, "stage1"), exchange);
    b.launch(2, Stream::Reduce, tag(5, "stage1"), coll(2));
    sync(&b);
    let errors = b.errors();
    assert_eq!(errors.len(), 3, "{errors:?}");
    for (_, _, _, e) in &errors {
        let reason = e.to_string();
        assert!(
            reason.contains("rank 0 and rank 1 issued different collectives")
                && reason.contains("a collective vs a copy-transport exchange")
                && reason.contains("kind reduce_scatter vs all_reduce"),
            "{reason}"
        );
    }
}

#[test]
fn exchange_buffers_are_checked_against_exchange_roles() {
    let b = CpuBackend::new(mesh(2, 1)).with_collective_timeout(Duration::from_secs(30));
    let g = Group::Shard { replicate: 0 };
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    let rs = desc(
        CollectiveKind::ReduceScatter,
        g,
        2,
        ReduceOp::Sum,
        DType::F32,
        None,
    );
    let reduce = desc(
        CollectiveKind::Reduce,
        g,
        2,
        ReduceOp::Sum,
        DType::F32,
        Some(1),
    );
    let broadcast = desc(
        CollectiveKind::Broadcast,
        g,
        2,
        ReduceOp::Sum,
        DType::F32,
        Some(0),
    );
    let buf = |rank, len| Some(b.alloc(rank, len).unwrap());
    // Rank 0's call is wrong in each case; rank 1's is right (where one can be).
    // Per member, its send and recv buffers.
    type Bufs = [(Option<CpuBuffer>, Option<CpuBuffer>); 2];
    let cases: Vec<(Collective, Bufs, &str)> = vec![
        (
            rs,
            [(buf(0, 4), buf(0, 4)), (buf(1, 4), buf(1, 2))],
            "exchange: recv must be a buffer of 2 elements on rank 0",
        ),
        (
            rs,
            [(buf(0, 2), buf(0, 2)), (buf(1, 4), buf(1, 2))],
            "exchange: send must be a buffer of 4 elements on rank 0",
        ),
        (
            rs,
            [(buf(1, 4), buf(0, 2)), (buf(1, 4), buf(1, 2))],
            "exchange: send must be a buffer of 4 elements on rank 0",
        ),
        (
            rs,
            [(buf(0, 4), None), (buf(1, 4), buf(1, 2))],
            "exchange: member 0 (rank 0) needs a recv buffer of 2 elements",
        ),
        (
            reduce,
            [(buf(0, 2), buf(0, 2)), (buf(1, 2), buf(1, 2))],
            "exchange: member 0 (rank 0) takes no recv buffer",
        ),
        (
            broadcast,
            [(buf(0, 2), None), (None, buf(1, 2))],
            "exchange: broadcast on shard-group(r=0): broadcast reduces nothing and has no copy-transport exchange",
        ),
    ];
    for (case, (d, bufs, msg)) in cases.into_iter().enumerate() {
        for (rank, (send, recv)) in (0u32..).zip(bufs) {
            b.launch(
                rank,
                Stream::Reduce,
                tag(case as u32, "exchange"),
                Kernel::Exchange {
                    desc: d,
                    comm,
                    send,
                    recv,
                },
            );
        }
        let peer = record(&b, 1, Stream::Reduce);
        sync(&b);
        let mut errors = b.errors();
        errors.sort_by_key(|e| e.0);
        let broadcast = d.kind == CollectiveKind::Broadcast;
        // Rank 1 is refused too for a broadcast; otherwise its call is cancelled.
        assert_eq!(
            errors.len(),
            1 + broadcast as usize,
            "case {case}: {errors:?}"
        );
        let (rank, _, t, e) = &errors[0];
        assert_eq!((*rank, t.node), (0, case as u32));
        assert!(
            matches!(e, OpsError::Shape { .. }) && e.to_string().contains(msg),
            "case {case}: {e} does not say {msg}"
        );
        let EventStatus::Failed(OpsError::Cancelled(cause)) = b.status(&peer) else {
            panic!("case {case}: {:?}", b.status(&peer))
        };
        assert!(
            broadcast || cause.contains("rank 0 could not take part"),
            "case {case}: {cause}"
        );
        b.reset();
    }
}

#[test]
fn bad_combines_report_shape_errors_and_write_nothing() {
    let b = CpuBackend::new(mesh(2, 1));
    let g = Group::Shard { replicate: 0 };
    let d = |kind, root| desc(kind, g, 2, ReduceOp::Avg, DType::Bf16, root);
    let rs = d(CollectiveKind::ReduceScatter, None);
    let dst = buffer(&b, 0, &[5.0; 2]);
    let own6 = buffer(&b, 0, &[1.0; 6]);
    let recv4 = buffer(&b, 0, &[2.0; 4]);
    let on_rank1 = b.alloc(1, 2).unwrap();
    let combine =
        |desc, size, index, own: &CpuBuffer, own_offset, recv: &CpuBuffer| Kernel::Combine {
            desc,
            size,
            index,
            own: own.clone(),
            own_offset,
            recv: recv.clone(),
            dst: dst.clone(),
        };
    let cases: Vec<(Kernel<CpuBuffer>, &str)> = vec![
        (
            combine(rs, 3, 2, &own6, 5, &recv4),
            "own is too short: own_offset 5 + 2 elements exceeds its 6 elements",
        ),
        (
            combine(rs, 3, 1, &own6, usize::MAX, &recv4),
            "own is too short: own_offset 18446744073709551615",
        ),
        (
            combine(rs, 4, 1, &own6, 2, &recv4),
            "recv is too short: the 3 other members' chunks need 6 elements",
        ),
        (
            Kernel::Combine {
                desc: rs,
                size: 3,
                index: 1,
                own: own6.clone(),
                own_offset: 2,
                recv: recv4.clone(),
                dst: own6.clone(),
            },
            "dst must hold count = 2 elements, got 6",
        ),
        (
            combine(rs, 3, 3, &own6, 2, &recv4),
            "member index 3 is not a member of a group of 3",
        ),
        (
            combine(rs, 0, 0, &own6, 0, &recv4),
            "member index 0 is not a member of a group of 0",
        ),
        (
            combine(d(CollectiveKind::Reduce, Some(0)), 3, 1, &own6, 0, &recv4),
            "member 1 is not the root (Some(0)) of the reduce on shard-group(r=0): it receives nothing to combine",
        ),
        (
            combine(d(CollectiveKind::Reduce, Some(3)), 3, 1, &own6, 0, &recv4),
            "root Some(3) is not a member index",
        ),
        (
            combine(d(CollectiveKind::AllGather, None), 3, 1, &own6, 0, &recv4),
            "all_gather reduces nothing",
        ),
        (
            combine(rs, 3, 1, &own6, 2, &on_rank1),
            "recv must be a buffer of 2 elements on rank 0, got CpuBuffer",
        ),
    ];
    for (node, (kernel, msg)) in cases.into_iter().enumerate() {
        b.launch(0, Stream::Compute, tag(node as u32, "combine"), kernel);
        sync(&b);
        let errors = b.errors();
        assert_eq!(errors.len(), 1, "{errors:?}");
        let e = &errors[0].3;
        assert!(
            matches!(
                e,
                OpsError::Shape {
                    kernel: "combine",
                    ..
                }
            ) && e.to_string().contains(msg),
            "{e} does not say {msg}"
        );
        b.reset();
    }
    for (buf, data) in [
        (&dst, vec![5.0; 2]),
        (&own6, vec![1.0; 6]),
        (&recv4, vec![2.0; 4]),
    ] {
        assert_eq!(b.download(buf).unwrap(), data);
    }
    // The same kernel with valid arguments runs: member 1 of 3, (2 + 1 + 2) / 3.
    b.launch(
        0,
        Stream::Compute,
        tag(0, "combine"),
        combine(rs, 3, 1, &own6, 2, &recv4),
    );
    sync(&b);
    assert_eq!(b.errors(), vec![]);
    assert_eq!(b.download(&dst).unwrap(), vec![5.0f32 / 3.0; 2]);
}

#[test]
fn a_poisoned_or_faulty_member_cancels_the_exchange_on_the_others() {
    let b = CpuBackend::new(mesh(3, 1)).with_collective_timeout(Duration::from_secs(30));
    let g = Group::Shard { replicate: 0 };
    // A reduce-scatter of one element per member: send 3, receive 2 on every member.
    let d = desc(
        CollectiveKind::ReduceScatter,
        g,
        1,
        ReduceOp::Sum,
        DType::F32,
        None,
    );
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    let sends: Vec<CpuBuffer> = (0..3)
        .map(|r| buffer(&b, r, &[r as f32 + 1.0; 3]))
        .collect();
    let recvs: Vec<CpuBuffer> = (0..3).map(|r| buffer(&b, r, &[-1.0, -1.0])).collect();
    let exchange = |rank: u32| Kernel::Exchange {
        desc: d,
        comm,
        send: Some(sends[rank as usize].clone()),
        recv: Some(recvs[rank as usize].clone()),
    };
    let untouched = || {
        recvs
            .iter()
            .all(|r| b.download(r).unwrap() == vec![-1.0, -1.0])
    };
    let started = Instant::now();

    // Rank 0's stream is poisoned by a failing pack before its exchange.
    b.inject_fault(0, "pack");
    b.launch(
        0,
        Stream::Reduce,
        tag(3, "pack"),
        Kernel::Pack {
            dst: b.alloc(0, 1).unwrap(),
            segs: Arc::from(vec![]),
        },
    );
    for rank in 0..3 {
        b.launch(rank, Stream::Reduce, tag(4, "exchange"), exchange(rank));
    }
    let peers = [record(&b, 1, Stream::Reduce), record(&b, 2, Stream::Reduce)];
    sync(&b);
    for ev in &peers {
        let EventStatus::Failed(OpsError::Cancelled(cause)) = b.status(ev) else {
            panic!("{:?}", b.status(ev))
        };
        assert!(
            cause.contains("rank 0 could not take part") && cause.contains("injected fault"),
            "{cause}"
        );
    }
    let errors = b.errors();
    assert_eq!(errors.len(), 1, "only the root cause: {errors:?}");
    assert_eq!(errors[0].2.op, "pack");
    assert!(untouched());

    // A fault injected into the exchange itself fails it on its rank and cancels it on
    // the others.
    b.reset();
    b.inject_fault(2, "exchange");
    for rank in 0..3 {
        b.launch(rank, Stream::Reduce, tag(4, "exchange"), exchange(rank));
    }
    let peers = [record(&b, 0, Stream::Reduce), record(&b, 1, Stream::Reduce)];
    sync(&b);
    assert_eq!(
        b.errors(),
        vec![(
            2,
            Stream::Reduce,
            tag(4, "exchange"),
            OpsError::Failed {
                kernel: "exchange",
                reason: "injected fault".into()
            }
        )]
    );
    for ev in &peers {
        let EventStatus::Failed(OpsError::Cancelled(cause)) = b.status(ev) else {
            panic!("{:?}", b.status(ev))
        };
        assert!(cause.contains("rank 2 could not take part"), "{cause}");
    }
    assert!(untouched());
    assert!(started.elapsed() < Duration::from_secs(10));

    // After a reset the communicator works again.
    b.reset();
    for rank in 0..3 {
        b.launch(rank, Stream::Reduce, tag(4, "exchange"), exchange(rank));
    }
    sync(&b);
    assert_eq!(b.errors(), vec![]);
    let got: Vec<Vec<f32>> = recvs.iter().map(|r| b.download(r).unwrap()).collect();
    assert_eq!(got, vec![vec![2.0, 3.0], vec![1.0, 3.0], vec![1.0, 2.0]]);
}

#[test]
fn a_missing_exchange_member_times_out() {
    let b = CpuBackend::new(mesh(2, 1)).with_collective_timeout(Duration::from_millis(100));
    let g = Group::Shard { replicate: 0 };
    let d = desc(
        CollectiveKind::Reduce,
        g,
        1,
        ReduceOp::Sum,
        DType::F32,
        Some(0),
    );
    b.launch(
        0,
        Stream::Reduce,
        tag(1, "exchange"),
        Kernel::Exchange {
            desc: d,
            comm: CommId {
                group: g,
                stream: Stream::Reduce,
            },
            send: Some(b.alloc(0, 1).unwrap()),
            recv: Some(b.alloc(0, 1).unwrap()),
        },
    );
    sync(&b);
    let errors = b.errors();
    assert_eq!(errors.len(), 1);
    let OpsError::Collective { reason, .. } = &errors[0].3 else {
        panic!("{errors:?}")
    };
    assert!(
        reason.contains("timed out") && reason.contains("[1]"),
        "{reason}"
    );
}

#[test]
fn a_gather_checks_its_collective_and_buffer() {
    let b = CpuBackend::new(mesh(2, 1));
    let g = Group::Shard { replicate: 0 };
    let comm = CommId {
        group: g,
        stream: Stream::Reduce,
    };
    let d = |kind| desc(kind, g, 130, ReduceOp::Sum, DType::F32, None);
    let cases = [
        (
            d(CollectiveKind::ReduceScatter),
            130,
            "only an all-reduce's chunks are gathered, not a reduce_scatter's",
        ),
        (
            d(CollectiveKind::AllReduce),
            129,
            "send must be a buffer of 130 elements",
        ),
    ];
    for (node, (desc, len, msg)) in cases.into_iter().enumerate() {
        for rank in 0..2 {
            b.launch(
                rank,
                Stream::Reduce,
                tag(node as u32, "gather"),
                Kernel::Gather {
                    desc,
                    comm,
                    buf: Some(b.alloc(rank, len).unwrap()),
                },
            );
        }
        sync(&b);
        let errors = b.errors();
        assert!(
            errors.iter().any(|(_, _, _, e)| matches!(
                e,
                OpsError::Shape {
                    kernel: "gather",
                    ..
                }
            ) && e.to_string().contains(msg)),
            "{errors:?}"
        );
        b.reset();
    }
    // Valid: chunks of 128 and 2 elements; each member ends with both.
    let bufs: Vec<CpuBuffer> = (0..2)
        .map(|r| buffer(&b, r, &vec![r as f32 + 1.0; 130]))
        .collect();
    for rank in 0..2 {
        b.launch(
            rank,
            Stream::Reduce,
            tag(9, "gather"),
            Kernel::Gather {
                desc: d(CollectiveKind::AllReduce),
                comm,
                buf: Some(bufs[rank as usize].clone()),
            },
        );
    }
    sync(&b);
    assert_eq!(b.errors(), vec![]);
    let want: Vec<f32> = (0..130).map(|e| if e < 128 { 1.0 } else { 2.0 }).collect();
    for buf in &bufs {
        assert_eq!(b.download(buf).unwrap(), want);
    }
}

#[test]
fn a_mesh_past_the_rank_limit_starts_no_thread_and_fails_what_is_issued() {
    assert!(CpuBackend::check_mesh(mesh(16, 16)).is_ok());
    assert!(CpuBackend::check_mesh(mesh(MAX_RANKS, 1)).is_ok());
    let big = mesh(MAX_RANKS + 1, 1);
    let e = CpuBackend::check_mesh(big).unwrap_err().to_string();
    assert!(e.contains("limit of 1024"), "{e}");
    let e = CpuBackend::check_mesh(Mesh {
        shard: 0,
        replicate: 1,
    })
    .unwrap_err();
    assert!(e.to_string().contains("zero dimension"), "{e}");
    let b = CpuBackend::new(big);
    assert!(b.threads.is_empty());
    b.launch(0, Stream::Compute, tag(0, "grad_ready"), Kernel::Marker);
    let ev = record(&b, 0, Stream::Compute);
    assert!(matches!(b.status(&ev), EventStatus::Failed(_)));
    let errors = b.errors();
    assert!(!errors.is_empty());
    assert!(
        errors
            .iter()
            .all(|e| e.3.to_string().contains("CPU backend's limit of 1024")),
        "{errors:?}"
    );
}
