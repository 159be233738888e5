/* Decode attention over the paged KV pool for CPUs (plugins/attention/cpu_c).
 * One work item per (request, KV head) (or per part of its query heads when there are fewer
 * items than threads): its query heads' scores over the request's slots in
 * fp32, a max-subtracted softmax, then the weighted sum of V rows, read straight from the pool
 * (fp32 or bf16 rows). Rows a few slots ahead are prefetched: a request's slots are runs of
 * consecutive rows interleaved with decode-time ones, which hardware prefetchers follow poorly.
 * AVX-512 builds take explicit vector loops for head dims 64 and 128 (scores16 / values16: a
 * key row loaded once for its G query heads, each head's V accumulators in registers over the
 * whole range; 3x the auto-vectorized loops at batch 1 and 16 on a 2-core AVX-512 VM); other
 * builds and head dims keep the portable loops. Every sum has a fixed order (the dot products
 * and softmax sums in 16 lanes, then the lanes pairwise: sum16 / dot16; V key after key).
 * ca_decode_rows runs several query rows of one request as one item (a speculative verify
 * step's tokens, row r over the request's first seq_lens[r] slots): a K row is loaded once for
 * all of them and V summed CHUNK keys at a time for each, so the item reads the request's cache
 * about once. Each row's arithmetic is ca_decode's for that row alone, operation for operation,
 * so a verify row gives the bits a decode step gives (tests/test_cpu_c_verify.py). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbf16.h"
#include "cexp.h" /* exp_neg */
#ifdef _OPENMP
#include <omp.h>
#endif

#define AHEAD 4
#define CHUNK 64 /* keys whose V rows each row of a multi-row item sums before the next */

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
    int64_t ks, int64_t g, int64_t G, int NC, float cap, float *sc, float *mx) {
    const size_t esz = bf ? 2 : 4;
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n)
            __builtin_prefetch((const char *)kb +
                               (sl[lo + j + AHEAD] * ks + g * NC * 16) * esz);
        const int64_t row = sl[lo + j] * ks + g * NC * 16;
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
    int64_t vs, int64_t g, int64_t G, int NC, float *acc) {
    const size_t esz = bf ? 2 : 4;
    for (int64_t i = 0; i < G; i++) {
        __m512 a[8];
        for (int c = 0; c < NC; c++) a[c] = _mm512_setzero_ps();
        const float *pi = p + i * n;
        for (int64_t j = 0; j < n; j++) {
            if (i == 0 && j + AHEAD < n)
                __builtin_prefetch((const char *)vb +
                                   (sl[lo + j + AHEAD] * vs + g * NC * 16) * esz);
            const int64_t row = sl[lo + j] * vs + g * NC * 16;
            const void *vr = bf ? (const void *)((const uint16_t *)vb + row)
                                : (const void *)((const float *)vb + row);
            const __m512 w = _mm512_set1_ps(pi[j]);
            for (int c = 0; c < NC; c++) a[c] = _mm512_fmadd_ps(w, ld16f(vr, bf, 16 * c), a[c]);
        }
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + i * NC * 16 + 16 * c, a[c]);
    }
}
#endif

#if defined(__AVX512F__)
/* The scores of key k (the item's j-th) for every row that sees it and every query head:
 * sc[(r * Gp + i) * nmax + k - lo[r]] = q_ri . K_k (fp32, a fixed lane order), maxima in mx.
 * NC = D / 16 vectors a row, a constant at each call site. */
static inline __attribute__((always_inline)) void score_key(
    const float *qs, const void *kb, int bf, const int64_t *sk, int64_t j, int64_t n, int64_t ks,
    int64_t g, int64_t k, const int64_t *lo, const int64_t *L, int64_t R, int64_t Gp,
    int64_t nmax, int NC, float cap, float *sc, float *mx) {
    const size_t esz = bf ? 2 : 4;
    if (j + AHEAD < n)
        __builtin_prefetch((const char *)kb + (sk[j + AHEAD] * ks + g * NC * 16) * esz);
    const int64_t row = sk[j] * ks + g * NC * 16;
    const void *kr = bf ? (const void *)((const uint16_t *)kb + row)
                        : (const void *)((const float *)kb + row);
    __m512 kv[8];
    for (int c = 0; c < NC; c++) kv[c] = ld16f(kr, bf, 16 * c);
    for (int64_t r = 0; r < R; r++) {
        if (k < lo[r] || k >= L[r]) continue;
        for (int64_t i = 0; i < Gp; i++) {
            const float *qi = qs + (r * Gp + i) * NC * 16;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qi), kv[0]);
            for (int c = 1; c < NC; c++)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), kv[c], a);
            float v = _mm512_reduce_add_ps(a);
            if (cap > 0.0f) v = cap * tanhf(v / cap);
            sc[(r * Gp + i) * nmax + k - lo[r]] = v;
            if (v > mx[r * Gp + i]) mx[r * Gp + i] = v;
        }
    }
}

