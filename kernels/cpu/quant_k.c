// duet's GGUF k-quant linears and embeddings for the CPU path (Q4_K, Q5_K, Q6_K: 256-weight super-blocks), called
// from kernels/cpu_quant_k.py through ctypes: the fp32-activation GEMV and dequantize (rows, prefill tiles). The
// int8-activation GEMV is quant_k_int8.c, the packed layout quant_k.h, the 32-weight formats quant.c.
//
// linear_f32 (activations="fp32", the default): x stays fp32; per sub-block (32 weights; Q6_K 16) of each row,
//   y += sum_j(x_j * q_j) * (d * sc) - (dmin * mn) * sum_j(x_j)        (Q6_K: q_j - 32, no min)
// q_j exact in fp32, d * sc and dmin * mn the reference's own (exact) products, sum(x) per sub-block once per call.
// The reference (quant_linear_ref) rounds w_j = (d * sc) * q_j - dmin * mn once and sums x_j * w_j; this sums
// the exact products x_j * q_j in fp32 and scales once per sub-block. Both are within gamma_n * sum_j |x_j| *
// (|d * sc * q_j| + |dmin * mn|) of the exact value (n = cols, gamma_n = n * 2^-24 / (1 - n * 2^-24): fp32
// summation in any order), so |y - y_ref| <= 2 * gamma_n * that sum; tests/kernels/test_cpu_quant_k.py checks
// it per output. Kernels (quant_k_f32.h, one source per instruction set): lanes (row, t) of 8 rows x 2
// neighbouring weights (AVX-512; AVX2: 4 rows a pass), so each 64-byte load of the 8x8 layout feeds every lane
// and x comes as (x_j, x_j+1) broadcast; OpenMP over groups of 8 rows. The scalar twin sums each sub-block in j
// order (fp32 order differs only).
//
// dequantize / rows: a row's super-block gathered back into the file's bytes, then decoded exactly as gguf-py:
//   Q4_K / Q5_K: w = (d * sc_j) * q - dmin * mn_j   (sub-block j of 32 weights; two roundings, never an FMA)
//   Q6_K:        w = (d * sc_g) * (q - 32)          (group g of 16 weights)
// Compiled with -ffp-contract=off (the decode's mul then sub stay two roundings, as gguf-py).
#include <stdlib.h>

#include "quant_k.h"

// ------------------------------------------------------------------------------------------ scalar

static void decode_scalar(int fmt, const uint8_t *blk, float w[QK]) {
    uint8_t q[QK];
    int sc[16], mn[16];
    const int groups = k_block_scales(fmt, blk, sc, mn), len = QK / groups;
    const float d = k_fp16_at(blk + (fmt == Q6_K ? 208 : 0)), dmin = fmt == Q6_K ? 0.0f : k_fp16_at(blk + 2);
    k_block_quants(fmt, blk, q);
    for (int g = 0; g < groups; g++) {
        const float scale = d * (float)sc[g], min = dmin * (float)mn[g];
        for (int l = 0; l < len; l++) {
            const int j = g * len + l;
            w[j] = fmt == Q6_K ? scale * (float)((int)q[j] - 32) : scale * (float)q[j] - min;
        }
    }
}

// out[i] = row r of the group at g0 . x_i for mc rows of x (the exact form above; xs: sums of x per 32)
static void row_f32_scalar(int fmt, const uint8_t *g0, int64_t nb, int r, const float *x, int64_t x_s,
                           const float *xs, int64_t xs_s, int mc, float *out) {
    const int64_t bb = k_block_bytes(fmt);
    uint8_t blk[210], q[QK];
    int sc[16], mn[16];
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        k_file_block(fmt, g0 + b * 8 * bb, r, blk);
        k_block_quants(fmt, blk, q);
        const int groups = k_block_scales(fmt, blk, sc, mn), len = QK / groups, off = fmt == Q6_K ? 32 : 0;
        const float d = k_fp16_at(blk + (fmt == Q6_K ? 208 : 0)), dmin = fmt == Q6_K ? 0.0f : k_fp16_at(blk + 2);
        for (int g = 0; g < groups; g++)
            for (int i = 0; i < mc; i++) {
                const float *xg = x + i * x_s + b * QK + g * len;
                float s = 0.0f;
                for (int l = 0; l < len; l++) s += xg[l] * (float)((int)q[g * len + l] - off);
                out[i] += s * (d * (float)sc[g]);
                if (fmt != Q6_K) out[i] -= (dmin * (float)mn[g]) * xs[i * xs_s + b * 8 + g];
            }
    }
}

