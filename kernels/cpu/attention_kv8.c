// duet's CPU kernels for a 1-byte KV cache — int8, fp8 e4m3 (e4m3fn: no infinities, max 448) and fp8 e5m2 — called
// from kernels/cpu_kv_int8.py through ctypes; each type's kernels are attention_kv8.inc instantiated (suffixes _i8,
// _e4m3, _e5m2). The fp8 bytes travel as int8_t pointers (bytes are bytes); only their conversion differs.
//
// Layout (kernels/kv_quant.py): a layer's K (or V) is 1-byte values [num_blocks, block_size, num_kv_heads, head_dim]
// and fp32 scales [num_blocks, block_size, num_kv_heads], both strided views of the one cache tensor (each page of a
// block holds its values, then their scales); strides in elements, a row's head_dim values contiguous, a row's
// heads' scales contiguous. value ≈ int8 × scale.
//
// Store: per token and KV head, scale = amax / qmax (127, 448, 57344) and x / scale clamped to ±qmax, then int8:
// nearbyintf (round half to even); fp8: rounded to the format's grid, half to even (fp8_of below: exact integer
// arithmetic on the fp32 value's exponent); a zero row gets scale 0 and its values divided by 1.
// kernels/kv_quant.py quantize_ref computes the same fp32 quotient and torch's casts round the same way: both write
// the same bytes (tests/kernels/test_cpu_kv_int8.py).
//
// Decode attention: the fp32 kernel's tiles and task loop instantiated for int8 rows (attention_decode.inc): each
// K/V chunk is loaded as 8 int8 and converted to fp32 in registers, a dot is multiplied by its key's scale and a
// probability by its value's scale (the same products as dequantizing first, in another order), so decode reads a
// quarter of fp32's bytes and writes nothing back. Prefill attention (compute-bound): the fp32 task loop fed with
// a 256-key tile of one KV head dequantized into a per-thread buffer (attention_tiles.h's kv_rows_fn); with fresh K/V
// (kernels/prefill_attention.py) a sequence's new tokens' rows are pointers into their K/V as computed instead, so a
// prompt without a cached prefix runs attention.c's arithmetic on fp32's floats. Scores, softmax and accumulation
// are fp32 throughout, as in attention.c.
#include "attention_tiles.h"

typedef int8_t vb8 __attribute__((vector_size(8), aligned(1)));  // 8 int8 lanes, unaligned loads
typedef uint8_t vb8u __attribute__((vector_size(8), aligned(1)));  // 8 bytes, unaligned
typedef int32_t v8i __attribute__((vector_size(32)));

// 8 int8 at p as 8 floats. GCC turns __builtin_convertvector of an 8-byte vector into 8 scalar byte loads (1,352
// movsbl in this file, and int8 decode ran at 0.68x fp32's speed): on x86 it is one sign-extending load and one
// conversion by intrinsics.
#if defined(__AVX2__)
#include <immintrin.h>
static inline v8 load8_i8(const int8_t *p) {
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
// 8 fp8 bytes at p as 8 floats, exactly: the byte's exponent and mantissa bits placed at the top of an fp32's (e4m3:
// << 20, e5m2: << 21) give the value times 2^-(127 - bias), subnormals included (as fp32 subnormals), so one
// multiply by 2^(127 - bias) finishes it; the sign bit goes to bit 31. Neither format's NaN / inf byte is ever
// stored (the store saturates at qmax).
static inline v8 load8_fp8(const int8_t *p, int shift, float rebias) {  // intrinsics, as load8_i8 (one load)
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24),
                                   _mm256_sll_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)),
                                                    _mm_cvtsi32_si128(shift)));
    return (v8)_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(rebias));
}
#else
static inline v8 load8_i8(const int8_t *p) { return __builtin_convertvector(*(const vb8 *)p, v8); }
static inline v8 load8_fp8(const int8_t *p, int shift, float rebias) {
    v8i b = __builtin_convertvector(*(const vb8u *)p, v8i);
    v8i bits = ((b & 0x80) << 24) | ((b & 0x7f) << shift);
    return (v8)bits * rebias;
}
#endif
#define load8_e4m3(p) load8_fp8(p, 20, 0x1p120f)
#define load8_e5m2(p) load8_fp8(p, 21, 0x1p112f)

// r (|r| <= the format's max) as an fp8 byte with `man` mantissa bits, exponent bias `bias`: e = max(floor(log2 |r|),
// 1 - bias) (subnormals share the smallest normal's step), m = nearbyintf(|r| * 2^(man - e)) in [2^man, 2^(man+1)]
// (or [0, 2^man] below the normals), byte = (e + bias) * 2^man + m - 2^man: a carry of m into 2^(man+1) is the next
// exponent's first value, as the encoding counts. Exact: |r| * 2^k is exact in fp32, nearbyintf rounds half to even.
static inline int8_t fp8_of(float r, int man, int bias) {
    float a = fabsf(r);
    int e = 1 - bias;
    if (a >= ldexpf(1.0f, 1 - bias)) {
        int k;
        frexpf(a, &k);  // a = f * 2^k, f in [0.5, 1)
        e = k - 1;
    }
    int m = (int)nearbyintf(ldexpf(a, man - e));
    int byte = (e + bias) * (1 << man) + m - (1 << man);
    return (int8_t)(uint8_t)(byte | (signbit(r) ? 0x80 : 0));
}

typedef struct {  // one layer's 1-byte K and V with their scales (strides in elements)
    const int8_t *k, *v;
    const float *ks, *vs;
    int64_t k_b, k_t, k_h, v_b, v_t, v_h;  // values [block, token, head] (+ head_dim contiguous)
    int64_t ks_b, ks_t, vs_b, vs_t;        // scales [block, token] (+ heads contiguous)
    int head_dim;                          // a multiple of 8
} kv_i8_t;

// dst[0:D] = src[0:D] * scale (D a multiple of 8)
// the rows' scale pointers of keys [t0, t0 + n) (K and V, head 0: head h's scale is p[h]), a block at a time
static inline void da_scale_rows(const kv_i8_t *c, const int32_t *table, int block_size, int t0, int n,
                                 const float **ksrow, const float **vsrow) {
    for (int t = 0; t < n; t++) {
        int pos = t0 + t, off = pos % block_size;
        int64_t b = table[pos / block_size];
        ksrow[t] = c->ks + b * c->ks_b + off * c->ks_t;
        vsrow[t] = c->vs + b * c->vs_b + off * c->vs_t;
    }
}


#define KV8_SFX(f) f##_i8
#define KV8_LOAD8(p) load8_i8(p)
#define KV8_QMAX 127.0f
#define KV8_QUANT(r) nearbyintf(r)
#include "attention_kv8.inc"
#undef KV8_SFX
#undef KV8_LOAD8
#undef KV8_QMAX
#undef KV8_QUANT

#define KV8_SFX(f) f##_e4m3
#define KV8_LOAD8(p) load8_e4m3(p)
#define KV8_QMAX 448.0f
#define KV8_QUANT(r) fp8_of(r, 3, 7)
#include "attention_kv8.inc"
#undef KV8_SFX
#undef KV8_LOAD8
#undef KV8_QMAX
#undef KV8_QUANT

#define KV8_SFX(f) f##_e5m2
#define KV8_LOAD8(p) load8_e5m2(p)
#define KV8_QMAX 57344.0f
#define KV8_QUANT(r) fp8_of(r, 2, 15)
#include "attention_kv8.inc"
