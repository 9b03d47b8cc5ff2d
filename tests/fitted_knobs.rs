//! Wrong values no catalog lists, fitted by experiment (#28): an out-of-process engine
//! (scripts/numpy_engine.py) that hard-codes its own rms eps, RoPE base or attention scale is
//! found at step 0 layer 0 and named with the value it uses — from full dumps (at the op) and
//! sparse ones (at layer 0's l_out span), under plain f32, ggml's and Q8_K activation
//! rounding, on the committed Q4_0 fixture and the shared models. Near the model's value a
//! span of 8-bit activations is not monotone in eps (requantization flips), which is where eps
//! 1e-3 once went missed (exit 0) in sparse dumps of the TinyStories models. The same engines
//! without the wrong value pass, nothing confirmed. gemma2's soft-caps are fitted too, from an
//! engine that reads them from a rewritten copy of the fixture.

use crate::common;
use common::*;
use std::path::{Path, PathBuf};

/// The numpy engine's trace of `golden`'s ids, one `.npz`.
fn engine(
    py: &Path,
    model: &Path,
    golden: &Path,
    rounding: &str,
    taps: &str,
    set: &[&str],
) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("t.npz");
    let o = std::process::Command::new(py)
        .arg(root().join("scripts/numpy_engine.py"))
        .arg(model)
        .arg("--golden")
        .arg(golden)
        .args(["--rounding", rounding, "--taps", taps])
        .args(set)
        .arg("--out")
        .arg(&out)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    (tmp, out)
}

/// `parity diff GOLDEN TRACE --model MODEL --json -`: the exit code and the own-inputs
/// comparison.
fn judged(model: &Path, golden: &Path, trace: &Path) -> (Option<i32>, serde_json::Value) {
    let o = parity(&[
        "diff",
        golden.to_str().unwrap(),
        trace.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--json",
        "-",
    ]);
    let j: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&o)));
    let own = own_inputs(&j).clone();
    (o.status.code(), own)
}

/// Every model with a committed golden that the numpy engine runs: the Q4_0 fixture, and the
/// shared TinyStories Q8_0 / Q4_0 and stories260K when ../shared is there.
fn models() -> Vec<(PathBuf, PathBuf)> {
    let mut v = vec![(
        root().join("fixtures/tiny-llama-q4_0.gguf"),
        root().join("golden/tiny-llama-q4_0"),
    )];
    if let Some(dir) = shared("models") {
        for name in [
            "TinyStories-656K-Q8_0",
            "TinyStories-656K-Q4_0",
            "stories260K",
        ] {
            v.push((
                dir.join(format!("{name}.gguf")),
                root().join("golden").join(name),
            ));
        }
    }
    v
}

#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py for the numpy engine (.ci/run installs them; then touch build.rs)"
)]
fn a_wrong_rms_eps_is_fitted_in_full_and_sparse_dumps_under_every_rounding() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    for (model, golden) in models() {
        for rounding in ["none", "ggml", "q8k"] {
            for taps in ["all", "sparse"] {
                let what = format!("{} {rounding} {taps}", model.display());
                // The clean engine: nothing found, nothing confirmed.
                let (_t, clean) = engine(&py, &model, &golden, rounding, taps, &[]);
                let (code, own) = judged(&model, &golden, &clean);
                assert_eq!(code, Some(0), "{what} clean: {own:#}");
                assert!(own["first_divergence"].is_null(), "{what} clean: {own:#}");
                // eps 1e-3, whatever the model says.
                let (_t, bad) =
                    engine(&py, &model, &golden, rounding, taps, &["--rms-eps", "1e-3"]);
                let (code, own) = judged(&model, &golden, &bad);
                assert_eq!(code, Some(1), "{what} eps 1e-3: {own:#}");
                let tap = if taps == "all" { "attn_norm" } else { "l_out" };
                assert_at_layer0_named(&own, tap, "rms-eps=1e-3 reproduces your ", &what);
                let why = own["first_divergence"]["diagnosis"].as_str().unwrap();
                assert!(
                    why.contains("the engine's RMSNorm adds eps 1e-3"),
                    "{what}: {why}"
                );
            }
        }
    }
}

/// The RoPE base and the attention scale, on the fixture: fitted and named with their value.
#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py for the numpy engine (.ci/run installs them; then touch build.rs)"
)]
fn a_wrong_rope_base_or_attention_scale_is_fitted() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let model = root().join("fixtures/tiny-llama-q4_0.gguf");
    let golden = root().join("golden/tiny-llama-q4_0");
    // head_dim 64: 1/head_dim = 1.5625e-2.
    let cases: [(&[&str], &str, &str, &str); 3] = [
        (
            &["--rope-theta", "20000"],
            "q_rope",
            "rope-theta=20000",
            "frequency base is 20000",
        ),
        (
            &["--attn-scale", "0.015625"],
            "kq_soft_max",
            "attn-scale=1.5625e-2",
            "= 1/head_dim (64 where 1/sqrt(64) is meant)",
        ),
        (
            &["--attn-scale", "1"],
            "kq_soft_max",
            "attn-scale=1",
            "(no scaling at all)",
        ),
    ];
    for (set, tap, name, words) in cases {
        for rounding in ["none", "ggml"] {
            fitted_at_layer0(&py, &model, &golden, rounding, set, tap, name, words);
        }
    }
}

/// The numpy engine with `set` under `rounding`, full and sparse: exit 1, placed at step 0
/// layer 0 (`tap` in a full dump, l_out's span in a sparse one) and named `name` with `words`.
#[allow(clippy::too_many_arguments)]
fn fitted_at_layer0(
    py: &Path,
    model: &Path,
    golden: &Path,
    rounding: &str,
    set: &[&str],
    tap: &str,
    name: &str,
    words: &str,
) {
    for taps in ["all", "sparse"] {
        let what = format!("{set:?} {rounding} {taps}");
        let (_t, bad) = engine(py, model, golden, rounding, taps, set);
        let (code, own) = judged(model, golden, &bad);
        assert_eq!(code, Some(1), "{what}: {own:#}");
        let at = if taps == "all" { tap } else { "l_out" };
        assert_at_layer0_named(&own, at, &format!("{name} reproduces your "), &what);
        let why = own["first_divergence"]["diagnosis"].as_str().unwrap();
        assert!(why.contains(words), "{what}: {why}");
    }
}

