//! llama.cpp Vulkan's f16-accumulating matmul (`Accum::F16`), emulated bit for bit: the
//! weight rounded to f16 (the input already is), the products added into an f16 running sum
//! in its order: k in vectors of `group`, the last of each vector first (its `dot_product`
//! nests `fma(a.x, b.x, fma(a.y, b.y, acc))`). Fused: one rounding per step (the product and
//! the sum are exact in f64 before it); unfused: the product rounded to f16, then the sum.
//!
//! One sum is a serial chain of roundings, so a replay runs `LANES` weight rows side by side
//! (`Rows`): the same chains, vectorised across output rows, which a decode step (one input
//! row) has as many of as a prefill. `dot_f16_acc` is the one-row definition; `Rows::dot` has
//! a scalar twin and an AVX2 one, both held to it bit for bit.

/// Weight rows summed side by side.
pub(crate) const LANES: usize = 16;

/// One output of the emulated matmul: `w` a weight row, `x` an input row (already rounded).
pub(crate) fn dot_f16_acc(w: &[f32], x: &[f32], group: usize, fused: bool) -> f32 {
    let mut acc = 0.0f32;
    let mut start = 0;
    while start < w.len() {
        let end = (start + group).min(w.len());
        for k in (start..end).rev() {
            let mut p = round_f16(w[k]) as f64 * x[k] as f64;
            if !fused {
                p = f16_nearest(p) as f64;
            }
            acc = f16_nearest(acc as f64 + p);
        }
        start = end;
    }
    acc
}

/// `LANES` weight rows rounded to f16 and interleaved (`w[k * LANES + l]` is row l's k-th
/// weight), rows past the last one zero.
pub(crate) struct Rows {
    w: Vec<f32>,
    n: usize,
}

impl Rows {
    pub(crate) fn new(n: usize) -> Self {
        Rows {
            w: vec![0.0; n * LANES],
            n,
        }
    }

    /// Lane `l` holds `row` (of length n), rounded to f16; `None` zeroes it.
    pub(crate) fn set(&mut self, l: usize, row: Option<&[f32]>) {
        for k in 0..self.n {
            self.w[k * LANES + l] = row.map_or(0.0, |r| round_f16(r[k]));
        }
    }

    /// `dot_f16_acc(row l, x, group, fused)` for every lane l.
    pub(crate) fn dot(&self, x: &[f32], group: usize, fused: bool) -> [f32; LANES] {
        assert_eq!(x.len(), self.n);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { self.dot_avx2(x, group, fused) };
        }
        self.dot_scalar(x, group, fused)
    }

    /// The scalar twin: each lane is `dot_f16_acc`'s chain.
    fn dot_scalar(&self, x: &[f32], group: usize, fused: bool) -> [f32; LANES] {
        let mut acc = [0.0f32; LANES];
        let mut start = 0;
        while start < self.n {
            let end = (start + group).min(self.n);
            for k in (start..end).rev() {
                let xk = x[k] as f64;
                for (l, a) in acc.iter_mut().enumerate() {
                    let mut p = self.w[k * LANES + l] as f64 * xk;
                    if !fused {
                        p = f16_nearest(p) as f64;
                    }
                    *a = f16_nearest(*a as f64 + p);
                }
            }
            start = end;
        }
        acc
    }

    /// Four lanes to a register, four registers: independent chains to hide each step's
    /// latency. The roundings are `f16_nearest`'s, on the f64's bits (see `nearest_avx2`).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(&self, x: &[f32], group: usize, fused: bool) -> [f32; LANES] {
        use std::arch::x86_64::*;
        const R: usize = LANES / 4;
        let mut acc = [_mm256_setzero_pd(); R];
        let mut start = 0;
        while start < self.n {
            let end = (start + group).min(self.n);
            for k in (start..end).rev() {
                let xk = _mm256_set1_pd(x[k] as f64);
                let row = &self.w[k * LANES..(k + 1) * LANES];
                for (r, a) in acc.iter_mut().enumerate() {
                    // SAFETY: `row` holds LANES = 4·R floats; lane group r reads 4 of them.
                    let w = _mm256_cvtps_pd(unsafe { _mm_loadu_ps(row.as_ptr().add(4 * r)) });
                    let mut p = _mm256_mul_pd(w, xk);
                    if !fused {
                        p = nearest_avx2(p);
                    }
                    *a = nearest_avx2(_mm256_add_pd(*a, p));
                }
            }
            start = end;
        }
        let mut out = [0.0f32; LANES];
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: out holds LANES = 4·R floats; lane group r writes 4 of them.
            unsafe { _mm_storeu_ps(out.as_mut_ptr().add(4 * r), _mm256_cvtpd_ps(*a)) };
        }
        out
    }
}

