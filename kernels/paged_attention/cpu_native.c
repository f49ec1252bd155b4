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
 * with one fp32 scale per token and head (x = q * scale).
 *
 * A work item is one (sequence, KV head) pair; OpenMP (torch's own runtime, as in kernels/quant_matmul) shares
 * the B * Hkv items between threads. With enough sequences to go round, a thread claims all of one sequence's
 * items at once (its heads one after the other): two threads then never read different heads of the same tokens
 * at the same time, which had cost ~15 % of a batch-64 step's attention on an Intel Xeon (2 threads, SmolLM2's 30
 * layers: ~34 -> ~29 ms); with few sequences, the heads are shared out one by one so that both threads work.
 * Inside an item the g queries and the g output rows stay in vector registers (AVX-512 or AVX2 where the compiler was told the CPU has them), so memory traffic is K and V
 * alone. What it cost to get there, measured on 64 sequences of ~180 tokens (SmolLM2's 9 / 3 heads of 64, bf16,
 * one core): the first version took 4.3 ms a layer. A 64-bit division (i / g, p / BS) per head and row cost
 * as much as the row's arithmetic, and fmaxf in the softmax kept GCC from vectorizing its exp (one libm call
 * per score); without them, and with the queries in registers, 1.1-1.5 ms. Then the horizontal adds (one per
 * score) and accumulators left on the stack (GQA group size known only at run time) were the limit: with copies
 * compiled per group size and four scores summed at once, ~25 ns per token and KV head in cache, and in a real
 * decode step (64 sequences, ~190 tokens, 30 layers, 2 threads) 22.6 ms of attention a step instead of 28.5.
 * Where it stands now (2026-12-03, AMD EPYC, AVX-512, 2 threads, 64 sequences of 208 tokens, SmolLM2's heads):
 * 1.43 ms a layer with K/V coming from DRAM, 0.33 ms with the same work hot in L2, so about three quarters of the
 * time is the wait for K and V. A plain C loop that only reads the same bytes in the same order reached 16.5 GB/s there
 * (whole 12 KB blocks in random order 20-23, a streaming sum 32-47): the kernel reads at about 85 % of what
 * this access pattern gives. Prefetching 32 or 64 tokens ahead, not prefetching at all, transparent huge pages
 * (madvise) and walking all KV heads of a chunk of tokens together each moved it by less than the noise.
 *
 * Contract (checked in Python before the call, kernels/paged_attention/reference.py check_paged_inputs):
 * q and out fp32 [B, H, D] contiguous (servelab_paged_decode), or q rows with a stride and out contiguous, both
 * fp32 or both bf16 (servelab_paged_decode_rows: the engine's queries as the QKV projection left them); pools
 * [NB, BS, Hkv, D] contiguous; scales fp32 [NB, BS, Hkv] or NULL; block_tables int32 [B, table_stride]; seq_lens int32 [B] in 1..capacity; every table entry read inside
 * the pool. Returns 0, or 1 when scratch memory could not be allocated.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cpu_vectors.h"  /* widen_bf16, to_bf16, exp_clamped, the vector layer (vec, vload, vfma, vsum4, ...) */

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2 };

#define PREFETCH_TOKENS 16  /* rows ahead of the one being read: 16 and 32 alike, 8 was ~1.2x slower (Xeon) */
#define CACHE_LINE 64
#define MAX_GROUP 16  /* query heads per KV head in one work item (more: several items, K and V read again) */
#define SEQS_PER_THREAD 2  /* from this many sequences a thread, a thread claims a whole sequence at a time */
#define MAX_HEAD_DIM 256  /* the register version's largest head; larger heads take the plain-C one */

/* ---- loading one head's row of one token as fp32 --------------------------------------------------------
 * The row of KV head h at pool slot `slot` starts at element (slot * Hkv + h) * D. fp32 pools are read as
 * they are; bf16 is widened (a bf16 is the top half of an fp32: zero-extend, shift left by 16); int8 is
 * multiplied by its fp32 scale (one per token and head). */
static inline float kv_at(int kind, const void *pool, int64_t i, float s) {
    if (kind == KV_F32) return ((const float *)pool)[i];
    if (kind == KV_BF16) return widen_bf16(((const uint16_t *)pool)[i]);
    return (float)((const int8_t *)pool)[i] * s;
}

static inline float scale_of(int kind, const float *scales, int64_t slot, int64_t Hkv, int64_t h) {
    return kind == KV_INT8 ? scales[slot * Hkv + h] : 1.0f;
}

/* One work item: the gc query heads q[gc, D] that read KV head h, over positions first .. len - 1 of one
 * sequence. Two passes over the sequence's blocks, each K (then V) row read once for all gc heads:
 *
 *     pass 1   s[j, t] = scale * q_j . k_t          (t = p - first)
 *     softmax  w[j, t]
 *     pass 2   out_j = sum_t w[j, t] * v_t
 *
 * `Head` holds what every work item of a call shares, and the item's own sequence (table, first, len) and
 * KV head h. */
typedef struct {
    int kind;
    const void *k_pool, *v_pool;
    const float *k_scale, *v_scale;
    const int32_t *table;
    int64_t first, len, h, Hkv, D, BS;
    float scale;
} Head;

/* The cache lines of head h's row at `slot`, asked for ahead of their use. */
static inline void prefetch_row(const Head *a, const void *pool, int64_t slot) {
    int64_t bytes = a->kind == KV_F32 ? 4 : a->kind == KV_BF16 ? 2 : 1;
    const char *at = (const char *)pool + (slot * a->Hkv + a->h) * a->D * bytes;
    for (int64_t b = 0; b < a->D * bytes; b += CACHE_LINE) __builtin_prefetch(at + b);
}

/* Pass 1 asks for the K row PREFETCH_TOKENS ahead and for the V row too, so that pass 2 finds V in cache (measured
 * ~1.1x on the whole kernel); pass 2 asks for V again, in case a long sequence's rows have left the cache. */
static inline void prefetch_ahead(const Head *a, const int64_t *slots, int64_t t, int64_t L, int pass) {
    if (t + PREFETCH_TOKENS >= L) return;
    if (pass == 1) prefetch_row(a, a->k_pool, slots[t + PREFETCH_TOKENS]);
    prefetch_row(a, a->v_pool, slots[t + PREFETCH_TOKENS]);
}

/* The pool slot of every position first .. len - 1 (t = p - first), from the block table once per work item:
 * both passes then walk a plain array (a division p / BS per row had cost as much as the row's math). Block by
 * block, so that only the first position is divided. */
static void fill_slots(const Head *a, int64_t *slots) {
    int64_t p = a->first, off = p % a->BS;
    for (int64_t blk = p / a->BS; p < a->len; blk++, off = 0) {
        int64_t base = (int64_t)a->table[blk] * a->BS;  /* the block's first slot */
        for (; off < a->BS && p < a->len; off++, p++) slots[p - a->first] = base + off;
    }
}

/* Each query row's softmax, in place: w[j, t] = exp(s[j, t] - max_t s[j, t]) / sum_t exp(...). */
static void softmax_rows(float *scores, int64_t rows, int64_t L) {
    for (int64_t j = 0; j < rows; j++) {
        float *sj = scores + j * L, m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < L; t++) m = sj[t] > m ? sj[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) { sj[t] = exp_clamped(sj[t] - m); sum += sj[t]; }
        float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < L; t++) sj[t] *= inv;
    }
}

