/* parity_trace.h - write a parity trace from a C, C++ or CUDA (host code) engine.
 *
 * A single header, C99 (stb style): the declarations always; the implementation in the one
 * translation unit that defines PARITY_TRACE_IMPLEMENTATION before it includes this file
 * (before any other #include there: the implementation asks for POSIX.1-2008 with
 * _POSIX_C_SOURCE, which must come first). POSIX only (Linux, macOS, the BSDs).
 *
 *     #define PARITY_TRACE_IMPLEMENTATION
 *     #include "parity_trace.h"
 *
 *     pt_writer *w = pt_create("my-trace", "model.gguf", NULL, "my-engine", "cpu");
 *     if (pt_error(w)) { fprintf(stderr, "%s\n", pt_error(w)); pt_abort(w); return 1; }
 *     pt_step(w, ids, positions, n_ids);                 // the prefill, then one per decode step
 *     size_t shape[2] = {n_ids, n_embd};
 *     pt_tap(w, -1, "embd", shape, 2, x);                // graph-wide taps: layer -1
 *     pt_tap(w, 0, "attn_norm", shape, 2, xn);           // per-layer taps: the layer index
 *     ...
 *     if (pt_finish(w, err, sizeof err)) fprintf(stderr, "%s\n", err);   // manifest.json
 *
 * The format is docs/trace-format.md of parity: one little-endian float32 C-order .npy per
 * (step, tap, layer) at sNNN/TAP-LAYER.npy (sNNN/TAP.npy for graph-wide taps) and a
 * manifest.json. Tap names, shapes (numpy order: token axis first; kq_soft_max is
 * [n_head, T, n_kv]) and the checks are those of parity's Rust TraceWriter
 * (src/trace/api.rs) and scripts/parity_trace.py: an unknown name, a layer on a graph-wide
 * tap (or none on a per-layer one), a token axis that is not the step's token count or a
 * repeated tap is refused with a message naming it, and nothing is written for it.
 *
 * Every function returns 0 on success and -1 on error; none aborts or exits. A refused tap
 * or step leaves the writer usable; a file-system error stops the trace (every later call
 * returns -1 with that error, and pt_finish removes what was written).
 *
 * The trace is written in a folder beside DIR named .DIR.partial-PID and moved into place
 * by pt_finish: a failed or killed run leaves no half-written trace at DIR (a killed one
 * leaves .DIR.partial-PID, which the next pt_create of DIR removes once that process is
 * gone; the header installs no signal handlers, so Ctrl-C counts as killed). DIR itself is never written through a symbolic link. Over a previous trace
 * (a folder with manifest.json), only manifest.json and the sNNN folders are replaced;
 * other files there are kept. A folder with sNNN entries but no manifest.json is refused.
 * One writer per DIR at a time.
 *
 * The golden-ids reader, pt_golden_ids, reads steps[i].tokens and steps[i].positions from a
 * golden's manifest.json (what the engine must be fed) with a small bounded JSON scanner:
 * 64 MiB at most, nesting 128 deep at most, every other key skipped; malformed input is an
 * error message, never a crash.
 *
 * Big-endian hosts: tensors are byte-swapped to little-endian as they are written (tested by
 * forcing that path with -DPARITY_TRACE_TEST_BIG_ENDIAN on a little-endian host).
 */
#ifndef PARITY_TRACE_H
#define PARITY_TRACE_H

#if defined(PARITY_TRACE_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && \
    !defined(_XOPEN_SOURCE) && !defined(_GNU_SOURCE) && !defined(__APPLE__) && !defined(_WIN32)
#define _POSIX_C_SOURCE 200809L
#endif

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PARITY_TRACE_VERSION "0.1.0"
/* At most this many axes per tap (parity's taps have 1 to 3). */
#define PT_MAX_NDIM 8

typedef struct pt_writer pt_writer;

/* Start a trace in folder `dir` for the GGUF at `model_path`. The model's sha256 is recorded
 * so that `parity diff` refuses a golden of another file: `sha256_hex` (64 hex digits; "" to
 * skip that check), or when it is NULL the header hashes `model_path` itself (and records its
 * size). Both NULL: no model recorded. `engine` and `backend` name the producer ("my-engine",
 * "cuda"). Returns NULL only when out of memory; otherwise check pt_error(w): NULL means the
 * writer is ready, a message means it failed (then pt_abort(w)). */
pt_writer *pt_create(const char *dir, const char *model_path, const char *sha256_hex,
                     const char *engine, const char *backend);

/* Optional: the producer's version and free-form settings as a JSON object text
 * ("{\"threads\": 4}"; NULL for {}). The text is checked to be one JSON object. */
int pt_set_producer(pt_writer *w, const char *version, const char *settings_json);

/* Begin a step: the prefill (step 0) with all prompt ids, then one call per decode step.
 * `n` ids and their positions; positions run on from 0 across the steps, one per token. */
int pt_step(pt_writer *w, const uint32_t *tokens, const size_t *positions, size_t n);

/* Record one tensor of the current step: `layer` is the layer index of a per-layer tap, -1
 * for the graph-wide ones (embd, embd_scaled, result_norm, logits_uncapped, logits). `shape`
 * is the numpy shape (`ndim` axes, token axis first; kq_soft_max [n_head, T, n_kv]), `data`
 * the product of it in floats, C order. The file is written before pt_tap returns. */
int pt_tap(pt_writer *w, int layer, const char *name, const size_t *shape, int ndim,
           const float *data);

/* Record to a plan (docs/trace-format.md, "Scan and zoom"), as `parity diff` prints it for a
 * zoom: "taps=l_out,result_norm,logits;full=3" keeps those taps at every step and every tap at
 * step 3; a tap the plan leaves out is accepted by pt_tap and not written. pt_create starts
 * with the plan in the environment variable PARITY_RECORD, if set (a bad one fails pt_create).
 * NULL or "" records every tap. Returns -1 (pt_error says why) on a bad plan.
 * "layers=5" narrows the full steps: there a per-layer tap that taps= leaves out is kept only
 * at those layers (graph-wide taps and the taps listed in taps= are kept as before): tap t of
 * layer l at step s is kept when t is in taps, or s is in full and (t is graph-wide, or no
 * layers part, or l is in layers).
 * "kq_heads=0-3,7;kq_rows=1000-1015" cuts kq_soft_max, wherever it is kept, to those heads and
 * to the rows of those positions (every column kept): stored [heads, rows, n_kv], its manifest
 * entry listing "heads" and "rows" (by position); a step that keeps no row (or a model with no
 * head listed) writes no kq_soft_max. Lists (full, layers, kq_heads, kq_rows) hold numbers and
 * ranges a-b, 4096 items and 2^24 at most; the manifest keeps the plan as parity prints it. */
int pt_set_record(pt_writer *w, const char *plan);

/* Whether the current step keeps tap `name` under the plan at some layer: an engine may skip
 * computing or copying one it leaves out (kq_soft_max at a step none of whose positions
 * kq_rows keeps). 1 before the first step and for a name the format does not know (pt_tap
 * then says what is wrong). The same as pt_wants_layer(w, name, -1). */
int pt_wants(const pt_writer *w, const char *name);

/* Whether the current step keeps tap `name` of layer `layer` (the plan's layers part): the
 * layer as pt_tap takes it, -1 for a graph-wide tap; -1 (any negative) for a per-layer tap
 * asks whether it is kept at any layer, as pt_wants does. */
int pt_wants_layer(const pt_writer *w, const char *name, int layer);

/* The message of the last call that failed (NULL if none has); "out of memory" for NULL. */
const char *pt_error(const pt_writer *w);

/* Write manifest.json, move the trace into place and free the writer (always, also on
 * error). On error the message is copied to `err` (if not NULL; `err_size` bytes, cut). */
int pt_finish(pt_writer *w, char *err, size_t err_size);

/* Free the writer without writing a trace (removes what it wrote). NULL is ignored. */
void pt_abort(pt_writer *w);

/* SHA-256 of a file as 64 lowercase hex digits (+ NUL); its size in *size if not NULL. */
int pt_sha256_file(const char *path, char hex[65], uint64_t *size);

/* One step of a golden: the ids fed and their positions. */
typedef struct pt_step_ids {
    uint32_t *tokens;
    size_t *positions;
    size_t n;
} pt_step_ids;

typedef struct pt_steps {
    pt_step_ids *steps;
    size_t n;
    char error[256]; /* why pt_golden_ids failed ("" on success) */
} pt_steps;

/* Read the steps of GOLDEN_DIR/manifest.json into *out (freed with pt_steps_free, which is
 * also safe after a failure). On error out->error says why and out holds no steps. */
int pt_golden_ids(const char *golden_dir, pt_steps *out);
/* The same from a manifest's text in memory (`len` bytes, need not be NUL-terminated). */
int pt_parse_ids(const char *json, size_t len, pt_steps *out);
void pt_steps_free(pt_steps *s);

#ifdef __cplusplus
}
#endif
#endif /* PARITY_TRACE_H */

/* ------------------------------------------------------------------------------------------ */
#if defined(PARITY_TRACE_IMPLEMENTATION) && !defined(PARITY_TRACE_IMPLEMENTATION_DONE)
#define PARITY_TRACE_IMPLEMENTATION_DONE

#ifdef _WIN32
#error "parity_trace.h: the implementation is POSIX only for now; on Windows write the .npy files and manifest.json as docs/instrument.md (C / C++) shows"
#endif

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8)
#error "parity_trace.h: define PARITY_TRACE_IMPLEMENTATION before the first #include of the file that does (or build it with -D_POSIX_C_SOURCE=200809L): the implementation needs POSIX.1-2008"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* float must be IEEE binary32 for the bytes written to be '<f4'. */
typedef char pt__float_is_4_bytes[sizeof(float) == 4 ? 1 : -1];

#define PT__MAX_POSITION ((size_t)1 << 24) /* as parity's reader (src/trace/format.rs) */
#define PT__MAX_ELEMENTS ((uint64_t)1 << 33)
#define PT__MAX_MANIFEST ((size_t)64 << 20)
#define PT__MAX_DEPTH 128

/* ---- small helpers ---- */

typedef struct pt__buf {
    char *p;
    size_t len, cap;
    int oom;
} pt__buf;

