//! Reading outside the trace, or without end, and crashes on near-valid data (issue #26): every
//! file a trace folder, a manifest or a flag names is read inside the folder it belongs to, only
//! as far as it must hold, and bad data is one line and exit 2, never a panic or a hang.
//!
//! Each case runs the real binary with a time limit (a hang fails the case); the cases that
//! would need memory the size of a hostile file run under `ulimit -v`, so that reading such a
//! file whole fails the case (an abort) instead of passing by luck on a big machine.

use crate::common;

use common::{copy_dir, root};
use parity::trace::Trace;
use serde_json::Value as Json;
use std::ffi::OsString;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const FIX: &str = "fixtures/tiny-llama-q8_0.gguf";
const GOLDEN: &str = "golden/tiny-llama-q8_0";
/// No case needs more; a case past it hangs.
const LIMIT: Duration = Duration::from_secs(60);
/// The address space a bounded case runs in (KiB): parity's own needs and then some, far below
/// any hostile file of these cases (4 GiB).
const VM_KIB: u64 = 2 << 20;

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    fn show(&self) -> String {
        format!(
            "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code,
            excerpt(&self.stdout),
            excerpt(&self.stderr)
        )
    }
}

/// A failure message stays readable when parity printed megabytes.
fn excerpt(s: &str) -> String {
    if s.len() > 4000 {
        format!("{}… ({} bytes)", &s[..s.floor_char_boundary(4000)], s.len())
    } else {
        s.to_string()
    }
}

/// Run parity in `cwd` with a time limit, optionally under `ulimit -v VM_KIB`.
fn run_with(cwd: &Path, bounded: bool, args: &[OsString]) -> Out {
    let mut c = if bounded {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("ulimit -v \"$1\" && shift && exec \"$@\"")
            .arg("sh")
            .arg(VM_KIB.to_string())
            .arg(env!("CARGO_BIN_EXE_parity"));
        c
    } else {
        Command::new(env!("CARGO_BIN_EXE_parity"))
    };
    c.args(args)
        .current_dir(cwd)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("run parity");
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let to = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut so, &mut s).ok();
        s
    });
    let te = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut se, &mut s).ok();
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > LIMIT {
            child.kill().ok();
            child.wait().ok();
            panic!("parity {args:?} hung (killed after {LIMIT:?})");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Out {
        code: status.code(),
        stdout: to.join().unwrap(),
        stderr: te.join().unwrap(),
    }
}

fn args(v: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
    v.iter().map(|a| a.as_ref().to_os_string()).collect()
}

fn run(v: &[&dyn AsRef<std::ffi::OsStr>]) -> Out {
    run_with(&root(), false, &args(v))
}

/// Exit 2, one short line on stderr holding every word, no panic.
fn refused(o: &Out, words: &[&str], case: &str) {
    assert_eq!(o.code, Some(2), "{case}: expected exit 2:\n{}", o.show());
    assert!(!o.stderr.contains("panicked"), "{case}:\n{}", o.show());
    let lines: Vec<&str> = o.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{case}: expected one line:\n{}", o.show());
    assert!(
        lines[0].chars().count() < 600,
        "{case}: the error line is {} characters long:\n{}",
        lines[0].chars().count(),
        o.show()
    );
    for w in words {
        assert!(
            lines[0].contains(w),
            "{case}: the error line lacks '{w}':\n{}",
            o.show()
        );
    }
}

/// A copy of the golden at `dir/name`.
fn golden_copy(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    copy_dir(&root().join(GOLDEN), &p);
    p
}

fn manifest(dir: &Path) -> Json {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

fn set_manifest(dir: &Path, m: &Json) {
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec_pretty(m).unwrap(),
    )
    .unwrap();
}

/// The manifest entry of `file` (`s000/logits.npy`).
fn entry<'a>(m: &'a mut Json, file: &str) -> &'a mut Json {
    m["tensors"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|t| t["file"] == file)
        .unwrap_or_else(|| panic!("no {file}"))
}

