//! What a run on the CPU backend needs, checked before anything is allocated.
//!
//! The CPU backend runs every rank of the mesh in this process: a thread per rank and
//! stream, and every rank's parameters, optimizer state, gradients and plans in this
//! process's memory. [`check_cpu`] refuses a job the backend cannot drive (more than
//! [`MAX_RANKS`](overlap_ops::cpu::MAX_RANKS) ranks) or the machine cannot hold (an [`estimate_cpu`] above the
//! memory available to the process: the smallest of what the kernel says is available,
//! what its address-space limit leaves, and what its cgroup's memory limit leaves), with
//! an error that names the estimate, what is available and which bound decided it. `overlap run` and `overlap verify` call it before starting a
//! session; a trainer that builds a [`Session::cpu`](crate::Session::cpu) can too.
//!
//! The estimate is an upper bound of the steady state, not a measurement: every
//! rank's gradients of a whole micro-batch in flight at once, each Stage-1 buffer as
//! large as the gradients it packs, the optimizers' scratch on every rank at once.
//! Memory does not grow with the number of steps (nothing is kept per step), so steps
//! are not part of it.

use std::fmt;

use overlap_graph::{Gate, Mesh, Planner, Route, Stream};
use overlap_ops::cpu::CpuBackend;
use overlap_ops::OpsError;

use crate::config::Config;
use crate::Error;

/// Bytes a plan node costs, with its share of the lowered programs, the validator's
/// and the executor's per-plan tables (measured: about 160 bytes per node for planning
/// and validation, `overlap plan` on a 16x16 mesh, 865 k nodes, 136 MB).
pub const PLAN_NODE_BYTES: u64 = 256;

/// Resident bytes a stream thread costs (stack pages touched and bookkeeping; measured:
/// `overlap verify` on 256 ranks, 2560 threads, 115 MB in all).
pub const THREAD_BYTES: u64 = 64 * 1024;

/// The memory a CPU-backend job needs, by part, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryEstimate {
    /// Parameters: each rank's shard or owned copy.
    pub params: u64,
    /// Optimizer state: AdamW's two moments, Muon's momentum and Newton–Schulz scratch.
    pub optimizer: u64,
    /// Gradients of a micro-batch on every rank, their Stage-1 buffers, no_sync
    /// accumulations, partials and reduced gradients.
    pub gradients: u64,
    /// The step plan and the plan the session runs micro-batches on (planned ahead).
    pub plans: u64,
    /// Host-side buffers: a parameter's full initial values (and, for `verify`, the
    /// reference's f64 sums), and the stream threads.
    pub host: u64,
}

impl MemoryEstimate {
    /// Both estimates' parts added (saturating): two processes' needs.
    pub fn plus(&self, other: &MemoryEstimate) -> MemoryEstimate {
        MemoryEstimate {
            params: self.params.saturating_add(other.params),
            optimizer: self.optimizer.saturating_add(other.optimizer),
            gradients: self.gradients.saturating_add(other.gradients),
            plans: self.plans.saturating_add(other.plans),
            host: self.host.saturating_add(other.host),
        }
    }

    /// The sum of the parts (saturating).
    pub fn total(&self) -> u64 {
        [
            self.params,
            self.optimizer,
            self.gradients,
            self.plans,
            self.host,
        ]
        .into_iter()
        .fold(0u64, u64::saturating_add)
    }
}

impl fmt::Display for MemoryEstimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (parameters {}, optimizer state {}, gradients and partials {}, plans {}, host buffers and threads {})",
            human(self.total()),
            human(self.params),
            human(self.optimizer),
            human(self.gradients),
            human(self.plans),
            human(self.host)
        )
    }
}

/// Bytes in binary units, one decimal.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut x = bytes as f64;
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{x:.1} {}", UNITS[unit])
    }
}

/// The memory a job of `sessions` CPU-backend sessions of `config` needs (`overlap run`
/// runs one, `overlap verify` two: the gated one and the no_sync reference), with the
/// planner `planner` of `config.plan`. Saturates instead of overflowing.
pub fn estimate_cpu(config: &Config, planner: &Planner, sessions: u32) -> MemoryEstimate {
    let all: Vec<u32> = (0..config.plan.mesh.world()).collect();
    estimate_cpu_ranks(config, planner, sessions, &all, false)
}

