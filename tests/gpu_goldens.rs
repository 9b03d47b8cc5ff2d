//! Goldens made by the real llama.cpp on its Vulkan backend (golden-gpu/, written by
//! scripts/gpu_goldens.sh: llama-cpp-python built with GGML_VULKAN, Mesa's lavapipe as the
//! device, every layer offloaded, every tap read back from the device, at the CPU goldens' ids).
//! parity must judge them as what they are, a correct llama.cpp: `diff` against the CPU golden
//! passes op by op at the tight matmul floor with the engine's rounding named (the tiled prefill
//! summing in f16 as lavapipe runs it, plain f32 decode steps), and `check` against them passes
//! every backend. Before the judge modelled Vulkan's summation order, each of them was called
//! diverged at step 0 layer 0 q.

use crate::common;
use common::*;
use std::path::{Path, PathBuf};

/// The tight matmul floor (`judge::floor::MM_ABS`): an exact fit is held to it.
const TIGHT: f64 = 1e-10;

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

/// One GPU golden: its own CPU golden (golden/NAME, else golden-gpu/NAME-cpu) and its model.
fn case(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let gpu = root().join("golden-gpu").join(name);
    let cpu = match root().join("golden").join(name) {
        p if p.is_dir() => p,
        _ => root().join("golden-gpu").join(format!("{name}-cpu")),
    };
    let m = manifest(&gpu);
    let model = root().join(m["model"]["path"].as_str().unwrap());
    (gpu, cpu, model)
}