/// A .npy file: `header` (the dict literal) padded as numpy pads it, then `data` bytes.
fn npy(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut v = b"\x93NUMPY\x01\x00".to_vec();
    v.extend_from_slice(&(h.len() as u16).to_le_bytes());
    v.extend_from_slice(h.as_bytes());
    v.extend_from_slice(data);
    v
}

fn le(data: &[f32]) -> Vec<u8> {
    data.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn tuple(shape: &[u64]) -> String {
    match shape {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Trace folders are confined: whatever a manifest names is read inside the folder.

/// How a crafted trace leads out of its folder (`out` is a folder beside it, holding a copy of
/// the golden: what is read there would compare at parity, so only a refusal passes).
type Escape = fn(trace: &Path, out: &Path);

fn escapes() -> Vec<(&'static str, Escape)> {
    vec![
        ("a tap symlinked to a file outside (absolute)", |t, out| {
            let f = t.join("s000/logits.npy");
            std::fs::remove_file(&f).unwrap();
            symlink(out.join("s000/logits.npy"), &f).unwrap();
        }),
        ("a tap symlinked outside by a relative path", |t, out| {
            let f = t.join("s001/embd.npy");
            std::fs::remove_file(&f).unwrap();
            let rel = Path::new("../..")
                .join(out.file_name().unwrap())
                .join("s001/embd.npy");
            symlink(rel, &f).unwrap();
        }),
        ("a step folder symlinked outside", |t, out| {
            std::fs::remove_dir_all(t.join("s000")).unwrap();
            symlink(out.join("s000"), t.join("s000")).unwrap();
        }),
        (
            "a step folder symlinked outside, by a relative path",
            |t, out| {
                std::fs::remove_dir_all(t.join("s001")).unwrap();
                let rel = Path::new("..").join(out.file_name().unwrap()).join("s001");
                symlink(rel, t.join("s001")).unwrap();
            },
        ),
        ("manifest.json symlinked outside", |t, out| {
            std::fs::remove_file(t.join("manifest.json")).unwrap();
            symlink(out.join("manifest.json"), t.join("manifest.json")).unwrap();
        }),
        ("a tap symlinked to /proc/self/pagemap", |t, _| {
            let f = t.join("s000/embd.npy");
            std::fs::remove_file(&f).unwrap();
            symlink("/proc/self/pagemap", &f).unwrap();
        }),
        ("a tap symlinked to /dev/zero", |t, _| {
            let f = t.join("s000/q-0.npy");
            std::fs::remove_file(&f).unwrap();
            symlink("/dev/zero", &f).unwrap();
        }),
        (
            "a tap behind a symlinked folder named in the manifest",
            |t, out| {
                // The manifest names `ext/logits.npy`; `ext` leads outside.
                symlink(out.join("s000"), t.join("ext")).unwrap();
                let mut m = manifest(t);
                entry(&mut m, "s000/logits.npy")["file"] = "ext/logits.npy".into();
                set_manifest(t, &m);
            },
        ),
    ]
}

#[test]
fn files_leading_outside_the_trace_folder_are_refused_in_every_command() {
    for (case, escape) in escapes() {
        let tmp = tempfile::tempdir().unwrap();
        let out = golden_copy(tmp.path(), "elsewhere");
        let bad = golden_copy(tmp.path(), "trace");
        escape(&bad, &out);
        let golden = root().join(GOLDEN);
        let fix = root().join(FIX);
        for (cmd, a) in [
            ("diff, candidate", args(&[&"diff", &golden, &bad])),
            ("diff, baseline", args(&[&"diff", &bad, &golden])),
            (
                "check --golden",
                args(&[
                    &"check",
                    &fix,
                    &"--golden",
                    &bad,
                    &"--backends",
                    &"reference",
                ]),
            ),
        ] {
            let o = run_with(&root(), false, &a);
            refused(
                &o,
                &["outside the trace folder"],
                &format!("{case} ({cmd})"),
            );
        }
    }
}

#[test]
fn symlinks_that_stay_inside_the_trace_and_a_symlinked_trace_folder_are_read() {
    let tmp = tempfile::tempdir().unwrap();
    let t = golden_copy(tmp.path(), "trace");
    // A tap that is a link to an identical file elsewhere in the same trace (an engine that
    // dedupes its dumps), and a step folder reached through a link inside the folder.
    std::fs::create_dir(t.join("store")).unwrap();
    std::fs::rename(t.join("s000/logits.npy"), t.join("store/logits.npy")).unwrap();
    symlink("../store/logits.npy", t.join("s000/logits.npy")).unwrap();
    std::fs::rename(t.join("s001"), t.join("store/s001")).unwrap();
    symlink("store/s001", t.join("s001")).unwrap();
    // The trace folder itself given through a link the user made.
    let link = tmp.path().join("link");
    symlink(&t, &link).unwrap();
    let o = run(&[&"diff", &root().join(GOLDEN), &link]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(o.stdout.contains("parity"), "{}", o.show());
}

// ---------------------------------------------------------------------------------------------
// Model paths and what is adopted from them.

/// Both traces' manifests naming `path` as the model, with `sha` (no size recorded, so that
/// a search would hash).
fn with_model(dir: &Path, path: &str, sha: &str) -> (PathBuf, PathBuf) {
    let pair = (golden_copy(dir, "base"), golden_copy(dir, "cand"));
    for t in [&pair.0, &pair.1] {
        let mut m = manifest(t);
        m["model"] = serde_json::json!({ "path": path, "sha256": sha });
        set_manifest(t, &m);
    }
    pair
}

#[test]
fn model_paths_that_read_without_end_are_never_hashed_to_the_end() {
    for path in [
        "/proc/self/pagemap",
        "/proc/self/mem",
        "/proc/kcore",
        "/dev/zero",
        "/dev/urandom",
        "/dev/stdin",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (base, cand) = with_model(tmp.path(), path, &"ab".repeat(32));
        let t0 = Instant::now();
        let o = run(&[&"diff", &base, &cand]);
        refused(&o, &["is not found here"], path);
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{path}: {:?}",
            t0.elapsed()
        );
        // End to end without the model: exit 0, at once.
        let o = run(&[
            &"diff",
            &base,
            &cand,
            &"--weight-type",
            &"q8_0",
            &"--json",
            &tmp.path().join("r.json"),
        ]);
        assert_eq!(o.code, Some(0), "{path}:\n{}", o.show());
    }
}

/// A regular file behind a GGUF header that is far longer than its tensors say (sparse: a
/// terabyte costs nothing on disk): a manifest naming it gets no hash of the whole file, and
/// is refused at once.
#[test]
fn model_files_longer_than_their_gguf_are_never_hashed() {
    let tmp = tempfile::tempdir().unwrap();
    let magic_only = tmp.path().join("magic.gguf");
    std::fs::write(&magic_only, b"GGUF").unwrap();
    let padded = tmp.path().join("padded.gguf");
    std::fs::copy(root().join(FIX), &padded).unwrap();
    for p in [&magic_only, &padded] {
        std::fs::OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        let (base, cand) = with_model(tmp.path(), p.to_str().unwrap(), &"ab".repeat(32));
        let t0 = Instant::now();
        let o = run(&[&"diff", &base, &cand]);
        refused(&o, &["is not found here"], &p.display().to_string());
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{}: {:?}",
            p.display(),
            t0.elapsed()
        );
        std::fs::remove_file(p).unwrap();
    }
}

/// A manifest naming 200,000 taps parity does not know: read in linear time (a list search
/// made it minutes), and the note names ten of them and counts the rest.
#[test]
fn a_manifest_of_many_unknown_taps_is_read_at_once_and_noted_short() {
    let tmp = tempfile::tempdir().unwrap();
    let t = golden_copy(tmp.path(), "t");
    let mut m = manifest(&t);
    let first = m["tensors"][0].clone();
    let list = m["tensors"].as_array_mut().unwrap();
    for i in 0..200_000 {
        let mut e = first.clone();
        e["tap"] = format!("x{i}").into();
        list.push(e);
    }
    set_manifest(&t, &m);
    let t0 = Instant::now();
    let o = run(&[&"diff", &root().join(GOLDEN), &t, &"--weight-type", &"q8_0"]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    let note = o
        .stderr
        .lines()
        .find(|l| l.contains("does not know"))
        .unwrap_or_else(|| panic!("no note:\n{}", o.show()));
    assert!(
        note.contains("x0, x1") && note.ends_with("and 199990 more"),
        "{note}"
    );
    assert!(note.len() < 300, "{note}");
}

/// Whether `--json`'s report holds text decoded by a tokenizer.
fn decoded(report: &Path) -> bool {
    let r: Json = serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap();
    r["traces"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["steps"].as_array().unwrap())
        .any(|s| s.get("text").is_some_and(|x| !x.is_null()))
}

#[test]
fn no_model_is_adopted_without_a_matching_sha256() {
    let real_sha = manifest(&root().join(GOLDEN))["model"]["sha256"]
        .as_str()
        .unwrap()
        .to_string();
    // (what the manifests record, whether the report may decode text with ./model.gguf)
    for (path, sha, adopt) in [
        ("model.gguf", "", false),
        ("./model.gguf", "", false),
        ("model.gguf", &"ab".repeat(32)[..], false),
        // The control: the same file with its own sha256 recorded is adopted (the test can fail).
        ("model.gguf", &real_sha[..], true),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (base, cand) = with_model(tmp.path(), path, sha);
        std::fs::copy(root().join(FIX), tmp.path().join("model.gguf")).unwrap();
        let report = tmp.path().join("r.json");
        let o = run_with(
            tmp.path(),
            false,
            &args(&[
                &"diff",
                &base,
                &cand,
                &"--weight-type",
                &"q8_0",
                &"--json",
                &report,
            ]),
        );
        assert_eq!(o.code, Some(0), "{path} {sha:?}:\n{}", o.show());
        assert_eq!(decoded(&report), adopt, "{path} {sha:?}:\n{}", o.show());
    }
}

// ---------------------------------------------------------------------------------------------
// Bounded reads: snapshots and taps are checked against their size before they are read.

/// A sparse file of `len` bytes starting with `head`.
fn sparse(p: &Path, head: &[u8], len: u64) {
    let f = std::fs::File::create(p).unwrap();
    std::io::Write::write_all(&mut &f, head).unwrap();
    f.set_len(len).unwrap();
}

#[test]
fn against_snapshots_are_bounded_and_quoted_short() {
    let tmp = tempfile::tempdir().unwrap();
    let golden = root().join(GOLDEN);
    let huge = tmp.path().join("huge.snap");
    sparse(
        &huge,
        b"---\nsource: parity\nexpression: parity diff\n---\nparity snapshot v1: x\n",
        (2 << 30) + (1 << 28),
    );
    let long_line = tmp.path().join("long.snap");
    std::fs::write(
        &long_line,
        format!("parity snapshot v1: x\n\n== t\n{}\n", "x".repeat(4 << 20)),
    )
    .unwrap();
    // A snapshot of this very run with a 4 MB verdict and a 4 MB title added: the gate's own
    // lines quote them.
    let long_field = tmp.path().join("field.snap");
    let o = run(&[
        &"diff",
        &golden,
        &golden,
        &"--weight-type",
        &"q8_0",
        &"--snapshot",
        &long_field,
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let text = std::fs::read_to_string(&long_field).unwrap();
    assert!(text.contains("verdict: parity"), "{text}");
    let text = text.replacen(
        "verdict: parity",
        &format!("verdict: {}", "v".repeat(4 << 20)),
        1,
    ) + &format!("\n== {}\nverdict: parity\n", "t".repeat(4 << 20));
    std::fs::write(&long_field, text).unwrap();
    let pagemap = tmp.path().join("pagemap.snap");
    symlink("/proc/self/pagemap", &pagemap).unwrap();
    let cases: Vec<(&str, PathBuf, &[&str])> = vec![
        (
            "a 2.3 GiB snapshot",
            huge,
            &["more than a parity snapshot can be"],
        ),
        ("a 4 MB line", long_line, &["a row before the header", "…"]),
        ("/dev/zero", "/dev/zero".into(), &["not a regular file"]),
        // Through a link (its `.new` must be writable beside it): size 0, endless to read.
        ("/proc/self/pagemap", pagemap, &["not a parity snapshot"]),
    ];
    for (case, snap, words) in cases {
        let o = run_with(
            &root(),
            true,
            &args(&[
                &"diff",
                &golden,
                &golden,
                &"--weight-type",
                &"q8_0",
                &"--against",
                &snap,
            ]),
        );
        refused(&o, words, case);
    }
    let o = run_with(
        &root(),
        true,
        &args(&[
            &"diff",
            &golden,
            &golden,
            &"--weight-type",
            &"q8_0",
            &"--against",
            &long_field,
        ]),
    );
    assert_eq!(o.code, Some(1), "the gate fails:\n{}", o.show());
    for l in o.stdout.lines().chain(o.stderr.lines()) {
        assert!(
            l.chars().count() < 600,
            "a {}-character line:\n{}",
            l.len(),
            o.show()
        );
    }
    assert!(
        o.stdout.contains("in the snapshot, not in this run"),
        "{}",
        o.show()
    );
    assert!(o.stdout.contains("verdict: vvvv"), "{}", o.show());
}

#[test]
fn taps_are_checked_against_the_manifest_before_they_are_read() {
    let four_gib = 1u64 << 32;
    // (case, the manifest's shape for s000/logits.npy or None to keep it, the file's header,
    // the file's size, the words)
    type Craft = (
        &'static str,
        Option<Vec<u64>>,
        Vec<u64>,
        u64,
        &'static [&'static str],
    );
    let hdr = |s: &[u64]| s.to_vec();
    let cases: Vec<Craft> = vec![
        (
            "a 4 GiB tap whose header and manifest agree with each other (2^30 values)",
            Some(vec![1 << 30]),
            hdr(&[1 << 30]),
            four_gib + 128,
            &["logits.npy", "more than this machine can hold"],
        ),
        (
            "a 4 GiB file where the manifest says a small tap",
            None,
            hdr(&[20, 393]),
            four_gib,
            &["logits.npy", "bytes of data after the header"],
        ),
        (
            "a header stating 2^30 values where the manifest says a small tap",
            None,
            hdr(&[1 << 30]),
            four_gib + 128,
            &[
                "logits.npy",
                "shape [1073741824] differs from the manifest's [20, 393]",
            ],
        ),
        (
            "a header whose shape overflows",
            None,
            hdr(&[u64::MAX, u64::MAX]),
            1 << 20,
            &["logits.npy", "differs from the manifest"],
        ),
        (
            "a small tap cut short",
            None,
            hdr(&[20, 393]),
            128 + 100,
            &["logits.npy", "truncated"],
        ),
    ];
    for (case, shape, header, len, words) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let bad = golden_copy(tmp.path(), "trace");
        if let Some(s) = &shape {
            let mut m = manifest(&bad);
            entry(&mut m, "s000/logits.npy")["shape"] = serde_json::json!(s);
            set_manifest(&bad, &m);
        }
        let head = npy(
            &format!(
                "{{'descr': '<f4', 'fortran_order': False, 'shape': {}, }}",
                tuple(&header)
            ),
            &[],
        );
        assert_eq!(head.len(), 128, "{case}");
        sparse(&bad.join("s000/logits.npy"), &head, len);
        let golden = root().join(GOLDEN);
        let o = run_with(
            &root(),
            true,
            &args(&[&"diff", &golden, &bad, &"--weight-type", &"q8_0"]),
        );
        refused(&o, words, case);
    }
}

// ---------------------------------------------------------------------------------------------
// Crashes and hangs on valid or near-valid data.

#[test]
fn a_deeply_nested_npy_header_is_refused_at_once() {
    for (case, header) in [
        (
            "a 26-deep list as the shape",
            format!(
                "{{'descr': '<f4', 'fortran_order': False, 'shape': {}2{}, }}",
                "[".repeat(26),
                "]".repeat(26)
            ),
        ),
        (
            "a 26-deep list as the dtype",
            format!(
                "{{'descr': {}'<f4'{}, 'fortran_order': False, 'shape': (20, 393), }}",
                "[".repeat(26),
                "]".repeat(26)
            ),
        ),
        (
            "a 2000-deep tuple as an extra key",
            format!(
                "{{'descr': '<f4', 'fortran_order': False, 'shape': (20, 393), 'x': {}1{}}}",
                "(".repeat(2000),
                ")".repeat(2000)
            ),
        ),
        (
            "a 26-deep dict as fortran_order",
            format!(
                "{{'descr': '<f4', 'fortran_order': {}{}, 'shape': (20, 393), }}",
                "{'a': ".repeat(26),
                "}".repeat(26)
            ),
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let bad = golden_copy(tmp.path(), "trace");
        std::fs::write(
            bad.join("s000/logits.npy"),
            npy(&header, &le(&[0.0; 20 * 393])),
        )
        .unwrap();
        let t0 = Instant::now();
        let o = run(&[
            &"diff",
            &root().join(GOLDEN),
            &bad,
            &"--weight-type",
            &"q8_0",
        ]);
        refused(&o, &["logits.npy"], case);
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{case}: {:?}",
            t0.elapsed()
        );
    }
}

/// The tap `file` of `dir` rewritten in Fortran order (the same logical values), or, with
/// `mislabel`, its C-order bytes labelled Fortran (other logical values).
fn fortran(dir: &Path, file: &str, mislabel: bool) {
    let p = dir.join(file);
    let (shape, data) = common::read_npy(&p);
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let a = ndarray::ArrayD::from_shape_vec(dims, data.clone()).unwrap();
    // The reversed axes, walked in logical order: the first axis varies fastest.
    let col_major: Vec<f32> = if mislabel {
        data
    } else {
        a.t().iter().copied().collect()
    };
    let h = format!(
        "{{'descr': '<f4', 'fortran_order': True, 'shape': {}, }}",
        tuple(&shape)
    );
    std::fs::write(&p, npy(&h, &le(&col_major))).unwrap();
}

#[test]
fn fortran_order_taps_are_read_on_either_side() {
    let golden = root().join(GOLDEN);
    for file in [
        "s000/logits.npy",
        "s000/attn_norm-1.npy",
        "s000/kq_soft_max-0.npy",
        "s001/q_rope-0.npy",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let f = golden_copy(tmp.path(), "fortran");
        fortran(&f, file, false);
        for (side, a, b) in [("candidate", &golden, &f), ("baseline", &f, &golden)] {
            let o = run(&[&"diff", a, b]);
            assert_eq!(
                o.code,
                Some(0),
                "{file} in Fortran order as the {side}:\n{}",
                o.show()
            );
        }
        // The control: the same bytes taken in C order are other values, found.
        let m = golden_copy(tmp.path(), "mislabelled");
        fortran(&m, file, true);
        let o = run(&[&"diff", &golden, &m, &"--weight-type", &"q8_0"]);
        assert_eq!(o.code, Some(1), "{file} mislabelled:\n{}", o.show());
    }
}

#[test]
fn empty_axes_are_refused_in_one_line() {
    // (case, file, the shape on both sides)
    for (case, file, shape) in [
        ("logits [T, 0]", "s000/logits.npy", vec![20u64, 0]),
        ("logits [0, n_vocab]", "s000/logits.npy", vec![0, 393]),
        (
            "a per-layer tap [T, n_head, 0]",
            "s000/q_rope-1.npy",
            vec![20, 4, 0],
        ),
        ("a decode step's embd [0]", "s001/embd.npy", vec![0]),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let a = golden_copy(tmp.path(), "a");
        let b = golden_copy(tmp.path(), "b");
        for t in [&a, &b] {
            let mut m = manifest(t);
            entry(&mut m, file)["shape"] = serde_json::json!(shape);
            set_manifest(t, &m);
            let h = format!(
                "{{'descr': '<f4', 'fortran_order': False, 'shape': {}, }}",
                tuple(&shape)
            );
            std::fs::write(t.join(file), npy(&h, &[])).unwrap();
        }
        for extra in [&[][..], &["--weight-type", "q8_0"][..]] {
            let mut v = args(&[&"diff", &a, &b]);
            v.extend(extra.iter().map(OsString::from));
            let o = run_with(&root(), false, &v);
            refused(&o, &["empty axis"], case);
        }
        let o = run(&[
            &"check",
            &root().join(FIX),
            &"--golden",
            &a,
            &"--backends",
            &"reference",
        ]);
        refused(&o, &["empty axis"], &format!("{case} (check --golden)"));
    }
}

#[test]
fn strings_a_manifest_holds_are_quoted_short() {
    let long = "x".repeat(4 << 20);
    type Edit = fn(&mut Json, &str);
    let edits: Vec<(&str, Edit)> = vec![
        ("format", |m, s| m["format"] = s.into()),
        (
            "a string where a number goes (the parser quotes it)",
            |m, s| m["version"] = s.into(),
        ),
        ("a file name leaving the folder", |m, s| {
            m["tensors"][0]["file"] = format!("{s}/../x").into()
        }),
        ("a file name of an unlisted step", |m, s| {
            m["tensors"][0]["file"] = s.into();
            m["tensors"][0]["step"] = 99.into();
        }),
        ("a tap needing a layer", |m, s| {
            let t = m["tensors"]
                .as_array_mut()
                .unwrap()
                .iter_mut()
                .find(|t| t["tap"] == "embd")
                .unwrap();
            t["layer"] = 0.into();
            t["file"] = s.into();
        }),
        ("a dtype with an impossible shape", |m, s| {
            m["tensors"][0]["dtype"] = s.into();
            m["tensors"][0]["shape"] = serde_json::json!([u64::MAX, u64::MAX]);
        }),
        ("a million positions", |m, _| {
            m["steps"][1]["positions"] = serde_json::json!(vec![0u32; 1 << 20]);
            m["steps"][1]["tokens"] = serde_json::json!(vec![1u32; 1 << 20]);
        }),
    ];
    for (case, edit) in edits {
        let tmp = tempfile::tempdir().unwrap();
        let bad = golden_copy(tmp.path(), "trace");
        let mut m = manifest(&bad);
        edit(&mut m, &long);
        set_manifest(&bad, &m);
        let o = run(&[&"diff", &root().join(GOLDEN), &bad]);
        refused(&o, &["manifest.json"], case);
    }
}

// ---------------------------------------------------------------------------------------------
// The manifest reader, fuzzed: it parses or refuses in one line, never panics, never hangs.

use proptest::prelude::*;

/// A JSON value built from the manifest's own keys and hostile leaves.
fn hostile_json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::from),
        prop_oneof![
            Just(0u64),
            Just(1),
            Just(u64::MAX),
            Just(1 << 32),
            Just(1 << 24),
            0u64..300
        ]
        .prop_map(Json::from),
        prop_oneof![Just(-1i64), Just(i64::MIN)].prop_map(Json::from),
        Just(Json::from(1.5)),
        prop_oneof![
            Just("parity-trace".to_string()),
            Just("embd".to_string()),
            Just("logits".to_string()),
            Just("s000/embd.npy".to_string()),
            Just("../x".to_string()),
            Just("/proc/self/pagemap".to_string()),
            Just("<f4".to_string()),
            Just("\u{1b}[2J\n".to_string()),
            ".{0,12}",
        ]
        .prop_map(Json::from),
    ];
    let keys = prop_oneof![
        Just("format"),
        Just("version"),
        Just("model"),
        Just("path"),
        Just("sha256"),
        Just("size"),
        Just("producer"),
        Just("name"),
        Just("backend"),
        Just("settings"),
        Just("steps"),
        Just("step"),
        Just("tokens"),
        Just("positions"),
        Just("forced"),
        Just("tensors"),
        Just("tap"),
        Just("layer"),
        Just("file"),
        Just("shape"),
        Just("dtype"),
        Just("layouts"),
    ];
    leaf.prop_recursive(6, 96, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Json::Array),
            prop::collection::vec((keys.clone(), inner), 0..10).prop_map(|kv| {
                Json::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

/// A valid manifest with one value replaced somewhere by a hostile one.
fn mutated_manifest() -> impl Strategy<Value = Json> {
    let base = manifest(&root().join(GOLDEN));
    (any::<prop::sample::Index>(), hostile_json()).prop_map(move |(i, v)| {
        let mut m = base.clone();
        let mut ptrs = Vec::new();
        pointers(&m, String::new(), &mut ptrs);
        let p = i.get(&ptrs).clone();
        *m.pointer_mut(&p).unwrap() = v;
        m
    })
}

fn pointers(v: &Json, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match v {
        Json::Object(m) => m
            .iter()
            // RFC 6901: a key's `~` and `/` are escaped (the golden's self-check keys hold `/`).
            .for_each(|(k, x)| {
                let k = k.replace('~', "~0").replace('/', "~1");
                pointers(x, format!("{at}/{k}"), out)
            }),
        Json::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, x)| pointers(x, format!("{at}/{i}"), out)),
        _ => {}
    }
}

/// `Trace::open` of `bytes` as a manifest (beside the golden's taps), then every tap read:
/// Ok or one-line errors, within a time limit, never a panic.
fn open_and_read(bytes: Vec<u8>) -> Result<(), String> {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path(), "t");
    std::fs::write(dir.join("manifest.json"), &bytes).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || {
        let r = (|| -> Result<Vec<String>, String> {
            let t = Trace::open(&d).map_err(|e| e.to_string())?;
            let keys: Vec<_> = t.keys().copied().collect();
            Ok(keys
                .iter()
                .filter_map(|k| t.get(k).err().map(|e| e.to_string()))
                .collect())
        })();
        tx.send(r).ok();
    });
    let errors = match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(Ok(errors)) => errors,
        Ok(Err(e)) => vec![e],
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return Err("hung".into()),
        Err(_) => return Err("panicked".into()),
    };
    for e in errors {
        if e.is_empty() || e.contains('\n') || e.chars().count() > 600 {
            return Err(format!("not one short line: {}", excerpt(&e)));
        }
    }
    Ok(())
}

