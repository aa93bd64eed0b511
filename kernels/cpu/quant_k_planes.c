// The k-quants' fp32-activation linear on AVX512-VNNI (activations="fp32", the default, on such CPUs), called from
// kernels/cpu_quant_k.py through ctypes; the layout is quant_k.h's, the int8 kernel's integer dots (quant_k_int8.h)
// run three times. Below VNNI the fp32 path is quant_k.c (quants widened to fp32).
//
// x is written as 24-bit fixed point per 256 (one super-block of weights), then in three balanced base-255 int8
// digits, as kernels/cpu/quant_planes.c does per 32:
//   X_j = round(x_j * 2^s)   (s per 256: the largest |X_j| in [2^21, 8290687]; s at most 149: subnormal x exact)
//   X_j = D0_j + 255 * D1_j + 65025 * D2_j,   D in [-127, 127]
// Per sub-block (32 weights; Q6_K 16) and plane the integer dot of the unsigned quants with the digits is exact
// (vpdpbusd); per sub-block t0 + 255 * t1 in int32 (exact), + 65025 * t2 in one FMA, then as the int8 kernel:
//   Q4_K / Q5_K: acc_b += f * (d * sc) - (dmin * mn) * sum(X)          per sub-block of 32
//   Q6_K:        t_p = dot_p - 32 * sum(D_p) (exact) before combining; acc_b += f * (d * sc) per 16
//   acc += acc_b * 2^-s per super-block (last: 2^-s may be subnormal).
// x^ = X * 2^-s is within 2^-22 of the super-block's largest |x| (half a unit of X): the error is of fp32's own
// order (tests/kernels/test_cpu_quant_k_planes.py checks it per output against the bound).
#include <math.h>
#include <stdlib.h>

#include "quant_digits.h"
#include "quant_k.h"

#define KPM 2          // rows of x per pass (3 planes of dots in registers)
// the next super-block's group-block prefetched while this one is multiplied: measured on the 1.5B Q4_K_M's
// weights from memory (python -m bench.llamacpp --parts engine --models synthetic-1.5b-q4_k_m --rounds 3, batch-1
// decode tok/s): no prefetch 17.6; Q6_K 2 / 4 / 8 ahead 19.5-20.0 / 20.2 / 19.7-19.9; Q4_K 4 ahead as well 16.2-16.9;
// Q4_K 1 ahead (Q6_K 4) 20.1-21.7; both 1 ahead 21.7-22.7. One Q4_K 8192x2048 GEMV from memory, 1 thread, us:
// none 995-1021, 1 ahead 735-760, 2 1003-1014, 4 1122-1132, 8 1125-1133, 16 933-949, 32 982-984
#define KP_AHEAD 1

typedef struct {
    int64_t M, cols;
    int8_t *digits;  // [PLANES, M, cols]
    float *dx;       // [M, cols / 256]: 2^-s (NaN for a super-block holding inf or NaN)
    int32_t *ds;     // [PLANES, M, cols / 16]: each plane's digit sums per 16 (Q6_K's -32)
    int32_t *xs;     // [M, cols / 16]: sums of X per 16 (Q4_K / Q5_K's mins)
} KPlanes;

// super-block b of x row i (256 values) -> its digits, scale and sums
static void k_prepare(const float *v, KPlanes *xp, int64_t i, int64_t b) {
    const int64_t cols = xp->cols, n16 = cols / 16;
    float amax;
    const int ok = digits_finite(v, QK, &amax);
    const int s = ok && amax > 0.0f ? digits_exponent(amax) : 0;
    static const float zero[16];
    for (int g = 0; g < 16; g++) {
        int32_t ds[PLANES] = {0, 0, 0};
        int8_t *dig[PLANES];
        for (int p = 0; p < PLANES; p++) dig[p] = xp->digits + (p * xp->M + i) * cols + b * QK + 16 * g;
        xp->xs[i * n16 + b * 16 + g] = (int32_t)digits_of(ok ? v + 16 * g : zero, 16, s, dig[0], dig[1], dig[2], ds);
        for (int p = 0; p < PLANES; p++) xp->ds[(p * xp->M + i) * n16 + b * 16 + g] = ds[p];
    }
    xp->dx[i * (cols / QK) + b] = !ok ? NAN : amax > 0.0f ? ldexpf(1.0f, -s) : 0.0f;
}

