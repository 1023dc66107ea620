//! `overlap bench` and `overlap bench-collectives` on this process's GPU, and the job
//! they (and `overlap calibrate`) open: the workloads themselves are
//! [`crate::bench`]'s, generic over the backend.
//!
//! Invariant: every rank opens the communicators of both bindings the bench runs (the
//! default and the serial one), so the serial variant's exchanges have rings of their
//! own; only rank 0 returns figures.

use overlap::{Error, Mesh};
use overlap_graph::{Bindings, Transport};

use crate::bench::{serial_bindings, BenchArgs, BenchReport, CollectiveRow, CombineCache};

/// Opens this rank's GPU for `mesh` under a launcher (`overlap launch`), with the
/// communicators of both the default and the serial bindings and kernel timings on.
pub(super) fn open_cuda(
    mesh: Mesh,
    bindings: Bindings,
    links: overlap_dist::cuda::Links,
    what: overlap_dist::fingerprint::Fingerprint,
) -> Result<overlap_dist::cuda::CudaWorld, Error> {
    use overlap_ops::cuda::mesh_comms;
    let env = overlap_dist::cuda::rank_env(mesh)?;
    let copy = links.copy.is_some();
    let mut comms = mesh_comms(mesh, &bindings, copy);
    comms.extend(mesh_comms(mesh, &serial_bindings(), copy));
    comms.sort();
    comms.dedup();
    overlap_dist::cuda::open(env, mesh, comms, true, links, what)
}

/// The fingerprint of a benchmark command and its arguments.
pub(super) fn bench_fingerprint(
    command: &str,
    args: String,
) -> overlap_dist::fingerprint::Fingerprint {
    let mut f = overlap_dist::fingerprint::Fingerprint::build();
    f.push("command", command);
    f.push("bench.args", args);
    f
}

/// `overlap bench` on this process's GPU: every rank runs the variants; rank 0 returns
/// its figures (the other ranks `None`).
pub(crate) async fn bench(args: &BenchArgs) -> Result<Option<BenchReport>, Error> {
    args.check()?;
    // Both plans the bench runs (the serial one's exchanges are on the compute stream,
    // so on rings of their own).
    let specs = [args.spec(Bindings::default()), args.spec(serial_bindings())];
    let links = overlap_dist::cuda::Links {
        copy: (args.transport == Transport::Copy).then(|| {
            overlap_dist::cuda::copy_setup(
                &[&specs[0], &specs[1]],
                (args.copy_slot_mib as usize) << 20,
                args.copy_ring_depth as usize,
                !args.no_in_place,
            )
        }),
        nccl_max_ctas: args.nccl_max_ctas,
        combine_ctas: args.combine_ctas,
        combine_cached: args.combine_cache == CombineCache::Normal,
        uniform_priority: args.uniform_priority,
    };
    let bindings = args.spec(Bindings::default()).bindings;
    let world = open_cuda(
        args.mesh,
        bindings,
        links,
        bench_fingerprint("bench", format!("{args:?}")),
    )?;
    let report = crate::bench::run(world.backend.clone(), args).await?;
    if world.env.rank != 0 {
        // Rank 0 prints the report; the others' own spans go to stderr, so that a
        // rank whose GPU runs slower (the step waits for it) shows in the log.
        eprintln!(
            "bench rank {}: compute_only {:.3} ms, comm_only {:.3} ms, serial {:.3} ms, overlap {:.3} ms",
            world.env.rank,
            report.figures.compute_only_ms,
            report.figures.comm_only_ms,
            report.figures.serial_ms,
            report.figures.overlap_ms
        );
    }
    Ok((world.env.rank == 0).then_some(report))
}

/// `overlap bench-collectives` on this process's GPU; rank 0 returns the rows.
pub(crate) async fn collectives(
    mesh: Mesh,
    sizes_mib: &[u32],
    iters: u32,
    warmup: u32,
) -> Result<Option<Vec<CollectiveRow>>, Error> {
    let world = open_cuda(
        mesh,
        Bindings::default(),
        Default::default(),
        bench_fingerprint(
            "bench-collectives",
            format!("mesh {mesh}, MiB {sizes_mib:?}, iters {iters}, warmup {warmup}"),
        ),
    )?;
    let rows =
        crate::bench::collectives(world.backend.clone(), mesh, sizes_mib, iters, warmup).await?;
    Ok((world.env.rank == 0).then_some(rows))
}

/// Which copy-transport rings of the bench workloads read in place (needs the CUDA
/// backend's `copy_setup`; no GPU).
#[cfg(test)]
mod tests {
    use crate::bench::BenchArgs;
    use overlap::config::Config;
    use overlap::Mesh;
    use overlap_dist::cuda::{copy_setup, gathering_comms, in_place_comms};
    use overlap_ops::cuda as ops_cuda;
    use overlap_ops::CommId;

    /// Whether any communicator of the plan reads in place.
    fn in_place(spec: &overlap_graph::PlanSpec, slot_bytes: usize, depth: usize) -> bool {
        !in_place_comms(spec, slot_bytes, depth).is_empty()
    }

