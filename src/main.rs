fn main() -> std::process::ExitCode {
    large_allocations_mapped();
    parity::cli::main()
}

/// glibc serves an allocation from its heap once one of that size has been freed (its mmap
/// threshold rises with each free, up to 32 MiB), and a freed block inside the heap stays
/// resident: a long judge's replays, each taking and freeing activations of a few MB to 46 MB
/// on several threads, left ~300 MB resident that no tensor held. A fixed 1 MiB threshold maps
/// every large buffer and unmaps it when freed (measured on the 2,048-id scan check: the judge
/// phase's peak RSS 1,190 → 1,077 MiB; time unchanged within the noise).
fn large_allocations_mapped() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}
