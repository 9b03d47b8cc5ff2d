//! A toy llama engine instrumented only through `parity-trace` (issue #31): its own GGUF
//! reader (F32 tensors only), a plain f32 forward with f64 dot products, and one
//! `TraceWriter::tap` call after each op. It replays a golden's ids — step 0 the whole prompt,
//! then one forced token per decode step — and builds for the host (`src/main.rs` writes a
//! folder or an `.npz`) and for `wasm32-unknown-unknown` (the `extern "C"` entry points at the
//! end; `run.mjs` drives them from Node).
//!
//! Planted bugs ([`Bug`]) make it behave like an engine with a known mistake, so that a test
//! can check what `parity diff` says about each.

use parity_trace::{ModelRef, TraceWriter};
use std::collections::HashSet;

// ---------------------------------------------------------------------------------------------
// GGUF

/// Nesting of arrays inside arrays a file may have (llama.cpp writes none).
const MAX_ARRAY_DEPTH: usize = 8;
/// Dimensions of a tensor (ggml's GGML_MAX_DIMS).
const MAX_DIMS: usize = 4;
/// ggml type id of F32.
const GGML_F32: u32 = 0;

/// A metadata value. Arrays are skipped (bounds-checked) and kept as their type and length.
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array { elem_type: u32, len: u64 },
}

/// One tensor's entry in the GGUF header: dims in ggml order (`dims[0]` is the row length).
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

/// A parsed GGUF file over borrowed bytes.
pub struct Gguf<'a> {
    bytes: &'a [u8],
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, Meta)>,
    pub tensors: Vec<TensorInfo>,
    /// Where the data section starts (the header's end, aligned).
    pub data_start: u64,
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], String> {
        let left = self.b.len() - self.pos;
        if n > left as u64 {
            return Err(format!(
                "truncated at byte {}: {what} needs {n} bytes, {left} left",
                self.pos
            ));
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.u64(what)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }

    /// Size in bytes of one value of a fixed-size type; None for strings and arrays.
    fn fixed_size(ty: u32) -> Option<u64> {
        match ty {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Meta, String> {
        Ok(match ty {
            0 => Meta::Uint(self.array::<1>(what)?[0] as u64),
            1 => Meta::Int(self.array::<1>(what)?[0] as i8 as i64),
            2 => Meta::Uint(u16::from_le_bytes(self.array(what)?) as u64),
            3 => Meta::Int(i16::from_le_bytes(self.array(what)?) as i64),
            4 => Meta::Uint(self.u32(what)? as u64),
            5 => Meta::Int(i32::from_le_bytes(self.array(what)?) as i64),
            6 => Meta::Float(f32::from_le_bytes(self.array(what)?) as f64),
            7 => match self.array::<1>(what)?[0] {
                0 => Meta::Bool(false),
                1 => Meta::Bool(true),
                b => return Err(format!("{what}: bool value {b}")),
            },
            8 => Meta::Str(self.string(what)?),
            9 => {
                let elem_type = self.u32(what)?;
                let len = self.u64(what)?;
                self.skip_array(elem_type, len, what, depth + 1)?;
                Meta::Array { elem_type, len }
            }
            10 => Meta::Uint(self.u64(what)?),
            11 => Meta::Int(i64::from_le_bytes(self.array(what)?)),
            12 => Meta::Float(f64::from_le_bytes(self.array(what)?)),
            _ => return Err(format!("{what}: unknown value type {ty}")),
        })
    }

    /// Step over `len` values of type `ty`. Each element consumes at least one byte (strings
    /// and arrays at least 8), so a lying length runs into the end of the file, not a loop
    /// of 2^64.
    fn skip_array(&mut self, ty: u32, len: u64, what: &str, depth: usize) -> Result<(), String> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(format!(
                "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
            ));
        }
        if let Some(size) = Self::fixed_size(ty) {
            let n = len
                .checked_mul(size)
                .ok_or_else(|| format!("{what}: array of {len} values overflows"))?;
            self.take(n, what)?;
            return Ok(());
        }
        match ty {
            8 => {
                for _ in 0..len {
                    let n = self.u64(what)?;
                    self.take(n, what)?;
                }
            }
            9 => {
                for _ in 0..len {
                    let t = self.u32(what)?;
                    let n = self.u64(what)?;
                    self.skip_array(t, n, what, depth + 1)?;
                }
            }
            _ => return Err(format!("{what}: unknown array element type {ty}")),
        }
        Ok(())
    }
}

