//! `parity bench`: fast backend vs the real llama.cpp on the same file, same threads.
//! (Being written.)

use super::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct BenchArgs {
    model: PathBuf,
}

pub fn bench(_a: BenchArgs) -> Result<ExitCode> {
    Err(super::err("parity bench is not implemented yet"))
}
