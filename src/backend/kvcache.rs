//! The K/V cache an engine keeps, and the arithmetic around it: what the reference emulates so
//! that an engine with an f16 or a quantized cache (llama.cpp's `-ctk/-ctv`), or with flash
//! attention, is held to its own cache's rounding and not to f32's.
//!
//! Two ways of keeping a quantized cache are modelled, because engines do both:
//! - plain: each stored row (a position's K or V over the KV heads) rounded to the type, then
//!   read back as f32 (what a hand-written engine with an int8 cache does);
//! - llama.cpp's (`ggml`): q and k rotated by a Walsh–Hadamard matrix before a quantized K is
//!   stored (v likewise, the attention output rotated back), q converted to the type K is dotted
//!   with (f16, or Q8_0 for a quantized K), the probabilities to V's (f16) without flash
//!   attention, and with flash attention an f16 V accumulated in f16 (ggml's CPU kernel).

use crate::gguf::GgmlType;
use crate::quant;
use half::f16;

/// How a plain Q8_0 cache rounds its rows to their grid. Engines write this quantizer their
/// own way, and the ways differ on exact ties, which are common where the K/V projections
/// accumulate in f16 (their outputs sit on a coarse grid: an element at half its block's
/// step). The judge replays the others as the cache's tie twins ([`KvCache::tie_twins`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Quantizer {
    /// ggml's CPU backend (x86 `quantize_row_q8_0`): `127 / max|x|`, ties to even.
    #[default]
    Ggml,
    /// ggml's `quantize_row_q8_0_ref`: `1 / (max|x| / 127)`, ties away from zero.
    Reference,
    /// `1 / (max|x| / 127)`, ties to even (numpy's `rint` over ggml's formula).
    InverseEven,
}

/// How one cache (K or V) stores its rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CacheType {
    #[default]
    F32,
    F16,
    Q8_0,
    Q4_0,
}

impl CacheType {
    pub const ALL: [CacheType; 4] = [
        CacheType::F32,
        CacheType::F16,
        CacheType::Q8_0,
        CacheType::Q4_0,
    ];

    /// llama.cpp's name (`-ctk q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
        }
    }

    pub fn parse(s: &str) -> Option<CacheType> {
        CacheType::ALL.into_iter().find(|t| t.name() == s)
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            CacheType::F32 => GgmlType::F32,
            CacheType::F16 => GgmlType::F16,
            CacheType::Q8_0 => GgmlType::Q8_0,
            CacheType::Q4_0 => GgmlType::Q4_0,
        }
    }

    pub fn quantized(self) -> bool {
        matches!(self, CacheType::Q8_0 | CacheType::Q4_0)
    }

    /// Whether a row of `n` values can be stored (whole blocks).
    pub fn fits(self, n: usize) -> bool {
        n.is_multiple_of(self.ggml().block_size())
    }

    /// Round `row` as the cache stores it and reads it back. A row that is not whole blocks
    /// is left as it is (callers check [`CacheType::fits`] first).
    pub fn store(self, row: &mut [f32]) {
        self.store_as(Quantizer::Ggml, row)
    }

    /// [`CacheType::store`] with a Q8_0 cache's rows rounded by `q`.
    pub fn store_as(self, q: Quantizer, row: &mut [f32]) {
        match (self, q) {
            (CacheType::F32, _) => {}
            (CacheType::Q8_0, Quantizer::Reference) => {
                round_trip(GgmlType::Q8_0, row, quant::q8_0::quantize)
            }
            (CacheType::Q8_0, Quantizer::InverseEven) => {
                round_trip(GgmlType::Q8_0, row, quant::q8_0::quantize_inverse_even)
            }
            _ => round_to(self.ggml(), row),
        }
    }

    /// The type ggml converts the other operand of a dot with this cache to (its
    /// `vec_dot_type`): f16 for f16, Q8_0 for the quantized types; none for f32.
    pub fn dot_type(self) -> Option<GgmlType> {
        match self {
            CacheType::F32 => None,
            CacheType::F16 => Some(GgmlType::F16),
            CacheType::Q8_0 | CacheType::Q4_0 => Some(GgmlType::Q8_0),
        }
    }
}

