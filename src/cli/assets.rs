//! Where the binary finds its own files (the default fixture and its golden, the Python
//! scripts): in the source checkout it was built from when that is still there, else in a
//! per-version cache folder it unpacks them into from the binary itself (build.rs embeds them).
//! So `cargo install --path .` gives a binary that works anywhere.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

include!(concat!(env!("OUT_DIR"), "/assets.rs"));

/// The source checkout, if it still has the files the binary was built with
/// (`PARITY_NO_CHECKOUT=1` pretends it is gone, to test an installed binary).
fn checkout() -> Option<PathBuf> {
    if std::env::var_os("PARITY_NO_CHECKOUT").is_some() {
        return None;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    root.join("scripts/llama_golden.py")
        .exists()
        .then_some(root)
}

/// `$XDG_CACHE_HOME/parity/VERSION`, else `~/.cache/parity/VERSION`, else the temp folder.
fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("parity").join(env!("CARGO_PKG_VERSION"))
}

/// Write every embedded file under `dir` that is missing or differs (a temp name, then a
/// rename, so a concurrent run never reads half a file).
fn unpack(dir: &Path) -> std::io::Result<()> {
    for (rel, bytes) in ASSETS {
        let p = dir.join(rel);
        if std::fs::read(&p).is_ok_and(|b| b == *bytes) {
            continue;
        }
        let parent = p.parent().expect("relative paths have a parent");
        std::fs::create_dir_all(parent)?;
        // A staging file made O_EXCL|O_NOFOLLOW, renamed over: never written through a link.
        crate::trace::staging::write_whole(&p, bytes).map_err(std::io::Error::other)?;
    }
    Ok(())
}

/// The folder holding `fixtures/`, `golden/` and `scripts/` as in the repository.
pub fn root() -> PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        if let Some(r) = checkout() {
            return r;
        }
        let dir = cache_dir();
        match unpack(&dir) {
            Ok(()) => dir,
            Err(e) => {
                // Nothing can be found then; say why once, and let the caller's "not found"
                // error name the path.
                eprintln!(
                    "warning: cannot unpack parity's files into {}: {e}",
                    dir.display()
                );
                dir
            }
        }
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpacked_files_equal_the_repository_ones() {
        let dir = tempfile::tempdir().unwrap();
        unpack(dir.path()).unwrap();
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        assert!(ASSETS.len() > 100, "fixture, golden files, scripts");
        for (rel, _) in ASSETS {
            assert_eq!(
                std::fs::read(dir.path().join(rel)).unwrap(),
                std::fs::read(root.join(rel)).unwrap(),
                "{rel}"
            );
        }
        // A second unpack rewrites nothing and still succeeds.
        unpack(dir.path()).unwrap();
    }
}
