// Weight-only quantized linears, y = x W^T, with W kept in its GGUF blocks (Q4_0, Q4_1, Q8_0): a decode step
// streams 0.56-1.06 bytes a weight instead of bf16's 2 or fp32's 4.
//
// The arithmetic is llama.cpp's: each row of x is quantized per 32-element block to int8 (d = max|x| / 127,
// q = round(x / d)), a block's dot product is an exact integer, and the blocks are combined in fp32:
//   y[n] = sum over blocks b, in order, of  fma(I[b], dw[n,b] * dx[b], .)  then  fma(mw[n,b], dx[b] * sx[b], .)
// where I = sum q_w q_x, sx = sum q_x and w = dw q_w + mw (Q4_0 is packed as Q4_1 with mw = -8 dw; Q8_0 has
// no mw). The integer sums are exact on every ISA and the float operations are the same and in the same order,
// so a row's output is bitwise the same alone or batched, and bitwise the same on the AVX512-VNNI, AVX2 and
// plain paths (tests/test_qlinear.py compares them).
//
// Packed layout (engine/model/quant.py `pack_quantized`), per block of 16 outputs, per 32-input block, one
// record: dw[16] as f16, then (4-bit only) mw[16] as f16, then the quants in 64-byte chunks whose 4-byte lane
// n holds 4 consecutive inputs of output n. 4-bit: chunk c holds inputs 4c..4c+3 in its low nibbles and
// 16+4c..16+4c+3 in its high ones (GGUF's own nibble order); 8-bit: chunk g holds inputs 4g..4g+3 as int8.
// One 512-bit load is one chunk for 16 outputs (vpdpbusd); with AVX2 each 256-bit half is 8 outputs.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;  // inputs per quantization block, weights and activations alike
constexpr int OUT = 16;  // outputs per packed block
// How far past the record a tile reads it asks for the next ones: each thread walks its columns' records in
// address order, and the hardware's prefetchers alone leave a batch-1 step well short of the memory's bandwidth
// (bench/prefetch_distance.py: 8-16 KiB is a plateau on both vector paths; the nearer end leaves a small L1
// more room).
constexpr int64_t PREFETCH = 8192;
constexpr int64_t record_bytes(int bits) { return bits == 4 ? 4 * OUT + OUT * QK / 2 : 2 * OUT + OUT * QK; }
constexpr int64_t quants_offset(int bits) { return bits == 4 ? 4 * OUT : 2 * OUT; }

inline float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, exact
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        int e = -1;
        uint32_t m = mant;
        do {
            ++e;
            m <<= 1;
        } while (!(m & 0x400u));
        bits = sign | uint32_t(112 - e) << 23 | ((m & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// The record PREFETCH bytes past p, a line at a time.
template <int BITS>
inline void prefetch_ahead(const uint8_t* p) {
    for (int64_t off = 0; off < record_bytes(BITS); off += 64) __builtin_prefetch(p + PREFETCH + off);
}

// A batch's rows quantized per 32-block: q [m][k] int8, and per (row, block) d, d * sum(q) and sum(q).
struct QuantRows {
    std::vector<int8_t> q;
    std::vector<float> d, ds;
    std::vector<int32_t> sum;
    int64_t k, blocks;
    const int8_t* row(int64_t r) const { return q.data() + r * k; }
    int64_t at(int64_t r, int64_t b) const { return r * blocks + b; }
};

// One 32-block of a row to int8: q = round(x / d) with d = max|x| / 127 (to nearest even, as nearbyint in the
// default rounding mode); d, d * sum(q) and sum(q) into the block's slots. The plain reference.
template <typename T>
void quantize_block_plain(const T* x, int8_t* q, float& d, float& ds, int32_t& sum) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(headroom::to_f32(x[j])));
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < QK; ++j) {
        const int v = int(std::nearbyint(headroom::to_f32(x[j]) * inv));
        q[j] = int8_t(v);
        s += v;
    }
    d = scale;
    sum = s;
    ds = scale * float(s);
}

