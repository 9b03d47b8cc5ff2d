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
    /// Any trace's every op recomputed from the trace's own inputs by the reference
    /// (`crate::judge`); each op's threshold is its own noise floor, set by the judge.
    OwnInputs,
}

/// Weight-type classes with distinct noise floors.
fn class(w: GgmlType) -> usize {
    match w {
        GgmlType::F32 => 0,
        GgmlType::F16 | GgmlType::BF16 => 1,
        _ => 2,
    }
}

/// NMSE threshold for `tap` when the model's matmul weights are `w` and the run has `depth`
/// layers.
///
/// End to end the same-rounding thresholds hold at the depths measured: generated 16-, 22-,
/// 32- and 64-layer models against fresh llama.cpp goldens (scripts/depth_matrix.sh,
/// docs/tolerances.md). Between different roundings only the embedding and the logits gate
/// ([`gates`]); the logits' bound grows with depth ([`depth_factor`]), the intermediate taps'
/// numbers are the level drift is drawn against. Each threshold sits above llama.cpp's own
/// spread — the same model under llama.cpp's defaults (F16 KV cache, flash attention) against
/// the tight golden — so no engine is blamed for less than llama.cpp itself allows. Small real
/// bugs are the op-by-op and own-error judgements' job, at the f32 floor.
pub fn nmse_threshold(pair: PairKind, w: GgmlType, tap: Tap, depth: usize) -> f64 {
    // [F32, F16/BF16, quantized]
    let base: [f64; 3] = match pair {
        // Both sides known to round activations like ggml's CPU with an f32 KV cache (parity's
        // own emulating backends against a tight golden). Worst clean value seen at depth:
        // F32 2.3e-12, F16 2.6e-6, quantized 2.5e-3 (64 layers).
        PairKind::SameRounding => [1e-10, 1e-4, 2e-2],
        // Anything else: llama.cpp's own spread (its F16 KV cache, at 64 layers) reaches F32
        // 3.6e-6, F16 6.6e-6, quantized 5.2e-3.
        PairKind::DifferentRounding => [1e-4, 1e-4, 2e-2],
        PairKind::OpByOp | PairKind::OwnInputs => [1e-10, 1e-10, 1e-10],
    };
    match tap {
        // Embedding rows are decoded exactly by every correct implementation.
        Tap::Embd => 1e-12,
        Tap::Logits if pair == PairKind::DifferentRounding => base[class(w)] * depth_factor(depth),
        _ => base[class(w)],
    }
}

/// How the end-to-end bounds on the logits between different roundings grow with the number
/// of layers: 1 up to the 22-layer depth they were set at, then in proportion to depth
/// (measured: docs/tolerances.md, "Verdicts at depth").
pub fn depth_factor(depth: usize) -> f64 {
    (depth as f64 / 22.0).max(1.0)
}

/// Whether a tap's NMSE is part of the verdict for this pair, or only the picture of drift.
///
/// Between different roundings, end to end, an intermediate tap's NMSE is compounded rounding
/// noise: it grows with depth and width (a clean Llama-2-7B-shaped Q4_0 model crosses 2e-2 at
/// ffn_out of layers 26–30, docs/tolerances.md) while every op sits at the f32 floor on its own.
/// No fixed number separates that from a bug, so those taps are drawn, not judged; the verdict
/// is each op's own error (op by op, `crate::judge`) and, end to end, what a user sees: the
/// logits (NMSE and KLD against a depth-aware bound) and the embedding rows (exact for any
/// correct decoder). Non-finite values fail at every tap.
pub fn gates(pair: PairKind, tap: Tap) -> bool {
    pair != PairKind::DifferentRounding || matches!(tap, Tap::Embd | Tap::Logits)
}

/// Mean KL divergence of the logits above which the run diverges. Above llama.cpp's own
/// spread (defaults vs tight, at 64 layers: F32 6.3e-7, F16 1.4e-6, quantized 1.1e-3).
pub fn kld_threshold(pair: PairKind, w: GgmlType, depth: usize) -> f64 {
    let scale = if pair == PairKind::DifferentRounding {
        depth_factor(depth)
    } else {
        1.0
    };
    scale
        * match (pair, class(w)) {
            (PairKind::OpByOp | PairKind::OwnInputs, _) => 1e-9,
            (PairKind::SameRounding, 0) => 1e-9,
            (PairKind::DifferentRounding, 0) => 1e-5,
            (_, 1) => 1e-4,
            (_, _) => 1e-2,
        }
}
