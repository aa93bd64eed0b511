// What duet's CPU attention kernels share (attention.c: fp32 caches; attention_kv8.c: int8 caches): the vector
// helpers, the online-softmax step, the drivers' interfaces (da_decode, pf_prefill), and prefill's register tiles
// and task loop, generic in where a tile's K/V rows come from (kv_rows_fn: row pointers straight into an fp32 cache,
// or rows dequantized into a buffer; always_inline with the rows function a constant at each instantiation, so the
// call is inlined and the fp32 path compiles as before). Decode's tiles are a template per element type
// (attention_decode.inc).
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VEC_LANES 8
#define VEC_F v8
#define VEC_I vi8
#define VEC_NAME(f) v8##f
#include "vexp.h"

static inline float hsum8(v8 x) {
    float s0 = (x[0] + x[4]) + (x[2] + x[6]), s1 = (x[1] + x[5]) + (x[3] + x[7]);
    return s0 + s1;
}

// A sequence's new tokens' K/V as computed (prefill's fresh K/V: kernels/prefill_attention.py): position p >= first
// is row p - first of k / v (row stride k_t / v_t, head h at h * k_h / h * v_h elements on), read instead of the cache.
typedef struct {
    const float *k, *v;  // the row of position `first`, head 0
    int64_t k_t, k_h, v_t, v_h;
    int first;
} kv_new_t;

// Row pointers of keys [t0, t0 + n) of KV heads [h0, h1) of one sequence (table: its block table), K and V:
// krow[t] / vrow[t] point at head h0's row, the next heads *k_h / *v_h elements on. A source that stores no fp32
// rows (an int8 cache) dequantizes them into buf (room for 2 * n * (h1 - h0) * head_dim floats: K, then V). nw: the
// sequence's fresh rows, or NULL; a source that reads them points the rows of positions >= nw->first at them (one
// head per call then, h1 = h0 + 1: *k_h / *v_h do not describe both kinds of rows).
typedef void (*kv_rows_fn)(const void *src, const kv_new_t *nw, const int32_t *table, int block_size, int t0, int n,
                           int h0, int h1, const float **krow, const float **vrow, int64_t *k_h, int64_t *v_h,
                           float *buf);

// ------------------------------------------------------------------------------------------ decode attention
//
// One task per sequence (per KV head of one when there are fewer sequences than twice the threads); keys in
// tiles of DA_TILE with an online softmax between tiles; per tile QKᵀ of every KV head (K rows in address
// order), the softmax step, then PV, while the next tile is prefetched. Each K row is loaded once for the KV
// head's query group (up to 4 heads at a time: three dots of 8-lane partial sums for a group of 3), eight
// keys' partial sums are reduced together (a transposing add tree instead of one horizontal sum per dot), and
// each V row once for all the group's accumulators. head_dim a multiple of 8 (attend_rows above serves the rest).

#define DA_TILE 16  // keys per tile (measured best of 8-128 on a 2-core Zen 4: 1.45x the per-block kernel)
#define DA_PF 1      // prefetch the next tile into L2 (prefetcht2): into L1 it evicts the tile at work

typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

