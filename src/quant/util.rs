//! Small helpers shared by the block formats.

/// f16 bits at `b[0..2]` (little endian) to f32.
#[inline]
pub fn f16_le(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Store `v` as little-endian f16 bits at `b[0..2]` (round to nearest even, as ggml's
/// `GGML_FP32_TO_FP16`).
#[inline]
pub fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

// ---- K-quant helpers (ggml-quants.c), shared by the 256-element super-block formats ----

/// Elements per K-quant super-block (`QK_K`).
pub const QK_K: usize = 256;

/// ggml's `GROUP_MAX_EPS`: a group whose largest |x| is below this quantizes to all zeros.
pub const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: adding 1.5·2²³ leaves the rounded integer in the low mantissa bits, so
/// this rounds half to even for |x| ≤ 2²². Outside that range it returns the same garbage as ggml.
#[inline]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `get_scale_min_k4`: the `j`-th 6-bit (scale, min) pair of a Q4_K/Q5_K `scales[12]`.
/// Pairs 0..4 sit in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins); pairs 4..8 keep
/// their low nibbles in bytes 8..12 and their top 2 bits in the spare bits of bytes 0..8.
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml's `make_qkx2_quants`: fit `x ≈ scale·L − min` with `L` in `0..=nmax`, minimising the
/// weighted error (|e| when `use_mad`, else e²) over `nstep + 1` trial scales. Writes `L` and
/// returns `(scale, min)` (ggml's return value and `*the_min`). `x.len() <= 32`.
/// Every float operation keeps ggml's order: the result must match its quantizer bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut laux = [0u8; 32];
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        best_error += weights[i] * err(scale * q as f32 + min - x[i]);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                cur_error += weights[i] * err(this_scale * laux[i] as f32 + this_min - x[i]);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Bounds-checked AVX2 loads/stores and the int8 → f32 widening the SIMD decoders share.
#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use std::arch::x86_64::*;

    /// The first 32 bytes of `s`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn load_u8x32(s: &[u8]) -> __m256i {
        let s = &s[..32];
        // SAFETY: `s` holds 32 readable bytes; loadu has no alignment requirement.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    /// The first 16 bytes of `s`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn load_u8x16(s: &[u8]) -> __m128i {
        let s = &s[..16];
        // SAFETY: `s` holds 16 readable bytes; loadu has no alignment requirement.
        unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
    }

    /// Store 8 floats to `dst[..8]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn store_f32x8(dst: &mut [f32], v: __m256) {
        let dst = &mut dst[..8];
        // SAFETY: `dst` holds 8 writable floats; storeu has no alignment requirement.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) }
    }

    /// One f16 to f32 with F16C. Written in asm because LLVM, seeing only the low 16 bits of
    /// `_mm_cvtsi32_si128` used, emits `vpinsrw`, which merges into whatever the register held
    /// last: in a decode loop that chained every block's scale to the previous block's final
    /// multiply (~14 cycles per Q8_0 block instead of ~5). `vmovd` zero-extends and breaks it.
    #[inline]
    #[target_feature(enable = "f16c")]
    pub(crate) fn f16c_bits(bits: u16) -> f32 {
        let x: __m128;
        // SAFETY: register-only instructions; this function is compiled for F16C.
        unsafe {
            std::arch::asm!(
                "vmovd {x}, {g:e}",
                "vcvtph2ps {x}, {x}",
                g = in(reg) u32::from(bits),
                x = lateout(xmm_reg) x,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
        _mm_cvtss_f32(x)
    }

    /// The f16 at `b[0..2]` as f32, with F16C (see [`f16c_bits`]).
    #[inline]
    #[target_feature(enable = "f16c")]
    pub(crate) fn f16c_at(b: &[u8]) -> f32 {
        f16c_bits(u16::from_le_bytes([b[0], b[1]]))
    }

    /// `d * s[i] as f32` for the 16 signed bytes of `s` (a super-block's sub-block scales),
    /// rounded exactly as the scalar products. Pass the array through [`in_memory`] so that each
    /// use is a broadcast load.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn scales_x16(s: __m128i, d: f32) -> [f32; 16] {
        let d = _mm256_set1_ps(d);
        let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s));
        let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(s)));
        let mut out = [0f32; 16];
        store_f32x8(&mut out[..8], _mm256_mul_ps(d, lo));
        store_f32x8(&mut out[8..], _mm256_mul_ps(d, hi));
        out
    }

    /// The 8 scales (bytes 0..8) and 8 mins (bytes 8..16) of a Q4_K or Q5_K block's 12 packed
    /// bytes, all at once: [`super::get_scale_min_k4`] for j = 0..8, by whole-word shifts and
    /// masks.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn scales_mins_x16(s: &[u8]) -> __m128i {
        let s = &s[..12];
        let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
        let (w0, w1, w2) = (w(0), w(1), w(2));
        const LOW6: u32 = 0x3f3f_3f3f;
        const LOW4: u32 = 0x0f0f_0f0f;
        const TOP2: u32 = 0x0303_0303;
        let sc_lo = w0 & LOW6;
        let sc_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
        let m_lo = w1 & LOW6;
        let m_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
        _mm_set_epi32(m_hi as i32, m_lo as i32, sc_hi as i32, sc_lo as i32)
    }

    /// `a`, opaque to the optimizer, so that an `a[i]` later splat across a vector is a
    /// broadcast load (a load port only). Otherwise LLVM keeps a small array of scales in
    /// registers and makes each splat a shuffle plus a register broadcast, two uops on the
    /// shuffle port that the decoders' widening already saturates.
    #[inline(always)]
    pub(crate) fn in_memory<T: ?Sized>(a: &T) -> &T {
        std::hint::black_box(a)
    }

    /// A super-block's quants as signed bytes, staged in memory between a decoder's integer
    /// phase and its float phase: widening straight from memory (`vpmovsxbd ymm, m64`) costs
    /// one shuffle uop per 8 outputs, where widening from a register adds extracts and byte
    /// shifts on the same port.
    #[repr(align(32))]
    pub(crate) struct Staged(pub [u8; 256]);

    impl Staged {
        pub(crate) fn new() -> Self {
            Staged([0; 256])
        }

        /// Quants `32·i .. 32·i + 32`.
        #[inline]
        #[target_feature(enable = "avx2")]
        pub(crate) fn put(&mut self, i: usize, q: __m256i) {
            let s = &mut self.0[32 * i..32 * i + 32];
            // SAFETY: `s` holds 32 writable bytes; storeu has no alignment requirement.
            unsafe { _mm256_storeu_si256(s.as_mut_ptr().cast(), q) }
        }

        /// Quants `16·i .. 16·i + 16`.
        #[inline]
        #[target_feature(enable = "avx2")]
        pub(crate) fn put16(&mut self, i: usize, q: __m128i) {
            let s = &mut self.0[16 * i..16 * i + 16];
            // SAFETY: `s` holds 16 writable bytes; storeu has no alignment requirement.
            unsafe { _mm_storeu_si128(s.as_mut_ptr().cast(), q) }
        }
    }

    /// 8 signed bytes at `q[..8]` as 8 f32 (exact).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn widen_i8x8(q: &[u8]) -> __m256 {
        let q = &q[..8];
        // SAFETY: `q` holds 8 readable bytes; loadl has no alignment requirement.
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(unsafe {
            _mm_loadl_epi64(q.as_ptr().cast())
        }))
    }

    /// `y[i] = d[i / G] * q[i]` (signed bytes `q`), each rounded like the scalar `d * q as f32`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn scale_groups<const G: usize>(q: &[u8], d: &[f32], y: &mut [f32]) {
        for ((q, y), &d) in q.chunks_exact(G).zip(y.chunks_exact_mut(G)).zip(d) {
            let d = _mm256_set1_ps(d);
            for (q, y) in q.chunks_exact(8).zip(y.chunks_exact_mut(8)) {
                store_f32x8(y, _mm256_mul_ps(d, widen_i8x8(q)));
            }
        }
    }

    /// `y[i] = d[i / G] * q[i] - m[i / G]`: a multiply then a subtract, no FMA, as the scalar.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn affine_groups<const G: usize>(q: &[u8], d: &[f32], m: &[f32], y: &mut [f32]) {
        for (((q, y), &d), &m) in q.chunks_exact(G).zip(y.chunks_exact_mut(G)).zip(d).zip(m) {
            let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
            for (q, y) in q.chunks_exact(8).zip(y.chunks_exact_mut(8)) {
                store_f32x8(y, _mm256_sub_ps(_mm256_mul_ps(d, widen_i8x8(q)), m));
            }
        }
    }

    /// `y[i] = q[i] * d[i / G] + m[i / G]`: a multiply then an add, no FMA, as the scalar.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn offset_groups<const G: usize>(q: &[u8], d: &[f32], m: &[f32], y: &mut [f32]) {
        for (((q, y), &d), &m) in q.chunks_exact(G).zip(y.chunks_exact_mut(G)).zip(d).zip(m) {
            let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
            for (q, y) in q.chunks_exact(8).zip(y.chunks_exact_mut(8)) {
                store_f32x8(y, _mm256_add_ps(_mm256_mul_ps(widen_i8x8(q), d), m));
            }
        }
    }

    /// `dst[i] = d * q[i]` for the 16 signed bytes of `q`, rounded exactly like the scalar
    /// `d * q as f32` (the int → float conversion is exact).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn store_scaled_i8x16(dst: &mut [f32], q: __m128i, d: f32) {
        let d = _mm256_set1_ps(d);
        let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q)));
        store_f32x8(&mut dst[..8], _mm256_mul_ps(d, lo));
        store_f32x8(&mut dst[8..16], _mm256_mul_ps(d, hi));
    }

    /// Sum of the 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn hsum_i32x8(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// The low 128 bits of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn lo128(v: __m256i) -> __m128i {
        _mm256_castsi256_si128(v)
    }

    /// The high 128 bits of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn hi128(v: __m256i) -> __m128i {
        _mm256_extracti128_si256::<1>(v)
    }

    /// 16 i16 lanes: `a` in the low 8, `b` in the high 8 (per-16-element scales for `madd`).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn set_i16_halves(a: i16, b: i16) -> __m256i {
        _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a))
    }
}

