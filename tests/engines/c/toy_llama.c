/* toy_llama.c - a hobby-style C engine instrumented with bindings/c/parity_trace.h.
 *
 * A plain f32 Llama forward over an F32 GGUF (its own GGUF v3 reader), fed one token at a
 * time as many small engines are: the prompt token by token through the KV cache, then one
 * forced token per decode step. The ids come from a golden (pt_golden_ids). For step 0 each
 * token's rows are gathered into the T-row tensors a trace holds (kq_soft_max
 * [n_head, T, n_kv] with each row's masked entries 0). Dot products accumulate in double, as
 * parity's Rust example engine (examples/trace_engine.rs) does.
 *
 *     toy_llama MODEL.gguf GOLDEN_DIR OUT_DIR [--bug NAME]
 *     parity diff GOLDEN_DIR OUT_DIR
 *
 * --bug plants one bug. Twelve are in parity's catalog (src/backend/mutation.rs):
 *   rope-neox         RoPE pairs (i, i + n_rot/2) where the model pairs neighbours (2i, 2i+1)
 *   rms-eps-10x       every RMSNorm adds 10x the model's epsilon
 *   swiglu-swap       the FFN computes silu(up) * gate instead of silu(gate) * up
 *   kv-slot-late      K/V are written at slot p + 1 for position p (slot 0 stays empty)
 *   no-final-norm     the output norm is left out: the logits read the last layer's output
 *   attn-out-twice    the attention output is added to the residual twice
 *   no-attn-norm      the attention's RMSNorm is left out: q, k, v read the residual itself
 *   no-ffn-norm       the FFN's RMSNorm is left out: gate and up read ffn_inp itself
 *   no-attn-residual  the attention's residual add is left out: ffn_inp = attn_out
 *   no-ffn-residual   the FFN's residual add is left out: l_out = ffn_out
 *   wrong-ffn-act     the FFN's gate goes through GELU (tanh) where the model uses SiLU
 *   softmax-no-max    the softmax does not subtract its row's max: exp(s) / sum, which
 *                     overflows (NaN) where a score passes 88.7 (`parity fixture --qk-gain`)
 * and five are values no catalog lists, which parity fits:
 *   rms-eps-1e-3      every RMSNorm adds 1e-3, whatever the model says
 *   rope-theta-20000  RoPE's frequency base is 20000, whatever the model says
 *   attn-scale-inv-d  attention scores are divided by head_dim, not its square root
 *   no-attn-scale     attention scores are not scaled at all
 *   out-norm-eps-1    the final norm alone adds eps 1 (the layers' norms the model's)
 * and four constant factors no catalog lists, which parity fits as output scales:
 *   embd-scale-sqrt   the embedding rows are multiplied by sqrt(n_embd), as gemma's are
 *   ffn-out-half      the FFN output is halved (a residual multiplier the model lacks)
 *   ffn-out-half-l0   layer 0's FFN output alone is halved (one tensor's scale read wrong)
 *   logits-temp       the logits are divided by a sampling temperature 0.8 before the dump
 * and two that act only from a position on, at widths the catalog does not use:
 *   kv-ring-13        the K/V cache is a ring of 13 slots (position p at slot p % 13), read
 *                     as if it held every position
 *   rope-pos-mod-11   RoPE rotates at position p % 11
 * and two RoPE position bugs of shapes no catalog lists, which parity solves from the angles:
 *   rope-pos-from-1   RoPE rotates position p at p + 1 (a counter advanced before it is used)
 *   rope-pos-stuck    decode steps rotate at the first decode position: the counter RoPE
 *                     reads is not advanced after the prompt (the cache slot is right)
 *
 * Build: cc -std=c99 -O2 -I bindings/c tests/engines/c/toy_llama.c -lm -o toy_llama
 */
