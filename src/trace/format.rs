//! The trace folder: `manifest.json` + one `.npy` per (step, tap, layer).

use super::{
    Cut, Cutting, Manifest, ModelRef, Producer, Record, Sink, StepInfo, TapFilter, TapKey,
    TensorEntry, TraceError,
};
use ndarray::{ArrayD, IxDyn, ShapeBuilder};
use parity_trace::archive::{Archive, ArchiveWriter};
use parity_trace::manifest::{MAX_MANIFEST_BYTES, short};
use parity_trace::npy;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TraceError + '_ {
    move |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    }
}

enum Source {
    /// The folder as given (for messages) and its canonical path (what every file read from
    /// it must stay inside).
    Dir {
        dir: PathBuf,
        root: PathBuf,
    },
    Memory(BTreeMap<TapKey, ArrayD<f32>>),
    /// One `.npz` archive (a wasm engine's trace), mapped; members are slices of it.
    Archive {
        path: PathBuf,
        map: memmap2::Mmap,
        index: Archive,
    },
}

/// A trace: its manifest and its tensors (read lazily from disk, or held in memory).
pub struct Trace {
    pub manifest: Manifest,
    keys: BTreeMap<TapKey, usize>,
    source: Source,
    /// Manifest entries whose tap is not one of the known names: kept (an engine may record
    /// more than parity compares) and reported as not compared.
    pub extra: Vec<TensorEntry>,
    /// Tensors already decoded from disk: the judge reads each key once per replay, and a
    /// `diff` runs dozens of replays (decoding and CRC-checking them again was a sixth of it).
    read: std::sync::Mutex<ReadCache>,
}

/// At most this many bytes of decoded tensors are kept per trace opened from disk: a diff of
/// a 16-layer fixture reads 9 MB, while a 7B golden (205 MB) adds no more than this to
/// `check`'s peak memory; past it a tensor is read again at each use.
const READ_CACHE_BYTES: usize = 64 << 20;

struct ReadCache {
    tensors: std::collections::HashMap<usize, ArrayD<f32>>,
    bytes: usize,
    budget: usize,
}

impl Default for ReadCache {
    fn default() -> Self {
        ReadCache {
            tensors: Default::default(),
            bytes: 0,
            budget: READ_CACHE_BYTES,
        }
    }
}

impl Trace {
    /// A trace made in memory by one of our backends.
    pub fn from_memory(
        model: ModelRef,
        producer: Producer,
        steps: Vec<StepInfo>,
        tensors: BTreeMap<TapKey, ArrayD<f32>>,
    ) -> Trace {
        let shapes = tensors
            .iter()
            .map(|(k, a)| (*k, a.shape().to_vec()))
            .collect();
        Self::from_listed(model, producer, steps, shapes, tensors)
    }

    /// A trace made in memory whose tensors were not all kept: every tap in `shapes` is
    /// listed (its manifest says what was recorded), [`Trace::get`] finds only `tensors`.
    pub fn from_listed(
        model: ModelRef,
        producer: Producer,
        steps: Vec<StepInfo>,
        shapes: BTreeMap<TapKey, Vec<usize>>,
        tensors: BTreeMap<TapKey, ArrayD<f32>>,
    ) -> Trace {
        debug_assert!(tensors.keys().all(|k| shapes.contains_key(k)));
        let entries: Vec<TensorEntry> =
            shapes.iter().map(|(k, s)| TensorEntry::f32(k, s)).collect();
        let keys = shapes.keys().enumerate().map(|(i, k)| (*k, i)).collect();
        Trace {
            manifest: Manifest::new(model, producer, steps, entries),
            keys,
            source: Source::Memory(tensors),
            extra: Vec::new(),
            read: Default::default(),
        }
    }

    /// Open a trace folder or `.npz` archive: parse and validate the manifest; tensors are
    /// read on demand.
    pub fn open(dir: impl AsRef<Path>) -> Result<Trace, TraceError> {
        let dir = dir.as_ref();
        if std::fs::metadata(dir).is_ok_and(|m| m.is_file()) {
            return Self::open_archive(dir);
        }
        let mpath = dir.join("manifest.json");
        // The folder itself may be a symlink the user named on purpose: resolved here, once;
        // every file read from it after this must lie inside what it resolves to.
        let root = std::fs::canonicalize(dir).map_err(io_err(dir))?;
        let bytes = super::open::open_inside(&root, Path::new("manifest.json"))
            .and_then(|f| super::open::read_file_bounded(f, MAX_MANIFEST_BYTES, "a trace manifest"))
            .map_err(io_err(&mpath))?;
        let (manifest, index) = Manifest::parse(&bytes, &mpath.display().to_string())?;
        Ok(Trace {
            manifest,
            keys: index.keys,
            source: Source::Dir {
                dir: dir.to_path_buf(),
                root,
            },
            extra: index.extra,
            read: Default::default(),
        })
    }