// ------------------------------------------------------------------------------------------ SIMD
#ifdef HAVE_X86
// a file super-block's quants with AVX2, 32 at a time, signed (Q6_K: q - 32)
AVX2 static void block_quants_avx2(int fmt, const uint8_t *blk, int8_t q[QK]) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (fmt == Q6_K) {
        const __m256i m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
            for (int k = 0; k < 4; k++) {
                __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), m2), 4);
                __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo[k], hi), off);
                _mm256_storeu_si256((__m256i *)(q + 128 * h + 32 * k), v);
            }
        }
        return;
    }
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16);
    __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16)), one = _mm256_set1_epi8(1);
    for (int k = 0; k < 4; k++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * k));
        __m256i v[2] = {_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4)};
        for (int s = 0; s < 2; s++) {
            if (fmt == Q5_K) {  // bit 2k + s of each byte of qh -> 16
                __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k + s), one);
                v[s] = _mm256_or_si256(v[s], _mm256_slli_epi16(bit, 4));
            }
            _mm256_storeu_si256((__m256i *)(q + 64 * k + 32 * s), v[s]);
        }
    }
}

// the 256 weights, bit-exactly decode_scalar's
AVX2 static void decode_avx2(int fmt, const uint8_t *blk, float w[QK]) {
    int8_t q[QK];
    int sc[16], mn[16];
    const int groups = k_block_scales(fmt, blk, sc, mn), len = QK / groups;
    const float d = k_fp16_at(blk + (fmt == Q6_K ? 208 : 0)), dmin = fmt == Q6_K ? 0.0f : k_fp16_at(blk + 2);
    block_quants_avx2(fmt, blk, q);
    for (int g = 0; g < groups; g++) {
        __m256 s = _mm256_set1_ps(d * (float)sc[g]), m = _mm256_set1_ps(dmin * (float)mn[g]);
        for (int l = 0; l < len; l += 8) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + g * len + l))));
            v = _mm256_mul_ps(s, v);
            if (fmt != Q6_K) v = _mm256_sub_ps(v, m);
            _mm256_storeu_ps(w + g * len + l, v);
        }
    }
}


#define K_ISA ISA_AVX2
#include "quant_k_vec.h"
#include "quant_k_f32.h"
#undef K_ISA
#define K_ISA ISA_AVX512
#include "quant_k_vec.h"
#include "quant_k_f32.h"
#undef K_ISA
#endif

// ------------------------------------------------------------------------------------------ entry points

// out[i * o_s + n] = x[i] . w[n] (+ bias[n]), x fp32 [M, cols] (row stride x_s), qs the packed groups (quant_k.h);
// isa: the instruction set level (quant_common.h); returns 0, or 1 when scratch memory could not be allocated
int duet_quant_k_linear_f32(int fmt, const uint8_t *qs, int64_t rows, int64_t cols, const float *x, int64_t x_s,
                            int64_t M, const float *bias, float *out, int64_t o_s, int isa, int num_threads) {
    const int64_t nb = cols / QK, groups = (rows + 7) / 8, group_bytes = nb * 8 * k_block_bytes(fmt);
    const int64_t xs_s = nb * 8;
    isa = isa_level(isa);
    float *xs = NULL;
    if (fmt != Q6_K) {  // sum(x) per 32, once per call
        xs = malloc(sizeof(float) * (size_t)(M * xs_s + 1));
        if (!xs) return 1;
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < xs_s; j++) {
                float s = 0.0f;
                for (int l = 0; l < 32; l++) s += x[i * x_s + j * 32 + l];
                xs[i * xs_s + j] = s;
            }
    }
    const int mt = isa == ISA_AVX2 ? 2 : MT;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t g = 0; g < groups; g++) {
        const int count = rows - g * 8 < 8 ? (int)(rows - g * 8) : 8;
        const uint8_t *g0 = qs + g * group_bytes;
        for (int64_t i0 = 0; i0 < M; i0 += mt) {
            const int mc = M - i0 < mt ? (int)(M - i0) : mt;
            const float *xi = x + i0 * x_s, *si = xs ? xs + i0 * xs_s : NULL;
            float res[MT][8];
#ifdef HAVE_X86
            if (isa >= ISA_AVX512)
                k_f32_group_avx512(fmt, g0, nb, xi, x_s, si, xs_s, mc, res);
            else if (isa == ISA_AVX2)
                k_f32_group_avx2(fmt, g0, nb, xi, x_s, si, xs_s, mc, res);
            else
#endif
                for (int r = 0; r < count; r++) {
                    float one[MT];
                    row_f32_scalar(fmt, g0, nb, r, xi, x_s, si, xs_s, mc, one);
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
void duet_quant_k_dequantize(int fmt, const uint8_t *qs, int64_t cols, const int64_t *ids, int64_t row0,
                             int64_t count, float *out, int isa, int num_threads) {
    const int64_t nb = cols / QK, bb = k_block_bytes(fmt);
    const int simd = isa_level(isa) >= ISA_AVX2;
    (void)simd;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = ids ? ids[i] : row0 + i;
        const uint8_t *g0 = qs + (n / 8) * nb * 8 * bb;
        uint8_t blk[210];
        for (int64_t b = 0; b < nb; b++) {
            k_file_block(fmt, g0 + b * 8 * bb, (int)(n % 8), blk);
#ifdef HAVE_X86
            if (simd) {
                decode_avx2(fmt, blk, out + i * cols + b * QK);
                continue;
            }
#endif
            decode_scalar(fmt, blk, out + i * cols + b * QK);
        }
    }
}
