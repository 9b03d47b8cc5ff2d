//! Every backend parity can run, as rows of one table: its name, the activation rounding it
//! applies, whether it can be replayed op by op, and how to build it. The CLI, `check` and
//! the reports ask this table instead of spelling backend names themselves.

pub use super::gpu::context::Probe;
use super::{Backend, BackendError, Emulation, Fast, Reference, gpu::Gpu};
use crate::model::Model;

pub struct Entry {
    pub name: &'static str,
    /// Other names accepted on the command line.
    pub aliases: &'static [&'static str],
    pub rounding: Emulation,
    /// Every tap goes through `tap_mut`, so the backend can be fed a baseline's tensors
    /// (op by op).
    pub replayable: bool,
    pub about: &'static str,
    /// Needs a GPU adapter: `check`'s default set includes it only when a hardware one exists.
    pub device: bool,
    /// A plain reference with this rounding: `check` runs it in one walk of the weights with
    /// the others (`Lockstep`).
    pub lockstep: bool,
    /// For a device backend: which adapter it would run on, found without opening it.
    pub probe: Option<fn() -> Probe>,
    pub(crate) build: Build,
}

/// Builds a backend over a model: (model, n_ctx, threads).
pub(crate) type Build =
    for<'m> fn(&'m Model, usize, usize) -> Result<Box<dyn Backend + 'm>, BackendError>;

impl Entry {
    /// A backend over `model` with room for `n_ctx` positions; `threads` (0 = all cores) is
    /// for backends that use their own pool. Fails (one line) only for a device backend
    /// without its device.
    pub fn build<'m>(
        &self,
        model: &'m Model,
        n_ctx: usize,
        threads: usize,
    ) -> Result<Box<dyn Backend + 'm>, BackendError> {
        (self.build)(model, n_ctx, threads)
    }
}

/// Threads for a pool: 0 means all cores; more than the machine has is capped (a pool of
/// 100000 threads helps nobody and may not start).
pub fn resolve_threads(n: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if n == 0 {
        cores
    } else {
        n.min(cores.max(1) * 4)
    }
}

pub const BACKENDS: &[Entry] = &[
    Entry {
        name: "reference",
        aliases: &[],
        rounding: Emulation::None,
        replayable: true,
        about: "plain f32, readable: the forward pass as written",
        device: false,
        lockstep: true,
        probe: None,
        build: |m, n_ctx, _| Ok(Box::new(Reference::new(m, Emulation::None, n_ctx))),
    },
    Entry {
        name: "reference:ggml-cpu",
        aliases: &["emulated"],
        rounding: Emulation::GgmlCpu,
        replayable: true,
        about: "the reference rounding matmul inputs as ggml's CPU backend does",
        device: false,
        lockstep: true,
        probe: None,
        build: |m, n_ctx, _| Ok(Box::new(Reference::new(m, Emulation::GgmlCpu, n_ctx))),
    },
    Entry {
        name: "fast",
        aliases: &[],
        rounding: Emulation::GgmlCpu,
        replayable: true,
        about: "SIMD and threads, ggml's CPU rounding",
        device: false,
        lockstep: false,
        probe: None,
        build: |m, n_ctx, threads| Ok(Box::new(Fast::new(m, n_ctx, resolve_threads(threads)))),
    },
    Entry {
        name: "gpu",
        aliases: &[],
        rounding: Emulation::None,
        replayable: true,
        about: "the GPU through wgpu (Vulkan, Metal, DX12): f32 activations, f32 accumulation",
        device: true,
        lockstep: false,
        probe: Some(super::gpu::context::probe),
        build: |m, n_ctx, _| Ok(Box::new(Gpu::new(m, n_ctx)?)),
    },
];

/// The row for `name` (or one of its aliases).
pub fn find(name: &str) -> Result<&'static Entry, BackendError> {
    BACKENDS
        .iter()
        .find(|e| e.name == name || e.aliases.contains(&name))
        .ok_or_else(|| BackendError::Unknown(name.to_string()))
}

/// All names, for messages: `reference, reference:ggml-cpu, fast`.
pub fn names() -> String {
    BACKENDS
        .iter()
        .map(|e| e.name)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_resolve_to_their_rows() {
        assert_eq!(find("emulated").unwrap().name, "reference:ggml-cpu");
        assert_eq!(find("fast").unwrap().rounding, Emulation::GgmlCpu);
        let e = find("vulkan").err().unwrap().to_string();
        assert!(e.contains("unknown backend 'vulkan'"), "{e}");
        assert!(
            e.contains("reference, reference:ggml-cpu, fast, gpu"),
            "{e}"
        );
    }

    #[test]
    fn threads_are_capped() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(resolve_threads(0), cores);
        assert_eq!(resolve_threads(1), 1);
        assert_eq!(resolve_threads(100_000), cores * 4);
    }
}
