//! Loading: the checkpoint a path names, verified whole (sizes, checksums, tensors,
//! the model's parameters, full coverage) and rebuilt into full tensors before anything
//! of the session changes, then each local rank's piece installed under the session's
//! own mesh (so a checkpoint reshards). Nothing here reads a partial directory: a root
//! is followed through `latest` only.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use overlap_executor::Executor;
use overlap_graph::{Buffer, ParamId, ParamSpec, PlacedParam, Planner, Route};
use overlap_ops::Backend;
use safetensors::{Dtype, SafeTensors};

use super::manifest::{read_manifest, Manifest, RankFile, StateKind, TensorEntry, MANIFEST};
use super::{err, holds_param, leftover, plain_name, runs_optimizer, sha256, Loaded, LATEST};
use crate::Error;

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
    let mut asm = Assembly::new(planner.params().len());
    for f in &m.files {
        let params = planner.params();
        let place = |t: &TensorEntry| -> Result<(usize, u64), Error> {
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
            Ok((id, params[id].spec.numel()))
        };
        asm.place_file(&ckpt.join(&f.file), f, place)?;
    }
    asm.check_complete(&manifest_path, planner.params())?;
    let unfinished = if ckpt == dir {
        Vec::new()
    } else {
        unfinished(dir)
    };
    Ok(Restored {
        loaded: Loaded {
            path: ckpt,
            step: m.step,
            seed: m.rng.seed,
            saved_mesh: m.mesh,
            unfinished,
        },
        full: asm.full,
    })
}

/// What unfinished saves left in the checkpoint root `root`, sorted: partial directories
/// and temporary files (hidden; nothing reads them, and the next successful save removes
/// them), and step directories newer than the one `latest` names, or every one where
/// there is no `latest` (renamed into place by a save that did not get to switch
/// `latest`; a later save of the same step replaces one).
pub fn unfinished(root: &Path) -> Vec<PathBuf> {
    let latest = fs::read_to_string(root.join(LATEST)).unwrap_or_default();
    let committed = step_of(latest.trim());
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let newer = match (step_of(&name), committed) {
                (Some(s), Some(c)) => s > c,
                (Some(_), None) => latest.is_empty(),
                (None, _) => false,
            };
            leftover(&name).is_some() || (newer && e.path().is_dir())
        })
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// The step of a step directory's name (`step-NNNNNN`).
fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    digits
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| digits.parse().ok())
        .flatten()
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

    /// Reads rank file `f` at `path` (checked against the manifest's size and sha256)
    /// and places each of its tensors; `place` checks a tensor's entry and gives the
    /// session parameter it belongs to and that parameter's element count.
    fn place_file(
        &mut self,
        path: &Path,
        f: &RankFile,
        place: impl Fn(&TensorEntry) -> Result<(usize, u64), Error>,
    ) -> Result<(), Error> {
        let bytes = read_rank_file(path, f)?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| err(path, format!("not a valid safetensors file: {e}")))?;
        for t in &f.tensors {
            let (id, numel) = place(t)?;
            self.place(path, &st, t, id, numel)?;
        }
        Ok(())
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
