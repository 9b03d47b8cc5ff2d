//! The temporary folders traces are written in (`.NAME.partial-PID`, beside the output folder)
//! never outlive their writer: an error or a panic drops the writer, which removes its folder;
//! Ctrl-C, `kill` or a closed terminal (SIGINT, SIGTERM, SIGHUP) end the process without
//! running drops, so a watcher thread removes the folders then and lets the signal end the
//! process as it would have (only for signals whose action is still the default: a program
//! with its own handler keeps it); a process killed outright (SIGKILL, a crash, a power cut) leaves
//! its folder behind, and the next writer of the same output removes it once its process is
//! gone.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The folders being written now by this process.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// `dir` is being written: remove it if the process is interrupted.
pub(super) fn register(dir: &Path) {
    #[cfg(unix)]
    signals::install();
    live().push(dir.to_path_buf());
}

/// Run `f` (publishing or removing `dir`) without an interrupt cutting it in half: the
/// watcher waits for the lock, and by then `dir` is no longer listed.
pub(super) fn settle<T>(dir: &Path, f: impl FnOnce() -> T) -> T {
    let mut l = live();
    let r = f();
    l.retain(|d| d != dir);
    r
}

/// The `.NAME.partial-PID` folders beside `dir` left by processes that no longer run (killed
/// outright, or by a crash), removed. Returns what was removed. A folder whose PID is running
/// now (another writer, or an unrelated process that reuses the number) is left alone.
pub fn remove_stale(dir: &Path) -> Vec<PathBuf> {
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Vec::new();
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(name);
    prefix.push(".partial-");
    let prefix = prefix.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = n
            .strip_prefix(&prefix)
            .map(|p| p.strip_suffix(".gone").unwrap_or(p))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || running(pid) {
            continue;
        }
        let p = e.path();
        if std::fs::remove_dir_all(&p).is_ok() {
            removed.push(p);
        }
    }
    removed
}

#[cfg(unix)]
fn running(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only asks whether the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(not(unix))]
fn running(_pid: u32) -> bool {
    // No cheap way to ask: assume it runs, never remove another writer's folder.
    true
}

#[cfg(unix)]
mod signals {
    use super::live;
    use std::sync::Once;
    use std::sync::atomic::{AtomicI32, Ordering};

    static INSTALL: Once = Once::new();
    /// The write end of the self-pipe the handler wakes the watcher through.
    static PIPE: AtomicI32 = AtomicI32::new(-1);
    const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

    extern "C" fn on_signal(sig: libc::c_int) {
        let fd = PIPE.load(Ordering::SeqCst);
        if fd >= 0 {
            let b = sig as u8;
            // SAFETY: write(2) is async-signal-safe; the byte is on the stack.
            unsafe {
                libc::write(fd, (&b as *const u8).cast(), 1);
            }
        }
    }

    /// The handler only writes the signal number to a pipe; a thread reads it, removes the
    /// folders being written, puts the default action back and raises the signal again, so
    /// the process ends exactly as it would have (a shell sees 130 for Ctrl-C).
    pub(super) fn install() {
        INSTALL.call_once(|| {
            let mut fds = [0 as libc::c_int; 2];
            // SAFETY: pipe2 fills the two descriptors; close-on-exec keeps them from children.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return;
            }
            let read_end = fds[0];
            let spawned = std::thread::Builder::new()
                .name("parity-interrupt".into())
                .spawn(move || watch(read_end));
            if spawned.is_err() {
                return;
            }
            PIPE.store(fds[1], Ordering::SeqCst);
            for sig in SIGNALS {
                // SAFETY: plain sigaction calls; the handler is async-signal-safe.
                unsafe {
                    let mut old: libc::sigaction = std::mem::zeroed();
                    libc::sigaction(sig, std::ptr::null(), &mut old);
                    // A signal the user chose to ignore (`nohup`) stays ignored, and a
                    // handler of the program parity is a library in (`trace::api`) stays its.
                    if old.sa_sigaction != libc::SIG_DFL {
                        continue;
                    }
                    let mut sa: libc::sigaction = std::mem::zeroed();
                    sa.sa_sigaction = on_signal as *const () as usize;
                    sa.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut sa.sa_mask);
                    libc::sigaction(sig, &sa, std::ptr::null_mut());
                }
            }
        });
    }

    /// Remove `d` while the writer may still be adding files to it: first moved aside (the
    /// writer's next file then fails, it never makes the folder again), then removed, retried
    /// while a file created in the moment of the move still lands in it.
    fn remove_now(d: &std::path::Path) -> bool {
        let mut gone = d.as_os_str().to_owned();
        gone.push(".gone");
        let target = if std::fs::rename(d, &gone).is_ok() {
            std::path::PathBuf::from(gone)
        } else {
            d.to_path_buf()
        };
        for _ in 0..50 {
            if std::fs::remove_dir_all(&target).is_ok() || !target.exists() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        false
    }

    fn watch(fd: libc::c_int) {
        let mut b = 0u8;
        loop {
            // SAFETY: reading one byte into a stack variable.
            let n = unsafe { libc::read(fd, (&mut b as *mut u8).cast(), 1) };
            if n == 1 {
                break;
            }
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        let sig = libc::c_int::from(b);
        // Holding the lock: a writer publishing its trace finishes first (see `settle`).
        let dirs = live();
        for d in dirs.iter() {
            if remove_now(d) {
                eprintln!(
                    "\ninterrupted: removed the unfinished trace {}",
                    d.display()
                );
            }
        }
        // SAFETY: back to the default action, then the same signal again: the process ends
        // as the signal would have ended it.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::kill(libc::getpid(), sig);
        }
        std::process::exit(128 + sig);
    }
}
