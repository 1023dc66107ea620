//! Data-parallel training of [candle](https://github.com/huggingface/candle) models with
//! `overlap`: FSDP / HSDP over a mesh of ranks, gradient accumulation with the
//! replicate gate, Muon or AdamW per parameter, clipping, schedules and checkpoints,
//! all through the validated gradient path of an [`overlap::Session`].
//!
//! The front door is [`DataParallel`], built from the model's `VarMap` and the
//! `overlap` config, in the spirit of PyTorch's `fully_shard(model)`:
//!
//! - [`Rules`] give each `Var` its layer and route from its name (`blocks.3.*` is
//!   layer 4; 2-D block matrices may go to Muon);
//! - per micro-batch the trainer hands over each rank's loss
//!   ([`DataParallel::backward`]), or runs a [`Segmented`] model's micro-batch
//!   ([`DataParallel::micro_batch`]) so that each block's reductions start while the
//!   backward of the blocks below still runs;
//! - after [`DataParallel::step`] the `Var`s hold the updated parameters.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, loss, Module, VarBuilder, VarMap};
//! use overlap_candle::DataParallel;
//!
//! # fn main() -> Result<(), overlap_candle::Error> {
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
//! let embed = linear(4, 8, vb.pp("embed"))?;
//! let head = linear(8, 1, vb.pp("head"))?;
//! let mut dp = DataParallel::builder(&vars)
//!     .config_toml("[mesh]\nshard = 2\nreplicate = 1\n[accumulation]\nmicro_batches = 2", "inline")
//!     .cpu()?;
//! for _step in 0..2 {
//!     for _micro_batch in 0..dp.micro_batches() {
//!         dp.begin_micro_batch()?;
//!         let mut losses = Vec::new();
//!         for &rank in dp.local_ranks() {
//!             // This rank's slice of the micro-batch.
//!             let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?.affine(1.0 + rank as f64, 0.0)?;
//!             let y = Tensor::zeros((3, 1), DType::F32, &Device::Cpu)?;
//!             let out = head.forward(&embed.forward(&x)?.relu()?)?;
//!             losses.push((rank, loss::mse(&out, &y)?));
//!         }
//!         dp.backward(&losses)?;
//!     }
//!     let report = dp.step()?; // the Vars now hold the updated parameters
//!     assert!(report.skipped.is_none());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! `docs/candle.md` in the repository is the guide: the rules, the segmented backward,
//! what is copied, memory per rank, and launching on many processes.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod error;
mod parallel;
mod rules;
mod segmented;

pub use error::Error;
pub use parallel::{adamw_from_candle, named_vars, Builder, Copies, DataParallel};
pub use rules::{Assignment, Rules};
pub use segmented::Segmented;

/// The `overlap` library this crate drives (its config, session and reports).
pub use overlap;
