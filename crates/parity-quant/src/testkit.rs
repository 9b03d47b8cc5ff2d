//! The one test kit of the block formats: ggml's test data and metrics, known answers from
//! llama.cpp, encode/decode helpers (used by the formats' unit tests and by tests/), and, for
//! the unit tests, proptest strategies and the twin checks ([`strategies`]).

use super::ggml::QK_K;
pub use super::{Dequant, Dot, Quant};

/// ggml test-quantize-fns' `generate_data`: `0.1 + 2·cos(i + offset)` (the 0.1 is a double).
pub fn ggml_test_data(n: usize, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (0.1f64 + (2.0f32 * (i as f32 + offset).cos()) as f64) as f32)
        .collect()
}

/// ggml test-quantize-fns' `array_rmse`: sqrt(Σ diff²) / n (not the usual sqrt of the mean;
/// its bounds, [`ggml_rmse_bound`], are in this unit), each difference taken in f32 as there.
pub fn ggml_rmse(a: &[f32], b: &[f32]) -> f64 {
    let sum: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| ((x - y) as f64).powi(2))
        .sum();
    sum.sqrt() / a.len() as f64
}

/// test-quantize-fns' `MAX_QUANTIZATION_TOTAL_ERROR{,_2BITS,_3BITS}` for [`ggml_rmse`].
pub fn ggml_rmse_bound(ty: super::GgmlType) -> f64 {
    match ty {
        super::GgmlType::Q2_K => 0.0075,
        super::GgmlType::Q3_K => 0.004,
        _ => 0.002,
    }
}

/// The usual RMSE relative to the data's RMS: a scale-free round-trip error.
pub fn rel_rmse(a: &[f32], b: &[f32]) -> f32 {
    let err: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| ((x - y) as f64).powi(2))
        .sum();
    let norm: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum();
    if norm == 0.0 {
        err.sqrt() as f32
    } else {
        (err / norm).sqrt() as f32
    }
}

/// f64 dot product (ggml's reference `dot_product`).
pub fn f64_dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

pub fn quantize_vec(x: &[f32], bytes: usize, f: fn(&[f32], &mut [u8])) -> Vec<u8> {
    let mut q = vec![0u8; x.len() / QK_K * bytes];
    f(x, &mut q);
    q
}

pub fn decode_vec(q: &[u8], bytes: usize, f: fn(&[u8], &mut [f32])) -> Vec<f32> {
    let mut y = vec![0f32; q.len() / bytes * QK_K];
    f(q, &mut y);
    y
}

/// Decode `src` with both functions and require the same bits (NaN payloads included).
pub fn assert_same_decode(
    src: &[u8],
    bytes: usize,
    fast: fn(&[u8], &mut [f32]),
    scalar: fn(&[u8], &mut [f32]),
) {
    let a = decode_vec(src, bytes, fast);
    let b = decode_vec(src, bytes, scalar);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "element {i}: {x} vs {y}");
    }
}

/// The SIMD dot product against the f64 dot of both rows dequantized: the same numbers, so
/// only float rounding may differ. `tol` scales with max|w|·Σ|a| because a K-quant dot is
/// `d·Σ sc·q·q8 − dmin·Σ m·bsum`, whose two terms can each exceed the result.
pub fn assert_dot_matches_dequantized(
    x: &[f32],
    y: &[f32],
    bytes: usize,
    quantize: fn(&[f32], &mut [u8]),
    dequantize: fn(&[u8], &mut [f32]),
    vec_dot: fn(&[u8], &[u8]) -> f32,
) {
    use crate::q8_k;
    let wq = quantize_vec(x, bytes, quantize);
    let aq = quantize_vec(y, q8_k::BYTES, q8_k::quantize);
    let wd = decode_vec(&wq, bytes, dequantize);
    let ad = decode_vec(&aq, q8_k::BYTES, q8_k::dequantize_scalar);
    let exact = f64_dot(&wd, &ad);
    let wmax = wd.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
    let asum: f64 = ad.iter().map(|&v| (v as f64).abs()).sum();
    let got = vec_dot(&wq, &aq) as f64;
    let tol = 4e-5 * wmax * asum + 1e-30;
    assert!(
        (got - exact).abs() <= tol,
        "vec_dot {got} vs dequantized {exact} (tol {tol})"
    );
}

