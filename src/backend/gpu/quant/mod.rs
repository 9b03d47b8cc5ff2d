//! Matmuls against weights kept on the device in their GGUF bytes, dequantized inside the
//! shader: `y[T, n_out] = x[T, n_in] · Wᵀ` with f32 activations and f32 accumulation.
//!
//! One WGSL kernel (`matmul.wgsl`) is specialised per weight type (its decoder from
//! `float.wgsl`, `q32.wgsl` or `kquant.wgsl`, all reading bytes through `common.wgsl`), per
//! token tile (1 for decode, [`TILE_TOKENS`] for prefill) and per reduction (`subgroupAdd`
//! where the device has subgroups, else a shared-memory tree).
//!
//! # Accuracy
//! Each weight is decoded with the same f32 operations as the scalar twin in crates/parity-quant
//! (exact, except that the device may fuse `d·q + m` / `d·q − m` into one rounding), and the
//! dot product is summed in another order than the CPU's. Against the CPU's
//! `dequantize → sequential f32 dot` the difference is at most
//! [`sum_order_bound`]`(K, Σ (|w_k| + off_k)·|x_k|)`, `off_k` the magnitude of the block's
//! min (Q4_1/Q5_1: |m|; Q4_K/Q5_K: |dmin|·63; others 0): see that function.

use std::sync::OnceLock;

use wgpu::util::DeviceExt;

use crate::quant::GgmlType;

/// Tokens per weight read in prefill (n_tokens > 1).
pub const TILE_TOKENS: u32 = 8;
/// Output rows per workgroup (`R` in matmul.wgsl).
pub const ROWS_PER_WORKGROUP: u32 = 4;

/// The types [`QuantMatmul`] decodes on the device, in pipeline-table order.
pub const TYPES: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

pub use super::context::Reduction;

const COMMON: &str = include_str!("common.wgsl");
const MATMUL: &str = include_str!("matmul.wgsl");
const FLOAT: &str = include_str!("float.wgsl");
const Q32: &str = include_str!("q32.wgsl");
const KQUANT: &str = include_str!("kquant.wgsl");
const ROWS: &str = include_str!("rows.wgsl");

/// The WGSL decoder of `ty` (its function name and the file that defines it).
fn decoder(ty: GgmlType) -> Option<(&'static str, &'static str)> {
    Some(match ty {
        GgmlType::F32 => ("deq_f32", FLOAT),
        GgmlType::F16 => ("deq_f16", FLOAT),
        GgmlType::BF16 => ("deq_bf16", FLOAT),
        GgmlType::Q8_0 => ("deq_q8_0", Q32),
        GgmlType::Q4_0 => ("deq_q4_0", Q32),
        GgmlType::Q4_1 => ("deq_q4_1", Q32),
        GgmlType::Q5_0 => ("deq_q5_0", Q32),
        GgmlType::Q5_1 => ("deq_q5_1", Q32),
        GgmlType::Q4_K => ("deq_q4_k", KQUANT),
        GgmlType::Q5_K => ("deq_q5_k", KQUANT),
        GgmlType::Q6_K => ("deq_q6_k", KQUANT),
        _ => return None,
    })
}

/// The full WGSL source of one pipeline.
pub fn shader_source(ty: GgmlType, tile_tokens: u32, reduction: Reduction) -> Option<String> {
    let (deq, family) = decoder(ty)?;
    let na = ROWS_PER_WORKGROUP * tile_tokens;
    // No `enable subgroups;`: naga 30 rejects it and takes the builtins when the device has
    // Features::SUBGROUP.
    // Accumulators per reduction: all of them in one round of barriers with subgroups (64·NA
    // floats of shared memory), 8 at a time in the tree (256 floats each: 16 KiB is all a
    // device must offer). Barriers are what a CPU device (lavapipe) pays most for.
    let ch = match reduction {
        Reduction::Subgroup => na,
        Reduction::Tree => na.min(8),
    };
    let mut s = String::new();
    s.push_str(&format!(
        "const TT: u32 = {tile_tokens}u;\nconst CH: u32 = {ch}u;\n"
    ));
    s.push_str(&MATMUL.replace("DEQ(", &format!("{deq}(")));
    s.push_str(COMMON);
    s.push_str(family);
    s.push_str(super::context::reduction_source(reduction));
    Some(s)
}

