//! ggml block formats: one file per format, each exporting its [`Format`] entry (sizes,
//! activation type, decoder, encoder, dot product, their scalar twins, an optional tile kernel),
//! and one table, [`GgmlType`], tying the on-disk ids to those entries. Everything else (the
//! GGUF reader's sizes, the backends' matmuls, the dispatchers below) asks the table.
//!
//! Every function here takes whole blocks: `src.len() == n / block * bytes`. The dispatchers
//! check lengths so a bad caller gets an error, not a panic.
//!
//! # Twins
//! Each format has a fast twin (`dequantize`, `vec_dot`: AVX2 or NEON where the CPU has it,
//! chosen by [`cpu::dispatch!`]) and a scalar twin (`*_scalar`: plain Rust, the readable
//! definition, written after ggml's C reference). The contract, checked by each format's tests
//! (kit in `testkit`) and by tests/quant_props.rs:
//! - `dequantize` equals `dequantize_scalar` bit for bit, NaN payloads included, except where
//!   two NaNs meet in one operation (Rust leaves which payload survives unspecified).
//! - `vec_dot`'s integer sums are exact. Its float steps are the scalar twin's, so the result is
//!   the same bits ([`Format::dot_exact`]: the K-quants, IQ4_XS), or follow ggml's AVX2 lane
//!   order (the 32-element formats and f32/f16/bf16), so it may differ by rounding, within
//!   `testkit::sum_order_bound`.
//! - A tile kernel equals `vec_dot` on every (row, token), bit for bit.
//!
//! ```
//! use parity_quant::{GgmlType, dequantize_row, quantize_row};
//!
//! let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
//! let blocks = quantize_row(GgmlType::Q8_0, &x)?; // 2 blocks of 34 bytes
//! assert_eq!(blocks.len(), 2 * GgmlType::Q8_0.type_size());
//! let mut y = vec![0f32; x.len()];
//! dequantize_row(GgmlType::Q8_0, &blocks, &mut y)?; // what llama.cpp would read back
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1.0 / 127.0));
//! // Not whole blocks: an error, not a panic.
//! assert!(quantize_row(GgmlType::Q8_0, &x[..40]).is_err());
//! # Ok::<(), parity_quant::QuantError>(())
//! ```

#[cfg(target_arch = "aarch64")]
pub(crate) mod arm;
pub mod bf16;
pub mod cpu;
pub mod f16;
pub mod f32;
pub mod ggml;
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
#[doc(hidden)]
pub mod testkit;
pub mod tile;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

pub use tile::TileAct;

pub type Dequant = fn(&[u8], &mut [f32]);
pub type Quant = fn(&[f32], &mut [u8]);
pub type Dot = fn(&[u8], &[u8]) -> f32;

/// One block format: ggml's `type_traits` and `type_traits_cpu` entry, with our twins.
/// Each format file exports one as `FORMAT`; [`GgmlType::format`] finds it.
pub struct Format {
    pub ty: GgmlType,
    /// As ggml's `ggml_type_name` prints it (lower case, e.g. `q4_K`).
    pub name: &'static str,
    /// Elements per block.
    pub block: usize,
    /// Bytes per block.
    pub bytes: usize,
    /// The activation type ggml's CPU backend rounds a matmul's input row to before a dot
    /// product with a weight of this type (`type_traits_cpu[ty].vec_dot_type`).
    pub vec_dot_type: GgmlType,
    /// Decode whole blocks (SIMD where available).
    pub dequantize: Dequant,
    pub dequantize_scalar: Dequant,
    /// ggml's reference quantizer (`quantize_row_*_ref`).
    pub quantize: Quant,
    /// What ggml's x86 CPU backend writes when it rounds a row to this type at run time
    /// (`type_traits_cpu[ty].from_float`); the reference quantizer except for Q8_0 and Q8_1.
    pub from_float: Quant,
    /// One weight row against one activation row of `vec_dot_type` (SIMD where available).
    pub vec_dot: Dot,
    pub vec_dot_scalar: Dot,
    /// `vec_dot` and `vec_dot_scalar` give the same bits (see the module's twin contract).
    pub dot_exact: bool,
    /// A kernel for many weight rows × many tokens at once, if the format has one.
    pub tile: Option<Tile>,
    /// The same rows × tokens against Q8_0 activations summed exactly: integer per block and
    /// every block's `(d_w · d_a) · Σ` added in f64 (parity's reference on an 8-bit grid), if
    /// the format has it. Bit-identical to its scalar twin.
    pub exact: Option<TileKernel>,
}

