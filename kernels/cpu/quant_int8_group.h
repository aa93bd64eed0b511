// The 32-weight formats' int8-activation kernel per group of 8 rows (see kernels/cpu/quant.c's top), included by
// quant.c once per instruction set with Q_TGT (the target attribute), Q_DOTS (the integer dot step: dots_avx2,
// dots_vnni) and Q_SFX (the names' suffix) defined; no pragma once: each inclusion is another instance.

// res[i] (lane r) = row 8g + r . x_i for mc rows of x; inlined with constant fmt and mc
Q_TGT static inline __attribute__((always_inline)) void Q_SFX(group)(
    const Weights *w, const int fmt, int64_t g, const int8_t *xq, const float *xd, const float *xs, const int mc,
    __m256 *res) {
    const int64_t nb = w->nb;
    __m256 acc[MT], corr[MT];
    for (int i = 0; i < mc; i++) acc[i] = corr[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i v[8], isum[MT];
        expand_avx2(fmt, w->qs + (g * nb + b) * 8 * w->qb, w->qh ? w->qh + (g * nb + b) * 8 : NULL, v);
        Q_DOTS(fmt, v, xq + b * 32, nb * 32, mc, isum);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->d + (g * nb + b) * 8)));
        for (int i = 0; i < mc; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]),
                                     _mm256_mul_ps(d, _mm256_broadcast_ss(xd + i * nb + b)), acc[i]);
        if (fmt != Q8_0) {
            __m256 c = fmt == Q4_1 || fmt == Q5_1
                           ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->m + (g * nb + b) * 8)))
                           : _mm256_mul_ps(d, _mm256_set1_ps(-(float)w->offset));
            for (int i = 0; i < mc; i++) corr[i] = _mm256_fmadd_ps(c, _mm256_broadcast_ss(xs + i * nb + b), corr[i]);
        }
    }
    for (int i = 0; i < mc; i++) res[i] = _mm256_add_ps(acc[i], corr[i]);
}

// one function per format, each with the row-of-x count unrolled for 4, 3, 2 and 1
#define Q_GROUP_FN(F)                                                                                          \
    Q_TGT static void Q_SFX(group_##F)(const Weights *w, int64_t g, const int8_t *xq, const float *xd,         \
                                    const float *xs, int mc, __m256 *res) {                                    \
        switch (mc) {                                                                                          \
            case 4: Q_SFX(group)(w, F, g, xq, xd, xs, 4, res); break;                                          \
            case 3: Q_SFX(group)(w, F, g, xq, xd, xs, 3, res); break;                                          \
            case 2: Q_SFX(group)(w, F, g, xq, xd, xs, 2, res); break;                                          \
            default: Q_SFX(group)(w, F, g, xq, xd, xs, 1, res); break;                                         \
        }                                                                                                      \
    }
Q_GROUP_FN(Q8_0) Q_GROUP_FN(Q4_0) Q_GROUP_FN(Q4_1) Q_GROUP_FN(Q5_0) Q_GROUP_FN(Q5_1)

static GroupFn Q_SFX(group_fn)(int fmt) {
    switch (fmt) {
        case Q8_0: return Q_SFX(group_Q8_0);
        case Q4_0: return Q_SFX(group_Q4_0);
        case Q4_1: return Q_SFX(group_Q4_1);
        case Q5_0: return Q_SFX(group_Q5_0);
        default: return Q_SFX(group_Q5_1);
    }
}

#undef Q_GROUP_FN
#undef Q_TGT
#undef Q_DOTS
#undef Q_SFX
