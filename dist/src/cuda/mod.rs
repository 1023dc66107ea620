//! Running on GPUs (the `cuda` feature): one process per GPU, as trainers run.
//!
//! Each process is one rank of the mesh: it reads its place in the job from the
//! environment ([`RankEnv`], set by `overlap launch`, torchrun, Slurm or Open MPI), opens
//! its GPU ([`CudaBackend`]), meets the other ranks at rank 0's TCP [`Rendezvous`], and
//! creates its NCCL communicators from the unique ids rank 0 generated. Then a
//! [`Session`] over the backend runs the same plans as on the CPU, for this rank only.
//!
//! Start-up is two-phase so that no rank is left waiting when another cannot start:
//! every rank first reports whether it opened its GPU; only when all did does rank 0
//! broadcast the NCCL ids (otherwise it broadcasts which rank failed and why, and every
//! rank exits with that error).
//!
//! Invariant: a [`CudaWorld`] exists only when the world size equals the mesh's
//! `shard × replicate` and every rank holds its communicators.

mod verify;

use std::sync::Arc;
use std::time::Duration;

use overlap_graph::Mesh;
use overlap_ops::cuda::{self as ops_cuda, CudaBackend, CudaOptions, NcclUniqueId};
use overlap_ops::CommId;

use overlap::config::Config;
use overlap::Error;

use crate::env::RankEnv;
use crate::fingerprint::Fingerprint;
use crate::rendezvous::Rendezvous;
use crate::DistError;

pub use verify::{muon_update_tolerance, verify};

/// The variable that puts every rank of a job on one GPU (`1` or `true`): a test mode
/// for the multi-process path where only one GPU is at hand. The ranks use the first
/// visible device and talk over the copy transport only (NCCL refuses two ranks on one
/// device, so a job whose plan needs NCCL collectives is refused); the GPU's engines
/// are shared, so timings from this mode say nothing of a job on several GPUs.
pub const SHARE_GPU_VAR: &str = "OVERLAP_SHARE_GPU";

/// Whether [`SHARE_GPU_VAR`] asks for every rank on one GPU; an unreadable value is an
/// error naming the variable.
pub fn shared_gpu() -> Result<bool, Error> {
    match std::env::var(SHARE_GPU_VAR) {
        Err(std::env::VarError::NotPresent) => Ok(false),
        Ok(v) => parse_share(&v),
        Err(e) => Err(DistError::Inconsistent(format!("{SHARE_GPU_VAR}: {e}")).into()),
    }
}

/// [`SHARE_GPU_VAR`]'s value: `1`/`true` or `0`/`false`/empty.
fn parse_share(v: &str) -> Result<bool, Error> {
    match v {
        "" | "0" => Ok(false),
        "1" => Ok(true),
        v if v.eq_ignore_ascii_case("false") => Ok(false),
        v if v.eq_ignore_ascii_case("true") => Ok(true),
        v => Err(DistError::Inconsistent(format!(
            "{SHARE_GPU_VAR}={v:?}: expected 1 or 0 (true or false)"
        ))
        .into()),
    }
}

/// How long ranks wait for each other at start (and rank 0 for the others' status),
/// unless `OVERLAP_RENDEZVOUS_TIMEOUT_S` says otherwise.
pub const START_TIMEOUT: Duration = Duration::from_secs(180);
/// How long rank 0 waits for another rank's figures at the end of a run.
pub const GATHER_TIMEOUT: Duration = Duration::from_secs(3600);

/// This process's rank, its GPU backend and its line to the other ranks.
pub struct CudaWorld {
    /// Who this process is.
    pub env: RankEnv,
    /// The connections to the other ranks (kept open for gathering results).
    pub rendezvous: Rendezvous,
    /// The backend driving this rank's GPU.
    pub backend: Arc<CudaBackend>,
}

/// This process's rank environment for a job on `mesh`: from the launcher's variables,
/// or a single process when none is set and the mesh has one rank.
pub fn rank_env(mesh: Mesh) -> Result<RankEnv, Error> {
    let env = match RankEnv::from_env()? {
        Some(env) => env,
        None if mesh.world() == 1 => RankEnv::single(),
        None => {
            return Err(DistError::Inconsistent(format!(
                "backend \"cuda\" runs one process per GPU and mesh {mesh} has {} ranks: start them with \
                 `overlap launch --nproc-per-node {} -- <this command>` (or torchrun, srun, mpirun)",
                mesh.world(),
                mesh.world()
            ))
            .into())
        }
    };
    if env.world_size != mesh.world() {
        return Err(DistError::Inconsistent(format!(
            "the job has {} ranks (WORLD_SIZE) but mesh {mesh} needs shard × replicate = {}",
            env.world_size,
            mesh.world()
        ))
        .into());
    }
    Ok(env)
}

