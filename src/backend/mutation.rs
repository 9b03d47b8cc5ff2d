//! The catalog of known engine bugs, as data. Each [`Mutation`] is one mistake that real
//! engine authors make (see `../shared/seeds/`); switching it on in the reference backend
//! (`Reference::with_mutation`) makes parity behave like an engine with that bug, so that
//! `parity selftest` can check that `diff` finds it at its place and names it.
//!
//! Compute mutations change an op inside `Reference::forward` (a small `if` at its place);
//! token mutations change the ids fed (`dump --mutate`), layout mutations how a tap is
//! stored. None of them touches the block formats (crates/parity-quant): the decoder bug rewrites the raw bytes before
//! the exact decoder runs.

use crate::gguf::{GgmlType, TensorInfo};
use crate::model::{Activation, Arch, LayerWeights, Model, RopeType};
use crate::trace::{Tap, TapKey};

/// One known engine bug. `name()` is its stable, kebab-case identity (CLI, JSON, hypotheses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// RoPE pairs NEOX-style where the model says NORM, and vice versa.
    RopeNeox,
    /// RoPE frequency base wrong: 10000 where the model says otherwise, ×10 where it says 10000.
    RopeTheta,
    /// Q and K weight rows permuted inside each head (llama.cpp's HF converter permutation
    /// applied once more).
    QkPermute,
    /// Query head h reads kv head h % n_head_kv instead of h / (n_head / n_head_kv).
    GqaModulo,
    /// The output matrix read transposed: out[r] = Σ_i W_flat[i·n_out + r]·x[i].
    TransposedLmHead,
    /// The attention output matrix (square) read transposed.
    TransposedWo,
    /// RMSNorm epsilon ×10.
    RmsEps10x,
    /// Every RMSNorm multiplies by its weight twice.
    NormWeightTwice,
    /// Every RMSNorm leaves its weight out.
    NormWeightMissing,
    /// Only the attention's RMSNorm (attn_norm) multiplies by its weight twice: a bug of one
    /// norm site, the others right.
    AttnNormWeightTwice,
    /// SwiGLU with its operands swapped: silu(up)·gate.
    SwigluSwap,
    /// Decode steps write the new K/V one slot after the position attention reads it at.
    KvOffByOne,
    /// The steps after the first attend over the cache before they store their own K/V: a
    /// decode token's row reads every position but its own (a later chunk's rows, none of
    /// the chunk's).
    AttendBeforeStore,
    /// Decode steps rotate q and k at their position plus one (the cache slot right).
    RopePosOffByOne,
    /// Prefill rows attend to later positions too.
    NoCausalMask,
    /// The causal mask off by one: each prefill row also sees the next position.
    CausalMaskOffByOne,
    /// The causal mask leaves each row's own position out (`j < i`): position 0 sees nothing,
    /// and its softmax over a row masked everywhere is NaN.
    CausalMaskExcludesSelf,
    /// The softmax does not subtract its row's max: exp(s) / Σ exp(s). The same numbers to
    /// f32 rounding until a score passes ln(f32::MAX) ≈ 88.7, where exp overflows and the
    /// row's probabilities are Inf/Inf = NaN (and 0 beside them).
    SoftmaxNoMax,
    /// K/V written one slot after their position at every step, the prompt included: slot 0
    /// stays empty and attention reads each earlier token's K/V one place late.
    KvSlotLate,
    /// The final RMSNorm (output_norm) is left out: the logits read the last layer's output.
    NoFinalNorm,
    /// The attention output is added to the residual twice: ffn_inp = x + 2·attn_out.
    AttnOutTwice,
    /// The feed-forward output is added to the residual twice: l_out = ffn_inp + 2·ffn_out.
    FfnOutTwice,
    /// The attention's RMSNorm (attn_norm) is left out: q, k and v read the residual itself.
    NoAttnNorm,
    /// The feed-forward's RMSNorm (ffn_norm) is left out: gate and up read ffn_inp itself.
    NoFfnNorm,
    /// The attention's residual add is left out: ffn_inp = attn_out.
    NoAttnResidual,
    /// The feed-forward's residual add is left out: l_out = ffn_out.
    NoFfnResidual,
    /// The q, k and v biases (qwen2's attn_q/k/v.bias) are not added.
    NoQkvBias,
    /// The feed-forward's gate activation is the other one: SiLU where the model uses GELU
    /// (tanh), GELU where it uses SiLU.
    WrongFfnAct,
    /// RoPE rotates k but not q.
    RopeQSkipped,
    /// RoPE rotates q but not k.
    RopeKSkipped,
    /// Every RMSNorm multiplies by (1 + w), gemma's convention, on a model whose norm weights
    /// are the multiplier itself (gemma's are stored with the 1 folded in: gemma-norm-plus-one).
    NormWeightPlusOne,
    /// Every RMSNorm divides by the root of the sum of squares, not of their mean (the `/ n`
    /// left out): each row comes out about 1/sqrt(n) as large.
    RmsSumNotMean,
    /// Every RMSNorm leaves the square root out: x / (mean(x²) + eps).
    RmsNoSqrt,
    /// Every RMSNorm subtracts the row's mean first: a LayerNorm without its bias,
    /// (x − mean) / sqrt(var + eps) · w, where the model's norm is RMSNorm (GPT-2 code reused).
    LayerNormNotRms,
    /// RoPE rotates the wrong way: by −θ (the sine's sign flipped in both rows of the pair).
    RopeAngleNegated,
    /// Every query head reads kv head 0 (`h / n_head` where `h / (n_head / n_head_kv)` is
    /// meant).
    KvHeadZero,
    /// Attention's values read the K cache: Σ p·K where Σ p·V is meant (a copy-paste slip).
    VFromK,
    /// SiLU with its sign slipped: x · sigmoid(−x) = x / (1 + eˣ).
    SiluWrongSign,
    /// Both residual adds start from the normed value, not the stream (x overwritten by its
    /// norm): ffn_inp = attn_norm(x) + attn_out, l_out = ffn_norm(ffn_inp) + ffn_out.
    ResidualFromNormed,
    /// The attention's residual add alone starts from the normed value: ffn_inp =
    /// attn_norm(x) + attn_out (the feed-forward's add is right).
    AttnResidualFromNormed,
    /// The feed-forward's residual add alone starts from the normed value: l_out =
    /// ffn_norm(ffn_inp) + ffn_out (the attention's add is right).
    FfnResidualFromNormed,
    /// 4-bit decoder with the nibbles of each quant byte swapped.
    DecoderNibbleOrder,
    /// Q4_0/Q5_0 decoder without its offset: d·q where d·(q − 8) (Q5_0: q − 16) is meant.
    DecoderNoOffset,
    /// The output projection uses token_embd although output.weight exists.
    TiedOutput,
    /// The BOS token is not prepended.
    NoBos,
    /// The BOS token is prepended twice (template plus tokenizer).
    DoubleBos,
    /// q_rope stored head-major, `[n_head, T, head_dim]`.
    HeadMajorQRope,
    // Bugs of the newer architectures.
    /// gemma: every RMSNorm adds 1 to its weight, although the converter already did.
    GemmaNormPlusOne,
    /// gemma: the token embeddings are not multiplied by sqrt(n_embd).
    NoEmbdScale,
    /// gemma2: attention scores and final logits are not soft-capped.
    NoSoftcap,
    /// Sliding-window layers let a query see one position more than the window.
    SwaOffByOne,
    /// qwen3, gemma3: the per-head q/k RMSNorm is skipped.
    QkNormSkipped,
    /// phi3: the fused QKV projection split with K and V swapped.
    QkvSplitOrder,
    /// llama3, phi3: RoPE ignores the frequency factors (rope_freqs / LongRoPE factors).
    RopeFactorsIgnored,
    // Bugs that act only from some position on (the width: [`WRAP`] in the catalog; the
    // judge fits it from the position the bug first shows at).
    /// The K/V cache is a ring of W slots read as if it held every position: attention at
    /// position i reads, for each earlier position j, slot j mod W, which holds the latest
    /// position ≡ j (mod W) written so far. Exact below position W.
    KvRingWrap(u32),
    /// RoPE rotates at position p mod W (a position counter kept modulo a buffer's size, or
    /// restarting): exact below position W.
    RopePosWrap(u32),
    /// The causal mask is applied in whole blocks of W rows: the rows after a step's last
    /// full block see every position of the step (a tiled kernel's remainder left unmasked;
    /// a prompt whose length is a multiple of W is exact).
    MaskTailBlock(u32),
    /// Each step of several tokens after the first (a further turn, a later chunk of the
    /// prompt) starts from an empty cache: it and the steps after it attend only from its
    /// first position on (the positions go on).
    KvResetPerTurn,
    /// Each step of several tokens after the first is rotated from position 0 again, and the
    /// decode steps after it count on from there; the cache slots are right.
    PosRestartPerTurn,
}

