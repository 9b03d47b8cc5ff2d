//! `parity tokenize`, `parity generate`, `parity dump`, and the helpers they share with `check`.

use super::{Result, err};
use crate::backend::{self, Backend, Emulation, Fast, Reference};
use crate::gguf::GgufFile;
use crate::model::Model;
use crate::model::tokenizer::Tokenizer;
use crate::trace::{ModelRef, Producer, TapFilter, TraceWriter};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args)]
pub struct TokenizeArgs {
    /// GGUF file (a vocab-only file is enough).
    model: PathBuf,
    /// Do not prepend BOS even if the vocabulary asks for it.
    #[arg(long)]
    no_bos: bool,
    /// Text to tokenize.
    text: String,
}

pub fn tokenize(a: TokenizeArgs) -> Result<ExitCode> {
    let f = GgufFile::open(&a.model)?;
    let tok = Tokenizer::from_gguf(&f)?;
    let ids = tok.encode(&a.text, !a.no_bos && tok.add_bos_default())?;
    let s: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    println!("{}", s.join(" "));
    Ok(ExitCode::SUCCESS)
}

/// Where the input ids come from: a prompt (tokenized with the model's own vocabulary) or ids.
#[derive(Args, Clone, Default)]
pub struct InputArgs {
    /// Prompt text, tokenized with the GGUF's own tokenizer.
    #[arg(short = 'p', long, conflicts_with = "tokens")]
    pub prompt: Option<String>,
    /// Token ids instead of a prompt, e.g. 1,415,2936 (used as given: no BOS added).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
    /// Do not prepend BOS to the prompt.
    #[arg(long)]
    pub no_bos: bool,
}

impl InputArgs {
    pub fn given(&self) -> bool {
        self.prompt.is_some() || self.tokens.is_some()
    }

    /// The ids to run, and a line describing the BOS policy applied.
    pub fn resolve(&self, f: &GgufFile) -> Result<(Vec<u32>, String)> {
        if let Some(ids) = &self.tokens {
            if ids.is_empty() {
                return Err(err("--tokens is empty"));
            }
            return Ok((
                ids.clone(),
                "ids given with --tokens: used as is (no BOS added)".into(),
            ));
        }
        let tok = Tokenizer::from_gguf(f)?;
        let text = self.prompt.clone().unwrap_or_default();
        let add_bos = !self.no_bos && tok.add_bos_default() && tok.bos_id().is_some();
        let ids = tok.encode(&text, add_bos)?;
        if ids.is_empty() {
            return Err(err(
                "the prompt tokenizes to no tokens (empty prompt and no BOS)",
            ));
        }
        let policy = if add_bos {
            format!(
                "BOS {} prepended (the vocabulary's add_bos_token; --no-bos to disable)",
                tok.bos_id().unwrap_or(0)
            )
        } else if self.no_bos {
            "no BOS (--no-bos)".into()
        } else {
            "no BOS (the vocabulary does not ask for one)".into()
        };
        Ok((ids, policy))
    }
}

/// Backend names: `reference` (plain f32), `reference:ggml-cpu` (emulating ggml's CPU
/// activation rounding).
pub fn make_backend<'m>(
    name: &str,
    model: &'m Model,
    n_ctx: usize,
    threads: usize,
) -> Result<Box<dyn Backend + 'm>> {
    match name {
        "fast" => Ok(Box::new(Fast::new(model, n_ctx, resolve_threads(threads)))),
        "reference" => Ok(Box::new(Reference::new(model, Emulation::None, n_ctx))),
        "reference:ggml-cpu" | "emulated" => {
            Ok(Box::new(Reference::new(model, Emulation::GgmlCpu, n_ctx)))
        }
        other => Err(backend::BackendError::Unknown(other.to_string()).into()),
    }
}

