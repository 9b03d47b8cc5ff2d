//! `parity diff`: compare two trace folders (e.g. an external engine's dump against a golden).

use super::check::pair_kind;
use super::output::{ReportArgs, finish};
use super::{Result, err, repo_root};
use crate::compare::{CompareOptions, PairKind, compare};
use crate::model::Model;
use crate::report;
use crate::trace::Trace;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args)]
pub struct DiffArgs {
    /// Baseline trace folder (e.g. a llama.cpp golden).
    baseline: PathBuf,
    /// Candidate trace folder (e.g. your engine's dump).
    candidate: PathBuf,
    /// Weight type of the model's matmul weights, for the tolerances (default: read from the
    /// model path in the baseline manifest if that file exists, else f32).
    #[arg(long = "weight-type")]
    weight_type: Option<String>,
    /// Hold the candidate to same-rounding tolerances (it emulates ggml's activation rounding).
    #[arg(long)]
    strict: bool,
    /// Compare even if the manifests name different model sha256.
    #[arg(long)]
    allow_model_mismatch: bool,
    #[command(flatten)]
    report: ReportArgs,
}

/// The model a trace names, if it is here: its path as recorded, else relative to the
/// repository (goldens record repo-relative paths); only if the sha256 matches.
fn model_for_trace(t: &Trace) -> Option<Model> {
    let p = Path::new(&t.manifest.model.path);
    [p.to_path_buf(), repo_root().join(p)]
        .iter()
        .filter(|c| c.exists())
        .filter_map(|c| Model::open(c).ok())
        .find(|m| m.sha256() == t.manifest.model.sha256)
}

pub fn diff(a: DiffArgs) -> Result<ExitCode> {
    let base = Trace::open(&a.baseline)?;
    let cand = Trace::open(&a.candidate)?;
    let wtype = match &a.weight_type {
        Some(s) => crate::gguf::GgmlType::parse(s)
            .ok_or_else(|| err(format!("unknown weight type '{s}'")))?,
        None => model_for_trace(&base)
            .map(|m| m.main_weight_type())
            .ok_or_else(|| {
                err(format!(
                    "the baseline's model {} is not found here (or its sha256 differs): pass --weight-type (e.g. q8_0) so the tolerances fit the model",
                    base.manifest.model.path
                ))
            })?,
    };
    let pair = if a.strict {
        PairKind::SameRounding
    } else {
        pair_kind(&base, &cand)
    };
    let opt = CompareOptions {
        pair,
        weight_type: wtype,
        require_same_model: !a.allow_model_mismatch,
    };
    let c = compare(&base, &cand, &opt)?;
    println!("== {} vs {}", c.candidate, c.baseline);
    print!("{}", report::table(&c));
    println!("{}\n", report::verdict(&c));
    finish(&[c], &a.report)
}
