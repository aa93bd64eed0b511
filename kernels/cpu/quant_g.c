// duet's group-quantized linears (GPTQ / AWQ / compressed-tensors weights, kernels/quant_group.py) for the CPU
// path, called from kernels/cpu_quant_group.py through ctypes.
//
// Packed layout (cpu_quant_group.pack): rows in groups of 8 (the last padded with zero rows), 32-weight blocks
// along each row, arrays apart:
//   qs     uint8 [groups, nb, 8 * qb]: block b of the group's 8 rows, qb bytes each (4 bits: 16 bytes, byte j =
//          q[j] | q[j + 16] << 4, ggml's nibble order; 8 bits: 32 bytes, byte j = q[j]), interleaved in 4-byte
//          chunks: byte c * 32 + r * 4 + t is row r's byte 4 * c + t (kernels/cpu/quant.c's layout).
//   scales [groups, ng, 8] in the checkpoint's dtype (scale_kind 0 fp16, 1 bf16, 2 fp32), one per row and group
//          of gs = 32 * bpg weights (ng = cols / gs); zeros int16 [groups, ng, 8] alike.
// A group's scale and zero are read once per gs weights of its 8 rows, so the bytes are the checkpoint's plus
// one int16 zero per group instead of its packed one.
//
// linear_f32: x stays fp32. Per group of gs weights and 8 rows, the quants are widened to fp32 in registers exactly
// as quant.c's fp32 kernel widens Q4_1's (4 bits: the nibble, 0..15) and Q8_0's (8 bits: q - 128, the byte's top bit
// flipped: signed): one pshufb puts each byte on top of its int32 lane, (q - c) * 2^24, converted exactly, FMAed
// against x broadcast; per group, with c = 128 for 8 bits and 0 for 4 bits,
//   acc += (s * 2^-24) * sum_j(x_j * (q_j - c) * 2^24) - ((z - c) * s) * sum_j(x_j)
// (sums of x per group once per call), which is sum_j x_j * (q_j - z) * s reordered: the reference
// (kernels/quant_group.py) rounds w = (q - z) * s first and sums x * w. Symmetric 8-bit weights (z = 128) have no
// second term: the same products as the reference. The zero's term is Q4_1's min * sum(x) form; measured
// (bench/kernels/quant_group_gemv.py, 2 threads, groups of 128, Qwen2.5-1.5B shapes 8960x1536 / 1536x8960, M = 1,
// runs under the lock, ~10 % noise between runs): this form against (q - z) subtracted per weight in integers:
// 8 bits 465 / 503 vs 502 / 521 us (one run each), 4 bits 420-426 / 431-441 vs 454-481 / 458 us (two runs each).
// The subtraction is exact but costs an instruction per 8 weights (8 bits: in int32) or per 4 (4 bits: in bytes).
// The scalar twin (no AVX2/FMA/F16C, or forced) computes the same per-group sums in j order.
//
// dequantize: rows (q - z) * s in fp32, one rounding, exactly the reference (prefill tiles for torch's GEMM).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_common.h"

#define MT 4  // rows of x per pass over a group's weights

typedef struct {
    int bits, qb, scale_kind;
    const uint8_t *qs;
    const void *scales;
    const int16_t *zeros;
    int64_t nb, ng, bpg;  // blocks per row, groups per row, blocks per group
} GWeights;

static GWeights gweights(int bits, int scale_kind, const uint8_t *qs, const void *scales, const int16_t *zeros,
                         int64_t cols, int64_t group_size) {
    GWeights w = {bits, bits == 4 ? 16 : 32, scale_kind, qs, scales, zeros, cols / 32, cols / group_size,
                  group_size / 32};
    return w;
}

