//! F16: little-endian IEEE-754 halves.

use super::cpu::dispatch;
use super::ggml::{f16_le, put_f16};

/// Elements per block.
pub const BLOCK: usize = 1;
/// Bytes per block.
pub const BYTES: usize = 2;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(F16, "f16", vec_dot_type: F16);

/// Each half widened to f32 (exact; NaNs come out quiet with their payload, as F16C does).
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *y = f16_le(b);
    }
}

/// [`dequantize_scalar`] with F16C, 8 at a time; bit-identical output. (aarch64 stays scalar:
/// Rust's NEON f16 intrinsics are not stable.)
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86 => dequantize(src, dst) else dequantize_scalar)
}

/// f32 to f16, round to nearest even (ggml's `GGML_FP32_TO_FP16` / F16C `vcvtps2ph`).
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    for (b, &x) in dst.chunks_exact_mut(2).zip(src) {
        put_f16(b, x);
    }
}

/// ggml's scalar `ggml_vec_dot_f16`: products of the widened halves (exact in f32), summed
/// in f64.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), a.len(), "f16 · f16: rows differ in length");
    w.chunks_exact(2)
        .zip(a.chunks_exact(2))
        .fold(0.0f64, |s, (x, y)| s + (f16_le(x) * f16_le(y)) as f64) as f32
}

/// [`vec_dot_scalar`], vectorised as ggml's AVX2 `ggml_vec_dot_f16`: four 8-lane FMA
/// accumulators over steps of 32, ggml's reduction, the tail added in f64. Summation order
/// differs from the scalar twin, so results can differ by rounding.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), a.len(), "f16 · f16: rows differ in length");
    dispatch!(x86 => vec_dot(w, a) else vec_dot_scalar)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::f32::x86::reduce4;
    use super::super::ggml::f16_le;
    use std::arch::x86_64::*;

    /// 8 halves from `b[..16]`, widened.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load8(b: &[u8]) -> __m256 {
        let b = &b[..16];
        // SAFETY: `b` holds 16 readable bytes; loadu has no alignment requirement.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        let mut s = src.chunks_exact(16);
        let mut d = dst.chunks_exact_mut(8);
        for (b, y) in (&mut s).zip(&mut d) {
            // SAFETY: `y` holds 8 writable floats.
            unsafe { _mm256_storeu_ps(y.as_mut_ptr(), load8(b)) };
        }
        super::dequantize_scalar(s.remainder(), d.into_remainder());
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let np = (w.len() / 2) & !31;
        let mut sum = [_mm256_setzero_ps(); 4];
        for (cw, ca) in w[..2 * np]
            .chunks_exact(64)
            .zip(a[..2 * np].chunks_exact(64))
        {
            for (j, s) in sum.iter_mut().enumerate() {
                let r = 16 * j..16 * j + 16;
                *s = _mm256_fmadd_ps(load8(&cw[r.clone()]), load8(&ca[r]), *s);
            }
        }
        let mut sumf = reduce4(sum) as f64;
        for (x, y) in w[2 * np..].chunks_exact(2).zip(a[2 * np..].chunks_exact(2)) {
            sumf += (f16_le(x) * f16_le(y)) as f64;
        }
        sumf as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    fn halves(x: &[f32]) -> Vec<u8> {
        let mut q = vec![0u8; 2 * x.len()];
        quantize(x, &mut q);
        q
    }

    #[test]
    fn rounds_to_nearest_even() {
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10, 1 + 3·2^-11 between 1 + 2^-10 and
        // 1 + 2^-9: the even mantissa wins both times.
        let q = halves(&[
            1.0 + f32::EPSILON * 4096.0,
            1.0 + 3.0 * f32::EPSILON * 4096.0,
            65520.0,
        ]);
        assert_eq!(u16::from_le_bytes([q[0], q[1]]), 0x3c00);
        assert_eq!(u16::from_le_bytes([q[2], q[3]]), 0x3c02);
        assert_eq!(u16::from_le_bytes([q[4], q[5]]), 0x7c00); // overflows to inf
    }

    #[test]
    fn every_half_widens_identically() {
        // All 65536 patterns, NaNs included: the F16C paths (row decoder and the block-scale
        // helper the SIMD kernels use) give exactly `half`'s bits.
        let src: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let (mut a, mut b) = (vec![0f32; 65536], vec![0f32; 65536]);
        dequantize(&src, &mut a);
        dequantize_scalar(&src, &mut b);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "{i:#06x}");
        }
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd() == crate::cpu::Simd::Avx2 {
            for (i, h) in src.chunks_exact(2).enumerate() {
                // SAFETY: avx2, fma and f16c are present.
                let x = unsafe { crate::x86::f16c_at(h) };
                assert_eq!(x.to_bits(), b[i].to_bits(), "{i:#06x}");
            }
        }
    }

    #[test]
    fn round_trip_ggml_data() {
        let x = ggml_test_data(4096, 0.0);
        assert_rmse(&x, quantize, dequantize, 1, 2, 0.002).unwrap();
    }

    proptest! {
        #[test]
        fn simd_dequantize_is_bit_identical(src in prop::collection::vec(any::<u8>(), 0..200)) {
            let src = &src[..src.len() & !1];
            assert_dequant_twins(src, 1, 2, dequantize, dequantize_scalar)?;
        }

        #[test]
        fn every_half_survives_a_round_trip(bits in any::<u16>()) {
            let x = half::f16::from_bits(bits);
            prop_assume!(!x.is_nan());
            let mut y = [0f32];
            dequantize(&bits.to_le_bytes(), &mut y);
            prop_assert_eq!(halves(&y), bits.to_le_bytes().to_vec());
        }

        #[test]
        fn vec_dot_twins_agree(
            x in prop::collection::vec(-100f32..100.0, 0..300),
            y in prop::collection::vec(-100f32..100.0, 300),
        ) {
            let (w, a) = (halves(&x), halves(&y[..x.len()]));
            let n = x.len();
            let (exact, mag) = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, dequantize));
            let bound = sum_order_bound(n, mag);
            for got in [vec_dot(&w, &a), vec_dot_scalar(&w, &a)] {
                prop_assert!((got as f64 - exact).abs() <= bound, "{} vs {}", got, exact);
            }
        }
    }
}
