//! The gpu backend's quantized matmul (src/backend/gpu/quant) against the CPU's decoder: every
//! type on random valid blocks (made by the quantizers in crates/parity-quant), y = x · Wᵀ compared with
//! `dequantize_row` + a sequential f32 dot within `sum_order_bound`. Shapes: rows not a
//! multiple of the workgroup's, 1, 2, 7 and 33 tokens, K = 256·k and K = 32·odd, weights at odd
//! byte offsets, NaN guards after the output, both reductions, windows and grids split by
//! small device limits, and a run with lavapipe's LVP_POISON_MEMORY.

use std::sync::OnceLock;

use parity::backend::gpu::quant::{
    QuantMatmul, ROWS_PER_WORKGROUP, Reduction, TYPES, sum_order_bound, upload_weight,
};
use parity::quant::{GgmlType, dequantize_row, ggml::f16_le, quantize_row};
use wgpu::util::DeviceExt;

const NO_GPU: &str = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)";

struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    subgroup: Option<QuantMatmul>,
    tree: QuantMatmul,
}

/// A device with `limits` lowered from the adapter's by `lower` (the default: none), with
/// subgroups when the adapter has them.
fn open(lower: impl Fn(&mut wgpu::Limits)) -> Gpu {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle().with_env());
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))
    .unwrap_or_else(|e| {
        panic!("{NO_GPU}, yet build.rs found a Vulkan loader and driver (its probe was wrong): {e}")
    });
    let features = adapter.features() & wgpu::Features::SUBGROUP;
    let mut limits = adapter.limits();
    lower(&mut limits);
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("gpu_quant test"),
        required_features: features,
        required_limits: limits,
        ..Default::default()
    }))
    .expect("device");
    let subgroup = features
        .contains(wgpu::Features::SUBGROUP)
        .then(|| QuantMatmul::lazy(&device, Reduction::Subgroup));
    let tree = QuantMatmul::lazy(&device, Reduction::Tree);
    Gpu {
        device,
        queue,
        subgroup,
        tree,
    }
}

fn gpu() -> &'static Gpu {
    static G: OnceLock<Gpu> = OnceLock::new();
    G.get_or_init(|| open(|_| {}))
}

impl Gpu {
    /// The pipelines to test: subgroupAdd when the device has it (the fast path), else the tree.
    fn main(&self) -> &QuantMatmul {
        self.subgroup.as_ref().unwrap_or(&self.tree)
    }
}

/// Deterministic pseudo-random numbers (xorshift), roughly normal by summing uniforms.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
    fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.uniform()).sum::<f32>() * 1.7
    }
}

const GUARD: usize = 64;

/// One matmul on the device: the weight's bytes at byte `w_offset` of a buffer filled with 0xff
/// around them, x followed by NaNs, y prefilled with NaN and followed by GUARD NaNs that must
/// survive. Returns y.
#[allow(clippy::too_many_arguments)]
fn run(
    g: &Gpu,
    mm: &QuantMatmul,
    ty: GgmlType,
    wbytes: &[u8],
    w_offset: usize,
    n_in: usize,
    n_out: usize,
    x: &[f32],
    n_tokens: usize,
) -> Vec<f32> {
    let mut wb = vec![0xffu8; w_offset];
    wb.extend_from_slice(wbytes);
    wb.extend_from_slice(&[0xff; 7]);
    let w = upload_weight(&g.device, &wb);
    let mut xb = x.to_vec();
    xb.extend(std::iter::repeat_n(f32::NAN, GUARD));
    let xbuf = g
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("x"),
            contents: bytemuck::cast_slice(&xb),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let ny = n_tokens * n_out + GUARD;
    let nan = f32::from_bits(0x7fc0_1234);
    let ybuf = g
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("y"),
            contents: bytemuck::cast_slice(&vec![nan; ny]),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        });
    let read = g.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: (ny * 4) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = g.device.create_command_encoder(&Default::default());
    mm.encode_at(
        &g.device,
        &mut enc,
        ty,
        &w,
        w_offset as u64,
        n_in as u32,
        n_out as u32,
        &xbuf,
        &ybuf,
        n_tokens as u32,
    );
    enc.copy_buffer_to_buffer(&ybuf, 0, &read, 0, (ny * 4) as u64);
    g.queue.submit([enc.finish()]);
    let slice = read.slice(..);
    slice.map_async(wgpu::MapMode::Read, |r| r.expect("map"));
    g.device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    let y: Vec<f32> = bytemuck::cast_slice(&slice.get_mapped_range().expect("mapped")).to_vec();
    for (i, v) in y[n_tokens * n_out..].iter().enumerate() {
        assert_eq!(
            v.to_bits(),
            nan.to_bits(),
            "{ty}: write past the output, guard element {i} is {v}"
        );
    }
    y[..n_tokens * n_out].to_vec()
}

