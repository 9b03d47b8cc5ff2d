//! `parity inspect` and `parity fixture` as a user runs them: the real binary, its stdout, its
//! stderr and its exit code (0 ok, 2 error with one `error:` line on stderr).
//!
//! Models in `../shared/models` are used when that folder exists; otherwise those parts print
//! "skipped: …" and only the committed fixtures are checked.

use crate::common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Output;

/// Exit 2 and exactly one stderr line, starting with `error:` and containing every `needle`
/// (case-insensitive). Returns that line.
fn assert_error(o: &Output, needles: &[&str], what: &str) -> String {
    assert_eq!(o.status.code(), Some(2), "{what}: want exit 2\n{}", show(o));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{what}: want exactly one stderr line\n{}",
        show(o)
    );
    assert!(lines[0].starts_with("error: "), "{what}: {}", show(o));
    let low = lines[0].to_lowercase();
    for n in needles {
        assert!(
            low.contains(&n.to_lowercase()),
            "{what}: the error should mention {n:?}\n{}",
            show(o)
        );
    }
    assert!(!err.contains("panicked"), "{what}: {}", show(o));
    lines[0].to_string()
}

fn fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("fixtures"))
        .expect("fixtures/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    v.sort();
    assert!(v.len() >= 8, "fixtures/*.gguf: found only {v:?}");
    v
}

fn shared_models() -> Vec<PathBuf> {
    let Some(dir) = shared("models") else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read ../shared/models")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    v.sort();
    v
}

// ---------------------------------------------------------------------------------------------
// An independent GGUF header walker (not parity's reader): where each tensor's offset field is,
// so that a test can corrupt it, and what the header says, to cross-check `inspect --json`.

struct Header {
    version: u32,
    n_kv: u64,
    alignment: u64,
    /// (name, numpy shape, type id, offset, byte position of the offset field)
    tensors: Vec<(String, Vec<u64>, u32, u64, usize)>,
}

struct Walk<'a> {
    b: &'a [u8],
    p: usize,
}

impl Walk<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.b[self.p..self.p + n];
        self.p += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        String::from_utf8(self.take(n).to_vec()).unwrap()
    }
    /// Skip a value of GGUF type `ty`; returns it as u64 when it is an unsigned integer.
    fn value(&mut self, ty: u32) -> Option<u64> {
        match ty {
            0 | 1 | 7 => Some(self.take(1)[0] as u64),
            2 | 3 => Some(u16::from_le_bytes(self.take(2).try_into().unwrap()) as u64),
            4..=6 => Some(self.u32() as u64),
            10..=12 => Some(self.u64()),
            8 => {
                self.string();
                None
            }
            9 => {
                let ety = self.u32();
                let n = self.u64();
                for _ in 0..n {
                    self.value(ety);
                }
                None
            }
            other => panic!("unknown GGUF value type {other}"),
        }
    }
}

fn walk(bytes: &[u8]) -> Header {
    let mut w = Walk { b: bytes, p: 0 };
    assert_eq!(w.take(4), b"GGUF");
    let version = w.u32();
    let n_tensors = w.u64();
    let n_kv = w.u64();
    let mut alignment = 32;
    for _ in 0..n_kv {
        let key = w.string();
        let ty = w.u32();
        let v = w.value(ty);
        if key == "general.alignment" {
            alignment = v.expect("alignment is an integer");
        }
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = w.string();
        let n_dims = w.u32();
        let mut dims: Vec<u64> = (0..n_dims).map(|_| w.u64()).collect();
        dims.reverse();
        let ty = w.u32();
        let at = w.p;
        let offset = w.u64();
        tensors.push((name, dims, ty, offset, at));
    }
    Header {
        version,
        n_kv,
        alignment,
        tensors,
    }
}

// ---------------------------------------------------------------------------------------------

