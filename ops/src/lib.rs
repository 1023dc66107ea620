//! # overlap-ops
//!
//! The operation vocabulary of `overlap` ([`Kernel`]) and the [`Backend`] trait that
//! runs it: per rank four streams executing kernels in issue order, events that order
//! streams, and communicators for the mesh's groups. The CPU backend ([`cpu`]) runs ranks
//! as threads with exact reference math; it is the ground truth GPU kernels are tested
//! against. Reference optimizer math lives in [`math`]. With the `cuda` feature, `cuda`
//! runs one rank per GPU on CUDA streams with NCCL communicators.
//!
//! Semantics every backend keeps (those of CUDA streams):
//! - work launched on a stream runs after all earlier work on that stream;
//! - [`Backend::record`] marks a point of a stream; [`Backend::wait`] makes later work
//!   of another stream wait until that point has executed;
//! - a kernel that fails *poisons* its stream: later kernels on it are cancelled, events
//!   recorded on it fail, streams waiting on a failed event are poisoned in turn, and a
//!   collective with a poisoned member fails on every member (nothing hangs).

#![warn(missing_docs, unreachable_pub)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub use overlap_graph as graph;
use overlap_graph::{Collective, CollectiveKind, CopySeg, Group, Stream};

// The copy transport's protocol: compiled where it is used (the CUDA backend) and for
// its model checker, which runs without a GPU.
#[cfg(any(feature = "cuda", test))]
mod copy_protocol;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod math;

/// Errors of kernels and backends.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpsError {
    /// A kernel's buffers do not match what it needs.
    #[error("{kernel}: {reason}")]
    Shape {
        /// The kernel kind.
        kernel: &'static str,
        /// What does not match.
        reason: String,
    },
    /// A kernel failed while running.
    #[error("{kernel} failed: {reason}")]
    Failed {
        /// The kernel kind.
        kernel: &'static str,
        /// Why.
        reason: String,
    },
    /// Cancelled because something it depends on failed.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// A collective's members disagree or did not arrive in time.
    #[error("collective on {comm}: {reason}")]
    Collective {
        /// The communicator, e.g. `shard-group(r=0)@reduce`.
        comm: String,
        /// What went wrong.
        reason: String,
    },
    /// The backend cannot be used.
    #[error("backend: {0}")]
    Backend(String),
}

impl OpsError {
    /// Whether this error only reports the failure of something else.
    pub fn is_cancellation(&self) -> bool {
        matches!(self, OpsError::Cancelled(_))
    }
}

/// A communicator: one group of the mesh bound to the stream that uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommId {
    /// The group.
    pub group: Group,
    /// The stream its collectives run on.
    pub stream: Stream,
}

impl CommId {
    /// The communicator a collective of the plan runs on, on `stream`.
    pub fn of(collective: &overlap_graph::Collective, stream: Stream) -> CommId {
        CommId {
            group: collective.group,
            stream,
        }
    }
}

impl std::fmt::Display for CommId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.group, self.stream)
    }
}

/// What each member of a collective passes, in elements (`None`: no buffer), as
/// [`Kernel::Collective`] documents. Both backends check launches against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollectiveRoles {
    /// Length of the member's send buffer.
    pub send: Option<usize>,
    /// Length of the member's receive buffer.
    pub recv: Option<usize>,
}

/// The buffers member `index` of a group of `size` passes to `desc`, or why `desc` is
/// unusable (a count that does not fit in memory, a root outside the group).
pub fn collective_roles(
    desc: &Collective,
    size: u32,
    index: u32,
) -> Result<CollectiveRoles, String> {
    let c =
        usize::try_from(desc.count).map_err(|_| format!("count {} is too large", desc.count))?;
    let whole = c.checked_mul(size as usize).ok_or_else(|| {
        format!(
            "count {} × {size} members does not fit in memory",
            desc.count
        )
    })?;
    let root = match (desc.kind.rooted(), desc.root) {
        (false, _) => None,
        (true, Some(r)) if r < size => Some(r),
        (true, r) => {
            return Err(format!(
                "root {r:?} is not a member index of {} ({size} members)",
                desc.group
            ))
        }
    };
    let is_root = root == Some(index);
    let (send, recv) = match desc.kind {
        CollectiveKind::ReduceScatter => (Some(whole), Some(c)),
        CollectiveKind::AllReduce => (Some(c), Some(c)),
        CollectiveKind::Reduce => (Some(c), is_root.then_some(c)),
        CollectiveKind::Broadcast if is_root => (Some(c), None),
        CollectiveKind::Broadcast => (None, Some(c)),
        CollectiveKind::AllGather => (Some(c), Some(whole)),
    };
    Ok(CollectiveRoles { send, recv })
}

