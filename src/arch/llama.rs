//! llama (also Mistral and llama3): the base every other architecture is described against.
//!
//! llama.cpp: `src/models/llama.cpp`. Per layer: RMSNorm, q/k/v matmuls (optional biases),
//! NORM RoPE (adjacent pairs), causal attention with GQA and kq_scale `1/sqrt(head_dim)`
//! passed to the softmax, Wo (`attn_out-L`), residual, RMSNorm, SwiGLU FFN, residual. Output:
//! `output.weight`, or `token_embd.weight` when absent (tied).
//!
//! - **llama3 frequency factors**: a global `rope_freqs.weight` `[n_rot/2]`, computed by the
//!   converter from HF `rope_scaling` type llama3, which llama.cpp passes to every layer's ROPE
//!   node (`llama_model::get_rope_factors`): pair i turns at `theta_i / factor_i`.
//! - **Mistral** GGUFs are tagged `llama`; llama's loader reads no sliding window, so llama.cpp
//!   attends to the whole context, and so does parity.

use super::spec::{Activation, ArchSpec, Bias, EmbdScale, KqScale, Output, RopeType, SoftCap};

pub const SPEC: ArchSpec = ArchSpec {
    name: "llama",
    rope_type: RopeType::Norm,
    activation: Activation::Silu,
    qkv_bias: Bias::Optional,
    qk_norm: false,
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
