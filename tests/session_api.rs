//! The embedding API's contract: gates, ordering, flushing, zero_grad and errors.

use std::sync::Arc;

use overlap::executor::{ExecConfig, ExecError};
use overlap::ops::cpu::CpuBackend;
use overlap::{Error, Gate, Mesh, ParamSpec, PlanSpec, Route, Session};

fn spec(shard: u32, replicate: u32) -> PlanSpec {
    let p = |name: &str, shape: Vec<u64>, route, layer| ParamSpec::new(name, shape, route, layer);
    PlanSpec::new(
        Mesh::new(shard, replicate).unwrap(),
        vec![
            p("w", vec![6, 5], Route::Muon, 2),
            p("norm", vec![9], Route::Fsdp, 2),
            p("bias", vec![7], Route::Adamw, 1),
            p("emb", vec![11, 3], Route::ShardedAdamw, 0),
        ],
    )
    .with_bucket_cap_bytes(1 << 20)
}

fn session(shard: u32, replicate: u32) -> (Session<CpuBackend>, Arc<CpuBackend>) {
    let backend = Arc::new(CpuBackend::new(Mesh::new(shard, replicate).unwrap()));
    (
        Session::new(
            spec(shard, replicate),
            backend.clone(),
            ExecConfig::default(),
        )
        .unwrap(),
        backend,
    )
}

