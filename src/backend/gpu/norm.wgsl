// RMSNorm of each row of width n (the model's rows, or each head for q/k norms), times the
// weight w[n]: one workgroup per row, the sum of squares reduced over the workgroup in f32.
struct P {
    n: u32,
    rows: u32,
    eps: f32,
}
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, lane: Lane) {
    let lid = lane.lid;
    let row = wid.x + wid.y * nwg.x;
    if row >= p.rows {
        return;
    }
    let base = row * p.n;
    var s = 0.0;
    for (var i = lid; i < p.n; i += WG) {
        let v = x[base + i];
        s += v * v;
    }
    let total = wg_sum(s, lane);
    let scale = 1.0 / sqrt(total / f32(p.n) + p.eps);
    for (var i = lid; i < p.n; i += WG) {
        y[base + i] = (x[base + i] * scale) * w[i];
    }
}
