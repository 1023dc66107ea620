//! Owner assignment for the owned routes (`muon`, `adamw`), balanced by optimizer time.
//!
//! Each owned parameter's update costs what [`UpdateRates::seconds`] says: Muon's
//! Newton–Schulz products at a tensor-core rate plus the optimizer's memory traffic at a
//! memory rate. Owners are assigned by longest-processing-time balance over the `S·R`
//! slots: parameters in decreasing cost (ties by index) each go to the shard column with
//! the least load, then to the least-loaded replicate slot of that column. A refinement
//! then moves or swaps single parameters while that lowers the most loaded rank (moves
//! and swaps keep each parameter's column when the mesh has one column per rank, so
//! columns stay balanced first). Every step is deterministic in the parameter list and
//! the rates, so every rank computes the same owners.

use crate::mesh::{Coord, Mesh};
use crate::param::{ParamSpec, Route};

/// Newton–Schulz iterations the cost model assumes (Muon's reference and the default
/// `ns_steps`).
pub const NS_STEPS: u32 = 5;

/// Bytes an AdamW update moves per value: the gradient read (4), the parameter, both
/// moments read and written (24).
pub const ADAMW_BYTES_PER_VALUE: u64 = 28;

/// Bytes a Muon update moves per value outside its Newton–Schulz products: the gradient
/// read, the momentum and the parameter read and written.
pub const MUON_BYTES_PER_VALUE: u64 = 20;

/// The rates that weigh an owned parameter's optimizer update when owners are assigned
/// ([`crate::PlanSpec::with_update_rates`]). The defaults are the H200 figures of the
/// repository's `hardware/h200-nvlink.toml`: a bf16 GEMM at 739 TFLOP/s and copy
/// kernels at 2490 GB/s. Only their ratio matters for the balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct UpdateRates {
    /// Rate of Muon's Newton–Schulz products in the dtype they run in, GFLOP/s.
    pub ns_gflops: u64,
    /// Rate of the optimizer kernels' memory traffic, GB/s.
    pub memory_gbs: u64,
}

impl Default for UpdateRates {
    fn default() -> Self {
        UpdateRates {
            ns_gflops: 739_000,
            memory_gbs: 2_490,
        }
    }
}

impl UpdateRates {
    /// Rates of `ns_gflops` GFLOP/s for Newton–Schulz and `memory_gbs` GB/s for memory
    /// traffic (each at least 1).
    pub fn new(ns_gflops: u64, memory_gbs: u64) -> UpdateRates {
        UpdateRates {
            ns_gflops: ns_gflops.max(1),
            memory_gbs: memory_gbs.max(1),
        }
    }

    /// The same rates with another Newton–Schulz rate, GFLOP/s (at least 1).
    pub fn with_ns_gflops(mut self, ns_gflops: u64) -> UpdateRates {
        self.ns_gflops = ns_gflops.max(1);
        self
    }

    /// The same rates with another memory rate, GB/s (at least 1).
    pub fn with_memory_gbs(mut self, memory_gbs: u64) -> UpdateRates {
        self.memory_gbs = memory_gbs.max(1);
        self
    }

    /// Seconds the update of `p` takes on its owner at these rates: for `muon`, the
    /// Newton–Schulz products ([`ns_flops`], [`NS_STEPS`] iterations) plus
    /// [`MUON_BYTES_PER_VALUE`]; for `adamw`, [`ADAMW_BYTES_PER_VALUE`]. Zero for the
    /// sharded routes, whose update every rank of the shard group shares.
    pub fn seconds(&self, p: &ParamSpec) -> f64 {
        let bytes_per_s = self.memory_gbs.max(1) as f64 * 1e9;
        let values = p.numel() as f64;
        match p.route {
            Route::Muon => {
                let (rows, cols) = p.matrix_dims();
                ns_flops(rows, cols, NS_STEPS) / (self.ns_gflops.max(1) as f64 * 1e9)
                    + values * MUON_BYTES_PER_VALUE as f64 / bytes_per_s
            }
            Route::Adamw => values * ADAMW_BYTES_PER_VALUE as f64 / bytes_per_s,
            Route::Fsdp | Route::ShardedAdamw => 0.0,
        }
    }
}

