//! The CI gate (`--snapshot FILE`, `--against FILE`): every fixture × backend pair of
//! `parity check` stays within its committed snapshot (tests/gate/*.snap), the files are insta
//! snapshots, and a perturbed kernel or tensor fails the gate, naming what moved.
//!
//! After an intended change of the numerics or of the comparisons `check` makes, refresh the
//! snapshots with `PARITY_UPDATE_GATE=1 cargo test --test suite report_gate::` and review the diff.

use crate::common;
use common::*;
use std::path::{Path, PathBuf};

fn fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("fixtures"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    v.sort();
    v
}

fn snap_path(model: &Path) -> PathBuf {
    root().join("tests/gate").join(format!(
        "{}.snap",
        model.file_stem().unwrap().to_string_lossy()
    ))
}

/// The body of an insta snapshot file, read by insta itself.
fn insta_contents(p: &Path) -> String {
    let s = insta::Snapshot::from_file(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    match s.contents() {
        insta::internals::SnapshotContents::Text(t) => t.to_string(),
        _ => panic!("{}: not a text snapshot", p.display()),
    }
}

#[test]
fn every_fixture_and_backend_pair_passes_its_committed_gate() {
    let update = std::env::var_os("PARITY_UPDATE_GATE").is_some();
    let models = fixtures();
    assert!(models.len() >= 8, "{models:?}");
    for m in &models {
        let snap = snap_path(m);
        let (flag, what) = if update {
            ("--snapshot", "write")
        } else {
            ("--against", "check")
        };
        // The committed gates hold the CPU backends (a gpu pair would tie them to a machine
        // with a GPU driver).
        let o = parity(&[
            "check",
            m.to_str().unwrap(),
            "--backends",
            "reference,reference:ggml-cpu,fast",
            flag,
            snap.to_str().unwrap(),
        ]);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{what} {}: a clean run must pass its snapshot (after an intended change: PARITY_UPDATE_GATE=1 cargo test --test suite report_gate::)\n{}",
            snap.display(),
            show(&o)
        );
        if !update {
            assert!(
                stdout(&o).contains("gate: numerics within the snapshot"),
                "{}",
                show(&o)
            );
        }
        // Every backend of `check` is in it: against the golden, op by op, and with each other.
        let text = std::fs::read_to_string(&snap).unwrap();
        for pair in [
            "parity/reference vs llama.cpp/llama.cpp-cpu",
            "parity/reference:ggml-cpu vs llama.cpp/llama.cpp-cpu",
            "parity/fast vs llama.cpp/llama.cpp-cpu",
            "parity/fast/op-by-op vs llama.cpp/llama.cpp-cpu",
            "parity/fast vs parity/reference:ggml-cpu",
        ] {
            assert!(
                text.contains(&format!("== {pair} [")),
                "{}: no {pair}",
                snap.display()
            );
        }
        // insta reads it as a snapshot whose contents are the body after the header.
        let body = text.splitn(3, "---\n").nth(2).unwrap();
        assert_eq!(insta_contents(&snap), body.trim_end());
    }
}

/// The golden with one tensor scaled by 1 + 3e-6 (NMSE ~9e-12): under every threshold, so the
/// verdict stays parity, but the gate sees layer 1 ffn_out leave its bucket and fails.
#[test]
fn a_perturbed_tensor_fails_the_gate_though_the_verdict_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let golden = tmp.path().join("golden");
    copy_dir(&root().join("golden/tiny-llama-q8_0"), &golden);
    let snap = tmp.path().join("q8_0.snap");
    let model = "fixtures/tiny-llama-q8_0.gguf";
    let g = golden.to_str().unwrap();
    let o = parity(&[
        "check",
        model,
        "--golden",
        g,
        "--snapshot",
        snap.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));

    let p = golden.join("s002/ffn_out-1.npy");
    let (shape, mut data) = read_npy(&p);
    data.iter_mut().for_each(|x| *x *= 1.0 + 3e-6);
    write_npy(&p, &shape, &data);

    let o = parity(&[
        "check",
        model,
        "--golden",
        g,
        "--against",
        snap.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(out.contains("verdict: parity"), "{}", show(&o));
    assert!(out.contains("gate: FAILED"), "{}", show(&o));
    assert!(
        out.contains("[op-by-op, Q8_0]: layer 1 ffn_out: NMSE bucket"),
        "{}",
        show(&o)
    );
    // Nothing upstream of the scaled tensor moved.
    let moved: Vec<&str> = out.lines().filter(|l| l.contains("NMSE bucket")).collect();
    assert!(!moved.is_empty());
    assert!(
        moved
            .iter()
            .all(|l| l.contains("layer 1 ffn_out") || l.contains("layer 1 l_out")),
        "{moved:#?}"
    );
    // The new snapshot waits beside the old one, as insta's pending .snap.new.
    let new = tmp.path().join("q8_0.snap.new");
    assert!(new.exists());
    assert!(insta_contents(&new).contains("verdict: parity"));
    // The unperturbed golden passes again and clears the stale pending file.
    let o = parity(&["check", model, "--against", snap.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(!new.exists());
}

/// A kernel bug (RMSNorm's epsilon 10×, from the mutation catalog) in an engine's dump: `parity
/// diff GOLDEN TRACE --against` of the clean dump's snapshot fails and names the norms.
#[test]
fn a_mutated_kernel_fails_the_gate() {
    let tmp = tempfile::tempdir().unwrap();
    let g = "golden/tiny-llama-q8_0";
    let model = "fixtures/tiny-llama-q8_0.gguf";
    let dump = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "dump",
            model,
            "--golden",
            g,
            "--backend",
            "reference",
            "--emulate",
            "ggml-cpu",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = parity(&args);
        assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    };
    let (clean, bad) = (tmp.path().join("clean"), tmp.path().join("bad"));
    dump(&clean, &[]);
    dump(&bad, &["--mutate", "rms-eps-10x"]);
    let snap = tmp.path().join("engine.snap");
    let s = snap.to_str().unwrap();
    let o = parity(&["diff", g, clean.to_str().unwrap(), "--snapshot", s]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let o = parity(&["diff", g, clean.to_str().unwrap(), "--against", s]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let o = parity(&["diff", g, bad.to_str().unwrap(), "--against", s]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let out = stdout(&o);
    assert!(out.contains("gate: FAILED"), "{}", show(&o));
    assert!(
        out.contains("layer 0 attn_norm: NMSE bucket"),
        "{}",
        show(&o)
    );
}

#[test]
fn against_a_missing_or_foreign_file_is_an_input_error() {
    let o = parity(&["check", "--against", "no/such.snap"]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("no/such.snap") && err.contains("--snapshot"),
        "{}",
        show(&o)
    );
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("x.snap");
    std::fs::write(&p, "---\nsource: x\n---\nhello\n").unwrap();
    let o = parity(&["check", "--against", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not a parity snapshot"),
        "{}",
        show(&o)
    );
}
