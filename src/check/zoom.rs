//! `check`'s zoom: where a check against a scan golden (`golden --record`) diverged, llama.cpp
//! runs again on the scan's ids, fed in the same calls with the same settings, with the first
//! diverging step recorded whole, and the check runs again against that golden.

use super::{CheckError, CheckOptions, CheckReport, Event, golden_is_scan, run};
use crate::compare::Comparison;
use crate::golden::{Aside, Spec, Tools, join_ids};
use crate::model::Model;
use crate::trace::{Trace, Zoom, goldens};
use std::path::{Path, PathBuf};

/// The zoom of a check against a scan golden (`golden --record`): the first step at which a
/// comparison against the golden diverged, and the plan that records that step whole with the
/// scan kept (and the K/V taps of every step before it). llama.cpp run again to that plan
/// gives a golden against which every tap of the step is compared and its own ops are judged
/// one by one (`parity check` does both by itself). None where nothing diverged against the
/// golden, the golden is not a scan, or it already has every tap of that step.
pub fn zoom(r: &CheckReport) -> Option<crate::trace::Zoom> {
    let (_, g) = r.golden.as_ref().filter(|(_, g)| golden_is_scan(g))?;
    let diverged = || {
        r.comparisons
            .iter()
            .filter(|j| j.against_golden && j.comparison.diverged())
    };
    let step = diverged().filter_map(|j| first_step(&j.comparison)).min()?;
    // The first position and layer out there (a long step keeps the probabilities' rows from
    // that position on, and its layers up to that one: an error carried end to end may first
    // cross its threshold layers after the op at fault).
    let firsts = || {
        diverged()
            .filter_map(|j| j.comparison.first_divergence.as_ref())
            .filter(|d| d.at.key.step == step)
    };
    let at = firsts()
        .filter_map(|d| d.position.as_ref().map(|p| p.position))
        .min();
    let upto = firsts().map(|d| d.at.key.layer).min().flatten();
    crate::judge::zoom::step(g, step, at, upto.map(|l| 0..=l))
}

/// The first step at which `c` diverged: a tap out of its threshold, an id that differs, or
/// the logits' mean KLD over its bound.
fn first_step(c: &Comparison) -> Option<usize> {
    [
        c.token_mismatch.as_ref().map(|t| t.step),
        c.first_divergence.as_ref().map(|d| d.at.key.step),
        c.logits
            .iter()
            .find(|l| l.kld_mean > c.kld_threshold)
            .map(|l| l.step),
    ]
    .into_iter()
    .flatten()
    .min()
}

/// A zoom's result: the check against the zoom golden, and where that golden is kept.
pub struct Zoomed {
    pub zoom: Zoom,
    pub report: CheckReport,
    pub kept: Option<PathBuf>,
}

