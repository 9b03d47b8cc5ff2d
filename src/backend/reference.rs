//! The reference backend: plain f32, deliberately unoptimized, one forward function that reads
//! top to bottom like llama2.c's `forward()`, with a tap at every named point.
//!
//! Weights are dequantized row by row straight from the memory map where they are used, so peak
//! memory stays near the activations plus the KV cache, not the whole model in f32.
//!
//! `Emulation::GgmlCpu` reproduces what ggml's CPU backend does to activations before a matmul
//! with a quantized weight: it quantizes the input row to the weight's `vec_dot_type` (Q8_0,
//! Q8_1, Q8_K; f16 for F16 weights). With it, the reference agrees with llama.cpp CPU goldens to
//! f32 summation-order noise; without it, to the activation-quantization noise of the weights.

use super::f16acc::{self, Rows, dot_f16_acc, round_f16, round_tf32};
pub use super::family::Emulation;
use super::family::{Accum, Act, Gelu, Quantizer};
use super::kvcache::{self, KvCache};
use super::mutation::{self, Mutation};
use super::positions::RopeAt;
use super::{Backend, BackendError};
use crate::arch::{self, Attn, Ops, Rope};
use crate::gguf::{GgmlType, TensorInfo};
use crate::model::{Activation, Model, RopeType};
use crate::quant;
use crate::trace::{Sink, Tap, TapKey, tap, tap_mut};
use rayon::prelude::*;
use std::ops::Range;

/// llama.cpp's GPU `quantize_q8_1`, dequantized: per block of 32, `d = max|x|/127`,
/// `q = roundf(x / d)`, times `d` as the f16 the block stores. Also the blocks, laid out as
/// Q8_0's (the values are Q8_0's: the block sum is not one), where `src` is whole blocks.
fn q8_1_gpu(src: &[f32], dst: &mut [f32]) -> Option<Vec<u8>> {
    let whole = src.len().is_multiple_of(32);
    let mut q8 = vec![0u8; if whole { src.len() / 32 * 34 } else { 0 }];
    for (b, (x, y)) in src.chunks(32).zip(dst.chunks_mut(32)).enumerate() {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let dh = half::f16::from_f32(d);
        if whole {
            q8[b * 34..b * 34 + 2].copy_from_slice(&dh.to_le_bytes());
        }
        for (j, (o, &v)) in y.iter_mut().zip(x).enumerate() {
            let q = if amax == 0.0 { 0.0 } else { (v / d).round() };
            *o = q * dh.to_f32();
            if whole {
                q8[b * 34 + 2 + j] = q as i8 as u8;
            }
        }
    }
    whole.then_some(q8)
}

/// A matmul's input as the emulated engine rounds it: the values, and where they lie on
/// Q8_0's grid (ggml-cpu's 8-bit activations and their twins'), its blocks, which the exact
/// integer kernels (`quant::Format::exact`) take in place of the values.
pub(crate) struct Rounded {
    pub x: Vec<f32>,
    pub q8: Option<Vec<u8>>,
}

impl Rounded {
    fn plain(x: Vec<f32>) -> Self {
        Rounded { x, q8: None }
    }
}

/// Rows of K (`k`) or V as the cache `kv` stores them: rotated where llama.cpp rotates a
/// quantized cache, then rounded to its type.
fn store_rows(kv: &KvCache, head_dim: usize, ekv: usize, k: bool, rows: &mut [f32]) {
    let (rotation, ty) = match k {
        true => (kv.k_rotation(head_dim), kv.k),
        false => (kv.v_rotation(head_dim), kv.v),
    };
    if let Some(n) = rotation {
        kvcache::rotate(&kvcache::hadamard(n), n, rows);
    }
    for row in rows.chunks_exact_mut(ekv) {
        ty.store_as(kv.quantizer, row);
    }
}

/// Per layer, rows of `n_embd_kv` values.
type LayerRows = Vec<Vec<f32>>;

/// Cloned where a judgement replays one step under several roundings from the state the
/// steps before it left (`judge::replay::replay_last_step_under`).
#[derive(Clone)]
pub struct Reference<'m> {
    model: &'m Model,
    emulation: Emulation,
    n_ctx: usize,
    /// Per layer: post-RoPE keys and values, `[n_ctx, n_embd_kv]` row-major.
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    /// The rows as computed, before the cache type rounded them: kept (`keeping_raw_kv`)
    /// where a later step kind reads the cache as another type (`set_kv`).
    kv_raw: Option<(LayerRows, LayerRows)>,
    /// The last row's logits of the latest forward.
    last_logits: Vec<f32>,
    /// A known engine bug to reproduce (`parity dump --mutate`), or none.
    mutation: Option<Mutation>,
    /// The bug acts from this layer on (and on the output ops); 0: everywhere.
    mutation_from: usize,
    /// The layer of the latest tap (for the ops that are not told their layer).
    layer_now: Option<usize>,
    /// The latest tap (which residual an `add` is).
    tap_now: Option<Tap>,
    /// RoPE calls since the latest tap: the first rotates q, the second k.
    ropes_since_tap: usize,
    /// With residual-from-normed: the latest attn_norm or ffn_norm output, which the next
    /// residual add starts from.
    normed: Option<Vec<f32>>,
    /// The K/V cache emulated (f32 by default: the exact reference).
    kv: KvCache,
    /// The output projection's rounding where it differs from `emulation` (an engine whose
    /// lm_head runs another kernel than its layers).
    output_emulation: Option<Emulation>,
    /// With flash attention: the latest `attn_probs`' scores, `(position, score)` per
    /// (head, token) row, which `attn_values` accumulates online as the engine does.
    flash_scores: Vec<Vec<(usize, f32)>>,
    /// The first position of the latest step of several tokens after the first (a turn, a
    /// chunk): where kv-reset-per-turn empties the cache and pos-restart-per-turn counts from.
    turn_start: usize,
    /// The positions q and k are rotated at, where a hypothesis says they are not the rows'
    /// own (`judge::rope_fit`).
    rope_at: Option<RopeAt>,
}

impl<'m> Reference<'m> {
    /// The rounding of the forwards from now on (an engine whose decode steps round otherwise
    /// than its prefill).
    pub fn set_emulation(&mut self, e: Emulation) {
        self.emulation = e;
    }

    pub fn new(model: &'m Model, emulation: Emulation, n_ctx: usize) -> Self {
        let c = &model.config;
        let n_ctx = n_ctx.min(c.n_ctx_train).max(1);
        Reference {
            model,
            emulation,
            n_ctx,
            k_cache: vec![Vec::new(); c.n_layer],
            v_cache: vec![Vec::new(); c.n_layer],
            kv_raw: None,
            last_logits: Vec::new(),
            mutation: None,
            mutation_from: 0,
            layer_now: None,
            tap_now: None,
            ropes_since_tap: 0,
            normed: None,
            kv: KvCache::F32,
            output_emulation: None,
            flash_scores: Vec::new(),
            turn_start: 0,
            rope_at: None,
        }
    }

    /// Keep the K/V cache as `kv` says (its storage, rotation and arithmetic).
    pub fn with_kv(mut self, kv: KvCache) -> Self {
        self.kv = kv;
        self
    }

    /// Keep each K/V row as computed besides the cache's rounded copy, so that `set_kv` can
    /// read the cache as another type from then on.
    pub fn keeping_raw_kv(mut self) -> Self {
        let n = self.model.config.n_layer;
        self.kv_raw = Some((vec![Vec::new(); n], vec![Vec::new(); n]));
        self
    }

    /// The cache as `kv` from now on (an engine whose decode steps read its cache otherwise
    /// than its prompt step): with the rows kept (`keeping_raw_kv`), every row stored so far
    /// is stored again as `kv` stores it; without them only the arithmetic changes.
    pub fn set_kv(&mut self, kv: KvCache) {
        let hd = self.model.config.head_dim;
        let stored = |c: &KvCache| (c.k, c.v, c.k_rotation(hd), c.v_rotation(hd));
        let restore = stored(&kv) != stored(&self.kv);
        self.kv = kv;
        if !restore {
            return;
        }
        let Some((kr, vr)) = &self.kv_raw else { return };
        let ekv = self.model.config.n_embd_kv();
        for (caches, raws, k) in [
            (&mut self.k_cache, kr, true),
            (&mut self.v_cache, vr, false),
        ] {
            for (c, r) in caches.iter_mut().zip(raws) {
                c.clone_from(r);
                store_rows(&kv, hd, ekv, k, c);
            }
        }
    }

    /// Round the output projection's inputs as `e` says (None: as every other matmul).
    pub fn with_output_emulation(mut self, e: Option<Emulation>) -> Self {
        self.output_emulation = e;
        self
    }

    /// Behave like an engine with bug `m` (see [`Mutation`]); `None` is the correct engine.
    /// The forward has reached `key`'s tap: the ops after it belong to it (where the
    /// catalog's bugs look), and RoPE calls are counted from it.
    fn at_tap(&mut self, key: TapKey) {
        self.layer_now = key.layer;
        self.tap_now = Some(key.tap);
        self.ropes_since_tap = 0;
    }

    /// Rotate q and k at the positions `r` says (None: their own).
    pub fn with_rope_at(mut self, r: Option<RopeAt>) -> Self {
        self.rope_at = r;
        self
    }

    pub fn with_mutation(mut self, m: Option<Mutation>) -> Self {
        self.mutation = m;
        self
    }

    /// Let the bug act only from `layer` on (and on the output norm and projection), so that
    /// a test can place it deep in the model.
    pub fn mutation_from_layer(mut self, layer: usize) -> Self {
        self.mutation_from = layer;
        self
    }

    /// Whether bug `m` acts in `layer` (None: the output ops after the last layer).
    fn mutated(&self, m: Mutation, layer: Option<usize>) -> bool {
        self.mutation == Some(m) && layer.is_none_or(|l| l >= self.mutation_from)
    }

    /// The width of the position bug `like` (any width) when it acts at `layer`.
    fn wrap(&self, like: Mutation, layer: usize) -> Option<usize> {
        let m = self.mutation?;
        (std::mem::discriminant(&m) == std::mem::discriminant(&like) && layer >= self.mutation_from)
            .then(|| m.wrap())
            .flatten()
    }

