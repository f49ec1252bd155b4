/* Every decoder layer of a decode step, in C: one call per step for all L layers, for the one or two decode
 * tokens of a batch-1 or batch-2 step.
 *
 * Why it exists: at batch 1 a decode step of SmolLM2-135M runs some 540 small torch ops per token (norms,
 * RoPE, dtype casts, residual adds, views), each a few microseconds of dispatch, around 120 matmuls that
 * are the real work. On a 2-core CPU that dispatch was about half of the step. Here the same ops run as
 * plain loops over a few hundred floats, and the heavy parts are the kernels the Python path already
 * calls, reached through function pointers (so each stays in its own file and library):
 *
 *     for each layer:   h = rmsnorm(x) * w_in                 (a loop)
 *                       qkv = h @ W_qkv^T (+ b)               gemv (kernels/gemv) or quant matmul (kernels/quant_matmul)
 *                       q, k = rope(q), rope(k)               (a loop, cos/sin given per token)
 *                       pools[slot] = k, v                    (a copy)
 *                       a = attention(q, the pools)           paged decode (kernels/paged_attention)
 *                       x = x + a @ W_o^T (+ b)               gemv / quant matmul
 *                       h = rmsnorm(x) * w_post
 *                       g, u = h @ W_gate_up^T                gemv / quant matmul
 *                       x = x + (silu(g) * u) @ W_down^T      gemv / quant matmul
 *
 * It is the same arithmetic as engine/model.py's DecoderLayer with the engine's fused projections, in the
 * same order. In a bf16 model torch rounds every op's result to bf16; so do we (`act`), at the same points,
 * so the C layers and the Python ones agree up to the order of float additions inside a sum.
 *
 * Contract (checked in Python, kernels/decoder_layers/cpu_native.py and engine/native_layers.py): x fp32 [M, E]
 * (bf16 values in a bf16 model), updated in place; cos, sin fp32 [M, D]; slots int64 [M]; block tables int32
 * [M, table_stride]; seq_lens int32 [M], the new token included; pools [NB, BS, Hkv, D] fp32 or bf16 (as the
 * model); every linear's K equal to what it is given. Returns 0, 1 when scratch memory could not be
 * allocated, 2 when a kernel it calls fails.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LINEAR_F32 = 0, LINEAR_BF16 = 1, LINEAR_INT4 = 4, LINEAR_INT8 = 8 };

/* The kernels this file calls: the same C functions the Python path calls through ctypes. */
typedef void (*gemv_fn)(int bf16, const float *x, int64_t M, int64_t K, const void *w, const float *bias,
                        int64_t N, float *y);
typedef int (*quant_fn)(int bits, const float *x, int64_t M, int64_t K, const void *qweight, const float *scales,
                        const float *zeros, int64_t scale_row_stride, int64_t G, int64_t N, float *y);
typedef int (*attend_fn)(int kind, const float *q, const void *k_pool, const void *v_pool, const float *k_scale,
                         const float *v_scale, const int32_t *block_tables, int64_t table_stride,
                         const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                         int64_t window, float scale, float *out);

typedef struct {           /* one linear layer: y [M, n] = x [M, k] @ W^T (+ bias) */
    int64_t kind, n, k;    /* kind: LINEAR_* */
    const void *weight;    /* float [n, k] (fp32 or bf16), or the quantized bytes (kernels/quant_matmul) */
    const float *bias;     /* fp32 [n] or NULL */
    const float *scales, *zeros;           /* quantized only: [n, k / G] (zeros: int4 only, else NULL) */
    int64_t scale_row_stride, group_size;  /* quantized only */
} linear_t;

typedef struct {
    const void *input_norm, *post_norm;  /* RMSNorm weights [E], in the model's dtype */
    linear_t qkv, o, gate_up, down;      /* q/k/v stacked [(H + 2 Hkv) D, E]; gate/up stacked [2F, E] */
    void *k_pool, *v_pool;               /* this layer's [NB, BS, Hkv, D] */
} layer_t;

