//! `overlap cuda-smoke`: a quick check of a GPU job before real runs.
//!
//! Under `overlap launch`, every rank reports the libraries it loaded and its device,
//! then checks every collective kind in f32 and bf16 with `sum` and `avg` on the
//! replicate group of a `1 × world` mesh against values computed on the host, checks
//! the rank-local kernels (add, pack, unpack, AdamW, Muon, spin) against the reference
//! math of [`overlap_ops::math`], measures the all-reduce bandwidth with timing
//! events, and what each driver call the backend issues costs the host.
//!
//! Invariant: every check compares with values computed on the host from the same
//! inputs; nothing here trusts the device to check itself.

use std::sync::Arc;
use std::time::Instant;

use overlap_graph::{Collective, CollectiveKind, CopySeg, DType, Group, ReduceOp, Stream};
use overlap_ops::cuda::CudaBackend;
use overlap_ops::math::pseudo_random as random;
use overlap_ops::{math, AdamwParams, Backend, CommId, Kernel, Tag};
use serde::Serialize;

use overlap::Error;
use overlap_dist::cuda::CudaWorld;

/// What one rank found.
#[derive(Debug, Clone, Serialize)]
pub struct SmokeReport {
    /// The rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world: u32,
    /// The GPU.
    pub device: String,
    /// Driver and NCCL versions.
    pub driver: String,
    /// NCCL version.
    pub nccl: String,
    /// Library files opened (driver, NVRTC, cuBLAS, NCCL).
    pub libraries: Vec<String>,
    /// Every check, in order.
    pub checks: Vec<Check>,
    /// All-reduce bandwidth per size.
    pub bandwidth: Vec<Bandwidth>,
    /// What each driver call the backend issues costs the host
    /// (`CudaBackend::host_costs`, 500 calls each).
    pub host_costs: Vec<HostCost>,
    /// Every check passed.
    pub ok: bool,
}

/// One check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// Whether it passed.
    pub ok: bool,
    /// The figure behind the verdict.
    pub detail: String,
}

/// The host cost of one kind of call.
#[derive(Debug, Clone, Serialize)]
pub struct HostCost {
    /// The call.
    pub call: String,
    /// Microseconds per call, issued back to back.
    pub us: f64,
}

/// One bandwidth measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Bandwidth {
    /// The collective.
    pub op: String,
    /// Bytes per rank.
    pub bytes: u64,
    /// Mean duration of one call (timing events), seconds.
    pub seconds: f64,
    /// Algorithm bandwidth, GB/s (bytes / time).
    pub algbw_gbs: f64,
    /// Bus bandwidth, GB/s (`algbw · 2(n-1)/n` for all-reduce, as nccl-tests).
    pub busbw_gbs: f64,
}

pub(crate) fn tag(node: u32, op: &'static str) -> Tag {
    Tag {
        node,
        op,
        micro_batch: 0,
    }
}

/// Launches `kernel` on `stream`, waits for it, and returns the backend's errors.
pub(crate) async fn run(
    b: &CudaBackend,
    stream: Stream,
    kernel: Kernel<<CudaBackend as Backend>::Buffer>,
) -> Result<(), String> {
    let rank = b.rank();
    b.launch(rank, stream, tag(0, "smoke"), kernel);
    let ev = b.event(rank);
    b.record(rank, stream, &ev);
    let waited = b.host_wait(&ev).await;
    let errors = b.errors();
    if !errors.is_empty() {
        b.reset();
        return Err(errors
            .iter()
            .map(|(_, _, _, e)| e.to_string())
            .collect::<Vec<_>>()
            .join("; "));
    }
    waited.map_err(|e| e.to_string())
}

pub(crate) fn ops(e: overlap_ops::OpsError) -> Error {
    Error::Backend(e.to_string())
}

pub(crate) fn alloc(
    b: &CudaBackend,
    len: usize,
) -> Result<<CudaBackend as Backend>::Buffer, Error> {
    b.alloc(b.rank(), len).map_err(ops)
}

pub(crate) fn download(
    b: &CudaBackend,
    buf: &<CudaBackend as Backend>::Buffer,
) -> Result<Vec<f32>, Error> {
    b.download(buf).map_err(ops)
}

pub(crate) fn buffer(
    b: &CudaBackend,
    data: &[f32],
) -> Result<<CudaBackend as Backend>::Buffer, Error> {
    let buf = alloc(b, data.len())?;
    b.upload(&buf, data).map_err(ops)?;
    Ok(buf)
}

