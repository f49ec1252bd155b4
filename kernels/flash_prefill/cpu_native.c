/* Causal prefill attention for the CPU, in C: FlashAttention's schedule (reference.py flash_attention_ref, tile
 * for tile) on the CPU's vector registers, for all the whole prompts of a prefill step in one call.
 *
 * Why it exists: torch's fused attention (the "sdpa" path) runs one call per prompt and layer, and on prompts of
 * a few hundred tokens its tiles are small and its fixed costs large: SmolLM2-135M's 9 heads of 64 over a
 * 153-token prompt ran at ~80 GFLOP/s in bf16 and ~60 in fp32 on 2 cores of an Intel Xeon (Sapphire Rapids),
 * a tenth of what the same cores do in a large matmul, so the attention of a 64-prompt prefill cost about a
 * third of its linear layers. Here one OpenMP loop takes every (prompt, KV head, query tile) of the step.
 *
 * A work item: BQ query tokens x the g = H / Hkv query heads that share KV head h (R = g * BQ rows of q,
 * each K and V tile read once for all of them), against the key tiles 0 .. its diagonal, BK keys each:
 *
 *     S    = Q K^T                       [R, BK]: K's tile transposed into [D, BK] first, so that a row of S
 *                                        is a few vectors, each an FMA chain of broadcast q[r, d] x Kt[d, :]
 *     m'   = max(m, rowmax(S * scale))   the online softmax (reference.py): running max m, sum l, acc
 *     P    = exp(S * scale - m')         keys after the query's own position: P = 0 (causal)
 *     acc  = acc * exp(m - m') + P V     [R, D], V's tile widened to fp32 once for all R rows
 *     l    = l * exp(m - m') + rowsum(P)
 *
 * and out = acc / l. Everything in fp32 (bf16 widened on load, rounded to nearest even on store), so the
 * result equals the reference up to the order of the float additions.
 *
 * Layout: q [tokens, H, D] and k, v [tokens, Hkv, D] as rows with a row stride (elements), e.g. column slices
 * of the fused QKV projection's output, so nothing is copied first; out [tokens, H, D] contiguous, written in
 * the prompts' rows only (a step's decode rows between them are left alone). Prompt b is rows
 * bounds[2b] .. bounds[2b + 1] - 1, its token i at position i. fp32 or bf16 (bf16 = 1), one dtype for all.
 * Checked in Python (kernels/flash_prefill/cpu_native.py). Returns 0, or 1 when scratch could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cpu_vectors.h"  /* value_at, to_bf16, exp_clamped, the vector layer (vec, vload, vfma, ...) */

#define BQ 16  /* query tokens per work item */
#define BK 32  /* keys per tile: two AVX-512 vectors (four AVX2 ones) of scores per row */
#define MAX_HEAD_DIM 256

typedef struct {  /* what every work item of a call shares */
    int bf16;
    const void *q, *k, *v;
    int64_t q_stride, k_stride, v_stride, H, Hkv, D;
    float scale;
    void *out;
} Call;

typedef struct {  /* one thread's scratch, reused by its work items */
    float *q;   /* [R, D]   the item's queries, fp32 */
    float *s;   /* [R, BK]  scores, then probabilities */
    float *acc; /* [R, D]   running sum of p * v */
    float *m, *l, *alpha;  /* [R] running max, running sum, this tile's rescale */
} Scratch;

/* Row r of the item is query head h * g + r / BQ at token t0 + r % BQ (n of the BQ tokens exist). */
static void load_queries(const Call *c, int64_t row0, int64_t t0, int64_t n, int64_t h, int64_t g, float *q) {
    for (int64_t j = 0; j < g; j++)
        for (int64_t i = 0; i < n; i++) {
            int64_t at = (row0 + t0 + i) * c->q_stride + (h * g + j) * c->D;
            for (int64_t d = 0; d < c->D; d++) q[(j * BQ + i) * c->D + d] = value_at(c->bf16, c->q, at + d);
        }
}

/* Keys k0 .. k0 + nk - 1 of KV head h, in fp32: K transposed into kt [D, BK], V as it is into vt [BK, D]; the
 * tile's columns past nk are zero (their scores are masked anyway). Done once per key tile and KV head for the
 * whole call (phase 1), not again by every query tile that reads it: transposing per use cost as much as the
 * FMAs it fed. */
