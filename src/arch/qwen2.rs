//! qwen2 (Qwen2, Qwen2.5): llama with NEOX RoPE and required q/k/v biases.
//!
//! llama.cpp: `src/models/qwen2.cpp`. As llama, except: RoPE pairs the halves of each head
//! (`x[i]`, `x[i + n_rot/2]`), `attn_q/k/v.bias` are in every layer, the RoPE base is usually
//! 1e6, and the Wo node is unnamed in the graph.

use super::spec::{Activation, ArchSpec, Bias, EmbdScale, KqScale, Output, RopeType, SoftCap};

pub const SPEC: ArchSpec = ArchSpec {
    name: "qwen2",
    rope_type: RopeType::Neox,
    activation: Activation::Silu,
    qkv_bias: Bias::Required,
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
