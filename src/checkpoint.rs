//! Checkpoints: a session's parameters, optimizer state and step counter on disk, and
//! back (`docs/checkpoints.md`).
//!
//! A checkpoint is a directory `step-NNNNNN/` under a checkpoint root, holding one
//! [safetensors](https://docs.rs/safetensors) file per rank (`rank-00000.safetensors`,
//! ...) and a JSON [`Manifest`]: the mesh, the parameters, which element range of which
//! full tensor every file holds, the step counter, the run's RNG position and each
//! file's sha256. The root's `latest` file names the newest complete checkpoint.
//!
//! Saving writes into a hidden temporary sibling, syncs every file and the directory,
//! renames it into place and only then switches `latest` (written to a temporary file and
//! renamed): a crash at any point leaves `latest` naming a complete checkpoint.
//!
//! Loading verifies everything before it touches the session: every file's size and
//! checksum, every tensor's dtype and shape, that the parameters are the model's, and
//! that the pieces cover every element. It then rebuilds the full tensors and hands each
//! local rank its piece under the session's own mesh, so a checkpoint loads onto another
//! `shard × replicate` mesh as well (the owners of owned routes may move: their state
//! goes to the new owner).

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use overlap_executor::Executor;
use overlap_graph::{Buffer, Coord, Mesh, ParamId, ParamSpec, PlacedParam, Planner, Route};
use overlap_ops::Backend;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::Error;

/// The manifest format this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// The file in a checkpoint root naming the newest complete checkpoint directory.
pub const LATEST: &str = "latest";
/// The generator of `overlap run`'s synthetic gradients, as the manifest names it.
pub const SYNTHETIC_RNG: &str = "overlap.synthetic.splitmix64";

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
    /// The generator ([`SYNTHETIC_RNG`]).
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
    const ALL: [StateKind; 4] = [
        StateKind::Param,
        StateKind::AdamwM,
        StateKind::AdamwV,
        StateKind::MuonMomentum,
    ];

    fn name(self) -> &'static str {
        match self {
            StateKind::Param => "param",
            StateKind::AdamwM => "adamw_m",
            StateKind::AdamwV => "adamw_v",
            StateKind::MuonMomentum => "muon_momentum",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// Whether a parameter of `route` has this state.
    fn fits(self, route: Route) -> bool {
        match self {
            StateKind::Param => true,
            StateKind::AdamwM | StateKind::AdamwV => route != Route::Muon,
            StateKind::MuonMomentum => route == Route::Muon,
        }
    }
}

/// What [`crate::Session::load`] restored.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The checkpoint directory it read (the one `latest` names, when given a root).
    pub path: PathBuf,
    /// The step counter restored: the next step is `step + 1`.
    pub step: u64,
    /// The seed the run that saved it used, if it recorded one.
    pub seed: Option<u64>,
    /// The mesh it was saved on (another than the session's: it was resharded).
    pub saved_mesh: Mesh,
}

fn err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// The directory name of the checkpoint of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

fn rank_file_name(rank: u32) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}", std::process::id())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Whether the rank at `c` writes a parameter's piece: replicate 0 of each shard column
/// for sharded routes (the other replicas hold the same values), the owner for owned
/// routes (which alone holds the optimizer state).
fn writes(owner: Option<Coord>, c: Coord) -> bool {
    match owner {
        None => c.replicate == 0,
        Some(o) => o == c,
    }
}

/// Whether the rank at `c` holds a parameter's values under `owner`.
fn holds_param(owner: Option<Coord>, c: Coord) -> bool {
    owner.map_or(true, |o| o.shard == c.shard)
}

/// Whether the rank at `c` runs a parameter's optimizer (and keeps its state).
fn runs_optimizer(owner: Option<Coord>, c: Coord) -> bool {
    owner.map_or(true, |o| o == c)
}

/// Why a session cannot save: it must drive every rank of its mesh (one process).
pub(crate) fn check_can_save<B: Backend>(
    planner: &Planner,
    exec: &Executor<B>,
) -> Result<(), String> {
    let world = planner.spec().mesh.world();
    let local = exec.local_ranks();
    if local.len() as u32 != world {
        return Err(format!(
            "this session drives ranks {local:?} of the mesh's {world}: a checkpoint of a \
             multi-process job needs every rank's file before its manifest, and saving one \
             is not supported yet (docs/checkpoints.md)"
        ));
    }
    Ok(())
}

