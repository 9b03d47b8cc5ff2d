//! Q8_K: 256 int8 values, one f32 scale and 16 partial sums.
//!
//! ggml never stores weights in this format: the CPU backend turns the activation row into Q8_K
//! before a dot product with a K-quant or IQ4_XS weight (`vec_dot_type`). `quantize` therefore
//! reproduces `quantize_row_q8_K_ref` bit for bit, so parity can emulate that rounding.
//!
//! Block (292 bytes): `d: f32`, `qs: [i8; 256]`, `bsums: [i16; 16]`. `bsums[j]` is the sum of
//! `qs[16j..16j + 16]`; the dot products use it to apply the weights' per-sub-block minimums
//! without touching the activations again.

use super::cpu::dispatch;
use super::ggml::{QK_K, nearest_int};

/// Bytes per 256-element block.
pub const BYTES: usize = 292;

/// Elements per block.
pub const BLOCK: usize = QK_K;

/// This format's entry in the table (`super::GgmlType::format`).
pub const FORMAT: super::Format =
    super::format_entry!(Q8_K, "q8_K", vec_dot_type: Q8_K, dot_exact: true);

// The block layout adds up.
const _: () = assert!(BYTES == 4 + BLOCK + 2 * (BLOCK / 16) && BSUMS + 2 * (BLOCK / 16) == BYTES);

/// Byte offsets inside a block.
const QS: usize = 4;
const BSUMS: usize = QS + QK_K;

/// The block's scale `d`.
#[inline]
pub(crate) fn block_d(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The block's 256 quants.
#[inline]
pub(crate) fn block_qs(b: &[u8]) -> &[u8] {
    &b[QS..BSUMS]
}

/// `bsums[j]`, the sum of quants `16j..16j + 16` as the quantizer stored it.
#[inline]
pub(crate) fn block_bsum(b: &[u8], j: usize) -> i32 {
    i16::from_le_bytes([b[BSUMS + 2 * j], b[BSUMS + 2 * j + 1]]) as i32
}

/// Check a weight row of `w_block`-byte blocks against its Q8_K activation row; returns the
/// block count. Panics on a mismatch (the dot products index both rows block by block).
pub(crate) fn check_dot(w: &[u8], w_block: usize, a: &[u8]) -> usize {
    let nb = w.len() / w_block;
    assert!(
        w.len().is_multiple_of(w_block) && a.len() == nb * BYTES,
        "vec_dot: {} weight bytes ({w_block}-byte blocks) vs {} Q8_K bytes",
        w.len(),
        a.len()
    );
    nb
}

/// Decode `dst.len()` elements (SIMD where available; bit-identical to [`dequantize_scalar`]).
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    dispatch!(x86, neon => dequantize(src, dst) else dequantize_scalar)
}

/// ggml's `dequantize_row_q8_K`: `y = d * q`.
pub fn dequantize_scalar(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() / QK_K * BYTES);
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = block_d(b);
        for (y, &q) in y.iter_mut().zip(block_qs(b)) {
            *y = d * q as i8 as f32;
        }
    }
}

/// ggml's `quantize_row_q8_K_ref`, bit for bit: the element of largest magnitude (the first on
/// ties, sign kept) maps to -127, `q = nearest_int(-127 / max * x)`, `d = 1 / iscale`.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() / QK_K * BYTES);
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(BYTES)) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            // ggml leaves bsums unwritten here; zero is what they would sum to.
            b.fill(0);
            continue;
        }
        // -127 rather than -128 keeps every q in [-127, 127], which the SIMD dot products
        // (sign tricks around maddubs) rely on.
        let iscale = -127.0 / max;
        let (head, bsums) = b.split_at_mut(BSUMS);
        for (q, &v) in head[QS..].iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for (j, s) in bsums.chunks_exact_mut(2).enumerate() {
            let sum: i32 = head[QS + 16 * j..QS + 16 * j + 16]
                .iter()
                .map(|&q| q as i8 as i32)
                .sum();
            s.copy_from_slice(&(sum as i16).to_le_bytes());
        }
        head[..QS].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

/// As a weight (no converter writes one; ggml has no kernel): the f32 dot of both rows
/// decoded.
pub fn vec_dot(w: &[u8], a: &[u8]) -> f32 {
    super::dot_decoded(
        super::GgmlType::Q8_K,
        w,
        a,
        dequantize,
        super::f32::vec_dot_f32,
    )
}

