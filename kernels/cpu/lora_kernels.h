// The LoRA shrink / expand kernels (kernels/cpu/lora.c) over the slots' packed layout, for one storage type of the
// adapters' weights, included once per type with:
//   W_T           the C type of a stored weight (float, or uint16_t for bf16 / fp16)
//   W_NAME(f)     f with the type's suffix
//   W_AT(p, i)    weight i of p as a float (exact: fp16 and bf16 widen exactly)
//   W_LOAD16(p)   16 weights as a __m512 (AVX-512)
//   W_LOAD8(p)    8 weights as a __m256 (AVX2)
// The layout pads every A chunk and B block to 16 elements with zeros, so weights are always loaded whole; x (and
// out) past K (a shard's columns) are masked. x, h and out are fp32 whatever the weights; the arithmetic is the same
// for every type (weights widened on load).
//
// shrink(p, task, A, r, h0, scale): h[t, h0 + j] = scale * sum_k x[t, k] A[j, k] for the task's tokens, j < r
// expand(p, task, B, r, h0, c0, c1): out[t, c] = fma over j < r of h[t, h0 + j] * B[c - c0, j], c in [c0, c1)

// ------------------------------------------------------------------------------------------ scalar

static void W_NAME(shrink_scalar)(const Lora *p, const Task *tk, const W_T *A, int64_t r, int64_t h0, float scale) {
    const int64_t K = p->g->K, KC = p->KC;
    for (int64_t i = 0; i < tk->count; i++) {
        const int64_t t = p->order[tk->first + i];
        const float *x = p->x + t * p->x_s;
        for (int64_t j = 0; j < r; j++) {
            const W_T *a = A + j / 4 * KC * 64 + j % 4 * 16;
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[k] * W_AT(a, k / 16 * 64 + k % 16);
            p->h[t * p->SR + h0 + j] = s * scale;
        }
    }
}

static void W_NAME(expand_scalar)(const Lora *p, const Task *tk, const W_T *B, int64_t r, int64_t h0, int64_t c0,
                                  int64_t c1) {
    const int64_t blocks = (c1 - c0 + 15) / 16;
    for (int64_t i = 0; i < tk->count; i++) {
        const int64_t t = p->order[tk->first + i];
        const float *h = p->h + t * p->SR + h0;
        float *o = p->out + t * p->out_s;
        for (int64_t c = c0; c < c1; c++) {
            const int64_t bk = (c - c0) / 16, gs = min64(GROUP, blocks - bk / GROUP * GROUP);
            const W_T *b = B + bk / GROUP * GROUP * r * 16 + bk % GROUP * 16 + (c - c0) % 16;
            float acc = o[c];
            for (int64_t j = 0; j < r; j++) acc += h[j] * W_AT(b, j * gs * 16);
            o[c] = acc;
        }
    }
}

#ifdef HAVE_X86
// ------------------------------------------------------------------------------------------ AVX-512

// one tile: nt tokens (x[q], h row offsets hrow[q]) x A's 4 rows of the tile at a (nr real); nt a constant in each
// expansion, so only real tokens are multiplied and the accumulators stay registers
AVX512 static inline __attribute__((always_inline)) void W_NAME(shrink_tile_avx512)(
        const Lora *p, const W_T *a, const float *const *x, const int64_t *hrow, const int nt, int nr, float scale) {
    const int64_t K = p->g->K, kv = K / 16;  // kv whole chunks, then a tail of K % 16
    const __mmask16 tail = (__mmask16)((1u << (K % 16)) - 1u);
    __m512 acc[TB][4];
    for (int q = 0; q < nt; q++)
        for (int i = 0; i < 4; i++) acc[q][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < kv; c++) {
        const W_T *ac = a + c * 64;
        for (int l = 0; l < (int)(64 * sizeof(W_T)); l += 64)
            _mm_prefetch((const char *)ac + PREFETCH + l, _MM_HINT_T0);
        __m512 av[4];
        for (int i = 0; i < 4; i++) av[i] = W_LOAD16(ac + i * 16);
        for (int q = 0; q < nt; q++) {
            const __m512 xv = _mm512_loadu_ps(x[q] + c * 16);
            for (int i = 0; i < 4; i++) acc[q][i] = _mm512_fmadd_ps(xv, av[i], acc[q][i]);
        }
    }
    if (tail) {
        __m512 av[4];
        for (int i = 0; i < 4; i++) av[i] = W_LOAD16(a + kv * 64 + i * 16);
        for (int q = 0; q < nt; q++) {
            const __m512 xv = _mm512_maskz_loadu_ps(tail, x[q] + kv * 16);
            for (int i = 0; i < 4; i++) acc[q][i] = _mm512_fmadd_ps(xv, av[i], acc[q][i]);
        }
    }
    for (int q = 0; q < nt; q++)
        for (int i = 0; i < nr; i++) p->h[hrow[q] + i] = _mm512_reduce_add_ps(acc[q][i]) * scale;
}

