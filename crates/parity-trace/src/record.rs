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

use crate::Tap;
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
}

impl Record {
    /// Parse `taps=a,b;full=3,7-8`. The error is one line naming the part at fault.
    pub fn parse(line: &str) -> Result<Record, String> {
        let mut r = Record::default();
        let (mut seen_taps, mut seen_full) = (false, false);
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
                "taps" | "full" => return Err(format!("'{}' is given twice", key.trim())),
                other => {
                    return Err(format!(
                        "unknown part '{}' (taps=…;full=…)",
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

    /// Whether `tap` is kept at `step`.
    pub fn wants(&self, step: usize, tap: Tap) -> bool {
        self.full_step(step) || self.taps.as_ref().is_none_or(|t| t.contains(&tap))
    }

    /// A plan that keeps every tap everywhere (nothing is filtered).
    pub fn keeps_all(&self) -> bool {
        self.taps.is_none()
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
    let num = |s: &str| {
        s.trim().parse::<usize>().map_err(|_| {
            format!(
                "full: '{}' is not a step number or a range a-b",
                crate::manifest::short(s.trim())
            )
        })
    };
    let mut ranges = Vec::new();
    for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (a, b) = match item.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(item)?, num(item)?),
        };
        if a > b {
            return Err(format!("full: the range {a}-{b} runs backwards"));
        }
        ranges.push(a..=b);
    }
    Ok(merge(ranges))
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
            let steps: Vec<String> = self
                .full
                .iter()
                .map(|r| {
                    if r.start() == r.end() {
                        r.start().to_string()
                    } else {
                        format!("{}-{}", r.start(), r.end())
                    }
                })
                .collect();
            write!(f, ";full={}", steps.join(","))?;
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
    fn a_bad_plan_is_one_line_naming_its_part() {
        for (line, says) in [
            ("taps=l_out,nope", "unknown tap 'nope'"),
            ("full=3-x", "'x' is not a step number"),
            ("full=5-2", "runs backwards"),
            ("steps=3", "unknown part 'steps'"),
            ("l_out", "is not key=value"),
            ("full=1;full=2", "given twice"),
            ("full=99999999999999999999999", "is not a step number"),
        ] {
            let e = Record::parse(line).unwrap_err();
            assert!(e.contains(says), "{line}: {e}");
            assert!(!e.contains('\n'), "{line}: {e}");
        }
    }
}
