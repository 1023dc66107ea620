//! The simulator on hand-built plans with known answers, on planned ones, and its
//! determinism.

use super::*;
use overlap_graph::mesh::{Group, Mesh};
use overlap_graph::node::{Collective, CollectiveKind, DType, Instr, Node, Op, ReduceOp, Stream};
use overlap_graph::param::{ParamSpec, Route};
use overlap_graph::plan::{PlanSpec, RankProgram, StreamProgram};
use overlap_graph::{Gate, Planner, Schedule, Transport};

const MS: f64 = 1e-3;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

macro_rules! assert_close {
    ($a:expr, $b:expr) => {{
        let (a, b) = ($a, $b);
        assert!(close(a, b), "{} = {a}, expected {b}", stringify!($a));
    }};
}

/// One rank's hand-built program: its nodes (stream and operation, ids in order), its
/// stream programs and its number of events.
type Program = (Vec<(Stream, Op)>, Vec<StreamProgram>, u32);

/// A valid plan's tables (one `fsdp` parameter, one bucket) with the given programs.
fn plan_with(mesh: Mesh, programs: Vec<Program>) -> Plan {
    plan_of_gates(mesh, &[Gate::On], programs)
}

/// [`plan_with`] of a step of these gates (one micro-batch each).
fn plan_of_gates(mesh: Mesh, gates: &[Gate], programs: Vec<Program>) -> Plan {
    let spec = PlanSpec::new(mesh, vec![ParamSpec::new("w", vec![1024], Route::Fsdp, 0)]);
    let mut plan = Planner::new(spec).unwrap().plan(gates).unwrap();
    plan.ranks = programs
        .into_iter()
        .enumerate()
        .map(|(r, (nodes, streams, events))| RankProgram {
            rank: r as u32,
            nodes: nodes
                .into_iter()
                .enumerate()
                .map(|(i, (stream, op))| Node {
                    id: i as u32,
                    // The micro-batch the operation names; the step's tail nodes
                    // belong to no micro-batch.
                    micro_batch: op.micro_batch().or((!op.is_norm()).then_some(0)),
                    stream,
                    op,
                })
                .collect(),
            events,
            streams,
        })
        .collect();
    plan.check_well_formed().unwrap();
    plan
}

fn program(stream: Stream, instrs: Vec<Instr>) -> StreamProgram {
    StreamProgram { stream, instrs }
}

fn backward() -> Op {
    Op::GradReady { layer: 0 }
}

/// A collective over the shard group of replicate index 0.
fn coll(kind: CollectiveKind, count: u64) -> Collective {
    Collective {
        kind,
        group: Group::Shard { replicate: 0 },
        count,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: None,
    }
}

/// One millisecond of backward per `grad_ready`; rates of 1 GB/s.
fn options() -> Options {
    Options {
        backward: Backward::Seconds(MS),
        ..Options::default()
    }
}

fn profile() -> Profile {
    Profile::neutral("test")
}

/// A memory-bound kernel of `ms` milliseconds on a neutral profile (a norm all-reduce
/// over a group of one is a copy of `count` f32: `8·count` bytes at 1 GB/s).
fn memory_kernel(ms: f64) -> Op {
    let count = (ms * MS * 1e9 / 8.0).round() as u64;
    Op::NormReduce {
        collective: Collective {
            group: Group::Replicate { shard: 0 },
            ..coll(CollectiveKind::AllReduce, count)
        },
    }
}

