//! A trace as one file: an uncompressed zip of `manifest.json` and the `.npy` files under
//! their trace-folder names — the layout numpy's `np.savez` writes, so `np.load` opens it too.
//! It is what an engine without a file system (wasm32 in a browser) hands back.
//!
//! Only stored (uncompressed) members are read, and only what the central directory lists,
//! each bounded by the file: a member's bytes are a slice of the archive, never copied.

/// The CRC-32 (IEEE) zip requires of each member (crc32fast: carry-less multiply where the
/// CPU has it, checked at every read of a member, so it is on every `diff`'s path).
pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// Writes an archive member by member, in memory (`ArchiveWriter::new()`) or streamed to any
/// `Write` (a file: a trace as large as the disk allows is never held whole).
pub struct ArchiveWriter<W: std::io::Write = Vec<u8>> {
    out: W,
    /// Bytes written to `out` so far: the next member's offset.
    at: u64,
    central: Vec<u8>,
    count: usize,
}

/// Zip without its 64-bit extension: sizes and offsets below 4 GiB, at most 65535 members.
const LIMIT: u64 = u32::MAX as u64;

impl Default for ArchiveWriter<Vec<u8>> {
    fn default() -> Self {
        Self::to(Vec::new())
    }
}

impl ArchiveWriter<Vec<u8>> {
    pub fn new() -> Self {
        Self::default()
    }
}

impl<W: std::io::Write> ArchiveWriter<W> {
    /// An archive streamed into `out`.
    pub fn to(out: W) -> Self {
        ArchiveWriter {
            out,
            at: 0,
            central: Vec::new(),
            count: 0,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.out.write_all(bytes).map_err(|e| e.to_string())?;
        self.at += bytes.len() as u64;
        Ok(())
    }

    /// Append a member; refused past the classic zip limits (4 GiB, 65535 members).
    pub fn add(&mut self, name: &str, bytes: &[u8]) -> Result<(), String> {
        self.add_parts(name, &[bytes])
    }

    /// Append a member whose bytes are `parts` one after another (an `.npy` header and its
    /// data, without copying them together).
    pub fn add_parts(&mut self, name: &str, parts: &[&[u8]]) -> Result<(), String> {
        let offset = self.at;
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if self.count >= 0xffff || len >= LIMIT || offset + 30 + name.len() as u64 + len >= LIMIT {
            return Err(format!(
                "{name}: a trace archive holds at most 65535 members and 4 GiB (write a folder instead)"
            ));
        }
        let mut h = crc32fast::Hasher::new();
        parts.iter().for_each(|p| h.update(p));
        let crc = h.finalize();
        let size = len as u32;
        let n = name.len() as u16;
        // Local file header: version 2.0, no flags, stored, no time, crc, sizes, name.
        let mut h = Vec::with_capacity(30 + name.len());
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&20u16.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes()); // flags
        h.extend_from_slice(&0u16.to_le_bytes()); // stored
        h.extend_from_slice(&0u16.to_le_bytes()); // time
        h.extend_from_slice(&0x21u16.to_le_bytes()); // date: 1980-01-01
        h.extend_from_slice(&crc.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&n.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes()); // extra
        h.extend_from_slice(name.as_bytes());
        self.put(&h)?;
        for p in parts {
            self.put(p)?;
        }
        // Central directory entry.
        let c = &mut self.central;
        c.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        c.extend_from_slice(&20u16.to_le_bytes()); // made by
        c.extend_from_slice(&20u16.to_le_bytes()); // needed
        c.extend_from_slice(&0u16.to_le_bytes());
        c.extend_from_slice(&0u16.to_le_bytes());
        c.extend_from_slice(&0u16.to_le_bytes());
        c.extend_from_slice(&0x21u16.to_le_bytes());
        c.extend_from_slice(&crc.to_le_bytes());
        c.extend_from_slice(&size.to_le_bytes());
        c.extend_from_slice(&size.to_le_bytes());
        c.extend_from_slice(&n.to_le_bytes());
        c.extend_from_slice(&[0u8; 12]); // extra, comment, disk, internal and external attributes
        c.extend_from_slice(&(offset as u32).to_le_bytes());
        c.extend_from_slice(name.as_bytes());
        self.count += 1;
        Ok(())
    }

