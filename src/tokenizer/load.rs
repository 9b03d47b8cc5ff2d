//! Building a [`Tokenizer`] from GGUF metadata, in the steps llama.cpp's `llama_vocab::load` takes.

use super::*;

pub(super) const KEY_MODEL: &str = "tokenizer.ggml.model";
pub(super) const KEY_PRE: &str = "tokenizer.ggml.pre";
pub(super) const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
pub(super) const KEY_SCORES: &str = "tokenizer.ggml.scores";
pub(super) const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub(super) const KEY_MERGES: &str = "tokenizer.ggml.merges";
pub(super) const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
pub(super) const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
pub(super) const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
pub(super) const KEY_SEP: &str = "tokenizer.ggml.seperator_token_id";
pub(super) const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
pub(super) const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
pub(super) const KEY_FIM_PRE: [&str; 2] = [
    "tokenizer.ggml.fim_pre_token_id",
    "tokenizer.ggml.prefix_token_id",
];
pub(super) const KEY_FIM_SUF: [&str; 2] = [
    "tokenizer.ggml.fim_suf_token_id",
    "tokenizer.ggml.suffix_token_id",
];
pub(super) const KEY_FIM_MID: [&str; 2] = [
    "tokenizer.ggml.fim_mid_token_id",
    "tokenizer.ggml.middle_token_id",
];
pub(super) const KEY_FIM_PAD: &str = "tokenizer.ggml.fim_pad_token_id";
pub(super) const KEY_FIM_REP: &str = "tokenizer.ggml.fim_rep_token_id";
pub(super) const KEY_FIM_SEP: &str = "tokenizer.ggml.fim_sep_token_id";
pub(super) const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
pub(super) const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
pub(super) const KEY_ADD_SEP: &str = "tokenizer.ggml.add_sep_token";
pub(super) const KEY_ADD_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
pub(super) const KEY_LOWERCASE: &str = "tokenizer.ggml.normalizer.lowercase";
pub(super) const KEY_STRIP_ACCENTS: &str = "tokenizer.ggml.normalizer.strip_accents";

pub(super) fn bad_key(key: &str, what: impl Into<String>) -> TokenizerError {
    TokenizerError::BadKey {
        key: key.to_string(),
        what: what.into(),
    }
}

/// An optional token id key: `Ok(None)` when absent; a non-integer value is refused, a negative
/// one reads as out of range.
pub(super) fn opt_id(f: &GgufFile, key: &str) -> Result<Option<u64>, TokenizerError> {
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
                    format!(
                        "expected an integer token id, found {}",
                        v.value_type().name()
                    ),
                )),
            },
        },
    }
}

pub(super) fn opt_bool(f: &GgufFile, key: &str) -> Result<Option<bool>, TokenizerError> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| {
            bad_key(
                key,
                format!("expected a bool, found {}", v.value_type().name()),
            )
        }),
    }
}

/// The settings llama.cpp's `load` derives per vocabulary type and then from metadata. Ids are
/// i64 so "none" is -1.
struct Settings {
    bos: i64,
    eos: i64,
    unk: i64,
    sep: i64,
    add_space_prefix: bool,
    add_bos: bool,
    add_eos: bool,
    add_sep: bool,
    clean_spaces: bool,
    escape_whitespaces: bool,
}

/// The vocabulary: token texts, their ids, scores and llama.cpp attributes.
struct Vocab {
    tokens: Vec<String>,
    token_to_id: HashMap<String, u32>,
    scores: Vec<f32>,
    attrs: Vec<u32>,
    max_token_len: usize,
}

