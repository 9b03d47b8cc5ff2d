//! The fast backend: weights stay in their block format, activations are quantized once per
//! matmul input row the way ggml's CPU backend does (Q8_0 / Q8_1 / Q8_K / f16), and each output
//! is an integer-per-block SIMD dot product. Output rows are split across a thread pool.
//! Attention and norms use the SIMD f32 dot. All scratch buffers live in the backend and only
//! grow, so a decode step allocates nothing (with a sink that keeps nothing).
//!
//! Held to the reference tap by tap: against `reference:ggml-cpu` it agrees to f32
//! summation-order noise (same activation rounding, different summation order).

use super::{Backend, BackendError};
use crate::gguf::TensorInfo;
use crate::model::{Model, RopeType};
use crate::quant;
use crate::trace::{Sink, Tap, tap};
use rayon::prelude::*;

struct LayerVecs {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
}

/// Activation buffers, sized for the largest T seen so far.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    probs: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Quantized matmul input rows.
    act: Vec<u8>,
    /// Matmul output in [n_out, T] order before transposing (prefill only).
    tmp: Vec<f32>,
    logits: Vec<f32>,
    rope: Vec<(f32, f32)>,
}

pub struct Fast<'m> {
    model: &'m Model,
    n_ctx: usize,
    pool: rayon::ThreadPool,
    n_threads: usize,
    layers: Vec<LayerVecs>,
    output_norm: Vec<f32>,
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    s: Scratch,
}

impl<'m> Fast<'m> {
    pub fn new(model: &'m Model, n_ctx: usize, n_threads: usize) -> Self {
        let c = &model.config;
        let n_ctx = n_ctx.min(c.n_ctx_train).max(1);
        let n_threads = n_threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n_threads)
            .build()
            .expect("thread pool");
        let layers = model
            .layers
            .iter()
            .map(|l| LayerVecs {
                attn_norm: model.vector(&l.attn_norm),
                ffn_norm: model.vector(&l.ffn_norm),
                bq: l.bq.as_ref().map(|b| model.vector(b)),
                bk: l.bk.as_ref().map(|b| model.vector(b)),
                bv: l.bv.as_ref().map(|b| model.vector(b)),
            })
            .collect();
        let kv = n_ctx * c.n_embd_kv();
        Fast {
            model,
            n_ctx,
            pool,
            n_threads,
            layers,
            output_norm: model.vector(&model.output_norm),
            k_cache: vec![vec![0.0; kv]; c.n_layer],
            v_cache: vec![vec![0.0; kv]; c.n_layer],
            s: Scratch::default(),
        }
    }

    pub fn threads(&self) -> usize {
        self.n_threads
    }
}

/// Grow `v` to `n` elements (never shrinks, so steady-state decode does not allocate).
fn fit<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// out[t, r] = W[r] · x[t] with W kept in its block format.
#[allow(clippy::too_many_arguments)]
fn matmul(
    pool: &rayon::ThreadPool,
    model: &Model,
    w: &TensorInfo,
    x: &[f32],
    t: usize,
    act: &mut Vec<u8>,
    tmp: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (n_in, n_out) = w.rows();
    let aty = quant::vec_dot_type(w.ty);
    let arow = aty.bytes_for(n_in as u64).expect("whole blocks") as usize;
    fit(act, t * arow);
    for i in 0..t {
        quant::quantize_activation(aty, &x[i * n_in..(i + 1) * n_in], &mut act[i * arow..(i + 1) * arow]);
    }
    let act = &act[..t * arow];
    let wdata = model.data(w);
    let wrow = w.ty.bytes_for(n_in as u64).expect("whole blocks") as usize;
    let wty = w.ty;
    // Enough chunks to balance the threads, few enough to keep scheduling cheap.
    let chunk = (n_out / (pool.current_num_threads() * 8)).clamp(16, 1024);
    if t == 1 {
        pool.install(|| {
            out[..n_out].par_chunks_mut(chunk).enumerate().for_each(|(c, o)| {
                for (j, y) in o.iter_mut().enumerate() {
                    let r = c * chunk + j;
                    *y = quant::vec_dot(wty, &wdata[r * wrow..(r + 1) * wrow], act);
                }
            })
        });
        return;
    }
    // Prefill: each weight row is read once and dotted with all T input rows while it is hot.
    fit(tmp, n_out * t);
    pool.install(|| {
        tmp[..n_out * t]
            .par_chunks_mut(chunk * t)
            .enumerate()
            .for_each(|(c, o)| {
                for (j, ys) in o.chunks_mut(t).enumerate() {
                    let r = c * chunk + j;
                    let wr = &wdata[r * wrow..(r + 1) * wrow];
                    for (i, y) in ys.iter_mut().enumerate() {
                        *y = quant::vec_dot(wty, wr, &act[i * arow..(i + 1) * arow]);
                    }
                }
            })
    });
    for r in 0..n_out {
        for i in 0..t {
            out[i * n_out + r] = tmp[r * t + i];
        }
    }
}

