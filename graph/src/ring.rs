//! The copy transport's in-place rule, on a plan: where a combine may read what its
//! exchange received straight out of the copy ring instead of a copy of it.
//!
//! A communicator (group and stream) may be read in place when, on every rank, every
//! exchange's message per peer fits one ring slot and at most `depth − 1` other
//! exchanges of the communicator are issued between an exchange and its combine (the
//! next exchanges would otherwise overwrite the slot before the combine read it). The
//! CUDA backend sets its rings up by this rule and the simulator charges by it, so the
//! rule lives here, once.

use std::collections::{BTreeMap, HashMap};

use crate::mesh::Group;
use crate::node::{Op, Stream};
use crate::plan::Plan;

/// Every communicator the plan exchanges on, with whether the rule allows reading it in
/// place with rings of `depth` slots of `slot_bytes` per peer (never with `depth` 0).
pub fn in_place_verdicts(
    plan: &Plan,
    slot_bytes: u64,
    depth: usize,
) -> BTreeMap<(Group, Stream), bool> {
    let most = depth.saturating_sub(1);
    let mut ok: BTreeMap<(Group, Stream), bool> = BTreeMap::new();
    for rp in &plan.ranks {
        // Per communicator: exchanges issued so far; per open exchange: where.
        let mut issued: HashMap<(Group, Stream), usize> = HashMap::new();
        let mut open = HashMap::new();
        for n in &rp.nodes {
            match n.op {
                Op::Exchange {
                    bucket,
                    micro_batch,
                    stage,
                    collective,
                } => {
                    let id = (collective.group, n.stream);
                    let size = plan.mesh.group_size(collective.group);
                    let fits = (0..size).all(|j| {
                        collective.member_chunk(size, j).1.saturating_mul(4) <= slot_bytes
                    });
                    *ok.entry(id).or_insert(true) &= fits && depth > 0;
                    let k = issued.entry(id).or_insert(0);
                    open.insert((bucket, micro_batch, stage), (id, *k));
                    *k += 1;
                }
                Op::Combine {
                    bucket,
                    micro_batch,
                    stage,
                    ..
                } => {
                    if let Some((id, at)) = open.remove(&(bucket, micro_batch, stage)) {
                        let between = issued.get(&id).copied().unwrap_or(0) - at - 1;
                        *ok.entry(id).or_insert(true) &= between <= most;
                    }
                }
                _ => {}
            }
        }
    }
    ok
}