#ifdef HAVE_X86
#define K_ISA ISA_VNNI
#include "quant_k_vec.h"

// t0 + 255 * t1 (exact in int32), + 65025 * t2 in one rounding
KTGT static inline __attribute__((always_inline)) kvf kp_combine(const kvi t[PLANES]) {
    const kvi u = KV_ADDI(t[0], KV_SUBI(_mm512_slli_epi32(t[1], 8), t[1]));
    return KV_FMA(KV_CVT(t[2]), KV_SET1(65025.0f), KV_CVT(u));
}

KTGT static inline __attribute__((always_inline)) void kp_q45(const int fmt, const uint8_t *g0, int64_t nb,
                                                               const KPlanes *xp, int64_t i0, const int mc,
                                                               float *res) {
    const int64_t bb8 = 8 * k_block_bytes(fmt), cols = xp->cols, plane_s = xp->M * cols;
    const int qs_at = k_qs_at(fmt);
    const kvi m4 = KV_SET1_8(0x0F), one = KV_SET1_8(1);
    kvf acc[KPM];
    for (int i = 0; i < mc; i++) acc[i] = KV_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g0 + b * bb8;
        for (int64_t o = 0; o < bb8; o += 64) _mm_prefetch((const char *)(gb + KP_AHEAD * bb8 + o), _MM_HINT_T0);
        float D[64], M[64];
        KV_SCALES(fmt, gb, D, M);
        kvf accb[KPM];
        for (int i = 0; i < mc; i++) accb[i] = KV_ZERO();
        for (int k = 0; k < 4; k++) {  // the 32-byte run k of each row: sub-blocks 2k (low nibbles), 2k + 1 (high)
            kvi ilo[PLANES][KPM], ihi[PLANES][KPM];
            for (int p = 0; p < PLANES; p++)
                for (int i = 0; i < mc; i++) ilo[p][i] = ihi[p][i] = KV_ZEROI();
            for (int c = 0; c < 4; c++) {
                const kvi v = KV_LOADI(gb + qs_at + (4 * k + c) * 64);
                kvi lo = KV_AND(v, m4), hi = KV_AND(KV_SRLI16(v, 4), m4);
                if (fmt == Q5_K) {
                    const kvi qh = KV_SRLI16(KV_LOADI(gb + 128 + c * 64), 2 * k);
                    lo = KV_OR(lo, KV_SLLI16(KV_AND(qh, one), 4));
                    hi = KV_OR(hi, KV_SLLI16(KV_AND(KV_SRLI16(qh, 1), one), 4));
                }
                for (int p = 0; p < PLANES; p++)
                    for (int i = 0; i < mc; i++) {
                        const int8_t *xb = xp->digits + p * plane_s + (i0 + i) * cols + b * QK + 64 * k + 8 * c;
                        ilo[p][i] = KV_DOT(ilo[p][i], lo, KV_BCAST8(xb));
                        ihi[p][i] = KV_DOT(ihi[p][i], hi, KV_BCAST8(xb + 32));
                    }
            }
            const kvf dk = KV_LOAD_PAIR(D + 16 * k, D + 16 * k + 8, 0);
            const kvf mk = KV_LOAD_PAIR(M + 16 * k, M + 16 * k + 8, 0);
            for (int i = 0; i < mc; i++) {
                kvi t[PLANES];
                for (int p = 0; p < PLANES; p++) t[p] = KV_PAIRS_I(ilo[p][i], ihi[p][i]);
                const int32_t *s16 = xp->xs + (i0 + i) * (cols / 16) + b * 16 + 4 * k;  // sums of X per 16
                const kvf xsum = KV_BLEND_HI(KV_SET1((float)(s16[0] + s16[1])), KV_SET1((float)(s16[2] + s16[3])));
                accb[i] = KV_FMA(kp_combine(t), dk, accb[i]);
                accb[i] = KV_FNMA(mk, xsum, accb[i]);
            }
        }
        for (int i = 0; i < mc; i++) acc[i] = KV_FMA(accb[i], KV_SET1(xp->dx[(i0 + i) * nb + b]), acc[i]);
    }
    for (int i = 0; i < mc; i++) KV_STORE_ROWS(acc[i], res + i * 8);
}

