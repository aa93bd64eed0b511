// The 32-weight GGUF formats' packed layout and the pieces their kernels share (kernels/cpu/quant.c: int8
// activations and dequantize; kernels/cpu/quant_planes.c: fp32 activations): the layout (quant.c's top), a
// block's quants expanded (scalar, AVX2) and integer dots of a block against int8 x (AVX2, AVX512-VNNI).
#pragma once
#include <stdint.h>
#include <string.h>

#include "quant_common.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };
#define MT 4  // rows of x per pass over a group's weights

typedef struct {
    int fmt, offset, qb;  // qb: quant bytes per row-block (16 or 32)
    const uint8_t *qs;
    const uint32_t *qh;
    const uint16_t *d, *m;
    int64_t nb;
} Weights;

static Weights weights(int fmt, const uint8_t *qs, const uint32_t *qh, const uint16_t *d, const uint16_t *m,
                       int64_t nb) {
    Weights w = {fmt, fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0, fmt == Q8_0 ? 32 : 16, qs, qh, d, m, nb};
    return w;
}


// index of row n's entry for block b in the [groups, nb, 8] arrays
static inline int64_t at(const Weights *w, int64_t n, int64_t b) { return ((n / 8) * w->nb + b) * 8 + n % 8; }

// ------------------------------------------------------------------------------------------ scalar twins

// block b of row n as its 32 quants: unsigned (q before the offset) or, for Q8_0, signed
static void expand_scalar(const Weights *w, int64_t n, int64_t b, int q[32]) {
    const uint8_t *s = w->qs + ((n / 8) * w->nb + b) * 8 * w->qb + (n % 8) * 4;
    if (w->fmt == Q8_0) {
        for (int j = 0; j < 32; j++) q[j] = (int8_t)s[(j / 4) * 32 + j % 4];
        return;
    }
    for (int j = 0; j < 16; j++) {
        uint8_t byte = s[(j / 4) * 32 + j % 4];
        q[j] = byte & 15;
        q[j + 16] = byte >> 4;
    }
    if (w->qh) {
        uint32_t h = w->qh[at(w, n, b)];
        for (int j = 0; j < 32; j++) q[j] |= ((h >> j) & 1) << 4;
    }
}

#ifdef HAVE_X86

// chunk c's 5th bits for the 8 rows (lane r: row r's qh shifted so its bit 0 is weight 4c's): byte r*4+t = 16
// where bit t is set
AVX2 static inline __m256i high_bits_avx2(__m256i qh_shifted) {
    const __m256i spread = _mm256_set_epi8(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0,
                                           12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0);
    const __m256i bit = _mm256_set1_epi32(0x08040201);
    __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(qh_shifted, spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(16));
}

// chunk c (0..7) of a group-block: weights 4c..4c+3 of its 8 rows, as unsigned bytes (Q8_0: signed)
// lane r: row r. Q4/Q5: chunks 0..3 are the low nibbles of the 4 loads, 4..7 the high.
AVX2 static inline __attribute__((always_inline)) void expand_avx2(const int fmt, const uint8_t *qgb,
                                                                    const uint32_t *hgb, __m256i v[8]) {
    if (fmt == Q8_0) {
        for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(qgb + c * 32));
        return;
    }
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i h = fmt == Q5_0 || fmt == Q5_1 ? _mm256_loadu_si256((const __m256i *)hgb) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qgb + c * 32));
        v[c] = _mm256_and_si256(raw, mask);
        v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        if (fmt == Q5_0 || fmt == Q5_1) {
            v[c] = _mm256_or_si256(v[c], high_bits_avx2(_mm256_srli_epi32(h, 4 * c)));
            v[c + 4] = _mm256_or_si256(v[c + 4], high_bits_avx2(_mm256_srli_epi32(h, 16 + 4 * c)));
        }
    }
}

// q . xq of a block for the mc rows of x, lane r: row r (v: the block's 8 chunks from expand_avx2), in int32
AVX2 static inline __attribute__((always_inline)) void dots_avx2(const int fmt, const __m256i v[8],
                                                                  const int8_t *xb, int64_t x_s, const int mc,
                                                                  __m256i *isum) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < mc; i++) {
        int32_t x4[8];
        memcpy(x4, xb + i * x_s, 32);
        if (fmt == Q4_0 || fmt == Q4_1) {  // 8 x 2 * 15 * 127 < 32767: one int16 sum per block
            __m256i s16 = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(x4[0]));
            for (int c = 1; c < 8; c++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[c], _mm256_set1_epi32(x4[c])));
            isum[i] = _mm256_madd_epi16(s16, ones);
        } else if (fmt == Q8_0) {  // |w| as unsigned, x takes w's sign
            isum[i] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(v[c], v[c]),
                                                 _mm256_sign_epi8(_mm256_set1_epi32(x4[c]), v[c]));
                isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p, ones));
            }
        } else {  // Q5: 2 x 2 * 31 * 127 < 32767: int16 sums of two chunks
            isum[i] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c += 2) {
                __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v[c], _mm256_set1_epi32(x4[c])),
                                             _mm256_maddubs_epi16(v[c + 1], _mm256_set1_epi32(x4[c + 1])));
                isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p, ones));
            }
        }
    }
}

// the same with AVX512-VNNI (256-bit vpdpbusd: 4 products of u8 w by s8 x into each int32 lane, one instruction)
VNNI static inline __attribute__((always_inline)) void dots_vnni(const int fmt, const __m256i v[8],
                                                                  const int8_t *xb, int64_t x_s, const int mc,
                                                                  __m256i *isum) {
    for (int i = 0; i < mc; i++) {
        int32_t x4[8];
        memcpy(x4, xb + i * x_s, 32);
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++)
            s = fmt == Q8_0 ? _mm256_dpbusd_epi32(s, _mm256_sign_epi8(v[c], v[c]),
                                                  _mm256_sign_epi8(_mm256_set1_epi32(x4[c]), v[c]))
                            : _mm256_dpbusd_epi32(s, v[c], _mm256_set1_epi32(x4[c]));
        isum[i] = s;
    }
}
#endif
