//! The noise floor of an own error: how far a *correct* engine's op may sit from the
//! reference's recomputation of it, from the same inputs. Measurements and reasoning:
//! docs/tolerances.md, section "Own error".
//!
//! Each op class has an absolute floor set by f32 arithmetic (summation order, libm ulps), far
//! below what any real bug moves. Matmuls add the one thing the reference cannot know exactly:
//! an engine's activation rounding. Under the rounding that reproduces the engine they sit at
//! ~1e-13; under the best of the roundings parity knows, an engine that rounds otherwise
//! (another 8-bit scheme, a GPU's tiles) sits at ~1e-5..1e-4 on every matmul alike, so the
//! matmul floor follows the median matmul own error of the trace (capped: a bug in every
//! matmul — a decoder — moves NMSE to ~1, far above the cap).
//!
//! A key whose inputs the candidate did not dump is judged as the span of ops from the
//! nearest taps it has; inside a span an activation that sits on a quantization boundary may
//! round the other way than in the engine (f32 noise upstream decides), so spans through a
//! rounded matmul carry a flip floor.

use super::replay::{Setup, Window};
use crate::backend::Emulation;
use crate::backend::family::Act;
use crate::backend::kvcache::KvCache;
use crate::gguf::GgmlType;
use crate::model::Model;
use crate::trace::{Tap, TapKey};

pub use super::opclass::{OpClass, class};
pub use super::span::{SpanOps, span};

/// Embedding rows: any correct decoder gives the same f32 (or f16-exact) values.
pub const LOOKUP: f64 = 1e-12;
/// RMSNorm: the mean of squares in any f32 order; an rms eps off by 10× sits 1-4 orders above.
pub const NORM: f64 = 1e-11;
/// Residual adds and SwiGLU (expf ulps).
pub const ELEMENTWISE: f64 = 1e-10;
/// RoPE at position 0..16; grows with position (see [`rope_floor`]).
pub const ROPE: f64 = 1e-10;
/// Attention: f16 K/V caches and flash attention's f16 accumulation (llama.cpp's defaults:
/// kqv_out at up to 8e-7) stay below this; a mask, position, scale or head-map bug sits at
/// 1e-3..1.
pub const ATTENTION: f64 = 1e-5;
/// Matmuls under the rounding that reproduces the engine.
pub const MM_ABS: f64 = 1e-10;
/// How far above the trace's median matmul own error a matmul may sit.
pub const MM_FACTOR: f64 = 100.0;
/// The highest the matmul floor may climb (an 8-bit activation rounding unlike ours).
pub const MM_CAP: f64 = 1e-3;
/// A span through a matmul whose inputs are rounded: one activation flipping to the next
/// quantum changes the span's output by up to this much.
pub const FLIP: f64 = 1e-5;
/// Spans through a rounded matmul also follow the trace's own span noise: an engine whose
/// attention is less exact than the reference's (llama.cpp's defaults: f16 K/V cache, flash
/// attention accumulating in f16; kqv_out ~8e-7) feeds the next quantized matmul inputs that
/// round the other way far more often, and its l_out spans sit at 3e-5..1.1e-4 against 1e-6
/// for the tight golden. The floor climbs to `SPAN_ADAPT` × the median span error, at most
/// `SPAN_CAP`; a bug in every layer that moves each span by more than that is still found
/// (wrong rope theta: 7e-3; GQA head map: 0.5).
pub const SPAN_ADAPT: f64 = 30.0;
pub const SPAN_CAP: f64 = 1e-3;
/// A candidate tensor stored in f16 (every value f16-exact) carries f16's rounding (~1e-7).
pub const F16_STORAGE: f64 = 1e-6;

/// RoPE's floor at positions up to `pos_max`: engines compute the rotation angles in f32 in
/// different ways (powf per dimension, or ggml's repeated multiplication), an angle error
/// growing like pos · 1e-7.
pub fn rope_floor(pos_max: usize) -> f64 {
    ROPE.max(10.0 * (1e-7 * pos_max as f64).powi(2))
}

/// Whether the reference rounds the inputs of a matmul with weights `ty` under `r`.
pub fn rounds_inputs(r: Emulation, ty: GgmlType) -> bool {
    match r.family().act {
        Act::F32 => false,
        Act::F16 | Act::Bf16 | Act::Tf32 => true,
        // Whatever the row length (Q8_K falls back to the CPU's type on short rows).
        Act::VecDot | Act::Q8KQuantized | Act::Q8_1Quantized => {
            r.act_type(ty, 256) != GgmlType::F32
        }
    }
}

