//! The GGUF reader's promise, tested: round trips through `GgufWriter` (every metadata value
//! type, nested and empty arrays, custom alignment, every tensor type), the real files in
//! `../shared` (skipped with a message when absent), targeted corruptions that must each give the
//! expected error variant with a one-line message, and zero-copy (tensor data is a slice of the
//! mapping; opening a large file allocates nothing proportional to it).

use crate::common::alloc::largest_allocation;
use parity::gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// Helpers.

/// Deterministic filler bytes.
fn filler(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn tensor_bytes(dims: &[u64], ty: GgmlType, seed: u64) -> Vec<u8> {
    let n: u64 = dims.iter().product();
    filler(ty.bytes_for(n).expect("whole blocks") as usize, seed)
}

/// Bitwise equality for values (so NaN payloads count as equal to themselves).
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

/// Parse, expect an error, check its message is one non-empty line, return it.
fn parse_err(bytes: Vec<u8>) -> GgufError {
    match GgufFile::from_bytes(bytes) {
        Ok(f) => panic!("expected an error, got a file: {f:?}"),
        Err(e) => {
            assert_one_line(&e);
            e
        }
    }
}

fn assert_one_line(e: &GgufError) {
    let msg = e.to_string();
    assert!(!msg.trim().is_empty(), "empty message for {e:?}");
    assert!(
        !msg.contains('\n') && !msg.contains('\r'),
        "message spans lines: {msg:?}"
    );
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    let hits: Vec<usize> = hay
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        hits.len(),
        1,
        "needle {:?} must occur once",
        String::from_utf8_lossy(needle)
    );
    hits[0]
}

fn put_u32(b: &mut [u8], pos: usize, v: u32) {
    b[pos..pos + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], pos: usize, v: u64) {
    b[pos..pos + 8].copy_from_slice(&v.to_le_bytes());
}

/// Byte position just after a key's text (where its u32 value type starts).
fn after_key(b: &[u8], key: &str) -> usize {
    find(b, key.as_bytes()) + key.len()
}

/// Field positions of one tensor-index entry.
struct TensorFields {
    name_len: usize,
    n_dims: usize,
    dims: usize,
    ty: usize,
    offset: usize,
}

fn tensor_fields(b: &[u8], name: &str) -> TensorFields {
    let at = find(b, name.as_bytes());
    let n_dims = at + name.len();
    let nd = u32::from_le_bytes(b[n_dims..n_dims + 4].try_into().unwrap()) as usize;
    TensorFields {
        name_len: at - 8,
        n_dims,
        dims: n_dims + 4,
        ty: n_dims + 4 + 8 * nd,
        offset: n_dims + 8 + 8 * nd,
    }
}

fn shared_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared");
    if dir.is_dir() {
        Some(dir)
    } else {
        println!(
            "skipping: {} is absent (the real GGUF files live there)",
            dir.display()
        );
        None
    }
}

fn gguf_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

// ---------------------------------------------------------------------------------------------
// Round trips.

fn every_value() -> Vec<(&'static str, Value)> {
    use Value as V;
    use ValueType as T;
    vec![
        ("v.u8", V::U8(250)),
        ("v.i8", V::I8(-128)),
        ("v.u16", V::U16(65535)),
        ("v.i16", V::I16(-32768)),
        ("v.u32", V::U32(4_000_000_000)),
        ("v.i32", V::I32(i32::MIN)),
        ("v.f32", V::F32(-1.5e-7)),
        ("v.f32_nan", V::F32(f32::from_bits(0x7fc0_1234))),
        ("v.bool_t", V::Bool(true)),
        ("v.bool_f", V::Bool(false)),
        ("v.str", V::String("héllo, wörld ✓ 🦙".into())),
        ("v.str_empty", V::String(String::new())),
        ("v.u64", V::U64(u64::MAX)),
        ("v.i64", V::I64(i64::MIN)),
        ("v.f64", V::F64(std::f64::consts::PI)),
        (
            "a.u8",
            V::Array(T::U8, vec![V::U8(0), V::U8(1), V::U8(255)]),
        ),
        ("a.i8", V::Array(T::I8, vec![V::I8(-1), V::I8(127)])),
        ("a.u16", V::Array(T::U16, vec![V::U16(7), V::U16(65535)])),
        ("a.i16", V::Array(T::I16, vec![V::I16(-7)])),
        (
            "a.u32",
            V::Array(T::U32, vec![V::U32(1), V::U32(2), V::U32(3)]),
        ),
        (
            "a.i32",
            V::Array(T::I32, vec![V::I32(-1), V::I32(i32::MAX)]),
        ),
        (
            "a.f32",
            V::Array(
                T::F32,
                vec![V::F32(0.0), V::F32(-0.0), V::F32(f32::INFINITY)],
            ),
        ),
        (
            "a.bool",
            V::Array(T::Bool, vec![V::Bool(true), V::Bool(false), V::Bool(true)]),
        ),
        (
            "a.str",
            V::Array(
                T::String,
                vec![
                    V::String("a".into()),
                    V::String(String::new()),
                    V::String("ü\n\0".into()),
                ],
            ),
        ),
        ("a.u64", V::Array(T::U64, vec![V::U64(0), V::U64(u64::MAX)])),
        (
            "a.i64",
            V::Array(T::I64, vec![V::I64(i64::MAX), V::I64(-5)]),
        ),
        (
            "a.f64",
            V::Array(T::F64, vec![V::F64(f64::MIN_POSITIVE), V::F64(-1e300)]),
        ),
        (
            "a.nested",
            V::Array(
                T::Array,
                vec![
                    V::Array(T::U32, vec![V::U32(1), V::U32(2)]),
                    V::Array(T::String, vec![V::String("x".into())]),
                    V::Array(
                        T::Array,
                        vec![V::Array(T::I8, vec![V::I8(-1)]), V::Array(T::F64, vec![])],
                    ),
                    V::Array(T::U8, vec![]),
                ],
            ),
        ),
        ("e.u8", V::Array(T::U8, vec![])),
        ("e.str", V::Array(T::String, vec![])),
        ("e.arr", V::Array(T::Array, vec![])),
        ("e.bool", V::Array(T::Bool, vec![])),
    ]
}

