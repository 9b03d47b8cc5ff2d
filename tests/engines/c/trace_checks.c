/* trace_checks.c - exercises bindings/c/parity_trace.h for tests/kit_c.rs.
 *
 *   trace_checks checks DIR      every refusal of pt_create/pt_step/pt_tap/pt_set_producer,
 *                                one line each ("refused: MSG" / "ok: WHAT"), then a small
 *                                valid trace in DIR
 *   trace_checks write DIR       a small valid trace (2 steps) in DIR, or "error: MSG"
 *   trace_checks sha FILE...     "HEX SIZE" per file (pt_sha256_file)
 *   trace_checks ids DIR         the golden ids of DIR/manifest.json, one step a line
 *                                ("t1,t2;p1,p2"), or "error: MSG" and exit 1
 *   trace_checks fuzz FILE       pt_parse_ids on every prefix of FILE and on FILE with each
 *                                byte replaced by JSON-significant ones: each parse ends
 *                                (success or a message); prefixes must all be refused
 */
#define PARITY_TRACE_IMPLEMENTATION
#include "parity_trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_refused = 0;

static void report(pt_writer *w, int rc, const char *what) {
    if (rc == 0) printf("ok: %s\n", what);
    else {
        printf("refused: %s\n", pt_error(w) ? pt_error(w) : "(no message)");
        n_refused++;
    }
    fflush(stdout);
}

static int write_small(const char *dir, const char *engine) {
    static const float x[8] = {1.0f, -2.0f, 3.5f, 0.25f, 5.0f, 6.0f, -7.0f, 8.0f};
    static const float p[4] = {1.0f, 0.0f, 0.5f, 0.5f};
    const uint32_t t0[2] = {1, 2}, t1[1] = {3};
    const size_t p0[2] = {0, 1}, p1[1] = {2};
    size_t sh[2] = {2, 4}, sh1[2] = {1, 4}, kq[3] = {1, 2, 2};
    char err[512];
    pt_writer *w = pt_create(dir, NULL, "", engine, "cpu");
    if (!w || pt_error(w)) {
        printf("error: %s\n", pt_error(w));
        pt_abort(w);
        return 1;
    }
    if (pt_step(w, t0, p0, 2) || pt_tap(w, -1, "embd", sh, 2, x) ||
        pt_tap(w, 0, "l_out", sh, 2, x) || pt_tap(w, 0, "kq_soft_max", kq, 3, p) ||
        pt_step(w, t1, p1, 1) || pt_tap(w, 0, "l_out", sh1, 2, x + 4) ||
        pt_tap(w, -1, "embd", sh1, 2, x)) {
        printf("error: %s\n", pt_error(w));
        pt_abort(w);
        return 1;
    }
    if (pt_finish(w, err, sizeof err) != 0) {
        printf("error: %s\n", err);
        return 1;
    }
    printf("wrote %s\n", dir);
    return 0;
}

static int checks(const char *dir) {
    static const float x[16] = {0};
    const uint32_t ids[2] = {1, 2}, id2[1] = {3};
    const size_t pos[2] = {0, 1}, bad_pos[2] = {1, 2}, pos_far[1] = {5}, pos2[1] = {2};
    size_t s24[2] = {2, 4}, s34[2] = {3, 4}, s20[2] = {2, 0}, huge[2] = {2, (size_t)-1 / 2},
           kq_bad[3] = {1, 3, 2}, kq[3] = {1, 2, 2}, s9[9] = {2, 1, 1, 1, 1, 1, 1, 1, 1},
           s14[2] = {1, 4};
    char err[512];
    pt_writer *w;

    /* pt_create refusals */
    w = pt_create(dir, NULL, "xyz", "e", "cpu");
    report(w, pt_error(w) ? -1 : 0, "create with a bad sha256");
    pt_abort(w);
    w = pt_create(dir, "/nonexistent/model.gguf", NULL, "e", "cpu");
    report(w, pt_error(w) ? -1 : 0, "create with a missing model");
    pt_abort(w);
    w = pt_create("/", NULL, NULL, "e", "cpu");
    report(w, pt_error(w) ? -1 : 0, "create at /");
    pt_abort(w);

    /* Producer strings that need escaping: a quote, a backslash, a newline, invalid UTF-8. */
    w = pt_create(dir, NULL, NULL, "eng\"ine\\\n\xff\xc3\xa9", "cpu\t1");
    report(w, pt_error(w) ? -1 : 0, "create");
    report(w, pt_tap(w, 0, "l_out", s24, 2, x), "tap before a step");
    report(w, pt_step(w, ids, pos, 0), "step of 0 tokens");
    report(w, pt_step(w, ids, bad_pos, 2), "step at positions 1, 2");
    report(w, pt_step(w, ids, pos, 2), "step 0");
    report(w, pt_tap(w, 0, "qq", s24, 2, x), "unknown tap");
    report(w, pt_tap(w, 0, "embd", s24, 2, x), "embd with a layer");
    report(w, pt_tap(w, -1, "q", s24, 2, x), "q without a layer");
    report(w, pt_tap(w, -2, "q", s24, 2, x), "layer -2");
    report(w, pt_tap(w, 0, "l_out", s24, 0, x), "0 axes");
    report(w, pt_tap(w, 0, "l_out", s9, 9, x), "9 axes");
    report(w, pt_tap(w, 0, "l_out", s20, 2, x), "an empty axis");
    report(w, pt_tap(w, 0, "l_out", huge, 2, x), "a huge shape");
    report(w, pt_tap(w, 0, "l_out", s34, 2, x), "3 rows in a 2-token step");
    report(w, pt_tap(w, 0, "kq_soft_max", kq_bad, 3, x), "kq_soft_max with 3 rows");
    report(w, pt_tap(w, 0, "l_out", s24, 2, NULL), "NULL data");
    report(w, pt_tap(w, 0, "l_out", s24, 2, x), "l_out");
    report(w, pt_tap(w, 0, "l_out", s24, 2, x), "l_out again");
    report(w, pt_tap(w, -1, "embd", s24, 2, x), "embd");
    report(w, pt_tap(w, 0, "kq_soft_max", kq, 3, x), "kq_soft_max");
    report(w, pt_set_producer(w, "1", "{\"a\": }"), "settings {\"a\": }");
    report(w, pt_set_producer(w, "1", "[1]"), "settings [1]");
    report(w, pt_set_producer(w, "1", "{} {}"), "settings {} {}");
    report(w, pt_set_producer(w, "1.0", "{\"k\": [1, {\"x\": \"\\\"}\"}], \"n\": -1.5e3}"),
           "settings");
    report(w, pt_step(w, id2, pos_far, 1), "step at position 5");
    report(w, pt_step(w, id2, pos2, 1), "step 1");
    report(w, pt_tap(w, 0, "l_out", s14, 2, x), "l_out of step 1");
    report(w, pt_tap(w, 0, "l_out", s14, 2, x), "l_out of step 1 again");
    if (pt_finish(w, err, sizeof err) != 0) {
        printf("error: %s\n", err);
        return 1;
    }
    printf("finished: %d refused\n", n_refused);
    return 0;
}

