// What the quantized kernels (kernels/cpu/quant.c, quant_k.c) share: fp16 -> fp32 exactly for the scalar paths,
// and the run-time choice of the AVX2 + FMA + F16C paths (``HAVE_X86``, ``AVX2`` on the functions compiled for them).
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
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

#ifdef HAVE_X86
static inline int avx2_supported(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cached;
}
#else
static inline int avx2_supported(void) { return 0; }
#endif
