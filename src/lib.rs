//! parity: find where an LLM inference engine stops agreeing with llama.cpp.
//!
//! Layers, dependencies pointing down only (docs/architecture.md; tests/house_order.rs checks
//! it): `cli`, `selftest`, `check`, `golden` (llama.cpp's run, made), `report`, `judge`, `compare`, `backend`, `arch` (the
//! forward), `trace`, `model`, `arch::spec`, `tokenizer`, `gguf`; below them all, `quant`, the ggml block
//! formats, is its own crate (crates/parity-quant), which imports nothing of parity.

pub mod arch;
pub mod backend;
pub mod check;
pub mod cli;
pub mod compare;
pub mod gguf;
pub mod golden;
pub mod judge;
pub mod model;
pub mod report;
pub mod selftest;
pub mod tokenizer;
pub mod trace;

pub use parity_quant as quant;