    /// Open a trace held in one `.npz` archive (what a wasm32 engine hands back): mapped, its
    /// members indexed, the manifest checked as a folder's is.
    fn open_archive(path: &Path) -> Result<Trace, TraceError> {
        let f = super::open::open_regular(path).map_err(io_err(path))?;
        // SAFETY: read-only map of a file parity does not write; a member is CRC-checked as
        // it is read, so a file changed underneath is refused, not trusted.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io_err(path))?;
        let bad = |what: String| TraceError::BadManifest {
            path: path.display().to_string(),
            what,
        };
        let index = Archive::parse(&map).map_err(bad)?;
        let mpath = path.join("manifest.json");
        let bytes = index.get(&map, "manifest.json").map_err(bad)?;
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "manifest.json is {} bytes, more than a manifest can be",
                bytes.len()
            )));
        }
        let (manifest, ix) = Manifest::parse(bytes, &mpath.display().to_string())?;
        Ok(Trace {
            manifest,
            keys: ix.keys,
            source: Source::Archive {
                path: path.to_path_buf(),
                map,
                index,
            },
            extra: ix.extra,
            read: Default::default(),
        })
    }

    /// Drop the tensors of a trace made in memory, keeping its manifest (what a report reads
    /// once every comparison of the trace is done); a trace read from disk keeps its source.
    /// Its keys stay listed: [`Trace::get`] then finds no tensor under them.
    pub fn drop_tensors(&mut self) {
        if let Source::Memory(m) = &mut self.source {
            m.clear();
        }
    }

    /// The names of the taps this trace records that parity does not know (not compared),
    /// each once, in manifest order.
    pub fn not_compared(&self) -> Vec<String> {
        // A set: a manifest may name 10^5 unknown taps (a list search was quadratic).
        let mut seen = std::collections::HashSet::new();
        self.extra
            .iter()
            .filter(|e| seen.insert(e.tap.as_str()))
            .map(|e| e.tap.clone())
            .collect()
    }

    pub fn keys(&self) -> impl Iterator<Item = &TapKey> {
        self.keys.keys()
    }

    pub fn contains(&self, key: &TapKey) -> bool {
        self.keys.contains_key(key)
    }

    /// What `key`'s tensor was cut to (`kq_soft_max` kept for some heads or rows); None:
    /// whole, or not in the trace.
    pub fn cut(&self, key: &TapKey) -> Option<Cut> {
        self.keys
            .get(key)
            .and_then(|&i| self.manifest.tensors[i].cut())
    }

    /// This trace with `cuts` entered in its manifest: what a sink kept of each cut tensor.
    pub fn with_cuts(mut self, cuts: BTreeMap<TapKey, Cut>) -> Trace {
        for (k, c) in cuts {
            if let Some(&i) = self.keys.get(&k) {
                let e = &mut self.manifest.tensors[i];
                (e.heads, e.rows) = (c.heads, c.rows);
            }
        }
        self
    }

    /// The shape a tensor is listed with (None if the trace does not have it).
    pub fn shape(&self, key: &TapKey) -> Option<&[usize]> {
        self.keys
            .get(key)
            .map(|&i| self.manifest.tensors[i].shape.as_slice())
    }

    /// The first tap (in this trace's order) both traces hold whose tensors differ in shape or
    /// in any bit: where two runs that should repeat each other part, if anywhere.
    pub fn first_difference(&self, other: &Trace) -> Result<Option<TapKey>, TraceError> {
        for k in self.keys().filter(|k| other.contains(k)) {
            let (Some(x), Some(y)) = (self.get(k)?, other.get(k)?) else {
                continue;
            };
            let same = x.shape() == y.shape()
                && x.iter()
                    .zip(y.iter())
                    .all(|(p, q)| p.to_bits() == q.to_bits());
            if !same {
                return Ok(Some(*k));
            }
        }
        Ok(None)
    }

    /// Read one tensor (None if the trace does not have it).
    pub fn get(&self, key: &TapKey) -> Result<Option<ArrayD<f32>>, TraceError> {
        self.read(key, true)
    }

    /// [`Trace::get`] for a tensor read once (a comparison made as the candidate records): not
    /// entered in the read cache, whose 64 MB would otherwise hold the first tensors read for
    /// the rest of the run.
    pub fn get_once(&self, key: &TapKey) -> Result<Option<ArrayD<f32>>, TraceError> {
        self.read(key, false)
    }

    fn read(&self, key: &TapKey, cache: bool) -> Result<Option<ArrayD<f32>>, TraceError> {
        let Some(&i) = self.keys.get(key) else {
            return Ok(None);
        };
        if let Source::Memory(m) = &self.source {
            return Ok(m.get(key).cloned());
        }
        if let Some(a) = self.cached().tensors.get(&i) {
            return Ok(Some(a.clone()));
        }
        let a = match &self.source {
            Source::Memory(_) => unreachable!("returned above"),
            Source::Dir { dir, root } => read_tap(dir, root, &self.manifest.tensors[i])?,
            Source::Archive { path, map, index } => {
                let e = &self.manifest.tensors[i];
                let bad = |what: String| TraceError::BadTensor {
                    path: format!("{}:{}", path.display(), short(&e.file)),
                    what,
                };
                let bytes = index.get(map, &e.file).map_err(&bad)?;
                let data = npy::decode_file(bytes, &e.shape).map_err(&bad)?;
                ArrayD::from_shape_vec(IxDyn(&e.shape), data).map_err(|x| bad(x.to_string()))?
            }
        };
        let mut c = self.cached();
        let size = a.len() * 4;
        if cache && c.bytes + size <= c.budget && !c.tensors.contains_key(&i) {
            c.bytes += size;
            c.tensors.insert(i, a.clone());
        }
        Ok(Some(a))
    }

    /// Rows `rows` of one tensor's first axis, in standard order, read without the rest of it
    /// where it is on disk (a prompt's logits compared a slice at a time: a 2,048-row prompt's
    /// are 262 MB) and not kept in the read cache. None if the trace does not have it.
    pub fn get_rows(
        &self,
        key: &TapKey,
        rows: std::ops::Range<usize>,
    ) -> Result<Option<Vec<f32>>, TraceError> {
        let Some(&i) = self.keys.get(key) else {
            return Ok(None);
        };
        let e = &self.manifest.tensors[i];
        let t = e.shape.first().copied().unwrap_or(1);
        let per_row: usize = e.shape.iter().skip(1).product();
        if rows.start > rows.end || rows.end > t {
            return Err(TraceError::BadTensor {
                path: short(&e.file),
                what: format!("rows {}..{} asked of a tensor of {t}", rows.start, rows.end),
            });
        }
        let slice = |a: &ArrayD<f32>| {
            let a = a.as_standard_layout();
            let v = a.as_slice().expect("standard layout");
            v[rows.start * per_row..rows.end * per_row].to_vec()
        };
        if let Source::Memory(m) = &self.source {
            return Ok(m.get(key).map(slice));
        }
        if let Some(a) = self.cached().tensors.get(&i) {
            return Ok(Some(slice(a)));
        }
        match &self.source {
            Source::Dir { dir, root } => read_tap_rows(dir, root, e, rows, per_row).map(Some),
            // An archive is mapped whole already (a wasm engine's, small).
            _ => Ok(self.get(key)?.as_ref().map(slice)),
        }
    }

    /// The read cache (a poisoned lock only means a reader panicked: the map is still whole).
    fn cached(&self) -> std::sync::MutexGuard<'_, ReadCache> {
        self.read.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Refuse a non-empty output folder unless `force` (checked before any work is done).