#define PARITY_TRACE_IMPLEMENTATION
#include "parity_trace.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BUG_NONE, BUG_ROPE_NEOX, BUG_RMS_EPS_10X, BUG_SWIGLU_SWAP, BUG_RMS_EPS_1E3,
       BUG_ROPE_THETA_20000, BUG_ATTN_SCALE_INV_D, BUG_NO_ATTN_SCALE, BUG_KV_SLOT_LATE,
       BUG_NO_FINAL_NORM, BUG_ATTN_OUT_TWICE, BUG_KV_RING_13, BUG_ROPE_POS_MOD_11,
       BUG_EMBD_SCALE_SQRT, BUG_FFN_OUT_HALF, BUG_LOGITS_TEMP, BUG_FFN_OUT_HALF_L0,
       BUG_ROPE_POS_FROM_1, BUG_ROPE_POS_STUCK, BUG_NO_ATTN_NORM, BUG_NO_FFN_NORM,
       BUG_NO_ATTN_RESIDUAL, BUG_NO_FFN_RESIDUAL, BUG_OUT_NORM_EPS_1, BUG_WRONG_FFN_ACT,
       BUG_SOFTMAX_NO_MAX };
static const char *const bug_names[] = {"none",          "rope-neox",        "rms-eps-10x",
                                        "swiglu-swap",   "rms-eps-1e-3",     "rope-theta-20000",
                                        "attn-scale-inv-d", "no-attn-scale",
                                        "kv-slot-late",  "no-final-norm",    "attn-out-twice",
                                        "kv-ring-13",    "rope-pos-mod-11",  "embd-scale-sqrt",
                                        "ffn-out-half",  "logits-temp",     "ffn-out-half-l0",
                                        "rope-pos-from-1", "rope-pos-stuck",
                                        "no-attn-norm",  "no-ffn-norm",     "no-attn-residual",
                                        "no-ffn-residual", "out-norm-eps-1", "wrong-ffn-act",
                                        "softmax-no-max"};

/* The cache slot of position p: p itself, or p % 13 in the ring-buffer bug. */
static size_t slot(size_t p, int bug) { return bug == BUG_KV_RING_13 ? p % 13 : p; }

static void die(const char *fmt, const char *a) {
    fprintf(stderr, "toy_llama: ");
    fprintf(stderr, fmt, a);
    fprintf(stderr, "\n");
    exit(1);
}

/* ---- GGUF v3: a bounded little-endian reader ---- */

typedef struct {
    const unsigned char *p;
    size_t n, pos;
    int bad;
} rd;

static int key_is(const char *key, size_t len, const char *want) {
    return len == strlen(want) && !memcmp(key, want, len);
}

static uint64_t rd_u(rd *r, size_t bytes) {
    uint64_t v = 0;
    size_t i;
    if (r->bad || r->n - r->pos < bytes) {
        r->bad = 1;
        return 0;
    }
    for (i = 0; i < bytes; i++) v |= (uint64_t)r->p[r->pos + i] << (8 * i);
    r->pos += bytes;
    return v;
}

static const char *rd_str(rd *r, size_t *len) {
    uint64_t n = rd_u(r, 8);
    const char *s;
    if (r->bad || n > r->n - r->pos) {
        r->bad = 1;
        *len = 0;
        return "";
    }
    s = (const char *)r->p + r->pos;
    r->pos += (size_t)n;
    *len = (size_t)n;
    return s;
}

