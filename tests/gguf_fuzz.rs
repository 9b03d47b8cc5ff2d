//! Fuzzing the GGUF reader: a seeded, deterministic mutation loop over `GgufFile::from_bytes`.
//!
//! Seeds are small valid files made with `GgufWriter` (metadata with scalars, strings, arrays and
//! nested arrays; 0 to 4 tensors of mixed types and alignments) plus, when `../shared` is present,
//! the real files there: each model's header with its tensors shrunk to one block (a valid file
//! with real metadata and a real tensor index), and the first 64 KiB of the vocab-only and legacy
//! files. Each case stacks one to five mutations:
//! structure-aware ones (a count, length, type id, dim or offset set to a boundary value, one
//! field copied onto another, one name copied onto another of the same length) and blind ones
//! (truncation, bit flips, boundary u32/u64 anywhere, splices, duplicated, deleted and inserted
//! ranges, crossover with another seed).
//!
//! Every case must return an error with a one-line message, or a file whose every tensor slice and
//! metadata value can be touched, with consistent invariants, and that the writer writes back to a
//! file that reads the same. Never a panic, and no single allocation above 64 MiB + the input size
//! (a counting global allocator watches).
//!
//! `PARITY_FUZZ_CASES` sets the number of cases (default 300,000), `PARITY_FUZZ_SEED` the master
//! seed; a failing case is printed with its number and written under `CARGO_TARGET_TMPDIR`, and
//! `PARITY_FUZZ_ONLY=<case>` replays just that case.

use crate::common::alloc::largest_allocation;
use parity::gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType};
use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::time::Instant;

const ALLOC_LIMIT: usize = 64 << 20;

// ---------------------------------------------------------------------------------------------
// A small deterministic RNG (splitmix64).

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds.

fn filler(n: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.next() as u8).collect()
}

fn add(w: &mut GgufWriter, name: &str, dims: &[u64], ty: GgmlType, seed: u64) {
    let n = ty.bytes_for(dims.iter().product()).unwrap() as usize;
    w.add_tensor(name, dims, ty, filler(n, seed));
}

fn strings(items: &[&str]) -> Value {
    Value::Array(
        ValueType::String,
        items.iter().map(|s| Value::String(s.to_string())).collect(),
    )
}