    /// Write the central directory and its end record; returns the output (the archive's
    /// bytes for an in-memory writer).
    pub fn finish(mut self) -> Result<W, String> {
        let at = self.at;
        if at + self.central.len() as u64 + 22 >= LIMIT {
            return Err("a trace archive holds at most 4 GiB (write a folder instead)".into());
        }
        let count = self.count as u16;
        let central = std::mem::take(&mut self.central);
        let mut end = Vec::with_capacity(22);
        end.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        end.extend_from_slice(&[0u8; 4]); // this disk, the directory's disk
        end.extend_from_slice(&count.to_le_bytes());
        end.extend_from_slice(&count.to_le_bytes());
        end.extend_from_slice(&(central.len() as u32).to_le_bytes());
        end.extend_from_slice(&(at as u32).to_le_bytes());
        end.extend_from_slice(&0u16.to_le_bytes()); // comment
        self.put(&central)?;
        self.put(&end)?;
        self.out.flush().map_err(|e| e.to_string())?;
        Ok(self.out)
    }
}

/// Where each member lies in an archive's bytes.
#[derive(Clone, Debug, Default)]
pub struct Archive {
    members: std::collections::BTreeMap<String, Member>,
}

#[derive(Clone, Copy, Debug)]
struct Member {
    start: usize,
    len: usize,
    crc: u32,
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(i..i + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?))
}

impl Archive {
    /// Index an archive held in `bytes` (a file read or mapped whole). Refused in one line: not
    /// a zip, a compressed or encrypted member, a member that runs past the file, a name listed
    /// twice, a zip64 archive.
    pub fn parse(bytes: &[u8]) -> Result<Archive, String> {
        let bad = |what: &str| format!("not a trace archive parity reads: {what}");
        if bytes.len() < 22 {
            return Err(bad("shorter than a zip's end record"));
        }
        // The end record is the last 22 bytes plus a comment of at most 65535.
        let lo = bytes.len().saturating_sub(22 + 0xffff);
        let eocd = (lo..=bytes.len() - 22)
            .rev()
            .find(|&i| u32_at(bytes, i) == Some(0x0605_4b50))
            .ok_or_else(|| bad("no zip end record (is it a .npz / .zip file?)"))?;
        let count = u16_at(bytes, eocd + 10).unwrap_or(0) as usize;
        let dir_len = u32_at(bytes, eocd + 12).unwrap_or(0) as usize;
        let dir_at = u32_at(bytes, eocd + 16).unwrap_or(0) as usize;
        if dir_at == 0xffff_ffff || count == 0xffff {
            return Err(bad("a zip64 archive (write the trace as a folder instead)"));
        }
        if dir_at.checked_add(dir_len).is_none_or(|end| end > eocd) {
            return Err(bad("its central directory lies outside the file"));
        }
        let mut members = std::collections::BTreeMap::new();
        let mut at = dir_at;
        for _ in 0..count {
            let field = |o: usize| u32_at(bytes, at + o);
            if field(0) != Some(0x0201_4b50) {
                return Err(bad("a central directory entry is damaged"));
            }
            let (flags, method) = (
                u16_at(bytes, at + 8).unwrap_or(0),
                u16_at(bytes, at + 10).unwrap_or(0),
            );
            let crc = field(16).unwrap_or(0);
            let csize = field(20).unwrap_or(0) as usize;
            let size = field(24).unwrap_or(0) as usize;
            let n = u16_at(bytes, at + 28).unwrap_or(0) as usize;
            let extra = u16_at(bytes, at + 30).unwrap_or(0) as usize;
            let comment = u16_at(bytes, at + 32).unwrap_or(0) as usize;
            let local = field(42).unwrap_or(0) as usize;
            let name = bytes
                .get(at + 46..at + 46 + n)
                .ok_or_else(|| bad("a member's name runs past the file"))?;
            let name = String::from_utf8_lossy(name).into_owned();
            let shown = crate::npy::excerpt(&name, 60);
            if flags & 1 != 0 {
                return Err(bad(&format!("member '{shown}' is encrypted")));
            }
            if method != 0 || csize != size {
                return Err(bad(&format!(
                    "member '{shown}' is compressed (write it uncompressed: np.savez, not np.savez_compressed)"
                )));
            }
            // The local header repeats the name and may carry its own extra field.
            let ln = u16_at(bytes, local + 26);
            let le = u16_at(bytes, local + 28);
            if u32_at(bytes, local) != Some(0x0403_4b50) || ln.is_none() || le.is_none() {
                return Err(bad(&format!("member '{shown}' has no local header")));
            }
            let start = local + 30 + ln.unwrap_or(0) as usize + le.unwrap_or(0) as usize;
            if start.checked_add(size).is_none_or(|end| end > dir_at) {
                return Err(bad(&format!("member '{shown}' runs past the file")));
            }
            if members
                .insert(
                    name,
                    Member {
                        start,
                        len: size,
                        crc,
                    },
                )
                .is_some()
            {
                return Err(bad(&format!("member '{shown}' is listed twice")));
            }
            at += 46 + n + extra + comment;
        }
        Ok(Archive { members })
    }

