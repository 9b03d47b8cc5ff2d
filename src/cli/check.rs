//! `parity golden` and `parity check` (the terminal side of `crate::check`).

use super::input::InputArgs;
use super::output::{ReportArgs, finish_with, run_info, show};
use super::{Result, err, repo_root};
use crate::check::{CheckOptions, Event};
use crate::compare::{Comparison, PairKind};
use crate::golden::{Aside, join_ids};
use crate::model::Model;
use crate::report::progress::Progress;
use crate::trace::goldens;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The committed default: `parity check` with no MODEL runs this fixture against its golden.
pub const DEFAULT_FIXTURE: &str = "fixtures/tiny-llama-q8_0.gguf";

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
    /// activation rounding), fast, gpu (wgpu). Default: reference,reference:ggml-cpu,fast, and
    /// gpu when a hardware GPU adapter exists (a software one such as lavapipe only when named
    /// here; either way the report says in one line when the GPU was not checked).
    #[arg(long, value_delimiter = ',')]
    backends: Option<Vec<String>>,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
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
    /// Print every comparison with its per-layer table (by default: the verdict, the
    /// comparisons that diverged, else the one that matters most, and a count of the rest).
    #[arg(long, short)]
    verbose: bool,
    /// Refuse a check whose traces (each pass holds one in memory) would be larger than this
    /// (bytes, or 500M, 4G, 1T), before any pass starts.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = crate::arch::size::parse_size)]
    max_trace_size: u64,
    /// Against a scan golden (`golden --record`), do not zoom: by default a check that
    /// diverges runs llama.cpp again with the first diverging step recorded whole and checks
    /// that step tap by tap, the golden's own ops judged one by one.
    #[arg(long)]
    no_zoom: bool,
    /// Keep the zoom's golden in this folder (new or empty) instead of a temporary one.
    #[arg(long, value_name = "DIR", conflicts_with = "no_zoom")]
    zoom_out: Option<PathBuf>,
}

