//! Every plan the planner builds validates, on every mesh shape and gate pattern.

use overlap_graph::{validate, Bindings, Gate, Mesh, Mode, ParamSpec, PlanSpec, Planner, Route};

pub fn four_routes() -> Vec<ParamSpec> {
    let p = |name: &str, shape: Vec<u64>, route, layer| ParamSpec::new(name, shape, route, layer);
    vec![
        p("embed", vec![37, 6], Route::ShardedAdamw, 0),
        p("blocks.0.norm", vec![7], Route::Fsdp, 1),
        p("blocks.0.w", vec![9, 5], Route::Muon, 1),
        p("blocks.0.b", vec![11], Route::Adamw, 1),
        p("blocks.1.norm", vec![5, 3], Route::Fsdp, 2),
        p("blocks.1.w", vec![6, 10], Route::Muon, 2),
        p("head", vec![13, 3], Route::ShardedAdamw, 3),
    ]
}

fn spec(shard: u32, replicate: u32) -> PlanSpec {
    PlanSpec::new(Mesh::new(shard, replicate).unwrap(), four_routes()).with_bucket_cap_bytes(256)
}

#[test]
fn built_plans_validate_on_every_mesh_and_gate_pattern() {
    use Gate::*;
    let patterns: Vec<Vec<Gate>> = vec![
        vec![On],
        vec![ReplicateOff, On],
        vec![ReplicateOff, ReplicateOff, On],
        vec![On, On],
        vec![NoSync, ReplicateOff, On],
        vec![ReplicateOff, On, ReplicateOff, On],
        vec![NoSync, NoSync, On],
    ];
    for (s, r) in [(1, 1), (2, 2), (1, 4), (4, 1), (2, 3), (3, 2)] {
        let planner = Planner::new(spec(s, r)).unwrap();
        for g in &patterns {
            let plan = planner.plan(g).unwrap();
            let v = validate(&plan, Mode::Step);
            assert!(
                v.is_empty(),
                "mesh {s}x{r} gates {}: {:#?}",
                Gate::pattern_label(g),
                v
            );
        }
    }
}

#[test]
fn copy_transport_plans_validate_with_every_combine_lag() {
    use overlap_graph::{Op, Schedule, Stream, Transport};
    use Gate::*;
    let patterns: Vec<Vec<Gate>> = vec![
        vec![On],
        vec![ReplicateOff, On],
        vec![NoSync, ReplicateOff, On],
        vec![ReplicateOff, On, ReplicateOff, On],
    ];
    for (s, r) in [(1, 1), (2, 2), (1, 4), (4, 1), (2, 3), (3, 2)] {
        for lag in [0, 1, 2, 7] {
            for combine in [Stream::Compute, Stream::Reduce, Stream::Publish] {
                let spec = spec(s, r)
                    .with_bindings(Bindings::default().with_combine(combine))
                    .with_schedule(
                        Schedule::default()
                            .with_transport(Transport::Copy)
                            .with_combine_lag(lag),
                    );
                let planner = Planner::new(spec).unwrap();
                for g in &patterns {
                    let plan = planner.plan(g).unwrap();
                    let v = validate(&plan, Mode::Step);
                    assert!(
                        v.is_empty(),
                        "mesh {s}x{r} lag {lag} combine on {combine} gates {}: {:#?}",
                        Gate::pattern_label(g),
                        v
                    );
                    // Groups of more than one member exchange; none runs a collective
                    // for a stage (only the publish broadcasts remain).
                    for rp in &plan.ranks {
                        for n in &rp.nodes {
                            if let Op::Stage1 { collective, .. } | Op::Stage2 { collective, .. } =
                                n.op
                            {
                                assert_eq!(plan.mesh.group_size(collective.group), 1);
                            }
                            if let Op::Combine { .. } = n.op {
                                assert_eq!(n.stream, combine);
                            }
                        }
                    }
                    if s * r > 1 && g == &vec![On] {
                        assert!(plan.ranks[0]
                            .nodes
                            .iter()
                            .any(|n| matches!(n.op, Op::Exchange { .. })));
                    }
                }
            }
        }
    }
}

