//! The forward pass of every supported architecture, top to bottom like llama2.c's
//! `forward()`, with a tap at every named point. Each optional step is there because some
//! architecture's data asks for it (see docs/architectures.md); the ops are the backend's.

use super::{Attn, Ops, Rope};
use crate::model::Model;
use crate::trace::{Sink, Tap, TapKey};

/// Run `tokens` at positions `pos0..pos0 + T` through `ops`, recording taps under `step`.
/// Returns the logits: `[T, n_vocab]` when the sink records them, else only the last row's
/// (all a greedy run needs); where the sink takes them a slice of rows at a time, the last
/// slice's.
pub fn forward<O: Ops>(
    m: &Model,
    ops: &mut O,
    tokens: &[u32],
    pos0: usize,
    step: usize,
    sink: &mut dyn Sink,
) -> O::Buf {
    let c = &m.config;
    let t = tokens.len();
    let (e, hd, nh, nkv, ff) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv, c.n_ff);
    let n_kv = pos0 + t;
    let eps = c.rms_eps;
    let mut taps = Taps { sink, step };
    macro_rules! tap {
        ($ops:expr, $layer:expr, $tap:expr, $shape:expr, $x:expr) => {
            taps.at($ops, $layer, $tap, $shape, $x)
        };
    }

    // Token embedding: one row of token_embd per token.
    let mut x = ops.embed(&m.token_embd, tokens);
    tap!(ops, None, Tap::Embd, &[t, e], &mut x);
    if let Some(s) = c.embd_scale {
        x = ops.scale(x, s);
        tap!(ops, None, Tap::EmbdScaled, &[t, e], &mut x);
    }

    for (l, w) in m.layers.iter().enumerate() {
        let ly = Some(l);

        // Attention block.
        let mut xn = ops.rms_norm(&x, &w.attn_norm, eps);
        tap!(ops, ly, Tap::AttnNorm, &[t, e], &mut xn);

        let mut q = ops.matmul(&w.wq, &xn);
        let mut k = ops.matmul(&w.wk, &xn);
        let mut v = ops.matmul(&w.wv, &xn);
        if let Some(b) = &w.bq {
            q = ops.add_bias(q, b);
        }
        if let Some(b) = &w.bk {
            k = ops.add_bias(k, b);
        }
        if let Some(b) = &w.bv {
            v = ops.add_bias(v, b);
        }
        tap!(ops, ly, Tap::Q, &[t, nh, hd], &mut q);
        tap!(ops, ly, Tap::K, &[t, nkv, hd], &mut k);
        tap!(ops, ly, Tap::V, &[t, nkv, hd], &mut v);

        // Per-head norms of q and k (qwen3, gemma3).
        if let Some(n) = &w.q_norm {
            q = ops.head_norm(q, n, eps);
            tap!(ops, ly, Tap::QNormed, &[t, nh, hd], &mut q);
        }
        if let Some(n) = &w.k_norm {
            k = ops.head_norm(k, n, eps);
            tap!(ops, ly, Tap::KNormed, &[t, nkv, hd], &mut k);
        }

        let rope = Rope::for_layer(c, l, w.rope_factors(ops.n_ctx(), c));
        q = ops.rope(q, l, pos0, nh, &rope);
        k = ops.rope(k, l, pos0, nkv, &rope);
        tap!(ops, ly, Tap::QRope, &[t, nh, hd], &mut q);
        tap!(ops, ly, Tap::KRope, &[t, nkv, hd], &mut k);

        // Causal attention over the cache (GQA, sliding window, soft-cap: see `Attn`).
        ops.kv_store(l, pos0, &k, &v);
        let attn = Attn::for_layer(c, l, pos0, t);
        let mut att = if taps.wants(ly, Tap::KqSoftMax) {
            let mut probs = ops.attn_probs(l, &q, &attn);
            tap!(ops, ly, Tap::KqSoftMax, &[nh, t, n_kv], &mut probs);
            ops.attn_values(l, &probs, &attn)
        } else {
            ops.attention(l, &q, &attn)
        };
        tap!(ops, ly, Tap::KqvOut, &[t, nh * hd], &mut att);

        let mut attn_out = ops.matmul(&w.wo, &att);
        tap!(ops, ly, Tap::AttnOut, &[t, e], &mut attn_out);
        if let Some(n) = &w.attn_post_norm {
            attn_out = ops.rms_norm(&attn_out, n, eps);
            tap!(ops, ly, Tap::AttnPostNorm, &[t, e], &mut attn_out);
        }
        let mut ffn_inp = ops.add(x, &attn_out);
        tap!(ops, ly, Tap::FfnInp, &[t, e], &mut ffn_inp);

        // Feed-forward block: down(act(gate) · up).
        let mut xn = ops.rms_norm(&ffn_inp, &w.ffn_norm, eps);
        tap!(ops, ly, Tap::FfnNorm, &[t, e], &mut xn);
        let mut gate = ops.matmul(&w.w_gate, &xn);
        tap!(ops, ly, Tap::FfnGate, &[t, ff], &mut gate);
        let mut up = ops.matmul(&w.w_up, &xn);
        tap!(ops, ly, Tap::FfnUp, &[t, ff], &mut up);
        let mut act = ops.glu(gate, &up, c.activation);
        tap!(ops, ly, Tap::FfnAct, &[t, ff], &mut act);
        let mut ffn_out = ops.matmul(&w.w_down, &act);
        tap!(ops, ly, Tap::FfnOut, &[t, e], &mut ffn_out);
        if let Some(n) = &w.ffn_post_norm {
            ffn_out = ops.rms_norm(&ffn_out, n, eps);
            tap!(ops, ly, Tap::FfnPostNorm, &[t, e], &mut ffn_out);
        }

        x = ops.add(ffn_inp, &ffn_out);
        tap!(ops, ly, Tap::LOut, &[t, e], &mut x);
        ops.leave_layer(l);
    }

    let mut xn = ops.rms_norm(&x, &m.output_norm, c.output_norm_eps.unwrap_or(eps));
    tap!(ops, None, Tap::ResultNorm, &[t, e], &mut xn);

    // Only the last row's logits are needed unless the sink records them all.
    let all = t == 1 || taps.wants(None, Tap::Logits);
    if !all {
        xn = ops.last_row(xn, e);
    } else if let Some(last) = logits_in_rows(m, ops, &mut taps, &xn, t) {
        return last;
    }
    let mut logits = ops.matmul(&m.output, &xn);
    if let Some(cap) = c.final_softcap {
        if all {
            taps.at(ops, None, Tap::LogitsUncapped, &[t, c.n_vocab], &mut logits);
        }
        logits = ops.softcap(logits, cap);
    }
    if all {
        taps.at(ops, None, Tap::Logits, &[t, c.n_vocab], &mut logits);
    }
    logits
}

