//! Reference math: the optimizers and the bfloat16 rounding every backend must match.
//!
//! This module is the ground truth GPU kernels are tested against, so it favours being
//! exactly specified over being fast. The invariant it keeps: every function is a pure,
//! deterministic function of its inputs (same inputs, same bits), with a documented
//! precision:
//!
//! - element-wise updates ([`adamw`], [`muon`]'s momentum and update) read the `f32`
//!   inputs, compute in `f64` and round each stored value to `f32` once;
//! - [`newton_schulz`] runs entirely in `f64` and rounds its result to `f32` at the end.
//!
//! A GPU kernel computing in `f32` therefore agrees with these to within a few ulps per
//! element (plus the conditioning of Newton–Schulz for Muon).

use crate::{AdamwParams, MuonParams};

/// Quintic Newton–Schulz coefficients (Keller Jordan's Muon): `a·X + b·A·X + c·A²·X`.
const NS_A: f64 = 3.4445;
const NS_B: f64 = -4.7750;
const NS_C: f64 = 2.0315;
/// Added to the Frobenius norm before normalising, as in Muon.
const NS_EPS: f64 = 1e-7;
/// Muon's update scale per `sqrt(max(rows, cols))`.
const MUON_SCALE: f64 = 0.2;

/// One AdamW step on a piece of a parameter, in place.
///
/// Decoupled weight decay first (`p *= 1 - lr·wd`), then `m = β1·m + (1-β1)·g`,
/// `v = β2·v + (1-β2)·g²`, and `p -= lr · m̂ / (sqrt(v̂) + eps)` with the bias-corrected
/// `m̂ = m / (1 - β1^step)`, `v̂ = v / (1 - β2^step)`. `step` is 1-based; the update
/// uses the `f64` moments before they are rounded to `f32` for storage.
///
/// # Panics
///
/// When `grad`, `m` or `v` is not as long as `param`, or `step` is 0 (no bias
/// correction exists for it). Backends check both before calling.
pub fn adamw(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamwParams,
    step: u64,
) {
    assert!(
        grad.len() == param.len() && m.len() == param.len() && v.len() == param.len(),
        "adamw: param, grad, m and v must have the same length"
    );
    assert!(step >= 1, "adamw: step is 1-based");
    let lr = f64::from(hp.lr);
    let (b1, b2) = (f64::from(hp.beta1), f64::from(hp.beta2));
    let eps = f64::from(hp.eps);
    let decay = 1.0 - lr * f64::from(hp.weight_decay);
    // `step as f64` is exact up to 2^53 steps.
    let bc1 = 1.0 - b1.powf(step as f64);
    let bc2 = 1.0 - b2.powf(step as f64);
    for (((p, &g), m), v) in param
        .iter_mut()
        .zip(grad)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
    {
        let g = f64::from(g);
        let m_new = b1 * f64::from(*m) + (1.0 - b1) * g;
        let v_new = b2 * f64::from(*v) + (1.0 - b2) * g * g;
        *m = m_new as f32;
        *v = v_new as f32;
        let update = lr * (m_new / bc1) / ((v_new / bc2).sqrt() + eps);
        *p = (f64::from(*p) * decay - update) as f32;
    }
}

/// Orthogonalises a row-major `rows × cols` matrix with `steps` quintic Newton–Schulz
/// iterations, as Muon does.
///
/// `X = G / (‖G‖_F + 1e-7)`, working on `Gᵀ` when `rows > cols` (so `X X^T` is the
/// smaller Gram matrix); then `steps` times `A = X Xᵀ`, `B = b·A + c·A²`,
/// `X = a·X + B·X`; the result is transposed back. The iteration drives every singular
/// value of the normalised matrix towards ~1 (into about `[0.68, 1.12]` after five
/// steps: the quintic trades exactness for speed) while keeping the singular vectors.
///
/// Computed in `f64`; `O(min(r,c)² · max(r,c))` per iteration.
///
/// # Panics
///
/// When `g.len() != rows * cols`.
pub fn newton_schulz(g: &[f32], rows: usize, cols: usize, steps: u32) -> Vec<f32> {
    assert_eq!(
        Some(g.len()),
        rows.checked_mul(cols),
        "newton_schulz: g must hold rows × cols elements"
    );
    if g.is_empty() {
        return Vec::new();
    }
    let transposed = rows > cols;
    // Work on an `m × n` matrix with `m <= n`.
    let (m, n) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let mut x: Vec<f64> = if transposed {
        transpose(g, rows, cols)
            .into_iter()
            .map(f64::from)
            .collect()
    } else {
        g.iter().copied().map(f64::from).collect()
    };
    let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt() + NS_EPS;
    x.iter_mut().for_each(|v| *v /= norm);

    let mut a = vec![0.0; m * m];
    let mut b = vec![0.0; m * m];
    let mut bx = vec![0.0; m * n];
    for _ in 0..steps {
        gram(&x, m, n, &mut a);
        // `A` is symmetric, so `A·A = A·Aᵀ`.
        gram(&a, m, m, &mut b);
        b.iter_mut()
            .zip(&a)
            .for_each(|(b, &a)| *b = NS_B * a + NS_C * *b);
        matmul(&b, &x, m, n, &mut bx);
        x.iter_mut()
            .zip(&bx)
            .for_each(|(x, &bx)| *x = NS_A * *x + bx);
    }
    let out: Vec<f32> = x.into_iter().map(|v| v as f32).collect();
    if transposed {
        transpose(&out, m, n)
    } else {
        out
    }
}