/// The floor policy for one judgement: the chosen rounding and the trace's matmul noise.
#[derive(Clone)]
pub struct Floors {
    pub rounding: Emulation,
    /// The decode steps' rounding where it differs (`Setup::decode`).
    pub decode: Option<Emulation>,
    /// The output projection's rounding where it differs (`Setup::output`).
    pub output: Option<Emulation>,
    /// The cache the decode steps read where it differs from the prompt's (`Setup::kv_decode`).
    pub kv_decode: Option<KvCache>,
    /// Median own NMSE of the matmuls judged on their own (None: the trace has none).
    pub mm_median_own: Option<f64>,
    /// Median own NMSE of the spans that contain a matmul.
    pub mm_median_span: Option<f64>,
    pub flips: bool,
    pub pos_max: usize,
}

impl Floors {
    /// The output projection rounds as `o` (where it differs from its step's rounding).
    pub fn with_output(mut self, model: &Model, o: Option<Emulation>) -> Floors {
        self.output = o;
        self.flips |= o.is_some_and(|o| rounds_inputs(o, model.output.ty));
        self
    }

    /// The same floors with the layers rounded as `rounding` and the output projection as
    /// `output` (where it differs).
    pub fn rounded(&self, model: &Model, rounding: Emulation, output: Option<Emulation>) -> Floors {
        let output = output.filter(|&o| o != rounding);
        Floors {
            mm_median_own: self.mm_median_own,
            mm_median_span: self.mm_median_span,
            kv_decode: self.kv_decode,
            ..Floors::new(model, rounding, self.decode, self.pos_max).with_output(model, output)
        }
    }

    pub fn new(
        model: &Model,
        rounding: Emulation,
        decode: Option<Emulation>,
        pos_max: usize,
    ) -> Floors {
        let flips = model
            .layers
            .iter()
            .flat_map(|l| [l.wq.ty, l.w_down.ty])
            .chain([model.output.ty])
            .any(|ty| rounds_inputs(rounding, ty) || decode.is_some_and(|d| rounds_inputs(d, ty)));
        Floors {
            rounding,
            decode,
            output: None,
            kv_decode: None,
            mm_median_own: None,
            mm_median_span: None,
            flips,
            pos_max,
        }
    }

    pub fn matmul(&self) -> f64 {
        let med = self.mm_median_own.or(self.mm_median_span).unwrap_or(0.0);
        MM_ABS.max(MM_CAP.min(MM_FACTOR * med))
    }

    pub fn op(&self, tap: Tap) -> f64 {
        match class(tap) {
            OpClass::Lookup => LOOKUP,
            OpClass::Norm => NORM,
            OpClass::Matmul => self.matmul(),
            OpClass::Rope => rope_floor(self.pos_max),
            OpClass::Attention => ATTENTION,
            OpClass::Elementwise => ELEMENTWISE,
        }
    }

    /// The floor of a key whose recomputation is `span`.
    pub fn key(&self, k: &TapKey, span: &SpanOps) -> f64 {
        if span.len <= 1 {
            return self.op(k.tap);
        }
        let ops = span.taps.iter().map(|&t| self.op(t)).fold(0.0f64, f64::max);
        let has_mm = span.taps.iter().any(|&t| class(t) == OpClass::Matmul);
        // A span's noise is its ops' noise carried through (each floor already sits 10× or
        // more above what a correct engine shows), plus flips where it rounds activations.
        let mut f = ops;
        if has_mm && self.flips {
            f = f.max(FLIP);
            if let Some(m) = self.mm_median_span {
                f = f.max(SPAN_CAP.min(SPAN_ADAPT * m));
            }
        }
        if has_mm
            && !self.flips
            && self.mm_median_own.is_none()
            && let Some(m) = self.mm_median_span
        {
            // No matmul judged on its own and no rounding that explains the engine: the
            // span noise is the rounding mismatch itself.
            f = f.max(MM_CAP.min(MM_FACTOR * m));
        }
        f
    }
}

/// Median of `v` (None when empty).
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}

/// The clean replay of `window` under the measured rounding and cache: what each experiment
/// at a key varies one thing of.
pub(super) fn clean_setup(floors: &Floors, kv: KvCache, window: Window) -> Setup {
    Setup {
        decode: floors.decode,
        output: floors.output,
        kv,
        kv_decode: floors.kv_decode,
        ..Setup::clean(floors.rounding, window)
    }
}