/// What each member of a copy-transport exchange of `desc` passes ([`Kernel::Exchange`]):
/// a send buffer as the collective's (reduce-scatter `n·c`, all-reduce and reduce `c`),
/// and where the member receives the stage's result, a receive buffer of `(n − 1)·k`,
/// `k` the length of what it reduces ([`Collective::member_chunk`]: `c` for
/// reduce-scatter and reduce, its chunk of the buffer for all-reduce).
/// Broadcast and all-gather move no reduction and have no exchange.
pub fn exchange_roles(desc: &Collective, size: u32, index: u32) -> Result<CollectiveRoles, String> {
    let roles = collective_roles(desc, size, index)?;
    // `collective_roles` checked that `size · count` fits in memory.
    let k = desc.member_chunk(size, index).1 as usize;
    let peers = size.saturating_sub(1) as usize;
    let recv = match desc.kind {
        CollectiveKind::ReduceScatter | CollectiveKind::AllReduce | CollectiveKind::Reduce => {
            roles.recv.map(|_| k * peers)
        }
        CollectiveKind::Broadcast | CollectiveKind::AllGather => {
            return Err(format!(
                "{} reduces nothing and has no copy-transport exchange",
                desc.kind.name()
            ))
        }
    };
    Ok(CollectiveRoles {
        send: roles.send,
        recv,
    })
}

/// Checks the buffer lengths of a [`Kernel::Combine`] (both backends run it before
/// anything else): `index` is a member, the member receives the stage's result, `own`
/// holds the member's chunk ([`Collective::member_chunk`], `k` elements) from
/// `own_offset` (for all-reduce, `own_offset` must be the chunk's offset), `recv` the
/// others' `(size − 1)·k`, and `dst` the stage's output: exactly `k` elements, or for
/// all-reduce the whole `count`, of which the combine writes the chunk. Returns `k` and
/// where in `dst` the combine writes; the error names what does not fit.
pub fn combine_lengths(
    desc: &Collective,
    (size, index): (u32, u32),
    (own_len, own_offset): (usize, usize),
    recv_len: usize,
    dst_len: usize,
) -> Result<(usize, usize), String> {
    if index >= size {
        return Err(format!(
            "member index {index} is not a member of a group of {size}"
        ));
    }
    let roles = exchange_roles(desc, size, index)
        .map_err(|e| format!("{} on {}: {e}", desc.kind.name(), desc.group))?;
    let Some(peers_len) = roles.recv else {
        return Err(format!(
            "member {index} is not the root ({:?}) of the {} on {}: it receives nothing to combine",
            desc.root,
            desc.kind.name(),
            desc.group
        ));
    };
    // `exchange_roles` checked that `size · count` fits in memory.
    let (chunk_offset, k) = desc.member_chunk(size, index);
    let (chunk_offset, k, count) = (chunk_offset as usize, k as usize, desc.count as usize);
    let all_reduce = desc.kind == CollectiveKind::AllReduce;
    if all_reduce && own_offset != chunk_offset {
        return Err(format!(
            "own_offset {own_offset} is not member {index}'s chunk of the all-reduce, which starts at {chunk_offset}"
        ));
    }
    if !matches!(own_offset.checked_add(k), Some(end) if end <= own_len) {
        return Err(format!(
            "own is too short: own_offset {own_offset} + {k} elements exceeds its {own_len} elements"
        ));
    }
    if recv_len < peers_len {
        return Err(format!(
            "recv is too short: the {} other members' chunks need {peers_len} elements, got {recv_len}",
            size - 1
        ));
    }
    if all_reduce {
        if dst_len != count {
            return Err(format!(
                "dst must hold the all-reduce's count = {count} elements, got {dst_len}"
            ));
        }
        return Ok((k, chunk_offset));
    }
    if dst_len != k {
        return Err(format!("dst must hold count = {k} elements, got {dst_len}"));
    }
    Ok((k, 0))
}