/// One tensor of every type, 1 to 4 dims, whole blocks.
fn every_tensor() -> Vec<(String, Vec<u64>, GgmlType)> {
    GgmlType::ALL
        .iter()
        .enumerate()
        .map(|(i, &ty)| {
            let bs = ty.block_size() as u64;
            let dims = match i % 4 {
                0 => vec![bs * 2],
                1 => vec![bs, 3],
                2 => vec![bs * 3, 2, 2],
                _ => vec![bs, 1, 2, 3],
            };
            (format!("blk.{i}.{}.weight", ty.name()), dims, ty)
        })
        .collect()
}

fn build_everything(alignment: Option<u32>) -> (GgufWriter, Vec<Vec<u8>>) {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    if let Some(a) = alignment {
        w.set("general.alignment", Value::U32(a));
    }
    for (k, v) in every_value() {
        w.set(k, v);
    }
    let mut datas = Vec::new();
    for (i, (name, dims, ty)) in every_tensor().into_iter().enumerate() {
        let data = tensor_bytes(&dims, ty, i as u64 + 1);
        datas.push(data.clone());
        w.add_tensor(&name, &dims, ty, data);
    }
    (w, datas)
}

fn check_everything(f: &GgufFile, alignment: u64, datas: &[Vec<u8>]) {
    assert_eq!(f.version, 3);
    assert_eq!(f.alignment, alignment);
    assert_eq!(f.architecture(), Some("llama"));
    for (k, v) in every_value() {
        let got = f.get(k).unwrap_or_else(|| panic!("key {k} missing"));
        assert!(same(got, &v), "{k}: wrote {v:?}, read {got:?}");
    }
    // Metadata keeps file order.
    let keys: Vec<&str> = f.metadata.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys[0], "general.architecture");
    assert_eq!(f.data_offset % alignment, 0, "data section aligned");
    assert!(f.data_offset as usize <= f.bytes().len());

    let expected = every_tensor();
    assert_eq!(f.tensors.len(), expected.len());
    let mut next_offset = 0u64;
    for ((t, (name, dims, ty)), data) in f.tensors.iter().zip(&expected).zip(datas) {
        assert_eq!(&t.name, name);
        assert_eq!(&t.dims, dims);
        assert_eq!(t.ty, *ty);
        assert_eq!(t.n_elements, dims.iter().product::<u64>());
        assert_eq!(t.n_bytes, data.len() as u64);
        assert_eq!(t.offset, next_offset, "{name}: tensors packed in order");
        assert_eq!(t.offset % alignment, 0, "{name}: offset aligned");
        assert_eq!((f.data_offset + t.offset) % alignment, 0);
        next_offset = (t.offset + t.n_bytes).div_ceil(alignment) * alignment;
        assert_eq!(f.tensor_data(t), &data[..], "{name}: data round trip");
        assert_eq!(f.tensor(name).map(|x| &x.name), Some(name));
    }
    assert!(f.tensor("no.such.tensor").is_none());
    assert!(f.get("no.such.key").is_none());
}

#[test]
fn round_trip_every_value_type_and_tensor_type_custom_alignment() {
    let (w, datas) = build_everything(Some(64));
    let bytes = w.to_bytes();
    let f = GgufFile::from_bytes(bytes.clone()).expect("parse");
    check_everything(&f, 64, &datas);

    // The same through a real file and the memory map.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("everything.gguf");
    w.write(&path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.path(), path);
    check_everything(&f, 64, &datas);
}