fn check_out_dir(dir: &Path, force: bool) -> Result<(), TraceError> {
    // A link is never written through (nor replaced by the rename that publishes).
    if std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(TraceError::Io {
            path: dir.display().to_string(),
            source: std::io::Error::other(
                "is a symbolic link: parity never writes through a link, give the folder's own path",
            ),
        });
    }
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => Err(TraceError::Io {
            path: dir.display().to_string(),
            source: std::io::Error::other("exists and is not a folder"),
        }),
        Ok(_) => {
            let non_empty = std::fs::read_dir(dir)
                .map_err(io_err(dir))?
                .next()
                .is_some();
            if non_empty && !force {
                return Err(TraceError::NotEmpty(dir.display().to_string()));
            }
            if non_empty {
                foreign_entries(dir)?;
            }
            Ok(())
        }
        Err(_) => Ok(()),
    }
}

/// Does `path` name a one-file trace (`*.npz`) rather than a folder?
pub fn is_archive_path(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("npz"))
}

fn archive_err(path: &Path, what: String) -> TraceError {
    TraceError::Io {
        path: path.display().to_string(),
        source: std::io::Error::other(what),
    }
}

/// Refuse an `.npz` output that exists unless `force`, and with `force` anything but a trace
/// archive (a folder, a link, a device, another zip): `--force` replaces a trace only.
fn check_out_archive(path: &Path, force: bool) -> Result<(), TraceError> {
    let refuse = |what: &str| TraceError::Io {
        path: path.display().to_string(),
        source: std::io::Error::other(what.to_string()),
    };
    let m = match std::fs::symlink_metadata(path) {
        Err(_) => return Ok(()),
        Ok(m) => m,
    };
    if m.file_type().is_symlink() {
        return Err(refuse(
            "is a symbolic link: parity never writes through a link, give the file's own path",
        ));
    }
    if m.is_dir() {
        return Err(refuse(
            "exists and is a folder (an .npz trace is one file; name a folder without .npz)",
        ));
    }
    if !m.is_file() {
        return Err(refuse(
            "exists and is not a regular file (a FIFO, socket or device is never replaced)",
        ));
    }
    if !force {
        return Err(refuse("exists (pass --force to overwrite)"));
    }
    let is_trace = super::open::open_regular(path)
        .ok()
        // SAFETY: a read-only map, only parsed; a file changed underneath gives a wrong
        // answer about whether it is a trace, never undefined behaviour in safe code below.
        .and_then(|f| unsafe { memmap2::Mmap::map(&f) }.ok())
        .is_some_and(|map| Archive::parse(&map).is_ok_and(|a| a.contains("manifest.json")));
    if !is_trace {
        return Err(refuse(
            "is not a trace archive parity wrote: --force replaces a trace only, remove it or choose another --out",
        ));
    }
    Ok(())
}