/// Text and JSON output of one model, checked against the header walked independently.
fn check_inspect(path: &Path) {
    let p = path.to_str().unwrap();
    let bytes = std::fs::read(path).unwrap();
    let h = walk(&bytes);

    let o = parity(&["inspect", p]);
    assert_eq!(o.status.code(), Some(0), "inspect {p}\n{}", show(&o));
    assert!(o.stderr.is_empty(), "inspect {p}: stderr\n{}", show(&o));
    let text = stdout(&o);
    let first = text.lines().next().unwrap_or_default();
    assert_eq!(
        first,
        format!(
            "{p}: GGUF v{}, {} bytes, {} metadata keys, {} tensors, alignment {}",
            h.version,
            bytes.len(),
            h.n_kv,
            h.tensors.len(),
            h.alignment
        ),
        "inspect {p}: header line"
    );
    let arch_line = text
        .lines()
        .find(|l| l.starts_with("architecture: "))
        .unwrap_or_else(|| panic!("inspect {p}: no architecture line\n{text}"));
    assert!(
        parity::model::Arch::ALL
            .iter()
            .any(|a| arch_line == format!("architecture: {}", a.name())),
        "inspect {p}: {arch_line}"
    );
    let hp = text
        .lines()
        .find(|l| l.starts_with("hyperparameters: "))
        .unwrap_or_else(|| panic!("inspect {p}: no hyperparameters line\n{text}"));
    for k in [
        "n_vocab ",
        "n_embd ",
        "n_layer ",
        "n_head ",
        "n_head_kv ",
        "n_ff ",
    ] {
        assert!(hp.contains(k), "inspect {p}: {hp} lacks {k}");
    }
    assert!(
        text.lines().any(|l| l.starts_with("tokenizer: ")),
        "inspect {p}: no tokenizer line\n{text}"
    );
    // The tensor table: a header row, then one row per tensor in file order.
    let lines: Vec<&str> = text.lines().collect();
    let hdr = lines
        .iter()
        .position(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w == ["name", "type", "shape", "bytes"]
        })
        .unwrap_or_else(|| panic!("inspect {p}: no tensor table header\n{text}"));
    let rows = &lines[hdr + 1..];
    assert_eq!(
        rows.len(),
        h.tensors.len(),
        "inspect {p}: table rows\n{text}"
    );
    for (row, (name, shape, _, _, _)) in rows.iter().zip(&h.tensors) {
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[0], name, "inspect {p}: row {row}");
        let shape_s = format!("{shape:?}").replace(' ', "");
        assert_eq!(
            cells[2..cells.len() - 1].join(""),
            shape_s,
            "inspect {p}: shape of {name}"
        );
    }

    let o = parity(&["inspect", "--json", p]);
    assert_eq!(o.status.code(), Some(0), "inspect --json {p}\n{}", show(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("inspect --json {p}: not JSON ({e})\n{}", show(&o)));
    assert_eq!(j["gguf_version"], h.version, "{p}");
    assert_eq!(j["file_bytes"], bytes.len(), "{p}");
    assert_eq!(
        j["architecture"].as_str(),
        Some(arch_line.trim_start_matches("architecture: ")),
        "{p}"
    );
    assert!(j["config"].is_object(), "{p}: config {}", j["config"]);
    assert!(j["config"]["n_embd"].as_u64().unwrap() > 0, "{p}");
    let tensors = j["tensors"].as_array().expect("tensors array");
    assert_eq!(tensors.len(), h.tensors.len(), "{p}: tensor count");
    let mut sum = 0;
    for (t, (name, shape, _, offset, _)) in tensors.iter().zip(&h.tensors) {
        assert_eq!(t["name"].as_str(), Some(name.as_str()), "{p}");
        let js: Vec<u64> = serde_json::from_value(t["shape"].clone()).unwrap();
        assert_eq!(&js, shape, "{p}: {name}");
        assert_eq!(t["offset"].as_u64(), Some(*offset), "{p}: {name}");
        assert!(t["type"].is_string(), "{p}: {name}");
        let b = t["bytes"].as_u64().expect("bytes");
        assert!(b > 0, "{p}: {name}");
        sum += b;
    }
    assert_eq!(j["tensor_bytes"].as_u64(), Some(sum), "{p}");
}

