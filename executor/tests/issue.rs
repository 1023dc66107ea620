//! The executor's issuing invariants, on the CPU backend: a plan is prepared once however
//! often it is adopted, and the preparations nobody can adopt again go; the Stage-1
//! window bounds the buffers in flight without changing a result; transient buffers
//! return to a pool that stays bounded; discarding a step drops its partials and
//! accumulations and leaves no trace in the next step.

mod common;

use common::{bits, spec, Rig};
use overlap_executor::ExecConfig;
use overlap_graph::{Buffer, Gate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_adopted_in_many_steps_is_prepared_once() {
    let mut rig = Rig::new(spec(2, 1, 3), ExecConfig::default());
    let one = rig.plan(&[Gate::On]);
    for _ in 0..3 {
        rig.step(&one).await.expect("step");
    }
    assert_eq!(rig.exec.plans_prepared(), 1);
    // Adopting the plan already adopted in the same step costs nothing either.
    rig.exec.adopt(&one);
    rig.exec.adopt(&one);
    rig.micro_batch(0).await.expect("micro-batch");
    rig.exec.finish_step().await.expect("step");
    assert_eq!(rig.exec.plans_prepared(), 1);
    // Another plan is prepared once too, and both stay cached while the caller holds
    // them.
    let two = rig.plan(&[Gate::NoSync, Gate::On]);
    for plan in [&two, &one, &two] {
        rig.step(plan).await.expect("step");
    }
    assert_eq!(rig.exec.plans_prepared(), 2);
    assert_eq!(rig.exec.prepared_plans(), 2);
    assert_eq!(rig.exec.steps_done(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_the_caller_let_go_of_is_dropped_at_the_step_end() {
    let mut rig = Rig::new(spec(2, 1, 3), ExecConfig::default());
    let kept = rig.plan(&[Gate::On]);
    rig.step(&kept).await.expect("step");
    let dropped = rig.plan(&[Gate::On, Gate::On]);
    rig.step(&dropped).await.expect("step");
    assert_eq!(rig.exec.prepared_plans(), 2);
    drop(dropped);
    rig.step(&kept).await.expect("step");
    assert_eq!(rig.exec.prepared_plans(), 1);
    assert_eq!(rig.exec.plans_prepared(), 2);
}

/// One step of two micro-batches with a window, the most Stage-1 buffers in flight and
/// the parameters after it.
async fn windowed(window: usize) -> (usize, Vec<Option<Vec<u32>>>) {
    let cfg = ExecConfig::default().with_stage1_window(window);
    let mut rig = Rig::new(spec(2, 2, 6), cfg);
    let plan = rig.plan(&[Gate::On, Gate::On]);
    let stats = rig.step(&plan).await.expect("step");
    (stats.stage1_in_flight_peak, bits(&rig.params()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stage1_window_bounds_buffers_in_flight_and_changes_no_result() {
    let (unbounded, want) = windowed(1 << 10).await;
    // Six layers, a bucket each (the top one with two parameters of other routes),
    // two micro-batches: without a bound every pack's buffers stay counted.
    assert!(unbounded > 4, "{unbounded} packs in flight");
    for window in [1, 2, 3] {
        let (peak, got) = windowed(window).await;
        assert!(peak <= window, "window {window}: {peak} in flight");
        assert!(peak >= 1, "window {window}");
        assert_eq!(got, want, "window {window} changed the parameters");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_buffers_return_to_a_bounded_pool() {
    let mut rig = Rig::new(spec(2, 2, 4), ExecConfig::default());
    let plan = rig.plan(&[Gate::NoSync, Gate::On]);
    let mut pooled = Vec::new();
    for _ in 0..10 {
        rig.step(&plan).await.expect("step");
        pooled.push(rig.exec.pooled_buffers());
    }
    assert!(pooled[0].iter().all(|&(_, n)| n > 0), "{pooled:?}");
    // Every step takes what earlier ones gave back. A buffer whose release is still
    // pending when a take looks may make the pool grow, by at most what one step
    // takes (`RankState::take`), so the pool stays bounded however many steps run,
    // whatever the timing: a leak would grow it by a step's buffers every step.
    for (first, later) in pooled[0].iter().zip(&pooled[9]) {
        assert_eq!(first.0, later.0);
        assert!(later.1 <= 2 * first.1, "{pooled:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_drops_partials_and_accumulations_and_leaves_no_trace() {
    // NoSync fills accumulations; ReplicateOff (on a replicate group of 2) partials.
    for (gates, shard, replicate) in [
        ([Gate::NoSync, Gate::On], 2, 1),
        ([Gate::ReplicateOff, Gate::On], 1, 2),
    ] {
        let what = format!("{gates:?} on {shard}x{replicate}");
        let mut fresh = Rig::new(spec(shard, replicate, 3), ExecConfig::default());
        let mut rig = Rig::new(spec(shard, replicate, 3), ExecConfig::default());
        let plan = rig.plan(&gates);
        rig.exec.adopt(&plan);
        rig.micro_batch(0).await.expect("micro-batch");
        assert!(rig.exec.step_buffers_held() > 0, "{what}");
        assert!(rig.exec.in_step(), "{what}");
        rig.exec.discard().await.expect("discard");
        assert_eq!(rig.exec.step_buffers_held(), 0, "{what}");
        assert!(!rig.exec.in_step(), "{what}");
        assert_eq!(rig.exec.steps_done(), 0, "{what}");
        for rank in rig.exec.local_ranks() {
            let reduced = rig.exec.read(rank, Buffer::Reduced { param: 0 }).unwrap();
            assert_eq!(reduced, None, "{what}");
        }
        // The next step is the step a fresh executor runs, bit for bit.
        rig.step(&plan).await.expect("step");
        let plan = fresh.plan(&gates);
        fresh.step(&plan).await.expect("step");
        assert_eq!(bits(&rig.params()), bits(&fresh.params()), "{what}");
        assert_eq!(rig.exec.step_buffers_held(), 0, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_between_steps_is_a_no_op() {
    let mut rig = Rig::new(spec(2, 1, 2), ExecConfig::default());
    let plan = rig.plan(&[Gate::On]);
    rig.step(&plan).await.expect("step");
    let before = bits(&rig.params());
    rig.exec.discard().await.expect("discard");
    assert_eq!(bits(&rig.params()), before);
    assert_eq!(rig.exec.steps_done(), 1);
    rig.step(&plan).await.expect("a step after the discard");
    assert_eq!(rig.exec.steps_done(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_of_optimizers_is_bound_once_and_again_after_a_write() {
    // Mesh 1x1: one rank, its optimizers in rows on one stream.
    let mut rig = Rig::new(spec(1, 1, 3), ExecConfig::default());
    let plan = rig.plan(&[Gate::On]);
    rig.step(&plan).await.expect("step");
    let rows = rig.exec.optimizer_rows_bound();
    assert!(rows > 0, "no row of optimizers was bound");
    for _ in 0..3 {
        rig.step(&plan).await.expect("step");
    }
    assert_eq!(
        rig.exec.optimizer_rows_bound(),
        rows,
        "kept rows were bound again"
    );
    // A parameter written between steps is the one the next step updates: the row is
    // bound again (a row still holding the old buffer would leave the new one as
    // written).
    let params = rig.params();
    let written: Vec<f32> = params[0]
        .as_ref()
        .expect("rank 0 holds param 0")
        .iter()
        .map(|x| x + 100.0)
        .collect();
    rig.exec
        .write(0, Buffer::Param { param: 0 }, &written)
        .expect("write");
    rig.step(&plan).await.expect("step");
    assert_eq!(rig.exec.optimizer_rows_bound(), 2 * rows);
    let after = rig.params()[0].clone().expect("param 0");
    assert_ne!(after, written, "the written parameter was not updated");
    assert!(after.iter().zip(&written).all(|(a, w)| (a - w).abs() < 1.0));
    // And the same plan again keeps the new row; steps alternating with another plan
    // keep the rows of both.
    rig.step(&plan).await.expect("step");
    assert_eq!(rig.exec.optimizer_rows_bound(), 2 * rows);
    let other = rig.plan(&[Gate::NoSync, Gate::On]);
    rig.step(&other).await.expect("step");
    let both = rig.exec.optimizer_rows_bound();
    assert!(both > 2 * rows);
    for p in [&plan, &other, &plan, &other] {
        rig.step(p).await.expect("step");
    }
    assert_eq!(rig.exec.optimizer_rows_bound(), both);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_let_go_of_leaves_no_kept_row_holding_it() {
    // Mesh 1x1, whose optimizers run in rows the executor keeps.
    let mut rig = Rig::new(spec(1, 1, 3), ExecConfig::default());
    let kept = rig.plan(&[Gate::On]);
    let dropped = rig.plan(&[Gate::On, Gate::On]);
    rig.step(&dropped).await.expect("step");
    assert!(rig.exec.optimizer_rows_bound() > 0);
    let weak = std::sync::Arc::downgrade(dropped.plan());
    drop(dropped);
    rig.step(&kept).await.expect("step");
    rig.step(&kept).await.expect("step");
    assert!(weak.upgrade().is_none(), "a plan let go of is still held");
}
