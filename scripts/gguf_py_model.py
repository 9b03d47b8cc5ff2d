#!/usr/bin/env python3
"""Write a random-weight model with llama.cpp's own GGUF writer (gguf-py), in a shape parity's
`fixture` does not make: head_dim 96 with n_head * head_dim != n_embd, 6 query heads over 2 kv
heads, f16 matrices, 4 layers. A second oracle for the model side: parity must read what
llama.cpp's tools write, and `parity check` against llama.cpp's golden must pass.

  scripts/gguf_py_model.py ARCH OUT.gguf [--vocab-from FIXTURE.gguf] [--seed N]

ARCH: qwen3 (per-head q/k norms) or gemma3 (q/k norms, post-norms, sliding window 5 with
pattern 4: three local layers then a global one, embedding scale, a final soft-cap of 10).
The vocabulary (SentencePiece, byte fallback) is copied from a parity fixture.
"""
import argparse
import sys

import numpy as np
import gguf

p = argparse.ArgumentParser()
p.add_argument("arch", choices=["qwen3", "gemma3"])
p.add_argument("out")
p.add_argument("--vocab-from", default="fixtures/tiny-llama-q8_0.gguf")
p.add_argument("--seed", type=int, default=5)
a = p.parse_args()

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_LAYER, N_CTX = 384, 6, 2, 96, 768, 4, 512
rng = np.random.default_rng(a.seed)

src = gguf.GGUFReader(a.vocab_from)


def field(name):
    f = src.fields[name]
    return f.contents()


tokens = field("tokenizer.ggml.tokens")
n_vocab = len(tokens)

w = gguf.GGUFWriter(a.out, a.arch)
w.add_name(f"gguf-py-{a.arch}-h{HEAD_DIM}")
w.add_context_length(N_CTX)
w.add_embedding_length(N_EMBD)
w.add_block_count(N_LAYER)
w.add_feed_forward_length(N_FF)
w.add_head_count(N_HEAD)
w.add_head_count_kv(N_HEAD_KV)
w.add_key_length(HEAD_DIM)
w.add_value_length(HEAD_DIM)
w.add_layer_norm_rms_eps(1e-6)
w.add_rope_freq_base(1e6)
if a.arch == "gemma3":
    w.add_sliding_window(5)
    w.add_uint32(f"{a.arch}.attention.sliding_window_pattern", 4)
    w.add_float32(f"{a.arch}.final_logit_softcapping", 10.0)
w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

w.add_tokenizer_model(field("tokenizer.ggml.model"))
w.add_token_list(tokens)
w.add_token_scores(field("tokenizer.ggml.scores"))
w.add_token_types(field("tokenizer.ggml.token_type"))
w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
w.add_unk_token_id(field("tokenizer.ggml.unknown_token_id"))
w.add_add_bos_token(True)
w.add_add_eos_token(False)


def mat(n_out, n_in, scale=None):
    # numpy order [n_out, n_in] is ggml's ne [n_in, n_out].
    s = scale if scale is not None else 1.0 / np.sqrt(n_in)
    return (rng.uniform(-1, 1, (n_out, n_in)) * s * 1.7).astype(np.float16)


def norm(n):
    return (1.0 + rng.uniform(-0.2, 0.2, n)).astype(np.float32)


q, kv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
w.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD, 1.0))
for l in range(N_LAYER):
    b = f"blk.{l}."
    w.add_tensor(b + "attn_norm.weight", norm(N_EMBD))
    w.add_tensor(b + "attn_q.weight", mat(q, N_EMBD))
    w.add_tensor(b + "attn_k.weight", mat(kv, N_EMBD))
    w.add_tensor(b + "attn_v.weight", mat(kv, N_EMBD))
    w.add_tensor(b + "attn_q_norm.weight", norm(HEAD_DIM))
    w.add_tensor(b + "attn_k_norm.weight", norm(HEAD_DIM))
    w.add_tensor(b + "attn_output.weight", mat(N_EMBD, q))
    if a.arch == "gemma3":
        w.add_tensor(b + "post_attention_norm.weight", norm(N_EMBD))
    w.add_tensor(b + "ffn_norm.weight", norm(N_EMBD))
    w.add_tensor(b + "ffn_gate.weight", mat(N_FF, N_EMBD))
    w.add_tensor(b + "ffn_up.weight", mat(N_FF, N_EMBD))
    w.add_tensor(b + "ffn_down.weight", mat(N_EMBD, N_FF))
    if a.arch == "gemma3":
        w.add_tensor(b + "post_ffw_norm.weight", norm(N_EMBD))
w.add_tensor("output_norm.weight", norm(N_EMBD))
if a.arch == "qwen3":
    w.add_tensor("output.weight", mat(n_vocab, N_EMBD))

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"wrote {a.out}: {a.arch}, n_embd {N_EMBD}, {N_HEAD}/{N_HEAD_KV} heads of {HEAD_DIM}, "
      f"n_ff {N_FF}, {N_LAYER} layers, vocab {n_vocab}", file=sys.stderr)
