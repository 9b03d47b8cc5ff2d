// The 32-element block formats. A unit is 8 elements: quarter `s = u % 4` of block `u / 4`.
// Nibble formats keep elements j and j + 16 in one byte (low, high nibble), so quarter s
// reads bytes 8·(s % 2)..+8 of the nibbles, shifted by 4·(s / 2).
// Each weight is computed as the scalar twins in crates/parity-quant do (same operations, same order).

// Q8_0 (34 bytes): d: f16, qs: [i8; 32]; w = q·d.
fn deq_q8_0(rb: u32, u: u32) -> W8 {
    let o = rb + (u >> 2u) * 34u;
    let d = half(ld16(o));
    let q = o + 2u + (u & 3u) * 8u;
    let va = ld32(q);
    let vb = ld32(q + 4u);
    // Sign-extend each byte: move it to the top, arithmetic shift back down.
    let sh = vec4<u32>(24u, 16u, 8u, 0u);
    let a = vec4<f32>((bitcast<vec4<i32>>(vec4<u32>(va) << sh)) >> vec4<u32>(24u));
    let b = vec4<f32>((bitcast<vec4<i32>>(vec4<u32>(vb) << sh)) >> vec4<u32>(24u));
    return W8(a * d, b * d);
}

// Q4_0 (18 bytes): d: f16, qs: [u8; 16]; w = (q − 8)·d.
fn deq_q4_0(rb: u32, u: u32) -> W8 {
    let o = rb + (u >> 2u) * 18u;
    let d = half(ld16(o));
    let s = u & 3u;
    let q = o + 2u + (s & 1u) * 8u;
    let sh = (s >> 1u) * 4u;
    let a = vec4<f32>(bytes4(ld32(q), sh, 0xfu)) - 8.0;
    let b = vec4<f32>(bytes4(ld32(q + 4u), sh, 0xfu)) - 8.0;
    return W8(a * d, b * d);
}

// Q4_1 (20 bytes): d: f16, m: f16, qs: [u8; 16]; w = q·d + m.
fn deq_q4_1(rb: u32, u: u32) -> W8 {
    let o = rb + (u >> 2u) * 20u;
    let d = half(ld16(o));
    let m = half(ld16(o + 2u));
    let s = u & 3u;
    let q = o + 4u + (s & 1u) * 8u;
    let sh = (s >> 1u) * 4u;
    let a = vec4<f32>(bytes4(ld32(q), sh, 0xfu));
    let b = vec4<f32>(bytes4(ld32(q + 4u), sh, 0xfu));
    return W8(a * d + m, b * d + m);
}

// The 5th bits of elements 8s..8s+8 from the block's `qh` word, as 0 or 16.
fn hi5(qh: u32, s: u32) -> W8 {
    let bits = (vec4<u32>(qh) >> (vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(8u * s))) & vec4<u32>(1u);
    let bits2 = (vec4<u32>(qh) >> (vec4<u32>(4u, 5u, 6u, 7u) + vec4<u32>(8u * s))) & vec4<u32>(1u);
    return W8(vec4<f32>(bits * 16u), vec4<f32>(bits2 * 16u));
}

// Q5_0 (22 bytes): d: f16, qh: u32, qs: [u8; 16]; w = (q − 16)·d, q = nibble + 16·bit.
fn deq_q5_0(rb: u32, u: u32) -> W8 {
    let o = rb + (u >> 2u) * 22u;
    let d = half(ld16(o));
    let s = u & 3u;
    let h = hi5(ld32(o + 2u), s);
    let q = o + 6u + (s & 1u) * 8u;
    let sh = (s >> 1u) * 4u;
    let a = vec4<f32>(bytes4(ld32(q), sh, 0xfu)) + h.a - 16.0;
    let b = vec4<f32>(bytes4(ld32(q + 4u), sh, 0xfu)) + h.b - 16.0;
    return W8(a * d, b * d);
}

// Q5_1 (24 bytes): d: f16, m: f16, qh: u32, qs: [u8; 16]; w = q·d + m.
fn deq_q5_1(rb: u32, u: u32) -> W8 {
    let o = rb + (u >> 2u) * 24u;
    let d = half(ld16(o));
    let m = half(ld16(o + 2u));
    let s = u & 3u;
    let h = hi5(ld32(o + 4u), s);
    let q = o + 8u + (s & 1u) * 8u;
    let sh = (s >> 1u) * 4u;
    let a = vec4<f32>(bytes4(ld32(q), sh, 0xfu)) + h.a;
    let b = vec4<f32>(bytes4(ld32(q + 4u), sh, 0xfu)) + h.b;
    return W8(a * d + m, b * d + m);
}
