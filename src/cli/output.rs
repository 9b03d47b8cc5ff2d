//! What a comparison run leaves behind: the terminal text, the JSON report, the HTML page, the CI
//! snapshot and gate, the verdict line and the exit code. `check` and `diff` both end here, so
//! every output format renders the same comparisons.

use super::{Result, err, repo_root};
use crate::compare::Comparison;
use crate::gguf::GgufFile;
use crate::judge::verdict::Outcome;
use crate::model::sha256_hex;
use crate::model::tokenizer::Tokenizer;
use crate::report::{self, RunInfo, snapshot};
use crate::trace::{ModelRef, Trace};
use anstyle::{AnsiColor, Style};
use clap::Args;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

#[derive(Args, Clone, Default)]
pub struct ReportArgs {
    /// Write the report as JSON (schema: docs/report-json.md); `-` writes it to stdout and moves
    /// the human-readable text to stderr.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write a self-contained HTML report: error curves, heat maps, diagnosis, tokens, settings.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Write a CI snapshot: per layer and tap kind, the NMSE as a decade bucket; the verdicts and
    /// first divergences (an insta-compatible .snap file; see docs/ci.md).
    #[arg(long, value_name = "FILE")]
    pub snapshot: Option<PathBuf>,
    /// Fail (exit 1) when the numerics moved out of their buckets in this snapshot, printing what
    /// moved, and write FILE.new beside it (`cargo insta review` can accept it).
    #[arg(long, value_name = "FILE")]
    pub against: Option<PathBuf>,
    /// Print the verdict line only.
    #[arg(long, short)]
    pub quiet: bool,
}

impl ReportArgs {
    fn json_to_stdout(&self) -> bool {
        self.json.as_deref() == Some(Path::new("-"))
    }

    /// Every output path checked before any work: its folder exists and takes a file, it is
    /// absent or a regular file (not a link: `-` is stdout's only spelling), no two outputs are
    /// one file, none is one of `inputs` (a model, a trace folder's files, the gate's
    /// snapshot) by file identity, and only `--json` may be `-` (stdout). A bad path fails
    /// here, in one line, with nothing written.
    pub fn validate(&self, inputs: &[(&Path, &str)]) -> Result<()> {
        let mut outputs: Vec<(&Path, &str)> = Vec::new();
        for (flag, p) in [
            ("--json", &self.json),
            ("--html", &self.html),
            ("--snapshot", &self.snapshot),
        ] {
            let Some(p) = p else { continue };
            if p.as_os_str() == "-" {
                if flag == "--json" {
                    continue;
                }
                return Err(err(format!(
                    "{flag} -: only --json can go to stdout (give {flag} a file name)"
                )));
            }
            crate::trace::staging::check_output_file(p, flag).map_err(err)?;
            outputs.push((p, flag));
        }
        let new = self
            .against
            .as_ref()
            .map(|p| PathBuf::from(format!("{}.new", p.display())));
        if let Some(new) = &new {
            outputs.push((new, "--against (its .new)"));
        }
        // The gate's snapshot is an input of every output but --snapshot, which may rewrite
        // it on purpose (it is read before anything is written).
        let mut all: Vec<(&Path, &str)> = inputs.to_vec();
        if let Some(s) = &self.against {
            all.push((s, "--against"));
        }
        let not_snapshot: Vec<(&Path, &str)> = outputs
            .iter()
            .copied()
            .filter(|(_, f)| *f != "--snapshot")
            .collect();
        crate::trace::paths::check_paths(&all, &not_snapshot).map_err(err)?;
        crate::trace::paths::check_paths(inputs, &outputs).map_err(err)?;
        if let Some(p) = &self.against {
            match std::fs::metadata(p) {
                Ok(m) if m.is_file() => {}
                Ok(_) => {
                    return Err(err(format!(
                        "--against {}: not a regular file",
                        p.display()
                    )));
                }
                Err(e) => {
                    return Err(err(format!(
                        "--against {}: {e} (write one first with --snapshot {})",
                        p.display(),
                        p.display()
                    )));
                }
            }
            if let Some(new) = &new {
                crate::trace::staging::check_output_file(new, "--against (its .new)")
                    .map_err(err)?;
            }
        }
        Ok(())
    }
}