/// The WGSL source of the row decoder of `ty` ([`QuantMatmul::encode_rows`]).
pub fn rows_source(ty: GgmlType) -> Option<String> {
    let (deq, family) = decoder(ty)?;
    Some([&ROWS.replace("DEQ(", &format!("{deq}(")), COMMON, family].concat())
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RowParams {
    n_in: u32,
    n_rows: u32,
    row0: u32,
    row_bytes: u32,
    w_off: u32,
    n_ids: u32,
    ids_off: u32,
    y_off: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_in: u32,
    n_rows: u32,
    n_tokens: u32,
    row_bytes: u32,
    w_off: u32,
    row0: u32,
    n_out: u32,
    x_off: u32,
    y_off: u32,
    _pad: [u32; 3],
}

/// The quantized-matmul pipelines of one device.
pub struct QuantMatmul {
    pipeline_layout: wgpu::PipelineLayout,
    reduction: Reduction,
    /// `[type][0: decode (1 token), 1: prefill (TILE_TOKENS)]`, compiled on first use unless
    /// `new` compiled them all.
    pipelines: Vec<[OnceLock<wgpu::ComputePipeline>; 2]>,
    /// `[type]`: the row decoders, compiled on first use.
    rows: Vec<OnceLock<wgpu::ComputePipeline>>,
}

impl QuantMatmul {
    /// Pipelines compiled on first use, with the given reduction (`Tree` forces the fallback
    /// on a device that has subgroups). Panics if `Subgroup` is asked of a device without them.
    pub fn lazy(device: &wgpu::Device, reduction: Reduction) -> QuantMatmul {
        assert!(
            reduction == Reduction::Tree || device.features().contains(wgpu::Features::SUBGROUP),
            "subgroup reduction on a device created without Features::SUBGROUP"
        );
        let entry = |binding, ty| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty,
            count: None,
        };
        let storage = |read_only| wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("quant matmul"),
            entries: &[
                entry(
                    0,
                    wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                ),
                entry(1, storage(true)),
                entry(2, storage(true)),
                entry(3, storage(false)),
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("quant matmul"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        QuantMatmul {
            pipeline_layout,
            reduction,
            pipelines: TYPES.iter().map(|_| Default::default()).collect(),
            rows: TYPES.iter().map(|_| Default::default()).collect(),
        }
    }

    /// The reduction these pipelines use.
    pub fn reduction(&self) -> Reduction {
        self.reduction
    }

    pub fn supports(ty: GgmlType) -> bool {
        TYPES.contains(&ty)
    }

    fn index(ty: GgmlType) -> usize {
        TYPES
            .iter()
            .position(|&t| t == ty)
            .unwrap_or_else(|| panic!("quant matmul: {ty} is not decoded on the device"))
    }

    fn compile(&self, device: &wgpu::Device, label: &str, src: String) -> wgpu::ComputePipeline {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        });
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: Some(&self.pipeline_layout),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        })
    }

    fn pipeline(
        &self,
        device: &wgpu::Device,
        ty: GgmlType,
        tile_tokens: u32,
    ) -> &wgpu::ComputePipeline {
        let slot = usize::from(tile_tokens != 1);
        self.pipelines[Self::index(ty)][slot].get_or_init(|| {
            let src = shader_source(ty, tile_tokens, self.reduction).expect("supported type");
            let label = format!("matmul {ty} tt={tile_tokens} {:?}", self.reduction);
            self.compile(device, &label, src)
        })
    }

    /// One dispatch through the device's one path ([`super::context::dispatch`]), the
    /// three (buffer, offset, size) windows bound as 1..=3.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        device: &wgpu::Device,
        enc: &mut wgpu::CommandEncoder,
        pipeline: &wgpu::ComputePipeline,
        params: &[u8],
        windows: [(&wgpu::Buffer, u64, u64); 3],
        groups: u64,
        gz: u64,
    ) {
        let binds = windows.map(|(buffer, offset, size)| wgpu::BufferBinding {
            buffer,
            offset,
            size: std::num::NonZeroU64::new(size),
        });
        super::context::dispatch(device, enc, pipeline, params, &binds, groups, gz);
    }

    /// y[T, n_out] = x[T, n_in] · Wᵀ, W = the tensor's GGUF bytes (uploaded as is, padded to 4
    /// bytes) in `w`; x, y: f32 storage buffers. Records one or more dispatches into `enc`.
    #[allow(clippy::too_many_arguments)]
    pub fn encode(
        &self,
        device: &wgpu::Device,
        enc: &mut wgpu::CommandEncoder,
        ty: GgmlType,
        w: &wgpu::Buffer,
        n_in: u32,
        n_out: u32,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
    ) {
        self.encode_at(device, enc, ty, w, 0, n_in, n_out, x, y, n_tokens)
    }

    /// [`encode`](Self::encode) for a tensor whose bytes start at byte `w_offset` of `w` (any
    /// byte: several tensors may share one buffer). Weights, x and y larger than one binding
    /// (`max_storage_buffer_binding_size`) are bound and dispatched in windows of whole rows
    /// and whole tokens.
    ///
    /// Panics when the shapes do not fit the buffers or one row exceeds a binding: callers check
    /// tensors against the device limits at load (see [`max_row_bytes`]).
    #[allow(clippy::too_many_arguments)]
    pub fn encode_at(
        &self,
        device: &wgpu::Device,
        enc: &mut wgpu::CommandEncoder,
        ty: GgmlType,
        w: &wgpu::Buffer,
        w_offset: u64,
        n_in: u32,
        n_out: u32,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
    ) {
        if n_out == 0 || n_tokens == 0 {
            return;
        }
        let lim = Windows::new(device, ty, w, w_offset, n_in, n_out);
        assert!(
            x.size() >= n_tokens as u64 * n_in as u64 * 4,
            "quant matmul: x too small"
        );
        assert!(
            y.size() >= n_tokens as u64 * n_out as u64 * 4,
            "quant matmul: y too small"
        );
        let tt = if n_tokens == 1 { 1 } else { TILE_TOKENS };
        let pipeline = self.pipeline(device, ty, tt);
        let max_groups = device.limits().max_compute_workgroups_per_dimension.max(1) as u64;
        // Tokens per dispatch: the grid's z, and x's and y's windows within one binding.
        let tok_per_dispatch = (max_groups * tt as u64).min(lim.items(n_in.max(n_out) as u64 * 4));
        let mut r0 = 0u64;
        while r0 < n_out as u64 {
            let nr = lim.rows_per_window.min(n_out as u64 - r0);
            let (w_base, w_size, w_off) =
                lim.window(w, w_offset + r0 * lim.row_bytes, nr * lim.row_bytes);
            let mut t0 = 0u64;
            while t0 < n_tokens as u64 {
                let nt = tok_per_dispatch.min(n_tokens as u64 - t0);
                let xrow = n_in as u64 * 4;
                let (x_base, x_size, x_off) = lim.window(x, t0 * xrow, nt * xrow);
                let yrow = n_out as u64 * 4;
                let (y_base, y_size, y_off) = lim.window(y, t0 * yrow, nt * yrow);
                let params = Params {
                    n_in,
                    n_rows: nr as u32,
                    n_tokens: nt as u32,
                    row_bytes: lim.row_bytes as u32,
                    w_off: w_off as u32,
                    row0: r0 as u32,
                    n_out,
                    x_off: (x_off / 4) as u32,
                    y_off: (y_off / 4) as u32,
                    _pad: [0; 3],
                };
                self.dispatch(
                    device,
                    enc,
                    pipeline,
                    bytemuck::bytes_of(&params),
                    [
                        (w, w_base, w_size),
                        (x, x_base, x_size),
                        (y, y_base, y_size),
                    ],
                    nr.div_ceil(ROWS_PER_WORKGROUP as u64),
                    nt.div_ceil(tt as u64),
                );
                t0 += nt;
            }
            r0 += nr;
        }
    }

    /// Rows of a weight decoded to f32 on the device: `y[i, :] = W[ids[i], :]` for the
    /// `n_ids` u32 row indices in `ids` (an embedding lookup; ids 0..n_rows give the whole
    /// tensor). W: `n_rows` rows of `n_in` elements of type `ty` at byte `w_offset` of `w`.
    /// Each weight is the same f32 the matmul multiplies. An id ≥ n_rows leaves its row of y
    /// as it was (callers check token ids).
    #[allow(clippy::too_many_arguments)]
    pub fn encode_rows(
        &self,
        device: &wgpu::Device,
        enc: &mut wgpu::CommandEncoder,
        ty: GgmlType,
        w: &wgpu::Buffer,
        w_offset: u64,
        n_in: u32,
        n_rows: u32,
        ids: &wgpu::Buffer,
        n_ids: u32,
        y: &wgpu::Buffer,
    ) {
        if n_rows == 0 || n_ids == 0 || n_in == 0 {
            return;
        }
        let lim = Windows::new(device, ty, w, w_offset, n_in, n_rows);
        assert!(ids.size() >= n_ids as u64 * 4, "quant rows: ids too small");
        assert!(
            y.size() >= n_ids as u64 * n_in as u64 * 4,
            "quant rows: y too small"
        );
        let pipeline = self.rows[Self::index(ty)].get_or_init(|| {
            self.compile(
                device,
                &format!("rows {ty}"),
                rows_source(ty).expect("supported type"),
            )
        });
        let units = (n_in as u64).div_ceil(8);
        let max_groups = device.limits().max_compute_workgroups_per_dimension.max(1) as u64;
        // Ids per dispatch: y's window within one binding, and the grid (x·y workgroups of 256).
        let ids_per_dispatch = lim
            .items(n_in as u64 * 4)
            .min(max_groups * max_groups * 256 / units)
            .min(1 << 24);
        let mut r0 = 0u64;
        while r0 < n_rows as u64 {
            let nr = lim.rows_per_window.min(n_rows as u64 - r0);
            let (w_base, w_size, w_off) =
                lim.window(w, w_offset + r0 * lim.row_bytes, nr * lim.row_bytes);
            let mut i0 = 0u64;
            while i0 < n_ids as u64 {
                let ni = ids_per_dispatch.min(n_ids as u64 - i0);
                let (i_base, i_size, i_off) = lim.window(ids, i0 * 4, ni * 4);
                let yrow = n_in as u64 * 4;
                let (y_base, y_size, y_off) = lim.window(y, i0 * yrow, ni * yrow);
                let params = RowParams {
                    n_in,
                    n_rows: nr as u32,
                    row0: r0 as u32,
                    row_bytes: lim.row_bytes as u32,
                    w_off: w_off as u32,
                    n_ids: ni as u32,
                    ids_off: (i_off / 4) as u32,
                    y_off: (y_off / 4) as u32,
                };
                self.dispatch(
                    device,
                    enc,
                    pipeline,
                    bytemuck::bytes_of(&params),
                    [
                        (w, w_base, w_size),
                        (ids, i_base, i_size),
                        (y, y_base, y_size),
                    ],
                    (ni * units).div_ceil(256),
                    1,
                );
                i0 += ni;
            }
            r0 += nr;
        }
    }
}

