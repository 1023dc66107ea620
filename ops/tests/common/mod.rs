//! What the GPU test binaries share: the device, buffers and a wait for a stream.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use overlap_ops::cuda::{CudaBackend, CudaBuffer, CudaOptions};
use overlap_ops::graph::{Mesh, Stream};
use overlap_ops::{Backend, EventStatus, Tag};

/// The GPU, or `None` (and a note) when there is none and `OVERLAP_GPU_TESTS` is unset.
pub fn gpu() -> Option<CudaBackend> {
    let opened = CudaBackend::new(CudaOptions::new(Mesh::new(1, 1).unwrap(), 0, 0));
    match opened {
        Ok(b) => Some(b),
        Err(e) if std::env::var("OVERLAP_GPU_TESTS").as_deref() == Ok("1") => {
            panic!("OVERLAP_GPU_TESTS=1 but the GPU does not open: {e}")
        }
        Err(e) => {
            eprintln!("no GPU ({e}): skipped");
            None
        }
    }
}

/// The tag of every test kernel.
pub const TAG: Tag = Tag {
    node: 0,
    op: "test",
    micro_batch: 0,
};

/// A device buffer holding `data`.
pub fn buffer(b: &CudaBackend, data: &[f32]) -> CudaBuffer {
    let buf = b.alloc(0, data.len()).unwrap();
    b.upload(&buf, data).unwrap();
    buf
}

/// Waits (at most 60 s) until everything issued on `stream` has run, and requires that
/// nothing failed.
pub fn sync(b: &CudaBackend, stream: Stream) {
    let ev = b.event(0);
    b.record(0, stream, &ev);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match b.status(&ev) {
            EventStatus::Complete => break,
            EventStatus::Pending if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_micros(100))
            }
            EventStatus::Pending => panic!("the GPU did not finish in 60 s"),
            EventStatus::Failed(e) => panic!("a kernel failed: {e}"),
        }
    }
    let errors = b.errors();
    assert!(errors.is_empty(), "{errors:?}");
}
