//! An RMSNorm's per-row scale solved from the trace. Where a norm is the first op out of its
//! floor and no hypothesis reproduces it, each row's output is its input times the weight
//! times one number `s` (the op is a scale per row) or it is not; that number against the
//! row's mean square says which formula the engine computes: `1/sqrt(a·ms + b)` (the mean over
//! another count than the row's width, another eps), `1/(sqrt(ms) + b)` (eps outside the
//! square root). The catalog names the formulas engines get grossly wrong (rms-no-sqrt,
//! rms-sum-not-mean, layernorm-not-rms); these move a row by a factor within a percent of 1.

use super::JudgeError;
use super::replay::Candidate;
use crate::gguf::TensorInfo;
use crate::model::Model;
use crate::trace::{Tap, TapKey};

/// How closely a row must be its input times the weight times one number to be a scale.
const SCALE_FIT: f64 = 1e-10;
/// How closely a formula must give every row's scale (relative) to be the one computed.
const FORMULA_FIT: f64 = 2e-6;

/// The norm's input key and weight at `k`, where the trace has its input.
fn input<'m>(model: &'m Model, cand: &Candidate, k: &TapKey) -> Option<(TapKey, &'m TensorInfo)> {
    let n_layer = model.config.n_layer;
    let (key, w) = match (k.tap, k.layer) {
        (Tap::AttnNorm, Some(0)) => {
            let scaled = TapKey::new(k.step, None, Tap::EmbdScaled);
            let key = if cand.contains(&scaled) {
                scaled
            } else {
                TapKey::new(k.step, None, Tap::Embd)
            };
            (key, &model.layers[0].attn_norm)
        }
        (Tap::AttnNorm, Some(l)) => (
            TapKey::new(k.step, Some(l - 1), Tap::LOut),
            &model.layers.get(l)?.attn_norm,
        ),
        (Tap::FfnNorm, Some(l)) => (
            TapKey::new(k.step, Some(l), Tap::FfnInp),
            &model.layers.get(l)?.ffn_norm,
        ),
        (Tap::ResultNorm, None) if n_layer > 0 => (
            TapKey::new(k.step, Some(n_layer - 1), Tap::LOut),
            &model.output_norm,
        ),
        _ => return None,
    };
    cand.contains(&key).then_some((key, w))
}

/// The formula the norm at `k` computes, in words, where its rows are scales of their
/// input and one formula gives every row's scale. None where the trace lacks the input, the
/// op is not a scale per row, or its scale is the model's.
pub fn observed(model: &Model, cand: &Candidate, k: &TapKey) -> Result<Option<String>, JudgeError> {
    let Some((in_key, w)) = input(model, cand, k) else {
        return Ok(None);
    };
    let (weight, n) = (model.vector(w), w.rows().0);
    let (Some(x), Some(y)) = (cand.get(&in_key)?, cand.get(k)?) else {
        return Ok(None);
    };
    if n == 0 || x.len() != y.len() || x.len() % n != 0 || weight.len() != n {
        return Ok(None);
    }
    let c = &model.config;
    let eps = match k.tap {
        Tap::ResultNorm => c.output_norm_eps.unwrap_or(c.rms_eps),
        _ => c.rms_eps,
    } as f64;
    // Each row: its mean square and the scale s that makes y = s·x·w (least squares).
    let mut rows: Vec<(f64, f64)> = Vec::new();
    for (xr, yr) in x.chunks(n).zip(y.chunks(n)) {
        let (mut uy, mut uu, mut yy, mut ss) = (0f64, 0f64, 0f64, 0f64);
        for i in 0..n {
            let u = xr[i] as f64 * weight[i] as f64;
            uy += u * yr[i] as f64;
            uu += u * u;
            yy += (yr[i] as f64).powi(2);
            ss += (xr[i] as f64).powi(2);
        }
        if uu == 0.0 || yy == 0.0 {
            continue;
        }
        let s = uy / uu;
        // Σ(y − s·u)² = yy − 2s·uy + s²·uu, relative to yy.
        if (yy - 2.0 * s * uy + s * s * uu).max(0.0) / yy > SCALE_FIT || s <= 0.0 {
            return Ok(None);
        }
        rows.push((ss / n as f64, s));
    }
    if rows.len() < 2 {
        return Ok(None);
    }
    let fits = |f: &dyn Fn(f64) -> f64| {
        rows.iter()
            .all(|&(ms, s)| (f(ms) / s - 1.0).abs() <= FORMULA_FIT)
    };
    if fits(&|ms| 1.0 / (ms + eps).sqrt()) {
        return Ok(None);
    }
    // 1/s = sqrt(ms) + b: eps outside the square root (one number, tried first).
    let m = rows.len() as f64;
    let b = rows.iter().map(|&(ms, s)| 1.0 / s - ms.sqrt()).sum::<f64>() / m;
    if fits(&|ms| 1.0 / (ms.sqrt() + b)) {
        return Ok(Some(format!(
            "each row's RMS scale, solved from the norm's input and output, is 1/(sqrt(mean(x²)) + {b:.1e}): eps is added outside the square root, where the model's is 1/sqrt(mean(x²) + {eps:.0e}){}",
            every_norm(k)
        )));
    }
    // Else 1/s² = a·ms + b, fitted over the rows (least squares).
    let (sx, sy) = rows
        .iter()
        .fold((0.0, 0.0), |(a, b), &(ms, s)| (a + ms, b + 1.0 / (s * s)));
    let (mx, my) = (sx / m, sy / m);
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for &(ms, s) in &rows {
        sxy += (ms - mx) * (1.0 / (s * s) - my);
        sxx += (ms - mx).powi(2);
    }
    if sxx > 0.0 {
        let a = sxy / sxx;
        let b = my - a * mx;
        if a > 0.0 && fits(&|ms| 1.0 / (a * ms + b).max(f64::MIN_POSITIVE).sqrt()) {
            // The count the mean divides by, where it is a whole number near the width.
            let count = n as f64 / a;
            let whole = count.round();
            if (count - whole).abs() <= 1e-3 * count && whole as usize != n {
                return Ok(Some(format!(
                    "each row's RMS scale, solved from the norm's input and output, is 1/sqrt(Σx²/{whole} + {b:.1e}): the mean of squares divides by {whole} where the row has {n} values (the model's eps {eps:.0e}){}",
                    every_norm(k)
                )));
            }
            return Ok(Some(format!(
                "each row's RMS scale, solved from the norm's input and output, is 1/sqrt({a:.6}·mean(x²) + {b:.1e}) where the model's is 1/sqrt(mean(x²) + {eps:.0e}){}",
                every_norm(k)
            )));
        }
    }
    Ok(None)
}

/// Where the first norm out is the final one, the layers' norms most likely compute the same.
fn every_norm(k: &TapKey) -> &'static str {
    match k.tap {
        Tap::ResultNorm => {
            " — the layers' norms most likely compute it too (their spans moved by less than their floors)"
        }
        _ => "",
    }
}
