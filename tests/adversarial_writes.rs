//! Writes that go elsewhere (issue #26): parity writes only the paths it is given. A link
//! planted at a side file's name (`.NAME.lock`, `.NAME.partial-PID`, `.gone`, `.old`) is never
//! followed: a lock is refused in one line and left as it is, a stale partial of a dead writer
//! is removed as a link (its target untouched). An output path that is a link (`/dev/stdout`
//! included) or not a regular file is refused, never written through or replaced; an output
//! that is an input, holds an input, or is another output (by file identity, however spelled)
//! is refused before any work, with nothing written. Every row runs the real binary.

use crate::common;

use common::{copy_dir, root};
use std::ffi::{OsStr, OsString};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const FIX: &str = "fixtures/tiny-llama-q8_0.gguf";
const GOLDEN: &str = "golden/tiny-llama-q8_0";
const PRECIOUS: &str = "precious: parity must not write here";

fn os(v: &[&dyn AsRef<OsStr>]) -> Vec<OsString> {
    v.iter().map(|s| s.as_ref().to_os_string()).collect()
}

/// Run parity from the repository root (goldens made go to `d`), killed after two minutes:
/// a side file that is a FIFO must not hang it.
fn run(d: &Path, args: &[OsString]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_parity"));
    c.args(args)
        .current_dir(root())
        .env("PARITY_GOLDEN_DIR", d.join("user-goldens"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = c.spawn().expect("run parity");
    let pid = child.id();
    // Waited for on a thread that also drains the pipes (a large --json - fills them).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(o) => o.unwrap(),
        Err(_) => {
            // SAFETY: a kill of the child we spawned (not yet reaped: its waiter still runs).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("parity {args:?} hung (killed after 120 s)");
        }
    }
}

fn show(o: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Exit 2 with one `error:` line on stderr holding every word.
fn refused(o: &Output, words: &[&str], what: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(o.status.code(), Some(2), "{what}: {}", show(o));
    let last = lines.last().copied().unwrap_or("");
    assert!(last.starts_with("error: "), "{what}: {}", show(o));
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("error")).count(),
        1,
        "{what}: one error line: {}",
        show(o)
    );
    for w in words {
        assert!(
            last.contains(w),
            "{what}: `{w}` not in the error line: {}",
            show(o)
        );
    }
}

fn ok(o: &Output, what: &str) {
    assert_eq!(o.status.code(), Some(0), "{what}: {}", show(o));
}

/// A process id that is not running (a child that has ended and been waited for).
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

/// Copy the committed golden to `dir/name` with its model unknown (sha256 zero), so that
/// `diff --weight-type q8_0` compares end to end without looking for the model.
fn trace_copy(dir: &Path, name: &str) -> PathBuf {
    common::golden_unknown_model(dir, name, |_, _| {})
}

/// Every file under `p` (links as links) with its bytes: to prove a folder untouched.
fn tree(p: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v = Vec::new();
    let m = std::fs::symlink_metadata(p).unwrap();
    if m.file_type().is_symlink() {
        v.push((
            p.to_path_buf(),
            std::fs::read_link(p)
                .unwrap()
                .into_os_string()
                .into_encoded_bytes(),
        ));
    } else if m.is_dir() {
        let mut es: Vec<_> = std::fs::read_dir(p)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        es.sort();
        for e in es {
            v.extend(tree(&e));
        }
    } else if m.is_file() {
        v.push((p.to_path_buf(), std::fs::read(p).unwrap()));
    } else {
        // A FIFO or a device: its kind, never its contents (reading a FIFO blocks).
        v.push((p.to_path_buf(), format!("{:?}", m.file_type()).into_bytes()));
    }
    v
}

