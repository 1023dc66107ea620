//! `overlap bench-optimizer` on the GPU: opens device 0 as the one rank
//! of a `1 × 1` mesh, allocates every parameter, gradient and optimizer state of the
//! shape set, and times the tail as the executor issues it (one kernel per parameter,
//! on the compute stream) between CUDA timing events.
//!
//! Invariant: runs on one host thread (the context stays bound on it), and every timed
//! interval starts and ends with an event recorded on the stream the kernels run on,
//! after the backend issued what it held (`CudaBackend::raw_stream`).

use std::sync::Arc;
use std::time::Instant;

use overlap::Error;
use overlap_graph::{Mesh, Stream};
use overlap_ops::cuda::cudarc::driver::{result as cu, sys};
use overlap_ops::cuda::{CudaBackend, CudaBuffer, CudaOptions};
use overlap_ops::{AdamwParams, Backend, Kernel, MuonParams, NsDtype, Tag};

use crate::bench_optim::{ns_flops, shape_set, BenchOptimizerArgs, OptimReport, TailRow, Tensor};

fn driver(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("bench-optimizer: {what}: {e:?}"))
}

/// A parameter's buffers: values, gradient, optimizer state (AdamW `2n`, Muon `n`).
struct Slot {
    tensor: Tensor,
    param: CudaBuffer,
    grad: CudaBuffer,
    adamw: CudaBuffer,
    muon: Option<CudaBuffer>,
}

/// Two timing events on the compute stream.
struct Timer {
    stream: sys::CUstream,
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Timer {
    fn new(b: &CudaBackend) -> Result<Timer, Error> {
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(Timer {
            stream: b.raw_stream(Stream::Compute),
            start: cu::event::create(flags).map_err(|e| driver("cuEventCreate", e))?,
            end: cu::event::create(flags).map_err(|e| driver("cuEventCreate", e))?,
        })
    }

    fn mark(&self, b: &CudaBackend, end: bool) -> Result<(), Error> {
        // `raw_stream` first issues what the backend holds on the stream.
        let stream = b.raw_stream(Stream::Compute);
        debug_assert_eq!(stream, self.stream);
        let ev = if end { self.end } else { self.start };
        // SAFETY: a live event and stream of the context bound on this thread.
        unsafe { cu::event::record(ev, stream) }.map_err(|e| driver("cuEventRecord", e))
    }

    /// Milliseconds from start to end, once end has executed.
    fn elapsed(&self) -> Result<f64, Error> {
        // SAFETY: both events were recorded on a live stream.
        unsafe {
            cu::event::synchronize(self.end).map_err(|e| driver("cuEventSynchronize", e))?;
            cu::event::elapsed(self.start, self.end)
                .map(f64::from)
                .map_err(|e| driver("cuEventElapsedTime", e))
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: events created by `Timer::new`, no longer used.
        unsafe {
            let _ = cu::event::destroy(self.start);
            let _ = cu::event::destroy(self.end);
        }
    }
}

fn ops(e: overlap_ops::OpsError) -> Error {
    Error::Backend(e.to_string())
}

/// A buffer of `n` values tiled from one pseudo-random block.
fn filled(b: &CudaBackend, n: usize, block: &[f32]) -> Result<CudaBuffer, Error> {
    let buf = b.alloc(0, n).map_err(ops)?;
    let data: Vec<f32> = block.iter().copied().cycle().take(n).collect();
    b.upload(&buf, &data).map_err(ops)?;
    Ok(buf)
}

/// The device-to-device copy bandwidth (bytes read plus written per second), GB/s.
fn copy_gbps(b: &CudaBackend, timer: &Timer) -> Result<f64, Error> {
    let n = 256usize << 20;
    let (src, dst) = (b.alloc(0, n).map_err(ops)?, b.alloc(0, n).map_err(ops)?);
    let iters = 10;
    let copy = || {
        // SAFETY: both buffers hold `n` floats and no other work uses them.
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.device_ptr(), src.device_ptr(), n * 4, timer.stream)
        }
        .result()
        .map_err(|e| driver("cuMemcpyDtoDAsync", e))
    };
    copy()?;
    timer.mark(b, false)?;
    for _ in 0..iters {
        copy()?;
    }
    timer.mark(b, true)?;
    let ms = timer.elapsed()?;
    Ok(2.0 * (n * 4) as f64 * f64::from(iters) / (ms * 1e-3) / 1e9)
}

/// The global norm's buffers for a tail behind clipping: the norm, every gradient, and
/// a pristine copy of each, restored before every step (outside the timed interval) so
/// that every timed step clips.
struct ClipBufs {
    norm: CudaBuffer,
    grads: Arc<[CudaBuffer]>,
    pristine: Vec<CudaBuffer>,
}