/// Which vector unit the fast (`dequantize`, `vec_dot`) twins use on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    Scalar,
    /// x86-64 with AVX2 + FMA + F16C (checked at run time).
    Avx2,
    /// aarch64: NEON is part of the baseline.
    Neon,
}

/// The vector unit to use; `is_x86_feature_detected!` caches, so this is cheap per call.
#[inline]
pub fn simd() -> Simd {
    if cfg!(target_arch = "aarch64") {
        return Simd::Neon;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Simd::Avx2;
        }
    }
    Simd::Scalar
}

/// Whether the tile kernels use AVX-VNNI's `vpdpbusd` (one instruction for the 4-product
/// integer sums that AVX2 builds from `maddubs` + `madd`; same integers, so same results):
/// when the CPU has it, unless `PARITY_NO_VNNI` is set (for A/B measurements).
pub fn use_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            simd() == Simd::Avx2
                && is_x86_feature_detected!("avxvnni")
                && std::env::var_os("PARITY_NO_VNNI").is_none()
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// AVX2 building blocks shared by the 32-element block formats.
///
/// # Safety
/// Every function needs `avx2,fma,f16c`: call them from kernels compiled for those features,
/// reached only after [`simd`] returned [`Simd::Avx2`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::missing_safety_doc)] // covered once, above
pub mod x86_b32 {
    use std::arch::x86_64::*;

