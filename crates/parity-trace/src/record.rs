//! What a run is asked to record: a **scan** (a few cheap taps at every step and position) and
//! the steps to record **in full** (the zoom). One line, the same for every producer:
//!
//! ```text
//! taps=l_out,result_norm,logits;full=3,7-8
//! ```
//!
//! `parity diff` on a scan prints the line that records the steps it needs; `parity dump`,
//! `parity golden` and the numpy engine take it as `--record`, and an engine writing through
//! this crate (or the Python kit) honours it from the `PARITY_RECORD` environment variable
//! without a change to its code. A part left out means every tap (`taps`) or no step in full
//! (`full`). The manifest keeps the line, so the judge knows the trace was filtered.
//!
//! `kq_soft_max`, which grows with the square of the length, can be cut to some heads and
//! rows wherever it is kept: `kq_heads=0-3` and `kq_rows=1000-1015` (rows by position; every
//! column kept). A step holding no kept row writes no `kq_soft_max` (see [`crate::Cut`]).

use crate::Tap;
use crate::cut::{Cut, Cutting};
use std::collections::BTreeSet;
use std::fmt;
use std::ops::RangeInclusive;

/// The environment variable an engine's trace writer reads its plan from.
pub const RECORD_ENV: &str = "PARITY_RECORD";

/// A recording plan: `taps` kept at every step, every tap at the `full` steps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The taps kept at every step; `None`: all of them.
    pub taps: Option<BTreeSet<Tap>>,
    /// Steps kept whole, as inclusive ranges in increasing order.
    pub full: Vec<RangeInclusive<usize>>,
    /// At a step kept whole, the layers whose taps are kept (beyond `taps`); `None`: every
    /// layer. A long step whole is gigabytes; the layer a scan flags is a 22nd of it.
    pub layers: Option<Vec<RangeInclusive<usize>>>,
    /// The heads of `kq_soft_max` kept; `None`: all of them.
    pub kq_heads: Option<Vec<RangeInclusive<usize>>>,
    /// The rows of `kq_soft_max` kept, by position; `None`: all of them.
    pub kq_rows: Option<Vec<RangeInclusive<usize>>>,
}

/// The most ranges a list part may hold: a plan is one line an engine parses, not a table.
const MAX_RANGES: usize = 4096;

