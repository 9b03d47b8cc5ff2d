//! Replaying a candidate trace through the reference: at every tap the candidate has, the
//! reference records what it computed from the candidate's own upstream tensors, then goes on
//! from the candidate's tensor (as `trace::ReplaySink`). The difference at a key is the
//! candidate's own error for the op, or the span of ops, that produced it.
//!
//! A replay can be limited to a *window*: decode steps up to `s_max` and layers `l0..=l1`,
//! entering layer `l0` from the candidate's `l_out` of layer `l0 - 1`. The window runs on a
//! copy of the model with only those layers (renumbered from 0, mapped back here), so an
//! experiment at layer 20 does not recompute layers 0–19.

use super::JudgeError;
use super::layout::{Layout, is_head_tap};
use super::opclass::{OpClass, class};
use crate::backend::mutation::Mutation;
use crate::backend::positions::RopeAt;
use crate::backend::{Backend, Emulation, Reference};
use crate::compare::{Metrics, MetricsAcc, metrics};
use crate::model::{Config, Model};
use crate::trace::{Sink, StepInfo, Tap, TapKey, Trace};
use ndarray::ArrayViewD;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The candidate trace, read in canonical order (declared layouts aligned on load).
pub struct Candidate<'t> {
    pub trace: &'t Trace,
    pub config: Config,
    pub layouts: HashMap<Tap, Layout>,
    /// Whether every value of the trace is finite (`all_finite`, read once).
    finite: std::sync::OnceLock<bool>,
}

