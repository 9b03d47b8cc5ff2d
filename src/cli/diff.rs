//! `parity diff`: judge a trace (an external engine's dump, one of ours, a golden) against a
//! golden. Token ids first; then, when the model is at hand, every op of the candidate
//! recomputed by the reference from the candidate's own inputs (`crate::judge`): the first op
//! out of its noise floor is the verdict, named by experiment. The end-to-end table stays as
//! the picture of drift. Without the model only the end-to-end comparison can be made.

use super::output::{ReportArgs, finish_with, run_info, show};
use super::{Result, err, repo_root};
use crate::backend::Emulation;
use crate::compare::PairKind;
use crate::judge::{self, JudgeOptions};
use crate::model::Model;
use crate::report;
use crate::trace::Trace;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args)]
pub struct DiffArgs {
    /// Baseline trace: a folder or an .npz archive (e.g. a llama.cpp golden).
    baseline: PathBuf,
    /// Candidate trace: a folder or an .npz archive (e.g. your engine's dump, or the archive a wasm engine hands back).
    candidate: PathBuf,
    /// The GGUF model the traces were made from: with it, each op of the candidate is judged on
    /// its own inputs (default: the model path in the candidate's or the baseline's manifest,
    /// else a file of the recorded size and sha256 in --model-dir, fixtures/ or
    /// ../shared/models).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A folder to look for the model in (its files of the size the manifest records, hashed;
    /// without a recorded size, the file of the manifest's name only).
    #[arg(long = "model-dir", value_name = "DIR", conflicts_with = "model")]
    model_dir: Vec<PathBuf>,
    /// Weight type for the end-to-end tolerances when the model is not at hand (e.g. q8_0).
    #[arg(long = "weight-type")]
    weight_type: Option<String>,
    /// Hold the candidate to same-rounding end-to-end tolerances.
    #[arg(long)]
    strict: bool,
    /// Compare even if the manifests (or --model) name different model sha256.
    #[arg(long)]
    allow_model_mismatch: bool,
    /// Judge under this activation rounding only (plain-f32, ggml-cpu, f16, ggml-scalar, q8k,
    /// q8_1-gpu, bf16, f16-acc, f16-acc-unfused, tf32; `none` and `ggml` are accepted for the
    /// first two) instead of measuring which one reproduces the engine.
    #[arg(long)]
    rounding: Option<String>,
    /// Judge with this K/V cache only instead of the one the candidate declares or the one
    /// measured to reproduce its attention: f32, f16, q8_0, q4_0, or K/V types (q8_0/f16);
    /// `+ggml` for llama.cpp's arithmetic around it (q rotated and rounded to K's dot type),
    /// `+fa` for flash attention (an f16 V accumulated in f16)
    #[arg(long, value_parser = parse_kv)]
    kv: Option<judge::replay::KvCache>,
    /// Skip the experiments at the first op out of its floor (name it by text heuristics only).
    #[arg(long)]
    no_experiments: bool,
    #[command(flatten)]
    report: ReportArgs,
}

/// The recorded model's sha256 and size: the candidate's, else the baseline's (an engine that
/// records a path but no sha256 is trusted only where the other side's sha256 agrees).
fn wanted(base: &Trace, cand: &Trace) -> (String, Option<u64>) {
    let (cm, bm) = (&cand.manifest.model, &base.manifest.model);
    let sha = if cm.sha256.is_empty() {
        &bm.sha256
    } else {
        &cm.sha256
    };
    (sha.clone(), cm.size.or(bm.size))
}

/// The file at `p`, if it is a non-empty regular GGUF file of the recorded size (when one is
/// recorded) whose streamed sha256 is `sha`. A FIFO, a device or a folder is never opened; a
/// /proc file (size 0) is never read.
fn open_if(p: &Path, sha: &str, size: Option<u64>) -> Option<Model> {
    let meta = std::fs::metadata(p).ok()?;
    if !meta.is_file() || meta.len() == 0 || size.is_some_and(|n| meta.len() != n) {
        return None;
    }
    // Only a GGUF file is hashed: a /proc file such as /proc/kcore states a size of terabytes.
    let mut magic = [0u8; 4];
    std::io::Read::read_exact(&mut crate::trace::open::open_regular(p).ok()?, &mut magic).ok()?;
    if &magic != b"GGUF" {
        return None;
    }
    // A file the manifest names is hashed only when it is a valid GGUF no longer than its own
    // tensors say: a sparse 100 GB file behind a GGUF header would otherwise be hashed for minutes.
    let g = crate::gguf::GgufFile::open(p).ok()?;
    let end = g
        .tensors
        .iter()
        .map(|t| t.offset.saturating_add(t.n_bytes))
        .max()
        .unwrap_or(0)
        .saturating_add(g.data_offset);
    if meta.len()
        > end
            .div_ceil(g.alignment.max(1))
            .saturating_mul(g.alignment.max(1))
    {
        return None;
    }
    drop(g);
    let (hex, _) = crate::trace::open::sha256_file(p).ok()?;
    if hex != sha {
        return None;
    }
    Model::open(p).ok()
}