KTGT static inline __attribute__((always_inline)) void kp_q6(const uint8_t *g0, int64_t nb, const KPlanes *xp,
                                                              int64_t i0, const int mc, float *res) {
    const int64_t cols = xp->cols, plane_s = xp->M * cols, n16 = cols / 16;
    const kvi m4 = KV_SET1_8(0x0F), m30 = KV_SET1_8(0x30);
    kvf acc[KPM];
    for (int i = 0; i < mc; i++) acc[i] = KV_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g0 + b * 1680;
        for (int64_t o = 0; o < 1680; o += 64) _mm_prefetch((const char *)(gb + KP_AHEAD * 1680 + o), _MM_HINT_T0);
        float D[128];
        KV_SCALES(Q6_K, gb, D, NULL);
        kvf accb[KPM];
        for (int i = 0; i < mc; i++) accb[i] = KV_ZERO();
        for (int hh = 0; hh < 2; hh++)
            for (int cp = 0; cp < 2; cp++) {  // as quant_k_int8.h's Q6_K: groups 8hh + 2s + cp
                kvi I[PLANES][KPM][4];
                for (int p = 0; p < PLANES; p++)
                    for (int i = 0; i < mc; i++) I[p][i][0] = I[p][i][1] = I[p][i][2] = I[p][i][3] = KV_ZEROI();
                for (int cc = 2 * cp; cc < 2 * cp + 2; cc++) {
                    const kvi qh = KV_LOADI(gb + 1024 + (4 * hh + cc) * 64);
                    const kvi a = KV_LOADI(gb + (8 * hh + cc) * 64);
                    const kvi b4 = KV_LOADI(gb + (8 * hh + cc + 4) * 64);
                    const kvi q[4] = {KV_OR(KV_AND(a, m4), KV_AND(KV_SLLI16(qh, 4), m30)),
                                      KV_OR(KV_AND(b4, m4), KV_AND(KV_SLLI16(qh, 2), m30)),
                                      KV_OR(KV_AND(KV_SRLI16(a, 4), m4), KV_AND(qh, m30)),
                                      KV_OR(KV_AND(KV_SRLI16(b4, 4), m4), KV_AND(KV_SRLI16(qh, 2), m30))};
                    for (int s = 0; s < 4; s++)
                        for (int p = 0; p < PLANES; p++)
                            for (int i = 0; i < mc; i++) {
                                const int8_t *xb =
                                    xp->digits + p * plane_s + (i0 + i) * cols + b * QK + 128 * hh + 32 * s + 8 * cc;
                                I[p][i][s] = KV_DOT(I[p][i][s], q[s], KV_BCAST8(xb));
                            }
                }
                for (int sp = 0; sp < 2; sp++) {  // s = 2sp, 2sp + 1: groups g and g + 2
                    const int g = 8 * hh + 4 * sp + cp;
                    const kvf dk = KV_LOAD_PAIR(D + 8 * g, D + 8 * (g + 2), 0);
                    for (int i = 0; i < mc; i++) {
                        kvi t[PLANES];
                        for (int p = 0; p < PLANES; p++) {
                            const int32_t *d16 = xp->ds + (p * xp->M + i0 + i) * n16 + b * 16;
                            const kvi corr = KV_BLEND_HI_I(KV_SET1_32(32 * d16[g]), KV_SET1_32(32 * d16[g + 2]));
                            t[p] = KV_SUBI(KV_PAIRS_I(I[p][i][2 * sp], I[p][i][2 * sp + 1]), corr);
                        }
                        accb[i] = KV_FMA(kp_combine(t), dk, accb[i]);
                    }
                }
            }
        for (int i = 0; i < mc; i++) acc[i] = KV_FMA(accb[i], KV_SET1(xp->dx[(i0 + i) * nb + b]), acc[i]);
    }
    for (int i = 0; i < mc; i++) KV_STORE_ROWS(acc[i], res + i * 8);
}