    /// The cache row attention at position `i` reads for position `j`: `j`, or with a ring of
    /// W slots (kv-ring-wrap) the latest position ≡ j (mod W) written by then.
    fn kv_source(&self, layer: usize, i: usize, j: usize) -> usize {
        match self.wrap(Mutation::KvRingWrap(0), layer) {
            Some(w) => j + (i - j) / w * w,
            None => j,
        }
    }

    /// Row `r` of a weight as the (possibly mutated) engine decodes it.
    fn weight_row(&self, w: &TensorInfo, layer: Option<usize>, r: usize, out: &mut [f32]) {
        if let Some(m) = self.decoder_bug(w, layer) {
            let (n_in, _) = w.rows();
            let rb = w.ty.bytes_for(n_in as u64).expect("validated at open") as usize;
            mutation::decode_row(m, w.ty, &self.model.data(w)[r * rb..(r + 1) * rb], out);
        } else {
            self.model.row(w, r, out);
        }
    }

    /// The decoder bug that acts on weight `w` at `layer`, if any.
    fn decoder_bug(&self, w: &TensorInfo, layer: Option<usize>) -> Option<Mutation> {
        [Mutation::DecoderNibbleOrder, Mutation::DecoderNoOffset]
            .into_iter()
            .find(|&m| self.mutated(m, layer) && mutation::misdecodes(m, w.ty))
    }

    /// A weight matmul the slow way, for the bugs that change how a weight is read: decoded
    /// wrong (swapped nibbles, no offset), or read transposed. Never the whole weight in f32 at once (an
    /// lm_head's is 262 MB at 32,000 × 2,048): rows decoded as they are read.
    fn project_mutated(
        &self,
        w: &TensorInfo,
        layer: Option<usize>,
        x: &[f32],
        t: usize,
        transposed: bool,
    ) -> Vec<f32> {
        let (n_in, n_out) = w.rows();
        let x = self.emulate_input(w.ty, x, n_in).x;
        let mut out = vec![0.0f32; t * n_out];
        let mut row = vec![0.0f32; n_in];
        let mut put = |r: usize, wr: &[f32]| {
            for i in 0..t {
                out[i * n_out + r] = self.dot(w.ty, wr, &x[i * n_in..(i + 1) * n_in]);
            }
        };
        if !transposed {
            for r in 0..n_out {
                self.weight_row(w, layer, r, &mut row);
                put(r, &row);
            }
            return out;
        }
        // Transposed: output r reads flat[j * n_out + r] for j < n_in (the stored values read
        // as [n_in, n_out], column r) instead of flat[r * n_in + j]. Columns are gathered a
        // block at a time from the stored rows that hold them (4096 columns: an lm_head's
        // 32,000 × 2,048 in 8 blocks of 32 MB, its stored rows decoded about 1.3 times).
        // (Lib tests take 7, so that their small weights cross block edges.)
        const BLOCK: usize = if cfg!(test) { 7 } else { 4096 };
        let mut cols = vec![0.0f32; BLOCK.min(n_out) * n_in];
        let mut held: Option<usize> = None;
        for r0 in (0..n_out).step_by(BLOCK) {
            let nb = BLOCK.min(n_out - r0);
            for j in 0..n_in {
                for c in 0..nb {
                    let at = j * n_out + r0 + c;
                    let (stored, off) = (at / n_in, at % n_in);
                    if held != Some(stored) {
                        self.weight_row(w, layer, stored, &mut row);
                        held = Some(stored);
                    }
                    cols[c * n_in + j] = row[off];
                }
            }
            for c in 0..nb {
                put(r0 + c, &cols[c * n_in..(c + 1) * n_in]);
            }
        }
        out
    }

    /// out[t, r] = Σ_i W[r, i] · x[t, i] for the T rows of `x`. `W` is `[n_in, n_out]` in ggml
    /// order: row r of the stored matrix is output r.
    pub(crate) fn matmul_plain(&self, w: &TensorInfo, x: &[f32], t: usize) -> Vec<f32> {
        let (n_in, n_out) = w.rows();
        let x = self.emulate_input(w.ty, x, n_in);
        if self.emulation.accum() == Accum::F32 {
            return matmul_f64(self.model, w, &[&x], t).remove(0);
        }
        let x = x.x;
        // Output rows are independent: split them over threads in chunks (rayon); every
        // output is the same sum wherever it runs.
        let mut by_row = vec![0.0f32; n_out * t];
        match self.emulation.accum() {
            Accum::F16 { fused } if !matches!(w.ty, GgmlType::F32 | GgmlType::BF16) => {
                let group = if w.ty == GgmlType::F16 { 4 } else { 2 };
                let lanes = f16acc::LANES;
                // A task's output rows: four blocks of `LANES` summed side by side (their chains
                // of roundings overlap).
                let per_task = 4 * lanes;
                map_chunks(&mut by_row, per_task * t, n_in * n_out * t, |c, chunk| {
                    let mut row = vec![0.0f32; n_in];
                    let mut rows = Rows::new(n_in);
                    for (b, block) in chunk.chunks_mut(lanes * t).enumerate() {
                        let count = block.len() / t;
                        for l in 0..lanes {
                            if l < count {
                                self.model.row(w, c * per_task + b * lanes + l, &mut row);
                            }
                            rows.set(l, (l < count).then_some(row.as_slice()));
                        }
                        for (i, xr) in x.chunks(n_in).enumerate() {
                            let o = rows.dot(xr, group, fused);
                            for l in 0..count {
                                block[l * t + i] = o[l];
                            }
                        }
                    }
                });
            }
            _ => {
                const ROWS: usize = 64;
                map_chunks(&mut by_row, ROWS * t, n_in * n_out * t, |c, chunk| {
                    let mut row = vec![0.0f32; n_in];
                    for (k, o) in chunk.chunks_mut(t).enumerate() {
                        self.model.row(w, c * ROWS + k, &mut row);
                        for (v, xr) in o.iter_mut().zip(x.chunks(n_in)) {
                            *v = self.dot(w.ty, &row, xr);
                        }
                    }
                });
            }
        }
        let mut out = vec![0.0f32; t * n_out];
        for (r, o) in by_row.chunks(t).enumerate() {
            for (i, &v) in o.iter().enumerate() {
                out[i * n_out + r] = v;
            }
        }
        out
    }

    /// Whether this reference reads weights as they are stored, sums in f64 (`matmul_f64`) and
    /// has no bug that changes how a weight is read: then its matmuls can share one walk of the
    /// weights with others' (`Lockstep`).
    pub(crate) fn plain_matmuls(&self) -> bool {
        self.mutation.is_none() && self.emulation.accum() == Accum::F32
    }

    /// The input of a matmul with a `ty` weight, rounded as this reference's engine rounds it.
    pub(crate) fn matmul_input(&self, ty: GgmlType, x: &[f32], n_in: usize) -> Rounded {
        self.emulate_input(ty, x, n_in)
    }

    /// One output of a weight matmul (`w` a weight row, `x` an already rounded input row),
    /// summed as the emulated family sums.
    fn dot(&self, ty: GgmlType, w: &[f32], x: &[f32]) -> f32 {
        match (self.emulation.accum(), ty) {
            (Accum::F32, _) => dot(w, x),
            (Accum::Tf32, _) => dot_tf32(w, x),
            // Vulkan's f32 × f32 matmul: f16 in shared memory, f32 accumulator.
            (Accum::F16 { .. }, GgmlType::F32) => {
                let w16: Vec<f32> = w.iter().map(|&v| round_f16(v)).collect();
                dot(&w16, x)
            }
            // BF16 weights take Vulkan's bf16 path: an f32 accumulator (its inputs rounded to
            // bf16 there, to f16 here: not modelled, no BF16 GPU golden checked).
            (Accum::F16 { .. }, GgmlType::BF16) => dot(w, x),
            (Accum::F16 { fused }, GgmlType::F16) => dot_f16_acc(w, x, 4, fused),
            (Accum::F16 { fused }, _) => dot_f16_acc(w, x, 2, fused),
        }
    }

    /// The activation rounding the emulated engine applies before a matmul with a `ty` weight.
    fn emulate_input(&self, ty: GgmlType, x: &[f32], n_in: usize) -> Rounded {
        let e = self.emulation;
        if e.family().act == Act::Tf32 {
            return Rounded::plain(x.iter().map(|&v| round_tf32(v)).collect());
        }
        let act = e.act_type(ty, n_in);
        match act {
            GgmlType::F32 => return Rounded::plain(x.to_vec()),
            GgmlType::F16 => return Rounded::plain(x.iter().map(|&v| round_f16(v)).collect()),
            GgmlType::BF16 => {
                return Rounded::plain(
                    x.iter()
                        .map(|&v| half::bf16::from_f32(v).to_f32())
                        .collect(),
                );
            }
            _ => {}
        }
        let mut y = vec![0.0f32; x.len()];
        let quantizer = e.family().quantizer;
        let mut q8 = if quantizer == Quantizer::Gpu && act == GgmlType::Q8_1 {
            q8_1_gpu(x, &mut y)
        } else {
            let rb = act.bytes_for(n_in as u64).expect("whole blocks") as usize;
            let mut q = vec![0u8; x.len() / n_in * rb];
            for ((src, dst), q) in x.chunks(n_in).zip(y.chunks_mut(n_in)).zip(q.chunks_mut(rb)) {
                if quantizer == Quantizer::Scalar {
                    quant::quantize_row_into(act, src, q).expect("whole blocks");
                } else {
                    quant::quantize_activation(act, src, q);
                }
                quant::dequantize_row(act, q, dst).expect("same length");
            }
            match act {
                GgmlType::Q8_0 => Some(q),
                // Q8_1's values are Q8_0's: its scale and quants, without the block sum.
                GgmlType::Q8_1 => Some(
                    q.chunks_exact(36)
                        .flat_map(|b| b[..2].iter().chain(&b[4..]).copied())
                        .collect(),
                ),
                _ => None,
            }
        };
        // An overflowing block's values are not its scale times its quants.
        if y.iter().any(|v| !v.is_finite()) {
            q8 = None;
        }
        Rounded { x: y, q8 }
    }

