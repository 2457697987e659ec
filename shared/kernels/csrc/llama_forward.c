/*
 * The decoder stack's float32 CPU forward as one call: per layer the add-and-norm, the q|k|v
 * projection, RoPE, the KV write, paged attention, the output projection, the second add-and-norm,
 * gate|up, SiLU x up and the down projection, then the final norm. The KV cache is float32 or bfloat16. The same kernels as the model's
 * Python path, in the same order; the projections run on gemm.c's kernel, as the Python path's do, or
 * (where the caller passes it) on the BLAS ``sgemm_`` that torch's own ``F.linear`` calls, with the same
 * arguments, so results are bit-identical either way.
 *
 * Being one call, it holds no interpreter lock while it runs: the worker's event loop streams the
 * previous step's tokens on the other core meanwhile instead of waiting for the step's Python.
 */
#include <stdint.h>
#include <string.h>

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

/* The kernels of this library (fused_ops.c, mlp_ops.c, paged_decode.c, paged_prefill.c). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t out_stride,
                  int num_rows, int size, float eps);
void add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t residual_stride,
                      const float *weight, float *out, int64_t out_stride, int num_rows, int size, float eps);
void rope_f32(float *qk, int64_t row_stride, int num_tokens, int num_heads_total, int head_dim,
              const float *cos_rows, const float *sin_rows);
void silu_mul_f32(const float *gate_up, int64_t row_stride, float *out, int num_tokens, int size);
void write_kv_f32(const float *key, const float *value, int64_t key_stride, int64_t value_stride, float *k_cache,
                  float *v_cache, int64_t block_stride, int64_t row_stride, const int64_t *slot_mapping,
                  int num_tokens, int row_elems, int block_size);
int paged_decode_f32(const float *q, float *out, const float *k_cache, const float *v_cache, int64_t block_stride,
                     int64_t row_stride, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int max_seq_len);
int paged_prefill_f32(const float *q, float *out, const float *k_cache, const float *v_cache, int64_t block_stride,
                      int64_t row_stride, const int32_t *block_tables, int64_t bt_stride,
                      const int32_t *query_start_loc, const int32_t *seq_lens, int num_seqs, int num_heads,
                      int num_kv_heads, int head_dim, int block_size, float scale);
/* Their builds for the narrower caches (paged_decode_bf16.c, paged_prefill_bf16.c, and the e4m3 and e5m2 files). */
#define NARROW_KV_KERNELS(KV_T, SUFFIX)                                                                               \
    void write_kv_##SUFFIX(const float *key, const float *value, int64_t key_stride, int64_t value_stride,          \
                           KV_T *k_cache, KV_T *v_cache, int64_t block_stride, int64_t row_stride,                   \
                           const int64_t *slot_mapping, int num_tokens, int row_elems, int block_size);             \
    int paged_decode_##SUFFIX(const float *q, float *out, const KV_T *k_cache, const KV_T *v_cache,                 \
                              int64_t block_stride, int64_t row_stride, const int32_t *block_tables,                 \
                              int64_t bt_stride, const int32_t *seq_lens, int num_seqs, int num_heads,               \
                              int num_kv_heads, int head_dim, int block_size, float scale, int max_seq_len);         \
    int paged_prefill_##SUFFIX(const float *q, float *out, const KV_T *k_cache, const KV_T *v_cache,                \
                               int64_t block_stride, int64_t row_stride, const int32_t *block_tables,                \
                               int64_t bt_stride, const int32_t *query_start_loc, const int32_t *seq_lens,          \
                               int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,          \
                               float scale);
NARROW_KV_KERNELS(uint16_t, bf16)
NARROW_KV_KERNELS(uint8_t, e4m3)
NARROW_KV_KERNELS(uint8_t, e5m2)
#undef NARROW_KV_KERNELS

