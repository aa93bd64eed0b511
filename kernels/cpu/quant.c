// duet's GGUF block-quantized linears for the CPU path, called from kernels/cpu_quant.py through ctypes.
//
// Packed layout (cpu_quant.pack): per format, arrays apart, each [rows, num_blocks(, per-block bytes)]:
//   qs  uint8 [rows, nb * 16] nibbles as ggml (byte j: weight j low, weight j + 16 high), or int8 [rows, nb * 32]
//   qh  uint32 [rows, nb] (Q5_*: bit j is bit 4 of weight j), d and m fp16 [rows, nb] (m: *_1 only).
// Scales stay fp16 (8 converted per F16C instruction): the packed bytes are the file's bytes, no more.
//
// linear: out[i, n] = sum_k x[i, k] * w[n, k] (+ bias[n]) for M rows of x at once, threads over output rows:
// each weight row is read from memory once per call and from L1 once per 4 rows of x. Per block b of a row:
//   w = q * d + c   (c = m for *_1, c = -offset * d for Q4_0/Q5_0, 0 for Q8_0)
//   w . x_b = d * (q . x_b) + c * sum(x_b)
// so a block is an unsigned-integer dot times one scale, plus a correction term summed over blocks apart.
// Two activation paths: "int8" (llama.cpp's: x quantized per 32-block to int8 with a scale xd, integer dots by
// _mm256_maddubs_epi16, exact in int16 since 31 * 127 * 2 < 32767) and "fp32" (quants widened to fp32 in
// registers, fp32 FMAs). Both have a portable scalar twin, chosen at run time (__builtin_cpu_supports) or forced.
// The int8 dots are the same integers on both; only fp32 summation order differs.
//
// Compiled with -ffp-contract=off: dequantize is d * q + m in two roundings, as gguf-py (the reference).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };
#define CHUNK 64  // blocks whose scales are converted at once (bounded stack for any width)
#define MT 4      // rows of x per pass over a weight row

typedef struct {
    int fmt, offset, qs_bytes;  // qs_bytes: per block (16 or 32)
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

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-08f;  // 2^-24: subnormal (exact)
        return sign ? -f : f;
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// ------------------------------------------------------------------------------------------ scalar twins

// block b of row n as its 32 quants: unsigned (q before the offset) or, for Q8_0, signed
static void expand_scalar(const Weights *w, int64_t n, int64_t b, int q[32]) {
    if (w->fmt == Q8_0) {
        const int8_t *s = (const int8_t *)w->qs + (n * w->nb + b) * 32;
        for (int j = 0; j < 32; j++) q[j] = s[j];
        return;
    }
    const uint8_t *s = w->qs + (n * w->nb + b) * 16;
    for (int j = 0; j < 16; j++) {
        q[j] = s[j] & 15;
        q[j + 16] = s[j] >> 4;
    }
    if (w->qh) {
        uint32_t h = w->qh[n * w->nb + b];
        for (int j = 0; j < 32; j++) q[j] |= ((h >> j) & 1) << 4;
    }
}

static void dequant_row_scalar(const Weights *w, int64_t n, float *out) {
    int q[32];
    for (int64_t b = 0; b < w->nb; b++) {
        expand_scalar(w, n, b, q);
        float d = half_to_float(w->d[n * w->nb + b]);
        if (w->m) {
            float m = half_to_float(w->m[n * w->nb + b]);
            for (int j = 0; j < 32; j++) out[b * 32 + j] = d * (float)q[j] + m;
        } else {
            for (int j = 0; j < 32; j++) out[b * 32 + j] = d * (float)(q[j] - w->offset);
        }
    }
}

// the correction coefficient c of block b (see the top): m, -offset * d or 0
static inline float coef(const Weights *w, int64_t i, float d) {
    return w->m ? half_to_float(w->m[i]) : -(float)w->offset * d;
}

// out[i] for the mc rows of x at xq/xf (row stride ld), the block sums xs and (int8) the block scales xd
static void row_scalar(const Weights *w, int64_t n, int int8, const int8_t *xq, const float *xf, int64_t ld,
                       const float *xd, const float *xs, int mc, float *out) {
    int q[32];
    for (int i = 0; i < mc; i++) out[i] = 0.0f;
    for (int64_t b = 0; b < w->nb; b++) {
        expand_scalar(w, n, b, q);
        float d = half_to_float(w->d[n * w->nb + b]), c = coef(w, n * w->nb + b, d);
        for (int i = 0; i < mc; i++) {
            if (int8) {
                const int8_t *xb = xq + i * ld + b * 32;
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) dot += q[j] * xb[j];
                out[i] += (float)dot * (d * xd[i * w->nb + b]);
            } else {
                const float *xb = xf + i * ld + b * 32;
                float dot = 0.0f;
                for (int j = 0; j < 32; j++) dot += (float)q[j] * xb[j];
                out[i] += dot * d;
            }
            if (w->fmt != Q8_0) out[i] += c * xs[i * w->nb + b];
        }
    }
}