    /// The query head → kv head map (GQA), as the (possibly mutated) engine does it.
    /// Head `h`'s attention probabilities `[T, n_kv]` into `probs` (zero where a key is not
    /// visible); with an f16 flash accumulator, each row's visible scores, which
    /// [`Reference::head_values`] accumulates instead.
    fn head_probs(
        &self,
        layer: usize,
        q: &[f32],
        a: &Attn,
        h: usize,
        rot: Option<&(usize, Vec<f32>)>,
        probs: &mut [f32],
    ) -> Vec<Vec<(usize, f32)>> {
        let (nh, hd, ekv) = (a.n_head, a.head_dim, a.n_head_kv * a.head_dim);
        let (t, pos0, n_kv) = (a.n_tokens, a.pos0, a.n_kv());
        let kc = &self.k_cache[layer];
        let kv_head = self.kv_head(layer, a);
        let no_cap = self.mutated(Mutation::NoSoftcap, Some(layer));
        let no_max = self.mutated(Mutation::SoftmaxNoMax, Some(layer));
        // An online (flash) softmax keeps a running max by construction.
        let flash = self.kv.f16_accumulator(t) && !no_max;
        let mut qh = vec![0.0f32; hd];
        let mut flash_scores = Vec::new();
        for i in 0..t {
            // q as the engine dots it with its cache: rotated with K, rounded to K's type.
            qh.copy_from_slice(&q[(i * nh + h) * hd..][..hd]);
            if let Some((n, hm)) = rot {
                kvcache::rotate(hm, *n, &mut qh);
            }
            self.kv.round_query(&mut qh, t);
            let qv = &qh[..];
            let p = &mut probs[i * n_kv..][..n_kv];
            let seen = self.visible(layer, a, pos0, i, n_kv);
            // A row that sees no position is what an engine's softmax over a row masked
            // everywhere gives: exp(-inf - (-inf)) = NaN in every entry.
            if seen.is_empty() {
                p.fill(f32::NAN);
                continue;
            }
            for j in seen.clone() {
                let src = self.kv_source(layer, pos0 + i, j);
                let mut s = dot(qv, &kc[src * ekv + kv_head(h) * hd..][..hd]) * a.kq_scale;
                if let Some(cap) = a.softcap.filter(|_| !no_cap) {
                    s = softcap(s, cap);
                }
                p[j] = s;
            }
            if flash {
                flash_scores.push(seen.clone().map(|j| (j, p[j])).collect());
            }
            if no_max {
                softmax_no_max(&mut p[seen]);
            } else {
                softmax(&mut p[seen]);
            }
        }
        flash_scores
    }

    /// Head `h`'s rows `[T, head_dim]` of `Σ_j p_j · v_j`, from its probabilities `p`
    /// (`[T, n_kv]`), or from its rows' scores accumulated online in f16 (`flash`).
    fn head_values(
        &self,
        layer: usize,
        p: &[f32],
        a: &Attn,
        h: usize,
        flash: Option<&[Vec<(usize, f32)>]>,
    ) -> Vec<f32> {
        let (hd, ekv) = (a.head_dim, a.n_head_kv * a.head_dim);
        let (t, pos0, n_kv) = (a.n_tokens, a.pos0, a.n_kv());
        let vc = match self.mutated(Mutation::VFromK, Some(layer)) {
            true => &self.k_cache[layer],
            false => &self.v_cache[layer],
        };
        let kv_head = self.kv_head(layer, a);
        let mut att = vec![0.0f32; t * hd];
        let mut pr = vec![0.0f32; n_kv];
        let mut acc = vec![0.0f64; hd];
        for i in 0..t {
            let seen = self.visible(layer, a, pos0, i, n_kv);
            let out = &mut att[i * hd..][..hd];
            // A fully masked row's NaN probabilities reach every value (p · V).
            if seen.is_empty() {
                out.fill(f32::NAN);
                continue;
            }
            let base = kv_head(h) * hd;
            let src = |j: usize| self.kv_source(layer, pos0 + i, j);
            if let Some(f) = flash {
                let row = |j: usize, g: &mut dyn FnMut(&[f32])| g(&vc[src(j) * ekv + base..][..hd]);
                let chunk = self.kv.split_chunk(t, n_kv).unwrap_or(usize::MAX);
                kvcache::flash_f16(&f[i], chunk, row, out);
                continue;
            }
            pr.copy_from_slice(&p[i * n_kv..][..n_kv]);
            self.kv.round_probs(&mut pr[seen.clone()]);
            // Each output an f64 sum over the positions in order (from -0.0, as `sum`
            // folds), the positions outer so that each V row is read once, in a line.
            acc.fill(-0.0);
            weighted_rows(&mut acc, seen, &pr, |j| &vc[src(j) * ekv + base..][..hd]);
            for (o, &a) in out.iter_mut().zip(&acc) {
                *o = a as f32;
            }
        }
        att
    }

    /// Each head's rows (`[T, head_dim]`) laid out token by token (`[T, n_head · head_dim]`);
    /// a rotated V gives a rotated output, which the engine rotates back.
    fn gather_heads(&self, heads: Vec<Vec<f32>>, a: &Attn) -> Vec<f32> {
        let (nh, hd) = (a.n_head, a.head_dim);
        let mut att = vec![0.0f32; a.n_tokens * nh * hd];
        for (h, rows) in heads.iter().enumerate() {
            for (i, row) in rows.chunks(hd).enumerate() {
                att[(i * nh + h) * hd..][..hd].copy_from_slice(row);
            }
        }
        if let Some(n) = self.kv.v_rotation(hd) {
            kvcache::rotate(&kvcache::hadamard(n), n, &mut att);
        }
        att
    }

    fn kv_head(&self, layer: usize, a: &Attn) -> impl Fn(usize) -> usize {
        let group = a.n_head / a.n_head_kv;
        let (nkv, modulo) = (a.n_head_kv, self.mutated(Mutation::GqaModulo, Some(layer)));
        let zero = self.mutated(Mutation::KvHeadZero, Some(layer));
        move |h| {
            if zero {
                0
            } else if modulo {
                h % nkv
            } else {
                h / group
            }
        }
    }

    /// The keys query row `i` sees (all of them with the no-causal-mask bug).
    fn visible(&self, layer: usize, a: &Attn, pos0: usize, i: usize, n_kv: usize) -> Range<usize> {
        if self.mutated(Mutation::NoCausalMask, Some(layer)) {
            return 0..n_kv;
        }
        let mut a = *a;
        if a.window > 0 && self.mutated(Mutation::SwaOffByOne, Some(layer)) {
            a.window += 1;
        }
        let mut seen = a.visible(pos0 + i);
        // An emptied cache: nothing before the turn's first position.
        if self.mutated(Mutation::KvResetPerTurn, Some(layer)) {
            seen.start = seen.start.max(self.turn_start);
        }
        // The rows after the step's last full block of W: unmasked within the step.
        if let Some(w) = self.wrap(Mutation::MaskTailBlock(0), layer)
            && i >= a.n_tokens / w * w
        {
            return seen.start..n_kv;
        }
        if self.mutated(Mutation::CausalMaskOffByOne, Some(layer)) {
            // One position more, where the step has one (a decode step's row is its last).
            return seen.start..(seen.end + 1).min(n_kv);
        }
        // Attended before the step's own K/V were stored: the positions before the step.
        if pos0 > 0 && self.mutated(Mutation::AttendBeforeStore, Some(layer)) {
            return seen.start..seen.end.min(pos0);
        }
        if self.mutated(Mutation::CausalMaskExcludesSelf, Some(layer)) {
            // `j < i` where `j <= i` is meant: position 0 sees nothing.
            return seen.start..seen.end - 1;
        }
        seen
    }
}

/// The layer a GGUF tensor belongs to (`blk.N.…`); None for the embedding, output norm and
/// output projection.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// `out[m][t, r] = Σ_i W[r, i] · x_m[t, i]` for each input `x_m` (T rows each, already rounded
/// as its engine rounds them), summed in f64: an input on Q8_0's grid against a weight with an
/// exact integer kernel (`quant::Format::exact`: Q4_0, Q8_0) through that kernel (integer per
/// block, the blocks summed in f64: the same sum to about 1e-16, several times faster), every
/// other as `dot` sums it, in one walk of the weight's rows for all of them. Each output is
/// the same sum whatever thread computes it, so the result is bit-identical whatever the
/// thread count or the other inputs.
pub(crate) fn matmul_f64(
    model: &Model,
    w: &TensorInfo,
    xs: &[&Rounded],
    t: usize,
) -> Vec<Vec<f32>> {
    let exact = w.ty.format().exact;
    let mut ints: Vec<Option<Vec<f32>>> = xs
        .iter()
        .map(|x| match (exact, &x.q8) {
            (Some(kernel), Some(q8)) => Some(matmul_exact(model, w, kernel, q8, t)),
            _ => None,
        })
        .collect();
    let floats: Vec<&[f32]> = xs
        .iter()
        .zip(&ints)
        .filter(|(_, o)| o.is_none())
        .map(|(x, _)| x.x.as_slice())
        .collect();
    let mut floats = if floats.is_empty() {
        Vec::new()
    } else {
        matmul_f64_floats(model, w, &floats, t)
    }
    .into_iter();
    ints.iter_mut()
        .map(|o| {
            o.take()
                .unwrap_or_else(|| floats.next().expect("one per float input"))
        })
        .collect()
}

/// Below this many multiply-adds an op runs on the calling thread: handing work to rayon's
/// threads (a wake-up, then a wait) costs more than a small model's whole matmul, and the
/// replays and self-tests of small models make thousands of them.
const PAR_MIN_WORK: usize = 1 << 18;

