//! Architecture and hyperparameters, read from GGUF metadata with the keys llama.cpp uses.

use crate::arch::spec::{Activation, Arch, Bias, Output, RopeType, SoftCap, Window};
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
    #[error("tensor '{name}' is {ty}: {why}")]
    BadType {
        name: String,
        ty: String,
        why: String,
    },
    #[error(
        "the vocabulary holds {tokens} tokens (tokenizer.ggml.tokens) but tensor 'token_embd.weight' has {rows} rows: llama.cpp refuses a vocabulary of another size than the embeddings"
    )]
    VocabSize { tokens: usize, rows: usize },
    #[error("tensor '{name}': expected dims {expected:?} (ggml ne order), found {found:?}")]
    BadShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
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
    /// The final norm's (`output_norm`) epsilon where it differs from `rms_eps`: no model
    /// sets one; a replay does, to test an engine whose final norm alone adds another eps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_norm_eps: Option<f32>,
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
    /// Multiplier of RoPE's cos and sin (`rope.scaling.attn_factor`: LongRoPE's attention
    /// factor, phi3); 1.0 otherwise.
    pub rope_attn_factor: f32,
    /// The context the RoPE factors were trained for (`rope.scaling.original_context_length`,
    /// default n_ctx_train): llama.cpp uses phi3's long factors when its context is longer.
    pub n_ctx_orig: usize,
}

