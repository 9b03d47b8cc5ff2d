//! The step kinds real serving uses (issue 29, item 3): a prompt fed in chunks, a prompt fed
//! one token at a time, and a second turn appended after decode steps. Real llama.cpp goldens
//! of each are judged clean op by op and pass `check` (every backend fed the golden's steps as
//! it was fed them); the out-of-process numpy engine, following the golden's steps, passes
//! clean and is caught, at the right step, with a bug that acts from the second step on.

mod common;
use common::*;
use std::path::Path;

fn fixture(dir: &Path) -> String {
    let m = dir.join("m.gguf");
    let o = parity(&[
        "fixture",
        "--out",
        m.to_str().unwrap(),
        "--n-ctx",
        "512",
        "--seed",
        "11",
    ]);
    assert!(o.status.success(), "{}", show(&o));
    m.to_str().unwrap().to_string()
}

fn ids(n: usize, mul: usize, off: usize) -> String {
    (0..n)
        .map(|i| (off + (i * mul) % 380).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// (positions[0], token count) of each step of a trace.
fn shape(dir: &Path) -> Vec<(u64, usize)> {
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    m["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["positions"][0].as_u64().unwrap(),
                s["tokens"].as_array().unwrap().len(),
            )
        })
        .collect()
}

#[test]
#[cfg_attr(not(parity_llama_cpp), ignore = "needs llama-cpp-python (.venv)")]
fn chunked_one_token_and_multi_turn_goldens_are_judged_and_checked() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture(tmp.path());
    let prompt = ids(70, 37, 3);
    let turn = ids(20, 53, 5);
    // (flags, the steps' (first position, tokens) the golden must have)
    type Case<'a> = (Vec<&'a str>, Vec<(u64, usize)>);
    let cases: Vec<Case> = vec![
        (
            vec!["--chunk", "32", "--steps", "2"],
            vec![(0, 32), (32, 32), (64, 6), (70, 1), (71, 1)],
        ),
        (
            vec!["--steps", "2", "--turn", &turn],
            vec![(0, 70), (70, 1), (71, 1), (72, 20), (92, 1), (93, 1)],
        ),
        (
            vec![
                "--chunk",
                "16",
                "--steps",
                "1",
                "--turn",
                &turn,
                "--llama-defaults",
            ],
            vec![
                (0, 16),
                (16, 16),
                (32, 16),
                (48, 16),
                (64, 6),
                (70, 1),
                (71, 16),
                (87, 4),
                (91, 1),
            ],
        ),
    ];
    for (i, (flags, want)) in cases.iter().enumerate() {
        let g = tmp.path().join(format!("g{i}"));
        let mut args = vec![
            "golden",
            &m,
            "--tokens",
            &prompt,
            "--out",
            g.to_str().unwrap(),
        ];
        args.extend(flags.iter().copied());
        let o = parity(&args);
        assert!(o.status.success(), "golden {flags:?}: {}", show(&o));
        assert_eq!(&shape(&g), want, "{flags:?}");
        let o = parity(&[
            "diff",
            "--model",
            &m,
            g.to_str().unwrap(),
            g.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "diff {flags:?}: {}", show(&o));
        assert!(
            stdout(&o).contains("every op within its noise floor"),
            "{}",
            show(&o)
        );
        let o = parity(&["check", &m, "--golden", g.to_str().unwrap()]);
        assert!(o.status.success(), "check {flags:?}: {}", show(&o));
    }
    // One token at a time: as many steps as prompt tokens, then the decode steps.
    let g = tmp.path().join("one");
    let short = ids(12, 37, 3);
    let o = parity(&[
        "golden",
        &m,
        "--tokens",
        &short,
        "--chunk",
        "1",
        "--steps",
        "2",
        "--out",
        g.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", show(&o));
    let s = shape(&g);
    assert_eq!(s.len(), 14);
    assert!(
        s.iter()
            .enumerate()
            .all(|(i, &(p, n))| p == i as u64 && n == 1),
        "{s:?}"
    );
    let o = parity(&["check", &m, "--golden", g.to_str().unwrap()]);
    assert!(o.status.success(), "{}", show(&o));
}

#[test]
#[cfg_attr(not(parity_llama_cpp), ignore = "needs llama-cpp-python (.venv)")]
fn an_engine_fed_in_chunks_is_judged_per_step_and_caught_at_the_second_chunk() {
    if !llama_cpp_or_skip() {
        return;
    }
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture(tmp.path());
    let g = tmp.path().join("golden");
    let prompt = ids(70, 37, 3);
    let turn = ids(20, 53, 5);
    let o = parity(&[
        "golden",
        &m,
        "--tokens",
        &prompt,
        "--chunk",
        "32",
        "--steps",
        "2",
        "--turn",
        &turn,
        "--out",
        g.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", show(&o));
    for taps in ["all", "sparse"] {
        for bug in [None, Some("kv-off-by-one"), Some("rope-pos-off-by-one")] {
            let out = tmp
                .path()
                .join(format!("e-{taps}-{}", bug.unwrap_or("clean")));
            numpy_engine_trace(&py, &m, &g, &out, bug, &["--taps", taps]);
            assert_eq!(
                shape(&out),
                shape(&g),
                "the engine follows the golden's steps"
            );
            let tmpj = out.with_extension("json");
            let o = parity(&[
                "diff",
                "--model",
                &m,
                g.to_str().unwrap(),
                out.to_str().unwrap(),
                "--json",
                tmpj.to_str().unwrap(),
            ]);
            let text = show(&o);
            match bug {
                None => assert_eq!(o.status.code(), Some(0), "clean {taps}:\n{text}"),
                Some(b) => {
                    assert_eq!(o.status.code(), Some(1), "{b} {taps}:\n{text}");
                    // Both bugs act from the second step on: the prompt's second chunk.
                    let r: serde_json::Value =
                        serde_json::from_slice(&std::fs::read(&tmpj).unwrap()).unwrap();
                    let at = &own_inputs(&r)["first_divergence"]["at"]["key"];
                    assert_eq!(at["step"], 1, "{b} {taps}:\n{text}");
                    assert_eq!(at["layer"], 0, "{b} {taps}:\n{text}");
                    assert!(
                        text.contains(&format!("confirmed by experiment: {b}")),
                        "{b} {taps}:\n{text}"
                    );
                }
            }
        }
    }
}

#[test]
#[cfg_attr(not(parity_llama_cpp), ignore = "needs llama-cpp-python (.venv)")]
fn a_turn_that_is_not_ids_of_the_model_is_refused_in_one_line() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("g");
    for (turn, says) in [
        ("5,99999", "token id 99999 out of range"),
        ("4,x\n\u{1b}[31m", "--turn"),
    ] {
        let o = parity(&[
            "golden",
            "fixtures/tiny-llama-q8_0.gguf",
            "--tokens",
            "1,2,3",
            "--steps",
            "1",
            "--turn",
            turn,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", show(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says), "{err}");
        assert!(
            !err.contains('\u{1b}'),
            "a control character reached the terminal: {err:?}"
        );
        assert_eq!(
            err.lines().filter(|l| l.starts_with("error")).count(),
            1,
            "{err}"
        );
        assert!(!out.exists(), "nothing written");
    }
}
