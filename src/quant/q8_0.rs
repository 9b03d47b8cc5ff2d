//! Q8_0: blocks of 32, `d: f16` then 32 signed bytes; `x[j] = qs[j] * d`.
//!
//! Also the activation type the CPU backend pairs with Q4_0, Q5_0, Q8_0 and IQ4_NL weights, so
//! [`quantize`] must match ggml's `quantize_row_q8_0_ref` bit for bit.

use super::util::{Simd, c_float_to_byte, cvtt_f32_i32, f16_le, put_f16, simd};

pub const BLOCK: usize = 32;
pub const BYTES: usize = 34;

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
    match simd() {
        // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { x86::dequantize(src, dst) },
        #[cfg(target_arch = "aarch64")]
        Simd::Neon => neon::dequantize(src, dst),
        _ => dequantize_scalar(src, dst),
    }
}

/// ggml's `quantize_row_q8_0_ref`: `d = max|x| / 127`, `q = roundf(x / d)` (half away from zero).
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BYTES)) {
        // C's MAX(a, b) is `a > b ? a : b`: a NaN is dropped again by the next element.
        let amax = x
            .iter()
            .fold(0.0f32, |m, v| if m > v.abs() { m } else { v.abs() });
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, d);
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = c_float_to_byte((v * id).round());
        }
    }
}

/// What ggml's x86 AVX/AVX2 `quantize_row_q8_0` (the CPU backend's activation quantizer on
/// such machines) writes. It differs from [`quantize`] in two ways: the inverse scale is
/// `127 / max|x|` rather than `1 / (max|x| / 127)`, and rounding is half to even. The two
/// disagree on a handful of bytes per million.
pub fn quantize_x86_avx(src: &[f32], dst: &mut [u8]) {
    match simd() {
        // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { x86::quantize_avx2(src, dst) },
        _ => quantize_x86_avx_scalar(src, dst),
    }
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
    match simd() {
        // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { x86::vec_dot(w, a) },
        #[cfg(target_arch = "aarch64")]
        Simd::Neon => neon::vec_dot(w, a),
        _ => vec_dot_scalar(w, a),
    }
}

/// One activation block as the tile kernels read it (64 bytes, one cache line): the 32 quants,
/// then `−8·(q[4k] + … + q[4k+3])` for k in 0..8 (the term that turns Q4_0's unsigned nibbles
/// into `q − 8`; negative so that it can be `vpdpbusd`'s starting value).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct TileBlock {
    pub(in crate::quant) q: [i8; 32],
    pub(in crate::quant) neg_bias: [i32; 8],
}

/// Eight lanes of one f32, 32-byte aligned.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub struct Lanes(pub(in crate::quant) [f32; 8]);

/// Activation rows quantized to Q8_0 exactly as [`quantize_x86_avx`] does, kept as plain Q8_0
/// rows and also re-laid out for the multi-row kernels ([`vec_dot_tile`], `q4_0::vec_dot_tile`):
/// per block a [`TileBlock`] and the scale as an f32. Buffers only grow, so refilling one per
/// matmul allocates nothing in steady state.
#[derive(Default)]
pub struct TileAct {
    /// Elements per row.
    n: usize,
    rows: usize,
    q8: Vec<u8>,
    pub(in crate::quant) blocks: Vec<TileBlock>,
    pub(in crate::quant) d: Vec<f32>,
    /// The scales again, each in 8 lanes (see `x86::Unpacked` for why).
    pub(in crate::quant) d8: Vec<Lanes>,
    /// Some quant is -128 (the Q8_0 × Q8_0 tile kernel's sign trick cannot take it).
    pub(in crate::quant) has_min: bool,
}

impl TileAct {
    /// Quantize the rows of `x` (each `n` elements, `n` a multiple of 32).
    pub fn quantize(&mut self, x: &[f32], n: usize) {
        self.resize(x.len() / n.max(1), n);
        let rb = n / BLOCK * BYTES;
        for (x, q) in x.chunks_exact(n).zip(self.q8.chunks_exact_mut(rb)) {
            quantize_x86_avx(x, q);
        }
        self.relayout();
    }