typedef struct {
    int64_t E, H, Hkv, D, F, BS, window;  /* window 0: none */
    double eps, scale;                    /* RMSNorm's epsilon, attention's 1 / sqrt(D) */
    int64_t bf16;                         /* activations, norm weights and pools in bf16 (else fp32) */
    gemv_fn gemv;
    quant_fn quant;
    attend_fn attend;
} model_t;

/* ---- bf16 as torch computes it: each op in fp32, its result rounded to the nearest bf16 (ties to even) ---- */

static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float act(const model_t *m, float v) { return m->bf16 ? round_bf16(v) : v; }

static inline float param(const model_t *m, const void *w, int64_t i) {  /* a norm weight, widened to fp32 */
    if (!m->bf16) return ((const float *)w)[i];
    uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- the small ops, one token row at a time -------------------------------------------------------- */

/* out = w * (x / rms(x)), engine/model.py RMSNorm: the mean of squares in fp32, the normalized x rounded to
 * the model's dtype, then the product with the weight rounded again. */
static void rmsnorm(const model_t *m, const float *x, const void *w, float *out) {
    double ss = 0.0;
    for (int64_t i = 0; i < m->E; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / (double)m->E) + (float)m->eps);
    for (int64_t i = 0; i < m->E; i++) out[i] = act(m, param(m, w, i) * act(m, x[i] * r));
}

/* Rotate each head's pairs (i, i + D/2) in place: x*cos + rotate_half(x)*sin, three rounded ops as torch does. */
static void rope(const model_t *m, float *x, int64_t heads, const float *cos, const float *sin) {
    int64_t D = m->D, half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * D, rotated[D];
        for (int64_t i = 0; i < half; i++) rotated[i] = -v[i + half], rotated[i + half] = v[i];
        for (int64_t i = 0; i < D; i++) v[i] = act(m, act(m, v[i] * cos[i]) + act(m, rotated[i] * sin[i]));
    }
}

