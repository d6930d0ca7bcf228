// The model's fp32 linears, y = x W^T, on FMA: the path of CPUs without bf16 dot products (AVX2-only), where
// `--dtype auto` runs fp32 and a float checkpoint's linears would otherwise run on MKL.
//
// Why our own: MKL's sgemm picks its kernel by the number of rows, so a row can round differently alone than
// in a batch (bench/results/batch_invariance.md). Here W is packed in blocks of 16 outputs, [N/16][K][16]
// (engine/model/cpu_kernels.py `pack_linear`), and output n's fp32 accumulator adds x[i] * W[n][i] with one
// FMA for i = 0, 1, ..., K-1 in order: the rows a tile holds and the thread that runs it change nothing, so a
// row's output is bitwise the same alone or batched. 256-bit vectors, so the same code runs on AVX2 and
// AVX-512 CPUs.
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int BLOCK = 16;  // outputs per packed block: two 8-float vectors
constexpr int ROWS = 4;    // 8 accumulators + 2 weight vectors + 1 broadcast of AVX2's 16 registers

template <int R>
void tile(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
        const __m256 w0 = _mm256_loadu_ps(w + i * BLOCK), w1 = _mm256_loadu_ps(w + i * BLOCK + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(y + r * ldy, acc[r][0]);
        _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    }
}

void column(int64_t m, const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy) {
    int64_t r = 0;
    for (; r + ROWS <= m; r += ROWS) tile<ROWS>(x + r * ldx, ldx, w, k, y + r * ldy, ldy);
    switch (m - r) {
        case 1: return tile<1>(x + r * ldx, ldx, w, k, y + r * ldy, ldy);
        case 2: return tile<2>(x + r * ldx, ldx, w, k, y + r * ldy, ldy);
        case 3: return tile<3>(x + r * ldx, ldx, w, k, y + r * ldy, ldy);
    }
}

}  // namespace

extern "C" {

int headroom_linear_f32_available() { return 1; }

// x: [m, k] fp32 with row stride ldx; w: packed [n/16][k][16]; y: [m, n] fp32, contiguous.
void headroom_linear_f32(const float* x, int64_t ldx, const float* w, float* y, int64_t m, int64_t n, int64_t k,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n / BLOCK; ++b) column(m, x, ldx, w + b * k * BLOCK, k, y + b * BLOCK, n);
}

}  // extern "C"

#else  // no AVX2 with FMA: the fp32 linears stay on torch

extern "C" {
int headroom_linear_f32_available() { return 0; }
void headroom_linear_f32(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t, int) {}
}

#endif
