//! The HTML report (`--html FILE`): one self-contained page, no script and no network. For each
//! comparison: the verdict and the diagnosis with its evidence, the per-layer error curve (log10
//! NMSE by layer, one line per tap kind, thresholds drawn, first divergence marked; drawn by
//! plotters as inline SVG), a layer × tap heat map coloured by closeness to the threshold, the
//! logits per step; then both token sequences and the run's settings.

use super::{COLUMNS, RunInfo, TraceInfo};
use crate::compare::{Comparison, PairKind, TapResult};
use crate::trace::Tap;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::fmt::Write;

/// One colour per per-layer tap kind (in `COLUMNS` order): distinct hues, darker first half.
const PALETTE: [(u8, u8, u8); 20] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
    (57, 59, 121),
    (173, 73, 74),
    (99, 121, 57),
    (206, 109, 189),
    (0, 0, 0),
    (107, 110, 207),
    (231, 203, 148),
    (82, 84, 163),
    (140, 162, 82),
    (189, 158, 57),
];

/// Markup escaped, and control characters too (an ESC from a label would reach a terminal
/// that shows the file).
fn esc(s: &str) -> String {
    super::shown::text(s)
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Worst value over steps of one (layer, tap).
#[derive(Clone, Copy)]
struct Cell {
    nmse: f64,
    threshold: f64,
    fail: bool,
    /// The step of the worst value.
    step: usize,
}

type Grid = BTreeMap<(Option<usize>, Tap), Cell>;

fn grid(c: &Comparison) -> Grid {
    let mut g: Grid = BTreeMap::new();
    for r in &c.results {
        let e = g.entry((r.key.layer, r.key.tap)).or_insert(Cell {
            nmse: 0.0,
            threshold: r.threshold,
            fail: false,
            step: r.key.step,
        });
        if r.metrics.nmse > e.nmse || r.metrics.nmse.is_nan() {
            e.nmse = r.metrics.nmse;
            e.threshold = r.threshold;
            e.step = r.key.step;
        }
        e.fail |= !r.pass;
    }
    g
}

fn layers(g: &Grid) -> Vec<usize> {
    let mut v: Vec<usize> = g.keys().filter_map(|(l, _)| *l).collect();
    v.dedup();
    v
}

fn sci(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if !x.is_finite() {
        format!("{x}")
    } else {
        format!("{x:.2e}")
    }
}

fn pair_name(p: PairKind) -> &'static str {
    match p {
        PairKind::SameRounding => "same activation rounding",
        PairKind::DifferentRounding => "different activation rounding",
        PairKind::OpByOp => "op by op (each op fed the baseline's inputs)",
        PairKind::OwnInputs => "each op on its own inputs (own error)",
    }
}

/// x coordinate of a (layer, tap) on the curve: embd at -1, layers 0.., result_norm and logits
/// at n_layer.
fn x_of(layer: Option<usize>, tap: Tap, n_layer: usize) -> f64 {
    match (layer, tap) {
        (Some(l), _) => l as f64,
        (None, Tap::Embd) => -1.0,
        _ => n_layer as f64,
    }
}

