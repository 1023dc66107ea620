//! The control plane's CPU job through its public API, as the processes of a launcher
//! use it (threads stand in for the processes here; `cli/tests/cpu_ranks.rs` runs real
//! ones): the ranks meet, agree on what they run, link to each other and drive one rank
//! each, ending with the in-process backend's bits; ranks that do not agree get no world.

use std::net::TcpListener;
use std::sync::Once;
use std::thread;

use overlap::config::Config;
use overlap::drive::synthetic_step;
use overlap::{Error, Session};
use overlap_dist::cpu;
use overlap_dist::env::{Launcher, RankEnv};
use overlap_dist::fingerprint::Fingerprint;

const STEPS: u64 = 3;

/// The job's secret, set once before any rank reads it.
fn job_secret() {
    static SET: Once = Once::new();
    SET.call_once(|| std::env::set_var("OVERLAP_JOB_SECRET", "a test job's secret of 32 bytes."));
}

fn config() -> Config {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/hsdp_2x2.toml");
    Config::from_file(path.as_ref()).expect("the example config")
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("a port");
    l.local_addr().expect("its address").port()
}

fn rank_env(rank: u32, world: u32, port: u16) -> RankEnv {
    RankEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: Some(world),
        master_addr: "127.0.0.1".into(),
        master_port: port,
        launcher: Launcher::Torchrun,
    }
}

/// Every parameter's piece on `rank`, as bits (`None` where the rank holds none).
fn pieces(s: &Session<overlap::CpuBackend>, rank: u32) -> Vec<Option<Vec<u32>>> {
    (0..s.params().len() as u32)
        .map(|p| {
            let v = s.param_values(rank, p).expect("a read");
            v.map(|v| v.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// Runs `rank` for every rank of the example's job on a thread of its own (the job's
/// rendezvous on a fresh port) and returns their results in rank order.
fn every_rank<T: Send + 'static>(
    cfg: &Config,
    rank: impl Fn(Config, RankEnv) -> T + Clone + Send + 'static,
) -> Vec<T> {
    job_secret();
    let world = cfg.plan.mesh.world();
    let port = free_port();
    let threads: Vec<_> = (0..world)
        .map(|r| {
            let (cfg, rank) = (cfg.clone(), rank.clone());
            thread::spawn(move || rank(cfg, rank_env(r, world, port)))
        })
        .collect();
    threads
        .into_iter()
        .map(|h| h.join().expect("a rank thread"))
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// One rank of the job: open the world, run the steps, return its pieces.
fn run_rank(cfg: &Config, env: RankEnv) -> Result<Vec<Option<Vec<u32>>>, Error> {
    let rank = env.rank;
    let what = Fingerprint::of_config(cfg, "test", "cpu", STEPS, cfg.run.seed)?;
    let world = cpu::world(cfg, env, what)?;
    let mut s = cpu::session(cfg, &world)?;
    runtime().block_on(async {
        for step in 0..STEPS {
            synthetic_step(&mut s, cfg.run.seed, step, &cfg.gates).await?;
        }
        Ok::<_, Error>(())
    })?;
    let out = pieces(&s, rank);
    world.rendezvous.bye();
    Ok(out)
}

#[test]
fn ranks_linked_over_tcp_end_with_the_in_process_bits() {
    let cfg = config();
    assert!(
        cfg.plan.mesh.world() >= 2,
        "the example is a multi-rank mesh"
    );
    let linked: Vec<_> = every_rank(&cfg, |cfg, env| run_rank(&cfg, env))
        .into_iter()
        .map(|r| r.expect("a rank's run"))
        .collect();

    let mut alone = Session::cpu(&cfg).expect("an in-process session");
    runtime().block_on(async {
        for step in 0..STEPS {
            synthetic_step(&mut alone, cfg.run.seed, step, &cfg.gates)
                .await
                .expect("a step");
        }
    });
    for (rank, got) in linked.iter().enumerate() {
        let want = pieces(&alone, rank as u32);
        assert!(want.iter().any(Option::is_some), "rank {rank} holds pieces");
        assert_eq!(got, &want, "rank {rank}'s pieces after {STEPS} steps");
    }
}

#[test]
fn ranks_that_run_different_things_get_no_world_and_the_same_reason() {
    let errors: Vec<String> = every_rank(&config(), |cfg, env| {
        // Rank 1 was started with another seed.
        let seed = if env.rank == 1 { 7 } else { cfg.run.seed };
        let what = Fingerprint::of_config(&cfg, "test", "cpu", STEPS, seed)?;
        cpu::world(&cfg, env, what).map(drop)
    })
    .into_iter()
    .map(|r: Result<(), Error>| match r {
        Ok(()) => panic!("a rank got a world although rank 1 differs"),
        Err(e) => e.to_string(),
    })
    .collect();
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            e.contains("ranks 0 and 1") && e.contains("run.seed"),
            "rank {rank}: {e}"
        );
        assert_eq!(e, &errors[0], "rank {rank} says what rank 0 says");
    }
}

#[test]
fn a_rank_that_is_not_ready_stops_every_rank_with_its_reason() {
    let ranks = every_rank(&config(), |cfg, env| {
        let r = env.rank;
        let what = Fingerprint::of_config(&cfg, "test", "cpu", STEPS, cfg.run.seed)?;
        cpu::world_checked(&cfg, env, what, || match r {
            2 => Err(Error::Resources("rank 2 cannot hold its tensors".into())),
            _ => Ok(()),
        })
        .map(drop)
    });
    for (rank, result) in ranks.into_iter().enumerate() {
        let e = match result {
            Ok(()) => panic!("rank {rank} got a world although rank 2 was not ready"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("cannot hold its tensors"), "rank {rank}: {e}");
        if rank != 2 {
            assert!(e.contains("rank 2"), "rank {rank} names rank 2: {e}");
        }
    }
}
