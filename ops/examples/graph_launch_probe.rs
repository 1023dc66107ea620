//! The host cost of launching a captured CUDA graph by its size and kind of nodes, on
//! this machine's GPU and driver: what `cuGraphLaunch` costs per node for a straight
//! line of kernels, and with a memset node among them.
//!
//! ```text
//! cargo build --release -p overlap-ops --features cuda --example graph_launch_probe
//! LD_LIBRARY_PATH=/usr/local/cuda/lib64 target/release/examples/graph_launch_probe
//! ```
//!
//! Prints, per graph, the median host time of one `cuGraphLaunch` over 400 launches
//! (the stream synchronised every 20, outside the timed calls).

use std::time::Instant;

use cudarc::driver::{sys, CudaContext, DriverError};

const SRC: &str = r#"
extern "C" __global__ void probe_nop(float* p) { if (p) p[threadIdx.x] += 1.0f; }
"#;

fn check(r: sys::CUresult, what: &str) -> Result<(), String> {
    r.result()
        .map_err(|e: DriverError| format!("{what}: {e:?}"))
}

/// How a probe graph is made: `kernels` launches of the no-op kernel on `grid` blocks,
/// a 4-byte memset before every `memset_every`-th (0: none), each launched with
/// `attr` (none, a cluster of two blocks, or programmatic stream serialisation).
struct Shape {
    kernels: usize,
    grid: u32,
    memset_every: usize,
    attr: Attr,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Attr {
    None,
    Cluster2,
    Programmatic,
}

impl Shape {
    fn memsets(&self) -> usize {
        if self.memset_every == 0 {
            0
        } else {
            self.kernels.div_ceil(self.memset_every)
        }
    }
}

fn main() -> Result<(), String> {
    let ctx = CudaContext::new(0).map_err(|e| format!("context: {e:?}"))?;
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some("sm_90"),
        ..Default::default()
    };
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(SRC, opts).map_err(|e| format!("nvrtc: {e:?}"))?;
    let module = ctx.load_module(ptx).map_err(|e| format!("module: {e:?}"))?;
    let f = module
        .load_function("probe_nop")
        .map_err(|e| format!("function: {e:?}"))?
        .cu_function();
    let stream = ctx.new_stream().map_err(|e| format!("stream: {e:?}"))?;
    let s = stream.cu_stream();
    let buf = stream
        .alloc_zeros::<f32>(1024)
        .map_err(|e| format!("alloc: {e:?}"))?;
    let ptr = {
        let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&buf, &stream);
        p
    };
    let mut version = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDriverGetVersion(&mut version) },
        "driver version",
    )?;
    println!("driver CUDA version {version}");
    let shape = |kernels, grid, memset_every, attr| Shape {
        kernels,
        grid,
        memset_every,
        attr,
    };
    let shapes = [
        shape(1, 1, 0, Attr::None),
        shape(8, 1, 0, Attr::None),
        shape(32, 1, 0, Attr::None),
        shape(89, 1, 0, Attr::None),
        shape(256, 1, 0, Attr::None),
        shape(89, 1024, 0, Attr::None),
        shape(89, 1, 89, Attr::None),
        shape(89, 1, 4, Attr::None),
        shape(89, 2, 0, Attr::Cluster2),
        shape(89, 1, 0, Attr::Programmatic),
    ];
    for shape in shapes {
        match time_graph(s, f, ptr, &shape) {
            Ok(us) => println!(
                "{:>4} kernels (grid {:>4}, {:?}) + {:>2} memsets: {:>7.2} us a launch, {:.3} us a node",
                shape.kernels,
                shape.grid,
                shape.attr,
                shape.memsets(),
                us,
                us / (shape.kernels + shape.memsets()) as f64
            ),
            Err(e) => println!("{:>4} kernels ({:?}): {e}", shape.kernels, shape.attr),
        }
    }
    Ok(())
}

fn time_graph(
    s: sys::CUstream,
    f: sys::CUfunction,
    ptr: sys::CUdeviceptr,
    shape: &Shape,
) -> Result<f64, String> {
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a live stream, nothing captured on it.
    check(
        unsafe { sys::cuStreamBeginCapture_v2(s, mode) },
        "begin capture",
    )?;
    let mut arg = ptr;
    for i in 0..shape.kernels {
        if shape.memset_every > 0 && i % shape.memset_every == 0 {
            // SAFETY: 4 bytes of the probe's own buffer.
            check(unsafe { sys::cuMemsetD32Async(ptr, 0, 1, s) }, "memset")?;
        }
        let mut params = [&mut arg as *mut sys::CUdeviceptr as *mut std::ffi::c_void];
        // SAFETY: a plain C union, the member set below.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        let id = match shape.attr {
            Attr::Cluster2 => {
                value.clusterDim =
                    sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: 2, y: 1, z: 1 };
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            }
            _ => {
                value.programmaticStreamSerializationAllowed = 1;
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            }
        };
        let mut attr = sys::CUlaunchAttribute {
            id,
            pad: [0; 4],
            value,
        };
        let config = sys::CUlaunchConfig {
            gridDimX: shape.grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: s,
            attrs: &mut attr,
            numAttrs: u32::from(shape.attr != Attr::None),
        };
        // SAFETY: the kernel takes one pointer; `params` and `attr` outlive the call.
        let launched =
            unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) };
        if let Err(e) = check(launched, "launch") {
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: ends the capture begun above; the graph is discarded.
            unsafe {
                sys::cuStreamEndCapture(s, &mut graph);
                if !graph.is_null() {
                    sys::cuGraphDestroy(graph);
                }
            }
            return Err(e);
        }
    }
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above.
    check(
        unsafe { sys::cuStreamEndCapture(s, &mut graph) },
        "end capture",
    )?;
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: a complete captured graph.
    check(
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
        "instantiate",
    )?;
    // SAFETY: the graph just instantiated, on its stream.
    check(unsafe { sys::cuGraphUpload(exec, s) }, "upload")?;
    let mut times = Vec::with_capacity(400);
    for round in 0..21 {
        for _ in 0..20 {
            let t = Instant::now();
            // SAFETY: as above.
            check(unsafe { sys::cuGraphLaunch(exec, s) }, "graph launch")?;
            if round > 0 {
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        // SAFETY: a live stream.
        check(unsafe { sys::cuStreamSynchronize(s) }, "synchronize")?;
    }
    // SAFETY: handles made above, nothing in flight.
    unsafe {
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
