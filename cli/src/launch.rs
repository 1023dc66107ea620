//! `overlap launch`: starts the local ranks of a job the way torchrun does.
//!
//! Each rank is a copy of the running executable with the given arguments and the
//! torchrun variables set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`), so every subcommand that understands
//! [`overlap_dist::env::RankEnv`] runs as one rank of the job. Each line a rank writes to
//! stdout or stderr is forwarded to the same stream prefixed with `[rank k] `.
//!
//! The ranks authenticate each other at the rendezvous with the job's secret
//! ([`overlap_dist::rendezvous::JobSecret`]): the launcher passes `OVERLAP_JOB_SECRET` on from
//! its own environment (or `OVERLAP_JOB_SECRET_FILE`), and on one node without either
//! generates a random one per job; it never prints it. A job of several nodes needs the
//! same secret on every node, so there it must be set.
//!
//! SIGINT and SIGTERM sent to the launcher are forwarded to every rank; ranks still
//! running after the grace period ([`GRACE_VAR`], [`DEFAULT_GRACE`]) are killed, and
//! the launcher exits with 128 + the signal. On Linux a rank also gets SIGKILL if the
//! launcher dies without cleaning up (`PR_SET_PDEATHSIG`).
//!
//! Invariant: the launcher exits with the first non-zero exit status of its ranks (128 +
//! the signal for a rank killed by one), after stopping the others: they get
//! [`STOP_WAIT`] to end by themselves (the job's watch tells them of the failure, and
//! each says what it was doing, which may be the root cause: a rank that hung while a
//! peer timed out waiting for it), then they are killed, since a failed rank can leave
//! its peers waiting in a device collective forever. No rank outlives the launcher.
//!
//! With `--max-restarts N` (torchrun's elastic restart, on one node) a failure that
//! leaves restarts starts every rank of the node again, after the others were stopped as
//! above, with the same arguments and secret and [`RESTART_COUNT_VAR`] set to the
//! restart's number (0 on the first attempt; torchrun's `TORCHELASTIC_RESTART_COUNT`);
//! `overlap run --checkpoint DIR --resume-latest` goes on from the latest checkpoint.
//! A signal to the launcher never restarts; once the restarts are used up the launcher
//! exits with the failure's status, as without them.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use overlap::executor::RESTART_COUNT_VAR;
use overlap_dist::rendezvous::{JobSecret, BIND_VAR, SECRET_ADVICE, SECRET_FILE_VAR, SECRET_VAR};
use overlap_dist::DistError;

/// How long the other ranks get to end by themselves after one failed, before they are
/// killed.
pub const STOP_WAIT: Duration = Duration::from_secs(2);

/// How long a restart waits for the rendezvous port to be free ([`Job::wait_for_port`]).
pub const PORT_WAIT: Duration = Duration::from_secs(10);

