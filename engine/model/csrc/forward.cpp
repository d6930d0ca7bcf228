// All the decoder layers of one step in one call: the kernels engine/model/llama.py `DecoderLayer.forward`
// calls, in its order, on the same inputs, so the hidden states are bitwise the same. What goes is the
// Python between them (nine kernel calls a layer, views, splits): at one decode stream of the default model,
// about a quarter of the step (bench/results/cpu_vs_peers.md).
//
// The buffers are the caller's (torch tensors, so the CPU probe counts them as the step's memory, as it counts
// the Python path's); the residual stream x is updated in place (each kernel reads an element before it writes
// it), so one buffer of each kind serves every layer.
#include <cstdint>

extern "C" {
void headroom_rms_norm(int bf16, const void* x, const void* residual, void* sum_out, const void* weight, void* out,
                       int64_t rows, int dim, float eps, int threads);
void headroom_rope(int bf16, void* x, int64_t row_stride, int64_t rows, int heads, int head_dim, const void* cos,
                   const void* sin, const int64_t* positions, int threads);
void headroom_silu_mul(int bf16, const void* gate_up, void* out, int64_t rows, int width, int threads);
void headroom_paged_attention(int bf16, const void* q, int64_t q_row, const void* k, int64_t k_row, const void* v,
                              int64_t v_row, const int64_t* slots, void* k_cache, void* v_cache,
                              const int32_t* tables, int64_t table_row, const int32_t* token_seq,
                              const int32_t* token_ctx, int64_t tokens, int heads, int kv_heads, int head_dim,
                              int block_size, float scale, void* out, int threads);
void headroom_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t m, int64_t n,
                          int64_t k, int threads);
void headroom_linear_f32(const float* x, int64_t ldx, const float* w, float* y, int64_t m, int64_t n, int64_t k,
                         int threads);
void headroom_qlinear(int x_bf16, const void* x, int64_t ldx, const uint8_t* w, int bits, int y_bf16, void* y,
                      int64_t m, int64_t n, int64_t k, int plain, int threads);
}

namespace {

// One step, as engine/model/cpu_forward.py `Step` lays it out (a ctypes Structure: keep the two in step).
struct Step {
    int64_t tokens, hidden, q_size, kv_size, heads, kv_heads, head_dim, inter, block_size, layers, table_row;
    float eps, scale;
    int32_t bf16, threads;
    const int64_t* positions;
    const void* cos;
    const void* sin;
    const int64_t* slots;
    const int32_t* tables;
    const int32_t* token_seq;
    const int32_t* token_ctx;
    const int64_t* weights;  // [layers][8]: attn_norm, mlp_norm, qkv, o, gate_up, down, k cache, v cache
    const int32_t* kinds;    // [layers][4]: 0 the float kernel's packing (bf16 or fp32), 4 or 8 quantized bits
    void *x, *delta, *h, *qkv, *attn, *proj, *gate_up, *act;  // [tokens][width] each
};

const void* ptr(int64_t address) { return reinterpret_cast<const void*>(address); }

void linear(const Step& s, const void* x, int64_t k, int64_t address, int kind, void* y, int64_t n) {
    if (kind == 0 && s.bf16)
        headroom_linear_bf16(static_cast<const uint16_t*>(x), k, static_cast<const uint16_t*>(ptr(address)),
                             static_cast<uint16_t*>(y), s.tokens, n, k, s.threads);
    else if (kind == 0)
        headroom_linear_f32(static_cast<const float*>(x), k, static_cast<const float*>(ptr(address)),
                            static_cast<float*>(y), s.tokens, n, k, s.threads);
    else
        headroom_qlinear(s.bf16, x, k, static_cast<const uint8_t*>(ptr(address)), kind, s.bf16, y, s.tokens, n, k, 0,
                         s.threads);
}

}  // namespace

extern "C" {

// x: the embeddings in, the residual stream out; delta: the last layer's MLP output, still to be added (as
// LlamaModel.forward leaves it for the final norm).
void headroom_decoder_layers(const Step* step) {
    const Step& s = *step;
    const int64_t elem = s.bf16 ? 2 : 4, qkv_row = s.q_size + 2 * s.kv_size;
    const char* qkv = static_cast<const char*>(s.qkv);
    for (int64_t l = 0; l < s.layers; ++l) {
        const int64_t* w = s.weights + l * 8;
        const int32_t* kind = s.kinds + l * 4;
        headroom_rms_norm(s.bf16, s.x, l ? s.delta : nullptr, l ? s.x : nullptr, ptr(w[0]), s.h, s.tokens,
                          int(s.hidden), s.eps, s.threads);
        linear(s, s.h, s.hidden, w[2], kind[0], s.qkv, qkv_row);
        headroom_rope(s.bf16, s.qkv, qkv_row, s.tokens, int(s.heads + s.kv_heads), int(s.head_dim), s.cos, s.sin,
                      s.positions, s.threads);
        headroom_paged_attention(s.bf16, qkv, qkv_row, qkv + s.q_size * elem, qkv_row,
                                 qkv + (s.q_size + s.kv_size) * elem, qkv_row, s.slots,
                                 const_cast<void*>(ptr(w[6])), const_cast<void*>(ptr(w[7])), s.tables, s.table_row,
                                 s.token_seq, s.token_ctx, s.tokens, int(s.heads), int(s.kv_heads), int(s.head_dim),
                                 int(s.block_size), s.scale, s.attn, s.threads);
        linear(s, s.attn, s.q_size, w[3], kind[1], s.proj, s.hidden);
        headroom_rms_norm(s.bf16, s.proj, s.x, s.x, ptr(w[1]), s.h, s.tokens, int(s.hidden), s.eps, s.threads);
        linear(s, s.h, s.hidden, w[4], kind[2], s.gate_up, 2 * s.inter);
        headroom_silu_mul(s.bf16, s.gate_up, s.act, s.tokens, int(s.inter), s.threads);
        linear(s, s.act, s.inter, w[5], kind[3], s.delta, s.hidden);
    }
}

}  // extern "C"
