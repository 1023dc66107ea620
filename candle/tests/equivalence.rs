//! The data-parallel equivalence: a candle model trained by `overlap` on S×R ranks × M
//! micro-batches equals the same model trained by candle alone on the global batch (every
//! rank's micro-batches together) with candle-nn's own AdamW, and with Muon routes an
//! f64 Muon written here.

#[path = "../examples/gpt/model.rs"]
mod model;

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use model::{Batch, Corpus, GptConfig};
use overlap_candle::overlap::Route;
use overlap_candle::{DataParallel, Error, Rules};

const SEED: u64 = 7;
const LR: f64 = 1e-3;
const WD: f64 = 0.01;
const BATCH: usize = 2;
const TIME: usize = 8;
const MUON_LR: f64 = 0.02;
const MUON_MOMENTUM: f64 = 0.95;

#[derive(Clone, Copy)]
struct Case {
    shard: u32,
    replicate: u32,
    micro: usize,
    steps: u64,
    tied: bool,
    segmented: bool,
    muon: bool,
    forward: bool,
    gates: Option<&'static str>,
}

impl Case {
    fn new(shard: u32, replicate: u32, micro: usize) -> Self {
        Case {
            shard,
            replicate,
            micro,
            steps: 30,
            tied: false,
            segmented: true,
            muon: false,
            forward: false,
            gates: None,
        }
    }

    fn gpt(&self) -> GptConfig {
        GptConfig {
            vocab: corpus().chars.len(),
            context: TIME,
            width: 16,
            heads: 2,
            blocks: 2,
            tied: self.tied,
        }
    }

    fn config(&self) -> String {
        let mut c = format!(
            "[mesh]\nshard = {}\nreplicate = {}\n[accumulation]\nmicro_batches = {}\n",
            self.shard, self.replicate, self.micro
        );
        if let Some(g) = self.gates {
            c = format!(
                "[mesh]\nshard = {}\nreplicate = {}\n[accumulation]\ngates = {g}\n",
                self.shard, self.replicate
            );
        }
        c += &format!("[optimizer.adamw]\nlr = {LR}\nweight_decay = {WD}\n");
        c += &format!("[optimizer.muon]\nlr = {MUON_LR}\nmomentum = {MUON_MOMENTUM}\n");
        if self.forward {
            c += "[forward]\n";
        }
        c
    }

    fn name(&self) -> String {
        format!(
            "mesh {}x{}, {} micro-batches{}{}{}{}",
            self.shard,
            self.replicate,
            self.micro,
            if self.segmented {
                ", segmented"
            } else {
                ", simple"
            },
            if self.tied { ", tied" } else { "" },
            if self.muon { ", muon" } else { "" },
            if self.forward { ", [forward]" } else { "" }
        )
    }
}

fn corpus() -> Corpus {
    Corpus::new(model::CORPUS)
}

/// Each step's mean loss and the final parameters by name.
type Run = (Vec<f64>, HashMap<String, Vec<f32>>);

fn params_of(vars: &candle_nn::VarMap) -> HashMap<String, Vec<f32>> {
    overlap_candle::named_vars(vars)
        .into_iter()
        .map(|(n, v)| {
            let values = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            (n, values)
        })
        .collect()
}

fn is_muon(name: &str, var: &Var) -> bool {
    name.starts_with("blocks.") && var.dims().len() == 2
}

fn train_overlap(case: &Case) -> Result<Run, Error> {
    let dev = Device::Cpu;
    let corpus = corpus();
    let (model, vars) = model::build(case.gpt(), SEED, &dev)?;
    let rules = if case.muon {
        Rules::new().block_matrices(Route::Muon)
    } else {
        Rules::new()
    };
    let mut dp = DataParallel::builder(&vars)
        .config_toml(case.config(), "equivalence.toml")
        .rules(rules)
        .cpu()?;
    let world = f64::from(case.shard * case.replicate);
    let mut curve = Vec::new();
    for step in 0..case.steps {
        let mut loss = 0.0;
        for m in 0..dp.micro_batches() {
            let batches = dp
                .local_ranks()
                .iter()
                .map(|&r| Ok((r, corpus.slice(step, m, r, BATCH, TIME, &dev)?)))
                .collect::<Result<Vec<(u32, Batch)>, Error>>()?;
            if case.segmented {
                let refs: Vec<(u32, &Batch)> = batches.iter().map(|(r, b)| (*r, b)).collect();
                let losses = dp.micro_batch(&model, &refs)?;
                loss += losses.iter().map(|(_, l)| f64::from(*l)).sum::<f64>();
            } else {
                dp.begin_micro_batch()?;
                let losses = batches
                    .iter()
                    .map(|(r, b)| Ok((*r, model.loss(b)?)))
                    .collect::<Result<Vec<(u32, Tensor)>, Error>>()?;
                for (_, l) in &losses {
                    loss += f64::from(l.to_scalar::<f32>()?);
                }
                dp.backward(&losses)?;
            }
        }
        dp.step()?;
        curve.push(loss / (world * dp.micro_batches() as f64));
    }
    if case.forward {
        dp.sync_vars()?;
    }
    Ok((curve, params_of(&vars)))
}

