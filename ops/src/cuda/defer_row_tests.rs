//! A row held as one (`row.rs`) against its steps held one by one, on stand-in buffers
//! (no GPU): the same shape key, addresses and clip flags; the same flush words, planned
//! anew and patched from a cached plan; and the rows that must be held step by step.

use std::sync::Arc;

use super::super::flush::FlushPlan;
use super::super::memory::stand_in_buffers;
use super::super::row::{HeldRow, RowMemos};
use super::*;
use crate::{NsDtype, OptimizerStep, Update};

fn tag(node: u32) -> Tag {
    Tag {
        node,
        op: "optimizer",
        micro_batch: u32::MAX,
    }
}

/// Seven steps on rank 0: AdamW on 5, 7, 5 and 1 values (two learning rates, two
/// weight decays), Muon on 2×3 (twice) and 4×2 matrices (two precisions).
fn list() -> Arc<[OptimizerStep<CudaBuffer>]> {
    let adamw = |len: usize, lr: f64, wd: f32| {
        let hp = AdamwParams {
            weight_decay: wd,
            ..AdamwParams::default()
        };
        (len, 2 * len, Update::Adamw { hp, lr })
    };
    let muon = |rows: usize, cols: usize, ns_dtype: NsDtype| {
        let hp = MuonParams {
            ns_dtype,
            ..MuonParams::default()
        };
        (
            rows * cols,
            rows * cols,
            Update::Muon {
                rows,
                cols,
                hp,
                lr: 0.02,
            },
        )
    };
    let specs = [
        adamw(5, 1e-3, 0.1),
        muon(2, 3, NsDtype::Bf16),
        adamw(7, 2e-3, 0.1),
        adamw(5, 1e-3, 0.1),
        muon(2, 3, NsDtype::Bf16),
        muon(4, 2, NsDtype::F32),
        adamw(1, 1e-3, 0.0),
    ];
    let lens: Vec<usize> = specs.iter().flat_map(|&(p, s, _)| [p, s]).collect();
    let bufs = stand_in_buffers(0, &lens);
    specs
        .iter()
        .zip(bufs.chunks(2))
        .enumerate()
        .map(|(i, (&(_, _, update), b))| OptimizerStep {
            tag: tag(10 + i as u32),
            param: b[0].clone(),
            state: b[1].clone(),
            update,
        })
        .collect()
}

/// One step's moving parts: fresh gradients (in the steps' order) and a fresh norm.
fn grads_of(steps: &[OptimizerStep<CudaBuffer>]) -> (Vec<CudaBuffer>, CudaBuffer) {
    let lens: Vec<usize> = steps.iter().map(|s| s.param.len).chain([1]).collect();
    let mut bufs = stand_in_buffers(0, &lens);
    let norm = bufs.pop().unwrap();
    (bufs, norm)
}

fn row(
    steps: &Arc<[OptimizerStep<CudaBuffer>]>,
    grads: &[CudaBuffer],
    guard: Option<&CudaBuffer>,
    (step, lr_factor): (u64, f64),
) -> HeldRow {
    HeldRow {
        steps: Arc::clone(steps),
        grads: grads.to_vec(),
        guard: guard.cloned(),
        step,
        lr_factor,
        clipped: false,
    }
}

/// A stream holding the norm of `grads` into `norm` and, with `clip`, its clip.
fn behind_norm(grads: &[CudaBuffer], norm: &CudaBuffer, clip: bool) -> Pending {
    let mut p = Pending::default();
    let srcs: Arc<[CudaBuffer]> = grads.iter().cloned().collect();
    let n = HeldNorm {
        tag: tag(1),
        dst: norm.clone(),
        srcs: Arc::clone(&srcs),
    };
    p.shape.add_norm(&n);
    p.norm = Some(n);
    if clip {
        let c = HeldClip {
            tag: tag(2),
            norm: norm.clone(),
            bufs: srcs,
            max_norm: 1.0,
            norms_list: true,
        };
        p.shape.add_clip(&c);
        p.clip = Some(c);
    }
    p
}

/// `row`'s steps held one by one on `p`, as `Issue::hold` holds them (none may
/// conflict: a row held as one never needs a flush between its steps).
fn one_by_one(p: &mut Pending, row: HeldRow, fuse_clip: bool) {
    let mut entries = Vec::new();
    row.expand_into(&mut entries);
    for e in entries {
        let names = p.shape.name_step(&e.1, e.2.as_ref());
        assert!(!p.conflicts(names.roles), "step {:?} conflicts", e.0);
        p.push_named(e, &names, fuse_clip);
    }
}