/// Saves a checkpoint of `exec`'s state under `root` (see the module docs); returns the
/// checkpoint directory.
pub(crate) fn save<B: Backend>(
    planner: &Planner,
    exec: &Executor<B>,
    root: &Path,
    seed: Option<u64>,
) -> Result<PathBuf, Error> {
    if exec.in_step() {
        return Err(Error::Usage(
            "save during a step; call it before the first micro-batch or after step()".into(),
        ));
    }
    check_can_save(planner, exec).map_err(|r| err(root, r))?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e: std::io::Error| err(&path, e.to_string())
    };
    fs::create_dir_all(root).map_err(io(root))?;
    let step = exec.steps_done();
    let name = step_dir_name(step);
    let tmp = root.join(format!(".tmp-{name}-{}", unique_suffix()));
    fs::create_dir(&tmp).map_err(io(&tmp))?;
    let written = write_dir(planner, exec, &tmp, step, seed);
    if let Err(e) = written {
        // Best effort: the directory is hidden and never named by `latest` either way.
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let dest = root.join(&name);
    if dest.exists() {
        // The same step saved again (a run resumed from an older checkpoint): the new
        // one replaces it.
        let old = root.join(format!(".old-{name}-{}", unique_suffix()));
        fs::rename(&dest, &old).map_err(io(&dest))?;
        fs::rename(&tmp, &dest).map_err(io(&dest))?;
        sync_dir(root)?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, &dest).map_err(io(&dest))?;
        sync_dir(root)?;
    }
    let latest_tmp = root.join(format!(".{LATEST}-{}", unique_suffix()));
    write_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(io(&root.join(LATEST)))?;
    sync_dir(root)?;
    Ok(dest)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let mut f = fs::File::create(path).map_err(|e| err(path, e.to_string()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| err(path, e.to_string()))
}

/// Makes a directory's entries (new files, renames) durable.
fn sync_dir(dir: &Path) -> Result<(), Error> {
    #[cfg(unix)]
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| err(dir, format!("syncing the directory: {e}")))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Writes every rank's file and the manifest into `dir`, synced.
fn write_dir<B: Backend>(
    planner: &Planner,
    exec: &Executor<B>,
    dir: &Path,
    step: u64,
    seed: Option<u64>,
) -> Result<(), Error> {
    let mesh = planner.spec().mesh;
    let params = planner.params();
    let mut files = Vec::new();
    for rank in mesh.ranks() {
        let c = mesh.coord(rank);
        let file = rank_file_name(rank);
        let path = dir.join(&file);
        let mut entries = Vec::new();
        let mut data: Vec<Vec<u8>> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            if !writes(p.owner, c) {
                continue;
            }
            let id = i as ParamId;
            let range = p.spec.shard_range(mesh.shard, c.shard);
            if range.is_empty() {
                continue;
            }
            let n = (range.end - range.start) as usize;
            let mut push = |kind: StateKind, start: u64, values: &[f32]| {
                entries.push(TensorEntry {
                    name: format!("{}/{}", kind.name(), p.spec.name),
                    param: p.spec.name.clone(),
                    kind,
                    start,
                    end: start + values.len() as u64,
                });
                data.push(values.iter().flat_map(|x| x.to_le_bytes()).collect());
            };
            let internal = |what: &str, got: usize, want: usize| {
                Error::Usage(format!(
                    "save: rank {rank} holds {got} elements of {what} of `{}`, its piece is {want}",
                    p.spec.name
                ))
            };
            let values = exec
                .read(rank, Buffer::Param { param: id })?
                .ok_or_else(|| {
                    Error::Usage(format!(
                        "save: rank {rank} holds no values of `{}`",
                        p.spec.name
                    ))
                })?;
            if values.len() != n {
                return Err(internal("the values", values.len(), n));
            }
            push(StateKind::Param, range.start, &values);
            if let Some(state) = exec.read(rank, Buffer::OptState { param: id })? {
                if p.spec.route == Route::Muon {
                    if state.len() != n {
                        return Err(internal("the Muon momentum", state.len(), n));
                    }
                    push(StateKind::MuonMomentum, range.start, &state);
                } else {
                    if state.len() != 2 * n {
                        return Err(internal("the AdamW moments", state.len(), 2 * n));
                    }
                    let (m, v) = state.split_at(n);
                    push(StateKind::AdamwM, range.start, m);
                    push(StateKind::AdamwV, range.start, v);
                }
            }
        }
        let views = entries
            .iter()
            .zip(&data)
            .map(|(e, d)| {
                let len = (e.end - e.start) as usize;
                safetensors::tensor::TensorView::new(Dtype::F32, vec![len], d)
                    .map(|v| (e.name.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| err(&path, format!("laying out the tensors: {e}")))?;
        let bytes = safetensors::serialize(views, None)
            .map_err(|e| err(&path, format!("serialising: {e}")))?;
        write_synced(&path, &bytes)?;
        files.push(RankFile {
            rank,
            file,
            bytes: bytes.len() as u64,
            sha256: sha256(&bytes),
            tensors: entries,
        });
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        overlap_version: env!("CARGO_PKG_VERSION").into(),
        mesh,
        step,
        rng: RngState {
            generator: SYNTHETIC_RNG.into(),
            seed,
            position: step,
        },
        params: params
            .iter()
            .map(|p| ManifestParam {
                name: p.spec.name.clone(),
                shape: p.spec.shape.clone(),
                route: p.spec.route,
                layer: p.spec.layer,
                owner: p.owner,
            })
            .collect(),
        files,
    };
    let path = dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| err(&path, format!("serialising: {e}")))?;
    write_synced(&path, &json)?;
    sync_dir(dir)
}

/// The checkpoint directory `dir` names: the one its `latest` names when it is a root,
/// else `dir` itself when it holds a manifest.
pub fn resolve(dir: &Path) -> Result<PathBuf, Error> {
    let latest = dir.join(LATEST);
    if latest.is_file() {
        let text = fs::read_to_string(&latest).map_err(|e| err(&latest, e.to_string()))?;
        let name = text.trim();
        if !plain_name(name) {
            return Err(err(
                &latest,
                format!("`{name}` is not the name of a checkpoint directory in this root"),
            ));
        }
        let path = dir.join(name);
        if !path.join(MANIFEST).is_file() {
            return Err(err(
                &latest,
                format!("names `{name}`, which holds no {MANIFEST}"),
            ));
        }
        return Ok(path);
    }
    if dir.join(MANIFEST).is_file() {
        return Ok(dir.to_path_buf());
    }
    Err(err(
        dir,
        format!("not a checkpoint: neither a `{LATEST}` file nor a {MANIFEST} is there"),
    ))
}

/// A file name with no directory part.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\'])
        && Path::new(name).components().count() == 1
}

