//! Benchmark probes that go around the plan: a copy-engine copy
//! ([`CudaBackend::copy_engine_copy`], for `overlap bench-interference`) and what each
//! driver call of the issue path costs the host ([`CudaBackend::host_costs`], for
//! `overlap cuda-smoke`).
//!
//! Invariant: a probe runs on the backend's own streams under the issue lock, and the
//! host-cost figures are taken between drains of those streams.

use std::time::Instant;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use overlap_graph::Stream;

use super::backend::CudaBackend;
use super::checks::expect;
use super::device;
use super::event::{lock, CudaEvent};
use super::exchange;
use super::kernels::Kernels;
use super::memory::CudaBuffer;
use crate::{Backend, Kernel, OpsError, Tag};

impl CudaBackend {
    /// Copies all of `src` into `dst` (the same length, this rank's) on `stream` with
    /// `cuMemcpyDtoDAsync`, i.e. on the copy engines, timed like a kernel tagged `tag`
    /// when timings are on. For probes of what copy-engine traffic costs the kernels
    /// beside it (`overlap bench-interference`); the plan's copies are kernels or
    /// exchanges.
    pub fn copy_engine_copy(
        &self,
        stream: Stream,
        tag: Tag,
        dst: &CudaBuffer,
        src: &CudaBuffer,
    ) -> Result<(), OpsError> {
        const K: &str = "copy";
        expect(K, self.shared.rank, "src", src, dst.len)?;
        expect(K, self.shared.rank, "dst", dst, src.len)?;
        let mut st = lock(&self.issue);
        self.shared.device.bind()?;
        let raw = self.shared.device.stream(stream);
        let start = if st.timings.on {
            st.timing_event(&self.shared, raw)
        } else {
            None
        };
        let bytes = src.len * 4;
        // SAFETY: both buffers are this rank's and hold `len` floats (checked above).
        let copied = unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr(), src.ptr(), bytes, raw) }
            .result()
            .map_err(|e| device::failed(K, e));
        let issued = copied.as_ref().ok().map(|()| bytes as u64);
        st.end_timing(&self.shared, (stream, raw), tag, start, issued);
        copied
    }

    /// What issuing costs the host, in microseconds per call: each driver call the
    /// backend's nodes are made of (and the backend's own record-and-wait edge and
    /// marker), issued `iters` times back to back on an idle stream, then the streams
    /// drained before the next. `overlap cuda-smoke` reports it: with the per-kind
    /// figures of `overlap bench` it says where a node's host time goes.
    pub fn host_costs(&self, iters: u32) -> Result<Vec<(&'static str, f64)>, OpsError> {
        let shared = &self.shared;
        let device = &shared.device;
        device.bind()?;
        let mut timer = HostTimer {
            streams: [device.stream(Stream::Copy), device.stream(Stream::Reduce)],
            iters: iters.max(1),
            out: Vec::new(),
        };
        let mem = shared.memory.alloc_raw(1 << 12)?;
        let ev = shared.events.take_plain()?;
        let measured = self.driver_costs(&mut timer, mem.ptr(), ev);
        shared.events.put_plain(ev);
        measured?;
        self.backend_costs(&mut timer)?;
        drop(mem);
        Ok(timer.out)
    }

    /// [`CudaBackend::host_costs`]' driver calls, under the issue lock: an event edge,
    /// flag operations on the 4 KiB `mem` at `flag`, a copy, a launch and event queries.
    fn driver_costs(
        &self,
        timer: &mut HostTimer,
        flag: sys::CUdeviceptr,
        ev: sys::CUevent,
    ) -> Result<(), OpsError> {
        let device = &self.shared.device;
        let [raw, other] = timer.streams;
        let flagged = |r: Result<(), String>| r.map_err(OpsError::Backend);
        let st = lock(&self.issue);
        timer.time("cuCtxSetCurrent", &mut |_| device.bind())?;
        timer.time("cuEventRecord", &mut |_| {
            // SAFETY: live handles of the bound context.
            unsafe { cu::event::record(ev, raw) }.map_err(|e| device::backend("cuEventRecord", e))
        })?;
        timer.time("cuStreamWaitEvent", &mut |_| {
            // SAFETY: live handles of the bound context.
            unsafe {
                cu::stream::wait_event(other, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            }
            .map_err(|e| device::backend("cuStreamWaitEvent", e))
        })?;
        use crate::copy_protocol::Flag;
        timer.time("cuStreamWriteValue32", &mut |i| {
            flagged(exchange::flags(raw, &[Flag::Write(flag, i)]))
        })?;
        timer.time("cuStreamWaitValue32 (already reached)", &mut |_| {
            flagged(exchange::flags(raw, &[Flag::Wait(flag, 0)]))
        })?;
        timer.time("cuStreamBatchMemOp (a write and a wait)", &mut |i| {
            flagged(exchange::flags(
                raw,
                &[Flag::Write(flag, i), Flag::Wait(flag, i)],
            ))
        })?;
        timer.time("cuMemcpyDtoDAsync (2 KiB)", &mut |_| {
            // SAFETY: both halves of the 4 KiB `mem`, ordered on `raw`.
            unsafe { sys::cuMemcpyDtoDAsync_v2(flag + 2048, flag, 2048, raw) }
                .result()
                .map_err(|e| device::backend("cuMemcpyDtoDAsync", e))
        })?;
        timer.time("cuLaunchKernel (add, 1 element)", &mut |_| {
            st.kernels.add(raw, flag + 64, flag + 128, 1, false)
        })?;
        query_costs(timer, &st.kernels, ev)
    }

    /// [`CudaBackend::host_costs`]' calls to the backend itself: what the executor
    /// issues per cross-stream edge and per aliased node (the issue lock, a pooled
    /// event, the driver call).
    fn backend_costs(&self, timer: &mut HostTimer) -> Result<(), OpsError> {
        let rank = self.shared.rank;
        let edge = CudaEvent::new(rank);
        timer.time("Backend::record + Backend::wait (one edge)", &mut |_| {
            self.record(rank, Stream::Copy, &edge);
            self.wait(rank, Stream::Reduce, &edge);
            Ok(())
        })?;
        timer.time("Backend::launch (marker)", &mut |i| {
            let tag = Tag {
                node: i,
                op: "marker",
                micro_batch: 0,
            };
            self.launch(rank, Stream::Copy, tag, Kernel::Marker);
            Ok(())
        })
    }
}