/// How a tensor is cut into bindings on one device.
struct Windows {
    align: u64,
    max_bind: u64,
    row_bytes: u64,
    rows_per_window: u64,
}

impl Windows {
    fn new(
        device: &wgpu::Device,
        ty: GgmlType,
        w: &wgpu::Buffer,
        w_offset: u64,
        n_in: u32,
        n_rows: u32,
    ) -> Windows {
        let row_bytes = ty
            .bytes_for(n_in as u64)
            .unwrap_or_else(|| panic!("quant matmul: {n_in} is not a whole number of {ty} blocks"));
        assert!(
            w_offset + row_bytes * n_rows as u64 <= w.size(),
            "quant matmul: {n_rows} rows of {row_bytes} bytes at {w_offset} overrun the weight buffer ({} bytes)",
            w.size()
        );
        let limits = device.limits();
        let max_bind = max_binding(&limits);
        assert!(
            row_bytes <= max_row_bytes(&limits),
            "quant matmul: a {ty} row of {row_bytes} bytes exceeds the device's storage binding limit ({max_bind} bytes)"
        );
        let align = limits.min_storage_buffer_offset_alignment as u64;
        Windows {
            align,
            max_bind,
            row_bytes,
            rows_per_window: max_row_bytes(&limits) / row_bytes.max(1),
        }
    }