/// Magnitude of the block's min term for each element (see `sum_order_bound`).
fn offsets(ty: GgmlType, row: &[u8], n_in: usize) -> Vec<f32> {
    let (bs, bb) = (ty.block_size(), ty.type_size());
    (0..n_in)
        .map(|i| {
            let b = &row[i / bs * bb..];
            match ty {
                GgmlType::Q4_1 | GgmlType::Q5_1 => f16_le(&b[2..]).abs(),
                GgmlType::Q4_K | GgmlType::Q5_K => f16_le(&b[2..]).abs() * 63.0,
                _ => 0.0,
            }
        })
        .collect()
}

/// A random n_out × n_in weight of type `ty` (valid blocks from its quantizer) and random x;
/// the device's y against the CPU's within the bound. Returns the largest error / bound.
#[allow(clippy::too_many_arguments)]
fn check(
    g: &Gpu,
    mm: &QuantMatmul,
    ty: GgmlType,
    n_in: usize,
    n_out: usize,
    n_tokens: usize,
    w_offset: usize,
    seed: u64,
) -> f64 {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let wf: Vec<f32> = (0..n_in * n_out).map(|_| rng.normal()).collect();
    let mut wbytes = Vec::new();
    for r in wf.chunks(n_in) {
        wbytes.extend(quantize_row(ty, r).expect("whole blocks"));
    }
    let x: Vec<f32> = (0..n_in * n_tokens).map(|_| rng.normal()).collect();
    let y = run(g, mm, ty, &wbytes, w_offset, n_in, n_out, &x, n_tokens);
    let row_bytes = wbytes.len() / n_out;
    let mut worst = 0.0f64;
    for r in 0..n_out {
        let rb = &wbytes[r * row_bytes..(r + 1) * row_bytes];
        let mut wd = vec![0.0f32; n_in];
        dequantize_row(ty, rb, &mut wd).expect("decode");
        let off = offsets(ty, rb, n_in);
        for t in 0..n_tokens {
            let xt = &x[t * n_in..(t + 1) * n_in];
            let cpu = wd.iter().zip(xt).fold(0.0f32, |s, (a, b)| s + a * b);
            let mag: f64 = (0..n_in)
                .map(|i| (wd[i].abs() as f64 + off[i] as f64) * xt[i].abs() as f64)
                .sum();
            let bound = sum_order_bound(n_in, mag);
            let got = y[t * n_out + r];
            let err = (got as f64 - cpu as f64).abs();
            assert!(
                err <= bound,
                "{ty} {n_out}x{n_in} T={n_tokens} off={w_offset} {:?}: y[t={t}, row={r}] = {got}, \
                 CPU {cpu}, |diff| {err:e} > bound {bound:e}",
                mm.reduction()
            );
            worst = worst.max(err / bound);
        }
    }
    worst
}

