// duet's CPU attention kernels (fp32), called from kernels/cpu_native.py through ctypes.
//
// Why C: on a CPU the engine's decode step reads every running sequence's whole K/V once per layer. The torch
// reference gathers the blocks into a padded copy, then SDPA reads the copy again (and masks the padding): about
// ten bytes moved per byte of K/V. These kernels read each K/V row once, straight from the paged cache, with
// one OpenMP task per sequence. The OpenMP runtime is torch's own libgomp (same soname, loaded
// first), so these threads are torch's threads: no second pool spinning beside torch's GEMMs.
//
// Layout (kernels/__init__.py): a layer's cache is the strided view [num_blocks, block_size, num_kv_heads,
// head_dim] of the one KV tensor; strides are in elements and the last dim is contiguous. Block tables are
// int32 [num_seqs, width] (row stride given), lengths int32.
//
// Arithmetic: fp32 throughout. Scores q.k * scale, softmax with the row max subtracted (exp of <= 0), then
// the probability-weighted sum of V divided by the sum: the same math as SDPA's reference, summed in another
// order (differences of a few ulp).
#include "attention_tiles.h"

typedef struct {  // one layer's K and V: [num_blocks, block_size, num_kv_heads, head_dim] by strides (elements)
    const float *k, *v;
    int64_t k_b, k_t, k_h, v_b, v_t, v_h;
} kv_f32_t;

// decode attention's tiles and task loop on fp32 rows (da_qk_f32, da_pv_f32, da_rows_of_f32, da_heads_impl_f32)
#define DA_T float
#define DA_SFX(f) f##_f32
#define DA_LOAD8(p) (*(const v8 *)(p))
#define DA_SCALED 0
#define DA_SRC kv_f32_t
#include "attention_decode.inc"
#undef DA_T
#undef DA_SFX
#undef DA_LOAD8
#undef DA_SCALED
#undef DA_SRC

#define MAX_SCRATCH 8192  // floats of per-task scratch on the stack (32 KB); more is allocated


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