    /// The 32 nibbles of `qs[0..16]` as bytes: low nibbles in bytes 0..16, high in 16..32
    /// (ggml's element order for 4-bit blocks).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn nibbles_32(qs: &[u8; 16]) -> __m256i {
        // SAFETY: `qs` is 16 readable bytes; loadu has no alignment requirement.
        let v = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let both = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// Byte j is 0xFF where bit j of `bits` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn bits_32(bits: u32) -> __m256i {
        // Byte j gets source byte j/8 of `bits`, then tests bit j%8 of it.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
            ),
        );
        let sel = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel)
    }

    /// 32 signed bytes times 32 signed bytes, summed exactly in fours: i32 lane k holds
    /// `sum(x[i]*y[i], i in 4k..4k+4)`, the lane layout of ggml's `mul_sum_i8_pairs_float`.
    /// Widening to i16 first keeps it exact for every input, -128 included (ggml's
    /// `maddubs` sign trick is not when `y` holds -128).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dot_i8_lanes(x: __m256i, y: __m256i) -> __m256i {
        let lo = _mm256_madd_epi16(
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)),
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(y)),
        );
        let hi = _mm256_madd_epi16(
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(x)),
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(y)),
        );
        // hadd leaves the 64-bit quarters as [0..8, 16..24, 8..16, 24..32]; put them in order.
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_hadd_epi32(lo, hi))
    }

    /// [`super::f16_le`] with F16C: the f16 at `b[0..2]` as f32. Same bits for every input
    /// (NaNs included), but no software branches per block scale.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn f16c_le(b: &[u8]) -> f32 {
        super::x86::f16c_bits(u16::from_le_bytes([b[0], b[1]]))
    }

    /// Sum of 8 lanes in ggml's `hsum_float_8` order, so results match its AVX2 kernels.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn hsum_f32x8(x: __m256) -> f32 {
        let mut r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }

    /// `y[i] = q[i] as f32 * d` for 32 signed bytes: the whole of a 32-element block decode.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn store_scaled(q: __m256i, d: f32, y: &mut [f32; 32]) {
        let d = _mm256_set1_ps(d);
        for (k, v) in widen_i8x32(q).into_iter().enumerate() {
            // SAFETY: k < 4, so `y[8k..8k+8]` is in bounds.
            unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(8 * k), _mm256_mul_ps(v, d)) };
        }
    }

    /// `y[i] = q[i] as f32 * d + m` (separate multiply and add, as ggml's scalar code).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn store_scaled_offset(q: __m256i, d: f32, m: f32, y: &mut [f32; 32]) {
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        for (k, v) in widen_i8x32(q).into_iter().enumerate() {
            let r = _mm256_add_ps(_mm256_mul_ps(v, d), m);
            // SAFETY: k < 4, so `y[8k..8k+8]` is in bounds.
            unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(8 * k), r) };
        }
    }

    /// Eight f16 bit patterns as f32, in one `vcvtph2ps`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn f16x8(bits: &[u16; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: `bits` is 16 readable bytes and `out` 32 writable ones; no alignment needed.
        unsafe {
            let v = _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr().cast()));
            _mm256_storeu_ps(out.as_mut_ptr(), v);
        }
        out
    }

    /// The decode loop of the 32-element block formats: `y = q·d` (`offset = false`) or
    /// `y = q·d + m` (`offset = true`, `m` the f16 at byte 2), with `d` the f16 at byte 0 and
    /// `$quants` the block's 32 quants as signed bytes, for `$b` bound to the block's bytes.
    /// Eight blocks at a time: their quants staged in memory (see `x86::Staged`), their scales
    /// converted by one `vcvtph2ps` and kept in memory for broadcast loads; the last blocks
    /// one by one. A macro, not a closure, so that `$quants` is compiled inside the caller's
    /// `#[target_feature]` function.
    macro_rules! dequant_b32 {
        ($src:expr, $dst:expr, $bytes:expr, offset = $offset:expr, |$b:ident| $quants:expr) => {{
            use crate::quant::util::x86::{Staged, in_memory, offset_groups, scale_groups};
            let (src, dst): (&[u8], &mut [f32]) = ($src, $dst);
            let blocks = (src.len() / $bytes).min(dst.len() / 32);
            let full = blocks / 8 * 8;
            let (head, tail) = src[..blocks * $bytes].split_at(full * $bytes);
            let (y_head, y_tail) = dst[..blocks * 32].split_at_mut(full * 32);
            for (s8, y) in head
                .chunks_exact(8 * $bytes)
                .zip(y_head.chunks_exact_mut(256))
            {
                let mut q = Staged::new();
                let (mut d, mut m) = ([0u16; 8], [0u16; 8]);
                for (i, $b) in s8.chunks_exact($bytes).enumerate() {
                    q.put(i, $quants);
                    d[i] = u16::from_le_bytes([$b[0], $b[1]]);
                    if $offset {
                        m[i] = u16::from_le_bytes([$b[2], $b[3]]);
                    }
                }
                let d = f16x8(&d);
                if $offset {
                    let m = f16x8(&m);
                    offset_groups::<32>(&in_memory(&q).0, in_memory(&d), in_memory(&m), y);
                } else {
                    scale_groups::<32>(&in_memory(&q).0, in_memory(&d), y);
                }
            }
            for ($b, y) in tail.chunks_exact($bytes).zip(y_tail.chunks_exact_mut(32)) {
                let (q, y) = ($quants, y.try_into().unwrap());
                if $offset {
                    store_scaled_offset(q, f16c_le($b), f16c_le(&$b[2..]), y);
                } else {
                    store_scaled(q, f16c_le($b), y);
                }
            }
        }};
    }
    pub(crate) use dequant_b32;

    /// 32 signed bytes to four vectors of 8 f32 (exact), in element order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn widen_i8x32(q: __m256i) -> [__m256; 4] {
        let lo = _mm256_castsi256_si128(q);
        let hi = _mm256_extracti128_si256::<1>(q);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi))),
        ]
    }
}