/* ai += sum over the item's keys j0..j1-1 of p[j] * V_j, key after key, the accumulators in
 * registers (NC = Dv / 16, a constant at each call site); `ahead`: prefetch the V row AHEAD
 * keys on, up to key `end` */
static inline __attribute__((always_inline)) void value_run(
    const float *p, const void *vb, int bf, const int64_t *sk, int64_t j0, int64_t j1,
    int64_t end, int ahead, int64_t vs, int64_t g, int NC, float *ai) {
    const size_t esz = bf ? 2 : 4;
    __m512 a[8];
    for (int c = 0; c < NC; c++) a[c] = _mm512_loadu_ps(ai + 16 * c);
    for (int64_t j = j0; j < j1; j++) {
        if (ahead && j + AHEAD < end)
            __builtin_prefetch((const char *)vb + (sk[j + AHEAD] * vs + g * NC * 16) * esz);
        const int64_t row = sk[j] * vs + g * NC * 16;
        const void *vr = bf ? (const void *)((const uint16_t *)vb + row)
                            : (const void *)((const float *)vb + row);
        const __m512 w = _mm512_set1_ps(p[j]);
        for (int c = 0; c < NC; c++) a[c] = _mm512_fmadd_ps(w, ld16f(vr, bf, 16 * c), a[c]);
    }
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(ai + 16 * c, a[c]);
}
#endif

/* sum of x[0..n) in 16 lanes (lane = index mod 16) then the lanes pairwise: the same order for
 * any alignment and in every build */
static inline float sum16(const float *x, int64_t n) {
    float l[16] = {0};
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 a = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) a = _mm512_add_ps(a, _mm512_loadu_ps(x + j));
    if (j < n)  /* the lanes past n add +0: the portable loop's sums */
        a = _mm512_add_ps(a, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - j)) - 1u), x + j));
    _mm512_storeu_ps(l, a);
#else
    for (; j + 16 <= n; j += 16)
        for (int t = 0; t < 16; t++) l[t] += x[j + t];
    for (int t = 0; j + t < n; t++) l[t] += x[j + t];
#endif
    for (int w = 8; w > 0; w /= 2)
        for (int t = 0; t < w; t++) l[t] += l[t + w];
    return l[0];
}

/* qi . k over D elements in sum16's order (the portable loops' dot product) */
static inline float dot16(const float *qi, const float *k, int64_t D) {
    float l[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16)
        for (int t = 0; t < 16; t++) l[t] += qi[d + t] * k[d + t];
    for (int t = 0; d + t < D; t++) l[t] += qi[d + t] * k[d + t];
    for (int w = 8; w > 0; w /= 2)
        for (int t = 0; t < w; t++) l[t] += l[t + w];
    return l[0];
}

/* Row j of head g among n cached rows (slots sl[0..n)) of a cache whose slots are `rs` elements
 * apart, each holding its heads' W-wide rows one after another, as fp32: the
 * cache itself for fp32, else the bf16 row widened once into buf (for all G query heads); the
 * row AHEAD places on is prefetched. The portable loops' fetch, for K and V alike. */
static inline const float *cache_row(const void *base, int bf, size_t esz, const int64_t *sl,
                                     int64_t j, int64_t n, int64_t rs, int64_t g, int64_t W,
                                     float *buf) {
    if (j + AHEAD < n)
        __builtin_prefetch((const char *)base + (sl[j + AHEAD] * rs + g * W) * esz);
    const int64_t row = sl[j] * rs + g * W;
    if (!bf) return (const float *)base + row;
    const uint16_t *r = (const uint16_t *)base + row;
#pragma omp simd
    for (int64_t d = 0; d < W; d++) buf[d] = bf2f(r[d]);
    return buf;
}

/* The portable loops' scores: sc[i * n + j] = qs_i . K_j (dot16), the row maxima in mx (their
 * own function: inlined, they slowed the vector loops of ca_decode 10-20%) */
