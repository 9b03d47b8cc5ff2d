//! Q2_K: 2-bit quants in 256-element super-blocks of 16 sub-blocks of 16, each sub-block with a
//! 4-bit scale and a 4-bit min: `y = d·sc·q − dmin·m`.
//!
//! Block (84 bytes): `scales: [u8; 16]` (scale in the low nibble, min in the high one),
//! `qs: [u8; 64]`, `d: f16`, `dmin: f16`. Each half of the block (128 elements) uses 32 bytes
//! of `qs`; bits `2j..2j + 2` of those bytes hold elements `32j..32j + 32` of the half.

use super::cpu::dispatch;
use super::ggml::{QK_K, f16_le, make_qkx2_quants, nearest_int, put_f16};
use super::q8_k;

/// Bytes per 256-element block.
pub const BYTES: usize = 84;

/// Elements per block.
pub const BLOCK: usize = QK_K;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format =
    super::format_entry!(Q2_K, "q2_K", vec_dot_type: Q8_K, dot_exact: true);

// The block layout adds up.
const _: () = assert!(BYTES == BLOCK / 16 + BLOCK / 4 + 2 + 2 && DMIN + 2 == BYTES);

/// Byte offsets inside a block.
const QS: usize = 16;
const D: usize = 80;
const DMIN: usize = 82;

/// Decode `dst.len()` elements (SIMD where available; bit-identical to [`dequantize_scalar`]).
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `dequantize_row_q2_K`: per sub-block `dl = d·(sc & 15)`, `ml = dmin·(sc >> 4)`,
/// `y = dl·q − ml`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() / QK_K * BYTES);
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, min) = (f16_le(&b[D..]), f16_le(&b[DMIN..]));
        // Sub-block `is` (16 elements) reads bytes `16·(is % 2)..` of its half's 32 bytes.
        for (is, y) in y.chunks_exact_mut(16).enumerate() {
            let sc = b[is];
            let (dl, ml) = (d * (sc & 0xf) as f32, min * (sc >> 4) as f32);
            let q = &b[QS + 32 * (is / 8) + 16 * (is % 2)..][..16];
            let shift = 2 * (is % 8 / 2);
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * ((q >> shift) & 3) as f32 - ml;
            }
        }
    }
}

/// ggml's `quantize_row_q2_K_ref`: fit each 16-element sub-block with [`make_qkx2_quants`]
/// (weights |x|, mean absolute error), quantize the scales and mins to 4 bits against the
/// largest of each, then requantize every element against the rounded scale and min.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() / QK_K * BYTES);
    const Q4SCALE: f32 = 15.0;
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BYTES)) {
        let mut l = [0u8; QK_K];
        let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            let weights: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
            let (s, m) = make_qkx2_quants(3, xs, &weights, &mut l[16 * j..], -0.5, 0.1, 15, true);
            (scales[j], mins[j]) = (s, m);
            if s > max_scale {
                max_scale = s;
            }
            if m > max_min {
                max_min = m;
            }
        }

        // ggml stores nearest_int straight into the uint8_t scales (wrapping).
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for j in 0..16 {
                b[j] = nearest_int(iscale * scales[j]) as u8;
            }
            put_f16(&mut b[D..], max_scale / Q4SCALE);
        } else {
            b[..16].fill(0);
            put_f16(&mut b[D..], 0.0);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for j in 0..16 {
                b[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
            }
            put_f16(&mut b[DMIN..], max_min / Q4SCALE);
        } else {
            put_f16(&mut b[DMIN..], 0.0);
        }

        let (d, dmin) = (f16_le(&b[D..]), f16_le(&b[DMIN..]));
        for ((&sc, xs), l) in b[..16]
            .iter()
            .zip(x.chunks_exact(16))
            .zip(l.chunks_exact_mut(16))
        {
            let d = d * (sc & 0xf) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin * (sc >> 4) as f32;
            for (l, &v) in l.iter_mut().zip(xs) {
                *l = nearest_int((v + dm) / d).clamp(0, 3) as u8;
            }
        }

        for (q, l) in b[QS..D].chunks_exact_mut(32).zip(l.chunks_exact(128)) {
            for i in 0..32 {
                q[i] = l[i] | (l[i + 32] << 2) | (l[i + 64] << 4) | (l[i + 96] << 6);
            }
        }
    }
}

/// One block's float result from its integer sums, shared by both dot-product twins so they
/// round identically: `d·Σ sc·(q·q8) − dmin·Σ m·bsum`.
#[inline]
fn block_dot(x: &[u8], y: &[u8], isum: i32, summs: i32) -> f32 {
    let dy = q8_k::block_d(y);
    let (dall, dmin) = (dy * f16_le(&x[D..]), dy * f16_le(&x[DMIN..]));
    dall * isum as f32 - dmin * summs as f32
}

/// `Σ bsum·m`: the mins' share of the dot product, from the activations' 16-element sums.
#[inline]
fn min_sum(x: &[u8], y: &[u8]) -> i32 {
    (0..16)
        .map(|j| q8_k::block_bsum(y, j) * (x[j] >> 4) as i32)
        .sum()
}

