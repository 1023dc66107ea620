//! Parameters given in code rather than the config file (what a framework integration
//! does), and full parameters read back from the ranks' pieces.

use overlap::{Config, Gate, ParamSpec, Route, Session};

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("embed", vec![10, 6], Route::ShardedAdamw, 0),
        ParamSpec::new("blocks.0.w", vec![7, 5], Route::Muon, 1),
        ParamSpec::new("blocks.0.b", vec![7], Route::Fsdp, 1),
        ParamSpec::new("head", vec![3, 6], Route::Adamw, 2),
    ]
}

const MESH: &str = "[mesh]\nshard = 2\nreplicate = 2\n";

#[test]
fn a_config_takes_its_parameters_from_code() {
    let text = format!("{MESH}[[optimizer.group]]\nmatch = \"blocks.*\"\nlr_scale = 0.5\n");
    let config = Config::from_toml_with_params(&text, "code.toml", specs()).unwrap();
    assert_eq!(config.plan.params, specs());
    assert_eq!(config.groups.len(), 1);
}

#[test]
fn parameters_from_code_are_checked_like_the_files() {
    let err = |text: &str, params: Vec<ParamSpec>| {
        Config::from_toml_with_params(text, "code.toml", params)
            .unwrap_err()
            .to_string()
    };
    let e = err(
        &format!("{MESH}[[param]]\nname = \"x\"\nshape = [2]\nroute = \"fsdp\"\n"),
        specs(),
    );
    assert!(
        e.contains("param[0]") && e.contains("come from the trainer's model"),
        "{e}"
    );
    let e = err(
        &format!("{MESH}[model]\nlayers = 1\nhidden = 8\nvocab = 8\n"),
        specs(),
    );
    assert!(
        e.contains("`model`") && e.contains("come from the trainer's model"),
        "{e}"
    );
    let e = err(MESH, vec![]);
    assert!(e.contains("no parameters"), "{e}");
    let mut twice = specs();
    twice.push(specs()[0].clone());
    let e = err(MESH, twice);
    assert!(e.contains("`embed`") && e.contains("duplicate"), "{e}");
    let e = err(MESH, vec![ParamSpec::new("v", vec![4], Route::Muon, 0)]);
    assert!(e.contains("`v`"), "{e}");
    let e = err(
        &format!("{MESH}[[optimizer.group]]\nmatch = \"nothing.*\"\n"),
        specs(),
    );
    assert!(e.contains("nothing.*"), "{e}");
}

#[test]
fn full_param_puts_every_ranks_piece_together() {
    let config = Config::from_toml_with_params(MESH, "code.toml", specs()).unwrap();
    let mut s = Session::cpu(&config).unwrap();
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        for gate in [Gate::ReplicateOff, Gate::On] {
            s.begin_micro_batch(gate).await.unwrap();
            for layer in s.layers() {
                s.grad_ready(layer, |rank, param, out| {
                    for (i, v) in out.iter_mut().enumerate() {
                        *v = (rank as f32 + 1.0) * (param as f32 + 1.0) + i as f32 * 0.01;
                    }
                })
                .await
                .unwrap();
            }
        }
        s.step().await.unwrap();
    });
    let mesh = config.plan.mesh;
    for (id, spec) in specs().iter().enumerate() {
        let full = s.full_param(id as u32).unwrap();
        assert_eq!(full.len() as u64, spec.numel());
        let mut pieces = 0;
        for rank in s.local_ranks() {
            if let Some(piece) = s.param_values(rank, id as u32).unwrap() {
                let r = spec.shard_range(mesh.shard, mesh.coord(rank).shard);
                assert_eq!(
                    piece,
                    full[r.start as usize..r.end as usize],
                    "{}",
                    spec.name
                );
                pieces += 1;
            }
        }
        assert!(pieces >= 2, "{}: {pieces} pieces", spec.name);
    }
    let e = s.full_param(99).unwrap_err().to_string();
    assert!(e.contains("has 4 parameters"), "{e}");
}
