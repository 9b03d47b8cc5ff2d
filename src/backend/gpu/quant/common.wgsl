// Byte-addressed reads from the weight buffer, bound as `array<u32>`: GGUF blocks of 18, 34,
// 210, ... bytes start at any byte, so every field is read through these (ggml-webgpu's way).
// `upload_weight` pads to whole words, so every byte of a field lies in a word of the bound
// window; a word read past the window (the unused half of an aligned `ld32` at the very end)
// is a robust-access read whose value is discarded.

// The 4 bytes at byte offset `o`, little endian. Branch-free (neighbouring invocations read
// blocks at different alignments): both words are read, and WGSL takes a runtime shift
// amount modulo 32, so the aligned case (a shift by 32) is selected away, not computed.
fn ld32(o: u32) -> u32 {
    let i = o >> 2u;
    let s = (o & 3u) * 8u;
    let lo = w[i];
    return select((lo >> s) | (w[i + 1u] << (32u - s)), lo, s == 0u);
}

fn ld16(o: u32) -> u32 {
    return ld32(o) & 0xffffu;
}

fn ld8(o: u32) -> u32 {
    return (w[o >> 2u] >> ((o & 3u) * 8u)) & 0xffu;
}

// IEEE half to f32, exactly (subnormals, infinities and NaN payloads kept); done by hand
// because unpack2x16float may flush subnormal halves. Branch-free.
fn half(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    // Subnormal: m·2⁻²⁴ is exact in f32 and a normal number.
    let sub = bitcast<u32>(f32(m) * 5.9604644775390625e-8);
    let normal = ((e + 112u) << 23u) | (m << 13u);
    let special = 0x7f800000u | (m << 13u);
    return bitcast<f32>(sign | select(select(normal, special, e == 31u), sub, e == 0u));
}

// Eight weights, as two vec4 (elements 0..4 and 4..8 of a unit).
struct W8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

// The 4 bytes of `v` as unsigned values, each shifted right by `s` bits and masked.
fn bytes4(v: u32, s: u32, mask: u32) -> vec4<u32> {
    return (vec4<u32>(v) >> (vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>(s))) & vec4<u32>(mask);
}
