//! The CI gate: a stable text summary of comparisons (`--snapshot FILE`) and the check of a new
//! run against one (`--against FILE`).
//!
//! Each (comparison, layer, tap kind) keeps the worst NMSE over the steps as a decade bucket
//! (`-13` means 1e-13 ≤ NMSE < 1e-12; `exact` is bit-identical). A new value has *moved* only when
//! it leaves its old bucket by more than [`MARGIN`] decades, so a value that sits on a decade
//! boundary and jitters (threads, GPU reductions) cannot flake the gate, while a kernel change
//! that shifts a tap by a factor of ten or more always shows. The verdict, the first divergence,
//! token ids and top-1 agreement are compared exactly.
//!
//! The file is an insta snapshot (YAML header between `---` lines, then the body), so in a Rust
//! project `cargo insta review` shows and accepts the `FILE.new` written when the gate fails.

use super::COLUMNS;
use crate::compare::{Comparison, PairKind};
use crate::trace::Tap;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The largest snapshot file read: a 100-layer model's comparisons take tens of KB; a bigger
/// file is no snapshot of parity's and is refused before it is read.
pub const MAX_SNAPSHOT_BYTES: u64 = 16 << 20;

/// Read a snapshot file for `--against`: a regular file of at most [`MAX_SNAPSHOT_BYTES`], as
/// text.
pub fn read(path: &std::path::Path) -> std::io::Result<String> {
    let bytes = crate::trace::open::read_bounded(path, MAX_SNAPSHOT_BYTES, "a parity snapshot")?;
    String::from_utf8(bytes).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a parity snapshot (not UTF-8 text)",
        )
    })
}

/// A piece of the snapshot's own text as a message quotes it: short, one line, escaped as every
/// other file-derived string is shown.
fn quote(s: &str) -> String {
    let short = super::shown::capped(s, crate::trace::npy::EXCERPT);
    super::shown::shown(&short).into_owned()
}

/// First line of the body; bumped when the layout changes.
const FORMAT: &str = "parity snapshot v1";

/// How far (in decades) a value may leave its bucket before it counts as moved.
pub const MARGIN: f64 = 0.5;

/// A bucketed NMSE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bucket {
    /// Bit-identical (NMSE 0).
    Exact,
    /// floor(log10(NMSE)).
    Decade(i32),
    /// Infinite NMSE (the baseline is all zero, the candidate not).
    Inf,
    /// NaN or an unmatched Inf on either side.
    NonFinite,
}

impl Bucket {
    fn of(nmse: f64, non_finite: bool) -> Bucket {
        if non_finite || nmse.is_nan() {
            Bucket::NonFinite
        } else if nmse <= 0.0 {
            Bucket::Exact
        } else if nmse.is_infinite() {
            Bucket::Inf
        } else {
            Bucket::Decade(nmse.log10().floor() as i32)
        }
    }

    fn text(self) -> String {
        match self {
            Bucket::Exact => "exact".into(),
            Bucket::Decade(d) => d.to_string(),
            Bucket::Inf => "inf".into(),
            Bucket::NonFinite => "nan".into(),
        }
    }

    fn parse(s: &str) -> Option<Bucket> {
        match s {
            "exact" => Some(Bucket::Exact),
            "inf" => Some(Bucket::Inf),
            "nan" => Some(Bucket::NonFinite),
            _ => s.parse().ok().map(Bucket::Decade),
        }
    }

    /// Whether `new` (a raw value and its bucket) is still within `self`, with the margin.
    fn holds(self, new_value: f64, new: Bucket) -> bool {
        match (self, new) {
            (Bucket::Decade(d), Bucket::Decade(_)) => {
                let x = new_value.log10();
                x >= d as f64 - MARGIN && x < (d + 1) as f64 + MARGIN
            }
            (a, b) => a == b,
        }
    }
}

/// One comparison, reduced to what the gate compares.
#[derive(Clone, Debug, PartialEq)]
struct Summary {
    title: String,
    verdict: String,
    first: String,
    tokens: String,
    top1: String,
    kld: Option<(f64, Bucket)>,
    /// (layer, tap) → (worst NMSE, bucket); layer None for graph-wide taps.
    cells: BTreeMap<(Option<usize>, Tap), (f64, Bucket)>,
}

