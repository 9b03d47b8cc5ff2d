//! The many-rows × many-tokens kernels for Q4_0 and Q8_0 weights against Q8_0 activations
//! (the prompt and decode matmuls' hot path): the activations' layout ([`TileAct`]), the
//! checks and fallback every such `vec_dot_tile` shares ([`run`]), and on x86 the driver that
//! walks row groups and token pairs plus the one [`tile_kernels!`] that stamps out a format's
//! AVX2 and AVX-VNNI kernels from its three per-block steps.
//!
//! This is the floor below the formats that have tile kernels (`q4_0.rs`, `q8_0.rs` use it):
//! it reads Q8_0's block size and activation quantizer from the table, never from `q8_0.rs`.

#[cfg(target_arch = "x86_64")]
use super::cpu::{Simd, simd};
use super::ggml::f16_le;
use super::{Dot, GgmlType};

/// Q8_0's block: 32 quants after an f16 scale.
const BLOCK: usize = GgmlType::Q8_0.format().block;
const BYTES: usize = GgmlType::Q8_0.format().bytes;

/// One activation block as the tile kernels read it (64 bytes, one cache line): the 32 quants,
/// then `−8·(q[4k] + … + q[4k+3])` for k in 0..8 (the term that turns Q4_0's unsigned nibbles
/// into `q − 8`; negative so that it can be `vpdpbusd`'s starting value).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct TileBlock {
    pub(crate) q: [i8; 32],
    pub(crate) neg_bias: [i32; 8],
}

/// Eight lanes of one f32, 32-byte aligned.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub struct Lanes(pub(crate) [f32; 8]);

/// Activation rows quantized to Q8_0 exactly as `q8_0::quantize_x86_avx` does, kept as plain Q8_0
/// rows and also re-laid out for the multi-row kernels (`q8_0::vec_dot_tile`, `q4_0::vec_dot_tile`):
/// per block a [`TileBlock`] and the scale as an f32. Buffers only grow, so refilling one per
/// matmul allocates nothing in steady state.
#[derive(Default)]
pub struct TileAct {
    /// Elements per row.
    n: usize,
    rows: usize,
    q8: Vec<u8>,
    pub(crate) blocks: Vec<TileBlock>,
    pub(crate) d: Vec<f32>,
    /// The scales again, each in 8 lanes (see `x86::Unpacked` for why).
    pub(crate) d8: Vec<Lanes>,
    /// Some quant is -128 (the Q8_0 × Q8_0 tile kernel's sign trick cannot take it).
    pub(crate) has_min: bool,
}

