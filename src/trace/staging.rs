//! The temporary folders traces are written in (`.NAME.partial-PID`, beside the output folder)
//! never outlive their writer: an error or a panic drops the writer, which removes its folder;
//! Ctrl-C, `kill` or a closed terminal (SIGINT, SIGTERM, SIGHUP) end the process without
//! running drops, so a watcher thread removes the folders then and lets the signal end the
//! process as it would have (only for signals whose action is still the default: a program
//! with its own handler keeps it); a process killed outright (SIGKILL, a crash, a power cut) leaves
//! its folder behind, and the next writer of the same output removes it once its process is
//! gone. Single output files (a fixture, a JSON or HTML report, a snapshot) go the same way
//! ([`write_whole`]), and every writer of a target holds its lock ([`lock`]) while it works.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The folders being written now by this process.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lock files held by this process: removed (silently) on an interrupt too.
static LOCKS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn locks() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LOCKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Child processes that write for this process (`golden`'s llama.cpp script): killed with it.
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// `dir` is being written: remove it if the process is interrupted.
pub fn register(dir: &Path) {
    #[cfg(unix)]
    signals::install();
    live().push(dir.to_path_buf());
}

/// `pid` writes for this process: an interrupt kills it (before the folders it writes are
/// removed), so that nothing is published after parity is gone. Spawn it with
/// [`die_with_parent`] too: that covers parity killed outright.
pub fn register_child(pid: u32) {
    #[cfg(unix)]
    signals::install();
    CHILDREN.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
}

/// `pid` has ended (waited for): no longer killed on an interrupt.
pub fn forget_child(pid: u32) {
    CHILDREN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|&p| p != pid);
}

/// Run `cmd` (a Python) isolated from what the user's shell and working folder hold: `-I` (no
/// working or script folder on `sys.path`, no user site, most `PYTHON*` variables ignored) is
/// added by the caller before the script; here the variables that choose which code the child
/// loads are removed from its environment: every `PYTHON*` and `__PYVENV_LAUNCHER__`, because
/// `-I` still honours some (`PYTHONEXECUTABLE` points `sys.executable` at a planted
/// `pyvenv.cfg`, whose site-packages `.pth` files then run), and llama-cpp-python's
/// `LLAMA_CPP_LIB_PATH` (the folder its `libllama.so` is loaded from). Where the libraries come
/// from is the venv's choice, not the environment's.
pub fn isolate_python(cmd: &mut std::process::Command) {
    for (k, _) in std::env::vars_os() {
        let name = k.to_string_lossy();
        if name.starts_with("PYTHON")
            || name == "__PYVENV_LAUNCHER__"
            || name.starts_with("LLAMA_CPP_LIB")
        {
            cmd.env_remove(&k);
        }
    }
}

/// Make `cmd`'s process receive SIGKILL when parity ends, however it ends (Linux's
/// `PR_SET_PDEATHSIG`; elsewhere the interrupt watcher alone stops it).
pub fn die_with_parent(cmd: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches nothing of the parent's.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// Run `f` (publishing or removing `dir`) without an interrupt cutting it in half: the
/// watcher waits for the lock, and by then `dir` is no longer listed.
pub fn settle<T>(dir: &Path, f: impl FnOnce() -> T) -> T {
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
            .map(|p| {
                p.strip_suffix(".gone")
                    .or_else(|| p.strip_suffix(".old"))
                    .unwrap_or(p)
            })
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || running(pid) {
            continue;
        }
        let p = e.path();
        if remove_any(&p).is_ok() {
            removed.push(p);
        }
    }
    removed
}

/// Remove a staging file or folder (a symlink is removed, never followed; so are the links
/// inside a folder: `remove_dir_all` does not follow them).
pub fn remove_any(p: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(e) => Err(e),
    }
}

/// `.NAME.partial-PID` beside `path`: where `path` is written until it is whole.
pub fn partial_path(path: &Path) -> std::io::Result<PathBuf> {
    let abs = std::path::absolute(path)?;
    let (Some(parent), Some(name)) = (abs.parent(), abs.file_name()) else {
        return Err(std::io::Error::other("not a file name"));
    };
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".partial-{}", std::process::id()));
    Ok(parent.join(tmp))
}