#[test]
fn a_chain_on_one_stream_and_across_an_event() {
    use Instr::*;
    let mesh = Mesh::new(1, 1).unwrap();
    let plan = plan_with(
        mesh,
        vec![(
            vec![
                (Stream::Compute, backward()),
                (Stream::Compute, backward()),
                (Stream::Reduce, memory_kernel(2.0)),
                (Stream::Compute, backward()),
            ],
            vec![
                program(Stream::Compute, vec![Run(0), Run(1), Record(0), Run(3)]),
                program(Stream::Reduce, vec![Wait(0), Run(2)]),
            ],
            1,
        )],
    );
    let s = simulate(&plan, &profile(), &options()).unwrap();
    let t = |n| s.node(0, n);
    assert_close!(t(0).start, 0.0);
    assert_close!(t(0).end, MS);
    assert_close!(t(1).end, 2.0 * MS);
    // The reduce stream waits for the record after node 1.
    assert_close!(t(2).start, 2.0 * MS);
    assert_close!(t(2).end, 4.0 * MS);
    assert_close!(t(3).end, 3.0 * MS);
    assert_close!(s.span(0), 4.0 * MS);
    assert_close!(s.busy(&plan, 0, Stream::Compute), 3.0 * MS);
    assert_close!(s.busy(&plan, 0, Stream::Reduce), 2.0 * MS);
    assert_eq!(t(0).class, Class::Compute);
    assert_eq!(t(2).class, Class::Memory);
    // A cross-stream wait that takes 100 µs to see its record.
    let mut p = profile();
    p.event_us = 100.0;
    let s = simulate(&plan, &p, &options()).unwrap();
    assert_close!(s.node(0, 2).start, 2.1 * MS);
    assert_close!(s.span(0), 4.1 * MS);
}

#[test]
fn two_streams_in_parallel_share_the_gpu_as_the_profile_says() {
    use Instr::*;
    let plan = plan_with(
        Mesh::new(1, 1).unwrap(),
        vec![(
            vec![
                (Stream::Compute, backward()),
                (Stream::Reduce, memory_kernel(1.0)),
            ],
            vec![
                program(Stream::Compute, vec![Run(0)]),
                program(Stream::Reduce, vec![Run(1)]),
            ],
            0,
        )],
    );
    // No interference: both run from 0 to 1 ms.
    let s = simulate(&plan, &profile(), &options()).unwrap();
    assert_close!(s.node(0, 0).end, MS);
    assert_close!(s.node(0, 1).end, MS);
    assert_close!(s.span(0), MS);
    // Beside the backward the kernel runs at half its rate (stretch 2) and costs the
    // backward half a second per second of its work: the backward runs at 0.75 until it
    // ends at 4/3 ms, the kernel has then done 2/3 of its work and ends 1/3 ms later.
    let mut p = profile();
    p.combine_beside = Beside {
        gemm_cost: 0.5,
        stretch: 2.0,
    };
    let s = simulate(&plan, &p, &options()).unwrap();
    assert_close!(s.node(0, 0).end, 4.0 / 3.0 * MS);
    assert_close!(s.node(0, 1).end, 5.0 / 3.0 * MS);
    // Two memory-bound kernels share the bandwidth: both end at 2 ms.
    let plan = plan_with(
        Mesh::new(1, 1).unwrap(),
        vec![(
            vec![
                (Stream::Replicate, memory_kernel(1.0)),
                (Stream::Reduce, memory_kernel(1.0)),
            ],
            vec![
                program(Stream::Replicate, vec![Run(0)]),
                program(Stream::Reduce, vec![Run(1)]),
            ],
            0,
        )],
    );
    let s = simulate(&plan, &profile(), &options()).unwrap();
    assert_close!(s.node(0, 0).end, 2.0 * MS);
    assert_close!(s.node(0, 1).end, 2.0 * MS);
}

