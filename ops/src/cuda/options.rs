//! What a [`CudaBackend`] is opened with ([`CudaOptions`]) and what it found at
//! start ([`DeviceInfo`]).

use overlap_graph::Mesh;

#[cfg(doc)]
use super::CudaBackend;

/// What a [`CudaBackend`] drives. Build it with [`CudaOptions::new`] and the `with_*`
/// methods: a field added later is not a breaking change.
///
/// ```
/// use overlap_ops::cuda::CudaOptions;
/// use overlap_ops::graph::Mesh;
///
/// let opts = CudaOptions::new(Mesh::new(2, 1).unwrap(), 1, 1).with_timings(true);
/// assert!(opts.timings && !opts.uniform_priority);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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

impl CudaOptions {
    /// Global rank `rank` of `mesh` on CUDA device `device`, without kernel timings and
    /// with the reduce stream at the device's greatest priority.
    pub fn new(mesh: Mesh, rank: u32, device: u32) -> CudaOptions {
        CudaOptions {
            mesh,
            rank,
            device,
            timings: false,
            uniform_priority: false,
        }
    }

    /// With kernel timings recorded (or not).
    pub fn with_timings(mut self, timings: bool) -> Self {
        self.timings = timings;
        self
    }

    /// With every stream at the same priority (or not).
    pub fn with_uniform_priority(mut self, uniform_priority: bool) -> Self {
        self.uniform_priority = uniform_priority;
        self
    }
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
