//! The prompt as ids: `-p TEXT` tokenized as llama.cpp does, or `--tokens`; `parity tokenize`.

use super::{Result, err};
use crate::gguf::GgufFile;
use crate::model::tokenizer::Tokenizer;
use crate::report::shown::shown;
use clap::Args;
use std::path::PathBuf;
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
