// The LoRA shrink / expand kernels (kernels/cpu/lora.c) for one storage type of the adapters' weights, included
// once per type with:
//   W_T           the C type of a stored weight (float, or uint16_t for bf16 / fp16)
//   W_NAME(f)     f with the type's suffix
//   W_AT(p, i)    weight i of p as a float (exact: fp16 and bf16 widen exactly)
//   W_LOAD16(p), W_LOAD16Z(m, p)   16 weights as a __m512 (AVX-512; masked: lanes off are 0)
//   W_LOAD8(p), W_LOAD8N(p, n)     8 weights as a __m256 (AVX2; n of them, the rest 0)
// x, h and out are fp32 whatever the weights; the arithmetic is the same for every type (weights widened on load).

// ------------------------------------------------------------------------------------------ scalar

static void W_NAME(shrink_scalar)(const Lora *p, const Item *it) {
    const W_T *A = (const W_T *)p->a + it->slot * p->SR * p->K;
    const float scale = p->scaling[it->slot];
    for (int64_t i = 0; i < it->count; i++) {
        const int64_t t = p->order[it->first + i];
        const float *x = p->x + t * p->x_s;
        for (int64_t j = it->lo; j < it->hi; j++) {
            const W_T *a = A + j * p->K;
            float s = 0.0f;
            for (int64_t k = 0; k < p->K; k++) s += x[k] * W_AT(a, k);
            p->h[t * p->SR + j] = s * scale;
        }
    }
}

static void W_NAME(expand_scalar)(const Lora *p, const Item *it) {
    const int64_t j0 = it->shard * p->R;
    const W_T *B = (const W_T *)p->bt + (it->slot * p->SR + j0) * p->N;
    for (int64_t i = 0; i < it->count; i++) {
        const int64_t t = p->order[it->first + i];
        const float *h = p->h + t * p->SR + j0;
        float *o = p->out + t * p->out_s;
        for (int64_t c = it->lo; c < it->hi; c++) {
            float acc = o[c];
            for (int64_t r = 0; r < p->R; r++) acc += h[r] * W_AT(B, r * p->N + c);
            o[c] = acc;
        }
    }
}

#ifdef HAVE_X86
// ------------------------------------------------------------------------------------------ AVX-512

AVX512 static void W_NAME(shrink_avx512)(const Lora *p, const Item *it) {
    const int64_t K = p->K, kv = K / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (K - kv)) - 1u);
    const W_T *A = (const W_T *)p->a + it->slot * p->SR * K;
    const float scale = p->scaling[it->slot];
    for (int64_t i0 = 0; i0 < it->count; i0 += TB) {
        TILE_TOKENS(p, it, i0, tok);
        const float *x[TB];
        for (int q = 0; q < TB; q++) x[q] = p->x + tok[q] * p->x_s;
        const int nt = (int)min64(TB, it->count - i0);
        for (int64_t j0 = it->lo; j0 < it->hi; j0 += 4) {
            const int nr = (int)min64(4, it->hi - j0);
            const W_T *a[4];
            for (int r = 0; r < 4; r++) a[r] = A + (j0 + min64(r, nr - 1)) * K;
            __m512 acc[TB][4];
            for (int q = 0; q < TB; q++)
                for (int r = 0; r < 4; r++) acc[q][r] = _mm512_setzero_ps();
            const W_T *next = A + min64(j0 + 4, p->SR - 1) * K;  // the next tile's rows, fetched meanwhile
            for (int64_t k = 0; k < kv; k += 16) {
                __m512 av[4];
                if (!(k * sizeof(W_T) & 63))  // a line of each
                    for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(next + r * K + k), _MM_HINT_T0);
                for (int r = 0; r < 4; r++) av[r] = W_LOAD16(a[r] + k);
                for (int q = 0; q < TB; q++) {
                    const __m512 xv = _mm512_loadu_ps(x[q] + k);
                    for (int r = 0; r < 4; r++) acc[q][r] = _mm512_fmadd_ps(xv, av[r], acc[q][r]);
                }
            }
            if (tail) {
                __m512 av[4];
                for (int r = 0; r < 4; r++) av[r] = W_LOAD16Z(tail, a[r] + kv);
                for (int q = 0; q < TB; q++) {
                    const __m512 xv = _mm512_maskz_loadu_ps(tail, x[q] + kv);
                    for (int r = 0; r < 4; r++) acc[q][r] = _mm512_fmadd_ps(xv, av[r], acc[q][r]);
                }
            }
            for (int q = 0; q < nt; q++)
                for (int r = 0; r < nr; r++) p->h[tok[q] * p->SR + j0 + r] = _mm512_reduce_add_ps(acc[q][r]) * scale;
        }
    }
}

