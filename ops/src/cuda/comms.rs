//! The communicators a mesh needs, in the one global order every rank creates them in
//! ([`mesh_comms`]), and the NCCL unique ids rank 0 generates for them.
//!
//! Invariant: every rank derives the same list from the same mesh and bindings, so
//! `ncclCommInitRank` calls meet in the same order everywhere.

use overlap_graph::{Bindings, Group, Mesh};

use super::loader;
use super::nccl::{self, NcclUniqueId};
use crate::{CommId, OpsError};

/// Every communicator a mesh needs with these stream bindings, in the one global order
/// in which every rank creates its members: each shard group on the Stage-1 stream,
/// each replicate group on the Stage-2 stream and on the publish stream, and with the
/// copy transport (`copy`) every group on the exchange stream too.
///
/// ```
/// use overlap_ops::cuda::mesh_comms;
/// use overlap_ops::graph::{Bindings, Mesh};
///
/// let comms = mesh_comms(Mesh { shard: 2, replicate: 1 }, &Bindings::default(), false);
/// // shard(r=0)@reduce, replicate(s=0)@replicate, replicate(s=0)@publish, ...
/// assert_eq!(comms.len(), 1 + 2 * 2);
/// let copy = mesh_comms(Mesh { shard: 2, replicate: 1 }, &Bindings::default(), true);
/// assert_eq!(copy.len(), 2 + 2 * 3);
/// ```
pub fn mesh_comms(mesh: Mesh, bindings: &Bindings, copy: bool) -> Vec<CommId> {
    let mut comms: Vec<CommId> = (0..mesh.replicate)
        .flat_map(|replicate| {
            let group = Group::Shard { replicate };
            std::iter::once(CommId {
                group,
                stream: bindings.stage1,
            })
            .chain(copy.then_some(CommId {
                group,
                stream: bindings.exchange,
            }))
        })
        .chain((0..mesh.shard).flat_map(|shard| {
            let group = Group::Replicate { shard };
            [bindings.stage2, bindings.publish]
                .map(|stream| CommId { group, stream })
                .into_iter()
                .chain(copy.then_some(CommId {
                    group,
                    stream: bindings.exchange,
                }))
        }))
        .collect();
    comms.sort();
    comms.dedup();
    comms
}

/// [`mesh_comms`] plus, for a plan that gathers the full parameters for the forward
/// (`PlanSpec::forward`), each shard group on the `unshard` binding's stream (the
/// gathers' all-gathers and broadcasts), in the same global order. Without the forward
/// it is exactly [`mesh_comms`], so such a job creates the communicators it always did.
///
/// ```
/// use overlap_ops::cuda::{mesh_comms, mesh_comms_with_forward};
/// use overlap_ops::graph::{Bindings, Mesh};
///
/// let mesh = Mesh { shard: 2, replicate: 1 };
/// let b = Bindings::default();
/// assert_eq!(mesh_comms_with_forward(mesh, &b, false, false), mesh_comms(mesh, &b, false));
/// // plus shard(r=0)@publish
/// assert_eq!(mesh_comms_with_forward(mesh, &b, false, true).len(), 1 + 2 * 2 + 1);
/// ```
pub fn mesh_comms_with_forward(
    mesh: Mesh,
    bindings: &Bindings,
    copy: bool,
    forward: bool,
) -> Vec<CommId> {
    let mut comms = mesh_comms(mesh, bindings, copy);
    if forward {
        comms.extend((0..mesh.replicate).map(|replicate| CommId {
            group: Group::Shard { replicate },
            stream: bindings.unshard,
        }));
        comms.sort();
        comms.dedup();
    }
    comms
}

/// `n` fresh NCCL unique ids (rank 0 generates them for every communicator of the
/// mesh). Fails with a clear error when the CUDA driver or NCCL cannot be loaded.
pub fn unique_ids(n: usize) -> Result<Vec<NcclUniqueId>, OpsError> {
    loader::DRIVER.check()?;
    loader::NCCL.check()?;
    nccl::generate(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use overlap_graph::Stream;

    #[test]
    fn every_rank_creates_the_same_communicators_in_one_order() {
        let mesh = Mesh {
            shard: 2,
            replicate: 3,
        };
        let comms = mesh_comms(mesh, &Bindings::default(), false);
        // 3 shard groups on the reduce stream; 2 replicate groups on replicate + publish.
        assert_eq!(comms.len(), 3 + 2 * 2);
        // The copy transport adds every group on the exchange stream.
        let copy = mesh_comms(mesh, &Bindings::default(), true);
        assert_eq!(copy.len(), 3 + 2 * 2 + 3 + 2);
        assert!(copy.contains(&CommId {
            group: Group::Shard { replicate: 2 },
            stream: Stream::Copy
        }));
        let mut sorted = comms.clone();
        sorted.sort();
        assert_eq!(comms, sorted);
        // Stage 2 and publish on one stream share one communicator.
        let shared = Bindings::default().with_publish(Stream::Replicate);
        assert_eq!(mesh_comms(mesh, &shared, false).len(), 3 + 2);
    }
}
