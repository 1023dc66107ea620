//! The CUDA backend's held optimizer kernels on a real GPU (`ops/src/cuda/defer.rs`):
//! what the backend holds is issued before anything the caller issues after it, so the
//! results are those of the kernels run one by one in launch order, bit for bit against
//! the reference math.
//!
//! Needs a GPU: without one every test says so and passes, unless `OVERLAP_GPU_TESTS=1`
//! is set, when failing to open the GPU fails them. On the GPU machine:
//!
//! ```sh
//! cargo test --release -p overlap-ops --features cuda --test cuda_tail --no-run   # builds it
//! OVERLAP_GPU_TESTS=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64 target/release/deps/cuda_tail-<hash> --test-threads 1
//! ```
#![cfg(feature = "cuda")]

mod common;

use std::time::Duration;

use common::{buffer, gpu, sync, TAG};
use overlap_ops::cuda::CudaBuffer;
use overlap_ops::graph::Stream;
use overlap_ops::{
    math, AdamwParams, Backend, Kernel, MuonParams, NsDtype, OptimizerRow, OptimizerStep, Update,
};

fn adamw(p: &CudaBuffer, g: &CudaBuffer, s: &CudaBuffer, step: u64) -> Kernel<CudaBuffer> {
    Kernel::Adamw {
        param: p.clone(),
        grad: g.clone(),
        state: s.clone(),
        hp: AdamwParams::default(),
        step,
    }
}

#[test]
fn a_parameter_updated_twice_in_a_row_gets_both_steps_in_order() {
    let Some(b) = gpu() else { return };
    let n = 10_001;
    let (p0, g) = (math::pseudo_random(n, 1), math::pseudo_random(n, 2));
    let (pb, gb, sb) = (buffer(&b, &p0), buffer(&b, &g), b.alloc(0, 2 * n).unwrap());
    // A second parameter held between the two steps of the first.
    let q0 = math::pseudo_random(300, 3);
    let (qb, hb, tb) = (
        buffer(&b, &q0),
        buffer(&b, &math::pseudo_random(300, 4)),
        b.alloc(0, 600).unwrap(),
    );
    b.launch(0, Stream::Compute, TAG, adamw(&pb, &gb, &sb, 1));
    b.launch(0, Stream::Compute, TAG, adamw(&qb, &hb, &tb, 1));
    b.launch(0, Stream::Compute, TAG, adamw(&pb, &gb, &sb, 2));
    sync(&b, Stream::Compute);
    let (mut p, mut m, mut v) = (p0, vec![0.0; n], vec![0.0; n]);
    for step in 1..=2 {
        math::adamw(&mut p, &g, &mut m, &mut v, &AdamwParams::default(), step);
    }
    let s = b.download(&sb).unwrap();
    assert_eq!(b.download(&pb).unwrap(), p);
    assert_eq!((&s[..n], &s[n..]), (&m[..], &v[..]));
}

#[test]
fn a_download_and_another_streams_wait_see_the_held_updates() {
    let Some(b) = gpu() else { return };
    let n = 4096;
    let (p0, g) = (math::pseudo_random(n, 5), math::pseudo_random(n, 6));
    let (pb, gb, sb) = (buffer(&b, &p0), buffer(&b, &g), b.alloc(0, 2 * n).unwrap());
    let (mut p, mut m, mut v) = (p0, vec![0.0; n], vec![0.0; n]);
    math::adamw(&mut p, &g, &mut m, &mut v, &AdamwParams::default(), 1);
    // Held on compute; an event recorded there, waited for on reduce, then a copy of the
    // parameter on reduce: the copy reads the updated values.
    b.launch(0, Stream::Compute, TAG, adamw(&pb, &gb, &sb, 1));
    let ev = b.event(0);
    b.record(0, Stream::Compute, &ev);
    b.wait(0, Stream::Reduce, &ev);
    let copy = b.alloc(0, n).unwrap();
    b.launch(
        0,
        Stream::Reduce,
        TAG,
        Kernel::Add {
            dst: copy.clone(),
            src: pb.clone(),
            accumulate: false,
        },
    );
    sync(&b, Stream::Reduce);
    assert_eq!(b.download(&copy).unwrap(), p);
    // Held and never followed by a record: the download issues it first.
    b.launch(0, Stream::Compute, TAG, adamw(&pb, &gb, &sb, 2));
    math::adamw(&mut p, &g, &mut m, &mut v, &AdamwParams::default(), 2);
    std::thread::sleep(Duration::from_millis(20));
    let _ = b.download(&gb).unwrap();
    sync(&b, Stream::Compute);
    assert_eq!(b.download(&pb).unwrap(), p);
}

