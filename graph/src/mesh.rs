//! The HSDP mesh: `S` ranks per shard group times `R` replicate groups.
//!
//! Global rank `g = r·S + s` for shard index `s` and replicate index `r`. The shard
//! group of `(s, r)` is every `(*, r)`; its replicate group is every `(s, *)`. This
//! module owns that arithmetic and nothing else, so every other module agrees on it.

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// The most ranks a mesh may have. Every rank plans the whole world (one program per
/// rank, and a collective's member list per node), so planning grows faster than the
/// world: `overlap plan` of a two-layer model takes 3.6 s on 4096x1 and 27 s on 16384x1
/// (debug build); past this a plan takes minutes before anything runs.
pub const MAX_WORLD: u32 = 16_384;

/// The shape of the world: `shard` ranks per shard group, `replicate` groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mesh {
    /// Ranks per shard group (`S`), usually one node with fast links.
    pub shard: u32,
    /// Number of replicate groups (`R`), usually across nodes.
    pub replicate: u32,
}

/// A rank's coordinates in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Coord {
    /// Index within the shard group (`s`).
    pub shard: u32,
    /// Index of the replicate group (`r`).
    pub replicate: u32,
}

/// A process group of the mesh. Every collective runs on exactly one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Group {
    /// The shard group of replicate index `replicate`: ranks `(*, replicate)`.
    Shard {
        /// The replicate index shared by the members.
        replicate: u32,
    },
    /// The replicate group of shard index `shard`: ranks `(shard, *)`.
    Replicate {
        /// The shard index shared by the members.
        shard: u32,
    },
}

impl Mesh {
    /// A mesh of `shard × replicate` ranks; both must be at least 1.
    pub fn new(shard: u32, replicate: u32) -> Result<Self, PlanError> {
        let mesh = Mesh { shard, replicate };
        mesh.check()?;
        Ok(mesh)
    }

    /// Rejects a mesh with a zero dimension or more than [`MAX_WORLD`] ranks.
    pub fn check(&self) -> Result<(), PlanError> {
        if self.shard == 0 || self.replicate == 0 {
            return Err(PlanError::Mesh(format!(
                "mesh {}x{} has a zero dimension; shard and replicate must be at least 1",
                self.shard, self.replicate
            )));
        }
        let world = u64::from(self.shard) * u64::from(self.replicate);
        if world > u64::from(MAX_WORLD) {
            return Err(PlanError::Mesh(format!(
                "mesh {}x{} has {world} ranks, more than the planner's limit of {MAX_WORLD}",
                self.shard, self.replicate
            )));
        }
        Ok(())
    }

    /// Number of ranks, `S·R` (saturating for a mesh [`Mesh::check`] rejects).
    pub fn world(&self) -> u32 {
        self.shard.saturating_mul(self.replicate)
    }

    /// Global rank of a coordinate: `r·S + s`.
    pub fn rank(&self, c: Coord) -> u32 {
        c.replicate * self.shard + c.shard
    }

    /// Coordinates of a global rank.
    pub fn coord(&self, rank: u32) -> Coord {
        Coord {
            shard: rank % self.shard,
            replicate: rank / self.shard,
        }
    }

    /// All global ranks in order.
    pub fn ranks(&self) -> impl Iterator<Item = u32> {
        0..self.world()
    }

    /// The shard group a rank belongs to.
    pub fn shard_group(&self, rank: u32) -> Group {
        Group::Shard {
            replicate: self.coord(rank).replicate,
        }
    }

    /// The replicate group a rank belongs to.
    pub fn replicate_group(&self, rank: u32) -> Group {
        Group::Replicate {
            shard: self.coord(rank).shard,
        }
    }

