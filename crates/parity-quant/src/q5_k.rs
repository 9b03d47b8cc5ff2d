//! Q5_K: Q4_K plus a fifth bit per element: 8 sub-blocks of 32, 6-bit scale and min each,
//! `y = d·sc·q − dmin·m` with `q` in 0..32.
//!
//! Block (176 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]` (as Q4_K), `qh: [u8; 32]`,
//! `qs: [u8; 128]`. Group `g` (64 elements) takes its low nibbles from `qs[32g..32g + 32]`
//! (elements 0..32, then the high nibbles for 32..64); the fifth bit of element `l` of the
//! first half is bit `2g` of `qh[l]`, of the second half bit `2g + 1`.

use super::cpu::dispatch;
use super::ggml::{QK_K, f16_le, get_scale_min_k4, make_qkx2_quants, nearest_int, put_f16};
use super::q8_k;

/// Bytes per 256-element block.
pub const BYTES: usize = 176;

/// Elements per block.
pub const BLOCK: usize = QK_K;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format =
    super::format_entry!(Q5_K, "q5_K", vec_dot_type: Q8_K, dot_exact: true);

// The block layout adds up.
const _: () = assert!(BYTES == 2 + 2 + 12 + BLOCK / 8 + BLOCK / 2);

/// Byte offsets inside a block.
const SCALES: usize = 4;
const QH: usize = 16;
const QS: usize = 48;

/// All 8 (scale, min) pairs of a block.
fn scales_mins(scales: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        (sc[j], m[j]) = get_scale_min_k4(j, scales);
    }
    (sc, m)
}

/// Decode `dst.len()` elements (SIMD where available; bit-identical to [`dequantize_scalar`]).
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `dequantize_row_q5_K`: per sub-block `d1 = d·sc`, `m1 = dmin·m`,
/// `y = d1·(nibble + 16·bit) − m1`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() / QK_K * BYTES);
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, min) = (f16_le(&b[0..]), f16_le(&b[2..]));
        let (sc, m) = scales_mins(&b[SCALES..QH]);
        let qh = &b[QH..QS];
        for (g, (ql, y)) in b[QS..]
            .chunks_exact(32)
            .zip(y.chunks_exact_mut(64))
            .enumerate()
        {
            let (d1, m1) = (d * sc[2 * g] as f32, min * m[2 * g] as f32);
            let (d2, m2) = (d * sc[2 * g + 1] as f32, min * m[2 * g + 1] as f32);
            let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
            let (lo, hi) = y.split_at_mut(32);
            for l in 0..32 {
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                lo[l] = d1 * ((ql[l] & 0xf) + h1) as f32 - m1;
                hi[l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

/// ggml's `quantize_row_q5_K_ref`: Q4_K's procedure with `nmax = 31` and a shorter scale
/// search ([`make_qkx2_quants`] from −0.5 in 15 steps of 0.1).
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() / QK_K * BYTES);
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BYTES)) {
        let mut l = [0u8; QK_K];
        let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..8 {
            let xs = &x[32 * j..32 * j + 32];
            let mut sum_x2 = 0f32;
            for &v in xs {
                sum_x2 += v * v;
            }
            let av_x = (sum_x2 / 32.0).sqrt();
            let weights: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
            let (s, m) = make_qkx2_quants(31, xs, &weights, &mut l[32 * j..], -0.5, 0.1, 15, false);
            (scales[j], mins[j]) = (s, m);
            if s > max_scale {
                max_scale = s;
            }
            if m > max_min {
                max_min = m;
            }
        }

        let inv_scale = if max_scale > 0.0 {
            63.0 / max_scale
        } else {
            0.0
        };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        let sc = &mut b[SCALES..QH];
        for j in 0..8 {
            // ggml stores nearest_int into a uint8_t (wrapping) before clamping.
            let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
            let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
            if j < 4 {
                sc[j] = ls;
                sc[j + 4] = lm;
            } else {
                sc[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
                sc[j - 4] |= (ls >> 4) << 6;
                sc[j] |= (lm >> 4) << 6;
            }
        }
        put_f16(&mut b[0..], max_scale / 63.0);
        put_f16(&mut b[2..], max_min / 63.0);

        let (d, dmin) = (f16_le(&b[0..]), f16_le(&b[2..]));
        for j in 0..8 {
            let (sc, m) = get_scale_min_k4(j, &b[SCALES..QH]);
            let d = d * sc as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin * m as f32;
            for i in 32 * j..32 * j + 32 {
                l[i] = nearest_int((x[i] + dm) / d).clamp(0, 31) as u8;
            }
        }

        let (qh, ql) = b[QH..].split_at_mut(QS - QH);
        qh.fill(0);
        for (g, (ql, l)) in ql.chunks_exact_mut(32).zip(l.chunks_exact(64)).enumerate() {
            for j in 0..32 {
                let (mut l1, mut l2) = (l[j], l[j + 32]);
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= 1 << (2 * g);
                }
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= 2 << (2 * g);
                }
                ql[j] = l1 | (l2 << 4);
            }
        }
    }
}

