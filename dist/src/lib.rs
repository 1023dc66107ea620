//! The control plane of multi-process `overlap` jobs: everything that only a job of one
//! process per rank needs, and an embedder that trains in one process never builds.
//!
//! - [`env`](mod@env): this process's place in the job, from the launcher's variables
//!   (`overlap launch` and torchrun, Slurm, Open MPI);
//! - [`rendezvous`]: rank 0's TCP rendezvous, authenticated with the job's secret
//!   (HMAC-SHA256 challenge-response), its framing, and the job watch that turns a
//!   peer's failure into every rank's stop;
//! - [`fingerprint`]: what a rank will run, compared across ranks before the first step;
//! - [`cpu`](mod@cpu): the CPU backend as one process per rank (its links between the
//!   processes, authenticated with the job's secret) and `verify --backend cpu`'s
//!   comparison in such a job;
//! - `cuda` (the `cuda` feature): the CUDA world (open the GPU, meet the other ranks,
//!   create the NCCL communicators or the copy transport's links) and `verify --backend
//!   cuda`'s comparison of each GPU with the exact reference.
//!
//! Its errors are the library's ([`overlap::Error`], with [`DistError`] for the
//! control plane's own), so a program mixes the two with `?`.
//!
//! Invariant: no rank starts its first step unless every rank of the job arrived,
//! proved the job's secret and runs the same thing (equal fingerprints); a rank that
//! fails makes every other rank stop within the watch's bound.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod env;
mod figures;
pub mod fingerprint;
pub mod rendezvous;

pub use overlap::DistError;
