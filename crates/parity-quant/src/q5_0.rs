//! Q5_0: blocks of 32, `d: f16`, `qh: u32` (bit j is the 5th bit of element j) then 16 bytes
//! of nibbles (element j low nibble of `qs[j]`, j+16 high); `x = (q - 16) * d`. Paired with
//! Q8_0 activations.

use super::cpu::dispatch;
use super::ggml::{c_float_to_byte, f16_le, put_f16};
use super::q8_0;

pub const BLOCK: usize = 32;
pub const BYTES: usize = 22;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(Q5_0, "q5_0", vec_dot_type: Q8_0);

// The block layout adds up.
const _: () = assert!(BYTES == 2 + 4 + BLOCK / 2);

/// The 32 five-bit quants of a block, in element order (0..=31, not yet offset by -16).
#[inline]
fn quants(b: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes(b[2..6].try_into().unwrap());
    let mut q = [0u8; 32];
    for (j, &v) in b[6..22].iter().enumerate() {
        q[j] = (v & 0x0F) | (((qh >> j) & 1) << 4) as u8;
        q[j + 16] = (v >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
    }
    q
}

/// ggml's `dequantize_row_q5_0`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
        let d = f16_le(b);
        for (y, q) in y.iter_mut().zip(quants(b)) {
            *y = (q as i32 - 16) as f32 * d;
        }
    }
}

/// [`dequantize_scalar`], vectorised; bit-identical output.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `quantize_row_q5_0_ref`: `d = -max/16` with `max` the signed value of largest
/// magnitude, `q = min(31, trunc(x/d + 16.5))`.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, d);
        // ggml: `MIN(31, (int8_t)(x*id + 16.5f))`.
        let q = |v: f32| (c_float_to_byte(v * id + 16.5) as i8).min(31) as u8;
        let mut qh = 0u32;
        for j in 0..16 {
            let (q0, q1) = (q(x[j]), q(x[j + 16]));
            b[6 + j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
            qh |= ((q0 as u32) >> 4) << j;
            qh |= ((q1 as u32) >> 4) << (j + 16);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

/// Dot product of a Q5_0 weight row with a Q8_0 activation row, as ggml's
/// `ggml_vec_dot_q5_0_q8_0_generic`: `sumf += (d_w * d_a) * sumi` per block.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    let mut sumf = 0.0f32;
    for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_0::BYTES)) {
        let sumi: i32 = quants(bw)
            .iter()
            .zip(&ba[2..])
            .map(|(&q, &y)| (q as i32 - 16) * y as i8 as i32)
            .sum();
        sumf += (f16_le(bw) * f16_le(ba)) * sumi as f32;
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

fn check_rows(w: &[u8], a: &[u8]) {
    assert_eq!(
        w.len() / BYTES,
        a.len() / q8_0::BYTES,
        "q5_0 · q8_0: rows differ in length"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::q8_0;
    use super::super::x86::*;
    use super::BYTES;
    use std::arch::x86_64::*;

    /// The block's quants as signed bytes `q - 16`, in element order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn quants(b: &[u8]) -> __m256i {
        let hi = _mm256_and_si256(
            bits_32(u32::from_le_bytes(b[2..6].try_into().unwrap())),
            _mm256_set1_epi8(0x10),
        );
        let q = _mm256_or_si256(nibbles_32(b[6..22].try_into().unwrap()), hi);
        _mm256_sub_epi8(q, _mm256_set1_epi8(16))
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
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::super::q8_0;
    use super::super::{arm::*, ggml::f16_le};
    use super::{BLOCK, BYTES};
    use std::arch::aarch64::*;

    /// The block's quants as signed bytes `q - 16`: (elements 0..16, 16..32).
    fn quants(b: &[u8]) -> (int8x16_t, int8x16_t) {
        let qh = u32::from_le_bytes(b[2..6].try_into().unwrap());
        let (lo, hi) = nibbles_32(b[6..22].try_into().unwrap());
        // SAFETY: register-only intrinsics; NEON is baseline.
        unsafe {
            let (bit, off) = (vdupq_n_u8(0x10), vdupq_n_s8(16));
            let lo = vorrq_u8(lo, vandq_u8(bits_16(qh, 0), bit));
            let hi = vorrq_u8(hi, vandq_u8(bits_16(qh, 1), bit));
            (
                vsubq_s8(vreinterpretq_s8_u8(lo), off),
                vsubq_s8(vreinterpretq_s8_u8(hi), off),
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
            sumf += (f16_le(bw) * f16_le(ba)) * sumi as f32;
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    // Values on the far side of `max` clamp at q = 31, a full step (max/16) away;
    // elsewhere half a step; plus f16 rounding of d spread over |q - 16| <= 16.
    block32_tests! {
        act: crate::q8_0,
        quantizers: [quantize],
        any_scale: (1.0 + 16.0 / 2048.0) / 16.0 + 1e-6,
    }

    q8_0_dot_tests!();

    #[test]
    fn layout() {
        // d = 1 (max = -16): element 0 -> q 0, element 16 = 15 -> q 31 (5th bit in qh bit 16),
        // element 1 = 1 -> q 17 (qh bit 1).
        let mut x = [0.0f32; 32];
        (x[0], x[16], x[1]) = (-16.0, 15.0, 1.0);
        let mut b = [0u8; BYTES];
        quantize(&x, &mut b);
        assert_eq!(f16_le(&b), 1.0);
        let qh = u32::from_le_bytes(b[2..6].try_into().unwrap());
        assert_eq!(qh, 0xFFFF_FFFE);
        assert_eq!(b[6], 0xF0);
        assert_eq!(b[7], 0x01);
        let mut y = [0.0f32; 32];
        dequantize(&b, &mut y);
        assert_eq!(y, x);
    }
}
