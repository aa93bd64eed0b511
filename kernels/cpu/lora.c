// duet's batched LoRA for the CPU path, called from kernels/cpu_lora.py through ctypes: SGMV (Punica, S-LoRA) over a
// per-token adapter slot, added in place into the base projection's fp32 output:
//   h[t, j]  = scaling[s] * sum_k x[t, k] * a[s, j, k]                 (shrink, j < S*R; s = token_slots[t])
//   out[t, c] += sum_{r < R} h[t, sh*R + r] * bt[s, sh*R + r, c]      (expand, c in shard sh's columns)
// for every token whose slot s is not -1 (-1: the base model alone, skipped). A fused projection's S shards
// (q/k/v, gate/up) hold their A stacked [S*R, K] and B block-diagonal, stored transposed as bt [S*R, N]:
// shard_cols [S+1] are the shards' column offsets in out, and the expand reads only the diagonal blocks. x, h and
// out are fp32; a and bt are stored fp32, bf16 or fp16 (w_type), widened exactly on load (lora_kernels.h: one set
// of kernels per storage type), so 16-bit weights halve the bytes read and change nothing else.
//
// The tokens are grouped by slot once per call (a counting sort), so each adapter's A and B are read once per
// call for all its tokens, never once per token. Work items: (slot, 32 tokens, 16 rows of A) for the shrink,
// (slot, 32 tokens, shard, 1024 columns) for the expand; OpenMP over each list, the shrink's items all done before
// the expand's (the barrier between the two loops). Static schedule: each thread takes a contiguous run of items,
// one stretch of the slots' weights (``schedule(dynamic, 1)`` measured the same within the 2-vCPU dev VM's noise:
// python -m bench.kernels.lora_cpu, 2026-11-28). The shrink: register tiles of 4 tokens x 4 A rows (AVX-512) /
// 4 x 2 (AVX2), the next tile's rows prefetched; a tile short of tokens or rows repeats its last one (results
// dropped). The expand: 4 B rows a pass (4 streams at once, the next pass's prefetched), FMAs into out's rows held
// in L1, then the rows past a multiple of 4 one at a time. So every h[t, j] and out[t, c] is computed by the same
// instructions in the same order wherever it falls: a token's result depends on its slot and its row of x only, not
// on the batch around it nor the thread count (a padded, recorded step and the eager one agree to the bit).
//
// Instruction sets (quant_common.h): every variant compiled into every build with gcc target attributes, the
// level chosen per call (``isa``: the best this CPU takes unless forced lower): ISA_AVX512 and above run the
// AVX-512 kernels, ISA_AVX2 the AVX2 ones, ISA_SCALAR the portable C (one token and one row/column at a time,
// k and r in order).
//
// Returns 0; 1 if a token's slot is outside [-1, n_slots) (nothing written); 2 if shard_cols is not a partition
// of [0, N] into S shards; 3 if scratch memory could not be allocated; 4 for an unknown w_type. Checked on every
// call: a replayed step (kernels/cpu_graph.py) never reads outside the slots' weights.
#include <stdlib.h>

#include "quant_common.h"

#define TOKENS_PER_ITEM 32
#define ROWS_PER_ITEM 16
#define COLS_PER_ITEM 1024
#define TB 4  // tokens per register tile
#define W_F32 0  // the weights' storage types (w_type)
#define W_BF16 1
#define W_F16 2

typedef struct {
    float *out;
    int64_t out_s;
    const float *x;
    int64_t x_s;
    int64_t K, N, SR, R;
    const void *a, *bt;   // [n_slots, SR, K], [n_slots, SR, N] in the weights' storage type
    const int64_t *shard_cols;
    const float *scaling;
    float *h;               // [T, SR] scratch
    const int64_t *order;   // token indices sorted by slot
} Lora;

typedef struct {
    int64_t slot, first, count, lo, hi;  // tokens order[first .. first + count), rows / columns [lo, hi)
    int64_t shard;                        // the expand's shard (its rows shard * R .. + R of bt)
} Item;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// the tile's token rows: x rows (or h rows) of tokens order[first + i], the last repeated past count
#define TILE_TOKENS(p, it, i0, tok)                                                   \
    int64_t tok[TB];                                                                  \
    for (int q_ = 0; q_ < TB; q_++) tok[q_] = (p)->order[(it)->first + min64((i0) + q_, (it)->count - 1)]

