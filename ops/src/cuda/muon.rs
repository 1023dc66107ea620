//! Muon on the GPU, a batch of same-shape matrices at a time: momentum and Nesterov
//! input (element-wise, as the reference, one launch for the batch), the per-matrix
//! norms, the working matrices in the Newton–Schulz precision ([`crate::NsDtype`]),
//! each quintic iteration as three strided-batched cuBLAS GEMMs over the whole batch,
//! then the scaled updates.
//!
//! The working matrix `X` is `m × n` with `m ≤ n` (the gradient, or its transpose when
//! `rows > cols`, as in [`crate::math::newton_schulz`]). A matrix is never transposed
//! in memory: cuBLAS is column-major, so the buffer holding a wide matrix row-major is
//! `Y = Xᵀ` (`n × m`, leading dimension `n`) to cuBLAS, and the buffer holding a tall
//! one row-major is `X` itself (`m × n`, leading dimension `m`). Each iteration, for a
//! wide matrix (a tall one uses the mirrored operations on `X`):
//!
//! - `A = X·Xᵀ = Yᵀ·Y` (`m × m`): `gemm(T, N, m, m, n, 1, Y, Y, 0, A)`;
//! - `B = b·A + c·A·A`: `B := A`, then `gemm(N, N, m, m, m, c, A, A, b, B)`;
//! - `X' = a·X + B·X = (B + a·I)·X`: `a` added to `B`'s diagonal, then
//!   `Y' = Y·(B + a·I)ᵀ`: `gemm(N, T, n, m, m, 1, Y, B, 0, Z)`, and `Y, Z` swap.
//!
//! In bf16 the operands and results are bfloat16 and the products accumulate in f32 on
//! the tensor cores (as `torch.optim.Muon`); in TF32 the f32 operands are rounded to
//! TF32 inside the products; in f32 the products are full f32. The distance of each
//! from the f64 reference is measured in `docs/performance.md`.
//!
//! Guarded by [`crate::Kernel::IfFinite`], the two kernels that write persistent state
//! (the momentum, then the parameter) read the squared global norm on the device and do
//! nothing when it is not finite; the norm, Newton–Schulz and its GEMMs still run, on
//! scratch only, so a skipped step costs what a taken one does and needs no host
//! synchronisation.
//!
//! Invariant: everything runs on the stream the Muon node is bound to, with that
//! stream's cuBLAS handle and scratch, so stream order alone protects the scratch.

use std::sync::Arc;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::sys;

use super::kernels::Kernels;
use super::memory::{DevMem, Memory};
use super::ns_graph::{NsGraphs, NsKey};
use super::optim::{MuonMats, MB_SUMSQ_BLOCKS};
use crate::{MuonParams, NsDtype, OpsError};

/// Quintic coefficients, as in [`crate::math::newton_schulz`].
const NS_A: f32 = 3.4445;
const NS_B: f32 = -4.7750;
const NS_C: f32 = 2.0315;
/// Muon's update scale per `sqrt(max(rows, cols))`.
const MUON_SCALE: f64 = 0.2;
/// cuBLAS workspace per handle (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;
/// Alignment of scratch regions.
const ALIGN: usize = 256;

