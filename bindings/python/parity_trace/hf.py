"""Write a parity trace from a Hugging Face `transformers` Llama model with forward hooks: an
independent second baseline for a GGUF's llama.cpp golden (it catches conversion bugs such as
the Q/K row permutation or tied embeddings).

    python -m parity_trace.hf HF_DIR GOLDEN_DIR OUT_DIR [--gguf MODEL.gguf]   (or scripts/hf_trace.py)
    parity diff GOLDEN_DIR OUT_DIR

Needs torch (CPU is enough), transformers and numpy; torch and transformers are imported only
when a trace is made. The golden's ids are replayed: its prompt as the prefill, then one forced
token per decode step through the model's KV cache.

Where each tap comes from (module hooks; RoPE by wrapping the model file's apply_rotary_pos_emb;
attention probabilities from the eager attention's returned weights):
  embd embed_tokens | attn_norm input_layernorm | q,k,v q_proj,k_proj,v_proj |
  q_rope,k_rope apply_rotary_pos_emb | kq_soft_max self_attn weights | kqv_out o_proj input |
  attn_out o_proj | ffn_inp post_attention_layernorm input | ffn_norm post_attention_layernorm |
  ffn_gate gate_proj | ffn_up up_proj | ffn_act down_proj input | ffn_out down_proj |
  l_out decoder layer | result_norm model.norm | logits lm_head

HF keeps each head's rotary pairs as (i, i + head_dim/2) where llama.cpp's converted GGUF has
them as (2i, 2i+1) (convert_hf_to_gguf.py permutes the Q/K rows so that llama.cpp's NORM RoPE
applies). The q, k, q_rope, k_rope taps are written in llama.cpp's order so that they compare;
every other tap is permutation-free.
"""
import argparse
import json
import os

import numpy as np

from parity_trace import TraceWriter, golden_ids, to_numpy


def hf_to_gguf_heads(x, head_dim):
    """[T, H, head_dim] in HF rotary order (i, i+d/2) -> llama.cpp's interleaved (2i, 2i+1)."""
    half = head_dim // 2
    out = np.empty_like(x)
    out[..., 0::2] = x[..., :half]
    out[..., 1::2] = x[..., half:]
    return out


def trace(hf_dir, golden, out, hf_order=False, gguf=None):
    """Run the checkpoint in `hf_dir` on the ids of the trace `golden` and write its taps to
    `out`. hf_order: write q, k, q_rope, k_rope in HF's own rotary order. gguf: the GGUF the
    golden was made from (its path and sha256 go in the manifest; default: the golden's own
    model entry). Returns the manifest."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.models.llama import modeling_llama

    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    heads = (lambda x, _hd: x) if hf_order else hf_to_gguf_heads

    with open(os.path.join(golden, "manifest.json")) as f:
        gm = json.load(f)
    if gguf:
        w = TraceWriter(out, model=gguf, engine="transformers", backend="torch-cpu-f32")
    else:
        w = TraceWriter(out, sha256=gm["model"]["sha256"], engine="transformers",
                        backend="torch-cpu-f32")
        w.model["path"] = gm["model"]["path"]
    w.producer["version"] = transformers.__version__
    w.producer["settings"] = {"torch": torch.__version__, "hf_dir": os.fspath(hf_dir),
                              "attn_implementation": "eager", "dtype": "float32"}

    def np2(t):  # [1, T, ...] -> [T, ...]
        return to_numpy(t[0])

    hooks = []

    def out_hook(layer, name, fn=None):
        def h(_m, _inp, out):
            o = out[0] if isinstance(out, tuple) else out
            x = np2(o)
            w.tap(layer, name, fn(x) if fn else x)
        return h

    def in_hook(layer, name):
        def h(_m, inp):
            w.tap(layer, name, np2(inp[0]))
        return h

    m = model.model
    hooks.append(m.embed_tokens.register_forward_hook(out_hook(None, "embd")))
    for l, blk in enumerate(m.layers):
        at, mlp = blk.self_attn, blk.mlp
        hooks += [
            blk.input_layernorm.register_forward_hook(out_hook(l, "attn_norm")),
            at.q_proj.register_forward_hook(out_hook(l, "q", lambda x: heads(x.reshape(x.shape[0], nh, hd), hd))),
            at.k_proj.register_forward_hook(out_hook(l, "k", lambda x: heads(x.reshape(x.shape[0], nkv, hd), hd))),
            at.v_proj.register_forward_hook(out_hook(l, "v", lambda x: x.reshape(x.shape[0], nkv, hd))),
            at.register_forward_hook(lambda _m, _i, out, l=l: w.tap(l, "kq_soft_max", np2(out[1]))),
            at.o_proj.register_forward_pre_hook(in_hook(l, "kqv_out")),
            at.o_proj.register_forward_hook(out_hook(l, "attn_out")),
            blk.post_attention_layernorm.register_forward_pre_hook(in_hook(l, "ffn_inp")),
            blk.post_attention_layernorm.register_forward_hook(out_hook(l, "ffn_norm")),
            mlp.gate_proj.register_forward_hook(out_hook(l, "ffn_gate")),
            mlp.up_proj.register_forward_hook(out_hook(l, "ffn_up")),
            mlp.down_proj.register_forward_pre_hook(in_hook(l, "ffn_act")),
            mlp.down_proj.register_forward_hook(out_hook(l, "ffn_out")),
            blk.register_forward_hook(out_hook(l, "l_out")),
        ]
    hooks.append(m.norm.register_forward_hook(out_hook(None, "result_norm")))
    hooks.append(model.lm_head.register_forward_hook(out_hook(None, "logits")))

    # RoPE is a function, not a module: wrap it, counting calls to know the layer.
    rope = modeling_llama.apply_rotary_pos_emb
    calls = {"n": 0}

    def rope_tap(q, k, cos, sin, *args, **kw):
        qe, ke = rope(q, k, cos, sin, *args, **kw)
        layer = calls["n"] % len(m.layers)
        calls["n"] += 1
        # [1, H, T, hd] -> [T, H, hd], in llama.cpp's pair order
        w.tap(layer, "q_rope", heads(to_numpy(qe[0].transpose(0, 1)), hd))
        w.tap(layer, "k_rope", heads(to_numpy(ke[0].transpose(0, 1)), hd))
        return qe, ke

    modeling_llama.apply_rotary_pos_emb = rope_tap
    try:
        past = DynamicCache()
        for ids, pos in golden_ids(golden):
            w.step(ids, pos)
            o = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                      past_key_values=past, use_cache=True, output_attentions=True)
            past = o.past_key_values
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()
    return w.finish()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("golden")
    ap.add_argument("out")
    ap.add_argument("--hf-order", action="store_true",
                    help="write q, k, q_rope, k_rope in HF's own rotary order (to see what parity "
                         "says about the un-permuted layout)")
    ap.add_argument("--gguf", help="the GGUF the golden was made from (its path and sha256 go in "
                                   "the manifest; default: the golden's own model entry)")
    a = ap.parse_args(argv)
    mf = trace(a.hf_dir, a.golden, a.out, hf_order=a.hf_order, gguf=a.gguf)
    import torch
    import transformers
    print(f"wrote {a.out}: {len(mf['steps'])} steps, {len(mf['tensors'])} taps "
          f"(transformers {transformers.__version__}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