/// Far below the gradients' norm: every step clips.
const MAX_NORM: f32 = 1e-3;

impl ClipBufs {
    fn new(b: &CudaBackend, slots: &[Slot]) -> Result<ClipBufs, Error> {
        let grads: Arc<[CudaBuffer]> = slots.iter().map(|s| s.grad.clone()).collect();
        let mut pristine = Vec::with_capacity(grads.len());
        for g in grads.iter() {
            pristine.push(b.alloc(0, g.len()).map_err(ops)?);
        }
        let clip = ClipBufs {
            norm: b.alloc(0, 1).map_err(ops)?,
            grads,
            pristine,
        };
        clip.copy(b, true)?;
        Ok(clip)
    }

    /// Copies every gradient into its pristine copy (`save`) or back.
    fn copy(&self, b: &CudaBackend, save: bool) -> Result<(), Error> {
        let stream = b.raw_stream(Stream::Compute);
        for (g, p) in self.grads.iter().zip(&self.pristine) {
            let (dst, src) = if save { (p, g) } else { (g, p) };
            // SAFETY: both buffers hold `len` floats; the stream orders the copy.
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst.device_ptr(), src.device_ptr(), g.len() * 4, stream)
            }
            .result()
            .map_err(|e| driver("cuMemcpyDtoDAsync", e))?;
        }
        Ok(())
    }

    /// The norm and the clip, then `kernels` guarded by the norm.
    fn wrap(&self, kernels: Vec<Kernel<CudaBuffer>>) -> Vec<Kernel<CudaBuffer>> {
        let mut out = vec![
            Kernel::SumSquares {
                dst: self.norm.clone(),
                srcs: self.grads.clone(),
            },
            Kernel::Clip {
                norm: self.norm.clone(),
                bufs: self.grads.clone(),
                max_norm: MAX_NORM,
            },
        ];
        out.extend(kernels.into_iter().map(|k| Kernel::IfFinite {
            norm: self.norm.clone(),
            kernel: Box::new(k),
        }));
        out
    }
}

/// What one timed tail runs: the optimizers (Muon in the dtype, or AdamW only), behind
/// the global norm and clip when `clip` is set, or the norm alone.
#[derive(Clone, Copy)]
enum Tail<'a> {
    Update(Option<NsDtype>, Option<&'a ClipBufs>),
    NormOnly(&'a ClipBufs),
}

impl Tail<'_> {
    fn kernels(self, slots: &[Slot], step: u64) -> Vec<Kernel<CudaBuffer>> {
        match self {
            Tail::Update(ns, None) => step_kernels(slots, ns, step),
            Tail::Update(ns, Some(c)) => c.wrap(step_kernels(slots, ns, step)),
            Tail::NormOnly(c) => vec![Kernel::SumSquares {
                dst: c.norm.clone(),
                srcs: c.grads.clone(),
            }],
        }
    }

    /// Restores the gradients a clip scaled (outside the timed interval).
    fn restore(self, b: &CudaBackend) -> Result<(), Error> {
        match self {
            Tail::Update(_, Some(c)) => c.copy(b, false),
            _ => Ok(()),
        }
    }
}

/// One step's kernels: AdamW on every slot, or Muon (in `ns`) on the Muon ones.
fn step_kernels(slots: &[Slot], ns: Option<NsDtype>, step: u64) -> Vec<Kernel<CudaBuffer>> {
    slots
        .iter()
        .map(|s| match (ns, &s.muon) {
            (Some(ns_dtype), Some(momentum)) => Kernel::Muon {
                param: s.param.clone(),
                grad: s.grad.clone(),
                momentum: momentum.clone(),
                rows: s.tensor.dims[0],
                cols: s.tensor.dims[1],
                hp: MuonParams::default().with_ns_dtype(ns_dtype),
            },
            _ => Kernel::Adamw {
                param: s.param.clone(),
                grad: s.grad.clone(),
                state: s.adamw.clone(),
                hp: AdamwParams::default(),
                step,
            },
        })
        .collect()
}

