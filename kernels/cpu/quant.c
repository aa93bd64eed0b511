// duet's GGUF block-quantized linears for the CPU path, called from kernels/cpu_quant.py through ctypes.
//
// Packed layout (cpu_quant.pack): rows in groups of 8 (the last padded with zero rows), arrays apart:
//   qs  uint8 [groups, nb, 8 * qb]: block b of the group's 8 rows, their quant bytes (qb = 16 nibble bytes as
//       ggml lays them out, byte j = weight j | weight j + 16 << 4; or 32 int8 for Q8_0) interleaved in 4-byte
//       chunks: byte c * 32 + r * 4 + t is row r's byte 4 * c + t. One 32-byte load is chunk c of all 8 rows.
//   qh  uint32 [groups, nb, 8] (Q5_*: bit j is bit 4 of weight j), d and m fp16 [groups, nb, 8] (m: *_1 only).
// Scales stay fp16 (the group's 8 converted by one F16C instruction): the bytes are the file's, plus padding.
//
// linear (llama.cpp's method, on its 8-row repacked layout): x is quantized per 32-block to int8 (scale xd =
// amax / 127, round to nearest even) and, per block b of a row, with w = q * d + c (c = m for *_1, -offset * d
// for Q4_0 / Q5_0, 0 for Q8_0):
//   w . x_b = d * xd * (q . xq_b) + c * xs_b        (xs_b = xd * sum(xq_b))
// q . xq_b is exact in integers (_mm256_maddubs_epi16: one instruction is 4 weights of 8 rows against 4 bytes
// of x broadcast; int16 sums stay below 32767); the 8 lanes are the group's 8 rows, so a block's scale,
// conversion and FMA serve 8 rows at once, and no horizontal sum is needed. Threads over groups; each weight
// byte is read from memory once per call and from L1 once per 4 rows of x.
// The scalar twin (no AVX2/FMA/F16C, or forced) computes the same integer dots; only fp32 order differs.
//
// linear_f32 (activations="fp32", M < GEMM_ROWS_FP32): x stays fp32. Per block b of a group, each of the 32
// weights of the 8 rows is widened in registers (one pshufb puts byte j of each row on top of its int32 lane, then
// cvtepi32_ps: q * 2^24 exactly, signed; Q4_0 / Q5_0 take their offset off in the bytes first, so q - offset is
// exact) and FMAed against x_j broadcast; then, per block,
//   acc += (d * 2^-24) * sum_j(x_j * q_j * 2^24)  [+ m * sum_j(x_j) for *_1, sums of x per block once per call]
// Scaling by 2^24 is exact (no rounding changes), so this is quant_linear_ref's sum over the same products
// reordered: the reference rounds w = q * d (+ m) first (two roundings) and sums x * w; here the block's
// fp32 sum of x * q is scaled once and m * sum(x) added apart: within 1e-5 of the output's RMS (tests).
// The scalar twin computes the same per-block sums in j order (one chain; the AVX2 kernel splits a block's
// 32 products over 4 / 2 / 1 chains for 1 / 2 / 3-4 rows of x): only fp32 order differs.
//
// Compiled with -ffp-contract=off: dequantize is d * q + m in two roundings, as gguf-py (the reference).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_32.h"

static void dequant_row_scalar(const Weights *w, int64_t n, float *out) {
    int q[32];
    for (int64_t b = 0; b < w->nb; b++) {
        expand_scalar(w, n, b, q);
        float d = half_to_float(w->d[at(w, n, b)]);
        if (w->m) {
            float m = half_to_float(w->m[at(w, n, b)]);
            for (int j = 0; j < 32; j++) out[b * 32 + j] = d * (float)q[j] + m;
        } else {
            for (int j = 0; j < 32; j++) out[b * 32 + j] = d * (float)(q[j] - w->offset);
        }
    }
}