static void pt__put(pt__buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (n > (size_t)-1 - b->len - 1) { b->oom = 1; return; }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        char *q;
        while (cap < b->len + n + 1) {
            if (cap > (size_t)-1 / 2) { b->oom = 1; return; }
            cap *= 2;
        }
        q = (char *)realloc(b->p, cap);
        if (!q) { b->oom = 1; return; }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void pt__puts(pt__buf *b, const char *s) { pt__put(b, s, strlen(s)); }

static void pt__putf(pt__buf *b, const char *fmt, ...) {
    char tmp[128];
    int n;
    va_list ap;
    va_start(ap, fmt);
    n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) { b->oom = 1; return; } /* only short numbers here */
    pt__put(b, tmp, (size_t)n);
}

/* Length of the valid UTF-8 sequence at s (0 if invalid). */
static size_t pt__utf8_len(const unsigned char *s) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return (s[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if ((s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && s[1] < 0xA0) return 0;  /* overlong */
        if (c == 0xED && s[1] > 0x9F) return 0;  /* surrogates */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if ((s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80) return 0;
        if (c == 0xF0 && s[1] < 0x90) return 0;
        if (c == 0xF4 && s[1] > 0x8F) return 0;
        return 4;
    }
    return 0;
}

/* A JSON string: quotes, backslashes and control characters escaped; a byte that is not
 * valid UTF-8 becomes U+FFFD (a manifest must be UTF-8). */
static void pt__json_str(pt__buf *b, const char *s) {
    const unsigned char *p = (const unsigned char *)(s ? s : "");
    pt__put(b, "\"", 1);
    while (*p) {
        unsigned c = *p;
        size_t n;
        if (c == '"') pt__put(b, "\\\"", 2);
        else if (c == '\\') pt__put(b, "\\\\", 2);
        else if (c == '\n') pt__put(b, "\\n", 2);
        else if (c == '\r') pt__put(b, "\\r", 2);
        else if (c == '\t') pt__put(b, "\\t", 2);
        else if (c < 0x20) pt__putf(b, "\\u%04x", c);
        else if ((n = pt__utf8_len(p)) > 0) {
            pt__put(b, (const char *)p, n);
            p += n;
            continue;
        } else pt__put(b, "\\ufffd", 6);
        p++;
    }
    pt__put(b, "\"", 1);
}

static char *pt__strdup(const char *s) {
    size_t n = strlen(s);
    char *q = (char *)malloc(n + 1);
    if (q) memcpy(q, s, n + 1);
    return q;
}

static char *pt__join(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *q = (char *)malloc(na + nb + 2);
    if (!q) return NULL;
    memcpy(q, a, na);
    q[na] = '/';
    memcpy(q + na + 1, b, nb + 1);
    return q;
}

static void pt__shape_str(char *out, size_t size, const size_t *shape, int ndim) {
    size_t len = 0;
    int i;
    out[0] = 0;
    len += (size_t)snprintf(out, size, "[");
    for (i = 0; i < ndim && len < size; i++)
        len += (size_t)snprintf(out + len, size - len, i ? ", %zu" : "%zu", shape[i]);
    if (len < size) snprintf(out + len, size - len, "]");
}

/* ---- SHA-256 (FIPS 180-4), byte-oriented: the same on either byte order ---- */

typedef struct pt__sha256 {
    uint32_t h[8];
    uint64_t bytes;
    unsigned char block[64];
    size_t fill;
} pt__sha256;

static const uint32_t pt__k256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define PT__ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void pt__sha256_block(pt__sha256 *s, const unsigned char *p) {
    uint32_t w[64], a, b, c, d, e, f, g, h, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = PT__ROR(w[i - 15], 7) ^ PT__ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = PT__ROR(w[i - 2], 17) ^ PT__ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = s->h[0]; b = s->h[1]; c = s->h[2]; d = s->h[3];
    e = s->h[4]; f = s->h[5]; g = s->h[6]; h = s->h[7];
    for (i = 0; i < 64; i++) {
        t1 = h + (PT__ROR(e, 6) ^ PT__ROR(e, 11) ^ PT__ROR(e, 25)) + ((e & f) ^ (~e & g)) +
             pt__k256[i] + w[i];
        t2 = (PT__ROR(a, 2) ^ PT__ROR(a, 13) ^ PT__ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    s->h[0] += a; s->h[1] += b; s->h[2] += c; s->h[3] += d;
    s->h[4] += e; s->h[5] += f; s->h[6] += g; s->h[7] += h;
}

static void pt__sha256_init(pt__sha256 *s) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof h0);
    s->bytes = 0;
    s->fill = 0;
}

static void pt__sha256_update(pt__sha256 *s, const unsigned char *p, size_t n) {
    s->bytes += n;
    while (n > 0) {
        size_t take = 64 - s->fill < n ? 64 - s->fill : n;
        if (s->fill == 0 && n >= 64) {
            pt__sha256_block(s, p);
            p += 64;
            n -= 64;
            continue;
        }
        memcpy(s->block + s->fill, p, take);
        s->fill += take;
        p += take;
        n -= take;
        if (s->fill == 64) {
            pt__sha256_block(s, s->block);
            s->fill = 0;
        }
    }
}

static void pt__sha256_hex(pt__sha256 *s, char hex[65]) {
    uint64_t bits = s->bytes * 8;
    unsigned char pad[72];
    size_t npad = (s->fill < 56 ? 56 : 120) - s->fill;
    int i;
    memset(pad, 0, sizeof pad);
    pad[0] = 0x80;
    for (i = 0; i < 8; i++) pad[npad + (size_t)i] = (unsigned char)(bits >> (56 - 8 * i));
    pt__sha256_update(s, pad, npad + 8);
    for (i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", (unsigned)(s->h[i / 4] >> (24 - 8 * (i % 4))) & 0xffu);
    hex[64] = 0;
}

int pt_sha256_file(const char *path, char hex[65], uint64_t *size) {
    pt__sha256 s;
    unsigned char *chunk;
    FILE *f;
    struct stat st;
    size_t n;
    int rc = 0;
    if (!path || !hex) return -1;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) return -1; /* never a FIFO or device */
    f = fopen(path, "rb");
    if (!f) return -1;
    chunk = (unsigned char *)malloc(1 << 16);
    if (!chunk) { fclose(f); return -1; }
    pt__sha256_init(&s);
    while ((n = fread(chunk, 1, 1 << 16, f)) > 0) pt__sha256_update(&s, chunk, n);
    if (ferror(f)) rc = -1;
    fclose(f);
    free(chunk);
    if (rc == 0) {
        if (size) *size = s.bytes;
        pt__sha256_hex(&s, hex);
    }
    return rc;
}

/* ---- tap names (docs/trace-format.md; src/trace/taps.rs order = graph order) ---- */

static const struct { const char *name; int per_layer; } pt__taps[] = {
    {"embd", 0},        {"embd_scaled", 0},     {"attn_norm", 1}, {"q", 1},
    {"k", 1},           {"v", 1},               {"q_normed", 1},  {"k_normed", 1},
    {"q_rope", 1},      {"k_rope", 1},          {"kq_soft_max", 1}, {"kqv_out", 1},
    {"attn_out", 1},    {"attn_post_norm", 1},  {"ffn_inp", 1},   {"ffn_norm", 1},
    {"ffn_gate", 1},    {"ffn_up", 1},          {"ffn_act", 1},   {"ffn_out", 1},
    {"ffn_post_norm", 1}, {"l_out", 1},         {"result_norm", 0}, {"logits_uncapped", 0},
    {"logits", 0}};
#define PT__NTAPS ((int)(sizeof pt__taps / sizeof pt__taps[0]))
#define PT__KQ_SOFT_MAX 10

/* ---- the writer ---- */

/* An inclusive range lo..hi of steps, heads or positions. */
typedef struct pt__range {
    size_t lo, hi;
} pt__range;

typedef struct pt__entry {
    size_t step;
    int layer; /* -1: graph-wide */
    int tap;
    int ndim;
    size_t shape[PT_MAX_NDIM];
    /* A kq_soft_max cut by the plan's kq_heads / kq_rows part: the heads and the positions
     * kept, as increasing ranges (NULL: that part was not in the plan). */
    pt__range *heads, *rows;
    size_t nheads, nrows;
} pt__entry;

typedef struct pt__stepinfo {
    uint32_t *tokens;
    size_t *positions;
    size_t n;
} pt__stepinfo;

struct pt_writer {
    char *dir;  /* absolute, no trailing slash */
    char *tmp;  /* .NAME.partial-PID beside it */
    char *model_path, *engine, *backend, *version, *settings;
    char sha256[65];
    int have_size;
    uint64_t size;
    pt__stepinfo *steps;
    size_t nsteps, capsteps, next_pos;
    pt__entry *entries;
    size_t nentries, capentries;
    int broken; /* a file-system error: the trace is lost */
    int failed; /* some call failed: err holds its message */
    char err[512];
    /* The recording plan: rec_line (its canonical line) NULL records every tap; else
     * rec_tap[t] keeps tap t at every step, and the steps in rec_full keep every tap (every
     * per-layer tap only at the layers in rec_layers, when it lists any). A kept kq_soft_max
     * holds only the heads in rec_heads and the rows whose positions are in rec_rows (none
     * listed: every head, every row). Each list is sorted and merged. */
    char *rec_line;
    unsigned char rec_tap[64];
    pt__range *rec_full, *rec_layers, *rec_heads, *rec_rows;
    size_t rec_nfull, rec_nlayers, rec_nheads, rec_nrows;
};

static const char pt__oom[] = "out of memory";

static int pt__fail(pt_writer *w, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->err, sizeof w->err, fmt, ap);
    va_end(ap);
    w->failed = 1;
    return -1;
}

/* A file-system error: the trace cannot be finished. */
static int pt__fatal(pt_writer *w, const char *what, const char *path, int e) {
    pt__fail(w, "%s %s: %s", what, path, strerror(e));
    w->broken = 1;
    return -1;
}

/* The most numbers and ranges one list of a recording plan may hold (full, layers, kq_heads,
 * kq_rows). */
#define PT__MAX_RANGES 4096

/* [*s, *s + *n) without leading and trailing spaces. */
static void pt__trim(const char **s, size_t *n) {
    while (*n && (**s == ' ' || **s == '\t' || **s == '\n' || **s == '\r')) (*s)++, (*n)--;
    while (*n && ((*s)[*n - 1] == ' ' || (*s)[*n - 1] == '\t' || (*s)[*n - 1] == '\n' ||
                  (*s)[*n - 1] == '\r'))
        (*n)--;
}

/* [s, s + n) as an error message quotes it: at most 60 bytes, control bytes as \xNN. */
static const char *pt__shown(char out[256], const char *s, size_t n) {
    size_t o = 0, i;
    for (i = 0; i < n && s[i] && i < 60 && o + 5 < 256; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f) o += (size_t)snprintf(out + o, 256 - o, "\\x%02x", c);
        else out[o++] = (char)c;
    }
    out[o] = 0;
    return out;
}

