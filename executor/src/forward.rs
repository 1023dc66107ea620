//! Forward plans: the trainer's `forward` and `backward` points, and the full parameters
//! their gathers hand it.
//!
//! A trainer's call names a point of its own work (`forward(layer)`, `backward(layer)`,
//! `grad_ready(layer)`); the executor issues every node of the plan up to that point,
//! so a node between two points is issued when the trainer reaches the later one:
//! after the trainer's work that followed the earlier point. That is what puts a
//! layer's free (its `reshard`, on the trainer's stream) after the trainer's kernels
//! that read the gathered parameters, and its prefetched gathers as early as the plan
//! places them. A forward or backward point then waits, on the host, until the point
//! has executed on its stream (so its gathers have completed: the plan orders them
//! before it) and hands the gathered buffers over.

use overlap_graph::{Buffer, Node, Op, ParamId};
use overlap_ops::Backend;

use crate::{ExecError, Executor};

/// The first point of the trainer's work at or after node `from`.
pub(crate) fn next_point(nodes: &[Node], from: usize) -> Option<usize> {
    (from..nodes.len()).find(|&i| nodes[i].op.is_point())
}

/// A gathered parameter handed to the trainer: rank, parameter, and the buffer of its
/// full values (sharded routes: the parameter's `numel` elements first, then padding).
pub type FullParam<B> = (u32, ParamId, <B as Backend>::Buffer);

impl<B: Backend> Executor<B> {
    /// Forward plans: the trainer's forward of `layer` in `micro_batch` starts. Issues
    /// every node up to the plan's `forward` point of the layer on every local rank
    /// (the frees of the layer before, the gathers `prefetch` layers ahead), waits until
    /// the point has executed, and returns each local rank's gathered parameters of the
    /// layer. A buffer holds its values until the trainer's next call (the layer's free
    /// is issued then, and its memory reused by a later gather): read it, or launch
    /// the work that reads it, before.
    pub async fn forward_ready(
        &mut self,
        micro_batch: u32,
        layer: u32,
    ) -> Result<Vec<FullParam<B>>, ExecError> {
        self.point(micro_batch, Op::Forward { layer }).await
    }

    /// Forward plans: the trainer's backward of `layer` in `micro_batch` starts: as
    /// [`Executor::forward_ready`], up to the layer's `backward` point, with the full
    /// parameters the backward reads (gathered again, or the forward's when they were
    /// kept). They hold their values until the layer's `grad_ready`.
    pub async fn backward_ready(
        &mut self,
        micro_batch: u32,
        layer: u32,
    ) -> Result<Vec<FullParam<B>>, ExecError> {
        self.point(micro_batch, Op::Backward { layer }).await
    }

    async fn point(&mut self, micro_batch: u32, want: Op) -> Result<Vec<FullParam<B>>, ExecError> {
        let ctx = self.ctx()?;
        let backend = self.backend.clone();
        let mut at = Vec::with_capacity(self.ranks.len());
        for r in &self.ranks {
            let p = r.prepared.clone().ok_or_else(|| {
                ExecError::Usage(format!("{} before a micro-batch began", want.kind()))
            })?;
            let nodes = &p.plan.rank(r.rank).nodes;
            if p.plan.forward.is_none() {
                return Err(ExecError::Usage(format!(
                    "{}: the plan gathers no parameters for the forward (a spec without `forward`)",
                    want.kind()
                )));
            }
            let i = next_point(nodes, r.next_node);
            match i.map(|i| &nodes[i]) {
                Some(n) if n.op == want && n.micro_batch == Some(micro_batch) => {}
                other => {
                    let next = other
                        .map(|n| p.plan.label(n))
                        .unwrap_or_else(|| "the end of the plan".into());
                    return Err(ExecError::Usage(format!(
                        "{} L{} of micro-batch {micro_batch} on rank {}: the plan expects {next} next (the forward of every layer ascending, then per layer descending backward and grad_ready)",
                        want.kind(),
                        want.point_layer().unwrap_or(0),
                        r.rank
                    )));
                }
            }
            at.push(i.unwrap_or(0));
        }
        self.issue_until(at.iter().map(|&i| i + 1).collect(), &ctx)
            .await?;
        // Wait until every rank's point has executed: its gathers are complete.
        let mut waits = Vec::with_capacity(self.ranks.len());
        for (r, &i) in self.ranks.iter().zip(&at) {
            let stream = r
                .prepared
                .as_ref()
                .map_or(overlap_graph::Stream::Compute, |p| {
                    p.plan.rank(r.rank).nodes[i].stream
                });
            let ev = backend.event(r.rank);
            backend.record(r.rank, stream, &ev);
            waits.push(ev);
        }
        let deadline = tokio::time::Instant::from_std(ctx.deadline);
        let mut failed = false;
        for ev in &waits {
            match tokio::time::timeout_at(deadline, backend.host_wait(ev)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => failed = true,
                Err(_) => return Err(self.timed_out(&[])),
            }
        }
        if failed {
            return Err(self.fail_step().await);
        }
        let mut out = Vec::new();
        for (r, &i) in self.ranks.iter().zip(&at) {
            let Some(p) = &r.prepared else { continue };
            for b in &p.access[i].reads {
                let Buffer::Full { param, .. } = *b else {
                    continue;
                };
                let buf = r.buffers.get(b).cloned().ok_or_else(|| {
                    ExecError::Internal(format!("rank {}: {b} is not allocated", r.rank))
                })?;
                out.push((r.rank, param, buf));
            }
        }
        Ok(out)
    }

    /// Ends the step after a failure seen while waiting inside it: waits for what was
    /// issued and returns the failures, as a step's end would.
    async fn fail_step(&mut self) -> ExecError {
        let failures = match self.drain().await {
            Ok(f) => f,
            Err(e) => return e,
        };
        self.step_start = None;
        self.backend.reset();
        for r in &mut self.ranks {
            r.end_step(false);
        }
        self.prune_prepared();
        ExecError::Step { failures }
    }
}
