//! Outputs that are inputs: every path a run writes is checked, before any work, against every
//! path it reads and every other path it writes, by file identity — (device, inode) where the
//! file exists, the canonical path (canonical folder + file name) where it does not. An input
//! trace folder stands for itself, its `manifest.json` and every tensor file its manifest
//! names, so `--html G/manifest.json` is the golden's manifest however it is spelled. An output
//! that holds an input (a trace folder `--force` would replace) is refused too.

use std::path::{Component, Path, PathBuf};

/// A manifest larger than this is not read to list its files (the trace reader refuses it on
/// its own terms); the folder and its `manifest.json` still count as inputs.
const MANIFEST_LIMIT: u64 = 64 << 20;

/// What a path is, for comparing it with others.
#[derive(Clone, Debug)]
struct Ident {
    /// (st_dev, st_ino) where the file exists.
    id: Option<(u64, u64)>,
    /// The canonical path: the file's own where it exists, else the canonical folder + name.
    canon: PathBuf,
}

impl Ident {
    fn same(&self, other: &Ident) -> bool {
        match (self.id, other.id) {
            (Some(a), Some(b)) => a == b,
            _ => self.canon == other.canon,
        }
    }
}

#[cfg(unix)]
fn dev_ino(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino())
}

#[cfg(not(unix))]
fn dev_ino(_: &std::fs::Metadata) -> (u64, u64) {
    (0, 0)
}

/// The canonical spelling of `p` whether or not it exists: its nearest existing ancestor
/// canonicalized, the rest appended with `.` dropped and `..` taken lexically (the kernel
/// would fail such a path anyway, as the folder it climbs out of does not exist).
pub fn canonical(p: &Path) -> PathBuf {
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    if let Ok(c) = abs.canonicalize() {
        return c;
    }
    let mut rest: Vec<std::ffi::OsString> = Vec::new();
    let mut base = abs.as_path();
    let mut canon = loop {
        match base.parent() {
            Some(parent) => {
                if let Some(name) = base.file_name() {
                    rest.push(name.to_os_string());
                } else {
                    // `..` or `.` as the last component: kept as written.
                    rest.push(
                        base.components()
                            .next_back()
                            .map_or_else(Default::default, |c| c.as_os_str().to_os_string()),
                    );
                }
                base = parent;
                if let Ok(c) = base.canonicalize() {
                    break c;
                }
            }
            None => break base.to_path_buf(),
        }
    };
    for n in rest.iter().rev() {
        match Path::new(n).components().next() {
            Some(Component::ParentDir) => {
                canon.pop();
            }
            Some(Component::CurDir) | None => {}
            _ => canon.push(n),
        }
    }
    canon
}

/// An input as it is read: links followed (they are the user's own spelling of what to read).
fn input_ident(p: &Path) -> Option<Ident> {
    let m = std::fs::metadata(p).ok()?;
    Some(Ident {
        id: Some(dev_ino(&m)),
        canon: p.canonicalize().unwrap_or_else(|_| canonical(p)),
    })
}

/// An output as it is written: the path itself (a link is refused before it is written, never
/// followed).
fn output_ident(p: &Path) -> Ident {
    match std::fs::symlink_metadata(p) {
        Ok(m) => Ident {
            id: Some(dev_ino(&m)),
            canon: canonical_no_follow(p),
        },
        Err(_) => Ident {
            id: None,
            canon: canonical(p),
        },
    }
}

/// Canonical folder + the last component as written: a link's own location.
fn canonical_no_follow(p: &Path) -> PathBuf {
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => canonical(parent).join(name),
        _ => canonical(&abs),
    }
}

/// An input's files, each with its name inside the trace (empty for the input itself).
type Files = Vec<(Ident, String)>;

/// The files an input stands for: itself and, for a trace folder, its manifest and the tensor
/// files the manifest names (each with a word for the message).
fn input_files(p: &Path) -> Files {
    let Some(own) = input_ident(p) else {
        return Vec::new();
    };
    let mut v = vec![(own, String::new())];
    if !p.is_dir() {
        return v;
    }
    let manifest = p.join("manifest.json");
    if let Some(i) = input_ident(&manifest) {
        v.push((i, "manifest.json".into()));
    }
    let text = std::fs::metadata(&manifest)
        .ok()
        .filter(|m| m.is_file() && m.len() <= MANIFEST_LIMIT)
        .and_then(|_| std::fs::read(&manifest).ok());
    let files = text
        .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("tensors")?.as_array().cloned())
        .unwrap_or_default();
    for t in files {
        if let Some(f) = t.get("file").and_then(|f| f.as_str())
            && let Some(i) = input_ident(&p.join(f))
        {
            v.push((i, f.to_string()));
        }
    }
    v
}

