//! Deliberately broken kernels, built only with the `gpu-test-bugs` feature (CI's test run
//! turns it on; the parity a user installs has none of this): the tests that prove a bug in a
//! GPU engine's kernel is found at its tap and named plant one through the
//! `PARITY_GPU_TEST_BUG` variable (`matmul-transposed`, `rope-pairs`, `reduction-tail`,
//! optionally `@LAYER`), read by the parity they spawn. Each broken kernel is the production
//! kernel's source with one change, compiled when first used.

use super::context::{Context, Reduction};
use std::sync::OnceLock;
use wgpu::{Buffer, CommandEncoder, ComputePipeline};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuBug {
    /// Every matmul reads its weight transposed.
    MatmulTransposed,
    /// RoPE pairs the other way (halves for NORM models, adjacent for NEOX).
    RopePairs,
    /// RMSNorm's reduction drops the last subgroup of active lanes.
    ReductionTail,
}

impl GpuBug {
    pub fn parse(s: &str) -> Option<(GpuBug, usize)> {
        let (name, layer) = match s.split_once('@') {
            Some((n, l)) => (n, l.parse().ok()?),
            None => (s, 0),
        };
        let bug = match name {
            "matmul-transposed" => GpuBug::MatmulTransposed,
            "rope-pairs" => GpuBug::RopePairs,
            "reduction-tail" => GpuBug::ReductionTail,
            _ => return None,
        };
        Some((bug, layer))
    }

    /// The bug `PARITY_GPU_TEST_BUG` plants, from which layer on.
    pub fn planted() -> Option<(GpuBug, usize)> {
        GpuBug::parse(&std::env::var("PARITY_GPU_TEST_BUG").ok()?)
    }
}

/// The broken kernels' pipelines, compiled on first use.
#[derive(Default)]
pub struct BugKernels {
    matmul_transposed: OnceLock<ComputePipeline>,
    rms_norm_tail: OnceLock<ComputePipeline>,
}

/// norm.wgsl with the lanes of the last subgroup that holds a value (of `sg` lanes) left out
/// of the sum of squares.
fn norm_dropping_tail(red: Reduction) -> String {
    let at = "    let total = wg_sum(s, lane);";
    let norm = include_str!("norm.wgsl");
    assert!(
        norm.contains(at),
        "norm.wgsl changed: place the tail bug again"
    );
    let sg = match red {
        Reduction::Subgroup => "subgroupAdd(1u)",
        // 32: a common subgroup width.
        Reduction::Tree => "32u",
    };
    let drop = format!(
        "    let sz = {sg};\n    let act = min(p.n, WG);\n    let last = ((act - 1u) / sz) * sz;\n    if lid >= last && lid < act {{\n        s = 0.0;\n    }}\n"
    );
    norm.replace(at, &format!("{drop}{at}"))
}

impl BugKernels {
    /// `y = x · W` with the f32 weight `w` [n_out rows of n_in] read transposed.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_transposed(
        &self,
        cx: &Context,
        enc: &mut CommandEncoder,
        w: &Buffer,
        x: &Buffer,
        y: &Buffer,
        n_in: usize,
        n_out: usize,
        t: usize,
    ) {
        let pipe = self
            .matmul_transposed
            .get_or_init(|| cx.pipeline(include_str!("bug_matmul_transposed.wgsl"), "matmul"));
        let p = [n_in as u32, n_out as u32, t as u32];
        cx.dispatch(enc, pipe, &p, &[w, x, y], n_out as u32);
    }

    /// The RMSNorm pipeline whose reduction drops its tail (same bindings as the real one).
    pub fn rms_norm_tail(&self, cx: &Context) -> &ComputePipeline {
        self.rms_norm_tail
            .get_or_init(|| cx.pipeline(&norm_dropping_tail(cx.reduction()), "rms_norm"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::context::kernel_source;
    use crate::backend::gpu::kernels::tests::validate;

    #[test]
    fn broken_kernels_validate() {
        for red in [Reduction::Subgroup, Reduction::Tree] {
            let src = kernel_source(red, &norm_dropping_tail(red));
            assert!(src.contains("s = 0.0;"));
            validate(&format!("norm tail {red:?}"), &src);
            let src = kernel_source(red, include_str!("bug_matmul_transposed.wgsl"));
            validate(&format!("matmul transposed {red:?}"), &src);
        }
        assert_eq!(GpuBug::parse("rope-pairs@3"), Some((GpuBug::RopePairs, 3)));
        assert_eq!(GpuBug::parse("reduction-tail@x"), None);
    }
}