/// `f16_nearest` on four f64s: one rounding to nearest, ties to even, from the f64 itself
/// (what rounding to odd into f32 and then to f16 gives). Normal: keep 10 of the 52 fraction
/// bits; a carry moves into the exponent, past 65504 is infinity. Subnormal (below 2^-14):
/// beside 2^28, whose f64 step is 2^-24 (f16's subnormal step), the add rounds to it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn nearest_avx2(v: std::arch::x86_64::__m256d) -> std::arch::x86_64::__m256d {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_pd(-0.0);
    let a = _mm256_andnot_pd(sign, v);
    let b = _mm256_castpd_si256(a);
    let odd = _mm256_and_si256(_mm256_srli_epi64::<42>(b), _mm256_set1_epi64x(1));
    let up = _mm256_add_epi64(b, _mm256_add_epi64(_mm256_set1_epi64x((1 << 41) - 1), odd));
    let normal = _mm256_castsi256_pd(_mm256_andnot_si256(_mm256_set1_epi64x((1 << 42) - 1), up));
    let big = _mm256_cmp_pd::<_CMP_GT_OQ>(normal, _mm256_set1_pd(65504.0));
    let normal = _mm256_blendv_pd(normal, _mm256_set1_pd(f64::INFINITY), big);
    let magic = _mm256_set1_pd(268_435_456.0); // 2^28
    let sub = _mm256_sub_pd(_mm256_add_pd(a, magic), magic);
    let tiny = _mm256_cmp_pd::<_CMP_LT_OQ>(a, _mm256_set1_pd(6.103_515_625e-5)); // 2^-14
    let r = _mm256_blendv_pd(normal, sub, tiny);
    // NaN stays itself (the bits above would carry its payload into the exponent's).
    let r = _mm256_blendv_pd(r, a, _mm256_cmp_pd::<_CMP_UNORD_Q>(a, a));
    _mm256_or_pd(r, _mm256_and_pd(v, sign))
}

/// `v` rounded to the nearest f16, ties to even, in one rounding, as an f32 (which holds every
/// f16). `half`'s `from_f64` is not: with F16C it goes through f32 rounded to nearest (a
/// second rounding an fma has not), and its fallback misses the nearest value on about one in
/// 2000 inputs.
#[inline]
fn f16_nearest(v: f64) -> f32 {
    // Round to odd into f32 (cut toward zero, then set the last bit if anything was cut): f32
    // keeps 13 bits more than f16, so its f16 rounding is the one from the exact value.
    let mut f = v as f32;
    if f.is_finite() && f as f64 != v {
        if (f as f64).abs() > v.abs() {
            f = f32::from_bits(f.to_bits() - 1);
        }
        f = f32::from_bits(f.to_bits() | 1);
    }
    round_f16(f)
}

/// `x` rounded to TF32 (f32's exponent, 10 of its 23 fraction bits, ties to even; a carry moves
/// into the exponent), still stored as f32: NaN stays NaN, the largest values round to Inf.
#[inline]
pub(crate) fn round_tf32(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let b = x.to_bits();
    f32::from_bits((b + 0x0fff + ((b >> 13) & 1)) & !0x1fff)
}