static __attribute__((noinline)) void scores_portable(
    const float *qs, const void *kb, int bf, const int64_t *sl, int64_t n, int64_t ks, int64_t g,
    int64_t Gp, int64_t D, float cap, float *sc, float *mx, float *krow) {
    const size_t esz = bf ? 2 : 4;
    for (int64_t j = 0; j < n; j++) {
        const float *k = cache_row(kb, bf, esz, sl, j, n, ks, g, D, krow);
        for (int64_t i = 0; i < Gp; i++) {
            float a = dot16(qs + i * D, k, D);
            if (cap > 0.0f) a = cap * tanhf(a / cap);
            sc[i * n + j] = a;
            if (a > mx[i]) mx[i] = a;
        }
    }
}

/* With fewer work items than threads (batch 1, MLA's single latent head), each item's `heads`
 * query heads are split in P parts, P the largest divisor of `heads` up to the threads per item,
 * every part re-reading the item's rows. A head's arithmetic does not depend on the split, so
 * the result does not either. Returns P (1 with enough items). */
static int64_t head_parts(int64_t items, int64_t heads, int nthreads) {
    if (items >= nthreads) return 1;
    for (int64_t p = (nthreads + items - 1) / items; p > 1; p--)
        if (heads % p == 0) return p;
    return 1;
}

/* ca_decode's and ca_decode_tab's body: slots [B, ss] int64 with seq_lens int64, or a table
 * [*, ss] int32 with rows and lens32 (the other pair NULL) */
static int decode_all(const void *q, int q_bf, const void *kb, const void *vb, int bf,
                      const int64_t *slots, const int32_t *table, const int64_t *rows,
                      int64_t ss, const int64_t *seq_lens, const int32_t *lens32, int64_t B,
                      int64_t H, int64_t Hkv, int64_t D, int64_t Dv, int64_t ks, int64_t vs,
                      float scale, int64_t window, float cap, void *out, int out_bf,
                      int nthreads);

/* q [B, H, D] fp32 (q_bf 0) or bf16 (1); kb [S, Hkv, D], vb [S, Hkv, Dv] with slots ks and vs
 * elements apart (Hkv * D and Hkv * Dv for separate K and V caches; MLA's latent cache is one
 * head whose V is the first Dv values of its K row, ks = vs = the row width); slots [B, ss] int64;
 * seq_lens [B]; window > 0 keeps the last `window` keys; cap > 0 soft-caps scores;
 * out [B, H, Dv] fp32 (out_bf 0) or bf16 (1, rounded to nearest even as torch does).
 * Returns 0, or -2 when out of memory. */
int ca_decode(const void *q, int q_bf, const void *kb, const void *vb, int bf,
              const int64_t *slots, int64_t ss, const int64_t *seq_lens, int64_t B, int64_t H,
              int64_t Hkv, int64_t D, int64_t Dv, int64_t ks, int64_t vs, float scale,
              int64_t window, float cap, void *out, int out_bf, int nthreads) {
    return decode_all(q, q_bf, kb, vb, bf, slots, NULL, NULL, ss, seq_lens, NULL, B, H, Hkv, D,
                      Dv, ks, vs, scale, window, cap, out, out_bf, nthreads);
}

/* ca_decode reading what a decode graph holds (static buffers, no per-step gather): request b's
 * slots are row rows[b] of the pool's int32 table [*, ts], its length seq_lens[b] (int32).
 * Each work item copies the slots it reads into its scratch as int64; the arithmetic is
 * ca_decode's, so a graph's step rounds as an eager one does. */
int ca_decode_tab(const void *q, int q_bf, const void *kb, const void *vb, int bf,
                  const int32_t *table, int64_t ts, const int64_t *rows, const int32_t *seq_lens,
                  int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t Dv, int64_t ks,
                  int64_t vs, float scale, int64_t window, float cap, void *out, int out_bf,
                  int nthreads) {
    return decode_all(q, q_bf, kb, vb, bf, NULL, table, rows, ts, NULL, seq_lens, B, H, Hkv, D,
                      Dv, ks, vs, scale, window, cap, out, out_bf, nthreads);
}

