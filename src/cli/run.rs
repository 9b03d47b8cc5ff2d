//! `parity tokenize`, `parity generate`, `parity dump`, and the helpers they share with `check`.

use super::{Result, err};
use crate::backend::mutation::{self, Mutation, MutationKind};
use crate::backend::{self, Backend, Emulation, Reference};
use crate::gguf::GgufFile;
use crate::model::Model;
use crate::model::tokenizer::Tokenizer;
use crate::report::shown::shown;
use crate::trace::{ModelRef, Producer, TapFilter, Trace, TraceWriter};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args)]
pub struct TokenizeArgs {
    /// GGUF file (a vocab-only file is enough).
    model: PathBuf,
    /// Do not prepend BOS ([CLS] for a BERT vocabulary) even if the vocabulary asks for it.
    #[arg(long)]
    no_bos: bool,
    /// Do not append EOS ([SEP] for a BERT vocabulary) even if the vocabulary asks for it.
    #[arg(long)]
    no_eos: bool,
    /// Text to tokenize.
    text: String,
}

/// The ids of `text` as llama.cpp's `llama_tokenize(add_special = true)` makes them — BOS
/// when `add_bos_token`, EOS when `add_eos_token`, [CLS] … [SEP] for a BERT vocabulary —
/// with either end left out on request, and a line saying what was added and why.
pub fn prompt_ids(
    tok: &Tokenizer,
    text: &str,
    no_bos: bool,
    no_eos: bool,
) -> Result<(Vec<u32>, String)> {
    let ids = tok.encode_special(text, !no_bos, !no_eos)?;
    let (first, last) = tok.special_ends();
    let bert = tok.kind() == "bert";
    let name = |id: u32| {
        tok.token_text(id)
            .map_or_else(|| id.to_string(), |t| format!("{} ({id})", shown(t)))
    };
    let first_s = match first {
        Some(id) if no_bos => format!("{} left out (--no-bos)", name(id)),
        Some(id) if bert => format!(
            "{} prepended (a BERT vocabulary, as llama.cpp does; --no-bos to leave it out)",
            name(id)
        ),
        Some(id) => format!(
            "BOS {} prepended (the vocabulary's add_bos_token; --no-bos to leave it out)",
            name(id)
        ),
        None if no_bos => "no BOS (--no-bos)".into(),
        None => "no BOS (the vocabulary does not ask for one)".into(),
    };
    let last_s = match last {
        Some(id) if no_eos => Some(format!("{} left out (--no-eos)", name(id))),
        Some(id) if bert => Some(format!(
            "{} appended (a BERT vocabulary, as llama.cpp does; --no-eos to leave it out)",
            name(id)
        )),
        Some(id) => Some(format!(
            "EOS {} appended (the vocabulary's add_eos_token, as llama.cpp does; --no-eos to leave it out)",
            name(id)
        )),
        None => None,
    };
    let policy = match last_s {
        Some(l) => format!("{first_s}; {l}"),
        None => first_s,
    };
    Ok((ids, policy))
}