/// The name of a ggml type, for the refusal of anything but F32.
fn ggml_type_name(t: u32) -> String {
    let n = match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        30 => "BF16",
        _ => return format!("ggml type {t}"),
    };
    n.to_string()
}

impl<'a> Gguf<'a> {
    /// Parse the header, metadata and tensor infos. Every tensor must be F32 and lie inside
    /// the file.
    pub fn parse(bytes: &'a [u8]) -> Result<Gguf<'a>, String> {
        let mut r = Reader { b: bytes, pos: 0 };
        if r.take(4, "magic").ok() != Some(b"GGUF".as_slice()) {
            return Err("not a GGUF file (no GGUF magic)".into());
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(format!(
                "GGUF version {version} (this reader reads versions 2 and 3)"
            ));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        let mut metadata: Vec<(String, Meta)> = Vec::new();
        let mut keys = HashSet::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key {i}"))?;
            let ty = r.u32(&format!("type of '{key}'"))?;
            let v = r.value(ty, &format!("value of '{key}'"), 0)?;
            if !keys.insert(key.clone()) {
                return Err(format!("metadata key '{key}' appears twice"));
            }
            metadata.push((key, v));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => 32,
            Some((_, Meta::Uint(a))) if *a > 0 && a.is_power_of_two() => *a,
            Some((_, v)) => return Err(format!("general.alignment {v:?} is not a power of two")),
        };
        let mut tensors = Vec::new();
        let mut names = HashSet::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor {i}'s name"))?;
            let nd = r.u32(&format!("tensor '{name}' dimension count"))? as usize;
            if nd == 0 || nd > MAX_DIMS {
                return Err(format!(
                    "tensor '{name}' has {nd} dimensions (1 to {MAX_DIMS})"
                ));
            }
            let mut dims = Vec::with_capacity(nd);
            for _ in 0..nd {
                dims.push(r.u64(&format!("tensor '{name}' dimensions"))?);
            }
            let ggml_type = r.u32(&format!("tensor '{name}' type"))?;
            let offset = r.u64(&format!("tensor '{name}' offset"))?;
            if !names.insert(name.clone()) {
                return Err(format!("tensor '{name}' appears twice"));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let data_start = (r.pos as u64).next_multiple_of(alignment);
        let g = Gguf {
            bytes,
            version,
            alignment,
            metadata,
            tensors,
            data_start,
        };
        for t in &g.tensors {
            g.data(t)?;
        }
        Ok(g)
    }

    pub fn get(&self, key: &str) -> Option<&Meta> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of an F32 tensor, checked to lie inside the file.
    fn data(&self, t: &TensorInfo) -> Result<&'a [u8], String> {
        if t.ggml_type != GGML_F32 {
            return Err(format!(
                "tensor '{}' is {}: this engine reads F32 tensors only",
                t.name,
                ggml_type_name(t.ggml_type)
            ));
        }
        if !t.offset.is_multiple_of(self.alignment) {
            return Err(format!(
                "tensor '{}' at offset {} is not aligned to {}",
                t.name, t.offset, self.alignment
            ));
        }
        let bytes = t
            .dims
            .iter()
            .try_fold(4u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("tensor '{}': shape {:?} overflows", t.name, t.dims))?;
        let start = self.data_start.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(bytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.bytes.len() as u64 => {
                Ok(&self.bytes[s as usize..e as usize])
            }
            _ => Err(format!(
                "tensor '{}' ({bytes} bytes at offset {}) runs past the end of the file ({} bytes)",
                t.name,
                t.offset,
                self.bytes.len()
            )),
        }
    }

    /// An F32 tensor of exactly these ggml dims, as values.
    pub fn f32_tensor(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>, String> {
        let t = self
            .tensor(name)
            .ok_or_else(|| format!("tensor '{name}' is missing"))?;
        if t.dims.len() != dims.len() || t.dims.iter().zip(dims).any(|(&a, &b)| a != b as u64) {
            return Err(format!(
                "tensor '{name}' has dims {:?}, expected {dims:?}",
                t.dims
            ));
        }
        Ok(self
            .data(t)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
}

// ---------------------------------------------------------------------------------------------
// Model

/// The llama hyperparameters the forward needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Dimensions of each head RoPE rotates (`rope.dimension_count`, default head_dim).
    pub n_rot: usize,
    pub n_ff: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
}

/// Largest dimension the toy engine accepts (keeps every product of two far from overflow).
const MAX_DIM: usize = 1 << 20;

impl Config {
    pub fn read(g: &Gguf) -> Result<Config, String> {
        match g.get("general.architecture") {
            Some(Meta::Str(a)) if a == "llama" => {}
            Some(Meta::Str(a)) => {
                return Err(format!(
                    "architecture '{a}': this engine runs llama models only"
                ));
            }
            _ => return Err("general.architecture is missing".into()),
        }
        let opt_usize = |k: &str| -> Result<Option<usize>, String> {
            let key = format!("llama.{k}");
            let n = match g.get(&key) {
                None => return Ok(None),
                Some(Meta::Uint(n)) => *n,
                Some(Meta::Int(n)) if *n >= 0 => *n as u64,
                Some(v) => return Err(format!("{key} is {v:?}, not a count")),
            };
            if n == 0 || n > MAX_DIM as u64 {
                return Err(format!("{key} is {n} (1 to {MAX_DIM})"));
            }
            Ok(Some(n as usize))
        };
        let usize_ = |k: &str| opt_usize(k)?.ok_or_else(|| format!("llama.{k} is missing"));
        let opt_f32 = |k: &str| -> Result<Option<f32>, String> {
            let key = format!("llama.{k}");
            match g.get(&key) {
                None => Ok(None),
                Some(Meta::Float(x)) if x.is_finite() && *x > 0.0 => Ok(Some(*x as f32)),
                Some(v) => Err(format!("{key} is {v:?}, not a positive number")),
            }
        };
        let n_embd = usize_("embedding_length")?;
        let n_layer = usize_("block_count")?;
        let n_head = usize_("attention.head_count")?;
        let n_head_kv = opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
        let n_ff = usize_("feed_forward_length")?;
        let rms_eps = opt_f32("attention.layer_norm_rms_epsilon")?
            .ok_or("llama.attention.layer_norm_rms_epsilon is missing")?;
        let rope_base = opt_f32("rope.freq_base")?.unwrap_or(10000.0);
        if n_embd % n_head != 0 || n_head % n_head_kv != 0 {
            return Err(format!(
                "{n_head} heads and {n_head_kv} kv heads do not divide n_embd {n_embd} and each other"
            ));
        }
        let head_dim = n_embd / n_head;
        if let Some(k) = opt_usize("attention.key_length")?.filter(|&k| k != head_dim) {
            return Err(format!(
                "llama.attention.key_length {k} differs from n_embd / n_head = {head_dim} (not supported)"
            ));
        }
        let n_rot = opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(format!(
                "llama.rope.dimension_count {n_rot} is not an even number up to head_dim {head_dim}"
            ));
        }
        let emb = g
            .tensor("token_embd.weight")
            .ok_or("tensor 'token_embd.weight' is missing")?;
        let n_vocab = match emb.dims[..] {
            [e, v] if e == n_embd as u64 && v > 0 && v <= MAX_DIM as u64 => v as usize,
            _ => {
                return Err(format!(
                    "token_embd.weight has dims {:?}, expected [{n_embd}, n_vocab]",
                    emb.dims
                ));
            }
        };
        Ok(Config {
            n_vocab,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            n_ff,
            rms_eps,
            rope_base,
        })
    }
}

/// One layer's weights, each stored as GGUF rows (out × in).
pub struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

pub struct Model {
    pub config: Config,
    token_embd: Vec<f32>,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    /// `output.weight`; None: tied to token_embd.
    output: Option<Vec<f32>>,
}

impl Model {
    pub fn load(g: &Gguf) -> Result<Model, String> {
        let c = Config::read(g)?;
        let (e, q, kv, ff) = (
            c.n_embd,
            c.n_head * c.head_dim,
            c.n_head_kv * c.head_dim,
            c.n_ff,
        );
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let t =
                |name: &str, dims: &[usize]| g.f32_tensor(&format!("blk.{l}.{name}.weight"), dims);
            layers.push(Layer {
                attn_norm: t("attn_norm", &[e])?,
                wq: t("attn_q", &[e, q])?,
                wk: t("attn_k", &[e, kv])?,
                wv: t("attn_v", &[e, kv])?,
                wo: t("attn_output", &[q, e])?,
                ffn_norm: t("ffn_norm", &[e])?,
                w_gate: t("ffn_gate", &[e, ff])?,
                w_up: t("ffn_up", &[e, ff])?,
                w_down: t("ffn_down", &[ff, e])?,
            });
        }
        let output = match g.tensor("output.weight") {
            Some(_) => Some(g.f32_tensor("output.weight", &[e, c.n_vocab])?),
            None => None,
        };
        Ok(Model {
            token_embd: g.f32_tensor("token_embd.weight", &[e, c.n_vocab])?,
            output_norm: g.f32_tensor("output_norm.weight", &[e])?,
            layers,
            output,
            config: c,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Planted bugs

/// A known engine mistake, switched on by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// RoPE pairs dimensions i and i + n_rot/2 (NEOX) where the model pairs 2i, 2i+1.
    RopeNeox,
    /// Attention scores are not divided by sqrt(head_dim).
    NoAttnScale,
    /// Query head h reads kv head h % n_head_kv instead of h / (n_head / n_head_kv).
    GqaModulo,
    /// SwiGLU with its operands swapped: silu(up) * gate.
    SwigluSwap,
    /// The output projection uses token_embd although output.weight exists.
    TiedOutput,
}

impl Bug {
    pub const ALL: [(&'static str, Bug); 5] = [
        ("rope-neox", Bug::RopeNeox),
        ("no-attn-scale", Bug::NoAttnScale),
        ("gqa-modulo", Bug::GqaModulo),
        ("swiglu-swap", Bug::SwigluSwap),
        ("tied-output", Bug::TiedOutput),
    ];

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, b)| *b == self)
            .expect("listed")
            .0
    }

    pub fn parse(s: &str) -> Result<Bug, String> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == s)
            .map(|&(_, b)| b)
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
                format!("unknown bug '{s}' (known: {})", known.join(", "))
            })
    }
}

