//! gemma (Gemma 1): embedding scale, GELU, NEOX RoPE, always-tied output.
//!
//! llama.cpp: `src/models/gemma.cpp`. Differences from llama:
//! - `inp_scaled` = embd · sqrtf(n_embd), one f32 scalar computed in f32 (not rounded to bf16
//!   as in HF).
//! - NEOX RoPE; q is scaled by `1/sqrt(head_dim)` after RoPE (`Qcur_scaled-L`) and the softmax
//!   gets 1 — the same scores as llama's kq_scale.
//! - FFN `ffn_geglu-L` = gelu(gate) · up, ggml's tanh approximation through ggml-cpu's f16
//!   table.
//! - Norms: HF computes `x · (1 + w)`; the converter adds the 1 to every `*norm.weight`, so
//!   the GGUF holds `1 + w` and llama.cpp does a plain rms_norm · weight.
//! - Output: always `token_embd.weight` (the loader never reads `output.weight`).
//! - The residual after attention is named `sa_out-L`.

use super::spec::{Activation, ArchSpec, Bias, EmbdScale, KqScale, Output, RopeType, SoftCap};

pub const SPEC: ArchSpec = ArchSpec {
    name: "gemma",
    rope_type: RopeType::Neox,
    activation: Activation::GeluTanh,
    qkv_bias: Bias::Refused,
    qk_norm: false,
    post_norms: false,
    embd_scale: EmbdScale::SqrtNEmbd,
    kq_scale: KqScale::InvSqrtHeadDim,
    attn_softcap: SoftCap::None,
    final_softcap: SoftCap::None,
    sliding_window: None,
    output: Output::TokenEmbd,
    fused_qkv: false,
    fused_gate_up: false,
    rope_factors_long_short: false,
};
