//! The house order of docs/architecture.md, read from the source: each top-level module of
//! src/ is a room, and a room imports only rooms below it, so no room imports one that imports
//! it back. `arch` is two floors: its spec (spec.rs and one data file per architecture) lies
//! below `model`, which reads it; the forward and its graph (mod.rs, transformer.rs) lie above
//! `model`, whose weights they run. Unit tests (`#[cfg(test)]` code) may reach up: a test of
//! the graph runs a backend.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top to bottom: a room may import only rooms after it.
const ORDER: &[&str] = &[
    "cli",
    "selftest",
    "check",
    "golden",
    "report",
    "judge",
    "compare",
    "backend",
    "arch",
    "trace",
    "model",
    "arch::spec",
    "tokenizer",
    "gguf",
    // crates/parity-quant, re-exported as `parity::quant`: a crate of its own, it cannot
    // import parity back.
    "quant",
];

/// The files of the forward's floor of `arch`; every other file of src/arch is its spec.
/// size.rs sums the forward's taps at their shapes (mod.rs's `tap_dims`, `records`).
const ARCH_FORWARD: &[&str] = &["mod", "transformer", "size"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The room of a file: its top-level module, with `arch` split in two floors.
fn room_of_file(rel: &Path) -> Option<String> {
    let parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    match parts[0].as_str() {
        "lib" | "main" => None,
        "arch" if !ARCH_FORWARD.contains(&parts[parts.len() - 1].as_str()) => {
            Some("arch::spec".into())
        }
        top => Some(top.into()),
    }
}

/// The room a `crate::a::b…` path lands in.
fn room_of_path(segs: &[String]) -> String {
    match (segs[0].as_str(), segs.get(1)) {
        ("arch", Some(sub))
            if !ARCH_FORWARD.contains(&sub.as_str())
                && src().join("arch").join(format!("{sub}.rs")).exists() =>
        {
            "arch::spec".into()
        }
        (top, _) => top.into(),
    }
}

/// The code without comments and without `#[cfg(test)]` items.
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let line = line.split("//").next().unwrap_or("");
        if line.trim() == "#[cfg(test)]" {
            // Skip the item that follows: through its matching brace, or its `;`.
            let mut depth = 0i32;
            for l in lines.by_ref() {
                let l = l.split("//").next().unwrap_or("");
                depth += l.matches('{').count() as i32 - l.matches('}').count() as i32;
                if depth <= 0 && (l.contains('}') || l.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Every path after a `root::` (`crate`, `super`, `self`) at `s`, brace groups expanded
/// (`crate::{a::b, c}`); a leading `super::super::` stays in the path.
fn paths_after(s: &str, root: &str) -> Vec<Vec<String>> {
    fn tree(s: &[u8], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let mut segs = prefix;
        loop {
            while *i < s.len() && s[*i].is_ascii_whitespace() {
                *i += 1;
            }
            if *i < s.len() && s[*i] == b'{' {
                *i += 1;
                loop {
                    tree(s, i, segs.clone(), out);
                    while *i < s.len() && s[*i].is_ascii_whitespace() {
                        *i += 1;
                    }
                    match s.get(*i) {
                        Some(b',') => *i += 1,
                        Some(b'}') => {
                            *i += 1;
                            return;
                        }
                        _ => return,
                    }
                    while *i < s.len() && s[*i].is_ascii_whitespace() {
                        *i += 1;
                    }
                    if s.get(*i) == Some(&b'}') {
                        *i += 1;
                        return;
                    }
                }
            }
            let start = *i;
            while *i < s.len() && (s[*i].is_ascii_alphanumeric() || s[*i] == b'_') {
                *i += 1;
            }
            if *i > start {
                segs.push(String::from_utf8_lossy(&s[start..*i]).into_owned());
            }
            if s[*i..].starts_with(b"::") {
                *i += 2;
                continue;
            }
            if !segs.is_empty() {
                out.push(segs);
            }
            return;
        }
    }
    let mut out = Vec::new();
    let b = s.as_bytes();
    let head = format!("{root}::");
    for (at, _) in s.match_indices(head.as_str()) {
        // Not the tail of a longer name or path (`super::super::`, `my_crate::`).
        let prev = at.checked_sub(1).map(|p| b[p]);
        if prev.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':') {
            continue;
        }
        let mut i = at + head.len();
        tree(b, &mut i, Vec::new(), &mut out);
    }
    out
}

/// Every path a `crate::` at `s` names, brace groups expanded (`crate::{a::b, c}`).
fn paths(s: &str) -> Vec<Vec<String>> {
    paths_after(s, "crate")
}

/// room → (room it imports → the first file that does).
fn graph() -> BTreeMap<String, BTreeMap<String, String>> {
    let mut files = Vec::new();
    rs_files(&src(), &mut files);
    files.sort();
    let mut g: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src()).unwrap();
        let Some(room) = room_of_file(rel) else {
            continue;
        };
        let text = std::fs::read_to_string(&f).unwrap();
        for p in paths(&code(&text)) {
            let to = room_of_path(&p);
            if to != room && to != "self" && to != "super" {
                g.entry(room.clone())
                    .or_default()
                    .entry(to)
                    .or_insert_with(|| rel.display().to_string());
            }
        }
    }
    g
}

#[test]
fn the_reader_sees_imports_as_written() {
    let got = paths(
        "use crate::{arch::{self, spec::Bias}, model::Model};\nx = $crate::quant::tile::x86::f();",
    );
    let want: Vec<Vec<&str>> = vec![
        vec!["arch", "self"],
        vec!["arch", "spec", "Bias"],
        vec!["model", "Model"],
        vec!["quant", "tile", "x86", "f"],
    ];
    assert_eq!(got, want);
    let c = code(
        "use crate::a::B; // crate::c\n#[cfg(test)]\nmod tests {\n    use crate::d;\n    fn f() { g() }\n}\nuse crate::e;\n",
    );
    assert_eq!(paths(&c), vec![vec!["a", "B"], vec!["e"]]);
    assert_eq!(room_of_path(&["arch".into(), "llama".into()]), "arch::spec");
    assert_eq!(room_of_path(&["arch".into(), "Ops".into()]), "arch");
}

#[test]
fn every_room_imports_only_rooms_below_it() {
    let g = graph();
    let rank = |r: &str| ORDER.iter().position(|o| *o == r);
    let rooms: BTreeSet<&String> = g.keys().chain(g.values().flat_map(|t| t.keys())).collect();
    for r in rooms {
        assert!(
            rank(r).is_some(),
            "room {r} is not in ORDER: place it in tests/house_order.rs and docs/architecture.md"
        );
    }
    let mut wrong = Vec::new();
    for (from, tos) in &g {
        for (to, file) in tos {
            if rank(to) <= rank(from) {
                let back = g
                    .get(to)
                    .and_then(|t| t.get(from))
                    .map(|f| format!(", and {f} imports {from} back"))
                    .unwrap_or_default();
                wrong.push(format!(
                    "{file}: {from} imports {to}, a room above it{back}"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The module path of a source file: `judge/replay.rs` is `judge::replay`, `judge/mod.rs` is
/// `judge`, `lib.rs` and `main.rs` the crate root.
fn module_of(rel: &Path) -> Vec<String> {
    let mut m: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        m.pop();
    }
    m
}

/// file → the files its `crate::`, `super::` and `self::` paths land in (the longest prefix
/// of each path that is a module file). A parent's `mod child;` and its `pub use child::…`
/// re-exports are the module tree, not imports: a file is a module of its parent.
fn file_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rs_files(src, &mut files);
    files.sort();
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(src).unwrap();
            (module_of(rel), rel.display().to_string())
        })
        .collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap();
        let me = module_of(rel);
        let name = rel.display().to_string();
        let text = code(&std::fs::read_to_string(f).unwrap());
        for root in ["crate", "super", "self"] {
            for p in paths_after(&text, root) {
                let mut full: Vec<String> = match root {
                    "crate" => Vec::new(),
                    "self" => me.clone(),
                    _ => me[..me.len().saturating_sub(1)].to_vec(),
                };
                let mut rest = p.as_slice();
                while let Some((first, tail)) = rest.split_first()
                    && first == "super"
                {
                    full.pop();
                    rest = tail;
                }
                full.extend(rest.iter().filter(|s| *s != "self").cloned());
                let target = (1..=full.len()).rev().find_map(|n| modules.get(&full[..n]));
                if let Some(t) = target.filter(|t| **t != name) {
                    g.entry(name.clone()).or_default().insert(t.clone());
                }
            }
        }
    }
    g
}

/// No file imports one that imports it back, directly or through others, in parity or in the
/// crates it is built on.
#[test]
fn no_circle_of_files() {
    let g = file_graph(&src());
    // A file the test cannot see into would hide circles: the reader sees the known imports.
    assert!(
        g.get("judge/rounding.rs")
            .is_some_and(|t| t.contains("judge/replay.rs")),
        "{g:?}"
    );
    assert!(
        g.get("arch/registry.rs")
            .is_some_and(|t| t.contains("arch/llama.rs") && t.contains("arch/spec.rs")),
        "{g:?}"
    );
    assert_no_circle(&g);
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let g = file_graph(&crates.join("parity-quant/src"));
    assert!(
        g.get("q4_k.rs").is_some_and(|t| t.contains("q8_k.rs")),
        "{g:?}"
    );
    assert_no_circle(&g);
    let g = file_graph(&crates.join("parity-trace/src"));
    assert!(!g.is_empty(), "{g:?}");
    assert_no_circle(&g);
}

/// Each import edge a → b is checked for a way back from b to a.
fn assert_no_circle(g: &BTreeMap<String, BTreeSet<String>>) {
    let back = |from: &str, to: &str| -> Option<Vec<String>> {
        // Breadth-first from `from`, the path kept, until `to`.
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([from.to_string()]);
        while let Some(x) = queue.pop_front() {
            if x == to {
                let mut path = vec![x.clone()];
                let mut at = x;
                while let Some(p) = prev.get(&at) {
                    path.push(p.clone());
                    at = p.clone();
                }
                path.reverse();
                return Some(path);
            }
            for y in g.get(&x).into_iter().flatten() {
                if !prev.contains_key(y) && y != from {
                    prev.insert(y.clone(), x.clone());
                    queue.push_back(y.clone());
                }
            }
        }
        None
    };
    let mut circles = Vec::new();
    for (a, tos) in g {
        for b in tos {
            if let Some(path) = back(b, a) {
                circles.push(format!("{a} -> {}", path.join(" -> ")));
            }
        }
    }
    assert!(
        circles.is_empty(),
        "circles of files:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_file_reader_resolves_relative_paths() {
    let got = paths_after("use super::super::a::{b, c::D};\nuse super::e;", "super");
    let want: Vec<Vec<&str>> = vec![
        vec!["super", "a", "b"],
        vec!["super", "a", "c", "D"],
        vec!["e"],
    ];
    assert_eq!(got, want);
    assert_eq!(module_of(Path::new("judge/mod.rs")), vec!["judge"]);
    assert_eq!(
        module_of(Path::new("judge/replay.rs")),
        vec!["judge", "replay"]
    );
}