/// `f(i, chunk i of out)` for every `chunk`-long chunk, on rayon's threads when `work`
/// (multiply-adds) is worth it; the results in order. Each call is the same whatever thread
/// runs it.
fn map_chunks<T, F>(out: &mut [f32], chunk: usize, work: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize, &mut [f32]) -> T + Sync + Send,
{
    if work < PAR_MIN_WORK {
        out.chunks_mut(chunk)
            .enumerate()
            .map(|(i, c)| f(i, c))
            .collect()
    } else {
        out.par_chunks_mut(chunk)
            .enumerate()
            .map(|(i, c)| f(i, c))
            .collect()
    }
}

/// `f(i)` for i in 0..n, as [`map_chunks`] runs its chunks.
fn map_range<T: Send, F: Fn(usize) -> T + Sync + Send>(n: usize, work: usize, f: F) -> Vec<T> {
    if work < PAR_MIN_WORK {
        (0..n).map(f).collect()
    } else {
        (0..n).into_par_iter().map(f).collect()
    }
}

/// `out[t, r]` for Q8_0 activation rows `q8` through the weight's exact kernel, output rows
/// split over threads in chunks.
fn matmul_exact(
    model: &Model,
    w: &TensorInfo,
    kernel: quant::TileKernel,
    q8: &[u8],
    t: usize,
) -> Vec<f32> {
    const ROWS: usize = 64;
    let (n_in, n_out) = w.rows();
    let mut a = quant::TileAct::default();
    a.load_q8(q8, n_in);
    let rb = w.ty.bytes_for(n_in as u64).expect("validated at open") as usize;
    let data = model.data(w);
    let mut by_row = vec![0.0f32; n_out * t];
    map_chunks(&mut by_row, ROWS * t, n_in * n_out * t, |c, o| {
        kernel(&data[c * ROWS * rb..][..o.len() / t * rb], &a, o)
    });
    let mut out = vec![0.0f32; t * n_out];
    for (r, o) in by_row.chunks(t).enumerate() {
        for (i, &v) in o.iter().enumerate() {
            out[i * n_out + r] = v;
        }
    }
    out
}

/// [`matmul_f64`] for inputs summed as `dot` sums them: one walk of the weight's rows
/// (decoded to f32) for all of them.
fn matmul_f64_floats(model: &Model, w: &TensorInfo, xs: &[&[f32]], t: usize) -> Vec<Vec<f32>> {
    const ROWS: usize = 64;
    let (n_in, n_out) = w.rows();
    let m = xs.len();
    // Widened to f64 once per matmul, not once per row.
    let x64: Vec<Vec<f64>> = xs
        .iter()
        .map(|x| x.iter().map(|&v| v as f64).collect())
        .collect();
    // by_row[(r * m + j) * t + i]: output r of input j's row i.
    let mut by_row = vec![0.0f32; n_out * m * t];
    map_chunks(
        &mut by_row,
        ROWS * m * t,
        n_in * n_out * m * t,
        |c, chunk| {
            let mut rows = vec![0.0f32; 4 * n_in];
            let mut acc = vec![[0.0f64; 8]; 4 * t];
            for (g, outs) in chunk.chunks_mut(4 * m * t).enumerate() {
                // A last group of fewer than four rows repeats its last one (and drops its
                // sums).
                let n = outs.len() / (m * t);
                for (k, row) in rows.chunks_mut(n_in).enumerate() {
                    model.row(w, c * ROWS + g * 4 + k.min(n - 1), row);
                }
                for (j, x) in x64.iter().enumerate() {
                    dots_f64(&rows, x, &mut acc);
                    for k in 0..n {
                        for i in 0..t {
                            let (wr, xr) = (&rows[k * n_in..][..n_in], &x[i * n_in..][..n_in]);
                            outs[(k * m + j) * t + i] = dot_finish(wr, xr, acc[k * t + i]);
                        }
                    }
                }
            }
        },
    );
    let mut out = vec![vec![0.0f32; t * n_out]; m];
    for (rj, o) in by_row.chunks(t).enumerate() {
        let (r, j) = (rj / m, rj % m);
        for (i, &v) in o.iter().enumerate() {
            out[j][i * n_out + r] = v;
        }
    }
    out
}

/// Dot product, accumulated in f64 so that the reference's own rounding stays far below
/// every tolerance. Eight running sums (element i goes to sum i % 8) instead of one let the
/// compiler use vector registers; in f64 the order changes nothing a tolerance could see.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if a.len() == b.len()
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_read(a, b, |v| v)
}

/// [`dot`]'s eight running sums in two registers (a head's scores and the plain matmuls spend
/// most of a long prompt's replays here), then its tail and final sum as it does them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    assert_eq!(a.len(), b.len());
    let whole = a.len() / 8 * 8;
    let mut acc = [0.0f64; 8];
    // SAFETY: every load stays inside `a` and `b` (c + 8 <= whole <= len); the stores inside
    // `acc`.
    unsafe {
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for c in (0..whole).step_by(8) {
            let (pa, pb) = (a.as_ptr().add(c), b.as_ptr().add(c));
            let (a0, a1) = (
                _mm256_cvtps_pd(_mm_loadu_ps(pa)),
                _mm256_cvtps_pd(_mm_loadu_ps(pa.add(4))),
            );
            let (b0, b1) = (
                _mm256_cvtps_pd(_mm_loadu_ps(pb)),
                _mm256_cvtps_pd(_mm_loadu_ps(pb.add(4))),
            );
            lo = _mm256_fmadd_pd(a0, b0, lo);
            hi = _mm256_fmadd_pd(a1, b1, hi);
        }
        _mm256_storeu_pd(acc.as_mut_ptr(), lo);
        _mm256_storeu_pd(acc.as_mut_ptr().add(4), hi);
    }
    let tail: f64 = a[whole..]
        .iter()
        .zip(&b[whole..])
        .map(|(&x, &y)| x as f64 * y as f64)
        .sum();
    (acc.iter().sum::<f64>() + tail) as f32
}

/// [`dot`] with each weight rounded to TF32 as it is read (`Accum::Tf32`; `x` already is).
pub(crate) fn dot_tf32(w: &[f32], x: &[f32]) -> f32 {
    dot_read(w, x, round_tf32)
}

/// [`dot`] with each element of `a` read through `read`.
#[inline(always)]
fn dot_read(a: &[f32], b: &[f32], read: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += read(x[k]) as f64 * y[k] as f64;
        }
    }
    let tail: f64 = ra
        .iter()
        .zip(rb)
        .map(|(&x, &y)| read(x) as f64 * y as f64)
        .sum();
    (acc.iter().sum::<f64>() + tail) as f32
}

/// `dot`'s eight running sums (element j goes to sum j % 8) of four weight rows (`rows`, back
/// to back) with each of the T input rows (`x`, widened to f64), over the whole blocks of
/// eight, into `acc[k * T + i]`; `dot_finish` adds the tail. The same sums in the same order
/// as `dot`, so the same bits, but arranged for the CPU: K in spans that keep their slice of
/// the inputs in L1 (a lane's sum carries from one span to the next), and four (row, token)
/// pairs at a time (2 rows × 2 tokens, or 4 rows × 1 token for a decode step or an odd last
/// token) so that eight chains of adds run side by side where one dot has two.
fn dots_f64(rows: &[f32], x: &[f64], acc: &mut [[f64; 8]]) {
    const SPAN: usize = 1024;
    let n = rows.len() / 4;
    let t = x.len() / n;
    acc.fill([0.0; 8]);
    let whole = n / 8 * 8;
    for k0 in (0..whole).step_by(SPAN) {
        let k = k0..(k0 + SPAN).min(whole);
        let w = |r: usize| &rows[r * n..][k.clone()];
        let xr = |i: usize| &x[i * n..][k.clone()];
        let mut i = 0;
        while i + 2 <= t {
            for r in [0, 2] {
                let mut a = [
                    [acc[r * t + i], acc[r * t + i + 1]],
                    [acc[(r + 1) * t + i], acc[(r + 1) * t + i + 1]],
                ];
                sums_2x2([w(r), w(r + 1)], [xr(i), xr(i + 1)], &mut a);
                [acc[r * t + i], acc[r * t + i + 1]] = a[0];
                [acc[(r + 1) * t + i], acc[(r + 1) * t + i + 1]] = a[1];
            }
            i += 2;
        }
        if i < t {
            let mut a: [[f64; 8]; 4] = std::array::from_fn(|r| acc[r * t + i]);
            sums_4x1(std::array::from_fn(w), xr(i), &mut a);
            for (r, a) in a.into_iter().enumerate() {
                acc[r * t + i] = a;
            }
        }
    }
}

/// `dot`'s ending: the eight sums in order, then the tail past the last block of eight.
fn dot_finish(w: &[f32], x: &[f64], acc: [f64; 8]) -> f32 {
    let whole = w.len() / 8 * 8;
    let tail: f64 = w[whole..]
        .iter()
        .zip(&x[whole..])
        .map(|(&a, &b)| a as f64 * b)
        .sum();
    (acc.iter().sum::<f64>() + tail) as f32
}

/// Adds `p[j] · row(j)[k]` to `acc[k]` for each j of `js` in order (an f64 sum per output,
/// the positions outer: attention's `p · V`); every row as long as `acc`.
fn weighted_rows<'a>(
    acc: &mut [f64],
    js: Range<usize>,
    p: &[f32],
    row: impl Fn(usize) -> &'a [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { weighted_rows_avx2(acc, js, p, row) };
    }
    weighted_rows_scalar(acc, js, p, row, 0);
}

/// The scalar twin of `weighted_rows_avx2`, for the outputs from `from` on.
fn weighted_rows_scalar<'a>(
    acc: &mut [f64],
    js: Range<usize>,
    p: &[f32],
    row: impl Fn(usize) -> &'a [f32],
    from: usize,
) {
    for j in js {
        let (pj, v) = (p[j] as f64, row(j));
        assert_eq!(v.len(), acc.len());
        for (a, &x) in acc[from..].iter_mut().zip(&v[from..]) {
            *a += pj * x as f64;
        }
    }
}

