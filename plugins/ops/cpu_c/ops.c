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

/* y[T, I] = silu(x[:, :I]) * x[:, I:] */
void co_silu_mul(const void *x, void *y, int64_t T, int64_t I, int bf, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * I >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < I; i++) {
            float g = ld(x, bf, t * 2 * I + i), u = ld(x, bf, t * 2 * I + I + i);
            st(y, bf, t * I + i, rnd(bf, g / (1.0f + expf(-g))) * u);
        }
    }
}

/* q[T, nq * D], k[T, nk * D] = the first nq + nk heads of qkv (rows qs elements apart) rotated:
 * x * cos + roll(x, D / 2) * sin, with cos / sin [T, D] (sin's sign folded as
 * RotaryEmbedding.cos_sin gives it) */
void co_rotary(const void *qkv, int64_t qs, const void *cs, const void *sn, void *q, void *k,
               int64_t T, int64_t nq, int64_t nk, int64_t D, int bf, int nthreads) {
    const int64_t h2 = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * (nq + nk) * D >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < nq + nk; h++) {
            void *out = h < nq ? q : k;
            const int64_t o = h < nq ? t * nq * D + h * D : t * nk * D + (h - nq) * D;
            for (int64_t d = 0; d < D; d++) {
                float x = ld(qkv, bf, t * qs + h * D + d);
                float xr = ld(qkv, bf, t * qs + h * D + (d + h2) % D);
                float a = rnd(bf, x * ld(cs, bf, t * D + d));
                st(out, bf, o + d, a + xr * ld(sn, bf, t * D + d));
            }
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
