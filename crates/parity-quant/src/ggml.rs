//! Scalar helpers that restate ggml C code (ggml-quants.c, ggml-impl.h) shared by several
//! formats: f16 storage, `nearest_int`, the K-quant scale packing and fitting, and C's
//! float-to-byte conversion as x86 compiles it.

/// f16 bits at `b[0..2]` (little endian) to f32.
#[inline]
pub fn f16_le(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Store `v` as little-endian f16 bits at `b[0..2]` (round to nearest even, as ggml's
/// `GGML_FP32_TO_FP16`).
#[inline]
pub fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

// ---- K-quant helpers (ggml-quants.c), shared by the 256-element super-block formats ----

/// Elements per K-quant super-block (`QK_K`).
pub const QK_K: usize = 256;

/// ggml's `GROUP_MAX_EPS`: a group whose largest |x| is below this quantizes to all zeros.
pub const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: adding 1.5·2²³ leaves the rounded integer in the low mantissa bits, so
/// this rounds half to even for |x| ≤ 2²². Outside that range it returns the same garbage as ggml.
#[inline]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `get_scale_min_k4`: the `j`-th 6-bit (scale, min) pair of a Q4_K/Q5_K `scales[12]`.
/// Pairs 0..4 sit in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins); pairs 4..8 keep
/// their low nibbles in bytes 8..12 and their top 2 bits in the spare bits of bytes 0..8.
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml's `make_qkx2_quants`: fit `x ≈ scale·L − min` with `L` in `0..=nmax`, minimising the
/// weighted error (|e| when `use_mad`, else e²) over `nstep + 1` trial scales. Writes `L` and
/// returns `(scale, min)` (ggml's return value and `*the_min`). `x.len() <= 32`.
/// Every float operation keeps ggml's order: the result must match its quantizer bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut laux = [0u8; 32];
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        best_error += weights[i] * err(scale * q as f32 + min - x[i]);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                cur_error += weights[i] * err(this_scale * laux[i] as f32 + this_min - x[i]);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// C's `(int8_t)x` / `(uint8_t)x` for a float `x`, as compiled for x86 (`cvttss2si`, then the
/// low byte): truncation toward zero when in range; NaN and |x| >= 2³¹ give 0x8000_0000, so 0.
/// The conversion is undefined behaviour in C, so this is what ggml's quantizers do on x86 when
/// a degenerate block (subnormal or infinite scale, NaN input) sends a value out of range.
#[inline]
pub fn c_float_to_byte(x: f32) -> u8 {
    cvtt_f32_i32(x) as u8
}

/// x86 `cvttss2si`: truncate toward zero; NaN and out-of-range give `i32::MIN`.
#[inline]
pub fn cvtt_f32_i32(x: f32) -> i32 {
    if x.is_nan() || !(-2_147_483_648.0..2_147_483_648.0).contains(&x) {
        i32::MIN
    } else {
        x as i32
    }
}