#[test]
fn records_behind_held_updates_keep_them_in_one_flush_and_order_each_waiter() {
    let Some(b) = gpu() else { return };
    // Three parameters, an event recorded after each update (as a plan records one for
    // each parameter's publish), then another stream waits for each event and copies
    // that parameter: the copies see the updates, and the three were issued together.
    let sizes = [4096, 333, 70_001];
    let mut bufs = Vec::new();
    let mut expect = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let (p0, g) = (
            math::pseudo_random(n, 20 + i as u64),
            math::pseudo_random(n, 30 + i as u64),
        );
        bufs.push((buffer(&b, &p0), buffer(&b, &g), b.alloc(0, 2 * n).unwrap()));
        let (mut p, mut m, mut v) = (p0, vec![0.0; n], vec![0.0; n]);
        math::adamw(&mut p, &g, &mut m, &mut v, &AdamwParams::default(), 1);
        expect.push(p);
    }
    let before = b.flushes();
    let mut events = Vec::new();
    for (pb, gb, sb) in &bufs {
        b.launch(0, Stream::Compute, TAG, adamw(pb, gb, sb, 1));
        let ev = b.event(0);
        b.record(0, Stream::Compute, &ev);
        events.push(ev);
    }
    let mut copies = Vec::new();
    for ((pb, _, _), ev) in bufs.iter().zip(&events) {
        b.wait(0, Stream::Reduce, ev);
        let copy = b.alloc(0, b.len(pb)).unwrap();
        let add = Kernel::Add {
            dst: copy.clone(),
            src: pb.clone(),
            accumulate: false,
        };
        b.launch(0, Stream::Reduce, TAG, add);
        copies.push(copy);
    }
    assert_eq!(
        b.flushes() - before,
        1,
        "the records split the held updates"
    );
    sync(&b, Stream::Reduce);
    for (copy, p) in copies.iter().zip(&expect) {
        assert_eq!(&b.download(copy).unwrap(), p);
    }
    // A host wait and a status of an event deferred behind a held update land it.
    let (pb, gb, sb) = &bufs[0];
    b.launch(0, Stream::Compute, TAG, adamw(pb, gb, sb, 2));
    let ev = b.event(0);
    b.record(0, Stream::Compute, &ev);
    let flushed = b.flushes();
    let _ = b.status(&ev);
    assert_eq!(
        b.flushes(),
        flushed + 1,
        "a status lands the deferred record"
    );
    let waited = block_on(b.host_wait(&ev));
    assert!(waited.is_ok(), "{waited:?}");
    // Re-recorded on an idle stream before its flush: the later record wins, and the
    // flush behind a long spin does not redirect it.
    b.launch(0, Stream::Compute, TAG, Kernel::Spin { micros: 300_000 });
    b.launch(0, Stream::Compute, TAG, adamw(pb, gb, sb, 3));
    b.record(0, Stream::Compute, &ev);
    b.record(0, Stream::Reduce, &ev);
    b.launch(0, Stream::Compute, TAG, Kernel::Marker);
    sync(&b, Stream::Reduce);
    assert_eq!(b.status(&ev), overlap_ops::EventStatus::Complete);
    sync(&b, Stream::Compute);
}

/// Runs a host wait to its end on this thread.
fn block_on<T>(f: overlap_ops::BoxFuture<T>) -> T {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = f;
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(1));
    }
}

