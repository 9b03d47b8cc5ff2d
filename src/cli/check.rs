//! `parity golden`, `parity check` and `parity diff`.

use super::output::{ReportArgs, finish_with, run_info, show};
use super::run::{InputArgs, make_backend, model_ref, producer};
use super::{Result, err, python, repo_root};
use crate::backend;
use crate::compare::{CompareOptions, Comparison, PairKind, compare};
use crate::model::Model;
use crate::trace::{MemorySink, ReplaySink, TapFilter, Trace};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The committed default: `parity check` with no MODEL runs this fixture against its golden.
pub const DEFAULT_FIXTURE: &str = "fixtures/tiny-llama-q8_0.gguf";

/// Backends whose every tap can take the baseline's tensor (`trace::tap_mut`), so they can be
/// compared op by op.
const OP_BY_OP: [&str; 2] = ["reference:ggml-cpu", "fast"];

#[derive(Args)]
pub struct GoldenArgs {
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps after the prefill (teacher-forced from llama.cpp's greedy continuation).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Ids to feed at the decode steps instead of llama.cpp's own greedy choice (comma
    /// separated), e.g. another golden's continuation, so two goldens see the same sequence.
    #[arg(long, value_delimiter = ',')]
    forced: Vec<u32>,
    /// Output trace folder.
    #[arg(long)]
    out: PathBuf,
    /// Keep llama.cpp's default settings (F16 KV cache, flash attention auto) instead of the
    /// tight ones (F32 KV cache, flash attention off, no weight repacking).
    #[arg(long)]
    llama_defaults: bool,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Overwrite a non-empty output folder.
    #[arg(long)]
    force: bool,
}

pub fn golden(a: GoldenArgs) -> Result<ExitCode> {
    let script = repo_root().join("scripts/llama_golden.py");
    if !script.exists() {
        return Err(err(format!("{} not found", script.display())));
    }
    let py = python();
    let probe = Command::new(&py)
        .args(["-c", "import llama_cpp, numpy"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(_) => {
            return Err(err(format!(
                "llama_cpp (llama-cpp-python) or numpy is not installed for {}: pip install llama-cpp-python numpy (or set PARITY_PYTHON to a Python that has them)",
                py.display()
            )));
        }
        Err(e) => {
            return Err(err(format!(
                "cannot run {} ({e}): install Python 3 with llama-cpp-python, or set PARITY_PYTHON",
                py.display()
            )));
        }
    }
    let mut cmd = Command::new(&py);
    cmd.arg(&script).arg(&a.model).arg("--out").arg(&a.out);
    match (&a.input.prompt, &a.input.tokens) {
        (Some(p), _) => {
            cmd.arg("--prompt").arg(p);
        }
        (None, Some(t)) => {
            let s: Vec<String> = t.iter().map(|i| i.to_string()).collect();
            cmd.arg("--tokens").arg(s.join(","));
        }
        (None, None) => return Err(err("give a prompt (-p TEXT) or ids (--tokens 1,2,3)")),
    }
    if a.input.no_bos {
        cmd.arg("--no-bos");
    }
    cmd.arg("--steps").arg(a.steps.to_string());
    if !a.forced.is_empty() {
        let s: Vec<String> = a.forced.iter().map(|i| i.to_string()).collect();
        cmd.arg("--forced").arg(s.join(","));
    }
    cmd.arg("--threads").arg(a.threads.to_string());
    if a.llama_defaults {
        cmd.arg("--llama-defaults");
    }
    if a.force {
        cmd.arg("--force");
    }
    let status = cmd
        .status()
        .map_err(|e| err(format!("running {}: {e}", py.display())))?;
    match status.code() {
        Some(0) => Ok(ExitCode::SUCCESS),
        Some(1) => Ok(ExitCode::from(1)),
        _ => Ok(ExitCode::from(2)),
    }
}

/// Trace folders under `dir` (or `dir` itself) whose model sha256 is `sha`.
fn find_goldens(dir: &Path, sha: &str) -> Result<Vec<(PathBuf, Trace)>> {
    if dir.join("manifest.json").exists() {
        return Ok(vec![(dir.to_path_buf(), Trace::open(dir)?)]);
    }
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(out);
    };
    let mut paths: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    paths.sort();
    for p in paths {
        if p.join("manifest.json").exists() {
            let t = Trace::open(&p)?;
            if t.manifest.model.sha256 == sha {
                out.push((p, t));
            }
        }
    }
    Ok(out)
}

#[derive(Args)]
pub struct CheckArgs {
    /// GGUF model (default: the committed fixture fixtures/tiny-llama-q8_0.gguf).
    model: Option<PathBuf>,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps (default: as many as the golden has, else 4).
    #[arg(long)]
    steps: Option<usize>,
    /// Backends to run: reference (plain f32), reference:ggml-cpu (emulating ggml's CPU
    /// activation rounding), fast.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "reference,reference:ggml-cpu,fast"
    )]
    backends: Vec<String>,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// A golden trace folder, or a folder of goldens searched by model sha256 (default:
    /// ./golden, then the goldens that ship with parity).
    #[arg(long)]
    golden: Option<PathBuf>,
    #[command(flatten)]
    report: ReportArgs,
    /// Skip the op-by-op comparison (each reference op fed the golden's inputs).
    #[arg(long)]
    no_op_by_op: bool,
    /// Print the per-layer table of every comparison, not only the ones against the golden.
    #[arg(long, short)]
    verbose: bool,
}

