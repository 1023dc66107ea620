//! The optimizer tail's batched kernels (`optim.cu`): AdamW over a table of tensors
//! ([`adamw_tables`], [`OptimFns::adamw_multi`]) and Muon's element-wise steps over a
//! batch of same-shape matrices ([`MuonMats`], the `mb_*` launchers), whose
//! Newton–Schulz runs as strided-batched GEMMs (`muon.rs`).
//!
//! A multi-tensor AdamW launch covers up to [`ADAMW_TENSORS`] tensors that share their
//! hyper-parameters, step and guard: each tensor is cut into chunks of [`ADAMW_CHUNK`]
//! elements, one block per chunk, and a block finds its tensor by a binary search over
//! the table's first blocks. The element-wise math is `ov_adamw`'s, so a batch gives the
//! reference's bits as the one-tensor kernel does.
//!
//! Invariant: the tables are plain data built on the host and passed by value as kernel
//! parameters (an AdamW table of 256 tensors is 12 KiB: kernel parameters may take up to
//! 32,764 bytes since CUDA 12.1 on Volta and later), so a launch reads nothing the host
//! must keep alive after `cuLaunchKernel` returns.

use cudarc::driver::sys;

use super::kernels::{Args, Kernels};
use crate::{AdamwParams, OpsError};

/// The source of the batched kernels, compiled after `kernels.cu`.
pub(super) const SOURCE: &str = include_str!("optim.cu");

/// Tensors per multi-tensor AdamW launch (`OV_ADAMW_TENSORS`).
pub(super) const ADAMW_TENSORS: usize = 256;
/// Elements per block of a multi-tensor AdamW launch (`OV_ADAMW_CHUNK`: 256 threads ×
/// 4 floats × 4).
pub(super) const ADAMW_CHUNK: u64 = 4096;
/// Matrices per batched Muon launch (`OV_MUON_MATS`).
pub(super) const MUON_MATS: usize = 64;

/// One tensor of a multi-tensor AdamW launch (`struct AdamwTensor`).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(super) struct AdamwTensor {
    pub p: sys::CUdeviceptr,
    pub g: sys::CUdeviceptr,
    pub m: sys::CUdeviceptr,
    pub v: sys::CUdeviceptr,
    pub n: u64,
    /// The grid's first block for this tensor.
    pub block0: u64,
}

/// A multi-tensor AdamW launch's parameter (`struct AdamwTable`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AdamwTable {
    t: [AdamwTensor; ADAMW_TENSORS],
    /// `b1, b2, eps, lr, decay, bc1, bc2`, as `ov_adamw` takes them.
    scalars: [f64; 7],
    guard: sys::CUdeviceptr,
    count: u64,
    clip: FusedClip,
}

/// [`crate::Kernel::Clip`] fused into the optimizer kernels that read the clipped
/// gradients (`defer.rs`): the squared global norm's address (0: no clip) and the
/// threshold. The kernels derive the factor on the device as `ov_clip` does, scale each
/// gradient element as they read it and store it back (`ov_fused_clip` in `optim.cu`).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub(super) struct FusedClip {
    /// The one-float squared norm, or 0.
    pub norm: sys::CUdeviceptr,
    /// The clip's threshold.
    pub max_norm: f32,
}

/// `ov_adamw`'s host-side scalars, exactly [`crate::math::adamw`]'s: `b1, b2, eps, lr,
/// 1 − lr·wd, 1 − b1^step, 1 − b2^step`, in f64.
pub(super) fn adamw_scalars(hp: &AdamwParams, step: u64) -> [f64; 7] {
    let lr = f64::from(hp.lr);
    let (b1, b2) = (f64::from(hp.beta1), f64::from(hp.beta2));
    [
        b1,
        b2,
        f64::from(hp.eps),
        lr,
        1.0 - lr * f64::from(hp.weight_decay),
        1.0 - b1.powf(step as f64),
        1.0 - b2.powf(step as f64),
    ]
}

/// The launches that update `tensors` (their `block0` ignored; empty ones left out):
/// up to [`ADAMW_TENSORS`] per table, in order, each with its grid width (the sum of
/// its tensors' chunks). A function of the lengths only.
pub(super) fn adamw_tables(
    tensors: &[AdamwTensor],
    scalars: [f64; 7],
    (guard, clip): (sys::CUdeviceptr, FusedClip),
) -> Vec<(AdamwTable, u32)> {
    let live: Vec<AdamwTensor> = tensors.iter().copied().filter(|t| t.n > 0).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < live.len() {
        let mut table = AdamwTable {
            t: [AdamwTensor::default(); ADAMW_TENSORS],
            scalars,
            guard,
            count: 0,
            clip,
        };
        let mut blocks = 0u64;
        // A grid's x dimension is at most 2^31 − 1 blocks.
        while i < live.len() && (table.count as usize) < ADAMW_TENSORS {
            let chunks = live[i].n.div_ceil(ADAMW_CHUNK);
            if table.count > 0 && blocks + chunks > i32::MAX as u64 {
                break;
            }
            table.t[table.count as usize] = AdamwTensor {
                block0: blocks,
                ..live[i]
            };
            blocks += chunks;
            table.count += 1;
            i += 1;
        }
        out.push((table, blocks.min(i32::MAX as u64) as u32));
    }
    out
}

