// A broken kernel for the tests (feature `gpu-test-bugs`): y[T, n_out] = x[T, n_in] · W for an
// f32 weight W [n_out rows of n_in] read transposed (W[i · n_out + r] instead of
// W[r · n_in + i]). One workgroup per output row; each token's dot is reduced over the
// workgroup in f32.
struct P {
    n_in: u32,
    n_out: u32,
    n_tokens: u32,
}
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lane: Lane) {
    let lid = lane.lid;
    let r = wid.x + wid.y * nwg.x;
    if r >= p.n_out {
        return;
    }
    for (var t = 0u; t < p.n_tokens; t++) {
        var s = 0.0;
        for (var i = lid; i < p.n_in; i += WG) {
            s += w[i * p.n_out + r] * x[t * p.n_in + i];
        }
        let total = wg_sum(s, lane);
        if lid == 0u {
            y[t * p.n_out + r] = total;
        }
    }
}