/// `max |a - b| / max |b|`.
pub(crate) fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max);
    let den = b.iter().map(|y| f64::from(y.abs())).fold(0.0, f64::max);
    if num == 0.0 {
        0.0
    } else {
        num / den.max(f64::MIN_POSITIVE)
    }
}

/// Runs the checks and measurements on this rank. `sizes` are all-reduce sizes in
/// bytes per rank, each timed over `iters` calls.
pub async fn smoke(world: &mut CudaWorld, sizes: &[u64], iters: u32) -> Result<SmokeReport, Error> {
    let b = Arc::clone(&world.backend);
    let info = b.info().clone();
    let mut checks = Vec::new();
    collectives(&b, world.env.world_size, &mut checks).await?;
    kernels(&b, &mut checks).await?;
    super::smoke_optim::optimizer_batches(&b, &mut checks).await?;
    let bandwidth = bandwidth(&b, world.env.world_size, sizes, iters).await?;
    let host_costs = b
        .host_costs(500)
        .map_err(ops)?
        .into_iter()
        .map(|(call, us)| HostCost {
            call: call.to_string(),
            us,
        })
        .collect();
    let ok = checks.iter().all(|c| c.ok);
    Ok(SmokeReport {
        rank: world.env.rank,
        world: world.env.world_size,
        device: format!(
            "{} (GPU {}, compute capability {}.{})",
            info.name, info.ordinal, info.capability.0, info.capability.1
        ),
        driver: info.driver,
        nccl: info.nccl,
        libraries: info.libraries,
        checks,
        bandwidth,
        host_costs,
        ok,
    })
}

/// Every collective kind, dtype and op on the `1 × world` mesh's replicate group.
async fn collectives(b: &CudaBackend, world: u32, checks: &mut Vec<Check>) -> Result<(), Error> {
    let kinds = [
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllReduce,
        CollectiveKind::Reduce,
        CollectiveKind::Broadcast,
        CollectiveKind::AllGather,
    ];
    for kind in kinds {
        for dtype in [DType::F32, DType::Bf16] {
            let ops: &[ReduceOp] =
                if matches!(kind, CollectiveKind::Broadcast | CollectiveKind::AllGather) {
                    &[ReduceOp::Sum]
                } else {
                    &[ReduceOp::Sum, ReduceOp::Avg]
                };
            for &op in ops {
                let desc = Collective {
                    kind,
                    group: Group::Replicate { shard: 0 },
                    count: COLLECTIVE_COUNT as u64,
                    dtype,
                    op,
                    root: kind.rooted().then_some(world - 1),
                };
                checks.push(collective_check(b, world, desc).await?);
            }
        }
    }
    Ok(())
}

/// Elements per member in [`collectives`]' checks.
const COLLECTIVE_COUNT: usize = 1003;

/// Element `i` of what member `r` sends in [`collectives`]: small integers, exact in
/// bf16 and in every sum of a few of them.
fn member_value(r: usize, i: usize) -> f32 {
    ((r + 1) * (i % 5 + 1)) as f32
}

/// The length of what member `me` of `world` sends for `desc` (`None`: nothing), and
/// what it receives, computed on the host (`None`: nothing).
fn member_roles(desc: &Collective, world: u32, me: usize) -> (Option<usize>, Option<Vec<f32>>) {
    let (n, c, x) = (world as usize, COLLECTIVE_COUNT, member_value);
    let root = desc.root.unwrap_or(0) as usize;
    let scale = |v: f32| {
        if desc.op == ReduceOp::Avg {
            v / world as f32
        } else {
            v
        }
    };
    let sum = |i: usize| scale((0..n).map(|r| x(r, i)).sum());
    match desc.kind {
        CollectiveKind::ReduceScatter => {
            (Some(n * c), Some((0..c).map(|i| sum(me * c + i)).collect()))
        }
        CollectiveKind::AllReduce => (Some(c), Some((0..c).map(sum).collect())),
        CollectiveKind::Reduce => (Some(c), (me == root).then(|| (0..c).map(sum).collect())),
        CollectiveKind::Broadcast if me == root => (Some(c), None),
        CollectiveKind::Broadcast => (None, Some((0..c).map(|i| x(root, i)).collect())),
        CollectiveKind::AllGather => (Some(c), Some((0..n * c).map(|k| x(k / c, k % c)).collect())),
    }
}