// out[t, c] = fma(h[t, r], b[r, c], out[t, c]) in r order over the item's columns, out's rows in L1; nt (1 .. TB)
// a constant in each expansion, so the tokens' registers stay registers
AVX512 static inline __attribute__((always_inline)) void W_NAME(expand_rows_avx512)(
        const Lora *p, const Item *it, const W_T *B, int64_t j0, int64_t i0, const int nt) {
    const int64_t N = p->N, cv = it->lo + (it->hi - it->lo) / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (it->hi - cv)) - 1u);
    float *o[TB];
    const float *h[TB];
    for (int q = 0; q < nt; q++) {
        const int64_t t = p->order[it->first + i0 + q];
        o[q] = p->out + t * p->out_s;
        h[q] = p->h + t * p->SR + j0;
    }
    int64_t r = 0;
    for (; r + 4 <= p->R; r += 4) {  // four B rows a pass: 4 streams read at once, out loaded and stored once
        const W_T *b = B + r * N;
        __m512 hv[TB][4];
        for (int q = 0; q < nt; q++)
            for (int i = 0; i < 4; i++) hv[q][i] = _mm512_set1_ps(h[q][r + i]);
        const int fetch = r + 8 <= p->R;  // the next pass's 4 rows, fetched meanwhile
        for (int64_t c = it->lo; c < cv; c += 16) {
            __m512 bv[4];
            if (fetch && !(c * sizeof(W_T) & 63))
                for (int i = 4; i < 8; i++) _mm_prefetch((const char *)(b + i * N + c), _MM_HINT_T0);
            for (int i = 0; i < 4; i++) bv[i] = W_LOAD16(b + i * N + c);
            for (int q = 0; q < nt; q++) {
                __m512 acc = _mm512_loadu_ps(o[q] + c);
                for (int i = 0; i < 4; i++) acc = _mm512_fmadd_ps(hv[q][i], bv[i], acc);
                _mm512_storeu_ps(o[q] + c, acc);
            }
        }
        if (tail) {
            __m512 bv[4];
            for (int i = 0; i < 4; i++) bv[i] = W_LOAD16Z(tail, b + i * N + cv);
            for (int q = 0; q < nt; q++) {
                __m512 acc = _mm512_maskz_loadu_ps(tail, o[q] + cv);
                for (int i = 0; i < 4; i++) acc = _mm512_fmadd_ps(hv[q][i], bv[i], acc);
                _mm512_mask_storeu_ps(o[q] + cv, tail, acc);
            }
        }
    }
    for (; r < p->R; r++) {  // the rows past a multiple of 4, one at a time (the same order of FMAs)
        const W_T *b = B + r * N;
        __m512 hv[TB];
        for (int q = 0; q < nt; q++) hv[q] = _mm512_set1_ps(h[q][r]);
        for (int64_t c = it->lo; c < cv; c += 16) {
            const __m512 bv = W_LOAD16(b + c);
            for (int q = 0; q < nt; q++)
                _mm512_storeu_ps(o[q] + c, _mm512_fmadd_ps(hv[q], bv, _mm512_loadu_ps(o[q] + c)));
        }
        if (tail) {
            const __m512 bv = W_LOAD16Z(tail, b + cv);
            for (int q = 0; q < nt; q++)
                _mm512_mask_storeu_ps(o[q] + cv, tail,
                                      _mm512_fmadd_ps(hv[q], bv, _mm512_maskz_loadu_ps(tail, o[q] + cv)));
        }
    }
}

AVX512 static void W_NAME(expand_avx512)(const Lora *p, const Item *it) {
    const int64_t j0 = it->shard * p->R;
    const W_T *B = (const W_T *)p->bt + (it->slot * p->SR + j0) * p->N;
    for (int64_t i0 = 0; i0 < it->count; i0 += TB) {
        switch (min64(TB, it->count - i0)) {
            case 1: W_NAME(expand_rows_avx512)(p, it, B, j0, i0, 1); break;
            case 2: W_NAME(expand_rows_avx512)(p, it, B, j0, i0, 2); break;
            case 3: W_NAME(expand_rows_avx512)(p, it, B, j0, i0, 3); break;
            default: W_NAME(expand_rows_avx512)(p, it, B, j0, i0, 4); break;
        }
    }
}

// ------------------------------------------------------------------------------------------ AVX2

