//! The tokenizer a GGUF file describes in its own metadata, producing llama.cpp's exact token ids.
//!
//! Supported `tokenizer.ggml.model` values:
//!
//! * `llama` — SentencePiece-style (llama.cpp's `llm_tokenizer_spm`): spaces become `▁`, a leading
//!   `▁` is added when `add_space_prefix` (default true), adjacent symbols are merged greedily by
//!   the *score of the merged token*, and whatever is left outside the vocabulary falls back to
//!   `<0xXX>` byte tokens.
//! * `gpt2` — byte-level BPE (llama.cpp's `llm_tokenizer_bpe`): the text is split into words by the
//!   pre-tokenizer regexes chosen by `tokenizer.ggml.pre`, each word is byte-encoded (GPT-2's
//!   bytes→unicode table) and merged by merge rank.
//! * `bert` — WordPiece (llama.cpp's `llm_tokenizer_wpm`).
//!
//! What comes from the `tokenizers` crate and what is written here, and why:
//!
//! * The BPE merge loop of byte-level BPE runs on [`tokenizers::models::bpe::BPE`], built from the
//!   GGUF tokens and merges. Its merge order (lowest rank first, ties to the leftmost pair) is
//!   llama.cpp's. It cannot express two corners of llama.cpp's loop: a merge whose parts or result
//!   are not in the vocabulary (llama.cpp still merges, then spells the symbol out byte by byte),
//!   and a word containing a character that is not a token (llama.cpp keeps it as a symbol that
//!   blocks merges across it; `tokenizers` drops it). For those cases — detected when the
//!   tokenizer is built, or per word — a hand-written transcription of llama.cpp's loop is used.
//! * The general-purpose pre-tokenizer regexes run on `tokenizers`' `SysRegex` (fancy-regex, for
//!   the look-arounds such as `\s+(?!\S)`) or on `regex` when a pattern has no look-around.
//!   llama.cpp does not run those regexes on the text as is: it "collapses" every non-ASCII
//!   codepoint to one stand-in byte per Unicode category and rewrites `\p{L}`, `\p{N}`, … to match
//!   those stand-ins (ASCII characters keep their own, slightly unusual, category sets), and
//!   `\s` is C's `isspace`. That rewriting is reproduced here (`translate_regex`); so are the
//!   two hand-coded splitters llama.cpp uses instead of a regex for the GPT-2 and LLaMA-3 patterns.
//! * SPM is written by hand: `tokenizers`' BPE and Unigram models cannot express llama.cpp's
//!   "merge the pair whose merged token has the highest score, ties to the leftmost" rule.
//! * WordPiece is written by hand (llama.cpp's vocabulary marks word starts with `▁`, the opposite
//!   of `tokenizers`' `##` continuation convention); its NFD step uses `tokenizers`'
//!   `NormalizedString`.
//! * Special tokens: like llama.cpp's `tokenizer_st_partition`, user-defined tokens are always cut
//!   out of the text before tokenization; control tokens only when `parse_special` (never in
//!   [`Tokenizer::encode`]).
//!
//! Unicode categories come from the `regex` crate's tables, with the codepoints assigned after
//! llama.cpp's own tables (Unicode 16.0) marked "undefined" as llama.cpp has them; the category,
//! lowercase and NFD tables were checked codepoint by codepoint against a llama.cpp build (see the
//! `unicode_tables_match_llama_cpp` test).
//!
//! Verified against llama.cpp (llama-cpp-python 0.3.36): every string of llama.cpp's tokenizer test
//! files for llama-spm, phi-3, gpt-2, falcon, mpt, starcoder, refact, deepseek-coder,
//! deepseek-llm and bert-bge, and a 2,551-string fuzz corpus on those plus baichuan, gpt-neox and
//! stablelm (`encode`, `encode_llama` with `add_special` / `parse_special`, both detokenize
//! modes); see `tests/tokenizer_vocab.rs`.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fmt;
use std::sync::OnceLock;

use tokenizers::Model;
use tokenizers::NormalizedString;
use tokenizers::models::bpe::{BPE, Vocab as BpeVocab};
use tokenizers::utils::SysRegex;

use crate::gguf::{GgufFile, Value};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_SEP: &str = "tokenizer.ggml.seperator_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
const KEY_FIM_PRE: [&str; 2] = [
    "tokenizer.ggml.fim_pre_token_id",
    "tokenizer.ggml.prefix_token_id",
];
const KEY_FIM_SUF: [&str; 2] = [
    "tokenizer.ggml.fim_suf_token_id",
    "tokenizer.ggml.suffix_token_id",
];
const KEY_FIM_MID: [&str; 2] = [
    "tokenizer.ggml.fim_mid_token_id",
    "tokenizer.ggml.middle_token_id",
];
const KEY_FIM_PAD: &str = "tokenizer.ggml.fim_pad_token_id";
const KEY_FIM_REP: &str = "tokenizer.ggml.fim_rep_token_id";
const KEY_FIM_SEP: &str = "tokenizer.ggml.fim_sep_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_ADD_SEP: &str = "tokenizer.ggml.add_sep_token";
const KEY_ADD_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
const KEY_LOWERCASE: &str = "tokenizer.ggml.normalizer.lowercase";
const KEY_STRIP_ACCENTS: &str = "tokenizer.ggml.normalizer.strip_accents";

/// Why a tokenizer could not be built or could not tokenize.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF metadata key '{0}' is missing; it is needed to build the tokenizer")]
    MissingKey(String),
    #[error("GGUF metadata key '{key}': {what}")]
    BadKey { key: String, what: String },
    #[error(
        "unsupported tokenizer.ggml.model '{0}' (parity reproduces llama.cpp's 'llama' (SentencePiece), 'gpt2' (byte-level BPE) and 'bert' (WordPiece) tokenizers)"
    )]
    UnsupportedModel(String),
    #[error(
        "unsupported pre-tokenizer tokenizer.ggml.pre = '{0}' (not one parity reproduces; llama.cpp itself refuses names it does not know)"
    )]
    UnsupportedPre(String),
    #[error(
        "duplicate token in vocabulary: '{text}' has ids {first} and {second} (llama.cpp refuses this vocabulary too)"
    )]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },
    #[error("{0}")]
    Inconsistent(String),
    #[error(
        "the vocabulary has no byte token for byte 0x{0:02X} (neither '<0x{0:02X}>' nor the byte itself), needed for byte fallback"
    )]
    MissingByteToken(u8),
    #[error(
        "pre-tokenizer regex {regex:?} (for tokenizer.ggml.pre '{pre}') does not compile: {what}"
    )]
    Regex {
        pre: String,
        regex: String,
        what: String,
    },
}

// llama.cpp's `llama_token_attr` bits.
const ATTR_UNDEFINED: u32 = 0;
const ATTR_UNKNOWN: u32 = 1 << 0;
const ATTR_UNUSED: u32 = 1 << 1;
const ATTR_NORMAL: u32 = 1 << 2;
const ATTR_CONTROL: u32 = 1 << 3;
const ATTR_USER_DEFINED: u32 = 1 << 4;
const ATTR_BYTE: u32 = 1 << 5;
const ATTR_LSTRIP: u32 = 1 << 7;
const ATTR_RSTRIP: u32 = 1 << 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum VocabType {
    Spm,
    Bpe,
    Wpm,
}

/// A tokenizer built from GGUF metadata (`tokenizer.ggml.*`), reproducing llama.cpp's token ids.
pub struct Tokenizer {
    kind: String,
    pre: Option<String>,
    vtype: VocabType,
    tokens: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u32>,
    token_to_id: HashMap<String, u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    sep: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_sep: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    escape_whitespaces: bool,
    /// Control, user-defined and unknown tokens, longest text first (llama.cpp's
    /// `cache_special_tokens`).
    special_cache: Vec<u32>,
    /// `llama_token_to_piece(id, special = true)` for every token.
    pieces: Vec<Vec<u8>>,
    bpe: Option<BpeState>,
    wpm: WpmOptions,
    max_token_len: usize,
}

struct BpeState {
    splitter: PreTokenizer,
    /// Merge ranks keyed by "left right" (llama.cpp's `bpe_ranks`; the first occurrence wins).
    ranks: HashMap<String, u32>,
    ignore_merges: bool,
    /// The `tokenizers` BPE model; `None` when some merge cannot be expressed in it exactly.
    hf: Option<BPE>,
    /// Characters that are tokens by themselves (a word made only of these can go to `hf`).
    single_char_tokens: HashSet<char>,
}

#[derive(Clone, Copy, Debug)]
struct WpmOptions {
    lowercase: bool,
    strip_accents: bool,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("pre", &self.pre)
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_space_prefix", &self.add_space_prefix)
            .finish_non_exhaustive()
    }
}

fn bad_key(key: &str, what: impl Into<String>) -> TokenizerError {
    TokenizerError::BadKey {
        key: key.to_string(),
        what: what.into(),
    }
}

/// An optional token id key: `Ok(None)` when absent; a non-integer value is refused, a negative
/// one reads as out of range.
fn opt_id(f: &GgufFile, key: &str) -> Result<Option<u64>, TokenizerError> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) => Ok(Some(id)),
            None => match v.as_i64() {
                // A negative id means "none" in some converters; llama.cpp would read it as a huge
                // u32 and reject it as out of range, keeping the default.
                Some(_) => Ok(Some(u64::MAX)),
                None => Err(bad_key(
                    key,
                    format!("expected an integer token id, found {:?}", v.value_type()),
                )),
            },
        },
    }
}

