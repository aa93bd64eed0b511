// duet's batched LoRA for the CPU path, called from kernels/cpu_lora.py through ctypes: SGMV (Punica, S-LoRA) over a
// per-token adapter slot, added in place into the base projection's fp32 output:
//   h[t, j]  = scaling[s] * sum_k x[t, k] * A_sh[s, j, k]          (shrink, j < r = ranks[s, sh]; s = token_slots[t])
//   out[t, c] += sum_{j < r} h[t, j] * B_sh[s, c, j]               (expand, c in shard sh's columns)
// for every token whose slot s is not -1 (-1: the base model alone, skipped), for each shard sh of the projection
// (q/k/v and gate/up are fused: S shards, each its own A and B over its own columns of out). x, h and out are fp32;
// the weights are stored fp32, bf16 or fp16 (LoraGeom.w_type), widened exactly on load (lora_kernels.h: one set of
// kernels per storage type), so 16-bit weights halve the bytes read and change nothing else.
//
// The weights live in the slots' packed layout (kernels/cpu_lora.py ``PackedLoraSlots`` writes it): one region of
// ``slot_len`` elements per slot, in it for each shard in order, at its adapter's own rank r (0: the adapter does
// not touch that shard; nothing stored, nothing read):
//   A: ceil(r / 4) tiles of 4 rows; tile i is KC = ceil(K / 16) chunks of [4 rows][16 k], rows past r and k past K 0
//   B: ceil(n_sh / 16) blocks of 16 columns, in groups of GROUP (the last group what is left), a group of g blocks
//      stored [r][g][16]: row j of all its blocks side by side (B[16b .. 16b + 15, j]), columns past n_sh 0
// so one slot's work reads one contiguous run of memory front to back, exactly its adapter's bytes (no zero blocks
// of a fused projection, no rank padding): at decode, where every adapter's weights come from memory, the bytes
// read are what bounds the kernel (kernels/cpu_lora.py has the figures).
//
// Work: the tokens grouped by slot once per call (a counting sort), then tasks of (slot, up to 32 of its tokens),
// halved until there are at least as many tasks as threads (a lone adapter's tokens still split). A task does its
// slot's shrink then expand shard by shard: each adapter's weights read once per task, never once per token, and
// no barrier between the two. OpenMP: each thread one contiguous run of tasks of about equal cost (weights read and
// multiply-adds: adapters of different ranks are different work). The shrink: register tiles of up to 4 tokens x 4
// A rows (AVX-512: as many tokens as the tile has; AVX2: 4 x 2, a short tile repeating its last token). The
// expand: a group's 4 column blocks x up to 2 tokens (2 blocks x up to 4 tokens), out's 16 columns held in a
// register per token and block while the rank runs, the group's rows read in order. Every h[t, j] and out[t, c] is
// computed by the same instructions in the same order wherever it falls: a token's result depends on its slot and
// its row of x only, not on the batch around it nor the thread count (a padded, recorded step and the eager one
// agree to the bit).
//
// Instruction sets (quant_common.h): every variant compiled into every build with gcc target attributes, the
// level chosen per call (``isa``: the best this CPU takes unless forced lower): ISA_AVX512 and above run the
// AVX-512 kernels, ISA_AVX2 the AVX2 ones, ISA_SCALAR the portable C (k and the rank in order).
//
// Returns 0; 1 if a token's slot is outside [-1, n_slots) (nothing written); 2 if the geometry is not one this
// layout holds (S outside [1, LORA_MAX_SHARDS], the shards' columns not a partition of [0, N], a slot's regions
// past slot_len); 3 if scratch memory could not be allocated; 4 for an unknown w_type; 5 if a rank is outside
// [0, R]. Checked on every call: a replayed step (kernels/cpu_graph.py) never reads outside the slots' weights.
#include <omp.h>
#include <stdlib.h>

#include "quant_common.h"