#[test]
fn a_collective_waits_for_its_slowest_member() {
    use Instr::*;
    // An all-reduce of 250k f32 over two ranks at 1 GB/s of bus bandwidth: 2·(1/2)·1 MB
    // = 1 ms once both members are there. Rank 0 reaches it after 1 ms of backward, rank
    // 1 after 3 ms.
    let ar = || Op::NormReduce {
        collective: coll(CollectiveKind::AllReduce, 250_000),
    };
    let rank = |backwards: usize| {
        let mut nodes: Vec<(Stream, Op)> = vec![(Stream::Compute, backward()); backwards];
        nodes.push((Stream::Reduce, ar()));
        let mut compute: Vec<Instr> = (0..backwards as u32).map(Run).collect();
        compute.push(Record(0));
        (
            nodes,
            vec![
                program(Stream::Compute, compute),
                program(Stream::Reduce, vec![Wait(0), Run(backwards as u32)]),
            ],
            1,
        )
    };
    let plan = plan_with(Mesh::new(2, 1).unwrap(), vec![rank(1), rank(3)]);
    let mut p = profile();
    p.nvlink_base_us = 0.0;
    p.gpus_per_node = 2;
    let s = simulate(&plan, &p, &options()).unwrap();
    assert_close!(s.node(0, 1).start, MS);
    assert_close!(s.node(0, 1).end, 4.0 * MS);
    assert_close!(s.node(1, 3).start, 3.0 * MS);
    assert_close!(s.node(1, 3).end, 4.0 * MS);
    assert_eq!(s.node(0, 1).class, Class::Nccl);
    // The latency: 10 µs fixed and 5 per ring step (two for an all-reduce of two).
    p.nvlink_base_us = 10.0;
    p.nvlink_hop_us = 5.0;
    let s = simulate(&plan, &p, &options()).unwrap();
    assert_close!(s.node(0, 1).end, 4.0 * MS + 20e-6);
    // Across nodes without a network: refused; with one, the slower link sets the rate.
    p.gpus_per_node = 1;
    assert!(matches!(
        simulate(&plan, &p, &options()),
        Err(SimError::NoNetwork { .. })
    ));
    p.network = Some(Network {
        hop_us: 0.0,
        nic_gbs: 0.5,
    });
    p.nvlink_base_us = 0.0;
    p.nvlink_hop_us = 0.0;
    let s = simulate(&plan, &p, &options()).unwrap();
    assert_close!(s.node(0, 1).end, 5.0 * MS);
}

/// Two ranks, each with the given exchanges (alone 1 ms each: 250k f32 to the peer at
/// 1 GB/s) on the given streams, all from time 0.
fn exchanges(streams: &[Stream]) -> Plan {
    let rank = || {
        let nodes: Vec<(Stream, Op)> = streams
            .iter()
            .map(|&s| {
                (
                    s,
                    Op::Exchange {
                        bucket: 0,
                        micro_batch: 0,
                        stage: 1,
                        collective: coll(CollectiveKind::ReduceScatter, 250_000),
                    },
                )
            })
            .collect();
        let progs = streams
            .iter()
            .enumerate()
            .map(|(i, &s)| program(s, vec![Instr::Run(i as u32)]))
            .collect();
        (nodes, progs, 0)
    };
    plan_with(Mesh::new(2, 1).unwrap(), vec![rank(), rank()])
}

#[test]
fn a_copy_engine_is_shared_by_two_exchanges() {
    let mut p = profile();
    p.gpus_per_node = 2;
    let one = exchanges(&[Stream::Copy]);
    let s = simulate(&one, &p, &options()).unwrap();
    assert_close!(s.node(0, 0).end, MS);
    assert_eq!(s.node(0, 0).class, Class::Copy);
    // Two at once on one copy engine: each at half the rate, both end at 2 ms.
    let two = exchanges(&[Stream::Copy, Stream::Reduce]);
    let s = simulate(&two, &p, &options()).unwrap();
    for n in 0..2 {
        assert_close!(s.node(0, n).end, 2.0 * MS);
        assert_close!(s.node(1, n).end, 2.0 * MS);
    }
    // Two engines: both at full rate.
    p.ce_concurrency = 2;
    let s = simulate(&two, &p, &options()).unwrap();
    assert_close!(s.node(0, 1).end, MS);
    // On one stream they run in turn.
    p.ce_concurrency = 1;
    let turn = exchanges(&[Stream::Copy]);
    let mut turn2 = turn.clone();
    for rp in &mut turn2.ranks {
        rp.nodes.push(Node {
            id: 1,
            ..rp.nodes[0].clone()
        });
        rp.streams[0].instrs.push(Instr::Run(1));
    }
    let s = simulate(&turn2, &p, &options()).unwrap();
    assert_close!(s.node(0, 1).start, MS);
    assert_close!(s.node(0, 1).end, 2.0 * MS);
    // Across nodes the copy transport cannot run.
    p.gpus_per_node = 1;
    assert!(matches!(
        simulate(&one, &p, &options()),
        Err(SimError::CopyAcrossNodes { .. })
    ));
    p.gpus_per_node = 2;
    // Copied out of the ring (no in-place receive): the local copy at 1 GB/s adds 1 ms.
    let out = Options {
        copy: CopyRing {
            in_place: false,
            ..CopyRing::default()
        },
        ..options()
    };
    let s = simulate(&one, &p, &out).unwrap();
    assert_close!(s.node(0, 0).end, 2.0 * MS);
}