/// What a member of a copy-transport call passes, and how many elements it receives
/// (both backends report `4 ×` that as the call's bytes: the copy transport moves f32 as
/// is). An exchange ([`Kernel::Exchange`]) passes [`exchange_roles`] and receives its
/// receive buffer; a gather ([`Kernel::Gather`], all-reduces only) passes its one buffer
/// of `count` as the send side and receives every other member's chunk. Errors name the
/// collective and its group.
pub fn copy_roles(
    desc: &Collective,
    size: u32,
    index: u32,
    gather: bool,
) -> Result<(CollectiveRoles, usize), String> {
    let in_group = |e: String| format!("{} on {}: {e}", desc.kind.name(), desc.group);
    if !gather {
        let roles = exchange_roles(desc, size, index).map_err(in_group)?;
        return Ok((roles, roles.recv.unwrap_or(0)));
    }
    if desc.kind != CollectiveKind::AllReduce {
        return Err(in_group(format!(
            "only an all-reduce's chunks are gathered, not a {}'s",
            desc.kind.name()
        )));
    }
    if index >= size {
        return Err(in_group(format!(
            "member index {index} is not a member of a group of {size}"
        )));
    }
    let count = collective_roles(desc, size, index)
        .map_err(in_group)?
        .recv
        .unwrap_or(0);
    let own = desc.member_chunk(size, index).1 as usize;
    let roles = CollectiveRoles {
        send: Some(count),
        recv: None,
    };
    Ok((roles, count - own))
}

/// The receive-buffer slot of member `from` at member `index`: the other members in
/// group order, skipping `index` itself.
pub fn exchange_slot(index: u32, from: u32) -> usize {
    if from < index {
        from as usize
    } else {
        from as usize - 1
    }
}

/// AdamW hyper-parameters (decoupled weight decay, bias-corrected moments). Build them
/// from [`AdamwParams::default`] with the `with_*` methods: a field added later is not a
/// breaking change.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct AdamwParams {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay: `p *= 1 - lr·wd` before the update.
    pub weight_decay: f32,
}

impl Default for AdamwParams {
    fn default() -> Self {
        AdamwParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamwParams {
    /// With this learning rate.
    pub fn with_lr(mut self, lr: f32) -> Self {
        self.lr = lr;
        self
    }

    /// With this first-moment decay.
    pub fn with_beta1(mut self, beta1: f32) -> Self {
        self.beta1 = beta1;
        self
    }

    /// With this second-moment decay.
    pub fn with_beta2(mut self, beta2: f32) -> Self {
        self.beta2 = beta2;
        self
    }

    /// With this denominator epsilon.
    pub fn with_eps(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// With this decoupled weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Self {
        self.weight_decay = weight_decay;
        self
    }
}

/// The precision Newton–Schulz runs in on a GPU (`ns_dtype` in a config). The CPU
/// backend always runs the exact `f64` reference ([`math::newton_schulz`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum NsDtype {
    /// bfloat16 operands and results, f32 accumulation on the tensor cores, as Muon's
    /// reference implementation and `torch.optim.Muon` run it (the default).
    #[default]
    Bf16,
    /// f32 operands rounded to TF32 inside the GEMMs (tensor cores), f32 results.
    Tf32,
    /// Full f32 GEMMs (no tensor cores).
    F32,
}

impl NsDtype {
    /// Every precision, in order.
    pub const ALL: [NsDtype; 3] = [NsDtype::Bf16, NsDtype::Tf32, NsDtype::F32];

    /// The name a config uses: `bf16`, `tf32` or `f32`.
    pub fn name(self) -> &'static str {
        match self {
            NsDtype::Bf16 => "bf16",
            NsDtype::Tf32 => "tf32",
            NsDtype::F32 => "f32",
        }
    }

    /// The precision a config names, or `None`.
    pub fn parse(name: &str) -> Option<NsDtype> {
        NsDtype::ALL.into_iter().find(|d| d.name() == name)
    }
}

/// Muon hyper-parameters. Build them from [`MuonParams::default`] with the `with_*`
/// methods: a field added later is not a breaking change.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct MuonParams {
    /// Learning rate.
    pub lr: f32,
    /// Momentum `μ`: `buf = μ·buf + g`, Nesterov input `g + μ·buf`.
    pub momentum: f32,
    /// Newton–Schulz iterations (quintic).
    pub ns_steps: u32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// The precision of Newton–Schulz on a GPU (the CPU backend ignores it).
    pub ns_dtype: NsDtype,
}

impl Default for MuonParams {
    fn default() -> Self {
        MuonParams {
            lr: 0.02,
            momentum: 0.95,
            ns_steps: 5,
            weight_decay: 0.0,
            ns_dtype: NsDtype::Bf16,
        }
    }
}

