// RoPE in place on x [T, n_heads, head_dim]: one invocation per rotated pair. The angles'
// cos and sin come from the host (cs [T, n_rot/2, 2], computed as ggml's rope cache): WGSL
// only promises sin/cos to 2^-11 absolute, far coarser than any engine's table.
struct P {
    n_heads: u32,
    head_dim: u32,
    n_rot: u32,
    // 0: pairs (2i, 2i+1) (NORM); 1: pairs (i, i + n_rot/2) (NEOX).
    neox: u32,
    pairs: u32,
}
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> cs: array<f32>;

@compute @workgroup_size(256)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let idx = (wid.x + wid.y * nwg.x) * 256u + lid;
    if idx >= p.pairs {
        return;
    }
    let half = p.n_rot / 2u;
    let i = idx % half;
    let th = idx / half;
    let h = th % p.n_heads;
    let t = th / p.n_heads;
    let base = (t * p.n_heads + h) * p.head_dim;
    var a = base + 2u * i;
    var b = a + 1u;
    if p.neox != 0u {
        a = base + i;
        b = base + i + half;
    }
    let c = cs[(t * half + i) * 2u];
    let s = cs[(t * half + i) * 2u + 1u];
    let x0 = x[a];
    let x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
}