#[test]
fn an_in_place_exchange_waits_for_its_ring_slot() {
    use Instr::*;
    // Depth 1: the second exchange reuses the slot of the first, which its combine (3 ms
    // of memory-bound work: (2 + 1) chunks of 1 MB at 1 GB/s) frees.
    let x = || Op::Exchange {
        bucket: 0,
        micro_batch: 0,
        stage: 1,
        collective: coll(CollectiveKind::ReduceScatter, 250_000),
    };
    let c = Op::Combine {
        bucket: 0,
        micro_batch: 0,
        stage: 1,
        collective: coll(CollectiveKind::ReduceScatter, 250_000),
    };
    let rank = || {
        (
            vec![
                (Stream::Copy, x()),
                (Stream::Reduce, c),
                (Stream::Copy, x()),
            ],
            vec![
                program(Stream::Copy, vec![Run(0), Record(0), Run(2)]),
                program(Stream::Reduce, vec![Wait(0), Run(1)]),
            ],
            1,
        )
    };
    let plan = plan_with(Mesh::new(2, 1).unwrap(), vec![rank(), rank()]);
    let mut p = profile();
    p.gpus_per_node = 2;
    let ring = |depth, in_place| Options {
        copy: CopyRing {
            slot_bytes: 1 << 20,
            depth,
            in_place,
        },
        ..options()
    };
    assert_eq!(
        in_place_comms(&plan, ring(1, true).copy),
        vec![(Group::Shard { replicate: 0 }, Stream::Copy)]
    );
    let s = simulate(&plan, &p, &ring(1, true)).unwrap();
    assert_close!(s.node(0, 1).end, 4.0 * MS);
    assert_close!(s.node(0, 2).start, MS);
    assert_close!(s.node(0, 2).end, 5.0 * MS);
    // With two slots it does not wait.
    let s = simulate(&plan, &p, &ring(2, true)).unwrap();
    assert_close!(s.node(0, 2).end, 2.0 * MS);
}

#[test]
fn the_host_issues_nodes_in_turn() {
    let mut p = profile();
    p.issue_us_per_node = 10.0;
    let plan = plan_with(
        Mesh::new(1, 1).unwrap(),
        vec![(
            vec![(Stream::Compute, backward()); 3],
            vec![program(
                Stream::Compute,
                vec![Instr::Run(0), Instr::Run(1), Instr::Run(2)],
            )],
            0,
        )],
    );
    let o = Options {
        backward: Backward::Seconds(1e-6),
        ..options()
    };
    let s = simulate(&plan, &p, &o).unwrap();
    assert_close!(s.node(0, 0).start, 10e-6);
    assert_close!(s.node(0, 1).start, 20e-6);
    assert_close!(s.node(0, 2).end, 31e-6);
    assert_close!(s.span(0), 21e-6);
}

