//! A stream's optimizer flush as one captured CUDA graph, replayed.
//!
//! A flush (`flush.rs`: the global norm, the clip of the gradients no optimizer reads,
//! the multi-tensor AdamW launches, and per Muon class the momentum, the norms, the
//! Newton–Schulz products and the updates) is the same work from step to step: the
//! same shapes in the same scratch. What changes (AdamW's bias corrections with the
//! step, the learning rate with its schedule, and the addresses of the step's
//! gradients, guards and norm) is read from device memory that the flush uploads
//! first. Issued call by call, GPT-2 small's
//! Muon tail is 22 launches and 41 cuBLASLt calls (counted from `flush.rs` and
//! `muon.rs`); replayed, it is one `cuGraphLaunch` (docs/performance.md, "Host time of
//! the tail").
//!
//! A flush is keyed by every address and size its launches take ([`TailKey`]): the
//! scratch and the sizes, never a buffer's address. A key
//! seen a second time is captured (`cuStreamBeginCapture` in thread-local mode on the
//! stream, the same calls, `cuStreamEndCapture`, `cuGraphInstantiate`) and launched;
//! replayed from then on. A key seen once is issued directly, so a flush that never
//! repeats costs no capture; at most [`MAX_KEYS`] keys are remembered, later ones are
//! issued directly. A capture that fails (or a driver without graphs) is remembered,
//! and that flush is issued call by call from then on; the results are the same bits
//! either way.
//!
//! Invariant: a graph is launched only on the stream it was captured on, with the
//! same scratch (the key holds the scratch's address, and the scratch is at least as
//! large as when it was captured: the same key asks for the same bytes), right after
//! the upload of this flush's words into it, which name the buffers its nodes touch.

use std::collections::HashMap;

use super::fast_hash::WordHash;

use cudarc::driver::sys;

use crate::OpsError;

/// Everything a flush's launches depend on but its uploaded words: the scratch's
/// address, every size, grid, precision, count and place of a table, in issue order
/// (`flush.rs` builds it).
pub(super) type TailKey = Vec<u64>;

/// Most flushes remembered per stream.
pub(super) const MAX_KEYS: usize = 64;

/// An instantiated graph and the graph it came from.
struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    /// Its nodes (for the flush clock's report, `defer.rs`).
    nodes: usize,
}

/// What is known of a flush's key.
enum Known {
    /// Issued once, directly.
    Seen,
    /// Captured and instantiated.
    Captured(Graph),
    /// Its capture failed: issued call by call.
    Failed,
}

/// One stream's flushes and their graphs.
#[derive(Default)]
pub(super) struct TailGraphs {
    graphs: HashMap<TailKey, Known, WordHash>,
    /// Whether to capture at all ([`super::CudaBackend::set_tail_graphs`]).
    pub(super) off: bool,
    /// Flushes issued as one graph launch ([`super::CudaBackend::tail_replays`]).
    pub(super) replays: u64,
    /// The nodes of the graph launched last (0: the last flush was issued call by
    /// call).
    pub(super) last_nodes: usize,
}

impl std::fmt::Debug for TailGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TailGraphs({} keys, off: {})",
            self.graphs.len(),
            self.off
        )
    }
}

// SAFETY: graph handles are used only under the backend's issue lock, with the context
// bound; none is tied to the thread that created it.
unsafe impl Send for TailGraphs {}

impl TailGraphs {
    /// Runs `issue` (the flush, call by call on `stream`) through the graph of `key`
    /// (made only when capturing is on):
    /// replayed when captured before, captured and launched the second time the key is
    /// seen, or issued directly (the first time, when capturing is off or failed for
    /// this key, or when [`MAX_KEYS`] others are remembered).
    pub(super) fn run(
        &mut self,
        stream: sys::CUstream,
        key: impl FnOnce() -> TailKey,
        mut issue: impl FnMut() -> Result<(), OpsError>,
    ) -> Result<(), OpsError> {
        self.last_nodes = 0;
        if self.off {
            return issue();
        }
        let key = key();
        let full = self.graphs.len() >= MAX_KEYS;
        let known = match self.graphs.get_mut(&key) {
            Some(known) => known,
            None => {
                if !full {
                    self.graphs.insert(key, Known::Seen);
                }
                return issue();
            }
        };
        if let Known::Seen = known {
            *known = match capture(stream, &mut issue) {
                Some(g) => Known::Captured(g),
                None => Known::Failed,
            };
        }
        match known {
            Known::Captured(g) => {
                self.replays += 1;
                self.last_nodes = g.nodes;
                // SAFETY: an instantiated graph of this stream's context; its nodes
                // touch the buffers and scratch the key names, which are still
                // allocated (the caller keeps them alive until the stream passes).
                unsafe { sys::cuGraphLaunch(g.exec, stream) }
                    .result()
                    .map_err(|e| super::device::failed("optimizer", e))
            }
            _ => issue(),
        }
    }

    /// Destroys every graph (the context bound, nothing in flight).
    pub(super) fn clear(&mut self) {
        let graphs = self.graphs.drain().filter_map(|(_, k)| match k {
            Known::Captured(g) => Some(g),
            _ => None,
        });
        for g in graphs {
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
    let mut nodes = 0;
    // SAFETY: a complete captured graph; a null array asks for the count only.
    let _ = unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut nodes) };
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: a complete captured graph.
    match unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result() {
        Ok(()) => Some(Graph { graph, exec, nodes }),
        Err(_) => {
            // SAFETY: the graph above, not instantiated.
            unsafe {
                let _ = sys::cuGraphDestroy(graph);
            }
            None
        }
    }
}