impl Record {
    /// Parse `taps=a,b;full=3,7-8`. The error is one line naming the part at fault.
    pub fn parse(line: &str) -> Result<Record, String> {
        let mut r = Record::default();
        let (mut seen_taps, mut seen_full) = (false, false);
        let seen = |key: &str, r: &Record| match key {
            "kq_heads" => r.kq_heads.is_some(),
            "layers" => r.layers.is_some(),
            _ => r.kq_rows.is_some(),
        };
        for part in line.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((key, value)) = part.split_once('=') else {
                return Err(format!(
                    "'{}' is not key=value (taps=l_out,logits;full=3)",
                    crate::manifest::short(part)
                ));
            };
            match key.trim() {
                "taps" if !seen_taps => {
                    seen_taps = true;
                    let mut set = BTreeSet::new();
                    for name in value.split(',').map(str::trim) {
                        if name == "all" {
                            return Ok(Record {
                                taps: None,
                                ..Record::parse(&without(line, "taps"))?
                            });
                        }
                        let tap = Tap::parse(name).ok_or_else(|| {
                            format!(
                                "taps: unknown tap '{}' (docs/trace-format.md lists them)",
                                crate::manifest::short(name)
                            )
                        })?;
                        set.insert(tap);
                    }
                    r.taps = Some(set);
                }
                "full" if !seen_full => {
                    seen_full = true;
                    r.full = parse_steps(value)?;
                }
                k @ ("layers" | "kq_heads" | "kq_rows") if !seen(k, &r) => {
                    let what = match k {
                        "layers" => "a layer number",
                        "kq_heads" => "a head number",
                        _ => "a position",
                    };
                    let list = parse_list(k, what, value)?;
                    if list.is_empty() {
                        return Err(format!("{k}: no {} given", what.trim_start_matches("a ")));
                    }
                    match k {
                        "layers" => r.layers = Some(list),
                        "kq_heads" => r.kq_heads = Some(list),
                        _ => r.kq_rows = Some(list),
                    }
                }
                "taps" | "full" | "layers" | "kq_heads" | "kq_rows" => {
                    return Err(format!("'{}' is given twice", key.trim()));
                }
                other => {
                    return Err(format!(
                        "unknown part '{}' (taps=…;full=…;layers=…;kq_heads=…;kq_rows=…)",
                        crate::manifest::short(other)
                    ));
                }
            }
        }
        Ok(r)
    }

    /// The plan in `PARITY_RECORD`, if it is set (an unreadable one is an error, not ignored).
    pub fn from_env() -> Result<Option<Record>, String> {
        match std::env::var(RECORD_ENV) {
            Ok(v) => Record::parse(&v)
                .map(Some)
                .map_err(|e| format!("{RECORD_ENV}: {e}")),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("{RECORD_ENV} is not UTF-8")),
        }
    }

    /// Also record `steps` whole (merged with the steps already whole).
    pub fn add_full(&mut self, steps: RangeInclusive<usize>) {
        self.full.push(steps);
        self.full = merge(std::mem::take(&mut self.full));
    }

    /// Whether step `step` is recorded whole.
    pub fn full_step(&self, step: usize) -> bool {
        self.full.iter().any(|r| r.contains(&step))
    }

    /// Whether `tap` is kept at `step` (at some layer: a step whole keeps every tap at the
    /// layers `layers` names).
    pub fn wants(&self, step: usize, tap: Tap) -> bool {
        self.full_step(step) || self.taps.as_ref().is_none_or(|t| t.contains(&tap))
    }

    /// Whether `tap` of `layer` (None: a graph-wide tap) is kept at `step`.
    pub fn keeps(&self, step: usize, layer: Option<usize>, tap: Tap) -> bool {
        self.whole_at(step, layer) || self.taps.as_ref().is_none_or(|t| t.contains(&tap))
    }

    /// Whether every tap of `layer` (None: the graph-wide ones) is kept at `step`: a step
    /// kept whole, at a layer `layers` names (or any, without it).
    pub fn whole_at(&self, step: usize, layer: Option<usize>) -> bool {
        let in_layers = match (layer, &self.layers) {
            (Some(l), Some(ls)) => ls.iter().any(|r| r.contains(&l)),
            _ => true,
        };
        self.full_step(step) && in_layers
    }

    /// A plan that keeps every tap everywhere (nothing is filtered).
    pub fn keeps_all(&self) -> bool {
        self.taps.is_none() && !self.cuts_probs()
    }

    /// Whether the plan cuts `kq_soft_max` to some heads or rows.
    pub fn cuts_probs(&self) -> bool {
        self.kq_heads.is_some() || self.kq_rows.is_some()
    }

    /// What the plan keeps of one step's `kq_soft_max`, head-major `[n_head, t, n_kv]`, of a
    /// step from position `pos0`.
    pub fn cut_probs(&self, dims: [usize; 3], pos0: usize, data: &[f32]) -> Cutting {
        match self.probs_cut(dims[0], pos0, dims[1]) {
            None => Cutting::Whole,
            Some(c) if c.is_empty() => Cutting::Nothing,
            Some(c) => {
                let (shape, v) = c.select(dims, pos0, data);
                Cutting::Kept(c, shape, v)
            }
        }
    }

    /// The cut the plan makes of a step's `kq_soft_max` (`n_head` heads, `t` rows from
    /// `pos0`): the heads and positions it keeps there; None where it cuts nothing.
    pub fn probs_cut(&self, n_head: usize, pos0: usize, t: usize) -> Option<Cut> {
        if !self.cuts_probs() {
            return None;
        }
        let within = |ranges: &[RangeInclusive<usize>], lo: usize, n: usize| -> Vec<usize> {
            let hi = lo.saturating_add(n);
            ranges
                .iter()
                .flat_map(|r| (*r.start()).max(lo)..(r.end().saturating_add(1)).min(hi))
                .collect()
        };
        Some(Cut {
            heads: self.kq_heads.as_ref().map(|h| within(h, 0, n_head)),
            rows: self.kq_rows.as_ref().map(|r| within(r, pos0, t)),
        })
    }
}

