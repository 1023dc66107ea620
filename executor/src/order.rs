//! The order the executor issues a rank's instructions in: the plan's issue order
//! ([`issue_order`](overlap_graph::order::issue_order)) with the waits and records that
//! order nothing a kernel can observe taken out.
//!
//! A wait costs little on its own, but on the CUDA backend a wait for (or a record
//! behind) a stream that holds the optimizer tail makes that stream flush what it holds
//! (`ops/src/cuda/defer.rs`): on a mesh without replicas the norm's all-reduces and the
//! publishes are no-op nodes (a collective over a group of one, `bind.rs`), and their
//! waits alone cut the tail into two flushes and cost a wait per publish. [`thin`]
//! rewrites the order in three passes:
//!
//! 1. **Waits forwarded through no-op nodes.** A no-op node launches nothing, so what
//!    its waits order on its stream is only what follows there: its waits are moved to
//!    the next instruction of a node that does work on that stream (or to the end of the
//!    step), and a wait for an event it records becomes a wait for the events it waited
//!    for (themselves forwarded).
//! 2. **A row's records merged.** The executor records a row's events at one point,
//!    after all its kernels (`prepared.rs`, "Runs"), so they are one event: each wait for
//!    one of them waits for the row's last record instead, and the others are not made.
//!    Only events recorded once, and waited for only after the row, are merged.
//! 3. **Redundant waits dropped.** A wait whose event's record is already ordered before
//!    the waiting stream's position (a wait for its own stream, a repeated wait, a wait
//!    another wait implies) is dropped.
//!
//! Pass 1 drops one thing a plan's order did say: a wait for a no-op node's record also
//! waited for everything its stream ran before it. So the result is checked against
//! the plan's own order with vector clocks over the runs of nodes that do work: before
//! each such node runs, and at the end of each stream, at least everything that the
//! plan's order made complete by then must be (a node's own stream position included).
//! Where the check fails, the plan's order is used unchanged. No-op nodes' own positions
//! are not kept: they read and write nothing.
//!
//! Invariant: every node's instructions stay contiguous, on its stream, in node order
//! (the executor issues them by node, [`group`]); every run is kept, in the same order
//! per stream.

use rustc_hash::FxHashMap as HashMap;

use overlap_graph::{EventId, Instr, Stream};

/// Per stream: how many runs of nodes that do work on each stream are known complete.
type Clock = [u32; Stream::COUNT];

/// A rank's instructions: on which stream, what.
pub(crate) type Issue = Vec<(Stream, Instr)>;

/// Per node: one past its last instruction in `issue` (its run and trailing records).
pub(crate) fn issue_ends(nodes: usize, issue: &[(Stream, Instr)]) -> Vec<usize> {
    let mut issue_end = vec![0; nodes];
    let mut i = 0;
    while i < issue.len() {
        if let Instr::Run(n) = issue[i].1 {
            let mut j = i + 1;
            while matches!(issue.get(j), Some((_, Instr::Record(_)))) {
                j += 1;
            }
            issue_end[n as usize] = j;
            i = j;
        } else {
            i += 1;
        }
    }
    issue_end
}

/// The slice of the issue order that issues node `n`, from every node's end in it.
pub(crate) fn group(issue_end: &[usize], n: usize) -> std::ops::Range<usize> {
    let start = if n == 0 { 0 } else { issue_end[n - 1] };
    start..issue_end[n]
}

/// `issue` thinned (module docs), or `issue` itself where the result would order less.
/// `streams[n]`: node `n`'s stream; `noop[n]`: node `n` launches nothing and touches no
/// memory. `rows` gives, from an order and its ends, each node's row end (`prepared.rs`,
/// "Runs").
pub(crate) fn thin(
    streams: &[Stream],
    noop: &[bool],
    issue: Issue,
    rows: impl Fn(&[(Stream, Instr)], &[usize]) -> Vec<usize>,
) -> Issue {
    let forwarded = forward(streams, noop, &issue);
    let ends = issue_ends(streams.len(), &forwarded);
    let merged = merge_rows(&forwarded, &ends, &rows(&forwarded, &ends));
    let lean = drop_redundant(noop, &merged);
    if keeps_order(streams.len(), noop, &issue, &lean) {
        lean
    } else {
        issue
    }
}