fn opt_bool(f: &GgufFile, key: &str) -> Result<Option<bool>, TokenizerError> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| bad_key(key, format!("expected a bool, found {:?}", v.value_type()))),
    }
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata (vocab-only files work),
    /// following llama.cpp's `llama_vocab::impl::load`.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let kind = match f.get(KEY_MODEL) {
            None => return Err(TokenizerError::MissingKey(KEY_MODEL.into())),
            Some(v) => v
                .as_str()
                .ok_or_else(|| bad_key(KEY_MODEL, "expected a string"))?
                .to_string(),
        };
        let pre = match f.get(KEY_PRE) {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .ok_or_else(|| bad_key(KEY_PRE, "expected a string"))?
                    .to_string(),
            ),
        };
        let vtype = match kind.as_str() {
            "llama" => VocabType::Spm,
            "gpt2" => VocabType::Bpe,
            "bert" => VocabType::Wpm,
            _ => return Err(TokenizerError::UnsupportedModel(kind)),
        };

        // Defaults per vocabulary type (llama.cpp's `load`). Ids are i64 so "none" is -1.
        let (mut bos, mut eos, mut unk, mut sep): (i64, i64, i64, i64) = match vtype {
            VocabType::Spm => (1, 2, 0, -1),
            VocabType::Wpm => (101, -1, 100, 102),
            VocabType::Bpe => (11, 11, -1, -1),
        };
        let mut add_space_prefix;
        let mut add_bos;
        let mut add_eos = false;
        let mut add_sep = false;
        let mut clean_spaces;
        let mut escape_whitespaces = true;
        let mut pre_cfg = None;
        match vtype {
            VocabType::Bpe => {
                add_space_prefix = false;
                escape_whitespaces = false;
                clean_spaces = true;
                add_bos = false;
                let name = pre.as_deref().unwrap_or("");
                let cfg = pre_config(name)
                    .ok_or_else(|| TokenizerError::UnsupportedPre(name.to_string()))?;
                if let Some(c) = cfg.clean_spaces {
                    clean_spaces = c;
                }
                if cfg.add_bos {
                    add_bos = true;
                }
                if cfg.add_sep {
                    add_sep = true;
                }
                if cfg.bos_none {
                    bos = -1;
                }
                pre_cfg = Some(cfg);
            }
            VocabType::Spm => {
                add_space_prefix = true;
                clean_spaces = false;
                add_bos = true;
            }
            VocabType::Wpm => {
                add_space_prefix = false;
                clean_spaces = true;
                add_bos = true;
                add_sep = true;
            }
        }
        if let Some(b) = opt_bool(f, KEY_ADD_PREFIX)? {
            add_space_prefix = b;
        }

        // Tokens, scores, types.
        let raw_tokens = match f.get(KEY_TOKENS) {
            None => return Err(TokenizerError::MissingKey(KEY_TOKENS.into())),
            Some(v) => v
                .as_array()
                .ok_or_else(|| bad_key(KEY_TOKENS, "expected an array of strings"))?,
        };
        let n = raw_tokens.len();
        if n > u32::MAX as usize {
            return Err(bad_key(KEY_TOKENS, "more than 2^32 tokens"));
        }
        let scores: Vec<f32> = match f.get(KEY_SCORES) {
            None => vec![0.0; n],
            Some(v) => {
                let a = v
                    .as_array()
                    .ok_or_else(|| bad_key(KEY_SCORES, "expected an array"))?;
                if a.len() < n {
                    return Err(bad_key(
                        KEY_SCORES,
                        format!("{} scores for {n} tokens", a.len()),
                    ));
                }
                a[..n]
                    .iter()
                    .map(|x| match x {
                        Value::F32(s) => Ok(*s),
                        Value::I32(s) => Ok(*s as f32),
                        other => Err(bad_key(
                            KEY_SCORES,
                            format!("expected f32 or i32 scores, found {:?}", other.value_type()),
                        )),
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let types: Option<Vec<i64>> = match f.get(KEY_TOKEN_TYPE) {
            None => None,
            Some(v) => {
                let a = v
                    .as_array()
                    .ok_or_else(|| bad_key(KEY_TOKEN_TYPE, "expected an array"))?;
                if a.len() < n {
                    return Err(bad_key(
                        KEY_TOKEN_TYPE,
                        format!("{} token types for {n} tokens", a.len()),
                    ));
                }
                Some(
                    a[..n]
                        .iter()
                        .map(|x| {
                            x.as_i64().ok_or_else(|| {
                                bad_key(KEY_TOKEN_TYPE, "expected integer token types")
                            })
                        })
                        .collect::<Result<_, _>>()?,
                )
            }
        };

        let mut tokens = Vec::with_capacity(n);
        let mut token_to_id: HashMap<String, u32> = HashMap::with_capacity(n);
        let mut attrs = Vec::with_capacity(n);
        let mut max_token_len = 0;
        for (i, v) in raw_tokens.iter().enumerate() {
            let mut word = v
                .as_str()
                .ok_or_else(|| bad_key(KEY_TOKENS, format!("token {i} is not a string")))?
                .to_string();
            if word.is_empty() {
                word = format!("[EMPTY_{i}]");
            }
            if let Some(&first) = token_to_id.get(&word) {
                return Err(TokenizerError::DuplicateToken {
                    text: word,
                    first,
                    second: i as u32,
                });
            }
            token_to_id.insert(word.clone(), i as u32);
            max_token_len = max_token_len.max(word.len());
            tokens.push(word);
            attrs.push(match &types {
                None => ATTR_NORMAL,
                Some(t) => match t[i] {
                    1 => ATTR_NORMAL,
                    2 => ATTR_UNKNOWN,
                    3 => ATTR_CONTROL,
                    4 => ATTR_USER_DEFINED,
                    5 => ATTR_UNUSED,
                    6 => ATTR_BYTE,
                    _ => ATTR_UNDEFINED,
                },
            });
        }

        // Merges (BPE only).
        let mut merges: Vec<(String, String)> = Vec::new();
        if vtype == VocabType::Bpe {
            let a = match f.get(KEY_MERGES) {
                None => return Err(TokenizerError::MissingKey(KEY_MERGES.into())),
                Some(v) => v
                    .as_array()
                    .ok_or_else(|| bad_key(KEY_MERGES, "expected an array of strings"))?,
            };
            merges.reserve(a.len());
            for (i, m) in a.iter().enumerate() {
                let s = m
                    .as_str()
                    .ok_or_else(|| bad_key(KEY_MERGES, format!("merge {i} is not a string")))?;
                // llama.cpp splits at the first space at or after byte 1.
                let (l, r) = match s.as_bytes().iter().skip(1).position(|&b| b == b' ') {
                    Some(p) => (s[..p + 1].to_string(), s[p + 2..].to_string()),
                    None => (String::new(), String::new()),
                };
                merges.push((l, r));
            }
        }

        // Special token ids: defaults out of range are disabled; a metadata id out of range is
        // ignored (the default stays), as in llama.cpp.
        let n_i = n as i64;
        let fix = |id: &mut i64, key: &str| -> Result<bool, TokenizerError> {
            if *id >= n_i {
                *id = -1;
            }
            match opt_id(f, key)? {
                None => Ok(false),
                Some(v) => {
                    if v < n as u64 {
                        *id = v as i64;
                    }
                    Ok(true)
                }
            }
        };
        fix(&mut bos, KEY_BOS)?;
        fix(&mut eos, KEY_EOS)?;
        fix(&mut unk, KEY_UNK)?;
        fix(&mut sep, KEY_SEP)?;
        let mut eot = -1;
        let mut eom = -1;
        fix(&mut eot, KEY_EOT)?;
        fix(&mut eom, KEY_EOM)?;
        let (has_eot, has_eom) = (eot >= 0, eom >= 0);
        let mut fim_known = [false; 6];
        for (slot, keys) in [
            (0usize, &KEY_FIM_PRE[..]),
            (1, &KEY_FIM_SUF[..]),
            (2, &KEY_FIM_MID[..]),
            (3, &[KEY_FIM_PAD][..]),
            (4, &[KEY_FIM_REP][..]),
            (5, &[KEY_FIM_SEP][..]),
        ] {
            for k in keys {
                let mut dummy = -1;
                if fix(&mut dummy, k)? && dummy >= 0 {
                    fim_known[slot] = true;
                }
            }
        }

        if let Some(b) = opt_bool(f, KEY_ADD_BOS)? {
            add_bos = b;
        }
        if let Some(b) = opt_bool(f, KEY_ADD_EOS)? {
            add_eos = b;
        }
        if let Some(b) = opt_bool(f, KEY_ADD_SEP)? {
            add_sep = b;
        }
        for (flag, id, fk, ik) in [
            (add_bos, bos, KEY_ADD_BOS, KEY_BOS),
            (add_eos, eos, KEY_ADD_EOS, KEY_EOS),
            (add_sep, sep, KEY_ADD_SEP, KEY_SEP),
        ] {
            if flag && id < 0 {
                return Err(TokenizerError::Inconsistent(format!(
                    "{fk} is true, but {ik} is not set"
                )));
            }
        }

        let mut wpm = WpmOptions {
            lowercase: true,
            strip_accents: true,
        };
        if let Some(b) = opt_bool(f, KEY_LOWERCASE)? {
            wpm.lowercase = b;
        }
        wpm.strip_accents = wpm.lowercase;
        if let Some(b) = opt_bool(f, KEY_STRIP_ACCENTS)? {
            wpm.strip_accents = b;
        }

        // Attribute fix-ups llama.cpp applies by token text.
        const EOT_TEXTS: &[&str] = &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ];
        const FIM_TEXTS: [&[&str]; 6] = [
            &[
                "<|fim_prefix|>",
                "<fim-prefix>",
                "<fim_prefix>",
                "<｜fim▁begin｜>",
                "<PRE>",
                "▁<PRE>",
                "<|code_prefix|>",
                "<|prefix|>",
            ],
            &[
                "<|fim_suffix|>",
                "<fim-suffix>",
                "<fim_suffix>",
                "<｜fim▁hole｜>",
                "<SUF>",
                "▁<SUF>",
                "<|code_suffix|>",
                "<|suffix|>",
            ],
            &[
                "<|fim_middle|>",
                "<fim-middle>",
                "<fim_middle>",
                "<｜fim▁end｜>",
                "<MID>",
                "▁<MID>",
                "<|code_middle|>",
                "<|middle|>",
            ],
            &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
            &[
                "<|fim_repo|>",
                "<|repo_name|>",
                "<fim-repo>",
                "<REPO>",
                "<reponame>",
            ],
            &["<|file_sep|>"],
        ];
        const EOG_TEXTS: &[&str] = &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<|return|>",
            "<|call|>",
            "<|flush|>",
            "<|calls|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "</s>",
            "<|eom_id|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "[EOS]",
            "<|end_of_text|>",
            "<end_of_utterance>",
            "<eos>",
            "<turn|>",
            "<|tool_response>",
            "<｜end▁of▁sentence｜>",
            "[e~[",
        ];
        let set_control = |t: &str, attrs: &mut Vec<u32>| {
            if let Some(&id) = token_to_id.get(t) {
                attrs[id as usize] |= ATTR_CONTROL;
            }
        };
        // llama.cpp marks the first EOT/EOM/FIM candidate it meets (hash-map order) as control;
        // every EOT candidate is also an EOG text below, so all of them end up control anyway.
        // For FIM, all candidates are marked (a vocabulary rarely has two of one kind).
        if !has_eot {
            for t in EOT_TEXTS {
                set_control(t, &mut attrs);
            }
        }
        if !has_eom {
            set_control("<|eom_id|>", &mut attrs);
        }
        for (slot, texts) in FIM_TEXTS.iter().enumerate() {
            if !fim_known[slot] {
                for t in *texts {
                    set_control(t, &mut attrs);
                }
            }
        }
        for (i, t) in tokens.iter().enumerate() {
            if attrs[i] & ATTR_CONTROL != 0 && attrs[i] & ATTR_UNUSED == 0 && t.contains("unused") {
                attrs[i] |= ATTR_UNUSED;
            }
        }
        let mut eog: HashSet<u32> = HashSet::new();
        for t in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*t) {
                eog.insert(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = token_to_id.get(t) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        let in_eog = |t: &str| token_to_id.get(t).is_some_and(|id| eog.contains(id));
        if (in_eog("<|return|>") && in_eog("<|call|>")
            || in_eog("<|calls|>") && in_eog("<|flush|>"))
            && in_eog("<|end|>")
        {
            attrs[token_to_id["<|end|>"] as usize] = ATTR_USER_DEFINED;
        }
        if in_eog("<|tool_response>") && in_eog("</s>") {
            attrs[token_to_id["</s>"] as usize] = ATTR_NORMAL;
        }

        let mut special_cache: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        // llama.cpp uses an unstable sort; ties (same length) keep id order here.
        special_cache.sort_by(|&a, &b| tokens[b as usize].len().cmp(&tokens[a as usize].len()));

        // Per-token strip attributes set by model name (llama.cpp's "Handle per token attributes").
        let name = f.get_str("general.name").unwrap_or("").to_ascii_lowercase();
        let arch = f.get_str("general.architecture").unwrap_or("");
        let pre_s = pre.as_deref().unwrap_or("");
        let has_any = |s: &str, subs: &[&str]| subs.iter().any(|x| s.contains(x));
        if has_any(pre_s, &["jina-v2-de", "jina-v2-es", "jina-v2-code"])
            || has_any(arch, &["nomic-bert-moe", "jina-bert-v3"])
        {
            if let Some(&id) = token_to_id.get("<mask>") {
                attrs[id as usize] |= ATTR_LSTRIP;
            }
        } else if has_any(&name, &["phi-3", "phi3"]) {
            for &id in &special_cache {
                attrs[id as usize] |= ATTR_RSTRIP;
            }
            if let Some(&id) = token_to_id.get("</s>") {
                attrs[id as usize] |= ATTR_RSTRIP;
            }
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(&id) = token_to_id.get(t) {
                    attrs[id as usize] &= !ATTR_RSTRIP;
                }
            }
        } else if has_any(&name, &["modern-bert"])
            && let Some(&id) = token_to_id.get("[MASK]")
        {
            attrs[id as usize] |= ATTR_LSTRIP;
        }

        let bpe = match pre_cfg {
            None => None,
            Some(cfg) => Some(BpeState::new(
                pre.as_deref().unwrap_or("default"),
                &cfg,
                &tokens,
                &token_to_id,
                merges,
            )?),
        };

        let to_opt = |id: i64| if id >= 0 { Some(id as u32) } else { None };
        let mut tok = Tokenizer {
            kind,
            pre,
            vtype,
            tokens,
            scores,
            attrs,
            token_to_id,
            bos: to_opt(bos),
            eos: to_opt(eos),
            unk: to_opt(unk),
            sep: to_opt(sep),
            add_bos,
            add_eos,
            add_sep,
            add_space_prefix,
            clean_spaces,
            escape_whitespaces,
            special_cache,
            pieces: Vec::new(),
            bpe,
            wpm,
            max_token_len,
        };
        tok.pieces = (0..tok.tokens.len())
            .map(|i| tok.compute_piece(i))
            .collect();
        Ok(tok)
    }

    /// Tokenizes `text` as llama.cpp's `llama_tokenize(text, add_special = false,
    /// parse_special = false)` does, with the BOS token prepended when `add_bos` (and the
    /// vocabulary has one).
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        if add_bos && let Some(b) = self.bos {
            out.push(b);
        }
        self.tokenize_fragments(text, false, &mut out)?;
        Ok(out)
    }

    /// Exactly llama.cpp's `llama_tokenize(text, add_special, parse_special)`: with `add_special`
    /// the vocabulary's own BOS/EOS/SEP policy applies (`add_bos_token`, `add_eos_token`, …).
    pub fn encode_llama(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        match self.vtype {
            VocabType::Spm | VocabType::Bpe => {
                if add_special && self.add_bos {
                    out.extend(self.bos);
                }
                self.tokenize_fragments(text, parse_special, &mut out)?;
                if add_special && self.add_eos {
                    out.extend(self.eos);
                }
            }
            VocabType::Wpm => {
                if add_special {
                    out.extend(self.bos);
                }
                self.tokenize_fragments(text, parse_special, &mut out)?;
                if add_special {
                    out.extend(self.sep);
                }
            }
        }
        Ok(out)
    }

    /// Ids → text, as llama.cpp's `llama_detokenize(ids, remove_special = false,
    /// unparse_special = false)`: control tokens render as nothing, byte tokens are reassembled,
    /// SPM's `▁` becomes a space and, when the vocabulary adds a space prefix, one leading space
    /// of the first piece is dropped; BPE vocabularies with `clean_spaces` get llama.cpp's
    /// clean-up of " ," " ." " 's" and friends. Invalid UTF-8 (a sequence cut mid-character)
    /// is replaced by U+FFFD. Ids outside the vocabulary render as nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.detokenize_bytes(ids, false, false)).into_owned()
    }

    /// llama.cpp's `llama_detokenize` with its two flags, as raw bytes.
    pub fn detokenize_bytes(
        &self,
        ids: &[u32],
        remove_special: bool,
        unparse_special: bool,
    ) -> Vec<u8> {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if remove_special && self.add_bos && !ids.is_empty() && Some(ids[0]) == self.bos {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.add_eos && !ids.is_empty() && Some(ids[ids.len() - 1]) == self.eos
        {
            ids = &ids[..ids.len() - 1];
        }
        let mut text = Vec::new();
        for &id in ids {
            let piece = self.piece(id, unparse_special);
            let piece = if remove_space && piece.first() == Some(&b' ') {
                &piece[1..]
            } else {
                piece
            };
            remove_space = false;
            text.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_up_spaces(&mut text);
        }
        text
    }

    /// The text of one token as llama.cpp's `llama_token_to_piece(id, special = true)` renders it
    /// (control tokens show their text, `▁` is a space, byte tokens are their byte — lossily
    /// shown when not valid UTF-8 on its own). Empty for ids outside the vocabulary.
    pub fn token_to_piece(&self, id: u32) -> String {
        String::from_utf8_lossy(self.piece(id, true)).into_owned()
    }

    /// `llama_token_to_piece(id, special)` as raw bytes.
    pub fn piece(&self, id: u32, special: bool) -> &[u8] {
        let Some(a) = self.attrs.get(id as usize) else {
            return &[];
        };
        if !special && a & (ATTR_UNKNOWN | ATTR_CONTROL) != 0 {
            return &[];
        }
        &self.pieces[id as usize]
    }

    /// The token's text as stored in the vocabulary (`tokenizer.ggml.tokens`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a token by its vocabulary text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    /// `tokenizer.ggml.add_bos_token`, else llama.cpp's default for the vocabulary type and
    /// pre-tokenizer (SPM and WPM true, BPE false except llama3-style pre-tokenizers).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos
    }

    /// `tokenizer.ggml.add_eos_token`, else llama.cpp's default (false for SPM, BPE, WPM).
    pub fn add_eos_default(&self) -> bool {
        self.add_eos
    }

    /// `tokenizer.ggml.add_sep_token`, else llama.cpp's default (true for WPM and a few BPE
    /// pre-tokenizers).
    pub fn add_sep_default(&self) -> bool {
        self.add_sep
    }

    /// Whether SentencePiece-style vocabularies prefix the text with a space.
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// `tokenizer.ggml.model`: "llama" | "gpt2" | "bert".
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// `tokenizer.ggml.pre`, when the file has it.
    pub fn pre(&self) -> Option<&str> {
        self.pre.as_deref()
    }

    // ---- tokenization -------------------------------------------------------------------------

    fn tokenize_fragments(
        &self,
        text: &str,
        parse_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let frags = self.partition(text, parse_special);
        match self.vtype {
            VocabType::Spm => {
                let mut prev_special = true;
                for fr in frags {
                    match fr {
                        Frag::Text(o, l) => {
                            let mut t = String::with_capacity(l + 1);
                            if self.add_space_prefix && prev_special {
                                t.push(' ');
                            }
                            t.push_str(&text[o..o + l]);
                            let t = t.replace(' ', "\u{2581}");
                            self.spm_tokenize(&t, out)?;
                            prev_special = false;
                        }
                        Frag::Tok(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            VocabType::Bpe => {
                for fr in frags {
                    match fr {
                        Frag::Text(o, l) => {
                            let t = &text[o..o + l];
                            if self.escape_whitespaces {
                                self.bpe_tokenize(&t.replace(' ', "\u{2581}"), out);
                            } else {
                                self.bpe_tokenize(t, out);
                            }
                        }
                        Frag::Tok(id) => out.push(id),
                    }
                }
            }
            VocabType::Wpm => {
                for fr in frags {
                    match fr {
                        Frag::Text(o, l) => self.wpm_tokenize(&text[o..o + l], out),
                        Frag::Tok(id) => out.push(id),
                    }
                }
            }
        }
        Ok(())
    }

    /// llama.cpp's `tokenizer_st_partition`: cut special tokens out of the text (byte ranges).
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
        let bytes = text.as_bytes();
        let mut frags = if text.is_empty() {
            Vec::new()
        } else {
            vec![Frag::Text(0, text.len())]
        };
        for &id in &self.special_cache {
            let a = self.attrs[id as usize];
            if !parse_special && a & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let tok = self.tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for fr in frags {
                let Frag::Text(mut off, mut len) = fr else {
                    next.push(fr);
                    continue;
                };
                loop {
                    let Some(rel) = text[off..off + len].find(tok) else {
                        next.push(Frag::Text(off, len));
                        break;
                    };
                    let m = off + rel;
                    if m > off {
                        let mut ll = m - off;
                        if a & ATTR_LSTRIP != 0 {
                            while ll > 0 && is_c_space(bytes[off + ll - 1]) {
                                ll -= 1;
                            }
                        }
                        if ll > 0 {
                            next.push(Frag::Text(off, ll));
                        }
                    }
                    next.push(Frag::Tok(id));
                    let end = m + tok.len();
                    if end >= off + len {
                        break;
                    }
                    let mut ro = end;
                    let mut rl = off + len - end;
                    if a & ATTR_RSTRIP != 0 {
                        while rl > 0 && is_c_space(bytes[ro]) {
                            ro += 1;
                            rl -= 1;
                        }
                    }
                    if rl == 0 {
                        break;
                    }
                    off = ro;
                    len = rl;
                }
            }
            frags = next;
        }
        frags
    }

    /// llama.cpp's `llm_tokenizer_spm_session::tokenize` on already-escaped text.
    fn spm_tokenize(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        struct Sym {
            prev: isize,
            next: isize,
            start: usize,
            n: usize,
        }
        #[derive(PartialEq)]
        struct Bigram {
            score: f32,
            left: usize,
            right: usize,
            size: usize,
        }
        impl Eq for Bigram {}
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Bigram {
            // Highest score first; ties go to the leftmost pair.
            fn cmp(&self, o: &Self) -> Ordering {
                self.score
                    .total_cmp(&o.score)
                    .then_with(|| o.left.cmp(&self.left))
            }
        }

        let bytes = text.as_bytes();
        if bytes.is_empty() {
            return Ok(());
        }
        let mut syms: Vec<Sym> = Vec::new();
        let mut offs = 0;
        while offs < bytes.len() {
            let len = utf8_len(bytes[offs]).min(bytes.len() - offs);
            let idx = syms.len() as isize;
            syms.push(Sym {
                prev: idx - 1,
                next: if offs + len == bytes.len() {
                    -1
                } else {
                    idx + 1
                },
                start: offs,
                n: len,
            });
            offs += len;
        }
        let mut heap = BinaryHeap::new();
        let try_add =
            |syms: &Vec<Sym>, heap: &mut BinaryHeap<Bigram>, left: isize, right: isize| {
                if left < 0 || right < 0 {
                    return;
                }
                let (l, r) = (&syms[left as usize], &syms[right as usize]);
                let Some(s) = text.get(l.start..l.start + l.n + r.n) else {
                    return;
                };
                if let Some(&id) = self.token_to_id.get(s) {
                    heap.push(Bigram {
                        score: self.scores[id as usize],
                        left: left as usize,
                        right: right as usize,
                        size: s.len(),
                    });
                }
            };
        for i in 1..syms.len() {
            try_add(&syms, &mut heap, i as isize - 1, i as isize);
        }
        while let Some(b) = heap.pop() {
            let (ln, rn) = (syms[b.left].n, syms[b.right].n);
            if ln == 0 || rn == 0 || ln + rn != b.size {
                continue;
            }
            syms[b.left].n += rn;
            syms[b.right].n = 0;
            let rnext = syms[b.right].next;
            syms[b.left].next = rnext;
            if rnext >= 0 {
                syms[rnext as usize].prev = b.left as isize;
            }
            let lprev = syms[b.left].prev;
            try_add(&syms, &mut heap, lprev, b.left as isize);
            try_add(&syms, &mut heap, b.left as isize, rnext);
        }
        let mut i: isize = 0;
        while i != -1 {
            let s = &syms[i as usize];
            let piece = &text[s.start..s.start + s.n];
            // A merged symbol is always a token (merges only form tokens), so llama.cpp's
            // `rev_merge` re-segmentation never applies; a lone character that is not a token
            // is spelled out as byte tokens.
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.push(self.byte_to_token(b)?);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }

    /// llama.cpp's `byte_to_token` for SPM: `<0xXX>`, else the byte itself as a token.
    fn byte_to_token(&self, b: u8) -> Result<u32, TokenizerError> {
        if let Some(&id) = self.token_to_id.get(&format!("<0x{b:02X}>")) {
            return Ok(id);
        }
        if b < 0x80
            && let Some(&id) = self.token_to_id.get(&(b as char).to_string())
        {
            return Ok(id);
        }
        Err(TokenizerError::MissingByteToken(b))
    }

    /// llama.cpp's `llm_tokenizer_bpe_session::tokenize`.
    fn bpe_tokenize(&self, text: &str, out: &mut Vec<u32>) {
        let st = self.bpe.as_ref().expect("BPE vocabulary has BPE state");
        for word in st.splitter.split(text) {
            if word.is_empty() {
                continue;
            }
            if st.ignore_merges
                && let Some(&id) = self.token_to_id.get(&word)
            {
                out.push(id);
                continue;
            }
            if let Some(hf) = &st.hf
                && word.chars().all(|c| st.single_char_tokens.contains(&c))
                && let Ok(toks) = hf.tokenize(&word)
            {
                out.extend(toks.into_iter().map(|t| t.id));
                continue;
            }
            self.bpe_word_by_hand(st, &word, out);
        }
    }

    /// A transcription of llama.cpp's BPE merge loop for one (byte-encoded) word.
    fn bpe_word_by_hand(&self, st: &BpeState, word: &str, out: &mut Vec<u32>) {
        struct Sym {
            prev: isize,
            next: isize,
            start: usize,
            n: usize,
        }
        #[derive(PartialEq, Eq)]
        struct Bigram {
            rank: u32,
            left: usize,
            right: usize,
            text: String,
        }
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Bigram {
            // Lowest rank first; ties go to the leftmost pair.
            fn cmp(&self, o: &Self) -> Ordering {
                o.rank.cmp(&self.rank).then_with(|| o.left.cmp(&self.left))
            }
        }
        let mut syms: Vec<Sym> = Vec::new();
        for (i, (start, c)) in word.char_indices().enumerate() {
            let n = c.len_utf8();
            syms.push(Sym {
                prev: i as isize - 1,
                next: if start + n == word.len() {
                    -1
                } else {
                    i as isize + 1
                },
                start,
                n,
            });
        }
        let mut key = String::new();
        let mut heap = BinaryHeap::new();
        let mut add =
            |syms: &Vec<Sym>, heap: &mut BinaryHeap<Bigram>, left: isize, right: isize| {
                if left < 0 || right < 0 {
                    return;
                }
                let (l, r) = (&syms[left as usize], &syms[right as usize]);
                let ls = &word[l.start..l.start + l.n];
                let rs = &word[r.start..r.start + r.n];
                key.clear();
                key.push_str(ls);
                key.push(' ');
                key.push_str(rs);
                if let Some(&rank) = st.ranks.get(&key) {
                    heap.push(Bigram {
                        rank,
                        left: left as usize,
                        right: right as usize,
                        text: format!("{ls}{rs}"),
                    });
                }
            };
        for i in 1..syms.len() {
            add(&syms, &mut heap, i as isize - 1, i as isize);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (&syms[b.left], &syms[b.right]);
            if l.n == 0 || r.n == 0 {
                continue;
            }
            // Stale if the two symbols no longer spell the pair (they are adjacent in the word).
            if l.start + l.n != r.start || &word[l.start..r.start + r.n] != b.text.as_str() {
                continue;
            }
            let rn = r.n;
            let rnext = r.next;
            syms[b.left].n += rn;
            syms[b.right].n = 0;
            syms[b.left].next = rnext;
            if rnext >= 0 {
                syms[rnext as usize].prev = b.left as isize;
            }
            let lprev = syms[b.left].prev;
            add(&syms, &mut heap, lprev, b.left as isize);
            add(&syms, &mut heap, b.left as isize, rnext);
        }
        for s in syms.iter().filter(|s| s.n > 0) {
            let piece = &word[s.start..s.start + s.n];
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    // llama.cpp looks each raw byte up as a one-byte token and skips misses.
                    for &b in piece.as_bytes() {
                        if b < 0x80
                            && let Some(&id) = self.token_to_id.get(&(b as char).to_string())
                        {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }

    /// llama.cpp's `llm_tokenizer_wpm_session::tokenize`.
    fn wpm_tokenize(&self, text: &str, out: &mut Vec<u32>) {
        for word in wpm_preprocess(text, self.wpm) {
            if word.is_empty() {
                continue;
            }
            let w1 = format!("\u{2581}{word}");
            let n = w1.len();
            let cur = out.len();
            let mut i = 0;
            while i < n {
                let mut matched = false;
                let jmax = n.min(i + self.max_token_len + 1);
                let mut j = jmax;
                while j > i {
                    if let Some(&id) = w1.get(i..j).and_then(|s| self.token_to_id.get(s)) {
                        out.push(id);
                        matched = true;
                        i = j;
                        break;
                    }
                    j -= 1;
                }
                if !matched {
                    out.truncate(cur);
                    break;
                }
            }
            if out.len() == cur {
                out.extend(self.unk);
            }
        }
    }

    // ---- pieces -------------------------------------------------------------------------------

    /// llama.cpp's `token_to_piece(id, special = true)` without the cache.
    fn compute_piece(&self, id: usize) -> Vec<u8> {
        let a = self.attrs[id];
        let text = &self.tokens[id];
        if a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if a & ATTR_NORMAL != 0 {
            return match self.vtype {
                VocabType::Spm | VocabType::Wpm => text.replace('\u{2581}', " ").into_bytes(),
                VocabType::Bpe if self.escape_whitespaces => {
                    text.replace('\u{2581}', " ").into_bytes()
                }
                VocabType::Bpe => byte_decode_text(text),
            };
        }
        if a & ATTR_BYTE != 0 && self.vtype != VocabType::Wpm {
            // `strtol(text.substr(3, 2), 16)`.
            let hex = text.get(3..5.min(text.len())).unwrap_or("");
            let digits: String = hex.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
            return vec![u8::from_str_radix(&digits, 16).unwrap_or(0)];
        }
        Vec::new()
    }
}

#[derive(Clone, Copy, Debug)]
enum Frag {
    /// Byte offset and length into the raw text.
    Text(usize, usize),
    Tok(u32),
}

fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// llama.cpp's `unicode_len_utf8`.
fn utf8_len(b: u8) -> usize {
    const LOOKUP: [usize; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4];
    LOOKUP[(b >> 4) as usize]
}

/// llama.cpp's `clean_spaces` passes of `detokenize`, byte for byte.
fn clean_up_spaces(text: &mut Vec<u8>) {
    // first pass: " ?", " !", " .", " ,"
    let total1 = text.len();
    let mut total = usize::from(total1 > 0);
    for i in 1..total1 {
        let x = text[i];
        if text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        text[total] = x;
        total += 1;
    }
    // second pass: strip a single apostrophe between spaces
    let total2 = total;
    total = usize::from(total2 > 0);
    let mut i = 1;
    while i < total2 {
        let x = text[i];
        if x == b'\'' && i + 1 < total2 && text[i - 1] == b' ' && text[i + 1] == b' ' {
            total -= 1;
            i += 1;
            text[i] = 0;
        }
        text[total] = x;
        total += 1;
        i += 1;
    }
    // third pass: apostrophe contractions
    let total3 = total;
    total = usize::from(total3 > 0);
    for i in 1..total3 {
        let x = text[i];
        if text[i - 1] == b' ' && x == b'\'' && i + 1 < total3 {
            let x1 = text[i + 1];
            if x1 == b't' || x1 == b'd' {
                // " 't", " 'd": keep the space
            } else if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if i + 2 < total3 {
                let x2 = text[i + 2];
                if x2 == b'e' && (x1 == b'r' || x1 == b'v') {
                    total -= 1;
                }
            }
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);
}

// ---- Unicode helpers (llama.cpp's unicode.cpp) ------------------------------------------------

const F_UNDEFINED: u16 = 0x0001;
const F_NUMBER: u16 = 0x0002;
const F_LETTER: u16 = 0x0004;
const F_SEPARATOR: u16 = 0x0008;
const F_MARK: u16 = 0x0010;
const F_PUNCT: u16 = 0x0020;
const F_SYMBOL: u16 = 0x0040;
const F_CONTROL: u16 = 0x0080;
const F_WHITESPACE: u16 = 0x0100;
const MAX_CODEPOINTS: usize = 0x110000;

/// Codepoints assigned in Unicode 16.0, which the `regex` crate knows and llama.cpp's tables
/// (`unicode-data.cpp`, Unicode 15.1) do not: llama.cpp classes them as undefined, with no case
/// mapping. Found by comparing with the tables of a llama.cpp build (see the
/// `unicode_tables_match_llama_cpp` test).
const NEWER_THAN_LLAMA_CPP: &[(u32, u32)] = &[
    (0x897, 0x897),
    (0x1B4E, 0x1B4F),
    (0x1B7F, 0x1B7F),
    (0x1C89, 0x1C8A),
    (0x2427, 0x2429),
    (0x31E4, 0x31E5),
    (0xA7CB, 0xA7CD),
    (0xA7DA, 0xA7DC),
    (0x105C0, 0x105F3),
    (0x10D40, 0x10D65),
    (0x10D69, 0x10D85),
    (0x10D8E, 0x10D8F),
    (0x10EC2, 0x10EC4),
    (0x10EFC, 0x10EFC),
    (0x11380, 0x11389),
    (0x1138B, 0x1138B),
    (0x1138E, 0x1138E),
    (0x11390, 0x113B5),
    (0x113B7, 0x113C0),
    (0x113C2, 0x113C2),
    (0x113C5, 0x113C5),
    (0x113C7, 0x113CA),
    (0x113CC, 0x113D5),
    (0x113D7, 0x113D8),
    (0x113E1, 0x113E2),
    (0x116D0, 0x116E3),
    (0x11BC0, 0x11BE1),
    (0x11BF0, 0x11BF9),
    (0x11F5A, 0x11F5A),
    (0x13460, 0x143FA),
    (0x16100, 0x16139),
    (0x16D40, 0x16D79),
    (0x18CFF, 0x18CFF),
    (0x1CC00, 0x1CCF9),
    (0x1CD00, 0x1CEB3),
    (0x1E5D0, 0x1E5FA),
    (0x1E5FF, 0x1E5FF),
    (0x1F8B2, 0x1F8BB),
    (0x1F8C0, 0x1F8C1),
    (0x1FA89, 0x1FA89),
    (0x1FA8F, 0x1FA8F),
    (0x1FABE, 0x1FABE),
    (0x1FAC6, 0x1FAC6),
    (0x1FADC, 0x1FADC),
    (0x1FADF, 0x1FADF),
    (0x1FAE9, 0x1FAE9),
    (0x1FBCB, 0x1FBEF),
];

/// Category flags per codepoint, as llama.cpp's `unicode_cpt_flags_from_cpt`: exactly one of
/// N, L, Z, M, P, S, C (Cc, Cf, Co; surrogates) or "undefined" (unassigned), plus White_Space.
fn flags_table() -> &'static [u16] {
    static TABLE: OnceLock<Vec<u16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![F_CONTROL; MAX_CODEPOINTS];
        let all: String = (0..MAX_CODEPOINTS as u32)
            .filter_map(char::from_u32)
            .collect();
        for (pat, flag) in [
            (r"\p{Cn}+", F_UNDEFINED),
            (r"\p{N}+", F_NUMBER),
            (r"\p{L}+", F_LETTER),
            (r"\p{Z}+", F_SEPARATOR),
            (r"\p{M}+", F_MARK),
            (r"\p{P}+", F_PUNCT),
            (r"\p{S}+", F_SYMBOL),
        ] {
            let re = regex::Regex::new(pat).expect("static category regex");
            for m in re.find_iter(&all) {
                for c in m.as_str().chars() {
                    t[c as usize] = flag;
                }
            }
        }
        for &(a, b) in NEWER_THAN_LLAMA_CPP {
            t[a as usize..=b as usize].fill(F_UNDEFINED);
        }
        for c in all.chars().filter(|c| c.is_whitespace()) {
            t[c as usize] |= F_WHITESPACE;
        }
        t
    })
}

fn cpt_flags(c: u32) -> u16 {
    flags_table()
        .get(c as usize)
        .copied()
        .unwrap_or(F_UNDEFINED)
}

/// llama.cpp's `unicode_tolower`: the first character of the lowercase mapping (none for
/// codepoints llama.cpp's tables do not know).
fn to_lower(c: u32) -> u32 {
    if cpt_flags(c) & F_UNDEFINED != 0 {
        return c;
    }
    match char::from_u32(c) {
        Some(ch) => ch.to_lowercase().next().map_or(c, |l| l as u32),
        None => c,
    }
}

/// llama.cpp's `unicode_cpts_normalize_nfd`: each codepoint becomes the first codepoint of its
/// NFD decomposition (the accents are dropped, not kept).
fn nfd_first(c: char) -> char {
    if c.is_ascii() {
        return c;
    }
    if c == '\u{11938}' {
        // DIVES AKURU VOWEL SIGN O = U+11935 U+11930; missing from the normalization tables
        // `tokenizers` uses.
        return '\u{11935}';
    }
    let mut n = NormalizedString::from(c.to_string());
    n.nfd();
    n.get().chars().next().unwrap_or(c)
}

/// GPT-2's bytes→unicode table (llama.cpp's `unicode_byte_to_utf8_map`).
fn byte_to_char_table() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut n = 0u32;
        for b in 0..256u32 {
            let keep = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            t[b as usize] = if keep {
                char::from_u32(b).unwrap()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap()
            };
        }
        t
    })
}

fn char_to_byte_table() -> &'static HashMap<char, u8> {
    static TABLE: OnceLock<HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        byte_to_char_table()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    })
}