/// `--force` replaces a trace, never what is not one: a folder with `sNNN` entries but no
/// manifest (or an `sNNN` that is a file) is refused before any work, so that publishing
/// cannot stop half way on a name it may not replace.
fn foreign_entries(dir: &Path) -> Result<(), TraceError> {
    let was_trace = dir.join("manifest.json").is_file();
    for e in std::fs::read_dir(dir).map_err(io_err(dir))?.flatten() {
        let name = e.file_name();
        if name == "manifest.json" || !is_trace_entry(&name) {
            if name == "manifest.json" && !was_trace {
                return Err(TraceError::Io {
                    path: e.path().display().to_string(),
                    source: std::io::Error::other(
                        "is not a file: --force replaces a trace only, remove it or choose another --out",
                    ),
                });
            }
            continue;
        }
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if !was_trace || !is_dir {
            return Err(TraceError::Io {
                path: e.path().display().to_string(),
                source: std::io::Error::other(format!(
                    "{} not a trace parity wrote ({}): --force replaces a trace only, remove it or choose another --out",
                    if is_dir { "is" } else { "is a file," },
                    if was_trace {
                        "a step entry that is not a folder"
                    } else {
                        "the folder has no manifest.json"
                    }
                )),
            });
        }
    }
    Ok(())
}

/// Is `name` one of the entries a trace consists of (`manifest.json`, `sNNN/`)?
fn is_trace_entry(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy();
    name == "manifest.json"
        || (name.len() > 1
            && name.starts_with('s')
            && name[1..].chars().all(|c| c.is_ascii_digit()))
}

/// A sibling of `dir` (same parent, so a rename is atomic) where the trace is written until it
/// is complete: `.NAME.partial-PID`.
fn staging_dir(dir: &Path) -> Result<PathBuf, TraceError> {
    let abs = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir().map_err(io_err(dir))?.join(dir)
    };
    // `trace/.` or `..`: name the folder by its canonical path when it already exists.
    let abs = match abs.file_name() {
        Some(_) => abs,
        None => abs.canonicalize().map_err(io_err(dir))?,
    };
    let (Some(parent), Some(name)) = (abs.parent(), abs.file_name()) else {
        return Err(TraceError::Io {
            path: dir.display().to_string(),
            source: std::io::Error::other("cannot write a trace at the file system root"),
        });
    };
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".partial-{}", std::process::id()));
    Ok(parent.join(tmp))
}

/// The output folder a staging folder `.NAME.partial-PID` stands for (beside it): where
/// [`super::staging::remove_stale`] looks.
fn tmp_target(tmp: &Path, dir: &Path) -> PathBuf {
    let name = tmp.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name
        .as_deref()
        .and_then(|n| n.strip_prefix('.'))
        .and_then(|n| n.rsplit_once(".partial-"))
        .map(|(n, _)| n.to_string());
    match (tmp.parent(), name) {
        (Some(parent), Some(name)) => parent.join(name),
        _ => dir.to_path_buf(),
    }
}

/// Move the finished trace in `tmp` to `dir`: a plain rename when `dir` is absent or empty;
/// otherwise (`--force`) the old trace's entries are moved aside, never other files, the new
/// ones moved in, `manifest.json` last, and the old ones removed. A failure half way puts the
/// old trace back: `dir` holds the whole new trace or is as it was.
fn publish(tmp: &Path, dir: &Path) -> Result<(), TraceError> {
    // Asked again: `dir` may have become a link while the backend ran.
    check_out_dir(dir, true)?;
    let empty = match std::fs::read_dir(dir) {
        Ok(mut it) => it.next().is_none(),
        Err(_) => {
            return std::fs::rename(tmp, dir).map_err(io_err(dir));
        }
    };
    if empty {
        std::fs::remove_dir(dir).map_err(io_err(dir))?;
        return std::fs::rename(tmp, dir).map_err(io_err(dir));
    }
    // Checked again now: the folder may have changed while the backend ran.
    foreign_entries(dir)?;
    let mut old = tmp.as_os_str().to_owned();
    old.push(".old");
    let old = PathBuf::from(old);
    std::fs::create_dir(&old).map_err(io_err(&old))?;
    let mut names: Vec<std::ffi::OsString> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| is_trace_entry(n))
        .collect();
    // The manifest first: from the first move on, `dir` is not a trace until the new one lands.
    names.sort_by_key(|n| n != "manifest.json");
    let mut moved_old = Vec::new();
    let mut moved_new = Vec::new();
    let result = (|| {
        for n in &names {
            std::fs::rename(dir.join(n), old.join(n)).map_err(io_err(&dir.join(n)))?;
            moved_old.push(n.clone());
        }
        let mut new: Vec<std::ffi::OsString> = std::fs::read_dir(tmp)
            .map_err(io_err(tmp))?
            .flatten()
            .map(|e| e.file_name())
            .collect();
        new.sort_by_key(|n| n == "manifest.json");
        for n in new {
            let to = dir.join(&n);
            std::fs::rename(tmp.join(&n), &to).map_err(io_err(&to))?;
            moved_new.push(n);
        }
        Ok(())
    })();
    if let Err(e) = result {
        for n in moved_new.iter().rev() {
            let _ = std::fs::rename(dir.join(n), tmp.join(n));
        }
        for n in moved_old.iter().rev() {
            let _ = std::fs::rename(old.join(n), dir.join(n));
        }
        let _ = std::fs::remove_dir_all(&old);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(&old);
    std::fs::remove_dir(tmp).map_err(io_err(tmp))
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), TraceError> {
    let p = dir.join("manifest.json");
    let text = serde_json::to_string_pretty(m).expect("manifest serializes");
    // Made new in the staging folder: nothing already at its name, a link least of all, is opened.
    super::staging::create_side_file(&p)
        .and_then(|mut f| std::io::Write::write_all(&mut f, (text + "\n").as_bytes()))
        .map_err(io_err(&p))
}