#define TB 4             // tokens per register tile
#define TASK_TOKENS 32   // tokens per task at most
#define GROUP 4          // B's column blocks interleaved row by row in groups of this many
#define PREFETCH 2048    // bytes ahead of the loads in a slot's weights, fetched meanwhile
#define LORA_MAX_SHARDS 8
#define W_F32 0  // the weights' storage types (w_type)
#define W_BF16 1
#define W_F16 2

typedef struct {  // kernels/cpu_lora.py ``_Geometry`` mirrors it
    int64_t K, N, S, R, n_slots, slot_len, w_type;
    int64_t cols[LORA_MAX_SHARDS + 1];  // shard sh's columns of out: cols[sh] .. cols[sh + 1]
} LoraGeom;

typedef struct {
    float *out;
    int64_t out_s;
    const float *x;
    int64_t x_s;
    const LoraGeom *g;
    int64_t KC, SR;           // k chunks of 16; h's row length S * R
    const void *w;            // [n_slots, slot_len] in the weights' storage type
    const int64_t *ranks;     // [n_slots, S]
    const float *scaling;
    float *h;                 // [T, S * R] scratch
    const int64_t *order;     // token indices sorted by slot
} Lora;

typedef struct {
    int64_t slot, first, count;  // tokens order[first .. first + count)
} Task;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// a shard's A and B at rank r, in elements
static inline int64_t a_elems(int64_t r, int64_t KC) { return (r + 3) / 4 * KC * 64; }
static inline int64_t b_elems(int64_t r, int64_t cols) { return (cols + 15) / 16 * r * 16; }

// the expand's token tile from token i0 of the task: each token's out row at column `col` and h row at h0; returns
// how many tokens (1 .. TB)
static inline int tile_rows(const Lora *p, const Task *tk, int64_t i0, int64_t col, int64_t h0, float **o,
                            const float **h) {
    const int nt = (int)min64(TB, tk->count - i0);
    for (int q = 0; q < nt; q++) {
        const int64_t t = p->order[tk->first + i0 + q];
        o[q] = p->out + t * p->out_s + col;
        h[q] = p->h + t * p->SR + h0;
    }
    return nt;
}

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
#endif

// one set of kernels per storage type of the weights (lora_kernels.h)
#define W_T float
#define W_NAME(f) f##_f32
#define W_AT(p, i) ((p)[i])
#define W_LOAD16(p) _mm512_loadu_ps(p)
#define W_LOAD8(p) _mm256_loadu_ps(p)
#include "lora_kernels.h"
#undef W_T
#undef W_NAME
#undef W_AT
#undef W_LOAD16
#undef W_LOAD8

#define W_T uint16_t
#define W_NAME(f) f##_bf16
#define W_AT(p, i) bf16_at(p, i)
#define W_LOAD16(p) bf16x16(_mm256_loadu_si256((const __m256i *)(p)))
#define W_LOAD8(p) bf16x8(_mm_loadu_si128((const __m128i *)(p)))
#include "lora_kernels.h"
#undef W_NAME
#undef W_AT
#undef W_LOAD16
#undef W_LOAD8

#define W_NAME(f) f##_f16
#define W_AT(p, i) half_to_float((p)[i])
#define W_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define W_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#include "lora_kernels.h"

// ------------------------------------------------------------------------------------------ entry point

typedef void (*TasksFn)(const Lora *, const Task *, const double *, int64_t, int, int, int);
static const TasksFn TASKS[3] = {run_tasks_f32, run_tasks_bf16, run_tasks_f16};

static int check_geometry(const LoraGeom *g, const int64_t *ranks) {
    if (g->S < 1 || g->S > LORA_MAX_SHARDS || g->R < 1 || g->K < 1 || g->cols[0] != 0 || g->cols[g->S] != g->N)
        return 2;
    const int64_t KC = (g->K + 15) / 16;
    int64_t full = 0;
    for (int64_t sh = 0; sh < g->S; sh++) {
        if (g->cols[sh + 1] < g->cols[sh]) return 2;
        full += a_elems(g->R, KC) + b_elems(g->R, g->cols[sh + 1] - g->cols[sh]);
    }
    if (full > g->slot_len) return 2;
    for (int64_t i = 0; i < g->n_slots * g->S; i++)
        if (ranks[i] < 0 || ranks[i] > g->R) return 5;
    return 0;
}

