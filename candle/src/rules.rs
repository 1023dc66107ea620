//! Which layer and route each parameter of a candle model gets, decided from its name.
//!
//! A candle model names its `Var`s by the path of the `VarBuilder` that made them
//! (`blocks.3.attn.qkv.weight`). [`Rules`] turns those names into the session's
//! parameters: a *layer* (the backward-readiness group: a layer's gradients are handed
//! to the session together, the highest layer first) and a *route* (how the gradient
//! travels and which optimizer consumes it).
//!
//! The invariant this module keeps: every parameter gets exactly one layer and one
//! route, decided by the documented order of rules below and by nothing else (not by
//! the order a `HashMap` yields the names in, not by the shapes except where a rule
//! says so); a name that no rule places is an error naming it.

use overlap::executor::glob_match;
use overlap::Route;

use crate::Error;

/// The layer and route of one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assignment {
    /// The backward-readiness group ([`overlap::ParamSpec::layer`]).
    pub layer: u32,
    /// How its gradient travels and which optimizer consumes it.
    pub route: Route,
}

/// Layers and routes from parameter names.
///
/// **Layers**, for a model that is a stem (embeddings), a stack of `N` blocks and a
/// head (final norm, output projection), tried in this order:
///
/// 1. an explicit [`Rules::layer`] glob that matches the name (the first that does);
/// 2. `{blocks}.K.…` (the [`Rules::blocks`] prefix, default `blocks`, then a block
///    index): layer `K + 1`;
/// 3. a [`Rules::stem`] glob (default `*emb*`, `wte.*`, `wpe.*`): layer 0;
/// 4. a [`Rules::head`] glob (default `ln_f.*`, `norm.*`, `final_norm.*`, `lm_head.*`,
///    `head.*`): layer `N + 1`, `N` being one more than the highest block index of any
///    name;
/// 5. otherwise [`Error::NoRule`], naming the parameter.
///
/// So the layers are the segments of the segmented backward ([`crate::Segmented`]):
/// segment 0 the stem, segment `K + 1` block `K`, segment `N + 1` the head. A weight
/// used by two segments (a head tied to the token embedding) belongs to the lowest of
/// them, where its gradient is complete.
///
/// **Routes**: the first [`Rules::route`] glob that matches; else, with
/// [`Rules::block_matrices`], that route for a 2-D parameter inside a block; else the
/// default route ([`Rules::default_route`], default [`Route::Fsdp`]: each rank updates
/// a dim-0 shard with AdamW, as PyTorch's FSDP2 does).
///
/// Globs match the whole name: `*` any run of characters (dots too), `?` one character.
///
/// ```
/// use overlap::Route;
/// use overlap_candle::Rules;
///
/// let rules = Rules::new().block_matrices(Route::Muon);
/// let names = [
///     ("wte.weight", vec![64, 16]),
///     ("blocks.0.attn.qkv.weight", vec![48, 16]),
///     ("blocks.0.ln1.weight", vec![16]),
///     ("ln_f.weight", vec![16]),
/// ];
/// let a = rules.assign(names.iter().map(|(n, s)| (*n, s.as_slice())))?;
/// assert_eq!((a[0].layer, a[0].route), (0, Route::Fsdp));
/// assert_eq!((a[1].layer, a[1].route), (1, Route::Muon));
/// assert_eq!((a[2].layer, a[2].route), (1, Route::Fsdp));
/// assert_eq!(a[3].layer, 2);
/// # Ok::<(), overlap_candle::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Rules {
    blocks: String,
    stem: Vec<String>,
    head: Vec<String>,
    layers: Vec<(String, u32)>,
    routes: Vec<(String, Route)>,
    block_matrices: Option<Route>,
    default_route: Route,
}

impl Default for Rules {
    fn default() -> Self {
        Rules::new()
    }
}

impl Rules {
    /// The default rules (see the type's documentation).
    pub fn new() -> Self {
        let globs = |g: &[&str]| g.iter().map(|s| s.to_string()).collect();
        Rules {
            blocks: "blocks".into(),
            stem: globs(&["*emb*", "wte.*", "wpe.*"]),
            head: globs(&["ln_f.*", "norm.*", "final_norm.*", "lm_head.*", "head.*"]),
            layers: Vec::new(),
            routes: Vec::new(),
            block_matrices: None,
            default_route: Route::Fsdp,
        }
    }

    /// The prefix of the blocks' names: `h` for `h.3.attn.weight`, `model.layers` for
    /// `model.layers.3.mlp.weight`.
    pub fn blocks(mut self, prefix: impl Into<String>) -> Self {
        self.blocks = prefix.into();
        self
    }

    /// Replaces the stem's globs (layer 0).
    pub fn stem<S: Into<String>>(mut self, globs: impl IntoIterator<Item = S>) -> Self {
        self.stem = globs.into_iter().map(Into::into).collect();
        self
    }

    /// Replaces the head's globs (the layer above the last block).
    pub fn head<S: Into<String>>(mut self, globs: impl IntoIterator<Item = S>) -> Self {
        self.head = globs.into_iter().map(Into::into).collect();
        self
    }

    /// Puts the parameters whose names match `glob` in `layer`, before any other layer
    /// rule.
    pub fn layer(mut self, glob: impl Into<String>, layer: u32) -> Self {
        self.layers.push((glob.into(), layer));
        self
    }