impl<'t> Candidate<'t> {
    pub fn new(trace: &'t Trace, config: &Config) -> Result<Self, JudgeError> {
        let mut layouts = HashMap::new();
        for (name, l) in &trace.manifest.layouts {
            let tap = Tap::parse(name).ok_or_else(|| JudgeError::BadLayout {
                what: format!("unknown tap '{name}'"),
            })?;
            let layout = Layout::parse(tap, l).ok_or_else(|| JudgeError::BadLayout {
                what: format!(
                    "'{l}' is not a layout of {tap} (known: {})",
                    Layout::candidates(tap)
                        .iter()
                        .map(|x| x.name(tap))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
            layouts.insert(tap, layout);
        }
        Ok(Candidate {
            trace,
            config: config.clone(),
            layouts,
            finite: std::sync::OnceLock::new(),
        })
    }

    /// Whether the trace holds no NaN and no Inf anywhere (one that cannot be read counts as
    /// not: the replays then keep the finite rest's NMSE, as they always did).
    pub fn all_finite(&self) -> bool {
        *self
            .finite
            .get_or_init(|| matches!(self.first_non_finite(), Ok(None)))
    }

    /// The first key (graph order) holding a NaN or an Inf: its NaN and Inf counts and its
    /// length.
    pub fn first_non_finite(&self) -> Result<Option<(TapKey, usize, usize, usize)>, JudgeError> {
        for k in self.trace.keys() {
            let v = match (self.raw(k)?, self.cut_values(k)?) {
                (Some(v), _) | (None, Some((_, v))) => v,
                (None, None) => continue,
            };
            let nan = v.iter().filter(|x| x.is_nan()).count();
            let inf = v.iter().filter(|x| x.is_infinite()).count();
            if nan + inf > 0 {
                return Ok(Some((*k, nan, inf, v.len())));
            }
        }
        Ok(None)
    }

    /// Whether the candidate has `k` whole: what can feed the replay. A cut tensor
    /// (`kq_soft_max` for some heads or rows, [`Candidate::cut`]) is judged, never fed.
    pub fn contains(&self, k: &TapKey) -> bool {
        self.trace.contains(k) && self.cut(k).is_none()
    }

    /// What `k` was cut to, where it keeps less than the whole tensor.
    pub fn cut(&self, k: &TapKey) -> Option<crate::trace::Cut> {
        let c = self.trace.cut(k)?;
        let (t, pos0) = self.step_shape(k.step)?;
        (!c.is_whole(self.config.n_head, pos0, t)).then_some(c)
    }

    /// A cut `k`'s values head-major (`[heads kept, rows kept, n_kv]`, a declared token-major
    /// order undone), with its cut; None where `k` is not cut.
    pub fn cut_values(
        &self,
        k: &TapKey,
    ) -> Result<Option<(crate::trace::Cut, Vec<f32>)>, JudgeError> {
        let (Some(c), Some(a)) = (self.cut(k), self.trace.get(k)?) else {
            return Ok(None);
        };
        let a = match self.layouts.get(&k.tap) {
            Some(Layout::SwapOuter) => a.permuted_axes(vec![1, 0, 2]),
            _ => a,
        };
        Ok(Some((c, a.as_standard_layout().iter().copied().collect())))
    }

    /// Token count and first position of `step`.
    pub fn step_shape(&self, step: usize) -> Option<(usize, usize)> {
        let s = self.trace.manifest.steps.iter().find(|s| s.step == step)?;
        Some((s.tokens.len(), s.positions.first().copied().unwrap_or(0)))
    }

    /// The canonical shape of `k` as 3-d `[a, b, c]` (see [`Layout::to_canonical`]).
    pub fn dims(&self, k: &TapKey) -> Option<[usize; 3]> {
        let c = &self.config;
        let (t, pos0) = self.step_shape(k.step)?;
        Some(crate::arch::tap_dims(c, k.tap, t, pos0))
    }

    /// The tensor exactly as stored (flattened in its own order).
    pub fn raw(&self, k: &TapKey) -> Result<Option<Vec<f32>>, JudgeError> {
        if !self.contains(k) {
            return Ok(None);
        }
        let Some(a) = self.trace.get(k)? else {
            return Ok(None);
        };
        let dims = self.dims(k).ok_or(JudgeError::MissingStep(k.step))?;
        let want: usize = dims.iter().product();
        if a.len() != want {
            return Err(JudgeError::Shape {
                key: *k,
                found: a.shape().to_vec(),
                want,
            });
        }
        // A trace's arrays are row-major: their own vector, not a copy (a prompt's logits are
        // hundreds of MB); ndarray's general iterator otherwise.
        Ok(Some(if a.is_standard_layout() {
            let (v, offset) = a.into_raw_vec_and_offset();
            match offset {
                Some(0) | None => v,
                Some(o) => v[o..o + want].to_vec(),
            }
        } else {
            a.iter().copied().collect()
        }))
    }

    /// Whether `k` can be read a slice of rows at a time ([`Candidate::rows`]): stored in
    /// canonical order, rows on its first axis as the step's token count.
    pub fn in_rows(&self, k: &TapKey) -> bool {
        let (Some(dims), Some(shape)) = (self.dims(k), self.trace.shape(k)) else {
            return false;
        };
        self.layouts
            .get(&k.tap)
            .is_none_or(|l| *l == Layout::Canonical)
            && shape.first() == Some(&dims[0])
            && shape.iter().product::<usize>() == dims.iter().product::<usize>()
    }

    /// Rows `rows` of `k`, where [`Candidate::in_rows`].
    pub fn rows(
        &self,
        k: &TapKey,
        rows: std::ops::Range<usize>,
    ) -> Result<Option<Vec<f32>>, JudgeError> {
        Ok(self.trace.get_rows(k, rows)?)
    }

    /// The tensor in canonical order (a declared layout undone).
    pub fn get(&self, k: &TapKey) -> Result<Option<Vec<f32>>, JudgeError> {
        let Some(v) = self.raw(k)? else {
            return Ok(None);
        };
        match self.layouts.get(&k.tap) {
            Some(l) if *l != Layout::Canonical => {
                Ok(Some(l.to_canonical(&v, self.dims(k).expect("checked"))))
            }
            _ => Ok(Some(v)),
        }
    }

    /// The candidate's tensor at `k` in canonical order; where it is cut, `ours` (the
    /// reference's whole tensor) with the candidate's kept heads and rows written over it:
    /// what a row-by-row reading of both can compare (rows not kept then agree).
    pub fn get_over(&self, k: &TapKey, ours: &[f32]) -> Result<Option<Vec<f32>>, JudgeError> {
        let Some((c, v)) = self.cut_values(k)? else {
            return self.get(k);
        };
        let (Some(dims), Some((_, pos0))) = (self.dims(k), self.step_shape(k.step)) else {
            return Ok(None);
        };
        let [n_head, t, n_kv] = dims;
        if ours.len() != n_head * t * n_kv {
            return Ok(None);
        }
        let (heads, rows) = (c.head_index(n_head), c.row_index(pos0, t));
        if v.len() != heads.len() * rows.len() * n_kv {
            return Ok(None);
        }
        let mut out = ours.to_vec();
        for (i, &h) in heads.iter().enumerate() {
            for (j, &r) in rows.iter().enumerate() {
                let (at, from) = ((h * t + r) * n_kv, (i * rows.len() + j) * n_kv);
                out[at..at + n_kv].copy_from_slice(&v[from..from + n_kv]);
            }
        }
        Ok(Some(out))
    }

    /// Whether the candidate stores `tap` in a declared non-canonical layout.
    pub fn declared(&self, tap: Tap) -> Option<Layout> {
        self.layouts
            .get(&tap)
            .copied()
            .filter(|l| *l != Layout::Canonical || is_head_tap(tap))
    }

    pub fn steps(&self) -> Vec<usize> {
        self.trace.manifest.steps.iter().map(|s| s.step).collect()
    }
}

pub use crate::backend::kvcache::{CacheType, KvCache};

/// A scalar the model sets that an engine may get wrong: the judge fits its value
/// (`hypothesis::fit`) instead of trying a fixed list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Knob {
    /// RMSNorm's epsilon (`attention.layer_norm_rms_epsilon`).
    RmsEps,
    /// The final norm's epsilon alone (an engine that passes another constant to its
    /// `output_norm` than to its layers' norms).
    OutputNormEps,
    /// RoPE's frequency base (`rope.freq_base`).
    RopeTheta,
    /// RoPE's linear position scale (1 / `rope.scaling.factor`): an engine that ignores the
    /// model's scaling, or multiplies by the factor where it should divide.
    RopeFreqScale,
    /// The attention score scale (1/sqrt(head_dim) unless the architecture says otherwise).
    AttnScale,
    /// The attention scores' soft-cap (gemma2: `attn_logit_softcapping`).
    AttnSoftcap,
    /// The logits' soft-cap (gemma2: `final_logit_softcapping`).
    FinalSoftcap,
    /// A constant factor on one op's output wherever it runs: no hyperparameter, the shape
    /// of a bug no catalog lists (a weight or block scale read wrong, a residual multiplier,
    /// an embedding scale the architecture does not have, a sampling temperature applied
    /// before the dump). Fitted in closed form; the replay multiplies that tap's output, in
    /// every layer or in one (one tensor's scale read wrong).
    OutputScale(Tap, Option<usize>),
}

impl Knob {
    /// The hyperparameters fitted by search (an output scale is fitted apart, per tap).
    pub const ALL: [Knob; 7] = [
        Knob::RmsEps,
        Knob::OutputNormEps,
        Knob::RopeTheta,
        Knob::RopeFreqScale,
        Knob::AttnScale,
        Knob::AttnSoftcap,
        Knob::FinalSoftcap,
    ];

    /// The hypothesis prefix: `rms-eps=1e-3`, `scale:ffn_out=0.5`.
    pub fn name(self) -> String {
        match self {
            Knob::RmsEps => "rms-eps".into(),
            Knob::OutputNormEps => "output-norm-eps".into(),
            Knob::RopeTheta => "rope-theta".into(),
            Knob::RopeFreqScale => "rope-freq-scale".into(),
            Knob::AttnScale => "attn-scale".into(),
            Knob::AttnSoftcap => "attn-softcap".into(),
            Knob::FinalSoftcap => "final-softcap".into(),
            Knob::OutputScale(t, None) => format!("scale:{}", t.name()),
            Knob::OutputScale(t, Some(l)) => format!("scale:{}@{l}", t.name()),
        }
    }

    /// The model's own value (an output scale's is 1; NaN: a soft-cap the model does not
    /// have).
    pub fn model_value(self, c: &crate::model::Config) -> f32 {
        match self {
            Knob::RmsEps => c.rms_eps,
            Knob::OutputNormEps => c.output_norm_eps.unwrap_or(c.rms_eps),
            Knob::RopeTheta => c.rope_theta,
            Knob::RopeFreqScale => c.rope_freq_scale,
            Knob::AttnScale => c.kq_scale,
            Knob::AttnSoftcap => c.attn_softcap.unwrap_or(f32::NAN),
            Knob::FinalSoftcap => c.final_softcap.unwrap_or(f32::NAN),
            Knob::OutputScale(..) => 1.0,
        }
    }

    /// Whether replaying it needs a model variant (a hyperparameter changed); an output scale
    /// is applied by the replay's sink.
    fn in_model(self) -> bool {
        !matches!(self, Knob::OutputScale(..))
    }

    fn set(self, c: &mut crate::model::Config, v: f32) {
        match self {
            Knob::RmsEps => c.rms_eps = v,
            Knob::OutputNormEps => c.output_norm_eps = Some(v),
            Knob::RopeTheta => c.rope_theta = v,
            Knob::RopeFreqScale => {
                // Sliding layers that share the global scaling (gemma2) take the value too;
                // those with their own (gemma3's local layers: 1) keep theirs.
                if c.rope_freq_scale_swa == c.rope_freq_scale {
                    c.rope_freq_scale_swa = v;
                }
                c.rope_freq_scale = v;
            }
            Knob::AttnScale => c.kq_scale = v,
            Knob::AttnSoftcap => c.attn_softcap = Some(v),
            Knob::FinalSoftcap => c.final_softcap = Some(v),
            Knob::OutputScale(..) => {}
        }
    }

    /// Parse `rms-eps=1e-3`, `scale:ffn_out=0.5` or `scale:ffn_out@1=0.5` (layer 1 only) back
    /// (a hypothesis name) into the knob and its value.
    pub fn parse(hypothesis: &str) -> Option<(Knob, f32)> {
        let (k, v) = hypothesis.split_once('=')?;
        let knob = match k.strip_prefix("scale:") {
            Some(t) => match t.split_once('@') {
                Some((t, l)) => Knob::OutputScale(Tap::parse(t)?, Some(l.parse().ok()?)),
                None => Knob::OutputScale(Tap::parse(t)?, None),
            },
            None => Knob::ALL.into_iter().find(|x| x.name() == k)?,
        };
        Some((knob, v.parse().ok()?))
    }
}

/// What a replay runs: an activation rounding, a K/V cache type, an optional known bug, a
/// model variant (one knob set to another value), and the window.
#[derive(Clone, Debug)]
pub struct Setup {
    pub rounding: Emulation,
    /// The rounding of the steps after the first (the decode steps), where it differs from
    /// `rounding` (the prefill's): each step's keys depend only on its own rounding, as every
    /// op is fed the candidate's inputs.
    pub decode: Option<Emulation>,
    /// The output projection's rounding where it differs from its step's (every step).
    pub output: Option<Emulation>,
    /// The cache emulated: the reference's k_rope and v (or the candidate's, where
    /// substituted) are stored as it stores them, and attention computed around it as the
    /// engine computes it (`backend::kvcache`).
    pub kv: KvCache,
    /// The cache as the steps after the first read it, where it differs from `kv` (an engine
    /// whose prompt attends over its fresh f32 rows and whose decode steps read a quantized
    /// cache, or whose two kernels round the cache unlike each other).
    pub kv_decode: Option<KvCache>,
    pub mutation: Option<Mutation>,
    pub knob: Option<(Knob, f32)>,
    /// The positions q and k are rotated at, fitted from the trace (`super::rope_fit`).
    pub rope_at: Option<RopeAt>,
    pub window: Window,
    /// Each of the candidate's tensors fed to the reference nudged (a pattern per seed): a
    /// replay as clean as the plain one, whose distance from it is what two correct engines
    /// may differ by at a key (`super::ambiguity`).
    pub jitter: Option<Jitter>,
    /// A replay of the first step alone, a prompt from position 0, runs only its first `rows`
    /// tokens (every tensor cut to them): a causal forward's first rows depend on nothing
    /// after them, so the cut changes no value, and a measurement costs the same at any
    /// prompt length (`MEASURE_ROWS`). Ignored where the window reaches a later step, whose
    /// attention reads every row.
    pub rows: Option<usize>,
}

/// The prompt rows a measurement replays (`Setup::rows`): a 64-wide model's rows carry
/// 64 × 64 values a tap, a 7B's 64 × 4096, enough for a median to settle either way.
pub const MEASURE_ROWS: usize = 64;

impl Setup {
    /// A clean replay of `window` under one rounding for every step and the output
    /// projection, through an f32 cache: what a measurement varies one thing of.
    pub fn clean(rounding: Emulation, window: Window) -> Setup {
        Setup {
            rounding,
            decode: None,
            output: None,
            kv: KvCache::F32,
            kv_decode: None,
            mutation: None,
            knob: None,
            rope_at: None,
            window,
            jitter: None,
            rows: None,
        }
    }

    /// This setup replaying only the prompt's first `MEASURE_ROWS` rows where it can.
    pub fn measuring(self) -> Setup {
        Setup {
            rows: Some(MEASURE_ROWS),
            ..self
        }
    }
}

/// A jittered replay's nudges: a pattern (`seed`), their relative size, and which tensors.
#[derive(Clone, Copy, Debug)]
pub struct Jitter {
    pub seed: u64,
    pub rel: f32,
    pub what: Nudged,
}

/// Which tensors a jittered replay nudges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nudged {
    /// The candidate's that enter the window (another engine's inputs).
    Inputs,
    /// Every tensor inside the window, the reference's own too (another engine's arithmetic
    /// at every op).
    Every,
    /// The matmul outputs inside the window alone (an engine that sums in another order and
    /// computes everything else as the reference does).
    Matmuls,
}

impl Jitter {
    /// Whether the tensor at `tap` inside the window is nudged (the reference's own, where the
    /// candidate has none).
    fn inside(&self, tap: Tap) -> bool {
        match self.what {
            Nudged::Inputs => false,
            Nudged::Every => true,
            Nudged::Matmuls => class(tap) == OpClass::Matmul,
        }
    }
}

/// `x` nudged by `rel` of itself, up or down by a hash of (seed, index).
fn jitter(seed: u64, rel: f32, data: &mut [f32]) {
    for (i, x) in data.iter_mut().enumerate() {
        // splitmix64 of the element's index under the seed
        let mut z = seed
            .wrapping_add(i as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let sign = if z & 1 == 0 { 1.0 } else { -1.0 };
        *x *= 1.0 + sign * rel;
    }
}

/// How far a jittered replay nudges each input: engines summing in another order differ from
/// the reference by a few ulps at every op.
pub const JITTER_ULPS: f32 = 4.0;

/// Steps `0..=s_max`, layers `l0..=l1` (`l1 = None`: no layer; `end`: through the output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub s_max: usize,
    pub l0: usize,
    /// Last layer run (exclusive end `l_end`): layers `l0..l_end`.
    pub l_end: usize,
    /// Whether result_norm and logits belong to the window (it runs to the model's end).
    pub end: bool,
}

impl Window {
    pub fn full(n_layer: usize, s_max: usize) -> Window {
        Window {
            s_max,
            l0: 0,
            l_end: n_layer,
            end: true,
        }
    }