// Attention of one sequence's query rows against its paged K/V, all KV heads at once, block by block, in one
// pass (online softmax): a block's K and then V rows of every head are read once, in address order (with the
// cache layout [.., layer, K/V, block_size, kv_heads, head_dim] they are one contiguous run), while the next
// block is prefetched a slice per row (a burst of prefetches would stall the core). Query row r belongs to
// query head head_of[r] (KV head head_of[r] / group) and sees positions [lo_of[r], hi_of[r]) (causal end and
// sliding window applied by the caller); [lo, hi) covers every row's range. Outputs are accumulated in
// out_rows. Scratch: m, l (rows floats each), p (rows * block_size). Inlined per head_dim: with a constant
// head_dim the row's output accumulator stays in registers over a block and the dots unroll.
static inline __attribute__((always_inline)) void attend_rows_impl(
    const float *const *q_rows, float *const *out_rows, const int *head_of, const int *lo_of, const int *hi_of,
    int rows, int group, int lo, int hi, const float *k, const float *v, int64_t k_b, int64_t k_t, int64_t k_h,
    int64_t v_b, int64_t v_t, int64_t v_h, const int32_t *table, int block_size, const int head_dim, float scale,
    float *m, float *l, float *p) {
    const int vec = head_dim % 8 == 0 && head_dim <= 256, nc = head_dim / 8;
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(out_rows[r], 0, sizeof(float) * head_dim);
    }
    int64_t k_bytes = (int64_t)block_size * k_t * 4, v_bytes = (int64_t)block_size * v_t * 4;
    int64_t k_step = ((k_bytes + rows - 1) / rows + 63) / 64 * 64, v_step = ((v_bytes + rows - 1) / rows + 63) / 64 * 64;
    int first_block = lo / block_size, last_block = (hi - 1) / block_size;
    for (int blk = first_block; blk <= last_block; blk++) {
        const char *nk = blk < last_block ? (const char *)(k + (int64_t)table[blk + 1] * k_b) : NULL;
        const char *nv = blk < last_block ? (const char *)(v + (int64_t)table[blk + 1] * v_b) : NULL;
        const float *kb = k + (int64_t)table[blk] * k_b, *vb = v + (int64_t)table[blk] * v_b;
        int b0 = blk * block_size;
        for (int r = 0; r < rows; r++) {
            if (nk) {
                for (int64_t i = r * k_step; i < (r + 1) * k_step && i < k_bytes; i += 64) __builtin_prefetch(nk + i);
                for (int64_t i = r * v_step; i < (r + 1) * v_step && i < v_bytes; i += 64) __builtin_prefetch(nv + i);
            }
            int t0 = lo_of[r] > b0 ? lo_of[r] : b0;
            int t1 = hi_of[r] < b0 + block_size ? hi_of[r] : b0 + block_size;
            if (t0 >= t1) continue;
            const float *kh = kb + (int64_t)(head_of[r] / group) * k_h;
            float *pr = p + (int64_t)r * block_size;  // pr[t - b0]; hidden positions hold -inf (exp -> 0)
            for (int i = 0; i < block_size; i++) pr[i] = -INFINITY;
            float bm = -INFINITY;
            for (int t = t0; t < t1; t++) {
                float sc = dot(q_rows[r], kh + (int64_t)(t - b0) * k_t, head_dim) * scale;
                pr[t - b0] = sc;
                bm = sc > bm ? sc : bm;
            }
            float *o = out_rows[r];
            if (bm > m[r]) {  // a new running max: rescale what was accumulated under the old one
                float alpha = expf(m[r] - bm);  // exp(-inf) = 0 on the first block
                l[r] *= alpha;
#pragma omp simd
                for (int i = 0; i < head_dim; i++) o[i] *= alpha;
                m[r] = bm;
            }
            float mr = m[r], sum = 0.0f;
            if (block_size % 8 == 0) {
                v8 acc = {0};
                for (int i = 0; i < block_size; i += 8) {
                    v8 e = v8exp(*(v8 *)(pr + i) - mr);
                    *(v8 *)(pr + i) = e;
                    acc += e;
                }
                sum = hsum8(acc);
            } else {
                for (int i = 0; i < block_size; i++) sum += (pr[i] = expf(pr[i] - mr));
            }
            l[r] += sum;
            const float *vh = vb + (int64_t)(head_of[r] / group) * v_h;
            if (vec) {
                v8 acc[32];
                for (int c = 0; c < nc; c++) acc[c] = *(v8 *)(o + 8 * c);
                for (int t = t0; t < t1; t++) {
                    float pt = pr[t - b0];
                    const float *vr = vh + (int64_t)(t - b0) * v_t;
                    for (int c = 0; c < nc; c++) acc[c] += pt * *(const v8 *)(vr + 8 * c);
                }
                for (int c = 0; c < nc; c++) *(v8 *)(o + 8 * c) = acc[c];
            } else {
                for (int t = t0; t < t1; t++) axpy(o, pr[t - b0], vh + (int64_t)(t - b0) * v_t, head_dim);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float inv = 1.0f / l[r];
        float *o = out_rows[r];
#pragma omp simd
        for (int i = 0; i < head_dim; i++) o[i] *= inv;
    }
}

static void attend_rows(const float *const *q_rows, float *const *out_rows, const int *head_of, const int *lo_of,
                        const int *hi_of, int rows, int group, int lo, int hi, const float *k, const float *v,
                        int64_t k_b, int64_t k_t, int64_t k_h, int64_t v_b, int64_t v_t, int64_t v_h,
                        const int32_t *table, int block_size, int head_dim, float scale, float *m, float *l,
                        float *p) {
#define ATTEND(D) attend_rows_impl(q_rows, out_rows, head_of, lo_of, hi_of, rows, group, lo, hi, k, v, k_b, k_t, \
                                   k_h, v_b, v_t, v_h, table, block_size, D, scale, m, l, p)
    switch (head_dim) {  // the common head sizes get their own unrolled copy
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        default: ATTEND(head_dim);
    }
#undef ATTEND
}

// ------------------------------------------------------------------------------------------ an fp32 cache's rows

// kv_rows_fn of an fp32 cache (prefill): pointers into it, nothing copied
static inline void rows_f32(const void *src, const kv_new_t *nw, const int32_t *table, int block_size, int t0, int n,
                            int h0, int h1, const float **krow, const float **vrow, int64_t *k_h, int64_t *v_h,
                            float *buf) {
    (void)nw;  // an fp32 cache holds the new rows as computed (the store copies them)
    (void)h1;
    (void)buf;
    const kv_f32_t *c = src;
    da_rows_of_f32(c->k + h0 * c->k_h, c->k_b, c->k_t, c->v + h0 * c->v_h, c->v_b, c->v_t, table, block_size, t0, n,
               krow, vrow);
    *k_h = c->k_h;
    *v_h = c->v_h;
}