/// `row` quantized to `ty` by `quantize`, then decoded (a row that is not whole blocks is left
/// as it is).
fn round_trip(ty: GgmlType, row: &mut [f32], quantize: impl Fn(&[f32], &mut [u8])) {
    if !row.len().is_multiple_of(ty.block_size()) {
        return;
    }
    let mut q = vec![0u8; row.len() / ty.block_size() * ty.type_size()];
    quantize(row, &mut q);
    quant::dequantize_row(ty, &q, row).expect("sized from the row");
}

/// Round `x` to `ty` (f16, Q8_0, Q4_0) in place, as ggml converts a matmul operand or stores
/// a cache row (f16: round to nearest even, as ggml's and numpy's conversions do).
fn round_to(ty: GgmlType, x: &mut [f32]) {
    match ty {
        GgmlType::F16 => x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32()),
        // As ggml's CPU backend quantizes at run time (`from_float`).
        t => round_trip(t, x, |r, q| quant::quantize_activation(t, r, q)),
    }
}

/// The K/V cache an engine keeps and how it computes attention around it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KvCache {
    pub k: CacheType,
    pub v: CacheType,
    /// llama.cpp's arithmetic (see the module's note): the other operand of each dot
    /// converted to the cache's dot type, quantized caches stored rotated.
    pub ggml: bool,
    /// Flash attention (with `ggml`: ggml's CPU kernel, an f16 V accumulated in f16).
    pub flash: bool,
    /// llama.cpp's thread count, where more than one: with flash attention a one-token decode
    /// over a padded cache of 512 cells or more is split into one chunk per thread, each
    /// accumulated on its own and the partials reduced in chunk order (0: one pass).
    pub threads: u16,
    /// How a plain Q8_0 cache rounds its rows (ggml's, but in the judge's tie twins).
    pub quantizer: Quantizer,
}

impl KvCache {
    pub const F32: KvCache = KvCache::plain(CacheType::F32);
    pub const F16: KvCache = KvCache::plain(CacheType::F16);

    /// Both caches of type `t`, read back as f32 and dotted in f32.
    pub const fn plain(t: CacheType) -> KvCache {
        KvCache {
            k: t,
            v: t,
            ggml: false,
            flash: false,
            threads: 0,
            quantizer: Quantizer::Ggml,
        }
    }

    /// llama.cpp's cache with `-ctk k -ctv v` and flash attention on or off.
    pub const fn llama_cpp(k: CacheType, v: CacheType, flash: bool) -> KvCache {
        KvCache {
            k,
            v,
            ggml: true,
            flash,
            threads: 0,
            quantizer: Quantizer::Ggml,
        }
    }

    /// The caches the judge tries on an engine that does not say which it keeps: f32, f16
    /// (plain and as llama.cpp's defaults compute it), and the quantized types: plain where a
    /// position's row (`n_embd_kv`, every KV head) is whole blocks, as llama.cpp with flash
    /// attention keeps them where each head is (llama.cpp refuses a quantized cache otherwise).
    pub fn candidates(head_dim: usize, n_embd_kv: usize) -> Vec<KvCache> {
        let mut v = vec![
            KvCache::F32,
            KvCache::F16,
            KvCache::llama_cpp(CacheType::F16, CacheType::F16, true),
        ];
        for t in [CacheType::Q8_0, CacheType::Q4_0] {
            if t.fits(n_embd_kv) {
                v.push(KvCache::plain(t));
            }
            if t.fits(head_dim) {
                v.push(KvCache::llama_cpp(t, t, true));
            }
        }
        v
    }

