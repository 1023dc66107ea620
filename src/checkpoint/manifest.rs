//! The manifest of a checkpoint directory (`manifest.json`): what it records and how it
//! is read back. Reading checks the format version first (a newer one is named as such),
//! then every field (unknown ones are refused), the mesh, one file per rank in rank
//! order with a plain file name, and parameter names listed once.

use std::collections::HashSet;
use std::path::Path;

use overlap_graph::{Coord, Mesh, Route};
use serde::{Deserialize, Serialize};

use super::{err, plain_name};
use crate::Error;

/// The manifest format this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// What a checkpoint directory's `manifest.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the build that wrote it.
    pub format_version: u32,
    /// The `overlap` version that wrote it.
    pub overlap_version: String,
    /// The mesh of the session that saved it.
    pub mesh: Mesh,
    /// Steps completed when it was saved (the next step is `step + 1`). It is also the
    /// position of a learning-rate schedule, which is a function of the step.
    pub step: u64,
    /// Where the run's random numbers stand.
    pub rng: RngState,
    /// The model's parameters, in the session's order, with their owners on `mesh`.
    pub params: Vec<ManifestParam>,
    /// One file per rank of `mesh`, in rank order.
    pub files: Vec<RankFile>,
}

/// The RNG position of a run. `overlap run`'s gradients are a pure function of (seed,
/// step, micro-batch, rank, parameter) (`synthetic::grad`), so the step counter is the
/// whole state of its generator: `position` is the step, `seed` the seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngState {
    /// The generator ([`super::SYNTHETIC_RNG`]).
    pub generator: String,
    /// The seed the run used; absent when the checkpoint was saved without one
    /// ([`crate::Session::save`] from a trainer that feeds its own gradients).
    pub seed: Option<u64>,
    /// The generator's position: the next step draws step `position`'s numbers.
    pub position: u64,
}

/// A parameter as the manifest records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestParam {
    /// The parameter's name.
    pub name: String,
    /// Its full shape.
    pub shape: Vec<u64>,
    /// Its route (which fixes its optimizer and the layout of its state).
    pub route: Route,
    /// Its backward-readiness layer.
    pub layer: u32,
    /// The owner rank's coordinates on the saved mesh (owned routes).
    pub owner: Option<Coord>,
}

/// One rank's file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankFile {
    /// The global rank that wrote it.
    pub rank: u32,
    /// The file's name in the checkpoint directory.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The sha256 of its bytes, lower-case hex.
    pub sha256: String,
    /// The tensors it holds.
    pub tensors: Vec<TensorEntry>,
}

/// A tensor of a rank's file: a flat element range of a full tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    /// The tensor's name in the file (`kind/parameter`).
    pub name: String,
    /// The parameter it belongs to.
    pub param: String,
    /// What it holds.
    pub kind: StateKind,
    /// First element of the full tensor (row major) it holds.
    pub start: u64,
    /// One past its last element.
    pub end: u64,
}

/// What a tensor of a checkpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    /// Parameter values.
    Param,
    /// AdamW's first moment, per element.
    AdamwM,
    /// AdamW's second moment, per element.
    AdamwV,
    /// Muon's momentum, of the whole matrix.
    MuonMomentum,
}

impl StateKind {
    pub(crate) const ALL: [StateKind; 4] = [
        StateKind::Param,
        StateKind::AdamwM,
        StateKind::AdamwV,
        StateKind::MuonMomentum,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            StateKind::Param => "param",
            StateKind::AdamwM => "adamw_m",
            StateKind::AdamwV => "adamw_v",
            StateKind::MuonMomentum => "muon_momentum",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Whether a parameter of `route` has this state.
    pub(crate) fn fits(self, route: Route) -> bool {
        match self {
            StateKind::Param => true,
            StateKind::AdamwM | StateKind::AdamwV => route != Route::Muon,
            StateKind::MuonMomentum => route == Route::Muon,
        }
    }
}

/// Reads and checks a manifest (its format version first, so a newer format is named as
/// such rather than as an unknown field).
pub fn read_manifest(path: &Path) -> Result<Manifest, Error> {
    // A manifest lists every parameter and file once: far below a plan's limit.
    let text = crate::resources::read_text_bounded(path, crate::resources::MAX_PLAN_BYTES)
        .map_err(|e| err(path, format!("cannot be read: {e}")))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| err(path, format!("is not valid JSON: {e}")))?;
    check_version(path, &value)?;
    let m: Manifest = serde_json::from_value(value)
        .map_err(|e| err(path, format!("is not a valid manifest: {e}")))?;
    m.mesh
        .check()
        .map_err(|e| err(path, format!("mesh: {e}")))?;
    check_files(path, &m)?;
    let mut seen = HashSet::new();
    for p in &m.params {
        if !seen.insert(p.name.as_str()) {
            return Err(err(path, format!("parameter `{}` is listed twice", p.name)));
        }
    }
    Ok(m)
}

/// A numeric `format_version` no newer than this build's.
fn check_version(path: &Path, value: &serde_json::Value) -> Result<(), Error> {
    match value.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v > u64::from(FORMAT_VERSION) => {
            let by = value
                .get("overlap_version")
                .and_then(|v| v.as_str())
                .unwrap_or("an unknown version");
            Err(err(
                path,
                format!(
                    "format version {v} (written by overlap {by}) is newer than this build's \
                     {FORMAT_VERSION} (overlap {}); load it with a newer overlap",
                    env!("CARGO_PKG_VERSION")
                ),
            ))
        }
        Some(_) => Ok(()),
        None => Err(err(path, "has no numeric `format_version`")),
    }
}

/// One file per rank of the mesh, in rank order, each a plain file name.
fn check_files(path: &Path, m: &Manifest) -> Result<(), Error> {
    // Compared without building the list of ranks: the mesh is the file's word.
    let world = u64::from(m.mesh.world());
    let in_order = m.files.len() as u64 == world
        && m.files
            .iter()
            .enumerate()
            .all(|(i, f)| f.rank as usize == i);
    if !in_order {
        return Err(err(
            path,
            format!(
                "lists {} rank files; mesh {}x{} needs one per rank 0..{world}, in rank order",
                m.files.len(),
                m.mesh.shard,
                m.mesh.replicate
            ),
        ));
    }
    match m.files.iter().find(|f| !plain_name(&f.file)) {
        Some(f) => Err(err(
            path,
            format!(
                "rank {}'s file `{}` is not a plain file name",
                f.rank, f.file
            ),
        )),
        None => Ok(()),
    }
}
