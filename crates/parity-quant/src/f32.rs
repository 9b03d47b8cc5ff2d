//! F32: plain little-endian IEEE-754 singles.

use super::cpu::dispatch;

/// Elements per block.
pub const BLOCK: usize = 1;
/// Bytes per block.
pub const BYTES: usize = 4;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format = super::format_entry!(F32, "f32", vec_dot_type: F32);

/// Little-endian bytes to f32, one element at a time.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *y = f32::from_le_bytes(b.try_into().unwrap());
    }
}

/// [`dequantize_scalar`] as one copy: on little-endian targets the bytes already are the
/// floats.
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    if cfg!(target_endian = "little") {
        let src = &src[..dst.len() * 4];
        // SAFETY: `src` holds exactly `dst.len() * 4` bytes, f32 has no invalid bit patterns,
        // the byte order matches, and a byte copy needs no alignment.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len())
        };
    } else {
        dequantize_scalar(src, dst);
    }
}

/// f32 to little-endian bytes (lossless).
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    for (b, x) in dst.chunks_exact_mut(4).zip(src) {
        b.copy_from_slice(&x.to_le_bytes());
    }
}

/// ggml's scalar `ggml_vec_dot_f32`: each product rounded to f32, summed in f64.
pub fn vec_dot_f32_scalar(w: &[f32], a: &[f32]) -> f32 {
    assert_eq!(w.len(), a.len(), "f32 · f32: rows differ in length");
    w.iter()
        .zip(a)
        .fold(0.0f64, |s, (&x, &y)| s + (x * y) as f64) as f32
}

/// [`vec_dot_f32_scalar`], vectorised as ggml's AVX2 `ggml_vec_dot_f32`: four 8-lane FMA
/// accumulators over steps of 32, ggml's reduction, then the tail in f32. Summation order
/// differs from the scalar twin, so results can differ by rounding.
pub fn vec_dot_f32(w: &[f32], a: &[f32]) -> f32 {
    assert_eq!(w.len(), a.len(), "f32 · f32: rows differ in length");
    dispatch!(x86, neon => vec_dot(w, a) else vec_dot_f32_scalar)
}

/// [`vec_dot_f32`] on little-endian f32 rows as bytes (the table's `vec_dot`).
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    vec_dot_f32(&as_f32(w), &as_f32(a))
}

/// [`vec_dot_f32_scalar`] on little-endian f32 rows as bytes.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    vec_dot_f32_scalar(&as_f32(w), &as_f32(a))
}

/// View little-endian f32 bytes as f32s (borrowed when aligned, as mapped tensors and heap
/// buffers are; copied otherwise).
fn as_f32(b: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    // SAFETY: every bit pattern is a valid f32; align_to only yields the aligned middle.
    let (pre, mid, post) = unsafe { b.align_to::<f32>() };
    if pre.is_empty() && post.is_empty() && cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(mid)
    } else {
        std::borrow::Cow::Owned(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
}

/// ggml's `GGML_F32x8_REDUCE` over four accumulators, and the AVX2 4×8-lane dot loops that
/// feed it (shared with the F16 dot product).
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// `(x0 + x2) + (x1 + x3)`, then the 8 lanes: low + high half, then two `hadd`s.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn reduce4(x: [__m256; 4]) -> f32 {
        let s = _mm256_add_ps(_mm256_add_ps(x[0], x[2]), _mm256_add_ps(x[1], x[3]));
        let t0 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let t1 = _mm_hadd_ps(t0, t0);
        _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn vec_dot(w: &[f32], a: &[f32]) -> f32 {
        let np = w.len() & !31;
        let mut sum = [_mm256_setzero_ps(); 4];
        for (cw, ca) in w[..np].chunks_exact(32).zip(a[..np].chunks_exact(32)) {
            for (j, s) in sum.iter_mut().enumerate() {
                // SAFETY: each chunk holds 32 floats, so `8j..8j+8` is in bounds.
                let (x, y) = unsafe {
                    (
                        _mm256_loadu_ps(cw.as_ptr().add(8 * j)),
                        _mm256_loadu_ps(ca.as_ptr().add(8 * j)),
                    )
                };
                *s = _mm256_fmadd_ps(x, y, *s);
            }
        }
        let mut sumf = reduce4(sum);
        // ggml's tail is a plain `sumf += x[i]*y[i]` loop; GCC vectorises the products in
        // fours (adds stay in order) and contracts the last n % 4 into FMAs. Matching that
        // codegen makes this bit-identical to the AVX2 build of ggml for every n.
        let (w, a) = (&w[np..], &a[np..]);
        let n4 = w.len() & !3;
        for (&x, &y) in w[..n4].iter().zip(&a[..n4]) {
            sumf += x * y;
        }
        for (&x, &y) in w[n4..].iter().zip(&a[n4..]) {
            sumf = x.mul_add(y, sumf);
        }
        sumf
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    /// Four 4-lane FMA accumulators (ggml's NEON layout), pairwise-reduced, tail in f32.
    pub fn vec_dot(w: &[f32], a: &[f32]) -> f32 {
        let np = w.len() & !15;
        // SAFETY: every load reads 4 floats inside `w[..np]`/`a[..np]`; NEON is baseline.
        unsafe {
            let mut sum = [vdupq_n_f32(0.0); 4];
            for (cw, ca) in w[..np].chunks_exact(16).zip(a[..np].chunks_exact(16)) {
                for (j, s) in sum.iter_mut().enumerate() {
                    let x = vld1q_f32(cw.as_ptr().add(4 * j));
                    let y = vld1q_f32(ca.as_ptr().add(4 * j));
                    *s = vfmaq_f32(*s, x, y);
                }
            }
            let s = vaddq_f32(vaddq_f32(sum[0], sum[2]), vaddq_f32(sum[1], sum[3]));
            let mut sumf = vaddvq_f32(s);
            for (&x, &y) in w[np..].iter().zip(&a[np..]) {
                sumf += x * y;
            }
            sumf
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn twins_round_trip_any_bits(bits in prop::collection::vec(any::<u32>(), 0..100)) {
            let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let mut q = vec![0u8; 4 * x.len()];
            quantize(&x, &mut q);
            assert_dequant_twins(&q, 1, 4, dequantize, dequantize_scalar)?;
            let mut y = vec![0f32; x.len()];
            dequantize(&q, &mut y);
            prop_assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()));
        }

        #[test]
        fn vec_dot_twins_agree(
            x in prop::collection::vec(-1e3f32..1e3, 0..300),
            y in prop::collection::vec(-1e3f32..1e3, 300),
        ) {
            let y = &y[..x.len()];
            let (exact, mag) = dequant_dot(&x, y);
            let bound = sum_order_bound(x.len(), mag);
            for got in [vec_dot_f32(&x, y), vec_dot_f32_scalar(&x, y)] {
                prop_assert!((got as f64 - exact).abs() <= bound, "{} vs {}", got, exact);
            }
        }
    }

    #[test]
    fn vec_dot_small_integers_exact() {
        let x: Vec<f32> = (0..77).map(|i| (i % 7) as f32 - 3.0).collect();
        let y: Vec<f32> = (0..77).map(|i| (i % 5) as f32).collect();
        let exact: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
        assert_eq!(vec_dot_f32(&x, &y), exact);
        assert_eq!(vec_dot_f32_scalar(&x, &y), exact);
    }
}
