//! Q4_0: blocks of 32, `d: f16` then 16 bytes of nibbles. Element j is the low nibble of
//! `qs[j]`, element j+16 the high nibble; `x = (q - 8) * d`. Paired with Q8_0 activations.

use super::cpu::dispatch;
use super::ggml::{c_float_to_byte, f16_le, put_f16};
use super::q8_0;
use super::tile::{self, TileAct};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 18;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(Q4_0, "q4_0", vec_dot_type: Q8_0, tile: Some(super::Tile::Q8_0(vec_dot_tile)), exact: Some(vec_dot_tile_exact));

// The block layout adds up.
const _: () = assert!(BYTES == 2 + BLOCK / 2);

/// ggml's `dequantize_row_q4_0`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
        let d = f16_le(b);
        for (j, &q) in b[2..].iter().enumerate() {
            y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// [`dequantize_scalar`], vectorised; bit-identical output.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `quantize_row_q4_0_ref`: `d = -max/8` with `max` the signed value of largest
/// magnitude (so it lands exactly on q = 0), `q = min(15, trunc(x/d + 8.5))`.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, d);
        // ggml: `MIN(15, (int8_t)(x*id + 8.5f))`.
        let q = |v: f32| (c_float_to_byte(v * id + 8.5) as i8).min(15) as u8;
        for j in 0..16 {
            b[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
        }
    }
}

/// Dot product of a Q4_0 weight row with a Q8_0 activation row, as ggml's
/// `ggml_vec_dot_q4_0_q8_0_generic`: `sumf += sumi * d_w * d_a` per block.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    let mut sumf = 0.0f32;
    for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_0::BYTES)) {
        let qa = &ba[2..];
        let mut sumi = 0i32;
        for (j, &q) in bw[2..].iter().enumerate() {
            sumi += ((q & 0x0F) as i32 - 8) * qa[j] as i8 as i32;
            sumi += ((q >> 4) as i32 - 8) * qa[j + 16] as i8 as i32;
        }
        sumf += sumi as f32 * f16_le(bw) * f16_le(ba);
    }
    sumf
}

/// [`vec_dot_scalar`], vectorised. Per-block integer sums are identical; the float sum follows
/// ggml's AVX2 kernel (8 FMA lanes, `hsum_float_8`), so it may differ from the scalar twin by
/// rounding.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_scalar)
}

/// `out[r * a.rows() + t] = vec_dot(w_r, a_t)` for every Q4_0 weight row `w_r` of `w` (whole
/// rows of `a.n()` elements back to back) and every activation row `a_t`: the same numbers as
/// [`vec_dot`], bit for bit, computed four rows and two tokens at a time (each weight block is
/// decoded once per token pair, each activation block loaded once per four rows, eight
/// independent accumulators).
pub fn vec_dot_tile(w: &[u8], a: &TileAct, out: &mut [f32]) {
    tile_with(super::cpu::use_vnni(), w, a, out)
}

/// [`vec_dot_tile`], choosing whether the AVX-VNNI kernel may be used (tests run both).
fn tile_with(vnni: bool, w: &[u8], a: &TileAct, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let kernels = Some([
        x86::vec_dot_tile as tile::Driver,
        x86::vec_dot_tile_vnni,
        x86::vec_dot_tile_vnni512,
    ]);
    #[cfg(not(target_arch = "x86_64"))]
    let kernels = None;
    tile::run(BYTES, vnni, w, a, out, kernels, vec_dot)
}

/// The exact dot of a Q4_0 weight row with a Q8_0 activation row (parity's reference on
/// ggml-cpu's grid): integer per block, summed in f64 (`tile::exact_dot_scalar`).
pub fn vec_dot_exact_scalar(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    tile::exact_dot_scalar(w, a, BYTES, |b| {
        let mut q = [0i32; 32];
        for (j, &v) in b[2..].iter().enumerate() {
            q[j] = (v & 0x0F) as i32 - 8;
            q[j + 16] = (v >> 4) as i32 - 8;
        }
        q
    })
}

/// [`vec_dot_exact_scalar`] for every weight row × activation row, as [`vec_dot_tile`] lays
/// them out: the same bits, four rows and two tokens at a time.
pub fn vec_dot_tile_exact(w: &[u8], a: &TileAct, out: &mut [f32]) {
    exact_with(super::cpu::use_vnni(), w, a, out)
}

/// [`vec_dot_tile_exact`], choosing whether the AVX-VNNI kernel may be used (tests run both).
fn exact_with(vnni: bool, w: &[u8], a: &TileAct, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let kernels = Some([
        x86::vec_dot_tile_f64 as tile::Driver,
        x86::vec_dot_tile_f64_vnni,
        x86::vec_dot_tile_f64_vnni512,
    ]);
    #[cfg(not(target_arch = "x86_64"))]
    let kernels = None;
    tile::run(BYTES, vnni, w, a, out, kernels, vec_dot_exact_scalar)
}

