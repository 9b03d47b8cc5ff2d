//! Dequantization throughput, per ggml type: the SIMD path (`dequantize_row`) against its
//! scalar twin (`dequantize_row_scalar`), single thread.
//!
//!     cargo bench --bench dequant [-- [--quick] [--mib N | --kib N] [--runs N] [TYPE...]]
//!
//! Throughput is GB/s of f32 *output* (10^9 bytes per second), the median of `--runs` timed
//! passes over a buffer large enough to leave the caches (64 MiB of output by default; `--quick`
//! uses 1 MiB and 3 runs). `--kib N` measures the kernels in cache instead: an N KiB output
//! (16 KiB is one 4096-wide weight row) decoded again and again, 64 MiB of output per pass;
//! that is how a row-by-row consumer such as the reference backend uses them. Input blocks are random bytes with finite, moderate scales, so no
//! path is slowed down by NaN or subnormal arithmetic.

use parity_quant::GgmlType;
use parity_quant::{QuantError, dequantize_row, dequantize_row_scalar};
use std::hint::black_box;
use std::time::{Duration, Instant};

type Decoder = fn(GgmlType, &[u8], &mut [f32]) -> Result<(), QuantError>;

/// Byte offsets of the scale fields set to finite values: (offset, is_f32).
fn scale_fields(ty: GgmlType) -> &'static [(usize, bool)] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => &[(0, false)],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => &[(0, false), (2, false)],
        GgmlType::Q4_K | GgmlType::Q5_K => &[(0, false), (2, false)],
        GgmlType::Q2_K => &[(80, false), (82, false)],
        GgmlType::Q3_K => &[(108, false)],
        GgmlType::Q6_K => &[(208, false)],
        GgmlType::Q8_K => &[(0, true)],
        GgmlType::IQ4_XS => &[(0, false)],
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &[],
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// A float in ±[1e-3, 1].
    fn scale(&mut self) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        let v = 10f32.powf(-3.0 * u);
        if self.next() & 1 == 0 { v } else { -v }
    }
}

/// `n` elements of `ty` as random blocks with finite scales (finite, normal values for the
/// plain float formats).
fn make_input(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let mut src = vec![0u8; n / bs * ts];
    for c in src.chunks_mut(8) {
        let r = rng.next().to_le_bytes();
        c.copy_from_slice(&r[..c.len()]);
    }
    match ty {
        GgmlType::F32 => {
            for c in src.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.scale().to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in src.chunks_exact_mut(2) {
                c.copy_from_slice(&half::f16::from_f32(rng.scale()).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in src.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.scale()).to_bits().to_le_bytes());
            }
        }
        _ => {
            for b in src.chunks_exact_mut(ts) {
                for &(off, is_f32) in scale_fields(ty) {
                    let v = rng.scale();
                    if is_f32 {
                        b[off..off + 4].copy_from_slice(&v.to_le_bytes());
                    } else {
                        b[off..off + 2]
                            .copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
                    }
                }
            }
        }
    }
    src
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked".into())
}

/// One timed pass (`repeat` decodes of `src`), or the error / panic message.
fn pass(
    f: Decoder,
    ty: GgmlType,
    src: &[u8],
    dst: &mut [f32],
    repeat: usize,
) -> Result<Duration, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let s = Instant::now();
        for _ in 0..repeat {
            f(ty, black_box(src), black_box(&mut *dst)).map_err(|e| e.to_string())?;
            black_box(&mut *dst);
        }
        Ok(s.elapsed())
    }))
    .unwrap_or_else(|p| Err(panic_text(p)))
}

