// The k-quants' int8-activation GEMV, written once in quant_k_vec.h's words; kernels/cpu/quant_k_int8.c includes it
// once per instruction set (after defining K_ISA and including quant_k_vec.h).
//
// x comes quantized per 256 (xq int8, scale dx) with its sums per 16 (bs). A pass covers KR rows of a group
// against mc rows of x. Per 8-byte chunk of the 8 rows' quants (one load): the quants as unsigned bytes (nibbles
// masked, Q5_K / Q6_K high bits or-ed in), one KV_DOT per sub-block half against the chunk's 8 bytes of x
// broadcast, so int32 lane (row, t) sums 4 products of row `row` (exact integers). Per pair of sub-blocks the
// (row, t) lanes are folded to [a's rows | b's rows], converted (exact: |sum| < 2^24) and scaled:
//   Q4_K / Q5_K: acc_b += sum(q * xq) * (d * sc) - (dmin * mn) * sum(xq)          per sub-block of 32
//   Q6_K:        acc_b += (sum(q * xq) - 32 * sum(xq)) * (d * sc)                 per group of 16 (q unsigned)
//   then acc += acc_b * dx per super-block.

#define K_I8_Q45 KSFX(k45_i8)
#define K_I8_Q6 KSFX(k6_i8)

KTGT static inline __attribute__((always_inline)) void K_I8_Q45(const int fmt, const uint8_t *g0, int64_t nb,
                                                                 const int h, const int8_t *xq, int64_t xq_s,
                                                                 const float *dx, const int32_t *bs, const int mc,
                                                                 float *res) {
    const int64_t bb8 = 8 * k_block_bytes(fmt), off = h * KR * 8;
    const int qs_at = k_qs_at(fmt);
    const kvi m4 = KV_SET1_8(0x0F), one = KV_SET1_8(1);
    kvf acc[KMT];
    for (int i = 0; i < mc; i++) acc[i] = KV_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g0 + b * bb8;
        for (int64_t o = h * KR * 8; o < bb8; o += 64)  // the next group-block (as quant_k_planes.c, measured there)
            _mm_prefetch((const char *)(gb + bb8 + o), _MM_HINT_T0);
        float D[64], M[64];
        KV_SCALES(fmt, gb, D, M);
        kvf accb[KMT];
        for (int i = 0; i < mc; i++) accb[i] = KV_ZERO();
        for (int k = 0; k < 4; k++) {  // the 32-byte run k of each row: sub-blocks 2k (low nibbles), 2k + 1 (high)
            kvi ilo[KMT], ihi[KMT];
            for (int i = 0; i < mc; i++) ilo[i] = ihi[i] = KV_ZEROI();
            for (int c = 0; c < 4; c++) {
                const kvi v = KV_LOADI(gb + qs_at + (4 * k + c) * 64 + off);
                kvi lo = KV_AND(v, m4), hi = KV_AND(KV_SRLI16(v, 4), m4);
                if (fmt == Q5_K) {
                    const kvi qh = KV_SRLI16(KV_LOADI(gb + 128 + c * 64 + off), 2 * k);
                    lo = KV_OR(lo, KV_SLLI16(KV_AND(qh, one), 4));
                    hi = KV_OR(hi, KV_SLLI16(KV_AND(KV_SRLI16(qh, 1), one), 4));
                }
                const int8_t *xb = xq + b * QK + 64 * k + 8 * c;
                for (int i = 0; i < mc; i++) {
                    ilo[i] = KV_DOT(ilo[i], lo, KV_BCAST8(xb + i * xq_s));
                    ihi[i] = KV_DOT(ihi[i], hi, KV_BCAST8(xb + i * xq_s + 32));
                }
            }
            const kvf dk = KV_LOAD_PAIR(D + 16 * k, D + 16 * k + 8, h);
            const kvf mk = KV_LOAD_PAIR(M + 16 * k, M + 16 * k + 8, h);
            for (int i = 0; i < mc; i++) {
                const int32_t *s16 = bs + i * (xq_s / 16) + b * 16 + 4 * k;  // sums of xq per 16
                const kvf xsum = KV_BLEND_HI(KV_SET1((float)(s16[0] + s16[1])), KV_SET1((float)(s16[2] + s16[3])));
                accb[i] = KV_FMA(KV_CVT(KV_PAIRS_I(ilo[i], ihi[i])), dk, accb[i]);
                accb[i] = KV_FNMA(mk, xsum, accb[i]);
            }
        }
        for (int i = 0; i < mc; i++) acc[i] = KV_FMA(accb[i], KV_SET1(dx[i * (xq_s / QK) + b]), acc[i]);
    }
    for (int i = 0; i < mc; i++) KV_STORE_ROWS(acc[i], res + i * KR);
}