/// One block's float result from its integer sums, shared by both dot-product twins so they
/// round identically: `d·Σ sc·(q·q8) − dmin·Σ m·bsum`.
#[inline]
fn block_dot(x: &[u8], y: &[u8], isum: i32, summs: i32) -> f32 {
    let dy = q8_k::block_d(y);
    let (d, dmin) = (f16_le(&x[0..]) * dy, f16_le(&x[2..]) * dy);
    d * isum as f32 - dmin * summs as f32
}

/// `Σ bsum·m`: the mins' share of the dot product, from the activations' 16-element sums.
#[inline]
fn min_sum(y: &[u8], m: &[u8; 8]) -> i32 {
    (0..16)
        .map(|j| q8_k::block_bsum(y, j) * m[j / 2] as i32)
        .sum()
}

/// Dot product of a Q5_K row with a Q8_K row (SIMD where available). The integer sums are
/// exact and the float steps shared, so it equals [`vec_dot_scalar`] bit for bit.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_scalar)
}

/// ggml's `ggml_vec_dot_q5_K_q8_K`, plainly: per block, integer sums of `q·q8` per sub-block
/// times the 6-bit scales, the mins applied through the activations' `bsums`, then one float
/// step with `d = w.d·a.d`.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    q8_k::check_dot(w, BYTES, a);
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
        let (sc, m) = scales_mins(&x[SCALES..QH]);
        let (qh, q8) = (&x[QH..QS], q8_k::block_qs(y));
        let mut isum = 0i32;
        for (g, ql) in x[QS..].chunks_exact(32).enumerate() {
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let q1 = (ql[l] & 0xf) as i32 + ((qh[l] >> (2 * g)) & 1) as i32 * 16;
                let q2 = (ql[l] >> 4) as i32 + ((qh[l] >> (2 * g + 1)) & 1) as i32 * 16;
                lo += q1 * q8[64 * g + l] as i8 as i32;
                hi += q2 * q8[64 * g + 32 + l] as i8 as i32;
            }
            isum += sc[2 * g] as i32 * lo + sc[2 * g + 1] as i32 * hi;
        }
        sumf += block_dot(x, y, isum, min_sum(y, &m));
    }
    sumf
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::x86::*;
    use std::arch::x86_64::*;

    /// The 5-bit quants of group `g` (64 elements) as two vectors of 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn quants(ql: &[u8], qh: __m256i, g: usize) -> (__m256i, __m256i) {
        let m4 = _mm256_set1_epi8(0xf);
        let bit16 = _mm256_set1_epi8(16);
        let (u1, u2) = (
            _mm256_set1_epi8(1 << (2 * g)),
            _mm256_set1_epi8(2 << (2 * g)),
        );
        let ql = load_u8x32(ql);
        // 0xff where the fifth bit is set, masked down to 16.
        let h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, u1), u1), bit16);
        let h2 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, u2), u2), bit16);
        let lo = _mm256_or_si256(_mm256_and_si256(ql, m4), h1);
        let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4), h2);
        (lo, hi)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            // As in Q4_K: `ds[j] = d·sc[j]`, `ms[8 + j] = dmin·m[j]`.
            let sm = scales_mins_x16(&b[SCALES..QH]);
            let ds = scales_x16(sm, f16c_at(&b[0..]));
            let ms = scales_x16(sm, f16c_at(&b[2..]));
            let (ds, ms) = (in_memory(&ds), in_memory(&ms));
            let qh = load_u8x32(&b[QH..]);
            let mut q = Staged::new();
            for (g, ql) in b[QS..].chunks_exact(32).enumerate() {
                let (lo, hi) = quants(ql, qh, g);
                q.put(2 * g, lo);
                q.put(2 * g + 1, hi);
            }
            affine_groups::<32>(&in_memory(&q).0, &ds[..8], &ms[8..], y);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        q8_k::check_dot(w, BYTES, a);
        let mut sumf = 0f32;
        for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
            let (sc, m) = scales_mins(&x[SCALES..QH]);
            let q8 = q8_k::block_qs(y);
            let qh = load_u8x32(&x[QH..]);
            let mut acc = _mm256_setzero_si256();
            for (g, ql) in x[QS..].chunks_exact(32).enumerate() {
                let (lo, hi) = quants(ql, qh, g);
                // 5-bit × int8 pairs sum to at most 2·31·128: no i16 saturation.
                let plo = _mm256_maddubs_epi16(lo, load_u8x32(&q8[64 * g..]));
                let phi = _mm256_maddubs_epi16(hi, load_u8x32(&q8[64 * g + 32..]));
                let plo = _mm256_madd_epi16(plo, _mm256_set1_epi16(sc[2 * g] as i16));
                let phi = _mm256_madd_epi16(phi, _mm256_set1_epi16(sc[2 * g + 1] as i16));
                acc = _mm256_add_epi32(acc, _mm256_add_epi32(plo, phi));
            }
            sumf += block_dot(x, y, hsum_i32x8(acc), min_sum(y, &m));
        }
        sumf
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use crate::arm::*;
    use std::arch::aarch64::*;

    /// Elements `16h..16h + 16` of both halves of group `g`: (first half, second half).
    #[inline]
    #[target_feature(enable = "neon")]
    fn quants(b: &[u8], g: usize, h: usize) -> (int8x16_t, int8x16_t) {
        let ql = load_u8x16(&b[QS + 32 * g + 16 * h..]);
        let qh = load_u8x16(&b[QH + 16 * h..]);
        let bit16 = vdupq_n_u8(16);
        // vtst: 0xff where the fifth bit is set.
        let h1 = vandq_u8(vtstq_u8(qh, vdupq_n_u8(1 << (2 * g))), bit16);
        let h2 = vandq_u8(vtstq_u8(qh, vdupq_n_u8(2 << (2 * g))), bit16);
        let lo = vorrq_u8(vandq_u8(ql, vdupq_n_u8(0xf)), h1);
        let hi = vorrq_u8(vshrq_n_u8::<4>(ql), h2);
        (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi))
    }

    #[target_feature(enable = "neon")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            let (d, min) = (f16_le(&b[0..]), f16_le(&b[2..]));
            let (sc, m) = scales_mins(&b[SCALES..QH]);
            for (g, y) in y.chunks_exact_mut(64).enumerate() {
                let (d1, m1) = (d * sc[2 * g] as f32, min * m[2 * g] as f32);
                let (d2, m2) = (d * sc[2 * g + 1] as f32, min * m[2 * g + 1] as f32);
                for h in 0..2 {
                    let (lo, hi) = quants(b, g, h);
                    store_affine_i8x16(&mut y[16 * h..], lo, d1, m1);
                    store_affine_i8x16(&mut y[32 + 16 * h..], hi, d2, m2);
                }
            }
        }
    }

    #[target_feature(enable = "neon")]
    pub(super) fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        q8_k::check_dot(w, BYTES, a);
        let mut sumf = 0f32;
        for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
            let (sc, m) = scales_mins(&x[SCALES..QH]);
            let q8 = q8_k::block_qs(y);
            let mut isum = 0i32;
            for g in 0..4 {
                let (mut lo, mut hi) = (0i32, 0i32);
                for h in 0..2 {
                    let (ql, qh) = quants(x, g, h);
                    let a_lo = vreinterpretq_s8_u8(load_u8x16(&q8[64 * g + 16 * h..]));
                    let a_hi = vreinterpretq_s8_u8(load_u8x16(&q8[64 * g + 32 + 16 * h..]));
                    lo += dot_i8x16(ql, a_lo);
                    hi += dot_i8x16(qh, a_hi);
                }
                isum += sc[2 * g] as i32 * lo + sc[2 * g + 1] as i32 * hi;
            }
            sumf += block_dot(x, y, isum, min_sum(y, &m));
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    // Measured: ggml's quantizer (same bits) peaks near 0.029 on random rows; its relative RMSE
    // on ggml's data is 0.024.
    kquant_tests! {
        random_rel_rmse: 0.04,
        ggml_rmse: 0.002,
        ggml_rel_rmse: 0.028,
        dot_error: 0.02,
        known: ("840500a4ea0545404653fecf494a9bdd", "8f979697abd2c102923512eab54f4778"),
        known_dot: (168.16553, 4442.1),
    }
}
