// The 32-weight formats' fp32-activation kernel per group of 8 rows (kernels/cpu/quant_planes.c's top), included by
// quant_planes.c once per instruction set with Q_TGT (the target attribute), Q_DOTS (the integer dot step of
// quant_32.h: dots_avx2, dots_vnni) and Q_SFX (the names' suffix) defined; no pragma once: each inclusion is another
// instance.

// res[i] (lane r) = row 8g + r . x_i for mc rows of x given as digit planes (see prepare_planes); inlined with
// constant fmt and mc
Q_TGT static inline __attribute__((always_inline)) void Q_SFX(planes_group)(const Weights *w, const int fmt, int64_t g,
                                                                            const Planes *xp, int64_t i0, const int mc,
                                                                            __m256 *res) {
    const int64_t nb = w->nb, cols = nb * 32;
    const int off = w->offset;
    __m256 acc[MT], corr[MT];
    for (int i = 0; i < mc; i++) acc[i] = corr[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i v[8], s[PLANES][MT];
        expand_avx2(fmt, w->qs + (g * nb + b) * 8 * w->qb, w->qh ? w->qh + (g * nb + b) * 8 : NULL, v);
        for (int p = 0; p < PLANES; p++) Q_DOTS(fmt, v, xp->digits + (p * xp->M + i0) * cols + b * 32, cols, mc, s[p]);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->d + (g * nb + b) * 8)));
        for (int i = 0; i < mc; i++) {
            const int64_t ib = (i0 + i) * nb + b;
            __m256i t[PLANES];
            for (int p = 0; p < PLANES; p++)
                t[p] = off ? _mm256_sub_epi32(s[p][i], _mm256_set1_epi32(off * xp->dsum[p * xp->M * nb + ib])) : s[p][i];
            // t0 + 255 * t1 in int32 (exact), then + 65025 * t2 in one rounding
            __m256i u = _mm256_add_epi32(t[0], _mm256_sub_epi32(_mm256_slli_epi32(t[1], 8), t[1]));
            __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[2]), _mm256_set1_ps(65025.0f), _mm256_cvtepi32_ps(u));
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(f, d), _mm256_broadcast_ss(xp->xd + ib), acc[i]);
        }
        if (fmt == Q4_1 || fmt == Q5_1) {
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->m + (g * nb + b) * 8)));
            for (int i = 0; i < mc; i++)
                corr[i] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xp->xs + (i0 + i) * nb + b), corr[i]);
        }
    }
    for (int i = 0; i < mc; i++) res[i] = _mm256_add_ps(acc[i], corr[i]);
}

// one function per format, each with the row-of-x count unrolled for 4, 3, 2 and 1
#define Q_PLANES_FN(F)                                                                                        \
    Q_TGT static void Q_SFX(planes_##F)(const Weights *w, int64_t g, const Planes *xp, int64_t i0, int mc,    \
                                        __m256 *res) {                                                        \
        switch (mc) {                                                                                         \
            case 4: Q_SFX(planes_group)(w, F, g, xp, i0, 4, res); break;                                      \
            case 3: Q_SFX(planes_group)(w, F, g, xp, i0, 3, res); break;                                      \
            case 2: Q_SFX(planes_group)(w, F, g, xp, i0, 2, res); break;                                      \
            default: Q_SFX(planes_group)(w, F, g, xp, i0, 1, res); break;                                     \
        }                                                                                                     \
    }
Q_PLANES_FN(Q8_0) Q_PLANES_FN(Q4_0) Q_PLANES_FN(Q4_1) Q_PLANES_FN(Q5_0) Q_PLANES_FN(Q5_1)

static PlanesFn Q_SFX(planes_fn)(int fmt) {
    switch (fmt) {
        case Q8_0: return Q_SFX(planes_Q8_0);
        case Q4_0: return Q_SFX(planes_Q4_0);
        case Q4_1: return Q_SFX(planes_Q4_1);
        case Q5_0: return Q_SFX(planes_Q5_0);
        default: return Q_SFX(planes_Q5_1);
    }
}

#undef Q_PLANES_FN
#undef Q_TGT
#undef Q_DOTS
#undef Q_SFX
