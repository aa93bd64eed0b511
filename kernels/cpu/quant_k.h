// The k-quants' packed layout and what their kernels (kernels/cpu/quant_k.c: fp32 activations, dequantize;
// quant_k_int8.c: int8 activations) share.
//
// Packed (kernels/cpu_quant_k.py pack): rows in groups of 8 (the last padded with zero rows); group g's
// super-block b is one group-block of 8 * block_bytes bytes at (g * nb + b) * 8 * block_bytes. A group-block
// holds the 8 rows' super-blocks field by field in the file's order, each field [chunk][8 rows][e] (e bytes of
// one row, then the next row's): e = 8 for the quants, 2 for the fp16 scales, 1 for the 6- and 8-bit scales.
//   Q4_K (144 B): d [8] fp16 @0, dmin [8] @16, scales [12][8] @32, qs [16][8][8] @128
//   Q5_K (176 B): d @0, dmin @16, scales @32, qh [4][8][8] @128, qs [16][8][8] @384
//   Q6_K (210 B): ql [16][8][8] @0, qh [8][8][8] @1024, scales [16][8] int8 @1536, d [8] @1664
// (a field at file offset fo starts at 8 * fo). So one 64-byte load of a quant field is 8 bytes of each of the
// 8 rows (row r: bytes 8r..8r+7), the same weights of every row: llama.cpp's 8x8 interleave. The bytes are the
// file's, rearranged: unpack gives them back and dequantize gives exactly gguf-py's weights.
#pragma once
#include <stdint.h>
#include <string.h>

#include "quant_common.h"

enum { Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define QK 256
#define MT 4  // rows of x per pass over a group's weights

static inline int k_block_bytes(int fmt) { return fmt == Q4_K ? 144 : fmt == Q5_K ? 176 : 210; }

// offset of the quants (Q4_K / Q5_K qs, Q6_K ql) and of the high bits (Q5_K, Q6_K qh) in a group-block
static inline int k_qs_at(int fmt) { return fmt == Q4_K ? 128 : fmt == Q5_K ? 384 : 0; }
static inline int k_qh_at(int fmt) { return fmt == Q5_K ? 128 : 1024; }

// row r's super-block as the file has it, gathered from its group-block gb
static inline void k_file_block(int fmt, const uint8_t *gb, int r, uint8_t *blk) {
    static const int16_t fields[3][5][3] = {  // file offset, end, element bytes
        {{0, 2, 2}, {2, 4, 2}, {4, 16, 1}, {16, 144, 8}, {0, 0, 0}},
        {{0, 2, 2}, {2, 4, 2}, {4, 16, 1}, {16, 48, 8}, {48, 176, 8}},
        {{0, 128, 8}, {128, 192, 8}, {192, 208, 1}, {208, 210, 2}, {0, 0, 0}}};
    const int16_t(*f)[3] = fields[fmt - Q4_K];
    for (int i = 0; i < 5 && f[i][1]; i++) {
        const int lo = f[i][0], e = f[i][2];
        for (int o = 0; o < f[i][1] - lo; o += e) memcpy(blk + lo + o, gb + 8 * lo + o * 8 + r * e, (size_t)e);
    }
}

static inline float k_fp16_at(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

// a file super-block's 6-bit scales and mins (Q4_K, Q5_K: ggml's get_scale_min_k4) or int8 scales (Q6_K), as
// integers; returns the sub-block count (8 of 32 weights, or 16 of 16)
static inline int k_block_scales(int fmt, const uint8_t *blk, int sc[16], int mn[16]) {
    if (fmt == Q6_K) {
        for (int g = 0; g < 16; g++) sc[g] = (int8_t)blk[192 + g], mn[g] = 0;
        return 16;
    }
    const uint8_t *s = blk + 4;
    for (int j = 0; j < 8; j++) {
        sc[j] = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        mn[j] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    return 8;
}

// a file super-block's 256 quants in weight order: Q4_K / Q5_K unsigned (0..15 / 0..31), Q6_K unsigned 0..63
// (w = d * sc * (q - 32))
static inline void k_block_quants(int fmt, const uint8_t *blk, uint8_t q[QK]) {
    if (fmt == Q6_K) {
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *ql = blk + 64 * h, hb = blk[128 + 32 * h + l];
                uint8_t *o = q + 128 * h + l;
                o[0] = (uint8_t)((ql[l] & 15) | ((hb & 3) << 4));
                o[32] = (uint8_t)((ql[l + 32] & 15) | (((hb >> 2) & 3) << 4));
                o[64] = (uint8_t)((ql[l] >> 4) | (((hb >> 4) & 3) << 4));
                o[96] = (uint8_t)((ql[l + 32] >> 4) | (((hb >> 6) & 3) << 4));
            }
        return;
    }
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16), *qh = blk + 16;
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 32; l++) {
            q[64 * k + l] = qs[32 * k + l] & 15;
            q[64 * k + 32 + l] = qs[32 * k + l] >> 4;
        }
    if (fmt == Q5_K)
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) q[32 * j + l] |= (uint8_t)(((qh[l] >> j) & 1) << 4);
}