/// The width of the catalog's position bugs: a ring of 8 slots, positions modulo 8, mask
/// blocks of 8 rows (every committed golden's run is longer).
pub const WRAP: u32 = 8;

/// What a mutation changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MutationKind {
    /// An op of the forward pass computes something else.
    Compute,
    /// The token ids fed differ.
    Tokens,
    /// The numbers are right; a tap is stored in another layout.
    Layout,
}

impl serde::Serialize for Mutation {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl std::fmt::Display for Mutation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Mutation {
    pub const ALL: &'static [Mutation] = &[
        Mutation::RopeNeox,
        Mutation::RopeTheta,
        Mutation::QkPermute,
        Mutation::GqaModulo,
        Mutation::TransposedLmHead,
        Mutation::TransposedWo,
        Mutation::RmsEps10x,
        Mutation::NormWeightTwice,
        Mutation::NormWeightMissing,
        Mutation::AttnNormWeightTwice,
        Mutation::SwigluSwap,
        Mutation::KvOffByOne,
        Mutation::AttendBeforeStore,
        Mutation::RopePosOffByOne,
        Mutation::NoCausalMask,
        Mutation::CausalMaskOffByOne,
        Mutation::CausalMaskExcludesSelf,
        Mutation::SoftmaxNoMax,
        Mutation::KvSlotLate,
        Mutation::NoFinalNorm,
        Mutation::AttnOutTwice,
        Mutation::FfnOutTwice,
        Mutation::NoAttnNorm,
        Mutation::NoFfnNorm,
        Mutation::NoAttnResidual,
        Mutation::NoFfnResidual,
        Mutation::NoQkvBias,
        Mutation::WrongFfnAct,
        Mutation::RopeQSkipped,
        Mutation::RopeKSkipped,
        Mutation::NormWeightPlusOne,
        Mutation::RmsSumNotMean,
        Mutation::RmsNoSqrt,
        Mutation::LayerNormNotRms,
        Mutation::RopeAngleNegated,
        Mutation::KvHeadZero,
        Mutation::VFromK,
        Mutation::SiluWrongSign,
        Mutation::ResidualFromNormed,
        Mutation::AttnResidualFromNormed,
        Mutation::FfnResidualFromNormed,
        Mutation::DecoderNibbleOrder,
        Mutation::DecoderNoOffset,
        Mutation::TiedOutput,
        Mutation::NoBos,
        Mutation::DoubleBos,
        Mutation::HeadMajorQRope,
        Mutation::GemmaNormPlusOne,
        Mutation::NoEmbdScale,
        Mutation::NoSoftcap,
        Mutation::SwaOffByOne,
        Mutation::QkNormSkipped,
        Mutation::QkvSplitOrder,
        Mutation::RopeFactorsIgnored,
        Mutation::KvRingWrap(WRAP),
        Mutation::RopePosWrap(WRAP),
        Mutation::MaskTailBlock(WRAP),
        Mutation::KvResetPerTurn,
        Mutation::PosRestartPerTurn,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mutation::RopeNeox => "rope-neox",
            Mutation::RopeTheta => "rope-theta",
            Mutation::QkPermute => "qk-permute",
            Mutation::GqaModulo => "gqa-modulo",
            Mutation::TransposedLmHead => "transposed-lm-head",
            Mutation::TransposedWo => "transposed-wo",
            Mutation::RmsEps10x => "rms-eps-10x",
            Mutation::NormWeightTwice => "norm-weight-twice",
            Mutation::NormWeightMissing => "norm-weight-missing",
            Mutation::AttnNormWeightTwice => "attn-norm-weight-twice",
            Mutation::RopePosOffByOne => "rope-pos-off-by-one",
            Mutation::SwigluSwap => "swiglu-swap",
            Mutation::KvOffByOne => "kv-off-by-one",
            Mutation::AttendBeforeStore => "attend-before-store",
            Mutation::NoCausalMask => "no-causal-mask",
            Mutation::CausalMaskOffByOne => "causal-mask-off-by-one",
            Mutation::CausalMaskExcludesSelf => "causal-mask-excludes-self",
            Mutation::SoftmaxNoMax => "softmax-no-max",
            Mutation::KvSlotLate => "kv-slot-late",
            Mutation::NoFinalNorm => "no-final-norm",
            Mutation::AttnOutTwice => "attn-out-twice",
            Mutation::FfnOutTwice => "ffn-out-twice",
            Mutation::NoAttnNorm => "no-attn-norm",
            Mutation::NoFfnNorm => "no-ffn-norm",
            Mutation::NoAttnResidual => "no-attn-residual",
            Mutation::NoFfnResidual => "no-ffn-residual",
            Mutation::NoQkvBias => "no-qkv-bias",
            Mutation::WrongFfnAct => "wrong-ffn-act",
            Mutation::RopeQSkipped => "rope-q-skipped",
            Mutation::RopeKSkipped => "rope-k-skipped",
            Mutation::NormWeightPlusOne => "norm-weight-plus-one",
            Mutation::RmsSumNotMean => "rms-sum-not-mean",
            Mutation::RmsNoSqrt => "rms-no-sqrt",
            Mutation::LayerNormNotRms => "layernorm-not-rms",
            Mutation::RopeAngleNegated => "rope-angle-negated",
            Mutation::KvHeadZero => "kv-head-zero",
            Mutation::VFromK => "v-from-k",
            Mutation::SiluWrongSign => "silu-wrong-sign",
            Mutation::ResidualFromNormed => "residual-from-normed",
            Mutation::AttnResidualFromNormed => "attn-residual-from-normed",
            Mutation::FfnResidualFromNormed => "ffn-residual-from-normed",
            Mutation::DecoderNibbleOrder => "decoder-nibble-order",
            Mutation::DecoderNoOffset => "decoder-no-offset",
            Mutation::TiedOutput => "tied-output",
            Mutation::NoBos => "no-bos",
            Mutation::DoubleBos => "double-bos",
            Mutation::HeadMajorQRope => "head-major-q-rope",
            Mutation::GemmaNormPlusOne => "gemma-norm-plus-one",
            Mutation::NoEmbdScale => "no-embd-scale",
            Mutation::NoSoftcap => "no-softcap",
            Mutation::SwaOffByOne => "swa-off-by-one",
            Mutation::QkNormSkipped => "qk-norm-skipped",
            Mutation::QkvSplitOrder => "qkv-split-order",
            Mutation::RopeFactorsIgnored => "rope-factors-ignored",
            Mutation::KvRingWrap(_) => "kv-ring-wrap",
            Mutation::RopePosWrap(_) => "rope-pos-wrap",
            Mutation::MaskTailBlock(_) => "mask-tail-block",
            Mutation::KvResetPerTurn => "kv-reset-per-turn",
            Mutation::PosRestartPerTurn => "pos-restart-per-turn",
        }
    }

    /// A catalog name; a position bug may give its width (`kv-ring-wrap=128`; default [`WRAP`]).
    pub fn parse(s: &str) -> Option<Mutation> {
        let (name, width) = match s.split_once('=') {
            Some((n, w)) => (n, Some(w.parse::<u32>().ok().filter(|&w| w >= 1)?)),
            None => (s, None),
        };
        let m = Self::ALL.iter().copied().find(|m| m.name() == name)?;
        match width {
            None => Some(m),
            Some(w) => m.wrap().map(|_| m.with_wrap(w)),
        }
    }

    /// The width of a position bug (None: not one).
    pub fn wrap(self) -> Option<usize> {
        match self {
            Mutation::KvRingWrap(w) | Mutation::RopePosWrap(w) | Mutation::MaskTailBlock(w) => {
                Some(w as usize)
            }
            _ => None,
        }
    }

    /// The same position bug at width `w` (any other bug unchanged).
    pub fn with_wrap(self, w: u32) -> Mutation {
        match self {
            Mutation::KvRingWrap(_) => Mutation::KvRingWrap(w),
            Mutation::RopePosWrap(_) => Mutation::RopePosWrap(w),
            Mutation::MaskTailBlock(_) => Mutation::MaskTailBlock(w),
            m => m,
        }
    }

    /// Whether the bug acts only from some position or step on ([`Self::first_position`]).
    pub fn positional(self) -> bool {
        self.wrap().is_some()
            || matches!(self, Mutation::KvResetPerTurn | Mutation::PosRestartPerTurn)
    }

    /// Where a position bug first shows in a run of `steps` (each: step, first position,
    /// token count): the step and the position, or None when no row of the run is affected.
    /// None for a bug that does not depend on the position.
    pub fn first_position(self, steps: &[(usize, usize, usize)]) -> Option<(usize, usize)> {
        match self {
            // The first row past the width: position W reads slot 0 (position W's own K/V),
            // or rotates at 0.
            Mutation::KvRingWrap(w) | Mutation::RopePosWrap(w) => {
                let w = w as usize;
                steps
                    .iter()
                    .find(|&&(_, p0, t)| p0 <= w && w < p0 + t)
                    .map(|&(s, _, _)| (s, w))
            }
            // The first row after a step's last full block, unless it is the step's last row
            // (which sees every position of the step anyway).
            Mutation::MaskTailBlock(w) => steps.iter().find_map(|&(s, p0, t)| {
                let tail = t / w as usize * w as usize;
                (tail + 1 < t).then_some((s, p0 + tail))
            }),
            // The first row of the first step of several tokens after the first.
            Mutation::KvResetPerTurn | Mutation::PosRestartPerTurn => steps
                .iter()
                .skip(1)
                .find(|&&(_, p0, t)| t > 1 && p0 > 0)
                .map(|&(s, p0, _)| (s, p0)),
            _ => None,
        }
    }

    /// All names, comma-separated (for error messages).
    pub fn names() -> String {
        Self::ALL
            .iter()
            .map(|m| m.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The tap and layout an engine with this layout bug declares in its manifest
    /// (`"layouts"`) when it knows it stores the tap so; `None` for other bugs.
    pub fn declared_layout(self) -> Option<(&'static str, &'static str)> {
        match self {
            Mutation::HeadMajorQRope => Some(("q_rope", "head-major")),
            _ => None,
        }
    }

    /// One line a user reads: what the engine does wrong.
    pub fn describe(self) -> &'static str {
        match self {
            Mutation::RopeNeox => {
                "RoPE pairs the wrong dimensions: halves (NEOX) where the model pairs neighbours (NORM), or the reverse"
            }
            Mutation::RopeTheta => {
                "RoPE uses the wrong frequency base: 10000 where the model says otherwise, 100000 where it says 10000"
            }
            Mutation::QkPermute => {
                "Q and K weight rows are permuted inside each head (the HF-to-GGUF permutation applied once more)"
            }
            Mutation::GqaModulo => {
                "query head h reads kv head h % n_head_kv instead of h / (n_head / n_head_kv)"
            }
            Mutation::TransposedLmHead => {
                "the output matrix is read transposed: out[r] = sum_i W[i*n_vocab + r] * x[i]"
            }
            Mutation::TransposedWo => "the attention output matrix (square) is read transposed",
            Mutation::RmsEps10x => "RMSNorm adds an epsilon 10x the model's",
            Mutation::NormWeightTwice => "each RMSNorm multiplies by its weight twice",
            Mutation::NormWeightMissing => "each RMSNorm leaves its weight out",
            Mutation::AttnNormWeightTwice => {
                "the attention's RMSNorm (attn_norm) multiplies by its weight twice; the other norms are right"
            }
            Mutation::RopePosOffByOne => {
                "decode steps rotate q and k at their position plus one (RoPE position off by one; the K/V cache slot is right)"
            }
            Mutation::SwigluSwap => "SwiGLU swaps its operands: silu(up) * gate",
            Mutation::KvOffByOne => {
                "decode steps (every step after the first: a chunked prompt's later chunks and later turns too) store the new K/V one position after the one attention reads"
            }
            Mutation::AttendBeforeStore => {
                "the steps after the first attend over the K/V cache before storing their own K/V: a decode token reads every earlier position but not its own"
            }
            Mutation::NoCausalMask => "prefill rows attend to later positions (no causal mask)",
            Mutation::CausalMaskOffByOne => {
                "the causal mask is off by one: each prefill row also sees the next position (`j <= i + 1`)"
            }
            Mutation::CausalMaskExcludesSelf => {
                "the causal mask leaves each row's own position out (`j < i`): the first position sees nothing, and a softmax over a row masked everywhere is NaN"
            }
            Mutation::SoftmaxNoMax => {
                "the attention softmax does not subtract its row's max: exp(s) / sum exp(s), which overflows where a score passes 88.7 (ln of f32's largest value) and gives NaN there"
            }
            Mutation::KvSlotLate => {
                "K/V are written one slot after their position at every step, the prompt included: attention reads an empty slot 0 and each earlier token's K/V one place late"
            }
            Mutation::NoFinalNorm => {
                "the final RMSNorm (output_norm) is left out: the output projection reads the last layer's output"
            }
            Mutation::AttnOutTwice => {
                "the attention output is added to the residual twice (ffn_inp = x + 2 * attn_out)"
            }
            Mutation::FfnOutTwice => {
                "the feed-forward output is added to the residual twice (l_out = ffn_inp + 2 * ffn_out)"
            }
            Mutation::NoAttnNorm => {
                "the attention's RMSNorm (attn_norm) is left out: q, k and v read the residual stream itself"
            }
            Mutation::NoFfnNorm => {
                "the feed-forward's RMSNorm (ffn_norm) is left out: gate and up read ffn_inp itself"
            }
            Mutation::NoAttnResidual => {
                "the attention's residual add is left out (ffn_inp = attn_out, where x + attn_out is meant)"
            }
            Mutation::NoFfnResidual => {
                "the feed-forward's residual add is left out (l_out = ffn_out, where ffn_inp + ffn_out is meant)"
            }
            Mutation::NoQkvBias => {
                "the q, k and v projections' biases (attn_q/k/v.bias) are not added"
            }
            Mutation::WrongFfnAct => {
                "the feed-forward's gate activation is the other one: SiLU where the model uses GELU (tanh), GELU where it uses SiLU"
            }
            Mutation::RopeQSkipped => "RoPE rotates k but not q",
            Mutation::RopeKSkipped => "RoPE rotates q but not k",
            Mutation::NormWeightPlusOne => {
                "each RMSNorm multiplies by (1 + weight), gemma's convention, where the model's weight is the multiplier itself"
            }
            Mutation::RmsSumNotMean => {
                "each RMSNorm divides by the root of the sum of squares, not of their mean (the / n left out): rows come out about 1/sqrt(n) as large"
            }
            Mutation::RmsNoSqrt => {
                "each RMSNorm leaves the square root out: x / (mean(x^2) + eps), where x / sqrt(mean(x^2) + eps) is meant"
            }
            Mutation::LayerNormNotRms => {
                "each RMSNorm subtracts the row's mean first (a LayerNorm: (x - mean) / sqrt(var + eps) * w), where the model's norm is RMSNorm"
            }
            Mutation::RopeAngleNegated => {
                "RoPE rotates the wrong way, by -theta: the sine's sign is flipped (x0*cos + x1*sin, -x0*sin + x1*cos)"
            }
            Mutation::KvHeadZero => {
                "every query head reads kv head 0 (h / n_head where h / (n_head / n_head_kv) is meant)"
            }
            Mutation::VFromK => {
                "attention's values read the K cache: sum p * K where sum p * V is meant"
            }
            Mutation::SiluWrongSign => {
                "SiLU has its sign slipped: x * sigmoid(-x) = x / (1 + exp(x)), where x / (1 + exp(-x)) is meant"
            }
            Mutation::ResidualFromNormed => {
                "the residual adds start from the normed value, not the residual stream (x overwritten by its norm): ffn_inp = attn_norm(x) + attn_out, l_out = ffn_norm(ffn_inp) + ffn_out"
            }
            Mutation::AttnResidualFromNormed => {
                "the attention's residual add starts from the normed value, not the residual stream: ffn_inp = attn_norm(x) + attn_out (the feed-forward's add is right)"
            }
            Mutation::FfnResidualFromNormed => {
                "the feed-forward's residual add starts from the normed value, not the residual stream: l_out = ffn_norm(ffn_inp) + ffn_out (the attention's add is right)"
            }
            Mutation::DecoderNibbleOrder => {
                "the 4-bit decoder swaps the low and high nibble of each quant byte"
            }
            Mutation::DecoderNoOffset => {
                "the Q4_0/Q5_0 decoder leaves the quants' offset out: d * q where d * (q - 8) (Q5_0: q - 16) is meant"
            }
            Mutation::TiedOutput => {
                "the output projection uses token_embd although the model has output.weight"
            }
            Mutation::NoBos => "the BOS token is not prepended to the prompt",
            Mutation::DoubleBos => "the BOS token is prepended twice (template and tokenizer)",
            Mutation::HeadMajorQRope => "q_rope is stored head-major, [n_head, T, head_dim]",
            Mutation::GemmaNormPlusOne => {
                "each RMSNorm adds 1 to its weight, although the GGUF converter already folded gemma's +1 in"
            }
            Mutation::NoEmbdScale => "the token embeddings are not multiplied by sqrt(n_embd)",
            Mutation::NoSoftcap => "attention scores and final logits are not soft-capped",
            Mutation::SwaOffByOne => {
                "sliding-window layers let a query see one position more than the window"
            }
            Mutation::QkNormSkipped => "the per-head RMSNorm of q and k is skipped",
            Mutation::QkvSplitOrder => "the fused QKV output is split with K and V swapped",
            Mutation::RopeFactorsIgnored => {
                "RoPE ignores the model's frequency factors (rope_freqs.weight, LongRoPE factors)"
            }
            Mutation::KvRingWrap(_) => {
                "the K/V cache is a ring buffer of W slots read as if it held every position: from position W on, attention reads slot p mod W, where a later token's K/V has overwritten position p's"
            }
            Mutation::RopePosWrap(_) => {
                "RoPE rotates at position p mod W: from position W on, positions restart (a counter kept modulo a buffer's size)"
            }
            Mutation::MaskTailBlock(_) => {
                "the causal mask is applied in whole blocks of W rows: the rows after a step's last full block see every position of the step (a tiled kernel's remainder left unmasked; exact when the prompt is a multiple of W)"
            }
            Mutation::KvResetPerTurn => {
                "the K/V cache is emptied at each step of several tokens after the first (a further turn, a later chunk of the prompt): from there on attention reads nothing before it"
            }
            Mutation::PosRestartPerTurn => {
                "RoPE positions restart at 0 at each step of several tokens after the first (a further turn, a later chunk of the prompt) and count on from there; the cache slots are right"
            }
        }
    }

    /// [`Self::describe`] with the width of a position bug said (`W` is 8 in the catalog).
    pub fn describe_width(self) -> String {
        match self.wrap() {
            // The remainder starts at row W: any width dividing W that leaves the same
            // remainder gives the same mask.
            Some(w) if matches!(self, Mutation::MaskTailBlock(_)) => format!(
                "{} (or of a width dividing {w} that leaves the same rows after the last block)",
                self.describe().replace(" W", &format!(" {w}"))
            ),
            Some(w) => self.describe().replace(" W", &format!(" {w}")),
            None => self.describe().to_string(),
        }
    }

    pub fn kind(self) -> MutationKind {
        match self {
            Mutation::NoBos | Mutation::DoubleBos => MutationKind::Tokens,
            Mutation::HeadMajorQRope => MutationKind::Layout,
            _ => MutationKind::Compute,
        }
    }

    /// Whether the bug can show on this model at all (e.g. GQA needs 1 < n_head_kv < n_head).
    pub fn applies_to(self, model: &Model) -> bool {
        let c = &model.config;
        match self {
            Mutation::GqaModulo => c.n_head_kv > 1 && c.n_head_kv < c.n_head,
            Mutation::TransposedWo => c.n_embd_q() == c.n_embd,
            Mutation::DecoderNibbleOrder | Mutation::DecoderNoOffset => {
                first_misdecoded(self, model, 0).is_some()
            }
            // A file may store output.weight as a copy of token_embd (llama2.c exports do).
            Mutation::TiedOutput => {
                !c.tied_embeddings
                    && (model.output.ty != model.token_embd.ty
                        || model.data(&model.output) != model.data(&model.token_embd))
            }
            Mutation::NoBos | Mutation::DoubleBos => bos_id(model).is_some(),
            Mutation::NormWeightTwice | Mutation::NormWeightMissing => {
                first_norm_showing(self, model, 0).is_some()
            }
            Mutation::AttnNormWeightTwice => first_attn_norm_showing(model, 0).is_some(),
            // Rotating nothing leaves every position the same.
            Mutation::RopePosOffByOne => c.n_rot >= 2,
            // Rotating nothing, or one pair, leaves NORM and NEOX the same.
            Mutation::RopeNeox => c.n_rot >= 4,
            Mutation::RopeTheta | Mutation::QkPermute => c.n_rot >= 4,
            Mutation::RopeQSkipped | Mutation::RopeKSkipped | Mutation::RopeAngleNegated => {
                c.n_rot >= 2
            }
            // With one kv head every query head reads head 0 anyway.
            Mutation::KvHeadZero => c.n_head_kv > 1,
            Mutation::SiluWrongSign => c.activation == Activation::Silu,
            Mutation::RopePosWrap(_) | Mutation::PosRestartPerTurn => c.n_rot >= 2,
            Mutation::KvRingWrap(w) => c.swa_layers.iter().any(|&s| !s || c.n_swa > w as usize),
            // On gemma the same op is gemma-norm-plus-one (its weights carry the 1 already).
            Mutation::NormWeightPlusOne => {
                !matches!(c.arch, Arch::Gemma | Arch::Gemma2 | Arch::Gemma3)
            }
            Mutation::GemmaNormPlusOne => {
                matches!(c.arch, Arch::Gemma | Arch::Gemma2 | Arch::Gemma3)
            }
            Mutation::NoEmbdScale => c.embd_scale.is_some_and(|s| s != 1.0),
            Mutation::NoSoftcap => c.attn_softcap.is_some() || c.final_softcap.is_some(),
            Mutation::SwaOffByOne => c.n_swa > 0 && c.swa_layers.iter().any(|&s| s),
            Mutation::QkNormSkipped => model.layers.iter().any(|l| l.q_norm.is_some()),
            Mutation::NoQkvBias => first_bias_showing(model, 0).is_some(),
            Mutation::QkvSplitOrder => model.layers.iter().any(fused_qkv),
            Mutation::RopeFactorsIgnored => model.layers.iter().any(|l| {
                l.rope_freqs
                    .as_ref()
                    .is_some_and(|f| model.vector(f).iter().any(|&v| v != 1.0))
            }),
            _ => true,
        }
    }

    /// Whether the bug computes the feed-forward activation the model does not use (a GELU on
    /// a SiLU model): how the engine rounds that one (GELU's f16 table or f32) may never have
    /// been measured, so the judge replays it under the GELU twins of the measured rounding.
    pub fn swaps_ffn_activation(self) -> bool {
        self == Mutation::WrongFfnAct
    }

    /// Whether the bug shows only where the run's attention scores pass exp's f32 overflow
    /// (`selftest::overflow_at` says where a golden's do): elsewhere it computes the same
    /// numbers to f32 rounding, and there is nothing to find.
    pub fn shows_only_on_overflow(self) -> bool {
        self == Mutation::SoftmaxNoMax
    }

    /// Where the bug first shows against a golden, in graph order, assuming a prompt of at
    /// least two tokens and at least one decode step (RoPE is the identity at position 0 and
    /// the causal mask only matters from the second row on).
    pub fn first_shows(self, model: &Model) -> TapKey {
        // Only a bug that does not apply (`applies_to`) cannot show: embd stands for "nowhere".
        self.first_shows_from(model, 0)
            .unwrap_or(TapKey::new(0, None, Tap::Embd))
    }

    /// [`Self::first_shows`] for the bug acting only from layer `from` on (and on the output
    /// norm and projection; `Reference::mutation_from_layer`). None when it cannot show then.
    pub fn first_shows_from(self, model: &Model, from: usize) -> Option<TapKey> {
        if from >= model.config.n_layer && from > 0 {
            return None;
        }
        let at = |step, tap| Some(TapKey::new(step, Some(from), tap));
        match self {
            Mutation::RopeNeox | Mutation::RopeTheta | Mutation::HeadMajorQRope => {
                at(0, Tap::QRope)
            }
            Mutation::QkPermute => at(0, Tap::Q),
            Mutation::GqaModulo
            | Mutation::NoCausalMask
            | Mutation::CausalMaskOffByOne
            | Mutation::CausalMaskExcludesSelf => at(0, Tap::KqSoftMax),
            // Where a score first overflows; the layer and step are the run's
            // (`selftest::overflow_at` finds them in a golden).
            Mutation::SoftmaxNoMax => at(0, Tap::KqSoftMax),
            Mutation::TransposedWo => at(0, Tap::AttnOut),
            Mutation::RmsEps10x => at(0, Tap::AttnNorm),
            Mutation::NormWeightTwice | Mutation::NormWeightMissing => {
                first_norm_showing(self, model, from)
            }
            Mutation::AttnNormWeightTwice => first_attn_norm_showing(model, from),
            Mutation::RopePosOffByOne => at(1, Tap::QRope),
            Mutation::SwigluSwap => at(0, Tap::FfnAct),
            Mutation::KvOffByOne | Mutation::AttendBeforeStore => at(1, Tap::KqSoftMax),
            // The prompt's second row reads slot 0 (empty) and slot 1 (the first token's).
            Mutation::KvSlotLate => at(0, Tap::KqSoftMax),
            Mutation::NoFinalNorm => Some(TapKey::new(0, None, Tap::ResultNorm)),
            Mutation::AttnOutTwice => at(0, Tap::FfnInp),
            Mutation::FfnOutTwice | Mutation::NoFfnResidual => at(0, Tap::LOut),
            Mutation::NoAttnNorm => at(0, Tap::AttnNorm),
            Mutation::NoFfnNorm => at(0, Tap::FfnNorm),
            Mutation::NoAttnResidual => at(0, Tap::FfnInp),
            Mutation::NoQkvBias => first_bias_showing(model, from),
            Mutation::WrongFfnAct => at(0, Tap::FfnAct),
            // Position 0 is the identity: the prompt's second row shows it.
            Mutation::RopeQSkipped => at(0, Tap::QRope),
            Mutation::RopeKSkipped => at(0, Tap::KRope),
            Mutation::NormWeightPlusOne => at(0, Tap::AttnNorm),
            Mutation::RmsSumNotMean | Mutation::RmsNoSqrt | Mutation::LayerNormNotRms => {
                at(0, Tap::AttnNorm)
            }
            Mutation::RopeAngleNegated => at(0, Tap::QRope),
            Mutation::KvHeadZero => at(0, Tap::KqSoftMax),
            Mutation::VFromK => at(0, Tap::KqvOut),
            Mutation::SiluWrongSign => at(0, Tap::FfnAct),
            Mutation::ResidualFromNormed | Mutation::AttnResidualFromNormed => at(0, Tap::FfnInp),
            Mutation::FfnResidualFromNormed => at(0, Tap::LOut),
            Mutation::DecoderNibbleOrder | Mutation::DecoderNoOffset => {
                first_misdecoded(self, model, from)
            }
            // Before a final soft-cap, the projection is tapped on its own.
            Mutation::TransposedLmHead | Mutation::TiedOutput => {
                let tap = match model.config.final_softcap {
                    Some(_) => Tap::LogitsUncapped,
                    None => Tap::Logits,
                };
                Some(TapKey::new(0, None, tap))
            }
            Mutation::NoBos | Mutation::DoubleBos => Some(TapKey::new(0, None, Tap::Embd)),
            Mutation::GemmaNormPlusOne => at(0, Tap::AttnNorm),
            // The embedding counts as layer 0.
            Mutation::NoEmbdScale => (from == 0).then_some(TapKey::new(0, None, Tap::EmbdScaled)),
            Mutation::NoSoftcap => match model.config.attn_softcap {
                Some(_) => at(0, Tap::KqSoftMax),
                None => Some(TapKey::new(0, None, Tap::Logits)),
            },
            // Assuming a prompt longer than the window.
            Mutation::SwaOffByOne => (from..model.config.n_layer)
                .find(|&l| model.config.swa_layers[l])
                .map(|l| TapKey::new(0, Some(l), Tap::KqSoftMax)),
            Mutation::QkNormSkipped => (from..model.config.n_layer)
                .find(|&l| model.layers[l].q_norm.is_some())
                .map(|l| TapKey::new(0, Some(l), Tap::QNormed)),
            Mutation::QkvSplitOrder => (from..model.config.n_layer)
                .find(|&l| fused_qkv(&model.layers[l]))
                .map(|l| TapKey::new(0, Some(l), Tap::K)),
            Mutation::RopeFactorsIgnored => (from..model.config.n_layer)
                .find(|&l| model.layers[l].rope_freqs.is_some())
                .map(|l| TapKey::new(0, Some(l), Tap::QRope)),
            // The step is the run's: the one holding `first_position`.
            // A sliding window no longer than the ring never reads an overwritten slot.
            Mutation::KvRingWrap(w) => (from..model.config.n_layer)
                .find(|&l| !model.config.swa_layers[l] || model.config.n_swa > w as usize)
                .map(|l| TapKey::new(0, Some(l), Tap::KqSoftMax)),
            Mutation::MaskTailBlock(_) | Mutation::KvResetPerTurn => at(0, Tap::KqSoftMax),
            Mutation::RopePosWrap(_) | Mutation::PosRestartPerTurn => at(0, Tap::QRope),
        }
    }
}

