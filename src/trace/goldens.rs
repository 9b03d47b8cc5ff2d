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
