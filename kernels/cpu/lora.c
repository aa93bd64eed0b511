// duet's batched LoRA for the CPU path (fp32), called from kernels/cpu_lora.py through ctypes: SGMV (Punica,
// S-LoRA) over a per-token adapter slot, added in place into the base projection's output:
//   h[t, j]  = scaling[s] * sum_k x[t, k] * a[s, j, k]                 (shrink, j < S*R; s = token_slots[t])
//   out[t, c] += sum_{r < R} h[t, sh*R + r] * bt[s, sh*R + r, c]      (expand, c in shard sh's columns)
// for every token whose slot s is not -1 (-1: the base model alone, skipped). A fused projection's S shards
// (q/k/v, gate/up) hold their A stacked [S*R, K] and B block-diagonal, stored transposed as bt [S*R, N]:
// shard_cols [S+1] are the shards' column offsets in out, and the expand reads only the diagonal blocks.
//
// The tokens are grouped by slot once per call (a counting sort), so each adapter's A and B are read once per
// call for all its tokens, never once per token. Work items: (slot, 32 tokens, 16 rows of A) for the shrink,
// (slot, 32 tokens, shard, 256 columns) for the expand; OpenMP (dynamic) over each list, the shrink's items
// all done before the expand's (the barrier between the two loops). Register tiles of 4 tokens x 4 A rows
// (AVX-512) / 4 x 2 (AVX2) for the shrink, 4 tokens x 64 / 16 columns for the expand; a tile short of tokens
// or rows repeats its last one (results dropped), so every (token, row) and (token, column) is computed by the
// same instructions in the same order wherever it falls: a token's result depends on its slot and its row of
// x only, not on the batch around it nor the thread count (recorded and eager steps agree to the bit).
//
// Instruction sets (quant_common.h): every variant compiled into every build with gcc target attributes, the
// level chosen per call (``isa``: the best this CPU takes unless forced lower): ISA_AVX512 and above run the
// AVX-512 kernels, ISA_AVX2 the AVX2 ones, ISA_SCALAR the portable C (one token and one row/column at a time,
// k and r in order).
//
// Returns 0; 1 if a token's slot is outside [-1, n_slots) (nothing written); 2 if shard_cols is not a partition
// of [0, N] into S shards; 3 if scratch memory could not be allocated. Checked on every call: a replayed step
// (kernels/cpu_graph.py) never reads outside the slots' weights.
#include <stdlib.h>

#include "quant_common.h"

#define TOKENS_PER_ITEM 32
#define ROWS_PER_ITEM 16
#define COLS_PER_ITEM 1024
#define TB 4  // tokens per register tile

typedef struct {
    float *out;
    int64_t out_s;
    const float *x;
    int64_t x_s;
    int64_t K, N, SR, R;
    const float *a, *bt;  // [n_slots, SR, K], [n_slots, SR, N]
    const int64_t *shard_cols;
    const float *scaling;
    float *h;               // [T, SR] scratch
    const int64_t *order;   // token indices sorted by slot
} Lora;

typedef struct {
    int64_t slot, first, count, lo, hi;  // tokens order[first .. first + count), rows / columns [lo, hi)
    int64_t shard;                        // the expand's shard (its rows shard * R .. + R of bt)
} Item;

// ------------------------------------------------------------------------------------------ scalar

static void shrink_scalar(const Lora *p, const Item *it) {
    const float *A = p->a + it->slot * p->SR * p->K;
    const float scale = p->scaling[it->slot];
    for (int64_t i = 0; i < it->count; i++) {
        const int64_t t = p->order[it->first + i];
        const float *x = p->x + t * p->x_s;
        for (int64_t j = it->lo; j < it->hi; j++) {
            const float *a = A + j * p->K;
            float s = 0.0f;
            for (int64_t k = 0; k < p->K; k++) s += x[k] * a[k];
            p->h[t * p->SR + j] = s * scale;
        }
    }
}