#[test]
fn muon_matrices_of_two_shapes_held_together_match_one_by_one() {
    let Some(b) = gpu() else { return };
    let hp = MuonParams::default()
        .with_ns_dtype(NsDtype::F32)
        .with_weight_decay(0.1);
    let mut host = Vec::new();
    for (i, (rows, cols)) in [(64usize, 48usize), (48, 64), (64, 48)]
        .into_iter()
        .enumerate()
    {
        let k = rows * cols;
        let seed = 10 * i as u64;
        let (p0, g, m0) = (
            math::pseudo_random(k, seed),
            math::pseudo_random(k, seed + 1),
            math::pseudo_random(k, seed + 2),
        );
        let (pb, gb, mb) = (buffer(&b, &p0), buffer(&b, &g), buffer(&b, &m0));
        b.launch(
            0,
            Stream::Compute,
            TAG,
            Kernel::Muon {
                param: pb.clone(),
                grad: gb,
                momentum: mb.clone(),
                rows,
                cols,
                hp,
            },
        );
        host.push((rows, cols, p0, g, m0, pb, mb));
    }
    sync(&b, Stream::Compute);
    for (rows, cols, p0, g, m0, pb, mb) in host {
        let (mut p, mut m) = (p0.clone(), m0);
        math::muon(&mut p, &g, &mut m, rows, cols, &hp);
        assert_eq!(b.download(&mb).unwrap(), m, "{rows}x{cols} momentum");
        let got = b.download(&pb).unwrap();
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for ((a, r), o) in got.iter().zip(&p).zip(&p0) {
            num += f64::from((a - o) - (r - o)).powi(2);
            den += f64::from(r - o).powi(2);
        }
        let e = (num / den).sqrt();
        assert!(e < 1e-4, "{rows}x{cols}: update rel err {e:.2e}");
    }
}

/// One case of the clip fused into the optimizers: three AdamW tensors (two aligned
/// sizes and an odd one) and a Muon matrix read their gradients after a clip that also
/// scales a gradient no optimizer reads; every buffer must be the reference's bits:
/// clip every gradient, then the guarded optimizers.
fn fused_clip_case(sq: f32, max_norm: f32) {
    let Some(b) = gpu() else { return };
    let norm = buffer(&b, &[sq]);
    let hp = MuonParams::default().with_ns_dtype(NsDtype::F32);
    let sizes = [8192usize, 4096 * 3 + 5, 77];
    let mut grads: Vec<Vec<f32>> = (0..5)
        .map(|i| math::pseudo_random(6000 + i * 1000, 40 + i as u64))
        .collect();
    for (i, &n) in sizes.iter().enumerate() {
        grads[i] = math::pseudo_random(n, 50 + i as u64);
    }
    let (rows, cols) = (48, 64);
    grads[3] = math::pseudo_random(rows * cols, 60);
    let gbufs: Vec<CudaBuffer> = grads.iter().map(|g| buffer(&b, g)).collect();
    b.launch(
        0,
        Stream::Compute,
        TAG,
        Kernel::Clip {
            norm: norm.clone(),
            bufs: gbufs.clone().into(),
            max_norm,
        },
    );
    let guarded = |k| Kernel::IfFinite {
        norm: norm.clone(),
        kernel: Box::new(k),
    };
    let mut adamw_host = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let p0 = math::pseudo_random(n, 70 + i as u64);
        let (pb, sb) = (buffer(&b, &p0), b.alloc(0, 2 * n).unwrap());
        b.launch(
            0,
            Stream::Compute,
            TAG,
            guarded(adamw(&pb, &gbufs[i], &sb, 1)),
        );
        adamw_host.push((p0, pb, sb));
    }
    let (p0, m0) = (
        math::pseudo_random(rows * cols, 80),
        math::pseudo_random(rows * cols, 81),
    );
    let (pb, mb) = (buffer(&b, &p0), buffer(&b, &m0));
    let muon = Kernel::Muon {
        param: pb.clone(),
        grad: gbufs[3].clone(),
        momentum: mb.clone(),
        rows,
        cols,
        hp,
    };
    b.launch(0, Stream::Compute, TAG, guarded(muon));
    sync(&b, Stream::Compute);
    // The reference: the clip of every gradient, then the optimizers on a finite norm.
    let finite = f64::from(sq).is_finite();
    if let Some(f) = math::clip_factor(f64::from(sq), max_norm) {
        grads.iter_mut().for_each(|g| math::scale(g, f));
    }
    for (g, gb) in grads.iter().zip(&gbufs) {
        assert_eq!(
            bits(&b.download(gb).unwrap()),
            bits(g),
            "a gradient after the clip"
        );
    }
    for (i, (p0, pb, sb)) in adamw_host.into_iter().enumerate() {
        let n = sizes[i];
        let (mut p, mut m, mut v) = (p0, vec![0.0; n], vec![0.0; n]);
        if finite {
            math::adamw(
                &mut p,
                &grads[i],
                &mut m,
                &mut v,
                &AdamwParams::default(),
                1,
            );
        }
        let s = b.download(&sb).unwrap();
        assert_eq!(
            bits(&b.download(&pb).unwrap()),
            bits(&p),
            "AdamW {n}: parameter"
        );
        assert_eq!(
            (bits(&s[..n]), bits(&s[n..])),
            (bits(&m), bits(&v)),
            "AdamW {n}: moments"
        );
    }
    let (mut p, mut m) = (p0.clone(), m0);
    if finite {
        math::muon(&mut p, &grads[3], &mut m, rows, cols, &hp);
    }
    assert_eq!(bits(&b.download(&mb).unwrap()), bits(&m), "Muon momentum");
    if !finite {
        assert_eq!(
            bits(&b.download(&pb).unwrap()),
            bits(&p0),
            "a skipped Muon step"
        );
    }
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_clip_fused_into_the_optimizers_is_the_references_bit_for_bit() {
    // Clipping (factor 0.5 / 2000), not clipping (factor above 1), a non-finite norm
    // (everything skipped, nothing scaled).
    fused_clip_case(4.0e6, 0.5);
    fused_clip_case(0.01, 1.0);
    fused_clip_case(f32::INFINITY, 1.0);
}

