//! gemma2 (Gemma 2): gemma plus post-norms, soft-caps and interleaved sliding windows.
//!
//! llama.cpp: `src/models/gemma2.cpp` (model class `llama_model_gemma2`, always the iSWA
//! cache). As gemma (embedding scale, GELU, NEOX, tied output, norms folded `1 + w`), plus:
//! - Post-norms: `attn_post_norm-L` = rms_norm(Wo·kqv) · `post_attention_norm.weight` before
//!   the first residual; `ffn_post_norm` = rms_norm(ffn_out) · `post_ffw_norm.weight` before
//!   the second (named without a layer in llama.cpp's graph).
//! - q scaled after RoPE by `1/sqrt(head_dim)`, except the 27B (46 layers):
//!   `1/sqrt(n_embd/n_head)`. llama.cpp does not read `query_pre_attn_scalar`; the layer count
//!   decides.
//! - Attention soft-cap `attn_logit_softcapping` (default 50) on the scaled q·k before the
//!   mask; final soft-cap `final_logit_softcapping` (default 30) on the logits.
//! - Sliding window `attention.sliding_window` (default 4096), default period 2: layers 0, 2,
//!   4… slide. Sliding layers' RoPE base is `rope.freq_base_swa` (default the global base),
//!   with the same linear scaling.

use super::spec::{
    Activation, ArchSpec, Bias, EmbdScale, KqScale, Output, RopeType, SlidingWindow, SoftCap,
    Window,
};

pub const SPEC: ArchSpec = ArchSpec {
    name: "gemma2",
    rope_type: RopeType::Neox,
    activation: Activation::GeluTanh,
    qkv_bias: Bias::Refused,
    qk_norm: false,
    post_norms: true,
    embd_scale: EmbdScale::SqrtNEmbd,
    kq_scale: KqScale::InvSqrtEmbdPerHeadAtLayers(46),
    attn_softcap: SoftCap::Default(50.0),
    final_softcap: SoftCap::Default(30.0),
    sliding_window: Some(SlidingWindow {
        window: Window::Default(4096),
        period: 2,
        rope_base: None,
        rope_scaled: true,
    }),
    output: Output::TokenEmbd,
    fused_qkv: false,
    fused_gate_up: false,
    rope_factors_long_short: false,
};
