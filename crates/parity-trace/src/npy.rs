//! The `.npy` header, read by a parser of our own: the format's header is a Python dict literal
//! with three keys (`descr`, `fortran_order`, `shape`), which this parser reads in one linear
//! pass without recursion. A general literal parser (npyz's) backtracks on nested lists and takes
//! time doubling per level: one small file could hang parity. Anything but the three keys with a
//! plain float dtype string, a bool and a tuple of integers is refused in one line.

use std::io::Read;

/// The most header bytes parity reads. numpy refuses headers past 10000 bytes by default
/// (`max_header_size`); a version 1 header is below 64 KiB by construction.
pub const HEADER_MAX: usize = 1 << 16;
/// Most dimensions a shape may state (numpy's own limit, `NPY_MAXDIMS`, is 64).
pub const MAX_DIMS: usize = 64;

/// One of the float element types a tap may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dtype {
    /// Bytes per element: 2, 4 or 8.
    pub size: usize,
    pub big_endian: bool,
}

impl Dtype {
    pub fn descr(self) -> String {
        format!("{}f{}", if self.big_endian { '>' } else { '<' }, self.size)
    }
}

/// What a `.npy` header states.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub dtype: Dtype,
    pub fortran_order: bool,
    pub shape: Vec<u64>,
    /// Where the data starts: magic, version, length field and the header itself.
    pub data_offset: u64,
}

/// At most `max` characters of `s` (then `…`), control characters escaped: how a piece of a
/// file is quoted in an error line, however long or strange the file is.
pub fn excerpt(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        // Controls, and the bidi controls and separators that reorder or split a line as seen
        // (the set report::shown escapes; every error line also passes through it).
        if c.is_control()
            || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
                | '\u{200e}' | '\u{200f}' | '\u{061c}' | '\u{2028}' | '\u{2029}')
        {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// How many characters of a file's own text an error line quotes.
pub const EXCERPT: usize = 80;

/// Read the header from the start of `r`: never more than [`HEADER_MAX`] bytes past the
/// length field, whatever the length field says.
pub fn read_header(r: &mut impl Read) -> Result<Header, String> {
    let mut pre = [0u8; 8];
    read_exact(r, &mut pre, "its magic")?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (no \\x93NUMPY magic)".into());
    }
    let (major, minor) = (pre[6], pre[7]);
    let (len, at) = match major {
        1 => {
            let mut b = [0u8; 2];
            read_exact(r, &mut b, "its header length")?;
            (u16::from_le_bytes(b) as usize, 10)
        }
        2 | 3 => {
            let mut b = [0u8; 4];
            read_exact(r, &mut b, "its header length")?;
            (u32::from_le_bytes(b) as usize, 12)
        }
        _ => {
            return Err(format!(
                "not a .npy file parity reads (format version {major}.{minor}; 1.0 to 3.0 are)"
            ));
        }
    };
    if len > HEADER_MAX {
        return Err(format!(
            "the .npy header is {len} bytes, more than a header can be ({HEADER_MAX} at most)"
        ));
    }
    let mut h = vec![0u8; len];
    read_exact(r, &mut h, "its header")?;
    let mut head = parse_dict(&h)?;
    head.data_offset = (at + len) as u64;
    Ok(head)
}

fn read_exact(r: &mut impl Read, buf: &mut [u8], what: &str) -> Result<(), String> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            format!("not a .npy file (the file ends inside {what})")
        }
        _ => e.to_string(),
    })
}

