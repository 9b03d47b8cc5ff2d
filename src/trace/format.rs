//! The trace folder: `manifest.json` + one `.npy` per (step, tap, layer).

use super::{Sink, TapFilter, TapKey, taps::Tap};
use ndarray::{ArrayD, IxDyn, ShapeBuilder};
use npyz::WriterBuilder;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "parity-trace";
pub const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a parity trace manifest: {what}")]
    BadManifest { path: String, what: String },
    #[error("{path}: {what}")]
    BadTensor { path: String, what: String },
    #[error("{0}: output folder is not empty (pass --force to overwrite)")]
    NotEmpty(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TraceError + '_ {
    move |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelRef {
    pub path: String,
    pub sha256: String,
    /// The file's size in bytes: `diff` looks for the model among files of this size only
    /// (older manifests have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Producer {
    pub name: String,
    pub backend: String,
    pub version: String,
    #[serde(default)]
    pub settings: serde_json::Value,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StepInfo {
    pub step: usize,
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forced: Option<bool>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorEntry {
    pub step: usize,
    pub tap: String,
    pub layer: Option<usize>,
    pub file: String,
    pub shape: Vec<usize>,
    pub dtype: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub model: ModelRef,
    pub producer: Producer,
    pub steps: Vec<StepInfo>,
    pub tensors: Vec<TensorEntry>,
    /// Taps stored in another layout than the canonical one, by tap name, e.g.
    /// `{"q_rope": "head-major"}` (see `judge::layout`); aligned on load by the judge.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub layouts: BTreeMap<String, String>,
}

impl Manifest {
    /// The ids fed at the decode steps (step 1 on), in order: what another run must force to
    /// see the same sequence.
    pub fn decode_tokens(&self) -> Vec<u32> {
        self.steps
            .iter()
            .skip(1)
            .flat_map(|s| s.tokens.iter().copied())
            .collect()
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
}

/// A trace: its manifest and its tensors (read lazily from disk, or held in memory).
pub struct Trace {
    pub manifest: Manifest,
    keys: BTreeMap<TapKey, usize>,
    source: Source,
    /// Manifest entries whose tap is not one of the known names: kept (an engine may record
    /// more than parity compares) and reported as not compared.
    pub extra: Vec<TensorEntry>,
}

impl Trace {
    /// A trace made in memory by one of our backends.
    pub fn from_memory(
        model: ModelRef,
        producer: Producer,
        steps: Vec<StepInfo>,
        tensors: BTreeMap<TapKey, ArrayD<f32>>,
    ) -> Trace {
        let entries: Vec<TensorEntry> = tensors.iter().map(|(k, a)| entry(k, a.shape())).collect();
        let keys = tensors.keys().enumerate().map(|(i, k)| (*k, i)).collect();
        Trace {
            manifest: Manifest {
                format: FORMAT.into(),
                version: VERSION,
                model,
                producer,
                steps,
                tensors: entries,
                layouts: BTreeMap::new(),
            },
            keys,
            source: Source::Memory(tensors),
            extra: Vec::new(),
        }
    }

    /// Open a trace folder: parse and validate the manifest; tensors are read on demand.
    pub fn open(dir: impl AsRef<Path>) -> Result<Trace, TraceError> {
        let dir = dir.as_ref();
        let mpath = dir.join("manifest.json");
        // The folder itself may be a symlink the user named on purpose: resolved here, once;
        // every file read from it after this must lie inside what it resolves to.
        let root = std::fs::canonicalize(dir).map_err(io_err(dir))?;
        let bytes = super::open::open_inside(&root, Path::new("manifest.json"))
            .and_then(|f| super::open::read_file_bounded(f, MAX_MANIFEST_BYTES, "a trace manifest"))
            .map_err(io_err(&mpath))?;
        let bad = |what: String| TraceError::BadManifest {
            path: mpath.display().to_string(),
            what,
        };
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| bad(head_tail(&e.to_string())))?;
        if manifest.format != FORMAT {
            return Err(bad(format!(
                "format is '{}', expected '{FORMAT}'",
                short(&manifest.format)
            )));
        }
        if manifest.version != VERSION {
            return Err(bad(format!(
                "version {} is not supported (this parity reads version {VERSION})",
                manifest.version
            )));
        }
        let mut next = 0usize;
        for (i, s) in manifest.steps.iter().enumerate() {
            // Steps index the tensors and feed position arithmetic (`pos0 + T`): their order
            // and range are checked here, once, before any of it.
            if s.step != i {
                return Err(bad(format!(
                    "steps[{i}] is step {} (steps are listed in order from 0, one entry each)",
                    s.step
                )));
            }
            if s.tokens.is_empty() {
                return Err(bad(format!("step {} has no tokens", s.step)));
            }
            if let Some(p) = s.positions.iter().find(|&&p| p > MAX_POSITION) {
                return Err(bad(format!(
                    "step {} has position {p}, past any context ({MAX_POSITION} at most)",
                    s.step
                )));
            }
            if s.positions.len() != s.tokens.len() {
                return Err(bad(format!(
                    "step {} has {} tokens but {} positions (one position per token)",
                    s.step,
                    s.tokens.len(),
                    s.positions.len()
                )));
            }
            // Positions run on from 0, one per token (what the judge's KV cache replays).
            if s.positions.iter().enumerate().any(|(k, &p)| p != next + k) {
                return Err(bad(format!(
                    "step {} has positions {}, expected {next}..{} (positions run on from 0 across the steps, one per token)",
                    s.step,
                    short(&format!("{:?}", s.positions)),
                    next + s.positions.len()
                )));
            }
            next += s.positions.len();
        }
        let mut keys = BTreeMap::new();
        let mut extra = Vec::new();
        for (i, t) in manifest.tensors.iter().enumerate() {
            let Some(tap) = Tap::parse(&t.tap) else {
                extra.push(t.clone());
                continue;
            };
            if tap.per_layer() != t.layer.is_some() {
                return Err(bad(format!(
                    "tap '{}' {} a layer",
                    short(&t.tap),
                    if tap.per_layer() {
                        "needs"
                    } else {
                        "cannot have"
                    }
                )));
            }
            // Names are checked here; where a name leads (symlinks) when the file is opened.
            if t.file.contains("..") || Path::new(&t.file).is_absolute() {
                return Err(bad(format!(
                    "tensor file '{}' leaves the trace folder",
                    short(&t.file)
                )));
            }
            if t.step >= manifest.steps.len() {
                return Err(bad(format!(
                    "tensor '{}' is for step {}, which the manifest's steps do not list",
                    short(&t.file),
                    t.step
                )));
            }
            if let Some(l) = t.layer.filter(|&l| l > MAX_POSITION) {
                return Err(bad(format!("tensor '{}' has layer {l}", short(&t.file))));
            }
            if tap_elements(t).is_none() {
                return Err(bad(format!(
                    "tensor '{}': shape {} of dtype '{}' is not a float tensor parity can hold",
                    short(&t.file),
                    short(&format!("{:?}", t.shape)),
                    short(&t.dtype)
                )));
            }
            // An empty axis has nothing to compare, and every row/column split downstream
            // (logit rows, head rows) would divide by it: refused here, once.
            if t.shape.contains(&0) {
                return Err(bad(format!(
                    "tensor '{}' has shape {}: an empty axis (a tap holds at least one value)",
                    short(&t.file),
                    short(&format!("{:?}", t.shape))
                )));
            }
            let key = TapKey::new(t.step, t.layer, tap);
            if keys.insert(key, i).is_some() {
                return Err(bad(format!("{key} is listed twice")));
            }
        }
        Ok(Trace {
            manifest,
            keys,
            source: Source::Dir {
                dir: dir.to_path_buf(),
                root,
            },
            extra,
        })
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

    /// Read one tensor (None if the trace does not have it).
    pub fn get(&self, key: &TapKey) -> Result<Option<ArrayD<f32>>, TraceError> {
        let Some(&i) = self.keys.get(key) else {
            return Ok(None);
        };
        match &self.source {
            Source::Memory(m) => Ok(m.get(key).cloned()),
            Source::Dir { dir, root } => read_tap(dir, root, &self.manifest.tensors[i]).map(Some),
        }
    }
}

fn entry(k: &TapKey, shape: &[usize]) -> TensorEntry {
    TensorEntry {
        step: k.step,
        tap: k.tap.name().to_string(),
        layer: k.layer,
        file: k.file(),
        shape: shape.to_vec(),
        dtype: "<f4".into(),
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
    // Truncated if the backend records a tap twice; a link at the name is never followed.
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NOFOLLOW);
    }
    let f = o.open(path).map_err(io_err(path))?;
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let mut w = npyz::WriteOptions::<f32>::new()
        .default_dtype()
        .shape(&shape)
        .writer(std::io::BufWriter::new(f))
        .begin_nd()
        .map_err(io_err(path))?;
    w.extend(data.iter().copied()).map_err(io_err(path))?;
    w.finish().map_err(io_err(path))
}

/// Largest manifest read: a 70B model's 80 layers × 20 taps × 100 steps of entries is ~30 MB.
const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Largest position or layer index a manifest may name (llama.cpp's contexts and layer counts
/// are far below; the bound keeps `pos0 + T` and friends far from overflow).
pub const MAX_POSITION: usize = 1 << 24;
/// Largest tensor a tap may hold (elements): the logits of a 256k vocabulary over a 16k-token
/// prefill are 2^32; a bigger shape is a corrupt manifest, not a tap.
const MAX_TAP_ELEMENTS: u64 = 1 << 33;

/// A piece of a file's own text as an error line quotes it: short, one line.
fn short(s: &str) -> String {
    super::npy::excerpt(s, super::npy::EXCERPT)
}

/// A parser's message, which may quote a whole string of the file, cut to its head and its
/// tail (where serde_json says the line and column).
fn head_tail(msg: &str) -> String {
    let n = msg.chars().count();
    if n <= 2 * super::npy::EXCERPT {
        return short(msg);
    }
    let tail: String = msg.chars().skip(n - 40).collect();
    format!("{} {}", short(msg), short(&tail))
}

/// The number of values entry `e`'s shape holds, None past what a tap may hold (the dtype is the
/// file header's to state: `read_tap` decodes by it).
fn tap_elements(e: &TensorEntry) -> Option<u64> {
    e.shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
        .filter(|&n| n <= MAX_TAP_ELEMENTS)
}

/// Read the tap of entry `e` from the trace folder `dir` (canonical: `root`) as an f32 tensor in
/// standard (C) layout: f32, f16 (widened exactly) or f64 (rounded to nearest, past f32's range
/// to ±inf), either byte order, C or Fortran order. Before any data is read, the file must lie
/// inside the folder, be a regular file, and its header must state the manifest's shape and a
/// float dtype whose size, with the header, is exactly the file's size: nothing is read or
/// allocated by what an unchecked field says, and the data is decoded straight into the
/// tensor (never held twice, but for a Fortran-order file's conversion).
fn read_tap(dir: &Path, root: &Path, e: &TensorEntry) -> Result<ArrayD<f32>, TraceError> {
    use std::io::Read;
    let path = dir.join(&e.file);
    let bad = |what: String| TraceError::BadTensor {
        path: path.display().to_string(),
        what,
    };
    let f = super::open::open_inside(root, Path::new(&e.file)).map_err(io_err(&path))?;
    let len = f.metadata().map_err(io_err(&path))?.len();
    // Never read past the size the file had when opened (a /proc file, a file still growing).
    let mut r = f.take(len);
    let h = super::npy::read_header(&mut r).map_err(bad)?;
    let dims = |d: &[u64]| {
        short(&format!(
            "[{}]",
            d.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    };
    let want_shape: Vec<u64> = e.shape.iter().map(|&d| d as u64).collect();
    if h.shape != want_shape {
        return Err(bad(format!(
            "shape {} differs from the manifest's {}",
            dims(&h.shape),
            dims(&want_shape)
        )));
    }
    let descr = h.dtype.descr();
    let shape_txt = dims(&want_shape);
    // At most MAX_TAP_ELEMENTS (checked at open) of at most 8 bytes: no overflow.
    let n = tap_elements(e).expect("checked at open");
    let size = h.dtype.size as u64;
    let want = n * size;
    let have = len.saturating_sub(h.data_offset);
    if have < want {
        return Err(bad(format!(
            "truncated ({have} of {want} bytes of {descr} data for shape {shape_txt})"
        )));
    }
    if have > want {
        return Err(bad(format!(
            "{have} bytes of data after the header, shape {shape_txt} of {descr} needs {want}"
        )));
    }
    let mut data: Vec<f32> = Vec::new();
    data.try_reserve_exact(n as usize).map_err(|_| {
        bad(format!(
            "shape {shape_txt} is {n} values ({} bytes as float32), more than this machine can hold",
            n * 4
        ))
    })?;
    let big = h.dtype.big_endian;
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
        let piece = &buf[..k];
        match size {
            2 => data.extend(piece.chunks_exact(2).map(|c| {
                let b = [c[0], c[1]];
                let bits = if big {
                    u16::from_be_bytes(b)
                } else {
                    u16::from_le_bytes(b)
                };
                half::f16::from_bits(bits).to_f32()
            })),
            4 => data.extend(piece.chunks_exact(4).map(|c| {
                let b = [c[0], c[1], c[2], c[3]];
                if big {
                    f32::from_be_bytes(b)
                } else {
                    f32::from_le_bytes(b)
                }
            })),
            _ => data.extend(piece.chunks_exact(8).map(|c| {
                let b: [u8; 8] = c.try_into().expect("chunks of 8");
                (if big {
                    f64::from_be_bytes(b)
                } else {
                    f64::from_le_bytes(b)
                }) as f32
            })),
        }
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

/// A sink that streams wanted taps straight to a trace folder (low memory for big models).
/// The trace is written under a temporary name beside the output folder and moved into place
/// by [`TraceWriter::finish`]; dropped unfinished (an error, a panic), it leaves nothing behind.
pub struct TraceWriter {
    dir: PathBuf,
    /// Where the tensors go until `finish`.
    tmp: PathBuf,
    filter: TapFilter,
    entries: Vec<TensorEntry>,
    error: Option<TraceError>,
    done: bool,
    /// This process alone writes `dir` until the writer is dropped.
    _lock: super::staging::Lock,
}

impl TraceWriter {
    pub fn create(dir: &Path, filter: TapFilter, force: bool) -> Result<Self, TraceError> {
        check_out_dir(dir, force)?;
        let tmp = staging_dir(dir)?;
        if let Some(parent) = tmp.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        // One writer of `dir` at a time; the folder checked again under the lock (another
        // writer may have published since).
        let lock = super::staging::lock(dir).map_err(io_err(dir))?;
        check_out_dir(dir, force)?;
        // Folders of writers killed outright (SIGKILL, a crash) go now.
        super::staging::remove_stale(&tmp_target(&tmp, dir));
        // Ours from an earlier writer with this PID, or planted: removed, a link never followed.
        if std::fs::symlink_metadata(&tmp).is_ok() {
            super::staging::remove_any(&tmp).map_err(io_err(&tmp))?;
        }
        std::fs::create_dir(&tmp).map_err(io_err(dir))?;
        super::staging::register(&tmp);
        Ok(TraceWriter {
            dir: dir.to_path_buf(),
            tmp,
            filter,
            entries: Vec::new(),
            error: None,
            done: false,
            _lock: lock,
        })
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
        let mut m = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            model,
            producer,
            steps,
            tensors: entries,
            layouts: BTreeMap::new(),
        };
        m.tensors
            .sort_by_key(|e| TapKey::new(e.step, e.layer, Tap::parse(&e.tap).expect("own tap")));
        write_manifest(&self.tmp, &m)?;
        super::staging::settle(&self.tmp, || publish(&self.tmp, &self.dir))?;
        self.done = true;
        Ok(m)
    }
}

impl Drop for TraceWriter {
    fn drop(&mut self) {
        if !self.done {
            super::staging::settle(&self.tmp, || std::fs::remove_dir_all(&self.tmp).ok());
        }
    }
}

impl Sink for TraceWriter {
    fn wants(&self, key: &TapKey) -> bool {
        self.error.is_none() && self.filter.matches(key)
    }
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
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
            Ok(()) => self.entries.push(entry(&key, shape)),
            Err(e) => self.error = Some(e),
        }
    }
}
