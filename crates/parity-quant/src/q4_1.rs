//! Q4_1: blocks of 32, `d: f16`, `m: f16` then 16 bytes of nibbles (element j low nibble of
//! `qs[j]`, j+16 high); `x = q * d + m`. Paired with Q8_1 activations.

use super::cpu::dispatch;
use super::ggml::{c_float_to_byte, f16_le, put_f16};
use super::q8_1;

pub const BLOCK: usize = 32;
pub const BYTES: usize = 20;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(Q4_1, "q4_1", vec_dot_type: Q8_1);

// The block layout adds up.
const _: () = assert!(BYTES == 4 + BLOCK / 2);

/// ggml's `dequantize_row_q4_1`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
        let (d, m) = (f16_le(b), f16_le(&b[2..]));
        for (j, &q) in b[4..].iter().enumerate() {
            y[j] = (q & 0x0F) as f32 * d + m;
            y[j + 16] = (q >> 4) as f32 * d + m;
        }
    }
}

/// [`dequantize_scalar`], vectorised; bit-identical output.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `quantize_row_q4_1_ref`: `m = min`, `d = (max - min) / 15`,
/// `q = min(15, trunc((x - min) / d + 0.5))`.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in x {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut b[0..], d);
        put_f16(&mut b[2..], min);
        // ggml: `MIN(15, (int8_t)((x - min)*id + 0.5f))`.
        let q = |v: f32| (c_float_to_byte((v - min) * id + 0.5) as i8).min(15) as u8;
        for j in 0..16 {
            b[4 + j] = q(x[j]) | (q(x[j + 16]) << 4);
        }
    }
}

/// Dot product of a Q4_1 weight row with a Q8_1 activation row, as ggml's
/// `ggml_vec_dot_q4_1_q8_1_generic`: `sumf += (d_w * d_a) * sumi + m * s` per block.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    let mut sumf = 0.0f32;
    for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_1::BYTES)) {
        let qa = &ba[4..];
        let mut sumi = 0i32;
        for (j, &q) in bw[4..].iter().enumerate() {
            sumi += (q & 0x0F) as i32 * qa[j] as i8 as i32;
            sumi += (q >> 4) as i32 * qa[j + 16] as i8 as i32;
        }
        sumf += (f16_le(bw) * f16_le(ba)) * sumi as f32 + f16_le(&bw[2..]) * f16_le(&ba[2..]);
    }
    sumf
}

/// [`vec_dot_scalar`], vectorised. Per-block integer sums are identical; the float sum follows
/// ggml's AVX2 kernel (8 FMA lanes for `d·sumi`, a scalar running sum of `m·s`, added last), so
/// it may differ from the scalar twin by rounding.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_scalar)
}