/// Runs `desc` on the replicate stream and compares what this rank receives with
/// [`member_roles`]' values.
async fn collective_check(b: &CudaBackend, world: u32, desc: Collective) -> Result<Check, Error> {
    let me = b.rank() as usize;
    let comm = CommId {
        group: desc.group,
        stream: Stream::Replicate,
    };
    let (send_len, want) = member_roles(&desc, world, me);
    let send = match send_len {
        Some(len) => Some(buffer(
            b,
            &(0..len).map(|i| member_value(me, i)).collect::<Vec<_>>(),
        )?),
        None => None,
    };
    let recv = match &want {
        Some(w) => Some(alloc(b, w.len())?),
        None => None,
    };
    let (op, dtype) = (desc.op, desc.dtype);
    let name = format!(
        "{} {} {}",
        desc.kind.name(),
        if dtype == DType::F32 { "f32" } else { "bf16" },
        if op == ReduceOp::Avg { "avg" } else { "sum" }
    );
    let ran = run(
        b,
        Stream::Replicate,
        Kernel::Collective {
            desc,
            comm,
            send,
            recv: recv.clone(),
        },
    )
    .await;
    Ok(match (ran, recv, want) {
        (Err(e), _, _) => Check {
            name,
            ok: false,
            detail: e,
        },
        (Ok(()), Some(buf), Some(want)) => {
            let got = download(b, &buf)?;
            // Exact for the sums; the avg's division rounds once (once more in bf16).
            let tol = match (op, dtype) {
                (ReduceOp::Sum, _) => 0.0,
                (ReduceOp::Avg, DType::F32) => 1e-6,
                (ReduceOp::Avg, DType::Bf16) => 8e-3,
            };
            let e = rel(&got, &want);
            Check {
                name,
                ok: e <= tol,
                detail: format!(
                    "relative error {e:.2e} (tolerance {tol:.0e}) over {} elements",
                    want.len()
                ),
            }
        }
        (Ok(()), _, _) => Check {
            name,
            ok: true,
            detail: "this rank sends only".into(),
        },
    })
}

/// The rank-local kernels against the reference math.
async fn kernels(b: &CudaBackend, checks: &mut Vec<Check>) -> Result<(), Error> {
    checks.push(add_check(b).await?);
    let (g1, g3) = (random(40, 2), random(30, 4));
    let (pack, packed, want) = pack_check(b, &g1, &g3).await?;
    checks.push(pack);
    checks.push(unpack_check(b, &packed, &want, &g1, &g3).await?);
    checks.push(adamw_check(b).await?);
    combine_checks(b, checks).await?;
    checks.push(combine_chunk_check(b).await?);
    checks.push(spin_check(b).await);
    Ok(())
}

/// add: copy, then accumulate onto itself.
async fn add_check(b: &CudaBackend) -> Result<Check, Error> {
    let a = random(5000, 1);
    let src = buffer(b, &a)?;
    let dst = alloc(b, a.len())?;
    let mut r = run(
        b,
        Stream::Compute,
        Kernel::Add {
            dst: dst.clone(),
            src: src.clone(),
            accumulate: false,
        },
    )
    .await;
    if r.is_ok() {
        r = run(
            b,
            Stream::Compute,
            Kernel::Add {
                dst: dst.clone(),
                src: dst.clone(),
                accumulate: true,
            },
        )
        .await;
    }
    let want: Vec<f32> = a.iter().map(|v| v + v).collect();
    let got = download(b, &dst)?;
    Ok(Check {
        name: "add (copy, then in place)".into(),
        ok: r.is_ok() && got == want,
        detail: format!("{r:?}, exact: {}", got == want),
    })
}

/// A copy segment of parameter `param`: `len` elements from `src` to `dst`.
fn seg(param: u32, src: u64, dst: u64, len: u64) -> CopySeg {
    CopySeg {
        param,
        src,
        dst,
        len,
    }
}

