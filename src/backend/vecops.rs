//! The fast backend's element-wise kernels (RMSNorm, `y += a·x`), each with its scalar twin
//! beside it and a test that they agree bit for bit.
//!
//! Both keep ggml's rounding exactly, so vectorizing them changes no tap:
//! - RMSNorm sums the f32 squares of a row in f64 *in element order* (ggml's
//!   `ggml_compute_forward_rms_norm_f32`; GCC keeps the order without -ffast-math). That chain
//!   of dependent f64 adds cannot be split across lanes without changing the rounding, so the
//!   SIMD twin vectorizes across rows instead: lane r of an f64×4 accumulator carries row r's
//!   sum, element by element, in the same order. The scaling is `(x·scale)·w`, two multiplies,
//!   no FMA, in 8 lanes.
//! - `axpy` is a multiply then an add per element (no FMA), in 8 lanes.

/// `out[r] = (x[r] · scale_r) · w` for every row of `x` (rows of `w.len()`), with
/// `scale_r = 1 / sqrt(mean(x[r]²) + eps)` and the mean from an f64 sum in element order.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::rms_norm(x, w, eps, out) };
    }
    rms_norm_scalar(x, w, eps, out)
}

/// [`rms_norm`], one element at a time.
pub fn rms_norm_scalar(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(
        x.len().is_multiple_of(n) && out.len() == x.len(),
        "rms_norm: shapes"
    );
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let scale = rms_scale(sum_squares(row), n, eps);
        for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

/// `Σ (v·v as f64)` in element order.
fn sum_squares(row: &[f32]) -> f64 {
    row.iter().fold(0.0f64, |s, &v| s + (v * v) as f64)
}

/// `1 / sqrt(mean + eps)` in ggml's precisions: the mean in f64, rounded to f32, the rest f32.
fn rms_scale(sum: f64, n: usize, eps: f32) -> f32 {
    1.0 / ((sum / n as f64) as f32 + eps).sqrt()
}

/// `y[i] += a · x[i]` (a multiply then an add, no FMA).
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::axpy(y, a, x) };
    }
    axpy_scalar(y, a, x)
}

