//! Architectures: the forward pass, written once, against a small set of ops that each backend
//! provides.
//!
//! [`transformer::forward`] is the one graph every supported architecture runs (llama, qwen2,
//! qwen3, gemma, gemma2, gemma3, phi3): what differs between them is data. Each architecture
//! is one file here (`llama.rs`, `gemma2.rs`, …) holding its [`spec::ArchSpec`]; the model
//! reads the metadata the spec names into [`crate::model::Config`] and the optional weights of
//! [`crate::model::LayerWeights`] (biases, q/k norms, post-norms, soft-caps, sliding window,
//! RoPE kind and factors, activation, embedding scale). docs/architectures.md lists, per
//! architecture, what llama.cpp computes, checked against the running llama.cpp.
//!
//! A backend implements [`Ops`]: `reference` (plain f32, readable, with the bug catalog),
//! `fast` (SIMD, threads). A new backend adds ops, never a forward; a new architecture adds data
//! (and, if it needs one, an op), never a kernel per backend.
//!
//! The op set is shaped for a device backend too: activations are the backend's own buffer type
//! (host vectors here, device buffers for wgpu), weights are named by their GGUF tensor (a
//! device backend keeps them resident), and the forward reads nothing back itself: taps go
//! through [`Ops::tap`], which a device backend serves only for the keys the sink wants or
//! replays ([`Sink::wants`], [`Sink::replays`]).

pub mod gemma;
pub mod gemma2;
pub mod gemma3;
pub mod llama;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod registry;
pub mod size;
pub mod spec;
pub mod transformer;

use crate::gguf::TensorInfo;
use crate::model::Config;
use crate::trace::{Sink, Tap, TapKey};
use spec::{Activation, Arch, RopeType};

/// RoPE of one layer: ggml_rope_ext with ext_factor 0.
#[derive(Clone, Copy, Debug)]
pub struct Rope<'w> {
    pub head_dim: usize,
    /// Dimensions rotated per head (the rest pass through).
    pub n_rot: usize,
    pub base: f32,
    /// Linear position scale (1 / scaling factor).
    pub freq_scale: f32,
    pub kind: RopeType,
    /// Per dimension pair: the angle is divided by this factor (llama3, phi3 LongRoPE).
    pub factors: Option<&'w TensorInfo>,
    /// cos and sin are multiplied by this (LongRoPE's attention factor); 1.0 otherwise.
    pub attn_factor: f32,
}

impl<'w> Rope<'w> {
    /// The RoPE layer `layer` uses: sliding-window layers may have their own base and scale
    /// (gemma3's local layers).
    pub fn for_layer(c: &Config, layer: usize, factors: Option<&'w TensorInfo>) -> Rope<'w> {
        let swa = c.swa_layers.get(layer).copied().unwrap_or(false);
        Rope {
            head_dim: c.head_dim,
            n_rot: c.n_rot,
            base: if swa { c.rope_theta_swa } else { c.rope_theta },
            freq_scale: if swa {
                c.rope_freq_scale_swa
            } else {
                c.rope_freq_scale
            },
            kind: c.rope_type,
            factors,
            attn_factor: c.rope_attn_factor,
        }
    }
}

/// Attention of one layer for one step's T queries at positions `pos0..pos0 + T`.
#[derive(Clone, Copy, Debug)]
pub struct Attn {
    pub pos0: usize,
    pub n_tokens: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Scores are `q·k · kq_scale`, then soft-capped, then soft-maxed.
    pub kq_scale: f32,
    pub softcap: Option<f32>,
    /// Sliding window: a query at position p sees keys at positions j with p - j < window
    /// (0: no window, every earlier position).
    pub window: usize,
}

impl Attn {
    pub fn for_layer(c: &Config, layer: usize, pos0: usize, n_tokens: usize) -> Attn {
        let swa = c.swa_layers.get(layer).copied().unwrap_or(false);
        Attn {
            pos0,
            n_tokens,
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            kq_scale: c.kq_scale,
            softcap: c.attn_softcap,
            window: if swa { c.n_swa } else { 0 },
        }
    }

    /// Positions in the cache after this step: the width of the probabilities.
    pub fn n_kv(&self) -> usize {
        self.pos0 + self.n_tokens
    }