static void load_kv_tile(const Call *c, int64_t row0, int64_t k0, int64_t nk, int64_t h, float *kt, float *vt) {
    int64_t D = c->D;
    for (int64_t j = 0; j < BK; j++) {
        if (j >= nk) {
            for (int64_t d = 0; d < D; d++) kt[d * BK + j] = 0.0f;
            memset(vt + j * D, 0, (size_t)D * sizeof(float));
            continue;
        }
        int64_t ka = (row0 + k0 + j) * c->k_stride + h * D, va = (row0 + k0 + j) * c->v_stride + h * D;
        for (int64_t d = 0; d < D; d++) kt[d * BK + j] = value_at(c->bf16, c->k, ka + d);
        for (int64_t d = 0; d < D; d++) vt[j * D + d] = value_at(c->bf16, c->v, va + d);
    }
}

/* ---- S = Q Kt: rows r0 .. r0 + RB - 1, all BK columns ------------------------------------------------------ */
#ifdef LANES
#define SV (BK / LANES)  /* vectors per row of S */
#define S_ROWS 6         /* rows per register block: 6 x SV accumulators (12 on AVX-512) */

static inline __attribute__((always_inline)) void scores_block(const float *q, const float *kt, float *s,
                                                               int64_t r0, int64_t RB, int64_t D) {
    vec a[S_ROWS][SV];
    for (int64_t r = 0; r < RB; r++)
        for (int64_t c = 0; c < SV; c++) a[r][c] = vzero();
    for (int64_t d = 0; d < D; d++) {
        vec k[SV];
        for (int64_t c = 0; c < SV; c++) k[c] = vload(kt + d * BK + c * LANES);
        for (int64_t r = 0; r < RB; r++) {
            vec qb = vset1(q[(r0 + r) * D + d]);
            for (int64_t c = 0; c < SV; c++) a[r][c] = vfma(qb, k[c], a[r][c]);
        }
    }
    for (int64_t r = 0; r < RB; r++)
        for (int64_t c = 0; c < SV; c++) vstore(s + (r0 + r) * BK + c * LANES, a[r][c]);
}

static void scores_tile(const float *q, const float *kt, float *s, int64_t R, int64_t D) {
    int64_t r = 0;
    for (; r + S_ROWS <= R; r += S_ROWS) scores_block(q, kt, s, r, S_ROWS, D);
    for (; r < R; r++) scores_block(q, kt, s, r, 1, D);
}
#else
static void scores_tile(const float *q, const float *kt, float *s, int64_t R, int64_t D) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < BK; j++) {
            float t = 0.0f;
            for (int64_t d = 0; d < D; d++) t += q[r * D + d] * kt[d * BK + j];
            s[r * BK + j] = t;
        }
}
#endif

/* The online softmax for one key tile: row r (its token at position pos[r]) sees keys k0 .. min(pos, k0 + nk - 1);
 * S becomes P in place (0 for keys it does not see); m and l updated, alpha = exp(m_old - m_new) kept for acc. */
static void softmax_tile(Scratch *w, int64_t R, int64_t t0, int64_t n, int64_t k0, int64_t nk, float scale) {
    for (int64_t r = 0; r < R; r++) {
        float *s = w->s + r * BK;
        int64_t i = r % BQ;
        int64_t seen = i >= n ? 0 : t0 + i - k0 + 1;  /* keys of this tile at or before the query */
        seen = seen > nk ? nk : seen;
#ifdef LANES
        if (seen == BK) {  /* a whole tile seen: most rows of most tiles, in vector registers */
            vec sv[SV], vscale = vset1(scale), sum = vzero();
            for (int64_t c = 0; c < SV; c++) sv[c] = vmul(vload(s + c * LANES), vscale);
            vec mv = sv[0];
            for (int64_t c = 1; c < SV; c++) mv = vmax(mv, sv[c]);
            float m = vmax_all(mv) > w->m[r] ? vmax_all(mv) : w->m[r];
            vec mb = vset1(m);
            for (int64_t c = 0; c < SV; c++) {
                vec p = vexp(vsub(sv[c], mb));
                vstore(s + c * LANES, p);
                sum = vadd(sum, p);
            }
            w->alpha[r] = w->m[r] == -INFINITY ? 0.0f : exp_clamped(w->m[r] - m);
            w->l[r] = w->l[r] * w->alpha[r] + vsum(sum);
            w->m[r] = m;
            continue;
        }
#endif
        if (seen <= 0) {  /* a padding row (past the prompt's end), or a tile wholly after the query */
            memset(s, 0, BK * sizeof(float));
            w->alpha[r] = 1.0f;
            continue;
        }
        float m = w->m[r];
        for (int64_t j = 0; j < seen; j++) m = s[j] * scale > m ? s[j] * scale : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < BK; j++) {
            float p = j < seen ? exp_clamped(s[j] * scale - m) : 0.0f;
            s[j] = p;
            sum += p;
        }
        w->alpha[r] = w->m[r] == -INFINITY ? 0.0f : exp_clamped(w->m[r] - m);
        w->l[r] = w->l[r] * w->alpha[r] + sum;
        w->m[r] = m;
    }
}

