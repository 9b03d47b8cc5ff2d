//! The model: architecture and hyperparameters from GGUF metadata, weight views, tokenizer.
//! Knows gguf and quant; knows nothing of backends.

mod config;
pub mod fixture;
pub use crate::tokenizer;

pub use crate::arch::spec::{Activation, Arch, RopeType};
pub use config::{Config, ModelError};

use crate::arch::spec::Bias;
use crate::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
use crate::quant;
use sha2::Digest;
use std::path::Path;
use std::sync::OnceLock;

/// One layer's weights: index entries into the mapped file (no data is copied).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: TensorInfo,
    pub wq: TensorInfo,
    pub wk: TensorInfo,
    pub wv: TensorInfo,
    pub bq: Option<TensorInfo>,
    pub bk: Option<TensorInfo>,
    pub bv: Option<TensorInfo>,
    pub wo: TensorInfo,
    pub ffn_norm: TensorInfo,
    pub w_gate: TensorInfo,
    pub w_up: TensorInfo,
    pub w_down: TensorInfo,
    /// Per-head RMSNorm of q and k before RoPE (qwen3, gemma3), `[head_dim]`.
    pub q_norm: Option<TensorInfo>,
    pub k_norm: Option<TensorInfo>,
    /// RMSNorm of the attention / FFN output before its residual add (gemma2, gemma3).
    pub attn_post_norm: Option<TensorInfo>,
    pub ffn_post_norm: Option<TensorInfo>,
    /// RoPE frequency factors (llama3 `rope_freqs.weight`, phi3's long or short factors),
    /// `[n_rot / 2]`: dimension pair i turns at `theta_i / factor_i`. For phi3 this is the
    /// short factors: what llama.cpp uses while its context is at most `Config::n_ctx_orig`.
    pub rope_freqs: Option<TensorInfo>,
    /// phi3's long factors (`rope_factors_long.weight`), which llama.cpp uses instead of
    /// `rope_freqs` when its context (n_ctx per sequence) exceeds `Config::n_ctx_orig`.
    pub rope_freqs_long: Option<TensorInfo>,
}

impl LayerWeights {
    /// The RoPE factors llama.cpp picks for a context of `n_ctx` tokens per sequence
    /// (`llama_model::get_rope_factors`).
    pub fn rope_factors(&self, n_ctx: usize, c: &Config) -> Option<&TensorInfo> {
        match &self.rope_freqs_long {
            Some(long) if n_ctx > c.n_ctx_orig => Some(long),
            _ => self.rope_freqs.as_ref(),
        }
    }
}

/// Rows `first..first + rows` of a 2-d tensor as a tensor of its own (no data copied): same
/// type, `[width, rows]`, offset moved by whole rows. Named `NAME[part]`.
pub fn row_view(
    t: &TensorInfo,
    part: &str,
    first: usize,
    rows: usize,
) -> Result<TensorInfo, ModelError> {
    let (w, n_rows) = t.rows();
    let bad = || ModelError::BadShape {
        name: format!("{}[{part}]", t.name),
        expected: vec![w as u64, (first + rows) as u64],
        found: t.dims.clone(),
    };
    if t.dims.len() != 2 || first + rows > n_rows {
        return Err(bad());
    }
    let row_bytes = t.ty.bytes_for(w as u64).ok_or_else(bad)?;
    Ok(TensorInfo {
        name: format!("{}[{part}]", t.name),
        dims: vec![w as u64, rows as u64],
        ty: t.ty,
        offset: t.offset + first as u64 * row_bytes,
        n_elements: (w * rows) as u64,
        n_bytes: rows as u64 * row_bytes,
    })
}

pub struct Model {
    pub file: GgufFile,
    pub config: Config,
    pub token_embd: TensorInfo,
    pub layers: Vec<LayerWeights>,
    pub output_norm: TensorInfo,
    /// `output.weight`, or `token_embd.weight` when the embeddings are tied.
    pub output: TensorInfo,
    sha256: OnceLock<String>,
    /// Release each layer's weights as a forward leaves it (`release_layer`): on by default for
    /// a file larger than half of this machine's memory, where keeping every page mapped would
    /// push out everything else; off below, where mapping the pages again costs time (about
    /// 30 % of a 7B check here) and saves nothing.
    release_layers: bool,
}

