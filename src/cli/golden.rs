//! `parity golden`: the flags, the prompt's ids (tokenized as llama.cpp does), then the
//! library's golden maker (`crate::golden`: checks before llama.cpp starts, the script, a
//! failure of the Python side as one line, exit 2).

use super::input::InputArgs;
use super::{Result, err};
use crate::golden::{Aside, Spec, Tools};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct GoldenArgs {
    /// GGUF model file (UTF-8 path: the golden's manifest records it as text).
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps after the prefill (teacher-forced from llama.cpp's greedy continuation);
    /// default 4, or as many as --forced gives. Prompt + steps must fit the model's context.
    #[arg(long)]
    steps: Option<usize>,
    /// Ids to feed at the decode steps instead of llama.cpp's own greedy choice (comma
    /// separated), e.g. another golden's continuation, so two goldens see the same sequence.
    #[arg(long, value_delimiter = ',')]
    forced: Vec<u32>,
    /// Output trace folder (written under a temporary name beside it, moved into place at the
    /// end; UTF-8 path). Default: the user's golden folder ($PARITY_GOLDEN_DIR, else
    /// ~/.local/share/parity/golden), one subfolder per model file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep llama.cpp's default settings (F16 KV cache, flash attention auto) instead of the
    /// tight ones (F32 KV cache, flash attention off, no weight repacking).
    #[arg(long)]
    llama_defaults: bool,
    /// Feed the prompt (and each --turn) to llama.cpp in calls of this many tokens, one step
    /// each: a chunked prefill (1: one token at a time). Default: the whole prompt at once.
    #[arg(long, default_value_t = 0)]
    chunk: usize,
    /// The ids of a further turn (comma separated), fed as one step (or chunks) after the
    /// decode steps and followed by as many decode steps again; repeat for more turns.
    #[arg(long)]
    turn: Vec<String>,
    /// K cache type (llama.cpp's -ctk: f32, f16, q8_0, q4_0). Default f32, or f16 with
    /// --llama-defaults. The golden records it and the judge holds it to that cache.
    #[arg(long, value_parser = ["f32", "f16", "q8_0", "q4_0"])]
    cache_type_k: Option<String>,
    /// V cache type (llama.cpp's -ctv; a quantized V cache needs flash attention).
    #[arg(long, value_parser = ["f32", "f16", "q8_0", "q4_0"])]
    cache_type_v: Option<String>,
    /// Flash attention (llama.cpp's -fa: on, off, auto). Default off, or auto with
    /// --llama-defaults; the golden records what llama.cpp resolved it to.
    #[arg(long, value_parser = ["on", "off", "auto"])]
    flash_attn: Option<String>,
    /// llama.cpp threads.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    threads: usize,
    /// Layers to offload to the GPU device of a llama-cpp-python built with one (-1: all, the
    /// output included; e.g. CMAKE_ARGS=-DGGML_VULKAN=on). The manifest names the device
    /// (llama.cpp-vulkan, …) and `check` holds such a golden to GPU rounding.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-1..))]
    gpu_layers: i32,
    /// Overwrite a non-empty output folder.
    #[arg(long)]
    force: bool,
    /// A recording plan, as `parity diff` prints it for a zoom: `taps=l_out,result_norm,logits`
    /// keeps those taps at every step (a scan of a long run at a fraction of the size),
    /// `;full=3,7-8` every tap at those steps (docs/trace-format.md, "Scan and zoom").
    #[arg(long, value_name = "PLAN")]
    record: Option<String>,
    /// Refuse a golden whose trace would be larger than this (bytes, or 500M, 4G, 1T), before
    /// llama.cpp runs. The attention probabilities grow with the square of the length.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = crate::arch::size::parse_size)]
    max_trace_size: u64,
    /// Show llama.cpp's own log and the script's full error output.
    #[arg(long)]
    verbose: bool,
}

pub fn golden(a: GoldenArgs) -> Result<ExitCode> {
    let spec = spec(a)?;
    crate::golden::make(&spec, &tools(), Aside::No).map_err(err)?;
    Ok(ExitCode::SUCCESS)
}

/// The golden the flags describe, with the prompt's ids: parity tokenizes (as llama.cpp does)
/// and hands llama.cpp ids, since its tokenizer aborts the whole process on some inputs (an
/// emoji on a vocabulary without byte tokens).
fn spec(a: GoldenArgs) -> Result<Spec> {
    if !a.input.given() {
        return Err(err("give a prompt (-p TEXT) or ids (--tokens 1,2,3)"));
    }
    let file = crate::model::open_gguf(&a.model)?;
    let (ids, policy) = a.input.resolve(&file)?;
    Ok(Spec {
        model: a.model,
        ids,
        policy,
        prompt_text: a.input.prompt,
        steps: a.steps,
        forced: a.forced,
        out: a.out,
        llama_defaults: a.llama_defaults,
        chunk: a.chunk,
        turns: a.turn,
        cache_type_k: a.cache_type_k,
        cache_type_v: a.cache_type_v,
        flash_attn: a.flash_attn,
        threads: a.threads,
        gpu_layers: a.gpu_layers,
        force: a.force,
        record: a.record,
        max_trace_size: a.max_trace_size,
        verbose: a.verbose,
    })
}

/// The Python and scripts/llama_golden.py every golden is made with.
pub fn tools() -> Tools {
    Tools {
        python: super::python(),
        script: super::script("llama_golden.py"),
    }
}