/// candle alone on the global batch: candle-nn's AdamW, and Muon written here in f64.
fn train_reference(case: &Case) -> Result<Run, Error> {
    let dev = Device::Cpu;
    let corpus = corpus();
    let (model, vars) = model::build(case.gpt(), SEED, &dev)?;
    let named = overlap_candle::named_vars(&vars);
    let (muon, adamw): (Vec<_>, Vec<_>) = named
        .into_iter()
        .partition(|(n, v)| case.muon && is_muon(n, v));
    let mut opt = AdamW::new(
        adamw.into_iter().map(|(_, v)| v).collect(),
        ParamsAdamW {
            lr: LR,
            weight_decay: WD,
            ..ParamsAdamW::default()
        },
    )?;
    let mut momentum: Vec<Vec<f64>> = muon
        .iter()
        .map(|(_, v)| vec![0.0; v.elem_count()])
        .collect();
    let micro = case
        .gates
        .map_or(case.micro, |g| g.matches('"').count() / 2);
    let world = case.shard * case.replicate;
    let mut curve = Vec::new();
    for step in 0..case.steps {
        let slices = (0..micro)
            .flat_map(|m| (0..world).map(move |r| (m, r)))
            .map(|(m, r)| corpus.slice(step, m, r, BATCH, TIME, &dev))
            .collect::<candle_core::Result<Vec<Batch>>>()?;
        let global = model::concat(&slices.iter().collect::<Vec<_>>())?;
        let loss = model.loss(&global)?;
        curve.push(f64::from(loss.to_scalar::<f32>()?));
        let grads = loss.backward()?;
        opt.step(&grads)?;
        for ((_, var), buf) in muon.iter().zip(&mut momentum) {
            let g: Vec<f32> = grads
                .get(var.as_tensor())
                .expect("every matrix has a gradient")
                .flatten_all()?
                .to_vec1()?;
            let p: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
            let (rows, cols) = var.as_tensor().dims2()?;
            let next = muon_f64(&p, &g, buf, rows, cols);
            var.set(&Tensor::from_vec(next, (rows, cols), &dev)?)?;
        }
    }
    Ok((curve, params_of(&vars)))
}

/// One Muon step in f64: momentum, Nesterov, five quintic Newton–Schulz iterations on
/// the Frobenius-normalised matrix (on its transpose when it is tall), the update scaled
/// by `0.2·sqrt(max(rows, cols))`.
fn muon_f64(p: &[f32], g: &[f32], buf: &mut [f64], rows: usize, cols: usize) -> Vec<f32> {
    let u: Vec<f64> = buf
        .iter_mut()
        .zip(g)
        .map(|(b, &g)| {
            // The stored momentum is f32, as the optimizer keeps it.
            *b = f64::from((MUON_MOMENTUM * *b + f64::from(g)) as f32);
            f64::from(g) + MUON_MOMENTUM * *b
        })
        .collect();
    // X is m × n with m ≤ n.
    let tall = rows > cols;
    let (m, n) = if tall { (cols, rows) } else { (rows, cols) };
    let at = |i: usize, j: usize| {
        if tall {
            u[j * cols + i]
        } else {
            u[i * cols + j]
        }
    };
    let mut x: Vec<Vec<f64>> = (0..m).map(|i| (0..n).map(|j| at(i, j)).collect()).collect();
    let norm = x.iter().flatten().map(|v| v * v).sum::<f64>().sqrt() + 1e-7;
    x.iter_mut().flatten().for_each(|v| *v /= norm);
    let mul = |a: &Vec<Vec<f64>>, b: &Vec<Vec<f64>>| -> Vec<Vec<f64>> {
        (0..a.len())
            .map(|i| {
                (0..b[0].len())
                    .map(|j| (0..b.len()).map(|k| a[i][k] * b[k][j]).sum())
                    .collect()
            })
            .collect()
    };
    for _ in 0..5 {
        let xt: Vec<Vec<f64>> = (0..n).map(|j| (0..m).map(|i| x[i][j]).collect()).collect();
        let a = mul(&x, &xt);
        let aa = mul(&a, &a);
        let b: Vec<Vec<f64>> = (0..m)
            .map(|i| {
                (0..m)
                    .map(|j| -4.7750 * a[i][j] + 2.0315 * aa[i][j])
                    .collect()
            })
            .collect();
        let bx = mul(&b, &x);
        for i in 0..m {
            for j in 0..n {
                x[i][j] = 3.4445 * x[i][j] + bx[i][j];
            }
        }
    }
    let scale = MUON_LR * 0.2 * (rows.max(cols) as f64).sqrt();
    (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            let o = if tall { x[j][i] } else { x[i][j] };
            (f64::from(p[k]) - scale * o) as f32
        })
        .collect()
}

