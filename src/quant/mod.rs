//! ggml block formats: one file per format, each with `dequantize` (to f32) and `quantize`
//! (ggml's `*_ref` quantizer), their scalar and SIMD twins side by side.
//!
//! Every function here takes whole blocks: `src.len() == n / block_size * type_size`.
//! The dispatchers check lengths so a bad caller gets an error, not a panic.

pub mod bf16;
pub mod f16;
pub mod f32;
pub mod iq4_nl;
pub mod iq4_xs;
pub mod q2_k;
pub mod q3_k;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q5_1;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;
pub mod q8_1;
pub mod q8_k;
pub mod util;

pub use crate::gguf::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("{ty}: {n} elements is not a whole number of {bs}-element blocks")]
    NotWholeBlocks { ty: GgmlType, n: usize, bs: usize },
    #[error("{ty}: expected {expected} bytes for {n} elements, got {got}")]
    WrongLength {
        ty: GgmlType,
        n: usize,
        expected: usize,
        got: usize,
    },
}

fn check(ty: GgmlType, n: usize, bytes: usize) -> Result<(), QuantError> {
    let bs = ty.block_size();
    if !n.is_multiple_of(bs) {
        return Err(QuantError::NotWholeBlocks { ty, n, bs });
    }
    let expected = n / bs * ty.type_size();
    if bytes != expected {
        return Err(QuantError::WrongLength {
            ty,
            n,
            expected,
            got: bytes,
        });
    }
    Ok(())
}

/// Decode `dst.len()` elements of type `ty` from `src` (SIMD where available).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check(ty, dst.len(), src.len())?;
    match ty {
        GgmlType::F32 => f32::dequantize(src, dst),
        GgmlType::F16 => f16::dequantize(src, dst),
        GgmlType::BF16 => bf16::dequantize(src, dst),
        GgmlType::Q4_0 => q4_0::dequantize(src, dst),
        GgmlType::Q4_1 => q4_1::dequantize(src, dst),
        GgmlType::Q5_0 => q5_0::dequantize(src, dst),
        GgmlType::Q5_1 => q5_1::dequantize(src, dst),
        GgmlType::Q8_0 => q8_0::dequantize(src, dst),
        GgmlType::Q8_1 => q8_1::dequantize(src, dst),
        GgmlType::Q2_K => q2_k::dequantize(src, dst),
        GgmlType::Q3_K => q3_k::dequantize(src, dst),
        GgmlType::Q4_K => q4_k::dequantize(src, dst),
        GgmlType::Q5_K => q5_k::dequantize(src, dst),
        GgmlType::Q6_K => q6_k::dequantize(src, dst),
        GgmlType::Q8_K => q8_k::dequantize(src, dst),
        GgmlType::IQ4_NL => iq4_nl::dequantize(src, dst),
        GgmlType::IQ4_XS => iq4_xs::dequantize(src, dst),
    }
    Ok(())
}

/// The scalar twin of [`dequantize_row`]: plain Rust, the readable definition of each format.
pub fn dequantize_row_scalar(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check(ty, dst.len(), src.len())?;
    match ty {
        GgmlType::F32 => f32::dequantize_scalar(src, dst),
        GgmlType::F16 => f16::dequantize_scalar(src, dst),
        GgmlType::BF16 => bf16::dequantize_scalar(src, dst),
        GgmlType::Q4_0 => q4_0::dequantize_scalar(src, dst),
        GgmlType::Q4_1 => q4_1::dequantize_scalar(src, dst),
        GgmlType::Q5_0 => q5_0::dequantize_scalar(src, dst),
        GgmlType::Q5_1 => q5_1::dequantize_scalar(src, dst),
        GgmlType::Q8_0 => q8_0::dequantize_scalar(src, dst),
        GgmlType::Q8_1 => q8_1::dequantize_scalar(src, dst),
        GgmlType::Q2_K => q2_k::dequantize_scalar(src, dst),
        GgmlType::Q3_K => q3_k::dequantize_scalar(src, dst),
        GgmlType::Q4_K => q4_k::dequantize_scalar(src, dst),
        GgmlType::Q5_K => q5_k::dequantize_scalar(src, dst),
        GgmlType::Q6_K => q6_k::dequantize_scalar(src, dst),
        GgmlType::Q8_K => q8_k::dequantize_scalar(src, dst),
        GgmlType::IQ4_NL => iq4_nl::dequantize_scalar(src, dst),
        GgmlType::IQ4_XS => iq4_xs::dequantize_scalar(src, dst),
    }
    Ok(())
}

/// Quantize `src` to type `ty` following ggml's reference (`quantize_row_*_ref`) quantizer.
pub fn quantize_row(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let bs = ty.block_size();
    if !src.len().is_multiple_of(bs) {
        return Err(QuantError::NotWholeBlocks {
            ty,
            n: src.len(),
            bs,
        });
    }
    let mut dst = vec![0u8; src.len() / bs * ty.type_size()];
    quantize_row_into(ty, src, &mut dst)?;
    Ok(dst)
}

