//! Which vector unit the fast twins use, and the one dispatch every format goes through.

/// Which vector unit the fast (`dequantize`, `vec_dot`) twins use on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    Scalar,
    /// x86-64 with AVX2 + FMA + F16C (checked at run time).
    Avx2,
    /// aarch64: NEON is part of the baseline.
    Neon,
}

/// The vector unit to use; `is_x86_feature_detected!` caches, so this is cheap per call.
#[inline]
pub fn simd() -> Simd {
    if cfg!(target_arch = "aarch64") {
        return Simd::Neon;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Simd::Avx2;
        }
    }
    Simd::Scalar
}

/// Whether the tile kernels use AVX-VNNI's `vpdpbusd` (one instruction for the 4-product
/// integer sums that AVX2 builds from `maddubs` + `madd`; same integers, so same results):
/// when the CPU has it, unless `PARITY_NO_VNNI` is set (for A/B measurements).
pub fn use_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            simd() == Simd::Avx2
                && is_x86_feature_detected!("avxvnni")
                && std::env::var_os("PARITY_NO_VNNI").is_none()
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The one dispatch of every fast twin: `dispatch!(x86, neon => f(args) else f_scalar)` calls
/// `x86::f(args)` where [`simd`] says [`Simd::Avx2`], `neon::f(args)` on aarch64, and
/// `f_scalar(args)` elsewhere; leave out `x86` or `neon` for a format without that kernel.
/// The kernels live in the format file's `x86` and `neon` modules under the same name.
macro_rules! dispatch {
    (x86, neon => $f:ident($($a:expr),*) else $scalar:path) => {
        match $crate::quant::cpu::simd() {
            // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
            #[cfg(target_arch = "x86_64")]
            $crate::quant::cpu::Simd::Avx2 => unsafe { x86::$f($($a),*) },
            #[cfg(target_arch = "aarch64")]
            $crate::quant::cpu::Simd::Neon => {
                // SAFETY: NEON is part of the aarch64 baseline.
                #[allow(unused_unsafe)]
                let r = unsafe { neon::$f($($a),*) };
                r
            }
            _ => $scalar($($a),*),
        }
    };
    (x86 => $f:ident($($a:expr),*) else $scalar:path) => {
        match $crate::quant::cpu::simd() {
            // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
            #[cfg(target_arch = "x86_64")]
            $crate::quant::cpu::Simd::Avx2 => unsafe { x86::$f($($a),*) },
            _ => $scalar($($a),*),
        }
    };
    (neon => $f:ident($($a:expr),*) else $scalar:path) => {
        match $crate::quant::cpu::simd() {
            #[cfg(target_arch = "aarch64")]
            $crate::quant::cpu::Simd::Neon => {
                // SAFETY: NEON is part of the aarch64 baseline.
                #[allow(unused_unsafe)]
                let r = unsafe { neon::$f($($a),*) };
                r
            }
            _ => $scalar($($a),*),
        }
    };
}
pub(crate) use dispatch;