/// pack: two sources summed into one segment (`g1` and a third input), `g3` into
/// another, zero between; returns the check, the packed buffer and its expected values.
async fn pack_check(
    b: &CudaBackend,
    g1: &[f32],
    g3: &[f32],
) -> Result<(Check, <CudaBackend as Backend>::Buffer, Vec<f32>), Error> {
    let g2 = random(40, 3);
    let (b1, b2, b3) = (buffer(b, g1)?, buffer(b, &g2)?, buffer(b, g3)?);
    let packed = buffer(b, &vec![9.0; 100])?;
    let segs = vec![
        (seg(0, 3, 0, 20), vec![b1.clone(), b2.clone()]),
        (seg(1, 0, 50, 30), vec![b3.clone()]),
    ];
    let r = run(
        b,
        Stream::Reduce,
        Kernel::Pack {
            dst: packed.clone(),
            segs: segs.into(),
        },
    )
    .await;
    let mut want = vec![0.0f32; 100];
    for i in 0..20 {
        want[i] = (0.0 + g1[3 + i]) + g2[3 + i];
    }
    want[50..80].copy_from_slice(&g3.iter().map(|v| 0.0 + v).collect::<Vec<_>>());
    let got = download(b, &packed)?;
    let check = Check {
        name: "pack (zero, sum of sources)".into(),
        ok: r.is_ok() && got == want,
        detail: format!("{r:?}, exact: {}", got == want),
    };
    Ok((check, packed, want))
}

/// unpack with accumulate into two destinations (holding `g1` and `g3`) from the
/// packed buffer, whose values are `packed_v`.
async fn unpack_check(
    b: &CudaBackend,
    packed: &<CudaBackend as Backend>::Buffer,
    packed_v: &[f32],
    g1: &[f32],
    g3: &[f32],
) -> Result<Check, Error> {
    let (d1, d2) = (buffer(b, g1)?, buffer(b, g3)?);
    let segs = vec![
        (seg(0, 0, 5, 20), d1.clone()),
        (seg(1, 50, 0, 30), d2.clone()),
    ];
    let r = run(
        b,
        Stream::Replicate,
        Kernel::Unpack {
            src: packed.clone(),
            segs: segs.into(),
            accumulate: true,
        },
    )
    .await;
    let mut w1 = g1.to_vec();
    for i in 0..20 {
        w1[5 + i] += packed_v[i];
    }
    let w2: Vec<f32> = g3
        .iter()
        .zip(&packed_v[50..80])
        .map(|(a, b)| a + b)
        .collect();
    let ok = download(b, &d1)? == w1 && download(b, &d2)? == w2;
    Ok(Check {
        name: "unpack (accumulate)".into(),
        ok: r.is_ok() && ok,
        detail: format!("{r:?}, exact: {ok}"),
    })
}

/// AdamW, step 3: the reference's bits.
async fn adamw_check(b: &CudaBackend) -> Result<Check, Error> {
    let n = 10_007;
    let (p0, g) = (random(n, 5), random(n, 6));
    let m0: Vec<f32> = random(n, 7).iter().map(|v| v * 0.1).collect();
    let v0: Vec<f32> = random(n, 8).iter().map(|v| v * v * 0.01).collect();
    let hp = AdamwParams::default();
    let state: Vec<f32> = m0.iter().chain(&v0).copied().collect();
    let (pb, gb, sb) = (buffer(b, &p0)?, buffer(b, &g)?, buffer(b, &state)?);
    let r = run(
        b,
        Stream::Compute,
        Kernel::Adamw {
            param: pb.clone(),
            grad: gb,
            state: sb.clone(),
            hp,
            step: 3,
        },
    )
    .await;
    let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
    math::adamw(&mut p, &g, &mut m, &mut v, &hp, 3);
    let got_p = download(b, &pb)?;
    let got_s = download(b, &sb)?;
    let exact = got_p == p && got_s[..n] == m[..] && got_s[n..] == v[..];
    Ok(Check {
        name: "adamw (step 3) vs ops::math::adamw".into(),
        ok: r.is_ok() && exact,
        detail: format!(
            "{r:?}, bit-exact: {exact}, param rel err {:.2e}",
            rel(&got_p, &p)
        ),
    })
}

