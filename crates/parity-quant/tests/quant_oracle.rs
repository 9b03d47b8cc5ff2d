//! parity's ggml block formats against vectors written by the real ggml.
//!
//! `tests/data/quant/` is produced by the repository's `scripts/quant_vectors.py` from ggml inside
//! llama-cpp-python (ctypes: `type_traits->to_float`, `ggml_quantize_chunk`, the `_ref`
//! quantizers) and cross-checked there against gguf-py. `index.json` records versions and,
//! per case, which ggml entry point produced the expected data.
//!
//! Asserted, bit for bit:
//! * `dequantize_row` and `dequantize_row_scalar`, every type, every stored block
//!   (a NaN matches any NaN; differing NaN payloads are printed, not failed);
//! * `quantize_row` for the activation types Q8_0, Q8_1 and Q8_K.
//!
//! For the other encoders the round-trip error on test-quantize-fns' data must stay within
//! its bounds; agreement with ggml's bytes is printed (`--nocapture`), not asserted.

use parity_quant::GgmlType;
use parity_quant::testkit::{ggml_rmse, ggml_rmse_bound};
use parity_quant::{dequantize_row, dequantize_row_scalar, quantize_row};
use serde_json::Value;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::OnceLock;

struct Vectors {
    index: Value,
    inputs: Vec<u8>,
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant")
}

fn vectors() -> &'static Vectors {
    static V: OnceLock<Vectors> = OnceLock::new();
    V.get_or_init(|| {
        let read = |f: &str| {
            std::fs::read(dir().join(f)).unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (regenerate with scripts/quant_vectors.py)",
                    dir().join(f).display()
                )
            })
        };
        let index: Value = serde_json::from_slice(&read("index.json")).expect("index.json");
        let inputs = read(index["inputs"]["file"].as_str().unwrap());
        Vectors { index, inputs }
    })
}

fn range(v: &Value) -> std::ops::Range<usize> {
    let off = v[0].as_u64().unwrap() as usize;
    off..off + v[1].as_u64().unwrap() as usize
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn input(name: &str) -> Vec<f32> {
    let v = vectors();
    let row = v.index["inputs"]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no input row {name}"));
    f32s(&v.inputs[range(&row["range"])])
}

fn entry(ty: GgmlType) -> &'static Value {
    let e = &vectors().index["types"][ty.name()];
    assert!(e.is_object(), "{ty}: no vectors in index.json");
    assert_eq!(e["id"].as_u64(), Some(ty.id() as u64), "{ty}: id");
    assert_eq!(
        e["block_size"].as_u64(),
        Some(ty.block_size() as u64),
        "{ty}: block size"
    );
    assert_eq!(
        e["type_size"].as_u64(),
        Some(ty.type_size() as u64),
        "{ty}: type size"
    );
    e
}

fn blob(ty: GgmlType) -> Vec<u8> {
    std::fs::read(dir().join(entry(ty)["file"].as_str().unwrap())).unwrap()
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "?".into())
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

type Decoder = fn(GgmlType, &[u8], &mut [f32]) -> Result<(), parity_quant::QuantError>;

/// Decode every stored case with `f`; a list of failures (empty when all match).
fn check_decoder(ty: GgmlType, label: &str, f: Decoder) -> Vec<String> {
    let e = entry(ty);
    let blob = blob(ty);
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let mut fails = Vec::new();
    let mut checked = 0usize;
    let mut nan_payload = 0usize;
    for case in e["dequant"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let n = case["n"].as_u64().unwrap() as usize;
        let src = &blob[range(&case["src"])];
        let want = f32s(&blob[range(&case["expected"])]);
        assert_eq!(want.len(), n);
        let mut got = vec![f32::from_bits(0x7fc0_dead); n];
        match catch_unwind(AssertUnwindSafe(|| f(ty, src, &mut got))) {
            Err(p) => {
                fails.push(format!(
                    "{label} panicked on case {name}: {}",
                    panic_text(p)
                ));
                continue;
            }
            Ok(Err(err)) => {
                fails.push(format!("{label} returned Err on case {name}: {err}"));
                continue;
            }
            Ok(Ok(())) => {}
        }
        let bad: Vec<usize> = (0..n).filter(|&i| !same(got[i], want[i])).collect();
        nan_payload += (0..n)
            .filter(|&i| {
                got[i].is_nan() && want[i].is_nan() && got[i].to_bits() != want[i].to_bits()
            })
            .count();
        checked += n;
        if let Some(&i) = bad.first() {
            let b = i / bs;
            let blk = &src[b * ts..(b + 1) * ts];
            fails.push(format!(
                "{label}: case {name}: {} of {n} elements differ; first at element {i} (block {b}, \
                 element {} in block): got {:e} (0x{:08x}) want {:e} (0x{:08x}); block bytes {}",
                bad.len(),
                i % bs,
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits(),
                hex(blk)
            ));
        }
    }
    println!(
        "{ty}: {label}: {checked} elements checked{}",
        if nan_payload > 0 {
            format!(", {nan_payload} NaNs with a different payload than ggml (allowed)")
        } else {
            String::new()
        }
    );
    fails
}

