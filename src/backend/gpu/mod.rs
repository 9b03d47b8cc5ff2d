//! The gpu backend: the same forward (`arch::transformer`) on the machine's GPU through wgpu
//! (Vulkan, Metal, DX12), one WGSL file per op family. Activations stay on the device as
//! plain f32 (`Emulation::None`, like `reference`); weights are uploaded once, on first use,
//! and stay resident; the K/V cache lives on the device. Nothing is read back except the last
//! logits row and the taps a sink wants or replays (op by op uploads the replayed tensor).
//!
//! Matmul weights of the types [`quant::QuantMatmul`] decodes (F32, F16, BF16, Q8_0, Q4_0,
//! Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are uploaded as their GGUF bytes and dequantized inside
//! the shader; any other type is dequantized to f32 at load (listed by [`Gpu::dequantized`])
//! and multiplied by the same kernel as F32. A weight larger than one binding is bound in
//! windows of whole rows; one larger than one buffer, or a row larger than one binding, is
//! refused in one line. RoPE's cos/sin table is computed on the host as ggml's rope cache
//! (WGSL only promises sin/cos to 2^-11), the rotation on the device.

pub mod context;
pub mod kernels;
pub mod quant;
#[cfg(feature = "gpu-test-bugs")]
pub mod test_bugs;

use super::{Backend, BackendError, Emulation};
use crate::arch::{self, Attn, Ops, Rope};
use crate::gguf::{GgmlType, TensorInfo};
use crate::model::{Activation, Model, RopeType};
use crate::trace::{Sink, TapKey};
use context::Context;
use kernels::Kernels;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
#[cfg(feature = "gpu-test-bugs")]
use test_bugs::GpuBug;

/// An activation on the device: `len` f32.
pub struct GpuBuf {
    buf: wgpu::Buffer,
    len: usize,
}

/// The device and its compiled kernels, made once per process: `check` builds the backend
/// for each pass, and compiling the kernels is most of a small model's run on a software
/// device.
fn device() -> Result<Arc<(Context, Kernels)>, BackendError> {
    static DEVICE: OnceLock<Result<Arc<(Context, Kernels)>, String>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let cx = Context::new()?;
            let k = Kernels::new(&cx)?;
            Ok(Arc::new((cx, k)))
        })
        .clone()
        .map_err(BackendError::Gpu)
}

pub struct Gpu<'m> {
    model: &'m Model,
    dev: Arc<(Context, Kernels)>,
    n_ctx: usize,
    /// Norm weights, biases (and a test bug's matmul weights) as f32, by data
    /// offset, uploaded on first use.
    weights: HashMap<u64, wgpu::Buffer>,
    /// Matmul weights by data offset, uploaded on first use: the type the shader decodes
    /// (the GGUF type, or F32 for a type dequantized at load) and the bytes.
    mats: HashMap<u64, (GgmlType, wgpu::Buffer)>,
    /// Matmul weights dequantized to f32 at load (names), for `check` to report.
    dequantized: Vec<String>,
    k_cache: Vec<wgpu::Buffer>,
    v_cache: Vec<wgpu::Buffer>,
    /// Commands recorded since the last submit.
    enc: Option<wgpu::CommandEncoder>,
    last_logits: Vec<f32>,
    /// The broken kernel a test planted, from which layer on.
    #[cfg(feature = "gpu-test-bugs")]
    bug: Option<(GpuBug, usize)>,
}

/// The layer a GGUF tensor belongs to (`blk.N.…`).
#[cfg(feature = "gpu-test-bugs")]
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

