//! The JSON report's schema: the committed docs/report.schema.json is the one the types generate,
//! and real reports (`check --json -`, `diff --json FILE` of a divergence) validate against it.
//!
//! After changing the report types: `PARITY_UPDATE_SCHEMA=1 cargo test --test suite report_json::`, then
//! update docs/report-json.md (and bump the schema version if a field changed meaning).

use crate::common;
use common::*;

fn committed_schema() -> serde_json::Value {
    let p = root().join("docs/report.schema.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{e}"))).unwrap()
}

#[test]
fn committed_schema_is_the_generated_one() {
    let generated = parity::report::json::schema();
    let p = root().join("docs/report.schema.json");
    if std::env::var_os("PARITY_UPDATE_SCHEMA").is_some() {
        std::fs::write(&p, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&p).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/report.schema.json is not what the report types generate: run PARITY_UPDATE_SCHEMA=1 cargo test --test suite report_json:: and document the change in docs/report-json.md"
    );
}

fn validate(report: &serde_json::Value, what: &str) {
    let schema = committed_schema();
    let v = jsonschema::validator_for(&schema).expect("a valid JSON Schema");
    let errors: Vec<String> = v
        .iter_errors(report)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{what}: {errors:#?}");
}

#[test]
fn a_clean_check_report_on_stdout_validates() {
    let o = parity(&["check", "--json", "-"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    // stdout is the JSON alone; the human text went to stderr.
    let j: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}\n{}", show(&o)));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("verdict: parity"),
        "{}",
        show(&o)
    );
    validate(&j, "check --json -");
    assert_eq!(j["schema_version"], 1);
    assert_eq!(j["verdict"], "parity");
    assert_eq!(j["diverged"], 0);
    let comps = j["comparisons"].as_array().unwrap();
    assert_eq!(
        comps.len(),
        common::default_comparisons(),
        "3 backends (4 with the gpu), their op-by-op passes, every pair"
    );
    // The golden is there with its llama.cpp version, and its ids decoded by the model's tokenizer.
    let golden = j["traces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["label"] == "llama.cpp/llama.cpp-cpu")
        .expect("the golden's trace");
    assert_eq!(
        golden["producer"]["settings"]["llama_cpp_commit"],
        "0c1e570-dirty"
    );
    assert_eq!(
        golden["steps"][0]["text"],
        " Once upon a time there was a little girl named Lily"
    );
    // Bit-identical taps have an SQNR of +inf, written as null.
    let fast = comps
        .iter()
        .find(|c| c["candidate"] == "parity/fast" && c["baseline"] == "llama.cpp/llama.cpp-cpu")
        .unwrap();
    let embd = &fast["results"][0];
    assert_eq!(embd["key"]["tap"], "embd");
    assert_eq!(embd["metrics"]["nmse"], 0.0);
    assert!(embd["metrics"]["sqnr_db"].is_null());
}

#[test]
fn a_divergence_report_validates() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    copy_dir(&root().join("golden/tiny-llama-q8_0"), &dir);
    let p = dir.join("s001/ffn_out-0.npy");
    let (shape, mut data) = read_npy(&p);
    data[5] = f32::NAN;
    data[7] *= 3.0;
    write_npy(&p, &shape, &data);
    let json = tmp.path().join("r.json");
    let o = parity(&[
        "diff",
        "golden/tiny-llama-q8_0",
        dir.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    validate(&j, "diff --json FILE");
    assert_eq!(j["verdict"], "diverged");
    let c = &j["comparisons"][0];
    assert_eq!(c["verdict"], "diverged");
    assert_eq!(
        c["first_divergence"]["at"]["key"],
        serde_json::json!({"step": 1, "layer": 0, "tap": "ffn_out"})
    );
}

#[test]
fn the_schema_refuses_what_it_should() {
    // The validator is not vacuous: a report missing its version, or with an unknown verdict, fails.
    let o = parity(&["check", "--json", "-", "-q"]);
    let mut j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let v = jsonschema::validator_for(&committed_schema()).unwrap();
    assert!(v.is_valid(&j));
    j["verdict"] = "maybe".into();
    assert!(!v.is_valid(&j));
    j["verdict"] = "parity".into();
    j.as_object_mut().unwrap().remove("schema_version");
    assert!(!v.is_valid(&j));
}

#[test]
fn a_token_mismatch_report_validates_with_both_texts_decoded() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("nobos");
    let o = parity(&[
        "dump",
        "fixtures/tiny-llama-q8_0.gguf",
        "--golden",
        "golden/tiny-llama-q8_0",
        "--mutate",
        "no-bos",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let o = parity(&[
        "diff",
        "golden/tiny-llama-q8_0",
        dir.to_str().unwrap(),
        "--json",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    validate(&j, "diff of a trace without BOS");
    // Different ids are the verdict: no tensor is named as the first divergence, in any
    // comparison (the text names none either).
    for c in j["comparisons"].as_array().unwrap() {
        assert!(!c["token_mismatch"].is_null(), "{c:#}");
        assert!(c["first_divergence"].is_null(), "{}", c["first_divergence"]);
    }
    // The verdict rests on the ids, at the prompt step's embd, named by their difference.
    assert_eq!(
        j["finding"],
        serde_json::json!({"diverged": true, "basis": "tokens",
            "place": {"step": 0, "layer": null, "tap": "embd"},
            "named": "bos-missing", "also": [], "layouts": []}),
    );
    let t = &j["comparisons"][0]["token_mismatch"];
    assert_eq!(t["kind"], "bos-missing");
    assert_eq!(t["baseline_ids"][0], 1);
    assert_eq!(
        t["baseline_text"],
        " Once upon a time there was a little girl named Lily"
    );
    assert_eq!(
        t["candidate_text"],
        "Once upon a time there was a little girl named Lily"
    );
}

/// docs/report-json.md names every pair kind the schema has.
#[test]
fn the_docs_list_every_pair_kind() {
    let schema = committed_schema();
    let doc = std::fs::read_to_string(root().join("docs/report-json.md")).unwrap();
    let kinds: Vec<String> = schema["$defs"]["Pair"]["oneOf"]
        .as_array()
        .expect("Pair is a oneOf of constants")
        .iter()
        .filter_map(|v| v["const"].as_str().or_else(|| v["enum"][0].as_str()))
        .map(str::to_string)
        .collect();
    assert_eq!(kinds.len(), 4, "{:#}", schema["$defs"]["Pair"]);
    for k in kinds {
        assert!(
            doc.contains(&format!("`\"{k}\"`")),
            "docs/report-json.md lacks the pair {k}"
        );
    }
}

/// One story: with a sparse dump the bug is flagged at a later key and placed by experiment at
/// an earlier one; the JSON `first_divergence` of the verdict (own-inputs) is the place the
/// text names, in both of its sentences.
#[test]
fn the_json_first_divergence_is_the_place_the_text_names() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("sparse");
    let o = parity(&[
        "dump",
        "fixtures/tiny-llama-q8_0.gguf",
        "--golden",
        "golden/tiny-llama-q8_0",
        "--emulate",
        "ggml-cpu",
        "--mutate",
        "rms-eps-10x",
        "--taps",
        "^(embd|l_out-[0-9]+|result_norm|logits)$",
        "--out",
        t.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let json = tmp.path().join("r.json");
    let o = parity(&[
        "diff",
        "golden/tiny-llama-q8_0",
        t.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let text = stdout(&o);
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    validate(&j, "diff of a sparse dump");
    let own = j["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["pair"] == "own-inputs")
        .expect("the verdict's comparison");
    let k = &own["first_divergence"]["at"]["key"];
    let place = match k["layer"].as_u64() {
        Some(l) => format!(
            "step {} layer {l} {}",
            k["step"],
            k["tap"].as_str().unwrap()
        ),
        None => format!("step {} {}", k["step"], k["tap"].as_str().unwrap()),
    };
    // Flagged at the output norm (judged on its own), placed back at layer 0 by experiment.
    assert_eq!(place, "step 0 layer 0 l_out", "{text}");
    assert!(
        text.contains(&format!("placed by experiment at {place}:")),
        "{text}"
    );
    assert!(
        text.contains(&format!("first divergence at {place} ")),
        "{text}"
    );
}

/// Every rounding family the judge can name in `rounding_family` is listed where that field is
/// documented: the report types' doc (hence the schema) and docs/report-json.md.
#[test]
fn every_rounding_family_is_documented() {
    let doc = std::fs::read_to_string(root().join("docs/report-json.md")).unwrap();
    let schema = committed_schema();
    let field = schema.to_string();
    let row = doc
        .lines()
        .find(|l| l.starts_with("| `rounding_family`"))
        .expect("docs/report-json.md documents rounding_family");
    for f in parity::backend::family::FAMILIES {
        let name = format!("`{}`", f.name);
        assert!(row.contains(&name), "docs/report-json.md lacks {name}");
        assert!(field.contains(&name), "the schema lacks {name}");
    }
}

/// `diff`'s verdict is in its JSON as the terminal states it: a planted bug's place and name,
/// a clean trace's parity; `check` writes no finding (its comparisons are its verdict).
#[test]
fn diff_json_carries_the_finding() {
    let tmp = tempfile::tempdir().unwrap();
    let finding = |mutate: Option<&str>, exit: i32| {
        let t = tmp
            .path()
            .join(format!("{}.npz", mutate.unwrap_or("clean")));
        let mut args = vec![
            "dump",
            "fixtures/tiny-llama-q8_0.gguf",
            "--golden",
            "golden/tiny-llama-q8_0",
            "--out",
            t.to_str().unwrap(),
        ];
        if let Some(m) = mutate {
            args.extend(["--mutate", m]);
        }
        let o = parity(&args);
        assert_eq!(o.status.code(), Some(0), "{}", show(&o));
        let o = parity(&[
            "diff",
            "golden/tiny-llama-q8_0",
            t.to_str().unwrap(),
            "--json",
            "-",
        ]);
        assert_eq!(o.status.code(), Some(exit), "{}", show(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        validate(&j, "diff --json -");
        j["finding"].clone()
    };
    assert_eq!(
        finding(Some("rope-neox"), 1),
        serde_json::json!({"diverged": true, "basis": "own-error",
            "place": {"step": 0, "layer": 0, "tap": "q_rope"},
            "named": "rope-neox", "also": [], "layouts": []}),
    );
    assert_eq!(
        finding(None, 0),
        serde_json::json!({"diverged": false, "basis": "parity", "place": null,
            "named": null, "also": [], "layouts": []}),
    );
    let o = parity(&["check", "--json", "-", "-q"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(j.get("finding").is_none(), "{j:#}");
}
