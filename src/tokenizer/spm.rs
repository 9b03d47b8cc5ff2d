//! SentencePiece-style tokenization (llama.cpp's `llm_tokenizer_spm`).

use super::*;

impl Tokenizer {
    /// llama.cpp's `llm_tokenizer_spm_session::tokenize` on already-escaped text.
    pub(super) fn spm_tokenize(
        &self,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        struct Sym {
            prev: isize,
            next: isize,
            start: usize,
            n: usize,
        }
        #[derive(PartialEq)]
        struct Bigram {
            score: f32,
            left: usize,
            right: usize,
            size: usize,
        }
        impl Eq for Bigram {}
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Bigram {
            // Highest score first; ties go to the leftmost pair.
            fn cmp(&self, o: &Self) -> Ordering {
                self.score
                    .total_cmp(&o.score)
                    .then_with(|| o.left.cmp(&self.left))
            }
        }

        let bytes = text.as_bytes();
        if bytes.is_empty() {
            return Ok(());
        }
        let mut syms: Vec<Sym> = Vec::new();
        let mut offs = 0;
        while offs < bytes.len() {
            let len = utf8_len(bytes[offs]).min(bytes.len() - offs);
            let idx = syms.len() as isize;
            syms.push(Sym {
                prev: idx - 1,
                next: if offs + len == bytes.len() {
                    -1
                } else {
                    idx + 1
                },
                start: offs,
                n: len,
            });
            offs += len;
        }
        let mut heap = BinaryHeap::new();
        let try_add =
            |syms: &Vec<Sym>, heap: &mut BinaryHeap<Bigram>, left: isize, right: isize| {
                if left < 0 || right < 0 {
                    return;
                }
                let (l, r) = (&syms[left as usize], &syms[right as usize]);
                let Some(s) = text.get(l.start..l.start + l.n + r.n) else {
                    return;
                };
                if let Some(&id) = self.token_to_id.get(s) {
                    heap.push(Bigram {
                        score: self.scores[id as usize],
                        left: left as usize,
                        right: right as usize,
                        size: s.len(),
                    });
                }
            };
        for i in 1..syms.len() {
            try_add(&syms, &mut heap, i as isize - 1, i as isize);
        }
        while let Some(b) = heap.pop() {
            let (ln, rn) = (syms[b.left].n, syms[b.right].n);
            if ln == 0 || rn == 0 || ln + rn != b.size {
                continue;
            }
            syms[b.left].n += rn;
            syms[b.right].n = 0;
            let rnext = syms[b.right].next;
            syms[b.left].next = rnext;
            if rnext >= 0 {
                syms[rnext as usize].prev = b.left as isize;
            }
            let lprev = syms[b.left].prev;
            try_add(&syms, &mut heap, lprev, b.left as isize);
            try_add(&syms, &mut heap, b.left as isize, rnext);
        }
        let mut i: isize = 0;
        while i != -1 {
            let s = &syms[i as usize];
            let piece = &text[s.start..s.start + s.n];
            // A merged symbol is always a token (merges only form tokens), so llama.cpp's
            // `rev_merge` re-segmentation never applies; a lone character that is not a token
            // is spelled out as byte tokens.
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.push(self.byte_to_token(b)?);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }

    /// llama.cpp's `byte_to_token` for SPM: `<0xXX>`, else the byte itself as a token.
    pub(super) fn byte_to_token(&self, b: u8) -> Result<u32, TokenizerError> {
        if let Some(&id) = self.token_to_id.get(&format!("<0x{b:02X}>")) {
            return Ok(id);
        }
        if b < 0x80
            && let Some(&id) = self.token_to_id.get(&(b as char).to_string())
        {
            return Ok(id);
        }
        Err(TokenizerError::MissingByteToken(b))
    }
}