/// The model a trace pair was made from: the file at a manifest's path (as written, or
/// relative to the repository), else one in the search folders (`--model-dir`, the
/// repository's fixtures/ and ../shared/models) of the recorded size; without a recorded size
/// only the file named as the manifest names it is hashed there. Never the working folder by
/// glob, never a file when no sha256 is recorded (any file would do then).
fn find_model(base: &Trace, cand: &Trace, dirs: &[PathBuf]) -> Option<(PathBuf, Model)> {
    let (sha, size) = wanted(base, cand);
    if sha.is_empty() {
        return None;
    }
    let root = repo_root();
    let mut tried: Vec<PathBuf> = Vec::new();
    let mut try_at = |p: PathBuf| -> Option<(PathBuf, Model)> {
        if tried.contains(&p) {
            return None;
        }
        tried.push(p.clone());
        open_if(&p, &sha, size).map(|m| (p, m))
    };
    for r in [&cand.manifest.model, &base.manifest.model] {
        if r.path.is_empty() {
            continue;
        }
        let p = Path::new(&r.path);
        for c in [p.to_path_buf(), root.join(p)] {
            if let Some(found) = try_at(c) {
                return Some(found);
            }
        }
    }
    let names: Vec<std::ffi::OsString> = [&cand.manifest.model, &base.manifest.model]
        .iter()
        .filter_map(|r| Path::new(&r.path).file_name().map(|n| n.to_os_string()))
        .collect();
    let search = dirs
        .iter()
        .cloned()
        .chain([root.join("fixtures"), root.join("../shared/models")]);
    for dir in search {
        let files: Vec<PathBuf> = match size {
            // Only files of the recorded size are hashed.
            Some(n) => {
                let Ok(rd) = std::fs::read_dir(&dir) else {
                    continue;
                };
                let mut v: Vec<PathBuf> = rd
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() == n))
                    .collect();
                v.sort();
                v
            }
            None => names.iter().map(|n| dir.join(n)).collect(),
        };
        for f in files {
            if let Some(found) = try_at(f) {
                return Some(found);
            }
        }
    }
    None
}