/// [`estimate_cpu`] for the ranks `ranks` of the mesh only: what one process of a job
/// of one process per rank holds (its ranks' parameters, state and gradients, with the
/// owners' whole tensors on the owners' shard columns), the whole step's plans (every
/// process plans every rank) and, when `linked`, what its links to the other ranks
/// receive: a whole Stage-1 buffer from every other rank at most.
pub fn estimate_cpu_ranks(
    config: &Config,
    planner: &Planner,
    sessions: u32,
    ranks: &[u32],
    linked: bool,
) -> MemoryEstimate {
    const F32: u64 = 4;
    let mesh = config.plan.mesh;
    let world = u64::from(mesh.world());
    let n_ranks = ranks.len() as u64;
    let mul = u64::saturating_mul;
    let (mut params, mut numel_all, mut chunks) = (0u64, 0u64, 0u64);
    let (mut adamw_held, mut largest, mut largest_muon) = (0u64, 0u64, 0u64);
    for p in planner.params() {
        let numel = p.spec.numel();
        let chunk = p.spec.chunk(mesh.shard);
        // Owned routes: the owner's whole shard column holds the parameter; sharded
        // ones: a chunk on every rank.
        let held = match p.owner {
            Some(o) if p.spec.route.is_owned() => {
                let column = ranks.iter().filter(|&&g| mesh.coord(g).shard == o.shard);
                mul(numel, column.count() as u64)
            }
            _ => mul(chunk, n_ranks),
        };
        params = params.saturating_add(held);
        if p.spec.route != Route::Muon {
            adamw_held = adamw_held.saturating_add(held);
        }
        numel_all = numel_all.saturating_add(numel);
        chunks = chunks.saturating_add(chunk);
        largest = largest.max(numel);
        if p.spec.route == Route::Muon {
            largest_muon = largest_muon.max(numel);
        }
    }
    // Muon's momentum, AdamW's two moments.
    let mut optimizer = params.saturating_add(adamw_held);
    params = params.saturating_add(mul(forward_gathered(config, planner), n_ranks));
    // Newton–Schulz on every rank at once: the iterate, its Gram matrix and two
    // products.
    optimizer = optimizer.saturating_add(mul(mul(largest_muon, 4), n_ranks));
    let no_sync = config.gates.contains(&Gate::NoSync);
    // Per rank: a micro-batch's gradients, as many Stage-1 bytes and as many again for
    // the collectives' outputs and the pool, the no_sync accumulation, and partials
    // plus reduced gradients of every bucket. (Measured: `overlap run` of three AdamW
    // parameters of 6 M elements in all on a 2x2 mesh, gates no_sync,off,on, peaks at
    // 624 MiB; this estimates 705 MiB.)
    let per_rank = mul(numel_all, 3 + u64::from(no_sync)).saturating_add(mul(chunks, 2));
    let gradients = mul(per_rank, n_ranks);
    // The step plan, and the current plan the session runs micro-batches on: planned
    // ahead, at most twice the step's micro-batches (`session` module docs); each also
    // prepared once per rank by the executor (counted in the per-node bytes).
    let step = planner.step_nodes_bound(config.gates.len());
    let ahead = planner.step_nodes_bound(config.gates.len().saturating_mul(2));
    let plans = mul(step.saturating_add(ahead), PLAN_NODE_BYTES);
    let threads = mul(mul(n_ranks, Stream::ALL.len() as u64), THREAD_BYTES);
    // verify's reference: two f64 sums and an f32 gradient of the largest parameter.
    let reference = if sessions > 1 { mul(largest, 20) } else { 0 };
    let received = if linked {
        mul(mul(numel_all, world.saturating_sub(1)), F32)
    } else {
        0
    };
    let n = u64::from(sessions);
    MemoryEstimate {
        params: mul(mul(params, F32), n),
        optimizer: mul(mul(optimizer, F32), n),
        gradients: mul(mul(gradients, F32), n),
        plans: mul(plans, n),
        host: mul(largest, F32)
            .saturating_add(reference)
            .saturating_add(mul(threads, n))
            .saturating_add(mul(received, n)),
    }
}

