/* Fused element-wise layer ops for CPUs (plugins/ops/cpu_c): one pass per op over fp32 or bf16
 * rows, with the reference's rounding (core/layers/ops_ref.py): sums in the compute dtype, the
 * norm in fp32 and cast back before the weight, one rounding per torch op it replaces.
 * Rows are split over OpenMP threads only when there are enough of them to pay for it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cbf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float rnd(int bf, float v) { return bf ? bf2f(f2bf(v)) : v; }

#define PAR_MIN 65536 /* elements below which a call stays on one thread */

static void norm_row(const void *x, int64_t xo, const void *w, void *y, int64_t yo, int64_t n,
                     float eps, int bf) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) {
        float v = ld(x, bf, xo + i);
        ss += (double)v * v;
    }
    float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) st(y, bf, yo + i, rnd(bf, ld(x, bf, xo + i) * r) * ld(w, bf, i));
}

/* y[T, N] = rms_norm(x) * w; x rows `xs` elements apart */
void co_rms_norm(const void *x, int64_t xs, const void *w, void *y, int64_t T, int64_t N,
                 float eps, int bf, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * N >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) norm_row(x, t * xs, w, y, t * N, N, eps, bf);
}

/* sum = x + res (rounded to the dtype), y = rms_norm(sum) * w; all [T, N] contiguous */
void co_add_rms_norm(const void *x, const void *res, const void *w, void *y, void *sum,
                     int64_t T, int64_t N, float eps, int bf, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * N >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < N; i++)
            st(sum, bf, t * N + i, ld(x, bf, t * N + i) + ld(res, bf, t * N + i));
        norm_row(sum, t * N, w, y, t * N, N, eps, bf);
    }
}

/* silu(g) * u over one row; with AVX-512 sixteen lanes at a time (expf is a call per element,
 * which made this op a fifth of a 512-token prefill): e^x as 2^n (exponent bits) times a
 * degree-6 Taylor polynomial on |r| <= ln2 / 2, relative error below 4e-7, so fp32 results
 * stay within the suite's 1e-5 and bf16 ones round as the reference's do but for ties. */
#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.3888889225e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333337680e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667908e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667163e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)),
                                  23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 load16(const void *p, int bf, int64_t i) {
    if (!bf) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* v rounded to bf16 (nearest even; a NaN stays a NaN), as fp32 */
static inline __m512 round16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(r), v);
}

static inline void store16(void *p, int bf, int64_t i, __m512 v) {
    if (!bf) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    __m512i u = _mm512_srli_epi32(_mm512_castps_si512(round16(v)), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(u));
}
#endif

static void silu_row(const void *x, void *y, int64_t t, int64_t I, int bf) {
    const int64_t xo = t * 2 * I, yo = t * I;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= I; i += 16) {
        __m512 g = load16(x, bf, xo + i), u = load16(x, bf, xo + I + i);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(),
                                                                            g))));
        if (bf) s = round16(s);
        store16(y, bf, yo + i, _mm512_mul_ps(s, u));
    }
#endif
    for (; i < I; i++) {
        float g = ld(x, bf, xo + i), u = ld(x, bf, xo + I + i);
        st(y, bf, yo + i, rnd(bf, g / (1.0f + expf(-g))) * u);
    }
}

/* y[T, I] = silu(x[:, :I]) * x[:, I:] */
void co_silu_mul(const void *x, void *y, int64_t T, int64_t I, int bf, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * I >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        silu_row(x, y, t, I, bf);
    }
}

/* q[T, nq * D], k[T, nk * D] = the first nq + nk heads of qkv (rows qs elements apart) rotated:
 * x * cos + roll(x, D / 2) * sin, with cos / sin [T, D] (sin's sign folded as
 * RotaryEmbedding.cos_sin gives it) */
static inline void rotary_head(const void *qkv, int64_t xo, const void *cs, const void *sn,
                               int64_t co, void *out, int64_t o, int64_t D, const int bf) {
    const int64_t h2 = D / 2;
#pragma omp simd
    for (int64_t d = 0; d < h2; d++) { /* first half: partner d + D / 2 */
        float a = rnd(bf, ld(qkv, bf, xo + d) * ld(cs, bf, co + d));
        st(out, bf, o + d, a + ld(qkv, bf, xo + d + h2) * ld(sn, bf, co + d));
    }
#pragma omp simd
    for (int64_t d = h2; d < D; d++) { /* second half: partner d - D / 2 */
        float a = rnd(bf, ld(qkv, bf, xo + d) * ld(cs, bf, co + d));
        st(out, bf, o + d, a + ld(qkv, bf, xo + d - h2) * ld(sn, bf, co + d));
    }
}

void co_rotary(const void *qkv, int64_t qs, const void *cs, const void *sn, void *q, void *k,
               int64_t T, int64_t nq, int64_t nk, int64_t D, int bf, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * (nq + nk) * D >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < nq + nk; h++) {
            void *out = h < nq ? q : k;
            const int64_t o = h < nq ? t * nq * D + h * D : t * nk * D + (h - nq) * D;
            if (bf) rotary_head(qkv, t * qs + h * D, cs, sn, t * D, out, o, D, 1);
            else rotary_head(qkv, t * qs + h * D, cs, sn, t * D, out, o, D, 0);
        }
    }
}

/* kb[loc[t], :kn] = k[t, :kn], vb[loc[t], :vn] = v[t, :vn], cast from src to dst dtype;
 * k / v rows ks / vs elements apart */
void co_store_kv(const void *k, int64_t ks, const void *v, int64_t vs, const int64_t *loc,
                 void *kb, void *vb, int64_t T, int64_t kn, int64_t vn, int src_bf,
                 int dst_bf) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = loc[t];
        if (src_bf == dst_bf) {
            const size_t e = src_bf ? 2 : 4;
            memcpy((char *)kb + slot * kn * e, (const char *)k + t * ks * e, kn * e);
            memcpy((char *)vb + slot * vn * e, (const char *)v + t * vs * e, vn * e);
        } else {
            for (int64_t i = 0; i < kn; i++) st(kb, dst_bf, slot * kn + i, ld(k, src_bf, t * ks + i));
            for (int64_t i = 0; i < vn; i++) st(vb, dst_bf, slot * vn + i, ld(v, src_bf, t * vs + i));
        }
    }
}