/// combine (copy transport): members of groups of 3 and 2, vector (n % 4 == 0) and
/// scalar paths, full grid with and without cache-streaming hints (the streaming
/// kernel's group-of-two path loads both operands first), and capped at 3 CTAs
/// (`combine_ctas`: the wide, unrolled kernel, which loops over 70,000 elements
/// several times), against the order of operations of the CPU backend, bit for bit.
async fn combine_checks(b: &CudaBackend, checks: &mut Vec<Check>) -> Result<(), Error> {
    for (n, ctas, streaming, size, index) in [
        (1000usize, None, true, 3u32, 1u32),
        (1003, None, true, 3, 1),
        (1000, None, false, 3, 1),
        (1000, None, true, 2, 0),
        (1000, None, true, 2, 1),
        (1000, None, false, 2, 1),
        (1003, None, true, 2, 1),
        (1000, Some(3), true, 3, 1),
        (1003, Some(3), true, 3, 1),
        (70_000, Some(3), true, 3, 1),
    ] {
        b.set_combine_ctas(ctas);
        b.set_combine_streaming(streaming);
        for (dtype, op) in [
            (DType::F32, ReduceOp::Avg),
            (DType::F32, ReduceOp::Sum),
            (DType::Bf16, ReduceOp::Avg),
        ] {
            let (r, exact) = combine_member(b, n, size, index, dtype, op).await?;
            checks.push(Check {
                name: format!(
                    "combine {n} {dtype:?} {op:?} (member {index} of {size}, {})",
                    combine_kernel(ctas, n, streaming)
                ),
                ok: r.is_ok() && exact,
                detail: format!("{r:?}, bit-exact: {exact}"),
            });
        }
    }
    b.set_combine_ctas(None);
    b.set_combine_streaming(true);
    Ok(())
}

/// One combine of `n` elements as member `index` of `size`: the launch's result and
/// whether its output equals the CPU backend's bit for bit.
async fn combine_member(
    b: &CudaBackend,
    n: usize,
    size: u32,
    index: u32,
    dtype: DType,
    op: ReduceOp,
) -> Result<(Result<(), String>, bool), Error> {
    let others = size as usize - 1;
    let own_v = random(n, 40 + n as u64);
    let recv_v = random(others * n, 41 + n as u64);
    let (own, recv, dst) = (buffer(b, &own_v)?, buffer(b, &recv_v)?, alloc(b, n)?);
    // A reduce to member `index`, which combines the whole count (an
    // all-reduce's member combines only its chunk: checked below, and by
    // `verify --transport copy`).
    let desc = Collective {
        kind: CollectiveKind::Reduce,
        group: Group::Shard { replicate: 0 },
        count: n as u64,
        dtype,
        op,
        root: Some(index),
    };
    let r = run(
        b,
        Stream::Compute,
        Kernel::Combine {
            desc,
            size,
            index,
            own,
            own_offset: 0,
            recv,
            dst: dst.clone(),
        },
    )
    .await;
    let want = combine_reference(&own_v, &recv_v, size, index, dtype, op);
    let got = download(b, &dst)?;
    let exact = got
        .iter()
        .zip(&want)
        .all(|(a, w)| a.to_bits() == w.to_bits());
    Ok((r, exact))
}

/// What member `index` of `size` combines from its own values and those it received,
/// in the CPU backend's order of operations: members in order, from member 0's value.
fn combine_reference(
    own_v: &[f32],
    recv_v: &[f32],
    size: u32,
    index: u32,
    dtype: DType,
    op: ReduceOp,
) -> Vec<f32> {
    let n = own_v.len();
    let round = |x: f32| {
        if dtype == DType::Bf16 {
            math::round_bf16(x)
        } else {
            x
        }
    };
    (0..n)
        .map(|e| {
            // Members in order, from member 0's value.
            let x = |j: u32| match j.cmp(&index) {
                std::cmp::Ordering::Equal => own_v[e],
                std::cmp::Ordering::Less => recv_v[j as usize * n + e],
                std::cmp::Ordering::Greater => recv_v[(j as usize - 1) * n + e],
            };
            let sum = (1..size).fold(round(x(0)), |acc, j| acc + round(x(j)));
            if op == ReduceOp::Avg {
                sum / size as f32
            } else {
                sum
            }
        })
        .collect()
}

/// The combine kernel the backend picks: vectors when n is a multiple of 4 (the
/// buffers are aligned), streaming only with the full grid.
fn combine_kernel(ctas: Option<u32>, n: usize, streaming: bool) -> String {
    match (ctas, n % 4 == 0, streaming) {
        (Some(c), true, _) => format!("{c} CTAs, wide vector kernel"),
        (Some(c), false, _) => format!("{c} CTAs, scalar kernel"),
        (None, true, true) => "full grid, streaming vector kernel".into(),
        (None, true, false) => "full grid, vector kernel".into(),
        (None, false, _) => "full grid, scalar kernel".into(),
    }
}

