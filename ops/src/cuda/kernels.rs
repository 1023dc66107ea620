//! The backend's own kernels: CUDA C (`kernels.cu`) compiled once at start with NVRTC,
//! and typed launchers for them.
//!
//! The source is compiled for the device's compute capability with `--fmad=false`, so
//! no multiply and add are contracted into one rounding: with the reference's operation
//! order and double-precision element-wise math, AdamW, the Muon momentum and update,
//! folds, packs and unpacks produce the CPU reference's bits.
//!
//! Invariant: a launcher never launches an empty grid (a zero-length operation is a
//! no-op) and never reads its arguments after `cuLaunchKernel` returned (the driver
//! copies them at launch).

use std::ffi::{c_void, CString};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::nvrtc::{self, CompileOptions};

use super::device::{backend, failed, Device};
use crate::OpsError;

/// The CUDA C source of every kernel.
pub(super) const SOURCE: &str = include_str!("kernels.cu");

/// `kernels.cu` followed by the batched optimizer kernels (`optim.cu`), which use its
/// helpers: the one module NVRTC compiles.
pub(super) fn full_source() -> String {
    format!("{SOURCE}\n{}", super::optim::SOURCE)
}

/// Threads per block of every kernel (the reductions need exactly this many).
const THREADS: u32 = 256;
/// Floats a block of the sum-of-squares pass takes (`OV_SUMSQ_CHUNK` in the source:
/// four float4 loads per thread).
pub(super) const SUMSQ_CHUNK: u64 = 256 * 16;
/// Most blocks a grid-stride kernel is launched with.
const MAX_BLOCKS: u64 = 4096;
/// Threads per block of the capped-grid combine (`OV_COMBINE_WIDE` in the source).
const WIDE_THREADS: u32 = 512;
/// Copies per `ov_segments` launch (`OV_MAX_SEGS` in the source).
pub(super) const MAX_SEGS: usize = 32;
/// Buffers per `ov_sumsq_spans` or `ov_clip` launch (`OV_MAX_SPANS` in the source).
pub(super) const MAX_SPANS: usize = 32;
/// Most blocks per buffer of an `ov_clip` launch.
const CLIP_BLOCKS: u32 = 1024;

/// One copy of a pack or unpack (`struct Seg` in the source).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct Seg {
    /// First source.
    pub a: sys::CUdeviceptr,
    /// Second source, or 0.
    pub b: sys::CUdeviceptr,
    /// Destination.
    pub dst: sys::CUdeviceptr,
    /// Elements.
    pub len: u64,
}

/// A batch of copies with disjoint destinations (`struct Segs` in the source).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Segs {
    s: [Seg; MAX_SEGS],
    count: u64,
    accumulate: i32,
    pad: i32,
}

/// One buffer of the global norm's kernels (`struct Span` in the source): `len` floats.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(super) struct Span {
    /// Element 0.
    pub p: sys::CUdeviceptr,
    /// Elements.
    pub len: u64,
}

/// Up to [`MAX_SPANS`] buffers (`struct Spans` in the source).
#[repr(C)]
#[derive(Clone, Copy)]
struct Spans {
    s: [Span; MAX_SPANS],
    count: u64,
}

impl Spans {
    fn of(spans: &[Span]) -> Spans {
        debug_assert!(spans.len() <= MAX_SPANS);
        let mut batch = Spans {
            s: [Span::default(); MAX_SPANS],
            count: spans.len() as u64,
        };
        batch.s[..spans.len()].copy_from_slice(spans);
        batch
    }

    /// The struct's bytes as the kernel reads them from device memory, in words.
    fn words(&self) -> Vec<u64> {
        let mut w: Vec<u64> = self.s.iter().flat_map(|s| [s.p, s.len]).collect();
        w.push(self.count);
        w
    }
}

/// One launch of the first pass of [`Kernels::sum_squares`]: which spans (a range of the
/// non-empty ones), its grid width, and where in the partials its `count · grid` sums
/// start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SumSqLaunch {
    pub spans: std::ops::Range<usize>,
    pub grid: u32,
    pub at: u64,
}