/// Write a little-endian f32 C-order .npy file into a folder that must exist.
fn write_npy_file(path: &Path, shape: &[usize], data: &[f32]) -> Result<(), TraceError> {
    use std::io::Write;
    // Truncated if the backend records a tap twice; a link at the name is never followed.
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NOFOLLOW);
    }
    let f = o.open(path).map_err(io_err(path))?;
    let mut w = std::io::BufWriter::new(f);
    w.write_all(&npy::f32_header(shape))
        .and_then(|()| data.iter().try_for_each(|v| w.write_all(&v.to_le_bytes())))
        .and_then(|()| w.flush())
        .map_err(io_err(path))
}

/// Read the tap of entry `e` from the trace folder `dir` (canonical: `root`) as an f32 tensor in
/// standard (C) layout: f32, f16 (widened exactly) or f64 (rounded to nearest, past f32's range
/// to ±inf), either byte order, C or Fortran order. Before any data is read, the file must lie
/// inside the folder, be a regular file, and its header must state the manifest's shape and a
/// float dtype whose size, with the header, is exactly the file's size: nothing is read or
/// allocated by what an unchecked field says, and the data is decoded straight into the
/// tensor (never held twice, but for a Fortran-order file's conversion).
/// A tap file's path as an error line names it: the folder as given, the manifest's file name
/// quoted short and on one line (a manifest may name any string, control characters too).
fn named(dir: &Path, e: &TensorEntry) -> PathBuf {
    dir.join(short(&e.file))
}

fn read_tap(dir: &Path, root: &Path, e: &TensorEntry) -> Result<ArrayD<f32>, TraceError> {
    use std::io::Read;
    let path = named(dir, e);
    let bad = |what: String| TraceError::BadTensor {
        path: path.display().to_string(),
        what,
    };
    let f = super::open::open_inside(root, Path::new(&e.file)).map_err(io_err(&path))?;
    let len = f.metadata().map_err(io_err(&path))?.len();
    // Never read past the size the file had when opened (a /proc file, a file still growing).
    let mut r = f.take(len);
    let h = npy::read_header(&mut r).map_err(bad)?;
    let want = npy::check_payload(&h, &e.shape, len.saturating_sub(h.data_offset)).map_err(bad)?;
    // At most MAX_TAP_ELEMENTS (checked at open) of at most 8 bytes: no overflow.
    let n = e.elements().expect("checked at open");
    let mut data: Vec<f32> = Vec::new();
    data.try_reserve_exact(n as usize).map_err(|_| {
        bad(format!(
            "shape {} is {n} values ({} bytes as float32), more than this machine can hold",
            short(&format!("{:?}", e.shape)),
            n * 4
        ))
    })?;
    // Decoded piece by piece: the file's bytes are never held whole beside the tensor.
    let mut buf = vec![0u8; 1 << 16];
    let mut left = want as usize;
    while left > 0 {
        let k = left.min(buf.len());
        r.read_exact(&mut buf[..k]).map_err(|err| {
            if err.kind() == std::io::ErrorKind::UnexpectedEof {
                bad(format!(
                    "truncated while read (the file shrank under {want} bytes of data)"
                ))
            } else {
                io_err(&path)(err)
            }
        })?;
        npy::decode_piece(h.dtype, &buf[..k], &mut data);
        left -= k;
    }
    let shape: Vec<usize> = e.shape.clone();
    if h.fortran_order {
        // Standard layout from here on: every consumer may reshape and slice rows.
        let a = ArrayD::from_shape_vec(IxDyn(&shape).f(), data).map_err(|x| bad(x.to_string()))?;
        Ok(a.as_standard_layout().into_owned())
    } else {
        ArrayD::from_shape_vec(IxDyn(&shape), data).map_err(|x| bad(x.to_string()))
    }
}