/* ---- acc = acc * alpha + P V ------------------------------------------------------------------------------- */
#ifdef LANES
#define ACC_VECS 16  /* accumulators per register block: rows x (D / LANES) */

static inline __attribute__((always_inline)) void values_block(const float *p, const float *vt, float *acc,
                                                               const float *alpha, int64_t r0, int64_t RB,
                                                               int64_t NV, int64_t nk) {
    int64_t D = NV * LANES;
    vec a[ACC_VECS];
    for (int64_t r = 0; r < RB; r++) {
        vec al = vset1(alpha[r0 + r]);
        for (int64_t c = 0; c < NV; c++) a[r * NV + c] = vmul(al, vload(acc + (r0 + r) * D + c * LANES));
    }
    for (int64_t j = 0; j < nk; j++) {
        vec v[MAX_HEAD_DIM / LANES];
        for (int64_t c = 0; c < NV; c++) v[c] = vload(vt + j * D + c * LANES);
        for (int64_t r = 0; r < RB; r++) {
            vec pb = vset1(p[(r0 + r) * BK + j]);
            for (int64_t c = 0; c < NV; c++) a[r * NV + c] = vfma(pb, v[c], a[r * NV + c]);
        }
    }
    for (int64_t r = 0; r < RB; r++)
        for (int64_t c = 0; c < NV; c++) vstore(acc + (r0 + r) * D + c * LANES, a[r * NV + c]);
}

/* NV a compile-time constant in the common head sizes (the loops unroll, the block stays in registers). */
static inline __attribute__((always_inline)) void values_rows(const float *p, const float *vt, float *acc,
                                                              const float *alpha, int64_t R, int64_t NV,
                                                              int64_t nk) {
    int64_t rows = ACC_VECS / NV, r = 0;
    if (rows == 4) for (; r + 4 <= R; r += 4) values_block(p, vt, acc, alpha, r, 4, NV, nk);
    if (rows == 2) for (; r + 2 <= R; r += 2) values_block(p, vt, acc, alpha, r, 2, NV, nk);
    for (; r < R; r++) values_block(p, vt, acc, alpha, r, 1, NV, nk);
}
#endif

static void values_tile(const float *p, const float *vt, float *acc, const float *alpha, int64_t R, int64_t D,
                        int64_t nk) {
#ifdef LANES
    if (D == 64) { values_rows(p, vt, acc, alpha, R, 64 / LANES, nk); return; }
    if (D == 128) { values_rows(p, vt, acc, alpha, R, 128 / LANES, nk); return; }
    if (D % LANES == 0 && D / LANES <= ACC_VECS) { values_rows(p, vt, acc, alpha, R, D / LANES, nk); return; }
#endif
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) {
            float t = acc[r * D + d] * alpha[r];
            for (int64_t j = 0; j < nk; j++) t += p[r * BK + j] * vt[j * D + d];
            acc[r * D + d] = t;
        }
}

/* One work item: query tokens t0 .. t0 + n - 1 of the prompt at rows row0.., the g heads of KV head h, whose key
 * tiles are kt [tiles, D, BK] and vt [tiles, BK, D] (phase 1's, for this prompt and head). */
static void attend_tile(const Call *c, Scratch *w, int64_t row0, int64_t t0, int64_t n, int64_t h,
                        const float *kt, const float *vt) {
    int64_t g = c->H / c->Hkv, R = g * BQ, D = c->D;
    load_queries(c, row0, t0, n, h, g, w->q);
    for (int64_t r = 0; r < R; r++) { w->m[r] = -INFINITY; w->l[r] = 0.0f; }
    memset(w->acc, 0, (size_t)(R * D) * sizeof(float));
    for (int64_t k0 = 0; k0 < t0 + n; k0 += BK) {  /* key tiles up to the diagonal */
        int64_t nk = t0 + n - k0 < BK ? t0 + n - k0 : BK;
        scores_tile(w->q, kt + k0 / BK * D * BK, w->s, R, D);
        softmax_tile(w, R, t0, n, k0, nk, c->scale);
        values_tile(w->s, vt + k0 / BK * BK * D, w->acc, w->alpha, R, D, nk);
    }
    for (int64_t j = 0; j < g; j++)
        for (int64_t i = 0; i < n; i++) {
            const float *a = w->acc + (j * BQ + i) * D;
            float inv = 1.0f / w->l[j * BQ + i];
            int64_t at = ((row0 + t0 + i) * c->H + h * g + j) * D;
            for (int64_t d = 0; d < D; d++) {
                if (c->bf16) ((uint16_t *)c->out)[at + d] = to_bf16(a[d] * inv);
                else ((float *)c->out)[at + d] = a[d] * inv;
            }
        }
}

