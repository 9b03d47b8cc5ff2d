//! Write a trace from an engine's own loop: `step`, `tap`, …, `finish`. Each tap is checked
//! as it is recorded (a known name, its layer, a shape that holds the data with the step's
//! tokens on its token axis, recorded once), so a mistake is named where it is made.

use crate::archive::ArchiveWriter;
use crate::manifest::{Manifest, ModelRef, Producer, StepInfo, TensorEntry};
use crate::{Cutting, Error, Record, Tap, TapKey, io_err, npy};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

enum Out {
    /// A folder: each tap written as it is recorded.
    Dir(PathBuf),
    /// One archive in memory, handed back by `finish_archive`.
    Memory(ArchiveWriter),
}

/// Writes a trace (a folder, or an `.npz` archive in memory) from an engine's own loop.
pub struct TraceWriter {
    out: Out,
    /// Names the trace in errors: the folder, or `<memory>`.
    shown: String,
    model: ModelRef,
    producer: Producer,
    steps: Vec<StepInfo>,
    entries: Vec<TensorEntry>,
    seen: HashSet<TapKey>,
    /// The plan this trace records to: taps it leaves out are accepted and not stored.
    record: Option<Record>,
}

fn bad(shown: &str, what: String) -> Error {
    Error::BadTensor {
        path: shown.to_string(),
        what,
    }
}

/// Is `name` one of the entries a trace consists of (`manifest.json`, `sNNN`)?
fn is_trace_entry(name: &str) -> bool {
    name == "manifest.json"
        || (name.len() > 1
            && name.starts_with('s')
            && name[1..].bytes().all(|c| c.is_ascii_digit()))
}

/// Make `dir` ready for a new trace: created if absent; a previous trace there is replaced
/// (its `manifest.json` and `sNNN` folders only); a link, a file, or a folder holding anything
/// but a trace is refused — a writer never deletes what it did not write.
fn prepare_dir(dir: &Path) -> Result<(), Error> {
    let shown = dir.display().to_string();
    let refuse = |what: &str| Error::Io {
        path: shown.clone(),
        source: std::io::Error::other(what.to_string()),
    };
    match std::fs::symlink_metadata(dir) {
        Err(_) => return std::fs::create_dir_all(dir).map_err(io_err(dir)),
        Ok(m) if m.file_type().is_symlink() => {
            return Err(refuse(
                "is a symbolic link: a trace is never written through a link, give the folder's own path",
            ));
        }
        Ok(m) if !m.is_dir() => return Err(refuse("exists and is not a folder")),
        Ok(_) => {}
    }
    let names: Vec<String> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    if !dir.join("manifest.json").is_file() || names.iter().any(|n| !is_trace_entry(n)) {
        return Err(Error::NotEmpty(shown));
    }
    for n in names {
        let p = dir.join(&n);
        let link = std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink());
        if p.is_dir() && !link {
            std::fs::remove_dir_all(&p).map_err(io_err(&p))?;
        } else {
            std::fs::remove_file(&p).map_err(io_err(&p))?;
        }
    }
    Ok(())
}

impl TraceWriter {
    /// Start a trace in folder `dir` (created; a previous trace there is replaced, anything
    /// else refused) for the GGUF file at `model` (its SHA-256 is recorded so that `parity diff`
    /// refuses a golden of another file), produced by `engine` on `backend`.
    pub fn create(
        dir: impl AsRef<Path>,
        model: impl AsRef<Path>,
        engine: &str,
        backend: &str,
    ) -> Result<TraceWriter, Error> {
        let m = model.as_ref();
        let (sha256, size) = crate::sha256::file(m).map_err(io_err(m))?;
        let model = ModelRef {
            path: m.display().to_string(),
            sha256,
            size: Some(size),
        };
        Self::with_model(dir, model, engine, backend)
    }

    /// As [`TraceWriter::create`] with the model given by path and hex SHA-256 (`""` to skip
    /// parity's same-model check).
    pub fn with_model(
        dir: impl AsRef<Path>,
        model: ModelRef,
        engine: &str,
        backend: &str,
    ) -> Result<TraceWriter, Error> {
        let record = Record::from_env().map_err(Error::BadRecord)?;
        let dir = dir.as_ref().to_path_buf();
        prepare_dir(&dir)?;
        let mut w = Self::new(
            Out::Dir(dir.clone()),
            dir.display().to_string(),
            model,
            engine,
            backend,
        );
        w.record = record;
        Ok(w)
    }