// The same block on the vector units: the maximum and the integer sum do not depend on the order, and each
// code is the same product rounded the same way (cvtps rounds as nearbyint does), so the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <typename T>
void quantize_block(const T* x, int8_t* q, float& d, float& ds, int32_t& sum) {
    const __m512 a = (__m512)headroom::load16(x), b = (__m512)headroom::load16(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vinv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    d = scale;
    sum = s;
    ds = scale * float(s);
}
#elif defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16 -> fp32, exact
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <typename T>
void quantize_block(const T* x, int8_t* q, float& d, float& ds, int32_t& sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = load8(x + 8 * i);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
    // packs interleave 4-code groups across the two 128-bit lanes; the permute puts them back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    const int32_t s = _mm_cvtsi128_si32(s4);
    d = scale;
    sum = s;
    ds = scale * float(s);
}
#else
template <typename T>
void quantize_block(const T* x, int8_t* q, float& d, float& ds, int32_t& sum) {
    quantize_block_plain(x, q, d, ds, sum);
}
#endif

// `plain`: the scalar reference for every block (the tests compare the vector paths with it).
template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t m, int64_t k, QuantRows& out, bool plain, int threads) {
    out.k = k;
    out.blocks = k / QK;
    out.q.resize(m * k);
    out.d.resize(m * out.blocks);
    out.ds.resize(m * out.blocks);
    out.sum.resize(m * out.blocks);
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 4)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < out.blocks; ++b) {
            const int64_t i = out.at(r, b);
            const T* xb = x + r * ldx + b * QK;
            int8_t* qb = out.q.data() + r * k + b * QK;
            if (plain)
                quantize_block_plain(xb, qb, out.d[i], out.ds[i], out.sum[i]);
            else
                quantize_block(xb, qb, out.d[i], out.ds[i], out.sum[i]);
        }
}

// One (row, output) sum's float steps, shared by every path: the integer dot of a block enters once.
inline float fold(float acc, int32_t dot, float dw, float mw, float dx, float dsx, bool with_min) {
    acc = std::fma(float(dot), dw * dx, acc);
    return with_min ? std::fma(mw, dsx, acc) : acc;
}

template <typename T>
void store_row(T* y, const float* acc, int count) {
    for (int i = 0; i < count; ++i) headroom::store(y + i, acc[i]);
}

// Weight j (0..31) of output n in a packed record, as its integer code (0..15 for 4-bit, signed for 8-bit).
template <int BITS>
int packed_quant(const uint8_t* record, int n, int j) {
    const int lane = n * 4 + (j % 4);
    if (BITS == 8) return int8_t(record[quants_offset(8) + (j / 4) * 64 + lane]);
    const uint8_t byte = record[quants_offset(4) + ((j % 16) / 4) * 64 + lane];
    return j < 16 ? byte & 0x0f : byte >> 4;
}

// Output n's scale and minimum (0 for 8-bit) in a packed record, as floats.
template <int BITS>
void packed_scales(const uint8_t* record, int n, float& d, float& m) {
    uint16_t dh, mh = 0;
    std::memcpy(&dh, record + 2 * n, 2);
    if (BITS == 4) std::memcpy(&mh, record + 2 * OUT + 2 * n, 2);
    d = half_to_float(dh);
    m = half_to_float(mh);
}

