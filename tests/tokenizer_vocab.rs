//! Tokenizer parity with llama.cpp on llama.cpp's own tokenizer test vocabularies
//! (`../shared/vocab/ggml-vocab-NAME.gguf` + `.inp` + `.out`, as read by llama.cpp's
//! `tests/test-tokenizer-0.cpp`), plus a real model file (`../shared/models/stories260K.gguf`),
//! and the ids every parity command makes from a prompt (BOS/EOS, BERT's [CLS] … [SEP])
//! against the real llama.cpp's `llama_tokenize(add_special = true)`.
//! Without `../shared` (or llama.cpp) the tests that need them show as ignored (build.rs probes).

use std::path::{Path, PathBuf};

use parity::gguf::{GgufFile, GgufWriter, Value};
use parity::model::tokenizer::Tokenizer;

fn shared(sub: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("shared")
        .join(sub);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: ../shared/{sub} not found");
        None
    }
}

fn vocab_dir() -> Option<PathBuf> {
    shared("vocab")
}

fn load(dir: &std::path::Path, name: &str) -> Tokenizer {
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The test cases exactly as llama.cpp's `read_tests` splits them: inputs separated by
/// "\n__ggml_vocab_test__\n" (so each input keeps its own inner newlines), expected ids one line
/// each, space-separated, no BOS.
fn read_tests(dir: &std::path::Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let base = dir.join(format!("ggml-vocab-{name}.gguf"));
    let inp = std::fs::read_to_string(base.with_extension("gguf.inp")).expect("read .inp");
    let out = std::fs::read_to_string(base.with_extension("gguf.out")).expect("read .out");
    const SEP: &str = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < inp.len() {
        match inp[pos..].find(SEP) {
            None => {
                inputs.push(inp[pos..].to_string());
                break;
            }
            Some(n) => {
                inputs.push(inp[pos..pos + n].to_string());
                pos += n + SEP.len();
            }
        }
    }
    let outputs: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.trim()
                .split(' ')
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out disagree on the number of tests"
    );
    inputs.into_iter().zip(outputs).collect()
}

/// (passed, total, first few failures).
fn run_vocab(dir: &std::path::Path, name: &str) -> (usize, usize, Vec<String>) {
    let tok = load(dir, name);
    let tests = read_tests(dir, name);
    let mut passed = 0;
    let mut failures = Vec::new();
    for (text, want) in &tests {
        let got = tok
            .encode(text, false)
            .unwrap_or_else(|e| panic!("{name}: encode({text:?}): {e}"));
        if &got == want {
            passed += 1;
        } else if failures.len() < 5 {
            failures.push(format!("{text:?}\n    want {want:?}\n    got  {got:?}"));
        }
    }
    (passed, tests.len(), failures)
}