KTGT static inline __attribute__((always_inline)) void K_I8_Q6(const uint8_t *g0, int64_t nb, const int h,
                                                                const int8_t *xq, int64_t xq_s, const float *dx,
                                                                const int32_t *bs, const int mc, float *res) {
    const int64_t off = h * KR * 8;
    const kvi m4 = KV_SET1_8(0x0F), m30 = KV_SET1_8(0x30);
    kvf acc[KMT];
    for (int i = 0; i < mc; i++) acc[i] = KV_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g0 + b * 1680;
        for (int64_t o = h * KR * 8; o < 1680; o += 64) _mm_prefetch((const char *)(gb + 1680 + o), _MM_HINT_T0);
        float D[128];
        KV_SCALES(Q6_K, gb, D, NULL);
        kvf accb[KMT];
        for (int i = 0; i < mc; i++) accb[i] = KV_ZERO();
        for (int hh = 0; hh < 2; hh++)
            for (int cp = 0; cp < 2; cp++) {  // qh chunks 2cp, 2cp + 1: groups 8hh + 2s + cp (as quant_k_f32.h)
                kvi I[KMT][4];
                for (int i = 0; i < mc; i++) I[i][0] = I[i][1] = I[i][2] = I[i][3] = KV_ZEROI();
                for (int cc = 2 * cp; cc < 2 * cp + 2; cc++) {
                    const kvi qh = KV_LOADI(gb + 1024 + (4 * hh + cc) * 64 + off);
                    const kvi a = KV_LOADI(gb + (8 * hh + cc) * 64 + off);
                    const kvi b4 = KV_LOADI(gb + (8 * hh + cc + 4) * 64 + off);
                    const kvi q[4] = {KV_OR(KV_AND(a, m4), KV_AND(KV_SLLI16(qh, 4), m30)),
                                      KV_OR(KV_AND(b4, m4), KV_AND(KV_SLLI16(qh, 2), m30)),
                                      KV_OR(KV_AND(KV_SRLI16(a, 4), m4), KV_AND(qh, m30)),
                                      KV_OR(KV_AND(KV_SRLI16(b4, 4), m4), KV_AND(KV_SRLI16(qh, 2), m30))};
                    for (int s = 0; s < 4; s++) {
                        const int8_t *xb = xq + b * QK + 128 * hh + 32 * s + 8 * cc;
                        for (int i = 0; i < mc; i++) I[i][s] = KV_DOT(I[i][s], q[s], KV_BCAST8(xb + i * xq_s));
                    }
                }
                for (int sp = 0; sp < 2; sp++) {  // s = 2sp, 2sp + 1: groups g and g + 2
                    const int g = 8 * hh + 4 * sp + cp;
                    const kvf dk = KV_LOAD_PAIR(D + 8 * g, D + 8 * (g + 2), h);
                    for (int i = 0; i < mc; i++) {
                        const int32_t *s16 = bs + i * (xq_s / 16) + b * 16;
                        const kvi corr = KV_BLEND_HI_I(KV_SET1_32(32 * s16[g]), KV_SET1_32(32 * s16[g + 2]));
                        const kvi t = KV_SUBI(KV_PAIRS_I(I[i][2 * sp], I[i][2 * sp + 1]), corr);
                        accb[i] = KV_FMA(KV_CVT(t), dk, accb[i]);
                    }
                }
            }
        for (int i = 0; i < mc; i++) acc[i] = KV_FMA(accb[i], KV_SET1(dx[i * (xq_s / QK) + b]), acc[i]);
    }
    for (int i = 0; i < mc; i++) KV_STORE_ROWS(acc[i], res + i * KR);
}

// res[i][r] = row 8g + r . x_i for the group at g0 and mc (<= KMT) rows of x (xq [mc, xq_s], dx [mc, xq_s / 256],
// bs [mc, xq_s / 16])
KTGT static void KSFX(k_i8_group)(int fmt, const uint8_t *g0, int64_t nb, const int8_t *xq, int64_t xq_s,
                                  const float *dx, const int32_t *bs, int mc, float res[][8]) {
    for (int h = 0; h < 8 / KR; h++) {
        float r[KMT * KR];
#define K_I8_CASE(MC)                                                  \
    case MC:                                                           \
        if (fmt == Q6_K)                                               \
            K_I8_Q6(g0, nb, h, xq, xq_s, dx, bs, MC, r);               \
        else if (fmt == Q5_K)                                          \
            K_I8_Q45(Q5_K, g0, nb, h, xq, xq_s, dx, bs, MC, r);        \
        else                                                           \
            K_I8_Q45(Q4_K, g0, nb, h, xq, xq_s, dx, bs, MC, r);        \
        break;
        switch (mc) {
#if KMT == 4
            K_I8_CASE(4)
            K_I8_CASE(3)
#endif
            K_I8_CASE(2)
            default:
                K_I8_CASE(1)
        }
#undef K_I8_CASE
        for (int i = 0; i < mc; i++)
            for (int j = 0; j < KR; j++) res[i][h * KR + j] = r[i * KR + j];
    }
}
#undef K_I8_Q45
#undef K_I8_Q6
