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
//! * The ids around the text ([`Tokenizer::special_ends`]) are llama.cpp's `add_special` ones:
//!   BOS when `add_bos_token`, EOS when `add_eos_token`, and for WordPiece always [CLS] … [SEP].
//!   Every parity command makes a prompt's ids with [`Tokenizer::encode_special`].
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

impl Tokenizer {
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
    /// the vocabulary's own BOS/EOS/SEP policy applies ([`Tokenizer::special_ends`]).
    pub fn encode_llama(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let (first, last) = if add_special {
            self.special_ends()
        } else {
            (None, None)
        };
        let mut out = Vec::new();
        out.extend(first);
        self.tokenize_fragments(text, parse_special, &mut out)?;
        out.extend(last);
        Ok(out)
    }

    /// The ids llama.cpp's `llama_tokenize(text, add_special = true)` puts before and after the
    /// text. SentencePiece and BPE vocabularies: BOS when `add_bos_token`, EOS when
    /// `add_eos_token` (each when the vocabulary has that token). WordPiece (BERT): always its
    /// [CLS] (the BOS id) first and [SEP] last, whatever the flags say.
    pub fn special_ends(&self) -> (Option<u32>, Option<u32>) {
        match self.vtype {
            VocabType::Spm | VocabType::Bpe => (
                self.bos.filter(|_| self.add_bos),
                self.eos.filter(|_| self.add_eos),
            ),
            VocabType::Wpm => (self.bos, self.sep),
        }
    }

    /// `text` as llama.cpp's `llama_tokenize(text, add_special = true, parse_special = false)`
    /// tokenizes it, with either special end left out on request (`--no-bos`, `--no-eos`).
    /// This is how every parity command turns a prompt into ids.
    pub fn encode_special(
        &self,
        text: &str,
        first: bool,
        last: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let (f, l) = self.special_ends();
        let mut out = Vec::new();
        out.extend(f.filter(|_| first));
        self.tokenize_fragments(text, false, &mut out)?;
        out.extend(l.filter(|_| last));
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

mod bpe;
mod load;
mod pre;
mod split;
mod spm;
#[cfg(test)]
mod tests;
mod unicode;
mod wpm;

use bpe::BpeState;
use pre::*;
use split::*;
use unicode::*;
use wpm::*;
