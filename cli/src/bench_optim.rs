//! `overlap bench-optimizer`: the step's optimizer tail on one GPU, as the executor
//! issues it (one AdamW or Muon kernel per parameter, which the CUDA backend issues as
//! multi-tensor AdamW launches and Newton–Schulz batched by shape), timed with CUDA
//! events on a named set of parameter shapes.
//!
//! Shape sets: `gpt2-small` (148 parameters, 124.4 M values), `llama-1b` (LLaMA-3.2-1B:
//! 146 parameters, 1.24 B values) or a file with one parameter a line, `name d0 [d1]
//! [adamw|muon]` (`#` starts a comment). With `--muon`, every 2-D parameter not marked
//! `adamw` (the built-in sets mark their embeddings) runs Muon, the rest AdamW; without
//! it, everything runs AdamW. `scripts/bench-optimizer.sh` runs it beside the same
//! shapes in PyTorch (`scripts/bench_optimizer.py`).
//!
//! Invariant: the shape sets here and in the PyTorch script are the same lists; the
//! figures are device time between two events on the stream the kernels run on.

use std::path::Path;

use overlap::Error;
use serde::Serialize;

/// One parameter of a shape set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Tensor {
    /// Its name.
    pub name: String,
    /// Its dimensions (one or two).
    pub dims: Vec<usize>,
    /// Whether `--muon` puts it on Muon (a 2-D parameter not marked `adamw`).
    pub muon: bool,
}

impl Tensor {
    fn new(name: impl Into<String>, dims: &[usize], muon: bool) -> Tensor {
        Tensor {
            name: name.into(),
            dims: dims.to_vec(),
            muon: muon && dims.len() == 2,
        }
    }

    /// Its number of values.
    // Called only by `crate::cuda`, which a build without CUDA replaces by `cuda_stub.rs`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

/// The arguments of `overlap bench-optimizer`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchOptimizerArgs {
    /// `gpt2-small`, `llama-1b`, or a file of `name d0 [d1] [adamw|muon]` lines.
    #[arg(long, default_value = "gpt2-small")]
    pub shapes: String,
    /// Put every 2-D block matrix on Muon (the rest stays on AdamW).
    #[arg(long)]
    pub muon: bool,
    /// Newton–Schulz precisions to time with `--muon`, comma-separated.
    #[arg(long, default_value = "bf16,tf32,f32")]
    pub ns_dtype: String,
    /// Also time the tail behind global-norm clipping: the norm of every gradient, the
    /// clip and the guarded updates, with the clip fused into the updates and as a pass
    /// of its own, and the norm alone (AdamW, and with `--muon` the first
    /// `--ns-dtype`).
    #[arg(long)]
    pub clip: bool,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    pub iters: u32,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 3)]
    pub warmup: u32,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// GPT-2 small: token and position embeddings, 12 blocks, the final norm.
fn gpt2_small() -> Vec<Tensor> {
    let d = 768;
    let mut out = vec![
        Tensor::new("wte", &[50257, d], false),
        Tensor::new("wpe", &[1024, d], false),
    ];
    for l in 0..12 {
        let p = |n: &str| format!("h.{l}.{n}");
        out.extend([
            Tensor::new(p("ln_1.weight"), &[d], false),
            Tensor::new(p("ln_1.bias"), &[d], false),
            Tensor::new(p("attn.c_attn.weight"), &[d, 3 * d], true),
            Tensor::new(p("attn.c_attn.bias"), &[3 * d], false),
            Tensor::new(p("attn.c_proj.weight"), &[d, d], true),
            Tensor::new(p("attn.c_proj.bias"), &[d], false),
            Tensor::new(p("ln_2.weight"), &[d], false),
            Tensor::new(p("ln_2.bias"), &[d], false),
            Tensor::new(p("mlp.c_fc.weight"), &[d, 4 * d], true),
            Tensor::new(p("mlp.c_fc.bias"), &[4 * d], false),
            Tensor::new(p("mlp.c_proj.weight"), &[4 * d, d], true),
            Tensor::new(p("mlp.c_proj.bias"), &[d], false),
        ]);
    }
    out.push(Tensor::new("ln_f.weight", &[d], false));
    out.push(Tensor::new("ln_f.bias", &[d], false));
    out
}

