//! Newton–Schulz of a Muon batch as one captured CUDA graph, replayed.
//!
//! A batch's Newton–Schulz (`muon::run_batch` between the momentum and the update: the
//! per-matrix norms, the working matrices and `ns_steps` iterations of three cuBLAS
//! GEMMs, a copy and a diagonal shift) touches only the stream's scratch, at offsets
//! that depend on the batch's shape, size and precision. Issued call by call that is
//! three launches and five calls per iteration, about 36 µs of host time per shape and
//! iteration on GPT-2 small (docs/performance.md, "Host time of the tail"); captured
//! once into a
//! graph (`cuStreamBeginCapture` in thread-local mode on the stream, the same calls,
//! `cuStreamEndCapture`, `cuGraphInstantiate`) it is one `cuGraphLaunch` after that.
//! The momentum and the update kernels, which read and write the parameters, are
//! launched directly around it, so the graph holds no pointer but the scratch's.
//!
//! A graph is keyed by everything its calls depend on ([`NsKey`]: the scratch's
//! address, the shape, the batch size, the precision and the iterations); a larger
//! scratch is a new address, so a new key. A capture that fails (or a driver without
//! graphs) is remembered, and that batch is issued call by call from then on; the
//! results are the same bits either way.
//!
//! Invariant: a graph is launched only on the stream whose scratch it was captured on,
//! and only while that scratch is at least as large as when it was captured (the key
//! holds its address, and the scratch never shrinks in place).

use std::collections::HashMap;

use cudarc::driver::sys;

use crate::{NsDtype, OpsError};

/// What a captured Newton–Schulz depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct NsKey {
    /// The scratch's base address.
    pub scratch: u64,
    /// The matrices' shape.
    pub shape: (usize, usize),
    /// Matrices in the batch.
    pub count: usize,
    /// The precision.
    pub dtype: NsDtype,
    /// Iterations.
    pub steps: u32,
}

/// An instantiated graph and the graph it came from.
struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

/// One stream's captured Newton–Schulz graphs; `None` marks a batch whose capture
/// failed (issued call by call).
#[derive(Default)]
pub(super) struct NsGraphs {
    graphs: HashMap<NsKey, Option<Graph>>,
    /// Whether to capture at all ([`super::CudaBackend::set_tail_graphs`]).
    pub off: bool,
}

impl std::fmt::Debug for NsGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NsGraphs({} keys, off: {})", self.graphs.len(), self.off)
    }
}

// SAFETY: graph handles are used only under the backend's issue lock, with the context
// bound; none is tied to the thread that created it.
unsafe impl Send for NsGraphs {}

impl NsGraphs {
    /// Runs `issue` (the batch's Newton–Schulz, call by call on `stream`) through the
    /// graph of `key`: replayed when captured before, captured and then launched the
    /// first time, or issued directly when capturing is off or failed for this key.
    pub(super) fn run(
        &mut self,
        stream: sys::CUstream,
        key: NsKey,
        mut issue: impl FnMut() -> Result<(), OpsError>,
    ) -> Result<(), OpsError> {
        if self.off {
            return issue();
        }
        let graph = self
            .graphs
            .entry(key)
            .or_insert_with(|| capture(stream, &mut issue));
        match graph {
            Some(g) => {
                // SAFETY: an instantiated graph of this stream's context; its nodes
                // touch the scratch the key names, which is still allocated.
                unsafe { sys::cuGraphLaunch(g.exec, stream) }
                    .result()
                    .map_err(|e| super::device::failed("muon", e))
            }
            None => issue(),
        }
    }

    /// Destroys every graph (the context bound, nothing in flight).
    pub(super) fn clear(&mut self) {
        for g in self.graphs.drain().filter_map(|(_, g)| g) {
            // SAFETY: handles created by `capture`, no longer launched.
            unsafe {
                let _ = sys::cuGraphExecDestroy(g.exec);
                let _ = sys::cuGraphDestroy(g.graph);
            }
        }
    }

    /// Forgets every graph without destroying it (a device that did not drain).
    pub(super) fn leak(&mut self) {
        self.graphs.clear();
    }
}

/// Captures `issue` on `stream` into an instantiated graph; `None` when any step fails
/// (the stream is left out of capture mode either way).
fn capture(
    stream: sys::CUstream,
    issue: &mut impl FnMut() -> Result<(), OpsError>,
) -> Option<Graph> {
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a live stream of the bound context with nothing captured on it.
    unsafe { sys::cuStreamBeginCapture_v2(stream, mode) }
        .result()
        .ok()?;
    let issued = issue();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; `graph` receives the captured graph.
    let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) }.result();
    if issued.is_err() || ended.is_err() || graph.is_null() {
        if !graph.is_null() {
            // SAFETY: a graph returned by the capture and not instantiated.
            unsafe {
                let _ = sys::cuGraphDestroy(graph);
            }
        }
        return None;
    }
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: a complete captured graph.
    match unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result() {
        Ok(()) => Some(Graph { graph, exec }),
        Err(_) => {
            // SAFETY: the graph above, not instantiated.
            unsafe {
                let _ = sys::cuGraphDestroy(graph);
            }
            None
        }
    }
}