/// Shapes for one type: K = 256·k and (32-element blocks) 32·odd, rows not a multiple of the
/// workgroup's, 1/2/7/33 tokens, aligned and odd byte offsets.
fn shapes(ty: GgmlType) -> Vec<(usize, usize, usize, usize)> {
    let mut ks = vec![256, 768];
    match ty.block_size() {
        32 => ks.extend([96, 32 * 45]),
        1 => ks.extend([96, 32 * 45, 37]),
        _ => {}
    }
    let mut v = Vec::new();
    for (i, &k) in ks.iter().enumerate() {
        for (j, &(n_out, t)) in [
            (5, 1),
            (13, 2),
            (1, 7),
            (2 * ROWS_PER_WORKGROUP as usize + 3, 33),
        ]
        .iter()
        .enumerate()
        {
            let off = [0, 3, 1027, 6][(i + j) % 4];
            v.push((k, n_out, t, off));
        }
    }
    v
}

fn check_type(ty: GgmlType) {
    let g = gpu();
    let mut worst = 0.0f64;
    for (i, (k, n_out, t, off)) in shapes(ty).into_iter().enumerate() {
        worst = worst.max(check(g, g.main(), ty, k, n_out, t, off, i as u64 + 1));
    }
    eprintln!("{ty}: largest |gpu − cpu| / bound = {worst:.3e}");
}

macro_rules! type_tests {
    ($($name:ident: $ty:ident,)*) => {$(
        #[test]
        #[cfg_attr(not(parity_gpu), ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)")]
        fn $name() {
            check_type(GgmlType::$ty);
        }
    )*};
}

type_tests! {
    f32_matches_cpu: F32,
    f16_matches_cpu: F16,
    bf16_matches_cpu: BF16,
    q8_0_matches_cpu: Q8_0,
    q4_0_matches_cpu: Q4_0,
    q4_1_matches_cpu: Q4_1,
    q5_0_matches_cpu: Q5_0,
    q5_1_matches_cpu: Q5_1,
    q4_k_matches_cpu: Q4_K,
    q5_k_matches_cpu: Q5_K,
    q6_k_matches_cpu: Q6_K,
}

/// The shared-memory tree, forced on a device that has subgroups too; every type.
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn tree_reduction_matches_cpu() {
    let g = gpu();
    for (i, &ty) in TYPES.iter().enumerate() {
        let k = if ty.block_size() == 256 { 512 } else { 32 * 7 };
        check(g, &g.tree, ty, k, 6, 1, 1, 100 + i as u64);
        check(g, &g.tree, ty, k, 9, 33, 2, 200 + i as u64);
    }
}

/// A device whose limits force every split: storage bindings of 4 KiB (weights bound in
/// windows of a few rows, at 256-byte aligned offsets), 3 workgroups per grid dimension (rows
/// over x and y, tokens over several dispatches).
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn small_limits_split_windows_and_grids() {
    let g = open(|l| {
        l.max_storage_buffer_binding_size = 4096;
        l.max_compute_workgroups_per_dimension = 3;
    });
    for (i, &ty) in TYPES.iter().enumerate() {
        let k = if ty.block_size() == 256 { 768 } else { 32 * 9 };
        let mm = g.subgroup.as_ref().unwrap_or(&g.tree);
        // 41 rows: 11 workgroups of 4 on a 3×4 grid; 33 tokens: 5 tiles, 2 dispatches.
        check(&g, mm, ty, k, 41, 33, 5, 300 + i as u64);
        check(&g, mm, ty, k, 41, 1, 0, 400 + i as u64);
        check(&g, &g.tree, ty, k, 17, 9, 1001, 500 + i as u64);
    }
}

