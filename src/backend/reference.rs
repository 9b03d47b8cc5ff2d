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

use super::mutation::{self, Mutation};
use super::{Backend, BackendError};
use crate::gguf::{GgmlType, TensorInfo};
use crate::model::{Model, RopeType};
use crate::quant;
use crate::trace::{Sink, Tap, tap, tap_mut};
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Emulation {
    /// Plain f32 activations.
    None,
    /// Quantize matmul inputs the way ggml's CPU backend does.
    GgmlCpu,
    /// Round matmul inputs to f16, as GPU engines that keep activations in f16 do.
    F16,
}

impl Emulation {
    /// The name `parse` reads and manifests record.
    pub fn name(self) -> &'static str {
        match self {
            Emulation::None => "none",
            Emulation::GgmlCpu => "ggml-cpu",
            Emulation::F16 => "f16",
        }
    }

    pub fn parse(s: &str) -> Option<Emulation> {
        match s {
            "none" => Some(Emulation::None),
            "ggml-cpu" => Some(Emulation::GgmlCpu),
            "f16" => Some(Emulation::F16),
            _ => None,
        }
    }
}

pub struct Reference<'m> {
    model: &'m Model,
    emulation: Emulation,
    n_ctx: usize,
    /// Per layer: post-RoPE keys and values, `[n_ctx, n_embd_kv]` row-major.
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    /// The last row's logits of the latest forward.
    last_logits: Vec<f32>,
    /// A known engine bug to reproduce (`parity dump --mutate`), or none.
    mutation: Option<Mutation>,
    /// The bug acts from this layer on (and on the output ops); 0: everywhere.
    mutation_from: usize,
    /// The layer `forward` is in (the embedding counts as layer 0; None after the layers).
    layer_now: Option<usize>,
}

impl<'m> Reference<'m> {
    pub fn new(model: &'m Model, emulation: Emulation, n_ctx: usize) -> Self {
        let c = &model.config;
        let n_ctx = n_ctx.min(c.n_ctx_train).max(1);
        let kv = n_ctx * c.n_embd_kv();
        Reference {
            model,
            emulation,
            n_ctx,
            k_cache: vec![vec![0.0; kv]; c.n_layer],
            v_cache: vec![vec![0.0; kv]; c.n_layer],
            last_logits: Vec::new(),
            mutation: None,
            mutation_from: 0,
            layer_now: None,
        }
    }

    /// Behave like an engine with bug `m` (see [`Mutation`]); `None` is the correct engine.
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

    fn mutated(&self, m: Mutation) -> bool {
        self.mutation == Some(m) && self.layer_now.is_none_or(|l| l >= self.mutation_from)
    }

    /// A weight matmul as the (possibly mutated) engine does it: [`Self::matmul`] unless the
    /// decoder-nibble-order bug changes how `w` decodes, or `transposed` reads it transposed.
    fn project(&self, w: &TensorInfo, x: &[f32], t: usize, transposed: bool) -> Vec<f32> {
        let nibbles = self.mutated(Mutation::DecoderNibbleOrder) && mutation::swaps_nibbles(w.ty);
        if !nibbles && !transposed {
            return self.matmul(w, x, t);
        }
        let (n_in, n_out) = w.rows();
        let x = self.emulate_input(w.ty, x, n_in);
        let mut flat = vec![0.0f32; n_in * n_out];
        for (r, row) in flat.chunks_mut(n_in).enumerate() {
            self.weight_row(w, r, row);
        }
        let mut out = vec![0.0f32; t * n_out];
        let mut col = vec![0.0f32; n_in];
        for r in 0..n_out {
            // Transposed: output r reads W_flat[i * n_out + r] instead of W_flat[r * n_in + i].
            let wr: &[f32] = if transposed {
                for (i, c) in col.iter_mut().enumerate() {
                    *c = flat[i * n_out + r];
                }
                &col
            } else {
                &flat[r * n_in..(r + 1) * n_in]
            };
            for i in 0..t {
                out[i * n_out + r] = dot(wr, &x[i * n_in..(i + 1) * n_in]);
            }
        }
        out
    }

