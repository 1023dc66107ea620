mod common;
use common::*;
use overlap_graph::*;
use serde_json::json;

fn show(p: &Plan) { for v in validate(p, Mode::Step) { println!("  {v}"); } }

#[test]
fn explore() {
    // 1. count changed on all ranks consistently
    let plan = four_routes_plan(&[Gate::ReplicateOff, Gate::On]);
    let mut v = to_value(&plan);
    for r in 0..4 { for n in v["ranks"][r]["nodes"].as_array_mut().unwrap() { if n["op"]["kind"]=="stage1" && n["op"]["bucket"]==0 { n["op"]["collective"]["count"] = json!(1); } } }
    println!("count-all:"); show(&from_value(&v));
    // 2. publish root changed
    let mut v = to_value(&plan);
    for r in 0..4 { for n in v["ranks"][r]["nodes"].as_array_mut().unwrap() { if n["op"]["kind"]=="publish" { n["op"]["collective"]["root"] = json!(1); } } }
    println!("publish-root:"); show(&from_value(&v));
    // 3. stage1 group -> replicate group consistently
    let mut v = to_value(&plan);
    for r in 0..4 { let s = r % 2; for n in v["ranks"][r]["nodes"].as_array_mut().unwrap() { if n["op"]["kind"]=="stage1" && n["op"]["bucket"]==0 { n["op"]["collective"]["group"] = json!({"kind":"replicate","shard":s}); } } }
    println!("stage1-group:"); show(&from_value(&v));
    // 4. param unknown field
    let mut v = to_value(&plan);
    v["params"][0]["rout"] = json!("muon");
    println!("param-unknown-field: {:?}", Plan::from_json(&v.to_string()).map(|_| ()));
    // 5. stage1 root wrong (owned)
    let mut v = to_value(&plan);
    for r in 0..4 { for n in v["ranks"][r]["nodes"].as_array_mut().unwrap() { if n["op"]["kind"]=="stage1" && n["op"]["bucket"]==1 { n["op"]["collective"]["root"] = json!(1); } } }
    println!("stage1-root:"); show(&from_value(&v));
    // 6. identical buckets swapped on rank 1
    let ps = vec![param("a", &[6], Route::Fsdp, 0), param("b", &[6], Route::Fsdp, 0)];
    let plan = Planner::new(spec(2, 1, ps, 12)).unwrap().plan(&[Gate::On]).unwrap();
    println!("{}", export::to_text(&plan));
    let mut v = to_value(&plan);
    let nodes = v["ranks"][1]["nodes"].as_array_mut().unwrap();
    for n in nodes.iter_mut() { if let Some(b) = n["op"].get("bucket").and_then(|b| b.as_u64()) { n["op"]["bucket"] = json!(1 - b); } }
    println!("swap-identical:"); show(&from_value(&v));
}
