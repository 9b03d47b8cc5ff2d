// Unquantized weights: one unit is 8 consecutive elements of a row; elements at or past n_in
// (rows of any length) read as 0 and their reads stay inside the row.

fn deq_f32(rb: u32, u: u32) -> W8 {
    var v: array<f32, 8>;
    for (var k = 0u; k < 8u; k++) {
        let e = u * 8u + k;
        v[k] = select(0.0, bitcast<f32>(ld32(rb + e * 4u)), e < p.n_in);
    }
    return W8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}

fn deq_f16(rb: u32, u: u32) -> W8 {
    var v: array<f32, 8>;
    for (var k = 0u; k < 8u; k++) {
        let e = u * 8u + k;
        v[k] = select(0.0, half(ld16(rb + e * 2u)), e < p.n_in);
    }
    return W8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}

fn deq_bf16(rb: u32, u: u32) -> W8 {
    var v: array<f32, 8>;
    for (var k = 0u; k < 8u; k++) {
        let e = u * 8u + k;
        v[k] = select(0.0, bitcast<f32>(ld16(rb + e * 2u) << 16u), e < p.n_in);
    }
    return W8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}
