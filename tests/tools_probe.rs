//! The tools the build found for the test suite (build.rs, from build/probe.rs: llama_cpp,
//! numpy, gguf-py, ../shared, jq, chromium, cc/c++, wasm32 and node, torch for HF, the aarch64
//! tools for qemu, a Vulkan driver, maturin) are still the ones this machine has: otherwise tests
//! would be ignored that could
//! run (or the reverse), and this test says how to refresh the probe. It runs the very probes
//! build.rs ran (`include!`d), so the two cannot drift apart.

use crate::common;
use common::*;

#[allow(dead_code)]
mod probe {
    include!("../build/probe.rs");
}

#[test]
fn the_build_probe_matches_this_machine() {
    // cfg! needs each name spelled out; the probe list says which exist.
    let built = [
        ("parity_llama_cpp", cfg!(parity_llama_cpp)),
        ("parity_numpy", cfg!(parity_numpy)),
        ("parity_gguf_py", cfg!(parity_gguf_py)),
        ("parity_shared", cfg!(parity_shared)),
        ("parity_jq", cfg!(parity_jq)),
        ("parity_chromium", cfg!(parity_chromium)),
        ("parity_cc", cfg!(parity_cc)),
        ("parity_wasm32", cfg!(parity_wasm32)),
        ("parity_node", cfg!(parity_node)),
        ("parity_hf", cfg!(parity_hf)),
        ("parity_qemu", cfg!(parity_qemu)),
        ("parity_gpu", cfg!(parity_gpu)),
        ("parity_mount_ns", cfg!(parity_mount_ns)),
        ("parity_maturin", cfg!(parity_maturin)),
    ];
    let probes = probe::probes(&root());
    assert_eq!(
        probes.iter().map(|p| p.0).collect::<Vec<_>>(),
        built.iter().map(|b| b.0).collect::<Vec<_>>(),
        "every probe of build/probe.rs is checked here"
    );
    for ((_, what, here), (_, built)) in probes.into_iter().zip(built) {
        assert_eq!(
            here, built,
            "{what}: available now = {here}, when the tests were built = {built}; run `touch build.rs` and test again so that tests needing it run (or show as ignored)"
        );
    }
}
