//! The segmented backward: reductions that overlap the backward, without autograd hooks.
//!
//! candle computes a backward all at once (`loss.backward()` returns every gradient
//! together): there is no hook that fires when one layer's gradients are ready, which
//! is what PyTorch's FSDP uses to start a layer's reduce-scatter while the backward of
//! the layers below still runs. A model that is a stack of segments (a stem, blocks, a
//! head) gets the same effect here by running its backward one segment at a time:
//!
//! - forward: segment `i` reads a copy of segment `i − 1`'s output made a `Var` of its
//!   own (so the graph is cut there and the copy's gradient exists);
//! - backward, from the last segment down: segment `i`'s backward starts from
//!   `sum(out_i · g_i)` (`g_i` the gradient that reached its output from above; the
//!   loss itself for the last segment); it yields the gradients of segment `i`'s
//!   parameters and of its input, `g_{i−1}`; the parameters of layer `i` go to the
//!   session at once, so their reductions run while segment `i − 1`'s backward runs.
//!
//! The gradients are those of the whole backward (the chain rule, cut at the segment
//! boundaries), up to float rounding: the same products summed in another grouping.
//!
//! The invariant it keeps: a parameter's gradient is handed in only once every segment
//! that uses it has run its backward: a parameter used by a segment below its layer (a
//! head tied to the embedding, but placed in the head's layer) is an error naming it,
//! never a gradient handed in short.

use std::collections::HashMap;

use candle_core::{Tensor, Var};
use overlap::{Backend, ParamId};

use crate::{DataParallel, Error};

/// A model whose forward is a chain of segments: segment 0 reads the input and nothing
/// else (the embeddings), segment `i > 0` reads segment `i − 1`'s output (and may read
/// the input: the targets, a mask), and the last returns the scalar loss.
///
/// With the default [`crate::Rules`], segment `i` is layer `i`: 0 the stem, `K + 1`
/// block `K`, the last the head.
///
/// ```
/// use candle_core::{Result, Tensor};
/// use candle_nn::{Linear, Module};
///
/// struct Stack { embed: Linear, blocks: Vec<Linear>, head: Linear }
///
/// impl overlap_candle::Segmented for Stack {
///     type Input = (Tensor, Tensor); // (features, targets)
///     fn segments(&self) -> usize {
///         self.blocks.len() + 2
///     }
///     fn segment(&self, i: usize, x: Option<&Tensor>, input: &Self::Input) -> Result<Tensor> {
///         match (i, x) {
///             (0, _) => self.embed.forward(&input.0),
///             (i, Some(x)) if i <= self.blocks.len() => self.blocks[i - 1].forward(x)?.relu(),
///             (_, Some(x)) => candle_nn::loss::mse(&self.head.forward(x)?, &input.1),
///             (_, None) => unreachable!("segments above 0 get the segment below's output"),
///         }
///     }
/// }
/// ```
pub trait Segmented {
    /// What one rank's micro-batch is: token ids and targets, features and labels.
    type Input: ?Sized;

    /// How many segments the forward has.
    fn segments(&self) -> usize;

    /// Segment `index`'s forward: `x` is `None` for segment 0 and the output of segment
    /// `index − 1` otherwise. The last segment returns the loss (a scalar), the mean over
    /// the micro-batch's samples.
    fn segment(
        &self,
        index: usize,
        x: Option<&Tensor>,
        input: &Self::Input,
    ) -> candle_core::Result<Tensor>;
}

/// One rank's forward: each segment's input (`None` for segment 0) and output.
struct Pass {
    inputs: Vec<Option<Var>>,
    outputs: Vec<Tensor>,
}

impl<B: Backend> DataParallel<B> {
    /// Runs one micro-batch of a segmented model on every local rank (`inputs` holds each
    /// local rank's data once) and hands its gradients to the session layer by layer
    /// during the backward (module docs). With `[forward]`, each layer's parameters are
    /// gathered into its `Var`s before its segment's forward. The loss is divided by the
    /// micro-batches per step before the backward, so the step's gradient is the mean
    /// over its micro-batches. Returns each local rank's loss, undivided.
    pub fn micro_batch<M: Segmented>(
        &mut self,
        model: &M,
        inputs: &[(u32, &M::Input)],
    ) -> Result<Vec<(u32, f32)>, Error> {
        let segments = model.segments();
        if let Some(p) = self.params.iter().find(|p| p.layer as usize >= segments) {
            return Err(Error::Param {
                name: p.name.clone(),
                reason: format!(
                    "in layer {}, but the model has {segments} segments (layers 0 to {}): check the rules or the model's segments()",
                    p.layer,
                    segments.saturating_sub(1)
                ),
            });
        }
        let order = self.rank_order(inputs.iter().map(|(r, _)| *r), "micro_batch")?;
        let m = self.begin("micro_batch")?;
        let result = self.run_segments(model, inputs, &order, m);
        if result.is_err() {
            // A failed micro-batch leaves the step unusable: drop it, so the next call
            // starts clean (the error is what the trainer sees).
            let _ = self.zero_grad();
        }
        result
    }

