/* A fused dequantize-and-multiply for the CPU, in C: y[M, N] = x[M, K] @ dequantize(W)^T.
 *
 * The Triton kernel's idea (triton.py) written for a CPU core, the way llama.cpp does it: stream each weight
 * row once, never build a float weight, and let integer dot-product instructions do the multiplying. To
 * multiply integers by integers, x is first rounded to int8 in blocks of 32 inputs, each block with its own
 * scale (once per call, a few microseconds; llama.cpp's "Q8" activations):
 *
 *     x[k] ~ qx[k] * sx[b]          qx in -127..127, sx[b] = max |x| over block b / 127
 *
 *     y[m, n] = sum_g s[n, g] * ( sum_{b in g} sx[b] * sum_{k in b} q[n, k] * qx[k]   -   z[n, g] * xs[g] )
 *                                                     \__ exact, in int32 ___/               xs[g] = sum_{k in g} qx[k] * sx[b]
 *
 * which is exactly dequantize(W) @ x_rounded (int8 is symmetric: z = 0). So the kernel's oracle is the
 * reference applied to the rounded x (``round_activations`` in cpu_native.py); against the unrounded x the
 * difference is the rounding of x, about 1/254 of each block's largest |x| per input.
 *
 * The weight bytes are read as they are stored (kernels/quant_matmul/reference.py): int8 [N, K], or int4 two
 * to a byte, the even input k in the low nibble and k + 1 in the high one. Nibbles come out of a byte as
 * (even, odd) pairs, so for int4 the rounded x is reordered once per call, block by block, into that order:
 *
 *     qx block:   x0 x1 x2 ... x31     ->   x0 x2 ... x30 | x1 x3 ... x31   (evens, then odds)
 *
 * AVX2 handles 32 weights per step with one "multiply bytes, add pairs" instruction (vpmaddubsw: unsigned
 * times signed bytes -> 16-bit pair sums; int4 values are 0..15, int8 weights are made unsigned by moving
 * their sign onto x), one "add pairs again" (vpmaddwd -> 8 int32 sums), one convert and one FMA with the
 * block's scale. Without AVX2 the plain C loops below do the same integer arithmetic. The rows n are split
 * between threads with OpenMP: torch's OpenMP runtime is already in the process (the same library name), so
 * both share one pool of threads.
 *
 * Contract (checked in Python before the call): K and G multiples of BLOCK, G divides K, x and y fp32 and
 * contiguous, scales/zeros fp32 [N or 1, K / G] with `scale_row_stride` K / G (or 0 for one per-tensor pair).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define BLOCK 32     /* inputs per activation scale, and per inner step: 16 int4 bytes or 32 int8 bytes */
#define QX_MAX 127   /* x rounds to -127..127, so +x and -x round to +q and -q */
#define CACHE_LINE 64
#define NEXT_PASS 4  /* four rows a pass: the next pass's rows are prefetched at the offset this pass reads */
#define PREFETCH_BYTES 1024  /* one row at a time: this far ahead in the row (5-15 % faster on one core) */
/* An int8 step of ONE row of x reads W one row after another (row_dot: a single front-to-back stream, two FMA
 * chains): on 2 cores of an AMD EPYC (Zen 4) over SmolLM2's 120 decoder matrices, 4.1-4.7 ms against 6.4-7.0 for
 * the four-row passes (1.5x; one core 1.65-1.85x), medians of 31 interleaved passes. int4, whose unpacking makes
 * each row's chain longer, keeps the four-row passes: there the two were level (1.0-1.1x) on the EPYC, and one row
 * at a time was chain-bound on the Intel Xeon (four_row_dots' comment). */
#define ONE_ROW_STREAMS(bits, M) ((bits) == 8 && (M) == 1)

/* ---- the x side, once per call ------------------------------------------------------------------ */

/* Rounded x of one row: qx[K] int8, sx[K / BLOCK] scales, xs[K / G] the rounded x's group sums. For int4
 * (nibble_order) each block's qx is stored evens first, then odds. */
