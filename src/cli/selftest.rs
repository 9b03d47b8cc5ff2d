//! `parity mutations` (the catalog of known engine bugs) and `parity selftest` (each bug run
//! through `dump` and `diff` exactly as an external engine's trace would be, checking that the
//! clean run passes and each bug is found at its place and named): the library's
//! `crate::selftest::run`, rendered as a table or JSON.

use super::Result;
use crate::backend::mutation::{Mutation, MutationKind};
use crate::model::Model;
use crate::selftest::{Engine, Programs, Rounding, Row, SelftestOptions, place};
use crate::trace::goldens;
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
                // Where a position bug shows depends on the run, not only the model.
                Some(md) if m.applies_to(md) && !m.positional() => place(&m.first_shows(md)),
                Some(md) if m.applies_to(md) => m.typical_place().into(),
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
        println!(
            "{}",
            crate::report::shown::json(serde_json::to_string_pretty(&rows)?)
        );
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

// ---- parity selftest ---------------------------------------------------------------------

#[derive(Args)]
pub struct SelftestArgs {
    /// GGUF model (default: the committed fixtures/tiny-llama-q8_0.gguf).
    model: Option<PathBuf>,
    /// The model's llama.cpp golden, or a folder of goldens to search (default: found by
    /// sha256 in ./golden, the user's golden folder where `parity golden` writes, then the
    /// goldens that ship with parity).
    #[arg(long)]
    golden: Option<PathBuf>,
    /// Which engine writes the traces: parity's reference (what `parity dump --mutate` writes,
    /// through its library call), the numpy engine (scripts/numpy_engine.py, a process of its
    /// own), or both.
    #[arg(long, default_value = "parity", value_parser = ["parity", "numpy", "both"])]
    engine: String,
    /// Activation rounding of the engine, comma-separated: any family `parity diff
    /// --rounding` knows (plain-f32, ggml-cpu, ggml-scalar, q8k, q8_1-gpu, f16, bf16, f16-acc,
    /// f16-acc-unfused, tf32; `none` and `ggml` are accepted for the first two), both
    /// (plain-f32,ggml-cpu), and for the numpy engine also f16-trunc (inputs cut to f16 toward
    /// zero, a rounding parity does not model), PREFILL/DECODE (the prompt step rounding otherwise, e.g. f16-acc/plain-f32 as
    /// llama.cpp Vulkan) and ROUNDING+lm=OUTPUT (the output projection rounding otherwise,
    /// e.g. q8k+lm=ggml-cpu).
    #[arg(long, default_value = "both", value_delimiter = ',')]
    rounding: Vec<String>,
    /// Dump only embd, l_out per layer, result_norm and logits (what engine authors dump
    /// first); the bug must then be found at the right layer.
    #[arg(long)]
    sparse: bool,
    /// The numpy engine's K/V cache type: f16 is llama.cpp's default cache; q8_0 and q4_0
    /// store 32-value blocks (a hand-written int8/int4 cache). parity's own engine keeps an
    /// f32 cache, so another type needs --engine numpy.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "q8_0", "q4_0"])]
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
    /// Cases judged at once, each with its engine process (0 = one per core). Rows print in
    /// catalog order whatever the order they finish in.
    #[arg(long, short = 'j', default_value_t = 0)]
    jobs: usize,
    /// Keep the traces in this folder instead of a temporary one (one `.npz` archive per
    /// row, named ENGINE-ROUNDING-CASE.npz; `parity diff` reads them as folders).
    #[arg(long)]
    keep: Option<PathBuf>,
}

/// `--rounding`'s list, `both` standing for plain-f32 and ggml-cpu.
fn roundings(names: &[String]) -> Result<Vec<Rounding>> {
    let mut v = Vec::new();
    for n in names {
        match n.as_str() {
            "both" => v.extend([Rounding::NONE, Rounding::GGML]),
            _ => v.push(Rounding::parse(n).ok_or_else(|| {
                super::err(format!(
                    "unknown --rounding '{n}' (known: {}, both)",
                    Rounding::names()
                ))
            })?),
        }
    }
    v.dedup();
    Ok(v)
}

