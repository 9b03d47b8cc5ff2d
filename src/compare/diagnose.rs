//! A diagnosis of the likely cause of a divergence, from the known bug signatures
//! (../shared/reference/llama-cpp-facts.md §4): what diverged, what just before it still
//! matched, and how the error is shaped (per row, per head, per channel).

use super::{CompareError, TapResult, metrics};
use crate::gguf::GgmlType;
use crate::trace::{Tap, TapKey, Trace};
use ndarray::{ArrayD, Axis, Ix2};

/// A baseline tensor and the candidate's, in the baseline's shape.
type Pair = (ArrayD<f32>, ArrayD<f32>);

/// Rows (first axis) of a tensor as 2-d: `[rows, rest]`.
fn rows2(a: &ArrayD<f32>) -> ndarray::Array2<f32> {
    let r = a.shape().first().copied().unwrap_or(1).max(1);
    let n = a.len() / r;
    a.to_owned()
        .into_shape_with_order((r, n))
        .expect("contiguous")
        .into_dimensionality::<Ix2>()
        .expect("2-d")
}

fn row_nmse(a: &ArrayD<f32>, b: &ArrayD<f32>) -> Vec<f64> {
    let (a, b) = (rows2(a), rows2(b));
    a.axis_iter(Axis(0))
        .zip(b.axis_iter(Axis(0)))
        .map(|(x, y)| metrics(&x.into_dyn(), &y.into_dyn()).nmse)
        .collect()
}

/// The taps an op reads, where a trace can show them (the same step): the previous layer's
/// `l_out` (or the embedding) for a layer's first norm and for the residual it carries; empty
/// where the op reads no tap (the embedding lookup).
fn input_keys(k: TapKey) -> Vec<TapKey> {
    let (s, l) = (k.step, k.layer);
    let at = |taps: &[Tap]| -> Vec<TapKey> { taps.iter().map(|&t| TapKey::new(s, l, t)).collect() };
    // What the layer starts from: the previous layer's output, or the embedding.
    let layer_input = || -> Vec<TapKey> {
        match l {
            Some(0) | None => vec![
                TapKey::new(s, None, Tap::Embd),
                TapKey::new(s, None, Tap::EmbdScaled),
            ],
            Some(n) => vec![TapKey::new(s, Some(n - 1), Tap::LOut)],
        }
    };
    match k.tap {
        Tap::Embd => Vec::new(),
        Tap::EmbdScaled => vec![TapKey::new(s, None, Tap::Embd)],
        Tap::AttnNorm => layer_input(),
        Tap::Q | Tap::K | Tap::V => at(&[Tap::AttnNorm]),
        Tap::QNormed => at(&[Tap::Q]),
        Tap::KNormed => at(&[Tap::K]),
        Tap::QRope => at(&[Tap::Q, Tap::QNormed]),
        Tap::KRope => at(&[Tap::K, Tap::KNormed]),
        Tap::KqSoftMax => at(&[Tap::QRope, Tap::KRope]),
        Tap::KqvOut => at(&[Tap::KqSoftMax, Tap::V]),
        Tap::AttnOut => at(&[Tap::KqvOut]),
        Tap::AttnPostNorm => at(&[Tap::AttnOut]),
        Tap::FfnInp => {
            let mut v = at(&[Tap::AttnOut, Tap::AttnPostNorm]);
            v.extend(layer_input());
            v
        }
        Tap::FfnNorm => at(&[Tap::FfnInp]),
        Tap::FfnGate | Tap::FfnUp => at(&[Tap::FfnNorm]),
        Tap::FfnAct => at(&[Tap::FfnGate, Tap::FfnUp]),
        Tap::FfnOut => at(&[Tap::FfnAct]),
        Tap::FfnPostNorm => at(&[Tap::FfnOut]),
        Tap::LOut => at(&[Tap::FfnInp, Tap::FfnOut, Tap::FfnPostNorm]),
        // The last layer's output (`diagnose` finds which layer that is).
        Tap::ResultNorm => Vec::new(),
        Tap::LogitsUncapped | Tap::Logits => vec![TapKey::new(s, None, Tap::ResultNorm)],
    }
}

