//! Prometheus metrics of every step, through the [`metrics`] facade.
//!
//! One call, [`install_prometheus`], serves `/metrics` on an address and turns recording
//! on; from then on every [`Session::step`](crate::Session::step) records its step and
//! every plan the validator rejects counts. A trainer that installs its own `metrics`
//! recorder calls [`enable`] instead.
//!
//! Names follow Prometheus' conventions (base units, `_total` counters) and labels are
//! low-cardinality (`op`, `stream`, `collective`, `gate`, `buffer`, `invariant`,
//! `micro_batch`, `group`, `optimizer`); the full list with meanings is [`METRICS`]. Per-step figures that are
//! durations are histograms (a dashboard divides the rates of `_sum` and `_count` for the
//! mean per step); the others are gauges holding the last step's value. Quantities over
//! the local ranks are as [`StepAnalysis`] defines them. The figures that need kernel
//! timings (device span, stream busy, exposed communication, η, op durations, bus
//! bandwidth) come from timed steps only (`[metrics] timing_every`), the rest from every
//! step.
//!
//! The invariant it keeps: recording never fails and never panics; with recording off
//! (the default) a step costs one atomic load here.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use overlap_graph::validate::INVARIANTS;
use overlap_graph::{Gate, Plan, Stream, Violation};

use super::StepAnalysis;
use crate::session::StepReport;
use crate::Error;

static ENABLED: AtomicBool = AtomicBool::new(false);

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

/// Every metric: name, labels, and what it means. The README's table and the
/// descriptions served on `/metrics` come from here.
pub const METRICS: [(&str, &str, &str); 21] = [
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
];

/// Serves Prometheus `/metrics` on `addr` and turns recording on: the one call a
/// library user makes. Call it once per process, from inside a Tokio runtime or not (the
/// exporter then runs on a thread of its own).
///
/// ```no_run
/// overlap::observe::metrics::install_prometheus("127.0.0.1:9464".parse().unwrap())?;
/// # Ok::<(), overlap::Error>(())
/// ```
pub fn install_prometheus(addr: SocketAddr) -> Result<(), Error> {
    let fail = |e: &dyn std::fmt::Display| {
        Error::Usage(format!("metrics: cannot serve /metrics on {addr}: {e}"))
    };
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .map_err(|e| fail(&e))?
        .install()
        .map_err(|e| fail(&e))?;
    enable();
    Ok(())
}

/// Turns recording on for a `metrics` recorder the caller installed, describes every
/// metric and creates the labelled counters at zero (so that dashboards show 0, not
/// "no data", for gates not used and invariants never broken).
pub fn enable() {
    describe();
    for gate in [Gate::NoSync, Gate::ReplicateOff, Gate::On] {
        counter!(MICRO_BATCHES, "gate" => gate.label()).increment(0);
    }
    for invariant in INVARIANTS {
        counter!(REJECTIONS, "invariant" => invariant).increment(0);
    }
    counter!(STEPS).increment(0);
    gauge!("overlap_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    ENABLED.store(true, Ordering::Release);
}

/// Whether steps are being recorded.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Acquire)
}

fn describe() {
    describe_histogram!(OP_DURATION, Unit::Seconds, METRICS[0].2);
    describe_counter!(STEPS, Unit::Count, METRICS[1].2);
    describe_histogram!(STEP_DURATION, Unit::Seconds, METRICS[2].2);
    describe_histogram!(STEP_DEVICE, Unit::Seconds, METRICS[3].2);
    describe_histogram!(STREAM_BUSY, Unit::Seconds, METRICS[4].2);
    describe_histogram!(EXPOSED, Unit::Seconds, METRICS[5].2);
    describe_gauge!(EFFICIENCY, Unit::Count, METRICS[6].2);
    describe_counter!(COLLECTIVE_BYTES, Unit::Bytes, METRICS[7].2);
    describe_gauge!(BUS_BANDWIDTH, METRICS[8].2);
    describe_gauge!(PARTIAL_BYTES, Unit::Bytes, METRICS[9].2);
    describe_counter!(STAGE2_BYTES, Unit::Bytes, METRICS[10].2);
    describe_counter!(STAGE2_SAVED, Unit::Bytes, METRICS[11].2);
    describe_counter!(MICRO_BATCHES, Unit::Count, METRICS[12].2);
    describe_gauge!(MICRO_BATCH_GATE, Unit::Count, METRICS[13].2);
    describe_counter!(REJECTIONS, Unit::Count, METRICS[14].2);
    describe_counter!(NODES, Unit::Count, METRICS[15].2);
    describe_histogram!(HOST_ISSUE, Unit::Seconds, METRICS[16].2);
    describe_gauge!(OP_HOST_ISSUE, Unit::Seconds, METRICS[17].2);
    describe_gauge!(OP_HOST_LAUNCH, Unit::Seconds, METRICS[18].2);
    describe_gauge!("overlap_build_info", Unit::Count, METRICS[19].2);
    describe_gauge!(LEARNING_RATE, METRICS[20].2);
}