static void round_row(const float *x, int64_t K, int64_t G, int nibble_order, int8_t *qx, float *sx, float *xs) {
    for (int64_t g = 0; g < K / G; g++) xs[g] = 0.0f;
    for (int64_t b = 0; b < K; b += BLOCK) {
        float amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) amax = fmaxf(amax, fabsf(x[b + j]));
        float scale = amax / QX_MAX, inv = amax > 0.0f ? QX_MAX / amax : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            int8_t q = (int8_t)lrintf(x[b + j] * inv);
            int slot = nibble_order ? (j % 2) * (BLOCK / 2) + j / 2 : j;
            qx[b + slot] = q;
            sum += q;
        }
        sx[b / BLOCK] = scale;
        xs[b / G] += scale * (float)sum;
    }
}

/* ---- one row's dot product over all groups -------------------------------------------------------- */

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 unsigned bytes times 32 signed bytes -> 8 int32 sums of 4 products each, as floats. With AVX-512 VNNI
 * one instruction (vpdpbusd) does what vpmaddubsw + vpmaddwd do; the sums are the same integers. */
static inline __m256 dot32(__m256i w_u8, __m256i x_s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w_u8, x_s8));
#endif
    __m256i pairs = _mm256_maddubs_epi16(w_u8, x_s8);                 /* 16 x int16, |.| <= 2 * 127 * 127 */
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* The 32 weights of one block as unsigned bytes, in the order the x block was stored in. int4: the 16
 * bytes are loaded into both 128-bit halves, the upper half shifted right by 4 bits, and the whole masked
 * to 4 bits: [low nibbles = evens | high nibbles = odds] in three instructions. int8: the weights' signs
 * move onto x (vpsignb), so w stays unsigned. */
static inline __m256 block_dot(int bits, const uint8_t *q, const int8_t *qx) {
    __m256i x = _mm256_loadu_si256((const __m256i *)qx);
    if (bits == 4) {
        __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
        __m256i w = _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
        return dot32(w, x);                                               /* [evens | odds] . [evens | odds] */
    }
    __m256i w = _mm256_loadu_si256((const __m256i *)q);
    return dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* sum_g s[g] * z[g] * xs[g], 8 groups at a time: the zero points' share of one output. */
static inline float zero_term(const float *s, const float *z, const float *xs, int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + g), _mm256_loadu_ps(z + g)), _mm256_loadu_ps(xs + g), acc);
    float total = hsum256(acc);
    for (; g < groups; g++) total += s[g] * z[g] * xs[g];
    return total;
}

/* One output. Inside a group, each block's sum is scaled by its x scale (two FMA chains, two blocks per
 * step); the group's weight scale multiplies once per group. With groups of one block (GGUF's Q8_0 and
 * Q4_1) the two scales fold into one multiplier per block instead. `bits` is a constant at every call
 * site, so the compiler builds one copy of this loop for int4 and one for int8. */
static inline __attribute__((always_inline)) float row_dot(int bits, const uint8_t *qrow, const int8_t *qx,
        const float *sx, const float *xs, const float *s, const float *z, int64_t K, int64_t G) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t bytes_per_block = bits == 4 ? BLOCK / 2 : BLOCK;
    if (G == BLOCK) {
        for (int64_t i = 0; i < K / BLOCK; i += 2) {
            const uint8_t *qb = qrow + i * bytes_per_block;
            _mm_prefetch((const char *)qb + PREFETCH_BYTES, _MM_HINT_T0);  /* a few rows ahead: the stream never waits */
            acc0 = _mm256_fmadd_ps(block_dot(bits, qb, qx + i * BLOCK), _mm256_set1_ps(s[i] * sx[i]), acc0);
            if (i + 1 < K / BLOCK)
                acc1 = _mm256_fmadd_ps(block_dot(bits, qb + bytes_per_block, qx + (i + 1) * BLOCK),
                                       _mm256_set1_ps(s[i + 1] * sx[i + 1]), acc1);
        }
    } else {
        for (int64_t g = 0; g < K / G; g++) {
            __m256 g0 = _mm256_setzero_ps(), g1 = _mm256_setzero_ps();
            for (int64_t b = g * G; b < (g + 1) * G; b += 2 * BLOCK) {
                const uint8_t *qb = qrow + b / BLOCK * bytes_per_block;
                _mm_prefetch((const char *)qb + PREFETCH_BYTES, _MM_HINT_T0);
                g0 = _mm256_fmadd_ps(block_dot(bits, qb, qx + b), _mm256_broadcast_ss(sx + b / BLOCK), g0);
                if (b + BLOCK < (g + 1) * G)
                    g1 = _mm256_fmadd_ps(block_dot(bits, qb + bytes_per_block, qx + b + BLOCK),
                                         _mm256_broadcast_ss(sx + b / BLOCK + 1), g1);
            }
            acc0 = _mm256_fmadd_ps(_mm256_add_ps(g0, g1), _mm256_set1_ps(s[g]), acc0);
        }
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) - (z ? zero_term(s, z, xs, K / G) : 0.0f);
}