    /// Does the archive list `name`?
    pub fn contains(&self, name: &str) -> bool {
        self.members.contains_key(name)
    }

    /// The member names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.members.keys().map(|s| s.as_str())
    }

    /// Member `name`'s bytes inside `bytes` (the archive this index was made from), checked
    /// against its CRC.
    pub fn get<'a>(&self, bytes: &'a [u8], name: &str) -> Result<&'a [u8], String> {
        let shown = crate::npy::excerpt(name, 60);
        let m = self
            .members
            .get(name)
            .ok_or_else(|| format!("the archive has no member '{shown}'"))?;
        let b = bytes
            .get(m.start..m.start + m.len)
            .ok_or_else(|| format!("member '{shown}' runs past the file"))?;
        if crc32(b) != m.crc {
            return Err(format!(
                "member '{shown}' is damaged (its CRC-32 does not match)"
            ));
        }
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_is_zips() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    /// The CRC is zip's bytewise one (the polynomial, bit by bit) at every length and
    /// alignment, and a member given in parts has the CRC of its bytes together.
    #[test]
    fn crc_is_the_bitwise_crc_and_parts_add_up() {
        let bytewise = |b: &[u8]| {
            !b.iter().fold(!0u32, |mut c, &x| {
                c ^= x as u32;
                for _ in 0..8 {
                    c = if c & 1 != 0 {
                        0xEDB8_8320 ^ (c >> 1)
                    } else {
                        c >> 1
                    };
                }
                c
            })
        };
        let data: Vec<u8> = (0..300u32).map(|i| (i * 7919 % 251) as u8).collect();
        for start in 0..9 {
            for end in start..data.len() {
                assert_eq!(crc32(&data[start..end]), bytewise(&data[start..end]));
            }
        }
        let mut w = ArchiveWriter::new();
        w.add_parts("a", &[&data[..13], &data[13..200], &data[200..]])
            .unwrap();
        w.add("b", &data).unwrap();
        let bytes = w.finish().unwrap();
        let a = Archive::parse(&bytes).unwrap();
        assert_eq!(a.get(&bytes, "a").unwrap(), a.get(&bytes, "b").unwrap());
    }

    #[test]
    fn members_round_trip_and_damage_is_refused() {
        let mut w = ArchiveWriter::new();
        w.add("manifest.json", b"{}").unwrap();
        w.add("s000/embd.npy", &[1, 2, 3]).unwrap();
        let bytes = w.finish().unwrap();
        let a = Archive::parse(&bytes).unwrap();
        assert_eq!(
            a.names().collect::<Vec<_>>(),
            vec!["manifest.json", "s000/embd.npy"]
        );
        assert_eq!(a.get(&bytes, "s000/embd.npy").unwrap(), &[1, 2, 3]);
        assert!(a.get(&bytes, "nope").unwrap_err().contains("no member"));
        let mut bad = bytes.clone();
        let i = bad.windows(3).position(|w| w == [1, 2, 3]).unwrap();
        bad[i] = 9;
        assert!(
            a.get(&bad, "s000/embd.npy")
                .unwrap_err()
                .contains("damaged")
        );
        for cut in [0, 10, 21, bytes.len() - 1] {
            assert!(Archive::parse(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        use proptest::prelude::*;
        proptest!(|(mut body in prop::collection::vec(any::<u8>(), 0..512), at in 0usize..512)| {
            // Half the cases carry an end record somewhere, so the directory walk runs too.
            if at + 22 <= body.len() {
                body[at..at + 4].copy_from_slice(&0x0605_4b50u32.to_le_bytes());
            }
            if let Ok(a) = Archive::parse(&body) {
                let names: Vec<String> = a.names().map(String::from).collect();
                for n in names {
                    let _ = a.get(&body, &n);
                }
            }
        });
    }
}
