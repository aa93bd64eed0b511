// duet's CPU kernels for an int8 KV cache, called from kernels/cpu_kv_int8.py through ctypes.
//
// Layout (kernels/kv_quant.py): a layer's K (or V) is int8 values [num_blocks, block_size, num_kv_heads, head_dim]
// and fp32 scales [num_blocks, block_size, num_kv_heads], both strided views of the one cache tensor (each page of a
// block holds its values, then their scales); strides in elements, a row's head_dim values contiguous, a row's
// heads' scales contiguous. value ≈ int8 × scale.
//
// Store: per token and KV head, scale = amax / 127 and q = nearbyintf(x / scale) (round half to even), clamped to
// ±127; a zero row gets scale 0 and zeros. kernels/kv_quant.py quantize_ref computes the same fp32 quotient and
// rounding: both write the same bytes.
//
// Decode attention: the fp32 kernel's tiles and task loop instantiated for int8 rows (attention_decode.inc): each
// K/V chunk is loaded as 8 int8 and converted to fp32 in registers, a dot is multiplied by its key's scale and a
// probability by its value's scale (the same products as dequantizing first, in another order), so decode reads a
// quarter of fp32's bytes and writes nothing back. Prefill attention (compute-bound): the fp32 task loop fed with
// a 256-key tile of one KV head dequantized into a per-thread buffer (attention_tiles.h's kv_rows_fn). Scores,
// softmax and accumulation are fp32 throughout, as in attention.c.
#include "attention_tiles.h"

typedef int8_t vb8 __attribute__((vector_size(8), aligned(1)));  // 8 int8 lanes, unaligned loads

