//! Driving a session with seeded synthetic gradients: what `overlap run` and
//! `overlap verify` do, and what a test or benchmark can reuse.

use overlap_executor::ExecError;
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
    full: impl FnMut(u8, u32, ParamId, &[f32]),
) -> Result<StepReport, Error> {
    drive(session, Grads::Host { seed, step }, gates, full).await
}

/// Where a driven step's gradients come from.
enum Grads<'a, B: Backend> {
    /// Written on the host: [`synthetic::grad`] of this seed and step.
    Host { seed: u64, step: u64 },
    /// Kept on the device.
    Device(&'a DeviceGrads<B>),
}

/// One step: every micro-batch with its gate, the forward's layers first where the plan
/// gathers parameters, every layer's backward point and gradients from the highest
/// layer down, the full parameters handed to `full` (as [`synthetic_step_with`]).
async fn drive<B: Backend>(
    session: &mut Session<B>,
    grads: Grads<'_, B>,
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
            match &grads {
                Grads::Host { seed, step } => {
                    session
                        .grad_ready(layer, |rank, param, out| {
                            synthetic::grad(*seed, *step, m as u32, rank, param, out)
                        })
                        .await?
                }
                // `DeviceGrads::new` made a buffer for every local rank and parameter;
                // one the session would ask for beyond those gets the empty buffer,
                // which the binding's length check turns into an error naming the
                // parameter and rank.
                Grads::Device(g) => {
                    session
                        .grad_ready_device(layer, &[], |rank, param| {
                            g.get(m, rank, param).unwrap_or(&g.empty).clone()
                        })
                        .await?
                }
            }
        }
    }
    session.step().await
}

/// Synthetic gradients that stay on the device, as a trainer whose backward runs on the
/// GPU has them: every local rank's gradient of every parameter, one set per micro-batch
/// of the step, written once ([`synthetic::grad`] of step 0) into buffers of the
/// session's backend. [`device_step`] hands them in where they are, so a step writes
/// and uploads nothing on the host (`[run] grads = "device"`).
pub struct DeviceGrads<B: Backend> {
    /// The local ranks, in the order of each set's rows.
    ranks: Vec<u32>,
    /// Per micro-batch, per local rank, per parameter.
    sets: Vec<Vec<Vec<B::Buffer>>>,
    /// An empty buffer, handed in for a (rank, parameter) that has none.
    empty: B::Buffer,
}

impl<B: Backend> DeviceGrads<B> {
    /// Allocates and fills the gradients of `micro_batches` micro-batches (at least
    /// one) on `session`'s backend, from `seed`.
    pub fn new(session: &Session<B>, seed: u64, micro_batches: usize) -> Result<Self, Error> {
        let backend = session.backend();
        let ranks = session.local_ranks();
        let mut staging = Vec::new();
        let mut sets = Vec::with_capacity(micro_batches.max(1));
        for m in 0..micro_batches.max(1) {
            let mut set = Vec::with_capacity(ranks.len());
            for &rank in &ranks {
                let mut row = Vec::with_capacity(session.params().len());
                for (param, placed) in session.params().iter().enumerate() {
                    let numel = usize::try_from(placed.spec.numel()).map_err(|_| {
                        Error::Usage(format!(
                            "parameter {} is too large for this host",
                            placed.spec.name
                        ))
                    })?;
                    staging.clear();
                    staging.resize(numel, 0.0);
                    synthetic::grad(seed, 0, m as u32, rank, param as ParamId, &mut staging);
                    let buf = backend.alloc_uninit(rank, numel).map_err(ExecError::from)?;
                    backend.upload(&buf, &staging).map_err(ExecError::from)?;
                    row.push(buf);
                }
                set.push(row);
            }
            sets.push(set);
        }
        let empty = backend
            .alloc(ranks.first().copied().unwrap_or(0), 0)
            .map_err(ExecError::from)?;
        Ok(DeviceGrads { ranks, sets, empty })
    }

    /// Rank `rank`'s gradient of `param` in micro-batch `m` (the last set for a later
    /// micro-batch than was made).
    fn get(&self, m: usize, rank: u32, param: ParamId) -> Option<&B::Buffer> {
        let set = self.sets.get(m).or(self.sets.last())?;
        let r = self.ranks.iter().position(|&x| x == rank)?;
        set.get(r)?.get(param as usize)
    }
}

/// Runs one step as [`synthetic_step`] does, handing in `grads`' buffers with
/// [`Session::grad_ready_device`] instead of writing each step's gradients on the host.
pub async fn device_step<B: Backend>(
    session: &mut Session<B>,
    grads: &DeviceGrads<B>,
    gates: &[Gate],
) -> Result<StepReport, Error> {
    drive(session, Grads::Device(grads), gates, |_, _, _, _| {}).await
}

/// The no_sync reference pattern for `m` micro-batches: no_sync for all but the last.
pub fn no_sync_pattern(m: usize) -> Vec<Gate> {
    (0..m)
        .map(|i| if i + 1 == m { Gate::On } else { Gate::NoSync })
        .collect()
}
