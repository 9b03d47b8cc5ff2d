//! IQ4_XS: 4-bit indices into the non-linear IQ4_NL codebook, in 256-element super-blocks of
//! 8 sub-blocks of 32, each with a signed 6-bit scale: `y = d·(ls − 32)·KVALUES_IQ4NL[q]`.
//!
//! Block (136 bytes): `d: f16`, `scales_h: u16` (2 high bits per sub-block), `scales_l: [u8; 4]`
//! (4 low bits per sub-block, even sub-blocks in the low nibble), `qs: [u8; 128]`. Sub-block
//! `ib` uses `qs[16ib..16ib + 16]`: low nibbles are its elements 0..16, high nibbles 16..32.

use super::cpu::dispatch;
use super::ggml::{GROUP_MAX_EPS, QK_K, f16_le, nearest_int, put_f16};
use super::q8_k;

/// Bytes per 256-element block.
pub const BYTES: usize = 136;

/// Elements per block.
pub const BLOCK: usize = QK_K;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format =
    super::format_entry!(IQ4_XS, "iq4_xs", vec_dot_type: Q8_K, dot_exact: true);

// The block layout adds up.
const _: () = assert!(BYTES == 2 + 2 + BLOCK / 64 + BLOCK / 2);

/// ggml's `kvalues_iq4nl`: the 16 levels, denser near zero, that IQ4_NL and IQ4_XS index.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Byte offsets inside a block.
const SCALES_H: usize = 2;
const SCALES_L: usize = 4;
const QS: usize = 8;

/// ggml's `best_index_int8`: the index of the level nearest `x` in the sorted `val`, ties to
/// the upper one. This is the bisection the pinned llama.cpp ships (newer trees compare
/// `2x ≥ val[i-1] + val[i]` instead: the same answer for every finite `x`, but NaN picks the
/// last level here and the first there).
pub fn best_index_int8(val: &[i8], x: f32) -> usize {
    let n = val.len();
    if x <= val[0] as f32 {
        return 0;
    }
    if x >= val[n - 1] as f32 {
        return n - 1;
    }
    let (mut ml, mut mu) = (0, n - 1);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < val[mav] as f32 {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - (val[mu - 1] as f32) < val[mu] as f32 - x {
        mu - 1
    } else {
        mu
    }
}

/// The signed scale (`ls − 32`, in −32..32) of sub-block `ib`.
#[inline]
fn scale(b: &[u8], ib: usize) -> i32 {
    let scales_h = u16::from_le_bytes([b[SCALES_H], b[SCALES_H + 1]]);
    let lo = (b[SCALES_L + ib / 2] >> (4 * (ib % 2))) & 0xf;
    let hi = ((scales_h >> (2 * ib)) & 3) as u8;
    (lo | (hi << 4)) as i32 - 32
}

/// Decode `dst.len()` elements (SIMD where available; bit-identical to [`dequantize_scalar`]).
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `dequantize_row_iq4_xs`: `dl = d·(ls − 32)`, `y = dl·KVALUES_IQ4NL[q]`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() / QK_K * BYTES);
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_le(b);
        for (ib, (q, y)) in b[QS..]
            .chunks_exact(16)
            .zip(y.chunks_exact_mut(32))
            .enumerate()
        {
            let dl = d * scale(b, ib) as f32;
            let (lo, hi) = y.split_at_mut(16);
            for j in 0..16 {
                lo[j] = dl * KVALUES_IQ4NL[(q[j] & 0xf) as usize] as f32;
                hi[j] = dl * KVALUES_IQ4NL[(q[j] >> 4) as usize] as f32;
            }
        }
    }
}