static int decode_all(const void *q, int q_bf, const void *kb, const void *vb, int bf,
                      const int64_t *slots, const int32_t *table, const int64_t *rows,
                      int64_t ss, const int64_t *seq_lens, const int32_t *lens32, int64_t B,
                      int64_t H, int64_t Hkv, int64_t D, int64_t Dv, int64_t ks, int64_t vs,
                      float scale, int64_t window, float cap, void *out, int out_bf,
                      int nthreads) {
    const int64_t G = H / Hkv;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += seq_lens ? seq_lens[b] : lens32[b];
    const int64_t P = head_parts(B * Hkv, G, nthreads), Gp = G / P;
    int failed = 0;
    const size_t esz = bf ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (work * H * D >= 32768)
    for (int64_t it = 0; it < B * Hkv * P; it++) {
        const int64_t b = it / (Hkv * P), g = (it / P) % Hkv;
        const int64_t h0 = g * G + (it % P) * Gp;  /* the item's first query head */
        const int64_t L = seq_lens ? seq_lens[b] : lens32[b];
        const int64_t lo = window > 0 && L > window ? L - window : 0;
        const int64_t n = L - lo;
        const int64_t wmax = D > Dv ? D : Dv;
        /* scratch: scores, scaled queries, accumulators, a widened row, then (from a table)
         * the item's slots as int64, 8-byte aligned */
        const size_t nf = (size_t)(Gp * (n > 0 ? n : 1) + Gp * D + Gp * Dv + wmax + 1) & ~(size_t)1;
        float *sc = (float *)malloc(sizeof(float) * nf + (table ? sizeof(int64_t) * (size_t)L : 0));
        if (!sc) { failed = 1; continue; }
        float *qs = sc + Gp * (n > 0 ? n : 1), *acc = qs + Gp * D, *krow = acc + Gp * Dv;
        const int64_t *sl = slots ? slots + b * ss : NULL;
        if (table) {
            int64_t *own = (int64_t *)(sc + nf);
            const int32_t *tr = table + rows[b] * ss;
            for (int64_t j = lo; j < L; j++) own[j] = tr[j];
            sl = own;
        }
        for (int64_t i = 0; i < Gp; i++)
            for (int64_t d = 0; d < D; d++)
                qs[i * D + d] = ld(q, q_bf, (b * H + h0 + i) * D + d) * scale;
        float mx[64], den[64];
        float *mxp = Gp <= 64 ? mx : (float *)malloc(sizeof(float) * 2 * (size_t)Gp);
        float *denp = Gp <= 64 ? den : mxp + Gp;
        for (int64_t i = 0; i < Gp; i++) { mxp[i] = -INFINITY; denp[i] = 0.0f; }
#if defined(__AVX512F__)
        const int vec = (D == 64 || D == 128) && Dv == D;
        if (vec && D == 64) scores16(qs, kb, bf, sl, lo, n, ks, g, Gp, 4, cap, sc, mxp);
        else if (vec) scores16(qs, kb, bf, sl, lo, n, ks, g, Gp, 8, cap, sc, mxp);
#else
        const int vec = 0;
#endif
        if (!vec) scores_portable(qs, kb, bf, sl + lo, n, ks, g, Gp, D, cap, sc, mxp, krow);
        for (int64_t i = 0; i < Gp; i++) {
            const float m = mxp[i];
            float *si = sc + i * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) si[j] = exp_neg(si[j] - m);
            denp[i] = sum16(si, n);
        }
        memset(acc, 0, sizeof(float) * (size_t)(Gp * Dv));
#if defined(__AVX512F__)
        if (vec && D == 64) values16(sc, vb, bf, sl, lo, n, vs, g, Gp, 4, acc);
        else if (vec) values16(sc, vb, bf, sl, lo, n, vs, g, Gp, 8, acc);
#endif
        if (!vec) {  /* the portable loops */
            for (int64_t j = 0; j < n; j++) {
                const float *v = cache_row(vb, bf, esz, sl + lo, j, n, vs, g, Dv, krow);
                for (int64_t i = 0; i < Gp; i++) {
                    const float p = sc[i * n + j];
                    float *ai = acc + i * Dv;
#pragma omp simd
                    for (int64_t d = 0; d < Dv; d++) ai[d] += p * v[d];
                }
            }
        }
        for (int64_t i = 0; i < Gp; i++) {
            const float r = denp[i] > 0.0f ? 1.0f / denp[i] : 0.0f;
            for (int64_t d = 0; d < Dv; d++)
                st(out, out_bf, (b * H + h0 + i) * Dv + d, acc[i * Dv + d] * r);
        }
        if (mxp != mx) free(mxp);
        free(sc);
    }
    return failed ? -2 : 0;
}

