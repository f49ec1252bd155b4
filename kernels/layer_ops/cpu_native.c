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

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest, ties to even (torch's rounding) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float rounded(int bf16, float f) { return bf16 ? from_bf16(to_bf16(f)) : f; }

static inline float load(int bf16, const void *p, int64_t i) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(int bf16, void *p, int64_t i, float v) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(v);
    else ((float *)p)[i] = v;
}

/* out[t] = w * (x[t] / rms(x[t])), engine/model.py RMSNorm: x / rms rounded to the model's dtype, then the
 * product with the weight rounded again. x, out: [T, E] (row strides x_stride, E); w: [E]. */
void servelab_rms_norm(int bf16, const void *x, int64_t x_stride, const void *w, void *out, int64_t T, int64_t E,
                       float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < E; i++) {
            float v = load(bf16, x, t * x_stride + i);
            ss += v * v;
        }
        float r = 1.0f / sqrtf(ss / (float)E + eps);
#pragma omp simd
        for (int64_t i = 0; i < E; i++)
            put(bf16, out, t * E + i, load(bf16, w, i) * rounded(bf16, load(bf16, x, t * x_stride + i) * r));
    }
}

/* out[t, j] = silu(gate[t, j]) * up[t, j] with gu[t] = [gate (F) | up (F)], the stacked gate/up projection's
 * output: silu rounded, then the product rounded (two torch ops). gu: [T, 2F]; out: [T, F]. */
void servelab_silu_mul(int bf16, const void *gu, void *out, int64_t T, int64_t F) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < F; j++) {
            float g = load(bf16, gu, t * 2 * F + j), u = load(bf16, gu, t * 2 * F + F + j);
            put(bf16, out, t * F + j, rounded(bf16, g / (1.0f + expf(-g))) * u);
        }
    }
}

/* In place: each of `heads` heads of D values in row t (row stride x_stride, heads side by side) rotated by
 * its position's angles, x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]: two products and a
 * sum, each rounded. cos, sin: fp32 [T, D]. */
void servelab_rope(int bf16, void *x, int64_t x_stride, const float *cos, const float *sin, int64_t T,
                   int64_t heads, int64_t D) {
    int64_t half = D / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            int64_t base = t * x_stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                float x1 = load(bf16, x, base + i), x2 = load(bf16, x, base + half + i);
                float lo = rounded(bf16, x1 * c[i]) + rounded(bf16, -x2 * s[i]);
                float hi = rounded(bf16, x2 * c[half + i]) + rounded(bf16, x1 * s[half + i]);
                put(bf16, x, base + i, lo);
                put(bf16, x, base + half + i, hi);
            }
        }
    }
}