    /// The other caches to try where the measured one may be wrong (a bug that moves
    /// attention more than any cache's rounding can mislead the measurement).
    pub fn alternatives(self, head_dim: usize, n_embd_kv: usize) -> Vec<KvCache> {
        KvCache::candidates(head_dim, n_embd_kv)
            .into_iter()
            .filter(|&c| c != self)
            .collect()
    }

    /// The same cache under the other ways engines round a plain Q8_0 cache (none for other
    /// caches, nor for llama.cpp's, whose quantizer is ggml's).
    pub fn tie_twins(self) -> Vec<KvCache> {
        let q8 = self.k == CacheType::Q8_0 || self.v == CacheType::Q8_0;
        if self.ggml || !q8 {
            return Vec::new();
        }
        [
            Quantizer::Ggml,
            Quantizer::Reference,
            Quantizer::InverseEven,
        ]
        .into_iter()
        .filter(|&q| q != self.quantizer)
        .map(|quantizer| KvCache { quantizer, ..self })
        .collect()
    }

    /// What a user reads: `f16`, `q8_0`, `K q8_0 / V f16`, then how it is computed
    /// (`, llama.cpp's arithmetic`, `, flash attention`).
    pub fn name(&self) -> String {
        let mut s = if self.k == self.v {
            self.k.name().to_string()
        } else {
            format!("K {} / V {}", self.k.name(), self.v.name())
        };
        if self.ggml {
            s.push_str(", llama.cpp's arithmetic");
        }
        if self.flash {
            s.push_str(", flash attention");
        }
        match self.quantizer {
            Quantizer::Ggml => {}
            Quantizer::Reference => s.push_str(", rounded as ggml's reference quantizer"),
            Quantizer::InverseEven => s.push_str(", rounded by 1/(max/127) to even"),
        }
        // Threads matter only to flash attention's split decode.
        if self.flash && self.threads > 1 {
            s.push_str(&format!(" on {} threads", self.threads));
        }
        s
    }

    /// `f32`, `f16`, `q8_0`, `q4_0` (both caches), `K/V` (`q8_0/f16`), each optionally
    /// followed by `+ggml` (llama.cpp's arithmetic) and `+fa` (flash attention).
    pub fn parse(s: &str) -> Option<KvCache> {
        let mut parts = s.split('+');
        let types = parts.next()?;
        let (k, v) = match types.split_once('/') {
            Some((k, v)) => (CacheType::parse(k)?, CacheType::parse(v)?),
            None => {
                let t = CacheType::parse(types)?;
                (t, t)
            }
        };
        let mut kv = KvCache {
            k,
            v,
            ggml: false,
            flash: false,
            threads: 0,
            quantizer: Quantizer::Ggml,
        };
        for p in parts {
            match p {
                "ggml" => kv.ggml = true,
                "fa" => kv.flash = true,
                _ => return None,
            }
        }
        Some(kv)
    }

    /// The cache a llama.cpp golden says it was made with (`type_k`, `type_v`, and flash
    /// attention as resolved); None when the settings do not say, or name another type.
    pub fn from_llama_settings(s: &serde_json::Value) -> Option<KvCache> {
        let k = CacheType::parse(s.get("type_k")?.as_str()?)?;
        let v = CacheType::parse(s.get("type_v")?.as_str()?)?;
        let flash = match s.get("flash_attn_resolved").and_then(|v| v.as_bool()) {
            Some(b) => b,
            None => match s.get("flash_attn")? {
                serde_json::Value::Bool(b) => *b,
                serde_json::Value::String(x) if x == "enabled" => true,
                serde_json::Value::String(x) if x == "disabled" => false,
                // "auto" without the resolved value: not known.
                _ => return None,
            },
        };
        // A one-token decode runs on `n_threads` (the prompt on `n_threads_batch`).
        let threads = s.get("n_threads").and_then(|t| t.as_u64()).unwrap_or(1);
        Some(KvCache {
            threads: threads.min(u16::MAX as u64) as u16,
            ..KvCache::llama_cpp(k, v, flash)
        })
    }