/// Whether a node's instructions `g` are waits, its run, then records, all on its
/// `stream`.
pub(crate) fn plain(g: &[(Stream, Instr)], stream: Stream) -> bool {
    let mut seen_run = false;
    g.iter().all(|&(s, ins)| {
        s == stream
            && match ins {
                Instr::Wait(_) => !seen_run,
                Instr::Run(_) => !std::mem::replace(&mut seen_run, true),
                Instr::Record(_) => seen_run,
            }
    })
}

/// Pass 1: waits forwarded through no-op nodes.
fn forward(streams: &[Stream], noop: &[bool], issue: &[(Stream, Instr)]) -> Issue {
    let ends = issue_ends(streams.len(), issue);
    // Per event recorded by a forwarded node: the events a wait for it stands for.
    let mut stands_for: HashMap<EventId, Vec<EventId>> = HashMap::default();
    // Per stream: the forwarded waits not issued yet.
    let mut pending: [Vec<EventId>; Stream::COUNT] = Default::default();
    let mut out = Vec::with_capacity(issue.len());
    let resolve = |stands_for: &HashMap<EventId, Vec<EventId>>, e: EventId| {
        stands_for.get(&e).cloned().unwrap_or_else(|| vec![e])
    };
    // Issues an instruction of a node that does work, after the waits owed to its stream;
    // an event it records stands for itself again.
    let emit = |out: &mut Issue,
                pending: &mut [Vec<EventId>; Stream::COUNT],
                stands_for: &mut HashMap<EventId, Vec<EventId>>,
                (s, ins): (Stream, Instr)| {
        out.extend(
            std::mem::take(&mut pending[s.index()])
                .into_iter()
                .map(|a| (s, Instr::Wait(a))),
        );
        match ins {
            Instr::Wait(e) => out.extend(
                resolve(stands_for, e)
                    .into_iter()
                    .map(|a| (s, Instr::Wait(a))),
            ),
            Instr::Record(e) => {
                stands_for.remove(&e);
                out.push((s, ins));
            }
            Instr::Run(_) => out.push((s, ins)),
        }
    };
    for (n, &stream) in streams.iter().enumerate() {
        let g = &issue[group(&ends, n)];
        if !(noop[n] && plain(g, stream)) {
            for &i in g {
                emit(&mut out, &mut pending, &mut stands_for, i);
            }
            continue;
        }
        let owed = &mut pending[stream.index()];
        for &(_, ins) in g {
            match ins {
                Instr::Wait(e) => {
                    for a in resolve(&stands_for, e) {
                        if !owed.contains(&a) {
                            owed.push(a);
                        }
                    }
                }
                Instr::Run(_) => out.push((stream, ins)),
                Instr::Record(e) => {
                    stands_for.insert(e, owed.clone());
                }
            }
        }
    }
    let trailing = ends.last().copied().unwrap_or(0);
    for &i in &issue[trailing..] {
        emit(&mut out, &mut pending, &mut stands_for, i);
    }
    for s in Stream::ALL {
        let owed = std::mem::take(&mut pending[s.index()]);
        out.extend(owed.into_iter().map(|a| (s, Instr::Wait(a))));
    }
    out
}

/// Pass 2: each row's records merged into its last one.
fn merge_rows(issue: &[(Stream, Instr)], ends: &[usize], runs: &[usize]) -> Issue {
    let mut records: HashMap<EventId, usize> = HashMap::default();
    let mut first_wait: HashMap<EventId, usize> = HashMap::default();
    for (i, &(_, ins)) in issue.iter().enumerate() {
        match ins {
            Instr::Record(e) => *records.entry(e).or_default() += 1,
            Instr::Wait(e) => {
                first_wait.entry(e).or_insert(i);
            }
            Instr::Run(_) => {}
        }
    }
    let mut into: HashMap<EventId, EventId> = HashMap::default();
    let mut n = 0;
    while n < runs.len() {
        let end = runs[n];
        if end > n + 1 {
            let row: Vec<(usize, EventId)> = (group(ends, n).start..ends[end - 1])
                .filter_map(|i| match issue[i].1 {
                    Instr::Record(e) => Some((i, e)),
                    _ => None,
                })
                .collect();
            if let Some(&(at, last)) = row.last() {
                for &(_, e) in &row[..row.len() - 1] {
                    let after = first_wait.get(&e).map_or(true, |&w| w > at);
                    if records[&e] == 1 && records[&last] == 1 && after {
                        into.insert(e, last);
                    }
                }
            }
        }
        n = end.max(n + 1);
    }
    issue
        .iter()
        .filter_map(|&(s, ins)| match ins {
            Instr::Record(e) if into.contains_key(&e) => None,
            Instr::Wait(e) => Some((s, Instr::Wait(into.get(&e).copied().unwrap_or(e)))),
            _ => Some((s, ins)),
        })
        .collect()
}