/// The golden a zoom of the scan golden `g` needs, written to `out`: llama.cpp on the scan's
/// ids, fed in the same calls, with the same settings (only values `parity golden` accepts are
/// passed on: the manifest is an input), recording `zoom`'s plan. Err: why it cannot be made
/// (the golden's steps disagree with how its settings say it was fed).
pub fn zoom_spec(
    model_path: &Path,
    g: &Trace,
    zoom: &Zoom,
    out: PathBuf,
    max_trace_size: u64,
) -> Result<Spec, String> {
    let feed = goldens::feed(g)
        .ok_or("the golden's steps do not match how its settings say it was fed")?;
    let s = &g.manifest.producer.settings;
    let text = |k: &str| s.get(k).and_then(|v| v.as_str());
    let cache = |k: &str| {
        text(k)
            .filter(|t| ["f32", "f16", "q8_0", "q4_0"].contains(t))
            .map(String::from)
    };
    let flash_attn = match s.get("flash_attn") {
        Some(serde_json::Value::Bool(b)) => Some(if *b { "on" } else { "off" }),
        Some(serde_json::Value::String(t)) => match t.as_str() {
            "enabled" | "on" => Some("on"),
            "disabled" | "off" => Some("off"),
            "auto" => Some("auto"),
            _ => None,
        },
        _ => None,
    };
    Ok(Spec {
        model: model_path.to_path_buf(),
        policy: "ids given with --tokens: used as is (no BOS or EOS added)".into(),
        ids: feed.prompt.clone(),
        prompt_text: None,
        steps: Some(feed.steps),
        forced: feed.forced.clone(),
        out: Some(out),
        llama_defaults: s.get("llama_defaults").and_then(|v| v.as_bool()) == Some(true),
        chunk: feed.chunk,
        turns: feed.turns.iter().map(|t| join_ids(t)).collect(),
        cache_type_k: cache("type_k"),
        cache_type_v: cache("type_v"),
        flash_attn: flash_attn.map(String::from),
        threads: s
            .get("n_threads")
            .and_then(|v| v.as_u64())
            .map_or(1, |t| t.clamp(1, 1024) as usize),
        gpu_layers: s
            .get("n_gpu_layers")
            .and_then(|v| v.as_i64())
            .map_or(0, |l| l.clamp(-1, i32::MAX as i64) as i32),
        force: false,
        record: Some(zoom.record.clone()),
        max_trace_size,
        verbose: false,
    })
}

/// Runs llama.cpp again (with `tools`) on the scan golden's ids, fed in the same calls with
/// the same settings, recording `zoom`'s plan (into `zoom_out`, else a temporary folder
/// removed at the end), and checks again against that golden. The inner Err: why no zoom was
/// made, one line for the report (the scan's verdict stands on its own).
#[allow(clippy::too_many_arguments)]
pub fn zoom_check(
    model: &Model,
    model_path: &Path,
    opt: &CheckOptions,
    r: &CheckReport,
    zoom: Zoom,
    zoom_out: Option<&Path>,
    tools: &Tools,
    aside: Aside,
    on_event: &mut dyn FnMut(Event),
) -> Result<Result<Zoomed, String>, CheckError> {
    let (_, g) = r.golden.as_ref().expect("a zoom has a golden");
    let by_hand = format!(
        "make it with `parity golden` and the scan's own ids and settings, adding --record '{}', then check against it",
        zoom.record
    );
    let tmp;
    let out = match zoom_out {
        Some(d) => d.to_path_buf(),
        None => {
            tmp = tempfile::Builder::new()
                .prefix("parity-zoom-")
                .tempdir()
                .map_err(CheckError::ZoomFolder)?;
            tmp.path().join("golden")
        }
    };
    let spec = match zoom_spec(model_path, g, &zoom, out.clone(), opt.max_trace_size) {
        Ok(s) => s,
        Err(why) => return Ok(Err(format!("zoom: not made — {why}; {by_hand}"))),
    };
    on_event(Event::Zooming {
        step: zoom.steps[0],
        record: zoom.record.clone(),
    });
    if let Err(e) = crate::golden::make(&spec, tools, aside) {
        return Ok(Err(format!(
            "zoom: not made — llama.cpp could not run again ({}); {by_hand}",
            e.trim()
        )));
    }
    let zopt = CheckOptions {
        golden: Some(out),
        prompt: None,
        ..opt.clone()
    };
    let mut report = run(model, model_path, &zopt, on_event)?;
    // llama.cpp on the CPU repeats itself bit for bit: a zoom golden that does not (another
    // build, threads that split sums otherwise, a GPU) is a run other than the scan's.
    if let Some((_, zg)) = &report.golden
        && let Some(k) = g.first_difference(zg)?
    {
        report.notes.push(format!(
            "zoom: llama.cpp run again differs from the scan golden at {k}: the zoom shows a run of its own, not the scan's"
        ));
    }
    Ok(Ok(Zoomed {
        zoom,
        report,
        kept: zoom_out.map(Path::to_path_buf),
    }))
}