/// Opens this rank's GPU and connects the job for a config: one communicator per
/// (group, stream) its bindings use. `what` is this rank's fingerprint
/// ([`Fingerprint::of_config`]); the ranks compare theirs before anything else.
pub fn world(
    config: &Config,
    env: RankEnv,
    timings: bool,
    what: Fingerprint,
) -> Result<CudaWorld, Error> {
    let mesh = config.plan.mesh;
    let copy = config.plan.schedule.transport == overlap_graph::Transport::Copy;
    let links = Links {
        copy: copy.then(|| {
            copy_setup(
                &[&config.plan],
                (config.overlap.copy_slot_mib as usize) << 20,
                config.overlap.copy_ring_depth as usize,
                true,
            )
        }),
        nccl_max_ctas: config.overlap.nccl_max_ctas,
        combine_ctas: None,
        combine_cached: false,
        uniform_priority: false,
    };
    open(
        env,
        mesh,
        ops_cuda::mesh_comms_with_forward(
            mesh,
            &config.plan.bindings,
            copy,
            config.plan.forward.is_some(),
        ),
        timings,
        links,
        what,
    )
}

/// How the ranks are linked besides the NCCL communicators' defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Links {
    /// Copy transport: receive rings for the communicators of two or more members on
    /// the exchange streams ([`copy_setup`]).
    pub copy: Option<ops_cuda::CopySetup>,
    /// At most this many CTAs per NCCL collective (`[overlap] nccl_max_ctas`).
    pub nccl_max_ctas: Option<u32>,
    /// At most this many CTAs per combine kernel (`overlap bench --combine-ctas`; a
    /// lever measured and not kept, docs/performance.md).
    pub combine_ctas: Option<u32>,
    /// Combines without cache-streaming hints (`overlap bench --combine-cache normal`,
    /// for comparison; [`ops_cuda::CudaBackend::set_combine_streaming`]).
    pub combine_cached: bool,
    /// Every stream at one priority (measurement only: by default the reduce stream
    /// is the device's highest).
    pub uniform_priority: bool,
}

/// The copy transport's rings for the plans a job runs (`[overlap] copy_slot_mib` and
/// `copy_ring_depth`): a ring on each plan's exchange stream for every communicator of
/// two or more members; with `in_place`, in-place receives on a communicator when every
/// plan that exchanges on it allows them ([`in_place_comms`]); and a gather lane where
/// such a communicator also gathers ([`gathering_comms`]: without in-place receives
/// its gathers share the one lane, and the ring stays half the size). The same on every
/// rank (it depends on the plans only).
pub fn copy_setup(
    specs: &[&overlap_graph::PlanSpec],
    slot_bytes: usize,
    depth: usize,
    in_place: bool,
) -> ops_cuda::CopySetup {
    use std::collections::BTreeMap;
    let mut verdicts: BTreeMap<CommId, bool> = BTreeMap::new();
    let mut gathering = Vec::new();
    let mut streams = Vec::new();
    for spec in specs {
        streams.push(spec.bindings.exchange);
        // Planned once for both questions (planning a large model takes a while).
        let Some(plan) = reducing_plan(spec) else {
            continue;
        };
        gathering.extend(gathering_of(&plan));
        for (id, ok) in in_place_verdicts(&plan, slot_bytes, depth) {
            *verdicts.entry(id).or_insert(true) &= ok;
        }
    }
    let in_place: Vec<CommId> = verdicts
        .into_iter()
        .filter(|&(_, ok)| ok && in_place)
        .map(|(id, _)| id)
        .collect();
    streams.sort();
    streams.dedup();
    gathering.sort();
    gathering.dedup();
    gathering.retain(|id| in_place.contains(id));
    ops_cuda::CopySetup {
        slot_bytes,
        depth,
        streams,
        in_place,
        gather_lane: gathering,
    }
}

