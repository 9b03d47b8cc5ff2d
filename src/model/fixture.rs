//! Deterministic tiny random-weight models (`parity fixture`), written as GGUF files that the real
//! llama.cpp loads: every architecture parity knows (plus `llama3`: a llama file with RoPE
//! frequency factors), any supported weight type, a small SentencePiece vocabulary with byte
//! fallback in the metadata. Each architecture's features are switched on with values small
//! enough to matter on a 16-token prompt (docs/architectures.md, "Fixtures").

use crate::gguf::{GgmlType, GgufWriter, Value, ValueType};
use crate::quant;

#[derive(Clone, Debug)]
pub struct FixtureSpec {
    pub arch: String,
    /// Type of the 2-d matmul weights (and token embedding); norms and biases stay F32.
    pub weight_type: GgmlType,
    pub seed: u64,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_ctx: usize,
    /// Pad the vocabulary with dummy normal tokens up to this many (None: the built-in
    /// vocabulary only). Benchmarks use it to get a real model's output-projection size.
    pub n_vocab: Option<usize>,
    /// Tie the output projection to the token embedding (no output.weight).
    pub tied: bool,
    /// llama-quantize's Q4_K_M mix instead of one type: Q6_K for output.weight and for
    /// attn_v / ffn_down in the layers `use_more_bits` picks, Q4_K elsewhere.
    pub q4_k_m: bool,
    /// Sliding-window length of gemma2/gemma3 (and phi3's, which llama.cpp ignores).
    pub n_swa: usize,
    /// Linear RoPE scaling (`rope.scaling.factor`: positions divided by it), where the
    /// architecture's own preset has none or another (gemma3's global layers: 8).
    pub rope_scale: Option<f32>,
    /// attn_q and attn_k's weights scaled by this (scores by its square; 1: as drawn).
    pub qk_gain: f32,
}

/// `parity fixture --arch` names: the architectures, plus `llama3`.
pub const FIXTURE_ARCHS: &[&str] = &[
    "llama", "llama3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
];

/// The special tokens of Phi-3's vocabulary that llama.cpp requires in a phi3 file.
pub const PHI3_SPECIAL: &[&str] = &[
    "<|endoftext|>",
    "<|assistant|>",
    "<|end|>",
    "<|user|>",
    "<|system|>",
];

/// gemma2's soft-caps in the fixtures: small enough that tanh bends typical scores and logits.
pub const FIXTURE_ATTN_SOFTCAP: f32 = 1.5;
pub const FIXTURE_FINAL_SOFTCAP: f32 = 5.0;
/// gemma3's layer period in the fixtures (`attention.sliding_window_pattern`): two local
/// layers, then a global one.
pub const FIXTURE_GEMMA3_PERIOD: u32 = 3;

impl FixtureSpec {
    pub fn new(arch: &str, weight_type: GgmlType, seed: u64) -> Self {
        FixtureSpec {
            arch: arch.to_string(),
            weight_type,
            seed,
            // Row widths that are multiples of 256 so K-quants are real.
            n_embd: 256,
            n_ff: 512,
            n_layer: 2,
            n_head: 4,
            n_head_kv: 2,
            n_ctx: 256,
            n_vocab: None,
            tied: false,
            q4_k_m: false,
            n_swa: 4,
            rope_scale: None,
            qk_gain: 1.0,
        }
    }
}

/// splitmix64: tiny, fast and identical on every platform.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-a, a).
    fn uniform(&mut self, a: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * a
    }
}

/// Tokens, their SentencePiece scores and their token types, index by index.
pub type Vocab = (Vec<String>, Vec<f32>, Vec<i32>);

/// The fixture vocabulary: `<unk> <s> </s>`, 256 byte tokens, then SentencePiece pieces for
/// single characters and a few story words with every prefix (SPM merges need them).
pub fn vocab() -> Vocab {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let mut pieces: Vec<String> = vec!["▁".into()];
    for c in ('a'..='z').chain('A'..='Z').chain(".,!?'".chars()) {
        pieces.push(c.to_string());
    }
    let words = "once upon a time there was little girl named lily she loved to play in the park \
                 one day saw big red ball and he it said";
    for w in words.split_whitespace() {
        let p: Vec<char> = format!("▁{w}").chars().collect();
        for n in 2..=p.len() {
            pieces.push(p[..n].iter().collect());
        }
    }
    let mut seen = std::collections::HashSet::new();
    for p in pieces {
        if seen.insert(p.clone()) {
            tokens.push(p);
            types.push(1);
        }
    }
    // Longer pieces score higher so the SPM merge prefers whole words.
    let scores = tokens
        .iter()
        .zip(&types)
        .map(|(t, &ty)| {
            if ty == 1 {
                t.chars().count() as f32 - 10.0
            } else {
                0.0
            }
        })
        .collect();
    (tokens, scores, types)
}