AVX512 static void W_NAME(shrink_avx512)(const Lora *p, const Task *tk, const W_T *A, int64_t r, int64_t h0,
                                         float scale) {
    for (int64_t j0 = 0; j0 < r; j0 += 4) {
        const W_T *a = A + j0 / 4 * p->KC * 64;
        const int nr = (int)min64(4, r - j0);
        for (int64_t i0 = 0; i0 < tk->count; i0 += TB) {
            const int nt = (int)min64(TB, tk->count - i0);
            const float *x[TB];
            int64_t hrow[TB];
            for (int q = 0; q < nt; q++) {
                const int64_t t = p->order[tk->first + i0 + q];
                x[q] = p->x + t * p->x_s;
                hrow[q] = t * p->SR + h0 + j0;
            }
            switch (nt) {
                case 1: W_NAME(shrink_tile_avx512)(p, a, x, hrow, 1, nr, scale); break;
                case 2: W_NAME(shrink_tile_avx512)(p, a, x, hrow, 2, nr, scale); break;
                case 3: W_NAME(shrink_tile_avx512)(p, a, x, hrow, 3, nr, scale); break;
                default: W_NAME(shrink_tile_avx512)(p, a, x, hrow, 4, nr, scale); break;
            }
        }
    }
}

// nb column blocks of a group of gs (row j of block b at B + (j * gs + b) * 16) into nt tokens' out rows o[q] (at the
// blocks' first column); ``last``: the lanes of the last block that are columns. nt * nb <= 8 independent chains of
// FMAs over the rank, nt and nb constants in each expansion, so the accumulators stay registers.
AVX512 static inline __attribute__((always_inline)) void W_NAME(expand_tile_avx512)(
        const W_T *B, int64_t r, int64_t gs, float *const *o, const float *const *h, const int nt, const int nb,
        __mmask16 last) {
    __m512 acc[4][TB];
    for (int b = 0; b < nb; b++)
        for (int q = 0; q < nt; q++)
            acc[b][q] = _mm512_maskz_loadu_ps(b == nb - 1 ? last : (__mmask16)0xffff, o[q] + b * 16);
    for (int64_t j = 0; j < r; j++) {
        __m512 bv[4];
        for (int b = 0; b < nb; b++) {
            const W_T *bj = B + (j * gs + b) * 16;
            if (!((j * 16 * sizeof(W_T)) & 63)) _mm_prefetch((const char *)bj + PREFETCH, _MM_HINT_T0);
            bv[b] = W_LOAD16(bj);
        }
        for (int q = 0; q < nt; q++) {
            const __m512 hv = _mm512_set1_ps(h[q][j]);
            for (int b = 0; b < nb; b++) acc[b][q] = _mm512_fmadd_ps(hv, bv[b], acc[b][q]);
        }
    }
    for (int b = 0; b < nb; b++)
        for (int q = 0; q < nt; q++)
            _mm512_mask_storeu_ps(o[q] + b * 16, b == nb - 1 ? last : (__mmask16)0xffff, acc[b][q]);
}

AVX512 static void W_NAME(expand_avx512)(const Lora *p, const Task *tk, const W_T *B, int64_t r, int64_t h0,
                                         int64_t c0, int64_t c1) {
    const int64_t blocks = (c1 - c0 + 15) / 16;
    const __mmask16 partial = (c1 - c0) % 16 ? (__mmask16)((1u << ((c1 - c0) % 16)) - 1u) : (__mmask16)0xffff;
    for (int64_t g0 = 0; g0 < blocks; g0 += GROUP) {  // a group of blocks (4 KB at rank 16) over every token tile
        const int64_t gs = min64(GROUP, blocks - g0);
        const W_T *g = B + g0 * r * 16;
        for (int64_t i0 = 0; i0 < tk->count; i0 += TB) {
            float *o[TB];
            const float *h[TB];
            const int nt = tile_rows(p, tk, i0, c0 + g0 * 16, h0, o, h);
            const int64_t sub = nt <= 2 ? gs : 2;  // blocks at a time: about 8 chains of FMAs with the tokens
            for (int64_t b0 = 0; b0 < gs; b0 += sub) {
                const int nb = (int)min64(sub, gs - b0);
                const __mmask16 last = g0 + b0 + nb == blocks ? partial : (__mmask16)0xffff;
                float *ob[TB];
                for (int q = 0; q < nt; q++) ob[q] = o[q] + b0 * 16;
                const W_T *b = g + b0 * 16;
                switch ((nt - 1) * 4 + nb - 1) {  // nb <= 2 once there are more than 2 tokens
                    case 0: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 1, 1, last); break;
                    case 1: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 1, 2, last); break;
                    case 2: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 1, 3, last); break;
                    case 3: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 1, 4, last); break;
                    case 4: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 2, 1, last); break;
                    case 5: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 2, 2, last); break;
                    case 6: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 2, 3, last); break;
                    case 7: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 2, 4, last); break;
                    case 8: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 3, 1, last); break;
                    case 9: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 3, 2, last); break;
                    case 12: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 4, 1, last); break;
                    default: W_NAME(expand_tile_avx512)(b, r, gs, ob, h, 4, 2, last); break;
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------ AVX2

