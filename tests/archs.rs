//! The newer architectures' model side: hyperparameters read as the running llama.cpp reads
//! them (its own print_info log is the oracle), fixtures that llama.cpp loads and runs, zero-copy
//! views of phi3's fused tensors, and one-line refusals.

use crate::common;

use common::{parity, python, root, show};
use parity::gguf::{GgufFile, GgufWriter, Value, ValueType};
use parity::model::fixture::{FIXTURE_ARCHS, FixtureSpec, build};
use parity::model::{Activation, Arch, Config, Model, RopeType, row_view};
use std::collections::HashMap;
use std::path::Path;

fn fixture(name: &str) -> Model {
    Model::open(root().join("fixtures").join(format!("{name}.gguf"))).expect("committed fixture")
}

fn spec(arch: &str) -> FixtureSpec {
    let mut s = FixtureSpec::new(arch, parity::gguf::GgmlType::Q8_0, 7);
    s.n_ff = 256;
    if arch == "gemma3" {
        s.n_layer = 3;
    }
    s
}

#[test]
fn committed_fixtures_read_with_each_architectures_data() {
    let g2 = fixture("tiny-gemma2-q8_0").config;
    assert_eq!(g2.arch, Arch::Gemma2);
    assert_eq!((g2.n_swa, g2.swa_layers.clone()), (4, vec![true, false]));
    assert_eq!(g2.attn_softcap, Some(1.5));
    assert_eq!(g2.final_softcap, Some(5.0));
    assert_eq!(g2.activation, Activation::GeluTanh);
    assert_eq!(g2.embd_scale, Some(16.0));
    assert_eq!(g2.kq_scale, 0.125);
    assert!(g2.tied_embeddings);
    assert_eq!(g2.rope_type, RopeType::Neox);

    let g3 = fixture("tiny-gemma3-q8_0");
    let c = &g3.config;
    assert_eq!(
        c.swa_layers,
        vec![true, true, false],
        "period 3: two local, one global"
    );
    assert_eq!((c.rope_theta, c.rope_freq_scale), (1e6, 0.125));
    assert_eq!((c.rope_theta_swa, c.rope_freq_scale_swa), (1e4, 1.0));
    assert_eq!((c.attn_softcap, c.final_softcap), (None, None));
    assert!(g3.layers.iter().all(|l| l.q_norm.is_some()
        && l.k_norm.is_some()
        && l.attn_post_norm.is_some()
        && l.ffn_post_norm.is_some()));

    let q3 = fixture("tiny-qwen3-q8_0");
    assert_eq!((q3.config.head_dim, q3.config.n_embd_q()), (128, 512));
    assert!(q3.layers[0].q_norm.as_ref().unwrap().dims == vec![128]);
    assert!(!q3.config.has_qkv_bias);

    let p3 = fixture("tiny-phi3-q8_0");
    let c = &p3.config;
    assert_eq!(c.n_swa, 0, "llama.cpp drops phi3's window");
    assert_eq!(c.n_ctx_orig, 256);
    assert!((c.rope_attn_factor - (1.0f32 + 32f32.ln() / 256f32.ln()).sqrt()).abs() < 1e-6);
    let l0 = &p3.layers[0];
    let short = p3.vector(l0.rope_factors(256, c).unwrap());
    let long = p3.vector(l0.rope_factors(257, c).unwrap());
    assert_eq!(short.len(), 32);
    assert!(short.iter().all(|&f| (1.0..=1.5).contains(&f)), "{short:?}");
    assert_eq!(*long.last().unwrap(), 16.0);

    let l3 = fixture("tiny-llama3-q8_0");
    let f = l3.vector(l3.layers[1].rope_freqs.as_ref().unwrap());
    assert_eq!((f[0], f[31]), (1.0, 8.0), "{f:?}");
    assert!(
        f.iter().any(|&x| x > 1.0 && x < 8.0),
        "a smooth band: {f:?}"
    );
    assert_eq!(l3.config.rope_type, RopeType::Norm);

    let g1 = fixture("tiny-gemma-q8_0").config;
    assert_eq!((g1.n_head_kv, g1.n_swa, g1.attn_softcap), (1, 0, None));
    assert!(g1.tied_embeddings && g1.embd_scale == Some(16.0));
}