#[test]
fn inspect_every_fixture() {
    for f in fixtures() {
        let rel = f.strip_prefix(root()).unwrap().to_path_buf();
        check_inspect(&rel);
    }
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models, vocab)")]
fn inspect_every_shared_model() {
    let models = shared_models();
    if models.is_empty() {
        eprintln!("skipped: no ../shared/models/*.gguf");
        return;
    }
    for m in models {
        check_inspect(&m);
    }
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models, vocab)")]
fn inspect_vocab_only_file() {
    let Some(dir) = shared("vocab") else { return };
    let p = dir.join("ggml-vocab-llama-spm.gguf");
    let o = parity(&["inspect", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let text = stdout(&o);
    assert!(
        text.contains("hyperparameters: none (vocab-only file)"),
        "{text}"
    );
    assert!(
        text.contains("tokenizer: llama (pre default) with 32000 tokens"),
        "{text}"
    );
}

/// A temp copy of `src` with `edit` applied.
fn corrupt(dir: &Path, name: &str, src: &Path, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut b = std::fs::read(src).unwrap();
    edit(&mut b);
    let p = dir.join(name);
    std::fs::write(&p, b).unwrap();
    p
}

#[test]
fn truncated_files_are_refused_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let src = root().join("fixtures/tiny-llama-q8_0.gguf");
    let bytes = std::fs::read(&src).unwrap();
    let len = bytes.len();
    let h = walk(&bytes);
    let last_field = h.tensors.last().unwrap().4;
    // Cut points: inside the magic, the version, the counts, the metadata, the tensor index, at
    // the end of the index, inside the data section and one byte short.
    let cuts = [
        0,
        3,
        4,
        8,
        16,
        23,
        24,
        100,
        1000,
        5000,
        last_field + 4,
        last_field + 8,
        len / 2,
        len - 1,
    ];
    for cut in cuts {
        let p = corrupt(tmp.path(), &format!("cut{cut}.gguf"), &src, |b| {
            b.truncate(cut)
        });
        let o = parity(&["inspect", p.to_str().unwrap()]);
        let line = assert_error(&o, &[], &format!("cut at {cut}"));
        assert!(
            o.stdout.is_empty(),
            "cut at {cut}: partial output\n{}",
            show(&o)
        );
        let l = line.to_lowercase();
        assert!(
            l.contains("truncated") || l.contains("cannot fit") || l.contains("past the end"),
            "cut at {cut}: the error should say the file is cut short: {line}"
        );
        if cut > last_field + 8 {
            // Cut inside the data: names the tensor whose data is missing.
            assert!(l.contains("tensor '"), "cut at {cut}: {line}");
        }
    }
}

#[test]
fn bad_magic_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = root().join("fixtures/tiny-llama-q8_0.gguf");
    let p = corrupt(tmp.path(), "magic.gguf", &src, |b| {
        b[..4].copy_from_slice(b"GGML")
    });
    let o = parity(&["inspect", p.to_str().unwrap()]);
    assert_error(&o, &["not a GGUF file", "magic"], "bad magic");
    // Not a GGUF at all (a text file).
    let p = tmp.path().join("notes.gguf");
    std::fs::write(&p, "hello, this is not a model\n").unwrap();
    let o = parity(&["inspect", p.to_str().unwrap()]);
    assert_error(&o, &["not a GGUF file"], "text file");
}

#[test]
fn tensor_offset_past_the_end_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = root().join("fixtures/tiny-llama-q8_0.gguf");
    let bytes = std::fs::read(&src).unwrap();
    let h = walk(&bytes);
    let len = bytes.len() as u64;
    let set = |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());

    // The first tensor's data moved just past the end of the file (aligned, so only the range
    // check can catch it).
    let (name, _, _, _, at) = h.tensors[0].clone();
    let past = len.div_ceil(h.alignment) * h.alignment;
    let p = corrupt(tmp.path(), "past.gguf", &src, |b| set(b, at, past));
    let o = parity(&["inspect", p.to_str().unwrap()]);
    assert_error(
        &o,
        &[&format!("tensor '{name}'"), "past the end"],
        "offset past end",
    );

    // An offset near u64::MAX (aligned): no overflow, no panic.
    let (name, _, _, _, at) = h.tensors.last().unwrap().clone();
    let huge = u64::MAX / h.alignment * h.alignment;
    let p = corrupt(tmp.path(), "huge.gguf", &src, |b| set(b, at, huge));
    let o = parity(&["inspect", p.to_str().unwrap()]);
    assert_error(
        &o,
        &[&format!("tensor '{name}'"), "past the end"],
        "huge offset",
    );

    // A misaligned offset.
    let (name, _, _, off, at) = h.tensors[3].clone();
    let p = corrupt(tmp.path(), "misaligned.gguf", &src, |b| set(b, at, off + 1));
    let o = parity(&["inspect", p.to_str().unwrap()]);
    assert_error(
        &o,
        &[&format!("tensor '{name}'"), "aligned"],
        "misaligned offset",
    );

    // Two tensors over the same bytes.
    let (_, _, _, off0, _) = h.tensors[1].clone();
    let (_, _, _, _, at2) = h.tensors[2].clone();
    let p = corrupt(tmp.path(), "overlap.gguf", &src, |b| set(b, at2, off0));
    let o = parity(&["inspect", p.to_str().unwrap()]);
    assert_error(&o, &["overlap"], "overlapping tensors");
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models, vocab)")]
fn legacy_gguf_v1_is_refused() {
    let Some(dir) = shared("legacy") else { return };
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "gguf") {
            continue;
        }
        n += 1;
        let o = parity(&["inspect", p.to_str().unwrap()]);
        assert_error(&o, &["version 1"], &p.display().to_string());
        assert!(o.stdout.is_empty(), "{}", show(&o));
    }
    assert!(n > 0, "../shared/legacy has no .gguf");
}

#[test]
fn missing_file_is_an_error() {
    let o = parity(&["inspect", "fixtures/no-such-model.gguf"]);
    assert_error(&o, &["fixtures/no-such-model.gguf"], "missing file");
}

// ---------------------------------------------------------------------------------------------
// parity fixture

