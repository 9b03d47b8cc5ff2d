// Reduction without subgroups: a shared-memory tree over the 256 invocations, CH
// accumulators at a time.
var<workgroup> red: array<f32, 256u * CH>;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    accumulate(lid, wg, nwg);
    for (var b = 0u; b < NA; b += CH) {
        for (var j = 0u; j < CH; j++) {
            red[j * WG + lid] = acc[b + j];
        }
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (lid < s) {
                for (var j = 0u; j < CH; j++) {
                    red[j * WG + lid] += red[j * WG + lid + s];
                }
            }
            workgroupBarrier();
        }
        if (lid < CH) {
            store(b + lid, red[lid * WG], wg, nwg);
        }
        workgroupBarrier();
    }
}