/* Four outputs at once (rows n .. n+3): the same sums as row_dot, with one accumulator per row. One row at a time,
 * each output was a chain of dependent FMAs ending in two horizontal sums, and the core waited on the chain:
 * int4 decode rows streamed only ~6 G weights/s on one core of an Intel Xeon (Sapphire Rapids). Four independent
 * chains keep it busy, and each x block, loaded once, serves four rows. `q` is row n's bytes, `row_bytes` apart;
 * `s`, `z` row n's scales and zeros, `srow` apart (0: one per-tensor pair for every row). */
static inline __attribute__((always_inline)) void four_row_dots(int bits, const uint8_t *q, int64_t row_bytes,
        const int8_t *qx, const float *sx, const float *xs, const float *s, const float *z, int64_t srow, int64_t K,
        int64_t G, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t bytes_per_block = bits == 4 ? BLOCK / 2 : BLOCK;
    if (G == BLOCK) {
        for (int64_t i = 0; i < K / BLOCK; i++) {
            const uint8_t *qb = q + i * bytes_per_block;
            for (int r = 0; r < 4; r++) {
                if ((i * bytes_per_block) % CACHE_LINE == 0)  /* once per line and row: more only took issue slots */
                    __builtin_prefetch((const char *)(qb + (NEXT_PASS + r) * row_bytes), 0, 3);
                acc[r] = _mm256_fmadd_ps(block_dot(bits, qb + r * row_bytes, qx + i * BLOCK),
                                         _mm256_set1_ps(s[r * srow + i] * sx[i]), acc[r]);
            }
        }
    } else {
        for (int64_t g = 0; g < K / G; g++) {
            __m256 part[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t b = g * G; b < (g + 1) * G; b += BLOCK) {
                const uint8_t *qb = q + b / BLOCK * bytes_per_block;
                __m256 xscale = _mm256_broadcast_ss(sx + b / BLOCK);
                for (int r = 0; r < 4; r++) {
                    if ((b / BLOCK * bytes_per_block) % CACHE_LINE == 0)
                        __builtin_prefetch((const char *)(qb + (NEXT_PASS + r) * row_bytes), 0, 3);
                    part[r] = _mm256_fmadd_ps(block_dot(bits, qb + r * row_bytes, qx + b), xscale, part[r]);
                }
            }
            for (int r = 0; r < 4; r++) acc[r] = _mm256_fmadd_ps(part[r], _mm256_set1_ps(s[r * srow + g]), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++)
        out[r] = hsum256(acc[r]) - (z ? zero_term(s + r * srow, z + r * srow, xs, K / G) : 0.0f);
}
#define HAVE_FOUR_ROWS 1

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* int4 with AVX-512 VNNI: TWO blocks (64 weights) per 512-bit vpdpbusd, where the 256-bit one takes 32. The 32
 * bytes of blocks i and i+1 are spread over the four 128-bit lanes as [block i | block i | block i+1 | block i+1],
 * lanes 1 and 3 shifted right by 4 bits, the whole masked to 4 bits: [evens | odds | evens | odds], the order in
 * which the two x blocks lie. Sums 0-7 are block i's and 8-15 block i+1's, so each half has its own scale. */
static inline __m512i int4_pair(const uint8_t *q) {
    const __m512i spread = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    __m512i v = _mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q)));
    return _mm512_and_si512(_mm512_srlv_epi64(v, shifts), _mm512_set1_epi8(0x0F));
}

static inline __m512 halves(float lo, float hi) {  /* [lo x 8 | hi x 8] */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(lo)),
                                               _mm256_castps_pd(_mm256_set1_ps(hi)), 1));
}

static inline __m512 pair_dot(const uint8_t *q, __m512i x) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), int4_pair(q), x));
}

