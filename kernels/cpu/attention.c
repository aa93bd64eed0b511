// duet's CPU attention kernels (fp32), called from kernels/cpu_native.py through ctypes.
//
// Why C: on a CPU the engine's decode step reads every running sequence's whole K/V once per layer. The torch
// reference gathers the blocks into a padded copy, then SDPA reads the copy again (and masks the padding): about
// ten bytes moved per byte of K/V. These kernels read each K/V row once, straight from the paged cache, with
// one OpenMP task per (sequence, KV head). The OpenMP runtime is torch's own libgomp (same soname, loaded
// first), so these threads are torch's threads: no second pool spinning beside torch's GEMMs.
//
// Layout (kernels/__init__.py): a layer's cache is the strided view [num_blocks, block_size, num_kv_heads,
// head_dim] of the one KV tensor; strides are in elements and the last dim is contiguous. Block tables are
// int32 [num_seqs, width] (row stride given), lengths int32.
//
// Arithmetic: fp32 throughout. Scores q.k * scale, softmax with the row max subtracted (exp of <= 0), then
// the probability-weighted sum of V divided by the sum: the same math as SDPA's reference, summed in another
// order (differences of a few ulp).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 256   // query rows per call of attend_rows
#define MAX_BLOCK 64   // tokens per cache block

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // 8 lanes, unaligned loads allowed

static inline float hsum8(v8 x) {
    float s0 = (x[0] + x[4]) + (x[2] + x[6]), s1 = (x[1] + x[5]) + (x[3] + x[7]);
    return s0 + s1;
}

// a . b; two independent 8-lane accumulators (head_dim a multiple of 8 takes the vector path)
static inline float dot(const float *restrict a, const float *restrict b, int n) {
    if ((n & 7) == 0) {
        v8 acc0 = {0}, acc1 = {0};
        int i = 0;
        for (; i + 16 <= n; i += 16) {
            acc0 += *(const v8 *)(a + i) * *(const v8 *)(b + i);
            acc1 += *(const v8 *)(a + i + 8) * *(const v8 *)(b + i + 8);
        }
        if (i < n) acc0 += *(const v8 *)(a + i) * *(const v8 *)(b + i);
        return hsum8(acc0 + acc1);
    }
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static inline void prefetch_block(const float *base, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)base + i);
}

// Attention of one sequence's query rows against its paged K/V, all KV heads at once, block by block, in one
// pass (online softmax): a block's K and then V rows of every head are read once, in address order (with the
// cache layout [.., layer, K/V, block_size, kv_heads, head_dim] they are one contiguous run), while the next
// block is prefetched. Query row r belongs to query head head_of[r] (KV head head_of[r] / group) and sees
// positions [lo_of[r], hi_of[r]) (causal end and sliding window applied by the caller); [lo, hi) covers every
// row's range. Outputs are accumulated in out_rows. Scratch: m, l (rows floats each), p (rows * block_size).
static void attend_rows(const float *const *q_rows, float *const *out_rows, const int *head_of, const int *lo_of,
                        const int *hi_of, int rows, int group, int lo, int hi, const float *k, const float *v,
                        int64_t k_b, int64_t k_t, int64_t k_h, int64_t v_b, int64_t v_t, int64_t v_h,
                        const int32_t *table, int block_size, int head_dim, float scale, float *m, float *l,
                        float *p) {
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(out_rows[r], 0, sizeof(float) * head_dim);
    }
    int first_block = lo / block_size, last_block = (hi - 1) / block_size;
    for (int blk = first_block; blk <= last_block; blk++) {
        if (blk < last_block) {
            prefetch_block(k + (int64_t)table[blk + 1] * k_b, (int64_t)block_size * k_t * 4);
            prefetch_block(v + (int64_t)table[blk + 1] * v_b, (int64_t)block_size * v_t * 4);
        }
        const float *kb = k + (int64_t)table[blk] * k_b, *vb = v + (int64_t)table[blk] * v_b;
        int b0 = blk * block_size;
        for (int r = 0; r < rows; r++) {
            int t0 = lo_of[r] > b0 ? lo_of[r] : b0;
            int t1 = hi_of[r] < b0 + block_size ? hi_of[r] : b0 + block_size;
            if (t0 >= t1) continue;
            const float *kh = kb + (int64_t)(head_of[r] / group) * k_h;
            float *pr = p + (int64_t)r * block_size - b0;
            float bm = -INFINITY;
            for (int t = t0; t < t1; t++) {
                pr[t] = dot(q_rows[r], kh + (int64_t)(t - b0) * k_t, head_dim) * scale;
                bm = pr[t] > bm ? pr[t] : bm;
            }
            if (bm > m[r]) {  // a new running max: rescale what was accumulated under the old one
                float alpha = expf(m[r] - bm);  // exp(-inf) = 0 on the first block
                l[r] *= alpha;
                float *o = out_rows[r];
#pragma omp simd
                for (int i = 0; i < head_dim; i++) o[i] *= alpha;
                m[r] = bm;
            }
            float mr = m[r], sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = t0; t < t1; t++) {
                pr[t] = expf(pr[t] - mr);
                sum += pr[t];
            }
            l[r] += sum;
            const float *vh = vb + (int64_t)(head_of[r] / group) * v_h;
            for (int t = t0; t < t1; t++) axpy(out_rows[r], pr[t], vh + (int64_t)(t - b0) * v_t, head_dim);
        }
    }
    for (int r = 0; r < rows; r++) {
        float inv = 1.0f / l[r];
        float *o = out_rows[r];
#pragma omp simd
        for (int i = 0; i < head_dim; i++) o[i] *= inv;
    }
}