/// Reads and checks a manifest (its format version first, so a newer format is named as
/// such rather than as an unknown field).
pub fn read_manifest(path: &Path) -> Result<Manifest, Error> {
    let bytes = fs::read(path).map_err(|e| err(path, format!("cannot be read: {e}")))?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| err(path, format!("is not valid JSON: {e}")))?;
    match value.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v > u64::from(FORMAT_VERSION) => {
            let by = value
                .get("overlap_version")
                .and_then(|v| v.as_str())
                .unwrap_or("an unknown version");
            return Err(err(
                path,
                format!(
                    "format version {v} (written by overlap {by}) is newer than this build's \
                     {FORMAT_VERSION} (overlap {}); load it with a newer overlap",
                    env!("CARGO_PKG_VERSION")
                ),
            ));
        }
        Some(_) => {}
        None => return Err(err(path, "has no numeric `format_version`")),
    }
    let m: Manifest = serde_json::from_value(value)
        .map_err(|e| err(path, format!("is not a valid manifest: {e}")))?;
    m.mesh
        .check()
        .map_err(|e| err(path, format!("mesh: {e}")))?;
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
    for f in &m.files {
        if !plain_name(&f.file) {
            return Err(err(
                path,
                format!(
                    "rank {}'s file `{}` is not a plain file name",
                    f.rank, f.file
                ),
            ));
        }
    }
    let mut seen = std::collections::HashSet::new();
    for p in &m.params {
        if !seen.insert(p.name.as_str()) {
            return Err(err(path, format!("parameter `{}` is listed twice", p.name)));
        }
    }
    Ok(m)
}

/// A verified checkpoint: every parameter's full tensors.
pub(crate) struct Restored {
    loaded: Loaded,
    /// Per session parameter (by id): full tensors by [`StateKind::index`], `None`
    /// where the checkpoint has none of that state (saved before the first step).
    full: Vec<[Option<Vec<f32>>; 4]>,
}

