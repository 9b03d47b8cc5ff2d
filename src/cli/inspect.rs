//! `parity inspect` and `parity fixture`.

use super::{Result, err};
use crate::gguf::{GgmlType, GgufFile, Value};
use crate::model::Config;
use crate::model::fixture::{FixtureSpec, build};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct InspectArgs {
    /// GGUF file.
    model: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Also list every metadata key.
    #[arg(long)]
    metadata: bool,
}

fn json_value(v: &Value) -> serde_json::Value {
    match v {
        Value::Array(ty, items) if items.len() > 16 => {
            serde_json::json!({ "array": format!("{ty:?}").to_lowercase(), "len": items.len() })
        }
        other => serde_json::to_value(other).unwrap_or(serde_json::Value::Null),
    }
}

pub fn inspect(a: InspectArgs) -> Result<ExitCode> {
    let f = GgufFile::open(&a.model)?;
    let config = Config::from_gguf(&f);
    let tok_model = f.get_str("tokenizer.ggml.model");
    let n_tokens = f.get_array("tokenizer.ggml.tokens").map(|t| t.len());
    let total_bytes: u64 = f.tensors.iter().map(|t| t.n_bytes).sum();
    let mut by_type: std::collections::BTreeMap<GgmlType, usize> = Default::default();
    for t in &f.tensors {
        *by_type.entry(t.ty).or_default() += 1;
    }

    if a.json {
        let j = serde_json::json!({
            "path": a.model.display().to_string(),
            "file_bytes": f.bytes().len(),
            "gguf_version": f.version,
            "alignment": f.alignment,
            "architecture": f.architecture(),
            "config": config.as_ref().ok(),
            "config_error": config.as_ref().err().map(|e| e.to_string()),
            "tokenizer": {
                "model": tok_model,
                "pre": f.get_str("tokenizer.ggml.pre"),
                "tokens": n_tokens,
                "bos_token_id": f.get_u64("tokenizer.ggml.bos_token_id"),
                "eos_token_id": f.get_u64("tokenizer.ggml.eos_token_id"),
                "add_bos_token": f.get_bool("tokenizer.ggml.add_bos_token"),
            },
            "metadata": f.metadata.iter().map(|(k, v)| (k.clone(), json_value(v))).collect::<serde_json::Map<_, _>>(),
            "tensors": f.tensors.iter().map(|t| serde_json::json!({
                "name": t.name, "type": t.ty.name(), "shape": t.shape(), "ne": t.dims,
                "offset": t.offset, "bytes": t.n_bytes,
            })).collect::<Vec<_>>(),
            "tensor_bytes": total_bytes,
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(ExitCode::SUCCESS);
    }

    println!(
        "{}: GGUF v{}, {} bytes, {} metadata keys, {} tensors, alignment {}",
        a.model.display(),
        f.version,
        f.bytes().len(),
        f.metadata.len(),
        f.tensors.len(),
        f.alignment
    );
    println!("architecture: {}", f.architecture().unwrap_or("(none)"));
    if let Some(name) = f.get_str("general.name") {
        println!("name: {name}");
    }
    match &config {
        Ok(c) => {
            println!(
                "hyperparameters: n_vocab {} n_embd {} n_layer {} n_head {} n_head_kv {} head_dim {} n_ff {} n_ctx_train {}",
                c.n_vocab,
                c.n_embd,
                c.n_layer,
                c.n_head,
                c.n_head_kv,
                c.head_dim,
                c.n_ff,
                c.n_ctx_train
            );
            println!(
                "  rms_eps {:e} rope {:?} theta {} n_rot {} freq_scale {} tied_embeddings {} qkv_bias {}",
                c.rms_eps,
                c.rope_type,
                c.rope_theta,
                c.n_rot,
                c.rope_freq_scale,
                c.tied_embeddings,
                c.has_qkv_bias
            );
        }
        Err(e) if !f.tensors.is_empty() => println!("hyperparameters: not a runnable model: {e}"),
        Err(_) => println!("hyperparameters: none (vocab-only file)"),
    }
    match tok_model {
        Some(m) => println!(
            "tokenizer: {m}{} with {} tokens, bos {:?} eos {:?} add_bos {:?}",
            f.get_str("tokenizer.ggml.pre")
                .map(|p| format!(" (pre {p})"))
                .unwrap_or_default(),
            n_tokens.unwrap_or(0),
            f.get_u64("tokenizer.ggml.bos_token_id"),
            f.get_u64("tokenizer.ggml.eos_token_id"),
            f.get_bool("tokenizer.ggml.add_bos_token"),
        ),
        None => println!("tokenizer: none"),
    }
    if a.metadata {
        println!("metadata:");
        for (k, v) in &f.metadata {
            println!("  {k} = {}", v.summary());
        }
    }
    let types: Vec<String> = by_type.iter().map(|(t, n)| format!("{n} {t}")).collect();
    println!(
        "tensors: {} ({} bytes of data)",
        types.join(", "),
        total_bytes
    );
    if !f.tensors.is_empty() {
        let w = f
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        println!(
            "  {:<w$}  {:<6}  {:>20}  {:>12}",
            "name", "type", "shape", "bytes"
        );
        for t in &f.tensors {
            let shape = format!("{:?}", t.shape());
            println!(
                "  {:<w$}  {:<6}  {:>20}  {:>12}",
                t.name,
                t.ty.name(),
                shape,
                t.n_bytes
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct FixtureArgs {
    /// Output GGUF path.
    #[arg(long, short)]
    out: PathBuf,
    /// Architecture: llama or qwen2.
    #[arg(long, default_value = "llama")]
    arch: String,
    /// Weight type of the matmul weights and token embedding (f32, f16, bf16, q8_0, q4_0, q4_k, …),
    /// or q4_k_m: llama-quantize's mix (Q4_K, with Q6_K for output.weight and some attn_v/ffn_down).
    #[arg(long = "type", default_value = "q8_0")]
    weight_type: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 256)]
    n_embd: usize,
    #[arg(long, default_value_t = 512)]
    n_ff: usize,
    #[arg(long, default_value_t = 2)]
    n_layer: usize,
    #[arg(long, default_value_t = 4)]
    n_head: usize,
    #[arg(long, default_value_t = 2)]
    n_head_kv: usize,
    /// Training context length written to the metadata.
    #[arg(long, default_value_t = 256)]
    n_ctx: usize,
    /// Pad the vocabulary with dummy tokens up to this size (default: the built-in ~400).
    #[arg(long)]
    n_vocab: Option<usize>,
    /// No output.weight: the output projection reuses token_embd.weight.
    #[arg(long)]
    tied: bool,
}

pub fn fixture(a: FixtureArgs) -> Result<ExitCode> {
    let q4_k_m = a.weight_type.eq_ignore_ascii_case("q4_k_m");
    let ty = if q4_k_m {
        GgmlType::Q4_K
    } else {
        GgmlType::parse(&a.weight_type)
            .ok_or_else(|| err(format!("unknown weight type '{}'", a.weight_type)))?
    };
    let mut spec = FixtureSpec::new(&a.arch, ty, a.seed);
    spec.q4_k_m = q4_k_m;
    spec.n_embd = a.n_embd;
    spec.n_ff = a.n_ff;
    spec.n_layer = a.n_layer;
    spec.n_head = a.n_head;
    spec.n_head_kv = a.n_head_kv;
    spec.n_ctx = a.n_ctx;
    spec.n_vocab = a.n_vocab;
    spec.tied = a.tied;
    let w = build(&spec).map_err(err)?;
    let bytes = w.to_bytes();
    std::fs::write(&a.out, &bytes).map_err(|e| err(format!("{}: {e}", a.out.display())))?;
    println!(
        "wrote {} ({} bytes, {} {}, seed {})",
        a.out.display(),
        bytes.len(),
        spec.arch,
        ty,
        spec.seed
    );
    Ok(ExitCode::SUCCESS)
}
