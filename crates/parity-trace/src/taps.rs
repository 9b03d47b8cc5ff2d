//! Canonical tap names, defined once, with their llama.cpp counterparts beside them.

use serde::{Deserialize, Serialize};

/// A named point in the forward pass. The declaration order is graph order within a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tap {
    Embd,
    /// gemma: the embedding rows times sqrt(n_embd).
    EmbdScaled,
    AttnNorm,
    Q,
    K,
    V,
    /// qwen3, gemma3: q after its per-head RMSNorm (x attn_q_norm.weight), before RoPE.
    QNormed,
    /// qwen3, gemma3: k after its per-head RMSNorm (x attn_k_norm.weight), before RoPE.
    KNormed,
    QRope,
    KRope,
    KqSoftMax,
    KqvOut,
    AttnOut,
    /// gemma2, gemma3: RMSNorm x post_attention_norm.weight of attn_out, before the residual.
    AttnPostNorm,
    FfnInp,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnAct,
    FfnOut,
    /// gemma2, gemma3: RMSNorm x post_ffw_norm.weight of ffn_out, before the residual.
    FfnPostNorm,
    LOut,
    ResultNorm,
    /// gemma2 (gemma3 when capped): the output projection before the final soft-cap.
    LogitsUncapped,
    Logits,
}

impl Tap {
    pub const ALL: [Tap; 25] = [
        Tap::Embd,
        Tap::EmbdScaled,
        Tap::AttnNorm,
        Tap::Q,
        Tap::K,
        Tap::V,
        Tap::QNormed,
        Tap::KNormed,
        Tap::QRope,
        Tap::KRope,
        Tap::KqSoftMax,
        Tap::KqvOut,
        Tap::AttnOut,
        Tap::AttnPostNorm,
        Tap::FfnInp,
        Tap::FfnNorm,
        Tap::FfnGate,
        Tap::FfnUp,
        Tap::FfnAct,
        Tap::FfnOut,
        Tap::FfnPostNorm,
        Tap::LOut,
        Tap::ResultNorm,
        Tap::LogitsUncapped,
        Tap::Logits,
    ];

    /// (canonical name, llama.cpp node name, meaning)
    fn info(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Tap::Embd => ("embd", "inp_embd", "token embedding rows"),
            Tap::EmbdScaled => (
                "embd_scaled",
                "inp_scaled",
                "embd x sqrt(n_embd) in f32 (gemma family)",
            ),
            Tap::AttnNorm => ("attn_norm", "attn_norm-L", "RMSNorm x attn_norm.weight"),
            Tap::Q => ("q", "Qcur-L", "Wq x (+ bias), before RoPE"),
            Tap::K => ("k", "Kcur-L", "Wk x (+ bias), before RoPE"),
            Tap::V => ("v", "Vcur-L", "Wv x (+ bias)"),
            Tap::QNormed => (
                "q_normed",
                "Qcur_normed-L",
                "per-head RMSNorm x attn_q_norm of q, before RoPE (qwen3, gemma3)",
            ),
            Tap::KNormed => (
                "k_normed",
                "Kcur_normed-L",
                "per-head RMSNorm x attn_k_norm of k, before RoPE (qwen3, gemma3)",
            ),
            Tap::QRope => ("q_rope", "Qcur-L (ROPE)", "q after RoPE"),
            Tap::KRope => ("k_rope", "Kcur-L (ROPE)", "k after RoPE"),
            Tap::KqSoftMax => ("kq_soft_max", "kq_soft_max-L", "attention probabilities"),
            Tap::KqvOut => ("kqv_out", "kqv_out-L", "attention output before Wo"),
            Tap::AttnOut => ("attn_out", "attn_out-L", "Wo x kqv_out"),
            Tap::AttnPostNorm => (
                "attn_post_norm",
                "attn_post_norm-L",
                "RMSNorm x post_attention_norm of attn_out (gemma2, gemma3)",
            ),
            Tap::FfnInp => ("ffn_inp", "ffn_inp-L", "first residual sum"),
            Tap::FfnNorm => ("ffn_norm", "ffn_norm-L", "RMSNorm x ffn_norm.weight"),
            Tap::FfnGate => ("ffn_gate", "ffn_gate-L", "W_gate x"),
            Tap::FfnUp => ("ffn_up", "ffn_up-L", "W_up x"),
            Tap::FfnAct => ("ffn_act", "ffn_swiglu-L", "silu(gate) * up"),
            Tap::FfnOut => ("ffn_out", "ffn_out-L (MUL_MAT)", "W_down x ffn_act"),
            Tap::FfnPostNorm => (
                "ffn_post_norm",
                "ffn_post_norm-L (gemma2: ffn_post_norm, per layer in order)",
                "RMSNorm x post_ffw_norm of ffn_out (gemma2, gemma3)",
            ),
            Tap::LOut => ("l_out", "l_out-L", "layer output"),
            Tap::ResultNorm => ("result_norm", "result_norm", "final RMSNorm"),
            Tap::LogitsUncapped => (
                "logits_uncapped",
                "logits_uncapped (unnamed MUL_MAT of result_norm)",
                "output projection before the final soft-cap (gemma2)",
            ),
            Tap::Logits => ("logits", "result_output", "output projection"),
        }
    }

    pub fn name(self) -> &'static str {
        self.info().0
    }

    pub fn llama_cpp_name(self) -> &'static str {
        self.info().1
    }

    pub fn meaning(self) -> &'static str {
        self.info().2
    }

    pub fn per_layer(self) -> bool {
        !matches!(
            self,
            Tap::Embd | Tap::EmbdScaled | Tap::ResultNorm | Tap::LogitsUncapped | Tap::Logits
        )
    }

    /// Whether the op writing this tap is an RMSNorm (its weight applied).
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            Tap::AttnNorm
                | Tap::FfnNorm
                | Tap::ResultNorm
                | Tap::QNormed
                | Tap::KNormed
                | Tap::AttnPostNorm
                | Tap::FfnPostNorm
        )
    }

    pub fn parse(s: &str) -> Option<Tap> {
        Self::ALL.iter().copied().find(|t| t.name() == s)
    }
}

impl std::fmt::Display for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which recorded tensor: (step, layer, tap). Orders in graph order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TapKey {
    pub step: usize,
    pub layer: Option<usize>,
    pub tap: Tap,
}

impl TapKey {
    pub fn new(step: usize, layer: Option<usize>, tap: Tap) -> TapKey {
        TapKey { step, layer, tap }
    }

    /// `attn_norm-3`, `embd` — the name within a step (llama.cpp style).
    pub fn name(&self) -> String {
        match self.layer {
            Some(l) => format!("{}-{l}", self.tap),
            None => self.tap.to_string(),
        }
    }

    /// File name inside a trace folder.
    pub fn file(&self) -> String {
        format!("s{:03}/{}.npy", self.step, self.name())
    }

    fn order(&self) -> (usize, usize, Tap) {
        let group = match (self.tap, self.layer) {
            (Tap::Embd | Tap::EmbdScaled, _) => 0,
            (_, Some(l)) => l + 1,
            _ => usize::MAX,
        };
        (self.step, group, self.tap)
    }
}

impl PartialOrd for TapKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TapKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.order().cmp(&other.order())
    }
}

impl std::fmt::Display for TapKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layer {
            Some(l) => write!(f, "step {} layer {} {}", self.step, l, self.tap),
            None => write!(f, "step {} {}", self.step, self.tap),
        }
    }
}
