//! `overlap run`'s closing table: the host's issue time by node kind, per step, and the
//! step's tail (the global norm, the clip, the optimizers, the publishes and the step's
//! end) summed.
//!
//! Each step's [`overlap::executor::StepStats::issue_by_kind`] is kept; the table shows
//! the median over the steady steps (the first two are left out when the run has more
//! than three: the first prepares its plans, the second captures the CUDA backend's
//! tail graphs), so one slow step does not move it.

/// The node kinds of a step's tail, after the last gradient is reduced, and
/// [`STEP_END`].
pub(crate) const TAIL_KINDS: [&str; 6] = [
    "grad_norm",
    "norm_reduce",
    "clip",
    "optimizer",
    "publish",
    STEP_END,
];

/// The table's line for the instructions after the step's last node
/// ([`overlap::executor::StepStats::trailing_seconds`]): where the executor puts the
/// waits of no-op nodes, and so where the CUDA backend flushes the held tail.
pub(crate) const STEP_END: &str = "step_end";

use crate::tune::median;

/// One step's host figures by kind: (kind, seconds, nodes, seconds inside the
/// backend's launch).
type StepKinds = Vec<(&'static str, f64, usize, f64)>;

/// Every step's host figures by kind, for the closing table.
#[derive(Default)]
pub(crate) struct HostKinds {
    steps: Vec<StepKinds>,
}

impl HostKinds {
    /// Keeps a step's figures.
    pub(crate) fn add(&mut self, stats: &overlap::executor::StepStats) {
        let launch = |kind: &str| {
            stats
                .launch_by_kind
                .iter()
                .find(|l| l.0 == kind)
                .map_or(0.0, |l| l.1)
        };
        let mut kinds: StepKinds = stats
            .issue_by_kind
            .iter()
            .map(|&(kind, secs, nodes)| (kind, secs, nodes, launch(kind)))
            .collect();
        if stats.trailing_seconds > 0.0 {
            kinds.push((STEP_END, stats.trailing_seconds, 0, 0.0));
        }
        self.steps.push(kinds);
    }

    /// The steps the table summarises: all but the first two when there are more than
    /// three, else all.
    fn steady(&self) -> (&[StepKinds], usize) {
        let skip = if self.steps.len() > 3 { 2 } else { 0 };
        (&self.steps[skip..], skip)
    }

    /// The closing table: a line per kind (nodes per step, median µs per step, µs per
    /// node, of it µs per node inside the backend), then the tail's kinds summed. Empty
    /// when no step ran.
    pub(crate) fn table(&self) -> Vec<String> {
        let (steps, skip) = self.steady();
        if steps.is_empty() {
            return Vec::new();
        }
        let mut kinds: Vec<&'static str> = Vec::new();
        for s in steps {
            for k in s {
                if !kinds.contains(&k.0) {
                    kinds.push(k.0);
                }
            }
        }
        let first = skip + 1;
        let last = skip + steps.len();
        let mut lines = vec![
            format!("host issue time by node kind, median of steps {first}-{last} of this run:"),
            format!(
                "  {:<12} {:>7} {:>10} {:>9} {:>11}",
                "kind", "nodes", "us/step", "us/node", "in backend"
            ),
        ];
        for kind in kinds {
            lines.push(row(kind, steps, |k| k == kind));
        }
        if steps
            .iter()
            .any(|s| s.iter().any(|k| TAIL_KINDS.contains(&k.0)))
        {
            lines.push(row("tail", steps, |k| TAIL_KINDS.contains(&k)));
            lines.push(format!("  (tail: {})", TAIL_KINDS.join(", ")));
        }
        lines
    }
}

/// The table's line for the kinds `pick` selects, summed within each step.
fn row(name: &str, steps: &[StepKinds], pick: impl Fn(&str) -> bool) -> String {
    let sums: Vec<(f64, usize, f64)> = steps
        .iter()
        .map(|s| {
            s.iter()
                .filter(|k| pick(k.0))
                .fold((0.0, 0, 0.0), |a, k| (a.0 + k.1, a.1 + k.2, a.2 + k.3))
        })
        .collect();
    // `steps` is never empty here (`HostKinds::table`).
    let secs = median(&sums.iter().map(|s| s.0).collect::<Vec<_>>());
    let inside = median(&sums.iter().map(|s| s.2).collect::<Vec<_>>());
    let nodes = sums.iter().map(|s| s.1).max().unwrap_or(0);
    let per = |x: f64| {
        if nodes == 0 {
            0.0
        } else {
            x * 1e6 / nodes as f64
        }
    };
    format!(
        "  {name:<12} {nodes:>7} {:>10.1} {:>9.2} {:>11.2}",
        secs * 1e6,
        per(secs),
        per(inside)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use overlap::executor::StepStats;

    fn step(optimizer_us: f64, publish_us: f64) -> StepStats {
        StepStats {
            issue_by_kind: vec![
                ("grad_ready", 10e-6, 2),
                ("optimizer", optimizer_us * 1e-6, 4),
                ("publish", publish_us * 1e-6, 4),
            ],
            launch_by_kind: vec![("optimizer", optimizer_us * 0.5e-6)],
            trailing_seconds: 2e-6,
            ..StepStats::default()
        }
    }

    #[test]
    fn the_table_is_the_median_of_the_steady_steps_with_the_tail_summed() {
        let mut h = HostKinds::default();
        // The first two steps (planning, capture) are left out; the median ignores
        // the one slow steady step.
        for (o, p) in [
            (900.0, 900.0),
            (500.0, 500.0),
            (40.0, 8.0),
            (44.0, 8.0),
            (400.0, 8.0),
        ] {
            h.add(&step(o, p));
        }
        let t = h.table();
        assert!(t[0].contains("median of steps 3-5"), "{t:?}");
        let line = |name: &str| {
            t.iter()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap_or_else(|| panic!("no {name} in {t:?}"))
                .split_whitespace()
                .skip(1)
                .map(|x| x.parse::<f64>().unwrap())
                .collect::<Vec<f64>>()
        };
        assert_eq!(line("optimizer"), vec![4.0, 44.0, 11.0, 5.5]);
        assert_eq!(line("publish"), vec![4.0, 8.0, 2.0, 0.0]);
        assert_eq!(line("step_end"), vec![0.0, 2.0, 0.0, 0.0]);
        // The tail's median is of the per-step sums (50, 54, 410).
        assert_eq!(line("tail"), vec![8.0, 54.0, 6.75, 2.75]);
        assert_eq!(line("grad_ready"), vec![2.0, 10.0, 5.0, 0.0]);
    }

    #[test]
    fn a_short_run_keeps_every_step_and_no_run_prints_nothing() {
        assert!(HostKinds::default().table().is_empty());
        let mut h = HostKinds::default();
        h.add(&step(40.0, 8.0));
        h.add(&step(60.0, 8.0));
        let t = h.table();
        assert!(t[0].contains("steps 1-2"), "{t:?}");
    }
}