/* One item of ca_decode_rows: query rows b0..b0+R-1 (sharing the slots sl; row r attends to keys
 * lo[r]..L[r]-1), KV head g, query heads h0..h0+Gp-1; each row's arithmetic is ca_decode's.
 * Returns 0, or -2 when out of memory. */
static int decode_item(const void *q, int q_bf, const void *kb, const void *vb, int bf,
                       const int64_t *sl, const int64_t *seq_lens, int64_t b0, int64_t R,
                       int64_t H, int64_t D, int64_t Dv, int64_t ks, int64_t vs, float scale,
                       int64_t window, float cap, void *out, int out_bf, int64_t g, int64_t h0,
                       int64_t Gp) {
    const size_t esz = bf ? 2 : 4;
    int64_t lo[16], L[16], kmin = INT64_MAX, kmax = 0, nmax = 1;
    for (int64_t r = 0; r < R; r++) {
        L[r] = seq_lens[b0 + r];
        lo[r] = window > 0 && L[r] > window ? L[r] - window : 0;
        if (lo[r] < kmin) kmin = lo[r];
        if (L[r] > kmax) kmax = L[r];
        if (L[r] - lo[r] > nmax) nmax = L[r] - lo[r];
    }
    if (kmin > kmax) kmin = kmax;
    const int64_t RG = R * Gp, wmax = D > Dv ? D : Dv;
    /* sc [R][Gp][nmax] scores then weights; qs [R][Gp][D]; acc [R][Gp][Dv]; mx, den [R][Gp] */
    float *sc = (float *)malloc(sizeof(float) * (size_t)(RG * (nmax + D + Dv + 2) + wmax));
    if (!sc) return -2;
    float *qs = sc + RG * nmax, *acc = qs + RG * D, *mx = acc + RG * Dv, *den = mx + RG;
    float *krow = den + RG;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < Gp; i++)
            for (int64_t d = 0; d < D; d++)
                qs[(r * Gp + i) * D + d] = ld(q, q_bf, ((b0 + r) * H + h0 + i) * D + d) * scale;
    for (int64_t x = 0; x < RG; x++) mx[x] = -INFINITY;
    const int64_t n = kmax - kmin;  /* the item's keys: kmin.. */
    const int64_t *sk = sl + kmin;
#if defined(__AVX512F__)
    const int vec = (D == 64 || D == 128) && Dv == D;
#else
    const int vec = 0;
#endif
    /* scores: each key row loaded once for every row and head that sees it */
    for (int64_t j = 0; j < n; j++) {
        const int64_t k = kmin + j;
#if defined(__AVX512F__)
        if (vec) {
            if (D == 64)
                score_key(qs, kb, bf, sk, j, n, ks, g, k, lo, L, R, Gp, nmax, 4, cap, sc, mx);
            else
                score_key(qs, kb, bf, sk, j, n, ks, g, k, lo, L, R, Gp, nmax, 8, cap, sc, mx);
            continue;
        }
#endif
        const float *kr = cache_row(kb, bf, esz, sk, j, n, ks, g, D, krow);
        for (int64_t r = 0; r < R; r++) {
            if (k < lo[r] || k >= L[r]) continue;
            for (int64_t i = 0; i < Gp; i++) {
                float v = dot16(qs + (r * Gp + i) * D, kr, D);
                if (cap > 0.0f) v = cap * tanhf(v / cap);
                sc[(r * Gp + i) * nmax + k - lo[r]] = v;
                if (v > mx[r * Gp + i]) mx[r * Gp + i] = v;
            }
        }
    }
    /* softmax numerators and their sums, per row and head */
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < Gp; i++) {
            float *si = sc + (r * Gp + i) * nmax;
            const float m = mx[r * Gp + i];
            const int64_t nr = L[r] - lo[r];
#pragma omp simd
            for (int64_t j = 0; j < nr; j++) si[j] = exp_neg(si[j] - m);
            den[r * Gp + i] = sum16(si, nr);
        }
    /* the weighted V sums, CHUNK keys at a time for every row and head (key after key) */
    memset(acc, 0, sizeof(float) * (size_t)(RG * Dv));
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        int first = 1;  /* the first row and head to read the chunk prefetch ahead */
        for (int64_t r = 0; r < R; r++) {
            const int64_t j0 = lo[r] - kmin > c0 ? lo[r] - kmin : c0;
            const int64_t j1 = L[r] - kmin < c1 ? L[r] - kmin : c1;
            if (j0 >= j1) continue;
            for (int64_t i = 0; i < Gp; i++) {
                const float *pi = sc + (r * Gp + i) * nmax + (kmin - lo[r]);
                float *ai = acc + (r * Gp + i) * Dv;
#if defined(__AVX512F__)
                if (vec) {
                    if (D == 64) value_run(pi, vb, bf, sk, j0, j1, n, first, vs, g, 4, ai);
                    else value_run(pi, vb, bf, sk, j0, j1, n, first, vs, g, 8, ai);
                    first = 0;
                    continue;
                }
#endif
                for (int64_t j = j0; j < j1; j++) {
                    const float *v = cache_row(vb, bf, esz, sk, j, first ? n : 0, vs, g, Dv,
                                               krow);
                    const float p = pi[j];
#pragma omp simd
                    for (int64_t d = 0; d < Dv; d++) ai[d] += p * v[d];
                }
                first = 0;
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < Gp; i++) {
            const float dn = den[r * Gp + i], rc = dn > 0.0f ? 1.0f / dn : 0.0f;
            const float *ai = acc + (r * Gp + i) * Dv;
            for (int64_t d = 0; d < Dv; d++)
                st(out, out_bf, ((b0 + r) * H + h0 + i) * Dv + d, ai[d] * rc);
        }
    free(sc);
    return 0;
}