    /// A trace kept in memory and handed back as one `.npz` archive by
    /// [`TraceWriter::finish_archive`]: for an engine without a file system (wasm32).
    pub fn in_memory(model: ModelRef, engine: &str, backend: &str) -> TraceWriter {
        Self::new(
            Out::Memory(ArchiveWriter::new()),
            "<memory>".into(),
            model,
            engine,
            backend,
        )
    }

    fn new(out: Out, shown: String, model: ModelRef, engine: &str, backend: &str) -> Self {
        TraceWriter {
            out,
            shown,
            model,
            producer: Producer {
                name: engine.into(),
                backend: backend.into(),
                version: String::new(),
                settings: serde_json::Value::Null,
            },
            steps: Vec::new(),
            entries: Vec::new(),
            seen: HashSet::new(),
            record: None,
        }
    }

    /// Record to `plan` (`parity diff` prints the one a zoom needs): taps it leaves out are
    /// accepted by [`TraceWriter::tap`] and not stored. A folder writer starts with the plan in
    /// `PARITY_RECORD`, if set; an in-memory one with none.
    pub fn set_record(&mut self, plan: Option<Record>) {
        self.record = plan;
    }

    /// Whether the current step keeps tap `name` (at some layer): an engine may skip
    /// computing or copying a tap the plan leaves out. Before the first step, or for a name
    /// the format does not know, `true` (`tap` then says what is wrong).
    pub fn wants(&self, name: &str) -> bool {
        match (&self.record, self.steps.last(), Tap::parse(name)) {
            (Some(r), Some(s), Some(t)) => r.wants(s.step, t),
            _ => true,
        }
    }

    /// [`TraceWriter::wants`] for tap `name` of `layer` (None: a graph-wide tap): a plan's
    /// `layers=` keeps a whole step's taps at some layers alone.
    pub fn wants_at(&self, name: &str, layer: Option<usize>) -> bool {
        match (&self.record, self.steps.last(), Tap::parse(name)) {
            (Some(r), Some(s), Some(t)) => r.keeps(s.step, layer, t),
            _ => true,
        }
    }

    /// Record the engine's version and free-form settings in the manifest.
    pub fn set_producer(&mut self, version: &str, settings: serde_json::Value) {
        self.producer.version = version.into();
        self.producer.settings = settings;
    }

    /// Begin a step: the prefill (step 0) with all prompt ids, then one call per decode step.
    /// Returns the step's index.
    pub fn step(&mut self, tokens: &[u32], positions: &[usize]) -> Result<usize, Error> {
        if tokens.is_empty() || tokens.len() != positions.len() {
            return Err(bad(
                &self.shown,
                format!(
                    "step {}: {} tokens and {} positions (need the same, at least one)",
                    self.steps.len(),
                    tokens.len(),
                    positions.len()
                ),
            ));
        }
        let step = self.steps.len();
        self.steps.push(StepInfo {
            step,
            tokens: tokens.to_vec(),
            positions: positions.to_vec(),
            forced: None,
        });
        Ok(step)
    }

