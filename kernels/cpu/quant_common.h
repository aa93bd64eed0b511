// What the quantized kernels (kernels/cpu/quant*.c) share: fp16 -> fp32 exactly for the scalar paths, and the
// run-time choice of instruction set. Every kernel is compiled for every level below (gcc target attributes on
// the functions, whatever -march the file gets), and the entry points take ``isa``, the level to use: the best
// this CPU has (``isa_supported``) unless the caller forces a lower one (DUET_QUANT_ISA); each kernel runs its
// best variant at or below that level (a kernel without an AVX-512 variant runs its AVX2 one).
//   ISA_SCALAR  portable C
//   ISA_AVX2    AVX2 + FMA + F16C
//   ISA_AVX512  + AVX-512 F/BW/VL/DQ (512-bit registers, 32 of them)
//   ISA_VNNI    + AVX512-VNNI (vpdpbusd: u8 x s8 dot products of 4, summed into int32, one instruction)
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ISA_SCALAR 0
#define ISA_AVX2 1
#define ISA_AVX512 2
#define ISA_VNNI 3  // macros, not an enum: quant_k_vec.h tests them with #if

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#endif

// exact for every value, subnormals included
static inline float half_to_float(uint16_t h) {
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

// the best level this CPU takes (cpuid, once)
#ifdef HAVE_X86
static inline int isa_supported(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        int level = ISA_SCALAR;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
            level = ISA_AVX2;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
                level = ISA_AVX512;
                if (__builtin_cpu_supports("avx512vnni")) level = ISA_VNNI;
            }
        }
        cached = level;
    }
    return cached;
}
#else
static inline int isa_supported(void) { return ISA_SCALAR; }
#endif

// the level a kernel runs at: the caller's, never above what this CPU takes
static inline int isa_level(int isa) {
    int best = isa_supported();
    return isa < best ? (isa < 0 ? ISA_SCALAR : isa) : best;
}

// out[i] = in[i] rounded to bf16, nearest even (torch's Tensor.to(torch.bfloat16), NaN kept a NaN); the prefill
// tiles of int8 activations for the bf16 GEMM (kernels/cpu_quant.py). A loop the compiler vectorizes.
static inline void f32_to_bf16(const float *in, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, in + i, 4);
        const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        out[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : r);
    }
}

// rows lo .. hi - 1 of the group at row 8g (lo, hi within it) dequantized into buf (row stride cols), fp32
typedef void (*group_rows_f32_fn)(const void *ctx, int64_t g, int64_t lo, int64_t hi, float *buf, int64_t cols);

// out [count, cols] bf16 = rows row0 .. row0 + count - 1 dequantized by rows(ctx, ...) one group of 8 rows at a time
// into a per-thread fp32 scratch that stays in cache, then rounded into out (f32_to_bf16): one pass over memory
// instead of an fp32 tile written and read back. Returns 1 when out of memory.
static inline int dequantize_bf16_by_groups(group_rows_f32_fn rows, const void *ctx, int64_t cols, int64_t row0,
                                            int64_t count, uint16_t *out, int num_threads) {
    const int64_t g0 = row0 / 8, g1 = (row0 + count + 7) / 8;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (count * cols >= 65536)
    {
        float *buf = malloc(8 * cols * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = g0; g < g1; g++) {
            if (!buf) continue;
            const int64_t lo = g * 8 > row0 ? g * 8 : row0, hi = g * 8 + 8 < row0 + count ? g * 8 + 8 : row0 + count;
            rows(ctx, g, lo, hi, buf, cols);
            f32_to_bf16(buf, out + (lo - row0) * cols, (hi - lo) * cols);
        }
        free(buf);
    }
    return failed;
}

// avx2_supported(): this CPU takes the AVX2 + FMA + F16C paths
static inline int avx2_supported(void) { return isa_supported() >= ISA_AVX2; }