/// Worst relative difference of the loss curves and of the final parameters (each
/// parameter's difference over its magnitude, as Frobenius norms).
fn compare(a: &Run, b: &Run) -> (f64, f64, String) {
    let loss =
        a.0.iter()
            .zip(&b.0)
            .map(|(x, y)| (x - y).abs() / y.abs())
            .fold(0.0, f64::max);
    let mut worst = (0.0, String::new());
    for (name, x) in &a.1 {
        let y = &b.1[name];
        let norm = y.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
        let diff = x
            .iter()
            .zip(y)
            .map(|(p, q)| f64::from(p - q).powi(2))
            .sum::<f64>()
            .sqrt();
        let rel = diff / norm.max(1e-30);
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
    }
    (loss, worst.0, worst.1)
}

fn check(case: Case, tolerance: f64) {
    let ours = train_overlap(&case).unwrap_or_else(|e| panic!("{}: {e}", case.name()));
    let reference = train_reference(&case).unwrap();
    let (loss, params, worst) = compare(&ours, &reference);
    eprintln!(
        "{}: loss curve {loss:.2e}, parameters {params:.2e} (worst `{worst}`)",
        case.name()
    );
    assert!(
        ours.0.last() < ours.0.first(),
        "{}: the loss did not fall: {:?}",
        case.name(),
        ours.0
    );
    assert!(
        loss <= tolerance && params <= tolerance,
        "{}: loss curve {loss:.2e}, parameters {params:.2e} (worst `{worst}`), tolerance {tolerance:.0e}",
        case.name()
    );
}

#[test]
fn overlap_equals_candle_alone_with_adamw_on_every_mesh_and_micro_batch_count() {
    for (shard, replicate) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        for micro in 1..=4 {
            check(Case::new(shard, replicate, micro), 1e-5);
        }
    }
}

#[test]
fn the_simple_path_equals_candle_alone() {
    for (shard, replicate, micro) in [(2, 2, 2), (1, 2, 3), (2, 1, 1)] {
        let case = Case {
            segmented: false,
            ..Case::new(shard, replicate, micro)
        };
        check(case, 1e-5);
    }
}

#[test]
fn a_tied_head_gets_both_of_its_gradients() {
    for segmented in [true, false] {
        let case = Case {
            tied: true,
            segmented,
            ..Case::new(2, 1, 2)
        };
        check(case, 1e-5);
    }
}

#[test]
fn the_forward_gathers_train_the_same_model() {
    for segmented in [true, false] {
        let case = Case {
            forward: true,
            segmented,
            ..Case::new(2, 2, 2)
        };
        check(case, 1e-5);
    }
}