/// Reads and verifies the checkpoint `dir` names against the session's parameters, and
/// rebuilds the full tensors. Touches nothing of the session.
pub(crate) fn read(dir: &Path, planner: &Planner) -> Result<Restored, Error> {
    let ckpt = resolve(dir)?;
    let manifest_path = ckpt.join(MANIFEST);
    let m = read_manifest(&manifest_path)?;
    let by_name: HashMap<&str, usize> = m
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    let of_session = session_ids(&manifest_path, &m, &by_name, planner)?;
    let params = planner.params();
    let mut asm = Assembly::new(params.len());
    for f in &m.files {
        let path = ckpt.join(&f.file);
        let bytes = read_rank_file(&path, f)?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| err(&path, format!("not a valid safetensors file: {e}")))?;
        for t in &f.tensors {
            let Some(&i) = by_name.get(t.param.as_str()) else {
                return Err(err(
                    &manifest_path,
                    format!(
                        "{}'s tensor `{}` belongs to `{}`, which is not among its parameters",
                        f.file, t.name, t.param
                    ),
                ));
            };
            let id = of_session[i];
            check_tensor_entry(&manifest_path, f, t, &params[id].spec)?;
            asm.place(&path, &st, t, id, params[id].spec.numel())?;
        }
    }
    asm.check_complete(&manifest_path, params)?;
    Ok(Restored {
        loaded: Loaded {
            path: ckpt,
            step: m.step,
            seed: m.rng.seed,
            saved_mesh: m.mesh,
        },
        full: asm.full,
    })
}

/// The model's parameters against the checkpoint's, by name (`by_name`: the manifest's
/// index of each name): per manifest parameter, the session's id; every parameter on
/// each side must be on the other with the same shape and route.
fn session_ids(
    manifest_path: &Path,
    m: &Manifest,
    by_name: &HashMap<&str, usize>,
    planner: &Planner,
) -> Result<Vec<usize>, Error> {
    let mut of_session = vec![usize::MAX; m.params.len()];
    for (id, p) in planner.params().iter().enumerate() {
        let name = &p.spec.name;
        let Some(&i) = by_name.get(name.as_str()) else {
            return Err(err(
                manifest_path,
                format!("parameter `{name}` of this model is not in the checkpoint"),
            ));
        };
        let saved = &m.params[i];
        if saved.shape != p.spec.shape {
            return Err(err(
                manifest_path,
                format!(
                    "parameter `{name}` has shape {:?} in the checkpoint, {:?} in this model",
                    saved.shape, p.spec.shape
                ),
            ));
        }
        if saved.route != p.spec.route {
            return Err(err(
                manifest_path,
                format!(
                    "parameter `{name}` has route {} in the checkpoint, {} in this model: its \
                     optimizer state does not convert",
                    saved.route, p.spec.route
                ),
            ));
        }
        of_session[i] = id;
    }
    if let Some(i) = of_session.iter().position(|&id| id == usize::MAX) {
        return Err(err(
            manifest_path,
            format!(
                "the checkpoint's parameter `{}` is not in this model",
                m.params[i].name
            ),
        ));
    }
    Ok(of_session)
}

/// A rank's file, read whole and checked against the manifest's size and sha256.
fn read_rank_file(path: &Path, f: &RankFile) -> Result<Vec<u8>, Error> {
    let bytes = fs::read(path).map_err(|e| err(path, format!("cannot be read: {e}")))?;
    let len = bytes.len() as u64;
    if len < f.bytes {
        return Err(err(
            path,
            format!("truncated: {len} bytes, the manifest says {}", f.bytes),
        ));
    }
    if len > f.bytes {
        return Err(err(
            path,
            format!("{len} bytes, the manifest says {}", f.bytes),
        ));
    }
    let sum = sha256(&bytes);
    if sum != f.sha256 {
        return Err(err(
            path,
            format!(
                "corrupted: its sha256 is {sum}, the manifest says {}",
                f.sha256
            ),
        ));
    }
    Ok(bytes)
}

/// Checks that a tensor of rank file `f` holds a state the parameter `spec`'s route has,
/// within its elements.
fn check_tensor_entry(
    manifest_path: &Path,
    f: &RankFile,
    t: &TensorEntry,
    spec: &ParamSpec,
) -> Result<(), Error> {
    if !t.kind.fits(spec.route) {
        return Err(err(
            manifest_path,
            format!(
                "{}'s tensor `{}` holds {} of `{}`, whose route {} has none",
                f.file,
                t.name,
                t.kind.name(),
                t.param,
                spec.route
            ),
        ));
    }
    let numel = spec.numel();
    if t.start > t.end || t.end > numel {
        return Err(err(
            manifest_path,
            format!(
                "{}'s tensor `{}` claims elements {}..{} of `{}`, which has {numel}",
                f.file, t.name, t.start, t.end, t.param
            ),
        ));
    }
    Ok(())
}

/// The full tensors being rebuilt from the rank files, per session parameter and
/// [`StateKind::index`], and which of their elements some file covered.
struct Assembly {
    full: Vec<[Option<Vec<f32>>; 4]>,
    covered: Vec<[Vec<bool>; 4]>,
}

