//! Unicode tables as llama.cpp's unicode.cpp has them: category flags, lowercase, NFD, and
//! GPT-2's byte↔unicode map.

use super::*;

pub(super) const F_UNDEFINED: u16 = 0x0001;
pub(super) const F_NUMBER: u16 = 0x0002;
pub(super) const F_LETTER: u16 = 0x0004;
pub(super) const F_SEPARATOR: u16 = 0x0008;
pub(super) const F_MARK: u16 = 0x0010;
pub(super) const F_PUNCT: u16 = 0x0020;
pub(super) const F_SYMBOL: u16 = 0x0040;
pub(super) const F_CONTROL: u16 = 0x0080;
pub(super) const F_WHITESPACE: u16 = 0x0100;
pub(super) const MAX_CODEPOINTS: usize = 0x110000;

/// Codepoints assigned in Unicode 16.0, which the `regex` crate knows and llama.cpp's tables
/// (`unicode-data.cpp`, Unicode 15.1) do not: llama.cpp classes them as undefined, with no case
/// mapping. Found by comparing with the tables of a llama.cpp build (see the
/// `unicode_tables_match_llama_cpp` test).
pub(super) const NEWER_THAN_LLAMA_CPP: &[(u32, u32)] = &[
    (0x897, 0x897),
    (0x1B4E, 0x1B4F),
    (0x1B7F, 0x1B7F),
    (0x1C89, 0x1C8A),
    (0x2427, 0x2429),
    (0x31E4, 0x31E5),
    (0xA7CB, 0xA7CD),
    (0xA7DA, 0xA7DC),
    (0x105C0, 0x105F3),
    (0x10D40, 0x10D65),
    (0x10D69, 0x10D85),
    (0x10D8E, 0x10D8F),
    (0x10EC2, 0x10EC4),
    (0x10EFC, 0x10EFC),
    (0x11380, 0x11389),
    (0x1138B, 0x1138B),
    (0x1138E, 0x1138E),
    (0x11390, 0x113B5),
    (0x113B7, 0x113C0),
    (0x113C2, 0x113C2),
    (0x113C5, 0x113C5),
    (0x113C7, 0x113CA),
    (0x113CC, 0x113D5),
    (0x113D7, 0x113D8),
    (0x113E1, 0x113E2),
    (0x116D0, 0x116E3),
    (0x11BC0, 0x11BE1),
    (0x11BF0, 0x11BF9),
    (0x11F5A, 0x11F5A),
    (0x13460, 0x143FA),
    (0x16100, 0x16139),
    (0x16D40, 0x16D79),
    (0x18CFF, 0x18CFF),
    (0x1CC00, 0x1CCF9),
    (0x1CD00, 0x1CEB3),
    (0x1E5D0, 0x1E5FA),
    (0x1E5FF, 0x1E5FF),
    (0x1F8B2, 0x1F8BB),
    (0x1F8C0, 0x1F8C1),
    (0x1FA89, 0x1FA89),
    (0x1FA8F, 0x1FA8F),
    (0x1FABE, 0x1FABE),
    (0x1FAC6, 0x1FAC6),
    (0x1FADC, 0x1FADC),
    (0x1FADF, 0x1FADF),
    (0x1FAE9, 0x1FAE9),
    (0x1FBCB, 0x1FBEF),
];

/// Category flags per codepoint, as llama.cpp's `unicode_cpt_flags_from_cpt`: exactly one of
/// N, L, Z, M, P, S, C (Cc, Cf, Co; surrogates) or "undefined" (unassigned), plus White_Space.
pub(super) fn flags_table() -> &'static [u16] {
    static TABLE: OnceLock<Vec<u16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![F_CONTROL; MAX_CODEPOINTS];
        let all: String = (0..MAX_CODEPOINTS as u32)
            .filter_map(char::from_u32)
            .collect();
        for (pat, flag) in [
            (r"\p{Cn}+", F_UNDEFINED),
            (r"\p{N}+", F_NUMBER),
            (r"\p{L}+", F_LETTER),
            (r"\p{Z}+", F_SEPARATOR),
            (r"\p{M}+", F_MARK),
            (r"\p{P}+", F_PUNCT),
            (r"\p{S}+", F_SYMBOL),
        ] {
            let re = regex::Regex::new(pat).expect("static category regex");
            for m in re.find_iter(&all) {
                for c in m.as_str().chars() {
                    t[c as usize] = flag;
                }
            }
        }
        for &(a, b) in NEWER_THAN_LLAMA_CPP {
            t[a as usize..=b as usize].fill(F_UNDEFINED);
        }
        for c in all.chars().filter(|c| c.is_whitespace()) {
            t[c as usize] |= F_WHITESPACE;
        }
        t
    })
}

pub(super) fn cpt_flags(c: u32) -> u16 {
    flags_table()
        .get(c as usize)
        .copied()
        .unwrap_or(F_UNDEFINED)
}

/// llama.cpp's `unicode_tolower`: the first character of the lowercase mapping (none for
/// codepoints llama.cpp's tables do not know).
pub(super) fn to_lower(c: u32) -> u32 {
    if cpt_flags(c) & F_UNDEFINED != 0 {
        return c;
    }
    match char::from_u32(c) {
        Some(ch) => ch.to_lowercase().next().map_or(c, |l| l as u32),
        None => c,
    }
}

/// llama.cpp's `unicode_cpts_normalize_nfd`: each codepoint becomes the first codepoint of its
/// NFD decomposition (the accents are dropped, not kept).
pub(super) fn nfd_first(c: char) -> char {
    if c.is_ascii() {
        return c;
    }
    if c == '\u{11938}' {
        // DIVES AKURU VOWEL SIGN O = U+11935 U+11930; missing from the normalization tables
        // `tokenizers` uses.
        return '\u{11935}';
    }
    let mut n = NormalizedString::from(c.to_string());
    n.nfd();
    n.get().chars().next().unwrap_or(c)
}

/// GPT-2's bytes→unicode table (llama.cpp's `unicode_byte_to_utf8_map`).
pub(super) fn byte_to_char_table() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut n = 0u32;
        for b in 0..256u32 {
            let keep = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            t[b as usize] = if keep {
                char::from_u32(b).unwrap()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap()
            };
        }
        t
    })
}

pub(super) fn char_to_byte_table() -> &'static HashMap<char, u8> {
    static TABLE: OnceLock<HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        byte_to_char_table()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    })
}

/// llama.cpp's `llama_decode_text`: byte-level BPE token text → bytes.
pub(super) fn byte_decode_text(text: &str) -> Vec<u8> {
    let map = char_to_byte_table();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

pub(super) fn byte_encode(word: &str) -> String {
    let t = byte_to_char_table();
    word.bytes().map(|b| t[b as usize]).collect()
}