/// A prompt's logits made and handed over a slice of rows at a time (`Sink::row_slice`),
/// never all `[T, n_vocab]` at once (262 MB for 2,048 rows of a 32,000-token vocabulary),
/// where the sink takes them so and the backend can; the same numbers, row by row. Returns
/// the last slice's; None where the output is made whole instead.
fn logits_in_rows<O: Ops>(
    m: &Model,
    ops: &mut O,
    taps: &mut Taps,
    xn: &O::Buf,
    t: usize,
) -> Option<O::Buf> {
    let c = &m.config;
    let mut values = taps.row_slice(Tap::Logits)?;
    if c.final_softcap.is_some() {
        values = values.min(taps.row_slice(Tap::LogitsUncapped)?);
    }
    let slice = crate::trace::rows_per_slice(values, c.n_vocab);
    if t <= slice {
        return None;
    }
    let shape = [t, c.n_vocab];
    let mut last = None;
    for r0 in (0..t).step_by(slice) {
        let part = ops.rows(xn, c.n_embd, r0..(r0 + slice).min(t))?;
        let mut logits = ops.matmul(&m.output, &part);
        if let Some(cap) = c.final_softcap {
            taps.rows(ops, Tap::LogitsUncapped, &shape, r0, &logits);
            logits = ops.softcap(logits, cap);
        }
        taps.rows(ops, Tap::Logits, &shape, r0, &logits);
        last = Some(logits);
    }
    last
}

/// The sink and step the taps of one forward go to.
struct Taps<'s> {
    sink: &'s mut dyn Sink,
    step: usize,
}

impl Taps<'_> {
    fn at<O: Ops>(
        &mut self,
        ops: &mut O,
        layer: Option<usize>,
        tap: Tap,
        shape: &[usize],
        x: &mut O::Buf,
    ) {
        ops.tap(self.sink, TapKey::new(self.step, layer, tap), shape, x)
    }

    /// A graph-wide tap handed over in rows, if the sink wants it.
    fn rows<O: Ops>(&mut self, ops: &mut O, tap: Tap, shape: &[usize], row0: usize, x: &O::Buf) {
        let key = TapKey::new(self.step, None, tap);
        if self.sink.wants(&key) {
            ops.tap_rows(self.sink, key, shape, row0, x);
        }
    }

    /// At most how many values a slice of a graph-wide tap made in rows may hold: the sink's
    /// (`Sink::row_slice`), or any where the sink neither records nor replays it; None where
    /// it is to be made whole.
    fn row_slice(&self, tap: Tap) -> Option<usize> {
        let key = TapKey::new(self.step, None, tap);
        let untouched = !self.sink.wants(&key) && !self.sink.replays(&key);
        self.sink
            .row_slice(&key)
            .or(untouched.then_some(usize::MAX))
    }

    fn wants(&self, layer: Option<usize>, tap: Tap) -> bool {
        let key = TapKey::new(self.step, layer, tap);
        self.sink.wants(&key) || self.sink.replays(&key)
    }
}
