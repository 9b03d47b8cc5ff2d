//! `parity bench`: parity's backends (`--backends`, the fast one by default; `gpu` for the
//! device) against the real llama.cpp on the same file, the same threads and the same token
//! ids, in one run.
//!
//! Every engine is timed the same way: one forward of the P-token prompt from an empty KV cache
//! (prompt processing), then G single-token greedy decode steps (the argmax is not timed), after
//! W untimed warm-up repetitions; medians over R repetitions. Our side runs with a `NullSink`,
//! so no taps are kept; the gpu backend reads each step's logits back, so its steps are timed
//! to completion on the device. Beside the rates: the weight bandwidth decode achieved (the
//! bytes of matmul weights read per token, as each engine holds them, × decode tok/s), and for
//! the gpu backend that figure against the device's memory bandwidth where it is known. llama.cpp runs through `scripts/llama_bench.py` with its defaults for a
//! user (F16 KV cache, flash attention auto, weight repacking), which the table names.

use super::{Result, err, python};
use crate::backend::gpu::Gpu;
use crate::backend::{Backend, argmax, registry};
use crate::gguf::TensorInfo;
use crate::model::Model;
use crate::trace::NullSink;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
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
    /// parity's backends to time, comma-separated (any of `parity check --backends`'s names;
    /// `gpu` needs a GPU adapter).
    #[arg(long, value_delimiter = ',', default_value = "fast")]
    backends: Vec<String>,
    /// The GPU's memory bandwidth in GB/s, for an adapter the built-in table does not know:
    /// the gpu backend's decode weight bandwidth is shown as a share of it.
    #[arg(long, value_name = "GB/S")]
    peak_gbs: Option<f64>,
    /// Only benchmark parity's backends.
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

fn time_backend(b: &mut dyn Backend, ids: &[u32], a: &BenchArgs) -> Result<Timing> {
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
    let script = super::script("llama_bench.py");
    let tokens: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    // Isolated (`-I`): nothing in the working folder is imported.
    let mut cmd = super::python_command();
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

/// Two decimals, or three significant digits below 1 (a software device's 0.00322 GB/s is
/// not 0.00).
fn fmt_rate(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| {
        let digits = if v > 0.0 && v < 1.0 {
            (2 - v.log10().floor() as i32).clamp(2, 12) as usize
        } else {
            2
        };
        format!("{v:.digits$}")
    })
}

/// The weights a decode step's matmuls read, each once per token: every layer's projections
/// and the output (the embedding only gives one row per token and is left out).
fn matmul_weights(model: &Model) -> Vec<&TensorInfo> {
    let mut v = vec![&model.output];
    for l in &model.layers {
        v.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
    }
    v
}

/// Bytes of matmul weights read per decode token: the file's bytes of each, except those an
/// engine holds as f32 (`as_f32`: their names), which cost 4 bytes an element.
fn weight_bytes(model: &Model, as_f32: &[String]) -> u64 {
    matmul_weights(model)
        .iter()
        .map(|t| {
            if as_f32.contains(&t.name) {
                t.n_elements * 4
            } else {
                t.n_bytes
            }
        })
        .sum()
}

/// The memory bandwidth (GB/s, the vendor's figure) of a GPU recognised by its adapter name,
/// matched by whole words (`L4` is not `L40S`); the more specific variants come first.
fn known_peak_gbs(adapter: &str) -> Option<f64> {
    const TABLE: &[(&[&str], f64)] = &[
        (&["H200"], 4800.0),
        (&["H100", "PCIe"], 2000.0),
        (&["H100", "NVL"], 3900.0),
        (&["H100"], 3350.0), // SXM5, "NVIDIA H100 80GB HBM3"
        (&["A100-SXM4-80GB"], 2039.0),
        (&["A100", "80GB", "PCIe"], 1935.0),
        (&["A100-SXM4-40GB"], 1555.0),
        (&["A100-PCIE-40GB"], 1555.0),
        (&["L40S"], 864.0),
        (&["L4"], 300.0),
        (&["T4"], 320.0),
        (&["RTX", "4090"], 1008.0),
        (&["RTX", "3090"], 936.0),
    ];
    let words: Vec<&str> = adapter.split_whitespace().collect();
    // Laptop parts share the desktop names with other memory.
    if words.iter().any(|w| *w == "Laptop" || *w == "Mobile") {
        return None;
    }
    TABLE
        .iter()
        .find(|(need, _)| need.iter().all(|n| words.contains(n)))
        .map(|&(_, g)| g)
}