AVX2 static void W_NAME(shrink_avx2)(const Lora *p, const Item *it) {
    const int64_t K = p->K, kv = K / 8 * 8;
    const __m256i tail = lanes_avx2(K - kv);
    const W_T *A = (const W_T *)p->a + it->slot * p->SR * K;
    const float scale = p->scaling[it->slot];
    for (int64_t i0 = 0; i0 < it->count; i0 += TB) {
        TILE_TOKENS(p, it, i0, tok);
        const float *x[TB];
        for (int q = 0; q < TB; q++) x[q] = p->x + tok[q] * p->x_s;
        const int nt = (int)min64(TB, it->count - i0);
        for (int64_t j0 = it->lo; j0 < it->hi; j0 += 2) {
            const int nr = (int)min64(2, it->hi - j0);
            const W_T *a[2] = {A + j0 * K, A + (j0 + nr - 1) * K};
            __m256 acc[TB][2];
            for (int q = 0; q < TB; q++) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
            const W_T *next = A + min64(j0 + 2, p->SR - 1) * K;  // the next tile's rows, fetched meanwhile
            for (int64_t k = 0; k < kv; k += 8) {
                if (!(k * sizeof(W_T) & 63)) {  // a line of each
                    _mm_prefetch((const char *)(next + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(next + K + k), _MM_HINT_T0);
                }
                const __m256 a0 = W_LOAD8(a[0] + k), a1 = W_LOAD8(a[1] + k);
                for (int q = 0; q < TB; q++) {
                    const __m256 xv = _mm256_loadu_ps(x[q] + k);
                    acc[q][0] = _mm256_fmadd_ps(xv, a0, acc[q][0]);
                    acc[q][1] = _mm256_fmadd_ps(xv, a1, acc[q][1]);
                }
            }
            if (kv < K) {
                const __m256 a0 = W_LOAD8N(a[0] + kv, K - kv), a1 = W_LOAD8N(a[1] + kv, K - kv);
                for (int q = 0; q < TB; q++) {
                    const __m256 xv = _mm256_maskload_ps(x[q] + kv, tail);
                    acc[q][0] = _mm256_fmadd_ps(xv, a0, acc[q][0]);
                    acc[q][1] = _mm256_fmadd_ps(xv, a1, acc[q][1]);
                }
            }
            for (int q = 0; q < nt; q++)
                for (int r = 0; r < nr; r++) p->h[tok[q] * p->SR + j0 + r] = hsum_avx2(acc[q][r]) * scale;
        }
    }
}

// expand_rows_avx512's loops, 8 columns a vector
AVX2 static inline __attribute__((always_inline)) void W_NAME(expand_rows_avx2)(
        const Lora *p, const Item *it, const W_T *B, int64_t j0, int64_t i0, const int nt) {
    const int64_t N = p->N, cv = it->lo + (it->hi - it->lo) / 8 * 8;
    float *o[TB];
    const float *h[TB];
    for (int q = 0; q < nt; q++) {
        const int64_t t = p->order[it->first + i0 + q];
        o[q] = p->out + t * p->out_s;
        h[q] = p->h + t * p->SR + j0;
    }
    const __m256i tail = lanes_avx2(it->hi - cv);
    int64_t r = 0;
    for (; r + 4 <= p->R; r += 4) {
        const W_T *b = B + r * N;
        __m256 hv[TB][4];
        for (int q = 0; q < nt; q++)
            for (int i = 0; i < 4; i++) hv[q][i] = _mm256_set1_ps(h[q][r + i]);
        for (int64_t c = it->lo; c < cv; c += 8) {
            __m256 bv[4];
            for (int i = 0; i < 4; i++) bv[i] = W_LOAD8(b + i * N + c);
            for (int q = 0; q < nt; q++) {
                __m256 acc = _mm256_loadu_ps(o[q] + c);
                for (int i = 0; i < 4; i++) acc = _mm256_fmadd_ps(hv[q][i], bv[i], acc);
                _mm256_storeu_ps(o[q] + c, acc);
            }
        }
        if (cv < it->hi) {
            __m256 bv[4];
            for (int i = 0; i < 4; i++) bv[i] = W_LOAD8N(b + i * N + cv, it->hi - cv);
            for (int q = 0; q < nt; q++) {
                __m256 acc = _mm256_maskload_ps(o[q] + cv, tail);
                for (int i = 0; i < 4; i++) acc = _mm256_fmadd_ps(hv[q][i], bv[i], acc);
                _mm256_maskstore_ps(o[q] + cv, tail, acc);
            }
        }
    }
    for (; r < p->R; r++) {
        const W_T *b = B + r * N;
        __m256 hv[TB];
        for (int q = 0; q < nt; q++) hv[q] = _mm256_set1_ps(h[q][r]);
        for (int64_t c = it->lo; c < cv; c += 8) {
            const __m256 bv = W_LOAD8(b + c);
            for (int q = 0; q < nt; q++)
                _mm256_storeu_ps(o[q] + c, _mm256_fmadd_ps(hv[q], bv, _mm256_loadu_ps(o[q] + c)));
        }
        if (cv < it->hi) {
            const __m256 bv = W_LOAD8N(b + cv, it->hi - cv);
            for (int q = 0; q < nt; q++)
                _mm256_maskstore_ps(o[q] + cv, tail, _mm256_fmadd_ps(hv[q], bv, _mm256_maskload_ps(o[q] + cv, tail)));
        }
    }
}

AVX2 static void W_NAME(expand_avx2)(const Lora *p, const Item *it) {
    const int64_t j0 = it->shard * p->R;
    const W_T *B = (const W_T *)p->bt + (it->slot * p->SR + j0) * p->N;
    for (int64_t i0 = 0; i0 < it->count; i0 += TB) {
        switch (min64(TB, it->count - i0)) {
            case 1: W_NAME(expand_rows_avx2)(p, it, B, j0, i0, 1); break;
            case 2: W_NAME(expand_rows_avx2)(p, it, B, j0, i0, 2); break;
            case 3: W_NAME(expand_rows_avx2)(p, it, B, j0, i0, 3); break;
            default: W_NAME(expand_rows_avx2)(p, it, B, j0, i0, 4); break;
        }
    }
}
#endif