/// [`axpy`], one element at a time.
pub fn axpy_scalar(y: &mut [f32], a: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len(), "axpy: lengths");
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{rms_scale, sum_squares};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2")]
    pub(super) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let n = w.len();
        assert!(
            x.len().is_multiple_of(n) && out.len() == x.len(),
            "rms_norm: shapes"
        );
        let rows = x.len() / n;
        let mut r = 0;
        while r + 4 <= rows {
            let sums = sum_squares4(&x[r * n..(r + 4) * n], n);
            for (k, &s) in sums.iter().enumerate() {
                let i = (r + k) * n;
                scale_mul(&x[i..i + n], w, rms_scale(s, n, eps), &mut out[i..i + n]);
            }
            r += 4;
        }
        for r in r..rows {
            let row = &x[r * n..(r + 1) * n];
            let s = rms_scale(sum_squares(row), n, eps);
            scale_mul(row, w, s, &mut out[r * n..(r + 1) * n]);
        }
    }

    /// The element-order f64 sums of squares of 4 rows of `n`: lane k is row k.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sum_squares4(x: &[f32], n: usize) -> [f64; 4] {
        let rows = [&x[..n], &x[n..2 * n], &x[2 * n..3 * n], &x[3 * n..4 * n]];
        let mut acc = _mm256_setzero_pd();
        let n4 = n & !3;
        for i in (0..n4).step_by(4) {
            // SAFETY: i + 4 <= n for every row. (No closures here: they may not be inlined
            // into a target_feature function.)
            let (a, b, c, d) = unsafe {
                (
                    _mm_loadu_ps(rows[0].as_ptr().add(i)),
                    _mm_loadu_ps(rows[1].as_ptr().add(i)),
                    _mm_loadu_ps(rows[2].as_ptr().add(i)),
                    _mm_loadu_ps(rows[3].as_ptr().add(i)),
                )
            };
            // 4×4 transpose: column j holds element i + j of each row.
            let ab_lo = _mm_unpacklo_ps(a, b); // a0 b0 a1 b1
            let ab_hi = _mm_unpackhi_ps(a, b); // a2 b2 a3 b3
            let cd_lo = _mm_unpacklo_ps(c, d);
            let cd_hi = _mm_unpackhi_ps(c, d);
            let cols = [
                _mm_movelh_ps(ab_lo, cd_lo),
                _mm_movehl_ps(cd_lo, ab_lo),
                _mm_movelh_ps(ab_hi, cd_hi),
                _mm_movehl_ps(cd_hi, ab_hi),
            ];
            for col in cols {
                acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm_mul_ps(col, col)));
            }
        }
        let mut s = [0f64; 4];
        // SAFETY: 4 writable f64.
        unsafe { _mm256_storeu_pd(s.as_mut_ptr(), acc) };
        for (s, r) in s.iter_mut().zip(rows) {
            for &v in &r[n4..] {
                *s += (v * v) as f64;
            }
        }
        s
    }

    /// `out = (x · s) · w` in 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scale_mul(x: &[f32], w: &[f32], s: f32, out: &mut [f32]) {
        let n = x.len();
        let (w, out) = (&w[..n], &mut out[..n]);
        let n8 = n & !7;
        let sv = _mm256_set1_ps(s);
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= n for all three slices.
            unsafe {
                let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), sv);
                let v = _mm256_mul_ps(v, _mm256_loadu_ps(w.as_ptr().add(i)));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            }
        }
        for i in n8..n {
            out[i] = (x[i] * s) * w[i];
        }
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        assert_eq!(y.len(), x.len(), "axpy: lengths");
        let n = y.len();
        let n8 = n & !7;
        let av = _mm256_set1_ps(a);
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= n for both slices.
            unsafe {
                let p = _mm256_mul_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)));
                let v = _mm256_add_ps(_mm256_loadu_ps(y.as_ptr().add(i)), p);
                _mm256_storeu_ps(y.as_mut_ptr().add(i), v);
            }
        }
        for i in n8..n {
            y[i] += a * x[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Floats spanning many binades (sums of squares that really round in f64), signed, with
    /// the occasional zero.
    fn wide() -> impl Strategy<Value = f32> {
        (any::<bool>(), -30i32..30, 0.5f32..1.0, 0u8..20).prop_map(|(neg, e, m, z)| {
            let v = if z == 0 { 0.0 } else { m * (e as f32).exp2() };
            if neg { -v } else { v }
        })
    }

    proptest! {
        #[test]
        fn rms_norm_twins_agree(
            (n, rows) in (1usize..70, 1usize..11),
            seed in prop::collection::vec(wide(), 11 * 70 + 70),
            eps in prop::sample::select(vec![1e-5f32, 1e-6, 0.0]),
        ) {
            let x = &seed[..n * rows];
            let w = &seed[11 * 70..11 * 70 + n];
            let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            rms_norm(x, w, eps, &mut a);
            rms_norm_scalar(x, w, eps, &mut b);
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                prop_assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{}: {} vs {}", i, a, b);
            }
        }

        #[test]
        fn axpy_twins_agree(
            x in prop::collection::vec(wide(), 0..70),
            y0 in prop::collection::vec(wide(), 70),
            a in wide(),
        ) {
            let (mut p, mut q) = (y0[..x.len()].to_vec(), y0[..x.len()].to_vec());
            axpy(&mut p, a, &x);
            axpy_scalar(&mut q, a, &x);
            for (p, q) in p.iter().zip(&q) {
                prop_assert!(p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()));
            }
        }
    }

    #[test]
    fn rms_norm_is_the_reference_one() {
        // The reference backend's RMSNorm is the readable specification.
        let n = 37;
        let x: Vec<f32> = (0..5 * n)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 13.0)
            .collect();
        let w: Vec<f32> = (0..n).map(|i| 0.5 + i as f32 / 50.0).collect();
        let mut out = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-5, &mut out);
        for (r, row) in x.chunks_exact(n).enumerate() {
            let want = crate::backend::reference::rms_norm(row, &w, 1e-5);
            let got = &out[r * n..(r + 1) * n];
            assert!(
                want.iter()
                    .zip(got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {r}"
            );
        }
    }
}