/// The taps `k`'s op reads (`input_keys`), the output norm's being the last layer's `l_out`.
pub(crate) fn op_inputs(k: TapKey, n_layer: usize) -> Vec<TapKey> {
    match k.tap {
        Tap::ResultNorm => vec![TapKey::new(k.step, n_layer.checked_sub(1), Tap::LOut)],
        _ => input_keys(k),
    }
}

pub(super) fn diagnose(
    base: &Trace,
    cand: &Trace,
    results: &[TapResult],
    i: usize,
    wtype: GgmlType,
) -> Result<String, CompareError> {
    let r = &results[i];
    let k = r.key;
    let passed = |tap: Tap, layer: Option<usize>| -> Option<bool> {
        results
            .iter()
            .find(|x| x.key == TapKey::new(k.step, layer, tap))
            .map(|x| x.pass)
    };
    let prefill_ok = k.step > 0 && results.iter().filter(|x| x.key.step == 0).all(|x| x.pass);
    let load = |key: TapKey| -> Result<Option<Pair>, CompareError> {
        // A cut side (`kq_soft_max` for some heads or rows) is read by no signature here.
        if base.cut(&key).is_some() || cand.cut(&key).is_some() {
            return Ok(None);
        }
        Ok(match (base.get(&key)?, cand.get(&key)?) {
            (Some(a), Some(b)) if a.len() == b.len() => {
                let b = b
                    .into_shape_with_order(a.shape())
                    .expect("same len")
                    .into_dyn();
                Some((a, b))
            }
            _ => None,
        })
    };
    let m = &r.metrics;
    let mut why = Vec::<String>::new();
    // An input "matched" only if it sits far below the threshold; an input just under it means
    // the error arrived from upstream and grew, not that this op is wrong.
    let input_exact = |tap: Tap| -> bool {
        results
            .iter()
            .find(|x| x.key == TapKey::new(k.step, k.layer, tap))
            .is_some_and(|x| x.pass && x.metrics.nmse <= x.threshold * 1e-2)
    };
    // A NaN or an Inf is the finding itself: no signature is read into such data.
    if let Some(t) = m.non_finite_text(&k, "the baseline", "the candidate") {
        return Ok(t);
    }
    if prefill_ok {
        // A later step of several tokens is a chunk of the prompt or a further turn, not a
        // one-token decode step: what it alone uses is the cache and positions it continues.
        let shape = crate::trace::step_shapes(base)
            .into_iter()
            .find(|&(s, _, _)| s == k.step);
        why.push(match shape {
            Some((_, pos0, n)) if n > 1 => format!(
                "the first step matched everywhere and step {} (a later chunk or turn: {n} tokens at positions {pos0}..{}) diverges: look at what only steps after the first use — the KV cache the earlier steps wrote (kept, not cleared; read at the right slots), the causal mask across steps, the positions passed to RoPE (continuing, not restarting at 0)",
                k.step,
                pos0 + n - 1
            ),
            _ => format!(
                "the prefill (step 0) matched everywhere and step {} diverges: look at what only decode steps use — the KV cache write/read position, the causal mask for the new row, the position passed to RoPE",
                k.step
            ),
        });
    }
    let grown: Vec<&TapResult> = results[..i]
        .iter()
        .filter(|x| x.key.step == k.step && x.pass && x.metrics.nmse > x.threshold * 1e-2)
        .collect();
    if let Some(g) = grown.first() {
        why.push(format!(
            "the error did not start here: it was already within 100x of the threshold at {} (NMSE {:.1e}) and grew along the graph — compounding noise or an earlier small error; compare op by op (each op fed the baseline's inputs) to tell which op is wrong",
            g.key, g.metrics.nmse
        ));
        return Ok(why.join("; "));
    }

    // Every hint below says what an input did ("its input matched"): said only where the
    // trace shows one. A sparse trace (l_out, result_norm, logits) has none inside a layer,
    // and then what it shows is a span of ops between the last tap that matched and this one.
    let inputs = match k.tap {
        // The last layer's output: the highest l_out of this step the comparison holds.
        Tap::ResultNorm => vec![
            results
                .iter()
                .filter(|x| x.key.step == k.step && x.key.tap == Tap::LOut)
                .map(|x| x.key)
                .max()
                .unwrap_or(TapKey::new(k.step, Some(usize::MAX), Tap::LOut)),
        ],
        _ => input_keys(k),
    };
    let seen = |x: &TapKey| results.iter().any(|r| r.key == *x);
    if !inputs.is_empty() && !inputs.iter().any(seen) {
        let mut names: Vec<String> = inputs.iter().map(|x| x.tap.to_string()).collect();
        names.dedup();
        let from = results[..i]
            .iter()
            .rev()
            .find(|x| x.key.step == k.step && x.pass)
            .map_or_else(
                || format!("the start of step {}", k.step),
                |x| format!("{} (which matched)", x.key),
            );
        why.push(format!(
            "{} is the first tap that differs and the trace has none of its inputs ({}): the cause is one of the ops between {from} and it — record the taps in between to see which",
            k.tap,
            names.join(", ")
        ));
        return Ok(why.join("; "));
    }

    let matmul_hint = |w: &str| -> String {
        if m.cosine.abs() < 0.2 {
            format!(
                "its input matched but the output is uncorrelated (cosine {:.3}): the {w} matmul reads the weight transposed or with the wrong ne order (GGUF stores W as [n_in, n_out], ne[0] = n_in)",
                m.cosine
            )
        } else {
            format!(
                "its input matched but the {w} matmul output does not (cosine {:.6}): the {wtype} weight decoder or the matmul kernel; with quantized weights also check which activation rounding the engine applies (ggml's CPU quantizes inputs to {})",
                m.cosine,
                crate::quant::vec_dot_type(wtype)
            )
        }
    };

    // One factor for the whole tensor: the op applies a constant the baseline does not. Not
    // for a norm: another eps moves every row by nearly the same factor when the rows' RMS are
    // alike, and the norm's own signatures read that per row.
    if k.tap != Tap::KqSoftMax
        && !k.tap.is_norm()
        && let Some((a, b)) = load(k)?
        && let Some(note) = scale_signature(k.tap, &a, &b, r.threshold, m.nmse)
    {
        why.push(note);
        return Ok(why.join("; "));
    }

    match k.tap {
        Tap::Embd => {
            if let Some((a, b)) = load(k)? {
                let bad: Vec<usize> = row_nmse(&a, &b)
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| **e > r.threshold)
                    .map(|(i, _)| i)
                    .collect();
                why.push(format!(
                    "token embedding rows {bad:?} differ: the token_embd.weight ({wtype}) decoder, or the row lookup (row = token id; GGUF ne = [n_embd, n_vocab]); if whole rows look shifted, the token ids differ (BOS, chat template)"
                ));
            }
        }
        Tap::AttnNorm
        | Tap::FfnNorm
        | Tap::ResultNorm
        | Tap::QNormed
        | Tap::KNormed
        | Tap::AttnPostNorm
        | Tap::FfnPostNorm => {
            let ratio_note = load(k)?.map(|(a, b)| norm_ratio_signature(&a, &b));
            match ratio_note {
                Some(Some(note)) => why.push(note),
                _ if m.nmse < 1e-4 => why.push(
                    "small error at the norm with matching input: rms eps (read it from the GGUF), or summation precision/order in the mean of squares".into(),
                ),
                _ => why.push("RMSNorm output differs with matching input: the normalization formula or its weight".into()),
            }
        }
        Tap::Q | Tap::K | Tap::V => {
            let v_ok = passed(Tap::V, k.layer);
            if k.tap != Tap::V && v_ok == Some(true) && m.cosine.abs() < 0.9 {
                why.push(
                    "V matches but Q/K do not: a Q/K row permutation (llama.cpp's converter permutes wq/wk rows for NORM RoPE; applying it twice or undoing it shuffles elements inside each head)".into(),
                );
            } else {
                why.push(matmul_hint(&format!("{} projection", k.tap)));
            }
        }
        Tap::QRope | Tap::KRope => {
            let pre = if k.tap == Tap::QRope { Tap::Q } else { Tap::K };
            if passed(pre, k.layer) == Some(true) {
                let rows = load(k)?.map(|(a, b)| row_nmse(&a, &b)).unwrap_or_default();
                let pos0 = base
                    .manifest
                    .steps
                    .get(k.step)
                    .and_then(|s| s.positions.first().copied())
                    .unwrap_or(0);
                if pos0 == 0 && rows.first().is_some_and(|&e| e <= r.threshold) && rows.len() > 1 {
                    why.push("RoPE: pre-RoPE q/k match, position 0 matches and later positions diverge — the pairing (NORM: (2i, 2i+1) for llama; NEOX: (i, i+n_rot/2) for qwen2), the frequency base (rope theta) or the rope scaling".into());
                } else if rows.windows(2).all(|w| w[1] >= w[0]) && rows.len() > 2 {
                    why.push("RoPE: the error grows with position — wrong rope theta / frequency scaling".into());
                } else {
                    why.push("RoPE: pre-RoPE q/k match but rotated ones do not — pairing, theta, or the positions passed".into());
                }
            }
        }
        Tap::KqSoftMax => why.push(
            "attention probabilities differ while q/k after RoPE matched: the score scale (1/sqrt(head_dim)), the causal mask, the KV cache contents at earlier positions, or the softmax".into(),
        ),
        Tap::KqvOut => {
            if let Some(note) = load(k)?.and_then(|(a, b)| head_signature(base, &a, &b, r.threshold)) {
                why.push(note);
            }
            if why.is_empty() || prefill_ok {
                why.push("attention output differs while the probabilities matched: the V cache (layout, positions) or the probs·V product".into());
            }
        }
        Tap::AttnOut => why.push(matmul_hint("attention output (Wo)")),
        Tap::LogitsUncapped => why.push(matmul_hint("output projection")),
        Tap::EmbdScaled => why.push(
            "the scaled embedding differs while the rows matched: the scale (gemma: sqrt(n_embd) in f32)".into(),
        ),
        Tap::FfnGate => why.push(matmul_hint("ffn_gate")),
        Tap::FfnUp => why.push(matmul_hint("ffn_up")),
        Tap::FfnOut => why.push(matmul_hint("ffn_down")),
        Tap::FfnAct => {
            if input_exact(Tap::FfnGate) && input_exact(Tap::FfnUp) {
                why.push("ffn_gate and ffn_up match but their product does not: SwiGLU operands swapped (silu must apply to gate, not up) or the wrong activation".into());
            }
        }
        Tap::FfnInp | Tap::LOut => why.push(
            "a residual sum differs while its operands matched: the residual connection (added twice, missing, or taken from the normalized value)".into(),
        ),
        Tap::Logits => {
            if passed(Tap::ResultNorm, None) == Some(true) {
                if m.cosine.abs() < 0.2 {
                    why.push("result_norm matches and the logits are uncorrelated: the output projection is transposed (lm_head GEMM flags / leading dimension) or uses the wrong matrix (output.weight when present; token_embd.weight only for tied embeddings)".into());
                } else {
                    why.push("result_norm matches but the logits do not: the output projection — tied embeddings (no output.weight: use token_embd.weight) or the output weight's decoding".into());
                }
            }
        }
    }
    if why.is_empty() {
        why.push(format!(
            "first divergence at {} with its inputs already off: see the taps before it",
            k
        ));
    }
    Ok(why.join("; "))
}