/// `--threads 0` means every core.
pub fn resolve_threads(n: usize) -> usize {
    if n > 0 {
        n
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// The backend name for `--backend B --emulate E`.
pub fn backend_name(backend: &str, emulate: &str) -> Result<String> {
    match (backend, emulate) {
        (b, "none") => Ok(b.to_string()),
        ("reference", "ggml-cpu") => Ok("reference:ggml-cpu".into()),
        (b, "ggml-cpu") => Ok(b.to_string()),
        (_, e) => Err(err(format!("unknown --emulate '{e}' (none, ggml-cpu)"))),
    }
}

pub fn producer(backend: &dyn Backend, settings: serde_json::Value) -> Producer {
    Producer {
        name: "parity".into(),
        backend: backend.name(),
        version: env!("CARGO_PKG_VERSION").into(),
        settings,
    }
}

pub fn model_ref(path: &Path, model: &Model) -> ModelRef {
    ModelRef {
        path: path.display().to_string(),
        sha256: model.sha256().to_string(),
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Number of tokens to generate.
    #[arg(short = 'n', long, default_value_t = 32)]
    n: usize,
    /// Backend: reference or fast.
    #[arg(long, default_value = "reference")]
    backend: String,
    /// Activation rounding: none or ggml-cpu.
    #[arg(long, default_value = "none")]
    emulate: String,
    /// Keep going past EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

pub fn generate(a: GenerateArgs) -> Result<ExitCode> {
    let model = Model::open(&a.model)?;
    let tok = Tokenizer::from_gguf(&model.file)?;
    let mut input = a.input.clone();
    if !input.given() {
        input.prompt = Some(String::new()); // from BOS alone
    }
    let (ids, policy) = input.resolve(&model.file)?;
    eprintln!("prompt ids: {ids:?} — {policy}");
    let name = backend_name(&a.backend, &a.emulate)?;
    let mut b = make_backend(&name, &model, ids.len() + a.n, a.threads)?;
    let eos = if a.ignore_eos { None } else { tok.eos_id() };
    let out = backend::generate(b.as_mut(), &ids, a.n, eos)?;
    println!("{}", tok.decode(&out));
    let s: Vec<String> = out.iter().map(|i| i.to_string()).collect();
    println!("ids: {}", s.join(" "));
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct DumpArgs {
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps after the prefill (teacher-forced from the greedy continuation).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Force these decode tokens instead of the greedy ones (sets --steps).
    #[arg(long, value_delimiter = ',')]
    forced: Option<Vec<u32>>,
    /// Output trace folder.
    #[arg(long)]
    out: PathBuf,
    /// Keep only taps whose name (e.g. `attn_norm-3`, `logits`) matches this regex.
    #[arg(long)]
    taps: Option<String>,
    #[arg(long, default_value = "reference")]
    backend: String,
    /// Activation rounding: none or ggml-cpu.
    #[arg(long, default_value = "none")]
    emulate: String,
    /// Overwrite a non-empty output folder.
    #[arg(long)]
    force: bool,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

pub fn dump(a: DumpArgs) -> Result<ExitCode> {
    let model = Model::open(&a.model)?;
    if !a.input.given() {
        return Err(err("give a prompt (-p TEXT) or ids (--tokens 1,2,3)"));
    }
    let (ids, policy) = a.input.resolve(&model.file)?;
    eprintln!("prompt ids: {ids:?} — {policy}");
    let steps = a.forced.as_ref().map_or(a.steps, |f| f.len());
    let filter = match &a.taps {
        Some(re) => TapFilter::regex(re).map_err(|e| err(format!("--taps: {e}")))?,
        None => TapFilter::all(),
    };
    let name = backend_name(&a.backend, &a.emulate)?;
    let mut b = make_backend(&name, &model, ids.len() + steps, a.threads)?;
    let mut sink = TraceWriter::create(&a.out, filter, a.force)?;
    let info = backend::run(b.as_mut(), &ids, steps, a.forced.as_deref(), &mut sink)?;
    let settings = serde_json::json!({ "bos_policy": policy, "command": std::env::args().collect::<Vec<_>>().join(" ") });
    let m = sink.finish(
        model_ref(&a.model, &model),
        producer(b.as_ref(), settings),
        info,
    )?;
    eprintln!(
        "wrote {} tensors over {} steps to {}",
        m.tensors.len(),
        m.steps.len(),
        a.out.display()
    );
    Ok(ExitCode::SUCCESS)
}