pub fn diff(a: DiffArgs) -> Result<ExitCode> {
    let mut inputs: Vec<(&Path, &str)> =
        vec![(&a.baseline, "baseline"), (&a.candidate, "candidate")];
    if let Some(m) = &a.model {
        inputs.push((m, "--model"));
    }
    a.report.validate(&inputs)?;
    let base = Trace::open(&a.baseline)?;
    let cand = Trace::open(&a.candidate)?;
    for (t, side) in [(&base, "baseline"), (&cand, "candidate")] {
        let extra = t.not_compared();
        if !extra.is_empty() && !a.report.quiet {
            // At most ten names: a manifest can name any number.
            let more = match extra.len() {
                n if n > 10 => format!(" and {} more", n - 10),
                _ => String::new(),
            };
            let names: Vec<String> = extra
                .iter()
                .take(10)
                .map(|n| crate::report::shown::shown(n).into_owned())
                .collect();
            eprintln!(
                "note: the {side} records taps parity does not know (kept, not compared): {}{more}",
                crate::report::shown::line(&names.join(", "))
            );
        }
    }
    let found = match &a.model {
        Some(p) => {
            if p.is_dir() {
                return Err(err(format!(
                    "--model {}: is a folder; pass the GGUF file, or --model-dir {} to look for it there",
                    p.display(),
                    p.display()
                )));
            }
            let m = Model::open(p).map_err(|e| err(format!("--model {e}")))?;
            let want = &cand.manifest.model.sha256;
            if !a.allow_model_mismatch && !want.is_empty() && m.sha256() != want {
                return Err(err(format!(
                    "--model {} has sha256 {}…, the candidate was made from {}…: pass the same GGUF file (or --allow-model-mismatch)",
                    p.display(),
                    &m.sha256()[..12],
                    want.chars().take(12).collect::<String>()
                )));
            }
            Some((p.clone(), m))
        }
        None => {
            for d in &a.model_dir {
                if !d.is_dir() {
                    return Err(err(format!("--model-dir {}: not a folder", d.display())));
                }
            }
            find_model(&base, &cand, &a.model_dir)
        }
    };
    let wtype = match (&found, &a.weight_type) {
        (_, Some(s)) => crate::gguf::GgmlType::parse(s)
            .ok_or_else(|| err(format!("unknown weight type '{s}'")))?,
        (Some((_, m)), None) => m.main_weight_type(),
        (None, None) => {
            let (sha, _) = wanted(&base, &cand);
            let why = if sha.is_empty() {
                "the manifests record no sha256 to recognise it by"
            } else {
                "nor a file of its size and sha256 in --model-dir, fixtures/ or ../shared/models"
            };
            return Err(err(format!(
                "the model '{}' is not found here ({why}): pass --model FILE (or --model-dir DIR) to judge each op, or --weight-type (e.g. q8_0) to compare end to end only",
                cand.manifest.model.path
            )));
        }
    };
    let rounding = match &a.rounding {
        None => None,
        Some(s) => Some(Emulation::parse(s).ok_or_else(|| {
            err(format!(
                "unknown rounding '{s}' (known: {})",
                Emulation::names()
            ))
        })?),
    };
    // A manifest says what its producer calls itself, not how it rounds: end to end, any
    // candidate is held to the tolerance that covers llama.cpp's own spread, unless --strict.
    let mut opt = judge::verdict::DiffOptions::new(wtype);
    if a.strict {
        opt.compare.pair = PairKind::SameRounding;
    }
    opt.compare.require_same_model = !a.allow_model_mismatch;
    opt.judge = JudgeOptions {
        roundings: rounding.map_or(judge::ROUNDINGS.to_vec(), |r| vec![r]),
        kv_caches: a.kv.into_iter().collect(),
        hypotheses: !a.no_experiments,
    };
    let info = run_info([&base, &cand]);
    let Some((model_path, model)) = found else {
        // The same library call, without a model: end to end only.
        let d = judge::verdict::diff(&base, &cand, None, &opt)?;
        show(
            &d.e2e,
            &format!(
                "== {} vs {} (end to end only: without the model, parity cannot recompute the candidate's ops; pass --model FILE)",
                d.e2e.candidate, d.e2e.baseline
            ),
            true,
            &a.report,
        );
        return finish_with(&d.outcome(), &info, &a.report, &inputs);
    };

    let to_stderr = a.report.json.as_deref() == Some(Path::new("-"));
    let say = |s: &str| {
        if a.report.quiet {
        } else if to_stderr {
            eprintln!("{s}")
        } else {
            println!("{s}")
        }
    };
    let t0 = std::time::Instant::now();
    // The verdict is one library call, the same `parity selftest` checks.
    let d = crate::report::progress::Progress::stage("judging each op", a.report.quiet, || {
        judge::verdict::diff(&base, &cand, Some(&model), &opt)
    })?;
    let c = &d.e2e;
    let (Some(j), Some(jc)) = (&d.judgement, &d.own) else {
        unreachable!("judged with the model")
    };
    say(&format!(
        "== {} vs {}: end to end (the picture of drift; the verdict is the own-error judgement below)\n{}{}",
        report::shown(&c.candidate),
        report::shown(&c.baseline),
        report::table_styled(c, !to_stderr && report::colour_stdout()),
        // Drift past the end-to-end tolerances (a NaN in the baseline) is a divergence too.
        // (Token ids that differ are the verdict below.)
        if c.diverged() && c.token_mismatch.is_none() {
            format!("{}\n", report::verdict(c))
        } else {
            String::new()
        }
    ));
    say(&format!(
        "model: {} ({}, judged in {:.1} s)\n{}",
        // Found by a manifest's path, which the file chose.
        report::shown(&model_path.display().to_string()),
        model.main_weight_type(),
        t0.elapsed().as_secs_f64(),
        report::judgement(j)
    ));
    show(jc, "== verdict", false, &a.report);
    // The logits' agreement end to end, as a statistic beside the verdict.
    if let Some(l) = c.logits.last() {
        say(&format!(
            "end to end at the last step: mean logit KLD {:.2e}, top-1 agreement {}/{}",
            l.kld_mean, l.top1_agree, l.rows
        ));
    }
    inputs.push((&model_path, "the model"));
    finish_with(&d.outcome(), &info, &a.report, &inputs)
}

fn parse_kv(s: &str) -> std::result::Result<judge::replay::KvCache, String> {
    judge::replay::KvCache::parse(s).ok_or_else(|| {
        format!(
            "{s:?}: expected f32, f16, q8_0, q4_0 or K/V types (q8_0/f16), optionally +ggml and +fa"
        )
    })
}
