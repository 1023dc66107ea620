//! Who this process is in a multi-process job: its rank, the world size, its local rank
//! and where rank 0's rendezvous listens, read from the environment the launcher set.
//!
//! Three launchers are understood, in this order of precedence (a torchrun started inside
//! a Slurm allocation sets both, and its own variables are the ones that describe the
//! process):
//!
//! | launcher | rank | world size | local rank | rendezvous |
//! | --- | --- | --- | --- | --- |
//! | torchrun, `overlap launch` | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `MASTER_ADDR`, `MASTER_PORT` (required) |
//! | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `MASTER_ADDR` (or 127.0.0.1 when every rank is on one node), `MASTER_PORT` (default 29500) |
//! | Slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `MASTER_ADDR` (or the first host of `SLURM_JOB_NODELIST`), `MASTER_PORT` (default 29500) |
//!
//! Invariant: a [`RankEnv`] that parses is consistent (`rank < world_size`,
//! `local_rank < local_world_size` when the latter is known, a non-empty address); every
//! missing or malformed variable is an error naming it.

use std::fmt;

use serde::Serialize;

use crate::DistError;

/// The rendezvous port when a launcher other than torchrun does not set `MASTER_PORT`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Launcher {
    /// torchrun, `overlap launch`, or anything setting `RANK` and `WORLD_SIZE`.
    Torchrun,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// Slurm's `srun`.
    Slurm,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankEnv {
    /// Global rank, `0..world_size`.
    pub rank: u32,
    /// Number of processes in the job.
    pub world_size: u32,
    /// Rank among the processes of this node: the GPU this process uses.
    pub local_rank: u32,
    /// Processes on this node, when the launcher says.
    pub local_world_size: Option<u32>,
    /// Host of rank 0's rendezvous.
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
    /// Where these values came from.
    pub launcher: Launcher,
}

impl fmt::Display for RankEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {} (local rank {}), rendezvous {}:{} ({:?})",
            self.rank,
            self.world_size,
            self.local_rank,
            self.master_addr,
            self.master_port,
            self.launcher
        )
    }
}

impl RankEnv {
    /// Reads the process environment; `Ok(None)` when no launcher variable is set (a
    /// process started by hand).
    pub fn from_env() -> Result<Option<RankEnv>, DistError> {
        RankEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (the environment, or a map in tests).
    ///
    /// ```
    /// use overlap_dist::env::RankEnv;
    ///
    /// let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"),
    ///             ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
    /// let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
    /// let env = RankEnv::from_vars(get)?.expect("torchrun variables are set");
    /// assert_eq!((env.rank, env.world_size, env.local_rank), (1, 2, 1));
    /// # Ok::<(), overlap_dist::DistError>(())
    /// ```
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>, DistError> {
        let has = |k: &str| get(k).is_some();
        let env = if has("RANK") || has("WORLD_SIZE") {
            torchrun(&get)?
        } else if has("OMPI_COMM_WORLD_RANK") || has("OMPI_COMM_WORLD_SIZE") {
            open_mpi(&get)?
        } else if has("SLURM_PROCID") {
            slurm(&get)?
        } else {
            return Ok(None);
        };
        env.check()?;
        Ok(Some(env))
    }

    /// Whether every rank of the job runs on this node: a single process, or a
    /// launcher that says this node holds all of them. Unknown counts as no.
    pub fn one_node(&self) -> bool {
        self.world_size == 1 || self.local_world_size == Some(self.world_size)
    }

    /// A job of one process (rank 0 of 1, rendezvous on 127.0.0.1).
    pub fn single() -> RankEnv {
        RankEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            launcher: Launcher::Torchrun,
        }
    }

    fn check(&self) -> Result<(), DistError> {
        if self.world_size == 0 {
            return Err(DistError::Inconsistent(
                "the world size is 0; a job has at least one rank".into(),
            ));
        }
        if self.rank >= self.world_size {
            return Err(DistError::Inconsistent(format!(
                "rank {} is not below the world size {} (ranks are 0-based)",
                self.rank, self.world_size
            )));
        }
        if let Some(local) = self.local_world_size {
            if self.local_rank >= local {
                return Err(DistError::Inconsistent(format!(
                    "local rank {} is not below the {local} processes of this node",
                    self.local_rank
                )));
            }
            if local > self.world_size {
                return Err(DistError::Inconsistent(format!(
                    "{local} processes on this node but only {} in the job",
                    self.world_size
                )));
            }
        }
        if self.master_addr.trim().is_empty() {
            return Err(DistError::Env {
                var: "MASTER_ADDR".into(),
                reason: "is empty; set it to the host of rank 0".into(),
            });
        }
        Ok(())
    }
}

type Get<'a> = &'a dyn Fn(&str) -> Option<String>;