/// Can an output file be written at `path`? Its folder must exist and take a new file, and
/// `path` must be absent or a regular file (a FIFO, a device, a folder is never replaced; a
/// symbolic link is refused, never followed: `--json /dev/stdout` would replace the link).
/// Asked before the work starts, so that a bad path costs nothing; `flag` names the option
/// in the message (`--json`). Creates and removes a probe file: writable by what the kernel
/// says (a read-only file system, permissions, root), not by mode bits.
pub fn check_output_file(path: &Path, flag: &str) -> Result<(), String> {
    let shown = path.display();
    if path.as_os_str().is_empty() {
        return Err(format!("{flag}: an empty path"));
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(super::paths::symlink_refusal(path, flag));
        }
        Ok(m) if m.is_dir() => return Err(format!("{flag} {shown}: is a folder, not a file")),
        Ok(m) if !m.is_file() => {
            return Err(format!(
                "{flag} {shown}: exists and is not a regular file (a FIFO, socket or device is never replaced)"
            ));
        }
        _ => {}
    }
    let probe = partial_path(path).map_err(|e| format!("{flag} {shown}: {e}"))?;
    let parent = probe.parent().unwrap_or(Path::new("/"));
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(format!(
                "{flag} {shown}: {} is not a folder",
                parent.display()
            ));
        }
        Err(e) => {
            return Err(format!(
                "{flag} {shown}: its folder {} cannot be used: {e}",
                parent.display()
            ));
        }
    }
    // The probe never outlives this call: with the interrupt watcher installed, a signal in
    // between waits for the lock held here (without it, the default action would end the
    // process with the probe on disk).
    #[cfg(unix)]
    signals::install();
    let _held = live();
    match create_side_file(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        // A probe of this process left by an earlier writer of the same path: it is ours.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!(
            "{flag} {shown}: cannot write in {}: {e}",
            parent.display()
        )),
    }
}

/// Write `bytes` to `path` whole or not at all: into `.NAME.partial-PID` beside it, synced,
/// then renamed over it. A failure (a full disk), an error, an interrupt leaves `path` as it
/// was and no staging file; staging files of writers killed outright go first.
/// Errors name the path.
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), String> {
    stage(path, bytes)?.commit()
}

/// A file written whole beside its target, not yet in place: [`Staged::commit`] renames it
/// over the target; dropped uncommitted, it is removed. Several outputs staged first and
/// committed after make a run that leaves all its outputs or none.
pub struct Staged {
    tmp: PathBuf,
    path: PathBuf,
    done: bool,
}

/// Write `bytes` to the staging file of `path` (see [`write_whole`]).
pub fn stage(path: &Path, bytes: &[u8]) -> Result<Staged, String> {
    use std::io::Write;
    let shown = path.display();
    replaceable(path)?;
    let tmp = partial_path(path).map_err(|e| format!("{shown}: {e}"))?;
    remove_stale(&tmp_target(&tmp));
    #[cfg(unix)]
    signals::install();
    live().push(tmp.clone());
    // From here on the drop removes the staging file, whatever fails.
    let staged = Staged {
        tmp,
        path: path.to_path_buf(),
        done: false,
    };
    let written = (|| {
        // A leftover of ours (or a link planted at our name) is removed, never followed.
        let _ = std::fs::remove_file(&staged.tmp);
        let mut f = create_side_file(&staged.tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    written.map_err(|e| format!("{shown}: {e}"))?;
    Ok(staged)
}

impl Staged {
    /// Put the file in place (a rename: atomic).
    pub fn commit(mut self) -> Result<(), String> {
        // Asked again: the target may have been swapped for a link or a device since.
        replaceable(&self.path)?;
        let r = settle(&self.tmp, || std::fs::rename(&self.tmp, &self.path));
        self.done = r.is_ok();
        r.map_err(|e| format!("{}: {e}", self.path.display()))
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done {
            settle(&self.tmp, || std::fs::remove_file(&self.tmp).ok());
        }
    }
}

/// `path` may be replaced by a rename: it is absent or a regular file, not a link (the rename
/// would replace the link, not write where it points), a device, a FIFO or a folder.
fn replaceable(path: &Path) -> Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(format!(
            "{}: is a symbolic link (parity never writes through a link)",
            path.display()
        )),
        Ok(m) if !m.is_file() => Err(format!(
            "{}: exists and is not a regular file (only a regular file is replaced)",
            path.display()
        )),
        _ => Ok(()),
    }
}

/// Create a side file (a probe, a partial) new: `O_CREAT|O_EXCL|O_NOFOLLOW`, so that a file
/// or a link (dangling or not) already at its name is never opened or written through.
pub(crate) fn create_side_file(p: &Path) -> std::io::Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NOFOLLOW);
    }
    o.open(p)
}

/// The target a staging path `.NAME.partial-PID` stands for.
fn tmp_target(tmp: &Path) -> PathBuf {
    let name = tmp.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name
        .as_deref()
        .and_then(|n| n.strip_prefix('.'))
        .and_then(|n| n.rsplit_once(".partial-"))
        .map(|(n, _)| n.to_string());
    match (tmp.parent(), name) {
        (Some(parent), Some(name)) => parent.join(name),
        _ => tmp.to_path_buf(),
    }
}

