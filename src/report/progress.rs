//! Progress on the slow parts (a golden of a big model, a reference pass, judging ops): indicatif
//! bars on stderr, hidden when stderr is not a terminal or the user asked for `--quiet`, so logs
//! and pipes stay clean.
//!
//! ```no_run
//! use parity::report::progress::Progress;
//! let quiet = false;
//! // A pass of known length (e.g. one tick per step or per layer):
//! let p = Progress::bar("reference pass", 5, quiet);
//! for _ in 0..5 {
//!     p.inc(1);
//! }
//! p.finish();
//! // A stage of unknown length: a spinner with the elapsed time, cleared when done.
//! let value = Progress::stage("llama.cpp golden", quiet, || 42);
//! assert_eq!(value, 42);
//! ```

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::time::Duration;

/// A progress bar or spinner; does nothing when hidden.
pub struct Progress(ProgressBar);

fn target(quiet: bool) -> ProgressDrawTarget {
    // indicatif's stderr target already hides itself when stderr is not a terminal.
    if quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    }
}

impl Progress {
    /// A bar of `len` units labelled `what`.
    pub fn bar(what: &str, len: u64, quiet: bool) -> Progress {
        let b = ProgressBar::with_draw_target(Some(len), target(quiet));
        b.set_style(
            ProgressStyle::with_template("{msg:>18} [{bar:30}] {pos}/{len} {elapsed}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        b.set_message(super::shown::line(what).into_owned());
        Progress(b)
    }

    /// A spinner labelled `what`, for work of unknown length.
    pub fn spinner(what: &str, quiet: bool) -> Progress {
        let b = ProgressBar::with_draw_target(None, target(quiet));
        b.set_style(
            ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
        );
        b.set_message(super::shown::line(what).into_owned());
        if !b.is_hidden() {
            b.enable_steady_tick(Duration::from_millis(120));
        }
        Progress(b)
    }

    /// Run `f` under a spinner; the spinner is cleared when it returns.
    pub fn stage<R>(what: &str, quiet: bool, f: impl FnOnce() -> R) -> R {
        let p = Progress::spinner(what, quiet);
        let r = f();
        p.finish();
        r
    }

    pub fn inc(&self, n: u64) {
        self.0.inc(n);
    }

    pub fn set_message(&self, msg: &str) {
        self.0.set_message(super::shown::line(msg).into_owned());
    }

    /// Print a line above the bar without tearing it. Labels and lines are escaped
    /// ([`super::shown`]): a line of a file's text cannot move the cursor or start another.
    pub fn println(&self, line: &str) {
        let line = super::shown::line(line);
        if self.0.is_hidden() {
            eprintln!("{line}");
        } else {
            self.0.println(line);
        }
    }

    pub fn is_hidden(&self) -> bool {
        self.0.is_hidden()
    }

    /// Remove the bar from the terminal.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if !self.0.is_finished() {
            self.0.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_is_hidden() {
        assert!(Progress::bar("x", 3, true).is_hidden());
        assert!(Progress::spinner("x", true).is_hidden());
        assert_eq!(Progress::stage("x", true, || 7), 7);
    }
}
