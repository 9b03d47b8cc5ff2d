//! Per-tensor closeness metrics, as llama.cpp and its peers compute them.

use ndarray::ArrayViewD;
use serde::Serialize;

/// How a candidate tensor `b` differs from a baseline `a`.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Metrics {
    /// Σ(a−b)² / Σa², as ggml's test-backend-ops (0 when both are all zero).
    pub nmse: f64,
    /// a·b / (|a| |b|).
    pub cosine: f64,
    pub max_abs: f64,
    pub mean_abs: f64,
    /// 10·log10(Σa² / Σ(a−b)²) dB (PyTorch Numeric Suite's SQNR); +∞ when identical.
    pub sqnr_db: f64,
    pub n: usize,
    /// NaNs in baseline / candidate: any NaN fails.
    pub nan_a: usize,
    pub nan_b: usize,
    /// Positions where either side is ±Inf and they differ (sign included): any fails.
    pub inf_mismatch: usize,
    /// ±Inf in baseline / candidate, matched or not: no tap of a transformer holds one (an
    /// overflow), so any fails too, even the same Inf on both sides.
    pub inf_a: usize,
    pub inf_b: usize,
}

impl Metrics {
    /// NaN or Inf on either side: fails whatever the tolerance.
    pub fn non_finite_failure(&self) -> bool {
        self.nan_a > 0 || self.nan_b > 0 || self.inf_mismatch > 0 || self.inf_a + self.inf_b > 0
    }

    /// The finding a non-finite value is, named where it first appears (`key`, the first
    /// failing key in graph order), with each side's counts (`a`, `b` name the sides); None
    /// when every value is finite. Nothing is to be judged or confirmed from such data.
    pub fn non_finite_text(&self, key: &crate::trace::TapKey, a: &str, b: &str) -> Option<String> {
        if !self.non_finite_failure() {
            return None;
        }
        let mut parts = Vec::new();
        for (nan, inf, who) in [(self.nan_b, self.inf_b, b), (self.nan_a, self.inf_a, a)] {
            if nan > 0 {
                parts.push(format!("{nan} NaN in {who}"));
            }
            if inf > 0 {
                parts.push(format!("{inf} ±Inf in {who}"));
            }
        }
        let what = if self.nan_a + self.nan_b > 0 {
            "NaN"
        } else {
            "Inf"
        };
        Some(format!(
            "{what} first appears at {key} ({}, of {} values): a non-finite value is a finding of its own (an overflow, a division by zero, a fully masked softmax row)",
            parts.join(", "),
            self.n
        ))
    }
}

/// The running sums of `metrics`, in element order.
#[derive(Default)]
struct Sums {
    saa: f64,
    sbb: f64,
    sab: f64,
    see: f64,
    max_abs: f64,
    sum_abs: f64,
    nan_a: usize,
    nan_b: usize,
    inf_mismatch: usize,
    n_finite: usize,
    inf_a: usize,
    inf_b: usize,
}

/// Lanes of the finite fast path: independent running sums the CPU overlaps (one chain of f64
/// additions waits on each add's latency); four fit SSE2's registers, six sums each.
const LANES: usize = 4;

/// The finite fast path's running state: [`LANES`] interleaved partial sums of each kind.
#[derive(Clone, Copy, Default)]
struct Lanes {
    saa: [f64; LANES],
    sbb: [f64; LANES],
    sab: [f64; LANES],
    see: [f64; LANES],
    sabs: [f64; LANES],
    max: [f64; LANES],
}

impl Lanes {
    /// Go on summing `x`, `y`, element `i` into lane `i % LANES` (the lanes continue where the
    /// last slice left them: slices whose lengths are multiples of [`LANES`] sum as one tensor
    /// does). Returns whether every value was finite.
    fn push(&mut self, x: &[f32], y: &[f32]) -> bool {
        // A local copy, so that the sums stay in registers through the loop.
        let mut lanes = *self;
        let Lanes {
            saa,
            sbb,
            sab,
            see,
            sabs,
            max,
        } = &mut lanes;
        // Exponent bits all set: NaN or Inf (checked once at the end, branch-free here).
        let mut non_finite = 0u32;
        let mut add = |l: usize, a: f32, b: f32| {
            non_finite |= (a.to_bits() & 0x7f80_0000 == 0x7f80_0000) as u32
                | (b.to_bits() & 0x7f80_0000 == 0x7f80_0000) as u32;
            let (a, b) = (a as f64, b as f64);
            let d = a - b;
            saa[l] += a * a;
            sbb[l] += b * b;
            sab[l] += a * b;
            see[l] += d * d;
            sabs[l] += d.abs();
            max[l] = max[l].max(d.abs());
        };
        let (xc, yc) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
        let (xr, yr) = (xc.remainder(), yc.remainder());
        for (xs, ys) in xc.zip(yc) {
            for l in 0..LANES {
                add(l, xs[l], ys[l]);
            }
        }
        for (l, (&a, &b)) in xr.iter().zip(yr).enumerate() {
            add(l, a, b);
        }
        *self = lanes;
        non_finite == 0
    }