#[test]
fn round_trip_default_alignment_and_version_2() {
    let (w, datas) = build_everything(None);
    let mut bytes = w.to_bytes();
    let f = GgufFile::from_bytes(bytes.clone()).expect("parse");
    check_everything(&f, 32, &datas);

    // Version 2 has the same little-endian layout and must read identically.
    put_u32(&mut bytes, 4, 2);
    let f = GgufFile::from_bytes(bytes).expect("v2 parses");
    assert_eq!(f.version, 2);
    assert_eq!(f.tensors.len(), every_tensor().len());
}

#[test]
fn round_trip_other_alignments_and_no_tensors() {
    for a in [1u32, 2, 8, 256, 4096] {
        let mut w = GgufWriter::new();
        w.set("general.alignment", Value::U32(a));
        w.add_tensor("a", &[3], GgmlType::F32, filler(12, 1));
        w.add_tensor("b", &[5], GgmlType::F16, filler(10, 2));
        let f = GgufFile::from_bytes(w.to_bytes()).expect("parse");
        assert_eq!(f.alignment, a as u64);
        assert_eq!(f.data_offset % a as u64, 0);
        for t in &f.tensors {
            assert_eq!(t.offset % a as u64, 0);
        }
        assert_eq!(f.tensor_data(&f.tensors[1]), &filler(10, 2)[..]);
    }
    // Metadata only, and a completely empty file body.
    let mut w = GgufWriter::new();
    w.set("k", Value::U8(1));
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert!(f.tensors.is_empty());
    let f = GgufFile::from_bytes(GgufWriter::new().to_bytes()).unwrap();
    assert!(f.metadata.is_empty() && f.tensors.is_empty());
}

// Random metadata trees and tensors round-trip exactly.

fn scalar(t: ValueType) -> BoxedStrategy<Value> {
    match t {
        ValueType::U8 => any::<u8>().prop_map(Value::U8).boxed(),
        ValueType::I8 => any::<i8>().prop_map(Value::I8).boxed(),
        ValueType::U16 => any::<u16>().prop_map(Value::U16).boxed(),
        ValueType::I16 => any::<i16>().prop_map(Value::I16).boxed(),
        ValueType::U32 => any::<u32>().prop_map(Value::U32).boxed(),
        ValueType::I32 => any::<i32>().prop_map(Value::I32).boxed(),
        ValueType::F32 => any::<u32>()
            .prop_map(|b| Value::F32(f32::from_bits(b)))
            .boxed(),
        ValueType::Bool => any::<bool>().prop_map(Value::Bool).boxed(),
        ValueType::String => "\\PC{0,10}".prop_map(Value::String).boxed(),
        ValueType::U64 => any::<u64>().prop_map(Value::U64).boxed(),
        ValueType::I64 => any::<i64>().prop_map(Value::I64).boxed(),
        ValueType::F64 => any::<u64>()
            .prop_map(|b| Value::F64(f64::from_bits(b)))
            .boxed(),
        ValueType::Array => unreachable!(),
    }
}

const SCALAR_TYPES: [ValueType; 12] = [
    ValueType::U8,
    ValueType::I8,
    ValueType::U16,
    ValueType::I16,
    ValueType::U32,
    ValueType::I32,
    ValueType::F32,
    ValueType::Bool,
    ValueType::String,
    ValueType::U64,
    ValueType::I64,
    ValueType::F64,
];

fn array_of_scalars() -> BoxedStrategy<Value> {
    proptest::sample::select(&SCALAR_TYPES[..])
        .prop_flat_map(|t| {
            proptest::collection::vec(scalar(t), 0..6).prop_map(move |v| Value::Array(t, v))
        })
        .boxed()
}

fn any_array(depth: u32) -> BoxedStrategy<Value> {
    if depth == 0 {
        return array_of_scalars();
    }
    prop_oneof![
        3 => array_of_scalars(),
        1 => proptest::collection::vec(any_array(depth - 1), 0..4)
            .prop_map(|v| Value::Array(ValueType::Array, v)),
    ]
    .boxed()
}

fn any_value() -> BoxedStrategy<Value> {
    prop_oneof![
        3 => proptest::sample::select(&SCALAR_TYPES[..]).prop_flat_map(scalar),
        1 => any_array(3),
    ]
    .boxed()
}

