// The model's elementwise ops on the CPU, one call each instead of a chain of torch ops: RMSNorm with the
// residual add before it, RoPE in place, and SiLU(gate) * up or GELU(gate) * up; and for the one-call layers
// (forward.cpp) what DecoderLayer.forward does in torch beside them: the q/k/v bias add and the norms over
// each head of q and k. At small batch a chain of small torch ops spends more on per-op overhead than on
// arithmetic, and the norms and RoPE run in every layer.
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

// One row's RMSNorm, from the row in fp32: the squares in 16 fixed lanes summed in a fixed tree, then the
// tail. out may be where the row was read from.
template <typename T>
void norm_row(const float* row, int dim, const T* weight, float eps, T* out) {
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
        store16(out + d, load16(weight + d) * load16(normed));
    }
    for (int d = whole; d < dim; ++d) {
        T normed;
        store(&normed, row[d] * inv);
        store(out + d, to_f32(weight[d]) * to_f32(normed));
    }
}

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
            norm_row(row.data(), dim, weight, eps, out + t * dim);
        }
    }
}

// Each head of q (the first q_heads of a row) normalized with q_weight and each of k (the next kv_heads) with
// k_weight, in place: Qwen3's and Gemma 3's norms before RoPE, on the rows of the fused projection.
template <typename T>
void head_norms(T* x, int64_t row_stride, int64_t rows, int q_heads, int kv_heads, int head_dim, const T* q_weight,
                const T* k_weight, float eps, int threads) {
    const int heads = q_heads + kv_heads;
#pragma omp parallel num_threads(threads) if (rows >= 8)
    {
        std::vector<float> row(head_dim);  // one buffer a thread, not one a head
#pragma omp for
        for (int64_t i = 0; i < rows * heads; ++i) {
            const int h = int(i % heads);
            T* p = x + (i / heads) * row_stride + int64_t(h) * head_dim;
            for (int d = 0; d < head_dim; ++d) row[d] = to_f32(p[d]);
            norm_row(row.data(), head_dim, h < q_heads ? q_weight : k_weight, eps, p);
        }
    }
}

// x [rows, width] += bias, each sum in fp32 rounded to the dtype once, as torch adds.
template <typename T>
void add_bias(T* x, int64_t rows, int width, const T* bias, int threads) {
    const int whole = width - width % LANES;
#pragma omp parallel for num_threads(threads) if (rows >= 8)
    for (int64_t t = 0; t < rows; ++t) {
        T* p = x + t * width;
        for (int d = 0; d < whole; d += LANES) store16(p + d, load16(p + d) + load16(bias + d));
        for (int d = whole; d < width; ++d) store(p + d, to_f32(p[d]) + to_f32(bias[d]));
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

// The activations as types, not function pointers, so each one is inlined into its loop (OpenMP outlines the
// loop's body, and a pointer passed into it would stay an indirect call).
struct Silu {
    f32x16 operator()(f32x16 x) const { return x / (1.0f + exp_approx(-x)); }
};

// HF's gelu_pytorch_tanh, 0.5 x (1 + tanh(u)), written as x / (1 + exp(-2u)), the same function: it has no
// 1 + tanh(u) to cancel where tanh(u) is near -1.
struct GeluTanh {
    f32x16 operator()(f32x16 x) const {
        const f32x16 u = 0.7978845608028654f * (x + 0.044715f * x * x * x);  // sqrt(2 / pi) (x + 0.044715 x^3)
        return x / (1.0f + exp_approx(-2.0f * u));
    }
};

// out [rows, width] = act(gate) * up, gate_up [rows, 2 * width] contiguous (gate first); a tail element through
// lane 0, so it gets the bits a vector lane would.
template <typename T, typename Act>
void gated_mul(const T* gate_up, T* out, int64_t rows, int width, Act act, int threads) {
    const int whole = width - width % LANES;
#pragma omp parallel for num_threads(threads) if (rows >= 8)
    for (int64_t t = 0; t < rows; ++t) {
        const T* g = gate_up + t * 2 * width;
        const T* u = g + width;
        T* o = out + t * width;
        for (int d = 0; d < whole; d += LANES) store16(o + d, act(load16(g + d)) * load16(u + d));
        for (int d = whole; d < width; ++d) store(o + d, act(splat(to_f32(g[d])))[0] * to_f32(u[d]));
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
        gated_mul(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, width, Silu{}, threads);
    });
}

// out [rows, width] = gelu_tanh(gate) * up, laid out as headroom_silu_mul's.
void headroom_gelu_tanh_mul(int bf16, const void* gate_up, void* out, int64_t rows, int width, int threads) {
    with_element_type(bf16, [&](auto zero) {
        using T = decltype(zero);
        gated_mul(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, width, GeluTanh{}, threads);
    });
}

// Normalizes in place each head of q and of k in x [rows, q_heads + kv_heads, head_dim] (row stride row_stride,
// heads contiguous), q's with q_weight and k's with k_weight [head_dim].
void headroom_head_norms(int bf16, void* x, int64_t row_stride, int64_t rows, int q_heads, int kv_heads,
                         int head_dim, const void* q_weight, const void* k_weight, float eps, int threads) {
    with_element_type(bf16, [&](auto zero) {
        using T = decltype(zero);
        head_norms(static_cast<T*>(x), row_stride, rows, q_heads, kv_heads, head_dim, static_cast<const T*>(q_weight),
                   static_cast<const T*>(k_weight), eps, threads);
    });
}

// x [rows, width] contiguous += bias [width].
void headroom_add_bias(int bf16, void* x, int64_t rows, int width, const void* bias, int threads) {
    with_element_type(bf16, [&](auto zero) {
        using T = decltype(zero);
        add_bias(static_cast<T*>(x), rows, width, static_cast<const T*>(bias), threads);
    });
}

}  // extern "C"