/// NEON building blocks shared by the 32-element block formats (NEON is baseline on aarch64).
#[cfg(target_arch = "aarch64")]
pub mod neon_b32 {
    use std::arch::aarch64::*;

    /// The 32 nibbles of `qs[0..16]`: (low nibbles = elements 0..16, high = 16..32).
    #[inline]
    pub fn nibbles_32(qs: &[u8; 16]) -> (uint8x16_t, uint8x16_t) {
        // SAFETY: `qs` is 16 readable bytes.
        let v = unsafe { vld1q_u8(qs.as_ptr()) };
        unsafe { (vandq_u8(v, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(v)) }
    }

    /// Byte j of the result is 0xFF where bit `j + 16*half` of `bits` is set.
    #[inline]
    pub fn bits_16(bits: u32, half: u32) -> uint8x16_t {
        let b = (bits >> (16 * half)) as u16;
        let sel: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        let bytes: [u8; 16] = [
            b as u8,
            b as u8,
            b as u8,
            b as u8,
            b as u8,
            b as u8,
            b as u8,
            b as u8,
            (b >> 8) as u8,
            (b >> 8) as u8,
            (b >> 8) as u8,
            (b >> 8) as u8,
            (b >> 8) as u8,
            (b >> 8) as u8,
            (b >> 8) as u8,
            (b >> 8) as u8,
        ];
        // SAFETY: plain loads of local arrays; NEON is baseline.
        unsafe {
            let sel = vld1q_u8(sel.as_ptr());
            vtstq_u8(vld1q_u8(bytes.as_ptr()), sel)
        }
    }

    /// Exact `sum(x[i]*y[i])` over 16 signed bytes.
    #[inline]
    pub fn dot_i8x16(x: int8x16_t, y: int8x16_t) -> i32 {
        // SAFETY: register-only intrinsics; NEON is baseline.
        unsafe {
            let lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
            let hi = vmull_high_s8(x, y);
            vaddvq_s32(vaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)))
        }
    }

    /// `y[i] = q[i] as f32 * d (+ m)` for 16 signed bytes; multiply and add stay separate.
    #[inline]
    pub fn store_scaled(q: int8x16_t, d: f32, m: Option<f32>, y: &mut [f32]) {
        assert!(y.len() >= 16);
        // SAFETY: 16 floats are writable at `y`; the rest are register-only intrinsics.
        unsafe {
            let w_lo = vmovl_s8(vget_low_s8(q));
            let w_hi = vmovl_high_s8(q);
            let parts = [
                vmovl_s16(vget_low_s16(w_lo)),
                vmovl_high_s16(w_lo),
                vmovl_s16(vget_low_s16(w_hi)),
                vmovl_high_s16(w_hi),
            ];
            for (k, p) in parts.into_iter().enumerate() {
                let mut v = vmulq_n_f32(vcvtq_f32_s32(p), d);
                if let Some(m) = m {
                    v = vaddq_f32(v, vdupq_n_f32(m));
                }
                vst1q_f32(y.as_mut_ptr().add(4 * k), v);
            }
        }
    }
}

