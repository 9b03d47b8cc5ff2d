// Workgroup reductions with subgroup ops, for every kernel that reduces (norms, attention,
// the matmuls). The host prepends `const CH`: how many values one reduction carries (1 for
// the norms and attention, a matmul tile's accumulators). A reduction of values 0..CH is
// `red_put(j, v, lane)` for each j, `red_combine(lane)`, then `red_total(j, lane)` on any lane,
// and a `workgroupBarrier()` before the next one. Each subgroup adds in registers and its
// first lane leaves the partial in shared memory, indexed by subgroup_id (any grouping of
// lanes into subgroups of 4 or more: at most 64 of a 256-invocation workgroup); a total adds
// the partials in subgroup order. `wg_sum` and `wg_max` hand one value's total to every lane,
// summed by one lane: every lane summing made each reduction cost far more on a CPU device
// (lavapipe).
const WG: u32 = 256u;

// The invocation's place: each reducing entry point takes it (`lane: Lane`).
struct Lane {
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_invocation_id) sl: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) ns: u32,
}

var<workgroup> part: array<f32, 64u * CH>;
var<workgroup> total: f32;

fn red_put(j: u32, v: f32, lane: Lane) {
    let s = subgroupAdd(v);
    if lane.sl == 0u {
        part[lane.sg * CH + j] = s;
    }
}

fn red_combine(lane: Lane) {
    workgroupBarrier();
}

fn red_total(j: u32, lane: Lane) -> f32 {
    var t = 0.0;
    for (var g = 0u; g < lane.ns; g++) {
        t += part[g * CH + j];
    }
    return t;
}

// A following reduction writes `part` first and `total` only after its first barrier, which
// every lane reaches after reading `total` here.
fn wg_sum(v: f32, lane: Lane) -> f32 {
    red_put(0u, v, lane);
    red_combine(lane);
    if lane.lid == 0u {
        total = red_total(0u, lane);
    }
    workgroupBarrier();
    return total;
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    let s = subgroupMax(v);
    if lane.sl == 0u {
        part[lane.sg * CH] = s;
    }
    workgroupBarrier();
    if lane.lid == 0u {
        var t = -3.0e38;
        for (var g = 0u; g < lane.ns; g++) {
            t = max(t, part[g * CH]);
        }
        total = t;
    }
    workgroupBarrier();
    return total;
}