/// How [`Kernels::sum_squares`] covers `spans` (the caller leaves empty ones out, they
/// add nothing): launches of up to [`MAX_SPANS`] spans in order, one block per chunk of
/// [`SUMSQ_CHUNK`] floats of each span (a launch ends early rather than pass `i32::MAX`
/// blocks), each block one partial sum (a double); and the number of partials. A
/// function of the lengths only, so the same inputs always reduce in the same order.
pub(super) fn sumsq_launches(spans: &[Span]) -> (Vec<SumSqLaunch>, u64) {
    let mut out = Vec::new();
    let mut at = 0u64;
    let mut start = 0;
    while start < spans.len() {
        let mut end = start;
        let mut blocks = 0u64;
        while end < spans.len() && end - start < MAX_SPANS {
            let chunks = spans[end].len.div_ceil(SUMSQ_CHUNK).max(1);
            if end > start && blocks + chunks > i32::MAX as u64 {
                break;
            }
            blocks += chunks;
            end += 1;
        }
        let grid = blocks.min(i32::MAX as u64) as u32;
        out.push(SumSqLaunch {
            spans: start..end,
            grid,
            at,
        });
        at += u64::from(grid);
        start = end;
    }
    (out, at)
}

/// Up to [`MAX_SPANS`] spans with the first block of each (`struct SumsqSpans` in the
/// source): span `y`'s chunks of [`SUMSQ_CHUNK`] floats are blocks `block0[y]` on.
#[repr(C)]
#[derive(Clone, Copy)]
struct SumsqSpans {
    s: [Span; MAX_SPANS],
    block0: [u64; MAX_SPANS],
    count: u64,
}

impl SumsqSpans {
    fn of(spans: &[Span]) -> SumsqSpans {
        debug_assert!(spans.len() <= MAX_SPANS);
        let mut t = SumsqSpans {
            s: [Span::default(); MAX_SPANS],
            block0: [0; MAX_SPANS],
            count: spans.len() as u64,
        };
        let mut next = 0u64;
        for (i, s) in spans.iter().enumerate() {
            t.s[i] = *s;
            t.block0[i] = next;
            next += s.len.div_ceil(SUMSQ_CHUNK).max(1);
        }
        t
    }

    /// The struct's bytes as the kernel reads them from device memory, in words.
    fn words(&self) -> Vec<u64> {
        let mut w: Vec<u64> = self.s.iter().flat_map(|s| [s.p, s.len]).collect();
        w.extend(self.block0);
        w.push(self.count);
        w
    }
}

/// The table (`struct SumsqSpans`, in words) of the first-pass launch of
/// [`Kernels::sum_squares`] over `chunk`, one [`SumSqLaunch`]'s spans: the kernel reads
/// it from device memory, where the flush uploads it (`flush.rs`).
pub(super) fn sumsq_words(chunk: &[Span]) -> Vec<u64> {
    SumsqSpans::of(chunk).words()
}

/// The launches of [`Kernels::clip`] over `spans` (as [`clip_batches`] groups them):
/// each one's table (`struct Spans`, in words, for device memory) and grid.
pub(super) fn clip_launches(spans: &[Span]) -> Vec<(Vec<u64>, (u32, u32))> {
    clip_batches(spans)
        .into_iter()
        .filter_map(|batch| {
            let longest = batch.iter().map(|s| s.len).max().unwrap_or(0);
            let grid = (blocks(longest).min(CLIP_BLOCKS), batch.len() as u32);
            (longest > 0).then(|| (Spans::of(&batch).words(), grid))
        })
        .collect()
}

/// How [`Kernels::clip`] batches `spans`: in order, up to [`MAX_SPANS`] per launch, a
/// span starting a new launch when its buffer is already in the current one (a buffer
/// named twice is scaled twice, one launch after the other, as the CPU backend does,
/// never by two blocks at once).
pub(super) fn clip_batches(spans: &[Span]) -> Vec<Vec<Span>> {
    let mut out: Vec<Vec<Span>> = Vec::new();
    let mut batch: Vec<Span> = Vec::with_capacity(MAX_SPANS);
    for &s in spans {
        if batch.len() == MAX_SPANS || batch.iter().any(|b| b.p == s.p) {
            out.push(std::mem::take(&mut batch));
        }
        batch.push(s);
    }
    if !batch.is_empty() {
        out.push(batch);
    }
    out
}

