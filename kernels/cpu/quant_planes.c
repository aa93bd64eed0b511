// The 32-weight GGUF formats' fp32-activation linear (activations="fp32", the default), called from
// kernels/cpu_quant.py through ctypes; the packed layout is quant.c's (quant_32.h).
//
// x is not quantized to 8 bits (llama.cpp's method, quant.c's linear) but written exactly enough to be fp32's equal
// as 24-bit fixed point per 32-block, and that integer as three int8 digits, so the same integer dot products that
// serve int8 x (quant_32.h: maddubs on AVX2, vpdpbusd on AVX512-VNNI) serve it three times:
//   X_j = round(x_j * 2^s)   (s per block: the largest |X_j| in [2^21, 8290687], 8290687 = 127 * (1 + 255 + 255^2))
//   X_j = D0_j + 255 * D1_j + 65025 * D2_j,   D in [-127, 127]   (balanced base 255: each digit an int8 that the
//         Q8_0 kernel's sign trick can negate)
//   q . X = (q . D0) + 255 * (q . D1) + 65025 * (q . D2)         (three exact int32 dot products per block)
// and per block, with w = q * d + c (c = m for *_1, -offset * d for Q4_0 / Q5_0, 0 for Q8_0):
//   w . x^ = d * 2^-s * (q . X) + c * 2^-s * sum(X)
// x^ (the x the kernel multiplies) differs from x by at most 2^-22 of the block's largest |x| (half a unit of X,
// whose largest is >= 2^21): the size of one fp32 rounding of a sum that holds that element (s is at most 149, where
// X = x * 2^149 is exact: subnormal x lose nothing). The dots are exact; per block, q . X is rounded to fp32 once or
// twice (t0 + 255 * t1 exact in int32, + 65025 * t2 in one FMA), times d, then times 2^-s (last: it may be
// subnormal) and summed over blocks in fp32. So against quant_linear_ref (w rounded to fp32, then fp32 sums of x * w)
// the error is of the same order as the reference's own; tests bound it with the old fp32-FMA kernel's 1e-5 of the
// output's RMS and check greedy tokens equal to the dense model's.
// Why: widening each weight to fp32 (one shuffle, one conversion and one FMA per 8 weights and row of x, the kernel
// this replaces) bound the default path by its vector ports; three int8 dots per 4 weights and 8 rows cost less
// (numbers in kernels/cpu_quant.py).
// The scalar twin (no AVX2/FMA/F16C, or forced) computes the same integer dots and the same fp32 operations in the
// same order: bitwise equal to the SIMD kernels (tests).
//
// Compiled with -ffp-contract=off: every FMA is an explicit intrinsic or fmaf, so the twins round alike.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_32.h"
#include "quant_digits.h"

typedef struct {
    int64_t M;
    int8_t *digits;  // [PLANES, M, cols]
    float *xd;       // [M, nb]: 2^-s (NaN for a block holding inf or NaN, so the output is NaN as fp32's would be)
    float *xs;       // [M, nb]: 2^-s * sum(X)
    int32_t *dsum;   // [PLANES, M, nb]: sum of each plane's digits (Q4_0 / Q5_0's offset term)
} Planes;

// block b of x row i (32 values) -> its digits, scale and sums
static void prepare_block(const float *v, Planes *xp, int64_t i, int64_t b, int64_t nb) {
    const int64_t cols = nb * 32, ib = i * nb + b;
    int8_t *dig[PLANES];
    for (int p = 0; p < PLANES; p++) dig[p] = xp->digits + (p * xp->M + i) * cols + b * 32;
    float amax;
    const int ok = digits_finite(v, 32, &amax);
    const int s = ok && amax > 0.0f ? digits_exponent(amax) : 0;
    int32_t ds[PLANES] = {0, 0, 0};
    float zero[32] = {0};
    const int64_t sum = digits_of(ok ? v : zero, 32, s, dig[0], dig[1], dig[2], ds);
    for (int p = 0; p < PLANES; p++) xp->dsum[p * xp->M * nb + ib] = ds[p];
    xp->xd[ib] = !ok ? NAN : amax > 0.0f ? ldexpf(1.0f, -s) : 0.0f;
    xp->xs[ib] = !ok ? NAN : (float)sum * xp->xd[ib];
}

