//! A toy inference engine instrumented with parity's `TraceWriter`: a plain-f32 Llama/Qwen2
//! forward written out step by step (the kind of loop an engine author has), with one `tap` call
//! after each op. It replays a golden's ids (prompt, then the forced decode tokens) and writes a
//! trace that `parity diff GOLDEN TRACE` judges.
//!
//! ```text
//! cargo run --release --example trace_engine -- fixtures/tiny-llama-q8_0.gguf golden/tiny-llama-q8_0 /tmp/toy
//! parity diff golden/tiny-llama-q8_0 /tmp/toy
//! ```
//!
//! Weights are read (and dequantized row by row) through parity's GGUF reader; everything else
//! is the engine's own code, in f32 with f64 dot products.

use parity::model::{Model, RopeType};
use parity::trace::Trace;
use parity::trace::api::TraceWriter;
use std::error::Error;

/// `y[t] = W x[t]` for each of the `t` rows of `x` (W stored as GGUF rows: out × in).
fn matmul(m: &Model, w: &parity::gguf::TensorInfo, x: &[f32], t: usize) -> Vec<f32> {
    let (n_in, n_out) = (w.dims[0] as usize, w.dims[1] as usize);
    let mut row = vec![0.0f32; n_in];
    let mut y = vec![0.0f32; t * n_out];
    for o in 0..n_out {
        m.row(w, o, &mut row);
        for i in 0..t {
            let xi = &x[i * n_in..(i + 1) * n_in];
            y[i * n_out + o] = xi
                .iter()
                .zip(&row)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>() as f32;
        }
    }
    y
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    let mut out = Vec::with_capacity(x.len());
    for r in x.chunks(n) {
        let ms = (r.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64) as f32;
        let s = 1.0 / (ms + eps).sqrt();
        out.extend(r.iter().zip(w).map(|(&v, &g)| v * s * g));
    }
    out
}