/// LLaMA-3.2-1B: tied embedding, 16 blocks (grouped-query attention with 8 KV heads of
/// 64), the final norm.
fn llama_1b() -> Vec<Tensor> {
    let (d, kv, ff) = (2048, 512, 8192);
    let mut out = vec![Tensor::new("embed_tokens", &[128_256, d], false)];
    for l in 0..16 {
        let p = |n: &str| format!("layers.{l}.{n}");
        out.extend([
            Tensor::new(p("input_layernorm"), &[d], false),
            Tensor::new(p("self_attn.q_proj"), &[d, d], true),
            Tensor::new(p("self_attn.k_proj"), &[kv, d], true),
            Tensor::new(p("self_attn.v_proj"), &[kv, d], true),
            Tensor::new(p("self_attn.o_proj"), &[d, d], true),
            Tensor::new(p("post_attention_layernorm"), &[d], false),
            Tensor::new(p("mlp.gate_proj"), &[ff, d], true),
            Tensor::new(p("mlp.up_proj"), &[ff, d], true),
            Tensor::new(p("mlp.down_proj"), &[d, ff], true),
        ]);
    }
    out.push(Tensor::new("norm", &[d], false));
    out
}

/// A shape file's parameters (`name d0 [d1] [adamw|muon]` a line).
fn parse_shapes(text: &str, origin: &str) -> Result<Vec<Tensor>, Error> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| Error::Usage(format!("{origin}:{}: {why}: `{line}`", i + 1));
        let mut words = line.split_whitespace();
        let name = words.next().ok_or_else(|| bad("no name"))?;
        let mut dims = Vec::new();
        let mut muon = true;
        for w in words {
            match w {
                "adamw" => muon = false,
                "muon" => muon = true,
                w => dims.push(
                    w.parse::<usize>()
                        .ok()
                        .filter(|&d| d > 0)
                        .ok_or_else(|| bad("a dimension is not a positive whole number"))?,
                ),
            }
        }
        if dims.is_empty() || dims.len() > 2 {
            return Err(bad("give one or two dimensions"));
        }
        out.push(Tensor::new(name, &dims, muon));
    }
    if out.is_empty() {
        return Err(Error::Usage(format!("{origin}: no parameter")));
    }
    Ok(out)
}

/// The shape set `spec` names.
pub fn shape_set(spec: &str) -> Result<Vec<Tensor>, Error> {
    match spec {
        "gpt2-small" => Ok(gpt2_small()),
        "llama-1b" => Ok(llama_1b()),
        path => {
            let limit = overlap::resources::MAX_CONFIG_BYTES;
            let text =
                overlap::resources::read_text_bounded(Path::new(path), limit).map_err(|e| {
                    Error::Usage(format!(
                    "--shapes: `{path}` is neither gpt2-small, llama-1b nor a readable file: {e}"
                ))
                })?;
            parse_shapes(&text, path)
        }
    }
}

/// Newton–Schulz's floating-point operations for one `rows × cols` matrix and `steps`
/// iterations ([`overlap::graph::owner::ns_flops`], the owner balance's model).
// Called only by `crate::cuda`, which a build without CUDA replaces by `cuda_stub.rs`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn ns_flops(rows: usize, cols: usize, steps: u32) -> f64 {
    overlap::graph::owner::ns_flops(rows as u64, cols as u64, steps)
}

/// One timed tail.
#[derive(Debug, Clone, Serialize)]
pub struct TailRow {
    /// `adamw` (every parameter on AdamW) or `muon-<dtype>` (Muon on the matrices,
    /// AdamW on the rest).
    pub tail: String,
    /// Median time of one step issued alone (synchronised before and after), from an
    /// event recorded before the host issues it: the host's issue time counts where the
    /// device waits for it, ms.
    pub alone_ms: f64,
    /// Median device time of one step issued alone while a spin still occupies the
    /// stream (as a tail is issued during the backward): the host's issue time hidden,
    /// ms.
    pub device_ms: f64,
    /// Device time per step of `iters` steps issued back to back, ms.
    pub back_to_back_ms: f64,
    /// Median host time to issue one step (launch calls and the flush), µs.
    pub host_us: f64,
    /// Median host time to issue one step while the device still runs earlier work
    /// (the covered steps): issuing never waits for the device, so it matches
    /// `host_us`, µs.
    pub host_covered_us: f64,
    /// The memory-bound limit of the AdamW part (28 bytes a value at the copy
    /// bandwidth), ms.
    pub adamw_limit_ms: f64,
    /// Newton–Schulz's TFLOP for the step (0 without Muon).
    pub ns_tflop: f64,
}