/// One of parity's backends, timed.
#[derive(Debug, serde::Serialize)]
struct Ours {
    name: String,
    #[serde(flatten)]
    timing: Timing,
    /// Bytes of matmul weights read per decode token, as this backend holds them.
    weight_bytes_per_token: u64,
    /// `weight_bytes_per_token` × decode tok/s, in GB/s.
    tg_weight_gb_s: Option<f64>,
    /// The device, for the gpu backend.
    device: Option<GpuRun>,
}

#[derive(Debug, serde::Serialize)]
struct GpuRun {
    adapter: String,
    device_type: String,
    api: String,
    driver: String,
    /// A CPU device (lavapipe, llvmpipe, WARP): the timings measure the CPU, only the
    /// correctness of the kernels counts there.
    cpu_device: bool,
    /// Matmul weights held as f32 on the device (no kernel reads their type directly).
    dequantized_at_load: Vec<String>,
    /// The device's memory bandwidth, GB/s: `--peak-gbs`, else the built-in table.
    peak_gb_s: Option<f64>,
    peak_from: Option<&'static str>,
    /// `tg_weight_gb_s` / `peak_gb_s`.
    tg_share_of_peak: Option<f64>,
}

fn time_ours(model: &Model, ids: &[u32], a: &BenchArgs, threads: usize) -> Result<Vec<Ours>> {
    let n_ctx = ids.len() + a.n_gen;
    // The gpu backend is made before anything is timed, so that a missing adapter stops the
    // run at once; the others are made in turn (an idle CPU pool must not run beside a timing).
    let wants_gpu = a
        .backends
        .iter()
        .any(|b| registry::find(b).is_ok_and(|e| e.name == "gpu"));
    let mut gpu = if wants_gpu {
        Some(Box::new(Gpu::new(model, n_ctx)?))
    } else {
        None
    };
    enum Built<'m> {
        Gpu(Box<Gpu<'m>>),
        Other(Box<dyn Backend + 'm>),
    }
    let mut out = Vec::new();
    for name in &a.backends {
        let entry = registry::find(name)?;
        let b = match gpu.take() {
            Some(g) if entry.name == "gpu" => Built::Gpu(g),
            g => {
                gpu = g;
                Built::Other(entry.build(model, n_ctx, threads)?)
            }
        };
        let (timing, device, as_f32) = match b {
            Built::Gpu(mut g) => {
                let timing = time_backend(g.as_mut(), ids, a)?;
                let i = g.info();
                let (peak, from) = match a.peak_gbs {
                    Some(p) => (Some(p), Some("--peak-gbs")),
                    None => {
                        let k = known_peak_gbs(&i.adapter);
                        (k, k.map(|_| "parity's table of vendor figures"))
                    }
                };
                let dev = GpuRun {
                    adapter: i.adapter.clone(),
                    device_type: i.device_type.clone(),
                    api: i.api.clone(),
                    driver: format!("{} {}", i.driver, i.driver_info).trim().to_string(),
                    cpu_device: i.device_type == "Cpu",
                    dequantized_at_load: g.dequantized().to_vec(),
                    peak_gb_s: peak,
                    peak_from: from,
                    tg_share_of_peak: None,
                };
                let f32s = dev.dequantized_at_load.clone();
                (timing, Some(dev), f32s)
            }
            Built::Other(mut b) => (time_backend(b.as_mut(), ids, a)?, None, Vec::new()),
        };
        let bytes = weight_bytes(model, &as_f32);
        let gbs = timing.tg_tok_s.map(|r| bytes as f64 * r / 1e9);
        let device = device.map(|d| GpuRun {
            tg_share_of_peak: gbs.zip(d.peak_gb_s).map(|(g, p)| g / p),
            ..d
        });
        out.push(Ours {
            name: entry.name.to_string(),
            timing,
            weight_bytes_per_token: bytes,
            tg_weight_gb_s: gbs,
            device,
        });
    }
    Ok(out)
}

/// The options a run cannot start with (one line, exit 2).
fn check_args(a: &BenchArgs) -> Result<()> {
    if a.reps == 0 {
        return Err(err("--reps must be at least 1"));
    }
    if a.prompt_tokens == 0 {
        return Err(err("--prompt-tokens must be at least 1"));
    }
    for (i, b) in a.backends.iter().enumerate() {
        let name = registry::find(b)?.name;
        if a.backends[..i]
            .iter()
            .any(|o| registry::find(o).is_ok_and(|e| e.name == name))
        {
            return Err(err(format!("--backends names {b} twice")));
        }
    }
    if a.backends.is_empty() {
        return Err(err("--backends names no backend"));
    }
    if let Some(p) = a.peak_gbs
        && !(p.is_finite() && p > 0.0)
    {
        return Err(err(format!(
            "--peak-gbs {p}: give the bandwidth in GB/s, > 0"
        )));
    }
    Ok(())
}

/// The machine a run timed on.
struct Machine {
    cpu: String,
    cores: usize,
    /// The quantized dot products' instruction set ("Avx2+AVX-VNNI").
    simd: String,
    threads: usize,
}

impl Machine {
    fn here(threads: usize) -> Machine {
        let simd = format!(
            "{:?}{}",
            crate::quant::cpu::simd(),
            match (crate::quant::cpu::use_vnni(), crate::quant::cpu::vnni()) {
                (true, Some(crate::quant::cpu::Vnni::Avx)) => "+AVX-VNNI",
                (true, Some(crate::quant::cpu::Vnni::Avx512)) => "+AVX512-VNNI",
                _ => "",
            }
        );
        Machine {
            cpu: cpu_model(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            simd,
            threads,
        }
    }
}

/// Everything one run measured, and the comparisons read from it; the renderers only print.
struct Measured {
    machine: Machine,
    ids: Vec<u32>,
    /// What llama.cpp's matmuls read per token: the file's bytes.
    file_weight_bytes: u64,
    ours: Vec<Ours>,
    /// `None` with `--no-llama`.
    llama: Option<std::result::Result<serde_json::Value, LlamaUnavailable>>,
}

impl Measured {
    fn theirs(&self) -> Option<&serde_json::Value> {
        match &self.llama {
            Some(Ok(j)) => Some(j),
            _ => None,
        }
    }

    fn their_pp(&self) -> Option<f64> {
        self.theirs().and_then(|j| j["pp_tok_s"].as_f64())
    }

    fn their_tg(&self) -> Option<f64> {
        self.theirs().and_then(|j| j["tg_tok_s"].as_f64())
    }

    fn their_gbs(&self) -> Option<f64> {
        self.their_tg()
            .map(|r| self.file_weight_bytes as f64 * r / 1e9)
    }

    /// (prompt, decode) rates of one of ours over llama.cpp's.
    fn ratios(&self, o: &Ours) -> (Option<f64>, Option<f64>) {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        (
            ratio(Some(o.timing.pp_tok_s), self.their_pp()),
            ratio(o.timing.tg_tok_s, self.their_tg()),
        )
    }

    /// How long two greedy continuations agree (llama.cpp's F16 KV cache may part them).
    fn agree(&self, o: &Ours) -> Option<usize> {
        self.theirs()
            .and_then(|j| j["generated"].as_array())
            .map(|g| {
                g.iter()
                    .zip(&o.timing.generated)
                    .take_while(|(x, y)| x.as_u64() == Some(**y as u64))
                    .count()
            })
    }

    fn fast(&self) -> Option<&Ours> {
        self.ours.iter().find(|o| o.name == "fast")
    }
}

/// Time parity's backends, then llama.cpp (unless `--no-llama`), on the same ids.
fn measure(a: &BenchArgs, model: &Model) -> Result<Measured> {
    let c = &model.config;
    if a.prompt_tokens + a.n_gen > c.n_ctx_train {
        return Err(err(format!(
            "prompt + gen ({}) exceeds the model's context length {}",
            a.prompt_tokens + a.n_gen,
            c.n_ctx_train
        )));
    }
    let machine = Machine::here(super::backends::resolve_threads(a.threads));
    let ids = prompt_ids(model, a.prompt_tokens);
    let ours = time_ours(model, &ids, a, machine.threads)?;
    let llama = (!a.no_llama).then(|| time_llama(&a.model, &ids, a, machine.threads));
    Ok(Measured {
        file_weight_bytes: weight_bytes(model, &[]),
        machine,
        ids,
        ours,
        llama,
    })
}

fn render_json(a: &BenchArgs, model: &Model, m: &Measured) -> Result<()> {
    let parity: serde_json::Map<String, serde_json::Value> = m
        .ours
        .iter()
        .map(|o| {
            let mut v = serde_json::to_value(o).unwrap_or_default();
            let (pp, tg) = m.ratios(o);
            v["ratio"] = serde_json::json!({ "pp": pp, "tg": tg });
            v["greedy_agree"] = serde_json::json!(m.agree(o));
            (o.name.clone(), v)
        })
        .collect();
    let fast = m.fast();
    let (pp_ratio, tg_ratio) = fast.map_or((None, None), |o| m.ratios(o));
    let j = serde_json::json!({
        "model": a.model.display().to_string(),
        "file_bytes": model.file.bytes().len(),
        "weight_type": model.main_weight_type().name(),
        "machine": { "cpu": m.machine.cpu, "cores": m.machine.cores, "simd": m.machine.simd },
        "threads": m.machine.threads,
        "prompt_tokens": m.ids.len(),
        "gen_tokens": a.n_gen,
        "reps": a.reps,
        "warmup": a.warmup,
        "prompt_ids": m.ids,
        "backends": m.ours.iter().map(|o| &o.name).collect::<Vec<_>>(),
        "parity": parity,
        // The fast backend's entry under its historical names (scripts read these).
        "parity_fast": fast.map(|o| &o.timing),
        "ratio": { "pp": pp_ratio, "tg": tg_ratio },
        "greedy_agree": fast.and_then(|o| m.agree(o)),
        "llama_cpp": m.theirs(),
        "llama_cpp_weight_bytes_per_token": m.file_weight_bytes,
        "llama_cpp_tg_weight_gb_s": m.their_gbs(),
        "llama_cpp_error": match &m.llama { Some(Err(LlamaUnavailable(e))) => Some(e), _ => None },
    });
    println!(
        "{}",
        crate::report::shown::json(serde_json::to_string_pretty(&j)?)
    );
    Ok(())
}

/// Driver and adapter strings come from the driver, llama.cpp's settings from a child's
/// output: each is escaped like a file's where it is printed.
fn sh(s: &str) -> String {
    crate::report::shown::shown(s).into_owned()
}

fn render_text(a: &BenchArgs, model: &Model, m: &Measured) {
    print_setting(a, model, m);
    println!();
    print_table(m);
    print_footnotes(a, m);
}

/// The machine, the model, the work, the devices and llama.cpp's settings.
fn print_setting(a: &BenchArgs, model: &Model, m: &Measured) {
    let c = &model.config;
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| {
            l.split_whitespace()
                .next()
                .map(|v| format!(", load average {v}"))
        })
        .unwrap_or_default();
    let Machine {
        cpu,
        cores,
        simd,
        threads,
    } = &m.machine;
    println!("machine: {cpu}, {cores} cores ({simd}){load}; {threads} threads for both engines");
    println!(
        "model: {} ({}, {:.1} MB, {} layers, n_embd {}, n_ff {}, n_vocab {})",
        a.model.display(),
        model.main_weight_type().name(),
        model.file.bytes().len() as f64 / 1e6,
        c.n_layer,
        c.n_embd,
        c.n_ff,
        c.n_vocab
    );
    println!(
        "work: prompt of {} ids, then {} greedy decode steps; median of {} reps after {} warm-up",
        m.ids.len(),
        a.n_gen,
        a.reps,
        a.warmup
    );
    for o in &m.ours {
        let Some(d) = &o.device else { continue };
        println!(
            "gpu: {} ({}, {}, driver {})",
            sh(&d.adapter),
            sh(&d.device_type),
            sh(&d.api),
            sh(&d.driver)
        );
        if d.cpu_device {
            println!(
                "gpu: the adapter is a CPU device (software Vulkan such as lavapipe): its figures measure the CPU, on it only correctness counts"
            );
        }
    }
    if let Some(j) = m.theirs() {
        println!("{}", crate::report::shown::line(&llama_settings(j)));
    }
}

/// llama.cpp's settings as the script reported them, in one line.
fn llama_settings(j: &serde_json::Value) -> String {
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
                .map(|(k, n)| format!("{} x {n} tensors", sh(k)))
                .collect()
        })
        .unwrap_or_default();
    let repack = match s["weight_repacking"].as_bool() {
        Some(true) if kinds.is_empty() => "on (no tensor repacked)".to_string(),
        Some(true) => format!("on ({})", kinds.join(", ")),
        Some(false) => "off".into(),
        None => "?".into(),
    };
    format!(
        "llama.cpp: {} (llama-cpp-python {}): KV cache {}/{}, flash attention {}, weight repacking {}, n_ubatch {}",
        s["mode"].as_str().unwrap_or("?"),
        j["llama_cpp_python"].as_str().unwrap_or("?"),
        s["type_k"].as_str().unwrap_or("?"),
        s["type_v"].as_str().unwrap_or("?"),
        fa,
        repack,
        s["n_ubatch"]
    )
}