// entry i of a [groups, ng, 8] scale array as fp32
static inline float scale_at(const GWeights *w, int64_t i) {
    if (w->scale_kind == 2) return ((const float *)w->scales)[i];
    uint16_t h = ((const uint16_t *)w->scales)[i];
    if (w->scale_kind == 0) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// index of row n's entry for group k in the [groups, ng, 8] arrays
static inline int64_t gat(const GWeights *w, int64_t n, int64_t k) { return ((n / 8) * w->ng + k) * 8 + n % 8; }

// ------------------------------------------------------------------------------------------ scalar twins

// block b of row n as its 32 unsigned quants
static void expand_g_scalar(const GWeights *w, int64_t n, int64_t b, int q[32]) {
    const uint8_t *s = w->qs + ((n / 8) * w->nb + b) * 8 * w->qb + (n % 8) * 4;
    if (w->bits == 8) {
        for (int j = 0; j < 32; j++) q[j] = s[(j / 4) * 32 + j % 4];
        return;
    }
    for (int j = 0; j < 16; j++) {
        uint8_t byte = s[(j / 4) * 32 + j % 4];
        q[j] = byte & 15;
        q[j + 16] = byte >> 4;
    }
}

static void dequant_row_g_scalar(const GWeights *w, int64_t n, float *out) {
    int q[32];
    for (int64_t k = 0; k < w->ng; k++) {
        float s = scale_at(w, gat(w, n, k));
        int z = w->zeros[gat(w, n, k)];
        for (int64_t b = k * w->bpg; b < (k + 1) * w->bpg; b++) {
            expand_g_scalar(w, n, b, q);
            for (int j = 0; j < 32; j++) out[b * 32 + j] = (float)(q[j] - z) * s;
        }
    }
}

// out[i] = row n . x_i for the mc rows of x (fp32, row stride x_s; xs their per-group sums [mc, ng]), in the AVX2
// kernel's form: per group sum_j(x_j * (q_j - c)) * s - (z - c) * s * sum_j(x_j), c = 128 for 8 bits, else 0
static void row_g_scalar(const GWeights *w, int64_t n, const float *x, int64_t x_s, const float *xs, int mc,
                         float *out) {
    const int c = w->bits == 8 ? 128 : 0;
    int q[32];
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int64_t k = 0; k < w->ng; k++) {
        float s = scale_at(w, gat(w, n, k)), sum[MT] = {0};
        float zs = (float)(w->zeros[gat(w, n, k)] - c) * s;
        for (int64_t b = k * w->bpg; b < (k + 1) * w->bpg; b++) {
            expand_g_scalar(w, n, b, q);
            for (int i = 0; i < mc; i++)
                for (int j = 0; j < 32; j++) sum[i] += x[i * x_s + b * 32 + j] * (float)(q[j] - c);
        }
        for (int i = 0; i < mc; i++) out[i] += sum[i] * s - zs * xs[i * w->ng + k];
    }
}

// ------------------------------------------------------------------------------------------ AVX2 + FMA + F16C
#ifdef HAVE_X86

// the 8 rows' scales of group k as fp32 lanes
AVX2 static inline __m256 scales8(const GWeights *w, int64_t i) {
    if (w->scale_kind == 2) return _mm256_loadu_ps((const float *)w->scales + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w->scales + i));
    if (w->scale_kind == 0) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// the 8 rows' zeros of group k as int32 lanes
AVX2 static inline __m256i zeros8(const GWeights *w, int64_t i) {
    return _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(w->zeros + i)));
}

// chunk c (0..7) of a group-block: weights 4c..4c+3 of its 8 rows, one unsigned byte each (lane r: row r)
AVX2 static inline __attribute__((always_inline)) void expand_g_avx2(const int bits, const uint8_t *qgb,
                                                                      __m256i v[8]) {
    if (bits == 8) {
        for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(qgb + c * 32));
        return;
    }
    const __m256i mask = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qgb + c * 32));
        v[c] = _mm256_and_si256(raw, mask);
        v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    }
}

