//! Prometheus metrics of every step, through the `metrics` facade.
//!
//! One call, `install_prometheus`, serves `/metrics` on an address and turns recording
//! on; from then on every [`Session::step`](crate::Session::step) records its step and
//! every plan the validator rejects counts. A trainer that installs its own `metrics`
//! recorder calls `enable` instead.
//!
//! Names follow Prometheus' conventions (base units, `_total` counters) and labels are
//! low-cardinality (`op`, `stream`, `collective`, `gate`, `buffer`, `invariant`,
//! `micro_batch`, `group`, `optimizer`); the full list with meanings is [`METRICS`]. Per-step figures that are
//! durations are histograms (a dashboard divides the rates of `_sum` and `_count` for the
//! mean per step); the others are gauges holding the last step's value. Quantities over
//! the local ranks are as [`StepAnalysis`](crate::observe::StepAnalysis) defines them. The figures that need kernel
//! timings (device span, stream busy, exposed communication, η, op durations, bus
//! bandwidth) come from timed steps only (`[metrics] timing_every`), the rest from every
//! step.
//!
//! The invariant it keeps: recording never fails and never panics; with recording off
//! (the default) a step costs one atomic load here.
//!
//! Recording needs the `metrics` feature (the command line has it on). Without it the
//! names and [`METRICS`] are still here for dashboards, the session records nothing and
//! `install_prometheus`/`enable` do not exist.

use std::net::SocketAddr;

use overlap_graph::Gate;

use crate::Error;

#[cfg(feature = "metrics")]
mod record;
#[cfg(feature = "metrics")]
pub use record::{
    enable, enabled, install_prometheus, record_analysis, record_refused_nonfinite,
    record_rejection, record_step, record_unflushed, serve_http, IDLE_TIMEOUT, MAX_CONNECTIONS,
};

/// Histogram buckets of every `_seconds` histogram: 1 µs to 10 s, 1-2.5-5 per decade.
pub const SECONDS_BUCKETS: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Kernel durations, per node kind and stream (histogram).
pub const OP_DURATION: &str = "overlap_op_duration_seconds";
/// Completed steps (counter).
pub const STEPS: &str = "overlap_steps_total";
/// Host wall time of a step, from its first issue to the device finishing (histogram).
pub const STEP_DURATION: &str = "overlap_step_duration_seconds";
/// Device span of a step, first kernel start to last kernel end (histogram).
pub const STEP_DEVICE: &str = "overlap_step_device_seconds";
/// Busy time of each stream in a step (histogram).
pub const STREAM_BUSY: &str = "overlap_stream_busy_seconds";
/// Communication not overlapped by compute in a step (histogram).
pub const EXPOSED: &str = "overlap_exposed_communication_seconds";
/// Overlap efficiency η of the last timed step (gauge).
pub const EFFICIENCY: &str = "overlap_overlap_efficiency_ratio";
/// Bytes of collective data, per node kind and collective kind (counter).
pub const COLLECTIVE_BYTES: &str = "overlap_collective_bytes_total";
/// Achieved bus bandwidth of the last timed step's collectives (gauge).
pub const BUS_BANDWIDTH: &str = "overlap_collective_bus_bandwidth_bytes_per_second";
/// Peak bytes of partials / no_sync accumulations held in the last step (gauge).
pub const PARTIAL_BYTES: &str = "overlap_partial_bytes";
/// Bytes Stage 2 moved (counter).
pub const STAGE2_BYTES: &str = "overlap_stage2_bytes_total";
/// Bytes Stage 2 did not move thanks to the replicate gate (counter).
pub const STAGE2_SAVED: &str = "overlap_stage2_saved_bytes_total";
/// Micro-batches by gate (counter).
pub const MICRO_BATCHES: &str = "overlap_micro_batches_total";
/// The gate of each micro-batch index in the last step (gauge: 0 no_sync, 1 off, 2 on).
pub const MICRO_BATCH_GATE: &str = "overlap_micro_batch_gate";
/// Plans the validator rejected, per broken invariant (counter).
pub const REJECTIONS: &str = "overlap_validator_rejections_total";
/// Plan nodes issued (counter).
pub const NODES: &str = "overlap_nodes_total";
/// Host time spent issuing a step's nodes (histogram).
pub const HOST_ISSUE: &str = "overlap_step_host_issue_seconds";
/// Host time per node by node kind in the last step (gauge).
pub const OP_HOST_ISSUE: &str = "overlap_op_host_issue_seconds";
/// Of that, the part spent inside the backend's launch (gauge).
pub const OP_HOST_LAUNCH: &str = "overlap_op_host_launch_seconds";
/// The learning rate of the last step, per parameter group and optimizer (gauge).
pub const LEARNING_RATE: &str = "overlap_learning_rate";
/// The last step's global L2 gradient norm (gauge; NaN without `[clip]`).
pub const GRAD_NORM: &str = "overlap_grad_norm";
/// Steps whose optimizers did nothing, by reason (counter).
pub const STEPS_SKIPPED: &str = "overlap_steps_skipped_total";
/// Peak parameter bytes of a local rank in the last step's plan (gauge).
pub const PARAM_PEAK: &str = "overlap_param_peak_bytes";
/// Peak gradient-path bytes of a local rank in the last step's plan (gauge).
pub const GRAD_PEAK: &str = "overlap_grad_peak_bytes";
/// Bytes of every parameter once: a full replica's parameters (gauge).
pub const REPLICA_BYTES: &str = "overlap_replica_bytes";

