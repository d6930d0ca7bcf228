// Paged attention on the CPU for a flattened ragged batch, reading K and V from the paged cache in place, with
// the families' variants: a scale of the layer's own, a sliding window, soft-capped scores.
//
// Why a kernel of our own: written in torch, attention has to gather every sequence's blocks into
// contiguous copies padded to the batch's longest context and run many tiny matmuls on them, which on a
// small CPU costs more than the attention's arithmetic. Here each KV head of a tile
// (one decode token, or up to 16 consecutive prefill tokens) is one work item that walks its own
// sequence's context, so nothing is copied, padded or masked.
//
// Batch invariance by construction: a token's result is computed by the same code over the same keys in
// the same order whatever else the step holds (decodes, prefills, chunks, other sequences), and no
// reduction depends on memory addresses or thread counts: dot products accumulate in 16 fixed lanes summed
// in a fixed tree, softmax and the value sum run over keys in order. Scores, softmax and the weighted sum
// of values are all in fp32; the output is rounded to the model dtype once. A sliding window only moves where
// a token's keys start: its keys, and so its arithmetic, are still its own, and the blocks before the first
// key a tile's tokens see are never read (a long context costs a sliding layer its window, not its length).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace headroom;

// Softmax of s[0..n) in place; returns the sum of the exponentials (the caller divides once at the end).
inline float softmax_unnormalized(float* s, int n) {
    const float top = max_of(s, n);
    const int whole = n - n % LANES;
    f32x16 lanes = {};
    for (int j = 0; j < whole; j += LANES) {
        const f32x16 e = exp_approx(load16(s + j) - top);
        store16(s + j, e);
        lanes += e;
    }
    for (int j = whole; j < n; ++j) s[j] = exp_approx(s[j] - top);
    float sum = sum16(lanes);
    for (int j = whole; j < n; ++j) sum += s[j];
    return sum;
}

// scores[0..n) become cap * tanh(score / cap), as Gemma 2 caps them before the softmax
inline void soft_cap(float* s, int n, float cap) {
    const int whole = n - n % LANES;
    for (int j = 0; j < whole; j += LANES) store16(s + j, tanh_approx(load16(s + j) / cap) * cap);
    for (int j = whole; j < n; ++j) s[j] = tanh_approx(s[j] / cap) * cap;
}

// How a layer attends (engine/model/attention_metadata.py AttentionSpec): window 0 and softcap 0 mean none.
struct Spec {
    float scale;
    int window;
    float softcap;
};

// The first key a token that sees `ctx` keys attends to (window 0: none).
inline int first_key(int ctx, int window) { return window ? std::max(0, ctx - window) : 0; }

// A row of `width` elements (a multiple of LANES) into the cache's element type C: copied where it is T.
template <typename T, typename C>
inline void copy_row(C* to, const T* from, int64_t width) {
    if constexpr (std::is_same_v<T, C>)
        std::memcpy(to, from, width * sizeof(T));
    else
        for (int64_t i = 0; i < width; i += LANES) store16(to + i, load16(from + i));
}

template <typename T, typename C>
void write_kv(const T* k, const T* v, int64_t k_row, int64_t v_row, const int64_t* slots, int64_t tokens,
              int kv_heads, int head_dim, C* k_cache, C* v_cache) {
    const int64_t width = int64_t(kv_heads) * head_dim;
    for (int64_t t = 0; t < tokens; ++t) {
        copy_row(k_cache + slots[t] * width, k + t * k_row, width);
        copy_row(v_cache + slots[t] * width, v + t * v_row, width);
    }
}

