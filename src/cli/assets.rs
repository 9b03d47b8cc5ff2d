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

/// `$XDG_CACHE_HOME/parity/VERSION`, else `~/.cache/parity/VERSION`, else
/// `TMP/parity-UID/VERSION`.
fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|b| b.join("parity"));
    // Without either, a folder of this user's own in the temp folder (checked by `private`).
    #[cfg(unix)]
    // SAFETY: geteuid has no preconditions.
    let fallback = || std::env::temp_dir().join(format!("parity-{}", unsafe { libc::geteuid() }));
    #[cfg(not(unix))]
    let fallback = || std::env::temp_dir().join("parity");
    base.unwrap_or_else(fallback)
        .join(env!("CARGO_PKG_VERSION"))
}

/// Make `dir` (and its parent, `parity/`) if missing and refuse to use them unless they are
/// this user's own and writable by no one else: parity runs the scripts it unpacks there, and
/// the fallback under the temp folder (no `$HOME`) is a place any user can make first.
fn private(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let parent = dir.parent().unwrap_or(dir);
        if let Some(base) = parent.parent() {
            std::fs::create_dir_all(base)?;
        }
        for d in [parent, dir] {
            match std::fs::DirBuilder::new().mode(0o700).create(d) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
                _ => {}
            }
            // lstat: a link planted at the folder's name is not followed.
            let m = std::fs::symlink_metadata(d)?;
            if !m.is_dir() || m.uid() != uid || m.mode() & 0o022 != 0 {
                return Err(std::io::Error::other(format!(
                    "{} is not a folder of this user's that only it can write (set XDG_CACHE_HOME)",
                    d.display()
                )));
            }
        }
    }
    #[cfg(not(unix))]
    std::fs::create_dir_all(dir)?;
    Ok(())
}

/// A new folder only this process made (mode 0700, a name never reused).
fn fresh_dir() -> std::io::Result<PathBuf> {
    let base = std::env::temp_dir();
    for n in 0..1000 {
        let d = base.join(format!("parity-files-{}-{n}", std::process::id()));
        let mut b = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        match b.create(&d) {
            Ok(()) => return Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("no free name in the temp folder"))
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
        let Err(e) = private(&dir).and_then(|()| unpack(&dir)) else {
            return dir;
        };
        // Never the refused folder (its scripts would run): a fresh one of this run's own.
        let fresh = fresh_dir().and_then(|d| unpack(&d).map(|()| d));
        let shown = crate::report::shown::shown(&dir.to_string_lossy()).into_owned();
        match fresh {
            Ok(d) => {
                eprintln!(
                    "warning: cannot use {shown} for parity's files ({e}); unpacked them into {}",
                    d.display()
                );
                d
            }
            Err(e2) => {
                // Nothing can be found then; the caller's "not found" error names the path.
                eprintln!("warning: cannot unpack parity's files ({e}; {e2})");
                PathBuf::from("/nonexistent/parity-files")
            }
        }
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn a_cache_folder_others_can_write_or_a_link_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let ok = t.path().join("a/parity/0.1");
        private(&ok).unwrap();
        private(&ok).unwrap();
        // Made first by someone else: writable by all (as /tmp/parity would be).
        let open = t.path().join("b/parity");
        std::fs::create_dir_all(open.join("0.1")).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private(&open.join("0.1")).unwrap_err();
        assert!(e.to_string().contains("only it can write"), "{e}");
        // A link planted at the version folder's name.
        let link = t.path().join("c/parity");
        std::fs::create_dir_all(&link).unwrap();
        std::os::unix::fs::symlink(t.path().join("a/parity/0.1"), link.join("0.1")).unwrap();
        assert!(private(&link.join("0.1")).is_err());
        let d = fresh_dir().unwrap();
        let m = std::fs::metadata(&d).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
        let d2 = fresh_dir().unwrap();
        assert_ne!(d2, d);
        std::fs::remove_dir(d).unwrap();
        std::fs::remove_dir(d2).unwrap();
    }

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

    /// scripts/numpy_engine.py and scripts/parity_trace.py import the package beside them
    /// (bindings/python/parity_trace): every module of it travels with the binary.
    #[test]
    fn the_python_package_is_embedded_whole() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = root.join("bindings/python/parity_trace");
        let mut missing = Vec::new();
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let rel = format!("bindings/python/parity_trace/{name}");
            if name.ends_with(".py") && !ASSETS.iter().any(|(r, _)| *r == rel) {
                missing.push(rel);
            }
        }
        assert!(
            missing.is_empty(),
            "not embedded (build.rs watches each file, not the folder: `touch build.rs`): {missing:?}"
        );
        assert!(
            ASSETS
                .iter()
                .any(|(r, _)| *r == "bindings/python/parity_trace/__init__.py")
        );
    }
}