/// An all-reduce's combine writes its member's chunk only, in place in the whole
/// output: member 1 of 3 of 1000 elements owns [384, 768) (chunks of 384); the rest
/// of dst keeps its values.
async fn combine_chunk_check(b: &CudaBackend) -> Result<Check, Error> {
    let n = 1000usize;
    let own_v = random(n, 77);
    let recv_v = random(2 * 384, 78);
    let sentinel = vec![-7.5f32; n];
    let (own, recv, dst) = (
        buffer(b, &own_v)?,
        buffer(b, &recv_v)?,
        buffer(b, &sentinel)?,
    );
    let desc = Collective {
        kind: CollectiveKind::AllReduce,
        group: Group::Shard { replicate: 0 },
        count: n as u64,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: None,
    };
    let (at, k) = desc.member_chunk(3, 1);
    let (at, k) = (at as usize, k as usize);
    let r = run(
        b,
        Stream::Compute,
        Kernel::Combine {
            desc,
            size: 3,
            index: 1,
            own,
            own_offset: at,
            recv,
            dst: dst.clone(),
        },
    )
    .await;
    let got = download(b, &dst)?;
    let exact = (0..n).all(|e| {
        let want = if (at..at + k).contains(&e) {
            let i = e - at;
            recv_v[i] + own_v[e] + recv_v[k + i]
        } else {
            -7.5
        };
        got[e].to_bits() == want.to_bits()
    });
    Ok(Check {
        name: "combine all_reduce chunk (member 1 of 3, elements 384..768 of 1000)".into(),
        ok: r.is_ok() && exact,
        detail: format!("{r:?}, bit-exact and rest untouched: {exact}"),
    })
}

/// Spin: the stream stays busy for the time asked.
async fn spin_check(b: &CudaBackend) -> Check {
    let t0 = Instant::now();
    let r = run(b, Stream::Compute, Kernel::Spin { micros: 20_000 }).await;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    Check {
        name: "spin 20 ms".into(),
        ok: r.is_ok() && (20.0..200.0).contains(&ms),
        detail: format!("{r:?}, host saw {ms:.2} ms"),
    }
}

/// All-reduce (f32 sum) bandwidth per size, from timing events.
async fn bandwidth(
    b: &CudaBackend,
    world: u32,
    sizes: &[u64],
    iters: u32,
) -> Result<Vec<Bandwidth>, Error> {
    let mut out = Vec::new();
    for &bytes in sizes {
        if bytes / 4 == 0 {
            continue;
        }
        let t = all_reduce_seconds(b, bytes, iters).await?;
        if t.is_empty() {
            continue;
        }
        let seconds = t.iter().sum::<f64>() / t.len() as f64;
        let algbw = bytes as f64 / seconds / 1e9;
        let n = f64::from(world);
        out.push(Bandwidth {
            op: "all_reduce f32 sum".into(),
            bytes,
            seconds,
            algbw_gbs: algbw,
            busbw_gbs: algbw * 2.0 * (n - 1.0) / n,
        });
    }
    Ok(out)
}

/// The device time of each of `iters` in-place f32 sum all-reduces of `bytes` on the
/// replicate group, issued back to back after three untimed ones, in seconds.
async fn all_reduce_seconds(b: &CudaBackend, bytes: u64, iters: u32) -> Result<Vec<f64>, Error> {
    let rank = b.rank();
    let group = Group::Replicate { shard: 0 };
    let comm = CommId {
        group,
        stream: Stream::Replicate,
    };
    let count = (bytes / 4) as usize;
    let buf = alloc(b, count)?;
    let desc = Collective {
        kind: CollectiveKind::AllReduce,
        group,
        count: count as u64,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: None,
    };
    let issue = |k: u32| {
        b.launch(
            rank,
            Stream::Replicate,
            tag(k, "bench"),
            Kernel::Collective {
                desc,
                comm,
                send: Some(buf.clone()),
                recv: Some(buf.clone()),
            },
        )
    };
    for k in 0..3 {
        issue(k);
    }
    replicate_done(b).await?;
    let _ = b.take_timings();
    b.set_timings(true);
    for k in 0..iters {
        issue(k);
    }
    b.set_timings(false);
    replicate_done(b).await?;
    let errors = b.errors();
    if let Some((_, _, _, e)) = errors.first() {
        return Err(Error::Backend(format!("all-reduce of {bytes} bytes: {e}")));
    }
    Ok(b.take_timings()
        .iter()
        .filter(|t| t.tag.op == "bench")
        .map(|t| t.end - t.start)
        .collect())
}

/// Waits until the replicate stream has run what was issued on it.
async fn replicate_done(b: &CudaBackend) -> Result<(), Error> {
    let rank = b.rank();
    let ev = b.event(rank);
    b.record(rank, Stream::Replicate, &ev);
    b.host_wait(&ev).await.map_err(ops)
}