    /// The size of the Walsh–Hadamard rotation llama.cpp applies to q and K before a
    /// quantized K is stored (the largest power of two dividing the head size), if any.
    pub fn k_rotation(&self, head_dim: usize) -> Option<usize> {
        (self.ggml && self.k.quantized() && head_dim.is_multiple_of(64))
            .then(|| 1 << head_dim.trailing_zeros())
    }

    /// The rotation applied to V (and back to the attention output): always 64 wide.
    pub fn v_rotation(&self, head_dim: usize) -> Option<usize> {
        (self.ggml && self.v.quantized() && head_dim.is_multiple_of(64)).then_some(64)
    }

    /// Whether a micro-batch of `rows` query rows takes ggml's tiled CPU flash-attention
    /// kernel (64 rows or more over an f16/f32 cache): f32 q against the decoded cache, an f32
    /// accumulator, as the plain reference computes it. Fewer rows, or a quantized cache, take
    /// the one-row kernel (q converted to K's dot type, an f16 V accumulated in f16).
    fn tiled(&self, rows: usize) -> bool {
        self.ggml && self.flash && !self.k.quantized() && !self.v.quantized() && rows >= 64
    }

    /// Whether the values of a micro-batch of `rows` rows are accumulated in f16 (ggml's
    /// one-row CPU flash-attention kernel over an f16 V).
    pub fn f16_accumulator(&self, rows: usize) -> bool {
        self.ggml && self.flash && self.v == CacheType::F16 && !self.tiled(rows)
    }

    /// The chunk length ggml's CPU flash attention splits a decode step over: a one-token
    /// step, an f16/f32 cache of one type, a cache padded (to 256 cells, as llama.cpp pads it)
    /// to 512 cells or more, and more than one thread. None: one pass.
    pub fn split_chunk(&self, rows: usize, n_kv: usize) -> Option<usize> {
        let padded = n_kv.div_ceil(256) * 256;
        (self.ggml
            && self.flash
            && rows == 1
            && self.threads > 1
            && self.k == self.v
            && !self.k.quantized()
            && padded >= 512)
            .then(|| padded.div_ceil(self.threads as usize))
    }

    /// Round the query head `q` as the engine dots it with K (after any rotation), in a
    /// micro-batch of `rows` rows.
    pub fn round_query(&self, q: &mut [f32], rows: usize) {
        if self.ggml
            && !self.tiled(rows)
            && let Some(t) = self.k.dot_type()
        {
            round_to(t, q);
        }
    }

    /// Round a row of probabilities as the engine multiplies it with V (without flash
    /// attention ggml converts them to an f16 V's type; a quantized V needs flash attention).
    pub fn round_probs(&self, p: &mut [f32]) {
        if self.ggml && !self.flash && self.v == CacheType::F16 {
            round_to(GgmlType::F16, p);
        }
    }
}

/// The orthonormal Walsh–Hadamard matrix of size `n` (a power of two), row-major, built as
/// llama.cpp builds its KV rotation (Sylvester's construction from 1/sqrt(n)); it is symmetric
/// and its own inverse.
pub fn hadamard(n: usize) -> Vec<f32> {
    let mut h = vec![0.0f32; n * n];
    h[0] = 1.0 / (n as f32).sqrt();
    let mut s = 1;
    while s < n {
        for i in 0..s {
            for j in 0..s {
                let v = h[i * n + j];
                h[(i + s) * n + j] = v;
                h[i * n + j + s] = v;
                h[(i + s) * n + j + s] = -v;
            }
        }
        s *= 2;
    }
    h
}

/// `x` (whole chunks of `n`) with each chunk multiplied by the `n`×`n` matrix `h`, in f32 as
/// ggml's matmul computes it (the sum's order is f32 noise).
pub fn rotate(h: &[f32], n: usize, x: &mut [f32]) {
    let mut tmp = vec![0.0f32; n];
    for chunk in x.chunks_exact_mut(n) {
        for (i, t) in tmp.iter_mut().enumerate() {
            let row = &h[i * n..][..n];
            *t = row
                .iter()
                .zip(chunk.iter())
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32;
        }
        chunk.copy_from_slice(&tmp);
    }
}

