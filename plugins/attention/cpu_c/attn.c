/* Decode attention over the paged KV pool for CPUs (plugins/attention/cpu_c).
 * One work item per (request, KV head): its G query heads' scores over the request's slots in
 * fp32, a max-subtracted softmax, then the weighted sum of V rows, read straight from the pool
 * (fp32 or bf16 rows). Rows a few slots ahead are prefetched: a request's slots are runs of
 * consecutive rows interleaved with decode-time ones, which hardware prefetchers follow poorly.
 * AVX-512 builds take explicit vector loops for head dims 64 and 128 (scores16 / values16: a
 * key row loaded once for its G query heads, each head's V accumulators in registers over the
 * whole range; 3x the auto-vectorized loops at batch 1 and 16 on a 2-core AVX-512 VM); other
 * builds and head dims keep the portable loops. Both sum in a fixed order. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define AHEAD 4

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 elements of a K / V row from element `off` on, as fp32 (bf16 widened exactly) */
static inline __m512 ld16f(const void *row, int bf, int64_t off) {
    if (bf) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + off);
}

/* Scores of keys [0, n) of one item: sc[i * n + j] = qs_i . K_j (fp32, fixed lane order), the
 * row max per query head in mx. NC = D / 16 vectors a row (a constant at each call site). */
static inline __attribute__((always_inline)) void scores16(
    const float *qs, const void *kb, int bf, const int64_t *sl, int64_t lo, int64_t n,
    int64_t Hkv, int64_t g, int64_t G, int NC, float cap, float *sc, float *mx) {
    const size_t esz = bf ? 2 : 4;
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n)
            __builtin_prefetch((const char *)kb +
                               ((sl[lo + j + AHEAD] * Hkv + g) * NC * 16) * esz);
        const int64_t row = (sl[lo + j] * Hkv + g) * NC * 16;
        const void *kr = bf ? (const void *)((const uint16_t *)kb + row)
                            : (const void *)((const float *)kb + row);
        __m512 k[8];
        for (int c = 0; c < NC; c++) k[c] = ld16f(kr, bf, 16 * c);
        for (int64_t i = 0; i < G; i++) {
            const float *qi = qs + i * NC * 16;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qi), k[0]);
            for (int c = 1; c < NC; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), k[c], a);
            float v = _mm512_reduce_add_ps(a);
            if (cap > 0.0f) v = cap * tanhf(v / cap);
            sc[i * n + j] = v;
            if (v > mx[i]) mx[i] = v;
        }
    }
}

/* acc[i * Dv + d] = sum_j p[i * n + j] * V_j[d] for keys [0, n) of one item, each query head's
 * accumulators in registers over the whole range (NC = Dv / 16, a constant at each call site) */
static inline __attribute__((always_inline)) void values16(
    const float *p, const void *vb, int bf, const int64_t *sl, int64_t lo, int64_t n,
    int64_t Hkv, int64_t g, int64_t G, int NC, float *acc) {
    const size_t esz = bf ? 2 : 4;
    for (int64_t i = 0; i < G; i++) {
        __m512 a[8];
        for (int c = 0; c < NC; c++) a[c] = _mm512_setzero_ps();
        const float *pi = p + i * n;
        for (int64_t j = 0; j < n; j++) {
            if (i == 0 && j + AHEAD < n)
                __builtin_prefetch((const char *)vb +
                                   ((sl[lo + j + AHEAD] * Hkv + g) * NC * 16) * esz);
            const int64_t row = (sl[lo + j] * Hkv + g) * NC * 16;
            const void *vr = bf ? (const void *)((const uint16_t *)vb + row)
                                : (const void *)((const float *)vb + row);
            const __m512 w = _mm512_set1_ps(pi[j]);
            for (int c = 0; c < NC; c++) a[c] = _mm512_fmadd_ps(w, ld16f(vr, bf, 16 * c), a[c]);
        }
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + i * NC * 16 + 16 * c, a[c]);
    }
}
#endif

/* e^x for x <= 0 (scores minus their max), in a form the compiler vectorizes: 2^n * e^r with
 * n = round(x / ln 2), r reduced in two steps, e^r by a degree-6 polynomial (Cephes expf's
 * coefficients); relative error ~1e-7, like expf. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* Row j of head g among n cached rows (slots sl[0..n)) of a [S, Hkv, W] cache, as fp32: the
 * cache itself for fp32, else the bf16 row widened once into buf (for all G query heads); the
 * row AHEAD places on is prefetched. The portable loops' fetch, for K and V alike. */
static inline const float *cache_row(const void *base, int bf, size_t esz, const int64_t *sl,
                                     int64_t j, int64_t n, int64_t Hkv, int64_t g, int64_t W,
                                     float *buf) {
    if (j + AHEAD < n)
        __builtin_prefetch((const char *)base + ((sl[j + AHEAD] * Hkv + g) * W) * esz);
    const int64_t row = (sl[j] * Hkv + g) * W;
    if (!bf) return (const float *)base + row;
    const uint16_t *r = (const uint16_t *)base + row;
#pragma omp simd
    for (int64_t d = 0; d < W; d++) buf[d] = bf2f(r[d]);
    return buf;
}