fn assert_all_pass(name: &str) {
    let Some(dir) = vocab_dir() else { return };
    let (passed, total, failures) = run_vocab(&dir, name);
    assert_eq!(
        passed,
        total,
        "{name}: {passed}/{total} strings match llama.cpp; failures:\n{}",
        failures.join("\n")
    );
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn llama_spm_matches_llama_cpp() {
    assert_all_pass("llama-spm");
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn gpt2_matches_llama_cpp() {
    assert_all_pass("gpt-2");
}

/// Every vocabulary with test strings; all of them reach 100%.
const VOCABS: &[&str] = &[
    "llama-spm",
    "phi-3",
    "gpt-2",
    "falcon",
    "mpt",
    "starcoder",
    "refact",
    "deepseek-coder",
    "deepseek-llm",
    "bert-bge",
];

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn every_vocab_pass_rate() {
    let Some(dir) = vocab_dir() else { return };
    let mut report = Vec::new();
    let mut bad = Vec::new();
    for name in VOCABS {
        let (passed, total, failures) = run_vocab(&dir, name);
        report.push(format!("{name}: {passed}/{total}"));
        if passed != total {
            bad.push(format!(
                "{name}: {passed}/{total}\n  {}",
                failures.join("\n  ")
            ));
        }
    }
    eprintln!("tokenizer parity with llama.cpp: {}", report.join(", "));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Vocabularies without test strings in ../shared: ids checked against llama.cpp itself
/// (llama-cpp-python 0.3.36, `Llama(model_path=…, vocab_only=True).tokenize(text, add_bos=False,
/// special=False)`).
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn vocabs_without_test_files_match_llama_cpp() {
    let Some(dir) = vocab_dir() else { return };
    let cases: &[(&str, &str, &[u32])] = &[
        ("baichuan", "Hello world", &[24568, 1275]),
        (
            "baichuan",
            " Hello world\n\n  x",
            &[31106, 24568, 1275, 5, 5, 31106, 2759],
        ),
        ("gpt-neox", "Hello world", &[12092, 1533]),
        (
            "gpt-neox",
            " Hello world\n\n  x",
            &[24387, 1533, 535, 50276, 89],
        ),
        ("stablelm", "Hello world", &[12092, 1533]),
        (
            "stablelm",
            " Hello world\n\n  x",
            &[24387, 1533, 535, 50276, 89],
        ),
    ];
    for (name, text, want) in cases {
        let tok = load(&dir, name);
        assert_eq!(tok.encode(text, false).unwrap(), *want, "{name}: {text:?}");
    }
    // add_bos follows the vocabulary: baichuan (SPM) has a BOS, gpt-neox's BOS is token 0.
    let tok = load(&dir, "baichuan");
    assert_eq!(tok.encode("Hello world", true).unwrap(), [1, 24568, 1275]);
    assert!(tok.add_bos_default());
    let tok = load(&dir, "gpt-neox");
    assert!(!tok.add_bos_default());
    assert_eq!(tok.bos_id(), Some(0));
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn dbrx_duplicate_key_is_refused_by_name() {
    let Some(dir) = vocab_dir() else { return };
    let err = GgufFile::open(dir.join("ggml-vocab-dbrx.gguf"))
        .expect_err("dbrx vocab has a duplicate key");
    assert!(
        matches!(err, parity::gguf::GgufError::DuplicateKey(ref k) if k == "general.file_type"),
        "{err:?}"
    );
    assert!(err.to_string().contains("general.file_type"), "{err}");
}

/// decode(encode(s)) == s. llama.cpp's detokenizer drops the SPM space prefix again; for gpt-2
/// its `clean_spaces` pass rewrites " 's", " ," … so those strings do not round-trip in
/// llama.cpp either (checked with llama-cpp-python's `llama_detokenize`).
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn decode_round_trips() {
    let Some(dir) = vocab_dir() else { return };
    for name in ["llama-spm", "gpt-2"] {
        let tok = load(&dir, name);
        let mut checked = 0;
        for (text, want) in read_tests(&dir, name) {
            let ids = tok.encode(&text, false).unwrap();
            assert_eq!(ids, want);
            let back = tok.decode(&ids);
            if name == "gpt-2" && cleaned_by_llama_cpp(&text) {
                assert_ne!(
                    back, text,
                    "{name}: {text:?} was expected to be changed by clean_spaces"
                );
                continue;
            }
            assert_eq!(back, text, "{name}: round trip of {text:?}");
            checked += 1;
        }
        assert!(checked > 30, "{name}: only {checked} strings round-tripped");
    }
}

/// The strings llama.cpp's `clean_spaces` detokenizer pass changes: " ?", " !", " .", " ,",
/// " ' ", " 's", " 'm", " 're", " 've".
fn cleaned_by_llama_cpp(s: &str) -> bool {
    let b = s.as_bytes();
    (1..b.len()).any(|i| {
        b[i - 1] == b' '
            && (matches!(b[i], b'?' | b'!' | b'.' | b',')
                || (b[i] == b'\''
                    && i + 1 < b.len()
                    && (matches!(b[i + 1], b' ' | b's' | b'm')
                        || (i + 2 < b.len() && matches!(&b[i + 1..i + 3], b"re" | b"ve")))))
    })
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn decode_with_bos_and_pieces() {
    let Some(dir) = vocab_dir() else { return };
    let tok = load(&dir, "llama-spm");
    let ids = tok.encode("Hello world", true).unwrap();
    assert_eq!(ids, [1, 15043, 3186]);
    // As llama.cpp's detokenizer: the BOS renders as nothing but uses up the space-prefix strip.
    assert_eq!(tok.decode(&ids), " Hello world");
    assert_eq!(tok.token_to_piece(1), "<s>");
    assert_eq!(tok.token_to_piece(15043), " Hello");
    assert_eq!(tok.kind(), "llama");
    assert_eq!(tok.vocab_size(), 32000);
    let tok = load(&dir, "gpt-2");
    assert_eq!(tok.kind(), "gpt2");
    assert_eq!(tok.pre(), Some("gpt-2"));
    assert_eq!(tok.token_to_piece(18435), " Hello");
    assert_eq!(
        tok.decode(&tok.encode(" this is 🦙.cpp", false).unwrap()),
        " this is 🦙.cpp"
    );
}

/// A real model file. The ids were produced by llama.cpp itself:
/// `llama_cpp.Llama(model_path="stories260K.gguf", vocab_only=True).tokenize(b"Once upon a time")`
/// → [1, 403, 407, 261, 378] (llama-cpp-python 0.3.36; `add_bos=False` gives [403, 407, 261, 378]).
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn stories260k_matches_llama_cpp() {
    let Some(models) = shared("models") else {
        return;
    };
    let path = models.join("stories260K.gguf");
    if !path.exists() {
        eprintln!("skipped: {} not found", path.display());
        return;
    }
    let f = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    assert_eq!(tok.kind(), "llama");
    assert_eq!(tok.vocab_size(), 512);
    assert!(tok.add_bos_default());
    assert_eq!(
        tok.encode("Once upon a time", true).unwrap(),
        [1, 403, 407, 261, 378]
    );
    assert_eq!(
        tok.encode("Once upon a time", false).unwrap(),
        [403, 407, 261, 378]
    );
    assert_eq!(tok.decode(&[403, 407, 261, 378]), "Once upon a time");
}

/// Cross-check against a corpus made by the real llama.cpp (scripts/tokenizer_oracle.py, run
/// here on every vocabulary of ../shared/vocab; or a corpus of your own named by
/// `PARITY_TOKENIZER_ORACLE=FILE`): llama.cpp's test strings plus seeded random strings mixing
/// scripts, whitespace kinds, digits, emoji, combining marks, control/private-use/unassigned
/// codepoints and special-token texts. Each case holds llama.cpp's `llama_tokenize` ids plain,
/// with `add_special` and with `parse_special`, and its `llama_detokenize` bytes of the plain
/// ids and of the `parse_special` ids (`remove_special`, `unparse_special`); parity must give
/// every one of them. A vocabulary llama.cpp refuses must be one parity refuses too.
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab)")]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama.cpp (llama-cpp-python) in .venv or $PARITY_PYTHON"
)]
fn oracle_corpus_matches_llama_cpp() {
    let Some(dir) = vocab_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let path = match std::env::var_os("PARITY_TOKENIZER_ORACLE") {
        Some(p) => PathBuf::from(p),
        None => {
            let out = tmp.path().join("oracle.json");
            let o = std::process::Command::new(python())
                .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/tokenizer_oracle.py"))
                .arg(&dir)
                .arg(&out)
                .output()
                .expect("run scripts/tokenizer_oracle.py");
            assert!(
                o.status.success(),
                "tokenizer_oracle.py: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            out
        }
    };
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let refused = json["refused"].as_object().unwrap();
    for name in refused.keys() {
        let p = dir.join(format!("ggml-vocab-{name}.gguf"));
        let loaded = GgufFile::open(&p)
            .map_err(|e| e.to_string())
            .and_then(|f| Tokenizer::from_gguf(&f).map_err(|e| e.to_string()));
        assert!(
            loaded.is_err(),
            "llama.cpp refuses {name} ({}), parity loads it",
            refused[name]
        );
    }
    let vocabs = json["vocabs"].as_object().unwrap();
    assert!(
        vocabs.len() >= 10,
        "the corpus covers {} vocabularies",
        vocabs.len()
    );
    let mut bad = Vec::new();
    for (name, v) in vocabs {
        let tok = load(&dir, name);
        let cases = v["cases"].as_array().unwrap();
        let (mut enc_ok, mut spec_ok, mut dec_ok) = (0, 0, 0);
        for c in cases {
            let text = c["text"].as_str().unwrap();
            let ids: Vec<u32> = c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let spec: Vec<u32> = c["ids_add_special"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let dec: Vec<u8> = c["decoded"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u8)
                .collect();
            let got = tok.encode(text, false).unwrap();
            if got == ids {
                enc_ok += 1;
            } else if bad.len() < 20 {
                bad.push(format!(
                    "{name} encode {text:?}\n    want {ids:?}\n    got  {got:?}"
                ));
            }
            let got = tok.encode_llama(text, true, false).unwrap();
            if got == spec {
                spec_ok += 1;
            } else if bad.len() < 20 {
                bad.push(format!(
                    "{name} encode_llama(add_special) {text:?}\n    want {spec:?}\n    got  {got:?}"
                ));
            }
            if let Some(parse) = c.get("ids_parse_special") {
                let parse: Vec<u32> = parse
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect();
                let got = tok.encode_llama(text, false, true).unwrap();
                if got != parse && bad.len() < 20 {
                    bad.push(format!("{name} encode_llama(parse_special) {text:?}\n    want {parse:?}\n    got  {got:?}"));
                }
                let dec2: Vec<u8> = c["decoded_special"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u8)
                    .collect();
                let got = tok.detokenize_bytes(&parse, true, true);
                if got != dec2 && bad.len() < 20 {
                    bad.push(format!(
                        "{name} detokenize(remove_special, unparse_special) {parse:?}\n    want {:?}\n    got  {:?}",
                        String::from_utf8_lossy(&dec2),
                        String::from_utf8_lossy(&got)
                    ));
                }
            }
            let got = tok.detokenize_bytes(&ids, false, false);
            if got == dec {
                dec_ok += 1;
            } else if bad.len() < 20 {
                bad.push(format!(
                    "{name} decode {ids:?}\n    want {:?}\n    got  {:?}",
                    String::from_utf8_lossy(&dec),
                    String::from_utf8_lossy(&got)
                ));
            }
        }
        let n = cases.len();
        eprintln!(
            "{name}: encode {enc_ok}/{n}, encode(add_special) {spec_ok}/{n}, decode {dec_ok}/{n}"
        );
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// BERT's WordPiece vocabulary: llama.cpp wraps every prompt in [CLS] … [SEP] (its
/// `add_special`), and so does every parity command that tokenizes a prompt. Checked on every
/// test string of llama.cpp's own bert-bge file (its `.out` ids are the text alone).
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
fn bert_prompts_get_cls_and_sep() {
    let Some(dir) = vocab_dir() else { return };
    let tok = load(&dir, "bert-bge");
    let (cls, sep) = (
        tok.token_id("[CLS]").unwrap(),
        tok.token_id("[SEP]").unwrap(),
    );
    assert_eq!((cls, sep), (101, 102));
    assert_eq!(tok.special_ends(), (Some(cls), Some(sep)));
    let tests = read_tests(&dir, "bert-bge");
    assert!(tests.len() > 30);
    for (text, want) in &tests {
        let full = [&[cls], &want[..], &[sep]].concat();
        assert_eq!(
            tok.encode_special(text, true, true).unwrap(),
            full,
            "{text:?}"
        );
        assert_eq!(
            tok.encode_llama(text, true, false).unwrap(),
            full,
            "{text:?}"
        );
        assert_eq!(tok.encode_special(text, false, false).unwrap(), *want);
    }
}

/// The ids the real llama.cpp makes with `llama_tokenize(text, add_special = true)` for each
/// text, from a vocabulary file (llama-cpp-python, `vocab_only`).
fn llama_cpp_ids(vocab: &Path, texts: &[String]) -> Vec<Vec<u32>> {
    const SCRIPT: &str = r#"
import json, sys, llama_cpp
texts = json.load(sys.stdin)
l = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([l.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in texts]))
"#;
    let mut child = std::process::Command::new(python())
        .args(["-c", SCRIPT])
        .arg(vocab)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run python");
    serde_json::to_writer(child.stdin.take().unwrap(), texts).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "llama.cpp tokenization failed");
    serde_json::from_slice(&out.stdout).expect("ids as JSON")
}

fn python() -> PathBuf {
    std::env::var_os("PARITY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"))
}

/// `path`'s metadata and tensors, with `edits` applied to the metadata, written to `to`.
fn rewrite_gguf(path: &Path, to: &Path, edits: &[(&str, Value)]) {
    let f = GgufFile::open(path).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in &f.metadata {
        w.set(k, v.clone());
    }
    for (k, v) in edits {
        w.set(k, v.clone());
    }
    for t in &f.tensors {
        w.add_tensor(&t.name, &t.dims, t.ty, f.tensor_data(t).to_vec());
    }
    w.write(to).unwrap();
}

/// The prompt ids of every parity command equal the real llama.cpp's `add_special` ids: on
/// the BERT vocabulary ([CLS] … [SEP]), on SentencePiece and BPE vocabularies as they come,
/// and on the same vocabularies rewritten with `tokenizer.ggml.add_eos_token = true` (EOS
/// appended), with `add_bos_token = false`, and with `add_sep_token = true` (which llama.cpp
/// 0.3.36 does not act on outside WordPiece; neither does parity).
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama.cpp (llama-cpp-python) in .venv or $PARITY_PYTHON"
)]
fn prompt_ids_match_llama_cpp_add_special() {
    let Some(dir) = vocab_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for name in ["bert-bge", "llama-spm", "gpt-2", "phi-3"] {
        let src = dir.join(format!("ggml-vocab-{name}.gguf"));
        let texts: Vec<String> = read_tests(&dir, name)
            .into_iter()
            .map(|(t, _)| t)
            .take(40)
            .collect();
        let variants: Vec<(&str, Vec<(&str, Value)>)> = vec![
            ("as is", vec![]),
            (
                "add_eos",
                vec![("tokenizer.ggml.add_eos_token", Value::Bool(true))],
            ),
            (
                "add_sep",
                vec![
                    ("tokenizer.ggml.add_sep_token", Value::Bool(true)),
                    ("tokenizer.ggml.seperator_token_id", Value::U32(13)),
                ],
            ),
            (
                "add_eos, no add_bos",
                vec![
                    ("tokenizer.ggml.add_eos_token", Value::Bool(true)),
                    ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
                ],
            ),
        ];
        // BERT's [CLS]/[SEP] ignore the flags (and it has no EOS to append).
        let n = if name == "bert-bge" {
            1
        } else {
            variants.len()
        };
        for (what, edits) in variants.into_iter().take(n) {
            let path = tmp.path().join(format!("{name}-{checked}.gguf"));
            rewrite_gguf(&src, &path, &edits);
            let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
            let want = llama_cpp_ids(&path, &texts);
            for (text, want) in texts.iter().zip(&want) {
                let got = tok.encode_special(text, true, true).unwrap();
                assert_eq!(&got, want, "{name} ({what}): {text:?}");
            }
            if what.starts_with("add_eos") {
                // The rewritten vocabulary does append its EOS.
                let eos = tok.eos_id().unwrap();
                assert_eq!(want[0].last(), Some(&eos), "{name} ({what})");
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 13);
}

/// Every `tokenizer.ggml.pre` parity has a regex table for (src/tokenizer/pre.rs).
const PRE_TYPES: &[&str] = &[
    "default",
    "minicpm5",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "hunyuan-dense",
    "hy_v4",
    "joyai-llm",
    "spark2_5",
    "youtu",
    "falcon",
    "mpt",
    "olmo",
    "jais",
    "exaone4",
    "starcoder",
    "refact",
    "codeshell",
    "exaone",
    "minerva-7b",
    "mellum2",
    "command-r",
    "smollm",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "trillion",
    "granite-docling",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "jais-2",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "hunyuan",
    "solar-open",
    "grok-2",
    "megrez",
    "stablelm2",
    "qwen35",
    "dbrx",
    "smaug-bpe",
    "poro-chat",
    "bloom",
    "gpt3-finnish",
    "glm4",
    "chatglm-bpe",
    "viking",
    "tekken",
    "chameleon",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
    "granite-embed-multi-97m",
    "tiny_aya",
    "cohere2moe",
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
    "seed-coder",
    "ufakzeka",
    "laguna",
    "exaone-moe",
];

/// Strings where the pre-tokenizer regexes disagree: digit runs (`\p{N}` vs `\p{N}{1,3}` vs
/// one digit), contractions in both cases, letters with marks, CJK, runs of newlines and
/// whitespace, punctuation runs.
const PRE_PROBES: &[&str] = &[
    "12345678",
    "1234567 89 0",
    "I'm you'll",
    "I'M YOU'LL they'Re we'VE",
    "naïve café Ωμέγα",
    "nai\u{308}ve",
    "日本語テキスト",
    "中文 한국어 ひらがな",
    "a\n\n  b\t\tc",
    "\n\n\n",
    "x \r\n y",
    "   leading and trailing   ",
    "hello...world!!",
    "(a+b)/2 == c; // ok?",
    "HelloWORLD camelCase",
    "🦙.cpp 🦙🦙",
];

/// For each file: llama.cpp's `tokenize(text, add_bos=False, special=False)` ids of every
/// text, or `None` where llama.cpp refuses to load the file (llama-cpp-python, `vocab_only`).
fn llama_cpp_plain_ids(files: &[PathBuf], texts: &[String]) -> Vec<Option<Vec<Vec<u32>>>> {
    const SCRIPT: &str = r#"
import json, sys, llama_cpp
req = json.load(sys.stdin)
out = []
for path in req["files"]:
    try:
        l = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    except Exception:
        out.append(None)
        continue
    out.append([l.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in req["texts"]])
    del l
print(json.dumps(out))
"#;
    let mut child = std::process::Command::new(python())
        .args(["-c", SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run python");
    let req = serde_json::json!({ "files": files, "texts": texts });
    serde_json::to_writer(child.stdin.take().unwrap(), &req).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "llama.cpp tokenization failed");
    serde_json::from_slice(&out.stdout).expect("ids as JSON")
}

/// The pre-tokenizer regexes of every `tokenizer.ggml.pre` parity knows, against the real
/// llama.cpp: the gpt-2 byte-level BPE vocabulary rewritten to each pre-type (llama3's
/// "llama-bpe", "qwen2", …), tokenizing every gpt-2 test string plus `PRE_PROBES`. Pre-types
/// llama.cpp 0.3.36 does not know (it refuses the file) are listed and skipped; llama-bpe and
/// qwen2 must load.
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama.cpp (llama-cpp-python) in .venv or $PARITY_PYTHON"
)]
fn pre_tokenizers_on_gpt2_vocab_match_llama_cpp() {
    let Some(dir) = vocab_dir() else { return };
    let src = dir.join("ggml-vocab-gpt-2.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let mut texts: Vec<String> = read_tests(&dir, "gpt-2")
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    texts.extend(PRE_PROBES.iter().map(|s| s.to_string()));
    // A made-up pre-type last: llama.cpp must refuse it, or a refusal would not be seen.
    let files: Vec<PathBuf> = PRE_TYPES
        .iter()
        .chain(&["no-such-pre"])
        .map(|pre| {
            let path = tmp.path().join(format!("gpt-2-{pre}.gguf"));
            rewrite_gguf(
                &src,
                &path,
                &[
                    ("tokenizer.ggml.pre", Value::String(pre.to_string())),
                    // jina-v1-en, jina-v2-code and roberta-bpe turn on add_sep, and parity
                    // refuses an add_sep without a separator id (llama.cpp 0.3.36 loads it);
                    // unused here, as no special tokens are added.
                    ("tokenizer.ggml.seperator_token_id", Value::U32(50256)),
                ],
            );
            path
        })
        .collect();
    let want = llama_cpp_plain_ids(&files, &texts);
    assert_eq!(want.len(), PRE_TYPES.len() + 1);
    assert!(
        want[PRE_TYPES.len()].is_none(),
        "llama.cpp loaded pre = no-such-pre"
    );
    // The rewrite reaches llama.cpp: its ids for a digit run differ between gpt-2 (`\p{N}+`),
    // llama-bpe (`\p{N}{1,3}`) and qwen2 (`\p{N}`).
    let digits = texts.iter().position(|t| t == "12345678").unwrap();
    let ids_of = |pre: &str| {
        let i = PRE_TYPES.iter().position(|p| *p == pre).unwrap();
        want[i].as_ref().map(|w| w[digits].clone())
    };
    let (g, l, q) = (ids_of("gpt-2"), ids_of("llama-bpe"), ids_of("qwen2"));
    assert!(g != l && l != q && g != q, "{g:?} {l:?} {q:?}");
    let (mut compared, mut unknown, mut bad) = (Vec::new(), Vec::new(), Vec::new());
    for ((pre, path), want) in PRE_TYPES.iter().zip(&files).zip(&want) {
        let Some(want) = want else {
            unknown.push(*pre);
            continue;
        };
        let tok = Tokenizer::from_gguf(&GgufFile::open(path).unwrap())
            .unwrap_or_else(|e| panic!("{pre}: {e}"));
        assert_eq!(tok.pre(), Some(*pre));
        let mut ok = 0;
        for (text, want) in texts.iter().zip(want) {
            let got = tok.encode(text, false).unwrap();
            if &got == want {
                ok += 1;
            } else if bad.len() < 20 {
                bad.push(format!(
                    "{pre}: {text:?}\n    want {want:?}\n    got  {got:?}"
                ));
            }
        }
        compared.push(format!("{pre} {ok}/{}", texts.len()));
    }
    eprintln!(
        "pre-tokenizers on the gpt-2 vocabulary vs llama.cpp: {}",
        compared.join(", ")
    );
    if !unknown.is_empty() {
        eprintln!(
            "not known to this llama.cpp (skipped): {}",
            unknown.join(", ")
        );
    }
    for must in ["llama-bpe", "qwen2", "gpt-2"] {
        assert!(!unknown.contains(&must), "llama.cpp refused pre = {must}");
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The SentencePiece vocabulary under gemma's architecture name (the `llama.*` hyperparameters
/// copied to `gemma.*`, as llama.cpp reads them even for `vocab_only`), as is and with
/// `add_space_prefix = false` as gemma files carry it: parity's ids equal llama.cpp's on every
/// llama-spm test string plus `PRE_PROBES`.
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (vocab and models)")]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama.cpp (llama-cpp-python) in .venv or $PARITY_PYTHON"
)]
fn spm_vocab_as_gemma_matches_llama_cpp() {
    let Some(dir) = vocab_dir() else { return };
    let src = dir.join("ggml-vocab-llama-spm.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let mut texts: Vec<String> = read_tests(&dir, "llama-spm")
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    texts.extend(PRE_PROBES.iter().map(|s| s.to_string()));
    let f = GgufFile::open(&src).unwrap();
    let hparams: Vec<(String, Value)> = f
        .metadata
        .iter()
        .filter_map(|(k, v)| Some((format!("gemma.{}", k.strip_prefix("llama.")?), v.clone())))
        .collect();
    assert!(
        hparams.len() > 5,
        "llama-spm has its llama.* hyperparameters"
    );
    let mut files = Vec::new();
    for space_prefix in [None, Some(false)] {
        let mut edits: Vec<(&str, Value)> = hparams
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        edits.push(("general.architecture", Value::String("gemma".into())));
        if let Some(b) = space_prefix {
            edits.push(("tokenizer.ggml.add_space_prefix", Value::Bool(b)));
        }
        let path = tmp.path().join(format!("gemma-{}.gguf", files.len()));
        rewrite_gguf(&src, &path, &edits);
        files.push(path);
    }
    let want = llama_cpp_plain_ids(&files, &texts);
    for (path, want) in files.iter().zip(&want) {
        let want = want
            .as_ref()
            .unwrap_or_else(|| panic!("llama.cpp refused {}", path.display()));
        let tok = Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap();
        assert_eq!(tok.kind(), "llama");
        for (text, want) in texts.iter().zip(want) {
            let got = tok.encode(text, false).unwrap();
            assert_eq!(&got, want, "{}: {text:?}", path.display());
        }
    }
    // The flag reaches llama.cpp: without the space prefix, "Hello" is not " Hello".
    let hello = texts.iter().position(|t| t == "Hello world").unwrap();
    let (a, b) = (want[0].as_ref().unwrap(), want[1].as_ref().unwrap());
    assert_ne!(a[hello], b[hello]);
    eprintln!(
        "llama-spm as gemma vs llama.cpp: {} strings x 2 variants",
        texts.len()
    );
}