/// The type tests again in a child process with LVP_POISON_MEMORY=true: lavapipe fills new
/// memory with garbage, so a read of memory nobody wrote shows (other drivers ignore it).
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn poisoned_memory() {
    if std::env::var_os("LVP_POISON_MEMORY").is_some() {
        return; // we are the child
    }
    let names = [
        "f32_matches_cpu",
        "f16_matches_cpu",
        "bf16_matches_cpu",
        "q8_0_matches_cpu",
        "q4_0_matches_cpu",
        "q4_1_matches_cpu",
        "q5_0_matches_cpu",
        "q5_1_matches_cpu",
        "q4_k_matches_cpu",
        "q5_k_matches_cpu",
        "q6_k_matches_cpu",
    ];
    // In the suite binary (module_path!() `suite::gpu_quant`) the tests are `gpu_quant::…`.
    let prefix = module_path!()
        .split_once("::")
        .map_or(String::new(), |(_, m)| format!("{m}::"));
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(names.iter().map(|n| format!("{prefix}{n}")))
        .args(["--exact", "--test-threads=1", "--include-ignored"])
        .env("LVP_POISON_MEMORY", "true")
        .output()
        .expect("run the test binary");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "with LVP_POISON_MEMORY=true:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("11 passed"), "{text}");
}

/// `encode_rows` on `g`: rows `ids` of a random n_rows × n_in weight at byte `w_offset`,
/// against `dequantize_row`. Weights without a min term are the same bits; with one (Q4_1,
/// Q5_1, Q4_K, Q5_K) the device may fuse d·q ± m: within 4u·(|w| + |m|). An id past the tensor
/// leaves its row of y (NaN) alone.
fn check_rows(g: &Gpu, ty: GgmlType, n_in: usize, n_rows: usize, ids: &[u32], w_offset: usize) {
    let mut rng = Rng(n_in as u64 * 7919 + n_rows as u64 + w_offset as u64);
    let mut wbytes = Vec::new();
    for _ in 0..n_rows {
        let r: Vec<f32> = (0..n_in).map(|_| rng.normal()).collect();
        wbytes.extend(quantize_row(ty, &r).expect("whole blocks"));
    }
    let row_bytes = wbytes.len() / n_rows;
    let mut wb = vec![0xffu8; w_offset];
    wb.extend_from_slice(&wbytes);
    let w = upload_weight(&g.device, &wb);
    let ibuf = g
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("ids"),
            contents: bytemuck::cast_slice(ids),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let ny = ids.len() * n_in + GUARD;
    let nan = f32::from_bits(0x7fc0_1234);
    let ybuf = g
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("y"),
            contents: bytemuck::cast_slice(&vec![nan; ny]),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        });
    let read = g.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: (ny * 4) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = g.device.create_command_encoder(&Default::default());
    g.tree.encode_rows(
        &g.device,
        &mut enc,
        ty,
        &w,
        w_offset as u64,
        n_in as u32,
        n_rows as u32,
        &ibuf,
        ids.len() as u32,
        &ybuf,
    );
    enc.copy_buffer_to_buffer(&ybuf, 0, &read, 0, (ny * 4) as u64);
    g.queue.submit([enc.finish()]);
    let slice = read.slice(..);
    slice.map_async(wgpu::MapMode::Read, |r| r.expect("map"));
    g.device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    let y: Vec<f32> = bytemuck::cast_slice(&slice.get_mapped_range().expect("mapped")).to_vec();
    let fused = matches!(
        ty,
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K
    );
    let u = f32::EPSILON as f64 / 2.0;
    for (i, &id) in ids.iter().enumerate() {
        let got = &y[i * n_in..(i + 1) * n_in];
        if id as usize >= n_rows {
            assert!(
                got.iter().all(|v| v.to_bits() == nan.to_bits()),
                "{ty}: id {id} past the tensor wrote its row"
            );
            continue;
        }
        let rb = &wbytes[id as usize * row_bytes..(id as usize + 1) * row_bytes];
        let mut want = vec![0.0f32; n_in];
        dequantize_row(ty, rb, &mut want).expect("decode");
        let off = offsets(ty, rb, n_in);
        for k in 0..n_in {
            let (a, b) = (got[k], want[k]);
            let ok = if fused {
                (a as f64 - b as f64).abs() <= 4.0 * u * (b.abs() as f64 + off[k] as f64)
            } else {
                a.to_bits() == b.to_bits()
            };
            assert!(
                ok,
                "{ty} {n_rows}x{n_in} off={w_offset}: row {id} element {k}: device {a:e}, CPU {b:e}"
            );
        }
    }
    for (i, v) in y[ids.len() * n_in..].iter().enumerate() {
        assert_eq!(
            v.to_bits(),
            nan.to_bits(),
            "{ty}: rows wrote guard element {i}"
        );
    }
}

