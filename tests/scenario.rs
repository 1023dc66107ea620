//! The scenario this project learns from, end to end on the CPU backend: gated HSDP
//! reduction equals the no_sync reference on every mesh, route and gate pattern.

use overlap::verify::verify;
use overlap::Config;

/// Parameters of all four routes; sizes chosen not to divide by 2, 3 or 4.
const PARAMS: &str = r#"
[[param]]
name = "embed"
shape = [37, 6]
route = "sharded_adamw"
layer = 0

[[param]]
name = "blocks.0.norm"
shape = [7]
route = "fsdp"
layer = 1

[[param]]
name = "blocks.0.qkv"
shape = [15, 7]
route = "muon"
layer = 1

[[param]]
name = "blocks.0.bias"
shape = [11]
route = "adamw"
layer = 1

[[param]]
name = "blocks.1.proj"
shape = [9, 5]
route = "muon"
layer = 2

[[param]]
name = "blocks.1.norm"
shape = [5, 3]
route = "fsdp"
layer = 2

[[param]]
name = "head"
shape = [13, 3]
route = "sharded_adamw"
layer = 3
"#;

fn config(shard: u32, replicate: u32, gates: &str, cap: u64, overlap: &str) -> Config {
    let text = format!(
        "[mesh]\nshard = {shard}\nreplicate = {replicate}\n[buckets]\ncap_bytes = {cap}\n[accumulation]\ngates = [{}]\n[overlap]\n{overlap}\n{PARAMS}",
        gates.split(',').map(|g| format!("\"{g}\"")).collect::<Vec<_>>().join(", ")
    );
    Config::from_toml(&text, "scenario.toml").unwrap()
}

async fn check(shard: u32, replicate: u32, gates: &str) {
    check_with(shard, replicate, gates, "").await;
}

async fn check_with(shard: u32, replicate: u32, gates: &str, overlap: &str) {
    for cap in [64, 1 << 20] {
        let cfg = config(shard, replicate, gates, cap, overlap);
        let r = verify(&cfg, 3, 42, |_| {}).await.unwrap();
        let label = format!("mesh {shard}x{replicate} gates {gates} cap {cap} {overlap}");
        assert!(
            r.worst_rel_err <= 1e-6,
            "{label}: gradient error {} at {}",
            r.worst_rel_err,
            r.worst_at
        );
        assert!(
            r.param_rel_err <= 1e-5,
            "{label}: parameter error {}",
            r.param_rel_err
        );
        assert_eq!(r.partials_left, 0, "{label}");
        assert_eq!(
            r.per_route.len(),
            4,
            "{label}: every route compared: {:?}",
            r.per_route
        );
        assert!(r.ok, "{label}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hsdp_2x2_gate_off_then_on_matches_no_sync_reference() {
    check(2, 2, "off,on").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_meshes_and_gate_patterns_match_no_sync_reference() {
    for (s, r) in [(1, 4), (4, 1), (2, 3), (3, 2)] {
        for gates in ["off,off,on", "on,on", "no_sync,off,on"] {
            check(s, r, gates).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_transport_matches_no_sync_reference() {
    // Exchange + combine for every stage over a group of two or more, with the
    // combine on the compute stream (lagged or not) or on the reduce stream.
    for (s, r) in [(2, 2), (1, 4), (4, 1), (2, 3), (3, 2)] {
        for gates in ["off,on", "no_sync,off,on", "on,on"] {
            check_with(s, r, gates, "transport = \"copy\"").await;
        }
    }
    for overlap in [
        "transport = \"copy\"\ncombine_lag = 0",
        "transport = \"copy\"\ncombine_lag = 3\n[streams]\ncombine = \"reduce\"",
    ] {
        check_with(2, 2, "off,off,on", overlap).await;
    }
}