// res[i][r] = row 8g + r . x_i for the group at g0 and mc (<= KPM) rows i0.. of x
KTGT static void kp_group(int fmt, const uint8_t *g0, int64_t nb, const KPlanes *xp, int64_t i0, int mc,
                          float res[][8]) {
    if (mc == 2) {
        if (fmt == Q6_K) kp_q6(g0, nb, xp, i0, 2, res[0]);
        else if (fmt == Q5_K) kp_q45(Q5_K, g0, nb, xp, i0, 2, res[0]);
        else kp_q45(Q4_K, g0, nb, xp, i0, 2, res[0]);
    } else {
        if (fmt == Q6_K) kp_q6(g0, nb, xp, i0, 1, res[0]);
        else if (fmt == Q5_K) kp_q45(Q5_K, g0, nb, xp, i0, 1, res[0]);
        else kp_q45(Q4_K, g0, nb, xp, i0, 1, res[0]);
    }
}
#undef K_ISA
#endif

// out[i * o_s + n] = x[i] . w[n] (+ bias[n]) with x in fp32 (see the top); qs the packed groups (quant_k.h);
// returns 0, 1 without scratch memory, 2 when this CPU (or isa) is below AVX512-VNNI (the caller's error)
int duet_quant_k_linear_planes(int fmt, const uint8_t *qs, int64_t rows, int64_t cols, const float *x, int64_t x_s,
                               int64_t M, const float *bias, float *out, int64_t o_s, int isa, int num_threads) {
#ifdef HAVE_X86
    if (isa_level(isa) < ISA_VNNI) return 2;
    const int64_t nb = cols / QK, n16 = cols / 16, groups = (rows + 7) / 8, group_bytes = nb * 8 * k_block_bytes(fmt);
    KPlanes xp = {M, cols, malloc((size_t)(PLANES * M * cols) + 1), malloc(sizeof(float) * (size_t)(M * nb) + 1),
                  malloc(sizeof(int32_t) * (size_t)(PLANES * M * n16) + 1), malloc(sizeof(int32_t) * (size_t)(M * n16) + 1)};
    if (!xp.digits || !xp.dx || !xp.ds || !xp.xs) {
        free(xp.digits), free(xp.dx), free(xp.ds), free(xp.xs);
        return 1;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * cols >= 65536)
    for (int64_t ib = 0; ib < M * nb; ib++) k_prepare(x + (ib / nb) * x_s + (ib % nb) * QK, &xp, ib / nb, ib % nb);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t g = 0; g < groups; g++) {
        const int count = rows - g * 8 < 8 ? (int)(rows - g * 8) : 8;
        for (int64_t i0 = 0; i0 < M; i0 += KPM) {
            const int mc = M - i0 < KPM ? (int)(M - i0) : KPM;
            float res[KPM][8];
            kp_group(fmt, qs + g * group_bytes, nb, &xp, i0, mc, res);
            for (int i = 0; i < mc; i++)
                for (int r = 0; r < count; r++)
                    out[(i0 + i) * o_s + g * 8 + r] = res[i][r] + (bias ? bias[g * 8 + r] : 0.0f);
        }
    }
    free(xp.digits), free(xp.dx), free(xp.ds), free(xp.xs);
    return 0;
#else
    (void)fmt, (void)qs, (void)rows, (void)cols, (void)x, (void)x_s, (void)M, (void)bias, (void)out, (void)o_s;
    (void)isa, (void)num_threads;
    return 2;
#endif
}