async fn micro_batch(s: &mut Session<CpuBackend>, gate: Gate) -> Result<(), Error> {
    s.begin_micro_batch(gate).await?;
    for layer in s.layers() {
        s.grad_ready(layer, |rank, param, out| {
            out.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = (rank + param) as f32 + i as f32 * 0.01)
        })
        .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_after_gate_off_last_micro_batch_names_unflushed_parameters() {
    let (mut s, _) = session(2, 2);
    micro_batch(&mut s, Gate::ReplicateOff).await.unwrap();
    let err = s.step().await.unwrap_err();
    match &err {
        Error::Unflushed { params, .. } => {
            for name in ["w", "norm", "bias", "emb"] {
                assert!(
                    params.iter().any(|p| p == name),
                    "{name} missing from {params:?}"
                );
            }
        }
        other => panic!("expected Unflushed, got {other}"),
    }
    assert!(err.to_string().contains("zero_grad"));
    assert!(
        s.partials_held() > 0,
        "the partials are still pending after the refused step"
    );
    s.zero_grad().await.unwrap();
    assert_eq!(s.partials_held(), 0);
    micro_batch(&mut s, Gate::On).await.unwrap();
    let r = s.step().await.unwrap();
    assert_eq!(r.step, 1);
    assert_eq!(r.stats.partials_left, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_after_no_sync_last_micro_batch_is_refused() {
    let (mut s, _) = session(2, 1);
    micro_batch(&mut s, Gate::On).await.unwrap();
    micro_batch(&mut s, Gate::NoSync).await.unwrap();
    assert!(matches!(s.step().await, Err(Error::Unflushed { .. })));
    // A gate-on micro-batch flushes the accumulation; the step then succeeds.
    micro_batch(&mut s, Gate::On).await.unwrap();
    let r = s.step().await.unwrap();
    assert_eq!(r.gates, vec![Gate::On, Gate::NoSync, Gate::On]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_out_of_order_are_a_usage_error() {
    let (mut s, _) = session(2, 1);
    s.begin_micro_batch(Gate::On).await.unwrap();
    let err = s.grad_ready(0, |_, _, _| {}).await.unwrap_err();
    assert!(err.to_string().contains("layer 2 is next"), "{err}");
    assert!(matches!(s.step().await, Err(Error::Usage(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_node_cancels_dependents_and_returns_from_step() {
    let (mut s, backend) = session(2, 2);
    backend.inject_fault(1, "fold");
    micro_batch(&mut s, Gate::ReplicateOff).await.unwrap();
    micro_batch(&mut s, Gate::On).await.unwrap();
    let err = s.step().await.unwrap_err();
    let Error::Exec(ExecError::Step { failures }) = &err else {
        panic!("expected a step failure, got {err}")
    };
    assert!(
        failures.iter().all(|f| !f.error.is_cancellation()),
        "only root causes are reported: {failures:?}"
    );
    assert!(
        failures
            .iter()
            .any(|f| f.rank == 1 && f.label.starts_with("fold")),
        "{failures:?}"
    );
    // The failed step's state is discarded; the next step runs normally.
    backend.clear_faults();
    assert_eq!(s.partials_held(), 0);
    micro_batch(&mut s, Gate::ReplicateOff).await.unwrap();
    micro_batch(&mut s, Gate::On).await.unwrap();
    assert_eq!(s.step().await.unwrap().step, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_node_times_out_naming_it_and_the_session_still_drops_promptly() {
    use overlap::executor::Fault;
    use std::time::{Duration, Instant};
    let exec = ExecConfig::default()
        .with_host_timeout(Duration::from_millis(200))
        .with_fault(Some(
            Fault::parse("rank=1,kind=stage1,step=1,mode=hang").unwrap(),
        ));
    let backend = Arc::new(CpuBackend::new(Mesh::new(2, 1).unwrap()));
    let mut s = Session::new(spec(2, 1), backend, exec).unwrap();
    let t0 = Instant::now();
    // Backpressure inside grad_ready or the step's drain: either gives up at the deadline.
    let err = match micro_batch(&mut s, Gate::On).await {
        Err(e) => e,
        Ok(()) => s.step().await.unwrap_err(),
    };
    let took = t0.elapsed();
    let Error::Exec(ExecError::Timeout {
        seconds,
        step,
        stalled,
    }) = &err
    else {
        panic!("expected a timeout, got {err}")
    };
    // The first step gets 3 × the timeout.
    assert_eq!((*step, *seconds), (1, 0.6), "{err}");
    assert!(
        stalled.iter().any(|s| s.rank == 1
            && s.running
            && s.label.starts_with("stage1")
            && s.label.contains("a hang injected by OVERLAP_FAULT")),
        "{err}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    // The device may still run the step: the session refuses more work.
    let again = micro_batch(&mut s, Gate::On).await.unwrap_err();
    assert!(again.to_string().contains("timed-out step"), "{again}");
    // Dropping it ends the hung spin (the CPU backend sleeps long spins in slices).
    let t1 = Instant::now();
    drop(s);
    assert!(t1.elapsed() < Duration::from_secs(5), "{:?}", t1.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffers_are_reused_across_steps() {
    let (mut s, _) = session(2, 2);
    let gates = [Gate::ReplicateOff, Gate::On];
    // Distinct transient buffers (gradients, send, Stage-1 and Stage-2 outputs) one step
    // uses per rank: allocating per micro-batch would exceed this within two steps.
    let plan = s.step_plan(&gates).unwrap();
    let per_step: Vec<usize> = plan
        .ranks
        .iter()
        .map(|rp| {
            let mut bufs: Vec<_> = rp
                .nodes
                .iter()
                .flat_map(|n| plan.access(rp.rank, n).writes)
                .filter(|b| b.is_transient())
                .collect();
            bufs.sort();
            bufs.dedup();
            bufs.len()
        })
        .collect();
    for _ in 0..6 {
        for gate in gates {
            micro_batch(&mut s, gate).await.unwrap();
        }
        s.step().await.unwrap();
    }
    for (rank, pooled) in s.plan_cache().pooled_buffers {
        assert!(
            pooled <= per_step[rank as usize],
            "rank {rank}: {pooled} pooled buffers after 6 steps, one step uses {}",
            per_step[rank as usize]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backpressure_window_bounds_stage1_buffers_in_flight() {
    for window in [1usize, 2, 3] {
        let spec = spec(2, 2).with_bucket_cap_bytes(16); // one bucket per parameter
        let backend = Arc::new(CpuBackend::new(spec.mesh));
        let exec = ExecConfig::default().with_stage1_window(window);
        let mut s = Session::new(spec, backend, exec).unwrap();
        micro_batch(&mut s, Gate::ReplicateOff).await.unwrap();
        micro_batch(&mut s, Gate::On).await.unwrap();
        let r = s.step().await.unwrap();
        assert_eq!(r.stats.stage1_in_flight_peak, window, "window {window}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_are_prepared_once_and_reused_across_steps() {
    let (mut s, _) = session(2, 2);
    for _ in 0..3 {
        micro_batch(&mut s, Gate::ReplicateOff).await.unwrap();
        micro_batch(&mut s, Gate::On).await.unwrap();
        s.step().await.unwrap();
    }
    // The first step ran its micro-batches on two plans planned ahead (`off,off`, then
    // `off,on,off,on` when the second gate was not the guess) and the step `off,on`;
    // later steps run on the step plan and prepare nothing.
    assert_eq!(s.plans_built(), 3);
    assert_eq!(s.plan_cache().prepared, 3);
    // Only the step plan stays prepared: the session let go of the others.
    assert_eq!(s.plan_cache().held, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_deadline_is_readable_from_other_threads_during_a_step_only() {
    let (mut s, _) = session(2, 2);
    let deadline = s.step_deadline();
    assert_eq!(deadline.get(), None);
    s.begin_micro_batch(Gate::On).await.unwrap();
    let during = std::thread::spawn(move || deadline.get()).join().unwrap();
    let d = during.expect("a step is in progress");
    // The first step's deadline: three times the step timeout (300 s by default).
    let left = d.saturating_duration_since(std::time::Instant::now());
    assert!(left > std::time::Duration::from_secs(800), "{left:?}");
    for layer in s.layers() {
        s.grad_ready(layer, |_, _, out| out.fill(0.5))
            .await
            .unwrap();
    }
    s.step().await.unwrap();
    assert_eq!(s.step_deadline().get(), None);
    micro_batch(&mut s, Gate::On).await.unwrap();
    let left = s
        .step_deadline()
        .get()
        .unwrap()
        .saturating_duration_since(std::time::Instant::now());
    assert!(left <= std::time::Duration::from_secs(300), "{left:?}");
    s.zero_grad().await.unwrap();
    assert_eq!(s.step_deadline().get(), None);
}

/// The internals' accessors are deprecated for one release: they still answer, and
/// what replaces each answers the same.
#[test]
#[allow(deprecated)]
fn deprecated_internals_answer_as_their_replacements() {
    let (s, backend) = session(2, 2);
    assert_eq!(s.planner().params(), s.params());
    assert_eq!(s.planner().spec(), s.spec());
    assert_eq!(s.planner().buckets(), s.buckets());
    assert!(Arc::ptr_eq(s.executor().backend(), s.backend()));
    assert!(Arc::ptr_eq(s.backend(), &backend));
    assert_eq!(s.executor().steps_done(), s.steps_done());
    for p in 0..s.params().len() as u32 {
        assert_eq!(s.hyper().group_of(p), s.param_group(p));
    }
}
