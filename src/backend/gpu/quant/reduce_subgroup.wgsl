// Reduction by subgroupAdd: each subgroup's sum goes to shared memory by its first
// invocation, then one invocation per accumulator adds the subgroups' sums. Indexed by
// subgroup_id, so it holds whichever invocations the device puts in a subgroup, of any size
// from 4 (at most 64 subgroups of a 256-invocation workgroup).
var<workgroup> part: array<f32, 64u * NA>;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_invocation_id) sl: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) ns: u32,
) {
    accumulate(lid, wg, nwg);
    for (var i = 0u; i < NA; i++) {
        let s = subgroupAdd(acc[i]);
        if (sl == 0u) {
            part[sg * NA + i] = s;
        }
    }
    workgroupBarrier();
    if (lid < NA) {
        var s = 0.0;
        for (var g = 0u; g < ns; g++) {
            s += part[g * NA + lid];
        }
        store(lid, s, wg, nwg);
    }
}