// A's rows j0 + i (i < 2) of the tile at a; tokens x[q] (nt real); a chunk is two 8-wide halves, summed in k order
AVX2 static void W_NAME(shrink_avx2)(const Lora *p, const Task *tk, const W_T *A, int64_t r, int64_t h0,
                                     float scale) {
    const int64_t K = p->g->K, KC = p->KC, kv = K / 16, rest = K % 16;
    const __m256i tail_lo = lanes_avx2(rest), tail_hi = lanes_avx2(rest - 8);
    for (int64_t j0 = 0; j0 < r; j0 += 2) {
        const W_T *a = A + j0 / 4 * KC * 64 + j0 % 4 * 16;  // rows j0, j0 + 1: 16 elements apart in each chunk
        const int nr = (int)min64(2, r - j0);
        for (int64_t i0 = 0; i0 < tk->count; i0 += TB) {
            const int nt = (int)min64(TB, tk->count - i0);
            int64_t tok[TB];
            const float *x[TB];
            for (int q = 0; q < TB; q++) {
                tok[q] = p->order[tk->first + i0 + min64(q, nt - 1)];
                x[q] = p->x + tok[q] * p->x_s;
            }
            __m256 acc[TB][2];
            for (int q = 0; q < TB; q++) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
            for (int64_t c = 0; c < kv; c++) {
                const W_T *ac = a + c * 64;
                const __m256 a0 = W_LOAD8(ac), a0h = W_LOAD8(ac + 8), a1 = W_LOAD8(ac + 16), a1h = W_LOAD8(ac + 24);
                for (int q = 0; q < TB; q++) {
                    const __m256 xl = _mm256_loadu_ps(x[q] + c * 16), xh = _mm256_loadu_ps(x[q] + c * 16 + 8);
                    acc[q][0] = _mm256_fmadd_ps(xh, a0h, _mm256_fmadd_ps(xl, a0, acc[q][0]));
                    acc[q][1] = _mm256_fmadd_ps(xh, a1h, _mm256_fmadd_ps(xl, a1, acc[q][1]));
                }
            }
            if (rest) {
                const W_T *ac = a + kv * 64;
                const __m256 a0 = W_LOAD8(ac), a0h = W_LOAD8(ac + 8), a1 = W_LOAD8(ac + 16), a1h = W_LOAD8(ac + 24);
                for (int q = 0; q < TB; q++) {
                    const __m256 xl = _mm256_maskload_ps(x[q] + kv * 16, tail_lo);
                    acc[q][0] = _mm256_fmadd_ps(xl, a0, acc[q][0]);
                    acc[q][1] = _mm256_fmadd_ps(xl, a1, acc[q][1]);
                    if (rest > 8) {
                        const __m256 xh = _mm256_maskload_ps(x[q] + kv * 16 + 8, tail_hi);
                        acc[q][0] = _mm256_fmadd_ps(xh, a0h, acc[q][0]);
                        acc[q][1] = _mm256_fmadd_ps(xh, a1h, acc[q][1]);
                    }
                }
            }
            for (int q = 0; q < nt; q++)
                for (int i = 0; i < nr; i++) p->h[tok[q] * p->SR + h0 + j0 + i] = hsum_avx2(acc[q][i]) * scale;
        }
    }
}

