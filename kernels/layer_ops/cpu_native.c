/* The small operations of a decoder layer, each fused into one pass over memory, for the CPU: RMSNorm, SiLU
 * times up, and RoPE, over many token rows at once (a prefill chunk, a batched decode step).
 *
 * Why it exists: written in PyTorch (engine/model.py) each of these is several ops, and each op reads and
 * writes a whole [T, E] or [T, F] tensor; in bf16 most of them also widen their input to fp32 and round their
 * result back. RMSNorm alone is a cast, a square, a mean, an rsqrt, a multiply, a cast and a multiply: seven
 * passes over memory where one does the job. In a 1,024-token bf16 prefill of SmolLM2-135M the elementwise ops
 * took about a third of the time beside the matmuls. vLLM's CPU backend has the same ops as custom kernels
 * (rms_norm, silu_and_mul, rotary_embedding); these are ours. Rows are shared among threads with OpenMP.
 *
 * Same arithmetic as the PyTorch ops, in the same order: fp32 inside, and in a bf16 model each intermediate
 * that torch rounds to bf16 is rounded here too (round to nearest even), so the results equal torch's up to
 * the order of the additions in RMSNorm's mean of squares.
 *
 * Tensors are [rows, width] with a row stride (in elements), in fp32 or bf16 (`bf16` = 1) as the model is;
 * cos and sin are fp32 [rows, D]. Checked in Python (kernels/layer_ops/cpu_native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../cpu_vectors.h"  /* widen_bf16, to_bf16, value_at, exp_clamped, the vector layer */

static inline float rounded(int bf16, float f) { return bf16 ? widen_bf16(to_bf16(f)) : f; }

static inline void put(int bf16, void *p, int64_t i, float v) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(v);
    else ((float *)p)[i] = v;
}

/* The row functions below take `bf16` as a compile-time constant (they are inlined into an if/else), so that
 * the compiler builds one vectorized loop per dtype instead of testing the dtype per element. */

static inline __attribute__((always_inline)) void rms_norm_row(int bf16, const void *x, const void *w, void *out,
                                                                int64_t E, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < E; i++) {
        float v = value_at(bf16, x, i);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(ss / (float)E + eps);
#pragma omp simd
    for (int64_t i = 0; i < E; i++) put(bf16, out, i, value_at(bf16, w, i) * rounded(bf16, value_at(bf16, x, i) * r));
}

/* out[t] = w * (x[t] / rms(x[t])), engine/model.py RMSNorm: x / rms rounded to the model's dtype, then the
 * product with the weight rounded again. x, out: [T, E] (row strides x_stride, E); w: [E]. */
void servelab_rms_norm(int bf16, const void *x, int64_t x_stride, const void *w, void *out, int64_t T, int64_t E,
                       float eps) {
    size_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *xt = (const char *)x + t * x_stride * size;
        char *ot = (char *)out + t * E * size;
        if (bf16) rms_norm_row(1, xt, w, ot, E, eps);
        else rms_norm_row(0, xt, w, ot, E, eps);
    }
}

#ifdef LANES
static inline __attribute__((always_inline)) vec load_vec(int bf16, const void *p, int64_t j) {
    return bf16 ? vload_bf16((const uint16_t *)p + j) : vload((const float *)p + j);
}
#endif

/* Written with the vector layer where there is one: GCC's own vectorization of this loop had left the bf16 model's
 * SiLU at ~7 cycles an element (Sapphire Rapids), 2x the time of the fp32 one. */
static inline __attribute__((always_inline)) void silu_mul_row(int bf16, const void *gate, const void *up, void *out,
                                                                int64_t F) {
    int64_t j = 0;
#ifdef LANES
    vec one = vset1(1.0f), zero = vzero();
    for (; j + LANES <= F; j += LANES) {
        vec g = load_vec(bf16, gate, j), u = load_vec(bf16, up, j);
        vec s = vdiv(g, vadd(one, vexp(vsub(zero, g))));
        if (bf16) vstore_bf16((uint16_t *)out + j, vround_bf16(vmul(vround_bf16(s), u)));
        else vstore((float *)out + j, vmul(s, u));
    }
#endif
    for (; j < F; j++) {
        float g = value_at(bf16, gate, j);
        put(bf16, out, j, rounded(bf16, g / (1.0f + exp_clamped(-g))) * value_at(bf16, up, j));
    }
}

