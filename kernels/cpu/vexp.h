// Vector helpers shared by the CPU kernels (GCC vector extensions: compiled for the machine they run on).
#pragma once
#include <stdint.h>

// VEC_LANES lanes of float / int32 (define before including; 8 or 16)
typedef float VEC_F __attribute__((vector_size(VEC_LANES * 4), aligned(4)));  // unaligned loads allowed
typedef int32_t VEC_I __attribute__((vector_size(VEC_LANES * 4), aligned(4)));

static inline VEC_F VEC_NAME(sel)(VEC_I mask, VEC_F a, VEC_F b) {  // mask lanes: all ones (a) or zero (b)
    return (VEC_F)((mask & (VEC_I)a) | (~mask & (VEC_I)b));
}

// exp(x) for all lanes (glibc's expf does not vectorize without -ffast-math): x = n ln2 + r with |r| <= ln2 / 2
// (ln2 split in two for exactness), exp(r) by the degree-6 Cephes polynomial, times 2^n built in the exponent
// bits. Within a few ulp of expf; 0 below -87.34 and inf above 88.38 (where floats run out); NaN stays NaN.
static inline VEC_F VEC_NAME(exp)(VEC_F x) {
    const VEC_F hi = (VEC_F){0} + 88.3762626647949f, lo = (VEC_F){0} - 87.3365447504f;
    VEC_I under = x < lo, over = x > hi;
    x = VEC_NAME(sel)(over, hi, x);
    x = VEC_NAME(sel)(under, lo, x);
    VEC_F fx = x * 1.44269504088896341f + 0.5f;
    VEC_I n = __builtin_convertvector(fx, VEC_I);  // truncates toward zero
    VEC_F nf = __builtin_convertvector(n, VEC_F);
    n += (VEC_I)(nf > fx);  // floor: -1 where a negative lane was rounded up
    nf = __builtin_convertvector(n, VEC_F);
    VEC_F r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    VEC_F z = r * r;
    VEC_F y = (VEC_F){0} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    VEC_I bits = (n + 127) << 23;
    VEC_F scale;
    __builtin_memcpy(&scale, &bits, sizeof(scale));
    y = y * scale;
    y = VEC_NAME(sel)(over, (VEC_F){0} + __builtin_inff(), y);
    return VEC_NAME(sel)(under, (VEC_F){0}, y);
}