impl MuonParams {
    /// With this learning rate.
    pub fn with_lr(mut self, lr: f32) -> Self {
        self.lr = lr;
        self
    }

    /// With this momentum.
    pub fn with_momentum(mut self, momentum: f32) -> Self {
        self.momentum = momentum;
        self
    }

    /// With this many Newton–Schulz iterations.
    pub fn with_ns_steps(mut self, ns_steps: u32) -> Self {
        self.ns_steps = ns_steps;
        self
    }

    /// With this decoupled weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// With Newton–Schulz in this precision on a GPU.
    pub fn with_ns_dtype(mut self, ns_dtype: NsDtype) -> Self {
        self.ns_dtype = ns_dtype;
        self
    }
}

/// One operation with its buffers bound. `B` is the backend's buffer handle.
#[derive(Debug, Clone)]
pub enum Kernel<B> {
    /// A point of the trainer's backward (`grad_ready`): no work, only ordering.
    Marker,
    /// Occupies its stream for `micros` microseconds and touches no buffer: stands in for
    /// device work that is not otherwise on the stream (the trainer's backward, when
    /// `[run] backward_us_per_layer` asks for a synthetic cost).
    Spin {
        /// How long the stream stays busy, in microseconds.
        micros: u32,
    },
    /// `count` matrix products `C = A·B` (`A` is `m × k`, `B` is `k × n`) on operands
    /// the backend owns, touching no plan buffer: a synthetic backward with the cost of
    /// real GEMMs (`overlap bench`). CUDA: bf16 inputs and output with f32 accumulation
    /// through cuBLAS `cublasGemmEx`, as `torch.mm` on bf16 tensors. CPU: the same
    /// products in f32 with a plain loop (exact, slow: meant for small sizes and tests).
    Gemm {
        /// Rows of `A` and `C`.
        m: u32,
        /// Columns of `B` and `C`.
        n: u32,
        /// Columns of `A`, rows of `B`.
        k: u32,
        /// How many products, one after another on the stream.
        count: u32,
    },
    /// `dst = src` (or `dst += src` when `accumulate`), same length.
    Add {
        /// Destination.
        dst: B,
        /// Source.
        src: B,
        /// Add instead of copy.
        accumulate: bool,
    },
    /// Zero `dst`, then for every segment `dst[dst..dst+len] = Σ srcs[src..src+len]`
    /// over the segment's sources (a gradient, plus its no_sync accumulation).
    Pack {
        /// The send buffer.
        dst: B,
        /// Copies, each with the buffers summed into it.
        segs: Arc<[(CopySeg, Vec<B>)]>,
    },
    /// For every segment `dsts[i][dst..dst+len] (+)= src[src..src+len]`.
    Unpack {
        /// The Stage-2 output.
        src: B,
        /// Copies with their destination buffer.
        segs: Arc<[(CopySeg, B)]>,
        /// Add instead of copy.
        accumulate: bool,
    },
    /// A collective on a communicator. Buffers by kind (`n` = group size, `c` = count):
    /// reduce-scatter `send[n·c] → recv[c]`; all-reduce `send[c] → recv[c]` (may be the
    /// same buffer); reduce `send[c] → recv[c]` on the root only (`recv = None`
    /// elsewhere); broadcast: the root passes `send` only, the others `recv` only;
    /// all-gather `send[c] → recv[n·c]`. `bf16` rounds inputs to bfloat16 and reduces in
    /// f32; `avg` divides by `n`.
    Collective {
        /// What every member issues.
        desc: Collective,
        /// The communicator.
        comm: CommId,
        /// Input.
        send: Option<B>,
        /// Output.
        recv: Option<B>,
    },
    /// Copy transport, the moving half of `desc` (reduce-scatter, all-reduce or
    /// reduce over `comm`'s group of `n` members, count `c`), without arithmetic: member
    /// `i` receives into `recv`, at slot [`exchange_slot`]`(i, j)`, member `j`'s chunk
    /// `i` of its send buffer (reduce-scatter: `c` elements at `i·c`; all-reduce: the
    /// [`Collective::member_chunk`] `i`) or member `j`'s whole send buffer (reduce, on
    /// the root only). Buffers as [`exchange_roles`]. Every
    /// member issues the same exchanges in the same order; the exchange ends on a
    /// member's stream once its own receive buffer is complete and the others have
    /// taken what they need from it. CUDA: copy engines over NVLink (CUDA IPC), no SMs.
    Exchange {
        /// The reduction the stage performs.
        desc: Collective,
        /// The communicator.
        comm: CommId,
        /// Input (as the collective's).
        send: Option<B>,
        /// The other members' chunks, `(n − 1)·c`; on a communicator whose receives
        /// stay in place ([`Backend::receives_in_place`]), only a key that names the
        /// exchange to its combine (any length).
        recv: Option<B>,
    },
    /// Copy transport, the arithmetic half of `desc`: over the member's chunk of `k`
    /// elements ([`combine_lengths`]), `dst[at + e] = Σ_j x_j[e]` over members `j =
    /// 0..size` in order, where `x_index = own[own_offset + e]` and `x_j =
    /// recv[slot(j)·k + e]` for the others, and `at` is 0, or the chunk's offset for an
    /// all-reduce (whose other chunks [`Kernel::Gather`] fills); `bf16` rounds every
    /// `x_j` to bfloat16 first, `avg` divides by `size`. Every element is summed in
    /// member order, so the result equals the collective's bit for bit.
    Combine {
        /// The reduction.
        desc: Collective,
        /// Members in the group.
        size: u32,
        /// This rank's member index.
        index: u32,
        /// This rank's own contribution (its send buffer or Stage-1 output).
        own: B,
        /// Where this rank's chunk starts in `own` (`index·c` for reduce-scatter).
        own_offset: usize,
        /// What [`Kernel::Exchange`] received.
        recv: B,
        /// The stage's output: `k` elements, or an all-reduce's whole `count`.
        dst: B,
    },
    /// Copy transport, the last third of an all-reduce `desc` over `comm`'s group: each
    /// member `i` copies chunk `i` of `buf` ([`Collective::member_chunk`], reduced by its
    /// combine) into chunk `i` of every other member's `buf`, without arithmetic, so every
    /// `buf` ends whole. Cross-rank like [`Kernel::Exchange`], on the same communicator;
    /// `buf` holds `count` elements ([`copy_roles`]); `None` for a member that cannot
    /// take part (it still meets the others). CUDA: copy engines, no SMs.
    Gather {
        /// The all-reduce.
        desc: Collective,
        /// The communicator (the exchange's).
        comm: CommId,
        /// The stage's output.
        buf: Option<B>,
    },
    /// AdamW on one piece: `state` holds `m` then `v` (2·len).
    Adamw {
        /// Parameter values (updated in place).
        param: B,
        /// The reduced gradient.
        grad: B,
        /// Moments.
        state: B,
        /// Hyper-parameters.
        hp: AdamwParams,
        /// 1-based step count for bias correction.
        step: u64,
    },
    /// Muon on a whole `rows × cols` matrix (row-major).
    Muon {
        /// Parameter values (updated in place).
        param: B,
        /// The reduced gradient.
        grad: B,
        /// Momentum buffer.
        momentum: B,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Hyper-parameters.
        hp: MuonParams,
    },
    /// `dst[0] = Σ x²` over every element of `srcs` (accumulated in f64, stored in
    /// f32): a rank's share of the squared global gradient norm ([`math::sum_squares`]).
    /// The CUDA backend adds in an order of its own (per-block partial sums, then one
    /// block; no atomics, so reproducible run to run): within one f32 rounding of the
    /// CPU backend's.
    SumSquares {
        /// The one-element result.
        dst: B,
        /// The reduced gradients the rank counts.
        srcs: Arc<[B]>,
    },
    /// Scales every buffer of `bufs` by [`math::clip_factor`] of the squared norm in
    /// `norm[0]` and `max_norm`; leaves them as they are when the norm is not finite
    /// (the step is skipped) or the factor is 1.
    Clip {
        /// The one-element squared global norm.
        norm: B,
        /// The reduced gradients to scale.
        bufs: Arc<[B]>,
        /// The threshold.
        max_norm: f32,
    },
    /// Runs `kernel` (an optimizer) only when the squared global norm in `norm[0]` is
    /// finite: a step whose gradients hold NaN or Inf leaves parameters and optimizer
    /// state untouched.
    IfFinite {
        /// The one-element squared global norm.
        norm: B,
        /// The guarded kernel.
        kernel: Box<Kernel<B>>,
    },
    /// A row of optimizer steps, each run as its own kernel under its own tag, in
    /// order ([`OptimizerStep::kernel`]): step `i` updates its parameter from
    /// `grads[i]` by [`Kernel::Adamw`] with step `step` or [`Kernel::Muon`], at
    /// learning rate `lr · lr_factor`, guarded by `guard` as [`Kernel::IfFinite`] when
    /// there is one. The result is the steps' kernels launched one by one; it exists so
    /// that a caller can keep what stays from step to step (the parameters, the
    /// states, the settings: one `Arc` to clone) and hand in only what moves (the
    /// gradients, the guard, the step count and the learning-rate factor). A backend
    /// reports a failure under the failing step's tag; `grads` shorter or longer than
    /// `steps` fails the row under its own tag, launching none of it.
    Optimizers(OptimizerRow<B>),
}

