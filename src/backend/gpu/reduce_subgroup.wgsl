// Workgroup reductions with subgroup ops, for every kernel that reduces (norms, attention,
// the matmuls). The host prepends `const CH`: how many values one `wg_sums` call reduces (1
// for the norms and attention, up to 8 for a matmul tile). Each subgroup reduces in registers
// and its first lane leaves the partial in shared memory, indexed by subgroup_id (any grouping
// of lanes into subgroups of 4 or more: at most 64 of a 256-invocation workgroup); lane j < CH
// adds value j's partials in subgroup order, and every lane reads the totals. One lane per
// value sums, not all: every lane looping over the partials made each reduction cost 256 ×
// 256 loads on a CPU device (lavapipe).
const WG: u32 = 256u;

// The invocation's place: each reducing entry point takes it (`lane: Lane`).
struct Lane {
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_invocation_id) sl: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) ns: u32,
}

var<workgroup> part: array<f32, 64u * CH>;
var<workgroup> total: array<f32, CH>;

// The workgroup's sums of each lane's v[j]. A following call writes `part` first and `total`
// only after its first barrier, which every lane reaches after reading the totals here.
fn wg_sums(v: array<f32, CH>, lane: Lane) -> array<f32, CH> {
    var a = v;
    for (var j = 0u; j < CH; j++) {
        let s = subgroupAdd(a[j]);
        if lane.sl == 0u {
            part[lane.sg * CH + j] = s;
        }
    }
    workgroupBarrier();
    if lane.lid < CH {
        var t = 0.0;
        for (var g = 0u; g < lane.ns; g++) {
            t += part[g * CH + lane.lid];
        }
        total[lane.lid] = t;
    }
    workgroupBarrier();
    var out: array<f32, CH>;
    for (var j = 0u; j < CH; j++) {
        out[j] = total[j];
    }
    return out;
}

fn wg_sum(v: f32, lane: Lane) -> f32 {
    var a: array<f32, CH>;
    a[0] = v;
    return wg_sums(a, lane)[0];
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
        total[0] = t;
    }
    workgroupBarrier();
    return total[0];
}
