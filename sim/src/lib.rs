//! What a step of `overlap` would take on hardware that is not here, and the search
//! for the config that makes it shortest: the tooling behind `overlap simulate`,
//! `overlap tune` and `overlap calibrate`. A trainer never links it.
//!
//! - [`simulate`]: a discrete-event simulation of a lowered plan on a cost model (the
//!   forward model: a hardware [`simulate::Profile`] and a plan in, every node's start
//!   and end out);
//! - [`calibrate`]: the same cost model inverted (measurements in, a profile out), its
//!   formulas beside the forward ones, with a round-trip test: a profile's own
//!   predictions, fitted, give the profile back;
//! - [`hardware`]: hardware profiles as TOML files, every error naming file, key and
//!   line;
//! - [`tune`]: the search over a config's scheduling levers for the smallest predicted
//!   step within a memory budget.
//!
//! Invariant: pure and deterministic (no clock, no device, no threads; files only where
//! [`hardware`] is asked to read one): the same plan, profile and options give the same
//! figures, bit for bit.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod calibrate;
pub mod hardware;
pub mod simulate;
pub mod tune;
