//! One step as a Gantt picture (SVG, written by hand): a lane per stream of each local
//! rank, a bar per node coloured by its kind, and exposed communication (communication
//! while the compute stream idles) shaded red over the rank's communication lanes and
//! drawn solid on a strip under them.
//!
//! The invariant it keeps: the picture is a pure function of the report, the plan and
//! the analysis; every text from the plan or config is XML-escaped, so any parameter
//! name yields a well-formed SVG.

use std::collections::HashMap;
use std::fmt::Write;

use overlap_graph::{NodeId, Plan, Stream};

use super::{RankAnalysis, StepAnalysis, COMMUNICATION_STREAMS};
use crate::session::StepReport;

const WIDTH: f64 = 1400.0;
const LABEL_W: f64 = 190.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 118.0;
const LANE_H: f64 = 18.0;
const LANE_GAP: f64 = 3.0;
const STRIP_H: f64 = 7.0;
const RANK_GAP: f64 = 12.0;
const RANK_HEADER: f64 = 18.0;
const EXPOSED: &str = "#d62728";

/// Node kinds in legend order, with their colour and legend name.
const KINDS: [(&str, &str, &str); 13] = [
    ("grad_ready", "#4e79a7", "backward (grad_ready)"),
    ("accumulate", "#76b7b2", "accumulate (no_sync)"),
    ("pack", "#edc948", "pack"),
    ("stage1", "#f28e2b", "stage 1"),
    ("fold", "#b07aa1", "fold"),
    ("fold_partial", "#ff9da7", "fold partial"),
    ("stage2", "#59a14f", "stage 2"),
    ("exchange", "#e15759", "exchange (copy engines)"),
    ("combine", "#ffbe7d", "combine"),
    ("gather", "#d37295", "gather (copy engines)"),
    ("unpack", "#9c755f", "unpack"),
    ("optimizer", "#a0cbe8", "optimizer"),
    ("publish", "#79706e", "publish"),
];

fn colour(kind: &str) -> &'static str {
    KINDS
        .iter()
        .find(|k| k.0 == kind)
        .map(|k| k.1)
        .unwrap_or("#bab0ac")
}

/// Escapes text for XML content and attribute values. Control characters, which XML
/// 1.0 forbids even as character references, are first written as `\u{1b}`
/// ([`overlap_graph::export::printable`]).
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in overlap_graph::export::printable(s).chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// A tick step of 1, 2 or 5 times a power of ten giving about `target` ticks over `span`.
fn tick_step(span: f64, target: f64) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / target;
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * p)
}

fn ms(seconds: f64) -> String {
    let v = seconds * 1e3;
    if v.abs() >= 10.0 {
        format!("{v:.1} ms")
    } else if v.abs() >= 1.0 {
        format!("{v:.2} ms")
    } else {
        format!("{:.0} µs", v * 1e3)
    }
}

/// An axis label: milliseconds with as many decimals as the tick step needs.
fn tick_label(t: f64, step: f64) -> String {
    let (v, s) = (t * 1e3, step * 1e3);
    if s >= 1.0 {
        format!("{v:.0} ms")
    } else if s >= 0.1 {
        format!("{v:.1} ms")
    } else if s >= 0.01 {
        format!("{v:.2} ms")
    } else {
        format!("{:.0} µs", v * 1e3)
    }
}

/// Each node's span per `(rank, node)`: its stream, first start and last end over its
/// kernels.
type Spans = HashMap<(u32, NodeId), (Stream, f64, f64)>;

/// Where times and ranks go on the picture.
struct Frame {
    /// The step's first start, seconds.
    t0: f64,
    /// The step's span, seconds (positive).
    span: f64,
    /// The plot's width, right of the lane labels.
    plot_w: f64,
    /// One rank's height: its header, lanes and exposed strip.
    rank_h: f64,
    /// The picture's height.
    height: f64,
}

impl Frame {
    /// The x coordinate of time `t`.
    fn x(&self, t: f64) -> f64 {
        LABEL_W + (t - self.t0) / self.span * self.plot_w
    }

    /// The width of an interval from `start` to `end`, at least a hairline.
    fn width(&self, start: f64, end: f64) -> f64 {
        ((end - start) / self.span * self.plot_w).max(0.8)
    }
}