    /// Member global ranks of a group, ordered by their index within the group.
    pub fn members(&self, group: Group) -> Vec<u32> {
        match group {
            Group::Shard { replicate } => (0..self.shard)
                .map(|s| {
                    self.rank(Coord {
                        shard: s,
                        replicate,
                    })
                })
                .collect(),
            Group::Replicate { shard } => (0..self.replicate)
                .map(|r| {
                    self.rank(Coord {
                        shard,
                        replicate: r,
                    })
                })
                .collect(),
        }
    }

    /// Number of members of a group.
    pub fn group_size(&self, group: Group) -> u32 {
        match group {
            Group::Shard { .. } => self.shard,
            Group::Replicate { .. } => self.replicate,
        }
    }

    /// A rank's index within a group it belongs to, or `None` when it is not a member.
    pub fn index_in(&self, group: Group, rank: u32) -> Option<u32> {
        let c = self.coord(rank);
        match group {
            Group::Shard { replicate } if c.replicate == replicate => Some(c.shard),
            Group::Replicate { shard } if c.shard == shard => Some(c.replicate),
            _ => None,
        }
    }

    /// Whether a group names an existing set of ranks of this mesh.
    pub fn has_group(&self, group: Group) -> bool {
        match group {
            Group::Shard { replicate } => replicate < self.replicate,
            Group::Replicate { shard } => shard < self.shard,
        }
    }
}

/// Parses a mesh written as [`Display`](std::fmt::Display) writes it, `SxR` (`2x1`,
/// `2X2`), checked as [`Mesh::new`] checks it.
impl std::str::FromStr for Mesh {
    type Err = PlanError;

    fn from_str(s: &str) -> Result<Mesh, PlanError> {
        let bad = || {
            PlanError::Mesh(format!(
                "`{}` is not SHARDxREPLICATE, e.g. 2x1 or 1x2",
                crate::export::printable(s)
            ))
        };
        let (a, b) = s.split_once(['x', 'X']).ok_or_else(bad)?;
        let shard = a.trim().parse::<u32>().map_err(|_| bad())?;
        let replicate = b.trim().parse::<u32>().map_err(|_| bad())?;
        Mesh::new(shard, replicate)
    }
}

impl std::fmt::Display for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.shard, self.replicate)
    }
}

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Group::Shard { replicate } => write!(f, "shard-group(r={replicate})"),
            Group::Replicate { shard } => write!(f, "replicate-group(s={shard})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_rank_is_r_times_s_plus_s() {
        let m = Mesh::new(3, 2).unwrap();
        assert_eq!(
            m.rank(Coord {
                shard: 1,
                replicate: 1
            }),
            4
        );
        assert_eq!(
            m.coord(4),
            Coord {
                shard: 1,
                replicate: 1
            }
        );
        for g in m.ranks() {
            assert_eq!(m.rank(m.coord(g)), g);
        }
    }

    #[test]
    fn groups_partition_the_world() {
        let m = Mesh::new(3, 2).unwrap();
        assert_eq!(m.members(Group::Shard { replicate: 1 }), vec![3, 4, 5]);
        assert_eq!(m.members(Group::Replicate { shard: 2 }), vec![2, 5]);
        assert_eq!(m.index_in(Group::Replicate { shard: 2 }, 5), Some(1));
        assert_eq!(m.index_in(Group::Replicate { shard: 2 }, 4), None);
    }

    #[test]
    fn zero_sized_mesh_is_rejected() {
        assert!(Mesh::new(0, 2).is_err());
        assert!(Mesh::new(2, 0).is_err());
    }

    #[test]
    fn a_mesh_past_the_rank_limit_is_rejected_without_overflow() {
        assert!(Mesh::new(MAX_WORLD, 1).is_ok());
        assert!(Mesh::new(128, 128).is_ok());
        assert!(Mesh::new(256, 256).is_err());
        for (s, r) in [(MAX_WORLD + 1, 1), (1, MAX_WORLD + 1), (u32::MAX, u32::MAX)] {
            let e = Mesh::new(s, r).unwrap_err().to_string();
            assert!(e.contains("limit of 16384"), "{e}");
        }
    }
}