/* out[t, j] = silu(gate[t, j]) * up[t, j] with gu[t] = [gate (F) | up (F)], the stacked gate/up projection's
 * output: silu rounded, then the product rounded (two torch ops). gu: [T, 2F]; out: [T, F]. */
void servelab_silu_mul(int bf16, const void *gu, void *out, int64_t T, int64_t F) {
    size_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *gate = (const char *)gu + t * 2 * F * size, *up = gate + F * size;
        char *ot = (char *)out + t * F * size;
        if (bf16) silu_mul_row(1, gate, up, ot, F);
        else silu_mul_row(0, gate, up, ot, F);
    }
}

static inline __attribute__((always_inline)) void rope_head(int bf16, void *x, const float *c, const float *s,
                                                             int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float x1 = value_at(bf16, x, i), x2 = value_at(bf16, x, half + i);
        float lo = rounded(bf16, x1 * c[i]) + rounded(bf16, -x2 * s[i]);
        float hi = rounded(bf16, x2 * c[half + i]) + rounded(bf16, x1 * s[half + i]);
        put(bf16, x, i, lo);
        put(bf16, x, half + i, hi);
    }
}

/* In place: each of `heads` heads of D values in row t (row stride x_stride, heads side by side) rotated by
 * its position's angles, x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]: two products and a
 * sum, each rounded. cos, sin: fp32 [T, D]. */
void servelab_rope(int bf16, void *x, int64_t x_stride, const float *cos, const float *sin, int64_t T,
                   int64_t heads, int64_t D) {
    size_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < heads; h++) {
            char *head = (char *)x + (t * x_stride + h * D) * size;
            if (bf16) rope_head(1, head, cos + t * D, sin + t * D, D / 2);
            else rope_head(0, head, cos + t * D, sin + t * D, D / 2);
        }
    }
}

/* ---- the sampler's greedy pick: the argmax of each row of logits ---------------------------------------------
 * torch's argmax over a [64, 49,152] batch of logits took ~4 ms on 2 cores (its amax alone: 0.4 ms): a decode
 * step's greedy pick cost as much as a layer. Here, two passes: the row's max (a vectorized reduction), then the
 * first position that holds it, found a chunk at a time (a vectorized "is it in here?", then a plain look inside
 * the one chunk that has it). torch's rules: the first of equal maxima; a NaN counts as the largest value. */
#define ARGMAX_CHUNK 64

static inline int64_t first_index_of(int bf16, const void *row, int64_t V, float m, int nan) {
    for (int64_t c = 0; c < V; c += ARGMAX_CHUNK) {
        int64_t end = c + ARGMAX_CHUNK < V ? c + ARGMAX_CHUNK : V;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t v = c; v < end; v++) {
            float x = value_at(bf16, row, v);
            hit |= nan ? x != x : x == m;
        }
        if (!hit) continue;
        for (int64_t v = c; v < end; v++) {
            float x = value_at(bf16, row, v);
            if (nan ? x != x : x == m) return v;
        }
    }
    return 0;  /* not reached: m is in the row */
}

static inline int64_t argmax_row(int bf16, const void *row, int64_t V) {
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t v = 0; v < V; v++) {
        float x = value_at(bf16, row, v);
        m = x > m ? x : m;
        nan |= x != x;
    }
    return first_index_of(bf16, row, V, m, nan);
}

/* out[r] = argmax of row r of x [R, V] (row stride x_stride elements). */
void servelab_argmax_rows(int bf16, const void *x, int64_t x_stride, int64_t R, int64_t V, int64_t *out) {
    size_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        const char *row = (const char *)x + r * x_stride * size;
        out[r] = bf16 ? argmax_row(1, row, V) : argmax_row(0, row, V);
    }
}