/// The error curve as an SVG string.
fn curve(c: &Comparison, g: &Grid) -> Result<String, String> {
    let ls = layers(g);
    let n_layer = ls.last().map_or(0, |l| l + 1);
    let logs: Vec<f64> = g
        .values()
        .filter(|v| v.nmse > 0.0 && v.nmse.is_finite())
        .map(|v| v.nmse.log10())
        .chain(g.values().map(|v| v.threshold.log10()))
        .collect();
    let lo = logs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // Bit-identical values sit on a floor row labelled "exact"; non-finite ones on a ceiling.
    let floor = (lo.min(-14.0) - 2.0).floor();
    let ceil = (hi.max(0.0) + 1.0).ceil();
    let y_of = |v: &Cell| {
        if v.nmse == 0.0 {
            floor
        } else if !v.nmse.is_finite() {
            ceil
        } else {
            v.nmse.log10()
        }
    };
    let (w, h) = (980u32, 430u32);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| format!("drawing the curve: {e}");
        root.fill(&WHITE).map_err(e)?;
        let (plot, legend) = root.split_horizontally(w - 150);
        let mut chart = ChartBuilder::on(&plot)
            .margin(12)
            .caption(
                // plotters escapes markup, not control characters: the labels are a file's.
                format!(
                    "{} vs {}: log10 NMSE by layer (worst over steps)",
                    super::shown::shown(&c.candidate),
                    super::shown::shown(&c.baseline)
                ),
                ("sans-serif", 17),
            )
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(-1.4..(n_layer as f64 + 0.4), floor - 0.5..ceil + 0.3)
            .map_err(e)?;
        let fl = floor;
        let ce = ceil;
        let nl = n_layer as f64;
        chart
            .configure_mesh()
            .x_labels((n_layer + 3).min(30))
            .y_labels(((ceil - floor) as usize + 2).min(24))
            .x_label_formatter(&|x| {
                if (x - x.round()).abs() > 1e-6 {
                    String::new()
                } else if x.round() == -1.0 {
                    "embd".into()
                } else if x.round() == nl {
                    "out".into()
                } else {
                    format!("{}", x.round() as i64)
                }
            })
            .y_label_formatter(&|y| {
                if (y - fl).abs() < 1e-6 {
                    "exact".into()
                } else if (y - ce).abs() < 1e-6 {
                    "inf/NaN".into()
                } else if (y - y.round()).abs() < 1e-6 {
                    format!("1e{}", y.round() as i64)
                } else {
                    String::new()
                }
            })
            .x_desc("layer")
            .y_desc("NMSE")
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(215, 215, 215))
            .draw()
            .map_err(e)?;

        // Thresholds: one dashed red line per distinct per-layer threshold; embd's own below.
        let mut thresholds: Vec<f64> = g
            .iter()
            .filter(|((l, _), _)| l.is_some())
            .map(|(_, v)| v.threshold)
            .collect();
        thresholds.sort_by(f64::total_cmp);
        thresholds.dedup();
        let red = RGBColor(200, 0, 0);
        for t in &thresholds {
            let y = t.log10();
            chart
                .draw_series(DashedLineSeries::new(
                    [(-0.5, y), (nl - 0.5, y)],
                    6,
                    4,
                    red.stroke_width(2),
                ))
                .map_err(e)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("threshold {t:.0e}"),
                    ((nl - 0.5).max(0.0) - 0.05 * nl.max(1.0), y + 0.55),
                    ("sans-serif", 13).into_font().color(&red),
                )))
                .map_err(e)?;
        }
        for tap in [Tap::Embd, Tap::ResultNorm, Tap::Logits] {
            if let Some(v) = g.get(&(None, tap)) {
                let x = x_of(None, tap, n_layer);
                let y = v.threshold.log10();
                chart
                    .draw_series(DashedLineSeries::new(
                        [(x - 0.3, y), (x + 0.3, y)],
                        4,
                        3,
                        red.stroke_width(2),
                    ))
                    .map_err(e)?;
            }
        }

        // One line per per-layer tap kind.
        for (i, (tap, _)) in COLUMNS.iter().enumerate() {
            let pts: Vec<(f64, f64)> = ls
                .iter()
                .filter_map(|l| g.get(&(Some(*l), *tap)).map(|v| (*l as f64, y_of(v))))
                .collect();
            if pts.is_empty() {
                continue;
            }
            let (r, gr, b) = PALETTE[i];
            let col = RGBColor(r, gr, b);
            chart
                .draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))
                .map_err(e)?;
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 3, col.filled())))
                .map_err(e)?;
        }
        // Graph-wide taps as markers.
        for (tap, shape) in [(Tap::Embd, 0), (Tap::ResultNorm, 1), (Tap::Logits, 2)] {
            if let Some(v) = g.get(&(None, tap)) {
                let p = (
                    x_of(None, tap, n_layer) + 0.12 * (shape as f64 - 1.0),
                    y_of(v),
                );
                let col = RGBColor(60, 60, 60);
                chart
                    .draw_series(std::iter::once(TriangleMarker::new(p, 6, col.filled())))
                    .map_err(e)?;
                chart
                    .draw_series(std::iter::once(Text::new(
                        tap.name().to_string(),
                        // Stagger the labels of the two markers that share the "out" column.
                        (p.0 - 0.1, p.1 + 0.9 + 0.9 * (shape as f64 - 1.0).max(0.0)),
                        ("sans-serif", 11).into_font().color(&col),
                    )))
                    .map_err(e)?;
            }
        }
        // The first divergence: a vertical line and a ring at its value.
        if let Some(d) = &c.first_divergence {
            let k = d.at.key;
            let x = x_of(k.layer, k.tap, n_layer);
            let v = g
                .get(&(k.layer, k.tap))
                .map_or(d.at.metrics.nmse.log10(), y_of);
            chart
                .draw_series(LineSeries::new(
                    [(x, floor - 0.5), (x, ceil + 0.3)],
                    red.stroke_width(1),
                ))
                .map_err(e)?;
            chart
                .draw_series(std::iter::once(Circle::new((x, v), 9, red.stroke_width(3))))
                .map_err(e)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("first divergence: {}", k),
                    (x + 0.05, ceil - 0.1),
                    ("sans-serif", 14).into_font().color(&red),
                )))
                .map_err(e)?;
        }

        // Legend beside the plot.
        legend.fill(&WHITE).map_err(e)?;
        let mut y = 40;
        for (i, (tap, _)) in COLUMNS.iter().enumerate() {
            if !g.keys().any(|(l, t)| l.is_some() && t == tap) {
                continue;
            }
            let (r, gr, b) = PALETTE[i];
            let col = RGBColor(r, gr, b);
            legend
                .draw(&PathElement::new(
                    vec![(8, y), (34, y)],
                    col.stroke_width(3),
                ))
                .map_err(e)?;
            legend
                .draw(&Text::new(
                    tap.name().to_string(),
                    (40, y - 7),
                    ("sans-serif", 13),
                ))
                .map_err(e)?;
            y += 21;
        }
        legend
            .draw(&PathElement::new(
                vec![(8, y), (34, y)],
                red.stroke_width(2),
            ))
            .map_err(e)?;
        legend
            .draw(&Text::new("threshold", (40, y - 7), ("sans-serif", 13)))
            .map_err(e)?;
        root.present().map_err(e)?;
    }
    Ok(svg)
}