#ifdef HAVE_X86
// floor((t) / 255) for int32 lanes |t| < 2^24, and t - 255 * that in [-127, 127] after the shift by 127:
// (t + 127) / 255 in fp32 (exact operands, one rounding), floored, then corrected by one either way in integers
AVX2 static inline void digit_avx2(__m256i t, __m256i *digit, __m256i *rest) {
    const __m256i k127 = _mm256_set1_epi32(127), k255 = _mm256_set1_epi32(255);
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(t, k127)), _mm256_set1_ps(1.0f / 255.0f));
    __m256i q = _mm256_cvtps_epi32(_mm256_floor_ps(f));
    __m256i d = _mm256_sub_epi32(t, _mm256_sub_epi32(_mm256_slli_epi32(q, 8), q));
    __m256i hi = _mm256_cmpgt_epi32(d, k127), lo = _mm256_cmpgt_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), k127), d);
    q = _mm256_add_epi32(_mm256_sub_epi32(q, hi), lo);  // hi, lo: -1 where set
    d = _mm256_add_epi32(_mm256_sub_epi32(d, _mm256_and_si256(hi, k255)), _mm256_and_si256(lo, k255));
    *digit = d;
    *rest = q;
}

AVX2 static inline int32_t hsum_avx2(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// 4 x 8 int32 lanes in [-127, 127] -> 32 int8 in order
AVX2 static inline void store_digits_avx2(const __m256i d[4], int8_t *out) {
    __m256i ab = _mm256_packs_epi32(d[0], d[1]), cd = _mm256_packs_epi32(d[2], d[3]);
    __m256i abcd = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, abcd);
}

// prepare_block's result for blocks of finite x whose largest |x| is a normal float and 2^s too (else returns 0:
// the caller runs prepare_block); the same digits, scales and sums
AVX2 static int prepare_block_avx2(const float *v, Planes *xp, int64_t i, int64_t b, int64_t nb) {
    const int64_t cols = nb * 32, ib = i * nb + b;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        x[k] = _mm256_loadu_ps(v + 8 * k);
        mx = _mm256_max_ps(mx, _mm256_and_ps(x[k], absmask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x[k], x[k], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float amax = _mm_cvtss_f32(m4);
    uint32_t bits;
    memcpy(&bits, &amax, 4);
    const int be = (int)(bits >> 23) & 0xff;  // amax in [2^(be-127), 2^(be-126)): frexpf's e = be - 126
    if (_mm256_movemask_ps(nan) || be == 0 || be == 0xff) return 0;
    int s = 23 - (be - 126);
    if (s + 127 < 1 || s + 127 > 254) return 0;
    uint32_t sb = (uint32_t)(s + 127) << 23;
    float scale;
    memcpy(&scale, &sb, 4);
    if (lrintf(amax * scale) > X_MAX) {
        s--;
        scale *= 0.5f;
    }
    __m256i X[4], d0[4], d1[4], d2[4], sum = _mm256_setzero_si256(), ds[PLANES];
    for (int p = 0; p < PLANES; p++) ds[p] = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        X[k] = _mm256_cvtps_epi32(_mm256_mul_ps(x[k], _mm256_set1_ps(scale)));
        __m256i q1;
        digit_avx2(X[k], &d0[k], &q1);
        digit_avx2(q1, &d1[k], &d2[k]);
        sum = _mm256_add_epi32(sum, X[k]);
        ds[0] = _mm256_add_epi32(ds[0], d0[k]);
        ds[1] = _mm256_add_epi32(ds[1], d1[k]);
        ds[2] = _mm256_add_epi32(ds[2], d2[k]);
    }
    store_digits_avx2(d0, xp->digits + (0 * xp->M + i) * cols + b * 32);
    store_digits_avx2(d1, xp->digits + (1 * xp->M + i) * cols + b * 32);
    store_digits_avx2(d2, xp->digits + (2 * xp->M + i) * cols + b * 32);
    for (int p = 0; p < PLANES; p++) xp->dsum[p * xp->M * nb + ib] = hsum_avx2(ds[p]);
    xp->xd[ib] = ldexpf(1.0f, -s);
    xp->xs[ib] = (float)hsum_avx2(sum) * xp->xd[ib];
    return 1;
}
#endif

// out[i] = row n . x_i for the mc rows i0.. of x: the SIMD kernels' operations, one lane at a time
static void row_planes_scalar(const Weights *w, int64_t n, const Planes *xp, int64_t i0, int mc, float *out) {
    const int64_t nb = w->nb, cols = nb * 32;
    int q[32];
    float acc[MT], corr[MT];
    for (int i = 0; i < mc; i++) acc[i] = corr[i] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        expand_scalar(w, n, b, q);
        float d = half_to_float(w->d[at(w, n, b)]);
        for (int i = 0; i < mc; i++) {
            const int64_t ib = (i0 + i) * nb + b;
            int32_t t[PLANES];
            for (int p = 0; p < PLANES; p++) {
                const int8_t *xb = xp->digits + (p * xp->M + i0 + i) * cols + b * 32;
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) dot += q[j] * xb[j];
                t[p] = dot - w->offset * xp->dsum[p * xp->M * nb + ib];
            }
            float f = fmaf((float)t[2], 65025.0f, (float)(t[0] + 255 * t[1]));
            acc[i] = fmaf(f * d, xp->xd[ib], acc[i]);  // xd last: 2^-s may be subnormal
            if (w->m) corr[i] = fmaf(half_to_float(w->m[at(w, n, b)]), xp->xs[ib], corr[i]);
        }
    }
    for (int i = 0; i < mc; i++) out[i] = acc[i] + corr[i];
}