/// Whether a layer's q, k and v are views of one fused attn_qkv weight (phi3).
pub fn fused_qkv(l: &LayerWeights) -> bool {
    l.wk.name.contains("attn_qkv")
}

impl Mutation {
    /// Where the bug first shows on a typical model, in words (`first_shows` is exact for a
    /// given model).
    pub fn typical_place(self) -> &'static str {
        match self {
            Mutation::RopeNeox | Mutation::RopeTheta | Mutation::HeadMajorQRope => {
                "step 0, layer 0, q_rope"
            }
            Mutation::QkPermute => "step 0, layer 0, q",
            Mutation::GqaModulo
            | Mutation::NoCausalMask
            | Mutation::CausalMaskOffByOne
            | Mutation::CausalMaskExcludesSelf => "step 0, layer 0, kq_soft_max",
            Mutation::SoftmaxNoMax => "the first kq_soft_max with a score over 88.7",
            Mutation::TransposedWo => "step 0, layer 0, attn_out",
            Mutation::RmsEps10x => "step 0, layer 0, attn_norm",
            Mutation::NormWeightTwice | Mutation::NormWeightMissing => {
                "step 0, the first norm whose weight is not all ones"
            }
            Mutation::SwigluSwap => "step 0, layer 0, ffn_act",
            Mutation::KvOffByOne | Mutation::AttendBeforeStore => {
                "step 1 (first decode step), layer 0, kq_soft_max"
            }
            Mutation::KvSlotLate => "step 0, layer 0, kq_soft_max",
            Mutation::NoFinalNorm => "step 0, result_norm",
            Mutation::AttnOutTwice => "step 0, layer 0, ffn_inp",
            Mutation::FfnOutTwice | Mutation::NoFfnResidual => "step 0, layer 0, l_out",
            Mutation::NoAttnNorm => "step 0, layer 0, attn_norm",
            Mutation::NoFfnNorm => "step 0, layer 0, ffn_norm",
            Mutation::NoAttnResidual => "step 0, layer 0, ffn_inp",
            Mutation::NoQkvBias => "step 0, the first q (k, v) with a bias not all zero",
            Mutation::WrongFfnAct => "step 0, layer 0, ffn_act",
            Mutation::RopeQSkipped => "step 0, layer 0, q_rope",
            Mutation::RopeKSkipped => "step 0, layer 0, k_rope",
            Mutation::NormWeightPlusOne => "step 0, layer 0, attn_norm",
            Mutation::RmsSumNotMean | Mutation::RmsNoSqrt | Mutation::LayerNormNotRms => {
                "step 0, layer 0, attn_norm"
            }
            Mutation::RopeAngleNegated => "step 0, layer 0, q_rope",
            Mutation::KvHeadZero => "step 0, layer 0, kq_soft_max",
            Mutation::VFromK => "step 0, layer 0, kqv_out",
            Mutation::SiluWrongSign => "step 0, layer 0, ffn_act",
            Mutation::ResidualFromNormed | Mutation::AttnResidualFromNormed => {
                "step 0, layer 0, ffn_inp"
            }
            Mutation::FfnResidualFromNormed => "step 0, layer 0, l_out",
            Mutation::AttnNormWeightTwice => {
                "step 0, the first attn_norm whose weight has an element other than 0 or 1"
            }
            Mutation::RopePosOffByOne => "step 1 (first decode step), layer 0, q_rope",
            Mutation::DecoderNibbleOrder => "step 0, the first op reading a 4-bit weight",
            Mutation::DecoderNoOffset => "step 0, the first op reading a Q4_0 or Q5_0 weight",
            Mutation::TransposedLmHead | Mutation::TiedOutput => "step 0, logits",
            Mutation::NoBos | Mutation::DoubleBos => "step 0, the token ids",
            Mutation::GemmaNormPlusOne => "step 0, layer 0, attn_norm",
            Mutation::NoEmbdScale => "step 0, embd_scaled",
            Mutation::NoSoftcap => "step 0, layer 0, kq_soft_max (or the logits)",
            Mutation::SwaOffByOne => {
                "step 0, the first sliding-window layer, kq_soft_max (a prompt longer than the window)"
            }
            Mutation::QkNormSkipped => "step 0, layer 0, q_normed",
            Mutation::QkvSplitOrder => "step 0, layer 0, k",
            Mutation::RopeFactorsIgnored => "step 0, layer 0, q_rope",
            Mutation::KvRingWrap(_) => "the step holding position 8, layer 0, kq_soft_max",
            Mutation::RopePosWrap(_) => "the step holding position 8, layer 0, q_rope",
            Mutation::MaskTailBlock(_) => {
                "the first step that leaves 2+ rows after its last full block of 8, layer 0, kq_soft_max"
            }
            Mutation::KvResetPerTurn => {
                "the first step of several tokens after the first (a turn, a chunk), layer 0, kq_soft_max"
            }
            Mutation::PosRestartPerTurn => {
                "the first step of several tokens after the first (a turn, a chunk), layer 0, q_rope"
            }
        }
    }
}