/// Build the GGUF image of a fixture.
/// What a spec makes, checked: the file's architecture and the sizes its tensors take.
struct Shape<'s> {
    /// `--arch` as given (`llama3` included).
    preset: &'s str,
    /// `general.architecture` (llama3 is a llama file with rope_freqs.weight).
    arch: &'s str,
    head_dim: usize,
    /// RoPE base.
    theta: f32,
    /// phi3 (LongRoPE) is trained for 32x the original context.
    n_ctx_train: usize,
}

impl Shape<'_> {
    fn gemma(&self) -> bool {
        self.arch.starts_with("gemma")
    }
}

/// The spec's sizes checked against each other and the weight type (one line each).
fn shape(spec: &FixtureSpec) -> Result<Shape<'_>, String> {
    let preset = spec.arch.as_str();
    if !FIXTURE_ARCHS.contains(&preset) {
        return Err(format!(
            "unsupported fixture architecture '{preset}' ({})",
            FIXTURE_ARCHS.join(", ")
        ));
    }
    let arch = if preset == "llama3" { "llama" } else { preset };
    let wt = spec.weight_type;
    if wt == GgmlType::Q8_K || wt == GgmlType::Q8_1 {
        return Err(format!(
            "{wt} is an activation-only type; pick a weight type"
        ));
    }
    let bs = wt.block_size();
    if !spec.n_embd.is_multiple_of(bs) || !spec.n_ff.is_multiple_of(bs) {
        return Err(format!(
            "n_embd {} and n_ff {} must be multiples of the {wt} block size {bs}",
            spec.n_embd, spec.n_ff
        ));
    }
    if spec.n_head == 0 || spec.n_head_kv == 0 || !spec.n_head.is_multiple_of(spec.n_head_kv) {
        return Err("n_head must be a positive multiple of n_head_kv".into());
    }
    // qwen3 (like the real 0.6B) has heads wider than n_embd / n_head.
    let head_dim = if arch == "qwen3" {
        2 * spec.n_embd / spec.n_head
    } else {
        spec.n_embd / spec.n_head
    };
    if head_dim % 2 != 0 || head_dim == 0 {
        return Err(format!(
            "n_embd {} over n_head {} leaves an odd or empty head",
            spec.n_embd, spec.n_head
        ));
    }
    if arch == "phi3" && spec.n_ctx < 2 {
        return Err("phi3 needs n_ctx >= 2".into());
    }
    let theta = match preset {
        "qwen2" | "qwen3" | "gemma3" => 1_000_000.0,
        "llama3" => 500_000.0,
        _ => 10_000.0,
    };
    // phi3: llama.cpp uses the short factors while its context is at most the original (the
    // goldens' 256), the long ones beyond.
    let n_ctx_train = if arch == "phi3" {
        spec.n_ctx * 32
    } else {
        spec.n_ctx
    };
    Ok(Shape {
        preset,
        arch,
        head_dim,
        theta,
        n_ctx_train,
    })
}

/// The built-in vocabulary, with phi3's special tokens and the spec's padding.
fn vocabulary(spec: &FixtureSpec, s: &Shape) -> Result<Vocab, String> {
    let (mut tokens, mut scores, mut types) = vocab();
    if s.arch == "phi3" {
        // llama.cpp's vocabulary loader looks these up by text for phi3 (std::map::at: a
        // phi3 file without them does not load); control tokens, as in Phi-3's own vocab.
        for t in PHI3_SPECIAL {
            tokens.push(t.to_string());
            scores.push(0.0);
            types.push(3);
        }
    }
    if let Some(n) = spec.n_vocab {
        if n < tokens.len() {
            return Err(format!(
                "n_vocab {n} is smaller than the built-in vocabulary ({} tokens)",
                tokens.len()
            ));
        }
        for i in tokens.len()..n {
            tokens.push(format!("<dummy{i:06}>"));
            scores.push(-1000.0);
            types.push(1);
        }
    }
    Ok((tokens, scores, types))
}