/// Producers known to round matmul inputs as ggml's CPU does. Anything else (the plain
/// reference, an external engine) is judged with different-rounding tolerances unless
/// `parity diff --strict` says otherwise.
pub(super) fn rounds_like_ggml(producer_backend: &str) -> bool {
    matches!(
        producer_backend,
        "reference:ggml-cpu" | "fast" | "llama.cpp-cpu"
    )
}

/// A llama.cpp golden made with the tight settings (F32 KV cache, no flash attention).
fn golden_is_tight(g: &Trace) -> bool {
    let s = &g.manifest.producer.settings;
    let kv_f32 = s
        .get("type_k")
        .and_then(|v| v.as_str())
        .is_none_or(|k| k == "f32");
    let no_fa = s
        .get("flash_attn")
        .is_none_or(|v| v.as_bool() == Some(false) || v.as_str() == Some("disabled"));
    kv_f32 && no_fa
}

fn pair_kind(a: &Trace, b: &Trace) -> PairKind {
    let golden_tight = |t: &Trace| {
        t.manifest.producer.name != "llama.cpp"
            || t.manifest
                .producer
                .settings
                .get("type_k")
                .and_then(|v| v.as_str())
                .is_none_or(|k| k == "f32")
    };
    if rounds_like_ggml(&a.manifest.producer.backend)
        && rounds_like_ggml(&b.manifest.producer.backend)
        && golden_tight(a)
        && golden_tight(b)
    {
        PairKind::SameRounding
    } else {
        PairKind::DifferentRounding
    }
}

