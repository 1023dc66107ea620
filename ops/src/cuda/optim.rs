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

/// A multi-tensor AdamW launch's table (`struct AdamwTable`), which the kernel reads
/// from device memory ([`AdamwTable::words`]).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AdamwTable {
    /// The device address of [`adamw_scalars`]' seven values (`struct AdamwScalars`).
    scalars: sys::CUdeviceptr,
    guard: sys::CUdeviceptr,
    count: u64,
    clip: FusedClip,
    t: [AdamwTensor; ADAMW_TENSORS],
}

impl AdamwTable {
    /// The tensors of the launch.
    pub(super) fn count(&self) -> u64 {
        self.count
    }

    /// The table as `struct AdamwTable` lays it out, in words, up to its last tensor
    /// (the kernel reads no further).
    pub(super) fn words(&self) -> Vec<u64> {
        let mut w = vec![
            self.scalars,
            self.guard,
            self.count,
            self.clip.norm,
            u64::from(self.clip.max_norm.to_bits()),
        ];
        w.extend(
            self.t[..self.count as usize]
                .iter()
                .flat_map(|t| [t.p, t.g, t.m, t.v, t.n, t.block0]),
        );
        w
    }
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

/// `ov_adamw`'s scalars, exactly [`crate::math::adamw`]'s: `b1, b2, eps, lr, 1 − lr·wd,
/// 1 − b1^step, 1 − b2^step`, in f64 (`struct AdamwScalars`; uploaded to the device at
/// each flush, `defer.rs`).
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

/// A Muon batch's scalars as `ov_mb_momentum` and `ov_mb_update` read them from the
/// device: `mu, 1 − lr·wd, lr · 0.2 · sqrt(max(rows, cols))` (Muon's momentum, decay
/// and update scale, as [`crate::math::muon`]).
pub(super) fn muon_scalars(hp: &crate::MuonParams, (rows, cols): (usize, usize)) -> [f64; 3] {
    let lr = f64::from(hp.lr);
    [
        f64::from(hp.momentum),
        1.0 - lr * f64::from(hp.weight_decay),
        lr * MUON_SCALE * (rows.max(cols) as f64).sqrt(),
    ]
}

/// Muon's update scale per `sqrt(max(rows, cols))`.
const MUON_SCALE: f64 = 0.2;

/// The launches that update `tensors` (their `block0` ignored; empty ones left out):
/// up to [`ADAMW_TENSORS`] per table, in order, each with its grid width (the sum of
/// its tensors' chunks), reading their scalars at the device address `scalars`. A
/// function of the lengths only.
pub(super) fn adamw_tables(
    tensors: &[AdamwTensor],
    scalars: sys::CUdeviceptr,
    (guard, clip): (sys::CUdeviceptr, FusedClip),
) -> Vec<(AdamwTable, u32)> {
    let live: Vec<AdamwTensor> = tensors.iter().copied().filter(|t| t.n > 0).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < live.len() {
        let mut table = AdamwTable {
            scalars,
            guard,
            count: 0,
            clip,
            t: [AdamwTensor::default(); ADAMW_TENSORS],
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

/// The matrices of a batched Muon launch (`struct MuonMats`), which the kernels read
/// from device memory ([`MuonMats::words`]).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MuonMats {
    count: u64,
    clip: FusedClip,
    /// [`crate::Kernel::IfFinite`]'s squared norm, or 0.
    guard: sys::CUdeviceptr,
    p: [sys::CUdeviceptr; MUON_MATS],
    buf: [sys::CUdeviceptr; MUON_MATS],
    g: [sys::CUdeviceptr; MUON_MATS],
}

impl MuonMats {
    /// Up to [`MUON_MATS`] `(param, momentum, grad)` triples.
    pub(super) fn of(
        mats: &[(sys::CUdeviceptr, sys::CUdeviceptr, sys::CUdeviceptr)],
        clip: FusedClip,
        guard: sys::CUdeviceptr,
    ) -> Self {
        debug_assert!(mats.len() <= MUON_MATS);
        let mut out = MuonMats {
            count: mats.len() as u64,
            clip,
            guard,
            p: [0; MUON_MATS],
            buf: [0; MUON_MATS],
            g: [0; MUON_MATS],
        };
        for (i, &(p, buf, g)) in mats.iter().enumerate() {
            out.p[i] = p;
            out.buf[i] = buf;
            out.g[i] = g;
        }
        out
    }

    /// The matrices of the batch.
    pub(super) fn count(&self) -> u32 {
        self.count as u32
    }

    /// The struct as `struct MuonMats` lays it out, in words.
    pub(super) fn words(&self) -> Vec<u64> {
        let mut w = vec![
            self.count,
            self.clip.norm,
            u64::from(self.clip.max_norm.to_bits()),
            self.guard,
        ];
        w.extend(self.p.iter().chain(&self.buf).chain(&self.g));
        w
    }
}

/// The batched kernels of the module.
pub(super) struct OptimFns {
    adamw_multi: sys::CUfunction,
    mb_momentum: sys::CUfunction,
    mb_norm: sys::CUfunction,
    mb_scale: sys::CUfunction,
    mb_diag: sys::CUfunction,
    mb_update: sys::CUfunction,
}

/// The width of a batched Muon grid for `numel` elements per matrix.
pub(super) fn mb_blocks(numel: u64) -> u32 {
    numel.div_ceil(256).clamp(1, MB_MAX_BLOCKS as u64) as u32
}

/// Most blocks per matrix of a batched Muon grid, so most partial sums per matrix
/// that [`OptimFns::mb_momentum`] writes.
pub(super) const MB_MAX_BLOCKS: u32 = 1024;

/// A batch's working matrices as the Muon kernels take them: `count` matrices of
/// `numel` elements, `stride` elements apart from `x`, bf16 or f32.
#[derive(Clone, Copy)]
pub(super) struct Working {
    pub(super) x: sys::CUdeviceptr,
    pub(super) numel: u64,
    pub(super) stride: u64,
    pub(super) bf16: bool,
}

impl OptimFns {
    /// Looks the functions up in the loaded module.
    pub(super) fn load(
        get: &dyn Fn(&str) -> Result<sys::CUfunction, OpsError>,
    ) -> Result<OptimFns, OpsError> {
        Ok(OptimFns {
            adamw_multi: get("ov_adamw_multi")?,
            mb_momentum: get("ov_mb_momentum")?,
            mb_norm: get("ov_mb_norm")?,
            mb_scale: get("ov_mb_scale")?,
            mb_diag: get("ov_mb_diag")?,
            mb_update: get("ov_mb_update")?,
        })
    }

    /// One multi-tensor AdamW launch of [`adamw_tables`], its table at the device
    /// address `table` ([`AdamwTable::words`]).
    pub(super) fn adamw_multi(
        &self,
        stream: sys::CUstream,
        table: sys::CUdeviceptr,
        grid: u32,
    ) -> Result<(), OpsError> {
        if grid == 0 {
            return Ok(());
        }
        let args = Args::default().push(table);
        Kernels::launch_with("adamw", self.adamw_multi, (grid, 1), 256, stream, args)
    }

    /// Muon's momentum and Nesterov input `U` of every matrix of the batch (its
    /// [`MuonMats`] at the device address `mats`, `count` of them), stored
    /// (unnormalised) as its working matrix in `w`, and per block the sum of squares of
    /// what it stored into `partial` (room for `count ·` [`MB_MAX_BLOCKS`] doubles);
    /// `scalars`: the device address of the batch's [`muon_scalars`].
    pub(super) fn mb_momentum(
        &self,
        stream: sys::CUstream,
        (mats, count): (sys::CUdeviceptr, u32),
        (w, partial): (Working, sys::CUdeviceptr),
        scalars: sys::CUdeviceptr,
    ) -> Result<(), OpsError> {
        let args = Args::default()
            .push(mats)
            .push(w.x)
            .push(w.numel)
            .push(w.stride)
            .push(scalars)
            .push(i32::from(w.bf16))
            .push(partial);
        let grid = (mb_blocks(w.numel), count);
        Kernels::launch_with("muon", self.mb_momentum, grid, 256, stream, args)
    }

    /// Each working matrix of `w` divided by its norm, in place: `norms[y] =
    /// sqrt(Σ u_y²) + 1e-7` from the `count` matrices' partial sums of
    /// [`Self::mb_momentum`], then `X_y = U_y · (1 / norms[y])` in f32.
    pub(super) fn mb_normalise(
        &self,
        stream: sys::CUstream,
        (w, count): (Working, u32),
        partial: sys::CUdeviceptr,
        norms: sys::CUdeviceptr,
    ) -> Result<(), OpsError> {
        let args = Args::default()
            .push(partial)
            .push(mb_blocks(w.numel))
            .push(norms);
        Kernels::launch_with("muon", self.mb_norm, (1, count), 256, stream, args)?;
        let args = Args::default()
            .push(w.x)
            .push(w.numel)
            .push(w.stride)
            .push(norms)
            .push(i32::from(w.bf16));
        let grid = (mb_blocks(w.numel), count);
        Kernels::launch_with("muon", self.mb_scale, grid, 256, stream, args)
    }

    /// Adds `shift` to the diagonal of each of the `count` `m × m` matrices at `b`
    /// (`astride` elements apart, f32 or bf16).
    pub(super) fn mb_shift(
        &self,
        stream: sys::CUstream,
        (b, m, count): (sys::CUdeviceptr, u64, u32),
        astride: u64,
        shift: f32,
        bf16: bool,
    ) -> Result<(), OpsError> {
        let args = Args::default()
            .push(b)
            .push(m)
            .push(astride)
            .push(shift)
            .push(i32::from(bf16));
        let grid = (mb_blocks(m), count);
        Kernels::launch_with("muon", self.mb_diag, grid, 256, stream, args)
    }

    /// Every parameter `p_y = p_y·decay − scale·O_y` of the batch (as for
    /// [`Self::mb_momentum`]), `O_y` the working matrix `y` of `w` (in the parameter's
    /// layout), `decay` and `scale` the batch's [`muon_scalars`] at the device address
    /// `scalars`.
    pub(super) fn mb_update(
        &self,
        stream: sys::CUstream,
        ((mats, count), w): ((sys::CUdeviceptr, u32), Working),
        scalars: sys::CUdeviceptr,
    ) -> Result<(), OpsError> {
        let args = Args::default()
            .push(mats)
            .push(w.x)
            .push(w.numel)
            .push(w.stride)
            .push(scalars)
            .push(i32::from(w.bf16));
        let grid = (mb_blocks(w.numel), count);
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
            8 + 8 + 8 + 16 + 48 * ADAMW_TENSORS
        );
        assert_eq!(std::mem::size_of::<FusedClip>(), 16);
        assert_eq!(
            std::mem::size_of::<MuonMats>(),
            8 + 16 + 8 + 3 * 8 * MUON_MATS
        );
        // The words the device reads are the structs' bytes: the header (the clip's
        // f32 threshold in the low half of its word), then the tensors or matrices.
        let t = AdamwTensor {
            p: 1,
            g: 2,
            m: 3,
            v: 4,
            n: 5,
            block0: 0,
        };
        let clip = FusedClip {
            norm: 0x77,
            max_norm: 0.5,
        };
        let (tables, _) = (adamw_tables(&[t, t], 0x50, (0x60, clip)), ());
        let w = tables[0].0.words();
        assert_eq!(
            w,
            [
                0x50,
                0x60,
                2,
                0x77,
                u64::from(0.5f32.to_bits()),
                1,
                2,
                3,
                4,
                5,
                0,
                1,
                2,
                3,
                4,
                5,
                1
            ]
        );
        let m = MuonMats::of(&[(1, 2, 3)], clip, 0x60);
        let w = m.words();
        assert_eq!(w.len() * 8, std::mem::size_of::<MuonMats>());
        assert_eq!(&w[..5], &[1, 0x77, u64::from(0.5f32.to_bits()), 0x60, 1]);
        assert_eq!((w[4 + MUON_MATS], w[4 + 2 * MUON_MATS]), (2, 3));
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
        let tables = adamw_tables(&tensors, 0x5000, (0, FusedClip::default()));
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
        assert!(adamw_tables(&[t(0)], 0x5000, (0, FusedClip::default())).is_empty());
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
