// x as 24-bit fixed point in three balanced base-255 int8 digits: what the digit-plane kernels (kernels/cpu/
// quant_planes.c per 32, quant_k_planes.c per 256) share. A block of x gets one power-of-two scale 2^s, chosen by
// digits_exponent from its largest |x|; then X_j = round(x_j * 2^s) = D0_j + 255 * D1_j + 65025 * D2_j with every
// digit in [-127, 127] (an int8 the int8 kernels' sign trick can negate).
#pragma once
#include <math.h>
#include <stdint.h>

#define PLANES 3
#define X_MAX 8290687  // 127 * (1 + 255 + 65025): the largest |X| three digits hold

// floor(a / 255) for a >= -8355840 (shifted to a non-negative dividend: one multiply and shift)
static inline int32_t floor_div255(int32_t a) { return (int32_t)((uint32_t)(a + 8355840) / 255u) - 32768; }

// 1 when the n values hold no inf or NaN; *amax their largest |x|
static inline int digits_finite(const float *v, int n, float *amax) {
    float m = 0.0f;
    int ok = 1;
    for (int j = 0; j < n; j++) {
        m = fmaxf(m, fabsf(v[j]));  // fmaxf drops NaN: tested apart
        ok &= v[j] == v[j];
    }
    *amax = m;
    return ok && m <= 3.4028234663852886e+38f;
}

// s for a block whose largest |x| is amax > 0 (finite): amax * 2^s in [2^21, X_MAX]; at most 149, where
// X = x * 2^149 is exact for every float (subnormals are multiples of 2^-149)
static inline int digits_exponent(float amax) {
    int e;
    frexpf(amax, &e);  // amax in [2^(e-1), 2^e)
    int s = 23 - e;    // amax * 2^s in [2^22, 2^23)
    if (s > 149) s = 149;
    if (lrintf(ldexpf(amax, s)) > X_MAX) s--;
    return s;
}

// the n values' digits at scale 2^s into d0, d1, d2; adds each plane's digit sums to ds and returns sum(X)
static inline int64_t digits_of(const float *v, int n, int s, int8_t *d0, int8_t *d1, int8_t *d2, int32_t ds[PLANES]) {
    const int plain = s >= -126 && s <= 127;  // 2^s a normal float: x * 2^s exact (or below 1/2: rounds to 0)
    const float scale = plain ? ldexpf(1.0f, s) : 0.0f;
    int64_t sum = 0;
    for (int j = 0; j < n; j++) {
        int32_t X = (int32_t)lrintf(plain ? v[j] * scale : ldexpf(v[j], s));
        int32_t q1 = floor_div255(X + 127), a = X - 255 * q1;
        int32_t q2 = floor_div255(q1 + 127), b = q1 - 255 * q2;
        d0[j] = (int8_t)a;
        d1[j] = (int8_t)b;
        d2[j] = (int8_t)q2;
        ds[0] += a, ds[1] += b, ds[2] += q2, sum += X;
    }
    return sum;
}