// out[i] = row n . x_i for the mc rows of x (xq int8 [mc, cols]; block scales xd and sums xs [mc, nb])
static void row_scalar(const Weights *w, int64_t n, const int8_t *xq, const float *xd, const float *xs, int mc,
                       float *out) {
    int q[32];
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < w->nb; b++) {
        expand_scalar(w, n, b, q);
        float d = half_to_float(w->d[at(w, n, b)]);
        float c = w->m ? half_to_float(w->m[at(w, n, b)]) : -(float)w->offset * d;
        for (int i = 0; i < mc; i++) {
            const int8_t *xb = xq + i * w->nb * 32 + b * 32;
            int32_t dot = 0;
            for (int j = 0; j < 32; j++) dot += q[j] * xb[j];
            out[i] += (float)dot * (d * xd[i * w->nb + b]);
            if (w->fmt != Q8_0) out[i] += c * xs[i * w->nb + b];
        }
    }
}

// out[i] = row n . x_i for the mc rows of x (fp32 [mc] rows of stride x_s; per-block sums xs [mc, nb])
static void row_f32_scalar(const Weights *w, int64_t n, const float *x, int64_t x_s, const float *xs, int mc,
                           float *out) {
    int q[32];
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < w->nb; b++) {
        expand_scalar(w, n, b, q);
        float d = half_to_float(w->d[at(w, n, b)]);
        float m = w->m ? half_to_float(w->m[at(w, n, b)]) : 0.0f;
        for (int i = 0; i < mc; i++) {
            const float *xb = x + i * x_s + b * 32;
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += xb[j] * (float)(q[j] - w->offset);
            out[i] += s * d;
            if (w->m) out[i] += m * xs[i * w->nb + b];
        }
    }
}

// ------------------------------------------------------------------------------------------ AVX2 + FMA + F16C
#ifdef HAVE_X86

typedef void (*GroupFn)(const Weights *, int64_t, const int8_t *, const float *, const float *, int, __m256 *);

// the int8 kernel per group (quant_int8_group.h), once with each dots step
#define Q_TGT AVX2
#define Q_DOTS dots_avx2
#define Q_SFX(name) name##_avx2
#include "quant_int8_group.h"
#define Q_TGT VNNI
#define Q_DOTS dots_vnni
#define Q_SFX(name) name##_vnni
#include "quant_int8_group.h"

// res[i] (lane r) = row 8g + r . x_i for mc rows of fp32 x (row stride x_s), the fp32-activation kernel;
// inlined with constant fmt and mc. S chains per row of x keep the FMA latency hidden at small mc.
AVX2 static inline __attribute__((always_inline)) void group_f32_avx2(
    const Weights *w, const int fmt, int64_t g, const float *x, int64_t x_s, const float *xs, const int mc,
    __m256 *res) {
    enum { S_MAX = 4 };
    const int S = mc == 1 ? 4 : mc == 2 ? 2 : 1;
    const int64_t nb = w->nb;
    // byte t of each int32 lane moved to its top byte, the rest zero: lane = q << 24 (signed)
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
    __m256 acc[MT];
    for (int i = 0; i < mc; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i v[8];
        expand_avx2(fmt, w->qs + (g * nb + b) * 8 * w->qb, w->qh ? w->qh + (g * nb + b) * 8 : NULL, v);
        if (fmt == Q4_0 || fmt == Q5_0) {  // q - offset, exact in the bytes (signed)
            const __m256i off = _mm256_set1_epi8(fmt == Q4_0 ? 8 : 16);
            for (int c = 0; c < 8; c++) v[c] = _mm256_sub_epi8(v[c], off);
        }
        __m256 bs[MT][S_MAX];
        for (int i = 0; i < mc; i++)
            for (int s = 0; s < S; s++) bs[i][s] = _mm256_setzero_ps();
        for (int c = 0; c < 8; c++)
            for (int t = 0; t < 4; t++) {  // weight 4c + t of the 8 rows
                __m256 q = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v[c], top[t]));
                for (int i = 0; i < mc; i++)
                    bs[i][t % S] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(x + i * x_s + b * 32 + 4 * c + t),
                                                   bs[i][t % S]);
            }
        __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->d + (g * nb + b) * 8))),
                                 unscale);
        for (int i = 0; i < mc; i++) {
            __m256 s = bs[i][0];
            if (S == 4) s = _mm256_add_ps(_mm256_add_ps(bs[i][0], bs[i][1]), _mm256_add_ps(bs[i][2], bs[i][3]));
            if (S == 2) s = _mm256_add_ps(bs[i][0], bs[i][1]);
            acc[i] = _mm256_fmadd_ps(s, d, acc[i]);
        }
        if (fmt == Q4_1 || fmt == Q5_1) {
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->m + (g * nb + b) * 8)));
            for (int i = 0; i < mc; i++) acc[i] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + i * nb + b), acc[i]);
        }
    }
    for (int i = 0; i < mc; i++) res[i] = acc[i];
}

