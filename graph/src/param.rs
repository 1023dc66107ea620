//! Parameters, their routes, and where each rank's piece of them lives.
//!
//! A parameter is a name, a shape, a [`Route`] and a backward-readiness `layer`.
//! Parameters come from explicit entries or from [`ModelSpec`], a generator for a
//! transformer-like stack. The shard layout ([`ParamSpec::chunk`], [`ParamSpec::shard_range`])
//! is defined here once, and everything that moves gradients uses it.

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// How a parameter's gradient is reduced and which optimizer consumes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// Reduce-scatter of dim-0 chunks, all-reduce across replicas, AdamW on every shard.
    Fsdp,
    /// Reduce-scatter of a flat chunk padded to `ceil(numel/S)`, all-reduce, AdamW per chunk.
    ShardedAdamw,
    /// Reduce to the owner, Muon on the owner only, broadcast after the step.
    Muon,
    /// Reduce to the owner, AdamW on the owner only, broadcast after the step.
    Adamw,
}

impl Route {
    /// Every route, in a fixed order.
    pub const ALL: [Route; 4] = [Route::Fsdp, Route::ShardedAdamw, Route::Muon, Route::Adamw];

    /// The name used in configs, plans, metrics and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            Route::Fsdp => "fsdp",
            Route::ShardedAdamw => "sharded_adamw",
            Route::Muon => "muon",
            Route::Adamw => "adamw",
        }
    }

    /// Parses a route name; the error lists the valid names.
    pub fn parse(s: &str) -> Result<Route, String> {
        Route::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| {
                format!("unknown route `{s}`; expected one of muon, adamw, sharded_adamw, fsdp")
            })
    }

    /// Whether the gradient is scattered over the shard group (every rank keeps a chunk).
    pub fn is_sharded(self) -> bool {
        matches!(self, Route::Fsdp | Route::ShardedAdamw)
    }

    /// Whether one owner rank runs the optimizer and publishes afterwards.
    pub fn is_owned(self) -> bool {
        !self.is_sharded()
    }
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The most elements a parameter may have (2³² − 1, 16 GiB of f32): element offsets and
/// counts of every node are 32-bit on the wire.
pub const MAX_NUMEL: u64 = u32::MAX as u64;

/// The most transformer blocks [`ModelSpec`] generates (six parameters each, so within
/// [`crate::MAX_PARAMS`]).
pub const MAX_MODEL_LAYERS: u32 = 4096;

/// Identifies a parameter by its index in [`crate::Plan::params`].
pub type ParamId = u32;

/// One parameter as the planner sees it ([`ParamSpec::new`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ParamSpec {
    /// Unique name, e.g. `blocks.3.proj`.
    pub name: String,
    /// Shape; no dimension is zero. Sizes need not divide by the mesh.
    pub shape: Vec<u64>,
    /// How the gradient travels and which optimizer consumes it.
    pub route: Route,
    /// Backward-readiness group: higher layers are ready first.
    pub layer: u32,
}

impl ParamSpec {
    /// A parameter: its unique name, shape, route and backward-readiness layer.
    pub fn new(
        name: impl Into<String>,
        shape: impl Into<Vec<u64>>,
        route: Route,
        layer: u32,
    ) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.into(),
            route,
            layer,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Elements per shard chunk on a shard group of `s` ranks: dim-0 rows for `fsdp`
    /// (`ceil(dim0/S)` rows), a flat `ceil(numel/S)` for `sharded_adamw`, the whole
    /// tensor for owned routes.
    pub fn chunk(&self, s: u32) -> u64 {
        let s = u64::from(s);
        match self.route {
            Route::Fsdp => {
                let dim0 = self.shape[0];
                let row = self.numel() / dim0;
                dim0.div_ceil(s) * row
            }
            Route::ShardedAdamw => self.numel().div_ceil(s),
            Route::Muon | Route::Adamw => self.numel(),
        }
    }

    /// The element range of the full tensor held by shard index `index` of a sharded
    /// route (empty when the padding swallows it). Owned routes hold everything.
    pub fn shard_range(&self, shards: u32, index: u32) -> std::ops::Range<u64> {
        if self.route.is_owned() {
            return 0..self.numel();
        }
        let c = self.chunk(shards);
        let lo = (c * u64::from(index)).min(self.numel());
        let hi = (lo + c).min(self.numel());
        lo..hi
    }

