// duet's fused per-token ops for the CPU path (fp32), called from kernels/cpu_native.py through ctypes.
//
// Each replaces several torch ops (and their temporaries) with one pass over the rows, threads over rows:
// the token table's rows for the step's ids (a float table: kernels/cpu_quant.py looks up packed ones), RMSNorm with
// the residual add before it, rotary embedding applied in place to the q and k heads of the fused
// qkv projection's output, and SwiGLU (silu(gate) * up). The arithmetic is the Llama reference's (transformers'),
// step for step in fp32; only summation order (the mean of squares) and exp's last bit can differ.
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define VEC_LANES VL
#define VEC_F vf
#define VEC_I vi
#define VEC_NAME(f) v##f
#include "vexp.h"

// h = x (+ residual, written back to residual); out = weight * (h / sqrt(mean(h^2) + eps)), row by row.
void duet_rms_norm_f32(const float *x, int64_t x_s, float *residual, int64_t r_s, const float *weight, float *out,
                       int64_t o_s, int64_t rows, int n, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_s;
        float *orow = out + r * o_s;
        const float *h = xr;
        if (residual) {
            float *res = residual + r * r_s;
#pragma omp simd
            for (int i = 0; i < n; i++) res[i] += xr[i];
            h = res;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++) ss += h[i] * h[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int i = 0; i < n; i++) orow[i] = weight[i] * (h[i] * inv);
    }
}

// In place, for every token t: the first rotary_dim dims of each of the first num_heads head_dim-wide heads of
// row t of x (row stride x_s) are rotated by position positions[t], half = rotary_dim / 2: x[i] = x[i] cos[i] -
// x[i + half] sin[i], x[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half] (rotate-half RoPE; cos/sin
// tables [max_positions, rotary_dim]); dims rotary_dim.. head_dim - 1 are not touched (partial rotary, Phi-4-mini).
void duet_rotary_f32(float *x, int64_t x_s, int64_t rows, int num_heads, int head_dim, int rotary_dim,
                     const int64_t *positions, const float *cos_table, const float *sin_table, int num_threads) {
    int half = rotary_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_table + positions[t] * rotary_dim, *s = sin_table + positions[t] * rotary_dim;
        for (int h = 0; h < num_heads; h++) {
            float *a = x + t * x_s + (int64_t)h * head_dim, *b = a + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float lo = a[i], hi = b[i];
                a[i] = lo * c[i] + (-hi) * s[i];
                b[i] = hi * c[i + half] + lo * s[i + half];
            }
        }
    }
}

// out[t, i] = silu(x[t, i]) * x[t, n + i] for i < n (x rows hold gate then up, as the fused projection writes);
// silu(g) = g / (1 + exp(-g)).
void duet_silu_mul_f32(const float *x, int64_t x_s, float *out, int64_t o_s, int64_t rows, int n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = x + t * x_s, *u = g + n;
        float *o = out + t * o_s;
        int i = 0;
        for (; i + VL <= n; i += VL) {
            vf gv = *(const vf *)(g + i), uv = *(const vf *)(u + i);
            *(vf *)(o + i) = gv / (1.0f + vexp(-gv)) * uv;
        }
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

// out[t] = table[ids[t]] (cols floats per row; table row stride t_s): the embedding lookup of a float token table.
// Returns 0, or 1 (nothing written) when an id is outside [0, vocab): checked here, so a replayed step
// (kernels/cpu_graph.py) never reads outside the table.
int duet_embedding_f32(const float *table, int64_t t_s, int64_t vocab, const int64_t *ids, int64_t rows, int64_t cols,
                       float *out, int64_t o_s, int num_threads) {
    for (int64_t t = 0; t < rows; t++)
        if (ids[t] < 0 || ids[t] >= vocab) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= 65536)
    for (int64_t t = 0; t < rows; t++) memcpy(out + t * o_s, table + ids[t] * t_s, sizeof(float) * (size_t)cols);
    return 0;
}