    fn run_segments<M: Segmented>(
        &mut self,
        model: &M,
        inputs: &[(u32, &M::Input)],
        order: &[usize],
        m: usize,
    ) -> Result<Vec<(u32, f32)>, Error> {
        let segments = model.segments();
        let is_layer = |s: usize| self.layers.iter().position(|(l, _)| *l as usize == s);
        let layer_index: Vec<Option<usize>> = (0..segments).map(is_layer).collect();
        // Forward, segment by segment on every rank.
        let mut passes: Vec<Pass> = order
            .iter()
            .map(|_| Pass {
                inputs: Vec::with_capacity(segments),
                outputs: Vec::with_capacity(segments),
            })
            .collect();
        for (s, layer) in layer_index.iter().enumerate() {
            if self.session.has_forward() && layer.is_some() {
                self.gather_into_vars(s as u32)?;
            }
            for (ri, pass) in passes.iter_mut().enumerate() {
                let input = inputs[order[ri]].1;
                let x = match pass.outputs.last() {
                    Some(prev) => {
                        self.step_copies.activations += 1;
                        Some(Var::from_tensor(&prev.detach())?)
                    }
                    None => None,
                };
                let out = model.segment(s, x.as_ref().map(Var::as_tensor), input)?;
                pass.inputs.push(x);
                pass.outputs.push(out);
            }
        }
        let losses = passes
            .iter()
            .zip(order)
            .map(|(p, &i)| {
                let loss = p.outputs.last().ok_or_else(|| {
                    Error::Usage("micro_batch: the model has no segments".into())
                })?;
                if loss.elem_count() != 1 {
                    return Err(Error::Usage(format!(
                        "micro_batch: the last segment returned a tensor of shape {:?}; it must return the loss, a scalar",
                        loss.dims()
                    )));
                }
                Ok((inputs[i].0, loss.flatten_all()?.to_vec1::<f32>()?[0]))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        self.backward_segments(passes, &layer_index, m)?;
        self.close_micro_batch();
        Ok(losses)
    }

    /// The backward, from the last segment down, handing each layer in as soon as its
    /// segment's backward has run on every rank.
    fn backward_segments(
        &mut self,
        mut passes: Vec<Pass>,
        layer_index: &[Option<usize>],
        m: usize,
    ) -> Result<(), Error> {
        let segments = layer_index.len();
        let scale = 1.0 / self.micro_batches() as f64;
        let mut upstream: Vec<Option<Tensor>> = vec![None; passes.len()];
        let mut pending: Vec<HashMap<ParamId, Tensor>> = vec![HashMap::new(); passes.len()];
        for s in (0..segments).rev() {
            if let Some(i) = layer_index[s] {
                self.backward_point(self.layers[i].0)?;
            }
            for (ri, pass) in passes.iter_mut().enumerate() {
                let out = pass.outputs.pop().ok_or_else(|| {
                    Error::Usage("internal: a segment's output is missing".into())
                })?;
                let root = match upstream[ri].take() {
                    None => out.affine(scale, 0.0)?,
                    Some(g) => (out * g.detach())?.sum_all()?,
                };
                let store = root.backward()?;
                if let Some(Some(x)) = pass.inputs.pop() {
                    upstream[ri] = Some(match store.get(x.as_tensor()) {
                        Some(g) => g.clone(),
                        None => x.as_tensor().zeros_like()?,
                    });
                }
                for (id, p) in self.params.iter().enumerate() {
                    let Some(g) = store.get(p.var.as_tensor()) else {
                        continue;
                    };
                    if p.layer as usize > s {
                        return Err(Error::Param {
                            name: p.name.clone(),
                            reason: format!(
                                "used by segment {s}, below its layer {}: its gradients were handed in before segment {s}'s backward; place it in layer {s} or lower (Rules::layer)",
                                p.layer
                            ),
                        });
                    }
                    let id = id as ParamId;
                    let sum = match pending[ri].remove(&id) {
                        Some(acc) => (acc + g)?,
                        None => g.clone(),
                    };
                    pending[ri].insert(id, sum);
                }
            }
            if let Some(i) = layer_index[s] {
                self.hand_layer(m, i, |ri, id| pending[ri].remove(&id))?;
            }
        }
        Ok(())
    }
}
