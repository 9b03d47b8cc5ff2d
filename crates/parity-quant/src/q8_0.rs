//! Q8_0: blocks of 32, `d: f16` then 32 signed bytes; `x[j] = qs[j] * d`.
//!
//! Also the activation type the CPU backend pairs with Q4_0, Q5_0, Q8_0 and IQ4_NL weights, so
//! [`quantize`] must match ggml's `quantize_row_q8_0_ref` bit for bit.

use super::cpu::dispatch;
use super::ggml::{c_float_to_byte, cvtt_f32_i32, f16_le, put_f16};
use super::tile::{self, TileAct};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 34;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(Q8_0, "q8_0", vec_dot_type: Q8_0, from_float: quantize_x86_avx, tile: Some(super::Tile::Q8_0(vec_dot_tile)), exact: Some(vec_dot_tile_exact));

// The block layout adds up.
const _: () = assert!(BYTES == 2 + BLOCK);

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
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `quantize_row_q8_0_ref`: `d = max|x| / 127`, `q = roundf(x / d)` (half away from zero).
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    quantize_inverse(src, dst, f32::round)
}

/// [`quantize`]'s scale with ties to even: `rint(x * (1 / (max|x| / 127)))`, as an engine
/// written with numpy's `rint` (or C's `nearbyint`) over ggml's formula quantizes. It
/// differs from both ggml quantizers on exact ties only.
pub fn quantize_inverse_even(src: &[f32], dst: &mut [u8]) {
    quantize_inverse(src, dst, f32::round_ties_even)
}

/// `q = round(x * (1 / (max|x| / 127)))`, ties as `round` breaks them.
fn quantize_inverse(src: &[f32], dst: &mut [u8], round: impl Fn(f32) -> f32) {
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        // C's MAX(a, b) is `a > b ? a : b`: a NaN is dropped again by the next element.
        let amax = x
            .iter()
            .fold(0.0f32, |m, v| if m > v.abs() { m } else { v.abs() });
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, d);
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = c_float_to_byte(round(v * id));
        }
    }
}

/// What ggml's x86 AVX/AVX2 `quantize_row_q8_0` (the CPU backend's activation quantizer on
/// such machines) writes. It differs from [`quantize`] in two ways: the inverse scale is
/// `127 / max|x|` rather than `1 / (max|x| / 127)`, and rounding is half to even. The two
/// disagree on a handful of bytes per million.
pub fn quantize_x86_avx(src: &[f32], dst: &mut [u8]) {
    dispatch!(x86 => quantize_avx2(src, dst) else quantize_x86_avx_scalar)
}

/// [`quantize_x86_avx`] in plain Rust: the readable definition its AVX2 version (which is
/// ggml's instruction sequence) must match byte for byte, NaN and infinity included.
pub fn quantize_x86_avx_scalar(src: &[f32], dst: &mut [u8]) {
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
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_scalar)
}

/// `out[r * a.rows() + t] = vec_dot(w_r, a_t)` for every Q8_0 weight row `w_r` of `w` (whole
/// rows of `a.n()` elements back to back) and every activation row `a_t`: the same numbers as
/// [`vec_dot`], bit for bit, but several rows and tokens at a time (see `q4_0::vec_dot_tile`).
/// Rows holding a -128 quant go through [`vec_dot`] (the sign trick cannot take them).
pub fn vec_dot_tile(w: &[u8], a: &TileAct, out: &mut [f32]) {
    tile_with(super::cpu::use_vnni(), w, a, out)
}

/// [`vec_dot_tile`], choosing whether the AVX-VNNI kernel may be used (tests run both).
fn tile_with(vnni: bool, w: &[u8], a: &TileAct, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let kernels = (!a.has_min).then_some([
        x86::vec_dot_tile as tile::Driver,
        x86::vec_dot_tile_vnni,
        x86::vec_dot_tile_vnni512,
    ]);
    #[cfg(not(target_arch = "x86_64"))]
    let kernels = None;
    tile::run(BYTES, vnni, w, a, out, kernels, vec_dot)
}

/// The exact dot of a Q8_0 weight row with a Q8_0 activation row (parity's reference on
/// ggml-cpu's grid): integer per block, summed in f64 (`tile::exact_dot_scalar`).
pub fn vec_dot_exact_scalar(w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), a.len(), "q8_0 · q8_0: rows differ in length");
    tile::exact_dot_scalar(w, a, BYTES, |b| {
        std::array::from_fn(|j| b[2 + j] as i8 as i32)
    })
}