/// A RoPE base between the walk's half-decade points (10000's neighbours there are 3160 and
/// 31600, and 12000 is no 1-2-5 value) is solved from the trace's own rotation where a full
/// dump has q or k on both sides of RoPE: the angle pair 1 turns by at positions 1..3 gives
/// the base, replayed to confirm. Before, 12000 was placed at q_rope and left unnamed ("no
/// hypothesis reproduces it"), RoPE's error not being monotone in the base.
#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py for the numpy engine (.ci/run installs them; then touch build.rs)"
)]
fn a_rope_base_between_round_values_is_solved_from_the_rotation() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let model = root().join("fixtures/tiny-llama-q4_0.gguf");
    let golden = root().join("golden/tiny-llama-q4_0");
    for theta in ["12000", "7300", "13750"] {
        for rounding in ["none", "ggml"] {
            let what = format!("theta {theta} {rounding}");
            let (_t, bad) = engine(
                &py,
                &model,
                &golden,
                rounding,
                "all",
                &["--rope-theta", theta],
            );
            let (code, own) = judged(&model, &golden, &bad);
            assert_eq!(code, Some(1), "{what}: {own:#}");
            let d = &own["first_divergence"];
            assert_eq!(
                d["at"]["key"],
                serde_json::json!({"step": 0, "layer": 0, "tap": "q_rope"}),
                "{what}: {d:#}"
            );
            let why = d["diagnosis"].as_str().unwrap();
            assert!(
                why.contains(&format!(
                    "confirmed by experiment: rope-theta={theta} reproduces your "
                )) && why.contains(&format!("frequency base is {theta}")),
                "{what}: {why}"
            );
        }
    }
}

/// Values no walk point lands on (#28 item 3): an attention scale within one step of the
/// model's (0.1 and 0.15 for 0.125: the walk's first steps, 0.0625 and 0.25, are each further
/// off than the model's own value, and before, the fit stopped there, "no hypothesis
/// reproduces it"), a RoPE base off the half-decade points in a sparse dump (where no q/k pair
/// gives it in closed form), an eps off the 1-2-5 values: found by a golden-section search
/// between the walk's points and named with the value the engine writes, from full and sparse
/// dumps under plain f32, ggml's and Q8_K activation rounding. Eps 3e-6 too: under ggml's 8-bit
/// activations a sparse span cannot tell it from 5e-6 (both reproduce it exactly, and the walk
/// meets 5e-6 first: "adds eps 5e-6" before), and the same step's final norm, judged on its
/// own, pins it (`AtKey::eps_at_final_norm`).
#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py for the numpy engine (.ci/run installs them; then touch build.rs)"
)]
fn a_value_off_the_walk_s_points_is_fitted_by_a_finer_search() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let model = root().join("fixtures/tiny-llama-q4_0.gguf");
    let golden = root().join("golden/tiny-llama-q4_0");
    // (the engine's setting, its op in a full dump, the fitted name, the words, the roundings)
    type Case<'a> = (&'a [&'a str], &'a str, &'a str, &'a str, &'a [&'a str]);
    let cases: [Case; 4] = [
        (
            &["--attn-scale", "0.1"],
            "kq_soft_max",
            "attn-scale=1e-1",
            "scales attention scores by 1e-1",
            &["none", "ggml", "q8k"],
        ),
        (
            &["--attn-scale", "0.15"],
            "kq_soft_max",
            "attn-scale=1.5e-1",
            "scales attention scores by 1.5e-1",
            &["none", "ggml", "q8k"],
        ),
        (
            &["--rope-theta", "15000"],
            "q_rope",
            "rope-theta=15000",
            "frequency base is 15000",
            &["none", "ggml", "q8k"],
        ),
        (
            &["--rms-eps", "3e-6"],
            "attn_norm",
            "rms-eps=3e-6",
            "adds eps 3e-6;",
            &["none", "ggml", "q8k"],
        ),
    ];
    for (set, tap, name, words, roundings) in cases {
        for &rounding in roundings {
            fitted_at_layer0(&py, &model, &golden, rounding, set, tap, name, words);
        }
    }
    // The final norm that pins a sparse span's eps says so by saying nothing more; an engine
    // whose final norm keeps the model's eps leaves the span's value unconfirmed there, and
    // the verdict says the value is the span's reading (before: "adds eps 5e-6" for 3e-6,
    // stated as the engine's).
    let caveat = "the value is read from a span of rounded activations";
    for (set, pinned) in [
        (&["--rms-eps", "3e-6"][..], true),
        (
            &["--rms-eps", "3e-6", "--output-norm-eps", "1e-5"][..],
            false,
        ),
    ] {
        for rounding in ["ggml", "q8k"] {
            let what = format!("{set:?} {rounding} sparse");
            let (_t, bad) = engine(&py, &model, &golden, rounding, "sparse", set);
            let (code, own) = judged(&model, &golden, &bad);
            assert_eq!(code, Some(1), "{what}: {own:#}");
            assert_at_layer0_named(&own, "l_out", "rms-eps=", &what);
            let why = own["first_divergence"]["diagnosis"].as_str().unwrap();
            assert_eq!(why.contains(caveat), !pinned, "{what}: {why}");
            if pinned {
                assert!(why.contains("adds eps 3e-6;"), "{what}: {why}");
            }
        }
    }
}