/// Ids as a person reads them: `1 388 268`.
pub fn ids_text(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn tokenize(a: TokenizeArgs) -> Result<ExitCode> {
    let f = crate::model::open_gguf(&a.model)?;
    let tok = Tokenizer::from_gguf(&f)?;
    let (ids, _) = prompt_ids(&tok, &a.text, a.no_bos, a.no_eos)?;
    println!("{}", ids_text(&ids));
    Ok(ExitCode::SUCCESS)
}

/// Where the input ids come from: a prompt (tokenized with the model's own vocabulary) or ids.
#[derive(Args, Clone, Default)]
pub struct InputArgs {
    /// Prompt text, tokenized with the GGUF's own tokenizer as llama.cpp does (BOS/EOS as the
    /// vocabulary asks; [CLS] … [SEP] for BERT).
    #[arg(short = 'p', long, conflicts_with = "tokens")]
    pub prompt: Option<String>,
    /// Token ids instead of a prompt, e.g. 1,415,2936 (used as given: no BOS or EOS added).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
    /// Do not prepend BOS ([CLS] for BERT) to the prompt.
    #[arg(long)]
    pub no_bos: bool,
    /// Do not append EOS ([SEP] for BERT) to the prompt, when the vocabulary asks for one
    /// (tokenizer.ggml.add_eos_token).
    #[arg(long)]
    pub no_eos: bool,
}

impl InputArgs {
    pub fn given(&self) -> bool {
        self.prompt.is_some() || self.tokens.is_some()
    }

    /// The ids to run, and a line describing the BOS/EOS policy applied.
    pub fn resolve(&self, f: &GgufFile) -> Result<(Vec<u32>, String)> {
        if let Some(ids) = &self.tokens {
            if ids.is_empty() {
                return Err(err("--tokens is empty"));
            }
            return Ok((
                ids.clone(),
                "ids given with --tokens: used as is (no BOS or EOS added)".into(),
            ));
        }
        let tok = Tokenizer::from_gguf(f)?;
        let text = self.prompt.clone().unwrap_or_default();
        let (ids, policy) = prompt_ids(&tok, &text, self.no_bos, self.no_eos)?;
        if ids.is_empty() {
            return Err(err(
                "the prompt tokenizes to no tokens (empty prompt and no BOS)",
            ));
        }
        Ok((ids, policy))
    }
}

/// A backend by its registry name (`backend::registry`).
pub fn make_backend<'m>(
    name: &str,
    model: &'m Model,
    n_ctx: usize,
    threads: usize,
) -> Result<Box<dyn Backend + 'm>> {
    match (backend::registry::find(name), reference_family(name)) {
        (Err(_), Some(e)) => Ok(Box::new(Reference::new(model, e, n_ctx))),
        (entry, _) => Ok(entry?.build(model, n_ctx, threads)?),
    }
}

/// `reference:FAMILY` for a rounding family the registry has no row for (the zoo's clean
/// engines: `reference:ggml-scalar`, `reference:q8k`, ...): the reference under that emulation.
fn reference_family(name: &str) -> Option<Emulation> {
    match name {
        "reference" => Some(Emulation::None),
        "emulated" => Some(Emulation::GgmlCpu),
        _ => Emulation::parse(name.strip_prefix("reference:")?),
    }
}

/// `--mutate NAME`: the mutation, refused (one line, exit 2) when unknown or when it cannot
/// show on this model.
pub fn parse_mutation(name: &str, model: &Model) -> Result<Mutation> {
    let m = Mutation::parse(name).ok_or_else(|| {
        err(format!(
            "unknown mutation '{name}' (known: {})",
            Mutation::names()
        ))
    })?;
    if !m.applies_to(model) {
        let ok: Vec<&str> = Mutation::ALL
            .iter()
            .filter(|m| m.applies_to(model))
            .map(|m| m.name())
            .collect();
        return Err(err(format!(
            "mutation '{name}' does not apply to this model (applicable: {})",
            ok.join(", ")
        )));
    }
    Ok(m)
}

/// [`make_backend`] for an engine with bug `m`: compute and layout bugs need the reference
/// backend (where the catalog's hooks live); token bugs change the ids, not the backend.
pub fn make_mutated_backend<'m>(
    name: &str,
    model: &'m Model,
    n_ctx: usize,
    threads: usize,
    m: Option<Mutation>,
    from_layer: usize,
) -> Result<Box<dyn Backend + 'm>> {
    let Some(m) = m.filter(|m| m.kind() != MutationKind::Tokens) else {
        return make_backend(name, model, n_ctx, threads);
    };
    let Some(emulation) = reference_family(name) else {
        return Err(err(format!(
            "--mutate {m} needs the reference backend (not '{name}')"
        )));
    };
    Ok(Box::new(
        Reference::new(model, emulation, n_ctx)
            .with_mutation(Some(m))
            .mutation_from_layer(from_layer),
    ))
}