/// `x` rounded to the nearest f16 (ties to even, overflow to infinity), as an f32. Bit
/// arithmetic the compiler inlines: `half`'s conversions are calls behind a CPU-feature check,
/// and an f16-accumulating replay makes three per multiply-add (97% of its time before).
#[inline]
pub(crate) fn round_f16(x: f32) -> f32 {
    const MIN_NORMAL: f32 = 6.103_515_6e-5; // 2^-14
    let a = x.abs();
    if a.is_nan() {
        return x;
    }
    if a < MIN_NORMAL {
        // Subnormal f16s are the multiples of 2^-24: beside 0.5 (whose f32 step is 2^-24) the
        // addition rounds to one of them, ties to even; taking 0.5 off again is exact.
        return ((a + 0.5) - 0.5).copysign(x);
    }
    let r = round_tf32(x);
    if r.abs() > 65504.0 {
        f32::INFINITY.copysign(x)
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 pair (a, next a) and points between them: the exact midpoint goes to the even
    /// one, a hair either side of it to the nearer one (what `half::f16::from_f64` misses), also
    /// a hair smaller than f32 can hold.
    #[test]
    fn f16_nearest_rounds_once_to_nearest_even() {
        use half::f16;
        for bits in 0..0x7bffu16 {
            let (a, b) = (f16::from_bits(bits), f16::from_bits(bits + 1));
            let (x, y) = (a.to_f64(), b.to_f64());
            let mid = (x + y) / 2.0;
            let even = if bits & 1 == 0 { a } else { b };
            let eps = (y - x) * 1e-6;
            for (v, want) in [
                (x, a),
                (mid, even),
                (mid - eps, a),
                (mid + eps, b),
                (-(mid + eps), -b),
                // Past f32's precision: only the sticky bit keeps them off the tie.
                (mid - (y - x) * 1e-12, a),
                (mid + (y - x) * 1e-12, b),
            ] {
                assert_eq!(f16_nearest(v), want.to_f32(), "{v:e}");
            }
        }
    }

    /// The inlined rounding is `half`'s (F16C's `vcvtps2ph` where the CPU has it) on a dense
    /// sample of every f32 bit pattern: normals, subnormals, ties, overflow, infinities, NaN.
    /// TF32 keeps 10 fraction bits: a value halfway between two goes to the even one, a hair
    /// past half to the nearer; a carry moves into the exponent; NaN stays NaN, f32's largest
    /// finite values round to infinity.
    #[test]
    fn round_tf32_keeps_ten_fraction_bits_ties_to_even() {
        let one = 1.0f32.to_bits();
        let ulp = 1u32 << 13;
        for (bits, want) in [
            (one + ulp / 2, one),                 // tie, even below
            (one + ulp + ulp / 2, one + 2 * ulp), // tie, even above
            (one + ulp / 2 + 1, one + ulp),       // past half
            (one + ulp / 2 - 1, one),
            (0x3fff_ffff, 0x4000_0000), // 1.99999…: carries into the exponent
        ] {
            let (x, w) = (f32::from_bits(bits), f32::from_bits(want));
            assert_eq!(round_tf32(x), w, "{x:e}");
            assert_eq!(round_tf32(-x), -w, "{x:e}");
        }
        assert!(round_tf32(f32::NAN).is_nan());
        assert_eq!(round_tf32(f32::MAX), f32::INFINITY);
        assert_eq!(round_tf32(f32::NEG_INFINITY), f32::NEG_INFINITY);
        // Every f16 is a TF32 value.
        for b in (0..0x7c00u16).step_by(7) {
            let h = half::f16::from_bits(b).to_f32();
            assert_eq!(round_tf32(h), h);
        }
    }

    #[test]
    fn round_f16_is_halfs_rounding_of_every_sampled_f32() {
        let mut bits = 0u32;
        loop {
            let x = f32::from_bits(bits);
            let (got, want) = (round_f16(x), half::f16::from_f32(x).to_f32());
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e} ({bits:#x}): {got:e} vs {want:e}"
            );
            // A prime stride, plus every pattern near the f16 ties (low 13 bits 0x1000).
            let next = bits.wrapping_add(if bits & 0x1fff == 0x0fff { 1 } else { 251 });
            if next < bits {
                break;
            }
            bits = next;
        }
        for bits in (0x3800_1000u32..0x3880_0000).step_by(0x2000) {
            let x = f32::from_bits(bits);
            assert_eq!(round_f16(x), half::f16::from_f32(x).to_f32(), "{x:e}");
        }
    }

    #[test]
    fn f16_acc_dot_sums_in_f16_in_vulkans_order() {
        let ones = [1.0f32; 4];
        // Groups of 1 run in order. 2048 + 1 + 1 in f16: each +1 is a tie at 2048 (step 2),
        // kept at 2048 (even); the other way round the ones add up before the big term.
        assert_eq!(dot_f16_acc(&[2048.0, 1.0, 1.0], &ones, 1, true), 2048.0);
        assert_eq!(dot_f16_acc(&[1.0, 1.0, 2048.0], &ones, 1, true), 2050.0);
        // In pairs the second of each pair comes first: 4096, 0, -4096, 1 in order ends at 1;
        // as 0, 4096, 1, -4096 the 1 is lost beside 4096 (f16 step 4 there).
        let w = [4096.0, 0.0, -4096.0, 1.0];
        assert_eq!(dot_f16_acc(&w, &ones, 1, true), 1.0);
        assert_eq!(dot_f16_acc(&w, &ones, 2, true), 0.0);
        // In fours the last comes first: 1, -4096, 0, 4096 ends at 0 in order and in pairs
        // (-4096 first), at 1 as 4096, 0, -4096, 1.
        let w = [1.0, -4096.0, 0.0, 4096.0];
        assert_eq!(dot_f16_acc(&w, &ones, 1, true), 0.0);
        assert_eq!(dot_f16_acc(&w, &ones, 2, true), 0.0);
        assert_eq!(dot_f16_acc(&w, &ones, 4, true), 1.0);
        // Unfused, the product is rounded to f16 first. a = 1 + 3·2^-10, a² = 1 + 3·2^-9 +
        // 9·2^-20: after -1 the fma keeps 9·2^-20 (to 2^-17, the nearest step near 3·2^-9),
        // the split product has lost it.
        let a = 1.0 + 3.0 * 2f32.powi(-10);
        let (w, x) = ([-1.0, a], [1.0, a]);
        assert_eq!(
            dot_f16_acc(&w, &x, 1, true),
            3.0 * 2f32.powi(-9) + 2f32.powi(-17)
        );
        assert_eq!(dot_f16_acc(&w, &x, 1, false), 3.0 * 2f32.powi(-9));
    }

    /// Side by side, every lane is its row's own chain: `Rows::dot` (the AVX2 kernel where the
    /// CPU has it) and its scalar twin are `dot_f16_acc` bit for bit, on values near f16 ties,
    /// subnormal products, sums past 65504, lanes left empty, lengths not a whole group.
    #[test]
    fn rows_side_by_side_are_each_rows_dot() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let u = (seed >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            let scale = [1.0, 64.0, 1e-3, 3e-5, 900.0][(seed & 7) as usize % 5];
            // A quarter of them on the f16 grid plus half a step: products land on ties.
            let v = (u * scale) as f32;
            if seed & 24 == 0 {
                round_f16(v) * (1.0 + 2f32.powi(-11))
            } else {
                v
            }
        };
        for n in [1, 2, 3, 7, 37, 64, 131] {
            for filled in [LANES, LANES - 3, 1] {
                let w: Vec<Vec<f32>> = (0..filled)
                    .map(|_| (0..n).map(|_| next()).collect())
                    .collect();
                let mut rows = Rows::new(n);
                for l in 0..LANES {
                    rows.set(l, w.get(l).map(|r| r.as_slice()));
                }
                let x: Vec<f32> = (0..n).map(|_| round_f16(next())).collect();
                for (group, fused) in [(2, true), (2, false), (4, true), (4, false)] {
                    let (got, twin) = (
                        rows.dot(&x, group, fused),
                        rows.dot_scalar(&x, group, fused),
                    );
                    for l in 0..LANES {
                        let want = w.get(l).map_or(0.0, |r| dot_f16_acc(r, &x, group, fused));
                        for (what, v) in [("kernel", got[l]), ("scalar twin", twin[l])] {
                            assert!(
                                v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
                                "{what}: n {n} lane {l} group {group} fused {fused}: {v:e} vs {want:e}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The vector rounding is `f16_nearest` on every f16 neighbourhood: each f16, the midpoint
    /// to the next, a hair either side (within and past f32's precision), both signs, the
    /// subnormals and the overflow edge, infinities and NaN.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_rounding_is_f16_nearest() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        use std::arch::x86_64::*;
        let mut vs = vec![
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            65519.9,
            65520.0,
            1e300,
            1e-300,
        ];
        for bits in 0..0x7bffu16 {
            let (x, y) = (
                half::f16::from_bits(bits).to_f64(),
                half::f16::from_bits(bits + 1).to_f64(),
            );
            let mid = (x + y) / 2.0;
            for v in [
                x,
                mid,
                mid - (y - x) * 1e-6,
                mid + (y - x) * 1e-6,
                mid - (y - x) * 1e-12,
                mid + (y - x) * 1e-12,
            ] {
                vs.extend([v, -v]);
            }
        }
        for c in vs.chunks(4) {
            let mut v = [0.0f64; 4];
            v[..c.len()].copy_from_slice(c);
            let mut got = [0.0f64; 4];
            // SAFETY: AVX2 is present (checked above); loads and stores of four f64s.
            unsafe {
                _mm256_storeu_pd(got.as_mut_ptr(), nearest_avx2(_mm256_loadu_pd(v.as_ptr())))
            };
            for (g, &x) in got.iter().zip(&v) {
                let want = f16_nearest(x) as f64;
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{x:e}: {g:e} vs {want:e}"
                );
            }
        }
    }
}
