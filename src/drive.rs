//! Driving a session with seeded synthetic gradients: what `overlap run` and
//! `overlap verify` do, and what a test or benchmark can reuse.

use overlap_graph::{Gate, ParamId};
use overlap_ops::Backend;

use crate::session::{Session, StepReport};
use crate::{synthetic, Error};

/// Runs one step: every micro-batch with its gate, every layer from the highest down,
/// rank `r`'s gradient of parameter `p` in micro-batch `m` of step `step` being
/// [`synthetic::grad`]`(seed, step, m, r, p)`. With the forward's gathers
/// ([`Session::has_forward`]), each micro-batch first runs the forward of every layer
/// and each layer's backward begins before its gradients go in; a synthetic step reads
/// nothing of the full parameters ([`synthetic_step_with`] looks at them).
pub async fn synthetic_step<B: Backend>(
    session: &mut Session<B>,
    seed: u64,
    step: u64,
    gates: &[Gate],
) -> Result<StepReport, Error> {
    synthetic_step_with(session, seed, step, gates, |_, _, _, _| {}).await
}

/// [`synthetic_step`], handing every full parameter the forward's gathers give the
/// trainer to `full(pass, rank, param, values)` (`pass` 0 for the forward, 1 for the
/// backward).
pub async fn synthetic_step_with<B: Backend>(
    session: &mut Session<B>,
    seed: u64,
    step: u64,
    gates: &[Gate],
    mut full: impl FnMut(u8, u32, ParamId, &[f32]),
) -> Result<StepReport, Error> {
    let forward = session.has_forward();
    for (m, &gate) in gates.iter().enumerate() {
        session.begin_micro_batch(gate).await?;
        if forward {
            for layer in session.forward_layers() {
                session
                    .forward_ready(layer, |r, p, v| full(0, r, p, v))
                    .await?;
            }
        }
        for layer in session.layers() {
            if forward {
                session
                    .backward_ready(layer, |r, p, v| full(1, r, p, v))
                    .await?;
            }
            session
                .grad_ready(layer, |rank, param, out| {
                    synthetic::grad(seed, step, m as u32, rank, param, out)
                })
                .await?;
        }
    }
    session.step().await
}

/// The no_sync reference pattern for `m` micro-batches: no_sync for all but the last.
pub fn no_sync_pattern(m: usize) -> Vec<Gate> {
    (0..m)
        .map(|i| if i + 1 == m { Gate::On } else { Gate::NoSync })
        .collect()
}
