#!/usr/bin/env python3
"""Time the REAL llama.cpp (through llama-cpp-python's low-level API) on a model, the way
`parity bench` times its fast backend, and print one JSON object on stdout.

    llama_bench.py MODEL --tokens 1,2,3,... [--gen G] [--reps R] [--threads N]
                   [--warmup W] [--n-ctx N] [--tight]

What is timed (wall clock around llama_decode only):
  pp: one llama_decode of the whole prompt batch (logits for the last row only),
      from an empty KV cache;
  tg: G llama_decode calls of one token each after it, feeding llama.cpp's own
      greedy choice (argmax of the previous logits; the argmax is not timed).
Each repetition clears the KV cache first; W warm-up repetitions (default 1) are run
and discarded, so page faults of the memory-mapped weights are not timed. Reported:
the median over R repetitions of tokens per second, and every sample.

Settings are llama.cpp's defaults for a user (F16 KV cache, flash attention auto,
weight repacking on, mmap), with n_threads = n_threads_batch = N; --tight switches
to the settings of llama_golden.py (F32 KV cache, flash attention off, no
repacking). The JSON says which settings were used.

Exit codes: 0 ok, 2 bad input / llama_cpp missing / llama.cpp failed.
"""

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time

MISSING_LLAMA_CPP = (
    "llama_cpp (llama-cpp-python) is not installed: pip install llama-cpp-python "
    "(or: pip install /path/to/shared/wheels/llama_cpp_python-*.whl)"
)

_KEEP_ALIVE = []


def die(msg, code=2):
    print(f"llama_bench: {msg}", file=sys.stderr)
    sys.exit(code)