pub fn check(a: CheckArgs) -> Result<ExitCode> {
    let model_path = a
        .model
        .clone()
        .unwrap_or_else(|| repo_root().join(DEFAULT_FIXTURE));
    if !model_path.exists() {
        return Err(err(format!("{}: no such file", model_path.display())));
    }
    let model = Model::open(&model_path)?;
    let sha = model.sha256().to_string();
    // Default: ./golden (where `parity golden --out golden/NAME` puts them), then the goldens
    // committed with parity itself.
    let golden_dir = a.golden.clone().unwrap_or_else(|| {
        let local = PathBuf::from("golden");
        let has_match = find_goldens(&local, &sha).is_ok_and(|g| !g.is_empty());
        if has_match {
            local
        } else {
            repo_root().join("golden")
        }
    });
    let mut goldens = find_goldens(&golden_dir, &sha)?;
    if a.golden.is_some() && goldens.len() == 1 && goldens[0].1.manifest.model.sha256 != sha {
        return Err(err(format!(
            "golden {} was made for another model (sha256 {}…), not {} (sha256 {}…)",
            goldens[0].0.display(),
            &goldens[0]
                .1
                .manifest
                .model
                .sha256
                .chars()
                .take(12)
                .collect::<String>(),
            model_path.display(),
            &sha[..12]
        )));
    }

    // The ids: from the user if given (and then the golden must be for the same ids), else
    // from the golden (prompt and forced decode tokens).
    let (prompt, forced, steps) = if a.input.given() {
        let (ids, policy) = a.input.resolve(&model.file)?;
        eprintln!("prompt ids: {ids:?} — {policy}");
        let wanted_steps = a.steps;
        goldens.retain(|(_, g)| g.manifest.steps.first().is_some_and(|s| s.tokens == ids));
        if goldens.is_empty() && find_goldens(&golden_dir, &sha)?.len() == 1 && a.golden.is_some() {
            let g = Trace::open(&golden_dir)?;
            return Err(err(format!(
                "golden {} was made for other token ids {:?}, not {:?}: make one with `parity golden {} -p ... --out DIR`",
                golden_dir.display(),
                g.manifest
                    .steps
                    .first()
                    .map(|s| s.tokens.clone())
                    .unwrap_or_default(),
                ids,
                model_path.display()
            )));
        }
        match goldens.first() {
            Some((_, g)) => {
                let forced: Vec<u32> = g.manifest.decode_tokens();
                let n = wanted_steps.unwrap_or(forced.len()).min(forced.len());
                (ids, Some(forced[..n].to_vec()), n)
            }
            None => (ids, None, wanted_steps.unwrap_or(4)),
        }
    } else {
        match goldens.first() {
            Some((_, g)) => {
                let ids = g
                    .manifest
                    .steps
                    .first()
                    .map(|s| s.tokens.clone())
                    .unwrap_or_default();
                let forced: Vec<u32> = g.manifest.decode_tokens();
                let n = a.steps.unwrap_or(forced.len()).min(forced.len());
                eprintln!("prompt ids: {ids:?} — from the golden");
                (ids, Some(forced[..n].to_vec()), n)
            }
            None => {
                return Err(err(format!(
                    "no golden for {} (sha256 {}…) in {}: give a prompt (-p TEXT) to compare backends only, or make a golden with `parity golden`",
                    model_path.display(),
                    &sha[..12],
                    golden_dir.display()
                )));
            }
        }
    };
    let golden = goldens.into_iter().next();
    match &golden {
        Some((p, _)) => eprintln!("golden: {}", p.display()),
        None => eprintln!(
            "golden: none for sha256 {}… in {} — comparing backends with each other only",
            &sha[..12],
            golden_dir.display()
        ),
    }

    let mut traces: Vec<Trace> = Vec::new();
    let mut traces_op: Vec<Trace> = Vec::new();
    // One sequence for every backend: the golden's ids, else the first backend's own greedy
    // continuation forced into the others (their greedy agreement is a statistic of the
    // logits comparison, never a divergence of its own).
    let mut forced = forced;
    for name in &a.backends {
        let mut b = make_backend(name, &model, prompt.len() + steps, a.threads)?;
        let mut sink = MemorySink::new(TapFilter::all());
        let info = backend::run(b.as_mut(), &prompt, steps, forced.as_deref(), &mut sink)?;
        if forced.is_none() {
            forced = Some(info.iter().skip(1).flat_map(|s| s.tokens.clone()).collect());
        }
        traces.push(Trace::from_memory(
            model_ref(&model_path, &model),
            producer(b.as_ref(), serde_json::Value::Null),
            info,
            sink.tensors,
        ));
    }

    let wtype = model.main_weight_type();
    let mut comparisons: Vec<Comparison> = Vec::new();
    // Op by op: each backend that rounds like ggml's CPU, fed the golden's tensor at every tap
    // (ReplaySink), so each op is judged on identical inputs.
    if let Some((_, g)) = golden
        .as_ref()
        .filter(|(_, g)| !a.no_op_by_op && golden_is_tight(g))
    {
        let forced: Vec<u32> = g.manifest.decode_tokens();
        let ids = &g.manifest.steps[0].tokens;
        for name in a.backends.iter().filter(|n| OP_BY_OP.contains(&n.as_str())) {
            let mut b = make_backend(name, &model, ids.len() + forced.len(), a.threads)?;
            let mut sink = ReplaySink::new(g);
            let info = backend::run(b.as_mut(), ids, forced.len(), Some(&forced), &mut sink)?;
            if let Some(e) = sink.error {
                return Err(e.into());
            }
            let mut p = producer(b.as_ref(), serde_json::Value::Null);
            p.backend = format!("{}/op-by-op", p.backend);
            traces_op.push(Trace::from_memory(
                model_ref(&model_path, &model),
                p,
                info,
                sink.inner.tensors,
            ));
        }
    }
    // Compare, print the verdict (and the per-layer table when asked or when it diverged).
    let mut run = |base: &Trace, cand: &Trace, pair: PairKind, table: bool| -> Result<()> {
        let opt = CompareOptions {
            pair,
            weight_type: wtype,
            require_same_model: true,
        };
        let c = compare(base, cand, &opt)?;
        let header = if base.manifest.producer.name == "llama.cpp" {
            format!("== {} vs golden ({})", c.candidate, c.baseline)
        } else {
            format!("== {} vs {}", c.candidate, c.baseline)
        };
        show(&c, &header, table || a.verbose || c.diverged(), &a.report);
        comparisons.push(c);
        Ok(())
    };
    if let Some((_, g)) = &golden {
        for t in &traces_op {
            run(g, t, PairKind::OpByOp, false)?;
        }
        for t in &traces {
            run(g, t, pair_kind(g, t), true)?;
        }
    }
    for i in 0..traces.len() {
        for j in i + 1..traces.len() {
            run(
                &traces[i],
                &traces[j],
                pair_kind(&traces[i], &traces[j]),
                false,
            )?;
        }
    }
    if comparisons.is_empty() {
        return Err(err("nothing to compare: one backend and no golden"));
    }
    let info = run_info(golden.iter().map(|(_, g)| g).chain(&traces_op).chain(&traces));
    finish_with(&comparisons, &info, &a.report)
}