/* Whether [s, s + n) spells `word`. */
static int pt__is(const char *s, size_t n, const char *word) {
    return strlen(word) == n && memcmp(s, word, n) == 0;
}

/* A number in [s, s + n): digits only, PT__MAX_POSITION at most (as parity's reader). */
static int pt__num(const char *s, size_t n, size_t *out) {
    size_t v = 0, i;
    if (n == 0) return -1;
    for (i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (size_t)(s[i] - '0'); /* v <= PT__MAX_POSITION before: cannot overflow */
        if (v > PT__MAX_POSITION) return -1;
    }
    *out = v;
    return 0;
}

static int pt__range_cmp(const void *a, const void *b) {
    const pt__range *x = (const pt__range *)a, *y = (const pt__range *)b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* The list [s, s + n) of plan part `key` ("3,7-8": numbers and inclusive ranges a-b; `what`
 * names a number) into *out, sorted, overlapping and touching ranges joined; empty items are
 * skipped. At most PT__MAX_RANGES items. */
static int pt__parse_ranges(pt_writer *w, const char *key, const char *what, const char *s,
                            size_t n, pt__range **out, size_t *nout) {
    pt__range *r = NULL;
    size_t nr = 0, cap = 0, i, k;
    char shown[256];
    *out = NULL;
    *nout = 0;
    for (;;) {
        const char *comma = (const char *)memchr(s, ',', n), *it = s, *lo, *hi, *dash;
        size_t len = comma ? (size_t)(comma - s) : n, itn = len, lon, hin, a, b;
        pt__trim(&it, &itn);
        if (itn) {
            dash = (const char *)memchr(it, '-', itn);
            lo = it;
            lon = dash ? (size_t)(dash - it) : itn;
            hi = dash ? dash + 1 : it;
            hin = dash ? itn - lon - 1 : itn;
            pt__trim(&lo, &lon);
            pt__trim(&hi, &hin);
            if (pt__num(lo, lon, &a) || pt__num(hi, hin, &b)) {
                pt__fail(w, "%s: '%s' is not a %s or a range a-b", key,
                         pt__shown(shown, it, itn), what);
                goto fail;
            }
            if (a > b) {
                pt__fail(w, "%s: the range %zu-%zu runs backwards", key, a, b);
                goto fail;
            }
            if (nr == PT__MAX_RANGES) {
                pt__fail(w, "%s: more than %d items", key, PT__MAX_RANGES);
                goto fail;
            }
            if (nr == cap) { /* cap <= PT__MAX_RANGES: the size cannot overflow */
                pt__range *q;
                cap = cap ? 2 * cap : 16;
                if (!(q = (pt__range *)realloc(r, cap * sizeof *r))) {
                    pt__fail(w, "%s", pt__oom);
                    goto fail;
                }
                r = q;
            }
            r[nr].lo = a;
            r[nr].hi = b;
            nr++;
        }
        if (!comma) break;
        n -= len + 1;
        s = comma + 1;
    }
    if (nr > 1) {
        qsort(r, nr, sizeof *r, pt__range_cmp);
        for (i = 1, k = 0; i < nr; i++) {
            if (r[i].lo <= r[k].hi || r[i].lo - 1 <= r[k].hi) { /* overlaps or touches */
                if (r[i].hi > r[k].hi) r[k].hi = r[i].hi;
            } else r[++k] = r[i];
        }
        nr = k + 1;
    }
    *out = r;
    *nout = nr;
    return 0;
fail:
    free(r);
    return -1;
}

/* Ranges as a plan prints them: 3,4-5. */
static void pt__put_ranges(pt__buf *b, const pt__range *r, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        if (i) pt__put(b, ",", 1);
        if (r[i].lo == r[i].hi) pt__putf(b, "%zu", r[i].lo);
        else pt__putf(b, "%zu-%zu", r[i].lo, r[i].hi);
    }
}

int pt_set_record(pt_writer *w, const char *plan) {
    /* In the order parity prints them. */
    static const char *const keys[5] = {"taps", "full", "layers", "kq_heads", "kq_rows"};
    static const char *const what[5] = {"", "step number", "layer number", "head number",
                                        "position"};
    unsigned char taps[64];
    pt__range *lists[5] = {NULL, NULL, NULL, NULL, NULL};
    size_t nl[5] = {0, 0, 0, 0, 0};
    int seen[5] = {0, 0, 0, 0, 0}, all = 1, rc = -1, k, d;
    const char *p = plan;
    char shown[256];
    pt__buf line = {NULL, 0, 0, 0};
    if (!w) return -1;
    memset(taps, 0, sizeof taps);
    while (p && *p) {
        const char *end = strchr(p, ';'), *part = p, *eq, *key, *val;
        size_t n, kn, vn;
        if (!end) end = p + strlen(p);
        n = (size_t)(end - p);
        p = *end ? end + 1 : end;
        pt__trim(&part, &n);
        if (!n) continue;
        if (!(eq = (const char *)memchr(part, '=', n))) {
            pt__fail(w, "'%s' is not key=value (taps=l_out,logits;full=3)",
                     pt__shown(shown, part, n));
            goto done;
        }
        key = part;
        kn = (size_t)(eq - part);
        val = eq + 1;
        vn = (size_t)(part + n - val);
        pt__trim(&key, &kn);
        for (k = 0; k < 5 && !pt__is(key, kn, keys[k]); k++) continue;
        if (k == 5) {
            pt__fail(w, "unknown part '%s' "
                        "(taps=...;full=...;layers=...;kq_heads=...;kq_rows=...)",
                     pt__shown(shown, key, kn));
            goto done;
        }
        if (seen[k]++) {
            pt__fail(w, "'%s' is given twice", keys[k]);
            goto done;
        }
        if (k > 0) {
            if (pt__parse_ranges(w, keys[k], what[k], val, vn, &lists[k], &nl[k])) goto done;
            if (k > 1 && nl[k] == 0) { /* full= is no step in full; layers= keeps nothing */
                pt__fail(w, "%s: no %s given", keys[k], what[k]);
                goto done;
            }
            continue;
        }
        for (;;) {
            const char *comma = (const char *)memchr(val, ',', vn), *it = val;
            size_t len = comma ? (size_t)(comma - val) : vn, itn = len;
            int tap = -1;
            pt__trim(&it, &itn);
            for (d = 0; d < PT__NTAPS; d++)
                if (pt__is(it, itn, pt__taps[d].name)) tap = d;
            if (pt__is(it, itn, "all")) all = 2;
            else if (tap < 0) {
                pt__fail(w, "taps: unknown tap '%s' (docs/trace-format.md lists them)",
                         pt__shown(shown, it, itn));
                goto done;
            } else {
                taps[tap] = 1;
                if (all == 1) all = 0;
            }
            if (!comma) break;
            vn -= len + 1;
            val = comma + 1;
        }
    }
    if (plan && *plan) { /* the canonical line, as parity prints it, for the manifest */
        pt__puts(&line, "taps=");
        if (all) pt__puts(&line, "all");
        else
            for (d = 0, k = 0; d < PT__NTAPS; d++)
                if (taps[d]) {
                    if (k++) pt__put(&line, ",", 1);
                    pt__puts(&line, pt__taps[d].name);
                }
        for (k = 1; k < 5; k++)
            if (nl[k]) {
                pt__putf(&line, ";%s=", keys[k]);
                pt__put_ranges(&line, lists[k], nl[k]);
            }
        if (line.oom) {
            pt__fail(w, "%s", pt__oom);
            goto done;
        }
    }
    free(w->rec_line);
    free(w->rec_full);
    free(w->rec_layers);
    free(w->rec_heads);
    free(w->rec_rows);
    w->rec_line = line.p;
    line.p = NULL;
    w->rec_full = lists[1];
    w->rec_layers = lists[2];
    w->rec_heads = lists[3];
    w->rec_rows = lists[4];
    w->rec_nfull = nl[1];
    w->rec_nlayers = nl[2];
    w->rec_nheads = nl[3];
    w->rec_nrows = nl[4];
    lists[1] = lists[2] = lists[3] = lists[4] = NULL;
    memcpy(w->rec_tap, taps, sizeof taps);
    if (all) memset(w->rec_tap, 1, sizeof w->rec_tap);
    rc = 0;
done:
    for (k = 0; k < 5; k++) free(lists[k]);
    free(line.p);
    return rc;
}

/* Whether ranges r (n of them) hold v. */
static int pt__in(const pt__range *r, size_t n, size_t v) {
    size_t i;
    for (i = 0; i < n; i++)
        if (r[i].lo <= v && v <= r[i].hi) return 1;
    return 0;
}

/* Whether the plan keeps tap `tap` of layer `layer` at `step`. A graph-wide tap has no layer
 * (whatever `layer` says); layer < 0 for a per-layer one: at any layer (a layers part lists at
 * least one). */
static int pt__wants_tap(const pt_writer *w, size_t step, int tap, int layer) {
    if (!w->rec_line || w->rec_tap[tap]) return 1;
    if (!pt__in(w->rec_full, w->rec_nfull, step)) return 0;
    if (!pt__taps[tap].per_layer || layer < 0 || !w->rec_nlayers) return 1;
    return pt__in(w->rec_layers, w->rec_nlayers, (size_t)layer);
}

/* The part of lo..lo+n-1 (n > 0) that ranges r keep, as ranges into *out (*nout of them, 0:
 * none kept); no ranges (nr 0): all of it. -1 when out of memory. */
static int pt__kept(const pt__range *r, size_t nr, size_t lo, size_t n, pt__range **out,
                    size_t *nout) {
    size_t hi = lo + (n - 1), i, k = 0; /* lo + n - 1 fits: a step's positions are bounded */
    *out = (pt__range *)malloc((nr ? nr : 1) * sizeof **out); /* nr <= PT__MAX_RANGES */
    *nout = 0;
    if (!*out) return -1;
    if (!nr) {
        (*out)[0].lo = lo;
        (*out)[0].hi = hi;
        *nout = 1;
        return 0;
    }
    for (i = 0; i < nr; i++)
        if (r[i].lo <= hi && r[i].hi >= lo) {
            (*out)[k].lo = r[i].lo > lo ? r[i].lo : lo;
            (*out)[k].hi = r[i].hi < hi ? r[i].hi : hi;
            k++;
        }
    *nout = k;
    return 0;
}