/// [`vec_dot`] with the scalar decoder and dot product.
pub fn vec_dot_scalar(w: &[u8], a: &[u8]) -> f32 {
    super::dot_decoded(
        super::GgmlType::Q8_K,
        w,
        a,
        dequantize_scalar,
        super::f32::vec_dot_f32_scalar,
    )
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BYTES, QK_K, block_d, block_qs};
    use crate::x86::{hi128, lo128, load_u8x32, store_scaled_i8x16};

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            let d = block_d(b);
            for (q, y) in block_qs(b).chunks_exact(32).zip(y.chunks_exact_mut(32)) {
                let q = load_u8x32(q);
                store_scaled_i8x16(&mut y[..16], lo128(q), d);
                store_scaled_i8x16(&mut y[16..], hi128(q), d);
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{BYTES, QK_K, block_d, block_qs};
    use crate::arm::*;
    use std::arch::aarch64::*;

    #[target_feature(enable = "neon")]
    pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() / QK_K * BYTES);
        for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK_K)) {
            let d = block_d(b);
            for (q, y) in block_qs(b).chunks_exact(16).zip(y.chunks_exact_mut(16)) {
                store_scaled_i8x16(y, vreinterpretq_s8_u8(load_u8x16(q)), d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn simd_matches_scalar(src in blocks(BYTES, 1..5)) {
            assert_same_decode(&src, BYTES, dequantize, dequantize_scalar);
        }

        #[test]
        fn quantize_is_idempotent(x in shifted_floats(1..5)) {
            // Requantizing the decoded row gives the same quants and bsums. `d = 1/iscale` can
            // move by an ulp (ggml's formula does not round-trip exactly), and when an element
            // of the opposite sign also rounded to |q| = 127 before the max, every sign flips.
            let q = quantize_vec(&x, BYTES, quantize);
            let y = decode_vec(&q, BYTES, dequantize_scalar);
            let r = quantize_vec(&y, BYTES, quantize);
            for (b, c) in q.chunks_exact(BYTES).zip(r.chunks_exact(BYTES)) {
                let flip = if block_d(b).signum() == block_d(c).signum() { 1 } else { -1 };
                let (d, e) = (block_d(b), flip as f32 * block_d(c));
                prop_assert!((d.to_bits() as i64 - e.to_bits() as i64).abs() <= 1, "{d} vs {e}");
                for (&u, &v) in block_qs(b).iter().zip(block_qs(c)) {
                    prop_assert_eq!(u as i8 as i32, flip * v as i8 as i32);
                }
                for j in 0..16 {
                    prop_assert_eq!(block_bsum(b, j), flip * block_bsum(c, j));
                }
            }
        }

        #[test]
        fn bsums_and_range(x in shifted_floats(1..5)) {
            let q = quantize_vec(&x, BYTES, quantize);
            for b in q.chunks_exact(BYTES) {
                let qs = block_qs(b);
                prop_assert!(qs.iter().all(|&v| v as i8 != -128));
                for j in 0..16 {
                    let s: i32 = qs[16 * j..16 * j + 16].iter().map(|&v| v as i8 as i32).sum();
                    prop_assert_eq!(block_bsum(b, j), s);
                }
            }
        }

        #[test]
        fn round_trip_random(x in shifted_floats(1..5)) {
            let q = quantize_vec(&x, BYTES, quantize);
            let y = decode_vec(&q, BYTES, dequantize);
            // Each block's error is at most half a step, step = max|x| / 127.
            for (xb, yb) in x.chunks(QK_K).zip(y.chunks(QK_K)) {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (a, b) in xb.iter().zip(yb) {
                    prop_assert!((a - b).abs() <= amax / 127.0 * 0.5001 + 1e-30);
                }
            }
        }
    }

    #[test]
    fn round_trip_ggml_data() {
        let x = ggml_test_data(4096, 0.0);
        let y = decode_vec(&quantize_vec(&x, BYTES, quantize), BYTES, dequantize);
        assert!(ggml_rmse(&x, &y) < 0.002);
        assert!(rel_rmse(&x, &y) < 0.005, "{}", rel_rmse(&x, &y));
    }

    #[test]
    fn zero_block() {
        let q = quantize_vec(&[0.0; QK_K], BYTES, quantize);
        assert!(q.iter().all(|&b| b == 0));
    }

    #[test]
    fn known_block() {
        // max |x| = 127 (negative) gives iscale = 1 exactly, so the rounding shows: ties go to
        // even, the same way ggml's 1.5·2²³ trick does.
        let mut x = [0.0f32; QK_K];
        x[1] = 2.5;
        x[2] = 3.5;
        x[3] = -127.0;
        x[17] = -0.5;
        let q = quantize_vec(&x, BYTES, quantize);
        assert_eq!(block_d(&q), 1.0);
        let qs = block_qs(&q);
        assert_eq!(
            [qs[1], qs[2], qs[3], qs[17]].map(|v| v as i8),
            [2, 4, -127, 0]
        );
        assert_eq!((block_bsum(&q, 0), block_bsum(&q, 1)), (2 + 4 - 127, 0));
    }

    #[test]
    fn matches_llama_cpp() {
        assert_known_answers(
            BYTES,
            quantize,
            dequantize,
            dequantize_scalar,
            "04ff0c5aaa83198b45416829865e7b0f",
            "5fe4f2d4c2ba00501156e77157ad027f",
        );
    }
}
