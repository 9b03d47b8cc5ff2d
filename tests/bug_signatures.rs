//! Known engine bugs, injected into our own reference, must be found at the right (step, layer,
//! tap) with the right diagnosis when compared with the real llama.cpp golden.

use crate::common::memory_trace;
use parity::backend::{self, Emulation, Reference};
use parity::compare::{CompareOptions, Comparison, PairKind, compare};
use parity::model::{Model, RopeType};
use parity::trace::{MemorySink, Tap, TapFilter, TapKey, Trace};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Run the emulating reference on `model` with the golden's ids and compare against the golden.
fn run_against_golden(model: &Model, golden: &str, pair: PairKind) -> Comparison {
    run_against_golden_keeping(model, golden, pair, TapFilter::all())
}

/// The same, the reference's trace keeping only the taps `keep` keeps.
fn run_against_golden_keeping(
    model: &Model,
    golden: &str,
    pair: PairKind,
    keep: TapFilter,
) -> Comparison {
    let g = Trace::open(root().join("golden").join(golden)).unwrap();
    let prompt = g.manifest.steps[0].tokens.clone();
    let forced = g.manifest.decode_tokens();
    let mut b = Reference::new(model, Emulation::GgmlCpu, prompt.len() + forced.len());
    let mut sink = MemorySink::new(keep);
    let steps = backend::run(&mut b, &prompt, forced.len(), Some(&forced), &mut sink).unwrap();
    let t = memory_trace(
        "parity",
        "reference:ggml-cpu",
        model.sha256(),
        steps,
        sink.tensors,
    );
    let opt = CompareOptions {
        pair,
        weight_type: model.main_weight_type(),
        require_same_model: true,
    };
    compare(&g, &t, &opt).unwrap()
}

fn open(fixture: &str) -> Model {
    Model::open(root().join("fixtures").join(fixture)).unwrap()
}

fn first(c: &Comparison) -> (TapKey, String) {
    let d = c
        .first_divergence
        .as_ref()
        .expect("a divergence must be found");
    (d.at.key, d.diagnosis.clone())
}

#[test]
fn unmodified_reference_is_at_parity() {
    let m = open("tiny-llama-f32.gguf");
    let c = run_against_golden(&m, "tiny-llama-f32", PairKind::SameRounding);
    assert!(!c.diverged(), "{:?}", c.first_divergence);
}

#[test]
fn wrong_rms_eps_is_found_at_the_first_attn_norm() {
    let mut m = open("tiny-llama-f32.gguf");
    m.config.rms_eps *= 10.0; // 1e-5 -> 1e-4: a 1e-4 relative change of each row's scale
    let c = run_against_golden(&m, "tiny-llama-f32", PairKind::SameRounding);
    let (k, why) = first(&c);
    assert_eq!(k, TapKey::new(0, Some(0), Tap::AttnNorm));
    assert!(why.contains("rms eps"), "{why}");
    assert!(why.contains("each token's row"), "{why}");
}

#[test]
fn neox_rope_on_a_llama_model_is_found_at_q_rope_with_position_zero_matching() {
    let mut m = open("tiny-llama-q8_0.gguf");
    m.config.rope_type = RopeType::Neox;
    let c = run_against_golden(&m, "tiny-llama-q8_0", PairKind::SameRounding);
    let (k, why) = first(&c);
    assert_eq!(k, TapKey::new(0, Some(0), Tap::QRope));
    assert!(why.contains("position 0 matches"), "{why}");
    assert!(why.contains("pairing"), "{why}");
}

#[test]
fn wrong_rope_theta_is_found_at_q_rope() {
    let mut m = open("tiny-qwen2-q8_0.gguf");
    m.config.rope_theta = 10_000.0; // qwen2 uses 1e6
    let c = run_against_golden(&m, "tiny-qwen2-q8_0", PairKind::SameRounding);
    let (k, why) = first(&c);
    assert_eq!(k, TapKey::new(0, Some(0), Tap::QRope));
    assert!(why.contains("RoPE"), "{why}");
}

