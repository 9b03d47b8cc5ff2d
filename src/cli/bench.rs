//! `parity bench`: the fast backend against the real llama.cpp on the same file, the same
//! threads and the same token ids, in one run.
//!
//! Both sides are timed the same way: one forward of the P-token prompt from an empty KV cache
//! (prompt processing), then G single-token greedy decode steps (the argmax is not timed), after
//! W untimed warm-up repetitions; medians over R repetitions. Our side runs with a `NullSink`,
//! so no taps are kept. llama.cpp runs through `scripts/llama_bench.py` with its defaults for a
//! user (F16 KV cache, flash attention auto, weight repacking), which the table names.

use super::{Result, err, python, repo_root};
use crate::backend::{Backend, Fast, argmax};
use crate::model::Model;
use crate::trace::NullSink;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    /// GGUF file.
    model: PathBuf,
    /// Worker threads, the same for both engines (0 = every core).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    threads: usize,
    /// Prompt length (a fixed pseudo-random id sequence after BOS).
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Greedy decode steps after the prompt.
    #[arg(long = "gen", default_value_t = 32)]
    n_gen: usize,
    /// Timed repetitions (medians are reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Untimed warm-up repetitions before the timed ones (page faults, caches, thread start).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Only benchmark parity's fast backend.
    #[arg(long)]
    no_llama: bool,
    /// Run llama.cpp with llama_golden.py's tight settings (F32 KV cache, no flash attention,
    /// no repacking) instead of its defaults.
    #[arg(long)]
    llama_tight: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

const INSTALL_HINT: &str = "install it with `python3 -m venv .venv && .venv/bin/pip install \
    llama-cpp-python numpy` in the repository root (or point $PARITY_PYTHON at an interpreter \
    that has llama_cpp), or pass --no-llama";

/// The benchmark prompt: BOS (when the vocabulary has one) then a fixed pseudo-random walk over
/// the ordinary ids, identical for both engines.
fn prompt_ids(model: &Model, n: usize) -> Vec<u32> {
    let n_vocab = model.config.n_vocab as u64;
    let bos = model
        .file
        .get_u64("tokenizer.ggml.bos_token_id")
        .filter(|&b| b < n_vocab);
    let mut ids = Vec::with_capacity(n);
    if let Some(b) = bos {
        ids.push(b as u32);
    }
    let lo = 3.min(n_vocab - 1);
    let mut s = 0x2545_f491_4f6c_dd1du64;
    while ids.len() < n {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ids.push((lo + (s >> 33) % (n_vocab - lo)) as u32);
    }
    ids
}

#[derive(Clone, Debug, serde::Serialize)]
struct Timing {
    /// Seconds per repetition.
    pp_s: Vec<f64>,
    tg_s: Vec<f64>,
    pp_tok_s: f64,
    tg_tok_s: Option<f64>,
    generated: Vec<u32>,
    /// Where the calling thread's time went over the timed repetitions.
    main_thread: Option<MainThread>,
}

/// A busy machine shows as time spent runnable but waiting for a CPU.
#[derive(Clone, Debug, serde::Serialize)]
struct MainThread {
    wall_s: f64,
    on_cpu_s: f64,
    waiting_for_cpu_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The calling thread's (time on a CPU, time runnable but waiting for one), in seconds, from
/// /proc/thread-self/schedstat (Linux with schedstats; `None` elsewhere).
fn thread_sched() -> Option<(f64, f64)> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let mut it = s.split_whitespace().map(|v| v.parse::<u64>().ok());
    let (run, wait) = (it.next()??, it.next()??);
    Some((run as f64 * 1e-9, wait as f64 * 1e-9))
}