/// Records a finished step of these local ranks when recording is on
/// ([`Session::step`](crate::Session::step) calls it).
pub fn record_step(report: &StepReport, plan: &Plan, local_ranks: impl FnOnce() -> Vec<u32>) {
    if enabled() {
        record_analysis(
            report,
            &StepAnalysis::on_ranks(report, plan, &local_ranks()),
        );
    }
}

/// Records a step already analysed (whether or not recording is on: the caller decides).
/// An untimed step ([`StepAnalysis::timed`]) leaves the device figures (device span,
/// stream busy, exposed communication, η, op durations, bus bandwidth) as the last timed
/// step left them, and counts everything else.
pub fn record_analysis(report: &StepReport, a: &StepAnalysis) {
    counter!(STEPS).increment(1);
    histogram!(STEP_DURATION).record(report.stats.wall_seconds);
    if a.timed() {
        histogram!(STEP_DEVICE).record(a.span_seconds());
        for s in Stream::ALL {
            histogram!(STREAM_BUSY, "stream" => s.name()).record(a.busy_seconds(s));
        }
        histogram!(EXPOSED).record(a.exposed_seconds());
        gauge!(EFFICIENCY).set(a.efficiency().unwrap_or(f64::NAN));
    }

    // Kernel durations, grouped so that each (op, stream) handle is looked up once.
    let mut durations: HashMap<(&'static str, Stream), Vec<f64>> = HashMap::new();
    for t in &report.stats.timings {
        durations
            .entry((t.tag.op, t.stream))
            .or_default()
            .push((t.end - t.start).max(0.0));
    }
    for ((op, stream), values) in durations {
        let h = histogram!(OP_DURATION, "op" => op, "stream" => stream.name());
        values.into_iter().for_each(|v| h.record(v));
    }

    for c in &a.collectives {
        let labels = [("op", c.op), ("collective", c.kind.name())];
        counter!(COLLECTIVE_BYTES, &labels).increment(c.bytes);
        if let Some(bw) = c.bus_bandwidth() {
            gauge!(BUS_BANDWIDTH, &labels).set(bw);
        }
    }

    gauge!(PARTIAL_BYTES, "buffer" => "partial").set(a.partial_bytes as f64);
    gauge!(PARTIAL_BYTES, "buffer" => "accumulation").set(a.accumulation_bytes as f64);
    counter!(STAGE2_BYTES).increment(report.stage2_bytes);
    counter!(STAGE2_SAVED).increment(report.stage2_bytes_saved);

    for (m, gate) in report.gates.iter().enumerate() {
        counter!(MICRO_BATCHES, "gate" => gate.label()).increment(1);
        gauge!(MICRO_BATCH_GATE, "micro_batch" => m.to_string()).set(gate_value(*gate));
    }
    for rate in &report.lr {
        gauge!(
            LEARNING_RATE,
            "group" => rate.label.clone(),
            "optimizer" => overlap_executor::hyper::optimizer_name(rate.optimizer)
        )
        .set(rate.lr);
    }
    counter!(NODES).increment(report.stats.nodes as u64);
    histogram!(HOST_ISSUE).record(report.stats.issue_seconds.max(0.0));
    for (&(op, seconds, nodes), &(_, inside)) in report
        .stats
        .issue_by_kind
        .iter()
        .zip(&report.stats.launch_by_kind)
    {
        if nodes > 0 {
            gauge!(OP_HOST_ISSUE, "op" => op).set(seconds.max(0.0) / nodes as f64);
            gauge!(OP_HOST_LAUNCH, "op" => op).set(inside.max(0.0) / nodes as f64);
        }
    }
}

/// The value of [`MICRO_BATCH_GATE`] for a gate: 0 no_sync, 1 off, 2 on.
pub fn gate_value(gate: Gate) -> f64 {
    match gate {
        Gate::NoSync => 0.0,
        Gate::ReplicateOff => 1.0,
        Gate::On => 2.0,
    }
}

/// Counts a step refused before validation because its gates leave partials or no_sync
/// accumulations unflushed: the `partials-flushed` invariant the validator would name.
pub fn record_unflushed() {
    counter!(REJECTIONS, "invariant" => "partials-flushed").increment(1);
}

/// Counts a plan the validator rejected, once per broken invariant.
pub fn record_rejection(violations: &[Violation]) {
    let mut seen: Vec<&'static str> = Vec::new();
    for v in violations {
        if !seen.contains(&v.invariant) {
            seen.push(v.invariant);
            counter!(REJECTIONS, "invariant" => v.invariant).increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::tests::cpu_step;
    use overlap_graph::Transport;

    /// The value of the series `series` (name and labels as rendered) in Prometheus text.
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_untimed_step_counts_bytes_and_nodes_and_leaves_the_device_figures() {
        let (timed, plan, local) = cpu_step(&[Gate::ReplicateOff, Gate::On], Transport::Nccl).await;
        let mut untimed = timed.clone();
        untimed.stats.timings.clear();
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let record = |r: &StepReport| {
            ::metrics::with_local_recorder(&recorder, || {
                record_analysis(r, &StepAnalysis::on_ranks(r, &plan, &local))
            })
        };
        let a = StepAnalysis::on_ranks(&timed, &plan, &local);
        let stage1 = a
            .collectives
            .iter()
            .find(|c| c.op == "stage1")
            .expect("a stage-1 collective");
        let bytes = format!(
            "{COLLECTIVE_BYTES}{{op=\"stage1\",collective=\"{}\"}}",
            stage1.kind.name()
        );
        let bandwidth = format!(
            "{BUS_BANDWIDTH}{{op=\"stage1\",collective=\"{}\"}}",
            stage1.kind.name()
        );
        let device = [
            STEP_DEVICE,
            STREAM_BUSY,
            EXPOSED,
            EFFICIENCY,
            OP_DURATION,
            BUS_BANDWIDTH,
        ];

        record(&untimed);
        let text = handle.render();
        assert_eq!(value(&text, STEPS), Some(1.0), "{text}");
        assert_eq!(value(&text, NODES), Some(timed.stats.nodes as f64));
        assert_eq!(value(&text, STAGE2_BYTES), Some(timed.stage2_bytes as f64));
        assert_eq!(value(&text, &bytes), Some(stage1.bytes as f64), "{text}");
        assert_eq!(
            value(&text, &format!("{PARTIAL_BYTES}{{buffer=\"partial\"}}")),
            Some(a.partial_bytes as f64)
        );
        assert!(a.partial_bytes > 0);
        for name in device {
            assert!(
                !text.contains(name),
                "{name} recorded for an untimed step:\n{text}"
            );
        }

        // A timed step records them; the untimed step after it leaves them as they were.
        record(&timed);
        let eta = a
            .efficiency()
            .expect("the example's backward hides communication");
        record(&untimed);
        let text = handle.render();
        assert_eq!(value(&text, STEPS), Some(3.0));
        assert_eq!(value(&text, &bytes), Some(3.0 * stage1.bytes as f64));
        assert_eq!(
            value(&text, &format!("{STEP_DEVICE}_count")),
            Some(1.0),
            "{text}"
        );
        assert_eq!(value(&text, &format!("{EXPOSED}_count")), Some(1.0));
        assert_eq!(value(&text, EFFICIENCY), Some(eta), "{text}");
        assert_eq!(value(&text, &bandwidth), stage1.bus_bandwidth());
        assert_eq!(value(&text, &format!("{STEP_DURATION}_count")), Some(3.0));
    }

    /// The labels of `overlap_validator_rejections_total` are created at zero from
    /// [`INVARIANTS`]; it must list every invariant the validator's docs list.
    #[test]
    fn every_documented_invariant_is_a_rejection_label() {
        let docs = include_str!("../../graph/src/validate/mod.rs");
        let documented: Vec<&str> = docs
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .filter_map(|l| l.strip_prefix("//! - `"))
            .filter_map(|l| l.split('`').next())
            .collect();
        assert!(documented.len() >= 9, "{documented:?}");
        assert_eq!(documented, INVARIANTS.to_vec());
    }

    #[test]
    fn gate_values_order_no_sync_off_on() {
        assert_eq!(gate_value(Gate::NoSync), 0.0);
        assert_eq!(gate_value(Gate::ReplicateOff), 1.0);
        assert_eq!(gate_value(Gate::On), 2.0);
    }

    #[test]
    fn every_metric_is_listed_once_with_a_prometheus_name() {
        let mut names: Vec<&str> = METRICS.iter().map(|m| m.0).collect();
        for n in &names {
            assert!(n.starts_with("overlap_"), "{n}");
            assert!(
                n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{n}"
            );
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), METRICS.len());
    }
}
