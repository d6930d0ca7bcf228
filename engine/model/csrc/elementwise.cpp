// The model's elementwise ops on the CPU, one call each instead of a chain of torch ops: RMSNorm with the
// residual add before it, RoPE in place, and SiLU(gate) * up. At small batch a chain of small torch ops
// spends more on per-op overhead than on arithmetic, and the norms and RoPE run in every layer.
//
// Each output row depends only on its own input row, computed in fp32 and rounded to the model dtype once;
// the norm's sum of squares is 16 fixed lanes summed in a fixed tree. So every row is the same whatever
// else the batch holds (batch invariance), and whichever thread computes it.
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace headroom;

template <typename T>
void rms_norm(const T* x, const T* residual, T* sum_out, const T* weight, T* out, int64_t rows, int dim, float eps,
              int threads) {
#pragma omp parallel num_threads(threads) if (rows >= 8)
    {
        std::vector<float> row(dim);  // one buffer a thread, not one a row
#pragma omp for
        for (int64_t t = 0; t < rows; ++t) {
            for (int d = 0; d < dim; ++d) {
                float v = to_f32(x[t * dim + d]);
                if (residual) {  // the sum is rounded to the dtype before the norm reads it, as torch adds
                    store(sum_out + t * dim + d, v + to_f32(residual[t * dim + d]));
                    v = to_f32(sum_out[t * dim + d]);
                }
                row[d] = v;
            }
            f32x16 lanes = {};
            const int whole = dim - dim % LANES;
            for (int d = 0; d < whole; d += LANES) {
                const f32x16 v = load16(&row[d]);
                lanes += v * v;
            }
            float squares = sum16(lanes);
            for (int d = whole; d < dim; ++d) squares += row[d] * row[d];
            const float inv = 1.0f / std::sqrt(squares / dim + eps);
            for (int d = 0; d < whole; d += LANES) {
                T normed[LANES];  // rounded to the dtype before the weight, as HF's LlamaRMSNorm does
                store16(normed, load16(&row[d]) * inv);
                store16(out + t * dim + d, load16(weight + d) * load16(normed));
            }
            for (int d = whole; d < dim; ++d) {
                T normed;
                store(&normed, row[d] * inv);
                store(out + t * dim + d, to_f32(weight[d]) * to_f32(normed));
            }
        }
    }
}

template <typename T>
void rope(T* x, int64_t row_stride, int64_t rows, int heads, int head_dim, const T* cos, const T* sin,
          const int64_t* positions, int threads) {
    const int half = head_dim / 2;
#pragma omp parallel num_threads(threads) if (rows >= 8)
    {
        std::vector<float> v(head_dim);  // one buffer a thread, not one a row
#pragma omp for
        for (int64_t t = 0; t < rows; ++t) {
            const T* c = cos + positions[t] * head_dim;
            const T* s = sin + positions[t] * head_dim;
            for (int h = 0; h < heads; ++h) {
                T* p = x + t * row_stride + int64_t(h) * head_dim;
                for (int d = 0; d < head_dim; ++d) v[d] = to_f32(p[d]);
                for (int d = 0; d < head_dim; ++d) {  // x * cos + rotate_half(x) * sin
                    const float rotated = d < half ? -v[d + half] : v[d - half];
                    store(p + d, v[d] * to_f32(c[d]) + rotated * to_f32(s[d]));
                }
            }
        }
    }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int width, int threads) {
    const int whole = width - width % LANES;
#pragma omp parallel for num_threads(threads) if (rows >= 8)
    for (int64_t t = 0; t < rows; ++t) {
        const T* g = gate_up + t * 2 * width;
        const T* u = g + width;
        T* o = out + t * width;
        for (int d = 0; d < whole; d += LANES) {
            const f32x16 x = load16(g + d);
            store16(o + d, x / (1.0f + exp_approx(-x)) * load16(u + d));
        }
        for (int d = whole; d < width; ++d) {
            const float x = to_f32(g[d]);
            store(o + d, x / (1.0f + exp_approx(-x)) * to_f32(u[d]));
        }
    }
}

}  // namespace

extern "C" {

// x, residual, sum_out, out: [rows, dim] contiguous; residual and sum_out may be null (no residual add),
// else sum_out = x + residual and the norm is of sum_out. bf16: 2-byte elements, else fp32.
void headroom_rms_norm(int bf16, const void* x, const void* residual, void* sum_out, const void* weight, void* out,
                       int64_t rows, int dim, float eps, int threads) {
    with_element_type(bf16, [&](auto zero) {
        using T = decltype(zero);
        rms_norm(static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<T*>(sum_out),
                 static_cast<const T*>(weight), static_cast<T*>(out), rows, dim, eps, threads);
    });
}

// Rotates x [rows, heads, head_dim] (row stride row_stride, heads contiguous) in place, HF's rotate_half
// convention; cos, sin: [positions, head_dim] tables.
void headroom_rope(int bf16, void* x, int64_t row_stride, int64_t rows, int heads, int head_dim, const void* cos,
                   const void* sin, const int64_t* positions, int threads) {
    with_element_type(bf16, [&](auto zero) {
        using T = decltype(zero);
        rope(static_cast<T*>(x), row_stride, rows, heads, head_dim, static_cast<const T*>(cos),
             static_cast<const T*>(sin), positions, threads);
    });
}

// out [rows, width] = silu(gate) * up, gate_up [rows, 2 * width] contiguous (gate first).
void headroom_silu_mul(int bf16, const void* gate_up, void* out, int64_t rows, int width, int threads) {
    with_element_type(bf16, [&](auto zero) {
        using T = decltype(zero);
        silu_mul(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, width, threads);
    });
}

}  // extern "C"
