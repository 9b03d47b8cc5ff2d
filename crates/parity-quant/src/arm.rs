//! NEON building blocks shared by the block formats' aarch64 kernels (NEON is baseline there).

use std::arch::aarch64::*;

/// The first 16 bytes of `s`.
#[inline]
#[target_feature(enable = "neon")]
pub(crate) fn load_u8x16(s: &[u8]) -> uint8x16_t {
    let s = &s[..16];
    // SAFETY: `s` holds 16 readable bytes; vld1q has no alignment requirement.
    unsafe { vld1q_u8(s.as_ptr()) }
}

/// Store 4 floats to `dst[..4]`.
#[inline]
#[target_feature(enable = "neon")]
fn store_f32x4(dst: &mut [f32], v: float32x4_t) {
    let dst = &mut dst[..4];
    // SAFETY: `dst` holds 4 writable floats; vst1q has no alignment requirement.
    unsafe { vst1q_f32(dst.as_mut_ptr(), v) }
}

/// 16 signed bytes as 4 vectors of floats (exact).
#[inline]
#[target_feature(enable = "neon")]
fn widen(q: int8x16_t) -> [float32x4_t; 4] {
    let (lo, hi) = (vmovl_s8(vget_low_s8(q)), vmovl_high_s8(q));
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

/// `dst[i] = d * q[i]` for 16 signed bytes, rounded like the scalar `d * q as f32`.
#[inline]
#[target_feature(enable = "neon")]
pub(crate) fn store_scaled_i8x16(dst: &mut [f32], q: int8x16_t, d: f32) {
    for (i, v) in widen(q).into_iter().enumerate() {
        store_f32x4(&mut dst[4 * i..], vmulq_n_f32(v, d));
    }
}

/// `dst[i] = d * q[i] - m` for 16 signed bytes: multiply then subtract (no fused op), as the
/// scalar `d * q as f32 - m`.
#[inline]
#[target_feature(enable = "neon")]
pub(crate) fn store_affine_i8x16(dst: &mut [f32], q: int8x16_t, d: f32, m: f32) {
    let m = vdupq_n_f32(m);
    for (i, v) in widen(q).into_iter().enumerate() {
        store_f32x4(&mut dst[4 * i..], vsubq_f32(vmulq_n_f32(v, d), m));
    }
}

/// `v >> n` in every byte, for a run-time `n` (vshlq shifts right by a negative count).
#[inline]
#[target_feature(enable = "neon")]
pub(crate) fn shr_u8(v: uint8x16_t, n: usize) -> uint8x16_t {
    vshlq_u8(v, vdupq_n_s8(-(n as i8)))
}

/// The 32 nibbles of `qs[0..16]`: (low nibbles = elements 0..16, high = 16..32).
#[inline]
pub fn nibbles_32(qs: &[u8; 16]) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: `qs` is 16 readable bytes.
    let v = unsafe { vld1q_u8(qs.as_ptr()) };
    unsafe { (vandq_u8(v, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(v)) }
}

/// Byte j of the result is 0xFF where bit `j + 16*half` of `bits` is set.
#[inline]
pub fn bits_16(bits: u32, half: u32) -> uint8x16_t {
    let b = (bits >> (16 * half)) as u16;
    let sel: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bytes: [u8; 16] = [
        b as u8,
        b as u8,
        b as u8,
        b as u8,
        b as u8,
        b as u8,
        b as u8,
        b as u8,
        (b >> 8) as u8,
        (b >> 8) as u8,
        (b >> 8) as u8,
        (b >> 8) as u8,
        (b >> 8) as u8,
        (b >> 8) as u8,
        (b >> 8) as u8,
        (b >> 8) as u8,
    ];
    // SAFETY: plain loads of local arrays; NEON is baseline.
    unsafe {
        let sel = vld1q_u8(sel.as_ptr());
        vtstq_u8(vld1q_u8(bytes.as_ptr()), sel)
    }
}

/// Exact `sum(x[i]*y[i])` over 16 signed bytes.
#[inline]
pub fn dot_i8x16(x: int8x16_t, y: int8x16_t) -> i32 {
    // SAFETY: register-only intrinsics; NEON is baseline.
    unsafe {
        let lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
        let hi = vmull_high_s8(x, y);
        vaddvq_s32(vaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)))
    }
}

/// `y[i] = q[i] as f32 * d (+ m)` for 16 signed bytes; multiply and add stay separate.
#[inline]
pub fn store_scaled(q: int8x16_t, d: f32, m: Option<f32>, y: &mut [f32]) {
    assert!(y.len() >= 16);
    // SAFETY: 16 floats are writable at `y`; the rest are register-only intrinsics.
    unsafe {
        let w_lo = vmovl_s8(vget_low_s8(q));
        let w_hi = vmovl_high_s8(q);
        let parts = [
            vmovl_s16(vget_low_s16(w_lo)),
            vmovl_high_s16(w_lo),
            vmovl_s16(vget_low_s16(w_hi)),
            vmovl_high_s16(w_hi),
        ];
        for (k, p) in parts.into_iter().enumerate() {
            let mut v = vmulq_n_f32(vcvtq_f32_s32(p), d);
            if let Some(m) = m {
                v = vaddq_f32(v, vdupq_n_f32(m));
            }
            vst1q_f32(y.as_mut_ptr().add(4 * k), v);
        }
    }
}