static void da_heads_f32(const void *src, const float *Q, float *O, int h0, int h1, int group, const int32_t *table,
                         int block_size, int lo, int hi, int D, float *S, float *m, float *l, const void **ptrs) {
#define DA(d) da_heads_impl_f32(src, Q, O, h0, h1, group, table, block_size, lo, hi, d, S, m, l, ptrs)
    switch (D) {
        case 64: DA(64); break;
        case 128: DA(128); break;
        default: DA(D);
    }
#undef DA
}

// One query token per sequence at position seq_lens[s] - 1, head_dim a multiple of 8. A task is a sequence
// (all its KV heads), or with fewer sequences than twice the threads, one KV head of one; and when even those
// tasks are fewer than twice the threads (batch 1: SmolLM2's 3 KV heads on 2 threads left one thread idle a
// third of the time), each also splits its keys into chunks of at least DA_CHUNK (flash-decoding): a chunk's
// output, max and sum are kept apart, then merged per row as sum_c e^(m_c - M) l_c O_c / sum_c e^(m_c - M) l_c.
// Returns 0, or -1 if a scratch allocation failed.
#define DA_CHUNK 128  // keys per chunk at least: a chunk's fixed cost (q copy, merge) stays small next to it
int da_decode(const void *src, da_heads_fn heads, const float *q, int64_t q_s, int64_t q_h, const int32_t *tables,
              int64_t tab_s, const int32_t *seq_lens, float *out, int64_t o_s, int64_t o_h, int num_seqs,
              int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
              int num_threads) {
    const int group = num_q_heads / num_kv_heads, split = num_seqs < 2 * num_threads;
    const int per_task = split ? 1 : num_kv_heads, head_tasks = num_kv_heads / per_task;
    const int rows = per_task * group, D = head_dim;
    int chunks = 1;  // per (sequence, head task): enough for twice the threads, never under DA_CHUNK keys
    if (num_seqs * head_tasks < 2 * num_threads) {
        int max_len = 0;
        for (int s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
        int want = (2 * num_threads + num_seqs * head_tasks - 1) / (num_seqs * head_tasks);
        int most = max_len / DA_CHUNK;
        chunks = want < most ? want : most;
        if (chunks < 1) chunks = 1;
    }
    const int ntasks = num_seqs * head_tasks * chunks;
    float *part = chunks > 1 ? malloc(sizeof(float) * (size_t)ntasks * rows * (D + 2)) : NULL;  // O, m, l
    int failed = chunks > 1 && !part;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = aligned_alloc(64, sizeof(float) * ((size_t)rows * (DA_TILE + 2 * D + 2) + 16));
        const void **ptrs = malloc(sizeof(void *) * 8 * DA_TILE);
        int ok = buf && ptrs && !failed;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < ntasks; task++) {
            if (!ok) continue;
            int c = task % chunks, ht = task / chunks;
            int s = ht / head_tasks, h0 = ht % head_tasks * per_task;
            int len = seq_lens[s], lo = window > 0 && len > window ? len - window : 0;
            int step = ((len - lo + chunks - 1) / chunks + DA_TILE - 1) / DA_TILE * DA_TILE;
            int c0 = lo + c * step, c1 = c0 + step < len ? c0 + step : len;
            float *S = buf, *Q = S + (size_t)rows * DA_TILE, *O = Q + (size_t)rows * D, *m = O + (size_t)rows * D,
                  *l = m + rows;
            if (c0 >= c1) {  // a short sequence beside long ones: its later chunks are empty
                float *pm = part + ((size_t)task * rows) * (D + 2);
                for (int r = 0; r < rows; r++) pm[r * (D + 2) + D] = -INFINITY, pm[r * (D + 2) + D + 1] = 0.0f;
                continue;
            }
            for (int r = 0; r < rows; r++) {
                const float *qr = q + s * q_s + (int64_t)(h0 * group + r) * q_h;
                for (int d = 0; d < D; d++) Q[r * D + d] = qr[d] * scale;
            }
            heads(src, Q, O, h0, h0 + per_task, group, tables + s * tab_s, block_size, c0, c1, D, S, m, l, ptrs);
            if (chunks == 1) {
                for (int r = 0; r < rows; r++)
                    memcpy(out + s * o_s + (int64_t)(h0 * group + r) * o_h, O + r * D, sizeof(float) * D);
                continue;
            }
            for (int r = 0; r < rows; r++) {
                float *pr = part + ((size_t)task * rows + r) * (D + 2);
                memcpy(pr, O + r * D, sizeof(float) * D);
                pr[D] = m[r];
                pr[D + 1] = l[r];
            }
        }
        if (chunks > 1 && !failed) {  // the omp for's barrier: every chunk is done
#pragma omp for schedule(static)
            for (int ht = 0; ht < num_seqs * head_tasks; ht++) {
                int s = ht / head_tasks, h0 = ht % head_tasks * per_task;
                for (int r = 0; r < rows; r++) {
                    float mx = -INFINITY, wsum = 0.0f;
                    for (int c = 0; c < chunks; c++) {
                        float mc = part[(((size_t)ht * chunks + c) * rows + r) * (D + 2) + D];
                        mx = mc > mx ? mc : mx;
                    }
                    float *o = out + s * o_s + (int64_t)(h0 * group + r) * o_h;
                    memset(o, 0, sizeof(float) * D);
                    for (int c = 0; c < chunks; c++) {
                        const float *pr = part + (((size_t)ht * chunks + c) * rows + r) * (D + 2);
                        if (pr[D + 1] == 0.0f) continue;  // an empty chunk
                        float w = expf(pr[D] - mx) * pr[D + 1];
                        wsum += w;
#pragma omp simd
                        for (int d = 0; d < D; d++) o[d] += w * pr[d];
                    }
                    float inv = 1.0f / wsum;
#pragma omp simd
                    for (int d = 0; d < D; d++) o[d] *= inv;
                }
            }
        }
        free(buf);
        free(ptrs);
    }
    free(part);
    return failed ? -1 : 0;
}

