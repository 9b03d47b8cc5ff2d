//! The gpu backend on a real Vulkan driver (lavapipe in CI): every kernel against the
//! reference op on random inputs, `check` on every fixture and shared model (op by op
//! included), a 16-layer model end to end, and deliberately broken kernels found by `diff`
//! at their tap. Without an adapter these show as ignored with the reason; the no-adapter
//! path itself is tested everywhere.

use crate::common;

use common::{gpu_env, in_child_with, parity_env, parity_env_without, root, shared, show, stdout};
use parity::arch::{Attn, Ops, Rope};
use parity::backend::gpu::Gpu;
use parity::backend::{Emulation, Reference};
use parity::model::{Activation, Model};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::path::{Path, PathBuf};

fn nmse(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    if den == 0.0 { num } else { num / den }
}

fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    // xorshift: deterministic, no dependency.
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The op-by-op floor: each kernel's f32 arithmetic against the reference's f64 sums.
const FLOOR: f64 = 1e-10;

fn close(what: &str, model: &Path, r: &[f32], g: &[f32]) -> Result<(), TestCaseError> {
    let e = nmse(r, g);
    prop_assert!(
        e <= FLOOR && g.iter().all(|v| v.is_finite()),
        "{}: {what}: NMSE {e:e}",
        model.display()
    );
    Ok(())
}

/// Every op of one layer of `model` on random inputs: T tokens from position pos0 (the
/// cache holds random keys/values before), against the reference's op.
fn ops_agree(
    model: &Model,
    path: &Path,
    g: &mut Gpu,
    t: usize,
    pos0: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let c = &model.config;
    let mut r = Reference::new(model, Emulation::None, 64);
    let w = &model.layers[0];
    let (e, hd, nh, nkv) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv);
    // Shared borrow: two-phase borrows let `g.op(up(g, ..))` through.
    let up = |g: &Gpu, v: &[f32]| g.from_host(v);
    let x = random(t * e, seed, 2.0);

    let tokens: Vec<u32> = (0..t as u32)
        .map(|i| (i * 7 + seed as u32) % c.n_vocab as u32)
        .collect();
    let (re, ge) = (
        r.embed(&model.token_embd, &tokens),
        g.embed(&model.token_embd, &tokens),
    );
    close("embed", path, &re, &g.to_host(&ge))?;
    let gs = g.scale(up(g, &x), 1.7);
    close("scale", path, &r.scale(x.clone(), 1.7), &g.to_host(&gs))?;
    let gn = g.rms_norm(&up(g, &x), &w.attn_norm, c.rms_eps);
    close(
        "rms_norm",
        path,
        &r.rms_norm(&x, &w.attn_norm, c.rms_eps),
        &g.to_host(&gn),
    )?;
    let gm = g.matmul(&w.wq, &up(g, &x));
    let rq = r.matmul(&w.wq, &x);
    close("matmul", path, &rq, &g.to_host(&gm))?;
    let ff = random(t * c.n_ff, seed + 1, 1.0);
    let gd = g.matmul(&w.w_down, &up(g, &ff));
    close(
        "matmul (ffn_down)",
        path,
        &r.matmul(&w.w_down, &ff),
        &g.to_host(&gd),
    )?;
    if let Some(b) = &w.bq {
        let gb = g.add_bias(up(g, &rq), b);
        close(
            "add_bias",
            path,
            &r.add_bias(rq.clone(), b),
            &g.to_host(&gb),
        )?;
    }
    let q = random(t * nh * hd, seed + 2, 1.0);
    if let Some(n) = &w.q_norm {
        let gh = g.head_norm(up(g, &q), n, c.rms_eps);
        close(
            "head_norm",
            path,
            &r.head_norm(q.clone(), n, c.rms_eps),
            &g.to_host(&gh),
        )?;
    }
    let rope = Rope::for_layer(c, 0, w.rope_factors(64, c));
    let gr = g.rope(up(g, &q), 0, pos0 + 3, nh, &rope);
    close(
        "rope",
        path,
        &r.rope(q.clone(), 0, pos0 + 3, nh, &rope),
        &g.to_host(&gr),
    )?;

    // Attention over a cache holding pos0 earlier positions, then this step's T.
    let n_kv = pos0 + t;
    let (k, v) = (
        random(n_kv * nkv * hd, seed + 3, 1.0),
        random(n_kv * nkv * hd, seed + 4, 1.0),
    );
    r.kv_store(0, 0, &k, &v);
    let (gk, gv) = (up(g, &k), up(g, &v));
    g.kv_store(0, 0, &gk, &gv);
    for layer in [0, c.n_layer - 1] {
        let mut a = Attn::for_layer(c, layer, pos0, t);
        if layer != 0 {
            r.kv_store(layer, 0, &k, &v);
            g.kv_store(layer, 0, &gk, &gv);
        }
        a.kq_scale = c.kq_scale;
        let rp = r.attn_probs(layer, &q, &a);
        let gp = g.attn_probs(layer, &up(g, &q), &a);
        close("attn_probs", path, &rp, &g.to_host(&gp))?;
        let rv = r.attn_values(layer, &rp, &a);
        let gv2 = g.attn_values(layer, &up(g, &rp), &a);
        close("attn_values", path, &rv, &g.to_host(&gv2))?;
    }
    let gate = random(t * c.n_ff, seed + 5, 4.0);
    for act in [Activation::Silu, Activation::GeluTanh] {
        let gg = g.glu(up(g, &gate), &up(g, &ff), act);
        close("glu", path, &r.glu(gate.clone(), &ff, act), &g.to_host(&gg))?;
    }
    let y = random(t * e, seed + 6, 3.0);
    let gadd = g.add(up(g, &x), &up(g, &y));
    close("add", path, &r.add(x.clone(), &y), &g.to_host(&gadd))?;
    let big = random(t * e, seed + 7, 80.0);
    let gc = g.softcap(up(g, &big), 30.0);
    close(
        "softcap",
        path,
        &r.softcap(big.clone(), 30.0),
        &g.to_host(&gc),
    )?;
    let gl = g.last_row(up(g, &x), e);
    close("last_row", path, &r.last_row(x.clone(), e), &g.to_host(&gl))?;
    Ok(())
}

