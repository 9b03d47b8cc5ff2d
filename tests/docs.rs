//! The command blocks of docs/*.md run as written, so the docs cannot drift from the tool.
//!
//! A *command block* is a fenced block in `sh`, `bash`, `shell` or `console`, or an unlabelled
//! block whose lines start with a `$ ` prompt. Each one either runs here (every line, in a
//! scratch folder laid out like the repository, must exit 0) or is marked in the doc on the
//! line before its fence with `<!-- not run: REASON -->`. Output, file contents and
//! synopses go in ```text blocks. The README's walkthrough is run by tests/readme.rs.
//!
//! The scratch folder has `fixtures/` and `scripts/` (links to the repository's),
//! `golden/tiny-llama-q8_0` (the committed golden), `golden/mine` (a copy of it) and `trace`
//! (parity's dump replaying it); `parity` on PATH is the binary under test and
//! `.venv/bin/python` the Python with numpy that build.rs found (no `python3` is added to PATH:
//! the docs run scripts with the venv's Python, as a newcomer's system Python may lack numpy).
//! Blocks that use the gpu backend run where build.rs found a Vulkan driver (cfg
//! `parity_gpu`), e.g. lavapipe.

use crate::common;

use common::root;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Command blocks of docs that other work owns, not marked in the doc yet: (file, first line of
/// the block, why it is not run).
const NOT_RUN_ELSEWHERE: &[(&str, &str, &str)] = &[];

struct Block {
    file: String,
    /// 1-based line of the opening fence.
    line: usize,
    lang: String,
    lines: Vec<String>,
    /// The `<!-- not run: … -->` reason, if marked.
    not_run: Option<String>,
}

impl Block {
    fn is_command(&self) -> bool {
        matches!(self.lang.as_str(), "sh" | "bash" | "shell" | "console")
            || (self.lang.is_empty() && self.lines.iter().any(|l| l.starts_with("$ ")))
    }

    /// The commands: `$ ` lines of a transcript, else every line (a `\` joins the next).
    fn script(&self) -> String {
        let prompts = self.lines.iter().any(|l| l.starts_with("$ "));
        let lines: Vec<&str> = self
            .lines
            .iter()
            .filter_map(|l| {
                if prompts {
                    l.strip_prefix("$ ")
                } else {
                    Some(l.as_str())
                }
            })
            .collect();
        lines.join("\n") + "\n"
    }

    fn needs(&self, tool: &str) -> bool {
        self.lines.iter().any(|l| {
            l.split_whitespace()
                .any(|w| w == tool || w.starts_with(tool) || w.rsplit('/').next() == Some(tool))
        })
    }

    /// Runs the gpu backend (or asks for the adapter): it needs a Vulkan driver.
    fn needs_gpu(&self) -> bool {
        self.lines.iter().any(|l| l.contains("gpu"))
    }

    fn name(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

/// docs/*.md, sorted.
fn doc_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    files.sort();
    files
}

fn blocks() -> Vec<Block> {
    let mut out = Vec::new();
    for p in doc_files() {
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let file = format!("docs/{}", p.file_name().unwrap().to_string_lossy());
        let mut i = 0;
        while i < lines.len() {
            let Some(lang) = lines[i].trim_start().strip_prefix("```") else {
                i += 1;
                continue;
            };
            let start = i;
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                body.push(lines[i].to_string());
                i += 1;
            }
            let not_run = start
                .checked_sub(1)
                .and_then(|j| lines[j].trim().strip_prefix("<!-- not run:"))
                .and_then(|r| r.strip_suffix("-->"))
                .map(|r| r.trim().to_string());
            out.push(Block {
                file: file.clone(),
                line: start + 1,
                lang: lang.trim().to_string(),
                lines: body,
                not_run,
            });
            i += 1;
        }
    }
    out
}

fn elsewhere(b: &Block) -> Option<&'static str> {
    NOT_RUN_ELSEWHERE
        .iter()
        .find(|(f, first, _)| *f == b.file && b.lines.first().is_some_and(|l| l.starts_with(first)))
        .map(|(_, _, why)| *why)
}

/// The blocks that run, with those that need `tool` (jq, python) kept or left out.
fn runnable(keep: impl Fn(&Block) -> bool) -> Vec<Block> {
    blocks()
        .into_iter()
        .filter(|b| b.is_command() && b.not_run.is_none() && elsewhere(b).is_none())
        .filter(keep)
        .collect()
}