pub fn check(a: CheckArgs) -> Result<ExitCode> {
    let model_path = a
        .model
        .clone()
        .unwrap_or_else(|| repo_root().join(DEFAULT_FIXTURE));
    let mut inputs: Vec<(&Path, &str)> = vec![(&model_path, "the model")];
    if let Some(g) = &a.golden {
        inputs.push((g, "--golden"));
    }
    a.report.validate(&inputs)?;
    if let Some(z) = &a.zoom_out {
        crate::trace::paths::check_paths(&inputs, &[(z, "--zoom-out")]).map_err(err)?;
        match std::fs::read_dir(z).map(|mut d| d.next().is_some()) {
            Ok(true) => {
                return Err(err(format!(
                    "--zoom-out {}: not empty (the zoom's golden needs a new or empty folder)",
                    crate::report::shown::line(&z.display().to_string())
                )));
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(err(format!(
                    "--zoom-out {}: {e}",
                    crate::report::shown::line(&z.display().to_string())
                )));
            }
            _ => {}
        }
    }
    let named = a.backends.as_deref().unwrap_or_default();
    for (i, b) in named.iter().enumerate() {
        if named[..i].contains(b) {
            return Err(err(format!(
                "--backends names {b} twice: a backend compared with itself proves nothing"
            )));
        }
    }
    if !model_path.exists() {
        return Err(err(format!("{}: no such file", model_path.display())));
    }
    let model = Progress::stage("loading the model", a.report.quiet, || {
        Model::open(&model_path)
    })?;
    let prompt = if a.input.given() {
        let (ids, policy) = a.input.resolve(&model.file)?;
        if !a.report.quiet {
            eprintln!("prompt ids: {} — {policy}", join_ids(&ids));
        }
        Some(ids)
    } else {
        None
    };
    let opt = CheckOptions {
        backends: a.backends.clone().unwrap_or_else(|| {
            ["reference", "reference:ggml-cpu", "fast", "gpu"]
                .map(String::from)
                .to_vec()
        }),
        device_optional: a.backends.is_none(),
        threads: a.threads,
        steps: a.steps,
        op_by_op: !a.no_op_by_op,
        golden: a.golden.clone(),
        golden_dirs: goldens::search_dirs(&repo_root().join("golden")),
        prompt,
        max_trace_size: a.max_trace_size,
    };
    // One bar per backend pass (a tick per forward call), then one for the comparisons.
    let quiet = a.report.quiet;
    let mut bar: Option<Progress> = None;
    let mut on_event = |e: Event| match e {
        Event::PassStart {
            backend,
            op_by_op,
            forwards,
        } => {
            let what = if op_by_op {
                format!("{backend} op by op")
            } else {
                backend.to_string()
            };
            bar = Some(Progress::bar(&what, forwards as u64, quiet));
        }
        Event::Forward => {
            if let Some(b) = &bar {
                b.inc(1)
            }
        }
        Event::PassEnd => bar = None,
        Event::Comparing { n } => bar = Some(Progress::bar("comparing", n as u64, quiet)),
        Event::Compared => {
            if let Some(b) = &bar {
                b.inc(1)
            }
        }
        Event::Zooming { step, record } => {
            if !quiet {
                eprintln!(
                    "zoom: the check diverged at step {step} of a scan golden: running llama.cpp again with that step recorded whole (--record '{record}')"
                );
            }
        }
    };
    let mut r = crate::check::run(&model, &model_path, &opt, &mut on_event)?;
    if !quiet {
        if prompt_from_golden(&r) {
            eprintln!("prompt ids: {} — {}", join_ids(&r.prompt), r.ids_from);
        }
        match &r.golden {
            Some((p, _)) => eprintln!(
                "golden: {}",
                crate::report::shown::line(&p.display().to_string())
            ),
            None => eprintln!(
                "golden: none for sha256 {}… in {} — comparing backends with each other only (all fed the first one's greedy continuation)",
                &model.sha256()[..12],
                opt.golden_dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
    // A scan golden's check that diverged zooms: llama.cpp again for that step whole.
    let aside = if quiet { Aside::Quiet } else { Aside::Stderr };
    let zoom = match crate::check::zoom(&r).filter(|_| !a.no_zoom) {
        Some(z) => Some(crate::check::zoom_check(
            &model,
            &model_path,
            &opt,
            &r,
            z,
            a.zoom_out.as_deref(),
            &super::golden::tools(),
            aside,
            &mut on_event,
        )?),
        None => None,
    };
    if let Some(Err(why)) = &zoom {
        r.notes.push(why.clone());
    }
    let info = run_info(
        r.golden
            .iter()
            .map(|(_, g)| g)
            .chain(&r.traces_op)
            .chain(&r.traces),
    );
    // The golden found by sha256 is an input too (known only now).
    let golden_path = r.golden.as_ref().map(|(g, _)| g.clone());
    if let Some(g) = &golden_path {
        inputs.push((g, "the golden"));
    }
    let mut comparisons = render(&a, r, None);
    if let Some(Ok(z)) = zoom {
        let line = format!(
            "zoom: llama.cpp ran again with step {} recorded whole (--record '{}'){}: every tap of that step compared, the golden's own ops judged one by one",
            z.zoom.steps[0],
            z.zoom.record,
            match &z.kept {
                Some(d) => format!(", kept in {}", d.display()),
                None => String::new(),
            }
        );
        say(&a, &crate::report::shown::line(&line));
        comparisons.extend(render(&a, z.report, Some(z.zoom.steps[0])));
    }
    finish_with(
        &crate::judge::verdict::Outcome::of(comparisons),
        &info,
        &a.report,
        &inputs,
    )
}

/// A line of the report: on stdout, or on stderr when the JSON goes to stdout.
fn say(a: &CheckArgs, line: &str) {
    if a.report.quiet {
        return;
    }
    if a.report.json.as_deref() == Some(Path::new("-")) {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// Prints one check's comparisons (the diverged ones, else the one that matters most; all of
/// them with --verbose), its passes and notes; returns its comparisons, those of a zoom at
/// `zoomed` labelled with the step.
fn render(a: &CheckArgs, r: crate::check::CheckReport, zoomed: Option<usize>) -> Vec<Comparison> {
    let quiet = a.report.quiet;
    // The first screen: every comparison that diverged (its paragraph and table), else the one
    // that matters most — the tightest against the golden (op by op first), else the first
    // pair. The rest, and the drift tables of the end-to-end passes, behind --verbose (and in
    // the HTML page).
    let key = r
        .comparisons
        .iter()
        .position(|j| j.comparison.diverged())
        .or_else(|| r.comparisons.iter().position(|j| j.against_golden))
        .unwrap_or(0);
    let n = r.comparisons.len();
    let mut comparisons = Vec::with_capacity(n);
    for (i, j) in r.comparisons.into_iter().enumerate() {
        let mut c = j.comparison;
        if let Some(s) = zoomed {
            c.baseline = format!("{} (zoom: step {s} whole)", c.baseline);
        }
        let header = if j.against_golden {
            format!("== {} vs golden ({})", c.candidate, c.baseline)
        } else {
            format!("== {} vs {}", c.candidate, c.baseline)
        };
        if a.verbose || c.diverged() || i == key {
            // The end-to-end comparisons against the golden show their table when asked for
            // everything: it is the picture of drift along the layers.
            let end_to_end = j.against_golden && c.pair != PairKind::OpByOp;
            show(
                &c,
                &header,
                (end_to_end && a.verbose) || c.diverged(),
                &a.report,
            );
        }
        comparisons.push(c);
    }
    if !a.verbose {
        let diverged = comparisons.iter().filter(|c| c.diverged()).count();
        let shown = if diverged > 0 { diverged } else { 1 };
        say(
            a,
            &format!(
                "{n} comparisons, {diverged} diverged; {} more within tolerance not shown: --verbose prints each (with the drift tables along the layers), --html FILE makes the page",
                n - shown
            ),
        );
    }
    if !quiet {
        let mut line = String::from("backends:");
        for p in &r.passes {
            line.push_str(&format!(
                " {}{} {:.2} s{};",
                p.backend,
                if p.op_by_op { " op by op" } else { "" },
                p.seconds,
                p.peak_rss_bytes
                    .map(|b| format!(" (peak RSS {:.0} MiB)", b as f64 / (1 << 20) as f64))
                    .unwrap_or_default()
            ));
        }
        line.pop();
        // Notes quote the golden's manifest (its backend name): one escaped line each.
        for l in std::iter::once(&line).chain(&r.notes) {
            say(a, &crate::report::shown::line(l));
        }
    }
    comparisons
}

fn prompt_from_golden(r: &crate::check::CheckReport) -> bool {
    r.ids_from == "from the golden"
}
