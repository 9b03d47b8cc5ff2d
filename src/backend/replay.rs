//! Op-by-op replay: each tap recomputed by the reference's own ops from the *baseline's* inputs
//! (q from the golden's attn_norm, q_rope from the golden's q, attention from the golden's
//! q_rope/k_rope/v, …). End to end, a 1e-13 difference can flip one activation across a
//! quantization boundary and grow from there; op by op the inputs are identical, so every op
//! is judged on its own and the floor stays at f32 summation-order noise (~1e-14). This is what
//! separates "noise that compounded" from "this op is wrong".

use super::Emulation;
use super::reference::{Reference, add, add_bias, dot, rms_norm, rope, silu, softmax};
use crate::model::Model;
use crate::trace::{Tap, TapKey, Trace, TraceError};
use ndarray::{ArrayD, IxDyn};
use std::collections::BTreeMap;

type Tensors = BTreeMap<TapKey, ArrayD<f32>>;

fn arr(shape: &[usize], v: Vec<f32>) -> ArrayD<f32> {
    ArrayD::from_shape_vec(IxDyn(shape), v).expect("shape matches")
}

/// Recompute every tap the baseline's inputs allow. Steps, tokens and positions are the
/// baseline's. Taps whose inputs the baseline lacks are skipped.
pub fn replay(model: &Model, base: &Trace, emulation: Emulation) -> Result<Tensors, TraceError> {
    let c = &model.config;
    let n_ctx = base.manifest.all_tokens().len().max(1);
    let r = Reference::new(model, emulation, n_ctx);
    let (e, hd, nh, nkv, ff) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv, c.n_ff);
    let (eq, ekv) = (c.n_embd_q(), c.n_embd_kv());
    let mut out = Tensors::new();
    let get = |s: usize, l: Option<usize>, tap: Tap| -> Result<Option<Vec<f32>>, TraceError> {
        Ok(base
            .get(&TapKey::new(s, l, tap))?
            .map(|a| a.iter().copied().collect()))
    };
    // The golden's post-RoPE keys and values so far, per layer: the KV cache it attended over.
    let mut k_cache: Vec<Vec<f32>> = vec![Vec::new(); c.n_layer];
    let mut v_cache: Vec<Vec<f32>> = vec![Vec::new(); c.n_layer];

    for st in &base.manifest.steps {
        let s = st.step;
        let t = st.tokens.len();
        let pos0 = st.positions.first().copied().unwrap_or(0);
        if st.tokens.iter().any(|&id| id as usize >= c.n_vocab) {
            return Ok(out);
        }
        let mut x = vec![0.0f32; t * e];
        for (i, &id) in st.tokens.iter().enumerate() {
            model.row(&model.token_embd, id as usize, &mut x[i * e..(i + 1) * e]);
        }
        out.insert(TapKey::new(s, None, Tap::Embd), arr(&[t, e], x));
        let mut layer_in = get(s, None, Tap::Embd)?;

        for (l, w) in model.layers.iter().enumerate() {
            let ly = Some(l);
            let mut put = |tap: Tap, shape: &[usize], v: Vec<f32>| {
                out.insert(TapKey::new(s, ly, tap), arr(shape, v));
            };
            if let Some(x) = &layer_in {
                put(Tap::AttnNorm, &[t, e], rms_norm(x, &model.vector(&w.attn_norm), c.rms_eps));
            }
            if let Some(xn) = get(s, ly, Tap::AttnNorm)? {
                for (tap, wt, b, n, shape) in [
                    (Tap::Q, &w.wq, &w.bq, eq, [t, nh, hd]),
                    (Tap::K, &w.wk, &w.bk, ekv, [t, nkv, hd]),
                    (Tap::V, &w.wv, &w.bv, ekv, [t, nkv, hd]),
                ] {
                    let mut y = r.matmul(wt, &xn, t);
                    if let Some(b) = b {
                        add_bias(&mut y, &model.vector(b));
                    }
                    debug_assert_eq!(y.len(), t * n);
                    put(tap, &shape, y);
                }
            }
            let positions: Vec<usize> = st.positions.clone();
            for (pre, post, heads) in [(Tap::Q, Tap::QRope, nh), (Tap::K, Tap::KRope, nkv)] {
                if let Some(mut v) = get(s, ly, pre)? {
                    let (b, fs) = (c.rope_theta, c.rope_freq_scale);
                    rope(&mut v, &positions, heads, hd, c.n_rot, b, fs, c.rope_type);
                    put(post, &[t, heads, hd], v);
                }
            }
            // Attention over the golden's cache.
            let (kr, vv, qr) = (get(s, ly, Tap::KRope)?, get(s, ly, Tap::V)?, get(s, ly, Tap::QRope)?);
            let have_cache = kr.is_some() && vv.is_some() && k_cache[l].len() == pos0 * ekv;
            if let (Some(kr), Some(vv)) = (kr, vv) {
                k_cache[l].extend_from_slice(&kr);
                v_cache[l].extend_from_slice(&vv);
            }
            let n_kv = pos0 + t;
            let group = nh / nkv;
            if let (true, Some(q)) = (have_cache, qr) {
                let kc = &k_cache[l];
                let scale = 1.0 / (hd as f32).sqrt();
                let mut probs = vec![0.0f32; nh * t * n_kv];
                for h in 0..nh {
                    for i in 0..t {
                        let qv = &q[(i * nh + h) * hd..][..hd];
                        let p = &mut probs[(h * t + i) * n_kv..][..n_kv];
                        let visible = pos0 + i + 1;
                        for j in 0..visible {
                            p[j] = dot(qv, &kc[j * ekv + (h / group) * hd..][..hd]) * scale;
                        }
                        softmax(&mut p[..visible]);
                    }
                }
                put(Tap::KqSoftMax, &[nh, t, n_kv], probs);
            }
            if let (true, Some(p)) = (have_cache, get(s, ly, Tap::KqSoftMax)?) {
                let vc = &v_cache[l];
                let mut att = vec![0.0f32; t * eq];
                for h in 0..nh {
                    for i in 0..t {
                        let pr = &p[(h * t + i) * n_kv..][..n_kv];
                        for d in 0..hd {
                            let sum: f64 = (0..pos0 + i + 1)
                                .map(|j| pr[j] as f64 * vc[j * ekv + (h / group) * hd + d] as f64)
                                .sum();
                            att[i * eq + h * hd + d] = sum as f32;
                        }
                    }
                }
                put(Tap::KqvOut, &[t, eq], att);
            }
            if let Some(a) = get(s, ly, Tap::KqvOut)? {
                put(Tap::AttnOut, &[t, e], r.matmul(&w.wo, &a, t));
            }
            if let (Some(x), Some(a)) = (&layer_in, get(s, ly, Tap::AttnOut)?) {
                put(Tap::FfnInp, &[t, e], add(x, &a));
            }
            let ffn_inp = get(s, ly, Tap::FfnInp)?;
            if let Some(fi) = &ffn_inp {
                put(Tap::FfnNorm, &[t, e], rms_norm(fi, &model.vector(&w.ffn_norm), c.rms_eps));
            }
            if let Some(xn) = get(s, ly, Tap::FfnNorm)? {
                put(Tap::FfnGate, &[t, ff], r.matmul(&w.w_gate, &xn, t));
                put(Tap::FfnUp, &[t, ff], r.matmul(&w.w_up, &xn, t));
            }
            if let (Some(g), Some(u)) = (get(s, ly, Tap::FfnGate)?, get(s, ly, Tap::FfnUp)?) {
                put(Tap::FfnAct, &[t, ff], g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect());
            }
            if let Some(a) = get(s, ly, Tap::FfnAct)? {
                put(Tap::FfnOut, &[t, e], r.matmul(&w.w_down, &a, t));
            }
            if let (Some(fi), Some(fo)) = (&ffn_inp, get(s, ly, Tap::FfnOut)?) {
                put(Tap::LOut, &[t, e], add(fi, &fo));
            }
            layer_in = get(s, ly, Tap::LOut)?;
        }
        if let Some(x) = &layer_in {
            let xn = rms_norm(x, &model.vector(&model.output_norm), c.rms_eps);
            out.insert(TapKey::new(s, None, Tap::ResultNorm), arr(&[t, e], xn));
        }
        if let Some(xn) = get(s, None, Tap::ResultNorm)? {
            let logits = r.matmul(&model.output, &xn, t);
            out.insert(TapKey::new(s, None, Tap::Logits), arr(&[t, c.n_vocab], logits));
        }
    }
    Ok(out)
}