/* Write one token's K or V rows ([Hkv * D] floats) into its slot of a pool, in the pool's dtype. */
static void store(const model_t *m, void *pool, int64_t slot, const float *src) {
    int64_t n = m->Hkv * m->D;
    if (!m->bf16) {
        memcpy((float *)pool + slot * n, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)pool + slot * n;
    for (int64_t i = 0; i < n; i++) {  /* the values are bf16 already (rounded by rope / the projection) */
        uint32_t u;
        memcpy(&u, &src[i], sizeof u);
        dst[i] = (uint16_t)(u >> 16);
    }
}

/* y [M, n] = x [M, k] @ W^T (+ bias), rounded to the model's dtype. Returns 0, or 2 if the kernel failed. */
static int linear(const model_t *m, const linear_t *lin, const float *x, int64_t M, float *y) {
    if (lin->kind == LINEAR_F32 || lin->kind == LINEAR_BF16) {
        m->gemv(lin->kind == LINEAR_BF16, x, M, lin->k, lin->weight, lin->bias, lin->n, y);
    } else {
        if (m->quant((int)lin->kind, x, M, lin->k, lin->weight, lin->scales, lin->zeros, lin->scale_row_stride,
                     lin->group_size, lin->n, y))
            return 2;
        if (lin->bias)  /* the Python path adds the bias after the kernel, in fp32 */
            for (int64_t r = 0; r < M; r++)
                for (int64_t j = 0; j < lin->n; j++) y[r * lin->n + j] += lin->bias[j];
    }
    if (m->bf16)
        for (int64_t i = 0; i < M * lin->n; i++) y[i] = round_bf16(y[i]);
    return 0;
}

/* ---- one layer -------------------------------------------------------------------------------------- */

typedef struct { float *h, *qkv, *q, *att, *proj, *gu, *mlp; } scratch_t;

static int layer_forward(const model_t *m, const layer_t *ly, int64_t M, float *x, const float *cos,
                         const float *sin, const int64_t *slots, const int32_t *tables, int64_t table_stride,
                         const int32_t *seq_lens, scratch_t *s) {
    int64_t E = m->E, H = m->H, Hkv = m->Hkv, D = m->D, F = m->F, qkv_n = (H + 2 * Hkv) * D;
    for (int64_t r = 0; r < M; r++) rmsnorm(m, x + r * E, ly->input_norm, s->h + r * E);
    if (linear(m, &ly->qkv, s->h, M, s->qkv)) return 2;
    for (int64_t r = 0; r < M; r++) {  /* qkv row: q [H, D] | k [Hkv, D] | v [Hkv, D] */
        float *q = s->qkv + r * qkv_n, *k = q + H * D, *v = k + Hkv * D;
        rope(m, q, H, cos + r * D, sin + r * D);
        rope(m, k, Hkv, cos + r * D, sin + r * D);
        memcpy(s->q + r * H * D, q, (size_t)(H * D) * sizeof(float));  /* the attention kernel's [M, H, D] */
        store(m, ly->k_pool, slots[r], k);
        store(m, ly->v_pool, slots[r], v);
    }
    if (m->attend((int)m->bf16, s->q, ly->k_pool, ly->v_pool, NULL, NULL, tables, table_stride, seq_lens, M, H,
                  Hkv, D, m->BS, m->window, (float)m->scale, s->att))
        return 1;
    if (m->bf16)
        for (int64_t i = 0; i < M * H * D; i++) s->att[i] = round_bf16(s->att[i]);
    if (linear(m, &ly->o, s->att, M, s->proj)) return 2;
    for (int64_t i = 0; i < M * E; i++) x[i] = act(m, x[i] + s->proj[i]);
    for (int64_t r = 0; r < M; r++) rmsnorm(m, x + r * E, ly->post_norm, s->h + r * E);
    if (linear(m, &ly->gate_up, s->h, M, s->gu)) return 2;
    for (int64_t r = 0; r < M; r++) {  /* gu row: gate [F] | up [F] */
        const float *g = s->gu + r * 2 * F, *u = g + F;
        for (int64_t j = 0; j < F; j++) s->mlp[r * F + j] = act(m, act(m, g[j] / (1.0f + expf(-g[j]))) * u[j]);
    }
    if (linear(m, &ly->down, s->mlp, M, s->proj)) return 2;
    for (int64_t i = 0; i < M * E; i++) x[i] = act(m, x[i] + s->proj[i]);
    return 0;
}

int servelab_decoder_layers(const model_t *m, const layer_t *layers, int64_t L, int64_t M, float *x,
                            const float *cos, const float *sin, const int64_t *slots, const int32_t *tables,
                            int64_t table_stride, const int32_t *seq_lens) {
    int64_t E = m->E, qkv_n = (m->H + 2 * m->Hkv) * m->D, hd = m->H * m->D, F = m->F;
    float *buf = malloc(sizeof(float) * (size_t)(M * (2 * E + qkv_n + 2 * hd + 3 * F)));
    if (buf == NULL) return 1;
    /* h [M, E] | qkv [M, qkv_n] | q [M, H D] | att [M, H D] | proj [M, E] | gu [M, 2F] | mlp [M, F] */
    float *h = buf, *qkv = h + M * E, *q = qkv + M * qkv_n, *att = q + M * hd, *proj = att + M * hd;
    float *gu = proj + M * E, *mlp = gu + M * 2 * F;
    scratch_t s = {h, qkv, q, att, proj, gu, mlp};
    int status = 0;
    for (int64_t l = 0; l < L && status == 0; l++)
        status = layer_forward(m, &layers[l], M, x, cos, sin, slots, tables, table_stride, seq_lens, &s);
    free(buf);
    return status;
}