/* ca_decode for T groups of rows of one request each (a verify step's tokens): first [T + 1]
 * row offsets, at most 16 rows a group; a group's rows share the slots of its first row and
 * row b attends to its first seq_lens[b] slots. Items are (group, KV head), or parts of a KV
 * head's query heads (head_parts). Every row gives the bits ca_decode gives it alone. Returns 0,
 * -1 on a bad group, or -2 when out of memory. */
int ca_decode_rows(const void *q, int q_bf, const void *kb, const void *vb, int bf,
                   const int64_t *slots, int64_t ss, const int64_t *seq_lens,
                   const int64_t *first, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                   int64_t Dv, int64_t ks, int64_t vs, float scale, int64_t window, float cap,
                   void *out, int out_bf, int nthreads) {
    const int64_t G = H / Hkv;
    int64_t work = 0;
    for (int64_t t = 0; t < T; t++) {
        if (first[t + 1] - first[t] > 16 || first[t + 1] < first[t]) return -1;
        if (first[t + 1] > first[t]) work += seq_lens[first[t + 1] - 1];
    }
    const int64_t P = head_parts(T * Hkv, G, nthreads), Gp = G / P;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (work * H * D >= 32768)
    for (int64_t it = 0; it < T * Hkv * P; it++) {
        const int64_t t = it / (Hkv * P), g = (it / P) % Hkv;
        const int64_t b0 = first[t];
        if (decode_item(q, q_bf, kb, vb, bf, slots + b0 * ss, seq_lens, b0, first[t + 1] - b0,
                        H, D, Dv, ks, vs, scale, window, cap, out, out_bf, g,
                        g * G + (it % P) * Gp, Gp))
            failed = 1;
    }
    return failed ? -2 : 0;
}