/// Every metric: name, labels, and what it means. The table in docs/observe.md and the
/// descriptions served on `/metrics` come from here.
pub const METRICS: [(&str, &str, &str); 26] = [
    (OP_DURATION, "op, stream", "histogram of kernel durations by node kind (`grad_ready`, `pack`, `stage1`, `fold`, `fold_partial`, `stage2`, `unpack`, `optimizer`, `publish`, ...) and stream, as the backend timed them (CUDA events on GPUs)"),
    (STEPS, "", "steps completed"),
    (STEP_DURATION, "", "histogram of the host wall time of a step: first issue to the device finishing"),
    (STEP_DEVICE, "", "histogram of the device span of a step (first kernel start to last kernel end), mean over local ranks: η's `actual`"),
    (STREAM_BUSY, "stream", "histogram of each stream's busy time in a step (union of its kernel intervals), mean over local ranks"),
    (EXPOSED, "", "histogram of a step's exposed communication: time a communication stream (reduce, replicate, publish, copy) is busy while compute is not, mean over local ranks"),
    (EFFICIENCY, "", "overlap efficiency η = (serial − actual) / (serial − ideal) of the last timed step; NaN when undefined (nothing to hide)"),
    (COLLECTIVE_BYTES, "op, collective", "collective data bytes per member (nccl-tests' size), summed over calls and local ranks"),
    (BUS_BANDWIDTH, "op, collective", "achieved bus bandwidth of the last timed step: bytes × NCCL's bus factor / kernel time, over the step's calls"),
    (PARTIAL_BYTES, "buffer", "peak bytes held at once in the last step by one rank: `partial` (replicate gate off) or `accumulation` (no_sync)"),
    (STAGE2_BYTES, "", "bytes Stage 2 moved, summed over local ranks"),
    (STAGE2_SAVED, "", "bytes Stage 2 did not move thanks to replicate-gate-off micro-batches, summed over local ranks"),
    (MICRO_BATCHES, "gate", "micro-batches run, by gate (`no_sync`, `off`, `on`)"),
    (MICRO_BATCH_GATE, "micro_batch", "the gate of each micro-batch index in the last step: 0 no_sync, 1 off, 2 on"),
    (REJECTIONS, "invariant", "plans the validator rejected, by broken invariant"),
    (NODES, "", "plan nodes issued, summed over local ranks"),
    (HOST_ISSUE, "", "histogram of the host time spent issuing a step's nodes (launches, records, waits), summed over local ranks; divided by the nodes, the host cost per node"),
    (OP_HOST_ISSUE, "op", "host time per node of each node kind in the last step (`exchange`, `stage1`, `combine`, ...): where the host cost per node goes"),
    (OP_HOST_LAUNCH, "op", "of `overlap_op_host_issue_seconds`, the part spent inside the backend's launch (its checks and driver calls: NCCL, copies, kernel launches); the rest is the executor's (events, buffers)"),
    ("overlap_build_info", "version", "always 1; the overlap version"),
    (LEARNING_RATE, "group, optimizer", "the learning rate the last step's optimizers used: base lr × the group's `lr_scale` × the schedule's factor, per parameter group (its `match` pattern, or `base` for the parameters in no group) and optimizer (`adamw`, `muon`)"),
    (GRAD_NORM, "", "the last step's global L2 norm of the reduced gradients over every parameter and rank (`[clip]`), before clipping; NaN when the step does not compute it"),
    (STEPS_SKIPPED, "reason", "steps whose optimizers did nothing (parameters, optimizer state and step counter untouched), by reason: `nonfinite` (NaN or Inf gradients; `[clip] on_nonfinite`, skipped or refused)"),
    (PARAM_PEAK, "rank", "peak parameter bytes of each local rank in the last step's plan, along its serial order: its shards and owned tensors, plus the full parameters `[forward]` gathers"),
    (GRAD_PEAK, "rank", "peak bytes of each local rank's gradient path in the last step's plan, along its serial order (gradients handed in, accumulations, send, Stage-1 and Stage-2 buffers, partials, reduced gradients)"),
    (REPLICA_BYTES, "", "bytes of every parameter once: what a full replica (DDP) holds of parameters, and of gradients, on every rank; the baseline of the two peaks above"),
];