/// Weight rows × [`TileAct`] activation rows into `out[row * tokens + token]`.
pub type TileKernel = fn(&[u8], &TileAct, &mut [f32]);

/// A many-rows × many-tokens kernel: `out[r * tokens + t] = vec_dot(w_r, a_t)`, bit for bit.
#[derive(Clone, Copy)]
pub enum Tile {
    /// Against Q8_0 activations re-laid out once per matmul ([`TileAct`]).
    Q8_0(fn(&[u8], &TileAct, &mut [f32])),
    /// Against `nt` plain rows of the activation type, back to back: `(w, a, nt, out)`.
    Rows(fn(&[u8], &[u8], usize, &mut [f32])),
}

/// A format file's [`Format`] from its standard items: `BLOCK`, `BYTES`, `dequantize`,
/// `dequantize_scalar`, `quantize` (also `from_float` unless given), `vec_dot`,
/// `vec_dot_scalar`; `dot_exact: false` and no tile unless given.
macro_rules! format_entry {
    ($ty:ident, $name:literal, vec_dot_type: $vdt:ident $(, $field:ident: $value:expr)* $(,)?) => {{
        #[allow(unused_mut)]
        let mut f = $crate::Format {
            ty: $crate::GgmlType::$ty,
            name: $name,
            block: BLOCK,
            bytes: BYTES,
            vec_dot_type: $crate::GgmlType::$vdt,
            dequantize,
            dequantize_scalar,
            quantize,
            from_float: quantize,
            vec_dot,
            vec_dot_scalar,
            dot_exact: false,
            tile: None,
            exact: None,
        };
        $(f.$field = $value;)*
        f
    }};
}
use format_entry;

/// The table: one line per format, `Variant = on-disk id => module`. It defines [`GgmlType`]
/// (in id order) and ties each variant to its module's `FORMAT`.
macro_rules! formats {
    ($($ty:ident = $id:literal => $m:ident,)*) => {
        /// The ggml tensor types parity can read. The numeric value is the on-disk id.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, PartialOrd, Ord)]
        pub enum GgmlType {
            $($ty = $id,)*
        }

        impl GgmlType {
            pub const ALL: [GgmlType; [$($id),*].len()] = [$(GgmlType::$ty),*];

            /// This type's entry in the format table.
            pub const fn format(self) -> &'static Format {
                match self {
                    $(GgmlType::$ty => &$m::FORMAT,)*
                }
            }
        }

        // The row dispatchers call through the table one arm per type: each arm reads a
        // `const` entry, so the call is direct (and inlinable) as in a hand-written match,
        // where `(ty.format().f)(..)` would be an indirect call per row.
        fn dequantize_with(ty: GgmlType, scalar: bool, src: &[u8], dst: &mut [f32]) {
            match ty {
                $(GgmlType::$ty => if scalar {
                    ($m::FORMAT.dequantize_scalar)(src, dst)
                } else {
                    ($m::FORMAT.dequantize)(src, dst)
                },)*
            }
        }

        fn quantize_with(ty: GgmlType, from_float: bool, src: &[f32], dst: &mut [u8]) {
            match ty {
                $(GgmlType::$ty => if from_float {
                    ($m::FORMAT.from_float)(src, dst)
                } else {
                    ($m::FORMAT.quantize)(src, dst)
                },)*
            }
        }

        /// Dot product of one weight row of type `ty` with one activation row already rounded to
        /// `vec_dot_type(ty)` (by [`quantize_activation`]): integer per block, SIMD where
        /// available.
        pub fn vec_dot(ty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
            match ty {
                $(GgmlType::$ty => ($m::FORMAT.vec_dot)(w, a),)*
            }
        }
    };
}

