// y[T, n_out] = x[T, n_in] · Wᵀ for an f32 weight W [n_out rows of n_in]: one workgroup per
// output row; the lanes stride over the row (coalesced), each token's dot is reduced over the
// workgroup in f32. The row is read from memory once per forward (the T tokens reuse it from
// cache).
struct P {
    n_in: u32,
    n_out: u32,
    n_tokens: u32,
    // Test-only bug: read W transposed (W[i · n_out + r] instead of W[r · n_in + i]).
    bug: u32,
}
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let r = wid.x + wid.y * nwg.x;
    if r >= p.n_out {
        return;
    }
    for (var t = 0u; t < p.n_tokens; t++) {
        var s = 0.0;
        for (var i = lid; i < p.n_in; i += WG) {
            var wi = r * p.n_in + i;
            if p.bug != 0u {
                wi = i * p.n_out + r;
            }
            s += w[wi] * x[t * p.n_in + i];
        }
        let total = wg_sum(s, lid);
        if lid == 0u {
            y[t * p.n_out + r] = total;
        }
    }
}
