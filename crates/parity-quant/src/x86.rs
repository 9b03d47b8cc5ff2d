//! AVX2 (and F16C) building blocks shared by the block formats' x86 kernels.
//!
//! # Safety
//! Every function is compiled for a subset of `avx2,fma,f16c`: call them from kernels compiled
//! for those features, reached only after [`super::cpu::simd`] returned `Simd::Avx2`.

use std::arch::x86_64::*;

/// The first 32 bytes of `s`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn load_u8x32(s: &[u8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: `s` holds 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// The first 16 bytes of `s`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn load_u8x16(s: &[u8]) -> __m128i {
    let s = &s[..16];
    // SAFETY: `s` holds 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// Store 8 floats to `dst[..8]`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn store_f32x8(dst: &mut [f32], v: __m256) {
    let dst = &mut dst[..8];
    // SAFETY: `dst` holds 8 writable floats; storeu has no alignment requirement.
    unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) }
}

/// One f16 to f32 with F16C. Written in asm because LLVM, seeing only the low 16 bits of
/// `_mm_cvtsi32_si128` used, emits `vpinsrw`, which merges into whatever the register held
/// last: in a decode loop that chained every block's scale to the previous block's final
/// multiply (~14 cycles per Q8_0 block instead of ~5). `vmovd` zero-extends and breaks it.
#[inline]
#[target_feature(enable = "f16c")]
pub(crate) fn f16c_bits(bits: u16) -> f32 {
    let x: __m128;
    // SAFETY: register-only instructions; this function is compiled for F16C.
    unsafe {
        std::arch::asm!(
            "vmovd {x}, {g:e}",
            "vcvtph2ps {x}, {x}",
            g = in(reg) u32::from(bits),
            x = lateout(xmm_reg) x,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    _mm_cvtss_f32(x)
}

/// The f16 at `b[0..2]` as f32, with F16C (see [`f16c_bits`]).
#[inline]
#[target_feature(enable = "f16c")]
pub(crate) fn f16c_at(b: &[u8]) -> f32 {
    f16c_bits(u16::from_le_bytes([b[0], b[1]]))
}

/// `d * s[i] as f32` for the 16 signed bytes of `s` (a super-block's sub-block scales),
/// rounded exactly as the scalar products. Pass the array through [`in_memory`] so that each
/// use is a broadcast load.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn scales_x16(s: __m128i, d: f32) -> [f32; 16] {
    let d = _mm256_set1_ps(d);
    let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s));
    let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(s)));
    let mut out = [0f32; 16];
    store_f32x8(&mut out[..8], _mm256_mul_ps(d, lo));
    store_f32x8(&mut out[8..], _mm256_mul_ps(d, hi));
    out
}

/// The 8 scales (bytes 0..8) and 8 mins (bytes 8..16) of a Q4_K or Q5_K block's 12 packed
/// bytes, all at once: [`crate::ggml::get_scale_min_k4`] for j = 0..8, by whole-word shifts and
/// masks.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn scales_mins_x16(s: &[u8]) -> __m128i {
    let s = &s[..12];
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    let sc_lo = w0 & LOW6;
    let sc_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
    let m_lo = w1 & LOW6;
    let m_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
    _mm_set_epi32(m_hi as i32, m_lo as i32, sc_hi as i32, sc_lo as i32)
}

/// `a`, opaque to the optimizer, so that an `a[i]` later splat across a vector is a
/// broadcast load (a load port only). Otherwise LLVM keeps a small array of scales in
/// registers and makes each splat a shuffle plus a register broadcast, two uops on the
/// shuffle port that the decoders' widening already saturates.
#[inline(always)]
pub(crate) fn in_memory<T: ?Sized>(a: &T) -> &T {
    std::hint::black_box(a)
}

/// A super-block's quants as signed bytes, staged in memory between a decoder's integer
/// phase and its float phase: widening straight from memory (`vpmovsxbd ymm, m64`) costs
/// one shuffle uop per 8 outputs, where widening from a register adds extracts and byte
/// shifts on the same port.
#[repr(align(32))]
pub(crate) struct Staged(pub [u8; 256]);

impl Staged {
    pub(crate) fn new() -> Self {
        Staged([0; 256])
    }

    /// Quants `32·i .. 32·i + 32`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn put(&mut self, i: usize, q: __m256i) {
        let s = &mut self.0[32 * i..32 * i + 32];
        // SAFETY: `s` holds 32 writable bytes; storeu has no alignment requirement.
        unsafe { _mm256_storeu_si256(s.as_mut_ptr().cast(), q) }
    }

    /// Quants `16·i .. 16·i + 16`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn put16(&mut self, i: usize, q: __m128i) {
        let s = &mut self.0[16 * i..16 * i + 16];
        // SAFETY: `s` holds 16 writable bytes; storeu has no alignment requirement.
        unsafe { _mm_storeu_si128(s.as_mut_ptr().cast(), q) }
    }
}