/// The row of a [`Kernel::Optimizers`]: what stays from step to step (the steps, one
/// `Arc`) and what moves (the gradients, the guard, the step count and the
/// learning-rate factor).
#[derive(Debug, Clone)]
pub struct OptimizerRow<B> {
    /// The steps, in order.
    pub steps: Arc<[OptimizerStep<B>]>,
    /// Each step's reduced gradient, at its index.
    pub grads: Vec<B>,
    /// The one-element squared global norm every step is guarded by.
    pub guard: Option<B>,
    /// AdamW's 1-based step count.
    pub step: u64,
    /// The learning-rate factor of this step (a schedule's).
    pub lr_factor: f64,
}

impl<B: Clone> OptimizerRow<B> {
    /// Whether there is one gradient per step ([`optimizers_mismatch`] if not).
    pub fn check(&self) -> Result<(), OpsError> {
        if self.grads.len() == self.steps.len() {
            Ok(())
        } else {
            Err(optimizers_mismatch(self.steps.len(), self.grads.len()))
        }
    }

    /// Each step's tag and kernel ([`OptimizerStep::guarded`]), in order, reading its
    /// gradient. Call [`Self::check`] first: a step without a gradient is left out.
    pub fn kernels(&self) -> impl Iterator<Item = (Tag, Kernel<B>)> + '_ {
        let at = (self.step, self.lr_factor);
        self.steps
            .iter()
            .zip(&self.grads)
            .map(move |(s, g)| (s.tag, s.guarded(g.clone(), at, self.guard.as_ref())))
    }
}

