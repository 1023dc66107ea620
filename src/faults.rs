//! Faults injected on purpose, for tests of a trainer's failure handling: a node of a
//! step that fails, hangs or reads a NaN ([`Fault`]; `OVERLAP_FAULT` in the command
//! line) and a checkpoint save stopped or failed at one of its phases ([`SaveFault`];
//! `OVERLAP_CHECKPOINT_FAULT`).
//!
//! The library never reads the environment by itself: a session has no fault until one
//! is handed to [`Session::inject_faults`](crate::Session::inject_faults). A program that
//! wants the variables honoured, as `overlap run` and `overlap verify` do, reads them
//! with [`Faults::from_env`] and hands the result over:
//!
//! ```no_run
//! # fn main() -> Result<(), overlap::Error> {
//! let config = overlap::Config::from_file("examples/hsdp_2x2.toml".as_ref())?;
//! let mut session = overlap::Session::cpu(&config)?;
//! session.inject_faults(overlap::faults::Faults::from_env()?);
//! # Ok(()) }
//! ```

pub use crate::checkpoint::SaveFault;
pub use overlap_executor::{Fault, FaultMode};

use crate::Error;

/// The faults a session injects: at most one into a step, at most one into a save.
/// Start from [`Faults::none`] (or [`Faults::from_env`]) and add with the `with_`
/// methods.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Faults {
    /// The node that fails, hangs or reads a NaN, in which rank and step.
    pub step: Option<Fault>,
    /// The phase of a save that stops or fails as a full disk does.
    pub save: Option<SaveFault>,
}

impl Faults {
    /// No fault.
    pub fn none() -> Faults {
        Faults::default()
    }

    /// The faults `OVERLAP_FAULT` and `OVERLAP_CHECKPOINT_FAULT` name, when they are set
    /// and not empty (`OVERLAP_FAULT`'s `attempt=K` fires only when
    /// `OVERLAP_RESTART_COUNT` is `K`). A malformed value is an [`Error::Usage`] naming
    /// the variable.
    pub fn from_env() -> Result<Faults, Error> {
        Ok(Faults {
            step: Fault::from_env().map_err(Error::Usage)?,
            save: SaveFault::from_env()?,
        })
    }

    /// With `fault` injected into a step.
    pub fn with_step(mut self, fault: Option<Fault>) -> Faults {
        self.step = fault;
        self
    }

    /// With `fault` injected into a save.
    pub fn with_save(mut self, fault: Option<SaveFault>) -> Faults {
        self.save = fault;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_built_from_their_texts_and_none_is_the_default() {
        assert_eq!(Faults::none(), Faults::default());
        let step = Fault::parse("rank=1,kind=pack,step=2,mode=hang").unwrap();
        let save = SaveFault::parse("phase=manifest,mode=enospc").unwrap();
        let f = Faults::none().with_step(Some(step)).with_save(Some(save));
        assert_eq!(
            f.step.map(|s| (s.rank, s.kind, s.step)),
            Some((1, "pack", 2))
        );
        assert_eq!(f.save, Some(save));
        let bad = SaveFault::parse("phase=nowhere").unwrap_err();
        assert!(bad.contains("nowhere"), "{bad}");
    }
}