/// ggml's CPU flash-attention accumulation for one query row over an f16 V: the online softmax
/// over `scores` (visible positions, in cache order), each V row (lent by `with_row(j, f)`)
/// added into an f16 accumulator (`y = f16(fma(v, w, y))`), rescaled in f16 when the running
/// maximum rises. Cells are taken in chunks of `chunk` (ggml's split-KV decode: one chunk per
/// thread; `usize::MAX`: one pass), each accumulated on its own, the partials reduced in chunk
/// order in f32 and divided by the running sum at the end.
pub fn flash_f16(
    scores: &[(usize, f32)],
    chunk: usize,
    mut with_row: impl FnMut(usize, &mut dyn FnMut(&[f32])),
    out: &mut [f32],
) {
    let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);
    let mut acc = vec![0.0f32; out.len()];
    for part in scores.chunk_by(|a, b| a.0 / chunk == b.0 / chunk) {
        let (mc, sc, vc) = flash_f16_partial(part, &mut with_row, out.len());
        if mc == f32::NEG_INFINITY {
            continue;
        }
        // One chunk: scale 0 for the empty start, 1 for the chunk, the accumulator as it is.
        let mn = m.max(mc);
        let (so, sn) = ((m - mn).exp(), (mc - mn).exp());
        for (a, v) in acc.iter_mut().zip(&vc) {
            *a = *a * so + v * sn;
        }
        s = s * so + sc * sn;
        m = mn;
    }
    let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = a * inv;
    }
}

/// One chunk's running maximum, running sum and f16 accumulator (as f32, not yet divided).
fn flash_f16_partial(
    scores: &[(usize, f32)],
    mut with_row: impl FnMut(usize, &mut dyn FnMut(&[f32])),
    n: usize,
) -> (f32, f32, Vec<f32>) {
    let mut acc = vec![f16::ZERO; n];
    let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);
    for &(j, sc) in scores {
        let (mut ms, mut vs) = (1.0f32, 1.0f32);
        if sc > m {
            let old = m;
            m = sc;
            ms = (old - m).exp();
            acc.iter_mut()
                .for_each(|a| *a = f16::from_f32(a.to_f32() * ms));
        } else {
            vs = (sc - m).exp();
        }
        with_row(j, &mut |row: &[f32]| {
            for (a, &x) in acc.iter_mut().zip(row) {
                *a = f16::from_f32(x.mul_add(vs, a.to_f32()));
            }
        });
        s = s * ms + vs;
    }
    (m, s, acc.iter().map(|a| a.to_f32()).collect())
}

/// Written as its name (`f16`, `q8_0, llama.cpp's arithmetic, flash attention`).
impl serde::Serialize for KvCache {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three Q8_0 quantizers differ on ties only, each as its formula says; a plain Q8_0
    /// cache has the two others as tie twins, llama.cpp's and unquantized caches none.
    #[test]
    fn a_plain_q8_0_cache_s_quantizers_differ_on_ties() {
        // max 127: scale 1 under every formula; 2.5 is a tie (to even: 2, away: 3).
        let mut row = vec![0.0f32; 32];
        row[0] = 127.0;
        row[1] = 2.5;
        let stored = |q: Quantizer| {
            let mut r = row.clone();
            CacheType::Q8_0.store_as(q, &mut r);
            r[1]
        };
        assert_eq!(stored(Quantizer::Ggml), 2.0);
        assert_eq!(stored(Quantizer::InverseEven), 2.0);
        assert_eq!(stored(Quantizer::Reference), 3.0);
        let twins = KvCache::plain(CacheType::Q8_0).tie_twins();
        let qs: Vec<Quantizer> = twins.iter().map(|t| t.quantizer).collect();
        assert_eq!(qs, [Quantizer::Reference, Quantizer::InverseEven]);
        assert!(twins.iter().all(|t| t.k == CacheType::Q8_0 && !t.ggml));
        assert!(
            twins[1].name().ends_with("1/(max/127) to even"),
            "{}",
            twins[1].name()
        );
        assert!(KvCache::F32.tie_twins().is_empty());
        assert!(KvCache::F16.tie_twins().is_empty());
        let ggml = KvCache::llama_cpp(CacheType::Q8_0, CacheType::Q8_0, true);
        assert!(ggml.tie_twins().is_empty());
    }

