//! `parity mutations` (the catalog of known engine bugs) and `parity selftest` (each bug run
//! through `dump` and `diff` exactly as an external engine's trace would be, checking that the
//! clean run passes and each bug is found at its place and named).

use super::Result;
use crate::backend::mutation::{Mutation, MutationKind};
use crate::judge::verdict::Verdict as Outcome;
use crate::model::Model;
use crate::trace::{Tap, Trace};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct MutationsArgs {
    /// A GGUF model: also say whether each bug applies to it and exactly where it first shows.
    model: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct CatalogRow {
    name: &'static str,
    kind: MutationKind,
    description: &'static str,
    first_shows: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    applies: Option<bool>,
}

pub fn mutations(a: MutationsArgs) -> Result<ExitCode> {
    let model = a.model.as_ref().map(Model::open).transpose()?;
    let rows: Vec<CatalogRow> = Mutation::ALL
        .iter()
        .map(|&m| {
            let applies = model.as_ref().map(|md| m.applies_to(md));
            let first_shows = match &model {
                Some(md) if m.applies_to(md) => place(&m.first_shows(md)),
                Some(_) => "-".into(),
                None => m.typical_place().into(),
            };
            CatalogRow {
                name: m.name(),
                kind: m.kind(),
                description: m.describe(),
                first_shows,
                applies,
            }
        })
        .collect();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<22} {:<8} {:<8}{:<34} description",
        "name",
        "kind",
        if model.is_some() { "applies " } else { "" },
        "first shows"
    );
    for r in &rows {
        let kind = serde_json::to_value(r.kind)?;
        let applies = match r.applies {
            Some(true) => "yes     ",
            Some(false) => "no      ",
            None => "",
        };
        println!(
            "{:<22} {:<8} {applies}{:<34} {}",
            r.name,
            kind.as_str().unwrap_or(""),
            r.first_shows,
            r.description
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `step 0, layer 3, q_rope` / `step 1, logits`.
pub fn place(k: &crate::trace::TapKey) -> String {
    match k.layer {
        Some(l) => format!("step {}, layer {l}, {}", k.step, k.tap),
        None => format!("step {}, {}", k.step, k.tap),
    }
}

// ---- parity selftest ---------------------------------------------------------------------

#[derive(Args)]
pub struct SelftestArgs {
    /// GGUF model (default: the committed fixtures/tiny-llama-q8_0.gguf).
    model: Option<PathBuf>,
    /// The model's llama.cpp golden (default: found by sha256 under ./golden or the
    /// repository's golden/).
    #[arg(long)]
    golden: Option<PathBuf>,
    /// Which engine writes the traces: parity's reference (`parity dump --mutate`, run as a
    /// separate process), the numpy engine (scripts/numpy_engine.py), or both.
    #[arg(long, default_value = "parity", value_parser = ["parity", "numpy", "both"])]
    engine: String,
    /// Activation rounding of the engine: none (plain f32), ggml (as ggml's CPU), or both.
    #[arg(long, default_value = "both", value_parser = ["none", "ggml", "both"])]
    rounding: String,
    /// Dump only embd, l_out per layer, result_norm and logits (what engine authors dump
    /// first); the bug must then be found at the right layer.
    #[arg(long)]
    sparse: bool,
    /// The numpy engine's K/V cache type: f16 is llama.cpp's default cache (parity's own
    /// engine keeps an f32 cache, so f16 needs --engine numpy).
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16"])]
    kv: String,
    /// Place each compute bug deep: it acts from this layer on (and on the output norm and
    /// projection), so it must be found at this layer with every layer before it clean.
    #[arg(long, default_value_t = 0)]
    from_layer: usize,
    /// Only these mutations (comma-separated names; the clean run always runs).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Print the rows as JSON.
    #[arg(long)]
    json: bool,
    /// Keep the traces in this folder instead of a temporary one.
    #[arg(long)]
    keep: Option<PathBuf>,
}

/// One case: the clean engine, or one bug, through one engine configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Case {
    Clean,
    Bug(Mutation),
    /// A layout bug whose manifest declares the layout: must be aligned (pass) or named.
    Declared(Mutation),
}

impl Case {
    fn label(self) -> String {
        match self {
            Case::Clean => "clean".into(),
            Case::Bug(m) => m.name().into(),
            Case::Declared(m) => format!("{m} (declared)"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum Engine {
    Parity,
    Numpy,
}

#[derive(serde::Serialize)]
struct Row {
    case: String,
    engine: Engine,
    rounding: &'static str,
    sparse: bool,
    /// Where the bug must be found (none for the clean run).
    expected: Option<String>,
    expected_name: Option<String>,
    /// Whether a divergence was found (exit 1 from `diff`).
    diverged: bool,
    found: Option<String>,
    /// The name the diagnosis gave (confirmed hypothesis, or the token difference's kind).
    named: Option<String>,
    /// Other hypotheses that reproduce the candidate as well.
    also: Vec<String>,
    /// The largest cut a hypothesis made of an own error under the floors (a clean row must
    /// stay below `judge::hypothesis::EXPLAINS`; None when none was tested).
    below_floor_cut: Option<f64>,
    ok: bool,
    why: String,
}

/// `diff`'s verdict on a candidate: the library call `parity diff` makes when it has the model
/// (`judge::verdict::diff`, with diff's default options), so the two cannot disagree.
fn outcome(golden: &Trace, cand: &Trace, model: &Model) -> Result<Outcome> {
    use crate::judge::verdict::{DiffOptions, diff};
    let d = diff(
        golden,
        cand,
        Some(model),
        &DiffOptions::new(model.main_weight_type()),
    )?;
    Ok(d.verdict)
}

/// The name the diagnosis must give for `m`: the catalog name, or for token bugs the kind of
/// token difference `compare` names.
fn expected_name(m: Mutation) -> &'static str {
    match m {
        Mutation::NoBos => "bos-missing",
        Mutation::DoubleBos => "bos-doubled",
        _ => m.name(),
    }
}

/// Whether `found` is where `m` must show: exactly, or in a sparse trace at the same step and
/// layer (the tap within the layer is not dumped).
fn same_place(expected: &crate::trace::TapKey, found: &crate::trace::TapKey, sparse: bool) -> bool {
    if !sparse || expected.layer.is_none() {
        return expected == found;
    }
    expected.step == found.step && expected.layer == found.layer
}

/// A golden for `model`: its sha256 in the manifest, under ./golden or the repository's golden/.
fn find_golden(model: &Model) -> Option<PathBuf> {
    let roots = [PathBuf::from("golden"), super::repo_root().join("golden")];
    roots
        .iter()
        .filter_map(|r| std::fs::read_dir(r).ok())
        .flat_map(|d| d.flatten())
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").exists())
        .find(|p| Trace::open(p).is_ok_and(|t| t.manifest.model.sha256 == model.sha256()))
}

const SPARSE_TAPS: &str = r"^(embd|l_out-\d+|result_norm|logits)$";

/// Write the case's trace into `dir` by running the engine as a separate process, as an
/// external engine's dump would be made.
#[allow(clippy::too_many_arguments)]
fn write_trace(
    engine: Engine,
    model_path: &std::path::Path,
    golden: &std::path::Path,
    case: Case,
    ggml: bool,
    sparse: bool,
    from_layer: usize,
    kv: &str,
    dir: &std::path::Path,
) -> Result<()> {
    let mut cmd = match engine {
        Engine::Parity => {
            let mut c = std::process::Command::new(std::env::current_exe()?);
            c.arg("dump").arg(model_path).arg("--golden").arg(golden);
            c.args(["--emulate", if ggml { "ggml-cpu" } else { "none" }]);
            if sparse {
                c.args(["--taps", SPARSE_TAPS]);
            }
            match case {
                Case::Clean => {}
                Case::Bug(m) => {
                    c.args(["--mutate", m.name()]);
                    if from_layer > 0 {
                        c.arg("--mutate-from-layer").arg(from_layer.to_string());
                    }
                }
                Case::Declared(m) => {
                    c.args(["--mutate", m.name(), "--declare-layout"]);
                }
            }
            c.arg("--force").arg("--out").arg(dir);
            c
        }
        Engine::Numpy => {
            let mut c = std::process::Command::new(super::python());
            c.arg(super::repo_root().join("scripts/numpy_engine.py"));
            c.arg(model_path).arg("--golden").arg(golden);
            c.args(["--rounding", if ggml { "ggml" } else { "none" }]);
            c.args(["--taps", if sparse { "sparse" } else { "all" }]);
            c.args(["--kv", kv]);
            match case {
                Case::Clean => {}
                Case::Bug(m) => {
                    c.args(["--mutate", m.name()]);
                    if from_layer > 0 {
                        c.arg("--mutate-from-layer").arg(from_layer.to_string());
                    }
                }
                Case::Declared(m) => {
                    c.args(["--mutate", m.name(), "--declare"]);
                }
            }
            c.arg("--out").arg(dir);
            c
        }
    };
    let out = cmd.output().map_err(|e| {
        super::err(format!(
            "running {} for {}: {e}",
            cmd.get_program().to_string_lossy(),
            case.label()
        ))
    })?;
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr);
        let last = msg.lines().last().unwrap_or("").trim();
        return Err(super::err(format!(
            "{} engine failed on {}: {last}",
            match engine {
                Engine::Parity => "parity dump",
                Engine::Numpy => "numpy",
            },
            case.label()
        )));
    }
    Ok(())
}

pub fn selftest(a: SelftestArgs) -> Result<ExitCode> {
    let model_path = a
        .model
        .clone()
        .unwrap_or_else(|| super::repo_root().join("fixtures/tiny-llama-q8_0.gguf"));
    let model = Model::open(&model_path)?;
    let golden_dir = match &a.golden {
        Some(g) => g.clone(),
        None => find_golden(&model).ok_or_else(|| {
            super::err(format!(
                "no golden for {} (sha256 {}…) under ./golden or the repository's golden/: make one with `parity golden` and pass --golden DIR",
                model_path.display(),
                &model.sha256()[..12]
            ))
        })?,
    };
    let golden = Trace::open(&golden_dir)?;
    if golden.manifest.model.sha256 != model.sha256() {
        return Err(super::err(format!(
            "{}: the golden is for another model (sha256 {}…)",
            golden_dir.display(),
            golden
                .manifest
                .model
                .sha256
                .chars()
                .take(12)
                .collect::<String>()
        )));
    }
    let prompt_len = golden.manifest.steps.first().map_or(0, |s| s.tokens.len());
    if prompt_len < 2 || golden.manifest.steps.len() < 2 {
        return Err(super::err(format!(
            "{}: selftest needs a golden with a prompt of 2+ ids and 1+ decode steps",
            golden_dir.display()
        )));
    }
    if a.from_layer >= model.config.n_layer {
        return Err(super::err(format!(
            "--from-layer {}: the model has {} layers",
            a.from_layer, model.config.n_layer
        )));
    }
    let mut cases = vec![Case::Clean];
    for &m in Mutation::ALL {
        if let Some(only) = &a.only
            && !only.iter().any(|n| n == m.name())
        {
            continue;
        }
        if !m.applies_to(&model) {
            continue;
        }
        if a.sparse && m.kind() == MutationKind::Layout {
            continue; // a sparse trace has no q_rope to store differently
        }
        if a.from_layer > 0
            && (m.kind() != MutationKind::Compute
                || m.first_shows_from(&model, a.from_layer).is_none())
        {
            continue; // token and layout bugs have no depth
        }
        cases.push(Case::Bug(m));
        if m.kind() == MutationKind::Layout {
            cases.push(Case::Declared(m));
        }
    }
    if let Some(only) = &a.only
        && let Some(bad) = only.iter().find(|n| Mutation::parse(n).is_none())
    {
        return Err(super::err(format!(
            "unknown mutation '{bad}' (known: {})",
            Mutation::names()
        )));
    }
    let engines: Vec<Engine> = match a.engine.as_str() {
        "parity" => vec![Engine::Parity],
        "numpy" => vec![Engine::Numpy],
        _ => vec![Engine::Parity, Engine::Numpy],
    };
    if a.kv != "f32" && engines.contains(&Engine::Parity) {
        return Err(super::err(format!(
            "--kv {} needs --engine numpy (parity's own engine keeps an f32 K/V cache)",
            a.kv
        )));
    }
    let roundings: Vec<bool> = match a.rounding.as_str() {
        "none" => vec![false],
        "ggml" => vec![true],
        _ => vec![false, true],
    };
    let tmp = match &a.keep {
        Some(k) => k.clone(),
        None => std::env::temp_dir().join(format!("parity-selftest-{}", std::process::id())),
    };
    std::fs::create_dir_all(&tmp).map_err(|e| {
        let what = match (&a.keep, std::fs::metadata(&tmp)) {
            (Some(_), Ok(m)) if !m.is_dir() => "exists and is not a folder".to_string(),
            _ => e.to_string(),
        };
        let flag = if a.keep.is_some() { "--keep " } else { "" };
        super::err(format!("{flag}{}: {what}", tmp.display()))
    })?;

    let mut rows = Vec::new();
    let result = (|| -> Result<()> {
        for &engine in &engines {
            for &ggml in &roundings {
                // The clean engine's trace (the first case), to see where a bug first makes
                // a sparse trace differ at all.
                let mut clean: Option<Trace> = None;
                for &case in &cases {
                    let dir = tmp.join(format!(
                        "{}-{}-{}",
                        serde_json::to_value(engine)?.as_str().unwrap_or(""),
                        if ggml { "ggml" } else { "none" },
                        case.label().replace([' ', '(', ')'], "")
                    ));
                    write_trace(
                        engine,
                        &model_path,
                        &golden_dir,
                        case,
                        ggml,
                        a.sparse,
                        a.from_layer,
                        &a.kv,
                        &dir,
                    )?;
                    let cand = Trace::open(&dir)?;
                    let o = outcome(&golden, &cand, &model)?;
                    // In a sparse trace a small bug can leave the first layers' outputs
                    // bit-identical (activation rounding to 8 bits absorbs it): it cannot be
                    // placed before the first key where the trace differs at all.
                    let observable = match (&clean, case) {
                        (Some(c), Case::Bug(_)) if a.sparse => first_difference(c, &cand)?,
                        _ => None,
                    };
                    let mut row = judge_row(
                        case,
                        engine,
                        ggml,
                        a.sparse,
                        a.from_layer,
                        &model,
                        &o,
                        observable,
                    );
                    if matches!(case, Case::Clean) {
                        clean = Some(cand);
                    }
                    if let (Some(k), Some(exp)) = (observable, &row.expected)
                        && !row.ok
                        && place(&k) != *exp
                    {
                        row.why = format!(
                            "{} (first difference in this trace: {})",
                            row.why,
                            place(&k)
                        );
                    }
                    if !a.json {
                        print_row(&row, rows.is_empty());
                    }
                    rows.push(row);
                }
            }
        }
        Ok(())
    })();
    if a.keep.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    let failed = rows.iter().filter(|r| !r.ok).count();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "selftest: {} of {} rows ok on {} (golden {}){}{}{}",
            rows.len() - failed,
            rows.len(),
            model_path.display(),
            golden_dir.display(),
            if a.sparse { ", sparse traces" } else { "" },
            if a.kv != "f32" {
                format!(", {} K/V cache", a.kv)
            } else {
                String::new()
            },
            if a.from_layer > 0 {
                format!(", bugs from layer {}", a.from_layer)
            } else {
                String::new()
            }
        );
    }
    Ok(if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The first key (graph order) where two traces of the same ids differ in any bit.
fn first_difference(a: &Trace, b: &Trace) -> Result<Option<crate::trace::TapKey>> {
    for k in a.keys() {
        let (Some(x), Some(y)) = (a.get(k)?, b.get(k)?) else {
            continue;
        };
        if x.len() != y.len()
            || x.iter()
                .zip(y.iter())
                .any(|(p, q)| p.to_bits() != q.to_bits())
        {
            return Ok(Some(*k));
        }
    }
    Ok(None)
}

#[allow(clippy::too_many_arguments)]
fn judge_row(
    case: Case,
    engine: Engine,
    ggml: bool,
    sparse: bool,
    from_layer: usize,
    model: &Model,
    o: &Outcome,
    observable: Option<crate::trace::TapKey>,
) -> Row {
    let found = o.place.as_ref().map(place);
    let base = Row {
        case: case.label(),
        engine,
        rounding: if ggml { "ggml" } else { "none" },
        sparse,
        expected: None,
        expected_name: None,
        diverged: o.diverged,
        found,
        named: o.named.clone(),
        also: o.also.clone(),
        below_floor_cut: o.below_floor_cut,
        ok: false,
        why: String::new(),
    };
    match case {
        Case::Clean => {
            let ok = !o.diverged;
            Row {
                ok,
                why: if ok {
                    "clean run passes".into()
                } else {
                    "false alarm on the clean run".into()
                },
                ..base
            }
        }
        Case::Bug(m) | Case::Declared(m) => {
            let mut exp = m
                .first_shows_from(model, from_layer)
                .unwrap_or_else(|| m.first_shows(model));
            // Where the sparse trace first differs from the clean engine's, if that is later.
            // (TapKey orders by graph: embedding taps, layers, output taps.)
            if let Some(k) = observable
                && k.step == exp.step
                && k > exp
            {
                exp = k;
            }
            let name = expected_name(m);
            // An eps bug acts on every RMSNorm of the layer; which one shows it first depends
            // on the scale of its input (deep in a model the residual stream dwarfs eps, a
            // post-norm's small input does not): any norm of the expected layer is its place.
            let norm = |t: Tap| {
                matches!(
                    t,
                    Tap::AttnNorm | Tap::AttnPostNorm | Tap::FfnNorm | Tap::FfnPostNorm
                )
            };
            let any_norm = m == Mutation::RmsEps10x && !sparse;
            let at = o.place.is_some_and(|p| {
                same_place(&exp, &p, sparse)
                    || (any_norm
                        && norm(p.tap)
                        && norm(exp.tap)
                        && (p.step, p.layer) == (exp.step, exp.layer))
            });
            // From a sparse trace, bugs that compute the same layer output cannot be told
            // apart (qk-permute and rope-neox give the same attention scores): there the
            // name may be among those that reproduce the candidate equally well.
            let named = o.named.as_deref() == Some(name)
                || (sparse && o.diverged && o.also.iter().any(|h| h == name));
            let (ok, why) = if matches!(case, Case::Declared(_)) {
                // Declared layouts are aligned (no divergence) or named as layout.
                match (o.diverged, at && named) {
                    (false, _) => (true, "declared layout aligned: no divergence".to_string()),
                    (true, true) => (true, "declared layout named".to_string()),
                    (true, false) => (
                        false,
                        "declared layout reported as a numeric bug".to_string(),
                    ),
                }
            } else if !o.diverged {
                (false, "not found: diff passed".to_string())
            } else if !at {
                (false, "found at the wrong place".to_string())
            } else if !named {
                (false, "not named".to_string())
            } else {
                (true, "found at its place and named".to_string())
            };
            Row {
                expected: Some(place(&exp)),
                expected_name: Some(name.to_string()),
                ok,
                why,
                ..base
            }
        }
    }
}

fn print_row(r: &Row, header: bool) {
    if header {
        println!(
            "{:<30} {:<7} {:<5} {:<30} {:<30} {:<22} ok",
            "mutation", "engine", "round", "expected", "found", "named"
        );
    }
    println!(
        "{:<30} {:<7} {:<5} {:<30} {:<30} {:<22} {}",
        r.case,
        serde_json::to_value(r.engine)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        r.rounding,
        r.expected.as_deref().unwrap_or("-"),
        r.found.as_deref().unwrap_or("-"),
        r.named.as_deref().unwrap_or("-"),
        if r.ok {
            "ok".to_string()
        } else {
            format!("FAIL: {}", r.why)
        }
    );
}