    fn total(&self, n_finite: usize) -> Sums {
        let total = |v: [f64; LANES]| v.iter().sum::<f64>();
        Sums {
            saa: total(self.saa),
            sbb: total(self.sbb),
            sab: total(self.sab),
            see: total(self.see),
            max_abs: self.max.iter().copied().fold(0.0, f64::max),
            sum_abs: total(self.sabs),
            n_finite,
            ..Sums::default()
        }
    }
}

/// [`metrics`] of a tensor handed over in slices, in order (a prompt's logits, computed and
/// compared a slice of rows at a time, never held whole). Slices whose lengths are multiples
/// of 4 give the metrics of the whole tensor bit for bit; a slice holding a NaN or an Inf is
/// summed element by element and added to the rest (its counts exact, the sums' last bits
/// may differ from the whole tensor's).
#[derive(Default)]
pub struct MetricsAcc {
    lanes: Lanes,
    finite_n: usize,
    /// The slices with a non-finite value, summed element by element.
    general: Option<Sums>,
    n: usize,
}

impl MetricsAcc {
    /// Add the next slice of the baseline (`a`) and the candidate (`b`), of equal lengths.
    pub fn push(&mut self, a: &[f32], b: &[f32]) {
        debug_assert_eq!(a.len(), b.len());
        self.n += a.len();
        let before = self.lanes;
        if self.lanes.push(a, b) {
            self.finite_n += a.len();
            return;
        }
        self.lanes = before;
        let s = Sums::of(a.iter().zip(b));
        self.general = Some(match self.general.take() {
            Some(g) => g.plus(s),
            None => s,
        });
    }

    pub fn finish(self) -> Metrics {
        let lanes = self.lanes.total(self.finite_n);
        let s = match self.general {
            // Nothing finite-only was summed: the element-by-element sums alone, as a whole
            // tensor holding a NaN is summed.
            Some(g) if self.finite_n == 0 => g,
            Some(g) => lanes.plus(g),
            None => lanes,
        };
        s.metrics(self.n)
    }
}

impl Sums {
    /// Finite tensors (nearly every comparison) summed in [`LANES`] interleaved partial sums,
    /// added up at the end; where any value is NaN or Inf the general element-by-element path
    /// runs instead. The order differs from [`Sums::of`] only in f64 rounding (relative 1e-16),
    /// not in any zero: `see` is 0 exactly when every difference is.
    fn of_slices(x: &[f32], y: &[f32]) -> Sums {
        let mut lanes = Lanes::default();
        if !lanes.push(x, y) {
            return Sums::of(x.iter().zip(y));
        }
        lanes.total(x.len())
    }

    fn plus(self, o: Sums) -> Sums {
        Sums {
            saa: self.saa + o.saa,
            sbb: self.sbb + o.sbb,
            sab: self.sab + o.sab,
            see: self.see + o.see,
            max_abs: self.max_abs.max(o.max_abs),
            sum_abs: self.sum_abs + o.sum_abs,
            nan_a: self.nan_a + o.nan_a,
            nan_b: self.nan_b + o.nan_b,
            inf_mismatch: self.inf_mismatch + o.inf_mismatch,
            n_finite: self.n_finite + o.n_finite,
            inf_a: self.inf_a + o.inf_a,
            inf_b: self.inf_b + o.inf_b,
        }
    }

    fn of<'a>(pairs: impl Iterator<Item = (&'a f32, &'a f32)>) -> Sums {
        let mut s = Sums::default();
        for (&x, &y) in pairs {
            s.inf_a += x.is_infinite() as usize;
            s.inf_b += y.is_infinite() as usize;
            if x.is_nan() || y.is_nan() {
                s.nan_a += x.is_nan() as usize;
                s.nan_b += y.is_nan() as usize;
                continue;
            }
            if x.is_infinite() || y.is_infinite() {
                // Inf must match with sign; a matched Inf contributes no error.
                if x != y {
                    s.inf_mismatch += 1;
                }
                continue;
            }
            let (x, y) = (x as f64, y as f64);
            let d = x - y;
            s.saa += x * x;
            s.sbb += y * y;
            s.sab += x * y;
            s.see += d * d;
            s.max_abs = s.max_abs.max(d.abs());
            s.sum_abs += d.abs();
            s.n_finite += 1;
        }
        s
    }
}