/// `line` without its `key=` part.
fn without(line: &str, key: &str) -> String {
    line.split(';')
        .filter(|p| p.split_once('=').is_none_or(|(k, _)| k.trim() != key))
        .collect::<Vec<_>>()
        .join(";")
}

/// `3,7-8` as merged inclusive ranges in increasing order.
fn parse_steps(value: &str) -> Result<Vec<RangeInclusive<usize>>, String> {
    parse_list("full", "a step number", value)
}

/// A list part (`3,7-8`) as merged inclusive ranges in increasing order; `what` one item is.
fn parse_list(part: &str, what: &str, value: &str) -> Result<Vec<RangeInclusive<usize>>, String> {
    let num = |s: &str| {
        s.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n <= crate::manifest::MAX_POSITION)
            .ok_or_else(|| {
                format!(
                    "{part}: '{}' is not {what} or a range a-b",
                    crate::manifest::short(s.trim())
                )
            })
    };
    let mut ranges = Vec::new();
    for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if ranges.len() == MAX_RANGES {
            return Err(format!("{part}: more than {MAX_RANGES} items"));
        }
        let (a, b) = match item.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(item)?, num(item)?),
        };
        if a > b {
            return Err(format!("{part}: the range {a}-{b} runs backwards"));
        }
        ranges.push(a..=b);
    }
    Ok(merge(ranges))
}