    /// The smallest window that recomputes `key`: from the latest layer whose input (the
    /// previous layer's l_out, at every step up to `key`'s) the candidate has.
    pub fn for_key(cand: &Candidate, key: &TapKey) -> Window {
        let n_layer = cand.config.n_layer;
        // The embedding taps come before every layer.
        let pre = matches!(key.tap, Tap::Embd | Tap::EmbdScaled);
        let upto = key.layer.unwrap_or(if pre { 0 } else { n_layer });
        let steps: Vec<usize> = cand
            .steps()
            .into_iter()
            .filter(|&s| s <= key.step)
            .collect();
        let mut l0 = 0;
        for l in (1..=upto).rev() {
            if steps
                .iter()
                .all(|&s| cand.contains(&TapKey::new(s, Some(l - 1), Tap::LOut)))
            {
                l0 = l;
                break;
            }
        }
        Window {
            s_max: key.step,
            l0,
            l_end: match key.layer {
                Some(l) => l + 1,
                None if pre => 0,
                None => n_layer,
            },
            end: key.layer.is_none() && !pre,
        }
    }
}

/// What a replay leaves: per candidate key in the window, the metrics of the reference's value
/// against the candidate's; and the reference's own tensors for the keys asked to be kept.
pub struct Replay {
    pub metrics: BTreeMap<TapKey, Metrics>,
    pub kept: BTreeMap<TapKey, Vec<f32>>,
    /// Keys where the candidate's values are all f16-exact and the reference's are not: the
    /// engine stored that tensor in f16.
    pub f16_storage: BTreeSet<TapKey>,
    /// The prompt was cut to its first rows (`Setup::rows`): the metrics cover those alone.
    pub cut: bool,
}

/// A copy of `model` with `Setup`'s hyperparameters and only the window's layers.
fn variant(model: &Model, s: &Setup) -> Result<Model, JudgeError> {
    // The same bytes (one map), not the file opened and parsed again.
    let mut m = Model::from_gguf(model.file.clone())?;
    if let Some((k, v)) = s.knob {
        k.set(&mut m.config, v);
    }
    let w = s.window;
    m.layers = m.layers[w.l0..w.l_end.max(w.l0)].to_vec();
    // Per-layer architecture data follows the layers (gemma's sliding-window pattern).
    m.config.swa_layers = m.config.swa_layers[w.l0..w.l_end.max(w.l0)].to_vec();
    m.config.n_layer = m.layers.len();
    Ok(m)
}

/// The context a run of these steps needs: past its last position, plus one.
pub(super) fn n_ctx<'a>(steps: impl IntoIterator<Item = &'a StepInfo>) -> usize {
    steps
        .into_iter()
        .map(|s| s.positions.first().copied().unwrap_or(0) + s.tokens.len())
        .max()
        .unwrap_or(1)
        + 1
}