/// 8 signed bytes at `q[..8]` as 8 f32 (exact).
#[inline]
#[target_feature(enable = "avx2")]
fn widen_i8x8(q: &[u8]) -> __m256 {
    let q = &q[..8];
    // SAFETY: `q` holds 8 readable bytes; loadl has no alignment requirement.
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(unsafe {
        _mm_loadl_epi64(q.as_ptr().cast())
    }))
}

/// `y[i] = d[i / G] * q[i]` (signed bytes `q`), each rounded like the scalar `d * q as f32`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn scale_groups<const G: usize>(q: &[u8], d: &[f32], y: &mut [f32]) {
    for ((q, y), &d) in q.chunks_exact(G).zip(y.chunks_exact_mut(G)).zip(d) {
        let d = _mm256_set1_ps(d);
        for (q, y) in q.chunks_exact(8).zip(y.chunks_exact_mut(8)) {
            store_f32x8(y, _mm256_mul_ps(d, widen_i8x8(q)));
        }
    }
}

/// `y[i] = d[i / G] * q[i] - m[i / G]`: a multiply then a subtract, no FMA, as the scalar.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn affine_groups<const G: usize>(q: &[u8], d: &[f32], m: &[f32], y: &mut [f32]) {
    for (((q, y), &d), &m) in q.chunks_exact(G).zip(y.chunks_exact_mut(G)).zip(d).zip(m) {
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        for (q, y) in q.chunks_exact(8).zip(y.chunks_exact_mut(8)) {
            store_f32x8(y, _mm256_sub_ps(_mm256_mul_ps(d, widen_i8x8(q)), m));
        }
    }
}

/// `y[i] = q[i] * d[i / G] + m[i / G]`: a multiply then an add, no FMA, as the scalar.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn offset_groups<const G: usize>(q: &[u8], d: &[f32], m: &[f32], y: &mut [f32]) {
    for (((q, y), &d), &m) in q.chunks_exact(G).zip(y.chunks_exact_mut(G)).zip(d).zip(m) {
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        for (q, y) in q.chunks_exact(8).zip(y.chunks_exact_mut(8)) {
            store_f32x8(y, _mm256_add_ps(_mm256_mul_ps(widen_i8x8(q), d), m));
        }
    }
}

/// `dst[i] = d * q[i]` for the 16 signed bytes of `q`, rounded exactly like the scalar
/// `d * q as f32` (the int → float conversion is exact).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn store_scaled_i8x16(dst: &mut [f32], q: __m128i, d: f32) {
    let d = _mm256_set1_ps(d);
    let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q)));
    store_f32x8(&mut dst[..8], _mm256_mul_ps(d, lo));
    store_f32x8(&mut dst[8..16], _mm256_mul_ps(d, hi));
}

/// Sum of the 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum_i32x8(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The low 128 bits of `v`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn lo128(v: __m256i) -> __m128i {
    _mm256_castsi256_si128(v)
}

/// The high 128 bits of `v`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hi128(v: __m256i) -> __m128i {
    _mm256_extracti128_si256::<1>(v)
}

/// 16 i16 lanes: `a` in the low 8, `b` in the high 8 (per-16-element scales for `madd`).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn set_i16_halves(a: i16, b: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a))
}

/// The 32 nibbles of `qs[0..16]` as bytes: low nibbles in bytes 0..16, high in 16..32
/// (ggml's element order for 4-bit blocks).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn nibbles_32(qs: &[u8; 16]) -> __m256i {
    // SAFETY: `qs` is 16 readable bytes; loadu has no alignment requirement.
    let v = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Byte j is 0xFF where bit j of `bits` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn bits_32(bits: u32) -> __m256i {
    // Byte j gets source byte j/8 of `bits`, then tests bit j%8 of it.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0,
        ),
    );
    let sel = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel)
}

/// 32 signed bytes times 32 signed bytes, summed exactly in fours: i32 lane k holds
/// `sum(x[i]*y[i], i in 4k..4k+4)`, the lane layout of ggml's `mul_sum_i8_pairs_float`.
/// Widening to i16 first keeps it exact for every input, -128 included (ggml's
/// `maddubs` sign trick is not when `y` holds -128).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn dot_i8_lanes(x: __m256i, y: __m256i) -> __m256i {
    let lo = _mm256_madd_epi16(
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)),
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(y)),
    );
    let hi = _mm256_madd_epi16(
        _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(x)),
        _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(y)),
    );
    // hadd leaves the 64-bit quarters as [0..8, 16..24, 8..16, 24..32]; put them in order.
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_hadd_epi32(lo, hi))
}