/// Pass 3: waits already implied by the waiting stream's position dropped.
fn drop_redundant(noop: &[bool], issue: &[(Stream, Instr)]) -> Issue {
    let mut walk = Walk::default();
    issue
        .iter()
        .copied()
        .filter(|&i| walk.step(noop, i) != Step::Implied)
        .collect()
}

/// What [`Walk::step`] found.
#[derive(PartialEq)]
enum Step {
    /// A node ran: what is known complete as it runs.
    Ran(Clock),
    /// A wait whose event's record the stream already knows complete.
    Implied,
    Other,
}

/// Vector clocks along an issue order: per stream, how many runs of nodes that do work
/// on each stream are known complete; per event, what its latest record knew. A wait
/// before any record of its event orders nothing.
#[derive(Default)]
struct Walk {
    cur: [Clock; Stream::COUNT],
    recorded: HashMap<EventId, Clock>,
}

impl Walk {
    /// Applies one instruction.
    fn step(&mut self, noop: &[bool], (s, ins): (Stream, Instr)) -> Step {
        let cur = &mut self.cur[s.index()];
        match ins {
            Instr::Run(n) => {
                if !noop[n as usize] {
                    cur[s.index()] += 1;
                }
                Step::Ran(*cur)
            }
            Instr::Record(e) => {
                self.recorded.insert(e, *cur);
                Step::Other
            }
            Instr::Wait(e) => match self.recorded.get(&e) {
                Some(c) if dominates(cur, c) => Step::Implied,
                Some(c) => {
                    for (x, y) in cur.iter_mut().zip(c) {
                        *x = (*x).max(*y);
                    }
                    Step::Other
                }
                None => Step::Other,
            },
        }
    }
}

/// Whether `a` knows at least everything `b` does.
fn dominates(a: &Clock, b: &Clock) -> bool {
    a.iter().zip(b).all(|(x, y)| x >= y)
}

/// Per node: what is known complete when it runs; and per stream what is known
/// complete at its end ([`Walk`]).
fn clocks(
    nodes: usize,
    noop: &[bool],
    issue: &[(Stream, Instr)],
) -> (Vec<Clock>, [Clock; Stream::COUNT]) {
    let mut walk = Walk::default();
    let mut at = vec![Clock::default(); nodes];
    for &i in issue {
        if let (Instr::Run(n), Step::Ran(c)) = (i.1, walk.step(noop, i)) {
            at[n as usize] = c;
        }
    }
    (at, walk.cur)
}