fn check_rows(w: &[u8], a: &[u8]) {
    assert_eq!(
        w.len() / BYTES,
        a.len() / q8_1::BYTES,
        "q4_1 · q8_1: rows differ in length"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::q8_1;
    use super::super::x86::*;
    use super::BYTES;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn quants(b: &[u8]) -> __m256i {
        nibbles_32(b[4..20].try_into().unwrap())
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        dequant_b32!(src, dst, BYTES, offset = true, |b| quants(b));
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0.0f32;
        for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_1::BYTES)) {
            summs += f16c_at(&bw[2..]) * f16c_at(&ba[2..]);
            let d = _mm256_set1_ps(f16c_at(bw) * f16c_at(ba));
            let qa = &ba[4..36];
            // SAFETY: `qa` holds 32 readable bytes; loadu has no alignment requirement.
            let qa = unsafe { _mm256_loadu_si256(qa.as_ptr().cast()) };
            let p = _mm256_cvtepi32_ps(dot_i8_lanes(quants(bw), qa));
            acc = _mm256_fmadd_ps(d, p, acc);
        }
        hsum_f32x8(acc) + summs
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::super::q8_1;
    use super::super::{arm::*, ggml::f16_le};
    use super::{BLOCK, BYTES};
    use std::arch::aarch64::*;

    fn quants(b: &[u8]) -> (int8x16_t, int8x16_t) {
        let (lo, hi) = nibbles_32(b[4..20].try_into().unwrap());
        // SAFETY: register-only reinterpretation; NEON is baseline.
        unsafe { (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)) }
    }

    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
            let (d, m) = (f16_le(b), f16_le(&b[2..]));
            let (q0, q1) = quants(b);
            store_scaled(q0, d, Some(m), &mut y[..16]);
            store_scaled(q1, d, Some(m), &mut y[16..]);
        }
    }

    /// Integer sums on NEON, float accumulation exactly as the scalar twin.
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0.0f32;
        for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_1::BYTES)) {
            let (x0, x1) = quants(bw);
            // SAFETY: `ba[4..36]` is 32 readable bytes.
            let (y0, y1) = unsafe {
                (
                    vld1q_s8(ba[4..].as_ptr().cast()),
                    vld1q_s8(ba[20..].as_ptr().cast()),
                )
            };
            let sumi = dot_i8x16(x0, y0) + dot_i8x16(x1, y1);
            sumf += (f16_le(bw) * f16_le(ba)) * sumi as f32 + f16_le(&bw[2..]) * f16_le(&ba[2..]);
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    // Half a step of (max - min)/15 <= 2 max|x|/15, plus f16 rounding of d (times
    // q <= 15) and of m.
    block32_tests! {
        act: crate::q8_1,
        quantizers: [quantize],
        any_scale: (1.0 + 30.0 / 2048.0) / 15.0 + 1.0 / 2048.0,
    }

    const A: usize = q8_1::BYTES;

    /// Σ|d_w q_w d_a q_a| + Σ|m s| over the blocks: what the float sums add up.
    fn magnitude(w: &[u8], a: &[u8]) -> f64 {
        w.chunks(BYTES)
            .zip(a.chunks(A))
            .map(|(bw, ba)| {
                let (dw, m, da, s) = (f16_le(bw), f16_le(&bw[2..]), f16_le(ba), f16_le(&ba[2..]));
                let prod: f64 = (0..32)
                    .map(|j| {
                        let q = if j < 16 {
                            bw[4 + j] & 0xF
                        } else {
                            bw[4 + j - 16] >> 4
                        };
                        (q as f64 * ba[4 + j] as i8 as f64).abs()
                    })
                    .sum();
                prod * (dw as f64 * da as f64).abs() + (m as f64 * s as f64).abs()
            })
            .sum()
    }

    proptest! {



        #[test]
        fn vec_dot_integer_part_is_exact(mut w in blocks(BYTES, 1..17), seed in blocks(A, 16..17)) {
            // d = 1 and m·s = 0: every partial sum is an integer below 2^24, so both are exact.
            let mut a = seed[..w.len() / BYTES * A].to_vec();
            set_scales(&mut w, BYTES, &[0], 1.0);
            set_scales(&mut w, BYTES, &[2], 0.0);
            set_scales(&mut a, A, &[0], 1.0);
            set_scales(&mut a, A, &[2], 0.0);
            let exact = int_dot(&w, &a);
            prop_assert_eq!(vec_dot_scalar(&w, &a) as f64, exact);
            prop_assert_eq!(vec_dot(&w, &a) as f64, exact);
        }

        #[test]
        fn vec_dot_twins_agree(mut w in blocks(BYTES, 1..33), seed in blocks(A, 32..33)) {
            let mut a = seed[..w.len() / BYTES * A].to_vec();
            finite_scales(&mut w, BYTES, &[0, 2]);
            finite_scales(&mut a, A, &[0, 2]);
            let (f, s) = (vec_dot(&w, &a) as f64, vec_dot_scalar(&w, &a) as f64);
            let bound = sum_order_bound(2 * w.len() / BYTES, magnitude(&w, &a));
            prop_assert!((f - s).abs() <= bound, "{} vs {}", f, s);
        }

        #[test]
        fn vec_dot_matches_dequantized_dot(x in floats(BLOCK, 1..33), y in floats(BLOCK, 32..33)) {
            let w = encode(&x, BLOCK, BYTES, quantize);
            let a = encode(&y[..x.len()], BLOCK, A, q8_1::quantize);
            let n = x.len();
            let exact = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, q8_1::dequantize)).0;
            // `s` is f16(d·Σq) from the unrounded d, so m·s is off the decoded dot by up to two
            // f16 roundings, |m s| 2^-10, per block.
            let s_err: f64 = w.chunks(BYTES).zip(a.chunks(A))
                .map(|(bw, ba)| (f16_le(&bw[2..]) as f64 * f16_le(&ba[2..]) as f64).abs() / 1000.0)
                .sum();
            let bound = sum_order_bound(2 * n / BLOCK, magnitude(&w, &a)) + s_err;
            for got in [vec_dot(&w, &a), vec_dot_scalar(&w, &a)] {
                prop_assert!((got as f64 - exact).abs() <= bound, "{} vs {}", got, exact);
            }
        }
    }

    /// Σ q_w q_a over the rows: the dot when d_w = d_a = 1 and m = 0.
    fn int_dot(w: &[u8], a: &[u8]) -> f64 {
        w.chunks(BYTES)
            .zip(a.chunks(A))
            .flat_map(|(bw, ba)| {
                (0..32).map(move |j| {
                    let q = if j < 16 {
                        bw[4 + j] & 0xF
                    } else {
                        bw[4 + j - 16] >> 4
                    };
                    q as f64 * ba[4 + j] as i8 as f64
                })
            })
            .sum()
    }
}