/// One column per engine: parity's backends, then llama.cpp when it ran.
fn print_table(m: &Measured) {
    let ours = &m.ours;
    let ran = m.theirs().is_some();
    let mut head = vec![String::new()];
    head.extend(ours.iter().map(|o| format!("parity {}", o.name)));
    let row = |label: &str, ours_v: Vec<String>, theirs_v: String| {
        let mut v = vec![label.to_string()];
        v.extend(ours_v);
        if ran {
            v.push(theirs_v);
        }
        v
    };
    let r = |x: Option<f64>| x.map_or("-".into(), |x| format!("{}x", fmt_rate(Some(x))));
    let mut rows = vec![
        row(
            "prompt (pp) tok/s",
            ours.iter()
                .map(|o| fmt_rate(Some(o.timing.pp_tok_s)))
                .collect(),
            fmt_rate(m.their_pp()),
        ),
        row(
            "decode (tg) tok/s",
            ours.iter().map(|o| fmt_rate(o.timing.tg_tok_s)).collect(),
            fmt_rate(m.their_tg()),
        ),
        row(
            "decode weights GB/s",
            ours.iter().map(|o| fmt_rate(o.tg_weight_gb_s)).collect(),
            fmt_rate(m.their_gbs()),
        ),
    ];
    if ran {
        head.push("llama.cpp".into());
        rows.push(row(
            "pp vs llama.cpp",
            ours.iter().map(|o| r(m.ratios(o).0)).collect(),
            String::new(),
        ));
        rows.push(row(
            "tg vs llama.cpp",
            ours.iter().map(|o| r(m.ratios(o).1)).collect(),
            String::new(),
        ));
    }
    for line in std::iter::once(&head).chain(&rows) {
        let mut s = format!("{:<22}", line[0]);
        for c in &line[1..] {
            s += &format!(" {c:>14}");
        }
        println!("{}", s.trim_end());
    }
}