/// One step of [`Kernel::Optimizers`]: a parameter's update, under its own tag (its
/// gradient is handed in with the row).
#[derive(Debug, Clone)]
pub struct OptimizerStep<B> {
    /// Who launched it (its own node).
    pub tag: Tag,
    /// Parameter values (updated in place).
    pub param: B,
    /// AdamW's moments, or Muon's momentum.
    pub state: B,
    /// The update and its settings.
    pub update: Update,
}

/// What an [`OptimizerStep`] runs, with its settings at learning-rate factor 1: the
/// learning rate of a step of factor `f` is `(lr · f)` computed in f64 and stored in
/// f32 (the `lr` field of `hp` is not read).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Update {
    /// [`Kernel::Adamw`].
    Adamw {
        /// Hyper-parameters.
        hp: AdamwParams,
        /// The unscaled learning rate.
        lr: f64,
    },
    /// [`Kernel::Muon`] on a `rows × cols` matrix.
    Muon {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Hyper-parameters.
        hp: MuonParams,
        /// The unscaled learning rate.
        lr: f64,
    },
}

impl<B: Clone> OptimizerStep<B> {
    /// The step as a kernel of its own, unguarded, reading `grad`: AdamW step `step`,
    /// learning-rate factor `lr_factor`.
    pub fn kernel(&self, grad: B, step: u64, lr_factor: f64) -> Kernel<B> {
        let (param, state) = (self.param.clone(), self.state.clone());
        match self.update {
            Update::Adamw { hp, lr } => Kernel::Adamw {
                param,
                grad,
                state,
                hp: hp.with_lr((lr * lr_factor) as f32),
                step,
            },
            Update::Muon { rows, cols, hp, lr } => Kernel::Muon {
                param,
                grad,
                momentum: state,
                rows,
                cols,
                hp: hp.with_lr((lr * lr_factor) as f32),
            },
        }
    }

    /// [`Self::kernel`], guarded by `guard` as [`Kernel::IfFinite`] when there is one.
    pub fn guarded(&self, grad: B, (step, lr_factor): (u64, f64), guard: Option<&B>) -> Kernel<B> {
        let kernel = self.kernel(grad, step, lr_factor);
        match guard {
            Some(norm) => Kernel::IfFinite {
                norm: norm.clone(),
                kernel: Box::new(kernel),
            },
            None => kernel,
        }
    }
}

