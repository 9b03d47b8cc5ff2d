//! gemma3 (Gemma 3 text): gemma2's post-norms, qwen3's q/k norms, per-layer RoPE, no
//! attention soft-cap.
//!
//! llama.cpp: `src/models/gemma3.cpp`. As gemma2 (embedding scale, GELU, NEOX, post-norms —
//! `ffn_post_norm-L` named per layer — the 27B's q scale by its 62 layers), plus:
//! - Per-head `Qcur_normed-L` / `Kcur_normed-L` as qwen3, before RoPE.
//! - No attention soft-cap; a final soft-cap only when `final_logit_softcapping` is present
//!   and non-zero (real Gemma 3 files have none).
//! - Sliding window only when `attention.sliding_window` is present and > 0; default period 6
//!   (five local layers, then one global), or `sliding_window_pattern`.
//! - RoPE per layer: global layers use `rope.freq_base` (1e6) with the linear scaling of
//!   `rope.scaling.factor`; local layers use base 10000 (or `rope.freq_base_swa`) and
//!   freq_scale 1.
//! - `output.weight` optional (tied otherwise).

use super::spec::{
    Activation, ArchSpec, Bias, EmbdScale, KqScale, Output, RopeType, SlidingWindow, SoftCap,
    Window,
};

pub const SPEC: ArchSpec = ArchSpec {
    name: "gemma3",
    rope_type: RopeType::Neox,
    activation: Activation::GeluTanh,
    qkv_bias: Bias::Refused,
    qk_norm: true,
    post_norms: true,
    embd_scale: EmbdScale::SqrtNEmbd,
    kq_scale: KqScale::InvSqrtEmbdPerHeadAtLayers(62),
    attn_softcap: SoftCap::None,
    final_softcap: SoftCap::WhenSet,
    sliding_window: Some(SlidingWindow {
        window: Window::WhenSet,
        period: 6,
        rope_base: Some(10000.0),
        rope_scaled: false,
    }),
    output: Output::OutputElseTokenEmbd,
    fused_qkv: false,
    fused_gate_up: false,
    rope_factors_long_short: false,
};