/// llama.cpp's `llama_decode_text`: byte-level BPE token text → bytes.
fn byte_decode_text(text: &str) -> Vec<u8> {
    let map = char_to_byte_table();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

fn byte_encode(word: &str) -> String {
    let t = byte_to_char_table();
    word.bytes().map(|b| t[b as usize]).collect()
}

fn is_chinese_char(c: u32) -> bool {
    (0x4E00..=0x9FFF).contains(&c)
        || (0x3400..=0x4DBF).contains(&c)
        || (0x20000..=0x2A6DF).contains(&c)
        || (0x2A700..=0x2B73F).contains(&c)
        || (0x2B740..=0x2B81F).contains(&c)
        || (0x2B920..=0x2CEAF).contains(&c)
        || (0xF900..=0xFAFF).contains(&c)
        || (0x2F800..=0x2FA1F).contains(&c)
}

/// llama.cpp's `llm_tokenizer_wpm_session::preprocess`.
fn wpm_preprocess(text: &str, opts: WpmOptions) -> Vec<String> {
    let mut words = vec![String::new()];
    for ch in text.chars() {
        let ch = if opts.strip_accents {
            nfd_first(ch)
        } else {
            ch
        };
        let c = ch as u32;
        let fl = cpt_flags(c);
        if fl & F_WHITESPACE != 0 {
            if !words.last().unwrap().is_empty() {
                words.push(String::new());
            }
            continue;
        }
        if c == 0 || c == 0xFFFD || fl & F_CONTROL != 0 {
            continue;
        }
        if opts.strip_accents && fl & F_MARK != 0 {
            continue;
        }
        let lc = if opts.lowercase {
            char::from_u32(to_lower(c)).unwrap_or(ch)
        } else {
            ch
        };
        if fl & F_PUNCT != 0 || (c < 0x7F && fl & F_SYMBOL != 0) || is_chinese_char(c) {
            if !words.last().unwrap().is_empty() {
                words.push(String::new());
            }
            words.last_mut().unwrap().push(lc);
            words.push(String::new());
        } else {
            words.last_mut().unwrap().push(lc);
        }
    }
    if words.last().is_some_and(String::is_empty) {
        words.pop();
    }
    words
}

// ---- BPE pre-tokenizer (llama.cpp's unicode_regex_split) --------------------------------------

/// The GPT-2 pattern; llama.cpp replaces it by a hand-written splitter (matched by exact text).
const R_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// The LLaMA-3 pattern (case-insensitive contractions spelled out); also hand-written there.
const R_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const R_LLAMA3_ORIG: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const R_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const R_CJK_DEEPSEEK: &str = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+";
const R_CJK_DEEPSEEK3: &str = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+";
const R_PORO: &str = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+";
const R_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Per `tokenizer.ggml.pre`: the regexes (in order) and the flags llama.cpp sets with them.
struct PreConfig {
    regexes: &'static [&'static str],
    clean_spaces: Option<bool>,
    ignore_merges: bool,
    add_bos: bool,
    add_sep: bool,
    bos_none: bool,
}

