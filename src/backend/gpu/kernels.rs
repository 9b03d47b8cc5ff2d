//! The compiled kernels, one WGSL file per op family beside this file, and how each op is
//! dispatched: its parameters (binding 0) and its buffers (bindings 1..).

use super::context::{Context, WG};
use super::quant::QuantMatmul;
use wgpu::{Buffer, CommandEncoder, ComputePipeline};

pub struct Kernels {
    rms_norm: ComputePipeline,
    scale: ComputePipeline,
    softcap: ComputePipeline,
    add: ComputePipeline,
    add_bias: ComputePipeline,
    glu: ComputePipeline,
    rope: ComputePipeline,
    probs: ComputePipeline,
    values: ComputePipeline,
    /// Every matmul: weights in their GGUF bytes, decoded in the shader.
    pub quant: QuantMatmul,
    /// The tests' broken kernels (feature `gpu-test-bugs`).
    #[cfg(feature = "gpu-test-bugs")]
    pub bugs: super::test_bugs::BugKernels,
}

const NORM: &str = include_str!("norm.wgsl");
const ELEMENTWISE: &str = include_str!("elementwise.wgsl");
const ROPE: &str = include_str!("rope.wgsl");
const ATTENTION: &str = include_str!("attention.wgsl");

fn f(x: f32) -> u32 {
    x.to_bits()
}

/// Workgroups for `n` invocations of one element each.
fn groups(n: usize) -> u32 {
    (n as u32).div_ceil(WG)
}

impl Kernels {
    /// Compile every kernel; a driver that refuses one is one line, not a panic.
    pub fn new(cx: &Context) -> Result<Kernels, String> {
        let scope = cx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let k = Kernels {
            rms_norm: cx.pipeline(NORM, "rms_norm"),
            scale: cx.pipeline(ELEMENTWISE, "scale"),
            softcap: cx.pipeline(ELEMENTWISE, "softcap"),
            add: cx.pipeline(ELEMENTWISE, "add"),
            add_bias: cx.pipeline(ELEMENTWISE, "add_bias"),
            glu: cx.pipeline(ELEMENTWISE, "glu"),
            rope: cx.pipeline(ROPE, "rope"),
            probs: cx.pipeline(ATTENTION, "probs"),
            values: cx.pipeline(ATTENTION, "values"),
            // Compiled on first use: a model needs two pipelines per weight type it has.
            quant: QuantMatmul::lazy(&cx.device, cx.reduction()),
            #[cfg(feature = "gpu-test-bugs")]
            bugs: Default::default(),
        };
        match pollster::block_on(scope.pop()) {
            None => Ok(k),
            Some(e) => Err(format!(
                "GPU kernels do not compile on {}: {}",
                cx.info.adapter,
                e.to_string().replace('\n', " ")
            )),
        }
    }