    /// Rows and columns of the matrix Muon orthogonalises: `shape[0]` by the rest.
    pub fn matrix_dims(&self) -> (u64, u64) {
        let rows = self.shape[0];
        (rows, self.numel() / rows)
    }

    /// Checks the shape and route against what the planner needs.
    pub fn check(&self) -> Result<(), PlanError> {
        let bad = |reason: String| PlanError::Param {
            name: self.name.clone(),
            reason,
        };
        if self.name.is_empty() {
            return Err(bad("the name is empty".into()));
        }
        if self.shape.is_empty() {
            return Err(bad("the shape is empty; a scalar is shape [1]".into()));
        }
        if let Some(i) = self.shape.iter().position(|&d| d == 0) {
            return Err(bad(format!(
                "dimension {i} of shape {:?} is zero",
                self.shape
            )));
        }
        let numel = self.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        match numel {
            Some(n) if n <= MAX_NUMEL => {}
            Some(n) => {
                return Err(bad(format!(
                    "shape {:?} has {n} elements, more than the limit of {MAX_NUMEL} (2^32 - 1) per parameter",
                    self.shape
                )))
            }
            None => {
                return Err(bad(format!(
                    "shape {:?} has more elements than 64 bits can count; the limit is {MAX_NUMEL} (2^32 - 1) per parameter",
                    self.shape
                )))
            }
        }
        if self.route == Route::Muon && self.shape.len() < 2 {
            return Err(bad(format!(
                "route muon needs a matrix (2 or more dimensions), got shape {:?}",
                self.shape
            )));
        }
        Ok(())
    }
}

/// A transformer-like stack: embeddings and head are `sharded_adamw`, the block matrices
/// `muon`, the norms `fsdp` ([`ModelSpec::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ModelSpec {
    /// Number of transformer blocks.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u64,
    /// Vocabulary size.
    pub vocab: u64,
}

impl ModelSpec {
    /// A stack of `layers` transformer blocks of hidden size `hidden` over a vocabulary
    /// of `vocab` tokens.
    pub fn new(layers: u32, hidden: u64, vocab: u64) -> ModelSpec {
        ModelSpec {
            layers,
            hidden,
            vocab,
        }
    }

    /// The generated parameters. Layer numbers follow backward order: the head is the
    /// highest layer (`layers + 1`), the embedding layer 0, block `i` layer `i + 1`.
    ///
    /// Call [`ModelSpec::check`] first: it bounds the number of parameters this makes
    /// (`6 × layers + 3`). Sizes that overflow saturate, so that [`ParamSpec::check`]
    /// rejects them rather than the arithmetic panicking.
    pub fn params(&self) -> Vec<ParamSpec> {
        let h = self.hidden;
        let p = |name: String, shape: Vec<u64>, route, layer| ParamSpec {
            name,
            shape,
            route,
            layer,
        };
        let mut out = vec![p(
            "embed".into(),
            vec![self.vocab, h],
            Route::ShardedAdamw,
            0,
        )];
        for i in 0..self.layers {
            let l = i + 1;
            out.push(p(format!("blocks.{i}.attn_norm"), vec![h], Route::Fsdp, l));
            out.push(p(
                format!("blocks.{i}.qkv"),
                vec![h.saturating_mul(3), h],
                Route::Muon,
                l,
            ));
            out.push(p(format!("blocks.{i}.proj"), vec![h, h], Route::Muon, l));
            out.push(p(format!("blocks.{i}.mlp_norm"), vec![h], Route::Fsdp, l));
            out.push(p(
                format!("blocks.{i}.fc1"),
                vec![h.saturating_mul(4), h],
                Route::Muon,
                l,
            ));
            out.push(p(
                format!("blocks.{i}.fc2"),
                vec![h, h.saturating_mul(4)],
                Route::Muon,
                l,
            ));
        }
        out.push(p(
            "final_norm".into(),
            vec![h],
            Route::Fsdp,
            self.layers.saturating_add(1),
        ));
        out.push(p(
            "head".into(),
            vec![self.vocab, h],
            Route::ShardedAdamw,
            self.layers.saturating_add(1),
        ));
        out
    }

    /// Rejects a zero-sized model, more than [`MAX_MODEL_LAYERS`] blocks, and sizes whose
    /// largest generated parameter (`fc1`'s `4h × h`, or `V × h`) would pass
    /// [`MAX_NUMEL`] elements.
    pub fn check(&self) -> Result<(), PlanError> {
        match self.fault() {
            Some((_, reason)) => Err(PlanError::Model(reason)),
            None => Ok(()),
        }
    }