typedef struct {
    /* The projections' weights NULL where the model holds them only as their AMX copies (below). */
    const float *qkv_weight, *o_weight, *gate_up_weight, *down_weight, *input_norm, *post_norm;
    /* The projections' packed copies (gemm.c's linear_f32_pack), each NULL where there is none. */
    const float *qkv_packed, *o_packed, *gate_up_packed, *down_packed;
    /* Their AMX copies (amx.c's linear_amx_pack, for bfloat16-valued weights), each NULL where there is none. */
    const uint16_t *qkv_amx, *o_amx, *gate_up_amx, *down_amx;
    float input_eps, post_eps;
} LayerWeights;

typedef struct {
    sgemm_fn sgemm; /* NULL: gemm.c's linear_f32 */
    int num_tokens, hidden, q_size, kv_size, intermediate, num_heads, num_kv_heads, head_dim, num_layers;
    int block_size, num_seqs, max_seq_len, is_decode, kv_kind; /* kv.h's KV_KIND of the cache */
    float scale, final_eps;
    const float *final_norm;
    void *kv_cache;                                    /* [blocks, layers, 2, block_size, kv_heads, head_dim] */
    int64_t block_stride, row_stride, layer_stride, value_offset; /* in elements */
    const int64_t *slot_mapping;
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    int64_t bt_stride;
    const float *cos, *sin; /* [T, head_dim] */
    float *residual;        /* [T, hidden]: the embeddings in, the residual stream after (updated in place) */
    float *out;             /* [T, hidden]: the final norm's output */
    float *scratch;         /* see llama_forward_scratch_floats */
} ForwardArgs;

void linear_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int m, int n, int k);
void linear_f32_packed(const float *x, int64_t ldx, const float *packed, float *y, int64_t ldy, int m, int n, int k);
int linear_amx(const float *x, int64_t ldx, const uint16_t *packed, float *y, int64_t ldy, int m, int n, int k);

#define LINEAR_DECLINED 16 /* a status no attention kernel returns */

/* y[M, N] = x[M, K] . w[N, K]^T: on gemm.c's kernel where no BLAS is given (from w's packed copy where
 * there is one, as the model's Python path then does), else called as torch's CPU linear calls BLAS
 * (column-major, w transposed); on AMX where the weight has an AMX copy. 0, or LINEAR_DECLINED where that
 * copy is all there is (w NULL) and linear_amx could not run. */
static int linear(sgemm_fn sgemm, const float *x, const float *w, const float *packed, const uint16_t *amx,
                  float *y, int m, int n, int k) {
    if (amx != NULL && linear_amx(x, k, amx, y, n, m, n, k) == 0) return 0; /* as the Python path does */
    if (w == NULL) return LINEAR_DECLINED; /* a weight held only as its bfloat16 copy: the Python path unpacks it */
    if (sgemm == NULL) {
        if (packed != NULL)
            linear_f32_packed(x, k, packed, y, n, m, n, k);
        else
            linear_f32(x, k, w, y, n, m, n, k);
        return 0;
    }
    const char transa = 't', transb = 'n';
    const float alpha = 1.f, beta = 0.f;
    sgemm(&transa, &transb, &n, &m, &k, &alpha, w, &k, x, &k, &beta, y, &n);
    return 0;
}

/* The layer's KV write and paged attention, for a cache of float32 (KV_T float, suffix f32), bfloat16 or float8. */
#define ATTENTION(KV_T, SUFFIX)                                                                                        \
    static int attention_##SUFFIX(const ForwardArgs *a, int l, const float *qkv, const float *q, float *attn) {      \
        const int qkv_dim = a->q_size + 2 * a->kv_size;                                                               \
        KV_T *k_cache = (KV_T *)a->kv_cache + (int64_t)l * a->layer_stride, *v_cache = k_cache + a->value_offset;    \
        write_kv_##SUFFIX(qkv + a->q_size, qkv + a->q_size + a->kv_size, qkv_dim, qkv_dim, k_cache, v_cache,         \
                          a->block_stride, a->row_stride, a->slot_mapping, a->num_tokens, a->kv_size, a->block_size); \
        return a->is_decode ? paged_decode_##SUFFIX(q, attn, k_cache, v_cache, a->block_stride, a->row_stride,        \
                                                    a->block_tables, a->bt_stride, a->seq_lens, a->num_seqs,           \
                                                    a->num_heads, a->num_kv_heads, a->head_dim, a->block_size,         \
                                                    a->scale, a->max_seq_len)                                          \
                            : paged_prefill_##SUFFIX(q, attn, k_cache, v_cache, a->block_stride, a->row_stride,       \
                                                     a->block_tables, a->bt_stride, a->query_start_loc, a->seq_lens,   \
                                                     a->num_seqs, a->num_heads, a->num_kv_heads, a->head_dim,          \
                                                     a->block_size, a->scale);                                         \
    }