/// Print one comparison for people: a header, the per-layer table when `with_table`, the verdict
/// paragraph. Nothing with `--quiet`; on stderr when stdout carries the JSON.
pub fn show(c: &Comparison, header: &str, with_table: bool, out: &ReportArgs) {
    if out.quiet {
        return;
    }
    // Headers name the traces' producers: escaped as one line.
    let header = report::shown::line(header);
    let text = format!(
        "{header}\n{}{}\n",
        if with_table {
            report::table_styled(
                c,
                if out.json_to_stdout() {
                    anstream::AutoStream::choice(&std::io::stderr()) != anstream::ColorChoice::Never
                } else {
                    report::colour_stdout()
                },
            )
        } else {
            String::new()
        },
        report::verdict(c)
    );
    if out.json_to_stdout() {
        eprintln!("{text}");
    } else {
        println!("{text}");
    }
}

/// The traces' manifests, for the reports' run settings and token ids.
pub fn run_info<'a>(traces: impl IntoIterator<Item = &'a Trace>) -> RunInfo {
    RunInfo::from_traces(traces)
}

/// The model file a manifest names, as recorded or relative to the repository (goldens record
/// repo-relative paths), if it is here and its sha256 matches the recorded one. Without a
/// recorded sha256 nothing is adopted: any file of that name would do, e.g. an unrelated
/// `./model.gguf` whose tokenizer would put its own words in the report.
fn model_file(path: &str, sha256: &str) -> Option<GgufFile> {
    if sha256.is_empty() {
        return None;
    }
    let p = Path::new(path);
    [p.to_path_buf(), repo_root().join(p)]
        .into_iter()
        .filter(|c| std::fs::metadata(c).is_ok_and(|m| m.is_file() && m.len() > 0))
        .filter_map(|c| GgufFile::open(&c).ok())
        .find(|f| sha256_hex(f.bytes()) == sha256)
}

/// Decode every trace's ids with its model's own tokenizer, where the model file is at hand, and
/// the ids of token mismatches that the comparison left undecoded.
fn decode_texts(info: &mut RunInfo, comparisons: &[Comparison]) -> Vec<Comparison> {
    let mut cache: HashMap<(String, String), Option<Rc<Tokenizer>>> = HashMap::new();
    let mut tokenizer = |m: &ModelRef| -> Option<Rc<Tokenizer>> {
        cache
            .entry((m.path.clone(), m.sha256.clone()))
            .or_insert_with(|| {
                model_file(&m.path, &m.sha256)
                    .and_then(|f| Tokenizer::from_gguf(&f).ok())
                    .map(Rc::new)
            })
            .clone()
    };
    for t in &mut info.traces {
        if let Some(tok) = tokenizer(&t.model) {
            t.text = Some(t.steps.iter().map(|s| tok.decode(&s.tokens)).collect());
        }
    }
    let mut out = comparisons.to_vec();
    for c in &mut out {
        // A derived comparison (e.g. against the candidate's own inputs) names no trace: any
        // trace's model will do, all of a run's traces are of one model.
        let (b, k) = info.sides(c);
        let model = b.or(k).or(info.traces.first()).map(|t| t.model.clone());
        if let (Some(tm), Some(m)) = (c.token_mismatch.as_mut(), model)
            && tm.baseline_text.is_none()
            && let Some(tok) = tokenizer(&m)
        {
            tm.decode_with(|ids| tok.decode(ids));
        }
    }
    out
}

/// Whole or not at all (a full disk leaves no half page), the message naming the flag.
fn write_file(flag: &str, p: &Path, text: &str) -> Result<()> {
    crate::trace::staging::write_whole(p, text.as_bytes()).map_err(|e| err(format!("{flag} {e}")))
}

/// The command for the snapshot header: `parity check`, `parity diff`.
fn command() -> String {
    match std::env::args().nth(1) {
        Some(sub) => format!("parity {sub}"),
        None => "parity".into(),
    }
}