enum { G_U8, G_I8, G_U16, G_I16, G_U32, G_I32, G_F32, G_BOOL, G_STR, G_ARR, G_U64, G_I64, G_F64 };
static const size_t g_size[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

static void rd_skip(rd *r, uint32_t type, int depth) {
    size_t len;
    if (type > G_F64 || depth > 3) {
        r->bad = 1;
        return;
    }
    if (type == G_STR) {
        rd_str(r, &len);
    } else if (type == G_ARR) {
        uint32_t et = (uint32_t)rd_u(r, 4);
        uint64_t count = rd_u(r, 8), i;
        if (r->bad || et > G_F64) {
            r->bad = 1;
            return;
        }
        if (g_size[et]) { /* fixed-size elements: one bounds check */
            if (count > (r->n - r->pos) / g_size[et]) r->bad = 1;
            else r->pos += (size_t)count * g_size[et];
        } else {
            for (i = 0; i < count && !r->bad; i++) rd_skip(r, et, depth + 1);
        }
    } else {
        rd_u(r, g_size[type]);
    }
}

/* A scalar number of any GGUF numeric type (booleans and strings are not numbers). */
static double rd_num(rd *r, uint32_t type, int *ok) {
    uint64_t v;
    *ok = 1;
    switch (type) {
    case G_U8: case G_U16: case G_U32: case G_U64:
        return (double)rd_u(r, g_size[type]);
    case G_I8: v = rd_u(r, 1); return (double)(int8_t)v;
    case G_I16: v = rd_u(r, 2); return (double)(int16_t)v;
    case G_I32: v = rd_u(r, 4); return (double)(int32_t)v;
    case G_I64: v = rd_u(r, 8); return (double)(int64_t)v;
    case G_F32: {
        uint32_t b = (uint32_t)rd_u(r, 4);
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    case G_F64: {
        double d;
        v = rd_u(r, 8);
        memcpy(&d, &v, 8);
        return d;
    }
    default:
        *ok = 0;
        rd_skip(r, type, 0);
        return 0;
    }
}

typedef struct {
    const char *name;
    size_t name_len;
    uint32_t ndims, type;
    uint64_t dims[4], offset;
} tinfo;

typedef struct {
    unsigned char *file;
    size_t size;
    const unsigned char *data; /* the tensor data section */
    size_t data_size;
    tinfo *t;
    size_t nt;
    /* hyperparameters */
    size_t n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_ctx, n_rot, n_vocab;
    float eps, theta;
} model;

static const float *tensor(const model *m, const char *name, size_t d0, size_t d1) {
    size_t i, n = strlen(name);
    for (i = 0; i < m->nt; i++) {
        const tinfo *t = &m->t[i];
        uint64_t bytes;
        if (t->name_len != n || memcmp(t->name, name, n) != 0) continue;
        if (t->type != 0) die("%s: not F32 (this toy engine reads F32 GGUFs only)", name);
        if (t->dims[0] != d0 || (t->ndims > 1 ? t->dims[1] : 1) != d1 ||
            (t->ndims > 2 && t->dims[2] != 1))
            die("%s: unexpected shape", name);
        bytes = (uint64_t)d0 * d1 * 4;
        if (t->offset > m->data_size || bytes > m->data_size - t->offset || t->offset % 4)
            die("%s: data outside the file", name);
        return (const float *)(const void *)(m->data + t->offset);
    }
    return NULL;
}

static const float *need(const model *m, const char *name, size_t d0, size_t d1) {
    const float *p = tensor(m, name, d0, d1);
    if (!p) die("the model has no tensor %s", name);
    return p;
}

static void load(model *m, const char *path) {
    FILE *f = fopen(path, "rb");
    rd r;
    uint64_t nt, nkv, i;
    size_t align = 32, hp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int arch_ok = 0;
    long size;
    static const char *const keys[8] = {
        "llama.embedding_length", "llama.block_count",         "llama.attention.head_count",
        "llama.attention.head_count_kv", "llama.feed_forward_length", "llama.context_length",
        "llama.rope.dimension_count", "general.alignment"};
    memset(m, 0, sizeof *m);
    m->theta = 10000.0f;
    m->eps = -1.0f;
    if (!f || fseek(f, 0, SEEK_END) != 0 || (size = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0)
        die("cannot read %s", path);
    m->size = (size_t)size;
    m->file = (unsigned char *)malloc(m->size ? m->size : 1);
    if (!m->file || fread(m->file, 1, m->size, f) != m->size) die("cannot read %s", path);
    fclose(f);
    r.p = m->file;
    r.n = m->size;
    r.pos = 0;
    r.bad = 0;
    if (rd_u(&r, 4) != 0x46554747u) die("%s: not a GGUF file", path); /* "GGUF" */
    if (rd_u(&r, 4) != 3) die("%s: not GGUF version 3", path);
    nt = rd_u(&r, 8);
    nkv = rd_u(&r, 8);
    for (i = 0; i < nkv && !r.bad; i++) {
        size_t kl, k;
        const char *key = rd_str(&r, &kl);
        uint32_t type = (uint32_t)rd_u(&r, 4);
        int ok, matched = 0;
        if (key_is(key, kl, "general.architecture") && type == G_STR) {
            size_t vl;
            const char *v = rd_str(&r, &vl);
            arch_ok = vl == 5 && !memcmp(v, "llama", 5);
            continue;
        }
        for (k = 0; k < 8; k++)
            if (key_is(key, kl, keys[k])) {
                double v = rd_num(&r, type, &ok);
                if (!ok || v < 1 || v > (double)(1 << 24)) die("bad value for %s", keys[k]);
                hp[k] = (size_t)v;
                matched = 1;
            }
        if (matched) continue;
        if (key_is(key, kl, "llama.attention.layer_norm_rms_epsilon")) {
            m->eps = (float)rd_num(&r, type, &ok);
            if (!ok || !(m->eps > 0)) die("bad value for %s", "rms epsilon");
        } else if (key_is(key, kl, "llama.rope.freq_base")) {
            m->theta = (float)rd_num(&r, type, &ok);
            if (!ok || !(m->theta > 0)) die("bad value for %s", "llama.rope.freq_base");
        } else {
            rd_skip(&r, type, 0); /* tokenizer arrays, names, ... */
        }
    }
    if (r.bad) die("%s: metadata runs past the end of the file", path);
    if (!arch_ok) die("%s: general.architecture is not llama", path);
    if (!hp[0] || !hp[1] || !hp[2] || !hp[4] || !hp[5] || m->eps < 0)
        die("%s: a llama.* hyperparameter is missing", path);
    m->n_embd = hp[0];
    m->n_layer = hp[1];
    m->n_head = hp[2];
    m->n_head_kv = hp[3] ? hp[3] : hp[2];
    m->n_ff = hp[4];
    m->n_ctx = hp[5];
    if (hp[7]) align = hp[7];
    if (m->n_embd % m->n_head || m->n_head % m->n_head_kv) die("%s: bad head counts", path);
    m->head_dim = m->n_embd / m->n_head;
    m->n_rot = hp[6] ? hp[6] : m->head_dim;
    if (m->n_rot > m->head_dim || m->n_rot % 2) die("%s: bad rope.dimension_count", path);
    if (nt > (r.n - r.pos) / 24) die("%s: tensor count past the end of the file", path);
    m->t = (tinfo *)calloc((size_t)nt + 1, sizeof *m->t);
    if (!m->t) die("out of memory reading %s", path);
    m->nt = (size_t)nt;
    for (i = 0; i < nt && !r.bad; i++) {
        tinfo *t = &m->t[i];
        uint32_t d;
        t->name = rd_str(&r, &t->name_len);
        t->ndims = (uint32_t)rd_u(&r, 4);
        if (t->ndims < 1 || t->ndims > 4) die("%s: a tensor with a bad number of dimensions", path);
        for (d = 0; d < t->ndims; d++) t->dims[d] = rd_u(&r, 8);
        t->type = (uint32_t)rd_u(&r, 4);
        t->offset = rd_u(&r, 8);
    }
    if (r.bad) die("%s: tensor infos run past the end of the file", path);
    if (align == 0 || align % 8) die("%s: bad general.alignment", path);
    r.pos = (r.pos + align - 1) / align * align;
    if (r.pos > r.n) die("%s: no tensor data", path);
    m->data = m->file + r.pos;
    m->data_size = r.n - r.pos;
    {
        const tinfo *te = NULL;
        for (i = 0; i < nt; i++)
            if (key_is(m->t[i].name, m->t[i].name_len, "token_embd.weight"))
                te = &m->t[i];
        if (!te || te->ndims < 2 || te->dims[1] < 1 || te->dims[1] > (1u << 24))
            die("%s: no token_embd.weight", path);
        m->n_vocab = (size_t)te->dims[1];
    }
}

/* ---- the forward, one token at a time ---- */

static void matvec(const float *w, size_t n_in, size_t n_out, const float *x, float *y) {
    size_t o, i;
    for (o = 0; o < n_out; o++) {
        const float *row = w + o * n_in;
        double acc = 0.0;
        for (i = 0; i < n_in; i++) acc += (double)x[i] * (double)row[i];
        y[o] = (float)acc;
    }
}

static void rms_norm(const float *x, const float *g, size_t n, float eps, float *out) {
    double ss = 0.0;
    float ms, s;
    size_t i;
    for (i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    ms = (float)(ss / (double)n);
    s = 1.0f / sqrtf(ms + eps);
    for (i = 0; i < n; i++) out[i] = x[i] * s * g[i];
}

/* In place on `heads` vectors of `hd` at position `pos`: llama.cpp's NORM rope pairs
 * neighbours (2i, 2i+1); the planted bug pairs halves (i, i + n_rot/2) as NEOX does. */
static void rope(float *v, size_t heads, size_t hd, size_t n_rot, size_t pos, float base,
                 int neox) {
    size_t h, i;
    for (h = 0; h < heads; h++) {
        float *x = v + h * hd;
        for (i = 0; i < n_rot / 2; i++) {
            float theta = (float)pos * powf(base, -2.0f * (float)i / (float)n_rot);
            float c = cosf(theta), s = sinf(theta);
            size_t a = neox ? i : 2 * i, b = neox ? i + n_rot / 2 : 2 * i + 1;
            float x0 = x[a], x1 = x[b];
            x[a] = x0 * c - x1 * s;
            x[b] = x0 * s + x1 * c;
        }
    }
}

/* Per-layer taps, in graph order (docs/trace-format.md). */
enum { ATTN_NORM, Q, K, V, Q_ROPE, K_ROPE, KQ, KQV_OUT, ATTN_OUT, FFN_INP, FFN_NORM,
       FFN_GATE, FFN_UP, FFN_ACT, FFN_OUT, L_OUT, NLT };
static const char *const lt_name[NLT] = {
    "attn_norm", "q",        "k",        "v",      "q_rope",  "k_rope",  "kq_soft_max", "kqv_out",
    "attn_out",  "ffn_inp",  "ffn_norm", "ffn_gate", "ffn_up", "ffn_act", "ffn_out",     "l_out"};

static float *alloc_f(size_t n) {
    float *p = (float *)calloc(n ? n : 1, sizeof(float));
    if (!p) die("out of memory%s", "");
    return p;
}

static void check(pt_writer *w, int rc) {
    if (rc != 0) {
        fprintf(stderr, "toy_llama: trace: %s\n", pt_error(w));
        pt_abort(w);
        exit(1);
    }
}

int main(int argc, char **argv) {
    model m;
    pt_steps g;
    pt_writer *w;
    int bug = BUG_NONE;
    size_t s, l, i, j, h, d, total = 0, ntaps = 0;
    size_t e, nh, nkv, hd, nff, nv, qw, kw;
    float eps, theta, scale;
    float **kc, **vc;
    char settings[160], err[512];
    const float *tok_embd, *out_norm, *out_w;
    if (argc == 6 && !strcmp(argv[4], "--bug")) {
        for (i = 1; i < sizeof bug_names / sizeof *bug_names; i++)
            if (!strcmp(argv[5], bug_names[i])) bug = (int)i;
        if (bug == BUG_NONE) {
            fprintf(stderr, "toy_llama: unknown bug '%s' (see the head of toy_llama.c)\n", argv[5]);
            return 2;
        }
    } else if (argc != 4) {
        fprintf(stderr, "usage: toy_llama MODEL.gguf GOLDEN_DIR OUT_DIR [--bug NAME]\n");
        return 2;
    }
    load(&m, argv[1]);
    e = m.n_embd;
    nh = m.n_head;
    nkv = m.n_head_kv;
    hd = m.head_dim;
    nff = m.n_ff;
    nv = m.n_vocab;
    qw = nh * hd;
    kw = nkv * hd;
    eps = bug == BUG_RMS_EPS_10X ? m.eps * 10.0f : bug == BUG_RMS_EPS_1E3 ? 1e-3f : m.eps;
    theta = bug == BUG_ROPE_THETA_20000 ? 20000.0f : m.theta;
    scale = bug == BUG_ATTN_SCALE_INV_D ? 1.0f / (float)hd
            : bug == BUG_NO_ATTN_SCALE  ? 1.0f
                                        : 1.0f / sqrtf((float)hd);
    tok_embd = need(&m, "token_embd.weight", e, nv);
    out_norm = need(&m, "output_norm.weight", e, 1);
    out_w = tensor(&m, "output.weight", e, nv);
    if (!out_w) out_w = tok_embd; /* tied embeddings */

    if (pt_golden_ids(argv[2], &g) != 0) die("%s", g.error);
    for (s = 0; s < g.n; s++) total += g.steps[s].n;
    if (total > m.n_ctx) die("the golden's positions exceed the model's context%s", "");

    w = pt_create(argv[3], argv[1], NULL, "toy-c", "cpu-f32");
    if (!w) die("out of memory%s", "");
    check(w, pt_error(w) ? -1 : 0);
    snprintf(settings, sizeof settings,
             "{\"dot\": \"f64 accumulation\", \"feed\": \"one token at a time\", \"bug\": \"%s\"}",
             bug_names[bug]);
    check(w, pt_set_producer(w, "0.1", settings));

    kc = (float **)calloc(m.n_layer, sizeof *kc);
    vc = (float **)calloc(m.n_layer, sizeof *vc);
    if (!kc || !vc) die("out of memory%s", "");
    for (l = 0; l < m.n_layer; l++) {
        kc[l] = alloc_f((total + 1) * kw); /* + 1: kv-slot-late writes one slot late */
        vc[l] = alloc_f((total + 1) * kw);
    }

    for (s = 0; s < g.n; s++) {
        const pt_step_ids *st = &g.steps[s];
        size_t T = st->n, n_kv = st->positions[T - 1] + 1;
        size_t width[NLT];
        float *embd, *res_norm, *logits, **buf, *scores = alloc_f(n_kv);
        width[ATTN_NORM] = width[ATTN_OUT] = width[FFN_INP] = width[FFN_NORM] = e;
        width[FFN_OUT] = width[L_OUT] = e;
        width[Q] = width[Q_ROPE] = width[KQV_OUT] = qw;
        width[K] = width[V] = width[K_ROPE] = kw;
        width[FFN_GATE] = width[FFN_UP] = width[FFN_ACT] = nff;
        width[KQ] = nh * n_kv; /* per token: [n_head, n_kv], gathered into [n_head, T, n_kv] */
        embd = alloc_f(T * e);
        res_norm = alloc_f(T * e);
        logits = alloc_f(T * nv);
        buf = (float **)calloc(m.n_layer * NLT, sizeof *buf);
        if (!buf) die("out of memory%s", "");
        for (l = 0; l < m.n_layer; l++)
            for (i = 0; i < NLT; i++) buf[l * NLT + i] = alloc_f(T * width[i]);
        check(w, pt_step(w, st->tokens, st->positions, st->n));

        for (i = 0; i < T; i++) { /* token i of the step, at position p */
            size_t p = st->positions[i], rp;
            float *x;
            if (st->tokens[i] >= nv) die("a golden id is past the vocabulary%s", "");
            x = embd + i * e;
            memcpy(x, tok_embd + (size_t)st->tokens[i] * e, e * sizeof *x);
            if (bug == BUG_EMBD_SCALE_SQRT)
                for (d = 0; d < e; d++) x[d] *= sqrtf((float)e);
            for (l = 0; l < m.n_layer; l++) {
                char name[64];
                float **b = buf + l * NLT;
                float *xn = b[ATTN_NORM] + i * e, *q = b[Q] + i * qw, *k = b[K] + i * kw,
                      *v = b[V] + i * kw, *qr = b[Q_ROPE] + i * qw, *kr = b[K_ROPE] + i * kw,
                      *att = b[KQV_OUT] + i * qw, *ao = b[ATTN_OUT] + i * e,
                      *fi = b[FFN_INP] + i * e, *fn = b[FFN_NORM] + i * e,
                      *gate = b[FFN_GATE] + i * nff, *up = b[FFN_UP] + i * nff,
                      *act = b[FFN_ACT] + i * nff, *fo = b[FFN_OUT] + i * e,
                      *lo = b[L_OUT] + i * e;
#define W(suffix, d0, d1) (snprintf(name, sizeof name, "blk.%zu." suffix, l), need(&m, name, d0, d1))
                if (bug == BUG_NO_ATTN_NORM)
                    memcpy(xn, x, e * sizeof *x);
                else
                    rms_norm(x, W("attn_norm.weight", e, 1), e, eps, xn);
                matvec(W("attn_q.weight", e, qw), e, qw, xn, q);
                matvec(W("attn_k.weight", e, kw), e, kw, xn, k);
                matvec(W("attn_v.weight", e, kw), e, kw, xn, v);
                memcpy(qr, q, qw * sizeof *q);
                memcpy(kr, k, kw * sizeof *k);
                rp = bug == BUG_ROPE_POS_MOD_11 ? p % 11
                     : bug == BUG_ROPE_POS_FROM_1 ? p + 1
                     : bug == BUG_ROPE_POS_STUCK && p > g.steps[0].n ? g.steps[0].n
                                                                     : p;
                rope(qr, nh, hd, m.n_rot, rp, theta, bug == BUG_ROPE_NEOX);
                rope(kr, nkv, hd, m.n_rot, rp, theta, bug == BUG_ROPE_NEOX);
                memcpy(kc[l] + slot(p + (bug == BUG_KV_SLOT_LATE), bug) * kw, kr, kw * sizeof *kr);
                memcpy(vc[l] + slot(p + (bug == BUG_KV_SLOT_LATE), bug) * kw, v, kw * sizeof *v);
                /* Attention of this token over positions 0..p (GQA: head h reads kv head
                 * h / (n_head / n_head_kv)); its probabilities are row i of kq_soft_max. */
                for (h = 0; h < nh; h++) {
                    size_t kh = h / (nh / nkv), seen = p + 1;
                    float *prob = b[KQ] + (h * T + i) * n_kv, max = -INFINITY;
                    double sum = 0.0;
                    for (j = 0; j < seen; j++) {
                        const float *kj = kc[l] + slot(j, bug) * kw + kh * hd;
                        double dot = 0.0;
                        for (d = 0; d < hd; d++) dot += (double)qr[h * hd + d] * (double)kj[d];
                        scores[j] = (float)dot * scale;
                        if (scores[j] > max) max = scores[j];
                    }
                    for (j = 0; j < seen; j++) {
                        scores[j] = expf(bug == BUG_SOFTMAX_NO_MAX ? scores[j] : scores[j] - max);
                        sum += (double)scores[j];
                    }
                    for (j = 0; j < seen; j++) prob[j] = (float)((double)scores[j] / sum);
                    for (d = 0; d < hd; d++) {
                        double acc = 0.0;
                        for (j = 0; j < seen; j++)
                            acc += (double)prob[j] * (double)vc[l][slot(j, bug) * kw + kh * hd + d];
                        att[h * hd + d] = (float)acc;
                    }
                }
                matvec(W("attn_output.weight", qw, e), qw, e, att, ao);
                for (d = 0; d < e; d++)
                    fi[d] = bug == BUG_ATTN_OUT_TWICE     ? x[d] + ao[d] + ao[d]
                            : bug == BUG_NO_ATTN_RESIDUAL ? ao[d]
                                                          : x[d] + ao[d];
                if (bug == BUG_NO_FFN_NORM)
                    memcpy(fn, fi, e * sizeof *fi);
                else
                    rms_norm(fi, W("ffn_norm.weight", e, 1), e, eps, fn);
                matvec(W("ffn_gate.weight", e, nff), e, nff, fn, gate);
                matvec(W("ffn_up.weight", e, nff), e, nff, fn, up);
                for (d = 0; d < nff; d++) {
                    float a = bug == BUG_SWIGLU_SWAP ? up[d] : gate[d];
                    float o = bug == BUG_SWIGLU_SWAP ? gate[d] : up[d];
                    act[d] = bug == BUG_WRONG_FFN_ACT
                                 ? 0.5f * a * (1.0f + tanhf(0.7978846f * a * (1.0f + 0.044715f * a * a))) * o
                                 : a / (1.0f + expf(-a)) * o;
                }
                matvec(W("ffn_down.weight", nff, e), nff, e, act, fo);
                if (bug == BUG_FFN_OUT_HALF || (bug == BUG_FFN_OUT_HALF_L0 && l == 0))
                    for (d = 0; d < e; d++) fo[d] *= 0.5f;
#undef W
                for (d = 0; d < e; d++) lo[d] = bug == BUG_NO_FFN_RESIDUAL ? fo[d] : fi[d] + fo[d];
                x = lo;
            }
            if (bug == BUG_NO_FINAL_NORM)
                memcpy(res_norm + i * e, x, e * sizeof *x);
            else
                rms_norm(x, out_norm, e, bug == BUG_OUT_NORM_EPS_1 ? 1.0f : eps, res_norm + i * e);
            matvec(out_w, e, nv, res_norm + i * e, logits + i * nv);
            if (bug == BUG_LOGITS_TEMP)
                for (d = 0; d < nv; d++) logits[i * nv + d] /= 0.8f;
        }

        { /* the step's taps, in graph order */
            size_t sh_e[2], sh_ff[2], sh_q[3], sh_k[3], sh_kq[3], sh_qw[2], sh_v[2];
            sh_e[0] = sh_ff[0] = sh_q[0] = sh_k[0] = sh_qw[0] = sh_v[0] = T;
            sh_e[1] = e;
            sh_ff[1] = nff;
            sh_q[1] = nh;
            sh_q[2] = hd;
            sh_k[1] = nkv;
            sh_k[2] = hd;
            sh_kq[0] = nh;
            sh_kq[1] = T;
            sh_kq[2] = n_kv;
            sh_qw[1] = qw;
            sh_v[1] = nv;
            check(w, pt_tap(w, -1, "embd", sh_e, 2, embd));
            for (l = 0; l < m.n_layer; l++)
                for (i = 0; i < NLT; i++) {
                    const size_t *sh = sh_e;
                    int nd = 2;
                    if (i == Q || i == Q_ROPE) { sh = sh_q; nd = 3; }
                    else if (i == K || i == V || i == K_ROPE) { sh = sh_k; nd = 3; }
                    else if (i == KQ) { sh = sh_kq; nd = 3; }
                    else if (i == KQV_OUT) sh = sh_qw;
                    else if (i == FFN_GATE || i == FFN_UP || i == FFN_ACT) sh = sh_ff;
                    check(w, pt_tap(w, (int)l, lt_name[i], sh, nd, buf[l * NLT + i]));
                    ntaps++;
                }
            check(w, pt_tap(w, -1, "result_norm", sh_e, 2, res_norm));
            check(w, pt_tap(w, -1, "logits", sh_v, 2, logits));
            ntaps += 3;
        }
        for (l = 0; l < m.n_layer * NLT; l++) free(buf[l]);
        free(buf);
        free(embd);
        free(res_norm);
        free(logits);
        free(scores);
    }
    if (pt_finish(w, err, sizeof err) != 0) {
        fprintf(stderr, "toy_llama: trace: %s\n", err);
        return 1;
    }
    printf("wrote %s: %zu steps, %zu taps\n", argv[3], g.n, ntaps);
    for (l = 0; l < m.n_layer; l++) {
        free(kc[l]);
        free(vc[l]);
    }
    free(kc);
    free(vc);
    pt_steps_free(&g);
    free(m.t);
    free(m.file);
    return 0;
}