static inline float bf16_at(const uint16_t *p, int64_t i) {
    const uint32_t bits = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef HAVE_X86
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

// 16-bit weights widened to fp32: bf16 by a shift into the high half, fp16 by F16C
AVX512 static inline __m512 bf16x16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
AVX2 static inline __m256 bf16x8(__m128i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
AVX2 static inline __m128i u16x8_n(const uint16_t *p, int64_t n) {  // n < 8 of them, the rest 0
    uint16_t v[8] = {0};
    memcpy(v, p, (size_t)n * 2);
    return _mm_loadu_si128((const __m128i *)v);
}
#endif

// one set of kernels per storage type of the weights (lora_kernels.h)
#define W_T float
#define W_NAME(f) f##_f32
#define W_AT(p, i) ((p)[i])
#define W_LOAD16(p) _mm512_loadu_ps(p)
#define W_LOAD16Z(m, p) _mm512_maskz_loadu_ps(m, p)
#define W_LOAD8(p) _mm256_loadu_ps(p)
#define W_LOAD8N(p, n) _mm256_maskload_ps(p, lanes_avx2(n))
#include "lora_kernels.h"
#undef W_T
#undef W_NAME
#undef W_AT
#undef W_LOAD16
#undef W_LOAD16Z
#undef W_LOAD8
#undef W_LOAD8N

#define W_T uint16_t
#define W_NAME(f) f##_bf16
#define W_AT(p, i) bf16_at(p, i)
#define W_LOAD16(p) bf16x16(_mm256_loadu_si256((const __m256i *)(p)))
#define W_LOAD16Z(m, p) bf16x16(_mm256_maskz_loadu_epi16(m, p))
#define W_LOAD8(p) bf16x8(_mm_loadu_si128((const __m128i *)(p)))
#define W_LOAD8N(p, n) bf16x8(u16x8_n(p, n))
#include "lora_kernels.h"
#undef W_NAME
#undef W_AT
#undef W_LOAD16
#undef W_LOAD16Z
#undef W_LOAD8
#undef W_LOAD8N

#define W_NAME(f) f##_f16
#define W_AT(p, i) half_to_float((p)[i])
#define W_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define W_LOAD16Z(m, p) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p))
#define W_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define W_LOAD8N(p, n) _mm256_cvtph_ps(u16x8_n(p, n))
#include "lora_kernels.h"

// ------------------------------------------------------------------------------------------ entry point

typedef void (*ItemFn)(const Lora *, const Item *);

// [weight type][scalar, avx2, avx512]: the shrink's and the expand's kernels
static const ItemFn SHRINK[3][3] = {
#ifdef HAVE_X86
    {shrink_scalar_f32, shrink_avx2_f32, shrink_avx512_f32},
    {shrink_scalar_bf16, shrink_avx2_bf16, shrink_avx512_bf16},
    {shrink_scalar_f16, shrink_avx2_f16, shrink_avx512_f16},
#else
    {shrink_scalar_f32, shrink_scalar_f32, shrink_scalar_f32},
    {shrink_scalar_bf16, shrink_scalar_bf16, shrink_scalar_bf16},
    {shrink_scalar_f16, shrink_scalar_f16, shrink_scalar_f16},
#endif
};
static const ItemFn EXPAND[3][3] = {
#ifdef HAVE_X86
    {expand_scalar_f32, expand_avx2_f32, expand_avx512_f32},
    {expand_scalar_bf16, expand_avx2_bf16, expand_avx512_bf16},
    {expand_scalar_f16, expand_avx2_f16, expand_avx512_f16},
#else
    {expand_scalar_f32, expand_scalar_f32, expand_scalar_f32},
    {expand_scalar_bf16, expand_scalar_bf16, expand_scalar_bf16},
    {expand_scalar_f16, expand_scalar_f16, expand_scalar_f16},
#endif
};

int duet_lora_add_f32(float *out, int64_t out_s, const float *x, int64_t x_s, int64_t T, int64_t K, int64_t N,
                      const void *a, const void *bt, int w_type, int64_t n_slots, int64_t S, int64_t R,
                      const int64_t *shard_cols, const float *scaling, const int64_t *token_slots, int isa,
                      int num_threads) {
    if (w_type < W_F32 || w_type > W_F16) return 4;
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
    const int level = isa_level(isa), v = level >= ISA_AVX512 ? 2 : level >= ISA_AVX2 ? 1 : 0;
    const ItemFn shrink_fn = SHRINK[w_type][v], expand_fn = EXPAND[w_type][v];
    // a thread team costs a few microseconds: worth it past ~64k multiply-adds
    const int parallel = num_threads > 1 && lora_tokens * (K + N) * R >= 65536;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_shrink; i++) shrink_fn(&p, &shrink[i]);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_expand; i++) expand_fn(&p, &expand[i]);
    }
    free(counts), free(order), free(h), free(items);
    return 0;
}