/// The compiled module and its functions.
pub(super) struct Kernels {
    module: sys::CUmodule,
    add: sys::CUfunction,
    segments: sys::CUfunction,
    to_bf16: sys::CUfunction,
    from_bf16: sys::CUfunction,
    combine: sys::CUfunction,
    combine4: sys::CUfunction,
    combine4s: sys::CUfunction,
    combine4n: sys::CUfunction,
    sumsq_spans: sys::CUfunction,
    sumsq_final: sys::CUfunction,
    clip: sys::CUfunction,
    spin: sys::CUfunction,
    /// A memset as a kernel (`ov_fill`, for `tail_graph.rs`).
    pub(super) fill: sys::CUfunction,
    /// The optimizer tail's batched kernels (`optim.cu`).
    pub(super) optim: super::optim::OptimFns,
}

/// Kernel arguments, each stored 8-byte aligned until the launch copies them.
#[derive(Default)]
pub(super) struct Args {
    slots: Vec<Box<[u64]>>,
}

impl Args {
    pub(super) fn push<T: Copy>(mut self, value: T) -> Self {
        let words = std::mem::size_of::<T>().div_ceil(8).max(1);
        let mut slot = vec![0u64; words].into_boxed_slice();
        // SAFETY: `slot` has room for `size_of::<T>()` bytes and `T: Copy` is plain data.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&value as *const T).cast::<u8>(),
                slot.as_mut_ptr().cast::<u8>(),
                std::mem::size_of::<T>(),
            );
        }
        self.slots.push(slot);
        self
    }

    fn pointers(&mut self) -> Vec<*mut c_void> {
        self.slots
            .iter_mut()
            .map(|s| s.as_mut_ptr().cast::<c_void>())
            .collect()
    }
}

/// Blocks for `n` elements.
fn blocks(n: u64) -> u32 {
    n.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32
}

impl Kernels {
    /// Compiles the source for the device and loads it. The caller has the context bound.
    pub(super) fn compile(device: &Device) -> Result<Kernels, OpsError> {
        let (major, minor) = device.capability;
        let opts = CompileOptions {
            fmad: Some(false),
            options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
            name: Some("overlap_kernels.cu".into()),
            ..Default::default()
        };
        let ptx = nvrtc::compile_ptx_with_opts(full_source(), opts).map_err(|e| {
            OpsError::Backend(format!(
                "NVRTC could not compile the backend's kernels for compute capability {major}.{minor}: {e:?}"
            ))
        })?;
        let image = match ptx.as_bytes() {
            Some(bytes) => {
                let mut v = bytes.to_vec();
                if v.last() != Some(&0) {
                    v.push(0);
                }
                v
            }
            None => CString::new(ptx.to_src())
                .map_err(|e| OpsError::Backend(format!("NVRTC returned malformed PTX: {e}")))?
                .into_bytes_with_nul(),
        };
        // SAFETY: `image` is NUL-terminated PTX that outlives the call.
        let module = unsafe { cu::module::load_data(image.as_ptr().cast()) }
            .map_err(|e| backend("cuModuleLoadData (the backend's kernels)", e))?;
        let get = |name: &str| -> Result<sys::CUfunction, OpsError> {
            let c = CString::new(name).map_err(|e| OpsError::Backend(e.to_string()))?;
            // SAFETY: `module` is loaded; the name is NUL-terminated.
            unsafe { cu::module::get_function(module, c) }
                .map_err(|e| backend(&format!("cuModuleGetFunction({name})"), e))
        };
        Ok(Kernels {
            module,
            add: get("ov_add")?,
            segments: get("ov_segments")?,
            to_bf16: get("ov_to_bf16")?,
            from_bf16: get("ov_from_bf16")?,
            combine: get("ov_combine")?,
            combine4: get("ov_combine4")?,
            combine4s: get("ov_combine4s")?,
            combine4n: get("ov_combine4n")?,
            sumsq_spans: get("ov_sumsq_spans")?,
            sumsq_final: get("ov_sumsq_final")?,
            clip: get("ov_clip")?,
            spin: get("ov_spin")?,
            fill: get("ov_fill")?,
            optim: super::optim::OptimFns::load(&get)?,
        })
    }

    /// Unloads the module. The caller has the context bound and the device is idle.
    pub(super) fn unload(&self) {
        // SAFETY: the module was loaded by `compile` and is unloaded once, when idle.
        let _ = unsafe { cu::module::unload(self.module) };
    }