static int scratch_alloc(Scratch *w, int64_t R, int64_t D) {
    w->q = malloc((size_t)(R * D) * sizeof(float));
    w->s = malloc((size_t)(R * BK) * sizeof(float));
    w->acc = malloc((size_t)(R * D) * sizeof(float));
    w->m = malloc((size_t)(3 * R) * sizeof(float));
    if (!w->q || !w->s || !w->acc || !w->m) return 1;
    w->l = w->m + R;
    w->alpha = w->m + 2 * R;
    return 0;
}

static void scratch_free(Scratch *w) {
    free(w->q); free(w->s); free(w->acc); free(w->m);
}

/* Which prompt work item `left` (counted from the last prompt) belongs to; `left` becomes its index there. */
static int64_t prompt_of(const int64_t *bounds, int64_t B, int64_t Hkv, int64_t *left) {
    int64_t b = B - 1;
    for (;; b--) {  /* a linear walk: a few dozen prompts, cheap beside an item's work */
        int64_t here = Hkv * ((bounds[2 * b + 1] - bounds[2 * b] + BQ - 1) / BQ);
        if (*left < here) return b;
        *left -= here;
    }
}

int servelab_flash_prefill(int bf16, const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                           const void *v, int64_t v_stride, const int64_t *bounds, int64_t B, int64_t H,
                           int64_t Hkv, int64_t D, float scale, void *out) {
    Call c = {bf16, q, k, v, q_stride, k_stride, v_stride, H, Hkv, D, scale, out};
    int64_t items = 0, key_tiles = 0, R = H / Hkv * BQ, tile_floats = D * BK;
    for (int64_t b = 0; b < B; b++) {
        items += Hkv * ((bounds[2 * b + 1] - bounds[2 * b] + BQ - 1) / BQ);
        key_tiles += (bounds[2 * b + 1] - bounds[2 * b] + BK - 1) / BK;
    }
    /* every key tile of every prompt, per KV head: kt_all [Hkv, key_tiles, D, BK], vt_all [Hkv, key_tiles, BK, D] */
    float *kt_all = malloc((size_t)(Hkv * key_tiles * tile_floats) * sizeof(float));
    float *vt_all = malloc((size_t)(Hkv * key_tiles * tile_floats) * sizeof(float));
    int64_t *first_tile = malloc((size_t)(B + 1) * sizeof(int64_t));  /* prompt b's tiles: first_tile[b] .. */
    int failed = kt_all == NULL || vt_all == NULL || first_tile == NULL;
    if (!failed) {
        first_tile[0] = 0;
        for (int64_t b = 0; b < B; b++)
            first_tile[b + 1] = first_tile[b] + (bounds[2 * b + 1] - bounds[2 * b] + BK - 1) / BK;
    }
#pragma omp parallel if (items > 1 && !failed)
    {
        Scratch w = {0};
        if (!failed && scratch_alloc(&w, R, D)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {  /* the same answer in every thread after the barrier: all or none go on */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < Hkv * key_tiles; i++) {  /* phase 1: the key tiles, i = (KV head, tile) */
                int64_t h = i / key_tiles, tile = i % key_tiles, b = 0;
                while (first_tile[b + 1] <= tile) b++;
                int64_t k0 = (tile - first_tile[b]) * BK, T = bounds[2 * b + 1] - bounds[2 * b];
                load_kv_tile(&c, bounds[2 * b], k0, T - k0 < BK ? T - k0 : BK, h, kt_all + i * tile_floats,
                             vt_all + i * tile_floats);
            }  /* (an implicit barrier: every tile is ready before phase 2) */
            /* phase 2: the work items, the last prompt's last query tiles (the longest items) first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; item++) {
                int64_t left = item, b = prompt_of(bounds, B, Hkv, &left);
                int64_t T = bounds[2 * b + 1] - bounds[2 * b], tiles = (T + BQ - 1) / BQ;
                int64_t tile = tiles - 1 - left / Hkv, h = left % Hkv, t0 = tile * BQ;
                int64_t at = (h * key_tiles + first_tile[b]) * tile_floats;
                attend_tile(&c, &w, bounds[2 * b], t0, T - t0 < BQ ? T - t0 : BQ, h, kt_all + at, vt_all + at);
            }
        }
        scratch_free(&w);  /* (free(NULL) is a no-op: a thread whose allocation failed half-way frees its part) */
    }
    free(kt_all);
    free(vt_all);
    free(first_tile);
    return failed;
}
