mod common;
use common::*;
use overlap_graph::*;
#[test]
fn dump() {
    let plan = four_routes_plan(&[Gate::NoSync, Gate::ReplicateOff, Gate::On]);
    std::fs::write("/tmp/plan3.json", plan.to_json()).unwrap();
    std::fs::write("/tmp/plan3.txt", export::to_text(&plan)).unwrap();
}
