//! llama.cpp's two hand-written splitters (GPT-2 and LLaMA-3 patterns).

use super::*;

pub(super) const OUT_OF_RANGE: u32 = 0xFFFF_FFFF;

/// Shared state of llama.cpp's hand-written splitters for one fragment.
pub(super) struct Cursor<'a> {
    pub(super) cpts: &'a [char],
    pub(super) ini: usize,
    pub(super) end: usize,
    pub(super) prev_end: usize,
    pub(super) out: &'a mut Vec<usize>,
}

impl Cursor<'_> {
    pub(super) fn cpt(&self, pos: usize) -> u32 {
        if pos >= self.ini && pos < self.end {
            self.cpts[pos] as u32
        } else {
            OUT_OF_RANGE
        }
    }
    pub(super) fn flags(&self, pos: usize) -> u16 {
        if pos >= self.ini && pos < self.end {
            cpt_flags(self.cpts[pos] as u32)
        } else {
            0
        }
    }
    pub(super) fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }
}

pub(super) fn is_l(f: u16) -> bool {
    f & F_LETTER != 0
}
pub(super) fn is_n(f: u16) -> bool {
    f & F_NUMBER != 0
}
pub(super) fn is_ws(f: u16) -> bool {
    f & F_WHITESPACE != 0
}

/// llama.cpp's `unicode_regex_split_custom_gpt2`.
pub(super) fn split_gpt2(cpts: &[char], offsets: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &offset in offsets {
        let (ini, end) = (start, start + offset);
        start = end;
        let mut k = Cursor {
            cpts,
            ini,
            end,
            prev_end: ini,
            out: &mut out,
        };
        let mut pos = ini;
        while pos < end {
            let cpt = k.cpt(pos);
            let flags = k.flags(pos);
            if cpt == '\'' as u32 && pos + 1 < end {
                let n = k.cpt(pos + 1);
                if [b's', b't', b'm', b'd'].iter().any(|&x| n == x as u32) {
                    pos += k.add(pos + 2);
                    continue;
                }
                if pos + 2 < end {
                    let nn = k.cpt(pos + 2);
                    let pair = |a: u8, b: u8| n == a as u32 && nn == b as u32;
                    if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
                        pos += k.add(pos + 3);
                        continue;
                    }
                }
            }
            let sp = cpt == ' ' as u32;
            let mut f2 = if sp { k.flags(pos + 1) } else { flags };
            if is_l(f2) {
                pos += usize::from(sp);
                while is_l(f2) {
                    pos += 1;
                    f2 = k.flags(pos);
                }
                k.add(pos);
                continue;
            }
            if is_n(f2) {
                pos += usize::from(sp);
                while is_n(f2) {
                    pos += 1;
                    f2 = k.flags(pos);
                }
                k.add(pos);
                continue;
            }
            let other = |f: u16| !(is_ws(f) || is_l(f) || is_n(f)) && f != 0;
            if other(f2) {
                pos += usize::from(sp);
                while other(f2) {
                    pos += 1;
                    f2 = k.flags(pos);
                }
                k.add(pos);
                continue;
            }
            let mut nws = 0;
            while is_ws(k.flags(pos + nws)) {
                nws += 1;
            }
            if nws > 1 && k.cpt(pos + nws) != OUT_OF_RANGE {
                pos += nws - 1;
                k.add(pos);
                continue;
            }
            if nws > 0 {
                pos += nws;
                k.add(pos);
                continue;
            }
            pos += 1;
            k.add(pos);
        }
    }
    out
}

/// llama.cpp's `unicode_regex_split_custom_llama3`.
pub(super) fn split_llama3(cpts: &[char], offsets: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &offset in offsets {
        let (ini, end) = (start, start + offset);
        start = end;
        let mut k = Cursor {
            cpts,
            ini,
            end,
            prev_end: ini,
            out: &mut out,
        };
        let mut pos = ini;
        let (cr, lf) = ('\r' as u32, '\n' as u32);
        while pos < end {
            let cpt = k.cpt(pos);
            let flags = k.flags(pos);
            if cpt == '\'' as u32 && pos + 1 < end {
                let n = to_lower(k.cpt(pos + 1));
                if [b's', b't', b'm', b'd'].iter().any(|&x| n == x as u32) {
                    pos += k.add(pos + 2);
                    continue;
                }
                if pos + 2 < end {
                    let nn = to_lower(k.cpt(pos + 2));
                    let pair = |a: u8, b: u8| n == a as u32 && nn == b as u32;
                    if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
                        pos += k.add(pos + 3);
                        continue;
                    }
                }
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(cpt == cr || cpt == lf || is_n(flags)) && (is_l(flags) || is_l(k.flags(pos + 1))) {
                pos += 1;
                while is_l(k.flags(pos)) {
                    pos += 1;
                }
                k.add(pos);
                continue;
            }
            // \p{N}{1,3}
            if is_n(flags) {
                let mut i0 = pos;
                while is_n(k.flags(pos)) {
                    pos += 1;
                    if pos - i0 >= 3 {
                        k.add(pos);
                        i0 = pos;
                    }
                }
                k.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+[\r\n]*
            let sp = cpt == ' ' as u32;
            let mut f2 = if sp { k.flags(pos + 1) } else { flags };
            let other = |f: u16| !(is_ws(f) || is_l(f) || is_n(f));
            if other(f2) && flags != 0 {
                pos += usize::from(sp);
                while other(f2) && f2 != 0 {
                    pos += 1;
                    f2 = k.flags(pos);
                }
                let mut c2 = k.cpt(pos);
                while c2 == cr || c2 == lf {
                    pos += 1;
                    c2 = k.cpt(pos);
                }
                k.add(pos);
                continue;
            }
            let mut nws = 0;
            let mut last_rn = 0;
            while is_ws(k.flags(pos + nws)) {
                let c2 = k.cpt(pos + nws);
                if c2 == cr || c2 == lf {
                    last_rn = pos + nws + 1;
                }
                nws += 1;
            }
            if last_rn > 0 {
                pos = last_rn;
                k.add(pos);
                continue;
            }
            if nws > 1 && k.cpt(pos + nws) != OUT_OF_RANGE {
                pos += nws - 1;
                k.add(pos);
                continue;
            }
            if nws > 0 {
                pos += nws;
                k.add(pos);
                continue;
            }
            pos += 1;
            k.add(pos);
        }
    }
    out
}
