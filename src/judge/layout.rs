//! Tensor layouts a trace may store a tap in, and their alignment to parity's canonical order.
//!
//! Canonical (docs/trace-format.md): `[T, n_head, head_dim]` for q/k/v (before and after RoPE)
//! and kqv_out, `[n_head, T, n_kv]` for kq_soft_max, `[T, n]` for the rest. Engines often keep
//! other orders; a manifest may declare them (`"layouts": {"q_rope": "head-major"}`), and an
//! undeclared one is named by experiment (`hypothesis`), never reported as a numeric bug.

use crate::trace::Tap;

/// How a tap is stored, relative to its canonical shape viewed as 3-d `[a, b, c]`
/// (`[T, H, D]` for head taps, `[H, T, N]` for kq_soft_max, `[T, 1, N]` for 2-d taps).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Layout {
    /// The canonical order.
    Canonical,
    /// The first two axes swapped: head-major `[H, T, D]` for a head tap, token-major
    /// `[T, H, N]` for kq_soft_max.
    SwapOuter,
    /// Head index fastest: `[T, D, H]` (heads interleaved, a flattened head dimension read the
    /// other way round).
    HeadInterleaved,
    /// The 2-d view `[T, rest]` transposed: `[rest, T]` (feature-major / column-major).
    Transposed,
    /// Each head's dimensions in Hugging Face's rotary order: the pairs (2i, 2i+1) of the
    /// converted GGUF stored at (i, i + D/2), as in an HF checkpoint's q/k rows before
    /// `convert_hf_to_gguf.py` permutes them.
    RotaryHalves,
}

/// The taps whose head dimension the Q/K row permutation of HF-to-GGUF conversion reorders.
pub fn is_rotary_tap(tap: Tap) -> bool {
    matches!(tap, Tap::Q | Tap::K | Tap::QRope | Tap::KRope)
}

/// Taps whose canonical shape is `[T, H, D]`.
pub fn is_head_tap(tap: Tap) -> bool {
    matches!(
        tap,
        Tap::Q | Tap::K | Tap::V | Tap::QRope | Tap::KRope | Tap::KqvOut
    )
}

impl Layout {
    /// Parse a declared layout for `tap`: "head-major", "token-major", "head-interleaved",
    /// "rotary-halves", "transposed" (and "canonical"). The name describes how the tensor is stored.
    pub fn parse(tap: Tap, s: &str) -> Option<Layout> {
        let head = is_head_tap(tap);
        Some(match s {
            "canonical" => Layout::Canonical,
            "head-major" if head => Layout::SwapOuter,
            "head-major" if tap == Tap::KqSoftMax => Layout::Canonical,
            "token-major" if tap == Tap::KqSoftMax => Layout::SwapOuter,
            "token-major" => Layout::Canonical,
            "head-interleaved" if head => Layout::HeadInterleaved,
            "rotary-halves" if is_rotary_tap(tap) => Layout::RotaryHalves,
            "transposed" => Layout::Transposed,
            _ => return None,
        })
    }

    /// The name a user declares for this layout of `tap` (inverse of [`Layout::parse`]).
    pub fn name(self, tap: Tap) -> &'static str {
        match self {
            Layout::Canonical => "canonical",
            Layout::SwapOuter if tap == Tap::KqSoftMax => "token-major",
            Layout::SwapOuter => "head-major",
            Layout::HeadInterleaved => "head-interleaved",
            Layout::RotaryHalves => "rotary-halves",
            Layout::Transposed => "transposed",
        }
    }

    /// The layouts worth trying for `tap` (besides canonical).
    pub fn candidates(tap: Tap) -> Vec<Layout> {
        let mut v = Vec::new();
        if is_head_tap(tap) || tap == Tap::KqSoftMax {
            v.push(Layout::SwapOuter);
        }
        if is_head_tap(tap) {
            v.push(Layout::HeadInterleaved);
        }
        if is_rotary_tap(tap) {
            v.push(Layout::RotaryHalves);
        }
        v.push(Layout::Transposed);
        v
    }

    /// Reorder `data`, stored in this layout, into the canonical order of a tensor whose
    /// canonical 3-d view is `[a, b, c]`.
    pub fn to_canonical(self, data: &[f32], [a, b, c]: [usize; 3]) -> Vec<f32> {
        debug_assert_eq!(data.len(), a * b * c);
        let mut out = vec![0.0f32; data.len()];
        match self {
            Layout::Canonical => out.copy_from_slice(data),
            Layout::SwapOuter => {
                for i in 0..a {
                    for j in 0..b {
                        out[(i * b + j) * c..][..c].copy_from_slice(&data[(j * a + i) * c..][..c]);
                    }
                }
            }
            Layout::HeadInterleaved => {
                for i in 0..a {
                    for j in 0..b {
                        for k in 0..c {
                            out[(i * b + j) * c + k] = data[(i * c + k) * b + j];
                        }
                    }
                }
            }
            Layout::Transposed => {
                let n = b * c;
                for i in 0..a {
                    for j in 0..n {
                        out[i * n + j] = data[j * a + i];
                    }
                }
            }
            Layout::RotaryHalves => {
                let half = c / 2;
                for (src, dst) in data.chunks(c).zip(out.chunks_mut(c)) {
                    for i in 0..half {
                        dst[2 * i] = src[i];
                        dst[2 * i + 1] = src[half + i];
                    }
                    if c % 2 == 1 {
                        dst[c - 1] = src[c - 1];
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Store a canonical tensor in `l` (the forward direction, written independently).
    fn store(l: Layout, x: &[f32], [a, b, c]: [usize; 3]) -> Vec<f32> {
        let mut out = Vec::new();
        match l {
            Layout::Canonical => out.extend_from_slice(x),
            Layout::SwapOuter => {
                for j in 0..b {
                    for i in 0..a {
                        out.extend_from_slice(&x[(i * b + j) * c..][..c]);
                    }
                }
            }
            Layout::HeadInterleaved => {
                for i in 0..a {
                    for k in 0..c {
                        for j in 0..b {
                            out.push(x[(i * b + j) * c + k]);
                        }
                    }
                }
            }
            Layout::Transposed => {
                for j in 0..b * c {
                    for i in 0..a {
                        out.push(x[i * b * c + j]);
                    }
                }
            }
            Layout::RotaryHalves => {
                for head in x.chunks(c) {
                    out.extend(head.iter().step_by(2));
                    out.extend(head.iter().skip(1).step_by(2));
                }
            }
        }
        out
    }

    #[test]
    fn every_layout_round_trips() {
        let dims = [3, 4, 6];
        let x: Vec<f32> = (0..72).map(|i| i as f32).collect();
        for l in [
            Layout::Canonical,
            Layout::SwapOuter,
            Layout::HeadInterleaved,
            Layout::Transposed,
            Layout::RotaryHalves,
        ] {
            let s = store(l, &x, dims);
            if l != Layout::Canonical {
                assert_ne!(s, x, "{l:?} must move something");
            }
            assert_eq!(l.to_canonical(&s, dims), x, "{l:?}");
        }
    }

    #[test]
    fn names_parse_back() {
        for tap in [Tap::QRope, Tap::K, Tap::KqSoftMax, Tap::FfnOut] {
            for l in Layout::candidates(tap) {
                assert_eq!(Layout::parse(tap, l.name(tap)), Some(l), "{tap} {l:?}");
            }
        }
        assert_eq!(Layout::parse(Tap::FfnOut, "head-major"), None);
        assert_eq!(Layout::parse(Tap::V, "rotary-halves"), None);
    }
}