    /// Gives the parameters whose names match `glob` this route, before any other route
    /// rule (the first matching glob wins).
    pub fn route(mut self, glob: impl Into<String>, route: Route) -> Self {
        self.routes.push((glob.into(), route));
        self
    }

    /// Gives every 2-D parameter inside a block this route (after the [`Rules::route`]
    /// globs): [`Route::Muon`] for Muon on the blocks' matrices, AdamW on the rest.
    pub fn block_matrices(mut self, route: Route) -> Self {
        self.block_matrices = Some(route);
        self
    }

    /// The route of a parameter no other route rule decides (default [`Route::Fsdp`]).
    pub fn default_route(mut self, route: Route) -> Self {
        self.default_route = route;
        self
    }

    /// The block index of a name of the form `{blocks}.K.…`.
    fn block_of(&self, name: &str) -> Option<u32> {
        let rest = name.strip_prefix(self.blocks.as_str())?.strip_prefix('.')?;
        let (index, tail) = rest.split_once('.')?;
        if tail.is_empty() || index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        index.parse().ok()
    }

    /// The layer and route of each parameter, in the order given: `params` yields each
    /// parameter's name and shape.
    pub fn assign<'a>(
        &self,
        params: impl IntoIterator<Item = (&'a str, &'a [usize])>,
    ) -> Result<Vec<Assignment>, Error> {
        let params: Vec<(&str, &[usize])> = params.into_iter().collect();
        let blocks = params
            .iter()
            .filter_map(|(n, _)| self.block_of(n))
            .max()
            .map_or(0, |k| k + 1);
        params
            .iter()
            .map(|&(name, shape)| {
                let block = self.block_of(name);
                let any = |globs: &[String]| globs.iter().any(|g| glob_match(g, name));
                let layer =
                    if let Some((_, l)) = self.layers.iter().find(|(g, _)| glob_match(g, name)) {
                        *l
                    } else if let Some(k) = block {
                        k + 1
                    } else if any(&self.stem) {
                        0
                    } else if any(&self.head) {
                        blocks + 1
                    } else {
                        return Err(Error::NoRule {
                            name: name.to_string(),
                            rules: self.describe(),
                        });
                    };
                let route = match self.routes.iter().find(|(g, _)| glob_match(g, name)) {
                    Some((_, r)) => *r,
                    None => match self.block_matrices {
                        Some(r) if block.is_some() && shape.len() == 2 => r,
                        _ => self.default_route,
                    },
                };
                Ok(Assignment { layer, route })
            })
            .collect()
    }

    /// The layer rules in words, for [`Error::NoRule`].
    fn describe(&self) -> String {
        let list = |g: &[String]| {
            g.iter()
                .map(|s| format!("`{s}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let explicit = if self.layers.is_empty() {
            String::new()
        } else {
            let l: Vec<String> = self.layers.iter().map(|(g, _)| g.clone()).collect();
            format!("no explicit layer glob ({}), ", list(&l))
        };
        format!(
            "{explicit}not `{}.K.*` (a block), no stem glob ({}), no head glob ({})",
            self.blocks,
            list(&self.stem),
            list(&self.head)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assign(rules: &Rules, names: &[(&str, &[usize])]) -> Result<Vec<Assignment>, Error> {
        rules.assign(names.iter().copied())
    }

    #[test]
    fn blocks_are_layers_above_the_stem_and_below_the_head() {
        let a = assign(
            &Rules::new(),
            &[
                ("lm_head.weight", &[10, 4]),
                ("blocks.11.mlp.weight", &[4, 4]),
                ("blocks.2.mlp.weight", &[4, 4]),
                ("wpe.weight", &[8, 4]),
            ],
        )
        .unwrap();
        let layers: Vec<u32> = a.iter().map(|a| a.layer).collect();
        assert_eq!(layers, vec![13, 12, 3, 0]);
    }

    #[test]
    fn a_name_no_rule_places_is_an_error_naming_it() {
        let e = assign(&Rules::new(), &[("mystery.weight", &[3])]).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("`mystery.weight`"), "{text}");
        assert!(text.contains("blocks.K"), "{text}");
    }

    #[test]
    fn explicit_layers_and_routes_come_first() {
        let rules = Rules::new()
            .layer("mystery.*", 0)
            .route("blocks.0.special", Route::Adamw)
            .block_matrices(Route::Muon);
        let a = assign(
            &rules,
            &[
                ("mystery.weight", &[3]),
                ("blocks.0.special", &[3, 3]),
                ("blocks.0.proj", &[3, 3]),
                ("blocks.0.bias", &[3]),
            ],
        )
        .unwrap();
        assert_eq!(a[0].layer, 0);
        assert_eq!(a[1].route, Route::Adamw);
        assert_eq!(a[2].route, Route::Muon);
        assert_eq!(a[3].route, Route::Fsdp);
    }

    #[test]
    fn a_block_prefix_needs_an_index_and_a_tail() {
        let rules = Rules::new().blocks("model.layers");
        assert_eq!(rules.block_of("model.layers.7.mlp.w"), Some(7));
        assert_eq!(rules.block_of("model.layers.7"), None);
        assert_eq!(rules.block_of("model.layers.x.w"), None);
        assert_eq!(rules.block_of("model.layersx.7.w"), None);
    }
}