/// The row decoder of every type against the CPU's, element by element: repeated ids, an id
/// past the tensor, odd byte offsets, K not a multiple of 8 (unquantized types); then on a
/// device with 4 KiB bindings (windows of rows and of ids).
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn rows_match_cpu_decoder() {
    let small = open(|l| l.max_storage_buffer_binding_size = 4096);
    for &ty in &TYPES {
        let ks: &[usize] = match ty.block_size() {
            256 => &[256, 768],
            32 => &[96, 256],
            _ => &[37, 256],
        };
        for (j, &k) in ks.iter().enumerate() {
            let ids = [3, 0, 6, 3, 1, 99, 2, 5, 4];
            check_rows(gpu(), ty, k, 7, &ids, [0, 5][j]);
            check_rows(&small, ty, k, 7, &ids, [1, 258][j]);
        }
    }
}

/// Every f16 and bf16 bit pattern (subnormals, infinities, NaNs) decoded on the device as on
/// the CPU: the same bits, NaN for NaN (a device may quieten a NaN's payload on the way).
#[test]
#[cfg_attr(
    not(parity_gpu),
    ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)"
)]
fn every_half_pattern_decodes_as_on_cpu() {
    let g = gpu();
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let bytes: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let n = 1 << 16;
        let w = upload_weight(&g.device, &bytes);
        let ids = g
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("ids"),
                contents: bytemuck::cast_slice(&[0u32]),
                usage: wgpu::BufferUsages::STORAGE,
            });
        let y = g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("y"),
            size: n as u64 * 4,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut enc = g.device.create_command_encoder(&Default::default());
        g.tree
            .encode_rows(&g.device, &mut enc, ty, &w, 0, n, 1, &ids, 1, &y);
        let got = read_back(g, enc, &y);
        let mut want = vec![0.0f32; n as usize];
        dequantize_row(ty, &bytes, &mut want).expect("decode");
        for (h, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{ty} {h:#06x}: device {a:e} ({:#010x}), CPU {b:e} ({:#010x})",
                a.to_bits(),
                b.to_bits()
            );
        }
    }
}

/// Submit `enc` with a copy of `buf` to a mappable buffer; its f32 contents.
fn read_back(g: &Gpu, mut enc: wgpu::CommandEncoder, buf: &wgpu::Buffer) -> Vec<f32> {
    let read = g.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: buf.size(),
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    enc.copy_buffer_to_buffer(buf, 0, &read, 0, buf.size());
    g.queue.submit([enc.finish()]);
    let slice = read.slice(..);
    slice.map_async(wgpu::MapMode::Read, |r| r.expect("map"));
    g.device
        .poll(wgpu::PollType::wait_indefinitely())
        .expect("poll");
    bytemuck::cast_slice(&slice.get_mapped_range().expect("mapped")).to_vec()
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        /// Any supported type, any whole-block K, rows, tokens and byte offset.
        #[test]
        #[cfg_attr(not(parity_gpu), ignore = "no GPU adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)")]
        fn any_shape_matches_cpu(
            t in 0..TYPES.len(),
            blocks in 1usize..12,
            n_out in 1usize..20,
            n_tokens in 1usize..12,
            off in 0usize..40,
            tree in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let g = gpu();
            let ty = TYPES[t];
            let bs = ty.block_size().max(8);
            let mm = if tree { &g.tree } else { g.main() };
            check(g, mm, ty, blocks * bs + if bs == 8 { t % 5 } else { 0 }, n_out, n_tokens, off, seed);
        }
    }
}