/// `[forward]`: the gathered full parameters a rank holds, at most `prefetch + 1`
/// layers of them per pass (bounded here by the largest layers), or every layer when
/// the forward's are kept for the backward; 0 without a forward.
fn forward_gathered(config: &Config, planner: &Planner) -> u64 {
    let Some(f) = config.plan.forward else {
        return 0;
    };
    let mesh = config.plan.mesh;
    let mut layers: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
    for p in planner.params() {
        let full = if p.spec.route.is_owned() {
            p.spec.numel()
        } else {
            p.spec
                .chunk(mesh.shard)
                .saturating_mul(u64::from(mesh.shard))
        };
        let l = layers.entry(p.spec.layer).or_insert(0);
        *l = l.saturating_add(full);
    }
    let mut sizes: Vec<u64> = layers.into_values().collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let held = if f.reshard_after_forward {
        (f.prefetch as usize).saturating_add(1)
    } else {
        sizes.len()
    };
    sizes
        .iter()
        .take(held)
        .fold(0u64, |acc, &x| acc.saturating_add(x))
}

/// Which ranks a memory check counts ([`check_cpu_ranks`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RanksHere {
    /// The ranks this process drives: held against its own address-space limit.
    pub process: Vec<u32>,
    /// The processes on this machine, each with its ranks: together held against the
    /// machine's available memory and the cgroup's limit.
    pub machine: Vec<Vec<u32>>,
}

impl RanksHere {
    /// Every rank of `mesh` in this process (the in-process CPU backend).
    pub fn all(mesh: Mesh) -> RanksHere {
        let all: Vec<u32> = (0..mesh.world()).collect();
        RanksHere {
            process: all.clone(),
            machine: vec![all],
        }
    }

    /// Rank `rank` of a job of one process per rank on `mesh`, the process
    /// `local_rank` of `local_world_size` on its machine (launchers number a machine's
    /// processes consecutively); without `local_world_size`, every rank is taken to
    /// share this machine.
    pub fn one(mesh: Mesh, rank: u32, local_rank: u32, local_world_size: Option<u32>) -> RanksHere {
        let world = mesh.world();
        let machine: Vec<Vec<u32>> = match local_world_size {
            Some(n) if local_rank <= rank => {
                let first = rank - local_rank;
                (first..first.saturating_add(n).min(world))
                    .map(|r| vec![r])
                    .collect()
            }
            _ => (0..world).map(|r| vec![r]).collect(),
        };
        RanksHere {
            process: vec![rank],
            machine,
        }
    }
}
/// Address space a stream thread reserves beyond what it touches: its stack (2 MiB, the
/// standard library's default) and, for the first threads, an allocator arena (glibc
/// reserves 64 MiB of address space per arena, at most 8 per core). Only a limit on the
/// address space (`ulimit -v`, `prlimit --as`) counts it.
pub const THREAD_ADDRESS_BYTES: u64 = 2 << 20;
/// Address space one allocator arena reserves (glibc's `HEAP_MAX_SIZE` on 64-bit).
pub const ARENA_ADDRESS_BYTES: u64 = 64 << 20;

/// What bounds the memory a job may take, and how much of it is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Available {
    /// Bytes left.
    pub bytes: u64,
    /// Which bound: `MemAvailable in /proc/meminfo`, `the address-space limit (ulimit
    /// -v)`, or `the cgroup's memory.max`.
    pub bound: &'static str,
    /// Whether the bound counts address space reserved but not touched.
    pub address_space: bool,
}

/// The largest config file read ([`crate::Config::from_file`]).
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;
/// The largest plan file `overlap check` reads: a plan at the node limit
/// (`overlap_graph::MAX_PLAN_NODES`, about 420 bytes of JSON a node) fits.
pub const MAX_PLAN_BYTES: u64 = 8 << 30;

