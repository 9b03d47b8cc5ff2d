//! WordPiece (llama.cpp's `llm_tokenizer_wpm`).

use super::*;

#[derive(Clone, Copy, Debug)]
pub(super) struct WpmOptions {
    pub(super) lowercase: bool,
    pub(super) strip_accents: bool,
}

impl Tokenizer {
    /// llama.cpp's `llm_tokenizer_wpm_session::tokenize`.
    pub(super) fn wpm_tokenize(&self, text: &str, out: &mut Vec<u32>) {
        for word in wpm_preprocess(text, self.wpm) {
            if word.is_empty() {
                continue;
            }
            let w1 = format!("\u{2581}{word}");
            let n = w1.len();
            let cur = out.len();
            let mut i = 0;
            while i < n {
                let mut matched = false;
                let jmax = n.min(i + self.max_token_len + 1);
                let mut j = jmax;
                while j > i {
                    if let Some(&id) = w1.get(i..j).and_then(|s| self.token_to_id.get(s)) {
                        out.push(id);
                        matched = true;
                        i = j;
                        break;
                    }
                    j -= 1;
                }
                if !matched {
                    out.truncate(cur);
                    break;
                }
            }
            if out.len() == cur {
                out.extend(self.unk);
            }
        }
    }

    // ---- pieces -------------------------------------------------------------------------------
}

pub(super) fn is_chinese_char(c: u32) -> bool {
    (0x4E00..=0x9FFF).contains(&c)
        || (0x3400..=0x4DBF).contains(&c)
        || (0x20000..=0x2A6DF).contains(&c)
        || (0x2A700..=0x2B73F).contains(&c)
        || (0x2B740..=0x2B81F).contains(&c)
        || (0x2B920..=0x2CEAF).contains(&c)
        || (0xF900..=0xFAFF).contains(&c)
        || (0x2F800..=0x2FA1F).contains(&c)
}

/// llama.cpp's `llm_tokenizer_wpm_session::preprocess`.
pub(super) fn wpm_preprocess(text: &str, opts: WpmOptions) -> Vec<String> {
    let mut words = vec![String::new()];
    for ch in text.chars() {
        let ch = if opts.strip_accents {
            nfd_first(ch)
        } else {
            ch
        };
        let c = ch as u32;
        let fl = cpt_flags(c);
        if fl & F_WHITESPACE != 0 {
            if !words.last().unwrap().is_empty() {
                words.push(String::new());
            }
            continue;
        }
        if c == 0 || c == 0xFFFD || fl & F_CONTROL != 0 {
            continue;
        }
        if opts.strip_accents && fl & F_MARK != 0 {
            continue;
        }
        let lc = if opts.lowercase {
            char::from_u32(to_lower(c)).unwrap_or(ch)
        } else {
            ch
        };
        if fl & F_PUNCT != 0 || (c < 0x7F && fl & F_SYMBOL != 0) || is_chinese_char(c) {
            if !words.last().unwrap().is_empty() {
                words.push(String::new());
            }
            words.last_mut().unwrap().push(lc);
            words.push(String::new());
        } else {
            words.last_mut().unwrap().push(lc);
        }
    }
    if words.last().is_some_and(String::is_empty) {
        words.pop();
    }
    words
}