ATTENTION(float, f32)
ATTENTION(uint16_t, bf16)
ATTENTION(uint8_t, e4m3)
ATTENTION(uint8_t, e5m2)
#undef ATTENTION

/* Floats of scratch the forward needs for num_tokens tokens. */
int64_t llama_forward_scratch_floats(int num_tokens, int hidden, int q_size, int kv_size, int intermediate) {
    const int64_t t = num_tokens;
    return t * (3 * (int64_t)hidden + (q_size + 2 * (int64_t)kv_size) + 2 * (int64_t)q_size + 3 * (int64_t)intermediate);
}

/* Returns 0, or the attention kernel's status or LINEAR_DECLINED (the layers before it have run, the residual is
 * spent). */
int llama_forward_f32(const ForwardArgs *a, const LayerWeights *layers) {
    const int t = a->num_tokens, h = a->hidden, qkv_dim = a->q_size + 2 * a->kv_size, inter = a->intermediate;
    float *normed = a->scratch, *qkv = normed + (int64_t)t * h, *q = qkv + (int64_t)t * qkv_dim;
    float *attn = q + (int64_t)t * a->q_size, *o = attn + (int64_t)t * a->q_size, *gate_up = o + (int64_t)t * h;
    float *act = gate_up + (int64_t)t * 2 * inter, *mlp_out = act + (int64_t)t * inter;
    for (int l = 0; l < a->num_layers; l++) {
        const LayerWeights *w = &layers[l];
        if (l == 0)
            rms_norm_f32(a->residual, h, w->input_norm, normed, h, t, h, w->input_eps);
        else
            add_rms_norm_f32(mlp_out, h, a->residual, h, w->input_norm, normed, h, t, h, w->input_eps);
        int status = linear(a->sgemm, normed, w->qkv_weight, w->qkv_packed, w->qkv_amx, qkv, t, qkv_dim, h);
        if (status != 0) return status;
        rope_f32(qkv, qkv_dim, t, a->num_heads + a->num_kv_heads, a->head_dim, a->cos, a->sin);
        for (int i = 0; i < t; i++) memcpy(q + (int64_t)i * a->q_size, qkv + (int64_t)i * qkv_dim, sizeof(float) * (size_t)a->q_size);
        switch (a->kv_kind) {
        case 1: status = attention_bf16(a, l, qkv, q, attn); break;
        case 2: status = attention_e4m3(a, l, qkv, q, attn); break;
        case 3: status = attention_e5m2(a, l, qkv, q, attn); break;
        default: status = attention_f32(a, l, qkv, q, attn);
        }
        if (status != 0) return status;
        status = linear(a->sgemm, attn, w->o_weight, w->o_packed, w->o_amx, o, t, h, a->q_size);
        if (status != 0) return status;
        add_rms_norm_f32(o, h, a->residual, h, w->post_norm, normed, h, t, h, w->post_eps);
        status = linear(a->sgemm, normed, w->gate_up_weight, w->gate_up_packed, w->gate_up_amx, gate_up, t, 2 * inter, h);
        if (status != 0) return status;
        silu_mul_f32(gate_up, 2 * inter, act, t, inter);
        status = linear(a->sgemm, act, w->down_weight, w->down_packed, w->down_amx, mlp_out, t, h, inter);
        if (status != 0) return status;
    }
    if (a->num_layers == 0)
        rms_norm_f32(a->residual, h, a->final_norm, a->out, h, t, h, a->final_eps);
    else
        add_rms_norm_f32(mlp_out, h, a->residual, h, a->final_norm, a->out, h, t, h, a->final_eps);
    return 0;
}
