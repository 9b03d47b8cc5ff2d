//! The tolerance policy: the largest NMSE a tap may show before it counts as a divergence.
//!
//! One fixed threshold cannot serve (../docs/tolerances.md has the measurements): an f32
//! reference and llama.cpp's CPU backend agree to ~1e-13 on F32 weights, while on quantized
//! weights llama.cpp rounds every matmul input to Q8 and a plain f32 reference is off by ~1e-4.
//! So the threshold depends on the weight type and on whether both sides round activations
//! the same way (the *pair kind*), and sits a safety factor above the noise floor measured for
//! that combination — low enough that small real bugs (a wrong rms eps moves attn_norm by
//! ~5e-9) stand out when the floor allows it.

use crate::gguf::GgmlType;
use crate::trace::Tap;
use serde::Serialize;

/// How the two sides of a comparison treat matmul inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PairKind {
    /// Both round activations as ggml's CPU does (reference+ggml-cpu, fast, llama.cpp CPU):
    /// only f32 summation order differs.
    SameRounding,
    /// One side keeps f32 activations where the other quantizes them (plain reference vs
    /// llama.cpp, or an external engine whose arithmetic we don't know).
    DifferentRounding,
    /// Same rounding, and each op fed the baseline's own inputs (`backend::replay`): no error
    /// can compound or flip a quantization boundary, so every op must sit at the f32 floor.
    OpByOp,
}

/// Weight-type classes with distinct noise floors.
fn class(w: GgmlType) -> usize {
    match w {
        GgmlType::F32 => 0,
        GgmlType::F16 | GgmlType::BF16 => 1,
        _ => 2,
    }
}

/// NMSE threshold for `tap` when the model's matmul weights are `w`.
/// Floors measured on the committed fixtures and ../shared models (docs/tolerances.md);
/// thresholds sit 10–100× above the largest floor seen.
pub fn nmse_threshold(pair: PairKind, w: GgmlType, tap: Tap) -> f64 {
    // [F32, F16/BF16, quantized]
    let base: [f64; 3] = match pair {
        // Quantized same-rounding pairs agree to ~1e-14 until an activation that sits on a
        // rounding boundary flips by one quantum in one side (f32 noise upstream decides which
        // way); one flip costs ~1e-7..1e-6 locally and random-weight models amplify it to
        // ~1e-4 at the logits of a one-token decode step, so the end-to-end threshold leaves
        // room for that. The op-by-op comparison, where no flip can happen, carries 1e-10.
        PairKind::SameRounding => [1e-10, 1e-5, 1e-3],
        PairKind::DifferentRounding => [1e-10, 1e-5, 1e-2],
        PairKind::OpByOp => [1e-10, 1e-10, 1e-10],
    };
    match tap {
        // Embedding rows are decoded exactly by every correct implementation.
        Tap::Embd => 1e-12,
        _ => base[class(w)],
    }
}

/// Mean KL divergence of the logits above which the run diverges (llama-perplexity's KLD of
/// a good Q8_0 vs F16 model is ~1e-4; same-rounding pairs sit many orders below).
pub fn kld_threshold(pair: PairKind, w: GgmlType) -> f64 {
    match (pair, class(w)) {
        (PairKind::OpByOp, _) => 1e-9,
        (PairKind::SameRounding, 0) => 1e-9,
        (PairKind::SameRounding, 1) => 1e-5,
        (PairKind::SameRounding, _) => 1e-3,
        (PairKind::DifferentRounding, 0) => 1e-9,
        (PairKind::DifferentRounding, 1) => 1e-5,
        (PairKind::DifferentRounding, _) => 1e-2,
    }
}