    /// Take Q8_0 rows as they are (`q8.len()` a multiple of the row size of `n` elements).
    pub fn load_q8(&mut self, q8: &[u8], n: usize) {
        let rb = n / BLOCK * BYTES;
        assert!(
            rb > 0 && q8.len().is_multiple_of(rb),
            "whole Q8_0 rows of {n} elements"
        );
        self.resize(q8.len() / rb, n);
        self.q8.copy_from_slice(q8);
        self.relayout();
    }

    fn resize(&mut self, rows: usize, n: usize) {
        assert!(n.is_multiple_of(BLOCK), "Q8_0 rows are whole blocks: {n}");
        let nb = rows * (n / BLOCK);
        self.n = n;
        self.rows = rows;
        // resize (not clear + resize) so that steady-state calls do not touch the allocator.
        self.q8.resize(nb * BYTES, 0);
        self.blocks.resize(nb, TileBlock::default());
        self.d.resize(nb, 0.0);
        self.d8.resize(nb, Lanes::default());
    }

    fn relayout(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if simd() == Simd::Avx2 {
            // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
            self.has_min = unsafe { x86::relayout(&self.q8, &mut self.blocks, &mut self.d) };
            self.fill_d8();
            return;
        }
        let mut has_min = false;
        let blocks = self.q8.chunks_exact(BYTES);
        for ((b, t), d) in blocks.zip(&mut self.blocks).zip(&mut self.d) {
            *d = f16_le(b);
            for (q, &v) in t.q.iter_mut().zip(&b[2..]) {
                *q = v as i8;
            }
            for (k, nb) in t.neg_bias.iter_mut().enumerate() {
                *nb = -8 * t.q[4 * k..4 * k + 4].iter().map(|&q| q as i32).sum::<i32>();
            }
            has_min |= b[2..].contains(&0x80);
        }
        self.fill_d8();
        self.has_min = has_min;
    }

    fn fill_d8(&mut self) {
        for (d8, &d) in self.d8.iter_mut().zip(&self.d) {
            *d8 = Lanes([d; 8]);
        }
    }