fn key_and_addresses(p: &mut Pending) -> (Vec<u64>, Vec<u64>) {
    (p.shape.assembled_key(), p.shape.addresses().to_vec())
}

#[test]
fn a_row_held_as_one_shapes_its_flush_as_its_steps_one_by_one() {
    let steps = list();
    let mut memos = RowMemos::default();
    for (clip, fuse) in [(true, true), (true, false), (false, true)] {
        let (grads, norm) = grads_of(&steps);
        let mut fast = behind_norm(&grads, &norm, clip);
        let memo = memos.of(0, &steps, MAX_HELD);
        let held = fast.hold_row(row(&steps, &grads, Some(&norm), (3, 0.5)), memo, fuse);
        assert!(held.is_ok(), "clip {clip}: not held as one");
        let mut slow = behind_norm(&grads, &norm, clip);
        one_by_one(&mut slow, row(&steps, &grads, Some(&norm), (3, 0.5)), fuse);
        assert_eq!(key_and_addresses(&mut fast), key_and_addresses(&mut slow));
        let flags: Vec<bool> = slow.held.iter().map(|e| e.3).collect();
        assert_eq!(flags, vec![clip && fuse; steps.len()]);
        assert_eq!(fast.row.as_ref().map(|r| r.clipped), Some(clip && fuse));
    }
    // Behind nothing and unguarded.
    let (grads, _) = grads_of(&steps);
    let mut fast = Pending::default();
    let memo = memos.of(0, &steps, MAX_HELD);
    assert!(fast
        .hold_row(row(&steps, &grads, None, (1, 1.0)), memo, true)
        .is_ok());
    let mut slow = Pending::default();
    one_by_one(&mut slow, row(&steps, &grads, None, (1, 1.0)), true);
    assert_eq!(key_and_addresses(&mut fast), key_and_addresses(&mut slow));
}

#[test]
fn a_row_held_as_one_flushes_the_words_its_steps_would_planned_anew_and_patched() {
    let steps = list();
    let mut memos = RowMemos::default();
    let mut cache = FlushCache::default();
    // Three steps: the first plans the shape (the row expanded and the shape built
    // again step by step), the later two patch the cached plan from the row, with new
    // gradients, norm, step count and learning-rate factor each time.
    for (k, scalars) in [(1u64, 1.0), (2, 0.75), (3, 0.5)].into_iter().enumerate() {
        let (grads, norm) = grads_of(&steps);
        let mut p = behind_norm(&grads, &norm, true);
        let memo = memos.of(0, &steps, MAX_HELD);
        let r = row(&steps, &grads, Some(&norm), scalars);
        assert!(p.hold_row(r, memo, true).is_ok());
        let (n, c, mut held, mut r, mut shape) = p.take();
        let words = cache
            .plan(&mut shape, (n.as_ref(), c.as_ref()), (&mut held, &mut r))
            .unwrap()
            .words()
            .to_vec();
        // Planned anew, the row was expanded into its steps; patched, it stayed a row.
        assert_eq!(
            (r.is_none(), held.len()),
            if k == 0 { (true, 7) } else { (false, 0) }
        );
        assert_eq!(cache.reuses, k as u64);
        let mut slow = behind_norm(&grads, &norm, true);
        one_by_one(&mut slow, row(&steps, &grads, Some(&norm), scalars), true);
        let direct = FlushPlan::with_addresses(
            &|b| b.ptr(),
            (slow.norm.as_ref(), slow.clip.as_ref()),
            &slow.held,
        )
        .unwrap();
        assert_eq!(words, direct.words(), "step {k}");
    }
}