/// One rank of three Stage-1 buffers (micro-batches 0, 1, 2 of bucket 0), each a pack
/// (aliased: a marker, no device time) then a 2 ms Stage-1 kernel, all on the reduce
/// stream, in the order `order` gives (`p` a pack, `s` a Stage-1 kernel, each followed by
/// its micro-batch). The memory of buffer `k` is freed by its Stage-1 kernel.
fn windowed(order: &[(char, u32)]) -> (Plan, Vec<Vec<Stage1Release>>, Vec<bool>) {
    let nodes: Vec<(Stream, Op)> = order
        .iter()
        .map(|&(kind, k)| {
            let op = match kind {
                'p' => Op::Pack {
                    bucket: 0,
                    micro_batch: k,
                    with_accum: false,
                },
                _ => memory_kernel(2.0),
            };
            (Stream::Reduce, op)
        })
        .collect();
    let runs = (0..order.len() as u32).map(Instr::Run).collect();
    let plan = plan_of_gates(
        Mesh::new(1, 1).unwrap(),
        &[Gate::On; 3],
        vec![(nodes, vec![program(Stream::Reduce, runs)], 0)],
    );
    let releases = order
        .iter()
        .enumerate()
        .filter(|(_, &(kind, _))| kind == 's')
        .map(|(i, &(_, k))| Stage1Release {
            bucket: 0,
            micro_batch: k,
            after: i as u32,
            nodes: vec![i as u32],
        })
        .collect();
    let aliased = order.iter().map(|&(kind, _)| kind == 'p').collect();
    (plan, vec![releases], aliased)
}

#[test]
fn a_stage1_window_of_one_serialises_stage1_behind_the_host() {
    let (plan, releases, aliased) =
        windowed(&[('p', 0), ('s', 0), ('p', 1), ('s', 1), ('p', 2), ('s', 2)]);
    // The host takes 1 ms per node.
    let mut p = profile();
    p.issue_us_per_node = 1000.0;
    let with = |window: Option<u32>| Options {
        aliased: vec![aliased.clone()],
        stage1: window.map(|window| Stage1Window {
            window,
            releases: releases.clone(),
        }),
        ..options()
    };
    // No window: the host issues node i at i + 1 ms. s0 runs 2–4 ms; s1, issued at 4,
    // runs 4–6; s2, issued at 6, runs 6–8: the host stays ahead of the device.
    let free = simulate(&plan, &p, &with(None)).unwrap();
    // Node `n` runs from `start` to `end` ms.
    let t = |s: &Simulation, n, start: f64, end: f64| {
        assert_close!(s.node(0, n).start, start * MS);
        assert_close!(s.node(0, n).end, end * MS);
    };
    t(&free, 1, 2.0, 4.0);
    t(&free, 3, 4.0, 6.0);
    t(&free, 5, 6.0, 8.0);
    // Window 1: before p1 the host lets buffer 0 go, waiting for s0 to end (4 ms); it
    // issues p1 at 5 and s1 at 6, which runs 6–8; before p2 it waits for s1 (8 ms),
    // issues p2 at 9 and s2 at 10, which runs 10–12. Each Stage-1 kernel waits for two
    // host issues after the one before it.
    let one = simulate(&plan, &p, &with(Some(1))).unwrap();
    t(&one, 1, 2.0, 4.0);
    t(&one, 2, 5.0, 5.0);
    t(&one, 3, 6.0, 8.0);
    t(&one, 4, 9.0, 9.0);
    t(&one, 5, 10.0, 12.0);
    assert_close!(one.span(0), 11.0 * MS);
    assert_close!(free.span(0), 7.0 * MS);
    // Window 2: before p2 the host waits for s0, which ended at 4 ms, when the host had
    // just issued s1: nothing changes.
    assert_eq!(simulate(&plan, &p, &with(Some(2))).unwrap(), free);
    // A window of at least the number of buffers never waits: no window, bit for bit.
    for window in [3, 4, 100] {
        assert_eq!(simulate(&plan, &p, &with(Some(window))).unwrap(), free);
    }
}