/// What `parity selftest` (`crate::selftest`) holds `diff` to for each bug: the name its
/// diagnosis must give, and which reported places count as the bug's place — in a full dump
/// the tap [`Mutation::first_shows`] names, in a sparse one (`selftest::SPARSE_TAPS`: embd,
/// l_out per layer, result_norm, logits) the layer it is in.
impl Mutation {
    /// The name the diagnosis must give: the catalog name, or for token bugs the kind of
    /// token difference `compare` names.
    pub fn diagnosed_as(self) -> &'static str {
        match self {
            Mutation::NoBos => "bos-missing",
            Mutation::DoubleBos => "bos-doubled",
            _ => self.name(),
        }
    }

    /// Whether a sparse dump can show the bug: a layout bug stores a tap (q_rope) that a
    /// sparse dump does not have.
    pub fn shows_in_sparse(self) -> bool {
        self.kind() != MutationKind::Layout
    }

    /// Whether `found` is this bug's place when it first shows at `expected`: exactly, or in
    /// a sparse dump at the same step and layer (the tap within the layer is not dumped).
    /// An eps bug acts on every RMSNorm of the layer; which one shows it first depends on the
    /// scale of its input (deep in a model the residual stream dwarfs eps, a post-norm's
    /// small input does not): any norm of the expected layer is its place.
    pub fn found_at(self, expected: &TapKey, found: &TapKey, sparse: bool) -> bool {
        let same_layer = (expected.step, expected.layer) == (found.step, found.layer);
        if sparse && expected.layer.is_some() {
            return same_layer;
        }
        let norm = |t: Tap| {
            matches!(
                t,
                Tap::AttnNorm | Tap::AttnPostNorm | Tap::FfnNorm | Tap::FfnPostNorm
            )
        };
        expected == found
            || (self == Mutation::RmsEps10x
                && !sparse
                && norm(found.tap)
                && norm(expected.tap)
                && same_layer)
    }
}