typedef void (*GroupF32Fn)(const Weights *, int64_t, const float *, int64_t, const float *, int, __m256 *);

#define GROUP_F32_FN(F)                                                                                     \
    AVX2 static void group_f32_avx2_##F(const Weights *w, int64_t g, const float *x, int64_t x_s,          \
                                        const float *xs, int mc, __m256 *res) {                             \
        switch (mc) {                                                                                       \
            case 4: group_f32_avx2(w, F, g, x, x_s, xs, 4, res); break;                                     \
            case 3: group_f32_avx2(w, F, g, x, x_s, xs, 3, res); break;                                     \
            case 2: group_f32_avx2(w, F, g, x, x_s, xs, 2, res); break;                                     \
            default: group_f32_avx2(w, F, g, x, x_s, xs, 1, res); break;                                    \
        }                                                                                                   \
    }
GROUP_F32_FN(Q8_0) GROUP_F32_FN(Q4_0) GROUP_F32_FN(Q4_1) GROUP_F32_FN(Q5_0) GROUP_F32_FN(Q5_1)

static GroupF32Fn group_f32_fn(int fmt) {
    switch (fmt) {
        case Q8_0: return group_f32_avx2_Q8_0;
        case Q4_0: return group_f32_avx2_Q4_0;
        case Q4_1: return group_f32_avx2_Q4_1;
        case Q5_0: return group_f32_avx2_Q5_0;
        default: return group_f32_avx2_Q5_1;
    }
}

// rows 8g .. 8g + count - 1 (those of rows_wanted in the group) dequantized into out (row stride cols)
AVX2 static void dequant_group_avx2(const Weights *w, int64_t g, int first, int count, float *out, int64_t ld) {
    const int sgn = w->fmt == Q8_0 || w->offset;
    for (int64_t b = 0; b < w->nb; b++) {
        __m256i v[8];
        uint32_t chunks[8][8];  // [chunk][row]
        expand_avx2(w->fmt, w->qs + (g * w->nb + b) * 8 * w->qb, w->qh ? w->qh + (g * w->nb + b) * 8 : NULL, v);
        for (int c = 0; c < 8; c++) {
            if (w->offset) v[c] = _mm256_sub_epi8(v[c], _mm256_set1_epi8((char)w->offset));
            _mm256_storeu_si256((__m256i *)chunks[c], v[c]);
        }
        float d[8], m[8];
        _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->d + (g * w->nb + b) * 8))));
        if (w->m) _mm256_storeu_ps(m, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->m + (g * w->nb + b) * 8))));
        for (int r = first; r < first + count; r++) {
            uint32_t row[8];
            for (int c = 0; c < 8; c++) row[c] = chunks[c][r];
            __m128i lo = _mm_loadu_si128((const __m128i *)row), hi = _mm_loadu_si128((const __m128i *)(row + 4));
            __m128i h[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            float *o = out + (r - first) * ld + b * 32;
            for (int k = 0; k < 4; k++) {
                __m256 q = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(h[k]) : _mm256_cvtepu8_epi32(h[k]));
                __m256 val = _mm256_mul_ps(_mm256_set1_ps(d[r]), q);
                if (w->m) val = _mm256_add_ps(val, _mm256_set1_ps(m[r]));
                _mm256_storeu_ps(o + 8 * k, val);
            }
        }
    }
}

#endif