    /// Elements per row.
    pub fn n(&self) -> usize {
        self.n
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `t` as plain Q8_0 bytes.
    pub fn q8_row(&self, t: usize) -> &[u8] {
        let rb = self.n / BLOCK * BYTES;
        &self.q8[t * rb..(t + 1) * rb]
    }
}

/// `out[r * a.rows() + t] = vec_dot(w_r, a_t)` for every Q8_0 weight row `w_r` of `w` (whole
/// rows of `a.n()` elements back to back) and every activation row `a_t`: the same numbers as
/// [`vec_dot`], bit for bit, but several rows and tokens at a time (see `q4_0::vec_dot_tile`).
/// Rows holding a -128 quant go through [`vec_dot`] (the sign trick cannot take them).
pub fn vec_dot_tile(w: &[u8], a: &TileAct, out: &mut [f32]) {
    tile_with(super::util::use_vnni(), w, a, out)
}

/// [`vec_dot_tile`], choosing whether the AVX-VNNI kernel may be used (tests run both).
fn tile_with(vnni: bool, w: &[u8], a: &TileAct, out: &mut [f32]) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = vnni;
    let rb = a.n / BLOCK * BYTES;
    assert!(
        rb > 0 && w.len().is_multiple_of(rb),
        "q8_0 tile: whole weight rows"
    );
    let nr = w.len() / rb;
    assert_eq!(out.len(), nr * a.rows, "q8_0 tile: output is rows × tokens");
    #[cfg(target_arch = "x86_64")]
    if simd() == Simd::Avx2 && !a.has_min {
        // SAFETY: avx2, fma and f16c are present (and avxvnni where used); sizes were checked
        // above.
        unsafe {
            if vnni && is_x86_feature_detected!("avxvnni") {
                x86::vec_dot_tile_vnni(w, nr, a, out)
            } else {
                x86::vec_dot_tile(w, nr, a, out)
            }
        };
        return;
    }
    for (wr, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(a.rows)) {
        for (t, o) in o.iter_mut().enumerate() {
            *o = vec_dot(wr, a.q8_row(t));
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::util::{put_f16, x86_b32::*};
    use super::{BLOCK, BYTES, TileAct, TileBlock};
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

    /// [`TileAct`]'s layout from plain Q8_0 blocks; returns whether some quant is -128.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn relayout(q8: &[u8], blocks: &mut [TileBlock], d: &mut [f32]) -> bool {
        let (ones8, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
        let mut min = _mm256_setzero_si256();
        for ((b, t), d) in q8.chunks_exact(BYTES).zip(blocks).zip(d) {
            *d = f16c_le(b);
            let y = load_qs(b);
            let sum4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, y), ones16);
            min = _mm256_or_si256(min, _mm256_cmpeq_epi8(y, _mm256_set1_epi8(-128)));
            // SAFETY: `t` is 64 writable bytes (32 of quants, then 8 i32).
            unsafe {
                _mm256_store_si256(t.q.as_mut_ptr().cast(), y);
                let neg8 = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<3>(sum4));
                _mm256_store_si256(t.neg_bias.as_mut_ptr().cast(), neg8);
            }
        }
        _mm256_movemask_epi8(min) != 0
    }

    /// `d` of a block: f16 bits at `p` to f32 (exact).
    ///
    /// # Safety
    /// `p` must point to 2 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees 2 readable bytes.
        let bits = unsafe { p.cast::<u16>().read_unaligned() };
        crate::quant::util::x86::f16c_bits(bits)
    }

    /// f32 of every f16 bit pattern (256 KiB, built once with F16C). In the one-token tiles a
    /// weight scale then costs two loads, where `vcvtph2ps` and its broadcast would take the
    /// shuffle port that the nibble unpacking needs too. Weight scales take few distinct values,
    /// so the entries in use stay in L1.
    pub(in crate::quant) fn f16_table() -> &'static [f32] {
        static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
        TABLE.get_or_init(|| {
            (0..=u16::MAX)
                .map(|bits| {
                    // SAFETY: the tile kernels that use the table only run where F16C is present.
                    unsafe { f16_at(bits.to_le_bytes().as_ptr()) }
                })
                .collect()
        })
    }

    /// The scale of the block at `wb`, from [`f16_table`].
    ///
    /// # Safety
    /// `wb` must point to 2 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::quant) unsafe fn scale_from(table: &[f32], wb: *const u8) -> f32 {
        // SAFETY: the caller guarantees 2 readable bytes; a u16 indexes the 65536-entry table.
        unsafe { *table.get_unchecked(wb.cast::<u16>().read_unaligned() as usize) }
    }

    /// A weight block made ready for many tokens (one cache line): its 32 quants as bytes
    /// (Q8_0's signed ones, or Q4_0's nibbles 0..15 in element order) and its scale in all 8
    /// lanes. A vector of scales (rather than one to broadcast) keeps `d_w * d_a` a vector
    /// multiply: two broadcasts would be folded into a scalar multiply and a shuffle per token.
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    pub(in crate::quant) struct Unpacked {
        pub q: [u8; 32],
        pub d: [f32; 8],
    }

    thread_local! {
        /// Per thread: the row group being multiplied, unpacked ([block][row]).
        static UNPACKED: std::cell::RefCell<Vec<Unpacked>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// `f(buffer of at least n unpacked blocks)`, with this thread's buffer (grown, never shrunk).
    pub(in crate::quant) fn with_unpacked<T>(n: usize, f: impl FnOnce(&mut [Unpacked]) -> T) -> T {
        UNPACKED.with(|u| {
            let mut u = u.borrow_mut();
            if u.len() < n {
                let z = Unpacked {
                    q: [0; 32],
                    d: [0.0; 8],
                };
                u.resize(n, z);
            }
            f(&mut u[..n])
        })
    }

    /// Rows per tile; tokens per tile when there are several (prefill).
    pub(in crate::quant) const R: usize = 4;
    pub(in crate::quant) const C: usize = 2;
    /// How far ahead (bytes) of the block in use a one-token (memory-bound) tile asks for
    /// weights. The hardware prefetcher alone leaves a core at about half its streaming rate;
    /// 16 KiB ahead measured best (4 KiB: -10%, 32 KiB: the same) on a 2-core Xeon.
    pub(in crate::quant) const PREFETCH: usize = 16384;

    /// The R rows at `w` into `u` ([block][row]).
    ///
    /// # Safety
    /// `w` holds R rows of `wrow` bytes (nb blocks); `u` has room for R·nb blocks.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack<const R: usize>(w: *const u8, wrow: usize, nb: usize, u: *mut Unpacked) {
        for b in 0..nb {
            for r in 0..R {
                // SAFETY: in bounds by the caller's promise.
                unsafe {
                    let wb = w.add(r * wrow + b * BYTES);
                    let u = &mut *u.add(b * R + r);
                    _mm256_store_si256(
                        u.q.as_mut_ptr().cast(),
                        _mm256_loadu_si256(wb.add(2).cast()),
                    );
                    _mm256_store_ps(u.d.as_mut_ptr(), _mm256_set1_ps(f16_at(wb)));
                }
            }
        }
    }

    /// The exact 4-product sums `Σ |x|·(y·sign x)` per i32 lane (ggml's sign trick: `|x|` as
    /// unsigned bytes; exact unless some y is -128, which the caller rules out).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn lanes_avx2(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
    }

    /// [`lanes_avx2`] with AVX-VNNI's `vpdpbusd`: the same four products per lane, summed in
    /// one instruction, so the same integers.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    fn lanes_vnni(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sy)
    }

    /// The tile driver shared by the Q4_0 and Q8_0 kernels: groups of R weight rows; for one
    /// token (decode) straight from the weights, for several (prompt) unpacked once into the
    /// per-thread buffer and then swept C tokens at a time; tail rows one by one. `$tile` is
    /// the caller's kernel, compiled for the same `$features`; `BLOCK`, `BYTES` and `unpack`
    /// are the caller's.
    macro_rules! tile_driver {
        ($features:literal, $driver:ident, $tile:ident) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $driver(w: &[u8], nr: usize, a: &TileAct, out: &mut [f32]) {
                let (nb, nt) = (a.n() / BLOCK, a.rows());
                let wrow = nb * BYTES;
                let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
                with_unpacked(if nt > 1 { R * nb } else { 0 }, |u| {
                    let u = u.as_mut_ptr();
                    // SAFETY (all calls): the caller checked w = nr rows of wrow bytes, out = nr × nt,
                    // and `a` holds nt rows of nb blocks; each call touches rows r..r+R' and tokens
                    // t..t+C'; `u` holds R·nb blocks when nt > 1.
                    unsafe {
                        let mut r = 0;
                        while r + R <= nr {
                            let (w, o) = (wp.add(r * wrow), op.add(r * nt));
                            if nt == 1 {
                                $tile::<R, 1, false>(w, wrow, u, a, 0, o, nt);
                            } else {
                                unpack::<R>(w, wrow, nb, u);
                                let mut t = 0;
                                while t + C <= nt {
                                    $tile::<R, C, true>(w, wrow, u, a, t, o, nt);
                                    t += C;
                                }
                                while t < nt {
                                    $tile::<R, 1, true>(w, wrow, u, a, t, o, nt);
                                    t += 1;
                                }
                            }
                            r += R;
                        }
                        for r in r..nr {
                            for t in 0..nt {
                                $tile::<1, 1, false>(
                                    wp.add(r * wrow),
                                    wrow,
                                    u,
                                    a,
                                    t,
                                    op.add(r * nt),
                                    nt,
                                );
                            }
                        }
                    }
                })
            }
        };
    }
    pub(in crate::quant) use tile_driver;

    /// The tile driver and kernel, stamped out once per instruction set (`$features`, with
    /// `$lanes` for the integer step): `vec_dot_tile` (AVX2) and `vec_dot_tile_vnni`.
    macro_rules! tile_kernels {
        ($features:literal, $lanes:ident, $driver:ident, $tile:ident) => {
            tile_driver!($features, $driver, $tile);

            /// R weight rows (`wrow` bytes apart from `w`, or unpacked in `u`) × activation rows
            /// t0..t0+C, into `out[r * ldo + t]`. Per (row, token) the arithmetic is
            /// [`super::vec_dot`]'s: the exact i32 lanes (ggml's `ax = |x|, sy = sign(y, x)` trick, exact
            /// since no activation quant is -128), one FMA of `d_w * d_a` per block into 8 lanes,
            /// `hsum_f32x8` at the end.
            #[inline]
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn $tile<const R: usize, const C: usize, const UNPACKED: bool>(
                w: *const u8,
                wrow: usize,
                u: *const Unpacked,
                a: &TileAct,
                t0: usize,
                out: *mut f32,
                ldo: usize,
            ) {
                let nb = a.n / BLOCK;
                let (ys, ds, d8) = (a.blocks.as_ptr(), a.d.as_ptr(), a.d8.as_ptr());
                let table = f16_table();
                let mut acc = [[_mm256_setzero_ps(); C]; R];
                for b in 0..nb {
                    for (r, acc) in acc.iter_mut().enumerate() {
                        // SAFETY: block b of row r is inside the caller's weight rows (or `u`); token
                        // rows t0..t0+C exist in `a`.
                        unsafe {
                            let (x, dw) = if UNPACKED {
                                let u = &*u.add(b * R + r);
                                (
                                    _mm256_load_si256(u.q.as_ptr().cast()),
                                    _mm256_load_ps(u.d.as_ptr()),
                                )
                            } else {
                                let wb = w.add(r * wrow + b * BYTES);
                                if C == 1 {
                                    // Decode streams the weights once: ask for them well ahead.
                                    _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(PREFETCH).cast());
                                }
                                (
                                    _mm256_loadu_si256(wb.add(2).cast()),
                                    _mm256_set1_ps(scale_from(table, wb)),
                                )
                            };
                            let ax = _mm256_sign_epi8(x, x);
                            for (c, acc) in acc.iter_mut().enumerate() {
                                let i = (t0 + c) * nb + b;
                                let y = _mm256_load_si256((*ys.add(i)).q.as_ptr().cast());
                                let p = $lanes(ax, _mm256_sign_epi8(y, x));
                                let da = if UNPACKED {
                                    _mm256_set1_ps(*ds.add(i))
                                } else {
                                    _mm256_load_ps((*d8.add(i)).0.as_ptr())
                                };
                                let d = _mm256_mul_ps(dw, da);
                                *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), *acc);
                            }
                        }
                    }
                }
                for (r, acc) in acc.iter().enumerate() {
                    for (c, &acc) in acc.iter().enumerate() {
                        // SAFETY: (r, t0 + c) is inside the caller's output.
                        unsafe { *out.add(r * ldo + t0 + c) = hsum_f32x8(acc) };
                    }
                }
            }
        };
    }
    tile_kernels!("avx2,fma,f16c", lanes_avx2, vec_dot_tile, tile);
    tile_kernels!(
        "avx2,fma,f16c,avxvnni",
        lanes_vnni,
        vec_dot_tile_vnni,
        tile_vnni
    );

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dequantize(src: &[u8], dst: &mut [f32]) {
        dequant_b32!(src, dst, BYTES, offset = false, |b| load_qs(b));
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (bw, ba) in w.chunks_exact(BYTES).zip(a.chunks_exact(BYTES)) {
            let d = _mm256_set1_ps(f16c_le(bw) * f16c_le(ba));
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
    use super::super::util::{f16_le, neon_b32::*};
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
    use crate::quant::util::testing::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_ggml_data() {
        let x = ggml_test_data(4096, 0.0);
        assert_rmse(&x, quantize, dequantize, BLOCK, BYTES, 0.002).unwrap();
        assert_rmse(&x, quantize_x86_avx, dequantize, BLOCK, BYTES, 0.002).unwrap();
    }

    #[test]
    fn vec_dot_ggml_data() {
        // test-quantize-fns' dot_product_error: |vec_dot - f32 dot| / n <= 0.02.
        let (x, y) = (ggml_test_data(4096, 0.0), ggml_test_data(4096, 1.0));
        let w = encode(&x, BLOCK, BYTES, quantize);
        let a = encode(&y, BLOCK, BYTES, quantize);
        let exact = dequant_dot(&x, &y).0;
        for dot in [vec_dot, vec_dot_scalar] {
            let err = (dot(&w, &a) as f64 - exact).abs() / 4096.0;
            assert!(err <= 0.02, "{err}");
        }
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
        fn simd_dequantize_is_bit_identical(src in blocks(BYTES, 1..9)) {
            assert_dequant_twins(&src, BLOCK, BYTES, dequantize, dequantize_scalar)?;
        }

        #[test]
        fn round_trip_random(x in ggml_like_floats()) {
            assert_rmse(&x, quantize, dequantize, BLOCK, BYTES, 0.002)?;
        }

        #[test]
        fn round_trip_any_scale(x in floats(BLOCK, 1..17)) {
            // Half a step, plus the f16 rounding of d spread over |q| <= 127.
            let e = max_rel_block_err(&x, quantize, dequantize, BLOCK, BYTES);
            prop_assert!(e <= (0.5 + 127.0 / 2048.0) / 127.0, "{}", e);
        }

        #[test]
        fn quantize_is_idempotent(x in floats(BLOCK, 1..17)) {
            assert_idempotent(&x, quantize, dequantize, BLOCK, BYTES)?;
        }

        #[test]
        fn vec_dot_integer_part_is_exact(mut w in blocks(BYTES, 1..17), seed in blocks(BYTES, 16..17)) {
            // Unit scales: every partial sum is an integer below 2^24, so both twins are exact.
            let mut a = seed[..w.len()].to_vec();
            set_scales(&mut w, BYTES, &[0], 1.0);
            set_scales(&mut a, BYTES, &[0], 1.0);
            let exact: i64 = w.chunks(BYTES).zip(a.chunks(BYTES))
                .flat_map(|(x, y)| x[2..].iter().zip(&y[2..]))
                .map(|(&p, &q)| p as i8 as i64 * q as i8 as i64)
                .sum();
            prop_assert_eq!(vec_dot_scalar(&w, &a), exact as f32);
            prop_assert_eq!(vec_dot(&w, &a), exact as f32);
        }

        #[test]
        fn vec_dot_twins_agree(mut w in blocks(BYTES, 1..33), seed in blocks(BYTES, 32..33)) {
            let mut a = seed[..w.len()].to_vec();
            finite_scales(&mut w, BYTES, &[0]);
            finite_scales(&mut a, BYTES, &[0]);
            let n = w.len() / BYTES * BLOCK;
            let (_, mag) = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, dequantize));
            let (f, s) = (vec_dot(&w, &a) as f64, vec_dot_scalar(&w, &a) as f64);
            prop_assert!((f - s).abs() <= sum_order_bound(n / BLOCK, mag), "{} vs {}", f, s);
        }

        #[test]
        fn vec_dot_matches_dequantized_dot(x in floats(BLOCK, 1..33), y in floats(BLOCK, 32..33)) {
            let w = encode(&x, BLOCK, BYTES, quantize);
            let a = encode(&y[..x.len()], BLOCK, BYTES, quantize);
            let n = x.len();
            let (exact, mag) = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, dequantize));
            for got in [vec_dot(&w, &a), vec_dot_scalar(&w, &a)] {
                prop_assert!((got as f64 - exact).abs() <= sum_order_bound(n / BLOCK, mag),
                    "{} vs {}", got, exact);
            }
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