/// Norm signatures from the ratio candidate/baseline. Constant within each token's row (but
/// not 1): the per-token scale differs — rms eps or the mean-of-squares precision. Constant per
/// channel across tokens (but varying across channels): the weight vector is wrong — applied
/// twice, a missing/doubled +1 offset (Gemma-style), or another tensor.
fn norm_ratio_signature(a: &ArrayD<f32>, b: &ArrayD<f32>) -> Option<String> {
    let (a, b) = (rows2(a), rows2(b));
    let ratio = |r: usize, c: usize| -> Option<f64> {
        (a[[r, c]].abs() > 1e-6).then(|| b[[r, c]] as f64 / a[[r, c]] as f64)
    };
    let spread = |v: &[f64]| -> f64 {
        let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
        v.iter().map(|x| (x - mean).abs()).fold(0.0, f64::max) / mean.abs().max(1e-12)
    };
    let rows: Vec<Vec<f64>> = (0..a.nrows())
        .map(|r| (0..a.ncols()).filter_map(|c| ratio(r, c)).collect())
        .collect();
    let row_means: Vec<f64> = rows
        .iter()
        .filter(|v| !v.is_empty())
        .map(|v| v.iter().sum::<f64>() / v.len() as f64)
        .collect();
    let off = row_means
        .iter()
        .map(|m| (m - 1.0).abs())
        .fold(0.0, f64::max);
    if !rows.is_empty()
        && rows
            .iter()
            .all(|v| v.len() < 2 || spread(v) < off.max(1e-9) * 0.05)
    {
        return Some(format!(
            "each token's row is off by one factor (up to {off:.1e} from 1) shared by all its channels: the per-token RMS scale differs — the rms eps (read it from the GGUF: attention.layer_norm_rms_epsilon), or the precision/order of the mean of squares"
        ));
    }
    if a.nrows() < 2 {
        return None;
    }
    let (mut consistent, mut total) = (0, 0);
    for c in 0..a.ncols() {
        let v: Vec<f64> = (0..a.nrows()).filter_map(|r| ratio(r, c)).collect();
        if v.len() >= 2 {
            total += 1;
            consistent += (spread(&v) <= 1e-3) as usize;
        }
    }
    (total > 0 && consistent * 10 >= total * 9).then(|| {
        "the norm output is off by a per-channel factor that is the same for every token: the norm weight applied twice, a missing/doubled +1 offset (Gemma-style), or the wrong weight vector".into()
    })
}