/// [`read_tap`]'s checks, then rows `rows` alone (`per_row` values each) read and decoded; a
/// Fortran-ordered file, whose rows are not contiguous, is read whole and sliced.
fn read_tap_rows(
    dir: &Path,
    root: &Path,
    e: &TensorEntry,
    rows: std::ops::Range<usize>,
    per_row: usize,
) -> Result<Vec<f32>, TraceError> {
    use std::io::{Read, Seek, SeekFrom};
    let path = named(dir, e);
    let bad = |what: String| TraceError::BadTensor {
        path: path.display().to_string(),
        what,
    };
    let mut f = super::open::open_inside(root, Path::new(&e.file)).map_err(io_err(&path))?;
    let len = f.metadata().map_err(io_err(&path))?.len();
    let h = npy::read_header(&mut (&mut f).take(len)).map_err(bad)?;
    npy::check_payload(&h, &e.shape, len.saturating_sub(h.data_offset)).map_err(bad)?;
    if h.fortran_order {
        let a = read_tap(dir, root, e)?;
        let v = a.as_slice().expect("standard layout");
        return Ok(v[rows.start * per_row..rows.end * per_row].to_vec());
    }
    // Within the payload whose size was just checked: no overflow, no read past it.
    let row_bytes = (per_row * h.dtype.size) as u64;
    f.seek(SeekFrom::Start(
        h.data_offset + rows.start as u64 * row_bytes,
    ))
    .map_err(io_err(&path))?;
    let n = (rows.end - rows.start) * per_row;
    let mut bytes = vec![0u8; n * h.dtype.size];
    f.read_exact(&mut bytes).map_err(|err| {
        if err.kind() == std::io::ErrorKind::UnexpectedEof {
            bad("truncated while read (the file shrank under its data)".into())
        } else {
            io_err(&path)(err)
        }
    })?;
    let mut data = Vec::with_capacity(n);
    npy::decode_piece(h.dtype, &bytes, &mut data);
    Ok(data)
}

/// A sink that streams wanted taps straight to a trace folder (low memory for big models).
/// The trace is written under a temporary name beside the output folder and moved into place
/// by [`TraceWriter::finish`]; dropped unfinished (an error, a panic), it leaves nothing behind.
pub struct TraceWriter {
    dir: PathBuf,
    /// Where the tensors go until `finish`.
    tmp: PathBuf,
    filter: TapFilter,
    entries: Vec<TensorEntry>,
    /// `Some` when `dir` names an `.npz` file: the trace is streamed into `tmp`, one file,
    /// instead of a file per tap (thousands of inode creations, most of a small trace's cost).
    archive: Option<ArchiveWriter<std::io::BufWriter<std::fs::File>>>,
    /// Taps declared stored in another layout (the manifest's `"layouts"`).
    layouts: std::collections::BTreeMap<String, String>,
    error: Option<TraceError>,
    done: bool,
    /// This process alone writes `dir` until the writer is dropped.
    _lock: super::staging::Lock,
}

impl TraceWriter {
    /// Whether a trace may be written at `dir` (asked again by [`TraceWriter::create`]):
    /// for a command to refuse a bad `--out` before it does any work.
    pub fn check_target(dir: &Path, force: bool) -> Result<(), TraceError> {
        if is_archive_path(dir) {
            check_out_archive(dir, force)
        } else {
            check_out_dir(dir, force)
        }
    }

    /// A writer of the trace folder `dir`, or of one `.npz` archive when `dir` ends in `.npz`.
    pub fn create(dir: &Path, filter: TapFilter, force: bool) -> Result<Self, TraceError> {
        let archive = is_archive_path(dir);
        let check = |force| Self::check_target(dir, force);
        check(force)?;
        let tmp = staging_dir(dir)?;
        if let Some(parent) = tmp.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        // One writer of `dir` at a time; the target checked again under the lock (another
        // writer may have published since).
        let lock = super::staging::lock(dir).map_err(io_err(dir))?;
        check(force)?;
        // Staging entries of writers killed outright (SIGKILL, a crash) go now.
        super::staging::remove_stale(&tmp_target(&tmp, dir));
        // Ours from an earlier writer with this PID, or planted: removed, a link never followed.
        if std::fs::symlink_metadata(&tmp).is_ok() {
            super::staging::remove_any(&tmp).map_err(io_err(&tmp))?;
        }
        let archive = if archive {
            let f = super::staging::create_side_file(&tmp).map_err(io_err(dir))?;
            super::staging::register(&tmp);
            Some(ArchiveWriter::to(std::io::BufWriter::with_capacity(
                1 << 20,
                f,
            )))
        } else {
            std::fs::create_dir(&tmp).map_err(io_err(dir))?;
            super::staging::register(&tmp);
            None
        };
        Ok(TraceWriter {
            dir: dir.to_path_buf(),
            tmp,
            filter,
            entries: Vec::new(),
            archive,
            layouts: Default::default(),
            error: None,
            done: false,
            _lock: lock,
        })
    }

    /// Declare that `tap` is stored in `layout` (the manifest's `"layouts"`, as an engine
    /// that knows it stores a tap differently would).
    pub fn declare_layout(&mut self, tap: &str, layout: &str) {
        self.layouts.insert(tap.to_string(), layout.to_string());
    }

    /// Write the manifest and move the trace into place. Reports the first write error met
    /// while recording.
    pub fn finish(
        mut self,
        model: ModelRef,
        producer: Producer,
        steps: Vec<StepInfo>,
    ) -> Result<Manifest, TraceError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let entries = std::mem::take(&mut self.entries);
        let mut m = Manifest::new(model, producer, steps, entries);
        m.layouts = std::mem::take(&mut self.layouts);
        m.record = self.filter.record().map(Record::to_string);
        match self.archive.take() {
            Some(mut a) => {
                let text = serde_json::to_string_pretty(&m).expect("manifest serializes") + "\n";
                a.add("manifest.json", text.as_bytes())
                    .and_then(|()| a.finish())
                    .map_err(|what| archive_err(&self.dir, what))?;
                super::staging::settle(&self.tmp, || {
                    // Asked again: `dir` may have become a link or a folder while the backend ran.
                    check_out_archive(&self.dir, true)?;
                    std::fs::rename(&self.tmp, &self.dir).map_err(io_err(&self.dir))
                })?;
            }
            None => {
                write_manifest(&self.tmp, &m)?;
                super::staging::settle(&self.tmp, || publish(&self.tmp, &self.dir))?;
            }
        }
        self.done = true;
        Ok(m)
    }
}