/// Whether `len` bytes exceed half of the memory this process may use: the machine's
/// (`MemTotal`), or its cgroup's limit where lower (a container's); false where
/// neither is known.
fn larger_than_half_of_memory(len: u64) -> bool {
    // cgroup v2, then v1 ("max" or a huge number: no limit).
    let limit = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok());
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let kib: u64 = s
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    });
    let usable = match (total, limit) {
        (Some(t), Some(l)) => Some(t.min(l)),
        (t, l) => t.or(l),
    };
    usable.is_some_and(|t| len > t / 2)
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}: is a directory, not a GGUF file")]
    Directory(String),
    /// A file that is no model parity (or llama.cpp) runs, named.
    #[error("{path}: {source}")]
    Refused { path: String, source: ModelError },
    /// A malformed file, named (the reader's own messages say what, not which file).
    #[error("{path}: {source}")]
    Malformed { path: String, source: GgufError },
}

/// Open a GGUF file as every command should: a folder refused by name, a malformed file's
/// error naming the file.
pub fn open_gguf(path: &Path) -> Result<GgufFile, OpenError> {
    check_model_path(path)?;
    GgufFile::open(path).map_err(|e| match e {
        e @ GgufError::Io { .. } => OpenError::Gguf(e),
        source => OpenError::Malformed {
            path: path.display().to_string(),
            source,
        },
    })
}

/// Refuse what cannot be a model file before mapping it (mmap of a folder fails with the
/// cryptic "No such device").
pub fn check_model_path(path: &Path) -> Result<(), OpenError> {
    if path.is_dir() {
        return Err(OpenError::Directory(path.display().to_string()));
    }
    Ok(())
}

impl Model {
    pub fn open(path: impl AsRef<Path>) -> Result<Model, OpenError> {
        let file = open_gguf(path.as_ref())?;
        Self::from_gguf(file).map_err(|source| OpenError::Refused {
            path: path.as_ref().display().to_string(),
            source,
        })
    }

