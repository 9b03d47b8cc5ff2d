//! Strings read from files (manifests, GGUF metadata, token text, snapshots, a child's log) as
//! they may be printed on a terminal. A file is untrusted: an ESC sequence in a producer name
//! could recolour, move the cursor or retitle the terminal, a bidi override could reorder a
//! line as it is seen, and a newline could start a line of its own that reads like parity's
//! (`verdict: parity`). Every print site of a file-derived string goes through one of these:
//!
//! - [`shown`]: one value inside a line (a name, a path, a key): every control character
//!   escaped, a newline as `\n`, at most [`MAX_VALUE`] characters then `…`;
//! - [`line`]: a whole line parity composed around such values (a note, an error line): the
//!   same escapes, one line, at most [`MAX_LINE`] characters;
//! - [`text`]: text whose newlines are the product (generated text, a child's log): newlines
//!   and tabs kept, every other control character escaped, no cap.
//!
//! Ordinary text (printable characters, no bidi controls, within the cap) comes back borrowed
//! and unchanged. HTML and JSON escape on their own and do not use this.

use std::borrow::Cow;
use std::fmt::Write;

/// The longest single value shown, in characters.
pub const MAX_VALUE: usize = 200;
/// The longest line shown, in characters (an error line quoting a 4 MB snapshot line stays
/// readable).
pub const MAX_LINE: usize = 2000;

/// Characters that must not reach a terminal as they are: C0 controls, DEL, C1 controls, the
/// bidi embeddings, overrides and isolates (U+202A–U+202E, U+2066–U+2069) and marks
/// (U+200E, U+200F, U+061C), and the Unicode line and paragraph separators.
fn escaped(c: char) -> bool {
    matches!(c,
        '\0'..='\x1f' | '\x7f'..='\u{9f}'
        | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        | '\u{200e}' | '\u{200f}' | '\u{061c}'
        | '\u{2028}' | '\u{2029}')
}

/// How a line ending is shown.
#[derive(Clone, Copy, PartialEq)]
enum Newlines {
    /// As `\n` (inside a value or a line).
    Escape,
    /// Kept (text whose lines are the product).
    Keep,
}

fn sanitize(s: &str, newlines: Newlines, cap: Option<usize>) -> Cow<'_, str> {
    let keep = |c: char| newlines == Newlines::Keep && (c == '\n' || c == '\t');
    let over = cap.is_some_and(|n| s.chars().nth(n).is_some());
    if !over && !s.chars().any(|c| escaped(c) && !keep(c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len().min(cap.unwrap_or(usize::MAX)) + 8);
    // The cap counts characters shown, escapes included, so a value of ESCs stays short too.
    let mut shown = 0usize;
    for c in s.chars() {
        let piece: Cow<str> = if keep(c) || !escaped(c) {
            Cow::Owned(c.to_string())
        } else {
            match c {
                '\n' => "\\n".into(),
                '\r' => "\\r".into(),
                '\t' => "\\t".into(),
                c if (c as u32) < 0x80 => format!("\\x{:02x}", c as u32).into(),
                c => format!("\\u{{{:x}}}", c as u32).into(),
            }
        };
        let n = piece.chars().count();
        if cap.is_some_and(|cap| shown + n > cap) {
            out.push('…');
            return Cow::Owned(out);
        }
        shown += n;
        let _ = out.write_str(&piece);
    }
    Cow::Owned(out)
}

/// One value from a file, as it may sit inside a line: control characters and bidi controls
/// escaped (`\x1b`, `\u{202e}`), a newline as `\n`, at most [`MAX_VALUE`] characters then `…`.
pub fn shown(s: &str) -> Cow<'_, str> {
    sanitize(s, Newlines::Escape, Some(MAX_VALUE))
}

/// A whole line parity composed around values from files (a note, an error): escaped as
/// [`shown`], so it stays one line, at most [`MAX_LINE`] characters then `…`.
pub fn line(s: &str) -> Cow<'_, str> {
    sanitize(s, Newlines::Escape, Some(MAX_LINE))
}

/// Multi-line text that is the product itself (generated text, a child process's log):
/// newlines and tabs kept, every other control character escaped, not capped.
pub fn text(s: &str) -> Cow<'_, str> {
    sanitize(s, Newlines::Keep, None)
}