/// The GPU golden's provenance is what the script recorded: llama.cpp's Vulkan backend, every
/// layer offloaded, on lavapipe; the same ids as its CPU golden.
fn assert_provenance(name: &str, gpu: &Path, cpu: &Path) {
    let g = manifest(gpu);
    let c = manifest(cpu);
    assert_eq!(g["producer"]["backend"], "llama.cpp-vulkan", "{name}");
    assert_eq!(g["producer"]["settings"]["n_gpu_layers"], 999, "{name}");
    let devices = g["producer"]["settings"]["devices"].as_array().unwrap();
    assert!(
        devices
            .iter()
            .any(|d| d["name"] == "Vulkan0"
                && d["description"].as_str().unwrap().contains("llvmpipe")),
        "{name}: {devices:?}"
    );
    assert_eq!(c["producer"]["backend"], "llama.cpp-cpu", "{name}");
    let ids = |m: &serde_json::Value| -> Vec<serde_json::Value> {
        m["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["tokens"].clone())
            .collect()
    };
    assert_eq!(
        ids(&g),
        ids(&c),
        "{name}: the GPU golden runs the CPU golden's ids"
    );
}

/// `parity diff CPU GPU`: exit 0, every key judged at its own floor, the prefill's rounding named
/// as the f16-accumulating tiled matmul and the decode steps' as plain f32, nothing confirmed.
fn assert_diff_passes(name: &str, cpu: &Path, gpu: &Path, prefill: &[&str]) {
    let o = parity(&[
        "diff",
        cpu.to_str().unwrap(),
        gpu.to_str().unwrap(),
        "--json",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(0), "{name}: {}", show(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let own = j["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["pair"] == "own-inputs")
        .unwrap_or_else(|| panic!("{name}: no own-inputs comparison: {j}"));
    let fam = own["rounding_family"].as_str().unwrap();
    assert!(prefill.contains(&fam), "{name}: prefill family {fam}");
    let text = String::from_utf8_lossy(&o.stderr).into_owned() + &stdout(&o);
    assert!(
        text.contains(&format!("prefill: {fam}, decode: plain-f32")),
        "{name}: {text}"
    );
    // An exact fit: the tight floor, no limit stated.
    assert!(
        text.contains(&format!("matmul floor {TIGHT:e}")),
        "{name}: {text}"
    );
    assert!(own.get("limits").is_none(), "{name}: {own}");
    assert!(!text.contains("confirmed by experiment"), "{name}: {text}");
}

/// `parity check MODEL --golden GPU`: exit 0; parity's backends are not fed the golden op by
/// op (a GPU golden is not the CPU's arithmetic) but compared with it end to end, and the
/// golden's own ops are judged on its own inputs (one own-inputs comparison, first).
fn assert_check_passes(name: &str, model: &Path, gpu: &Path) {
    let o = parity(&[
        "check",
        model.to_str().unwrap(),
        "--golden",
        gpu.to_str().unwrap(),
        "--backends",
        "reference,reference:ggml-cpu,fast",
        "--json",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(0), "{name}: {}", show(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let vs: Vec<_> = j["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["baseline"] == "llama.cpp/llama.cpp-vulkan")
        .collect();
    assert_eq!(vs.len(), 3, "{name}: {j}");
    assert!(
        vs.iter().all(|c| c["pair"] == "different-rounding"),
        "{name}"
    );
    let own = &j["comparisons"][0];
    assert_eq!(own["pair"], "own-inputs", "{name}: {own}");
    assert_eq!(own["candidate"], "llama.cpp/llama.cpp-vulkan", "{name}");
    assert!(own["first_divergence"].is_null(), "{name}: {own}");
}

/// Quantized weights (pairs of k summed last first), F16 weights (fours), F32 weights (the f32
/// accumulator on f16 inputs: either f16-acc row reproduces it), a GELU model (Vulkan computes
/// GELU in f32), a K-quant.
#[test]
fn vulkan_goldens_of_the_fixtures_pass_diff_and_check() {
    for (name, prefill) in [
        ("tiny-llama-q4_0", &["f16-acc-unfused"][..]),
        ("tiny-llama-f16", &["f16-acc-unfused"][..]),
        ("tiny-llama-f32", &["f16-acc", "f16-acc-unfused"][..]),
        ("tiny-gemma2-q8_0", &["f16-acc-unfused"][..]),
        ("tiny-qwen2-q4_k", &["f16-acc-unfused"][..]),
    ] {
        let (gpu, cpu, model) = case(name);
        assert_provenance(name, &gpu, &cpu);
        assert_diff_passes(name, &cpu, &gpu, prefill);
        assert_check_passes(name, &model, &gpu);
    }
}

/// The real TinyStories-656K-Q4_0 with a 44-token prompt (Vulkan tiles prompts over 8 tokens),
/// against a CPU golden at the same ids.
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models)")]
fn vulkan_golden_of_a_long_prompt_on_a_real_model_passes() {
    let name = "TinyStories-656K-Q4_0-p44";
    let (gpu, cpu, model) = case(name);
    assert_provenance(name, &gpu, &cpu);
    assert_eq!(
        manifest(&gpu)["steps"][0]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        44
    );
    assert_diff_passes(name, &cpu, &gpu, &["f16-acc-unfused"]);
    assert_check_passes(name, &model, &gpu);
}

/// The pass is the family's doing, not a blind spot: judged under llama.cpp CPU's rounding
/// (`--rounding ggml-cpu`), nothing reproduces the trace's matmuls, the floor widens to follow
/// their own error, and the verdict says so.
#[test]
fn a_vulkan_golden_judged_under_the_cpus_rounding_states_its_widened_floor() {
    let (gpu, cpu, _) = case("tiny-llama-q4_0");
    let o = parity(&[
        "diff",
        cpu.to_str().unwrap(),
        gpu.to_str().unwrap(),
        "--rounding",
        "ggml-cpu",
        "--json",
        "-",
    ]);
    let text = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!text.contains("matmul floor 1e-10"), "{text}");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let limits = j["comparisons"][0]["limits"].to_string();
    assert!(
        limits.contains("no known activation rounding reproduces"),
        "{limits}"
    );
}

/// `parity golden --gpu-layers` with a llama.cpp that has no GPU device: exit 2, one line that
/// says so and how to build one.
#[test]
#[cfg_attr(not(parity_llama_cpp), ignore = "needs llama-cpp-python (.venv)")]
fn golden_on_a_gpu_needs_a_build_with_one() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("g");
    let o = parity(&[
        "golden",
        "fixtures/tiny-llama-q4_0.gguf",
        "-p",
        "Once upon a time",
        "--steps",
        "1",
        "--gpu-layers",
        "-1",
        "--out",
        out.to_str().unwrap(),
    ]);
    let has_gpu = String::from_utf8_lossy(&o.stderr).contains("wrote");
    if has_gpu {
        // A llama-cpp-python with a GPU backend: the golden says which.
        assert_eq!(o.status.code(), Some(0), "{}", show(&o));
        assert_ne!(manifest(&out)["producer"]["backend"], "llama.cpp-cpu");
        return;
    }
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--gpu-layers: this llama.cpp build has no GPU device")
            && err.contains("GGML_VULKAN"),
        "{err}"
    );
    assert!(!out.exists(), "nothing is published");
}

/// Bugs planted into the real llama.cpp on Vulkan: it ran a copy of the Q4_0 fixture whose
/// metadata says rms eps ×10 (or RoPE base 500000), and its trace is judged against the real
/// model. Under the GPU's rounding each is found at step 0 layer 0 and named by experiment, from
/// the full dump; from its sparse cut too, where eps ×10 moves layer 0's l_out less than its
/// span floor (2e-5, the GPU's f16 sums) and is first seen, and named, at result_norm (a single
/// op) with the span limit stated and where it acts from (layer 0's l_out, the replays with and
/// without it differ there), and the RoPE base is placed at layer 0's l_out.
#[test]
fn bugs_planted_into_llama_cpp_on_vulkan_are_found_and_named() {
    let cpu = root().join("golden/tiny-llama-q4_0");
    let model = root().join("fixtures/tiny-llama-q4_0.gguf");
    let tmp = tempfile::tempdir().unwrap();
    for (bug, full_at, sparse_at, named) in [
        (
            "rms-eps-10x",
            (0, Some(0), "attn_norm"),
            (0, None, "result_norm"),
            "confirmed by experiment: rms-eps-10x reproduces",
        ),
        (
            "rope-theta-500000",
            (0, Some(0), "q_rope"),
            (0, Some(0), "l_out"),
            "confirmed by experiment: rope-theta=500000 reproduces",
        ),
    ] {
        let full = root().join("golden-gpu/planted").join(bug);
        assert_eq!(manifest(&full)["producer"]["backend"], "llama.cpp-vulkan");
        let sparse = tmp.path().join(bug);
        sparse_copy(&full, &sparse);
        for (trace, (step, layer, tap)) in [(&full, full_at), (&sparse, sparse_at)] {
            let what = format!("{bug} {}", trace.display());
            let o = parity(&[
                "diff",
                cpu.to_str().unwrap(),
                trace.to_str().unwrap(),
                "--model",
                model.to_str().unwrap(),
                "--allow-model-mismatch",
                "--json",
                "-",
            ]);
            assert_eq!(o.status.code(), Some(1), "{what}: {}", show(&o));
            let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            let own = &j["comparisons"][0];
            assert_eq!(own["pair"], "own-inputs", "{what}");
            assert_eq!(own["rounding_family"], "f16-acc-unfused", "{what}");
            let at = &own["first_divergence"]["at"]["key"];
            assert_eq!(
                (
                    at["step"].as_u64(),
                    at["layer"].as_u64(),
                    at["tap"].as_str()
                ),
                (Some(step), layer, Some(tap)),
                "{what}: {at}"
            );
            let diagnosis = own["first_divergence"]["diagnosis"].as_str().unwrap();
            assert!(diagnosis.contains(named), "{what}: {diagnosis}");
            // Seen later than it acts: the text says where it acts from.
            if tap == "result_norm" {
                assert!(
                    diagnosis.contains("it acts from step 0 layer 0 l_out on"),
                    "{what}: {diagnosis}"
                );
            } else {
                assert!(!diagnosis.contains("it acts from"), "{what}: {diagnosis}");
            }
            let spans = own["limits"].to_string().contains("judged as spans");
            assert_eq!(spans, trace == &sparse, "{what}: {}", own["limits"]);
        }
    }
}

/// A GPU golden that carries a bug fails `check`: the same planted goldens, recorded as made
/// from the real model (as llama.cpp's own `--override-kv` on the real file records it: the
/// tensors are those of the planted copy, the sha256 the model's). Each is found by judging
/// the golden's own ops, placed at step 0 layer 0 and named, although every backend's
/// end-to-end comparison with the golden may stay within the tolerances between roundings.
#[test]
fn check_fails_a_gpu_golden_that_carries_a_bug() {
    let model = root().join("fixtures/tiny-llama-q4_0.gguf");
    let sha = parity::model::sha256_hex(&std::fs::read(&model).unwrap());
    let tmp = tempfile::tempdir().unwrap();
    for (bug, tap, named) in [
        ("rms-eps-10x", "attn_norm", "rms-eps-10x reproduces"),
        (
            "rope-theta-500000",
            "q_rope",
            "rope-theta=500000 reproduces",
        ),
    ] {
        let g = tmp.path().join(bug);
        copy_dir(&root().join("golden-gpu/planted").join(bug), &g);
        let mut m = manifest(&g);
        m["model"]["sha256"] = serde_json::Value::String(sha.clone());
        std::fs::write(g.join("manifest.json"), m.to_string()).unwrap();
        let o = parity(&[
            "check",
            model.to_str().unwrap(),
            "--golden",
            g.to_str().unwrap(),
            "--backends",
            "reference,fast",
            "--json",
            "-",
        ]);
        assert_eq!(o.status.code(), Some(1), "{bug}: {}", show(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let own = &j["comparisons"][0];
        assert_eq!(own["pair"], "own-inputs", "{bug}: {own}");
        let at = &own["first_divergence"]["at"]["key"];
        assert_eq!(
            (
                at["step"].as_u64(),
                at["layer"].as_u64(),
                at["tap"].as_str()
            ),
            (Some(0), Some(0), Some(tap)),
            "{bug}: {at}"
        );
        let diagnosis = own["first_divergence"]["diagnosis"].as_str().unwrap();
        assert!(diagnosis.contains(named), "{bug}: {diagnosis}");
    }
}