/* ---- MLA decode (plugins/attention/cpu_c/mla.py) -------------------------------------------
 * Absorbed MLA is attention of H query heads over one KV "head" whose keys are the latent rows
 * [c | k_rope] (W values) and whose values are their first R entries. With every head reading
 * the same rows it is compute-bound (2 * (W + R) flops a row and head, 16-128 heads), so rows
 * are gathered TILE at a time into a contiguous fp32 tile and both products run as register-
 * blocked micro-kernels (2 heads x 4 rows of scores, 2 heads x 4 vectors of values), with an
 * online softmax between tiles. GCC vector extensions: 16 lanes in AVX-512 builds, 8 otherwise.
 * A fixed summation order, independent of the thread count. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
#define MLA_TILE 32

static inline vf ldv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void stv(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf bcast(float x) { vf v; for (int i = 0; i < VL; i++) v[i] = x; return v; }
static inline float hsum(vf v) { float s = 0.0f; for (int i = 0; i < VL; i++) s += v[i]; return s; }

/* s[h * MLA_TILE + j] = q_h . t_j for heads [0, G), rows [0, nt) of the tile (Wp values a row) */
static void mla_scores(const float *qs, const float *tb, int64_t G, int64_t nt, int64_t Wp,
                       float *s) {
    int64_t h = 0;
    for (; h + 2 <= G; h += 2) {
        const float *q0 = qs + h * Wp, *q1 = q0 + Wp;
        int64_t j = 0;
        for (; j + 4 <= nt; j += 4) {
            const float *r = tb + j * Wp;
            vf a0 = bcast(0), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t d = 0; d < Wp; d += VL) {
                const vf x = ldv(q0 + d), y = ldv(q1 + d);
                const vf r0 = ldv(r + d), r1 = ldv(r + Wp + d), r2 = ldv(r + 2 * Wp + d),
                         r3 = ldv(r + 3 * Wp + d);
                a0 += x * r0; a1 += x * r1; a2 += x * r2; a3 += x * r3;
                b0 += y * r0; b1 += y * r1; b2 += y * r2; b3 += y * r3;
            }
            float *s0 = s + h * MLA_TILE + j, *s1 = s0 + MLA_TILE;
            s0[0] = hsum(a0); s0[1] = hsum(a1); s0[2] = hsum(a2); s0[3] = hsum(a3);
            s1[0] = hsum(b0); s1[1] = hsum(b1); s1[2] = hsum(b2); s1[3] = hsum(b3);
        }
        for (; j < nt; j++) {
            vf a = bcast(0), b = a;
            for (int64_t d = 0; d < Wp; d += VL) {
                const vf r0 = ldv(tb + j * Wp + d);
                a += ldv(q0 + d) * r0; b += ldv(q1 + d) * r0;
            }
            s[h * MLA_TILE + j] = hsum(a);
            s[(h + 1) * MLA_TILE + j] = hsum(b);
        }
    }
    for (; h < G; h++)
        for (int64_t j = 0; j < nt; j++) {
            vf a = bcast(0);
            for (int64_t d = 0; d < Wp; d += VL) a += ldv(qs + h * Wp + d) * ldv(tb + j * Wp + d);
            s[h * MLA_TILE + j] = hsum(a);
        }
}

/* acc[h * Rp + d] += sum_j p[h * MLA_TILE + j] * t_j[d] for d < Rp, rows [0, nt) */
static void mla_values(const float *p, const float *tb, int64_t G, int64_t nt, int64_t Wp,
                       int64_t Rp, float *acc) {
    int64_t h = 0;
    for (; h + 2 <= G; h += 2) {
        const float *p0 = p + h * MLA_TILE, *p1 = p0 + MLA_TILE;
        float *c0 = acc + h * Rp, *c1 = c0 + Rp;
        int64_t d = 0;
        for (; d + 4 * VL <= Rp; d += 4 * VL) {
            vf a0 = ldv(c0 + d), a1 = ldv(c0 + d + VL), a2 = ldv(c0 + d + 2 * VL),
               a3 = ldv(c0 + d + 3 * VL);
            vf b0 = ldv(c1 + d), b1 = ldv(c1 + d + VL), b2 = ldv(c1 + d + 2 * VL),
               b3 = ldv(c1 + d + 3 * VL);
            for (int64_t j = 0; j < nt; j++) {
                const float *r = tb + j * Wp + d;
                const vf x = bcast(p0[j]), y = bcast(p1[j]);
                const vf r0 = ldv(r), r1 = ldv(r + VL), r2 = ldv(r + 2 * VL), r3 = ldv(r + 3 * VL);
                a0 += x * r0; a1 += x * r1; a2 += x * r2; a3 += x * r3;
                b0 += y * r0; b1 += y * r1; b2 += y * r2; b3 += y * r3;
            }
            stv(c0 + d, a0); stv(c0 + d + VL, a1); stv(c0 + d + 2 * VL, a2);
            stv(c0 + d + 3 * VL, a3);
            stv(c1 + d, b0); stv(c1 + d + VL, b1); stv(c1 + d + 2 * VL, b2);
            stv(c1 + d + 3 * VL, b3);
        }
        for (; d < Rp; d += VL) {
            vf a = ldv(c0 + d), b = ldv(c1 + d);
            for (int64_t j = 0; j < nt; j++) {
                const vf r0 = ldv(tb + j * Wp + d);
                a += bcast(p0[j]) * r0; b += bcast(p1[j]) * r0;
            }
            stv(c0 + d, a); stv(c1 + d, b);
        }
    }
    for (; h < G; h++)
        for (int64_t d = 0; d < Rp; d += VL) {
            vf a = ldv(acc + h * Rp + d);
            for (int64_t j = 0; j < nt; j++)
                a += bcast(p[h * MLA_TILE + j]) * ldv(tb + j * Wp + d);
            stv(acc + h * Rp + d, a);
        }
}

