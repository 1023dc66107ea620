//! What a [`super::CudaBackend`] is opened with ([`CudaOptions`]) and what it found at
//! start ([`DeviceInfo`]).

use overlap_graph::Mesh;

#[cfg(doc)]
use super::CudaBackend;

/// What a [`CudaBackend`] drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// The mesh of the whole job.
    pub mesh: Mesh,
    /// This process's global rank.
    pub rank: u32,
    /// The CUDA device ordinal to use (the local rank, as torchrun assigns GPUs).
    pub device: u32,
    /// Record kernel timings with timing events (two event records per kernel).
    pub timings: bool,
    /// Create every stream at the same priority (for measurement: by default the
    /// reduce stream gets the device's greatest).
    pub uniform_priority: bool,
}

/// What the backend found at start, for logs and `overlap` diagnostics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: u32,
    /// Device name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability.
    pub capability: (i32, i32),
    /// CUDA driver version.
    pub driver: String,
    /// NCCL version.
    pub nccl: String,
    /// The library files opened: driver, NVRTC, cuBLAS, NCCL.
    pub libraries: Vec<String>,
}
