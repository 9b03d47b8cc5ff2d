//! Q5_1: blocks of 32, `d: f16`, `m: f16`, `qh: u32` (bit j is the 5th bit of element j) then
//! 16 bytes of nibbles (element j low nibble of `qs[j]`, j+16 high); `x = q * d + m`. Paired
//! with Q8_1 activations.

use super::cpu::dispatch;
use super::ggml::{c_float_to_byte, f16_le, put_f16};
use super::q8_1;

pub const BLOCK: usize = 32;
pub const BYTES: usize = 24;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(Q5_1, "q5_1", vec_dot_type: Q8_1);

// The block layout adds up.
const _: () = assert!(BYTES == 4 + 4 + BLOCK / 2);

/// The 32 five-bit quants of a block, in element order.
#[inline]
fn quants(b: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes(b[4..8].try_into().unwrap());
    let mut q = [0u8; 32];
    for (j, &v) in b[8..24].iter().enumerate() {
        q[j] = (v & 0x0F) | (((qh >> j) & 1) << 4) as u8;
        q[j + 16] = (v >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
    }
    q
}

/// ggml's `dequantize_row_q5_1`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
        let (d, m) = (f16_le(b), f16_le(&b[2..]));
        for (y, q) in y.iter_mut().zip(quants(b)) {
            *y = q as f32 * d + m;
        }
    }
}

/// [`dequantize_scalar`], vectorised; bit-identical output.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `quantize_row_q5_1_ref`: `m = min`, `d = (max - min) / 31`,
/// `q = trunc((x - min) / d + 0.5)` (no clamp in ggml; the arithmetic keeps it <= 31).
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
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut b[0..], d);
        put_f16(&mut b[2..], min);
        // ggml: `(uint8_t)((x - min)*id + 0.5f)`.
        let q = |v: f32| c_float_to_byte((v - min) * id + 0.5);
        let mut qh = 0u32;
        for j in 0..16 {
            let (q0, q1) = (q(x[j]), q(x[j + 16]));
            b[8 + j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
            qh |= ((q0 as u32 & 0x10) >> 4) << j;
            qh |= ((q1 as u32 & 0x10) >> 4) << (j + 16);
        }
        b[4..8].copy_from_slice(&qh.to_le_bytes());
    }
}

/// Dot product of a Q5_1 weight row with a Q8_1 activation row, as ggml's
/// `ggml_vec_dot_q5_1_q8_1_generic`: `sumf += (d_w * d_a) * sumi + m * s` per block.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    let mut sumf = 0.0f32;
    for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_1::BYTES)) {
        let sumi: i32 = quants(bw)
            .iter()
            .zip(&ba[4..])
            .map(|(&q, &y)| q as i32 * y as i8 as i32)
            .sum();
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
        "q5_1 · q8_1: rows differ in length"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::q8_1;
    use super::super::x86::*;
    use super::BYTES;
    use std::arch::x86_64::*;

    /// The block's quants (0..=31), in element order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn quants(b: &[u8]) -> __m256i {
        let hi = _mm256_and_si256(
            bits_32(u32::from_le_bytes(b[4..8].try_into().unwrap())),
            _mm256_set1_epi8(0x10),
        );
        _mm256_or_si256(nibbles_32(b[8..24].try_into().unwrap()), hi)
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
            acc = _mm256_fmadd_ps(p, d, acc);
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

    /// The block's quants (0..=31): (elements 0..16, 16..32).
    fn quants(b: &[u8]) -> (int8x16_t, int8x16_t) {
        let qh = u32::from_le_bytes(b[4..8].try_into().unwrap());
        let (lo, hi) = nibbles_32(b[8..24].try_into().unwrap());
        // SAFETY: register-only intrinsics; NEON is baseline.
        unsafe {
            let bit = vdupq_n_u8(0x10);
            (
                vreinterpretq_s8_u8(vorrq_u8(lo, vandq_u8(bits_16(qh, 0), bit))),
                vreinterpretq_s8_u8(vorrq_u8(hi, vandq_u8(bits_16(qh, 1), bit))),
            )
        }
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

    // Half a step of (max - min)/31 <= 2 max|x|/31, plus f16 rounding of d (times
    // q <= 31) and of m.
    block32_tests! {
        act: crate::q8_1,
        quantizers: [quantize],
        any_scale: (1.0 + 62.0 / 2048.0) / 31.0 + 1.0 / 2048.0,
    }

    const A: usize = q8_1::BYTES;

    /// Σ|d_w q_w d_a q_a| + Σ|m s| over the blocks: what the float sums add up.
    fn magnitude(w: &[u8], a: &[u8]) -> f64 {
        w.chunks(BYTES)
            .zip(a.chunks(A))
            .map(|(bw, ba)| {
                let (dw, m, da, s) = (f16_le(bw), f16_le(&bw[2..]), f16_le(ba), f16_le(&ba[2..]));
                let prod: f64 = quants(bw)
                    .iter()
                    .zip(&ba[4..])
                    .map(|(&q, &y)| (q as f64 * y as i8 as f64).abs())
                    .sum();
                prod * (dw as f64 * da as f64).abs() + (m as f64 * s as f64).abs()
            })
            .sum()
    }

    /// Σ q_w q_a over the rows: the dot when d_w = d_a = 1 and m = 0.
    fn int_dot(w: &[u8], a: &[u8]) -> f64 {
        w.chunks(BYTES)
            .zip(a.chunks(A))
            .flat_map(|(bw, ba)| quants(bw).into_iter().zip(ba[4..].to_vec()))
            .map(|(q, y)| q as f64 * y as i8 as f64)
            .sum()
    }

    #[test]
    fn layout() {
        // min 0, max 31: d = 1, m = 0, q = x; element 17 = 16 sets qh bit 17.
        let mut x = [0.0f32; 32];
        (x[0], x[16], x[17]) = (31.0, 1.0, 16.0);
        let mut b = [0u8; BYTES];
        quantize(&x, &mut b);
        assert_eq!((f16_le(&b), f16_le(&b[2..])), (1.0, 0.0));
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 1 | 1 << 17);
        assert_eq!((b[8], b[9]), (0x1F, 0x00));
        let mut y = [0.0f32; 32];
        dequantize(&b, &mut y);
        assert_eq!(y, x);
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
}