/// The matrices of a batched Muon launch (`struct MuonMats`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MuonMats {
    p: [sys::CUdeviceptr; MUON_MATS],
    buf: [sys::CUdeviceptr; MUON_MATS],
    g: [sys::CUdeviceptr; MUON_MATS],
    count: u64,
    clip: FusedClip,
}

impl MuonMats {
    /// Up to [`MUON_MATS`] `(param, momentum, grad)` triples.
    pub(super) fn of(
        mats: &[(sys::CUdeviceptr, sys::CUdeviceptr, sys::CUdeviceptr)],
        clip: FusedClip,
    ) -> Self {
        debug_assert!(mats.len() <= MUON_MATS);
        let mut out = MuonMats {
            p: [0; MUON_MATS],
            buf: [0; MUON_MATS],
            g: [0; MUON_MATS],
            count: mats.len() as u64,
            clip,
        };
        for (i, &(p, buf, g)) in mats.iter().enumerate() {
            out.p[i] = p;
            out.buf[i] = buf;
            out.g[i] = g;
        }
        out
    }

    fn count(&self) -> u32 {
        self.count as u32
    }
}

/// The batched kernels of the module.
pub(super) struct OptimFns {
    adamw_multi: sys::CUfunction,
    mb_momentum: sys::CUfunction,
    mb_sumsq: sys::CUfunction,
    mb_norm: sys::CUfunction,
    mb_init: sys::CUfunction,
    mb_update: sys::CUfunction,
    mb_diag: sys::CUfunction,
}

/// The width of a batched Muon grid for `numel` elements per matrix.
fn mb_blocks(numel: u64) -> u32 {
    numel.div_ceil(256).clamp(1, 1024) as u32
}

/// Blocks per matrix of the batched sum of squares (its partials go to one block).
pub(super) const MB_SUMSQ_BLOCKS: u32 = 64;

impl OptimFns {
    /// Looks the functions up in the loaded module.
    pub(super) fn load(
        get: &dyn Fn(&str) -> Result<sys::CUfunction, OpsError>,
    ) -> Result<OptimFns, OpsError> {
        Ok(OptimFns {
            adamw_multi: get("ov_adamw_multi")?,
            mb_momentum: get("ov_mb_momentum")?,
            mb_sumsq: get("ov_mb_sumsq")?,
            mb_norm: get("ov_mb_norm")?,
            mb_init: get("ov_mb_init")?,
            mb_update: get("ov_mb_update")?,
            mb_diag: get("ov_mb_diag")?,
        })
    }

    /// One multi-tensor AdamW launch of [`adamw_tables`].
    pub(super) fn adamw_multi(
        &self,
        stream: sys::CUstream,
        (table, grid): &(AdamwTable, u32),
    ) -> Result<(), OpsError> {
        if *grid == 0 {
            return Ok(());
        }
        let args = Args::default().push(*table);
        Kernels::launch_with("adamw", self.adamw_multi, (*grid, 1), 256, stream, args)
    }

    /// Muon's momentum and Nesterov input of every matrix into `u` (`numel` floats
    /// each, back to back); `guard` as for AdamW.
    pub(super) fn mb_momentum(
        &self,
        stream: sys::CUstream,
        mats: &MuonMats,
        (u, numel): (sys::CUdeviceptr, u64),
        mu: f64,
        guard: sys::CUdeviceptr,
    ) -> Result<(), OpsError> {
        let args = Args::default()
            .push(*mats)
            .push(u)
            .push(numel)
            .push(mu)
            .push(guard);
        let grid = (mb_blocks(numel), mats.count());
        Kernels::launch_with("muon", self.mb_momentum, grid, 256, stream, args)
    }

    /// `norms[y] = sqrt(Σ u_y²) + 1e-7` for the `count` matrices of `u`, through
    /// `partial` (room for `count ·` [`MB_SUMSQ_BLOCKS`] doubles).
    pub(super) fn mb_norms(
        &self,
        stream: sys::CUstream,
        (u, numel, count): (sys::CUdeviceptr, u64, u32),
        partial: sys::CUdeviceptr,
        norms: sys::CUdeviceptr,
    ) -> Result<(), OpsError> {
        let g = mb_blocks(numel).min(MB_SUMSQ_BLOCKS);
        let args = Args::default().push(u).push(numel).push(partial);
        Kernels::launch_with("muon", self.mb_sumsq, (g, count), 256, stream, args)?;
        let args = Args::default().push(partial).push(g).push(norms);
        Kernels::launch_with("muon", self.mb_norm, (1, count), 256, stream, args)
    }

