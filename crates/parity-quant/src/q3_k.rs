//! Q3_K: 3-bit signed quants in 256-element super-blocks of 16 sub-blocks of 16, each with a
//! signed 6-bit scale: `y = d·(sc − 32)·q`, `q` in −4..4.
//!
//! Block (110 bytes): `hmask: [u8; 32]`, `qs: [u8; 64]`, `scales: [u8; 12]`, `d: f16`. The low
//! 2 bits of `q + 4` are laid out as Q2_K's `qs`; its high bit lives in `hmask`: bit `k` of
//! `hmask[l]` belongs to element `32k + l`, and a clear bit means `q + 4 < 4` (subtract 4).
//! The 16 scales keep their low nibbles in `scales[0..8]` and their top 2 bits in
//! `scales[8..12]` (see `unpack_scales`).

use super::cpu::dispatch;
use super::ggml::{GROUP_MAX_EPS, QK_K, f16_le, nearest_int, put_f16};
use super::q8_k;

/// Bytes per 256-element block.
pub const BYTES: usize = 110;

/// Elements per block.
pub const BLOCK: usize = QK_K;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format =
    super::format_entry!(Q3_K, "q3_K", vec_dot_type: Q8_K, dot_exact: true);

// The block layout adds up.
const _: () = assert!(BYTES == BLOCK / 8 + BLOCK / 4 + 12 + 2);

/// Byte offsets inside a block.
const QS: usize = 32;
const SCALES: usize = 96;
const D: usize = 108;

/// The 16 sub-block scales, already minus 32: scale `j` has its low nibble in
/// `scales[j % 8]` (low nibble for j < 8, high for j ≥ 8) and its top 2 bits at bit
/// `2·(j / 4)` of `scales[8 + j % 4]`.
#[inline]
fn unpack_scales(scales: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let lo = if j < 8 {
            scales[j] & 0xf
        } else {
            scales[j - 8] >> 4
        };
        let hi = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
        (lo | (hi << 4)) as i8 - 32
    })
}

/// Decode `dst.len()` elements (SIMD where available; bit-identical to [`dequantize_scalar`]).
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// The 3-bit quant (−4..4) of element `32k + l` of `half` (128 elements) of a block.
#[inline]
fn quant(b: &[u8], half: usize, k: usize, l: usize) -> i32 {
    let low = (b[QS + 32 * half + l] >> (2 * (k % 4))) & 3;
    let high_set = b[l] & (1 << k) != 0;
    low as i32 - if high_set { 0 } else { 4 }
}

/// ggml's `dequantize_row_q3_K`: `dl = d·(sc − 32)`, `y = dl·q`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() / QK_K * BYTES);
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_le(&b[D..]);
        let sc = unpack_scales(&b[SCALES..D]);
        // 32-element group `k` (0..8): `hmask` bit k; low bits from half k / 4, shift 2·(k % 4).
        for (k, y) in y.chunks_exact_mut(32).enumerate() {
            for (h, y) in y.chunks_exact_mut(16).enumerate() {
                let dl = d * sc[2 * k + h] as f32;
                for (i, y) in y.iter_mut().enumerate() {
                    *y = dl * quant(b, k / 4, k, 16 * h + i) as f32;
                }
            }
        }
    }
}