impl<'m> Gpu<'m> {
    /// A gpu backend over `model` with room for `n_ctx` positions. Fails with one line when
    /// there is no adapter, or when a weight (as the kernels read it) exceeds one binding.
    pub fn new(model: &'m Model, n_ctx: usize) -> Result<Gpu<'m>, BackendError> {
        let dev = device()?;
        let cx = &dev.0;
        let c = &model.config;
        let n_ctx = n_ctx.min(c.n_ctx_train).max(1);
        // Matmul weights are bound in windows of whole rows: a tensor must fit one buffer
        // and a row one binding. Everything else is bound whole.
        let max_row = quant::max_row_bytes(&cx.device.limits());
        let mut mats: Vec<&TensorInfo> = vec![&model.output];
        for w in &model.layers {
            mats.extend([&w.wq, &w.wk, &w.wv, &w.wo, &w.w_gate, &w.w_up, &w.w_down]);
        }
        for t in mats {
            let (n_in, _) = t.rows();
            let (ty, row) = match quant::QuantMatmul::supports(t.ty) {
                true => (t.ty, t.ty.bytes_for(n_in as u64).unwrap_or(u64::MAX)),
                false => (GgmlType::F32, n_in as u64 * 4),
            };
            let bytes = t.rows().1 as u64 * row;
            if bytes > cx.info.max_buffer {
                return Err(BackendError::Gpu(format!(
                    "tensor {} needs {bytes} bytes as {ty} on the GPU, more than one buffer allows ({} bytes on {})",
                    t.name, cx.info.max_buffer, cx.info.adapter
                )));
            }
            if row > max_row {
                return Err(BackendError::Gpu(format!(
                    "tensor {}: a row of {row} bytes as {ty} is more than one binding allows ({max_row} bytes on {})",
                    t.name, cx.info.adapter
                )));
            }
        }
        let max = cx.info.max_binding.min(cx.info.max_buffer);
        let kv = n_ctx * c.n_embd_kv();
        if (kv * 4) as u64 > max {
            return Err(BackendError::Gpu(format!(
                "the K/V cache of one layer needs {} bytes, more than one binding allows ({max} bytes)",
                kv * 4
            )));
        }
        let k_cache = (0..c.n_layer).map(|_| cx.buffer(kv)).collect();
        let v_cache = (0..c.n_layer).map(|_| cx.buffer(kv)).collect();
        Ok(Gpu {
            model,
            dev: dev.clone(),
            n_ctx,
            weights: HashMap::new(),
            mats: HashMap::new(),
            dequantized: Vec::new(),
            k_cache,
            v_cache,
            enc: None,
            last_logits: Vec::new(),
            #[cfg(feature = "gpu-test-bugs")]
            bug: GpuBug::planted(),
        })
    }

    pub fn info(&self) -> &context::GpuInfo {
        &self.dev.0.info
    }

    /// Matmul weights held as f32 on the device because no kernel reads their type directly.
    pub fn dequantized(&self) -> &[String] {
        &self.dequantized
    }

    #[cfg(feature = "gpu-test-bugs")]
    fn bugged(&self, b: GpuBug, layer: Option<usize>) -> bool {
        self.bug
            .is_some_and(|(x, from)| x == b && layer.is_none_or(|l| l >= from))
    }

    fn enc(&mut self) -> &mut wgpu::CommandEncoder {
        let cx = &self.dev.0;
        self.enc.get_or_insert_with(|| cx.encoder())
    }

    /// A norm weight's or bias's device buffer (f32), uploaded on first use.
    fn weight(&mut self, w: &TensorInfo) -> &wgpu::Buffer {
        if !self.weights.contains_key(&w.offset) {
            let buf = self.dev.0.upload(&self.dequantize(w));
            self.weights.insert(w.offset, buf);
        }
        &self.weights[&w.offset]
    }

    /// A matmul weight on the device, uploaded on first use: its GGUF bytes when the shader
    /// decodes its type, else f32 dequantized on the host (and listed).
    fn mat(&mut self, w: &TensorInfo) -> (GgmlType, &wgpu::Buffer) {
        if !self.mats.contains_key(&w.offset) {
            let dev = &self.dev.0.device;
            let m = if quant::QuantMatmul::supports(w.ty) {
                (w.ty, quant::upload_weight(dev, self.model.data(w)))
            } else {
                self.dequantized.push(w.name.clone());
                (GgmlType::F32, self.dev.0.upload(&self.dequantize(w)))
            };
            self.mats.insert(w.offset, m);
        }
        let (ty, buf) = &self.mats[&w.offset];
        (*ty, buf)
    }

    fn dequantize(&self, w: &TensorInfo) -> Vec<f32> {
        let (n_in, rows) = w.rows();
        let mut data = vec![0.0f32; n_in * rows];
        for (r, row) in data.chunks_mut(n_in.max(1)).enumerate() {
            self.model.row(w, r, row);
        }
        data
    }

    /// Read `x` back (submitting what is pending).
    fn read(&mut self, x: &GpuBuf, offset: usize, n: usize) -> Vec<f32> {
        let enc = self.enc.take().unwrap_or_else(|| self.dev.0.encoder());
        self.dev.0.read(enc, &x.buf, offset, n)
    }

    fn new_buf(&self, n: usize) -> GpuBuf {
        GpuBuf {
            buf: self.dev.0.buffer(n),
            len: n,
        }
    }

    /// The whole of `x` on the host (tests, taps).
    pub fn to_host(&mut self, x: &GpuBuf) -> Vec<f32> {
        self.read(x, 0, x.len)
    }

    /// `data` on the device (tests).
    pub fn from_host(&self, data: &[f32]) -> GpuBuf {
        GpuBuf {
            buf: self.dev.0.upload(data),
            len: data.len(),
        }
    }

    /// `(cos, sin)` · attn_factor for positions `pos0..pos0 + t`, `[t, n_rot/2, 2]`, as
    /// `reference::rope` computes them (ggml's rope cache: the angle by repeated products).
    fn rope_table(&self, t: usize, pos0: usize, r: &Rope) -> Vec<f32> {
        let half = r.n_rot / 2;
        let factors = r.factors.map(|f| self.model.vector(f));
        let theta_scale = r.base.powf(-2.0 / r.n_rot as f32);
        let mut out = Vec::with_capacity(t * half * 2);
        for i in 0..t {
            let mut theta = (pos0 + i) as f32;
            for k in 0..half {
                let ff = factors.as_ref().map_or(1.0, |f| f[k]);
                let th = r.freq_scale * (theta / ff);
                out.push(th.cos() * r.attn_factor);
                out.push(th.sin() * r.attn_factor);
                theta *= theta_scale;
            }
        }
        out
    }
}

impl Backend for Gpu<'_> {
    fn name(&self) -> String {
        "gpu".into()
    }