/// Sixteen outputs at a time held in four registers over all of `js` (each output's sum
/// keeps its order), then four at a time, the rest scalar. An f32 times an f32 is exact in
/// f64, so the fused multiply-add rounds as the multiply then add.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn weighted_rows_avx2<'a>(
    acc: &mut [f64],
    js: Range<usize>,
    p: &[f32],
    row: impl Fn(usize) -> &'a [f32],
) {
    let n = acc.len();
    let (by16, by4) = (n / 16 * 16, n / 4 * 4);
    for c in (0..by16).step_by(16) {
        weighted_block::<4>(acc, c, js.clone(), p, &row);
    }
    for c in (by16..by4).step_by(4) {
        weighted_block::<1>(acc, c, js.clone(), p, &row);
    }
    if by4 < n {
        weighted_rows_scalar(acc, js, p, row, by4);
    }
}

/// `acc[c..c + 4R]` of `weighted_rows_avx2`, held in R registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn weighted_block<'a, const R: usize>(
    acc: &mut [f64],
    c: usize,
    js: Range<usize>,
    p: &[f32],
    row: &impl Fn(usize) -> &'a [f32],
) {
    use std::arch::x86_64::*;
    let n = acc.len();
    assert!(c + 4 * R <= n);
    // SAFETY: the loads and stores stay inside `acc[c..c + 4R]` and the row's same range
    // (asserted: c + 4R <= n, and every row's length is n).
    unsafe {
        let mut a: [__m256d; R] =
            std::array::from_fn(|m| _mm256_loadu_pd(acc.as_ptr().add(c + 4 * m)));
        for j in js {
            let v = row(j);
            assert_eq!(v.len(), n);
            let pj = _mm256_set1_pd(p[j] as f64);
            for (m, r) in a.iter_mut().enumerate() {
                let x = _mm256_cvtps_pd(_mm_loadu_ps(v.as_ptr().add(c + 4 * m)));
                *r = _mm256_fmadd_pd(pj, x, *r);
            }
        }
        for (m, r) in a.iter().enumerate() {
            _mm256_storeu_pd(acc.as_mut_ptr().add(c + 4 * m), *r);
        }
    }
}

/// Adds `w[r][j] · x[i][j]` to `acc[r][i][j % 8]` in order of j (lengths: multiples of 8).
fn sums_2x2(w: [&[f32]; 2], x: [&[f64]; 2], acc: &mut [[[f64; 8]; 2]; 2]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { sums_2x2_avx2(w, x, acc) };
    }
    for r in 0..2 {
        for i in 0..2 {
            sums_scalar(w[r], x[i], &mut acc[r][i]);
        }
    }
}

/// Adds `w[r][j] · x[j]` to `acc[r][j % 8]` in order of j (lengths: multiples of 8).
fn sums_4x1(w: [&[f32]; 4], x: &[f64], acc: &mut [[f64; 8]; 4]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { sums_4x1_avx2(w, x, acc) };
    }
    for r in 0..4 {
        sums_scalar(w[r], x, &mut acc[r]);
    }
}

/// The scalar twin of the AVX2 kernels: one pair's eight running sums.
fn sums_scalar(w: &[f32], x: &[f64], acc: &mut [f64; 8]) {
    for (a, b) in w.chunks_exact(8).zip(x.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += a[k] as f64 * b[k];
        }
    }
}

// The AVX2 kernels keep sums 0–3 of a pair in one register and 4–7 in another. The product
// of two f32s is exact in f64, so the fused multiply-add rounds as `dot`'s multiply then add.

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sums_2x2_avx2(w: [&[f32]; 2], x: [&[f64]; 2], acc: &mut [[[f64; 8]; 2]; 2]) {
    use std::arch::x86_64::*;
    let n = w[0].len();
    assert!(
        n.is_multiple_of(8) && w.iter().all(|r| r.len() == n) && x.iter().all(|r| r.len() == n)
    );
    // SAFETY: every load and store stays inside a slice of n (a multiple of 8) or an [f64; 8].
    unsafe {
        let mut lo = acc.map(|r| r.map(|a| _mm256_loadu_pd(a.as_ptr())));
        let mut hi = acc.map(|r| r.map(|a| _mm256_loadu_pd(a.as_ptr().add(4))));
        for c in (0..n).step_by(8) {
            let wv: [[__m256d; 2]; 2] = std::array::from_fn(|r| {
                let p = w[r].as_ptr().add(c);
                [
                    _mm256_cvtps_pd(_mm_loadu_ps(p)),
                    _mm256_cvtps_pd(_mm_loadu_ps(p.add(4))),
                ]
            });
            for i in 0..2 {
                let p = x[i].as_ptr().add(c);
                let (x0, x1) = (_mm256_loadu_pd(p), _mm256_loadu_pd(p.add(4)));
                for r in 0..2 {
                    lo[r][i] = _mm256_fmadd_pd(wv[r][0], x0, lo[r][i]);
                    hi[r][i] = _mm256_fmadd_pd(wv[r][1], x1, hi[r][i]);
                }
            }
        }
        for r in 0..2 {
            for i in 0..2 {
                _mm256_storeu_pd(acc[r][i].as_mut_ptr(), lo[r][i]);
                _mm256_storeu_pd(acc[r][i].as_mut_ptr().add(4), hi[r][i]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sums_4x1_avx2(w: [&[f32]; 4], x: &[f64], acc: &mut [[f64; 8]; 4]) {
    use std::arch::x86_64::*;
    let n = x.len();
    assert!(n.is_multiple_of(8) && w.iter().all(|r| r.len() == n));
    // SAFETY: every load and store stays inside a slice of n (a multiple of 8) or an [f64; 8].
    unsafe {
        let mut lo = acc.map(|a| _mm256_loadu_pd(a.as_ptr()));
        let mut hi = acc.map(|a| _mm256_loadu_pd(a.as_ptr().add(4)));
        for c in (0..n).step_by(8) {
            let p = x.as_ptr().add(c);
            let (x0, x1) = (_mm256_loadu_pd(p), _mm256_loadu_pd(p.add(4)));
            for r in 0..4 {
                let q = w[r].as_ptr().add(c);
                lo[r] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(q)), x0, lo[r]);
                hi[r] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(q.add(4))), x1, hi[r]);
            }
        }
        for r in 0..4 {
            _mm256_storeu_pd(acc[r].as_mut_ptr(), lo[r]);
            _mm256_storeu_pd(acc[r].as_mut_ptr().add(4), hi[r]);
        }
    }
}

/// RMSNorm in ggml's order: mean of squares summed in f64, scale = 1/sqrt(mean + eps) in f32,
/// then the element-wise weight.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let n = weight.len();
    let mut out = vec![0.0f32; x.len()];
    for (row, o) in x.chunks(n).zip(out.chunks_mut(n)) {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for i in 0..n {
            o[i] = (row[i] * scale) * weight[i];
        }
    }
    out
}

/// An RMSNorm as an engine with a catalog bug of its formula computes it: the mean of
/// squares without its `/ n` (`RmsSumNotMean`), the square root left out (`RmsNoSqrt`), or
/// the row's mean subtracted first (`LayerNormNotRms`, a LayerNorm without bias).
pub(crate) fn rms_norm_mutated(x: &[f32], weight: &[f32], eps: f32, m: Mutation) -> Vec<f32> {
    let n = weight.len();
    let mut out = vec![0.0f32; x.len()];
    for (row, o) in x.chunks(n).zip(out.chunks_mut(n)) {
        let mean = match m {
            Mutation::LayerNormNotRms => {
                (row.iter().map(|&v| v as f64).sum::<f64>() / n as f64) as f32
            }
            _ => 0.0,
        };
        let sum: f64 = row.iter().map(|&v| ((v - mean) * (v - mean)) as f64).sum();
        let ms = match m {
            Mutation::RmsSumNotMean => sum as f32,
            _ => (sum / n as f64) as f32,
        };
        let scale = match m {
            Mutation::RmsNoSqrt => 1.0 / (ms + eps),
            _ => 1.0 / (ms + eps).sqrt(),
        };
        for i in 0..n {
            o[i] = ((row[i] - mean) * scale) * weight[i];
        }
    }
    out
}

/// Flip the sign of the second element of each rotated pair in every head of `x`: rotating
/// the result by θ and flipping again rotates by −θ, bit for bit.
fn conjugate_pairs(x: &mut [f32], r: &Rope) {
    let (hd, half) = (r.head_dim, r.n_rot / 2);
    for head in x.chunks_mut(hd) {
        for i in 0..half {
            let second = match r.kind {
                RopeType::Norm => 2 * i + 1,
                RopeType::Neox => i + half,
            };
            head[second] = -head[second];
        }
    }
}