fn python() -> PathBuf {
    common::python()
}

/// The scratch folder the blocks run in (see the module comment).
fn scratch() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    use std::os::unix::fs::symlink;
    symlink(root().join("fixtures"), d.join("fixtures")).unwrap();
    symlink(root().join("scripts"), d.join("scripts")).unwrap();
    std::fs::create_dir(d.join("golden")).unwrap();
    symlink(
        root().join("golden/tiny-llama-q8_0"),
        d.join("golden/tiny-llama-q8_0"),
    )
    .unwrap();
    common::copy_dir(
        &root().join("golden/tiny-llama-q8_0"),
        &d.join("golden/mine"),
    );
    std::fs::create_dir(d.join("bin")).unwrap();
    symlink(env!("CARGO_BIN_EXE_parity"), d.join("bin/parity")).unwrap();
    // The checkout's venv, as the docs name it (`.venv/bin/python`): a newcomer's `python3`
    // may have no numpy, so none is put on PATH here. A wrapper, not a link: a venv's Python
    // finds its packages from its own path.
    std::fs::create_dir_all(d.join(".venv/bin")).unwrap();
    {
        let p = d.join(".venv/bin/python");
        std::fs::write(
            &p,
            format!("#!/bin/sh\nexec '{}' \"$@\"\n", python().display()),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let o = sh(
        d,
        "parity dump fixtures/tiny-llama-q8_0.gguf --golden golden/mine --out trace\n",
    );
    assert!(o.status.success(), "setup: {}", common::show(&o));
    tmp
}

fn sh(dir: &Path, script: &str) -> std::process::Output {
    let path = format!(
        "{}:{}",
        dir.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("bash")
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(dir)
        .env("PATH", path)
        .env("PARITY_GOLDEN_DIR", dir.join("user-goldens"))
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn run_all(blocks: Vec<Block>, at_least: usize) {
    assert!(
        blocks.len() >= at_least,
        "only {} blocks to run: {:?}",
        blocks.len(),
        blocks.iter().map(Block::name).collect::<Vec<_>>()
    );
    let mut failed = Vec::new();
    for b in &blocks {
        // Each block in its own scratch folder: none depends on another's leftovers.
        let tmp = scratch();
        let o = sh(tmp.path(), &b.script());
        if o.status.success() {
            eprintln!("ok    {}", b.name());
        } else {
            eprintln!("FAIL  {}\n{}\n{}", b.name(), b.script(), common::show(&o));
            failed.push(b.name());
        }
    }
    assert!(failed.is_empty(), "doc blocks that fail: {failed:?}");
}

/// Every command block is run or says why not: a new one cannot slip in unrun.
#[test]
fn every_command_block_runs_or_says_why_not() {
    let all = blocks();
    assert!(all.len() > 20, "{} blocks found", all.len());
    let mut unmarked = Vec::new();
    let mut runs = 0;
    for b in all.iter().filter(|b| b.is_command()) {
        let why = b.not_run.as_deref().or_else(|| elsewhere(b));
        match why {
            Some("") => unmarked.push(format!("{}: empty reason", b.name())),
            Some(why) => eprintln!("not run  {}: {why}", b.name()),
            None => runs += 1,
        }
    }
    for (f, first, _) in NOT_RUN_ELSEWHERE {
        assert!(
            all.iter()
                .any(|b| b.file == *f && b.lines.first().is_some_and(|l| l.starts_with(first))),
            "{f}: no block starting with {first:?} any more: update NOT_RUN_ELSEWHERE"
        );
    }
    // A bare block of `parity …` lines reads as a command block: give it a language.
    for b in all.iter().filter(|b| b.lang.is_empty() && !b.is_command()) {
        if b.lines.iter().any(|l| l.starts_with("parity "))
            && b.not_run.is_none()
            && elsewhere(b).is_none()
        {
            unmarked.push(format!(
                "{}: unlabelled block of parity commands (```sh to run it, ```text if it is not a command)",
                b.name()
            ));
        }
    }
    assert!(unmarked.is_empty(), "{}", unmarked.join("\n"));
    assert!(runs >= 4, "{runs} command blocks run");
}

#[test]
fn doc_command_blocks_run() {
    run_all(
        runnable(|b| !b.needs("jq") && !b.needs("python") && !b.needs_gpu()),
        1,
    );
}

#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn doc_command_blocks_with_gpu_run() {
    run_all(
        runnable(|b| !b.needs("jq") && !b.needs("python") && b.needs_gpu()),
        1,
    );
}

#[test]
#[cfg_attr(not(parity_numpy), ignore = "needs numpy in .venv or $PARITY_PYTHON")]
fn doc_command_blocks_with_python_run() {
    run_all(runnable(|b| !b.needs("jq") && b.needs("python")), 1);
}

#[test]
#[cfg_attr(not(parity_jq), ignore = "needs jq (apt-get install jq)")]
fn doc_command_blocks_with_jq_run() {
    run_all(runnable(|b| b.needs("jq")), 2);
}

/// The four tests above split the runnable blocks between them (plain, gpu, python, jq), each
/// block in exactly one, and together they are every unmarked command fence of docs/*.md,
/// counted here from the raw text by a scan of its own: a parser or a filter that stopped
/// finding blocks fails here, where each test alone would still pass on one block.
#[test]
fn the_block_tests_cover_every_unmarked_command_fence() {
    let groups = [
        runnable(|b| !b.needs("jq") && !b.needs("python") && !b.needs_gpu()),
        runnable(|b| !b.needs("jq") && !b.needs("python") && b.needs_gpu()),
        runnable(|b| !b.needs("jq") && b.needs("python")),
        runnable(|b| b.needs("jq")),
    ];
    let mut names: Vec<String> = groups.iter().flatten().map(Block::name).collect();
    let covered = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), covered, "a block in two groups: {names:?}");

    let mut raw = Vec::new();
    for p in doc_files() {
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut open: Option<(usize, String)> = None;
        let mut prompt = false;
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            match (&open, t.starts_with("```")) {
                (None, true) => {
                    open = Some((i, t.trim_start_matches('`').trim().to_string()));
                    prompt = false;
                }
                (Some((start, lang)), true) => {
                    let marked = *start > 0 && lines[start - 1].trim().starts_with("<!-- not run:");
                    let command = ["sh", "bash", "shell", "console"].contains(&lang.as_str())
                        || (lang.is_empty() && prompt);
                    let file = format!("docs/{}", p.file_name().unwrap().to_string_lossy());
                    let owned = NOT_RUN_ELSEWHERE.iter().any(|(f, first, _)| {
                        *f == file && lines.get(start + 1).is_some_and(|l| l.starts_with(first))
                    });
                    if command && !marked && !owned {
                        raw.push(format!("{file}:{}", start + 1));
                    }
                    open = None;
                }
                (Some(_), false) => prompt |= l.starts_with("$ "),
                (None, false) => {}
            }
        }
    }
    raw.sort();
    assert_eq!(names, raw, "the block tests run these, the docs hold those");
    assert!(raw.len() >= 4, "{} command blocks in docs/", raw.len());
}