/// Compare two tensors of the same number of elements, in logical (row-major) order.
pub fn metrics(a: &ArrayViewD<f32>, b: &ArrayViewD<f32>) -> Metrics {
    debug_assert_eq!(a.len(), b.len());
    // Contiguous tensors (every trace's) are read as slices: ndarray's general iterator costs
    // several times the arithmetic. The sums are the same, in the same order.
    let s = match (a.as_slice(), b.as_slice()) {
        (Some(x), Some(y)) => Sums::of_slices(x, y),
        _ => Sums::of(a.iter().zip(b.iter())),
    };
    s.metrics(a.len())
}

/// The NMSE of `b` against the baseline `a`, two slices of the same length (as [`metrics`]).
pub fn slice_nmse(a: &[f32], b: &[f32]) -> f64 {
    debug_assert_eq!(a.len(), b.len());
    Sums::of_slices(a, b).metrics(a.len()).nmse
}

impl Sums {
    /// The metrics of these sums over `n` values.
    fn metrics(self, n: usize) -> Metrics {
        let Sums {
            saa,
            sbb,
            sab,
            see,
            max_abs,
            sum_abs,
            nan_a,
            nan_b,
            inf_mismatch,
            n_finite,
            inf_a,
            inf_b,
        } = self;
        let nmse = if see == 0.0 {
            0.0
        } else if saa == 0.0 {
            f64::INFINITY
        } else {
            see / saa
        };
        let cosine = if saa == 0.0 && sbb == 0.0 {
            1.0
        } else if saa == 0.0 || sbb == 0.0 {
            0.0
        } else {
            sab / (saa.sqrt() * sbb.sqrt())
        };
        let sqnr_db = if see == 0.0 {
            f64::INFINITY
        } else {
            10.0 * (saa / see).log10()
        };
        Metrics {
            nmse,
            cosine,
            max_abs,
            mean_abs: if n_finite > 0 {
                sum_abs / n_finite as f64
            } else {
                0.0
            },
            sqnr_db,
            n,
            nan_a,
            nan_b,
            inf_mismatch,
            inf_a,
            inf_b,
        }
    }
}

/// Logit statistics for one row: KL(p_base ‖ p_cand), top-1 agreement, top-5 overlap.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct LogitStats {
    pub kld: f64,
    pub top1_base: u32,
    pub top1_cand: u32,
    pub top5_overlap: usize,
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    x.iter().map(|&v| v as f64 - lse).collect()
}

fn top_k(x: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    // Stable sort keeps the lowest index first on ties, like the greedy sampler.
    idx.sort_by(|&i, &j| x[j as usize].total_cmp(&x[i as usize]));
    idx.truncate(k);
    idx
}