    /// The key positions a query at position `pos` sees (causal, within the window).
    pub fn visible(&self, pos: usize) -> std::ops::Range<usize> {
        let first = if self.window > 0 {
            (pos + 1).saturating_sub(self.window)
        } else {
            0
        };
        first..pos + 1
    }
}

/// What a backend provides to run a forward. Every op takes its inputs by reference or, where
/// the input is dead afterwards, by value (so a backend may reuse its storage) and returns its
/// output. `[T, n]` tensors are row-major, one row per token.
pub trait Ops {
    /// An activation tensor, owned by the backend (a host vector, a device buffer).
    type Buf;

    /// Rows `tokens` of the embedding matrix `w`: `[T, n_embd]`.
    fn embed(&mut self, w: &TensorInfo, tokens: &[u32]) -> Self::Buf;
    /// `x · s`.
    fn scale(&mut self, x: Self::Buf, s: f32) -> Self::Buf;
    /// RMSNorm of each row, times the weight `w` (`[n]`).
    fn rms_norm(&mut self, x: &Self::Buf, w: &TensorInfo, eps: f32) -> Self::Buf;
    /// RMSNorm of each head (`w` is `[head_dim]`): qwen3's and gemma3's q/k norms.
    fn head_norm(&mut self, x: Self::Buf, w: &TensorInfo, eps: f32) -> Self::Buf;
    /// `x · Wᵀ` for the GGUF weight `w` (`[n_in, n_out]` in ggml order): `[T, n_out]`.
    fn matmul(&mut self, w: &TensorInfo, x: &Self::Buf) -> Self::Buf;
    /// `x + b` for each row.
    fn add_bias(&mut self, x: Self::Buf, b: &TensorInfo) -> Self::Buf;
    /// Rotate each head of `x` (`[T, n_heads, head_dim]`) by its position `pos0 + t`.
    fn rope(
        &mut self,
        x: Self::Buf,
        layer: usize,
        pos0: usize,
        n_heads: usize,
        r: &Rope,
    ) -> Self::Buf;
    /// Write this step's keys and values (`[T, n_head_kv · head_dim]`) into the layer's cache
    /// at positions `pos0..`.
    fn kv_store(&mut self, layer: usize, pos0: usize, k: &Self::Buf, v: &Self::Buf);
    /// Attention probabilities `[n_head, T, pos0 + T]` of the queries `q` (`[T, n_head,
    /// head_dim]`) over the cached keys; zero where a key is not visible.
    fn attn_probs(&mut self, layer: usize, q: &Self::Buf, a: &Attn) -> Self::Buf;
    /// `Σ_j p_j · v_j` over the cached values: `[T, n_head · head_dim]`.
    fn attn_values(&mut self, layer: usize, p: &Self::Buf, a: &Attn) -> Self::Buf;
    /// `attn_values(attn_probs(q))`, where nothing records or replays the probabilities: a
    /// backend may compute it a head at a time and never hold all of `[n_head, T, pos0 + T]`
    /// (1.5 GB for 32 heads of a 2,048-token prompt); the same numbers as the two ops.
    fn attention(&mut self, layer: usize, q: &Self::Buf, a: &Attn) -> Self::Buf {
        let p = self.attn_probs(layer, q, a);
        self.attn_values(layer, &p, a)
    }
    /// Gated activation `act(gate) · up`.
    fn glu(&mut self, gate: Self::Buf, up: &Self::Buf, act: Activation) -> Self::Buf;
    /// `a + b`.
    fn add(&mut self, a: Self::Buf, b: &Self::Buf) -> Self::Buf;
    /// `cap · tanh(x / cap)`.
    fn softcap(&mut self, x: Self::Buf, cap: f32) -> Self::Buf;
    /// The last row of `x` (`[T, width]` → `[1, width]`).
    fn last_row(&mut self, x: Self::Buf, width: usize) -> Self::Buf;
    /// Rows `rows` of `x` (`width` values each) as a tensor of their own, for an output made a
    /// slice of rows at a time ([`Sink::row_slice`]). Default: None, the backend does not
    /// (a device buffer), and the forward makes the output whole.
    fn rows(
        &mut self,
        _x: &Self::Buf,
        _width: usize,
        _rows: std::ops::Range<usize>,
    ) -> Option<Self::Buf> {
        None
    }
    /// A tap handed over a slice of rows at a time: rows `row0..` of `key`, whose whole shape
    /// is `shape`, to a sink that takes rows; never substituted. Called only by a backend
    /// whose `rows` gives them.
    fn tap_rows(
        &mut self,
        sink: &mut dyn Sink,
        key: TapKey,
        _shape: &[usize],
        _row0: usize,
        _x: &Self::Buf,
    ) {
        unreachable!(
            "{key} in rows from a backend that makes no rows ({})",
            sink.wants(&key)
        )
    }
    /// The context length this backend holds a cache for: LongRoPE models (phi3) pick their
    /// RoPE factors by it, as llama.cpp does by its context size.
    fn n_ctx(&self) -> usize;
    /// The forward is done with layer `layer`'s weights for this call (a backend reading them
    /// from the map releases them: `Model::release_layer`). Default: nothing.
    fn leave_layer(&mut self, _layer: usize) {}
    /// A tap point: hand `x` to the sink if it wants it, then let a replaying sink replace it
    /// (op by op) before the forward goes on from it.
    fn tap(&mut self, sink: &mut dyn Sink, key: TapKey, shape: &[usize], x: &mut Self::Buf);
}

/// The canonical shape of `tap` for a step of `t` tokens from position `pos0`, as 3-d
/// `[a, b, c]`: `[T, heads, head_dim]` for per-head tensors, `[n_head, T, n_kv]` for the
/// attention probabilities, `[T, 1, width]` for the rest. What the forward records.
pub fn tap_dims(c: &Config, tap: Tap, t: usize, pos0: usize) -> [usize; 3] {
    match tap {
        Tap::Q | Tap::QNormed | Tap::QRope | Tap::KqvOut => [t, c.n_head, c.head_dim],
        Tap::K | Tap::KNormed | Tap::V | Tap::KRope => [t, c.n_head_kv, c.head_dim],
        Tap::KqSoftMax => [c.n_head, t, pos0 + t],
        Tap::FfnGate | Tap::FfnUp | Tap::FfnAct => [t, 1, c.n_ff],
        Tap::Logits | Tap::LogitsUncapped => [t, 1, c.n_vocab],
        Tap::Embd
        | Tap::EmbdScaled
        | Tap::AttnNorm
        | Tap::AttnOut
        | Tap::AttnPostNorm
        | Tap::FfnInp
        | Tap::FfnNorm
        | Tap::FfnOut
        | Tap::FfnPostNorm
        | Tap::LOut
        | Tap::ResultNorm => [t, 1, c.n_embd],
    }
}

/// Whether the forward of a model with config `c` records `tap` (every architecture records
/// the llama taps; the others only where its data asks for the op). Checked against the
/// forward itself by a test.
pub fn records(c: &Config, tap: Tap) -> bool {
    // The spec's flags say which optional weights the loader requires in every layer.
    let spec = Arch::spec(c.arch);
    match tap {
        Tap::EmbdScaled => c.embd_scale.is_some(),
        Tap::QNormed | Tap::KNormed => spec.qk_norm,
        Tap::AttnPostNorm | Tap::FfnPostNorm => spec.post_norms,
        Tap::LogitsUncapped => c.final_softcap.is_some(),
        _ => true,
    }
}

/// The keys whose op produced `k` directly (its inputs, the graph's edges), for a trace with
/// decode steps `steps`: attention reads the cached keys and values of every step so far.
pub fn tap_inputs(c: &Config, k: &TapKey, steps: &[usize]) -> Vec<TapKey> {
    let s = k.step;
    let at = |tap: Tap| TapKey::new(s, k.layer, tap);
    // The last of `taps` the graph records (each optional one replaces the one before).
    let last = |layer: Option<usize>, taps: &[Tap]| {
        let tap = *taps.iter().rev().find(|&&t| records(c, t)).expect("one");
        TapKey::new(s, layer, tap)
    };
    let l_in = |l: usize| {
        if l == 0 {
            last(None, &[Tap::Embd, Tap::EmbdScaled])
        } else {
            TapKey::new(s, Some(l - 1), Tap::LOut)
        }
    };
    let cached = |tap: Tap| -> Vec<TapKey> {
        steps
            .iter()
            .filter(|&&x| x <= s)
            .map(|&x| TapKey::new(x, k.layer, tap))
            .collect()
    };
    let layer = k.layer.unwrap_or(0);
    match k.tap {
        Tap::Embd => vec![],
        Tap::EmbdScaled => vec![TapKey::new(s, None, Tap::Embd)],
        Tap::AttnNorm => vec![l_in(layer)],
        Tap::Q | Tap::K | Tap::V => vec![at(Tap::AttnNorm)],
        Tap::QNormed => vec![at(Tap::Q)],
        Tap::KNormed => vec![at(Tap::K)],
        Tap::QRope => vec![last(k.layer, &[Tap::Q, Tap::QNormed])],
        Tap::KRope => vec![last(k.layer, &[Tap::K, Tap::KNormed])],
        Tap::KqSoftMax => {
            let mut v = vec![at(Tap::QRope)];
            v.extend(cached(Tap::KRope));
            v
        }
        Tap::KqvOut => {
            let mut v = vec![at(Tap::KqSoftMax)];
            v.extend(cached(Tap::V));
            v
        }
        Tap::AttnOut => vec![at(Tap::KqvOut)],
        Tap::AttnPostNorm => vec![at(Tap::AttnOut)],
        Tap::FfnInp => vec![
            last(k.layer, &[Tap::AttnOut, Tap::AttnPostNorm]),
            l_in(layer),
        ],
        Tap::FfnNorm => vec![at(Tap::FfnInp)],
        Tap::FfnGate | Tap::FfnUp => vec![at(Tap::FfnNorm)],
        Tap::FfnAct => vec![at(Tap::FfnGate), at(Tap::FfnUp)],
        Tap::FfnOut => vec![at(Tap::FfnAct)],
        Tap::FfnPostNorm => vec![at(Tap::FfnOut)],
        Tap::LOut => vec![
            at(Tap::FfnInp),
            last(k.layer, &[Tap::FfnOut, Tap::FfnPostNorm]),
        ],
        Tap::ResultNorm => match c.n_layer {
            0 => vec![l_in(0)],
            n => vec![TapKey::new(s, Some(n - 1), Tap::LOut)],
        },
        Tap::LogitsUncapped => vec![TapKey::new(s, None, Tap::ResultNorm)],
        Tap::Logits => vec![last(None, &[Tap::ResultNorm, Tap::LogitsUncapped])],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Emulation, Reference};
    use crate::model::Model;
    use crate::trace::{MemorySink, TapFilter};

    /// What `records`, `tap_dims` and `tap_inputs` say about the graph is what the forward
    /// does, on every committed fixture (every architecture): the same taps, the same shapes,
    /// and every input of a recorded tap is recorded too.
    #[test]
    fn graph_facts_match_the_forward_on_every_architecture() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
        let mut archs = std::collections::BTreeSet::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let m = Model::open(e.unwrap().path()).unwrap();
            let c = &m.config;
            archs.insert(c.arch.name());
            let mut sink = MemorySink::new(TapFilter::all());
            let mut r = Reference::new(&m, Emulation::None, 64);
            crate::backend::run(&mut r, &[1, 5, 9, 20, 7], 2, None, &mut sink).unwrap();
            let name = &m.file.path().display();
            for step in 0..3 {
                let (t, pos0) = if step == 0 { (5, 0) } else { (1, 4 + step) };
                let recorded: Vec<Tap> = sink
                    .tensors
                    .keys()
                    .filter(|k| k.step == step && k.layer.is_none_or(|l| l == 1))
                    .map(|k| k.tap)
                    .collect();
                let want: Vec<Tap> = Tap::ALL.into_iter().filter(|&x| records(c, x)).collect();
                let mut got = recorded.clone();
                got.sort();
                got.dedup();
                assert_eq!(got, want, "{name} step {step}: taps");
                for (k, a) in sink.tensors.iter().filter(|(k, _)| k.step == step) {
                    let d = tap_dims(c, k.tap, t, pos0);
                    assert_eq!(a.len(), d.iter().product::<usize>(), "{name} {k}: shape");
                    let steps: Vec<usize> = (0..=step).collect();
                    for i in tap_inputs(c, k, &steps) {
                        assert!(sink.tensors.contains_key(&i), "{name} {k}: input {i}");
                    }
                }
            }
        }
        for a in crate::model::Arch::ALL {
            assert!(
                archs.contains(a.name()),
                "no committed fixture of {}",
                a.name()
            );
        }
    }

    #[test]
    fn window_bounds_what_a_query_sees() {
        let mut a = Attn {
            pos0: 0,
            n_tokens: 1,
            n_head: 1,
            n_head_kv: 1,
            head_dim: 2,
            kq_scale: 1.0,
            softcap: None,
            window: 0,
        };
        assert_eq!(a.visible(5), 0..6);
        a.window = 4;
        assert_eq!(a.visible(5), 2..6);
        assert_eq!(a.visible(2), 0..3);
        a.window = 1;
        assert_eq!(a.visible(5), 5..6);
    }
}