/* four_row_dots for int4 when the blocks come in pairs (K / BLOCK even, and groups of one block or of an even
 * number of them): the same sums, two blocks a step. On one core of an Intel Xeon (Sapphire Rapids), 60 int4
 * weights of [3072, 576] (66 MB), best of 12: 18.4 -> 19.6 G weights/s with groups of 64, 16.0 -> 17.2 with GGUF's
 * blocks of 32; the stream is then near the core's memory bandwidth (about 13 GB/s), so half the instructions buy
 * only 6-7 % here, more where a core has more bandwidth. */
static inline void four_row_dots_int4_pairs(const uint8_t *q, int64_t row_bytes, const int8_t *qx, const float *sx,
        const float *xs, const float *s, const float *z, int64_t srow, int64_t K, int64_t G, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t pair_bytes = BLOCK;  /* two blocks of 16 bytes */
    int64_t groups = G == BLOCK ? 1 : K / G;  /* one-block groups: the weight scales go in per block, below */
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int64_t first = G == BLOCK ? 0 : g * G / BLOCK, last = G == BLOCK ? K / BLOCK : (g + 1) * G / BLOCK;
        for (int64_t i = first; i < last; i += 2) {  /* blocks i and i + 1 */
            const uint8_t *qb = q + i / 2 * pair_bytes;
            __m512i x = _mm512_loadu_si512((const void *)(qx + i * BLOCK));
            __m512 xscale = halves(sx[i], sx[i + 1]);
            for (int r = 0; r < 4; r++) {
                if ((i / 2 * pair_bytes) % CACHE_LINE == 0)
                    __builtin_prefetch((const char *)(qb + (NEXT_PASS + r) * row_bytes), 0, 3);
                __m512 scale = G == BLOCK ? _mm512_mul_ps(xscale, halves(s[r * srow + i], s[r * srow + i + 1])) : xscale;
                part[r] = _mm512_fmadd_ps(pair_dot(qb + r * row_bytes, x), scale, part[r]);
            }
        }
        for (int r = 0; r < 4; r++)
            acc[r] = G == BLOCK ? part[r] : _mm512_fmadd_ps(part[r], _mm512_set1_ps(s[r * srow + g]), acc[r]);
    }
    for (int r = 0; r < 4; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]) - (z ? zero_term(s + r * srow, z + r * srow, xs, K / G) : 0.0f);
}
#define HAVE_INT4_PAIRS 1
#endif
#else
/* The same integer sums, one weight at a time (CPUs without AVX2, or another architecture). */
static float row_dot(int bits, const uint8_t *qrow, const int8_t *qx, const float *sx, const float *xs,
                     const float *s, const float *z, int64_t K, int64_t G) {
    float total = 0.0f;
    for (int64_t g = 0; g < K / G; g++) {
        for (int64_t b = g * G; b < (g + 1) * G; b += BLOCK) {
            int32_t isum = 0;
            for (int j = 0; j < BLOCK; j++) {
                int w;
                if (bits == 4) {  /* qx is in nibble order: slot j < 16 is input 2j's, the rest input 2(j-16)+1's */
                    uint8_t byte = qrow[(b + 2 * (j % (BLOCK / 2))) / 2];
                    w = j < BLOCK / 2 ? byte & 0x0F : byte >> 4;
                } else {
                    w = ((const int8_t *)qrow)[b + j];
                }
                isum += w * qx[b + j];
            }
            total += s[g] * sx[b / BLOCK] * (float)isum;
        }
        if (z) total -= s[g] * z[g] * xs[g];
    }
    return total;
}
#endif

/* ---- the entry points --------------------------------------------------------------------------- */

/* y[M, N] = round(x)[M, K] @ dequantize(q)^T for bits 4 (zeros given) or 8 (zeros NULL).
 * Returns 0, or -1 if scratch memory could not be allocated (y is then untouched). */
