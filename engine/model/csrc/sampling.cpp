// Inverse-CDF sampling of whole rows (no top-k, no top-p), the sampler's commonest random path: one pass
// of vectorized exponentials instead of torch's softmax, cumsum over the vocabulary and searchsorted. The
// temperature is applied here too (and 0 means the argmax), so a one-stream step samples in one call.
//
// Per row: x / t rounds as torch's division does, and its largest is the largest x over t (division is
// monotonic); the probabilities are exp(x / t - max) (fp32); the CDF is summed 16 tokens at a time (sum16 of
// each group, the groups in order), the group holding the target u * total is found, and the token
// within it by a running sum. A row's draw depends on that row and its uniform alone.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace headroom;

// SCALED: t is not 1 (x / 1 is x, and a division per logit is not free).
template <bool SCALED>
int64_t draw_scaled(const float* x, int64_t vocab, float t, float u, std::vector<float>& groups) {
    const auto over_t = [t](auto v) {
        if constexpr (SCALED) return v / t;
        else return v;
    };
    const float top = over_t(max_of(x, vocab));
    const int64_t whole = vocab - vocab % LANES;
    groups.assign(size_t((vocab + LANES - 1) / LANES), 0.0f);
    for (int64_t j = 0; j < whole; j += LANES) groups[j / LANES] = sum16(exp_approx(over_t(load16(x + j)) - top));
    for (int64_t j = whole; j < vocab; ++j) groups.back() += exp_approx(over_t(x[j]) - top);
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
                const float p = exp_approx(over_t(x[j]) - top);
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

int64_t draw_row(const float* x, int64_t vocab, float t, float u, std::vector<float>& groups) {
    if (t == 0.0f) return std::max_element(x, x + vocab) - x;  // the first largest, as torch's argmax
    return t == 1.0f ? draw_scaled<false>(x, vocab, t, u, groups) : draw_scaled<true>(x, vocab, t, u, groups);
}

}  // namespace

extern "C" {

// x: [rows, vocab] fp32 logits; t: each row's temperature (0: greedy); u: one uniform in [0, 1) per row.
void headroom_sample_plain(const float* x, int64_t rows, int64_t vocab, const float* t, const float* u, int64_t* out,
                           int threads) {
#pragma omp parallel num_threads(threads) if (rows >= 2)
    {
        std::vector<float> groups;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) out[r] = draw_row(x + r * vocab, vocab, t[r], u[r], groups);
    }
}

}  // extern "C"