    #[test]
    fn hadamard_is_orthonormal_and_its_own_inverse() {
        for n in [64, 128] {
            let h = hadamard(n);
            let mut x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let orig = x.clone();
            rotate(&h, n, &mut x);
            assert!(x.iter().zip(&orig).any(|(a, b)| (a - b).abs() > 1e-3));
            rotate(&h, n, &mut x);
            for (a, b) in x.iter().zip(&orig) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn names_parse_back() {
        for kv in KvCache::candidates(64, 128) {
            let spelled = format!(
                "{}/{}{}{}",
                kv.k.name(),
                kv.v.name(),
                if kv.ggml { "+ggml" } else { "" },
                if kv.flash { "+fa" } else { "" }
            );
            assert_eq!(KvCache::parse(&spelled), Some(kv), "{spelled}");
        }
        assert_eq!(
            KvCache::parse("q8_0"),
            Some(KvCache::plain(CacheType::Q8_0))
        );
        assert_eq!(KvCache::parse("q8_0+rot"), None);
        assert_eq!(KvCache::parse("q5_1"), None);
        // llama.cpp's quantized cache needs whole blocks per head, a plain one per position.
        assert_eq!(KvCache::candidates(16, 16).len(), 3);
        assert_eq!(
            KvCache::candidates(16, 64)[3..],
            [
                KvCache::plain(CacheType::Q8_0),
                KvCache::plain(CacheType::Q4_0)
            ]
        );
    }

    #[test]
    fn quantized_rows_are_on_their_grid() {
        let mut r: Vec<f32> = (0..64).map(|i| (i as f32 * 0.1).cos()).collect();
        let before = r.clone();
        CacheType::Q8_0.store(&mut r);
        let err: f32 = r
            .iter()
            .zip(&before)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err > 0.0 && err < 1.0 / 127.0, "{err}");
        let again = r.clone();
        CacheType::Q8_0.store(&mut r);
        assert_eq!(r, again, "a stored row stores as itself");
    }

    #[test]
    fn the_f16_flash_accumulator_is_softmax_weighted_values() {
        let scores: Vec<(usize, f32)> = vec![(0, 0.5), (1, 2.0), (2, -1.0), (3, 1.5)];
        let rows: Vec<Vec<f32>> = (0..4)
            .map(|j| (0..8).map(|d| ((j * 8 + d) as f32 * 0.3).sin()).collect())
            .collect();
        let mut out = vec![0.0; 8];
        flash_f16(&scores, usize::MAX, |j, f| f(&rows[j]), &mut out);
        // Split in chunks of 2 cells and reduced: the same softmax-weighted values.
        let mut split = vec![0.0; 8];
        flash_f16(&scores, 2, |j, f| f(&rows[j]), &mut split);
        let z: f64 = scores.iter().map(|s| (s.1 as f64).exp()).sum();
        for d in 0..8 {
            let want: f64 = scores
                .iter()
                .map(|&(j, s)| (s as f64).exp() / z * rows[j][d] as f64)
                .sum();
            assert!(
                (out[d] as f64 - want).abs() < 2e-3,
                "{d}: {} vs {want}",
                out[d]
            );
            assert!(
                (split[d] as f64 - want).abs() < 2e-3,
                "{d}: {} vs {want}",
                split[d]
            );
        }
    }
}
