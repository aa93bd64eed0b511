// The k-quants' fp32-activation GEMV, written once in quant_k_vec.h's words; kernels/cpu/quant_k.c includes it
// once per instruction set (after defining K_ISA and including quant_k_vec.h).
//
// A pass covers KR rows of a group (pass h: rows h * KR ..) against mc rows of x. Per 8-byte chunk of the 8 rows'
// quants (one load), per pair p of neighbouring weights: one shuffle puts weight 2p + t of each row into int32
// lane (row, t), shifted left by 16 (Q4_K, Q5_K: unsigned; a Q4_K high nibble masked in place: by 20) or 24
// (Q6_K: q - 32, signed); one conversion makes it a float (exact); one FMA per row of x against (x_j, x_j+1)
// broadcast. So a sub-block's sum(x * q) (times the exact power of 2) builds in the (row, t) lanes; two of them
// are folded into [sub-block a's rows | sub-block b's rows] and the power of 2 and the scale d * sc applied:
//   acc += sum_j(x_j * q_j) * (d * sc)  - (dmin * mn) * sum_j(x_j)     (Q6_K: sum_j(x_j * (q_j - 32)) * (d * sc))
// the reference's products d * sc * q (exact) summed in another order, the min term once per sub-block.

#define K_F32_Q45 KSFX(k45_f32)
#define K_F32_Q6 KSFX(k6_f32)

KTGT static inline __attribute__((always_inline)) void K_F32_Q45(const int fmt, const uint8_t *g0, int64_t nb,
                                                                  const int h, const float *x, int64_t x_s,
                                                                  const float *xs, int64_t xs_s, const int mc,
                                                                  float *res) {
    const int64_t bb8 = 8 * k_block_bytes(fmt), off = h * KR * 8;
    const int qs_at = k_qs_at(fmt);
    const kvi m4 = KV_SET1_8(0x0F), m4h = KV_SET1_8(0xF0), one = KV_SET1_8(1);
    kvi sh[4];
    for (int p = 0; p < 4; p++) sh[p] = KV_BCAST128I(k_shuffle(p, 2));
    // lanes [sub-block 2k | 2k + 1]: the low nibbles came as q * 2^16, Q4_K's high nibbles as q * 2^20
    const kvf unscale = KV_BLEND_HI(KV_SET1(0x1p-16f), KV_SET1(fmt == Q4_K ? 0x1p-20f : 0x1p-16f));
    kvf acc[KMT];
    for (int i = 0; i < mc; i++) acc[i] = KV_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g0 + b * bb8;
        float D[64], M[64];
        KV_SCALES(fmt, gb, D, M);
        for (int k = 0; k < 4; k++) {  // the 32-byte run k of each row: sub-blocks 2k (low nibbles), 2k + 1 (high)
            kvf slo[KMT][2], shi[KMT][2];
            for (int i = 0; i < mc; i++) slo[i][0] = slo[i][1] = shi[i][0] = shi[i][1] = KV_ZERO();
            for (int c = 0; c < 4; c++) {
                const kvi v = KV_LOADI(gb + qs_at + (4 * k + c) * 64 + off);
                kvi lo, hi;
                if (fmt == Q5_K) {  // the 5th bits: bit 2k (low) and 2k + 1 (high) of the qh byte of the same weight
                    const kvi qh = KV_SRLI16(KV_LOADI(gb + 128 + c * 64 + off), 2 * k);
                    lo = KV_OR(KV_AND(v, m4), KV_SLLI16(KV_AND(qh, one), 4));
                    hi = KV_OR(KV_AND(KV_SRLI16(v, 4), m4), KV_SLLI16(KV_AND(KV_SRLI16(qh, 1), one), 4));
                } else {
                    lo = KV_AND(v, m4);
                    hi = KV_AND(v, m4h);
                }
                for (int p = 0; p < 4; p++) {
                    const kvf ql = KV_CVT(KV_SHUF(lo, sh[p])), qh = KV_CVT(KV_SHUF(hi, sh[p]));
                    const float *xb = x + b * QK + 64 * k + 8 * c + 2 * p;
                    const int s = mc == 1 ? p & 1 : 0;  // two chains at M = 1
                    for (int i = 0; i < mc; i++) {
                        slo[i][s] = KV_FMA(ql, KV_BCAST2(xb + i * x_s), slo[i][s]);
                        shi[i][s] = KV_FMA(qh, KV_BCAST2(xb + i * x_s + 32), shi[i][s]);
                    }
                }
            }
            const kvf dk = KV_MUL(KV_LOAD_PAIR(D + 16 * k, D + 16 * k + 8, h), unscale);
            const kvf mk = KV_LOAD_PAIR(M + 16 * k, M + 16 * k + 8, h);
            for (int i = 0; i < mc; i++) {
                const kvf t = mc == 1 ? KV_PAIRS(KV_ADD(slo[i][0], slo[i][1]), KV_ADD(shi[i][0], shi[i][1]))
                                     : KV_PAIRS(slo[i][0], shi[i][0]);
                const float *xk = xs + i * xs_s + b * 8 + 2 * k;
                acc[i] = KV_FMA(t, dk, acc[i]);
                acc[i] = KV_FNMA(mk, KV_BLEND_HI(KV_SET1(xk[0]), KV_SET1(xk[1])), acc[i]);
            }
        }
    }
    for (int i = 0; i < mc; i++) KV_STORE_ROWS(acc[i], res + i * KR);
}