fn pair_name(p: PairKind) -> &'static str {
    match p {
        PairKind::SameRounding => "same-rounding",
        PairKind::DifferentRounding => "different-rounding",
        PairKind::OpByOp => "op-by-op",
        PairKind::OwnInputs => "own-inputs",
    }
}

fn summarize(c: &Comparison, title: String) -> Summary {
    let mut cells: BTreeMap<(Option<usize>, Tap), (f64, bool)> = BTreeMap::new();
    for r in &c.results {
        let e = cells
            .entry((r.key.layer, r.key.tap))
            .or_insert((0.0, false));
        // NaN-safe max: a NaN NMSE is already flagged by non_finite.
        if r.metrics.nmse > e.0 {
            e.0 = r.metrics.nmse;
        }
        e.1 |= r.metrics.non_finite_failure();
    }
    let cells = cells
        .into_iter()
        .map(|(k, (v, nf))| (k, (v, Bucket::of(v, nf))))
        .collect();
    let kld = (!c.logits.is_empty()).then(|| {
        let v = c.logits.iter().map(|l| l.kld_mean).fold(0.0, f64::max);
        (v, Bucket::of(v, false))
    });
    let top1: usize = c.logits.iter().map(|l| l.top1_agree).sum();
    let rows: usize = c.logits.iter().map(|l| l.rows).sum();
    Summary {
        title,
        verdict: if c.diverged() { "diverged" } else { "parity" }.into(),
        first: c
            .first_divergence
            .as_ref()
            .map_or("none".into(), |d| d.at.key.to_string()),
        tokens: match &c.token_mismatch {
            None => "same".into(),
            Some(t) => format!(
                "{} at step {} index {} (baseline {:?}, candidate {:?})",
                t.kind.name(),
                t.step,
                t.index,
                t.baseline_ids.get(t.index),
                t.candidate_ids.get(t.index)
            ),
        },
        top1: format!("{top1}/{rows}"),
        kld,
        cells,
    }
}

/// Comparison titles, made unique in order (`… #2` for a repeat).
fn summaries(comparisons: &[Comparison]) -> Vec<Summary> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    comparisons
        .iter()
        .map(|c| {
            // The labels are the manifests' producer names: escaped, so a newline in one cannot
            // write a line of its own (`verdict: parity`) into the snapshot the gate reads back.
            let base = format!(
                "{} vs {} [{}, {:?}]",
                super::shown(&c.candidate),
                super::shown(&c.baseline),
                pair_name(c.pair),
                c.weight_type
            );
            let n = seen.entry(base.clone()).or_insert(0);
            *n += 1;
            let title = if *n == 1 {
                base
            } else {
                format!("{base} #{n}")
            };
            summarize(c, title)
        })
        .collect()
}

fn short(tap: Tap) -> &'static str {
    COLUMNS
        .iter()
        .find(|(t, _)| *t == tap)
        .map_or(tap.name(), |(_, s)| s)
}

fn from_short(s: &str) -> Option<Tap> {
    COLUMNS
        .iter()
        .find(|(_, n)| *n == s)
        .map(|(t, _)| *t)
        .or_else(|| Tap::parse(s))
}

/// The snapshot body (no header).
pub fn body(comparisons: &[Comparison]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{FORMAT}: worst NMSE over steps as a decade (-13: 1e-13 <= NMSE < 1e-12; exact: bit-identical)"
    );
    for s in summaries(comparisons) {
        let _ = writeln!(out, "\n== {}", s.title);
        let _ = writeln!(out, "verdict: {}", s.verdict);
        let _ = writeln!(out, "first divergence: {}", s.first);
        let _ = writeln!(out, "tokens: {}", s.tokens);
        if let Some((_, b)) = s.kld {
            let _ = writeln!(out, "logits: kld {} top-1 {}", b.text(), s.top1);
        }
        for tap in super::BEFORE_LAYERS.into_iter().chain(super::AFTER_LAYERS) {
            if let Some((_, b)) = s.cells.get(&(None, tap)) {
                let _ = writeln!(out, "{:<11} {}", tap.name(), b.text());
            }
        }
        let layers: Vec<usize> = {
            let mut v: Vec<usize> = s.cells.keys().filter_map(|(l, _)| *l).collect();
            v.dedup();
            v
        };
        let taps: Vec<Tap> = COLUMNS
            .iter()
            .map(|(t, _)| *t)
            .filter(|t| s.cells.keys().any(|(l, x)| l.is_some() && x == t))
            .collect();
        if !layers.is_empty() {
            let _ = write!(out, "{:<5}", "layer");
            for t in &taps {
                let _ = write!(out, " {:>6}", short(*t));
            }
            out.push('\n');
            for l in layers {
                let _ = write!(out, "{l:<5}");
                for t in &taps {
                    let cell = s
                        .cells
                        .get(&(Some(l), *t))
                        .map_or("-".into(), |c| c.1.text());
                    let _ = write!(out, " {cell:>6}");
                }
                out.push('\n');
            }
        }
    }
    out
}