fn check_rows(w: &[u8], a: &[u8]) {
    assert_eq!(
        w.len() / BYTES,
        a.len() / q8_0::BYTES,
        "q4_0 · q8_0: rows differ in length"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::q8_0;
    use super::super::tile::TileBlock;
    use super::super::x86::*;
    use super::{BLOCK, BYTES};
    use std::arch::x86_64::*;

    /// The block's quants as signed bytes `q - 8`, in element order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn quants(b: &[u8]) -> __m256i {
        _mm256_sub_epi8(
            nibbles_32(b[2..18].try_into().unwrap()),
            _mm256_set1_epi8(8),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        dequant_b32!(src, dst, BYTES, offset = false, |b| quants(b));
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_0::BYTES)) {
            let d = _mm256_set1_ps(f16c_at(bw) * f16c_at(ba));
            let qa = &ba[2..34];
            // SAFETY: `qa` holds 32 readable bytes; loadu has no alignment requirement.
            let qa = unsafe { _mm256_loadu_si256(qa.as_ptr().cast()) };
            let p = _mm256_cvtepi32_ps(dot_i8_lanes(quants(bw), qa));
            acc = _mm256_fmadd_ps(d, p, acc);
        }
        hsum_f32x8(acc)
    }

    /// The block's nibbles as bytes 0..15 in element order (low nibbles are elements 0..16,
    /// high nibbles 16..32): one broadcast load, one per-half shift, one mask.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles(wb: *const u8) -> __m256i {
        // SAFETY: the caller guarantees a whole block at `wb`.
        let both = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(wb.add(2).cast())) };
        let shifted = _mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0));
        _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
    }

    /// Nothing to do once per weight block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn keep(q: __m256i) -> __m256i {
        q
    }

    /// One block against one activation block: i32 lane k holds the exact `Σ (q − 8)·y` over
    /// elements 4k..4k+4, as `Σ q·y` of the unsigned nibbles (`maddubs` + `madd`; no saturation
    /// possible) plus the activation's `−8·Σ y`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lanes_avx2(q: __m256i, _: __m256i, y: &TileBlock) -> __m256i {
        // SAFETY: `y` is 64-byte aligned: quants at 0, the bias at 32.
        let (qy, neg_bias) = unsafe {
            (
                _mm256_load_si256(y.q.as_ptr().cast()),
                _mm256_load_si256(y.neg_bias.as_ptr().cast()),
            )
        };
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, qy), _mm256_set1_epi16(1));
        _mm256_add_epi32(p, neg_bias)
    }

    /// [`lanes_avx2`] with AVX-VNNI: `vpdpbusd` adds the same four products per lane to
    /// `−8·Σ y` in one instruction, so the integers, and everything after them, are the same.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn lanes_vnni(q: __m256i, _: __m256i, y: &TileBlock) -> __m256i {
        // SAFETY: as in `lanes_avx2`.
        let (qy, neg_bias) = unsafe {
            (
                _mm256_load_si256(y.q.as_ptr().cast()),
                _mm256_load_si256(y.neg_bias.as_ptr().cast()),
            )
        };
        _mm256_dpbusd_avx_epi32(neg_bias, q, qy)
    }

    /// [`lanes_vnni`] with AVX512-VNNI's `vpdpbusd` on 256-bit registers: the same integers.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    unsafe fn lanes_vnni512(q: __m256i, _: __m256i, y: &TileBlock) -> __m256i {
        // SAFETY: as in `lanes_avx2`.
        let (qy, neg_bias) = unsafe {
            (
                _mm256_load_si256(y.q.as_ptr().cast()),
                _mm256_load_si256(y.neg_bias.as_ptr().cast()),
            )
        };
        _mm256_dpbusd_epi32(neg_bias, q, qy)
    }

    crate::tile::x86::tile_kernels!(weights: nibbles, prepare: keep, avx2: lanes_avx2, vnni: lanes_vnni, vnni512: lanes_vnni512);
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::super::q8_0;
    use super::super::{arm::*, ggml::f16_le};
    use super::{BLOCK, BYTES};
    use std::arch::aarch64::*;

    /// The block's quants as signed bytes `q - 8`: (elements 0..16, 16..32).
    fn quants(b: &[u8]) -> (int8x16_t, int8x16_t) {
        let (lo, hi) = nibbles_32(b[2..18].try_into().unwrap());
        // SAFETY: register-only intrinsics; NEON is baseline.
        unsafe {
            let eight = vdupq_n_s8(8);
            (
                vsubq_s8(vreinterpretq_s8_u8(lo), eight),
                vsubq_s8(vreinterpretq_s8_u8(hi), eight),
            )
        }
    }

    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
            let d = f16_le(b);
            let (q0, q1) = quants(b);
            store_scaled(q0, d, None, &mut y[..16]);
            store_scaled(q1, d, None, &mut y[16..]);
        }
    }

    /// Integer sums on NEON, float accumulation exactly as the scalar twin.
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0.0f32;
        for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_0::BYTES)) {
            let (x0, x1) = quants(bw);
            // SAFETY: `ba[2..34]` is 32 readable bytes.
            let (y0, y1) = unsafe {
                (
                    vld1q_s8(ba[2..].as_ptr().cast()),
                    vld1q_s8(ba[18..].as_ptr().cast()),
                )
            };
            let sumi = dot_i8x16(x0, y0) + dot_i8x16(x1, y1);
            sumf += sumi as f32 * f16_le(bw) * f16_le(ba);
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    // Values on the far side of `max` clamp at q = 15, a full step (max/8) away;
    // elsewhere half a step; plus f16 rounding of d spread over |q - 8| <= 8.
    block32_tests! {
        act: crate::q8_0,
        quantizers: [quantize],
        any_scale: (1.0 + 8.0 / 2048.0) / 8.0 + 1e-6,
    }

    q8_0_dot_tests!();

    const A: usize = q8_0::BYTES;

    #[test]
    fn layout() {
        // d = 1 (max = -8), element 0 = -8 -> q 0, element 16 = 7 -> q 15.
        let mut x = [0.0f32; 32];
        (x[0], x[16], x[1]) = (-8.0, 7.0, 1.0);
        let mut b = [0u8; BYTES];
        quantize(&x, &mut b);
        assert_eq!(f16_le(&b), 1.0);
        assert_eq!(b[2], 0xF0);
        assert_eq!(b[3], 0x89);
        let mut y = [0.0f32; 32];
        dequantize(&b, &mut y);
        assert_eq!(y, x);
    }

    proptest! {
        #[test]
        fn tile_is_vec_dot((mut w, x, n) in q8_0::tests::tile_case(BYTES)) {
            finite_scales(&mut w, BYTES, &[0]);
            let mut a = TileAct::default();
            a.quantize(&x, n);
            // Both kernels: AVX2 and, where the CPU has it, AVX-VNNI.
            for tile in [|w: &[u8], a: &_, o: &mut [f32]| tile_with(false, w, a, o), |w: &[u8], a: &_, o: &mut [f32]| tile_with(true, w, a, o)] {
                q8_0::tests::assert_tile_is_vec_dot(&w, &a, tile, vec_dot, n / BLOCK * BYTES)?;
            }
        }

        #[test]
        fn exact_tile_is_its_scalar_twin_and_exact(
            (mut w, x, n) in q8_0::tests::tile_case(BYTES),
            seed in prop::collection::vec(any::<u8>(), 7 * 5 * A),
            any_bytes in any::<bool>(),
        ) {
            finite_scales(&mut w, BYTES, &[0]);
            let a = q8_0::tests::exact_case_act(&x, &seed, any_bytes, n);
            for tile in [|w: &[u8], a: &_, o: &mut [f32]| exact_with(false, w, a, o), |w: &[u8], a: &_, o: &mut [f32]| exact_with(true, w, a, o)] {
                q8_0::tests::assert_exact_tile(&w, &a, tile, vec_dot_exact_scalar, dequantize_scalar, n / BLOCK * BYTES)?;
            }
        }

        #[test]
        fn tile_is_vec_dot_for_any_activation_bytes(
            (mut w, _, n) in q8_0::tests::tile_case(BYTES),
            seed in prop::collection::vec(any::<u8>(), 7 * 5 * A),
        ) {
            finite_scales(&mut w, BYTES, &[0]);
            let rb = n / BLOCK * A;
            let mut q = seed[..(seed.len() / rb).min(7) * rb].to_vec();
            finite_scales(&mut q, A, &[0]);
            let mut a = TileAct::default();
            a.load_q8(&q, n);
            // Both kernels: AVX2 and, where the CPU has it, AVX-VNNI.
            for tile in [|w: &[u8], a: &_, o: &mut [f32]| tile_with(false, w, a, o), |w: &[u8], a: &_, o: &mut [f32]| tile_with(true, w, a, o)] {
                q8_0::tests::assert_tile_is_vec_dot(&w, &a, tile, vec_dot, n / BLOCK * BYTES)?;
            }
        }
    }
}
