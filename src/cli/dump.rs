//! `parity dump`: one backend's trace of a prompt and its decode steps, every tap or a plan's.

use super::backends::{
    backend_name, check_context, make_mutated_backend, parse_mutation, resolve_threads,
};
use super::input::{InputArgs, ids_text};
use super::{Result, err};
use crate::backend::dump;
use crate::backend::mutation::MutationKind;
use crate::model::Model;
use crate::report::shown::shown;
use crate::trace::{TapFilter, Trace, TraceWriter};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args)]
pub struct DumpArgs {
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps after the prefill (teacher-forced from the greedy continuation; default 4,
    /// or as many as --forced or --golden give).
    #[arg(long)]
    steps: Option<usize>,
    /// Force these decode tokens instead of the greedy ones (sets --steps).
    #[arg(long, value_delimiter = ',')]
    forced: Option<Vec<u32>>,
    /// Output trace: a folder, or one `.npz` archive when the name ends in `.npz` (one file
    /// instead of one per tap: faster to write and read).
    #[arg(long)]
    out: PathBuf,
    /// Keep only taps whose name (e.g. `attn_norm-3`, `logits`) matches this regex.
    #[arg(long)]
    taps: Option<String>,
    /// A recording plan, as `parity diff` prints it for a zoom: `taps=l_out,result_norm,logits`
    /// keeps those taps at every step (a scan), `;full=3,7-8` every tap at those steps
    /// (docs/trace-format.md, "Scan and zoom"). With --taps, a step kept whole keeps every
    /// tap; elsewhere both must keep it.
    #[arg(long, value_name = "PLAN")]
    record: Option<String>,
    #[arg(long, default_value = "reference")]
    backend: String,
    /// Activation rounding of the reference backend: plain-f32 (the default), ggml-cpu (as
    /// llama.cpp's CPU backend rounds matmul inputs) or another engine family (ggml-scalar,
    /// q8k, q8_1-gpu, f16, bf16; `parity diff --help`); `none` and `ggml` are accepted for the
    /// first two. The fast backend always rounds as ggml-cpu.
    #[arg(long, value_name = "ROUNDING")]
    emulate: Option<String>,
    /// Overwrite the trace already at --out (a folder's or an archive's; never other files).
    #[arg(long)]
    force: bool,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    threads: usize,
    /// Replay a golden's ids: its prompt (step 0) and its decode tokens (forced).
    #[arg(long, conflicts_with_all = ["prompt", "tokens", "forced"])]
    golden: Option<PathBuf>,
    /// Write the trace an engine with this known bug would write (see `parity mutations`).
    /// The manifest does not say so: `diff` must find it blind.
    #[arg(long, value_name = "NAME")]
    mutate: Option<String>,
    /// With a layout mutation: declare the layout in the manifest (`"layouts"`), as an
    /// engine that knows it stores the tap differently would.
    #[arg(long, requires = "mutate")]
    declare_layout: bool,
    /// Refuse a run whose trace would be larger than this (bytes, or 500M, 4G, 1T), before it
    /// starts. The attention probabilities grow with the square of the length.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = crate::arch::size::parse_size)]
    max_trace_size: u64,
    /// The bug acts only from this layer on (and on the output norm and projection): a bug
    /// placed deep in the model.
    #[arg(long, requires = "mutate", default_value_t = 0)]
    mutate_from_layer: usize,
}

/// `--record PLAN` (dump, golden), parsed before any work: one line naming the part at fault.
pub fn record_plan(plan: Option<&str>) -> Result<Option<crate::trace::Record>> {
    plan.map(crate::trace::Record::parse)
        .transpose()
        .map_err(|e| err(format!("--record: {e}")))
}

pub fn dump(a: DumpArgs) -> Result<ExitCode> {
    let mut inputs: Vec<(&Path, &str)> = vec![(&a.model, "the model")];
    if let Some(g) = &a.golden {
        inputs.push((g, "--golden"));
    }
    crate::trace::paths::check_paths(&inputs, &[(&a.out, "--out")]).map_err(err)?;
    TraceWriter::check_target(&a.out, a.force)?;
    let plan = record_plan(a.record.as_deref())?;
    let model = Model::open(&a.model)?;
    // A golden fed in chunks or with further turns is replayed step by step, as it was fed.
    let (mut ids, policy, feed) = match &a.golden {
        Some(dir) => {
            let g = Trace::open(dir)?;
            let want = &g.manifest.model.sha256;
            if !want.is_empty() && want != model.sha256() {
                return Err(err(format!(
                    "--golden {} was made for another model (sha256 {}…), not {} (sha256 {}…)",
                    dir.display(),
                    want.chars().take(12).collect::<String>(),
                    a.model.display(),
                    &model.sha256()[..12]
                )));
            }
            let (ids, feed) = dump::replay(&g)
                .ok_or_else(|| err(format!("{}: the golden has no prompt ids", dir.display())))?;
            if let Some(s) = a.steps
                && s != feed.n_ids()
            {
                return Err(err(format!(
                    "--steps {s} disagrees with the golden's {} decode ids: give one of them",
                    feed.n_ids()
                )));
            }
            let policy = format!("ids replayed from the golden {}", dir.display());
            (ids, policy, feed)
        }
        None if !a.input.given() => {
            return Err(err(
                "give a prompt (-p TEXT), ids (--tokens 1,2,3) or a golden to replay (--golden DIR)",
            ));
        }
        None => {
            let (ids, policy) = a.input.resolve(&model.file)?;
            let feed = match (&a.forced, a.steps) {
                (Some(f), Some(s)) if s != f.len() => {
                    return Err(err(format!(
                        "--steps {s} disagrees with --forced ({} ids): give one of them",
                        f.len()
                    )));
                }
                (Some(f), _) => dump::Feed::Steps {
                    n: f.len(),
                    forced: Some(f.clone()),
                },
                (None, s) => dump::Feed::Steps {
                    n: s.unwrap_or(4),
                    forced: None,
                },
            };
            (ids, policy, feed)
        }
    };
    let mutate = a
        .mutate
        .as_deref()
        .map(|n| parse_mutation(n, &model))
        .transpose()?;
    if a.declare_layout && mutate.is_some_and(|m| m.kind() != MutationKind::Layout) {
        return Err(err(
            "--declare-layout goes with a layout mutation (head-major-q-rope)",
        ));
    }
    if let Some(m) = mutate {
        if m.first_shows_from(&model, a.mutate_from_layer).is_none() {
            return Err(err(format!(
                "--mutate {m} cannot show from layer {} of this {}-layer model",
                a.mutate_from_layer, model.config.n_layer
            )));
        }
        ids = dump::mutate_ids(&ids, m, &model)?;
        eprintln!("mutation: {m} — {}", m.describe());
    }
    eprintln!("prompt ids: {} — {policy}", ids_text(&ids));
    let what = match &feed {
        dump::Feed::Steps { forced: None, .. } => "--steps",
        _ => "forced decode ids",
    };
    let steps = feed.n_ids();
    check_context(&model, ids.len(), what, steps)?;
    let threads = resolve_threads(a.threads);
    let filter = match &a.taps {
        Some(re) => TapFilter::regex(re).map_err(|e| err(format!("--taps: {e}")))?,
        None => TapFilter::all(),
    };
    let filter = filter.with_record(plan);
    let run = match &feed {
        dump::Feed::Chunks(l) => {
            crate::arch::size::fed_steps(std::iter::once(ids.len()).chain(l.iter().map(Vec::len)))
        }
        dump::Feed::Steps { .. } => crate::arch::size::golden_feed(ids.len(), 0, steps, &[]),
    };
    let (bytes, probs) = crate::arch::size::trace_bytes(
        &model.config,
        &run,
        &|k| filter.matches(k),
        filter.record(),
    );
    if let Some(msg) = crate::arch::size::over_budget(
        "this dump's trace",
        bytes,
        probs,
        a.max_trace_size,
        "keep fewer taps (--taps 'l_out|result_norm|logits' scans every position cheaply)",
    ) {
        return Err(err(msg));
    }
    let name = backend_name(&a.backend, a.emulate.as_deref())?;
    let mut b = make_mutated_backend(
        &name,
        &model,
        ids.len() + steps,
        threads,
        mutate,
        a.mutate_from_layer,
    )?;
    let mut sink = TraceWriter::create(&a.out, filter, a.force)?;
    if a.declare_layout
        && let Some((tap, layout)) = mutate.and_then(|m| m.declared_layout())
    {
        sink.declare_layout(tap, layout);
    }
    let settings = serde_json::json!({ "bos_policy": policy, "command": std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ") });
    let m = dump::write(
        b.as_mut(),
        &ids,
        &feed,
        sink,
        dump::model_ref(&a.model, &model),
        settings,
    )?;
    eprintln!(
        "wrote {} tensors over {} steps to {}",
        m.tensors.len(),
        m.steps.len(),
        // The path as given may hold control characters: escaped, one line.
        shown(&a.out.display().to_string())
    );
    Ok(ExitCode::SUCCESS)
}