#[test]
fn no_sync_and_replicate_gates_train_the_same_model() {
    let case = Case {
        gates: Some(r#"["no_sync", "off", "on"]"#),
        ..Case::new(2, 2, 3)
    };
    check(case, 1e-5);
}

#[test]
fn muon_on_the_block_matrices_equals_an_f64_muon_reference() {
    for (shard, replicate, micro) in [(1, 1, 1), (2, 2, 2), (2, 1, 3)] {
        let case = Case {
            muon: true,
            ..Case::new(shard, replicate, micro)
        };
        check(case, 5e-5);
    }
}

#[test]
fn a_tied_weight_placed_above_a_segment_that_uses_it_is_refused_by_name() {
    let dev = Device::Cpu;
    let case = Case {
        tied: true,
        ..Case::new(1, 1, 1)
    };
    let (model, vars) = model::build(case.gpt(), SEED, &dev).unwrap();
    // The tied matrix put in the head's layer: segment 0 uses it after its gradients
    // would have been handed in.
    let mut dp = DataParallel::builder(&vars)
        .config_toml(case.config(), "tied.toml")
        .rules(Rules::new().layer("wte.*", 3))
        .cpu()
        .unwrap();
    let batch = corpus().slice(0, 0, 0, BATCH, TIME, &dev).unwrap();
    let e = dp
        .micro_batch(&model, &[(0, &batch)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("`wte.weight`") && e.contains("segment 0"), "{e}");
    // The failed micro-batch was dropped: the next one runs.
    let mut dp = DataParallel::builder(&vars)
        .config_toml(case.config(), "tied.toml")
        .cpu()
        .unwrap();
    dp.micro_batch(&model, &[(0, &batch)]).unwrap();
    dp.step().unwrap();
}

#[test]
fn misuse_is_refused_by_name() {
    let dev = Device::Cpu;
    let case = Case::new(2, 1, 2);
    let (model, vars) = model::build(case.gpt(), SEED, &dev).unwrap();
    let mut dp = DataParallel::builder(&vars)
        .config_toml(case.config(), "misuse.toml")
        .cpu()
        .unwrap();
    let batch = corpus().slice(0, 0, 0, BATCH, TIME, &dev).unwrap();
    let e = dp.step().unwrap_err().to_string();
    assert!(e.contains("0 of the step's 2 micro-batches"), "{e}");
    let e = dp
        .micro_batch(&model, &[(0, &batch)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("nothing for rank 1"), "{e}");
    let e = dp
        .micro_batch(&model, &[(0, &batch), (1, &batch), (5, &batch)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 5 is not a local rank"), "{e}");
    let e = dp.backward(&[]).unwrap_err().to_string();
    assert!(e.contains("call begin_micro_batch first"), "{e}");
    dp.begin_micro_batch().unwrap();
    let e = dp.begin_micro_batch().unwrap_err().to_string();
    assert!(e.contains("micro-batch 0 still waits"), "{e}");
    let loss = model.loss(&batch).unwrap();
    dp.backward_rank(1, &loss).unwrap();
    let e = dp.backward_rank(1, &loss).unwrap_err().to_string();
    assert!(
        e.contains("rank 1's gradients of micro-batch 0 were given already"),
        "{e}"
    );
    let e = dp.end_micro_batch().unwrap_err().to_string();
    assert!(e.contains("no gradients of ranks [0]"), "{e}");
    let e = dp.backward_rank(3, &loss).unwrap_err().to_string();
    assert!(e.contains("rank 3 is not a local rank"), "{e}");
    dp.backward_rank(0, &loss).unwrap();
    dp.end_micro_batch().unwrap();
    // A config with parameters of its own, and a name no rule places.
    let with_params = format!(
        "{}[[param]]\nname = \"x\"\nshape = [2]\nroute = \"fsdp\"\n",
        case.config()
    );
    let e = DataParallel::builder(&vars)
        .config_toml(with_params, "params.toml")
        .cpu()
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("param[0]") && e.contains("come from the trainer's model"),
        "{e}"
    );
    let stray = Var::zeros(3, candle_core::DType::F32, &dev).unwrap();
    let e = DataParallel::builder_from_vars(vec![("stray.weight".into(), stray)])
        .config_toml(case.config(), "stray.toml")
        .cpu()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("`stray.weight` matches no layer rule"), "{e}");
}

#[test]
fn copies_are_counted() {
    let dev = Device::Cpu;
    let case = Case::new(2, 1, 2);
    let (model, vars) = model::build(case.gpt(), SEED, &dev).unwrap();
    let params = overlap_candle::named_vars(&vars).len() as u64;
    let mut dp = DataParallel::builder(&vars)
        .config_toml(case.config(), "copies.toml")
        .cpu()
        .unwrap();
    for m in 0..2 {
        let batches: Vec<Batch> = (0..2)
            .map(|r| corpus().slice(0, m, r, BATCH, TIME, &dev).unwrap())
            .collect();
        dp.micro_batch(&model, &[(0, &batches[0]), (1, &batches[1])])
            .unwrap();
    }
    dp.step().unwrap();
    let c = dp.copies();
    // Every rank's gradient of every parameter in each micro-batch; each parameter read
    // back into its Var once; each segment boundary's activation on each rank.
    assert_eq!(c.grads, 2 * 2 * params);
    assert_eq!(c.params, 3 * params);
    assert_eq!(c.activations, 2 * 2 * (case.gpt().blocks as u64 + 1));
}