// ------------------------------------------------------------------------------------------ entry points

// the best instruction set level this machine takes (quant_common.h: ISA_SCALAR .. ISA_VNNI)
int duet_quant_isa(void) { return isa_supported(); }

// x [M, cols] (row stride x_s) -> xq int8 [M, cols], xd = amax / 127 and xs = xd * sum(xq) per block [M, nb]
// (llama.cpp's quantize_row_q8_1: round to nearest even)
static void prepare_x(const float *x, int64_t x_s, int64_t M, int64_t cols, int8_t *xq, float *xd, float *xs,
                      int num_threads) {
    int64_t nb = cols / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * cols >= 65536)
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + i * x_s + b * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            int8_t *q = xq + i * cols + b * 32;
            for (int j = 0; j < 32; j++) sum += q[j] = (int8_t)nearbyintf(v[j] * id);
            xd[i * nb + b] = d;
            xs[i * nb + b] = d * (float)sum;
        }
}

// out[i * o_s + n] = x[i] . w[n] (+ bias[n]); returns 0, or 1 when scratch memory could not be allocated
int duet_quant_linear(int fmt, const uint8_t *qs, const uint32_t *qh, const uint16_t *d, const uint16_t *m,
                      int64_t rows, int64_t cols, const float *x, int64_t x_s, int64_t M, const float *bias,
                      float *out, int64_t o_s, int isa, int num_threads) {
    Weights w = weights(fmt, qs, qh, d, m, cols / 32);
    int64_t nb = w.nb, groups = (rows + 7) / 8;
    int8_t *xq = malloc((size_t)(M * cols));
    float *xd = malloc(sizeof(float) * (size_t)(M * nb * 2 + 1));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return 1;
    }
    float *xs = xd + M * nb;
    prepare_x(x, x_s, M, cols, xq, xd, xs, num_threads);
#ifdef HAVE_X86
    const int level = isa_level(isa);
    GroupFn simd = level >= ISA_VNNI ? group_fn_vnni(fmt) : level >= ISA_AVX2 ? group_fn_avx2(fmt) : NULL;
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t g = 0; g < groups; g++) {
        int count = rows - g * 8 < 8 ? (int)(rows - g * 8) : 8;
        for (int64_t i0 = 0; i0 < M; i0 += MT) {
            int mc = M - i0 < MT ? (int)(M - i0) : MT;
            float res[MT][8];
#ifdef HAVE_X86
            if (simd) {
                __m256 v[MT];
                simd(&w, g, xq + i0 * cols, xd + i0 * nb, xs + i0 * nb, mc, v);
                for (int i = 0; i < mc; i++) _mm256_storeu_ps(res[i], v[i]);
            } else
#endif
                for (int r = 0; r < count; r++) {
                    float one[MT];
                    row_scalar(&w, g * 8 + r, xq + i0 * cols, xd + i0 * nb, xs + i0 * nb, mc, one);
                    for (int i = 0; i < mc; i++) res[i][r] = one[i];
                }
            for (int i = 0; i < mc; i++)
                for (int r = 0; r < count; r++)
                    out[(i0 + i) * o_s + g * 8 + r] = res[i][r] + (bias ? bias[g * 8 + r] : 0.0f);
        }
    }
    free(xq);
    free(xd);
    return 0;
}

