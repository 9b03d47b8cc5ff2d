//! Q8_0: blocks of 32, `d: f16` then 32 signed bytes; `x[j] = qs[j] * d`.
//!
//! Also the activation type the CPU backend pairs with Q4_0, Q5_0, Q8_0 and IQ4_NL weights, so
//! [`quantize`] must match ggml's `quantize_row_q8_0_ref` bit for bit.

use super::util::{Simd, c_float_to_byte, cvtt_f32_i32, f16_le, put_f16, simd};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 34;

/// ggml's `dequantize_row_q8_0`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
        let d = f16_le(b);
        for (y, &q) in y.iter_mut().zip(&b[2..]) {
            *y = q as i8 as f32 * d;
        }
    }
}

/// [`dequantize_scalar`], vectorised; bit-identical output.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    match simd() {
        // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { x86::dequantize(src, dst) },
        #[cfg(target_arch = "aarch64")]
        Simd::Neon => neon::dequantize(src, dst),
        _ => dequantize_scalar(src, dst),
    }
}

/// ggml's `quantize_row_q8_0_ref`: `d = max|x| / 127`, `q = roundf(x / d)` (half away from zero).
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        // C's MAX(a, b) is `a > b ? a : b`: a NaN is dropped again by the next element.
        let amax = x
            .iter()
            .fold(0.0f32, |m, v| if m > v.abs() { m } else { v.abs() });
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, d);
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = c_float_to_byte((v * id).round());
        }
    }
}

/// What ggml's x86 AVX/AVX2 `quantize_row_q8_0` (the CPU backend's activation quantizer on
/// such machines) writes. It differs from [`quantize`] in two ways: the inverse scale is
/// `127 / max|x|` rather than `1 / (max|x| / 127)`, and rounding is half to even. The two
/// disagree on a handful of bytes per million.
pub fn quantize_x86_avx(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        let amax = amax_x86_avx(x);
        put_f16(b, amax / 127.0);
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        for (q, &v) in b[2..].iter_mut().zip(x) {
            // cvtps_epi32 (NaN/overflow -> i32::MIN), then saturating packs down to i8.
            *q = cvtt_f32_i32((v * id).round_ties_even()).clamp(-128, 127) as i8 as u8;
        }
    }
}

/// max|x| of a 32-element block reduced as ggml's AVX kernels do it: 8 lanes over the four
/// vectors, then halves. `max_ps(a, b)` is `a > b ? a : b`, so the order decides which NaN
/// survives.
pub(crate) fn amax_x86_avx(x: &[f32]) -> f32 {
    let mx = |a: f32, b: f32| if a > b { a } else { b };
    let lane: [f32; 8] =
        std::array::from_fn(|l| (1..4).fold(x[l].abs(), |m, k| mx(m, x[8 * k + l].abs())));
    let half: [f32; 4] = std::array::from_fn(|i| mx(lane[4 + i], lane[i]));
    mx(mx(half[0], half[2]), mx(half[1], half[3]))
}

/// Dot product of a Q8_0 weight row with a Q8_0 activation row, as ggml's
/// `ggml_vec_dot_q8_0_q8_0_generic`: exact integer sum per block, then
/// `sumf += sumi * (d_w * d_a)`.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), a.len(), "q8_0 · q8_0: rows differ in length");
    let mut sumf = 0.0f32;
    for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(BYTES)) {
        let sumi: i32 = bw[2..]
            .iter()
            .zip(&ba[2..])
            .map(|(&x, &y)| x as i8 as i32 * y as i8 as i32)
            .sum();
        sumf += sumi as f32 * (f16_le(bw) * f16_le(ba));
    }
    sumf
}