    /// RMSNorm of `rows` rows of width `n` in `x` into `y`, times `w` [n].
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        cx: &Context,
        enc: &mut CommandEncoder,
        x: &Buffer,
        w: &Buffer,
        y: &Buffer,
        n: usize,
        rows: usize,
        eps: f32,
    ) {
        self.rms_norm_with(&self.rms_norm, cx, enc, x, w, y, n, rows, eps);
    }

    /// [`rms_norm`](Self::rms_norm) through `pipe` (the real kernel, or a test's broken one).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_with(
        &self,
        pipe: &ComputePipeline,
        cx: &Context,
        enc: &mut CommandEncoder,
        x: &Buffer,
        w: &Buffer,
        y: &Buffer,
        n: usize,
        rows: usize,
        eps: f32,
    ) {
        let p = [n as u32, rows as u32, f(eps)];
        cx.dispatch(enc, pipe, &p, &[x, w, y], rows as u32);
    }

    /// `x · s` in place (`dummy` fills the unused binding).
    pub fn scale(&self, cx: &Context, enc: &mut CommandEncoder, x: &Buffer, n: usize, s: f32) {
        let dummy = cx.buffer(1);
        cx.dispatch(
            enc,
            &self.scale,
            &[n as u32, 0, f(s)],
            &[x, &dummy],
            groups(n),
        );
    }

    pub fn softcap(&self, cx: &Context, enc: &mut CommandEncoder, x: &Buffer, n: usize, cap: f32) {
        let dummy = cx.buffer(1);
        cx.dispatch(
            enc,
            &self.softcap,
            &[n as u32, 0, f(cap)],
            &[x, &dummy],
            groups(n),
        );
    }

    /// `a += b` in place.
    pub fn add(&self, cx: &Context, enc: &mut CommandEncoder, a: &Buffer, b: &Buffer, n: usize) {
        cx.dispatch(enc, &self.add, &[n as u32, 0, 0], &[a, b], groups(n));
    }

    /// Each row of `x` (width `width`) plus `b`, in place.
    pub fn add_bias(
        &self,
        cx: &Context,
        enc: &mut CommandEncoder,
        x: &Buffer,
        b: &Buffer,
        n: usize,
        width: usize,
    ) {
        let p = [n as u32, width as u32, 0];
        cx.dispatch(enc, &self.add_bias, &p, &[x, b], groups(n));
    }

    /// `act(gate) · up` into `gate`; `gelu` picks GELU (tanh) over SiLU.
    pub fn glu(
        &self,
        cx: &Context,
        enc: &mut CommandEncoder,
        gate: &Buffer,
        up: &Buffer,
        n: usize,
        gelu: bool,
    ) {
        cx.dispatch(
            enc,
            &self.glu,
            &[n as u32, gelu as u32, 0],
            &[gate, up],
            groups(n),
        );
    }

    /// RoPE in place on `x` [T, n_heads, head_dim] with the host's cos/sin table `cs`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        cx: &Context,
        enc: &mut CommandEncoder,
        x: &Buffer,
        cs: &Buffer,
        t: usize,
        n_heads: usize,
        head_dim: usize,
        n_rot: usize,
        neox: bool,
    ) {
        let pairs = t * n_heads * (n_rot / 2);
        let p = [
            n_heads as u32,
            head_dim as u32,
            n_rot as u32,
            neox as u32,
            pairs as u32,
        ];
        cx.dispatch(enc, &self.rope, &p, &[x, cs], groups(pairs));
    }

    /// Attention probabilities [n_head, T, n_kv] of `q` over the key cache `kc`.
    pub fn probs(
        &self,
        cx: &Context,
        enc: &mut CommandEncoder,
        a: &crate::arch::Attn,
        q: &Buffer,
        kc: &Buffer,
        out: &Buffer,
    ) {
        let p = attn_params(a);
        cx.dispatch(
            enc,
            &self.probs,
            &p,
            &[q, kc, out],
            (a.n_head * a.n_tokens) as u32,
        );
    }

    /// `Σ_j p_j · v_j` over the value cache `vc`: [T, n_head, head_dim].
    pub fn values(
        &self,
        cx: &Context,
        enc: &mut CommandEncoder,
        a: &crate::arch::Attn,
        probs: &Buffer,
        vc: &Buffer,
        out: &Buffer,
    ) {
        let p = attn_params(a);
        let n = a.n_tokens * a.n_head * a.head_dim;
        cx.dispatch(enc, &self.values, &p, &[probs, vc, out], groups(n));
    }
}

fn attn_params(a: &crate::arch::Attn) -> [u32; 10] {
    [
        a.n_head as u32,
        a.head_dim as u32,
        a.n_tokens as u32,
        a.pos0 as u32,
        a.n_kv() as u32,
        (a.n_head / a.n_head_kv) as u32,
        (a.n_head_kv * a.head_dim) as u32,
        a.window as u32,
        f(a.kq_scale),
        f(a.softcap.unwrap_or(0.0)),
    ]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::gpu::context::{Reduction, kernel_source};
    use wgpu::naga;

    /// Every kernel's WGSL parses and validates (naga, as wgpu does before any driver sees it)
    /// with either reduction: runs on machines without a GPU too.
    #[test]
    fn every_kernel_validates() {
        for red in [Reduction::Subgroup, Reduction::Tree] {
            for (name, src) in [
                ("norm", NORM),
                ("elementwise", ELEMENTWISE),
                ("rope", ROPE),
                ("attention", ATTENTION),
            ] {
                validate(&format!("{name} {red:?}"), &kernel_source(red, src));
            }
        }
    }

    pub(crate) fn validate(name: &str, src: &str) {
        let caps = naga::valid::Capabilities::all();
        let module = naga::front::wgsl::parse_str(src)
            .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(src)));
        naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
            .validate(&module)
            .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(src)));
    }
}
