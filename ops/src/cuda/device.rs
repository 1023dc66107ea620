//! One GPU: its primary context and the streams of the rank that drives it.
//!
//! [`Device`] retains the device's primary context (the one the CUDA runtime, cuBLAS and
//! NCCL use too, so the libraries agree on the device without `cudaSetDevice`) and
//! creates the rank's plan streams (ARCHITECTURE.md, `ops/`) plus a private *host* stream:
//!
//! - every stream is created `CU_STREAM_NON_BLOCKING`, so none synchronises implicitly
//!   with the legacy default stream (which some library might use): every ordering
//!   between them comes from the plan's events;
//! - the `reduce` stream gets the greatest priority the device offers, so Stage-1
//!   collectives and folds are scheduled ahead of backward's kernels when both are ready
//!   (FSDP2's choice); the others get the least (the default);
//! - the host stream carries only synchronous host operations (zeroing a new buffer,
//!   uploads, downloads): each is synchronised before the call returns, so it never
//!   overlaps work the plan ordered.
//!
//! Invariant: the context is current on every thread before it issues a CUDA call
//! ([`Device::bind`]): tokio may move the issuing task between threads, so every entry
//! point of the backend binds it first.

use std::ffi::CStr;
use std::sync::Arc;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use overlap_graph::Stream;

use crate::OpsError;

/// A CUDA driver error as text: its name and description.
pub(super) fn describe(e: DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(s) => format!("{name}: {}", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// A driver call that failed while setting up or on the host side: a backend error.
pub(super) fn backend(what: &str, e: DriverError) -> OpsError {
    OpsError::Backend(format!("{what}: {}", describe(e)))
}

/// A driver call that failed while running a kernel: the kernel failed.
pub(super) fn failed(kernel: &'static str, e: DriverError) -> OpsError {
    OpsError::Failed {
        kernel,
        reason: describe(e),
    }
}

/// The GPU of one rank.
pub(super) struct Device {
    /// The device ordinal (among the visible devices).
    pub ordinal: u32,
    /// The device's name, for messages.
    pub name: String,
    /// Compute capability.
    pub capability: (i32, i32),
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
    /// The rank's streams, at [`Stream::index`].
    streams: [sys::CUstream; Stream::COUNT],
    /// The private stream of synchronous host operations.
    host: sys::CUstream,
}

// SAFETY: the context and stream handles are plain driver handles; the driver API is
// thread-safe once the context is current on the calling thread, which every user of a
// `Device` ensures with `bind`.
unsafe impl Send for Device {}
// SAFETY: as for `Send`: `Device` has no interior mutability of its own.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `ordinal`: initialises the driver, retains the primary context and
    /// creates the streams (the reduce stream at the greatest priority unless
    /// `uniform_priority`, which gives every stream the same).
    pub(super) fn open(ordinal: u32, uniform_priority: bool) -> Result<Arc<Device>, OpsError> {
        cu::init().map_err(|e| backend("cannot initialise the CUDA driver (cuInit)", e))?;
        let count = cu::device::get_count().map_err(|e| backend("cuDeviceGetCount", e))?;
        if i64::from(ordinal) >= i64::from(count) {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into());
            return Err(OpsError::Backend(format!(
                "this rank wants CUDA device {ordinal} (its local rank), but {count} device(s) are visible \
                 (CUDA_VISIBLE_DEVICES={visible}); start at most one rank per GPU on each node"
            )));
        }
        let dev = cu::device::get(ordinal as i32).map_err(|e| backend("cuDeviceGet", e))?;
        let name = cu::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
        let attr = |a| {
            // SAFETY: `dev` is a valid device handle from cuDeviceGet.
            unsafe { cu::device::get_attribute(dev, a) }
                .map_err(|e| backend("cuDeviceGetAttribute", e))
        };
        let capability = (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        // SAFETY: `dev` is valid; the retained context is released in `Drop`.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }
            .map_err(|e| backend("cuDevicePrimaryCtxRetain", e))?;
        let mut device = Device {
            ordinal,
            name,
            capability,
            ctx,
            dev,
            streams: [std::ptr::null_mut(); Stream::COUNT],
            host: std::ptr::null_mut(),
        };
        device.bind()?;
        let (least, greatest) = cu::stream::get_priority_range()
            .map_err(|e| backend("cuCtxGetStreamPriorityRange", e))?;
        for stream in Stream::ALL {
            // The reduce stream is the high-priority one (FSDP2's binding, `docs/plan-format.md` section 4): Stage 1
            // and folds should not queue behind backward's GEMMs.
            let priority = if stream.high_priority() && !uniform_priority {
                greatest
            } else {
                least
            };
            device.streams[stream.index()] =
                cu::stream::create_with_priority(cu::stream::StreamKind::NonBlocking, priority)
                    .map_err(|e| backend("cuStreamCreateWithPriority", e))?;
        }
        device.host = cu::stream::create_with_priority(cu::stream::StreamKind::NonBlocking, least)
            .map_err(|e| backend("cuStreamCreateWithPriority", e))?;
        Ok(Arc::new(device))
    }

    /// A device of null handles for tests of host-side logic (`memory.rs`'s
    /// `stand_in_buffers`, which never lets it drop).
    #[cfg(test)]
    pub(super) fn stand_in() -> Device {
        Device {
            ordinal: 0,
            name: "stand-in".into(),
            capability: (9, 0),
            ctx: std::ptr::null_mut(),
            dev: 0,
            streams: [std::ptr::null_mut(); Stream::COUNT],
            host: std::ptr::null_mut(),
        }
    }

    /// Makes the context current on the calling thread.
    pub(super) fn bind(&self) -> Result<(), OpsError> {
        // SAFETY: the context is retained for the device's lifetime.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| backend("cuCtxSetCurrent", e))
    }

    /// A stream of the rank.
    pub(super) fn stream(&self, stream: Stream) -> sys::CUstream {
        self.streams[stream.index()]
    }

    /// The private stream of synchronous host operations.
    pub(super) fn host_stream(&self) -> sys::CUstream {
        self.host
    }

    /// Waits until the host stream has executed everything issued to it.
    pub(super) fn sync_host_stream(&self, what: &str) -> Result<(), OpsError> {
        // SAFETY: the host stream lives as long as the device.
        unsafe { cu::stream::synchronize(self.host) }.map_err(|e| backend(what, e))
    }

    /// The driver's version, as `major.minor`.
    pub(super) fn driver_version() -> String {
        let mut v = 0;
        // SAFETY: a plain out-parameter.
        let ok = unsafe { sys::cuDriverGetVersion(&mut v) }.result().is_ok();
        if ok {
            format!("{}.{}", v / 1000, (v % 1000) / 10)
        } else {
            "unknown".into()
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Nothing useful can be done with a failure while tearing down.
        if self.bind().is_err() {
            return;
        }
        // SAFETY: every handle below was created by `open` and is destroyed once; the
        // context is synchronised first so no stream is destroyed with work in flight.
        unsafe {
            let _ = cu::ctx::synchronize();
            for s in self.streams.into_iter().chain([self.host]) {
                if !s.is_null() {
                    let _ = cu::stream::destroy(s);
                }
            }
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}

/// A C string from a library, or a placeholder.
pub(super) fn c_str(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the libraries return NUL-terminated static or thread-local strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
