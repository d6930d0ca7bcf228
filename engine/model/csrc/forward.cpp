// All the decoder layers of one step in one call: the kernels engine/model/llama.py `DecoderLayer.forward`
// calls, in its order, on the same inputs, so the hidden states are bitwise the same, for every dense family
// (what a family adds, a bias, head norms, sandwich norms, is skipped where its weight is null, so Llama pays
// nothing for it). What goes is the Python between them (nine kernel calls a layer, views, splits): at one
// decode stream of the default model, about a quarter of the step (bench/results/cpu_vs_peers.md).
//
// The buffers are the caller's (torch tensors, so the CPU probe counts them as the step's memory, as it counts
// the Python path's); the residual stream x is updated in place (each kernel reads an element before it writes
// it), so one buffer of each kind serves every layer.
#include <cstdint>

extern "C" {
void headroom_rms_norm(int bf16, const void* x, const void* residual, void* sum_out, const void* weight, void* out,
                       int64_t rows, int dim, float eps, int threads);
void headroom_head_norms(int bf16, void* x, int64_t row_stride, int64_t rows, int q_heads, int kv_heads,
                         int head_dim, const void* q_weight, const void* k_weight, float eps, int threads);
void headroom_add_bias(int bf16, void* x, int64_t rows, int width, const void* bias, int threads);
void headroom_rope(int bf16, void* x, int64_t row_stride, int64_t rows, int heads, int head_dim, const void* cos,
                   const void* sin, const int64_t* positions, int threads);
void headroom_silu_mul(int bf16, const void* gate_up, void* out, int64_t rows, int width, int threads);
void headroom_gelu_tanh_mul(int bf16, const void* gate_up, void* out, int64_t rows, int width, int threads);
void headroom_paged_attention(int bf16, int kv_f16, const void* q, int64_t q_row, const void* k, int64_t k_row,
                              const void* v, int64_t v_row, const int64_t* slots, void* k_cache, void* v_cache,
                              const int32_t* tables, int64_t table_row, const int32_t* token_seq,
                              const int32_t* token_ctx, int64_t tokens, int heads, int kv_heads, int head_dim,
                              int block_size, float scale, int window, float softcap, void* out, int threads);
void headroom_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t m, int64_t n,
                          int64_t k, int threads);
void headroom_linear_f32(const float* x, int64_t ldx, const float* w, float* y, int64_t m, int64_t n, int64_t k,
                         int threads);
void headroom_qlinear(int x_bf16, const void* x, int64_t ldx, const uint8_t* w, int bits, int y_bf16, void* y,
                      int64_t m, int64_t n, int64_t k, int plain, int threads);
}

namespace {

// One decoder layer, as engine/model/cpu_forward.py `Layer` lays it out (a ctypes Structure: keep the two in
// step). A weight the family does not have is null.
struct Layer {
    const void *attn_norm, *mlp_norm, *qkv, *o, *gate_up, *down;
    const void *qkv_bias, *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
    void *k_cache, *v_cache;
    int32_t kinds[4];  // qkv, o, gate_up, down: 0 the float kernel's packing (bf16 or fp32), 4 or 8 quantized bits
    int32_t window;    // keys a token sees (0: all before it)
    int32_t local;     // RoPE from the sliding layers' own tables (Gemma 3)
    float scale, softcap;  // softcap 0: none
};

// One step, as engine/model/cpu_forward.py `Step` lays it out (a ctypes Structure: keep the two in step).
struct Step {
    int64_t tokens, hidden, q_size, kv_size, heads, kv_heads, head_dim, inter, block_size, layers, table_row;
    float eps;
    int32_t bf16, kv_f16, threads, gelu;  // kv_f16: the KV caches hold fp16; gelu: the MLP's activation is
                                          // gelu_tanh, else SiLU
    const int64_t* positions;
    const void *cos, *sin, *cos_local, *sin_local;
    const int64_t* slots;
    const int32_t* tables;
    const int32_t* token_seq;
    const int32_t* token_ctx;
    const Layer* layer;  // [layers]
    void *x, *delta, *h, *qkv, *attn, *proj, *gate_up, *act;  // [tokens][width] each
};

void linear(const Step& s, const void* x, int64_t k, const void* w, int kind, void* y, int64_t n) {
    if (kind == 0 && s.bf16)
        headroom_linear_bf16(static_cast<const uint16_t*>(x), k, static_cast<const uint16_t*>(w),
                             static_cast<uint16_t*>(y), s.tokens, n, k, s.threads);
    else if (kind == 0)
        headroom_linear_f32(static_cast<const float*>(x), k, static_cast<const float*>(w), static_cast<float*>(y),
                            s.tokens, n, k, s.threads);
    else
        headroom_qlinear(s.bf16, x, k, static_cast<const uint8_t*>(w), kind, s.bf16, y, s.tokens, n, k, 0, s.threads);
}

// x [tokens, hidden] normalized in place with `weight` (no residual): Gemma's norms after attention and MLP.
void norm_in_place(const Step& s, void* x, const void* weight) {
    headroom_rms_norm(s.bf16, x, nullptr, nullptr, weight, x, s.tokens, int(s.hidden), s.eps, s.threads);
}

}  // namespace