/// Newton–Schulz's floating-point operations for one `rows × cols` matrix and `steps`
/// iterations: per iteration `X·Xᵀ` and `B·X` (`2m²n` each) and `A·A` (`2m³`), with
/// `m = min(rows, cols)` and `n = max(rows, cols)`.
pub fn ns_flops(rows: u64, cols: u64, steps: u32) -> f64 {
    let (m, n) = (rows.min(cols) as f64, rows.max(cols) as f64);
    f64::from(steps) * (4.0 * m * m * n + 2.0 * m * m * m)
}

/// The owner of every parameter: `Some` for owned routes, `None` for sharded ones.
pub fn assign_owners(mesh: Mesh, params: &[ParamSpec], rates: UpdateRates) -> Vec<Option<Coord>> {
    let cost: Vec<f64> = params.iter().map(|p| rates.seconds(p)).collect();
    let mut order: Vec<usize> = (0..params.len())
        .filter(|&i| params[i].route.is_owned())
        .collect();
    order.sort_by(|&a, &b| cost[b].total_cmp(&cost[a]).then(a.cmp(&b)));
    let (s, r) = (mesh.shard as usize, mesh.replicate as usize);
    let mut column = vec![0.0f64; s];
    let mut slots = Slots::new(s * r);
    let mut slot_of = vec![usize::MAX; params.len()];
    for &i in &order {
        let sc = argmin(&column);
        let rc = argmin(&slots.load[sc * r..(sc + 1) * r]);
        column[sc] += cost[i];
        slots.add(sc * r + rc, i, cost[i]);
        slot_of[i] = sc * r + rc;
    }
    // Within a column moves keep the column loads; across columns only when a column
    // is one slot (a 1-row mesh), where the column is the slot.
    let same_column = |a: usize, b: usize| r == 1 || a / r == b / r;
    slots.refine(&cost, &mut slot_of, same_column);
    let mut owners = vec![None; params.len()];
    for &i in &order {
        let g = slot_of[i];
        owners[i] = Some(Coord {
            shard: (g / r) as u32,
            replicate: (g % r) as u32,
        });
    }
    owners
}

/// The slots' loads and members, for the refinement.
struct Slots {
    load: Vec<f64>,
    members: Vec<Vec<usize>>,
}

/// At most this many improving moves or swaps: each lowers the largest load, so the
/// refinement ends anyway; the cap bounds planning time on huge models.
const MAX_REFINEMENTS: usize = 4096;

impl Slots {
    fn new(n: usize) -> Slots {
        Slots {
            load: vec![0.0; n],
            members: vec![Vec::new(); n],
        }
    }

    fn add(&mut self, slot: usize, i: usize, cost: f64) {
        self.load[slot] += cost;
        self.members[slot].push(i);
    }

    fn remove(&mut self, slot: usize, i: usize, cost: f64) {
        self.load[slot] -= cost;
        self.members[slot].retain(|&m| m != i);
    }

    /// Moves or swaps single parameters out of the most loaded slot while that lowers
    /// the pair's larger load below the current maximum; the first improvement found in
    /// a fixed order is taken, so the result is deterministic.
    fn refine(
        &mut self,
        cost: &[f64],
        slot_of: &mut [usize],
        allowed: impl Fn(usize, usize) -> bool,
    ) {
        for _ in 0..MAX_REFINEMENTS {
            let hi = argmax(&self.load);
            let Some((i, to, j)) = self.improvement(hi, cost, &allowed) else {
                return;
            };
            self.remove(hi, i, cost[i]);
            self.add(to, i, cost[i]);
            slot_of[i] = to;
            if let Some(j) = j {
                self.remove(to, j, cost[j]);
                self.add(hi, j, cost[j]);
                slot_of[j] = hi;
            }
        }
    }

    /// The first move of a parameter `i` of slot `hi` to a slot `to` (or swap with its
    /// parameter `j`) that leaves both slots below `hi`'s load.
    fn improvement(
        &self,
        hi: usize,
        cost: &[f64],
        allowed: &impl Fn(usize, usize) -> bool,
    ) -> Option<(usize, usize, Option<usize>)> {
        let top = self.load[hi];
        // Below this a change is rounding noise: ends the loop on equal loads.
        let eps = top * 1e-9;
        for to in (0..self.load.len()).filter(|&t| t != hi && allowed(hi, t)) {
            for &i in &self.members[hi] {
                if self.load[to] + cost[i] < top - eps {
                    return Some((i, to, None));
                }
                for &j in &self.members[to] {
                    let d = cost[i] - cost[j];
                    if d > eps && self.load[to] + d < top - eps {
                        return Some((i, to, Some(j)));
                    }
                }
            }
        }
        None
    }
}