formats! {
    F32 = 0 => f32,
    F16 = 1 => f16,
    Q4_0 = 2 => q4_0,
    Q4_1 = 3 => q4_1,
    Q5_0 = 6 => q5_0,
    Q5_1 = 7 => q5_1,
    Q8_0 = 8 => q8_0,
    Q8_1 = 9 => q8_1,
    Q2_K = 10 => q2_k,
    Q3_K = 11 => q3_k,
    Q4_K = 12 => q4_k,
    Q5_K = 13 => q5_k,
    Q6_K = 14 => q6_k,
    Q8_K = 15 => q8_k,
    IQ4_NL = 20 => iq4_nl,
    IQ4_XS = 23 => iq4_xs,
    BF16 = 30 => bf16,
}

// The table, checked when it compiles: each module's FORMAT names its own type, ids ascend,
// and a weight's blocks line up with its activation type's, whose own activation type it is.
const _: () = {
    let all = GgmlType::ALL;
    let mut i = 0;
    while i < all.len() {
        let f = all[i].format();
        assert!(f.ty as u32 == all[i] as u32, "a FORMAT names another type");
        assert!(i == 0 || (all[i - 1] as u32) < all[i] as u32, "ids ascend");
        assert!(f.block > 0 && f.bytes > 0);
        let a = f.vec_dot_type.format();
        assert!(a.block == f.block, "weight and activation blocks line up");
        assert!(a.vec_dot_type as u32 == f.vec_dot_type as u32);
        i += 1;
    }
};

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().copied().find(|t| *t as u32 == id)
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// Name as ggml's `ggml_type_name` prints it (lower case, e.g. `q4_K`).
    pub fn name(self) -> &'static str {
        self.format().name
    }

    /// Parse a type name, case-insensitively (`q4_k`, `Q4_K`, `f16`).
    pub fn parse(s: &str) -> Option<GgmlType> {
        let l = s.to_ascii_lowercase();
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.name().to_ascii_lowercase() == l)
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.format().block
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.format().bytes
    }

    /// Bytes for `n` elements, or None when `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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
    dequantize_with(ty, false, src, dst);
    Ok(())
}

/// The scalar twin of [`dequantize_row`]: plain Rust, the readable definition of each format.
pub fn dequantize_row_scalar(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check(ty, dst.len(), src.len())?;
    dequantize_with(ty, true, src, dst);
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
    quantize_with(ty, false, src, dst);
    Ok(())
}

/// Round a matmul input row to activation type `ty` exactly as the x86 CPU backend of
/// ggml does at run time ([`Format::from_float`]). For Q8_0/Q8_1 that is the AVX quantizer,
/// which differs from the `_ref` one in rare ties (see q8_0.rs); Q8_K, f16 and bf16 use the
/// reference conversion. Panics if `dst` has the wrong length (callers size it).
pub fn quantize_activation(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    check(ty, src.len(), dst.len()).expect("activation buffer sized by the caller");
    quantize_with(ty, true, src, dst);
}

/// The activation type ggml's CPU backend quantizes the input row to before a matmul with a
/// weight of type `ty` ([`Format::vec_dot_type`]).
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    ty.format().vec_dot_type
}

/// The dot product of activation-only types used as weights (Q8_1, Q8_K; no converter writes
/// them, ggml has no kernel): both rows decoded with `decode`, then the f32 dot.
pub(crate) fn dot_decoded(
    ty: GgmlType,
    w: &[u8],
    a: &[u8],
    decode: Dequant,
    dot: fn(&[f32], &[f32]) -> f32,
) -> f32 {
    let n = w.len() / ty.type_size() * ty.block_size();
    let (mut x, mut y) = (vec![0.0; n], vec![0.0; n]);
    decode(w, &mut x);
    decode(a, &mut y);
    dot(&x, &y)
}