// acc[c] += p[j] * v[j * chunks + c] over the keys j in [from, n), in order: one row's sum of values.
template <int CHUNKS>
inline void weighted_sum(f32x16* acc, const float* p, const f32x16* v, int from, int n, int chunks) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (CHUNKS > 0) {  // the same FMAs on 8-float halves: GCC keeps 16-float vectors built from a
                                 // scalar in memory on AVX2, and the sum would wait on the stack every key
        __m256 a[2 * CHUNKS];
        for (int i = 0; i < 2 * CHUNKS; ++i) a[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(acc) + 8 * i);
        for (int j = from; j < n; ++j) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            const float* vj = reinterpret_cast<const float*>(v + j * CHUNKS);
            for (int i = 0; i < 2 * CHUNKS; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
        }
        for (int i = 0; i < 2 * CHUNKS; ++i) _mm256_storeu_ps(reinterpret_cast<float*>(acc) + 8 * i, a[i]);
        return;
    }
#endif
    constexpr int MAX_CHUNKS = 16;  // head_dim <= 256
    f32x16 a[MAX_CHUNKS];           // in registers when CHUNKS is known: one FMA chain per chunk, interleaved
    for (int c = 0; c < chunks; ++c) a[c] = acc[c];
    for (int j = from; j < n; ++j)
        for (int c = 0; c < chunks; ++c) a[c] += p[j] * v[j * chunks + c];
    for (int c = 0; c < chunks; ++c) acc[c] = a[c];
}

constexpr int ITEMS_PER_THREAD = 4;  // tiles a thread gets at least before an item takes all of a tile's heads
constexpr int TILE_TOKENS = 16;  // a prefill's consecutive tokens attended together: each K and V block is
                                 // converted once for all of them

struct Tile {
    int64_t first;  // first token in the flat batch
    int tokens;     // consecutive tokens of one sequence, each seeing one key more than the one before
};