/// The rows of a view decode to the same values as the matching rows of the fused tensor.
fn same_rows(m: &Model, view: &parity::gguf::TensorInfo, fused_first: usize) {
    let (w, rows) = view.rows();
    let fused_name = view.name.split('[').next().unwrap();
    let fused = m.file.tensor(fused_name).unwrap().clone();
    let (mut a, mut b) = (vec![0.0; w], vec![0.0; w]);
    for r in [0, rows / 2, rows - 1] {
        m.row(view, r, &mut a);
        m.row(&fused, fused_first + r, &mut b);
        assert_eq!(a, b, "{} row {r}", view.name);
    }
    assert_eq!(m.data(view).len() as u64, view.n_bytes);
}

#[test]
fn phi3_fused_tensors_are_zero_copy_row_views() {
    let m = fixture("tiny-phi3-q8_0");
    let (q, kv, ff) = (m.config.n_embd_q(), m.config.n_embd_kv(), m.config.n_ff);
    for (l, layer) in m.layers.iter().enumerate() {
        assert_eq!(layer.wq.name, format!("blk.{l}.attn_qkv.weight[q]"));
        assert_eq!(layer.wk.dims, vec![256, kv as u64]);
        same_rows(&m, &layer.wq, 0);
        same_rows(&m, &layer.wk, q);
        same_rows(&m, &layer.wv, q + kv);
        assert_eq!(layer.w_gate.name, format!("blk.{l}.ffn_up.weight[gate]"));
        same_rows(&m, &layer.w_gate, 0);
        same_rows(&m, &layer.w_up, ff);
    }
    // the views tile the fused tensor exactly
    let fused = m.file.tensor("blk.0.attn_qkv.weight").unwrap();
    let l0 = &m.layers[0];
    assert_eq!(l0.wq.offset, fused.offset);
    assert_eq!(l0.wv.offset + l0.wv.n_bytes, fused.offset + fused.n_bytes);
    assert!(
        row_view(fused, "x", q + 2 * kv - 1, 2).is_err(),
        "past the end"
    );
}