fn fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("fixtures"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    v.sort();
    v
}

/// Every kernel against its reference op, on every architecture's fixture (their shapes:
/// rows of 64..., head sizes, GQA, windows, caps, biases, q/k norms, RoPE kinds and factors),
/// with T and the cache length drawn at random so that few sizes are multiples of a workgroup.
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn kernels_match_the_reference_ops_on_random_inputs() {
    if !in_child_with(
        module_path!(),
        "kernels_match_the_reference_ops_on_random_inputs",
        &gpu_env(),
    ) {
        return;
    }
    // Widths no workgroup divides: an F32 model (rows of 200 and 300, heads of 50, K not a
    // multiple of 8) and a Q4_0 qwen2 (rows of 288 and 416: whole blocks, no multiple of 256,
    // 18-byte blocks at odd byte offsets; biases; one KV head for four).
    let dir = tempfile::tempdir().unwrap();
    let mut models = fixtures();
    for (name, args) in [
        ("odd-f32.gguf", ["llama", "f32", "200", "300", "2"]),
        ("odd-q4_0.gguf", ["qwen2", "q4_0", "288", "416", "1"]),
    ] {
        let out = dir.path().join(name);
        let [arch, ty, e, ff, kv] = args;
        let o = run(&[
            "fixture",
            "--out",
            out.to_str().unwrap(),
            "--arch",
            arch,
            "--type",
            ty,
            "--n-embd",
            e,
            "--n-ff",
            ff,
            "--n-head",
            "4",
            "--n-head-kv",
            kv,
        ]);
        assert!(o.status.success(), "{}", show(&o));
        models.push(out);
    }
    for path in models {
        let model = Model::open(&path).unwrap();
        let g = std::cell::RefCell::new(Gpu::new(&model, 64).unwrap());
        let mut runner = TestRunner::new(Config {
            cases: 4,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&(1usize..12, 0usize..20, 0u64..1000), |(t, pos0, seed)| {
                ops_agree(&model, &path, &mut g.borrow_mut(), t, pos0, seed)
            })
            .unwrap();
    }
}

fn run(args: &[&str]) -> std::process::Output {
    parity_env(args, &gpu_env())
}

/// `check --backends reference,fast,gpu` passes on every committed fixture (every
/// architecture) and every shared model with a golden: end to end against the golden and the
/// other backends, and op by op (the gpu fed the golden's tensors, judged against the
/// reference fed them too, at the f32 floor).
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn check_passes_on_every_fixture_and_shared_model_op_by_op_included() {
    let mut models = fixtures();
    if let Some(dir) = shared("models") {
        let mut s: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        s.sort();
        models.extend(s);
    }
    for m in models {
        let o = run(&[
            "check",
            m.to_str().unwrap(),
            "--backends",
            "reference,fast,gpu",
            "--json",
            "-",
        ]);
        if String::from_utf8_lossy(&o.stderr).contains("no golden") {
            eprintln!("{}: no golden, skipped", m.display());
            continue;
        }
        assert_eq!(o.status.code(), Some(0), "{}: {}", m.display(), show(&o));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let labels: Vec<String> = r["comparisons"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| format!("{} vs {}", c["candidate"], c["baseline"]))
            .collect();
        assert!(
            labels
                .iter()
                .any(|l| l.contains("gpu/op-by-op") && l.contains("reference/op-by-op")),
            "{}: no gpu op-by-op comparison in {labels:?}",
            m.display()
        );
        assert!(
            labels
                .iter()
                .any(|l| l.contains("parity/gpu\"") && l.contains("llama.cpp")),
            "{}: no gpu vs golden in {labels:?}",
            m.display()
        );
    }
}

/// The whole gpu backend against the reference on a generated 16-layer model with
/// llama-quantize's Q4_K_M mix (Q4_K, Q6_K for the output and some attn_v/ffn_down: every
/// type of a Q4_K_M file, decoded in the shader). No golden: the backends against each other,
/// all fed the reference's greedy continuation.
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn gpu_matches_the_reference_on_a_16_layer_model() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("deep.gguf");
    let o = run(&[
        "fixture",
        "--out",
        m.to_str().unwrap(),
        "--arch",
        "llama",
        "--type",
        "q4_k_m",
        "--n-layer",
        "16",
        "--seed",
        "7",
    ]);
    assert!(o.status.success(), "{}", show(&o));
    let o = run(&[
        "check",
        m.to_str().unwrap(),
        "--backends",
        "reference,gpu",
        "--tokens",
        "1,17,42,99,5,300,7",
        "--steps",
        "3",
        "--golden",
        dir.path().to_str().unwrap(),
        "--json",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let c = &r["comparisons"][0];
    assert_eq!(c["candidate"], "parity/gpu", "{c}");
    // Every layer's every tap compared: 16 layers × 16 taps + embd, result_norm, logits, × 4 steps.
    let results = c["results"].as_array().unwrap();
    assert!(results.len() >= 4 * (16 * 16 + 3), "{c}");
    // Both sides keep f32 activations: every tap of every step within the f32 floor `check`
    // applies op by op (docs/tolerances.md: end to end the gpu stays at or below 1.4e-12).
    for t in results {
        let e = t["metrics"]["nmse"].as_f64().unwrap();
        assert!(e <= 1e-10, "{}: NMSE {e:e}", t["key"]);
    }
}

/// A broken kernel written as an engine's trace by `parity dump --backend gpu` is found by
/// `parity diff` against the golden at its (step, layer, tap), with a cause; the clean
/// kernels' dump passes. Runs with uninitialised device memory poisoned.
#[test]
#[cfg_attr(
    not(all(parity_gpu, feature = "gpu-test-bugs")),
    ignore = "needs a GPU adapter (Debian: mesa-vulkan-drivers) and the broken kernels: cargo test --features gpu-test-bugs (.ci/run does)"
)]
fn broken_kernels_are_found_at_their_tap_by_diff() {
    let golden = root().join("golden/tiny-llama-f32");
    let dir = tempfile::tempdir().unwrap();
    // (bug, where diff must find it: step, layer, tap)
    type Want = Option<(usize, usize, &'static str)>;
    let cases: [(&str, Want); 4] = [
        ("", None),
        ("matmul-transposed@1", Some((0, 1, "q"))),
        ("rope-pairs@1", Some((0, 1, "q_rope"))),
        ("reduction-tail@1", Some((0, 1, "attn_norm"))),
    ];
    for (bug, want) in cases {
        let out = dir.path().join(if bug.is_empty() { "clean" } else { bug });
        let mut env = gpu_env();
        env.push(("PARITY_GPU_TEST_BUG", bug));
        let o = parity_env(
            &[
                "dump",
                "fixtures/tiny-llama-f32.gguf",
                "--backend",
                "gpu",
                "--golden",
                golden.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
            &env,
        );
        assert!(o.status.success(), "{bug}: {}", show(&o));
        let o = run(&[
            "diff",
            golden.to_str().unwrap(),
            out.to_str().unwrap(),
            "--json",
            "-",
        ]);
        let r: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|_| panic!("{bug}: {}", show(&o)));
        let c = &r["comparisons"][0];
        match want {
            None => assert_eq!(o.status.code(), Some(0), "clean: {}", show(&o)),
            Some((step, layer, tap)) => {
                assert_eq!(o.status.code(), Some(1), "{bug}: {}", show(&o));
                let at = &c["first_divergence"]["at"]["key"];
                assert_eq!(
                    (
                        at["step"].as_u64(),
                        at["layer"].as_u64(),
                        at["tap"].as_str()
                    ),
                    (Some(step as u64), Some(layer as u64), Some(tap)),
                    "{bug}: {c}"
                );
                let why = c["first_divergence"]["diagnosis"].as_str().unwrap_or("");
                assert!(!why.is_empty(), "{bug}: no cause named: {c}");
                eprintln!("{bug}: found at step {step} layer {layer} {tap}: {why}");
            }
        }
    }
}

/// No adapter (an empty driver list): `parity gpu` says so in one line (exit 2), and the
/// default `check` goes on with the other backends and says the GPU was not checked.
#[test]
fn without_an_adapter_gpu_is_one_line_and_check_goes_on() {
    let env = [
        ("VK_DRIVER_FILES", "/nonexistent/none.json"),
        ("VK_ICD_FILENAMES", "/nonexistent/none.json"),
        ("XDG_RUNTIME_DIR", "/tmp"),
    ];
    let o = parity_env(&["gpu"], &env);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0]
            .contains("no GPU adapter: install a Vulkan driver, e.g. Debian's mesa-vulkan-drivers"),
        "{err}"
    );
    let o = parity_env(&["check", "fixtures/tiny-llama-q8_0.gguf"], &env);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("gpu: not checked — no GPU adapter"),
        "{}",
        show(&o)
    );
    let o = parity_env(
        &[
            "check",
            "fixtures/tiny-llama-q8_0.gguf",
            "--backends",
            "reference,gpu",
        ],
        &env,
    );
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("no GPU adapter: install a Vulkan driver"),
        "{err}"
    );
}

