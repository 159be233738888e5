/* Activation rows -> integer codes per block, for the gguf kernels (plugins/quant/gguf: kernels.c
 * and amx.c include it; plugins/_kit/cbuild.py hashes it into every build's key). */
#ifndef CORE_GQ_ACT_H
#define CORE_GQ_ACT_H
#include <math.h>
#include <stdint.h>

#include "cbf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

/* One activation row -> integer codes per block of bs (int8, |q| <= 127, or int16,
 * |q| <= 32512: `wide`), the block's scale and its code sum. */
__attribute__((unused)) static void quantize_row(const void *x, int x_bf16, int64_t K, int bs,
                                                int wide, void *q,
                         float *d, int32_t *s) {
    int64_t nb = K / bs;
    const float qmax = wide ? 32512.0f : 127.0f;  /* 32512 = 127 * 256: see split16 */
    const int lim = wide ? 32512 : 127;
    float buf[32];
    for (int64_t b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (int j = 0; j < bs; j++) {
            int64_t k = b * bs + j;
            float v = x_bf16 ? bf2f(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            buf[j] = v;
            float a = fabsf(v);
            amax = a > amax ? a : amax;
        }
        float dx = amax / qmax;
        float inv = dx > 0.0f ? 1.0f / dx : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < bs; j++) {
            int v = (int)lrintf(buf[j] * inv);
            v = v > lim ? lim : (v < -lim ? -lim : v);
            if (wide) ((int16_t *)q)[b * bs + j] = (int16_t)v;
            else ((int8_t *)q)[b * bs + j] = (int8_t)v;
            sum += v;
        }
        d[b] = dx;
        s[b] = sum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* quantize_row in vectors: the same arithmetic (|x| max, amax / qmax, one reciprocal, round to
 * nearest even as lrintf does under the default rounding mode, clamp), the same codes */
static void quantize_row_vec(const void *x, int x_bf16, int64_t K, int bs, int wide, void *q,
                             float *d, int32_t *s) {
    const int64_t nb = K / bs;
    const float qmax = wide ? 32512.0f : 127.0f;
    const __m512i lim = _mm512_set1_epi32(wide ? 32512 : 127);
    const __m512i nlim = _mm512_set1_epi32(wide ? -32512 : -127);
    const int nv = bs / 16;  /* 1 or 2 vectors a block */
    for (int64_t b = 0; b < nb; b++) {
        __m512 v[2];
        for (int i = 0; i < nv; i++) {
            const int64_t k = b * bs + 16 * i;
            if (x_bf16) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + k));
                v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            } else {
                v[i] = _mm512_loadu_ps((const float *)x + k);
            }
        }
        __m512 a = _mm512_abs_ps(v[0]);
        if (nv == 2) a = _mm512_max_ps(a, _mm512_abs_ps(v[1]));
        const float amax = _mm512_reduce_max_ps(a);
        const float dx = amax / qmax;
        const __m512 inv = _mm512_set1_ps(dx > 0.0f ? 1.0f / dx : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        for (int i = 0; i < nv; i++) {
            __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));
            c = _mm512_min_epi32(_mm512_max_epi32(c, nlim), lim);
            sum = _mm512_add_epi32(sum, c);
            const int64_t k = b * bs + 16 * i;
            if (wide) _mm256_storeu_si256((__m256i *)((int16_t *)q + k), _mm512_cvtepi32_epi16(c));
            else _mm_storeu_si128((__m128i *)((int8_t *)q + k), _mm512_cvtepi32_epi8(c));
        }
        d[b] = dx;
        s[b] = _mm512_reduce_add_epi32(sum);
    }
}
#endif

/* int16 activations on int8 hardware: q = 256 * hi + lo with hi = floor((q + 128) / 256) in
 * [-127, 127] and lo in [-128, 127] (|q| <= 32512), so sum(code * q) = 256 * sum(code * hi)
 * + sum(code * lo) exactly: two dpbusd where int8 activations take one. */
__attribute__((unused)) static void split16(const int16_t *q, int64_t n, int8_t *hi, int8_t *lo) {
    for (int64_t i = 0; i < n; i++) {
        int h = (q[i] + 128) >> 8;  /* arithmetic shift: floor */
        hi[i] = (int8_t)h;
        lo[i] = (int8_t)(q[i] - 256 * h);
    }
}
#endif
