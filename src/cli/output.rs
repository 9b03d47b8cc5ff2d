//! What a comparison run leaves behind: the JSON report, the verdict line and the exit code.
//! `check` and `diff` both end here, so every output format renders the same comparisons.

use super::{Result, err};
use crate::compare::Comparison;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args, Clone, Default)]
pub struct ReportArgs {
    /// Write every comparison as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn finish(comparisons: &[Comparison], out: &ReportArgs) -> Result<ExitCode> {
    if let Some(p) = &out.json {
        let text = serde_json::to_string_pretty(comparisons)?;
        std::fs::write(p, text).map_err(|e| err(format!("{}: {e}", p.display())))?;
    }
    let diverged = comparisons.iter().filter(|c| c.diverged()).count();
    if diverged > 0 {
        println!(
            "verdict: {diverged} of {} comparisons diverged",
            comparisons.len()
        );
        Ok(ExitCode::from(1))
    } else {
        println!("verdict: parity ({} comparisons)", comparisons.len());
        Ok(ExitCode::SUCCESS)
    }
}
