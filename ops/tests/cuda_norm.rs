//! The CUDA backend's global-norm kernels on a real GPU, against the reference math
//! (`ops::math`, which the CPU backend runs): `SumSquares` over many buffers (more than
//! one launch takes, empty ones, long ones), `Clip` (engaged, not engaged, a NaN or Inf
//! norm, a buffer named twice, more buffers than one launch takes) and `IfFinite` around
//! AdamW and Muon (a finite norm changes nothing, a non-finite one leaves parameters and
//! state bit for bit as they were).
//!
//! Needs a GPU: without one (no driver, no device) every test says so and passes, unless
//! `OVERLAP_GPU_TESTS=1` is set, when failing to open the GPU fails them. On the GPU
//! machine:
//!
//! ```sh
//! cargo test --release -p overlap-ops --features cuda --test cuda_norm --no-run   # builds it
//! OVERLAP_GPU_TESTS=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64 target/release/deps/cuda_norm-<hash> --test-threads 1
//! ```
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::{buffer, gpu, sync, TAG};
use overlap_ops::cuda::{CudaBackend, CudaBuffer};
use overlap_ops::graph::Stream;
use overlap_ops::{math, AdamwParams, Backend, Kernel, MuonParams};

/// Launches on the optimizer stream.
fn launch(b: &CudaBackend, k: Kernel<CudaBuffer>) {
    b.launch(0, Stream::Compute, TAG, k);
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

/// Lengths that cross every boundary of the two passes: empty, one element, a block
/// (256) and one either side, many blocks, more than the first pass's 256 blocks.
const LENGTHS: [usize; 10] = [0, 1, 7, 255, 256, 257, 1000, 65_539, 300_001, 2_000_003];

fn sources(b: &CudaBackend, extra: usize) -> (Vec<Vec<f32>>, Vec<CudaBuffer>) {
    let mut host: Vec<Vec<f32>> = LENGTHS
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            math::pseudo_random(n, i as u64 + 1)
                .into_iter()
                .map(|x| x * (1 + i) as f32)
                .collect()
        })
        .collect();
    // Small buffers beyond one launch's 32.
    host.extend((0..extra).map(|i| math::pseudo_random(3 + i % 5, 100 + i as u64)));
    let dev = host.iter().map(|h| buffer(b, h)).collect();
    (host, dev)
}

/// The reference: what the CPU backend's kernel computes (f64 sum, stored as f32).
fn reference_sum(host: &[Vec<f32>]) -> f32 {
    host.iter().map(|h| math::sum_squares(h)).sum::<f64>() as f32
}

fn sum_squares(b: &CudaBackend, srcs: &[CudaBuffer]) -> f32 {
    let dst = buffer(b, &[-1.0]);
    launch(
        b,
        Kernel::SumSquares {
            dst: dst.clone(),
            srcs: Arc::from(srcs.to_vec()),
        },
    );
    sync(b, Stream::Compute);
    b.download(&dst).unwrap()[0]
}

#[test]
fn the_sum_of_squares_is_the_references_within_one_rounding_and_reproducible() {
    let Some(b) = gpu() else { return };
    let (host, dev) = sources(&b, 45);
    let want = reference_sum(&host);
    let got = sum_squares(&b, &dev);
    // Both sum in f64 (in different orders) and round once: at most one f32 ulp apart.
    let ulp = f32::from_bits(want.to_bits() + 1) - want;
    assert!((got - want).abs() <= ulp, "{got} vs {want}");
    // Atomics-free: the same inputs give the same bits.
    for _ in 0..3 {
        assert_eq!(sum_squares(&b, &dev).to_bits(), got.to_bits());
    }
    // No sources, or only empty ones: zero.
    assert_eq!(sum_squares(&b, &[]), 0.0);
    assert_eq!(sum_squares(&b, &dev[..1]), 0.0);
    // One source alone.
    let one = sum_squares(&b, &dev[8..9]);
    let want1 = math::sum_squares(&host[8]) as f32;
    assert!((one - want1).abs() <= f32::from_bits(want1.to_bits() + 1) - want1);
    // A NaN or an infinity anywhere makes the sum NaN or infinite.
    let mut poisoned = host[5].clone();
    poisoned[200] = f32::NAN;
    let nan = buffer(&b, &poisoned);
    let mut srcs = dev.clone();
    srcs[5] = nan;
    assert!(sum_squares(&b, &srcs).is_nan());
    poisoned[200] = f32::INFINITY;
    srcs[5] = buffer(&b, &poisoned);
    assert_eq!(sum_squares(&b, &srcs), f32::INFINITY);
}