    /// The working matrices `X_y = U_y / norms[y]` (in `U`'s layout), in f32 or bf16
    /// at `x`.
    pub(super) fn mb_init(
        &self,
        stream: sys::CUstream,
        (u, x): (sys::CUdeviceptr, sys::CUdeviceptr),
        (numel, count): (u64, u32),
        norms: sys::CUdeviceptr,
        bf16: bool,
    ) -> Result<(), OpsError> {
        let args = Args::default()
            .push(u)
            .push(x)
            .push(numel)
            .push(norms)
            .push(i32::from(bf16));
        let grid = (mb_blocks(numel), count);
        Kernels::launch_with("muon", self.mb_init, grid, 256, stream, args)
    }

    /// Adds `shift` to the diagonal of each of the `count` `m × m` matrices at `b` (f32
    /// or bf16).
    pub(super) fn mb_diag(
        &self,
        stream: sys::CUstream,
        (b, m, count): (sys::CUdeviceptr, u64, u32),
        shift: f32,
        bf16: bool,
    ) -> Result<(), OpsError> {
        let args = Args::default()
            .push(b)
            .push(m)
            .push(shift)
            .push(i32::from(bf16));
        let grid = (mb_blocks(m), count);
        Kernels::launch_with("muon", self.mb_diag, grid, 256, stream, args)
    }

    /// Every parameter `p_y = p_y·decay − scale·O_y`, `O_y` the working matrix `y` of
    /// `x` (f32 or bf16, in the parameter's layout); `guard` as for AdamW.
    pub(super) fn mb_update(
        &self,
        stream: sys::CUstream,
        (mats, x, numel): (&MuonMats, sys::CUdeviceptr, u64),
        (decay, scale): (f64, f64),
        bf16: bool,
        guard: sys::CUdeviceptr,
    ) -> Result<(), OpsError> {
        let args = Args::default()
            .push(*mats)
            .push(x)
            .push(numel)
            .push(decay)
            .push(scale)
            .push(i32::from(bf16))
            .push(guard);
        let grid = (mb_blocks(numel), mats.count());
        Kernels::launch_with("muon", self.mb_update, grid, 256, stream, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_have_the_layout_of_the_cuda_structs() {
        assert_eq!(std::mem::size_of::<AdamwTensor>(), 48);
        assert_eq!(
            std::mem::size_of::<AdamwTable>(),
            48 * ADAMW_TENSORS + 7 * 8 + 16 + 16
        );
        assert_eq!(std::mem::size_of::<FusedClip>(), 16);
        assert_eq!(std::mem::size_of::<MuonMats>(), 3 * 8 * MUON_MATS + 8 + 16);
        // Kernel parameters are limited to 32,764 bytes (CUDA 12.1 and later).
        assert!(std::mem::size_of::<AdamwTable>() <= 32_764);
        assert!(std::mem::size_of::<MuonMats>() + 64 <= 32_764);
        assert!(SOURCE.contains(&format!("#define OV_ADAMW_TENSORS {ADAMW_TENSORS}")));
        assert!(SOURCE.contains(&format!("#define OV_MUON_MATS {MUON_MATS}")));
        assert!(SOURCE.contains("#define OV_ADAMW_UNROLL 4"));
        assert_eq!(ADAMW_CHUNK, 256 * 4 * 4);
    }

    #[test]
    fn adamw_tables_cover_every_chunk_once() {
        let t = |n: u64| AdamwTensor {
            p: 0x1000,
            g: 0x2000,
            m: 0x3000,
            v: 0x4000,
            n,
            block0: 99,
        };
        let tensors: Vec<AdamwTensor> = (0..600u64)
            .map(|i| t(if i % 7 == 3 { 0 } else { 1 + i * 1000 }))
            .collect();
        let tables = adamw_tables(&tensors, [0.0; 7], (0, FusedClip::default()));
        let live: Vec<u64> = tensors.iter().map(|t| t.n).filter(|&n| n > 0).collect();
        assert_eq!(tables.len(), live.len().div_ceil(ADAMW_TENSORS));
        let mut seen = Vec::new();
        for (table, grid) in &tables {
            let mut next = 0u64;
            for s in &table.t[..table.count as usize] {
                assert_eq!(s.block0, next, "chunks are back to back");
                next += s.n.div_ceil(ADAMW_CHUNK);
                seen.push(s.n);
            }
            assert_eq!(u64::from(*grid), next);
        }
        assert_eq!(seen, live);
        assert!(adamw_tables(&[t(0)], [0.0; 7], (0, FusedClip::default())).is_empty());
    }

    #[test]
    fn adamw_scalars_are_the_references() {
        let hp = AdamwParams::default();
        let s = adamw_scalars(&hp, 3);
        assert_eq!(s[0], f64::from(hp.beta1));
        assert_eq!(s[5], 1.0 - f64::from(hp.beta1).powf(3.0));
        assert_eq!(s[4], 1.0 - f64::from(hp.lr) * f64::from(hp.weight_decay));
    }
}
