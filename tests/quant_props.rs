//! Cross-type properties of `parity::quant`, for every type in `GgmlType::ALL`:
//!
//! * arbitrary bytes (whole blocks) decode without panicking, and the SIMD decoder
//!   (`dequantize_row`) equals the scalar twin bit for bit, NaN payloads included;
//! * quantize → dequantize stays within test-quantize-fns' error bounds on its own data
//!   (n = 4096, several offsets) and on random data at several scales;
//! * the activation quantizers (Q8_0, Q8_1, Q8_K) are idempotent;
//! * wrong lengths are an `Err`, never a panic.
//!
//! Case counts are kept small so the whole file runs in a few seconds (test profile is
//! opt-level 2).

use parity::gguf::GgmlType;
use parity::quant::{dequantize_row, dequantize_row_scalar, quantize_row};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// test-quantize-fns' `generate_data`: `0.1 + 2 * cosf(i + offset)` (0.1 is a double).
fn ggml_test_data(n: usize, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (0.1f64 + (2.0f32 * (i as f32 + offset).cos()) as f64) as f32)
        .collect()
}

/// test-quantize-fns' `array_rmse`: sqrt(Σ diff²) / n (its bounds are in this unit).
fn ggml_rmse(a: &[f32], b: &[f32]) -> f64 {
    let s: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    s.sqrt() / a.len() as f64
}

/// test-quantize-fns' MAX_QUANTIZATION_TOTAL_ERROR{,_2BITS,_3BITS}.
fn rmse_bound(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::Q2_K => 0.0075,
        GgmlType::Q3_K => 0.004,
        _ => 0.002,
    }
}

/// Blocks per generated row: enough to cross a SIMD loop boundary or two, small enough to
/// keep cases cheap.
fn max_blocks(ty: GgmlType) -> usize {
    match ty.block_size() {
        1 => 80,
        32 => 9,
        _ => 3,
    }
}

fn blocks(ty: GgmlType) -> impl Strategy<Value = Vec<u8>> {
    let ts = ty.type_size();
    (1..=max_blocks(ty)).prop_flat_map(move |nb| prop::collection::vec(any::<u8>(), nb * ts))
}

fn decode(ty: GgmlType, q: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n];
    dequantize_row(ty, q, &mut y).unwrap();
    y
}

fn check_twins(ty: GgmlType, src: &[u8]) -> Result<(), TestCaseError> {
    let n = src.len() / ty.type_size() * ty.block_size();
    // Poison the outputs so an element a decoder forgets to write shows up.
    let (mut a, mut b) = (vec![f32::from_bits(0x7fc0_0a0a); n], vec![0f32; n]);
    dequantize_row(ty, src, &mut a).map_err(|e| TestCaseError::fail(e.to_string()))?;
    dequantize_row_scalar(ty, src, &mut b).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for i in 0..n {
        prop_assert_eq!(
            a[i].to_bits(),
            b[i].to_bits(),
            "{}: element {} (block {}): simd {:e} vs scalar {:e}",
            ty,
            i,
            i / ty.block_size(),
            a[i],
            b[i]
        );
    }
    Ok(())
}

fn check_rmse(ty: GgmlType, x: &[f32], scale: f64, what: &str) -> Result<(), TestCaseError> {
    let q = quantize_row(ty, x).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(q.len(), x.len() / ty.block_size() * ty.type_size());
    let y = decode(ty, &q, x.len());
    let e = ggml_rmse(x, &y) / scale;
    prop_assert!(
        e <= rmse_bound(ty),
        "{}: {}: rmse {:.5} > {}",
        ty,
        what,
        e,
        rmse_bound(ty)
    );
    Ok(())
}

/// 4096 values in ±2 (test-quantize-fns' range), optionally shifted to one side (0..2),
/// scaled by 2^k. Returns (data, scale).
fn random_rows() -> impl Strategy<Value = (Vec<f32>, f64)> {
    (
        prop::collection::vec(-2.0f32..2.0, 4096),
        any::<bool>(),
        -3i32..=8,
    )
        .prop_map(|(v, one_sided, k)| {
            let s = (k as f32).exp2();
            let v = v
                .into_iter()
                .map(|x| if one_sided { (x + 2.0) * 0.5 } else { x } * s)
                .collect();
            (v, s as f64)
        })
}

/// Rows for the idempotence check: values in ±1 at a scale where every format's scales stay
/// normal f16 numbers, with some exact zeros and repeats.
fn q8_rows(block: usize) -> impl Strategy<Value = Vec<f32>> {
    let elem = prop_oneof![8 => -1.0f32..1.0, 1 => Just(0.0f32), 1 => Just(0.5f32)];
    (
        (1usize..=4).prop_flat_map(move |nb| prop::collection::vec(elem.clone(), nb * block)),
        -2.0f32..3.0,
    )
        .prop_map(|(v, e)| {
            let s = 10f32.powf(e);
            v.into_iter().map(|x| x * s).collect()
        })
}