def parse_ids(s):
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        die(f"--tokens must be a comma-separated list of integer token ids, got {s!r}")
    if not ids:
        die("--tokens is empty")
    return ids


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True, help="prompt token ids, comma-separated")
    ap.add_argument("--gen", type=int, default=32, help="single-token decode steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=0, help="context size (default: prompt + gen, rounded up to 256)")
    ap.add_argument("--tight", action="store_true",
                    help="F32 KV cache, flash attention off, no repacking (llama_golden.py's settings)")
    ap.add_argument("--verbose", action="store_true", help="pass llama.cpp's log through to stderr")
    args = ap.parse_args(argv)

    try:
        import llama_cpp as L
    except Exception:
        print(MISSING_LLAMA_CPP, file=sys.stderr)
        sys.exit(2)
    try:
        import numpy as np
    except ImportError:
        die("numpy is not installed: pip install numpy")

    prompt = parse_ids(args.tokens)
    if args.gen < 0 or args.reps < 1 or args.warmup < 0 or args.threads < 1:
        die("--gen >= 0, --reps >= 1, --warmup >= 0 and --threads >= 1 are required")
    if not os.path.isfile(args.model):
        die(f"model file not found: {args.model}")

    log = []

    def _log(level, text, ud):
        t = text.decode("utf-8", "replace")
        log.append(t)
        if args.verbose:
            sys.stderr.write(t)

    log_cb = L.llama_log_callback(_log)
    _KEEP_ALIVE.append(log_cb)
    L.llama_log_set(log_cb, None)
    L.llama_backend_init()

    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp_fields = {f[0] for f in type(mp)._fields_}
    if args.tight and "use_extra_bufts" in mp_fields:
        mp.use_extra_bufts = False
    t0 = time.perf_counter()
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    t_load = time.perf_counter() - t0
    load_log = "".join(log)
    # "repack: repack tensor blk.0.attn_q.weight with q4_0_8x8": which layouts, how many tensors.
    repacked = {}
    for kind in re.findall(r"repack tensor \S+ with (\w+)", load_log):
        repacked[kind] = repacked.get(kind, 0) + 1
    if not model:
        die(f"llama.cpp failed to load the model: {args.model} (rerun with --verbose)")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    for tok in prompt:
        if not 0 <= tok < n_vocab:
            die(f"token id {tok} out of range (n_vocab {n_vocab})")

    P, G = len(prompt), args.gen
    n_ctx = args.n_ctx or max(256, -(-(P + G) // 256) * 256)
    if n_ctx < P + G:
        die(f"--n-ctx {n_ctx} is smaller than prompt + gen ({P + G})")
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    # Defaults are n_batch 2048 / n_ubatch 512; the prompt must fit one micro-batch to be one
    # llama_decode graph, as parity's prefill is one forward.
    if P > cp.n_ubatch:
        cp.n_batch = max(cp.n_batch, P)
        cp.n_ubatch = P
    cp.n_seq_max = 1
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    cp_fields = {f[0] for f in type(cp)._fields_}
    if args.tight:
        if "flash_attn_type" in cp_fields:
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        elif "flash_attn" in cp_fields:
            cp.flash_attn = False
        cp.type_k = L.GGML_TYPE_F32
        cp.type_v = L.GGML_TYPE_F32
    log.clear()
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        die("llama.cpp failed to create a context (rerun with --verbose)")
    ctx_log = "".join(log)

    type_names = {v: k[len("GGML_TYPE_"):].lower() for k, v in vars(L).items()
                  if k.startswith("GGML_TYPE_") and isinstance(v, int) and k != "GGML_TYPE_COUNT"}
    if "flash_attn_type" in cp_fields:
        fa_req = {-1: "auto", 0: "disabled", 1: "enabled"}.get(cp.flash_attn_type, str(cp.flash_attn_type))
    else:
        fa_req = "enabled" if getattr(cp, "flash_attn", False) else "disabled"
    # llama.cpp logs what 'auto' resolved to ("Flash Attention was auto, set to enabled", or the
    # context summary line "flash_attn = ...").
    fa_used = None
    for pat in (r"[Ff]lash [Aa]ttention was auto, set to (\w+)",
                r"[Ff]lash [Aa]ttention (enabled|disabled)",
                r"flash_attn\s*=\s*(\w+)"):
        m = re.search(pat, ctx_log)
        if m:
            fa_used = m.group(1)
            break
    repack = None
    if "use_extra_bufts" in mp_fields:
        repack = bool(mp.use_extra_bufts)

    mem = L.llama_get_memory(ctx) if hasattr(L, "llama_get_memory") else None

    def clear():
        if mem is not None:
            L.llama_memory_clear(mem, True)
        else:
            L.llama_kv_self_clear(ctx)

    batch = L.llama_batch_init(max(P, 1), 0, 1)
    _KEEP_ALIVE.append(batch)

    def fill(tokens, pos0):
        batch.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if i == len(tokens) - 1 else 0

    def run_once():
        clear()
        fill(prompt, 0)
        t = time.perf_counter()
        rc = L.llama_decode(ctx, batch)
        t_pp = time.perf_counter() - t
        if rc != 0:
            die(f"llama_decode of the prompt returned {rc}")
        t_tg = 0.0
        gen = []
        pos = P
        for _ in range(G):
            lg = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(lg))
            gen.append(tok)
            fill([tok], pos)
            t = time.perf_counter()
            rc = L.llama_decode(ctx, batch)
            t_tg += time.perf_counter() - t
            if rc != 0:
                die(f"llama_decode of generated token {len(gen)} returned {rc}")
            pos += 1
        return t_pp, t_tg, gen

    for _ in range(args.warmup):
        run_once()
    pp_s, tg_s, gen = [], [], []
    for _ in range(args.reps):
        a, b, gen = run_once()
        pp_s.append(a)
        tg_s.append(b)

    pp_tok_s = [P / s for s in pp_s]
    tg_tok_s = [G / s for s in tg_s if s > 0]
    out = {
        "engine": "llama.cpp",
        "llama_cpp_python": getattr(L, "__version__", None),
        "system_info": L.llama_print_system_info().decode("utf-8", "replace").strip(),
        "model": args.model,
        "machine": platform.machine(),
        "threads": args.threads,
        "prompt_tokens": P,
        "gen_tokens": G,
        "reps": args.reps,
        "warmup": args.warmup,
        "settings": {
            "mode": "tight" if args.tight else "llama.cpp defaults",
            "type_k": type_names.get(cp.type_k, str(cp.type_k)),
            "type_v": type_names.get(cp.type_v, str(cp.type_v)),
            "flash_attn": fa_req,
            "flash_attn_resolved": fa_used,
            "weight_repacking": repack,
            "repacked_tensors": repacked,
            "n_ctx": n_ctx,
            "n_batch": cp.n_batch,
            "n_ubatch": cp.n_ubatch,
        },
        "load_s": t_load,
        "pp_s": pp_s,
        "tg_s": tg_s,
        "pp_tok_s": statistics.median(pp_tok_s),
        "tg_tok_s": statistics.median(tg_tok_s) if tg_tok_s else None,
        "generated": gen,
    }
    L.llama_batch_free(batch)
    _KEEP_ALIVE.remove(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