fn required(get: Get, var: &str, launcher: &str) -> Result<String, DistError> {
    get(var).ok_or_else(|| DistError::Env {
        var: var.into(),
        reason: format!("is not set, but other {launcher} variables are; set it (or unset them)"),
    })
}

fn number<T: std::str::FromStr>(var: &str, value: &str) -> Result<T, DistError> {
    value.trim().parse().map_err(|_| DistError::Env {
        var: var.into(),
        reason: format!("`{value}` is not a non-negative integer"),
    })
}

fn port(var: &str, value: &str) -> Result<u16, DistError> {
    match value.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(DistError::Env {
            var: var.into(),
            reason: format!("`{value}` is not a TCP port (1-65535)"),
        }),
    }
}

fn torchrun(get: Get) -> Result<RankEnv, DistError> {
    const L: &str = "torchrun";
    let rank = number("RANK", &required(get, "RANK", L)?)?;
    let world_size = number("WORLD_SIZE", &required(get, "WORLD_SIZE", L)?)?;
    let local_rank =
        match get("LOCAL_RANK") {
            Some(v) => number("LOCAL_RANK", &v)?,
            None if world_size == 1 => 0,
            None => return Err(DistError::Env {
                var: "LOCAL_RANK".into(),
                reason:
                    "is not set; it picks this process's GPU (torchrun and `overlap launch` set it)"
                        .into(),
            }),
        };
    let local_world_size = get("LOCAL_WORLD_SIZE")
        .map(|v| number("LOCAL_WORLD_SIZE", &v))
        .transpose()?;
    Ok(RankEnv {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr: required(get, "MASTER_ADDR", L)?,
        master_port: port("MASTER_PORT", &required(get, "MASTER_PORT", L)?)?,
        launcher: Launcher::Torchrun,
    })
}

fn master_port(get: Get) -> Result<u16, DistError> {
    get("MASTER_PORT").map_or(Ok(DEFAULT_MASTER_PORT), |v| port("MASTER_PORT", &v))
}

fn open_mpi(get: Get) -> Result<RankEnv, DistError> {
    const L: &str = "Open MPI";
    let rank = number(
        "OMPI_COMM_WORLD_RANK",
        &required(get, "OMPI_COMM_WORLD_RANK", L)?,
    )?;
    let world_size = number(
        "OMPI_COMM_WORLD_SIZE",
        &required(get, "OMPI_COMM_WORLD_SIZE", L)?,
    )?;
    let local_rank = number(
        "OMPI_COMM_WORLD_LOCAL_RANK",
        &required(get, "OMPI_COMM_WORLD_LOCAL_RANK", L)?,
    )?;
    let local_world_size: Option<u32> = get("OMPI_COMM_WORLD_LOCAL_SIZE")
        .map(|v| number("OMPI_COMM_WORLD_LOCAL_SIZE", &v))
        .transpose()?;
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => a,
        None if local_world_size == Some(world_size) => "127.0.0.1".into(),
        None => {
            return Err(DistError::Env {
                var: "MASTER_ADDR".into(),
                reason: "is not set and the job spans several nodes; set it to the host of rank 0 (e.g. `mpirun -x MASTER_ADDR=node0 ...`)"
                    .into(),
            })
        }
    };
    Ok(RankEnv {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port: master_port(get)?,
        launcher: Launcher::OpenMpi,
    })
}

fn slurm(get: Get) -> Result<RankEnv, DistError> {
    const L: &str = "Slurm";
    let rank = number("SLURM_PROCID", &required(get, "SLURM_PROCID", L)?)?;
    let world_size = number("SLURM_NTASKS", &required(get, "SLURM_NTASKS", L)?)?;
    let local_rank = number("SLURM_LOCALID", &required(get, "SLURM_LOCALID", L)?)?;
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => a,
        None => {
            let (var, list) = match get("SLURM_JOB_NODELIST") {
                Some(l) => ("SLURM_JOB_NODELIST", l),
                None => ("SLURM_NODELIST", required(get, "SLURM_NODELIST", L)?),
            };
            first_host(&list).ok_or_else(|| DistError::Env {
                var: var.into(),
                reason: format!("cannot read a host from `{list}`; set MASTER_ADDR instead"),
            })?
        }
    };
    // Tasks on this node: all of them in a one-node allocation, else a uniform
    // `SLURM_NTASKS_PER_NODE` (a plain number; `4(x2)` and lists stay unknown).
    let nodes = get("SLURM_JOB_NUM_NODES").or_else(|| get("SLURM_NNODES"));
    let local_world_size = if nodes.as_deref().map(str::trim) == Some("1") {
        Some(world_size)
    } else {
        get("SLURM_NTASKS_PER_NODE").and_then(|v| v.trim().parse::<u32>().ok())
    };
    Ok(RankEnv {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port: master_port(get)?,
        launcher: Launcher::Slurm,
    })
}