/// The whole file: insta's header, then the body. `command` is what ran (`parity check`).
pub fn file(comparisons: &[Comparison], command: &str) -> String {
    format!(
        "---\nsource: parity\nexpression: {command}\n---\n{}",
        body(comparisons)
    )
}

/// What a snapshot file holds, parsed back.
struct Parsed {
    title: String,
    fields: BTreeMap<String, String>,
    kld: Option<Bucket>,
    cells: BTreeMap<(Option<usize>, Tap), Bucket>,
}

fn parse(text: &str) -> Result<Vec<Parsed>, String> {
    // Skip insta's YAML header.
    let mut lines = text.lines().peekable();
    if lines.peek().map(|l| l.trim_end()) == Some("---") {
        lines.next();
        for l in lines.by_ref() {
            if l.trim_end() == "---" {
                break;
            }
        }
    }
    let first = lines.next().unwrap_or("");
    if !first.starts_with(FORMAT) {
        return Err(format!(
            "not a parity snapshot (expected a first line '{FORMAT}: …')"
        ));
    }
    let mut out: Vec<Parsed> = Vec::new();
    let mut header: Option<Vec<Tap>> = None;
    for (n, line) in lines.enumerate() {
        let bad = |what: &str| format!("line {}: {what}: \"{}\"", n + 2, quote(line));
        if line.trim().is_empty() {
            continue;
        }
        if let Some(t) = line.strip_prefix("== ") {
            out.push(Parsed {
                title: t.to_string(),
                fields: BTreeMap::new(),
                kld: None,
                cells: BTreeMap::new(),
            });
            header = None;
            continue;
        }
        let cur = out.last_mut().ok_or_else(|| bad("before any '== ' line"))?;
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some((k, v)) = line.split_once(": ") {
            if k == "logits" {
                // logits: kld B top-1 A/B
                match words.as_slice() {
                    [_, "kld", b, "top-1", t] => {
                        cur.kld = Some(Bucket::parse(b).ok_or_else(|| bad("bad bucket"))?);
                        cur.fields.insert("top-1".into(), t.to_string());
                    }
                    _ => return Err(bad("bad logits line")),
                }
            } else {
                cur.fields.insert(k.to_string(), v.to_string());
            }
        } else if words.first() == Some(&"layer") {
            header = Some(
                words[1..]
                    .iter()
                    .map(|w| from_short(w).ok_or_else(|| bad("unknown tap")))
                    .collect::<Result<_, _>>()?,
            );
        } else if let (Some(t), [_, b]) = (Tap::parse(words[0]), words.as_slice()) {
            cur.cells.insert(
                (None, t),
                Bucket::parse(b).ok_or_else(|| bad("bad bucket"))?,
            );
        } else {
            let taps = header
                .as_ref()
                .ok_or_else(|| bad("a row before the header"))?;
            let l: usize = words[0].parse().map_err(|_| bad("bad layer"))?;
            if words.len() != taps.len() + 1 {
                return Err(bad("wrong number of cells"));
            }
            for (t, w) in taps.iter().zip(&words[1..]) {
                if *w != "-" {
                    cur.cells.insert(
                        (Some(l), *t),
                        Bucket::parse(w).ok_or_else(|| bad("bad bucket"))?,
                    );
                }
            }
        }
    }
    Ok(out)
}

fn cell_name(k: &(Option<usize>, Tap)) -> String {
    match k.0 {
        Some(l) => format!("layer {l} {}", k.1),
        None => k.1.to_string(),
    }
}

fn describe(b: Bucket) -> String {
    match b {
        Bucket::Decade(d) => format!("1e{d}"),
        other => other.text(),
    }
}