/// Which special tokens the metadata names (llama.cpp only guesses the others by text).
struct Named {
    eot: bool,
    eom: bool,
    fim: [bool; 6],
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata (vocab-only files work),
    /// following llama.cpp's `llama_vocab::impl::load`: the model kind, the per-kind defaults,
    /// the vocabulary, the merges, the special ids, the attribute fix-ups, then the BPE state.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let (kind, pre, vtype) = model_kind(f)?;
        let (mut set, pre_cfg) = defaults(vtype, pre.as_deref())?;
        if let Some(b) = opt_bool(f, KEY_ADD_PREFIX)? {
            set.add_space_prefix = b;
        }
        let Vocab {
            tokens,
            token_to_id,
            scores,
            mut attrs,
            max_token_len,
        } = read_vocab(f)?;
        let merges = if vtype == VocabType::Bpe {
            read_merges(f)?
        } else {
            Vec::new()
        };
        let named = special_ids(f, tokens.len(), &mut set)?;
        let wpm = wpm_options(f)?;
        mark_special_texts(&token_to_id, &tokens, &mut attrs, &named);
        let mut special_cache: Vec<u32> = (0..tokens.len() as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        // llama.cpp uses an unstable sort; ties (same length) keep id order here.
        special_cache.sort_by(|&a, &b| tokens[b as usize].len().cmp(&tokens[a as usize].len()));
        strip_attributes(f, pre.as_deref(), &token_to_id, &special_cache, &mut attrs);

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
            bos: to_opt(set.bos),
            eos: to_opt(set.eos),
            unk: to_opt(set.unk),
            sep: to_opt(set.sep),
            add_bos: set.add_bos,
            add_eos: set.add_eos,
            add_sep: set.add_sep,
            add_space_prefix: set.add_space_prefix,
            clean_spaces: set.clean_spaces,
            escape_whitespaces: set.escape_whitespaces,
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
}

/// `tokenizer.ggml.model` (and `.pre`) and the vocabulary type they select.
fn model_kind(f: &GgufFile) -> Result<(String, Option<String>, VocabType), TokenizerError> {
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

    Ok((kind, pre, vtype))
}

/// llama.cpp's per-type defaults, and for BPE the `tokenizer.ggml.pre` table's overrides.
fn defaults(
    vtype: VocabType,
    pre: Option<&str>,
) -> Result<(Settings, Option<PreConfig>), TokenizerError> {
    let (bos, eos, unk, sep) = match vtype {
        VocabType::Spm => (1, 2, 0, -1),
        VocabType::Wpm => (101, -1, 100, 102),
        VocabType::Bpe => (11, 11, -1, -1),
    };
    let mut s = Settings {
        bos,
        eos,
        unk,
        sep,
        add_space_prefix: vtype == VocabType::Spm,
        add_bos: vtype != VocabType::Bpe,
        add_eos: false,
        add_sep: vtype == VocabType::Wpm,
        clean_spaces: vtype != VocabType::Spm,
        escape_whitespaces: vtype != VocabType::Bpe,
    };
    if vtype != VocabType::Bpe {
        return Ok((s, None));
    }
    let name = pre.unwrap_or("");
    let cfg = pre_config(name).ok_or_else(|| TokenizerError::UnsupportedPre(name.to_string()))?;
    if let Some(c) = cfg.clean_spaces {
        s.clean_spaces = c;
    }
    s.add_bos |= cfg.add_bos;
    s.add_sep |= cfg.add_sep;
    if cfg.bos_none {
        s.bos = -1;
    }
    Ok((s, Some(cfg)))
}

/// Tokens, scores and token types.
fn read_vocab(f: &GgufFile) -> Result<Vocab, TokenizerError> {
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
                        format!(
                            "expected f32 or i32 scores, found {}",
                            other.value_type().name()
                        ),
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
                        x.as_i64()
                            .ok_or_else(|| bad_key(KEY_TOKEN_TYPE, "expected integer token types"))
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
    Ok(Vocab {
        tokens,
        token_to_id,
        scores,
        attrs,
        max_token_len,
    })
}

/// `tokenizer.ggml.merges` as (left, right) pairs.
fn read_merges(f: &GgufFile) -> Result<Vec<(String, String)>, TokenizerError> {
    let mut merges: Vec<(String, String)> = Vec::new();
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
    Ok(merges)
}

/// Special token ids and the add_* flags: defaults out of range are disabled; a metadata id out
/// of range is ignored (the default stays), as in llama.cpp. Returns which of the EOT, EOM and
/// FIM tokens the metadata names.
fn special_ids(f: &GgufFile, n: usize, set: &mut Settings) -> Result<Named, TokenizerError> {
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
    fix(&mut set.bos, KEY_BOS)?;
    fix(&mut set.eos, KEY_EOS)?;
    fix(&mut set.unk, KEY_UNK)?;
    fix(&mut set.sep, KEY_SEP)?;
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
        set.add_bos = b;
    }
    if let Some(b) = opt_bool(f, KEY_ADD_EOS)? {
        set.add_eos = b;
    }
    if let Some(b) = opt_bool(f, KEY_ADD_SEP)? {
        set.add_sep = b;
    }
    for (flag, id, fk, ik) in [
        (set.add_bos, set.bos, KEY_ADD_BOS, KEY_BOS),
        (set.add_eos, set.eos, KEY_ADD_EOS, KEY_EOS),
        (set.add_sep, set.sep, KEY_ADD_SEP, KEY_SEP),
    ] {
        if flag && id < 0 {
            return Err(TokenizerError::Inconsistent(format!(
                "{fk} is true, but {ik} is not set"
            )));
        }
    }
    Ok(Named {
        eot: has_eot,
        eom: has_eom,
        fim: fim_known,
    })
}