/// A plan of `spec` with a micro-batch of each kind that exchanges: gate `off`, then
/// gate `on` (a `no_sync` one exchanges nothing, and a micro-batch's chains do not
/// depend on the ones before it beyond which of these two it is). So what holds for
/// every micro-batch of this plan holds for any gate pattern. The two differ: an `on`
/// micro-batch's all-reduce chains go out early at its end (the graph's tail rule,
/// `Schedule::early_tail_gathers`) and an `off` one's do not, so neither alone is the
/// worst case. Just gate `on` where gate `off` does not plan; `None` when nothing does
/// (then the job fails elsewhere, with the planner's error).
fn reducing_plan(spec: &overlap_graph::PlanSpec) -> Option<overlap_graph::Plan> {
    use overlap_graph::Gate;
    let planner = overlap_graph::Planner::new(spec.clone()).ok()?;
    planner
        .plan(&[Gate::ReplicateOff, Gate::On])
        .or_else(|_| planner.plan(&[Gate::On]))
        .ok()
}

/// The communicators the plan gathers on (all-reduces over the copy transport): their
/// rings get a gather lane ([`ops_cuda::CopySetup::gather_lane`]).
pub fn gathering_comms(spec: &overlap_graph::PlanSpec) -> Vec<CommId> {
    reducing_plan(spec).map_or_else(Vec::new, |plan| gathering_of(&plan))
}