/// Replay `cand` under `setup`, keeping the reference's tensors at `keep`.
pub fn replay(
    model: &Model,
    cand: &Candidate,
    setup: &Setup,
    keep: &BTreeSet<TapKey>,
) -> Result<Replay, JudgeError> {
    Ok(replay_core(model, cand, setup, keep, None)?.remove(0))
}

/// The window's last step (a decode step) replayed under each of `roundings`, the steps
/// before it once under `setup` (its `decode` rounding ignored): one replay of a long prompt
/// serves every rounding a decode step is measured under. Each replay's metrics cover the
/// last step alone; none where the window holds one step.
pub fn replay_last_step_under(
    model: &Model,
    cand: &Candidate,
    setup: &Setup,
    roundings: &[Emulation],
) -> Result<Vec<Replay>, JudgeError> {
    let setup = Setup {
        decode: None,
        rows: None,
        ..setup.clone()
    };
    replay_core(model, cand, &setup, &BTreeSet::new(), Some(roundings))
}

fn replay_core(
    model: &Model,
    cand: &Candidate,
    setup: &Setup,
    keep: &BTreeSet<TapKey>,
    last_under: Option<&[Emulation]>,
) -> Result<Vec<Replay>, JudgeError> {
    let w = setup.window;
    let plain = w.l0 == 0
        && w.l_end == model.config.n_layer
        && setup.knob.is_none_or(|(k, _)| !k.in_model());
    let owned;
    let m: &Model = if plain {
        model
    } else {
        owned = variant(model, setup)?;
        &owned
    };
    let steps: Vec<_> = cand
        .trace
        .manifest
        .steps
        .iter()
        .filter(|s| s.step <= w.s_max)
        .collect();
    // (step, its full token count, the rows kept) where the prompt is cut.
    let cut = match (setup.rows, steps.as_slice()) {
        (Some(r), [s]) if s.positions.first().is_none_or(|&p| p == 0) && s.tokens.len() > r => {
            Some((s.step, s.tokens.len(), r.max(1)))
        }
        _ => None,
    };
    let n_ctx = match cut {
        Some((_, _, r)) => r + 1,
        None => n_ctx(steps.iter().copied()),
    };
    let mut b = Reference::new(m, setup.rounding, n_ctx)
        .with_mutation(setup.mutation)
        .with_rope_at(setup.rope_at)
        .with_kv(setup.kv)
        .with_output_emulation(setup.output);
    if setup.kv_decode.is_some() {
        b = b.keeping_raw_kv();
    }
    let new_sink = || JudgeSink {
        cand,
        window: w,
        scale: match setup.knob {
            Some((Knob::OutputScale(t, l), c)) => Some((t, l, c)),
            _ => None,
        },
        keep,
        out: Replay {
            metrics: BTreeMap::new(),
            kept: BTreeMap::new(),
            f16_storage: BTreeSet::new(),
            cut: cut.is_some(),
        },
        pending: None,
        cut,
        jitter: setup.jitter,
        error: None,
        rows: None,
    };
    let mut sink = new_sink();
    let run = |b: &mut Reference, s: &StepInfo, sink: &mut JudgeSink| {
        let pos0 = s.positions.first().copied().unwrap_or(0);
        let tokens = match cut {
            Some((_, _, r)) => &s.tokens[..r],
            None => &s.tokens[..],
        };
        b.forward(tokens, pos0, s.step, sink)?;
        sink.error.take().map_or(Ok(()), Err)
    };
    // With `last_under`, the last step is run apart (below) from a copy of this state.
    let n_run = match last_under {
        Some(_) => steps.len().saturating_sub(1),
        None => steps.len(),
    };
    for (i, s) in steps.iter().take(n_run).enumerate() {
        if i == 1 {
            if let Some(d) = setup.decode {
                b.set_emulation(d);
            }
            if let Some(c) = setup.kv_decode {
                b.set_kv(c);
            }
        }
        run(&mut b, s, &mut sink)?;
    }
    let Some(roundings) = last_under else {
        return Ok(vec![sink.out]);
    };
    let Some(last) = steps.last().filter(|_| n_run > 0) else {
        return Ok(Vec::new());
    };
    // (The steps after the first read the cache as `kv_decode`: set at the second.)
    if let Some(c) = setup.kv_decode.filter(|_| n_run == 1) {
        b.set_kv(c);
    }
    roundings
        .iter()
        .map(|&r| {
            let mut b = b.clone();
            b.set_emulation(r);
            let mut sink = new_sink();
            run(&mut b, last, &mut sink)?;
            Ok(sink.out)
        })
        .collect()
}

