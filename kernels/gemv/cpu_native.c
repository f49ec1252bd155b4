/* A matrix-vector product for the CPU, in C: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the one or two rows of
 * x of a batch-1 or batch-2 decode step, W in fp32 or bf16, stored as nn.Linear stores it.
 *
 * At decode time a linear layer is bound by reading W: 2 FLOPs per weight, and a weight read from memory
 * costs far more than two FLOPs. So the whole game is streaming W at the memory's speed. Every thread takes a
 * contiguous range of output rows, reads those rows of W front to back exactly once, FOUR rows at a time (so
 * each vector of x, loaded once, serves four dot products and four independent FMA chains keep the core
 * busy), with the partial sums in vector registers until the row ends:
 *
 *     thread 0: rows 0, 1, 2, 3 | 4, 5, 6, 7 | ...     acc_i += W[n + i, k : k + V] * x[k : k + V]   (V lanes)
 *     thread 1: rows N/T ...                            y[n + i] = sum of acc_i's lanes (+ bias)
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
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define ROWS 4  /* weight rows per pass: one load of x serves four dot products */
#define PREFETCH_BYTES 4096  /* past the next pass's position: measured 1.1x on one core (0 and 1024 alike) */

static inline float widen_bf16(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float weight_at(int bf16, const void *w, int64_t i) {
    return bf16 ? widen_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__)
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef LANES
/* Ask for the next pass's four rows, PREFETCH_BYTES ahead of where this pass reads (`at`: row 0 of this pass at
 * the current k; `row_bytes`: K times the weight's size). One prefetch per row and step: the hardware
 * prefetcher alone left bf16 weights at 6.6 GB/s on one core of an Intel Xeon (Sapphire Rapids), 10-13 with
 * these; fp32 streamed 11 either way. */
static inline void prefetch_next_pass(const char *at, int64_t row_bytes) {
    for (int i = ROWS; i < 2 * ROWS; i++) _mm_prefetch(at + i * row_bytes + PREFETCH_BYTES, _MM_HINT_T0);
}

/* Four rows of W (starting at row n) times one row of x: sums of the whole vectors of K into s[0..3];
 * returns where the tail (K not a multiple of LANES) begins. */
static inline int64_t four_rows(int bf16, const void *w, int64_t n, const float *x, int64_t K, float *s) {
    vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    int64_t k = 0;
    if (bf16) {
        const uint16_t *r = (const uint16_t *)w + n * K;
        for (; k + LANES <= K; k += LANES) {
            prefetch_next_pass((const char *)(r + k), K * 2);
            vec xv = vload(x + k);
            a0 = vfma(vload_bf16(r + k), xv, a0);
            a1 = vfma(vload_bf16(r + K + k), xv, a1);
            a2 = vfma(vload_bf16(r + 2 * K + k), xv, a2);
            a3 = vfma(vload_bf16(r + 3 * K + k), xv, a3);
        }
    } else {
        const float *r = (const float *)w + n * K;
        for (; k + LANES <= K; k += LANES) {
            prefetch_next_pass((const char *)(r + k), K * 4);
            vec xv = vload(x + k);
            a0 = vfma(vload(r + k), xv, a0);
            a1 = vfma(vload(r + K + k), xv, a1);
            a2 = vfma(vload(r + 2 * K + k), xv, a2);
            a3 = vfma(vload(r + 3 * K + k), xv, a3);
        }
    }
    s[0] = vsum(a0), s[1] = vsum(a1), s[2] = vsum(a2), s[3] = vsum(a3);
    return k;
}
#else
static inline int64_t four_rows(int bf16, const void *w, int64_t n, const float *x, int64_t K, float *s) {
    for (int i = 0; i < ROWS; i++) {
        float t = 0.0f;
        for (int64_t k = 0; k < K; k++) t += weight_at(bf16, w, (n + i) * K + k) * x[k];
        s[i] = t;
    }
    return K;
}
#endif

void servelab_gemv(int bf16, const float *x, int64_t M, int64_t K, const void *w, const float *bias, int64_t N,
                   float *y) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += ROWS) {
        int rows = N - n < ROWS ? (int)(N - n) : ROWS;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float s[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
            int64_t tail = rows == ROWS ? four_rows(bf16, w, n, xm, K, s) : 0;  /* the last rows: one by one */
            for (int i = 0; i < rows; i++) {
                float t = s[i];
                for (int64_t k = tail; k < K; k++) t += weight_at(bf16, w, (n + i) * K + k) * xm[k];
                y[m * N + n + i] = t + (bias ? bias[n + i] : 0.0f);
            }
        }
    }
}