#[test]
fn an_unknown_architecture_is_refused_in_one_line_listing_the_supported_ones() {
    let mut w = build(&spec("llama")).unwrap();
    w.set("general.architecture", Value::String("falcon".into()));
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let e = Config::from_gguf(&f).unwrap_err().to_string();
    assert_eq!(
        e,
        "unsupported architecture 'falcon' (parity supports: llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3)"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let o = parity(&[
        "fixture",
        "--arch",
        "falcon",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("llama, llama3, qwen2, qwen3, gemma, gemma2, gemma3, phi3"),
        "{err}"
    );
    assert!(!out.exists(), "a refused fixture leaves no file");
}

#[test]
fn sliding_window_pattern_is_read_like_load_swa_pattern() {
    let layers = |w: &GgufWriter| {
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        Config::from_gguf(&f).map(|c| c.swa_layers)
    };
    let mut s = spec("gemma3");
    s.n_layer = 7;
    let mut w = build(&s).unwrap();
    // a scalar is a period: local layers, then a global one
    assert_eq!(
        layers(&w).unwrap(),
        [true, true, false, true, true, false, true]
    );
    // a per-layer array wins
    let arr = [true, false, true, false, false, true, true];
    w.set(
        "gemma3.attention.sliding_window_pattern",
        Value::Array(
            ValueType::Bool,
            arr.iter().map(|&b| Value::Bool(b)).collect(),
        ),
    );
    assert_eq!(layers(&w).unwrap(), arr);
    // an array too short for the layers is an error naming the key
    w.set(
        "gemma3.attention.sliding_window_pattern",
        Value::Array(ValueType::Bool, vec![Value::Bool(true)]),
    );
    let e = layers(&w).unwrap_err().to_string();
    assert!(
        e.contains("sliding_window_pattern") && e.contains("1 entries"),
        "{e}"
    );
    // window 0: gemma3 without sliding window (llama.cpp: swa_type none)
    w.set("gemma3.attention.sliding_window", Value::U32(0));
    assert_eq!(layers(&w).unwrap(), [false; 7]);
}

#[test]
fn a_bad_shape_is_one_clear_error() {
    // qwen3 heads narrowed to 64 in the metadata: the 128-wide tensors no longer fit
    let mut w = build(&spec("qwen3")).unwrap();
    for k in [
        "attention.key_length",
        "attention.value_length",
        "rope.dimension_count",
    ] {
        w.set(&format!("qwen3.{k}"), Value::U32(64));
    }
    let e = match Model::from_gguf(GgufFile::from_bytes(w.to_bytes()).unwrap()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a model whose tensors do not fit its heads was accepted"),
    };
    assert_eq!(
        e,
        "tensor 'blk.0.attn_q.weight': expected dims [256, 256] (ggml ne order), found [256, 512]"
    );
}

/// llama.cpp's own reading of a fixture, from its load log: print_info values and each
/// layer's is_swa.
fn llama_cpp_reading(model: &Path) -> HashMap<String, String> {
    let code = r#"
import sys, llama_cpp as L
logs = []
cb = L.llama_log_callback(lambda level, text, ud: logs.append(text.decode("utf-8", "replace")))
L.llama_log_set(cb, None)
L.llama_backend_init()
mp = L.llama_model_default_params()
m = L.llama_model_load_from_file(sys.argv[1].encode(), mp)
print("loaded=" + ("1" if m else "0"))
for line in "".join(logs).splitlines():
    if line.startswith("print_info: ") and " = " in line:
        k, v = line[len("print_info: "):].split(" = ", 1)
        print(k.strip() + "=" + v.strip())
    if "assigned to device" in line and "is_swa" in line:
        il = line.split("layer")[1].split()[0]
        print("is_swa_" + il + "=" + line.rsplit("=", 1)[1].strip())
"#;
    let o = std::process::Command::new(python())
        .args(["-c", code])
        .arg(model)
        .output()
        .expect("run python");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama.cpp (llama-cpp-python in .venv or $PARITY_PYTHON)"
)]
fn every_fixture_architecture_reads_as_llama_cpp_reads_it() {
    if !common::llama_cpp_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for arch in FIXTURE_ARCHS {
        let s = spec(arch);
        let path = dir.path().join(format!("{arch}.gguf"));
        std::fs::write(&path, build(&s).unwrap().to_bytes()).unwrap();
        let c = Model::open(&path).expect("parity opens it").config;
        let r = llama_cpp_reading(&path);
        assert_eq!(
            r["loaded"], "1",
            "{arch}: llama.cpp did not load the fixture"
        );
        let num = |k: &str| -> f64 { r[k].parse().unwrap_or_else(|_| panic!("{k}={}", r[k])) };
        let rope_type = if c.rope_type == RopeType::Neox {
            2.0
        } else {
            0.0
        };
        assert_eq!(num("rope type"), rope_type, "{arch}: rope type");
        assert_eq!(num("n_embd_head_k"), c.head_dim as f64, "{arch}");
        assert_eq!(num("n_rot"), c.n_rot as f64, "{arch}");
        assert_eq!(num("n_swa"), c.n_swa as f64, "{arch}: n_swa");
        assert_eq!(num("freq_base_train"), c.rope_theta as f64, "{arch}");
        assert_eq!(num("freq_scale_train") as f32, c.rope_freq_scale, "{arch}");
        assert_eq!(num("n_ctx_orig_yarn"), c.n_ctx_orig as f64, "{arch}");
        assert!(
            (num("f_norm_rms_eps") as f32 - c.rms_eps).abs() < 1e-7,
            "{arch}"
        );
        for (il, &swa) in c.swa_layers.iter().enumerate() {
            assert_eq!(
                r[&format!("is_swa_{il}")],
                if swa { "1" } else { "0" },
                "{arch} L{il}"
            );
        }
        if c.n_swa > 0 {
            assert_eq!(num("freq_base_swa") as f32, c.rope_theta_swa, "{arch}");
            assert_eq!(
                num("freq_scale_swa") as f32,
                c.rope_freq_scale_swa,
                "{arch}"
            );
        }
        // llama.cpp prints f_attention_scale only where the loader sets it (gemma2/3); the
        // graph scales q by it with kq_scale 1
        let f_attn = num("f_attn_scale") as f32;
        if f_attn != 0.0 {
            // (printed with two significant digits)
            assert!((f_attn - c.kq_scale).abs() < 0.05 * c.kq_scale, "{arch}");
        }
    }
}

#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama.cpp (llama-cpp-python in .venv or $PARITY_PYTHON)"
)]
fn every_fixture_architecture_runs_in_llama_cpp_and_passes_the_golden_self_checks() {
    if !common::llama_cpp_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for arch in FIXTURE_ARCHS {
        let model = dir.path().join(format!("{arch}.gguf"));
        let m = model.to_str().unwrap();
        let mut args = vec!["fixture", "--arch", arch, "--n-ff", "256", "--out", m];
        if *arch == "gemma3" {
            args.extend(["--n-layer", "3"]);
        }
        let o = parity(&args);
        assert_eq!(o.status.code(), Some(0), "{}", show(&o));
        let out = dir.path().join(format!("g-{arch}"));
        let o = parity(&[
            "golden",
            m,
            "-p",
            "Once upon a time there was a little girl named Lily",
            "--steps",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(0), "{arch}: {}", show(&o));
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
        let ck = &manifest["producer"]["settings"]["self_check"];
        assert_eq!(ck["failed"], 0, "{arch}: {ck}");
        let files: Vec<&str> = manifest["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["file"].as_str().unwrap())
            .collect();
        // each architecture's own taps are recorded
        let want: &[&str] = match *arch {
            "gemma" => &["s000/embd_scaled.npy"],
            "gemma2" => &[
                "s000/embd_scaled.npy",
                "s000/attn_post_norm-1.npy",
                "s000/ffn_post_norm-1.npy",
                "s000/logits_uncapped.npy",
            ],
            "gemma3" => &[
                "s000/q_normed-2.npy",
                "s000/k_normed-2.npy",
                "s000/ffn_post_norm-2.npy",
            ],
            "qwen3" => &["s000/q_normed-1.npy", "s000/k_normed-1.npy"],
            "phi3" => &["s000/ffn_gate-1.npy", "s000/ffn_inp-1.npy"],
            _ => &["s000/q_rope-1.npy"],
        };
        for w in want {
            assert!(files.contains(w), "{arch}: {w} not in the golden");
        }
    }
}

#[test]
fn inspect_prints_each_architectures_own_hyperparameters() {
    let run = |name: &str| {
        let o = parity(&["inspect", &format!("fixtures/{name}.gguf")]);
        assert_eq!(o.status.code(), Some(0), "{}", show(&o));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let g2 = run("tiny-gemma2-q8_0");
    for want in [
        "activation gelu-tanh",
        "embd_scale 16",
        "attn_softcap 1.5",
        "final_softcap 5",
        "sliding_window 4 layers SF",
        "post-norms",
    ] {
        assert!(g2.contains(want), "{want} not in:\n{g2}");
    }
    assert!(run("tiny-gemma3-q8_0").contains("layers SSF (S slides) swa_theta 10000"));
    let p3 = run("tiny-phi3-q8_0");
    assert!(
        p3.contains("rope_factors long+short (long above n_ctx 256)")
            && p3.contains("fused attn_qkv"),
        "{p3}"
    );
    assert!(run("tiny-llama3-q8_0").contains("rope_freqs (llama3 frequency factors)"));
    assert!(run("tiny-qwen3-q8_0").contains("q/k norms"));
}