/// The ids an engine with a token bug feeds: BOS dropped or doubled. Refused when the prompt
/// does not start with the model's BOS (the bug cannot show then).
pub fn mutate_ids(ids: &[u32], m: Mutation, model: &Model) -> Result<Vec<u32>> {
    let bos = mutation::bos_id(model);
    let starts = bos.is_some() && ids.first().copied() == bos;
    match m {
        Mutation::NoBos | Mutation::DoubleBos if !starts => Err(err(format!(
            "--mutate {m}: the prompt ids do not start with the model's BOS ({})",
            bos.map_or("it has none".to_string(), |b| b.to_string())
        ))),
        Mutation::NoBos if ids.len() < 2 => {
            Err(err("--mutate no-bos: the prompt is BOS alone".to_string()))
        }
        Mutation::NoBos => Ok(ids[1..].to_vec()),
        Mutation::DoubleBos => Ok([&ids[..1], ids].concat()),
        _ => Ok(ids.to_vec()),
    }
}

/// `--threads 0` means every core; more than 4 per core is capped, with a note on stderr.
pub fn resolve_threads(n: usize) -> usize {
    let r = backend::registry::resolve_threads(n);
    if n != 0 && r < n {
        eprintln!(
            "note: --threads {n} capped at {r} (4 per core on this machine's {} cores)",
            r / 4
        );
    }
    r
}

/// Refuse, before any work, a run whose prompt and steps do not fit the model's context
/// (`what` names the steps argument, e.g. `--steps 8`).
pub fn check_context(model: &Model, n_prompt: usize, what: &str, steps: usize) -> Result<()> {
    let n_ctx = model.config.n_ctx_train;
    if n_prompt.saturating_add(steps) > n_ctx {
        return Err(err(format!(
            "{n_prompt} prompt ids + {what} {steps} exceed the model's context of {n_ctx} positions"
        )));
    }
    Ok(())
}

/// The backend name for `--backend B --emulate E` (E unset: the backend's own rounding).
pub fn backend_name(backend: &str, emulate: Option<&str>) -> Result<String> {
    match (backend, emulate) {
        (b, None) => Ok(b.to_string()),
        ("reference", Some("none")) => Ok("reference".into()),
        ("reference", Some(e)) if Emulation::parse(e).is_some() => Ok(format!("reference:{e}")),
        (b, Some(e @ ("none" | "ggml-cpu"))) => {
            let entry = backend::registry::find(b)?;
            if entry.rounding.name() == e {
                Ok(b.to_string())
            } else {
                Err(err(format!(
                    "--backend {b} always rounds activations as '{}'; --emulate {e} is for the reference backend",
                    entry.rounding.name()
                )))
            }
        }
        (_, Some(e)) => Err(err(format!(
            "unknown --emulate '{e}' ({})",
            Emulation::ALL.map(|e| e.name()).join(", ")
        ))),
    }
}

