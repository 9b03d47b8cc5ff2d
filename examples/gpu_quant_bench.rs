//! Weight bandwidth of the gpu backend's quantized matmul (src/backend/gpu/quant), per type:
//! the 2048×5632 matvecs of a 1.1B Llama's FFN (up: 2048 → 5632, down: 5632 → 2048), decode
//! (1 token) and a 64-token prefill tile.
//!
//! ```text
//! cargo run --release --example gpu_quant_bench [-- [--runs N] [--mib N] [--tree] [TYPE...]]
//! ```
//!
//! Prints GB/s of weight bytes read (10⁹ bytes per second): per pass, `--iters` matmuls
//! recorded in one submission, each against the next of several copies of the weight (at
//! least `--mib` MiB in all, 512 by default, so the weights come from memory, not from the
//! GPU's cache), timed from
//! submit to completion; the median (and range) of `--runs` passes after one warm-up; GB/s
//! from the median. Compare with the
//! GPU's memory bandwidth (e.g. H100 SXM 3.35 TB/s, RTX 4090 1.01 TB/s). On a software device
//! (lavapipe) the figures measure the CPU. `--tree` times the shared-memory reduction instead
//! of subgroupAdd.

use std::time::Instant;

use parity::backend::gpu::quant::{QuantMatmul, Reduction, TYPES, upload_weight};
use parity::quant::{GgmlType, quantize_row};

fn main() {
    let mut runs = 5usize;
    let mut tree = false;
    let mut mib = 512usize;
    let mut types = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).unwrap_or(5).max(1),
            "--tree" => tree = true,
            "--mib" => {
                mib = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(512)
                    .max(1)
            }
            t => match GgmlType::parse(t).filter(|t| QuantMatmul::supports(*t)) {
                Some(t) => types.push(t),
                None => {
                    eprintln!("gpu_quant_bench: '{t}' is not a type the gpu matmul decodes");
                    std::process::exit(2);
                }
            },
        }
    }
    if types.is_empty() {
        types = TYPES.to_vec();
    }
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle().with_env());
    let Ok(adapter) = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    })) else {
        eprintln!(
            "no GPU adapter: install a Vulkan driver, e.g. Debian's mesa-vulkan-drivers for a software device"
        );
        std::process::exit(2);
    };
    let info = adapter.get_info();
    let features = adapter.features() & wgpu::Features::SUBGROUP;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("gpu_quant_bench"),
        required_features: features,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .expect("device");
    let reduction = if tree || !features.contains(wgpu::Features::SUBGROUP) {
        Reduction::Tree
    } else {
        Reduction::Subgroup
    };
    let mm = QuantMatmul::lazy(&device, reduction);
    println!(
        "adapter: {} ({:?}, {}), subgroups {}..{}, reduction {reduction:?}",
        info.name, info.backend, info.driver, info.subgroup_min_size, info.subgroup_max_size
    );
    println!(
        "{:<6} {:>13} {:>8} {:>6} {:>10} {:>21} {:>10}",
        "type", "shape", "tokens", "copies", "median µs", "range µs", "GB/s"
    );
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    for &ty in &types {
        for (n_in, n_out) in [(2048u32, 5632u32), (5632, 2048)] {
            let wf: Vec<f32> = (0..n_in as usize * n_out as usize).map(|_| rnd()).collect();
            let bytes = quantize_row(ty, &wf).expect("whole blocks");
            let copies = (mib << 20).div_ceil(bytes.len()).clamp(2, 64);
            let ws: Vec<wgpu::Buffer> = (0..copies)
                .map(|_| upload_weight(&device, &bytes))
                .collect();
            for n_tokens in [1u32, 64] {
                let xs: Vec<f32> = (0..(n_in * n_tokens) as usize).map(|_| rnd()).collect();
                let x = wgpu::util::DeviceExt::create_buffer_init(
                    &device,
                    &wgpu::util::BufferInitDescriptor {
                        label: Some("x"),
                        contents: bytemuck::cast_slice(&xs),
                        usage: wgpu::BufferUsages::STORAGE,
                    },
                );
                let y = device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("y"),
                    size: (n_out * n_tokens * 4) as u64,
                    usage: wgpu::BufferUsages::STORAGE,
                    mapped_at_creation: false,
                });
                let iters = copies * 4;
                let pass = || {
                    let mut enc = device.create_command_encoder(&Default::default());
                    for i in 0..iters {
                        mm.encode(
                            &device,
                            &mut enc,
                            ty,
                            &ws[i % copies],
                            n_in,
                            n_out,
                            &x,
                            &y,
                            n_tokens,
                        );
                    }
                    let cmd = enc.finish();
                    let t = Instant::now();
                    queue.submit([cmd]);
                    device
                        .poll(wgpu::PollType::wait_indefinitely())
                        .expect("poll");
                    t.elapsed().as_secs_f64() / iters as f64
                };
                pass();
                let mut times: Vec<f64> = (0..runs).map(|_| pass()).collect();
                times.sort_by(f64::total_cmp);
                let med = times[times.len() / 2];
                println!(
                    "{:<6} {:>13} {:>8} {:>6} {:>10.1} {:>21} {:>10.3}",
                    ty.name(),
                    format!("{n_in}→{n_out}"),
                    n_tokens,
                    copies,
                    med * 1e6,
                    format!("{:.1}–{:.1}", times[0] * 1e6, times[times.len() - 1] * 1e6),
                    bytes.len() as f64 / med / 1e9
                );
            }
        }
    }
}