fn is_link(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

/// The writers that take a `.NAME.lock` beside their output: (what, output name, arguments).
fn lock_writers(d: &Path) -> Vec<(&'static str, &'static str, Vec<OsString>)> {
    let fix = root().join(FIX);
    vec![
        (
            "fixture",
            "out.gguf",
            os(&[&"fixture", &"-o", &d.join("out.gguf")]),
        ),
        (
            "dump",
            "out",
            os(&[
                &"dump",
                &fix,
                &"--golden",
                &GOLDEN,
                &"--out",
                &d.join("out"),
            ]),
        ),
        (
            // The lock is taken before llama.cpp is looked for: no Python needed.
            "golden",
            "out",
            os(&[&"golden", &fix, &"-p", &"hi", &"--out", &d.join("out")]),
        ),
    ]
}

#[test]
fn a_lock_planted_as_a_link_is_refused_and_never_followed() {
    for kind in [
        "link to a file",
        "dangling link",
        "link to a folder",
        "fifo",
    ] {
        for i in 0..3 {
            let tmp = tempfile::tempdir().unwrap();
            let d = tmp.path();
            let outside = d.join("outside");
            std::fs::create_dir(&outside).unwrap();
            let (what, name, args) = lock_writers(d).swap_remove(i);
            let lock = d.join(format!(".{name}.lock"));
            let target = outside.join("target");
            match kind {
                "link to a file" => {
                    std::fs::write(&target, PRECIOUS).unwrap();
                    symlink(&target, &lock).unwrap();
                }
                "dangling link" => symlink(&target, &lock).unwrap(),
                "link to a folder" => symlink(&outside, &lock).unwrap(),
                _ => {
                    let c = std::ffi::CString::new(lock.as_os_str().as_encoded_bytes()).unwrap();
                    // SAFETY: mkfifo on a path in our temp folder.
                    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
                }
            }
            let before = tree(&outside);
            let o = run(d, &args);
            let row = format!("{what} with {kind} at .{name}.lock");
            let word = if kind == "fifo" {
                "not a regular file"
            } else {
                "symbolic link"
            };
            refused(&o, &[".lock", word], &row);
            assert_eq!(tree(&outside), before, "{row}: the outside folder changed");
            assert!(
                !target.exists() || kind == "link to a file",
                "{row}: created the target"
            );
            // Refused, not removed: it is not parity's to judge.
            assert!(
                std::fs::symlink_metadata(&lock).is_ok(),
                "{row}: the planted file is gone"
            );
            assert!(!d.join(name).exists(), "{row}: wrote the output anyway");
        }
    }
}

#[test]
fn stale_partials_planted_as_links_are_removed_without_following_them() {
    let fix = root().join(FIX);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = trace_copy(d, "a");
    let outside = d.join("outside");
    std::fs::create_dir_all(outside.join("sub")).unwrap();
    std::fs::write(outside.join("file"), PRECIOUS).unwrap();
    std::fs::write(outside.join("sub/file"), PRECIOUS).unwrap();
    let pid = dead_pid();
    // (output name, the command writing it)
    let rows: Vec<(&str, Vec<OsString>)> = vec![
        (
            "t",
            os(&[&"dump", &fix, &"--golden", &GOLDEN, &"--out", &d.join("t")]),
        ),
        ("f.gguf", os(&[&"fixture", &"-o", &d.join("f.gguf")])),
        (
            "r.json",
            os(&[
                &"diff",
                &a,
                &a,
                &"--weight-type",
                &"q8_0",
                &"--json",
                &d.join("r.json"),
            ]),
        ),
    ];
    let before = tree(&outside);
    for (name, args) in rows {
        let planted: Vec<PathBuf> = ["", ".gone", ".old"]
            .iter()
            .enumerate()
            .map(|(i, suffix)| {
                let p = d.join(format!(".{name}.partial-{pid}{suffix}"));
                // To a folder, to a file, dangling: each removed as a link.
                let to = [outside.clone(), outside.join("file"), outside.join("none")][i].clone();
                symlink(to, &p).unwrap();
                p
            })
            .collect();
        let o = run(d, &args);
        ok(&o, name);
        for p in &planted {
            assert!(
                !is_link(p),
                "{name}: the stale link {} was left",
                p.display()
            );
        }
        assert!(
            !outside.join("none").exists(),
            "{name}: a dangling link was followed"
        );
        assert_eq!(
            tree(&outside),
            before,
            "{name}: followed a stale partial's link"
        );
        assert!(d.join(name).exists(), "{name}: not written");
    }
}

#[test]
fn output_paths_that_are_links_are_refused() {
    type Args = fn(&Path, &Path, &Path) -> Vec<OsString>;
    // (row, the flag's words, args given: temp folder, a trace, the link)
    let rows: Vec<(&str, &[&str], Args)> = vec![
        (
            "diff --json",
            &["--json", "symbolic link", "`-`"],
            |_, a, l| os(&[&"diff", &a, &a, &"--weight-type", &"q8_0", &"--json", &l]),
        ),
        ("diff --html", &["--html", "symbolic link"], |_, a, l| {
            os(&[&"diff", &a, &a, &"--weight-type", &"q8_0", &"--html", &l])
        }),
        (
            "diff --snapshot",
            &["--snapshot", "symbolic link"],
            |_, a, l| {
                os(&[
                    &"diff",
                    &a,
                    &a,
                    &"--weight-type",
                    &"q8_0",
                    &"--snapshot",
                    &l,
                ])
            },
        ),
        ("check --html", &["--html", "symbolic link"], |_, _, l| {
            os(&[&"check", &root().join(FIX), &"--html", &l])
        }),
        (
            "fixture --force -o",
            &["--out", "symbolic link"],
            |_, _, l| os(&[&"fixture", &"--force", &"-o", &l]),
        ),
    ];
    for kind in ["to a file", "dangling"] {
        for (row, words, args) in &rows {
            let tmp = tempfile::tempdir().unwrap();
            let d = tmp.path();
            let a = trace_copy(d, "a");
            let outside = d.join("outside");
            std::fs::create_dir(&outside).unwrap();
            let target = outside.join("target");
            if kind == "to a file" {
                std::fs::write(&target, PRECIOUS).unwrap();
            }
            let link = d.join("out.link");
            symlink(&target, &link).unwrap();
            let before = tree(&outside);
            let o = run(d, &args(d, &a, &link));
            let what = format!("{row} {kind}");
            refused(&o, words, &what);
            assert_eq!(tree(&outside), before, "{what}: wrote through the link");
            assert!(is_link(&link), "{what}: the link was replaced");
        }
    }
    // Folder outputs: a link to a folder is not written through either.
    let folder_rows: Vec<(&str, Args)> = vec![
        ("dump --out", |_, _, l| {
            os(&[
                &"dump",
                &root().join(FIX),
                &"--golden",
                &GOLDEN,
                &"--out",
                &l,
                &"--force",
            ])
        }),
        ("golden --out", |_, _, l| {
            os(&[
                &"golden",
                &root().join(FIX),
                &"-p",
                &"hi",
                &"--out",
                &l,
                &"--force",
            ])
        }),
        ("selftest --keep", |_, _, l| {
            os(&[&"selftest", &"--keep", &l])
        }),
    ];
    for (row, args) in folder_rows {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let outside = d.join("outside");
        std::fs::create_dir(&outside).unwrap();
        let link = d.join("out");
        symlink(&outside, &link).unwrap();
        let o = run(d, &args(d, d, &link));
        refused(&o, &["symbolic link"], row);
        assert!(
            tree(&outside).is_empty(),
            "{row}: wrote into the link's folder"
        );
        assert!(is_link(&link), "{row}: the link was replaced");
    }
}

#[test]
fn json_to_dev_stdout_is_refused_and_dash_is_stdout() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = trace_copy(d, "a");
    // The link a shell offers for stdout: `-` is the spelling parity takes.
    if is_link(Path::new("/dev/stdout")) {
        let o = run(
            d,
            &os(&[
                &"diff",
                &a,
                &a,
                &"--weight-type",
                &"q8_0",
                &"--json",
                &"/dev/stdout",
            ]),
        );
        refused(
            &o,
            &["--json /dev/stdout", "symbolic link", "`-`"],
            "--json /dev/stdout",
        );
        assert!(is_link(Path::new("/dev/stdout")));
    }
    let o = run(
        d,
        &os(&[&"diff", &a, &a, &"--weight-type", &"q8_0", &"--json", &"-"]),
    );
    ok(&o, "--json -");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is the JSON");
    assert!(v.is_object(), "{}", show(&o));
    // A device is refused, never replaced (whoever runs it).
    for flag in ["--html", "--snapshot"] {
        let o = run(
            d,
            &os(&[
                &"diff",
                &a,
                &a,
                &"--weight-type",
                &"q8_0",
                &flag,
                &"/dev/null",
            ]),
        );
        refused(&o, &[flag, "/dev/null", "not a regular file"], flag);
    }
}

