//! Backends: the same forward pass over the same model, each recording the same taps.
//! `reference` is the readable truth; `fast` is held to it tap by tap.

pub mod dump;
pub mod f16acc;
pub mod family;
pub mod fast;
pub mod gpu;
pub mod kvcache;
pub mod lockstep;
pub mod mutation;
pub mod positions;
pub mod reference;
pub mod registry;
pub mod vecops;

use crate::trace::{NullSink, Sink, StepInfo};

pub use fast::Fast;
pub use reference::{Emulation, Reference};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("token id {id} is out of range (vocabulary has {n_vocab} tokens)")]
    BadToken { id: u32, n_vocab: usize },
    #[error("context overflow: position {end} exceeds the context length {n_ctx}")]
    ContextOverflow { end: usize, n_ctx: usize },
    #[error("nothing to run: no tokens")]
    Empty,
    /// The gpu backend could not start (no adapter, a tensor past the binding limit): one line.
    #[error("{0}")]
    Gpu(String),
    #[error("unknown backend '{0}' (available: {names})", names = registry::names())]
    Unknown(String),
}

pub trait Backend {
    /// Name recorded as the trace producer, e.g. `reference` or `reference+ggml-cpu`.
    fn name(&self) -> String;

    /// Run `tokens` at positions `pos0..pos0+T` (extending the KV cache), recording taps under
    /// `step`. Returns the logits of the last row (borrowed: decode steps need not allocate).
    fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        step: usize,
        sink: &mut dyn Sink,
    ) -> Result<&[f32], BackendError>;

    /// Forget the KV cache.
    fn reset(&mut self);

    /// The activation rounding this backend applies before matmuls (recorded in the manifests
    /// of its traces as `producer.settings.rounding`).
    fn rounding(&self) -> Emulation;

    /// Lines a check prints about this backend (the device it ran on, weights it holds in
    /// another form than the file's). Default: none.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Index of the largest logit; the first one on ties (as llama.cpp's greedy sampler).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Refuse what no backend can run, before any op: no tokens, ids past the vocabulary, positions
/// past the cache.
pub fn check_inputs(
    c: &crate::model::Config,
    tokens: &[u32],
    pos0: usize,
    n_ctx: usize,
) -> Result<(), BackendError> {
    let t = tokens.len();
    if t == 0 {
        return Err(BackendError::Empty);
    }
    if pos0 + t > n_ctx {
        return Err(BackendError::ContextOverflow {
            end: pos0 + t,
            n_ctx,
        });
    }
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.n_vocab) {
        return Err(BackendError::BadToken {
            id,
            n_vocab: c.n_vocab,
        });
    }
    Ok(())
}

/// Prefill `prompt` (step 0), then `n_steps` decode steps of one token each. Each decode step
/// feeds `forced[i]` when given, else the greedy argmax of the previous logits (teacher forcing
/// from the greedy continuation). Returns what was fed at each step.
pub fn run(
    backend: &mut dyn Backend,
    prompt: &[u32],
    n_steps: usize,
    forced: Option<&[u32]>,
    sink: &mut dyn Sink,
) -> Result<Vec<StepInfo>, BackendError> {
    if prompt.is_empty() {
        return Err(BackendError::Empty);
    }
    backend.reset();
    let mut next = argmax(backend.forward(prompt, 0, 0, sink)?);
    let mut steps = vec![StepInfo {
        step: 0,
        tokens: prompt.to_vec(),
        positions: (0..prompt.len()).collect(),
        forced: None,
    }];
    for (s, pos) in (1..=n_steps).zip(prompt.len()..) {
        let tok = match forced.and_then(|f| f.get(s - 1)) {
            Some(&t) => t,
            None => next,
        };
        next = argmax(backend.forward(&[tok], pos, s, sink)?);
        steps.push(StepInfo {
            step: s,
            tokens: vec![tok],
            positions: vec![pos],
            forced: Some(true),
        });
    }
    Ok(steps)
}

/// Prefill `prompt` (step 0), then feed each of `later` as one step of its own (teacher
/// forced): a prompt fed in chunks, a further turn of a conversation, or one-token decode steps
/// alike, each step's rows attending to the cache of every earlier step.
pub fn run_steps(
    backend: &mut dyn Backend,
    prompt: &[u32],
    later: &[Vec<u32>],
    sink: &mut dyn Sink,
) -> Result<Vec<StepInfo>, BackendError> {
    if prompt.is_empty() || later.iter().any(|s| s.is_empty()) {
        return Err(BackendError::Empty);
    }
    backend.reset();
    backend.forward(prompt, 0, 0, sink)?;
    let mut steps = vec![StepInfo {
        step: 0,
        tokens: prompt.to_vec(),
        positions: (0..prompt.len()).collect(),
        forced: None,
    }];
    let mut pos = prompt.len();
    for (s, toks) in (1..).zip(later) {
        backend.forward(toks, pos, s, sink)?;
        steps.push(StepInfo {
            step: s,
            tokens: toks.clone(),
            positions: (pos..pos + toks.len()).collect(),
            forced: Some(true),
        });
        pos += toks.len();
    }
    Ok(steps)
}