fn make_fixture(dir: &Path, name: &str, args: &[&str]) -> Vec<u8> {
    let out = dir.join(name);
    let mut a = vec!["fixture", "--out", out.to_str().unwrap()];
    a.extend_from_slice(args);
    let o = parity(&a);
    assert_eq!(o.status.code(), Some(0), "fixture {args:?}\n{}", show(&o));
    std::fs::read(&out).unwrap()
}

#[test]
fn fixture_is_deterministic_and_seeded() {
    let tmp = tempfile::tempdir().unwrap();
    let args = [
        "--arch", "llama", "--type", "q4_k", "--seed", "11", "--n-embd", "256", "--n-ff", "256",
    ];
    let a = make_fixture(tmp.path(), "a.gguf", &args);
    let b = make_fixture(tmp.path(), "b.gguf", &args);
    assert!(a == b, "same arguments, different bytes");
    let mut other = args;
    other[5] = "12";
    let c = make_fixture(tmp.path(), "c.gguf", &other);
    assert_eq!(
        a.len(),
        c.len(),
        "a seed changes the values, not the layout"
    );
    assert!(a != c, "seed 11 and seed 12 wrote the same bytes");
    // The written file is a valid model that inspect accepts.
    let o = parity(&["inspect", tmp.path().join("a.gguf").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    // And qwen2 is seeded too.
    let q = ["--arch", "qwen2", "--type", "q8_0", "--seed", "3"];
    let q1 = make_fixture(tmp.path(), "q1.gguf", &q);
    let q2 = make_fixture(tmp.path(), "q2.gguf", &q);
    assert!(q1 == q2, "qwen2: same arguments, different bytes");
}

/// The FIXTURES table of scripts/make_fixtures.sh: (name, arch, type, extra args).
fn make_fixtures_table() -> Vec<(String, String, String, Vec<String>)> {
    let script = std::fs::read_to_string(root().join("scripts/make_fixtures.sh")).unwrap();
    let start = script
        .find("FIXTURES=(")
        .expect("FIXTURES=( in make_fixtures.sh");
    let body = &script[start..];
    let body = &body[..body.find("\n)").expect("end of FIXTURES")];
    let mut out = Vec::new();
    for line in body.lines().skip(1) {
        let line = line.trim();
        if !line.starts_with('"') {
            continue;
        }
        let w: Vec<String> = line
            .trim_matches('"')
            .split_whitespace()
            .map(String::from)
            .collect();
        out.push((w[0].clone(), w[1].clone(), w[2].clone(), w[3..].to_vec()));
    }
    // The seed the script passes to every fixture.
    assert!(
        script.contains("--seed 7 $dims"),
        "make_fixtures.sh no longer uses --seed 7: update this test"
    );
    out
}

#[test]
fn committed_fixtures_are_reproducible() {
    let table = make_fixtures_table();
    let tmp = tempfile::tempdir().unwrap();
    // Every committed fixture comes from the script.
    for f in fixtures() {
        let stem = f.file_stem().unwrap().to_str().unwrap().to_string();
        assert!(
            table.iter().any(|(n, ..)| *n == stem),
            "{} is not made by scripts/make_fixtures.sh",
            f.display()
        );
    }
    for (name, arch, ty, dims) in &table {
        let mut args: Vec<&str> = vec!["--arch", arch, "--type", ty, "--seed", "7"];
        args.extend(dims.iter().map(String::as_str));
        let fresh = make_fixture(tmp.path(), &format!("{name}.gguf"), &args);
        let committed = std::fs::read(root().join(format!("fixtures/{name}.gguf")))
            .unwrap_or_else(|e| panic!("fixtures/{name}.gguf: {e}"));
        assert!(
            fresh == committed,
            "fixtures/{name}.gguf differs from a fresh `parity fixture {}` ({} vs {} bytes): the generator changed; rerun scripts/make_fixtures.sh (and the goldens)",
            args.join(" "),
            fresh.len(),
            committed.len()
        );
    }
}

#[test]
fn committed_q8_0_fixture_matches_the_documented_command() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = make_fixture(
        tmp.path(),
        "t.gguf",
        &[
            "--arch", "llama", "--type", "q8_0", "--seed", "7", "--n-embd", "256", "--n-ff", "256",
        ],
    );
    let committed = std::fs::read(root().join("fixtures/tiny-llama-q8_0.gguf")).unwrap();
    assert!(fresh == committed, "fixtures/tiny-llama-q8_0.gguf is stale");
}

#[test]
fn fixture_bad_type_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gguf");
    let o = parity(&["fixture", "--out", out.to_str().unwrap(), "--type", "q9_9"]);
    assert_error(&o, &["q9_9"], "unknown type");
    assert!(!out.exists());
}

#[test]
fn inspect_snapshot_q4_k() {
    let o = parity(&["inspect", "fixtures/tiny-llama-q4_k.gguf"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    insta::assert_snapshot!("inspect_tiny_llama_q4_k", stdout(&o));
}