#ifdef HAVE_X86
typedef void (*PlanesFn)(const Weights *, int64_t, const Planes *, int64_t, int, __m256 *);

#define Q_TGT AVX2
#define Q_DOTS dots_avx2
#define Q_SFX(name) name##_avx2
#include "quant_planes_group.h"
#define Q_TGT VNNI
#define Q_DOTS dots_vnni
#define Q_SFX(name) name##_vnni
#include "quant_planes_group.h"

// ---------------------------------------------------------------- AVX512-VNNI: two groups (16 rows) per register
// One 512-bit vpdpbusd is 4 weights of 16 rows against 4 digits of x: half the instructions of the 256-bit kernel,
// whose one vpdpbusd per cycle bounds it. Every format's quants go in unsigned (Q8_0's with the top bit flipped:
// q + 128) and its offset (Q4_0 8, Q5_0 16, Q8_0 128) comes off as offset * sum(D) per plane: exact integers, the
// same t as the other kernels, so the same outputs to the bit.
#define PAIR256(p0, p1) \
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0))), \
                       _mm256_loadu_si256((const __m256i *)(p1)), 1)

// the 5th bits of a Q5 chunk for 16 rows (high_bits_avx2 per 256-bit half)
VNNI static inline __m512i high_bits_zmm(__m512i qh_shifted) {
    const __m512i spread = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0x00000000);
    const __m512i bit = _mm512_set1_epi32(0x08040201);
    __m512i bytes = _mm512_and_si512(_mm512_shuffle_epi8(qh_shifted, spread), bit);
    return _mm512_maskz_mov_epi8(_mm512_cmpeq_epi8_mask(bytes, bit), _mm512_set1_epi8(16));
}