#[test]
fn a_release_issued_after_the_pack_that_lets_its_buffer_go_is_not_waited_for() {
    // p0, p1, s0, s1, p2, s2: with window 1, p1 lets buffer 0 go before the host has
    // issued s0 (the executor knows of no release yet), so it waits for nothing; p2 lets
    // buffer 1 go, whose release (s1) was issued: it waits for s1.
    let (plan, releases, aliased) =
        windowed(&[('p', 0), ('p', 1), ('s', 0), ('s', 1), ('p', 2), ('s', 2)]);
    let mut p = profile();
    p.issue_us_per_node = 1000.0;
    let o = Options {
        aliased: vec![aliased],
        stage1: Some(Stage1Window {
            window: 1,
            releases,
        }),
        ..options()
    };
    let s = simulate(&plan, &p, &o).unwrap();
    // p1 at 2 ms, s0 at 3 (runs 3–5), s1 at 4 (runs 5–7); p2 waits for s1: issued at 8,
    // s2 at 9, runs 9–11.
    assert_close!(s.node(0, 1).start, 2.0 * MS);
    assert_close!(s.node(0, 3).end, 7.0 * MS);
    assert_close!(s.node(0, 4).start, 8.0 * MS);
    assert_close!(s.node(0, 5).end, 11.0 * MS);
}

#[test]
fn a_stage1_window_that_does_not_fit_the_plan_is_refused() {
    let (plan, releases, _) = windowed(&[('p', 0), ('s', 0)]);
    let with = |window, releases| Options {
        stage1: Some(Stage1Window { window, releases }),
        ..options()
    };
    let err = |o: &Options| match simulate(&plan, &profile(), o) {
        Err(SimError::Options(why)) => why,
        other => panic!("expected an options error, got {other:?}"),
    };
    assert!(err(&with(0, releases.clone())).contains("at least 1"));
    assert!(err(&with(1, Vec::new())).contains("cover 0 ranks, the plan has 1"));
    let mut far = releases;
    far[0][0].nodes.push(7);
    assert!(err(&with(1, far)).contains("names node 7, but the rank has 2 nodes"));
}

#[test]
fn a_rendezvous_a_member_never_reaches_stalls_the_step() {
    use Instr::*;
    let with = (
        vec![(
            Stream::Reduce,
            Op::NormReduce {
                collective: coll(CollectiveKind::AllReduce, 1),
            },
        )],
        vec![program(Stream::Reduce, vec![Run(0)])],
        0,
    );
    let without = (
        vec![(Stream::Compute, backward())],
        vec![program(Stream::Compute, vec![Run(0)])],
        0,
    );
    let plan = plan_with(Mesh::new(2, 1).unwrap(), vec![with, without]);
    let mut p = profile();
    p.gpus_per_node = 2;
    match simulate(&plan, &p, &options()) {
        Err(SimError::Stalled(why)) => {
            assert!(why.contains("rank 0 stream reduce"), "{why}")
        }
        other => panic!("expected a stall, got {other:?}"),
    }
}

#[test]
fn a_bad_profile_is_refused_with_its_key() {
    let plan = exchanges(&[Stream::Copy]);
    let mut p = profile();
    p.ce_peer_gbs = 0.0;
    match simulate(&plan, &p, &options()) {
        Err(SimError::Profile(e)) => {
            assert_eq!(e.key, "copy_engine.peer_gbs");
            assert!(e.reason.contains("above 0"), "{e}");
        }
        other => panic!("expected a profile error, got {other:?}"),
    }
    p = profile();
    p.copy_beside.stretch = 0.5;
    assert!(matches!(
        simulate(&plan, &p, &options()),
        Err(SimError::Profile(e)) if e.key == "interference.copy_engine.stretch"
    ));
    // Every key reads back what was set.
    let mut q = profile();
    for (i, k) in KEYS.iter().enumerate() {
        let v = 1.0 + i as f64;
        assert!(q.set(k.path, v), "{}", k.path);
        assert_eq!(q.get(k.path), Some(v), "{}", k.path);
    }
    assert!(!q.set("no.such.key", 1.0));
}

/// A planned step: mesh 2x2, copy transport, three layers, two micro-batches.
fn planned(transport: Transport) -> Plan {
    let params = (0..3)
        .map(|l| ParamSpec::new(format!("layer{l}.w"), vec![64, 48], Route::Fsdp, l))
        .collect();
    let spec = PlanSpec::new(Mesh::new(2, 2).unwrap(), params)
        .with_schedule(Schedule::default().with_transport(transport));
    Planner::new(spec)
        .unwrap()
        .plan(&[Gate::ReplicateOff, Gate::On])
        .unwrap()
}

