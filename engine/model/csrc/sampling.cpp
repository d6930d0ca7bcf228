// Inverse-CDF sampling of whole rows (no top-k, no top-p), the sampler's commonest random path: one pass
// of vectorized exponentials instead of torch's softmax, cumsum over the vocabulary and searchsorted.
//
// Per row: the probabilities are exp(x - max) (fp32); the CDF is summed 16 tokens at a time (sum16 of
// each group, the groups in order), the group holding the target u * total is found, and the token
// within it by a running sum. A row's draw depends on that row and its uniform alone.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace headroom;

int64_t draw_row(const float* x, int64_t vocab, float u, std::vector<float>& groups) {
    const float top = max_of(x, vocab);
    const int64_t whole = vocab - vocab % LANES;
    groups.assign(size_t((vocab + LANES - 1) / LANES), 0.0f);
    for (int64_t j = 0; j < whole; j += LANES) groups[j / LANES] = sum16(exp_approx(load16(x + j) - top));
    for (int64_t j = whole; j < vocab; ++j) groups.back() += exp_approx(x[j] - top);
    float total = 0.0f;
    for (float g : groups) total += g;
    // kept strictly below the total, so the group found always has mass
    const float target = std::min(u * total, std::nextafter(total, 0.0f));
    float before = 0.0f;
    for (size_t g = 0; g < groups.size(); ++g) {
        if (before + groups[g] > target) {
            float running = before;
            int64_t last = -1;
            for (int64_t j = int64_t(g) * LANES; j < std::min<int64_t>(vocab, int64_t(g + 1) * LANES); ++j) {
                const float p = exp_approx(x[j] - top);
                if (p <= 0.0f) continue;
                running += p;
                last = j;
                if (running > target) return j;
            }
            return last;  // the running sum rounded below the group's: its last token with mass
        }
        before += groups[g];
    }
    return std::max_element(x, x + vocab) - x;  // not reached: the last group with mass ends at the total
}

}  // namespace

extern "C" {

// x: [rows, vocab] fp32 logits, already divided by the temperature; u: one uniform in [0, 1) per row.
void headroom_sample_plain(const float* x, int64_t rows, int64_t vocab, const float* u, int64_t* out, int threads) {
#pragma omp parallel num_threads(threads) if (rows >= 2)
    {
        std::vector<float> groups;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) out[r] = draw_row(x + r * vocab, vocab, u[r], groups);
    }
}

}  // extern "C"