/// Held while one process writes a target (a trace folder, a fixture, a golden): a second
/// writer of the same target is refused instead of racing the first. The lock is an
/// `flock` on `.NAME.lock` beside the target, removed when released.
pub struct Lock {
    /// Open while held: closing it releases the flock.
    #[cfg(unix)]
    _file: std::fs::File,
    path: PathBuf,
}

/// Take the writer's lock of `target`, or say (an error of kind `WouldBlock`) that another
/// process holds it. The caller names `target` in its message. The lock file is opened with
/// `O_NOFOLLOW` (another parity may hold it, so it is not made exclusively): a link at its
/// name, dangling or not, or anything but a regular file, is refused and left as it is.
pub fn lock(target: &Path) -> std::io::Result<Lock> {
    let abs = std::path::absolute(target)?;
    let (Some(parent), Some(name)) = (abs.parent(), abs.file_name()) else {
        return Err(std::io::Error::other("not a file or folder name"));
    };
    let mut n = std::ffi::OsString::from(".");
    n.push(name);
    n.push(".lock");
    let path = parent.join(n);
    #[cfg(unix)]
    {
        use std::io::{Read, Seek, Write};
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::io::AsRawFd;
        // The file is made and listed under the interrupt watcher's lock: a signal in between
        // would otherwise leave `.NAME.lock` behind (the watcher waits, then removes it).
        signals::install();
        let mut held = locks();
        use std::os::unix::fs::OpenOptionsExt;
        let foreign = |what: &str| {
            std::io::Error::other(format!(
                "its lock {} is {what}: parity never writes through it (remove it if no parity is writing there)",
                path.display()
            ))
        };
        // Retried when the file was removed by its last holder between our open and flock.
        for _ in 0..100 {
            match std::fs::symlink_metadata(&path) {
                Ok(m) if m.file_type().is_symlink() => return Err(foreign("a symbolic link")),
                Ok(m) if !m.is_file() => return Err(foreign("not a regular file")),
                _ => {}
            }
            // O_NONBLOCK: a FIFO swapped in after the look above cannot stall the open.
            let opened = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&path);
            let mut file = match opened {
                Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                    return Err(foreign("a symbolic link"));
                }
                Err(e) => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!("cannot write there (its lock {}: {e})", path.display()),
                    ));
                }
                Ok(f) => f,
            };
            if !file.metadata().is_ok_and(|m| m.is_file()) {
                return Err(foreign("not a regular file"));
            }
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                // A pid at most: the file may be anyone's, of any size and content.
                let mut holder = String::new();
                let _ = (&mut file).take(20).read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.bytes().all(|b| b.is_ascii_digit()) {
                    holder
                } else {
                    ""
                };
                let who = if holder.is_empty() {
                    "another process".to_string()
                } else {
                    format!("process {holder}")
                };
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    format!(
                        "{who} is writing it now (lock {}); wait for it or choose another output",
                        path.display()
                    ),
                ));
            }
            let same = match (file.metadata(), std::fs::symlink_metadata(&path)) {
                (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
                _ => false,
            };
            if !same {
                continue;
            }
            let _ = file.set_len(0);
            let _ = file.rewind();
            let _ = write!(file, "{}", std::process::id());
            held.push(path.clone());
            return Ok(Lock { _file: file, path });
        }
        Err(std::io::Error::other(format!(
            "its lock {} keeps changing",
            path.display()
        )))
    }
    #[cfg(not(unix))]
    {
        Ok(Lock { path })
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        // Removed while still held: a waiter that opened the old file sees it is gone.
        let mut l = locks();
        let _ = std::fs::remove_file(&self.path);
        l.retain(|p| p != &self.path);
    }
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
        if std::fs::symlink_metadata(d).is_ok_and(|m| !m.is_dir()) {
            return std::fs::remove_file(d).is_ok();
        }
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
        // The children first: a llama.cpp script still running would publish its golden.
        let children = super::CHILDREN
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for pid in children {
            if let Ok(pid) = libc::pid_t::try_from(pid) {
                // SAFETY: a plain kill of a child we spawned and have not waited for.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
        // Holding the lock: a writer publishing its trace finishes first (see `settle`).
        let dirs = live();
        for d in dirs.iter() {
            let what = if d.is_dir() { "trace" } else { "file" };
            if remove_now(d) {
                eprintln!(
                    "\ninterrupted: removed the unfinished {what} {}",
                    d.display()
                );
            }
        }
        for l in super::locks().iter() {
            let _ = std::fs::remove_file(l);
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
