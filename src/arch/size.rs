//! What a trace costs before it is made: every tap the forward records, at its canonical
//! shape, for each step of a run. The attention probabilities grow with the square of the
//! length (a 1,024-token prompt on a TinyLlama shape is about 3 GB of `kq_soft_max`), so
//! `golden`, `dump` and `check` refuse a run over a budget in one line, before any work.

use super::{records, tap_dims};
use crate::model::Config;
use crate::trace::{Record, Tap, TapKey};

/// The default budget for one run's trace: far above a check of a 7B model on a short prompt
/// (about 0.2 GB), below what a long prompt's probabilities fill a disk with.
pub const DEFAULT_BUDGET: u64 = 4_000_000_000;

/// A `.npy` file's header, as parity writes it (the format pads it to 128 bytes).
const NPY_HEADER: u64 = 128;

/// The steps of a run, each (first position, token count): the prompt (in chunks of
/// `chunk` tokens, 0 for whole), `decode` one-token steps, then each further turn (in chunks
/// too) followed by `decode` steps again — the order `parity golden` feeds llama.cpp.
pub fn golden_feed(
    prompt: usize,
    chunk: usize,
    decode: usize,
    turns: &[usize],
) -> Vec<(usize, usize)> {
    let mut steps = Vec::new();
    let mut pos = 0;
    let mut feed = |n: usize, steps: &mut Vec<(usize, usize)>| {
        let c = if chunk == 0 { n.max(1) } else { chunk };
        let mut left = n;
        while left > 0 {
            let t = left.min(c);
            steps.push((pos, t));
            pos += t;
            left -= t;
        }
        for _ in 0..decode {
            steps.push((pos, 1));
            pos += 1;
        }
    };
    feed(prompt, &mut steps);
    for &t in turns {
        feed(t, &mut steps);
    }
    steps
}

/// The steps of a run fed as these token counts, one step each, in order.
pub fn fed_steps(lens: impl IntoIterator<Item = usize>) -> Vec<(usize, usize)> {
    let mut pos = 0;
    lens.into_iter()
        .map(|t| {
            pos += t;
            (pos - t, t)
        })
        .collect()
}

/// Bytes of every tap `keep` keeps, summed over the layers and `steps` (f32 values and a
/// `.npy` header each; the manifest aside), and the share of the probabilities.
/// `plan` cuts `kq_soft_max` to the heads and rows it keeps (`kq_heads`, `kq_rows`).
pub fn trace_bytes(
    c: &Config,
    steps: &[(usize, usize)],
    keep: &dyn Fn(&TapKey) -> bool,
    plan: Option<&Record>,
) -> (u64, u64) {
    let (mut all, mut probs) = (0u64, 0u64);
    for (s, &(pos0, t)) in steps.iter().enumerate() {
        for tap in Tap::ALL {
            if !records(c, tap) {
                continue;
            }
            let [mut a, mut b, d] = tap_dims(c, tap, t, pos0);
            if tap == Tap::KqSoftMax
                && let Some(cut) = plan.and_then(|p| p.probs_cut(a, pos0, t))
            {
                a = cut.heads.map_or(a, |h| h.len());
                b = cut.rows.map_or(b, |r| r.len());
            }
            let bytes = 4 * (a as u64) * (b as u64) * (d as u64);
            let layers: Vec<Option<usize>> = if tap.per_layer() {
                (0..c.n_layer).map(Some).collect()
            } else {
                vec![None]
            };
            for l in layers {
                if bytes > 0 && keep(&TapKey::new(s, l, tap)) {
                    all = all.saturating_add(bytes + NPY_HEADER);
                    if tap == Tap::KqSoftMax {
                        probs = probs.saturating_add(bytes);
                    }
                }
            }
        }
    }
    (all, probs)
}

/// `4G`, `500M`, `64k` or a plain count of bytes (decimal units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, u)) if u.is_ascii_alphabetic() => {
            let m = match u.to_ascii_uppercase() {
                'K' => 1e3,
                'M' => 1e6,
                'G' => 1e9,
                'T' => 1e12,
                _ => return Err(format!("'{s}': give bytes, or a size like 500M, 4G, 1T")),
            };
            (&t[..i], m)
        }
        _ => (t, 1.0),
    };
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v * mult < 1.8e19 => Ok((v * mult) as u64),
        _ => Err(format!("'{s}': give bytes, or a size like 500M, 4G, 1T")),
    }
}

/// Bytes for people: `3.2 GB`, `410 MB`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match b {
        b if b >= 1e9 => format!("{:.1} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.0} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.0} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

/// The refusal, in one line: what the run would write, the budget, the flag that raises it and
/// what else would shrink it (`fewer`).
pub fn over_budget(what: &str, bytes: u64, probs: u64, budget: u64, fewer: &str) -> Option<String> {
    if bytes <= budget {
        return None;
    }
    // A budget flag value that covers it, rounded up to a whole GB (or MB).
    let raise = if bytes >= 1_000_000_000 {
        format!("{}G", bytes.div_ceil(1_000_000_000))
    } else {
        format!("{}M", bytes.div_ceil(1_000_000))
    };
    // Where the probabilities are most of it, cutting them is the cheapest way down.
    let cut = if probs * 2 > bytes {
        "; or keep kq_soft_max for some rows or heads alone (--record '…;kq_rows=A-B;kq_heads=C-D')"
    } else {
        ""
    };
    Some(format!(
        "{what} would be about {} ({} of it the attention probabilities, kq_soft_max), over the budget of {}: raise it with --max-trace-size {raise}, or {fewer}{cut}",
        human(bytes),
        human(probs),
        human(budget)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_follow_the_golden_feed() {
        assert_eq!(golden_feed(3, 0, 2, &[]), vec![(0, 3), (3, 1), (4, 1)]);
        assert_eq!(fed_steps([3, 1, 4]), vec![(0, 3), (3, 1), (4, 4)]);
        assert_eq!(
            golden_feed(5, 2, 1, &[3]),
            vec![(0, 2), (2, 2), (4, 1), (5, 1), (6, 2), (8, 1), (9, 1)]
        );
    }

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("4G"), Ok(4_000_000_000));
        assert_eq!(parse_size("1.5g"), Ok(1_500_000_000));
        assert_eq!(parse_size("500M"), Ok(500_000_000));
        assert_eq!(parse_size("123"), Ok(123));
        for bad in ["", "G", "-1G", "4X", "nanG", "0", "1e30T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert_eq!(human(3_210_000_000), "3.2 GB");
        assert_eq!(human(410_000_000), "410 MB");
        let msg = over_budget(
            "the golden",
            6_800_000_001,
            3_100_000_000,
            4_000_000_000,
            "x",
        )
        .unwrap();
        assert!(msg.contains("--max-trace-size 7G"), "{msg}");
        assert!(over_budget("t", 10, 0, 10, "x").is_none());
    }
}