// res[i] (lane r) = row 8g + r . x_i for mc rows of fp32 x (row stride x_s; xs: their per-group sums [mc, ng]);
// inlined with constant bits and mc. S chains per row of x keep the FMA latency hidden at small mc.
AVX2 static inline __attribute__((always_inline)) void group_g_avx2(const GWeights *w, const int bits, int64_t g,
                                                                     const float *x, int64_t x_s, const float *xs,
                                                                     const int mc, __m256 *res) {
    enum { S_MAX = 4 };
    const int S = mc == 1 ? 4 : mc == 2 ? 2 : 1;
    // byte t of each int32 lane moved to its top byte, the rest zero: lane = q' << 24 (signed)
    const __m256i top[4] = {
        _mm256_set_epi8(12, -1, -1, -1, 8, -1, -1, -1, 4, -1, -1, -1, 0, -1, -1, -1,
                        12, -1, -1, -1, 8, -1, -1, -1, 4, -1, -1, -1, 0, -1, -1, -1),
        _mm256_set_epi8(13, -1, -1, -1, 9, -1, -1, -1, 5, -1, -1, -1, 1, -1, -1, -1,
                        13, -1, -1, -1, 9, -1, -1, -1, 5, -1, -1, -1, 1, -1, -1, -1),
        _mm256_set_epi8(14, -1, -1, -1, 10, -1, -1, -1, 6, -1, -1, -1, 2, -1, -1, -1,
                        14, -1, -1, -1, 10, -1, -1, -1, 6, -1, -1, -1, 2, -1, -1, -1),
        _mm256_set_epi8(15, -1, -1, -1, 11, -1, -1, -1, 7, -1, -1, -1, 3, -1, -1, -1,
                        15, -1, -1, -1, 11, -1, -1, -1, 7, -1, -1, -1, 3, -1, -1, -1)};
    const __m256 unscale = _mm256_set1_ps(5.9604644775390625e-08f);  // 2^-24
    const __m256i center = _mm256_set1_epi32(bits == 8 ? 128 : 0);
    __m256 acc[MT];
    for (int i = 0; i < mc; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < w->ng; k++) {
        const int64_t gi = (g * w->ng + k) * 8;
        __m256 bs[MT][S_MAX];
        for (int i = 0; i < mc; i++)
            for (int c = 0; c < S; c++) bs[i][c] = _mm256_setzero_ps();
        for (int64_t b = k * w->bpg; b < (k + 1) * w->bpg; b++) {
            __m256i v[8];
            expand_g_avx2(bits, w->qs + (g * w->nb + b) * 8 * w->qb, v);
            for (int c = 0; c < 8; c++) {
                if (bits == 8) v[c] = _mm256_xor_si256(v[c], _mm256_set1_epi8((char)0x80));  // q - 128, signed
                for (int t = 0; t < 4; t++) {  // weight 4c + t of the 8 rows
                    __m256 q = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v[c], top[t]));
                    for (int i = 0; i < mc; i++)
                        bs[i][t % S] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(x + i * x_s + b * 32 + 4 * c + t),
                                                       bs[i][t % S]);
                }
            }
        }
        __m256 s = scales8(w, gi);
        __m256 zs = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(zeros8(w, gi), center)), s);
        s = _mm256_mul_ps(s, unscale);
        for (int i = 0; i < mc; i++) {
            __m256 sum = bs[i][0];
            if (S == 4) sum = _mm256_add_ps(_mm256_add_ps(bs[i][0], bs[i][1]), _mm256_add_ps(bs[i][2], bs[i][3]));
            if (S == 2) sum = _mm256_add_ps(bs[i][0], bs[i][1]);
            acc[i] = _mm256_fnmadd_ps(zs, _mm256_broadcast_ss(xs + i * w->ng + k), _mm256_fmadd_ps(sum, s, acc[i]));
        }
    }
    for (int i = 0; i < mc; i++) res[i] = acc[i];
}

typedef void (*GroupGFn)(const GWeights *, int64_t, const float *, int64_t, const float *, int, __m256 *);

#define GROUP_G_FN(B)                                                                                           \
    AVX2 static void group_g_avx2_##B(const GWeights *w, int64_t g, const float *x, int64_t x_s, const float *xs, \
                                      int mc, __m256 *res) {                                                    \
        switch (mc) {                                                                                           \
            case 4: group_g_avx2(w, B, g, x, x_s, xs, 4, res); break;                                           \
            case 3: group_g_avx2(w, B, g, x, x_s, xs, 3, res); break;                                           \
            case 2: group_g_avx2(w, B, g, x, x_s, xs, 2, res); break;                                           \
            default: group_g_avx2(w, B, g, x, x_s, xs, 1, res); break;                                          \
        }                                                                                                       \
    }
GROUP_G_FN(4) GROUP_G_FN(8)