// chunk c (0..7) of block b of groups g (lanes 0-7) and g + 1 (lanes 8-15) as unsigned bytes
VNNI static inline __attribute__((always_inline)) void expand_zmm(const int fmt, const Weights *w, int64_t g,
                                                                   int64_t b, __m512i v[8]) {
    const int64_t nb = w->nb;
    const uint8_t *q0 = w->qs + (g * nb + b) * 8 * w->qb, *q1 = w->qs + ((g + 1) * nb + b) * 8 * w->qb;
    if (fmt == Q8_0) {
        for (int c = 0; c < 8; c++) v[c] = _mm512_xor_si512(PAIR256(q0 + c * 32, q1 + c * 32), _mm512_set1_epi8(-128));
        return;
    }
    const __m512i mask = _mm512_set1_epi8(15);
    const int q5 = fmt == Q5_0 || fmt == Q5_1;
    __m512i h = q5 ? PAIR256(w->qh + (g * nb + b) * 8, w->qh + ((g + 1) * nb + b) * 8) : _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        __m512i raw = PAIR256(q0 + c * 32, q1 + c * 32);
        v[c] = _mm512_and_si512(raw, mask);
        v[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        if (q5) {
            v[c] = _mm512_or_si512(v[c], high_bits_zmm(_mm512_srli_epi32(h, 4 * c)));
            v[c + 4] = _mm512_or_si512(v[c + 4], high_bits_zmm(_mm512_srli_epi32(h, 16 + 4 * c)));
        }
    }
}

// the 16 rows' fp16 values of block b (d or m) as fp32
VNNI static inline __m512 halves_zmm(const uint16_t *a, int64_t g, int64_t b, int64_t nb) {
    __m128i lo = _mm_loadu_si128((const __m128i *)(a + (g * nb + b) * 8));
    __m128i hi = _mm_loadu_si128((const __m128i *)(a + ((g + 1) * nb + b) * 8));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// res[i] (lane r) = row 8g + r . x_i, rows 8g .. 8g + 15, for mc rows of x; inlined with constant fmt and mc
VNNI static inline __attribute__((always_inline)) void planes_pair(const Weights *w, const int fmt, int64_t g,
                                                                    const Planes *xp, int64_t i0, const int mc,
                                                                    __m512 *res) {
    const int64_t nb = w->nb, cols = nb * 32;
    const int off = fmt == Q8_0 ? 128 : w->offset;
    __m512 acc[MT], corr[MT];
    for (int i = 0; i < mc; i++) acc[i] = corr[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i v[8], s[PLANES][MT];
        expand_zmm(fmt, w, g, b, v);
        for (int p = 0; p < PLANES; p++)
            for (int i = 0; i < mc; i++) {
                int32_t x4[8];
                memcpy(x4, xp->digits + (p * xp->M + i0 + i) * cols + b * 32, 32);
                __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(x4[0]));
                for (int c = 1; c < 8; c++) a = _mm512_dpbusd_epi32(a, v[c], _mm512_set1_epi32(x4[c]));
                s[p][i] = a;
            }
        __m512 d = halves_zmm(w->d, g, b, nb);
        for (int i = 0; i < mc; i++) {
            const int64_t ib = (i0 + i) * nb + b;
            __m512i t[PLANES];
            for (int p = 0; p < PLANES; p++)
                t[p] = off ? _mm512_sub_epi32(s[p][i], _mm512_set1_epi32(off * xp->dsum[p * xp->M * nb + ib])) : s[p][i];
            __m512i u = _mm512_add_epi32(t[0], _mm512_sub_epi32(_mm512_slli_epi32(t[1], 8), t[1]));
            __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[2]), _mm512_set1_ps(65025.0f), _mm512_cvtepi32_ps(u));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(f, d), _mm512_set1_ps(xp->xd[ib]), acc[i]);
        }
        if (fmt == Q4_1 || fmt == Q5_1) {
            __m512 m = halves_zmm(w->m, g, b, nb);
            for (int i = 0; i < mc; i++) corr[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xp->xs[(i0 + i) * nb + b]), corr[i]);
        }
    }
    for (int i = 0; i < mc; i++) res[i] = _mm512_add_ps(acc[i], corr[i]);
}

typedef void (*PairFn)(const Weights *, int64_t, const Planes *, int64_t, int, __m512 *);

#define PAIR_FN(F)                                                                                            \
    VNNI static void pair_##F(const Weights *w, int64_t g, const Planes *xp, int64_t i0, int mc, __m512 *res) { \
        switch (mc) {                                                                                         \
            case 4: planes_pair(w, F, g, xp, i0, 4, res); break;                                              \
            case 3: planes_pair(w, F, g, xp, i0, 3, res); break;                                              \
            case 2: planes_pair(w, F, g, xp, i0, 2, res); break;                                              \
            default: planes_pair(w, F, g, xp, i0, 1, res); break;                                             \
        }                                                                                                     \
    }
