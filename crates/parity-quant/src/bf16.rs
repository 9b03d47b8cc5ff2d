//! BF16: the top 16 bits of an f32, little endian.

use super::cpu::dispatch;

/// Elements per block.
pub const BLOCK: usize = 1;
/// Bytes per block.
pub const BYTES: usize = 2;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(BF16, "bf16", vec_dot_type: BF16);

/// ggml's `GGML_BF16_TO_FP32`: the bits become the high half of an f32 (exact).
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *y = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

#[inline]
fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// [`dequantize_scalar`], vectorised; bit-identical output.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even on the dropped 16 bits; a NaN is
/// truncated and forced quiet (bit 6 of the bf16).
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// f32 to bf16 with [`f32_to_bf16`] (ggml's `ggml_fp32_to_bf16_row_ref`).
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    for (b, &x) in dst.chunks_exact_mut(2).zip(src) {
        b.copy_from_slice(&f32_to_bf16(x).to_le_bytes());
    }
}

/// ggml's scalar `ggml_vec_dot_bf16`: products of the widened values (exact in f32), summed
/// in f64.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), a.len(), "bf16 · bf16: rows differ in length");
    w.chunks_exact(2)
        .zip(a.chunks_exact(2))
        .fold(0.0f64, |s, (x, y)| {
            let x = bf16_to_f32(u16::from_le_bytes([x[0], x[1]]));
            let y = bf16_to_f32(u16::from_le_bytes([y[0], y[1]]));
            s + (x * y) as f64
        }) as f32
}

/// [`vec_dot_scalar`], vectorised as ggml's AVX2 `ggml_vec_dot_bf16`: four 8-lane
/// accumulators (multiply then add, as ggml writes it) over steps of 32, its reduction, the
/// tail in f64. Summation order differs from the scalar twin, so results can differ by
/// rounding.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), a.len(), "bf16 · bf16: rows differ in length");
    dispatch!(x86 => vec_dot(w, a) else vec_dot_scalar)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::bf16_to_f32;
    use std::arch::x86_64::*;

    /// 8 bf16 from `b[..16]`, widened.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load8(b: &[u8]) -> __m256 {
        let b = &b[..16];
        // SAFETY: `b` holds 16 readable bytes; loadu has no alignment requirement.
        let h = unsafe { _mm_loadu_si128(b.as_ptr().cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
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
        let mut c = [_mm256_setzero_ps(); 4];
        for (cw, ca) in w[..2 * np]
            .chunks_exact(64)
            .zip(a[..2 * np].chunks_exact(64))
        {
            for (j, c) in c.iter_mut().enumerate() {
                let r = 16 * j..16 * j + 16;
                *c = _mm256_add_ps(_mm256_mul_ps(load8(&cw[r.clone()]), load8(&ca[r])), *c);
            }
        }
        let s = _mm256_add_ps(_mm256_add_ps(c[0], c[2]), _mm256_add_ps(c[1], c[3]));
        let mut g = _mm_add_ps(_mm256_extractf128_ps::<1>(s), _mm256_castps256_ps128(s));
        g = _mm_add_ps(g, _mm_movehl_ps(g, g));
        g = _mm_add_ss(g, _mm_movehdup_ps(g));
        let mut sumf = _mm_cvtss_f32(g) as f64;
        for (x, y) in w[2 * np..].chunks_exact(2).zip(a[2 * np..].chunks_exact(2)) {
            let x = bf16_to_f32(u16::from_le_bytes([x[0], x[1]]));
            let y = bf16_to_f32(u16::from_le_bytes([y[0], y[1]]));
            sumf += (x * y) as f64;
        }
        sumf as f32
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        let mut s = src.chunks_exact(8);
        let mut d = dst.chunks_exact_mut(4);
        for (b, y) in (&mut s).zip(&mut d) {
            // SAFETY: `b` holds 4 readable u16, `y` 4 writable floats; NEON is baseline.
            unsafe {
                let h = vld1_u16(b.as_ptr().cast());
                vst1q_f32(y.as_mut_ptr(), vreinterpretq_f32_u32(vshll_n_u16::<16>(h)));
            }
        }
        super::dequantize_scalar(s.remainder(), d.into_remainder());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    fn bf16s(x: &[f32]) -> Vec<u8> {
        let mut q = vec![0u8; 2 * x.len()];
        quantize(x, &mut q);
        q
    }

    #[test]
    fn conversion_edge_cases() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // Halfway between 1.0 (even) and the next bf16: stays at 1.0; just above goes up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds up to inf
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0); // sNaN made quiet
        assert_eq!(f32_to_bf16(f32::from_bits(0xffc1_2345)), 0xffc1);
        assert_eq!(f32_to_bf16(-0.0), 0x8000);
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
        fn rounding_is_nearest(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assume!(x.is_finite() && x.abs() < 3.0e38);
            let y = bf16_to_f32(f32_to_bf16(x));
            // Nearest: at most half a bf16 ulp away (2^-8 relative; 2^-134 among subnormals),
            // and exact bf16 values are kept.
            let half_ulp = (x as f64).abs() / 256.0 + 2f64.powi(-134);
            prop_assert!((y as f64 - x as f64).abs() <= half_ulp);
            prop_assert_eq!(f32_to_bf16(y), f32_to_bf16(x));
        }

        #[test]
        fn vec_dot_twins_agree(
            x in prop::collection::vec(-100f32..100.0, 0..300),
            y in prop::collection::vec(-100f32..100.0, 300),
        ) {
            let (w, a) = (bf16s(&x), bf16s(&y[..x.len()]));
            let n = x.len();
            let (exact, mag) = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, dequantize));
            let bound = sum_order_bound(n, mag);
            for got in [vec_dot(&w, &a), vec_dot_scalar(&w, &a)] {
                prop_assert!((got as f64 - exact).abs() <= bound, "{} vs {}", got, exact);
            }
        }
    }
}