struct JudgeSink<'a, 't> {
    cand: &'a Candidate<'t>,
    window: Window,
    /// An output scale replayed: this tap's output (in this layer, or every layer) times this
    /// factor, as the engine would multiply it in f32.
    scale: Option<(Tap, Option<usize>, f32)>,
    keep: &'a BTreeSet<TapKey>,
    out: Replay,
    /// The candidate's tensor read by `record`, reused by the `substitute` that follows.
    pending: Option<(TapKey, Vec<f32>)>,
    /// (step, its full token count, rows kept): the prompt cut (`Setup::rows`).
    cut: Option<(usize, usize, usize)>,
    jitter: Option<Jitter>,
    error: Option<JudgeError>,
    /// The logits coming in rows: their metrics so far, and whether every value of the
    /// candidate's / the reference's rows so far was f16-exact.
    rows: Option<(MetricsAcc, bool, bool)>,
}

impl JudgeSink<'_, '_> {
    /// The full model's key for a key of the window's model; None outside the window.
    fn map(&self, k: &TapKey) -> Option<TapKey> {
        let w = self.window;
        match (k.tap, k.layer) {
            (Tap::Embd | Tap::EmbdScaled, _) => (w.l0 == 0).then_some(*k),
            (_, Some(l)) => Some(TapKey::new(k.step, Some(l + w.l0), k.tap)),
            (_, None) => w.end.then_some(*k),
        }
    }

