//! `parity inspect` and `parity fixture`.

use super::{Result, err};
use crate::gguf::{GgmlType, GgufFile, Value};
use crate::model::Config;
use crate::model::fixture::{FixtureSpec, build};
use crate::report::shown::{line, shown};
use clap::Args;
use std::fmt::Write as _;
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

#[derive(Args)]
pub struct GpuArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// `parity gpu`: the adapter and what the kernels use of it; no adapter is one line, exit 2.
pub fn gpu(a: GpuArgs) -> Result<ExitCode> {
    let cx = crate::backend::gpu::context::Context::new().map_err(err)?;
    let i = &cx.info;
    let reduce = if i.subgroups {
        "subgroup ops"
    } else {
        "shared memory"
    };
    if a.json {
        let v = serde_json::json!({
            "adapter": i.adapter, "driver": i.driver, "driver_info": i.driver_info,
            "api": i.api, "device_type": i.device_type,
            "max_storage_binding_bytes": i.max_binding, "max_buffer_bytes": i.max_buffer,
            "workgroup_storage_bytes": i.workgroup_storage,
            "max_invocations_per_workgroup": i.max_invocations,
            "workgroup_size": crate::backend::gpu::context::WG,
            "subgroup_size": [i.subgroup.0, i.subgroup.1], "reductions": reduce, "f16": i.f16,
            "driver_stderr": i.driver_log,
        });
        println!(
            "{}",
            crate::report::shown::json(serde_json::to_string_pretty(&v)?)
        );
        return Ok(ExitCode::SUCCESS);
    }
    // Driver strings come from the driver: escaped like a file's.
    let sh = |s: &str| crate::report::shown::shown(s).into_owned();
    println!("adapter: {} ({})", sh(&i.adapter), sh(&i.device_type));
    println!("driver: {} {}", sh(&i.driver), sh(&i.driver_info));
    println!("api: {}", sh(&i.api));
    println!(
        "limits used: max storage binding {} bytes, max buffer {} bytes, workgroup storage {} bytes, {} invocations per workgroup (kernels use {})",
        i.max_binding,
        i.max_buffer,
        i.workgroup_storage,
        i.max_invocations,
        crate::backend::gpu::context::WG
    );
    println!(
        "subgroup size: {}..{} (reductions: {reduce})",
        i.subgroup.0, i.subgroup.1
    );
    println!("f16: {}", if i.f16 { "yes" } else { "no" });
    if i.device_type == "Cpu" {
        println!(
            "note: this adapter runs on the CPU; `parity check` leaves it out unless --backends names gpu"
        );
    }
    // The driver's own lines, kept off stderr while the device opened (Mesa's XDG_RUNTIME_DIR
    // complaint is not parity's error).
    for l in i.driver_log.lines() {
        println!("driver stderr: {}", sh(l));
    }
    Ok(ExitCode::SUCCESS)
}

fn json_value(v: &Value) -> serde_json::Value {
    match v {
        Value::Array(ty, items) if items.len() > 16 => {
            serde_json::json!({ "array": ty.name(), "len": items.len() })
        }
        other => serde_json::to_value(other).unwrap_or(serde_json::Value::Null),
    }
}

