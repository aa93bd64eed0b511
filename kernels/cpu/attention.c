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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SCRATCH 8192  // floats of per-task scratch on the stack (32 KB); more is allocated

#define VEC_LANES 8
#define VEC_F v8
#define VEC_I vi8
#define VEC_NAME(f) v8##f
#include "vexp.h"

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

// S[g][0:nt8] = Q[g] . K_t for G rows (Q: G x D, scaled, contiguous; row t of K at krow[t] + koff): each K
// chunk is loaded once for all G rows, eight keys' partial sums reduced together; keys past nt get -inf. While
// at it, the same rows of the next tile (nkrow, nn of them; NULL: none) are prefetched.
static inline __attribute__((always_inline)) void da_qk(const float *restrict Q, const int G, const int D,
                                                        const float *const *krow, int64_t koff, int nt,
                                                        const float *const *nkrow, int nn, float *restrict S,
                                                        int ld_s) {
    const int nt8 = (nt + 7) & ~7;
    for (int j0 = 0; j0 < nt8; j0 += 8) {
        v8 part[4][8];
        for (int j = 0; j < 8; j++) {
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            if (j0 + j < nt) {
                const float *kr = krow[j0 + j] + koff;
                if (nkrow && j0 + j < nn)
                    for (int c = 0; c < D; c += 16) __builtin_prefetch(nkrow[j0 + j] + koff + c, 0, DA_PF);
                for (int c = 0; c < D; c += 8) {
                    v8 kc = *(const v8 *)(kr + c);
                    a0 += *(const v8 *)(Q + c) * kc;
                    if (G > 1) a1 += *(const v8 *)(Q + D + c) * kc;
                    if (G > 2) a2 += *(const v8 *)(Q + 2 * D + c) * kc;
                    if (G > 3) a3 += *(const v8 *)(Q + 3 * D + c) * kc;
                }
            }
            part[0][j] = a0;
            part[1][j] = a1;
            part[2][j] = a2;
            part[3][j] = a3;
        }
        for (int g = 0; g < G; g++) *(v8 *)(S + g * ld_s + j0) = da_reduce8(part[g]);
    }
    for (int g = 0; g < G; g++)
        for (int t = nt; t < nt8; t++) S[g * ld_s + t] = -INFINITY;
}

