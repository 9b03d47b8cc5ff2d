// Workgroup reductions in shared memory, for devices without subgroup ops: the same functions
// as reduce_subgroup.wgsl (the host prepends `const CH`, the values one `wg_sums` call
// reduces), each a tree over the 256 lanes, CH values at a time.
const WG: u32 = 256u;

// The invocation's place: each reducing entry point takes it (`lane: Lane`).
struct Lane {
    @builtin(local_invocation_index) lid: u32,
}

var<workgroup> red: array<f32, 256u * CH>;

// The workgroup's sums of each lane's v[j].
fn wg_sums(v: array<f32, CH>, lane: Lane) -> array<f32, CH> {
    var a = v;
    for (var j = 0u; j < CH; j++) {
        red[j * WG + lane.lid] = a[j];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lane.lid < s {
            for (var j = 0u; j < CH; j++) {
                red[j * WG + lane.lid] += red[j * WG + lane.lid + s];
            }
        }
        workgroupBarrier();
    }
    var out: array<f32, CH>;
    for (var j = 0u; j < CH; j++) {
        out[j] = red[j * WG];
    }
    workgroupBarrier();
    return out;
}

fn wg_sum(v: f32, lane: Lane) -> f32 {
    var a: array<f32, CH>;
    a[0] = v;
    return wg_sums(a, lane)[0];
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