// [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
#ifdef __clang__
#define DA_SHUF(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define DA_SHUF(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shuffle(a, b, (vi8){i0, i1, i2, i3, i4, i5, i6, i7})
#endif
static inline v8 da_hadd(v8 a, v8 b) {
    return DA_SHUF(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + DA_SHUF(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// lane j = the sum of p[j]'s lanes
static inline v8 da_reduce8(const v8 *p) {
    v8 x = da_hadd(da_hadd(p[0], p[1]), da_hadd(p[2], p[3]));
    v8 y = da_hadd(da_hadd(p[4], p[5]), da_hadd(p[6], p[7]));
    return DA_SHUF(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + DA_SHUF(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
}

// the online-softmax step of one row over a tile: new running max, rescale of O and l, S -> exp(S - max)
static inline void da_softmax_row(float *restrict sr, int nt8, float *m, float *l, float *restrict o, int D) {
    v8 vm = *(v8 *)sr;
    for (int t = 8; t < nt8; t += 8) vm = v8sel(*(v8 *)(sr + t) > vm, *(v8 *)(sr + t), vm);
    float bm = vm[0];
    for (int i = 1; i < 8; i++) bm = vm[i] > bm ? vm[i] : bm;
    if (bm > *m) {
        float alpha = expf(*m - bm);  // 0 on the first tile
        *l *= alpha;
        for (int d = 0; d < D; d++) o[d] *= alpha;
        *m = bm;
    }
    v8 acc = {0}, mv = (v8){0} + *m;
    for (int t = 0; t < nt8; t += 8) {
        v8 e = v8exp(*(v8 *)(sr + t) - mv);
        *(v8 *)(sr + t) = e;
        acc += e;
    }
    *l += hsum8(acc);
}

// One decode task's attention (da_heads_impl of attention_decode.inc, instantiated for one cache type); run by
// da_decode. ptrs: room for 8 x DA_TILE pointers.
typedef void (*da_heads_fn)(const void *src, const float *Q, float *O, int h0, int h1, int group,
                            const int32_t *table, int block_size, int lo, int hi, int D, float *S, float *m,
                            float *l, const void **ptrs);

// Decode attention of every sequence, its tasks chosen, run and merged here (attention.c); heads: the task of one
// cache type.
int da_decode(const void *src, da_heads_fn heads, const float *q, int64_t q_s, int64_t q_h, const int32_t *tables,
              int64_t tab_s, const int32_t *seq_lens, float *out, int64_t o_s, int64_t o_h, int num_seqs,
              int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
              int num_threads);

// ------------------------------------------------------------------------------------------ prefill attention
//
// Each sequence's new query rows against its paged K/V (any cached prefix included), causal, optionally with a
// sliding window: flash attention with large key tiles, all in one OpenMP region per layer. A task is one
// (sequence, KV head, chunk of PF_TOK new tokens); its rows are the chunk's tokens × the KV head's query heads,
// token-major (row r = token i * group + head j), so a run of 8 rows spans few positions and the causal bound
// of a run is tight. Per tile of PF_KEYS keys: S = Q Kᵀ (8 rows × 16 keys register tiles over a transposed
// 16-key slice of K), the hidden positions set to -inf, the online-softmax update of each row's max and sum,
// then O += P V (4 rows × 32 columns register tiles over V's rows read in place from the cache). No K/V copy
// beyond the 16-key transpose, no masks in memory, no Python between the pieces.
//
// Arithmetic: fp32; q is scaled before the dot (q * scale) . k, where the reference scales the dot: the same
// up to rounding. Softmax with the running row max subtracted, the sum kept alongside, O divided at the end.

#define PF_TOK 64    // new tokens per task
#define PF_KEYS 256  // keys per tile (a multiple of 16)

typedef struct {
    int seq, kv_head, c0, c1;  // token chunk [c0, c1) of the sequence's new tokens
    int64_t work;              // for ordering: rows × keys
} pf_task_t;

// The arguments every prefill task of one call reads.
typedef struct {
    const float *q;
    int64_t q_s, q_h;
    const int32_t *tables;
    int64_t tab_s;
    const int32_t *cu, *seq_lens;
    float *out;
    int64_t o_s, o_h;
    int group, head_dim, block_size, window;
    float scale;
    // fresh K/V (a 1-byte cache's prefill): nk, nv [num_q_tokens, kv_heads, head_dim] by strides, or NULL; fresh[s]
    // != 0: sequence s reads its new tokens' K/V there (its cached prefix from the cache)
    const float *nk, *nv;
    int64_t nk_t, nk_h, nv_t, nv_h;
    const int32_t *fresh;
} pf_args_t;

// S[r][0:16] = sum_d Q[r][d] * KT[d][0:16] for 8 rows (Q rows of stride ld_q, S rows of stride ld_s)
static inline void pf_qk_8x16(const float *restrict Q, int ld_q, const float *restrict KT, int D, float *restrict S,
                              int ld_s) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    v8 b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, b4 = {0}, b5 = {0}, b6 = {0}, b7 = {0};
    for (int d = 0; d < D; d++) {
        v8 k0 = *(const v8 *)(KT + 16 * d), k1 = *(const v8 *)(KT + 16 * d + 8);
#define PF_ROW(i, A, B)                   \
    {                                     \
        float x = Q[(int64_t)(i)*ld_q + d]; \
        A += x * k0;                      \
        B += x * k1;                      \
    }
        PF_ROW(0, a0, b0) PF_ROW(1, a1, b1) PF_ROW(2, a2, b2) PF_ROW(3, a3, b3)
        PF_ROW(4, a4, b4) PF_ROW(5, a5, b5) PF_ROW(6, a6, b6) PF_ROW(7, a7, b7)
#undef PF_ROW
    }
#define PF_OUT(i, A, B)                                   \
    *(v8 *)(S + (int64_t)(i)*ld_s) = A;                   \
    *(v8 *)(S + (int64_t)(i)*ld_s + 8) = B;
    PF_OUT(0, a0, b0) PF_OUT(1, a1, b1) PF_OUT(2, a2, b2) PF_OUT(3, a3, b3)
    PF_OUT(4, a4, b4) PF_OUT(5, a5, b5) PF_OUT(6, a6, b6) PF_OUT(7, a7, b7)
#undef PF_OUT
}

// O[r][c0:c0+32] += sum_t P[r][t] * V_t[c0:c0+32] for 4 rows, keys t in [0, nt)
static inline void pf_pv_4x32(const float *restrict P, int ld_p, const float *const *vrow, int nt, float *restrict O,
                              int ld_o, int c0) {
    v8 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = *(v8 *)(O + (int64_t)i * ld_o + c0 + 8 * c);
    for (int t = 0; t < nt; t++) {
        const float *vr = vrow[t] + c0;
        v8 x0 = *(const v8 *)vr, x1 = *(const v8 *)(vr + 8), x2 = *(const v8 *)(vr + 16), x3 = *(const v8 *)(vr + 24);
        for (int i = 0; i < 4; i++) {
            float p = P[(int64_t)i * ld_p + t];
            acc[i][0] += p * x0;
            acc[i][1] += p * x1;
            acc[i][2] += p * x2;
            acc[i][3] += p * x3;
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) *(v8 *)(O + (int64_t)i * ld_o + c0 + 8 * c) = acc[i][c];
}

// the same for one 8-column slice (head sizes that are not a multiple of 32)
static inline void pf_pv_4x8(const float *restrict P, int ld_p, const float *const *vrow, int nt, float *restrict O,
                             int ld_o, int c0) {
    v8 a0 = *(v8 *)(O + c0), a1 = *(v8 *)(O + ld_o + c0), a2 = *(v8 *)(O + 2 * (int64_t)ld_o + c0),
       a3 = *(v8 *)(O + 3 * (int64_t)ld_o + c0);
    for (int t = 0; t < nt; t++) {
        v8 x = *(const v8 *)(vrow[t] + c0);
        a0 += P[t] * x;
        a1 += P[ld_p + t] * x;
        a2 += P[2 * (int64_t)ld_p + t] * x;
        a3 += P[3 * (int64_t)ld_p + t] * x;
    }
    *(v8 *)(O + c0) = a0;
    *(v8 *)(O + ld_o + c0) = a1;
    *(v8 *)(O + 2 * (int64_t)ld_o + c0) = a2;
    *(v8 *)(O + 3 * (int64_t)ld_o + c0) = a3;
}

// One task. Scratch (floats): Q rows8*D, O rows8*D, S rows8*PF_KEYS, KT 16*D, m/l rows8 each; lo/hi rows8 ints;
// krow/vrow PF_KEYS pointers each; rows_buf: one tile's K and V rows (2 * PF_KEYS * D floats) for a source that
// dequantizes (kv_rows_fn), else NULL.
static inline __attribute__((always_inline)) void pf_task_impl(
    kv_rows_fn rows_of, const void *src, const pf_task_t *task, const pf_args_t *a, float *buf, int *ibuf,
    const float **krow, const float **vrow, float *rows_buf) {
    const float *q = a->q;
    const int64_t q_s = a->q_s, q_h = a->q_h, tab_s = a->tab_s, o_s = a->o_s, o_h = a->o_h;
    const int32_t *tables = a->tables, *cu = a->cu, *seq_lens = a->seq_lens;
    float *out = a->out;
    const int group = a->group, D = a->head_dim, block_size = a->block_size, window = a->window;
    const float scale = a->scale;
    const int s = task->seq, h = task->kv_head, c0 = task->c0, ntok = task->c1 - task->c0;
    const int n = cu[s + 1] - cu[s], kv_len = seq_lens[s], q0 = cu[s];
    const int rows = ntok * group, rows8 = (rows + 7) & ~7;
    const int32_t *table = tables + (int64_t)s * tab_s;
    float *Q = buf, *O = Q + (int64_t)rows8 * D, *S = O + (int64_t)rows8 * D, *KT = S + (int64_t)rows8 * PF_KEYS,
          *m = KT + 16 * D, *l = m + rows8;
    int *lo_of = ibuf, *hi_of = ibuf + rows8;
    kv_new_t nw_rows, *nw = NULL;
    if (a->nk && a->fresh[s]) {
        nw_rows = (kv_new_t){a->nk + (int64_t)q0 * a->nk_t, a->nv + (int64_t)q0 * a->nv_t, a->nk_t, a->nk_h, a->nv_t,
                             a->nv_h, kv_len - n};
        nw = &nw_rows;
    }
    for (int r = 0; r < rows8; r++) {
        int i = r / group, j = r % group;
        if (r < rows) {
            const float *qr = q + (int64_t)(q0 + c0 + i) * q_s + (int64_t)(h * group + j) * q_h;
            for (int d = 0; d < D; d++) Q[(int64_t)r * D + d] = qr[d] * scale;
            int pos = kv_len - n + c0 + i;
            hi_of[r] = pos + 1;
            lo_of[r] = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
        } else {  // padding rows: zero queries that see nothing (their results are dropped)
            memset(Q + (int64_t)r * D, 0, sizeof(float) * D);
            hi_of[r] = 0;
            lo_of[r] = 0;
        }
        memset(O + (int64_t)r * D, 0, sizeof(float) * D);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    int lo_min = lo_of[0], hi_max = hi_of[rows - 1];  // token-major rows: bounds grow with r
    for (int kt0 = lo_min / 16 * 16; kt0 < hi_max; kt0 += PF_KEYS) {
        int nk = hi_max - kt0 < PF_KEYS ? hi_max - kt0 : PF_KEYS, nk16 = (nk + 15) & ~15;
        int64_t k_h, v_h;  // the tile's rows are of head h alone
        rows_of(src, nw, table, block_size, kt0, nk, h, h + 1, krow, vrow, &k_h, &v_h, rows_buf);
        // S = Q Kᵀ over 16-key slices; a run of 8 rows skips slices wholly after its last visible position
        for (int t16 = 0; t16 < nk16; t16 += 16) {
            for (int t = 0; t < 16; t++) {
                if (t16 + t < nk) {
                    const float *kr = krow[t16 + t];
                    for (int d = 0; d < D; d++) KT[16 * d + t] = kr[d];
                } else {
                    for (int d = 0; d < D; d++) KT[16 * d + t] = 0.0f;
                }
            }
            for (int r0 = 0; r0 < rows8; r0 += 8) {
                int hi8 = hi_of[r0 + 7 < rows ? r0 + 7 : rows - 1];
                if (kt0 + t16 >= hi8) continue;  // no row of the run sees a key of this slice (the mask sets -inf)
                pf_qk_8x16(Q + (int64_t)r0 * D, D, KT, D, S + (int64_t)r0 * PF_KEYS + t16, PF_KEYS);
            }
        }
        // hidden positions -> -inf; online softmax per row (padding rows see nothing: P = 0)
        for (int r = 0; r < rows8; r++) {
            float *sr = S + (int64_t)r * PF_KEYS;
            int a = lo_of[r] - kt0, b = hi_of[r] - kt0;  // visible columns [a, b) of this tile
            if (a < 0) a = 0;
            if (b > nk16) b = nk16;
            if (a >= b) {  // nothing visible in this tile
                for (int t = 0; t < nk16; t++) sr[t] = 0.0f;
                continue;
            }
            for (int t = 0; t < a; t++) sr[t] = -INFINITY;
            for (int t = b; t < nk16; t++) sr[t] = -INFINITY;
            da_softmax_row(sr, nk16, m + r, l + r, O + (int64_t)r * D, D);
        }
        // O += P V; a run of 4 rows reads keys only up to its last visible position
        for (int r0 = 0; r0 < rows; r0 += 4) {
            int last = r0 + 3 < rows ? r0 + 3 : rows - 1;
            int nt = hi_of[last] - kt0 < nk ? hi_of[last] - kt0 : nk;
            if (nt <= 0) continue;
            const float *P = S + (int64_t)r0 * PF_KEYS;
            float *Or = O + (int64_t)r0 * D;
            int c = 0;
            for (; c + 32 <= D; c += 32) pf_pv_4x32(P, PF_KEYS, vrow, nt, Or, D, c);
            for (; c < D; c += 8) pf_pv_4x8(P, PF_KEYS, vrow, nt, Or, D, c);
        }
    }
    for (int r = 0; r < rows; r++) {
        int i = r / group, j = r % group;
        float inv = 1.0f / l[r], *o = O + (int64_t)r * D;
        float *dst = out + (int64_t)(q0 + c0 + i) * o_s + (int64_t)(h * group + j) * o_h;
        for (int d = 0; d < D; d++) dst[d] = o[d] * inv;
    }
}

// One prefill task (pf_task_impl instantiated for one source); run by pf_prefill.
typedef void (*pf_task_fn)(const void *src, const pf_task_t *task, const pf_args_t *a, float *buf, int *ibuf,
                           const float **krow, const float **vrow, float *rows_buf);

// Prefill attention of every sequence: its tasks made, ordered and run here (attention.c); dequant: the task's rows
// function dequantizes (each thread then holds one tile of K and V rows, 2 x PF_KEYS x head_dim floats).
int pf_prefill(const void *src, pf_task_fn task, int dequant, const pf_args_t *a, int num_seqs, int num_q_heads,
               int num_kv_heads, int num_threads);
