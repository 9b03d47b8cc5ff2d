//! The integration tests, as one test binary: each file beside this one is a module of it
//! (`cargo test --test suite selftest::` runs one file's tests). One binary links parity once
//! instead of once per file, and its tests share the machine's cores as one queue: a file
//! whose last test runs alone no longer leaves a core idle while the next file waits.
//! The block formats' tests (quant_props, quant_oracle) live with their crate,
//! crates/parity-quant, which scripts/test_aarch64.sh cross-builds alone and runs under qemu.

mod common;

mod adversarial_inputs;
mod adversarial_prints;
mod adversarial_reads;
mod adversarial_writes;
mod arch_verdicts;
mod archs;
mod bench_gpu;
mod bug_signatures;
mod cli_adversarial;
mod cli_check;
mod cli_inspect;
mod cli_run;
mod docs;
mod fitted_knobs;
mod gguf_fuzz;
mod gguf_reader;
mod gpu;
mod gpu_goldens;
mod gpu_quant;
mod house_order;
mod installed;
mod instrument;
mod judge;
mod judge_confirm;
mod judge_families;
mod kit_c;
mod kit_python;
mod kit_rust;
mod kv_caches;
mod mutations;
mod neon_qemu;
mod probs_cut;
mod readme;
mod report_gate;
mod report_html;
mod report_json;
mod report_terminal;
mod selftest;
mod solved_positions;
mod step_kinds;
mod tap_names;
mod tokenizer_vocab;
mod tools_probe;
mod verdicts;