/// KLD as llama-perplexity computes it: Σ p_base (log p_base − log p_cand), skipping entries
/// with log p_base ≤ −16 (they carry no mass worth comparing).
pub fn logit_stats(base: &[f32], cand: &[f32]) -> LogitStats {
    let (lb, lc) = (log_softmax(base), log_softmax(cand));
    let kld = lb
        .iter()
        .zip(&lc)
        .filter(|(b, _)| **b > -16.0)
        .map(|(&b, &c)| b.exp() * (b - c))
        .sum::<f64>()
        .max(0.0);
    let (tb, tc) = (top_k(base, 5), top_k(cand, 5));
    LogitStats {
        kld,
        top1_base: tb[0],
        top1_cand: tc[0],
        top5_overlap: tb.iter().filter(|i| tc.contains(i)).count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{ArrayD, IxDyn};

    fn arr(v: &[f32]) -> ArrayD<f32> {
        ArrayD::from_shape_vec(IxDyn(&[v.len()]), v.to_vec()).unwrap()
    }

    /// Slices summed one after another (each but the last a multiple of 4 values long) give
    /// the whole tensor's metrics bit for bit; one holding a NaN or an Inf gives its counts
    /// exactly and its sums to f64 rounding.
    #[test]
    fn metrics_of_slices_are_the_whole_tensor_s() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        };
        let a: Vec<f32> = (0..1003).map(|_| next()).collect();
        let b: Vec<f32> = a.iter().map(|v| v + next() * 1e-3).collect();
        let whole = metrics(&arr(&a).view(), &arr(&b).view());
        for cut in [4, 8, 100, 500, 1000, 1003] {
            let mut acc = MetricsAcc::default();
            for (x, y) in a.chunks(cut).zip(b.chunks(cut)) {
                acc.push(x, y);
            }
            assert_eq!(acc.finish(), whole, "slices of {cut}");
        }
        let (mut an, mut bn) = (a.clone(), b.clone());
        an[10] = f32::NAN;
        bn[600] = f32::INFINITY;
        let whole = metrics(&arr(&an).view(), &arr(&bn).view());
        let mut acc = MetricsAcc::default();
        for (x, y) in an.chunks(100).zip(bn.chunks(100)) {
            acc.push(x, y);
        }
        let m = acc.finish();
        assert_eq!(
            (m.n, m.nan_a, m.nan_b, m.inf_a, m.inf_b, m.inf_mismatch),
            (whole.n, 1, 0, 0, 1, 1)
        );
        assert!((m.nmse / whole.nmse - 1.0).abs() < 1e-12, "{m:?} {whole:?}");
        assert_eq!(m.max_abs, whole.max_abs);
        // One slice alone is the whole tensor, NaN or not.
        let mut acc = MetricsAcc::default();
        acc.push(&an, &bn);
        assert_eq!(acc.finish(), whole);
    }

    #[test]
    fn nmse_matches_definition() {
        let a = arr(&[1.0, 2.0, 3.0]);
        let b = arr(&[1.0, 2.0, 4.0]);
        let m = metrics(&a.view(), &b.view());
        assert!((m.nmse - 1.0 / 14.0).abs() < 1e-15);
        assert_eq!(m.max_abs, 1.0);
        assert!((m.sqnr_db - 10.0 * 14f64.log10()).abs() < 1e-12);
    }

    #[test]
    fn nan_and_inf_rules() {
        let a = arr(&[1.0, f32::INFINITY]);
        // The same Inf on both sides is no error between them, and still a failure: no tap
        // holds an Inf (issue 20: two identical traces with +Inf logits are not "parity").
        let same = metrics(&a.view(), &arr(&[1.0, f32::INFINITY]).view());
        assert!(same.non_finite_failure());
        assert_eq!((same.inf_a, same.inf_b, same.inf_mismatch), (1, 1, 0));
        assert_eq!(same.nmse, 0.0);
        let flipped = metrics(&a.view(), &arr(&[1.0, f32::NEG_INFINITY]).view());
        assert!(flipped.non_finite_failure());
        let nan = metrics(&a.view(), &arr(&[f32::NAN, f32::INFINITY]).view());
        assert_eq!(nan.nan_b, 1);
        assert!(nan.non_finite_failure());
    }

    proptest::proptest! {
        /// The lanes of the finite fast path give the element-by-element sums up to f64
        /// rounding, every count the same, and no error exactly where the tensors are equal.
        #[test]
        fn the_fast_path_sums_as_the_general_one(
            x in proptest::collection::vec(-1e4f32..1e4, 0..70),
            noise in proptest::collection::vec(-1f32..1.0, 70),
            scale in 0f32..1e-2,
        ) {
            let y: Vec<f32> = x.iter().zip(&noise).map(|(a, n)| a + n * scale * a.abs()).collect();
            let (f, g) = (Sums::of_slices(&x, &y), Sums::of(x.iter().zip(&y)));
            let close = |p: f64, q: f64| (p - q).abs() <= 1e-12 * p.abs().max(q.abs());
            for (p, q) in [(f.saa, g.saa), (f.sbb, g.sbb), (f.sab, g.sab), (f.see, g.see), (f.sum_abs, g.sum_abs)] {
                proptest::prop_assert!(close(p, q), "{p} vs {q}");
            }
            proptest::prop_assert_eq!(f.max_abs, g.max_abs);
            proptest::prop_assert_eq!(f.n_finite, g.n_finite);
            proptest::prop_assert_eq!(f.see == 0.0, x == y);
            proptest::prop_assert_eq!(Sums::of_slices(&x, &x).see, 0.0);
        }
    }

    #[test]
    fn kld_zero_for_identical_and_positive_otherwise() {
        let a = [1.0, 2.0, 3.0, 0.5, -1.0, 0.0];
        let s = logit_stats(&a, &a);
        assert!(s.kld.abs() < 1e-12);
        assert_eq!(s.top1_base, 2);
        assert_eq!(s.top5_overlap, 5);
        let b = [3.0, 2.0, 1.0, 0.5, -1.0, 0.0];
        let s = logit_stats(&a, &b);
        assert!(s.kld > 0.1);
        assert_ne!(s.top1_base, s.top1_cand);
    }
}
