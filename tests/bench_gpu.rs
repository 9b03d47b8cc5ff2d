//! `parity bench --backends gpu`: the gpu backend's rates and weight bandwidth beside the fast
//! backend's, in the table and in the JSON. Timings are not judged (no thresholds): only that
//! each figure is there, finite and positive, and that the figures agree with each other.

use crate::common;
use common::*;

/// The numbers on the table row that starts with `label`, one per engine column.
fn row(out: &str, label: &str) -> Vec<f64> {
    let line = out
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` row in\n{out}"));
    line[label.len()..]
        .split_whitespace()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("`{v}` in `{line}` is not a number"))
        })
        .collect()
}

fn finite_positive(v: f64, what: &str) {
    assert!(v.is_finite() && v > 0.0, "{what}: {v}");
}

#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn bench_prints_gpu_rates_and_bandwidth() {
    let base = [
        "bench",
        "fixtures/tiny-llama-q4_0.gguf",
        "--backends",
        "fast,gpu",
        "--no-llama",
        "--reps",
        "1",
        "--warmup",
        "1",
        "--prompt-tokens",
        "8",
        "--gen",
        "4",
        "--threads",
        "2",
    ];
    let o = parity(&base);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let out = stdout(&o);
    let head = out
        .lines()
        .find(|l| l.contains("parity fast"))
        .unwrap_or_else(|| panic!("no column header in\n{out}"));
    assert!(head.contains("parity gpu"), "{head}");
    for label in [
        "prompt (pp) tok/s",
        "decode (tg) tok/s",
        "decode weights GB/s",
    ] {
        let v = row(&out, label);
        assert_eq!(v.len(), 2, "{label}: two columns (fast, gpu) in\n{out}");
        for x in v {
            finite_positive(x, label);
        }
    }
    let adapter = out
        .lines()
        .find(|l| l.starts_with("gpu: ") && l.contains("driver"))
        .unwrap_or_else(|| panic!("no adapter line in\n{out}"));
    // A CPU device says its figures are no speed figures; a real GPU gets its bandwidth share
    // or the hint to give it.
    let cpu_device = adapter.contains("(Cpu,");
    assert_eq!(
        out.contains("on it only correctness counts"),
        cpu_device,
        "{out}"
    );
    if !cpu_device {
        assert!(
            out.contains("memory bandwidth"),
            "a real GPU's line about its memory bandwidth in\n{out}"
        );
    }

    // The JSON: the same engines, and bandwidth = bytes per token × decode rate.
    let o = parity(&[&base[..], &["--json", "--peak-gbs", "100"]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("bench --json");
    let g = &j["parity"]["gpu"];
    for key in ["pp_tok_s", "tg_tok_s", "tg_weight_gb_s"] {
        finite_positive(g[key].as_f64().unwrap_or(f64::NAN), key);
    }
    assert_eq!(g["generated"].as_array().map(Vec::len), Some(4), "{g}");
    let bytes = g["weight_bytes_per_token"]
        .as_u64()
        .expect("bytes per token");
    let want = bytes as f64 * g["tg_tok_s"].as_f64().unwrap() / 1e9;
    let got = g["tg_weight_gb_s"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
    // The q4_0 fixture's matmul weights, counted from the file: every f32 one is 4 bytes an
    // element, so the gpu backend reads at least the file's bytes and at most all as f32.
    let fast_bytes = j["parity"]["fast"]["weight_bytes_per_token"]
        .as_u64()
        .unwrap();
    assert!(bytes >= fast_bytes, "{bytes} < {fast_bytes}");
    let d = &g["device"];
    assert_eq!(d["peak_gb_s"].as_f64(), Some(100.0), "{d}");
    let share = d["tg_share_of_peak"].as_f64().unwrap_or(f64::NAN);
    assert!((share - got / 100.0).abs() <= 1e-12, "{share} vs {got}/100");
    assert_eq!(j["backends"], serde_json::json!(["fast", "gpu"]));
    // The fast backend keeps its historical keys.
    finite_positive(
        j["parity_fast"]["tg_tok_s"].as_f64().unwrap_or(f64::NAN),
        "parity_fast.tg_tok_s",
    );
}

/// What bench refuses in one line (exit 2): a backend named twice, an unknown one, a
/// bandwidth that is no bandwidth. No adapter needed.
#[test]
fn bench_refuses_bad_backend_lists() {
    for (extra, why) in [
        (&["--backends", "fast,fast"][..], "twice"),
        (&["--backends", "vulkan"][..], "unknown backend 'vulkan'"),
        (&["--peak-gbs", "0"][..], "--peak-gbs"),
    ] {
        let args = [
            &["bench", "fixtures/tiny-llama-q8_0.gguf", "--no-llama"][..],
            extra,
        ]
        .concat();
        let o = parity(&args);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", show(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(err.contains(why), "{extra:?}: {err}");
    }
}

/// With no adapter (the Vulkan loader pointed at a driver list that does not exist), asking
/// for the gpu backend stops bench in one line naming the driver to install, exit 2, before
/// anything is timed (the fast backend named first prints no table).
#[test]
#[cfg(target_os = "linux")]
fn bench_without_an_adapter_says_so_in_one_line() {
    let args = [
        "bench",
        "fixtures/tiny-llama-q8_0.gguf",
        "--backends",
        "fast,gpu",
        "--no-llama",
        "--reps",
        "1",
    ];
    let none = "/nonexistent/parity-no-driver.json";
    let o = parity_env(
        &args,
        &[("VK_DRIVER_FILES", none), ("VK_ICD_FILENAMES", none)],
    );
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.contains("XDG_RUNTIME_DIR"))
        .collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(
        lines[0].contains("no GPU adapter") && lines[0].contains("mesa-vulkan-drivers"),
        "{err}"
    );
    assert!(o.stdout.is_empty(), "{}", show(&o));
}