/* q [B, H, D] fp32 (q_bf 0) or bf16 (1); kb [S, Hkv, D], vb [S, Hkv, Dv]; slots [B, ss] int64;
 * seq_lens [B]; window > 0 keeps the last `window` keys; cap > 0 soft-caps scores;
 * out [B, H, Dv] fp32 (out_bf 0) or bf16 (1, rounded to nearest even as torch does).
 * Returns 0, or -2 when out of memory. */
int ca_decode(const void *q, int q_bf, const void *kb, const void *vb, int bf,
              const int64_t *slots, int64_t ss, const int64_t *seq_lens, int64_t B, int64_t H,
              int64_t Hkv, int64_t D, int64_t Dv, float scale, int64_t window, float cap,
              void *out, int out_bf, int nthreads) {
    const int64_t G = H / Hkv;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += seq_lens[b];
    int failed = 0;
    const size_t esz = bf ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (work * H * D >= 32768)
    for (int64_t it = 0; it < B * Hkv; it++) {
        const int64_t b = it / Hkv, g = it % Hkv;
        const int64_t L = seq_lens[b];
        const int64_t lo = window > 0 && L > window ? L - window : 0;
        const int64_t n = L - lo;
        const int64_t *sl = slots + b * ss;
        const int64_t wmax = D > Dv ? D : Dv;
        float *sc = (float *)malloc(sizeof(float) *
                                    (size_t)(G * (n > 0 ? n : 1) + G * D + G * Dv + wmax));
        if (!sc) { failed = 1; continue; }
        float *qs = sc + G * (n > 0 ? n : 1), *acc = qs + G * D, *krow = acc + G * Dv;
        for (int64_t i = 0; i < G; i++)
            for (int64_t d = 0; d < D; d++)
                qs[i * D + d] = ld(q, q_bf, (b * H + g * G + i) * D + d) * scale;
        float mx[64], den[64];
        float *mxp = G <= 64 ? mx : (float *)malloc(sizeof(float) * 2 * (size_t)G);
        float *denp = G <= 64 ? den : mxp + G;
        for (int64_t i = 0; i < G; i++) { mxp[i] = -INFINITY; denp[i] = 0.0f; }
#if defined(__AVX512F__)
        const int vec = (D == 64 || D == 128) && Dv == D;
        if (vec && D == 64) scores16(qs, kb, bf, sl, lo, n, Hkv, g, G, 4, cap, sc, mxp);
        else if (vec) scores16(qs, kb, bf, sl, lo, n, Hkv, g, G, 8, cap, sc, mxp);
#else
        const int vec = 0;
#endif
        if (!vec) {  /* the portable loops */
            for (int64_t j = 0; j < n; j++) {
                const float *k = cache_row(kb, bf, esz, sl + lo, j, n, Hkv, g, D, krow);
                for (int64_t i = 0; i < G; i++) {
                    float a = 0.0f;
                    const float *qi = qs + i * D;
                    /* simd reduction: the compiler's vector order, the same on every call */
#pragma omp simd reduction(+ : a)
                    for (int64_t d = 0; d < D; d++) a += qi[d] * k[d];
                    if (cap > 0.0f) a = cap * tanhf(a / cap);
                    sc[i * n + j] = a;
                    if (a > mxp[i]) mxp[i] = a;
                }
            }
        }
        for (int64_t i = 0; i < G; i++) {
            const float m = mxp[i];
            float *si = sc + i * n, dsum = 0.0f;
            /* vectorized exp and a fixed vector sum order */
#pragma omp simd reduction(+ : dsum)
            for (int64_t j = 0; j < n; j++) {
                const float e = exp_neg(si[j] - m);
                si[j] = e;
                dsum += e;
            }
            denp[i] = dsum;
        }
        memset(acc, 0, sizeof(float) * (size_t)(G * Dv));
#if defined(__AVX512F__)
        if (vec && D == 64) values16(sc, vb, bf, sl, lo, n, Hkv, g, G, 4, acc);
        else if (vec) values16(sc, vb, bf, sl, lo, n, Hkv, g, G, 8, acc);
#endif
        if (!vec) {  /* the portable loops */
            for (int64_t j = 0; j < n; j++) {
                const float *v = cache_row(vb, bf, esz, sl + lo, j, n, Hkv, g, Dv, krow);
                for (int64_t i = 0; i < G; i++) {
                    const float p = sc[i * n + j];
                    float *ai = acc + i * Dv;
#pragma omp simd
                    for (int64_t d = 0; d < Dv; d++) ai[d] += p * v[d];
                }
            }
        }
        for (int64_t i = 0; i < G; i++) {
            const float r = denp[i] > 0.0f ? 1.0f / denp[i] : 0.0f;
            for (int64_t d = 0; d < Dv; d++)
                st(out, out_bf, (b * H + g * G + i) * Dv + d, acc[i * Dv + d] * r);
        }
        if (mxp != mx) free(mxp);
        free(sc);
    }
    return failed ? -2 : 0;
}