    /// Record one tensor of the current step. `layer`: `None` for `embd`, `result_norm`,
    /// `logits`; the layer index for every other tap. `shape` is the numpy shape (token axis
    /// first; `kq_soft_max` is `[n_head, T, n_kv]`), `data` in C order.
    pub fn tap(
        &mut self,
        layer: impl Into<Option<usize>>,
        name: &str,
        shape: &[usize],
        data: &[f32],
    ) -> Result<(), Error> {
        let layer = layer.into();
        let shown = &self.shown;
        let Some(s) = self.steps.last() else {
            return Err(bad(
                shown,
                format!("tap '{name}' before the first step() call"),
            ));
        };
        let tap = Tap::parse(name).ok_or_else(|| {
            bad(
                shown,
                format!("unknown tap '{name}' (docs/trace-format.md lists them)"),
            )
        })?;
        if tap.per_layer() != layer.is_some() {
            return Err(bad(
                shown,
                format!(
                    "tap '{name}' {} a layer",
                    if tap.per_layer() {
                        "needs"
                    } else {
                        "cannot have"
                    }
                ),
            ));
        }
        let key = TapKey::new(s.step, layer, tap);
        if self
            .record
            .as_ref()
            .is_some_and(|r| !r.keeps(s.step, layer, tap))
        {
            return Ok(());
        }
        let n: Option<usize> = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n != Some(data.len()) {
            return Err(bad(
                shown,
                format!("{key}: shape {shape:?} does not hold {} values", data.len()),
            ));
        }
        let t_axis = if tap == Tap::KqSoftMax { 1 } else { 0 };
        if shape.get(t_axis) != Some(&s.tokens.len()) {
            return Err(bad(
                shown,
                format!(
                    "{key}: shape {shape:?} should have the step's {} tokens on axis {t_axis} (numpy shape = ggml ne reversed)",
                    s.tokens.len()
                ),
            ));
        }
        if self.seen.contains(&key) {
            return Err(bad(shown, format!("{key} recorded twice")));
        }
        // The plan's cut of the probabilities ([n_head, T, n_kv], the step's rows).
        let mut cut = None;
        let cutting = match (tap, &self.record, shape) {
            (Tap::KqSoftMax, Some(r), &[h, t, n]) => r.cut_probs([h, t, n], s.positions[0], data),
            (Tap::KqSoftMax, Some(r), _) if r.cuts_probs() => {
                return Err(bad(
                    shown,
                    format!(
                        "{key}: shape {shape:?} is not [n_head, T, n_kv], which the plan's kq_heads/kq_rows cut"
                    ),
                ));
            }
            _ => Cutting::Whole,
        };
        let kept;
        let (shape, data) = match cutting {
            Cutting::Whole => (shape, data),
            Cutting::Nothing => return Ok(()),
            Cutting::Kept(c, sh, v) => {
                cut = Some(c);
                kept = (sh, v);
                (&kept.0[..], &kept.1[..])
            }
        };
        let file = key.file();
        let bytes = npy::f32_file(shape, data);
        match &mut self.out {
            Out::Dir(dir) => {
                let path = dir.join(&file);
                let step = path.parent().expect("sNNN/name.npy");
                if !step.is_dir() {
                    std::fs::create_dir(step).map_err(io_err(step))?;
                }
                // A new file: nothing already at the name (a link least of all) is opened.
                use std::io::Write;
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .and_then(|mut f| f.write_all(&bytes))
                    .map_err(io_err(&path))?;
            }
            Out::Memory(a) => a.add(&file, &bytes).map_err(|what| bad(shown, what))?,
        }
        self.seen.insert(key);
        let mut entry = TensorEntry::f32(&key, shape);
        if let Some(c) = cut {
            (entry.heads, entry.rows) = (c.heads, c.rows);
        }
        self.entries.push(entry);
        Ok(())
    }

    fn manifest(&mut self) -> Manifest {
        let mut m = Manifest::new(
            self.model.clone(),
            self.producer.clone(),
            std::mem::take(&mut self.steps),
            std::mem::take(&mut self.entries),
        );
        m.record = self.record.as_ref().map(Record::to_string);
        m
    }

    /// Write `manifest.json` (a folder trace) and return the manifest. For an in-memory trace,
    /// use [`TraceWriter::finish_archive`].
    pub fn finish(mut self) -> Result<Manifest, Error> {
        let m = self.manifest();
        match &self.out {
            Out::Dir(dir) => {
                let p = dir.join("manifest.json");
                std::fs::write(&p, m.to_json()).map_err(io_err(&p))?;
                Ok(m)
            }
            Out::Memory(_) => Err(bad(
                &self.shown,
                "an in-memory trace is finished with finish_archive()".into(),
            )),
        }
    }