/// `parity gpu` prints the adapter, driver, API, the limits the kernels use, the subgroup size
/// and f16; the test-only knob lowers the binding limit it reports.
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn gpu_command_prints_adapter_and_limits() {
    let o = run(&["gpu"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        "adapter: ",
        "driver: ",
        "api: ",
        "max storage binding ",
        "subgroup size: ",
        "f16: ",
    ] {
        assert!(out.contains(want), "no '{want}' in {out}");
    }
    let mut env = gpu_env();
    env.push(("PARITY_GPU_TEST_MAX_BINDING", "131072"));
    let o = parity_env(&["gpu", "--json"], &env);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["max_storage_binding_bytes"], 131072, "{v}");
}

/// With only a software adapter (lavapipe), the default `check` (no --backends) runs the CPU
/// backends alone and says in one line that it left the gpu out and how to include it;
/// naming the gpu runs it there, op by op included. The driver's own stderr lines (Mesa's
/// `error: XDG_RUNTIME_DIR is invalid…`, printed without XDG_RUNTIME_DIR) never reach
/// parity's stderr, and `parity gpu` shows them as the driver's.
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn default_check_leaves_a_software_gpu_out_and_says_how_to_include_it() {
    let m = "fixtures/tiny-qwen2-q4_k.gguf";
    // Without XDG_RUNTIME_DIR, as a CI job or a container has it: Mesa complains.
    let env: Vec<(&str, &str)> = gpu_env()
        .into_iter()
        .filter(|(k, _)| *k != "XDG_RUNTIME_DIR")
        .collect();
    let o = parity_env_without(&["check", m, "--json", "-"], &env, &["XDG_RUNTIME_DIR"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        !r["comparisons"].to_string().contains("parity/gpu"),
        "the default set ran the software gpu: {}",
        show(&o)
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("XDG_RUNTIME_DIR"),
        "driver chatter on stderr: {err}"
    );
    let o = parity_env_without(&["check", m], &env, &["XDG_RUNTIME_DIR"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let note: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("gpu: not checked"))
        .collect();
    assert_eq!(note.len(), 1, "{}", show(&o));
    assert!(
        note[0].contains("runs on the CPU")
            && note[0].contains("`--backends reference,reference:ggml-cpu,fast,gpu` includes it"),
        "{}",
        note[0]
    );
    let all = "reference,reference:ggml-cpu,fast,gpu";
    let o = parity_env_without(
        &["check", m, "--backends", all, "--json", "-"],
        &env,
        &["XDG_RUNTIME_DIR"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let text = r["comparisons"].to_string();
    assert!(text.contains("parity/gpu"), "no gpu comparison: {text}");
    assert!(
        text.contains("parity/gpu/op-by-op"),
        "no gpu op by op: {text}"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("XDG_RUNTIME_DIR"),
        "driver chatter on stderr: {err}"
    );
    // Mesa's device-select layer is what speaks (NODEVICE_SELECT=1 in the caller's
    // environment would silence it).
    let o = parity_env_without(&["gpu"], &env, &["XDG_RUNTIME_DIR", "NODEVICE_SELECT"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        !err.contains("XDG_RUNTIME_DIR"),
        "driver chatter on stderr: {err}"
    );
    assert!(
        out.contains("driver stderr: error: XDG_RUNTIME_DIR is invalid"),
        "the driver's lines are not shown as its: {out}"
    );
}

/// Weights larger than one binding are bound in windows of whole rows (the 128 KiB knob
/// splits the fixture's 136 KiB FFN weights, the K/V cache of 256 positions just fits;
/// `check` still passes, op by op included); a
/// tensor larger than one buffer is refused in one line naming it and the limit (exit 2).
/// (The default set leaving out a gpu it cannot build, with the reason, is
/// `check::tests::default_set_leaves_out_a_device_it_cannot_use`: lavapipe is left out before
/// it is built.)
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn tensors_larger_than_a_binding_are_split_or_refused_in_one_line() {
    let m = "fixtures/tiny-llama-q8_0.gguf";
    let mut env = gpu_env();
    env.push(("PARITY_GPU_TEST_MAX_BINDING", "131072"));
    let o = parity_env(
        &["check", m, "--backends", "reference,gpu", "--json", "-"],
        &env,
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        r["comparisons"].to_string().contains("parity/gpu"),
        "{}",
        show(&o)
    );

    let mut env = gpu_env();
    env.push(("PARITY_GPU_TEST_MAX_BUFFER", "100000"));
    let o = parity_env(&["check", m, "--backends", "gpu"], &env);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("tensor output.weight needs ")
            && lines[0].contains(" bytes as q8_0 on the GPU")
            && lines[0].contains("more than one buffer allows (100000 bytes"),
        "{err}"
    );
}

/// A weight type no shader decodes (Q3_K) is dequantized to f32 at load, multiplied by the
/// F32 kernel, and `check` names the tensors it dequantized.
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn other_weight_types_are_dequantized_at_load_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("q3k.gguf");
    let o = run(&["fixture", "--out", m.to_str().unwrap(), "--type", "q3_k"]);
    assert!(o.status.success(), "{}", show(&o));
    let o = run(&[
        "check",
        m.to_str().unwrap(),
        "--backends",
        "reference,gpu",
        "--golden",
        dir.path().to_str().unwrap(),
        "--tokens",
        "1,17,42,99,5",
        "--steps",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("gpu: dequantized to f32 at load: ") && out.contains("blk.1.ffn_down.weight"),
        "{}",
        show(&o)
    );
}

/// The shared-memory reductions (devices without subgroup ops; forced here) hold the same
/// floor: `check` passes op by op on a soft-capped gemma2 and a biased Q4_K qwen2.
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn shared_memory_reductions_pass_check() {
    let mut env = gpu_env();
    env.push(("PARITY_GPU_NO_SUBGROUPS", "1"));
    let o = parity_env(&["gpu"], &env);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("reductions: shared memory"),
        "{}",
        show(&o)
    );
    for m in ["tiny-gemma2-q8_0", "tiny-qwen2-q4_k"] {
        let f = format!("fixtures/{m}.gguf");
        let o = parity_env(
            &["check", &f, "--backends", "reference,gpu", "--json", "-"],
            &env,
        );
        assert_eq!(o.status.code(), Some(0), "{m}: {}", show(&o));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(
            r["comparisons"].to_string().contains("gpu/op-by-op"),
            "{m}: {}",
            show(&o)
        );
    }
}

/// `check` against a scan golden zooms by itself (issue 29): a broken kernel that the scan
/// (l_out, result_norm, logits at every step) shows only as a drift makes `check` run
/// llama.cpp again, on the same ids fed in the same calls (a chunked prompt and a second turn
/// here), with the first diverging step recorded whole, and compare every tap of it: the
/// broken tap is named where the scan had none. The zoom golden repeats the scan's tensors bit
/// for bit; --no-zoom turns it off; a clean check never zooms; a golden whose steps disagree
/// with its settings is not zoomed, and the report says how to make the zoom by hand.
#[test]
#[cfg_attr(
    not(all(parity_gpu, parity_llama_cpp, feature = "gpu-test-bugs")),
    ignore = "needs a GPU adapter (Debian: mesa-vulkan-drivers), llama-cpp-python (.venv) and the broken kernels: cargo test --features gpu-test-bugs (.ci/run does)"
)]
fn check_zooms_into_the_first_diverging_step_of_a_scan_golden() {
    let dir = tempfile::tempdir().unwrap();
    let model = "fixtures/tiny-llama-q8_0.gguf";
    let scan = dir.path().join("scan");
    let s = scan.to_str().unwrap();
    let o = run(&[
        "golden",
        model,
        "--tokens",
        "1,259,300,273,262,264,324",
        "--chunk",
        "3",
        "--turn",
        "325,329,333,336,340",
        "--steps",
        "3",
        "--record",
        "taps=l_out,result_norm,logits",
        "--out",
        s,
    ]);
    assert!(o.status.success(), "{}", show(&o));
    let check = |extra: &[&str], bug: &str| {
        let mut args = vec!["check", model, "--golden", s, "--backends", "reference,gpu"];
        args.extend_from_slice(extra);
        let mut env = gpu_env();
        env.push(("PARITY_GPU_TEST_BUG", bug));
        parity_env(&args, &env)
    };
    let o = check(&[], "");
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(!show(&o).contains("zoom:"), "{}", show(&o));

    let kept = dir.path().join("zoom");
    let o = check(
        &["--zoom-out", kept.to_str().unwrap(), "--json", "-"],
        "rope-pairs@1",
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let comparisons = r["comparisons"].as_array().unwrap();
    let zoomed = |c: &&serde_json::Value| c["baseline"].as_str().unwrap().contains("(zoom: step");
    let (zoom, scan_cs): (Vec<_>, Vec<_>) = comparisons.iter().partition(zoomed);
    assert!(!zoom.is_empty() && !scan_cs.is_empty(), "{r:#}");
    // The step zoomed into: the first at which the gpu left the golden in the scan.
    let first = |c: &serde_json::Value| c["first_divergence"]["at"]["key"]["step"].as_u64();
    let gpu_vs_golden = scan_cs
        .iter()
        .find(|c| c["candidate"] == "parity/gpu" && c["baseline"] == "llama.cpp/llama.cpp-cpu")
        .unwrap();
    let step = first(gpu_vs_golden).expect("the scan diverged");
    let tag = format!("(zoom: step {step} whole)");
    assert!(
        zoom.iter()
            .all(|c| c["baseline"].as_str().unwrap().ends_with(&tag)),
        "{r:#}"
    );
    // In the scan the gpu against the reference is first seen at an l_out; zoomed, at the
    // broken kernel's own tap of layer 1.
    let gpu_vs_ref = |cs: &[&serde_json::Value]| {
        cs.iter()
            .find(|c| {
                c["candidate"] == "parity/gpu"
                    && c["baseline"]
                        .as_str()
                        .unwrap()
                        .starts_with("parity/reference")
            })
            .map(|c| c["first_divergence"]["at"]["key"].clone())
            .unwrap()
    };
    assert_eq!(gpu_vs_ref(&scan_cs)["tap"], "l_out", "{r:#}");
    let at = gpu_vs_ref(&zoom);
    assert_eq!(at["layer"], 1, "{r:#}");
    assert!(
        ["q_rope", "k_rope"].contains(&at["tap"].as_str().unwrap()),
        "{at}"
    );
    // Op by op at the zoomed step (issue 29): the scan cannot feed every op its inputs, so
    // none runs against it; the zoom golden has the step whole, and there the gpu and the
    // reference, both fed its tensors, are compared op by op at that step alone: the broken
    // kernel is placed at its own op of layer 1.
    let op_by_op = |c: &&&serde_json::Value| c["candidate"] == "parity/gpu/op-by-op";
    assert!(!scan_cs.iter().any(|c| op_by_op(&c)), "{r:#}");
    let op = zoom.iter().find(op_by_op).expect("op by op in the zoom");
    assert!(
        op["baseline"]
            .as_str()
            .unwrap()
            .starts_with("parity/reference/op-by-op"),
        "{op:#}"
    );
    let at = &op["first_divergence"]["at"]["key"];
    assert_eq!(
        (at["step"].as_u64(), at["layer"].as_u64()),
        (Some(step), Some(1)),
        "{op:#}"
    );
    assert!(
        ["q_rope", "k_rope"].contains(&at["tap"].as_str().unwrap()),
        "{op:#}"
    );
    let steps: std::collections::BTreeSet<u64> = op["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["key"]["step"].as_u64())
        .collect();
    assert_eq!(steps, [step].into(), "{op:#}");
    // The zoom golden: the scan's plan with that step whole, fed as the scan was, every tensor
    // the scan has repeated bit for bit (no note that the run differs).
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(kept.join("manifest.json")).unwrap()).unwrap();
    let plan = m["record"].as_str().unwrap();
    assert!(plan.ends_with(&format!("full={step}")), "{plan}");
    assert!(
        m["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["step"] == step && t["tap"] == "kq_soft_max"),
        "{plan}"
    );
    let sm: serde_json::Value =
        serde_json::from_slice(&std::fs::read(scan.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["steps"], sm["steps"]);
    let text = show(&o);
    assert!(
        text.contains(&format!("step {step} recorded whole")),
        "{text}"
    );
    assert!(!text.contains("differs from the scan golden"), "{text}");
    for t in sm["tensors"].as_array().unwrap() {
        let f = t["file"].as_str().unwrap();
        assert_eq!(
            std::fs::read(scan.join(f)).unwrap(),
            std::fs::read(kept.join(f)).unwrap(),
            "{f}"
        );
    }

    // Turned off; and a kept folder must be new or empty (nothing run).
    let o = check(&["--no-zoom"], "rope-pairs@1");
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(!show(&o).contains("zoom:"), "{}", show(&o));
    let o = check(&["--zoom-out", kept.to_str().unwrap()], "rope-pairs@1");
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    assert!(show(&o).contains("not empty"), "{}", show(&o));

    // A golden whose steps its settings cannot explain (one more turn than it has): the scan's
    // verdict, and how to make the zoom by hand.
    let odd = dir.path().join("odd");
    common::copy_dir(&scan, &odd);
    let mut om = sm.clone();
    om["producer"]["settings"]["turns"] = serde_json::json!([5, 9]);
    std::fs::write(odd.join("manifest.json"), om.to_string()).unwrap();
    let mut env = gpu_env();
    env.push(("PARITY_GPU_TEST_BUG", "rope-pairs@1"));
    let o = parity_env(
        &[
            "check",
            model,
            "--golden",
            odd.to_str().unwrap(),
            "--backends",
            "reference,gpu",
        ],
        &env,
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(
        stdout(&o).contains(
            "zoom: not made — the golden's steps do not match how its settings say it was fed"
        ) && stdout(&o).contains("--record 'taps=v,k_rope,l_out,result_norm,logits;full="),
        "{}",
        show(&o)
    );
}