/// [`gathering_comms`] of a planned spec.
fn gathering_of(plan: &overlap_graph::Plan) -> Vec<CommId> {
    let mut ids: Vec<CommId> = plan
        .ranks
        .iter()
        .flat_map(|rp| &rp.nodes)
        .filter_map(|n| match n.op {
            overlap_graph::Op::Gather { collective, .. } => Some(CommId::of(&collective, n.stream)),
            _ => None,
        })
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// The communicators whose combines may read what their exchanges received in place in
/// the copy ring ([`ops_cuda::CudaBackend::connect_copy`]), decided from the plan alike on
/// every rank, for rings of `depth` slots of `slot_bytes` per peer. A communicator
/// qualifies when every exchange's wait for a free ring slot names a piece whose
/// combine was issued before it, on every rank: each exchange's message per peer fits
/// one slot, and between an exchange and its combine at most `depth − 1` other
/// exchanges of that communicator are issued (with the default depth 2: one bucket per
/// layer with `combine_lag = 1` qualifies; several buckets per layer usually do not).
/// Gathers do not count: they have a lane of their own ([`gathering_comms`]).
/// Everywhere else exchanges copy out of the ring.
///
/// Why that suffices: the only wait in-place receives add is an exchange's wait for a
/// slot, i.e. for the peer's combine of the exchange `depth` pieces earlier, which the
/// peer issued before its own copy of this exchange. Every other device-side wait
/// (stream order, the plan's events, the pool's fences on recycled memory) points at
/// work its rank issued earlier, and a wait across ranks points at the same or an
/// earlier exchange or gather of the communicator, in the order every member issues
/// them; so no chain of waits closes a cycle. With a combine further behind, an
/// exchange waits for a combine its rank has not issued, which may sit behind a
/// pooled-buffer fence or a host wait on that very exchange (the likely cause of call
/// P's hang in `docs/performance.md`, not traced on the GPU).
pub fn in_place_comms(
    spec: &overlap_graph::PlanSpec,
    slot_bytes: usize,
    depth: usize,
) -> Vec<CommId> {
    reducing_plan(spec)
        .map(|plan| in_place_verdicts(&plan, slot_bytes, depth))
        .unwrap_or_default()
        .into_iter()
        .filter(|&(_, ok)| ok)
        .map(|(id, _)| id)
        .collect()
}

/// Every communicator a planned spec exchanges on, with whether [`in_place_comms`]
/// allows it (the rule is `overlap_graph::ring`'s).
fn in_place_verdicts(
    plan: &overlap_graph::Plan,
    slot_bytes: usize,
    depth: usize,
) -> std::collections::BTreeMap<CommId, bool> {
    overlap_graph::ring::in_place_verdicts(plan, slot_bytes as u64, depth)
        .into_iter()
        .map(|((group, stream), ok)| (CommId { group, stream }, ok))
        .collect()
}

/// Opens this rank's GPU and connects the job: `comms` is the global list of
/// communicators (the same on every rank), linked as `links` says. Right after the
/// rendezvous, before any GPU work, the ranks compare `what` (with the communicators
/// and links added): a difference stops every rank with the same message.
pub fn open(
    env: RankEnv,
    mesh: Mesh,
    comms: Vec<CommId>,
    timings: bool,
    links: Links,
    mut what: Fingerprint,
) -> Result<CudaWorld, Error> {
    let shared = shared_gpu()?;
    if shared && links.copy.is_none() && mesh.world() > 1 {
        return Err(DistError::Inconsistent(format!(
            "{SHARE_GPU_VAR}=1 puts the job's {} ranks on one GPU, and NCCL refuses two ranks on one device: \
             this job's collectives go through NCCL ([overlap] transport = \"nccl\"); \
             set transport = \"copy\" (or \"auto\") to run it on one GPU",
            mesh.world()
        ))
        .into());
    }
    what.push("cuda.comms", format!("{comms:?}"));
    what.push("cuda.links", format!("{links:?}"));
    what.push("cuda.shared_gpu", shared.to_string());
    let (mut rendezvous, timeout) = Rendezvous::meet(&env, mesh, &what, START_TIMEOUT)?;
    // Sharing one GPU: every rank on the first visible device.
    let ordinal = if shared { 0 } else { env.local_rank };
    let opened = CudaBackend::new(
        CudaOptions::new(mesh, env.rank, ordinal)
            .with_timings(timings)
            .with_uniform_priority(links.uniform_priority),
    );
    // Phase 1: everyone says whether its GPU opened.
    let status = match &opened {
        Ok(_) => vec![0u8],
        Err(e) => [vec![1u8], e.to_string().into_bytes()].concat(),
    };
    let statuses = rendezvous.gather(&status, timeout)?;
    // Phase 2: rank 0 hands out the NCCL ids (none when the ranks share a GPU), or the
    // first failure.
    let n_ids = if shared { 0 } else { comms.len() };
    let payload = match statuses {
        Some(all) => decide(&all, n_ids),
        None => Vec::new(),
    };
    let payload = rendezvous.broadcast(&payload, timeout)?;
    let ids = decode(&payload, n_ids)?;
    let mut backend = opened.map_err(|e| Error::Backend(e.to_string()))?;
    if shared {
        connect_shared(
            &mut backend,
            &comms,
            links.copy.clone(),
            &mut rendezvous,
            timeout,
        )?;
    } else {
        let list: Vec<(CommId, NcclUniqueId)> = comms.into_iter().zip(ids).collect();
        backend
            .connect(&list, links.nccl_max_ctas)
            .map_err(|e| Error::Backend(e.to_string()))?;
        if let Some(copy) = &links.copy {
            backend
                .connect_copy(copy)
                .map_err(|e| Error::Backend(e.to_string()))?;
        }
    }
    backend.set_combine_ctas(links.combine_ctas);
    backend.set_combine_streaming(!links.combine_cached);
    Ok(CudaWorld {
        env,
        rendezvous,
        backend: Arc::new(backend),
    })
}

/// Connects ranks that share one GPU ([`SHARE_GPU_VAR`]): copy-only communicators, a
/// ring for each of two or more members set up through the rendezvous, with `copy`'s
/// ring sizes (the defaults without one) and a gather lane on every ring read in place
/// (broadcasts and all-gathers acknowledge at once, like gathers).
fn connect_shared(
    backend: &mut CudaBackend,
    comms: &[CommId],
    copy: Option<ops_cuda::CopySetup>,
    rendezvous: &mut Rendezvous,
    timeout: Duration,
) -> Result<(), Error> {
    let mut setup = copy.unwrap_or_else(|| ops_cuda::CopySetup {
        slot_bytes: ops_cuda::DEFAULT_COPY_SLOT_BYTES,
        depth: ops_cuda::DEFAULT_COPY_RING_DEPTH,
        streams: Vec::new(),
        in_place: Vec::new(),
        gather_lane: Vec::new(),
    });
    setup.gather_lane.extend(setup.in_place.iter().copied());
    setup.gather_lane.sort();
    setup.gather_lane.dedup();
    backend
        .connect_copy_only(comms, &setup, |mine| {
            rendezvous
                .all_gather(mine, timeout)
                .map_err(|e| e.to_string())
        })
        .map_err(|e| Error::Backend(e.to_string()))
}

/// Rank 0's decision from every rank's status: `0` and the ids, or `1`, the failed
/// rank and its error.
fn decide(statuses: &[Vec<u8>], n: usize) -> Vec<u8> {
    let failed = statuses
        .iter()
        .enumerate()
        .find(|(_, s)| s.first() != Some(&0));
    let failure = |rank: usize, msg: &[u8]| {
        [
            vec![1u8],
            (rank as u32).to_le_bytes().to_vec(),
            msg.to_vec(),
        ]
        .concat()
    };
    if let Some((rank, s)) = failed {
        return failure(rank, s.get(1..).unwrap_or_default());
    }
    if n == 0 {
        return vec![0u8];
    }
    match ops_cuda::unique_ids(n) {
        Ok(ids) => {
            let mut out = vec![0u8];
            ids.iter().for_each(|id| out.extend_from_slice(&id.0));
            out
        }
        Err(e) => failure(0, e.to_string().as_bytes()),
    }
}

fn decode(payload: &[u8], n: usize) -> Result<Vec<NcclUniqueId>, Error> {
    match payload.split_first() {
        Some((0, ids)) if ids.len() == n * 128 => Ok(ids
            .chunks_exact(128)
            .map(|c| {
                let mut id = [0u8; 128];
                id.copy_from_slice(c);
                NcclUniqueId(id)
            })
            .collect()),
        Some((1, rest)) if rest.len() >= 4 => {
            let rank = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            Err(DistError::Peer {
                rank,
                reason: String::from_utf8_lossy(&rest[4..]).into_owned(),
            }
            .into())
        }
        _ => Err(DistError::Rendezvous(format!(
            "rank 0 sent {} bytes of start-up data, expected {} NCCL ids",
            payload.len(),
            n
        ))
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `copy_setup` approves for in-place receives keeps the distance rule in the
    /// plan of every gate pattern, for every schedule: the verdict is taken on a plan
    /// with both kinds of exchanging micro-batch, since the graph's tail rule moves an
    /// `on` micro-batch's all-reduce chains and not an `off` one's. (Taken on the
    /// gate-`on` plan alone, 2x2 with lag 1, depth 2 and two buckets in the first layer
    /// approves a ring that gates `off, on` then break.)
    #[test]
    fn an_in_place_verdict_holds_for_every_gate_pattern() {
        use overlap_graph::{Gate, ParamSpec, Route, Schedule, Transport};
        let p = |name: &str, n: u64, route, layer| ParamSpec::new(name, vec![n], route, layer);
        let params = vec![
            p("a", 64, Route::Fsdp, 3),
            p("b", 64, Route::ShardedAdamw, 2),
            p("c", 64, Route::Fsdp, 1),
            p("d", 64, Route::Fsdp, 0),
            p("e", 64, Route::ShardedAdamw, 0),
        ];
        let patterns: [&[Gate]; 5] = [
            &[Gate::On],
            &[Gate::ReplicateOff, Gate::On],
            &[Gate::NoSync, Gate::ReplicateOff, Gate::On],
            &[Gate::On, Gate::ReplicateOff, Gate::On],
            &[Gate::ReplicateOff, Gate::ReplicateOff, Gate::On],
        ];
        let slot = 1 << 20;
        let mut approved = 0;
        for (shard, replicate) in [(2, 1), (1, 2), (2, 2), (2, 3)] {
            for lag in 0..4 {
                for depth in 1..5 {
                    for (early, after) in [(true, false), (false, false), (true, true)] {
                        let spec = overlap_graph::PlanSpec::new(
                            Mesh::new(shard, replicate).unwrap(),
                            params.clone(),
                        )
                        .with_bucket_cap_bytes(256)
                        .with_schedule(
                            Schedule::default()
                                .with_transport(Transport::Copy)
                                .with_combine_lag(lag)
                                .with_early_tail_gathers(early)
                                .with_combine_after_exchanges(after),
                        );
                        let ok = copy_setup(&[&spec], slot, depth, true).in_place;
                        approved += ok.len();
                        let planner = overlap_graph::Planner::new(spec).unwrap();
                        for gates in patterns {
                            let plan = planner.plan(gates).unwrap();
                            let verdicts = in_place_verdicts(&plan, slot, depth);
                            for id in &ok {
                                assert!(
                                    verdicts.get(id).copied().unwrap_or(true),
                                    "{shard}x{replicate} lag {lag} depth {depth} early {early} after {after}: {id} approved, broken by gates {gates:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
        assert!(approved > 0, "the sweep approves some rings");
    }

    #[test]
    fn every_collective_of_a_clipping_plan_has_its_communicator() {
        use overlap_graph::{
            Bindings, Gate, Op, ParamSpec, PlanSpec, Route, Schedule, Stream, Transport,
        };
        let params = vec![
            ParamSpec::new("w", vec![4, 6], Route::Muon, 2),
            ParamSpec::new("odd", vec![9], Route::Fsdp, 1),
            ParamSpec::new("bias", vec![7], Route::Adamw, 1),
            ParamSpec::new("emb", vec![10, 3], Route::ShardedAdamw, 0),
        ];
        let bindings = [
            Bindings::default(),
            Bindings::default().with_stage2(Stream::Reduce),
        ];
        for (shard, replicate) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)] {
            for (transport, forward) in [
                (Transport::Nccl, false),
                (Transport::Copy, false),
                (Transport::Nccl, true),
                (Transport::Copy, true),
            ] {
                for b in &bindings {
                    let mesh = Mesh::new(shard, replicate).unwrap();
                    let spec = PlanSpec::new(mesh, params.clone())
                        .with_bucket_cap_bytes(64)
                        .with_bindings(*b)
                        .with_schedule(Schedule::default().with_transport(transport))
                        .with_grad_norm(true)
                        .with_forward(forward.then(overlap_graph::ForwardSpec::default));
                    let copy = transport == Transport::Copy;
                    let comms = ops_cuda::mesh_comms_with_forward(mesh, b, copy, forward);
                    let plan = overlap_graph::Planner::new(spec)
                        .unwrap()
                        .plan(&[Gate::ReplicateOff, Gate::On])
                        .unwrap();
                    let mut norm_reduces = 0;
                    for rp in &plan.ranks {
                        for n in &rp.nodes {
                            let Some(c) = n.op.collective() else { continue };
                            norm_reduces += usize::from(matches!(n.op, Op::NormReduce { .. }));
                            let id = CommId::of(c, n.stream);
                            assert!(
                                comms.contains(&id),
                                "{mesh} {transport:?} {b:?}: {} on rank {} has no communicator {id}",
                                n.op.kind(),
                                rp.rank
                            );
                        }
                    }
                    assert_eq!(norm_reduces, 2 * mesh.world() as usize, "{mesh}");
                }
            }
        }
    }

    #[test]
    fn the_configs_ring_bounds_are_the_backends() {
        let c = overlap::config::OverlapConfig::default();
        assert_eq!(
            c.copy_ring_depth as usize,
            ops_cuda::DEFAULT_COPY_RING_DEPTH
        );
        assert_eq!(
            (c.copy_slot_mib as usize) << 20,
            ops_cuda::DEFAULT_COPY_SLOT_BYTES
        );
        assert_eq!(
            overlap::config::MAX_COPY_RING_DEPTH as usize,
            ops_cuda::MAX_COPY_RING_DEPTH
        );
    }

    #[test]
    fn start_up_decisions_round_trip() {
        let failed = decide(&[vec![0], vec![1, b'n', b'o']], 3);
        match decode(&failed, 3) {
            Err(Error::Dist(DistError::Peer { rank, reason })) => {
                assert_eq!((rank, reason.as_str()), (1, "no"));
            }
            other => panic!("{:?}", other.map(|v| v.len())),
        }
        let mut ok = vec![0u8];
        ok.extend([7u8; 256]);
        let ids = decode(&ok, 2).unwrap();
        assert_eq!(ids.len(), 2);
        assert_eq!(ids[1].0, [7u8; 128]);
        assert!(decode(&ok, 3).is_err());
        // Ranks sharing a GPU: no NCCL ids, and no NCCL library asked for them.
        let none = decide(&[vec![0], vec![0]], 0);
        assert_eq!(none, vec![0]);
        assert!(decode(&none, 0).unwrap().is_empty());
    }

    #[test]
    fn the_share_variable_is_a_switch_and_anything_else_is_named() {
        for (v, want) in [
            ("1", true),
            ("true", true),
            ("TRUE", true),
            ("0", false),
            ("", false),
            ("False", false),
        ] {
            assert_eq!(parse_share(v).unwrap(), want, "{v:?}");
        }
        for v in ["yes", "2", " 1"] {
            let e = parse_share(v).unwrap_err().to_string();
            assert!(e.contains("OVERLAP_SHARE_GPU"), "{e}");
        }
    }
}
