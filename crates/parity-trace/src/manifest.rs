//! `manifest.json`: what a trace holds, parsed and checked once, before any tensor is read.

use crate::npy::{EXCERPT, excerpt};
use crate::{Error, Tap, TapKey};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const FORMAT: &str = "parity-trace";
pub const VERSION: u32 = 1;

/// Largest manifest read: a 70B model's 80 layers × 20 taps × 100 steps of entries is ~30 MB.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Largest position or layer index a manifest may name (llama.cpp's contexts and layer counts
/// are far below; the bound keeps `pos0 + T` and friends far from overflow).
pub const MAX_POSITION: usize = 1 << 24;
/// Largest tensor a tap may hold (elements): the logits of a 256k vocabulary over a 16k-token
/// prefill are 2^32; a bigger shape is a corrupt manifest, not a tap.
pub const MAX_TAP_ELEMENTS: u64 = 1 << 33;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelRef {
    pub path: String,
    /// Hex SHA-256 of the GGUF file (`""`: unknown, parity then skips its same-model check).
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
    /// `kq_soft_max` cut to these heads (a plan's `kq_heads`): the stored head axis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<Vec<usize>>,
    /// `kq_soft_max` cut to the rows of these positions (a plan's `kq_rows`): the stored row axis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<Vec<usize>>,
}

impl TensorEntry {
    /// The entry a writer makes for an f32 tap.
    pub fn f32(key: &TapKey, shape: &[usize]) -> TensorEntry {
        TensorEntry {
            step: key.step,
            tap: key.tap.name().to_string(),
            layer: key.layer,
            file: key.file(),
            shape: shape.to_vec(),
            dtype: "<f4".into(),
            heads: None,
            rows: None,
        }
    }

    /// The cut this entry's tensor was stored with (`kq_soft_max` alone); None: whole.
    pub fn cut(&self) -> Option<crate::Cut> {
        (self.heads.is_some() || self.rows.is_some()).then(|| crate::Cut {
            heads: self.heads.clone(),
            rows: self.rows.clone(),
        })
    }

    /// The number of values the shape holds; None past what a tap may hold.
    pub fn elements(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .filter(|&n| n <= MAX_TAP_ELEMENTS)
    }
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
    /// `{"q_rope": "head-major"}`; aligned on load by parity's judge.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub layouts: BTreeMap<String, String>,
    /// The recording plan the producer honoured (`taps=l_out,logits;full=3`, see
    /// `parity_trace::Record`): which taps it left out where. Absent: every tap it could.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<String>,
}

/// A checked manifest's index: each known tap's entry, and the entries parity does not know.
#[derive(Clone, Debug, Default)]
pub struct Index {
    pub keys: BTreeMap<TapKey, usize>,
    /// Entries whose tap is not one of the known names: kept (an engine may record more than
    /// parity compares) and reported as not compared.
    pub extra: Vec<TensorEntry>,
}

/// A piece of a file's own text as an error line quotes it: short, one line.
pub fn short(s: &str) -> String {
    excerpt(s, EXCERPT)
}

/// A parser's message, which may quote a whole string of the file, cut to its head and its
/// tail (where serde_json says the line and column).
fn head_tail(msg: &str) -> String {
    let n = msg.chars().count();
    if n <= 2 * EXCERPT {
        return short(msg);
    }
    let tail: String = msg.chars().skip(n - 40).collect();
    format!("{} {}", short(msg), short(&tail))
}

impl Manifest {
    /// A new manifest of this format and version.
    pub fn new(
        model: ModelRef,
        producer: Producer,
        steps: Vec<StepInfo>,
        mut tensors: Vec<TensorEntry>,
    ) -> Manifest {
        // Graph order, whatever order the engine recorded in.
        tensors.sort_by_key(|e| Tap::parse(&e.tap).map(|t| TapKey::new(e.step, e.layer, t)));
        Manifest {
            format: FORMAT.into(),
            version: VERSION,
            model,
            producer,
            steps,
            tensors,
            layouts: BTreeMap::new(),
            record: None,
        }
    }

    /// The ids fed at the decode steps (step 1 on), in order: what another run must force to
    /// see the same sequence.
    pub fn decode_tokens(&self) -> Vec<u32> {
        self.steps
            .iter()
            .skip(1)
            .flat_map(|s| s.tokens.iter().copied())
            .collect()
    }