/// Clips `bufs` (indices into `host`, repeats allowed) by the squared norm `sq` on the
/// GPU and in the reference, and checks that every buffer agrees bit for bit.
fn clip_case(b: &CudaBackend, host: &[Vec<f32>], bufs: &[usize], sq: f32, max_norm: f32) {
    let dev: Vec<CudaBuffer> = host.iter().map(|h| buffer(b, h)).collect();
    let norm = buffer(b, &[sq]);
    launch(
        b,
        Kernel::Clip {
            norm,
            bufs: bufs
                .iter()
                .map(|&i| dev[i].clone())
                .collect::<Vec<_>>()
                .into(),
            max_norm,
        },
    );
    sync(b, Stream::Compute);
    let mut want = host.to_vec();
    if let Some(f) = math::clip_factor(f64::from(sq), max_norm) {
        for &i in bufs {
            math::scale(&mut want[i], f);
        }
    }
    for (i, (d, w)) in dev.iter().zip(&want).enumerate() {
        assert_eq!(
            bits(&b.download(d).unwrap()),
            bits(w),
            "buffer {i}, norm² {sq}, max_norm {max_norm}, bufs {bufs:?}"
        );
    }
}

#[test]
fn clipping_is_the_references_bit_for_bit() {
    let Some(b) = gpu() else { return };
    let host: Vec<Vec<f32>> = (0..40)
        .map(|i| math::pseudo_random([1000, 257, 0, 65_539, 3][i % 5], i as u64 + 7))
        .collect();
    let all: Vec<usize> = (0..host.len()).collect();
    // Engaged (factor about 1e-3), barely engaged (factors 0.999 and 1 - 1e-6), not
    // engaged (factor 20).
    for (sq, max_norm) in [(4.0e5, 0.5), (1.0, 0.999), (1.0, 1.0), (0.25, 10.0)] {
        clip_case(&b, &host, &all, sq, max_norm);
    }
    // A non-finite norm leaves everything as it is.
    for sq in [f32::NAN, f32::INFINITY] {
        clip_case(&b, &host, &all, sq, 0.5);
    }
    // A buffer named twice is scaled twice, as the CPU backend does; a subset only.
    clip_case(&b, &host, &[0, 1, 0, 3, 1], 4.0e5, 0.5);
    clip_case(&b, &host, &[3], 4.0e5, 0.5);
}

/// An optimizer kernel over (parameter, gradient, state).
type Make<'a> = &'a dyn Fn(CudaBuffer, CudaBuffer, CudaBuffer) -> Kernel<CudaBuffer>;

/// Runs the kernel `make` builds on fresh copies of `p`, `g`, `s`, guarded by a norm
/// `sq`, or unguarded (`None`); returns the parameter and state after it.
fn optimizer(
    b: &CudaBackend,
    (p, g, s): (&[f32], &[f32], &[f32]),
    sq: Option<f32>,
    make: Make,
) -> (Vec<f32>, Vec<f32>) {
    let (pb, gb, sb) = (buffer(b, p), buffer(b, g), buffer(b, s));
    let k = make(pb.clone(), gb, sb.clone());
    match sq {
        Some(sq) => launch(
            b,
            Kernel::IfFinite {
                norm: buffer(b, &[sq]),
                kernel: Box::new(k),
            },
        ),
        None => launch(b, k),
    }
    sync(b, Stream::Compute);
    (b.download(&pb).unwrap(), b.download(&sb).unwrap())
}

