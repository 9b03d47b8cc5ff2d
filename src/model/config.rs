//! Architecture and hyperparameters, read from GGUF metadata with the keys llama.cpp uses.

use crate::gguf::GgufFile;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unsupported architecture '{0}' (parity supports: {list})", list = Arch::supported())]
    UnsupportedArch(String),
    #[error("missing metadata key '{0}'")]
    MissingKey(String),
    #[error("metadata key '{key}': {what}")]
    BadKey { key: String, what: String },
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    #[error(
        "vocab-only file: no tensors (a tokenizer's vocabulary, not a model: use it with `parity tokenize`)"
    )]
    VocabOnly,
    #[error("tensor '{name}': expected dims {expected:?} (ggml ne order), found {found:?}")]
    BadShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
}

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

impl Arch {
    /// Every architecture, as `general.architecture` names it.
    pub const ALL: &[Arch] = &[
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma,
        Arch::Gemma2,
        Arch::Gemma3,
        Arch::Phi3,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma => "gemma",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3",
            Arch::Phi3 => "phi3",
        }
    }

    pub fn parse(s: &str) -> Option<Arch> {
        Arch::ALL.iter().copied().find(|a| a.name() == s)
    }

    /// `llama, qwen2, …` for messages.
    pub fn supported() -> String {
        Arch::ALL
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join(", ")
    }
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

#[derive(Clone, Debug, Serialize)]
pub struct Config {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    pub rope_type: RopeType,
    pub rope_theta: f32,
    /// Dimensions of each head that RoPE rotates (`rope.dimension_count`, default head_dim).
    pub n_rot: usize,
    /// Linear RoPE scaling factor (`rope.scaling.factor` with type linear); 1.0 when absent.
    pub rope_freq_scale: f32,
    /// No `output.weight`: the output projection reuses `token_embd.weight`.
    pub tied_embeddings: bool,
    pub has_qkv_bias: bool,
    // What the architecture is, as data the one forward reads (see src/arch/).
    /// Gated FFN activation.
    pub activation: Activation,
    /// Multiply the token embeddings by this (gemma: sqrt(n_embd)).
    pub embd_scale: Option<f32>,
    /// Scale applied to q·k before the softmax (1/sqrt(head_dim) unless the architecture says).
    pub kq_scale: f32,
    /// Soft-cap of attention scores: `cap · tanh(s / cap)` (gemma2).
    pub attn_softcap: Option<f32>,
    /// Soft-cap of the final logits (gemma2).
    pub final_softcap: Option<f32>,
    /// Sliding-window length (0: none) and, per layer, whether that layer uses it.
    pub n_swa: usize,
    pub swa_layers: Vec<bool>,
    /// RoPE base and linear frequency scale of sliding-window layers (gemma3's local layers).
    pub rope_theta_swa: f32,
    pub rope_freq_scale_swa: f32,
    /// Multiplier of RoPE's cos and sin (LongRoPE's attention factor, phi3); 1.0 otherwise.
    pub rope_attn_factor: f32,
}

impl Config {
    pub fn from_gguf(f: &GgufFile) -> Result<Config, ModelError> {
        let arch_name = f
            .architecture()
            .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
        let arch = match Arch::parse(arch_name) {
            Some(a @ (Arch::Llama | Arch::Qwen2)) => a,
            _ => return Err(ModelError::UnsupportedArch(arch_name.to_string())),
        };
        let key = |s: &str| format!("{arch_name}.{s}");
        let req = |s: &str| -> Result<usize, ModelError> {
            let k = key(s);
            let v = f.get(&k).ok_or_else(|| ModelError::MissingKey(k.clone()))?;
            let n = v.as_u64().ok_or_else(|| ModelError::BadKey {
                key: k.clone(),
                what: "not an unsigned integer".into(),
            })?;
            // Hyperparameters size allocations: refuse absurd values up front.
            if n == 0 || n > 1 << 24 {
                return Err(ModelError::BadKey {
                    key: k,
                    what: format!("{n} is out of range"),
                });
            }
            Ok(n as usize)
        };
        let n_embd = req("embedding_length")?;
        let n_layer = req("block_count")?;
        let n_head = req("attention.head_count")?;
        let n_head_kv = match f.get(&key("attention.head_count_kv")) {
            Some(_) => req("attention.head_count_kv")?,
            None => n_head,
        };
        let n_ff = req("feed_forward_length")?;
        let n_ctx_train = req("context_length")?;
        let head_dim = match f.get(&key("attention.key_length")) {
            Some(_) => req("attention.key_length")?,
            None => n_embd / n_head,
        };
        if n_head % n_head_kv != 0 {
            return Err(ModelError::BadKey {
                key: key("attention.head_count_kv"),
                what: format!("{n_head} query heads are not a multiple of {n_head_kv} kv heads"),
            });
        }
        let n_rot = match f.get(&key("rope.dimension_count")) {
            Some(_) => req("rope.dimension_count")?,
            None => head_dim,
        };
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::BadKey {
                key: key("rope.dimension_count"),
                what: format!("{n_rot} is not an even number ≤ head_dim {head_dim}"),
            });
        }
        let rms_eps = f
            .get_f64(&key("attention.layer_norm_rms_epsilon"))
            .ok_or_else(|| ModelError::MissingKey(key("attention.layer_norm_rms_epsilon")))?
            as f32;
        let rope_theta = f.get_f64(&key("rope.freq_base")).unwrap_or(10000.0) as f32;
        let rope_freq_scale = match f.get_str(&key("rope.scaling.type")) {
            None | Some("none") => 1.0,
            Some("linear") => {
                let factor = f.get_f64(&key("rope.scaling.factor")).unwrap_or(1.0);
                if factor > 0.0 {
                    (1.0 / factor) as f32
                } else {
                    1.0
                }
            }
            Some(other) => {
                return Err(ModelError::BadKey {
                    key: key("rope.scaling.type"),
                    what: format!("RoPE scaling '{other}' is not supported yet (linear is)"),
                });
            }
        };
        let embd = f
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let n_vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let (rope_type, has_qkv_bias) = match arch {
            Arch::Llama => (RopeType::Norm, f.tensor("blk.0.attn_q.bias").is_some()),
            Arch::Qwen2 => (RopeType::Neox, true),
            _ => unreachable!("refused above"),
        };
        Ok(Config {
            arch,
            n_vocab,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            n_ctx_train,
            rms_eps,
            rope_type,
            rope_theta,
            n_rot,
            rope_freq_scale,
            tied_embeddings: f.tensor("output.weight").is_none(),
            has_qkv_bias,
            activation: Activation::Silu,
            embd_scale: None,
            kq_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
            n_swa: 0,
            swa_layers: vec![false; n_layer],
            rope_theta_swa: rope_theta,
            rope_freq_scale_swa: rope_freq_scale,
            rope_attn_factor: 1.0,
        })
    }

    pub fn n_embd_q(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn n_embd_kv(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}