/// test-quantize-fns' dot product error: weights `0.1 + 2cos(i)` in the tested format,
/// activations `0.1 + 2cos(i + 1)` in Q8_K, |vec_dot − f64 dot of the originals| / n.
pub fn ggml_dot_error(
    bytes: usize,
    quantize: fn(&[f32], &mut [u8]),
    vec_dot: fn(&[u8], &[u8]) -> f32,
) -> f32 {
    use crate::q8_k;
    let n = 4096;
    let (x, y) = (ggml_test_data(n, 0.0), ggml_test_data(n, 1.0));
    let wq = quantize_vec(&x, bytes, quantize);
    let aq = quantize_vec(&y, q8_k::BYTES, q8_k::quantize);
    ((vec_dot(&wq, &aq) as f64 - f64_dot(&x, &y)).abs() / n as f64) as f32
}

/// Known-answer inputs that Python can rebuild exactly (integer LCG, exact float ops):
/// `n` values in ±2 with a per-block offset of −0.5, 0 or +0.5.
pub fn kat_data(n: usize) -> Vec<f32> {
    let mut s = 1u32;
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let x = ((s >> 8) as f32 * (1.0 / 16_777_216.0) - 0.5) * 4.0;
            x + ((i / QK_K) % 3) as f32 * 0.5 - 0.5
        })
        .collect()
}

/// Known-answer bytes: the top byte of the same LCG seeded with 2.
pub fn kat_bytes(n: usize) -> Vec<u8> {
    let mut s = 2u32;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 24) as u8
        })
        .collect()
}

/// First 16 bytes of the SHA-256 of `b`, in hex.
pub fn sha256_128(b: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(b)[..16]
        .iter()
        .map(|v| format!("{v:02x}"))
        .collect()
}

/// Bit-exactness against llama.cpp (llama-cpp-python 0.3.36's libggml): the hash of
/// `quantize(kat_data(4096))` and of both decoders' output for `kat_bytes(8 blocks)`, as
/// ggml's `quantize_chunk` / `to_float` produce them.
pub fn assert_known_answers(
    bytes: usize,
    quantize: fn(&[f32], &mut [u8]),
    dequantize: fn(&[u8], &mut [f32]),
    dequantize_scalar: fn(&[u8], &mut [f32]),
    quant_hash: &str,
    decode_hash: &str,
) {
    let q = quantize_vec(&kat_data(4096), bytes, quantize);
    assert_eq!(sha256_128(&q), quant_hash, "quantize");
    let raw = kat_bytes(8 * bytes);
    for f in [dequantize, dequantize_scalar] {
        let y: Vec<u8> = decode_vec(&raw, bytes, f)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(sha256_128(&y), decode_hash, "dequantize");
    }
}

/// llama.cpp's `vec_dot` for `quantize(kat_data(4096))` against the reversed data in Q8_K
/// is `expected`; ours sums in another order, so allow a few f32 roundings of `abs_sum`
/// (Σ|w·a| of the dequantized rows, ~4.4e3 for this data).
pub fn assert_dot_known_answer(
    bytes: usize,
    quantize: fn(&[f32], &mut [u8]),
    vec_dot: fn(&[u8], &[u8]) -> f32,
    expected: f32,
    abs_sum: f32,
) {
    use crate::q8_k;
    let x = kat_data(4096);
    let y: Vec<f32> = x.iter().rev().copied().collect();
    let w = quantize_vec(&x, bytes, quantize);
    let a = quantize_vec(&y, q8_k::BYTES, q8_k::quantize);
    let got = vec_dot(&w, &a);
    let tol = 16.0 * f32::EPSILON * abs_sum;
    assert!(
        (got - expected).abs() <= tol,
        "{got} vs llama.cpp {expected} (tol {tol})"
    );
}