/// Sum of 8 lanes in ggml's `hsum_float_8` order, so results match its AVX2 kernels.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn hsum_f32x8(x: __m256) -> f32 {
    let mut r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// `y[i] = q[i] as f32 * d` for 32 signed bytes: the whole of a 32-element block decode.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn store_scaled(q: __m256i, d: f32, y: &mut [f32; 32]) {
    let d = _mm256_set1_ps(d);
    for (k, v) in widen_i8x32(q).into_iter().enumerate() {
        // SAFETY: k < 4, so `y[8k..8k+8]` is in bounds.
        unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(8 * k), _mm256_mul_ps(v, d)) };
    }
}

/// `y[i] = q[i] as f32 * d + m` (separate multiply and add, as ggml's scalar code).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn store_scaled_offset(q: __m256i, d: f32, m: f32, y: &mut [f32; 32]) {
    let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
    for (k, v) in widen_i8x32(q).into_iter().enumerate() {
        let r = _mm256_add_ps(_mm256_mul_ps(v, d), m);
        // SAFETY: k < 4, so `y[8k..8k+8]` is in bounds.
        unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(8 * k), r) };
    }
}

/// Eight f16 bit patterns as f32, in one `vcvtph2ps`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn f16x8(bits: &[u16; 8]) -> [f32; 8] {
    let mut out = [0f32; 8];
    // SAFETY: `bits` is 16 readable bytes and `out` 32 writable ones; no alignment needed.
    unsafe {
        let v = _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr().cast()));
        _mm256_storeu_ps(out.as_mut_ptr(), v);
    }
    out
}

/// The decode loop of the 32-element block formats: `y = q·d` (`offset = false`) or
/// `y = q·d + m` (`offset = true`, `m` the f16 at byte 2), with `d` the f16 at byte 0 and
/// `$quants` the block's 32 quants as signed bytes, for `$b` bound to the block's bytes.
/// Eight blocks at a time: their quants staged in memory (see `x86::Staged`), their scales
/// converted by one `vcvtph2ps` and kept in memory for broadcast loads; the last blocks
/// one by one. A macro, not a closure, so that `$quants` is compiled inside the caller's
/// `#[target_feature]` function.
macro_rules! dequant_b32 {
    ($src:expr, $dst:expr, $bytes:expr, offset = $offset:expr, |$b:ident| $quants:expr) => {{
        use crate::x86::{Staged, in_memory, offset_groups, scale_groups};
        let (src, dst): (&[u8], &mut [f32]) = ($src, $dst);
        let blocks = (src.len() / $bytes).min(dst.len() / 32);
        let full = blocks / 8 * 8;
        let (head, tail) = src[..blocks * $bytes].split_at(full * $bytes);
        let (y_head, y_tail) = dst[..blocks * 32].split_at_mut(full * 32);
        for (s8, y) in head
            .chunks_exact(8 * $bytes)
            .zip(y_head.chunks_exact_mut(256))
        {
            let mut q = Staged::new();
            let (mut d, mut m) = ([0u16; 8], [0u16; 8]);
            for (i, $b) in s8.chunks_exact($bytes).enumerate() {
                q.put(i, $quants);
                d[i] = u16::from_le_bytes([$b[0], $b[1]]);
                if $offset {
                    m[i] = u16::from_le_bytes([$b[2], $b[3]]);
                }
            }
            let d = f16x8(&d);
            if $offset {
                let m = f16x8(&m);
                offset_groups::<32>(&in_memory(&q).0, in_memory(&d), in_memory(&m), y);
            } else {
                scale_groups::<32>(&in_memory(&q).0, in_memory(&d), y);
            }
        }
        for ($b, y) in tail.chunks_exact($bytes).zip(y_tail.chunks_exact_mut(32)) {
            let (q, y) = ($quants, y.try_into().unwrap());
            if $offset {
                store_scaled_offset(q, f16c_at($b), f16c_at(&$b[2..]), y);
            } else {
                store_scaled(q, f16c_at($b), y);
            }
        }
    }};
}
pub(crate) use dequant_b32;

/// 32 signed bytes to four vectors of 8 f32 (exact), in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_i8x32(q: __m256i) -> [__m256; 4] {
    let lo = _mm256_castsi256_si128(q);
    let hi = _mm256_extracti128_si256::<1>(q);
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi))),
    ]
}