/// The model's BOS id, if it declares one.
pub fn bos_id(model: &Model) -> Option<u32> {
    model
        .file
        .get_u64("tokenizer.ggml.bos_token_id")
        .and_then(|b| u32::try_from(b).ok())
        .filter(|&b| (b as usize) < model.config.n_vocab)
}

/// Byte offset and length of the nibble array inside one block of a type whose quants are
/// stored as nibbles, with the block size in bytes.
fn nibble_layout(ty: GgmlType) -> Option<(usize, usize, usize)> {
    match ty {
        GgmlType::Q4_0 | GgmlType::IQ4_NL => Some((2, 16, 18)),
        GgmlType::Q4_1 => Some((4, 16, 20)),
        GgmlType::Q5_0 => Some((6, 16, 22)),
        GgmlType::Q5_1 => Some((8, 16, 24)),
        GgmlType::Q4_K => Some((16, 128, 144)),
        GgmlType::Q5_K => Some((48, 128, 176)),
        _ => None,
    }
}

/// Whether the decoder-nibble-order bug changes how a `ty` weight decodes.
pub fn swaps_nibbles(ty: GgmlType) -> bool {
    nibble_layout(ty).is_some()
}

/// The raw bytes of a row of a nibble type with the two nibbles of every quant byte swapped:
/// what a decoder that reads them in the wrong order sees.
pub fn swap_nibbles(ty: GgmlType, bytes: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    if let Some((off, len, block)) = nibble_layout(ty) {
        for b in out.chunks_exact_mut(block) {
            for q in &mut b[off..off + len] {
                *q = q.rotate_left(4);
            }
        }
    }
    out
}