fn argmin(loads: &[f64]) -> usize {
    let mut best = 0;
    for (i, &l) in loads.iter().enumerate() {
        if l < loads[best] {
            best = i;
        }
    }
    best
}

fn argmax(loads: &[f64]) -> usize {
    let mut best = 0;
    for (i, &l) in loads.iter().enumerate() {
        if l > loads[best] {
            best = i;
        }
    }
    best
}

/// Each rank's optimizer time (seconds at `rates`) under `owners`: the owned
/// parameters' updates on their owners plus each rank's share of the sharded routes
/// (its chunk of every `fsdp` and `sharded_adamw` parameter, at AdamW's bytes), by
/// global rank.
pub fn optimizer_seconds(
    mesh: Mesh,
    params: &[ParamSpec],
    owners: &[Option<Coord>],
    rates: UpdateRates,
) -> Vec<f64> {
    let mut per_rank = vec![0.0f64; mesh.world() as usize];
    let bytes_per_s = rates.memory_gbs.max(1) as f64 * 1e9;
    for (p, owner) in params.iter().zip(owners) {
        match owner {
            Some(o) => per_rank[mesh.rank(*o) as usize] += rates.seconds(p),
            None => {
                let chunk = p.chunk(mesh.shard) as f64;
                let t = chunk * ADAMW_BYTES_PER_VALUE as f64 / bytes_per_s;
                per_rank.iter_mut().for_each(|x| *x += t);
            }
        }
    }
    per_rank
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, shape: &[u64], route: Route) -> ParamSpec {
        ParamSpec::new(name, shape.to_vec(), route, 0)
    }

    /// GPT-2 small: 148 parameters, the block matrices on `muon`, the rest on `adamw`.
    fn gpt2_small() -> Vec<ParamSpec> {
        let mut ps = vec![
            p("wte", &[50257, 768], Route::Adamw),
            p("wpe", &[1024, 768], Route::Adamw),
        ];
        for l in 0..12 {
            for (n, shape, route) in [
                ("ln_1.w", &[768][..], Route::Adamw),
                ("ln_1.b", &[768], Route::Adamw),
                ("attn.c_attn.w", &[768, 2304], Route::Muon),
                ("attn.c_attn.b", &[2304], Route::Adamw),
                ("attn.c_proj.w", &[768, 768], Route::Muon),
                ("attn.c_proj.b", &[768], Route::Adamw),
                ("ln_2.w", &[768], Route::Adamw),
                ("ln_2.b", &[768], Route::Adamw),
                ("mlp.c_fc.w", &[768, 3072], Route::Muon),
                ("mlp.c_fc.b", &[3072], Route::Adamw),
                ("mlp.c_proj.w", &[3072, 768], Route::Muon),
                ("mlp.c_proj.b", &[768], Route::Adamw),
            ] {
                ps.push(p(&format!("h.{l}.{n}"), shape, route));
            }
        }
        ps.push(p("ln_f.w", &[768], Route::Adamw));
        ps.push(p("ln_f.b", &[768], Route::Adamw));
        ps
    }

    /// A LLaMA-7B-like set: 32 blocks of 4096² attention and 4096×11008 MLP matrices on
    /// `muon`, embeddings and norms on `adamw`.
    fn llama_7b() -> Vec<ParamSpec> {
        let mut ps = vec![
            p("embed", &[32000, 4096], Route::Adamw),
            p("head", &[32000, 4096], Route::Adamw),
            p("norm", &[4096], Route::Adamw),
        ];
        for l in 0..32 {
            for (n, shape) in [
                ("q", [4096, 4096]),
                ("k", [4096, 4096]),
                ("v", [4096, 4096]),
                ("o", [4096, 4096]),
                ("gate", [11008, 4096]),
                ("up", [11008, 4096]),
                ("down", [4096, 11008]),
            ] {
                ps.push(p(&format!("l{l}.{n}"), &shape, Route::Muon));
            }
            ps.push(p(&format!("l{l}.attn_norm"), &[4096], Route::Adamw));
            ps.push(p(&format!("l{l}.mlp_norm"), &[4096], Route::Adamw));
        }
        ps
    }

    fn imbalance(mesh: Mesh, ps: &[ParamSpec]) -> f64 {
        let rates = UpdateRates::default();
        let owners = assign_owners(mesh, ps, rates);
        let t = optimizer_seconds(mesh, ps, &owners, rates);
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        t.iter().cloned().fold(0.0, f64::max) / mean
    }

    #[test]
    fn gpt2_small_is_balanced_by_optimizer_time() {
        for (s, r) in [(4, 1), (2, 2), (1, 4), (8, 1)] {
            let ratio = imbalance(Mesh::new(s, r).unwrap(), &gpt2_small());
            // The figures of docs/config.md: `cargo test -p overlap-graph --lib owner -- --nocapture`.
            eprintln!("gpt2-small {s}x{r}: busiest rank over the mean {ratio:.4}");
            assert!(ratio <= 1.10, "{s}x{r}: max/mean {ratio:.3}");
        }
    }

    #[test]
    fn llama_7b_is_balanced_by_optimizer_time() {
        for (s, r) in [(8, 1), (4, 2), (16, 1)] {
            let ratio = imbalance(Mesh::new(s, r).unwrap(), &llama_7b());
            eprintln!("llama-7b-like {s}x{r}: busiest rank over the mean {ratio:.4}");
            assert!(ratio <= 1.10, "{s}x{r}: max/mean {ratio:.3}");
        }
    }

    #[test]
    fn balancing_by_count_of_elements_would_not_be() {
        // The embedding's AdamW is 38.6 M values but cheap beside Newton–Schulz: by
        // element count it would get a rank to itself.
        let ps = gpt2_small();
        let mesh = Mesh::new(4, 1).unwrap();
        let rates = UpdateRates::default();
        let owners = assign_owners(mesh, &ps, rates);
        let wte_rank = owners[0].unwrap();
        let shares_rank_with_muon = ps
            .iter()
            .zip(&owners)
            .any(|(q, o)| q.route == Route::Muon && *o == Some(wte_rank));
        assert!(shares_rank_with_muon);
    }

    #[test]
    fn owners_cover_exactly_the_owned_routes() {
        let mesh = Mesh::new(3, 2).unwrap();
        let mut ps = gpt2_small();
        ps[1].route = Route::Fsdp;
        ps[3].route = Route::ShardedAdamw;
        let o = assign_owners(mesh, &ps, UpdateRates::default());
        for (q, owner) in ps.iter().zip(&o) {
            assert_eq!(q.route.is_owned(), owner.is_some(), "{}", q.name);
            if let Some(c) = owner {
                assert!(c.shard < 3 && c.replicate < 2);
            }
        }
    }

    #[test]
    fn owners_are_deterministic() {
        let mesh = Mesh::new(3, 2).unwrap();
        let ps: Vec<_> = (1..40)
            .map(|n| p(&format!("p{n}"), &[n % 7 + 1, 3], Route::Muon))
            .collect();
        let rates = UpdateRates::new(50_000, 2_000);
        assert_eq!(
            assign_owners(mesh, &ps, rates),
            assign_owners(mesh, &ps, rates)
        );
    }

    #[test]
    fn the_rates_weigh_newton_schulz_against_memory() {
        let muon = p("m", &[768, 768], Route::Muon);
        let adamw = p("a", &[768, 768], Route::Adamw);
        let fast = UpdateRates::default();
        let f32_rate = UpdateRates::new(50_000, 2_490);
        assert!(f32_rate.seconds(&muon) > 10.0 * fast.seconds(&muon));
        assert_eq!(f32_rate.seconds(&adamw), fast.seconds(&adamw));
        assert_eq!(fast.seconds(&p("f", &[768, 768], Route::Fsdp)), 0.0);
        // 5 × (4·768³ + 2·768³) flops.
        assert_eq!(ns_flops(768, 768, 5), 5.0 * 6.0 * 768f64.powi(3));
    }
}