fn time_fast(model: &Model, ids: &[u32], a: &BenchArgs, threads: usize) -> Result<Timing> {
    let mut b = Fast::new(model, ids.len() + a.n_gen, threads);
    let (p, g) = (ids.len(), a.n_gen);
    let mut run = || -> Result<(f64, f64, Vec<u32>)> {
        b.reset();
        let t = Instant::now();
        let mut tok = argmax(b.forward(ids, 0, 0, &mut NullSink)?);
        let t_pp = t.elapsed().as_secs_f64();
        let mut t_tg = 0.0;
        let mut out = Vec::with_capacity(g);
        for s in 1..=g {
            out.push(tok);
            let t = Instant::now();
            let logits = b.forward(&[tok], p + s - 1, s, &mut NullSink)?;
            t_tg += t.elapsed().as_secs_f64();
            tok = argmax(logits);
        }
        Ok((t_pp, t_tg, out))
    };
    for _ in 0..a.warmup {
        run()?;
    }
    let (mut pp_s, mut tg_s, mut generated) = (vec![], vec![], vec![]);
    let (wall0, sched0) = (Instant::now(), thread_sched());
    for _ in 0..a.reps {
        let (x, y, out) = run()?;
        pp_s.push(x);
        tg_s.push(y);
        generated = out;
    }
    let wall = wall0.elapsed().as_secs_f64();
    let sched = sched0
        .zip(thread_sched())
        .map(|((r0, w0), (r1, w1))| (r1 - r0, w1 - w0));
    Ok(Timing {
        pp_tok_s: median(pp_s.iter().map(|s| p as f64 / s).collect()),
        tg_tok_s: (g > 0).then(|| median(tg_s.iter().map(|s| g as f64 / s).collect())),
        pp_s,
        tg_s,
        generated,
        main_thread: sched.map(|(run, wait)| MainThread {
            wall_s: wall,
            on_cpu_s: run,
            waiting_for_cpu_s: wait,
        }),
    })
}

/// Why llama.cpp could not be benchmarked (the message says how to fix it).
struct LlamaUnavailable(String);

fn time_llama(
    path: &Path,
    ids: &[u32],
    a: &BenchArgs,
    threads: usize,
) -> std::result::Result<serde_json::Value, LlamaUnavailable> {
    let py = python();
    let script = repo_root().join("scripts/llama_bench.py");
    let tokens: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let mut cmd = Command::new(&py);
    cmd.arg(&script)
        .arg(path)
        .arg("--tokens")
        .arg(tokens.join(","))
        .args(["--gen", &a.n_gen.to_string()])
        .args(["--reps", &a.reps.to_string()])
        .args(["--warmup", &a.warmup.to_string()])
        .args(["--threads", &threads.to_string()]);
    if a.llama_tight {
        cmd.arg("--tight");
    }
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| LlamaUnavailable(format!("{}: {e}", py.display())))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let last = stderr.lines().last().unwrap_or("").trim().to_string();
        return Err(LlamaUnavailable(format!(
            "{} {} exited with {}: {last}",
            py.display(),
            script.display(),
            out.status
        )));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| LlamaUnavailable(format!("{} printed no JSON ({e})", script.display())))
}

/// "Intel(R) Xeon(R) ..." from /proc/cpuinfo (or the architecture elsewhere).
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn fmt_rate(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}"))
}

pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    if a.reps == 0 {
        return Err(err("--reps must be at least 1"));
    }
    if a.prompt_tokens == 0 {
        return Err(err("--prompt-tokens must be at least 1"));
    }
    let model = Model::open(&a.model)?;
    let c = &model.config;
    if a.prompt_tokens + a.n_gen > c.n_ctx_train {
        return Err(err(format!(
            "prompt + gen ({}) exceeds the model's context length {}",
            a.prompt_tokens + a.n_gen,
            c.n_ctx_train
        )));
    }
    let threads = super::run::resolve_threads(a.threads);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpu = cpu_model();
    let simd = format!(
        "{:?}{}",
        crate::quant::cpu::simd(),
        if crate::quant::cpu::use_vnni() {
            "+AVX-VNNI"
        } else {
            ""
        }
    );
    let ids = prompt_ids(&model, a.prompt_tokens);
    let file_bytes = model.file.bytes().len();
    let wtype = model.main_weight_type();

    let ours = time_fast(&model, &ids, &a, threads)?;
    let llama = if a.no_llama {
        None
    } else {
        Some(time_llama(&a.model, &ids, &a, threads))
    };
    let theirs = match &llama {
        Some(Ok(j)) => Some(j),
        _ => None,
    };
    let their_pp = theirs.and_then(|j| j["pp_tok_s"].as_f64());
    let their_tg = theirs.and_then(|j| j["tg_tok_s"].as_f64());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let pp_ratio = ratio(Some(ours.pp_tok_s), their_pp);
    let tg_ratio = ratio(ours.tg_tok_s, their_tg);
    // How long the two greedy continuations agree (llama.cpp's F16 KV cache may part them).
    let agree = theirs.and_then(|j| j["generated"].as_array()).map(|g| {
        g.iter()
            .zip(&ours.generated)
            .take_while(|(x, y)| x.as_u64() == Some(**y as u64))
            .count()
    });

    if a.json {
        let j = serde_json::json!({
            "model": a.model.display().to_string(),
            "file_bytes": file_bytes,
            "weight_type": wtype.name(),
            "machine": { "cpu": cpu, "cores": cores, "simd": simd },
            "threads": threads,
            "prompt_tokens": ids.len(),
            "gen_tokens": a.n_gen,
            "reps": a.reps,
            "warmup": a.warmup,
            "prompt_ids": ids,
            "parity_fast": ours,
            "llama_cpp": theirs,
            "llama_cpp_error": match &llama { Some(Err(LlamaUnavailable(e))) => Some(e), _ => None },
            "ratio": { "pp": pp_ratio, "tg": tg_ratio },
            "greedy_agree": agree,
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        let load = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| {
                l.split_whitespace()
                    .next()
                    .map(|v| format!(", load average {v}"))
            })
            .unwrap_or_default();
        println!(
            "machine: {cpu}, {cores} cores ({simd}){load}; {threads} threads for both engines"
        );
        println!(
            "model: {} ({}, {:.1} MB, {} layers, n_embd {}, n_ff {}, n_vocab {})",
            a.model.display(),
            wtype.name(),
            file_bytes as f64 / 1e6,
            c.n_layer,
            c.n_embd,
            c.n_ff,
            c.n_vocab
        );
        println!(
            "work: prompt of {} ids, then {} greedy decode steps; median of {} reps after {} warm-up",
            ids.len(),
            a.n_gen,
            a.reps,
            a.warmup
        );
        if let Some(j) = theirs {
            let s = &j["settings"];
            let fa = match (s["flash_attn"].as_str(), s["flash_attn_resolved"].as_str()) {
                (Some(r), Some(u)) if r != u => format!("{r} -> {u}"),
                (Some(r), _) => r.to_string(),
                _ => "?".into(),
            };
            // "on (q4_0_8x8 × 154 tensors)": which layouts llama.cpp actually repacked into.
            let kinds: Vec<String> = s["repacked_tensors"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, n)| format!("{k} x {n} tensors"))
                        .collect()
                })
                .unwrap_or_default();
            let repack = match s["weight_repacking"].as_bool() {
                Some(true) if kinds.is_empty() => "on (no tensor repacked)".to_string(),
                Some(true) => format!("on ({})", kinds.join(", ")),
                Some(false) => "off".into(),
                None => "?".into(),
            };
            println!(
                "llama.cpp: {} (llama-cpp-python {}): KV cache {}/{}, flash attention {}, weight repacking {}, n_ubatch {}",
                s["mode"].as_str().unwrap_or("?"),
                j["llama_cpp_python"].as_str().unwrap_or("?"),
                s["type_k"].as_str().unwrap_or("?"),
                s["type_v"].as_str().unwrap_or("?"),
                fa,
                repack,
                s["n_ubatch"]
            );
        }
        println!();
        println!(
            "{:<22} {:>12} {:>12} {:>18}",
            "", "parity fast", "llama.cpp", "parity/llama.cpp"
        );
        let r = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.2}x"));
        println!(
            "{:<22} {:>12} {:>12} {:>18}",
            "prompt (pp) tok/s",
            fmt_rate(Some(ours.pp_tok_s)),
            fmt_rate(their_pp),
            r(pp_ratio)
        );
        println!(
            "{:<22} {:>12} {:>12} {:>18}",
            "decode (tg) tok/s",
            fmt_rate(ours.tg_tok_s),
            fmt_rate(their_tg),
            r(tg_ratio)
        );
        if let Some(m) = &ours.main_thread {
            let waited = m.waiting_for_cpu_s / m.wall_s;
            if waited > 0.02 {
                println!(
                    "note: parity's main thread waited for a CPU {:.0}% of the timed wall time: \
                     the machine was busy, so both columns are pessimistic",
                    100.0 * waited
                );
            }
        }
        if let Some(n) = agree {
            println!(
                "greedy continuations agree on the first {n} of {} tokens",
                a.n_gen
            );
        }
    }
    match llama {
        Some(Err(LlamaUnavailable(why))) => {
            eprintln!("llama.cpp could not be run ({why}); {INSTALL_HINT}");
            Ok(ExitCode::from(2))
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}