/// ggml's `quantize_row_iq4_xs_ref` (`quantize_row_iq4_nl_impl` with 32-element sub-blocks,
/// no importance weights, `ntry = 7`): per sub-block, the x²-weighted least-squares scale
/// over 15 trial scales for the nearest-level assignment; then the 8 scales go to signed 6 bits
/// against the largest in magnitude and every element is re-assigned to its rounded scale.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() / QK_K * BYTES);
    const NTRY: i32 = 7;
    let values = &KVALUES_IQ4NL;
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BYTES)) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 8];
        let (mut max_scale, mut amax_scale) = (0f32, 0f32);
        for (ib, xb) in x.chunks_exact(32).enumerate() {
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in xb {
                if v.abs() > amax {
                    amax = v.abs();
                    max = v;
                }
            }
            if amax < GROUP_MAX_EPS {
                scales[ib] = 0.0;
                continue;
            }
            // (Σ w·q·x, Σ w·q²) for the nearest levels to `id·x`, with w = x².
            let fit = |id: f32, lb: Option<&mut [u8]>| {
                let (mut sumqx, mut sumq2) = (0f32, 0f32);
                let mut lb = lb;
                for (j, &v) in xb.iter().enumerate() {
                    let k = best_index_int8(values, id * v);
                    if let Some(lb) = lb.as_deref_mut() {
                        lb[j] = k as u8;
                    }
                    let (q, w) = (values[k] as f32, v * v);
                    sumqx += w * q * v;
                    sumq2 += w * q * q;
                }
                (sumqx, sumq2)
            };
            let d = -max / values[0] as f32;
            let (sumqx, sumq2) = fit(1.0 / d, Some(&mut l[32 * ib..32 * ib + 32]));
            let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
            let mut best = d * sumqx;
            for itry in -NTRY..=NTRY {
                let id = (itry + values[0] as i32) as f32 / max;
                let (sumqx, sumq2) = fit(id, None);
                if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                    d = sumqx / sumq2;
                    best = d * sumqx;
                }
            }
            scales[ib] = d;
            if d.abs() > amax_scale {
                amax_scale = d.abs();
                max_scale = d;
            }
        }

        // The super-block scale maps the largest sub-block scale to -32; note ggml keeps
        // using the unrounded `d` (not the stored f16) for the sub-block scales.
        let d = -max_scale / 32.0;
        put_f16(&mut b[0..], d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        b[SCALES_L..QS].fill(0);
        for (ib, xb) in x.chunks_exact(32).enumerate() {
            let ls = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * ls as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for (l, &v) in l[32 * ib..32 * ib + 32].iter_mut().zip(xb) {
                *l = best_index_int8(values, idl * v) as u8;
            }
            let ls = (ls + 32) as u8;
            b[SCALES_L + ib / 2] |= (ls & 0xf) << (4 * (ib % 2));
            scales_h |= ((ls >> 4) as u16) << (2 * ib);
        }
        b[SCALES_H..SCALES_L].copy_from_slice(&scales_h.to_le_bytes());

        for (q, l) in b[QS..].chunks_exact_mut(16).zip(l.chunks_exact(32)) {
            for j in 0..16 {
                q[j] = l[j] | (l[j + 16] << 4);
            }
        }
    }
}

/// One block's float result from its integer sum, shared by both dot-product twins.
#[inline]
fn block_dot(x: &[u8], y: &[u8], isum: i32) -> f32 {
    f16_le(x) * q8_k::block_d(y) * isum as f32
}

/// Dot product of an IQ4_XS row with a Q8_K row (SIMD where available). The integer sums are
/// exact and the float steps shared, so it equals [`vec_dot_scalar`] bit for bit.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_scalar)
}