// Four activation codes as one int32, for a broadcast to every lane (4 inputs of each output's dot).
inline int32_t four_bytes(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// The plain path: a reference for the vector ones and what runs without AVX2.
template <int BITS, typename T>
void block_plain(const QuantRows& x, int64_t r0, int64_t rows, const uint8_t* w, T* y, int64_t ldy) {
    const int64_t rec = record_bytes(BITS);
    for (int64_t r = r0; r < r0 + rows; ++r) {
        float acc[OUT] = {};
        for (int64_t b = 0; b < x.blocks; ++b) {
            const uint8_t* p = w + b * rec;
            const int8_t* xq = x.row(r) + b * QK;
            for (int n = 0; n < OUT; ++n) {
                int32_t dot = 0;
                for (int j = 0; j < QK; ++j) dot += packed_quant<BITS>(p, n, j) * xq[j];
                float dw, mw;
                packed_scales<BITS>(p, n, dw, mw);
                acc[n] = fold(acc[n], dot, dw, mw, x.d[x.at(r, b)], x.ds[x.at(r, b)], BITS == 4);
            }
        }
        store_row(y + (r - r0) * ldy, acc, OUT);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int ROWS = 4, COLS = 2;  // 8 fp32 + 8 int32 accumulators, 4 weight vectors: no spills

inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }

// R rows times C packed blocks (16 outputs each) over all the input blocks.
template <int BITS, int R, int C, typename T>
void tile(const QuantRows& x, int64_t r0, const uint8_t* w, int64_t wstride, T* y, int64_t ldy) {
    const int64_t rec = record_bytes(BITS);
    const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(char(0x80));
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x.blocks; ++b) {
        __m512i dot[R][C];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
        const uint8_t* p[C];
        for (int c = 0; c < C; ++c) {
            p[c] = w + c * wstride + b * rec;
            prefetch_ahead<BITS>(p[c]);
        }
        if (BITS == 4) {
            for (int ch = 0; ch < 4; ++ch) {
                __m512i lo[C], hi[C];
                for (int c = 0; c < C; ++c) {
                    const __m512i raw = _mm512_loadu_si512(p[c] + quants_offset(4) + ch * 64);
                    lo[c] = _mm512_and_si512(raw, low);
                    hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                }
                for (int r = 0; r < R; ++r) {
                    const int8_t* xq = x.row(r0 + r) + b * QK + 4 * ch;
                    const __m512i xl = bcast4(xq), xh = bcast4(xq + 16);
                    for (int c = 0; c < C; ++c) {
                        dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], lo[c], xl);
                        dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], hi[c], xh);
                    }
                }
            }
        } else {  // int8 weights as uint8 (w + 128): the sum then holds 128 sum(q_x) too, taken off below
            for (int g = 0; g < 8; ++g) {
                __m512i wv[C];
                for (int c = 0; c < C; ++c)
                    wv[c] = _mm512_xor_si512(_mm512_loadu_si512(p[c] + quants_offset(8) + g * 64), flip);
                for (int r = 0; r < R; ++r) {
                    const __m512i xv = bcast4(x.row(r0 + r) + b * QK + 4 * g);
                    for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], wv[c], xv);
                }
            }
            for (int r = 0; r < R; ++r) {
                const __m512i bias = _mm512_set1_epi32(x.sum[x.at(r0 + r, b)] * 128);
                for (int c = 0; c < C; ++c) dot[r][c] = _mm512_sub_epi32(dot[r][c], bias);
            }
        }
        __m512 dw[C], mw[C];
        for (int c = 0; c < C; ++c) {
            dw[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p[c]));
            mw[c] = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p[c] + 2 * OUT))) : dw[c];
        }
        for (int r = 0; r < R; ++r) {
            const __m512 dx = _mm512_set1_ps(x.d[x.at(r0 + r, b)]), dsx = _mm512_set1_ps(x.ds[x.at(r0 + r, b)]);
            for (int c = 0; c < C; ++c) {
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(dw[c], dx), acc[r][c]);
                if (BITS == 4) acc[r][c] = _mm512_fmadd_ps(mw[c], dsx, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) headroom::store16(y + r * ldy + c * OUT, headroom::f32x16(acc[r][c]));
}
#elif defined(__AVX2__)
constexpr int ROWS = 2, COLS = 1;  // AVX2 has 16 vector registers: 4 fp32 + 4 int sums + 4 weights

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }

// A 4-bit block's chunk `ch` (4 inputs of each of 32 pairs) as low and high nibbles, two halves each.
inline void split_nibbles(const uint8_t* p, int ch, __m256i* lo, __m256i* hi) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + quants_offset(4) + ch * 64 + h * 32));
        lo[h] = _mm256_and_si256(raw, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
}

