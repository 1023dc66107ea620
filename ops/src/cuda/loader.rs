//! Finding the CUDA libraries before cudarc touches them.
//!
//! cudarc loads each library (and each symbol) lazily on first use and *panics* when it
//! cannot: a missing `libnvrtc.so` would abort the process from deep inside a kernel
//! compile. This module opens every library the backend needs, with the names cudarc
//! itself tries and in the same order (so the library found here is the one cudarc
//! loads), and looks up every symbol the backend calls. What is missing becomes an
//! [`OpsError::Backend`] that names the library and says which variable or path to set.
//!
//! Invariant: [`check`] succeeding means no cudarc entry point the backend uses can
//! panic for want of a library or a symbol.

use libloading::Library;

use crate::OpsError;

/// One library the backend loads.
pub(super) struct Lib {
    /// cudarc's name stem (`cuda`, `nvrtc`, ...).
    stem: &'static str,
    /// What it is, for messages.
    what: &'static str,
    /// How to make it loadable.
    hint: &'static str,
    /// Every symbol the backend calls through cudarc.
    symbols: &'static [&'static str],
}

/// The CUDA driver.
pub(super) const DRIVER: Lib = Lib {
    stem: "cuda",
    what: "the CUDA driver",
    hint: "install the NVIDIA driver, or set LD_LIBRARY_PATH to the directory holding libcuda.so.1 (e.g. /usr/lib/x86_64-linux-gnu)",
    symbols: &[
        "cuInit",
        "cuDriverGetVersion",
        "cuDeviceGet",
        "cuDeviceGetCount",
        "cuDeviceGetName",
        "cuDeviceGetAttribute",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuCtxSetCurrent",
        "cuCtxSynchronize",
        "cuCtxGetStreamPriorityRange",
        "cuStreamCreateWithPriority",
        "cuStreamDestroy_v2",
        "cuStreamSynchronize",
        "cuStreamWaitEvent",
        "cuEventCreate",
        "cuEventRecord",
        "cuEventSynchronize",
        "cuStreamIsCapturing",
        "cuEventQuery",
        "cuEventElapsedTime_v2",
        "cuEventDestroy_v2",
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuMemsetD32Async",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuModuleLoadData",
        "cuModuleGetFunction",
        "cuModuleUnload",
        "cuLaunchKernel",
        "cuStreamBeginCapture_v2",
        "cuStreamEndCapture",
        "cuGraphInstantiateWithFlags",
        "cuGraphLaunch",
        "cuGraphExecDestroy",
        "cuGraphDestroy",
        "cuGetErrorString",
        "cuGetErrorName",
    ],
};

/// What the copy transport ([`crate::Kernel::Exchange`]) needs of the driver besides
/// [`DRIVER`]: CUDA IPC and the v2 stream memory operations. Checked when the transport
/// is set up, not at start, so a backend without it works on drivers that lack them.
pub(super) const COPY: Lib = Lib {
    stem: "cuda",
    what: "the CUDA driver (copy transport)",
    hint:
        "the copy transport needs a driver for CUDA 11.7 or newer; use the NCCL transport otherwise",
    symbols: &[
        "cuIpcGetMemHandle",
        "cuIpcOpenMemHandle_v2",
        "cuIpcCloseMemHandle",
        "cuStreamWaitValue32_v2",
        "cuStreamWriteValue32_v2",
        "cuStreamBatchMemOp_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuMemsetD32Async",
    ],
};

/// NVRTC, which compiles the backend's kernels at start.
pub(super) const NVRTC: Lib = Lib {
    stem: "nvrtc",
    what: "NVRTC, the CUDA runtime compiler",
    hint: "set LD_LIBRARY_PATH to the CUDA lib64 directory, e.g. /usr/local/cuda/lib64",
    symbols: &[
        "nvrtcCreateProgram",
        "nvrtcCompileProgram",
        "nvrtcGetPTXSize",
        "nvrtcGetPTX",
        "nvrtcGetProgramLogSize",
        "nvrtcGetProgramLog",
        "nvrtcDestroyProgram",
    ],
};

/// cuBLAS, for Muon's Newton–Schulz GEMMs.
pub(super) const CUBLAS: Lib = Lib {
    stem: "cublas",
    what: "cuBLAS",
    hint: "set LD_LIBRARY_PATH to the CUDA lib64 directory, e.g. /usr/local/cuda/lib64",
    symbols: &[
        "cublasCreate_v2",
        "cublasDestroy_v2",
        "cublasSetStream_v2",
        "cublasSetWorkspace_v2",
        "cublasSetMathMode",
        "cublasSgemm_v2",
    ],
};

