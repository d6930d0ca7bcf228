// The model's linears in bf16, y = x W^T, on AVX512-BF16's dot-product instruction (vdpbf16ps).
//
// Why our own: at the batch sizes of decoding a linear is a stream of its weights, which oneDNN reads
// well below the CPU's memory rate (bench/results/cpu_kernels.md); and its kernels promise nothing about
// summation order, so a row could round differently with the batch's size.
//
// Summation order: W is packed in blocks of 16 outputs, [N/16][K/2][16][2] (engine/model/cpu_kernels.py
// `pack_linear`), so one 512-bit load holds the next pair of inputs' weights for 16 outputs. Output n's
// fp32 accumulator adds the K/2 pairs x[2p]*W[n][2p] + x[2p+1]*W[n][2p+1] in order p = 0, 1, ...; it is
// rounded to bf16 once. Which rows share a tile, how many rows the batch has and which thread runs a tile
// change none of that: a row's output is bitwise the same alone or batched (batch invariance by
// construction).
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int BLOCK = 16;  // outputs in one packed block: one zmm of fp32 accumulators

// R rows of x times C blocks of W: R*C accumulators, C weight vectors and one broadcast in registers.
template <int R, int C>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, uint16_t* y, int64_t ldy) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh wv[C];
        for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + (c * pairs + p) * 2 * BLOCK);
        for (int r = 0; r < R; ++r) {
            int32_t two;
            std::memcpy(&two, x + r * ldx + 2 * p, sizeof two);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            _mm256_storeu_si256((__m256i*)(y + r * ldy + c * BLOCK), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

// 8 rows x 3 blocks (48 outputs): 24 accumulators + 3 weights + 1 broadcast of the 32 registers. Of the
// tilings that fit the registers (4 x 6, 6 x 4 too), the fastest at decode sizes (bench/results/cpu_kernels.md).
constexpr int ROWS = 8;
constexpr int BLOCKS = 3;

// The remaining rows (fewer than ROWS) of a column of C blocks: the same per-output arithmetic.
template <int C>
void rows_tail(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, uint16_t* y,
               int64_t ldy) {
    switch (rows) {
        case 1: return tile<1, C>(x, ldx, w, pairs, y, ldy);
        case 2: return tile<2, C>(x, ldx, w, pairs, y, ldy);
        case 3: return tile<3, C>(x, ldx, w, pairs, y, ldy);
        case 4: return tile<4, C>(x, ldx, w, pairs, y, ldy);
        case 5: return tile<5, C>(x, ldx, w, pairs, y, ldy);
        case 6: return tile<6, C>(x, ldx, w, pairs, y, ldy);
        case 7: return tile<7, C>(x, ldx, w, pairs, y, ldy);
    }
}

template <int C>
void column(int64_t m, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, uint16_t* y,
            int64_t ldy) {
    int64_t r = 0;
    for (; r + ROWS <= m; r += ROWS) tile<ROWS, C>(x + r * ldx, ldx, w, pairs, y + r * ldy, ldy);
    if (r < m) rows_tail<C>(int(m - r), x + r * ldx, ldx, w, pairs, y + r * ldy, ldy);
}

void column_of(int blocks, int64_t m, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs,
               uint16_t* y, int64_t ldy) {
    switch (blocks) {
        case 1: return column<1>(m, x, ldx, w, pairs, y, ldy);
        case 2: return column<2>(m, x, ldx, w, pairs, y, ldy);
        case 3: return column<3>(m, x, ldx, w, pairs, y, ldy);
    }
}

}  // namespace

extern "C" {

int headroom_linear_available() { return 1; }

// x: [m, k] bf16 with row stride ldx; w: packed [n/16][k/2][16][2]; y: [m, n] bf16, contiguous.
void headroom_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t m, int64_t n,
                          int64_t k, int threads) {
    const int64_t pairs = k / 2, blocks = n / BLOCK, columns = (blocks + BLOCKS - 1) / BLOCKS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < columns; ++c) {
        const int64_t first = c * BLOCKS;
        const int width = int(blocks - first < BLOCKS ? blocks - first : BLOCKS);
        column_of(width, m, x, ldx, w + first * pairs * 2 * BLOCK, pairs, y + first * BLOCK, n);
    }
}

}  // extern "C"

#else  // no AVX512-BF16: the model's linears stay on torch

extern "C" {
int headroom_linear_available() { return 0; }
void headroom_linear_bf16(const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t, int) {}
}

#endif
