//! IQ4_NL: blocks of 32, `d: f16` then 16 bytes of nibbles (element j low nibble of `qs[j]`,
//! j+16 high); each nibble indexes the non-linear grid [`KVALUES`]: `x = KVALUES[q] * d`.
//! Paired with Q8_0 activations.

use super::cpu::dispatch;
use super::ggml::{f16_le, put_f16};
use super::q8_0;

pub const BLOCK: usize = 32;
pub const BYTES: usize = 18;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(IQ4_NL, "iq4_nl", vec_dot_type: Q8_0);

// The block layout adds up.
const _: () = assert!(BYTES == 2 + BLOCK / 2);

/// ggml's `kvalues_iq4nl`, sorted ascending.
pub const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// ggml's `GROUP_MAX_EPS`: a block whose max |x| is below this encodes as zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `dequantize_row_iq4_nl`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(BLOCK)) {
        let d = f16_le(b);
        for (j, &q) in b[2..].iter().enumerate() {
            y[j] = d * KVALUES[(q & 0x0F) as usize] as f32;
            y[j + 16] = d * KVALUES[(q >> 4) as usize] as f32;
        }
    }
}

/// [`dequantize_scalar`], vectorised; bit-identical output.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `quantize_row_iq4_nl_ref` (`quantize_row_iq4_nl_impl` with `ntry = -1`, no
/// importance weights): one weighted least-squares refit of the scale, no search.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    quantize_impl(src, dst, -1);
}

/// What `llama-quantize` writes for IQ4_NL without an imatrix (`quantize_iq4_nl`, `ntry = 7`):
/// also tries 15 scales around `max / 127` and re-picks the quants for the best one.
pub fn quantize_search(src: &[f32], dst: &mut [u8]) {
    quantize_impl(src, dst, 7);
}

/// ggml's `best_index_int8` on [`KVALUES`]: the nearest grid point, ties going up, NaN to the
/// top. This is the binary search of the ggml we check against (libggml 0.25.x); newer ggml
/// compares `2x` with the midpoints branch-free, which agrees except that NaN goes to 0.
fn best_index(x: f32) -> usize {
    let v = |i: usize| KVALUES[i] as f32;
    if x <= v(0) {
        return 0;
    }
    if x >= v(15) {
        return 15;
    }
    let (mut lo, mut hi) = (0, 15);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < v(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - v(lo) < v(hi) - x { lo } else { hi }
}

/// `quantize_row_iq4_nl_impl` for one 32-element super-block with weights `x²`.
fn quantize_impl(src: &[f32], dst: &mut [u8], ntry: i32) {
    let v0 = KVALUES[0] as f32;
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        let weight: [f32; 32] = std::array::from_fn(|j| x[j] * x[j]);
        // Σ w·q·x and Σ w·q² over the block for the grid picked by inverse scale `id`.
        let fit = |id: f32, l: &mut [u8; 32]| {
            let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
            for j in 0..32 {
                let i = best_index(id * x[j]);
                l[j] = i as u8;
                let q = KVALUES[i] as f32;
                sumqx += weight[j] * q * x[j];
                sumq2 += weight[j] * q * q;
            }
            (sumqx, sumq2)
        };
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let mut l = [0u8; 32];
        let mut scale = 0.0f32;
        if amax >= GROUP_MAX_EPS {
            let mut d = if ntry > 0 { -max / v0 } else { max / v0 };
            let (sumqx, sumq2) = fit(1.0 / d, &mut l);
            d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
            let mut best = d * sumqx;
            let mut scratch = [0u8; 32];
            for itry in -ntry..=ntry {
                let (sumqx, sumq2) = fit((itry as f32 + v0) / max, &mut scratch);
                if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                    d = sumqx / sumq2;
                    best = d * sumqx;
                }
            }
            scale = d;
        }
        put_f16(b, scale);
        if ntry > 0 {
            // Re-pick every quant for the final scale (a zero block gets the grid point
            // nearest 0, nibble 8, exactly as ggml).
            let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            for j in 0..32 {
                l[j] = best_index(id * x[j]) as u8;
            }
        }
        for j in 0..16 {
            b[2 + j] = l[j] | (l[j + 16] << 4);
        }
    }
}

/// Dot product of an IQ4_NL weight row with a Q8_0 activation row, as ggml's
/// `ggml_vec_dot_iq4_nl_q8_0_generic`: `sumf += (d_a * d_w) * sumi` per block.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    let mut sumf = 0.0f32;
    for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(q8_0::BYTES)) {
        sumf += (f16_le(ba) * f16_le(bw)) * block_sumi(bw, ba) as f32;
    }
    sumf
}

/// Exact Σ KVALUES[q_w] · q_a over one block pair.
fn block_sumi(bw: &[u8], ba: &[u8]) -> i32 {
    let qa = &ba[2..];
    let mut sumi = 0i32;
    for (j, &q) in bw[2..18].iter().enumerate() {
        sumi += KVALUES[(q & 0x0F) as usize] as i32 * qa[j] as i8 as i32;
        sumi += KVALUES[(q >> 4) as usize] as i32 * qa[j + 16] as i8 as i32;
    }
    sumi
}

