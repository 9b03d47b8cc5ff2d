//! Where goldens are kept and found: one search order for every command that looks for a
//! model's golden by itself (`check`, `selftest`), and the folder `parity golden` writes to when
//! it is not told where. the README ("Where goldens are found") documents the same order.

use super::{Trace, TraceError, is_archive_path};
use std::path::{Path, PathBuf};

/// `$PARITY_GOLDEN_DIR`, else `$XDG_DATA_HOME/parity/golden`, else
/// `~/.local/share/parity/golden`: where `parity golden` keeps a golden when no `--out` is
/// given.
pub fn user_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("PARITY_GOLDEN_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
        return Some(PathBuf::from(d).join("parity/golden"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/parity/golden"))
}

/// The folders searched, in order, when no golden is named: `./golden` (where `parity golden
/// --out golden/NAME` puts one), the user's golden folder ([`user_dir`]), then `shipped` (the
/// goldens that come with parity).
pub fn search_dirs(shipped: &Path) -> Vec<PathBuf> {
    let mut v = vec![PathBuf::from("golden")];
    v.extend(user_dir());
    v.push(shipped.to_path_buf());
    v
}

/// The default folder for a new golden of the model whose file stem is `stem` and whose
/// sha256 is `sha`: one subfolder of [`user_dir`] per model file and content.
pub fn default_out(stem: &str, sha: &str) -> Option<PathBuf> {
    let short: String = sha.chars().take(12).collect();
    user_dir().map(|d| d.join(format!("{stem}-{short}")))
}

/// Traces at `dir` whose model sha256 is `sha`: `dir` itself when it is a trace, else the
/// trace folders and `.npz` archives directly inside it, sorted by path. A folder that does not
/// exist holds none; an entry that is not a readable trace is not this model's golden.
pub fn find(dir: &Path, sha: &str) -> Result<Vec<(PathBuf, Trace)>, TraceError> {
    // One trace: a folder with its manifest, or an `.npz` archive (as `diff` reads them).
    if dir.join("manifest.json").exists() || (dir.is_file() && is_archive_path(dir)) {
        return Ok(vec![(dir.to_path_buf(), Trace::open(dir)?)]);
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut paths: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").exists() || (p.is_file() && is_archive_path(p)))
        .collect();
    paths.sort();
    Ok(paths
        .into_iter()
        .filter_map(|p| {
            let t = Trace::open(&p).ok()?;
            (t.manifest.model.sha256 == sha).then_some((p, t))
        })
        .collect())
}

/// The goldens of the model in the first of `dirs` that holds any (see [`search_dirs`]).
pub fn find_first(dirs: &[PathBuf], sha: &str) -> Result<Vec<(PathBuf, Trace)>, TraceError> {
    for d in dirs {
        let found = find(d, sha)?;
        if !found.is_empty() {
            return Ok(found);
        }
    }
    Ok(Vec::new())
}

/// How a llama.cpp golden was fed, recovered from its manifest so that llama.cpp can be run
/// again on the same ids in the same calls (`parity check`'s zoom): the prompt (in chunks of
/// `chunk`), then `steps` one-token decode steps, then each further turn (chunked alike)
/// followed by `steps` decode steps again, the decode ids `forced` in that order.
#[derive(Clone, Debug, PartialEq)]
pub struct Feed {
    pub prompt: Vec<u32>,
    pub steps: usize,
    pub forced: Vec<u32>,
    pub chunk: usize,
    pub turns: Vec<Vec<u32>>,
}

/// The golden's feed: its steps' ids, split as its settings say it was fed (`chunk`, the
/// turns' lengths). None where no split gives exactly its steps (a trace `parity golden` did
/// not make, or settings that disagree with the steps).
pub fn feed(g: &Trace) -> Option<Feed> {
    let settings = &g.manifest.producer.settings;
    let chunk = settings.get("chunk").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    let turn_lens: Vec<usize> = match settings.get("turns") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(v) => v
            .as_array()?
            .iter()
            .map(|t| t.as_u64().map(|n| n as usize))
            .collect::<Option<_>>()?,
    };
    let steps: Vec<&[u32]> = g
        .manifest
        .steps
        .iter()
        .map(|s| s.tokens.as_slice())
        .collect();
    feed_of(&steps, chunk, &turn_lens)
}

/// [`feed`] over the steps' ids alone.
fn feed_of(steps: &[&[u32]], chunk: usize, turn_lens: &[usize]) -> Option<Feed> {
    let total: usize = steps.iter().map(|s| s.len()).sum();
    // The settings are the manifest's (an input): each turn is at least one step of at most
    // the whole run, or no split is tried (a crafted length would size the loop below).
    if turn_lens.len() >= steps.len() || turn_lens.iter().any(|&t| t == 0 || t > total) {
        return None;
    }
    let turned = turn_lens
        .iter()
        .try_fold(0usize, |a, &t| a.checked_add(t))?;
    let rounds = 1 + turn_lens.len();
    let split = |n: usize| -> Vec<usize> {
        let c = if chunk == 0 { n.max(1) } else { chunk };
        (0..n.div_ceil(c)).map(|i| c.min(n - i * c)).collect()
    };
    // Each count of decode steps per round leaves one prompt length: the first whose calls
    // have the steps' lengths is the feed (two that both match feed the same calls).
    for n in 0..=steps.len() {
        let Some(p) = total.checked_sub(turned + rounds * n).filter(|&p| p > 0) else {
            break;
        };
        let mut lens = split(p);
        lens.extend(std::iter::repeat_n(1, n));
        for &t in turn_lens {
            lens.extend(split(t));
            lens.extend(std::iter::repeat_n(1, n));
        }
        if lens.len() != steps.len() || lens.iter().zip(steps).any(|(&l, s)| l != s.len()) {
            continue;
        }
        // Walk the steps as the calls: the prompt's chunks, n decode ids, each turn, n more.
        let mut at = steps.iter();
        let mut take = |len: usize| -> Vec<u32> {
            let mut ids = Vec::new();
            for _ in split(len) {
                ids.extend_from_slice(at.next().expect("lengths checked"));
            }
            ids
        };
        let prompt = take(p);
        let mut forced = Vec::new();
        let mut turns = Vec::new();
        for r in 0..rounds {
            if r > 0 {
                turns.push(take(turn_lens[r - 1]));
            }
            for _ in 0..n {
                forced.extend(take(1));
            }
        }
        return Some(Feed {
            prompt,
            steps: n,
            forced,
            chunk,
            turns,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(steps: &[&[u32]], chunk: usize, turns: &[usize]) -> Option<Feed> {
        feed_of(steps, chunk, turns)
    }

    #[test]
    fn a_prompt_and_decode_steps() {
        let f = feed(&[&[1, 2, 3], &[4], &[5]], 0, &[]).unwrap();
        assert_eq!(
            (f.prompt, f.steps, f.forced, f.turns.len()),
            (vec![1, 2, 3], 2, vec![4, 5], 0)
        );
    }

    #[test]
    fn chunks_and_turns_are_split_as_fed() {
        // Prompt 1..=5 in chunks of 2, 1 decode step, a turn of 3 ids (chunks 2+1), 1 decode.
        let s: [&[u32]; 7] = [&[1, 2], &[3, 4], &[5], &[6], &[7, 8], &[9], &[10]];
        let f = feed(&s, 2, &[3]).unwrap();
        assert_eq!(f.prompt, vec![1, 2, 3, 4, 5]);
        assert_eq!(f.steps, 1);
        assert_eq!(f.forced, vec![6, 10]);
        assert_eq!(f.turns, vec![vec![7, 8, 9]]);
        // One token at a time: prompt and decode steps are the same calls; the split found
        // feeds exactly those calls again.
        let s: [&[u32]; 4] = [&[1], &[2], &[3], &[4]];
        let f = feed(&s, 1, &[]).unwrap();
        let mut ids = f.prompt.clone();
        ids.extend(&f.forced);
        assert_eq!(ids, vec![1, 2, 3, 4]);
        // Unchunked turns: the turn is one call.
        let s: [&[u32]; 6] = [&[1, 2], &[3], &[4], &[5, 6, 7], &[8], &[9]];
        let f = feed(&s, 0, &[3]).unwrap();
        assert_eq!(
            (f.steps, f.forced, f.turns),
            (2, vec![3, 4, 8, 9], vec![vec![5, 6, 7]])
        );
    }

    #[test]
    fn steps_no_feed_explains_give_none() {
        // A two-token step where only one-token decode steps can be.
        assert_eq!(feed(&[&[1, 2], &[3, 4], &[5]], 0, &[]), None);
        // A turn longer than every step.
        assert_eq!(feed(&[&[1, 2], &[3]], 0, &[4]), None);
        assert_eq!(feed(&[], 0, &[]), None);
        // Crafted settings: a turn longer than the run, of no ids, or more turns than steps
        // are refused before any split (no loop sized by them).
        let s: [&[u32]; 3] = [&[1, 2], &[3], &[4]];
        assert_eq!(feed(&s, 1, &[usize::MAX]), None);
        assert_eq!(feed(&s, 0, &[0]), None);
        assert_eq!(feed(&s, 0, &[1; 3]), None);
        assert_eq!(feed(&s, usize::MAX, &[]).map(|f| f.steps), Some(2));
    }
}