// ------------------------------------------------------------------------------------------ AVX2 + FMA + F16C
#ifdef HAVE_X86

// block b of a row (its quants at qrow, its high bits at hrow) as 32 bytes in weight order (fmt a constant
// after inlining)
AVX2 static inline __attribute__((always_inline)) __m256i expand_avx2(const int fmt, const uint8_t *qrow,
                                                                       const uint32_t *hrow, int64_t b) {
    if (fmt == Q8_0) return _mm256_loadu_si256((const __m256i *)(qrow + b * 32));
    __m128i t = _mm_loadu_si128((const __m128i *)(qrow + b * 16));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
    if (fmt == Q5_0 || fmt == Q5_1) {  // llama.cpp's bytes_from_bits_32: bit j -> byte j all ones
        const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)hrow[b]), shuf);
        bytes = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                  _mm256_set1_epi64x(-1));
        q = _mm256_or_si256(q, _mm256_and_si256(bytes, _mm256_set1_epi8(16)));
    }
    return q;
}

AVX2 static inline __m256 widen_avx2(__m128i v, int is_signed) {  // 8 bytes -> 8 floats
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

AVX2 static inline void scales_avx2(const uint16_t *h, int count, float *out) {
    int j = 0;
    for (; j + 8 <= count; j += 8) _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (; j < count; j++) out[j] = _cvtsh_ss(h[j]);
}

AVX2 static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// sum_k a[k] * b[k] in 8 lanes (a scalar chain of adds would cost an add's latency per block)
AVX2 static inline float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float t = hsum_avx2(acc);
    for (; k < n; k++) t += a[k] * b[k];
    return t;
}

// one block's contribution to acc[0..mc); row i of x's scale is s[i * CHUNK] (int8: d * xd) or s[0] (fp32: d).
// Inlined with constant fmt, int8 and mc: the accumulators stay in registers.
AVX2 static inline __attribute__((always_inline)) void block_avx2(
    const int fmt, const uint8_t *qrow, const uint32_t *hrow, int64_t b, const int int8, const int8_t *xq,
    const float *xf, int64_t ld, const float *s, const int mc, __m256 *acc) {
    __m256i q = expand_avx2(fmt, qrow, hrow, b);
    const int sgn = fmt == Q8_0;
    if (int8) {
        __m256i qa = sgn ? _mm256_sign_epi8(q, q) : q;
        for (int i = 0; i < mc; i++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * ld + b * 32));
            if (sgn) xv = _mm256_sign_epi8(xv, q);
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xv), _mm256_set1_epi16(1));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(s + i * CHUNK), acc[i]);
        }
    } else {
        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        __m256 f0 = widen_avx2(lo, sgn), f1 = widen_avx2(_mm_srli_si128(lo, 8), sgn);
        __m256 f2 = widen_avx2(hi, sgn), f3 = widen_avx2(_mm_srli_si128(hi, 8), sgn);
        __m256 d = _mm256_broadcast_ss(s);
        for (int i = 0; i < mc; i++) {
            const float *xb = xf + i * ld + b * 32;
            __m256 t = _mm256_mul_ps(f0, _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(f1, _mm256_loadu_ps(xb + 8), t);
            __m256 u = _mm256_mul_ps(f2, _mm256_loadu_ps(xb + 16));
            u = _mm256_fmadd_ps(f3, _mm256_loadu_ps(xb + 24), u);
            acc[i] = _mm256_fmadd_ps(_mm256_add_ps(t, u), d, acc[i]);
        }
    }
}