// O[g] += sum_t S[g][t] V_t for G rows (V row t at vrow[t] + voff), each V chunk loaded once for all rows; the
// next tile's rows prefetched as in da_qk.
static inline __attribute__((always_inline)) void da_pv(const float *restrict S, int ld_s, const int G, const int D,
                                                        const float *const *vrow, int64_t voff, int nt,
                                                        const float *const *nvrow, int nn, float *restrict O) {
    int c0 = 0;
    for (; c0 + 32 <= D; c0 += 32) {
        v8 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = *(v8 *)(O + g * D + c0 + 8 * c);
        for (int t = 0; t < nt; t++) {
            const float *vr = vrow[t] + voff + c0;
            if (nvrow && t < nn) {
                __builtin_prefetch(nvrow[t] + voff + c0, 0, DA_PF);
                __builtin_prefetch(nvrow[t] + voff + c0 + 16, 0, DA_PF);
            }
            v8 x0 = *(const v8 *)vr, x1 = *(const v8 *)(vr + 8), x2 = *(const v8 *)(vr + 16),
               x3 = *(const v8 *)(vr + 24);
            for (int g = 0; g < G; g++) {
                float p = S[g * ld_s + t];
                acc[g][0] += p * x0;
                acc[g][1] += p * x1;
                acc[g][2] += p * x2;
                acc[g][3] += p * x3;
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) *(v8 *)(O + g * D + c0 + 8 * c) = acc[g][c];
    }
    for (; c0 < D; c0 += 8) {
        v8 acc[4];
        for (int g = 0; g < G; g++) acc[g] = *(v8 *)(O + g * D + c0);
        for (int t = 0; t < nt; t++) {
            v8 x = *(const v8 *)(vrow[t] + voff + c0);
            for (int g = 0; g < G; g++) acc[g] += S[g * ld_s + t] * x;
        }
        for (int g = 0; g < G; g++) *(v8 *)(O + g * D + c0) = acc[g];
    }
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

// row pointers of keys [t0, t0 + n) (K and V, head 0), a block at a time
static inline void da_rows_of(const float *k, int64_t k_b, int64_t k_t, const float *v, int64_t v_b, int64_t v_t,
                              const int32_t *table, int block_size, int t0, int n, const float **krow,
                              const float **vrow) {
    for (int t = 0; t < n;) {
        int pos = t0 + t, off = pos % block_size, c = block_size - off < n - t ? block_size - off : n - t;
        int64_t b = table[pos / block_size];
        const float *kb = k + b * k_b + (int64_t)off * k_t, *vb = v + b * v_b + (int64_t)off * v_t;
        for (int i = 0; i < c; i++) {
            krow[t + i] = kb + (int64_t)i * k_t;
            vrow[t + i] = vb + (int64_t)i * v_t;
        }
        t += c;
    }
}

// Query rows of KV heads [h0, h1) of one sequence against keys [lo, hi), in tiles of DA_TILE keys: per tile,
// QKᵀ of every head (the tile's K rows read in address order, the next tile's prefetched alongside), the
// softmax step, then PV likewise. Q: scaled queries [rows][D] (row = (h - h0) * group + g); O: the results.
// Scratch: S rows x DA_TILE, m/l rows each, 4 x DA_TILE row pointers.
static inline __attribute__((always_inline)) void da_heads_impl(
    const float *restrict Q, float *restrict O, int h0, int h1, int group, const float *k, int64_t k_b,
    int64_t k_t, int64_t k_h, const float *v, int64_t v_b, int64_t v_t, int64_t v_h, const int32_t *table,
    int block_size, int lo, int hi, const int D, float *restrict S, float *m, float *l, const float **ptrs) {
    const int rows = (h1 - h0) * group;
    const float **krow = ptrs, **vrow = ptrs + DA_TILE, **nkrow = ptrs + 2 * DA_TILE, **nvrow = ptrs + 3 * DA_TILE;
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(O, 0, sizeof(float) * rows * D);
    int nt = hi - lo < DA_TILE ? hi - lo : DA_TILE;
    da_rows_of(k, k_b, k_t, v, v_b, v_t, table, block_size, lo, nt, krow, vrow);
    for (int t0 = lo; t0 < hi; t0 += DA_TILE) {
        int nn = hi - (t0 + nt) < DA_TILE ? hi - (t0 + nt) : DA_TILE;  // the next tile's keys
        if (nn > 0) da_rows_of(k, k_b, k_t, v, v_b, v_t, table, block_size, t0 + nt, nn, nkrow, nvrow);
        const int nt8 = (nt + 7) & ~7;
        for (int h = h0; h < h1; h++)
            for (int g0 = 0; g0 < group; g0 += 4) {
                int r0 = (h - h0) * group + g0, G = group - g0 < 4 ? group - g0 : 4;
                const float *const *pf = g0 == 0 && nn > 0 ? nkrow : NULL;
                switch (G) {
                    case 1: da_qk(Q + r0 * D, 1, D, krow, h * k_h, nt, pf, nn, S + r0 * DA_TILE, DA_TILE); break;
                    case 2: da_qk(Q + r0 * D, 2, D, krow, h * k_h, nt, pf, nn, S + r0 * DA_TILE, DA_TILE); break;
                    case 3: da_qk(Q + r0 * D, 3, D, krow, h * k_h, nt, pf, nn, S + r0 * DA_TILE, DA_TILE); break;
                    default: da_qk(Q + r0 * D, 4, D, krow, h * k_h, nt, pf, nn, S + r0 * DA_TILE, DA_TILE);
                }
            }
        for (int r = 0; r < rows; r++) da_softmax_row(S + r * DA_TILE, nt8, m + r, l + r, O + r * D, D);
        for (int h = h0; h < h1; h++)
            for (int g0 = 0; g0 < group; g0 += 4) {
                int r0 = (h - h0) * group + g0, G = group - g0 < 4 ? group - g0 : 4;
                const float *const *pf = g0 == 0 && nn > 0 ? nvrow : NULL;
                switch (G) {
                    case 1: da_pv(S + r0 * DA_TILE, DA_TILE, 1, D, vrow, h * v_h, nt, pf, nn, O + r0 * D); break;
                    case 2: da_pv(S + r0 * DA_TILE, DA_TILE, 2, D, vrow, h * v_h, nt, pf, nn, O + r0 * D); break;
                    case 3: da_pv(S + r0 * DA_TILE, DA_TILE, 3, D, vrow, h * v_h, nt, pf, nn, O + r0 * D); break;
                    default: da_pv(S + r0 * DA_TILE, DA_TILE, 4, D, vrow, h * v_h, nt, pf, nn, O + r0 * D);
                }
            }
        const float **tk = krow, **tv = vrow;  // the next tile's pointers become the current ones
        krow = nkrow;
        vrow = nvrow;
        nkrow = tk;
        nvrow = tv;
        nt = nn;
    }
    for (int r = 0; r < rows; r++) {
        float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) O[r * D + d] *= inv;
    }
}

static void da_heads(const float *Q, float *O, int h0, int h1, int group, const float *k, int64_t k_b, int64_t k_t,
                     int64_t k_h, const float *v, int64_t v_b, int64_t v_t, int64_t v_h, const int32_t *table,
                     int block_size, int lo, int hi, int D, float *S, float *m, float *l, const float **ptrs) {
#define DA(d) da_heads_impl(Q, O, h0, h1, group, k, k_b, k_t, k_h, v, v_b, v_t, v_h, table, block_size, lo, hi, d, \
                            S, m, l, ptrs)
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
static int da_decode(const float *q, int64_t q_s, int64_t q_h, const float *k, int64_t k_b, int64_t k_t,
                     int64_t k_h, const float *v, int64_t v_b, int64_t v_t, int64_t v_h, const int32_t *tables,
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
        const float **ptrs = malloc(sizeof(float *) * 4 * DA_TILE);
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
            da_heads(Q, O, h0, h0 + per_task, group, k, k_b, k_t, k_h, v, v_b, v_t, v_h, tables + s * tab_s,
                     block_size, c0, c1, D, S, m, l, ptrs);
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
    if (head_dim % 8 == 0)
        return da_decode(q, q_s, q_h, k, k_b, k_t, k_h, v, v_b, v_t, v_h, tables, tab_s, seq_lens, out, o_s, o_h,
                         num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, scale, window, num_threads);
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

static int pf_cmp(const void *a, const void *b) {
    int64_t wa = ((const pf_task_t *)a)->work, wb = ((const pf_task_t *)b)->work;
    return wa < wb ? 1 : wa > wb ? -1 : 0;
}

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
// krow/vrow PF_KEYS pointers each.
static void pf_task(const pf_task_t *task, const float *q, int64_t q_s, int64_t q_h, const float *k, int64_t k_b,
                    int64_t k_t, int64_t k_h, const float *v, int64_t v_b, int64_t v_t, int64_t v_h,
                    const int32_t *tables, int64_t tab_s, const int32_t *cu, const int32_t *seq_lens, float *out,
                    int64_t o_s, int64_t o_h, int group, int D, int block_size, float scale, int window, float *buf,
                    int *ibuf, const float **krow, const float **vrow) {
    const int s = task->seq, h = task->kv_head, c0 = task->c0, ntok = task->c1 - task->c0;
    const int n = cu[s + 1] - cu[s], kv_len = seq_lens[s], q0 = cu[s];
    const int rows = ntok * group, rows8 = (rows + 7) & ~7;
    const int32_t *table = tables + (int64_t)s * tab_s;
    float *Q = buf, *O = Q + (int64_t)rows8 * D, *S = O + (int64_t)rows8 * D, *KT = S + (int64_t)rows8 * PF_KEYS,
          *m = KT + 16 * D, *l = m + rows8;
    int *lo_of = ibuf, *hi_of = ibuf + rows8;
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
        da_rows_of(k + (int64_t)h * k_h, k_b, k_t, v + (int64_t)h * v_h, v_b, v_t, table, block_size, kt0, nk, krow,
                   vrow);
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

// Prefill attention for all sequences of a step. cu: int32 [num_seqs + 1] query-row offsets; seq_lens: K/V
// length incl. the new tokens (the caller checked n <= seq_lens[s] and the tables). head_dim a multiple of 8.
// Returns 0, or -1 if an allocation failed.
int duet_prefill_attention_f32(const float *q, int64_t q_s, int64_t q_h, const float *k, int64_t k_b, int64_t k_t,
                               int64_t k_h, const float *v, int64_t v_b, int64_t v_t, int64_t v_h,
                               const int32_t *tables, int64_t tab_s, const int32_t *cu, const int32_t *seq_lens,
                               float *out, int64_t o_s, int64_t o_h, int num_seqs, int num_q_heads, int num_kv_heads,
                               int head_dim, int block_size, float scale, int window, int num_threads) {
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
        int ok = buf && ibuf && ptrs;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntasks; i++)
            if (ok)
                pf_task(&tasks[i], q, q_s, q_h, k, k_b, k_t, k_h, v, v_b, v_t, v_h, tables, tab_s, cu, seq_lens, out,
                        o_s, o_h, group, head_dim, block_size, scale, window, buf, ibuf, ptrs, ptrs + PF_KEYS);
        free(buf);
        free(ibuf);
        free(ptrs);
    }
    free(tasks);
    return failed ? -1 : 0;
}