/// Rotate each head of `x` (`[T, n_heads, head_dim]`) by its position `pos0 + t`, as
/// ggml_rope_ext with ext_factor 0: theta_i = pos · freq_scale · base^(-2i/n_rot) / factor_i,
/// computed by repeated multiplication like ggml's rope cache; cos and sin times attn_factor.
/// Norm pairs (2i, 2i+1); Neox pairs (i, i + n_rot/2).
/// `cache` is scratch for the angles (the fast backend keeps one, so decode does not allocate).
pub(crate) fn rope(
    x: &mut [f32],
    pos0: usize,
    n_heads: usize,
    r: &Rope,
    factors: Option<&[f32]>,
    cache: &mut Vec<(f32, f32)>,
) {
    let (hd, n_rot) = (r.head_dim, r.n_rot);
    let theta_scale = r.base.powf(-2.0 / n_rot as f32);
    cache.resize(n_rot / 2, (0.0, 0.0));
    for (t, row) in x.chunks_mut(n_heads * hd).enumerate() {
        let mut theta = (pos0 + t) as f32;
        for (i, c) in cache.iter_mut().enumerate() {
            let ff = factors.map_or(1.0, |f| f[i]);
            let th = r.freq_scale * (theta / ff);
            *c = (th.cos() * r.attn_factor, th.sin() * r.attn_factor);
            theta *= theta_scale;
        }
        for v in row.chunks_mut(hd) {
            for (i, &(cos, sin)) in cache.iter().enumerate() {
                let (a, b) = match r.kind {
                    RopeType::Norm => (2 * i, 2 * i + 1),
                    RopeType::Neox => (i, i + n_rot / 2),
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * cos - x1 * sin;
                v[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `cap · tanh(x / cap)`, as ggml's scale, tanh, scale.
pub(crate) fn softcap(x: f32, cap: f32) -> f32 {
    (x / cap).tanh() * cap
}

/// GELU, tanh approximation, as ggml_gelu. ggml's CPU backend looks it up in an f16 table
/// (`GGML_GELU_FP16`): the input rounded to f16, the output stored as f16, and exact past
/// ±10; a family whose row says `Gelu::F16Table` (ggml-cpu) does the same.
pub(crate) fn gelu(x: f32, emulation: Emulation) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    let exact = |x: f32| 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh());
    if emulation.gelu() != Gelu::F16Table {
        return exact(x);
    }
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let h = half::f16::from_f32(x).to_f32();
        half::f16::from_f32(exact(h)).to_f32()
    }
}

pub(crate) fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

pub(crate) fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

impl Backend for Reference<'_> {
    fn name(&self) -> String {
        match self.emulation {
            Emulation::None => "reference".into(),
            Emulation::GgmlCpu => "reference:ggml-cpu".into(),
            e => format!("reference:{}", e.name()),
        }
    }

    fn rounding(&self) -> Emulation {
        self.emulation
    }

    fn reset(&mut self) {
        for c in self.k_cache.iter_mut().chain(self.v_cache.iter_mut()) {
            c.clear();
        }
        if let Some((k, v)) = &mut self.kv_raw {
            k.iter_mut().chain(v.iter_mut()).for_each(Vec::clear);
        }
        self.turn_start = 0;
    }

    fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        step: usize,
        sink: &mut dyn Sink,
    ) -> Result<&[f32], BackendError> {
        let m = self.model;
        super::check_inputs(&m.config, tokens, pos0, self.n_ctx)?;
        if tokens.len() > 1 && pos0 > 0 {
            self.turn_start = pos0;
        }
        let logits = arch::transformer::forward(m, self, tokens, pos0, step, sink);
        let nv = m.config.n_vocab;
        self.last_logits = logits[logits.len() - nv..].to_vec();
        Ok(&self.last_logits)
    }
}

/// The ops, plainly: one loop per op, f64 sums, the bug catalog at the op each bug lives in.
impl Reference<'_> {
    /// RoPE as the (possibly mutated) engine rotates: its base, pairing, factors and
    /// positions.
    fn rotate(
        &mut self,
        mut x: Vec<f32>,
        layer: usize,
        pos0: usize,
        n_heads: usize,
        r: &Rope,
    ) -> Vec<f32> {
        let mut r = *r;
        if self.mutated(Mutation::RopeTheta, Some(layer)) {
            r.base = mutation::wrong_theta(r.base);
        }
        if self.mutated(Mutation::RopeNeox, Some(layer)) {
            r.kind = mutation::other_rope(r.kind);
        }
        if self.mutated(Mutation::RopeFactorsIgnored, Some(layer)) {
            r.factors = None;
        }
        let factors = r.factors.map(|f| self.model.vector(f));
        // Positions restarting at a turn: counted from its first position.
        let pos0 = if self.mutated(Mutation::PosRestartPerTurn, Some(layer)) {
            pos0 - self.turn_start
        } else {
            pos0
        };
        // Positions a fitted rule says (q: the first rotation since the tap, k the second).
        if let Some(at) = self.rope_at {
            let rule = if self.ropes_since_tap == 1 {
                at.q
            } else {
                at.k
            };
            let row = n_heads * r.head_dim;
            for (t, x) in x.chunks_mut(row).enumerate() {
                let p = rule.at(pos0 + t, pos0);
                rope(x, p, n_heads, &r, factors.as_deref(), &mut Vec::new());
            }
            return x;
        }
        // Positions restarting every W (rope-pos-wrap): each row at its own position mod W.
        if let Some(w) = self.wrap(Mutation::RopePosWrap(0), layer) {
            let row = n_heads * r.head_dim;
            for (t, x) in x.chunks_mut(row).enumerate() {
                rope(
                    x,
                    (pos0 + t) % w,
                    n_heads,
                    &r,
                    factors.as_deref(),
                    &mut Vec::new(),
                );
            }
            return x;
        }
        // Decode steps rotated one position late (the cache slot stays right).
        let pos0 = if self.mutated(Mutation::RopePosOffByOne, Some(layer)) && pos0 > 0 {
            pos0 + 1
        } else {
            pos0
        };
        rope(
            &mut x,
            pos0,
            n_heads,
            &r,
            factors.as_deref(),
            &mut Vec::new(),
        );
        x
    }

    /// Whether the attention's (`attn`) or the feed-forward's residual add starts from the
    /// normed value (residual-from-normed, at both sites or at that one).
    fn residual_from_normed(&self, attn: bool, layer: Option<usize>) -> bool {
        let site = match attn {
            true => Mutation::AttnResidualFromNormed,
            false => Mutation::FfnResidualFromNormed,
        };
        self.mutated(Mutation::ResidualFromNormed, layer) || self.mutated(site, layer)
    }

    /// The RMSNorm formula a catalog bug computes instead (None: the model's).
    fn norm_formula(&self, layer: Option<usize>) -> Option<Mutation> {
        [
            Mutation::RmsSumNotMean,
            Mutation::RmsNoSqrt,
            Mutation::LayerNormNotRms,
        ]
        .into_iter()
        .find(|&m| self.mutated(m, layer))
    }
}

