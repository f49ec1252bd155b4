/* A matrix-vector product for the CPU, in C: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the few rows of x of a
 * small decode step (M up to 16 sequences), W in fp32 or bf16, stored as nn.Linear stores it.
 *
 * At decode time a linear layer is bound by reading W: 2 FLOPs per weight, and a weight read from memory
 * costs far more than two FLOPs. So the whole game is streaming W at the memory's speed. Every thread takes a
 * contiguous range of output rows, reads those rows of W front to back exactly once, FOUR rows at a time (so
 * each vector of x, loaded once, serves four dot products and four independent FMA chains keep the core
 * busy), with the partial sums in vector registers until the row ends:
 *
 *     thread 0: rows 0, 1, 2, 3 | 4, 5, 6, 7 | ...     acc_mi += W[n + i, k : k + V] * x[m, k : k + V]   (V lanes)
 *     thread 1: rows N/T ...                            y[m, n + i] = sum of acc_mi's lanes (+ bias)
 *
 * Up to four rows of x ride along (16 accumulators): each vector of W, loaded once, serves all of them, so a
 * decode step of four sequences reads W once, as a step of one does. More rows of x take further blocks of
 * four over the same W rows, which are then in L1. Measured on 2 cores of an Intel Xeon (Sapphire Rapids)
 * over SmolLM2-sized weights (425 MB fp32): 8 rows take 1.4x the time of one (27.5 against 19.5 ms), faster
 * than oneDNN's packed GEMM up to 8 rows in fp32 and bf16 (engine/packed_linear.py picks per dtype).
 *
 * One or two rows of x (batch-1 and batch-2 steps) are the exception: there each thread reads its rows of W one
 * after another, a single front-to-back stream (streamed_rows below). Four rows at a time read four places 2-6 KB
 * apart at once, which the hardware prefetcher follows less well, and with so few rows of x a shared load of x
 * saves little. Measured on 2 cores of an AMD EPYC (Zen 4, AVX-512) over SmolLM2's 120 decoder matrices (425 MB
 * fp32, 212 MB bf16), medians of 41 interleaved passes: one row 14.0 against 19.3 ms in fp32 (1.4x), 6.4 against
 * 10.6 in bf16 (1.65x); two rows 1.22-1.25x; three 1.05x; four 0.9x, so from three rows on, the four-row passes.
 *
 * bf16 weights are widened to fp32 in registers (a bf16 is the top half of an fp32: zero-extend, shift left
 * by 16), so a bf16 model reads half the bytes and computes in fp32. AVX-512 (16 lanes) or AVX2 (8 lanes)
 * where the compiler was told the CPU has them (kernels/toolchain.py c_flags), plain C loops otherwise; every
 * output is summed by one thread in one order, so the thread count does not change the result.
 *
 * Contract (checked in Python, kernels/gemv/cpu_native.py): x fp32 [M, K] contiguous; W [N, K] contiguous, fp32
 * or bf16; bias fp32 [N] or NULL; y fp32 [M, N].
 */
#include <stdint.h>
#include <string.h>

#include "../cpu_vectors.h"  /* value_at and the vector layer (vec, vload, vload_bf16, vfma, vsum, ...) */

#define ROWS 4  /* weight rows per pass: one load of x serves four dot products */
#define X_ROWS 4  /* rows of x per block: 4 x 4 accumulators, half the vector registers of AVX-512 */
/* rows of x up to which W is streamed row after row instead (streamed_rows; the header has the measurement) */
#define STREAM_MAX_ROWS 2
#define PREFETCH_BYTES 4096  /* past the next pass's position: measured 1.1x on one core (0 and 1024 alike) */

#ifdef LANES
/* Ask for the next pass's four rows, PREFETCH_BYTES ahead of where this pass reads (`at`: row 0 of this pass at
 * the current k; `row_bytes`: K times the weight's size). One prefetch per row and step: the hardware
 * prefetcher alone left bf16 weights at 6.6 GB/s on one core of an Intel Xeon (Sapphire Rapids), 10-13 with
 * these; fp32 streamed 11 either way. */
static inline void prefetch_next_pass(const char *at, int64_t row_bytes) {
    /* (__builtin_prefetch, not _mm_prefetch: inlined into rows_block's always_inline copies, GCC 12 dropped every
     * _mm_prefetch without a word, and bf16 rows fell back to the hardware prefetcher's 6.7 GB/s) */
    for (int i = ROWS; i < 2 * ROWS; i++) __builtin_prefetch(at + i * row_bytes + PREFETCH_BYTES, 0, 3);
}

/* Four rows of W (starting at row n) times MB rows of x (MB = 1..4, a compile-time constant at each call):
 * the MB x 4 sums of the whole vectors of K into s[m][0..3]; returns where the tail (K not a multiple of
 * LANES) begins. Each vector of W, loaded (and widened) once, serves MB rows of x; each vector of x serves four
 * rows of W: 16 independent FMA chains at MB = 4, so a batch of sequences costs little more than one. */