fn writer_seeds() -> Vec<(String, Vec<u8>)> {
    use Value as V;
    use ValueType as T;
    let mut seeds = Vec::new();

    // A miniature llama: the usual keys, a tokenizer, four tensors of mixed types.
    let mut w = GgufWriter::new();
    w.set("general.architecture", V::String("llama".into()));
    w.set("general.name", V::String("fuzz seed".into()));
    w.set("llama.block_count", V::U32(1));
    w.set("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5));
    w.set("llama.rope.freq_base", V::F32(10000.0));
    w.set("tokenizer.ggml.model", V::String("llama".into()));
    w.set(
        "tokenizer.ggml.tokens",
        strings(&["<unk>", "<s>", "</s>", "▁a", "b", ""]),
    );
    w.set(
        "tokenizer.ggml.scores",
        V::Array(T::F32, (0..6).map(|i| V::F32(-(i as f32))).collect()),
    );
    w.set(
        "tokenizer.ggml.token_type",
        V::Array(T::I32, (0..6).map(|i| V::I32(i % 3)).collect()),
    );
    w.set("tokenizer.ggml.add_bos_token", V::Bool(true));
    add(&mut w, "token_embd.weight", &[32, 4], GgmlType::Q8_0, 1);
    add(&mut w, "blk.0.attn_norm.weight", &[32], GgmlType::F32, 2);
    add(
        &mut w,
        "blk.0.ffn_down.weight",
        &[256, 2],
        GgmlType::Q4_K,
        3,
    );
    add(&mut w, "output.weight", &[32, 4], GgmlType::F16, 4);
    seeds.push(("llama".to_string(), w.to_bytes()));

    // Alignment 64, every scalar type, a 4-dim tensor.
    let mut w = GgufWriter::new();
    w.set("general.alignment", V::U32(64));
    w.set("s.u8", V::U8(7));
    w.set("s.i8", V::I8(-7));
    w.set("s.u16", V::U16(700));
    w.set("s.i16", V::I16(-700));
    w.set("s.u64", V::U64(1 << 40));
    w.set("s.i64", V::I64(-1));
    w.set("s.f64", V::F64(0.5));
    w.set("s.bool", V::Bool(false));
    add(&mut w, "t.bf16", &[8, 2, 2, 2], GgmlType::BF16, 5);
    add(&mut w, "t.q6k", &[256], GgmlType::Q6_K, 6);
    seeds.push(("align64".to_string(), w.to_bytes()));

    // Version 2, two tensors whose names have the same length (copying one onto the other makes
    // a duplicate), one string.
    let mut w = GgufWriter::new();
    w.set("general.architecture", V::String("llama".into()));
    w.set("general.file_type", V::U32(2));
    add(&mut w, "blk.0.a", &[32], GgmlType::Q4_0, 7);
    add(&mut w, "blk.0.b", &[32, 2], GgmlType::IQ4_NL, 8);
    let mut b = w.to_bytes();
    b[4..8].copy_from_slice(&2u32.to_le_bytes());
    seeds.push(("v2".to_string(), b));

    // Metadata only: every array shape, nested and empty arrays.
    let mut w = GgufWriter::new();
    w.set("a.u8", V::Array(T::U8, vec![V::U8(1), V::U8(2)]));
    w.set(
        "a.bool",
        V::Array(T::Bool, vec![V::Bool(true), V::Bool(false)]),
    );
    w.set("a.u64", V::Array(T::U64, vec![V::U64(3)]));
    w.set("a.f64", V::Array(T::F64, vec![V::F64(1.0), V::F64(-1.0)]));
    w.set("a.i16", V::Array(T::I16, vec![V::I16(-2)]));
    w.set("a.str", strings(&["x", "yy", ""]));
    w.set("a.empty", V::Array(T::U32, vec![]));
    w.set("a.empty_arr", V::Array(T::Array, vec![]));
    w.set(
        "a.nested",
        V::Array(
            T::Array,
            vec![
                V::Array(T::U32, vec![V::U32(1)]),
                V::Array(
                    T::Array,
                    vec![V::Array(T::String, vec![V::String("deep".into())])],
                ),
                V::Array(T::I8, vec![]),
            ],
        ),
    );
    seeds.push(("metadata".to_string(), w.to_bytes()));

    // Alignment 1: tensors packed back to back (an offset nudge makes them overlap).
    let mut w = GgufWriter::new();
    w.set("general.alignment", V::U32(1));
    add(&mut w, "p.q5_0", &[32], GgmlType::Q5_0, 9);
    add(&mut w, "p.q5_1", &[64], GgmlType::Q5_1, 10);
    add(&mut w, "p.q6_k", &[256], GgmlType::Q6_K, 11);
    add(&mut w, "p.iq4x", &[256], GgmlType::IQ4_XS, 12);
    seeds.push(("align1".to_string(), w.to_bytes()));

    // Minimal: no metadata, one one-element tensor; and a header with nothing at all.
    let mut w = GgufWriter::new();
    add(&mut w, "x", &[1], GgmlType::F32, 13);
    seeds.push(("minimal".to_string(), w.to_bytes()));
    seeds.push(("empty".to_string(), GgufWriter::new().to_bytes()));

    for (name, b) in &seeds {
        GgufFile::from_bytes(b.clone()).unwrap_or_else(|e| panic!("seed {name} invalid: {e}"));
    }
    seeds
}

/// Seeds from the real files, when ../shared is present: each model's header with its tensors
/// shrunk to one block each (so the seed is a valid file with real metadata and a real tensor
/// index), and the leading bytes of the vocab-only and legacy files.
fn real_seeds() -> Vec<(String, Vec<u8>)> {
    const CAP: usize = 64 << 10;
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared");
    if !shared.is_dir() {
        println!(
            "note: {} is absent; fuzzing writer-made seeds only",
            shared.display()
        );
        return Vec::new();
    }
    let mut out = Vec::new();
    for sub in ["models", "vocab", "legacy"] {
        let Ok(rd) = std::fs::read_dir(shared.join(sub)) else {
            continue;
        };
        let mut paths: Vec<_> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        paths.sort();
        for p in paths {
            let Ok(bytes) = std::fs::read(&p) else {
                continue;
            };
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            match shrink(&bytes, CAP) {
                Some(small) => out.push((name, small)),
                None => out.push((name, bytes[..bytes.len().min(CAP)].to_vec())),
            }
        }
    }
    out
}

/// A valid file with `bytes`' metadata and tensor index, every tensor cut down to one block
/// (dims `[block, 1, …]`) and packed; None when `bytes` has no tensors, does not parse, or its
/// header is longer than `cap`.
fn shrink(bytes: &[u8], cap: usize) -> Option<Vec<u8>> {
    let f = GgufFile::from_bytes(bytes.to_vec()).ok()?;
    let header_len = f.data_offset as usize;
    if f.tensors.is_empty() || header_len > cap {
        return None;
    }
    let mut header = bytes[..header_len].to_vec();
    let mut w = Walker {
        b: &header,
        pos: 0,
        out: Vec::new(),
    };
    w.file()?;
    let dims: Vec<usize> = w
        .out
        .iter()
        .filter(|x| x.kind == Kind::Dim)
        .map(|x| x.pos)
        .collect();
    let offsets: Vec<usize> = w
        .out
        .iter()
        .filter(|x| x.kind == Kind::Offset)
        .map(|x| x.pos)
        .collect();
    let mut dims = dims.into_iter();
    let mut next = 0u64;
    for (t, &at) in f.tensors.iter().zip(&offsets) {
        for d in 0..t.dims.len() {
            let v = if d == 0 { t.ty.block_size() as u64 } else { 1 };
            write_uint(&mut header, dims.next()?, 8, v);
        }
        write_uint(&mut header, at, 8, next);
        next = (next + t.ty.type_size() as u64).div_ceil(f.alignment) * f.alignment;
    }
    header.extend(filler(next as usize, header_len as u64));
    GgufFile::from_bytes(header.clone()).ok()?;
    Some(header)
}

// ---------------------------------------------------------------------------------------------
// A tolerant walker that records where each structural field of a seed lies.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Version,
    TensorCount,
    KvCount,
    StrLen,
    ValueType,
    ArrayType,
    ArrayLen,
    Bool,
    NDims,
    Dim,
    TensorType,
    Offset,
}