impl Ops for Reference<'_> {
    type Buf = Vec<f32>;

    fn embed(&mut self, w: &TensorInfo, tokens: &[u32]) -> Vec<f32> {
        let e = w.rows().0;
        let mut x = vec![0.0f32; tokens.len() * e];
        for (row, &id) in x.chunks_mut(e).zip(tokens) {
            // The embedding counts as layer 0 for bugs placed from a layer on.
            self.weight_row(w, Some(0), id as usize, row);
        }
        x
    }

    fn scale(&mut self, mut x: Vec<f32>, s: f32) -> Vec<f32> {
        // The only scale in the graph is gemma's embedding scale.
        if self.mutated(Mutation::NoEmbdScale, Some(0)) {
            return x;
        }
        x.iter_mut().for_each(|v| *v *= s);
        x
    }

    fn rms_norm(&mut self, x: &Vec<f32>, w: &TensorInfo, eps: f32) -> Vec<f32> {
        let layer = layer_of(&w.name);
        if (w.name == "output_norm.weight" && self.mutated(Mutation::NoFinalNorm, None))
            || (w.name.ends_with(".attn_norm.weight") && self.mutated(Mutation::NoAttnNorm, layer))
            || (w.name.ends_with(".ffn_norm.weight") && self.mutated(Mutation::NoFfnNorm, layer))
        {
            return x.clone();
        }
        let mut weight = self.model.vector(w);
        if self.mutated(Mutation::NormWeightMissing, layer) {
            weight.fill(1.0);
        }
        if self.mutated(Mutation::NormWeightTwice, layer)
            || (self.mutated(Mutation::AttnNormWeightTwice, layer)
                && w.name.ends_with(".attn_norm.weight"))
        {
            weight.iter_mut().for_each(|v| *v *= *v);
        }
        if self.mutated(Mutation::GemmaNormPlusOne, layer)
            || self.mutated(Mutation::NormWeightPlusOne, layer)
        {
            weight.iter_mut().for_each(|v| *v += 1.0);
        }
        let eps = if self.mutated(Mutation::RmsEps10x, layer) {
            eps * 10.0
        } else {
            eps
        };
        let out = match self.norm_formula(layer) {
            Some(m) => rms_norm_mutated(x, &weight, eps, m),
            None => rms_norm(x, &weight, eps),
        };
        let attn = w.name.ends_with(".attn_norm.weight");
        let ffn = w.name.ends_with(".ffn_norm.weight");
        if (attn && self.residual_from_normed(true, layer))
            || (ffn && self.residual_from_normed(false, layer))
        {
            self.normed = Some(out.clone());
        }
        out
    }

    fn head_norm(&mut self, x: Vec<f32>, w: &TensorInfo, eps: f32) -> Vec<f32> {
        let layer = layer_of(&w.name);
        if self.mutated(Mutation::QkNormSkipped, layer) {
            return x;
        }
        match self.norm_formula(layer) {
            Some(m) => rms_norm_mutated(&x, &self.model.vector(w), eps, m),
            None => rms_norm(&x, &self.model.vector(w), eps),
        }
    }

    fn matmul(&mut self, w: &TensorInfo, x: &Vec<f32>) -> Vec<f32> {
        let layer = layer_of(&w.name);
        let m = self.model;
        // The output projection: `output.weight`, or the embedding matrix when tied.
        let lm_head = layer.is_none();
        let w = if lm_head && w.name == "output.weight" && self.mutated(Mutation::TiedOutput, None)
        {
            &m.token_embd
        } else {
            w
        };
        // A fused QKV split with K and V swapped reads each from the other's rows.
        // (Found by offset: a judge window's model holds only some layers.)
        let swapped = self.mutated(Mutation::QkvSplitOrder, layer).then(|| {
            m.layers.iter().find_map(|lw| {
                let fused = mutation::fused_qkv(lw);
                if fused && w.offset == lw.wk.offset {
                    Some(&lw.wv)
                } else if fused && w.offset == lw.wv.offset {
                    Some(&lw.wk)
                } else {
                    None
                }
            })
        });
        let w = swapped.flatten().unwrap_or(w);
        let t = x.len() / w.rows().0;
        let transposed = (lm_head && self.mutated(Mutation::TransposedLmHead, None))
            || (w.name.ends_with("attn_output.weight")
                && self.mutated(Mutation::TransposedWo, layer));
        let nibbles = self.decoder_bug(w, layer).is_some();
        let own = self.emulation;
        if lm_head && let Some(e) = self.output_emulation {
            self.emulation = e;
        }
        let y = if transposed || nibbles {
            self.project_mutated(w, layer, x, t, transposed)
        } else {
            self.matmul_plain(w, x, t)
        };
        self.emulation = own;
        y
    }

    fn add_bias(&mut self, mut x: Vec<f32>, b: &TensorInfo) -> Vec<f32> {
        // The only biases in the graph are q's, k's and v's.
        if !self.mutated(Mutation::NoQkvBias, layer_of(&b.name)) {
            add_bias(&mut x, &self.model.vector(b));
        }
        x
    }

    fn rope(
        &mut self,
        mut x: Vec<f32>,
        layer: usize,
        pos0: usize,
        n_heads: usize,
        r: &Rope,
    ) -> Vec<f32> {
        // The forward rotates q, then k, between two taps.
        self.ropes_since_tap += 1;
        let skipped = match self.ropes_since_tap {
            1 => Mutation::RopeQSkipped,
            _ => Mutation::RopeKSkipped,
        };
        if self.mutated(skipped, Some(layer)) {
            return x;
        }
        // R(-θ) = C·R(θ)·C, C flipping the sign of each pair's second element (exact).
        if self.mutated(Mutation::RopeAngleNegated, Some(layer)) {
            conjugate_pairs(&mut x, r);
            let mut y = self.rotate(x, layer, pos0, n_heads, r);
            conjugate_pairs(&mut y, r);
            return y;
        }
        self.rotate(x, layer, pos0, n_heads, r)
    }

    fn kv_store(&mut self, layer: usize, pos0: usize, k: &Vec<f32>, v: &Vec<f32>) {
        let ekv = self.model.config.n_embd_kv();
        let t = k.len() / ekv;
        // A decode step with kv-off-by-one writes one slot late (past the end: nowhere).
        let late = (self.mutated(Mutation::KvOffByOne, Some(layer)) && pos0 > 0)
            || self.mutated(Mutation::KvSlotLate, Some(layer));
        let slot = if late { pos0 + 1 } else { pos0 };
        // The cache holds the positions run so far (zeros where nothing was written), not the
        // whole context: a 7B's 256 positions would be 270 MB per reference, mostly unused.
        let held = (pos0 + t).max(slot + t).min(self.n_ctx) * ekv;
        for c in [&mut self.k_cache[layer], &mut self.v_cache[layer]] {
            if c.len() < held {
                c.resize(held, 0.0);
            }
        }
        if let Some((kr, vr)) = &mut self.kv_raw {
            for (c, x) in [(&mut kr[layer], k), (&mut vr[layer], v)] {
                if c.len() < held {
                    c.resize(held, 0.0);
                }
                if slot + t <= self.n_ctx {
                    c[slot * ekv..(slot + t) * ekv].copy_from_slice(x);
                }
            }
        }
        if slot + t <= self.n_ctx {
            let hd = self.model.config.head_dim;
            let (kc, vc) = (
                &mut self.k_cache[layer][slot * ekv..(slot + t) * ekv],
                &mut self.v_cache[layer][slot * ekv..(slot + t) * ekv],
            );
            kc.copy_from_slice(k);
            vc.copy_from_slice(v);
            store_rows(&self.kv, hd, ekv, true, kc);
            store_rows(&self.kv, hd, ekv, false, vc);
        }
    }

    fn attn_probs(&mut self, layer: usize, q: &Vec<f32>, a: &Attn) -> Vec<f32> {
        let (t, n_kv) = (a.n_tokens, a.n_kv());
        let mut probs = vec![0.0f32; a.n_head * t * n_kv];
        let rot = self
            .kv
            .k_rotation(a.head_dim)
            .map(|n| (n, kvcache::hadamard(n)));
        let this = &*self;
        // The heads are independent: on rayon's threads where the work is worth it, each the
        // same sums.
        let work = a.n_head * t * n_kv * a.head_dim;
        let flash_scores: Vec<Vec<Vec<(usize, f32)>>> =
            map_chunks(&mut probs, t * n_kv, work, |h, p| {
                this.head_probs(layer, q, a, h, rot.as_ref(), p)
            });
        self.flash_scores = flash_scores.into_iter().flatten().collect();
        probs
    }

    fn attn_values(&mut self, layer: usize, p: &Vec<f32>, a: &Attn) -> Vec<f32> {
        let (nh, t, n_kv) = (a.n_head, a.n_tokens, a.n_kv());
        // Flash attention over an f16 V: the scores of `attn_probs` accumulated online in f16.
        let flash = std::mem::take(&mut self.flash_scores);
        let flash = (self.kv.f16_accumulator(t) && flash.len() == nh * t).then_some(flash);
        let this = &*self;
        // The heads are independent: on rayon's threads where the work is worth it, each the
        // same sums.
        let heads = map_range(nh, nh * t * n_kv * a.head_dim, |h| {
            let f = flash.as_ref().map(|f| &f[h * t..][..t]);
            this.head_values(layer, &p[h * t * n_kv..][..t * n_kv], a, h, f)
        });
        self.gather_heads(heads, a)
    }

    /// A head at a time, its probabilities in a buffer of its own and consumed at once: the
    /// same numbers as `attn_probs` then `attn_values`, never every head's probabilities.
    fn attention(&mut self, layer: usize, q: &Vec<f32>, a: &Attn) -> Vec<f32> {
        let (t, n_kv) = (a.n_tokens, a.n_kv());
        let rot = self
            .kv
            .k_rotation(a.head_dim)
            .map(|n| (n, kvcache::hadamard(n)));
        let flash = self.kv.f16_accumulator(t);
        let this = &*self;
        let heads = map_range(a.n_head, 2 * a.n_head * t * n_kv * a.head_dim, |h| {
            let mut p = vec![0.0f32; t * n_kv];
            let scores = this.head_probs(layer, q, a, h, rot.as_ref(), &mut p);
            // As `attn_values`: flash only where every row saw a position.
            let f = (flash && scores.len() == t).then_some(&scores[..]);
            this.head_values(layer, &p, a, h, f)
        });
        self.gather_heads(heads, a)
    }

    fn glu(&mut self, gate: Vec<f32>, up: &Vec<f32>, act: Activation) -> Vec<f32> {
        // The op knows no layer: the last tap before it (ffn_up) said which.
        let swap = self.mutated(Mutation::SwigluSwap, self.layer_now);
        let act = match (act, self.mutated(Mutation::WrongFfnAct, self.layer_now)) {
            (a, false) => a,
            (Activation::Silu, true) => Activation::GeluTanh,
            (Activation::GeluTanh, true) => Activation::Silu,
        };
        // x / (1 + e^x) = −silu(−x), bit for bit.
        let wrong_sign = self.mutated(Mutation::SiluWrongSign, self.layer_now);
        let f = |g: f32, u: f32| match act {
            Activation::Silu if wrong_sign => -silu(-g) * u,
            Activation::Silu => silu(g) * u,
            Activation::GeluTanh => gelu(g, self.emulation) * u,
        };
        gate.iter()
            .zip(up)
            .map(|(&g, &u)| if swap { f(u, g) } else { f(g, u) })
            .collect()
    }

    fn add(&mut self, a: Vec<f32>, b: &Vec<f32>) -> Vec<f32> {
        // The op knows no place: the last tap before it says which residual this is.
        let attn = matches!(self.tap_now, Some(Tap::AttnOut | Tap::AttnPostNorm));
        let ffn = matches!(self.tap_now, Some(Tap::FfnOut | Tap::FfnPostNorm));
        let l = self.layer_now;
        if (attn && self.mutated(Mutation::AttnOutTwice, l))
            || (ffn && self.mutated(Mutation::FfnOutTwice, l))
        {
            return add(&add(&a, b), b);
        }
        // `a` is the residual stream, `b` the block's output.
        if ((attn && self.residual_from_normed(true, l))
            || (ffn && self.residual_from_normed(false, l)))
            && let Some(n) = self.normed.take().filter(|n| n.len() == a.len())
        {
            return add(&n, b);
        }
        if (attn && self.mutated(Mutation::NoAttnResidual, l))
            || (ffn && self.mutated(Mutation::NoFfnResidual, l))
        {
            return b.clone();
        }
        add(&a, b)
    }

    fn softcap(&mut self, mut x: Vec<f32>, cap: f32) -> Vec<f32> {
        // The only soft-cap op in the graph is the final one.
        if self.mutated(Mutation::NoSoftcap, None) {
            return x;
        }
        x.iter_mut().for_each(|v| *v = softcap(*v, cap));
        x
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn leave_layer(&mut self, layer: usize) {
        self.model.release_layer(layer);
    }

    fn last_row(&mut self, x: Vec<f32>, width: usize) -> Vec<f32> {
        x[x.len() - width..].to_vec()
    }

    fn rows(&mut self, x: &Vec<f32>, width: usize, r: std::ops::Range<usize>) -> Option<Vec<f32>> {
        Some(x[r.start * width..r.end * width].to_vec())
    }

    fn tap_rows(
        &mut self,
        sink: &mut dyn Sink,
        key: TapKey,
        shape: &[usize],
        row0: usize,
        x: &Vec<f32>,
    ) {
        self.at_tap(key);
        sink.record_rows(key, shape, row0, x);
    }

    fn tap(&mut self, sink: &mut dyn Sink, key: TapKey, shape: &[usize], x: &mut Vec<f32>) {
        let (step, layer) = (key.step, key.layer);
        self.at_tap(key);
        match key.tap {
            // An engine that lays q/k heads out as HF does (the converter's permutation
            // undone): every op after this point sees the permuted tensor.
            Tap::Q | Tap::K if self.mutated(Mutation::QkPermute, layer) => {
                *x = mutation::permute_heads(x, shape[1], shape[2]);
            }
            // An engine that stores q_rope head-major: only the stored tensor differs.
            Tap::QRope if self.mutated(Mutation::HeadMajorQRope, layer) => {
                let (t, nh, hd) = (shape[0], shape[1], shape[2]);
                let hm = mutation::to_head_major(x, t, nh, hd);
                return tap(sink, step, layer, key.tap, &[nh, t, hd], &hm);
            }
            _ => {}
        }
        tap_mut(sink, step, layer, key.tap, shape, x);
    }
}