/// cuBLASLt, for Newton–Schulz's products with a separate output (`lt.rs`).
pub(super) const CUBLASLT: Lib = Lib {
    stem: "cublasLt",
    what: "cuBLASLt",
    hint: "set LD_LIBRARY_PATH to the CUDA lib64 directory, e.g. /usr/local/cuda/lib64",
    symbols: &[
        "cublasLtCreate",
        "cublasLtDestroy",
        "cublasLtMatmul",
        "cublasLtMatmulAlgoGetHeuristic",
        "cublasLtMatmulDescCreate",
        "cublasLtMatrixLayoutCreate",
    ],
};

/// NCCL, for every collective.
pub(super) const NCCL: Lib = Lib {
    stem: "nccl",
    what: "NCCL",
    hint: "install NCCL 2.18 or newer (libnccl2), or set LD_LIBRARY_PATH to the directory holding libnccl.so",
    symbols: &[
        "ncclGetVersion",
        "ncclGetUniqueId",
        "ncclCommInitRank",
        "ncclCommAbort",
        "ncclCommDestroy",
        "ncclCommGetAsyncError",
        "ncclGetErrorString",
        "ncclGetLastError",
        "ncclAllReduce",
        "ncclReduceScatter",
        "ncclReduce",
        "ncclBroadcast",
        "ncclAllGather",
    ],
};

/// Every library the backend needs.
pub(super) const ALL: [&Lib; 5] = [&DRIVER, &NVRTC, &CUBLAS, &CUBLASLT, &NCCL];

impl Lib {
    /// Opens the library under the first name cudarc would use and looks up every
    /// symbol; returns the file name that was opened.
    pub(super) fn check(&self) -> Result<String, OpsError> {
        let mut names = cudarc::get_lib_name_candidates(self.stem);
        let mut seen = std::collections::HashSet::new();
        names.retain(|n| seen.insert(n.clone()));
        let mut opened = None;
        for name in &names {
            // SAFETY: loading a CUDA library runs its initialisers, which is what cudarc
            // does with the same name a moment later; nothing else is assumed.
            if let Ok(lib) = unsafe { Library::new(name) } {
                opened = Some((name.clone(), lib));
                break;
            }
        }
        let Some((name, lib)) = opened else {
            return Err(OpsError::Backend(format!(
                "cannot load lib{}.so ({}): {} (tried {})",
                self.stem,
                self.what,
                self.hint,
                names.join(", ")
            )));
        };
        let missing: Vec<&str> = self
            .symbols
            .iter()
            .copied()
            .filter(|sym| {
                // SAFETY: the symbol is only looked up, never called through this type.
                unsafe { lib.get::<*const ()>(sym.as_bytes()) }.is_err()
            })
            .collect();
        if !missing.is_empty() {
            return Err(OpsError::Backend(format!(
                "{name} ({}) lacks {}: it is too old or not the library overlap expects; {}",
                self.what,
                missing.join(", "),
                self.hint
            )));
        }
        Ok(name)
    }
}

/// Checks every library the backend needs; returns the file names opened, in the order
/// driver, NVRTC, cuBLAS, cuBLASLt, NCCL.
pub fn check() -> Result<Vec<String>, OpsError> {
    ALL.iter().map(|lib| lib.check()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_it_and_the_variable_to_set() {
        let lib = Lib {
            stem: "overlap_no_such_library",
            what: "a test library",
            hint: "set LD_LIBRARY_PATH to the CUDA lib64 directory, e.g. /usr/local/cuda/lib64",
            symbols: &[],
        };
        let err = lib.check().unwrap_err().to_string();
        assert!(
            err.contains("cannot load liboverlap_no_such_library.so (a test library)"),
            "{err}"
        );
        assert!(err.contains("LD_LIBRARY_PATH"), "{err}");
    }

    #[test]
    fn checking_the_real_libraries_never_panics() {
        // On a machine without CUDA each is an error; with CUDA, the file names.
        match check() {
            Ok(names) => assert_eq!(names.len(), 4),
            Err(e) => {
                assert!(e.to_string().contains("cannot load") || e.to_string().contains("lacks"))
            }
        }
    }
}