int pt_wants(const pt_writer *w, const char *name) { return pt_wants_layer(w, name, -1); }

int pt_wants_layer(const pt_writer *w, const char *name, int layer) {
    int d;
    size_t i;
    if (!w || !name || w->nsteps == 0) return 1;
    for (d = 0; d < PT__NTAPS; d++)
        if (!strcmp(name, pt__taps[d].name)) {
            const pt__stepinfo *st = &w->steps[w->nsteps - 1];
            if (!pt__wants_tap(w, w->nsteps - 1, d, layer)) return 0;
            if (d != PT__KQ_SOFT_MAX || !w->rec_nrows) return 1;
            for (i = 0; i < w->rec_nrows; i++) /* kq_rows keeps a position of the step */
                if (w->rec_rows[i].lo <= st->positions[st->n - 1] &&
                    w->rec_rows[i].hi >= st->positions[0])
                    return 1;
            return 0;
        }
    return 1;
}

const char *pt_error(const pt_writer *w) {
    if (!w) return pt__oom;
    return w->failed ? w->err : NULL;
}

/* Remove a file or folder tree; a symbolic link is removed, never followed. */
static int pt__rm_rf(const char *path, int depth) {
    struct stat st;
    DIR *d;
    struct dirent *e;
    char **names = NULL;
    size_t n = 0, cap = 0, i;
    int rc = 0;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : -1;
    if (!S_ISDIR(st.st_mode)) return unlink(path);
    if (depth > 16) return -1;
    d = opendir(path);
    if (!d) return -1;
    while ((e = readdir(d)) != NULL) { /* names first: never remove while reading */
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (n == cap) {
            char **q = (char **)realloc(names, (cap ? cap * 2 : 16) * sizeof *names);
            if (!q) { rc = -1; break; }
            names = q;
            cap = cap ? cap * 2 : 16;
        }
        if (!(names[n] = pt__join(path, e->d_name))) { rc = -1; break; }
        n++;
    }
    closedir(d);
    for (i = 0; i < n; i++) {
        if (rc == 0 && pt__rm_rf(names[i], depth + 1) != 0) rc = -1;
        free(names[i]);
    }
    free(names);
    if (rc == 0 && rmdir(path) != 0) rc = -1;
    return rc;
}

/* sNNN: an entry a trace consists of (besides manifest.json). */
static int pt__is_step_name(const char *n) {
    size_t i;
    if (n[0] != 's' || !n[1]) return 0;
    for (i = 1; n[i]; i++)
        if (n[i] < '0' || n[i] > '9') return 0;
    return 1;
}

/* DIR may be replaced: not a link, a folder; if it holds sNNN entries, they are folders of
 * a previous trace (one with a manifest.json file). Absent is fine. */
static int pt__check_out_dir(pt_writer *w, const char *dir) {
    struct stat st;
    DIR *d;
    struct dirent *e;
    char *mp;
    int was_trace, rc = 0;
    if (lstat(dir, &st) != 0) {
        if (errno == ENOENT) return 0;
        return pt__fatal(w, "cannot read", dir, errno);
    }
    if (S_ISLNK(st.st_mode)) {
        w->broken = 1;
        return pt__fail(w, "%s: is a symbolic link: parity never writes through a link, give "
                           "the folder's own path", dir);
    }
    if (!S_ISDIR(st.st_mode)) {
        w->broken = 1;
        return pt__fail(w, "%s: exists and is not a folder", dir);
    }
    if (!(mp = pt__join(dir, "manifest.json"))) return pt__fatal(w, "joining", dir, ENOMEM);
    was_trace = lstat(mp, &st) == 0;
    if (was_trace && !S_ISREG(st.st_mode)) {
        w->broken = 1;
        pt__fail(w, "%s: is not a file: only a previous trace is replaced, remove it or choose "
                    "another folder", mp);
        free(mp);
        return -1;
    }
    free(mp);
    if (!(d = opendir(dir))) return pt__fatal(w, "cannot read", dir, errno);
    while ((e = readdir(d)) != NULL) {
        char *p;
        if (!pt__is_step_name(e->d_name)) continue;
        if (!(p = pt__join(dir, e->d_name))) { rc = pt__fatal(w, "joining", dir, ENOMEM); break; }
        if (!was_trace || lstat(p, &st) != 0 || !S_ISDIR(st.st_mode)) {
            w->broken = 1;
            rc = pt__fail(w, "%s: not a trace's step folder (%s): only a previous trace is "
                             "replaced, remove it or choose another folder", p,
                          was_trace ? "not a folder" : "the folder has no manifest.json");
            free(p);
            break;
        }
        free(p);
    }
    closedir(d);
    return rc;
}

static int pt__mkdir_p(char *path) { /* modifies path temporarily */
    char *s;
    struct stat st;
    for (s = path + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(path, 0777) != 0 && errno != EEXIST) { *s = '/'; return -1; }
        *s = '/';
    }
    if (mkdir(path, 0777) != 0 && errno != EEXIST) return -1;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) { errno = ENOTDIR; return -1; }
    return 0;
}

/* Remove .NAME.partial-PID folders in `parent` of processes that no longer run, and ours. */
static void pt__remove_stale(const char *parent, const char *name) {
    DIR *d = opendir(parent);
    struct dirent *e;
    size_t nl = strlen(name);
    char **victims = NULL;
    size_t n = 0, i;
    if (!d) return;
    while ((e = readdir(d)) != NULL) {
        const char *s = e->d_name, *digits;
        long pid = 0;
        char **q;
        if (s[0] != '.' || strncmp(s + 1, name, nl) != 0 || strncmp(s + 1 + nl, ".partial-", 9))
            continue;
        digits = s + 1 + nl + 9;
        if (!*digits || strlen(digits) > 9) continue;
        for (; *digits; digits++) {
            if (*digits < '0' || *digits > '9') break;
            pid = pid * 10 + (*digits - '0');
        }
        if (*digits || pid <= 0) continue;
        if ((pid_t)pid != getpid() && !(kill((pid_t)pid, 0) != 0 && errno == ESRCH)) continue;
        q = (char **)realloc(victims, (n + 1) * sizeof *victims);
        if (!q) break;
        victims = q;
        if ((victims[n] = pt__join(parent, s)) != NULL) n++;
    }
    closedir(d);
    for (i = 0; i < n; i++) {
        pt__rm_rf(victims[i], 0);
        free(victims[i]);
    }
    free(victims);
}

static int pt__hex_ok(const char *s, char out[65]) {
    int i;
    for (i = 0; i < 64; i++) {
        char c = s[i];
        if (c >= 'A' && c <= 'F') c = (char)(c - 'A' + 'a');
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return 0;
        out[i] = c;
    }
    out[64] = 0;
    return s[64] == 0;
}

pt_writer *pt_create(const char *dir, const char *model_path, const char *sha256_hex,
                     const char *engine, const char *backend) {
    pt_writer *w = (pt_writer *)calloc(1, sizeof *w);
    char *abs = NULL, *parent = NULL, *base, *slash;
    size_t len;
    char pid[32];
    if (!w) return NULL;
    w->model_path = pt__strdup(model_path ? model_path : "");
    w->engine = pt__strdup(engine && *engine ? engine : "c-engine");
    w->backend = pt__strdup(backend && *backend ? backend : "cpu");
    w->version = pt__strdup("");
    if (!w->model_path || !w->engine || !w->backend || !w->version) {
        pt__fatal(w, "creating", "the writer", ENOMEM);
        return w;
    }
    if (!dir || !*dir) {
        w->broken = 1;
        pt__fail(w, "pt_create: no output folder given");
        return w;
    }
    if (getenv("PARITY_RECORD") && pt_set_record(w, getenv("PARITY_RECORD")) != 0) {
        char why[512];
        memcpy(why, w->err, sizeof why);
        w->broken = 1;
        pt__fail(w, "PARITY_RECORD: %s", why);
        return w;
    }
    if (sha256_hex) {
        if (*sha256_hex && !pt__hex_ok(sha256_hex, w->sha256)) {
            w->broken = 1;
            pt__fail(w, "pt_create: sha256 '%.80s' is not 64 hex digits (\"\" skips the check)",
                     sha256_hex);
            return w;
        }
    } else if (model_path && *model_path) {
        if (pt_sha256_file(model_path, w->sha256, &w->size) != 0) {
            int e = errno ? errno : EIO;
            struct stat st;
            if (stat(model_path, &st) == 0 && !S_ISREG(st.st_mode)) {
                w->broken = 1;
                pt__fail(w, "model %s: not a regular file", model_path);
            } else pt__fatal(w, "cannot hash the model", model_path, e);
            return w;
        }
        w->have_size = 1;
    }
    /* The folder by absolute path (a later chdir changes nothing), without trailing '/'. */
    if (dir[0] == '/') abs = pt__strdup(dir);
    else {
        char cwd[4096];
        if (!getcwd(cwd, sizeof cwd)) { pt__fatal(w, "getcwd for", dir, errno); return w; }
        abs = pt__join(cwd, dir);
    }
    if (!abs) { pt__fatal(w, "creating", dir, ENOMEM); return w; }
    len = strlen(abs);
    while (len > 1 && abs[len - 1] == '/') abs[--len] = 0;
    slash = strrchr(abs, '/');
    base = slash + 1;
    if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) {
        w->broken = 1;
        pt__fail(w, "%s: name the trace folder itself (not /, . or ..)", dir);
        free(abs);
        return w;
    }
    w->dir = abs;
    if (pt__check_out_dir(w, abs) != 0) return w;
    parent = (char *)malloc((size_t)(slash - abs) + 2);
    if (!parent) { pt__fatal(w, "creating", dir, ENOMEM); return w; }
    if (slash == abs) strcpy(parent, "/");
    else {
        memcpy(parent, abs, (size_t)(slash - abs));
        parent[slash - abs] = 0;
    }
    if (pt__mkdir_p(parent) != 0) {
        pt__fatal(w, "cannot create", parent, errno);
        free(parent);
        return w;
    }
    pt__remove_stale(parent, base);
    snprintf(pid, sizeof pid, ".partial-%ld", (long)getpid());
    w->tmp = (char *)malloc(strlen(parent) + strlen(base) + strlen(pid) + 3);
    if (!w->tmp) { pt__fatal(w, "creating", dir, ENOMEM); free(parent); return w; }
    sprintf(w->tmp, "%s/.%s%s", strcmp(parent, "/") ? parent : "", base, pid);
    free(parent);
    if (mkdir(w->tmp, 0777) != 0) {
        int e = errno;
        free(w->tmp);
        w->tmp = NULL; /* not ours: never removed */
        pt__fatal(w, "cannot create", dir, e);
    }
    return w;
}