#ifdef HAVE_X86
// A group-block's per-row scales for the SIMD kernels, tables [sub-block j][8 rows] of floats: D[j][r] = d_r * sc
// (Q4_K, Q5_K: 8 sub-blocks of 32, their 6-bit scales and mins decoded for the 8 rows at once, M[j][r] = dmin_r *
// mn; Q6_K: 16 groups of 16, int8 scales, M untouched). Each product exact (an fp16 by a 6- or 8-bit integer): the
// same values as the reference's d * sc and dmin * mn.
AVX2 static inline __attribute__((always_inline)) void k_scales_f32(const int fmt, const uint8_t *gb, float *D,
                                                                     float *M) {
    if (fmt == Q6_K) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + 1664)));
        for (int g = 0; g < 16; g++)
            _mm256_storeu_ps(D + 8 * g, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                              _mm_loadl_epi64((const __m128i *)(gb + 1536 + 8 * g))))));
        return;
    }
    // bytes [j][r]: a = s[0..3], b = s[4..7], c = s[8..11] of the 8 rows (ggml's get_scale_min_k4, 32 at a time)
    const __m256i a = _mm256_loadu_si256((const __m256i *)(gb + 32)), b = _mm256_loadu_si256((const __m256i *)(gb + 64));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(gb + 96));
    const __m256i m6 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i v[4] = {_mm256_and_si256(a, m6),
                          _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_srli_epi16(a, 2), m30)),
                          _mm256_and_si256(b, m6),
                          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                          _mm256_and_si256(_mm256_srli_epi16(b, 2), m30))};
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gb));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + 16)));
    for (int i = 0; i < 4; i++) {  // sc[0..3], sc[4..7], mn[0..3], mn[4..7]
        float *o = (i < 2 ? D : M) + 32 * (i & 1);
        const __m256 s = i < 2 ? d : dmin;
        const __m128i lo = _mm256_castsi256_si128(v[i]), hi = _mm256_extracti128_si256(v[i], 1);
        const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[j]))));
    }
}

// k_scales_f32 with 512-bit conversions: 16 values (two sub-blocks of the 8 rows) per instruction
AVX512 static inline __attribute__((always_inline)) void k_scales_f32_512(const int fmt, const uint8_t *gb,
                                                                           float *D, float *M) {
    if (fmt == Q6_K) {
        const __m512 d = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(gb + 1664))));
        for (int g = 0; g < 16; g += 2)
            _mm512_storeu_ps(D + 8 * g, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                              _mm_loadu_si128((const __m128i *)(gb + 1536 + 8 * g))))));
        return;
    }
    const __m256i a = _mm256_loadu_si256((const __m256i *)(gb + 32)), b = _mm256_loadu_si256((const __m256i *)(gb + 64));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(gb + 96));
    const __m256i m6 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i v[4] = {_mm256_and_si256(a, m6),
                          _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_srli_epi16(a, 2), m30)),
                          _mm256_and_si256(b, m6),
                          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                          _mm256_and_si256(_mm256_srli_epi16(b, 2), m30))};
    const __m512 d = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)gb)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(gb + 16))));
    for (int i = 0; i < 4; i++) {  // sc[0..3], sc[4..7], mn[0..3], mn[4..7]
        float *o = (i < 2 ? D : M) + 32 * (i & 1);
        const __m512 s = i < 2 ? d : dmin;
        _mm512_storeu_ps(o, _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(v[i])))));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                      _mm256_extracti128_si256(v[i], 1)))));
    }
}

// the shuffle that moves byte 2p + t of each row's 8-byte chunk (rows 2L, 2L + 1 in 128-bit lane L) into byte
// ``at`` of int32 lane (row, t), the others zero: q << 8 * at, exact in fp32 (at 3: signed)
AVX2 static inline __m128i k_shuffle(int p, int at) {
    int8_t c[16];
    for (int i = 0; i < 16; i++) c[i] = (int8_t)(i % 4 == at ? (i / 8) * 8 + 2 * p + (i / 4) % 2 : -128);
    return _mm_loadu_si128((const __m128i *)c);
}
#endif
