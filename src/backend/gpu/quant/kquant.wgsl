// The K-quants: 256-element super-blocks. A unit is 8 elements: `uu = u % 32` of super-block
// `u / 32`. For Q4_K/Q5_K, group g = uu / 8 holds 64 elements whose 32 low nibbles are
// sub-block 2g and high nibbles sub-block 2g + 1 (hh = uu % 8 / 4 picks which), and
// part = uu % 4 picks bytes 8·part..+8 of the group's 32. Weights are computed as the scalar
// twins in crates/parity-quant do (same operations, same order).

// ggml's get_scale_min_k4: 6-bit (scale, min) of sub-block j from the 12 bytes at `o`.
fn scale_min_k4(o: u32, j: u32) -> vec2<u32> {
    if (j < 4u) {
        return vec2<u32>(ld8(o + j) & 63u, ld8(o + j + 4u) & 63u);
    }
    let b = ld8(o + j + 4u);
    return vec2<u32>((b & 0xfu) | ((ld8(o + j - 4u) >> 6u) << 4u), (b >> 4u) | ((ld8(o + j) >> 6u) << 4u));
}

// Q4_K (144 bytes): d, dmin: f16, scales: [u8; 12], qs: [u8; 128]; w = d·sc·q − dmin·m.
fn deq_q4_k(rb: u32, u: u32) -> W8 {
    let o = rb + (u >> 5u) * 144u;
    let uu = u & 31u;
    let g = uu >> 3u;
    let hh = (uu >> 2u) & 1u;
    let part = uu & 3u;
    let sm = scale_min_k4(o + 4u, 2u * g + hh);
    let d1 = half(ld16(o)) * f32(sm.x);
    let m1 = half(ld16(o + 2u)) * f32(sm.y);
    let q = o + 16u + 32u * g + 8u * part;
    let a = vec4<f32>(bytes4(ld32(q), 4u * hh, 0xfu));
    let b = vec4<f32>(bytes4(ld32(q + 4u), 4u * hh, 0xfu));
    return W8(d1 * a - m1, d1 * b - m1);
}

// Q5_K (176 bytes): d, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]; as Q4_K with
// a 5th bit: bit 2g + hh of qh[l] for element l of the sub-block.
fn deq_q5_k(rb: u32, u: u32) -> W8 {
    let o = rb + (u >> 5u) * 176u;
    let uu = u & 31u;
    let g = uu >> 3u;
    let hh = (uu >> 2u) & 1u;
    let part = uu & 3u;
    let sm = scale_min_k4(o + 4u, 2u * g + hh);
    let d1 = half(ld16(o)) * f32(sm.x);
    let m1 = half(ld16(o + 2u)) * f32(sm.y);
    let h = o + 16u + 8u * part;
    let bit = 2u * g + hh;
    let q = o + 48u + 32u * g + 8u * part;
    let a = vec4<f32>(bytes4(ld32(q), 4u * hh, 0xfu) + bytes4(ld32(h), bit, 1u) * 16u);
    let b = vec4<f32>(bytes4(ld32(q + 4u), 4u * hh, 0xfu) + bytes4(ld32(h + 4u), bit, 1u) * 16u);
    return W8(d1 * a - m1, d1 * b - m1);
}

// Q6_K (210 bytes): ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16; w = (d·sc)·(q − 32).
// Element 128·half + 32k + l takes the nibble k / 2 of ql[64·half + 32·(k % 2) + l] and bits
// 2k..2k + 2 of qh[32·half + l]; its scale is scales[e / 16].
fn deq_q6_k(rb: u32, u: u32) -> W8 {
    let o = rb + (u >> 5u) * 210u;
    let uu = u & 31u;
    let hf = uu >> 4u;
    let k = (uu >> 2u) & 3u;
    let l0 = 8u * (uu & 3u);
    let sc = f32((bitcast<i32>(ld8(o + 192u + (uu >> 1u)) << 24u)) >> 24u);
    let dl = half(ld16(o + 208u)) * sc;
    let ql = o + 64u * hf + 32u * (k & 1u) + l0;
    let qh = o + 128u + 32u * hf + l0;
    let sl = 4u * (k >> 1u);
    let a = vec4<f32>(bytes4(ld32(ql), sl, 0xfu) | (bytes4(ld32(qh), 2u * k, 3u) << vec4<u32>(4u))) - 32.0;
    let b = vec4<f32>(bytes4(ld32(ql + 4u), sl, 0xfu) | (bytes4(ld32(qh + 4u), 2u * k, 3u) << vec4<u32>(4u))) - 32.0;
    return W8(dl * a, dl * b);
}