int duet_lora_packed_f32(float *out, int64_t out_s, const float *x, int64_t x_s, int64_t T, const LoraGeom *g,
                         const void *w, const int64_t *ranks, const float *scaling, const int64_t *token_slots,
                         int isa, int num_threads) {
    if (g->w_type < W_F32 || g->w_type > W_F16) return 4;
    const int bad = check_geometry(g, ranks);
    if (bad) return bad;
    const int64_t n_slots = g->n_slots, S = g->S;
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
    int64_t rank_sum = 0;  // the work per token, for the decision to go parallel
    for (int64_t i = 0; i < n_slots * S; i++) rank_sum += ranks[i];
    if (lora_tokens == 0 || rank_sum == 0) {
        free(counts);
        return 0;
    }
    int64_t *order = malloc(sizeof(int64_t) * (size_t)lora_tokens);
    int64_t *fill = calloc((size_t)n_slots, sizeof(int64_t));
    float *h = malloc(sizeof(float) * (size_t)(T * S * g->R));
    Task *tasks = malloc(sizeof(Task) * (size_t)(lora_tokens + n_slots));
    double *cost = malloc(sizeof(double) * (size_t)(lora_tokens + n_slots + 1));
    if (!order || !fill || !h || !tasks || !cost) {
        free(counts), free(order), free(fill), free(h), free(tasks), free(cost);
        return 3;
    }
    for (int64_t s = 0; s < n_slots; s++) counts[s + 1] += counts[s];  // counts[s]: slot s's first token in order
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = token_slots[t];
        if (s >= 0) order[counts[s] + fill[s]++] = t;
    }
    // tasks of `chunk` tokens of one slot (a slot that holds nothing in this projection: none), at least as many as
    // threads while a chunk can shrink
    int64_t n_tasks = 0;
    for (int64_t chunk = TASK_TOKENS;; chunk /= 2) {
        n_tasks = 0;
        for (int64_t s = 0; s < n_slots; s++) {
            int64_t any = 0;
            for (int64_t sh = 0; sh < S; sh++) any += ranks[s * S + sh];
            if (!any) continue;
            for (int64_t f = counts[s]; f < counts[s + 1]; f += chunk)
                tasks[n_tasks++] = (Task){s, f, min64(chunk, counts[s + 1] - f)};
        }
        if (n_tasks >= num_threads || chunk <= TB) break;
    }
    // a task's cost: its slot's weights (read once) and its tokens' multiply-adds with them
    cost[0] = 0.0;
    for (int64_t i = 0; i < n_tasks; i++) {
        double bytes = 0.0;
        for (int64_t sh = 0; sh < S; sh++)
            bytes += (double)ranks[tasks[i].slot * S + sh] * (double)(g->K + g->cols[sh + 1] - g->cols[sh]);
        cost[i + 1] = cost[i] + bytes * (double)(tasks[i].count + 4);
    }
    const Lora p = {out, out_s, x, x_s, g, (g->K + 15) / 16, S * g->R, w, ranks, scaling, h, order};
    const int level = isa_level(isa), v = level >= ISA_AVX512 ? 2 : level >= ISA_AVX2 ? 1 : 0;
    // a thread team costs a few microseconds: worth it past ~64k multiply-adds
    const int parallel = num_threads > 1 && n_tasks > 1 && lora_tokens * (g->K + g->N) * g->R >= 65536;
    TASKS[g->w_type](&p, tasks, cost, n_tasks, v, parallel, num_threads);
    free(counts), free(order), free(fill), free(h), free(tasks), free(cost);
    return 0;
}