/// Renders one step. Lanes are the local ranks' streams, in rank order.
pub fn render(report: &StepReport, plan: &Plan, a: &StepAnalysis) -> String {
    let spans = node_spans(report);
    let (t0, t1) = (a.start(), a.end());
    let rank_h = RANK_HEADER + Stream::COUNT as f64 * (LANE_H + LANE_GAP) + STRIP_H + RANK_GAP;
    let f = Frame {
        t0,
        span: if t1 > t0 { t1 - t0 } else { 1e-6 },
        plot_w: WIDTH - LABEL_W - RIGHT,
        rank_h,
        height: TOP + rank_h * a.ranks.len().max(1) as f64 + 10.0,
    };
    let mut s = String::new();
    title(&mut s, report, plan, a, f.height);
    legend(&mut s, report);
    time_axis(&mut s, &f);
    for (i, r) in a.ranks.iter().enumerate() {
        rank_lanes(&mut s, plan, r, TOP + i as f64 * f.rank_h, &f, &spans);
    }
    s.push_str("</svg>\n");
    s
}

/// Each node's span from the report's kernel timings.
fn node_spans(report: &StepReport) -> Spans {
    let mut spans = Spans::new();
    for t in &report.stats.timings {
        let e = spans
            .entry((t.rank, t.tag.node))
            .or_insert((t.stream, t.start, t.end));
        e.1 = e.1.min(t.start);
        e.2 = e.2.max(t.end);
    }
    spans
}

/// The SVG element, its background, and the title and summary lines.
fn title(s: &mut String, report: &StepReport, plan: &Plan, a: &StepAnalysis, height: f64) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>"##
    );
    let gates = overlap_graph::Gate::pattern_label(&report.gates);
    let _ = writeln!(
        s,
        r#"<text x="16" y="26" font-size="17" font-weight="bold">overlap · step {} · mesh {} · gates {}</text>"#,
        report.step,
        plan.mesh,
        escape(&gates)
    );
    let eta = a
        .efficiency()
        .map(|e| format!("{e:.2}"))
        .unwrap_or_else(|| "undefined".into());
    let _ = writeln!(
        s,
        r##"<text x="16" y="48" fill="#333">device span {} · compute {} · communication {} · exposed communication {} · overlap efficiency η {} (mean over {} ranks, {} layers)</text>"##,
        ms(a.span_seconds()),
        ms(a.busy_seconds(Stream::Compute)),
        ms(a.ranks
            .iter()
            .map(|r| r.communication_seconds())
            .sum::<f64>()
            / a.ranks.len().max(1) as f64),
        ms(a.exposed_seconds()),
        eta,
        a.ranks.len(),
        a.layers
    );
}

/// Legend: the kinds present in this step, then exposed communication.
fn legend(s: &mut String, report: &StepReport) {
    let present: Vec<&str> = report.stats.timings.iter().map(|t| t.tag.op).collect();
    let mut lx = 16.0;
    let ly = 66.0;
    for (_, fill, name) in KINDS.iter().filter(|k| present.contains(&k.0)) {
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{ly}" width="12" height="12" fill="{fill}"/><text x="{}" y="{}">{}</text>"#,
            lx + 16.0,
            ly + 10.5,
            escape(name)
        );
        lx += 24.0 + 7.0 * name.chars().count() as f64;
    }
    let _ = writeln!(
        s,
        r#"<rect x="{lx}" y="{ly}" width="12" height="12" fill="{EXPOSED}" fill-opacity="0.35"/><text x="{}" y="{}">exposed communication</text>"#,
        lx + 16.0,
        ly + 10.5
    );
}

/// Time axis and grid.
fn time_axis(s: &mut String, f: &Frame) {
    let step = tick_step(f.span, 10.0);
    let axis_y = TOP - 14.0;
    let _ = writeln!(
        s,
        r##"<line x1="{LABEL_W}" y1="{axis_y}" x2="{}" y2="{axis_y}" stroke="#555"/>"##,
        LABEL_W + f.plot_w
    );
    let mut k = 0.0;
    while k * step <= f.span * 1.0001 {
        let tx = f.x(f.t0 + k * step);
        let _ = writeln!(
            s,
            r##"<line x1="{tx:.1}" y1="{}" x2="{tx:.1}" y2="{}" stroke="#e3e3e3"/><line x1="{tx:.1}" y1="{}" x2="{tx:.1}" y2="{axis_y}" stroke="#555"/><text x="{tx:.1}" y="{}" text-anchor="middle" fill="#333">{}</text>"##,
            axis_y,
            f.height - 10.0,
            axis_y - 4.0,
            axis_y - 7.0,
            tick_label(k * step, step)
        );
        k += 1.0;
    }
}