// One work item: the `group` query heads that share KV head g, of a tile's tokens, over the keys of the
// sequence's block table. For each (query row, key) the arithmetic is the same whatever the tile holds:
// the score is one dot product (16 lanes, then sum16); each row's softmax runs over its own keys; each
// output lane adds p * v over the keys in order. head_dim % LANES == 0 (the caller checks). Scores are kept
// from `base` on, the start of the block of the first key the tile's first token (the one that sees the
// fewest) attends to. WINDOW: whether the layer slides, known at compile time so that without a window every
// row's keys start at 0 in the hot loops, as the compiler sees them.
// C: the cache's element type, T's or fp16 (converted to fp32 as a block is loaded, like bf16).
template <typename T, typename C, int CHUNKS, bool WINDOW>  // CHUNKS: head_dim / LANES where known, else 0
void attend_tile(const T* q, int64_t q_row, const C* k_cache, const C* v_cache, const int32_t* table,
                 const int32_t* ctx, int tokens, int g, int group, int kv_heads, int head_dim, int block_size,
                 const Spec& spec, T* out, int64_t out_row, std::vector<f32x16>& qv, std::vector<f32x16>& acc,
                 std::vector<f32x16>& block, std::vector<float>& scores, std::vector<float>& total) {
    const int chunks = CHUNKS ? CHUNKS : head_dim / LANES, rows = tokens * group;
    const int keys = ctx[tokens - 1];  // the tile's last token sees the most
    const int window = WINDOW ? spec.window : 0;
    const int base = first_key(ctx[0], window) / block_size * block_size, span = keys - base;
    const int64_t key_stride = int64_t(kv_heads) * head_dim;  // between consecutive keys of a block
    const float scale = spec.scale;  // a local: the score stores cannot alias it
    qv.resize(size_t(rows) * chunks);
    acc.assign(size_t(rows) * chunks, f32x16{});
    block.resize(size_t(block_size) * chunks);
    scores.resize(size_t(rows) * span);
    total.resize(rows);
    for (int i = 0; i < tokens; ++i)
        for (int r = 0; r < group; ++r)
            for (int c = 0; c < chunks; ++c)
                qv[(i * group + r) * chunks + c] = load16(q + i * q_row + (g * group + r) * head_dim + c * LANES);
    auto head_in_block = [&](const C* cache, int first) {  // this KV head's first key in the block at `first`
        return cache + (int64_t(table[first / block_size]) * block_size * kv_heads + g) * head_dim;
    };
    auto load_block = [&](const C* cache, int first, int n) {
        if (first + block_size < keys) {  // the next block's keys are wherever the table put it: ask for them now
            const char* next = reinterpret_cast<const char*>(head_in_block(cache, first + block_size));
            for (int j = 0; j < block_size; ++j)
                for (int64_t b = 0; b < head_dim * int64_t(sizeof(C)); b += 64)
                    __builtin_prefetch(next + j * key_stride * int64_t(sizeof(C)) + b);
        }
        const C* p = head_in_block(cache, first);
        for (int j = 0; j < n; ++j, p += key_stride)
            for (int c = 0; c < chunks; ++c) block[j * chunks + c] = load16(p + c * LANES);
    };
    // the row's keys within the block starting at `first`: [from, to) of it (empty where to <= from)
    auto keys_in = [&](int row, int first, int& from, int& to) {
        const int c = ctx[row / group];
        from = std::max(first_key(c, window) - first, 0);
        to = std::min(block_size, c - first);
    };
    for (int first = base; first < keys; first += block_size) {
        load_block(k_cache, first, std::min(block_size, keys - first));
        for (int row = 0; row < rows; ++row) {
            int j, n;
            keys_in(row, first, j, n);
            const f32x16* qr = &qv[size_t(row) * chunks];
            float* s = &scores[size_t(row) * span + first - base];
            for (; j + 4 <= n; j += 4) {  // four keys at a time: independent FMA chains, the same sums
                f32x16 p0 = {}, p1 = {}, p2 = {}, p3 = {};
                for (int c = 0; c < chunks; ++c) {
                    p0 += qr[c] * block[j * chunks + c];
                    p1 += qr[c] * block[(j + 1) * chunks + c];
                    p2 += qr[c] * block[(j + 2) * chunks + c];
                    p3 += qr[c] * block[(j + 3) * chunks + c];
                }
                s[j] = sum16(p0) * scale;
                s[j + 1] = sum16(p1) * scale;
                s[j + 2] = sum16(p2) * scale;
                s[j + 3] = sum16(p3) * scale;
            }
            for (; j < n; ++j) {
                f32x16 products = {};
                for (int c = 0; c < chunks; ++c) products += qr[c] * block[j * chunks + c];
                s[j] = sum16(products) * scale;
            }
        }
    }
    for (int row = 0; row < rows; ++row) {
        const int c = ctx[row / group], from = first_key(c, window);
        float* s = &scores[size_t(row) * span + from - base];
        if (spec.softcap) soft_cap(s, c - from, spec.softcap);
        total[row] = softmax_unnormalized(s, c - from);
    }
    for (int first = base; first < keys; first += block_size) {
        load_block(v_cache, first, std::min(block_size, keys - first));
        for (int row = 0; row < rows; ++row) {
            int from, n;
            keys_in(row, first, from, n);
            const float* p = &scores[size_t(row) * span + first - base];
            weighted_sum<CHUNKS>(&acc[size_t(row) * chunks], p, block.data(), from, n, chunks);
        }
    }
    for (int row = 0; row < rows; ++row) {
        const float inv = 1.0f / total[row];
        T* o = out + (row / group) * out_row + (g * group + row % group) * head_dim;
        for (int c = 0; c < chunks; ++c) store16(o + c * LANES, acc[size_t(row) * chunks + c] * inv);
    }
}