/// The variable that sets how long ranks get to exit after a forwarded signal, in
/// seconds.
pub const GRACE_VAR: &str = "OVERLAP_LAUNCH_GRACE_S";
/// How long ranks get to exit after a forwarded SIGINT or SIGTERM before they are
/// killed.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// The last SIGINT or SIGTERM the launcher received (0: none).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// Catches SIGINT and SIGTERM so that `watch` forwards them to the ranks.
fn catch_signals() {
    #[cfg(unix)]
    // SAFETY: `on_signal` only stores to an atomic, which is async-signal-safe.
    unsafe {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// The longest grace period [`GRACE_VAR`] may ask for: an hour.
pub const MAX_GRACE_S: u64 = 3600;

/// The grace period: [`GRACE_VAR`] seconds when set (and not empty), else
/// [`DEFAULT_GRACE`]; anything but a whole number from 0 to [`MAX_GRACE_S`] is an error
/// naming the variable (checked before any rank starts).
fn grace() -> Result<Duration, DistError> {
    let Some(v) = std::env::var(GRACE_VAR)
        .ok()
        .filter(|v| !v.trim().is_empty())
    else {
        return Ok(DEFAULT_GRACE);
    };
    match v.trim().parse::<u64>() {
        Ok(s) if s <= MAX_GRACE_S => Ok(Duration::from_secs(s)),
        _ => Err(DistError::Env {
            var: GRACE_VAR.into(),
            reason: format!("`{v}` is not a whole number of seconds from 0 to {MAX_GRACE_S}"),
        }),
    }
}

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Processes to start on this node (one per GPU).
    pub nproc_per_node: u32,
    /// Nodes in the job.
    pub nnodes: u32,
    /// This node's index, `0..nnodes`.
    pub node_rank: u32,
    /// Host of rank 0 (on node 0).
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
    /// The arguments of every rank: an `overlap` subcommand and its options, or a
    /// program and its arguments ([`LaunchSpec::program`]).
    pub args: Vec<OsString>,
    /// When `args` start with a program rather than an `overlap` subcommand: that
    /// program (a trainer embedding the library, `target/release/examples/train`), run
    /// with the rest of `args`. `None`: each rank is this executable.
    pub program: Option<PathBuf>,
    /// How many times every rank is started again after one failed (`--max-restarts`;
    /// 0: never). One node only.
    pub max_restarts: u32,
}

/// Which executable the ranks run for `args`: `None` when the first argument is one of
/// `subcommands` or a flag (the ranks run this `overlap`), else the program it names (a
/// path, or a name looked up on `PATH` when started), torchrun's convention for a
/// script.
pub fn program_of(args: &[OsString], subcommands: &[String]) -> Option<PathBuf> {
    let first = args.first()?;
    // A flag first (`-- --help`) is overlap's to answer, not a program to start.
    let is_subcommand = first
        .to_str()
        .is_some_and(|f| f.starts_with('-') || subcommands.iter().any(|s| s == f));
    (!is_subcommand).then(|| PathBuf::from(first))
}

/// Starts the ranks of this node, forwards their output and waits for them, starting
/// them all again after a failure while `--max-restarts` allows; returns the exit status
/// to exit with.
pub fn launch(spec: &LaunchSpec) -> Result<u8, DistError> {
    grace()?;
    let job = Job::new(spec)?;
    catch_signals();
    let mut restart = 0;
    loop {
        let (rank, code) = match job.attempt(restart)? {
            Ended::Done => return Ok(0),
            Ended::Signalled(code) => return Ok(code),
            Ended::Failed { rank, code } => (rank, code),
        };
        if restart == spec.max_restarts {
            if spec.max_restarts > 0 {
                eprintln!(
                    "[launch] rank {rank} exited with status {code}; the {} restart(s) of --max-restarts are used up: exiting with status {code}",
                    spec.max_restarts
                );
            }
            return Ok(code);
        }
        job.wait_for_port();
        // A signal while the failed attempt stopped (or while waiting) ends the job.
        if let Some(sig) = signalled() {
            eprintln!("[launch] rank {rank} exited with status {code} and the launcher received signal {sig}: no restart");
            return Ok(u8::try_from(128 + sig).unwrap_or(1));
        }
        restart += 1;
        eprintln!(
            "[launch] rank {rank} exited with status {code}; restart {restart} of {}: starting every rank again",
            spec.max_restarts
        );
    }
}

/// The SIGINT or SIGTERM the launcher received, if any.
fn signalled() -> Option<i32> {
    Some(SIGNALLED.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// How one attempt of the job ended.
enum Ended {
    /// Every rank exited with status 0.
    Done,
    /// Rank `rank` exited with status `code` (not 0), and the others were stopped.
    Failed { rank: u32, code: u8 },
    /// The launcher was signalled: the ranks were stopped; the status to exit with.
    Signalled(u8),
}

/// What every attempt of the job starts: the executable and its arguments, with the
/// job's size and secret (the same on every attempt).
struct Job<'a> {
    spec: &'a LaunchSpec,
    exe: PathBuf,
    args: &'a [OsString],
    world: u32,
    secret: JobSecret,
}

impl<'a> Job<'a> {
    /// Checks the spec and finds the executable and the job's secret.
    fn new(spec: &'a LaunchSpec) -> Result<Job<'a>, DistError> {
        let fail = |m: String| DistError::Launch(m);
        let world = check(spec)?;
        let secret = match JobSecret::from_env()? {
            Some(s) => s,
            None if spec.nnodes == 1 => JobSecret::generate()?,
            None => {
                return Err(fail(format!(
                "a job of {} nodes needs the same secret on every node's launcher: {SECRET_ADVICE}",
                spec.nnodes
            )))
            }
        };
        let (exe, args) = match &spec.program {
            Some(p) => (p.clone(), &spec.args[1..]),
            None => (
                std::env::current_exe().map_err(|e| {
                    fail(format!("cannot find the overlap executable to start: {e}"))
                })?,
                &spec.args[..],
            ),
        };
        Ok(Job {
            spec,
            exe,
            args,
            world,
            secret,
        })
    }

    /// Attempt `restart` (0: the first): starts every rank of this node, forwards their
    /// output and waits for them ([`watch`]).
    fn attempt(&self, restart: u32) -> Result<Ended, DistError> {
        let mut children: Vec<(u32, Child)> = Vec::new();
        let mut pumps: Vec<JoinHandle<()>> = Vec::new();
        for local in 0..self.spec.nproc_per_node {
            let rank = self.spec.node_rank * self.spec.nproc_per_node + local;
            let mut child = match self.command(rank, local, restart).spawn() {
                Ok(c) => c,
                Err(e) => {
                    stop(&mut children);
                    return Err(DistError::Launch(format!(
                        "cannot start rank {rank} ({}): {e}",
                        self.exe.display()
                    )));
                }
            };
            if let Some(out) = child.stdout.take() {
                pumps.push(pump(rank, out, false));
            }
            if let Some(err) = child.stderr.take() {
                pumps.push(pump(rank, err, true));
            }
            children.push((rank, child));
        }
        let ended = watch(&mut children);
        for p in pumps {
            // A pump only forwards lines; if one panicked there is nothing to undo.
            let _ = p.join();
        }
        ended
    }

    /// The command of global rank `rank` (local rank `local`) in attempt `restart`.
    fn command(&self, rank: u32, local: u32, restart: u32) -> Command {
        let spec = self.spec;
        let mut cmd = Command::new(&self.exe);
        cmd.args(self.args)
            .env(SECRET_VAR, self.secret.expose())
            .env_remove(SECRET_FILE_VAR)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", self.world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", spec.nproc_per_node.to_string())
            .env("GROUP_RANK", spec.node_rank.to_string())
            .env("MASTER_ADDR", &spec.master_addr)
            .env("MASTER_PORT", spec.master_port.to_string())
            .env(RESTART_COUNT_VAR, restart.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd
    }

    /// Before a restart, on the node of rank 0: waits up to [`PORT_WAIT`] while the
    /// rendezvous port cannot be bound because it is in use, so that the new rank 0 can
    /// listen on it. The previous attempt's rank 0 was reaped, so its listener is closed,
    /// and the rendezvous binds as Rust's `TcpListener::bind` does, with `SO_REUSEADDR`,
    /// so the previous attempt's connections left in `TIME_WAIT` do not hold the port;
    /// what this waits out is another process that took the free port in between (a
    /// port from the ephemeral range, as tests pick, can be an outgoing connection's).
    fn wait_for_port(&self) {
        let spec = self.spec;
        if spec.node_rank != 0 {
            return;
        }
        let by = Instant::now() + PORT_WAIT;
        while port_in_use(&spec.master_addr, spec.master_port) {
            if Instant::now() >= by || signalled().is_some() {
                eprintln!(
                    "[launch] port {} is still in use after {PORT_WAIT:?}; starting the ranks anyway",
                    spec.master_port
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Whether rank 0 could not listen on `host:port` now because the port is in use: the
/// addresses [`overlap_dist::rendezvous::listen`] tries (`OVERLAP_BIND_ADDR`, else what
/// `host` resolves to), none of which binds, one of them for that reason.
fn port_in_use(host: &str, port: u16) -> bool {
    let bind = std::env::var(BIND_VAR).ok();
    let addrs: Vec<SocketAddr> = match bind.as_deref().map(str::trim) {
        Some(b) if !b.is_empty() => b
            .parse::<IpAddr>()
            .map(|ip| vec![SocketAddr::new(ip, port)])
            .unwrap_or_default(),
        _ => (host, port)
            .to_socket_addrs()
            .map(Iterator::collect)
            .unwrap_or_default(),
    };
    let mut in_use = false;
    for a in addrs {
        match TcpListener::bind(a) {
            Ok(_) => return false,
            Err(e) => in_use |= e.kind() == std::io::ErrorKind::AddrInUse,
        }
    }
    in_use
}

/// Checks what to launch; returns the job's size (ranks on every node).
fn check(spec: &LaunchSpec) -> Result<u32, DistError> {
    let fail = |m: String| DistError::Launch(m);
    if spec.nproc_per_node == 0 || spec.nnodes == 0 {
        return Err(fail(
            "--nproc-per-node and --nnodes must be at least 1".into(),
        ));
    }
    if spec.node_rank >= spec.nnodes {
        return Err(fail(format!(
            "--node-rank {} is not below --nnodes {}",
            spec.node_rank, spec.nnodes
        )));
    }
    if spec.args.is_empty() {
        return Err(fail(
            "nothing to run: give the overlap subcommand after `--`, e.g. `overlap launch --nproc-per-node 2 -- verify --config F --backend cuda`".into(),
        ));
    }
    if spec.max_restarts > 0 && spec.nnodes > 1 {
        return Err(fail(format!(
            "--max-restarts {} restarts the ranks of one node, and this job has {} nodes, whose launchers would not restart together: restart a job of several nodes as a whole through its scheduler (Slurm's --requeue) with `run --resume-latest` (docs/checkpoints.md, Restarts)",
            spec.max_restarts, spec.nnodes
        )));
    }
    spec.nproc_per_node
        .checked_mul(spec.nnodes)
        .ok_or_else(|| fail("--nproc-per-node × --nnodes overflows".into()))
}

/// Polls the ranks until all exited or one failed (then kills the rest), or the
/// launcher was signalled (then forwards the signal, and kills the ranks left after the
/// grace period).
fn watch(children: &mut [(u32, Child)]) -> Result<Ended, DistError> {
    let mut running: Vec<bool> = vec![true; children.len()];
    loop {
        if let Some(sig) = signalled() {
            return Ok(Ended::Signalled(forward(children, sig)));
        }
        let mut failure = None;
        let mut broken = None;
        for (i, (rank, child)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    running[i] = false;
                    let code = exit_code(&status);
                    if code != 0 && failure.is_none() {
                        failure = Some((*rank, code));
                    }
                }
                Ok(None) => {}
                Err(e) => broken = Some(format!("cannot watch rank {rank}: {e}")),
            }
        }
        if let Some(msg) = broken {
            stop(children);
            return Err(DistError::Launch(msg));
        }
        if let Some((rank, code)) = failure {
            let others = running.iter().filter(|r| **r).count();
            if others > 0 {
                eprintln!("[launch] rank {rank} exited with status {code}; stopping the {others} other rank(s)");
            }
            stop_after(children, STOP_WAIT);
            return Ok(Ended::Failed { rank, code });
        }
        if running.iter().all(|r| !r) {
            return Ok(Ended::Done);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `sig` to every rank still running, waits up to the grace period for them to
/// exit, kills the rest; the exit status is 128 + `sig`.
fn forward(children: &mut [(u32, Child)], sig: i32) -> u8 {
    // Checked when the launch began.
    let grace = grace().unwrap_or(DEFAULT_GRACE);
    eprintln!(
        "[launch] received signal {sig}; forwarding it to the ranks (killed after {grace:?}, {GRACE_VAR})"
    );
    for (_, c) in children.iter_mut() {
        if matches!(c.try_wait(), Ok(None)) {
            #[cfg(unix)]
            if let Ok(pid) = libc::pid_t::try_from(c.id()) {
                // SAFETY: kill on the pid of a child not yet reaped (so not reused).
                unsafe {
                    libc::kill(pid, sig);
                }
            }
        }
    }
    let by = Instant::now() + grace;
    while Instant::now() < by
        && children
            .iter_mut()
            .any(|(_, c)| matches!(c.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop(children);
    u8::try_from(128 + sig).unwrap_or(1)
}

/// Kills and reaps every rank still running.
/// Waits up to `wait` for every rank to exit, then [`stop`]s the rest.
fn stop_after(children: &mut [(u32, Child)], wait: Duration) {
    let by = Instant::now() + wait;
    while Instant::now() < by
        && children
            .iter_mut()
            .any(|(_, c)| matches!(c.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop(children);
}

fn stop(children: &mut [(u32, Child)]) {
    for (_, c) in children.iter_mut() {
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

fn exit_code(status: &std::process::ExitStatus) -> u8 {
    if let Some(c) = status.code() {
        return u8::try_from(c & 0xff).unwrap_or(1);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return u8::try_from(128 + sig).unwrap_or(1);
        }
    }
    1
}

/// Forwards a rank's output line by line with its prefix.
fn pump(rank: u32, from: impl Read + Send + 'static, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if line.last() != Some(&b'\n') {
                        line.push(b'\n');
                    }
                    let mut out = format!("[rank {rank}] ").into_bytes();
                    out.extend_from_slice(&line);
                    // One write per line keeps ranks' lines whole; a closed pipe is the
                    // reader's business.
                    let _ = if to_stderr {
                        std::io::stderr().lock().write_all(&out)
                    } else {
                        std::io::stdout().lock().write_all(&out)
                    };
                }
            }
        }
    })
}

#[cfg(test)]
mod program_tests {
    use super::*;

    #[test]
    fn program_of_tells_subcommands_from_programs() {
        let subs = vec!["run".to_string(), "verify".to_string()];
        let args = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(program_of(&args(&["run", "--config", "f"]), &subs), None);
        assert_eq!(program_of(&args(&["--help"]), &subs), None);
        assert_eq!(program_of(&[], &subs), None);
        assert_eq!(
            program_of(
                &args(&["target/release/examples/train", "--backend", "cuda"]),
                &subs
            ),
            Some(PathBuf::from("target/release/examples/train"))
        );
        assert_eq!(
            program_of(&args(&["python3", "train.py"]), &subs),
            Some(PathBuf::from("python3"))
        );
    }
}