/// Softmax as ggml: subtract the max, exp in f32, sum in f64, multiply by 1/sum.
pub(crate) fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// [`softmax`] without the max subtracted (the catalog's softmax-no-max): a score over
/// ln(f32::MAX) gives exp = Inf, so 1/sum = 0 and Inf·0 = NaN there, 0 beside it.
fn softmax_no_max(x: &mut [f32]) {
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = v.exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Model {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        Model::open(root.join("fixtures").join(name)).unwrap()
    }

    /// A xorshift64 stream from `seed`: the tests' pseudo-random bits.
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// A value in [-0.5, 0.5) from the top bits of `r`.
    fn unit(r: u64) -> f32 {
        (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    /// Pseudo-random inputs of a few magnitudes.
    fn inputs(n: usize) -> Vec<f32> {
        let mut bits = xorshift(0x9e37_79b9_7f4a_7c15);
        (0..n)
            .map(|_| {
                let r = bits();
                unit(r) * 2f32.powi((r % 6) as i32)
            })
            .collect()
    }

    /// On an 8-bit grid (ggml-cpu and its two tie twins) a Q4_0 or Q8_0 weight's matmul goes
    /// through the exact integer kernel: each output within an f32 ulp (plus what two f64
    /// sums may differ by) of the f64 sum of the decoded weights times the rounded inputs, and
    /// the same bits on one thread as on every core.
    /// A weight read transposed or row by row (the weight-reading bugs) without the whole
    /// weight decoded at once is the same matmul as with it: every output of the flat
    /// weight's own reading, bit for bit, across column blocks (7 wide in lib tests) and
    /// weights wider and narrower than they are deep, plain and f16-accumulating.
    #[test]
    fn a_mutated_weight_read_in_blocks_is_the_whole_weight_s() {
        let model = fixture("tiny-llama-q8_0.gguf");
        let l = &model.layers[0];
        for e in [Emulation::None, Emulation::F16Acc] {
            let r = Reference::new(&model, e, 8);
            for w in [&l.wk, &l.wq, &model.output] {
                let (n_in, n_out) = w.rows();
                let t = 3;
                let x = inputs(t * n_in);
                let xr = r.emulate_input(w.ty, &x, n_in).x;
                let mut flat = vec![0.0f32; n_in * n_out];
                for (k, row) in flat.chunks_mut(n_in).enumerate() {
                    model.row(w, k, row);
                }
                for transposed in [false, true] {
                    let got = r.project_mutated(w, Some(0), &x, t, transposed);
                    for o in 0..n_out {
                        let wr: Vec<f32> = (0..n_in)
                            .map(|j| {
                                if transposed {
                                    flat[j * n_out + o]
                                } else {
                                    flat[o * n_in + j]
                                }
                            })
                            .collect();
                        for i in 0..t {
                            let want = r.dot(w.ty, &wr, &xr[i * n_in..(i + 1) * n_in]);
                            assert_eq!(
                                got[i * n_out + o].to_bits(),
                                want.to_bits(),
                                "{e:?} {} transposed {transposed} output {o} row {i}",
                                w.name
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn exact_matmuls_are_the_f64_sums_on_an_8_bit_grid() {
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        for file in ["tiny-llama-q4_0.gguf", "tiny-llama-q8_0.gguf"] {
            let model = fixture(file);
            let l = &model.layers[1];
            for e in [
                Emulation::GgmlCpu,
                Emulation::GgmlScalar,
                Emulation::Q8_1Gpu,
            ] {
                let r = Reference::new(&model, e, 8);
                for w in [&l.wq, &l.wk, &l.w_down, &model.output] {
                    assert!(w.ty.format().exact.is_some(), "{file}: {}", w.name);
                    let (n_in, _) = w.rows();
                    let t = 5;
                    let rounded = r.matmul_input(w.ty, &inputs(t * n_in), n_in);
                    assert!(rounded.q8.is_some(), "{file} {e:?}: on Q8_0's grid");
                    let exact = matmul_f64(&model, w, &[&rounded], t).remove(0);
                    let plain = Rounded::plain(rounded.x.clone());
                    let want = matmul_f64(&model, w, &[&plain], t).remove(0);
                    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (i, (a, b)) in exact.iter().zip(&want).enumerate() {
                        let tol = f32::EPSILON * a.abs().max(b.abs()) + 1e-12 * scale;
                        assert!(
                            (a - b).abs() <= tol,
                            "{file} {e:?} {} output {i}: {a} vs {b}",
                            w.name
                        );
                    }
                    // Through the format's kernel, not the f32 rows.
                    let mut a = quant::TileAct::default();
                    a.load_q8(rounded.q8.as_ref().unwrap(), n_in);
                    let mut by_row = vec![0f32; exact.len()];
                    (w.ty.format().exact.unwrap())(model.data(w), &a, &mut by_row);
                    let n_out = exact.len() / t;
                    for (i, v) in exact.iter().enumerate() {
                        assert_eq!(v.to_bits(), by_row[i % n_out * t + i / n_out].to_bits());
                    }
                    let alone = one.install(|| matmul_f64(&model, w, &[&rounded], t).remove(0));
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&alone), bits(&exact), "{file} {e:?} {}", w.name);
                }
            }
        }
    }

    /// Attention runs one head per thread: every tap of a prefill and decode steps is the
    /// same bits on one thread as on every core (plain and ggml-cpu, f32 and f16 caches).
    #[test]
    fn attention_is_the_same_on_one_thread() {
        use crate::trace::{MemorySink, TapFilter};
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let model = fixture("tiny-llama-q8_0.gguf");
        let prompt: Vec<u32> = (1..40).map(|i| (i * 7 % 200) as u32).collect();
        for (e, kv) in [
            (Emulation::None, KvCache::F32),
            (Emulation::GgmlCpu, KvCache::F16),
        ] {
            let run = || {
                let mut b = Reference::new(&model, e, 48).with_kv(kv);
                let mut s = MemorySink::new(TapFilter::all());
                super::super::run(&mut b, &prompt, 3, None, &mut s).unwrap();
                s.tensors
            };
            let (many, alone) = (run(), one.install(run));
            assert!(many.len() > 50);
            for (k, x) in &many {
                let bits =
                    |x: &ndarray::ArrayD<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(x), bits(&alone[k]), "{e:?} {kv:?} {k}");
            }
        }
    }

    /// `dots_f64` + `dot_finish` (AVX2 where the CPU has it) return `dot`'s bits: any length,
    /// spans and tails, odd and even token counts, values across many magnitudes (where the
    /// order of a sum shows); and the scalar twins agree with the AVX2 kernels.
    #[test]
    fn tiled_dots_are_dot_bit_for_bit() {
        let mut bits = xorshift(0x2545_f491_4f6c_dd1d);
        let mut next = move || {
            let r = bits();
            unit(r) * 2f32.powi((r % 40) as i32 - 20)
        };
        for (n, t) in [
            (1, 1),
            (7, 2),
            (8, 3),
            (9, 1),
            (31, 4),
            (1024, 2),
            (1031, 5),
            (2500, 3),
        ] {
            let rows: Vec<f32> = (0..4 * n).map(|_| next()).collect();
            let x: Vec<f32> = (0..t * n).map(|_| next()).collect();
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let mut acc = vec![[0.0f64; 8]; 4 * t];
            dots_f64(&rows, &x64, &mut acc);
            for k in 0..4 {
                for i in 0..t {
                    let (wr, xr) = (&rows[k * n..][..n], &x[i * n..][..n]);
                    let got = dot_finish(wr, &x64[i * n..][..n], acc[k * t + i]);
                    assert_eq!(
                        got.to_bits(),
                        dot(wr, xr).to_bits(),
                        "n {n} t {t} ({k}, {i})"
                    );
                }
            }
            let whole = n / 8 * 8;
            let w4: [&[f32]; 4] = std::array::from_fn(|k| &rows[k * n..][..whole]);
            let (mut a, mut b) = ([[0.0f64; 8]; 4], [[0.0f64; 8]; 4]);
            sums_4x1(w4, &x64[..whole], &mut a);
            for k in 0..4 {
                sums_scalar(w4[k], &x64[..whole], &mut b[k]);
            }
            assert_eq!(a, b, "4x1 twin, n {n}");
        }
    }

    /// Attention's kernels (AVX2 where the CPU has it) give their scalar twins' bits: `dot`
    /// as `dot_read`, `weighted_rows` as the loop it replaced, at every head size's tail
    /// (lengths 1 to 70), over many magnitudes, with zeros of either sign, infinities and NaN.
    #[test]
    fn attention_kernels_are_their_scalar_twins_bit_for_bit() {
        let mut bits = xorshift(0x9e37_79b9_7f4a_7c15);
        let mut next = move || {
            let r = bits();
            match r % 97 {
                0 => -0.0,
                1 => 0.0,
                2 => f32::INFINITY,
                3 => f32::NAN,
                _ => unit(r) * 2f32.powi((r % 50) as i32 - 25),
            }
        };
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for n in 1..=70 {
            for _ in 0..20 {
                let (a, b): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (next(), next())).unzip();
                let (got, want) = (dot(&a, &b), dot_read(&a, &b, |v| v));
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "dot n {n}: {got} vs {want}"
                );
            }
            let rows = 37;
            let v: Vec<f32> = (0..rows * n).map(|_| next()).collect();
            let p: Vec<f32> = (0..rows).map(|_| next().abs()).collect();
            for js in [0..rows, 3..29, 5..5] {
                let (mut got, mut want) = (vec![-0.0f64; n], vec![-0.0f64; n]);
                weighted_rows(&mut got, js.clone(), &p, |j| &v[j * n..][..n]);
                weighted_rows_scalar(&mut want, js.clone(), &p, |j| &v[j * n..][..n], 0);
                let nan = |v: &[f64]| v.iter().map(|x| x.is_nan()).collect::<Vec<_>>();
                assert_eq!(nan(&got), nan(&want), "weighted_rows n {n} {js:?}");
                let finite = |v: &[f64]| {
                    bits(
                        &v.iter()
                            .map(|&x| if x.is_nan() { 0.0 } else { x })
                            .collect::<Vec<_>>(),
                    )
                };
                assert_eq!(finite(&got), finite(&want), "weighted_rows n {n} {js:?}");
            }
        }
    }
}