fn any_tensor() -> impl Strategy<Value = (GgmlType, Vec<u64>)> {
    (
        proptest::sample::select(&GgmlType::ALL[..]),
        1u64..3,
        proptest::collection::vec(1u64..4, 0..4),
    )
        .prop_map(|(ty, blocks, rest)| {
            let mut dims = vec![blocks * ty.block_size() as u64];
            dims.extend(rest);
            (ty, dims)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn random_files_round_trip(
        values in proptest::collection::vec(("[a-z._]{0,12}", any_value()), 0..8),
        tensors in proptest::collection::vec(any_tensor(), 0..5),
        align_pow in 0u32..8,
    ) {
        let alignment = 1u64 << align_pow;
        let mut w = GgufWriter::new();
        w.set("general.alignment", Value::U64(alignment));
        let values: Vec<(String, Value)> = values
            .into_iter()
            .enumerate()
            .map(|(i, (k, v))| (format!("k{i}.{k}"), v))
            .collect();
        for (k, v) in &values {
            w.set(k, v.clone());
        }
        let mut datas = Vec::new();
        for (i, (ty, dims)) in tensors.iter().enumerate() {
            let data = tensor_bytes(dims, *ty, i as u64);
            w.add_tensor(&format!("t{i}"), dims, *ty, data.clone());
            datas.push(data);
        }
        let f = GgufFile::from_bytes(w.to_bytes()).expect("parse");
        prop_assert_eq!(f.alignment, alignment);
        prop_assert_eq!(f.metadata.len(), values.len() + 1);
        for (k, v) in &values {
            let got = f.get(k).expect("key present");
            prop_assert!(same(got, v), "{}: {:?} vs {:?}", k, v, got);
        }
        for (i, ((ty, dims), data)) in tensors.iter().zip(&datas).enumerate() {
            let t = f.tensor(&format!("t{i}")).expect("tensor present");
            prop_assert_eq!(t.ty, *ty);
            prop_assert_eq!(&t.dims, dims);
            prop_assert_eq!(t.offset % alignment, 0);
            prop_assert_eq!(f.tensor_data(t), &data[..]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Zero-copy.

fn assert_within(f: &GgufFile) {
    let all = f.bytes().as_ptr_range();
    for t in &f.tensors {
        let d = f.tensor_data(t).as_ptr_range();
        assert!(
            all.start <= d.start && d.end <= all.end,
            "{}: data slice is not inside the file's bytes",
            t.name
        );
        assert_eq!(d.end as usize - d.start as usize, t.n_bytes as usize);
        let start = d.start as usize - all.start as usize;
        assert_eq!(
            start as u64,
            f.data_offset + t.offset,
            "{}: borrowed at its offset",
            t.name
        );
    }
}

#[test]
fn tensor_data_borrows_from_the_mapping() {
    let (w, _) = build_everything(Some(64));
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_within(&f);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("zc.gguf");
    w.write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_within(&f);
}

/// A small valid header describing one 1 GiB F32 tensor, written into a sparse file. `patch`
/// may corrupt the header; it gets the final file length.
fn sparse_big_file(dir: &Path, patch: impl FnOnce(&mut Vec<u8>, u64)) -> (PathBuf, u64) {
    const N: u64 = 1 << 28; // elements: 1 GiB of f32
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    w.set(
        "big.list",
        Value::Array(ValueType::U8, vec![Value::U8(1); 4]),
    );
    w.add_tensor("huge.weight", &[4], GgmlType::F32, vec![0; 16]);
    let mut header = w.to_bytes();
    header.truncate(header.len() - 16);
    let tf = tensor_fields(&header, "huge.weight");
    put_u64(&mut header, tf.dims, N);
    let len = header.len() as u64 + N * 4;
    patch(&mut header, len);
    let path = dir.join("big.gguf");
    let file = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut &file, &header).unwrap();
    file.set_len(len).unwrap();
    (path, len)
}

#[test]
fn opening_a_large_file_reads_only_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let (path, len) = sparse_big_file(dir.path(), |_, _| {});
    let (f, largest) = largest_allocation(|| GgufFile::open(&path).expect("open"));
    assert!(
        largest < 1 << 20,
        "opening allocated {largest} bytes at once"
    );
    assert_eq!(f.bytes().len() as u64, len);
    let t = f.tensor("huge.weight").unwrap();
    assert_eq!(t.n_bytes, 1 << 30);
    assert_within(&f);
}

#[test]
fn corrupt_counts_in_a_large_file_do_not_allocate_proportionally() {
    // Counts that pass the "fits in the file" test of a 1 GiB file but are still corrupt must
    // fail without a giant up-front allocation (or an abort when that allocation fails).
    type Patch = fn(&mut Vec<u8>, u64);
    let cases: [(&str, Patch); 3] = [
        ("kv count", |h, len| put_u64(h, 16, len / 16)),
        ("tensor count", |h, len| put_u64(h, 8, len / 40)),
        ("u8 array count", |h, len| {
            let p = after_key(h, "big.list") + 8;
            put_u64(h, p, len - 4096)
        }),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (what, patch) in cases {
        let (path, _) = sparse_big_file(dir.path(), patch);
        let (r, largest) = largest_allocation(|| GgufFile::open(&path));
        assert!(
            largest < 64 << 20,
            "{what}: one allocation of {largest} bytes"
        );
        match r {
            Ok(_) => panic!("{what}: corrupt file opened"),
            Err(e) => assert_one_line(&e),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Real files.

#[test]
fn real_models_open() {
    let Some(shared) = shared_dir() else { return };
    let files = gguf_files(&shared.join("models"));
    assert!(!files.is_empty(), "no models in {}", shared.display());
    for path in files {
        let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = path.display();
        assert_eq!(f.architecture(), Some("llama"), "{name}");
        assert!(f.version == 2 || f.version == 3, "{name}");
        assert!(
            (1..=10_000).contains(&f.tensors.len()),
            "{name}: {} tensors",
            f.tensors.len()
        );
        assert!(f.tensor("token_embd.weight").is_some(), "{name}");
        assert_eq!(f.data_offset % f.alignment, 0, "{name}");
        let file_len = f.bytes().len() as u64;
        let mut total = 0;
        for t in &f.tensors {
            assert!(
                f.data_offset + t.offset + t.n_bytes <= file_len,
                "{name}: {}",
                t.name
            );
            assert_eq!(t.offset % f.alignment, 0, "{name}: {}", t.name);
            assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
            total += t.n_bytes;
        }
        assert!(total <= file_len - f.data_offset, "{name}");
        assert_within(&f);
        let n_layers = f.arch_get("block_count").and_then(Value::as_u64).unwrap();
        assert!((1..=256).contains(&n_layers), "{name}");
    }
}

#[test]
fn legacy_v1_is_refused_naming_the_version() {
    let Some(shared) = shared_dir() else { return };
    let path = shared.join("legacy/stories260k-gguf-v1.gguf");
    let e = GgufFile::open(&path).expect_err("v1 must be refused");
    assert!(matches!(e, GgufError::Version1), "{e:?}");
    assert_one_line(&e);
    assert!(e.to_string().contains("version 1"), "{e}");
}

#[test]
fn vocab_files() {
    let Some(shared) = shared_dir() else { return };
    let files = gguf_files(&shared.join("vocab"));
    assert!(!files.is_empty());
    for path in files {
        let r = GgufFile::open(&path);
        if path.file_name().unwrap() == "ggml-vocab-dbrx.gguf" {
            let e = r.expect_err("dbrx has a duplicate key");
            assert!(
                matches!(&e, GgufError::DuplicateKey(k) if k == "general.file_type"),
                "{e:?}"
            );
            assert_one_line(&e);
            assert!(e.to_string().contains("general.file_type"));
            continue;
        }
        let f = r.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            f.get_array("tokenizer.ggml.tokens")
                .is_some_and(|t| !t.is_empty()),
            "{}",
            path.display()
        );
        assert!(f.get_str("tokenizer.ggml.model").is_some());
    }
}

// ---------------------------------------------------------------------------------------------
// Targeted corruptions.

/// A small valid file: scalar, string, bool and array metadata, three tensors (1, 2 and 4 dims).
fn small() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    w.set("test.flag", Value::Bool(true));
    w.set("test.name", Value::String("hello".into()));
    w.set(
        "test.list",
        Value::Array(
            ValueType::U32,
            vec![Value::U32(1), Value::U32(2), Value::U32(3)],
        ),
    );
    w.set("test.count", Value::U32(7));
    w.add_tensor("tensor.a", &[32, 2], GgmlType::F32, filler(256, 1));
    w.add_tensor("tensor.b", &[64], GgmlType::Q8_0, filler(68, 2));
    w.add_tensor("tensor.c", &[8, 2, 2, 2], GgmlType::F16, filler(128, 3));
    w.to_bytes()
}

/// A file with `general.alignment` set to `v` (the writer lays invalid values out at 32).
fn with_alignment(v: Value) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set("general.alignment", v);
    w.set("general.architecture", Value::String("llama".into()));
    w.add_tensor("tensor.a", &[32, 2], GgmlType::F32, filler(256, 1));
    w.to_bytes()
}

#[test]
fn small_file_is_valid() {
    let f = GgufFile::from_bytes(small()).unwrap();
    assert_eq!(f.tensors.len(), 3);
    assert_eq!(f.get_bool("test.flag"), Some(true));
}

#[test]
fn bad_magic() {
    for magic in [*b"GGUG", *b"\0\0\0\0", *b"FUGG", *b"GGML", *b"ggjt"] {
        let mut b = small();
        b[..4].copy_from_slice(&magic);
        let e = parse_err(b);
        assert!(matches!(e, GgufError::BadMagic(m) if m == magic), "{e:?}");
    }
    assert!(matches!(parse_err(Vec::new()), GgufError::Truncated { .. }));
    assert!(matches!(
        parse_err(b"GGU".to_vec()),
        GgufError::Truncated { .. }
    ));
}

#[test]
fn bad_versions() {
    let mut b = small();
    put_u32(&mut b, 4, 3u32.swap_bytes());
    let e = parse_err(b).to_string();
    assert!(e.contains("big-endian"), "{e}");
    for v in [0u32, 4, 99, u32::MAX] {
        let mut b = small();
        put_u32(&mut b, 4, v);
        let e = parse_err(b);
        assert!(
            matches!(e, GgufError::UnsupportedVersion(x) if x == v),
            "{e:?}"
        );
        assert!(e.to_string().contains(&v.to_string()), "{e}");
    }
    let mut b = small();
    put_u32(&mut b, 4, 1);
    assert!(matches!(parse_err(b), GgufError::Version1));
}

#[test]
fn truncated_at_every_byte() {
    let b = small();
    for n in 0..b.len() {
        let r = std::panic::catch_unwind(|| GgufFile::from_bytes(b[..n].to_vec()));
        match r {
            Err(_) => panic!("panic on the file truncated to {n} bytes"),
            Ok(Ok(_)) => panic!("file truncated to {n} of {} bytes parsed", b.len()),
            Ok(Err(e)) => assert_one_line(&e),
        }
    }
}

#[test]
fn huge_counts() {
    let len = small().len() as u64;
    for v in [u64::MAX, u64::MAX / 2, 1 << 40, len + 1, len, len / 13 + 1] {
        // Tensor count (offset 8) and KV count (offset 16).
        for pos in [8, 16] {
            let mut b = small();
            put_u64(&mut b, pos, v);
            let e = parse_err(b);
            assert!(
                matches!(e, GgufError::Invalid(_) | GgufError::Truncated { .. }),
                "count {v} at {pos}: {e:?}"
            );
        }
    }
}

#[test]
fn huge_string_lengths() {
    let len = small().len() as u64;
    for v in [u64::MAX, u64::MAX - 7, 1 << 40, len + 1, len] {
        // A key's length.
        let mut b = small();
        let p = find(&b, b"test.name") - 8;
        put_u64(&mut b, p, v);
        let e = parse_err(b);
        assert!(
            matches!(e, GgufError::Invalid(_) | GgufError::Truncated { .. }),
            "key length {v}: {e:?}"
        );
        // A string value's length.
        let mut b = small();
        let p = after_key(&b, "test.name") + 4;
        put_u64(&mut b, p, v);
        let e = parse_err(b);
        assert!(
            matches!(e, GgufError::Invalid(_) | GgufError::Truncated { .. }),
            "value length {v}: {e:?}"
        );
        // A tensor name's length.
        let mut b = small();
        let p = tensor_fields(&b, "tensor.b").name_len;
        put_u64(&mut b, p, v);
        let e = parse_err(b);
        assert!(
            matches!(e, GgufError::Invalid(_) | GgufError::Truncated { .. }),
            "name length {v}: {e:?}"
        );
    }
}

#[test]
fn huge_array_lengths() {
    let len = small().len() as u64;
    for v in [u64::MAX, u64::MAX / 4 + 1, 1 << 40, len + 1, len / 4 + 1] {
        let mut b = small();
        let p = after_key(&b, "test.list") + 8;
        put_u64(&mut b, p, v);
        let e = parse_err(b);
        assert!(
            matches!(e, GgufError::BadMetadata { .. }),
            "array length {v}: {e:?}"
        );
        assert!(e.to_string().contains("test.list"), "{e}");
    }
    // A count that fits the remaining bytes on paper but runs into the tensor index.
    let mut b = small();
    let p = after_key(&b, "test.list") + 8;
    put_u64(&mut b, p, 40);
    assert!(GgufFile::from_bytes(b).is_err());
}

#[test]
fn bad_dimension_counts() {
    for n in [0u32, 5, 64, u32::MAX] {
        let mut b = small();
        let p = tensor_fields(&b, "tensor.c").n_dims;
        put_u32(&mut b, p, n);
        let e = parse_err(b);
        assert!(
            matches!(&e, GgufError::BadTensor { name, .. } if name == "tensor.c"),
            "n_dims {n}: {e:?}"
        );
        assert!(e.to_string().contains("dimensions"), "{e}");
    }
}

#[test]
fn bad_dims() {
    let cases: [(&[u64], &str); 5] = [
        (&[1 << 32, 1 << 32, 1, 1], "absurd"),
        (&[u64::MAX, 2, 1, 1], "absurd"),
        (&[1 << 16, 1 << 16, 1 << 16, 1 << 16], "absurd"),
        (&[8, 0, 2, 2], "zero"),
        (&[0, 2, 2, 2], "zero"),
    ];
    for (dims, word) in cases {
        let mut b = small();
        let tf = tensor_fields(&b, "tensor.c");
        for (i, d) in dims.iter().enumerate() {
            put_u64(&mut b, tf.dims + 8 * i, *d);
        }
        let e = parse_err(b);
        assert!(matches!(e, GgufError::BadTensor { .. }), "{dims:?}: {e:?}");
        assert!(e.to_string().contains(word), "{dims:?}: {e}");
    }
    // Bigger than the file.
    let mut b = small();
    let tf = tensor_fields(&b, "tensor.c");
    put_u64(&mut b, tf.dims, 1 << 20);
    let e = parse_err(b);
    assert!(
        matches!(e, GgufError::BadTensor { .. }) && e.to_string().contains("past the end"),
        "{e}"
    );
    // A quantized row width that is not a whole number of blocks.
    let mut b = small();
    let tf = tensor_fields(&b, "tensor.b");
    put_u64(&mut b, tf.dims, 48);
    let e = parse_err(b);
    assert!(
        matches!(e, GgufError::BadTensor { .. }) && e.to_string().contains("block"),
        "{e}"
    );
    // Smaller dims than the data written are fine (the rest is padding to the reader).
    let mut b = small();
    let tf = tensor_fields(&b, "tensor.c");
    put_u64(&mut b, tf.dims, 7);
    let f = GgufFile::from_bytes(b).unwrap();
    assert_eq!(f.tensor("tensor.c").unwrap().n_bytes, 7 * 8 * 2);
}

#[test]
fn unknown_tensor_types() {
    // 4/5 are ggml's retired Q4_2/Q4_3; 16/17 are IQ2_XXS/IQ2_XS, which parity does not read.
    for id in [4u32, 5, 16, 17, 24, 99, u32::MAX] {
        let mut b = small();
        let p = tensor_fields(&b, "tensor.b").ty;
        put_u32(&mut b, p, id);
        let e = parse_err(b);
        assert!(
            matches!(&e, GgufError::UnknownTensorType { name, id: x } if name == "tensor.b" && *x == id),
            "{e:?}"
        );
    }
}

#[test]
fn unknown_value_types() {
    for id in [13u32, 99, u32::MAX] {
        // The value type of a key.
        let mut b = small();
        let p = after_key(&b, "test.count");
        put_u32(&mut b, p, id);
        let e = parse_err(b);
        assert!(
            matches!(&e, GgufError::BadValueType { key, ty } if key == "test.count" && *ty == id),
            "{e:?}"
        );
        // An array's element type.
        let mut b = small();
        let p = after_key(&b, "test.list") + 4;
        put_u32(&mut b, p, id);
        let e = parse_err(b);
        assert!(
            matches!(&e, GgufError::BadValueType { ty, .. } if *ty == id),
            "{e:?}"
        );
    }
}

#[test]
fn bad_offsets() {
    let len = small().len() as u64;
    // Past the end (aligned or not), and values that overflow when added to the data offset.
    for v in [len, len.div_ceil(32) * 32, 1 << 40, u64::MAX - 31, !31] {
        let mut b = small();
        let p = tensor_fields(&b, "tensor.b").offset;
        put_u64(&mut b, p, v);
        let e = parse_err(b);
        assert!(
            matches!(&e, GgufError::BadTensor { name, .. } if name == "tensor.b"),
            "{v}: {e:?}"
        );
    }
    // Misaligned.
    for v in [1u64, 4, 31, 33, 258] {
        let mut b = small();
        let p = tensor_fields(&b, "tensor.b").offset;
        put_u64(&mut b, p, v);
        let e = parse_err(b);
        assert!(
            matches!(&e, GgufError::BadTensor { .. }) && e.to_string().contains("aligned"),
            "{v}: {e:?}"
        );
    }
}

#[test]
fn overlapping_tensors() {
    let b0 = small();
    let f = GgufFile::from_bytes(b0.clone()).unwrap();
    let a_off = f.tensor("tensor.a").unwrap().offset;
    let c_off = f.tensor("tensor.c").unwrap().offset;
    // b on top of a; c inside a (a is 256 bytes: offset 224 is inside).
    for (name, v) in [
        ("tensor.b", a_off),
        ("tensor.c", a_off + 224),
        ("tensor.b", c_off),
    ] {
        let mut b = b0.clone();
        let p = tensor_fields(&b, name).offset;
        put_u64(&mut b, p, v);
        let e = parse_err(b);
        assert!(matches!(e, GgufError::Overlap { .. }), "{name}@{v}: {e:?}");
    }
}

#[test]
fn duplicate_tensor_names_and_keys() {
    let mut w = GgufWriter::new();
    w.add_tensor("same", &[4], GgmlType::F32, filler(16, 1));
    w.add_tensor("same", &[4], GgmlType::F32, filler(16, 2));
    let e = parse_err(w.to_bytes());
    assert!(
        matches!(&e, GgufError::DuplicateTensor(n) if n == "same"),
        "{e:?}"
    );

    // Rename a key to collide with another of the same length.
    let mut b = small();
    let p = find(&b, b"test.name");
    b[p..p + 9].copy_from_slice(b"test.flag");
    // (now "test.flag" occurs twice; the second is a string)
    let e = parse_err(b);
    assert!(
        matches!(&e, GgufError::DuplicateKey(k) if k == "test.flag"),
        "{e:?}"
    );
}

#[test]
fn bad_alignments() {
    for v in [
        Value::U32(0),
        Value::U32(3),
        Value::U32(48),
        Value::U64(1 << 40),
        Value::I32(-32),
        Value::F32(32.0),
        Value::String("32".into()),
        Value::Bool(true),
        Value::Array(ValueType::U32, vec![Value::U32(32)]),
    ] {
        let b = with_alignment(v.clone());
        let e = parse_err(b);
        assert!(
            matches!(&e, GgufError::BadMetadata { key, .. } if key == "general.alignment"),
            "{v:?}: {e:?}"
        );
    }
}

#[test]
fn bool_byte_must_be_0_or_1() {
    for byte in [2u8, 0x80, 0xff] {
        let mut b = small();
        let p = after_key(&b, "test.flag") + 4;
        assert_eq!(b[p], 1);
        b[p] = byte;
        let e = parse_err(b);
        assert!(
            matches!(&e, GgufError::BadMetadata { key, .. } if key == "test.flag"),
            "{e:?}"
        );
    }
}

#[test]
fn invalid_utf8() {
    // In a key.
    let mut b = small();
    let p = find(&b, b"test.count");
    b[p + 4] = 0xff;
    let e = parse_err(b);
    assert!(matches!(e, GgufError::Invalid(_)), "{e:?}");
    assert!(e.to_string().contains("UTF-8"), "{e}");
    // In a string value and a tensor name.
    for needle in [&b"hello"[..], b"tensor.b"] {
        let mut b = small();
        let p = find(&b, needle);
        b[p + 1] = 0xc3; // a lead byte followed by an ASCII byte
        let e = parse_err(b);
        assert!(e.to_string().contains("UTF-8"), "{e}");
    }
}

#[test]
fn names_with_control_characters_stay_on_one_line() {
    // A key or tensor name may legally contain a newline; error messages must still be one line.
    let mut w = GgufWriter::new();
    w.set("evil\nkey", Value::U32(1));
    w.add_tensor("evil\ntensor", &[4], GgmlType::F32, filler(16, 1));
    let good = w.to_bytes();
    let f = GgufFile::from_bytes(good.clone()).expect("newlines in names are legal");
    assert!(f.get("evil\nkey").is_some() && f.tensor("evil\ntensor").is_some());

    let mut b = good.clone();
    let p = after_key(&b, "evil\nkey");
    put_u32(&mut b, p, 77);
    let e = parse_err(b);
    assert!(matches!(&e, GgufError::BadValueType { key, .. } if key == "evil\nkey"));
    assert!(e.to_string().contains(r"'evil\nkey'"), "{e}");

    let mut b = good.clone();
    let tf = tensor_fields(&b, "evil\ntensor");
    put_u32(&mut b, tf.ty, 99);
    assert!(matches!(parse_err(b), GgufError::UnknownTensorType { .. }));

    let mut b = good.clone();
    put_u64(&mut b, tf.offset, 3);
    assert!(matches!(parse_err(b), GgufError::BadTensor { .. }));

    let mut b = good;
    b.truncate(tf.ty + 2);
    assert!(matches!(parse_err(b), GgufError::Truncated { .. }));
}

/// One metadata key holding a u8 array of `n` zero bytes.
fn u8_array_file(n: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes()); // tensors
    b.extend_from_slice(&1u64.to_le_bytes()); // kv
    b.extend_from_slice(&3u64.to_le_bytes());
    b.extend_from_slice(b"big");
    b.extend_from_slice(&(ValueType::Array as u32).to_le_bytes());
    b.extend_from_slice(&(ValueType::U8 as u32).to_le_bytes());
    b.extend_from_slice(&n.to_le_bytes());
    b.resize(b.len() + n as usize, 0);
    b
}

#[test]
fn metadata_value_budget() {
    // A million-element array (a large real vocabulary's worth) parses...
    let f = GgufFile::from_bytes(u8_array_file(1 << 20)).expect("1M values");
    assert_eq!(f.get_array("big").map(<[Value]>::len), Some(1 << 20));
    // ...but a file whose metadata would materialize more than 2^24 values is refused up front,
    // even though every byte is present.
    let input = u8_array_file((1 << 24) + 1);
    let (r, largest) = largest_allocation(|| GgufFile::from_bytes(input));
    let e = r.expect_err("too many values");
    assert_one_line(&e);
    assert!(
        matches!(&e, GgufError::BadMetadata { key, .. } if key == "big"),
        "{e:?}"
    );
    assert!(
        largest < 1 << 20,
        "refusing allocated {largest} bytes at once"
    );
}