/// Hands back (temp folder guard, a writable copy of the fixture, a golden copy) for a row.
fn inputs_here() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m.gguf");
    std::fs::copy(root().join(FIX), &m).unwrap();
    let g = tmp.path().join("g");
    copy_dir(&root().join(GOLDEN), &g);
    (tmp, m, g)
}

#[test]
fn outputs_that_are_inputs_are_refused_before_any_work() {
    type Args = fn(&Path, &Path, &Path) -> Vec<OsString>;
    // (row, words of the error line, args from (temp folder, model copy, golden copy),
    // files that must not exist afterwards)
    let rows: Vec<(&str, &[&str], Args, &[&str])> = vec![
        (
            "diff --html the baseline's manifest",
            &["--html", "manifest.json of the input trace baseline"],
            |_, _, g| os(&[&"diff", &g, &g, &"--html", &g.join("manifest.json")]),
            &[],
        ),
        (
            "diff --json a candidate tap spelled with ..",
            &["--json", "s000/logits.npy of the input trace", "candidate"],
            |d, _, g| {
                let b = d.join("b");
                copy_dir(g, &b);
                os(&[
                    &"diff",
                    &g,
                    &b,
                    &"--json",
                    &b.join("s001/../s000/logits.npy"),
                ])
            },
            &[],
        ),
        (
            "diff --snapshot a hard link of the golden's manifest",
            &["--snapshot", "manifest.json of the input trace"],
            |d, _, g| {
                std::fs::hard_link(g.join("manifest.json"), d.join("h.snap")).unwrap();
                os(&[&"diff", &g, &g, &"--snapshot", &d.join("h.snap")])
            },
            &[],
        ),
        (
            "diff --model M --html M",
            &["--html", "the input --model"],
            |_, m, g| os(&[&"diff", &g, &g, &"--model", &m, &"--html", &m]),
            &[],
        ),
        (
            "check M --json M",
            &["--json", "is the input the model"],
            |_, m, _| os(&[&"check", &m, &"--json", &m]),
            &[],
        ),
        (
            "check --golden G --html G/manifest.json",
            &["--html", "manifest.json of the input trace --golden"],
            |_, m, g| {
                os(&[
                    &"check",
                    &m,
                    &"--golden",
                    &g,
                    &"--html",
                    &g.join("manifest.json"),
                ])
            },
            &[],
        ),
        (
            "check --json the gate's snapshot",
            &["--json", "the input --against"],
            |d, m, g| {
                std::fs::write(d.join("s.snap"), "old snapshot").unwrap();
                os(&[
                    &"check",
                    &m,
                    &"--golden",
                    &g,
                    &"--json",
                    &d.join("s.snap"),
                    &"--against",
                    &d.join("s.snap"),
                ])
            },
            &[],
        ),
        (
            "dump M --golden G --out G --force",
            &["--out", "is the input --golden"],
            |_, m, g| os(&[&"dump", &m, &"--golden", &g, &"--out", &g, &"--force"]),
            &[],
        ),
        (
            "dump --out a folder holding the golden it replays",
            &["--out", "holds the input"],
            |d, m, g| os(&[&"dump", &m, &"--golden", &g, &"--out", &d, &"--force"]),
            &[],
        ),
        (
            "dump --out G/s000 --force: a step folder of the golden it replays",
            &["--out", "holds s000/", "of the input --golden"],
            |_, m, g| {
                os(&[
                    &"dump",
                    &m,
                    &"--golden",
                    &g,
                    &"--out",
                    &g.join("s000"),
                    &"--force",
                ])
            },
            &[],
        ),
        (
            "dump --out G/x --force, where G's manifest names its taps x/sNNN/* and G/x looks like a trace",
            &["--out", "holds x/s000/", "of the input --golden"],
            |_, m, g| {
                // The golden's taps moved under x/, with a manifest there that --force accepts.
                let mp = g.join("manifest.json");
                let mut j: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
                std::fs::create_dir_all(g.join("x")).unwrap();
                for t in j["tensors"].as_array_mut().unwrap() {
                    let f = t["file"].as_str().unwrap().to_string();
                    let to = g.join("x").join(&f);
                    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
                    if !to.exists() {
                        std::fs::rename(g.join(&f), &to).unwrap();
                    }
                    t["file"] = format!("x/{f}").into();
                }
                std::fs::copy(&mp, g.join("x/manifest.json")).unwrap();
                std::fs::write(&mp, serde_json::to_string(&j).unwrap()).unwrap();
                os(&[
                    &"dump",
                    &m,
                    &"--golden",
                    &g,
                    &"--out",
                    &g.join("x"),
                    &"--force",
                ])
            },
            &[],
        ),
        (
            "golden --out the folder holding the model",
            &["--out", "holds the input the model"],
            |d, m, _| os(&[&"golden", &m, &"-p", &"hi", &"--out", &d, &"--force"]),
            &[],
        ),
        (
            "golden --out the model file itself",
            &["--out", "is the input the model"],
            |_, m, _| os(&[&"golden", &m, &"-p", &"hi", &"--out", &m, &"--force"]),
            &[],
        ),
        (
            "selftest --keep a folder holding its golden",
            &["--keep", "holds the input"],
            |d, m, g| os(&[&"selftest", &m, &"--golden", &g, &"--keep", &d]),
            &[],
        ),
        (
            "--json d/r.json --html d/../d/r.json",
            &["--html", "the same file as --json"],
            |d, _, g| {
                let html = d.join("../").join(d.file_name().unwrap()).join("r.json");
                os(&[
                    &"diff",
                    &g,
                    &g,
                    &"--json",
                    &d.join("r.json"),
                    &"--html",
                    &html,
                ])
            },
            &["r.json"],
        ),
        (
            "--against S --html S.new",
            &["--against (its .new)", "the same file as --html"],
            |d, _, g| {
                std::fs::write(d.join("s.snap"), "old snapshot").unwrap();
                os(&[
                    &"diff",
                    &g,
                    &g,
                    &"--against",
                    &d.join("s.snap"),
                    &"--html",
                    &d.join("s.snap.new"),
                ])
            },
            &["s.snap.new"],
        ),
    ];
    for (row, words, args, absent) in rows {
        let (tmp, m, g) = inputs_here();
        let d = tmp.path();
        let args = args(d, &m, &g);
        let before = tree(d);
        let o = run(d, &args);
        refused(&o, words, row);
        assert_eq!(tree(d), before, "{row}: something was written or changed");
        for a in absent {
            assert!(!d.join(a).exists(), "{row}: {a} was written");
        }
    }
}