// 8 int8 at p as 8 floats. GCC turns __builtin_convertvector of an 8-byte vector into 8 scalar byte loads (1,352
// movsbl in this file, and int8 decode ran at 0.68x fp32's speed): on x86 it is one sign-extending load and one
// conversion by intrinsics.
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 load8_i8(const int8_t *p) {
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline v8 load8_i8(const int8_t *p) { return __builtin_convertvector(*(const vb8 *)p, v8); }
#endif

typedef struct {  // one layer's int8 K and V with their scales (strides in elements)
    const int8_t *k, *v;
    const float *ks, *vs;
    int64_t k_b, k_t, k_h, v_b, v_t, v_h;  // values [block, token, head] (+ head_dim contiguous)
    int64_t ks_b, ks_t, vs_b, vs_t;        // scales [block, token] (+ heads contiguous)
    int head_dim;                          // a multiple of 8
} kv_i8_t;

// dst[0:D] = src[0:D] * scale (D a multiple of 8)
// the rows' scale pointers of keys [t0, t0 + n) (K and V, head 0: head h's scale is p[h]), a block at a time
static inline void da_scale_rows(const kv_i8_t *c, const int32_t *table, int block_size, int t0, int n,
                                 const float **ksrow, const float **vsrow) {
    for (int t = 0; t < n; t++) {
        int pos = t0 + t, off = pos % block_size;
        int64_t b = table[pos / block_size];
        ksrow[t] = c->ks + b * c->ks_b + off * c->ks_t;
        vsrow[t] = c->vs + b * c->vs_b + off * c->vs_t;
    }
}

// decode attention's tiles and task loop on int8 rows (da_qk_i8, da_pv_i8, da_rows_of_i8, da_heads_impl_i8)
#define DA_T int8_t
#define DA_SFX(f) f##_i8
#define DA_LOAD8(p) load8_i8(p)
#define DA_SCALED 1
#define DA_SRC kv_i8_t
#include "attention_decode.inc"
#undef DA_T
#undef DA_SFX
#undef DA_LOAD8
#undef DA_SCALED
#undef DA_SRC

static inline void dequant_row(float *restrict dst, const int8_t *restrict src, float scale, int D) {
    for (int d = 0; d < D; d += 8) *(v8 *)(dst + d) = load8_i8(src + d) * scale;
}

// kv_rows_fn of an int8 cache (prefill): keys [t0, t0 + n) of heads [h0, h1) dequantized into buf, K rows [n][h1 - h0][D]
// then V rows likewise; the row pointers point there.
static inline void rows_i8(const void *src, const int32_t *table, int block_size, int t0, int n, int h0, int h1,
                           const float **krow, const float **vrow, int64_t *k_h, int64_t *v_h, float *buf) {
    const kv_i8_t *c = src;
    const int D = c->head_dim, H = h1 - h0;
    float *kf = buf, *vf = buf + (size_t)n * H * D;
    for (int t = 0; t < n; t++) {
        int pos = t0 + t, off = pos % block_size;
        int64_t b = table[pos / block_size];
        const int8_t *kq = c->k + b * c->k_b + off * c->k_t, *vq = c->v + b * c->v_b + off * c->v_t;
        const float *ks = c->ks + b * c->ks_b + off * c->ks_t, *vs = c->vs + b * c->vs_b + off * c->vs_t;
        float *kr = kf + (size_t)t * H * D, *vr = vf + (size_t)t * H * D;
        for (int h = h0; h < h1; h++) {
            dequant_row(kr + (size_t)(h - h0) * D, kq + h * c->k_h, ks[h], D);
            dequant_row(vr + (size_t)(h - h0) * D, vq + h * c->v_h, vs[h], D);
        }
        krow[t] = kr;
        vrow[t] = vr;
    }
    *k_h = D;
    *v_h = D;
}

static void da_heads_i8(const void *src, const float *Q, float *O, int h0, int h1, int group, const int32_t *table,
                        int block_size, int lo, int hi, int D, float *S, float *m, float *l, const void **ptrs) {
#define DA(d) da_heads_impl_i8(src, Q, O, h0, h1, group, table, block_size, lo, hi, d, S, m, l, ptrs)
    switch (D) {  // the common head sizes get their own unrolled copy, as in attention.c
        case 64: DA(64); break;
        case 128: DA(128); break;
        default: DA(D);
    }
#undef DA
}

static void pf_task_i8(const void *src, const pf_task_t *task, const pf_args_t *a, float *buf, int *ibuf,
                       const float **krow, const float **vrow, float *rows_buf) {
    pf_task_impl(rows_i8, src, task, a, buf, ibuf, krow, vrow, rows_buf);
}

// One query token per sequence at position seq_lens[s] - 1 (its K/V already stored), head_dim a multiple of 8;
// tasks and chunks as duet_decode_attention_f32's. Returns 0, or -1 if a scratch allocation failed.
int duet_decode_attention_i8(const float *q, int64_t q_s, int64_t q_h, const int8_t *k, int64_t k_b, int64_t k_t,
                             int64_t k_h, const float *ks, int64_t ks_b, int64_t ks_t, const int8_t *v, int64_t v_b,
                             int64_t v_t, int64_t v_h, const float *vs, int64_t vs_b, int64_t vs_t,
                             const int32_t *tables, int64_t tab_s, const int32_t *seq_lens, float *out, int64_t o_s,
                             int64_t o_h, int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                             int block_size, float scale, int window, int num_threads) {
    const kv_i8_t src = {k, v, ks, vs, k_b, k_t, k_h, v_b, v_t, v_h, ks_b, ks_t, vs_b, vs_t, head_dim};
    return da_decode(&src, da_heads_i8, q, q_s, q_h, tables, tab_s, seq_lens, out, o_s, o_h, num_seqs,
                     num_q_heads, num_kv_heads, head_dim, block_size, scale, window, num_threads);
}

// Prefill attention (duet_prefill_attention_f32's contract) over an int8 cache, head_dim a multiple of 8.
// Returns 0, or -1 if an allocation failed.
int duet_prefill_attention_i8(const float *q, int64_t q_s, int64_t q_h, const int8_t *k, int64_t k_b, int64_t k_t,
                              int64_t k_h, const float *ks, int64_t ks_b, int64_t ks_t, const int8_t *v, int64_t v_b,
                              int64_t v_t, int64_t v_h, const float *vs, int64_t vs_b, int64_t vs_t,
                              const int32_t *tables, int64_t tab_s, const int32_t *cu, const int32_t *seq_lens,
                              float *out, int64_t o_s, int64_t o_h, int num_seqs, int num_q_heads, int num_kv_heads,
                              int head_dim, int block_size, float scale, int window, int num_threads) {
    const kv_i8_t src = {k, v, ks, vs, k_b, k_t, k_h, v_b, v_t, v_h, ks_b, ks_t, vs_b, vs_t, head_dim};
    const pf_args_t a = {q, q_s, q_h, tables, tab_s, cu, seq_lens, out, o_s, o_h, num_q_heads / num_kv_heads,
                         head_dim, block_size, window, scale};
    return pf_prefill(&src, pf_task_i8, 1, &a, num_seqs, num_q_heads, num_kv_heads, num_threads);
}

// One row of `heads` heads of head_dim values (contiguous, row of x) into int8 values (head h at q + h * q_h) and
// scales (head h at s[h]).
static inline void quantize_row(const float *restrict x, int heads, int head_dim, int8_t *restrict q, int64_t q_h,
                                float *restrict s) {
    for (int h = 0; h < heads; h++) {
        const float *xh = x + (int64_t)h * head_dim;
        int8_t *qh = q + h * q_h;
        float amax = 0.0f;
        for (int d = 0; d < head_dim; d++) amax = fmaxf(amax, fabsf(xh[d]));
        float scale = amax / 127.0f;
        s[h] = scale;
        if (scale == 0.0f) {
            memset(qh, 0, head_dim);
            continue;
        }
        for (int d = 0; d < head_dim; d++) {
            float r = nearbyintf(xh[d] / scale);
            qh[d] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
    }
}

// Each new token's K and V rows (heads * head_dim floats, contiguous within a row; row stride k_s / v_s) quantized
// into its cache slot (block * block_size + offset); slot -1 = skip (a padding token).
void duet_store_kv_i8(const float *k, int64_t k_s, const float *v, int64_t v_s, int8_t *kc, int64_t kc_b,
                      int64_t kc_t, int64_t kc_h, float *ksc, int64_t ksc_b, int64_t ksc_t, int8_t *vc, int64_t vc_b,
                      int64_t vc_t, int64_t vc_h, float *vsc, int64_t vsc_b, int64_t vsc_t, const int64_t *slots,
                      int64_t num_tokens, int block_size, int heads, int head_dim) {
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        int64_t b = slot / block_size, off = slot % block_size;
        quantize_row(k + t * k_s, heads, head_dim, kc + b * kc_b + off * kc_t, kc_h, ksc + b * ksc_b + off * ksc_t);
        quantize_row(v + t * v_s, heads, head_dim, vc + b * vc_b + off * vc_t, vc_h, vsc + b * vsc_b + off * vsc_t);
    }
}