/// CSS background of a heat-map cell: green far below the threshold, through yellow to orange
/// at it, red over it, pale when bit-identical.
fn heat(v: &Cell) -> (String, &'static str) {
    if v.fail || !v.nmse.is_finite() {
        return ("#c62828".into(), "#fff");
    }
    if v.nmse == 0.0 {
        return ("#e8f5e9".into(), "#555");
    }
    // 0 at ≥ 8 decades below the threshold, 1 at the threshold; squared so that only the
    // last decades before the threshold turn yellow and orange.
    let r = ((v.nmse / v.threshold).log10() / 8.0 + 1.0).clamp(0.0, 1.0);
    let hue = 120.0 * (1.0 - r * r);
    (
        format!("hsl({hue:.0}, 70%, {:.0}%)", 78.0 - 18.0 * r),
        "#111",
    )
}

fn heat_cell(out: &mut String, key: (Option<usize>, Tap), g: &Grid, first: Option<&TapResult>) {
    match g.get(&key) {
        None => out.push_str("<td class=na>–</td>"),
        Some(v) => {
            let (bg, fg) = heat(v);
            let is_first = first.is_some_and(|f| (f.key.layer, f.key.tap) == key);
            let text = if v.nmse == 0.0 {
                "exact".to_string()
            } else if v.nmse.is_finite() {
                format!("{:.1}", v.nmse.log10())
            } else {
                "inf".into()
            };
            let place = match key.0 {
                Some(l) => format!("layer {l} {}", key.1),
                None => key.1.to_string(),
            };
            let _ = write!(
                out,
                "<td style=\"background:{bg};color:{fg}\"{} title=\"{place}: worst NMSE {} (step {}), threshold {:.0e}\">{}{text}</td>",
                if is_first { " class=first" } else { "" },
                sci(v.nmse),
                v.step,
                v.threshold,
                if is_first { "◆ " } else { "" }
            );
        }
    }
}