#[test]
fn outputs_beside_inputs_still_work() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = trace_copy(d, "a");
    let b = trace_copy(d, "b");
    let snap = d.join("s.snap");
    let diff = |extra: &[&dyn AsRef<OsStr>]| {
        let mut v = os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"]);
        v.extend(os(extra));
        run(d, &v)
    };
    ok(&diff(&[&"--snapshot", &snap]), "--snapshot");
    // The gate may rewrite its own snapshot: it is read before anything is written.
    ok(
        &diff(&[&"--snapshot", &snap, &"--against", &snap]),
        "--snapshot S --against S",
    );
    // A new file inside an input trace folder is none of the trace's files.
    let page = b.join("report.html");
    ok(
        &diff(&[&"--html", &page, &"--json", &d.join("r.json")]),
        "--html inside a trace",
    );
    assert!(page.is_file() && d.join("r.json").is_file());
    // A dump may replace its own earlier output (--force), not an input.
    let t = d.join("t");
    let fix = root().join(FIX);
    let dump = || {
        run(
            d,
            &os(&[
                &"dump",
                &fix,
                &"--golden",
                &GOLDEN,
                &"--out",
                &t,
                &"--force",
            ]),
        )
    };
    ok(&dump(), "dump");
    ok(&dump(), "dump --force over its own trace");
}