/// Render a run's outcome: write the requested reports, run the gate, print the verdict line;
/// the exit code is the outcome's (`Outcome::exit_code`, given what the gate found).
/// `inputs` are every path the run read (asked again here: `check` finds its golden only
/// while it runs).
pub fn finish_with(
    outcome: &Outcome,
    info: &RunInfo,
    out: &ReportArgs,
    inputs: &[(&Path, &str)],
) -> Result<ExitCode> {
    out.validate(inputs)?;
    // Read the gate's snapshot before anything is written (it may be the --snapshot path too).
    let old = match &out.against {
        Some(p) => Some(snapshot::read(p).map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                format!(" (write one first with --snapshot {})", p.display())
            } else {
                String::new()
            };
            err(format!("{}: {e}{hint}", p.display()))
        })?),
        None => None,
    };
    let comparisons = &outcome.comparisons[..];
    let mut info = info.clone();
    let decoded;
    let comparisons = if out.html.is_some() || out.json.is_some() {
        decoded = decode_texts(&mut info, comparisons);
        &decoded[..]
    } else {
        comparisons
    };
    // Every file staged first, then all put in place: a failure (a full disk) leaves none
    // of them, and never half of one.
    let mut staged = Vec::new();
    let stage = |flag: &str, p: &Path, text: &str| {
        crate::trace::staging::stage(p, text.as_bytes()).map_err(|e| err(format!("{flag} {e}")))
    };
    let mut json_stdout = None;
    if let Some(p) = &out.json {
        let text = report::shown::json(serde_json::to_string_pretty(&report::json::report(
            comparisons,
            &info,
            outcome.verdict.as_ref(),
        ))?) + "\n";
        if out.json_to_stdout() {
            json_stdout = Some(text);
        } else {
            staged.push(stage("--json", p, &text)?);
        }
    }
    if let Some(p) = &out.html {
        let page = report::html::page(comparisons, &info).map_err(err)?;
        staged.push(stage("--html", p, &page)?);
    }
    if let Some(p) = &out.snapshot {
        staged.push(stage(
            "--snapshot",
            p,
            &snapshot::file(comparisons, &command()),
        )?);
    }
    for s in staged {
        s.commit().map_err(err)?;
    }
    if let Some(text) = json_stdout {
        let mut so = std::io::stdout().lock();
        so.write_all(text.as_bytes())
            .and_then(|_| so.flush())
            .map_err(|e| err(format!("stdout: {e}")))?;
    }
    // Human text goes to stderr when stdout carries the JSON.
    let say = |line: String| {
        if out.json_to_stdout() {
            eprintln!("{line}")
        } else {
            println!("{line}")
        }
    };
    if let Some(p) = &out.html
        && !out.quiet
    {
        let abs = std::path::absolute(p).unwrap_or_else(|_| p.clone());
        say(format!("html: wrote the report to {}", abs.display()));
    }
    let colour = !out.json_to_stdout() && report::colour_stdout();
    let paint = |s: &str, c: AnsiColor| {
        if colour {
            let st = Style::new().fg_color(Some(c.into())).bold();
            format!("{st}{s}{st:#}")
        } else {
            s.to_string()
        }
    };
    let mut moved_any = false;
    if let (Some(p), Some(old)) = (&out.against, &old) {
        let moved = snapshot::against(comparisons, old)
            .map_err(|e| err(format!("{}: {e}", p.display())))?;
        let new = PathBuf::from(format!("{}.new", p.display()));
        if moved.is_empty() {
            // A pending snapshot left by an earlier failure is stale now.
            let _ = std::fs::remove_file(&new);
        }
        if moved.is_empty() && !out.quiet {
            say(format!(
                "gate: {} within the snapshot {} (no NMSE left its bucket)",
                paint("numerics", AnsiColor::Green),
                p.display()
            ));
        } else if !moved.is_empty() {
            moved_any = true;
            write_file("--against", &new, &snapshot::file(comparisons, &command()))?;
            say(format!(
                "gate: {} {} moved against {}:",
                paint("FAILED", AnsiColor::Red),
                moved.len(),
                p.display()
            ));
            for m in &moved {
                // Keys of the old snapshot, a file: escaped and capped.
                say(format!("  {}", report::shown::line(m)));
            }
            say(format!(
                "gate: the new snapshot is {} (review: `cargo insta review`, or `mv {} {}` to accept)",
                new.display(),
                new.display(),
                p.display()
            ));
        }
    }
    let diverged = outcome.diverged();
    if diverged > 0 {
        say(format!(
            "verdict: {} of {} comparisons diverged",
            diverged,
            comparisons.len()
        ));
    } else {
        say(format!(
            "verdict: {} ({} comparisons)",
            paint("parity", AnsiColor::Green),
            comparisons.len()
        ));
    }
    Ok(ExitCode::from(outcome.exit_code(moved_any)))
}