// one column block (two 8-wide halves) into nt tokens' rows
AVX2 static inline __attribute__((always_inline)) void W_NAME(expand_tile_avx2)(
        const W_T *B, int64_t r, int64_t stride, float *const *o, const float *const *h, const int nt, int64_t cols) {
    const __m256i m_lo = lanes_avx2(cols), m_hi = lanes_avx2(cols - 8);
    __m256 acc[TB][2];
    for (int q = 0; q < nt; q++) {
        acc[q][0] = _mm256_maskload_ps(o[q], m_lo);
        acc[q][1] = _mm256_maskload_ps(o[q] + 8, m_hi);
    }
    for (int64_t j = 0; j < r; j++) {
        const __m256 bl = W_LOAD8(B + j * stride), bh = W_LOAD8(B + j * stride + 8);
        for (int q = 0; q < nt; q++) {
            const __m256 hv = _mm256_set1_ps(h[q][j]);
            acc[q][0] = _mm256_fmadd_ps(hv, bl, acc[q][0]);
            acc[q][1] = _mm256_fmadd_ps(hv, bh, acc[q][1]);
        }
    }
    for (int q = 0; q < nt; q++) {
        _mm256_maskstore_ps(o[q], m_lo, acc[q][0]);
        _mm256_maskstore_ps(o[q] + 8, m_hi, acc[q][1]);
    }
}

AVX2 static void W_NAME(expand_avx2)(const Lora *p, const Task *tk, const W_T *B, int64_t r, int64_t h0, int64_t c0,
                                     int64_t c1) {
    const int64_t blocks = (c1 - c0 + 15) / 16;
    for (int64_t c = c0; c < c1; c += 16) {
        const int64_t bk = (c - c0) / 16, stride = min64(GROUP, blocks - bk / GROUP * GROUP) * 16;
        const W_T *b = B + bk / GROUP * GROUP * r * 16 + bk % GROUP * 16;
        const int64_t cols = min64(16, c1 - c);
        for (int64_t i0 = 0; i0 < tk->count; i0 += TB) {
            float *o[TB];
            const float *h[TB];
            const int nt = tile_rows(p, tk, i0, c, h0, o, h);
            switch (nt) {
                case 1: W_NAME(expand_tile_avx2)(b, r, stride, o, h, 1, cols); break;
                case 2: W_NAME(expand_tile_avx2)(b, r, stride, o, h, 2, cols); break;
                case 3: W_NAME(expand_tile_avx2)(b, r, stride, o, h, 3, cols); break;
                default: W_NAME(expand_tile_avx2)(b, r, stride, o, h, 4, cols); break;
            }
        }
    }
}
#endif

// ------------------------------------------------------------------------------------------ tasks

typedef void (*W_NAME(ShrinkFn))(const Lora *, const Task *, const W_T *, int64_t, int64_t, float);
typedef void (*W_NAME(ExpandFn))(const Lora *, const Task *, const W_T *, int64_t, int64_t, int64_t, int64_t);

// each task: its slot's shards in order, the shrink then the expand of each (its h rows are the task's own)
static void W_NAME(run_task)(const Lora *p, const Task *tk, W_NAME(ShrinkFn) shrink, W_NAME(ExpandFn) expand) {
    const LoraGeom *g = p->g;
    const W_T *w = (const W_T *)p->w + tk->slot * g->slot_len;
    const float scale = p->scaling[tk->slot];
    for (int64_t sh = 0; sh < g->S; sh++) {
        const int64_t r = p->ranks[tk->slot * g->S + sh], c0 = g->cols[sh], c1 = g->cols[sh + 1];
        if (r) {
            shrink(p, tk, w, r, sh * g->R, scale);
            expand(p, tk, w + a_elems(r, p->KC), r, sh * g->R, c0, c1);
        }
        w += a_elems(r, p->KC) + b_elems(r, c1 - c0);
    }
}

// the tasks split into one contiguous run per thread of about equal cost (``cost``: the running sum, n + 1 of it):
// a static split (a dynamic schedule's bookkeeping measured ~3 us a call more, 2026-11-29), each thread streaming
// one stretch of the slots' memory
static void W_NAME(run_tasks)(const Lora *p, const Task *tasks, const double *cost, int64_t n, int v, int parallel,
                              int num_threads) {
#ifdef HAVE_X86
    const W_NAME(ShrinkFn) shrink = v == 2   ? W_NAME(shrink_avx512)
                                    : v == 1 ? W_NAME(shrink_avx2)
                                             : W_NAME(shrink_scalar);
    const W_NAME(ExpandFn) expand = v == 2   ? W_NAME(expand_avx512)
                                    : v == 1 ? W_NAME(expand_avx2)
                                             : W_NAME(expand_scalar);
#else
    (void)v;
    const W_NAME(ShrinkFn) shrink = W_NAME(shrink_scalar);
    const W_NAME(ExpandFn) expand = W_NAME(expand_scalar);
#endif
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t i = 0;
        while (i < n && cost[i] < cost[n] * (double)me / (double)team) i++;
        for (; i < n && (me == team - 1 || cost[i] < cost[n] * (double)(me + 1) / (double)team); i++)
            W_NAME(run_task)(p, &tasks[i], shrink, expand);
    }
}