/// The block size in bytes and the offset of a type whose decoder subtracts one from its
/// quants (Q4_0: q − 8, Q5_0: q − 16), its f16 scale first in the block.
fn quant_offset(ty: GgmlType) -> Option<(usize, f32)> {
    match ty {
        GgmlType::Q4_0 => Some((18, 8.0)),
        GgmlType::Q5_0 => Some((22, 16.0)),
        _ => None,
    }
}

/// Whether decoder bug `m` changes how a `ty` weight decodes.
pub fn misdecodes(m: Mutation, ty: GgmlType) -> bool {
    match m {
        Mutation::DecoderNibbleOrder => swaps_nibbles(ty),
        Mutation::DecoderNoOffset => quant_offset(ty).is_some(),
        _ => false,
    }
}

/// A row of `ty` as a decoder with bug `m` decodes its raw `bytes` (the exact decoder on the
/// bytes the bug reads, then what the bug leaves out added back).
pub fn decode_row(m: Mutation, ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match m {
        Mutation::DecoderNibbleOrder => {
            crate::quant::dequantize_row(ty, &swap_nibbles(ty, bytes), out)
                .expect("row length validated at open");
        }
        _ => {
            crate::quant::dequantize_row(ty, bytes, out).expect("row length validated at open");
            if let (Mutation::DecoderNoOffset, Some((block, off))) = (m, quant_offset(ty)) {
                for (b, vals) in bytes.chunks_exact(block).zip(out.chunks_mut(32)) {
                    let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                    vals.iter_mut().for_each(|v| *v += off * d);
                }
            }
        }
    }
}

