//! The device: adapter, limits and features read from it, and the small helpers every kernel
//! uses (pipelines, buffers, one dispatch, read-back).

use std::borrow::Cow;
use wgpu::util::DeviceExt;

/// The one line printed when no adapter exists (the other backends go on without it).
pub const NO_ADAPTER: &str = "no GPU adapter: install a Vulkan driver, e.g. Debian's mesa-vulkan-drivers for a software device";

/// Invocations per workgroup of every kernel: 256 is the most every device must allow.
pub const WG: u32 = 256;

/// How a workgroup adds its invocations' values: the one pair of reductions every kernel
/// that reduces uses (norms, attention, the matmuls).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// `subgroupAdd`, then shared memory across subgroups (needs `Features::SUBGROUP`).
    Subgroup,
    /// A shared-memory tree (any device).
    Tree,
}

/// The WGSL of `r`: `WG`, `struct Lane` (the builtins a reducing entry point takes), the
/// steps of a reduction of `CH` values at once (`red_put`, `red_combine`, `red_total`: the
/// including source declares `CH`), and `wg_sum`, `wg_max` of one value.
pub fn reduction_source(r: Reduction) -> &'static str {
    match r {
        Reduction::Subgroup => include_str!("reduce_subgroup.wgsl"),
        Reduction::Tree => include_str!("reduce_shared.wgsl"),
    }
}

/// The whole WGSL of a kernel file `src` (not a matmul's: see `quant::shader_source`) on a
/// device that reduces by `r`: one value per reduction.
pub fn kernel_source(r: Reduction, src: &str) -> String {
    format!("const CH: u32 = 1u;\n{}\n{src}", reduction_source(r))
}

/// The one way a kernel is dispatched: binding 0 a uniform holding `params` (zero-padded to
/// 16 bytes), bindings 1.. the buffer windows `binds`, and a grid of `groups` workgroups laid
/// over x and y (over y only past the per-dimension limit; kernels recover the linear index
/// as `wid.x + wid.y * nwg.x`), `gz` deep. At least one workgroup is dispatched.
pub fn dispatch(
    device: &wgpu::Device,
    enc: &mut wgpu::CommandEncoder,
    pipe: &wgpu::ComputePipeline,
    params: &[u8],
    binds: &[wgpu::BufferBinding],
    groups: u64,
    gz: u64,
) {
    let max = u64::from(device.limits().max_compute_workgroups_per_dimension.max(1));
    let gx = groups.clamp(1, max);
    let gy = groups.div_ceil(gx).max(1);
    assert!(
        gy <= max && gz <= max,
        "a grid of {groups}×{gz} workgroups exceeds the device's limits"
    );
    let mut words = params.to_vec();
    words.resize(params.len().div_ceil(16).max(1) * 16, 0);
    let uni = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: &words,
        usage: wgpu::BufferUsages::UNIFORM,
    });
    let mut entries = vec![wgpu::BindGroupEntry {
        binding: 0,
        resource: uni.as_entire_binding(),
    }];
    for (i, b) in binds.iter().enumerate() {
        entries.push(wgpu::BindGroupEntry {
            binding: i as u32 + 1,
            resource: wgpu::BindingResource::Buffer(b.clone()),
        });
    }
    let bg = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipe.get_bind_group_layout(0),
        entries: &entries,
    });
    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
    pass.set_pipeline(pipe);
    pass.set_bind_group(0, &bg, &[]);
    pass.dispatch_workgroups(gx as u32, gy as u32, gz as u32);
}

/// What `parity gpu` prints and the kernels are built for.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub adapter: String,
    pub driver: String,
    pub driver_info: String,
    pub api: String,
    pub device_type: String,
    pub max_binding: u64,
    pub max_buffer: u64,
    pub workgroup_storage: u32,
    pub max_invocations: u32,
    pub max_groups_per_dim: u32,
    /// Subgroup size range (min, max) the adapter reports; (0, 0) when it has none.
    pub subgroup: (u32, u32),
    /// The reductions use subgroup ops (else the shared-memory fallback).
    pub subgroups: bool,
    pub f16: bool,
    /// What the driver wrote on stderr while the device was opened (shown by `parity gpu`,
    /// never as parity's own lines).
    pub driver_log: String,
}

pub struct Context {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: GpuInfo,
}