static void expand_scalar(const Lora *p, const Item *it) {
    const int64_t j0 = it->shard * p->R;
    const float *B = p->bt + (it->slot * p->SR + j0) * p->N;
    for (int64_t i = 0; i < it->count; i++) {
        const int64_t t = p->order[it->first + i];
        const float *h = p->h + t * p->SR + j0;
        float *o = p->out + t * p->out_s;
        for (int64_t c = it->lo; c < it->hi; c++) {
            float acc = o[c];
            for (int64_t r = 0; r < p->R; r++) acc += h[r] * B[r * p->N + c];
            o[c] = acc;
        }
    }
}

// ------------------------------------------------------------------------------------------ SIMD
#ifdef HAVE_X86
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// the tile's token rows: x rows (or h rows) of tokens order[first + i], the last repeated past count
#define TILE_TOKENS(p, it, i0, tok)                                                   \
    int64_t tok[TB];                                                                  \
    for (int q_ = 0; q_ < TB; q_++) tok[q_] = (p)->order[(it)->first + min64((i0) + q_, (it)->count - 1)]

AVX512 static void shrink_avx512(const Lora *p, const Item *it) {
    const int64_t K = p->K, kv = K / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (K - kv)) - 1u);
    const float *A = p->a + it->slot * p->SR * K;
    const float scale = p->scaling[it->slot];
    for (int64_t i0 = 0; i0 < it->count; i0 += TB) {
        TILE_TOKENS(p, it, i0, tok);
        const float *x[TB];
        for (int q = 0; q < TB; q++) x[q] = p->x + tok[q] * p->x_s;
        const int nt = (int)min64(TB, it->count - i0);
        for (int64_t j0 = it->lo; j0 < it->hi; j0 += 4) {
            const int nr = (int)min64(4, it->hi - j0);
            const float *a[4];
            for (int r = 0; r < 4; r++) a[r] = A + (j0 + min64(r, nr - 1)) * K;
            __m512 acc[TB][4];
            for (int q = 0; q < TB; q++)
                for (int r = 0; r < 4; r++) acc[q][r] = _mm512_setzero_ps();
            const float *next = A + min64(j0 + 4, p->SR - 1) * K;  // the next tile's rows, fetched meanwhile
            for (int64_t k = 0; k < kv; k += 16) {
                __m512 av[4];
                for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(next + r * K + k), _MM_HINT_T0);
                for (int r = 0; r < 4; r++) av[r] = _mm512_loadu_ps(a[r] + k);
                for (int q = 0; q < TB; q++) {
                    const __m512 xv = _mm512_loadu_ps(x[q] + k);
                    for (int r = 0; r < 4; r++) acc[q][r] = _mm512_fmadd_ps(xv, av[r], acc[q][r]);
                }
            }
            if (tail) {
                __m512 av[4];
                for (int r = 0; r < 4; r++) av[r] = _mm512_maskz_loadu_ps(tail, a[r] + kv);
                for (int q = 0; q < TB; q++) {
                    const __m512 xv = _mm512_maskz_loadu_ps(tail, x[q] + kv);
                    for (int r = 0; r < 4; r++) acc[q][r] = _mm512_fmadd_ps(xv, av[r], acc[q][r]);
                }
            }
            for (int q = 0; q < nt; q++)
                for (int r = 0; r < nr; r++) p->h[tok[q] * p->SR + j0 + r] = _mm512_reduce_add_ps(acc[q][r]) * scale;
        }
    }
}