/// Times host calls for [`CudaBackend::host_costs`], between drains of its two
/// streams.
struct HostTimer {
    /// The stream the calls issue on, and the one an event edge waits on.
    streams: [sys::CUstream; 2],
    /// Calls per figure, back to back.
    iters: u32,
    /// Each call's name and mean host time in microseconds.
    out: Vec<(&'static str, f64)>,
}

impl HostTimer {
    /// Waits until both streams are idle.
    fn drain(&self) -> Result<(), OpsError> {
        for s in self.streams {
            // SAFETY: live streams of the bound context.
            unsafe { cu::stream::synchronize(s) }
                .map_err(|e| device::backend("cuStreamSynchronize", e))?;
        }
        Ok(())
    }

    /// Calls `f` `iters` times (with the iteration) on idle streams and records the
    /// mean time per call under `name`, then drains the streams.
    fn time(
        &mut self,
        name: &'static str,
        f: &mut dyn FnMut(u32) -> Result<(), OpsError>,
    ) -> Result<(), OpsError> {
        self.drain()?;
        let t0 = Instant::now();
        for i in 0..self.iters {
            f(i)?;
        }
        let mean = t0.elapsed().as_secs_f64() * 1e6 / f64::from(self.iters);
        self.out.push((name, mean));
        self.drain()
    }
}

/// [`CudaBackend::host_costs`]' `cuEventQuery` figures, on an event complete and then
/// pending behind a spinning kernel.
fn query_costs(timer: &mut HostTimer, kernels: &Kernels, ev: sys::CUevent) -> Result<(), OpsError> {
    let [raw, _] = timer.streams;
    let iters = timer.iters;
    let query = |_| {
        // SAFETY: a live event of the bound context.
        match unsafe { cu::event::query(ev) } {
            Ok(()) => Ok(()),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(()),
            Err(e) => Err(device::backend("cuEventQuery", e)),
        }
    };
    // SAFETY: live handles of the bound context; `time` drained the stream.
    unsafe { cu::event::record(ev, raw) }.map_err(|e| device::backend("cuEventRecord", e))?;
    timer.time("cuEventQuery (complete)", &mut { query })?;
    // Pending: behind a kernel that spins longer than the queries take (launched
    // in the first iteration, whose two calls add ~4 µs to the whole loop).
    timer.time("cuEventQuery (pending)", &mut |i| {
        if i == 0 {
            kernels.spin(raw, (iters / 10).clamp(5, 100) * 1000)?;
            // SAFETY: live handles of the bound context.
            unsafe { cu::event::record(ev, raw) }
                .map_err(|e| device::backend("cuEventRecord", e))?;
        }
        query(i)
    })
}