/// RoPE on `[t, heads, head_dim]`: NORM pairs (2i, 2i+1), NEOX pairs (i, i + n_rot/2).
fn rope(
    x: &mut [f32],
    pos: &[usize],
    heads: usize,
    hd: usize,
    n_rot: usize,
    base: f32,
    kind: RopeType,
) {
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let v = &mut x[(t * heads + h) * hd..][..hd];
            for i in 0..n_rot / 2 {
                let theta = p as f32 * base.powf(-2.0 * i as f32 / n_rot as f32);
                let (c, s) = (theta.cos(), theta.sin());
                let (a, b) = match kind {
                    RopeType::Norm => (2 * i, 2 * i + 1),
                    RopeType::Neox => (i, i + n_rot / 2),
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * c - x1 * s;
                v[b] = x0 * s + x1 * c;
            }
        }
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model_path, golden, out] = args.as_slice() else {
        return Err("usage: trace_engine MODEL.gguf GOLDEN_DIR OUT_DIR".into());
    };
    let m = Model::open(model_path)?;
    let c = m.config.clone();
    let (e, hd, nh, nkv, nff) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv, c.n_ff);

    // The golden's ids: step 0 is the prompt, each later step one forced token.
    let g = Trace::open(golden)?;
    let mut w = TraceWriter::create(out, model_path, "toy-engine", "cpu-f32")?;
    w.set_producer("0.1", serde_json::json!({"dot": "f64 accumulation"}));

    let mut k_cache: Vec<Vec<f32>> = vec![Vec::new(); c.n_layer];
    let mut v_cache: Vec<Vec<f32>> = vec![Vec::new(); c.n_layer];
    for s in &g.manifest.steps {
        let (ids, pos) = (&s.tokens, &s.positions);
        let t = ids.len();
        w.step(ids, pos)?;

        let mut x = vec![0.0f32; t * e];
        for (i, &id) in ids.iter().enumerate() {
            m.row(&m.token_embd, id as usize, &mut x[i * e..(i + 1) * e]);
        }
        w.tap(None, "embd", &[t, e], &x)?;

        for (l, lw) in m.layers.iter().enumerate() {
            let xn = rms_norm(&x, &m.vector(&lw.attn_norm), c.rms_eps);
            w.tap(l, "attn_norm", &[t, e], &xn)?;
            let mut q = matmul(&m, &lw.wq, &xn, t);
            let mut k = matmul(&m, &lw.wk, &xn, t);
            let mut v = matmul(&m, &lw.wv, &xn, t);
            for (y, b) in [(&mut q, &lw.bq), (&mut k, &lw.bk), (&mut v, &lw.bv)] {
                if let Some(b) = b {
                    let b = m.vector(b);
                    y.chunks_mut(b.len())
                        .for_each(|r| r.iter_mut().zip(&b).for_each(|(a, c)| *a += c));
                }
            }
            w.tap(l, "q", &[t, nh, hd], &q)?;
            w.tap(l, "k", &[t, nkv, hd], &k)?;
            w.tap(l, "v", &[t, nkv, hd], &v)?;
            rope(&mut q, pos, nh, hd, c.n_rot, c.rope_theta, c.rope_type);
            rope(&mut k, pos, nkv, hd, c.n_rot, c.rope_theta, c.rope_type);
            w.tap(l, "q_rope", &[t, nh, hd], &q)?;
            w.tap(l, "k_rope", &[t, nkv, hd], &k)?;

            // Causal attention over the cache (GQA: query head h reads kv head h / group).
            k_cache[l].extend_from_slice(&k);
            v_cache[l].extend_from_slice(&v);
            let n_kv = k_cache[l].len() / (nkv * hd);
            let p0 = n_kv - t;
            let mut probs = vec![0.0f32; nh * t * n_kv];
            let mut att = vec![0.0f32; t * nh * hd];
            for h in 0..nh {
                let kh = h / (nh / nkv);
                for i in 0..t {
                    let qv = &q[(i * nh + h) * hd..][..hd];
                    let p = &mut probs[(h * t + i) * n_kv..][..n_kv];
                    let seen = p0 + i + 1;
                    for (j, pj) in p.iter_mut().enumerate().take(seen) {
                        let kv = &k_cache[l][(j * nkv + kh) * hd..][..hd];
                        let d: f64 = qv.iter().zip(kv).map(|(&a, &b)| a as f64 * b as f64).sum();
                        *pj = d as f32 / (hd as f32).sqrt();
                    }
                    let max = p[..seen].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let sum: f64 = p[..seen]
                        .iter_mut()
                        .map(|v| {
                            *v = (*v - max).exp();
                            *v as f64
                        })
                        .sum();
                    p[..seen]
                        .iter_mut()
                        .for_each(|v| *v = (*v as f64 / sum) as f32);
                    for d in 0..hd {
                        att[(i * nh + h) * hd + d] = (0..seen)
                            .map(|j| p[j] as f64 * v_cache[l][(j * nkv + kh) * hd + d] as f64)
                            .sum::<f64>()
                            as f32;
                    }
                }
            }
            w.tap(l, "kq_soft_max", &[nh, t, n_kv], &probs)?;
            w.tap(l, "kqv_out", &[t, nh * hd], &att)?;
            let attn_out = matmul(&m, &lw.wo, &att, t);
            w.tap(l, "attn_out", &[t, e], &attn_out)?;
            let ffn_inp: Vec<f32> = x.iter().zip(&attn_out).map(|(a, b)| a + b).collect();
            w.tap(l, "ffn_inp", &[t, e], &ffn_inp)?;

            let xn = rms_norm(&ffn_inp, &m.vector(&lw.ffn_norm), c.rms_eps);
            w.tap(l, "ffn_norm", &[t, e], &xn)?;
            let gate = matmul(&m, &lw.w_gate, &xn, t);
            w.tap(l, "ffn_gate", &[t, nff], &gate)?;
            let up = matmul(&m, &lw.w_up, &xn, t);
            w.tap(l, "ffn_up", &[t, nff], &up)?;
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            w.tap(l, "ffn_act", &[t, nff], &act)?;
            let ffn_out = matmul(&m, &lw.w_down, &act, t);
            w.tap(l, "ffn_out", &[t, e], &ffn_out)?;
            x = ffn_inp.iter().zip(&ffn_out).map(|(a, b)| a + b).collect();
            w.tap(l, "l_out", &[t, e], &x)?;
        }
        let xn = rms_norm(&x, &m.vector(&m.output_norm), c.rms_eps);
        w.tap(None, "result_norm", &[t, e], &xn)?;
        let logits = matmul(&m, &m.output, &xn, t);
        w.tap(None, "logits", &[t, c.n_vocab], &logits)?;
    }
    let manifest = w.finish()?;
    println!(
        "wrote {out}: {} steps, {} taps",
        manifest.steps.len(),
        manifest.tensors.len()
    );
    Ok(())
}
