//! Parameter groups and learning-rate schedules: a group changes exactly the parameters
//! it gets (first match wins), every optimizer launch uses its parameter's settings and
//! the step's rate, and the report, the metrics and `overlap verify` agree.

use std::path::Path;
use std::sync::Arc;

use overlap::executor::{ExecConfig, LrSchedule, ParamGroup, ScheduleKind};
use overlap::graph::OptimizerKind;
use overlap::ops::cpu::CpuBackend;
use overlap::ops::{math, AdamwParams, MuonParams};
use overlap::{Config, Error, Gate, Mesh, ParamSpec, PlanSpec, Route, Session};

const BASE: &str = r#"
[mesh]
shard = 2
replicate = 2
[[param]]
name = "w"
shape = [6, 5]
route = "muon"
layer = 2
[[param]]
name = "norm"
shape = [9]
route = "fsdp"
layer = 2
[[param]]
name = "bias"
shape = [7]
route = "adamw"
layer = 1
[[param]]
name = "emb"
shape = [11, 3]
route = "sharded_adamw"
layer = 0
[optimizer.adamw]
lr = 0.01
weight_decay = 0.1
[optimizer.muon]
lr = 0.02
weight_decay = 0.05
"#;

fn config(rest: &str) -> Config {
    Config::from_toml(&format!("{BASE}{rest}"), "groups.toml").unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Every local rank's piece of every parameter: `[param][rank]`.
fn values(s: &Session<CpuBackend>) -> Vec<Vec<Option<Vec<f32>>>> {
    let n = s.params().len() as u32;
    (0..n)
        .map(|p| {
            s.local_ranks()
                .into_iter()
                .map(|r| s.param_values(r, p).unwrap())
                .collect()
        })
        .collect()
}

/// One step of `gates` with every gradient `g`.
async fn step_with(s: &mut Session<CpuBackend>, g: f32) -> Result<overlap::StepReport, Error> {
    s.begin_micro_batch(Gate::On).await?;
    for layer in s.layers() {
        s.grad_ready(layer, |_, _, out| out.fill(g)).await?;
    }
    s.step().await
}

/// What decoupled weight decay alone does to a value (a zero gradient moves nothing
/// else): the kernels' arithmetic, `p · (1 − lr·wd)` in f64 rounded once, with `lr` the
/// f32 the kernel gets.
fn decayed(p: f32, lr: f64, wd: f32) -> f32 {
    let lr = f64::from(lr as f32);
    (f64::from(p) * (1.0 - lr * f64::from(wd))) as f32
}

/// Asserts that parameter `param` went from `before` to `after` by weight decay at `lr`
/// and `wd` (unchanged when `lr · wd` is 0), on every rank holding it.
#[track_caller]
fn assert_decayed(
    before: &[Option<Vec<f32>>],
    after: &[Option<Vec<f32>>],
    lr: f64,
    wd: f32,
    what: &str,
) {
    let mut held = 0;
    for (b, a) in before.iter().zip(after) {
        let (Some(b), Some(a)) = (b, a) else {
            assert_eq!(b.is_some(), a.is_some(), "{what}");
            continue;
        };
        held += 1;
        let want: Vec<f32> = b.iter().map(|&p| decayed(p, lr, wd)).collect();
        assert_eq!(a, &want, "{what}");
        if lr * f64::from(wd) == 0.0 {
            assert_eq!(a, b, "{what}: must be unchanged");
        } else {
            assert_ne!(a, b, "{what}: must have decayed");
        }
    }
    assert!(held > 0, "{what}: no rank holds it");
}

#[test]
fn a_weight_decay_zero_group_leaves_norms_and_biases_undecayed_and_decays_the_rest_by_lr_wd() {
    let cfg = config(
        "[[optimizer.group]]\nmatch = \"norm*\"\nweight_decay = 0\n\
         [[optimizer.group]]\nmatch = \"*bias\"\nweight_decay = 0\n",
    );
    runtime().block_on(async {
        let mut s = Session::cpu(&cfg).unwrap();
        let before = values(&s);
        step_with(&mut s, 0.0).await.unwrap();
        let after = values(&s);
        // w (muon), norm (group 0), bias (group 1), emb (base adamw).
        assert_decayed(&before[0], &after[0], 0.02f32.into(), 0.05, "w");
        assert_decayed(&before[1], &after[1], 0.01f32.into(), 0.0, "norm");
        assert_decayed(&before[2], &after[2], 0.01f32.into(), 0.0, "bias");
        assert_decayed(&before[3], &after[3], 0.01f32.into(), 0.1, "emb");
    });
}

#[test]
fn the_first_matching_group_wins() {
    // `w` matches both groups: the first one's decay applies, not the second's 0.
    let cfg = config(
        "[[optimizer.group]]\nmatch = \"w\"\nweight_decay = 0.5\nlr_scale = 2\n\
         [[optimizer.group]]\nmatch = \"*\"\nweight_decay = 0\n",
    );
    runtime().block_on(async {
        let mut s = Session::cpu(&cfg).unwrap();
        let groups: Vec<Option<usize>> = (0..s.params().len() as u32)
            .map(|p| s.param_group(p))
            .collect();
        assert_eq!(groups, [Some(0), Some(1), Some(1), Some(1)]);
        let before = values(&s);
        step_with(&mut s, 0.0).await.unwrap();
        let after = values(&s);
        assert_decayed(&before[0], &after[0], f64::from(0.02f32) * 2.0, 0.5, "w");
        for p in 1..4 {
            assert_decayed(&before[p], &after[p], 0.01f32.into(), 0.0, "group 1");
        }
    });
}

#[test]
fn newton_schulz_runs_in_bf16_unless_the_base_or_a_group_says_otherwise() {
    let cfg = config("[[optimizer.group]]\nmatch = \"w\"\nns_dtype = \"tf32\"\n");
    assert_eq!(cfg.muon.ns_dtype, overlap::NsDtype::Bf16);
    assert_eq!(cfg.groups[0].ns_dtype, Some(overlap::NsDtype::Tf32));
    let base = Config::from_toml(
        &BASE.replace("[optimizer.muon]", "[optimizer.muon]\nns_dtype = \"f32\""),
        "<inline>",
    )
    .unwrap();
    assert_eq!(base.muon.ns_dtype, overlap::NsDtype::F32);
}

#[test]
fn each_parameters_newton_schulz_is_what_its_group_gives_it() {
    use overlap::NsDtype::{Bf16, Tf32, F32};
    let cfg = config(
        "[[optimizer.group]]\nmatch = \"w\"\nns_dtype = \"tf32\"\nns_steps = 3\n\
         [[optimizer.group]]\nmatch = \"emb\"\nns_dtype = \"f32\"\n",
    );
    // By parameter id: w (its group), norm and bias (the base), emb (its group).
    assert_eq!(
        cfg.newton_schulz(),
        vec![(Tf32, 3), (Bf16, 5), (Bf16, 5), (F32, 5)]
    );
}

#[test]
fn a_groups_ns_steps_and_momentum_reach_the_muon_kernel() {
    let cfg = config("[[optimizer.group]]\nmatch = \"w\"\nns_steps = 1\nmomentum = 0.5\n");
    runtime().block_on(async {
        let mut s = Session::cpu(&cfg).unwrap();
        let before = values(&s);
        step_with(&mut s, 0.25).await.unwrap();
        let after = values(&s);
        let rank = (0..4)
            .find(|&r| before[0][r].is_some())
            .expect("an owner holds w");
        let g = s.reduced_grad(rank as u32, 0).unwrap().unwrap();
        let expect = |ns_steps, momentum| {
            let mut p = before[0][rank].clone().unwrap();
            let mut buf = vec![0.0; p.len()];
            let hp = MuonParams::default()
                .with_lr(0.02)
                .with_momentum(momentum)
                .with_ns_steps(ns_steps)
                .with_weight_decay(0.05);
            math::muon(&mut p, &g, &mut buf, 6, 5, &hp);
            p
        };
        assert_eq!(after[0][rank].as_ref().unwrap(), &expect(1, 0.5));
        assert_ne!(expect(1, 0.5), expect(5, 0.95), "the group must matter");
    });
}

fn spec() -> PlanSpec {
    PlanSpec::new(
        Mesh::new(2, 1).unwrap(),
        vec![
            ParamSpec::new("w", [4, 3], Route::Muon, 1),
            ParamSpec::new("norm", [5], Route::Fsdp, 0),
        ],
    )
    .with_bucket_cap_bytes(1 << 20)
}

#[test]
fn a_code_built_session_rejects_a_group_that_gets_no_parameter() {
    let backend = Arc::new(CpuBackend::new(Mesh::new(2, 1).unwrap()));
    let exec = ExecConfig::default().with_groups(vec![ParamGroup::new("*.nrom")]);
    let e = Session::new(spec(), backend.clone(), exec)
        .err()
        .expect("a group matching nothing is refused");
    assert!(matches!(e, Error::Usage(_)), "{e}");
    assert!(
        e.to_string().contains("`*.nrom` matches no parameter"),
        "{e}"
    );
    let mut bad = ParamGroup::new("norm");
    bad.eps = Some(0.0);
    let exec = ExecConfig::default().with_groups(vec![bad]);
    let e = Session::new(spec(), backend, exec).err().unwrap();
    assert!(
        e.to_string().contains("`eps`: must be a finite number > 0"),
        "{e}"
    );
}

#[test]
fn set_lr_factor_takes_effect_on_the_next_step_and_the_report_carries_it() {
    let backend = Arc::new(CpuBackend::new(Mesh::new(2, 1).unwrap()));
    let mut norm = ParamGroup::new("norm");
    norm.lr_scale = 0.5;
    let exec = ExecConfig::default()
        .with_adamw(AdamwParams::default().with_lr(0.1).with_weight_decay(0.2))
        .with_muon(MuonParams::default().with_lr(0.05).with_weight_decay(0.4))
        .with_groups(vec![norm])
        .with_schedule(LrSchedule::constant().with_warmup(4));
    runtime().block_on(async {
        let mut s = Session::new(spec(), backend, exec).unwrap();
        s.init_params(|i, p| {
            (0..p.spec.numel())
                .map(|k| 1.0 + i as f32 + k as f32 * 0.125)
                .collect()
        })
        .unwrap();
        // Step 1 follows the schedule: warm-up factor 1/4.
        assert_eq!(s.lr_factor(), 0.25);
        let mut before = values(&s);
        let r = step_with(&mut s, 0.0).await.unwrap();
        assert_eq!(r.lr_factor, 0.25);
        let after = values(&s);
        assert_decayed(
            &before[0],
            &after[0],
            f64::from(0.05f32) * 0.25,
            0.4,
            "w, step 1",
        );
        assert_decayed(
            &before[1],
            &after[1],
            f64::from(0.1f32) * 0.5 * 0.25,
            0.2,
            "norm, step 1",
        );
        let rates: Vec<(&str, OptimizerKind, f64)> =
            r.lr.iter()
                .map(|g| (g.label.as_str(), g.optimizer, g.lr))
                .collect();
        assert_eq!(
            rates,
            vec![
                ("norm", OptimizerKind::Adamw, f64::from(0.1f32) * 0.5 * 0.25),
                ("base", OptimizerKind::Muon, f64::from(0.05f32) * 0.25),
            ]
        );

        // The trainer's factor replaces the schedule from the next step on.
        s.set_lr_factor(2.0).unwrap();
        assert_eq!(s.lr_factor(), 2.0);
        before = after;
        let r = step_with(&mut s, 0.0).await.unwrap();
        assert_eq!(r.lr_factor, 2.0);
        let after = values(&s);
        assert_decayed(
            &before[0],
            &after[0],
            f64::from(0.05f32) * 2.0,
            0.4,
            "w, step 2",
        );
        assert_decayed(
            &before[1],
            &after[1],
            f64::from(0.1f32) * 0.5 * 2.0,
            0.2,
            "norm, step 2",
        );

        // A factor of 0 freezes every parameter.
        s.set_lr_factor(0.0).unwrap();
        before = after;
        step_with(&mut s, 0.0).await.unwrap();
        assert_eq!(values(&s), before);

        // Not during a step, and never negative or NaN.
        s.begin_micro_batch(Gate::On).await.unwrap();
        assert!(matches!(s.set_lr_factor(1.0), Err(Error::Usage(_))));
        s.zero_grad().await.unwrap();
        assert!(s.set_lr_factor(-1.0).is_err());
        assert!(s.set_lr_factor(f64::NAN).is_err());

        // Back to the schedule: step 4 is the warm-up's last, factor 1.
        s.follow_schedule().unwrap();
        let r = step_with(&mut s, 0.0).await.unwrap();
        assert_eq!((r.step, r.lr_factor), (4, 1.0));
    });
}

#[cfg(feature = "metrics")]
#[test]
fn a_configured_schedule_sets_each_steps_rate_in_the_report_and_the_metrics() {
    let cfg = config(
        "[[optimizer.group]]\nmatch = \"bias\"\nlr_scale = 3\n\
         [schedule]\nkind = \"linear\"\nwarmup_steps = 2\ntotal_steps = 4\nfinal_lr_frac = 0.5\n",
    );
    // The documented formula: t/W in the warm-up, then 1 − (1 − r)·(t − W)/(T − W), then r.
    let want = [0.5, 1.0, 0.75, 0.5, 0.5];
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    ::metrics::with_local_recorder(&recorder, || {
        overlap::observe::metrics::enable();
        runtime().block_on(async {
            let mut s = Session::cpu(&cfg).unwrap();
            for (step, &f) in want.iter().enumerate() {
                let r = overlap::drive::synthetic_step(&mut s, 1, step as u64, &[Gate::On])
                    .await
                    .unwrap();
                assert_eq!(r.lr_factor, f, "step {}", step + 1);
                let bias = r.lr.iter().find(|g| g.label == "bias").unwrap();
                assert_eq!(bias.lr, f64::from(0.01f32) * 3.0 * f);
                let base_muon =
                    r.lr.iter()
                        .find(|g| g.label == "base" && g.optimizer == OptimizerKind::Muon)
                        .unwrap();
                assert_eq!(base_muon.lr, f64::from(0.02f32) * f);
            }
        });
    });
    let text = handle.render();
    let line = |labels: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("overlap_learning_rate{{{labels}}} ")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no overlap_learning_rate{{{labels}}} in\n{text}"))
    };
    assert_eq!(
        line("group=\"bias\",optimizer=\"adamw\""),
        f64::from(0.01f32) * 3.0 * 0.5
    );
    assert_eq!(
        line("group=\"base\",optimizer=\"muon\""),
        f64::from(0.02f32) * 0.5
    );
}