fn check_idempotent(ty: GgmlType, x: &[f32]) -> Result<(), TestCaseError> {
    let q = quantize_row(ty, x).unwrap();
    let y = decode(ty, &q, x.len());
    let q2 = quantize_row(ty, &y).unwrap();
    if let Some(i) = (0..q.len()).find(|&i| q[i] != q2[i]) {
        let ts = ty.type_size();
        return Err(TestCaseError::fail(format!(
            "{ty}: quantize(dequantize(q)) != q at byte {i} (block {}, offset {}): {:02x?} vs {:02x?}",
            i / ts,
            i % ts,
            &q[i / ts * ts..(i / ts + 1) * ts],
            &q2[i / ts * ts..(i / ts + 1) * ts]
        )));
    }
    Ok(())
}

/// Both decoders return Err (and do not panic) for every (elements, bytes) pair that is not
/// a whole number of blocks with the matching byte count.
fn check_lengths(ty: GgmlType, n: usize, nbytes: usize) -> Result<(), TestCaseError> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let valid = n % bs == 0 && nbytes == n / bs * ts;
    prop_assume!(!valid);
    let src = vec![0u8; nbytes];
    let mut dst = vec![0f32; n];
    prop_assert!(
        dequantize_row(ty, &src, &mut dst).is_err(),
        "{}: n {} bytes {}",
        ty,
        n,
        nbytes
    );
    prop_assert!(
        dequantize_row_scalar(ty, &src, &mut dst).is_err(),
        "{}: n {} bytes {}",
        ty,
        n,
        nbytes
    );
    if n % bs != 0 {
        prop_assert!(quantize_row(ty, &vec![0f32; n]).is_err(), "{}: n {}", ty, n);
    }
    Ok(())
}

/// (elements, bytes) pairs biased towards the near misses: one block more or less, one
/// element or byte off, and anything at all.
fn lengths(ty: GgmlType) -> impl Strategy<Value = (usize, usize)> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    prop_oneof![
        (0usize..6, -2isize..=2, -2isize..=2).prop_map(move |(nb, de, db)| {
            let n = (nb * bs) as isize + de;
            let b = (nb * ts) as isize + db;
            (n.max(0) as usize, b.max(0) as usize)
        }),
        (0usize..6, 0usize..6).prop_map(move |(nb, nb2)| (nb * bs, nb2 * ts)),
        (0usize..2000, 0usize..3000),
    ]
}

macro_rules! per_type {
    ($($m:ident => $ty:ident),* $(,)?) => {$(
        mod $m {
            use super::*;
            const TY: GgmlType = GgmlType::$ty;

            proptest! {
                #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

                #[test]
                fn arbitrary_bytes_decode_and_twins_agree(src in blocks(TY)) {
                    check_twins(TY, &src)?;
                }

                #[test]
                fn wrong_lengths_are_errors((n, nbytes) in lengths(TY)) {
                    check_lengths(TY, n, nbytes)?;
                }
            }

            proptest! {
                #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

                #[test]
                fn round_trip_random_data((x, scale) in random_rows()) {
                    check_rmse(TY, &x, scale, "random data")?;
                }
            }

            #[test]
            fn round_trip_ggml_test_data() {
                for off in [0.0f32, 0.5, 1.0, 2.0, 100.0] {
                    let x = ggml_test_data(4096, off);
                    check_rmse(TY, &x, 1.0, &format!("0.1 + 2cos(i + {off})")).unwrap();
                }
            }

            #[test]
            fn empty_row_is_fine() {
                let mut y: [f32; 0] = [];
                dequantize_row(TY, &[], &mut y).unwrap();
                dequantize_row_scalar(TY, &[], &mut y).unwrap();
                assert!(quantize_row(TY, &[]).unwrap().is_empty());
            }
        }
    )*};
}

per_type! {
    f32 => F32, f16 => F16, bf16 => BF16,
    q4_0 => Q4_0, q4_1 => Q4_1, q5_0 => Q5_0, q5_1 => Q5_1, q8_0 => Q8_0, q8_1 => Q8_1,
    q2_k => Q2_K, q3_k => Q3_K, q4_k => Q4_K, q5_k => Q5_K, q6_k => Q6_K, q8_k => Q8_K,
    iq4_nl => IQ4_NL, iq4_xs => IQ4_XS,
}

mod idempotent {
    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn q8_0(x in q8_rows(32)) { check_idempotent(GgmlType::Q8_0, &x)?; }

        #[test]
        fn q8_1(x in q8_rows(32)) { check_idempotent(GgmlType::Q8_1, &x)?; }

        #[test]
        fn q8_k(x in q8_rows(256)) { check_idempotent(GgmlType::Q8_K, &x)?; }
    }
}

/// Every type in `GgmlType::ALL`, including any added later without a `per_type!` line:
/// deterministic pseudo-random blocks decode identically on both paths, and the round trip on
/// test-quantize-fns' data holds.
#[test]
fn every_type_in_all() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for ty in GgmlType::ALL {
        let src: Vec<u8> = (0..4 * ty.type_size())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        check_twins(ty, &src).unwrap();
        check_rmse(ty, &ggml_test_data(4096, 0.0), 1.0, "0.1 + 2cos(i)").unwrap();
    }
}
