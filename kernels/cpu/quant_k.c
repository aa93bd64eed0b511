// duet's GGUF k-quant linears and embeddings for the CPU path (Q4_K, Q5_K, Q6_K: 256-weight super-blocks), called
// from kernels/cpu_quant.py through ctypes. The 32-weight formats are kernels/cpu/quant.c.
//
// Layout: row-wise, the file's bytes as they are (cpu_quant.pack keeps them; no 8-row interleave in this slice):
// data uint8 [rows, nb * block_bytes], nb = cols / 256 super-blocks per row, each exactly ggml's block_q*_K.
//
// A super-block is decoded into its 256 fp32 weights exactly as gguf-py dequantizes it (kernels/quant.py):
//   Q4_K / Q5_K: w = (d * sc_j) * q - dmin * mn_j   (sub-block j of 32 weights; two roundings, never an FMA)
//   Q6_K:        w = (d * sc_g) * (q - 32)          (group g of 16 weights)
// dequantize / rows write these; linear_f32 keeps them in L1 (1 KB) and FMAs them against up to 4 rows of fp32
// x at once (8 independent 8-lane chains per row of x for M = 1), so its products are quant_linear_ref's own and
// only the order of the fp32 sum differs (tests: within 1e-5 of the output's RMS). Threads over weight rows.
// The scalar twin (no AVX2/FMA/F16C, or forced) decodes with the same operations (bit-exact) and sums in j order.
//
// Compiled with -ffp-contract=off (the decode's mul then sub stay two roundings, as gguf-py).
#include <stdint.h>
#include <string.h>

#include "quant_common.h"

enum { Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define QK 256
#define MT 4  // rows of x per pass over a weight row

static int block_bytes(int fmt) { return fmt == Q4_K ? 144 : fmt == Q5_K ? 176 : 210; }


static float fp16_at(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

// the super-block's per-32 (Q4_K / Q5_K: 8) or per-16 (Q6_K: 16) scales d * sc and mins dmin * mn
static int block_scales(int fmt, const uint8_t *blk, float *scale, float *min) {
    if (fmt == Q6_K) {
        float d = fp16_at(blk + 208);
        for (int g = 0; g < 16; g++) scale[g] = d * (float)(int8_t)blk[192 + g];
        return 16;
    }
    float d = fp16_at(blk), dmin = fp16_at(blk + 2);
    const uint8_t *s = blk + 4;
    for (int j = 0; j < 8; j++) {  // ggml's get_scale_min_k4
        int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        scale[j] = d * (float)sc;
        min[j] = dmin * (float)mn;
    }
    return 8;
}

// the 256 quants of a super-block, signed (Q6_K: q - 32), weight order
static void block_quants_scalar(int fmt, const uint8_t *blk, int8_t q[QK]) {
    if (fmt == Q6_K) {
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *ql = blk + 64 * h, hb = blk[128 + 32 * h + l];
                int8_t *o = q + 128 * h + l;
                o[0] = (int8_t)(((ql[l] & 15) | ((hb & 3) << 4)) - 32);
                o[32] = (int8_t)(((ql[l + 32] & 15) | (((hb >> 2) & 3) << 4)) - 32);
                o[64] = (int8_t)(((ql[l] >> 4) | (((hb >> 4) & 3) << 4)) - 32);
                o[96] = (int8_t)(((ql[l + 32] >> 4) | (((hb >> 6) & 3) << 4)) - 32);
            }
        return;
    }
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16), *qh = blk + 16;
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 32; l++) {
            q[64 * k + l] = (int8_t)(qs[32 * k + l] & 15);
            q[64 * k + 32 + l] = (int8_t)(qs[32 * k + l] >> 4);
        }
    if (fmt == Q5_K)
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) q[32 * j + l] |= (int8_t)(((qh[l] >> j) & 1) << 4);
}

static void decode_scalar(int fmt, const uint8_t *blk, float w[QK]) {
    int8_t q[QK];
    float scale[16], min[16];
    int groups = block_scales(fmt, blk, scale, min), len = QK / groups;
    block_quants_scalar(fmt, blk, q);
    for (int g = 0; g < groups; g++)
        for (int l = 0; l < len; l++) {
            float v = scale[g] * (float)q[g * len + l];
            w[g * len + l] = fmt == Q6_K ? v : v - min[g];
        }
}

#ifdef HAVE_X86
// the same quants with AVX2: 32 at a time
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
    float scale[16], min[16];
    int groups = block_scales(fmt, blk, scale, min), len = QK / groups;
    block_quants_avx2(fmt, blk, q);
    for (int g = 0; g < groups; g++) {
        __m256 s = _mm256_set1_ps(scale[g]), m = _mm256_set1_ps(min[g]);
        for (int l = 0; l < len; l += 8) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + g * len + l))));
            v = _mm256_mul_ps(s, v);
            if (fmt != Q6_K) v = _mm256_sub_ps(v, m);
            _mm256_storeu_ps(w + g * len + l, v);
        }
    }
}