/// A knob whose effect the engine's own rounding and K/V cache hide from the measurement
/// (#28): a sparse dump's layers and cache are measured with the bug in the data, and where
/// the bug moves each span more than the roundings and caches differ, the first tried stands
/// (ggml-cpu, an f32 cache). Under it the right value leaves the cache's noise: rms eps 1e-3
/// under Q8_K layers and an f16 cache cut layer 0's own error 2.2×, short of the 100× a
/// finding under the floors needs (missed, exit 0); attention scale 0.2 under a Q8_0 cache
/// 28×, short of `KNOB_CUT` (placed, unnamed). The closest hypotheses are screened under each
/// other rounding and cache, against that setup's own clean replay, and the trace judged
/// again under the one that explains it. On 52555f2's code none of the ten was named (eight
/// missed, exit 0; two unnamed, one of them placed at step 3); the clean engines pass. The
/// next four were missed (exit 0) on a76c357: where no cache reproduces the attention (the
/// best fit 1.2e-5, a clean trace's 0) and nothing cuts 2×, each cache is tried with every
/// knob fitted again under it (`judge::under_other_caches`); the last two on 7342566, where
/// the layers' rounding was hidden too (under the measured one's tie twin, each cache); the
/// last on 2021312, where another cache fit within 2x of the one kept; the two after it were
/// flagged but unnamed on 2d00d31 (the flagged key diagnosed again under each other cache); the
/// last three named with a value 0.2-3% off on a84966a (the knob fitted again under each cache).
#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py for the numpy engine (.ci/run installs them; then touch build.rs)"
)]
fn a_knob_hidden_by_the_engine_s_cache_is_fitted_under_it() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let Some(dir) = shared("models") else {
        return;
    };
    let model = dir.join("TinyStories-656K-Q8_0.gguf");
    let golden = root().join("golden/TinyStories-656K-Q8_0");
    // (the engine's rounding and cache, its wrong value, the fitted name)
    let cases: [(&str, &str, [&str; 2], &str); 22] = [
        ("q8k", "f16", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        ("ggml", "f16", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        ("none", "f16", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        ("f16", "f16", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        ("q8_1", "q4_0", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        ("q8k", "f16", ["--rope-theta", "20000"], "rope-theta=20000"),
        ("ggml", "f16", ["--rope-theta", "20000"], "rope-theta=20000"),
        (
            "bf16",
            "q8_0",
            ["--rope-theta", "20000"],
            "rope-theta=20000",
        ),
        ("q8k", "q8_0", ["--rope-theta", "20000"], "rope-theta=20000"),
        ("q8k", "q8_0", ["--attn-scale", "0.2"], "attn-scale=2e-1"),
        // No cache reproduces the attention, and under the one measured no hypothesis cuts
        // even 2×: every hypothesis tried again under each other cache, knobs fitted there.
        ("bf16", "q8_0", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        ("ggml", "f16", ["--rope-theta", "12000"], "rope-theta=12000"),
        ("q8k", "q8_0", ["--rope-theta", "8000"], "rope-theta=8000"),
        // The layers' rounding hidden (ggml-cpu measured, ggml's reference quantizers used):
        // judged again under the screen's rounding, which its tie twin no longer replaces.
        ("q8_1", "f32", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        // Both hidden: each cache tried under the measured rounding's tie twin too.
        ("ggml-scalar", "f16", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        ("q8_1", "q8_0", ["--rms-eps", "1e-3"], "rms-eps=1e-3"),
        // The cache measured as f32 (2.0e-8) where the engine's f16 fits nearly as well
        // (3.1e-8: the first type stays unless another is 2x closer), and under f32 the eps
        // cuts 1.6x: a choice that close is unsure, each cache tried (missed on 2021312).
        ("none", "f16", ["--rms-eps", "1e-4"], "rms-eps=1e-4"),
        // Flagged (out of its floor at step 1) but unnamed under the f32 cache kept: no RoPE
        // base beats the own error there; the diagnosis under each other cache names it
        // (placed at step 1, unnamed, on 2d00d31).
        ("none", "q8_0", ["--rope-theta", "8000"], "rope-theta=8000"),
        (
            "none",
            "q8_0",
            ["--rope-theta", "15000"],
            "rope-theta=15000",
        ),
        // Named, but with a value a little off under the f32 cache kept where the engine's
        // f16 fit the attention nearly as well (8025, 15030, 15447 on a84966a): the knob is
        // fitted again under each other cache, and one that reproduces the key 100x closer is
        // judged again under.
        ("none", "f16", ["--rope-theta", "8000"], "rope-theta=8000"),
        ("none", "f16", ["--rope-theta", "15000"], "rope-theta=15000"),
        ("f16", "f16", ["--rope-theta", "15000"], "rope-theta=15000"),
    ];
    let mut clean_done: Vec<(&str, &str)> = Vec::new();
    for (rounding, kv, set, name) in cases {
        if !clean_done.contains(&(rounding, kv)) {
            clean_done.push((rounding, kv));
            let (_t, clean) = engine(&py, &model, &golden, rounding, "sparse", &["--kv", kv]);
            let (code, own) = judged(&model, &golden, &clean);
            assert_eq!(code, Some(0), "{rounding} {kv} clean: {own:#}");
            assert!(
                own["first_divergence"].is_null(),
                "{rounding} {kv} clean: {own:#}"
            );
        }
        let what = format!("{rounding} {kv} {set:?} sparse");
        let args = ["--kv", kv, set[0], set[1]];
        let (_t, bad) = engine(&py, &model, &golden, rounding, "sparse", &args);
        let (code, own) = judged(&model, &golden, &bad);
        assert_eq!(code, Some(1), "{what}: {own:#}");
        assert_at_layer0_named(&own, "l_out", &format!("{name} reproduces your "), &what);
    }
}

/// A long prompt's sparse dump where ties hide the bug (TinyStories-656K-Q8_0, 398 prompt
/// tokens, rms eps 1e-3), two ways, each missed (exit 0) on 6598207:
/// - ggml's reference quantizers (ties half away from zero), f32 cache: the layers' rounding
///   measured as its tie twin ggml-cpu at the logits, where both fit to 0. The screen under
///   the floors found the eps under ggml-scalar, but the judgement again under it kept the
///   output projection at ggml-cpu, where ties put the logits out of their floor, unnamed, and
///   the first judgement stood (named from 60, 120 and 200 tokens; missed from 300). The output
///   projection's rounding, measured with the layers', now follows them to their tie twin
///   (`rounding::layers_as`).
/// - f16-accumulated layers (their unfused twin alike) with a plain Q8_0 cache quantized by
///   `rint(x * (1 / (max/127)))`: the K/V projections' outputs sit on the f16 grid, where an
///   element at half a step is common, and ggml's quantizer (`127 / max`) breaks such ties
///   otherwise: the clean engine's own error at layer 0 stayed 3.3e-7 under the Q8_0 cache,
///   so the eps cut 51x, under the 100x a finding needs. A plain Q8_0 cache's quantizer now
///   has tie twins (`KvCache::tie_twins`: ggml's reference, and 1/(max/127) to even), tried
///   where the rounding's are (the clean engine: 4.3e-8, nothing cut).
///
/// The clean engines still pass, nothing confirmed (and three more, below, that a rounding
/// twin once failed).
#[test]
#[cfg_attr(
    not(all(parity_gguf_py, parity_llama_cpp)),
    ignore = "needs numpy, gguf-py and llama-cpp-python (.ci/run installs them; then touch build.rs)"
)]
fn a_knob_hidden_by_a_tie_twin_in_a_long_prompt_is_fitted() {
    let Some(LongStory {
        py,
        model,
        golden,
        tmp: _tmp,
    }) = long_story()
    else {
        return;
    };
    // Clean engines where softmax-no-max, short of an overflow the right numbers to f32
    // rounding, flipped the same quanta as the engine and "reproduced" layer 1's l_out bit for
    // bit (confirmed, exit 1): it is tried only on a trace that holds a NaN or an Inf.
    for (rounding, kv) in [("ggml", "f16"), ("q8k", "f16"), ("q8_1", "q8_0")] {
        let what = format!("{rounding} {kv} clean");
        let (_t, clean) = engine(&py, &model, &golden, rounding, "sparse", &["--kv", kv]);
        let (code, own) = judged(&model, &golden, &clean);
        assert_eq!(code, Some(0), "{what}: {own:#}");
        assert!(own["first_divergence"].is_null(), "{what}: {own:#}");
    }
    for (rounding, kv) in [("ggml-scalar", "f32"), ("f16-acc", "q8_0")] {
        let what = format!("{rounding} {kv}");
        let (_t, clean) = engine(&py, &model, &golden, rounding, "sparse", &["--kv", kv]);
        let (code, own) = judged(&model, &golden, &clean);
        assert_eq!(code, Some(0), "{what} clean: {own:#}");
        assert!(own["first_divergence"].is_null(), "{what} clean: {own:#}");
        let set = ["--kv", kv, "--rms-eps", "1e-3"];
        let (_t, bad) = engine(&py, &model, &golden, rounding, "sparse", &set);
        let (code, own) = judged(&model, &golden, &bad);
        assert_eq!(code, Some(1), "{what} rms eps 1e-3: {own:#}");
        let name = "rms-eps=1e-3 reproduces your ";
        assert_at_layer0_named(&own, "l_out", name, &format!("{what} rms eps 1e-3"));
    }
    // A plain f32 engine that sums in f32, with a Q8_0 cache: its summation noise flips a K
    // quantum here and there, and eps x10 flipped one the same way at layer 1 (own 2.4e-12,
    // cut 110x): confirmed, exit 1, until an own error had to stand 10x above what the
    // engine's own sums may flip there (its matmul outputs nudged by 1e-7, the square root of
    // their median own NMSE 9.3e-15: clean replays 2.4e-12 apart). A real eps 1e-3 (and a
    // small one, 1e-5: eps x10) in the same engine stands 1e5x and more above it: named.
    let f32_sums = ["--kv", "q8_0", "--f32-sums"];
    let (_t, clean) = engine(&py, &model, &golden, "none", "sparse", &f32_sums);
    let (code, own) = judged(&model, &golden, &clean);
    assert_eq!(code, Some(0), "f32 sums, q8_0 cache: {own:#}");
    assert!(
        own["first_divergence"].is_null(),
        "f32 sums, q8_0 cache: {own:#}"
    );
    for (eps, name) in [("1e-3", "rms-eps=1e-3"), ("1e-5", "rms-eps-10x")] {
        let set = [&f32_sums[..], &["--rms-eps", eps]].concat();
        let (_t, bad) = engine(&py, &model, &golden, "none", "sparse", &set);
        let (code, own) = judged(&model, &golden, &bad);
        let what = format!("f32 sums, q8_0 cache, rms eps {eps}");
        assert_eq!(code, Some(1), "{what}: {own:#}");
        assert_at_layer0_named(&own, "l_out", &format!("{name} reproduces your "), &what);
    }
}

/// At depth a knob is held in every layer it acts on. A 16-layer Q4_0 model (generated, a
/// fresh llama.cpp golden) and the numpy engine summing in f32 with Q8_K inputs and an f16
/// cache, sparse: its own sums flip a Q8_K quantum now and then, and eps 2e-5 (the model says
/// 1e-5) flipped layer 13's back (own 3.6e-7, reproduced to 3.0e-14): confirmed, exit 1 —
/// while it moves layer 0's l_out by 6.9e-5, where this engine matches to 4e-14. Before the
/// flagged layer a knob was not held against the trace (a bug may act from a deep layer
/// on; a knob is the model's setting for every layer). Now clean, nothing confirmed; an engine
/// that does use eps 2e-5 is named with it (the round values beside the model's are tried in
/// a span, whose own error is not monotone in eps), and eps x10 by the catalog.
#[test]
#[cfg_attr(
    not(all(parity_gguf_py, parity_llama_cpp)),
    ignore = "needs numpy, gguf-py and llama-cpp-python (.ci/run installs them; then touch build.rs)"
)]
fn at_depth_a_knob_is_held_in_every_layer() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, golden) = deep_model(tmp.path(), "q4_0", 16, 1, 16);
    let base = ["--kv", "f16", "--f32-sums"];
    let (_t, clean) = engine(&py, &model, &golden, "q8k", "sparse", &base);
    let (code, own) = judged(&model, &golden, &clean);
    assert_eq!(code, Some(0), "clean: {own:#}");
    assert!(own["first_divergence"].is_null(), "clean: {own:#}");
    for (eps, name) in [("2e-5", "rms-eps=2e-5"), ("1e-4", "rms-eps-10x")] {
        let set = [&base[..], &["--rms-eps", eps]].concat();
        let (_t, bad) = engine(&py, &model, &golden, "q8k", "sparse", &set);
        let (code, own) = judged(&model, &golden, &bad);
        let what = format!("rms eps {eps}");
        assert_eq!(code, Some(1), "{what}: {own:#}");
        assert_at_layer0_named(&own, "l_out", &format!("{name} reproduces your "), &what);
    }
}

/// A generated llama model of `n_layer` layers (256 wide, 4/2 heads) and a fresh llama.cpp
/// golden of `n_ids` of the prompt ids below, 4 decode steps.
fn deep_model(dir: &Path, ty: &str, n_layer: usize, seed: u64, n_ids: usize) -> (PathBuf, PathBuf) {
    let (n, s) = (n_layer.to_string(), seed.to_string());
    let shape = [
        "--n-embd",
        "256",
        "--n-ff",
        "512",
        "--n-layer",
        &n,
        "--n-head",
        "4",
        "--n-head-kv",
        "2",
        "--n-ctx",
        "256",
    ];
    let ids = [
        1, 15, 27, 300, 42, 77, 8, 91, 120, 5, 66, 200, 33, 19, 250, 7, 9, 31, 44, 101,
    ];
    generated(
        dir,
        &format!("d{n_layer}-{ty}"),
        ty,
        &shape,
        &s,
        &ids[..n_ids],
    )
}

/// `parity fixture --type ty --seed seed` of `shape` as `dir/name.gguf`, and a fresh llama.cpp
/// golden of `ids`, 4 decode steps.
fn generated(
    dir: &Path,
    name: &str,
    ty: &str,
    shape: &[&str],
    seed: &str,
    ids: &[u32],
) -> (PathBuf, PathBuf) {
    let model = dir.join(format!("{name}.gguf"));
    let golden = dir.join(format!("golden-{name}"));
    let args = [&["fixture", "--type", ty][..], shape, &["--seed", seed]].concat();
    let o = parity(&[&args[..], &["--out", model.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", show(&o));
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let o = parity(&[
        "golden",
        model.to_str().unwrap(),
        "--tokens",
        &ids.join(","),
        "--steps",
        "4",
        "--out",
        golden.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", show(&o));
    (model, golden)
}

/// A 32-layer 512-wide Q8_0 model (8/8 heads, 4000 ids: the 7B's depth at CI width) and a
/// fresh golden of 16 ids.
fn w32_model(dir: &Path, seed: u64) -> (PathBuf, PathBuf) {
    let shape = [
        "--n-embd",
        "512",
        "--n-ff",
        "1408",
        "--n-layer",
        "32",
        "--n-head",
        "8",
        "--n-head-kv",
        "8",
        "--n-vocab",
        "4000",
        "--n-ctx",
        "512",
    ];
    let ids = [
        1, 450, 496, 1735, 170, 432, 1720, 975, 278, 1736, 1120, 2988, 1576, 338, 263, 1243,
    ];
    let name = format!("w32-s{seed}");
    generated(dir, &name, "q8_0", &shape, &seed.to_string(), &ids)
}

/// An 8-bit quantum flips under a nudge only now and then; three nudge patterns can all miss
/// what an engine's own sums flipped. On the 32-layer 512-wide Q8_0 model (seed 1), a clean
/// numpy engine with ggml's rounding and an f32 cache, sparse, had one decode row at step 4
/// layer 2 1.06e-5 over its 1e-5 floor: exit 1. A span within 10x of its floor is now replayed
/// under more patterns until one flips as much. And (seed 2) Q8_K inputs with eps x10, f32
/// cache, sparse: eps x10 was contradicted at step 2 layer 6 by a quantum its replay flipped
/// and the engine did not (4.2e-6 where the clean replay was 1.2e-9): the matmuls reproduce
/// bit for bit, the spans do not, and the hypothesis was held against un-nudged replays.
#[test]
#[cfg_attr(
    not(all(parity_gguf_py, parity_llama_cpp)),
    ignore = "needs numpy, gguf-py and llama-cpp-python (.ci/run installs them; then touch build.rs)"
)]
fn at_depth_rare_flips_are_sampled_until_found() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, golden) = w32_model(tmp.path(), 1);
    let (_t, clean) = engine(&py, &model, &golden, "ggml", "sparse", &["--kv", "f32"]);
    let (code, own) = judged(&model, &golden, &clean);
    assert_eq!(code, Some(0), "ggml f32 clean: {own:#}");
    assert!(own["first_divergence"].is_null(), "ggml f32 clean: {own:#}");
    let (model, golden) = w32_model(tmp.path(), 2);
    let set = ["--kv", "f32", "--mutate", "rms-eps-10x"];
    let (_t, bad) = engine(&py, &model, &golden, "q8k", "sparse", &set);
    let (code, own) = judged(&model, &golden, &bad);
    assert_eq!(code, Some(1), "q8k eps x10: {own:#}");
    assert_at_layer0_named(&own, "l_out", "rms-eps-10x reproduces your ", "q8k eps x10");
}

/// A real bug is not contradicted by a flip. The numpy engine with eps x10, summing in f32
/// with 8-bit (ggml's Q8_0) activations, on a generated 32-layer Q8_0 model, sparse: at step 3
/// layer 13 the eps barely moves anything and the engine matches the reference to 4.6e-15;
/// the replay with eps x10 flips one quantum there (5.7e-7), and eps x10 was "not elsewhere
/// in the trace" — unnamed. A key counts against a hypothesis only where it stands well above
/// what the engine's own sums may flip there (its hypothesis replay nudged as they differ).
/// With Q8_K inputs and an f16 cache the flip was attn_norm's (2.2e-6 at step 2 layer 23,
/// 8.6e-12 clean), upstream of every matmul: nudging the matmul outputs never reproduced it,
/// and eps x10 stayed unnamed until every tensor of the window was nudged.
#[test]
#[cfg_attr(
    not(all(parity_gguf_py, parity_llama_cpp)),
    ignore = "needs numpy, gguf-py and llama-cpp-python (.ci/run installs them; then touch build.rs)"
)]
fn at_depth_a_real_bug_is_not_contradicted_by_a_flip() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, golden) = deep_model(tmp.path(), "q8_0", 32, 9, 20);
    let base = ["--kv", "f32", "--f32-sums"];
    let (_t, clean) = engine(&py, &model, &golden, "ggml", "sparse", &base);
    let (code, own) = judged(&model, &golden, &clean);
    assert_eq!(code, Some(0), "clean: {own:#}");
    assert!(own["first_divergence"].is_null(), "clean: {own:#}");
    let set = [&base[..], &["--mutate", "rms-eps-10x"]].concat();
    let (_t, bad) = engine(&py, &model, &golden, "ggml", "sparse", &set);
    let (code, own) = judged(&model, &golden, &bad);
    assert_eq!(code, Some(1), "eps x10: {own:#}");
    assert_at_layer0_named(&own, "l_out", "rms-eps-10x reproduces your ", "eps x10");
    let q8k = ["--kv", "f16", "--f32-sums"];
    let (_t, clean) = engine(&py, &model, &golden, "q8k", "sparse", &q8k);
    let (code, own) = judged(&model, &golden, &clean);
    assert_eq!(code, Some(0), "q8k f16 clean: {own:#}");
    assert!(own["first_divergence"].is_null(), "q8k f16 clean: {own:#}");
    let set = [&q8k[..], &["--mutate", "rms-eps-10x"]].concat();
    let (_t, bad) = engine(&py, &model, &golden, "q8k", "sparse", &set);
    let (code, own) = judged(&model, &golden, &bad);
    assert_eq!(code, Some(1), "q8k f16 eps x10: {own:#}");
    let what = "q8k f16 eps x10";
    assert_at_layer0_named(&own, "l_out", "rms-eps-10x reproduces your ", what);
}