/// Parse the header's dict literal: `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`
/// with any whitespace between tokens, keys in any order, each once.
pub fn parse_dict(h: &[u8]) -> Result<Header, String> {
    let mut p = Lexer { s: h, i: 0 };
    let bad = |p: &Lexer, what: &str| {
        let rest = String::from_utf8_lossy(&p.s[p.i.min(p.s.len())..]);
        format!(
            "not a .npy header parity reads: {what} at byte {} ('{}')",
            p.i,
            excerpt(rest.trim_start(), 24)
        )
    };
    p.expect(b'{').map_err(|_| bad(&p, "expected '{'"))?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        p.ws();
        if p.eat(b'}') {
            break;
        }
        let key = p.string().ok_or_else(|| bad(&p, "expected a quoted key"))?;
        p.expect(b':').map_err(|_| bad(&p, "expected ':'"))?;
        p.ws();
        match key {
            b"descr" if descr.is_none() => {
                let Some(d) = p.string() else {
                    return Err(if p.peek() == Some(b'[') {
                        "dtype is a structured (record) type, not a float type (use float32, float16 or float64)".into()
                    } else {
                        bad(&p, "expected the dtype as a quoted string")
                    });
                };
                descr = Some(dtype(d)?);
            }
            b"fortran_order" if fortran.is_none() => {
                fortran = Some(if p.word(b"True") {
                    true
                } else if p.word(b"False") {
                    false
                } else {
                    return Err(bad(&p, "expected True or False"));
                });
            }
            b"shape" if shape.is_none() => {
                shape = Some(p.tuple().map_err(|what| bad(&p, what))?);
            }
            k => {
                return Err(format!(
                    "not a .npy header parity reads: key '{}' {}",
                    excerpt(&String::from_utf8_lossy(k), 24),
                    if matches!(k, b"descr" | b"fortran_order" | b"shape") {
                        "given twice"
                    } else {
                        "is not one of descr, fortran_order, shape"
                    }
                ));
            }
        }
        p.ws();
        if p.eat(b',') {
            continue;
        }
        p.ws();
        p.expect(b'}').map_err(|_| bad(&p, "expected ',' or '}'"))?;
        break;
    }
    // After the dict: only the padding numpy writes.
    if p.s[p.i..].iter().any(|b| !b.is_ascii_whitespace()) {
        return Err(bad(&p, "text after the header's dict"));
    }
    let missing = [
        ("descr", descr.is_none()),
        ("fortran_order", fortran.is_none()),
        ("shape", shape.is_none()),
    ]
    .iter()
    .filter(|(_, m)| *m)
    .map(|(k, _)| *k)
    .collect::<Vec<_>>();
    if !missing.is_empty() {
        return Err(format!(
            "not a .npy header parity reads: no {}",
            missing.join(", ")
        ));
    }
    Ok(Header {
        dtype: descr.expect("checked"),
        fortran_order: fortran.expect("checked"),
        shape: shape.expect("checked"),
        data_offset: 0,
    })
}

/// The float dtypes a tap may hold (`=` and `|` are not written by numpy for floats).
fn dtype(d: &[u8]) -> Result<Dtype, String> {
    let (size, big_endian) = match d {
        b"<f4" => (4, false),
        b">f4" => (4, true),
        b"<f2" => (2, false),
        b">f2" => (2, true),
        b"<f8" => (8, false),
        b">f8" => (8, true),
        other => {
            return Err(format!(
                "dtype {} is not a float type (use float32, float16 or float64)",
                excerpt(&String::from_utf8_lossy(other), 24)
            ));
        }
    };
    Ok(Dtype { size, big_endian })
}