/// ggml's `make_q3_quants` with `do_rmse`: start from `nearest(x·nmax/max)`, then up to 5
/// passes moving single quants while that raises the x²-weighted fit `Σwxl² / Σwl²`.
/// Writes `L + nmax` and returns the scale.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let n = x.len();
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = q as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let li = l[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] as i32 {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for v in &mut l[..n] {
        *v += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// ggml's `quantize_row_q3_K_ref`: fit each 16-element sub-block with `make_q3_quants`,
/// quantize the 16 scales to signed 6 bits against the largest in magnitude, then requantize
/// every element against its rounded scale.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() / QK_K * BYTES);
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BYTES)) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut amax) = (0f32, 0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }

        let sc = &mut b[SCALES..D];
        sc.fill(0);
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &s) in scales.iter().enumerate() {
                // ggml keeps nearest_int in an int8_t (wrapping) before clamping.
                let v = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    sc[j] = v & 0xf;
                } else {
                    sc[j - 8] |= (v & 0xf) << 4;
                }
                sc[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
            }
            put_f16(&mut b[D..], 1.0 / iscale);
        } else {
            put_f16(&mut b[D..], 0.0);
        }

        let d = f16_le(&b[D..]);
        let sc = unpack_scales(&b[SCALES..D]);
        for ((&sc, xs), l) in sc
            .iter()
            .zip(x.chunks_exact(16))
            .zip(l.chunks_exact_mut(16))
        {
            let d = d * sc as f32;
            if d == 0.0 {
                continue;
            }
            for (l, &v) in l.iter_mut().zip(xs) {
                *l = nearest_int(v / d).clamp(-4, 3) as i8 + 4;
            }
        }

        // High bit of element 32k + m goes to bit k of hmask[m].
        let (hmask, rest) = b.split_at_mut(QS);
        hmask.fill(0);
        for (j, l) in l.iter_mut().enumerate() {
            if *l > 3 {
                hmask[j % 32] |= 1 << (j / 32);
                *l -= 4;
            }
        }
        for (q, l) in rest[..SCALES - QS]
            .chunks_exact_mut(32)
            .zip(l.chunks_exact(128))
        {
            for i in 0..32 {
                q[i] = (l[i] | (l[i + 32] << 2) | (l[i + 64] << 4) | (l[i + 96] << 6)) as u8;
            }
        }
    }
}

/// One block's float result from its integer sum, shared by both dot-product twins.
#[inline]
fn block_dot(x: &[u8], y: &[u8], isum: i32) -> f32 {
    f16_le(&x[D..]) * q8_k::block_d(y) * isum as f32
}

/// Dot product of a Q3_K row with a Q8_K row (SIMD where available). The integer sums are
/// exact and the float steps shared, so it equals [`vec_dot_scalar`] bit for bit.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_scalar)
}