#[test]
fn a_lagged_combine_follows_the_next_layers_backward() {
    use overlap_graph::{Op, Schedule, Transport};
    let spec = spec(2, 1).with_schedule(
        Schedule::default()
            .with_transport(Transport::Copy)
            .with_combine_lag(1),
    );
    let plan = Planner::new(spec).unwrap().plan(&[Gate::On]).unwrap();
    let nodes = &plan.ranks[0].nodes;
    let layer_of = |b: u32| plan.buckets[b as usize].layer;
    let layers = plan.layers_desc();
    for n in nodes {
        let Op::Combine { bucket, .. } = n.op else {
            continue;
        };
        let l = layer_of(bucket);
        let li = layers.iter().position(|&x| x == l).unwrap();
        // The grad_ready issued last before the combine is the next layer's (or the
        // combine ends the micro-batch, after the last layer).
        let last_ready = nodes[..n.id as usize]
            .iter()
            .rev()
            .find_map(|m| match m.op {
                Op::GradReady { layer } => Some(layer),
                _ => None,
            })
            .unwrap();
        match layers.get(li + 1) {
            Some(&next) => assert_eq!(last_ready, next, "combine of layer {l}"),
            None => assert_eq!(last_ready, *layers.last().unwrap()),
        }
    }
}

/// On mesh 1x2 (all-reduces: exchange, combine, gather), with the combine one layer
/// behind: the gathers of the layer before the last are issued before the last layer's
/// exchanges by default, after them when `early_tail_gathers` is off; every other
/// layer's chain comes after the next layer's exchanges either way, and the plans
/// validate. Mesh 2x1 (no gathers) plans the same with the rule on or off.
#[test]
fn lagging_gathers_go_out_before_the_last_layers_exchanges() {
    use overlap_graph::{Op, Schedule, Transport};
    let plan_of = |shard, replicate, early| {
        let spec = spec(shard, replicate).with_schedule(
            Schedule::default()
                .with_transport(Transport::Copy)
                .with_combine_lag(1)
                .with_early_tail_gathers(early),
        );
        let plan = Planner::new(spec).unwrap().plan(&[Gate::On]).unwrap();
        assert!(validate(&plan, Mode::Step).is_empty());
        plan
    };
    for early in [true, false] {
        let plan = plan_of(1, 2, early);
        let nodes = &plan.ranks[0].nodes;
        let layers = plan.layers_desc();
        let last = *layers.last().unwrap();
        let layer_of = |b: u32| plan.buckets[b as usize].layer;
        let pos = |f: &dyn Fn(&Op) -> bool| nodes.iter().position(|n| f(&n.op));
        let first_last_exchange =
            pos(&|op| matches!(op, Op::Exchange { bucket, .. } if layer_of(*bucket) == last))
                .expect("the last layer exchanges");
        let last_ready =
            pos(&|op| matches!(op, Op::GradReady { layer } if *layer == last)).unwrap();
        let mut before = 0;
        for (i, n) in nodes.iter().enumerate() {
            let Op::Gather { bucket, .. } = n.op else {
                continue;
            };
            let l = layer_of(bucket);
            let li = layers.iter().position(|&x| x == l).unwrap();
            if li + 2 == layers.len() {
                assert_eq!(
                    i < first_last_exchange,
                    early,
                    "gather of layer {l}, early {early}"
                );
                assert!(
                    i > last_ready,
                    "gather of layer {l} after the last backward"
                );
                before += usize::from(i < first_last_exchange);
            } else if li + 2 < layers.len() {
                // Behind the next layer's first exchange, as lag 1 says.
                let next = layers[li + 1];
                let next_exchange = pos(
                    &|op| matches!(op, Op::Exchange { bucket, .. } if layer_of(*bucket) == next),
                )
                .unwrap();
                assert!(i > next_exchange, "gather of layer {l}");
            }
        }
        assert_eq!(before > 0, early);
    }
    let (on, off) = (plan_of(2, 1, true), plan_of(2, 1, false));
    assert_eq!(on.ranks, off.ranks, "no gathers, no change");
}