    /// Row `r` of a weight as the (possibly mutated) engine decodes it.
    fn weight_row(&self, w: &TensorInfo, r: usize, out: &mut [f32]) {
        if self.mutated(Mutation::DecoderNibbleOrder) && mutation::swaps_nibbles(w.ty) {
            let (n_in, _) = w.rows();
            let rb = w.ty.bytes_for(n_in as u64).expect("validated at open") as usize;
            let bytes = mutation::swap_nibbles(w.ty, &self.model.data(w)[r * rb..(r + 1) * rb]);
            quant::dequantize_row(w.ty, &bytes, out).expect("row length validated at open");
        } else {
            self.model.row(w, r, out);
        }
    }

    /// RMSNorm as the (possibly mutated) engine does it.
    fn norm(&self, x: &[f32], w: &TensorInfo) -> Vec<f32> {
        let c = &self.model.config;
        let mut weight = self.model.vector(w);
        if self.mutated(Mutation::NormWeightMissing) {
            weight.fill(1.0);
        }
        if self.mutated(Mutation::NormWeightTwice) {
            weight.iter_mut().for_each(|v| *v *= *v);
        }
        let eps = if self.mutated(Mutation::RmsEps10x) {
            c.rms_eps * 10.0
        } else {
            c.rms_eps
        };
        rms_norm(x, &weight, eps)
    }

    /// out[t, r] = Σ_i W[r, i] · x[t, i] for the T rows of `x`. `W` is `[n_in, n_out]` in ggml
    /// order: row r of the stored matrix is output r.
    pub(crate) fn matmul(&self, w: &TensorInfo, x: &[f32], t: usize) -> Vec<f32> {
        let (n_in, n_out) = w.rows();
        let x = self.emulate_input(w.ty, x, n_in);
        // Output rows are independent: split them over threads in chunks (rayon), each with
        // its own row buffer. Every dot is the same f64 sum as single-threaded, so the result
        // is bit-identical whatever the thread count.
        const ROWS: usize = 64;
        let mut by_row = vec![0.0f32; n_out * t];
        by_row
            .par_chunks_mut(ROWS * t)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut row = vec![0.0f32; n_in];
                for (k, o) in chunk.chunks_mut(t).enumerate() {
                    self.model.row(w, c * ROWS + k, &mut row);
                    for (i, v) in o.iter_mut().enumerate() {
                        *v = dot(&row, &x[i * n_in..(i + 1) * n_in]);
                    }
                }
            });
        let mut out = vec![0.0f32; t * n_out];
        for (r, o) in by_row.chunks(t).enumerate() {
            for (i, &v) in o.iter().enumerate() {
                out[i * n_out + r] = v;
            }
        }
        out
    }

    /// The activation rounding ggml's CPU applies before a matmul with a `ty` weight.
    fn emulate_input(&self, ty: GgmlType, x: &[f32], n_in: usize) -> Vec<f32> {
        if self.emulation == Emulation::F16 {
            return x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        }
        let act = quant::vec_dot_type(ty);
        if self.emulation == Emulation::None || act == GgmlType::F32 {
            return x.to_vec();
        }
        let mut y = vec![0.0f32; x.len()];
        let mut q = vec![0u8; act.bytes_for(n_in as u64).expect("whole blocks") as usize];
        for (src, dst) in x.chunks(n_in).zip(y.chunks_mut(n_in)) {
            quant::quantize_activation(act, src, &mut q);
            quant::dequantize_row(act, &q, dst).expect("same length");
        }
        y
    }
}

/// Dot product, accumulated in f64 so that the reference's own rounding stays far below
/// every tolerance. Eight running sums (element i goes to sum i % 8) instead of one let the
/// compiler use vector registers; in f64 the order changes nothing a tolerance could see.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] as f64 * y[k] as f64;
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(&x, &y)| x as f64 * y as f64).sum();
    (acc.iter().sum::<f64>() + tail) as f32
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