/// One step of the replay test: the global norm, the clip, then guarded AdamW (an
/// aligned and an odd tensor) and Muon (four shapes in two classes, bf16), learning
/// rates that change with the step.
/// A tail of AdamW and Muon behind the norm and the clip whose gradients and norm
/// move every step: step `s` takes gradient set `s % 2` and norm `s % 3`, as a pool
/// hands out buffers (or a trainer makes new gradients), so a replayed graph must take
/// each step's buffers from the words the flush uploads.
struct ReplaySet {
    norms: Vec<CudaBuffer>,
    sets: Vec<Vec<CudaBuffer>>,
    pristine: Vec<Vec<f32>>,
    params: Vec<CudaBuffer>,
    states: Vec<CudaBuffer>,
}

const REPLAY_ADAMW: [usize; 2] = [8192, 4099];

/// The learning rate of step `step` of a [`ReplaySet`]: `1e-3 · step` in f64, stored
/// in f32 (as [`Kernel::Optimizers`] computes it from a factor).
fn replay_lr(step: u64) -> f32 {
    (1e-3 * step as f64) as f32
}
/// Two shapes iterated directly (one class) and two on their Gram matrix (another).
const REPLAY_MUON: [(usize, usize); 4] = [(48, 64), (96, 48), (64, 256), (256, 64)];