static inline __attribute__((always_inline)) int64_t rows_block(int bf16, const void *w, int64_t n, const float *x,
                                                                int64_t K, int MB, int prefetch, float s[][ROWS]) {
    vec a[4][ROWS];
    for (int m = 0; m < MB; m++)
        for (int i = 0; i < ROWS; i++) a[m][i] = vzero();
    int64_t k = 0;
    size_t size = bf16 ? 2 : 4;
    for (; k + LANES <= K; k += LANES) {
        if (prefetch) prefetch_next_pass((const char *)w + (n * K + k) * size, K * (int64_t)size);
        vec wv[ROWS];
        for (int i = 0; i < ROWS; i++)
            wv[i] = bf16 ? vload_bf16((const uint16_t *)w + (n + i) * K + k) : vload((const float *)w + (n + i) * K + k);
        for (int m = 0; m < MB; m++) {
            vec xv = vload(x + m * K + k);
            for (int i = 0; i < ROWS; i++) a[m][i] = vfma(wv[i], xv, a[m][i]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int i = 0; i < ROWS; i++) s[m][i] = vsum(a[m][i]);
    return k;
}
#else
static inline int64_t rows_block(int bf16, const void *w, int64_t n, const float *x, int64_t K, int MB, int prefetch,
                                 float s[][ROWS]) {
    (void)prefetch;
    for (int m = 0; m < MB; m++)
        for (int i = 0; i < ROWS; i++) {
            float t = 0.0f;
            for (int64_t k = 0; k < K; k++) t += value_at(bf16, w, (n + i) * K + k) * x[m * K + k];
            s[m][i] = t;
        }
    return K;
}
#endif

/* Rows m0 .. m0 + MB - 1 of y at the four columns n .. n + 3 (each a dot product of whole K, finished in the
 * tail loop). The dtype and MB become constants, so each combination is its own unrolled loop. */
static void block_outputs(int bf16, const float *x, int64_t m0, int MB, int64_t K, const void *w, const float *bias,
                          int64_t n, int64_t N, float *y) {
    float s[4][ROWS];
    int64_t tail;
#define CALL(B, R) tail = rows_block(B, w, n, x + m0 * K, K, R, m0 == 0, s)
    if (bf16) {
        if (MB == 4) CALL(1, 4); else if (MB == 3) CALL(1, 3); else if (MB == 2) CALL(1, 2); else CALL(1, 1);
    } else {
        if (MB == 4) CALL(0, 4); else if (MB == 3) CALL(0, 3); else if (MB == 2) CALL(0, 2); else CALL(0, 1);
    }
#undef CALL
    for (int m = 0; m < MB; m++)
        for (int i = 0; i < ROWS; i++) {
            float t = s[m][i];
            for (int64_t k = tail; k < K; k++) t += value_at(bf16, w, (n + i) * K + k) * x[(m0 + m) * K + k];
            y[(m0 + m) * N + n + i] = t + (bias ? bias[n + i] : 0.0f);
        }
}

#ifdef LANES
/* y[m, n] = W[n, :] . x[m, :] for the MB (1 or 2) rows of x: row n of W read front to back once, one FMA chain
 * per row of x, summed in the order rows_block sums (so an output's bits do not depend on M). */
static inline __attribute__((always_inline)) void row_dots(int bf16, const void *w, int64_t n, const float *x,
                                                          int64_t K, int MB, float *s) {
    vec a[STREAM_MAX_ROWS];
    for (int m = 0; m < MB; m++) a[m] = vzero();
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        vec wv = bf16 ? vload_bf16((const uint16_t *)w + n * K + k) : vload((const float *)w + n * K + k);
        for (int m = 0; m < MB; m++) a[m] = vfma(wv, vload(x + m * K + k), a[m]);
    }
    for (int m = 0; m < MB; m++) {
        float t = vsum(a[m]);
        for (int64_t j = k; j < K; j++) t += value_at(bf16, w, n * K + j) * x[m * K + j];
        s[m] = t;
    }
}
#else
static inline void row_dots(int bf16, const void *w, int64_t n, const float *x, int64_t K, int MB, float *s) {
    for (int m = 0; m < MB; m++) {
        float t = 0.0f;
        for (int64_t k = 0; k < K; k++) t += value_at(bf16, w, n * K + k) * x[m * K + k];
        s[m] = t;
    }
}
#endif

/* M <= STREAM_MAX_ROWS: every thread streams its contiguous range of W's rows once, front to back (the header). */
static void streamed_rows(int bf16, const float *x, int64_t M, int64_t K, const void *w, const float *bias,
                          int64_t N, float *y) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float s[STREAM_MAX_ROWS];
        if (bf16) { if (M == 2) row_dots(1, w, n, x, K, 2, s); else row_dots(1, w, n, x, K, 1, s); }
        else { if (M == 2) row_dots(0, w, n, x, K, 2, s); else row_dots(0, w, n, x, K, 1, s); }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = s[m] + (bias ? bias[n] : 0.0f);
    }
}

void servelab_gemv(int bf16, const float *x, int64_t M, int64_t K, const void *w, const float *bias, int64_t N,
                   float *y) {
    if (M <= STREAM_MAX_ROWS) {
        streamed_rows(bf16, x, M, K, w, bias, N, y);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += ROWS) {
        if (N - n < ROWS) {  /* the last rows, one by one */
            for (int64_t m = 0; m < M; m++)
                for (int64_t i = n; i < N; i++) {
                    float t = 0.0f;
                    for (int64_t k = 0; k < K; k++) t += value_at(bf16, w, i * K + k) * x[m * K + k];
                    y[m * N + i] = t + (bias ? bias[i] : 0.0f);
                }
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += X_ROWS)  /* W's four rows stay in L1 for the next x rows */
            block_outputs(bf16, x, m0, (int)(M - m0 < X_ROWS ? M - m0 : X_ROWS), K, w, bias, n, N, y);
    }
}