    pub fn from_gguf(file: GgufFile) -> Result<Model, ModelError> {
        let file_len = file.bytes().len() as u64;
        if file.tensors.is_empty() {
            return Err(ModelError::VocabOnly);
        }
        let c = Config::from_gguf(&file)?;
        // What llama.cpp refuses, refused before anything is sized by the metadata.
        check_layers(&file, c.n_layer)?;
        check_vocab(&file, c.n_vocab)?;
        // Which optional and fused tensors the architecture has: its spec (src/arch/<name>.rs).
        let spec = c.arch.spec();
        let get = |name: &str, dims: &[usize]| -> Result<TensorInfo, ModelError> {
            let t = file
                .tensor(name)
                .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
            let expected: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
            // 1-d norms/biases may be stored as [n] ; matrices as [n_in, n_out].
            if t.dims != expected {
                return Err(ModelError::BadShape {
                    name: name.to_string(),
                    expected,
                    found: t.dims.clone(),
                });
            }
            Ok(t.clone())
        };
        let opt = |name: &str, dims: &[usize]| -> Result<Option<TensorInfo>, ModelError> {
            match file.tensor(name) {
                None => Ok(None),
                Some(_) => get(name, dims).map(Some),
            }
        };
        let (e, q, kv, ff) = (c.n_embd, c.n_embd_q(), c.n_embd_kv(), c.n_ff);
        let (hd, half_rot) = (c.head_dim, c.n_rot / 2);
        let token_embd = get("token_embd.weight", &[e, c.n_vocab])?;
        // Global RoPE factor tensors (llama.cpp duplicates them into every layer).
        let rope_freqs = opt("rope_freqs.weight", &[half_rot])?;
        let (rope_long, rope_short) = if spec.rope_factors_long_short {
            (
                opt("rope_factors_long.weight", &[half_rot])?,
                opt("rope_factors_short.weight", &[half_rot])?,
            )
        } else {
            (None, None)
        };
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            // q|k|v as one matrix and gate|up as one (phi3): zero-copy row views.
            let (wq, wk, wv) = match file.tensor(&n("attn_qkv.weight")) {
                Some(_) if spec.fused_qkv => {
                    let fused = get(&n("attn_qkv.weight"), &[e, q + 2 * kv])?;
                    (
                        row_view(&fused, "q", 0, q)?,
                        row_view(&fused, "k", q, kv)?,
                        row_view(&fused, "v", q + kv, kv)?,
                    )
                }
                _ => (
                    get(&n("attn_q.weight"), &[e, q])?,
                    get(&n("attn_k.weight"), &[e, kv])?,
                    get(&n("attn_v.weight"), &[e, kv])?,
                ),
            };
            let (w_gate, w_up) = if spec.fused_gate_up {
                // ggml_swiglu on the fused output: silu(first half) * second half.
                let fused = get(&n("ffn_up.weight"), &[e, 2 * ff])?;
                (
                    row_view(&fused, "gate", 0, ff)?,
                    row_view(&fused, "up", ff, ff)?,
                )
            } else {
                (
                    get(&n("ffn_gate.weight"), &[e, ff])?,
                    get(&n("ffn_up.weight"), &[e, ff])?,
                )
            };
            let (q_norm, k_norm) = if spec.qk_norm {
                (
                    Some(get(&n("attn_q_norm.weight"), &[hd])?),
                    Some(get(&n("attn_k_norm.weight"), &[hd])?),
                )
            } else {
                (None, None)
            };
            let (attn_post_norm, ffn_post_norm) = if spec.post_norms {
                (
                    Some(get(&n("post_attention_norm.weight"), &[e])?),
                    Some(get(&n("post_ffw_norm.weight"), &[e])?),
                )
            } else {
                (None, None)
            };
            layers.push(LayerWeights {
                attn_norm: get(&n("attn_norm.weight"), &[e])?,
                wq,
                wk,
                wv,
                bq: opt(&n("attn_q.bias"), &[q])?,
                bk: opt(&n("attn_k.bias"), &[kv])?,
                bv: opt(&n("attn_v.bias"), &[kv])?,
                wo: get(&n("attn_output.weight"), &[q, e])?,
                ffn_norm: get(&n("ffn_norm.weight"), &[e])?,
                w_gate,
                w_up,
                w_down: get(&n("ffn_down.weight"), &[ff, e])?,
                q_norm,
                k_norm,
                attn_post_norm,
                ffn_post_norm,
                // llama.cpp's get_rope_factors: rope_freqs if present, else phi3's long factors
                // when the context exceeds n_ctx_orig, else the short ones.
                rope_freqs: rope_freqs.clone().or_else(|| rope_short.clone()),
                rope_freqs_long: if rope_freqs.is_some() {
                    None
                } else {
                    rope_long.clone()
                },
            });
        }
        if spec.qkv_bias == Bias::Required && layers.iter().any(|l| l.bq.is_none()) {
            return Err(ModelError::MissingTensor(format!(
                "blk.N.attn_q.bias ({})",
                spec.name
            )));
        }
        if !c.has_qkv_bias && layers.iter().any(|l| l.bq.is_some()) {
            return Err(ModelError::BadShape {
                name: "blk.N.attn_q.bias".into(),
                expected: vec![],
                found: vec![q as u64],
            });
        }
        let output_norm = get("output_norm.weight", &[e])?;
        let output = if c.tied_embeddings {
            token_embd.clone()
        } else {
            get("output.weight", &[e, c.n_vocab])?
        };
        // Norm weights, biases and RoPE factors are ggml_mul / ggml_add / rope operands: ggml's
        // CPU ops take them as f32 only (llama.cpp aborts in binary_op on a q8_0 norm).
        let vectors = layers
            .iter()
            .flat_map(|l| {
                [
                    Some(&l.attn_norm),
                    Some(&l.ffn_norm),
                    l.bq.as_ref(),
                    l.bk.as_ref(),
                    l.bv.as_ref(),
                    l.q_norm.as_ref(),
                    l.k_norm.as_ref(),
                    l.attn_post_norm.as_ref(),
                    l.ffn_post_norm.as_ref(),
                    l.rope_freqs.as_ref(),
                    l.rope_freqs_long.as_ref(),
                ]
            })
            .chain([Some(&output_norm)])
            .flatten();
        for t in vectors {
            if t.ty != GgmlType::F32 {
                return Err(ModelError::BadType {
                    name: t.name.clone(),
                    ty: t.ty.to_string(),
                    why: "a norm weight, bias or RoPE factor must be f32 (ggml's CPU ops refuse any other type for it; llama.cpp aborts)".into(),
                });
            }
        }
        Ok(Model {
            file,
            config: c,
            token_embd,
            layers,
            output_norm,
            output,
            sha256: OnceLock::new(),
            release_layers: larger_than_half_of_memory(file_len),
        })
    }

    /// Raw bytes of a tensor (borrowed from the mapping).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        self.file.tensor_data(t)
    }

    /// Release each layer as forwards leave it, whatever the file's size (tests; a caller
    /// that knows memory is short).
    pub fn set_release_layers(&mut self, on: bool) {
        self.release_layers = on;
    }

    /// Dequantize row `r` of a 2-d tensor into `out` (`out.len()` = row width).
    pub fn row(&self, t: &TensorInfo, r: usize, out: &mut [f32]) {
        let (w, _) = t.rows();
        let rb = t.ty.bytes_for(w as u64).unwrap() as usize;
        let bytes = &self.data(t)[r * rb..(r + 1) * rb];
        quant::dequantize_row(t.ty, bytes, out).expect("row length validated at open");
    }

    /// Release layer `l`'s weights from memory (`GgufFile::release`) where `release_layers`
    /// says so: called as a forward leaves the layer.
    pub fn release_layer(&self, l: usize) {
        let Some(w) = self.layers.get(l).filter(|_| self.release_layers) else {
            return;
        };
        for t in [&w.wq, &w.wk, &w.wv, &w.wo, &w.w_gate, &w.w_up, &w.w_down] {
            self.file.release(t);
        }
    }

    /// A whole 1-d tensor (norm weights, biases) as f32.
    pub fn vector(&self, t: &TensorInfo) -> Vec<f32> {
        let mut v = vec![0.0; t.n_elements as usize];
        quant::dequantize_row(t.ty, self.data(t), &mut v).expect("validated at open");
        v
    }

    /// Weight type of the bulk of the matmul weights (for tolerance selection).
    pub fn main_weight_type(&self) -> GgmlType {
        self.layers
            .first()
            .map(|l| l.wq.ty)
            .unwrap_or(self.token_embd.ty)
    }

    /// Whether [`Model::sha256`] has been computed already.
    pub fn sha256_known(&self) -> bool {
        self.sha256.get().is_some()
    }

    /// Whether each layer's weights leave memory as a forward leaves the layer (a file larger
    /// than half of memory).
    pub fn releases_layers(&self) -> bool {
        self.release_layers
    }

    /// sha256 of the whole GGUF file, hex (computed once, on first use).
    pub fn sha256(&self) -> &str {
        self.sha256.get_or_init(|| {
            if !self.release_layers {
                return sha256_hex(self.file.bytes());
            }
            // A file larger than half of memory: hashed a slice at a time, each released after.
            use sha2::Digest;
            let (bytes, mut h) = (self.file.bytes(), sha2::Sha256::new());
            for (i, chunk) in bytes.chunks(64 << 20).enumerate() {
                h.update(chunk);
                self.file
                    .release_range(i * (64 << 20), i * (64 << 20) + chunk.len());
            }
            h.finalize().iter().map(|b| format!("{b:02x}")).collect()
        })
    }
}