struct Lexer<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Lexer<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn ws(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace()) {
            self.i += 1;
        }
    }
    fn eat(&mut self, b: u8) -> bool {
        if self.peek() == Some(b) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, b: u8) -> Result<(), ()> {
        self.ws();
        if self.eat(b) { Ok(()) } else { Err(()) }
    }
    /// A keyword not followed by more of a name.
    fn word(&mut self, w: &[u8]) -> bool {
        let end = self.i + w.len();
        if self.s.get(self.i..end) == Some(w)
            && !self
                .s
                .get(end)
                .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
        {
            self.i = end;
            true
        } else {
            false
        }
    }
    /// A quoted string without escapes ('…' or "…"); None leaves the position as it was.
    fn string(&mut self) -> Option<&'a [u8]> {
        let q = self.peek().filter(|&q| q == b'\'' || q == b'"')?;
        let start = self.i + 1;
        let len = self.s[start..]
            .iter()
            .position(|&b| b == q || b == b'\\' || b == b'\n')?;
        if self.s[start + len] != q {
            return None;
        }
        self.i = start + len + 1;
        Some(&self.s[start..start + len])
    }
    /// `(d0, d1, …)`, `(d0,)` or `()`: decimal dimensions (Python 2's `L` suffix allowed).
    fn tuple(&mut self) -> Result<Vec<u64>, &'static str> {
        if !self.eat(b'(') {
            return Err("expected the shape as a tuple");
        }
        let mut dims = Vec::new();
        loop {
            self.ws();
            if self.eat(b')') {
                return Ok(dims);
            }
            let start = self.i;
            while self.peek().is_some_and(|b| b.is_ascii_digit()) {
                self.i += 1;
            }
            let digits = &self.s[start..self.i];
            if digits.is_empty() {
                return Err("expected a dimension");
            }
            let d = std::str::from_utf8(digits)
                .ok()
                .and_then(|t| t.parse::<u64>().ok())
                .ok_or("a dimension too large")?;
            self.eat(b'L');
            dims.push(d);
            if dims.len() > MAX_DIMS {
                return Err("more dimensions than numpy allows (64)");
            }
            self.ws();
            if self.eat(b',') {
                continue;
            }
            self.ws();
            if self.eat(b')') {
                // `(5)` is an int in Python, not a tuple: numpy never writes it.
                if dims.len() == 1 {
                    return Err("a one-dimensional shape written without its comma");
                }
                return Ok(dims);
            }
            return Err("expected ',' or ')' in the shape");
        }
    }
}