/// Whether node `a` happens before node `b` in a rank's stream programs: stream order,
/// and each wait after the record it waits for.
fn happens_before(rp: &overlap_graph::RankProgram, a: u32, b: u32) -> bool {
    use overlap_graph::Instr;
    // Instructions as (stream, position), edges to the next on the stream and from a
    // record to its waits: a search from `a`'s run.
    let mut at = std::collections::HashMap::new();
    for (s, sp) in rp.streams.iter().enumerate() {
        for (i, ins) in sp.instrs.iter().enumerate() {
            if let Instr::Run(n) = *ins {
                at.insert(n, (s, i));
            }
        }
    }
    let (start, goal) = (at[&a], at[&b]);
    let mut seen = std::collections::HashSet::new();
    let mut todo = vec![start];
    while let Some((s, i)) = todo.pop() {
        if (s, i) == goal {
            return true;
        }
        if !seen.insert((s, i)) {
            continue;
        }
        if i + 1 < rp.streams[s].instrs.len() {
            todo.push((s, i + 1));
        }
        if let Instr::Record(e) = rp.streams[s].instrs[i] {
            for (t, sp) in rp.streams.iter().enumerate() {
                for (j, ins) in sp.instrs.iter().enumerate() {
                    if *ins == Instr::Wait(e) {
                        todo.push((t, j));
                    }
                }
            }
        }
    }
    false
}

/// `combine_after_exchanges`: on meshes 2x1 and 1x2, lag 0 to 2, every combine happens
/// after the latest exchange issued before it (without the option, with lag 1 on 2x1,
/// a combine and the next layer's exchange are unordered), the layer before the last
/// is combined before the last layer's exchanges, and the plans validate.
#[test]
fn combines_can_wait_for_the_exchanges_before_them() {
    use overlap_graph::{Op, Schedule, Transport};
    let plan_of = |shard, replicate, lag, after| {
        let spec = spec(shard, replicate).with_schedule(
            Schedule::default()
                .with_transport(Transport::Copy)
                .with_combine_lag(lag)
                .with_combine_after_exchanges(after),
        );
        let plan = Planner::new(spec).unwrap().plan(&[Gate::On]).unwrap();
        assert!(validate(&plan, Mode::Step).is_empty());
        plan
    };
    // (latest exchange before, combine) pairs of rank 0 where they are different nodes.
    let pairs = |plan: &overlap_graph::Plan| {
        let mut latest = None;
        let mut out = Vec::new();
        for n in &plan.ranks[0].nodes {
            match n.op {
                Op::Exchange { .. } => latest = Some(n.id),
                Op::Combine { .. } => out.extend(latest.map(|e| (e, n.id))),
                _ => {}
            }
        }
        out
    };
    for (s, r) in [(2, 1), (1, 2)] {
        for lag in [0, 1, 2] {
            let plan = plan_of(s, r, lag, true);
            for (e, c) in pairs(&plan) {
                assert!(
                    happens_before(&plan.ranks[0], e, c),
                    "mesh {s}x{r} lag {lag}: combine {c} after exchange {e}"
                );
            }
        }
    }
    // Behind the last layer's exchange, the layer before's combine would wait for it:
    // it goes out before it (the tail rule of `early_tail_gathers`).
    let plan = plan_of(2, 1, 1, true);
    let layers = plan.layers_desc();
    let layer_of = |b: u32| plan.buckets[b as usize].layer;
    let first = |pick: &dyn Fn(&Op) -> bool| {
        plan.ranks[0]
            .nodes
            .iter()
            .position(|n| pick(&n.op))
            .unwrap()
    };
    let (last, before) = (layers[layers.len() - 1], layers[layers.len() - 2]);
    assert!(
        first(&|op| matches!(op, Op::Combine { bucket, .. } if layer_of(*bucket) == before))
            < first(&|op| matches!(op, Op::Exchange { bucket, .. } if layer_of(*bucket) == last))
    );
    let plain = plan_of(2, 1, 1, false);
    assert!(
        pairs(&plain)
            .iter()
            .any(|&(e, c)| !happens_before(&plain.ranks[0], e, c)),
        "without the option some combine runs beside a later exchange"
    );
}

