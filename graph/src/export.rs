//! Plan exports for people: a text listing and Graphviz DOT.

use std::borrow::Cow;
use std::fmt::Write;

use crate::dag::dependencies;
use crate::node::{Instr, Stream};
use crate::plan::{Plan, RankProgram};

/// A name as it may be printed: control characters (a newline, an escape sequence that
/// would recolour a terminal) become Rust-style `\u{1b}` escapes; everything else,
/// including non-ASCII text, is kept. Borrowed when there is nothing to escape.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A string as the inside of a DOT double-quoted label: [`printable`], then `\` and `"`
/// escaped, so that no name can end the string or start a DOT escape (`\n`, `\N`, ...).
pub fn dot_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in printable(s).chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out
}

/// A text listing: the tables, then each rank's stream programs.
pub fn to_text(plan: &Plan) -> String {
    let mut s = String::new();
    write_tables(&mut s, plan);
    for rp in &plan.ranks {
        write_programs(&mut s, plan, rp);
    }
    s
}

/// [`to_text`]'s header, then its parameter and bucket tables.
fn write_tables(s: &mut String, plan: &Plan) {
    let _ = writeln!(
        s,
        "plan: mesh {} ({} ranks), gates {}, reduce {:?}/{:?}",
        plan.mesh,
        plan.mesh.world(),
        crate::Gate::pattern_label(&plan.gates),
        plan.reduce.op,
        plan.reduce.dtype
    );
    if let Some(f) = plan.forward {
        let _ = writeln!(
            s,
            "forward: gathers {} layer(s) ahead, {}",
            f.prefetch,
            if f.reshard_after_forward {
                "freed after the forward and gathered again for the backward"
            } else {
                "kept from the forward for the backward"
            }
        );
    }
    let _ = writeln!(s, "params ({}):", plan.params.len());
    for (i, p) in plan.params.iter().enumerate() {
        let owner = p
            .owner
            .map(|o| format!(" owner ({}, {})", o.shard, o.replicate))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "  p{i} {} {:?} {} layer {}{owner}",
            printable(&p.spec.name),
            p.spec.shape,
            p.spec.route,
            p.spec.layer
        );
    }
    let _ = writeln!(s, "buckets ({}):", plan.buckets.len());
    for b in &plan.buckets {
        let _ = writeln!(
            s,
            "  b{} layer {} {} [{}] stage1 {} elems",
            b.id,
            b.layer,
            b.route,
            printable(&plan.bucket_param_names(b.id)),
            plan.stage1_elems(b.id)
        );
    }
}

/// [`to_text`]'s listing of one rank's stream programs.
fn write_programs(s: &mut String, plan: &Plan, rp: &RankProgram) {
    let c = plan.mesh.coord(rp.rank);
    let _ = writeln!(
        s,
        "rank {} (s={}, r={}): {} nodes, {} events",
        rp.rank,
        c.shard,
        c.replicate,
        rp.nodes.len(),
        rp.events
    );
    for sp in &rp.streams {
        let _ = writeln!(s, "  {}:", sp.stream);
        for ins in &sp.instrs {
            match *ins {
                Instr::Run(n) => {
                    let label = plan.label(&rp.nodes[n as usize]);
                    let _ = writeln!(s, "    run    n{n} {}", printable(&label));
                }
                Instr::Record(e) => {
                    let _ = writeln!(s, "    record e{e}");
                }
                Instr::Wait(e) => {
                    let _ = writeln!(s, "    wait   e{e}");
                }
            }
        }
    }
}

/// The memory figures of a plan's ranks ([`Plan::memory`]), for `overlap plan`: per
/// rank the peak parameter bytes (its pieces plus the gathered full parameters) and the
/// peak gradient-path bytes along the serial order, then a full replica's.
pub fn memory_text(plan: &Plan, ranks: &[u32]) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "memory per rank (peak along the serial order, f32 buffers, MiB):"
    );
    for &rank in ranks {
        let m = plan.memory(rank);
        let _ = writeln!(
            s,
            "  rank {rank}: params {:.3} (pieces {:.3} + gathered {:.3}), grads {:.3}",
            mib(m.param_peak_bytes),
            mib(m.shard_bytes),
            mib(m.full_peak_bytes),
            mib(m.grad_peak_bytes)
        );
    }
    let _ = writeln!(
        s,
        "  full replica: params {:.3}, grads {:.3}",
        mib(plan.replica_bytes()),
        mib(plan.replica_bytes())
    );
    s
}

fn color(stream: Stream) -> &'static str {
    match stream {
        Stream::Compute => "#4e79a7",
        Stream::Reduce => "#e15759",
        Stream::Replicate => "#f28e2b",
        Stream::Publish => "#59a14f",
        Stream::Copy => "#b07aa1",
    }
}

/// Graphviz DOT of the ranks' DAGs (`ranks = None` for all): one cluster per rank, one
/// sub-cluster per stream, solid edges for data dependencies, dashed red edges for events.
pub fn to_dot(plan: &Plan, ranks: Option<&[u32]>) -> String {
    let mut s = String::from("digraph plan {\n  rankdir=LR;\n  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10, fillcolor=white];\n");
    for rp in &plan.ranks {
        if ranks.is_some_and(|rs| !rs.contains(&rp.rank)) {
            continue;
        }
        let r = rp.rank;
        let _ = writeln!(s, "  subgraph cluster_rank{r} {{\n    label=\"rank {r}\";");
        for sp in &rp.streams {
            let _ = writeln!(
                s,
                "    subgraph cluster_r{r}_{} {{\n      label=\"{}\"; color=\"{}\";",
                sp.stream,
                sp.stream,
                color(sp.stream)
            );
            for ins in &sp.instrs {
                if let Instr::Run(n) = *ins {
                    let node = &rp.nodes[n as usize];
                    let _ = writeln!(
                        s,
                        "      r{r}n{n} [label=\"{}\", color=\"{}\"];",
                        dot_escape(&plan.label(node)),
                        color(sp.stream)
                    );
                }
            }
            s.push_str("    }\n");
        }
        let g = dependencies(plan, r, &rp.nodes);
        for e in g.raw_edges() {
            let (a, b) = (e.source().index(), e.target().index());
            let cross = rp.nodes[a].stream != rp.nodes[b].stream;
            let style = if cross {
                " [style=dashed, color=\"#b07aa1\"]"
            } else {
                ""
            };
            let _ = writeln!(s, "    r{r}n{a} -> r{r}n{b}{style};");
        }
        s.push_str("  }\n");
    }
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_escapes_control_characters_only() {
        assert!(matches!(printable("blocks.0.qkv"), Cow::Borrowed(_)));
        assert_eq!(printable("a\u{1b}[31m\nb"), "a\\u{1b}[31m\\u{a}b");
        assert_eq!(printable("é<&\"'"), "é<&\"'");
    }

    #[test]
    fn dot_escape_keeps_the_label_one_string() {
        assert_eq!(dot_escape(r#"a"b\n"#), r#"a\"b\\n"#);
        assert_eq!(dot_escape("x\ny"), r"x\\u{a}y");
    }
}