/// The adapter a context would use, as `check` needs to know it before building anything.
pub enum Probe {
    /// A hardware GPU (discrete, integrated or virtual): its name.
    Hardware(String),
    /// Only a device that runs on the CPU (lavapipe/llvmpipe, SwiftShader, WARP): its name.
    Software(String),
    /// No adapter at all: the line to print.
    Missing(String),
}

/// Which adapter `check`'s default set would run on, without opening a device. Whatever the
/// driver writes on stderr meanwhile is swallowed (see `quiet_stderr`).
pub fn probe() -> Probe {
    let (picked, _) = quiet_stderr(|| pick_adapter(&instance()).map(|a| a.get_info()));
    match picked {
        None => Probe::Missing(NO_ADAPTER.to_string()),
        Some(i) if i.device_type == wgpu::DeviceType::Cpu => Probe::Software(i.name),
        Some(i) => Probe::Hardware(i.name),
    }
}

fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    })
}

/// The adapter to use: a discrete GPU before an integrated one, before a virtual one, before
/// anything else, a device running on the CPU last (wgpu's own high-performance choice can
/// return lavapipe while a real GPU is present).
fn pick_adapter(instance: &wgpu::Instance) -> Option<wgpu::Adapter> {
    let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    };
    let all = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    all.into_iter().min_by_key(rank)
}

/// Runs `f` with this process's stderr (fd 2) sent to a pipe and returns what was written
/// there: Vulkan drivers print their own lines (Mesa's `error: XDG_RUNTIME_DIR is invalid or
/// not set in the environment.`), which must not read as parity's errors. Where the pipe
/// cannot be made, `f` runs with stderr as it is.
pub fn quiet_stderr<T>(f: impl FnOnce() -> T) -> (T, String) {
    #[cfg(unix)]
    {
        use std::io::Read;
        use std::os::fd::FromRawFd;
        let mut fds = [0; 2];
        // SAFETY: plain fd calls; every fd made here is closed or handed to a File.
        let saved = unsafe {
            if libc::pipe(fds.as_mut_ptr()) != 0 {
                return (f(), String::new());
            }
            let saved = libc::dup(2);
            if saved < 0 || libc::dup2(fds[1], 2) < 0 {
                libc::close(fds[0]);
                libc::close(fds[1]);
                if saved >= 0 {
                    libc::close(saved);
                }
                return (f(), String::new());
            }
            libc::close(fds[1]);
            saved
        };
        // SAFETY: fds[0] is ours alone from here.
        let mut pipe = unsafe { std::fs::File::from_raw_fd(fds[0]) };
        // Read while `f` runs: a driver that writes more than the pipe holds must not block.
        let reader = std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.by_ref().take(1 << 16).read_to_end(&mut text);
            let _ = std::io::copy(&mut pipe, &mut std::io::sink());
            text
        });
        let out = f();
        // SAFETY: put fd 2 back; that closes the pipe's last write end (unless the driver
        // kept a copy: then the reader ends when the process does, and is not waited for).
        unsafe {
            libc::dup2(saved, 2);
            libc::close(saved);
        }
        let text = if reader.is_finished() || wait_briefly(&reader) {
            reader.join().unwrap_or_default()
        } else {
            Vec::new()
        };
        (out, String::from_utf8_lossy(&text).trim_end().to_string())
    }
    #[cfg(not(unix))]
    {
        (f(), String::new())
    }
}