/// Reads the UTF-8 text file at `path`, refusing, before it is all in memory, one longer
/// than `limit` bytes or than a quarter of the memory available ([`available_memory`]):
/// a device such as `/dev/zero`, or a runaway file, is an error naming the limit rather
/// than an abort. The error is the reader's, or `InvalidData` (not UTF-8, too long).
pub fn read_text_bounded(path: &std::path::Path, limit: u64) -> std::io::Result<String> {
    use std::io::Read;
    let limit = available_memory().map_or(limit, |a| limit.min(a / 4));
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_char_device() || t.is_block_device() || t.is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "it is a device or a socket, not a file",
            ));
        }
    }
    if meta.is_file() && meta.len() > limit {
        return Err(too_long(limit));
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_long(limit));
    }
    String::from_utf8(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "it is not valid UTF-8"))
}

fn too_long(limit: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "it is longer than {}, the most read from such a file here (at most a quarter of the memory available)",
            human_bytes(limit)
        ),
    )
}

fn human_bytes(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30))
    } else {
        format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20))
    }
}

/// The memory available to new allocations, in bytes: the smallest of `MemAvailable` of
/// `/proc/meminfo`, what the process's address-space limit leaves, and what its cgroup's
/// memory limit leaves; `None` where none can be read (then nothing is refused).
pub fn available_memory() -> Option<u64> {
    available().map(|a| a.bytes)
}

/// [`available_memory`], with the bound that decides it.
pub fn available() -> Option<Available> {
    bounds().into_iter().min_by_key(|a| a.bytes)
}

/// Every bound on the memory this process may take that can be read: the machine's
/// `MemAvailable`, the address-space limit, the cgroup's limit.
pub fn bounds() -> Vec<Available> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let meminfo = read("/proc/meminfo")
        .and_then(|t| meminfo_available(&t))
        .map(|bytes| Available {
            bytes,
            bound: "MemAvailable in /proc/meminfo",
            address_space: false,
        });
    let address = read("/proc/self/limits")
        .and_then(|t| address_space_limit(&t))
        .map(|limit| {
            let used = read("/proc/self/status")
                .and_then(|t| status_kib(&t, "VmSize:"))
                .unwrap_or(0);
            Available {
                bytes: limit.saturating_sub(used),
                bound: "the address-space limit (ulimit -v)",
                address_space: true,
            }
        });
    let cgroup = cgroup_left(&read).map(|bytes| Available {
        bytes,
        bound: "the cgroup's memory.max",
        address_space: false,
    });
    [meminfo, address, cgroup].into_iter().flatten().collect()
}