/// RMSNorm in ggml's order (sum of squares in f64, scale in f32).
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / n as f64) as f32 + eps).sqrt();
        for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

fn add_bias(x: &mut [f32], b: &Option<Vec<f32>>) {
    if let Some(b) = b {
        for row in x.chunks_exact_mut(b.len()) {
            for (v, bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn rope(
    x: &mut [f32],
    pos0: usize,
    t: usize,
    n_heads: usize,
    head_dim: usize,
    n_rot: usize,
    base: f32,
    freq_scale: f32,
    kind: RopeType,
    cache: &mut Vec<(f32, f32)>,
) {
    fit(cache, n_rot / 2);
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    for i in 0..t {
        let mut theta = (pos0 + i) as f32;
        for c in cache[..n_rot / 2].iter_mut() {
            let th = freq_scale * theta;
            *c = (th.cos(), th.sin());
            theta *= theta_scale;
        }
        for h in 0..n_heads {
            let v = &mut x[(i * n_heads + h) * head_dim..][..head_dim];
            for (j, &(cos, sin)) in cache[..n_rot / 2].iter().enumerate() {
                let (a, b) = match kind {
                    RopeType::Norm => (2 * j, 2 * j + 1),
                    RopeType::Neox => (j, j + n_rot / 2),
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * cos - x1 * sin;
                v[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

impl Backend for Fast<'_> {
    fn name(&self) -> String {
        "fast".into()
    }

    fn reset(&mut self) {
        // Positions beyond n_past are never read, so the cache needs no clearing.
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
            return Err(BackendError::ContextOverflow { end: pos0 + t, n_ctx: self.n_ctx });
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.n_vocab) {
            return Err(BackendError::BadToken { id, n_vocab: c.n_vocab });
        }
        let (e, hd, nh, nkv, ff) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv, c.n_ff);
        let (eq, ekv) = (c.n_embd_q(), c.n_embd_kv());
        let n_kv = pos0 + t;
        let s = &mut self.s;
        for (buf, n) in [
            (&mut s.x, t * e),
            (&mut s.xn, t * e),
            (&mut s.q, t * eq),
            (&mut s.k, t * ekv),
            (&mut s.v, t * ekv),
            (&mut s.probs, nh * t * n_kv),
            (&mut s.att, t * eq),
            (&mut s.proj, t * e),
            (&mut s.gate, t * ff),
            (&mut s.up, t * ff),
            (&mut s.logits, t * c.n_vocab),
        ] {
            fit(buf, n);
        }
        let pool = &self.pool;

        for (i, &id) in tokens.iter().enumerate() {
            m.row(&m.token_embd, id as usize, &mut s.x[i * e..(i + 1) * e]);
        }
        tap(sink, step, None, Tap::Embd, &[t, e], &s.x[..t * e]);

        for (l, w) in m.layers.iter().enumerate() {
            let ly = Some(l);
            let lv = &self.layers[l];
            rms_norm(&s.x[..t * e], &lv.attn_norm, c.rms_eps, &mut s.xn[..t * e]);
            tap(sink, step, ly, Tap::AttnNorm, &[t, e], &s.xn[..t * e]);

            let xn = &s.xn[..t * e];
            matmul(pool, m, &w.wq, xn, t, &mut s.act, &mut s.tmp, &mut s.q[..t * eq]);
            matmul(pool, m, &w.wk, xn, t, &mut s.act, &mut s.tmp, &mut s.k[..t * ekv]);
            matmul(pool, m, &w.wv, xn, t, &mut s.act, &mut s.tmp, &mut s.v[..t * ekv]);
            add_bias(&mut s.q[..t * eq], &lv.bq);
            add_bias(&mut s.k[..t * ekv], &lv.bk);
            add_bias(&mut s.v[..t * ekv], &lv.bv);
            tap(sink, step, ly, Tap::Q, &[t, nh, hd], &s.q[..t * eq]);
            tap(sink, step, ly, Tap::K, &[t, nkv, hd], &s.k[..t * ekv]);
            tap(sink, step, ly, Tap::V, &[t, nkv, hd], &s.v[..t * ekv]);

            let (base, fs, nr, rt) = (c.rope_theta, c.rope_freq_scale, c.n_rot, c.rope_type);
            rope(&mut s.q[..t * eq], pos0, t, nh, hd, nr, base, fs, rt, &mut s.rope);
            rope(&mut s.k[..t * ekv], pos0, t, nkv, hd, nr, base, fs, rt, &mut s.rope);
            tap(sink, step, ly, Tap::QRope, &[t, nh, hd], &s.q[..t * eq]);
            tap(sink, step, ly, Tap::KRope, &[t, nkv, hd], &s.k[..t * ekv]);

            self.k_cache[l][pos0 * ekv..n_kv * ekv].copy_from_slice(&s.k[..t * ekv]);
            self.v_cache[l][pos0 * ekv..n_kv * ekv].copy_from_slice(&s.v[..t * ekv]);
            let (kc, vc) = (&self.k_cache[l], &self.v_cache[l]);

            // Attention, one (head, query row) per task.
            let group = nh / nkv;
            let kq_scale = 1.0 / (hd as f32).sqrt();
            let q = &s.q[..t * eq];
            let probs = &mut s.probs[..nh * t * n_kv];
            let att = &mut s.att[..t * eq];
            pool.install(|| {
                probs.par_chunks_mut(n_kv).enumerate().for_each(|(hi, p)| {
                    let (h, i) = (hi / t, hi % t);
                    let kvh = h / group;
                    let qv = &q[(i * nh + h) * hd..][..hd];
                    let visible = pos0 + i + 1;
                    let mut max = f32::NEG_INFINITY;
                    for (j, pj) in p[..visible].iter_mut().enumerate() {
                        *pj = quant::f32::vec_dot_f32(qv, &kc[j * ekv + kvh * hd..][..hd]) * kq_scale;
                        max = max.max(*pj);
                    }
                    let mut sum = 0.0f64;
                    for pj in p[..visible].iter_mut() {
                        *pj = (*pj - max).exp();
                        sum += *pj as f64;
                    }
                    let inv = (1.0 / sum) as f32;
                    for pj in p[..visible].iter_mut() {
                        *pj *= inv;
                    }
                    p[visible..].fill(0.0);
                })
            });
            let probs = &s.probs[..nh * t * n_kv];
            pool.install(|| {
                att.par_chunks_mut(hd).enumerate().for_each(|(ih, out)| {
                    let (i, h) = (ih / nh, ih % nh);
                    let kvh = h / group;
                    let p = &probs[(h * t + i) * n_kv..][..pos0 + i + 1];
                    out.fill(0.0);
                    for (j, &pj) in p.iter().enumerate() {
                        let vr = &vc[j * ekv + kvh * hd..][..hd];
                        for (o, &vv) in out.iter_mut().zip(vr) {
                            *o += pj * vv;
                        }
                    }
                })
            });
            tap(sink, step, ly, Tap::KqSoftMax, &[nh, t, n_kv], probs);
            tap(sink, step, ly, Tap::KqvOut, &[t, eq], &s.att[..t * eq]);

            matmul(pool, m, &w.wo, &s.att[..t * eq], t, &mut s.act, &mut s.tmp, &mut s.proj[..t * e]);
            tap(sink, step, ly, Tap::AttnOut, &[t, e], &s.proj[..t * e]);
            for (x, p) in s.x[..t * e].iter_mut().zip(&s.proj[..t * e]) {
                *x += p;
            }
            tap(sink, step, ly, Tap::FfnInp, &[t, e], &s.x[..t * e]);

            rms_norm(&s.x[..t * e], &lv.ffn_norm, c.rms_eps, &mut s.xn[..t * e]);
            tap(sink, step, ly, Tap::FfnNorm, &[t, e], &s.xn[..t * e]);
            let xn = &s.xn[..t * e];
            matmul(pool, m, &w.w_gate, xn, t, &mut s.act, &mut s.tmp, &mut s.gate[..t * ff]);
            tap(sink, step, ly, Tap::FfnGate, &[t, ff], &s.gate[..t * ff]);
            matmul(pool, m, &w.w_up, xn, t, &mut s.act, &mut s.tmp, &mut s.up[..t * ff]);
            tap(sink, step, ly, Tap::FfnUp, &[t, ff], &s.up[..t * ff]);
            for (g, &u) in s.gate[..t * ff].iter_mut().zip(&s.up[..t * ff]) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            tap(sink, step, ly, Tap::FfnAct, &[t, ff], &s.gate[..t * ff]);
            matmul(pool, m, &w.w_down, &s.gate[..t * ff], t, &mut s.act, &mut s.tmp, &mut s.proj[..t * e]);
            tap(sink, step, ly, Tap::FfnOut, &[t, e], &s.proj[..t * e]);
            for (x, p) in s.x[..t * e].iter_mut().zip(&s.proj[..t * e]) {
                *x += p;
            }
            tap(sink, step, ly, Tap::LOut, &[t, e], &s.x[..t * e]);
        }

        rms_norm(&s.x[..t * e], &self.output_norm, c.rms_eps, &mut s.xn[..t * e]);
        tap(sink, step, None, Tap::ResultNorm, &[t, e], &s.xn[..t * e]);
        // Only the last row's logits are needed unless a sink records them all.
        let want_all = sink.wants(&crate::trace::TapKey::new(step, None, Tap::Logits));
        let nv = c.n_vocab;
        if want_all {
            matmul(pool, m, &m.output, &s.xn[..t * e], t, &mut s.act, &mut s.tmp, &mut s.logits[..t * nv]);
            tap(sink, step, None, Tap::Logits, &[t, nv], &s.logits[..t * nv]);
            s.logits.copy_within((t - 1) * nv..t * nv, 0);
        } else {
            matmul(pool, m, &m.output, &s.xn[(t - 1) * e..t * e], 1, &mut s.act, &mut s.tmp, &mut s.logits[..nv]);
        }
        Ok(&self.s.logits[..nv])
    }
}