// ---------------------------------------------------------------------------------------------
// Forward

/// `y[t] = W x[t]` for each of the `t` rows of `x`; W holds `n_out` rows of `n_in`.
fn matmul(w: &[f32], x: &[f32], t: usize) -> Vec<f32> {
    let n_in = x.len() / t;
    let n_out = w.len() / n_in;
    let mut y = vec![0.0f32; t * n_out];
    for (o, row) in w.chunks_exact(n_in).enumerate() {
        for i in 0..t {
            let xi = &x[i * n_in..(i + 1) * n_in];
            y[i * n_out + o] = xi
                .iter()
                .zip(row)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>() as f32;
        }
    }
    y
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    let mut out = Vec::with_capacity(x.len());
    for r in x.chunks(n) {
        let ms = (r.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64) as f32;
        let s = 1.0 / (ms + eps).sqrt();
        out.extend(r.iter().zip(w).map(|(&v, &g)| v * s * g));
    }
    out
}

/// RoPE on `[t, heads, head_dim]` at the given positions. llama's "normal" RoPE rotates
/// adjacent pairs (2i, 2i+1) — the converter permuted the GGUF's q/k rows for it; `neox`
/// (the planted bug) pairs (i, i + n_rot/2).
fn rope(x: &mut [f32], pos: &[usize], heads: usize, c: &Config, neox: bool) {
    let (hd, n_rot) = (c.head_dim, c.n_rot);
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let v = &mut x[(t * heads + h) * hd..][..hd];
            for i in 0..n_rot / 2 {
                let theta = p as f32 * c.rope_base.powf(-2.0 * i as f32 / n_rot as f32);
                let (cos, sin) = (theta.cos(), theta.sin());
                let (a, b) = if neox {
                    (i, i + n_rot / 2)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * cos - x1 * sin;
                v[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The engine: a model and its KV cache, one `step` per golden step.
pub struct Engine<'m> {
    m: &'m Model,
    bug: Option<Bug>,
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
}

fn tap_err(e: parity_trace::Error) -> String {
    e.to_string()
}

impl<'m> Engine<'m> {
    pub fn new(m: &'m Model, bug: Option<Bug>) -> Engine<'m> {
        let n = m.config.n_layer;
        Engine {
            m,
            bug,
            k_cache: vec![Vec::new(); n],
            v_cache: vec![Vec::new(); n],
        }
    }

    /// Run `ids` at `pos` (continuing the cache) and record every tap of the step.
    pub fn step(&mut self, ids: &[u32], pos: &[usize], w: &mut TraceWriter) -> Result<(), String> {
        let m = self.m;
        let c = &m.config;
        let (e, hd, nh, nkv, nff) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv, c.n_ff);
        let t = ids.len();
        let cached = self.k_cache.first().map_or(0, |k| k.len() / (nkv * hd));
        if pos.len() != t || pos.iter().enumerate().any(|(i, &p)| p != cached + i) {
            return Err(format!(
                "positions {pos:?} do not continue the {cached} cached ones"
            ));
        }
        w.step(ids, pos).map_err(tap_err)?;

        let mut x = Vec::with_capacity(t * e);
        for &id in ids {
            let row = m
                .token_embd
                .chunks_exact(e)
                .nth(id as usize)
                .ok_or_else(|| format!("token id {id} is past the vocabulary ({})", c.n_vocab))?;
            x.extend_from_slice(row);
        }
        w.tap(None, "embd", &[t, e], &x).map_err(tap_err)?;

        for (l, lw) in m.layers.iter().enumerate() {
            let xn = rms_norm(&x, &lw.attn_norm, c.rms_eps);
            w.tap(l, "attn_norm", &[t, e], &xn).map_err(tap_err)?;
            let mut q = matmul(&lw.wq, &xn, t);
            let mut k = matmul(&lw.wk, &xn, t);
            let v = matmul(&lw.wv, &xn, t);
            w.tap(l, "q", &[t, nh, hd], &q).map_err(tap_err)?;
            w.tap(l, "k", &[t, nkv, hd], &k).map_err(tap_err)?;
            w.tap(l, "v", &[t, nkv, hd], &v).map_err(tap_err)?;
            let neox = self.bug == Some(Bug::RopeNeox);
            rope(&mut q, pos, nh, c, neox);
            rope(&mut k, pos, nkv, c, neox);
            w.tap(l, "q_rope", &[t, nh, hd], &q).map_err(tap_err)?;
            w.tap(l, "k_rope", &[t, nkv, hd], &k).map_err(tap_err)?;

            // Causal attention over the cache (GQA: query head h reads kv head h / group).
            self.k_cache[l].extend_from_slice(&k);
            self.v_cache[l].extend_from_slice(&v);
            let (kc, vc) = (&self.k_cache[l], &self.v_cache[l]);
            let n_kv = kc.len() / (nkv * hd);
            let p0 = n_kv - t;
            let scale = if self.bug == Some(Bug::NoAttnScale) {
                1.0
            } else {
                1.0 / (hd as f32).sqrt()
            };
            let mut probs = vec![0.0f32; nh * t * n_kv];
            let mut att = vec![0.0f32; t * nh * hd];
            for h in 0..nh {
                let kh = if self.bug == Some(Bug::GqaModulo) {
                    h % nkv
                } else {
                    h / (nh / nkv)
                };
                for i in 0..t {
                    let qv = &q[(i * nh + h) * hd..][..hd];
                    let p = &mut probs[(h * t + i) * n_kv..][..n_kv];
                    let seen = p0 + i + 1;
                    for (j, pj) in p.iter_mut().enumerate().take(seen) {
                        let kv = &kc[(j * nkv + kh) * hd..][..hd];
                        let d: f64 = qv.iter().zip(kv).map(|(&a, &b)| a as f64 * b as f64).sum();
                        *pj = d as f32 * scale;
                    }
                    let max = p[..seen].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f64;
                    for v in &mut p[..seen] {
                        *v = (*v - max).exp();
                        sum += *v as f64;
                    }
                    p[..seen]
                        .iter_mut()
                        .for_each(|v| *v = (*v as f64 / sum) as f32);
                    for d in 0..hd {
                        att[(i * nh + h) * hd + d] = (0..seen)
                            .map(|j| p[j] as f64 * vc[(j * nkv + kh) * hd + d] as f64)
                            .sum::<f64>()
                            as f32;
                    }
                }
            }
            w.tap(l, "kq_soft_max", &[nh, t, n_kv], &probs)
                .map_err(tap_err)?;
            w.tap(l, "kqv_out", &[t, nh * hd], &att).map_err(tap_err)?;
            let attn_out = matmul(&lw.wo, &att, t);
            w.tap(l, "attn_out", &[t, e], &attn_out).map_err(tap_err)?;
            let ffn_inp = add(&x, &attn_out);
            w.tap(l, "ffn_inp", &[t, e], &ffn_inp).map_err(tap_err)?;

            let xn = rms_norm(&ffn_inp, &lw.ffn_norm, c.rms_eps);
            w.tap(l, "ffn_norm", &[t, e], &xn).map_err(tap_err)?;
            let gate = matmul(&lw.w_gate, &xn, t);
            w.tap(l, "ffn_gate", &[t, nff], &gate).map_err(tap_err)?;
            let up = matmul(&lw.w_up, &xn, t);
            w.tap(l, "ffn_up", &[t, nff], &up).map_err(tap_err)?;
            let act: Vec<f32> = if self.bug == Some(Bug::SwigluSwap) {
                gate.iter().zip(&up).map(|(&g, &u)| silu(u) * g).collect()
            } else {
                gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect()
            };
            w.tap(l, "ffn_act", &[t, nff], &act).map_err(tap_err)?;
            let ffn_out = matmul(&lw.w_down, &act, t);
            w.tap(l, "ffn_out", &[t, e], &ffn_out).map_err(tap_err)?;
            x = add(&ffn_inp, &ffn_out);
            w.tap(l, "l_out", &[t, e], &x).map_err(tap_err)?;
        }
        let xn = rms_norm(&x, &m.output_norm, c.rms_eps);
        w.tap(None, "result_norm", &[t, e], &xn).map_err(tap_err)?;
        let out = match (&m.output, self.bug) {
            (Some(o), b) if b != Some(Bug::TiedOutput) => o,
            _ => &m.token_embd,
        };
        let logits = matmul(out, &xn, t);
        w.tap(None, "logits", &[t, c.n_vocab], &logits)
            .map_err(tap_err)?;
        Ok(())
    }
}

/// Run the golden's steps (its `manifest.json` bytes) through the model (the GGUF's bytes),
/// recording every tap in `w`. `bug`: a planted bug by name ([`Bug::ALL`]).
pub fn run(
    gguf: &[u8],
    golden_manifest: &[u8],
    w: &mut TraceWriter,
    bug: Option<&str>,
) -> Result<(), String> {
    let bug = bug.map(Bug::parse).transpose()?;
    let g = Gguf::parse(gguf)?;
    let model = Model::load(&g)?;
    let steps = parity_trace::golden_steps(golden_manifest, "manifest.json").map_err(tap_err)?;
    // The settings as JSON text, parsed into the writer's own value type.
    let settings = format!(
        r#"{{"dot": "f64 accumulation", "bug": {}}}"#,
        bug.map_or("null".to_string(), |b| format!("\"{}\"", b.name()))
    );
    w.set_producer(
        env!("CARGO_PKG_VERSION"),
        settings.parse().map_err(|e| format!("settings: {e}"))?,
    );
    let mut engine = Engine::new(&model, bug);
    for s in &steps {
        engine.step(&s.tokens, &s.positions, w)?;
    }
    Ok(())
}

/// The model reference a trace records for a GGUF held in memory: `path` as given, its
/// SHA-256 and size (what `parity diff` finds the model by).
pub fn model_ref(path: &str, gguf: &[u8]) -> ModelRef {
    let mut h = parity_trace::sha256::Sha256::new();
    h.update(gguf);
    ModelRef {
        path: path.to_string(),
        sha256: h.hex(),
        size: Some(gguf.len() as u64),
    }
}

/// [`run`] into an in-memory trace: the `.npz` archive's bytes.
pub fn trace_archive(
    model: ModelRef,
    backend: &str,
    gguf: &[u8],
    golden_manifest: &[u8],
    bug: Option<&str>,
) -> Result<Vec<u8>, String> {
    let mut w = TraceWriter::in_memory(model, "toy-engine", backend);
    run(gguf, golden_manifest, &mut w, bug)?;
    w.finish_archive().map_err(tap_err)
}

// ---------------------------------------------------------------------------------------------
// wasm32 entry points: plain `extern "C"`, no imports. The host copies the model and the
// golden's manifest into memory from `alloc`, calls `trace`, then reads `result_len` bytes at
// `result_ptr`: the `.npz` archive (trace returned 0) or the error text (1).

#[cfg(target_arch = "wasm32")]
mod wasm {
    use std::alloc::Layout;
    use std::sync::Mutex;

    /// The last `trace` call's archive or error text.
    static RESULT: Mutex<Vec<u8>> = Mutex::new(Vec::new());

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), 8).expect("a wasm32 buffer")
    }

    /// `len` bytes for the host to write into (null when memory cannot grow).
    #[unsafe(no_mangle)]
    pub extern "C" fn alloc(len: usize) -> *mut u8 {
        // SAFETY: the layout has a non-zero size.
        unsafe { std::alloc::alloc(layout(len)) }
    }

    /// Free a buffer `alloc(len)` returned.
    ///
    /// # Safety
    /// `ptr` comes from `alloc(len)` with the same `len`, and is freed once.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn dealloc(ptr: *mut u8, len: usize) {
        if !ptr.is_null() {
            // SAFETY: the caller's contract.
            unsafe { std::alloc::dealloc(ptr, layout(len)) }
        }
    }

    /// # Safety
    /// `ptr` points at `len` readable bytes (any pointer when `len` is 0).
    unsafe fn bytes<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
        if len == 0 || ptr.is_null() {
            &[]
        } else {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts(ptr, len) }
        }
    }

    /// Run the engine on the GGUF and the golden's `manifest.json`, with the planted bug
    /// named by `bug` (`bug_len` 0: none). 0: the result is the `.npz` archive; 1: the
    /// result is the error text.
    ///
    /// # Safety
    /// Each (pointer, length) pair names readable memory, as from `alloc`.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn trace(
        gguf_ptr: *const u8,
        gguf_len: usize,
        manifest_ptr: *const u8,
        manifest_len: usize,
        bug_ptr: *const u8,
        bug_len: usize,
    ) -> i32 {
        // SAFETY: the caller's contract.
        let (gguf, manifest, bug) = unsafe {
            (
                bytes(gguf_ptr, gguf_len),
                bytes(manifest_ptr, manifest_len),
                bytes(bug_ptr, bug_len),
            )
        };
        let r = match std::str::from_utf8(bug) {
            Err(_) => Err("the bug name is not UTF-8".to_string()),
            Ok(b) => super::trace_archive(
                super::model_ref("model.gguf", gguf),
                "wasm32-f32",
                gguf,
                manifest,
                (!b.is_empty()).then_some(b),
            ),
        };
        let (code, out) = match r {
            Ok(a) => (0, a),
            Err(e) => (1, e.into_bytes()),
        };
        *RESULT.lock().unwrap_or_else(|e| e.into_inner()) = out;
        code
    }

    /// Where the last result starts.
    #[unsafe(no_mangle)]
    pub extern "C" fn result_ptr() -> *const u8 {
        RESULT.lock().unwrap_or_else(|e| e.into_inner()).as_ptr()
    }

    /// The last result's length in bytes.
    #[unsafe(no_mangle)]
    pub extern "C" fn result_len() -> usize {
        RESULT.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF header: magic, version, counts, then `kv` and `tensors` bytes as given.
    fn gguf(n_kv: u64, kv: &[u8], n_t: u64, tensors: &[u8]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_t.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b.extend(kv);
        b.extend(tensors);
        b
    }

    fn s(x: &str) -> Vec<u8> {
        let mut b = (x.len() as u64).to_le_bytes().to_vec();
        b.extend(x.as_bytes());
        b
    }

    #[test]
    fn skips_every_value_type_and_reads_scalars() {
        let mut kv = Vec::new();
        for (i, (ty, val)) in [
            (0u32, vec![7u8]),
            (1, vec![0xff]),
            (2, 3u16.to_le_bytes().to_vec()),
            (3, (-3i16).to_le_bytes().to_vec()),
            (4, 9u32.to_le_bytes().to_vec()),
            (5, (-9i32).to_le_bytes().to_vec()),
            (6, 1.5f32.to_le_bytes().to_vec()),
            (7, vec![1]),
            (8, s("hi")),
            (10, 11u64.to_le_bytes().to_vec()),
            (11, (-11i64).to_le_bytes().to_vec()),
            (12, 2.5f64.to_le_bytes().to_vec()),
        ]
        .into_iter()
        .enumerate()
        {
            kv.extend(s(&format!("k{i}")));
            kv.extend(ty.to_le_bytes());
            kv.extend(val);
        }
        // An array of strings and an array of arrays of u16.
        kv.extend(s("strs"));
        kv.extend(9u32.to_le_bytes());
        kv.extend(8u32.to_le_bytes());
        kv.extend(2u64.to_le_bytes());
        kv.extend(s("a"));
        kv.extend(s("bc"));
        kv.extend(s("nested"));
        kv.extend(9u32.to_le_bytes());
        kv.extend(9u32.to_le_bytes());
        kv.extend(1u64.to_le_bytes());
        kv.extend(2u32.to_le_bytes());
        kv.extend(2u64.to_le_bytes());
        kv.extend([1, 0, 2, 0]);
        let b = gguf(14, &kv, 0, &[]);
        let g = Gguf::parse(&b).unwrap();
        assert_eq!(g.get("k1"), Some(&Meta::Int(-1)));
        assert_eq!(g.get("k6"), Some(&Meta::Float(1.5)));
        assert_eq!(g.get("k8"), Some(&Meta::Str("hi".into())));
        assert_eq!(
            g.get("strs"),
            Some(&Meta::Array {
                elem_type: 8,
                len: 2
            })
        );
        assert_eq!(g.alignment, 32);
        assert_eq!(g.data_start, b.len().next_multiple_of(32) as u64);
        // Every truncation is an error, never a panic.
        for n in 0..b.len() {
            assert!(Gguf::parse(&b[..n]).is_err(), "{n}");
        }
    }

    #[test]
    fn refuses_lying_lengths_and_other_types() {
        let mut kv = s("big");
        kv.extend(9u32.to_le_bytes());
        kv.extend(8u32.to_le_bytes());
        kv.extend(u64::MAX.to_le_bytes());
        let e = Gguf::parse(&gguf(1, &kv, 0, &[])).err().unwrap();
        assert!(e.contains("truncated"), "{e}");
        let mut kv = s("big");
        kv.extend(9u32.to_le_bytes());
        kv.extend(10u32.to_le_bytes());
        kv.extend(u64::MAX.to_le_bytes());
        let e = Gguf::parse(&gguf(1, &kv, 0, &[])).err().unwrap();
        assert!(e.contains("overflows"), "{e}");
        let mut kv = s("x");
        kv.extend(13u32.to_le_bytes());
        let e = Gguf::parse(&gguf(1, &kv, 0, &[])).err().unwrap();
        assert!(e.contains("unknown value type 13"), "{e}");

        let mut t = s("w");
        t.extend(1u32.to_le_bytes());
        t.extend(4u64.to_le_bytes());
        t.extend(8u32.to_le_bytes()); // Q8_0
        t.extend(0u64.to_le_bytes());
        let mut b = gguf(0, &[], 1, &t);
        b.resize(b.len().next_multiple_of(32) + 64, 0);
        let e = Gguf::parse(&b).err().unwrap();
        assert!(e.contains("Q8_0") && e.contains("F32 tensors only"), "{e}");

        let mut t = s("w");
        t.extend(2u32.to_le_bytes());
        t.extend(4u64.to_le_bytes());
        t.extend(u64::MAX.to_le_bytes());
        t.extend(0u32.to_le_bytes());
        t.extend(0u64.to_le_bytes());
        let e = Gguf::parse(&gguf(0, &[], 1, &t)).err().unwrap();
        assert!(e.contains("overflows"), "{e}");
        let mut t = s("w");
        t.extend(1u32.to_le_bytes());
        t.extend(1000u64.to_le_bytes());
        t.extend(0u32.to_le_bytes());
        t.extend(0u64.to_le_bytes());
        let e = Gguf::parse(&gguf(0, &[], 1, &t)).err().unwrap();
        assert!(e.contains("past the end"), "{e}");
    }

    #[test]
    fn bugs_parse_by_name() {
        for (n, b) in Bug::ALL {
            assert_eq!(Bug::parse(n), Ok(b));
            assert_eq!(b.name(), n);
        }
        assert!(Bug::parse("nope").unwrap_err().contains("rope-neox"));
    }
}