// One query token per sequence at position seq_lens[s] - 1 (its K/V already stored). Head sizes that are a
// multiple of 8 take da_decode; the rest attend_rows, one task per sequence.
// Returns 0, or -1 if a scratch allocation failed (only sizes past the stack buffer allocate).
int duet_decode_attention_f32(const float *q, int64_t q_s, int64_t q_h, const float *k, int64_t k_b,
                              int64_t k_t, int64_t k_h, const float *v, int64_t v_b, int64_t v_t, int64_t v_h,
                              const int32_t *tables, int64_t tab_s, const int32_t *seq_lens, float *out,
                              int64_t o_s, int64_t o_h, int num_seqs, int num_q_heads, int num_kv_heads,
                              int head_dim, int block_size, float scale, int window, int num_threads) {
    if (head_dim % 8 == 0) {
        const kv_f32_t src = {k, v, k_b, k_t, k_h, v_b, v_t, v_h};
        return da_decode(&src, da_heads_f32, q, q_s, q_h, tables, tab_s, seq_lens, out, o_s, o_h, num_seqs,
                         num_q_heads, num_kv_heads, head_dim, block_size, scale, window, num_threads);
    }
    int group = num_q_heads / num_kv_heads, failed = 0;
    size_t scratch = (size_t)num_q_heads * (2 + block_size);  // m, l, p
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        int len = seq_lens[s];
        int lo = window > 0 && len > window ? len - window : 0;
        const float *q_rows[num_q_heads];
        float *out_rows[num_q_heads];
        int head_of[num_q_heads], lo_of[num_q_heads], hi_of[num_q_heads];
        for (int j = 0; j < num_q_heads; j++) {
            q_rows[j] = q + s * q_s + (int64_t)j * q_h;
            out_rows[j] = out + s * o_s + (int64_t)j * o_h;
            head_of[j] = j;
            lo_of[j] = lo;
            hi_of[j] = len;
        }
        float stack_buf[MAX_SCRATCH];
        float *buf = scratch <= MAX_SCRATCH ? stack_buf : malloc(sizeof(float) * scratch);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        attend_rows(q_rows, out_rows, head_of, lo_of, hi_of, num_q_heads, group, lo, len, k, v, k_b, k_t, k_h,
                    v_b, v_t, v_h, tables + s * tab_s, block_size, head_dim, scale, buf, buf + num_q_heads,
                    buf + 2 * num_q_heads);
        if (buf != stack_buf) free(buf);
    }
    return failed ? -1 : 0;
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

// The launchers' check of what the kernels above trust: 0 if every length is in [1, width * block_size] and
// every block id a sequence uses is in [0, num_blocks); 1 for a bad length, 2 for a bad block id.
int duet_check_paged_f32(const int32_t *tables, int64_t tab_s, const int32_t *lens, int n, int width,
                         int block_size, int64_t num_blocks) {
    for (int s = 0; s < n; s++) {
        int len = lens[s];
        if (len < 1 || (int64_t)len > (int64_t)width * block_size) return 1;
        for (int j = 0; j < (len + block_size - 1) / block_size; j++) {
            int32_t b = tables[s * tab_s + j];
            if (b < 0 || b >= num_blocks) return 2;
        }
    }
    return 0;
}