/// What [`Kernel::Optimizers`] fails with when its gradients do not match its steps.
pub fn optimizers_mismatch(steps: usize, grads: usize) -> OpsError {
    OpsError::Shape {
        kernel: "optimizers",
        reason: format!("{grads} gradients for {steps} steps"),
    }
}

impl<B> Kernel<B> {
    /// The kernel's kind name.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Marker => "marker",
            Kernel::Spin { .. } => "spin",
            Kernel::Gemm { .. } => "gemm",
            Kernel::Add { .. } => "add",
            Kernel::Pack { .. } => "pack",
            Kernel::Unpack { .. } => "unpack",
            Kernel::Collective { .. } => "collective",
            Kernel::Exchange { .. } => "exchange",
            Kernel::Combine { .. } => "combine",
            Kernel::Gather { .. } => "gather",
            Kernel::Adamw { .. } => "adamw",
            Kernel::Muon { .. } => "muon",
            Kernel::SumSquares { .. } => "sum_squares",
            Kernel::Clip { .. } => "clip",
            Kernel::IfFinite { kernel, .. } => kernel.name(),
            Kernel::Optimizers(_) => "optimizers",
        }
    }
}

/// Who launched a kernel: for errors, fault injection, timings and traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    /// The plan node.
    pub node: u32,
    /// The node's operation kind (`stage1`, `fold`, ...).
    pub op: &'static str,
    /// The micro-batch, or `u32::MAX` for the step tail.
    pub micro_batch: u32,
}

/// When a kernel ran, relative to the backend's epoch (for timelines and metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// The rank.
    pub rank: u32,
    /// The stream.
    pub stream: Stream,
    /// The launching node.
    pub tag: Tag,
    /// Start, seconds since the epoch.
    pub start: f64,
    /// End, seconds since the epoch.
    pub end: f64,
    /// Bytes a collective moved per member (0 for other kernels).
    pub bytes: u64,
}

/// The state of an event as the host sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum EventStatus {
    /// Not executed yet.
    Pending,
    /// Executed.
    Complete,
    /// Recorded on a poisoned stream.
    Failed(OpsError),
}