/// docs/contributing.md's index of where a feature's tests live names every module of the
/// suite (each `tests/*.rs` beside suite.rs), and no module that is gone.
#[test]
fn the_test_index_names_every_module() {
    let text = std::fs::read_to_string(root().join("docs/contributing.md")).unwrap();
    let index = text
        .split("## Where a feature's tests live")
        .nth(1)
        .expect("docs/contributing.md has the test index");
    let index = index.split("\n## ").next().unwrap();
    // parity's suite and the block-format crate's own test binaries.
    let mut modules: Vec<String> = ["tests", "crates/parity-quant/tests"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root().join(d)).unwrap().flatten())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".rs").map(str::to_string)
        })
        .filter(|m| m != "suite")
        .collect();
    modules.sort();
    let missing: Vec<&String> = modules
        .iter()
        .filter(|m| !index.contains(&format!("`{m}`")))
        .collect();
    assert!(missing.is_empty(), "not in the test index: {missing:?}");
    // The table's second column: the modules, each in backticks.
    let named: Vec<&str> = index
        .lines()
        .filter_map(|l| l.split('|').nth(2))
        .flat_map(|cell| cell.split('`').skip(1).step_by(2))
        .filter(|s| s.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .collect();
    assert!(named.len() >= modules.len(), "{named:?}");
    let gone: Vec<&&str> = named
        .iter()
        .filter(|n| !modules.iter().any(|m| m == *n))
        .collect();
    assert!(
        gone.is_empty(),
        "the test index names modules that are gone: {gone:?}"
    );
}