/* ---- a bounded JSON scanner (used to check settings and to read golden ids) ---- */

typedef struct pt__js {
    const char *start, *p, *end;
    char *err;
    size_t errn;
    int depth;
} pt__js;

static int pt__jfail(pt__js *j, const char *what) {
    if (j->err && !j->err[0])
        snprintf(j->err, j->errn, "manifest.json: byte %zu: %s", (size_t)(j->p - j->start),
                 j->p >= j->end ? "unexpected end (truncated?)" : what);
    return -1;
}

static void pt__jws(pt__js *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t'))
        j->p++;
}

static int pt__jhex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A string at j->p (the opening quote); its raw contents are [*s, *s + *n). */
static int pt__jstring(pt__js *j, const char **s, size_t *n) {
    if (j->p >= j->end || *j->p != '"') return pt__jfail(j, "expected a string");
    j->p++;
    *s = j->p;
    for (;;) {
        unsigned char c;
        if (j->p >= j->end) return pt__jfail(j, "unterminated string");
        c = (unsigned char)*j->p;
        if (c == '"') break;
        if (c < 0x20) return pt__jfail(j, "control character in a string");
        if (c == '\\') {
            j->p++;
            if (j->p >= j->end) return pt__jfail(j, "unterminated string");
            c = (unsigned char)*j->p;
            if (c == 'u') {
                int i;
                for (i = 1; i <= 4; i++)
                    if (j->p + i >= j->end || pt__jhex(j->p[i]) < 0)
                        return pt__jfail(j, "bad \\u escape");
                j->p += 4;
            } else if (!strchr("\"\\/bfnrt", (int)c) || c == 0) {
                return pt__jfail(j, "bad escape in a string");
            }
        }
        j->p++;
    }
    *n = (size_t)(j->p - *s);
    j->p++;
    return 0;
}

/* Does the raw string [s, s+n) decode to `want` (ASCII)? Escapes are decoded (\u00XX too). */
static int pt__jeq(const char *s, size_t n, const char *want) {
    size_t i = 0;
    for (; *want; want++) {
        int c;
        if (i >= n) return 0;
        c = (unsigned char)s[i++];
        if (c == '\\') {
            char e = s[i++];
            if (e == 'u') {
                c = (pt__jhex(s[i]) << 12) | (pt__jhex(s[i + 1]) << 8) | (pt__jhex(s[i + 2]) << 4) |
                    pt__jhex(s[i + 3]);
                i += 4;
            } else if (e == 'n') c = '\n';
            else if (e == 't') c = '\t';
            else if (e == 'r') c = '\r';
            else if (e == 'b') c = '\b';
            else if (e == 'f') c = '\f';
            else c = (unsigned char)e;
        }
        if (c != (unsigned char)*want) return 0;
    }
    return i == n;
}

/* A number: checks the JSON grammar. If `val` is given the number must be a non-negative
 * integer no larger than `max`. */
static int pt__jnumber(pt__js *j, uint64_t *val, uint64_t max) {
    const char *p = j->p;
    uint64_t v = 0;
    int over = 0, frac = 0; /* frac: not a non-negative integer (sign, fraction, exponent) */
    if (p < j->end && *p == '-') { p++; frac = 1; }
    if (p >= j->end || *p < '0' || *p > '9') return pt__jfail(j, "expected a value");
    if (*p == '0') p++;
    else
        while (p < j->end && *p >= '0' && *p <= '9') {
            unsigned d = (unsigned)(*p - '0');
            if (v > (max - d) / 10) over = 1;
            else v = v * 10 + d;
            p++;
        }
    if (p < j->end && *p == '.') {
        frac = 1;
        p++;
        if (p >= j->end || *p < '0' || *p > '9') return pt__jfail(j, "bad number");
        while (p < j->end && *p >= '0' && *p <= '9') p++;
    }
    if (p < j->end && (*p == 'e' || *p == 'E')) {
        frac = 1;
        p++;
        if (p < j->end && (*p == '+' || *p == '-')) p++;
        if (p >= j->end || *p < '0' || *p > '9') return pt__jfail(j, "bad number");
        while (p < j->end && *p >= '0' && *p <= '9') p++;
    }
    if (val) {
        if (frac) return pt__jfail(j, "expected a non-negative integer");
        if (over) {
            char m[96];
            snprintf(m, sizeof m, "number too large (%llu at most)", (unsigned long long)max);
            return pt__jfail(j, m);
        }
        *val = v;
    }
    j->p = p;
    return 0;
}

static int pt__jskip(pt__js *j);

static int pt__jlit(pt__js *j, const char *lit) {
    size_t n = strlen(lit), left = (size_t)(j->end - j->p);
    if (left < n && memcmp(j->p, lit, left) == 0) {
        j->p = j->end;
        return pt__jfail(j, "truncated");
    }
    if (left < n || memcmp(j->p, lit, n) != 0) return pt__jfail(j, "expected a value");
    j->p += n;
    return 0;
}