    /// The key at fault (`layers`, `hidden` or `vocab`) and why, or `None` for a usable
    /// model; [`ModelSpec::check`] in a form that lets a caller point at the key.
    pub fn fault(&self) -> Option<(&'static str, String)> {
        for (key, v) in [
            ("layers", u64::from(self.layers)),
            ("hidden", self.hidden),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Some((key, format!("`{key}` must be at least 1")));
            }
        }
        if self.layers > MAX_MODEL_LAYERS {
            return Some((
                "layers",
                format!(
                    "`layers` is {}, more than the limit of {MAX_MODEL_LAYERS} blocks",
                    self.layers
                ),
            ));
        }
        let h = self.hidden;
        let block = h.checked_mul(4).and_then(|x| x.checked_mul(h));
        if block.map_or(true, |n| n > MAX_NUMEL) {
            return Some((
                "hidden",
                format!(
                    "`hidden` = {h} makes blocks.*.fc1 a [{}, {h}] matrix, more than the limit of {MAX_NUMEL} (2^32 - 1) elements per parameter",
                    h.saturating_mul(4)
                ),
            ));
        }
        let v = self.vocab;
        if v.checked_mul(h).map_or(true, |n| n > MAX_NUMEL) {
            return Some((
                "vocab",
                format!(
                    "`vocab` = {v} with `hidden` = {h} makes `embed` and `head` [{v}, {h}] matrices, more than the limit of {MAX_NUMEL} (2^32 - 1) elements per parameter"
                ),
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(shape: Vec<u64>, route: Route) -> ParamSpec {
        ParamSpec {
            name: "p".into(),
            shape,
            route,
            layer: 0,
        }
    }

    #[test]
    fn fsdp_chunks_whole_rows_padded() {
        let p = spec(vec![5, 3], Route::Fsdp);
        assert_eq!(p.chunk(2), 9); // ceil(5/2)=3 rows of 3
        assert_eq!(p.shard_range(2, 0), 0..9);
        assert_eq!(p.shard_range(2, 1), 9..15);
    }

    #[test]
    fn sharded_adamw_chunks_flat_padded() {
        let p = spec(vec![7], Route::ShardedAdamw);
        assert_eq!(p.chunk(4), 2);
        assert_eq!(p.shard_range(4, 3), 6..7);
        let tiny = spec(vec![2], Route::ShardedAdamw);
        assert_eq!(tiny.shard_range(4, 3), 2..2);
    }

    #[test]
    fn muon_needs_a_matrix_and_zero_dims_are_rejected() {
        assert!(spec(vec![4], Route::Muon).check().is_err());
        assert!(spec(vec![4, 0], Route::Adamw).check().is_err());
        assert!(spec(vec![4, 2], Route::Muon).check().is_ok());
    }

    #[test]
    fn oversized_shapes_and_models_are_rejected_without_overflow() {
        let e = spec(vec![u64::MAX, u64::MAX], Route::Fsdp)
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("limit is 4294967295"), "{e}");
        let e = spec(vec![65536, 65536], Route::Fsdp).check().unwrap_err();
        assert!(e.to_string().contains("4294967296 elements"), "{e}");
        assert!(spec(vec![65535, 65537], Route::Fsdp).check().is_ok());
        let m = |layers, hidden, vocab| ModelSpec {
            layers,
            hidden,
            vocab,
        };
        assert_eq!(m(u32::MAX, 8, 8).fault().unwrap().0, "layers");
        assert_eq!(m(2, u64::MAX, 8).fault().unwrap().0, "hidden");
        assert_eq!(m(2, 32768, 8).fault().unwrap().0, "hidden");
        assert_eq!(m(2, 8, u64::MAX).fault().unwrap().0, "vocab");
        assert!(m(MAX_MODEL_LAYERS, 32767, 131_000).check().is_ok());
        // Unchecked, the generator saturates instead of overflowing.
        let ps = m(1, u64::MAX, 8).params();
        assert!(ps.iter().any(|p| p.check().is_err()));
    }

    #[test]
    fn model_generator_routes_by_kind() {
        let ps = ModelSpec {
            layers: 2,
            hidden: 8,
            vocab: 32,
        }
        .params();
        assert_eq!(ps.len(), 2 + 2 * 6 + 1);
        assert!(ps.iter().any(|p| p.route == Route::Muon));
        assert_eq!(ps.last().unwrap().layer, 3);
    }
}