/// The candidate is the baseline times one factor: after it, within the threshold, and the
/// error cut at least 100-fold.
fn scale_signature(
    tap: Tap,
    a: &ArrayD<f32>,
    b: &ArrayD<f32>,
    thr: f64,
    nmse: f64,
) -> Option<String> {
    let (mut xy, mut xx) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b.iter()) {
        xy += x as f64 * y as f64;
        xx += x as f64 * x as f64;
    }
    let c = xy / xx;
    if !c.is_finite() || (c - 1.0).abs() < 1e-4 {
        return None;
    }
    let scaled = a.mapv(|x| (x as f64 * c) as f32);
    let rest = metrics(&scaled.view(), &b.view()).nmse;
    (rest <= thr && rest * 100.0 <= nmse).then(|| {
        let why = match tap {
            Tap::Logits | Tap::LogitsUncapped => format!(
                "a sampling temperature applied before the logits were dumped (T = {:.4}), or the output weight's scale",
                1.0 / c
            ),
            _ => "a weight's or a block's scale read wrong, a residual or output multiplier, or a scale the architecture does not have".into(),
        };
        format!(
            "{tap} is the baseline's times {c:.5} throughout (after that one factor, NMSE {rest:.1e}, within the threshold): a constant factor in the op that writes it — {why}"
        )
    })
}

