// Attention over the device-resident K/V cache ([n_ctx, n_head_kv · head_dim] per layer).
struct P {
    n_head: u32,
    head_dim: u32,
    n_tokens: u32,
    pos0: u32,
    n_kv: u32,
    // Query heads per kv head (GQA).
    group: u32,
    ekv: u32,
    // Sliding window (0: none).
    window: u32,
    kq_scale: f32,
    // Soft-cap of the scores (0: none).
    cap: f32,
}
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> cache: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn first_visible(pos: u32) -> u32 {
    if p.window > 0u && pos + 1u > p.window {
        return pos + 1u - p.window;
    }
    return 0u;
}

// Probabilities [n_head, T, n_kv] of the queries a = q [T, n_head, head_dim] over the cached
// keys: one workgroup per (head, query); lanes stride over the keys; max and sum are
// workgroup reductions. Keys a query does not see are 0.
@compute @workgroup_size(256)
fn probs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         lane: Lane) {
    let lid = lane.lid;
    let hi = wid.x + wid.y * nwg.x;
    if hi >= p.n_head * p.n_tokens {
        return;
    }
    let h = hi / p.n_tokens;
    let i = hi % p.n_tokens;
    let pos = p.pos0 + i;
    let first = first_visible(pos);
    let q0 = (i * p.n_head + h) * p.head_dim;
    let k0 = (h / p.group) * p.head_dim;
    let o = hi * p.n_kv;
    var m = -3.0e38;
    for (var j = lid; j < p.n_kv; j += WG) {
        if j >= first && j <= pos {
            var s = 0.0;
            for (var d = 0u; d < p.head_dim; d++) {
                s += a[q0 + d] * cache[j * p.ekv + k0 + d];
            }
            s = s * p.kq_scale;
            if p.cap > 0.0 {
                s = tanh(clamp(s / p.cap, -10.0, 10.0)) * p.cap;
            }
            out[o + j] = s;
            m = max(m, s);
        } else {
            out[o + j] = 0.0;
        }
    }
    let mx = wg_max(m, lane);
    var sum = 0.0;
    for (var j = lid; j < p.n_kv; j += WG) {
        if j >= first && j <= pos {
            let e = exp(out[o + j] - mx);
            out[o + j] = e;
            sum += e;
        }
    }
    let inv = 1.0 / wg_sum(sum, lane);
    for (var j = lid; j < p.n_kv; j += WG) {
        if j >= first && j <= pos {
            out[o + j] = out[o + j] * inv;
        }
    }
}

// Σ_j p_j · v_j: a = probabilities, out [T, n_head, head_dim]; one invocation per output.
@compute @workgroup_size(256)
fn values(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let idx = (wid.x + wid.y * nwg.x) * 256u + lid;
    if idx >= p.n_tokens * p.n_head * p.head_dim {
        return;
    }
    let d = idx % p.head_dim;
    let h = (idx / p.head_dim) % p.n_head;
    let i = idx / (p.head_dim * p.n_head);
    let pos = p.pos0 + i;
    let pr = (h * p.n_tokens + i) * p.n_kv;
    let v0 = (h / p.group) * p.head_dim + d;
    var s = 0.0;
    for (var j = first_visible(pos); j <= pos; j++) {
        s += a[pr + j] * cache[j * p.ekv + v0];
    }
    out[idx] = s;
}