/// Refuse, in one line naming the flags, an output that is an input (or one of an input
/// trace's files), an output that holds an input, two outputs that are one file, and an
/// output that is a symbolic link (written through, it would go elsewhere). `inputs` and
/// `outputs` pair a path with the flag that gave it (`--golden`, `--html`, `the model`).
pub fn check_paths(inputs: &[(&Path, &str)], outputs: &[(&Path, &str)]) -> Result<(), String> {
    // Nothing written: no input trace's manifest need be parsed and its files resolved.
    if outputs.is_empty() {
        return Ok(());
    }
    let ins: Vec<(&Path, &str, Files)> = inputs
        .iter()
        .map(|&(p, flag)| (p, flag, input_files(p)))
        .collect();
    let mut seen: Vec<(&str, &Path, Ident)> = Vec::new();
    for &(out, oflag) in outputs {
        let shown = out.display();
        if out.as_os_str().is_empty() {
            return Err(format!("{oflag}: an empty path"));
        }
        if std::fs::symlink_metadata(out).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(symlink_refusal(out, oflag));
        }
        let o = output_ident(out);
        for (inp, iflag, files) in &ins {
            for (i, what) in files {
                if o.same(i) {
                    let which = if what.is_empty() {
                        format!("the input {iflag} {}", inp.display())
                    } else {
                        format!("{what} of the input trace {iflag} {}", inp.display())
                    };
                    return Err(format!(
                        "{oflag} {shown}: is {which}: an input is never overwritten, give the output another path"
                    ));
                }
            }
            // The input itself or any file of an input trace (a tap the manifest names in a
            // sub-folder an output folder would replace).
            if let Some((_, what)) = files
                .iter()
                .find(|(i, _)| i.canon != o.canon && i.canon.starts_with(&o.canon))
            {
                let which = if what.is_empty() {
                    String::new()
                } else {
                    format!("{what} of ")
                };
                return Err(format!(
                    "{oflag} {shown}: holds {which}the input {iflag} {}: an input is never overwritten, give the output another path",
                    inp.display()
                ));
            }
        }
        if let Some((other, _, _)) = seen.iter().find(|(_, _, s)| s.same(&o)) {
            return Err(format!(
                "{oflag} {shown}: the same file as {other}: give each output its own path"
            ));
        }
        seen.push((oflag, out, o));
    }
    Ok(())
}

/// The one line for an output path that is a symbolic link.
pub fn symlink_refusal(p: &Path, flag: &str) -> String {
    let target = std::fs::read_link(p)
        .map(|t| format!(" (to {})", t.display()))
        .unwrap_or_default();
    let stdout = if flag == "--json" {
        "; `-` is how to write to stdout"
    } else {
        ""
    };
    format!(
        "{flag} {}: is a symbolic link{target}: parity never writes through a link, give the file's own path{stdout}",
        p.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_takes_dot_dot_through_existing_folders() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("a")).unwrap();
        let c = canonical(d.path());
        assert_eq!(
            canonical(&d.path().join("a/../a/r.json")),
            c.join("a/r.json")
        );
        assert_eq!(canonical(&d.path().join("a/./x/../y")), c.join("a/y"));
        assert_eq!(canonical(&d.path().join("a")), c.join("a"));
    }

    #[test]
    fn outputs_are_compared_with_inputs_and_each_other() {
        let d = tempfile::tempdir().unwrap();
        let g = d.path().join("g");
        std::fs::create_dir_all(g.join("s000")).unwrap();
        std::fs::write(
            g.join("manifest.json"),
            r#"{"tensors":[{"file":"s000/x.npy"}]}"#,
        )
        .unwrap();
        std::fs::write(g.join("s000/x.npy"), b"x").unwrap();
        let ins = [(g.as_path(), "--golden")];
        let tap = g.join("s000/../s000/x.npy");
        let e = check_paths(&ins, &[(&tap, "--html")]).unwrap_err();
        assert!(e.contains("s000/x.npy of the input trace --golden"), "{e}");
        let e = check_paths(&ins, &[(d.path(), "--out")]).unwrap_err();
        assert!(e.contains("holds the input --golden"), "{e}");
        // A new file inside the trace folder is no input.
        check_paths(&ins, &[(&g.join("report.html"), "--html")]).unwrap();
        let a = d.path().join("r.json");
        let b = d.path().join("g/../r.json");
        let e = check_paths(&[], &[(&a, "--json"), (&b, "--html")]).unwrap_err();
        assert!(e.contains("the same file as --json"), "{e}");
    }
}