/// Overwrite the f16 at `off` in every `bytes`-sized block with a finite value in ±[2⁻⁸, 2⁶),
/// keeping arbitrary sign and mantissa: dot-product tests want finite scales.
pub fn finite_scales(data: &mut [u8], bytes: usize, offs: &[usize]) {
    for b in data.chunks_exact_mut(bytes) {
        for &o in offs {
            let bits = u16::from_le_bytes([b[o], b[o + 1]]);
            let e = 7 + ((bits >> 10) & 0x1F) % 14;
            let bits = (bits & 0x83FF) | (e << 10);
            b[o..o + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
}

/// Set the f16 at each of `offs` in every block to `v`.
pub fn set_scales(data: &mut [u8], bytes: usize, offs: &[usize], v: f32) {
    for b in data.chunks_exact_mut(bytes) {
        for &o in offs {
            crate::ggml::put_f16(&mut b[o..], v);
        }
    }
}

/// Decode `q` (whole blocks) into a fresh vector of `n` floats.
pub fn decode(q: &[u8], n: usize, deq: Dequant) -> Vec<f32> {
    let mut y = vec![0f32; n];
    deq(q, &mut y);
    y
}

/// Encode `x` into a fresh vector of `x.len() / block * bytes` bytes.
pub fn encode(x: &[f32], block: usize, bytes: usize, quant: Quant) -> Vec<u8> {
    let mut q = vec![0u8; x.len() / block * bytes];
    quant(x, &mut q);
    q
}

/// Worst per-block `max|x - x̂| / max|x|` after a round trip (0 for all-zero blocks).
pub fn max_rel_block_err(x: &[f32], quant: Quant, deq: Dequant, block: usize, bytes: usize) -> f32 {
    let y = decode(&encode(x, block, bytes, quant), x.len(), deq);
    x.chunks(block)
        .zip(y.chunks(block))
        .map(|(x, y)| {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = x.iter().zip(y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            if amax > 0.0 { err / amax } else { err }
        })
        .fold(0.0, f32::max)
}

/// `(sum w·a, sum |w·a|)` over the decoded rows, in f64.
pub fn dequant_dot(w: &[f32], a: &[f32]) -> (f64, f64) {
    w.iter().zip(a).fold((0.0, 0.0), |(s, m), (&x, &y)| {
        let p = x as f64 * y as f64;
        (s + p, m + p.abs())
    })
}

/// Two float sums of the same `nterms` rounded terms, accumulated in different orders (and
/// with or without FMA), differ by at most about `2 (nterms + 8) ε Σ|term|`; `mag` is that
/// Σ|term| (or an upper bound on it).
pub fn sum_order_bound(nterms: usize, mag: f64) -> f64 {
    2.0 * (nterms as f64 + 8.0) * f32::EPSILON as f64 * mag + 1e-30
}

#[cfg(test)]
pub use strategies::*;

/// The tests every 256-element format with Q8_K activations shares (Q2_K … Q6_K, IQ4_XS), one
/// body for all, the format's numbers as arguments. Invoke inside the format's `tests` module
/// (with `use super::*; use crate::testkit::*; use proptest::prelude::*;`):
/// - `random_rel_rmse`: bound on the relative RMSE of a round trip of [`shifted_floats`] rows;
/// - `ggml_rmse`, `ggml_rel_rmse`: bounds on test-quantize-fns' error and on the relative RMSE
///   for its data;
/// - `dot_error`: bound on test-quantize-fns' dot product error ([`ggml_dot_error`]);
/// - `known`: llama.cpp's hashes of `quantize` and of the decoders ([`assert_known_answers`]);
/// - `known_dot`: llama.cpp's `vec_dot` and the Σ|w·a| tolerance scale
///   ([`assert_dot_known_answer`]).
///
/// The twins are checked under the module's contract: the decoders bit for bit, the dot
/// products the same bits or both NaN ([`same_dot`]).
#[cfg(test)]
macro_rules! kquant_tests {
    (
        random_rel_rmse: $random:expr,
        ggml_rmse: $ggml:expr,
        ggml_rel_rmse: $ggml_rel:expr,
        dot_error: $dot_err:expr,
        known: ($quant_hash:expr, $decode_hash:expr),
        known_dot: ($dot:expr, $abs_sum:expr) $(,)?
    ) => {
        proptest! {
            #[test]
            fn simd_matches_scalar(src in blocks(BYTES, 1..5)) {
                assert_same_decode(&src, BYTES, dequantize, dequantize_scalar);
            }

            #[test]
            fn round_trip_random(x in shifted_floats(1..5)) {
                let y = decode_vec(&quantize_vec(&x, BYTES, quantize), BYTES, dequantize);
                prop_assert!(rel_rmse(&x, &y) < $random, "{}", rel_rmse(&x, &y));
            }

            #[test]
            fn vec_dot_simd_matches_scalar(
                (w, a) in (1..5usize).prop_flat_map(|n| (
                    blocks(BYTES, n..n + 1),
                    blocks(crate::q8_k::BYTES, n..n + 1),
                ))
            ) {
                same_dot(vec_dot(&w, &a), vec_dot_scalar(&w, &a))?;
            }

            #[test]
            fn vec_dot_matches_dequantized(x in shifted_floats(1..5), y in shifted_floats(4..5)) {
                assert_dot_matches_dequantized(&x, &y[..x.len()], BYTES, quantize, dequantize, vec_dot);
            }
        }

        #[test]
        fn round_trip_ggml_data() {
            let x = ggml_test_data(4096, 0.0);
            let y = decode_vec(&quantize_vec(&x, BYTES, quantize), BYTES, dequantize);
            assert!(ggml_rmse(&x, &y) < $ggml, "{}", ggml_rmse(&x, &y));
            assert!(rel_rmse(&x, &y) < $ggml_rel, "{}", rel_rmse(&x, &y));
        }

        #[test]
        fn vec_dot_ggml_data() {
            let err = ggml_dot_error(BYTES, quantize, vec_dot);
            assert!(err < $dot_err, "{err}");
        }

        #[test]
        fn matches_llama_cpp() {
            assert_known_answers(
                BYTES,
                quantize,
                dequantize,
                dequantize_scalar,
                $quant_hash,
                $decode_hash,
            );
        }

        #[test]
        fn vec_dot_matches_llama_cpp() {
            assert_dot_known_answer(BYTES, quantize, vec_dot, $dot, $abs_sum);
            assert_dot_known_answer(BYTES, quantize, vec_dot_scalar, $dot, $abs_sum);
        }
    };
}
#[cfg(test)]
pub(crate) use kquant_tests;

/// The tests every 32-element weight format shares (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), one
/// body for all. Invoke inside the format's `tests` module (with `use super::*; use
/// crate::testkit::*; use proptest::prelude::*;`):
/// - `act`: the activation format's module (`crate::q8_0` or `q8_1`);
/// - `quantizers`: the format's quantizers, each held to test-quantize-fns' bound (0.002) on its
///   data and on random data in its range, and to `any_scale` (worst per-block
///   `max|x − x̂| / max|x|`) on [`floats`] at any scale.
///
/// The decoders are checked bit for bit ([`assert_dequant_twins`]); the dot products against
/// test-quantize-fns' bound (0.02).
#[cfg(test)]
macro_rules! block32_tests {
    (act: $act:path, quantizers: [$($q:path),+ $(,)?], any_scale: $bound:expr $(,)?) => {
        #[test]
        fn round_trip_ggml_data() {
            let x = ggml_test_data(4096, 0.0);
            $(assert_rmse(&x, $q, dequantize, BLOCK, BYTES, 0.002).unwrap();)+
        }

        #[test]
        fn vec_dot_ggml_data() {
            use $act as act;
            // test-quantize-fns' dot_product_error: |vec_dot - f32 dot| / n <= 0.02.
            let (x, y) = (ggml_test_data(4096, 0.0), ggml_test_data(4096, 1.0));
            let w = encode(&x, BLOCK, BYTES, quantize);
            let a = encode(&y, BLOCK, act::BYTES, act::quantize);
            let exact = dequant_dot(&x, &y).0;
            for dot in [vec_dot, vec_dot_scalar] {
                let err = (dot(&w, &a) as f64 - exact).abs() / 4096.0;
                assert!(err <= 0.02, "{err}");
            }
        }

        proptest! {
            #[test]
            fn simd_dequantize_is_bit_identical(src in blocks(BYTES, 1..9)) {
                assert_dequant_twins(&src, BLOCK, BYTES, dequantize, dequantize_scalar)?;
            }

            #[test]
            fn round_trip_random(x in ggml_like_floats()) {
                $(assert_rmse(&x, $q, dequantize, BLOCK, BYTES, 0.002)?;)+
            }

            #[test]
            fn round_trip_any_scale(x in floats(BLOCK, 1..17)) {
                $(
                    let e = max_rel_block_err(&x, $q, dequantize, BLOCK, BYTES);
                    prop_assert!(e <= $bound, "{}", e);
                )+
            }
        }
    };
}
#[cfg(test)]
pub(crate) use block32_tests;

/// The dot product tests of the 32-element weight formats paired with Q8_0 activations (one f16
/// scale at byte 0 on both sides): with unit scales both twins give the exact integer dot; with
/// any finite scales they agree within [`sum_order_bound`]; on quantized rows they match the f64
/// dot of the decoded rows within it.
#[cfg(test)]
macro_rules! q8_0_dot_tests {
    () => {
        proptest! {
            #[test]
            fn vec_dot_integer_part_is_exact(
                mut w in blocks(BYTES, 1..17),
                seed in blocks(crate::q8_0::BYTES, 16..17),
            ) {
                use crate::q8_0::{self as act, BYTES as A};
                // Unit scales: every partial sum is an integer below 2^24, so both twins are exact.
                let mut a = seed[..w.len() / BYTES * A].to_vec();
                set_scales(&mut w, BYTES, &[0], 1.0);
                set_scales(&mut a, A, &[0], 1.0);
                let n = w.len() / BYTES * BLOCK;
                let exact = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, act::dequantize)).0;
                prop_assert_eq!(vec_dot_scalar(&w, &a) as f64, exact);
                prop_assert_eq!(vec_dot(&w, &a) as f64, exact);
            }

            #[test]
            fn vec_dot_twins_agree(
                mut w in blocks(BYTES, 1..33),
                seed in blocks(crate::q8_0::BYTES, 32..33),
            ) {
                use crate::q8_0::{self as act, BYTES as A};
                let mut a = seed[..w.len() / BYTES * A].to_vec();
                finite_scales(&mut w, BYTES, &[0]);
                finite_scales(&mut a, A, &[0]);
                let n = w.len() / BYTES * BLOCK;
                let (_, mag) = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, act::dequantize));
                let (f, s) = (vec_dot(&w, &a) as f64, vec_dot_scalar(&w, &a) as f64);
                prop_assert!((f - s).abs() <= sum_order_bound(n / BLOCK, mag), "{} vs {}", f, s);
            }

            #[test]
            fn vec_dot_matches_dequantized_dot(x in floats(BLOCK, 1..33), y in floats(BLOCK, 32..33)) {
                use crate::q8_0::{self as act, BYTES as A};
                let w = encode(&x, BLOCK, BYTES, quantize);
                let a = encode(&y[..x.len()], BLOCK, A, act::quantize);
                let n = x.len();
                let (exact, mag) = dequant_dot(&decode(&w, n, dequantize), &decode(&a, n, act::dequantize));
                for got in [vec_dot(&w, &a), vec_dot_scalar(&w, &a)] {
                    prop_assert!((got as f64 - exact).abs() <= sum_order_bound(n / BLOCK, mag),
                        "{} vs {}", got, exact);
                }
            }
        }
    };
}
#[cfg(test)]
pub(crate) use q8_0_dot_tests;

