//! The README's walkthrough runs as written: every `parity …` line of its "Using it on your
//! model and your engine" block, on a freshly generated model, with the placeholders filled in
//! (model.gguf, DIR/GOLDEN = the golden `parity golden` made, t/ and YOUR_TRACE = the dump).
//! Then the same walkthrough with an engine that doubles BOS ends in a named finding.

use crate::common;
use common::*;
use std::path::Path;
use std::process::Command;

fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let start = readme
        .find("## Using it on your model and your engine")
        .expect("README has the walkthrough section");
    let block = &readme[start..];
    let open = block.find("```\n").unwrap() + 4;
    let close = open + block[open..].find("```").unwrap();
    block[open..close]
        .lines()
        .map(|l| l.split(" # ").next().unwrap().trim().to_string())
        .filter(|l| l.starts_with("parity "))
        .collect()
}

fn run(line: &str, dir: &Path, golden_dir: &Path) -> std::process::Output {
    let args = shell_words(line);
    Command::new(env!("CARGO_BIN_EXE_parity"))
        .args(&args[1..])
        .current_dir(dir)
        .env("PARITY_GOLDEN_DIR", golden_dir)
        .output()
        .unwrap()
}

/// Split on spaces, keeping "double-quoted words" together (enough for the README).
fn shell_words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for ch in line.chars() {
        match ch {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn the_readme_walkthrough_runs_as_written() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let gd = dir.join("goldens");
    let o = run(
        "parity fixture --type q4_k --seed 3 --n-layer 3 --out model.gguf",
        dir,
        &gd,
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let cmds = readme_commands();
    assert!(cmds.len() >= 10, "{cmds:?}");
    let mut golden = String::new();
    let mut ran = 0;
    for c in &cmds {
        // bench times llama.cpp on a real model (scripts/bench.sh does that). selftest finds
        // the golden `parity golden` just wrote to the user folder by itself (two bugs of the
        // catalog here; the whole catalog runs in tests/selftest.rs).
        if c.starts_with("parity bench") {
            continue;
        }
        let mut line = c
            .replace("DIR", &golden)
            .replace("GOLDEN", &golden)
            .replace("YOUR_TRACE", "t/")
            .replace("[model.gguf]", "model.gguf");
        if c.starts_with("parity selftest") {
            assert!(
                !golden.is_empty(),
                "the README makes a golden before its selftest"
            );
            line.push_str(" --only rope-neox,kv-off-by-one");
        }
        let o = run(&line, dir, &gd);
        assert_eq!(o.status.code(), Some(0), "`{line}`\n{}", show(&o));
        if c.starts_with("parity golden") {
            let made: Vec<_> = std::fs::read_dir(&gd).unwrap().flatten().collect();
            assert_eq!(made.len(), 1, "one golden in the user folder");
            golden = made[0].path().display().to_string();
        }
        ran += 1;
    }
    assert!(ran >= 13, "{ran} commands ran");
    assert!(dir.join("r.html").exists() && dir.join("parity.snap").exists());

    // The same engine, but it adds BOS to a prompt that already has it.
    let m: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(&golden).join("manifest.json")).unwrap(),
    )
    .unwrap();
    let ids: Vec<String> = m["steps"][0]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    let forced: Vec<String> = m["steps"].as_array().unwrap()[1..]
        .iter()
        .map(|s| s["tokens"][0].to_string())
        .collect();
    let doubled = format!("{},{}", ids[0], ids.join(","));
    let o = run(
        &format!(
            "parity dump model.gguf --tokens {doubled} --forced {} --out bad/",
            forced.join(",")
        ),
        dir,
        &gd,
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let o = run(&format!("parity diff {golden} bad/"), dir, &gd);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(stdout(&o).contains("bos-doubled"), "{}", show(&o));
}

/// A newcomer's test command is CI's run: the README's first block runs `.ci/run`, and
/// `.ci/run` installs every tool build.rs probes for (so that no test is ignored), makes
/// build.rs look again after an install, and ends in `cargo test --workspace` over the whole suite (the kits' crates too),
/// with the gpu backend's broken kernels built (`gpu-test-bugs`), which the GPU bug tests plant.
#[test]
fn the_readme_test_command_is_ci_run() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let open = readme.find("```\n").unwrap() + 4;
    let close = open + readme[open..].find("```").unwrap();
    let cmds: Vec<&str> = readme[open..close]
        .lines()
        .map(|l| l.split(" # ").next().unwrap().trim())
        .collect();
    assert!(cmds.contains(&"bash .ci/run"), "{cmds:?}");
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    let last = ci
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap();
    assert_eq!(
        last,
        "cargo test --workspace --features parity/gpu-test-bugs --no-fail-fast \"$@\""
    );
    for what in [
        "llama-cpp-python",
        "qemu-user-static",
        "gcc-aarch64-linux-gnu",
        "libc6-dev-arm64-cross",
        "aarch64-unknown-linux-gnu",
        "mesa-vulkan-drivers",
        "wasm32-unknown-unknown",
        "nodejs",
        "maturin",
        "g++",
        "libvulkan1",
        "chromium",
        "jq",
        "touch build.rs",
    ] {
        assert!(ci.contains(what), ".ci/run does not install {what}");
    }
}