// As the AVX-512 tile, each 16-output block as two 8-output halves. 4-bit: vpmaddubsw's int16 pair sums
// (at most 2 * 15 * 127) add up over a block's 8 products to at most 30,480, so they stay in int16 until one
// vpmaddwd. 8-bit: the weights are signed, so |w| times x with w's sign (llama.cpp's trick, at most
// 2 * 127 * 127 a pair) goes through vpmaddwd at every chunk. SPLIT (4-bit): the nibbles come from `split`
// (split_column), not from the packed codes: the same integers, so the same bits.
template <int BITS, int R, bool SPLIT, typename T>
void tile_of(const QuantRows& x, int64_t r0, const uint8_t* w, const __m256i* split, T* y, int64_t ldy) {
    const int64_t rec = record_bytes(BITS);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.blocks; ++b) {
        const uint8_t* p = w + b * rec;
        if constexpr (!SPLIT) prefetch_ahead<BITS>(p);
        __m256i dot[R][2];
        if (BITS == 4) {
            __m256i pairs[R][2];
            for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
            for (int ch = 0; ch < 4; ++ch) {
                __m256i lo[2], hi[2];
                if constexpr (SPLIT) {
                    const __m256i* v = split + (b * 4 + ch) * 4;
                    lo[0] = v[0], lo[1] = v[1], hi[0] = v[2], hi[1] = v[3];
                } else {
                    split_nibbles(p, ch, lo, hi);
                }
                for (int r = 0; r < R; ++r) {
                    const int8_t* xq = x.row(r0 + r) + b * QK + 4 * ch;
                    const __m256i xl = bcast4(xq), xh = bcast4(xq + 16);
                    for (int h = 0; h < 2; ++h) {
                        pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_maddubs_epi16(lo[h], xl));
                        pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_maddubs_epi16(hi[h], xh));
                    }
                }
            }
            for (int r = 0; r < R; ++r)
                for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_madd_epi16(pairs[r][h], ones);
        } else {
            for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g) {
                for (int h = 0; h < 2; ++h) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i*)(p + quants_offset(8) + g * 64 + h * 32));
                    const __m256i aw = _mm256_sign_epi8(wv, wv);
                    for (int r = 0; r < R; ++r) {
                        const __m256i sx = _mm256_sign_epi8(bcast4(x.row(r0 + r) + b * QK + 4 * g), wv);
                        dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
                    }
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
            const __m256 mw = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 2 * OUT + 16 * h))) : dw;
            for (int r = 0; r < R; ++r) {
                const __m256 dx = _mm256_set1_ps(x.d[x.at(r0 + r, b)]), dsx = _mm256_set1_ps(x.ds[x.at(r0 + r, b)]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(dw, dx), acc[r][h]);
                if (BITS == 4) acc[r][h] = _mm256_fmadd_ps(mw, dsx, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float out[OUT];
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        store_row(y + r * ldy, out, OUT);
    }
}

template <int BITS, int R, int C, typename T>
void tile(const QuantRows& x, int64_t r0, const uint8_t* w, int64_t, T* y, int64_t ldy) {
    static_assert(C == 1, "one packed block (two halves) per tile");
    tile_of<BITS, R, false>(x, r0, w, nullptr, y, ldy);
}

// From this many rows a 4-bit column's nibbles are split once, for all its tiles, instead of once a tile.
constexpr int64_t SPLIT_ROWS = 8 * ROWS;

// A 4-bit column's codes as split_nibbles gives them: per block and chunk, the low halves, then the high.
inline void split_column(const uint8_t* w, int64_t blocks, std::vector<__m256i>& out) {
    out.resize(size_t(blocks) * 16);
    for (int64_t b = 0; b < blocks; ++b)
        for (int ch = 0; ch < 4; ++ch) {
            __m256i* v = out.data() + (b * 4 + ch) * 4;
            split_nibbles(w + b * record_bytes(4), ch, v, v + 2);
        }
}

// A batch of at least SPLIT_ROWS rows through 4-bit weights: each column split once, then its row tiles.
template <typename T>
void linear_split(const QuantRows& x, int64_t m, const uint8_t* w, T* y, int64_t n, int threads) {
    const int64_t wstride = x.blocks * record_bytes(4);
#pragma omp parallel num_threads(threads)
    {
        std::vector<__m256i> split;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n / OUT; ++c) {
            const uint8_t* wc = w + c * wstride;
            split_column(wc, x.blocks, split);
            int64_t r = 0;
            for (; r + ROWS <= m; r += ROWS) tile_of<4, ROWS, true>(x, r, wc, split.data(), y + r * n + c * OUT, n);
            for (; r < m; ++r) tile_of<4, 1, true>(x, r, wc, split.data(), y + r * n + c * OUT, n);
        }
    }
}
#else
constexpr int ROWS = 1, COLS = 1;
template <int BITS, int R, int C, typename T>
void tile(const QuantRows& x, int64_t r0, const uint8_t* w, int64_t, T* y, int64_t ldy) {
    block_plain<BITS>(x, r0, R, w, y, ldy);
}
#endif

// The rows left over after whole tiles of ROWS, for C blocks.
template <int BITS, int C, typename T>
void rows_tail(int rows, const QuantRows& x, int64_t r0, const uint8_t* w, int64_t wstride, T* y, int64_t ldy) {
    if constexpr (ROWS > 1) {
        if (rows == 1) return tile<BITS, 1, C>(x, r0, w, wstride, y, ldy);
    }
    if constexpr (ROWS > 2) {
        if (rows == 2) return tile<BITS, 2, C>(x, r0, w, wstride, y, ldy);
        if (rows == 3) return tile<BITS, 3, C>(x, r0, w, wstride, y, ldy);
    }
}