impl ReplaySet {
    fn new(b: &overlap_ops::cuda::CudaBackend) -> ReplaySet {
        let sizes: Vec<usize> = REPLAY_ADAMW
            .iter()
            .copied()
            .chain(REPLAY_MUON.iter().map(|(r, c)| r * c))
            .collect();
        let pristine: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| math::pseudo_random(n, 900 + i as u64))
            .collect();
        let sets = (0..2)
            .map(|_| pristine.iter().map(|g| buffer(b, g)).collect())
            .collect();
        let params = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| buffer(b, &math::pseudo_random(n, 950 + i as u64)))
            .collect();
        let states = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let len = if i < REPLAY_ADAMW.len() { 2 * n } else { n };
                buffer(b, &vec![0.0; len])
            })
            .collect();
        ReplaySet {
            norms: (0..3).map(|_| buffer(b, &[4.0e6])).collect(),
            sets,
            pristine,
            params,
            states,
        }
    }

    /// The gradients step `step` reads.
    fn grads(&self, step: u64) -> &[CudaBuffer] {
        &self.sets[step as usize % self.sets.len()]
    }

    /// The norm step `step` writes and guards with.
    fn norm(&self, step: u64) -> &CudaBuffer {
        &self.norms[step as usize % self.norms.len()]
    }

    /// Launches one step (its gradients restored: the clip of an earlier step scaled
    /// them), the optimizers one by one.
    fn step(&self, b: &overlap_ops::cuda::CudaBackend, step: u64) {
        self.step_as(b, step, false);
    }

    /// [`Self::step`], the optimizers one by one or as one [`Kernel::Optimizers`].
    fn step_as(&self, b: &overlap_ops::cuda::CudaBackend, step: u64, row: bool) {
        let (grads, norm) = (self.grads(step), self.norm(step));
        for (g, host) in grads.iter().zip(&self.pristine) {
            b.upload(g, host).unwrap();
        }
        b.launch(
            0,
            Stream::Compute,
            TAG,
            Kernel::SumSquares {
                dst: norm.clone(),
                srcs: grads.to_vec().into(),
            },
        );
        b.launch(
            0,
            Stream::Compute,
            TAG,
            Kernel::Clip {
                norm: norm.clone(),
                bufs: grads.to_vec().into(),
                max_norm: 0.5,
            },
        );
        let lr = replay_lr(step);
        let n = REPLAY_ADAMW.len();
        if row {
            self.optimizers(b, step);
            sync(b, Stream::Compute);
            return;
        }
        for i in 0..self.params.len() {
            let kernel = if i < n {
                Kernel::Adamw {
                    param: self.params[i].clone(),
                    grad: grads[i].clone(),
                    state: self.states[i].clone(),
                    hp: AdamwParams::default().with_lr(lr),
                    step,
                }
            } else {
                let (rows, cols) = REPLAY_MUON[i - n];
                Kernel::Muon {
                    param: self.params[i].clone(),
                    grad: grads[i].clone(),
                    momentum: self.states[i].clone(),
                    rows,
                    cols,
                    hp: MuonParams::default()
                        .with_lr(lr)
                        .with_weight_decay(0.1)
                        .with_ns_dtype(NsDtype::Bf16),
                }
            };
            let guarded = Kernel::IfFinite {
                norm: norm.clone(),
                kernel: Box::new(kernel),
            };
            b.launch(0, Stream::Compute, TAG, guarded);
        }
        sync(b, Stream::Compute);
    }

    /// The step's optimizers as one [`Kernel::Optimizers`]: the settings those of
    /// [`Self::step_as`]'s kernels, the learning rate `1e-3 · step` as a factor.
    fn optimizers(&self, b: &overlap_ops::cuda::CudaBackend, step: u64) {
        let n = REPLAY_ADAMW.len();
        let steps: Vec<OptimizerStep<CudaBuffer>> = (0..self.params.len())
            .map(|i| OptimizerStep {
                tag: overlap_ops::Tag {
                    node: i as u32,
                    ..TAG
                },
                param: self.params[i].clone(),
                state: self.states[i].clone(),
                update: if i < n {
                    Update::Adamw {
                        hp: AdamwParams::default(),
                        lr: 1e-3,
                    }
                } else {
                    let (rows, cols) = REPLAY_MUON[i - n];
                    Update::Muon {
                        rows,
                        cols,
                        hp: MuonParams::default()
                            .with_weight_decay(0.1)
                            .with_ns_dtype(NsDtype::Bf16),
                        lr: 1e-3,
                    }
                },
            })
            .collect();
        let kernel = Kernel::Optimizers(OptimizerRow {
            steps: steps.into(),
            grads: self.grads(step).to_vec(),
            guard: Some(self.norm(step).clone()),
            step,
            lr_factor: step as f64,
        });
        b.launch(0, Stream::Compute, TAG, kernel);
    }

    fn bits(&self, b: &overlap_ops::cuda::CudaBackend) -> Vec<Vec<u32>> {
        self.params
            .iter()
            .chain(&self.states)
            .map(|x| bits(&b.download(x).unwrap()))
            .collect()
    }
}