/// llama.cpp's `tokenizer_pre` → pre-type → regexes table (`llama-vocab.cpp`).
fn pre_config(pre: &str) -> Option<PreConfig> {
    const DEFAULT: &[&str] = &[
        r"[\p{P}\$\+<=>\^~\|]+",
        R_GPT2,
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ];
    const LLAMA3: &[&str] = &[R_LLAMA3];
    const JAIS2: &[&str] = &[
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ];
    const DEEPSEEK_LLM: &[&str] = &[
        r"[\r\n]",
        r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+",
        r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
        r"\s+$",
        R_CJK_DEEPSEEK,
        r"\p{N}+",
    ];
    const DEEPSEEK3: &[&str] = &[
        r"\p{N}{1,3}",
        R_CJK_DEEPSEEK3,
        r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
    ];
    const SPARK2_5: &[&str] = &[
        r"\p{N}{1,3}",
        R_CJK_DEEPSEEK3,
        r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##,
        r"\p{N}",
    ];
    const YOUTU: &[&str] = &[
        r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];
    const DEEPSEEK_CODER: &[&str] = &[
        r"[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        R_CJK_DEEPSEEK,
        r"\p{N}",
    ];
    const FALCON: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", R_GPT2, r"[0-9][0-9][0-9]"];
    const STARCODER: &[&str] = &[r"\p{N}", R_GPT2];
    const GPT2: &[&str] = &[R_GPT2];
    const QWEN2: &[&str] = &[R_QWEN2];
    const QWEN35: &[&str] = &[
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];
    const PORO: &[&str] = &[R_PORO];
    const VIKING: &[&str] = &[R_PORO, r"\p{N}"];
    const TEKKEN: &[&str] = &[
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];
    const CHAMELEON: &[&str] = &[
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        R_GPT2,
    ];
    const GPT4O: &[&str] = &[R_GPT4O];
    const GRANITE_EMB_MULTI: &[&str] = &[
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];
    const TINY_AYA: &[&str] = &[
        r"\d{1,3}(?=(?:\d{3})*\b)",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];
    const BAILINGMOE: &[&str] = &[
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ];
    const SEED_CODER: &[&str] = &[
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];
    const UFAKZEKA: &[&str] =
        &[r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"];
    const LAGUNA: &[&str] = &[r"[^\n]+|[\n]+", R_QWEN2];
    const EXAONE_MOE: &[&str] = &[
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ];
    const MINICPM5: &[&str] = &[
        r"\p{N}{1,3}",
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];

    let cfg = |regexes: &'static [&'static str], clean: Option<bool>| PreConfig {
        regexes,
        clean_spaces: clean,
        ignore_merges: false,
        add_bos: false,
        add_sep: false,
        bos_none: false,
    };
    const NOCLEAN: Option<bool> = Some(false);
    Some(match pre {
        "" | "default" => cfg(DEFAULT, None),
        "minicpm5" => PreConfig {
            ignore_merges: true,
            ..cfg(MINICPM5, None)
        },
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => PreConfig {
            ignore_merges: true,
            add_bos: true,
            ..cfg(LLAMA3, None)
        },
        "deepseek-llm" => cfg(DEEPSEEK_LLM, NOCLEAN),
        "deepseek-coder" => cfg(DEEPSEEK_CODER, NOCLEAN),
        "deepseek-v3" | "hunyuan-dense" | "hy_v4" | "joyai-llm" => cfg(DEEPSEEK3, NOCLEAN),
        "spark2_5" => cfg(SPARK2_5, NOCLEAN),
        "youtu" => PreConfig {
            ignore_merges: true,
            ..cfg(YOUTU, NOCLEAN)
        },
        "falcon" => cfg(FALCON, None),
        "mpt" | "olmo" | "jais" | "exaone4" => cfg(GPT2, None),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            cfg(STARCODER, None)
        }
        "command-r" | "smollm" => cfg(STARCODER, NOCLEAN),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" => cfg(GPT2, None),
        "trillion" | "granite-docling" => cfg(GPT2, NOCLEAN),
        "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => PreConfig {
            add_sep: true,
            ..cfg(GPT2, None)
        },
        "jais-2" => cfg(JAIS2, None),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open"
        | "grok-2" => cfg(QWEN2, NOCLEAN),
        "megrez" | "stablelm2" => cfg(QWEN2, None),
        "qwen35" => cfg(QWEN35, NOCLEAN),
        "dbrx" | "smaug-bpe" => cfg(LLAMA3, None),
        "poro-chat" => cfg(PORO, NOCLEAN),
        "bloom" | "gpt3-finnish" => cfg(PORO, None),
        "glm4" | "chatglm-bpe" => PreConfig {
            bos_none: true,
            ..cfg(LLAMA3, None)
        },
        "viking" => cfg(VIKING, NOCLEAN),
        "tekken" => PreConfig {
            ignore_merges: true,
            add_bos: true,
            ..cfg(TEKKEN, NOCLEAN)
        },
        "chameleon" => PreConfig {
            add_bos: true,
            ..cfg(CHAMELEON, NOCLEAN)
        },
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => cfg(GPT4O, NOCLEAN),
        "granite-embed-multi-97m" => PreConfig {
            ignore_merges: true,
            ..cfg(GRANITE_EMB_MULTI, NOCLEAN)
        },
        "tiny_aya" | "cohere2moe" => cfg(TINY_AYA, NOCLEAN),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => cfg(BAILINGMOE, NOCLEAN),
        "seed-coder" => cfg(SEED_CODER, NOCLEAN),
        "ufakzeka" => cfg(UFAKZEKA, NOCLEAN),
        "laguna" => cfg(LAGUNA, NOCLEAN),
        "exaone-moe" => cfg(EXAONE_MOE, None),
        // Not reproduced: kimi-k2, afmoe (custom splitters), superbpe (empty-match regex),
        // gemma4/sarvam-moe/granite-embed-multi-311m (no byte encoding), whitespace.
        _ => return None,
    })
}