/// The first host of a Slurm node list (`gpu[03-04,07],cpu1` → `gpu03`;
/// `a[1-2]-ib` → `a1-ib`).
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => return true,
                _ => {}
            }
            false
        })
        .map_or(list.len(), |(i, _)| i);
    let entry = &list[..end];
    let host = match entry.find('[') {
        None => entry.to_string(),
        Some(open) => {
            let close = open + entry[open..].find(']')?;
            let first = entry[open + 1..close].split(',').next()?;
            let first = first.split('-').next()?;
            format!("{}{first}{}", &entry[..open], &entry[close + 1..])
        }
    };
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Option<RankEnv>, DistError> {
        let owned: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankEnv::from_vars(move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29400"),
    ];

    #[test]
    fn no_launcher_variables_means_a_single_process() {
        assert_eq!(env(&[]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_are_read() {
        let e = env(TORCHRUN).unwrap().unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (3, 4, 1));
        assert_eq!(e.local_world_size, Some(2));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("node0", 29400));
        assert_eq!(e.launcher, Launcher::Torchrun);
    }

    #[test]
    fn torchrun_takes_precedence_over_slurm_in_an_allocation() {
        let mut vars = TORCHRUN.to_vec();
        vars.extend([
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
        ]);
        assert_eq!(env(&vars).unwrap().unwrap().rank, 3);
    }

    #[test]
    fn a_missing_torchrun_variable_is_named() {
        let vars: Vec<_> = TORCHRUN
            .iter()
            .copied()
            .filter(|(k, _)| *k != "MASTER_PORT")
            .collect();
        let err = env(&vars).unwrap_err().to_string();
        assert!(
            err.contains("MASTER_PORT") && err.contains("not set"),
            "{err}"
        );
    }

    #[test]
    fn malformed_and_inconsistent_values_are_errors() {
        let mut vars = TORCHRUN.to_vec();
        vars[0] = ("RANK", "three");
        assert!(env(&vars).unwrap_err().to_string().contains("`three`"));
        vars[0] = ("RANK", "4");
        let err = env(&vars).unwrap_err().to_string();
        assert!(
            err.contains("rank 4 is not below the world size 4"),
            "{err}"
        );
        vars[0] = ("RANK", "0");
        vars[2] = ("LOCAL_RANK", "2");
        assert!(env(&vars).unwrap_err().to_string().contains("local rank 2"));
        vars[2] = ("LOCAL_RANK", "0");
        vars[5] = ("MASTER_PORT", "70000");
        assert!(env(&vars).unwrap_err().to_string().contains("TCP port"));
    }

    #[test]
    fn one_node_needs_the_launcher_to_say_so() {
        assert!(RankEnv::single().one_node());
        let mut e = RankEnv {
            world_size: 4,
            local_world_size: Some(4),
            ..RankEnv::single()
        };
        assert!(e.one_node());
        e.local_world_size = Some(2);
        assert!(!e.one_node());
        e.local_world_size = None;
        assert!(!e.one_node());
    }

    #[test]
    fn open_mpi_on_one_node_defaults_the_address() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!((e.rank, e.local_rank), (1, 1));
        assert_eq!(
            (e.master_addr.as_str(), e.master_port),
            ("127.0.0.1", DEFAULT_MASTER_PORT)
        );
        let err = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("MASTER_ADDR"), "{err}");
    }

    #[test]
    fn slurm_takes_the_first_host_of_the_node_list() {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[03-04,07],cpu1"),
            ("MASTER_PORT", "12345"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.launcher, Launcher::Slurm);
        assert_eq!((e.rank, e.world_size, e.local_rank), (5, 8, 1));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("gpu03", 12345));
        // Nothing says how many tasks share a node: unknown, so not one node.
        assert_eq!(e.local_world_size, None);
        assert!(!e.one_node());
        let base = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu03"),
        ];
        let with = |extra: (&'static str, &'static str)| {
            let mut v = base.to_vec();
            v.push(extra);
            env(&v).unwrap().unwrap()
        };
        assert!(with(("SLURM_JOB_NUM_NODES", "1")).one_node());
        assert!(with(("SLURM_NTASKS_PER_NODE", "4")).one_node());
        assert!(!with(("SLURM_NTASKS_PER_NODE", "2")).one_node());
        assert_eq!(
            with(("SLURM_NTASKS_PER_NODE", "2(x2)")).local_world_size,
            None
        );
        let err = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("SLURM_LOCALID"), "{err}");
    }

    #[test]
    fn slurm_node_lists_parse() {
        assert_eq!(first_host("node7").as_deref(), Some("node7"));
        assert_eq!(first_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_host("gpu[03-04,07],cpu1").as_deref(), Some("gpu03"));
        assert_eq!(first_host("x[1-2]-ib,y").as_deref(), Some("x1-ib"));
        assert_eq!(first_host("bad[1-2").as_deref(), None);
        assert_eq!(first_host("").as_deref(), None);
    }
}
