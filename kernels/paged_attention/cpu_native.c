/* Paged decode attention for the CPU, in C: every sequence's one new query against its cached past, read
 * straight out of the paged pools by following the block table.
 *
 * Why it exists: the "sdpa" backend (sdpa.py) first COPIES each sequence's K and V out of the pool into a
 * padded [B, L, Hkv, D] tensor (index_select), zeroes the padding, then calls torch's fused attention with
 * a mask. At decode time, with one query per sequence, those copies and the call's fixed costs were most of
 * the attention's time (SmolLM2-135M, one sequence of ~300 tokens, one thread: ~160 us a layer, 30 layers).
 * Here nothing is copied: for each (sequence, KV head) we walk the table
 *
 *     position p  ->  block = table[p / BS], slot = p % BS  ->  K row at k_pool[block, slot, kv_head, :]
 *
 * and compute, for the g = H / Hkv query heads that share this KV head (GQA: each K and V row is read once
 * for all g of them),
 *
 *     s[i, p] = scale * q_i . k_p           for p in first .. len - 1   (first > 0 only with a sliding window)
 *     w[i, p] = exp(s[i, p] - max_p s[i, p]) / sum_p exp(...)
 *     out_i   = sum_p w[i, p] * v_p
 *
 * in fp32, the reference's arithmetic (reference.py), so the result equals it up to the order of the float
 * additions. Pools hold fp32, bf16 (widened to fp32 on the fly: a bf16 is the top half of an fp32) or int8
 * with one fp32 scale per token and head (x = q * scale). The (sequence, KV head) pairs are shared between
 * threads with OpenMP (torch's own runtime, as in kernels/quant_matmul/cpu_native.c).
 *
 * Contract (checked in Python before the call, kernels/paged_attention/reference.py check_paged_inputs):
 * q and out fp32 [B, H, D] contiguous; pools [NB, BS, Hkv, D] contiguous; scales fp32 [NB, BS, Hkv] or NULL;
 * block_tables int32 [B, table_stride]; seq_lens int32 [B] in 1..capacity; every table entry read inside
 * the pool. Returns 0, or 1 when scratch memory could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2 };

#define PREFETCH_TOKENS 8  /* tokens ahead: a few rows of [Hkv, D] ahead of the one being read */
#define EXP_MIN_ARG (-87.0f)  /* e^-87 ~ 1.6e-38, still a normal float; a softmax weight below it is 0 anyway */

/* e^x for x <= 0 (a softmax's x - max), written so that the compiler can vectorize a loop of it: libm's
 * expf is one call per value, and with ~1,000 scores per head it was most of the kernel's time. Cephes'
 * method: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, 2^n put into the exponent bits.
 * Relative error about 1e-7, fp32's own rounding. */
static inline float exp_nonpositive(float x) {
    x = fmaxf(x, EXP_MIN_ARG);
    float n = rintf(x * 1.44269504088896341f);  /* x / ln2, to the nearest integer */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* x - n ln2, ln2 split in two for precision */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n as a float: n >= -126 here, a normal number */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* A token's K or V rows of all Hkv heads, [Hkv * D] contiguous in the pool, as fp32 (int8: times their
 * scales). fp32 pools are read in place; the others are widened into `row`. */
static inline const float *load_token(int kind, const void *pool, const float *scales, int64_t slot, int64_t Hkv,
                                      int64_t D, float *row) {
    int64_t n = Hkv * D;
    if (kind == KV_F32) return (const float *)pool + slot * n;
    if (kind == KV_BF16) {
        const uint16_t *src = (const uint16_t *)pool + slot * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) {
            uint32_t bits = (uint32_t)src[j] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            row[j] = f;
        }
        return row;
    }
    const int8_t *src = (const int8_t *)pool + slot * n;
    const float *s = scales + slot * Hkv;
    for (int64_t h = 0; h < Hkv; h++) {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) row[h * D + d] = (float)src[h * D + d] * s[h];
    }
    return row;
}

/* The slot of position p, and a prefetch of the token PREFETCH_TOKENS ahead (the next block is anywhere). */
static inline int64_t slot_of(const int32_t *table, int64_t p, int64_t BS) {
    return (int64_t)table[p / BS] * BS + p % BS;
}

/* All H query heads of one sequence. Position by position, a token's K (then V) rows of every KV head lie
 * side by side in the pool ([Hkv, D]), and the tokens of a block follow each other: we read them in that
 * order, so the memory is streamed, not hopped through. scores: scratch [H, L]; acc: scratch [H, D] + [Hkv, D]. */
static void attend_sequence(int kind, const float *q, const void *k_pool, const void *v_pool, const float *k_scale,
                            const float *v_scale, const int32_t *table, int64_t first, int64_t len, int64_t H,
                            int64_t Hkv, int64_t D, int64_t BS, float scale, float *scores, float *acc,
                            float *out) {
    int64_t L = len - first, g = H / Hkv, row_bytes = Hkv * D * (kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1);
    float *row = acc + H * D;
    for (int64_t p = first; p < len; p++) {  /* pass 1: the scores; query head i reads KV head i / g */
        if (p + PREFETCH_TOKENS < len)
            __builtin_prefetch((const char *)k_pool + slot_of(table, p + PREFETCH_TOKENS, BS) * row_bytes);
        const float *k = load_token(kind, k_pool, k_scale, slot_of(table, p, BS), Hkv, D, row);
        for (int64_t i = 0; i < H; i++) {
            const float *qi = q + i * D, *kh = k + (i / g) * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++) s += qi[d] * kh[d];
            scores[i * L + (p - first)] = s * scale;
        }
    }
    for (int64_t i = 0; i < H; i++) {  /* the softmax of each head's row, in place */
        float *si = scores + i * L, m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < L; j++) m = fmaxf(m, si[j]);
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; j++) { si[j] = exp_nonpositive(si[j] - m); sum += si[j]; }
        float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t j = 0; j < L; j++) si[j] *= inv;
    }
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t p = first; p < len; p++) {  /* pass 2: the weighted sum of V */
        if (p + PREFETCH_TOKENS < len)
            __builtin_prefetch((const char *)v_pool + slot_of(table, p + PREFETCH_TOKENS, BS) * row_bytes);
        const float *v = load_token(kind, v_pool, v_scale, slot_of(table, p, BS), Hkv, D, row);
        for (int64_t i = 0; i < H; i++) {
            const float *vh = v + (i / g) * D;
            float w = scores[i * L + (p - first)], *ai = acc + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ai[d] += w * vh[d];
        }
    }
    memcpy(out, acc, (size_t)(H * D) * sizeof(float));
}

int servelab_paged_decode(int kind, const float *q, const void *k_pool, const void *v_pool, const float *k_scale,
                          const float *v_scale, const int32_t *block_tables, int64_t table_stride,
                          const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                          int64_t window, float scale, float *out) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;
#pragma omp parallel if (B > 1)
    {
        float *scores = malloc((size_t)(H * max_len) * sizeof(float));
        float *acc = malloc((size_t)((H + Hkv) * D) * sizeof(float));
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {  /* the same answer in every thread after the barrier: all or none enter the loop */
#pragma omp for schedule(dynamic, 1)
            for (int64_t b = 0; b < B; b++) {
                int64_t len = seq_lens[b], first = (window > 0 && len > window) ? len - window : 0;
                attend_sequence(kind, q + b * H * D, k_pool, v_pool, k_scale, v_scale, block_tables + b * table_stride,
                                first, len, H, Hkv, D, BS, scale, scores, acc, out + b * H * D);
            }
        }
        free(scores);
        free(acc);
    }
    return failed;
}
