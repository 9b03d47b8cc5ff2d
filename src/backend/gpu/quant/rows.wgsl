// y[i, :] = W[ids[i], :] decoded to f32 (embedding rows, or a whole tensor with ids 0..n):
// each invocation decodes one unit of 8 elements with the same decoder the matmul uses. The
// host dispatches once per window of rows bound from `w` (and of ids, y); ids outside the
// window are left to the dispatch whose window holds them, ids past the tensor to nobody.

struct Params {
    n_in: u32,
    // Rows in the bound window, and the index of its first row in the tensor.
    n_rows: u32,
    row0: u32,
    row_bytes: u32,
    w_off: u32,
    // Ids in this dispatch, and element offsets of the first in the bound windows of ids, y.
    n_ids: u32,
    ids_off: u32,
    y_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let units = (p.n_in + 7u) / 8u;
    let g = (wg.y * nwg.x + wg.x) * 256u + lid;
    let i = g / units;
    let u = g % units;
    if (i >= p.n_ids) {
        return;
    }
    let id = ids[p.ids_off + i];
    if (id < p.row0 || id - p.row0 >= p.n_rows) {
        return;
    }
    let v = DEQ(p.w_off + (id - p.row0) * p.row_bytes, u);
    let e = u * 8u;
    let o = p.y_off + i * p.n_in + e;
    for (var k = 0u; k < 4u; k++) {
        if (e + k < p.n_in) {
            y[o + k] = v.a[k];
        }
        if (e + 4u + k < p.n_in) {
            y[o + 4u + k] = v.b[k];
        }
    }
}