    fn launch(
        kernel: &'static str,
        f: sys::CUfunction,
        grid: (u32, u32),
        stream: sys::CUstream,
        args: Args,
    ) -> Result<(), OpsError> {
        Self::launch_with(kernel, f, grid, THREADS, stream, args)
    }

    /// [`Kernels::launch`] with `threads` per block.
    pub(super) fn launch_with(
        kernel: &'static str,
        f: sys::CUfunction,
        grid: (u32, u32),
        threads: u32,
        stream: sys::CUstream,
        mut args: Args,
    ) -> Result<(), OpsError> {
        let mut ptrs = args.pointers();
        // SAFETY: `f` is a function of the loaded module; `ptrs` point at arguments of
        // the kernel's parameter types, alive until this call returns (the driver copies
        // them); the device addresses were validated by the caller.
        unsafe {
            cu::launch_kernel(
                f,
                (grid.0, grid.1, 1),
                (threads, 1, 1),
                0,
                stream,
                &mut ptrs,
            )
        }
        .map_err(|e| failed(kernel, e))
    }

    /// Occupies the stream for `micros` microseconds with one thread.
    pub(super) fn spin(&self, stream: sys::CUstream, micros: u32) -> Result<(), OpsError> {
        if micros == 0 {
            return Ok(());
        }
        let mut args = Args::default().push(u64::from(micros) * 1000);
        let mut ptrs = args.pointers();
        // SAFETY: as in `launch`, with a grid of one thread.
        unsafe { cu::launch_kernel(self.spin, (1, 1, 1), (1, 1, 1), 0, stream, &mut ptrs) }
            .map_err(|e| failed("spin", e))
    }

    /// `dst = src` or `dst += src` over `n` elements.
    pub(super) fn add(
        &self,
        stream: sys::CUstream,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: u64,
        accumulate: bool,
    ) -> Result<(), OpsError> {
        if n == 0 {
            return Ok(());
        }
        let args = Args::default()
            .push(dst)
            .push(src)
            .push(n)
            .push(i32::from(accumulate));
        Self::launch("add", self.add, (blocks(n), 1), stream, args)
    }

    /// Runs copies in launches of at most [`MAX_SEGS`]; the caller guarantees that the
    /// destinations within one call are disjoint.
    pub(super) fn segments(
        &self,
        kernel: &'static str,
        stream: sys::CUstream,
        segs: &[Seg],
        accumulate: bool,
    ) -> Result<(), OpsError> {
        for chunk in segs.chunks(MAX_SEGS) {
            let longest = chunk.iter().map(|s| s.len).max().unwrap_or(0);
            if longest == 0 {
                continue;
            }
            let mut batch = Segs {
                s: [Seg::default(); MAX_SEGS],
                count: chunk.len() as u64,
                accumulate: i32::from(accumulate),
                pad: 0,
            };
            batch.s[..chunk.len()].copy_from_slice(chunk);
            let args = Args::default().push(batch);
            Self::launch(
                kernel,
                self.segments,
                (blocks(longest).min(1024), chunk.len() as u32),
                stream,
                args,
            )?;
        }
        Ok(())
    }

    /// Rounds `n` floats to bfloat16 (u16 storage).
    pub(super) fn round_bf16(
        &self,
        stream: sys::CUstream,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: u64,
    ) -> Result<(), OpsError> {
        if n == 0 {
            return Ok(());
        }
        let args = Args::default().push(dst).push(src).push(n);
        Self::launch("collective", self.to_bf16, (blocks(n), 1), stream, args)
    }

    /// Widens `n` bfloat16 values to floats.
    pub(super) fn widen_bf16(
        &self,
        stream: sys::CUstream,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: u64,
    ) -> Result<(), OpsError> {
        if n == 0 {
            return Ok(());
        }
        let args = Args::default().push(dst).push(src).push(n);
        Self::launch("collective", self.from_bf16, (blocks(n), 1), stream, args)
    }