/// A boxed future, as returned by [`Backend::host_wait`].
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A device (or the CPU standing in for one) with streams, events and communicators for
/// the local ranks of a mesh.
pub trait Backend: Send + Sync + 'static {
    /// A device buffer of f32 elements.
    type Buffer: Clone + Send + Sync + std::fmt::Debug + 'static;
    /// An event.
    type Event: Clone + Send + Sync + 'static;

    /// `cpu` or `cuda`.
    fn name(&self) -> &'static str;
    /// The global ranks this backend drives.
    fn local_ranks(&self) -> Vec<u32>;
    /// A zeroed buffer of `len` elements on a rank.
    fn alloc(&self, rank: u32, len: usize) -> Result<Self::Buffer, OpsError>;
    /// A buffer of `len` elements whose contents are unspecified, for a caller whose
    /// first use overwrites every element (no zeroing, so no synchronous device work).
    /// The default zeroes, like [`Backend::alloc`].
    fn alloc_uninit(&self, rank: u32, len: usize) -> Result<Self::Buffer, OpsError> {
        self.alloc(rank, len)
    }
    /// Number of elements.
    fn len(&self, buf: &Self::Buffer) -> usize;
    /// Copies host data into a buffer no stream is using (synchronous).
    fn upload(&self, buf: &Self::Buffer, data: &[f32]) -> Result<(), OpsError>;
    /// Copies a buffer no stream is writing to the host (synchronous).
    fn download(&self, buf: &Self::Buffer) -> Result<Vec<f32>, OpsError>;
    /// A new event on a rank.
    fn event(&self, rank: u32) -> Self::Event;
    /// Enqueues a kernel on a stream of a rank; returns at once.
    fn launch(&self, rank: u32, stream: Stream, tag: Tag, kernel: Kernel<Self::Buffer>);
    /// Launches `kernels` on `stream` in order, each under its tag: what calling
    /// [`Self::launch`] for each does, which is the default. A backend that takes a lock
    /// or binds a context per launch does that once for the whole row here (the
    /// executor hands it a step's optimizers, or its publishes, in one call).
    fn launch_row(&self, rank: u32, stream: Stream, kernels: Vec<(Tag, Kernel<Self::Buffer>)>) {
        for (tag, kernel) in kernels {
            self.launch(rank, stream, tag, kernel);
        }
    }
    /// Enqueues a record of `event` on a stream.
    fn record(&self, rank: u32, stream: Stream, event: &Self::Event);
    /// Makes later work on a stream wait for the latest record of `event`.
    fn wait(&self, rank: u32, stream: Stream, event: &Self::Event);
    /// Non-blocking query.
    fn status(&self, event: &Self::Event) -> EventStatus;
    /// Resolves when the event has executed (or failed), without blocking a thread.
    fn host_wait(&self, event: &Self::Event) -> BoxFuture<Result<(), OpsError>>;
    /// The first error each stream of the local ranks hit since the last reset
    /// (root causes, not cancellations), in the order they happened.
    fn errors(&self) -> Vec<(u32, Stream, Tag, OpsError)>;
    /// Clears every stream's poison after a failed step. Only call when idle.
    fn reset(&self);
    /// Takes the kernel timings recorded since the last call.
    fn take_timings(&self) -> Vec<Timing>;
    /// Turns kernel timings on or off for work launched from now on, where recording
    /// them costs host time (the CUDA backend: two event records per kernel). The
    /// default ignores it (the backend always records them).
    fn set_timings(&self, _on: bool) {}
    /// Whether a [`Kernel::Marker`] on `rank` does anything (a timing point): `false`
    /// lets a caller leave markers out of a row. The default says yes; the CUDA backend
    /// says no while timings are off (its markers then launch nothing).
    fn needs_markers(&self, _rank: u32) -> bool {
        true
    }
    /// Whether `a` and `b` are handles of one buffer (clones of one allocation). A
    /// caller that keeps kernels' buffers from step to step ([`Kernel::Optimizers`])
    /// asks this to see that they are still the ones to use. The default says no,
    /// which only makes such a caller bind them again.
    fn same_buffer(&self, _a: &Self::Buffer, _b: &Self::Buffer) -> bool {
        false
    }
    /// Whether [`Kernel::Exchange`]s on `comm` leave what they receive where it
    /// arrived, for the combine to read there: then their `recv` buffer only names the
    /// exchange to its [`Kernel::Combine`] and is never read or written, so a caller may
    /// pass a one-element buffer. The default: no (the receive buffer holds the data).
    fn receives_in_place(&self, _comm: CommId) -> bool {
        false
    }

    /// The kernel a stream is running now, if the backend knows (the CPU backend does;
    /// CUDA does not, `None`): how a timed-out step names the node it waits on.
    fn running(&self, _rank: u32, _stream: Stream) -> Option<Tag> {
        None
    }

    /// Gives up on the work in flight after a step timed out, so that the process can
    /// exit: CUDA aborts every NCCL communicator (`ncclCommAbort`; later collectives
    /// fail); the CPU backend with one rank per process ends its waits for other
    /// processes and tells them `why` (in one process it does nothing: its collectives
    /// time out by themselves and dropping it ends its streams). `why` says what ended
    /// the work (the timeout, or another rank's failure). The backend is not usable for
    /// collectives after.
    fn abort(&self, _why: &str) {}
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use overlap_graph::{DType, ReduceOp};

    /// An f32 `avg` collective on shard group 0 (for tests across the crate).
    pub(crate) fn coll(kind: CollectiveKind, count: u64, root: Option<u32>) -> Collective {
        Collective {
            kind,
            group: Group::Shard { replicate: 0 },
            count,
            dtype: DType::F32,
            op: ReduceOp::Avg,
            root,
        }
    }

    #[test]
    fn member_roles_follow_the_kernel_contract() {
        let r = collective_roles(&coll(CollectiveKind::ReduceScatter, 5, None), 4, 1).unwrap();
        assert_eq!((r.send, r.recv), (Some(20), Some(5)));
        let r = collective_roles(&coll(CollectiveKind::Reduce, 5, Some(1)), 2, 0).unwrap();
        assert_eq!((r.send, r.recv), (Some(5), None));
        let r = collective_roles(&coll(CollectiveKind::Broadcast, 5, Some(1)), 2, 1).unwrap();
        assert_eq!((r.send, r.recv), (Some(5), None));
        let r = collective_roles(&coll(CollectiveKind::AllGather, 3, None), 2, 0).unwrap();
        assert_eq!((r.send, r.recv), (Some(3), Some(6)));
        assert!(collective_roles(&coll(CollectiveKind::Reduce, 5, Some(2)), 2, 0).is_err());
        assert!(collective_roles(&coll(CollectiveKind::AllGather, u64::MAX, None), 2, 0).is_err());
    }
}