/// As root, in a private mount namespace with a tmpfs over /dev (the machine's own /dev is
/// never at risk): `--json /dev/stdout` and a device path are refused, the link and the device
/// stay what they were.
#[test]
#[cfg_attr(
    not(parity_mount_ns),
    ignore = "needs root and `unshare -m` (a private mount namespace; build.rs probes it)"
)]
fn as_root_dev_stdout_and_devices_are_never_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = trace_copy(d, "a");
    let script = r#"
set -u
mount --make-rprivate / || exit 90
mount -t tmpfs tmpfs /dev || exit 91
ln -s /proc/self/fd/1 /dev/stdout
mknod -m 666 /dev/null c 1 3
mknod -m 666 /dev/zero c 1 5
"$PARITY" diff "$A" "$A" --weight-type q8_0 --json /dev/stdout >"$D/o1" 2>"$D/e1"; echo $? >"$D/rc1"
"$PARITY" diff "$A" "$A" --weight-type q8_0 --html /dev/null >"$D/o2" 2>"$D/e2"; echo $? >"$D/rc2"
"$PARITY" fixture --force -o /dev/zero >"$D/o3" 2>"$D/e3"; echo $? >"$D/rc3"
ln -s /dev/null "$D/planted"
"$PARITY" diff "$A" "$A" --weight-type q8_0 --snapshot "$D/planted" >"$D/o4" 2>"$D/e4"; echo $? >"$D/rc4"
if [ -L /dev/stdout ]; then echo link; else echo replaced; fi >"$D/stdout-kind"
if [ -c /dev/null ] && [ -c /dev/zero ]; then echo devices; else echo replaced; fi >"$D/dev-kind"
"#;
    let o = Command::new("unshare")
        .args(["-m", "sh", "-c", script])
        .env("PARITY", env!("CARGO_BIN_EXE_parity"))
        .env("A", &a)
        .env("D", d)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "the namespace script: {}", show(&o));
    let read = |n: &str| std::fs::read_to_string(d.join(n)).unwrap_or_default();
    for (i, words) in [
        (1, &["--json /dev/stdout", "symbolic link", "`-`"][..]),
        (2, &["--html /dev/null", "not a regular file"][..]),
        (3, &["--out /dev/zero", "not a regular file"][..]),
        (4, &["--snapshot", "planted", "symbolic link"][..]),
    ] {
        let rc = read(&format!("rc{i}"));
        let err = read(&format!("e{i}"));
        assert_eq!(rc.trim(), "2", "row {i}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "row {i}: one line: {err}");
        for w in words {
            assert!(lines[0].contains(w), "row {i}: `{w}` not in {err}");
        }
    }
    assert_eq!(
        read("stdout-kind").trim(),
        "link",
        "/dev/stdout was replaced"
    );
    assert_eq!(
        read("dev-kind").trim(),
        "devices",
        "a device node was replaced"
    );
}