#[cfg(unix)]
fn wait_briefly<T>(h: &std::thread::JoinHandle<T>) -> bool {
    for _ in 0..100 {
        if h.is_finished() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    h.is_finished()
}

impl Context {
    /// The adapter `pick_adapter` prefers (a device on the CPU only when there is nothing
    /// else), with the adapter's own limits (not wgpu's conservative defaults: a 128 MiB
    /// binding would refuse real models). The driver's stderr is kept in `info.driver_log`.
    /// `PARITY_GPU_NO_SUBGROUPS=1` forces the shared-memory reductions (tests use it).
    pub fn new() -> Result<Context, String> {
        let (cx, log) = quiet_stderr(Context::open);
        let mut cx = cx?;
        cx.info.driver_log = log;
        Ok(cx)
    }

    fn open() -> Result<Context, String> {
        let adapter = pick_adapter(&instance()).ok_or_else(|| NO_ADAPTER.to_string())?;
        let feats = adapter.features();
        let no_sg = std::env::var_os("PARITY_GPU_NO_SUBGROUPS").is_some_and(|v| v == "1");
        let subgroups = feats.contains(wgpu::Features::SUBGROUP) && !no_sg;
        let f16 = feats.contains(wgpu::Features::SHADER_F16);
        let mut want = wgpu::Features::empty();
        if subgroups {
            want |= wgpu::Features::SUBGROUP;
        }
        if f16 {
            want |= wgpu::Features::SHADER_F16;
        }
        let mut limits = adapter.limits();
        // Test-only knobs: a smaller binding or buffer than the adapter's, so that the
        // windowed binding of large weights and the one-line refusal run on a small model.
        let knob = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        if let Some(b) = knob("PARITY_GPU_TEST_MAX_BINDING") {
            limits.max_storage_buffer_binding_size = limits.max_storage_buffer_binding_size.min(b);
        }
        if let Some(b) = knob("PARITY_GPU_TEST_MAX_BUFFER") {
            limits.max_buffer_size = limits.max_buffer_size.min(b);
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("parity"),
            required_features: want,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| format!("GPU device: {e}"))?;
        let a = adapter.get_info();
        let info = GpuInfo {
            adapter: a.name.clone(),
            driver: a.driver.clone(),
            driver_info: a.driver_info.clone(),
            api: format!("{:?}", a.backend),
            device_type: format!("{:?}", a.device_type),
            max_binding: limits.max_storage_buffer_binding_size,
            max_buffer: limits.max_buffer_size,
            workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_invocations: limits.max_compute_invocations_per_workgroup,
            max_groups_per_dim: limits.max_compute_workgroups_per_dimension,
            subgroup: (a.subgroup_min_size, a.subgroup_max_size),
            subgroups,
            f16,
            driver_log: String::new(),
        };
        if info.max_invocations < WG {
            return Err(format!(
                "GPU adapter {} allows {} invocations per workgroup; parity's kernels need {WG}",
                info.adapter, info.max_invocations
            ));
        }
        Ok(Context {
            device,
            queue,
            info,
        })
    }

    /// How this device's kernels reduce over a workgroup.
    pub fn reduction(&self) -> Reduction {
        match self.info.subgroups {
            true => Reduction::Subgroup,
            false => Reduction::Tree,
        }
    }

    /// A compute pipeline for `entry` of the WGSL `src` (one value per reduction: `CH` = 1),
    /// with this device's reduction (`reduction_source`) prepended.
    pub fn pipeline(&self, src: &str, entry: &str) -> wgpu::ComputePipeline {
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(entry),
                source: wgpu::ShaderSource::Wgsl(Cow::Owned(kernel_source(self.reduction(), src))),
            });
        self.device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
    }

    /// An f32 storage buffer of `n` elements (at least one: zero-sized bindings are invalid).
    pub fn buffer(&self, n: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (n.max(1) * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `data`.
    pub fn upload(&self, data: &[f32]) -> wgpu::Buffer {
        let one = [0.0f32];
        let data = if data.is_empty() { &one[..] } else { data };
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
            })
    }

    /// Record one dispatch of `pipe` into `enc` (see [`dispatch`]): `params` as u32 words
    /// (f32 given by `to_bits`), `bufs` bound whole, `groups` workgroups.
    pub fn dispatch(
        &self,
        enc: &mut wgpu::CommandEncoder,
        pipe: &wgpu::ComputePipeline,
        params: &[u32],
        bufs: &[&wgpu::Buffer],
        groups: u32,
    ) {
        let binds: Vec<_> = bufs.iter().map(|b| b.as_entire_buffer_binding()).collect();
        dispatch(
            &self.device,
            enc,
            pipe,
            bytemuck::cast_slice(params),
            &binds,
            groups.into(),
            1,
        );
    }

    /// Submit `enc` and read `n` f32 from `buf` at element `offset`.
    pub fn read(
        &self,
        mut enc: wgpu::CommandEncoder,
        buf: &wgpu::Buffer,
        offset: usize,
        n: usize,
    ) -> Vec<f32> {
        if n == 0 {
            self.queue.submit([enc.finish()]);
            return Vec::new();
        }
        let size = (n * 4) as u64;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        enc.copy_buffer_to_buffer(buf, (offset * 4) as u64, &staging, 0, size);
        self.queue.submit([enc.finish()]);
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .expect("GPU device lost while waiting");
        rx.recv()
            .expect("map callback")
            .expect("GPU read-back failed");
        let out = {
            let view = slice.get_mapped_range().expect("mapped above");
            bytemuck::cast_slice::<u8, f32>(&view).to_vec()
        };
        staging.unmap();
        out
    }

    pub fn encoder(&self) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor::default())
    }
}