fn launch_all(b: &CudaBackend, kernels: Vec<Kernel<CudaBuffer>>) {
    for (i, k) in kernels.into_iter().enumerate() {
        let tag = Tag {
            node: i as u32,
            op: "optimizer",
            micro_batch: u32::MAX,
        };
        b.launch(0, Stream::Compute, tag, k);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// How long the stream is kept busy before a covered step's start event: longer than
/// the host takes to issue any tail here, so the step's device time excludes it.
const COVER_US: u32 = 20_000;

/// Times one tail: steps alone (median; `covered`: issued while a spin occupies the
/// stream, as a tail is issued while the backward still runs, so the host's issue time
/// is not counted), then `iters` back to back. Returns (alone, covered, back to back)
/// in ms and the host's µs per step (alone, covered).
fn time_tail(
    b: &CudaBackend,
    timer: &Timer,
    slots: &[Slot],
    tail: Tail<'_>,
    (iters, warmup): (u32, u32),
) -> Result<([f64; 3], [f64; 2]), Error> {
    let (mut alone, mut covered) = (Vec::new(), Vec::new());
    let (mut host, mut host_covered) = (Vec::new(), Vec::new());
    let mut step = 1;
    for i in 0..2 * (warmup + iters) {
        let kernels = tail.kernels(slots, step);
        step += 1;
        tail.restore(b)?;
        let cover = i % 2 == 1;
        if cover {
            let tag = Tag {
                node: u32::MAX,
                op: "cover",
                micro_batch: u32::MAX,
            };
            b.launch(0, Stream::Compute, tag, Kernel::Spin { micros: COVER_US });
        }
        timer.mark(b, false)?;
        let t0 = Instant::now();
        launch_all(b, kernels);
        timer.mark(b, true)?;
        let us = t0.elapsed().as_secs_f64() * 1e6;
        let ms = timer.elapsed()?;
        if i >= 2 * warmup {
            if cover {
                covered.push(ms);
                host_covered.push(us);
            } else {
                alone.push(ms);
                host.push(us);
            }
        }
    }
    let b2b = back_to_back(b, timer, slots, tail, (step, iters))?;
    let errors = b.errors();
    if !errors.is_empty() {
        return Err(Error::Backend(format!("bench-optimizer: {errors:?}")));
    }
    Ok((
        [median(alone), median(covered), b2b],
        [median(host), median(host_covered)],
    ))
}

/// Milliseconds per step of `iters` steps issued back to back from `step` on; a tail
/// that restores its gradients restores them between steps, and the time of the
/// restores alone (measured the same way) is taken off.
fn back_to_back(
    b: &CudaBackend,
    timer: &Timer,
    slots: &[Slot],
    tail: Tail<'_>,
    (mut step, iters): (u64, u32),
) -> Result<f64, Error> {
    timer.mark(b, false)?;
    for _ in 0..iters {
        let kernels = tail.kernels(slots, step);
        step += 1;
        tail.restore(b)?;
        launch_all(b, kernels);
    }
    timer.mark(b, true)?;
    let mut ms = timer.elapsed()?;
    if let Tail::Update(_, Some(_)) = tail {
        timer.mark(b, false)?;
        for _ in 0..iters {
            tail.restore(b)?;
        }
        timer.mark(b, true)?;
        ms -= timer.elapsed()?;
    }
    Ok(ms / f64::from(iters.max(1)))
}

/// An update tail of `--clip`: its name, Muon's dtype (`None`: AdamW only), its
/// memory-bound limit in ms and its Newton–Schulz TFLOP.
type UpdateTail = (String, Option<NsDtype>, f64, f64);

/// The rows of `--clip`: the norm alone, then each update tail (name, Muon's dtype,
/// memory-bound limit in ms, Newton–Schulz TFLOP) behind the norm and the clip, fused
/// and as a pass of its own; `norm_limit` is the norm's limit in ms (one read of every
/// gradient), added to each update's.
fn clip_rows(
    b: &CudaBackend,
    timer: &Timer,
    slots: &[Slot],
    (updates, norm_limit): (&[UpdateTail], f64),
    (iters, warmup): (u32, u32),
) -> Result<Vec<TailRow>, Error> {
    let clip = ClipBufs::new(b, slots)?;
    let mut rows = Vec::new();
    let (times, host_us) = time_tail(b, timer, slots, Tail::NormOnly(&clip), (iters, warmup))?;
    rows.push(TailRow::of("norm".into(), times, host_us, norm_limit, 0.0));
    for (name, ns, limit, ns_tflop) in updates {
        for fused in [true, false] {
            b.set_clip_fusion(fused);
            let tail = Tail::Update(*ns, Some(&clip));
            let (times, host_us) = time_tail(b, timer, slots, tail, (iters, warmup))?;
            let how = if fused { "clip" } else { "clip-pass" };
            // The norm's read (4 bytes a value) on top of the update's 28.
            let limit = limit + norm_limit;
            rows.push(TailRow::of(
                format!("{name}+{how}"),
                times,
                host_us,
                limit,
                *ns_tflop,
            ));
        }
    }
    b.set_clip_fusion(true);
    Ok(rows)
}

/// Every parameter's buffers on the device, with a Muon momentum for the Muon ones when
/// `muon` is set.
fn alloc_slots(b: &CudaBackend, tensors: Vec<Tensor>, muon: bool) -> Result<Vec<Slot>, Error> {
    let block = overlap_ops::math::pseudo_random(1 << 20, 7);
    let mut slots = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n = t.numel();
        let momentum = (muon && t.muon)
            .then(|| b.alloc(0, n).map_err(ops))
            .transpose()?;
        slots.push(Slot {
            param: filled(b, n, &block)?,
            grad: filled(b, n, &block[1..])?,
            adamw: b.alloc(0, 2 * n).map_err(ops)?,
            muon: momentum,
            tensor: t,
        });
    }
    Ok(slots)
}

impl TailRow {
    /// A row from `time_tail`'s (alone, covered, back to back) figures.
    fn of(
        tail: String,
        [alone_ms, device_ms, back_to_back_ms]: [f64; 3],
        [host_us, host_covered_us]: [f64; 2],
        adamw_limit_ms: f64,
        ns_tflop: f64,
    ) -> TailRow {
        TailRow {
            tail,
            alone_ms,
            device_ms,
            back_to_back_ms,
            host_us,
            host_covered_us,
            adamw_limit_ms,
            ns_tflop,
        }
    }
}

/// The precisions of `--ns-dtype`, a comma-separated list.
fn ns_dtypes(list: &str) -> Result<Vec<NsDtype>, Error> {
    list.split(',')
        .map(|d| {
            NsDtype::parse(d.trim())
                .ok_or_else(|| Error::Usage(format!("--ns-dtype: `{d}` is not bf16, tf32 or f32")))
        })
        .collect()
}

/// Runs the benchmark (blocking: call it on a thread of its own).
pub fn run(args: &BenchOptimizerArgs) -> Result<OptimReport, Error> {
    let tensors = shape_set(&args.shapes)?;
    let dtypes = ns_dtypes(&args.ns_dtype)?;
    let mesh = Mesh::new(1, 1).map_err(|e| Error::Usage(e.to_string()))?;
    let b = CudaBackend::new(CudaOptions::new(mesh, 0, 0)).map_err(ops)?;
    let slots = alloc_slots(&b, tensors, args.muon)?;
    let timer = Timer::new(&b)?;
    let copy = copy_gbps(&b, &timer)?;
    let limit = |on_adamw: usize| 28.0 * on_adamw as f64 / (copy * 1e9) * 1e3;
    let values: usize = slots.iter().map(|s| s.tensor.numel()).sum();
    let mut rows = Vec::new();
    let timed = (args.iters, args.warmup);
    let (times, host_us) = time_tail(&b, &timer, &slots, Tail::Update(None, None), timed)?;
    rows.push(TailRow::of(
        "adamw".into(),
        times,
        host_us,
        limit(values),
        0.0,
    ));
    let on_muon: Vec<&Tensor> = slots
        .iter()
        .filter(|s| s.muon.is_some())
        .map(|s| &s.tensor)
        .collect();
    let muon_values: usize = on_muon.iter().map(|t| t.numel()).sum();
    let flops: f64 = on_muon
        .iter()
        .map(|t| ns_flops(t.dims[0], t.dims[1], MuonParams::default().ns_steps))
        .sum();
    if !on_muon.is_empty() {
        for &dtype in &dtypes {
            let tail = Tail::Update(Some(dtype), None);
            let (times, host_us) = time_tail(&b, &timer, &slots, tail, timed)?;
            let name = format!("muon-{}", dtype.name());
            let limit = limit(values - muon_values);
            rows.push(TailRow::of(
                name.clone(),
                times,
                host_us,
                limit,
                flops / 1e12,
            ));
            if Some(&dtype) == dtypes.first() {
                // Newton–Schulz issued call by call instead of replayed as a graph.
                b.set_tail_graphs(false);
                let (times, host_us) = time_tail(&b, &timer, &slots, tail, timed)?;
                b.set_tail_graphs(true);
                let name = format!("{name}-direct");
                rows.push(TailRow::of(name, times, host_us, limit, flops / 1e12));
            }
        }
    }
    if args.clip {
        let mut updates = vec![("adamw".to_string(), None, limit(values), 0.0)];
        if let (Some(&dtype), false) = (dtypes.first(), on_muon.is_empty()) {
            let name = format!("muon-{}", dtype.name());
            updates.push((name, Some(dtype), limit(values - muon_values), flops / 1e12));
        }
        // The norm reads every gradient once: 4 bytes a value.
        let norm_limit = 4.0 * values as f64 / (copy * 1e9) * 1e3;
        rows.extend(clip_rows(
            &b,
            &timer,
            &slots,
            (&updates, norm_limit),
            timed,
        )?);
    }
    let info = b.info();
    Ok(OptimReport {
        shapes: args.shapes.clone(),
        device: info.name.clone(),
        tensors: slots.len(),
        values,
        muon_matrices: on_muon.len(),
        copy_gbps: copy,
        iters: args.iters,
        warmup: args.warmup,
        rows,
    })
}