/* The plain-C version: the row widened into scratch [D], the accumulators in scratch + D [gc, D]. */
static void attend_head_plain(const Head *a, const int64_t *slots, const float *q, int64_t gc, float *scores,
                              float *scratch, float *out) {
    int64_t L = a->len - a->first, D = a->D;
    float *row = scratch, *acc = scratch + D;
    for (int64_t t = 0; t < L; t++) {
        prefetch_ahead(a, slots, t, L, 1);
        int64_t slot = slots[t], base = (slot * a->Hkv + a->h) * D;
        float s = scale_of(a->kind, a->k_scale, slot, a->Hkv, a->h);
        for (int64_t d = 0; d < D; d++) row[d] = kv_at(a->kind, a->k_pool, base + d, s);
        for (int64_t j = 0; j < gc; j++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < D; d++) dot += q[j * D + d] * row[d];
            scores[j * L + t] = dot * a->scale;
        }
    }
    softmax_rows(scores, gc, L);
    memset(acc, 0, (size_t)(gc * D) * sizeof(float));
    for (int64_t t = 0; t < L; t++) {
        prefetch_ahead(a, slots, t, L, 2);
        int64_t slot = slots[t], base = (slot * a->Hkv + a->h) * D;
        float s = scale_of(a->kind, a->v_scale, slot, a->Hkv, a->h);
        for (int64_t d = 0; d < D; d++) row[d] = kv_at(a->kind, a->v_pool, base + d, s);
        for (int64_t j = 0; j < gc; j++) {
            float w = scores[j * L + t];
            for (int64_t d = 0; d < D; d++) acc[j * D + d] += w * row[d];
        }
    }
    memcpy(out, acc, (size_t)(gc * D) * sizeof(float));
}