/// A RoPE base near the model's, in a sparse dump of 8-bit (or f16, bf16) layers: the span's
/// own error has a basin about a fifth of the base wide around the engine's value (12000:
/// 0 there, 9.4e-6 at 11000, 4.1e-6 at 13000) and is flat a half-decade away, where the walk's
/// points are, so no point cut anything and the fit gave up: missed, exit 0, on a76c357 for
/// 8000, 12000 and 15000 under every rounding but plain f32 (TinyStories-656K-Q8_0, f32
/// cache). Now a golden-section search from the model's value finds the basin; the clean
/// engines still pass.
#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py for the numpy engine (.ci/run installs them; then touch build.rs)"
)]
fn a_rope_base_in_a_narrow_basin_is_fitted_from_a_sparse_dump() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let Some(dir) = shared("models") else {
        return;
    };
    let model = dir.join("TinyStories-656K-Q8_0.gguf");
    let golden = root().join("golden/TinyStories-656K-Q8_0");
    for rounding in ["ggml", "q8k", "f16", "bf16"] {
        let (_t, clean) = engine(&py, &model, &golden, rounding, "sparse", &[]);
        let (code, own) = judged(&model, &golden, &clean);
        assert_eq!(code, Some(0), "{rounding} clean: {own:#}");
        for theta in ["8000", "12000", "15000"] {
            let what = format!("{rounding} theta {theta} sparse");
            let (_t, bad) = engine(
                &py,
                &model,
                &golden,
                rounding,
                "sparse",
                &["--rope-theta", theta],
            );
            let (code, own) = judged(&model, &golden, &bad);
            assert_eq!(code, Some(1), "{what}: {own:#}");
            assert_at_layer0_named(
                &own,
                "l_out",
                &format!("rope-theta={theta} reproduces your "),
                &what,
            );
        }
    }
}

