//! Staging: at the save point, a host copy of what each local rank writes (through the
//! backend's download, so a device-to-host copy on CUDA), taken between steps so that
//! the files can be written while the next steps change the parameters.
//!
//! Which rank writes which piece (the *layout*, `docs/checkpoints.md`): a sharded
//! route's piece is written by replicate row 0 of its shard column (the other replicas
//! hold the same values and state), an owned route's tensor and state by its owner. The
//! copy holds only those pieces, so a rank of replicate row 1 or above stages only the
//! owned parameters it owns.

use overlap_executor::Executor;
use overlap_graph::{Buffer, Coord, Mesh, ParamId, PlacedParam, Planner, Route};
use overlap_ops::Backend;
use safetensors::Dtype;

use super::manifest::{ManifestParam, StateKind, TensorEntry};
use super::{err, writes};
use crate::Error;

/// A host copy of a session's checkpoint at one step: what the manifest records of the
/// model, and every local rank's pieces.
pub(crate) struct Staged {
    /// Steps completed.
    pub(crate) step: u64,
    /// The session's mesh.
    pub(crate) mesh: Mesh,
    /// The seed of `overlap run`'s gradients, if the caller gave one.
    pub(crate) seed: Option<u64>,
    /// The model's parameters as the manifest lists them.
    pub(crate) params: Vec<ManifestParam>,
    /// The local ranks' pieces, in rank order.
    pub(crate) ranks: Vec<StagedRank>,
}

impl Staged {
    /// Whether the session drives every rank of its mesh (one process saves it all).
    pub(crate) fn all_local(&self) -> bool {
        self.ranks.len() as u64 == u64::from(self.mesh.world())
    }

    /// Whether this process holds global rank 0, whose process commits the checkpoint.
    pub(crate) fn commits(&self) -> bool {
        self.ranks.first().is_some_and(|r| r.rank == 0)
    }
}

/// One rank's pieces: the tensors of its file and their values.
pub(crate) struct StagedRank {
    /// The global rank.
    pub(crate) rank: u32,
    /// The file's tensors, in the order they were staged.
    pub(crate) entries: Vec<TensorEntry>,
    /// Each tensor's values.
    data: Vec<Vec<f32>>,
}

impl StagedRank {
    fn push(&mut self, kind: StateKind, param: &str, start: u64, values: Vec<f32>) {
        self.entries.push(TensorEntry {
            name: format!("{}/{param}", kind.name()),
            param: param.to_string(),
            kind,
            start,
            end: start + values.len() as u64,
        });
        self.data.push(values);
    }

    /// The rank's safetensors file (little-endian `F32`, one dimension per tensor);
    /// `path` names it in errors.
    pub(crate) fn serialize(&self, path: &std::path::Path) -> Result<Vec<u8>, Error> {
        let bytes: Vec<Vec<u8>> = self
            .data
            .iter()
            .map(|d| d.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views = self
            .entries
            .iter()
            .zip(&bytes)
            .map(|(e, d)| {
                let len = (e.end - e.start) as usize;
                safetensors::tensor::TensorView::new(Dtype::F32, vec![len], d)
                    .map(|v| (e.name.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| err(path, format!("laying out the tensors: {e}")))?;
        safetensors::serialize(views, None).map_err(|e| err(path, format!("serialising: {e}")))
    }
}

/// Copies every local rank's pieces to the host. Call between steps.
pub(crate) fn stage<B: Backend>(
    planner: &Planner,
    exec: &Executor<B>,
    seed: Option<u64>,
) -> Result<Staged, Error> {
    let mut local = exec.local_ranks();
    local.sort_unstable();
    let ranks = local
        .into_iter()
        .map(|rank| stage_rank(planner, exec, rank))
        .collect::<Result<Vec<_>, _>>()?;
    let params = planner
        .params()
        .iter()
        .map(|p| ManifestParam {
            name: p.spec.name.clone(),
            shape: p.spec.shape.clone(),
            route: p.spec.route,
            layer: p.spec.layer,
            owner: p.owner,
        })
        .collect();
    Ok(Staged {
        step: exec.steps_done(),
        mesh: planner.spec().mesh,
        seed,
        params,
        ranks,
    })
}

/// The pieces rank `rank` writes.
fn stage_rank<B: Backend>(
    planner: &Planner,
    exec: &Executor<B>,
    rank: u32,
) -> Result<StagedRank, Error> {
    let mesh = planner.spec().mesh;
    let c = mesh.coord(rank);
    let mut out = StagedRank {
        rank,
        entries: Vec::new(),
        data: Vec::new(),
    };
    for (i, p) in planner.params().iter().enumerate() {
        if writes(p.owner, c) {
            stage_param(exec, mesh, c, rank, (i as ParamId, p), &mut out)?;
        }
    }
    Ok(out)
}

/// Rank `rank`'s piece of one parameter (`id`, `p`) and of its optimizer state, if it
/// has one yet; nothing for a piece the padding swallows.
fn stage_param<B: Backend>(
    exec: &Executor<B>,
    mesh: Mesh,
    c: Coord,
    rank: u32,
    (id, p): (ParamId, &PlacedParam),
    out: &mut StagedRank,
) -> Result<(), Error> {
    let range = p.spec.shard_range(mesh.shard, c.shard);
    if range.is_empty() {
        return Ok(());
    }
    let name = &p.spec.name;
    let n = (range.end - range.start) as usize;
    let internal = |what: &str, got: usize, want: usize| {
        Error::Usage(format!(
            "save: rank {rank} holds {got} elements of {what} of `{name}`, its piece is {want}"
        ))
    };
    let values = exec
        .read(rank, Buffer::Param { param: id })?
        .ok_or_else(|| Error::Usage(format!("save: rank {rank} holds no values of `{name}`")))?;
    if values.len() != n {
        return Err(internal("the values", values.len(), n));
    }
    out.push(StateKind::Param, name, range.start, values);
    let Some(mut state) = exec.read(rank, Buffer::OptState { param: id })? else {
        return Ok(());
    };
    if p.spec.route == Route::Muon {
        if state.len() != n {
            return Err(internal("the Muon momentum", state.len(), n));
        }
        out.push(StateKind::MuonMomentum, name, range.start, state);
    } else {
        if state.len() != 2 * n {
            return Err(internal("the AdamW moments", state.len(), 2 * n));
        }
        let v = state.split_off(n);
        out.push(StateKind::AdamwM, name, range.start, state);
        out.push(StateKind::AdamwV, name, range.start, v);
    }
    Ok(())
}