/// The unicode categories llama.cpp rewrites in "collapsed" regexes.
const UCATS: &[&str] = &[
    r"\p{N}", r"\p{L}", r"\p{P}", r"\p{M}", r"\p{S}", r"\p{Lu}", r"\p{Ll}", r"\p{Lt}", r"\p{Lm}",
    r"\p{Lo}",
];

/// Class contents standing for a category in collapsed text: the stand-in codepoint plus the
/// ASCII members llama.cpp assigns (`k_ucat_cpt` and `k_ucat_map`).
fn ucat_class(name: &str) -> Option<&'static str> {
    Some(match name {
        "N" => r"\x{D1}0-9",
        "L" | "Lu" | "Ll" | "Lt" | "Lm" | "Lo" => r"\x{D2}A-Za-z",
        "P" => r"\x{D3}!-#%-*,-/:-;?-@\[-\]_\{\}",
        "M" => r"\x{D4}",
        "S" => r"\x{D5}\$\+<->\^`\|",
        _ => return None,
    })
}

/// Rewrites one of llama.cpp's ECMAScript (`std::regex`) patterns for Rust: `\s`/`\d`/`\w` become
/// their ASCII (C locale) classes, and in collapsed mode `\p{..}` becomes the stand-in classes.
/// Characters that are set operators in Rust classes are escaped.
fn translate_regex(expr: &str, collapse: bool) -> Result<String, String> {
    let c: Vec<char> = expr.chars().collect();
    let mut out = String::with_capacity(expr.len() * 2);
    let mut inside = false;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '\\' {
            let Some(&e) = c.get(i + 1) else {
                return Err("trailing backslash".into());
            };
            i += 2;
            match e {
                'p' if c.get(i) == Some(&'{') => {
                    let close = c[i..]
                        .iter()
                        .position(|&x| x == '}')
                        .ok_or("unclosed \\p{")?
                        + i;
                    let name: String = c[i + 1..close].iter().collect();
                    i = close + 1;
                    let cls = ucat_class(&name)
                        .filter(|_| collapse)
                        .ok_or_else(|| format!("unsupported \\p{{{name}}}"))?;
                    if inside {
                        out.push_str(cls);
                    } else {
                        out.push('[');
                        out.push_str(cls);
                        out.push(']');
                    }
                }
                's' => out.push_str(if inside { "[:space:]" } else { "[[:space:]]" }),
                'd' => out.push_str(if inside { "0-9" } else { "[0-9]" }),
                'w' => out.push_str(if inside { "0-9A-Za-z_" } else { "[0-9A-Za-z_]" }),
                'S' | 'D' | 'W' if inside => return Err(format!("\\{e} inside a class")),
                'S' => out.push_str("[^[:space:]]"),
                'D' => out.push_str("[^0-9]"),
                'W' => out.push_str("[^0-9A-Za-z_]"),
                'b' if inside => out.push_str(r"\x08"),
                // ECMAScript's \b is an ASCII word boundary; fancy-regex has no `(?-u:\b)`.
                'b' => out.push_str(
                    r"(?:(?<=[0-9A-Za-z_])(?![0-9A-Za-z_])|(?<![0-9A-Za-z_])(?=[0-9A-Za-z_]))",
                ),
                'B' => out.push_str(
                    r"(?:(?<=[0-9A-Za-z_])(?=[0-9A-Za-z_])|(?<![0-9A-Za-z_])(?![0-9A-Za-z_]))",
                ),
                'r' => out.push_str(r"\r"),
                'n' => out.push_str(r"\n"),
                't' => out.push_str(r"\t"),
                'f' => out.push_str(r"\x0C"),
                'v' => out.push_str(r"\x0B"),
                'x' if c.get(i) == Some(&'{') => {
                    let close = c[i..]
                        .iter()
                        .position(|&x| x == '}')
                        .ok_or("unclosed \\x{")?
                        + i;
                    out.extend(&c[i - 2..=close]);
                    i = close + 1;
                }
                'x' => {
                    let hex: String = c.get(i..i + 2).ok_or("short \\x")?.iter().collect();
                    out.push_str(&format!("\\x{{{hex}}}"));
                    i += 2;
                }
                e if e.is_ascii_punctuation() => push_literal(&mut out, e, inside),
                e => return Err(format!("unsupported escape \\{e}")),
            }
            continue;
        }
        i += 1;
        if !inside {
            match ch {
                '[' => {
                    inside = true;
                    out.push('[');
                    if c.get(i) == Some(&'^') {
                        out.push('^');
                        i += 1;
                    }
                }
                '.' => out.push_str(r"[^\n\r]"),
                _ => out.push(ch),
            }
        } else {
            match ch {
                ']' => {
                    inside = false;
                    out.push(']');
                }
                '-' => out.push('-'),
                _ => push_literal(&mut out, ch, true),
            }
        }
    }
    if inside {
        return Err("unclosed character class".into());
    }
    Ok(out)
}

