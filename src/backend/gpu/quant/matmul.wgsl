// y[t, row] = Σ_k x[t, k] · W[row, k], W in its GGUF bytes. One workgroup of 256 invocations
// computes R rows for TT tokens: all its invocations split each row's K in units of 8
// elements (neighbouring invocations read neighbouring bytes), each unit's weights are
// decoded once and used for every token of the tile (one weight read per TT tokens), sums in
// f32. The rows of the grid are split over x and y (≤ 65535 workgroups per dimension), token
// tiles over z. x, y and w are bound in windows (the host splits rows and tokens so that each
// fits one binding); offsets inside them are in Params. The host prepends `const TT` and
// `const CH` (accumulators per reduction), names the format's decoder as `DEQ`, and appends
// the decoders and the device's reduction (`red_*`, `WG`, `Lane`: ../reduce_*.wgsl).

const R: u32 = 4u;
const NA: u32 = R * TT;

struct Params {
    n_in: u32,
    // Rows in this dispatch (a window of the weight: see `encode_at`).
    n_rows: u32,
    // Tokens in this dispatch.
    n_tokens: u32,
    row_bytes: u32,
    // Byte offset of the window's first row inside the bound range of `w`.
    w_off: u32,
    // Index of the window's first row in a row of y.
    row0: u32,
    n_out: u32,
    // Element offsets of the dispatch's first token in the bound windows of x and y.
    x_off: u32,
    y_off: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// acc[r * TT + t]: this invocation's partial sum of row r, token t of the tile.
var<private> acc: array<f32, NA>;

// The tile's first row (in the window) and first token.
fn tile(wg: vec3<u32>, nwg: vec3<u32>) -> vec2<u32> {
    return vec2<u32>((wg.y * nwg.x + wg.x) * R, wg.z * TT);
}

fn accumulate(lid: u32, wg: vec3<u32>, nwg: vec3<u32>) {
    for (var i = 0u; i < NA; i++) {
        acc[i] = 0.0;
    }
    let tl = tile(wg, nwg);
    let r0 = tl.x;
    let t0 = tl.y;
    // Workgroups past the last row (the grid is a rectangle) or token do nothing.
    if (r0 >= p.n_rows || t0 >= p.n_tokens) {
        return;
    }
    let nt = min(TT, p.n_tokens - t0);
    let nr = min(R, p.n_rows - r0);
    let n_units = (p.n_in + 7u) / 8u;
    for (var u = lid; u < n_units; u += WG) {
        var wr: array<W8, R>;
        for (var r = 0u; r < R; r++) {
            if (r < nr) {
                wr[r] = DEQ(p.w_off + (r0 + r) * p.row_bytes, u);
            } else {
                wr[r] = W8(vec4<f32>(0.0), vec4<f32>(0.0));
            }
        }
        let e = u * 8u;
        for (var t = 0u; t < TT; t++) {
            if (t < nt) {
                let xo = p.x_off + (t0 + t) * p.n_in + e;
                var xa: vec4<f32>;
                var xb: vec4<f32>;
                if (e + 8u <= p.n_in) {
                    xa = vec4<f32>(x[xo], x[xo + 1u], x[xo + 2u], x[xo + 3u]);
                    xb = vec4<f32>(x[xo + 4u], x[xo + 5u], x[xo + 6u], x[xo + 7u]);
                } else {
                    // The tail of a row of an unquantized type: K need not be a multiple of 8.
                    var v: array<f32, 8>;
                    for (var k = 0u; k < 8u; k++) {
                        v[k] = select(0.0, x[xo + min(k, p.n_in - e - 1u)], e + k < p.n_in);
                    }
                    xa = vec4<f32>(v[0], v[1], v[2], v[3]);
                    xb = vec4<f32>(v[4], v[5], v[6], v[7]);
                }
                for (var r = 0u; r < R; r++) {
                    acc[r * TT + t] += dot(wr[r].a, xa) + dot(wr[r].b, xb);
                }
            }
        }
    }
}

// Write the workgroup's total for accumulator i, if its row and token exist.
fn store(i: u32, v: f32, wg: vec3<u32>, nwg: vec3<u32>) {
    let tl = tile(wg, nwg);
    let row = tl.x + i / TT;
    let tok = tl.y + i % TT;
    if (row < p.n_rows && tok < p.n_tokens) {
        y[p.y_off + tok * p.n_out + p.row0 + row] = v;
    }
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lane: Lane) {
    accumulate(lane.lid, wg, nwg);
    for (var b = 0u; b < NA; b += CH) {
        for (var j = 0u; j < CH; j++) {
            red_put(j, acc[b + j], lane);
        }
        red_combine(lane);
        if (lane.lid < CH) {
            store(b + lane.lid, red_total(lane.lid, lane), wg, nwg);
        }
        workgroupBarrier();
    }
}