    /// The candidate's tensor at `k` in canonical order, cut to the replayed rows.
    fn get(&self, k: &TapKey) -> Result<Option<Vec<f32>>, JudgeError> {
        let v = self.cand.get(k)?;
        match (self.cut, v) {
            (Some((step, t, r)), Some(v)) if k.step == step => Ok(Some(first_rows(
                &v,
                self.cand.dims(k).ok_or(JudgeError::MissingStep(step))?,
                k.tap,
                t,
                r,
            ))),
            (_, v) => Ok(v),
        }
    }

    fn fail(&mut self, e: JudgeError) {
        self.error.get_or_insert(e);
    }

    /// The tap whose tensor enters the first layer: the embedding, or its scaled copy.
    fn entry(&self) -> Tap {
        if self.cand.config.embd_scale.is_some() {
            Tap::EmbdScaled
        } else {
            Tap::Embd
        }
    }
}

impl Sink for JudgeSink<'_, '_> {
    fn wants(&self, key: &TapKey) -> bool {
        self.error.is_none() && self.map(key).is_some_and(|k| self.cand.trace.contains(&k))
    }

    fn replays(&self, key: &TapKey) -> bool {
        self.map(key).is_some_and(|k| self.cand.contains(&k)) && self.wants(key)
            || (key.tap == self.entry() && (self.window.l0 > 0 || self.jitter.is_some()))
            || (self.jitter.is_some_and(|j| j.inside(key.tap)) && self.map(key).is_some())
    }

    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        let Some(k) = self.map(&key) else { return };
        if self.cand.cut(&k).is_some() {
            return self.record_cut(k, shape, data);
        }
        let c = match self.get(&k) {
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(e) => return self.fail(e),
        };
        if c.len() != data.len() {
            // The reference's own shape is canonical by construction; a mutated one (a layout
            // bug replayed) stores another element count only if it is broken.
            return self.fail(JudgeError::Shape {
                key: k,
                found: shape.to_vec(),
                want: c.len(),
            });
        }
        let scaled: Vec<f32>;
        let data = match self.scale {
            Some((t, l, f)) if t == k.tap && l.is_none_or(|l| Some(l) == k.layer) => {
                scaled = data.iter().map(|x| x * f).collect();
                &scaled[..]
            }
            _ => data,
        };
        self.out
            .metrics
            .insert(k, own_metrics(data, &c, self.cand.all_finite()));
        let f16_exact = |v: &[f32]| v.iter().all(|&x| half::f16::from_f32(x).to_f32() == x);
        if f16_exact(&c) && !f16_exact(data) {
            self.out.f16_storage.insert(k);
        }
        if self.keep.contains(&k) {
            self.out.kept.insert(k, data.to_vec());
        }
        self.pending = Some((k, c));
    }

    fn substitute(&mut self, key: &TapKey, data: &mut [f32]) -> bool {
        self.replace(key, data)
    }

    /// The logits of a step not cut, kept or scaled, stored in rows (the forward then never
    /// makes a prompt's logits whole, nor reads the candidate's whole).
    fn row_slice(&self, key: &TapKey) -> Option<usize> {
        let rows = key.tap == Tap::Logits
            && self.wants(key)
            && self.map(key).is_some_and(|k| {
                !self.keep.contains(&k)
                    && self.cut.is_none_or(|(step, _, _)| step != k.step)
                    && self.scale.is_none_or(|(t, _, _)| t != k.tap)
                    && self.cand.in_rows(&k)
            });
        rows.then(crate::trace::row_slice_values)
    }

    fn record_rows(&mut self, key: TapKey, shape: &[usize], row0: usize, data: &[f32]) {
        let Some(k) = self.map(&key) else { return };
        if row0 == 0 {
            self.rows = None;
        }
        let (acc, c_f16, d_f16) = self
            .rows
            .get_or_insert_with(|| (MetricsAcc::default(), true, true));
        if self.error.is_some() {
            return;
        }
        let width = shape.iter().skip(1).product::<usize>().max(1);
        let n = data.len() / width;
        let c = match self.cand.rows(&k, row0..row0 + n) {
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(e) => return self.fail(e),
        };
        acc.push(data, &c);
        let f16_exact = |v: &[f32]| v.iter().all(|&x| half::f16::from_f32(x).to_f32() == x);
        *c_f16 &= f16_exact(&c);
        *d_f16 &= f16_exact(data);
        if row0 + n == shape[0] {
            let (acc, c_f16, d_f16) = self.rows.take().expect("taken above");
            let mut m = acc.finish();
            replays_nothing(&mut m, self.cand.all_finite());
            self.out.metrics.insert(k, m);
            if c_f16 && !d_f16 {
                self.out.f16_storage.insert(k);
            }
        }
    }
}