extern "C" {

// x: the embeddings in, the residual stream out; delta: the last layer's MLP output, still to be added (as
// LlamaModel.forward leaves it for the final norm).
void headroom_decoder_layers(const Step* step) {
    const Step& s = *step;
    const int64_t elem = s.bf16 ? 2 : 4, qkv_row = s.q_size + 2 * s.kv_size;
    char* qkv = static_cast<char*>(s.qkv);
    for (int64_t l = 0; l < s.layers; ++l) {
        const Layer& layer = s.layer[l];
        headroom_rms_norm(s.bf16, s.x, l ? s.delta : nullptr, l ? s.x : nullptr, layer.attn_norm, s.h, s.tokens,
                          int(s.hidden), s.eps, s.threads);
        linear(s, s.h, s.hidden, layer.qkv, layer.kinds[0], s.qkv, qkv_row);
        if (layer.qkv_bias) headroom_add_bias(s.bf16, s.qkv, s.tokens, int(qkv_row), layer.qkv_bias, s.threads);
        if (layer.q_norm)
            headroom_head_norms(s.bf16, s.qkv, qkv_row, s.tokens, int(s.heads), int(s.kv_heads), int(s.head_dim),
                                layer.q_norm, layer.k_norm, s.eps, s.threads);
        headroom_rope(s.bf16, s.qkv, qkv_row, s.tokens, int(s.heads + s.kv_heads), int(s.head_dim),
                      layer.local ? s.cos_local : s.cos, layer.local ? s.sin_local : s.sin, s.positions, s.threads);
        headroom_paged_attention(s.bf16, s.kv_f16, qkv, qkv_row, qkv + s.q_size * elem, qkv_row,
                                 qkv + (s.q_size + s.kv_size) * elem, qkv_row, s.slots, layer.k_cache, layer.v_cache,
                                 s.tables, s.table_row, s.token_seq, s.token_ctx, s.tokens, int(s.heads),
                                 int(s.kv_heads), int(s.head_dim), int(s.block_size), layer.scale, layer.window,
                                 layer.softcap, s.attn, s.threads);
        linear(s, s.attn, s.q_size, layer.o, layer.kinds[1], s.proj, s.hidden);
        if (layer.post_attn_norm) norm_in_place(s, s.proj, layer.post_attn_norm);
        headroom_rms_norm(s.bf16, s.proj, s.x, s.x, layer.mlp_norm, s.h, s.tokens, int(s.hidden), s.eps, s.threads);
        linear(s, s.h, s.hidden, layer.gate_up, layer.kinds[2], s.gate_up, 2 * s.inter);
        (s.gelu ? headroom_gelu_tanh_mul : headroom_silu_mul)(s.bf16, s.gate_up, s.act, s.tokens, int(s.inter),
                                                              s.threads);
        linear(s, s.act, s.inter, layer.down, layer.kinds[3], s.delta, s.hidden);
        if (layer.post_mlp_norm) norm_in_place(s, s.delta, layer.post_mlp_norm);
    }
}

}  // extern "C"