fn push_literal(out: &mut String, ch: char, inside: bool) {
    let meta = if inside {
        "\\[]^-&~"
    } else {
        "\\.+*?()|[]{}^$"
    };
    if meta.contains(ch) {
        out.push('\\');
    }
    out.push(ch);
}

enum Re {
    Plain(regex::Regex),
    Fancy(SysRegex),
}

impl Re {
    fn find_iter(&self, s: &str) -> Vec<(usize, usize)> {
        match self {
            Re::Plain(r) => r.find_iter(s).map(|m| (m.start(), m.end())).collect(),
            Re::Fancy(r) => r.find_iter(s).collect(),
        }
    }
}

enum Step {
    Gpt2,
    Llama3,
    Regex { re: Re, collapsed: bool },
}

struct PreTokenizer {
    steps: Vec<Step>,
}

impl PreTokenizer {
    fn new(pre: &str, regexes: &[&str]) -> Result<PreTokenizer, TokenizerError> {
        let mut steps = Vec::new();
        for &src in regexes {
            if src == R_GPT2 {
                steps.push(Step::Gpt2);
                continue;
            }
            if src == R_LLAMA3 || src == R_LLAMA3_ORIG {
                steps.push(Step::Llama3);
                continue;
            }
            let err = |what: String| TokenizerError::Regex {
                pre: pre.to_string(),
                regex: src.to_string(),
                what,
            };
            let collapsed = UCATS.iter().any(|u| src.contains(u));
            if collapsed && !src.is_ascii() {
                return Err(err("unicode categories and non-ASCII characters in one regex (llama.cpp refuses it too)".into()));
            }
            let pat = translate_regex(src, collapsed).map_err(err)?;
            let re = if pat.contains("(?=") || pat.contains("(?!") || pat.contains("(?<") {
                Re::Fancy(SysRegex::new(&pat).map_err(|e| err(e.to_string()))?)
            } else {
                Re::Plain(regex::Regex::new(&pat).map_err(|e| err(e.to_string()))?)
            };
            steps.push(Step::Regex { re, collapsed });
        }
        Ok(PreTokenizer { steps })
    }