/// Test helpers shared by the K-quant formats: proptest strategies, ggml's test data and metrics.
#[cfg(test)]
pub mod ktest {
    use super::QK_K;
    use proptest::prelude::*;

    /// The twins' dot products agree: the same bits, or both NaN. On arbitrary bytes a NaN f16
    /// weight scale can meet a NaN f32 activation scale in one multiply, and which payload
    /// survives is unspecified in Rust (LLVM may commute the operands, differently per build
    /// and opt level); finite, infinite and zero results must match to the bit.
    pub fn same_dot(simd: f32, scalar: f32) -> Result<(), TestCaseError> {
        prop_assert!(
            simd.to_bits() == scalar.to_bits() || (simd.is_nan() && scalar.is_nan()),
            "simd {simd:e} (0x{:08x}) vs scalar {scalar:e} (0x{:08x})",
            simd.to_bits(),
            scalar.to_bits()
        );
        Ok(())
    }

    /// Arbitrary bytes for a whole number of blocks (f16 scales may be NaN or Inf).
    pub fn blocks(bytes: usize, nblocks: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u8>> {
        nblocks.prop_flat_map(move |n| prop::collection::vec(any::<u8>(), n * bytes))
    }

    /// Random rows of whole blocks: values in ±1 plus an offset, scaled by 2^e with e in -4..8,
    /// so blocks range from all-positive to sign-balanced. The range keeps the formats' f16
    /// super-block scales normal; outside it their error is the f16's, not the quantizer's.
    pub fn floats(nblocks: std::ops::Range<usize>) -> impl Strategy<Value = Vec<f32>> {
        (nblocks, -4i32..8, -1.0f32..1.0).prop_flat_map(|(n, e, off)| {
            prop::collection::vec(-1.0f32..1.0, n * QK_K).prop_map(move |v| {
                v.into_iter()
                    .map(|x| (x + off) * (e as f32).exp2())
                    .collect()
            })
        })
    }

    /// ggml test-quantize-fns' `generate_data`: `0.1 + 2·cos(i + offset)` (the 0.1 is a double).
    pub fn ggml_test_data(offset: f32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (0.1f64 + (2.0f32 * (i as f32 + offset).cos()) as f64) as f32)
            .collect()
    }