/// The GQA signature: attention output matches for some heads only.
fn head_signature(base: &Trace, a: &ArrayD<f32>, b: &ArrayD<f32>, thr: f64) -> Option<String> {
    // kqv_out is [T, n_head*head_dim]; the head count comes from the q tap's shape.
    let q = base
        .manifest
        .tensors
        .iter()
        .find(|t| t.tap == "q" && t.shape.len() == 3)?;
    let (nh, hd) = (q.shape[1], q.shape[2]);
    let (a, b) = (rows2(a), rows2(b));
    if a.ncols() != nh * hd {
        return None;
    }
    let ok: Vec<bool> = (0..nh)
        .map(|h| {
            let sa = a
                .slice(ndarray::s![.., h * hd..(h + 1) * hd])
                .to_owned()
                .into_dyn();
            let sb = b
                .slice(ndarray::s![.., h * hd..(h + 1) * hd])
                .to_owned()
                .into_dyn();
            metrics(&sa.view(), &sb.view()).nmse <= thr
        })
        .collect();
    let n_ok = ok.iter().filter(|&&x| x).count();
    if n_ok > 0 && n_ok < nh {
        let good: Vec<usize> = (0..nh).filter(|&h| ok[h]).collect();
        Some(format!(
            "attention output matches for heads {good:?} only: the GQA head map (query head h must read kv head h / (n_head / n_head_kv), not h % n_head_kv)"
        ))
    } else {
        None
    }
}
