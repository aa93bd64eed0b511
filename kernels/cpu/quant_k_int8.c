// duet's GGUF k-quant linears with int8 activations (activations="int8", opt-in: llama.cpp's scheme), called from
// kernels/cpu_quant_k.py through ctypes; the layout is quant_k.h's, the fp32-activation kernel quant_k.c.
//
// x is quantized per 256 (one super-block of weights) as llama.cpp's q8_K: xq = round-to-nearest-even(x / dx),
// dx = amax / 127, with the sums of xq per 16 (the mins of Q4_K / Q5_K per 32, Q6_K's -32 per 16). Per sub-block,
// integer dot products of the unsigned quants with xq, exact (AVX2 / AVX-512: _mm*_maddubs_epi16 pairs then
// _mm*_madd_epi16; VNNI: _mm512_dpbusd_epi32, 4 products into an int32 lane, one instruction); then in fp32
//   y += dx * sum_sub-blocks( sum(q * xq) * (d * sc) - (dmin * mn) * sum(xq) )     (Q6_K: (sum(q * xq) - 32 *
//   sum(xq)) * (d * sc), per 16)
// Error vs quant_linear_ref: x's rounding, |x_j - xq_j * dx| <= dx / 2, so |y - y_ref| <= sum_j |w_j| * dx_j / 2
// (dx_j: the scale of x_j's 256-block) plus fp32 rounding (tests/kernels/test_cpu_quant_k.py checks it per
// output). Kernels: quant_k_int8.h, one source for AVX2, AVX-512 and VNNI; OpenMP over groups of 8 rows. The
// scalar twin computes the same integers and only sums floats in another order.
#include <math.h>
#include <stdlib.h>

#include "quant_k.h"

// x [M, cols] (row stride x_s) -> xq int8 [M, cols], dx [M, cols / 256], bs int32 [M, cols / 16]
static void quantize_x(const float *x, int64_t x_s, int64_t M, int64_t cols, int8_t *xq, float *dx, int32_t *bs,
                       int num_threads) {
    const int64_t nb = cols / QK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * cols >= 65536)
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + i * x_s + b * QK;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = xq + i * cols + b * QK;
            for (int j = 0; j < QK; j++) q[j] = (int8_t)nearbyintf(v[j] * id);
            for (int g = 0; g < 16; g++) {
                int32_t s = 0;
                for (int l = 0; l < 16; l++) s += q[16 * g + l];
                bs[i * (cols / 16) + b * 16 + g] = s;
            }
            dx[i * nb + b] = d;
        }
}

// out[i] = row r of the group at g0 . x_i for mc rows of x (the same integers as the SIMD kernels)
static void row_i8_scalar(int fmt, const uint8_t *g0, int64_t nb, int r, const int8_t *xq, int64_t xq_s,
                          const float *dx, const int32_t *bs, int mc, float *out) {
    const int64_t bb = k_block_bytes(fmt);
    uint8_t blk[210], q[QK];
    int sc[16], mn[16];
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        k_file_block(fmt, g0 + b * 8 * bb, r, blk);
        k_block_quants(fmt, blk, q);
        const int groups = k_block_scales(fmt, blk, sc, mn), len = QK / groups;
        const float d = k_fp16_at(blk + (fmt == Q6_K ? 208 : 0)), dmin = fmt == Q6_K ? 0.0f : k_fp16_at(blk + 2);
        for (int i = 0; i < mc; i++) {
            const int8_t *xb = xq + i * xq_s + b * QK;
            const int32_t *s16 = bs + i * (xq_s / 16) + b * 16;
            float acc_b = 0.0f;
            for (int g = 0; g < groups; g++) {
                int32_t dot = 0;
                for (int l = 0; l < len; l++) dot += (int32_t)q[g * len + l] * xb[g * len + l];
                if (fmt == Q6_K) {
                    acc_b += (float)(dot - 32 * s16[g]) * (d * (float)sc[g]);
                } else {
                    acc_b += (float)dot * (d * (float)sc[g]);
                    acc_b -= (dmin * (float)mn[g]) * (float)(s16[2 * g] + s16[2 * g + 1]);
                }
            }
            out[i] += acc_b * dx[i * (xq_s / QK) + b];
        }
    }
}

#ifdef HAVE_X86
#define K_ISA ISA_AVX2
#include "quant_k_vec.h"
#include "quant_k_int8.h"
#undef K_ISA
#define K_ISA ISA_AVX512
#include "quant_k_vec.h"
#include "quant_k_int8.h"
#undef K_ISA
#define K_ISA ISA_VNNI
#include "quant_k_vec.h"
#include "quant_k_int8.h"
#undef K_ISA
#endif

// out[i * o_s + n] = x[i] . w[n] (+ bias[n]) with x quantized to int8 per 256 (see the top); qs the packed groups
// (quant_k.h); isa: the instruction set level (quant_common.h); returns 0, or 1 without scratch memory
int duet_quant_k_linear_int8(int fmt, const uint8_t *qs, int64_t rows, int64_t cols, const float *x, int64_t x_s,
                             int64_t M, const float *bias, float *out, int64_t o_s, int isa, int num_threads) {
    const int64_t nb = cols / QK, groups = (rows + 7) / 8, group_bytes = nb * 8 * k_block_bytes(fmt);
    isa = isa_level(isa);
    int8_t *xq = malloc((size_t)(M * cols));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb + 1));
    int32_t *bs = malloc(sizeof(int32_t) * (size_t)(M * (cols / 16) + 1));
    if (!xq || !dx || !bs) {
        free(xq);
        free(dx);
        free(bs);
        return 1;
    }
    quantize_x(x, x_s, M, cols, xq, dx, bs, num_threads);
    const int mt = isa == ISA_AVX2 ? 2 : MT;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t g = 0; g < groups; g++) {
        const int count = rows - g * 8 < 8 ? (int)(rows - g * 8) : 8;
        const uint8_t *g0 = qs + g * group_bytes;
        for (int64_t i0 = 0; i0 < M; i0 += mt) {
            const int mc = M - i0 < mt ? (int)(M - i0) : mt;
            const int8_t *xi = xq + i0 * cols;
            const float *di = dx + i0 * nb;
            const int32_t *bi = bs + i0 * (cols / 16);
            float res[MT][8];
#ifdef HAVE_X86
            if (isa == ISA_VNNI)
                k_i8_group_vnni(fmt, g0, nb, xi, cols, di, bi, mc, res);
            else if (isa == ISA_AVX512)
                k_i8_group_avx512(fmt, g0, nb, xi, cols, di, bi, mc, res);
            else if (isa == ISA_AVX2)
                k_i8_group_avx2(fmt, g0, nb, xi, cols, di, bi, mc, res);
            else
#endif
                for (int r = 0; r < count; r++) {
                    float one[MT];
                    row_i8_scalar(fmt, g0, nb, r, xi, cols, di, bi, mc, one);
                    for (int i = 0; i < mc; i++) res[i][r] = one[i];
                }
            for (int i = 0; i < mc; i++)
                for (int r = 0; r < count; r++)
                    out[(i0 + i) * o_s + g * 8 + r] = res[i][r] + (bias ? bias[g * 8 + r] : 0.0f);
        }
    }
    free(xq);
    free(dx);
    free(bs);
    return 0;
}