impl Config {
    /// Read the hyperparameters as llama.cpp's loader does (`llama_model::load_hparams` and the
    /// architecture's `load_arch_hparams` in src/models/*.cpp): same keys, same defaults, same
    /// derived values. What differs between architectures is their [`crate::arch::spec::ArchSpec`]
    /// (src/arch/<name>.rs); docs/architectures.md lists it per architecture.
    pub fn from_gguf(f: &GgufFile) -> Result<Config, ModelError> {
        let arch_name = f
            .architecture()
            .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
        let arch = Arch::parse(arch_name)
            .ok_or_else(|| ModelError::UnsupportedArch(arch_name.to_string()))?;
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
        let opt_usize = |s: &str| -> Result<Option<usize>, ModelError> {
            match f.get(&key(s)) {
                Some(_) => req(s).map(Some),
                None => Ok(None),
            }
        };
        // An optional float key; present but not a number, or not finite, is an error.
        let opt_f32 = |s: &str| -> Result<Option<f32>, ModelError> {
            let k = key(s);
            match f.get(&k) {
                None => Ok(None),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() => Ok(Some(x as f32)),
                    _ => Err(ModelError::BadKey {
                        key: k,
                        what: "not a finite number".into(),
                    }),
                },
            }
        };
        let n_embd = req("embedding_length")?;
        let n_layer = req("block_count")?;
        let n_head = req("attention.head_count")?;
        let n_head_kv = opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
        let n_ff = req("feed_forward_length")?;
        let n_ctx_train = req("context_length")?;
        let head_dim = opt_usize("attention.key_length")?.unwrap_or(n_embd / n_head);
        if head_dim == 0 {
            return Err(ModelError::BadKey {
                key: key("attention.head_count"),
                what: format!("{n_head} heads leave no head dimension of n_embd {n_embd}"),
            });
        }
        if let Some(v) = opt_usize("attention.value_length")?
            && v != head_dim
        {
            return Err(ModelError::BadKey {
                key: key("attention.value_length"),
                what: format!("{v} differs from the key length {head_dim} (not supported)"),
            });
        }
        if n_head % n_head_kv != 0 {
            return Err(ModelError::BadKey {
                key: key("attention.head_count_kv"),
                what: format!("{n_head} query heads are not a multiple of {n_head_kv} kv heads"),
            });
        }
        let n_rot = opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::BadKey {
                key: key("rope.dimension_count"),
                what: format!("{n_rot} is not an even number ≤ head_dim {head_dim}"),
            });
        }
        let rms_eps = opt_f32("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| ModelError::MissingKey(key("attention.layer_norm_rms_epsilon")))?;
        let rope_theta = opt_f32("rope.freq_base")?.unwrap_or(10000.0);
        // llama.cpp: the scaling type defaults to "linear"; the factor (`rope.scaling.factor`,
        // else the old `rope.scale_linear`) gives freq_scale = 1/factor; type "none" forces 1.
        // "longrope" (phi3) scales through its factor tensors, not freq_scale.
        let factor = match opt_f32("rope.scaling.factor")? {
            Some(x) => Some(x),
            None => opt_f32("rope.scale_linear")?,
        };
        let rope_freq_scale = match f.get_str(&key("rope.scaling.type")) {
            Some("none") => 1.0,
            None | Some("linear") | Some("longrope") => match factor {
                Some(x) if x > 0.0 => 1.0 / x,
                _ => 1.0,
            },
            Some(other) => {
                return Err(ModelError::BadKey {
                    key: key("rope.scaling.type"),
                    what: format!(
                        "RoPE scaling '{other}' is not supported yet (linear and longrope are)"
                    ),
                });
            }
        };
        let rope_attn_factor = opt_f32("rope.scaling.attn_factor")?.unwrap_or(1.0);
        let n_ctx_orig = opt_usize("rope.scaling.original_context_length")?.unwrap_or(n_ctx_train);
        let embd = f
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let n_vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let spec = arch.spec();
        let has_qkv_bias = match spec.qkv_bias {
            Bias::Required => true,
            Bias::Optional => f.tensor("blk.0.attn_q.bias").is_some(),
            Bias::Refused => false,
        };
        let kq_scale = spec.kq_scale.value(n_layer, n_embd, n_head, head_dim);
        // Sliding window and its layer period (`attention.sliding_window_pattern` when present);
        // an architecture without one reads no window (phi3's is read and dropped by llama.cpp).
        let (n_swa, swa_period) = match spec.sliding_window {
            None => (0, 0),
            Some(sw) => {
                let n = match sw.window {
                    Window::Default(d) => opt_usize("attention.sliding_window")?.unwrap_or(d),
                    Window::WhenSet => match f.get(&key("attention.sliding_window")) {
                        Some(v) if v.as_u64() == Some(0) => 0,
                        Some(_) => req("attention.sliding_window")?,
                        None => 0,
                    },
                };
                (n, sw.period)
            }
        };
        let swa_layers = if n_swa == 0 {
            vec![false; n_layer]
        } else {
            swa_pattern(
                f,
                &key("attention.sliding_window_pattern"),
                n_layer,
                swa_period,
            )?
        };
        let (rope_theta_swa, rope_freq_scale_swa) = match spec.sliding_window {
            None => (rope_theta, rope_freq_scale),
            Some(sw) => (
                opt_f32("rope.freq_base_swa")?.unwrap_or(sw.rope_base.unwrap_or(rope_theta)),
                if sw.rope_scaled { rope_freq_scale } else { 1.0 },
            ),
        };
        let softcap = |rule: SoftCap, k: &str| -> Result<Option<f32>, ModelError> {
            Ok(match rule {
                SoftCap::None => None,
                SoftCap::Default(d) => Some(opt_f32(k)?.unwrap_or(d)),
                SoftCap::WhenSet => opt_f32(k)?.filter(|&c| c != 0.0),
            })
        };
        let attn_softcap = softcap(spec.attn_softcap, "attn_logit_softcapping")?;
        let final_softcap = softcap(spec.final_softcap, "final_logit_softcapping")?;
        for (k, cap) in [
            ("attn_logit_softcapping", attn_softcap),
            ("final_logit_softcapping", final_softcap),
        ] {
            if cap.is_some_and(|c| c <= 0.0) {
                return Err(ModelError::BadKey {
                    key: key(k),
                    what: "a soft-cap must be positive".into(),
                });
            }
        }
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
            output_norm_eps: None,
            rope_type: spec.rope_type,
            rope_theta,
            n_rot,
            rope_freq_scale,
            tied_embeddings: match spec.output {
                Output::TokenEmbd => true,
                Output::OutputElseTokenEmbd => f.tensor("output.weight").is_none(),
            },
            has_qkv_bias,
            activation: spec.activation,
            embd_scale: spec.embd_scale.value(n_embd),
            kq_scale,
            attn_softcap,
            final_softcap,
            n_swa,
            swa_layers,
            rope_theta_swa,
            rope_freq_scale_swa,
            rope_attn_factor,
            n_ctx_orig,
        })
    }

    pub fn n_embd_q(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn n_embd_kv(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

/// Which layers slide, as `llama_model_base::load_swa_pattern` reads it: a per-layer array
/// (bool or integer) when the key holds one, else a scalar period (default `period`), expanded
/// by `llama_hparams::set_swa_pattern`: layer `il` slides iff `il % period < period - 1`
/// (period 0: every layer slides).
fn swa_pattern(
    f: &GgufFile,
    k: &str,
    n_layer: usize,
    period: usize,
) -> Result<Vec<bool>, ModelError> {
    let bad = |what: String| ModelError::BadKey {
        key: k.to_string(),
        what,
    };
    if let Some(items) = f.get_array(k) {
        if items.len() < n_layer {
            return Err(bad(format!("{} entries for {n_layer} layers", items.len())));
        }
        return items[..n_layer]
            .iter()
            .map(|v| {
                v.as_bool()
                    .or_else(|| v.as_u64().map(|n| n != 0))
                    .ok_or_else(|| bad("not an array of booleans or integers".into()))
            })
            .collect();
    }
    let period = match f.get(k) {
        None => period,
        Some(v) => v
            .as_u64()
            .filter(|&n| n <= 1 << 24)
            .ok_or_else(|| bad("not a layer period".into()))? as usize,
    };
    Ok((0..n_layer)
        .map(|il| period == 0 || il % period < period - 1)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::swa_pattern;
    use crate::gguf::{GgufFile, GgufWriter, Value};

    fn pattern(key: Option<Value>, n_layer: usize, period: usize) -> Vec<bool> {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String("gemma3".into()));
        if let Some(v) = key {
            w.set("gemma3.attention.sliding_window_pattern", v);
        }
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        swa_pattern(
            &f,
            "gemma3.attention.sliding_window_pattern",
            n_layer,
            period,
        )
        .unwrap()
    }

    #[test]
    fn swa_period_as_set_swa_pattern_expands_it() {
        // no key: the architecture's default (gemma2 2, gemma3 6)
        assert_eq!(pattern(None, 4, 2), [true, false, true, false]);
        assert_eq!(
            pattern(None, 7, 6),
            [true, true, true, true, true, false, true]
        );
        // period 1: no layer slides; period 0: every layer does
        assert_eq!(pattern(Some(Value::U32(1)), 3, 6), [false; 3]);
        assert_eq!(pattern(Some(Value::U32(0)), 3, 6), [true; 3]);
        assert_eq!(
            pattern(Some(Value::U32(3)), 4, 6),
            [true, true, false, true]
        );
    }
}