impl Kind {
    fn width(self) -> usize {
        match self {
            Kind::Bool => 1,
            Kind::Version | Kind::ValueType | Kind::ArrayType | Kind::NDims | Kind::TensorType => 4,
            _ => 8,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Field {
    pos: usize,
    kind: Kind,
}

struct Walker<'a> {
    b: &'a [u8],
    pos: usize,
    out: Vec<Field>,
}

impl Walker<'_> {
    fn take(&mut self, n: u64) -> Option<&[u8]> {
        let end = self.pos.checked_add(usize::try_from(n).ok()?)?;
        let s = self.b.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    fn record(&mut self, kind: Kind) {
        if self.out.len() < 100_000 {
            self.out.push(Field {
                pos: self.pos,
                kind,
            });
        }
    }
    fn u32(&mut self, kind: Kind) -> Option<u32> {
        self.record(kind);
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self, kind: Kind) -> Option<u64> {
        self.record(kind);
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn string(&mut self) -> Option<()> {
        let n = self.u64(Kind::StrLen)?;
        self.take(n).map(|_| ())
    }
    fn value(&mut self, ty: u32, depth: u32) -> Option<()> {
        match ty {
            0 | 1 => self.take(1).map(|_| ()),
            7 => {
                self.record(Kind::Bool);
                self.take(1).map(|_| ())
            }
            2 | 3 => self.take(2).map(|_| ()),
            4..=6 => self.take(4).map(|_| ()),
            10..=12 => self.take(8).map(|_| ()),
            8 => self.string(),
            9 if depth < 8 => {
                let et = self.u32(Kind::ArrayType)?;
                let n = self.u64(Kind::ArrayLen)?;
                for _ in 0..n {
                    self.value(et, depth + 1)?;
                }
                Some(())
            }
            _ => None,
        }
    }
    fn file(&mut self) -> Option<()> {
        self.take(4)?;
        self.u32(Kind::Version)?;
        let n_tensors = self.u64(Kind::TensorCount)?;
        let n_kv = self.u64(Kind::KvCount)?;
        for _ in 0..n_kv {
            self.string()?;
            let ty = self.u32(Kind::ValueType)?;
            self.value(ty, 0)?;
        }
        for _ in 0..n_tensors {
            self.string()?;
            let nd = self.u32(Kind::NDims)?;
            if nd > 4 {
                return None;
            }
            for _ in 0..nd {
                self.u64(Kind::Dim)?;
            }
            self.u32(Kind::TensorType)?;
            self.u64(Kind::Offset)?;
        }
        Some(())
    }
}

struct Seed {
    name: String,
    bytes: Vec<u8>,
    /// Fields grouped by kind, so every kind gets picked equally often.
    fields: BTreeMap<Kind, Vec<usize>>,
    /// String fields (position of the length) grouped by string length.
    strings_by_len: BTreeMap<u64, Vec<usize>>,
}

impl Seed {
    fn new(name: String, bytes: Vec<u8>) -> Seed {
        let mut w = Walker {
            b: &bytes,
            pos: 0,
            out: Vec::new(),
        };
        let _ = w.file();
        let mut fields: BTreeMap<Kind, Vec<usize>> = BTreeMap::new();
        let mut strings_by_len: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for f in &w.out {
            if f.pos + f.kind.width() > bytes.len() {
                continue;
            }
            fields.entry(f.kind).or_default().push(f.pos);
            if f.kind == Kind::StrLen {
                let n = read_u64(&bytes, f.pos);
                if f.pos as u64 + 8 + n <= bytes.len() as u64 {
                    strings_by_len.entry(n).or_default().push(f.pos);
                }
            }
        }
        strings_by_len.retain(|_, v| v.len() > 1);
        Seed {
            name,
            bytes,
            fields,
            strings_by_len,
        }
    }
}

fn read_u64(b: &[u8], pos: usize) -> u64 {
    u64::from_le_bytes(b[pos..pos + 8].try_into().unwrap())
}

fn read_u32(b: &[u8], pos: usize) -> u32 {
    u32::from_le_bytes(b[pos..pos + 4].try_into().unwrap())
}

// ---------------------------------------------------------------------------------------------
// Mutations.

fn boundary_u64(r: &mut Rng, len: u64, orig: u64) -> u64 {
    match r.below(24) {
        0 => 0,
        1 => 1,
        2 => 2,
        3 => u64::MAX,
        4 => u64::MAX - 1,
        5 => u64::MAX / 2 + 1,
        6 => 1 << 40,
        7 => 1 << 32,
        8 => u32::MAX as u64,
        9 => len,
        10 => len + 1,
        11 => len.saturating_sub(1),
        12 => len / 2,
        13 => len / 13 + 1,
        14 => len / 28 + 1,
        15 => orig.wrapping_add(1),
        16 => orig.wrapping_sub(1),
        17 => orig.wrapping_mul(2),
        18 => orig << 8,
        19 => orig ^ (1 << r.below(64)),
        20 => (r.next() % len.max(1)) & !31,
        21 => len & !31,
        22 => r.next() % 1024,
        _ => r.next(),
    }
}

fn boundary_u32(r: &mut Rng, len: u64, orig: u32) -> u32 {
    match r.below(14) {
        0 => 0,
        1 => 1,
        2 => u32::MAX,
        3 => 1 << 31,
        4 => 4,
        5 => 5,
        6 => 13,
        7 => 99,
        8 => len as u32,
        9 => orig.wrapping_add(1),
        10 => orig.wrapping_sub(1),
        11 => r.below(40) as u32,
        12 => orig ^ (1 << r.below(32)),
        _ => r.next() as u32,
    }
}

fn write_uint(b: &mut [u8], pos: usize, width: usize, v: u64) {
    b[pos..pos + width].copy_from_slice(&v.to_le_bytes()[..width]);
}

/// A structure-aware mutation of `b`, which still has the seed's layout.
fn mutate_field(r: &mut Rng, seed: &Seed, b: &mut [u8], log: &mut Vec<String>) {
    let len = b.len() as u64;
    // Sometimes copy one string onto another of the same length (duplicate keys / names).
    if !seed.strings_by_len.is_empty() && r.chance(8) {
        let groups: Vec<(&u64, &Vec<usize>)> = seed.strings_by_len.iter().collect();
        let (&n, g) = *r.pick(&groups);
        let (from, to, n) = (*r.pick(g) + 8, *r.pick(g) + 8, n as usize);
        b.copy_within(from..from + n, to);
        log.push(format!("copy {n}-byte string @{from} onto @{to}"));
        return;
    }
    let kinds: Vec<Kind> = seed.fields.keys().copied().collect();
    if kinds.is_empty() {
        return;
    }
    let kind = *r.pick(&kinds);
    let pos = *r.pick(&seed.fields[&kind]);
    let width = kind.width();
    // Sometimes copy another field of the same kind (two tensors at one offset, …).
    if r.chance(10) {
        let other = *r.pick(&seed.fields[&kind]);
        let src = b[other..other + width].to_vec();
        b[pos..pos + width].copy_from_slice(&src);
        log.push(format!("copy {kind:?} @{other} onto @{pos}"));
        return;
    }
    let v = match kind {
        Kind::Bool => *r.pick(&[0u64, 1, 2, 0x80, 0xff]),
        Kind::NDims => *r.pick(&[0u64, 1, 2, 3, 4, 5, 64, u32::MAX as u64]),
        Kind::Version => *r.pick(&[0u64, 1, 2, 3, 4, 99, u32::MAX as u64, 3 << 24]),
        Kind::Dim => match r.below(3) {
            0 => *r.pick(&[0u64, 1, 31, 32, 48, 256, 4096, 1 << 24, 1 << 31]),
            _ => boundary_u64(r, len, read_u64(b, pos)),
        },
        Kind::Offset if r.chance(40) => {
            // Aligned or nearly aligned values near the end of the file.
            let a = *r.pick(&[1u64, 32, 64]);
            (len.saturating_sub(r.below(512) as u64) & !(a - 1)).wrapping_add(r.below(2) as u64)
        }
        _ if width == 4 => boundary_u32(r, len, read_u32(b, pos)) as u64,
        _ => boundary_u64(r, len, read_u64(b, pos)),
    };
    write_uint(b, pos, width, v);
    log.push(format!("{kind:?} @{pos} = {v}"));
}

/// A blind mutation; may change the length.
fn mutate_blind(r: &mut Rng, seeds: &[Seed], b: &mut Vec<u8>, log: &mut Vec<String>) {
    let len = b.len();
    if len == 0 {
        b.extend_from_slice(b"GGUF");
        return;
    }
    match r.below(10) {
        0 => {
            let n = r.below(len);
            b.truncate(n);
            log.push(format!("truncate to {n}"));
        }
        1 => {
            for _ in 0..1 + r.below(4) {
                let bit = r.below(len * 8);
                b[bit / 8] ^= 1 << (bit % 8);
                log.push(format!("flip bit {bit}"));
            }
        }
        2 => {
            let p = r.below(len);
            let random = r.next() as u8;
            b[p] = *r.pick(&[0u8, 1, 2, 0x7f, 0x80, 0xff, random]);
            log.push(format!("byte @{p}"));
        }
        3 if len >= 4 => {
            let p = r.below(len - 3);
            let orig = read_u32(b, p);
            let v = boundary_u32(r, len as u64, orig);
            write_uint(b, p, 4, v as u64);
            log.push(format!("u32 @{p} = {v}"));
        }
        4 if len >= 8 => {
            let p = r.below(len - 7);
            let orig = read_u64(b, p);
            let v = boundary_u64(r, len as u64, orig);
            write_uint(b, p, 8, v);
            log.push(format!("u64 @{p} = {v}"));
        }
        5 => {
            // Overwrite a range with a copy of another range.
            let n = 1 + r.below(64.min(len));
            let (from, to) = (r.below(len - n + 1), r.below(len - n + 1));
            b.copy_within(from..from + n, to);
            log.push(format!("copy {n} bytes @{from} -> @{to}"));
        }
        6 => {
            // Duplicate a range in place (everything after it shifts).
            let n = 1 + r.below(64.min(len));
            let from = r.below(len - n + 1);
            let chunk = b[from..from + n].to_vec();
            let to = r.below(len + 1);
            b.splice(to..to, chunk);
            log.push(format!("insert copy of {n} bytes @{from} at {to}"));
        }
        7 => {
            let n = 1 + r.below(32.min(len));
            let from = r.below(len - n + 1);
            b.drain(from..from + n);
            log.push(format!("delete {n} bytes @{from}"));
        }
        8 => {
            let n = 1 + r.below(16);
            let to = r.below(len + 1);
            let chunk: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
            b.splice(to..to, chunk);
            log.push(format!("insert {n} random bytes at {to}"));
        }
        _ => {
            // Crossover: overwrite with a piece of another seed at the same offset.
            let other = &r.pick(seeds).bytes;
            let end = len.min(other.len());
            if end > 0 {
                let from = r.below(end);
                let to = (from + 1 + r.below(256)).min(end);
                b[from..to].copy_from_slice(&other[from..to]);
                log.push(format!("crossover [{from}, {to})"));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Checking one case.

enum Outcome {
    Ok,
    Err(&'static str),
}

fn variant(e: &GgufError) -> &'static str {
    match e {
        GgufError::Io { .. } => "Io",
        GgufError::BadMagic(_) => "BadMagic",
        GgufError::Version1 => "Version1",
        GgufError::UnsupportedVersion(_) => "UnsupportedVersion",
        GgufError::Truncated { .. } => "Truncated",
        GgufError::BadValueType { .. } => "BadValueType",
        GgufError::BadMetadata { .. } => "BadMetadata",
        GgufError::DuplicateKey(_) => "DuplicateKey",
        GgufError::DuplicateTensor(_) => "DuplicateTensor",
        GgufError::UnknownTensorType { .. } => "UnknownTensorType",
        GgufError::BadTensor { .. } => "BadTensor",
        GgufError::Overlap { .. } => "Overlap",
        GgufError::Invalid(_) => "Invalid",
    }
}

/// Visit a value and everything in it; returns a checksum so nothing is optimized away.
fn touch_value(v: &Value, depth: u32) -> u64 {
    assert!(depth <= 64, "absurd nesting survived parsing");
    match v {
        Value::Array(t, items) => {
            let mut s = items.len() as u64;
            for it in items {
                if *t != ValueType::Array {
                    assert_eq!(it.value_type(), *t, "array element of the wrong type");
                }
                s = s.wrapping_add(touch_value(it, depth + 1));
            }
            s
        }
        Value::String(s) => s.len() as u64 + s.chars().count() as u64,
        other => {
            let _ = other.summary();
            other.as_f64().map(f64::to_bits).unwrap_or(1)
        }
    }
}

fn check_file(f: &GgufFile) -> u64 {
    assert!(f.version == 2 || f.version == 3);
    assert!(f.alignment.is_power_of_two());
    assert_eq!(f.data_offset % f.alignment, 0);
    let mut sum = 0u64;
    for (k, v) in &f.metadata {
        assert!(
            std::ptr::eq(f.get(k).expect("indexed key"), v),
            "key {k:?} not unique"
        );
        sum = sum.wrapping_add(touch_value(v, 0));
    }
    let all = f.bytes().as_ptr_range();
    let mut spans = Vec::new();
    for t in &f.tensors {
        let d = f.tensor_data(t);
        assert_eq!(d.len() as u64, t.n_bytes);
        let r = d.as_ptr_range();
        assert!(
            all.start <= r.start && r.end <= all.end,
            "tensor slice outside the file"
        );
        assert_eq!(t.offset % f.alignment, 0);
        assert!(!t.dims.is_empty() && t.dims.len() <= 4 && !t.dims.contains(&0));
        assert_eq!(t.ty.bytes_for(t.n_elements), Some(t.n_bytes));
        assert!(std::ptr::eq(f.tensor(&t.name).expect("indexed tensor"), t));
        sum = sum.wrapping_add(d.iter().map(|&x| x as u64).sum::<u64>());
        spans.push((t.offset, t.offset + t.n_bytes));
    }
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "overlapping tensors accepted");
    }
    rewrite_round_trip(f);
    sum
}

/// Bitwise equality for values (NaN payloads included).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(ta, va), Value::Array(tb, vb)) => {
            ta == tb && va.len() == vb.len() && va.iter().zip(vb).all(|(x, y)| same(x, y))
        }
        _ => a == b,
    }
}

/// Whatever the reader accepts, the writer must write back to a file that reads the same.
fn rewrite_round_trip(f: &GgufFile) {
    let mut w = GgufWriter::new();
    for (k, v) in &f.metadata {
        w.set(k, v.clone());
    }
    for t in &f.tensors {
        w.add_tensor(&t.name, &t.dims, t.ty, f.tensor_data(t).to_vec());
    }
    let g = GgufFile::from_bytes(w.to_bytes()).expect("the re-written file parses");
    assert_eq!(g.alignment, f.alignment);
    assert_eq!(g.metadata.len(), f.metadata.len());
    for ((ka, va), (kb, vb)) in f.metadata.iter().zip(&g.metadata) {
        assert!(
            ka == kb && same(va, vb),
            "metadata {ka:?} changed on re-writing"
        );
    }
    assert_eq!(g.tensors.len(), f.tensors.len());
    for (a, b) in f.tensors.iter().zip(&g.tensors) {
        assert!(a.name == b.name && a.dims == b.dims && a.ty == b.ty);
        assert_eq!(
            f.tensor_data(a),
            g.tensor_data(b),
            "tensor {:?} data",
            a.name
        );
    }
}

fn run_case(input: Vec<u8>) -> Outcome {
    match GgufFile::from_bytes(input) {
        Ok(f) => {
            std::hint::black_box(check_file(&f));
            Outcome::Ok
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.trim().is_empty(), "empty message: {e:?}");
            assert!(!msg.contains(['\n', '\r']), "message spans lines: {msg:?}");
            Outcome::Err(variant(&e))
        }
    }
}

/// Build case `i`: its seed index, the mutated bytes and a log of what was done.
fn make_case(
    master: u64,
    i: u64,
    seeds: &[Seed],
    n_writer: usize,
) -> (usize, Vec<u8>, Vec<String>) {
    let mut r = Rng::new(master ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03));
    // Writer seeds carry the tensor structure; the real headers carry real metadata.
    let s = if seeds.len() > n_writer && r.chance(25) {
        n_writer + r.below(seeds.len() - n_writer)
    } else {
        r.below(n_writer)
    };
    let seed = &seeds[s];
    let mut b = seed.bytes.clone();
    let mut log = Vec::new();
    let n_field = match r.below(10) {
        0..=2 => 0,
        3..=7 => 1,
        _ => 2,
    };
    for _ in 0..n_field {
        mutate_field(&mut r, seed, &mut b, &mut log);
    }
    let n_blind = match (n_field, r.below(10)) {
        (0, 0..=5) => 1,
        (0, _) => 2 + r.below(3),
        (_, 0..=5) => 0,
        (_, _) => 1,
    };
    for _ in 0..n_blind {
        mutate_blind(&mut r, seeds, &mut b, &mut log);
    }
    (s, b, log)
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .replace('_', "")
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
    )
}