/// An enum's name as its JSON spells it (`norm`, `neox`, `silu`, `gelu-tanh`): the same words
/// in the text and in `--json`.
fn serde_name(v: &impl serde::Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

pub fn inspect(a: InspectArgs) -> Result<ExitCode> {
    let f = crate::model::open_gguf(&a.model)?;
    // Everything goes to a String first, then to stdout in one write whose error (a full disk,
    // a closed file) is reported like any other.
    let mut o = String::new();
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
        writeln!(
            o,
            "{}",
            crate::report::shown::json(serde_json::to_string_pretty(&j)?)
        )?;
        return emit(&o);
    }

    writeln!(
        o,
        "{}: GGUF v{}, {} bytes, {} metadata keys, {} tensors, alignment {}",
        line(&a.model.display().to_string()),
        f.version,
        f.bytes().len(),
        f.metadata.len(),
        f.tensors.len(),
        f.alignment
    )?;
    // Every string below is the file's own: shown escaped and capped (`report::shown`).
    writeln!(
        o,
        "architecture: {}",
        f.architecture().map_or("(none)".into(), shown)
    )?;
    if let Some(name) = f.get_str("general.name") {
        writeln!(o, "name: {}", shown(name))?;
    }
    match &config {
        Ok(c) => {
            writeln!(
                o,
                "hyperparameters: n_vocab {} n_embd {} n_layer {} n_head {} n_head_kv {} head_dim {} n_ff {} n_ctx_train {}",
                c.n_vocab,
                c.n_embd,
                c.n_layer,
                c.n_head,
                c.n_head_kv,
                c.head_dim,
                c.n_ff,
                c.n_ctx_train
            )?;
            writeln!(
                o,
                "  rms_eps {:e} rope {} theta {} n_rot {} freq_scale {} tied_embeddings {} qkv_bias {}",
                c.rms_eps,
                serde_name(&c.rope_type),
                c.rope_theta,
                c.n_rot,
                c.rope_freq_scale,
                c.tied_embeddings,
                c.has_qkv_bias
            )?;
            // The architecture's own data (what its forward reads besides the shapes).
            let mut extra = vec![
                format!("activation {}", serde_name(&c.activation)),
                format!("kq_scale {}", c.kq_scale),
            ];
            if let Some(s) = c.embd_scale {
                extra.push(format!("embd_scale {s}"));
            }
            if let Some(cap) = c.attn_softcap {
                extra.push(format!("attn_softcap {cap}"));
            }
            if let Some(cap) = c.final_softcap {
                extra.push(format!("final_softcap {cap}"));
            }
            if c.n_swa > 0 {
                let pattern: String = c
                    .swa_layers
                    .iter()
                    .map(|&s| if s { 'S' } else { 'F' })
                    .collect();
                extra.push(format!(
                    "sliding_window {} layers {pattern} (S slides) swa_theta {} swa_freq_scale {}",
                    c.n_swa, c.rope_theta_swa, c.rope_freq_scale_swa
                ));
            }
            if c.rope_attn_factor != 1.0 {
                extra.push(format!("rope_attn_factor {}", c.rope_attn_factor));
            }
            let names = |n: &str| f.tensor(n).is_some();
            if names("rope_freqs.weight") {
                extra.push("rope_freqs (llama3 frequency factors)".into());
            }
            if names("rope_factors_long.weight") || names("rope_factors_short.weight") {
                extra.push(format!(
                    "rope_factors long+short (long above n_ctx {})",
                    c.n_ctx_orig
                ));
            }
            if names("blk.0.attn_q_norm.weight") {
                extra.push("q/k norms".into());
            }
            if names("blk.0.post_attention_norm.weight") {
                extra.push("post-norms".into());
            }
            if names("blk.0.attn_qkv.weight") {
                extra.push("fused attn_qkv".into());
            }
            writeln!(o, "  {}", extra.join(", "))?;
        }
        Err(e) if !f.tensors.is_empty() => writeln!(
            o,
            "hyperparameters: not a runnable model: {}",
            line(&e.to_string())
        )?,
        Err(_) => writeln!(o, "hyperparameters: none (vocab-only file)")?,
    }
    match tok_model {
        Some(m) => writeln!(
            o,
            "tokenizer: {}{} with {} tokens, bos {} eos {} add_bos {}",
            shown(m),
            f.get_str("tokenizer.ggml.pre")
                .map(|p| format!(" (pre {})", shown(p)))
                .unwrap_or_default(),
            n_tokens.unwrap_or(0),
            or_none(f.get_u64("tokenizer.ggml.bos_token_id")),
            or_none(f.get_u64("tokenizer.ggml.eos_token_id")),
            or_none(f.get_bool("tokenizer.ggml.add_bos_token")),
        )?,
        None => writeln!(o, "tokenizer: none")?,
    }
    if a.metadata {
        writeln!(o, "metadata:")?;
        for (k, v) in &f.metadata {
            // summary() quotes strings with `{:?}`, which escapes them.
            writeln!(o, "  {} = {}", shown(k), v.summary())?;
        }
    }
    let types: Vec<String> = by_type.iter().map(|(t, n)| format!("{n} {t}")).collect();
    writeln!(
        o,
        "tensors: {} ({} bytes of data)",
        types.join(", "),
        total_bytes
    )?;
    if !f.tensors.is_empty() {
        let w = f
            .tensors
            .iter()
            .map(|t| shown(&t.name).chars().count())
            .max()
            .unwrap_or(4)
            .max(4);
        writeln!(
            o,
            "  {:<w$}  {:<6}  {:>20}  {:>12}",
            "name", "type", "shape", "bytes"
        )?;
        for t in &f.tensors {
            let shape = format!("{:?}", t.shape());
            writeln!(
                o,
                "  {:<w$}  {:<6}  {:>20}  {:>12}",
                shown(&t.name),
                t.ty.name(),
                shape,
                t.n_bytes
            )?;
        }
    }
    emit(&o)
}

