//! The terminal report: colour by closeness to threshold only on a colour terminal (forced here
//! with CLICOLOR_FORCE, off with NO_COLOR and on pipes), and `--quiet` printing the verdict only.

use crate::common;
use common::*;

const ESC: &str = "\x1b[";

#[test]
fn colour_only_when_the_terminal_takes_it() {
    // A pipe: plain text.
    let o = parity(&["check", "-v"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(!stdout(&o).contains(ESC), "{}", show(&o));
    // Forced colour: the table's cells are coloured; bit-identical ones dim green (2;32).
    let o = parity_env(&["check", "-v"], &[("CLICOLOR_FORCE", "1")]);
    let s = stdout(&o);
    assert!(s.contains(ESC), "{}", show(&o));
    assert!(s.contains("\x1b[2m\x1b[32m exact"), "{s}");
    // Stripping the escapes gives back the plain text (less the timing line, which varies).
    let plain = stdout(&parity(&["check", "-v"]));
    let re = regex::Regex::new("\x1b\\[[0-9;]*m").unwrap();
    let untimed = |t: &str| {
        t.lines()
            .filter(|l| !l.starts_with("backends:"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(untimed(&re.replace_all(&s, "")), untimed(&plain));
    // NO_COLOR wins over CLICOLOR_FORCE.
    let o = parity_env(
        &["check", "-v"],
        &[("CLICOLOR_FORCE", "1"), ("NO_COLOR", "1")],
    );
    assert!(!stdout(&o).contains(ESC), "{}", show(&o));
}

#[test]
fn a_divergence_is_red() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    copy_dir(&root().join("golden/tiny-llama-q8_0"), &dir);
    let p = dir.join("s000/embd.npy");
    let (shape, mut data) = read_npy(&p);
    data.iter_mut().for_each(|x| *x *= 1.5);
    write_npy(&p, &shape, &data);
    let o = parity_env(
        &["diff", "golden/tiny-llama-q8_0", dir.to_str().unwrap()],
        &[("CLICOLOR_FORCE", "1")],
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    // Bold red over the threshold.
    assert!(stdout(&o).contains("\x1b[1m\x1b[31m"), "{}", show(&o));
}

#[test]
fn quiet_prints_the_verdict_only() {
    let o = parity(&["check", "--quiet"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(stdout(&o), format!("{}\n", default_verdict()));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    copy_dir(&root().join("golden/tiny-llama-q8_0"), &dir);
    let p = dir.join("s001/ffn_out-0.npy");
    let (shape, mut data) = read_npy(&p);
    data[5] = f32::NAN;
    write_npy(&p, &shape, &data);
    let o = parity(&[
        "diff",
        "-q",
        "golden/tiny-llama-q8_0",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert_eq!(
        stdout(&o),
        "verdict: 2 of 2 comparisons diverged\n",
        "{}",
        show(&o)
    );
}

/// The first screen of a clean `parity check`: the one comparison that matters (the tightest
/// against the golden: op by op), a count of the rest with where to find them, the verdict; no
/// drift tables. `--verbose` prints every comparison and the end-to-end tables.
#[test]
fn the_first_screen_is_the_verdict_and_the_comparison_that_matters() {
    let o = parity(&["check"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let s = stdout(&o);
    let paragraphs = s.lines().filter(|l| l.starts_with("PARITY (")).count();
    assert_eq!(paragraphs, 1, "{s}");
    assert!(
        s.lines().any(|l| l.starts_with("PARITY (")
            && l.contains("op by op on the baseline's inputs")
            && l.contains("vs llama.cpp/")),
        "{s}"
    );
    assert!(!s.contains("log10 NMSE"), "{s}");
    let rest = format!(
        "{} comparisons, 0 diverged; {} more within tolerance not shown: --verbose",
        default_comparisons(),
        default_comparisons() - 1
    );
    assert!(s.contains(&rest), "{s}");
    assert_eq!(s.lines().last(), Some(default_verdict().as_str()), "{s}");

    let o = parity(&["check", "--verbose"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let s = stdout(&o);
    let paragraphs = s.lines().filter(|l| l.starts_with("PARITY (")).count();
    assert_eq!(paragraphs, default_comparisons(), "{s}");
    assert!(s.contains("log10 NMSE"), "{s}");
    assert!(!s.contains("not shown"), "{s}");
}