impl Assembly {
    /// Nothing yet of `params` parameters.
    fn new(params: usize) -> Assembly {
        Assembly {
            full: vec![Default::default(); params],
            covered: vec![Default::default(); params],
        }
    }

    /// Copies tensor `t` of the safetensors file at `path` into parameter `id` (of
    /// `numel` elements), after checking its dtype and shape.
    fn place(
        &mut self,
        path: &Path,
        st: &SafeTensors<'_>,
        t: &TensorEntry,
        id: usize,
        numel: u64,
    ) -> Result<(), Error> {
        let view = st
            .tensor(&t.name)
            .map_err(|e| err(path, format!("tensor `{}`: {e}", t.name)))?;
        let n = (t.end - t.start) as usize;
        if view.dtype() != Dtype::F32 || view.shape() != [n] {
            return Err(err(
                path,
                format!(
                    "tensor `{}` is {:?} of shape {:?}; the manifest says F32 of shape [{n}]",
                    t.name,
                    view.dtype(),
                    view.shape()
                ),
            ));
        }
        let k = t.kind.index();
        let dst = self.full[id][k].get_or_insert_with(|| vec![0.0; numel as usize]);
        let cov = &mut self.covered[id][k];
        if cov.is_empty() {
            cov.resize(numel as usize, false);
        }
        let range = t.start as usize..t.end as usize;
        for (x, b) in dst[range.clone()]
            .iter_mut()
            .zip(view.data().chunks_exact(4))
        {
            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        cov[range].iter_mut().for_each(|c| *c = true);
        Ok(())
    }

    /// Every element of every parameter, and of every state present, from some file;
    /// both AdamW moments or neither.
    fn check_complete(&self, manifest_path: &Path, params: &[PlacedParam]) -> Result<(), Error> {
        for (id, p) in params.iter().enumerate() {
            for kind in StateKind::ALL {
                if !kind.fits(p.spec.route) {
                    continue;
                }
                let cov = &self.covered[id][kind.index()];
                let present = !cov.is_empty();
                if !present && kind != StateKind::Param {
                    continue;
                }
                if let Some(gap) =
                    (0..p.spec.numel() as usize).find(|&e| !cov.get(e).is_some_and(|&c| c))
                {
                    return Err(err(
                        manifest_path,
                        format!(
                            "{} of `{}`: element {gap} is in no rank's file (incomplete checkpoint)",
                            kind.name(),
                            p.spec.name
                        ),
                    ));
                }
            }
            if p.spec.route != Route::Muon {
                let has = |k: StateKind| self.full[id][k.index()].is_some();
                if has(StateKind::AdamwM) != has(StateKind::AdamwV) {
                    return Err(err(
                        manifest_path,
                        format!("`{}` has only one of AdamW's two moments", p.spec.name),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Hands each local rank its piece of a verified checkpoint under the session's mesh,
/// and restores the step counter.
pub(crate) fn install<B: Backend>(
    planner: &Planner,
    exec: &mut Executor<B>,
    restored: Restored,
) -> Result<Loaded, Error> {
    let mesh = planner.spec().mesh;
    for rank in exec.local_ranks() {
        let c = mesh.coord(rank);
        for (id, p) in planner.params().iter().enumerate() {
            if !holds_param(p.owner, c) {
                continue;
            }
            let param = id as ParamId;
            let r = p.spec.shard_range(mesh.shard, c.shard);
            let r = r.start as usize..r.end as usize;
            let full = &restored.full[id];
            let piece = |k: StateKind| full[k.index()].as_ref().map(|v| &v[r.clone()]);
            let values = piece(StateKind::Param).ok_or_else(|| {
                Error::Usage(format!("load: no values of `{}` restored", p.spec.name))
            })?;
            exec.write(rank, Buffer::Param { param }, values)?;
            if !runs_optimizer(p.owner, c) {
                continue;
            }
            let state = Buffer::OptState { param };
            let values = if p.spec.route == Route::Muon {
                piece(StateKind::MuonMomentum).map(<[f32]>::to_vec)
            } else {
                piece(StateKind::AdamwM)
                    .zip(piece(StateKind::AdamwV))
                    .map(|(m, v)| [m, v].concat())
            };
            match values {
                Some(v) => exec.write(rank, state, &v)?,
                None => exec.clear(rank, state)?,
            }
        }
    }
    exec.set_steps_done(restored.loaded.step)?;
    Ok(restored.loaded)
}