    /// The trace as one `.npz` archive (manifest.json and every tap), for `parity diff` to
    /// read as it reads a folder. A folder trace is finished with [`TraceWriter::finish`].
    pub fn finish_archive(mut self) -> Result<Vec<u8>, Error> {
        let m = self.manifest();
        let shown = self.shown.clone();
        match self.out {
            Out::Memory(mut a) => {
                a.add("manifest.json", m.to_json().as_bytes())
                    .map_err(|what| bad(&shown, what))?;
                a.finish().map_err(|what| bad(&shown, what))
            }
            Out::Dir(_) => Err(bad(
                &shown,
                "a folder trace is finished with finish()".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelRef {
        ModelRef {
            path: "m.gguf".into(),
            sha256: String::new(),
            size: None,
        }
    }

    fn record(w: &mut TraceWriter) {
        let e = |r: Result<(), Error>| r.unwrap_err().to_string();
        assert!(e(w.tap(None, "embd", &[1, 2], &[0.0, 1.0])).contains("before the first step"));
        w.step(&[1, 2], &[0, 1]).unwrap();
        w.tap(None, "embd", &[2, 2], &[0.0, 1.0, 2.0, 3.0]).unwrap();
        assert!(e(w.tap(0, "embd", &[2, 2], &[0.0; 4])).contains("cannot have a layer"));
        assert!(e(w.tap(None, "q", &[2, 2], &[0.0; 4])).contains("needs a layer"));
        assert!(e(w.tap(0, "qq", &[2, 2], &[0.0; 4])).contains("unknown tap"));
        assert!(e(w.tap(0, "l_out", &[2, 3], &[0.0; 4])).contains("does not hold"));
        assert!(e(w.tap(0, "l_out", &[4, 1], &[0.0; 4])).contains("2 tokens on axis 0"));
        assert!(e(w.tap(None, "embd", &[2, 2], &[0.0; 4])).contains("twice"));
        w.tap(0, "kq_soft_max", &[1, 2, 2], &[1.0, 0.0, 0.5, 0.5])
            .unwrap();
        w.step(&[3], &[2]).unwrap();
        w.tap(0, "l_out", &[1, 2], &[5.0, 6.0]).unwrap();
    }

    #[test]
    fn a_folder_and_an_archive_hold_the_same_trace() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("t");
        let mut w = TraceWriter::with_model(&dir, model(), "toy", "cpu").unwrap();
        record(&mut w);
        let m = w.finish().unwrap();
        assert_eq!(m.tensors.len(), 3);
        let text = std::fs::read(dir.join("manifest.json")).unwrap();
        let (back, ix) = Manifest::parse(&text, "manifest.json").unwrap();
        assert_eq!(back, m);
        assert_eq!(ix.keys.len(), 3);
        let l_out = std::fs::read(dir.join("s001/l_out-0.npy")).unwrap();
        assert_eq!(npy::decode_file(&l_out, &[1, 2]).unwrap(), vec![5.0, 6.0]);

        let mut w = TraceWriter::in_memory(model(), "toy", "cpu");
        record(&mut w);
        let bytes = w.finish_archive().unwrap();
        let a = crate::archive::Archive::parse(&bytes).unwrap();
        let (am, _) = Manifest::parse(a.get(&bytes, "manifest.json").unwrap(), "x").unwrap();
        assert_eq!(am, m);
        for e in &m.tensors {
            assert_eq!(
                a.get(&bytes, &e.file).unwrap(),
                &std::fs::read(dir.join(&e.file)).unwrap()[..],
                "{}",
                e.file
            );
        }
    }

    #[test]
    fn replaces_a_trace_and_nothing_else() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("t");
        for _ in 0..2 {
            let mut w = TraceWriter::with_model(&dir, model(), "toy", "cpu").unwrap();
            record(&mut w);
            w.finish().unwrap();
        }
        std::fs::write(dir.join("notes.txt"), "mine").unwrap();
        let e = TraceWriter::with_model(&dir, model(), "toy", "cpu")
            .err()
            .unwrap();
        assert!(e.to_string().contains("not empty"), "{e}");
        assert!(dir.join("notes.txt").exists() && dir.join("manifest.json").exists());
        #[cfg(unix)]
        {
            let link = tmp.path().join("link");
            std::os::unix::fs::symlink(&dir, &link).unwrap();
            let e = TraceWriter::with_model(&link, model(), "toy", "cpu")
                .err()
                .unwrap();
            assert!(e.to_string().contains("symbolic link"), "{e}");
        }
    }

    #[test]
    fn create_records_the_models_hash_and_size() {
        let tmp = tempfile::tempdir().unwrap();
        let gguf = tmp.path().join("m.gguf");
        std::fs::write(&gguf, b"abc").unwrap();
        let mut w = TraceWriter::create(tmp.path().join("t"), &gguf, "toy", "cpu").unwrap();
        w.step(&[1], &[0]).unwrap();
        let m = w.finish().unwrap();
        assert_eq!(
            m.model.sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(m.model.size, Some(3));
    }
}