// One query token per sequence at position seq_lens[s] - 1 (its K/V already stored). One task per sequence.
// Returns 0, or -1 if a scratch allocation failed.
int duet_decode_attention_f32(const float *q, int64_t q_s, int64_t q_h, const float *k, int64_t k_b,
                              int64_t k_t, int64_t k_h, const float *v, int64_t v_b, int64_t v_t, int64_t v_h,
                              const int32_t *tables, int64_t tab_s, const int32_t *seq_lens, float *out,
                              int64_t o_s, int64_t o_h, int num_seqs, int num_q_heads, int num_kv_heads,
                              int head_dim, int block_size, float scale, int window, int num_threads) {
    int group = num_q_heads / num_kv_heads;
    if (num_q_heads > MAX_ROWS || block_size > MAX_BLOCK) return -2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        int len = seq_lens[s];
        int lo = window > 0 && len > window ? len - window : 0;
        const float *q_rows[MAX_ROWS];
        float *out_rows[MAX_ROWS];
        int head_of[MAX_ROWS], lo_of[MAX_ROWS], hi_of[MAX_ROWS];
        for (int j = 0; j < num_q_heads; j++) {
            q_rows[j] = q + s * q_s + (int64_t)j * q_h;
            out_rows[j] = out + s * o_s + (int64_t)j * o_h;
            head_of[j] = j;
            lo_of[j] = lo;
            hi_of[j] = len;
        }
        float m[MAX_ROWS], l[MAX_ROWS], p[MAX_ROWS * MAX_BLOCK];
        attend_rows(q_rows, out_rows, head_of, lo_of, hi_of, num_q_heads, group, lo, len, k, v, k_b, k_t, k_h,
                    v_b, v_t, v_h, tables + s * tab_s, block_size, head_dim, scale, m, l, p);
    }
    return 0;
}

// Copy the first num_tokens rows of one sequence's K and V out of the paged cache into contiguous
// [num_tokens, kv_heads * head_dim] buffers (each block's rows are contiguous: one memcpy per block and tensor).
void duet_gather_kv_f32(const float *k, int64_t k_b, const float *v, int64_t v_b, const int32_t *table,
                        int num_tokens, int block_size, int64_t row_elems, float *k_out, float *v_out) {
    for (int t = 0; t < num_tokens; t += block_size) {
        int n = num_tokens - t < block_size ? num_tokens - t : block_size;
        int32_t b = table[t / block_size];
        memcpy(k_out + (int64_t)t * row_elems, k + (int64_t)b * k_b, sizeof(float) * n * row_elems);
        memcpy(v_out + (int64_t)t * row_elems, v + (int64_t)b * v_b, sizeof(float) * n * row_elems);
    }
}

// Write each new token's K and V rows (all heads: row_elems floats, contiguous within a row) into its cache slot
// (block * block_size + offset); slot -1 = skip (a padding token).
void duet_store_kv_f32(const float *k, int64_t k_s, const float *v, int64_t v_s, float *k_cache, int64_t kc_b,
                       int64_t kc_t, float *v_cache, int64_t vc_b, int64_t vc_t, const int64_t *slots,
                       int64_t num_tokens, int block_size, int64_t row_elems) {
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        int64_t b = slot / block_size, off = slot % block_size;
        memcpy(k_cache + b * kc_b + off * kc_t, k + t * k_s, sizeof(float) * row_elems);
        memcpy(v_cache + b * vc_b + off * vc_t, v + t * v_s, sizeof(float) * row_elems);
    }
}