// per B row r (in order), out[t, c] = fma(h[t, r], bt[r, c], out[t, c]) over the item's columns, out's rows in L1;
// nt (1 .. TB) a constant in each expansion, so the tokens' registers and pointers stay registers
AVX512 static inline __attribute__((always_inline)) void expand_rows_avx512(const Lora *p, const Item *it,
                                                                            const float *B, int64_t j0, int64_t i0,
                                                                            const int nt) {
    const int64_t N = p->N, cv = it->lo + (it->hi - it->lo) / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (it->hi - cv)) - 1u);
    float *o[TB];
    const float *h[TB];
    for (int q = 0; q < nt; q++) {
        const int64_t t = p->order[it->first + i0 + q];
        o[q] = p->out + t * p->out_s;
        h[q] = p->h + t * p->SR + j0;
    }
    int64_t r = 0;
    for (; r + 4 <= p->R; r += 4) {  // four B rows a pass: 4 streams read at once, out loaded and stored once
        const float *b = B + r * N;
        __m512 hv[TB][4];
        for (int q = 0; q < nt; q++)
            for (int i = 0; i < 4; i++) hv[q][i] = _mm512_set1_ps(h[q][r + i]);
        for (int64_t c = it->lo; c < cv; c += 16) {
            __m512 bv[4];
            for (int i = 0; i < 4; i++) bv[i] = _mm512_loadu_ps(b + i * N + c);
            for (int q = 0; q < nt; q++) {
                __m512 acc = _mm512_loadu_ps(o[q] + c);
                for (int i = 0; i < 4; i++) acc = _mm512_fmadd_ps(hv[q][i], bv[i], acc);
                _mm512_storeu_ps(o[q] + c, acc);
            }
        }
        if (tail) {
            __m512 bv[4];
            for (int i = 0; i < 4; i++) bv[i] = _mm512_maskz_loadu_ps(tail, b + i * N + cv);
            for (int q = 0; q < nt; q++) {
                __m512 acc = _mm512_maskz_loadu_ps(tail, o[q] + cv);
                for (int i = 0; i < 4; i++) acc = _mm512_fmadd_ps(hv[q][i], bv[i], acc);
                _mm512_mask_storeu_ps(o[q] + cv, tail, acc);
            }
        }
    }
    for (; r < p->R; r++) {  // the rows past a multiple of 4, one at a time (the same order of FMAs)
        const float *b = B + r * N;
        __m512 hv[TB];
        for (int q = 0; q < nt; q++) hv[q] = _mm512_set1_ps(h[q][r]);
        for (int64_t c = it->lo; c < cv; c += 16) {
            const __m512 bv = _mm512_loadu_ps(b + c);
            for (int q = 0; q < nt; q++)
                _mm512_storeu_ps(o[q] + c, _mm512_fmadd_ps(hv[q], bv, _mm512_loadu_ps(o[q] + c)));
        }
        if (tail) {
            const __m512 bv = _mm512_maskz_loadu_ps(tail, b + cv);
            for (int q = 0; q < nt; q++)
                _mm512_mask_storeu_ps(o[q] + cv, tail,
                                      _mm512_fmadd_ps(hv[q], bv, _mm512_maskz_loadu_ps(tail, o[q] + cv)));
        }
    }
}

AVX512 static void expand_avx512(const Lora *p, const Item *it) {
    const int64_t j0 = it->shard * p->R;
    const float *B = p->bt + (it->slot * p->SR + j0) * p->N;
    for (int64_t i0 = 0; i0 < it->count; i0 += TB) {
        switch (min64(TB, it->count - i0)) {
            case 1: expand_rows_avx512(p, it, B, j0, i0, 1); break;
            case 2: expand_rows_avx512(p, it, B, j0, i0, 2); break;
            case 3: expand_rows_avx512(p, it, B, j0, i0, 3); break;
            default: expand_rows_avx512(p, it, B, j0, i0, 4); break;
        }
    }
}

AVX2 static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// lanes 0 .. n - 1 set (n clamped to [0, 8]): _mm256_maskload_ps / maskstore masks
AVX2 static inline __m256i lanes_avx2(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)), idx);
}

