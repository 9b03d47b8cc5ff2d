// Workgroup reductions in shared memory, for devices without subgroup ops: the same functions
// as reduce_subgroup.wgsl (the host prepends `const CH`, the values one reduction carries),
// each a tree over the 256 lanes, CH values at a time.
const WG: u32 = 256u;

// The invocation's place: each reducing entry point takes it (`lane: Lane`).
struct Lane {
    @builtin(local_invocation_index) lid: u32,
}

var<workgroup> red: array<f32, 256u * CH>;

fn red_put(j: u32, v: f32, lane: Lane) {
    red[j * WG + lane.lid] = v;
}

fn red_combine(lane: Lane) {
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lane.lid < s {
            for (var j = 0u; j < CH; j++) {
                red[j * WG + lane.lid] += red[j * WG + lane.lid + s];
            }
        }
        workgroupBarrier();
    }
}

fn red_total(j: u32, lane: Lane) -> f32 {
    return red[j * WG];
}

fn wg_sum(v: f32, lane: Lane) -> f32 {
    red_put(0u, v, lane);
    red_combine(lane);
    let t = red[0];
    workgroupBarrier();
    return t;
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    red[lane.lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lane.lid < s {
            red[lane.lid] = max(red[lane.lid], red[lane.lid + s]);
        }
        workgroupBarrier();
    }
    let t = red[0];
    workgroupBarrier();
    return t;
}