/* ---- the same in vector registers (AVX-512: 16 lanes, AVX2: 8), where the compiler was told the CPU has them
 * A head row of D floats is NV = D / LANES vectors. The GC queries (pass 1) and the GC accumulators (pass 2) stay
 * in registers: only K and V come from memory, each row once. Pass 1 takes TOKEN_GROUP tokens at a time, so that
 * their GC x 4 partial-sum vectors are added across lanes four at a time (vsum4: 10 shuffles and adds for four
 * scores, against 24 for four vsum's; the horizontal adds had been the pass's bottleneck).
 *
 * KIND, GC and NV are compile-time constants in the common cases (attend_head below lists them): the loops over
 * them unroll, and qv[][] and acc[][] become registers. Where GC was a run-time value, GCC kept the accumulators
 * on the stack (a load, an FMA and a store per vector and token): with that and a vsum per score, the kernel took
 * ~130 cycles per token and KV head, hot in cache, on an Intel Xeon (Sapphire Rapids). */
#ifdef LANES
#define MAX_VECS (MAX_HEAD_DIM / LANES)
#define TOKEN_GROUP 4  /* tokens per vsum4 in pass 1 */

/* Vector c of the head row that starts at element `base`. */
static inline __attribute__((always_inline)) vec load_vec(int kind, const void *pool, int64_t base, int64_t c,
                                                          vec s) {
    int64_t i = base + c * LANES;
    if (kind == KV_F32) return vload((const float *)pool + i);
    if (kind == KV_BF16) return vload_bf16((const uint16_t *)pool + i);
    return vmul(vload_int8((const int8_t *)pool + i), s);
}

/* Token t's row of head a->h, NV vectors, into k[] (int8: times its scale). */
static inline __attribute__((always_inline)) void load_row(const Head *a, int kind, const void *pool,
                                                           const float *scales, const int64_t *slots, int64_t t,
                                                           int64_t NV, vec *k) {
    int64_t slot = slots[t], base = (slot * a->Hkv + a->h) * a->D;
    vec s = vset1(scale_of(kind, scales, slot, a->Hkv, a->h));
    for (int64_t c = 0; c < NV; c++) k[c] = load_vec(kind, pool, base, c, s);
}

/* qv[j] . k, still LANES partial sums wide */
static inline __attribute__((always_inline)) vec dot_vec(const vec *qv, const vec *k, int64_t NV) {
    vec dot = vmul(qv[0], k[0]);
    for (int64_t c = 1; c < NV; c++) dot = vfma(qv[c], k[c], dot);
    return dot;
}

static inline __attribute__((always_inline)) void attend_head_vec(const Head *a, int kind, const int64_t *slots,
                                                                   const float *q, int64_t GC, float *scores,
                                                                   float *out, int64_t NV) {
    int64_t L = a->len - a->first, D = a->D, t = 0;
    vec qv[MAX_GROUP][MAX_VECS], k[MAX_VECS], acc[MAX_GROUP][MAX_VECS];
    for (int64_t j = 0; j < GC; j++)
        for (int64_t c = 0; c < NV; c++) qv[j][c] = vload(q + j * D + c * LANES);
    __m128 scale4 = _mm_set1_ps(a->scale);
    for (; t + TOKEN_GROUP <= L; t += TOKEN_GROUP) {  /* pass 1, four tokens at a time */
        vec dots[TOKEN_GROUP][MAX_GROUP];
        for (int64_t u = 0; u < TOKEN_GROUP; u++) {
            prefetch_ahead(a, slots, t + u, L, 1);
            load_row(a, kind, a->k_pool, a->k_scale, slots, t + u, NV, k);
            for (int64_t j = 0; j < GC; j++) dots[u][j] = dot_vec(qv[j], k, NV);
        }
        for (int64_t j = 0; j < GC; j++)
            _mm_storeu_ps(scores + j * L + t,
                          _mm_mul_ps(vsum4(dots[0][j], dots[1][j], dots[2][j], dots[3][j]), scale4));
    }
    for (; t < L; t++) {  /* the last L % 4 tokens */
        prefetch_ahead(a, slots, t, L, 1);
        load_row(a, kind, a->k_pool, a->k_scale, slots, t, NV, k);
        for (int64_t j = 0; j < GC; j++) scores[j * L + t] = vsum(dot_vec(qv[j], k, NV)) * a->scale;
    }
    softmax_rows(scores, GC, L);
    for (int64_t j = 0; j < GC; j++)
        for (int64_t c = 0; c < NV; c++) acc[j][c] = vzero();
    for (t = 0; t < L; t++) {  /* pass 2 */
        prefetch_ahead(a, slots, t, L, 2);
        load_row(a, kind, a->v_pool, a->v_scale, slots, t, NV, k);
        for (int64_t j = 0; j < GC; j++) {
            vec w = vset1(scores[j * L + t]);
            for (int64_t c = 0; c < NV; c++) acc[j][c] = vfma(w, k[c], acc[j][c]);
        }
    }
    for (int64_t j = 0; j < GC; j++)
        for (int64_t c = 0; c < NV; c++) vstore(out + j * D + c * LANES, acc[j][c]);
}