    /// `dst = Σ_j x_j` over the `size` members of a copy-transport stage (`n` elements
    /// each): `own` is this member's chunk, `recv` the others', member `j`'s at
    /// [`crate::exchange_slot`]`(index, j) · stride` (`stride = n` for a receive buffer;
    /// the distance between peers' slots when reading a copy ring in place); `bf16`
    /// rounds every `x_j` first, `avg` divides by `size`. `max_ctas` caps the grid (the
    /// grid-stride loop covers any length), so the combine can run on a few SMs beside
    /// a GEMM instead of all of them. `streaming`: on 16-byte vectors with an uncapped
    /// grid, cache-streaming (evict-first) loads and stores, so the combine does not
    /// push the GEMMs' tiles out of L2 (the same bits).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn combine(
        &self,
        stream: sys::CUstream,
        (max_ctas, streaming): (Option<u32>, bool),
        (dst, own, recv): (sys::CUdeviceptr, sys::CUdeviceptr, sys::CUdeviceptr),
        (n, stride): (u64, u64),
        size: u32,
        index: u32,
        bf16: bool,
        avg: bool,
    ) -> Result<(), OpsError> {
        if n == 0 {
            return Ok(());
        }
        // 16-byte vectors where every operand allows: each pointer 16-byte aligned and
        // the slot stride a whole number of vectors.
        let vector = n % 4 == 0 && stride % 4 == 0 && [dst, own, recv].iter().all(|p| p % 16 == 0);
        let (f, len, step) = if vector {
            let f = if streaming && max_ctas.is_none() {
                self.combine4s
            } else {
                self.combine4
            };
            (f, n / 4, stride / 4)
        } else {
            (self.combine, n, stride)
        };
        let args = Args::default()
            .push(dst)
            .push(own)
            .push(recv)
            .push(len)
            .push(step)
            .push(size)
            .push(index)
            .push(i32::from(bf16))
            .push(i32::from(avg));
        match (vector, max_ctas) {
            // A capped grid on vectors: fewer, wider blocks that keep more loads in flight.
            (true, Some(cap)) => {
                let grid = len
                    .div_ceil(u64::from(WIDE_THREADS))
                    .clamp(1, u64::from(cap.max(1))) as u32;
                let f = self.combine4n;
                Self::launch_with("combine", f, (grid, 1), WIDE_THREADS, stream, args)
            }
            (false, Some(cap)) => {
                Self::launch("combine", f, (blocks(len).min(cap.max(1)), 1), stream, args)
            }
            (_, None) => Self::launch("combine", f, (blocks(len), 1), stream, args),
        }
    }

    /// `dst[0] = Σ x²` over every element of the spans [`sumsq_launches`] laid out,
    /// stored as f32: each first-pass launch `(grid, at, table)` reads its spans from
    /// the device address `table` ([`sumsq_words`]) and writes one double per block
    /// into `partial` from `at` on (room for the `partials` doubles
    /// [`sumsq_launches`] counts); the second, one block, sums them in index order and
    /// stores the result where the device word at `dst_at` points. No atomics and no
    /// host synchronisation, and no buffer address in the launches' parameters, so a
    /// captured graph of them serves any buffers.
    pub(super) fn sum_squares(
        &self,
        stream: sys::CUstream,
        launches: &[(u32, u64, sys::CUdeviceptr)],
        (partial, partials): (sys::CUdeviceptr, u64),
        dst_at: sys::CUdeviceptr,
    ) -> Result<(), OpsError> {
        const K: &str = "sum_squares";
        for &(grid, at, table) in launches {
            let args = Args::default().push(table).push(partial + at * 8);
            Self::launch(K, self.sumsq_spans, (grid, 1), stream, args)?;
        }
        let args = Args::default().push(partial).push(partials).push(dst_at);
        Self::launch(K, self.sumsq_final, (1, 1), stream, args)
    }

    /// Scales every span by the clip factor of the squared norm (one float, read on the
    /// device where the device word at `norm_at` points) and `max_norm`; nothing when
    /// the norm is not finite or the factor is not below 1. One launch per
    /// [`clip_launches`] entry, its spans at the device address `table`.
    pub(super) fn clip(
        &self,
        stream: sys::CUstream,
        launches: &[((u32, u32), sys::CUdeviceptr)],
        norm_at: sys::CUdeviceptr,
        max_norm: f32,
    ) -> Result<(), OpsError> {
        for &(grid, table) in launches {
            let args = Args::default().push(table).push(norm_at).push(max_norm);
            Self::launch("clip", self.clip, grid, stream, args)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_batches_have_the_layout_of_the_cuda_struct() {
        // struct Seg: three pointers and a u64; struct Segs: 32 of them, a u64, two ints.
        assert_eq!(std::mem::size_of::<Seg>(), 32);
        assert_eq!(std::mem::size_of::<Segs>(), 32 * MAX_SEGS + 16);
        assert!(SOURCE.contains(&format!("#define OV_MAX_SEGS {MAX_SEGS}")));
        assert!(SOURCE.contains(&format!("#define OV_REDUCE_THREADS {THREADS}")));
        assert!(SOURCE.contains(&format!("#define OV_COMBINE_WIDE {WIDE_THREADS}")));
        // struct Span: a pointer and a u64; struct Spans: 32 of them and a u64.
        assert_eq!(std::mem::size_of::<Span>(), 16);
        assert_eq!(std::mem::size_of::<Spans>(), 16 * MAX_SPANS + 8);
        assert!(SOURCE.contains(&format!("#define OV_MAX_SPANS {MAX_SPANS}")));
        // struct SumsqSpans: the spans, a u64 per span and a u64.
        assert_eq!(std::mem::size_of::<SumsqSpans>(), 24 * MAX_SPANS + 8);
        assert!(SOURCE.contains("#define OV_SUMSQ_CHUNK (OV_REDUCE_THREADS * 16)"));
        assert_eq!(SUMSQ_CHUNK, u64::from(THREADS) * 16);
    }

    /// Every function `Kernels::compile` looks up is defined in the source, with the
    /// parameters its launcher pushes, in order (a mismatch would read garbage on the
    /// GPU, not fail to compile).
    #[test]
    fn launchers_push_what_the_kernels_declare() {
        let source = full_source();
        let params = |name: &str| -> Vec<String> {
            let at = source
                .find(&format!("void {name}("))
                .unwrap_or_else(|| panic!("{name} is not in kernels.cu"));
            let rest = &source[at..];
            let open = rest.find('(').unwrap();
            let close = rest.find(')').unwrap();
            rest[open + 1..close]
                .split(',')
                .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
                .collect()
        };
        // The tail's kernels take their buffers' addresses from device memory (tables
        // the flush uploads), never as parameters: a captured graph serves any buffers.
        assert_eq!(
            params("ov_sumsq_spans"),
            ["const SumsqSpans* __restrict__ spans", "double* partial"]
        );
        assert_eq!(
            params("ov_sumsq_final"),
            [
                "const double* partial",
                "u64 count",
                "float* const* __restrict__ dst"
            ]
        );
        assert_eq!(
            params("ov_clip"),
            [
                "const Spans* __restrict__ spans",
                "const float* const* __restrict__ norm",
                "float max_norm"
            ]
        );
        assert_eq!(
            params("ov_adamw_multi"),
            ["const AdamwTable* __restrict__ table"]
        );
        assert_eq!(
            params("ov_mb_momentum"),
            [
                "const MuonMats* __restrict__ mats",
                "void* x",
                "u64 numel",
                "u64 stride",
                "const double* sc",
                "int bf16",
                "double* partial"
            ]
        );
        assert_eq!(
            params("ov_mb_update"),
            [
                "const MuonMats* __restrict__ mats",
                "const void* x",
                "u64 numel",
                "u64 stride",
                "const double* sc",
                "int bf16"
            ]
        );
        assert_eq!(
            params("ov_mb_scale"),
            [
                "void* x",
                "u64 numel",
                "u64 stride",
                "const double* norms",
                "int bf16"
            ]
        );
        assert_eq!(
            params("ov_mb_diag"),
            ["void* b", "u64 m", "u64 astride", "float shift", "int bf16"]
        );
        assert_eq!(
            params("ov_mb_norm"),
            ["const double* partial", "u32 count", "double* norms"]
        );
        for name in [
            "ov_add",
            "ov_segments",
            "ov_to_bf16",
            "ov_from_bf16",
            "ov_combine",
            "ov_combine4",
            "ov_combine4s",
            "ov_sumsq_spans",
            "ov_sumsq_final",
            "ov_clip",
            "ov_spin",
            "ov_adamw_multi",
            "ov_mb_momentum",
            "ov_mb_norm",
            "ov_mb_scale",
            "ov_mb_diag",
            "ov_mb_update",
        ] {
            assert!(
                source.contains(&format!("extern \"C\" __global__ void {name}(")),
                "{name}"
            );
        }
    }

    #[test]
    fn sum_of_squares_launches_depend_on_the_lengths_only() {
        let span = |p: u64, len: u64| Span { p, len };
        assert_eq!(sumsq_launches(&[]), (vec![], 0));
        // One short span: one block; a long one: a block per chunk.
        let (l, n) = sumsq_launches(&[span(0x1000, 10)]);
        assert_eq!(
            (l, n),
            (
                vec![SumSqLaunch {
                    spans: 0..1,
                    grid: 1,
                    at: 0
                }],
                1
            )
        );
        let long = SUMSQ_CHUNK * 3 + 1;
        let (l, n) = sumsq_launches(&[span(0x1000, 10), span(0x2000, long)]);
        assert_eq!(l[0].grid, 1 + 4);
        assert_eq!(n, 5);
        let t = SumsqSpans::of(&[span(0x1000, 10), span(0x2000, long)]);
        assert_eq!(&t.block0[..2], &[0, 1]);
        // In device memory as the struct lays it out: spans, first blocks, count.
        let w = sumsq_words(&[span(0x1000, 10), span(0x2000, long)]);
        assert_eq!(w.len() * 8, std::mem::size_of::<SumsqSpans>());
        assert_eq!(
            (&w[..4], w[2 * MAX_SPANS + 1], w[3 * MAX_SPANS]),
            (&[0x1000, 10, 0x2000, long][..], 1, 2)
        );
        // More spans than one launch takes: consecutive launches, partials back to back.
        let spans: Vec<Span> = (0..MAX_SPANS as u64 + 5)
            .map(|i| span(0x1000 * (i + 1), 3000 * (i + 1)))
            .collect();
        let (l, n) = sumsq_launches(&spans);
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].spans, 0..MAX_SPANS);
        assert_eq!(l[1].spans, MAX_SPANS..MAX_SPANS + 5);
        let blocks = |r: std::ops::Range<usize>| -> u64 {
            spans[r].iter().map(|s| s.len.div_ceil(SUMSQ_CHUNK)).sum()
        };
        assert_eq!(u64::from(l[0].grid), blocks(0..MAX_SPANS));
        assert_eq!(l[1].at, u64::from(l[0].grid));
        assert_eq!(n, l[1].at + u64::from(l[1].grid));
        // Other addresses, same lengths: the same launches.
        let moved: Vec<Span> = spans.iter().map(|s| span(s.p + 0x10_0000, s.len)).collect();
        assert_eq!(sumsq_launches(&moved), (l, n));
    }

    #[test]
    fn a_buffer_named_twice_is_clipped_in_two_launches() {
        let span = |p: u64| Span { p, len: 4 };
        let b = clip_batches(&[span(1), span(2), span(1), span(3)]);
        assert_eq!(b, vec![vec![span(1), span(2)], vec![span(1), span(3)]]);
        let many: Vec<Span> = (0..MAX_SPANS as u64 * 2 + 1).map(span).collect();
        let b = clip_batches(&many);
        assert_eq!(
            b.iter().map(Vec::len).collect::<Vec<_>>(),
            [MAX_SPANS, MAX_SPANS, 1]
        );
        assert_eq!(b.concat(), many);
        assert!(clip_batches(&[]).is_empty());
    }

    #[test]
    fn arguments_are_stored_word_aligned() {
        let mut a = Args::default().push(1u64).push(2i32).push(3.5f64);
        let ptrs = a.pointers();
        assert_eq!(ptrs.len(), 3);
        assert!(ptrs.iter().all(|p| (*p as usize) % 8 == 0));
        // SAFETY: the second slot holds an i32.
        assert_eq!(unsafe { *(ptrs[1] as *const i32) }, 2);
    }

    /// Compiles the source with NVRTC when the library is present (no GPU needed):
    /// `LD_LIBRARY_PATH=/usr/local/cuda/lib64 cargo test -p overlap-ops --features cuda`.
    #[test]
    fn the_kernel_source_compiles_when_nvrtc_is_available() {
        if super::super::loader::NVRTC.check().is_err() {
            eprintln!("NVRTC not found: skipping the compile check");
            return;
        }
        let opts = CompileOptions {
            fmad: Some(false),
            options: vec!["--gpu-architecture=compute_90".into()],
            ..Default::default()
        };
        if let Err(e) = nvrtc::compile_ptx_with_opts(full_source(), opts) {
            panic!("kernels.cu does not compile: {e:?}");
        }
    }
}