#[test]
fn fuzz_from_bytes() {
    let cases = env_u64("PARITY_FUZZ_CASES").unwrap_or(300_000);
    let master = env_u64("PARITY_FUZZ_SEED").unwrap_or(0x6767_7566_5EED);
    let only = env_u64("PARITY_FUZZ_ONLY");

    let writer = writer_seeds();
    let n_writer = writer.len();
    let seeds: Vec<Seed> = writer
        .into_iter()
        .chain(real_seeds())
        .map(|(n, b)| Seed::new(n, b))
        .collect();

    let start = Instant::now();
    let mut ok = 0u64;
    let mut ran = 0u64;
    let mut by_variant: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut ok_by_seed: BTreeMap<&str, u64> = BTreeMap::new();
    let range = match only {
        Some(i) => i..i + 1,
        None => 0..cases,
    };
    for i in range {
        let (s, input, log) = make_case(master, i, &seeds, n_writer);
        let input_len = input.len();
        let copy = input.clone();
        let (result, largest) =
            largest_allocation(|| std::panic::catch_unwind(AssertUnwindSafe(|| run_case(input))));
        let failure = match &result {
            Err(_) => Some("panicked".to_string()),
            Ok(_) if largest > ALLOC_LIMIT + input_len => Some(format!(
                "allocated {largest} bytes at once ({input_len}-byte input)"
            )),
            Ok(_) => None,
        };
        if let Some(why) = failure {
            let out =
                Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("gguf-fuzz-case-{i}.gguf"));
            let _ = std::fs::write(&out, &copy);
            panic!(
                "case {i} (seed {:?}, master seed {master:#x}) {why}\nmutations: {log:?}\ninput written to {}\nreplay: PARITY_FUZZ_ONLY={i} PARITY_FUZZ_SEED={master}",
                seeds[s].name,
                out.display()
            );
        }
        ran += 1;
        match result.unwrap() {
            Outcome::Ok => {
                ok += 1;
                *ok_by_seed.entry(&seeds[s].name).or_default() += 1;
            }
            Outcome::Err(v) => *by_variant.entry(v).or_default() += 1,
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "gguf fuzz: {ran} cases in {secs:.1} s over {} seeds ({n_writer} writer-made): {ok} parsed OK, {} refused",
        seeds.len(),
        ran - ok
    );
    println!("  refused by variant: {by_variant:?}");
    println!("  parsed OK by seed: {ok_by_seed:?}");

    // The mutations must keep reaching deep into the format, not just bounce off the magic.
    if only.is_none() && cases >= 20_000 {
        assert!(ok > cases / 100, "too few mutated files parse ({ok})");
        for v in [
            "Truncated",
            "BadMagic",
            "UnsupportedVersion",
            "BadValueType",
            "BadMetadata",
            "DuplicateKey",
            "DuplicateTensor",
            "UnknownTensorType",
            "BadTensor",
            "Overlap",
            "Invalid",
        ] {
            assert!(
                by_variant.contains_key(v),
                "no case reached {v}: {by_variant:?}"
            );
        }
    }
}