    #[test]
    fn combines_read_in_place_only_where_no_exchange_can_wait_for_a_later_combine() {
        use overlap_graph::{Bindings, Transport};
        let slot = 32 << 20;
        let bench = |f: &dyn Fn(&mut BenchArgs)| {
            let mut a = BenchArgs {
                transport: Transport::Copy,
                ..BenchArgs::new(Mesh::new(2, 1).unwrap())
            };
            f(&mut a);
            a.spec(Bindings::default())
        };
        let two = ops_cuda::DEFAULT_COPY_RING_DEPTH;
        // `docs/performance.md`'s workload: one 64 MiB bucket per layer, combines one layer behind: the next
        // exchange is the only one between an exchange and its combine.
        assert!(in_place(&bench(&|_| {}), slot, two));
        assert!(in_place(&bench(&|a| a.combine_lag = 0), slot, two));
        // Two layers behind: the exchange two later waits for a combine not yet issued,
        // unless the ring has a third slot per peer.
        assert!(!in_place(&bench(&|a| a.combine_lag = 2), slot, two));
        assert!(in_place(&bench(&|a| a.combine_lag = 2), slot, 3));
        assert!(!in_place(&bench(&|a| a.combine_lag = 3), slot, 3));
        // One slot: only a combine issued before the next exchange.
        assert!(in_place(&bench(&|a| a.combine_lag = 0), slot, 1));
        assert!(!in_place(&bench(&|_| {}), slot, 1));
        // A 64 MiB chunk per peer does not fit a 32 MiB slot.
        assert!(!in_place(&bench(&|a| a.grad_mib = 128), slot, two));
        // Several buckets per layer (the GPU validation config): not in place.
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/gpu/gpu_2x1.toml");
        let mut config = Config::from_file(&path).unwrap();
        config.plan.schedule.transport = Transport::Copy;
        assert!(!in_place(&config.plan, slot, two));
        // One parameter per layer: in place (the GPU validation of in-place receives).
        let path = path.with_file_name("gpu_2x1_in_place.toml");
        let mut config = Config::from_file(&path).unwrap();
        config.plan.schedule.transport = Transport::Copy;
        assert!(in_place(&config.plan, slot, two));
        // The all-reduce one, and the one that needs three slots.
        let config = |name: &str| {
            let mut c = Config::from_file(&path.with_file_name(name)).unwrap();
            c.plan.schedule.transport = Transport::Copy;
            c
        };
        let ar = config("gpu_1x2_in_place.toml");
        assert!(in_place(&ar.plan, slot, two) && !gathering_comms(&ar.plan).is_empty());
        let deep = config("gpu_2x1_depth3.toml");
        assert_eq!(deep.overlap.copy_ring_depth, 3);
        assert!(!in_place(&deep.plan, slot, two) && in_place(&deep.plan, slot, 3));
        // Which ones: the shard group's ring on the exchange stream, and an all-reduce's
        // (the replicate group's), whose gathers get a lane of their own.
        let comm = |group| CommId {
            group,
            stream: overlap_graph::Stream::Copy,
        };
        let shard = |replicate| comm(overlap_graph::Group::Shard { replicate });
        let replicate = |shard| comm(overlap_graph::Group::Replicate { shard });
        assert_eq!(in_place_comms(&bench(&|_| {}), slot, two), vec![shard(0)]);
        let ar = bench(&|a| a.mesh = Mesh::new(1, 2).unwrap());
        assert_eq!(in_place_comms(&ar, slot, two), vec![replicate(0)]);
        assert_eq!(gathering_comms(&ar), vec![replicate(0)]);
        assert!(gathering_comms(&bench(&|_| {})).is_empty());
        let hsdp = bench(&|a| a.mesh = Mesh::new(2, 2).unwrap());
        assert_eq!(
            in_place_comms(&hsdp, slot, two),
            vec![shard(0), shard(1), replicate(0), replicate(1)]
        );
        assert_eq!(gathering_comms(&hsdp), vec![replicate(0), replicate(1)]);
        // What a job connects: both lists, its exchange stream, sorted; none in place
        // when asked not to.
        let setup = copy_setup(&[&hsdp, &hsdp], slot, 3, true);
        assert_eq!(
            (setup.slot_bytes, setup.depth, &setup.streams),
            (slot, 3, &vec![overlap_graph::Stream::Copy])
        );
        assert_eq!(setup.in_place, in_place_comms(&hsdp, slot, 3));
        assert_eq!(setup.gather_lane, gathering_comms(&hsdp));
        assert!(copy_setup(&[&hsdp], slot, 3, false).in_place.is_empty());
        // Two plans on one communicator: in place only if both allow it.
        let (lag1, lag2) = (bench(&|_| {}), bench(&|a| a.combine_lag = 2));
        assert!(copy_setup(&[&lag1, &lag2], slot, two, true)
            .in_place
            .is_empty());
        assert_eq!(
            copy_setup(&[&lag1, &lag2], slot, 3, true).in_place,
            vec![shard(0)]
        );
        // A gather lane only where the all-reduce is read in place.
        assert_eq!(
            copy_setup(&[&ar], slot, two, true).gather_lane,
            vec![replicate(0)]
        );
        assert!(copy_setup(&[&ar], slot, two, false).gather_lane.is_empty());
        let several = config("gpu_1x2.toml");
        assert!(copy_setup(&[&several.plan], slot, two, true)
            .gather_lane
            .is_empty());
        // Depth 0 allows nothing (the config refuses it before).
        assert!(in_place_comms(&lag1, slot, 0).is_empty());
        // How deep a ring the validation configs, with several buckets per layer, need.
        let deep = |plan: &overlap_graph::PlanSpec| {
            (1..=16).find(|&d| !in_place_comms(plan, slot, d).is_empty())
        };
        assert_eq!(deep(&config("gpu_2x1.toml").plan), Some(12));
        // Two buckets per layer: each combine one layer behind has two or three
        // exchanges after it, so four slots are needed (docs/config.md).
        let mut two_per_layer = bench(&|a| a.grad_mib = 32);
        let extra: Vec<_> = two_per_layer
            .params
            .iter()
            .map(|p| {
                let mut q = p.clone();
                q.name = format!("{}.b", p.name);
                q
            })
            .collect();
        two_per_layer.params.extend(extra);
        assert_eq!(deep(&two_per_layer), Some(4));
    }
}