    /// `manifest.json` as written: pretty JSON and a final newline.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a manifest serializes") + "\n"
    }

    /// Parse and check `manifest.json` (`path` names it in errors). Everything a reader then
    /// relies on is checked here, once: the format and version, steps in order with one
    /// position per token running on from 0, each known tap's layer, file names that stay
    /// inside the trace, shapes that a tap can hold, no key listed twice.
    pub fn parse(bytes: &[u8], path: &str) -> Result<(Manifest, Index), Error> {
        let bad = |what: String| Error::BadManifest {
            path: path.to_string(),
            what,
        };
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "{} bytes, more than a manifest can be ({MAX_MANIFEST_BYTES} at most)",
                bytes.len()
            )));
        }
        let manifest: Manifest =
            serde_json::from_slice(bytes).map_err(|e| bad(head_tail(&e.to_string())))?;
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
        check_steps(&manifest.steps).map_err(bad)?;
        let mut index = Index::default();
        for (i, t) in manifest.tensors.iter().enumerate() {
            let Some(tap) = Tap::parse(&t.tap) else {
                index.extra.push(t.clone());
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
            if t.file.contains("..")
                || t.file.starts_with('/')
                || std::path::Path::new(&t.file).is_absolute()
            {
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
            if t.elements().is_none() {
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
            check_cut(&manifest, t, tap).map_err(|what| bad(format!("{key}: {what}")))?;
            if index.keys.insert(key, i).is_some() {
                return Err(bad(format!("{key} is listed twice")));
            }
        }
        Ok((manifest, index))
    }
}

/// A cut entry (`heads`, `rows`): `kq_soft_max` alone, increasing lists of heads and of the
/// step's own positions, as many as the stored axes hold (token-major: rows first).
fn check_cut(m: &Manifest, t: &TensorEntry, tap: Tap) -> Result<(), String> {
    if t.heads.is_none() && t.rows.is_none() {
        return Ok(());
    }
    if tap != Tap::KqSoftMax {
        return Err("only kq_soft_max can be cut to heads or rows".into());
    }
    if t.shape.len() != 3 {
        return Err(format!(
            "a cut kq_soft_max is stored [heads, rows, keys], not {}",
            short(&format!("{:?}", t.shape))
        ));
    }
    let token_major = m
        .layouts
        .get("kq_soft_max")
        .is_some_and(|l| l == "token-major");
    let (h_axis, r_axis) = if token_major { (1, 0) } else { (0, 1) };
    let increasing = |v: &[usize]| !v.is_empty() && v.windows(2).all(|w| w[0] < w[1]);
    if let Some(h) = &t.heads {
        if !increasing(h) || h[h.len() - 1] > MAX_POSITION {
            return Err("heads must list head numbers in increasing order, at least one".into());
        }
        if h.len() != t.shape[h_axis] {
            return Err(format!(
                "lists {} heads but stores {} on axis {h_axis}",
                h.len(),
                t.shape[h_axis]
            ));
        }
    }
    if let Some(r) = &t.rows {
        let s = &m.steps[t.step];
        let (lo, n) = (s.positions[0], s.positions.len());
        if !increasing(r) {
            return Err("rows must list positions in increasing order, at least one".into());
        }
        if let Some(p) = r.iter().find(|&&p| p < lo || p - lo >= n) {
            return Err(format!(
                "rows lists position {p}, which step {} does not hold ({lo}..{})",
                t.step,
                lo + n
            ));
        }
        if r.len() != t.shape[r_axis] {
            return Err(format!(
                "lists {} rows but stores {} on axis {r_axis}",
                r.len(),
                t.shape[r_axis]
            ));
        }
    }
    Ok(())
}

/// Steps index the tensors and feed position arithmetic (`pos0 + T`): their order and range
/// are checked once, before any of it.
fn check_steps(steps: &[StepInfo]) -> Result<(), String> {
    let mut next = 0usize;
    for (i, s) in steps.iter().enumerate() {
        if s.step != i {
            return Err(format!(
                "steps[{i}] is step {} (steps are listed in order from 0, one entry each)",
                s.step
            ));
        }
        if s.tokens.is_empty() {
            return Err(format!("step {} has no tokens", s.step));
        }
        if let Some(p) = s.positions.iter().find(|&&p| p > MAX_POSITION) {
            return Err(format!(
                "step {} has position {p}, past any context ({MAX_POSITION} at most)",
                s.step
            ));
        }
        if s.positions.len() != s.tokens.len() {
            return Err(format!(
                "step {} has {} tokens but {} positions (one position per token)",
                s.step,
                s.tokens.len(),
                s.positions.len()
            ));
        }
        // Positions run on from 0, one per token (what the judge's KV cache replays).
        if s.positions.iter().enumerate().any(|(k, &p)| p != next + k) {
            return Err(format!(
                "step {} has positions {}, expected {next}..{} (positions run on from 0 across the steps, one per token)",
                s.step,
                short(&format!("{:?}", s.positions)),
                next + s.positions.len()
            ));
        }
        next += s.positions.len();
    }
    Ok(())
}

/// One step of a golden: the ids to feed and their positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoldenStep {
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
}