AVX2 static void shrink_avx2(const Lora *p, const Item *it) {
    const int64_t K = p->K, kv = K / 8 * 8;
    const __m256i tail = lanes_avx2(K - kv);
    const float *A = p->a + it->slot * p->SR * K;
    const float scale = p->scaling[it->slot];
    for (int64_t i0 = 0; i0 < it->count; i0 += TB) {
        TILE_TOKENS(p, it, i0, tok);
        const float *x[TB];
        for (int q = 0; q < TB; q++) x[q] = p->x + tok[q] * p->x_s;
        const int nt = (int)min64(TB, it->count - i0);
        for (int64_t j0 = it->lo; j0 < it->hi; j0 += 2) {
            const int nr = (int)min64(2, it->hi - j0);
            const float *a[2] = {A + j0 * K, A + (j0 + nr - 1) * K};
            __m256 acc[TB][2];
            for (int q = 0; q < TB; q++) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
            const float *next = A + min64(j0 + 2, p->SR - 1) * K;  // the next tile's rows, fetched meanwhile
            for (int64_t k = 0; k < kv; k += 8) {
                if (!(k & 15)) {  // a line of each
                    _mm_prefetch((const char *)(next + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(next + K + k), _MM_HINT_T0);
                }
                const __m256 a0 = _mm256_loadu_ps(a[0] + k), a1 = _mm256_loadu_ps(a[1] + k);
                for (int q = 0; q < TB; q++) {
                    const __m256 xv = _mm256_loadu_ps(x[q] + k);
                    acc[q][0] = _mm256_fmadd_ps(xv, a0, acc[q][0]);
                    acc[q][1] = _mm256_fmadd_ps(xv, a1, acc[q][1]);
                }
            }
            if (kv < K) {
                const __m256 a0 = _mm256_maskload_ps(a[0] + kv, tail), a1 = _mm256_maskload_ps(a[1] + kv, tail);
                for (int q = 0; q < TB; q++) {
                    const __m256 xv = _mm256_maskload_ps(x[q] + kv, tail);
                    acc[q][0] = _mm256_fmadd_ps(xv, a0, acc[q][0]);
                    acc[q][1] = _mm256_fmadd_ps(xv, a1, acc[q][1]);
                }
            }
            for (int q = 0; q < nt; q++)
                for (int r = 0; r < nr; r++) p->h[tok[q] * p->SR + j0 + r] = hsum_avx2(acc[q][r]) * scale;
        }
    }
}

// expand_rows_avx512's loop, 8 columns a vector (the column tail masked)
AVX2 static inline __attribute__((always_inline)) void expand_rows_avx2(const Lora *p, const Item *it,
                                                                        const float *B, int64_t j0, int64_t i0,
                                                                        const int nt) {
    const int64_t N = p->N;
    float *o[TB];
    const float *h[TB];
    for (int q = 0; q < nt; q++) {
        const int64_t t = p->order[it->first + i0 + q];
        o[q] = p->out + t * p->out_s;
        h[q] = p->h + t * p->SR + j0;
    }
    int64_t r = 0;
    for (; r + 4 <= p->R; r += 4) {
        const float *b = B + r * N;
        __m256 hv[TB][4];
        for (int q = 0; q < nt; q++)
            for (int i = 0; i < 4; i++) hv[q][i] = _mm256_set1_ps(h[q][r + i]);
        for (int64_t c = it->lo; c < it->hi; c += 8) {
            const __m256i m = lanes_avx2(it->hi - c);
            __m256 bv[4];
            for (int i = 0; i < 4; i++) bv[i] = _mm256_maskload_ps(b + i * N + c, m);
            for (int q = 0; q < nt; q++) {
                __m256 acc = _mm256_maskload_ps(o[q] + c, m);
                for (int i = 0; i < 4; i++) acc = _mm256_fmadd_ps(hv[q][i], bv[i], acc);
                _mm256_maskstore_ps(o[q] + c, m, acc);
            }
        }
    }
    for (; r < p->R; r++) {
        const float *b = B + r * N;
        __m256 hv[TB];
        for (int q = 0; q < nt; q++) hv[q] = _mm256_set1_ps(h[q][r]);
        for (int64_t c = it->lo; c < it->hi; c += 8) {
            const __m256i m = lanes_avx2(it->hi - c);
            const __m256 bv = _mm256_maskload_ps(b + c, m);
            for (int q = 0; q < nt; q++)
                _mm256_maskstore_ps(o[q] + c, m, _mm256_fmadd_ps(hv[q], bv, _mm256_maskload_ps(o[q] + c, m)));
        }
    }
}

AVX2 static void expand_avx2(const Lora *p, const Item *it) {
    const int64_t j0 = it->shard * p->R;
    const float *B = p->bt + (it->slot * p->SR + j0) * p->N;
    for (int64_t i0 = 0; i0 < it->count; i0 += TB) {
        switch (min64(TB, it->count - i0)) {
            case 1: expand_rows_avx2(p, it, B, j0, i0, 1); break;
            case 2: expand_rows_avx2(p, it, B, j0, i0, 2); break;
            case 3: expand_rows_avx2(p, it, B, j0, i0, 3); break;
            default: expand_rows_avx2(p, it, B, j0, i0, 4); break;
        }
    }
}
#endif

// ------------------------------------------------------------------------------------------ entry point

typedef void (*ItemFn)(const Lora *, const Item *);

int duet_lora_add_f32(float *out, int64_t out_s, const float *x, int64_t x_s, int64_t T, int64_t K, int64_t N,
                      const float *a, const float *bt, int64_t n_slots, int64_t S, int64_t R,
                      const int64_t *shard_cols, const float *scaling, const int64_t *token_slots, int isa,
                      int num_threads) {
    if (shard_cols[0] != 0 || shard_cols[S] != N) return 2;
    for (int64_t s = 0; s < S; s++)
        if (shard_cols[s + 1] < shard_cols[s]) return 2;
    int64_t *counts = calloc((size_t)n_slots + 1, sizeof(int64_t));
    if (!counts) return 3;
    int64_t lora_tokens = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = token_slots[t];
        if (s < -1 || s >= n_slots) {
            free(counts);
            return 1;
        }
        if (s >= 0) counts[s + 1]++, lora_tokens++;
    }
    if (lora_tokens == 0) {
        free(counts);
        return 0;
    }
    const int64_t SR = S * R, chunks = (lora_tokens + TOKENS_PER_ITEM - 1) / TOKENS_PER_ITEM + n_slots;
    int64_t n_shrink = 0, n_expand = 0, max_shrink = chunks * ((SR + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM),
            max_expand = chunks * (S + (N + COLS_PER_ITEM - 1) / COLS_PER_ITEM);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)lora_tokens);
    float *h = malloc(sizeof(float) * (size_t)(T * SR));
    Item *items = malloc(sizeof(Item) * (size_t)(max_shrink + max_expand));
    if (!order || !h || !items) {
        free(counts), free(order), free(h), free(items);
        return 3;
    }
    for (int64_t s = 0; s < n_slots; s++) counts[s + 1] += counts[s];  // counts[s]: slot s's first token in order
    int64_t *fill = calloc((size_t)n_slots, sizeof(int64_t));
    if (!fill) {
        free(counts), free(order), free(h), free(items);
        return 3;
    }
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = token_slots[t];
        if (s >= 0) order[counts[s] + fill[s]++] = t;
    }
    Item *shrink = items, *expand = items + max_shrink;
    for (int64_t s = 0; s < n_slots; s++) {
        for (int64_t f = counts[s]; f < counts[s + 1]; f += TOKENS_PER_ITEM) {
            const int64_t n = counts[s + 1] - f < TOKENS_PER_ITEM ? counts[s + 1] - f : TOKENS_PER_ITEM;
            for (int64_t j = 0; j < SR; j += ROWS_PER_ITEM)
                shrink[n_shrink++] = (Item){s, f, n, j, j + ROWS_PER_ITEM < SR ? j + ROWS_PER_ITEM : SR, 0};
            for (int64_t sh = 0; sh < S; sh++)
                for (int64_t c = shard_cols[sh]; c < shard_cols[sh + 1]; c += COLS_PER_ITEM) {
                    const int64_t end = shard_cols[sh + 1];
                    expand[n_expand++] = (Item){s, f, n, c, c + COLS_PER_ITEM < end ? c + COLS_PER_ITEM : end, sh};
                }
        }
    }
    free(fill);
    const Lora p = {out, out_s, x, x_s, K, N, SR, R, a, bt, shard_cols, scaling, h, order};
    ItemFn shrink_fn = shrink_scalar, expand_fn = expand_scalar;
#ifdef HAVE_X86
    const int level = isa_level(isa);
    if (level >= ISA_AVX512) shrink_fn = shrink_avx512, expand_fn = expand_avx512;
    else if (level >= ISA_AVX2) shrink_fn = shrink_avx2, expand_fn = expand_avx2;
#else
    (void)isa;
#endif
    // a thread team costs a few microseconds: worth it past ~64k multiply-adds
    const int parallel = num_threads > 1 && lora_tokens * (K + N) * R >= 65536;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_shrink; i++) shrink_fn(&p, &shrink[i]);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_expand; i++) expand_fn(&p, &expand[i]);
    }
    free(counts), free(order), free(h), free(items);
    return 0;
}