    /// llama.cpp's `unicode_regex_split` followed by the byte encoding of each word.
    fn split(&self, text: &str) -> Vec<String> {
        let cpts: Vec<char> = text.chars().collect();
        let mut offsets = vec![cpts.len()];
        let mut collapsed: Option<Hay> = None;
        let mut wide: Option<Hay> = None;
        for step in &self.steps {
            offsets = match step {
                Step::Gpt2 => split_gpt2(&cpts, &offsets),
                Step::Llama3 => split_llama3(&cpts, &offsets),
                Step::Regex {
                    re,
                    collapsed: true,
                } => {
                    let hay = collapsed
                        .get_or_insert_with(|| Hay::new(cpts.iter().map(|&c| collapse_char(c))));
                    hay.split(re, &offsets)
                }
                Step::Regex {
                    re,
                    collapsed: false,
                } => {
                    let hay = wide.get_or_insert_with(|| {
                        Hay::new(cpts.iter().map(|&c| {
                            if (c as u32) > 0x7F && cpt_flags(c as u32) & F_WHITESPACE != 0 {
                                '\u{0B}'
                            } else {
                                c
                            }
                        }))
                    });
                    hay.split(re, &offsets)
                }
            };
        }
        let mut words = Vec::with_capacity(offsets.len());
        let mut start = 0;
        let mut buf = String::new();
        for &len in &offsets {
            buf.clear();
            buf.extend(&cpts[start..start + len]);
            words.push(byte_encode(&buf));
            start += len;
        }
        words
    }
}

/// llama.cpp's collapsed representation of one codepoint.
fn collapse_char(c: char) -> char {
    let u = c as u32;
    if u < 128 {
        return c;
    }
    let f = cpt_flags(u);
    if f & F_WHITESPACE != 0 {
        return '\u{0B}';
    }
    match f & 0xFF {
        F_NUMBER => '\u{D1}',
        F_LETTER => '\u{D2}',
        F_PUNCT => '\u{D3}',
        F_MARK => '\u{D4}',
        F_SYMBOL => '\u{D5}',
        _ => '\u{D0}',
    }
}

/// A text to run a regex on, with the byte offset of every codepoint.
struct Hay {
    s: String,
    byte_of: Vec<usize>,
}

impl Hay {
    fn new(chars: impl Iterator<Item = char>) -> Hay {
        let mut s = String::new();
        let mut byte_of = Vec::new();
        for c in chars {
            byte_of.push(s.len());
            s.push(c);
        }
        byte_of.push(s.len());
        Hay { s, byte_of }
    }

    fn cpt_at(&self, byte: usize) -> usize {
        self.byte_of
            .binary_search(&byte)
            .expect("regex match on a char boundary")
    }

    /// llama.cpp's `unicode_regex_split_stl`: matches and the gaps between them become pieces.
    fn split(&self, re: &Re, offsets: &[usize]) -> Vec<usize> {
        let mut out = Vec::with_capacity(offsets.len());
        let mut start = 0;
        for &len in offsets {
            let (b0, b1) = (self.byte_of[start], self.byte_of[start + len]);
            let mut idx = 0;
            for (ms, me) in re.find_iter(&self.s[b0..b1]) {
                let pos = self.cpt_at(b0 + ms) - start;
                let mlen = self.cpt_at(b0 + me) - start - pos;
                if pos > idx {
                    out.push(pos - idx);
                }
                out.push(mlen);
                idx = pos + mlen;
            }
            if idx < len {
                out.push(len - idx);
            }
            start += len;
        }
        out
    }
}

const OUT_OF_RANGE: u32 = 0xFFFF_FFFF;

/// Shared state of llama.cpp's hand-written splitters for one fragment.
struct Cursor<'a> {
    cpts: &'a [char],
    ini: usize,
    end: usize,
    prev_end: usize,
    out: &'a mut Vec<usize>,
}

impl Cursor<'_> {
    fn cpt(&self, pos: usize) -> u32 {
        if pos >= self.ini && pos < self.end {
            self.cpts[pos] as u32
        } else {
            OUT_OF_RANGE
        }
    }
    fn flags(&self, pos: usize) -> u16 {
        if pos >= self.ini && pos < self.end {
            cpt_flags(self.cpts[pos] as u32)
        } else {
            0
        }
    }
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }
}

fn is_l(f: u16) -> bool {
    f & F_LETTER != 0
}
fn is_n(f: u16) -> bool {
    f & F_NUMBER != 0
}
fn is_ws(f: u16) -> bool {
    f & F_WHITESPACE != 0
}

/// llama.cpp's `unicode_regex_split_custom_gpt2`.
fn split_gpt2(cpts: &[char], offsets: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &offset in offsets {
        let (ini, end) = (start, start + offset);
        start = end;
        let mut k = Cursor {
            cpts,
            ini,
            end,
            prev_end: ini,
            out: &mut out,
        };
        let mut pos = ini;
        while pos < end {
            let cpt = k.cpt(pos);
            let flags = k.flags(pos);
            if cpt == '\'' as u32 && pos + 1 < end {
                let n = k.cpt(pos + 1);
                if [b's', b't', b'm', b'd'].iter().any(|&x| n == x as u32) {
                    pos += k.add(pos + 2);
                    continue;
                }
                if pos + 2 < end {
                    let nn = k.cpt(pos + 2);
                    let pair = |a: u8, b: u8| n == a as u32 && nn == b as u32;
                    if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
                        pos += k.add(pos + 3);
                        continue;
                    }
                }
            }
            let sp = cpt == ' ' as u32;
            let mut f2 = if sp { k.flags(pos + 1) } else { flags };
            if is_l(f2) {
                pos += usize::from(sp);
                while is_l(f2) {
                    pos += 1;
                    f2 = k.flags(pos);
                }
                k.add(pos);
                continue;
            }
            if is_n(f2) {
                pos += usize::from(sp);
                while is_n(f2) {
                    pos += 1;
                    f2 = k.flags(pos);
                }
                k.add(pos);
                continue;
            }
            let other = |f: u16| !(is_ws(f) || is_l(f) || is_n(f)) && f != 0;
            if other(f2) {
                pos += usize::from(sp);
                while other(f2) {
                    pos += 1;
                    f2 = k.flags(pos);
                }
                k.add(pos);
                continue;
            }
            let mut nws = 0;
            while is_ws(k.flags(pos + nws)) {
                nws += 1;
            }
            if nws > 1 && k.cpt(pos + nws) != OUT_OF_RANGE {
                pos += nws - 1;
                k.add(pos);
                continue;
            }
            if nws > 0 {
                pos += nws;
                k.add(pos);
                continue;
            }
            pos += 1;
            k.add(pos);
        }
    }
    out
}