// ------------------------------------------------------------------------------------------ prefill attention
// (the tiles and the task loop: attention_tiles.h)

static int pf_cmp(const void *a, const void *b) {
    int64_t wa = ((const pf_task_t *)a)->work, wb = ((const pf_task_t *)b)->work;
    return wa < wb ? 1 : wa > wb ? -1 : 0;
}

static void pf_task_f32(const void *src, const pf_task_t *task, const pf_args_t *a, float *buf, int *ibuf,
                        const float **krow, const float **vrow, float *rows_buf) {
    pf_task_impl(rows_f32, src, task, a, buf, ibuf, krow, vrow, rows_buf);
}

// Prefill attention of every sequence (any source: task is its pf_task_impl); 0, or -1 if an allocation failed.
int pf_prefill(const void *src, pf_task_fn task, int dequant, const pf_args_t *a, int num_seqs, int num_q_heads,
               int num_kv_heads, int num_threads) {
    const int32_t *cu = a->cu, *seq_lens = a->seq_lens;
    const int head_dim = a->head_dim;
    int group = num_q_heads / num_kv_heads, ntasks = 0, failed = 0;
    for (int s = 0; s < num_seqs; s++) ntasks += (cu[s + 1] - cu[s] + PF_TOK - 1) / PF_TOK * num_kv_heads;
    if (ntasks == 0) return 0;
    pf_task_t *tasks = malloc(sizeof(pf_task_t) * ntasks);
    if (!tasks) return -1;
    int t = 0;
    for (int s = 0; s < num_seqs; s++) {
        int n = cu[s + 1] - cu[s];
        for (int c0 = 0; c0 < n; c0 += PF_TOK)
            for (int h = 0; h < num_kv_heads; h++) {
                int c1 = c0 + PF_TOK < n ? c0 + PF_TOK : n;
                tasks[t++] = (pf_task_t){s, h, c0, c1, (int64_t)(c1 - c0) * (seq_lens[s] - n + c1)};
            }
    }
    qsort(tasks, ntasks, sizeof(pf_task_t), pf_cmp);  // the biggest first: the last tasks are short
    int rows8 = (PF_TOK * group + 7) & ~7;
    size_t floats = (size_t)rows8 * (2 * head_dim + PF_KEYS + 2) + 16 * (size_t)head_dim;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        int *ibuf = malloc(sizeof(int) * 2 * rows8);
        const float **ptrs = malloc(sizeof(float *) * 2 * PF_KEYS);
        float *rows_buf = dequant ? aligned_alloc(64, sizeof(float) * 2 * PF_KEYS * (size_t)head_dim) : NULL;
        int ok = buf && ibuf && ptrs && (rows_buf || !dequant);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntasks; i++)
            if (ok) task(src, &tasks[i], a, buf, ibuf, ptrs, ptrs + PF_KEYS, rows_buf);
        free(buf);
        free(ibuf);
        free(ptrs);
        free(rows_buf);
    }
    free(tasks);
    return failed ? -1 : 0;
}

// Prefill attention for all sequences of a step. cu: int32 [num_seqs + 1] query-row offsets; seq_lens: K/V
// length incl. the new tokens (the caller checked n <= seq_lens[s] and the tables). head_dim a multiple of 8.
// Returns 0, or -1 if an allocation failed.
int duet_prefill_attention_f32(const float *q, int64_t q_s, int64_t q_h, const float *k, int64_t k_b, int64_t k_t,
                               int64_t k_h, const float *v, int64_t v_b, int64_t v_t, int64_t v_h,
                               const int32_t *tables, int64_t tab_s, const int32_t *cu, const int32_t *seq_lens,
                               float *out, int64_t o_s, int64_t o_h, int num_seqs, int num_q_heads, int num_kv_heads,
                               int head_dim, int block_size, float scale, int window, int num_threads) {
    const kv_f32_t src = {k, v, k_b, k_t, k_h, v_b, v_t, v_h};
    const pf_args_t a = {q, q_s, q_h, tables, tab_s, cu, seq_lens, out, o_s, o_h, num_q_heads / num_kv_heads,
                         head_dim, block_size, window, scale, NULL, NULL, 0, 0, 0, 0, NULL};
    return pf_prefill(&src, pf_task_f32, 0, &a, num_seqs, num_q_heads, num_kv_heads, num_threads);
}