    /// How many items of `bytes` bytes one binding holds (panics if not one).
    fn items(&self, bytes: u64) -> u64 {
        let n = (self.max_bind - self.align - 4) / bytes.max(1);
        assert!(
            n >= 1,
            "quant matmul: {bytes} bytes of activations exceed the device's storage binding limit ({} bytes)",
            self.max_bind
        );
        n
    }

    /// The binding of `len` bytes at byte `start` of `buf`: (aligned offset, size, offset of
    /// `start` inside it). The size is rounded up to 4 bytes within the buffer.
    fn window(&self, buf: &wgpu::Buffer, start: u64, len: u64) -> (u64, u64, u64) {
        let base = start / self.align * self.align;
        let size = ((start - base + len + 3) & !3).min(buf.size() - base);
        (base, size, start - base)
    }
}

/// The largest storage binding the kernels use: the device's limit, kept below 2³¹ so that
/// byte offsets inside a window fit the shader's u32 arithmetic.
fn max_binding(limits: &wgpu::Limits) -> u64 {
    limits.max_storage_buffer_binding_size.min(1 << 31)
}

/// The largest weight row (in bytes) [`QuantMatmul::encode_at`] accepts on a device with
/// these limits.
pub fn max_row_bytes(limits: &wgpu::Limits) -> u64 {
    max_binding(limits) - limits.min_storage_buffer_offset_alignment as u64 - 4
}