KTGT static inline __attribute__((always_inline)) void K_F32_Q6(const uint8_t *g0, int64_t nb, const int h,
                                                                 const float *x, int64_t x_s, const int mc,
                                                                 float *res) {
    const int64_t off = h * KR * 8;
    const kvi m4 = KV_SET1_8(0x0F), m30 = KV_SET1_8(0x30), o32 = KV_SET1_8(32);
    kvi sh[4];
    for (int p = 0; p < 4; p++) sh[p] = KV_BCAST128I(k_shuffle(p, 3));
    const kvf unscale = KV_SET1(0x1p-24f);
    kvf acc[KMT];
    for (int i = 0; i < mc; i++) acc[i] = KV_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g0 + b * 1680;
        float D[128];
        KV_SCALES(Q6_K, gb, D, NULL);
        for (int hh = 0; hh < 2; hh++)  // 128-weight halves
            for (int cp = 0; cp < 2; cp++) {  // qh chunks 2cp, 2cp + 1: groups 8hh + 2s + cp of 16 weights
                kvf S[KMT][4];
                for (int i = 0; i < mc; i++) S[i][0] = S[i][1] = S[i][2] = S[i][3] = KV_ZERO();
                for (int cc = 2 * cp; cc < 2 * cp + 2; cc++) {
                    // weights 128hh + 32s + 8cc + t: ql chunk 8hh + cc (s 0 low, 2 high nibbles) or + 4 (s 1, 3),
                    // qh chunk 4hh + cc bits 2s, 2s + 1
                    const kvi qh = KV_LOADI(gb + 1024 + (4 * hh + cc) * 64 + off);
                    const kvi a = KV_LOADI(gb + (8 * hh + cc) * 64 + off);
                    const kvi b4 = KV_LOADI(gb + (8 * hh + cc + 4) * 64 + off);
                    kvi q[4] = {KV_OR(KV_AND(a, m4), KV_AND(KV_SLLI16(qh, 4), m30)),
                                KV_OR(KV_AND(b4, m4), KV_AND(KV_SLLI16(qh, 2), m30)),
                                KV_OR(KV_AND(KV_SRLI16(a, 4), m4), KV_AND(qh, m30)),
                                KV_OR(KV_AND(KV_SRLI16(b4, 4), m4), KV_AND(KV_SRLI16(qh, 2), m30))};
                    for (int s = 0; s < 4; s++) {
                        q[s] = KV_SUB8(q[s], o32);
                        for (int p = 0; p < 4; p++) {
                            const kvf qv = KV_CVT(KV_SHUF(q[s], sh[p]));
                            const float *xb = x + b * QK + 128 * hh + 32 * s + 8 * cc + 2 * p;
                            for (int i = 0; i < mc; i++) S[i][s] = KV_FMA(qv, KV_BCAST2(xb + i * x_s), S[i][s]);
                        }
                    }
                }
                for (int sp = 0; sp < 2; sp++) {  // s = 2sp, 2sp + 1: groups g and g + 2
                    const int g = 8 * hh + 4 * sp + cp;
                    const kvf dk = KV_MUL(KV_LOAD_PAIR(D + 8 * g, D + 8 * (g + 2), h), unscale);
                    for (int i = 0; i < mc; i++) acc[i] = KV_FMA(KV_PAIRS(S[i][2 * sp], S[i][2 * sp + 1]), dk, acc[i]);
                }
            }
    }
    for (int i = 0; i < mc; i++) KV_STORE_ROWS(acc[i], res + i * KR);
}

// res[i][r] = row 8g + r . x_i for the group at g0 and mc (<= KMT) rows of x
KTGT static void KSFX(k_f32_group)(int fmt, const uint8_t *g0, int64_t nb, const float *x, int64_t x_s,
                                   const float *xs, int64_t xs_s, int mc, float res[][8]) {
    for (int h = 0; h < 8 / KR; h++) {
        float r[KMT * KR];
#define K_F32_CASE(MC)                                                         \
    case MC:                                                                   \
        if (fmt == Q6_K)                                                       \
            K_F32_Q6(g0, nb, h, x, x_s, MC, r);                                \
        else if (fmt == Q5_K)                                                  \
            K_F32_Q45(Q5_K, g0, nb, h, x, x_s, xs, xs_s, MC, r);               \
        else                                                                   \
            K_F32_Q45(Q4_K, g0, nb, h, x, x_s, xs, xs_s, MC, r);               \
        break;
        switch (mc) {
#if KMT == 4
            K_F32_CASE(4)
            K_F32_CASE(3)
#endif
            K_F32_CASE(2)
            default:
                K_F32_CASE(1)
        }
#undef K_F32_CASE
        for (int i = 0; i < mc; i++)
            for (int j = 0; j < KR; j++) res[i][h * KR + j] = r[i * KR + j];
    }
}
#undef K_F32_Q45
#undef K_F32_Q6