impl Drop for TraceWriter {
    fn drop(&mut self) {
        if !self.done {
            // The archive's file is closed first.
            self.archive = None;
            super::staging::settle(&self.tmp, || super::staging::remove_any(&self.tmp).ok());
        }
    }
}

impl Sink for TraceWriter {
    fn wants(&self, key: &TapKey) -> bool {
        self.error.is_none() && self.filter.matches(key)
    }
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        // The plan's cut, of the probabilities in their canonical (head-major) order.
        let canonical = !self.layouts.contains_key(key.tap.name());
        let (cut, kept) = match self.filter.cut(&key, shape, data) {
            Cutting::Kept(c, sh, v) if canonical => (Some(c), Some((sh, v))),
            Cutting::Nothing if canonical => return,
            _ => (None, None),
        };
        let (shape, data) = match &kept {
            Some((sh, v)) => (&sh[..], &v[..]),
            None => (shape, data),
        };
        let entry = || {
            let mut e = TensorEntry::f32(&key, shape);
            if let Some(c) = cut.clone() {
                (e.heads, e.rows) = (c.heads, c.rows);
            }
            e
        };
        if let Some(a) = &mut self.archive {
            let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            match a.add_parts(&key.file(), &[&npy::f32_header(shape), &bytes]) {
                Ok(()) => self.entries.push(entry()),
                Err(what) => self.error = Some(archive_err(&self.dir, what)),
            }
            return;
        }
        // The step folder is made inside the staging folder, never the staging folder itself:
        // once an interrupt has taken it away, writing fails instead of starting it again.
        let path = self.tmp.join(key.file());
        let made = match path.parent() {
            Some(step) if step != self.tmp => match std::fs::create_dir(step) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(io_err(step)(e)),
                _ => Ok(()),
            },
            _ => Ok(()),
        };
        match made.and_then(|()| write_npy_file(&path, shape, data)) {
            Ok(()) => self.entries.push(entry()),
            Err(e) => self.error = Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Tap;

    /// A tensor read again comes from the read cache with the same values, from a folder
    /// and from an `.npz` archive alike, and the cache holds no more than its budget.
    #[test]
    fn a_tensor_read_twice_is_the_same_and_the_cache_is_bounded() {
        let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/tiny-llama-q8_0");
        let dir = Trace::open(&golden).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let npz = tmp.path().join("t.npz");
        let keys: Vec<TapKey> = dir.keys().copied().collect();
        let arc = archive_of(&dir, &npz);
        for t in [&dir, &arc] {
            for k in &keys {
                let first = t.get(k).unwrap().unwrap();
                let again = t.get(k).unwrap().unwrap();
                assert_eq!(first, again, "{k}");
                assert_eq!(first, dir.get(k).unwrap().unwrap(), "{k}");
            }
            let c = t.cached();
            assert_eq!(c.tensors.len(), keys.len());
            assert!(c.bytes > 0 && c.bytes <= READ_CACHE_BYTES);
        }
        // Past its budget a tensor is decoded again at each read, the same.
        let small = Trace::open(&npz).unwrap();
        let first = small.get(&keys[0]).unwrap().unwrap().len() * 4;
        small.cached().budget = first;
        for k in &keys {
            assert_eq!(small.get(k).unwrap(), dir.get(k).unwrap(), "{k}");
        }
        let c = small.cached();
        assert_eq!((c.tensors.len(), c.bytes), (1, first));
    }

    /// Two traces part at the first tap (in the first one's order) whose tensors differ in a
    /// bit or in shape; taps only one holds do not count, and a trace is its own twin.
    #[test]
    fn first_difference_is_the_first_tap_that_differs_in_any_bit() {
        let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/tiny-llama-q8_0");
        let g = Trace::open(&golden).unwrap();
        let all: BTreeMap<TapKey, ArrayD<f32>> =
            g.keys().map(|k| (*k, g.get(k).unwrap().unwrap())).collect();
        let made = |t: BTreeMap<TapKey, ArrayD<f32>>| {
            Trace::from_memory(
                g.manifest.model.clone(),
                g.manifest.producer.clone(),
                g.manifest.steps.clone(),
                t,
            )
        };
        assert_eq!(g.first_difference(&made(all.clone())).unwrap(), None);
        let keys: Vec<TapKey> = all.keys().copied().collect();
        let (early, late) = (keys[3], keys[keys.len() - 2]);
        // One value one ulp off.
        let mut one_bit = all.clone();
        let x = one_bit.get_mut(&late).unwrap();
        let v = x.iter_mut().next().unwrap();
        *v = f32::from_bits(v.to_bits() ^ 1);
        assert_eq!(
            g.first_difference(&made(one_bit.clone())).unwrap(),
            Some(late)
        );
        // A reshaped tensor with the same values differs; a tap the other lacks does not.
        let t = one_bit.remove(&early).unwrap();
        let n = t.len();
        one_bit.insert(early, t.into_shape_with_order(vec![n]).unwrap());
        assert_eq!(
            g.first_difference(&made(one_bit.clone())).unwrap(),
            Some(early)
        );
        one_bit.remove(&early);
        assert_eq!(g.first_difference(&made(one_bit)).unwrap(), Some(late));
    }

    /// Rows read alone are the whole tensor's rows: from a folder (C order, a seek; Fortran
    /// order and f16 data too), an archive and memory; uncached, every row range of every
    /// tap; a range past the rows refused. `get_once` leaves the cache empty.
    #[test]
    fn rows_read_alone_are_the_whole_tensor_s() {
        let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/tiny-llama-q8_0");
        let g = Trace::open(&golden).unwrap();
        let key = TapKey::new(0, None, Tap::Logits);
        let tmp = tempfile::tempdir().unwrap();
        // The same trace with the logits stored Fortran-ordered, and as f16.
        let copy = |name: &str, file: &dyn Fn(&ArrayD<f32>) -> Vec<u8>| {
            let dir = tmp.path().join(name);
            fn copy_dir(from: &Path, to: &Path) {
                std::fs::create_dir_all(to).unwrap();
                for e in std::fs::read_dir(from).unwrap() {
                    let e = e.unwrap();
                    let dest = to.join(e.file_name());
                    if e.file_type().unwrap().is_dir() {
                        copy_dir(&e.path(), &dest);
                    } else {
                        std::fs::copy(e.path(), dest).unwrap();
                    }
                }
            }
            copy_dir(&golden, &dir);
            let t = Trace::open(&dir).unwrap();
            let e = &t.manifest.tensors[t.keys[&key]];
            std::fs::write(dir.join(&e.file), file(&g.get(&key).unwrap().unwrap())).unwrap();
            dir
        };
        let fortran = copy("f", &|a| {
            let data = a
                .t()
                .as_standard_layout()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            npy_file("<f4", true, a.shape(), data)
        });
        let half = copy("h", &|a| {
            let data = a
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect();
            npy_file("<f2", false, a.shape(), data)
        });
        let keys: Vec<TapKey> = g.keys().copied().collect();
        let a = archive_of(&g, &tmp.path().join("t.npz"));
        let mem = Trace::from_memory(
            g.manifest.model.clone(),
            g.manifest.producer.clone(),
            g.manifest.steps.clone(),
            keys.iter()
                .map(|k| (*k, g.get(k).unwrap().unwrap()))
                .collect(),
        );
        let (f, h) = (Trace::open(&fortran).unwrap(), Trace::open(&half).unwrap());
        for t in [&Trace::open(&golden).unwrap(), &f, &h, &a, &mem] {
            for k in &keys {
                let whole = t.get_once(k).unwrap().unwrap();
                let v = whole
                    .as_standard_layout()
                    .iter()
                    .copied()
                    .collect::<Vec<f32>>();
                let rows = whole.shape()[0];
                let per_row = v.len() / rows;
                for r0 in 0..rows {
                    for r1 in r0..=rows {
                        let got = t.get_rows(k, r0..r1).unwrap().unwrap();
                        assert_eq!(got, v[r0 * per_row..r1 * per_row], "{k} {r0}..{r1}");
                    }
                }
                let e = t.get_rows(k, 0..rows + 1).unwrap_err().to_string();
                assert!(e.contains("rows 0..") && !e.contains('\n'), "{e}");
            }
        }
        // The whole tensors as read (f16 widened exactly; Fortran order undone).
        assert_eq!(f.get(&key).unwrap(), g.get(&key).unwrap());
        let fresh = Trace::open(&golden).unwrap();
        for k in &keys {
            fresh.get_once(k).unwrap();
            fresh.get_rows(k, 0..1).unwrap();
        }
        assert_eq!(fresh.cached().tensors.len(), 0);
    }

    /// `t` written again as one `.npz` archive at `path`, opened.
    fn archive_of(t: &Trace, path: &Path) -> Trace {
        let mut w = TraceWriter::create(path, TapFilter::all(), false).unwrap();
        for k in t.keys() {
            let a = t.get(k).unwrap().unwrap();
            w.record(*k, a.shape(), a.as_slice().unwrap());
        }
        let m = &t.manifest;
        w.finish(m.model.clone(), m.producer.clone(), m.steps.clone())
            .unwrap();
        Trace::open(path).unwrap()
    }

    /// An `.npy` file of a 2-d `shape` holding `data` as `descr` says.
    fn npy_file(descr: &str, fortran: bool, shape: &[usize], data: Vec<u8>) -> Vec<u8> {
        let order = if fortran { "True" } else { "False" };
        let (t, n) = (shape[0], shape[1]);
        let mut h =
            format!("{{'descr': '{descr}', 'fortran_order': {order}, 'shape': ({t}, {n}), }}")
                .into_bytes();
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(b' ');
        }
        h.push(b'\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(h.len() as u16).to_le_bytes());
        b.extend_from_slice(&h);
        b.extend(data);
        b
    }
}
