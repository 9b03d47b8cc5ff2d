// Workgroup reductions with subgroup ops: each subgroup reduces in registers, one elected
// lane per subgroup leaves its partial in shared memory, and the first invocation sums the
// partials in invocation order (no assumption about how lanes are grouped into subgroups) and
// hands the total to all. One lane sums, not all: every lane looping over all 256 slots made
// each reduction cost 256 × 256 loads, which dominated a CPU device's (lavapipe's) run time.
const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;
var<workgroup> red_total: f32;

// The subgroup's first lane (WGSL's subgroupElect, which Naga lacks).
fn sg_first() -> bool {
    return subgroupExclusiveAdd(1u) == 0u;
}

fn sg_size() -> u32 {
    return subgroupAdd(1u);
}

fn wg_sum(v: f32, lid: u32) -> f32 {
    let s = subgroupAdd(v);
    red[lid] = select(0.0, s, sg_first());
    workgroupBarrier();
    if lid == 0u {
        var t = 0.0;
        for (var k = 0u; k < WG; k++) {
            t += red[k];
        }
        red_total = t;
    }
    workgroupBarrier();
    // The next reduction's writes come after its first barrier, which every lane reaches only
    // after this read.
    return red_total;
}

fn wg_max(v: f32, lid: u32) -> f32 {
    let s = subgroupMax(v);
    red[lid] = select(-3.0e38, s, sg_first());
    workgroupBarrier();
    if lid == 0u {
        var t = -3.0e38;
        for (var k = 0u; k < WG; k++) {
            t = max(t, red[k]);
        }
        red_total = t;
    }
    workgroupBarrier();
    return red_total;
}