fn hex(b: &[u8]) -> String {
    if b.len() > 48 {
        format!("{}…({} bytes)", hex(&b[..48]), b.len())
    } else {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}

fn dequant_test(ty: GgmlType) {
    let mut fails = check_decoder(ty, "dequantize_row", dequantize_row);
    fails.extend(check_decoder(
        ty,
        "dequantize_row_scalar",
        dequantize_row_scalar,
    ));
    assert!(fails.is_empty(), "{ty}:\n  {}", fails.join("\n  "));
}

/// Undefined byte ranges of a stored quantization (bytes ggml leaves uninitialised).
fn undefined(case: &Value, key: &str) -> Vec<bool> {
    let n = case["expected"][1].as_u64().unwrap() as usize;
    let mut mask = vec![false; n];
    if let Some(rs) = case[key].as_array() {
        for r in rs {
            for m in &mut mask[range(r)] {
                *m = true;
            }
        }
    }
    mask
}

/// Name of the field holding byte `off` of a block, for failure messages.
fn field(ty: GgmlType, off: usize) -> &'static str {
    match ty {
        GgmlType::Q8_0 => {
            if off < 2 {
                "d"
            } else {
                "qs"
            }
        }
        GgmlType::Q8_1 => match off {
            0..2 => "d",
            2..4 => "s",
            _ => "qs",
        },
        GgmlType::Q8_K => match off {
            0..4 => "d",
            4..260 => "qs",
            _ => "bsums",
        },
        _ => "",
    }
}

