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
        (stream, fill): (sys::CUstream, sys::CUfunction),
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
            *known = match capture((stream, fill), &mut issue) {
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

/// Captures `issue` on `stream` into an instantiated graph, its memset nodes made
/// kernels of `fill` ([`memsets_as_kernels`]); `None` when any step fails (the stream
/// is left out of capture mode either way).
fn capture(
    (stream, fill): (sys::CUstream, sys::CUfunction),
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
    let keep = std::env::var("OVERLAP_MEMSET_NODES").as_deref() == Ok("1");
    let (replaced, stopped) = if keep || !edge_api() {
        (0, None)
    } else {
        memsets_as_kernels(graph, fill)
    };
    let nodes = graph_nodes(graph).len();
    if std::env::var("OVERLAP_FLUSH_CLOCK").as_deref() == Ok("1") {
        let stopped = stopped.map_or(String::new(), |e| format!(", stopped by {e}"));
        eprintln!(
            "flush graph captured: {nodes} nodes ({replaced} memsets made kernels{stopped}): {}",
            census(graph)
        );
    }
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

/// The nodes of `graph` counted by kind, kernels by name, in order of first appearance
/// (the flush clock's diagnostic, `OVERLAP_FLUSH_CLOCK=1`). Kernel names need a
/// driver of CUDA 12.3 or later ([`edge_api`]); older ones count kernels unnamed.
fn census(graph: sys::CUgraph) -> String {
    let named = edge_api();
    let mut tally: Vec<(String, usize)> = Vec::new();
    for node in graph_nodes(graph) {
        let name = node_name(node, named);
        match tally.iter_mut().find(|(n, _)| *n == name) {
            Some((_, c)) => *c += 1,
            None => tally.push((name, 1)),
        }
    }
    tally
        .iter()
        .map(|(n, c)| format!("{c} × {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A node's kind, and for a kernel its function's name (cut to 90 characters).
fn node_name(node: sys::CUgraphNode, named: bool) -> String {
    let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: a node of a live graph; writes one enum.
    if unsafe { sys::cuGraphNodeGetType(node, &mut kind) }
        .result()
        .is_err()
    {
        return "unknown".into();
    }
    if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL || !named {
        return format!("{kind:?}");
    }
    // SAFETY: a plain C struct, filled by the call.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a kernel node; `p` receives its parameters.
    if unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) }
        .result()
        .is_err()
    {
        return "kernel".into();
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the node's function or library kernel; the name is the driver's string.
    let got = unsafe {
        if !p.func.is_null() {
            sys::cuFuncGetName(&mut name, p.func)
        } else {
            sys::cuKernelGetName(&mut name, p.kern)
        }
    };
    if got.result().is_err() || name.is_null() {
        return "kernel".into();
    }
    // SAFETY: a NUL-terminated string owned by the driver.
    let s = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
    format!("kernel {}", s.chars().take(90).collect::<String>())
}

/// Whether the driver has the graph calls of CUDA 12.3 (edge data, kernel names) that
/// [`memsets_as_kernels`] and [`census`] use: calling one the driver lacks would abort.
fn edge_api() -> bool {
    let mut version = 0;
    // SAFETY: writes one int.
    let _ = unsafe { sys::cuDriverGetVersion(&mut version) };
    version >= 12030
}

/// The nodes of `graph` (none if they cannot be read).
fn graph_nodes(graph: sys::CUgraph) -> Vec<sys::CUgraphNode> {
    let mut count = 0;
    // SAFETY: a live graph; a null array asks for the count only.
    let _ = unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) };
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` holds `count` handles.
    match unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) }.result() {
        Ok(()) => {
            nodes.truncate(count);
            nodes
        }
        Err(_) => Vec::new(),
    }
}

/// Puts a kernel of `fill` (`ov_fill`) in the place of every memset node of `graph`,
/// with the same dependencies; returns how many it replaced, and the driver's refusal
/// that stopped it, if one did.
///
/// cuBLASLt zeroes a few words before some of its products, and a captured graph holds
/// each such memset as a node. The driver launches a straight line of kernel nodes in
/// constant host time (about 2 µs for 1 or 256 nodes on an H200 with driver 580), but
/// memset nodes among them cost about 1.5 µs each: with 20 of them, Muon's flush of 89
/// nodes launched in 39–58 µs (`ops/examples/graph_launch_probe.rs`,
/// docs/performance.md). A kernel that writes the same bytes does the same work.
///
/// Every step leaves the graph correct: the kernel is added behind the memset's
/// dependencies and ahead of its dependents before the memset is removed, so a refused
/// call stops the replacing with the rest of the memsets kept.
fn memsets_as_kernels(graph: sys::CUgraph, fill: sys::CUfunction) -> (usize, Option<String>) {
    let mut replaced = 0;
    for node in graph_nodes(graph) {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of a live graph; writes one enum.
        let known = unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result();
        if known.is_err() || kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET {
            continue;
        }
        if let Err(e) = replace_memset(graph, node, fill) {
            return (replaced, Some(e));
        }
        replaced += 1;
    }
    (replaced, None)
}

/// A refused driver call, named.
fn refused(call: &str) -> impl FnOnce(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{call}: {}", super::device::describe(e))
}

/// The nodes `node` depends on (`before`) or that depend on it.
fn neighbours(node: sys::CUgraphNode, before: bool) -> Result<Vec<sys::CUgraphNode>, String> {
    let get = |nodes: *mut sys::CUgraphNode, edges: *mut sys::CUgraphEdgeData, n: &mut usize| {
        // SAFETY: a node of a live graph; the arrays hold `*n` entries (or are null to
        // ask for the count).
        unsafe {
            if before {
                sys::cuGraphNodeGetDependencies_v2(node, nodes, edges, n)
            } else {
                sys::cuGraphNodeGetDependentNodes_v2(node, nodes, edges, n)
            }
        }
        .result()
        .map_err(refused(if before {
            "cuGraphNodeGetDependencies"
        } else {
            "cuGraphNodeGetDependentNodes"
        }))
    };
    let mut n = 0;
    get(std::ptr::null_mut(), std::ptr::null_mut(), &mut n)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: a plain C struct of bytes.
    let mut edges = vec![unsafe { std::mem::zeroed::<sys::CUgraphEdgeData>() }; n];
    get(nodes.as_mut_ptr(), edges.as_mut_ptr(), &mut n)?;
    nodes.truncate(n);
    Ok(nodes)
}

/// `nodes` as the driver takes an array: null when empty.
fn array(nodes: &[sys::CUgraphNode]) -> *const sys::CUgraphNode {
    if nodes.is_empty() {
        std::ptr::null()
    } else {
        nodes.as_ptr()
    }
}

/// Replaces the memset node `node` of `graph` by a kernel of `fill` writing the same
/// bytes, behind the same nodes and ahead of the same nodes (plain edges: a full
/// dependency, as a memset's).
fn replace_memset(
    graph: sys::CUgraph,
    node: sys::CUgraphNode,
    fill: sys::CUfunction,
) -> Result<(), String> {
    // SAFETY: a plain C struct, filled by the call.
    let mut p: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a memset node of a live graph.
    unsafe { sys::cuGraphMemsetNodeGetParams(node, &mut p) }
        .result()
        .map_err(refused("cuGraphMemsetNodeGetParams"))?;
    let (before, after) = (neighbours(node, true)?, neighbours(node, false)?);
    let (dst, pitch, value, esize) = (p.dst, p.pitch as u64, p.value, p.elementSize);
    let (width, height) = (p.width as u64, p.height.max(1) as u64);
    let mut args: [*mut std::ffi::c_void; 6] = [
        &dst as *const u64 as *mut _,
        &pitch as *const u64 as *mut _,
        &value as *const u32 as *mut _,
        &esize as *const u32 as *mut _,
        &width as *const u64 as *mut _,
        &height as *const u64 as *mut _,
    ];
    let grid = width.saturating_mul(height).div_ceil(256).clamp(1, 4096) as u32;
    // SAFETY: a plain C struct; the fields the call reads are set below.
    let mut k: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    k.func = fill;
    (k.gridDimX, k.gridDimY, k.gridDimZ) = (grid, 1, 1);
    (k.blockDimX, k.blockDimY, k.blockDimZ) = (256, 1, 1);
    k.kernelParams = args.as_mut_ptr();
    let mut added: sys::CUgraphNode = std::ptr::null_mut();
    // SAFETY: `fill` takes (u64, u64, u32, u32, u64, u64), the types `args` points at,
    // alive until the call returns (the driver copies them); `before` are nodes of
    // `graph`.
    unsafe { sys::cuGraphAddKernelNode_v2(&mut added, graph, array(&before), before.len(), &k) }
        .result()
        .map_err(refused("cuGraphAddKernelNode"))?;
    // The driver refuses a call of no edges (a last node has no dependents).
    if !after.is_empty() {
        let from = vec![added; after.len()];
        // SAFETY: nodes of `graph`, `after.len()` of each; null edge data: plain edges.
        unsafe {
            sys::cuGraphAddDependencies_v2(
                graph,
                from.as_ptr(),
                after.as_ptr(),
                std::ptr::null(),
                after.len(),
            )
        }
        .result()
        .map_err(refused("cuGraphAddDependencies"))?;
    }
    // SAFETY: a node of `graph`, no longer needed: the kernel above takes its place.
    unsafe { sys::cuGraphDestroyNode(node) }
        .result()
        .map_err(refused("cuGraphDestroyNode"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::device::Device;
    use crate::cuda::kernels::Kernels;

    /// Elements a row, rows, and bytes from one row to the next.
    type Dims = (usize, usize, usize);

    /// A memset node of `graph` behind `dep` (if any).
    fn memset(
        graph: sys::CUgraph,
        dep: Option<sys::CUgraphNode>,
        ctx: sys::CUcontext,
        (dst, value, esize): (u64, u32, u32),
        (width, height, pitch): Dims,
    ) -> sys::CUgraphNode {
        let p = sys::CUDA_MEMSET_NODE_PARAMS {
            dst,
            pitch,
            value,
            elementSize: esize,
            width,
            height,
        };
        let deps: Vec<_> = dep.into_iter().collect();
        let mut node = std::ptr::null_mut();
        // SAFETY: a live graph and context; `deps` are its nodes.
        unsafe { sys::cuGraphAddMemsetNode(&mut node, graph, deps.as_ptr(), deps.len(), &p, ctx) }
            .result()
            .unwrap();
        node
    }

    /// Writes `value`'s low `esize` bytes (little-endian) to `width` elements of each
    /// of `height` rows of `buf`, `pitch` bytes apart from `at`.
    fn expect(
        buf: &mut [u8],
        at: usize,
        (value, esize): (u32, usize),
        (width, height, pitch): (usize, usize, usize),
    ) {
        for r in 0..height {
            for c in 0..width {
                let o = at + r * pitch + c * esize;
                buf[o..o + esize].copy_from_slice(&value.to_le_bytes()[..esize]);
            }
        }
    }

    #[test]
    fn memset_nodes_made_kernels_write_the_same_bytes_in_the_same_order() {
        let gpu = std::env::var("OVERLAP_GPU_TESTS").as_deref() == Ok("1");
        let opened = crate::cuda::loader::check().and_then(|_| Device::open(0, false));
        let device = match opened {
            Ok(d) => d,
            Err(e) if gpu => panic!("OVERLAP_GPU_TESTS=1 but the GPU does not open: {e}"),
            Err(e) => {
                eprintln!("skipped: no GPU ({e})");
                return;
            }
        };
        device.bind().unwrap();
        let kernels = Kernels::compile(&device).unwrap();
        const BYTES: usize = 4096;
        let mut ctx = std::ptr::null_mut();
        let mut buf = 0u64;
        let mut graph = std::ptr::null_mut();
        // SAFETY: the context is bound; plain allocations and a new graph.
        unsafe {
            sys::cuCtxGetCurrent(&mut ctx).result().unwrap();
            sys::cuMemAlloc_v2(&mut buf, BYTES).result().unwrap();
            sys::cuMemsetD8_v2(buf, 0xab, BYTES).result().unwrap();
            sys::cuGraphCreate(&mut graph, 0).result().unwrap();
        }
        // Bytes, halves, words, a 2-D block, and a second write over the first: the
        // order must hold.
        let sets: [(usize, u32, u32, Dims); 5] = [
            (0, 0x11, 1, (100, 1, 100)),
            (256, 0x2233, 2, (50, 1, 100)),
            (512, 0x4455_6677, 4, (30, 1, 120)),
            (1024, 7, 4, (3, 4, 64)),
            (5, 0x99, 1, (10, 1, 10)),
        ];
        let mut want = vec![0xabu8; BYTES];
        let mut last = None;
        for &(at, value, esize, dims) in &sets {
            let node = memset(graph, last, ctx, (buf + at as u64, value, esize), dims);
            last = Some(node);
            expect(&mut want, at, (value, esize as usize), dims);
        }
        assert_eq!(memsets_as_kernels(graph, kernels.fill), (sets.len(), None));
        let census = census(graph);
        assert!(!census.contains("MEMSET"), "{census}");
        assert!(census.starts_with("5 × kernel ov_fill"), "{census}");
        let stream = device.stream(overlap_graph::Stream::Compute);
        let mut exec = std::ptr::null_mut();
        let mut got = vec![0u8; BYTES];
        // SAFETY: the graph above, its nodes writing inside `buf`; `got` holds BYTES.
        unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
                .result()
                .unwrap();
            sys::cuGraphLaunch(exec, stream).result().unwrap();
            sys::cuStreamSynchronize(stream).result().unwrap();
            sys::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), buf, BYTES)
                .result()
                .unwrap();
            sys::cuGraphExecDestroy(exec);
            sys::cuGraphDestroy(graph);
            sys::cuMemFree_v2(buf);
        }
        kernels.unload();
        assert_eq!(got, want);
    }
}