proptest! {
    // Each case copies the tiny golden and reads it (milliseconds): a few seconds in all.
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn manifest_reader_takes_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        prop_assert_eq!(open_and_read(bytes), Ok(()));
    }

    #[test]
    fn manifest_reader_takes_hostile_json(v in hostile_json()) {
        prop_assert_eq!(open_and_read(serde_json::to_vec(&v).unwrap()), Ok(()));
    }

    #[test]
    fn manifest_reader_takes_a_manifest_with_one_hostile_value(m in mutated_manifest()) {
        prop_assert_eq!(open_and_read(serde_json::to_vec(&m).unwrap()), Ok(()));
    }
}

/// A tap whose file name holds a terminal escape and a newline (found by the proptest above):
/// the read fails on one line, the name quoted, the escape never printed.
#[test]
fn a_tap_file_named_with_control_characters_fails_on_one_line() {
    let text =
        std::fs::read_to_string(root().join("golden/tiny-llama-q8_0/manifest.json")).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["tensors"][0]["file"] = "\u{1b}[2J\n".into();
    assert_eq!(open_and_read(serde_json::to_vec(&m).unwrap()), Ok(()));
}

#[test]
fn manifest_nesting_past_the_parsers_limit_is_refused() {
    for depth in [200usize, 100_000] {
        let doc = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert_eq!(open_and_read(doc.into_bytes()), Ok(()), "{depth}");
    }
    let doc = format!(
        "{{\"format\": {}1{}}}",
        "{\"a\":".repeat(50_000),
        "}".repeat(50_000)
    );
    assert_eq!(open_and_read(doc.into_bytes()), Ok(()));
}