/// The header of a little-endian float32 C-order `.npy` (version 1.0) of `shape`: magic,
/// version, length and the dict, padded with spaces and a newline to a multiple of 64 bytes.
pub fn f32_header(shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {tuple}, }}");
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = Vec::with_capacity(10 + dict.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// A whole `.npy` file: [`f32_header`] and the values, little-endian.
pub fn f32_file(shape: &[usize], data: &[f32]) -> Vec<u8> {
    let mut out = f32_header(shape);
    out.reserve(data.len() * 4);
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Check a header against the shape a manifest lists and the bytes the file holds after the
/// header; returns the number of data bytes to read. Nothing is read or allocated by what an
/// unchecked field says.
pub fn check_payload(h: &Header, shape: &[usize], have: u64) -> Result<u64, String> {
    let dims = |d: &[u64]| {
        excerpt(
            &format!(
                "[{}]",
                d.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            EXCERPT,
        )
    };
    let want_shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    if h.shape != want_shape {
        return Err(format!(
            "shape {} differs from the manifest's {}",
            dims(&h.shape),
            dims(&want_shape)
        ));
    }
    let descr = h.dtype.descr();
    let shape_txt = dims(&want_shape);
    let n = want_shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_mul(h.dtype.size as u64))
        .ok_or_else(|| format!("shape {shape_txt} of {descr} is past any size"))?;
    if have < n {
        return Err(format!(
            "truncated ({have} of {n} bytes of {descr} data for shape {shape_txt})"
        ));
    }
    if have > n {
        return Err(format!(
            "{have} bytes of data after the header, shape {shape_txt} of {descr} needs {n}"
        ));
    }
    Ok(n)
}

/// Append the values in `piece` (whole elements of `dtype`) to `out` as f32: f16 widened
/// exactly, f64 rounded to nearest (past f32's range to ±inf).
pub fn decode_piece(dtype: Dtype, piece: &[u8], out: &mut Vec<f32>) {
    let big = dtype.big_endian;
    match dtype.size {
        2 => out.extend(piece.chunks_exact(2).map(|c| {
            let b = [c[0], c[1]];
            f16_to_f32(if big {
                u16::from_be_bytes(b)
            } else {
                u16::from_le_bytes(b)
            })
        })),
        4 => out.extend(piece.chunks_exact(4).map(|c| {
            let b = [c[0], c[1], c[2], c[3]];
            if big {
                f32::from_be_bytes(b)
            } else {
                f32::from_le_bytes(b)
            }
        })),
        _ => out.extend(piece.chunks_exact(8).map(|c| {
            let b: [u8; 8] = c.try_into().expect("chunks of 8");
            (if big {
                f64::from_be_bytes(b)
            } else {
                f64::from_le_bytes(b)
            }) as f32
        })),
    }
}

/// IEEE half to single, exactly (subnormals, infinities and NaN payloads included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value m·2^-24, normalised.
            let shift = m.leading_zeros() - 21; // bring the top bit to bit 10
            let m = (m << shift) & 0x3ff;
            sign | ((113 - shift) << 23) | (m << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Decode a whole `.npy` file held in memory (an archive member) whose manifest entry lists
/// `shape`, to f32 values in C order (a Fortran-order file is transposed).
pub fn decode_file(bytes: &[u8], shape: &[usize]) -> Result<Vec<f32>, String> {
    let mut r = bytes;
    let h = read_header(&mut r)?;
    let data = &bytes[h.data_offset as usize..];
    let n = check_payload(&h, shape, data.len() as u64)?;
    let mut out = Vec::new();
    out.try_reserve_exact((n / h.dtype.size as u64) as usize)
        .map_err(|_| "more values than this machine can hold".to_string())?;
    decode_piece(h.dtype, data, &mut out);
    Ok(if h.fortran_order {
        fortran_to_c(&out, shape)
    } else {
        out
    })
}

/// Values of a Fortran-order (first axis fastest) array, reordered to C order.
pub fn fortran_to_c(v: &[f32], shape: &[usize]) -> Vec<f32> {
    let nd = shape.len();
    if nd < 2 {
        return v.to_vec();
    }
    // Fortran strides: 1, s0, s0·s1, …
    let mut fstride = vec![1usize; nd];
    for i in 1..nd {
        fstride[i] = fstride[i - 1] * shape[i - 1];
    }
    let mut out = Vec::with_capacity(v.len());
    let mut idx = vec![0usize; nd];
    for _ in 0..v.len() {
        out.push(v[idx.iter().zip(&fstride).map(|(i, s)| i * s).sum::<usize>()]);
        // Advance the C-order index: last axis fastest.
        for a in (0..nd).rev() {
            idx[a] += 1;
            if idx[a] < shape[a] {
                break;
            }
            idx[a] = 0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::{Duration, Instant};

    fn file(header: &str) -> Vec<u8> {
        let mut v = b"\x93NUMPY\x01\x00".to_vec();
        v.extend_from_slice(&(header.len() as u16).to_le_bytes());
        v.extend_from_slice(header.as_bytes());
        v
    }

    fn parse(header: &str) -> Result<Header, String> {
        read_header(&mut &file(header)[..])
    }

    #[test]
    fn reads_what_numpy_writes() {
        let text = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }          \n";
        let h = parse(text).unwrap();
        assert_eq!(h.shape, vec![2, 3]);
        assert_eq!(
            h.dtype,
            Dtype {
                size: 4,
                big_endian: false
            }
        );
        assert!(!h.fortran_order);
        assert_eq!(h.data_offset, 10 + text.len() as u64);
        let h = parse("{\"shape\": (7,), \"fortran_order\": True, \"descr\": \">f8\"}").unwrap();
        assert_eq!(
            (h.shape, h.fortran_order, h.dtype.descr()),
            (vec![7], true, ">f8".into())
        );
        assert_eq!(
            parse("{'descr':'<f2','fortran_order':False,'shape':()}")
                .unwrap()
                .shape,
            Vec::<u64>::new()
        );
        assert_eq!(
            parse("{'descr':'<f2','fortran_order':False,'shape':(3L, 4L)}")
                .unwrap()
                .shape,
            vec![3, 4]
        );
        // Version 2 and 3 have a four-byte length.
        let mut v = b"\x93NUMPY\x03\x00".to_vec();
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }\n";
        v.extend_from_slice(&(h.len() as u32).to_le_bytes());
        v.extend_from_slice(h.as_bytes());
        assert_eq!(
            read_header(&mut &v[..]).unwrap().data_offset,
            12 + h.len() as u64
        );
    }

    #[test]
    fn refuses_what_is_not_a_float_tap_header_in_one_line() {
        for (h, words) in [
            (
                "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }",
                "dtype <i4 is not a float type",
            ),
            (
                "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
                "structured",
            ),
            (
                "{'descr': '|O', 'fortran_order': False, 'shape': (2,), }",
                "not a float type",
            ),
            (
                "{'descr': '<f4', 'fortran_order': 0, 'shape': (2,), }",
                "True or False",
            ),
            (
                "{'descr': '<f4', 'fortran_order': Falsey, 'shape': (2,), }",
                "True or False",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': [[[[[[[[[[[[[[[[[[[[[[[[[[2]]]]]]]]]]]]]]]]]]]]]]]]]], }",
                "tuple",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': ((2,),), }",
                "dimension",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2), }",
                "comma",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }",
                "dimension",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,), }",
                "too large",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}",
                "key 'x'",
            ),
            (
                "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
                "given twice",
            ),
            ("{'descr': '<f4', 'shape': (2,)}", "no fortran_order"),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk",
                "text after",
            ),
            (
                "{'descr': '<f\\x34', 'fortran_order': False, 'shape': (2,)}",
                "quoted string",
            ),
            ("", "expected '{'"),
        ] {
            let e = parse(h).unwrap_err();
            assert!(e.contains(words), "{h}: {e}");
            assert!(!e.contains('\n') && e.chars().count() < 200, "{h}: {e}");
        }
        let shape = (0..65).map(|_| "1").collect::<Vec<_>>().join(",");
        let e = parse(&format!(
            "{{'descr':'<f4','fortran_order':False,'shape':({shape})}}"
        ))
        .unwrap_err();
        assert!(e.contains("64"), "{e}");
        assert!(
            read_header(&mut &b"\x93NUMPY\x09\x00\x00\x00"[..])
                .unwrap_err()
                .contains("version 9")
        );
        assert!(
            read_header(&mut &b"\x93NUMP"[..])
                .unwrap_err()
                .contains("ends inside")
        );
        assert!(
            read_header(&mut &b"PK\x03\x04xxxxxxxx"[..])
                .unwrap_err()
                .contains("magic")
        );
        // A length field past the cap is refused before anything that long is read or held.
        let mut v = b"\x93NUMPY\x02\x00".to_vec();
        v.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            read_header(&mut &v[..])
                .unwrap_err()
                .contains("more than a header can be")
        );
    }

    #[test]
    fn a_deeply_nested_header_is_refused_at_once() {
        // npyz took 30 s at 18 levels and doubled per level; ours reads each byte once.
        for depth in [26usize, 5000, 30000] {
            let shape = format!("{}2{}", "[".repeat(depth), "]".repeat(depth));
            for h in [
                format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"),
                format!("{{'descr': {shape}, 'fortran_order': False, 'shape': (2,), }}"),
                format!("{{'descr': '<f4', 'fortran_order': {shape}, 'shape': (2,), }}"),
                format!("{{'descr': '<f4', 'x': {shape}}}"),
            ] {
                let t = Instant::now();
                assert!(parse(&h).is_err());
                assert!(
                    t.elapsed() < Duration::from_millis(200),
                    "{depth}: {:?}",
                    t.elapsed()
                );
            }
        }
    }

    #[test]
    fn excerpts_are_short_and_single_line() {
        assert_eq!(excerpt("abc", 80), "abc");
        assert_eq!(
            excerpt(&"x".repeat(4 << 20), 80),
            format!("{}…", "x".repeat(80))
        );
        assert_eq!(excerpt("a\nb\x1b[31m", 80), "a\\nb\\u{1b}[31m");
    }

    /// Headers made of the format's own tokens in any order: the grammar's neighbourhood.
    fn hostile_header() -> impl Strategy<Value = String> {
        let token = prop_oneof![
            Just("{".to_string()),
            Just("}".to_string()),
            Just("(".to_string()),
            Just(")".to_string()),
            Just("[".to_string()),
            Just("]".to_string()),
            Just(",".to_string()),
            Just(":".to_string()),
            Just(" ".to_string()),
            Just("'descr'".to_string()),
            Just("'shape'".to_string()),
            Just("'fortran_order'".to_string()),
            Just("'<f4'".to_string()),
            Just("'>f2'".to_string()),
            Just("True".to_string()),
            Just("False".to_string()),
            Just("'".to_string()),
            Just("\\".to_string()),
            "[0-9]{1,25}L?",
        ];
        prop::collection::vec(token, 0..400).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        /// Any bytes after the magic: an error or a header, never a panic, always quickly.
        #[test]
        fn arbitrary_bytes_never_panic(version in 0u8..5, body in prop::collection::vec(any::<u8>(), 0..2048)) {
            let mut v = b"\x93NUMPY".to_vec();
            v.push(version);
            v.push(0);
            v.extend_from_slice(&body);
            let t = Instant::now();
            let r = read_header(&mut &v[..]);
            prop_assert!(t.elapsed() < Duration::from_millis(100));
            if let Err(e) = r {
                prop_assert!(!e.contains('\n') && e.chars().count() < 300, "{e}");
            }
        }

        /// Structured but hostile headers: parse (and then say exactly what a header may) or
        /// refuse in one short line, in bounded time.
        #[test]
        fn hostile_headers_parse_or_refuse(h in hostile_header()) {
            let t = Instant::now();
            let r = parse(&h);
            prop_assert!(t.elapsed() < Duration::from_millis(100));
            match r {
                Ok(head) => prop_assert!(head.shape.len() <= MAX_DIMS),
                Err(e) => prop_assert!(!e.contains('\n') && e.chars().count() < 300, "{e}"),
            }
        }

        /// Every header numpy could write for a float tap parses back to what it states.
        #[test]
        fn valid_headers_round_trip(
            shape in prop::collection::vec(0u64..1 << 40, 0..8),
            d in 0usize..6,
            fortran in any::<bool>(),
            pad in 0usize..64,
        ) {
            let descr = ["<f4", ">f4", "<f2", ">f2", "<f8", ">f8"][d];
            let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
            let tuple = match dims.len() {
                1 => format!("({},)", dims[0]),
                _ => format!("({})", dims.join(", ")),
            };
            let f = if fortran { "True" } else { "False" };
            let h = format!("{{'descr': '{descr}', 'fortran_order': {f}, 'shape': {tuple}, }}{}\n", " ".repeat(pad));
            let head = parse(&h).unwrap();
            prop_assert_eq!(head.shape, shape);
            prop_assert_eq!(head.fortran_order, fortran);
            prop_assert_eq!(head.dtype.descr(), descr);
        }
    }

    #[test]
    fn f16_decodes_exactly_as_half_does() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn written_files_read_back_with_their_shape() {
        for shape in [vec![3usize], vec![2, 3], vec![2, 1, 4], vec![1; 9]] {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 1.0).collect();
            let f = f32_file(&shape, &data);
            let h = read_header(&mut &f[..]).unwrap();
            assert_eq!(h.data_offset % 64, 0, "numpy pads the header to 64 bytes");
            assert_eq!(h.shape, shape.iter().map(|&d| d as u64).collect::<Vec<_>>());
            assert_eq!(decode_file(&f, &shape).unwrap(), data);
            assert!(
                decode_file(&f[..f.len() - 1], &shape)
                    .unwrap_err()
                    .contains("truncated")
            );
            let mut wrong = shape.clone();
            wrong[0] += 1;
            assert!(decode_file(&f, &wrong).unwrap_err().contains("differs"));
        }
    }

    #[test]
    fn fortran_order_is_transposed_to_c_order() {
        // [[0, 1, 2], [3, 4, 5]] stored first axis fastest: 0 3 1 4 2 5.
        let f = [0.0, 3.0, 1.0, 4.0, 2.0, 5.0];
        assert_eq!(
            fortran_to_c(&f, &[2, 3]),
            vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        );
    }
}