/// ggml's `ggml_vec_dot_iq4_xs_q8_K`: per block, integer sums of `level·q8` per sub-block times
/// the signed scales, then one float step with `d = w.d·a.d` (ggml applies the scale in float
/// per sub-block; the integer form is the same sum with a single rounding).
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    q8_k::check_dot(w, BYTES, a);
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
        let q8 = q8_k::block_qs(y);
        let mut isum = 0i32;
        for (ib, (q, q8)) in x[QS..]
            .chunks_exact(16)
            .zip(q8.chunks_exact(32))
            .enumerate()
        {
            let mut s = 0i32;
            for j in 0..16 {
                s += KVALUES_IQ4NL[(q[j] & 0xf) as usize] as i32 * q8[j] as i8 as i32;
                s += KVALUES_IQ4NL[(q[j] >> 4) as usize] as i32 * q8[j + 16] as i8 as i32;
            }
            isum += scale(x, ib) * s;
        }
        sumf += block_dot(x, y, isum);
    }
    sumf
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::x86::*;
    use std::arch::x86_64::*;

    /// The 32 levels of one sub-block from its 16 `qs` bytes: (elements 0..16, 16..32).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn levels(q: &[u8]) -> (__m128i, __m128i) {
        let table = load_u8x16(&KVALUES_IQ4NL.map(|v| v as u8));
        let m4 = _mm_set1_epi8(0xf);
        let q = load_u8x16(q);
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m4));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(q), m4));
        (lo, hi)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            let d = f16c_at(b);
            let dl: [f32; 8] = std::array::from_fn(|ib| d * scale(b, ib) as f32);
            let mut q = Staged::new();
            for (ib, qs) in b[QS..].chunks_exact(16).enumerate() {
                let (lo, hi) = levels(qs);
                q.put16(2 * ib, lo);
                q.put16(2 * ib + 1, hi);
            }
            scale_groups::<32>(&in_memory(&q).0, in_memory(&dl), y);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        q8_k::check_dot(w, BYTES, a);
        let mut sumf = 0f32;
        for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
            let q8 = q8_k::block_qs(y);
            let mut acc = _mm256_setzero_si256();
            for (ib, q) in x[QS..].chunks_exact(16).enumerate() {
                let (lo, hi) = levels(q);
                let v = _mm256_set_m128i(hi, lo);
                let a8 = load_u8x32(&q8[32 * ib..]);
                // |q8| (unsigned, 128 for -128) × level with q8's sign: exact for every int8,
                // pair sums within ±2·128·127.
                let p = _mm256_maddubs_epi16(_mm256_abs_epi8(a8), _mm256_sign_epi8(v, a8));
                let s = _mm256_set1_epi16(scale(x, ib) as i16);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
            }
            sumf += block_dot(x, y, hsum_i32x8(acc));
        }
        sumf
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use crate::arm::*;
    use std::arch::aarch64::*;

    /// The 32 levels of one sub-block from its 16 `qs` bytes: (elements 0..16, 16..32).
    #[inline]
    #[target_feature(enable = "neon")]
    fn levels(q: &[u8]) -> (int8x16_t, int8x16_t) {
        let table = vreinterpretq_s8_u8(load_u8x16(&KVALUES_IQ4NL.map(|v| v as u8)));
        let q = load_u8x16(q);
        let lo = vqtbl1q_s8(table, vandq_u8(q, vdupq_n_u8(0xf)));
        let hi = vqtbl1q_s8(table, vshrq_n_u8::<4>(q));
        (lo, hi)
    }

    #[target_feature(enable = "neon")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            let d = f16_le(b);
            for (ib, (q, y)) in b[QS..]
                .chunks_exact(16)
                .zip(y.chunks_exact_mut(32))
                .enumerate()
            {
                let dl = d * scale(b, ib) as f32;
                let (lo, hi) = levels(q);
                store_scaled_i8x16(&mut y[..16], lo, dl);
                store_scaled_i8x16(&mut y[16..], hi, dl);
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
            for (ib, (q, q8)) in x[QS..]
                .chunks_exact(16)
                .zip(q8.chunks_exact(32))
                .enumerate()
            {
                let (lo, hi) = levels(q);
                let a_lo = vreinterpretq_s8_u8(load_u8x16(q8));
                let a_hi = vreinterpretq_s8_u8(load_u8x16(&q8[16..]));
                isum += scale(x, ib) * (dot_i8x16(lo, a_lo) + dot_i8x16(hi, a_hi));
            }
            sumf += block_dot(x, y, isum);
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    // Measured: ggml's quantizer (same bits) peaks near 0.069 on random rows; its relative RMSE
    // on ggml's data is 0.057.
    kquant_tests! {
        random_rel_rmse: 0.1,
        ggml_rmse: 0.002,
        ggml_rel_rmse: 0.065,
        dot_error: 0.02,
        known: ("50cf48795582da4fe0c98cfbe97714f4", "0258283b2e357bdc3b2e3b250993acd3"),
        known_dot: (183.69266, 4437.2),
    }

    proptest! {




        #[test]
        fn best_index_is_nearest(x in -200f32..200.0) {
            let k = best_index_int8(&KVALUES_IQ4NL, x);
            let dist = |i: usize| (KVALUES_IQ4NL[i] as f32 - x).abs();
            prop_assert!((0..16).all(|i| dist(k) <= dist(i)));
        }
    }

    #[test]
    fn best_index_ties_go_up() {
        // Midpoints between neighbours (and the ends) pick the upper level.
        for i in 1..16 {
            let mid = (KVALUES_IQ4NL[i - 1] as f32 + KVALUES_IQ4NL[i] as f32) / 2.0;
            assert_eq!(best_index_int8(&KVALUES_IQ4NL, mid), i);
        }
        assert_eq!(best_index_int8(&KVALUES_IQ4NL, -1e9), 0);
        assert_eq!(best_index_int8(&KVALUES_IQ4NL, 1e9), 15);
        assert_eq!(best_index_int8(&KVALUES_IQ4NL, f32::NAN), 15);
    }
}