/* Any value, checked and skipped; nesting bounded. */
static int pt__jskip(pt__js *j) {
    const char *s;
    size_t n;
    pt__jws(j);
    if (j->p >= j->end) return pt__jfail(j, "unexpected end (truncated?)");
    switch (*j->p) {
    case '"':
        return pt__jstring(j, &s, &n);
    case 't':
        return pt__jlit(j, "true");
    case 'f':
        return pt__jlit(j, "false");
    case 'n':
        return pt__jlit(j, "null");
    case '{':
    case '[': {
        char close = *j->p == '{' ? '}' : ']';
        int obj = close == '}';
        if (++j->depth > PT__MAX_DEPTH) return pt__jfail(j, "nested deeper than 128 levels");
        j->p++;
        pt__jws(j);
        if (j->p < j->end && *j->p == close) {
            j->p++;
            j->depth--;
            return 0;
        }
        for (;;) {
            if (obj) {
                pt__jws(j);
                if (pt__jstring(j, &s, &n)) return -1;
                pt__jws(j);
                if (j->p >= j->end || *j->p != ':') return pt__jfail(j, "expected ':'");
                j->p++;
            }
            if (pt__jskip(j)) return -1;
            pt__jws(j);
            if (j->p >= j->end) return pt__jfail(j, "unexpected end (truncated?)");
            if (*j->p == ',') { j->p++; continue; }
            if (*j->p == close) { j->p++; break; }
            return pt__jfail(j, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        }
        j->depth--;
        return 0;
    }
    default:
        return pt__jnumber(j, NULL, 0);
    }
}

int pt_set_producer(pt_writer *w, const char *version, const char *settings_json) {
    char *v, *s = NULL;
    if (!w) return -1;
    if (w->broken) return -1;
    if (settings_json) {
        pt__js j;
        char err[160] = "";
        j.start = j.p = settings_json;
        j.end = settings_json + strlen(settings_json);
        j.err = err;
        j.errn = sizeof err;
        j.depth = 0;
        pt__jws(&j);
        if (j.p >= j.end || *j.p != '{') pt__jfail(&j, "not an object");
        else if (pt__jskip(&j) == 0 && (pt__jws(&j), j.p != j.end)) pt__jfail(&j, "text after it");
        if (err[0])
            return pt__fail(w, "pt_set_producer: settings are not one JSON object (%s)", err + 15);
        if (!(s = pt__strdup(settings_json))) return pt__fail(w, "%s", pt__oom);
    }
    if (!(v = pt__strdup(version ? version : ""))) { free(s); return pt__fail(w, "%s", pt__oom); }
    free(w->version);
    w->version = v;
    free(w->settings);
    w->settings = s;
    return 0;
}

int pt_step(pt_writer *w, const uint32_t *tokens, const size_t *positions, size_t n) {
    pt__stepinfo *st;
    size_t i;
    if (!w) return -1;
    if (w->broken) return -1;
    if (n == 0 || !tokens || !positions)
        return pt__fail(w, "step %zu: %zu tokens%s (need at least one, and their positions)",
                        w->nsteps, n, n && !tokens ? " given as NULL" : "");
    for (i = 0; i < n; i++)
        if (positions[i] != w->next_pos + i || positions[i] > PT__MAX_POSITION)
            return pt__fail(w, "step %zu has position %zu at index %zu, expected %zu (positions "
                               "run on from 0 across the steps, one per token)",
                            w->nsteps, positions[i], i, w->next_pos + i);
    if (w->nsteps == w->capsteps) {
        size_t cap = w->capsteps ? w->capsteps * 2 : 16;
        pt__stepinfo *q = (pt__stepinfo *)realloc(w->steps, cap * sizeof *q);
        if (!q) return pt__fail(w, "%s", pt__oom);
        w->steps = q;
        w->capsteps = cap;
    }
    st = &w->steps[w->nsteps];
    if (n > (size_t)-1 / sizeof(size_t)) return pt__fail(w, "%s", pt__oom);
    st->tokens = (uint32_t *)malloc(n * sizeof *st->tokens);
    st->positions = (size_t *)malloc(n * sizeof *st->positions);
    if (!st->tokens || !st->positions) {
        free(st->tokens);
        free(st->positions);
        return pt__fail(w, "%s", pt__oom);
    }
    memcpy(st->tokens, tokens, n * sizeof *tokens);
    memcpy(st->positions, positions, n * sizeof *positions);
    st->n = n;
    w->nsteps++;
    w->next_pos += n;
    return 0;
}

static int pt__host_big_endian(void) {
#ifdef PARITY_TRACE_TEST_BIG_ENDIAN /* tests: take the byte-swapping path on any host */
    return 1;
#else
    const uint32_t one = 1;
    unsigned char c;
    memcpy(&c, &one, 1);
    return c == 0;
#endif
}

static int pt__write_all(int fd, const void *data, size_t n) {
    const char *p = (const char *)data;
    while (n > 0) {
        ssize_t k = write(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* `n` floats as little-endian. */
static int pt__write_floats(int fd, const float *data, size_t n) {
    unsigned char buf[1 << 14];
    size_t done = 0;
    if (!pt__host_big_endian()) return pt__write_all(fd, data, n * sizeof(float));
    while (done < n) {
        size_t k = n - done < sizeof buf / 4 ? n - done : sizeof buf / 4, i;
        memcpy(buf, data + done, k * 4);
        for (i = 0; i < k; i++) {
            unsigned char t = buf[4 * i];
            buf[4 * i] = buf[4 * i + 3];
            buf[4 * i + 3] = t;
            t = buf[4 * i + 1];
            buf[4 * i + 1] = buf[4 * i + 2];
            buf[4 * i + 2] = t;
        }
        if (pt__write_all(fd, buf, k * 4) != 0) return -1;
        done += k;
    }
    return 0;
}

/* A kq_soft_max [n_head, T, ...] cut to some heads and rows: `heads` (indices) and `rows`
 * (positions; row0 that of the step's first row) as ranges, `inner` floats per row. */
typedef struct pt__cut {
    const pt__range *heads, *rows;
    size_t nheads, nrows, row0, T, inner;
} pt__cut;

/* Create `path` new (O_EXCL: nothing already there, a link least of all, is opened) and write
 * the header then `nfloats` floats as little-endian (or raw bytes, `nfloats` = 0), or with
 * `cut` the heads and rows of `data` it keeps, in order. */
static int pt__write_new(const char *path, const char *hdr, size_t hlen, const float *data,
                         size_t nfloats, const pt__cut *cut) {
    int fd, rc = 0, e;
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0666);
    if (fd < 0) return -1;
    if (pt__write_all(fd, hdr, hlen) != 0) rc = -1;
    if (rc == 0 && cut) {
        size_t a, h, b;
        for (a = 0; rc == 0 && a < cut->nheads; a++)
            for (h = cut->heads[a].lo; rc == 0 && h <= cut->heads[a].hi; h++)
                for (b = 0; rc == 0 && b < cut->nrows; b++) /* a run of rows is contiguous */
                    rc = pt__write_floats(fd, data + (h * cut->T + (cut->rows[b].lo - cut->row0)) *
                                                         cut->inner,
                                          (cut->rows[b].hi - cut->rows[b].lo + 1) * cut->inner);
    } else if (rc == 0 && nfloats > 0) rc = pt__write_floats(fd, data, nfloats);
    e = errno;
    if (close(fd) != 0 && rc == 0) { rc = -1; e = errno; }
    errno = e;
    return rc;
}

static void pt__key(char *out, size_t size, size_t step, int layer, int tap) {
    if (layer >= 0) snprintf(out, size, "step %zu layer %d %s", step, layer, pt__taps[tap].name);
    else snprintf(out, size, "step %zu %s", step, pt__taps[tap].name);
}

static void pt__file(char *out, size_t size, size_t step, int layer, int tap) {
    if (layer >= 0) snprintf(out, size, "s%03zu/%s-%d.npy", step, pt__taps[tap].name, layer);
    else snprintf(out, size, "s%03zu/%s.npy", step, pt__taps[tap].name);
}

int pt_tap(pt_writer *w, int layer, const char *name, const size_t *shape, int ndim,
           const float *data) {
    const pt__stepinfo *st;
    size_t step, i, axis, wshape[PT_MAX_NDIM];
    uint64_t count = 1;
    int tap = -1, d, rc = -1;
    char key[96], shp[PT_MAX_NDIM * 22 + 4], rel[96], hdr[512], *path = NULL, *stepdir;
    size_t hlen;
    pt__range *heads = NULL, *rows = NULL;
    size_t nheads = 0, nrows = 0;
    pt__cut cut;
    if (!w) return -1;
    if (w->broken) return -1;
    if (!name) return pt__fail(w, "pt_tap: tap name is NULL");
    if (w->nsteps == 0) return pt__fail(w, "tap '%.64s' before the first pt_step() call", name);
    for (d = 0; d < PT__NTAPS; d++)
        if (!strcmp(name, pt__taps[d].name)) tap = d;
    if (tap < 0) return pt__fail(w, "unknown tap '%.64s' (docs/trace-format.md lists them)", name);
    if (pt__taps[tap].per_layer != (layer >= 0) && layer >= -1)
        return pt__fail(w, "tap '%s' %s a layer", name,
                        pt__taps[tap].per_layer ? "needs" : "cannot have");
    if (layer < -1 || (size_t)(layer < 0 ? 0 : layer) > PT__MAX_POSITION)
        return pt__fail(w, "tap '%s': layer %d is not a layer index (0 to %zu; -1 for a "
                           "graph-wide tap)", name, layer, PT__MAX_POSITION);
    step = w->nsteps - 1;
    st = &w->steps[step];
    if (!pt__wants_tap(w, step, tap, layer)) return 0; /* left out by the recording plan */
    pt__key(key, sizeof key, step, layer, tap);
    if (ndim < 1 || ndim > PT_MAX_NDIM)
        return pt__fail(w, "%s: %d axes (a tap has 1 to %d)", key, ndim, PT_MAX_NDIM);
    if (!shape || !data) return pt__fail(w, "%s: shape or data is NULL", key);
    pt__shape_str(shp, sizeof shp, shape, ndim);
    for (d = 0; d < ndim; d++) {
        if (shape[d] == 0)
            return pt__fail(w, "%s: shape %s has an empty axis (a tap holds at least one value)",
                            key, shp);
        if ((uint64_t)shape[d] > PT__MAX_ELEMENTS / count)
            return pt__fail(w, "%s: shape %s holds more than %llu values", key, shp,
                            (unsigned long long)PT__MAX_ELEMENTS);
        count *= (uint64_t)shape[d];
        wshape[d] = shape[d];
    }
    if (count > (uint64_t)((size_t)-1 / sizeof(float)))
        return pt__fail(w, "%s: shape %s does not fit in memory here", key, shp);
    axis = tap == PT__KQ_SOFT_MAX ? 1 : 0;
    if ((size_t)ndim <= axis || shape[axis] != st->n)
        return pt__fail(w, "%s: shape %s should have the step's %zu tokens on axis %zu (numpy "
                           "shape = ggml ne reversed)", key, shp, st->n, axis);
    for (i = w->nentries; i > 0 && w->entries[i - 1].step == step; i--)
        if (w->entries[i - 1].tap == tap && w->entries[i - 1].layer == layer)
            return pt__fail(w, "%s recorded twice", key);
    /* kq_soft_max [n_head, T, n_kv] under kq_heads / kq_rows: only the heads and rows kept
     * (every column); nothing at all when the step keeps none. */
    if (tap == PT__KQ_SOFT_MAX && (w->rec_nheads || w->rec_nrows)) {
        if (ndim != 3)
            return pt__fail(w, "%s: shape %s is not [n_head, T, n_kv], which the plan's "
                               "kq_heads/kq_rows cut", key, shp);
        if (pt__kept(w->rec_heads, w->rec_nheads, 0, shape[0], &heads, &nheads) ||
            pt__kept(w->rec_rows, w->rec_nrows, st->positions[0], st->n, &rows, &nrows)) {
            pt__fail(w, "%s", pt__oom);
            goto done;
        }
        if (nheads == 0 || nrows == 0) {
            rc = 0;
            goto done;
        }
        cut.heads = heads;
        cut.nheads = nheads;
        cut.rows = rows;
        cut.nrows = nrows;
        cut.row0 = st->positions[0];
        cut.T = st->n;
        cut.inner = shape[2];
        wshape[0] = wshape[1] = 0;
        for (i = 0; i < nheads; i++) wshape[0] += heads[i].hi - heads[i].lo + 1;
        for (i = 0; i < nrows; i++) wshape[1] += rows[i].hi - rows[i].lo + 1;
    }
    if (w->nentries == w->capentries) {
        size_t cap = w->capentries ? w->capentries * 2 : 64;
        pt__entry *q;
        if (cap > (size_t)-1 / sizeof *q || !(q = (pt__entry *)realloc(w->entries, cap * sizeof *q))) {
            pt__fail(w, "%s", pt__oom);
            goto done;
        }
        w->entries = q;
        w->capentries = cap;
    }
    /* The .npy header: version 1.0, padded with spaces to 64 bytes (magic + length + dict). */
    memcpy(hdr, "\x93NUMPY\x01\x00", 8);
    hlen = 10 + (size_t)snprintf(hdr + 10, sizeof hdr - 10,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': (");
    for (d = 0; d < ndim; d++)
        hlen += (size_t)snprintf(hdr + hlen, sizeof hdr - hlen, d ? ", %zu" : "%zu", wshape[d]);
    hlen += (size_t)snprintf(hdr + hlen, sizeof hdr - hlen, ndim == 1 ? ",), }" : "), }");
    while ((hlen + 1) % 64) hdr[hlen++] = ' ';
    hdr[hlen++] = '\n';
    hdr[8] = (char)((hlen - 10) & 0xff);
    hdr[9] = (char)((hlen - 10) >> 8);
    pt__file(rel, sizeof rel, step, layer, tap);
    if (!(path = pt__join(w->tmp, rel))) {
        pt__fail(w, "%s", pt__oom);
        goto done;
    }
    if (!(stepdir = pt__strdup(path))) {
        pt__fail(w, "%s", pt__oom);
        goto done;
    }
    *strrchr(stepdir, '/') = 0;
    if (mkdir(stepdir, 0777) != 0 && errno != EEXIST) {
        pt__fatal(w, "cannot create the step folder", stepdir, errno);
        free(stepdir);
        goto done;
    }
    free(stepdir);
    if (pt__write_new(path, hdr, hlen, data, (size_t)count, heads ? &cut : NULL) != 0) {
        int e = errno;
        char what[140];
        snprintf(what, sizeof what, "writing %s to", key);
        pt__fatal(w, what, path, e);
        goto done;
    }
    {
        pt__entry *en = &w->entries[w->nentries++];
        en->step = step;
        en->layer = layer;
        en->tap = tap;
        en->ndim = ndim;
        for (d = 0; d < ndim; d++) en->shape[d] = wshape[d];
        /* "heads" / "rows" whenever the plan has that part, even if it keeps them all. */
        en->heads = w->rec_nheads ? heads : NULL;
        en->nheads = w->rec_nheads ? nheads : 0;
        en->rows = w->rec_nrows ? rows : NULL;
        en->nrows = w->rec_nrows ? nrows : 0;
        if (en->heads) heads = NULL;
        if (en->rows) rows = NULL;
    }
    rc = 0;
done:
    free(path);
    free(heads);
    free(rows);
    return rc;
}

/* Graph order: step, then embd before every layer, layers in order, graph-wide taps last. */
static int pt__entry_cmp(const void *a, const void *b) {
    const pt__entry *x = (const pt__entry *)a, *y = (const pt__entry *)b;
    uint64_t gx = x->layer >= 0 ? (uint64_t)x->layer + 1 : x->tap <= 1 ? 0 : UINT64_MAX;
    uint64_t gy = y->layer >= 0 ? (uint64_t)y->layer + 1 : y->tap <= 1 ? 0 : UINT64_MAX;
    if (x->step != y->step) return x->step < y->step ? -1 : 1;
    if (gx != gy) return gx < gy ? -1 : 1;
    return x->tap < y->tap ? -1 : x->tap > y->tap;
}

/* Ranges as the JSON list of every number in them: [1, 3, 4]. */
static void pt__put_list(pt__buf *b, const pt__range *r, size_t n) {
    size_t i, v;
    int first = 1;
    pt__put(b, "[", 1);
    for (i = 0; i < n; i++)
        for (v = r[i].lo;; v++) {
            pt__putf(b, first ? "%zu" : ", %zu", v);
            first = 0;
            if (v == r[i].hi || b->oom) break;
        }
    pt__put(b, "]", 1);
}

static void pt__manifest(pt_writer *w, pt__buf *b) {
    size_t i, k;
    int d;
    pt__puts(b, "{\n \"format\": \"parity-trace\",\n \"version\": 1,\n \"model\": {\"path\": ");
    pt__json_str(b, w->model_path);
    pt__puts(b, ", \"sha256\": ");
    pt__json_str(b, w->sha256);
    if (w->have_size) pt__putf(b, ", \"size\": %llu", (unsigned long long)w->size);
    pt__puts(b, "},\n \"producer\": {\"name\": ");
    pt__json_str(b, w->engine);
    pt__puts(b, ", \"backend\": ");
    pt__json_str(b, w->backend);
    pt__puts(b, ", \"version\": ");
    pt__json_str(b, w->version);
    pt__puts(b, ", \"settings\": ");
    pt__puts(b, w->settings ? w->settings : "{}");
    pt__puts(b, "},\n");
    if (w->rec_line) {
        pt__puts(b, " \"record\": ");
        pt__json_str(b, w->rec_line);
        pt__puts(b, ",\n");
    }
    pt__puts(b, " \"steps\": [");
    for (i = 0; i < w->nsteps; i++) {
        pt__putf(b, "%s\n  {\"step\": %zu, \"tokens\": [", i ? "," : "", i);
        for (k = 0; k < w->steps[i].n; k++)
            pt__putf(b, k ? ", %lu" : "%lu", (unsigned long)w->steps[i].tokens[k]);
        pt__puts(b, "], \"positions\": [");
        for (k = 0; k < w->steps[i].n; k++)
            pt__putf(b, k ? ", %zu" : "%zu", w->steps[i].positions[k]);
        pt__puts(b, "]}");
    }
    pt__puts(b, "\n ],\n \"tensors\": [");
    qsort(w->entries, w->nentries, sizeof *w->entries, pt__entry_cmp);
    for (i = 0; i < w->nentries; i++) {
        const pt__entry *e = &w->entries[i];
        char rel[96];
        pt__file(rel, sizeof rel, e->step, e->layer, e->tap);
        pt__putf(b, "%s\n  {\"step\": %zu, \"tap\": \"%s\", ", i ? "," : "", e->step,
                 pt__taps[e->tap].name);
        if (e->layer >= 0) pt__putf(b, "\"layer\": %d, ", e->layer);
        else pt__puts(b, "\"layer\": null, ");
        pt__putf(b, "\"file\": \"%s\", \"shape\": [", rel);
        for (d = 0; d < e->ndim; d++) pt__putf(b, d ? ", %zu" : "%zu", e->shape[d]);
        pt__puts(b, "], \"dtype\": \"<f4\"");
        if (e->heads) {
            pt__puts(b, ", \"heads\": ");
            pt__put_list(b, e->heads, e->nheads);
        }
        if (e->rows) {
            pt__puts(b, ", \"rows\": ");
            pt__put_list(b, e->rows, e->nrows);
        }
        pt__puts(b, "}");
    }
    pt__puts(b, "\n ]\n}\n");
}

/* Move the finished trace in w->tmp to w->dir: a rename when DIR is absent or empty; over a
 * previous trace its manifest goes first (from then on DIR is no trace until the new one
 * lands), then its sNNN folders, then the new sNNN folders move in and the manifest last. */
static int pt__publish(pt_writer *w) {
    struct stat st;
    DIR *d;
    struct dirent *e;
    int empty = 1, rc = 0;
    if (pt__check_out_dir(w, w->dir) != 0) return -1; /* asked again: it may have changed */
    if (lstat(w->dir, &st) != 0) {
        if (rename(w->tmp, w->dir) != 0) return pt__fatal(w, "cannot move the trace to", w->dir, errno);
        return 0;
    }
    if (!(d = opendir(w->dir))) return pt__fatal(w, "cannot read", w->dir, errno);
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) empty = 0;
    closedir(d);
    if (empty) {
        if (rmdir(w->dir) != 0 || rename(w->tmp, w->dir) != 0)
            return pt__fatal(w, "cannot move the trace to", w->dir, errno);
        return 0;
    }
    {
        char *mp = pt__join(w->dir, "manifest.json");
        if (!mp) return pt__fatal(w, "publishing", w->dir, ENOMEM);
        if (unlink(mp) != 0 && errno != ENOENT) rc = pt__fatal(w, "cannot replace", mp, errno);
        free(mp);
        if (rc) return rc;
    }
    if (!(d = opendir(w->dir))) return pt__fatal(w, "cannot read", w->dir, errno);
    {
        char **old = NULL;
        size_t n = 0, i;
        while ((e = readdir(d)) != NULL) {
            char **q;
            if (!pt__is_step_name(e->d_name)) continue;
            q = (char **)realloc(old, (n + 1) * sizeof *old);
            if (q) old = q;
            if (!q || !(old[n] = pt__join(w->dir, e->d_name))) {
                rc = pt__fatal(w, "publishing", w->dir, ENOMEM);
                break;
            }
            n++;
        }
        closedir(d);
        for (i = 0; i < n; i++) {
            if (rc == 0 && pt__rm_rf(old[i], 0) != 0)
                rc = pt__fatal(w, "cannot remove the previous trace's", old[i], errno);
            free(old[i]);
        }
        free(old);
        if (rc) return -1;
    }
    if (!(d = opendir(w->tmp))) return pt__fatal(w, "cannot read", w->tmp, errno);
    {
        char **names = NULL;
        size_t n = 0, i;
        while ((e = readdir(d)) != NULL) {
            char **q;
            if (!pt__is_step_name(e->d_name)) continue;
            q = (char **)realloc(names, (n + 1) * sizeof *names);
            if (q) names = q;
            if (!q || !(names[n] = pt__strdup(e->d_name))) {
                rc = pt__fatal(w, "publishing", w->dir, ENOMEM);
                break;
            }
            n++;
        }
        closedir(d);
        for (i = 0; i <= n; i++) { /* i == n: the manifest, last */
            const char *nm = i < n ? names[i] : "manifest.json";
            char *from = pt__join(w->tmp, nm), *to = pt__join(w->dir, nm);
            if (rc == 0 && (!from || !to)) rc = pt__fatal(w, "publishing", w->dir, ENOMEM);
            if (rc == 0 && rename(from, to) != 0) rc = pt__fatal(w, "cannot move the trace to", to, errno);
            free(from);
            free(to);
        }
        for (i = 0; i < n; i++) free(names[i]);
        free(names);
        if (rc) return -1;
    }
    rmdir(w->tmp);
    return 0;
}

static void pt__free(pt_writer *w, int remove_tmp) {
    size_t i;
    if (!w) return;
    if (remove_tmp && w->tmp) pt__rm_rf(w->tmp, 0);
    for (i = 0; i < w->nsteps; i++) {
        free(w->steps[i].tokens);
        free(w->steps[i].positions);
    }
    free(w->steps);
    for (i = 0; i < w->nentries; i++) {
        free(w->entries[i].heads);
        free(w->entries[i].rows);
    }
    free(w->entries);
    free(w->dir);
    free(w->tmp);
    free(w->model_path);
    free(w->engine);
    free(w->backend);
    free(w->version);
    free(w->settings);
    free(w->rec_line);
    free(w->rec_full);
    free(w->rec_layers);
    free(w->rec_heads);
    free(w->rec_rows);
    free(w);
}

void pt_abort(pt_writer *w) { pt__free(w, 1); }

int pt_finish(pt_writer *w, char *err, size_t err_size) {
    pt__buf b = {NULL, 0, 0, 0};
    int rc = 0;
    if (!w) {
        if (err && err_size) snprintf(err, err_size, "%s", pt__oom);
        return -1;
    }
    if (w->broken) rc = -1;
    else if (w->nsteps == 0) rc = pt__fail(w, "pt_finish: no step was recorded (call pt_step first)");
    if (rc == 0) {
        pt__manifest(w, &b);
        if (b.oom) rc = pt__fail(w, "writing manifest.json: %s", pt__oom);
    }
    if (rc == 0) {
        char *mp = pt__join(w->tmp, "manifest.json");
        if (!mp) rc = pt__fail(w, "%s", pt__oom);
        else if (pt__write_new(mp, b.p, b.len, NULL, 0, NULL) != 0)
            rc = pt__fatal(w, "cannot write", mp, errno);
        free(mp);
    }
    free(b.p);
    if (rc == 0) rc = pt__publish(w);
    if (rc != 0 && err && err_size) snprintf(err, err_size, "%s", w->err);
    pt__free(w, rc != 0);
    return rc;
}

/* ---- golden ids ---- */

void pt_steps_free(pt_steps *s) {
    size_t i;
    if (!s) return;
    for (i = 0; i < s->n; i++) {
        free(s->steps[i].tokens);
        free(s->steps[i].positions);
    }
    free(s->steps);
    s->steps = NULL;
    s->n = 0;
}

/* [int, ...] into a growing array of `elem`-byte items (4: uint32, else size_t). The array
 * grows with the elements actually read: its size is bounded by the input's. */
static int pt__jints(pt__js *j, void **out, size_t *n, size_t elem, uint64_t max) {
    size_t cap = 0;
    char *a = NULL;
    *out = NULL;
    *n = 0;
    pt__jws(j);
    if (j->p >= j->end || *j->p != '[') return pt__jfail(j, "expected an array of ids");
    j->p++;
    pt__jws(j);
    if (j->p < j->end && *j->p == ']') { j->p++; return 0; }
    for (;;) {
        uint64_t v;
        pt__jws(j);
        if (pt__jnumber(j, &v, max)) { free(a); return -1; }
        if (*n == cap) {
            size_t nc = cap ? cap * 2 : 64;
            char *q;
            if (nc > (size_t)-1 / elem) { free(a); return pt__jfail(j, "array too long"); }
            q = (char *)realloc(a, nc * elem);
            if (!q) { free(a); return pt__jfail(j, "out of memory"); }
            a = q;
            cap = nc;
        }
        if (elem == 4) ((uint32_t *)(void *)a)[*n] = (uint32_t)v;
        else ((size_t *)(void *)a)[*n] = (size_t)v;
        (*n)++;
        pt__jws(j);
        if (j->p < j->end && *j->p == ',') { j->p++; continue; }
        if (j->p < j->end && *j->p == ']') { j->p++; break; }
        free(a);
        return pt__jfail(j, j->p >= j->end ? "unexpected end (truncated?)" : "expected ',' or ']'");
    }
    *out = a;
    return 0;
}

static int pt__jstep(pt__js *j, pt_steps *out, size_t index, size_t *next_pos) {
    pt_step_ids st;
    size_t nt = 0, np = 0, i;
    int have_t = 0, have_p = 0;
    void *tk = NULL, *ps = NULL;
    char m[160];
    st.tokens = NULL;
    st.positions = NULL;
    st.n = 0;
    pt__jws(j);
    if (j->p >= j->end || *j->p != '{') return pt__jfail(j, "a step is not an object");
    j->p++;
    pt__jws(j);
    if (j->p < j->end && *j->p == '}') j->p++;
    else
        for (;;) {
            const char *k;
            size_t kn;
            pt__jws(j);
            if (pt__jstring(j, &k, &kn)) goto fail;
            pt__jws(j);
            if (j->p >= j->end || *j->p != ':') { pt__jfail(j, "expected ':'"); goto fail; }
            j->p++;
            if (pt__jeq(k, kn, "tokens")) {
                if (have_t) { pt__jfail(j, "duplicate key 'tokens'"); goto fail; }
                have_t = 1;
                if (pt__jints(j, &tk, &nt, 4, UINT32_MAX)) goto fail;
            } else if (pt__jeq(k, kn, "positions")) {
                if (have_p) { pt__jfail(j, "duplicate key 'positions'"); goto fail; }
                have_p = 1;
                if (pt__jints(j, &ps, &np, sizeof(size_t), PT__MAX_POSITION)) goto fail;
            } else if (pt__jeq(k, kn, "step")) {
                uint64_t v;
                pt__jws(j);
                if (pt__jnumber(j, &v, (uint64_t)1 << 40)) goto fail;
                if (v != index) {
                    snprintf(m, sizeof m, "steps[%zu] is step %llu (steps are listed in order "
                                          "from 0)", index, (unsigned long long)v);
                    pt__jfail(j, m);
                    goto fail;
                }
            } else if (pt__jskip(j)) goto fail;
            pt__jws(j);
            if (j->p < j->end && *j->p == ',') { j->p++; continue; }
            if (j->p < j->end && *j->p == '}') { j->p++; break; }
            pt__jfail(j, j->p >= j->end ? "unexpected end (truncated?)" : "expected ',' or '}'");
            goto fail;
        }
    if (!have_t || !have_p || nt == 0 || nt != np) {
        snprintf(m, sizeof m, "step %zu has %zu tokens and %zu positions (need the same, at "
                              "least one)", index, nt, np);
        pt__jfail(j, m);
        goto fail;
    }
    for (i = 0; i < np; i++)
        if (((size_t *)ps)[i] != *next_pos + i) {
            snprintf(m, sizeof m, "step %zu has position %zu at index %zu, expected %zu "
                                  "(positions run on from 0)", index, ((size_t *)ps)[i], i,
                     *next_pos + i);
            pt__jfail(j, m);
            goto fail;
        }
    *next_pos += np;
    st.tokens = (uint32_t *)tk;
    st.positions = (size_t *)ps;
    st.n = nt;
    out->steps[out->n++] = st;
    return 0;
fail:
    free(tk);
    free(ps);
    return -1;
}

int pt_parse_ids(const char *json, size_t len, pt_steps *out) {
    pt__js j;
    int have_steps = 0, have_format = 0;
    size_t cap = 0, next_pos = 0;
    if (!out) return -1;
    memset(out, 0, sizeof *out);
    if (!json) {
        snprintf(out->error, sizeof out->error, "pt_parse_ids: no text");
        return -1;
    }
    j.start = j.p = json;
    j.end = json + len;
    j.err = out->error;
    j.errn = sizeof out->error;
    j.depth = 0;
    if (len > PT__MAX_MANIFEST) {
        snprintf(out->error, sizeof out->error, "manifest.json: larger than 64 MiB");
        return -1;
    }
    pt__jws(&j);
    if (j.p >= j.end) {
        snprintf(out->error, sizeof out->error, "manifest.json: empty");
        goto fail;
    }
    if (*j.p != '{') { pt__jfail(&j, "not a JSON object"); goto fail; }
    j.p++;
    pt__jws(&j);
    if (j.p < j.end && *j.p == '}') j.p++;
    else
        for (;;) {
            const char *k, *v;
            size_t kn, vn;
            pt__jws(&j);
            if (pt__jstring(&j, &k, &kn)) goto fail;
            pt__jws(&j);
            if (j.p >= j.end || *j.p != ':') { pt__jfail(&j, "expected ':'"); goto fail; }
            j.p++;
            pt__jws(&j);
            if (pt__jeq(k, kn, "steps")) {
                if (have_steps) { pt__jfail(&j, "duplicate key 'steps'"); goto fail; }
                have_steps = 1;
                if (j.p >= j.end || *j.p != '[') { pt__jfail(&j, "steps is not an array"); goto fail; }
                j.p++;
                pt__jws(&j);
                if (j.p < j.end && *j.p == ']') j.p++;
                else
                    for (;;) {
                        if (out->n == cap) {
                            size_t nc = cap ? cap * 2 : 16;
                            pt_step_ids *q;
                            if (nc > (size_t)-1 / sizeof *q) { pt__jfail(&j, "too many steps"); goto fail; }
                            q = (pt_step_ids *)realloc(out->steps, nc * sizeof *q);
                            if (!q) { pt__jfail(&j, "out of memory"); goto fail; }
                            out->steps = q;
                            cap = nc;
                        }
                        if (pt__jstep(&j, out, out->n, &next_pos)) goto fail;
                        pt__jws(&j);
                        if (j.p < j.end && *j.p == ',') { j.p++; continue; }
                        if (j.p < j.end && *j.p == ']') { j.p++; break; }
                        pt__jfail(&j, j.p >= j.end ? "unexpected end (truncated?)" : "expected ',' or ']'");
                        goto fail;
                    }
            } else if (pt__jeq(k, kn, "format")) {
                if (pt__jstring(&j, &v, &vn)) goto fail;
                if (!pt__jeq(v, vn, "parity-trace")) {
                    pt__jfail(&j, "format is not 'parity-trace'");
                    goto fail;
                }
                have_format = 1;
            } else if (pt__jeq(k, kn, "version")) {
                uint64_t ver;
                if (pt__jnumber(&j, &ver, UINT32_MAX)) goto fail;
                if (ver != 1) { pt__jfail(&j, "version is not 1 (this reader reads version 1)"); goto fail; }
            } else if (pt__jskip(&j)) goto fail;
            pt__jws(&j);
            if (j.p < j.end && *j.p == ',') { j.p++; continue; }
            if (j.p < j.end && *j.p == '}') { j.p++; break; }
            pt__jfail(&j, j.p >= j.end ? "unexpected end (truncated?)" : "expected ',' or '}'");
            goto fail;
        }
    pt__jws(&j);
    if (j.p != j.end) { pt__jfail(&j, "text after the manifest's object"); goto fail; }
    if (!have_format) {
        snprintf(out->error, sizeof out->error,
                 "manifest.json: no \"format\": \"parity-trace\" (not a parity trace)");
        goto fail;
    }
    if (!have_steps || out->n == 0) {
        snprintf(out->error, sizeof out->error, "manifest.json: no steps");
        goto fail;
    }
    return 0;
fail:
    pt_steps_free(out);
    if (!out->error[0]) snprintf(out->error, sizeof out->error, "manifest.json: malformed");
    return -1;
}

int pt_golden_ids(const char *golden_dir, pt_steps *out) {
    char *path, *text = NULL;
    size_t len = 0, cap = 0;
    int fd, rc;
    struct stat st;
    if (!out) return -1;
    memset(out, 0, sizeof *out);
    if (!golden_dir || !(path = pt__join(golden_dir, "manifest.json"))) {
        snprintf(out->error, sizeof out->error, "pt_golden_ids: no folder given");
        return -1;
    }
    /* Non-blocking: a FIFO named manifest.json is refused below, never waited on. */
    fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(out->error, sizeof out->error, "%.200s: %s", path,
                 fd < 0 ? strerror(errno) : "not a regular file");
        if (fd >= 0) close(fd);
        free(path);
        return -1;
    }
    for (;;) {
        ssize_t k;
        if (len == cap) {
            size_t nc = cap ? cap * 2 : 1 << 16;
            char *q;
            if (cap > PT__MAX_MANIFEST) {
                snprintf(out->error, sizeof out->error, "%.200s: larger than 64 MiB", path);
                break;
            }
            if (nc > PT__MAX_MANIFEST + 1) nc = PT__MAX_MANIFEST + 1; /* one byte past: too large */
            q = (char *)realloc(text, nc);
            if (!q) { snprintf(out->error, sizeof out->error, "%s", pt__oom); break; }
            text = q;
            cap = nc;
        }
        k = read(fd, text + len, cap - len);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            snprintf(out->error, sizeof out->error, "%.200s: %s", path, strerror(errno));
            break;
        }
        if (k == 0) break;
        len += (size_t)k;
    }
    close(fd);
    if (out->error[0]) {
        free(text);
        free(path);
        return -1;
    }
    rc = pt_parse_ids(text ? text : "", len, out);
    if (rc != 0 && !strncmp(out->error, "manifest.json", 13)) {
        char m[256];
        snprintf(m, sizeof m, "%.120s%s", path, out->error + 13);
        memcpy(out->error, m, sizeof m);
    }
    free(text);
    free(path);
    return rc;
}

#ifdef __cplusplus
}
#endif
#endif /* PARITY_TRACE_IMPLEMENTATION */
