//! qwen3: llama with NEOX RoPE, no biases, and per-head RMSNorm of q and k before RoPE.
//!
//! llama.cpp: `src/models/qwen3.cpp`. After the q/k matmuls and the reshape to heads, each
//! head's head_dim values are RMS-normed (the model's eps) and multiplied by
//! `attn_q_norm.weight` / `attn_k_norm.weight` (`[head_dim]`): `Qcur_normed-L`,
//! `Kcur_normed-L`; **then** RoPE. kq_scale `1/sqrt(head_dim)`. head_dim comes from
//! `attention.key_length` and may exceed n_embd/n_head (the 0.6B: 128 vs 64), so Wq is
//! `[n_embd, n_head·head_dim]` and Wo `[n_head·head_dim, n_embd]`.

use super::spec::{Activation, ArchSpec, Bias, EmbdScale, KqScale, Output, RopeType, SoftCap};

pub const SPEC: ArchSpec = ArchSpec {
    name: "qwen3",
    rope_type: RopeType::Neox,
    activation: Activation::Silu,
    qkv_bias: Bias::Refused,
    qk_norm: true,
    post_norms: false,
    embd_scale: EmbdScale::None,
    kq_scale: KqScale::InvSqrtHeadDim,
    attn_softcap: SoftCap::None,
    final_softcap: SoftCap::None,
    sliding_window: None,
    output: Output::OutputElseTokenEmbd,
    fused_qkv: false,
    fused_gate_up: false,
    rope_factors_long_short: false,
};