AVX2 static inline __attribute__((always_inline)) void row_avx2_mc(
    const Weights *w, const int fmt, int64_t n, const int int8, const int8_t *xq, const float *xf, int64_t ld,
    const float *xd, const float *xs, const int mc, float *out) {
    __m256 a0[MT], a1[MT];  // two chains per row of x: an FMA's latency is hidden behind the other block
    float corr[MT] = {0}, d[CHUNK], c[CHUNK], sc[MT * CHUNK];
    for (int i = 0; i < mc; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    const uint8_t *qrow = w->qs + n * w->nb * w->qs_bytes;
    const uint32_t *hrow = w->qh ? w->qh + n * w->nb : NULL;
    for (int64_t b0 = 0; b0 < w->nb; b0 += CHUNK) {
        int bc = w->nb - b0 < CHUNK ? (int)(w->nb - b0) : CHUNK;
        scales_avx2(w->d + n * w->nb + b0, bc, d);
        if (fmt != Q8_0) {
            if (w->m) scales_avx2(w->m + n * w->nb + b0, bc, c);
            else for (int j = 0; j < bc; j++) c[j] = -(float)w->offset * d[j];
            for (int i = 0; i < mc; i++) corr[i] += dot_avx2(c, xs + i * w->nb + b0, bc);
        }
        const float *s = d;
        if (int8) {  // per row of x: the products d * xd of its blocks
            for (int i = 0; i < mc; i++) {
                const float *xdi = xd + i * w->nb + b0;
                float *si = sc + i * CHUNK;
                int k = 0;
                for (; k + 8 <= bc; k += 8)
                    _mm256_storeu_ps(si + k, _mm256_mul_ps(_mm256_loadu_ps(d + k), _mm256_loadu_ps(xdi + k)));
                for (; k < bc; k++) si[k] = d[k] * xdi[k];
            }
            s = sc;
        }
        int j = 0;
        for (; j + 2 <= bc; j += 2) {
            block_avx2(fmt, qrow, hrow, b0 + j, int8, xq, xf, ld, s + j, mc, a0);
            block_avx2(fmt, qrow, hrow, b0 + j + 1, int8, xq, xf, ld, s + j + 1, mc, a1);
        }
        if (j < bc) block_avx2(fmt, qrow, hrow, b0 + j, int8, xq, xf, ld, s + j, mc, a0);
    }
    for (int i = 0; i < mc; i++) out[i] = hsum_avx2(_mm256_add_ps(a0[i], a1[i])) + corr[i];
}

typedef void (*RowFn)(const Weights *, int64_t, const int8_t *, const float *, int64_t, const float *,
                      const float *, int, float *);

// one function per (format, activation path), each with the row-of-x count unrolled for 4, 3, 2 and 1
#define ROW_FN(F, I)                                                                                          \
    AVX2 static void row_avx2_##F##_##I(const Weights *w, int64_t n, const int8_t *xq, const float *xf,      \
                                        int64_t ld, const float *xd, const float *xs, int mc, float *out) { \
        switch (mc) {                                                                                         \
            case 4: row_avx2_mc(w, F, n, I, xq, xf, ld, xd, xs, 4, out); break;                               \
            case 3: row_avx2_mc(w, F, n, I, xq, xf, ld, xd, xs, 3, out); break;                               \
            case 2: row_avx2_mc(w, F, n, I, xq, xf, ld, xd, xs, 2, out); break;                               \
            default: row_avx2_mc(w, F, n, I, xq, xf, ld, xd, xs, 1, out); break;                              \
        }                                                                                                     \
    }
ROW_FN(Q8_0, 0) ROW_FN(Q8_0, 1) ROW_FN(Q4_0, 0) ROW_FN(Q4_0, 1) ROW_FN(Q4_1, 0) ROW_FN(Q4_1, 1)
ROW_FN(Q5_0, 0) ROW_FN(Q5_0, 1) ROW_FN(Q5_1, 0) ROW_FN(Q5_1, 1)

static RowFn row_avx2(int fmt, int int8) {
    switch (fmt) {
        case Q8_0: return int8 ? row_avx2_Q8_0_1 : row_avx2_Q8_0_0;
        case Q4_0: return int8 ? row_avx2_Q4_0_1 : row_avx2_Q4_0_0;
        case Q4_1: return int8 ? row_avx2_Q4_1_1 : row_avx2_Q4_1_0;
        case Q5_0: return int8 ? row_avx2_Q5_0_1 : row_avx2_Q5_0_0;
        default: return int8 ? row_avx2_Q5_1_1 : row_avx2_Q5_1_0;
    }
}

