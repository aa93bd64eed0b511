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
// dequantize / rows: decoded exactly as gguf-py (SIMD: from the packed layout, 8 weights of a row at a time; the
// scalar twin gathers a row's super-block back into the file's bytes first):
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
// rows first .. first + count - 1 of the group at g0, every super-block, dequantized from the packed layout into
// out (row stride ld): 8 weights of a row per instruction, the scales of the 8 rows decoded once per super-block
// (k_scales_f32: the same d * sc and dmin * mn), then (d * sc) * q - dmin * mn, two roundings: decode_scalar's
AVX2 static void dequant_group_avx2(int fmt, const uint8_t *g0, int64_t nb, int first, int count, float *out,
                                    int64_t ld) {
    const int64_t bb8 = 8 * k_block_bytes(fmt);
    const int qs_at = k_qs_at(fmt);
    const __m128i m4 = _mm_set1_epi8(15), one = _mm_set1_epi8(1), m30 = _mm_set1_epi8(0x30), o32 = _mm_set1_epi8(32);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g0 + b * bb8;
        float D[128], M[64];
        k_scales_f32(fmt, gb, D, M);
        for (int r = first; r < first + count; r++) {
            float *o = out + (int64_t)(r - first) * ld + b * QK;
            if (fmt == Q6_K) {
                for (int hh = 0; hh < 2; hh++)
                    for (int cc = 0; cc < 4; cc++) {  // as quant_k_f32.h: weights 128hh + 32s + 8cc + t
                        const __m128i qh = _mm_loadl_epi64((const __m128i *)(gb + 1024 + (4 * hh + cc) * 64 + 8 * r));
                        const __m128i a = _mm_loadl_epi64((const __m128i *)(gb + (8 * hh + cc) * 64 + 8 * r));
                        const __m128i b4 = _mm_loadl_epi64((const __m128i *)(gb + (8 * hh + cc + 4) * 64 + 8 * r));
                        const __m128i q[4] = {
                            _mm_or_si128(_mm_and_si128(a, m4), _mm_and_si128(_mm_slli_epi16(qh, 4), m30)),
                            _mm_or_si128(_mm_and_si128(b4, m4), _mm_and_si128(_mm_slli_epi16(qh, 2), m30)),
                            _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), m4), _mm_and_si128(qh, m30)),
                            _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b4, 4), m4),
                                         _mm_and_si128(_mm_srli_epi16(qh, 2), m30))};
                        for (int s = 0; s < 4; s++) {
                            const int g = 8 * hh + 2 * s + cc / 2;
                            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_sub_epi8(q[s], o32)));
                            _mm256_storeu_ps(o + 128 * hh + 32 * s + 8 * cc,
                                             _mm256_mul_ps(_mm256_set1_ps(D[8 * g + r]), v));
                        }
                    }
                continue;
            }
            for (int k = 0; k < 4; k++)
                for (int c = 0; c < 4; c++) {
                    const __m128i v = _mm_loadl_epi64((const __m128i *)(gb + qs_at + (4 * k + c) * 64 + 8 * r));
                    __m128i q[2] = {_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4)};
                    if (fmt == Q5_K) {
                        const __m128i qh = _mm_srli_epi16(
                            _mm_loadl_epi64((const __m128i *)(gb + 128 + c * 64 + 8 * r)), 2 * k);
                        q[0] = _mm_or_si128(q[0], _mm_slli_epi16(_mm_and_si128(qh, one), 4));
                        q[1] = _mm_or_si128(q[1], _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 1), one), 4));
                    }
                    for (int h = 0; h < 2; h++) {  // sub-block 2k + h
                        const int j = 2 * k + h;
                        const __m256 w = _mm256_mul_ps(_mm256_set1_ps(D[8 * j + r]),
                                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[h])));
                        _mm256_storeu_ps(o + 64 * k + 32 * h + 8 * c, _mm256_sub_ps(w, _mm256_set1_ps(M[8 * j + r])));
                    }
                }
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
    const int64_t nb = cols / QK, bb = k_block_bytes(fmt), group_bytes = nb * 8 * bb;
#ifdef HAVE_X86
    if (isa_level(isa) >= ISA_AVX2) {
        if (ids) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
            for (int64_t i = 0; i < count; i++)
                dequant_group_avx2(fmt, qs + (ids[i] / 8) * group_bytes, nb, (int)(ids[i] % 8), 1, out + i * cols,
                                   cols);
            return;
        }
        const int64_t g0 = row0 / 8, g1 = (row0 + count + 7) / 8;  // a run of rows: whole groups at once
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
        for (int64_t g = g0; g < g1; g++) {
            const int64_t lo = g * 8 > row0 ? g * 8 : row0, hi = g * 8 + 8 < row0 + count ? g * 8 + 8 : row0 + count;
            dequant_group_avx2(fmt, qs + g * group_bytes, nb, (int)(lo - g * 8), (int)(hi - lo),
                               out + (lo - row0) * cols, cols);
        }
        return;
    }
#else
    (void)isa;
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = ids ? ids[i] : row0 + i;
        uint8_t blk[210];
        for (int64_t b = 0; b < nb; b++) {
            k_file_block(fmt, qs + (n / 8) * group_bytes + b * 8 * bb, (int)(n % 8), blk);
            decode_scalar(fmt, blk, out + i * cols + b * QK);
        }
    }
}

typedef struct {
    int fmt, simd;
    const uint8_t *qs;
    int64_t nb, bb;
} Bf16Rows;

static void bf16_group_rows(const void *ctx, int64_t g, int64_t lo, int64_t hi, float *buf, int64_t cols) {
    const Bf16Rows *c = ctx;
    const uint8_t *g0 = c->qs + g * c->nb * 8 * c->bb;
#ifdef HAVE_X86
    if (c->simd) {
        dequant_group_avx2(c->fmt, g0, c->nb, (int)(lo - g * 8), (int)(hi - lo), buf, cols);
        return;
    }
#endif
    for (int64_t r = lo; r < hi; r++) {
        uint8_t blk[210];
        for (int64_t b = 0; b < c->nb; b++) {
            k_file_block(c->fmt, g0 + b * 8 * c->bb, (int)(r % 8), blk);
            decode_scalar(c->fmt, blk, buf + (r - lo) * cols + b * QK);
        }
    }
}

// out [count, cols] bf16 = rows row0 .. row0 + count - 1 as duet_quant_k_dequantize gives them, rounded to bf16
// (quant_common.h's dequantize_bf16_by_groups). Returns 1 when out of memory.
int duet_quant_k_dequantize_bf16(int fmt, const uint8_t *qs, int64_t cols, int64_t row0, int64_t count,
                                 uint16_t *out, int isa, int num_threads) {
    const Bf16Rows ctx = {fmt, isa_level(isa) >= ISA_AVX2, qs, cols / QK, k_block_bytes(fmt)};
    return dequantize_bf16_by_groups(bf16_group_rows, &ctx, cols, row0, count, out, num_threads);
}