/// What `overlap bench-optimizer` measured.
#[derive(Debug, Clone, Serialize)]
pub struct OptimReport {
    /// The shape set.
    pub shapes: String,
    /// The device.
    pub device: String,
    /// Parameters and values.
    pub tensors: usize,
    /// Values in all.
    pub values: usize,
    /// Matrices on Muon (with `--muon`).
    pub muon_matrices: usize,
    /// Device-to-device copy bandwidth (read + write bytes per second), GB/s.
    pub copy_gbps: f64,
    /// Timed and warm-up steps.
    pub iters: u32,
    /// Untimed steps.
    pub warmup: u32,
    /// The tails timed.
    pub rows: Vec<TailRow>,
}

/// The human-readable form.
pub fn render(r: &OptimReport) -> String {
    let mut out = format!(
        "overlap bench-optimizer: {} ({} parameters, {:.1} M values, {} on Muon) on {}; copy {:.0} GB/s; {} steps after {} warm-up\n",
        r.shapes,
        r.tensors,
        r.values as f64 / 1e6,
        r.muon_matrices,
        r.device,
        r.copy_gbps,
        r.iters,
        r.warmup
    );
    out.push_str(
        "tail          alone ms  device ms  back-to-back ms  host us  host us (busy)  AdamW limit ms  NS TFLOP/s (device)\n",
    );
    for row in &r.rows {
        let tflops = if row.ns_tflop > 0.0 {
            format!("{:.0}", row.ns_tflop / (row.device_ms * 1e-3))
        } else {
            "-".into()
        };
        out.push_str(&format!(
            "{:<12} {:>9.3} {:>10.3} {:>16.3} {:>8.1} {:>15.1} {:>15.3} {:>20}\n",
            row.tail,
            row.alone_ms,
            row.device_ms,
            row.back_to_back_ms,
            row.host_us,
            row.host_covered_us,
            row.adamw_limit_ms,
            tflops
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_sets_have_the_models_sizes() {
        let g = gpt2_small();
        assert_eq!(g.len(), 148);
        assert_eq!(g.iter().map(Tensor::numel).sum::<usize>(), 124_439_808);
        assert_eq!(g.iter().filter(|t| t.muon).count(), 48);
        let l = llama_1b();
        assert_eq!(l.len(), 146);
        assert_eq!(l.iter().map(Tensor::numel).sum::<usize>(), 1_235_814_400);
        assert_eq!(l.iter().filter(|t| t.muon).count(), 112);
    }

    #[test]
    fn a_shape_file_names_dims_and_optimizer() {
        let t = parse_shapes("# model\nemb 100 8 adamw\nw 8 8\nb 8\n", "f").unwrap();
        assert_eq!(
            t,
            [
                Tensor::new("emb", &[100, 8], false),
                Tensor::new("w", &[8, 8], true),
                Tensor::new("b", &[8], false),
            ]
        );
        assert!(parse_shapes("w 0 3", "f").is_err());
        assert!(parse_shapes("w 1 2 3", "f").is_err());
        assert!(parse_shapes("# nothing", "f").is_err());
        assert!(shape_set("/no/such/file").is_err());
    }

    #[test]
    fn newton_schulz_flops_count_the_three_products() {
        // 48 GPT-2-small matrices, 5 steps: about 1.52 TFLOP.
        let f: f64 = gpt2_small()
            .iter()
            .filter(|t| t.muon)
            .map(|t| ns_flops(t.dims[0], t.dims[1], 5))
            .sum();
        assert!((f / 1e12 - 1.52).abs() < 0.01, "{f}");
    }
}
