/* What the CPU kernels (kernels/<op>/cpu_native.c) share: bf16 widening, a vectorizable exp, and a thin layer
 * over the vector registers, so that a kernel is written once for AVX-512 (16 fp32 lanes) and AVX2 (8 lanes).
 *
 *     vec            one register of LANES fp32 values (LANES undefined: no vector build, plain C only)
 *     vload/vstore   fp32 from/to memory;  vload_bf16: LANES bf16 widened to fp32;  vload_int8: int8 to fp32
 *     vzero, vset1   all zeros, one value in every lane
 *     vmul, vfma     a * b;  a * b + c (one rounding);  vadd, vsub, vmax: lane by lane
 *     vexp           exp_clamped on every lane;  vmax_all: the largest lane;  vdiv: a / b
 *     vround_bf16    each lane rounded to bf16 (as fp32);  vstore_bf16: LANES rounded values stored as bf16
 *     vsum           the LANES values added together (a horizontal sum);  vsum4: four of them at once, as __m128
 *
 * Scalar helpers beside them: widen_bf16 / to_bf16 (bf16 <-> fp32, rounding as torch does), value_at (fp32 or bf16
 * element as fp32), exp_clamped.
 *
 * Which set is built depends on the compiler flags (kernels/toolchain.py c_flags). A kernel includes this file
 * as "../cpu_vectors.h"; the compiled library's cache key covers the header too (toolchain.build_c_library).
 */
#ifndef SERVELAB_CPU_VECTORS_H
#define SERVELAB_CPU_VECTORS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* A bf16 is the top half of an fp32: put its 16 bits on top, zeros below. */
static inline float widen_bf16(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The nearest bf16 to f, ties to even (torch's rounding): its top 16 bits after rounding. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of an fp32 array, or of a bf16 one widened (bf16 = 1): the scalar loads of kernels that take either. */
static inline float value_at(int bf16, const void *p, int64_t i) {
    return bf16 ? widen_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* e^x, written so that a loop of it vectorizes: libm's expf is one call per value, which made a softmax over
 * ~1,000 scores per head, or SiLU over every element of a prefill, slower than torch's vectorized exp. Cephes'
 * method: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, 2^n put into the exponent bits; x
 * clamped to [-87, 88] (e^-87 and e^88 are still normal floats; a softmax weight or a SiLU gate beyond them is
 * 0 or x anyway). Relative error about 1e-7, fp32's own rounding. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x;  /* (not fminf/fmaxf: their NaN rules keep GCC from vectorizing the loop) */
    x = x > 88.0f ? 88.0f : x;
    float n = rintf(x * 1.44269504088896341f);  /* x / ln2, to the nearest integer */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* x - n ln2, ln2 split in two for precision */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n as a float: -126 <= n <= 127 here */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vload_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline vec vload_int8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline float vmax_all(vec v) { return _mm512_reduce_max_ps(v); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
/* Every lane rounded to the nearest bf16 (ties to even, torch's rounding), still as fp32 */
static inline vec vround_bf16(vec x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* The top halves of LANES fp32 values (already rounded: vround_bf16) stored as LANES bf16 */
static inline void vstore_bf16(uint16_t *p, vec x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}
/* exp_clamped on every lane (the same method and constants) */
static inline vec vexp(vec x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vec r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    vec p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
/* The sums of four vectors at once, [sum a, sum b, sum c, sum d]: 10 shuffles and adds where four vsum's take 24.
 * Within each 128-bit lane, pairs first (unpack), then the four (shuffle), then the lanes added together. */
static inline __m128 vsum4(vec a, vec b, vec c, vec d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  /* a0+a2 b0+b2 a1+a3 b1+b3 */
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  /* a b c d of each lane */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vload_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline vec vload_int8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline float vmax_all(vec v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vround_bf16(vec x) {  /* as in the AVX-512 build */
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void vstore_bf16(uint16_t *p, vec x) {
    __m256i top = _mm256_srli_epi32(_mm256_castps_si256(x), 16);  /* 8 values of 16 bits, in 32-bit lanes */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
static inline vec vexp(vec x) {  /* as in the AVX-512 build */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    vec n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vec r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    vec p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline __m128 vsum4(vec a, vec b, vec c, vec d) {  /* as in the AVX-512 build, over two 128-bit lanes */
    __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

#endif