/// An optional metadata value as a person reads it: the value, or "unset".
fn or_none<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "unset".to_string(), |v| v.to_string())
}

/// Write `text` to stdout; a failure is an error like any other (exit 2), not a panic.
pub(super) fn emit(text: &str) -> Result<ExitCode> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| err(format!("cannot write to stdout: {e}")))?;
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct FixtureArgs {
    /// Output GGUF path.
    #[arg(long, short)]
    out: PathBuf,
    /// Architecture: llama, llama3 (llama with RoPE frequency factors), qwen2, qwen3, gemma,
    /// gemma2, gemma3 or phi3. Each one's features are on (docs/architectures.md, "Fixtures").
    #[arg(long, default_value = "llama")]
    arch: String,
    /// Weight type of the matmul weights and token embedding (f32, f16, bf16, q8_0, q4_0, q4_k, …),
    /// or q4_k_m: llama-quantize's mix (Q4_K, with Q6_K for output.weight and some attn_v/ffn_down).
    #[arg(long = "type", default_value = "q8_0")]
    weight_type: String,
    /// Seed of the random weights (same seed, same file, byte for byte).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Embedding width (a multiple of the weight type's block size; --n-head times an even
    /// head size).
    #[arg(long, default_value_t = 256)]
    n_embd: usize,
    /// Feed-forward width (a multiple of the weight type's block size).
    #[arg(long, default_value_t = 512)]
    n_ff: usize,
    /// Number of layers. The whole file is limited to 4 GiB of weights.
    #[arg(long, default_value_t = 2)]
    n_layer: usize,
    /// Attention (query) heads.
    #[arg(long, default_value_t = 4)]
    n_head: usize,
    /// Key/value heads (n_head must be a multiple: grouped-query attention).
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
    /// Sliding-window length of gemma2 and gemma3 (shorter than the prompt, so it slides).
    #[arg(long, default_value_t = 4)]
    n_swa: usize,
    /// Linear RoPE scaling: positions divided by this factor (rope.scaling.factor; gemma3's
    /// global layers have 8 of their own). Not for phi3, which scales through its factor
    /// tensors.
    #[arg(long)]
    rope_scale: Option<f32>,
    /// Scale attn_q and attn_k's weights by this factor: attention scores G² times larger.
    /// At 8 a llama fixture's largest scores pass 88, where exp overflows in f32 (an engine
    /// whose softmax does not subtract the row's max gives Inf/Inf there). Not for phi3
    /// (fused QKV) nor qwen3/gemma3 (q/k normed per head, which undoes it).
    #[arg(long, default_value_t = 1.0)]
    qk_gain: f32,
    /// Overwrite OUT if it exists.
    #[arg(long)]
    force: bool,
}

/// Largest fixture written (tensor data): generated deep models for tests stay far below.
const MAX_FIXTURE_BYTES: u64 = 4 << 30;

/// Refuse, before building anything, sizes that are zero, do not fit the GGUF fields, or would
/// make a file over [`MAX_FIXTURE_BYTES`].
fn check_fixture_sizes(a: &FixtureArgs, ty: GgmlType) -> Result<()> {
    for (name, v) in [
        ("--n-embd", a.n_embd),
        ("--n-ff", a.n_ff),
        ("--n-layer", a.n_layer),
        ("--n-head", a.n_head),
        ("--n-head-kv", a.n_head_kv),
        ("--n-ctx", a.n_ctx),
    ] {
        if v == 0 {
            return Err(err(format!("{name} must be at least 1")));
        }
        if v > u32::MAX as usize {
            return Err(err(format!(
                "{name} {v} does not fit in GGUF's 32-bit field"
            )));
        }
    }
    if !a.n_embd.is_multiple_of(a.n_head) || !(a.n_embd / a.n_head).is_multiple_of(2) {
        return Err(err(format!(
            "--n-embd {} must be --n-head {} times an even head size (RoPE rotates pairs)",
            a.n_embd, a.n_head
        )));
    }
    let n_vocab = a.n_vocab.unwrap_or(0).max(512) as u64;
    let (e, ff, l) = (a.n_embd as u64, a.n_ff as u64, a.n_layer as u64);
    let kv = e / a.n_head as u64 * a.n_head_kv as u64;
    let row = |width: u64, rows: u64| -> u64 {
        ty.bytes_for(width)
            .unwrap_or(width.saturating_mul(4))
            .saturating_mul(rows)
    };
    let per_layer = row(e, e)
        .saturating_add(row(e, kv).saturating_mul(2))
        .saturating_add(row(e, e))
        .saturating_add(row(e, ff).saturating_mul(2))
        .saturating_add(row(ff, e));
    let embd = row(e, n_vocab).saturating_mul(if a.tied { 1 } else { 2 });
    let total = per_layer.saturating_mul(l).saturating_add(embd);
    if total > MAX_FIXTURE_BYTES {
        return Err(err(format!(
            "a fixture of --n-embd {} --n-ff {} --n-layer {} in {ty} would hold about {:.1} GiB of weights; the limit is {} GiB",
            a.n_embd,
            a.n_ff,
            a.n_layer,
            total as f64 / (1u64 << 30) as f64,
            MAX_FIXTURE_BYTES >> 30
        )));
    }
    Ok(())
}

