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

/// The x86 extension that gives the tile kernels `vpdpbusd` (one instruction for the
/// 4-product integer sums that AVX2 builds from `maddubs` + `madd`; the same integers, so the
/// same results): AVX-VNNI (VEX) where the CPU has it, else AVX512-VNNI with AVX512-VL (the
/// same instruction on 256-bit registers, EVEX-encoded: AMD Zen 4, Intel Ice Lake and later).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vnni {
    Avx,
    Avx512,
}

/// The [`Vnni`] extension this CPU has, if any.
pub fn vnni() -> Option<Vnni> {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<Option<Vnni>> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            if simd() != Simd::Avx2 {
                None
            } else if is_x86_feature_detected!("avxvnni") {
                Some(Vnni::Avx)
            } else if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
            {
                Some(Vnni::Avx512)
            } else {
                None
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Whether the tile kernels use [`vnni`]'s `vpdpbusd`: when the CPU has it, unless
/// `PARITY_NO_VNNI` is set (for A/B measurements).
pub fn use_vnni() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| vnni().is_some() && std::env::var_os("PARITY_NO_VNNI").is_none())
}

/// The one dispatch of every fast twin: `dispatch!(x86, neon => f(args) else f_scalar)` calls
/// `x86::f(args)` where [`simd`] says [`Simd::Avx2`], `neon::f(args)` on aarch64, and
/// `f_scalar(args)` elsewhere; leave out `x86` or `neon` for a format without that kernel.
/// The kernels live in the format file's `x86` and `neon` modules under the same name.
macro_rules! dispatch {
    (x86, neon => $f:ident($($a:expr),*) else $scalar:path) => {
        match $crate::cpu::simd() {
            // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::Simd::Avx2 => unsafe { x86::$f($($a),*) },
            #[cfg(target_arch = "aarch64")]
            $crate::cpu::Simd::Neon => {
                // SAFETY: NEON is part of the aarch64 baseline.
                #[allow(unused_unsafe)]
                let r = unsafe { neon::$f($($a),*) };
                r
            }
            _ => $scalar($($a),*),
        }
    };
    (x86 => $f:ident($($a:expr),*) else $scalar:path) => {
        match $crate::cpu::simd() {
            // SAFETY: `simd()` reports Avx2 only when avx2, fma and f16c are present.
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::Simd::Avx2 => unsafe { x86::$f($($a),*) },
            _ => $scalar($($a),*),
        }
    };
    (neon => $f:ident($($a:expr),*) else $scalar:path) => {
        match $crate::cpu::simd() {
            #[cfg(target_arch = "aarch64")]
            $crate::cpu::Simd::Neon => {
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