/// One Muon step on a whole row-major `rows × cols` matrix, in place.
///
/// `buf = μ·buf + g`; Nesterov input `u = g + μ·buf` (from the stored `buf`, rounded to
/// `f32`); `o = newton_schulz(u)`; then `p = p·(1 - lr·wd) - lr·0.2·sqrt(max(rows, cols))·o`.
///
/// # Panics
///
/// When `param`, `grad` or `momentum` does not hold `rows × cols` elements.
pub fn muon(
    param: &mut [f32],
    grad: &[f32],
    momentum: &mut [f32],
    rows: usize,
    cols: usize,
    hp: &MuonParams,
) {
    let numel = rows.checked_mul(cols);
    assert!(
        numel == Some(param.len()) && numel == Some(grad.len()) && numel == Some(momentum.len()),
        "muon: param, grad and momentum must hold rows × cols elements"
    );
    let mu = f64::from(hp.momentum);
    let u: Vec<f32> = momentum
        .iter_mut()
        .zip(grad)
        .map(|(buf, &g)| {
            let g = f64::from(g);
            *buf = (mu * f64::from(*buf) + g) as f32;
            (g + mu * f64::from(*buf)) as f32
        })
        .collect();
    let o = newton_schulz(&u, rows, cols, hp.ns_steps);
    let lr = f64::from(hp.lr);
    let decay = 1.0 - lr * f64::from(hp.weight_decay);
    let scale = lr * MUON_SCALE * (rows.max(cols) as f64).sqrt();
    for (p, &o) in param.iter_mut().zip(&o) {
        *p = (f64::from(*p) * decay - scale * f64::from(o)) as f32;
    }
}

/// Rounds to the nearest bfloat16 (ties to even) and widens back to `f32`.
///
/// NaN stays NaN (quiet); values beyond the largest bfloat16 round to infinity.
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return f32::NAN.copysign(x);
    }
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    f32::from_bits(bits.wrapping_add(0x7fff + lsb) & 0xffff_0000)
}

/// The transpose of a row-major `rows × cols` matrix.
fn transpose<T: Copy + Default>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut t = vec![T::default(); x.len()];
    for (i, row) in x.chunks_exact(cols).enumerate() {
        for (j, &v) in row.iter().enumerate() {
            t[j * rows + i] = v;
        }
    }
    t
}

/// `out = x·xᵀ` for a row-major `m × n` matrix `x` (`out` is `m × m`): row dot products,
/// each computed once and mirrored.
fn gram(x: &[f64], m: usize, n: usize, out: &mut [f64]) {
    for i in 0..m {
        let xi = &x[i * n..(i + 1) * n];
        for j in i..m {
            let xj = &x[j * n..(j + 1) * n];
            let dot = xi.iter().zip(xj).map(|(a, b)| a * b).sum::<f64>();
            out[i * m + j] = dot;
            out[j * m + i] = dot;
        }
    }
}

/// `out = a·x` for a row-major `m × m` matrix `a` and `m × n` matrix `x`, in `i-k-j`
/// order so the inner loop streams rows of `x` and `out`.
fn matmul(a: &[f64], x: &[f64], m: usize, n: usize, out: &mut [f64]) {
    for (out_row, a_row) in out.chunks_exact_mut(n).zip(a.chunks_exact(m)) {
        out_row.fill(0.0);
        for (&aik, x_row) in a_row.iter().zip(x.chunks_exact(n)) {
            out_row
                .iter_mut()
                .zip(x_row)
                .for_each(|(o, &xv)| *o += aik * xv);
        }
    }
}

