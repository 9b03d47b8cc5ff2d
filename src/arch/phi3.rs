//! phi3 (Phi-3, Phi-4 mini): llama with NEOX RoPE, fused qkv and gate/up, LongRoPE factors.
//!
//! llama.cpp: `src/models/phi3.cpp`. Differences from llama:
//! - q scaled by `1/sqrt(head_dim)` after RoPE (the SCALE node named `Qcur-L` again), softmax
//!   kq_scale 1; the first residual sum is unnamed.
//! - **Fused QKV**: `blk.L.attn_qkv.weight` `[n_embd, n_embd_q + 2·n_embd_kv]` (separate
//!   q/k/v also accepted); q, k, v are views of the one matmul's output at offsets 0,
//!   n_embd_q, n_embd_q + n_embd_kv. parity keeps no copy: wq, wk, wv are row views.
//! - **Fused gate/up**: `blk.L.ffn_up.weight` `[n_embd, 2·n_ff]`, `ffn_swiglu-L` =
//!   silu(first half) · second half: the gate is the first n_ff rows.
//! - **LongRoPE**: global `rope_factors_long.weight` / `rope_factors_short.weight`
//!   `[n_rot/2]`; the long ones when the context per sequence exceeds
//!   `rope.scaling.original_context_length`, else the short ones. `rope.scaling.attn_factor`
//!   multiplies cos and sin of q and k whichever factors are used.
//! - **No sliding window**: the loader reads `attention.sliding_window` and drops it
//!   (llama.cpp PR #13676, "Phi SWA is currently disabled").

use super::spec::{Activation, ArchSpec, Bias, EmbdScale, KqScale, Output, RopeType, SoftCap};

pub const SPEC: ArchSpec = ArchSpec {
    name: "phi3",
    rope_type: RopeType::Neox,
    activation: Activation::Silu,
    qkv_bias: Bias::Refused,
    qk_norm: false,
    post_norms: false,
    embd_scale: EmbdScale::None,
    kq_scale: KqScale::InvSqrtHeadDim,
    attn_softcap: SoftCap::None,
    final_softcap: SoftCap::None,
    sliding_window: None,
    output: Output::OutputElseTokenEmbd,
    fused_qkv: true,
    fused_gate_up: true,
    rope_factors_long_short: true,
};
