#!/usr/bin/env python3
"""Write a random-weight llama model of any size in Q4_0, streamed tensor by tensor with
llama.cpp's own GGUF writer (gguf-py): `parity fixture` builds its file in memory (4 GiB at
most), this never holds more than one tensor, so a 70B-shaped model (about 38 GB) is written on
a machine with less memory than the file (issue 30, item 3; scripts/huge_check.sh).

  scripts/huge_model.py OUT.gguf [--shape 70b|7b|tiny] [--vocab-from FIXTURE.gguf] [--seed N]

70b: Llama-2-70B's shape (8192/28672, 80 layers, 64 query heads over 8 K/V heads), the
vocabulary cut to 4000 tokens (the fixture's SentencePiece vocabulary, padded as `parity
fixture --n-vocab` pads). Every matrix is Q4_0
with random nibbles and per-block scales of about 1/sqrt(n_in) (activations stay O(1) through
80 layers); norms are f32 near 1.
"""
import argparse
import sys

import numpy as np
import gguf

SHAPES = {
    # n_embd, n_ff, n_layer, n_head, n_head_kv
    "70b": (8192, 28672, 80, 64, 8),
    "7b": (4096, 11008, 32, 32, 32),
    "tiny": (256, 512, 2, 4, 2),
}
QK = 32  # Q4_0: 32 weights per block, an f16 scale and 16 bytes of nibbles

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--shape", choices=sorted(SHAPES), default="70b")
p.add_argument("--vocab-from", default="fixtures/tiny-llama-q8_0.gguf")
p.add_argument("--n-vocab", type=int, default=4000,
               help="pad the fixture's vocabulary with unused tokens up to this size")
p.add_argument("--n-ctx", type=int, default=4096)
p.add_argument("--seed", type=int, default=7)
a = p.parse_args()

n_embd, n_ff, n_layer, n_head, n_head_kv = SHAPES[a.shape]
kv = n_embd // n_head * n_head_kv
rng = np.random.default_rng(a.seed)
src = gguf.GGUFReader(a.vocab_from)


def field(name):
    return src.fields[name].contents()


tokens = list(field("tokenizer.ggml.tokens"))
scores = list(field("tokenizer.ggml.scores"))
types = list(field("tokenizer.ggml.token_type"))
# As `parity fixture --n-vocab` pads: normal tokens that the tokenizer never produces.
for i in range(len(tokens), a.n_vocab):
    tokens.append(f"<dummy{i:06}>")
    scores.append(-1000.0)
    types.append(1)
n_vocab = len(tokens)

w = gguf.GGUFWriter(a.out, "llama")
w.add_name(f"parity-huge-{a.shape}-q4_0")
w.add_context_length(a.n_ctx)
w.add_embedding_length(n_embd)
w.add_block_count(n_layer)
w.add_feed_forward_length(n_ff)
w.add_head_count(n_head)
w.add_head_count_kv(n_head_kv)
w.add_rope_dimension_count(n_embd // n_head)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_freq_base(10000.0)
w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
w.add_tokenizer_model(field("tokenizer.ggml.model"))
w.add_token_list(tokens)
w.add_token_scores(scores)
w.add_token_types(types)
w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
w.add_unk_token_id(field("tokenizer.ggml.unknown_token_id"))
w.add_add_bos_token(True)
w.add_add_eos_token(False)

# The plan: (name, rows, cols) for a Q4_0 matrix (cols = n_in), (name, n) for an f32 norm.
plan = [("token_embd.weight", n_vocab, n_embd)]
for l in range(n_layer):
    b = f"blk.{l}."
    plan += [
        (b + "attn_norm.weight", n_embd),
        (b + "attn_q.weight", n_embd, n_embd),
        (b + "attn_k.weight", kv, n_embd),
        (b + "attn_v.weight", kv, n_embd),
        (b + "attn_output.weight", n_embd, n_embd),
        (b + "ffn_norm.weight", n_embd),
        (b + "ffn_gate.weight", n_ff, n_embd),
        (b + "ffn_up.weight", n_ff, n_embd),
        (b + "ffn_down.weight", n_embd, n_ff),
    ]
plan += [("output_norm.weight", n_embd), ("output.weight", n_vocab, n_embd)]

for t in plan:
    if len(t) == 2:
        w.add_tensor_info(t[0], (t[1],), np.dtype(np.float32), 4 * t[1])
    else:
        name, rows, cols = t
        nbytes = rows * cols // QK * (2 + QK // 2)
        w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), nbytes,
                          raw_dtype=gguf.GGMLQuantizationType.Q4_0)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_ti_data_to_file()


def q4_0(rows, cols, scale):
    # Uniform nibbles: (q - 8) has a standard deviation of about 4.6.
    n = rows * cols // QK
    blocks = np.empty((n, 2 + QK // 2), dtype=np.uint8)
    blocks[:, 2:] = np.frombuffer(rng.bytes(n * QK // 2), dtype=np.uint8).reshape(n, QK // 2)
    d = (scale / 4.6 * rng.uniform(0.8, 1.2, n)).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(n, 2)
    return blocks


total = 0
for i, t in enumerate(plan):
    if len(t) == 2:
        data = (1.0 + rng.uniform(-0.2, 0.2, t[1])).astype(np.float32)
    else:
        name, rows, cols = t
        data = q4_0(rows, cols, 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(cols))
    w.write_tensor_data(data)
    total += data.nbytes
    if i % 90 == 0:
        print(f"  {t[0]}: {total / 1e9:.1f} GB written", file=sys.stderr, flush=True)
w.close()
print(f"wrote {a.out}: llama {a.shape}, n_embd {n_embd}, n_ff {n_ff}, {n_layer} layers, "
      f"{n_head}/{n_head_kv} heads, vocab {n_vocab}, Q4_0, {total / 1e9:.2f} GB of tensors",
      file=sys.stderr)
