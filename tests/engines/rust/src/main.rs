//! `toy-engine MODEL.gguf GOLDEN OUT [--bug NAME] [--npz]`: run the golden's ids through the
//! toy engine and write its trace to OUT — a folder, or with `--npz` one `.npz` archive built
//! in memory as the wasm32 build does. GOLDEN is a golden's folder or `.npz`.

use parity_trace::TraceWriter;
use std::process::ExitCode;

const USAGE: &str = "usage: toy-engine MODEL.gguf GOLDEN OUT [--bug NAME] [--npz]";

fn read(p: &str) -> Result<Vec<u8>, String> {
    std::fs::read(p).map_err(|e| format!("{p}: {e}"))
}

/// The golden's `manifest.json`: from its folder, or from inside its `.npz`.
fn golden_manifest(golden: &str) -> Result<Vec<u8>, String> {
    let p = std::path::Path::new(golden);
    if p.is_dir() {
        return read(&p.join("manifest.json").display().to_string());
    }
    let data = read(golden)?;
    let a = parity_trace::archive::Archive::parse(&data).map_err(|e| format!("{golden}: {e}"))?;
    a.get(&data, "manifest.json")
        .map(<[u8]>::to_vec)
        .map_err(|e| format!("{golden}: {e}"))
}

fn main() -> ExitCode {
    let mut pos = Vec::new();
    let (mut bug, mut npz) = (None, false);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--npz" => npz = true,
            "--bug" => match args.next() {
                Some(b) => bug = Some(b),
                None => {
                    eprintln!("toy-engine: --bug needs a name\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            s if s.starts_with("--") => {
                eprintln!("toy-engine: unknown option {s}\n{USAGE}");
                return ExitCode::from(2);
            }
            _ => pos.push(a),
        }
    }
    let [model, golden, out] = pos.as_slice() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    match trace(model, golden, out, bug.as_deref(), npz) {
        Ok((steps, taps)) => {
            println!("wrote {out}: {steps} steps, {taps} taps");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("toy-engine: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Write the trace; returns its (steps, taps).
fn trace(
    model: &str,
    golden: &str,
    out: &str,
    bug: Option<&str>,
    npz: bool,
) -> Result<(usize, usize), String> {
    let gguf = read(model)?;
    let manifest = golden_manifest(golden)?;
    if npz {
        let m = toy_engine::model_ref(model, &gguf);
        let bytes = toy_engine::trace_archive(m, "cpu-f32", &gguf, &manifest, bug)?;
        std::fs::write(out, &bytes).map_err(|e| format!("{out}: {e}"))?;
        // Read back, as parity will: the archive and its manifest.
        let a = parity_trace::archive::Archive::parse(&bytes).map_err(|e| format!("{out}: {e}"))?;
        let mj = a
            .get(&bytes, "manifest.json")
            .map_err(|e| format!("{out}: {e}"))?;
        let (m, _) = parity_trace::Manifest::parse(mj, out).map_err(|e| e.to_string())?;
        return Ok((m.steps.len(), m.tensors.len()));
    }
    let mut w =
        TraceWriter::create(out, model, "toy-engine", "cpu-f32").map_err(|e| e.to_string())?;
    toy_engine::run(&gguf, &manifest, &mut w, bug)?;
    let m = w.finish().map_err(|e| e.to_string())?;
    Ok((m.steps.len(), m.tensors.len()))
}