    /// ggml test-quantize-fns' `array_rmse`: sqrt(Σ diff²) / n (not the usual sqrt of the mean).
    pub fn ggml_rmse(a: &[f32], b: &[f32]) -> f32 {
        let sum: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| ((x - y) as f64).powi(2))
            .sum();
        (sum.sqrt() / a.len() as f64) as f32
    }

    /// The usual RMSE relative to the data's RMS: a scale-free round-trip error.
    pub fn rel_rmse(a: &[f32], b: &[f32]) -> f32 {
        let err: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| ((x - y) as f64).powi(2))
            .sum();
        let norm: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum();
        if norm == 0.0 {
            err.sqrt() as f32
        } else {
            (err / norm).sqrt() as f32
        }
    }

    /// f64 dot product (ggml's reference `dot_product`).
    pub fn f64_dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
    }

    pub fn quantize_vec(x: &[f32], bytes: usize, f: fn(&[f32], &mut [u8])) -> Vec<u8> {
        let mut q = vec![0u8; x.len() / QK_K * bytes];
        f(x, &mut q);
        q
    }

    pub fn decode_vec(q: &[u8], bytes: usize, f: fn(&[u8], &mut [f32])) -> Vec<f32> {
        let mut y = vec![0f32; q.len() / bytes * QK_K];
        f(q, &mut y);
        y
    }

    /// Decode `src` with both functions and require the same bits (NaN payloads included).
    pub fn assert_same_decode(
        src: &[u8],
        bytes: usize,
        fast: fn(&[u8], &mut [f32]),
        scalar: fn(&[u8], &mut [f32]),
    ) {
        let a = decode_vec(src, bytes, fast);
        let b = decode_vec(src, bytes, scalar);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "element {i}: {x} vs {y}");
        }
    }

    /// The SIMD dot product against the f64 dot of both rows dequantized: the same numbers, so
    /// only float rounding may differ. `tol` scales with max|w|·Σ|a| because a K-quant dot is
    /// `d·Σ sc·q·q8 − dmin·Σ m·bsum`, whose two terms can each exceed the result.
    pub fn assert_dot_matches_dequantized(
        x: &[f32],
        y: &[f32],
        bytes: usize,
        quantize: fn(&[f32], &mut [u8]),
        dequantize: fn(&[u8], &mut [f32]),
        vec_dot: fn(&[u8], &[u8]) -> f32,
    ) {
        use crate::quant::q8_k;
        let wq = quantize_vec(x, bytes, quantize);
        let aq = quantize_vec(y, q8_k::BLOCK_BYTES, q8_k::quantize);
        let wd = decode_vec(&wq, bytes, dequantize);
        let ad = decode_vec(&aq, q8_k::BLOCK_BYTES, q8_k::dequantize_scalar);
        let exact = f64_dot(&wd, &ad);
        let wmax = wd.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
        let asum: f64 = ad.iter().map(|&v| (v as f64).abs()).sum();
        let got = vec_dot(&wq, &aq) as f64;
        let tol = 4e-5 * wmax * asum + 1e-30;
        assert!(
            (got - exact).abs() <= tol,
            "vec_dot {got} vs dequantized {exact} (tol {tol})"
        );
    }

    /// test-quantize-fns' dot product error: weights `0.1 + 2cos(i)` in the tested format,
    /// activations `0.1 + 2cos(i + 1)` in Q8_K, |vec_dot − f64 dot of the originals| / n.
    pub fn ggml_dot_error(
        bytes: usize,
        quantize: fn(&[f32], &mut [u8]),
        vec_dot: fn(&[u8], &[u8]) -> f32,
    ) -> f32 {
        use crate::quant::q8_k;
        let n = 4096;
        let (x, y) = (ggml_test_data(0.0, n), ggml_test_data(1.0, n));
        let wq = quantize_vec(&x, bytes, quantize);
        let aq = quantize_vec(&y, q8_k::BLOCK_BYTES, q8_k::quantize);
        ((vec_dot(&wq, &aq) as f64 - f64_dot(&x, &y)).abs() / n as f64) as f32
    }

    /// Known-answer inputs that Python can rebuild exactly (integer LCG, exact float ops):
    /// `n` values in ±2 with a per-block offset of −0.5, 0 or +0.5.
    pub fn kat_data(n: usize) -> Vec<f32> {
        let mut s = 1u32;
        (0..n)
            .map(|i| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let x = ((s >> 8) as f32 * (1.0 / 16_777_216.0) - 0.5) * 4.0;
                x + ((i / QK_K) % 3) as f32 * 0.5 - 0.5
            })
            .collect()
    }

    /// Known-answer bytes: the top byte of the same LCG seeded with 2.
    pub fn kat_bytes(n: usize) -> Vec<u8> {
        let mut s = 2u32;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 24) as u8
            })
            .collect()
    }

    /// First 16 bytes of the SHA-256 of `b`, in hex.
    pub fn sha256_128(b: &[u8]) -> String {
        use sha2::{Digest, Sha256};
        Sha256::digest(b)[..16]
            .iter()
            .map(|v| format!("{v:02x}"))
            .collect()
    }

    /// Bit-exactness against llama.cpp (llama-cpp-python 0.3.36's libggml): the hash of
    /// `quantize(kat_data(4096))` and of both decoders' output for `kat_bytes(8 blocks)`, as
    /// ggml's `quantize_chunk` / `to_float` produce them.
    pub fn assert_known_answers(
        bytes: usize,
        quantize: fn(&[f32], &mut [u8]),
        dequantize: fn(&[u8], &mut [f32]),
        dequantize_scalar: fn(&[u8], &mut [f32]),
        quant_hash: &str,
        decode_hash: &str,
    ) {
        let q = quantize_vec(&kat_data(4096), bytes, quantize);
        assert_eq!(sha256_128(&q), quant_hash, "quantize");
        let raw = kat_bytes(8 * bytes);
        for f in [dequantize, dequantize_scalar] {
            let y: Vec<u8> = decode_vec(&raw, bytes, f)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            assert_eq!(sha256_128(&y), decode_hash, "dequantize");
        }
    }

    /// llama.cpp's `vec_dot` for `quantize(kat_data(4096))` against the reversed data in Q8_K
    /// is `expected`; ours sums in another order, so allow a few f32 roundings of `abs_sum`
    /// (Σ|w·a| of the dequantized rows, ~4.4e3 for this data).
    pub fn assert_dot_known_answer(
        bytes: usize,
        quantize: fn(&[f32], &mut [u8]),
        vec_dot: fn(&[u8], &[u8]) -> f32,
        expected: f32,
        abs_sum: f32,
    ) {
        use crate::quant::q8_k;
        let x = kat_data(4096);
        let y: Vec<f32> = x.iter().rev().copied().collect();
        let w = quantize_vec(&x, bytes, quantize);
        let a = quantize_vec(&y, q8_k::BLOCK_BYTES, q8_k::quantize);
        let got = vec_dot(&w, &a);
        let tol = 16.0 * f32::EPSILON * abs_sum;
        assert!(
            (got - expected).abs() <= tol,
            "{got} vs llama.cpp {expected} (tol {tol})"
        );
    }
}

/// Shared property-test helpers for the 32-element block formats (and anyone else).
#[cfg(test)]
pub mod testing {
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;
    use std::ops::Range;

    pub type Quant = fn(&[f32], &mut [u8]);
    pub type Dequant = fn(&[u8], &mut [f32]);
    pub type Dot = fn(&[u8], &[u8]) -> f32;

    /// test-quantize-fns' `generate_data`: `0.1 + 2 cos(i + offset)`.
    pub fn ggml_test_data(n: usize, offset: f32) -> Vec<f32> {
        (0..n)
            .map(|i| 0.1 + 2.0 * (i as f32 + offset).cos())
            .collect()
    }