/// One rank from `header_y` down: its header, a lane per stream, exposed communication
/// and its nodes' bars.
fn rank_lanes(
    s: &mut String,
    plan: &Plan,
    r: &RankAnalysis,
    header_y: f64,
    f: &Frame,
    spans: &Spans,
) {
    let y0 = header_y + RANK_HEADER;
    let lane_y = |st: Stream| y0 + st.index() as f64 * (LANE_H + LANE_GAP);
    let c = plan.mesh.coord(r.rank);
    let _ = writeln!(
        s,
        r#"<text x="12" y="{}" font-weight="bold">rank {} (s={}, r={})</text>"#,
        header_y + RANK_HEADER - 5.0,
        r.rank,
        c.shard,
        c.replicate
    );
    for st in Stream::ALL {
        let ly = lane_y(st);
        let _ = writeln!(
            s,
            r##"<rect x="{LABEL_W}" y="{ly}" width="{}" height="{LANE_H}" fill="#f4f4f4"/><text x="{}" y="{}" text-anchor="end" fill="#333">{}</text>"##,
            f.plot_w,
            LABEL_W - 8.0,
            ly + LANE_H - 5.0,
            super::lane_name(plan, r.rank, st)
        );
    }
    // Exposed communication: shaded over the communication lanes, solid on the strip.
    let comm_top = lane_y(COMMUNICATION_STREAMS[0]);
    let last = Stream::ALL[Stream::COUNT - 1];
    let comm_h = lane_y(last) + LANE_H - comm_top;
    let strip_y = lane_y(last) + LANE_H + LANE_GAP;
    for &(es, ee) in &r.exposed {
        let (ex, ew) = (f.x(es), f.width(es, ee));
        let _ = writeln!(
            s,
            r#"<rect x="{ex:.2}" y="{comm_top}" width="{ew:.2}" height="{comm_h}" fill="{EXPOSED}" fill-opacity="0.16"/><rect x="{ex:.2}" y="{strip_y}" width="{ew:.2}" height="{STRIP_H}" fill="{EXPOSED}"/>"#
        );
    }
    node_bars(s, plan, r.rank, f, spans, &lane_y);
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="end" fill="{EXPOSED}" font-size="10">exposed</text>"##,
        LABEL_W - 8.0,
        strip_y + STRIP_H
    );
}

/// Rank `rank`'s nodes as bars on their streams' lanes (at `lane_y`), in node order.
fn node_bars(
    s: &mut String,
    plan: &Plan,
    rank: u32,
    f: &Frame,
    spans: &Spans,
    lane_y: &dyn Fn(Stream) -> f64,
) {
    let mut nodes: Vec<(&NodeId, &(Stream, f64, f64))> = spans
        .iter()
        .filter(|((r, _), _)| *r == rank)
        .map(|((_, n), v)| (n, v))
        .collect();
    nodes.sort_by_key(|(n, _)| **n);
    let rp = plan.ranks.get(rank as usize);
    for (node, &(st, ns, ne)) in nodes {
        let Some(n) = rp.and_then(|rp| rp.nodes.get(*node as usize)) else {
            continue;
        };
        let (bx, bw) = (f.x(ns), f.width(ns, ne));
        let _ = writeln!(
            s,
            r##"<rect x="{bx:.2}" y="{:.1}" width="{bw:.2}" height="{}" fill="{}" stroke="#ffffff" stroke-width="0.3"><title>{} · {}</title></rect>"##,
            lane_y(st) + 1.0,
            LANE_H - 2.0,
            colour(n.op.kind()),
            escape(&plan.label(n)),
            ms(ne - ns)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_makes_any_name_safe_in_xml() {
        assert_eq!(escape(r#"a<b>&"c'"#), "a&lt;b&gt;&amp;&quot;c&apos;");
        assert_eq!(escape("a\u{1b}[1m\nb\u{7f}"), "a\\u{1b}[1m\\u{a}b\\u{7f}");
    }

    #[test]
    fn ticks_are_one_two_or_five_times_a_power_of_ten() {
        assert_eq!(tick_step(0.01, 10.0), 0.001);
        assert!((tick_step(0.013, 10.0) - 0.002).abs() < 1e-12);
        assert!((tick_step(0.04, 10.0) - 0.005).abs() < 1e-12);
        assert_eq!(tick_step(0.0, 10.0), 1.0);
    }
}
