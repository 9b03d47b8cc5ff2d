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

/// llama.cpp's `add_special`: BOS when `add_bos_token`, EOS when `add_eos_token` (each end
/// can be left out), and the flags' defaults for SentencePiece (BOS yes, EOS no).
#[test]
fn special_ends_follow_add_bos_and_add_eos() {
    let t = Tokenizer::from_gguf(&spm_vocab()).unwrap();
    assert_eq!(t.special_ends(), (Some(1), None));
    let body = t.encode("hello", false).unwrap();
    assert_eq!(
        t.encode_special("hello", true, true).unwrap(),
        [&[1], &body[..]].concat()
    );
    let f = spm_vocab();
    let mut w = GgufWriter::new();
    for (k, v) in &f.metadata {
        w.set(k, v.clone());
    }
    w.set("tokenizer.ggml.add_eos_token", Value::Bool(true));
    w.set("tokenizer.ggml.eos_token_id", Value::U32(2));
    let t = Tokenizer::from_gguf(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap();
    assert_eq!(t.special_ends(), (Some(1), Some(2)));
    let all = t.encode_special("hello", true, true).unwrap();
    assert_eq!(all, [&[1], &body[..], &[2]].concat());
    assert_eq!(all, t.encode_llama("hello", true, false).unwrap());
    assert_eq!(
        t.encode_special("hello", false, true).unwrap(),
        [&body[..], &[2]].concat()
    );
    assert_eq!(
        t.encode_special("hello", true, false).unwrap(),
        [&[1], &body[..]].concat()
    );
    assert_eq!(t.encode_special("", true, true).unwrap(), [1, 2]);
    w.set("tokenizer.ggml.add_bos_token", Value::Bool(false));
    let t = Tokenizer::from_gguf(&GgufFile::from_bytes(w.to_bytes()).unwrap()).unwrap();
    assert_eq!(t.special_ends(), (None, Some(2)));
    assert_eq!(
        t.encode_special("hello", true, true).unwrap(),
        [&body[..], &[2]].concat()
    );
}
