//! What an architecture is, as data: one [`ArchSpec`] per architecture, each in its own file
//! (src/arch/llama.rs, qwen2.rs, …), stating what llama.cpp's graph for it does differently from
//! llama. `Config::from_gguf` and `Model::from_gguf` read the metadata and tensors as the spec
//! says, with no per-architecture code of their own; [`Arch::spec`] (src/arch/registry.rs) is
//! the one place that maps an architecture to its spec. The vocabulary of a spec ([`Arch`], [`RopeType`],
//! [`Activation`], …) lives here, so this floor imports nothing from `model`: `model` reads
//! it (and re-exports the names its callers use).

use serde::Serialize;

/// How RoPE pairs the dimensions of a head (ggml `LLAMA_ROPE_TYPE_NORM` / `_NEOX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeType {
    /// Adjacent pairs (`x[2i]`, `x[2i+1]`): llama.
    Norm,
    /// Halves (`x[i]`, `x[i + n_rot/2]`): qwen2 and GPT-NeoX-style models.
    Neox,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma,
    Gemma2,
    Gemma3,
    Phi3,
}

/// The activation of the gated feed-forward block: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Activation {
    /// SwiGLU (llama, qwen, phi3).
    Silu,
    /// GELU, tanh approximation (gemma family; ggml_gelu).
    GeluTanh,
}

/// One architecture's differences from llama, as llama.cpp 0.3.36 loads and builds it
/// (docs/architectures.md).
#[derive(Debug)]
pub struct ArchSpec {
    /// `general.architecture` in the GGUF, and the prefix of the architecture's own keys.
    pub name: &'static str,
    /// How RoPE pairs the dimensions of a head.
    pub rope_type: RopeType,
    /// The gated feed-forward activation: `act(gate) · up`.
    pub activation: Activation,
    /// Whether `blk.L.attn_{q,k,v}.bias` are required, optional or refused.
    pub qkv_bias: Bias,
    /// Per-head RMSNorm of q and k before RoPE: `attn_q_norm.weight` / `attn_k_norm.weight`
    /// (`[head_dim]`, required in every layer).
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before their residual adds:
    /// `post_attention_norm.weight` / `post_ffw_norm.weight` (`[n_embd]`, required).
    pub post_norms: bool,
    /// What the token embeddings are multiplied by before the first layer.
    pub embd_scale: EmbdScale,
    /// The scale of q·k before the soft-cap and softmax.
    pub kq_scale: KqScale,
    /// Soft-cap of the attention scores (`<arch>.attn_logit_softcapping`).
    pub attn_softcap: SoftCap,
    /// Soft-cap of the final logits (`<arch>.final_logit_softcapping`).
    pub final_softcap: SoftCap,
    /// Interleaved sliding-window attention; `None`: every layer attends to the whole context
    /// (and `attention.sliding_window` is not read, or read and dropped as llama.cpp does).
    pub sliding_window: Option<SlidingWindow>,
    /// Where the output projection comes from.
    pub output: Output,
    /// q|k|v may be stored as one matrix, `blk.L.attn_qkv.weight` `[n_embd, n_embd_q +
    /// 2·n_embd_kv]`, q rows first, then k, then v (used when present; separate q/k/v otherwise).
    pub fused_qkv: bool,
    /// gate|up are stored as one matrix, `blk.L.ffn_up.weight` `[n_embd, 2·n_ff]`, the gate in
    /// the first n_ff rows (required: there is no `ffn_gate.weight`).
    pub fused_gate_up: bool,
    /// Besides the global `rope_freqs.weight` (llama3; any architecture may carry it), LongRoPE's
    /// `rope_factors_long.weight` / `rope_factors_short.weight` (`[n_rot/2]`), picked by the
    /// context length against `rope.scaling.original_context_length`.
    pub rope_factors_long_short: bool,
}

/// Presence of the q/k/v projection biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bias {
    /// Every layer has them (a file without is refused).
    Required,
    /// Used when layer 0 has `attn_q.bias`.
    Optional,
    /// A file with them is refused.
    Refused,
}

/// The token embedding scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmbdScale {
    None,
    /// `sqrt(n_embd)`, one f32 scalar (gemma family).
    SqrtNEmbd,
}

impl EmbdScale {
    pub fn value(self, n_embd: usize) -> Option<f32> {
        match self {
            EmbdScale::None => None,
            EmbdScale::SqrtNEmbd => Some((n_embd as f32).sqrt()),
        }
    }
}

/// The q·k scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KqScale {
    /// `1/sqrt(head_dim)`.
    InvSqrtHeadDim,
    /// `1/sqrt(n_embd/n_head)` for a model of exactly this many layers (the gemma 27B models,
    /// recognised by llama.cpp by their layer count), else `1/sqrt(head_dim)`.
    InvSqrtEmbdPerHeadAtLayers(usize),
}

impl KqScale {
    pub fn value(self, n_layer: usize, n_embd: usize, n_head: usize, head_dim: usize) -> f32 {
        match self {
            KqScale::InvSqrtEmbdPerHeadAtLayers(n) if n == n_layer => {
                1.0 / ((n_embd / n_head) as f32).sqrt()
            }
            _ => 1.0 / (head_dim as f32).sqrt(),
        }
    }
}

/// A soft-cap `cap · tanh(x / cap)` and its metadata key's default.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SoftCap {
    /// Never applied (the key is not read).
    None,
    /// Always applied: the key's value, else this default.
    Default(f32),
    /// Applied only when the key is present and non-zero.
    WhenSet,
}

/// The sliding-window attention of an architecture.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    /// The window length (`attention.sliding_window`).
    pub window: Window,
    /// Default layer period when `attention.sliding_window_pattern` is absent: layer `il` slides
    /// iff `il % period < period - 1`.
    pub period: usize,
    /// RoPE base of sliding layers when `rope.freq_base_swa` is absent; `None`: the global base.
    pub rope_base: Option<f32>,
    /// Whether sliding layers use the global linear RoPE scaling (else freq_scale 1).
    pub rope_scaled: bool,
}

/// How the window length is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// The key's value (which must be > 0), else this default.
    Default(usize),
    /// Only when the key is present and > 0; no window otherwise.
    WhenSet,
}

/// Where the output projection (the logits' matrix) comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Always `token_embd.weight` (the loader never reads `output.weight`).
    TokenEmbd,
    /// `output.weight`, else `token_embd.weight` (tied).
    OutputElseTokenEmbd,
}

#[cfg(test)]
mod tests {
    #[test]
    fn spec_rules_give_llama_cpp_values() {
        use super::*;
        assert_eq!(EmbdScale::SqrtNEmbd.value(256), Some(16.0));
        assert_eq!(EmbdScale::None.value(256), None);
        let k = KqScale::InvSqrtEmbdPerHeadAtLayers(46);
        // gemma2 27B: n_embd 4608 / 32 heads = 144, head_dim 128
        assert_eq!(k.value(46, 4608, 32, 128), 1.0 / 12.0);
        assert_eq!(k.value(42, 3584, 16, 256), 1.0 / 16.0);
        assert_eq!(KqScale::InvSqrtHeadDim.value(46, 4608, 32, 64), 0.125);
    }
}