/// Rotate each head of `x` (`[T, n_heads, head_dim]`) by its position, as ggml_rope_ext with
/// ext_factor 0: theta_i = pos · freq_scale · base^(-2i/n_rot), computed by repeated
/// multiplication like ggml's rope cache. Norm pairs (2i, 2i+1); Neox pairs (i, i + n_rot/2).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope(
    x: &mut [f32],
    positions: &[usize],
    n_heads: usize,
    head_dim: usize,
    n_rot: usize,
    base: f32,
    freq_scale: f32,
    kind: RopeType,
) {
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    for (t, &pos) in positions.iter().enumerate() {
        let mut cache = vec![(0.0f32, 0.0f32); n_rot / 2];
        let mut theta = pos as f32;
        for c in cache.iter_mut() {
            let th = freq_scale * theta;
            *c = (th.cos(), th.sin());
            theta *= theta_scale;
        }
        for h in 0..n_heads {
            let v = &mut x[(t * n_heads + h) * head_dim..][..head_dim];
            for (i, &(cos, sin)) in cache.iter().enumerate() {
                let (a, b) = match kind {
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
            Emulation::F16 => "reference:f16".into(),
        }
    }

    fn rounding(&self) -> Emulation {
        self.emulation
    }

    fn reset(&mut self) {
        for c in self.k_cache.iter_mut().chain(self.v_cache.iter_mut()) {
            c.fill(0.0);
        }
    }

    fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        step: usize,
        sink: &mut dyn Sink,
    ) -> Result<&[f32], BackendError> {
        let m = self.model;
        let c = &m.config;
        let t = tokens.len();
        if t == 0 {
            return Err(BackendError::Empty);
        }
        if pos0 + t > self.n_ctx {
            return Err(BackendError::ContextOverflow {
                end: pos0 + t,
                n_ctx: self.n_ctx,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.n_vocab) {
            return Err(BackendError::BadToken {
                id,
                n_vocab: c.n_vocab,
            });
        }
        let (e, hd, nh, nkv) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv);
        let (eq, ekv) = (c.n_embd_q(), c.n_embd_kv());
        let positions: Vec<usize> = (pos0..pos0 + t).collect();
        let n_kv = pos0 + t;

        // Token embedding: one row of token_embd per token.
        self.layer_now = Some(0);
        let mut x = vec![0.0f32; t * e];
        for (i, &id) in tokens.iter().enumerate() {
            self.weight_row(&m.token_embd, id as usize, &mut x[i * e..(i + 1) * e]);
        }
        tap_mut(sink, step, None, Tap::Embd, &[t, e], &mut x);

        for (l, w) in m.layers.iter().enumerate() {
            let ly = Some(l);
            self.layer_now = ly;

            // Attention block.
            let mut xn = self.norm(&x, &w.attn_norm);
            tap_mut(sink, step, ly, Tap::AttnNorm, &[t, e], &mut xn);

            let mut q = self.project(&w.wq, &xn, t, false);
            let mut k = self.project(&w.wk, &xn, t, false);
            let mut v = self.project(&w.wv, &xn, t, false);
            if let Some(b) = &w.bq {
                add_bias(&mut q, &m.vector(b));
            }
            if let Some(b) = &w.bk {
                add_bias(&mut k, &m.vector(b));
            }
            if let Some(b) = &w.bv {
                add_bias(&mut v, &m.vector(b));
            }
            if self.mutated(Mutation::QkPermute) {
                q = mutation::permute_heads(&q, nh, hd);
                k = mutation::permute_heads(&k, nkv, hd);
            }
            tap_mut(sink, step, ly, Tap::Q, &[t, nh, hd], &mut q);
            tap_mut(sink, step, ly, Tap::K, &[t, nkv, hd], &mut k);
            tap_mut(sink, step, ly, Tap::V, &[t, nkv, hd], &mut v);

            let (mut base, scale, mut pairing) = (c.rope_theta, c.rope_freq_scale, c.rope_type);
            if self.mutated(Mutation::RopeTheta) {
                base = mutation::wrong_theta(base);
            }
            if self.mutated(Mutation::RopeNeox) {
                pairing = mutation::other_rope(pairing);
            }
            rope(&mut q, &positions, nh, hd, c.n_rot, base, scale, pairing);
            rope(&mut k, &positions, nkv, hd, c.n_rot, base, scale, pairing);
            if self.mutated(Mutation::HeadMajorQRope) {
                let hm = mutation::to_head_major(&q, t, nh, hd);
                tap(sink, step, ly, Tap::QRope, &[nh, t, hd], &hm);
            } else {
                tap_mut(sink, step, ly, Tap::QRope, &[t, nh, hd], &mut q);
            }
            tap_mut(sink, step, ly, Tap::KRope, &[t, nkv, hd], &mut k);

            // Append this step's keys and values to the cache at their positions (a decode
            // step with kv-off-by-one writes them one slot later; past the end, nowhere).
            let slot = if self.mutated(Mutation::KvOffByOne) && pos0 > 0 {
                pos0 + 1
            } else {
                pos0
            };
            if slot + t <= self.n_ctx {
                self.k_cache[l][slot * ekv..(slot + t) * ekv].copy_from_slice(&k);
                self.v_cache[l][slot * ekv..(slot + t) * ekv].copy_from_slice(&v);
            }
            let (kc, vc) = (&self.k_cache[l], &self.v_cache[l]);

            // Causal attention: query i (position pos0+i) sees cache positions 0..=pos0+i.
            // Query head h reads kv head h / (n_head / n_head_kv) (GQA).
            let group = nh / nkv;
            let kv_head = |h: usize| {
                if self.mutated(Mutation::GqaModulo) {
                    h % nkv
                } else {
                    h / group
                }
            };
            let no_mask = self.mutated(Mutation::NoCausalMask);
            let kq_scale = 1.0 / (hd as f32).sqrt();
            let mut probs = vec![0.0f32; nh * t * n_kv];
            for h in 0..nh {
                for i in 0..t {
                    let qv = &q[(i * nh + h) * hd..][..hd];
                    let p = &mut probs[(h * t + i) * n_kv..][..n_kv];
                    let visible = if no_mask { n_kv } else { pos0 + i + 1 };
                    for j in 0..visible {
                        p[j] = dot(qv, &kc[j * ekv + kv_head(h) * hd..][..hd]) * kq_scale;
                    }
                    softmax(&mut p[..visible]);
                }
            }
            tap_mut(sink, step, ly, Tap::KqSoftMax, &[nh, t, n_kv], &mut probs);

            // Attention output: probability-weighted sum of the cached values.
            let mut att = vec![0.0f32; t * eq];
            for h in 0..nh {
                for i in 0..t {
                    let visible = if no_mask { n_kv } else { pos0 + i + 1 };
                    let p = &probs[(h * t + i) * n_kv..][..visible];
                    let out = &mut att[i * eq + h * hd..][..hd];
                    for (d, o) in out.iter_mut().enumerate() {
                        let s: f64 = p
                            .iter()
                            .enumerate()
                            .map(|(j, &pj)| pj as f64 * vc[j * ekv + kv_head(h) * hd + d] as f64)
                            .sum();
                        *o = s as f32;
                    }
                }
            }
            tap_mut(sink, step, ly, Tap::KqvOut, &[t, eq], &mut att);

            let wo_t = self.mutated(Mutation::TransposedWo);
            let mut attn_out = self.project(&w.wo, &att, t, wo_t);
            tap_mut(sink, step, ly, Tap::AttnOut, &[t, e], &mut attn_out);
            let mut ffn_inp = add(&x, &attn_out);
            tap_mut(sink, step, ly, Tap::FfnInp, &[t, e], &mut ffn_inp);

            // Feed-forward block (SwiGLU).
            let mut xn = self.norm(&ffn_inp, &w.ffn_norm);
            tap_mut(sink, step, ly, Tap::FfnNorm, &[t, e], &mut xn);
            let mut gate = self.project(&w.w_gate, &xn, t, false);
            tap_mut(sink, step, ly, Tap::FfnGate, &[t, c.n_ff], &mut gate);
            let mut up = self.project(&w.w_up, &xn, t, false);
            tap_mut(sink, step, ly, Tap::FfnUp, &[t, c.n_ff], &mut up);
            let mut act: Vec<f32> = if self.mutated(Mutation::SwigluSwap) {
                gate.iter().zip(&up).map(|(&g, &u)| silu(u) * g).collect()
            } else {
                gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect()
            };
            tap_mut(sink, step, ly, Tap::FfnAct, &[t, c.n_ff], &mut act);
            let mut ffn_out = self.project(&w.w_down, &act, t, false);
            tap_mut(sink, step, ly, Tap::FfnOut, &[t, e], &mut ffn_out);

            x = add(&ffn_inp, &ffn_out);
            tap_mut(sink, step, ly, Tap::LOut, &[t, e], &mut x);
        }

        self.layer_now = None;
        let mut xn = self.norm(&x, &m.output_norm);
        tap_mut(sink, step, None, Tap::ResultNorm, &[t, e], &mut xn);
        let output = if self.mutated(Mutation::TiedOutput) {
            &m.token_embd
        } else {
            &m.output
        };
        let lm_t = self.mutated(Mutation::TransposedLmHead);
        let mut logits = self.project(output, &xn, t, lm_t);
        tap_mut(sink, step, None, Tap::Logits, &[t, c.n_vocab], &mut logits);

        self.last_logits = logits[(t - 1) * c.n_vocab..].to_vec();
        Ok(&self.last_logits)
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