/// A deterministic model for `spec`, as a GGUF writer: metadata, tokenizer, then weights.
pub fn build(spec: &FixtureSpec) -> Result<GgufWriter, String> {
    let s = shape(spec)?;
    let (tokens, scores, types) = vocabulary(spec, &s)?;
    let n_vocab = tokens.len();
    let mut w = GgufWriter::new();
    write_hparams(&mut w, spec, &s);
    write_tokenizer(&mut w, &s, tokens, scores, types);
    write_weights(&mut w, spec, &s, n_vocab);
    w.set(
        "general.file_type",
        Value::U32(llama_ftype(spec.weight_type)),
    );
    Ok(w)
}

/// The architecture's hyperparameters and the features each fixture switches on.
fn write_hparams(w: &mut GgufWriter, spec: &FixtureSpec, s: &Shape) {
    let (arch, wt, head_dim) = (s.arch, spec.weight_type, s.head_dim);
    let k = |key: &str| format!("{arch}.{key}");
    w.set("general.architecture", Value::String(arch.into()));
    w.set(
        "general.name",
        Value::String(format!(
            "parity-fixture-{}-{}-s{}",
            s.preset,
            wt.name(),
            spec.seed
        )),
    );
    w.set(&k("context_length"), Value::U32(s.n_ctx_train as u32));
    w.set(&k("embedding_length"), Value::U32(spec.n_embd as u32));
    w.set(&k("block_count"), Value::U32(spec.n_layer as u32));
    w.set(&k("feed_forward_length"), Value::U32(spec.n_ff as u32));
    w.set(&k("attention.head_count"), Value::U32(spec.n_head as u32));
    w.set(
        &k("attention.head_count_kv"),
        Value::U32(spec.n_head_kv as u32),
    );
    w.set(&k("rope.dimension_count"), Value::U32(head_dim as u32));
    if head_dim != spec.n_embd / spec.n_head {
        w.set(&k("attention.key_length"), Value::U32(head_dim as u32));
        w.set(&k("attention.value_length"), Value::U32(head_dim as u32));
    }
    w.set(&k("rope.freq_base"), Value::F32(s.theta));
    let eps = if s.gemma() { 1e-6 } else { 1e-5 };
    w.set(&k("attention.layer_norm_rms_epsilon"), Value::F32(eps));
    match arch {
        "gemma2" => {
            // period 2 (llama.cpp's default for gemma2, not written): layer 0 slides, 1 is global
            w.set(
                &k("attention.sliding_window"),
                Value::U32(spec.n_swa as u32),
            );
            w.set(
                &k("attn_logit_softcapping"),
                Value::F32(FIXTURE_ATTN_SOFTCAP),
            );
            w.set(
                &k("final_logit_softcapping"),
                Value::F32(FIXTURE_FINAL_SOFTCAP),
            );
        }
        "gemma3" => {
            w.set(
                &k("attention.sliding_window"),
                Value::U32(spec.n_swa as u32),
            );
            w.set(
                &k("attention.sliding_window_pattern"),
                Value::U32(FIXTURE_GEMMA3_PERIOD),
            );
            // global layers: base 1e6 with linear scaling 8 (gemma3 4B+); local: base 10000
            w.set(&k("rope.scaling.type"), Value::String("linear".into()));
            w.set(&k("rope.scaling.factor"), Value::F32(8.0));
        }
        "phi3" => {
            // read and ignored by llama.cpp (PR #13676): phi3 attends to the whole context
            w.set(
                &k("attention.sliding_window"),
                Value::U32(spec.n_swa as u32),
            );
            w.set(
                &k("rope.scaling.original_context_length"),
                Value::U32(spec.n_ctx as u32),
            );
            // the converter's LongRoPE attention factor: sqrt(1 + ln(scale) / ln(n_orig))
            let scale = (s.n_ctx_train as f64) / (spec.n_ctx as f64);
            let f = (1.0 + scale.ln() / (spec.n_ctx as f64).ln()).sqrt();
            w.set(&k("rope.scaling.attn_factor"), Value::F32(f as f32));
        }
        _ => {}
    }
    if let Some(f) = spec.rope_scale {
        w.set(&k("rope.scaling.type"), Value::String("linear".into()));
        w.set(&k("rope.scaling.factor"), Value::F32(f));
    }
}

