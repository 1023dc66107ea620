//! Muon on the GPU, the matrices of a flush in classes that share `m = min(rows, cols)`,
//! the precision ([`crate::NsDtype`]) and the iteration count: per batch of same-shape
//! matrices, the momentum and Nesterov input written straight into the working
//! precision with each block's sum of squares (one launch), the norms and the
//! normalisation (two), then every quintic iteration in lockstep across the class's
//! batches, as three kinds of strided-batched cuBLASLt products, then the scaled
//! updates (one launch per batch).
//!
//! The working matrix `X` is `m × n` with `m ≤ n` (the gradient, or its transpose when
//! `rows > cols`, as in [`crate::math::newton_schulz`]). A matrix is never transposed
//! in memory: cuBLAS is column-major, so the buffer holding a wide matrix row-major is
//! `Y = Xᵀ` (`n × m`, leading dimension `n`) to cuBLAS, and the buffer holding a tall
//! one row-major is `X` itself (`m × n`, leading dimension `m`). Each iteration:
//!
//! - per batch, `A = X·Xᵀ` (`m × m`): `Yᵀ·Y` for a wide matrix, `X·Xᵀ` for a tall one,
//!   into the class's `A` array;
//! - once for the whole class, `B = c·A·A + b·A`: one product over every `m × m`
//!   matrix of the class (so its grid fills the GPU, where one batch's would leave
//!   most of the last wave idle), `A` read as operand and as `C`, `B` written;
//! - per batch, `X' = a·X + B·X`: `Y' = Y·Bᵀ + a·Y` (wide) or `X' = B·X + a·X` (tall),
//!   `X` read as operand and as `C`, `X'` written to the other buffer.
//!
//! cuBLASLt's separate `C` and `D` make those three products the whole iteration: no
//! copy of `A` into `B` and no shift of `B`'s diagonal, and the `a·X` term is added in
//! f32 in the product's epilogue. Every matrix's region starts 256-byte aligned.
//!
//! In bf16 the operands and results are bfloat16 and the products accumulate in f32 on
//! the tensor cores (as `torch.optim.Muon`, which also takes the norm of the bf16
//! matrix); in TF32 the f32 operands are rounded to TF32 inside the products; in f32
//! the products are full f32. The distance of each from the f64 reference is measured
//! in `docs/performance.md`.
//!
//! Guarded by [`crate::Kernel::IfFinite`], the two kernels that write persistent state
//! (the momentum, then the parameter) read the squared global norm on the device and do
//! nothing when it is not finite; the norm, Newton–Schulz and its GEMMs still run, on
//! scratch only, so a skipped step costs what a taken one does and needs no host
//! synchronisation.
//!
//! Invariant: everything runs on the stream the Muon node is bound to, with that
//! stream's cuBLAS handles and scratch, so stream order alone protects the scratch.

use std::sync::Arc;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::sys;

use super::kernels::Kernels;
use super::lt::{Lt, LtShape};
use super::memory::{DevMem, Memory};
use super::optim::{MuonMats, Working, MB_MAX_BLOCKS};
use crate::{MuonParams, NsDtype, OpsError};

/// Quintic coefficients, as in [`crate::math::newton_schulz`].
const NS_A: f32 = 3.4445;
const NS_B: f32 = -4.7750;
const NS_C: f32 = 2.0315;
/// cuBLAS workspace per handle (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;
/// Alignment of scratch regions and of every matrix in them, in bytes.
const ALIGN: usize = 256;
/// Most scratch bytes of one class (`ClassLayout`): a class larger than this is
/// split, so that lockstep never costs much more memory than one batch at a time.
const CLASS_BYTES: usize = 1 << 30;

/// A cuBLAS handle bound to one stream, with its own workspace.
pub(super) struct Blas {
    handle: blas_sys::cublasHandle_t,
    _workspace: Arc<DevMem>,
    /// The cuBLASLt handle of the same stream (Newton–Schulz).
    pub(super) lt: Lt,
}

// SAFETY: the handle is used by one thread at a time (under the backend's issue lock)
// with the context bound.
unsafe impl Send for Blas {}