/// gemma2's soft-caps, fitted (#28 item 3): an engine that caps the attention scores or the
/// logits at another value (the two caps swapped, or a cap of its own) is found at the op
/// (`kq_soft_max`, `logits`) and named with the value it uses; in a sparse dump the attention
/// cap is placed at layer 0's l_out span and fitted there. The engine: parity's reference run
/// on a copy of the fixture whose metadata gguf-py rewrote (the engine's hard-coded value),
/// judged against the fixture's golden and the fixture itself.
#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs gguf-py to rewrite the model's metadata (.ci/run installs it; then touch build.rs)"
)]
fn a_wrong_softcap_is_fitted() {
    let model = root().join("fixtures/tiny-gemma2-q8_0.gguf");
    let golden = root().join("golden/tiny-gemma2-q8_0");
    let (prompt, forced) = golden_ids(&golden);
    // The fixture caps attention at 1.5 and the logits at 5.
    let cases = [
        (
            "attn_logit_softcapping",
            "5",
            "kq_soft_max",
            Some(0),
            "attn-softcap=5",
            "soft-caps the attention scores at 5 (the other soft-cap's value: the two are swapped); the model says 1.5",
        ),
        (
            "final_logit_softcapping",
            "1.5",
            "logits",
            None,
            "final-softcap=1.5",
            "soft-caps the logits at 1.5 (the other soft-cap's value: the two are swapped); the model says 5",
        ),
        (
            "final_logit_softcapping",
            "8",
            "logits",
            None,
            "final-softcap=8",
            "soft-caps the logits at 8; the model says 5",
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (key, value, tap, layer, name, words) in cases {
        let wrong = tmp.path().join(format!("{key}-{value}.gguf"));
        std::fs::copy(&model, &wrong).unwrap();
        let o = std::process::Command::new(python())
            .args([
                "-c",
                "import sys; from gguf.scripts.gguf_set_metadata import main; sys.argv[0] = 'gguf-set-metadata'; sys.exit(main())",
                "--force",
            ])
            .arg(&wrong)
            .args([format!("gemma2.{key}"), value.to_string()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", show(&o));
        let full = tmp.path().join(format!("{key}-{value}"));
        let o = parity(&[
            "dump",
            wrong.to_str().unwrap(),
            "--tokens",
            &prompt,
            "--forced",
            &forced,
            "--emulate",
            "ggml-cpu",
            "--out",
            full.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", show(&o));
        let sparse = tmp.path().join(format!("{key}-{value}-sparse"));
        sparse_copy(&full, &sparse);
        for (trace, at_tap, at_layer) in [
            (&full, tap, layer),
            (&sparse, if layer.is_some() { "l_out" } else { tap }, layer),
        ] {
            let what = format!("{key}={value} {}", trace.display());
            let o = parity(&[
                "diff",
                golden.to_str().unwrap(),
                trace.to_str().unwrap(),
                "--model",
                model.to_str().unwrap(),
                "--allow-model-mismatch",
                "--json",
                "-",
            ]);
            assert_eq!(o.status.code(), Some(1), "{what}: {}", show(&o));
            let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            let d = &own_inputs(&j)["first_divergence"];
            assert_eq!(
                d["at"]["key"],
                serde_json::json!({"step": 0, "layer": at_layer, "tap": at_tap}),
                "{what}: {d:#}"
            );
            let why = d["diagnosis"].as_str().unwrap();
            assert!(
                why.contains(&format!("confirmed by experiment: {name} reproduces your "))
                    && why.contains(words),
                "{what}: {why}"
            );
        }
    }
}

/// The prompt and the forced decode ids of `golden` (`--tokens`, `--forced`).
fn golden_ids(golden: &Path) -> (String, String) {
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden.join("manifest.json")).unwrap())
            .unwrap();
    let steps = manifest["steps"].as_array().unwrap();
    let ids = |s: &serde_json::Value| -> Vec<String> {
        s["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect()
    };
    let forced: Vec<String> = steps[1..].iter().flat_map(ids).collect();
    (ids(&steps[0]).join(","), forced.join(","))
}

/// RoPE's linear scaling, fitted (#28 item 3): an engine that ignores the model's
/// `rope.scaling.factor`, divides where it should multiply, or scales a model that has no
/// scaling is found at layer 0's `q_rope` (its `l_out` span in a sparse dump) and named with
/// the scale it uses. The engines: parity's reference on a fixture of the same weights whose
/// metadata says another factor; the goldens: the real llama.cpp, which applies the factor
/// (a clean engine on the scaled model passes against it).
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python for the goldens (.ci/run installs it; then touch build.rs)"
)]
fn a_wrong_rope_scaling_is_fitted() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = |scale: Option<&str>| -> PathBuf {
        let out = tmp
            .path()
            .join(format!("scale-{}.gguf", scale.unwrap_or("none")));
        let mut args = vec!["fixture", "--out", out.to_str().unwrap()];
        if let Some(s) = scale {
            args.extend(["--rope-scale", s]);
        }
        let o = parity(&args);
        assert!(o.status.success(), "{}", show(&o));
        out
    };
    let (none, four, quarter) = (model(None), model(Some("4")), model(Some("0.25")));
    let golden = |m: &Path| -> PathBuf {
        let g = m.with_extension("golden");
        let o = parity(&[
            "golden",
            m.to_str().unwrap(),
            "-p",
            "Once upon a time there was a little girl",
            "--steps",
            "2",
            "--out",
            g.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", show(&o));
        g
    };
    let (g_none, g_four) = (golden(&none), golden(&four));
    // (the model, its golden, the engine's model, the fitted name, the words)
    let cases = [
        (&four, &g_four, &four, None, ""),
        (
            &four,
            &g_four,
            &none,
            Some("rope-freq-scale=1"),
            "the engine's RoPE scales positions by 1 (no scaling: the engine ignores rope.scaling); the model scales them by 0.25 (linear scaling, rope.scaling.factor 4)",
        ),
        (
            &four,
            &g_four,
            &quarter,
            Some("rope-freq-scale=4"),
            "scales positions by 4 (the factor itself, where its inverse is meant)",
        ),
        (
            &none,
            &g_none,
            &four,
            Some("rope-freq-scale=0.25"),
            "scales positions by 0.25; the model has no RoPE scaling",
        ),
    ];
    for (i, (m, g, engine, name, words)) in cases.into_iter().enumerate() {
        let (prompt, forced) = golden_ids(g);
        let full = tmp.path().join(format!("engine-{i}"));
        let o = parity(&[
            "dump",
            engine.to_str().unwrap(),
            "--tokens",
            &prompt,
            "--forced",
            &forced,
            "--emulate",
            "ggml-cpu",
            "--out",
            full.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", show(&o));
        let sparse = tmp.path().join(format!("engine-{i}-sparse"));
        sparse_copy(&full, &sparse);
        for (trace, at_tap) in [(&full, "q_rope"), (&sparse, "l_out")] {
            let what = format!(
                "{} as {}: {}",
                engine.display(),
                m.display(),
                trace.display()
            );
            let o = parity(&[
                "diff",
                g.to_str().unwrap(),
                trace.to_str().unwrap(),
                "--model",
                m.to_str().unwrap(),
                "--allow-model-mismatch",
                "--json",
                "-",
            ]);
            let j: serde_json::Value = serde_json::from_slice(&o.stdout)
                .unwrap_or_else(|e| panic!("{what}: {e}: {}", show(&o)));
            let d = &own_inputs(&j)["first_divergence"];
            let Some(name) = name else {
                assert_eq!(o.status.code(), Some(0), "{what}: {}", show(&o));
                assert!(d.is_null(), "{what}: {d:#}");
                continue;
            };
            assert_eq!(o.status.code(), Some(1), "{what}: {}", show(&o));
            assert_eq!(
                d["at"]["key"],
                serde_json::json!({"step": 0, "layer": 0, "tap": at_tap}),
                "{what}: {d:#}"
            );
            let why = d["diagnosis"].as_str().unwrap();
            assert!(
                why.contains(&format!("confirmed by experiment: {name} reproduces your "))
                    && why.contains(words),
                "{what}: {why}"
            );
        }
    }
}

/// An engine whose final norm alone adds another eps (its layers' norms right), a constant
/// passed in the wrong place: placed at step 0's `result_norm` and named with the value, from
/// full and sparse dumps under plain f32, ggml's and Q8_K activation rounding. Before, it was
/// "no hypothesis reproduces it" with a text heuristic (no knob set the final norm's eps
/// alone; eps everywhere is contradicted at layer 0), and eps 10 lay beyond the walk's 1 —
/// while on TinyStories-656K, whose last layer's mean square is ~400, eps 1e-5 and 1e-6 give
/// the same f32 output there, so the walk's first steps changed nothing and it stopped.
#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py for the numpy engine (.ci/run installs them; then touch build.rs)"
)]
fn the_final_norm_s_own_eps_is_fitted() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    for (model, golden) in models() {
        for (eps, rounding) in [("10", "none"), ("1e-2", "ggml"), ("5e-1", "q8k")] {
            for taps in ["all", "sparse"] {
                let what = format!("{} {eps} {rounding} {taps}", model.display());
                let set = ["--output-norm-eps", eps];
                let (_t, bad) = engine(&py, &model, &golden, rounding, taps, &set);
                let (code, own) = judged(&model, &golden, &bad);
                assert_eq!(code, Some(1), "{what}: {own:#}");
                let d = &own["first_divergence"];
                assert_eq!(
                    d["at"]["key"],
                    serde_json::json!({"step": 0, "layer": null, "tap": "result_norm"}),
                    "{what}: {d:#}"
                );
                let why = d["diagnosis"].as_str().unwrap_or_default();
                let named = format!("confirmed by experiment: output-norm-eps={eps} reproduces");
                assert!(why.contains(&named), "{what}: {why}");
                let words = format!("final RMSNorm (output_norm) adds eps {eps}");
                assert!(why.contains(&words), "{what}: {why}");
            }
        }
    }
}

/// An attention scale a few percent off the model's, in a long sparse dump of 8-bit layers
/// with an f16 cache (398 ids, TinyStories-656K-Q8_0): 0.26 for 0.25 moves layer 0's span by
/// 1.9e-4, under the span floor (1e-3) such an engine's spans lift, and no point of the walk
/// (powers of 2) nor a round value beside the model's cut it; the run was flagged only by the
/// logits' end-to-end KLD, at no op (exit 1, unnamed). As for a RoPE base, the span's own
/// error has a basin around the engine's value: a golden-section search from the model's
/// value finds it (0 at 0.26). Named at layer 0 now, and 0.24 the same.
#[test]
#[cfg_attr(
    not(all(parity_gguf_py, parity_llama_cpp)),
    ignore = "needs numpy, gguf-py and llama-cpp-python (.ci/run installs them; then touch build.rs)"
)]
fn an_attention_scale_near_the_model_s_is_fitted_in_a_long_sparse_dump() {
    let Some(LongStory {
        py,
        model,
        golden,
        tmp: _tmp,
    }) = long_story()
    else {
        return;
    };
    for (scale, named) in [("0.26", "attn-scale=2.6e-1"), ("0.24", "attn-scale=2.4e-1")] {
        let what = format!("ggml f16 cache, attention scale {scale}");
        let set = ["--kv", "f16", "--attn-scale", scale];
        let (_t, bad) = engine(&py, &model, &golden, "ggml", "sparse", &set);
        let (code, own) = judged(&model, &golden, &bad);
        assert_eq!(code, Some(1), "{what}: {own:#}");
        assert_at_layer0_named(&own, "l_out", &format!("{named} reproduces your "), &what);
    }
}

/// A knob fitted under the rounding's tie twins. Engines whose 8-bit inputs break ties as
/// ggml's scalar `roundf` does (ggml's reference quantizer, a GPU's Q8_1) are measured as
/// ggml-cpu: the same grid, the other tie rule. With attention scale 0.22 (the model says
/// 0.25), sparse, on TinyStories-656K-Q8_0: the first span out of its floor is a decode step's,
/// where the fitted scale left 3e-5 of a 1.4e-3 own error (46×, not reproduced), and the run
/// was unnamed. The fit runs again under the tie twins where a value cut tenfold but left
/// more than f32's last bits: 0 under the engine's own tie rule, named at layer 0.
#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py for the numpy engine (.ci/run installs them; then touch build.rs)"
)]
fn a_knob_is_fitted_under_the_rounding_s_tie_twins() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let Some(dir) = shared("models") else {
        return;
    };
    let model = dir.join("TinyStories-656K-Q8_0.gguf");
    let golden = root().join("golden/TinyStories-656K-Q8_0");
    for rounding in ["ggml-scalar", "q8_1"] {
        let (_t, clean) = engine(&py, &model, &golden, rounding, "sparse", &[]);
        let (code, own) = judged(&model, &golden, &clean);
        assert_eq!(code, Some(0), "{rounding} clean: {own:#}");
        let what = format!("{rounding}, attention scale 0.22");
        let set = ["--attn-scale", "0.22"];
        let (_t, bad) = engine(&py, &model, &golden, rounding, "sparse", &set);
        let (code, own) = judged(&model, &golden, &bad);
        assert_eq!(code, Some(1), "{what}: {own:#}");
        assert_at_layer0_named(&own, "l_out", "attn-scale=2.2e-1 reproduces your ", &what);
    }
}