/// [`quantize_row`] into a caller-provided buffer of exactly the right length.
pub fn quantize_row_into(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check(ty, src.len(), dst.len())?;
    match ty {
        GgmlType::F32 => f32::quantize(src, dst),
        GgmlType::F16 => f16::quantize(src, dst),
        GgmlType::BF16 => bf16::quantize(src, dst),
        GgmlType::Q4_0 => q4_0::quantize(src, dst),
        GgmlType::Q4_1 => q4_1::quantize(src, dst),
        GgmlType::Q5_0 => q5_0::quantize(src, dst),
        GgmlType::Q5_1 => q5_1::quantize(src, dst),
        GgmlType::Q8_0 => q8_0::quantize(src, dst),
        GgmlType::Q8_1 => q8_1::quantize(src, dst),
        GgmlType::Q2_K => q2_k::quantize(src, dst),
        GgmlType::Q3_K => q3_k::quantize(src, dst),
        GgmlType::Q4_K => q4_k::quantize(src, dst),
        GgmlType::Q5_K => q5_k::quantize(src, dst),
        GgmlType::Q6_K => q6_k::quantize(src, dst),
        GgmlType::Q8_K => q8_k::quantize(src, dst),
        GgmlType::IQ4_NL => iq4_nl::quantize(src, dst),
        GgmlType::IQ4_XS => iq4_xs::quantize(src, dst),
    }
    Ok(())
}

/// Round a matmul input row to activation type `ty` exactly as the x86 CPU backend of
/// ggml does at run time (`from_float` of the vec_dot type). For Q8_0/Q8_1 that is the AVX
/// quantizer, which differs from the `_ref` one in rare ties (see q8_0.rs); Q8_K, f16 and bf16
/// use the reference conversion. Panics if `dst` has the wrong length (callers size it).
pub fn quantize_activation(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    check(ty, src.len(), dst.len()).expect("activation buffer sized by the caller");
    match ty {
        GgmlType::Q8_0 => q8_0::quantize_x86_avx(src, dst),
        GgmlType::Q8_1 => q8_1::quantize_x86_avx(src, dst),
        _ => quantize_row_into(ty, src, dst).expect("checked"),
    }
}

/// The activation type ggml's CPU backend quantizes the input row to before a matmul with a
/// weight of type `ty` (`type_traits_cpu[ty].vec_dot_type`).
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    match ty {
        GgmlType::F32 => GgmlType::F32,
        GgmlType::F16 => GgmlType::F16,
        GgmlType::BF16 => GgmlType::BF16,
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => GgmlType::Q8_0,
        GgmlType::Q4_1 | GgmlType::Q5_1 => GgmlType::Q8_1,
        GgmlType::Q8_1 => GgmlType::Q8_1,
        GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::Q4_K
        | GgmlType::Q5_K
        | GgmlType::Q6_K
        | GgmlType::Q8_K
        | GgmlType::IQ4_XS => GgmlType::Q8_K,
    }
}

/// View little-endian f32 bytes as f32s (borrowed when aligned, as mapped tensors and heap
/// buffers are; copied otherwise).
fn as_f32(b: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    // SAFETY: every bit pattern is a valid f32; align_to only yields the aligned middle.
    let (pre, mid, post) = unsafe { b.align_to::<f32>() };
    if pre.is_empty() && post.is_empty() && cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(mid)
    } else {
        std::borrow::Cow::Owned(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
}

/// Dot product of one weight row of type `ty` with one activation row already rounded to
/// `vec_dot_type(ty)` (by [`quantize_activation`]): integer per block, SIMD where available.
pub fn vec_dot(ty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    match ty {
        GgmlType::F32 => f32::vec_dot_f32(&as_f32(w), &as_f32(a)),
        GgmlType::F16 => f16::vec_dot_f16(w, a),
        GgmlType::BF16 => bf16::vec_dot_bf16(w, a),
        GgmlType::Q4_0 => q4_0::vec_dot(w, a),
        GgmlType::Q4_1 => q4_1::vec_dot(w, a),
        GgmlType::Q5_0 => q5_0::vec_dot(w, a),
        GgmlType::Q5_1 => q5_1::vec_dot(w, a),
        GgmlType::Q8_0 => q8_0::vec_dot(w, a),
        GgmlType::IQ4_NL => iq4_nl::vec_dot(w, a),
        GgmlType::Q2_K => q2_k::vec_dot(w, a),
        GgmlType::Q3_K => q3_k::vec_dot(w, a),
        GgmlType::Q4_K => q4_k::vec_dot(w, a),
        GgmlType::Q5_K => q5_k::vec_dot(w, a),
        GgmlType::Q6_K => q6_k::vec_dot(w, a),
        GgmlType::IQ4_XS => iq4_xs::vec_dot(w, a),
        // Activation-only types as weights (no converter writes them): dot the decoded rows.
        GgmlType::Q8_1 | GgmlType::Q8_K => {
            let n = w.len() / ty.type_size() * ty.block_size();
            let (mut x, mut y) = (vec![0.0; n], vec![0.0; n]);
            let ok = dequantize_row(ty, w, &mut x).is_ok() && dequantize_row(ty, a, &mut y).is_ok();
            debug_assert!(ok, "rows sized by the caller");
            f32::vec_dot_f32(&x, &y)
        }
    }
}