/// A cuBLAS handle bound to one stream, with its own workspace.
pub(super) struct Blas {
    handle: blas_sys::cublasHandle_t,
    _workspace: Arc<DevMem>,
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
        Ok(Blas {
            handle,
            _workspace: workspace,
        })
    }

    /// Destroys the handle. The caller has the context bound.
    pub(super) fn destroy(&self) {
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

    /// `count` GEMMs `C_i = alpha·op(A_i)·op(B_i) + beta·C_i` (column-major, as
    /// cuBLAS), the operands `stride` elements apart, in `dtype`'s data and compute
    /// types: bf16 data with f32 accumulation, or f32 data with TF32 or full f32
    /// arithmetic.
    #[allow(clippy::too_many_arguments)]
    fn gemm_batched(
        &self,
        dtype: NsDtype,
        (ta, tb): (bool, bool),
        (m, n, k): (i32, i32, i32),
        alpha: f32,
        (a, lda, sa): (u64, i32, i64),
        (b, ldb, sb): (u64, i32, i64),
        beta: f32,
        (c, ldc, sc): (u64, i32, i64),
        count: i32,
    ) -> Result<(), OpsError> {
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (data, compute) = match dtype {
            NsDtype::Bf16 => (
                blas_sys::cudaDataType::CUDA_R_16BF,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            NsDtype::Tf32 => (
                blas_sys::cudaDataType::CUDA_R_32F,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            NsDtype::F32 => (
                blas_sys::cudaDataType::CUDA_R_32F,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
        };
        // SAFETY: the caller passes `count` device matrices of the stated shapes and
        // strides in scratch it owns on this handle's stream; alpha and beta are host
        // scalars of the compute type's scale type (f32), read at the call.
        unsafe {
            blas::gemm_strided_batched_ex(
                self.handle,
                op(ta),
                op(tb),
                m,
                n,
                k,
                (&alpha as *const f32).cast(),
                a as *const std::ffi::c_void,
                data,
                lda,
                sa,
                b as *const std::ffi::c_void,
                data,
                ldb,
                sb,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                data,
                ldc,
                sc,
                count,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| OpsError::Failed {
            kernel: "muon",
            reason: format!("cublasGemmStridedBatchedEx: {:?}", e.0),
        })
    }
}

/// Where each scratch region of one batched Muon step lies, as byte offsets: `count`
/// matrices of `rows × cols`, the working matrices in the Newton–Schulz precision.
pub(super) struct BatchLayout {
    /// `count` Nesterov inputs `U`, f32, back to back.
    u: usize,
    y: usize,
    z: usize,
    a: usize,
    b: usize,
    partial: usize,
    norms: usize,
    rows: usize,
    cols: usize,
    count: usize,
    dtype: NsDtype,
    /// Total bytes.
    pub(super) bytes: usize,
}

impl BatchLayout {
    /// The scratch of `count` `rows × cols` Muon steps in `dtype`, or `None` if it
    /// overflows.
    pub(super) fn new((rows, cols): (usize, usize), count: usize, dtype: NsDtype) -> Option<Self> {
        let (m, n) = (rows.min(cols), rows.max(cols));
        let esize = if dtype == NsDtype::Bf16 { 2 } else { 4 };
        let mut at = 0usize;
        let mut region = |bytes: usize| -> Option<usize> {
            let start = at;
            at = at.checked_add(bytes.checked_next_multiple_of(ALIGN)?)?;
            Some(start)
        };
        let mn = m.checked_mul(n)?.checked_mul(count)?;
        let mm = m.checked_mul(m)?.checked_mul(count)?;
        Some(BatchLayout {
            u: region(mn.checked_mul(4)?)?,
            y: region(mn.checked_mul(esize)?)?,
            z: region(mn.checked_mul(esize)?)?,
            a: region(mm.checked_mul(esize)?)?,
            b: region(mm.checked_mul(esize)?)?,
            partial: region(count.checked_mul(MB_SUMSQ_BLOCKS as usize * 8)?)?,
            norms: region(count.checked_mul(8)?)?,
            rows,
            cols,
            count,
            dtype,
            bytes: at,
        })
    }

    fn esize(&self) -> usize {
        if self.dtype == NsDtype::Bf16 {
            2
        } else {
            4
        }
    }
}

/// Runs the Muon steps of `mats` (all of `layout`'s shape) on `stream` with `scratch`
/// laid out by `layout`: the momentum of every matrix in one launch, the norms in two,
/// the working matrices in one, each Newton–Schulz GEMM once for the whole batch
/// (strided-batched), the updates in one. `guard`: the squared global norm of
/// [`crate::Kernel::IfFinite`], or 0.
pub(super) fn run_batch(
    kernels: &Kernels,
    (blas, graphs): (&Blas, &mut NsGraphs),
    stream: sys::CUstream,
    (scratch, layout): (u64, &BatchLayout),
    mats: &MuonMats,
    hp: &MuonParams,
    guard: u64,
) -> Result<(), OpsError> {
    let (rows, cols, count) = (layout.rows, layout.cols, layout.count);
    if rows == 0 || cols == 0 || count == 0 {
        return Ok(());
    }
    let (m, n) = (rows.min(cols), rows.max(cols));
    let too_big = || OpsError::Shape {
        kernel: "muon",
        reason: format!(
            "a batch of {count} {rows} × {cols} matrices exceeds cuBLAS's 32-bit dimensions"
        ),
    };
    let mi = i32::try_from(m).map_err(|_| too_big())?;
    let ni = i32::try_from(n).map_err(|_| too_big())?;
    let ci = i32::try_from(count).map_err(|_| too_big())?;
    let at = |off: usize| scratch + off as u64;
    let (u, y, z) = (at(layout.u), at(layout.y), at(layout.z));
    let numel = (rows * cols) as u64;
    let bf16 = layout.dtype == NsDtype::Bf16;
    let fns = &kernels.optim;

    // U = g + μ·(μ·buf + g); X = U / (‖U‖ + 1e-7) into Y, in the working precision.
    fns.mb_momentum(stream, mats, (u, numel), f64::from(hp.momentum), guard)?;
    let key = NsKey {
        scratch,
        shape: (rows, cols),
        count,
        dtype: layout.dtype,
        steps: hp.ns_steps,
    };
    graphs.run(stream, key, || {
        fns.mb_norms(
            stream,
            (u, numel, ci as u32),
            at(layout.partial),
            at(layout.norms),
        )?;
        fns.mb_init(stream, (u, y), (numel, ci as u32), at(layout.norms), bf16)?;
        let ns = NsIteration {
            dt: layout.dtype,
            esize: layout.esize(),
            // The buffer holds the row-major `rows × cols` matrix: to cuBLAS
            // (column-major), `Y = Xᵀ` (`n × m`, ld `n`) for a wide one, `X` itself
            // (`m × n`, ld `m`) for a tall one (whose `X` is `Gᵀ`), so neither is ever
            // transposed in memory.
            tall: rows > cols,
            m,
            count,
            dims: (mi, ni, ci),
            strides: ((m * n) as i64, (m * m) as i64),
            a: at(layout.a),
            b: at(layout.b),
        };
        let (mut y, mut z) = (y, z);
        for _ in 0..hp.ns_steps {
            ns.run(kernels, blas, stream, (y, z))?;
            std::mem::swap(&mut y, &mut z);
        }
        Ok(())
    })?;
    // The iterations alternate between Y and Z: the result is in Z after an odd count.
    let y = if hp.ns_steps % 2 == 1 { z } else { y };
    let lr = f64::from(hp.lr);
    let decay = 1.0 - lr * f64::from(hp.weight_decay);
    let scale = lr * MUON_SCALE * (rows.max(cols) as f64).sqrt();
    fns.mb_update(stream, (mats, y, numel), (decay, scale), bf16, guard)
}

/// One quintic Newton–Schulz iteration over a batch of [`run_batch`], in cuBLAS's
/// terms: the working precision, the shape and the scratch regions of `A` and `B`.
struct NsIteration {
    /// The working precision.
    dt: NsDtype,
    /// Bytes per element in `dt`.
    esize: usize,
    /// Whether the matrices have more rows than columns (`X` is then `Gᵀ`).
    tall: bool,
    /// `min(rows, cols)`.
    m: usize,
    /// Matrices in the batch.
    count: usize,
    /// `m`, `n = max(rows, cols)` and `count` as cuBLAS takes them.
    dims: (i32, i32, i32),
    /// The strides between the batch's `m × n` and `m × m` matrices.
    strides: (i64, i64),
    /// `A = X·Xᵀ` in scratch.
    a: u64,
    /// `B = b·A + c·A·A` (then `+ a·I`) in scratch.
    b: u64,
}

impl NsIteration {
    /// Runs one iteration on `stream`: `X` in `y`, `X'` written to `z`.
    fn run(
        &self,
        kernels: &Kernels,
        blas: &Blas,
        stream: sys::CUstream,
        (y, z): (u64, u64),
    ) -> Result<(), OpsError> {
        let (dt, tall, (a, b)) = (self.dt, self.tall, (self.a, self.b));
        let (mi, ni, ci) = self.dims;
        let (smn, smm) = self.strides;
        let bf16 = dt == NsDtype::Bf16;
        let copy = |dst: u64, src: u64, bytes: usize| -> Result<(), OpsError> {
            // SAFETY: both regions lie in this call's scratch and hold `bytes` bytes.
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) }
                .result()
                .map_err(|e| super::device::failed("muon", e))
        };
        // A = X·Xᵀ: Yᵀ·Y (wide) or X·Xᵀ (tall).
        let (ta, tb, ld) = if tall {
            (false, true, mi)
        } else {
            (true, false, ni)
        };
        blas.gemm_batched(
            dt,
            (ta, tb),
            (mi, mi, ni),
            1.0,
            (y, ld, smn),
            (y, ld, smn),
            0.0,
            (a, mi, smm),
            ci,
        )?;
        // B = b·A + c·A·A
        copy(b, a, self.count * self.m * self.m * self.esize)?;
        blas.gemm_batched(
            dt,
            (false, false),
            (mi, mi, mi),
            NS_C,
            (a, mi, smm),
            (a, mi, smm),
            NS_B,
            (b, mi, smm),
            ci,
        )?;
        // X' = a·X + B·X = (B + a·I)·X: Z = Y·B'ᵀ (wide) or Z = B'·X (tall), one
        // product that reads X once and writes Z without a copy of X first.
        let fns = &kernels.optim;
        fns.mb_diag(stream, (b, self.m as u64, ci as u32), NS_A, bf16)?;
        if tall {
            blas.gemm_batched(
                dt,
                (false, false),
                (mi, ni, mi),
                1.0,
                (b, mi, smm),
                (y, mi, smn),
                0.0,
                (z, mi, smn),
                ci,
            )
        } else {
            blas.gemm_batched(
                dt,
                (false, true),
                (ni, mi, mi),
                1.0,
                (y, ni, smn),
                (b, mi, smm),
                0.0,
                (z, ni, smn),
                ci,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_scratch_regions_are_aligned_and_disjoint() {
        for dtype in NsDtype::ALL {
            let l = BatchLayout::new((33, 7), 5, dtype).expect("fits");
            let e = l.esize();
            let regions = [
                (l.u, 5 * 7 * 33 * 4),
                (l.y, 5 * 7 * 33 * e),
                (l.z, 5 * 7 * 33 * e),
                (l.a, 5 * 7 * 7 * e),
                (l.b, 5 * 7 * 7 * e),
                (l.partial, 5 * MB_SUMSQ_BLOCKS as usize * 8),
                (l.norms, 5 * 8),
            ];
            for (i, &(start, len)) in regions.iter().enumerate() {
                assert_eq!(start % ALIGN, 0);
                assert!(start + len <= l.bytes);
                for &(other, olen) in &regions[i + 1..] {
                    assert!(start + len <= other || other + olen <= start);
                }
            }
        }
        assert!(BatchLayout::new((usize::MAX, 2), 1, NsDtype::F32).is_none());
        assert!(BatchLayout::new((1 << 31, 1 << 31), 1 << 10, NsDtype::Bf16).is_none());
    }
}