#[test]
fn a_replayed_flush_reads_each_steps_scalars_and_matches_one_issued_call_by_call() {
    let Some(b) = gpu() else { return };
    // Set `a` is flushed with graphs (issued, then captured, then replayed), set `b`
    // call by call; the learning rate and AdamW's bias corrections change every step.
    // The gradients and the norm move every step: the graph captured at step 2 is
    // replayed at steps 3 to 5 on other buffers.
    let (a, d) = (ReplaySet::new(&b), ReplaySet::new(&b));
    let replays = b.tail_replays();
    let reuses = b.tail_plan_reuses();
    for step in 1..=5 {
        b.set_tail_graphs(true);
        a.step(&b, step);
        b.set_tail_graphs(false);
        d.step(&b, step);
        assert_eq!(
            a.bits(&b),
            d.bits(&b),
            "step {step}: replayed against direct"
        );
    }
    assert_eq!(
        b.tail_replays() - replays,
        4,
        "captured at step 2, replayed after"
    );
    // Both sets' flushes have one shape: planned once, then only their addresses and
    // scalars written (`flush_cache.rs`).
    assert_eq!(b.tail_plan_reuses() - reuses, 9, "one plan for ten flushes");
    // AdamW against the reference, bit for bit, after the five steps, with the norm
    // the GPU computed (the same every step: the gradients are restored).
    let sq = b.download(a.norm(5)).unwrap()[0];
    let all: Vec<f32> = a.pristine.concat();
    let want = math::sum_squares(&all);
    assert!(
        (f64::from(sq) - want).abs() <= 1e-6 * want,
        "norm {sq} vs {want}"
    );
    let factor = math::clip_factor(f64::from(sq), 0.5).unwrap();
    for (i, &n) in REPLAY_ADAMW.iter().enumerate() {
        let mut g = a.pristine[i].clone();
        math::scale(&mut g, factor);
        let (mut p, mut m, mut v) = (
            math::pseudo_random(n, 950 + i as u64),
            vec![0.0; n],
            vec![0.0; n],
        );
        for step in 1..=5u64 {
            let hp = AdamwParams::default().with_lr(replay_lr(step));
            math::adamw(&mut p, &g, &mut m, &mut v, &hp, step);
        }
        assert_eq!(
            bits(&b.download(&a.params[i]).unwrap()),
            bits(&p),
            "AdamW {n}"
        );
    }
}

#[test]
fn a_row_of_optimizers_holds_and_replays_as_its_steps_one_by_one() {
    let Some(b) = gpu() else { return };
    // Set `a` hands each step's optimizers in as one row, set `d` one by one; both
    // flush with graphs, the gradients and the norm moving every step.
    b.set_tail_graphs(true);
    let (a, d) = (ReplaySet::new(&b), ReplaySet::new(&b));
    for step in 1..=4 {
        a.step_as(&b, step, true);
        d.step_as(&b, step, false);
        assert_eq!(
            a.bits(&b),
            d.bits(&b),
            "step {step}: row against one by one"
        );
    }
    assert!(b.errors().is_empty(), "{:?}", b.errors());
    // A row whose gradients do not match its steps fails under its tag at its launch
    // (nothing held; the stream it names is poisoned, so no sync on it here).
    let mut grads = a.grads(5).to_vec();
    grads.pop();
    let kernel = Kernel::Optimizers(OptimizerRow {
        steps: Vec::<OptimizerStep<CudaBuffer>>::new().into(),
        grads,
        guard: None,
        step: 5,
        lr_factor: 1.0,
    });
    b.launch(0, Stream::Copy, TAG, kernel);
    let errors = b.errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].2, TAG);
    assert!(errors[0].3.to_string().contains("5 gradients for 0 steps"));
}
