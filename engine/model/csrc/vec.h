// Shared by the CPU kernels: 16-float vectors, bf16 and fp32 loads and stores, and a fixed-order sum.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace headroom {

constexpr int LANES = 16;
// GCC/Clang vector extensions: one 16-float vector is a zmm register with AVX-512, two ymm with AVX2, four
// q registers on NEON; each lane's arithmetic is the same however the ISA splits the vector.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
// Always inlined where a 16-float vector is passed or returned: without AVX-512 no register holds one, so an
// out-of-line call passes it through memory, and GCC leaves exp_approx out of line on AVX2.
#define HEADROOM_VEC inline __attribute__((always_inline))

HEADROOM_VEC f32x16 load16(const float* p) {
    f32x16 x;
    std::memcpy(&x, p, sizeof x);
    return x;
}
HEADROOM_VEC f32x16 load16(const uint16_t* p) {  // bf16 -> fp32 is exact: the bits shifted into the high half
    u16x16 raw;
    std::memcpy(&raw, p, sizeof raw);
    u32x16 wide = __builtin_convertvector(raw, u32x16) << 16;
    f32x16 x;
    std::memcpy(&x, &wide, sizeof x);
    return x;
}

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch casts to bf16; branch-free
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    *p = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);  // NaN stays a quiet NaN
}

// IEEE fp16, the KV cache's element beside fp32 activations (`--kv-cache-dtype`): a type of its own so that
// overloads tell it from bf16's bits. F16C (every AVX2 CPU) or AVX-512 converts 8 or 16 at once; elsewhere
// the compiler's _Float16 does, one by one. Stores round to nearest even, as torch casts to fp16.
struct f16 {
    uint16_t bits;
};

HEADROOM_VEC f32x16 load16(const f16* p) {
    f32x16 x;
#if defined(__AVX512F__)
    const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    std::memcpy(&x, &wide, sizeof x);
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    std::memcpy(&x, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&x) + sizeof lo, &hi, sizeof hi);
#else
    for (int l = 0; l < LANES; ++l) {
        _Float16 h;
        std::memcpy(&h, &p[l].bits, sizeof h);
        x[l] = float(h);
    }
#endif
    return x;
}

HEADROOM_VEC void store16(f16* p, f32x16 x) {
#if defined(__AVX512F__)
    __m512 wide;
    std::memcpy(&wide, &x, sizeof x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(wide, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    __m256 lo, hi;
    std::memcpy(&lo, &x, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
#else
    for (int l = 0; l < LANES; ++l) {
        const _Float16 h = _Float16(x[l]);
        std::memcpy(&p[l].bits, &h, sizeof h);
    }
#endif
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));

HEADROOM_VEC float sum16(f32x16 x) {  // a fixed tree: lane l + lane l + 8, then + 4, + 2, + 1
    f32x8 half[2];  // not a shuffle of x: without AVX-512 GCC would build the halves lane by lane
    std::memcpy(half, &x, sizeof x);
    f32x8 a = half[0] + half[1];
    f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    f32x2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
    return c[0] + c[1];
}

HEADROOM_VEC void store16(float* p, f32x16 x) { std::memcpy(p, &x, sizeof x); }
HEADROOM_VEC void store16(uint16_t* p, f32x16 x) {  // store() on each lane, as vector operations
    u32x16 u;
    std::memcpy(&u, &x, sizeof u);
    const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const u32x16 bf16 = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
    const u16x16 narrow = __builtin_convertvector(bf16, u16x16);
    std::memcpy(p, &narrow, sizeof narrow);
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

HEADROOM_VEC f32x16 splat(float x) { return f32x16{} + x; }

// Comparisons and selects of 16-float vectors GCC writes out lane by lane, in scalar code, where no register
// holds 16 floats (AVX2): there the loops that compare run on 8-float vectors, the ymm registers' width.
#if defined(__AVX512F__)
typedef f32x16 f32xN;
typedef i32x16 i32xN;
#else
typedef f32x8 f32xN;
typedef int32_t i32xN __attribute__((vector_size(32)));
#endif
constexpr int NATIVE_LANES = sizeof(f32xN) / sizeof(float);

// The largest of x[0..n), n >= 1: whole vectors, then the rest (the maximum is exact in any order).
inline float max_of(const float* x, int64_t n) {
    float top = x[0];
    const int64_t whole = n - n % NATIVE_LANES;
    if (whole) {
        f32xN high;
        std::memcpy(&high, x, sizeof high);
        for (int64_t j = NATIVE_LANES; j < whole; j += NATIVE_LANES) {
            f32xN y;
            std::memcpy(&y, x + j, sizeof y);
            high = y > high ? y : high;
        }
        for (int l = 0; l < NATIVE_LANES; ++l) top = std::max(top, high[l]);
    }
    for (int64_t j = whole; j < n; ++j) top = std::max(top, x[j]);
    return top;
}

// exp(x), Cephes' expf polynomial, a vector at a time (libm's expf does not vectorize without -ffast-math);
// the same bits on every call, and in every lane whatever the vector's width. Below -87 (where expf leaves
// the normal floats) it is 0, so a masked -inf logit has no mass; above 88 it saturates.
template <typename V, typename I>
HEADROOM_VEC V exp_lanes(V x) {
    const V input = x, low = V{} - 87.0f, high = V{} + 88.0f;
    x = x < low ? low : x;
    x = x > high ? high : x;
    const V z = x * 1.44269504088896341f + 0.5f;
    V n = __builtin_convertvector(__builtin_convertvector(z, I), V);
    n = n > z ? n - 1.0f : n;  // floor(z): the conversion truncates toward zero
    const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
    V p = V{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const I bits = (__builtin_convertvector(n, I) + 127) << 23;
    V scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return input < low ? V{} : p * scale;
}

HEADROOM_VEC f32x16 exp_approx(f32x16 x) {
    f32xN part[sizeof(f32x16) / sizeof(f32xN)];
    std::memcpy(part, &x, sizeof x);
    for (f32xN& v : part) v = exp_lanes<f32xN, i32xN>(v);
    std::memcpy(&x, part, sizeof x);
    return x;
}

// exp_approx of one float, through lane 0: a tail element gets the same bits as a vector lane would.
HEADROOM_VEC float exp_approx(float x) { return exp_approx(splat(x))[0]; }

// tanh(x) = 1 - 2 / (1 + exp(2x)), on exp_approx: saturates to +-1 where exp_approx does; near 0 it is off by
// about one float step of 1, not of x: an absolute error, which soft-capped scores (cap * tanh) can take.
HEADROOM_VEC f32x16 tanh_approx(f32x16 x) { return 1.0f - 2.0f / (1.0f + exp_approx(x + x)); }
HEADROOM_VEC float tanh_approx(float x) { return tanh_approx(splat(x))[0]; }

// Calls f with a value of the element type: uint16_t (bf16 bits) when `bf16`, else float. Each kernel's
// extern "C" entry point casts its pointers once, inside f, instead of spelling out both types.
template <typename F>
void with_element_type(int bf16, F&& f) {
    if (bf16)
        f(uint16_t{});
    else
        f(float{});
}

}  // namespace headroom