#[test]
fn rows_whose_numbering_is_not_certain_are_held_step_by_step() {
    let steps = list();
    let mut memos = RowMemos::default();
    let (grads, norm) = grads_of(&steps);
    let mut refused = |mut p: Pending, r: HeldRow, what: &str| {
        let memo = memos.of(0, &steps, MAX_HELD);
        assert!(p.hold_row(r, memo, true).is_err(), "{what}: held as one");
    };
    let mut swapped = grads.clone();
    swapped.swap(0, 2);
    refused(
        behind_norm(&swapped, &norm, true),
        row(&steps, &grads, Some(&norm), (1, 1.0)),
        "gradients in another order than the norm's",
    );
    refused(
        behind_norm(&grads, &norm, true),
        row(&steps, &grads, None, (1, 1.0)),
        "unguarded behind a norm",
    );
    let (_, other) = grads_of(&steps);
    refused(
        behind_norm(&grads, &norm, true),
        row(&steps, &grads, Some(&other), (1, 1.0)),
        "guarded by another norm",
    );
    refused(
        Pending::default(),
        row(&steps, &grads, Some(&norm), (1, 1.0)),
        "guarded, no norm held",
    );
    refused(
        behind_norm(&grads, &norm, true),
        row(&steps, &grads, Some(&norm), (0, 1.0)),
        "step 0",
    );
    // A gradient that is a parameter of the row.
    let mut aliased = grads.clone();
    aliased[3] = steps[3].param.clone();
    refused(
        behind_norm(&aliased, &norm, true),
        row(&steps, &aliased, Some(&norm), (1, 1.0)),
        "a gradient that is a parameter",
    );
    refused(
        Pending::default(),
        row(&steps, &aliased, None, (1, 1.0)),
        "a gradient that is a parameter, unguarded",
    );
    // The same gradient twice (same length: steps 0 and 3).
    let mut twice = grads.clone();
    twice[3] = twice[0].clone();
    refused(
        Pending::default(),
        row(&steps, &twice, None, (1, 1.0)),
        "a gradient read twice",
    );
    refused(
        behind_norm(&twice, &norm, true),
        row(&steps, &twice, Some(&norm), (1, 1.0)),
        "a gradient read twice, behind its norm",
    );
    // A gradient of the wrong length.
    let mut short = grads.clone();
    short[2] = stand_in_buffers(0, &[3]).remove(0);
    refused(
        Pending::default(),
        row(&steps, &short, None, (1, 1.0)),
        "a gradient of the wrong length",
    );
    // Something held before.
    let mut p = Pending::default();
    one_by_one(&mut p, row(&steps, &grads, None, (1, 1.0)), true);
    let (more, _) = grads_of(&steps);
    refused(p, row(&steps, &more, None, (1, 1.0)), "steps held before");
    // A list whose steps share a parameter is never held as one.
    let mut shared: Vec<OptimizerStep<CudaBuffer>> = steps.to_vec();
    shared[3].param = shared[0].param.clone();
    let shared: Arc<[OptimizerStep<CudaBuffer>]> = shared.into();
    let memo = memos.of(0, &shared, MAX_HELD);
    let mut p = Pending::default();
    assert!(p
        .hold_row(row(&shared, &grads, None, (1, 1.0)), memo, true)
        .is_err());
}

/// Host µs of holding GPT-2 small's 148 AdamW steps behind their norm and clip: the
/// norm and clip held, the row held as one, the same steps held one by one (a figure
/// for `docs/performance.md`, not a check):
/// `cargo test --release -p overlap-ops --features cuda --lib host_cost_of_holding -- --ignored --nocapture`
#[test]
#[ignore = "prints host timings; run by hand"]
fn host_cost_of_holding_a_row_as_one_and_step_by_step() {
    let lens: Vec<usize> = (0..148).flat_map(|i| [768 + 64 * (i % 7); 2]).collect();
    let bufs = stand_in_buffers(0, &lens);
    let steps: Arc<[OptimizerStep<CudaBuffer>]> = bufs
        .chunks(2)
        .enumerate()
        .map(|(i, b)| OptimizerStep {
            tag: tag(i as u32),
            param: b[0].clone(),
            state: stand_in_buffers(0, &[2 * b[1].len]).remove(0),
            update: Update::Adamw {
                hp: AdamwParams::default(),
                lr: 1e-3,
            },
        })
        .collect();
    let mut memos = RowMemos::default();
    let reps = 2000;
    let mut secs = [0.0f64; 3];
    let mut time = |i: usize, t: std::time::Instant| secs[i] += t.elapsed().as_secs_f64();
    for _ in 0..reps {
        let (grads, norm) = grads_of(&steps);
        let t = std::time::Instant::now();
        let mut p = behind_norm(&grads, &norm, true);
        time(0, t);
        let t = std::time::Instant::now();
        let memo = memos.of(0, &steps, MAX_HELD);
        let r = row(&steps, &grads, Some(&norm), (3, 0.5));
        assert!(p.hold_row(r, memo, true).is_ok());
        time(1, t);
        let mut q = behind_norm(&grads, &norm, true);
        let t = std::time::Instant::now();
        one_by_one(&mut q, row(&steps, &grads, Some(&norm), (3, 0.5)), true);
        time(2, t);
    }
    let us = |x: f64| x / f64::from(reps) * 1e6;
    eprintln!(
        "148 AdamW steps, host µs: norm and clip held {:.2}, row held as one {:.2}, held one by one {:.2}",
        us(secs[0]),
        us(secs[1]),
        us(secs[2])
    );
}
