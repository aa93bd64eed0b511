// The vector words the k-quant kernels (quant_k_f32.h, quant_k_int8.h) are written in, for one instruction set:
// included once per level with K_ISA defined (ISA_AVX2, ISA_AVX512 or ISA_VNNI), right before those bodies, so
// each kernel is written once and compiled for each level (no pragma once: it redefines its words each time).
//
// A vector covers KR rows of a group of 8 as (row, t) lanes, t = 0, 1: the two halves of a row's 8-byte chunk
// (int8 kernels: 4 bytes each, one int32 lane) or two neighbouring weights (fp32 kernels: one float each).
// AVX-512: KR = 8, one 64-byte load of a quant field is the whole group; AVX2: KR = 4, the group is two passes
// (pass h reads bytes 32h..32h+31 of each 64-byte unit: rows 4h..4h+3).
#undef KR
#undef KMT
#undef KTGT
#undef KSFX
#undef kvf
#undef kvi
#undef KV_LOADI
#undef KV_SET1_8
#undef KV_AND
#undef KV_OR
#undef KV_SRLI16
#undef KV_SLLI16
#undef KV_SUB8
#undef KV_SHUF
#undef KV_BCAST128I
#undef KV_CVT
#undef KV_FMA
#undef KV_FNMA
#undef KV_ADD
#undef KV_MUL
#undef KV_ZERO
#undef KV_ZEROI
#undef KV_SET1
#undef KV_ADDI
#undef KV_SUBI
#undef KV_BLEND_HI
#undef KV_BLEND_HI_I
#undef KV_BCAST2
#undef KV_BCAST8
#undef KV_PAIRS
#undef KV_PAIRS_I
#undef KV_LOAD_PAIR
#undef KV_STORE_ROWS
#undef KV_DOT
#undef KV_SET1_32
#undef KV_SCALES

#if K_ISA == ISA_AVX512 || K_ISA == ISA_VNNI
#define KR 8
#define KMT 4  // rows of x per pass (registers: 32)
#if K_ISA == ISA_VNNI
#define KTGT VNNI
#define KSFX(name) name##_vnni
#else
#define KTGT AVX512
#define KSFX(name) name##_avx512
#endif
#define kvf __m512
#define kvi __m512i
#define KV_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define KV_SET1_8(c) _mm512_set1_epi8((char)(c))
#define KV_AND(a, b) _mm512_and_si512(a, b)
#define KV_OR(a, b) _mm512_or_si512(a, b)
#define KV_SRLI16(a, n) _mm512_srli_epi16(a, n)
#define KV_SLLI16(a, n) _mm512_slli_epi16(a, n)
#define KV_SUB8(a, b) _mm512_sub_epi8(a, b)
#define KV_SHUF(a, m) _mm512_shuffle_epi8(a, m)
#define KV_BCAST128I(v) _mm512_broadcast_i32x4(v)
#define KV_CVT(a) _mm512_cvtepi32_ps(a)
#define KV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define KV_FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define KV_ADD(a, b) _mm512_add_ps(a, b)
#define KV_MUL(a, b) _mm512_mul_ps(a, b)
#define KV_ZERO() _mm512_setzero_ps()
#define KV_ZEROI() _mm512_setzero_si512()
#define KV_SET1(f) _mm512_set1_ps(f)
#define KV_SET1_32(v) _mm512_set1_epi32(v)
#define KV_ADDI(a, b) _mm512_add_epi32(a, b)
#define KV_SUBI(a, b) _mm512_sub_epi32(a, b)
#define KV_BLEND_HI(a, b) _mm512_mask_blend_ps((__mmask16)0xFF00, a, b)  // lanes 0..7 of a, 8..15 of b
#define KV_BLEND_HI_I(a, b) _mm512_mask_blend_epi32((__mmask16)0xFF00, a, b)

