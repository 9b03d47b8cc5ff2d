#!/usr/bin/env python3
"""Write a tokenizer oracle corpus made by the real llama.cpp (llama-cpp-python's low-level
bindings), for tests/tokenizer_vocab.rs's `oracle_corpus_matches_llama_cpp`.

    python3 scripts/tokenizer_oracle.py VOCAB_DIR OUT.json [--random N] [--seed S]

For every `ggml-vocab-NAME.gguf` in VOCAB_DIR that llama.cpp loads, over llama.cpp's own test
strings (`.inp`, where there is one) plus N random strings (seeded: the same corpus every run)
mixing scripts, whitespace kinds, digits, emoji, combining marks, control, private-use and
unassigned codepoints and the vocabulary's special-token texts, it records

    ids               llama_tokenize(add_special=False, parse_special=False)
    ids_add_special   llama_tokenize(add_special=True,  parse_special=False)
    ids_parse_special llama_tokenize(add_special=False, parse_special=True)
    decoded           llama_detokenize(ids, remove_special=False, unparse_special=False)
    decoded_special   llama_detokenize(ids_parse_special, remove_special=True, unparse_special=True)

(`decoded*` as byte lists: a detokenized piece may end inside a UTF-8 sequence). A vocabulary
llama.cpp refuses is listed under "refused" with llama.cpp's reason, not silently dropped.
"""
import argparse
import ctypes
import json
import os
import random
import sys

import llama_cpp

SEP = "\n__ggml_vocab_test__\n"
_QUIET = None

# Pieces the random strings are built from: each a kind of text a tokenizer treats specially.
POOLS = {
    "ascii": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "digits": "0123456789",
    "punct": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "space": [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2009", "\u200b", "\v", "\f"],
    "latin": "àéîõüßçñøåæœÀÉÎÕÜÇÑØÅ",
    "greek_cyrillic": "αβγδεζηθλμπσωΑΒΓΔΩабвгдежзийклмнопрстуфхцчшщыэюяЖЩЯ",
    "cjk": "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现",
    "kana_hangul": "あいうえおかきくけこアイウエオカキクケコ한국어조선말안녕하세요",
    "arabic_hebrew_indic": "مرحبابالعالمשלוםעולםनमस्तेदुनियाவணக்கம்",
    "thai": "สวัสดีชาวโลก",
    "emoji": ["😀", "🦙", "👍🏽", "👨‍👩‍👧", "🇩🇪", "❤️", "✅", "🤖"],
    "combining": ["e\u0301", "a\u0308", "n\u0303", "\u0301", "\u0327", "\u20dd"],
    "control": ["\x00", "\x01", "\x07", "\x1b", "\x7f", "\u0085", "\u200e", "\ufeff"],
    "private_unassigned": ["\ue000", "\uf8ff", "\U000f0000", "\u0378", "\U0001fffe", "\U000e0001"],
}


def special_texts(model, n_vocab):
    """The texts of the vocabulary's control and user-defined tokens (BOS, EOS, <|...|>, ...)."""
    out = []
    for t in range(n_vocab):
        attr = llama_cpp.llama_vocab_get_attr(model.vocab, t)
        if attr & (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED):
            text = llama_cpp.llama_vocab_get_text(model.vocab, t)
            if text:
                out.append(text.decode("utf-8", "replace"))
    return out


def random_text(rng, specials):
    parts = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.choice(list(POOLS) + (["special"] if specials else []))
        if kind == "special":
            parts.append(rng.choice(specials))
            continue
        pool = POOLS[kind]
        n = rng.randint(1, 6)
        parts.append("".join(rng.choice(pool) for _ in range(n)))
        if rng.random() < 0.4:
            parts.append(" ")
    return "".join(parts)


def tokenize(vocab, text, add_special, parse_special):
    data = text.encode("utf-8")
    cap = len(data) + 16
    buf = (llama_cpp.llama_token * cap)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    assert n >= 0, f"llama_tokenize failed on {text!r}"
    return [int(x) for x in buf[:n]]


def detokenize(vocab, ids, remove_special, unparse_special):
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    cap = 64 + 32 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(cap)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
        if n >= 0:
            return list(buf.raw[:n])
        cap = -n + 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vocab_dir")
    ap.add_argument("out")
    ap.add_argument("--random", type=int, default=200, help="random strings per vocabulary")
    ap.add_argument("--seed", type=int, default=20261125)
    a = ap.parse_args()

    global _QUIET  # the callback must outlive every llama.cpp call
    _QUIET = llama_cpp.llama_log_callback(lambda *args: None)
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
    corpus, refused = {}, {}
    names = sorted(
        f[len("ggml-vocab-"):-len(".gguf")]
        for f in os.listdir(a.vocab_dir)
        if f.startswith("ggml-vocab-") and f.endswith(".gguf")
    )
    for name in names:
        path = os.path.join(a.vocab_dir, f"ggml-vocab-{name}.gguf")
        try:
            llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        except Exception as e:  # llama.cpp refuses the file (dbrx: a duplicate key)
            refused[name] = str(e).splitlines()[0] if str(e) else type(e).__name__
            continue
        vocab = llm._model.vocab
        texts = []
        if os.path.exists(path + ".inp"):
            with open(path + ".inp", encoding="utf-8") as f:
                texts = f.read().split(SEP)
        rng = random.Random(f"{a.seed}:{name}")
        specials = special_texts(llm._model, llm.n_vocab())
        texts += [random_text(rng, specials) for _ in range(a.random)]
        cases = []
        for text in texts:
            ids = tokenize(vocab, text, False, False)
            parse = tokenize(vocab, text, False, True)
            cases.append({
                "text": text,
                "ids": ids,
                "ids_add_special": tokenize(vocab, text, True, False),
                "decoded": detokenize(vocab, ids, False, False),
                "ids_parse_special": parse,
                "decoded_special": detokenize(vocab, parse, True, True),
            })
        corpus[name] = {"cases": cases}
        del llm
    tmp = a.out + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"vocabs": corpus, "refused": refused,
                   "llama_cpp": getattr(llama_cpp, "__version__", "?")}, f)
    os.replace(tmp, a.out)
    n = sum(len(v["cases"]) for v in corpus.values())
    print(f"wrote {a.out}: {len(corpus)} vocabularies, {n} cases; refused: "
          + (", ".join(f"{k} ({v})" for k, v in refused.items()) or "none"), file=sys.stderr)


if __name__ == "__main__":
    main()