/// At most `n` characters of `s`, then `…`: for values printed through `{:?}` (which escapes
/// on its own) that still need a bound.
pub fn capped(s: &str, n: usize) -> Cow<'_, str> {
    match s.char_indices().nth(n) {
        None => Cow::Borrowed(s),
        Some((i, _)) => Cow::Owned(format!("{}…", &s[..i])),
    }
}

/// Serialized JSON with every character [`shown`] escapes written as a `\uXXXX` escape: serde
/// escapes C0 controls but writes DEL, C1, bidi controls and line separators raw, and a JSON
/// report printed to a terminal (`--json -`) must not carry them. Those characters can only
/// stand inside strings there, so the JSON means the same.
pub fn json(s: String) -> String {
    if !s.chars().any(|c| c >= '\x7f' && escaped(c)) {
        return s;
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if c >= '\x7f' && escaped(c) {
            // Every such character is in the BMP: one escape.
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ordinary_text_is_unchanged_and_borrowed() {
        for s in [
            "",
            "llama.cpp/cpu",
            "blk.0.attn_q.weight",
            "Ġthe ▁word 日本語 émoji 🦙",
            "model: /tmp/x y.gguf",
        ] {
            assert!(matches!(shown(s), Cow::Borrowed(_)), "{s}");
            assert!(matches!(line(s), Cow::Borrowed(_)), "{s}");
            assert!(matches!(text(s), Cow::Borrowed(_)), "{s}");
        }
        assert!(matches!(text("two\nlines\tand a tab"), Cow::Borrowed(_)));
    }

    #[test]
    fn controls_and_bidi_are_escaped() {
        assert_eq!(shown("a\x1b[2Jb"), "a\\x1b[2Jb");
        assert_eq!(shown("x\ny\rz\t"), "x\\ny\\rz\\t");
        assert_eq!(shown("\x7f\u{85}\u{9b}"), "\\x7f\\u{85}\\u{9b}");
        assert_eq!(shown("abc\u{202e}fed"), "abc\\u{202e}fed");
        assert_eq!(
            shown("\u{2066}\u{2069}\u{200f}"),
            "\\u{2066}\\u{2069}\\u{200f}"
        );
        assert_eq!(line("e\nverdict: parity"), "e\\nverdict: parity");
        assert_eq!(text("ok\nline\x1b]0;t\x07"), "ok\nline\\x1b]0;t\\x07");
    }

    #[test]
    fn values_are_capped() {
        let long = "a".repeat(500);
        let s = shown(&long);
        assert_eq!(s.chars().count(), MAX_VALUE + 1);
        assert!(s.ends_with('…'));
        // Escapes count towards the cap: 500 ESCs do not become 2000 characters.
        let esc = "\x1b".repeat(500);
        assert!(shown(&esc).chars().count() <= MAX_VALUE + 1);
        assert_eq!(shown(&"b".repeat(MAX_VALUE)), "b".repeat(MAX_VALUE));
        assert!(line(&"c".repeat(10_000)).chars().count() <= MAX_LINE + 1);
        assert_eq!(capped("日本語", 2), "日本…");
        assert_eq!(capped("ab", 2), "ab");
    }

    #[test]
    fn json_escapes_what_serde_writes_raw_and_means_the_same() {
        let v = serde_json::json!({"name": "a\u{202e}b\u{85}c\u{2028}d\x7fe\x1b日本"});
        let raw = serde_json::to_string_pretty(&v).unwrap();
        assert!(raw.contains('\u{202e}'), "serde writes it raw: {raw}");
        let safe = json(raw);
        assert!(!safe.chars().any(|c| escaped(c) && c != '\n'), "{safe}");
        assert!(safe.contains("\\u202e") && safe.contains("\\u0085") && safe.contains("\\u007f"));
        assert_eq!(serde_json::from_str::<serde_json::Value>(&safe).unwrap(), v);
        let plain = serde_json::to_string_pretty(&serde_json::json!({"a": "日本 ok"})).unwrap();
        assert_eq!(json(plain.clone()), plain);
    }

    proptest! {
        /// Whatever a file holds, a shown value or line is one line of printable text within
        /// its cap, and text keeps no control character but newline and tab.
        #[test]
        fn nothing_escapes(s in any::<String>()) {
            for (v, cap) in [(shown(&s), MAX_VALUE), (line(&s), MAX_LINE)] {
                prop_assert!(!v.chars().any(escaped), "{v:?}");
                prop_assert!(v.chars().count() <= cap + 1);
            }
            prop_assert!(!text(&s).chars().any(|c| escaped(c) && c != '\n' && c != '\t'));
        }
    }
}