pub fn fixture(a: FixtureArgs) -> Result<ExitCode> {
    let q4_k_m = a.weight_type.eq_ignore_ascii_case("q4_k_m");
    let ty = if q4_k_m {
        GgmlType::Q4_K
    } else {
        GgmlType::parse(&a.weight_type)
            .ok_or_else(|| err(format!("unknown weight type '{}'", a.weight_type)))?
    };
    check_fixture_sizes(&a, ty)?;
    if let Some(f) = a.rope_scale {
        if !(f.is_finite() && f > 0.0) {
            return Err(err(format!(
                "--rope-scale {f}: a RoPE scaling factor is a positive number"
            )));
        }
        if a.arch == "phi3" {
            return Err(err(
                "--rope-scale: phi3 scales RoPE through its factor tensors (LongRoPE), not a linear factor".to_string(),
            ));
        }
    }
    if !(a.qk_gain.is_finite() && a.qk_gain > 0.0) {
        return Err(err(format!(
            "--qk-gain {}: a gain is a positive number",
            a.qk_gain
        )));
    }
    if a.qk_gain != 1.0 && matches!(a.arch.as_str(), "phi3" | "qwen3" | "gemma3") {
        return Err(err(format!(
            "--qk-gain: {} {}",
            a.arch,
            if a.arch == "phi3" {
                "fuses q, k and v into one weight"
            } else {
                "norms q and k per head, which undoes a gain"
            }
        )));
    }
    // Only an absent path or (with --force) a regular file is written: a FIFO, a device or a
    // folder is refused, never replaced.
    crate::trace::staging::check_output_file(&a.out, "--out").map_err(err)?;
    // One writer at a time; checked again under the lock (another may have just finished).
    let _lock = crate::trace::staging::lock(&a.out).map_err(|e| {
        err(format!(
            "--out {}: {e}",
            shown(&a.out.display().to_string())
        ))
    })?;
    if !a.force && std::fs::symlink_metadata(&a.out).is_ok() {
        return Err(err(format!(
            "--out {}: exists (pass --force to overwrite)",
            shown(&a.out.display().to_string())
        )));
    }
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
    spec.n_swa = a.n_swa;
    spec.rope_scale = a.rope_scale;
    spec.qk_gain = a.qk_gain;
    let w = build(&spec).map_err(err)?;
    // Read it back as a model before writing: a fixture parity cannot open is refused here.
    let file = GgufFile::from_bytes(w.to_bytes())
        .map_err(|e| err(format!("the fixture would not read back: {e}")))?;
    drop(w);
    let model = crate::model::Model::from_gguf(file)
        .map_err(|e| err(format!("the fixture would not open as a model: {e}")))?;
    let bytes = model.file.bytes();
    write_atomically(&a.out, bytes)?;
    println!(
        "wrote {} ({} bytes, {} {}, seed {})",
        shown(&a.out.display().to_string()),
        bytes.len(),
        spec.arch,
        ty,
        spec.seed
    );
    Ok(ExitCode::SUCCESS)
}

/// Write `bytes` whole or not at all ([`crate::trace::staging::write_whole`]: an interrupt
/// or a full disk leaves no half file, and no `.NAME.partial-PID` either).
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    crate::trace::staging::write_whole(path, bytes).map_err(|e| err(format!("--out {e}")))
}