/// ggml's `ggml_vec_dot_q3_K_q8_K`: per block, integer sums of `q·q8` per sub-block times the
/// signed scales, then one float step with `d = w.d·a.d`.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    q8_k::check_dot(w, BYTES, a);
    let mut sumf = 0f32;
    for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
        let sc = unpack_scales(&x[SCALES..D]);
        let q8 = q8_k::block_qs(y);
        let mut isum = 0i32;
        for k in 0..8 {
            for h in 0..2 {
                let s: i32 = (16 * h..16 * h + 16)
                    .map(|l| quant(x, k / 4, k, l) * q8[32 * k + l] as i8 as i32)
                    .sum();
                isum += sc[2 * k + h] as i32 * s;
            }
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

    /// Group `k` (32 elements) as (low 2 bits, 4 where the high bit is clear): `q = low − sub`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn quants(q3: __m256i, hmask: __m256i, k: usize) -> (__m256i, __m256i) {
        let shift = _mm_cvtsi32_si128(2 * (k % 4) as i32);
        let low = _mm256_and_si256(_mm256_srl_epi16(q3, shift), _mm256_set1_epi8(3));
        let bit = _mm256_set1_epi8((1u8 << k) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
        (low, _mm256_andnot_si256(set, _mm256_set1_epi8(4)))
    }

    /// [`unpack_scales`] in 16 bytes by whole-word masks and shifts (a byte loop stores 16
    /// bytes one by one, and the vector load of them then stalls on store forwarding).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scales_x16_words(s: &[u8]) -> __m128i {
        let s: &[u8; 12] = s[..12].try_into().unwrap();
        let lo = u64::from_le_bytes(s[..8].try_into().unwrap());
        let w = u32::from_le_bytes(s[8..].try_into().unwrap());
        const LOW4: u64 = 0x0f0f_0f0f_0f0f_0f0f;
        // Scale j takes bits 2·(j / 4) of byte 8 + j % 4 as its top two bits.
        let top = |k: u32| u64::from(((w >> (2 * k)) & 0x0303_0303) << 4);
        let first = (lo & LOW4) | top(0) | (top(1) << 32);
        let second = ((lo >> 4) & LOW4) | top(2) | (top(3) << 32);
        _mm_sub_epi8(
            _mm_set_epi64x(second as i64, first as i64),
            _mm_set1_epi8(32),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            let dl = scales_x16(scales_x16_words(&b[SCALES..D]), f16c_at(&b[D..]));
            let dl = in_memory(&dl);
            let hmask = load_u8x32(b);
            let q3 = [load_u8x32(&b[QS..]), load_u8x32(&b[QS + 32..])];
            let mut q = Staged::new();
            for k in 0..8 {
                let (low, sub) = quants(q3[k / 4], hmask, k);
                q.put(k, _mm256_sub_epi8(low, sub));
            }
            scale_groups::<16>(&in_memory(&q).0, dl, y);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        q8_k::check_dot(w, BYTES, a);
        let mut sumf = 0f32;
        for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
            let sc = unpack_scales(&x[SCALES..D]);
            let q8 = q8_k::block_qs(y);
            let hmask = load_u8x32(x);
            let q3 = [load_u8x32(&x[QS..]), load_u8x32(&x[QS + 32..])];
            let mut acc = _mm256_setzero_si256();
            for k in 0..8 {
                let (low, sub) = quants(q3[k / 4], hmask, k);
                let a8 = load_u8x32(&q8[32 * k..]);
                // low·q8 − sub·q8: both unsigned × signed, pair sums within ±1024.
                let p =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(low, a8), _mm256_maddubs_epi16(sub, a8));
                let s = set_i16_halves(sc[2 * k] as i16, sc[2 * k + 1] as i16);
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

    /// The 16 quants (−4..4) of sub-block `is` (half `is % 2` of 32-element group `is / 2`).
    #[inline]
    #[target_feature(enable = "neon")]
    fn quants(b: &[u8], is: usize) -> int8x16_t {
        let (k, h) = (is / 2, is % 2);
        let q = load_u8x16(&b[QS + 32 * (k / 4) + 16 * h..]);
        let low = vandq_u8(shr_u8(q, 2 * (k % 4)), vdupq_n_u8(3));
        let set = vtstq_u8(load_u8x16(&b[16 * h..]), vdupq_n_u8(1 << k));
        // 4 where the high bit is clear.
        let sub = vbicq_u8(vdupq_n_u8(4), set);
        vreinterpretq_s8_u8(vsubq_u8(low, sub))
    }

    #[target_feature(enable = "neon")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            let d = f16_le(&b[D..]);
            let sc = unpack_scales(&b[SCALES..D]);
            for (is, y) in y.chunks_exact_mut(16).enumerate() {
                store_scaled_i8x16(y, quants(b, is), d * sc[is] as f32);
            }
        }
    }

    #[target_feature(enable = "neon")]
    pub(super) fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        q8_k::check_dot(w, BYTES, a);
        let mut sumf = 0f32;
        for (x, y) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_k::BYTES)) {
            let sc = unpack_scales(&x[SCALES..D]);
            let q8 = q8_k::block_qs(y);
            let mut isum = 0i32;
            for (is, q8) in q8.chunks_exact(16).enumerate() {
                let s = dot_i8x16(quants(x, is), vreinterpretq_s8_u8(load_u8x16(q8)));
                isum += sc[is] as i32 * s;
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

    // Measured: ggml's quantizer (same bits) peaks near 0.13 on random rows; its relative RMSE
    // on ggml's data is 0.113.
    kquant_tests! {
        random_rel_rmse: 0.18,
        ggml_rmse: 0.004,
        ggml_rel_rmse: 0.13,
        dot_error: 0.04,
        known: ("c20945a657fd6184e74d1174f48566c3", "6e1bb94526dbaa004ea365ccbe7c67fc"),
        known_dot: (174.69664, 4402.8),
    }

    #[test]
    fn scale_layout() {
        // Scale j = 37 + j % 3 (all in 0..64), packed by hand the way ggml does.
        let want: [u8; 16] = std::array::from_fn(|j| 37 + (j % 3) as u8);
        let mut s = [0u8; 12];
        for (j, &v) in want.iter().enumerate() {
            s[j % 8] |= (v & 0xf) << (4 * (j / 8));
            s[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
        }
        assert_eq!(unpack_scales(&s), want.map(|v| v as i8 - 32));
    }
}