fn heatmap(c: &Comparison, g: &Grid) -> String {
    let first = c.first_divergence.as_ref().map(|d| &d.at);
    let taps: Vec<(Tap, &str)> = COLUMNS
        .iter()
        .copied()
        .filter(|(t, _)| g.keys().any(|(l, x)| l.is_some() && x == t))
        .collect();
    let mut out = String::from("<table class=heat><tr><th>layer</th>");
    for (_, h) in &taps {
        let _ = write!(out, "<th>{h}</th>");
    }
    out.push_str("</tr>");
    for l in layers(g) {
        let _ = write!(out, "<tr><th>{l}</th>");
        for (t, _) in &taps {
            heat_cell(&mut out, (Some(l), *t), g, first);
        }
        out.push_str("</tr>");
    }
    out.push_str("</table><table class=heat><tr>");
    for t in [Tap::Embd, Tap::ResultNorm, Tap::Logits] {
        if g.contains_key(&(None, t)) {
            let _ = write!(out, "<th>{t}</th>");
            heat_cell(&mut out, (None, t), g, first);
        }
    }
    out.push_str("</tr></table>");
    out
}

fn tap_row(out: &mut String, r: &TapResult, what: &str) {
    let m = &r.metrics;
    let _ = write!(
        out,
        "<tr><td>{what}</td><td>{}</td><td>{}</td><td>{:.0e}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{}/{}/{}</td></tr>",
        esc(&r.key.to_string()),
        sci(m.nmse),
        r.threshold,
        if m.cosine.is_finite() {
            format!("{:.6}", m.cosine)
        } else {
            "–".into()
        },
        sci(m.max_abs),
        m.sqnr_db,
        m.nan_a,
        m.nan_b,
        m.inf_mismatch
    );
}