/// `len` deterministic values in `[-1, 1)` from `seed` (xorshift): inputs for checks
/// that compare a backend with this module's reference math.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `Σ x²` of a slice, accumulated in f64 (the global norm's reference and the CPU
/// kernel alike).
pub fn sum_squares(xs: &[f32]) -> f64 {
    xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

/// The factor torch's `clip_grad_norm_` scales gradients by, from the squared global
/// norm: `min(1, max_norm / (√sq + 1e-6))`, as f32; `None` when the gradients stay as
/// they are (the factor is 1, or the norm is not finite and the step is skipped).
pub fn clip_factor(sq: f64, max_norm: f32) -> Option<f32> {
    if !sq.is_finite() {
        return None;
    }
    let f = f64::from(max_norm) / (sq.sqrt() + 1e-6);
    (f < 1.0).then_some(f as f32)
}

/// `xs *= f`.
pub fn scale(xs: &mut [f32], f: f32) {
    for x in xs {
        *x *= f;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::pseudo_random as random;

    /// Eigenvalues of a symmetric matrix (cyclic Jacobi), for checking singular values.
    fn symmetric_eigenvalues(mut a: Vec<f64>, n: usize) -> Vec<f64> {
        for _sweep in 0..100 {
            let off: f64 = (0..n)
                .flat_map(|i| (0..n).map(move |j| (i, j)))
                .filter(|(i, j)| i != j)
                .map(|(i, j)| a[i * n + j].powi(2))
                .sum();
            if off < 1e-22 {
                break;
            }
            for p in 0..n {
                for q in p + 1..n {
                    let apq = a[p * n + q];
                    if apq.abs() < 1e-300 {
                        continue;
                    }
                    let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                    let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                    let t = if theta == 0.0 { 1.0 } else { t };
                    let c = 1.0 / (t * t + 1.0).sqrt();
                    let s = t * c;
                    for k in 0..n {
                        let (akp, akq) = (a[k * n + p], a[k * n + q]);
                        a[k * n + p] = c * akp - s * akq;
                        a[k * n + q] = s * akp + c * akq;
                    }
                    for k in 0..n {
                        let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                        a[p * n + k] = c * apk - s * aqk;
                        a[q * n + k] = s * apk + c * aqk;
                    }
                }
            }
        }
        (0..n).map(|i| a[i * n + i]).collect()
    }

    /// Singular values of a row-major `rows × cols` matrix with `rows <= cols`.
    fn singular_values(o: &[f32], rows: usize, cols: usize) -> Vec<f64> {
        let x: Vec<f64> = o.iter().copied().map(f64::from).collect();
        let mut g = vec![0.0; rows * rows];
        gram(&x, rows, cols, &mut g);
        symmetric_eigenvalues(g, rows)
            .into_iter()
            .map(f64::sqrt)
            .collect()
    }

    #[test]
    fn adamw_first_step_matches_hand_computation() {
        let hp = AdamwParams {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let (mut p, mut m, mut v) = ([1.0f32, -2.0], [0.0f32; 2], [0.0f32; 2]);
        adamw(&mut p, &[0.5, -0.25], &mut m, &mut v, &hp, 1);
        // Decay: 1 · (1 - 0.01) = 0.99; m̂ = g, v̂ = g², so the update is lr·g/(|g| + eps).
        let expect_p = [
            0.99 - 0.1 * 0.5 / (0.5 + 1e-8),
            -1.98 + 0.1 * 0.25 / (0.25 + 1e-8),
        ];
        for (got, want) in p.iter().zip(expect_p) {
            assert!(
                (f64::from(*got) - want).abs() < 1e-7,
                "param {got} vs {want}"
            );
        }
        // Moments from the f32 hyper-parameters: m = (1 - 0.9f32)·g, v = (1 - 0.999f32)·g².
        let one_minus = |b: f32| 1.0 - f64::from(b);
        assert_eq!(
            m,
            [
                (one_minus(0.9) * 0.5) as f32,
                (one_minus(0.9) * -0.25) as f32
            ]
        );
        assert_eq!(
            v,
            [
                (one_minus(0.999) * 0.25) as f32,
                (one_minus(0.999) * 0.0625) as f32
            ]
        );
    }

    #[test]
    fn adamw_second_step_uses_bias_correction() {
        let hp = AdamwParams {
            lr: 0.01,
            weight_decay: 0.0,
            ..AdamwParams::default()
        };
        let (mut p, mut m, mut v) = ([0.0f32], [0.0f32], [0.0f32]);
        adamw(&mut p, &[1.0], &mut m, &mut v, &hp, 1);
        adamw(&mut p, &[1.0], &mut m, &mut v, &hp, 2);
        // A constant gradient has m̂ = v̂ = 1 at every step: each update is lr/(1 + eps).
        assert!((p[0] + 0.02).abs() < 1e-8, "{}", p[0]);
    }

    #[test]
    fn newton_schulz_drives_singular_values_towards_one() {
        let (rows, cols) = (24, 40);
        let g = random(rows * cols, 7);
        let o = newton_schulz(&g, rows, cols, 5);
        let sv = singular_values(&o, rows, cols);
        let (lo, hi) = sv
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &s| (lo.min(s), hi.max(s)));
        // The quintic's coefficients trade exactness for speed: after five steps the
        // singular values oscillate in about [0.68, 1.12] instead of converging to 1.
        assert!(lo > 0.65 && hi < 1.15, "singular values in [{lo}, {hi}]");
        // Before the iteration the normalised matrix's singular values are far below 1.
        let x0 = newton_schulz(&g, rows, cols, 0);
        let sv0 = singular_values(&x0, rows, cols);
        assert!(sv0.iter().all(|&s| s < 0.5), "{sv0:?}");
    }

    #[test]
    fn newton_schulz_of_a_tall_matrix_is_the_transpose_of_its_transpose() {
        let (rows, cols) = (33, 12);
        let g = random(rows * cols, 11);
        let tall = newton_schulz(&g, rows, cols, 5);
        let wide = newton_schulz(&transpose(&g, rows, cols), cols, rows, 5);
        assert_eq!(tall, transpose(&wide, cols, rows));
    }

    #[test]
    fn newton_schulz_of_an_empty_matrix_is_empty() {
        assert!(newton_schulz(&[], 0, 5, 5).is_empty());
    }

    #[test]
    fn muon_applies_momentum_nesterov_and_scaled_update() {
        let (rows, cols) = (4, 6);
        let hp = MuonParams {
            lr: 0.1,
            momentum: 0.5,
            ns_steps: 5,
            weight_decay: 0.2,
            ..MuonParams::default()
        };
        let g = random(rows * cols, 3);
        let mut buf = random(rows * cols, 5);
        let buf0 = buf.clone();
        let mut p = vec![1.0f32; rows * cols];
        muon(&mut p, &g, &mut buf, rows, cols, &hp);
        let buf_want: Vec<f32> = buf0
            .iter()
            .zip(&g)
            .map(|(&b, &g)| (0.5 * f64::from(b) + f64::from(g)) as f32)
            .collect();
        assert_eq!(buf, buf_want);
        let u: Vec<f32> = g
            .iter()
            .zip(&buf)
            .map(|(&g, &b)| (f64::from(g) + 0.5 * f64::from(b)) as f32)
            .collect();
        let o = newton_schulz(&u, rows, cols, 5);
        let scale = 0.1 * 0.2 * 6f64.sqrt();
        for (got, o) in p.iter().zip(&o) {
            let want = (1.0 - 0.1 * f64::from(0.2f32)) - scale * f64::from(*o);
            assert!((f64::from(*got) - want).abs() < 1e-6, "{got} vs {want}");
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        let above_one = |k: i32| 1.0 + 2f32.powi(-k);
        assert_eq!(round_bf16(1.0), 1.0);
        assert_eq!(round_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        assert_eq!(round_bf16(above_one(8)), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), above_one(6));
        // Just above the halfway point rounds up.
        assert_eq!(round_bf16(above_one(8) + 2f32.powi(-20)), above_one(7));
        assert_eq!(round_bf16(std::f32::consts::PI), 3.140625);
        assert_eq!(round_bf16(-std::f32::consts::PI), -3.140625);
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert!(round_bf16(f32::NAN).is_nan());
    }

    proptest::proptest! {
        #[test]
        fn bf16_is_the_nearest_representable(bits in 0u32..0x7f7f_0000) {
            let x = f32::from_bits(bits);
            let r = round_bf16(x);
            proptest::prop_assert_eq!(r.to_bits() & 0xffff, 0);
            // No bfloat16 neighbour of the result is strictly closer to x.
            let ulp = f32::from_bits(r.to_bits() + 0x1_0000) - r;
            proptest::prop_assert!((r - x).abs() <= ulp / 2.0);
        }
    }

    #[test]
    fn clip_factor_is_torchs_and_leaves_small_or_non_finite_norms_alone() {
        assert_eq!(super::sum_squares(&[3.0, 4.0]), 25.0);
        let f = super::clip_factor(25.0, 1.0).unwrap();
        assert!((f64::from(f) - 1.0 / 5.000001).abs() < 1e-7);
        assert_eq!(super::clip_factor(0.25, 1.0), None);
        assert_eq!(super::clip_factor(f64::NAN, 1.0), None);
        assert_eq!(super::clip_factor(f64::INFINITY, 1.0), None);
    }
}
