//! What kind of arithmetic each tap's op does: the floors (`floor`) are set per class, and a
//! replay that models an engine's own sums (`replay::Nudged::Matmuls`) nudges one class. A file
//! of its own, under both: the floors read spans, which read replays.

use crate::trace::Tap;

/// What kind of arithmetic an op does (its floor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpClass {
    /// Embedding rows: decoded exactly.
    Lookup,
    Norm,
    Matmul,
    Rope,
    /// Scores, mask and softmax; the probability-weighted sum of V.
    Attention,
    /// Residual adds, SwiGLU.
    Elementwise,
}

pub fn class(tap: Tap) -> OpClass {
    match tap {
        Tap::Embd => OpClass::Lookup,
        Tap::AttnNorm
        | Tap::FfnNorm
        | Tap::ResultNorm
        | Tap::QNormed
        | Tap::KNormed
        | Tap::AttnPostNorm
        | Tap::FfnPostNorm => OpClass::Norm,
        Tap::LogitsUncapped => OpClass::Matmul,
        Tap::EmbdScaled => OpClass::Elementwise,
        Tap::Q
        | Tap::K
        | Tap::V
        | Tap::AttnOut
        | Tap::FfnGate
        | Tap::FfnUp
        | Tap::FfnOut
        | Tap::Logits => OpClass::Matmul,
        Tap::QRope | Tap::KRope => OpClass::Rope,
        Tap::KqSoftMax | Tap::KqvOut => OpClass::Attention,
        Tap::FfnInp | Tap::FfnAct | Tap::LOut => OpClass::Elementwise,
    }
}