static int ids(const char *dir) {
    pt_steps g;
    size_t s, i;
    if (pt_golden_ids(dir, &g) != 0) {
        printf("error: %s\n", g.error);
        pt_steps_free(&g);
        return 1;
    }
    for (s = 0; s < g.n; s++) {
        for (i = 0; i < g.steps[s].n; i++) printf(i ? ",%lu" : "%lu", (unsigned long)g.steps[s].tokens[i]);
        printf(";");
        for (i = 0; i < g.steps[s].n; i++) printf(i ? ",%zu" : "%zu", g.steps[s].positions[i]);
        printf("\n");
    }
    pt_steps_free(&g);
    return 0;
}

static int fuzz(const char *path) {
    static const char subst[] = "{}[]\",:\\0-9e. \x01\xff";
    FILE *f = fopen(path, "rb");
    char *text, *copy;
    long n;
    size_t i, k, ok = 0, refused = 0, prefixes_accepted = 0, end;
    pt_steps g;
    if (!f || fseek(f, 0, SEEK_END) || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET)) return 2;
    text = (char *)malloc((size_t)n + 1);
    copy = (char *)malloc((size_t)n + 1);
    if (!text || !copy || fread(text, 1, (size_t)n, f) != (size_t)n) return 2;
    fclose(f);
    if (pt_parse_ids(text, (size_t)n, &g) != 0) {
        printf("error: the whole file: %s\n", g.error);
        return 1;
    }
    pt_steps_free(&g);
    for (end = (size_t)n; end > 0 && text[end - 1] && strchr(" \n\r\t", text[end - 1]); end--) {
    }
    /* Every prefix that cuts the object: a truncated manifest is refused, with a message. The prefix is
     * copied into a buffer of its own size so that reading past it is caught (ASan). */
    for (i = 0; i < end; i++) {
        char *p = (char *)malloc(i ? i : 1);
        memcpy(p, text, i);
        if (pt_parse_ids(p, i, &g) == 0) prefixes_accepted++;
        else if (!g.error[0]) {
            printf("error: prefix %zu refused without a message\n", i);
            return 1;
        }
        pt_steps_free(&g);
        free(p);
    }
    for (i = 0; i < (size_t)n; i++)
        for (k = 0; k < sizeof subst - 1; k++) {
            memcpy(copy, text, (size_t)n);
            copy[i] = subst[k];
            if (pt_parse_ids(copy, (size_t)n, &g) == 0) ok++;
            else if (!g.error[0]) {
                printf("error: mutation at %zu refused without a message\n", i);
                return 1;
            } else refused++;
            pt_steps_free(&g);
        }
    printf("prefixes: %zu, accepted %zu\nmutations: %zu accepted, %zu refused\n", end,
           prefixes_accepted, ok, refused);
    free(text);
    free(copy);
    return prefixes_accepted == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    int i, rc = 0;
    if (argc >= 3 && !strcmp(argv[1], "checks")) return checks(argv[2]);
    if (argc >= 3 && !strcmp(argv[1], "write")) return write_small(argv[2], "c-test");
    if (argc >= 3 && !strcmp(argv[1], "ids")) return ids(argv[2]);
    if (argc >= 3 && !strcmp(argv[1], "fuzz")) return fuzz(argv[2]);
    if (argc >= 3 && !strcmp(argv[1], "sha")) {
        for (i = 2; i < argc; i++) {
            char hex[65];
            uint64_t size;
            if (pt_sha256_file(argv[i], hex, &size) != 0) {
                printf("error: %s\n", argv[i]);
                rc = 1;
            } else printf("%s %llu\n", hex, (unsigned long long)size);
        }
        return rc;
    }
    fprintf(stderr, "usage: trace_checks checks|write|ids|fuzz|sha ARGS\n");
    return 2;
}