/// What the table's figures mean, the devices' bandwidth, a busy machine, greedy agreement.
fn print_footnotes(a: &BenchArgs, m: &Measured) {
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "decode weights: the matmul weights read once per token ({:.1} MB as stored in the file), × decode tok/s",
        mb(m.file_weight_bytes)
    );
    for o in &m.ours {
        let Some(d) = &o.device else { continue };
        if !d.dequantized_at_load.is_empty() {
            println!(
                "gpu: {} matmul weights held as f32 on the device ({:.1} MB read per token)",
                d.dequantized_at_load.len(),
                mb(o.weight_bytes_per_token)
            );
        }
        match (d.peak_gb_s, d.tg_share_of_peak) {
            (Some(p), Some(s)) => println!(
                "gpu: decode read weights at {:.1}% of {}'s memory bandwidth ({p:.0} GB/s, from {})",
                100.0 * s,
                sh(&d.adapter),
                d.peak_from.unwrap_or("?")
            ),
            _ if d.cpu_device => {}
            _ => println!(
                "gpu: memory bandwidth of {} unknown: pass --peak-gbs to see decode's share of it",
                sh(&d.adapter)
            ),
        }
    }
    if let Some(t) = m.ours.iter().find_map(|o| o.timing.main_thread.as_ref()) {
        let waited = t.waiting_for_cpu_s / t.wall_s;
        if waited > 0.02 {
            println!(
                "note: parity's main thread waited for a CPU {:.0}% of the timed wall time: \
                 the machine was busy, so every column is pessimistic",
                100.0 * waited
            );
        }
    }
    for o in &m.ours {
        if let Some(n) = m.agree(o) {
            println!(
                "greedy continuations of parity {} and llama.cpp agree on the first {n} of {} tokens",
                o.name, a.n_gen
            );
        }
    }
}

pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    check_args(&a)?;
    let model = Model::open(&a.model)?;
    let m = measure(&a, &model)?;
    if a.json {
        render_json(&a, &model, &m)?;
    } else {
        render_text(&a, &model, &m);
    }
    match &m.llama {
        Some(Err(LlamaUnavailable(why))) => {
            // `why` quotes the script's last stderr line: one escaped line.
            eprintln!(
                "llama.cpp could not be run ({}); {INSTALL_HINT}",
                crate::report::shown::line(why)
            );
            Ok(ExitCode::from(2))
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}

#[cfg(test)]
mod tests {
    use super::known_peak_gbs;

    #[test]
    fn peak_bandwidth_matches_whole_words_and_specific_variants_first() {
        assert_eq!(known_peak_gbs("NVIDIA H100 80GB HBM3"), Some(3350.0));
        assert_eq!(known_peak_gbs("NVIDIA H100 PCIe"), Some(2000.0));
        assert_eq!(known_peak_gbs("NVIDIA L4"), Some(300.0));
        assert_eq!(known_peak_gbs("NVIDIA L40S"), Some(864.0));
        assert_eq!(known_peak_gbs("NVIDIA GeForce RTX 4090"), Some(1008.0));
        assert_eq!(known_peak_gbs("NVIDIA GeForce RTX 4090 Laptop GPU"), None);
        assert_eq!(known_peak_gbs("llvmpipe (LLVM 19.1.7, 256 bits)"), None);
    }

    #[test]
    fn small_rates_keep_three_significant_digits() {
        use super::fmt_rate;
        assert_eq!(fmt_rate(Some(0.0032249)), "0.00322");
        assert_eq!(fmt_rate(Some(0.5)), "0.500");
        assert_eq!(fmt_rate(Some(17418.951)), "17418.95");
        assert_eq!(fmt_rate(Some(0.0)), "0.00");
        assert_eq!(fmt_rate(None), "-");
    }
}