template <int BITS, int C, typename T>
void column(const QuantRows& x, int64_t m, const uint8_t* w, int64_t wstride, T* y, int64_t ldy) {
    int64_t r = 0;
    for (; r + ROWS <= m; r += ROWS) tile<BITS, ROWS, C>(x, r, w, wstride, y + r * ldy, ldy);
    if (r < m) rows_tail<BITS, C>(int(m - r), x, r, w, wstride, y + r * ldy, ldy);
}

template <int BITS, typename T>
void linear(const QuantRows& x, int64_t m, const uint8_t* w, T* y, int64_t n, int threads) {
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__)
    if constexpr (BITS == 4)
        if (m >= SPLIT_ROWS) return linear_split(x, m, w, y, n, threads);
#endif
    const int64_t wstride = x.blocks * record_bytes(BITS), blocks = n / OUT, columns = (blocks + COLS - 1) / COLS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < columns; ++c) {
        const int64_t first = c * COLS;
        const uint8_t* wc = w + first * wstride;
        if (COLS == 1 || blocks - first >= COLS)
            column<BITS, COLS>(x, m, wc, wstride, y + first * OUT, n);
        else
            column<BITS, 1>(x, m, wc, wstride, y + first * OUT, n);
    }
}

// An int8/int4 weight row `row` back to floats (the embedding lookup of a tied, quantized table).
template <int BITS, typename T>
void dequant_row(const uint8_t* w, int64_t blocks, int64_t row, T* out) {
    const uint8_t* base = w + (row / OUT) * blocks * record_bytes(BITS);
    const int n = int(row % OUT);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = base + b * record_bytes(BITS);
        float d, m;
        packed_scales<BITS>(p, n, d, m);
        for (int j = 0; j < QK; ++j) {
            const float v = d * float(packed_quant<BITS>(p, n, j));
            headroom::store(out + b * QK + j, BITS == 4 ? v + m : v);
        }
    }
}

template <typename F>
void with_bits(int bits, F&& f) {
    if (bits == 4)
        f(std::integral_constant<int, 4>{});
    else
        f(std::integral_constant<int, 8>{});
}

}  // namespace

extern "C" {

// Which vector path this build runs: 2 AVX512-VNNI, 1 AVX2, 0 plain C++.
int headroom_qlinear_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

// x: [m, k] (bf16 when x_bf16, else fp32) with row stride ldx; w: packed, `bits` 4 or 8; y: [m, n] contiguous,
// bf16 when y_bf16. `plain`: the plain C++ path whatever the ISA (the tests' reference).
void headroom_qlinear(int x_bf16, const void* x, int64_t ldx, const uint8_t* w, int bits, int y_bf16, void* y,
                      int64_t m, int64_t n, int64_t k, int plain, int threads) {
    QuantRows rows;
    headroom::with_element_type(x_bf16, [&](auto xt) {
        quantize_rows(static_cast<const decltype(xt)*>(x), ldx, m, k, rows, plain, threads);
    });
    headroom::with_element_type(y_bf16, [&](auto yt) {
        using T = decltype(yt);
        with_bits(bits, [&](auto b) {
            constexpr int BITS = decltype(b)::value;
            if (!plain) return linear<BITS>(rows, m, w, static_cast<T*>(y), n, threads);
            const int64_t wstride = rows.blocks * record_bytes(BITS);
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t ob = 0; ob < n / OUT; ++ob)
                block_plain<BITS>(rows, 0, m, w + ob * wstride, static_cast<T*>(y) + ob * OUT, n);
        });
    });
}

// out[i] = row ids[i] of the packed weight [*, k], as floats (bf16 when out_bf16).
void headroom_qrows(const uint8_t* w, int bits, int64_t k, const int64_t* ids, int64_t count, int out_bf16,
                    void* out) {
    headroom::with_element_type(out_bf16, [&](auto t) {
        using T = decltype(t);
        with_bits(bits, [&](auto b) {
            for (int64_t i = 0; i < count; ++i)
                dequant_row<decltype(b)::value>(w, k / QK, ids[i], static_cast<T*>(out) + i * k);
        });
    });
}

}  // extern "C"