/// A golden for `model`, by sha256, in the search order every command uses
/// ([`goldens::search_dirs`]): the first long enough to show every bug (two steps, a prompt
/// of two ids), else the first at all (whose shortness the selftest then names).
fn find_golden(model: &Model, dirs: &[PathBuf]) -> Result<Option<PathBuf>> {
    let mut any = None;
    for d in dirs {
        for (p, t) in goldens::find(d, model.sha256())? {
            let prompt = t.manifest.steps.first().map_or(0, |s| s.tokens.len());
            if prompt >= 2 && t.manifest.steps.len() >= 2 {
                return Ok(Some(p));
            }
            any.get_or_insert(p);
        }
    }
    Ok(any)
}

pub fn selftest(a: SelftestArgs) -> Result<ExitCode> {
    let model_path = a
        .model
        .clone()
        .unwrap_or_else(|| super::repo_root().join("fixtures/tiny-llama-q8_0.gguf"));
    let model = Model::open(&model_path)?;
    let golden = match &a.golden {
        // A golden, or a folder of goldens searched as the default folders are.
        Some(g) if g.join("manifest.json").exists() || g.is_file() || !g.is_dir() => g.clone(),
        Some(g) => find_golden(&model, std::slice::from_ref(g))?.ok_or_else(|| {
            super::err(format!(
                "no golden for {} (sha256 {}…) in {}",
                model_path.display(),
                &model.sha256()[..12],
                g.display()
            ))
        })?,
        None => {
            let dirs = goldens::search_dirs(&super::repo_root().join("golden"));
            find_golden(&model, &dirs)?.ok_or_else(|| {
                let searched: Vec<String> =
                    dirs.iter().map(|d| d.display().to_string()).collect();
                super::err(format!(
                    "no golden for {} (sha256 {}…) in {}: make one with `parity golden {}` or pass --golden DIR",
                    model_path.display(),
                    &model.sha256()[..12],
                    searched.join(", "),
                    model_path.display(),
                ))
            })?
        }
    };
    if let Some(k) = &a.keep {
        crate::trace::paths::check_paths(
            &[(&model_path, "the model"), (&golden, "the golden")],
            &[(k, "--keep")],
        )
        .map_err(super::err)?;
    }
    let opt = SelftestOptions {
        golden,
        engines: match a.engine.as_str() {
            "parity" => vec![Engine::Parity],
            "numpy" => vec![Engine::Numpy],
            _ => vec![Engine::Parity, Engine::Numpy],
        },
        roundings: roundings(&a.rounding)?,
        sparse: a.sparse,
        kv: a.kv.clone(),
        from_layer: a.from_layer,
        only: a.only.clone(),
        keep: a.keep.clone(),
        jobs: a.jobs,
        programs: Programs {
            python: super::python(),
            numpy_engine: super::script("numpy_engine.py"),
        },
    };
    let mut first = true;
    let rows = crate::selftest::run(&model, &model_path, &opt, &mut |r| {
        if !a.json {
            print_row(r, first);
        }
        first = false;
    })?;
    let failed = rows.iter().filter(|r| !r.ok).count();
    if a.json {
        println!(
            "{}",
            crate::report::shown::json(serde_json::to_string_pretty(&rows)?)
        );
    } else {
        println!(
            "selftest: {} of {} rows ok on {} (golden {}){}{}{}",
            rows.len() - failed,
            rows.len(),
            model_path.display(),
            opt.golden.display(),
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

fn print_row(r: &Row, header: bool) {
    if header {
        println!(
            "{:<30} {:<7} {:<15} {:<30} {:<30} {:<22} ok",
            "mutation", "engine", "round", "expected", "found", "named"
        );
    }
    println!(
        "{:<30} {:<7} {:<15} {:<30} {:<30} {:<22} {}",
        r.case,
        r.engine.name(),
        r.rounding.name(),
        r.expected.as_deref().unwrap_or("-"),
        r.found.as_deref().unwrap_or("-"),
        r.named.as_deref().unwrap_or("-"),
        if r.ok {
            "ok".to_string()
        } else {
            // `why` may quote an error about the golden (a file): one escaped line.
            format!("FAIL: {}", crate::report::shown::line(&r.why))
        }
    );
}