fn blas_err(what: &str, e: blas::CublasError) -> OpsError {
    OpsError::Backend(format!("cuBLAS {what}: {:?}", e.0))
}

impl Blas {
    /// A handle issuing on `stream`. The caller has the context bound.
    pub(super) fn new(stream: sys::CUstream, memory: &Arc<Memory>) -> Result<Blas, OpsError> {
        let handle = blas::create_handle().map_err(|e| blas_err("cublasCreate", e))?;
        let workspace = memory.alloc_raw(WORKSPACE_BYTES)?;
        // SAFETY: a fresh handle, a live stream and workspace of the stated size. The
        // stream is set first: cublasSetStream resets the workspace to the default pool.
        unsafe {
            blas::set_stream(handle, stream as blas_sys::cudaStream_t)
                .map_err(|e| blas_err("cublasSetStream", e))?;
            blas_sys::cublasSetWorkspace_v2(
                handle,
                workspace.ptr() as *mut std::ffi::c_void,
                workspace.bytes(),
            )
            .result()
            .map_err(|e| blas_err("cublasSetWorkspace", e))?;
            // Full-precision SGEMM: no TF32 (which would round inputs to 10 bits).
            blas_sys::cublasSetMathMode(handle, blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
                .result()
                .map_err(|e| blas_err("cublasSetMathMode", e))?;
        }
        let lt = Lt::new(memory).inspect_err(|_| {
            // SAFETY: the handle made above, not used by anything else.
            let _ = unsafe { blas::destroy_handle(handle) };
        })?;
        Ok(Blas {
            handle,
            _workspace: workspace,
            lt,
        })
    }

    /// Destroys the handle. The caller has the context bound.
    pub(super) fn destroy(&self) {
        self.lt.destroy();
        // SAFETY: destroyed once, when the backend is dropped.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }

    /// `C = A·B` with bf16 `A` (`m × k`), `B` (`k × n`) and `C` (`m × n`), all
    /// row-major, accumulated in f32 (tensor cores): what `torch.mm` issues for bf16
    /// tensors (row-major `C = A·B` is column-major `Cᵀ = Bᵀ·Aᵀ`).
    pub(super) fn gemm_bf16(
        &self,
        (m, n, k): (i32, i32, i32),
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<(), OpsError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf16 = blas_sys::cudaDataType::CUDA_R_16BF;
        let n_op = blas_sys::cublasOperation_t::CUBLAS_OP_N;
        // SAFETY: the caller passes device matrices of the stated shapes (operands it
        // owns, and scratch of this handle's stream); alpha and beta are host scalars
        // read at the call, of the compute type's precision (f32).
        unsafe {
            blas::gemm_ex(
                self.handle,
                n_op,
                n_op,
                n,
                m,
                k,
                (&alpha as *const f32).cast(),
                b as *const std::ffi::c_void,
                bf16,
                n,
                a as *const std::ffi::c_void,
                bf16,
                k,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                bf16,
                n,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| OpsError::Failed {
            kernel: "gemm",
            reason: format!("cublasGemmEx: {:?}", e.0),
        })
    }
}

/// One batch of a class: up to [`super::optim::MUON_MATS`] matrices of one shape with
/// their hyper-parameters (their guard, [`crate::Kernel::IfFinite`]'s squared norm, is
/// in `mats`).
pub(super) struct Batch {
    pub(super) shape: (usize, usize),
    pub(super) mats: MuonMats,
    pub(super) count: usize,
    pub(super) hp: MuonParams,
}

/// A batch's scratch regions, as byte offsets, and where its matrices start in the
/// class's `A` and `B` arrays.
#[derive(Debug, Clone)]
struct BatchRegions {
    shape: (usize, usize),
    count: usize,
    /// Elements from one working matrix to the next (`m·n` rounded up so that each
    /// starts aligned).
    xstride: usize,
    y: usize,
    z: usize,
    partial: usize,
    norms: usize,
    /// The batch's first matrix in the `A` and `B` arrays.
    first: usize,
}

/// Where each scratch region of a class lies: per batch its two working buffers, its
/// partial sums and norms; for the class one `A` and one `B` array of every matrix's
/// `m × m` products, `astride` elements apart (and with [`gram`] two more, `c` and
/// `d`).
#[derive(Debug, Clone)]
pub(super) struct ClassLayout {
    m: usize,
    dtype: NsDtype,
    /// Whether the class iterates on the Gram matrix ([`gram`]).
    gram: bool,
    batches: Vec<BatchRegions>,
    astride: usize,
    a: usize,
    b: usize,
    c: usize,
    d: usize,
    /// Matrices in the class.
    total: usize,
    /// Total bytes.
    pub(super) bytes: usize,
}

/// Elements of `esize` bytes rounded up to a whole number of [`ALIGN`] bytes.
fn aligned_elems(elems: usize, esize: usize) -> Option<usize> {
    elems.checked_next_multiple_of(ALIGN / esize)
}

impl ClassLayout {
    /// The scratch of a class of batches (`(rows, cols)` and matrix count each, every
    /// one with the same `min(rows, cols)`) in `dtype`, or `None` if it overflows.
    pub(super) fn new(batches: &[((usize, usize), usize)], dtype: NsDtype) -> Option<Self> {
        let m = batches.first().map(|((r, c), _)| *r.min(c))?;
        let esize = dtype_size(dtype);
        let mut at = 0usize;
        let mut region = |bytes: usize| -> Option<usize> {
            let start = at;
            at = at.checked_add(bytes.checked_next_multiple_of(ALIGN)?)?;
            Some(start)
        };
        let mut regions = Vec::with_capacity(batches.len());
        let mut total = 0usize;
        for &((rows, cols), count) in batches {
            debug_assert_eq!(rows.min(cols), m);
            let xstride = aligned_elems(rows.checked_mul(cols)?, esize)?;
            let xbytes = xstride.checked_mul(count)?.checked_mul(esize)?;
            regions.push(BatchRegions {
                shape: (rows, cols),
                count,
                xstride,
                y: region(xbytes)?,
                z: region(xbytes)?,
                partial: region(count.checked_mul(MB_MAX_BLOCKS as usize * 8)?)?,
                norms: region(count.checked_mul(8)?)?,
                first: total,
            });
            total = total.checked_add(count)?;
        }
        let astride = aligned_elems(m.checked_mul(m)?, esize)?;
        let abytes = astride.checked_mul(total)?.checked_mul(esize)?;
        let (a, b) = (region(abytes)?, region(abytes)?);
        let gram = gram(batches[0].0, dtype);
        let (c, d) = if gram {
            (region(abytes)?, region(abytes)?)
        } else {
            (a, b)
        };
        Some(ClassLayout {
            m,
            dtype,
            gram,
            batches: regions,
            astride,
            a,
            b,
            c,
            d,
            total,
            bytes: at,
        })
    }
}

/// Whether matrices of `shape` in `dtype` iterate on their Gram matrix: in bf16, when
/// `max(rows, cols) ≥ 2.5 · min(rows, cols)`.
///
/// Newton–Schulz's iterates are `X_k = Q_k·X_0` with `Q_k` a polynomial in
/// `R = X_0·X_0ᵀ` (`m × m`), so the iteration can run on `m × m` matrices only: `Z =
/// a·I + b·R + c·R²`, `Q ← Z·Q`, `R ← Z·R·Z`, and `X = Q·X_0` at the end. That is `8m³`
/// an iteration against `4m²n + 2m³`, plus `4m²n` once: fewer products when `n` is
/// well above `m` (about 26 % fewer at `n = 3m`, 33 % at `n = 4m`). In bf16 the `m × m`
/// products drift away from a polynomial of `R` and the iteration diverges, so it
/// restarts from `X = Q·X_0` before every third iteration (before the fourth of
/// Muon's five): measured against the f64 reference (`scripts/ns_gram_probe.py`,
/// docs/performance.md) it is then as close as the direct iteration (0.021 against
/// 0.023 on Gaussian 768 × 3072 matrices, 0.15 against 0.22 on low-rank ones). In f32
/// the direct iteration is kept: its error there is far below the Gram iteration's
/// (1.7e-5 against 4.3e-4 in the same probe); TF32 keeps it too (not probed).
fn gram((rows, cols): (usize, usize), dtype: NsDtype) -> bool {
    let (m, n) = (rows.min(cols), rows.max(cols));
    dtype == NsDtype::Bf16 && n.saturating_mul(2) >= m.saturating_mul(5)
}

/// Iterations between restarts of the Gram iteration ([`gram`]).
const GRAM_RESTART: u32 = 3;

fn dtype_size(dtype: NsDtype) -> usize {
    if dtype == NsDtype::Bf16 {
        2
    } else {
        4
    }
}

/// Splits `batches` (in order) into classes that can run in lockstep: the same `m`,
/// precision and iteration count, and at most [`CLASS_BYTES`] of scratch unless one
/// batch alone needs more. Returns each class's batch indices.
pub(super) fn classes(batches: &[&Batch]) -> Vec<Vec<usize>> {
    type Key = (usize, NsDtype, u32, bool);
    let key = |b: &Batch| {
        let (m, dtype) = (b.shape.0.min(b.shape.1), b.hp.ns_dtype);
        (m, dtype, b.hp.ns_steps, gram(b.shape, dtype))
    };
    let mut out: Vec<(Key, Vec<usize>)> = Vec::new();
    for (i, b) in batches.iter().enumerate() {
        let k = key(b);
        let fits = |members: &[usize]| {
            let mut dims: Vec<_> = members
                .iter()
                .map(|&j| (batches[j].shape, batches[j].count))
                .collect();
            dims.push((b.shape, b.count));
            ClassLayout::new(&dims, k.1).is_some_and(|l| l.bytes <= CLASS_BYTES)
        };
        match out.iter_mut().rev().find(|(ck, _)| *ck == k) {
            Some((_, members)) if fits(members) => members.push(i),
            _ => out.push((k, vec![i])),
        }
    }
    out.into_iter().map(|(_, members)| members).collect()
}

/// Runs the Muon steps of a class's `batches` (each with the device addresses of its
/// [`super::optim::muon_scalars`] and of its [`MuonMats`]' words) on `stream` with `scratch` laid out by `layout`:
/// per batch the momentum into the working precision (one launch), then the norms and
/// Newton–Schulz of the whole class in lockstep, then per batch the updates (one
/// launch).
pub(super) fn run_class(
    kernels: &Kernels,
    blas: &Blas,
    stream: sys::CUstream,
    (scratch, layout): (u64, &ClassLayout),
    batches: &[(&Batch, u64, u64)],
) -> Result<(), OpsError> {
    let Some((first, _, _)) = batches.first() else {
        return Ok(());
    };
    let steps = first.hp.ns_steps;
    let at = |off: usize| scratch + off as u64;
    let fns = &kernels.optim;
    let bf16 = layout.dtype == NsDtype::Bf16;
    let working = |r: &BatchRegions, x: usize| Working {
        x: at(x),
        numel: (r.shape.0 * r.shape.1) as u64,
        stride: r.xstride as u64,
        bf16,
    };
    for ((b, sc, mats), r) in batches.iter().zip(&layout.batches) {
        let w = working(r, r.y);
        fns.mb_momentum(stream, (*mats, b.mats.count()), (w, at(r.partial)), *sc)?;
    }
    for r in &layout.batches {
        let count = u32::try_from(r.count).map_err(|_| too_big(r))?;
        fns.mb_normalise(stream, (working(r, r.y), count), at(r.partial), at(r.norms))?;
    }
    let ns = Lockstep::new(layout, scratch)?;
    let in_z = if layout.gram {
        ns.gram_iterations(&blas.lt, kernels, stream, steps)?
    } else {
        for i in 0..steps {
            ns.iteration(&blas.lt, stream, i % 2 == 1)?;
        }
        // The iterations alternate between Y and Z: the result is in Z after an odd
        // count.
        steps % 2 == 1
    };
    for ((b, sc, mats), r) in batches.iter().zip(&layout.batches) {
        let w = working(r, if in_z { r.z } else { r.y });
        fns.mb_update(stream, ((*mats, b.mats.count()), w), *sc)?;
    }
    Ok(())
}

fn too_big(r: &BatchRegions) -> OpsError {
    OpsError::Shape {
        kernel: "muon",
        reason: format!(
            "a batch of {} {} × {} matrices exceeds cuBLAS's 32-bit dimensions",
            r.count, r.shape.0, r.shape.1
        ),
    }
}

/// A class's Newton–Schulz iterations as cuBLASLt products: per batch the shapes of
/// `A = X·Xᵀ` and `X' = a·X + B·X` with its buffers, and the class's `B = c·A·A + b·A`.
struct Lockstep {
    batches: Vec<LockstepBatch>,
    /// `B = c·A·A + b·A` over every matrix of the class (and every `m × m` product of
    /// the Gram iteration).
    square: LtShape,
    /// The class's `m × m` arrays: `A`, `B`, then (Gram iteration) two more.
    arrays: [u64; 4],
    m: u64,
    /// Elements between consecutive matrices of an array.
    astride: u64,
    total: u32,
    bf16: bool,
}

/// One batch's products in [`Lockstep`].
struct LockstepBatch {
    gram: LtShape,
    apply: LtShape,
    /// Whether the matrices have more rows than columns (`X` is then `Gᵀ`).
    tall: bool,
    /// Its working buffers.
    y: u64,
    z: u64,
    /// Its first matrix's offset in bytes in each `m × m` array.
    first: u64,
}

impl Lockstep {
    fn new(layout: &ClassLayout, scratch: u64) -> Result<Lockstep, OpsError> {
        let (dtype, m) = (layout.dtype, layout.m as u64);
        let esize = dtype_size(dtype) as u64;
        let astride = layout.astride as i64;
        let total = i32::try_from(layout.total).map_err(|_| OpsError::Shape {
            kernel: "muon",
            reason: format!("{} matrices in one batch exceed cuBLAS's int", layout.total),
        })?;
        let at = |off: usize| scratch + off as u64;
        let mi = m as i64;
        let mut batches = Vec::with_capacity(layout.batches.len());
        for r in &layout.batches {
            let count = i32::try_from(r.count).map_err(|_| too_big(r))?;
            let (rows, cols) = r.shape;
            let tall = rows > cols;
            let n = rows.max(cols) as u64;
            let ni = n as i64;
            let xs = r.xstride as i64;
            let lt = |trans, mnk, ld, stride| LtShape {
                dtype,
                trans,
                mnk,
                ld,
                stride,
                count,
            };
            let (gram, apply) = if tall {
                // X is m × n (ld m): A = X·Xᵀ; X' = B·X + a·X.
                (
                    lt((false, true), (m, m, n), (mi, mi, mi), (xs, xs, astride)),
                    lt((false, false), (m, n, m), (mi, mi, mi), (astride, xs, xs)),
                )
            } else {
                // Y = Xᵀ is n × m (ld n): A = Yᵀ·Y; Y' = Y·Bᵀ + a·Y.
                (
                    lt((true, false), (m, m, n), (ni, ni, mi), (xs, xs, astride)),
                    lt((false, true), (n, m, m), (ni, mi, ni), (xs, astride, xs)),
                )
            };
            batches.push(LockstepBatch {
                gram,
                apply,
                tall,
                y: at(r.y),
                z: at(r.z),
                first: (r.first as u64) * (layout.astride as u64) * esize,
            });
        }
        let square = LtShape {
            dtype,
            trans: (false, false),
            mnk: (m, m, m),
            ld: (mi, mi, mi),
            stride: (astride, astride, astride),
            count: total,
        };
        Ok(Lockstep {
            batches,
            square,
            arrays: [at(layout.a), at(layout.b), at(layout.c), at(layout.d)],
            m,
            astride: layout.astride as u64,
            total: total as u32,
            bf16: dtype == NsDtype::Bf16,
        })
    }

    /// One iteration of every batch: `X` in each batch's `y` (`z` when `swapped`),
    /// `X'` written to the other.
    fn iteration(&self, lt: &Lt, stream: sys::CUstream, swapped: bool) -> Result<(), OpsError> {
        let xs = |b: &LockstepBatch| if swapped { (b.z, b.y) } else { (b.y, b.z) };
        let [a, bb, ..] = self.arrays;
        self.grams(lt, stream, a, swapped)?;
        lt.matmul(stream, &self.square, NS_C, (a, a), NS_B, (a, bb))?;
        for b in &self.batches {
            let (x, next) = xs(b);
            let bm = bb + b.first;
            let operands = if b.tall { (bm, x) } else { (x, bm) };
            lt.matmul(stream, &b.apply, 1.0, operands, NS_A, (x, next))?;
        }
        Ok(())
    }

    /// `R = X·Xᵀ` of every batch into the array at `r` (`X` in `y`, or `z` when `in_z`).
    fn grams(&self, lt: &Lt, stream: sys::CUstream, r: u64, in_z: bool) -> Result<(), OpsError> {
        for b in &self.batches {
            let x = if in_z { b.z } else { b.y };
            lt.matmul(
                stream,
                &b.gram,
                1.0,
                (x, x),
                0.0,
                (r + b.first, r + b.first),
            )?;
        }
        Ok(())
    }

    /// `X' = Q·X` of every batch (`Q` in the array at `q`, `X` in `y` or `z`), into the
    /// other buffer.
    fn applies(&self, lt: &Lt, stream: sys::CUstream, q: u64, in_z: bool) -> Result<(), OpsError> {
        for b in &self.batches {
            let (x, next) = if in_z { (b.z, b.y) } else { (b.y, b.z) };
            let qm = q + b.first;
            let operands = if b.tall { (qm, x) } else { (x, qm) };
            lt.matmul(stream, &b.apply, 1.0, operands, 0.0, (next, next))?;
        }
        Ok(())
    }

    /// `D = A·B` over the class's `m × m` arrays.
    fn product(
        &self,
        lt: &Lt,
        stream: sys::CUstream,
        (a, b): (u64, u64),
        d: u64,
    ) -> Result<(), OpsError> {
        lt.matmul(stream, &self.square, 1.0, (a, b), 0.0, (d, d))
    }

    /// Newton–Schulz of every batch iterated on its Gram matrix ([`gram`]), `X_0` in
    /// each batch's `y`, as [`gram_schedule`] orders it; returns whether the result is
    /// in `z` (else `y`).
    fn gram_iterations(
        &self,
        lt: &Lt,
        kernels: &Kernels,
        stream: sys::CUstream,
        steps: u32,
    ) -> Result<bool, OpsError> {
        let (ops, in_z) = gram_schedule(steps);
        let at = |i: usize| self.arrays[i];
        for op in ops {
            match op {
                GramOp::Gram { r, in_z } => self.grams(lt, stream, at(r), in_z)?,
                GramOp::Apply { q, in_z } => self.applies(lt, stream, at(q), in_z)?,
                GramOp::Poly { r, z } => {
                    lt.matmul(
                        stream,
                        &self.square,
                        NS_C,
                        (at(r), at(r)),
                        NS_B,
                        (at(r), at(z)),
                    )?;
                    let dims = (at(z), self.m, self.total);
                    kernels
                        .optim
                        .mb_shift(stream, dims, self.astride, NS_A, self.bf16)?;
                }
                GramOp::Product { a, b, d } => self.product(lt, stream, (at(a), at(b)), at(d))?,
            }
        }
        Ok(in_z)
    }
}

/// One step of the Gram iteration over a class's four `m × m` arrays (by index) and
/// each batch's two working buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GramOp {
    /// `R = X·Xᵀ` per batch into array `r`, `X` in `z` when `in_z` (else `y`).
    Gram { r: usize, in_z: bool },
    /// `X' = Q·X` per batch, `Q` in array `q`, `X` in `z` when `in_z`, into the other.
    Apply { q: usize, in_z: bool },
    /// `Z = c·R·R + b·R + a·I`, arrays `r` to `z`.
    Poly { r: usize, z: usize },
    /// `D = A·B`, arrays.
    Product { a: usize, b: usize, d: usize },
}

/// The Gram iteration of `steps` quintic steps ([`gram`]) as operations over four
/// `m × m` arrays whose roles (`R`, the next `Z`, `Q`, a spare) rotate so that nothing
/// is copied, with a restart (`X_0 = Q·X_0`, `R = X_0·X_0ᵀ`) before every
/// [`GRAM_RESTART`]-th step; and whether the result ends in `z`.
fn gram_schedule(steps: u32) -> (Vec<GramOp>, bool) {
    let (r, mut z, mut q, mut t) = (0, 1, 2, 3);
    let mut in_z = false;
    let mut ops = vec![GramOp::Gram { r, in_z }];
    // Q = I until the first step (and again after a restart).
    let mut q_identity = true;
    for k in 0..steps {
        if k > 0 && k % GRAM_RESTART == 0 {
            ops.push(GramOp::Apply { q, in_z });
            in_z = !in_z;
            ops.push(GramOp::Gram { r, in_z });
            q_identity = true;
        }
        ops.push(GramOp::Poly { r, z });
        let zc = z;
        if q_identity {
            // Q = Z; the old Q's array holds the next Z.
            (z, q) = (q, zc);
            q_identity = false;
        } else {
            // Q = Z·Q into the spare; the old Q's array becomes the spare.
            ops.push(GramOp::Product { a: zc, b: q, d: t });
            (q, t) = (t, q);
        }
        if k + 1 < steps && (k + 1) % GRAM_RESTART != 0 {
            // R = Z·R·Z through the spare.
            ops.push(GramOp::Product { a: zc, b: r, d: t });
            ops.push(GramOp::Product { a: t, b: zc, d: r });
        }
    }
    if steps > 0 {
        ops.push(GramOp::Apply { q, in_z });
        in_z = !in_z;
    }
    (ops, in_z)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_scratch_regions_are_aligned_and_disjoint() {
        for dtype in NsDtype::ALL {
            let dims = [((33, 7), 5), ((7, 96), 3), ((7, 7), 1)];
            let l = ClassLayout::new(&dims, dtype).expect("fits");
            let e = dtype_size(dtype);
            assert_eq!((l.m, l.total), (7, 9));
            let mut regions = vec![(l.a, 9 * l.astride * e), (l.b, 9 * l.astride * e)];
            for (r, &((rows, cols), count)) in l.batches.iter().zip(&dims) {
                assert!(r.xstride >= rows * cols);
                assert_eq!((r.xstride * e) % ALIGN, 0, "every matrix starts aligned");
                regions.push((r.y, count * r.xstride * e));
                regions.push((r.z, count * r.xstride * e));
                regions.push((r.partial, count * MB_MAX_BLOCKS as usize * 8));
                regions.push((r.norms, count * 8));
            }
            if l.gram {
                regions.push((l.c, 9 * l.astride * e));
                regions.push((l.d, 9 * l.astride * e));
            }
            assert_eq!(
                l.gram,
                dtype == NsDtype::Bf16,
                "33 × 7 iterates on its Gram matrix in bf16"
            );
            assert_eq!((l.astride * e) % ALIGN, 0);
            assert_eq!(
                l.batches.iter().map(|r| r.first).collect::<Vec<_>>(),
                [0, 5, 8]
            );
            for (i, &(start, len)) in regions.iter().enumerate() {
                assert_eq!(start % ALIGN, 0);
                assert!(start + len <= l.bytes);
                for &(other, olen) in &regions[i + 1..] {
                    assert!(start + len <= other || other + olen <= start);
                }
            }
        }
        assert!(ClassLayout::new(&[((usize::MAX, 2), 1)], NsDtype::F32).is_none());
        assert!(ClassLayout::new(&[((1 << 31, 1 << 31), 1 << 10)], NsDtype::Bf16).is_none());
        assert!(ClassLayout::new(&[], NsDtype::Bf16).is_none());
    }

    #[test]
    fn classes_join_batches_that_share_m_precision_and_steps_within_the_cap() {
        let batch = |shape: (usize, usize), count: usize, ns: NsDtype, steps: u32| Batch {
            shape,
            mats: MuonMats::of(&[], super::super::optim::FusedClip::default(), 0),
            count,
            hp: MuonParams::default().with_ns_dtype(ns).with_ns_steps(steps),
        };
        let bf = NsDtype::Bf16;
        let batches = [
            batch((768, 2304), 12, bf, 5),
            batch((768, 768), 12, bf, 5),
            batch((3072, 768), 12, bf, 5),
            batch((512, 768), 4, bf, 5),
            batch((768, 3072), 12, NsDtype::F32, 5),
            batch((768, 3072), 12, bf, 4),
            batch((768, 3072), 12, bf, 5),
        ];
        let batches: Vec<&Batch> = batches.iter().collect();
        // The bf16 shapes with n ≥ 2.5 m iterate on the Gram matrix: a class of their own.
        assert_eq!(
            classes(&batches),
            vec![vec![0, 2, 6], vec![1], vec![3], vec![4], vec![5]]
        );
        // Past the cap a class is split: 64 matrices of 4096 × 16384 in bf16 need
        // about 17 GiB each batch; each goes alone.
        let big = [
            batch((4096, 16384), 64, bf, 5),
            batch((16384, 4096), 64, bf, 5),
        ];
        let big: Vec<&Batch> = big.iter().collect();
        assert_eq!(classes(&big), vec![vec![0], vec![1]]);
    }

    /// The Gram schedule run in f64 on the CPU (arrays, buffers and all) ends where
    /// it says with the direct iteration's result: the roles of the four arrays never
    /// overwrite what a later step reads.
    #[test]
    fn the_gram_schedule_computes_the_direct_iteration() {
        type M = Vec<f64>;
        let mul = |a: &M, b: &M, (p, k, q): (usize, usize, usize)| -> M {
            let mut c = vec![0.0; p * q];
            for i in 0..p {
                for l in 0..k {
                    for j in 0..q {
                        c[i * q + j] += a[i * k + l] * b[l * q + j];
                    }
                }
            }
            c
        };
        let t = |a: &M, (p, q): (usize, usize)| -> M {
            let mut o = vec![0.0; p * q];
            for i in 0..p {
                for j in 0..q {
                    o[j * p + i] = a[i * q + j];
                }
            }
            o
        };
        let (m, n) = (6usize, 17usize);
        for steps in 0..8u32 {
            let g = crate::math::pseudo_random(m * n, 40 + u64::from(steps));
            let want = crate::math::newton_schulz(&g, m, n, steps);
            let norm = g.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt() + 1e-7;
            let x0: M = g.iter().map(|&v| f64::from(v) / norm).collect();
            let (ops, in_z) = gram_schedule(steps);
            let mut arrays: Vec<M> = vec![vec![f64::NAN; m * m]; 4];
            let mut bufs: [M; 2] = [x0, vec![f64::NAN; m * n]];
            let (a, b, c) = (f64::from(NS_A), f64::from(NS_B), f64::from(NS_C));
            for op in ops {
                match op {
                    GramOp::Gram { r, in_z } => {
                        let x = &bufs[usize::from(in_z)];
                        arrays[r] = mul(x, &t(x, (m, n)), (m, n, m));
                    }
                    GramOp::Apply { q, in_z } => {
                        let x = mul(&arrays[q], &bufs[usize::from(in_z)], (m, m, n));
                        bufs[usize::from(!in_z)] = x;
                    }
                    GramOp::Poly { r, z } => {
                        let rr = mul(&arrays[r], &arrays[r], (m, m, m));
                        let mut out: M = (0..m * m).map(|i| c * rr[i] + b * arrays[r][i]).collect();
                        (0..m).for_each(|i| out[i * m + i] += a);
                        arrays[z] = out;
                    }
                    GramOp::Product { a, b, d } => {
                        assert!(d != a && d != b, "a product writes one of its operands");
                        arrays[d] = mul(&arrays[a], &arrays[b], (m, m, m));
                    }
                }
            }
            let got = &bufs[usize::from(in_z)];
            for (i, (x, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (x - f64::from(*w)).abs() < 1e-5,
                    "{steps} steps, element {i}: {x} against {w}"
                );
            }
        }
    }
}
