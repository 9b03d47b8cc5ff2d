//! Pre-tokenization (llama.cpp's `unicode_regex_split`): the per-`tokenizer.ggml.pre` regex
//! table, the rewriting of its patterns for collapsed text, and the splitter that runs them.

use super::*;

/// The GPT-2 pattern; llama.cpp replaces it by a hand-written splitter (matched by exact text).
pub(super) const R_GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// The LLaMA-3 pattern (case-insensitive contractions spelled out); also hand-written there.
pub(super) const R_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(super) const R_LLAMA3_ORIG: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(super) const R_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(super) const R_CJK_DEEPSEEK: &str = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+";
pub(super) const R_CJK_DEEPSEEK3: &str = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+";
pub(super) const R_PORO: &str =
    r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+";
pub(super) const R_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Per `tokenizer.ggml.pre`: the regexes (in order) and the flags llama.cpp sets with them.
pub(super) struct PreConfig {
    pub(super) regexes: &'static [&'static str],
    pub(super) clean_spaces: Option<bool>,
    pub(super) ignore_merges: bool,
    pub(super) add_bos: bool,
    pub(super) add_sep: bool,
    pub(super) bos_none: bool,
}

/// llama.cpp's `tokenizer_pre` → pre-type → regexes table (`llama-vocab.cpp`).
pub(super) fn pre_config(pre: &str) -> Option<PreConfig> {
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
pub(super) const UCATS: &[&str] = &[
    r"\p{N}", r"\p{L}", r"\p{P}", r"\p{M}", r"\p{S}", r"\p{Lu}", r"\p{Ll}", r"\p{Lt}", r"\p{Lm}",
    r"\p{Lo}",
];

/// Class contents standing for a category in collapsed text: the stand-in codepoint plus the
/// ASCII members llama.cpp assigns (`k_ucat_cpt` and `k_ucat_map`).
pub(super) fn ucat_class(name: &str) -> Option<&'static str> {
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
pub(super) fn translate_regex(expr: &str, collapse: bool) -> Result<String, String> {
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

pub(super) fn push_literal(out: &mut String, ch: char, inside: bool) {
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

pub(super) enum Re {
    Plain(regex::Regex),
    Fancy(SysRegex),
}

impl Re {
    pub(super) fn find_iter(&self, s: &str) -> Vec<(usize, usize)> {
        match self {
            Re::Plain(r) => r.find_iter(s).map(|m| (m.start(), m.end())).collect(),
            Re::Fancy(r) => r.find_iter(s).collect(),
        }
    }
}

pub(super) enum Step {
    Gpt2,
    Llama3,
    Regex { re: Re, collapsed: bool },
}

pub(super) struct PreTokenizer {
    pub(super) steps: Vec<Step>,
}

impl PreTokenizer {
    pub(super) fn new(pre: &str, regexes: &[&str]) -> Result<PreTokenizer, TokenizerError> {
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
    pub(super) fn split(&self, text: &str) -> Vec<String> {
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
pub(super) fn collapse_char(c: char) -> char {
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
pub(super) struct Hay {
    pub(super) s: String,
    pub(super) byte_of: Vec<usize>,
}

impl Hay {
    pub(super) fn new(chars: impl Iterator<Item = char>) -> Hay {
        let mut s = String::new();
        let mut byte_of = Vec::new();
        for c in chars {
            byte_of.push(s.len());
            s.push(c);
        }
        byte_of.push(s.len());
        Hay { s, byte_of }
    }

    pub(super) fn cpt_at(&self, byte: usize) -> usize {
        self.byte_of
            .binary_search(&byte)
            .expect("regex match on a char boundary")
    }

    /// llama.cpp's `unicode_regex_split_stl`: matches and the gaps between them become pieces.
    pub(super) fn split(&self, re: &Re, offsets: &[usize]) -> Vec<usize> {
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
