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

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use overlap_dist::rendezvous::{JobSecret, SECRET_ADVICE, SECRET_FILE_VAR, SECRET_VAR};
use overlap_dist::DistError;

/// How long the other ranks get to end by themselves after one failed, before they are
/// killed.
pub const STOP_WAIT: Duration = Duration::from_secs(2);

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

fn grace() -> Duration {
    std::env::var(GRACE_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_GRACE, Duration::from_secs)
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

/// Starts the ranks of this node, forwards their output and waits for them; returns
/// the exit status to exit with.
pub fn launch(spec: &LaunchSpec) -> Result<u8, DistError> {
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
    let world = spec
        .nproc_per_node
        .checked_mul(spec.nnodes)
        .ok_or_else(|| fail("--nproc-per-node × --nnodes overflows".into()))?;
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
            std::env::current_exe()
                .map_err(|e| fail(format!("cannot find the overlap executable to start: {e}")))?,
            &spec.args[..],
        ),
    };
    catch_signals();
    let mut children: Vec<(u32, Child)> = Vec::new();
    let mut pumps: Vec<JoinHandle<()>> = Vec::new();
    for local in 0..spec.nproc_per_node {
        let rank = spec.node_rank * spec.nproc_per_node + local;
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .env(SECRET_VAR, secret.expose())
            .env_remove(SECRET_FILE_VAR)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", spec.nproc_per_node.to_string())
            .env("GROUP_RANK", spec.node_rank.to_string())
            .env("MASTER_ADDR", &spec.master_addr)
            .env("MASTER_PORT", spec.master_port.to_string())
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
        let spawned = cmd.spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(fail(format!(
                    "cannot start rank {rank} ({}): {e}",
                    exe.display()
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
    let code = watch(&mut children);
    for p in pumps {
        // A pump only forwards lines; if one panicked there is nothing to undo.
        let _ = p.join();
    }
    code
}

/// Polls the ranks until all exited or one failed (then kills the rest), or the
/// launcher was signalled (then forwards the signal, and kills the ranks left after the
/// grace period).
fn watch(children: &mut [(u32, Child)]) -> Result<u8, DistError> {
    let mut running: Vec<bool> = vec![true; children.len()];
    loop {
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            return Ok(forward(children, sig));
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
            return Ok(code);
        }
        if running.iter().all(|r| !r) {
            return Ok(0);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `sig` to every rank still running, waits up to the grace period for them to
/// exit, kills the rest; the exit status is 128 + `sig`.
fn forward(children: &mut [(u32, Child)], sig: i32) -> u8 {
    let grace = grace();
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
