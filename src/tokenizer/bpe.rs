//! Byte-level BPE (llama.cpp's `llm_tokenizer_bpe`): the merge loop on `tokenizers`' BPE model,
//! and a transcription of llama.cpp's loop for what that model cannot express.

use super::*;

pub(super) struct BpeState {
    pub(super) splitter: PreTokenizer,
    /// Merge ranks keyed by "left right" (llama.cpp's `bpe_ranks`; the first occurrence wins).
    pub(super) ranks: HashMap<String, u32>,
    pub(super) ignore_merges: bool,
    /// The `tokenizers` BPE model; `None` when some merge cannot be expressed in it exactly.
    pub(super) hf: Option<BPE>,
    /// Characters that are tokens by themselves (a word made only of these can go to `hf`).
    pub(super) single_char_tokens: HashSet<char>,
}

impl Tokenizer {
    /// llama.cpp's `llm_tokenizer_bpe_session::tokenize`.
    pub(super) fn bpe_tokenize(&self, text: &str, out: &mut Vec<u32>) {
        let st = self.bpe.as_ref().expect("BPE vocabulary has BPE state");
        for word in st.splitter.split(text) {
            if word.is_empty() {
                continue;
            }
            if st.ignore_merges
                && let Some(&id) = self.token_to_id.get(&word)
            {
                out.push(id);
                continue;
            }
            if let Some(hf) = &st.hf
                && word.chars().all(|c| st.single_char_tokens.contains(&c))
                && let Ok(toks) = hf.tokenize(&word)
            {
                out.extend(toks.into_iter().map(|t| t.id));
                continue;
            }
            self.bpe_word_by_hand(st, &word, out);
        }
    }

    /// A transcription of llama.cpp's BPE merge loop for one (byte-encoded) word.
    pub(super) fn bpe_word_by_hand(&self, st: &BpeState, word: &str, out: &mut Vec<u32>) {
        struct Sym {
            prev: isize,
            next: isize,
            start: usize,
            n: usize,
        }
        #[derive(PartialEq, Eq)]
        struct Bigram {
            rank: u32,
            left: usize,
            right: usize,
            text: String,
        }
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Bigram {
            // Lowest rank first; ties go to the leftmost pair.
            fn cmp(&self, o: &Self) -> Ordering {
                o.rank.cmp(&self.rank).then_with(|| o.left.cmp(&self.left))
            }
        }
        let mut syms: Vec<Sym> = Vec::new();
        for (i, (start, c)) in word.char_indices().enumerate() {
            let n = c.len_utf8();
            syms.push(Sym {
                prev: i as isize - 1,
                next: if start + n == word.len() {
                    -1
                } else {
                    i as isize + 1
                },
                start,
                n,
            });
        }
        let mut key = String::new();
        let mut heap = BinaryHeap::new();
        let mut add =
            |syms: &Vec<Sym>, heap: &mut BinaryHeap<Bigram>, left: isize, right: isize| {
                if left < 0 || right < 0 {
                    return;
                }
                let (l, r) = (&syms[left as usize], &syms[right as usize]);
                let ls = &word[l.start..l.start + l.n];
                let rs = &word[r.start..r.start + r.n];
                key.clear();
                key.push_str(ls);
                key.push(' ');
                key.push_str(rs);
                if let Some(&rank) = st.ranks.get(&key) {
                    heap.push(Bigram {
                        rank,
                        left: left as usize,
                        right: right as usize,
                        text: format!("{ls}{rs}"),
                    });
                }
            };
        for i in 1..syms.len() {
            add(&syms, &mut heap, i as isize - 1, i as isize);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (&syms[b.left], &syms[b.right]);
            if l.n == 0 || r.n == 0 {
                continue;
            }
            // Stale if the two symbols no longer spell the pair (they are adjacent in the word).
            if l.start + l.n != r.start || &word[l.start..r.start + r.n] != b.text.as_str() {
                continue;
            }
            let rn = r.n;
            let rnext = r.next;
            syms[b.left].n += rn;
            syms[b.right].n = 0;
            syms[b.left].next = rnext;
            if rnext >= 0 {
                syms[rnext as usize].prev = b.left as isize;
            }
            let lprev = syms[b.left].prev;
            add(&syms, &mut heap, lprev, b.left as isize);
            add(&syms, &mut heap, b.left as isize, rnext);
        }
        for s in syms.iter().filter(|s| s.n > 0) {
            let piece = &word[s.start..s.start + s.n];
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    // llama.cpp looks each raw byte up as a one-byte token and skips misses.
                    for &b in piece.as_bytes() {
                        if b < 0x80
                            && let Some(&id) = self.token_to_id.get(&(b as char).to_string())
                        {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }
}

impl BpeState {
    pub(super) fn new(
        pre: &str,
        cfg: &PreConfig,
        tokens: &[String],
        token_to_id: &HashMap<String, u32>,
        merges: Vec<(String, String)>,
    ) -> Result<BpeState, TokenizerError> {
        let splitter = PreTokenizer::new(pre, cfg.regexes)?;
        let mut ranks: HashMap<String, u32> = HashMap::with_capacity(merges.len());
        let mut hf_merges = Vec::with_capacity(merges.len());
        let mut exact = true;
        for (i, (l, r)) in merges.into_iter().enumerate() {
            let key = format!("{l} {r}");
            if ranks.contains_key(&key) {
                continue; // llama.cpp's `emplace` keeps the first rank
            }
            ranks.insert(key, i as u32);
            let whole = format!("{l}{r}");
            if token_to_id.contains_key(&l)
                && token_to_id.contains_key(&r)
                && token_to_id.contains_key(&whole)
            {
                hf_merges.push((l, r));
            } else {
                exact = false;
            }
        }
        let single_char_tokens: HashSet<char> = tokens
            .iter()
            .filter_map(|t| {
                let mut cs = t.chars();
                match (cs.next(), cs.next()) {
                    (Some(c), None) => Some(c),
                    _ => None,
                }
            })
            .collect();
        let hf = if exact {
            let vocab: BpeVocab = token_to_id.iter().map(|(k, &v)| (k.clone(), v)).collect();
            BPE::builder()
                .vocab_and_merges(vocab, hf_merges)
                .build()
                .ok()
        } else {
            None
        };
        Ok(BpeState {
            splitter,
            ranks,
            ignore_merges: cfg.ignore_merges,
            hf,
            single_char_tokens,
        })
    }
}