    fn rounding(&self) -> Emulation {
        Emulation::None
    }

    fn reset(&mut self) {
        // Positions past pos0 + T are never read (attention sees only what was stored), so
        // the cache need not be cleared; clearing keeps a poisoned-memory run honest anyway.
        let mut enc = self.dev.0.encoder();
        for b in self.k_cache.iter().chain(&self.v_cache) {
            enc.clear_buffer(b, 0, None);
        }
        self.dev.0.queue.submit([enc.finish()]);
    }

    fn notes(&self) -> Vec<String> {
        let mut v = vec![format!(
            "gpu: {} ({}, {})",
            self.dev.0.info.adapter, self.dev.0.info.api, self.dev.0.info.driver
        )];
        if !self.dequantized.is_empty() {
            v.push(format!(
                "gpu: dequantized to f32 at load: {}",
                self.dequantized.join(", ")
            ));
        }
        v
    }

    fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        step: usize,
        sink: &mut dyn Sink,
    ) -> Result<&[f32], BackendError> {
        let m = self.model;
        super::check_inputs(&m.config, tokens, pos0, self.n_ctx)?;
        // The elementwise, norm and attention kernels bind their activations whole.
        let c = &m.config;
        let t = tokens.len();
        let widest = [c.n_vocab, c.n_ff, c.n_embd, c.n_embd_q()]
            .into_iter()
            .max()
            .unwrap_or(0)
            .max(c.n_head * (pos0 + t))
            * t
            * 4;
        let max = self.dev.0.info.max_binding.min(self.dev.0.info.max_buffer);
        if widest as u64 > max {
            return Err(BackendError::Gpu(format!(
                "a forward of {t} tokens from position {pos0} needs an activation of {widest} bytes, more than one binding allows ({max} bytes on {})",
                self.dev.0.info.adapter
            )));
        }
        let logits = arch::transformer::forward(m, self, tokens, pos0, step, sink);
        let nv = m.config.n_vocab;
        self.last_logits = self.read(&logits, logits.len - nv, nv);
        Ok(&self.last_logits)
    }
}

