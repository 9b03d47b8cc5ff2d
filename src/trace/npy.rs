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
}