/// Greedy generation: returns the `n` generated ids (stops early at `eos`).
pub fn generate(
    backend: &mut dyn Backend,
    prompt: &[u32],
    n: usize,
    eos: Option<u32>,
) -> Result<Vec<u32>, BackendError> {
    if prompt.is_empty() {
        return Err(BackendError::Empty);
    }
    backend.reset();
    let mut out = Vec::with_capacity(n);
    let mut tok = argmax(backend.forward(prompt, 0, 0, &mut NullSink)?);
    for (s, pos) in (1..=n).zip(prompt.len()..) {
        out.push(tok);
        if Some(tok) == eos || s == n {
            break;
        }
        tok = argmax(backend.forward(&[tok], pos, s, &mut NullSink)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Model;
    use crate::trace::{MemorySink, Tap, TapFilter};

    /// A sink that does not record the attention probabilities gets every other tap bit for
    /// bit as one that does: the backends' `attention` (the fast one a head at a time, never
    /// holding every head's probabilities) is their `attn_probs` then `attn_values`. GQA
    /// (qwen2), a sliding window and soft-capped scores (gemma2), f32, f16 (flash) and Q8_0
    /// caches, prefill and decode.
    #[test]
    fn attention_without_its_probabilities_changes_no_tap() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for fixture in ["tiny-qwen2-q8_0", "tiny-gemma2-q8_0", "tiny-llama-q4_0"] {
            let m = Model::open(root.join(format!("fixtures/{fixture}.gguf"))).unwrap();
            // Longer than gemma2's fixture window, so the window cuts in.
            let prompt: Vec<u32> = (0..40).map(|i| 1 + (i * 37) % 200).collect();
            /// Every tap but the probabilities.
            struct NoProbs(MemorySink);
            impl Sink for NoProbs {
                fn wants(&self, k: &crate::trace::TapKey) -> bool {
                    k.tap != Tap::KqSoftMax
                }
                fn record(&mut self, k: crate::trace::TapKey, shape: &[usize], d: &[f32]) {
                    self.0.record(k, shape, d)
                }
            }
            use kvcache::{CacheType, KvCache};
            // The reference also under ggml's flash attention over an f16 V (values accumulated
            // from the scores), and a Q8_0 cache (stored rotated, probabilities rounded).
            let caches = [
                KvCache::F32,
                KvCache {
                    threads: 2,
                    ..KvCache::llama_cpp(CacheType::F16, CacheType::F16, true)
                },
                KvCache::llama_cpp(CacheType::Q8_0, CacheType::Q8_0, true),
            ];
            let trace = |probs: bool, b: usize| {
                let mut b: Box<dyn Backend> = match b {
                    0 => Box::new(Fast::new(&m, 64, 2)),
                    c => {
                        Box::new(Reference::new(&m, Emulation::GgmlCpu, 64).with_kv(caches[c - 1]))
                    }
                };
                let mut sink = NoProbs(MemorySink::new(TapFilter::all()));
                if probs {
                    run(b.as_mut(), &prompt, 3, None, &mut sink.0).unwrap();
                } else {
                    run(b.as_mut(), &prompt, 3, None, &mut sink).unwrap();
                }
                sink.0.tensors
            };
            for b in 0..=caches.len() {
                let (all, without) = (trace(true, b), trace(false, b));
                let probs = all.keys().filter(|k| k.tap == Tap::KqSoftMax).count();
                assert!(probs > 0, "{fixture}");
                assert_eq!(without.len(), all.len() - probs, "{fixture}");
                let bits =
                    |x: &ndarray::ArrayD<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                for (k, a) in &without {
                    assert_eq!(bits(a), bits(&all[k]), "{fixture} {k:?} (backend {b})");
                }
            }
        }
    }

    /// A prompt's logits made a slice of rows at a time (a sink that takes them so) are the
    /// whole tensor's, bit for bit: the fast backend, the reference under every rounding it
    /// emulates (an f16-accumulating and a Q8_K output projection among them), a weight-reading
    /// bug at the output (a transposed lm_head), gemma2's final soft-cap; slices of 4 rows and
    /// a last one shorter; the returned logits are the last row's either way.
    #[test]
    fn logits_made_in_rows_are_the_whole_tensor_s() {
        use crate::backend::mutation::Mutation;
        use crate::trace::{Sink, TapKey};
        /// A MemorySink taking rows, counting the slices it is handed.
        struct Slices(MemorySink, usize);
        impl Sink for Slices {
            fn wants(&self, k: &TapKey) -> bool {
                self.0.wants(k)
            }
            fn record(&mut self, k: TapKey, shape: &[usize], d: &[f32]) {
                self.0.record(k, shape, d)
            }
            fn row_slice(&self, k: &TapKey) -> Option<usize> {
                self.0.row_slice(k)
            }
            fn record_rows(&mut self, k: TapKey, shape: &[usize], row0: usize, d: &[f32]) {
                self.1 += 1;
                self.0.record_rows(k, shape, row0, d)
            }
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let prompt: Vec<u32> = (0..23).map(|i| 1 + (i * 37) % 200).collect();
        for fixture in ["tiny-llama-q4_0", "tiny-gemma2-q8_0", "tiny-qwen2-q8_0"] {
            let m = Model::open(root.join(format!("fixtures/{fixture}.gguf"))).unwrap();
            let nv = m.config.n_vocab;
            let names: Vec<String> = ["fast".to_string()]
                .into_iter()
                .chain(Emulation::ALL.iter().map(|e| format!("{e:?}")))
                .chain(["transposed lm_head".to_string()])
                .collect();
            let make = |i: usize| -> Box<dyn Backend + '_> {
                match i {
                    0 => Box::new(Fast::new(&m, 64, 2)),
                    i if i <= Emulation::ALL.len() => {
                        Box::new(Reference::new(&m, Emulation::ALL[i - 1], 64))
                    }
                    _ => Box::new(
                        Reference::new(&m, Emulation::GgmlCpu, 64)
                            .with_mutation(Some(Mutation::TransposedLmHead)),
                    ),
                }
            };
            for (i, name) in names.iter().enumerate() {
                let mut whole = MemorySink::new(TapFilter::all());
                let last = make(i).forward(&prompt, 0, 0, &mut whole).unwrap().to_vec();
                let mut sliced = Slices(MemorySink::new(TapFilter::all()).in_rows(4 * nv), 0);
                let last_sliced = make(i)
                    .forward(&prompt, 0, 0, &mut sliced)
                    .unwrap()
                    .to_vec();
                let capped = m.config.final_softcap.is_some() as usize;
                assert_eq!(
                    sliced.1,
                    6 * (1 + capped),
                    "{fixture} {name}: 23 rows in 4s"
                );
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&last), bits(&last_sliced), "{fixture} {name}");
                assert_eq!(
                    whole.tensors.keys().collect::<Vec<_>>(),
                    sliced.0.tensors.keys().collect::<Vec<_>>(),
                    "{fixture} {name}"
                );
                for (k, a) in &whole.tensors {
                    let b = &sliced.0.tensors[k];
                    assert_eq!(a.shape(), b.shape(), "{fixture} {name} {k}");
                    assert_eq!(
                        bits(a.as_slice().unwrap()),
                        bits(b.as_slice().unwrap()),
                        "{fixture} {name} {k}"
                    );
                }
            }
        }
    }

    /// Releasing each layer's pages as a forward leaves it (a model larger than memory) changes
    /// no bit of any tap, in the reference and the fast backend, prefill and decode.
    #[test]
    fn releasing_layers_changes_no_tap() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama-q8_0.gguf");
        let trace = |release: bool, fast: bool| {
            let mut m = Model::open(&path).unwrap();
            m.set_release_layers(release);
            let mut sink = MemorySink::new(TapFilter::all());
            let mut b: Box<dyn Backend> = if fast {
                Box::new(Fast::new(&m, 32, 2))
            } else {
                Box::new(Reference::new(&m, Emulation::GgmlCpu, 32))
            };
            run(b.as_mut(), &[1, 17, 42, 99], 3, None, &mut sink).unwrap();
            sink.tensors
        };
        for fast in [false, true] {
            let (kept, released) = (trace(false, fast), trace(true, fast));
            assert!(!kept.is_empty());
            assert_eq!(kept.len(), released.len());
            for ((k, a), (k2, b)) in kept.iter().zip(&released) {
                assert_eq!(k, k2);
                let bits =
                    |x: &ndarray::ArrayD<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(b), "{k:?} (fast: {fast})");
            }
        }
    }
}