int servelab_quant_matmul(int bits, const float *x, int64_t M, int64_t K, const void *qweight,
                          const float *scales, const float *zeros, int64_t scale_row_stride,
                          int64_t G, int64_t N, float *y) {
    int64_t groups = K / G, blocks = K / BLOCK, row_bytes = bits == 4 ? K / 2 : K;
    int8_t *qx = malloc((size_t)(M * K));
    float *sx = malloc(sizeof(float) * M * blocks), *xs = malloc(sizeof(float) * M * groups);
    if (!qx || !sx || !xs) { free(qx); free(sx); free(xs); return -1; }
    for (int64_t m = 0; m < M; m++)
        round_row(x + m * K, K, G, bits == 4, qx + m * K, sx + m * blocks, xs + m * groups);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += 4) {  /* four rows at a time where the CPU has AVX2; the last ones one by one */
        int64_t first_single = n;
#ifdef HAVE_FOUR_ROWS
        if (n + 4 <= N && !ONE_ROW_STREAMS(bits, M)) {
            const uint8_t *qrow = (const uint8_t *)qweight + n * row_bytes;  /* read once, reused for every m */
            const float *s = scales + n * scale_row_stride, *z = zeros ? zeros + n * scale_row_stride : NULL;
            for (int64_t m = 0; m < M; m++) {
                float out[4];
#ifdef HAVE_INT4_PAIRS
                if (bits == 4 && blocks % 2 == 0 && (G == BLOCK || (G / BLOCK) % 2 == 0))
                    four_row_dots_int4_pairs(qrow, row_bytes, qx + m * K, sx + m * blocks, xs + m * groups, s, z,
                                             scale_row_stride, K, G, out);
                else
#endif
                if (bits == 4)
                    four_row_dots(4, qrow, row_bytes, qx + m * K, sx + m * blocks, xs + m * groups, s, z,
                                  scale_row_stride, K, G, out);
                else
                    four_row_dots(8, qrow, row_bytes, qx + m * K, sx + m * blocks, xs + m * groups, s, z,
                                  scale_row_stride, K, G, out);
                for (int r = 0; r < 4; r++) y[m * N + n + r] = out[r];
            }
            first_single = n + 4;
        }
#endif
        for (int64_t r = first_single; r < n + 4 && r < N; r++) {
            const uint8_t *qrow = (const uint8_t *)qweight + r * row_bytes;
            const float *s = scales + r * scale_row_stride, *z = zeros ? zeros + r * scale_row_stride : NULL;
            for (int64_t m = 0; m < M; m++)
                y[m * N + r] = bits == 4 ? row_dot(4, qrow, qx + m * K, sx + m * blocks, xs + m * groups, s, z, K, G)
                                         : row_dot(8, qrow, qx + m * K, sx + m * blocks, xs + m * groups, s, z, K, G);
        }
    }
    free(qx); free(sx); free(xs);
    return 0;
}

/* The rounded x the kernel multiplies by, in natural order (for tests and for the oracle). */
void servelab_round_activations(const float *x, int64_t M, int64_t K, float *out) {
    int8_t qx[BLOCK];
    float sx, xs;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K; b += BLOCK) {
            round_row(x + m * K + b, BLOCK, BLOCK, 0, qx, &sx, &xs);
            for (int j = 0; j < BLOCK; j++) out[m * K + b + j] = (float)qx[j] * sx;
        }
}

/* w[N, K] = dequantize(q): for many rows of x a float GEMM beats the fused kernel, so the caller
 * dequantizes once per call and hands w to torch's matmul. */
void servelab_dequantize(int bits, const void *qweight, const float *scales, const float *zeros,
                         int64_t scale_row_stride, int64_t G, int64_t N, int64_t K, float *w) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *s = scales + n * scale_row_stride, *z = zeros ? zeros + n * scale_row_stride : NULL;
        for (int64_t g = 0; g < K / G; g++) {  /* one scale (and zero) per group: the inner loop vectorizes */
            float sg = s[g], zg = z ? z[g] : 0.0f, *out = w + n * K + g * G;
            if (bits == 8) {
                const int8_t *q = (const int8_t *)qweight + n * K + g * G;
                for (int64_t k = 0; k < G; k++) out[k] = (float)q[k] * sg;
            } else {
                const uint8_t *q = (const uint8_t *)qweight + (n * K + g * G) / 2;
                for (int64_t j = 0; j < G / 2; j++) {
                    out[2 * j] = ((float)(q[j] & 0x0F) - zg) * sg;
                    out[2 * j + 1] = ((float)(q[j] >> 4) - zg) * sg;
                }
            }
        }
    }
}