/// [`vec_dot_scalar`], vectorised. The per-block integer sums are identical; the float sum is
/// ordered like ggml's AVX2 kernel (8 lanes of FMA, then `hsum_float_8`), so it can differ from
/// the scalar twin by rounding.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), a.len(), "q8_0 · q8_0: rows differ in length");
    match simd() {
        // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { x86::vec_dot(w, a) },
        #[cfg(target_arch = "aarch64")]
        Simd::Neon => neon::vec_dot(w, a),
        _ => vec_dot_scalar(w, a),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::util::{f16_le, x86_b32::*};
    use super::{BLOCK, BYTES};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
            store_scaled(load_qs(b), f16_le(b), y.try_into().unwrap());
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(BYTES)) {
            let d = _mm256_set1_ps(f16_le(bw) * f16_le(ba));
            let p = _mm256_cvtepi32_ps(dot_i8_lanes(load_qs(bw), load_qs(ba)));
            acc = _mm256_fmadd_ps(d, p, acc);
        }
        hsum_f32x8(acc)
    }

    /// The 32 quants of a block (`b[2..34]`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn load_qs(b: &[u8]) -> __m256i {
        let qs = &b[2..34];
        // SAFETY: `qs` holds 32 readable bytes; loadu has no alignment requirement.
        unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::super::util::{f16_le, neon_b32::*};
    use super::{BLOCK, BYTES};
    use std::arch::aarch64::*;

    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
            let d = f16_le(b);
            let (q0, q1) = load_qs(b);
            store_scaled(q0, d, None, &mut y[..16]);
            store_scaled(q1, d, None, &mut y[16..]);
        }
    }

    /// Integer sums on NEON, float accumulation exactly as the scalar twin.
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0.0f32;
        for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(BYTES)) {
            let (x0, x1) = load_qs(bw);
            let (y0, y1) = load_qs(ba);
            let sumi = dot_i8x16(x0, y0) + dot_i8x16(x1, y1);
            sumf += sumi as f32 * (f16_le(bw) * f16_le(ba));
        }
        sumf
    }

    fn load_qs(b: &[u8]) -> (int8x16_t, int8x16_t) {
        let qs = &b[2..34];
        // SAFETY: `qs` holds 32 readable bytes.
        unsafe {
            (
                vld1q_s8(qs.as_ptr().cast()),
                vld1q_s8(qs[16..].as_ptr().cast()),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::util::testing::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_ggml_data() {
        let x = ggml_test_data(4096, 0.0);
        assert_rmse(&x, quantize, dequantize, BLOCK, BYTES, 0.002).unwrap();
        assert_rmse(&x, quantize_x86_avx, dequantize, BLOCK, BYTES, 0.002).unwrap();
    }

    #[test]
    fn vec_dot_ggml_data() {
        // test-quantize-fns' dot_product_error: |vec_dot - f32 dot| / n <= 0.02.
        let (x, y) = (ggml_test_data(4096, 0.0), ggml_test_data(4096, 1.0));
        let w = encode(&x, BLOCK, BYTES, quantize);
        let a = encode(&y, BLOCK, BYTES, quantize);
        let exact = dequant_dot(&x, &y).0;
        for dot in [vec_dot, vec_dot_scalar] {
            let err = (dot(&w, &a) as f64 - exact).abs() / 4096.0;
            assert!(err <= 0.02, "{err}");
        }
    }

    #[test]
    fn ties_round_away_from_zero() {
        // max|x| = 127 makes d = 1: ±2.5 must become ±3 (C roundf); the AVX path gives ±2.
        let mut x = [0.0f32; 32];
        (x[0], x[1], x[2]) = (127.0, 2.5, -2.5);
        let mut b = [0u8; BYTES];
        quantize(&x, &mut b);
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), 0x3c00);
        assert_eq!(&b[2..5], &[127, 3, (-3i8) as u8]);
        quantize_x86_avx(&x, &mut b);
        assert_eq!(&b[2..5], &[127, 2, (-2i8) as u8]);
    }

    #[test]
    fn zero_block_is_all_zero_bytes() {
        let mut b = [0xAAu8; BYTES];
        quantize(&[0.0; 32], &mut b);
        assert!(b.iter().all(|&v| v == 0));
    }

    proptest! {
        #[test]
        fn simd_dequantize_is_bit_identical(src in blocks(BYTES, 1..9)) {
            assert_dequant_twins(&src, BLOCK, BYTES, dequantize, dequantize_scalar)?;
        }

        #[test]
        fn round_trip_random(x in ggml_like_floats()) {
            assert_rmse(&x, quantize, dequantize, BLOCK, BYTES, 0.002)?;
        }

        #[test]
        fn round_trip_any_scale(x in floats(BLOCK, 1..17)) {
            // Half a step, plus the f16 rounding of d spread over |q| <= 127.
            let e = max_rel_block_err(&x, quantize, dequantize, BLOCK, BYTES);
            prop_assert!(e <= (0.5 + 127.0 / 2048.0) / 127.0, "{}", e);
        }

        #[test]
        fn quantize_is_idempotent(x in floats(BLOCK, 1..17)) {
            assert_idempotent(&x, quantize, dequantize, BLOCK, BYTES)?;
        }

        #[test]
        fn vec_dot_integer_part_is_exact(mut w in blocks(BYTES, 1..17), seed in blocks(BYTES, 16..17)) {
            // Unit scales: every partial sum is an integer below 2^24, so both twins are exact.
            let mut a = seed[..w.len()].to_vec();
            set_scales(&mut w, BYTES, &[0], 1.0);
            set_scales(&mut a, BYTES, &[0], 1.0);
            let exact: i64 = w.chunks(BYTES).zip(a.chunks(BYTES))
                .flat_map(|(x, y)| x[2..].iter().zip(&y[2..]))
                .map(|(&p, &q)| p as i8 as i64 * q as i8 as i64)
                .sum();
            prop_assert_eq!(vec_dot_scalar(&w, &a), exact as f32);
            prop_assert_eq!(vec_dot(&w, &a), exact as f32);
        }

        #[test]
        fn vec_dot_twins_agree(mut w in blocks(BYTES, 1..33), seed in blocks(BYTES, 32..33)) {
            let mut a = seed[..w.len()].to_vec();
            finite_scales(&mut w, BYTES, &[0]);
            finite_scales(&mut a, BYTES, &[0]);
            let n = w.len() / BYTES * BLOCK;
            let (_, mag) = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, dequantize));
            let (f, s) = (vec_dot(&w, &a) as f64, vec_dot_scalar(&w, &a) as f64);
            prop_assert!((f - s).abs() <= sum_order_bound(n / BLOCK, mag), "{} vs {}", f, s);
        }

        #[test]
        fn vec_dot_matches_dequantized_dot(x in floats(BLOCK, 1..33), y in floats(BLOCK, 32..33)) {
            let w = encode(&x, BLOCK, BYTES, quantize);
            let a = encode(&y[..x.len()], BLOCK, BYTES, quantize);
            let n = x.len();
            let (exact, mag) = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, dequantize));
            for got in [vec_dot(&w, &a), vec_dot_scalar(&w, &a)] {
                prop_assert!((got as f64 - exact).abs() <= sum_order_bound(n / BLOCK, mag),
                    "{} vs {}", got, exact);
            }
        }
    }
}
