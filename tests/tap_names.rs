//! The taps and their llama.cpp node names are defined once, in `Tap` (src/trace/taps.rs). The
//! golden script (scripts/llama_golden.py) restates them in Python to drive llama.cpp; these
//! tests read the script and hold the two to each other, so that a tap added or renamed on one
//! side and not the other fails here rather than as a missing tap in a golden.

use crate::common;

use parity::trace::Tap;
use regex::Regex;

fn script() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/llama_golden.py");
    std::fs::read_to_string(path).expect("scripts/llama_golden.py")
}

/// The quoted strings of the Python literal `NAME = [...]` or `NAME = {...}`.
fn py_strings(src: &str, name: &str) -> Vec<String> {
    let re = Regex::new(&format!(r"(?ms)^{name} = [\[{{](.*?)[\]}}]")).unwrap();
    let body = re
        .captures(src)
        .unwrap_or_else(|| panic!("{name} not found in llama_golden.py"))[1]
        .to_string();
    let body: String = body
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    Regex::new(r#""([^"]*)""#)
        .unwrap()
        .captures_iter(&body)
        .map(|c| c[1].to_string())
        .collect()
}

/// The node base name in `Tap::llama_cpp_name`: `Qcur-L (ROPE)` → `Qcur`, `inp_embd` → itself.
fn node_base(tap: Tap) -> &'static str {
    let n = tap.llama_cpp_name();
    let n = n.split(" (").next().unwrap();
    n.strip_suffix("-L").unwrap_or(n)
}

#[test]
fn script_lists_the_taps_in_graph_order() {
    let src = script();
    let mut names = py_strings(&src, "GLOBAL_FIRST");
    let layer = py_strings(&src, "LAYER_TAPS");
    names.extend(layer.iter().cloned());
    names.extend(py_strings(&src, "GLOBAL_LAST"));
    let ours: Vec<&str> = Tap::ALL.iter().map(|t| t.name()).collect();
    assert_eq!(names, ours, "llama_golden.py's tap lists vs Tap::ALL");
    for t in Tap::ALL {
        assert_eq!(
            layer.iter().any(|n| n == t.name()),
            t.per_layer(),
            "{t}: per-layer in one place only"
        );
    }
}

#[test]
fn script_asks_llama_cpp_for_every_taps_node() {
    let src = script();
    let bases = py_strings(&src, "LAYER_NODE_BASES");
    let act = py_strings(&src, "FFN_ACT_NODES");
    for t in Tap::ALL {
        let base = node_base(t);
        if t.per_layer() {
            assert!(
                bases.iter().any(|b| b == base),
                "{t}: node {base}-<il> ({}) is not in LAYER_NODE_BASES",
                t.llama_cpp_name()
            );
        } else {
            assert!(
                src.contains(&format!("pick(\"{base}\")")),
                "{t}: the script never picks node {base}"
            );
        }
    }
    assert!(
        act.iter().any(|b| b == node_base(Tap::FfnAct)),
        "ffn_act's node {} is not in FFN_ACT_NODES",
        node_base(Tap::FfnAct)
    );
}

#[test]
fn script_maps_a_node_to_every_tap() {
    let src = script();
    // Taps filled in a loop over (tap, base) pairs or (base, tap_pre, tap_rope, nh) rows are
    // named as string literals there; the others in a `put("tap", ...)` call.
    for t in Tap::ALL {
        let quoted = format!("\"{}\"", t.name());
        let mapped = src.contains(&format!("put({quoted},"))
            || src.contains(&format!("({quoted}, \"{}\")", node_base(t)))
            || src.contains(&format!("(\"{}\", {quoted}", node_base(t)))
            || src.contains(&format!(", {quoted}, n_head"));
        assert!(mapped, "{t}: llama_golden.py's map_step never fills it");
    }
}

/// What the script does with llama.cpp's graph, not only what its source says: a fresh golden
/// from the real llama.cpp of each architecture's fixture holds exactly the (step, layer, tap)
/// keys parity's reference records for the same model and ids, and together they hold every
/// tap parity knows.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn a_fresh_golden_of_every_architecture_holds_each_tap_parity_records() {
    use common::{llama_cpp_or_skip, parity, root, show};
    use std::collections::BTreeSet;
    if !llama_cpp_or_skip() {
        return;
    }
    let keys = |dir: &std::path::Path| -> BTreeSet<(u64, Option<u64>, String)> {
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
        m["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["step"].as_u64().unwrap(),
                    t["layer"].as_u64(),
                    t["tap"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut seen = BTreeSet::new();
    for arch in [
        "llama", "llama3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
    ] {
        let model = root().join(format!("fixtures/tiny-{arch}-q8_0.gguf"));
        let golden = tmp.path().join(format!("golden-{arch}"));
        let dump = tmp.path().join(format!("dump-{arch}"));
        let o = parity(&[
            "golden",
            model.to_str().unwrap(),
            "--tokens",
            "1,300,301,302,303",
            "--steps",
            "2",
            "--out",
            golden.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{arch}: {}", show(&o));
        let o = parity(&[
            "dump",
            model.to_str().unwrap(),
            "--golden",
            golden.to_str().unwrap(),
            "--out",
            dump.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{arch}: {}", show(&o));
        let (g, d) = (keys(&golden), keys(&dump));
        assert_eq!(
            g.symmetric_difference(&d).collect::<Vec<_>>(),
            Vec::<&(u64, Option<u64>, String)>::new(),
            "{arch}: keys only one of llama.cpp's golden and parity's dump has"
        );
        seen.extend(g.into_iter().map(|k| k.2));
    }
    for t in Tap::ALL {
        assert!(seen.contains(t.name()), "{t}: no golden holds it");
    }
}
