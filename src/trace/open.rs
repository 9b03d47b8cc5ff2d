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
    // stat first: a folder or a device is named before anything is opened.
    let ft = std::fs::metadata(path)?.file_type();
    if !ft.is_file() {
        return Err(not_regular(&ft));
    }
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NONBLOCK);
    }
    let f = o.open(path)?;
    // The path may have been swapped between the stat and the open.
    let ft = f.metadata()?.file_type();
    if !ft.is_file() {
        return Err(not_regular(&ft));
    }
    Ok(f)
}

/// Read a whole regular file of at most `max` bytes (`what` says why that is the bound).
pub fn read_bounded(path: &Path, max: u64, what: &str) -> std::io::Result<Vec<u8>> {
    let f = open_regular(path)?;
    let len = f.metadata()?.len();
    let too_big = |n: u64| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{n} bytes, more than {what} can be ({max} bytes at most)"),
        )
    };
    if len > max {
        return Err(too_big(len));
    }
    // The file may grow while read: never take more than the bound (plus one byte to tell).
    let mut buf = Vec::with_capacity(len as usize);
    f.take(max + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > max {
        return Err(too_big(buf.len() as u64));
    }
    Ok(buf)
}

/// The hex sha256 and size of a regular file, read in pieces (a model of many GB is never held
/// in memory).
pub fn sha256_file(path: &Path) -> std::io::Result<(String, u64)> {
    use sha2::Digest;
    let mut f = open_regular(path)?;
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