/* One copy per (pool kind, query heads per KV head, head size) that models use: GQA groups of 1 (MHA), 2, 3
 * (SmolLM2), 4 (Llama 3 8B) and 8 (Llama 3 70B); heads of 64 and 128. Anything else: the same code with run-time
 * sizes (correct, slower). */
#define SPECIALIZE(KIND, GC, DIM)                                                                             \
    static void attend_##KIND##_##GC##_##DIM(const Head *a, const int64_t *slots, const float *q,             \
                                              float *scores, float *out) {                                    \
        attend_head_vec(a, KIND, slots, q, GC, scores, out, DIM / LANES);                                     \
    }
#define SPECIALIZE_KIND(KIND)                                                                                  \
    SPECIALIZE(KIND, 1, 64) SPECIALIZE(KIND, 2, 64) SPECIALIZE(KIND, 3, 64) SPECIALIZE(KIND, 4, 64)          \
    SPECIALIZE(KIND, 8, 64) SPECIALIZE(KIND, 1, 128) SPECIALIZE(KIND, 2, 128) SPECIALIZE(KIND, 3, 128)       \
    SPECIALIZE(KIND, 4, 128) SPECIALIZE(KIND, 8, 128)
SPECIALIZE_KIND(KV_F32)
SPECIALIZE_KIND(KV_BF16)
SPECIALIZE_KIND(KV_INT8)

typedef void (*attend_fn)(const Head *, const int64_t *, const float *, float *, float *);

/* The specialized copy for this call, or NULL. */
static attend_fn specialized(int kind, int64_t gc, int64_t D) {
#define PICK(KIND)                                                                                             \
    if (D == 64) {                                                                                            \
        if (gc == 1) return attend_##KIND##_1_64;                                                             \
        if (gc == 2) return attend_##KIND##_2_64;                                                             \
        if (gc == 3) return attend_##KIND##_3_64;                                                             \
        if (gc == 4) return attend_##KIND##_4_64;                                                             \
        if (gc == 8) return attend_##KIND##_8_64;                                                             \
    } else if (D == 128) {                                                                                    \
        if (gc == 1) return attend_##KIND##_1_128;                                                            \
        if (gc == 2) return attend_##KIND##_2_128;                                                            \
        if (gc == 3) return attend_##KIND##_3_128;                                                            \
        if (gc == 4) return attend_##KIND##_4_128;                                                            \
        if (gc == 8) return attend_##KIND##_8_128;                                                            \
    }                                                                                                         \
    return NULL;
    if (kind == KV_F32) { PICK(KV_F32) }
    if (kind == KV_BF16) { PICK(KV_BF16) }
    PICK(KV_INT8)
#undef PICK
}
#endif

/* One work item, on the fastest version that takes its sizes. */
static void attend_head(const Head *a, const int64_t *slots, const float *q, int64_t gc, float *scores,
                        float *scratch, float *out) {
#ifdef LANES
    attend_fn fn = specialized(a->kind, gc, a->D);
    if (fn != NULL) { fn(a, slots, q, scores, out); return; }
    if (a->D % LANES == 0 && a->D <= MAX_HEAD_DIM) {
        attend_head_vec(a, a->kind, slots, q, gc, scores, out, a->D / LANES);
        return;
    }
#endif
    attend_head_plain(a, slots, q, gc, scores, scratch, out);
}