/* q [B, H, W] fp32 (the absorbed query [q_nope @ w_kc | q_rope]); cache: latent rows of W
 * values, fp32 (bf 0) or bf16 (1), slots rs elements apart; slots [B, ss] int64; seq_lens [B];
 * out [B, H, R] fp32, softmax(scale * q . row) @ row[:R]. Returns 0, or -2 when out of memory. */
int ca_mla_decode(const float *q, const void *cache, int bf, int64_t rs, const int64_t *slots,
                  int64_t ss, const int64_t *seq_lens, int64_t B, int64_t H, int64_t W,
                  int64_t R, float scale, float *out, int nthreads) {
    const int64_t Wp = (W + VL - 1) / VL * VL, Rp = (R + VL - 1) / VL * VL;
    const int64_t P = head_parts(B, H, nthreads), G = H / P;  /* as ca_decode */
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += seq_lens[b];
    int failed = 0;
    const size_t esz = bf ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (work * H * W >= 32768)
    for (int64_t it = 0; it < B * P; it++) {
        const int64_t b = it / P, h0 = (it % P) * G, n = seq_lens[b];
        const int64_t *sl = slots + b * ss;
        float *mem = (float *)malloc(sizeof(float) *
                                     (size_t)(MLA_TILE * Wp + G * Wp + G * Rp + G * MLA_TILE
                                              + 2 * G));
        if (!mem) { failed = 1; continue; }
        float *tb = mem, *qs = tb + MLA_TILE * Wp, *acc = qs + G * Wp, *s = acc + G * Rp;
        float *m = s + G * MLA_TILE, *l = m + G;
        memset(qs, 0, sizeof(float) * (size_t)(G * Wp));
        for (int64_t i = 0; i < G; i++) {
            for (int64_t d = 0; d < W; d++) qs[i * Wp + d] = q[(b * H + h0 + i) * W + d] * scale;
            m[i] = -INFINITY;
            l[i] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)(G * Rp));
        /* the tile's padding columns stay zero: they meet zero query padding */
        memset(tb, 0, sizeof(float) * (size_t)(MLA_TILE * Wp));
        for (int64_t t0 = 0; t0 < n; t0 += MLA_TILE) {
            const int64_t nt = n - t0 < MLA_TILE ? n - t0 : MLA_TILE;
            for (int64_t j = 0; j < nt; j++) {
                if (t0 + j + AHEAD < n)
                    __builtin_prefetch((const char *)cache + sl[t0 + j + AHEAD] * rs * esz);
                const int64_t row = sl[t0 + j] * rs;
                float *t = tb + j * Wp;
                if (bf) {
                    const uint16_t *r = (const uint16_t *)cache + row;
#pragma omp simd
                    for (int64_t d = 0; d < W; d++) t[d] = bf2f(r[d]);
                } else {
                    memcpy(t, (const float *)cache + row, sizeof(float) * (size_t)W);
                }
            }
            mla_scores(qs, tb, G, nt, Wp, s);
            for (int64_t i = 0; i < G; i++) {  /* the online softmax over this tile */
                float *si = s + i * MLA_TILE, mt = m[i];
                for (int64_t j = 0; j < nt; j++) mt = si[j] > mt ? si[j] : mt;
                const float alpha = m[i] == -INFINITY ? 0.0f : exp_neg(m[i] - mt);
                float sum = 0.0f;
                for (int64_t j = 0; j < nt; j++) { si[j] = exp_neg(si[j] - mt); sum += si[j]; }
                if (alpha != 1.0f)
                    for (int64_t d = 0; d < Rp; d++) acc[i * Rp + d] *= alpha;
                l[i] = l[i] * alpha + sum;
                m[i] = mt;
            }
            mla_values(s, tb, G, nt, Wp, Rp, acc);
        }
        for (int64_t i = 0; i < G; i++) {
            const float r = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            for (int64_t d = 0; d < R; d++) out[(b * H + h0 + i) * R + d] = acc[i * Rp + d] * r;
        }
        free(mem);
    }
    return failed ? -2 : 0;
}