/// A SentencePiece tokenizer over the vocabulary, BOS added.
fn write_tokenizer(
    w: &mut GgufWriter,
    s: &Shape,
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
) {
    w.set(
        &format!("{}.vocab_size", s.arch),
        Value::U32(tokens.len() as u32),
    );
    w.set("tokenizer.ggml.model", Value::String("llama".into()));
    w.set(
        "tokenizer.ggml.tokens",
        Value::Array(
            ValueType::String,
            tokens.into_iter().map(Value::String).collect(),
        ),
    );
    w.set(
        "tokenizer.ggml.scores",
        Value::Array(ValueType::F32, scores.into_iter().map(Value::F32).collect()),
    );
    w.set(
        "tokenizer.ggml.token_type",
        Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
    );
    w.set("tokenizer.ggml.bos_token_id", Value::U32(1));
    w.set("tokenizer.ggml.eos_token_id", Value::U32(2));
    w.set("tokenizer.ggml.unknown_token_id", Value::U32(0));
    w.set("tokenizer.ggml.add_bos_token", Value::Bool(true));
    w.set("tokenizer.ggml.add_eos_token", Value::Bool(false));
}

/// Every tensor, drawn from one generator in file order (the same seed, the same bytes).
fn write_weights(w: &mut GgufWriter, spec: &FixtureSpec, s: &Shape, n_vocab: usize) {
    let (arch, wt) = (s.arch, spec.weight_type);
    let mut rng = Rng(spec.seed);
    let (e, ff, hd) = (spec.n_embd, spec.n_ff, s.head_dim);
    let (q, kv) = (spec.n_head * hd, spec.n_head_kv * hd);
    // Uniform weights scaled by 1/sqrt(n_in) keep activations O(1) through the layers.
    // llama.cpp's use_more_bits(): the first and last eighth of the layers and every third
    // one between get the bigger type in a _M mix.
    let n_layer = spec.n_layer;
    let more_bits = |l: usize| {
        spec.q4_k_m && (l < n_layer / 8 || l >= 7 * n_layer / 8 || (l - n_layer / 8) % 3 == 2)
    };
    let matrix = |w: &mut GgufWriter, rng: &mut Rng, name: &str, n_in: usize, n_out: usize| {
        let mut a = (3.0 / n_in as f32).sqrt();
        if name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight") {
            a *= spec.qk_gain;
        }
        let data: Vec<f32> = (0..n_in * n_out).map(|_| rng.uniform(a)).collect();
        let bigger = spec.q4_k_m
            && (name == "output.weight"
                || ((name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight"))
                    && name
                        .split('.')
                        .nth(1)
                        .and_then(|l| l.parse().ok())
                        .is_some_and(more_bits)));
        let ty = if bigger { GgmlType::Q6_K } else { wt };
        let bytes = quant::quantize_row(ty, &data).expect("whole blocks");
        w.add_tensor(name, &[n_in as u64, n_out as u64], ty, bytes);
    };
    let vector = |w: &mut GgufWriter, rng: &mut Rng, name: &str, n: usize, center: f32, a: f32| {
        let data: Vec<f32> = (0..n).map(|_| center + rng.uniform(a)).collect();
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.add_tensor(name, &[n as u64], GgmlType::F32, bytes);
    };
    // Embedding rows with unit-ish scale (like trained models' pre-norm residual stream);
    // gemma's are scaled by sqrt(n_embd) in the graph, so they are stored that much smaller.
    {
        let a = if s.gemma() {
            (3.0 / e as f32).sqrt()
        } else {
            1.0
        };
        let data: Vec<f32> = (0..e * n_vocab).map(|_| rng.uniform(a)).collect();
        let bytes = quant::quantize_row(wt, &data).expect("whole blocks");
        w.add_tensor("token_embd.weight", &[e as u64, n_vocab as u64], wt, bytes);
    }
    write_rope_factors(w, s);
    for l in 0..spec.n_layer {
        let n = |s: &str| format!("blk.{l}.{s}");
        vector(w, &mut rng, &n("attn_norm.weight"), e, 1.0, 0.2);
        if arch == "phi3" {
            matrix(w, &mut rng, &n("attn_qkv.weight"), e, q + 2 * kv);
        } else {
            matrix(w, &mut rng, &n("attn_q.weight"), e, q);
            matrix(w, &mut rng, &n("attn_k.weight"), e, kv);
            matrix(w, &mut rng, &n("attn_v.weight"), e, kv);
        }
        if arch == "qwen2" {
            vector(w, &mut rng, &n("attn_q.bias"), q, 0.0, 0.5);
            vector(w, &mut rng, &n("attn_k.bias"), kv, 0.0, 0.5);
            vector(w, &mut rng, &n("attn_v.bias"), kv, 0.0, 0.5);
        }
        if arch == "qwen3" || arch == "gemma3" {
            vector(w, &mut rng, &n("attn_q_norm.weight"), hd, 1.0, 0.5);
            vector(w, &mut rng, &n("attn_k_norm.weight"), hd, 1.0, 0.5);
        }
        matrix(w, &mut rng, &n("attn_output.weight"), q, e);
        if arch == "gemma2" || arch == "gemma3" {
            vector(w, &mut rng, &n("post_attention_norm.weight"), e, 1.0, 0.5);
        }
        vector(w, &mut rng, &n("ffn_norm.weight"), e, 1.0, 0.2);
        if arch == "phi3" {
            // gate rows first, then up rows: ggml_swiglu's split
            matrix(w, &mut rng, &n("ffn_up.weight"), e, 2 * ff);
        } else {
            matrix(w, &mut rng, &n("ffn_gate.weight"), e, ff);
            matrix(w, &mut rng, &n("ffn_up.weight"), e, ff);
        }
        matrix(w, &mut rng, &n("ffn_down.weight"), ff, e);
        if arch == "gemma2" || arch == "gemma3" {
            vector(w, &mut rng, &n("post_ffw_norm.weight"), e, 1.0, 0.5);
        }
    }
    vector(w, &mut rng, "output_norm.weight", e, 1.0, 0.2);
    // gemma and gemma2 have no output.weight (llama.cpp reads token_embd.weight).
    if !spec.tied && arch != "gemma" && arch != "gemma2" {
        matrix(w, &mut rng, "output.weight", e, n_vocab);
    }
}

