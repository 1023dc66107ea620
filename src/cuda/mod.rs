//! Sessions on a GPU (the `cuda` feature): [`Session::cuda`] over a rank's
//! [`CudaBackend`]. Opening the GPU, meeting the other ranks and creating the NCCL
//! communicators (the CUDA world) is the control plane's job: `overlap_dist::cuda`.

use std::sync::Arc;

use overlap_ops::cuda::CudaBackend;

use crate::config::Config;
use crate::session::{exec_config, Session};
use crate::Error;

impl Session<CudaBackend> {
    /// A session on this rank's GPU, parameters initialised from the config's seed
    /// exactly as [`Session::cpu`] does (each rank keeps its piece).
    pub fn cuda(config: &Config, backend: Arc<CudaBackend>) -> Result<Self, Error> {
        let mut s = Session::new(config.plan.clone(), backend, exec_config(config)?)?;
        let seed = config.run.seed;
        s.init_params(|i, p| crate::synthetic::init(seed, i, p.spec.numel() as usize))?;
        Ok(s)
    }
}