template <typename T, typename C, int CHUNKS>
void attend(const T* q, int64_t q_row, const C* k_cache, const C* v_cache, const int32_t* tables,
            int64_t table_row, const int32_t* token_seq, const int32_t* token_ctx, int64_t tokens, int heads,
            int kv_heads, int head_dim, int block_size, const Spec& spec, T* out, int threads) {
    std::vector<Tile> tiles;
    for (int64_t t = 0; t < tokens; ++t) {
        Tile* last = tiles.empty() ? nullptr : &tiles.back();
        if (last && last->tokens < TILE_TOKENS && token_seq[t] == token_seq[last->first] &&
            token_ctx[t] == token_ctx[t - 1] + 1)
            ++last->tokens;
        else
            tiles.push_back({t, 1});
    }
    const int group = heads / kv_heads;
    // A work item takes all of a tile's KV heads where there are tiles enough to keep every thread busy: a key's
    // heads are adjacent in the cache, so one item then reads each block whole and in address order, which the
    // hardware prefetchers follow. Few tiles (a lone decode) are split per head to share them out.
    const int heads_per_item = int64_t(tiles.size()) >= ITEMS_PER_THREAD * threads ? kv_heads : 1;
    const int64_t per_tile = kv_heads / heads_per_item, items = int64_t(tiles.size()) * per_tile;
    const auto tile_kernel = spec.window ? attend_tile<T, C, CHUNKS, true> : attend_tile<T, C, CHUNKS, false>;
#pragma omp parallel num_threads(threads)
    {
        std::vector<f32x16> qv, acc, block;
        std::vector<float> scores, total;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const Tile& tile = tiles[item / per_tile];
            const int first_head = int(item % per_tile) * heads_per_item;
            for (int g = first_head; g < first_head + heads_per_item; ++g)
                tile_kernel(q + tile.first * q_row, q_row, k_cache, v_cache,
                            tables + int64_t(token_seq[tile.first]) * table_row, token_ctx + tile.first, tile.tokens,
                            g, group, kv_heads, head_dim, block_size, spec, out + tile.first * heads * head_dim,
                            int64_t(heads) * head_dim, qv, acc, block, scores, total);
        }
    }
}

}  // namespace

extern "C" {

// Write the step's new K and V into their cache slots, then attend: q [tokens, heads, head_dim] with row
// stride q_row (elements), k and v [tokens, kv_heads, head_dim] with row strides k_row and v_row, heads
// contiguous within a row, head_dim a multiple of 16 and at most 256 (the caller checks). Token t belongs to
// block-table row token_seq[t] and sees the first token_ctx[t] keys of it, or with a `window` (0: none) the
// last `window` of those. Scores are q.k * scale, then with a `softcap` (0: none) softcap * tanh(score /
// softcap). out: [tokens, heads, head_dim], contiguous. bf16: 2-byte elements, else fp32. kv_f16: the caches
// hold fp16 (k and v are converted as they are written), else the activations' type.
void headroom_paged_attention(int bf16, int kv_f16, const void* q, int64_t q_row, const void* k, int64_t k_row,
                              const void* v, int64_t v_row, const int64_t* slots, void* k_cache, void* v_cache,
                              const int32_t* tables, int64_t table_row, const int32_t* token_seq,
                              const int32_t* token_ctx, int64_t tokens, int heads, int kv_heads, int head_dim,
                              int block_size, float scale, int window, float softcap, void* out, int threads) {
    const Spec spec{scale, window, softcap};
    auto run = [&](auto activation, auto element) {
        using T = decltype(activation);
        using C = decltype(element);
        write_kv(static_cast<const T*>(k), static_cast<const T*>(v), k_row, v_row, slots, tokens, kv_heads,
                 head_dim, static_cast<C*>(k_cache), static_cast<C*>(v_cache));
        auto go = [&](auto chunks) {  // head sizes 64 and 128 unrolled, others at run time
            attend<T, C, decltype(chunks)::value>(static_cast<const T*>(q), q_row, static_cast<const C*>(k_cache),
                                                  static_cast<const C*>(v_cache), tables, table_row, token_seq,
                                                  token_ctx, tokens, heads, kv_heads, head_dim, block_size, spec,
                                                  static_cast<T*>(out), threads);
        };
        if (head_dim == 64)
            go(std::integral_constant<int, 4>{});
        else if (head_dim == 128)
            go(std::integral_constant<int, 8>{});
        else
            go(std::integral_constant<int, 0>{});
    };
    with_element_type(bf16, [&](auto zero) {
        if (kv_f16)
            run(zero, f16{});
        else
            run(zero, zero);
    });
}

}  // extern "C"