/// Median seconds of `runs` passes of each decoder after one warm-up each. The two decoders
/// alternate pass by pass, so load from elsewhere on the machine hits both alike.
fn time_both(
    ty: GgmlType,
    src: &[u8],
    dst: &mut [f32],
    runs: usize,
    repeat: usize,
) -> [Result<f64, String>; 2] {
    let fs: [Decoder; 2] = [dequantize_row, dequantize_row_scalar];
    let mut out: [Result<Vec<Duration>, String>; 2] = [Ok(Vec::new()), Ok(Vec::new())];
    for r in 0..=runs {
        for (f, o) in fs.iter().zip(out.iter_mut()) {
            if let Ok(v) = o {
                match pass(*f, ty, src, dst, repeat) {
                    Ok(t) if r > 0 => v.push(t),
                    Ok(_) => {}
                    Err(e) => *o = Err(e),
                }
            }
        }
    }
    out.map(|o| o.map(|v| median(v).as_secs_f64()))
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    #[cfg(target_arch = "x86_64")]
    let feats: Vec<String> = {
        let yn = |b: bool| if b { "yes" } else { "no" };
        vec![
            format!("avx2={}", yn(is_x86_feature_detected!("avx2"))),
            format!("fma={}", yn(is_x86_feature_detected!("fma"))),
            format!("f16c={}", yn(is_x86_feature_detected!("f16c"))),
            format!("avx512f={}", yn(is_x86_feature_detected!("avx512f"))),
        ]
    };
    #[cfg(target_arch = "aarch64")]
    let feats: Vec<String> = vec!["neon=yes".into()];
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let feats: Vec<String> = Vec::new();
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into());
    format!(
        "machine: {cpu} ({}, {} logical CPUs); {}; single thread; load average {load}",
        std::env::consts::ARCH,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        feats.join(" ")
    )
}

fn main() {
    let mut quick = false;
    let mut mib: Option<usize> = None;
    let mut kib: Option<usize> = None;
    let mut runs: Option<usize> = None;
    let mut only: Vec<GgmlType> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--mib" => mib = args.next().and_then(|v| v.parse().ok()),
            "--kib" => kib = args.next().and_then(|v| v.parse().ok()),
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()),
            "--bench" | "--nocapture" => {} // passed by `cargo bench`
            "-h" | "--help" => {
                println!("dequant [--quick] [--mib N | --kib N] [--runs N] [TYPE...]");
                return;
            }
            s if s.starts_with('-') => {}
            s => match GgmlType::parse(s) {
                Some(t) => only.push(t),
                None => eprintln!("dequant: unknown type {s}, ignored"),
            },
        }
    }
    let mib = mib.unwrap_or(if quick { 1 } else { 64 }).max(1);
    // In-cache mode: a KiB-sized output decoded again and again, 64 MiB of output per pass.
    let (out_bytes, repeat) = match kib {
        Some(k) => {
            let b = (k.max(1) << 10).next_multiple_of(1024);
            (b, (64 << 20) / b)
        }
        None => (mib << 20, 1),
    };
    let runs = runs.unwrap_or(if quick { 3 } else { 7 }).max(1);
    let types: Vec<GgmlType> = if only.is_empty() {
        GgmlType::ALL.to_vec()
    } else {
        only
    };

    println!("{}", machine());
    let buffer = match kib {
        Some(_) => format!(
            "{} KiB output decoded {repeat} times (in cache)",
            out_bytes >> 10
        ),
        None => format!("{mib} MiB output"),
    };
    println!(
        "{buffer} per pass, median of {runs} runs (+1 warm-up); GB/s = 1e9 bytes of f32 output per second"
    );
    println!(
        "{:<8} {:>10} {:>10} {:>10} {:>7}",
        "type", "in KiB", "simd GB/s", "scalar GB/s", "ratio"
    );
    // Keep panics from placeholder decoders to one line in the table.
    std::panic::set_hook(Box::new(|_| {}));
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for ty in types {
        // A whole number of blocks (and of 256-element super-blocks) per pass.
        let n = out_bytes / 4 / 256 * 256;
        let src = make_input(ty, n, &mut rng);
        let mut dst = vec![0f32; n]; // touched now, so page faults stay out of the timing
        let bytes = (n * 4 * repeat) as f64;
        let [simd, scalar] = time_both(ty, &src, &mut dst, runs, repeat);
        let gbs = |r: &Result<f64, String>| match r {
            Ok(s) => format!("{:.2}", bytes / s / 1e9),
            Err(_) => "n/a".into(),
        };
        let ratio = match (&simd, &scalar) {
            (Ok(a), Ok(b)) => format!("{:.2}x", b / a),
            _ => "-".into(),
        };
        let mut line = format!(
            "{:<8} {:>10.1} {:>10} {:>10} {:>7}",
            ty.name(),
            src.len() as f64 / 1024.0,
            gbs(&simd),
            gbs(&scalar),
            ratio
        );
        for (what, r) in [("simd", &simd), ("scalar", &scalar)] {
            if let Err(e) = r {
                line.push_str(&format!("  ({what}: {e})"));
            }
        }
        println!("{line}");
    }
    let _ = std::panic::take_hook();
}