/// Dot product of a Q2_K row with a Q8_K row (SIMD where available). The integer sums are
/// exact and the float steps shared, so it equals [`vec_dot_scalar`] bit for bit.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_scalar)
}

/// ggml's `ggml_vec_dot_q2_K_q8_K`: per block, integer sums of `q·q8` per sub-block times the
/// 4-bit scales, the mins applied through the activations' `bsums`, then one float step with
/// `dall = a.d·w.d`, `dmin = a.d·w.dmin`.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    q8_k::check_dot(w, BYTES, a);
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
        let q8 = q8_k::block_qs(y);
        let mut isum = 0i32;
        for (is, q8) in q8.chunks_exact(16).enumerate() {
            let q = &x[QS + 32 * (is / 8) + 16 * (is % 2)..][..16];
            let shift = 2 * (is % 8 / 2);
            let s: i32 = (0..16)
                .map(|l| ((q[l] >> shift) & 3) as i32 * q8[l] as i8 as i32)
                .sum();
            isum += (x[is] & 0xf) as i32 * s;
        }
        sumf += block_dot(x, y, isum, min_sum(x, y));
    }
    sumf
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::x86::*;
    use std::arch::x86_64::*;

    /// Elements `32j..32j + 32` of a half block: bits `2j..2j + 2` of its 32 `qs` bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn quants(q2: __m256i, j: usize) -> __m256i {
        let shifted = _mm256_srl_epi16(q2, _mm_cvtsi32_si128(2 * j as i32));
        _mm256_and_si256(shifted, _mm256_set1_epi8(3))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            // Scale byte i: `ds[i] = d·(s & 15)`, `ms[i] = dmin·(s >> 4)`.
            let s = load_u8x16(b);
            let m4 = _mm_set1_epi8(0xf);
            let ds = scales_x16(_mm_and_si128(s, m4), f16c_at(&b[D..]));
            let ms = scales_x16(
                _mm_and_si128(_mm_srli_epi16::<4>(s), m4),
                f16c_at(&b[DMIN..]),
            );
            let (ds, ms) = (in_memory(&ds), in_memory(&ms));
            let mut q = Staged::new();
            for n in 0..2 {
                let q2 = load_u8x32(&b[QS + 32 * n..]);
                for j in 0..4 {
                    q.put(4 * n + j, quants(q2, j));
                }
            }
            affine_groups::<16>(&in_memory(&q).0, ds, ms, y);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        q8_k::check_dot(w, BYTES, a);
        let mut sumf = 0f32;
        for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
            let q8 = q8_k::block_qs(y);
            let mut acc = _mm256_setzero_si256();
            for n in 0..2 {
                let q2 = load_u8x32(&x[QS + 32 * n..]);
                for j in 0..4 {
                    let is = 8 * n + 2 * j;
                    let p = _mm256_maddubs_epi16(quants(q2, j), load_u8x32(&q8[32 * (is / 2)..]));
                    let sc = set_i16_halves((x[is] & 0xf) as i16, (x[is + 1] & 0xf) as i16);
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
                }
            }
            sumf += block_dot(x, y, hsum_i32x8(acc), min_sum(x, y));
        }
        sumf
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use crate::arm::*;
    use std::arch::aarch64::*;

    /// The 16 quants of sub-block `is`.
    #[inline]
    #[target_feature(enable = "neon")]
    fn quants(b: &[u8], is: usize) -> int8x16_t {
        let q = load_u8x16(&b[QS + 32 * (is / 8) + 16 * (is % 2)..]);
        let q = vandq_u8(shr_u8(q, 2 * (is % 8 / 2)), vdupq_n_u8(3));
        vreinterpretq_s8_u8(q)
    }

    #[target_feature(enable = "neon")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            let (d, min) = (f16_le(&b[D..]), f16_le(&b[DMIN..]));
            for (is, y) in y.chunks_exact_mut(16).enumerate() {
                let sc = b[is];
                let (dl, ml) = (d * (sc & 0xf) as f32, min * (sc >> 4) as f32);
                store_affine_i8x16(y, quants(b, is), dl, ml);
            }
        }
    }

    #[target_feature(enable = "neon")]
    pub(super) fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        q8_k::check_dot(w, BYTES, a);
        let mut sumf = 0f32;
        for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
            let q8 = q8_k::block_qs(y);
            let mut isum = 0i32;
            for (is, q8) in q8.chunks_exact(16).enumerate() {
                let s = dot_i8x16(quants(x, is), vreinterpretq_s8_u8(load_u8x16(q8)));
                isum += (x[is] & 0xf) as i32 * s;
            }
            sumf += block_dot(x, y, isum, min_sum(x, y));
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    // Measured: ggml's quantizer (same bits) peaks near 0.26 on random rows; its relative RMSE
    // on ggml's data is 0.211.
    kquant_tests! {
        random_rel_rmse: 0.35,
        ggml_rmse: 0.0075,
        ggml_rel_rmse: 0.25,
        dot_error: 0.04,
        known: ("40e81df977d2500121bc6e23c6686427", "b5d1d60b11976cf0aa0975ec72df4ca8"),
        known_dot: (176.70868, 4429.5),
    }
}
