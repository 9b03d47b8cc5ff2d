//! The taps and their llama.cpp node names are defined once, in `Tap` (src/trace/taps.rs). The
//! golden script (scripts/llama_golden.py) restates them in Python to drive llama.cpp; these
//! tests read the script and hold the two to each other, so that a tap added or renamed on one
//! side and not the other fails here rather than as a missing tap in a golden.

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
