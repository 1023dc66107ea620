//! How a step fails, on the CPU backend: a kernel that fails on a stream fails the step
//! with an error naming its rank, stream and node, and the executor runs the next step;
//! a step past its deadline names what was still running and the executor refuses
//! further work; another rank's failure ends a step's waits at once, with the same
//! refusal; the API used out of order
//! is a usage error that says what comes next.

mod common;

use std::time::{Duration, Instant};

use common::{spec, Rig};
use overlap_executor::{ExecConfig, ExecError, Fault, FaultMode, PeerFailure, FAULT_OP, FAULT_VAR};
use overlap_graph::{Gate, Op};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_failing_on_a_stream_fails_the_step_naming_its_node() {
    let mut rig = Rig::new(spec(2, 1, 3), ExecConfig::default());
    let plan = rig.plan(&[Gate::On]);
    rig.exec.backend().inject_fault(1, "unpack");
    let err = rig.step(&plan).await.expect_err("the unpack fails");
    let ExecError::Step { failures } = &err else {
        panic!("{err}");
    };
    // The root cause only: what the failure cancelled is not reported.
    assert_eq!(failures.len(), 1, "{err}");
    let f = &failures[0];
    let node = &plan.plan().rank(1).nodes[f.node as usize];
    assert!(matches!(node.op, Op::Unpack { .. }), "{err}");
    assert_eq!((f.rank, f.stream), (1, node.stream), "{err}");
    assert_eq!(f.label, plan.plan().label(node));
    assert!(err.to_string().contains(&f.label), "{err}");
    // The failed step changed nothing, and the executor goes on.
    assert_eq!(rig.exec.steps_done(), 0);
    assert!(!rig.exec.in_step());
    assert_eq!(rig.exec.step_buffers_held(), 0);
    rig.step(&plan).await.expect("the next step");
    assert_eq!(rig.exec.steps_done(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_failure_is_named_as_injected_and_fires_once() {
    let fault = Fault::new(0, "stage1", 2, FaultMode::Fail).unwrap();
    let cfg = ExecConfig::default().with_fault(Some(fault));
    let mut rig = Rig::new(spec(2, 1, 3), cfg);
    let plan = rig.plan(&[Gate::On]);
    rig.step(&plan).await.expect("step 1 has no fault");
    let err = rig.step(&plan).await.expect_err("step 2 fails");
    let ExecError::Step { failures } = &err else {
        panic!("{err}");
    };
    let f = &failures[0];
    let node = &plan.plan().rank(0).nodes[f.node as usize];
    assert_eq!(f.rank, 0, "{err}");
    assert!(matches!(node.op, Op::Stage1 { .. }), "{err}");
    assert!(f.label.contains(FAULT_VAR), "{err}");
    rig.step(&plan).await.expect("the fault fires once");
    assert_eq!(rig.exec.steps_done(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_past_its_deadline_names_the_running_node_and_breaks_the_executor() {
    let timeout = Duration::from_millis(100);
    let cfg = ExecConfig::default()
        .with_host_timeout(timeout)
        .with_fault(Some(Fault::new(1, "pack", 1, FaultMode::Hang).unwrap()));
    let mut rig = Rig::new(spec(2, 1, 2), cfg);
    assert_eq!(
        rig.exec.step_timeout(),
        timeout * 3,
        "the first step gets 3x"
    );
    let plan = rig.plan(&[Gate::On]);
    let t0 = Instant::now();
    let err = rig.step(&plan).await.expect_err("the step hangs");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    let ExecError::Timeout { step, stalled, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(*step, 1);
    // The hang on rank 1, and rank 0 in the collective that waits for rank 1's pack.
    let hung: Vec<_> = stalled
        .iter()
        .filter(|s| s.running && s.label.contains(FAULT_VAR))
        .collect();
    assert_eq!(hung.len(), 1, "{err}");
    assert_eq!(hung[0].rank, 1, "{err}");
    let node = &plan.plan().rank(1).nodes[hung[0].node.unwrap() as usize];
    assert!(matches!(node.op, Op::Pack { .. }), "{err}");
    assert_eq!(hung[0].stream, node.stream, "{err}");
    assert!(stalled.iter().any(|s| s.rank == 0), "{err}");
    // The device may still run the step: nothing more is issued.
    let again = rig
        .step(&plan)
        .await
        .expect_err("a broken executor refuses");
    assert!(matches!(again, ExecError::Usage(_)), "{again}");
    assert!(matches!(rig.exec.discard().await, Err(ExecError::Usage(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_ranks_failure_ends_a_waiting_step_at_once_and_breaks_the_executor() {
    // Rank 1 hangs in its first pack, so the step would wait for its deadline (15 min).
    let cfg =
        ExecConfig::default().with_fault(Some(Fault::new(1, "pack", 2, FaultMode::Hang).unwrap()));
    let mut rig = Rig::new(spec(2, 1, 2), cfg);
    let plan = rig.plan(&[Gate::On]);
    rig.step(&plan).await.expect("step 1 has no fault");
    let failure = PeerFailure {
        rank: 5,
        reason: "out of memory".into(),
    };
    // Reported from another thread, as a job watcher does; whether it comes before the
    // step waits or while it waits, the step ends with it.
    let abort = rig.exec.peer_abort();
    let reported = failure.clone();
    let watcher = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        abort.trigger(reported)
    });
    let t0 = Instant::now();
    let err = rig.step(&plan).await.expect_err("the job failed");
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    assert!(watcher.join().unwrap(), "the first failure reported");
    // The other rank's error, then what this executor's ranks were still running: the
    // hang here may be why the other rank failed.
    assert!(
        matches!(&err, ExecError::PeerFailed { rank: 5, reason }
            if reason.starts_with("out of memory; this rank was still busy: ")
                && reason.contains("a hang injected by OVERLAP_FAULT")),
        "{err}"
    );
    assert!(matches!(
        rig.exec.finish_step().await,
        Err(ExecError::Usage(_))
    ));
    assert_eq!(rig.exec.steps_done(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_out_of_order_is_a_usage_error_saying_what_comes_next() {
    let mut rig = Rig::new(spec(2, 1, 3), ExecConfig::default());
    let plan = rig.plan(&[Gate::On]);
    // Before any plan was adopted.
    let err = rig.exec.grad_ready(0, 2, |_, _, _| {}).await.unwrap_err();
    assert!(
        matches!(&err, ExecError::Usage(m) if m.contains("before a micro-batch")),
        "{err}"
    );
    rig.exec.adopt(&plan);
    // Layers come from the highest down.
    let err = rig.exec.grad_ready(0, 0, |_, _, _| {}).await.unwrap_err();
    assert!(
        matches!(&err, ExecError::Usage(m) if m.contains("grad_ready(layer 0)") && m.contains("expects")),
        "{err}"
    );
    // Step-wide settings are refused during a step.
    assert!(matches!(
        rig.exec.set_lr_factor(Some(0.5)),
        Err(ExecError::Usage(_))
    ));
    assert!(matches!(
        rig.exec.set_steps_done(3),
        Err(ExecError::Usage(_))
    ));
    rig.micro_batch(0).await.expect("the layers in order");
    rig.exec.finish_step().await.expect("step");
    rig.exec.set_lr_factor(Some(0.5)).expect("between steps");
    assert_eq!(rig.exec.lr_factor(), 0.5);
    assert!(matches!(
        rig.exec.set_lr_factor(Some(f64::NAN)),
        Err(ExecError::Usage(_))
    ));
}

#[test]
fn the_fault_tag_is_not_a_node_kind() {
    assert!(!Op::KINDS.contains(&FAULT_OP));
}
