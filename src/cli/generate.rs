//! `parity generate`: greedy generation with one backend (or several, checked against each
//! other token by token).

use super::backends::{
    backend_name, check_context, make_mutated_backend, parse_mutation, resolve_threads,
};
use super::input::{InputArgs, ids_text};
use super::{Result, err};
use crate::backend::{self, Backend, Emulation};
use crate::model::Model;
use crate::model::tokenizer::Tokenizer;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

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
    /// Activation rounding of the reference backend: plain-f32 (the default), ggml-cpu (as
    /// llama.cpp's CPU backend rounds matmul inputs) or another engine family (ggml-scalar,
    /// q8k, q8_1-gpu, f16, bf16; `parity diff --help`); `none` and `ggml` are accepted for the
    /// first two. The fast backend always rounds as ggml-cpu.
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
        ids = crate::backend::dump::mutate_ids(&ids, m, &model)?;
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