/* Sequence b's queries as the model left them, and where its output goes: row b of q starts at q + b * q_stride
 * (elements), its H heads side by side, fp32 or bf16 (io_bf16); out [B, H, D] contiguous in the same dtype. */
typedef struct {
    int bf16;
    const void *q;
    int64_t q_stride;
    void *out;
} Rows;

/* The call behind both entry points. A work item whose rows are not fp32 in place reads its gc query rows through
 * qbuf and writes through obuf (gc x D floats each): a bf16 model's queries need no fp32 copy of the whole batch. */
static int paged_decode(int kind, const Rows *io, const void *k_pool, const void *v_pool, const float *k_scale,
                        const float *v_scale, const int32_t *block_tables, int64_t table_stride,
                        const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                        int64_t window, float scale) {
    int64_t max_len = 0, g = H / Hkv, chunks = (g + MAX_GROUP - 1) / MAX_GROUP, items = B * Hkv * chunks;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;
#pragma omp parallel if (items > 1)
    {
        float *scores = malloc((size_t)(MAX_GROUP * max_len) * sizeof(float));
        float *scratch = malloc((size_t)((MAX_GROUP + 1) * D) * sizeof(float));
        float *qbuf = malloc((size_t)(2 * MAX_GROUP * D) * sizeof(float)), *obuf = qbuf + MAX_GROUP * D;
        int64_t *slots = malloc((size_t)max_len * sizeof(int64_t));
        if (scores == NULL || scratch == NULL || qbuf == NULL || slots == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* the items of one claim: a whole sequence's (b-major order), or one when sequences are few */
        int64_t claim = B >= SEQS_PER_THREAD * omp_get_num_threads() ? Hkv * chunks : 1;
        if (!failed) {  /* the same answer in every thread after the barrier: all or none enter the loop */
#pragma omp for schedule(dynamic, claim)
            for (int64_t item = 0; item < items; item++) {  /* item = (sequence b, KV head h, query chunk) */
                int64_t b = item / (Hkv * chunks), h = item / chunks % Hkv, j0 = item % chunks * MAX_GROUP;
                int64_t len = seq_lens[b], gc = g - j0 < MAX_GROUP ? g - j0 : MAX_GROUP;
                Head a = {kind, k_pool, v_pool, k_scale, v_scale, block_tables + b * table_stride,
                          (window > 0 && len > window) ? len - window : 0, len, h, Hkv, D, BS, scale};
                int64_t head0 = h * g + j0, at = b * io->q_stride + head0 * D;  /* query head h * g + j0 of b */
                fill_slots(&a, slots);
                if (!io->bf16) {
                    attend_head(&a, slots, (const float *)io->q + at, gc, scores, scratch,
                                (float *)io->out + (b * H + head0) * D);
                    continue;
                }
                for (int64_t i = 0; i < gc * D; i++) qbuf[i] = widen_bf16(((const uint16_t *)io->q)[at + i]);
                attend_head(&a, slots, qbuf, gc, scores, scratch, obuf);
                uint16_t *o = (uint16_t *)io->out + (b * H + head0) * D;
                for (int64_t i = 0; i < gc * D; i++) o[i] = to_bf16(obuf[i]);
            }
        }
        free(scores);
        free(scratch);
        free(qbuf);
        free(slots);
    }
    return failed;
}

/* q and out fp32 [B, H, D] contiguous (what the C decoder layers pass). */
int servelab_paged_decode(int kind, const float *q, const void *k_pool, const void *v_pool, const float *k_scale,
                          const float *v_scale, const int32_t *block_tables, int64_t table_stride,
                          const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                          int64_t window, float scale, float *out) {
    Rows io = {0, q, H * D, out};
    return paged_decode(kind, &io, k_pool, v_pool, k_scale, v_scale, block_tables, table_stride, seq_lens, B, H,
                        Hkv, D, BS, window, scale);
}

/* q rows with a stride (e.g. the query columns of the fused QKV projection's output), fp32 or bf16 (io_bf16);
 * out [B, H, D] contiguous in q's dtype. */
int servelab_paged_decode_rows(int kind, int io_bf16, const void *q, int64_t q_stride, const void *k_pool,
                               const void *v_pool, const float *k_scale, const float *v_scale,
                               const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, int64_t B,
                               int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t window, float scale, void *out) {
    Rows io = {io_bf16, q, q_stride, out};
    return paged_decode(kind, &io, k_pool, v_pool, k_scale, v_scale, block_tables, table_stride, seq_lens, B, H,
                        Hkv, D, BS, window, scale);
}