/// Proptest strategies and the checks that return proptest errors (unit tests only).
#[cfg(test)]
pub mod strategies {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;
    use std::ops::Range;

    /// The twins' dot products agree: the same bits, or both NaN. On arbitrary bytes a NaN f16
    /// weight scale can meet a NaN f32 activation scale in one multiply, and which payload
    /// survives is unspecified in Rust (LLVM may commute the operands, differently per build
    /// and opt level); finite, infinite and zero results must match to the bit.
    pub fn same_dot(simd: f32, scalar: f32) -> Result<(), TestCaseError> {
        prop_assert!(
            simd.to_bits() == scalar.to_bits() || (simd.is_nan() && scalar.is_nan()),
            "simd {simd:e} (0x{:08x}) vs scalar {scalar:e} (0x{:08x})",
            simd.to_bits(),
            scalar.to_bits()
        );
        Ok(())
    }

    /// Arbitrary bytes for a whole number of blocks (f16 scales may be NaN or Inf).
    pub fn blocks(bytes: usize, nblocks: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u8>> {
        nblocks.prop_flat_map(move |n| prop::collection::vec(any::<u8>(), n * bytes))
    }

    /// Whole blocks of finite floats at a random scale (10⁻² … 10³), with a sprinkling of exact
    /// zeros and repeated values so ties and flat blocks come up.
    pub fn floats(block: usize, nblocks: Range<usize>) -> impl Strategy<Value = Vec<f32>> {
        let elem = prop_oneof![
            8 => -1.0f32..1.0,
            1 => Just(0.0f32),
            1 => Just(0.5f32),
        ];
        (
            nblocks.prop_flat_map(move |nb| prop::collection::vec(elem.clone(), nb * block)),
            -2.0f32..3.0,
        )
            .prop_map(|(v, e)| {
                let s = 10f32.powf(e);
                v.into_iter().map(|x| x * s).collect()
            })
    }

    /// Random rows of whole blocks: values in ±1 plus an offset, scaled by 2^e with e in -4..8,
    /// so blocks range from all-positive to sign-balanced. The range keeps the formats' f16
    /// super-block scales normal; outside it their error is the f16's, not the quantizer's.
    pub fn shifted_floats(nblocks: std::ops::Range<usize>) -> impl Strategy<Value = Vec<f32>> {
        (nblocks, -4i32..8, -1.0f32..1.0).prop_flat_map(|(n, e, off)| {
            prop::collection::vec(-1.0f32..1.0, n * QK_K).prop_map(move |v| {
                v.into_iter()
                    .map(|x| (x + off) * (e as f32).exp2())
                    .collect()
            })
        })
    }

    /// 4096 floats in ±2: the regime test-quantize-fns' bounds were set for.
    pub fn ggml_like_floats() -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-2.0f32..2.0, 4096)
    }

    /// The SIMD decoder equals the scalar one bit for bit. A NaN only has to meet a NaN: Rust
    /// (LLVM) leaves NaN payloads unspecified, e.g. which operand's NaN `q*d + m` returns.
    pub fn assert_dequant_twins(
        src: &[u8],
        block: usize,
        bytes: usize,
        fast: Dequant,
        scalar: Dequant,
    ) -> Result<(), TestCaseError> {
        let n = src.len() / bytes * block;
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        fast(src, &mut a);
        scalar(src, &mut b);
        for i in 0..n {
            if !(a[i].is_nan() && b[i].is_nan()) {
                prop_assert_eq!(a[i].to_bits(), b[i].to_bits(), "element {}", i);
            }
        }
        Ok(())
    }

    /// quantize → dequantize error, in test-quantize-fns' unit, is at most `bound`.
    pub fn assert_rmse(
        x: &[f32],
        quant: Quant,
        deq: Dequant,
        block: usize,
        bytes: usize,
        bound: f32,
    ) -> Result<(), TestCaseError> {
        let y = decode(&encode(x, block, bytes, quant), x.len(), deq);
        let e = ggml_rmse(x, &y);
        prop_assert!(e <= bound as f64, "rmse {} > {}", e, bound);
        Ok(())
    }

    /// quantize(dequantize(quantize(x))) == quantize(x), byte for byte.
    pub fn assert_idempotent(
        x: &[f32],
        quant: Quant,
        deq: Dequant,
        block: usize,
        bytes: usize,
    ) -> Result<(), TestCaseError> {
        let q1 = encode(x, block, bytes, quant);
        let q2 = encode(&decode(&q1, x.len(), deq), block, bytes, quant);
        prop_assert_eq!(q1, q2);
        Ok(())
    }
}
