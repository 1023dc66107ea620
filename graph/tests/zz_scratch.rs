mod common;
use common::*;
use overlap_graph::*;
#[test]
fn dump() {
    let plan = Planner::new(spec(
        2,
        1,
        vec![param("w", &[3, 2], Route::Fsdp, 0)],
        1 << 20,
    ))
    .unwrap()
    .plan(&[Gate::ReplicateOff, Gate::On])
    .unwrap();
    std::fs::write("/tmp/tiny.json", plan.to_json()).unwrap();
    println!("{}", export::to_text(&plan));
    let plan = Planner::new(spec(
        1,
        2,
        vec![param("m", &[2, 2], Route::Muon, 0)],
        1 << 20,
    ))
    .unwrap()
    .plan(&[Gate::On])
    .unwrap();
    println!("{}", export::to_text(&plan));
}