/// llama.cpp loads exactly the tensors of `block_count` layers and refuses a file holding more
/// ("wrong number of tensors"): a `blk.N.*` tensor with N at or past it is refused, and so is a
/// count whose last layer has no tensors, before any per-layer allocation.
fn check_layers(f: &GgufFile, n_layer: usize) -> Result<(), ModelError> {
    let mut seen = 0usize;
    for t in &f.tensors {
        let Some(n) = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(n, _)| n.parse::<usize>().ok())
        else {
            continue;
        };
        if n >= n_layer {
            return Err(ModelError::BadKey {
                key: format!("{}.block_count", f.architecture().unwrap_or("?")),
                what: format!(
                    "{n_layer} layers, but the file holds tensor '{}' of layer {n} (llama.cpp refuses: wrong number of tensors)",
                    t.name
                ),
            });
        }
        seen = seen.max(n + 1);
    }
    if seen < n_layer {
        return Err(ModelError::BadKey {
            key: format!("{}.block_count", f.architecture().unwrap_or("?")),
            what: format!(
                "{n_layer} layers, but the file holds tensors for {seen} (no blk.{seen}.* tensors)"
            ),
        });
    }
    Ok(())
}

/// llama.cpp sizes token_embd (and output) by the vocabulary: a vocabulary of another size than
/// the embedding's rows is refused ("tensor 'token_embd.weight' has wrong shape").
fn check_vocab(f: &GgufFile, n_vocab: usize) -> Result<(), ModelError> {
    let Some(tokens) = f.get_array("tokenizer.ggml.tokens") else {
        return Ok(());
    };
    if tokens.len() != n_vocab {
        return Err(ModelError::VocabSize {
            tokens: tokens.len(),
            rows: n_vocab,
        });
    }
    Ok(())
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = sha2::Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layers are released for a file larger than half of the usable memory only: never for a
    /// megabyte, always for more bytes than any machine has (where memory is known at all).
    #[test]
    #[cfg(target_os = "linux")]
    fn layers_are_released_only_for_files_near_memory_size() {
        assert!(!larger_than_half_of_memory(1 << 20));
        assert!(larger_than_half_of_memory(u64::MAX / 2));
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama-q8_0.gguf");
        assert!(!Model::open(&path).unwrap().release_layers);
    }
}