/// Whether `new` runs every node, in the same order per stream, and orders at least what
/// `old` does before every node that does work and at every stream's end.
fn keeps_order(
    nodes: usize,
    noop: &[bool],
    old: &[(Stream, Instr)],
    new: &[(Stream, Instr)],
) -> bool {
    let runs = |issue: &[(Stream, Instr)]| {
        let mut per: [Vec<u32>; Stream::COUNT] = Default::default();
        for &(s, ins) in issue {
            if let Instr::Run(n) = ins {
                per[s.index()].push(n);
            }
        }
        per
    };
    if runs(old) != runs(new) {
        return false;
    }
    let (old_at, old_end) = clocks(nodes, noop, old);
    let (new_at, new_end) = clocks(nodes, noop, new);
    let nodes_kept = (0..nodes).all(|n| noop[n] || dominates(&new_at[n], &old_at[n]));
    let ends_kept = old_end.iter().zip(&new_end).all(|(o, n)| dominates(n, o));
    nodes_kept && ends_kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use Instr::{Record as Rec, Run, Wait};
    use Stream::{Compute as C, Publish as P, Reduce as R, Replicate as X};

    /// No rows.
    fn single(_: &[(Stream, Instr)], ends: &[usize]) -> Vec<usize> {
        (1..=ends.len()).collect()
    }

    #[test]
    fn a_no_ops_waits_move_to_the_end_and_a_wait_for_it_to_what_it_waited_for() {
        // n0 (compute) → n1 (no-op, reduce) → n2 (no-op, replicate) → n3 (compute).
        let streams = [C, R, X, C];
        let noop = [false, true, true, false];
        let issue = vec![
            (C, Run(0)),
            (C, Rec(0)),
            (R, Wait(0)),
            (R, Run(1)),
            (R, Rec(1)),
            (X, Wait(1)),
            (X, Run(2)),
            (X, Rec(2)),
            (C, Wait(2)),
            (C, Run(3)),
        ];
        let thinned = thin(&streams, &noop, issue, single);
        // n3's wait stands for n0's record, on its own stream: dropped. The no-ops'
        // waits are owed at the end of the step.
        let want = vec![
            (C, Run(0)),
            (C, Rec(0)),
            (R, Run(1)),
            (X, Run(2)),
            (C, Run(3)),
            (R, Wait(0)),
            (X, Wait(0)),
        ];
        assert_eq!(thinned, want);
    }

    #[test]
    fn a_forwarded_wait_goes_before_the_next_node_that_does_work_on_its_stream() {
        let streams = [C, R, R];
        let noop = [false, true, false];
        let issue = vec![
            (C, Run(0)),
            (C, Rec(0)),
            (R, Wait(0)),
            (R, Run(1)),
            (R, Run(2)),
        ];
        let thinned = thin(&streams, &noop, issue, single);
        let want = vec![
            (C, Run(0)),
            (C, Rec(0)),
            (R, Run(1)),
            (R, Wait(0)),
            (R, Run(2)),
        ];
        assert_eq!(thinned, want);
    }

    #[test]
    fn an_event_recorded_again_by_a_node_that_does_work_stands_for_itself() {
        // e0 is recorded by the no-op n1, then again by n2: n3's wait is for n2's record.
        let streams = [C, R, X, P];
        let noop = [false, true, false, false];
        let issue = vec![
            (C, Run(0)),
            (C, Rec(1)),
            (R, Wait(1)),
            (R, Run(1)),
            (R, Rec(0)),
            (X, Run(2)),
            (X, Rec(0)),
            (P, Wait(0)),
            (P, Run(3)),
        ];
        let thinned = thin(&streams, &noop, issue.clone(), single);
        assert_ne!(thinned, issue, "the no-op's wait moves to the end");
        assert!(thinned.contains(&(P, Wait(0))), "{thinned:?}");
        assert!(!thinned.contains(&(P, Wait(1))), "{thinned:?}");
    }

    #[test]
    fn the_plans_order_stays_where_a_no_op_stood_for_its_streams_earlier_work() {
        // n2 needs n0 (reduce) only through the no-op n1's record: forwarding would drop
        // that, so nothing is thinned.
        let streams = [R, R, C];
        let noop = [false, true, false];
        let issue = vec![
            (R, Run(0)),
            (R, Run(1)),
            (R, Rec(0)),
            (C, Wait(0)),
            (C, Run(2)),
        ];
        assert_eq!(thin(&streams, &noop, issue.clone(), single), issue);
    }

    #[test]
    fn a_rows_records_become_its_last_and_repeated_waits_go() {
        // A row of three on compute, each recording an event a publish waits for.
        let streams = [C, C, C, P, P, P];
        let noop = [false; 6];
        let mut issue = Vec::new();
        for n in 0..3 {
            issue.extend([(C, Run(n)), (C, Rec(n))]);
        }
        for n in 3..6 {
            issue.extend([(P, Wait(n - 3)), (P, Run(n))]);
        }
        let rows = |_: &[(Stream, Instr)], ends: &[usize]| {
            let mut r: Vec<usize> = (1..=ends.len()).collect();
            r[..3].fill(3);
            r
        };
        let want = vec![
            (C, Run(0)),
            (C, Run(1)),
            (C, Run(2)),
            (C, Rec(2)),
            (P, Wait(2)),
            (P, Run(3)),
            (P, Run(4)),
            (P, Run(5)),
        ];
        assert_eq!(thin(&streams, &noop, issue, rows), want);
    }

    #[test]
    fn an_event_waited_for_before_its_row_is_not_merged() {
        // Node 0's wait for e1 comes before e1's record (it orders nothing this step,
        // but names the event): e1 keeps its own record.
        let issue = vec![
            (P, Wait(1)),
            (P, Run(0)),
            (C, Run(1)),
            (C, Rec(1)),
            (C, Run(2)),
            (C, Rec(2)),
            (P, Wait(2)),
            (P, Run(3)),
        ];
        let ends = issue_ends(4, &issue);
        assert_eq!(merge_rows(&issue, &ends, &[1, 3, 3, 4]), issue);
    }
}