/// WordPiece normalization flags (lowercase; strip accents, by default as lowercase).
fn wpm_options(f: &GgufFile) -> Result<WpmOptions, TokenizerError> {
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
    Ok(wpm)
}

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

/// Attribute fix-ups llama.cpp applies by token text: EOT, EOM, FIM and EOG candidates become
/// control tokens, unused control tokens are marked unused, and a few chat-format tokens are
/// user-defined.
fn mark_special_texts(
    token_to_id: &HashMap<String, u32>,
    tokens: &[String],
    attrs: &mut [u32],
    named: &Named,
) {
    let set_control = |t: &str, attrs: &mut [u32]| {
        if let Some(&id) = token_to_id.get(t) {
            attrs[id as usize] |= ATTR_CONTROL;
        }
    };
    // llama.cpp marks the first EOT/EOM/FIM candidate it meets (hash-map order) as control;
    // every EOT candidate is also an EOG text below, so all of them end up control anyway.
    // For FIM, all candidates are marked (a vocabulary rarely has two of one kind).
    if !named.eot {
        for t in EOT_TEXTS {
            set_control(t, attrs);
        }
    }
    if !named.eom {
        set_control("<|eom_id|>", attrs);
    }
    for (slot, texts) in FIM_TEXTS.iter().enumerate() {
        if !named.fim[slot] {
            for t in *texts {
                set_control(t, attrs);
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
    if (in_eog("<|return|>") && in_eog("<|call|>") || in_eog("<|calls|>") && in_eog("<|flush|>"))
        && in_eog("<|end|>")
    {
        attrs[token_to_id["<|end|>"] as usize] = ATTR_USER_DEFINED;
    }
    if in_eog("<|tool_response>") && in_eog("</s>") {
        attrs[token_to_id["</s>"] as usize] = ATTR_NORMAL;
    }
}

/// Per-token strip attributes set by model name (llama.cpp's "Handle per token attributes").
fn strip_attributes(
    f: &GgufFile,
    pre: Option<&str>,
    token_to_id: &HashMap<String, u32>,
    special_cache: &[u32],
    attrs: &mut [u32],
) {
    let name = f.get_str("general.name").unwrap_or("").to_ascii_lowercase();
    let arch = f.get_str("general.architecture").unwrap_or("");
    let pre_s = pre.unwrap_or("");
    let has_any = |s: &str, subs: &[&str]| subs.iter().any(|x| s.contains(x));
    if has_any(pre_s, &["jina-v2-de", "jina-v2-es", "jina-v2-code"])
        || has_any(arch, &["nomic-bert-moe", "jina-bert-v3"])
    {
        if let Some(&id) = token_to_id.get("<mask>") {
            attrs[id as usize] |= ATTR_LSTRIP;
        }
    } else if has_any(&name, &["phi-3", "phi3"]) {
        for &id in special_cache {
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
}
