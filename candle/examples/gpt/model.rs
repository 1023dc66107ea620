//! A small GPT written with candle-nn: token and position embeddings, pre-norm blocks of
//! causal self-attention and an MLP, a final norm and a head (tied to the token
//! embedding or not); trained character-level. Shared by the `gpt` example and the
//! crate's equivalence tests.

#![allow(dead_code)]

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{embedding, linear, Embedding, Linear, VarBuilder, VarMap};

/// The model's shape.
#[derive(Debug, Clone, Copy)]
pub struct GptConfig {
    /// Distinct characters.
    pub vocab: usize,
    /// Longest sequence (positions).
    pub context: usize,
    /// Width of the residual stream.
    pub width: usize,
    /// Attention heads (divides `width`).
    pub heads: usize,
    /// Blocks.
    pub blocks: usize,
    /// Whether the head reuses the token embedding's matrix.
    pub tied: bool,
}

/// Layer norm over the last dimension, written with candle's differentiable primitives
/// (candle-nn's fused layer norm has no backward).
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn new(width: usize, vb: VarBuilder) -> Result<Self> {
        Ok(LayerNorm {
            weight: vb.get_with_hints(width, "weight", candle_nn::Init::Const(1.0))?,
            bias: vb.get_with_hints(width, "bias", candle_nn::Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm_slow(x, &self.weight, &self.bias, 1e-5)
    }
}

struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    out: Linear,
    heads: usize,
}

impl Block {
    fn new(c: &GptConfig, vb: VarBuilder) -> Result<Self> {
        let w = c.width;
        Ok(Block {
            ln1: LayerNorm::new(w, vb.pp("ln1"))?,
            // No bias on the query, key and value projections: a key bias gets no gradient
            // (softmax ignores a shift shared by every key) but rounding noise, which
            // Adam's normalisation turns into full-size steps in any implementation.
            qkv: candle_nn::linear_no_bias(w, 3 * w, vb.pp("attn.qkv"))?,
            proj: linear(w, w, vb.pp("attn.proj"))?,
            ln2: LayerNorm::new(w, vb.pp("ln2"))?,
            fc: linear(w, 4 * w, vb.pp("mlp.fc"))?,
            out: linear(4 * w, w, vb.pp("mlp.proj"))?,
            heads: c.heads,
        })
    }

    fn attention(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let d = c / self.heads;
        let qkv = self.qkv.forward(x)?;
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(D::Minus1, i * c, c)?
                .reshape((b, t, self.heads, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let att = (q.matmul(&k.t()?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?;
        let att = candle_nn::ops::softmax(&att.broadcast_add(mask)?, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        self.proj.forward(&y)
    }

    fn forward(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let x = (x + self.attention(&self.ln1.forward(x)?, mask)?)?;
        let h = self.fc.forward(&self.ln2.forward(&x)?)?.gelu_erf()?;
        x + self.out.forward(&h)?
    }
}

/// The GPT.
pub struct Gpt {
    pub config: GptConfig,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Option<Linear>,
}

/// One rank's micro-batch: token ids `[batch, time]` and the next characters.
pub struct Batch {
    pub tokens: Tensor,
    pub targets: Tensor,
}

impl Gpt {
    /// The model, its parameters in `vb` named `wte`, `wpe`, `blocks.K.…`, `ln_f`,
    /// `lm_head` (absent when tied).
    pub fn new(config: GptConfig, vb: VarBuilder) -> Result<Self> {
        let blocks = (0..config.blocks)
            .map(|k| Block::new(&config, vb.pp(format!("blocks.{k}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt {
            config,
            wte: embedding(config.vocab, config.width, vb.pp("wte"))?,
            wpe: embedding(config.context, config.width, vb.pp("wpe"))?,
            blocks,
            ln_f: LayerNorm::new(config.width, vb.pp("ln_f"))?,
            head: if config.tied {
                None
            } else {
                Some(candle_nn::linear_no_bias(
                    config.width,
                    config.vocab,
                    vb.pp("lm_head"),
                )?)
            },
        })
    }

    fn mask(t: usize, device: &Device) -> Result<Tensor> {
        let m: Vec<f32> = (0..t * t)
            .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
            .collect();
        Tensor::from_vec(m, (t, t), device)
    }

    /// Segment `i` of the forward: 0 the embeddings, `k + 1` block `k`, the last the
    /// head and the loss (mean cross-entropy over the micro-batch's positions).
    pub fn segment(&self, i: usize, x: Option<&Tensor>, batch: &Batch) -> Result<Tensor> {
        let n = self.blocks.len();
        match x {
            None => {
                let (_, t) = batch.tokens.dims2()?;
                let pos = Tensor::arange(0u32, t as u32, batch.tokens.device())?;
                self.wte
                    .forward(&batch.tokens)?
                    .broadcast_add(&self.wpe.forward(&pos)?)
            }
            Some(x) if i <= n => {
                let (_, t, _) = x.dims3()?;
                self.blocks[i - 1].forward(x, &Self::mask(t, x.device())?)
            }
            Some(x) => {
                let h = self.ln_f.forward(x)?;
                let logits = match &self.head {
                    Some(head) => head.forward(&h)?,
                    None => h.broadcast_matmul(&self.wte.embeddings().t()?)?,
                };
                let (b, t, v) = logits.dims3()?;
                candle_nn::loss::cross_entropy(
                    &logits.reshape((b * t, v))?,
                    &batch.targets.reshape(b * t)?,
                )
            }
        }
    }

    /// The whole forward: the loss.
    pub fn loss(&self, batch: &Batch) -> Result<Tensor> {
        let mut x = self.segment(0, None, batch)?;
        for i in 1..self.blocks.len() + 2 {
            x = self.segment(i, Some(&x), batch)?;
        }
        Ok(x)
    }
}

impl overlap_candle::Segmented for Gpt {
    type Input = Batch;

    fn segments(&self) -> usize {
        self.blocks.len() + 2
    }

    fn segment(&self, index: usize, x: Option<&Tensor>, input: &Batch) -> Result<Tensor> {
        Gpt::segment(self, index, x, input)
    }
}

/// A deterministic generator (splitmix64): the same stream on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// A model with seeded initial values (candle's own initialisers draw from an unseeded
/// generator): N(0, 0.02²) for matrices and embeddings, ones for norm weights, zeros for
/// biases; the variables in name order.
pub fn build(config: GptConfig, seed: u64, device: &Device) -> Result<(Gpt, VarMap)> {
    let vars = VarMap::new();
    let model = Gpt::new(config, VarBuilder::from_varmap(&vars, DType::F32, device))?;
    let mut named = overlap_candle::named_vars(&vars);
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rng = Rng::new(seed);
    for (name, var) in named {
        let n = var.elem_count();
        let values: Vec<f32> = if name.ends_with(".bias") {
            vec![0.0; n]
        } else if name.starts_with("ln") || name.contains(".ln") {
            vec![1.0; n]
        } else {
            (0..n).map(|_| (0.02 * rng.normal()) as f32).collect()
        };
        var.set(&Tensor::from_vec(values, var.shape(), device)?)?;
    }
    Ok((model, vars))
}

/// Character-level text: the vocabulary and the text as ids.
pub struct Corpus {
    pub chars: Vec<char>,
    pub ids: Vec<u32>,
}

impl Corpus {
    pub fn new(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = text
            .chars()
            .map(|c| chars.binary_search(&c).unwrap_or(0) as u32)
            .collect();
        Corpus { chars, ids }
    }

    /// `batch` windows of `time` characters and their next characters, at positions
    /// drawn from `seed`.
    pub fn batch(&self, seed: u64, batch: usize, time: usize, device: &Device) -> Result<Batch> {
        let mut rng = Rng::new(seed);
        let span = self.ids.len().saturating_sub(time + 1).max(1);
        let mut tokens = Vec::with_capacity(batch * time);
        let mut targets = Vec::with_capacity(batch * time);
        for _ in 0..batch {
            let start = (rng.next_u64() % span as u64) as usize;
            tokens.extend_from_slice(&self.ids[start..start + time]);
            targets.extend_from_slice(&self.ids[start + 1..start + time + 1]);
        }
        Ok(Batch {
            tokens: Tensor::from_vec(tokens, (batch, time), device)?,
            targets: Tensor::from_vec(targets, (batch, time), device)?,
        })
    }

    /// The data of rank `rank`'s micro-batch `m` in step `step`: its own seed.
    pub fn slice(
        &self,
        step: u64,
        m: usize,
        rank: u32,
        batch: usize,
        time: usize,
        device: &Device,
    ) -> Result<Batch> {
        let seed = step
            .wrapping_mul(1_000_003)
            .wrapping_add(m as u64 * 10_007)
            .wrapping_add(u64::from(rank));
        self.batch(seed, batch, time, device)
    }
}

/// Concatenates micro-batches into one (the global batch of candle alone).
pub fn concat(batches: &[&Batch]) -> Result<Batch> {
    let tokens: Vec<&Tensor> = batches.iter().map(|b| &b.tokens).collect();
    let targets: Vec<&Tensor> = batches.iter().map(|b| &b.targets).collect();
    Ok(Batch {
        tokens: Tensor::cat(&tokens, 0)?,
        targets: Tensor::cat(&targets, 0)?,
    })
}

/// The text the example trains on: a snapshot of the repository's own documentation
/// (`candle/data/corpus.txt`), fixed so that figures and tests do not move when the
/// docs do.
pub const CORPUS: &str = include_str!("../../data/corpus.txt");