/// The address a rank serves metrics on: `base` for a process that is no rank of a
/// job, else `base`'s port plus the local rank (so the ranks of a node do not collide).
pub fn rank_addr(base: SocketAddr, local_rank: Option<u32>) -> Result<SocketAddr, Error> {
    let Some(k) = local_rank else {
        return Ok(base);
    };
    if base.port() == 0 {
        return Ok(base);
    }
    let port = u32::from(base.port()) + k;
    let port = u16::try_from(port).map_err(|_| {
        Error::Usage(format!(
            "metrics: base port {} plus local rank {k} is past 65535; pick a lower port",
            base.port()
        ))
    })?;
    Ok(SocketAddr::new(base.ip(), port))
}

/// The value of [`MICRO_BATCH_GATE`] for a gate: 0 no_sync, 1 off, 2 on.
pub fn gate_value(gate: Gate) -> f64 {
    match gate {
        Gate::NoSync => 0.0,
        Gate::ReplicateOff => 1.0,
        Gate::On => 2.0,
    }
}

/// Without the `metrics` feature: recording is never on, and these do nothing.
#[cfg(not(feature = "metrics"))]
mod off {
    use overlap_graph::{Plan, Violation};

    use crate::observe::StepAnalysis;
    use crate::session::StepReport;

    /// Whether steps are being recorded: never, without the `metrics` feature.
    pub fn enabled() -> bool {
        false
    }
    /// Nothing to record without the `metrics` feature.
    pub fn record_step(_: &StepReport, _: &Plan, _: impl FnOnce() -> Vec<u32>) {}
    /// Nothing to record without the `metrics` feature.
    pub fn record_analysis(_: &StepReport, _: &StepAnalysis) {}
    /// Nothing to record without the `metrics` feature.
    pub fn record_refused_nonfinite() {}
    /// Nothing to record without the `metrics` feature.
    pub fn record_unflushed() {}
    /// Nothing to record without the `metrics` feature.
    pub fn record_rejection(_: &[Violation]) {}
}
#[cfg(not(feature = "metrics"))]
pub use off::*;
