//! Q8_1: blocks of 32, `d: f16`, `s: f16` then 32 signed bytes; `x[j] = qs[j] * d`, and
//! `s = d * sum(qs)` lets the Q4_1/Q5_1 dot products fold in their offset `m` per block.
//!
//! The activation type the CPU backend pairs with Q4_1 and Q5_1 weights, so [`quantize`] must
//! match ggml's `quantize_row_q8_1_ref` bit for bit. ggml has no Q8_1 decoder (`to_float` is
//! unset); ours ignores `s`.

use super::cpu::dispatch;
use super::ggml::{c_float_to_byte, cvtt_f32_i32, f16_le, put_f16};
use super::q8_0;

pub const BLOCK: usize = 32;
pub const BYTES: usize = 36;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format =
    super::format_entry!(Q8_1, "q8_1", vec_dot_type: Q8_1, from_float: quantize_x86_avx);

// The block layout adds up.
const _: () = assert!(BYTES == 4 + BLOCK);

/// `x[j] = qs[j] * d`, as Q8_0.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
        let d = f16_le(b);
        for (y, &q) in y.iter_mut().zip(&b[4..]) {
            *y = q as i8 as f32 * d;
        }
    }
}

/// [`dequantize_scalar`], vectorised; bit-identical output.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `quantize_row_q8_1_ref`: Q8_0's `d` and `roundf` quants, plus
/// `s = f16((sum of the quants) as f32 * d)` with `d` the unrounded f32 scale.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    quantize_impl(src, dst, false);
}

/// What ggml's x86 AVX/AVX2 `quantize_row_q8_1` writes: inverse scale `127 / max|x|` and
/// round-half-to-even, as `q8_0::quantize_x86_avx`. Rarely differs from [`quantize`].
pub fn quantize_x86_avx(src: &[f32], dst: &mut [u8]) {
    quantize_impl(src, dst, true);
}

fn quantize_impl(src: &[f32], dst: &mut [u8], avx: bool) {
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        let amax = if avx {
            q8_0::amax_x86_avx(x)
        } else {
            // C's MAX(a, b) is `a > b ? a : b`: a NaN is dropped again by the next element.
            x.iter()
                .fold(0.0f32, |m, v| if m > v.abs() { m } else { v.abs() })
        };
        let d = amax / 127.0;
        // `_ref` inverts the f32 `d`; the AVX kernel divides 127 by max|x| directly.
        let id = match avx {
            false if d != 0.0 => 1.0 / d,
            true if amax != 0.0 => 127.0 / amax,
            _ => 0.0,
        };
        let mut sum = 0i32;
        for (q, &v) in b[4..].iter_mut().zip(x) {
            if avx {
                // cvtps_epi32 (NaN/overflow -> i32::MIN), summed as i32 before the saturating
                // packs down to i8.
                let r = cvtt_f32_i32((v * id).round_ties_even());
                *q = r.clamp(-128, 127) as i8 as u8;
                sum = sum.wrapping_add(r);
            } else {
                *q = c_float_to_byte((v * id).round());
                sum += *q as i8 as i32;
            }
        }
        put_f16(&mut b[0..], d);
        put_f16(&mut b[2..], sum as f32 * d);
    }
}

/// As a weight (no converter writes one; ggml has no kernel): the f32 dot of both rows
/// decoded.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    super::dot_decoded(
        super::GgmlType::Q8_1,
        w,
        a,
        dequantize,
        super::f32::vec_dot_f32,
    )
}

/// [`vec_dot`] with the scalar decoder and dot product.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    super::dot_decoded(
        super::GgmlType::Q8_1,
        w,
        a,
        dequantize_scalar,
        super::f32::vec_dot_f32_scalar,
    )
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::*;
    use super::BYTES;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        // SAFETY: `b[4..36]` holds 32 readable bytes; loadu has no alignment requirement.
        dequant_b32!(src, dst, BYTES, offset = false, |b| unsafe {
            _mm256_loadu_si256(b[4..36].as_ptr().cast())
        });
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::super::{arm::*, ggml::f16_le};
    use super::{BLOCK, BYTES};
    use std::arch::aarch64::*;

    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
            let d = f16_le(b);
            // SAFETY: `b[4..36]` is 32 readable bytes.
            let (q0, q1) = unsafe {
                (
                    vld1q_s8(b[4..].as_ptr().cast()),
                    vld1q_s8(b[20..].as_ptr().cast()),
                )
            };
            store_scaled(q0, d, None, &mut y[..16]);
            store_scaled(q1, d, None, &mut y[16..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_ggml_data() {
        let x = ggml_test_data(4096, 0.0);
        assert_rmse(&x, quantize, dequantize, BLOCK, BYTES, 0.002).unwrap();
    }

    #[test]
    fn s_is_d_times_quant_sum() {
        // x = j/31 * 127: d = 1, quants 0..=127 rounded; s = their sum (as f16).
        let x: Vec<f32> = (0..32).map(|j| j as f32 * 127.0 / 31.0).collect();
        let mut b = [0u8; BYTES];
        quantize(&x, &mut b);
        let sum: i32 = b[4..].iter().map(|&q| q as i8 as i32).sum();
        assert_eq!(f16_le(&b[0..]), 1.0);
        assert_eq!(f16_le(&b[2..]), half::f16::from_f32(sum as f32).to_f32());
    }

    #[test]
    fn agrees_with_q8_0_on_d_and_quants() {
        let x = ggml_test_data(4096, 0.5);
        let a = encode(&x, BLOCK, BYTES, quantize);
        let b = encode(
            &x,
            BLOCK,
            super::super::q8_0::BYTES,
            super::super::q8_0::quantize,
        );
        for (a, b) in a.chunks(BYTES).zip(b.chunks(super::super::q8_0::BYTES)) {
            assert_eq!(&a[..2], &b[..2]);
            assert_eq!(&a[4..], &b[2..]);
        }
        let a = encode(&x, BLOCK, BYTES, quantize_x86_avx);
        let b = encode(&x, BLOCK, 34, super::super::q8_0::quantize_x86_avx);
        for (a, b) in a.chunks(BYTES).zip(b.chunks(34)) {
            assert_eq!(&a[..2], &b[..2]);
            assert_eq!(&a[4..], &b[2..]);
        }
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
            let e = max_rel_block_err(&x, quantize, dequantize, BLOCK, BYTES);
            prop_assert!(e <= (0.5 + 127.0 / 2048.0) / 127.0, "{}", e);
        }

        #[test]
        fn quantize_is_idempotent(x in floats(BLOCK, 1..17)) {
            // d and the quants come back byte for byte. `s` need not: ggml computes it from the
            // f32 d, the second pass from the f16-rounded one, so it may move by one f16 ulp.
            let q1 = encode(&x, BLOCK, BYTES, quantize);
            let q2 = encode(&decode(&q1, x.len(), dequantize), BLOCK, BYTES, quantize);
            for (a, b) in q1.chunks(BYTES).zip(q2.chunks(BYTES)) {
                prop_assert_eq!(&a[..2], &b[..2]);
                prop_assert_eq!(&a[4..], &b[4..]);
                let (s1, s2) = (i16::from_le_bytes([a[2], a[3]]), i16::from_le_bytes([b[2], b[3]]));
                prop_assert!((s1 - s2).abs() <= 1 || f16_le(&a[2..]) == f16_le(&b[2..]), "s {} vs {}", s1, s2);
            }
        }
    }
}