fn quantize_caught(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, String> {
    match catch_unwind(AssertUnwindSafe(|| quantize_row(ty, x))) {
        Err(p) => Err(format!("quantize_row panicked: {}", panic_text(p))),
        Ok(Err(e)) => Err(format!("quantize_row returned Err: {e}")),
        Ok(Ok(q)) => Ok(q),
    }
}

fn decode_caught(ty: GgmlType, q: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let mut y = vec![0f32; n];
    match catch_unwind(AssertUnwindSafe(|| dequantize_row(ty, q, &mut y))) {
        Err(p) => Err(format!("dequantize_row panicked: {}", panic_text(p))),
        Ok(Err(e)) => Err(format!("dequantize_row returned Err: {e}")),
        Ok(Ok(())) => Ok(y),
    }
}

/// Quantization bit-exactness (Q8_0, Q8_1, Q8_K).
fn quant_exact_test(ty: GgmlType) {
    let e = entry(ty);
    let blob = blob(ty);
    let ts = ty.type_size();
    let mut fails = Vec::new();
    let mut blocks = 0;
    for case in e["quant"].as_array().unwrap() {
        let row = case["input"].as_str().unwrap();
        let x = input(row);
        let want = &blob[range(&case["expected"])];
        let und = undefined(case, "undefined");
        let got = match quantize_caught(ty, &x) {
            Ok(q) => q,
            Err(m) => {
                fails.push(format!("input {row}: {m}"));
                continue;
            }
        };
        assert_eq!(got.len(), want.len(), "{ty}: input {row}: output length");
        blocks += want.len() / ts;
        let bad: Vec<usize> = (0..want.len())
            .filter(|&i| !und[i] && got[i] != want[i])
            .collect();
        if let Some(&i) = bad.first() {
            let b = i / ts;
            let nbad_blocks = {
                let mut v: Vec<usize> = bad.iter().map(|i| i / ts).collect();
                v.dedup();
                v.len()
            };
            fails.push(format!(
                "input {row} ({}): {} bytes in {nbad_blocks} of {} blocks differ; first at byte {i} \
                 (block {b}, offset {} = {}): got 0x{:02x} want 0x{:02x}\n      got  block {}\n      want block {}",
                case["oracle"].as_str().unwrap_or("?"),
                bad.len(),
                want.len() / ts,
                i % ts,
                field(ty, i % ts),
                got[i],
                want[i],
                hex(&got[b * ts..(b + 1) * ts]),
                hex(&want[b * ts..(b + 1) * ts]),
            ));
        }
    }
    println!("{ty}: quantize_row: {blocks} blocks checked against ggml");
    assert!(
        fails.is_empty(),
        "{ty}: quantize_row differs from ggml:\n  {}",
        fails.join("\n  ")
    );
}

/// Round-trip error within ggml's bounds; byte agreement with ggml printed.
fn quant_rmse_test(ty: GgmlType) {
    let e = entry(ty);
    let blob = blob(ty);
    let ts = ty.type_size();
    let mut fails = Vec::new();
    let (mut same_bytes, mut total_bytes, mut same_blocks, mut total_blocks) = (0, 0, 0, 0);
    let (mut ref_same, mut ref_total) = (0, 0);
    let mut worst_ratio: (f64, String) = (0.0, String::new());
    let mut first_diff = String::new();
    for case in e["quant"].as_array().unwrap() {
        let row = case["input"].as_str().unwrap();
        let x = input(row);
        let want = &blob[range(&case["expected"])];
        let got = match quantize_caught(ty, &x) {
            Ok(q) => q,
            Err(m) => {
                fails.push(format!("input {row}: {m}"));
                break;
            }
        };
        assert_eq!(got.len(), want.len(), "{ty}: input {row}: output length");
        let und = undefined(case, "undefined");
        for (b, (g, w)) in got.chunks(ts).zip(want.chunks(ts)).enumerate() {
            let m = &und[b * ts..(b + 1) * ts];
            let s = (0..ts).filter(|&i| m[i] || g[i] == w[i]).count();
            if s != ts && first_diff.is_empty() {
                first_diff = format!(
                    "; first differing block: {row} block {b}: got {} want {}",
                    hex(g),
                    hex(w)
                );
            }
            same_bytes += s;
            total_bytes += ts;
            same_blocks += (s == ts) as usize;
            total_blocks += 1;
        }
        if let Some(r) = case.get("from_float_ref") {
            let rb = &blob[range(r)];
            let und = undefined(case, "from_float_ref_undefined");
            ref_same += (0..rb.len()).filter(|&i| und[i] || got[i] == rb[i]).count();
            ref_total += rb.len();
        }
        // Round trip: ours against ggml's on the same row (informative), and the bound on
        // test-quantize-fns' own data (asserted).
        let n = x.len();
        let ours = match decode_caught(ty, &got, n) {
            Ok(y) => y,
            Err(m) => {
                fails.push(format!("input {row}: {m}"));
                break;
            }
        };
        let theirs = decode_caught(ty, want, n).unwrap_or_default();
        if x.iter().all(|v| v.is_finite()) && theirs.len() == n {
            let (a, b) = (ggml_rmse(&x, &ours), ggml_rmse(&x, &theirs));
            if b > 0.0 && a / b > worst_ratio.0 {
                worst_ratio = (a / b, format!("{row}: {a:.3e} vs ggml {b:.3e}"));
            }
        }
        if row.starts_with("ggml_cos") {
            let err = ggml_rmse(&x, &ours);
            if err.is_nan() || err > ggml_rmse_bound(ty) {
                fails.push(format!(
                    "input {row}: round-trip rmse {err:.5} > test-quantize-fns bound {}",
                    ggml_rmse_bound(ty)
                ));
            }
        }
    }
    if total_bytes > 0 {
        println!(
            "{ty}: quantize_row vs ggml_quantize_chunk: {:.2}% bytes, {:.2}% blocks identical \
             ({total_blocks} blocks){}; worst rmse ratio ours/ggml {:.3} ({}){first_diff}",
            100.0 * same_bytes as f64 / total_bytes as f64,
            100.0 * same_blocks as f64 / total_blocks as f64,
            if ref_total > 0 {
                format!(
                    "; vs quantize_row_{}_ref: {:.2}% bytes",
                    ty.name(),
                    100.0 * ref_same as f64 / ref_total as f64
                )
            } else {
                String::new()
            },
            worst_ratio.0,
            worst_ratio.1,
        );
    }
    assert!(fails.is_empty(), "{ty}:\n  {}", fails.join("\n  "));
}

macro_rules! per_type {
    ($($f:ident => $ty:ident),* $(,)?) => {
        mod dequant {
            use super::*;
            $( #[test] fn $f() { dequant_test(GgmlType::$ty) } )*
        }
        mod quant {
            use super::*;
            $( #[test] fn $f() {
                match GgmlType::$ty {
                    GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K => quant_exact_test(GgmlType::$ty),
                    GgmlType::F32 => {}
                    ty => quant_rmse_test(ty),
                }
            } )*
        }
    };
}

per_type! {
    f32 => F32, f16 => F16, bf16 => BF16,
    q4_0 => Q4_0, q4_1 => Q4_1, q5_0 => Q5_0, q5_1 => Q5_1, q8_0 => Q8_0, q8_1 => Q8_1,
    q2_k => Q2_K, q3_k => Q3_K, q4_k => Q4_K, q5_k => Q5_K, q6_k => Q6_K, q8_k => Q8_K,
    iq4_nl => IQ4_NL, iq4_xs => IQ4_XS,
}

/// The vector set covers every type parity knows, the files are the ones the index describes,
/// and every stored quantization decodes through ggml consistently (sanity of the data itself).
#[test]
fn index_is_complete_and_intact() {
    use sha2::{Digest, Sha256};
    let v = vectors();
    for ty in GgmlType::ALL {
        let e = entry(ty);
        assert!(
            !e["dequant"].as_array().unwrap().is_empty(),
            "{ty}: no dequant cases"
        );
        if ty != GgmlType::F32 {
            assert!(
                !e["quant"].as_array().unwrap().is_empty(),
                "{ty}: no quant cases"
            );
        }
    }
    for (name, meta) in v.index["files"].as_object().unwrap() {
        let data = std::fs::read(dir().join(name)).unwrap();
        assert_eq!(
            data.len() as u64,
            meta["bytes"].as_u64().unwrap(),
            "{name}: size"
        );
        let sha: String = Sha256::digest(&data)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(sha, meta["sha256"].as_str().unwrap(), "{name}: sha256");
    }
    let g = &v.index["generator"];
    println!(
        "vectors: ggml {} (llama-cpp-python {}), gguf-py {}",
        g["ggml"], g["llama_cpp_python"], g["gguf_py"]
    );
}

/// ggml's x86 CPU backend does not use `quantize_row_q8_0_ref` for activations: its AVX2
/// `quantize_row_q8_0` rounds half to even with `id = 127 / amax`. parity models that as
/// `q8_0::quantize_x86_avx`; the vectors keep ggml's CPU bytes wherever they differ from the
/// reference (the tie rows).
#[test]
fn q8_0_cpu_backend_avx2_quantizer() {
    let ty = GgmlType::Q8_0;
    let e = entry(ty);
    let blob = blob(ty);
    let mut differing_rows = 0;
    for case in e["quant"].as_array().unwrap() {
        let x = input(case["input"].as_str().unwrap());
        let want = match &case["cpu_from_float"] {
            Value::String(s) if s == "same" => &blob[range(&case["expected"])],
            r => {
                differing_rows += 1;
                &blob[range(r)]
            }
        };
        let mut got = vec![0u8; want.len()];
        parity_quant::q8_0::quantize_x86_avx(&x, &mut got);
        let bad = (0..want.len()).filter(|&i| got[i] != want[i]).count();
        assert_eq!(
            bad, 0,
            "input {}: q8_0::quantize_x86_avx differs from ggml's CPU from_float in {bad} bytes",
            case["input"]
        );
    }
    assert!(
        differing_rows > 0,
        "the tie rows should separate the two quantizers"
    );
}