/// llama.cpp's `unicode_regex_split_custom_llama3`.
fn split_llama3(cpts: &[char], offsets: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &offset in offsets {
        let (ini, end) = (start, start + offset);
        start = end;
        let mut k = Cursor {
            cpts,
            ini,
            end,
            prev_end: ini,
            out: &mut out,
        };
        let mut pos = ini;
        let (cr, lf) = ('\r' as u32, '\n' as u32);
        while pos < end {
            let cpt = k.cpt(pos);
            let flags = k.flags(pos);
            if cpt == '\'' as u32 && pos + 1 < end {
                let n = to_lower(k.cpt(pos + 1));
                if [b's', b't', b'm', b'd'].iter().any(|&x| n == x as u32) {
                    pos += k.add(pos + 2);
                    continue;
                }
                if pos + 2 < end {
                    let nn = to_lower(k.cpt(pos + 2));
                    let pair = |a: u8, b: u8| n == a as u32 && nn == b as u32;
                    if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
                        pos += k.add(pos + 3);
                        continue;
                    }
                }
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(cpt == cr || cpt == lf || is_n(flags)) && (is_l(flags) || is_l(k.flags(pos + 1))) {
                pos += 1;
                while is_l(k.flags(pos)) {
                    pos += 1;
                }
                k.add(pos);
                continue;
            }
            // \p{N}{1,3}
            if is_n(flags) {
                let mut i0 = pos;
                while is_n(k.flags(pos)) {
                    pos += 1;
                    if pos - i0 >= 3 {
                        k.add(pos);
                        i0 = pos;
                    }
                }
                k.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+[\r\n]*
            let sp = cpt == ' ' as u32;
            let mut f2 = if sp { k.flags(pos + 1) } else { flags };
            let other = |f: u16| !(is_ws(f) || is_l(f) || is_n(f));
            if other(f2) && flags != 0 {
                pos += usize::from(sp);
                while other(f2) && f2 != 0 {
                    pos += 1;
                    f2 = k.flags(pos);
                }
                let mut c2 = k.cpt(pos);
                while c2 == cr || c2 == lf {
                    pos += 1;
                    c2 = k.cpt(pos);
                }
                k.add(pos);
                continue;
            }
            let mut nws = 0;
            let mut last_rn = 0;
            while is_ws(k.flags(pos + nws)) {
                let c2 = k.cpt(pos + nws);
                if c2 == cr || c2 == lf {
                    last_rn = pos + nws + 1;
                }
                nws += 1;
            }
            if last_rn > 0 {
                pos = last_rn;
                k.add(pos);
                continue;
            }
            if nws > 1 && k.cpt(pos + nws) != OUT_OF_RANGE {
                pos += nws - 1;
                k.add(pos);
                continue;
            }
            if nws > 0 {
                pos += nws;
                k.add(pos);
                continue;
            }
            pos += 1;
            k.add(pos);
        }
    }
    out
}

impl BpeState {
    fn new(
        pre: &str,
        cfg: &PreConfig,
        tokens: &[String],
        token_to_id: &HashMap<String, u32>,
        merges: Vec<(String, String)>,
    ) -> Result<BpeState, TokenizerError> {
        let splitter = PreTokenizer::new(pre, cfg.regexes)?;
        let mut ranks: HashMap<String, u32> = HashMap::with_capacity(merges.len());
        let mut hf_merges = Vec::with_capacity(merges.len());
        let mut exact = true;
        for (i, (l, r)) in merges.into_iter().enumerate() {
            let key = format!("{l} {r}");
            if ranks.contains_key(&key) {
                continue; // llama.cpp's `emplace` keeps the first rank
            }
            ranks.insert(key, i as u32);
            let whole = format!("{l}{r}");
            if token_to_id.contains_key(&l)
                && token_to_id.contains_key(&r)
                && token_to_id.contains_key(&whole)
            {
                hf_merges.push((l, r));
            } else {
                exact = false;
            }
        }
        let single_char_tokens: HashSet<char> = tokens
            .iter()
            .filter_map(|t| {
                let mut cs = t.chars();
                match (cs.next(), cs.next()) {
                    (Some(c), None) => Some(c),
                    _ => None,
                }
            })
            .collect();
        let hf = if exact {
            let vocab: BpeVocab = token_to_id.iter().map(|(k, &v)| (k.clone(), v)).collect();
            BPE::builder()
                .vocab_and_merges(vocab, hf_merges)
                .build()
                .ok()
        } else {
            None
        };
        Ok(BpeState {
            splitter,
            ranks,
            ignore_merges: cfg.ignore_merges,
            hf,
            single_char_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufWriter, ValueType};

    fn strs(v: &[&str]) -> Value {
        Value::Array(
            ValueType::String,
            v.iter().map(|s| Value::String(s.to_string())).collect(),
        )
    }

    fn spm_vocab() -> GgufFile {
        // A toy SentencePiece vocabulary: control tokens, byte tokens, and a few pieces.
        let mut toks = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
        let mut types = vec![2, 3, 3];
        let mut scores = vec![0.0f32, 0.0, 0.0];
        for b in 0..256 {
            toks.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for (t, s) in [
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("he", -3.0),
            ("ll", -3.0),
            ("hell", -4.0),
            ("▁hello", -5.0),
            ("▁hell", -6.0),
            ("lo", -1.5),
        ] {
            toks.push(t.to_string());
            types.push(1);
            scores.push(s);
        }
        let mut w = GgufWriter::new();
        w.set("tokenizer.ggml.model", Value::String("llama".into()));
        w.set(
            "tokenizer.ggml.tokens",
            Value::Array(
                ValueType::String,
                toks.into_iter().map(Value::String).collect(),
            ),
        );
        w.set(
            "tokenizer.ggml.scores",
            Value::Array(ValueType::F32, scores.into_iter().map(Value::F32).collect()),
        );
        w.set(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        );
        GgufFile::from_bytes(w.to_bytes()).unwrap()
    }

    #[test]
    fn spm_merges_by_score_and_falls_back_to_bytes() {
        let t = Tokenizer::from_gguf(&spm_vocab()).unwrap();
        assert_eq!(t.kind(), "llama");
        assert!(t.add_bos_default());
        assert_eq!(t.bos_id(), Some(1));
        let ids = t.encode("hello", true).unwrap();
        // "▁hello" has the lowest score of the complete candidates, but SPM merges pair by pair:
        // the best pair first ("lo" −1.5), so "▁hello" can never form.
        let pieces: Vec<String> = ids.iter().map(|&i| t.token_to_piece(i)).collect();
        assert_eq!(ids[0], 1);
        assert_eq!(pieces[1..].concat(), " hello");
        // "z" is no token: byte fallback.
        let z = t.encode("z", false).unwrap();
        assert_eq!(z.len(), 2);
        assert_eq!(t.token_text(z[1]), Some("<0x7A>"));
        assert_eq!(
            t.decode(&t.encode("hello zoo", false).unwrap()),
            "hello zoo"
        );
    }

    #[test]
    fn missing_and_unsupported_keys_are_named() {
        let mut w = GgufWriter::new();
        w.set("tokenizer.ggml.model", Value::String("t5".into()));
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        let e = Tokenizer::from_gguf(&f).unwrap_err().to_string();
        assert!(e.contains("'t5'"), "{e}");

        let f = GgufFile::from_bytes(GgufWriter::new().to_bytes()).unwrap();
        let e = Tokenizer::from_gguf(&f).unwrap_err().to_string();
        assert!(e.contains("tokenizer.ggml.model"), "{e}");

        let mut w = GgufWriter::new();
        w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
        w.set("tokenizer.ggml.pre", Value::String("no-such-pre".into()));
        w.set("tokenizer.ggml.tokens", strs(&["a"]));
        w.set("tokenizer.ggml.merges", strs(&[]));
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        let e = Tokenizer::from_gguf(&f).unwrap_err().to_string();
        assert!(e.contains("'no-such-pre'"), "{e}");

        let mut w = GgufWriter::new();
        w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
        w.set("tokenizer.ggml.tokens", strs(&["a"]));
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        let e = Tokenizer::from_gguf(&f).unwrap_err().to_string();
        assert!(e.contains("tokenizer.ggml.merges"), "{e}");
    }

    #[test]
    fn every_supported_pre_tokenizer_compiles() {
        let names = [
            "default",
            "minicpm5",
            "llama3",
            "llama-bpe",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "spark2_5",
            "youtu",
            "falcon",
            "mpt",
            "starcoder",
            "gpt-2",
            "jais-2",
            "refact",
            "command-r",
            "qwen2",
            "qwen35",
            "stablelm2",
            "olmo",
            "dbrx",
            "smaug-bpe",
            "poro-chat",
            "glm4",
            "viking",
            "jais",
            "tekken",
            "smollm",
            "codeshell",
            "bloom",
            "gpt3-finnish",
            "exaone",
            "exaone4",
            "exaone-moe",
            "chameleon",
            "minerva-7b",
            "megrez",
            "gpt-4o",
            "granite-embed-multi-97m",
            "tiny_aya",
            "trillion",
            "granite-docling",
            "bailingmoe",
            "seed-coder",
            "hunyuan",
            "hunyuan-dense",
            "ufakzeka",
            "grok-2",
            "laguna",
            "minimax-m2",
            "solar-open",
            "mellum2",
            "roberta-bpe",
        ];
        for n in names {
            let cfg = pre_config(n).unwrap_or_else(|| panic!("{n} has no config"));
            let p = PreTokenizer::new(n, cfg.regexes).unwrap_or_else(|e| panic!("{n}: {e}"));
            // Splitting never loses text.
            let s = "Hello, y'all! 3333 ∑ \n\n  x 我想在apple工作 🦙.cpp";
            let words = p.split(s);
            let joined: Vec<u8> = words
                .concat()
                .chars()
                .map(|c| char_to_byte_table()[&c])
                .collect();
            assert_eq!(String::from_utf8(joined).unwrap(), s, "{n}");
        }
    }

    #[test]
    fn collapsed_regex_translation() {
        assert_eq!(translate_regex(r"\p{N}", true).unwrap(), r"[\x{D1}0-9]");
        assert_eq!(
            translate_regex(r"[^\s\p{L}]", true).unwrap(),
            r"[^[:space:]\x{D2}A-Za-z]"
        );
        assert_eq!(
            translate_regex(r"\s+(?!\S)", false).unwrap(),
            r"[[:space:]]+(?![^[:space:]])"
        );
        assert!(translate_regex(r"\p{Han}", true).is_err());
    }

    #[test]
    fn gpt2_custom_split() {
        let cpts: Vec<char> = "Hello world  x's 123\n\n".chars().collect();
        let offs = split_gpt2(&cpts, &[cpts.len()]);
        let mut start = 0;
        let words: Vec<String> = offs
            .iter()
            .map(|&l| {
                let w: String = cpts[start..start + l].iter().collect();
                start += l;
                w
            })
            .collect();
        assert_eq!(words, ["Hello", " world", " ", " x", "'s", " 123", "\n\n"]);
    }

    /// Compares the Unicode tables with ones extracted from a llama.cpp build, when given
    /// (`PARITY_LLAMA_UNICODE_TABLES=/path/tables.json`: `flags` = [[start, flags]…] as in
    /// `unicode_ranges_flags`, `lower` = [[cpt, lower]…] as in `unicode_map_lowercase`, `nfd` =
    /// [[first, last, nfd]…] as in `unicode_ranges_nfd`; read out of libllama.so's read-only data).
    /// Last run against llama-cpp-python 0.3.36's libllama: no differences.
    #[test]
    fn unicode_tables_match_llama_cpp() {
        let Ok(path) = std::env::var("PARITY_LLAMA_UNICODE_TABLES") else {
            return;
        };
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let pairs = |k: &str| -> Vec<Vec<u64>> {
            v[k].as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    e.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap())
                        .collect()
                })
                .collect()
        };
        let flags = pairs("flags");
        let mut diffs = Vec::new();
        for w in flags.windows(2) {
            for c in w[0][0]..w[1][0] {
                let mine = cpt_flags(c as u32) & 0xFF;
                if mine as u64 != w[0][1] & 0xFF {
                    diffs.push((c, w[0][1], mine));
                }
            }
        }
        eprintln!(
            "flags: {} codepoints differ; first: {:x?}",
            diffs.len(),
            &diffs[..diffs.len().min(20)]
        );
        let lower: HashMap<u32, u32> = pairs("lower")
            .iter()
            .map(|p| (p[0] as u32, p[1] as u32))
            .collect();
        let mut ldiff = Vec::new();
        for c in 0..MAX_CODEPOINTS as u32 {
            let want = lower.get(&c).copied().unwrap_or(c);
            if to_lower(c) != want {
                ldiff.push((c, want, to_lower(c)));
            }
        }
        eprintln!(
            "lowercase: {} differ; first: {:x?}",
            ldiff.len(),
            &ldiff[..ldiff.len().min(20)]
        );
        let mut nfd_map: HashMap<u32, u32> = HashMap::new();
        for r in pairs("nfd") {
            for c in r[0]..=r[1] {
                nfd_map.insert(c as u32, r[2] as u32);
            }
        }
        let mut ndiff = Vec::new();
        for c in (0..MAX_CODEPOINTS as u32).filter_map(char::from_u32) {
            let want = nfd_map.get(&(c as u32)).copied().unwrap_or(c as u32);
            if nfd_first(c) as u32 != want {
                ndiff.push((c as u32, want, nfd_first(c) as u32));
            }
        }
        eprintln!(
            "nfd: {} differ; first: {:x?}",
            ndiff.len(),
            &ndiff[..ndiff.len().min(20)]
        );
        assert!(diffs.is_empty() && ldiff.is_empty() && ndiff.is_empty());
    }

    /// The `tokenizers` BPE model is used for the real vocabularies, and gives the same ids as
    /// the transcription of llama.cpp's merge loop on every word of llama.cpp's test strings.
    #[test]
    fn tokenizers_bpe_agrees_with_llama_cpp_merge_loop() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/vocab");
        if !dir.exists() {
            eprintln!("skipped: ../shared/vocab not found");
            return;
        }
        let mut text = String::new();
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "inp") {
                text.push_str(&std::fs::read_to_string(p).unwrap());
            }
        }
        for name in [
            "gpt-2",
            "falcon",
            "mpt",
            "starcoder",
            "refact",
            "deepseek-coder",
            "deepseek-llm",
            "gpt-neox",
            "stablelm",
        ] {
            let f = GgufFile::open(dir.join(format!("ggml-vocab-{name}.gguf"))).unwrap();
            let t = Tokenizer::from_gguf(&f).unwrap();
            let st = t.bpe.as_ref().unwrap();
            let hf = st
                .hf
                .as_ref()
                .unwrap_or_else(|| panic!("{name}: tokenizers BPE not built"));
            let mut words = 0;
            for word in st.splitter.split(&text) {
                if word.is_empty() || !word.chars().all(|c| st.single_char_tokens.contains(&c)) {
                    continue;
                }
                let a: Vec<u32> = hf
                    .tokenize(&word)
                    .unwrap()
                    .into_iter()
                    .map(|t| t.id)
                    .collect();
                let mut b = Vec::new();
                t.bpe_word_by_hand(st, &word, &mut b);
                assert_eq!(a, b, "{name}: {word:?}");
                words += 1;
            }
            assert!(words > 500, "{name}: {words}");
        }
    }

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }

    #[test]
    fn clean_spaces_passes() {
        let mut v = b"Hello , world ! it 's a ' b".to_vec();
        clean_up_spaces(&mut v);
        assert_eq!(String::from_utf8(v).unwrap(), "Hello, world! it's a'b");
    }
}
