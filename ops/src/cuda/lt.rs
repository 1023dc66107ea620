//! Strided-batched GEMMs through cuBLASLt, for Newton–Schulz: `D = α·op(A)·op(B) + β·C`
//! with `C` and `D` distinct, which plain cuBLAS cannot do. That lets an iteration be
//! three products and nothing else: `B = c·A·A + b·A` reads `A` as both operand and
//! `C`, and `X' = B·X + a·X` reads `X` as both operand and `C` and writes a new buffer,
//! with no copy of `A` and no shift of `B`'s diagonal in between.
//!
//! A product's descriptors and algorithm (cuBLASLt's first heuristic choice for its
//! shapes, types, strides and the workspace) are made once per [`LtShape`] and cached;
//! making them is host work only, so it may happen while a stream is being captured.
//! The choice is deliberately not timed: the heuristic answers the same in every
//! process, so every rank and a run resumed from a checkpoint compute the same bits as
//! an uninterrupted one, where timing candidates picked differently from one process
//! to the next (a GPU checkpoint resumed in another process then differed).
//!
//! Invariant: one handle per stream, used under the backend's issue lock with the
//! context bound; its workspace is used only by products on that stream.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::sys as drv;

use super::memory::{DevMem, Memory};
use crate::{NsDtype, OpsError};

/// cuBLASLt workspace per handle (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;
/// Heuristic answers asked for (the first valid one is used).
const ANSWERS: usize = 8;

/// What a product's descriptors and algorithm depend on (column-major, as cuBLAS):
/// `op(A)` is `m × k`, `op(B)` is `k × n`, `C` and `D` are `m × n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct LtShape {
    pub(super) dtype: NsDtype,
    /// Whether `A` and `B` are transposed.
    pub(super) trans: (bool, bool),
    pub(super) mnk: (u64, u64, u64),
    /// Leading dimensions of `A`, `B` and `C`/`D`.
    pub(super) ld: (i64, i64, i64),
    /// Elements between the batch's consecutive `A`, `B` and `C`/`D`.
    pub(super) stride: (i64, i64, i64),
    pub(super) count: i32,
}

/// A product's scalars and operands: `D = alpha·op(A)·op(B) + beta·C`.
struct Operands {
    alpha: f32,
    beta: f32,
    ab: (u64, u64),
    cd: (u64, u64),
}

/// A product's descriptors and chosen algorithm.
struct LtPlan {
    desc: sys::cublasLtMatmulDesc_t,
    /// `A`, `B`, then `C` (also `D`'s).
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

/// A cuBLASLt handle bound to one stream's products, with its workspace and plans.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: Arc<DevMem>,
    plans: RefCell<HashMap<LtShape, LtPlan>>,
}

// SAFETY: the handle and plans are used by one thread at a time (under the backend's
// issue lock) with the context bound; none is tied to the thread that made it.
unsafe impl Send for Lt {}

fn lt_err(what: &str, e: lt::CublasError) -> OpsError {
    OpsError::Failed {
        kernel: "muon",
        reason: format!("cuBLASLt {what}: {:?}", e.0),
    }
}

impl Lt {
    /// A handle with its own workspace. The caller has the context bound.
    pub(super) fn new(memory: &Arc<Memory>) -> Result<Lt, OpsError> {
        let handle = lt::create_handle().map_err(|e| lt_err("cublasLtCreate", e))?;
        let workspace = memory.alloc_raw(WORKSPACE_BYTES)?;
        Ok(Lt {
            handle,
            workspace,
            plans: RefCell::new(HashMap::new()),
        })
    }

    /// Destroys the plans and the handle. The caller has the context bound.
    pub(super) fn destroy(&self) {
        for (_, p) in self.plans.borrow_mut().drain() {
            // SAFETY: descriptors made by `plan`, no longer used.
            unsafe { p.destroy() };
        }
        // SAFETY: destroyed once, when the backend is dropped.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }

    /// `D = alpha·op(A)·op(B) + beta·C` for each of the batch's `count` products, on
    /// `stream`. `c` and `d` may be the same buffer or distinct ones.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul(
        &self,
        stream: drv::CUstream,
        shape: &LtShape,
        alpha: f32,
        (a, b): (u64, u64),
        beta: f32,
        (c, d): (u64, u64),
    ) -> Result<(), OpsError> {
        let args = Operands {
            alpha,
            beta,
            ab: (a, b),
            cd: (c, d),
        };
        let mut plans = self.plans.borrow_mut();
        if !plans.contains_key(shape) {
            let plan = self.plan(shape)?;
            plans.insert(*shape, plan);
        }
        let plan = &plans[shape];
        self.call(stream, plan, &plan.algo, &args)
    }

