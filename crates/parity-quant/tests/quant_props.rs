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

use parity_quant::GgmlType;
use parity_quant::testkit::{ggml_rmse, ggml_rmse_bound, ggml_test_data};
use parity_quant::{dequantize_row, dequantize_row_scalar, quantize_row};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// `default` cases, or PROPTEST_CASES when set (for a longer soak: `PROPTEST_CASES=5000`).
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Blocks per generated row: enough to cross a SIMD loop boundary or two, small enough to
/// keep cases cheap. The 32-element formats decode eight blocks at a time on x86 and the rest
/// one by one, so rows reach two batches and a tail.
fn max_blocks(ty: GgmlType) -> usize {
    match ty.block_size() {
        1 => 80,
        32 => 19,
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

/// SIMD and scalar decoders agree: every non-NaN element bit for bit, NaN where the other
/// has NaN; with `nan_bits`, NaN sign and payload must match too.
/// Q4_1/Q5_1 blocks start with d, m as f16: is m NaN and d non-finite (so q·d can be NaN too)?
fn block_scale_and_min_nan(src: &[u8], off: usize) -> bool {
    let h = |o: usize| half::f16::from_bits(u16::from_le_bytes([src[off + o], src[off + o + 1]]));
    !h(0).is_finite() && h(2).is_nan()
}

fn check_twins(ty: GgmlType, src: &[u8], nan_bits: bool) -> Result<(), TestCaseError> {
    let n = src.len() / ty.type_size() * ty.block_size();
    // Poison the outputs so an element a decoder forgets to write shows up.
    let (mut a, mut b) = (vec![f32::from_bits(0x7fc0_0a0a); n], vec![0f32; n]);
    dequantize_row(ty, src, &mut a).map_err(|e| TestCaseError::fail(e.to_string()))?;
    dequantize_row_scalar(ty, src, &mut b).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for i in 0..n {
        // When two NaNs meet in one add (a NaN scale times q, plus a NaN min: the `_1` types),
        // which payload survives is not specified: LLVM may commute the fadd. Only there do we
        // accept any NaN for any NaN; every other element must match to the bit.
        let two_nan_add = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1)
            && block_scale_and_min_nan(src, i / ty.block_size() * ty.type_size());
        let ok = a[i].to_bits() == b[i].to_bits()
            || ((!nan_bits || two_nan_add) && a[i].is_nan() && b[i].is_nan());
        if !ok {
            let (bs, ts) = (ty.block_size(), ty.type_size());
            let blk = i / bs;
            return Err(TestCaseError::fail(format!(
                "{ty}: element {i} (block {blk}, element {} in block): simd {:e} (0x{:08x}) vs \
                 scalar {:e} (0x{:08x}); block bytes {:02x?}",
                i % bs,
                a[i],
                a[i].to_bits(),
                b[i],
                b[i].to_bits(),
                &src[blk * ts..(blk + 1) * ts]
            )));
        }
    }
    Ok(())
}

fn check_rmse(ty: GgmlType, x: &[f32], scale: f64, what: &str) -> Result<(), TestCaseError> {
    let q = quantize_row(ty, x).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(q.len(), x.len() / ty.block_size() * ty.type_size());
    let y = decode(ty, &q, x.len());
    let e = ggml_rmse(x, &y) / scale;
    prop_assert!(
        e <= ggml_rmse_bound(ty),
        "{}: {}: rmse {:.5} > {}",
        ty,
        what,
        e,
        ggml_rmse_bound(ty)
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

fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// quantize(dequantize(quantize(x))) against quantize(x), block by block, as far as ggml's own
/// reference quantizers are idempotent (checked against ggml 0.25.3 in scripts/):
/// * Q8_0: every byte.
/// * Q8_1: `d` and `qs`; `s` is `f16(Σq · d)` with the f32 `d` before its f16 rounding, so
///   the second pass (whose `d` is already an f16 value) gives `f16(Σq · f16(d))`.
/// * Q8_K: `d = 1 / (-127 / max)` can move by one ulp, and when the decoded block holds both
///   `+max` and `-max` the first one wins, negating `d`, `qs` and `bsums` (ggml does the same
///   for about a fifth of random blocks).
fn check_idempotent(ty: GgmlType, x: &[f32]) -> Result<(), TestCaseError> {
    let q = quantize_row(ty, x).unwrap();
    let y = decode(ty, &q, x.len());
    let q2 = quantize_row(ty, &y).unwrap();
    let ts = ty.type_size();
    for (i, (a, b)) in q.chunks(ts).zip(q2.chunks(ts)).enumerate() {
        let ctx = || format!("{ty}: block {i}: first {a:02x?}\n  second {b:02x?}");
        match ty {
            GgmlType::Q8_0 => prop_assert!(a == b, "{}", ctx()),
            GgmlType::Q8_1 => {
                prop_assert!(a[..2] == b[..2] && a[4..] == b[4..], "{}", ctx());
                let sum: i32 = a[4..].iter().map(|&v| v as i8 as i32).sum();
                let s = half::f16::from_f32(sum as f32 * f16_at(a))
                    .to_bits()
                    .to_le_bytes();
                prop_assert!(
                    b[2..4] == s,
                    "{}: s should be f16(sum * d) = {:02x?}",
                    ctx(),
                    s
                );
            }
            GgmlType::Q8_K => {
                let d = |b: &[u8]| f32::from_le_bytes(b[..4].try_into().unwrap());
                let (d1, d2) = (d(a), d(b));
                let flipped = d1.is_sign_negative() != d2.is_sign_negative();
                let ulps = (d1.abs().to_bits() as i64 - d2.abs().to_bits() as i64).abs();
                prop_assert!(ulps <= 1, "{}: d {:e} vs {:e}", ctx(), d1, d2);
                let neg = |v: &[u8]| -> Vec<i32> { v.iter().map(|&q| -(q as i8 as i32)).collect() };
                let qs1: Vec<i32> = a[4..260].iter().map(|&q| q as i8 as i32).collect();
                let qs2: Vec<i32> = b[4..260].iter().map(|&q| q as i8 as i32).collect();
                let want = if flipped { neg(&a[4..260]) } else { qs1 };
                prop_assert!(qs2 == want, "{}: qs (sign flipped: {})", ctx(), flipped);
                for j in 0..16 {
                    let s = |v: &[u8]| i16::from_le_bytes([v[260 + 2 * j], v[261 + 2 * j]]) as i32;
                    let sum: i32 = qs2[16 * j..16 * j + 16].iter().sum();
                    prop_assert_eq!(s(b), sum, "{}: bsums[{}]", ctx(), j);
                    prop_assert_eq!(s(b), if flipped { -s(a) } else { s(a) }, "{}", ctx());
                }
            }
            _ => unreachable!(),
        }
    }
    Ok(())
}

/// Both decoders return Err (and do not panic) for every (elements, bytes) pair that is not
/// a whole number of blocks with the matching byte count.
fn check_lengths(ty: GgmlType, n: usize, nbytes: usize) -> Result<(), TestCaseError> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let valid = n.is_multiple_of(bs) && nbytes == n / bs * ts;
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
    if !n.is_multiple_of(bs) {
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
                #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

                #[test]
                fn arbitrary_bytes_decode_and_twins_agree(src in blocks(TY)) {
                    check_twins(TY, &src, false)?;
                }

                /// As above, and NaNs carry the same sign and payload on both paths.
                #[test]
                fn twins_agree_on_nan_bits(src in blocks(TY)) {
                    check_twins(TY, &src, true)?;
                }

                #[test]
                fn wrong_lengths_are_errors((n, nbytes) in lengths(TY)) {
                    check_lengths(TY, n, nbytes)?;
                }
            }

            proptest! {
                #![proptest_config(ProptestConfig { cases: cases(16), ..ProptestConfig::default() })]

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
        #![proptest_config(ProptestConfig { cases: cases(128), ..ProptestConfig::default() })]

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
        check_twins(ty, &src, true).unwrap();
        check_rmse(ty, &ggml_test_data(4096, 0.0), 1.0, "0.1 + 2cos(i)").unwrap();
    }
}