/// [`vec_dot_scalar`], vectorised. Per-block integer sums are identical; the float sum follows
/// ggml's AVX2 kernel (two FMA accumulators over block pairs, `hsum_float_8`, an odd last
/// block added with one FMA), so it may differ from the scalar twin by rounding.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    check_rows(w, a);
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_scalar)
}

fn check_rows(w: &[u8], a: &[u8]) {
    assert_eq!(
        w.len() / BYTES,
        a.len() / q8_0::BYTES,
        "iq4_nl · q8_0: rows differ in length"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::q8_0;
    use super::super::x86::*;
    use super::{BYTES, KVALUES};
    use std::arch::x86_64::*;

    /// The block's grid values as signed bytes, in element order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn quants(b: &[u8]) -> __m256i {
        // SAFETY: KVALUES is 16 readable bytes.
        let table = unsafe { _mm_loadu_si128(KVALUES.as_ptr().cast()) };
        // pshufb looks up within each 128-bit half, so both halves get the table.
        _mm256_shuffle_epi8(
            _mm256_broadcastsi128_si256(table),
            nibbles_32(b[2..18].try_into().unwrap()),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        dequant_b32!(src, dst, BYTES, offset = false, |b| quants(b));
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn block_lanes(bw: &[u8], ba: &[u8]) -> __m256 {
        let qa = &ba[2..34];
        // SAFETY: `qa` holds 32 readable bytes; loadu has no alignment requirement.
        let qa = unsafe { _mm256_loadu_si256(qa.as_ptr().cast()) };
        _mm256_cvtepi32_ps(dot_i8_lanes(quants(bw), qa))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let (mut acc1, mut acc2) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut wp = w.chunks_exact(2 * BYTES);
        let mut ap = a.chunks_exact(2 * q8_0::BYTES);
        for (bw, ba) in (&mut wp).zip(&mut ap) {
            let (w0, w1) = bw.split_at(BYTES);
            let (a0, a1) = ba.split_at(q8_0::BYTES);
            let d0 = _mm256_set1_ps(f16c_at(a0) * f16c_at(w0));
            let d1 = _mm256_set1_ps(f16c_at(a1) * f16c_at(w1));
            acc1 = _mm256_fmadd_ps(d0, block_lanes(w0, a0), acc1);
            acc2 = _mm256_fmadd_ps(d1, block_lanes(w1, a1), acc2);
        }
        let mut sumf = hsum_f32x8(_mm256_add_ps(acc1, acc2));
        let (bw, ba) = (wp.remainder(), ap.remainder());
        if !bw.is_empty() {
            // Compilers contract ggml's `sumf += d * sumi` here into an FMA.
            let d = f16c_at(ba) * f16c_at(bw);
            sumf = d.mul_add(super::block_sumi(bw, ba) as f32, sumf);
        }
        sumf
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::super::q8_0;
    use super::super::{arm::*, ggml::f16_le};
    use super::{BLOCK, BYTES, KVALUES};
    use std::arch::aarch64::*;

    /// The block's grid values as signed bytes: (elements 0..16, 16..32).
    fn quants(b: &[u8]) -> (int8x16_t, int8x16_t) {
        let (lo, hi) = nibbles_32(b[2..18].try_into().unwrap());
        // SAFETY: KVALUES is 16 readable bytes; the rest is register-only.
        unsafe {
            let table = vld1q_s8(KVALUES.as_ptr());
            (vqtbl1q_s8(table, lo), vqtbl1q_s8(table, hi))
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
            sumf += (f16_le(ba) * f16_le(bw)) * sumi as f32;
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    // The refit scale can move the grid so far that no per-element bound holds in
    // general; a block-relative worst case of a quarter of max|x| is ample for a
    // 16-level grid (the widest gap is 24/127 of the range).
    block32_tests! {
        act: crate::q8_0,
        quantizers: [quantize, quantize_search],
        any_scale: 0.25,
    }

    q8_0_dot_tests!();

    #[test]
    fn best_index_is_nearest_ties_up() {
        for (i, &v) in KVALUES.iter().enumerate() {
            assert_eq!(best_index(v as f32), i);
        }
        assert_eq!(best_index(-1000.0), 0);
        assert_eq!(best_index(1000.0), 15);
        assert_eq!(best_index(-4.5), 8); // midpoint of -10 and 1
        assert_eq!(best_index(-4.5001), 7);
        assert_eq!(best_index(f32::NAN), 15);
        for k in -1300..1300 {
            let x = k as f32 / 10.0;
            let i = best_index(x);
            let e = (KVALUES[i] as f32 - x).abs();
            assert!(KVALUES.iter().all(|&v| (v as f32 - x).abs() >= e), "{x}");
        }
    }

    #[test]
    fn zero_block() {
        let mut b = [0xAAu8; BYTES];
        quantize(&[0.0; 32], &mut b);
        assert!(b.iter().all(|&v| v == 0));
        quantize_search(&[0.0; 32], &mut b);
        assert_eq!(&b[..2], &[0, 0]);
        assert!(b[2..].iter().all(|&v| v == 0x88));
    }
}