/// The first tap, in graph order, that reads a tensor decoder bug `m` misdecodes (from layer
/// `from` on).
fn first_misdecoded(m: Mutation, model: &Model, from: usize) -> Option<TapKey> {
    let nib = |t: &TensorInfo| misdecodes(m, t.ty);
    if from == 0 && nib(&model.token_embd) {
        return Some(TapKey::new(0, None, Tap::Embd));
    }
    for (l, w) in model.layers.iter().enumerate().skip(from) {
        let at = |tap| Some(TapKey::new(0, Some(l), tap));
        if nib(&w.wq) {
            return at(Tap::Q);
        }
        if nib(&w.wk) {
            return at(Tap::K);
        }
        if nib(&w.wv) {
            return at(Tap::V);
        }
        if nib(&w.wo) {
            return at(Tap::AttnOut);
        }
        if nib(&w.w_gate) {
            return at(Tap::FfnGate);
        }
        if nib(&w.w_up) {
            return at(Tap::FfnUp);
        }
        if nib(&w.w_down) {
            return at(Tap::FfnOut);
        }
    }
    nib(&model.output).then_some(TapKey::new(0, None, Tap::Logits))
}

/// The first RMSNorm, in graph order, whose output the norm-weight bug changes: a weight
/// with an element that is not 1 (missing) or not 0 or 1 (twice), from layer `from` on.
fn first_norm_showing(m: Mutation, model: &Model, from: usize) -> Option<TapKey> {
    let shows = |t: &TensorInfo| {
        model.vector(t).iter().any(|&w| match m {
            Mutation::NormWeightTwice => w * w != w,
            _ => w != 1.0,
        })
    };
    for (l, w) in model.layers.iter().enumerate().skip(from) {
        let norms = [
            (Some(&w.attn_norm), Tap::AttnNorm),
            (w.attn_post_norm.as_ref(), Tap::AttnPostNorm),
            (Some(&w.ffn_norm), Tap::FfnNorm),
            (w.ffn_post_norm.as_ref(), Tap::FfnPostNorm),
        ];
        for (n, tap) in norms {
            if n.is_some_and(shows) {
                return Some(TapKey::new(0, Some(l), tap));
            }
        }
    }
    shows(&model.output_norm).then_some(TapKey::new(0, None, Tap::ResultNorm))
}