/// The ids a golden was made with, step by step (step 0: the prompt as llama.cpp tokenized
/// it; then one teacher-forced token per decode step): what an engine must feed to be compared.
/// `golden` is a trace folder or a `.npz` archive.
pub fn golden_ids(golden: impl AsRef<std::path::Path>) -> Result<Vec<GoldenStep>, Error> {
    let golden = golden.as_ref();
    let (bytes, path) = if golden.is_dir() {
        let p = golden.join("manifest.json");
        (read_bounded(&p)?, p)
    } else {
        let data = std::fs::read(golden).map_err(crate::io_err(golden))?;
        let a = crate::archive::Archive::parse(&data).map_err(|what| Error::BadManifest {
            path: golden.display().to_string(),
            what,
        })?;
        let m = a
            .get(&data, "manifest.json")
            .map_err(|what| Error::BadManifest {
                path: golden.display().to_string(),
                what,
            })?;
        (m.to_vec(), golden.join("manifest.json"))
    };
    golden_steps(&bytes, &path.display().to_string())
}

/// [`golden_ids`] from the bytes of a golden's `manifest.json` (`path` names it in errors):
/// for an engine without a file system, handed the manifest by its host.
pub fn golden_steps(manifest_json: &[u8], path: &str) -> Result<Vec<GoldenStep>, Error> {
    let (m, _) = Manifest::parse(manifest_json, path)?;
    Ok(m.steps
        .into_iter()
        .map(|s| GoldenStep {
            tokens: s.tokens,
            positions: s.positions,
        })
        .collect())
}

fn read_bounded(p: &std::path::Path) -> Result<Vec<u8>, Error> {
    use std::io::Read;
    let f = std::fs::File::open(p).map_err(crate::io_err(p))?;
    let mut out = Vec::new();
    f.take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(crate::io_err(p))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(steps: &str, tensors: &str) -> String {
        format!(
            r#"{{"format":"parity-trace","version":1,"model":{{"path":"m","sha256":""}},
            "producer":{{"name":"x","backend":"cpu","version":""}},"steps":{steps},"tensors":{tensors}}}"#
        )
    }

    #[test]
    fn checks_steps_and_entries() {
        let ok = manifest(
            r#"[{"step":0,"tokens":[1,2],"positions":[0,1]},{"step":1,"tokens":[3],"positions":[2]}]"#,
            r#"[{"step":0,"tap":"embd","layer":null,"file":"s000/embd.npy","shape":[2,4],"dtype":"<f4"},
               {"step":1,"tap":"mine","layer":0,"file":"s001/mine-0.npy","shape":[1],"dtype":"<f4"}]"#,
        );
        let (m, ix) = Manifest::parse(ok.as_bytes(), "m.json").unwrap();
        assert_eq!(m.decode_tokens(), vec![3]);
        assert_eq!(ix.keys.len(), 1);
        assert_eq!(ix.extra.len(), 1);
        let refused = |steps: &str, tensors: &str, want: &str| {
            let e = Manifest::parse(manifest(steps, tensors).as_bytes(), "m.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains('\n'), "{e}");
        };
        let one = r#"[{"step":0,"tokens":[1],"positions":[0]}]"#;
        refused(
            r#"[{"step":1,"tokens":[1],"positions":[0]}]"#,
            "[]",
            "steps[0] is step 1",
        );
        refused(
            r#"[{"step":0,"tokens":[1],"positions":[5]}]"#,
            "[]",
            "expected 0..1",
        );
        refused(
            r#"[{"step":0,"tokens":[],"positions":[]}]"#,
            "[]",
            "no tokens",
        );
        refused(
            one,
            r#"[{"step":0,"tap":"embd","layer":null,"file":"../x.npy","shape":[1],"dtype":"<f4"}]"#,
            "leaves the trace folder",
        );
        refused(
            one,
            r#"[{"step":0,"tap":"q","layer":null,"file":"s000/q.npy","shape":[1],"dtype":"<f4"}]"#,
            "needs a layer",
        );
        refused(
            one,
            r#"[{"step":0,"tap":"embd","layer":null,"file":"a.npy","shape":[4294967296,4294967296],"dtype":"<f4"}]"#,
            "not a float tensor parity can hold",
        );
        refused(
            one,
            r#"[{"step":0,"tap":"embd","layer":null,"file":"a.npy","shape":[0],"dtype":"<f4"}]"#,
            "empty axis",
        );
        refused(
            one,
            r#"[{"step":3,"tap":"embd","layer":null,"file":"a.npy","shape":[1],"dtype":"<f4"}]"#,
            "do not list",
        );
        let e = Manifest::parse(b"{\"format\":\"x\"", "m.json")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("m.json: not a parity trace manifest"), "{e}");
    }
}