/// The producer of a trace made by `backend`; its activation rounding is recorded in the
/// settings so that no reader has to guess it from the backend's name.
pub fn producer(backend: &dyn Backend, settings: serde_json::Value) -> Producer {
    let mut settings = match settings {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    settings.insert("rounding".into(), backend.rounding().name().into());
    Producer {
        name: "parity".into(),
        backend: backend.name(),
        version: env!("CARGO_PKG_VERSION").into(),
        settings: settings.into(),
    }
}

pub fn model_ref(path: &Path, model: &Model) -> ModelRef {
    ModelRef {
        path: path.display().to_string(),
        sha256: model.sha256().to_string(),
        size: Some(model.file.bytes().len() as u64),
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
    /// Activation rounding of the reference backend: none (plain f32, the default), ggml-cpu
    /// (as llama.cpp's CPU backend rounds matmul inputs) or another engine family (ggml-scalar,
    /// q8k, q8_1-gpu, f16, bf16; `parity diff --help`). The fast backend always rounds as
    /// ggml-cpu.
    #[arg(long, value_name = "ROUNDING")]
    emulate: Option<String>,
    /// Keep going past EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    threads: usize,
    /// Behave like an engine with this known bug (see `parity mutations`).
    #[arg(long, value_name = "NAME")]
    mutate: Option<String>,
}

pub fn generate(a: GenerateArgs) -> Result<ExitCode> {
    let model = Model::open(&a.model)?;
    let tok = Tokenizer::from_gguf(&model.file)?;
    let mut input = a.input.clone();
    if !input.given() {
        input.prompt = Some(String::new()); // from BOS alone
    }
    let (mut ids, policy) = input.resolve(&model.file)?;
    let mutate = a
        .mutate
        .as_deref()
        .map(|n| parse_mutation(n, &model))
        .transpose()?;
    if let Some(m) = mutate {
        ids = mutate_ids(&ids, m, &model)?;
        eprintln!("mutation: {m} — {}", m.describe());
    }
    eprintln!("prompt ids: {} — {policy}", ids_text(&ids));
    check_context(&model, ids.len(), "-n", a.n)?;
    let name = backend_name(&a.backend, a.emulate.as_deref())?;
    let threads = resolve_threads(a.threads);
    let mut b = make_mutated_backend(&name, &model, ids.len() + a.n, threads, mutate, 0)?;
    eprintln!("{}", rounding_line(b.as_ref(), &model));
    let eos = if a.ignore_eos { None } else { tok.eos_id() };
    let out = generate_checked(b.as_mut(), &ids, a.n, eos)?;
    // The generated text is the product: its newlines and tabs are kept, any other control
    // character a vocabulary's tokens hold (ESC, CR, a bidi override) is escaped.
    println!("{}", crate::report::shown::text(&tok.decode(&out)));
    println!("ids: {}", ids_text(&out));
    Ok(ExitCode::SUCCESS)
}

/// Which backend runs and how it rounds, and whether that can give llama.cpp's ids: its CPU
/// backend rounds matmul inputs to 8 bits (16 for F16 weights) before quantized matmuls, so a
/// plain-f32 run of a quantized or F16 model differs slightly and its greedy choice can part
/// from llama.cpp's on a near tie.
fn rounding_line(b: &dyn Backend, model: &Model) -> String {
    let w = model.main_weight_type();
    let rounding = b.rounding();
    let how = rounding.family().activations;
    let mut line = format!("backend: {} ({how}; {w} weights)", b.name());
    if rounding != Emulation::GgmlCpu && w != crate::gguf::GgmlType::F32 {
        line.push_str(&format!(
            "\nwarning: llama.cpp rounds activations before {w} matmuls and this backend does not: \
             the continuation can part from llama.cpp's after a few tokens \
             (--emulate ggml-cpu or --backend fast round as llama.cpp does)"
        ));
    }
    line
}

/// [`backend::generate`], refusing logits that are not finite: a NaN or infinite logit has no
/// argmax, and printing `ids: 0 0 0` as if it had would hide the fault.
fn generate_checked(
    b: &mut dyn Backend,
    prompt: &[u32],
    n: usize,
    eos: Option<u32>,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(backend::BackendError::Empty.into());
    }
    b.reset();
    let next = |logits: &[f32], step: usize| -> Result<u32> {
        match logits.iter().position(|x| !x.is_finite()) {
            Some(i) => Err(err(format!(
                "the logits at step {step} are not finite (logit {i} is {}): the model's weights hold NaN or infinity, or the forward pass overflowed; `parity check` shows the first tap where it starts",
                logits[i]
            ))),
            None => Ok(backend::argmax(logits)),
        }
    };
    let mut out = Vec::with_capacity(n);
    let mut tok = next(b.forward(prompt, 0, 0, &mut crate::trace::NullSink)?, 0)?;
    for (s, pos) in (1..=n).zip(prompt.len()..) {
        out.push(tok);
        if Some(tok) == eos || s == n {
            break;
        }
        tok = next(b.forward(&[tok], pos, s, &mut crate::trace::NullSink)?, s)?;
    }
    Ok(out)
}

#[derive(Args)]
pub struct DumpArgs {
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps after the prefill (teacher-forced from the greedy continuation; default 4,
    /// or as many as --forced or --golden give).
    #[arg(long)]
    steps: Option<usize>,
    /// Force these decode tokens instead of the greedy ones (sets --steps).
    #[arg(long, value_delimiter = ',')]
    forced: Option<Vec<u32>>,
    /// Output trace: a folder, or one `.npz` archive when the name ends in `.npz` (one file
    /// instead of one per tap: faster to write and read).
    #[arg(long)]
    out: PathBuf,
    /// Keep only taps whose name (e.g. `attn_norm-3`, `logits`) matches this regex.
    #[arg(long)]
    taps: Option<String>,
    /// A recording plan, as `parity diff` prints it for a zoom: `taps=l_out,result_norm,logits`
    /// keeps those taps at every step (a scan), `;full=3,7-8` every tap at those steps
    /// (docs/trace-format.md, "Scan and zoom"). With --taps, a step kept whole keeps every
    /// tap; elsewhere both must keep it.
    #[arg(long, value_name = "PLAN")]
    record: Option<String>,
    #[arg(long, default_value = "reference")]
    backend: String,
    /// Activation rounding of the reference backend: none (plain f32, the default), ggml-cpu
    /// (as llama.cpp's CPU backend rounds matmul inputs) or another engine family (ggml-scalar,
    /// q8k, q8_1-gpu, f16, bf16; `parity diff --help`). The fast backend always rounds as
    /// ggml-cpu.
    #[arg(long, value_name = "ROUNDING")]
    emulate: Option<String>,
    /// Overwrite the trace already at --out (a folder's or an archive's; never other files).
    #[arg(long)]
    force: bool,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    threads: usize,
    /// Replay a golden's ids: its prompt (step 0) and its decode tokens (forced).
    #[arg(long, conflicts_with_all = ["prompt", "tokens", "forced"])]
    golden: Option<PathBuf>,
    /// Write the trace an engine with this known bug would write (see `parity mutations`).
    /// The manifest does not say so: `diff` must find it blind.
    #[arg(long, value_name = "NAME")]
    mutate: Option<String>,
    /// With a layout mutation: declare the layout in the manifest (`"layouts"`), as an
    /// engine that knows it stores the tap differently would.
    #[arg(long, requires = "mutate")]
    declare_layout: bool,
    /// Refuse a run whose trace would be larger than this (bytes, or 500M, 4G, 1T), before it
    /// starts. The attention probabilities grow with the square of the length.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = crate::arch::size::parse_size)]
    max_trace_size: u64,
    /// The bug acts only from this layer on (and on the output norm and projection): a bug
    /// placed deep in the model.
    #[arg(long, requires = "mutate", default_value_t = 0)]
    mutate_from_layer: usize,
}

/// `--record PLAN` (dump, golden), parsed before any work: one line naming the part at fault.
pub fn record_plan(plan: Option<&str>) -> Result<Option<crate::trace::Record>> {
    plan.map(crate::trace::Record::parse)
        .transpose()
        .map_err(|e| err(format!("--record: {e}")))
}

pub fn dump(a: DumpArgs) -> Result<ExitCode> {
    let mut inputs: Vec<(&Path, &str)> = vec![(&a.model, "the model")];
    if let Some(g) = &a.golden {
        inputs.push((g, "--golden"));
    }
    crate::trace::paths::check_paths(&inputs, &[(&a.out, "--out")]).map_err(err)?;
    TraceWriter::check_target(&a.out, a.force)?;
    let plan = record_plan(a.record.as_deref())?;
    let model = Model::open(&a.model)?;
    // A golden fed in chunks or with further turns is replayed step by step, as it was fed.
    let mut later: Option<Vec<Vec<u32>>> = None;
    let (mut ids, policy, forced) = match &a.golden {
        Some(dir) => {
            let g = Trace::open(dir)?;
            let want = &g.manifest.model.sha256;
            if !want.is_empty() && want != model.sha256() {
                return Err(err(format!(
                    "--golden {} was made for another model (sha256 {}…), not {} (sha256 {}…)",
                    dir.display(),
                    want.chars().take(12).collect::<String>(),
                    a.model.display(),
                    &model.sha256()[..12]
                )));
            }
            let ids = g.manifest.steps.first().map(|s| s.tokens.clone());
            let ids = ids
                .filter(|t| !t.is_empty())
                .ok_or_else(|| err(format!("{}: the golden has no prompt ids", dir.display())))?;
            let policy = format!("ids replayed from the golden {}", dir.display());
            let steps: Vec<Vec<u32>> = g.manifest.steps[1..]
                .iter()
                .map(|s| s.tokens.clone())
                .collect();
            if steps.iter().any(|t| t.len() != 1) {
                later = Some(steps);
            }
            (ids, policy, Some(g.manifest.decode_tokens()))
        }
        None if !a.input.given() => {
            return Err(err(
                "give a prompt (-p TEXT), ids (--tokens 1,2,3) or a golden to replay (--golden DIR)",
            ));
        }
        None => {
            let (ids, policy) = a.input.resolve(&model.file)?;
            (ids, policy, a.forced.clone())
        }
    };
    let mutate = a
        .mutate
        .as_deref()
        .map(|n| parse_mutation(n, &model))
        .transpose()?;
    if a.declare_layout && mutate.is_some_and(|m| m.kind() != MutationKind::Layout) {
        return Err(err(
            "--declare-layout goes with a layout mutation (head-major-q-rope)",
        ));
    }
    if let Some(m) = mutate {
        if m.first_shows_from(&model, a.mutate_from_layer).is_none() {
            return Err(err(format!(
                "--mutate {m} cannot show from layer {} of this {}-layer model",
                a.mutate_from_layer, model.config.n_layer
            )));
        }
        ids = mutate_ids(&ids, m, &model)?;
        eprintln!("mutation: {m} — {}", m.describe());
    }
    eprintln!("prompt ids: {} — {policy}", ids_text(&ids));
    let steps = match (&forced, a.steps) {
        (Some(f), Some(s)) if s != f.len() => {
            let from = if a.golden.is_some() {
                format!("the golden's {} decode ids", f.len())
            } else {
                format!("--forced ({} ids)", f.len())
            };
            return Err(err(format!(
                "--steps {s} disagrees with {from}: give one of them"
            )));
        }
        (Some(f), _) => f.len(),
        (None, s) => s.unwrap_or(4),
    };
    let what = if forced.is_some() {
        "forced decode ids"
    } else {
        "--steps"
    };
    check_context(&model, ids.len(), what, steps)?;
    let threads = resolve_threads(a.threads);
    let filter = match &a.taps {
        Some(re) => TapFilter::regex(re).map_err(|e| err(format!("--taps: {e}")))?,
        None => TapFilter::all(),
    };
    let filter = filter.with_record(plan);
    let run = match &later {
        Some(l) => {
            crate::arch::size::fed_steps(std::iter::once(ids.len()).chain(l.iter().map(Vec::len)))
        }
        None => crate::arch::size::golden_feed(ids.len(), 0, steps, &[]),
    };
    let (bytes, probs) =
        crate::arch::size::trace_bytes(&model.config, &run, &|k| filter.matches(k));
    if let Some(msg) = crate::arch::size::over_budget(
        "this dump's trace",
        bytes,
        probs,
        a.max_trace_size,
        "keep fewer taps (--taps 'l_out|result_norm|logits' scans every position cheaply)",
    ) {
        return Err(err(msg));
    }
    let name = backend_name(&a.backend, a.emulate.as_deref())?;
    let mut b = make_mutated_backend(
        &name,
        &model,
        ids.len() + steps,
        threads,
        mutate,
        a.mutate_from_layer,
    )?;
    let mut sink = TraceWriter::create(&a.out, filter, a.force)?;
    if a.declare_layout {
        sink.declare_layout("q_rope", "head-major");
    }
    let info = match &later {
        Some(l) => backend::run_steps(b.as_mut(), &ids, l, &mut sink)?,
        None => backend::run(b.as_mut(), &ids, steps, forced.as_deref(), &mut sink)?,
    };
    let settings = serde_json::json!({ "bos_policy": policy, "command": std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ") });
    let m = sink.finish(
        model_ref(&a.model, &model),
        producer(b.as_ref(), settings),
        info,
    )?;
    eprintln!(
        "wrote {} tensors over {} steps to {}",
        m.tensors.len(),
        m.steps.len(),
        // The path as given may hold control characters: escaped, one line.
        shown(&a.out.display().to_string())
    );
    Ok(ExitCode::SUCCESS)
}