/// The soft `Max address space` of a `/proc/self/limits` text, in bytes; `None` when
/// unlimited or unreadable.
pub fn address_space_limit(limits: &str) -> Option<u64> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    line["Max address space".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A `kB` field of a `/proc/self/status` text (`VmSize:`), in bytes.
pub fn status_kib(status: &str, field: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line[field.len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// What the process's cgroup (v2) still allows: `memory.max − memory.current` of the
/// cgroup `/proc/self/cgroup` names; `None` without a limit (`max`) or a cgroup v2.
fn cgroup_left(read: &dyn Fn(&str) -> Option<String>) -> Option<u64> {
    let cgroups = read("/proc/self/cgroup")?;
    let path = cgroups.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = format!("/sys/fs/cgroup{}", path.trim_end());
    let max: u64 = read(&format!("{dir}/memory.max"))?.trim().parse().ok()?;
    let current: u64 = read(&format!("{dir}/memory.current"))
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    Some(max.saturating_sub(current))
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn meminfo_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line["MemAvailable:".len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => value.checked_mul(1024),
        Some(_) => None,
    }
}

/// Refuses a job whose estimate passes what is available (`None`: unknown, accepted),
/// read as `MemAvailable` of `/proc/meminfo`.
pub fn check_memory(
    estimate: &MemoryEstimate,
    available: Option<u64>,
    what: &str,
) -> Result<(), Error> {
    let available = available.map(|bytes| Available {
        bytes,
        bound: "MemAvailable in /proc/meminfo",
        address_space: false,
    });
    check_within(estimate, 0, available, what)
}

/// Refuses a job whose estimate (plus `reserved` bytes of address space its threads
/// reserve, where the bound counts address space) passes what is available, naming
/// the bound.
pub fn check_within(
    estimate: &MemoryEstimate,
    reserved: u64,
    available: Option<Available>,
    what: &str,
) -> Result<(), Error> {
    let Some(a) = available else { return Ok(()) };
    let extra = if a.address_space { reserved } else { 0 };
    let needs = estimate.total().saturating_add(extra);
    if needs <= a.bytes {
        return Ok(());
    }
    let reserve = if extra > 0 {
        format!(" and {} of address space its threads reserve", human(extra))
    } else {
        String::new()
    };
    Err(Error::Resources(format!(
        "{what} needs about {estimate}{reserve}, but this machine has {} available ({}); use a smaller model, mesh or fewer micro-batches",
        human(a.bytes),
        a.bound
    )))
}

/// Address space that `threads` stream threads reserve beyond what they touch
/// ([`THREAD_ADDRESS_BYTES`] each, and an allocator arena for up to 8 per core).
pub fn thread_address_bytes(threads: u64) -> u64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let arenas = threads.min(8 * cores);
    threads
        .saturating_mul(THREAD_ADDRESS_BYTES)
        .saturating_add(arenas.saturating_mul(ARENA_ADDRESS_BYTES))
}

/// Checks, before anything is allocated, that the CPU backend can run `sessions`
/// sessions of `config` here: at most [`MAX_RANKS`](overlap_ops::cpu::MAX_RANKS) ranks, a step plan within the
/// planner's limits for the config's gates, and an [`estimate_cpu`] within
/// [`available_memory`]. Returns the estimate.
pub fn check_cpu(config: &Config, sessions: u32) -> Result<MemoryEstimate, Error> {
    check_cpu_ranks(config, sessions, &RanksHere::all(config.plan.mesh))
}

/// [`check_cpu`] for a process that drives only some ranks (`here`): its own ranks'
/// [`estimate_cpu_ranks`] against its address-space limit, and every process of its
/// machine together against the machine's available memory and the cgroup's limit.
/// Returns this process's estimate.
pub fn check_cpu_ranks(
    config: &Config,
    sessions: u32,
    here: &RanksHere,
) -> Result<MemoryEstimate, Error> {
    CpuBackend::check_mesh(config.plan.mesh).map_err(|e| match e {
        OpsError::Backend(reason) => Error::Backend(reason),
        other => Error::Backend(other.to_string()),
    })?;
    let planner = Planner::new(config.plan.clone())?;
    planner.check_step(config.gates.len())?;
    let world = config.plan.mesh.world();
    let linked = here.process.len() < world as usize;
    let estimate = |ranks: &[u32]| estimate_cpu_ranks(config, &planner, sessions, ranks, linked);
    let mine = estimate(&here.process);
    let machine = here
        .machine
        .iter()
        .map(|p| estimate(p))
        .reduce(|a, b| a.plus(&b))
        .unwrap_or(mine);
    let what = |scope: &str| job_text(config, sessions, &here.process, linked, scope);
    let threads = |n: usize| {
        thread_address_bytes(
            (n as u64)
                .saturating_mul(Stream::ALL.len() as u64)
                .saturating_mul(u64::from(sessions)),
        )
    };
    let all = bounds();
    let process_bound = all
        .iter()
        .copied()
        .filter(|a| a.address_space)
        .min_by_key(|a| a.bytes);
    let machine_bound = all
        .iter()
        .copied()
        .filter(|a| !a.address_space)
        .min_by_key(|a| a.bytes);
    check_within(
        &mine,
        threads(here.process.len()),
        process_bound,
        &what("this process"),
    )?;
    let on_machine: usize = here.machine.iter().map(Vec::len).sum();
    let scope = if linked {
        "the processes on this machine"
    } else {
        "this process"
    };
    check_within(&machine, threads(on_machine), machine_bound, &what(scope))?;
    Ok(mine)
}

/// What a memory check names: the config and mesh, and for a process of a job its
/// ranks and `scope` (this process, or the processes on its machine).
fn job_text(config: &Config, sessions: u32, ranks: &[u32], linked: bool, scope: &str) -> String {
    let (mesh, m) = (config.plan.mesh, config.gates.len());
    let n = sessions_text(sessions);
    if linked {
        format!(
            "{} ({scope}: rank(s) {ranks:?} of a job of {} processes on the CPU backend (mesh {mesh}, {m} micro-batches{n}))",
            config.source,
            mesh.world()
        )
    } else {
        format!(
            "{} on the CPU backend (mesh {mesh}, {} ranks, {m} micro-batches{n})",
            config.source,
            mesh.world()
        )
    }
}

fn sessions_text(sessions: u32) -> String {
    if sessions > 1 {
        format!(", {sessions} sessions")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn text_files_are_read_within_a_limit_and_devices_are_refused() {
        let dir = std::env::temp_dir().join(format!("overlap-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.toml");
        std::fs::write(&f, "x = 1\n").unwrap();
        assert_eq!(super::read_text_bounded(&f, 6).unwrap(), "x = 1\n");
        let e = super::read_text_bounded(&f, 5).unwrap_err();
        assert!(e.to_string().contains("longer than"), "{e}");
        std::fs::write(&f, [0xff, 0xfe]).unwrap();
        let e = super::read_text_bounded(&f, 64).unwrap_err();
        assert!(e.to_string().contains("not valid UTF-8"), "{e}");
        #[cfg(unix)]
        {
            let e = super::read_text_bounded("/dev/zero".as_ref(), 1 << 30).unwrap_err();
            assert!(e.to_string().contains("a device"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_address_space_limit_and_the_process_size_are_read_from_proc() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax stack size            8388608              unlimited            bytes\nMax address space         4294967296           unlimited            bytes\n";
        assert_eq!(super::address_space_limit(limits), Some(4 << 30));
        let unlimited =
            "Max address space         unlimited            unlimited            bytes\n";
        assert_eq!(super::address_space_limit(unlimited), None);
        assert_eq!(
            super::status_kib("VmPeak:  9 kB\nVmSize:   2048 kB\n", "VmSize:"),
            Some(2 << 20)
        );
        assert_eq!(super::status_kib("VmSize: x kB\n", "VmSize:"), None);
    }

    #[test]
    fn an_address_space_bound_counts_what_threads_reserve_and_names_itself() {
        let e = super::MemoryEstimate {
            params: 1 << 30,
            ..Default::default()
        };
        let a = super::Available {
            bytes: (1 << 30) + (1 << 20),
            bound: "the address-space limit (ulimit -v)",
            address_space: true,
        };
        let msg = super::check_within(&e, 64 << 20, Some(a), "job")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("ulimit -v") && msg.contains("address space its threads reserve"),
            "{msg}"
        );
        // The same bytes of physical memory are enough: reservations cost nothing there.
        let m = super::Available {
            address_space: false,
            ..a
        };
        assert!(super::check_within(&e, 64 << 20, Some(m), "job").is_ok());
    }

    use super::*;

    #[test]
    fn meminfo_is_read_in_kib() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   16384 kB\n";
        assert_eq!(meminfo_available(text), Some(16384 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
        assert_eq!(meminfo_available("MemAvailable: lots kB\n"), None);
        assert_eq!(
            meminfo_available("MemAvailable: 99999999999999999999 kB\n"),
            None
        );
    }

    #[test]
    fn human_units() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
        assert_eq!(human(u64::MAX), "16384.0 PiB");
    }

    #[test]
    fn an_estimate_above_what_is_available_is_refused_naming_both() {
        let e = MemoryEstimate {
            params: 3 << 30,
            gradients: 2 << 30,
            ..MemoryEstimate::default()
        };
        assert!(check_memory(&e, None, "job").is_ok());
        assert!(check_memory(&e, Some(6 << 30), "job").is_ok());
        let msg = check_memory(&e, Some(4 << 30), "job")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("needs about 5.0 GiB"), "{msg}");
        assert!(msg.contains("4.0 GiB available"), "{msg}");
    }
}