/// [`vec_dot_exact_scalar`] for every weight row × activation row, as [`vec_dot_tile`] lays
/// them out: the same bits, several rows and tokens at a time (an activation holding -128
/// goes through the scalar twin, as in [`vec_dot_tile`]).
pub fn vec_dot_tile_exact(w: &[u8], a: &TileAct, out: &mut [f32]) {
    exact_with(super::cpu::use_vnni(), w, a, out)
}

/// [`vec_dot_tile_exact`], choosing whether the AVX-VNNI kernel may be used (tests run both).
fn exact_with(vnni: bool, w: &[u8], a: &TileAct, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let kernels = (!a.has_min).then_some([
        x86::vec_dot_tile_f64 as tile::Driver,
        x86::vec_dot_tile_f64_vnni,
        x86::vec_dot_tile_f64_vnni512,
    ]);
    #[cfg(not(target_arch = "x86_64"))]
    let kernels = None;
    tile::run(BYTES, vnni, w, a, out, kernels, vec_dot_exact_scalar)
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::{ggml::put_f16, x86::*};
    use super::{BLOCK, BYTES};
    use std::arch::x86_64::*;

    /// ggml's AVX2 `quantize_row_q8_0`, instruction for instruction.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn quantize_avx2(src: &[f32], dst: &mut [u8]) {
        let sign = _mm256_set1_ps(-0.0);
        for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
            let x: &[f32; 32] = x.try_into().unwrap();
            // SAFETY: `x` holds 32 readable floats; loadu has no alignment requirement.
            let v = unsafe {
                [
                    _mm256_loadu_ps(x.as_ptr()),
                    _mm256_loadu_ps(x.as_ptr().add(8)),
                    _mm256_loadu_ps(x.as_ptr().add(16)),
                    _mm256_loadu_ps(x.as_ptr().add(24)),
                ]
            };
            let mut m = _mm256_andnot_ps(sign, v[0]);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[1]));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[2]));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[3]));
            let mut m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            put_f16(b, amax / 127.0);
            let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let mut i = [_mm256_setzero_si256(); 4];
            for (i, &v) in i.iter_mut().zip(&v) {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(v, id),
                );
                *i = _mm256_cvtps_epi32(r);
            }
            let p01 = _mm256_packs_epi32(i[0], i[1]);
            let p23 = _mm256_packs_epi32(i[2], i[3]);
            let q = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(p01, p23),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
            );
            let qs = &mut b[2..34];
            // SAFETY: `qs` holds 32 writable bytes; storeu has no alignment requirement.
            unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), q) };
        }
    }

    /// The block's 32 signed quants (the tile kernels' weight bytes).
    ///
    /// # Safety
    /// `wb` points to a whole block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(wb: *const u8) -> __m256i {
        // SAFETY: the caller guarantees a whole block at `wb`.
        unsafe { _mm256_loadu_si256(wb.add(2).cast()) }
    }

    /// `|x|`, once per weight block (ggml's sign trick: `|x|` as unsigned bytes).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn abs(x: __m256i) -> __m256i {
        _mm256_sign_epi8(x, x)
    }

    /// The exact 4-product sums `Σ |x|·(y·sign x)` per i32 lane (exact unless some y is -128,
    /// which [`super::tile_with`] rules out).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lanes_avx2(x: __m256i, ax: __m256i, y: &TileBlock) -> __m256i {
        // SAFETY: `y.q` is 32 bytes, 32-byte aligned (TileBlock is 64-aligned).
        let y = unsafe { _mm256_load_si256(y.q.as_ptr().cast()) };
        _mm256_madd_epi16(
            _mm256_maddubs_epi16(ax, _mm256_sign_epi8(y, x)),
            _mm256_set1_epi16(1),
        )
    }

    /// [`lanes_avx2`] with AVX-VNNI's `vpdpbusd`: the same four products per lane, summed in
    /// one instruction, so the same integers.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn lanes_vnni(x: __m256i, ax: __m256i, y: &TileBlock) -> __m256i {
        // SAFETY: as in `lanes_avx2`.
        let y = unsafe { _mm256_load_si256(y.q.as_ptr().cast()) };
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, _mm256_sign_epi8(y, x))
    }

    /// [`lanes_vnni`] with AVX512-VNNI's `vpdpbusd` on 256-bit registers: the same integers.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    unsafe fn lanes_vnni512(x: __m256i, ax: __m256i, y: &TileBlock) -> __m256i {
        // SAFETY: as in `lanes_avx2`.
        let y = unsafe { _mm256_load_si256(y.q.as_ptr().cast()) };
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, _mm256_sign_epi8(y, x))
    }

    use crate::tile::TileBlock;
    crate::tile::x86::tile_kernels!(weights: weights, prepare: abs, avx2: lanes_avx2, vnni: lanes_vnni, vnni512: lanes_vnni512);

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        dequant_b32!(src, dst, BYTES, offset = false, |b| load_qs(b));
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(BYTES)) {
            let d = _mm256_set1_ps(f16c_at(bw) * f16c_at(ba));
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
    use super::super::{arm::*, ggml::f16_le};
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
pub(crate) mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    // Half a step, plus the f16 rounding of d spread over |q| <= 127.
    block32_tests! {
        act: crate::q8_0,
        quantizers: [quantize],
        any_scale: (0.5 + 127.0 / 2048.0) / 127.0,
    }

    q8_0_dot_tests!();

    #[test]
    fn round_trip_ggml_data_x86_avx() {
        let x = ggml_test_data(4096, 0.0);
        assert_rmse(&x, quantize_x86_avx, dequantize, BLOCK, BYTES, 0.002).unwrap();
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
        fn quantize_is_idempotent(x in floats(BLOCK, 1..17)) {
            assert_idempotent(&x, quantize, dequantize, BLOCK, BYTES)?;
        }



    }

    /// Weight rows × activation rows for the tile tests: (weights, activations, n).
    pub(crate) fn tile_case(wbytes: usize) -> impl Strategy<Value = (Vec<u8>, Vec<f32>, usize)> {
        (1usize..6, 1usize..11, 1usize..8).prop_flat_map(move |(nb, nr, nt)| {
            (
                prop::collection::vec(any::<u8>(), nr * nb * wbytes),
                floats(BLOCK, nt * nb..nt * nb + 1),
                Just(nb * BLOCK),
            )
        })
    }

    /// `vec_dot_tile` against `vec_dot` on every (row, token) pair, bit for bit.
    pub(crate) fn assert_tile_is_vec_dot(
        w: &[u8],
        a: &TileAct,
        tile: fn(&[u8], &TileAct, &mut [f32]),
        dot: fn(&[u8], &[u8]) -> f32,
        wrow: usize,
    ) -> Result<(), TestCaseError> {
        let nr = w.len() / wrow;
        let mut out = vec![0f32; nr * a.rows()];
        tile(w, a, &mut out);
        for r in 0..nr {
            for t in 0..a.rows() {
                let want = dot(&w[r * wrow..(r + 1) * wrow], a.q8_row(t));
                let got = out[r * a.rows() + t];
                prop_assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "row {} token {}: {} vs {}",
                    r,
                    t,
                    got,
                    want
                );
            }
        }
        Ok(())
    }

    use proptest::test_runner::TestCaseError;

    /// The activations of an exact-tile case: `x` quantized, or (`any_bytes`) rows cut from
    /// `seed` as arbitrary Q8_0 blocks, -128 quants included (the scalar twin's fallback).
    pub(crate) fn exact_case_act(x: &[f32], seed: &[u8], any_bytes: bool, n: usize) -> TileAct {
        let mut a = TileAct::default();
        if any_bytes {
            let rb = n / BLOCK * BYTES;
            let mut q = seed[..(seed.len() / rb).min(7) * rb].to_vec();
            finite_scales(&mut q, BYTES, &[0]);
            a.load_q8(&q, n);
        } else {
            a.quantize(x, n);
        }
        a
    }

    /// An exact tile (`tile`, f64 sums) against its scalar twin `dot` on every (row, token)
    /// pair, bit for bit, and against the sum of the decoded rows' products in f64 in plain
    /// order: within half an f32 ulp of it, plus what two f64 summations may differ by.
    pub(crate) fn assert_exact_tile(
        w: &[u8],
        a: &TileAct,
        tile: fn(&[u8], &TileAct, &mut [f32]),
        dot: fn(&[u8], &[u8]) -> f32,
        decode: fn(&[u8], &mut [f32]),
        wrow: usize,
    ) -> Result<(), TestCaseError> {
        assert_tile_is_vec_dot(w, a, tile, dot, wrow)?;
        let n = a.n();
        let (mut wf, mut af) = (vec![0f32; n], vec![0f32; n]);
        for r in 0..w.len() / wrow {
            decode(&w[r * wrow..(r + 1) * wrow], &mut wf);
            for t in 0..a.rows() {
                dequantize_scalar(a.q8_row(t), &mut af);
                let terms = wf.iter().zip(&af).map(|(&x, &y)| x as f64 * y as f64);
                let (sum, mag) = terms.fold((0f64, 0f64), |(s, m), v| (s + v, m + v.abs()));
                let got = dot(&w[r * wrow..(r + 1) * wrow], a.q8_row(t));
                let ulp = (got.abs().max(f32::MIN_POSITIVE) * f32::EPSILON) as f64;
                prop_assert!(
                    (got as f64 - sum).abs() <= ulp / 2.0 + 1e-13 * mag,
                    "row {} token {}: {} vs {} (terms' magnitude {})",
                    r,
                    t,
                    got,
                    sum,
                    mag
                );
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn simd_quantize_x86_avx_is_bit_identical(bits in prop::collection::vec(any::<u32>(), 32..289)) {
            let n = bits.len() / BLOCK * BLOCK;
            let x: Vec<f32> = bits[..n].iter().map(|&b| f32::from_bits(b)).collect();
            let (mut a, mut b) = (vec![0u8; n / BLOCK * BYTES], vec![0u8; n / BLOCK * BYTES]);
            quantize_x86_avx(&x, &mut a);
            quantize_x86_avx_scalar(&x, &mut b);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn simd_quantize_x86_avx_is_bit_identical_on_floats(x in floats(BLOCK, 1..9)) {
            let (mut a, mut b) = (vec![0u8; x.len() / BLOCK * BYTES], vec![0u8; x.len() / BLOCK * BYTES]);
            quantize_x86_avx(&x, &mut a);
            quantize_x86_avx_scalar(&x, &mut b);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn tile_is_vec_dot((mut w, x, n) in tile_case(BYTES)) {
            finite_scales(&mut w, BYTES, &[0]);
            let mut a = TileAct::default();
            a.quantize(&x, n);
            // Both kernels: AVX2 and, where the CPU has it, AVX-VNNI.
            for tile in [|w: &[u8], a: &_, o: &mut [f32]| tile_with(false, w, a, o), |w: &[u8], a: &_, o: &mut [f32]| tile_with(true, w, a, o)] {
            assert_tile_is_vec_dot(&w, &a, tile, vec_dot, n / BLOCK * BYTES)?;
            }
        }

        #[test]
        fn exact_tile_is_its_scalar_twin_and_exact(
            (mut w, x, n) in tile_case(BYTES),
            seed in prop::collection::vec(any::<u8>(), 7 * 5 * BYTES),
            any_bytes in any::<bool>(),
        ) {
            finite_scales(&mut w, BYTES, &[0]);
            let a = exact_case_act(&x, &seed, any_bytes, n);
            for tile in [|w: &[u8], a: &_, o: &mut [f32]| exact_with(false, w, a, o), |w: &[u8], a: &_, o: &mut [f32]| exact_with(true, w, a, o)] {
                assert_exact_tile(&w, &a, tile, vec_dot_exact_scalar, dequantize_scalar, n / BLOCK * BYTES)?;
            }
        }

        #[test]
        fn tile_is_vec_dot_for_any_activation_bytes(
            (mut w, _, n) in tile_case(BYTES),
            seed in prop::collection::vec(any::<u8>(), 7 * 5 * BYTES),
        ) {
            // Arbitrary quants, -128 included (the sign trick's blind spot: the tile must fall
            // back to the exact kernel).
            finite_scales(&mut w, BYTES, &[0]);
            let rb = n / BLOCK * BYTES;
            let mut q = seed[..(seed.len() / rb).min(7) * rb].to_vec();
            finite_scales(&mut q, BYTES, &[0]);
            let mut a = TileAct::default();
            a.load_q8(&q, n);
            // Both kernels: AVX2 and, where the CPU has it, AVX-VNNI.
            for tile in [|w: &[u8], a: &_, o: &mut [f32]| tile_with(false, w, a, o), |w: &[u8], a: &_, o: &mut [f32]| tile_with(true, w, a, o)] {
            assert_tile_is_vec_dot(&w, &a, tile, vec_dot, rb)?;
            }
        }
    }
}