// the fp32-activation kernel: out[i * o_s + n] = x[i] . w[n] (+ bias[n]) with x in fp32 (see the top);
// returns 0, or 1 when scratch memory could not be allocated
int duet_quant_linear_f32(int fmt, const uint8_t *qs, const uint32_t *qh, const uint16_t *d, const uint16_t *m,
                          int64_t rows, int64_t cols, const float *x, int64_t x_s, int64_t M, const float *bias,
                          float *out, int64_t o_s, int isa, int num_threads) {
    Weights w = weights(fmt, qs, qh, d, m, cols / 32);
    int64_t nb = w.nb, groups = (rows + 7) / 8;
    float *xs = NULL;
    if (m) {  // *_1: sum(x) per block, once per call
        xs = malloc(sizeof(float) * (size_t)(M * nb + 1));
        if (!xs) return 1;
        for (int64_t i = 0; i < M; i++)
            for (int64_t b = 0; b < nb; b++) {
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += x[i * x_s + b * 32 + j];
                xs[i * nb + b] = s;
            }
    }
#ifdef HAVE_X86
    GroupF32Fn simd = isa_level(isa) >= ISA_AVX2 ? group_f32_fn(fmt) : NULL;
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t g = 0; g < groups; g++) {
        int count = rows - g * 8 < 8 ? (int)(rows - g * 8) : 8;
        for (int64_t i0 = 0; i0 < M; i0 += MT) {
            int mc = M - i0 < MT ? (int)(M - i0) : MT;
            const float *xi = x + i0 * x_s, *si = xs ? xs + i0 * nb : NULL;
            float res[MT][8];
#ifdef HAVE_X86
            if (simd) {
                __m256 v[MT];
                simd(&w, g, xi, x_s, si, mc, v);
                for (int i = 0; i < mc; i++) _mm256_storeu_ps(res[i], v[i]);
            } else
#endif
                for (int r = 0; r < count; r++) {
                    float one[MT];
                    row_f32_scalar(&w, g * 8 + r, xi, x_s, si, mc, one);
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

// out [count, cols] = rows (ids ? ids[i] : row0 + i) dequantized, exactly as gguf-py
void duet_quant_dequantize(int fmt, const uint8_t *qs, const uint32_t *qh, const uint16_t *d, const uint16_t *m,
                           int64_t cols, const int64_t *ids, int64_t row0, int64_t count, float *out,
                           int isa, int num_threads) {
    Weights w = weights(fmt, qs, qh, d, m, cols / 32);
    const int simd = isa_level(isa) >= ISA_AVX2;
    (void)simd;
#ifdef HAVE_X86
    if (simd && !ids) {  // a run of rows: whole groups at once
        int64_t g0 = row0 / 8, g1 = (row0 + count + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
        for (int64_t g = g0; g < g1; g++) {
            int64_t lo = g * 8 > row0 ? g * 8 : row0, hi = g * 8 + 8 < row0 + count ? g * 8 + 8 : row0 + count;
            dequant_group_avx2(&w, g, (int)(lo - g * 8), (int)(hi - lo), out + (lo - row0) * cols, cols);
        }
        return;
    }
    if (simd) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
        for (int64_t i = 0; i < count; i++) dequant_group_avx2(&w, ids[i] / 8, (int)(ids[i] % 8), 1, out + i * cols, cols);
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
    for (int64_t i = 0; i < count; i++) dequant_row_scalar(&w, ids ? ids[i] : row0 + i, out + i * cols);
}

typedef struct {
    Weights w;
    int simd;
} Bf16Rows;

static void bf16_group_rows(const void *ctx, int64_t g, int64_t lo, int64_t hi, float *buf, int64_t cols) {
    const Bf16Rows *c = ctx;
#ifdef HAVE_X86
    if (c->simd) {
        dequant_group_avx2(&c->w, g, (int)(lo - g * 8), (int)(hi - lo), buf, cols);
        return;
    }
#endif
    for (int64_t r = lo; r < hi; r++) dequant_row_scalar(&c->w, r, buf + (r - lo) * cols);
}

// out [count, cols] bf16 = rows row0 .. row0 + count - 1 as duet_quant_dequantize gives them, rounded to bf16
// (quant_common.h's dequantize_bf16_by_groups). Returns 1 when out of memory.
int duet_quant_dequantize_bf16(int fmt, const uint8_t *qs, const uint32_t *qh, const uint16_t *d, const uint16_t *m,
                               int64_t cols, int64_t row0, int64_t count, uint16_t *out, int isa, int num_threads) {
    const Bf16Rows ctx = {weights(fmt, qs, qh, d, m, cols / 32), isa_level(isa) >= ISA_AVX2};
    return dequantize_bf16_by_groups(bf16_group_rows, &ctx, cols, row0, count, out, num_threads);
}