#[test]
fn a_guarded_optimizer_runs_on_a_finite_norm_and_touches_nothing_otherwise() {
    let Some(b) = gpu() else { return };
    let n = 33 * 70;
    let p = math::pseudo_random(n, 1);
    let g = math::pseudo_random(n, 2);
    let adamw_state: Vec<f32> = math::pseudo_random(2 * n, 3)
        .into_iter()
        .enumerate()
        .map(|(i, x)| if i < n { x * 0.1 } else { x.abs() * 0.01 })
        .collect();
    let adamw = |p: CudaBuffer, g: CudaBuffer, s: CudaBuffer| Kernel::Adamw {
        param: p,
        grad: g,
        state: s,
        hp: AdamwParams::default(),
        step: 3,
    };
    let momentum = math::pseudo_random(n, 4);
    let muon = |p: CudaBuffer, g: CudaBuffer, s: CudaBuffer| Kernel::Muon {
        param: p,
        grad: g,
        momentum: s,
        rows: 33,
        cols: 70,
        hp: MuonParams::default(),
    };
    let cases: [(&str, &Vec<f32>, Make); 2] =
        [("adamw", &adamw_state, &adamw), ("muon", &momentum, &muon)];
    for (name, state, make) in cases {
        let bufs = (&p[..], &g[..], &state[..]);
        let plain = optimizer(&b, bufs, None, make);
        assert_ne!(bits(&plain.0), bits(&p), "{name} updates");
        // A finite norm: the same bits as unguarded.
        let guarded = optimizer(&b, bufs, Some(123.5), make);
        assert_eq!(bits(&guarded.0), bits(&plain.0), "{name} param");
        assert_eq!(bits(&guarded.1), bits(&plain.1), "{name} state");
        // NaN or Inf: parameter and state untouched.
        for sq in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let (pp, ss) = optimizer(&b, bufs, Some(sq), make);
            assert_eq!(bits(&pp), bits(&p), "{name} param, norm² {sq}");
            assert_eq!(bits(&ss), bits(state), "{name} state, norm² {sq}");
        }
    }
    // AdamW unguarded is the reference's bit for bit (as cuda-smoke checks).
    let (mut wp, mut ws) = (p.clone(), adamw_state.clone());
    let (m, v) = ws.split_at_mut(n);
    math::adamw(&mut wp, &g, m, v, &AdamwParams::default(), 3);
    let plain = optimizer(&b, (&p, &g, &adamw_state), Some(1.0), &adamw);
    assert_eq!(bits(&plain.0), bits(&wp));
    assert_eq!(bits(&plain.1), bits(&ws));
}

#[test]
fn a_guard_that_is_a_written_buffer_or_guards_no_optimizer_is_refused() {
    let Some(b) = gpu() else { return };
    let p = buffer(&b, &[1.0]);
    let g = buffer(&b, &[0.5]);
    let s = buffer(&b, &[0.0, 0.0]);
    b.launch(
        0,
        Stream::Copy,
        TAG,
        Kernel::IfFinite {
            norm: p.clone(),
            kernel: Box::new(Kernel::Adamw {
                param: p.clone(),
                grad: g.clone(),
                state: s,
                hp: AdamwParams::default(),
                step: 1,
            }),
        },
    );
    b.launch(
        0,
        Stream::Replicate,
        TAG,
        Kernel::IfFinite {
            norm: g.clone(),
            kernel: Box::new(Kernel::Add {
                dst: p.clone(),
                src: p,
                accumulate: true,
            }),
        },
    );
    let errors: Vec<String> = b.errors().iter().map(|e| e.3.to_string()).collect();
    assert!(
        errors.iter().any(|e| e.contains("norm guarding the step")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("guards optimizers")),
        "{errors:?}"
    );
}