// rows 8g + first .. 8g + first + count - 1 dequantized into out (row stride ld)
AVX2 static void dequant_group_g_avx2(const GWeights *w, int64_t g, int first, int count, float *out, int64_t ld) {
    for (int64_t k = 0; k < w->ng; k++) {
        const int64_t gi = (g * w->ng + k) * 8;
        float s[8];
        int32_t z[8];
        _mm256_storeu_ps(s, scales8(w, gi));
        _mm256_storeu_si256((__m256i *)z, zeros8(w, gi));
        for (int64_t b = k * w->bpg; b < (k + 1) * w->bpg; b++) {
            __m256i v[8];
            uint32_t chunks[8][8];  // [chunk][row]
            expand_g_avx2(w->bits, w->qs + (g * w->nb + b) * 8 * w->qb, v);
            for (int c = 0; c < 8; c++) _mm256_storeu_si256((__m256i *)chunks[c], v[c]);
            for (int r = first; r < first + count; r++) {
                uint32_t row[8];
                for (int c = 0; c < 8; c++) row[c] = chunks[c][r];
                __m128i lo = _mm_loadu_si128((const __m128i *)row), hi = _mm_loadu_si128((const __m128i *)(row + 4));
                __m128i h[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                float *o = out + (r - first) * ld + b * 32;
                for (int q = 0; q < 4; q++) {
                    __m256i iv = _mm256_sub_epi32(_mm256_cvtepu8_epi32(h[q]), _mm256_set1_epi32(z[r]));
                    _mm256_storeu_ps(o + 8 * q, _mm256_mul_ps(_mm256_cvtepi32_ps(iv), _mm256_set1_ps(s[r])));
                }
            }
        }
    }
}

#endif

// ------------------------------------------------------------------------------------------ entry points

// out[i * o_s + n] = x[i] . w[n] (+ bias[n]) with x in fp32 (see the top). perm (act-order; NULL: none): the
// kernel's column k is x's column perm[k], each in [0, cols) (checked once, at pack: kernels/cpu_quant_group.py);
// x's rows are gathered into that order once per call, in the pass that sums each group of x. Returns 0, or 1 when
// scratch memory could not be allocated.
int duet_group_linear_f32(int bits, int scale_kind, const uint8_t *qs, const void *scales, const int16_t *zeros,
                           int64_t rows, int64_t cols, int64_t group_size, const int64_t *perm, const float *x,
                           int64_t x_s, int64_t M, const float *bias, float *out, int64_t o_s, int force_scalar,
                           int num_threads) {
    GWeights w = gweights(bits, scale_kind, qs, scales, zeros, cols, group_size);
    int64_t groups = (rows + 7) / 8;
#ifdef HAVE_X86
    GroupGFn simd = !force_scalar && avx2_supported() ? (bits == 4 ? group_g_avx2_4 : group_g_avx2_8) : NULL;
#endif
    // sum(x) per row of x and group [M, ng], then (act-order) x's rows in the kernel's column order [M, cols]
    float *xs = malloc(sizeof(float) * (size_t)(M * w.ng + (perm ? M * cols : 0) + 1));
    if (!xs) return 1;
    float *xg = perm ? xs + M * w.ng : NULL;
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < w.ng; k++) {
            float sum = 0.0f;
            for (int64_t j = k * group_size; j < (k + 1) * group_size; j++) {
                float v = perm ? x[i * x_s + perm[j]] : x[i * x_s + j];
                if (xg) xg[i * cols + j] = v;
                sum += v;
            }
            xs[i * w.ng + k] = sum;
        }
    if (xg) {
        x = xg;
        x_s = cols;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t g = 0; g < groups; g++) {
        int count = rows - g * 8 < 8 ? (int)(rows - g * 8) : 8;
        for (int64_t i0 = 0; i0 < M; i0 += MT) {
            int mc = M - i0 < MT ? (int)(M - i0) : MT;
            const float *xi = x + i0 * x_s;
            float res[MT][8];
#ifdef HAVE_X86
            if (simd) {
                __m256 v[MT];
                simd(&w, g, xi, x_s, xs + i0 * w.ng, mc, v);
                for (int i = 0; i < mc; i++) _mm256_storeu_ps(res[i], v[i]);
            } else
#endif
                for (int r = 0; r < count; r++) {
                    float one[MT];
                    row_g_scalar(&w, g * 8 + r, xi, x_s, xs + i0 * w.ng, mc, one);
                    for (int i = 0; i < mc; i++) res[i][r] = one[i];
                }
            for (int i = 0; i < mc; i++)
                for (int r = 0; r < count; r++)
                    out[(i0 + i) * o_s + g * 8 + r] = res[i][r] + (bias ? bias[g * 8 + r] : 0.0f);
        }
    }
    free(xs);
    return 0;
}

// out [count, cols] = rows row0 .. row0 + count - 1 dequantized, exactly as kernels/quant_group.py (kernel column
// order: the permutation, if any, is the caller's)
void duet_group_dequantize(int bits, int scale_kind, const uint8_t *qs, const void *scales, const int16_t *zeros,
                           int64_t cols, int64_t group_size, int64_t row0, int64_t count, float *out,
                           int force_scalar, int num_threads) {
    GWeights w = gweights(bits, scale_kind, qs, scales, zeros, cols, group_size);
#ifdef HAVE_X86
    if (!force_scalar && avx2_supported()) {
        int64_t g0 = row0 / 8, g1 = (row0 + count + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
        for (int64_t g = g0; g < g1; g++) {
            int64_t lo = g * 8 > row0 ? g * 8 : row0, hi = g * 8 + 8 < row0 + count ? g * 8 + 8 : row0 + count;
            dequant_group_g_avx2(&w, g, (int)(lo - g * 8), (int)(hi - lo), out + (lo - row0) * cols, cols);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
    for (int64_t i = 0; i < count; i++) dequant_row_g_scalar(&w, row0 + i, out + i * cols);
}