AVX2 static void dequant_row_avx2(const Weights *w, int64_t n, float *out) {
    float d[CHUNK], m[CHUNK];
    const int sgn = w->fmt == Q8_0 || w->offset;
    for (int64_t b0 = 0; b0 < w->nb; b0 += CHUNK) {
        int bc = w->nb - b0 < CHUNK ? (int)(w->nb - b0) : CHUNK;
        scales_avx2(w->d + n * w->nb + b0, bc, d);
        if (w->m) scales_avx2(w->m + n * w->nb + b0, bc, m);
        for (int j = 0; j < bc; j++) {
            __m256i q = expand_avx2(w->fmt, w->qs + n * w->nb * w->qs_bytes, w->qh ? w->qh + n * w->nb : NULL, b0 + j);
            if (w->offset) q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)w->offset));
            __m128i h[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
            __m256 dv = _mm256_set1_ps(d[j]);
            float *o = out + (b0 + j) * 32;
            for (int k = 0; k < 4; k++) {
                __m256 v = _mm256_mul_ps(dv, widen_avx2(k & 1 ? _mm_srli_si128(h[k >> 1], 8) : h[k >> 1], sgn));
                if (w->m) v = _mm256_add_ps(v, _mm256_set1_ps(m[j]));
                _mm256_storeu_ps(o + 8 * k, v);
            }
        }
    }
}

static int avx2_supported(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cached;
}
#else
static int avx2_supported(void) { return 0; }
#endif

// ------------------------------------------------------------------------------------------ entry points

// 1 when this machine takes the AVX2 path (unless forced scalar)
int duet_quant_simd(void) { return avx2_supported(); }

// x [M, cols] (row stride x_s) -> xq int8 [M, cols], xd = amax / 127 and xs = xd * sum(xq) per block [M, nb]
// (llama.cpp's quantize_row_q8_1: round to nearest even); the fp32 path needs only xs = sum(x) per block.
static void prepare_x(const float *x, int64_t x_s, int64_t M, int64_t cols, int int8, int8_t *xq, float *xd,
                      float *xs, int num_threads) {
    int64_t nb = cols / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * cols >= 65536)
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + i * x_s + b * 32;
            if (!int8) {
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += v[j];
                xs[i * nb + b] = s;
                continue;
            }
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
                      float *out, int64_t o_s, int int8, int force_scalar, int num_threads) {
    Weights w = weights(fmt, qs, qh, d, m, cols / 32);
    int64_t nb = w.nb;
    int8_t *xq = int8 ? malloc((size_t)(M * cols)) : NULL;
    float *xd = malloc(sizeof(float) * (size_t)(M * nb * 2 + 1));
    if ((int8 && !xq) || !xd) {
        free(xq);
        free(xd);
        return 1;
    }
    float *xs = xd + M * nb;
    prepare_x(x, x_s, M, cols, int8, xq, xd, xs, num_threads);
    const int64_t ld = int8 ? cols : x_s;
#ifdef HAVE_X86
    RowFn simd = !force_scalar && avx2_supported() ? row_avx2(fmt, int8) : NULL;
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * M * cols >= 32768)
    for (int64_t n = 0; n < rows; n++) {
        float res[MT];
        for (int64_t i0 = 0; i0 < M; i0 += MT) {
            int mc = M - i0 < MT ? (int)(M - i0) : MT;
            const int8_t *q8 = int8 ? xq + i0 * cols : NULL;
            const float *xf = x + i0 * x_s;
#ifdef HAVE_X86
            if (simd) simd(&w, n, q8, xf, ld, xd + i0 * nb, xs + i0 * nb, mc, res);
            else
#endif
                row_scalar(&w, n, int8, q8, xf, ld, xd + i0 * nb, xs + i0 * nb, mc, res);
            for (int i = 0; i < mc; i++) out[(i0 + i) * o_s + n] = res[i] + (bias ? bias[n] : 0.0f);
        }
    }
    free(xq);
    free(xd);
    return 0;
}

// out [count, cols] = rows (ids ? ids[i] : row0 + i) dequantized, exactly as gguf-py
void duet_quant_dequantize(int fmt, const uint8_t *qs, const uint32_t *qh, const uint16_t *d, const uint16_t *m,
                           int64_t cols, const int64_t *ids, int64_t row0, int64_t count, float *out,
                           int force_scalar, int num_threads) {
    Weights w = weights(fmt, qs, qh, d, m, cols / 32);
    const int simd = !force_scalar && avx2_supported();
    (void)simd;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * cols >= 65536)
    for (int64_t i = 0; i < count; i++) {
        int64_t n = ids ? ids[i] : row0 + i;
#ifdef HAVE_X86
        if (simd) dequant_row_avx2(&w, n, out + i * cols);
        else
#endif
            dequant_row_scalar(&w, n, out + i * cols);
    }
}