/// RoPE frequency factors, one per rotated pair (global tensors, not drawn from the generator).
fn write_rope_factors(w: &mut GgufWriter, s: &Shape) {
    let half = s.head_dim / 2;
    if s.preset == "llama3" {
        let data = llama3_rope_factors(s.head_dim, s.theta, 8.0, 1.0, 4.0, 64.0);
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.add_tensor("rope_freqs.weight", &[half as u64], GgmlType::F32, bytes);
    }
    if s.arch == "phi3" {
        // increasing with the pair index, like real LongRoPE factors; long ones much larger
        for (name, top) in [
            ("rope_factors_long.weight", 16.0f32),
            ("rope_factors_short.weight", 1.5),
        ] {
            let data: Vec<f32> = (0..half)
                .map(|i| 1.0 + (top - 1.0) * (i as f32 / (half - 1).max(1) as f32).powi(2))
                .collect();
            let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            w.add_tensor(name, &[half as u64], GgmlType::F32, bytes);
        }
    }
}

/// llama.cpp's LLAMA_FTYPE for the main weight type (informational).
fn llama_ftype(wt: GgmlType) -> u32 {
    match wt {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q2_K => 10,
        GgmlType::Q3_K => 12,
        GgmlType::Q4_K => 15, // Q4_K_M: what llama-quantize writes for a Q4_K model too
        GgmlType::Q5_K => 17,
        GgmlType::Q6_K => 18,
        GgmlType::IQ4_NL => 25,
        GgmlType::IQ4_XS => 30,
        GgmlType::BF16 => 32,
        _ => 0,
    }
}

/// Llama 3.1's RoPE frequency factors (what convert_hf_to_gguf.py writes as rope_freqs.weight
/// from `rope_scaling` of type llama3): 1 for short wavelengths, `factor` for long ones, smooth
/// between. `orig_ctx` sets where the bands fall; a small one puts every band in a tiny head.
pub fn llama3_rope_factors(
    head_dim: usize,
    base: f32,
    factor: f32,
    low_freq_factor: f32,
    high_freq_factor: f32,
    orig_ctx: f32,
) -> Vec<f32> {
    let low_wavelen = orig_ctx / low_freq_factor;
    let high_wavelen = orig_ctx / high_freq_factor;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf(2.0 * i as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth =
                    (orig_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}
