// Shared by the CPU kernels: 16-float vectors, bf16 and fp32 loads and stores, and a fixed-order sum.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace headroom {

constexpr int LANES = 16;
// GCC/Clang vector extensions: one 16-float vector is a zmm register with AVX-512, two ymm with AVX2, four
// q registers on NEON; each lane's arithmetic is the same however the ISA splits the vector.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load16(const float* p) {
    f32x16 x;
    std::memcpy(&x, p, sizeof x);
    return x;
}
inline f32x16 load16(const uint16_t* p) {  // bf16 -> fp32 is exact: the bits shifted into the high half
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

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));

inline float sum16(f32x16 x) {  // a fixed tree: lane l + lane l + 8, then + 4, + 2, + 1
    f32x8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    f32x2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
    return c[0] + c[1];
}

inline void store16(float* p, f32x16 x) { std::memcpy(p, &x, sizeof x); }
inline void store16(uint16_t* p, f32x16 x) {  // store() on each lane, as vector operations
    u32x16 u;
    std::memcpy(&u, &x, sizeof u);
    const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const u32x16 bf16 = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
    const u16x16 narrow = __builtin_convertvector(bf16, u16x16);
    std::memcpy(p, &narrow, sizeof narrow);
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 splat(float x) { return f32x16{} + x; }

// exp(x), Cephes' expf polynomial, 16 lanes at a time (libm's expf does not vectorize without
// -ffast-math); the same bits on every call. Below -87 (where expf leaves the normal floats) it is 0, so a
// masked -inf logit has no mass; above 88 it saturates.
inline f32x16 exp_approx(f32x16 x) {
    const f32x16 input = x;
    x = x < splat(-87.0f) ? splat(-87.0f) : x;
    x = x > splat(88.0f) ? splat(88.0f) : x;
    const f32x16 z = x * 1.44269504088896341f + 0.5f;
    f32x16 n = __builtin_convertvector(__builtin_convertvector(z, i32x16), f32x16);
    n = n > z ? n - 1.0f : n;  // floor(z): the conversion truncates toward zero
    const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    f32x16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
    f32x16 scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return input < splat(-87.0f) ? splat(0.0f) : p * scale;
}

// exp_approx of one float, through lane 0: a tail element gets the same bits as a vector lane would.
inline float exp_approx(float x) { return exp_approx(splat(x))[0]; }

// tanh(x) = 1 - 2 / (1 + exp(2x)), on exp_approx: saturates to +-1 where exp_approx does; near 0 it is off by
// about one float step of 1, not of x: an absolute error, which soft-capped scores (cap * tanh) can take.
inline f32x16 tanh_approx(f32x16 x) { return 1.0f - 2.0f / (1.0f + exp_approx(x + x)); }
inline float tanh_approx(float x) { return tanh_approx(splat(x))[0]; }

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