#ifndef K_VEC_512_HELPERS
#define K_VEC_512_HELPERS
// two floats (x_j, x_j+1) into every (row, t) pair of lanes
AVX512 static inline __attribute__((always_inline)) __m512 kv_bcast2_512(const float *p) {
    double v;
    memcpy(&v, p, 8);
    return _mm512_castpd_ps(_mm512_set1_pd(v));
}
// eight bytes of x (two int32 lanes' worth) into every (row, t) pair of lanes
AVX512 static inline __attribute__((always_inline)) __m512i kv_bcast8_512(const int8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm512_set1_epi64(v);
}
// (row, t) lanes of a and b -> [a's row sums | b's row sums] (rows 0..7 each)
AVX512 static inline __attribute__((always_inline)) __m512 kv_pairs_512(__m512 a, __m512 b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}
AVX512 static inline __attribute__((always_inline)) __m512i kv_pairs_i_512(__m512i a, __m512i b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
}
// [p0[0..7] | p1[0..7]]: a pair of sub-blocks' per-row values from a [sub-block][8 rows] table
AVX512 static inline __attribute__((always_inline)) __m512 kv_load_pair_512(const float *p0, const float *p1, int h) {
    (void)h;
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p0)), _mm256_loadu_ps(p1), 1);
}
// the two halves added: the 8 rows' results
AVX512 static inline __attribute__((always_inline)) void kv_store_rows_512(__m512 v, float *out) {
    _mm256_storeu_ps(out, _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#endif
#define KV_BCAST2(p) kv_bcast2_512(p)
#define KV_BCAST8(p) kv_bcast8_512(p)
#define KV_PAIRS(a, b) kv_pairs_512(a, b)
#define KV_PAIRS_I(a, b) kv_pairs_i_512(a, b)
#define KV_LOAD_PAIR(p0, p1, h) kv_load_pair_512(p0, p1, h)
#define KV_STORE_ROWS(v, out) kv_store_rows_512(v, out)
#define KV_SCALES(fmt, gb, D, M) k_scales_f32_512(fmt, gb, D, M)
#if K_ISA == ISA_VNNI  // acc + the 4 products u8 w x s8 x of each int32 lane, one instruction
#define KV_DOT(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#else  // pairs summed to int16 (at most 2 * 63 * 127: no saturation), then to int32
#define KV_DOT(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)))
#endif

#elif K_ISA == ISA_AVX2
#define KR 4
#define KMT 2  // rows of x per pass (registers: 16)
#define KTGT AVX2
#define KSFX(name) name##_avx2
#define kvf __m256
#define kvi __m256i
#define KV_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define KV_SET1_8(c) _mm256_set1_epi8((char)(c))
#define KV_AND(a, b) _mm256_and_si256(a, b)
#define KV_OR(a, b) _mm256_or_si256(a, b)
#define KV_SRLI16(a, n) _mm256_srli_epi16(a, n)
#define KV_SLLI16(a, n) _mm256_slli_epi16(a, n)
#define KV_SUB8(a, b) _mm256_sub_epi8(a, b)
#define KV_SHUF(a, m) _mm256_shuffle_epi8(a, m)
#define KV_BCAST128I(v) _mm256_broadcastsi128_si256(v)
#define KV_CVT(a) _mm256_cvtepi32_ps(a)
#define KV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define KV_FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define KV_ADD(a, b) _mm256_add_ps(a, b)
#define KV_MUL(a, b) _mm256_mul_ps(a, b)
#define KV_ZERO() _mm256_setzero_ps()
#define KV_ZEROI() _mm256_setzero_si256()
#define KV_SET1(f) _mm256_set1_ps(f)
#define KV_SET1_32(v) _mm256_set1_epi32(v)
#define KV_ADDI(a, b) _mm256_add_epi32(a, b)
#define KV_SUBI(a, b) _mm256_sub_epi32(a, b)
#define KV_BLEND_HI(a, b) _mm256_blend_ps(a, b, 0xF0)
#define KV_BLEND_HI_I(a, b) _mm256_blend_epi32(a, b, 0xF0)

#ifndef K_VEC_256_HELPERS
#define K_VEC_256_HELPERS
AVX2 static inline __attribute__((always_inline)) __m256 kv_bcast2_256(const float *p) {
    double v;
    memcpy(&v, p, 8);
    return _mm256_castpd_ps(_mm256_set1_pd(v));
}
AVX2 static inline __attribute__((always_inline)) __m256i kv_bcast8_256(const int8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}
// hadd: [a r0, a r1, b r0, b r1 | a r2, a r3, b r2, b r3]; then 64-bit lanes 0, 2, 1, 3: [a r0..r3 | b r0..r3]
AVX2 static inline __attribute__((always_inline)) __m256 kv_pairs_256(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(a, b)), 0xD8));
}
AVX2 static inline __attribute__((always_inline)) __m256i kv_pairs_i_256(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8);
}
AVX2 static inline __attribute__((always_inline)) __m256 kv_load_pair_256(const float *p0, const float *p1, int h) {
    return _mm256_loadu2_m128(p1 + 4 * h, p0 + 4 * h);
}
AVX2 static inline __attribute__((always_inline)) void kv_store_rows_256(__m256 v, float *out) {
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}
#endif
#define KV_BCAST2(p) kv_bcast2_256(p)
#define KV_BCAST8(p) kv_bcast8_256(p)
#define KV_PAIRS(a, b) kv_pairs_256(a, b)
#define KV_PAIRS_I(a, b) kv_pairs_i_256(a, b)
#define KV_LOAD_PAIR(p0, p1, h) kv_load_pair_256(p0, p1, h)
#define KV_STORE_ROWS(v, out) kv_store_rows_256(v, out)
#define KV_SCALES(fmt, gb, D, M) k_scales_f32(fmt, gb, D, M)
#define KV_DOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#else
#error "K_ISA must be ISA_AVX2, ISA_AVX512 or ISA_VNNI"
#endif