impl JudgeSink<'_, '_> {
    /// A cut candidate tensor (`kq_soft_max` kept for some heads or rows) measured on what it
    /// kept; the reference then goes on from its own values (nothing whole to substitute).
    fn record_cut(&mut self, k: TapKey, shape: &[usize], data: &[f32]) {
        let (c, v) = match self.cand.cut_values(&k) {
            Ok(Some(x)) => x,
            Ok(None) => return,
            Err(e) => return self.fail(e),
        };
        let (Some((t, pos0)), &[n_head, rows, n_kv]) = (self.cand.step_shape(k.step), shape) else {
            return self.fail(JudgeError::MissingStep(k.step));
        };
        // What the candidate stores: its heads and rows kept, every key of the step.
        let want = c.heads.as_ref().map_or(n_head, Vec::len)
            * c.rows.as_ref().map_or(t, Vec::len)
            * (pos0 + t);
        if v.len() != want {
            return self.fail(JudgeError::Shape {
                key: k,
                found: vec![v.len()],
                want,
            });
        }
        let ours = crate::trace::Side {
            data,
            cut: None,
            n_head,
            t: rows,
        };
        let theirs = crate::trace::Side {
            data: &v,
            cut: Some(&c),
            n_head,
            t,
        };
        // (A prompt replayed to its first rows has as many keys: those columns are compared.)
        if let Some((a, b)) = crate::trace::Cut::common(ours, theirs, pos0, n_kv) {
            self.out
                .metrics
                .insert(k, own_metrics(&a, &b, self.cand.all_finite()));
            if self.keep.contains(&k) {
                self.out.kept.insert(k, data.to_vec());
            }
        }
    }

    /// The candidate's tensor in place of the reference's, where the candidate has one.
    fn replace(&mut self, key: &TapKey, data: &mut [f32]) -> bool {
        let w = self.window;
        // Entering the window: the candidate's l_out of the layer before stands in for the
        // embedding (the scaled one where the model scales it).
        let src = if key.tap == self.entry() && w.l0 > 0 {
            TapKey::new(key.step, Some(w.l0 - 1), Tap::LOut)
        } else {
            match self.map(key) {
                Some(k) => k,
                None => return false,
            }
        };
        let v = match self.pending.take() {
            Some((k, v)) if k == src => v,
            _ => match self.get(&src) {
                Ok(Some(v)) => v,
                // A window entered from the token embedding the candidate did not dump: under
                // jitter the reference's own embedding is nudged, as every tensor fed from the
                // candidate is (else a span from layer 0 of a sparse dump had no input to nudge,
                // and its clean replays no distance however near a rounding boundary it sits).
                Ok(None)
                    if self.jitter.is_some_and(|j| j.inside(key.tap))
                        || (self.jitter.is_some_and(|j| j.what != Nudged::Matmuls)
                            && key.tap == self.entry()
                            && w.l0 == 0) =>
                {
                    data.to_vec()
                }
                Ok(None) => return false,
                Err(e) => {
                    self.fail(e);
                    return false;
                }
            },
        };
        if v.len() != data.len() {
            self.fail(JudgeError::Shape {
                key: src,
                found: vec![v.len()],
                want: data.len(),
            });
            return false;
        }
        data.copy_from_slice(&v);
        if let Some(j) = self.jitter
            && (j.what != Nudged::Matmuls || j.inside(src.tap))
        {
            let at = ((src.step as u64) << 32)
                ^ (src.layer.map_or(0, |l| l as u64 + 1) << 48)
                ^ match j.what {
                    Nudged::Inputs => 0,
                    _ => (src.tap as u64) << 40,
                };
            jitter(j.seed ^ at, j.rel, data);
        }
        true
    }
}