PAIR_FN(Q8_0) PAIR_FN(Q4_0) PAIR_FN(Q4_1) PAIR_FN(Q5_0) PAIR_FN(Q5_1)

static PairFn pair_fn(int fmt) {
    switch (fmt) {
        case Q8_0: return pair_Q8_0;
        case Q4_0: return pair_Q4_0;
        case Q4_1: return pair_Q4_1;
        case Q5_0: return pair_Q5_0;
        default: return pair_Q5_1;
    }
}
#endif

// out[i * o_s + n] = x[i] . w[n] (+ bias[n]) with x in fp32 (see the top); returns 0, or 1 when scratch memory
// could not be allocated
int duet_quant_linear_planes(int fmt, const uint8_t *qs, const uint32_t *qh, const uint16_t *d, const uint16_t *m,
                             int64_t rows, int64_t cols, const float *x, int64_t x_s, int64_t M, const float *bias,
                             float *out, int64_t o_s, int isa, int num_threads) {
    Weights w = weights(fmt, qs, qh, d, m, cols / 32);
    const int64_t nb = w.nb, groups = (rows + 7) / 8;
    Planes xp = {M, malloc((size_t)(PLANES * M * cols) + 1), malloc(sizeof(float) * (size_t)(2 * M * nb) + 1),
                 NULL, malloc(sizeof(int32_t) * (size_t)(PLANES * M * nb) + 1)};
    if (!xp.digits || !xp.xd || !xp.dsum) {
        free(xp.digits);
        free(xp.xd);
        free(xp.dsum);
        return 1;
    }
    xp.xs = xp.xd + M * nb;
    const int level = isa_level(isa);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * cols >= 65536)
    for (int64_t ib = 0; ib < M * nb; ib++) {
        const float *v = x + (ib / nb) * x_s + (ib % nb) * 32;
#ifdef HAVE_X86
        if (level >= ISA_AVX2 && prepare_block_avx2(v, &xp, ib / nb, ib % nb, nb)) continue;
#endif
        prepare_block(v, &xp, ib / nb, ib % nb, nb);
    }
#ifdef HAVE_X86
    PlanesFn simd = level >= ISA_VNNI ? planes_fn_vnni(fmt) : level >= ISA_AVX2 ? planes_fn_avx2(fmt) : NULL;
    PairFn pair = level >= ISA_VNNI ? pair_fn(fmt) : NULL;
    const int64_t span = pair ? 2 : 1, units = (groups + span - 1) / span;  // groups per pass
#else
    const int64_t span = 1, units = groups;
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t u = 0; u < units; u++) {
        const int64_t g = u * span, r0 = g * 8;
        const int count = rows - r0 < 8 * span ? (int)(rows - r0) : (int)(8 * span);
        for (int64_t i0 = 0; i0 < M; i0 += MT) {
            int mc = M - i0 < MT ? (int)(M - i0) : MT;
            float res[MT][16];
#ifdef HAVE_X86
            if (pair && g + 1 < groups) {
                __m512 v[MT];
                pair(&w, g, &xp, i0, mc, v);
                for (int i = 0; i < mc; i++) _mm512_storeu_ps(res[i], v[i]);
            } else if (simd) {
                __m256 v[MT];
                simd(&w, g, &xp, i0, mc, v);
                for (int i = 0; i < mc; i++) _mm256_storeu_ps(res[i], v[i]);
            } else
#endif
                for (int r = 0; r < count; r++) {
                    float one[MT];
                    row_planes_scalar(&w, r0 + r, &xp, i0, mc, one);
                    for (int i = 0; i < mc; i++) res[i][r] = one[i];
                }
            for (int i = 0; i < mc; i++)
                for (int r = 0; r < count; r++) out[(i0 + i) * o_s + r0 + r] = res[i][r] + (bias ? bias[r0 + r] : 0.0f);
        }
    }
    free(xp.digits);
    free(xp.xd);
    free(xp.dsum);
    return 0;
}