#[test]
fn planned_steps_run_every_node_in_stream_order_and_deterministically() {
    let mut p = Profile::neutral("h");
    p.gpus_per_node = 4;
    p.kernel_us = 2.0;
    p.issue_us_per_node = 1.0;
    p.nvlink_base_us = 5.0;
    p.combine_beside = Beside {
        gemm_cost: 0.3,
        stretch: 3.0,
    };
    p.nccl_beside = Beside {
        gemm_cost: 0.4,
        stretch: 1.5,
    };
    for transport in [Transport::Nccl, Transport::Copy] {
        let plan = planned(transport);
        let o = Options {
            backward: Backward::Seconds(50e-6),
            ..Options::default()
        };
        let s = simulate(&plan, &p, &o).unwrap();
        for rp in &plan.ranks {
            for sp in &rp.streams {
                let mut last = 0.0;
                for ins in &sp.instrs {
                    if let Instr::Run(n) = *ins {
                        let t = s.node(rp.rank, n);
                        assert!(t.start >= last && t.end >= t.start, "{t:?}");
                        last = t.end;
                    }
                }
            }
            assert!(s.span(rp.rank) > 0.0);
        }
        // The same input, the same timings, bit for bit.
        assert_eq!(s, simulate(&plan.clone(), &p.clone(), &o.clone()).unwrap());
        // A Stage-1 window: each buffer freed by the last node of its bucket and
        // micro-batch. A window of at least the packs of a rank never waits (the same
        // step, bit for bit); a window of 1 finishes too, no sooner.
        let releases: Vec<Vec<Stage1Release>> = plan
            .ranks
            .iter()
            .map(|rp| {
                rp.nodes
                    .iter()
                    .filter(|n| matches!(n.op, Op::Pack { .. }))
                    .map(|pack| {
                        let key = (pack.op.bucket(), pack.op.micro_batch());
                        let last = rp
                            .nodes
                            .iter()
                            .rev()
                            .find(|n| (n.op.bucket(), n.op.micro_batch()) == key)
                            .map_or(pack.id, |n| n.id);
                        Stage1Release {
                            bucket: pack.op.bucket().unwrap(),
                            micro_batch: pack.op.micro_batch().unwrap(),
                            after: last,
                            nodes: vec![last],
                        }
                    })
                    .collect()
            })
            .collect();
        let packs = releases.iter().map(Vec::len).max().unwrap();
        assert!(packs >= 4, "{packs} packs");
        let window = |window| Options {
            stage1: Some(Stage1Window {
                window: window as u32,
                releases: releases.clone(),
            }),
            ..o.clone()
        };
        assert_eq!(simulate(&plan, &p, &window(packs)).unwrap(), s);
        let one = simulate(&plan, &p, &window(1)).unwrap();
        assert!(one.span(0) >= s.span(0), "{} < {}", one.span(0), s.span(0));
        // Aliased nodes cost nothing.
        let all = Options {
            aliased: plan
                .ranks
                .iter()
                .map(|rp| vec![true; rp.nodes.len()])
                .collect(),
            ..o.clone()
        };
        let a = simulate(&plan, &p, &all).unwrap();
        assert!(a.ranks.iter().flatten().all(|t| t.end == t.start));
    }
}

/// A forward plan simulates: its layers' forwards cost half their backward each, the
/// gathers are collectives over the shard group, and every rank's step ends.
#[test]
fn a_forward_plan_adds_the_forwards_and_its_gathers() {
    let params = (0..4)
        .map(|l| ParamSpec::new(format!("l{l}.w"), vec![256, 256], Route::Fsdp, l))
        .collect::<Vec<_>>();
    let mesh = Mesh::new(2, 1).unwrap();
    let plain = PlanSpec::new(mesh, params.clone());
    let forward = plain.clone().with_forward(Some(
        overlap_graph::plan::ForwardSpec::default()
            .with_prefetch(1)
            .with_reshard_after_forward(true),
    ));
    let mut p = profile();
    p.gpus_per_node = 2;
    let o = Options {
        backward: Backward::Seconds(1.0 * MS),
        ..options()
    };
    let span = |spec: PlanSpec| {
        let plan = Planner::new(spec).unwrap().plan(&[Gate::On]).unwrap();
        let sim = simulate(&plan, &p, &o).unwrap();
        assert_close!(sim.span(0), sim.span(1));
        sim.span(0)
    };
    let (without, with) = (span(plain), span(forward));
    // Four forwards of 0.5 ms on the compute stream, at least.
    assert!(
        with >= without + 4.0 * 0.5 * MS - 1e-9,
        "{with} vs {without}"
    );
}