// out[i] = row . x_i for mc rows of x (row stride x_s); inlined with constant mc
AVX2 static inline __attribute__((always_inline)) void row_f32_avx2(int fmt, const uint8_t *row, int64_t nb,
                                                                     const float *x, int64_t x_s, const int mc,
                                                                     float *out) {
    enum { C = 8 };  // chains per row of x at mc = 1
    const int S = mc == 1 ? C : mc == 2 ? 4 : 2;
    const int64_t bb = block_bytes(fmt);
    __m256 acc[MT][C];
    for (int i = 0; i < mc; i++)
        for (int s = 0; s < S; s++) acc[i][s] = _mm256_setzero_ps();
    float w[QK] __attribute__((aligned(32)));
    for (int64_t b = 0; b < nb; b++) {
        decode_avx2(fmt, row + b * bb, w);
        for (int k = 0; k < QK / 8; k++) {
            __m256 wk = _mm256_load_ps(w + 8 * k);
            for (int i = 0; i < mc; i++)
                acc[i][k % S] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + i * x_s + b * QK + 8 * k), acc[i][k % S]);
        }
    }
    for (int i = 0; i < mc; i++) {
        __m256 a = acc[i][0];
        for (int s = 1; s < S; s++) a = _mm256_add_ps(a, acc[i][s]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[i] = _mm_cvtss_f32(h);
    }
}

AVX2 static void row_f32_avx2_mc(int fmt, const uint8_t *row, int64_t nb, const float *x, int64_t x_s, int mc,
                                 float *out) {
    switch (mc) {
        case 4: row_f32_avx2(fmt, row, nb, x, x_s, 4, out); break;
        case 3: row_f32_avx2(fmt, row, nb, x, x_s, 3, out); break;
        case 2: row_f32_avx2(fmt, row, nb, x, x_s, 2, out); break;
        default: row_f32_avx2(fmt, row, nb, x, x_s, 1, out); break;
    }
}

#endif

static void row_f32_scalar(int fmt, const uint8_t *row, int64_t nb, const float *x, int64_t x_s, int mc,
                           float *out) {
    const int64_t bb = block_bytes(fmt);
    float w[QK];
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        decode_scalar(fmt, row + b * bb, w);
        for (int i = 0; i < mc; i++) {
            const float *xb = x + i * x_s + b * QK;
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += w[j] * xb[j];
            out[i] += s;
        }
    }
}

// ------------------------------------------------------------------------------------------ entry points

// out[i * o_s + n] = x[i] . w[n] (+ bias[n]), x fp32 [M, cols] (row stride x_s); data [rows, nb * block_bytes]
void duet_quant_k_linear_f32(int fmt, const uint8_t *data, int64_t rows, int64_t cols, const float *x, int64_t x_s,
                             int64_t M, const float *bias, float *out, int64_t o_s, int force_scalar,
                             int num_threads) {
    const int64_t nb = cols / QK, row_bytes = nb * block_bytes(fmt);
    const int simd = !force_scalar && avx2_supported();
    (void)simd;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t n = 0; n < rows; n++)
        for (int64_t i0 = 0; i0 < M; i0 += MT) {
            int mc = M - i0 < MT ? (int)(M - i0) : MT;
            float res[MT];
#ifdef HAVE_X86
            if (simd)
                row_f32_avx2_mc(fmt, data + n * row_bytes, nb, x + i0 * x_s, x_s, mc, res);
            else
#endif
                row_f32_scalar(fmt, data + n * row_bytes, nb, x + i0 * x_s, x_s, mc, res);
            for (int i = 0; i < mc; i++) out[(i0 + i) * o_s + n] = res[i] + (bias ? bias[n] : 0.0f);
        }
}

// out [count, cols] = rows (ids ? ids[i] : row0 + i) dequantized, exactly as gguf-py
void duet_quant_k_dequantize(int fmt, const uint8_t *data, int64_t cols, const int64_t *ids, int64_t row0,
                             int64_t count, float *out, int force_scalar, int num_threads) {
    const int64_t nb = cols / QK, row_bytes = nb * block_bytes(fmt);
    const int simd = !force_scalar && avx2_supported();
    (void)simd;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = data + (ids ? ids[i] : row0 + i) * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
#ifdef HAVE_X86
            if (simd) {
                decode_avx2(fmt, row + b * block_bytes(fmt), out + i * cols + b * QK);
                continue;
            }
#endif
            decode_scalar(fmt, row + b * block_bytes(fmt), out + i * cols + b * QK);
        }
    }
}