impl TileAct {
    /// Quantize the rows of `x` (each `n` elements, `n` a multiple of 32).
    pub fn quantize(&mut self, x: &[f32], n: usize) {
        self.resize(x.len() / n.max(1), n);
        let rb = n / BLOCK * BYTES;
        for (x, q) in x.chunks_exact(n).zip(self.q8.chunks_exact_mut(rb)) {
            // Q8_0's `from_float`: `q8_0::quantize_x86_avx`.
            (GgmlType::Q8_0.format().from_float)(x, q);
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

/// A format's tile driver: `(w, rows, activations, out)`; sizes checked by [`run`].
#[cfg(target_arch = "x86_64")]
pub(crate) type Driver = unsafe fn(&[u8], usize, &TileAct, &mut [f32]);
#[cfg(not(target_arch = "x86_64"))]
pub(crate) type Driver = fn(&[u8], usize, &TileAct, &mut [f32]);

/// Every `vec_dot_tile` over [`TileAct`]: `out[r * a.rows() + t] = dot(w_r, a_t)` for the whole
/// weight rows `w_r` of `w` (`wbytes`-byte blocks) and every activation row `a_t`. Runs
/// `kernels` (AVX2, AVX-VNNI) where the CPU has AVX2, the VNNI one when `vnni` and the CPU
/// has it; otherwise `dot` per (row, token).
pub(crate) fn run(
    wbytes: usize,
    vnni: bool,
    w: &[u8],
    a: &TileAct,
    out: &mut [f32],
    kernels: Option<[Driver; 3]>,
    dot: Dot,
) {
    let rb = a.n / BLOCK * wbytes;
    assert!(
        rb > 0 && w.len().is_multiple_of(rb),
        "tile: whole weight rows"
    );
    let nr = w.len() / rb;
    assert_eq!(out.len(), nr * a.rows, "tile: output is rows × tokens");
    #[cfg(target_arch = "x86_64")]
    if let (Some([avx2, with_vnni, with_vnni512]), Simd::Avx2) = (kernels, simd()) {
        let k = match (vnni, crate::cpu::vnni()) {
            (true, Some(crate::cpu::Vnni::Avx)) => with_vnni,
            (true, Some(crate::cpu::Vnni::Avx512)) => with_vnni512,
            _ => avx2,
        };
        // SAFETY: avx2, fma and f16c are present (and the VNNI extension `cpu::vnni` found,
        // where used); sizes were checked above.
        unsafe { k(w, nr, a, out) };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (vnni, kernels);
    for (wr, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(a.rows)) {
        for (t, o) in o.iter_mut().enumerate() {
            *o = dot(wr, a.q8_row(t));
        }
    }
}

/// The exact dot's ending (the tile kernels' f64 mode and the formats' `vec_dot_exact_scalar`):
/// the four lane sums added in one fixed order, then rounded to f32 once.
pub(crate) fn finish_f64(l: [f64; 4]) -> f32 {
    ((l[0] + l[2]) + (l[1] + l[3])) as f32
}

/// The scalar twin of the f64 tile kernels, for a format whose weight block gives its 32
/// quants in element order (`quants`, as i32) and its scale in its first two bytes (f16):
/// per block, lane k is the exact `Σ w·a` over elements 4k..4k+4 and 4k+16..4k+20, added to
/// an f64 lane sum as `(d_w · d_a) · lane` (an exact product, so one rounding per add, as the
/// kernels' FMA), then [`finish_f64`]. Differs from the exact sum only by the f64 adds (about
/// 1e-16 relative).
pub(crate) fn exact_dot_scalar(
    w: &[u8],
    a: &[u8],
    wbytes: usize,
    quants: impl Fn(&[u8]) -> [i32; 32],
) -> f32 {
    let mut acc = [0f64; 4];
    for (bw, ba) in w.chunks_exact(wbytes).zip(a.chunks_exact(BYTES)) {
        let q = quants(bw);
        let d = (f16_le(bw) * f16_le(ba)) as f64;
        for (k, acc) in acc.iter_mut().enumerate() {
            let lane: i32 = (4 * k..4 * k + 4)
                .chain(4 * k + 16..4 * k + 20)
                .map(|j| q[j] * ba[2 + j] as i8 as i32)
                .sum();
            *acc += d * lane as f64;
        }
    }
    finish_f64(acc)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::super::x86::*;
    use super::{BYTES, TileBlock};
    use std::arch::x86_64::*;

    /// [`TileAct`]'s layout from plain Q8_0 blocks; returns whether some quant is -128.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn relayout(q8: &[u8], blocks: &mut [TileBlock], d: &mut [f32]) -> bool {
        let (ones8, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
        let mut min = _mm256_setzero_si256();
        for ((b, t), d) in q8.chunks_exact(BYTES).zip(blocks).zip(d) {
            *d = f16c_at(b);
            let y = load_u8x32(&b[2..]);
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
    pub(crate) unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees 2 readable bytes.
        let bits = unsafe { p.cast::<u16>().read_unaligned() };
        f16c_bits(bits)
    }

    /// f32 of every f16 bit pattern (256 KiB, built once with F16C). In the one-token tiles a
    /// weight scale then costs two loads, where `vcvtph2ps` and its broadcast would take the
    /// shuffle port that the nibble unpacking needs too. Weight scales take few distinct values,
    /// so the entries in use stay in L1.
    pub(crate) fn f16_table() -> &'static [f32] {
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
    pub(crate) unsafe fn scale_from(table: &[f32], wb: *const u8) -> f32 {
        // SAFETY: the caller guarantees 2 readable bytes; a u16 indexes the 65536-entry table.
        unsafe { *table.get_unchecked(wb.cast::<u16>().read_unaligned() as usize) }
    }

    /// A weight block made ready for many tokens (one cache line): its 32 quants as bytes
    /// (Q8_0's signed ones, or Q4_0's nibbles 0..15 in element order) and its scale in all 8
    /// lanes. A vector of scales (rather than one to broadcast) keeps `d_w * d_a` a vector
    /// multiply: two broadcasts would be folded into a scalar multiply and a shuffle per token.
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    pub(crate) struct Unpacked {
        pub q: [u8; 32],
        pub d: [f32; 8],
    }

    thread_local! {
        /// Per thread: the row group being multiplied, unpacked ([block][row]).
        static UNPACKED: std::cell::RefCell<Vec<Unpacked>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// `f(buffer of at least n unpacked blocks)`, with this thread's buffer (grown, never shrunk).
    pub(crate) fn with_unpacked<T>(n: usize, f: impl FnOnce(&mut [Unpacked]) -> T) -> T {
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
    pub(crate) const R: usize = 4;
    pub(crate) const C: usize = 2;
    /// How far ahead (bytes) of the block in use a one-token (memory-bound) tile asks for
    /// weights. The hardware prefetcher alone leaves a core at about half its streaming rate;
    /// 16 KiB ahead measured best (4 KiB: -10%, 32 KiB: the same) on a 2-core Xeon.
    pub(crate) const PREFETCH: usize = 16384;

    /// A weight format's tile kernels, stamped out in its `x86` module from its three per-block
    /// steps: `$weights(wb)`, the 32 quants of the block at `wb` as the bytes the kernel
    /// multiplies (also what the prompt path unpacks once per row group); `$prepare(x)`, any
    /// per-weight-block work done once before the token loop; `$avx2(x, prepared, y)`,
    /// `$vnni(...)` and `$vnni512(...)`, the exact i32 lanes `Σ w·y` over elements 4k..4k+4
    /// against the activation block `y` ([`TileBlock`]), with AVX2, AVX-VNNI and AVX512-VNNI
    /// (the same `vpdpbusd` on 256 bits, EVEX-encoded). Defines `vec_dot_tile`,
    /// `vec_dot_tile_vnni` and `vec_dot_tile_vnni512`, and their `_f64` twins
    /// ([`super::Driver`]s). Per (row, token) the float arithmetic is the
    /// format's AVX2 `vec_dot`'s: one FMA of `d_w * d_a` per block into 8 lanes, `hsum_f32x8`
    /// at the end, so the results are the same bits. The caller's module provides `BLOCK` and
    /// `BYTES`.
    macro_rules! tile_kernels {
        (weights: $weights:ident, prepare: $prepare:ident, avx2: $avx2:ident, vnni: $vnni:ident, vnni512: $vnni512:ident) => {
            $crate::tile::x86::tile_kernels!(@isa "avx2,fma,f16c", f32, $weights, $prepare, $avx2, vec_dot_tile, tile);
            $crate::tile::x86::tile_kernels!(@isa "avx2,fma,f16c,avxvnni", f32, $weights, $prepare, $vnni, vec_dot_tile_vnni, tile_vnni);
            $crate::tile::x86::tile_kernels!(@isa "avx2,fma,f16c,avx512vnni,avx512vl", f32, $weights, $prepare, $vnni512, vec_dot_tile_vnni512, tile_vnni512);
            $crate::tile::x86::tile_kernels!(@isa "avx2,fma,f16c", f64, $weights, $prepare, $avx2, vec_dot_tile_f64, tile_f64);
            $crate::tile::x86::tile_kernels!(@isa "avx2,fma,f16c,avxvnni", f64, $weights, $prepare, $vnni, vec_dot_tile_f64_vnni, tile_f64_vnni);
            $crate::tile::x86::tile_kernels!(@isa "avx2,fma,f16c,avx512vnni,avx512vl", f64x, $weights, $prepare, $vnni512, vec_dot_tile_f64_vnni512, tile_f64_vnni512);

            /// The R rows at `w` into `u` ([block][row]).
            ///
            /// # Safety
            /// `w` holds R rows of `wrow` bytes (nb blocks); `u` has room for R·nb blocks.
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn unpack<const R: usize>(w: *const u8, wrow: usize, nb: usize, u: *mut $crate::tile::x86::Unpacked) {
                use $crate::tile::x86::f16_at;
                for b in 0..nb {
                    for r in 0..R {
                        // SAFETY: in bounds by the caller's promise.
                        unsafe {
                            let wb = w.add(r * wrow + b * BYTES);
                            let u = &mut *u.add(b * R + r);
                            _mm256_store_si256(u.q.as_mut_ptr().cast(), $weights(wb));
                            _mm256_store_ps(u.d.as_mut_ptr(), _mm256_set1_ps(f16_at(wb)));
                        }
                    }
                }
            }
        };
        // The accumulators: f32 (ggml's arithmetic) or f64 (exact products, `super::finish_f64`).
        // Rows and tokens per tile: f64 lanes take twice the registers.
        (@rows f32) => { $crate::tile::x86::R };
        (@cols f32) => { $crate::tile::x86::C };
        (@rows f64) => { 2 };
        (@cols f64) => { 2 };
        // f64 with AVX-512's 32 vector registers: four rows fit without spilling.
        (@rows f64x) => { 4 };
        (@cols f64x) => { 2 };
        (@zero f32) => { _mm256_setzero_ps() };
        (@zero f64) => { _mm256_setzero_pd() };
        (@zero f64x) => { _mm256_setzero_pd() };
        (@add f64x, $acc:expr, $d:expr, $p:expr) => { $crate::tile::x86::tile_kernels!(@add f64, $acc, $d, $p) };
        (@finish f64x, $acc:expr) => { $crate::tile::x86::tile_kernels!(@finish f64, $acc) };
        (@add f32, $acc:expr, $d:expr, $p:expr) => { _mm256_fmadd_ps($d, _mm256_cvtepi32_ps($p), $acc) };
        (@add f64, $acc:expr, $d:expr, $p:expr) => {{
            // Lanes k and k + 4 folded (exact: at most 8 · 128 · 127); `d_w * d_a` of two f16
            // values is exact in f32 (all 8 lanes alike), its product with a folded lane exact
            // in f64: each lane's sum rounds once per block.
            let p = $p;
            let s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256::<1>(p));
            _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128($d)), _mm256_cvtepi32_pd(s), $acc)
        }};
        (@finish f32, $acc:expr) => { hsum_f32x8($acc) };
        (@finish f64, $acc:expr) => {{
            let mut l = [0f64; 4];
            _mm256_storeu_pd(l.as_mut_ptr(), $acc);
            $crate::tile::finish_f64(l)
        }};
        (@isa $features:literal, $mode:tt, $weights:ident, $prepare:ident, $lanes:ident, $driver:ident, $tile:ident) => {
            /// Groups of R weight rows: for one token (decode) straight from the weights, for
            /// several (prompt) unpacked once into the per-thread buffer and then swept C
            /// tokens at a time; tail rows one by one.
            #[target_feature(enable = $features)]
            pub unsafe fn $driver(w: &[u8], nr: usize, a: &$crate::TileAct, out: &mut [f32]) {
                use $crate::tile::x86::with_unpacked;
                const R: usize = $crate::tile::x86::tile_kernels!(@rows $mode);
                const C: usize = $crate::tile::x86::tile_kernels!(@cols $mode);
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
                                $tile::<1, 1, false>(wp.add(r * wrow), wrow, u, a, t, op.add(r * nt), nt);
                            }
                        }
                    }
                })
            }

            /// R weight rows (`wrow` bytes apart from `w`, or unpacked in `u`) × activation rows
            /// t0..t0+C, into `out[r * ldo + t]`.
            #[inline]
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn $tile<const R: usize, const C: usize, const UNPACKED: bool>(
                w: *const u8,
                wrow: usize,
                u: *const $crate::tile::x86::Unpacked,
                a: &$crate::TileAct,
                t0: usize,
                out: *mut f32,
                ldo: usize,
            ) {
                use $crate::tile::x86::{PREFETCH, f16_table, scale_from};
                let nb = a.n() / BLOCK;
                let (ys, ds, d8) = (a.blocks.as_ptr(), a.d.as_ptr(), a.d8.as_ptr());
                let table = f16_table();
                let mut acc = [[$crate::tile::x86::tile_kernels!(@zero $mode); C]; R];
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
                                ($weights(wb), _mm256_set1_ps(scale_from(table, wb)))
                            };
                            let px = $prepare(x);
                            for (c, acc) in acc.iter_mut().enumerate() {
                                let i = (t0 + c) * nb + b;
                                let p = $lanes(x, px, &*ys.add(i));
                                let da = if UNPACKED {
                                    _mm256_set1_ps(*ds.add(i))
                                } else {
                                    _mm256_load_ps((*d8.add(i)).0.as_ptr())
                                };
                                let d = _mm256_mul_ps(dw, da);
                                *acc = $crate::tile::x86::tile_kernels!(@add $mode, *acc, d, p);
                            }
                        }
                    }
                }
                for (r, acc) in acc.iter().enumerate() {
                    for (c, &acc) in acc.iter().enumerate() {
                        // SAFETY: (r, t0 + c) is inside the caller's output.
                        unsafe { *out.add(r * ldo + t0 + c) = $crate::tile::x86::tile_kernels!(@finish $mode, acc) };
                    }
                }
            }
        };
    }
    pub(crate) use tile_kernels;
}