impl Ops for Gpu<'_> {
    type Buf = GpuBuf;

    fn embed(&mut self, w: &TensorInfo, tokens: &[u32]) -> GpuBuf {
        // Rows decoded on the host: the embedding is a gather, not worth a kernel per type.
        let e = w.rows().0;
        let mut x = vec![0.0f32; tokens.len() * e];
        for (row, &id) in x.chunks_mut(e).zip(tokens) {
            self.model.row(w, id as usize, row);
        }
        self.from_host(&x)
    }

    fn scale(&mut self, x: GpuBuf, s: f32) -> GpuBuf {
        let (cx, k) = (&self.dev.0, &self.dev.1);
        let enc = self.enc.get_or_insert_with(|| cx.encoder());
        k.scale(cx, enc, &x.buf, x.len, s);
        x
    }

    fn rms_norm(&mut self, x: &GpuBuf, w: &TensorInfo, eps: f32) -> GpuBuf {
        let n = w.rows().0;
        let y = self.new_buf(x.len);
        #[cfg(feature = "gpu-test-bugs")]
        let tail = self.bugged(GpuBug::ReductionTail, layer_of(&w.name));
        self.weight(w);
        self.enc();
        let (cx, k, wb) = (&self.dev.0, &self.dev.1, &self.weights[&w.offset]);
        let enc = self.enc.as_mut().expect("made above");
        #[cfg(feature = "gpu-test-bugs")]
        if tail {
            let pipe = k.bugs.rms_norm_tail(cx);
            k.rms_norm_with(pipe, cx, enc, &x.buf, wb, &y.buf, n, x.len / n, eps);
            return y;
        }
        k.rms_norm(cx, enc, &x.buf, wb, &y.buf, n, x.len / n, eps);
        y
    }

    fn head_norm(&mut self, x: GpuBuf, w: &TensorInfo, eps: f32) -> GpuBuf {
        self.rms_norm(&x, w, eps)
    }

    fn matmul(&mut self, w: &TensorInfo, x: &GpuBuf) -> GpuBuf {
        let (n_in, n_out) = w.rows();
        let t = x.len / n_in;
        let y = self.new_buf(t * n_out);
        #[cfg(feature = "gpu-test-bugs")]
        if self.bugged(GpuBug::MatmulTransposed, layer_of(&w.name)) {
            // The broken kernel: an f32 copy of W read transposed.
            self.weight(w);
            self.enc();
            let (cx, k, wb) = (&self.dev.0, &self.dev.1, &self.weights[&w.offset]);
            let enc = self.enc.as_mut().expect("made above");
            k.bugs
                .matmul_transposed(cx, enc, wb, &x.buf, &y.buf, n_in, n_out, t);
            return y;
        }
        self.mat(w);
        self.enc();
        let (cx, k) = (&self.dev.0, &self.dev.1);
        let (ty, wb) = &self.mats[&w.offset];
        let enc = self.enc.as_mut().expect("made above");
        k.quant.encode(
            &cx.device,
            enc,
            *ty,
            wb,
            n_in as u32,
            n_out as u32,
            &x.buf,
            &y.buf,
            t as u32,
        );
        y
    }

    fn add_bias(&mut self, x: GpuBuf, b: &TensorInfo) -> GpuBuf {
        self.weight(b);
        self.enc();
        let (cx, k, bb) = (&self.dev.0, &self.dev.1, &self.weights[&b.offset]);
        let enc = self.enc.as_mut().expect("made above");
        k.add_bias(cx, enc, &x.buf, bb, x.len, b.rows().0);
        x
    }

    #[cfg_attr(not(feature = "gpu-test-bugs"), allow(unused_variables))]
    fn rope(&mut self, x: GpuBuf, layer: usize, pos0: usize, n_heads: usize, r: &Rope) -> GpuBuf {
        let t = x.len / (n_heads * r.head_dim);
        let table = self.rope_table(t, pos0, r);
        let cs = self.dev.0.upload(&table);
        #[allow(unused_mut)]
        let mut neox = r.kind == RopeType::Neox;
        #[cfg(feature = "gpu-test-bugs")]
        if self.bugged(GpuBug::RopePairs, Some(layer)) {
            neox = !neox;
        }
        let (cx, k) = (&self.dev.0, &self.dev.1);
        let enc = self.enc.get_or_insert_with(|| cx.encoder());
        k.rope(cx, enc, &x.buf, &cs, t, n_heads, r.head_dim, r.n_rot, neox);
        x
    }

    fn kv_store(&mut self, layer: usize, pos0: usize, k: &GpuBuf, v: &GpuBuf) {
        let ekv = self.model.config.n_embd_kv();
        let off = (pos0 * ekv * 4) as u64;
        let size = (k.len * 4) as u64;
        let (kc, vc) = (&self.k_cache[layer], &self.v_cache[layer]);
        let cx = &self.dev.0;
        let enc = self.enc.get_or_insert_with(|| cx.encoder());
        enc.copy_buffer_to_buffer(&k.buf, 0, kc, off, size);
        enc.copy_buffer_to_buffer(&v.buf, 0, vc, off, size);
    }

    fn attn_probs(&mut self, layer: usize, q: &GpuBuf, a: &Attn) -> GpuBuf {
        let out = self.new_buf(a.n_head * a.n_tokens * a.n_kv());
        let (cx, k) = (&self.dev.0, &self.dev.1);
        let enc = self.enc.get_or_insert_with(|| cx.encoder());
        k.probs(cx, enc, a, &q.buf, &self.k_cache[layer], &out.buf);
        out
    }

    fn attn_values(&mut self, layer: usize, p: &GpuBuf, a: &Attn) -> GpuBuf {
        let out = self.new_buf(a.n_tokens * a.n_head * a.head_dim);
        let (cx, k) = (&self.dev.0, &self.dev.1);
        let enc = self.enc.get_or_insert_with(|| cx.encoder());
        k.values(cx, enc, a, &p.buf, &self.v_cache[layer], &out.buf);
        out
    }

    fn glu(&mut self, gate: GpuBuf, up: &GpuBuf, act: Activation) -> GpuBuf {
        let gelu = act == Activation::GeluTanh;
        let (cx, k) = (&self.dev.0, &self.dev.1);
        let enc = self.enc.get_or_insert_with(|| cx.encoder());
        k.glu(cx, enc, &gate.buf, &up.buf, gate.len, gelu);
        gate
    }

    fn add(&mut self, a: GpuBuf, b: &GpuBuf) -> GpuBuf {
        let (cx, k) = (&self.dev.0, &self.dev.1);
        let enc = self.enc.get_or_insert_with(|| cx.encoder());
        k.add(cx, enc, &a.buf, &b.buf, a.len);
        a
    }

    fn softcap(&mut self, x: GpuBuf, cap: f32) -> GpuBuf {
        let (cx, k) = (&self.dev.0, &self.dev.1);
        let enc = self.enc.get_or_insert_with(|| cx.encoder());
        k.softcap(cx, enc, &x.buf, x.len, cap);
        x
    }

    fn last_row(&mut self, x: GpuBuf, width: usize) -> GpuBuf {
        let y = self.new_buf(width);
        let off = ((x.len - width) * 4) as u64;
        self.enc()
            .copy_buffer_to_buffer(&x.buf, off, &y.buf, 0, (width * 4) as u64);
        y
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn tap(&mut self, sink: &mut dyn Sink, key: TapKey, shape: &[usize], x: &mut GpuBuf) {
        let (wants, replays) = (sink.wants(&key), sink.replays(&key));
        if !wants && !replays {
            return;
        }
        let mut data = self.to_host(x);
        if wants {
            sink.record(key, shape, &data);
        }
        if sink.substitute(&key, &mut data) {
            // Everything recorded so far was submitted by the read: the next commands see it.
            self.dev
                .0
                .queue
                .write_buffer(&x.buf, 0, bytemuck::cast_slice(&data));
        }
    }
}