    /// test-quantize-fns' `array_rmse`: `sqrt(sum diff²) / n` (it divides by n, not √n, and
    /// its bounds — 0.002 for 4/5/8-bit formats — are in that unit).
    pub fn ggml_rmse(a: &[f32], b: &[f32]) -> f32 {
        let sum: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum();
        sum.sqrt() as f32 / a.len() as f32
    }

    /// `nblocks` whole blocks of arbitrary bytes.
    pub fn blocks(bytes: usize, nblocks: Range<usize>) -> impl Strategy<Value = Vec<u8>> {
        nblocks.prop_flat_map(move |nb| prop::collection::vec(any::<u8>(), nb * bytes))
    }

    /// Whole blocks of finite floats at a random scale (10⁻² … 10³), with a sprinkling of exact
    /// zeros and repeated values so ties and flat blocks come up.
    pub fn floats(block: usize, nblocks: Range<usize>) -> impl Strategy<Value = Vec<f32>> {
        let elem = prop_oneof![
            8 => -1.0f32..1.0,
            1 => Just(0.0f32),
            1 => Just(0.5f32),
        ];
        (
            nblocks.prop_flat_map(move |nb| prop::collection::vec(elem.clone(), nb * block)),
            -2.0f32..3.0,
        )
            .prop_map(|(v, e)| {
                let s = 10f32.powf(e);
                v.into_iter().map(|x| x * s).collect()
            })
    }