/// Check `comparisons` against a snapshot file's text: one line per thing that moved (empty:
/// the gate passes). Err: the file is not a parity snapshot.
pub fn against(comparisons: &[Comparison], old_text: &str) -> Result<Vec<String>, String> {
    let old = parse(old_text)?;
    let new = summaries(comparisons);
    let mut moved = Vec::new();
    for o in &old {
        if !new.iter().any(|n| n.title == o.title) {
            moved.push(format!(
                "{}: in the snapshot, not in this run",
                quote(&o.title)
            ));
        }
    }
    for n in &new {
        let Some(o) = old.iter().find(|o| o.title == n.title) else {
            moved.push(format!("{}: in this run, not in the snapshot", n.title));
            continue;
        };
        let t = &n.title;
        for (k, now) in [
            ("verdict", &n.verdict),
            ("first divergence", &n.first),
            ("tokens", &n.tokens),
        ] {
            let was = o.fields.get(k).map_or("(missing)", |s| s.as_str());
            if was != now {
                moved.push(format!("{t}: {k}: {} -> {now}", quote(was)));
            }
        }
        if n.kld.is_some() {
            let was = o.fields.get("top-1").map_or("(missing)", |s| s.as_str());
            if was != n.top1 {
                moved.push(format!(
                    "{t}: logits top-1 agreement: {} -> {}",
                    quote(was),
                    n.top1
                ));
            }
        }
        match (o.kld, n.kld) {
            (Some(b), Some((v, nb))) if !b.holds(v, nb) => moved.push(format!(
                "{t}: logits mean KLD: bucket {} -> {} (now {v:.2e})",
                describe(b),
                describe(nb)
            )),
            (Some(_), None) => moved.push(format!("{t}: logits: no longer compared")),
            (None, Some(_)) => moved.push(format!("{t}: logits: newly compared")),
            _ => {}
        }
        for (k, b) in &o.cells {
            match n.cells.get(k) {
                None => moved.push(format!("{t}: {}: no longer compared", cell_name(k))),
                Some(&(v, nb)) if !b.holds(v, nb) => {
                    let dir = match (b, nb) {
                        (Bucket::Decade(a), Bucket::Decade(c)) if c < *a => "better",
                        (Bucket::Inf | Bucket::NonFinite, _) => "better",
                        (_, Bucket::Exact) => "better",
                        _ => "worse",
                    };
                    moved.push(format!(
                        "{t}: {}: NMSE bucket {} -> {} (now {v:.2e}, {dir})",
                        cell_name(k),
                        describe(*b),
                        describe(nb)
                    ));
                }
                _ => {}
            }
        }
        for k in n.cells.keys().filter(|k| !o.cells.contains_key(k)) {
            moved.push(format!("{t}: {}: newly compared", cell_name(k)));
        }
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_and_margin() {
        assert_eq!(Bucket::of(0.0, false), Bucket::Exact);
        assert_eq!(Bucket::of(3e-13, false), Bucket::Decade(-13));
        assert_eq!(Bucket::of(1e-13, false), Bucket::Decade(-13));
        assert_eq!(Bucket::of(f64::INFINITY, false), Bucket::Inf);
        assert_eq!(Bucket::of(1e-3, true), Bucket::NonFinite);
        let b = Bucket::Decade(-13);
        // Jitter across either decade boundary within half a decade holds…
        for v in [9.9e-13, 1.01e-12, 3.1e-12, 9.9e-14, 3.2e-14] {
            assert!(b.holds(v, Bucket::of(v, false)), "{v}");
        }
        // …a factor past it does not.
        for v in [3.2e-12, 1e-11, 3.1e-14, 1e-15] {
            assert!(!b.holds(v, Bucket::of(v, false)), "{v}");
        }
        assert!(!Bucket::Exact.holds(1e-20, Bucket::of(1e-20, false)));
        assert!(Bucket::Exact.holds(0.0, Bucket::Exact));
        for b in [
            Bucket::Exact,
            Bucket::Inf,
            Bucket::NonFinite,
            Bucket::Decade(-7),
        ] {
            assert_eq!(Bucket::parse(&b.text()), Some(b));
        }
    }

    #[test]
    fn parse_rejects_other_files() {
        assert!(parse("hello\n").is_err());
        assert!(parse("---\nsource: x\n---\nparity snapshot v1: x\nlayer q\n").is_err());
    }
}