/// A STORAGE | COPY_DST (| COPY_SRC) buffer holding `bytes`, zero-padded to a multiple of 4.
pub fn upload_weight(device: &wgpu::Device, bytes: &[u8]) -> wgpu::Buffer {
    let mut padded;
    let contents = if bytes.len().is_multiple_of(4) && !bytes.is_empty() {
        bytes
    } else {
        padded = bytes.to_vec();
        padded.resize(bytes.len().div_ceil(4).max(1) * 4, 0);
        &padded
    };
    device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("weight"),
        contents,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC,
    })
}

/// u = 2⁻²⁴, the unit roundoff of f32.
const U: f64 = 1.0 / 16_777_216.0;

/// How far the device's `y` may be from the CPU's `dequantize → sequential f32 dot` for one
/// output of a length-`k` dot product, given `mag = Σ (|w_i| + off_i)·|x_i|` (see the module
/// docs for `off`).
///
/// Both sums are within γ_k·Σ|w_i x_i| of the exact dot of their own weights (γ_k =
/// k·u / (1 − k·u): any summation order, products rounded or fused). A weight the device
/// computes as fma(d, q, ±m) instead of fl(fl(d·q) ± m) differs by at most
/// u·|d·q| + 2u·|w| (+u²) ≤ 4u·(|w| + |m|) from the CPU's, which moves the exact dot by
/// 4u·mag and the device's γ_k term by a factor (1 + 4u). Devices that flush subnormals lose
/// at most 2⁻¹²⁶ per operation (2k of them, on each side).
pub fn sum_order_bound(k: usize, mag: f64) -> f64 {
    let k = k as f64;
    let gamma = k * U / (1.0 - k * U);
    (gamma * (2.0 + 4.0 * U) + 4.0 * U) * mag + 4.0 * k * f64::from(f32::MIN_POSITIVE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpu::naga;

    /// Every pipeline's WGSL parses and validates (naga, as wgpu does before any driver sees
    /// it), with and without subgroups: runs on machines without a GPU too.
    #[test]
    fn every_shader_validates() {
        let caps = naga::valid::Capabilities::all();
        for ty in TYPES {
            let mut sources = vec![(format!("rows {ty}"), rows_source(ty).unwrap())];
            for tt in [1, TILE_TOKENS] {
                for red in [Reduction::Subgroup, Reduction::Tree] {
                    sources.push((
                        format!("matmul {ty} tt={tt} {red:?}"),
                        shader_source(ty, tt, red).unwrap(),
                    ));
                }
            }
            for (name, src) in sources {
                let module = naga::front::wgsl::parse_str(&src)
                    .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&src)));
                naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
                    .validate(&module)
                    .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&src)));
            }
        }
        for ty in [GgmlType::Q2_K, GgmlType::IQ4_XS, GgmlType::Q8_1] {
            assert!(!QuantMatmul::supports(ty) && shader_source(ty, 1, Reduction::Tree).is_none());
        }
    }

    #[test]
    fn bound_grows_with_length_and_magnitude() {
        // K = 4096, Σ|w||x| = 100: about 2·4096·2⁻²⁴·100 ≈ 0.049.
        let b = sum_order_bound(4096, 100.0);
        assert!(b > 0.0488 && b < 0.0489, "{b}");
        assert!(sum_order_bound(8192, 100.0) > b && sum_order_bound(4096, 200.0) > b);
    }
}