    /// 4096 floats in ±2: the regime test-quantize-fns' bounds were set for.
    pub fn ggml_like_floats() -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-2.0f32..2.0, 4096)
    }

    /// Overwrite the f16 at `off` in every `bytes`-sized block with a finite value in ±[2⁻⁸, 2⁶),
    /// keeping arbitrary sign and mantissa: dot-product tests want finite scales.
    pub fn finite_scales(data: &mut [u8], bytes: usize, offs: &[usize]) {
        for b in data.chunks_exact_mut(bytes) {
            for &o in offs {
                let bits = u16::from_le_bytes([b[o], b[o + 1]]);
                let e = 7 + ((bits >> 10) & 0x1F) % 14;
                let bits = (bits & 0x83FF) | (e << 10);
                b[o..o + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
    }

    /// Set the f16 at each of `offs` in every block to `v`.
    pub fn set_scales(data: &mut [u8], bytes: usize, offs: &[usize], v: f32) {
        for b in data.chunks_exact_mut(bytes) {
            for &o in offs {
                super::put_f16(&mut b[o..], v);
            }
        }
    }

    /// The SIMD decoder equals the scalar one bit for bit. A NaN only has to meet a NaN: Rust
    /// (LLVM) leaves NaN payloads unspecified, e.g. which operand's NaN `q*d + m` returns.
    pub fn assert_dequant_twins(
        src: &[u8],
        block: usize,
        bytes: usize,
        fast: Dequant,
        scalar: Dequant,
    ) -> Result<(), TestCaseError> {
        let n = src.len() / bytes * block;
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        fast(src, &mut a);
        scalar(src, &mut b);
        for i in 0..n {
            if !(a[i].is_nan() && b[i].is_nan()) {
                prop_assert_eq!(a[i].to_bits(), b[i].to_bits(), "element {}", i);
            }
        }
        Ok(())
    }

    /// Decode `q` (whole blocks) into a fresh vector of `n` floats.
    pub fn decode(q: &[u8], n: usize, deq: Dequant) -> Vec<f32> {
        let mut y = vec![0f32; n];
        deq(q, &mut y);
        y
    }

    /// Encode `x` into a fresh vector of `x.len() / block * bytes` bytes.
    pub fn encode(x: &[f32], block: usize, bytes: usize, quant: Quant) -> Vec<u8> {
        let mut q = vec![0u8; x.len() / block * bytes];
        quant(x, &mut q);
        q
    }

    /// quantize → dequantize error, in test-quantize-fns' unit, is at most `bound`.
    pub fn assert_rmse(
        x: &[f32],
        quant: Quant,
        deq: Dequant,
        block: usize,
        bytes: usize,
        bound: f32,
    ) -> Result<(), TestCaseError> {
        let y = decode(&encode(x, block, bytes, quant), x.len(), deq);
        let e = ggml_rmse(x, &y);
        prop_assert!(e <= bound, "rmse {} > {}", e, bound);
        Ok(())
    }

    /// Worst per-block `max|x - x̂| / max|x|` after a round trip (0 for all-zero blocks).
    pub fn max_rel_block_err(
        x: &[f32],
        quant: Quant,
        deq: Dequant,
        block: usize,
        bytes: usize,
    ) -> f32 {
        let y = decode(&encode(x, block, bytes, quant), x.len(), deq);
        x.chunks(block)
            .zip(y.chunks(block))
            .map(|(x, y)| {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let err = x.iter().zip(y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                if amax > 0.0 { err / amax } else { err }
            })
            .fold(0.0, f32::max)
    }

    /// quantize(dequantize(quantize(x))) == quantize(x), byte for byte.
    pub fn assert_idempotent(
        x: &[f32],
        quant: Quant,
        deq: Dequant,
        block: usize,
        bytes: usize,
    ) -> Result<(), TestCaseError> {
        let q1 = encode(x, block, bytes, quant);
        let q2 = encode(&decode(&q1, x.len(), deq), block, bytes, quant);
        prop_assert_eq!(q1, q2);
        Ok(())
    }

    /// `(sum w·a, sum |w·a|)` over the decoded rows, in f64.
    pub fn dequant_dot(w: &[f32], a: &[f32]) -> (f64, f64) {
        w.iter().zip(a).fold((0.0, 0.0), |(s, m), (&x, &y)| {
            let p = x as f64 * y as f64;
            (s + p, m + p.abs())
        })
    }

    /// Two float sums of the same `nterms` rounded terms, accumulated in different orders (and
    /// with or without FMA), differ by at most about `2 (nterms + 8) ε Σ|term|`; `mag` is that
    /// Σ|term| (or an upper bound on it).
    pub fn sum_order_bound(nterms: usize, mag: f64) -> f64 {
        2.0 * (nterms as f64 + 8.0) * f32::EPSILON as f64 * mag + 1e-30
    }
}

/// NEON twins of [`x86`]'s helpers for the K-quant decoders (NEON is baseline on aarch64).
#[cfg(target_arch = "aarch64")]
pub mod arm {
    use std::arch::aarch64::*;

    /// The first 16 bytes of `s`.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(crate) fn load_u8x16(s: &[u8]) -> uint8x16_t {
        let s = &s[..16];
        // SAFETY: `s` holds 16 readable bytes; vld1q has no alignment requirement.
        unsafe { vld1q_u8(s.as_ptr()) }
    }

    /// Store 4 floats to `dst[..4]`.
    #[inline]
    #[target_feature(enable = "neon")]
    fn store_f32x4(dst: &mut [f32], v: float32x4_t) {
        let dst = &mut dst[..4];
        // SAFETY: `dst` holds 4 writable floats; vst1q has no alignment requirement.
        unsafe { vst1q_f32(dst.as_mut_ptr(), v) }
    }

    /// 16 signed bytes as 4 vectors of floats (exact).
    #[inline]
    #[target_feature(enable = "neon")]
    fn widen(q: int8x16_t) -> [float32x4_t; 4] {
        let (lo, hi) = (vmovl_s8(vget_low_s8(q)), vmovl_high_s8(q));
        [
            vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
            vcvtq_f32_s32(vmovl_high_s16(lo)),
            vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
            vcvtq_f32_s32(vmovl_high_s16(hi)),
        ]
    }

    /// `dst[i] = d * q[i]` for 16 signed bytes, rounded like the scalar `d * q as f32`.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(crate) fn store_scaled_i8x16(dst: &mut [f32], q: int8x16_t, d: f32) {
        for (i, v) in widen(q).into_iter().enumerate() {
            store_f32x4(&mut dst[4 * i..], vmulq_n_f32(v, d));
        }
    }

    /// `dst[i] = d * q[i] - m` for 16 signed bytes: multiply then subtract (no fused op), as the
    /// scalar `d * q as f32 - m`.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(crate) fn store_affine_i8x16(dst: &mut [f32], q: int8x16_t, d: f32, m: f32) {
        let m = vdupq_n_f32(m);
        for (i, v) in widen(q).into_iter().enumerate() {
            store_f32x4(&mut dst[4 * i..], vsubq_f32(vmulq_n_f32(v, d), m));
        }
    }

    /// `Σ a[i]·b[i]` over 16 int8 lanes (each product fits an i16; the sum is exact).
    #[inline]
    #[target_feature(enable = "neon")]
    pub(crate) fn dot_i8x16(a: int8x16_t, b: int8x16_t) -> i32 {
        let p = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
        vaddvq_s32(vpadalq_s16(p, vmull_high_s8(a, b)))
    }

    /// `v >> n` in every byte, for a run-time `n` (vshlq shifts right by a negative count).
    #[inline]
    #[target_feature(enable = "neon")]
    pub(crate) fn shr_u8(v: uint8x16_t, n: usize) -> uint8x16_t {
        vshlq_u8(v, vdupq_n_s8(-(n as i8)))
    }
}

/// C's `(int8_t)x` / `(uint8_t)x` for a float `x`, as compiled for x86 (`cvttss2si`, then the
/// low byte): truncation toward zero when in range; NaN and |x| >= 2³¹ give 0x8000_0000, so 0.
/// The conversion is undefined behaviour in C, so this is what ggml's quantizers do on x86 when
/// a degenerate block (subnormal or infinite scale, NaN input) sends a value out of range.
#[inline]
pub fn c_float_to_byte(x: f32) -> u8 {
    cvtt_f32_i32(x) as u8
}

/// x86 `cvttss2si`: truncate toward zero; NaN and out-of-range give `i32::MIN`.
#[inline]
pub fn cvtt_f32_i32(x: f32) -> i32 {
    if x.is_nan() || !(-2_147_483_648.0..2_147_483_648.0).contains(&x) {
        i32::MIN
    } else {
        x as i32
    }
}