fn evidence(c: &Comparison) -> String {
    let mut out = String::new();
    if let Some(t) = &c.token_mismatch {
        let ids = |v: &[u32]| {
            v.iter()
                .enumerate()
                .map(|(j, id)| {
                    if j == t.index {
                        format!("<mark>{id}</mark>")
                    } else {
                        id.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let text = |x: &Option<String>| {
            x.as_ref()
                .map(|s| format!(" <q>{}</q>", esc(s)))
                .unwrap_or_default()
        };
        let _ = write!(
            out,
            "<p class=bad>Token ids differ ({}) at step {} index {}:</p><ul class=tok><li>baseline: [{}]{}</li><li>candidate: [{}]{}</li></ul>",
            t.kind.name(),
            t.step,
            t.index,
            ids(&t.baseline_ids),
            text(&t.baseline_text),
            ids(&t.candidate_ids),
            text(&t.candidate_text)
        );
    }
    if let Some(d) = &c.first_divergence {
        let _ = write!(
            out,
            "<p><b>Diagnosis:</b> {}</p><table class=ev><tr><th></th><th>tap</th><th>NMSE</th><th>threshold</th><th>cosine</th><th>max |Δ|</th><th>SQNR dB</th><th>NaN a/b, Inf≠</th></tr>",
            esc(&d.diagnosis)
        );
        for r in &d.matched_before {
            tap_row(&mut out, r, "still matching");
        }
        tap_row(&mut out, &d.at, "<b>first divergence</b>");
        out.push_str("</table>");
        let failing: Vec<&TapResult> = c.results.iter().filter(|r| !r.pass).collect();
        let _ = write!(
            out,
            "<p>{} of {} taps over their threshold; the first ones: {}.</p>",
            failing.len(),
            c.results.len(),
            esc(&failing
                .iter()
                .take(8)
                .map(|r| r.key.to_string())
                .collect::<Vec<_>>()
                .join(", "))
        );
    }
    if !c.logits.is_empty() {
        out.push_str("<table class=ev><tr><th>step</th><th>KLD mean</th><th>KLD max</th><th>top-1 agree</th><th>top-5 overlap</th></tr>");
        for l in &c.logits {
            let cls = if l.kld_mean > c.kld_threshold {
                " class=bad"
            } else {
                ""
            };
            let _ = write!(
                out,
                "<tr{cls}><td>{}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>{:.2}/5</td></tr>",
                l.step,
                sci(l.kld_mean),
                sci(l.kld_max),
                l.top1_agree,
                l.rows,
                l.top5_overlap_mean
            );
        }
        let _ = write!(
            out,
            "</table><p class=small>KLD threshold {:.0e}.</p>",
            c.kld_threshold
        );
    }
    out
}

/// A trace's ids, step by step, with the decoded text when known; `mark` highlights one id.
fn token_block(t: &TraceInfo, mark: Option<(usize, usize)>) -> String {
    let mut out = format!(
        "<div class=tok><b>{}</b> <span class=small>({})</span><ol start=0>",
        esc(&t.label()),
        esc(&t.model.path)
    );
    for (i, s) in t.steps.iter().enumerate() {
        let ids: Vec<String> = s
            .tokens
            .iter()
            .enumerate()
            .map(|(j, id)| {
                if mark == Some((s.step, j)) {
                    format!("<mark>{id}</mark>")
                } else {
                    id.to_string()
                }
            })
            .collect();
        let text = t
            .text
            .as_ref()
            .and_then(|v| v.get(i))
            .map(|x| format!(" <q>{}</q>", esc(x)))
            .unwrap_or_default();
        let _ = write!(
            out,
            "<li>step {}{}: [{}]{text}</li>",
            s.step,
            if i == 0 { " (prefill)" } else { "" },
            ids.join(", ")
        );
    }
    if let Some(v) = &t.text {
        let _ = write!(
            out,
            "</ol><p>All steps as text: <q>{}</q></p></div>",
            esc(&v.concat())
        );
    } else {
        out.push_str("</ol></div>");
    }
    out
}

fn settings_table(info: &RunInfo) -> String {
    let mut out = String::from(
        "<table class=ev><tr><th>trace</th><th>producer version</th><th>model</th><th>sha256</th><th>settings</th></tr>",
    );
    for t in &info.traces {
        let mut s = String::new();
        if let Some(obj) = t.producer.settings.as_object() {
            for (k, v) in obj {
                if matches!(k.as_str(), "command" | "self_check" | "system_info") {
                    continue;
                }
                let _ = write!(s, "<b>{}</b>={} ", esc(k), esc(&v.to_string()));
            }
            let _ = write!(
                s,
                "<details><summary>all</summary><pre>{}</pre></details>",
                esc(&serde_json::to_string_pretty(&t.producer.settings).unwrap_or_default())
            );
        } else if !t.producer.settings.is_null() {
            s = esc(&t.producer.settings.to_string());
        }
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=mono>{}</td><td class=set>{s}</td></tr>",
            esc(&t.label()),
            esc(&t.producer.version),
            esc(&t.model.path),
            esc(&t.model.sha256)
        );
    }
    out.push_str("</table>");
    out
}

const CSS: &str = "body{font-family:DejaVu Sans,Arial,sans-serif;margin:24px;color:#111;max-width:1280px}
h1{font-size:24px;margin:0 0 8px} h2{font-size:19px;margin:28px 0 6px;border-top:2px solid #ddd;padding-top:14px}
h3{font-size:15px;margin:14px 0 4px}
.badge{display:inline-block;padding:3px 10px;border-radius:4px;color:#fff;font-weight:bold}
.ok{background:#2e7d32} .no{background:#c62828}
table{border-collapse:collapse;margin:6px 0;font-size:12px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}
th{background:#f4f4f4} table.ev td{text-align:left}
table.heat td{min-width:46px;font-family:DejaVu Sans Mono,monospace}
td.first{outline:3px solid #000;outline-offset:-3px;font-weight:bold}
td.na{color:#aaa;text-align:center}
.bad{color:#c62828} .small{color:#666;font-size:12px} .mono{font-family:monospace;font-size:11px}
td.set{max-width:520px;font-size:11px;word-break:break-word}
.tok{margin:6px 0;font-size:13px} .tok ol{margin:2px 0} mark{background:#ffcdd2;font-weight:bold}
p.verdict{font-size:14px;line-height:1.4}";

/// The whole page.
pub fn page(comparisons: &[Comparison], info: &RunInfo) -> Result<String, String> {
    let diverged = comparisons.iter().filter(|c| c.diverged()).count();
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html><html><head><meta charset=utf-8><title>parity report</title><style>{CSS}</style></head><body>"
    );
    let _ = write!(
        out,
        "<h1>parity report <span class=\"badge {}\">{}</span></h1><p class=small>parity {} — {} comparisons, {} diverged.</p>",
        if diverged > 0 { "no" } else { "ok" },
        if diverged > 0 { "DIVERGED" } else { "PARITY" },
        env!("CARGO_PKG_VERSION"),
        comparisons.len(),
        diverged
    );
    out.push_str("<table class=ev><tr><th>#</th><th>candidate</th><th>baseline</th><th>tolerances</th><th>weights</th><th>verdict</th><th>first divergence</th></tr>");
    for (i, c) in comparisons.iter().enumerate() {
        let _ = write!(
            out,
            "<tr><td><a href=\"#c{i}\">{i}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&c.candidate),
            esc(&c.baseline),
            pair_name(c.pair),
            c.weight_type,
            if c.diverged() {
                "<span class=bad>diverged</span>"
            } else {
                "parity"
            },
            c.first_divergence
                .as_ref()
                .map(|d| esc(&d.at.key.to_string()))
                .or_else(|| c.token_mismatch.as_ref().map(|_| "token ids".into()))
                .unwrap_or_else(|| "–".into())
        );
    }
    out.push_str("</table>");

    for (i, c) in comparisons.iter().enumerate() {
        let g = grid(c);
        let _ = write!(
            out,
            "<h2 id=c{i}>{i}. {} vs {} <span class=\"badge {}\">{}</span></h2><p class=small>{}, {} weights.</p><p class=verdict>{}</p>",
            esc(&c.candidate),
            esc(&c.baseline),
            if c.diverged() { "no" } else { "ok" },
            if c.diverged() { "DIVERGED" } else { "PARITY" },
            pair_name(c.pair),
            c.weight_type,
            esc(&super::verdict(c))
        );
        out.push_str(&evidence(c));
        if !g.is_empty() {
            out.push_str("<h3>Error curve</h3>");
            out.push_str(&curve(c, &g)?);
            out.push_str("<h3>Layer × tap heat map</h3><p class=small>log10 NMSE, worst over steps; colour: green far below the threshold, yellow–orange near it, red over it; ◆ first divergence. Hover for the value, step and threshold.</p>");
            out.push_str(&heatmap(c, &g));
        }
        let (base, cand) = info.sides(c);
        if let (Some(b), Some(k)) = (base, cand)
            && c.token_mismatch.is_some()
        {
            let mark = c.token_mismatch.as_ref().map(|t| (t.step, t.index));
            out.push_str("<h3>Token ids</h3>");
            out.push_str(&token_block(b, mark));
            out.push_str(&token_block(k, mark));
        }
    }

    if !info.traces.is_empty() {
        out.push_str("<h2>Token sequences</h2>");
        // Traces with identical ids are shown once.
        let mut shown: Vec<Vec<u32>> = Vec::new();
        for t in &info.traces {
            let ids = t.all_tokens();
            let same: Vec<String> = info
                .traces
                .iter()
                .filter(|x| x.all_tokens() == ids)
                .map(|x| x.label())
                .collect();
            if shown.contains(&ids) {
                continue;
            }
            shown.push(ids);
            out.push_str(&token_block(t, None));
            if same.len() > 1 {
                let _ = write!(
                    out,
                    "<p class=small>Same ids in: {}.</p>",
                    esc(&same.join(", "))
                );
            }
        }
        out.push_str("<h2>Run settings</h2>");
        out.push_str(&settings_table(info));
    }
    out.push_str("</body></html>\n");
    Ok(out)
}