/// A planned 1x1 step of Muon matrices of these shapes (parameters 0, 1, ...).
fn muon_plan(shapes: &[[u64; 2]]) -> Plan {
    let params = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec::new(format!("m{i}"), s.to_vec(), Route::Muon, 0))
        .collect();
    Planner::new(PlanSpec::new(Mesh::new(1, 1).unwrap(), params))
        .unwrap()
        .plan(&[Gate::On])
        .unwrap()
}

/// Seconds of the optimizer node of `param` on rank 0 of `plan` in `s`.
fn optimizer_seconds(plan: &Plan, s: &Simulation, param: u32) -> f64 {
    let node = plan.ranks[0]
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::Optimizer { param: q, .. } if q == param))
        .expect("the step updates the parameter");
    let t = s.node(0, node.id);
    t.end - t.start
}

/// Muon's device time on a planned 1x1 step of one 64 × 256 Muon matrix, with its
/// Newton–Schulz in `run` (or the defaults when `None`), on a profile whose bf16 GEMM
/// rate is 8 TFLOP/s and f32 rate 1.
fn muon_seconds(run: Option<(NsDtype, u32)>) -> f64 {
    let plan = muon_plan(&[[64, 256]]);
    let mut p = profile();
    (p.gemm_tflops, p.fp32_tflops, p.hbm_gbs) = (8.0, 1.0, 1e6);
    let o = Options {
        newton_schulz: run.into_iter().collect(),
        ..options()
    };
    optimizer_seconds(&plan, &simulate(&plan, &p, &o).unwrap(), 0)
}

#[test]
fn muon_costs_its_newton_schulz_at_the_rate_of_its_precision() {
    // 64 × 256: 5 iterations of 4m²n + 2m³; its traffic, 5 × 16384 f32 at 1 PB/s.
    let flops = |steps: f64| steps * (4.0 * 64.0 * 64.0 * 256.0 + 2.0 * 64f64.powi(3));
    let traffic = 5.0 * 16384.0 * 4.0 / 1e15;
    let cases = [
        (Some((NsDtype::F32, 5)), flops(5.0) / 1e12),
        (Some((NsDtype::Bf16, 5)), flops(5.0) / 8e12),
        (Some((NsDtype::Tf32, 5)), flops(5.0) / 4e12),
        (Some((NsDtype::Bf16, 3)), flops(3.0) / 8e12),
        // No entry: Muon's defaults, bf16 and 5 iterations.
        (None, flops(5.0) / 8e12),
    ];
    for (run, ns) in cases {
        assert_close!(muon_seconds(run), ns + traffic);
    }
}

#[test]
fn muon_matrices_of_one_shape_share_their_batchs_launches() {
    // Two 64 × 256 matrices and one 32 × 32 on one rank, launches of 10 µs and
    // everything else free: the pair shares one batch's 19 launches (5 iterations),
    // the third has a batch of its own.
    let plan = muon_plan(&[[64, 256], [64, 256], [32, 32]]);
    let mut p = profile();
    (p.gemm_tflops, p.hbm_gbs, p.kernel_us) = (1e9, 1e9, 10.0);
    let s = simulate(&plan, &p, &options()).unwrap();
    let launches = |param| optimizer_seconds(&plan, &s, param) / 10e-6;
    for (param, want) in [(0, 9.5), (1, 9.5), (2, 19.0)] {
        assert!(
            (launches(param) - want).abs() < 1e-3,
            "{param}: {}",
            launches(param)
        );
    }
}