    /// One product with `algo`.
    fn call(
        &self,
        stream: drv::CUstream,
        plan: &LtPlan,
        algo: &sys::cublasLtMatmulAlgo_t,
        o: &Operands,
    ) -> Result<(), OpsError> {
        // SAFETY: the caller passes device matrices of the plan's dimensions and
        // strides in memory it owns on this stream; alpha and beta are host f32 scalars
        // read at the call; the workspace is this handle's, used only on this stream.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&o.alpha as *const f32).cast(),
                (&o.beta as *const f32).cast(),
                o.ab.0 as *const std::ffi::c_void,
                plan.layouts[0],
                o.ab.1 as *const std::ffi::c_void,
                plan.layouts[1],
                o.cd.0 as *const std::ffi::c_void,
                plan.layouts[2],
                o.cd.1 as *mut std::ffi::c_void,
                plan.layouts[2],
                algo,
                self.workspace.ptr() as *mut std::ffi::c_void,
                self.workspace.bytes(),
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("cublasLtMatmul", e))
    }

    /// The descriptors of `shape` and cuBLASLt's first choice of algorithm for them.
    fn plan(&self, s: &LtShape) -> Result<LtPlan, OpsError> {
        let (data, compute) = match s.dtype {
            NsDtype::Bf16 => (
                sys::cudaDataType::CUDA_R_16BF,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            NsDtype::Tf32 => (
                sys::cudaDataType::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            NsDtype::F32 => (
                sys::cudaDataType::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
        };
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
            .map_err(|e| lt_err("cublasLtMatmulDescCreate", e))?;
        let mut plan = LtPlan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            // SAFETY: a plain C struct of integers, filled by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
        };
        let (m, n, k) = s.mnk;
        // The stored (not transposed) dimensions of A, B and C.
        let stored = |t: bool, r: u64, c: u64| if t { (c, r) } else { (r, c) };
        let dims = [stored(s.trans.0, m, k), stored(s.trans.1, k, n), (m, n)];
        let lds = [s.ld.0, s.ld.1, s.ld.2];
        let strides = [s.stride.0, s.stride.1, s.stride.2];
        let made = (|| -> Result<(), lt::CublasError> {
            // cublasOperation_t as the attribute's int32: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
            let (ta, tb) = (i32::from(s.trans.0), i32::from(s.trans.1));
            use sys::cublasLtMatmulDescAttributes_t as D;
            // SAFETY: attributes of the documented types and sizes on a live descriptor.
            unsafe {
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &ta)?;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &tb)?;
            }
            for i in 0..3 {
                plan.layouts[i] = lt::create_matrix_layout(data, dims[i].0, dims[i].1, lds[i])?;
                // SAFETY: as above, on a live layout.
                unsafe { set_batch(plan.layouts[i], s.count, strides[i])? };
            }
            plan.algo = self.first_algo(desc, plan.layouts)?;
            Ok(())
        })();
        if let Err(e) = made {
            // SAFETY: what was made above, never used.
            unsafe { plan.destroy() };
            return Err(OpsError::Failed {
                kernel: "muon",
                reason: format!(
                    "cuBLASLt has no algorithm for a {:?} product of {m} × {n} × {k} \
                     (batch {}): {:?}",
                    s.dtype, s.count, e.0
                ),
            });
        }
        Ok(plan)
    }

    /// cuBLASLt's first heuristic choice for `desc` over `layouts` (`A`, `B`, `C` as
    /// `D`) within the workspace: the first valid one of its first [`ANSWERS`].
    fn first_algo(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        [a, b, c]: [sys::cublasLtMatrixLayout_t; 3],
    ) -> Result<sys::cublasLtMatmulAlgo_t, lt::CublasError> {
        let pref = lt::create_matmul_pref()?;
        let bytes = self.workspace.bytes() as u64;
        // SAFETY: a live preference, the attribute's documented type (u64), live
        // descriptor and layouts, a results array of ANSWERS entries; the preference is
        // destroyed whatever the answer.
        unsafe {
            let mut results: [sys::cublasLtMatmulHeuristicResult_t; ANSWERS] = std::mem::zeroed();
            let mut count = 0i32;
            let found = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
            .and_then(|()| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    a,
                    b,
                    c,
                    c,
                    pref,
                    ANSWERS as i32,
                    results.as_mut_ptr(),
                    &mut count,
                )
                .result()
            });
            let _ = lt::destroy_matmul_pref(pref);
            found?;
            let n = usize::try_from(count).unwrap_or(0).min(ANSWERS);
            results[..n]
                .iter()
                .find(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo)
                .ok_or(lt::CublasError(
                    sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
                ))
        }
    }
}

impl LtPlan {
    /// Destroys the descriptors made so far.
    ///
    /// # Safety
    /// Nothing uses the plan any more.
    unsafe fn destroy(&self) {
        let _ = lt::destroy_matmul_desc(self.desc);
        for &l in self.layouts.iter().filter(|l| !l.is_null()) {
            let _ = lt::destroy_matrix_layout(l);
        }
    }
}

/// Sets a layout's batch: `count` matrices `stride` elements apart.
unsafe fn set_batch(
    layout: sys::cublasLtMatrixLayout_t,
    count: i32,
    stride: i64,
) -> Result<(), lt::CublasError> {
    use sys::cublasLtMatrixLayoutAttribute_t as L;
    set_layout(layout, L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)?;
    set_layout(
        layout,
        L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
        &stride,
    )
}

/// Sets a descriptor attribute from a value of its documented type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), lt::CublasError> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        (value as *const T).cast(),
        std::mem::size_of::<T>(),
    )
}

/// Sets a layout attribute from a value of its documented type.
unsafe fn set_layout<T>(
    layout: sys::cublasLtMatrixLayout_t,
    attr: sys::cublasLtMatrixLayoutAttribute_t,
    value: &T,
) -> Result<(), lt::CublasError> {
    lt::set_matrix_layout_attribute(
        layout,
        attr,
        (value as *const T).cast(),
        std::mem::size_of::<T>(),
    )
}