#[test]
fn untied_model_using_the_embedding_as_output_is_found_at_the_logits() {
    let mut m = open("tiny-llama-q4_0.gguf");
    m.output = m.token_embd.clone();
    let c = run_against_golden(&m, "tiny-llama-q4_0", PairKind::SameRounding);
    let (k, why) = first(&c);
    assert_eq!(k, TapKey::new(0, None, Tap::Logits));
    assert!(why.contains("result_norm matches"), "{why}");
    assert!(why.contains("output projection"), "{why}");
}

#[test]
fn plain_f32_activations_on_a_quantized_model_pass_only_with_different_rounding_tolerances() {
    // The plain reference is off by llama.cpp's activation rounding: fine under the
    // different-rounding policy, a divergence under the same-rounding one.
    let m = open("tiny-llama-q8_0.gguf");
    let g = Trace::open(root().join("golden/tiny-llama-q8_0")).unwrap();
    let prompt = g.manifest.steps[0].tokens.clone();
    let mut b = Reference::new(&m, Emulation::None, prompt.len());
    let mut sink = MemorySink::new(TapFilter::all());
    let steps = backend::run(&mut b, &prompt, 0, None, &mut sink).unwrap();
    let t = memory_trace("parity", "reference", m.sha256(), steps, sink.tensors);
    let loose = CompareOptions {
        pair: PairKind::DifferentRounding,
        weight_type: m.main_weight_type(),
        require_same_model: true,
    };
    assert!(!compare(&g, &t, &loose).unwrap().diverged());
    let strict = CompareOptions {
        pair: PairKind::OpByOp,
        ..loose
    };
    let c = compare(&g, &t, &strict).unwrap();
    // The first matmul after the (exact) norm is where activation rounding first shows.
    assert_eq!(first(&c).0, TapKey::new(0, Some(0), Tap::Q));
}

/// A hint says an input "matched" only where the trace shows that input: a sparse trace (the
/// taps a scan keeps) has none inside a layer, so a bug there is described as the span of ops
/// between the last tap that matched and the first that differs, never as "a residual sum
/// differs while its operands matched" or "its input matched". Each tap a sparse or partial
/// trace may end a span at is tried, with a bug placed inside the span.
#[test]
fn a_hint_claims_only_inputs_the_trace_shows() {
    let spans: [(&str, Tap, &str); 4] = [
        ("^(l_out-.*|result_norm|logits)$", Tap::LOut, "ffn_inp"),
        (
            "^(attn_norm-.*|k_rope-.*|q_rope-.*|l_out-.*|result_norm|logits)$",
            Tap::QRope,
            "q",
        ),
        (
            "^(embd|ffn_out-.*|l_out-.*|logits)$",
            Tap::FfnOut,
            "ffn_act",
        ),
        ("^(embd|l_out-.*|result_norm|logits)$", Tap::LOut, "ffn_out"),
    ];
    for (keep, tap, input) in spans {
        let mut m = open("tiny-llama-f32.gguf");
        match tap {
            // A wrong rope theta acts inside the q/k projections' span.
            Tap::QRope => m.config.rope_theta *= 2.0,
            _ => m.config.rms_eps *= 1000.0,
        }
        let c = run_against_golden_keeping(
            &m,
            "tiny-llama-f32",
            PairKind::SameRounding,
            TapFilter::regex(keep).unwrap(),
        );
        let (k, why) = first(&c);
        assert_eq!((k.step, k.layer, k.tap), (0, Some(0), tap), "{keep}: {why}");
        for claim in [
            "operands matched",
            "input matched",
            "with matching input",
            "q/k match",
        ] {
            assert!(!why.contains(claim), "{keep}: claims '{claim}': {why}");
        }
        assert!(
            why.contains("the trace has none of its inputs") && why.contains(input),
            "{keep}: {why}"
        );
    }
    // With its inputs in the trace, the hint reads them as before.
    let mut m = open("tiny-llama-f32.gguf");
    m.config.rms_eps *= 10.0;
    let c = run_against_golden(&m, "tiny-llama-f32", PairKind::SameRounding);
    let (_, why) = first(&c);
    assert!(!why.contains("none of its inputs"), "{why}");
}
