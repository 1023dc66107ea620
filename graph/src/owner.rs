//! Owner assignment for the owned routes (`muon`, `adamw`).
//!
//! Longest-processing-time balance over the `S·R` slots: parameters in decreasing
//! cost (elements; ties by index) each go to the shard column with the least load, then
//! to the least-loaded replicate slot of that column. Ties go to the lowest index, so
//! every rank computes the same owners from the same parameter list.

use crate::mesh::{Coord, Mesh};
use crate::param::ParamSpec;

/// The owner of every parameter: `Some` for owned routes, `None` for sharded ones.
pub fn assign_owners(mesh: Mesh, params: &[ParamSpec]) -> Vec<Option<Coord>> {
    let mut order: Vec<usize> = (0..params.len())
        .filter(|&i| params[i].route.is_owned())
        .collect();
    order.sort_by(|&a, &b| params[b].numel().cmp(&params[a].numel()).then(a.cmp(&b)));
    let (s, r) = (mesh.shard as usize, mesh.replicate as usize);
    let mut column = vec![0u64; s];
    let mut slot = vec![0u64; s * r];
    let mut owners = vec![None; params.len()];
    for i in order {
        let cost = params[i].numel();
        let sc = argmin(&column);
        let rc = argmin(&slot[sc * r..(sc + 1) * r]);
        column[sc] += cost;
        slot[sc * r + rc] += cost;
        owners[i] = Some(Coord {
            shard: sc as u32,
            replicate: rc as u32,
        });
    }
    owners
}

fn argmin(loads: &[u64]) -> usize {
    let mut best = 0;
    for (i, &l) in loads.iter().enumerate() {
        if l < loads[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::param::Route;

    fn p(n: u64, route: Route) -> ParamSpec {
        ParamSpec {
            name: format!("p{n}"),
            shape: vec![n, 1],
            route,
            layer: 0,
        }
    }

    #[test]
    fn owners_balance_columns_then_slots() {
        let mesh = Mesh::new(2, 2).unwrap();
        let ps = vec![
            p(8, Route::Muon),
            p(6, Route::Muon),
            p(5, Route::Adamw),
            p(4, Route::Muon),
            p(3, Route::Fsdp),
        ];
        let o = assign_owners(mesh, &ps);
        assert_eq!(
            o[0],
            Some(Coord {
                shard: 0,
                replicate: 0
            })
        );
        assert_eq!(
            o[1],
            Some(Coord {
                shard: 1,
                replicate: 0
            })
        );
        assert_eq!(
            o[2],
            Some(Coord {
                shard: 1,
                replicate: 1
            })
        );
        assert_eq!(
            o[3],
            Some(Coord {
                shard: 0,
                replicate: 1
            })
        );
        assert_eq!(o[4], None);
    }

    #[test]
    fn owners_are_deterministic() {
        let mesh = Mesh::new(3, 2).unwrap();
        let ps: Vec<_> = (1..40).map(|n| p(n % 7 + 1, Route::Muon)).collect();
        assert_eq!(assign_owners(mesh, &ps), assign_owners(mesh, &ps));
    }
}