#[test]
fn the_example_with_groups_and_a_schedule_verifies() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/groups_schedule_2x2.toml");
    let cfg = Config::from_file(&path).unwrap();
    assert_eq!(cfg.groups.len(), 4);
    assert_eq!(cfg.schedule.kind, ScheduleKind::Cosine);
    let report = runtime()
        .block_on(overlap::verify::verify(&cfg, 6, 3, |_| {}))
        .unwrap();
    assert!(report.ok, "{report:?}");
    assert_eq!(report.partials_left, 0);
}

#[test]
fn an_executor_used_directly_resolves_its_groups_from_the_first_plan() {
    use overlap::executor::{ExecError, Executor};
    let planner = overlap::graph::Planner::new(spec()).unwrap();
    let plan = planner
        .plan_checked(&[Gate::On], overlap::graph::Mode::Step)
        .unwrap();
    let backend = Arc::new(CpuBackend::new(Mesh::new(2, 1).unwrap()));
    let exec = |pattern: &str| ExecConfig::default().with_groups(vec![ParamGroup::new(pattern)]);
    runtime().block_on(async {
        let mut ex = Executor::new(backend.clone(), exec("no*"));
        ex.adopt(&plan);
        assert_eq!(ex.hyper().group_of(1), Some(0));
        assert_eq!(ex.hyper().group_of(0), None);
        ex.discard().await.unwrap();

        // A group that gets nothing fails the hand-in before any node is issued.
        let mut ex = Executor::new(backend.clone(), exec("bias"));
        ex.adopt(&plan);
        let e = ex
            .grad_ready(0, 1, |_, _, out| out.fill(0.0))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, ExecError::Usage(m) if m.contains("`bias` matches no parameter")),
            "{e}"
        );
        assert!(ex.finish_step().await.is_err());
    });
}