/// `3-5,8` for merged ranges.
fn show_list(ranges: &[RangeInclusive<usize>]) -> String {
    ranges
        .iter()
        .map(|r| {
            if r.start() == r.end() {
                r.start().to_string()
            } else {
                format!("{}-{}", r.start(), r.end())
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Inclusive ranges sorted, overlapping and touching ones joined.
fn merge(mut ranges: Vec<RangeInclusive<usize>>) -> Vec<RangeInclusive<usize>> {
    ranges.sort_by_key(|r| *r.start());
    let mut merged: Vec<RangeInclusive<usize>> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            Some(m) if *r.start() <= m.end().saturating_add(1) => {
                *m = *m.start()..=(*m.end()).max(*r.end());
            }
            _ => merged.push(r),
        }
    }
    merged
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.taps {
            None => write!(f, "taps=all")?,
            Some(t) => {
                let names: Vec<&str> = t.iter().map(|t| t.name()).collect();
                write!(f, "taps={}", names.join(","))?;
            }
        }
        if !self.full.is_empty() {
            write!(f, ";full={}", show_list(&self.full))?;
        }
        if let Some(l) = &self.layers {
            write!(f, ";layers={}", show_list(l))?;
        }
        if let Some(h) = &self.kq_heads {
            write!(f, ";kq_heads={}", show_list(h))?;
        }
        if let Some(r) = &self.kq_rows {
            write!(f, ";kq_rows={}", show_list(r))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_reads_back_as_written_and_keeps_what_it_says() {
        let r = Record::parse(" taps = logits, l_out ,result_norm ; full=8,3, 4-5 ").unwrap();
        assert_eq!(r.to_string(), "taps=l_out,result_norm,logits;full=3-5,8");
        assert_eq!(Record::parse(&r.to_string()).unwrap(), r);
        assert!(r.wants(0, Tap::parse("l_out").unwrap()));
        assert!(!r.wants(0, Tap::parse("kq_soft_max").unwrap()));
        assert!(r.wants(4, Tap::parse("kq_soft_max").unwrap()));
        assert!(!r.wants(6, Tap::parse("q_rope").unwrap()));
        assert!(r.wants(8, Tap::parse("q_rope").unwrap()));
        // Left out: every tap; `all` says so too.
        let all = Record::parse("full=2").unwrap();
        assert!(all.keeps_all() && all.wants(0, Tap::parse("kq_soft_max").unwrap()));
        assert_eq!(Record::parse("taps=all;full=2").unwrap(), all);
        assert_eq!(Record::parse("").unwrap(), Record::default());
        let mut z = Record::parse("taps=l_out;full=2,6").unwrap();
        z.add_full(3..=3);
        assert_eq!(z.to_string(), "taps=l_out;full=2-3,6");
    }

    #[test]
    fn a_whole_step_keeps_every_tap_of_its_layers_alone() {
        let r = Record::parse("layers=3,1-1; full=2 ;taps=l_out").unwrap();
        assert_eq!(r.to_string(), "taps=l_out;full=2;layers=1,3");
        assert_eq!(Record::parse(&r.to_string()).unwrap(), r);
        let q = Tap::parse("q").unwrap();
        let l_out = Tap::parse("l_out").unwrap();
        let logits = Tap::parse("logits").unwrap();
        assert!(r.keeps(2, Some(1), q) && r.keeps(2, Some(3), q));
        assert!(!r.keeps(2, Some(2), q) && !r.keeps(1, Some(1), q));
        assert!(r.keeps(2, Some(2), l_out) && r.keeps(0, Some(7), l_out));
        assert!(r.keeps(2, None, logits) && !r.keeps(1, None, logits));
        // Without a layer: kept at some layer.
        assert!(r.wants(2, q) && !r.wants(1, q));
        let all = Record::parse("full=2").unwrap();
        assert!(all.keeps(2, Some(9), q));
    }

    #[test]
    fn a_plan_cuts_kq_soft_max_to_its_heads_and_rows_by_position() {
        let r = Record::parse("kq_rows=4-5,2 ;taps=all; kq_heads=3,0-1,1").unwrap();
        assert_eq!(r.to_string(), "taps=all;kq_heads=0-1,3;kq_rows=2,4-5");
        assert_eq!(Record::parse(&r.to_string()).unwrap(), r);
        assert!(!r.keeps_all() && r.cuts_probs());
        // [4 heads, 3 rows, 6 keys] of a step from position 3: value = 100h + 10r + c.
        let full: Vec<f32> = (0..4 * 3 * 6)
            .map(|i| (100 * (i / 18) + 10 * (i / 6 % 3) + i % 6) as f32)
            .collect();
        let Cutting::Kept(cut, shape, v) = r.cut_probs([4, 3, 6], 3, &full) else {
            panic!("positions 4 and 5 are in the step");
        };
        assert_eq!(cut.heads.as_deref(), Some(&[0, 1, 3][..]));
        assert_eq!(cut.rows.as_deref(), Some(&[4, 5][..]));
        assert_eq!(shape, [3, 2, 6]);
        let firsts: Vec<f32> = v.iter().step_by(6).copied().collect();
        assert_eq!(firsts, [10., 20., 110., 120., 310., 320.]);
        // A decode step at position 9 keeps no row; a plan without the parts cuts nothing.
        assert_eq!(r.cut_probs([4, 1, 10], 9, &[0.; 40]), Cutting::Nothing);
        let heads = Record::parse("kq_heads=7").unwrap();
        assert_eq!(heads.cut_probs([4, 1, 10], 9, &[0.; 40]), Cutting::Nothing);
        let plain = Record::parse("full=2").unwrap();
        assert_eq!(plain.cut_probs([4, 3, 6], 3, &full), Cutting::Whole);
    }

    #[test]
    fn a_bad_plan_is_one_line_naming_its_part() {
        for (line, says) in [
            ("taps=l_out,nope", "unknown tap 'nope'"),
            ("full=3-x", "'x' is not a step number"),
            ("full=5-2", "runs backwards"),
            ("steps=3", "unknown part 'steps'"),
            ("l_out", "is not key=value"),
            ("full=1;full=2", "given twice"),
            ("full=99999999999999999999999", "is not a step number"),
            ("kq_rows=x", "kq_rows: 'x' is not a position"),
            ("kq_heads=5-2", "kq_heads: the range 5-2 runs backwards"),
            ("kq_rows=", "kq_rows: no position given"),
            ("kq_heads= , ", "kq_heads: no head number given"),
            ("kq_rows=1;kq_rows=2", "'kq_rows' is given twice"),
            ("kq_cols=1", "unknown part 'kq_cols'"),
            ("layers=x", "layers: 'x' is not a layer number"),
            ("layers=5-2", "layers: the range 5-2 runs backwards"),
            ("layers=", "layers: no layer number given"),
            ("layers=1;layers=2", "'layers' is given twice"),
        ] {
            let e = Record::parse(line).unwrap_err();
            assert!(e.contains(says), "{line}: {e}");
            assert!(!e.contains('\n'), "{line}: {e}");
        }
    }
}