/// The replay's metrics of `ours` against the candidate's `theirs`, as `replays_nothing`
/// says (`finite`: the candidate's whole trace is).
fn own_metrics(ours: &[f32], theirs: &[f32], finite: bool) -> Metrics {
    let a = ArrayViewD::from_shape(ndarray::IxDyn(&[ours.len()]), ours).expect("1-d");
    let b = ArrayViewD::from_shape(ndarray::IxDyn(&[theirs.len()]), theirs).expect("1-d");
    let mut m = metrics(&a, &b);
    replays_nothing(&mut m, finite);
    m
}

/// A replay that holds a NaN or an Inf of a candidate whose whole trace is finite reproduces
/// nothing at that key, whatever the finite rest's NMSE (0 where nothing else is finite: a
/// hypothesis that overflows everywhere "reproduced" any candidate — softmax-no-max "was"
/// no-attn-norm on a model with scores to 200). Where the candidate's trace overflows
/// somewhere itself, the finite rest's NMSE stands: near an overflow two arithmetics cross
/// f32's largest value at different places (a 16-layer model without its FFN norm, replayed
/// over the trace: NaN at step 4 layer 8 where the engine held 5e6), the rounding is measured
/// on the rest, and `judge::nonfinite` matches the places.
fn replays_nothing(m: &mut Metrics, finite: bool) {
    if finite && m.nan_a + m.inf_a > 0 {
        m.nmse = f64::INFINITY;
    }
}

/// The first `r` of a prompt's `t` token rows of a canonical tensor (`arch::tap_dims`): rows
/// lead every tap but the probabilities, `[head, t, t]` from position 0, cut on both axes
/// (row i < r reads no key past i).
fn first_rows(v: &[f32], dims: [usize; 3], tap: Tap, t: usize, r: usize) -> Vec<f32> {
    match tap {
        Tap::KqSoftMax => {
            let (n_head, n_kv) = (dims[0], dims[2]);
            let mut out = Vec::with_capacity(n_head * r * r);
            for h in 0..n_head {
                for i in 0..r {
                    let row = (h * t + i) * n_kv;
                    out.extend_from_slice(&v[row..row + r]);
                }
            }
            out
        }
        _ => v[..v.len() / t * r].to_vec(),
    }
}

/// `trace` with every declared layout undone, in memory, for the end-to-end comparison (a
/// declared layout is a way of storing the numbers, never a numeric difference); None when it
/// declares none.
pub fn aligned_trace(trace: &Trace, config: &Config) -> Result<Option<Trace>, JudgeError> {
    let cand = Candidate::new(trace, config)?;
    if !cand.layouts.values().any(|l| *l != Layout::Canonical) {
        return Ok(None);
    }
    let mut tensors = BTreeMap::new();
    let mut cuts = BTreeMap::new();
    for k in trace.keys() {
        let a = trace.get(k)?.expect("listed");
        if let Some(c) = trace.cut(k) {
            // Kept cut, its rows and heads head-major as the cut lists them.
            let a = match cand.declared(k.tap) {
                Some(Layout::SwapOuter) if a.ndim() == 3 => a
                    .permuted_axes(vec![1, 0, 2])
                    .as_standard_layout()
                    .into_owned(),
                _ => a,
            };
            tensors.insert(*k, a);
            cuts.insert(*k, c);
            continue;
        }
        let a = match cand.declared(k.tap) {
            Some(l) if l != Layout::Canonical => {
                let dims = cand.dims(k).ok_or(JudgeError::MissingStep(k.step))?;
                let v = cand.get(k)?.expect("listed");
                // Canonical numpy shape: [T, heads, head_dim] for head taps, else as stored.
                let shape: Vec<usize> = if is_head_tap(k.tap) {
                    dims.to_vec()
                } else {
                    a.shape().to_vec()
                };
                ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), v).map_err(|_| {
                    JudgeError::Shape {
                        key: *k,
                        found: a.shape().to_vec(),
                        want: dims.iter().product(),
                    }
                })?
            }
            _ => a,
        };
        tensors.insert(*k, a);
    }
    Ok(Some(
        Trace::from_memory(
            trace.manifest.model.clone(),
            trace.manifest.producer.clone(),
            trace.manifest.steps.clone(),
            tensors,
        )
        .with_cuts(cuts),
    ))
}
