// parity_trace.h as a C++11 translation unit, implementation included: tests/kit_c.rs builds
// it with `c++ -std=c++11 -Wall -Wextra -Werror -pedantic` and runs it (c++_check OUT_DIR).
#define PARITY_TRACE_IMPLEMENTATION
#include "parity_trace.h"

#include <cstdio>
#include <vector>

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: cxx_check OUT_DIR\n");
        return 2;
    }
    std::vector<float> x(8);
    for (size_t i = 0; i < x.size(); i++) x[i] = 0.5f * static_cast<float>(i);
    const uint32_t ids[2] = {1, 2};
    const size_t pos[2] = {0, 1};
    const size_t shape[2] = {2, 4};
    char err[256];
    pt_writer *w = pt_create(argv[1], nullptr, "", "cxx", "cpu");
    if (!w || pt_error(w)) {
        std::fprintf(stderr, "%s\n", pt_error(w));
        pt_abort(w);
        return 1;
    }
    if (pt_set_producer(w, "1", "{\"std\": \"c++11\"}") != 0 || pt_step(w, ids, pos, 2) != 0 ||
        pt_tap(w, -1, "embd", shape, 2, x.data()) != 0) {
        std::fprintf(stderr, "%s\n", pt_error(w));
        pt_abort(w);
        return 1;
    }
    if (pt_tap(w, 0, "embd", shape, 2, x.data()) == 0) return 1;  // refused: a layer on embd
    std::printf("refused: %s\n", pt_error(w));
    if (pt_finish(w, err, sizeof err) != 0) {
        std::fprintf(stderr, "%s\n", err);
        return 1;
    }
    std::printf("wrote %s\n", argv[1]);
    return 0;
}