/// The first of q, k, v (in graph order, from layer `from` on) whose bias has an element other
/// than 0: where `no-qkv-bias` first shows.
fn first_bias_showing(model: &Model, from: usize) -> Option<TapKey> {
    let shows = |b: &Option<TensorInfo>| {
        b.as_ref()
            .is_some_and(|b| model.vector(b).iter().any(|&x| x != 0.0))
    };
    model
        .layers
        .iter()
        .enumerate()
        .skip(from)
        .find_map(|(l, w)| {
            [(&w.bq, Tap::Q), (&w.bk, Tap::K), (&w.bv, Tap::V)]
                .into_iter()
                .find(|(b, _)| shows(b))
                .map(|(_, tap)| TapKey::new(0, Some(l), tap))
        })
}

/// The first attn_norm whose output `attn-norm-weight-twice` changes (an element not 0 or 1),
/// from layer `from` on.
fn first_attn_norm_showing(model: &Model, from: usize) -> Option<TapKey> {
    (from..model.config.n_layer)
        .find(|&l| {
            model
                .vector(&model.layers[l].attn_norm)
                .iter()
                .any(|&w| w * w != w)
        })
        .map(|l| TapKey::new(0, Some(l), Tap::AttnNorm))
}

/// The RoPE pairing an engine with `rope-neox` uses.
pub fn other_rope(kind: RopeType) -> RopeType {
    match kind {
        RopeType::Norm => RopeType::Neox,
        RopeType::Neox => RopeType::Norm,
    }
}

/// The RoPE base an engine with `rope-theta` uses.
pub fn wrong_theta(theta: f32) -> f32 {
    if theta == 10000.0 { 100000.0 } else { 10000.0 }
}

/// Rows of a `[T, n_heads, head_dim]` projection permuted inside each head as llama.cpp's
/// `convert_hf_to_gguf.py` permutes Q/K weights: output dim 2i+s takes dim s·head_dim/2 + i.
pub fn permute_heads(x: &[f32], n_heads: usize, head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0f32; x.len()];
    for (src, dst) in x.chunks(head_dim).zip(out.chunks_mut(head_dim)) {
        for i in 0..half {
            for s in 0..2 {
                dst[2 * i + s] = src[s * half + i];
            }
        }
        if head_dim % 2 == 1 {
            dst[head_dim - 1] = src[head_dim - 1];
        }
    }
    debug_assert_eq!(x.len() % (n_heads * head_dim), 0);
    out
}

/// A `[T, n_heads, head_dim]` tensor stored head-major, `[n_heads, T, head_dim]`.
pub fn to_head_major(x: &[f32], t: usize, n_heads: usize, head_dim: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for i in 0..t {
        for h in 0..n_heads {
            out[(h * t + i) * head_dim..][..head_dim]
                .copy_from_slice(&x[(i * n_heads + h) * head_dim..][..head_dim]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for &m in Mutation::ALL {
            assert_eq!(Mutation::parse(m.name()), Some(m));
            assert!(seen.insert(m.name()), "{m} twice");
            assert!(!m.describe().is_empty());
        }
        assert_eq!(Mutation::parse("rope"), None);
    }

    #[test]
    fn position_bugs_take_a_width_and_know_where_they_show() {
        assert_eq!(
            Mutation::parse("kv-ring-wrap=128"),
            Some(Mutation::KvRingWrap(128))
        );
        assert_eq!(
            Mutation::parse("mask-tail-block"),
            Some(Mutation::MaskTailBlock(WRAP))
        );
        for bad in [
            "kv-ring-wrap=0",
            "kv-ring-wrap=x",
            "rms-eps-10x=3",
            "rope-pos-wrap=",
        ] {
            assert_eq!(Mutation::parse(bad), None, "{bad}");
        }
        assert_eq!(
            Mutation::KvRingWrap(16).describe_width(),
            Mutation::KvRingWrap(16)
                .describe()
                .replace("of W slots", "of 16 slots")
                .replace("position W", "position 16")
                .replace("mod W", "mod 16")
        );
        // A 20-token prompt and 4 decode steps.
        let run = [(0, 0, 20), (1, 20, 1), (2, 21, 1), (3, 22, 1), (4, 23, 1)];
        assert_eq!(Mutation::KvRingWrap(8).first_position(&run), Some((0, 8)));
        assert_eq!(
            Mutation::RopePosWrap(21).first_position(&run),
            Some((2, 21))
        );
        assert_eq!(Mutation::RopePosWrap(24).first_position(&run), None);
        // Rows 16..19 after the last block of 8; with blocks of 10 the prompt is whole, and
        // with blocks of 19 the tail is the last row alone.
        assert_eq!(
            Mutation::MaskTailBlock(8).first_position(&run),
            Some((0, 16))
        );
        assert_eq!(Mutation::MaskTailBlock(10).first_position(&run), None);
        assert_eq!(Mutation::MaskTailBlock(19).first_position(&run), None);
        // A prompt shorter than a block is unmasked whole, from its first row.
        assert_eq!(
            Mutation::MaskTailBlock(32).first_position(&run),
            Some((0, 0))
        );
        assert_eq!(Mutation::RmsEps10x.first_position(&run), None);
        // No step of several tokens after the first: no turn to reset at.
        assert_eq!(Mutation::KvResetPerTurn.first_position(&run), None);
        let turns = [(0, 0, 32), (1, 32, 6), (2, 38, 1), (3, 39, 20), (4, 59, 1)];
        assert_eq!(
            Mutation::KvResetPerTurn.first_position(&turns),
            Some((1, 32))
        );
        assert_eq!(
            Mutation::PosRestartPerTurn.first_position(&turns[1..]),
            Some((3, 39))
        );
    }

    #[test]
    fn nibble_swap_trades_elements_j_and_j_plus_16() {
        // One Q4_0 block: d = 1.0 (f16 0x3c00), qs[j] = j | (15 - j) << 4.
        let mut b = vec![0x00, 0x3c];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut a = vec![0.0f32; 32];
        let mut s = vec![0.0f32; 32];
        crate::quant::dequantize_row(GgmlType::Q4_0, &b, &mut a).unwrap();
        crate::quant::dequantize_row(GgmlType::Q4_0, &swap_nibbles(GgmlType::Q4_0, &b), &mut s)
            .unwrap();
        assert_eq!(&s[..16], &a[16..]);
        assert_eq!(&s[16..], &a[..16]);
        assert_ne!(a, s);
    }

    #[test]
    fn head_major_and_permutation_move_the_right_values() {
        // T=2, 2 heads, head_dim 4: value = 100 t + 10 h + d.
        let x: Vec<f32> = (0..16)
            .map(|k| (100 * (k / 8) + 10 * ((k / 4) % 2) + k % 4) as f32)
            .collect();
        let hm = to_head_major(&x, 2, 2, 4);
        assert_eq!(&hm[4..8], &[100.0, 101.0, 102.0, 103.0]); // head 0, t 1
        assert_eq!(&hm[8..12], &[10.0, 11.0, 12.0, 13.0]); // head 1, t 0
        let p = permute_heads(&x, 2, 4);
        assert_eq!(&p[..4], &[0.0, 2.0, 1.0, 3.0]);
    }
}
