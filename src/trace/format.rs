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
    Dir(PathBuf),
    Memory(BTreeMap<TapKey, ArrayD<f32>>),
}

/// A trace: its manifest and its tensors (read lazily from disk, or held in memory).
pub struct Trace {
    pub manifest: Manifest,
    keys: BTreeMap<TapKey, usize>,
    source: Source,
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
        }
    }

    /// Open a trace folder: parse and validate the manifest; tensors are read on demand.
    pub fn open(dir: impl AsRef<Path>) -> Result<Trace, TraceError> {
        let dir = dir.as_ref();
        let mpath = dir.join("manifest.json");
        let text = std::fs::read_to_string(&mpath).map_err(io_err(&mpath))?;
        let bad = |what: String| TraceError::BadManifest {
            path: mpath.display().to_string(),
            what,
        };
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if manifest.format != FORMAT {
            return Err(bad(format!(
                "format is '{}', expected '{FORMAT}'",
                manifest.format
            )));
        }
        if manifest.version != VERSION {
            return Err(bad(format!(
                "version {} is not supported (this parity reads version {VERSION})",
                manifest.version
            )));
        }
        let mut keys = BTreeMap::new();
        for (i, t) in manifest.tensors.iter().enumerate() {
            let tap = Tap::parse(&t.tap).ok_or_else(|| bad(format!("unknown tap '{}'", t.tap)))?;
            if tap.per_layer() != t.layer.is_some() {
                return Err(bad(format!(
                    "tap '{}' {} a layer",
                    t.tap,
                    if tap.per_layer() {
                        "needs"
                    } else {
                        "cannot have"
                    }
                )));
            }
            if t.file.contains("..") || Path::new(&t.file).is_absolute() {
                return Err(bad(format!(
                    "tensor file '{}' leaves the trace folder",
                    t.file
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
            source: Source::Dir(dir.to_path_buf()),
        })
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
            Source::Dir(dir) => {
                let e = &self.manifest.tensors[i];
                let a = read_npy(&dir.join(&e.file))?;
                if a.shape() != e.shape.as_slice() {
                    return Err(TraceError::BadTensor {
                        path: dir.join(&e.file).display().to_string(),
                        what: format!(
                            "shape {:?} differs from the manifest's {:?}",
                            a.shape(),
                            e.shape
                        ),
                    });
                }
                Ok(Some(a))
            }
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

fn prepare_dir(dir: &Path, force: bool) -> Result<(), TraceError> {
    if dir.exists() {
        let non_empty = std::fs::read_dir(dir)
            .map_err(io_err(dir))?
            .next()
            .is_some();
        if non_empty && !force {
            return Err(TraceError::NotEmpty(dir.display().to_string()));
        }
        if non_empty {
            // Only clear what a trace consists of, never arbitrary user files.
            if dir.join("manifest.json").exists() {
                for e in std::fs::read_dir(dir).map_err(io_err(dir))?.flatten() {
                    let p = e.path();
                    let name = e.file_name().to_string_lossy().to_string();
                    if p.is_dir()
                        && name.starts_with('s')
                        && name[1..].chars().all(|c| c.is_ascii_digit())
                    {
                        std::fs::remove_dir_all(&p).map_err(io_err(&p))?;
                    }
                }
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(io_err(dir))
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), TraceError> {
    let p = dir.join("manifest.json");
    let text = serde_json::to_string_pretty(m).expect("manifest serializes");
    std::fs::write(&p, text + "\n").map_err(io_err(&p))
}

/// Write a little-endian f32 C-order .npy file.
pub fn write_npy(path: &Path, shape: &[usize], data: &[f32]) -> Result<(), TraceError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let f = std::fs::File::create(path).map_err(io_err(path))?;
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

/// Read a .npy file of f32, f64 or f16 (C or Fortran order) as an f32 tensor.
pub fn read_npy(path: &Path) -> Result<ArrayD<f32>, TraceError> {
    let bad = |what: String| TraceError::BadTensor {
        path: path.display().to_string(),
        what,
    };
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| bad(format!("not a .npy file: {e}")))?;
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let n: usize = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad("absurd shape".into()))?;
    if n.saturating_mul(2) > bytes.len() {
        return Err(bad(format!(
            "shape {shape:?} does not fit in {} bytes",
            bytes.len()
        )));
    }
    let fortran = npy.order() == npyz::Order::Fortran;
    let descr = npy
        .dtype()
        .descr()
        .trim_matches(|c| c == '\'' || c == '"')
        .to_string();
    let data: Vec<f32> = match descr.as_str() {
        "<f4" | ">f4" => npy.into_vec::<f32>(),
        "<f8" | ">f8" => npy
            .into_vec::<f64>()
            .map(|v| v.into_iter().map(|x| x as f32).collect()),
        "<f2" | ">f2" => npy.into_vec::<u16>().map(|v| {
            v.into_iter()
                .map(|b| half::f16::from_bits(b).to_f32())
                .collect()
        }),
        other => {
            return Err(bad(format!(
                "dtype {other} is not a float type (use float32)"
            )));
        }
    }
    .map_err(|e| bad(e.to_string()))?;
    if data.len() != n {
        return Err(bad(format!(
            "holds {} values for shape {shape:?}",
            data.len()
        )));
    }
    let sh = if fortran {
        IxDyn(&shape).f()
    } else {
        IxDyn(&shape).into_shape_with_order()
    };
    ArrayD::from_shape_vec(sh, data).map_err(|e| bad(e.to_string()))
}

/// A sink that streams wanted taps straight to a trace folder (low memory for big models).
pub struct TraceWriter {
    dir: PathBuf,
    filter: TapFilter,
    entries: Vec<TensorEntry>,
    error: Option<TraceError>,
}

impl TraceWriter {
    pub fn create(dir: &Path, filter: TapFilter, force: bool) -> Result<Self, TraceError> {
        prepare_dir(dir, force)?;
        Ok(TraceWriter {
            dir: dir.to_path_buf(),
            filter,
            entries: Vec::new(),
            error: None,
        })
    }

    /// Write the manifest. Reports the first write error met while recording.
    pub fn finish(
        mut self,
        model: ModelRef,
        producer: Producer,
        steps: Vec<StepInfo>,
    ) -> Result<Manifest, TraceError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.entries
            .sort_by_key(|e| TapKey::new(e.step, e.layer, Tap::parse(&e.tap).expect("own tap")));
        let m = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            model,
            producer,
            steps,
            tensors: self.entries,
            layouts: BTreeMap::new(),
        };
        write_manifest(&self.dir, &m)?;
        Ok(m)
    }
}

impl Sink for TraceWriter {
    fn wants(&self, key: &TapKey) -> bool {
        self.error.is_none() && self.filter.matches(key)
    }
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        match write_npy(&self.dir.join(key.file()), shape, data) {
            Ok(()) => self.entries.push(entry(&key, shape)),
            Err(e) => self.error = Some(e),
        }
    }
}
