//! Opening what parity reads: only regular files, and never more bytes than the file can hold.
//! A FIFO must not block the open, a symlink to `/dev/zero` must not be read without end, a
//! folder must be named as one: each is refused in one line naming the path and what it is.

use std::fs::File;
use std::io::Read;
use std::path::Path;

/// What a non-regular file is, as a person names it.
fn kind(ft: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a named pipe (FIFO)";
        }
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    if ft.is_dir() {
        return "a folder";
    }
    "not a regular file"
}

fn not_regular(ft: &std::fs::FileType) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("is {}, not a regular file", kind(ft)),
    )
}

/// Open `path` for reading if it is (or links to) a regular file. The open does not block on a
/// FIFO (O_NONBLOCK, then the descriptor's own type is checked), so a pipe is refused at once.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    open_file(path, false)
}

/// `open_regular` for a path that is not to be followed if it is a symlink (O_NOFOLLOW): one
/// resolved already, whose last component must still be the file that was checked.
fn open_file(path: &Path, nofollow: bool) -> std::io::Result<File> {
    // stat first: a folder or a device is named before anything is opened.
    let meta = if nofollow {
        std::fs::symlink_metadata(path)?
    } else {
        std::fs::metadata(path)?
    };
    let ft = meta.file_type();
    if !ft.is_file() {
        return Err(not_regular(&ft));
    }
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NONBLOCK | if nofollow { libc::O_NOFOLLOW } else { 0 });
    }
    let f = o.open(path)?;
    // The path may have been swapped between the stat and the open.
    let ft = f.metadata()?.file_type();
    if !ft.is_file() {
        return Err(not_regular(&ft));
    }
    Ok(f)
}

/// Open `rel` inside the folder `root` (given canonical): every symlink on the way is resolved
/// on purpose, and the file is opened only if where it leads is still inside `root` (a link
/// between two taps of one trace is fine; one to `/etc/passwd` or another trace is not).
pub fn open_inside(root: &Path, rel: &Path) -> std::io::Result<File> {
    let real = std::fs::canonicalize(root.join(rel))?;
    if !real.starts_with(root) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "is a symbolic link (or lies under one) that leads outside the trace folder: a trace's files must lie inside it",
        ));
    }
    open_file(&real, true)
}

/// Read a whole regular file of at most `max` bytes (`what` says why that is the bound).
pub fn read_bounded(path: &Path, max: u64, what: &str) -> std::io::Result<Vec<u8>> {
    read_file_bounded(open_regular(path)?, max, what)
}

/// Read the whole of an open regular file of at most `max` bytes: never more than its size
/// when opened (a file that grows meanwhile is cut there; a /proc file of size 0 reads as
/// empty, never without end).
pub fn read_file_bounded(f: File, max: u64, what: &str) -> std::io::Result<Vec<u8>> {
    let len = f.metadata()?.len();
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{len} bytes, more than {what} can be ({max} bytes at most)"),
        ));
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(len as usize)
        .map_err(|_| std::io::Error::other(format!("{len} bytes do not fit in memory")))?;
    f.take(len).read_to_end(&mut buf)?;
    Ok(buf)
}

/// The hex sha256 and size of a regular file, read in pieces (a model of many GB is never held
/// in memory) and never past the size it had when opened: a /proc file (size 0, endless to
/// read) hashes as empty at once.
pub fn sha256_file(path: &Path) -> std::io::Result<(String, u64)> {
    use sha2::Digest;
    let f = open_regular(path)?;
    let len = f.metadata()?.len();
    let mut f = f.take(len);
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    let hex = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((hex, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_devices_folders_and_oversized_files() {
        let e = read_bounded(Path::new("/dev/zero"), 1 << 20, "a manifest").unwrap_err();
        assert!(e.to_string().contains("character device"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let e = read_bounded(dir.path(), 1 << 20, "a manifest").unwrap_err();
        assert!(e.to_string().contains("a folder"), "{e}");
        let p = dir.path().join("f");
        std::fs::write(&p, [0u8; 100]).unwrap();
        assert_eq!(read_bounded(&p, 100, "x").unwrap().len(), 100);
        let e = read_bounded(&p, 99, "a tap").unwrap_err();
        assert!(e.to_string().contains("more than a tap can be"), "{e}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn proc_files_are_read_as_far_as_their_size_says() {
        // /proc/self/pagemap states size 0 and reads without end: hashed and read as empty.
        let t = std::time::Instant::now();
        let p = Path::new("/proc/self/pagemap");
        assert_eq!(sha256_file(p).unwrap().1, 0);
        assert!(read_bounded(p, 1 << 20, "x").unwrap().is_empty());
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
    }

    #[cfg(unix)]
    #[test]
    fn a_link_leaving_the_folder_is_refused_one_staying_inside_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("t");
        std::fs::create_dir_all(root.join("s000")).unwrap();
        std::fs::write(root.join("a"), b"x").unwrap();
        std::fs::write(dir.path().join("outside"), b"y").unwrap();
        std::os::unix::fs::symlink("../a", root.join("s000/in")).unwrap();
        std::os::unix::fs::symlink("../../outside", root.join("s000/out")).unwrap();
        let root = root.canonicalize().unwrap();
        assert!(open_inside(&root, Path::new("s000/in")).is_ok());
        let e = open_inside(&root, Path::new("s000/out")).unwrap_err();
        assert!(e.to_string().contains("outside the trace folder"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fifo");
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo on a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_regular(&p).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
    }
}