/// The prefix property with the copy transport, for every lag and schedule flag: a
/// prefix plan's stream programs begin every stream program of the step's (matched by
/// stream: a prefix may use fewer streams).
#[test]
fn copy_transport_prefixes_are_prefixes_of_the_step_plan() {
    use overlap_graph::{Schedule, Transport};
    use Gate::*;
    let gates = [NoSync, ReplicateOff, On, ReplicateOff, On];
    for lag in 0..3 {
        for (early, after) in [(true, false), (false, false), (true, true)] {
            let spec = spec(2, 2).with_schedule(
                Schedule::default()
                    .with_transport(Transport::Copy)
                    .with_combine_lag(lag)
                    .with_early_tail_gathers(early)
                    .with_combine_after_exchanges(after),
            );
            let planner = Planner::new(spec).unwrap();
            let full = planner.plan(&gates).unwrap();
            for k in 1..gates.len() {
                let prefix = planner.plan_prefix(&gates[..k]).unwrap();
                assert!(validate(&prefix, Mode::Prefix).is_empty());
                for (a, b) in prefix.ranks.iter().zip(&full.ranks) {
                    for sa in &a.streams {
                        let sb = b
                            .streams
                            .iter()
                            .find(|sb| sb.stream == sa.stream)
                            .expect("the step plan uses every stream its prefix does");
                        assert_eq!(
                            sa.instrs[..],
                            sb.instrs[..sa.instrs.len()],
                            "lag {lag} early {early} after {after}, prefix {k}, rank {} stream {}",
                            a.rank,
                            sa.stream
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn plan_json_round_trips() {
    let plan = Planner::new(spec(2, 2))
        .unwrap()
        .plan(&[Gate::ReplicateOff, Gate::On])
        .unwrap();
    let back = overlap_graph::Plan::from_json(&plan.to_json()).unwrap();
    assert_eq!(plan, back);
}

#[test]
fn plan_of_a_gate_prefix_is_a_prefix_of_the_step_plan() {
    use Gate::*;
    let planner = Planner::new(spec(2, 2)).unwrap();
    let gates = [NoSync, ReplicateOff, On, ReplicateOff, On];
    let full = planner.plan(&gates).unwrap();
    for k in 1..gates.len() {
        let prefix = planner.plan_prefix(&gates[..k]).unwrap();
        assert!(validate(&prefix, Mode::Prefix).is_empty());
        for (a, b) in prefix.ranks.iter().zip(&full.ranks) {
            let mb_nodes = a
                .nodes
                .iter()
                .take_while(|n| n.micro_batch.is_some())
                .count();
            assert_eq!(a.nodes[..mb_nodes], b.nodes[..mb_nodes]);
            for (sa, sb) in a.streams.iter().zip(&b.streams) {
                assert_eq!(sa.stream, sb.stream);
                assert_eq!(
                    sa.instrs[..],
                    sb.instrs[..sa.instrs.len()],
                    "rank {} stream {}",
                    a.rank,
                    sa.stream
                );
            }
        }
    }
}

#[test]
fn plans_with_the_global_norm_validate_and_count_every_element_once() {
    use overlap_graph::{Buffer, Op, Schedule, Transport};
    use Gate::*;
    for transport in [Transport::Nccl, Transport::Copy] {
        for (s, r) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (2, 3)] {
            let schedule = Schedule::default().with_transport(transport);
            let planner =
                Planner::new(spec(s, r).with_schedule(schedule).with_grad_norm(true)).unwrap();
            for g in [vec![On], vec![NoSync, ReplicateOff, On]] {
                let plan = planner.plan(&g).unwrap();
                let v = validate(&plan, Mode::Step);
                assert!(v.is_empty(), "mesh {s}x{r} {transport:?}: {v:#?}");
                // Every element of every parameter is counted by exactly one rank.
                let mut counted = vec![0u64; plan.params.len()];
                for rp in &plan.ranks {
                    let norms: Vec<_> = rp.nodes.iter().filter(|n| n.op == Op::GradNorm).collect();
                    assert_eq!(norms.len(), 1);
                    for b in plan.access(rp.rank, norms[0]).reads {
                        if let Buffer::Reduced { param } = b {
                            counted[param as usize] += plan.buffer_len(rp.rank, &b);
                        }
                    }
                }
                for (p, c) in counted.iter().enumerate() {
                    assert_eq!(*c, plan.params[p].spec.numel(), "{s}x{r} param {p}");
                }
                let prefix = planner.plan_prefix(&g).unwrap();
                assert!(validate(&prefix, Mode::Prefix).is_empty());
            }
        }
    }
}