/// `dump --out T.npz` writes one archive: a link at T.npz (to a file, to a folder, dangling),
/// a folder or a device named T.npz, and a file that is not a trace archive are refused before
/// any work, with nothing changed; an archive parity wrote is replaced with --force only, and a
/// stale partial of a dead writer planted as a link is removed without following it.
#[test]
fn npz_outputs_replace_only_a_trace_archive() {
    let dump = |d: &Path, out: &Path, force: bool| {
        let fix = root().join(FIX);
        let mut v = os(&[&"dump", &fix, &"--golden", &GOLDEN, &"--out", &out]);
        if force {
            v.push("--force".into());
        }
        run(d, &v)
    };
    for (kind, words) in [
        ("link to a file", &["symbolic link"][..]),
        ("link to a folder", &["symbolic link"]),
        ("dangling link", &["symbolic link"]),
        ("folder", &["is a folder", "one file"]),
        ("fifo", &["not a regular file"]),
        (
            "another zip",
            &["not a trace archive", "--force replaces a trace only"],
        ),
        ("text file", &["not a trace archive"]),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let outside = d.join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("target"), PRECIOUS).unwrap();
        let out = d.join("t.npz");
        match kind {
            "link to a file" => symlink(outside.join("target"), &out).unwrap(),
            "link to a folder" => symlink(&outside, &out).unwrap(),
            "dangling link" => symlink(outside.join("gone"), &out).unwrap(),
            "folder" => std::fs::create_dir(&out).unwrap(),
            "fifo" => {
                let c = std::ffi::CString::new(out.to_str().unwrap()).unwrap();
                // SAFETY: a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }
            // A zip without manifest.json (what `zip` or np.savez of anything else writes).
            "another zip" => {
                let mut w = parity_trace::archive::ArchiveWriter::new();
                w.add("x.npy", b"not a tap").unwrap();
                std::fs::write(&out, w.finish().unwrap()).unwrap();
            }
            _ => std::fs::write(&out, PRECIOUS).unwrap(),
        }
        let before = tree(d);
        for force in [false, true] {
            let what = format!("{kind} (force {force})");
            // A regular file is refused as existing first; --force then asks what it is.
            let regular = std::fs::symlink_metadata(&out).is_ok_and(|m| m.is_file());
            let words = if regular && !force {
                &["exists", "--force"][..]
            } else {
                words
            };
            refused(&dump(d, &out, force), words, &what);
            assert_eq!(tree(d), before, "{what}: something was written or changed");
        }
    }
    // A trace archive: kept without --force, replaced with it; the partial a killed writer
    // left, planted as a link, is removed as a link.
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let out = d.join("t.npz");
    ok(&dump(d, &out, false), "dump to a new .npz");
    let first = std::fs::read(&out).unwrap();
    refused(&dump(d, &out, false), &["exists", "--force"], "no --force");
    assert_eq!(std::fs::read(&out).unwrap(), first);
    std::fs::write(d.join("precious"), PRECIOUS).unwrap();
    let stale = d.join(format!(".t.npz.partial-{}", dead_pid()));
    symlink(d.join("precious"), &stale).unwrap();
    ok(&dump(d, &out, true), "dump --force over its own archive");
    assert!(
        std::fs::symlink_metadata(&stale).is_err(),
        "stale partial kept"
    );
    assert_eq!(
        std::fs::read_to_string(d.join("precious")).unwrap(),
        PRECIOUS
    );
    // Nothing but the archive (and the untouched file) is left beside it.
    let mut names: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["precious", "t.npz"]);
}
