/* Quantized-weight products for the `gguf` quant methods (plugins/quant/gguf).
 *
 * Weights are held in one of two block formats that represent GGUF's integer formats exactly:
 *   w = scale[b] * code + min[b]   for every element of block b (bs elements of one row),
 *   bits 4: codes 0..15, two per byte, ggml's order within a block of 32 (byte j holds element
 *           j in its low nibble and element j + 16 in its high one); bs is 32;
 *   bits 8: codes 0..255, one per byte; bs is 32 or 16.
 * scale / min are fp16 (legacy formats, whose values are fp16 times small integers) or fp32
 * (K-quants, whose sub-block scales are products).
 *
 * The product quantizes each activation row per block to int8 with one fp32 scale (the
 * Q8 activations llama.cpp uses), sums code * q exactly in int32 per block, and accumulates
 * scale * xscale * isum + min * xscale * sum(q) in fp32. Compiled once per ISA variant
 * (GQ_VARIANT): AVX-512 VNNI, AVX2, portable C; the same source, different flags (build.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef GQ_STACK_BYTES
#define GQ_STACK_BYTES 32768  /* scratch kept on the caller's stack up to this size */
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GQ_AVX2 1
#endif

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {
            int e = -1;
            do { mant <<= 1; e++; } while (!(mant & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float ld_scale(const void *p, int f32, int64_t i) {
    return f32 ? ((const float *)p)[i] : h2f(((const uint16_t *)p)[i]);
}

const char *gq_variant(void) {
#if defined(GQ_AVX512)
    return "avx512_vnni";
#elif defined(GQ_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

#include "gq_act.h" /* quantize_row(_vec), split16: shared with amx.c */
#if defined(GQ_AVX512)
#define QUANTIZE_ROW quantize_row_vec
#else
#define QUANTIZE_ROW quantize_row
#endif

static inline int32_t qat(const void *q, int wide, int64_t i) {
    return wide ? ((const int16_t *)q)[i] : ((const int8_t *)q)[i];
}

/* sum over the blocks [b0, nb) of one row of scale * xd * sum(code * q) + min * xd * sum(q) */
/* (inlined everywhere: called out of line, its ~13 arguments cost a 1-row product ~5%) */
__attribute__((unused, always_inline)) static inline float dot_tail(
    const uint8_t *codes, int bits, int bs, const void *sc, const void *mn, int f32,
    int64_t row_blocks, const void *q, int wide, const float *d, const int32_t *s, int64_t b0,
    int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = b0; b < nb; b++) {
        int32_t isum = 0;
        if (bits == 4) {
            const uint8_t *c = codes + b * 16;
            for (int j = 0; j < 16; j++) {
                isum += (int32_t)(c[j] & 0x0f) * qat(q, wide, b * 32 + j) +
                        (int32_t)(c[j] >> 4) * qat(q, wide, b * 32 + j + 16);
            }
        } else {
            const uint8_t *c = codes + b * bs;
            for (int j = 0; j < bs; j++) isum += (int32_t)c[j] * qat(q, wide, b * bs + j);
        }
        float ws = ld_scale(sc, f32, row_blocks + b), wm = ld_scale(mn, f32, row_blocks + b);
        acc += d[b] * (ws * (float)isum + wm * (float)s[b]);
    }
    return acc;
}

#if defined(GQ_AVX512)
/* 64 code bytes per step: bits 4 -> 4 blocks of 32 (low nibbles = elements 0..15 of each
 * block, high = 16..31; the activation row is laid out to match, see arrange4), bits 8 ->
 * 2 blocks of 32 or 4 of 16. dpbusd sums 4 products per int32 lane; lane l belongs to block
 * l / (lanes per block) of the step, and the per-block factor scale * xscale reaches the lanes
 * through one permute of a 16-block register. */
typedef struct {
    const void *q;       /* the row's int8 codes, or the high bytes of int16 ones (bits 4:
                            arranged, arrange4) */
    const void *q2;      /* int16 activations: the low bytes */
    const float *d;      /* [nb] block scales */
    const float *xsum;   /* [nb] d * sum(q) per block (the min term's factor) */
} arow;

static inline __m512 ld16(const void *p, int f32, int64_t i, __mmask16 k) {
    if (f32) return _mm512_maskz_loadu_ps(k, (const float *)p + i);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i));
}

static inline __mmask64 bytes_mask(int n) { return n >= 64 ? ~0ULL : ((1ULL << n) - 1); }
static inline __mmask32 words_mask(int n) {
    return n >= 32 ? ~0U : (n <= 0 ? 0U : ((1U << n) - 1));
}

/* The codes of one step of a weight row: 64 bytes (bits 4: low / high nibbles) */
static inline void step_codes(const uint8_t *crow, int bits, int bs, int64_t b, __mmask64 k,
                              __m512i *lo, __m512i *hi) {
    if (bits == 4) {
        const __m512i nib = _mm512_set1_epi8(0x0f);
        __m512i c = _mm512_maskz_loadu_epi8(k, crow + b * 16);
        *lo = _mm512_and_si512(c, nib);
        *hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
    } else {
        *lo = _mm512_maskz_loadu_epi8(k, crow + b * bs);
        *hi = *lo;
    }
}

/* int8 activations: the step's activation vectors and the int32 lane sums (dpbusd) */
static inline void step_x8(const int8_t *qrow, int bits, int bs, int64_t b, int g, __mmask64 k,
                           __m512i x[4]) {
    if (bits == 4) {
        x[0] = _mm512_maskz_loadu_epi8(k, qrow + b * 32);
        x[1] = _mm512_maskz_loadu_epi8(k, qrow + b * 32 + g * 16);
    } else {
        x[0] = _mm512_maskz_loadu_epi8(k, qrow + b * bs);
    }
}

static inline __m512i isum8(int bits, __m512i lo, __m512i hi, const __m512i x[4]) {
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x[0]);
    return bits == 4 ? _mm512_dpbusd_epi32(acc, hi, x[1]) : acc;
}

/* The sums of each of 4 vectors' lanes, as one 128-bit vector. */
static inline __m256 hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), hi256(a));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), hi256(b));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), hi256(c));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), hi256(d));
    __m256 ab = _mm256_hadd_ps(a8, b8), cd = _mm256_hadd_ps(c8, d8);
    __m256 abcd = _mm256_hadd_ps(ab, cd);  /* [a01 b01 c01 d01 | a23 b23 c23 d23] halves */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* out[j][i] = row n0 + i of W . activation row j, for NR weight rows x MR activation rows;
 * NR, MR, bits, bs, wide are constants at every call site, so the loops unroll into
 * registers. A step is 64 code bytes: bits 4 -> 4 blocks of 32, bits 8 -> 2 of 32 or 4 of 16.
 * The per-block factor scale * xscale reaches the int32 lanes of a block through a permute of
 * a 16-block register (lane l of an int8 step, or of a half of an int16 step, belongs to
 * block l / lanes-per-block). */
static inline __attribute__((always_inline)) void tile(
    const uint8_t *codes, int64_t row_bytes, int bits, int bs, int wide, const void *sc,
    const void *mn, int f32, int64_t nb, int64_t n0, const arow *xr, int NR, int MR,
    float out[4][4]) {
    const int bpg = bits == 4 || bs == 16 ? 4 : 2;  /* blocks per step */
    /* block of each lane of a step */
    const __m512i base = bpg == 4
        ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
        : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i step_idx = _mm512_set1_epi32(bpg);
    __m512 acc[4][4];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < MR; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b16 = 0; b16 < nb; b16 += 16) {
        const int cnt = nb - b16 < 16 ? (int)(nb - b16) : 16;
        const __mmask16 k = (__mmask16)((1u << cnt) - 1u);
        __m512 S[4], XD[4];
        for (int j = 0; j < MR; j++) {
            XD[j] = _mm512_maskz_loadu_ps(k, xr[j].d + b16);
            const __m512 xs = _mm512_maskz_loadu_ps(k, xr[j].xsum + b16);
            for (int i = 0; i < NR; i++)  /* the min term of these 16 blocks */
                acc[i][j] = _mm512_fmadd_ps(ld16(mn, f32, (n0 + i) * nb + b16, k), xs, acc[i][j]);
        }
        for (int i = 0; i < NR; i++) {
            S[i] = ld16(sc, f32, (n0 + i) * nb + b16, k);
            if (MR == 1) S[i] = _mm512_mul_ps(S[i], XD[0]);
        }
        __m512i idx = base;
        for (int64_t b = b16; b < b16 + cnt; b += bpg) {
            const int g = b16 + cnt - b < bpg ? (int)(b16 + cnt - b) : bpg;
            const __mmask64 bk = g == bpg ? ~0ULL : bytes_mask(g * (bits == 4 ? 16 : bs));
            __m512i x[4][4], x2[4][4];
            __m512 px[4];
            for (int j = 0; j < MR; j++) {
                step_x8((const int8_t *)xr[j].q, bits, bs, b, g, bk, x[j]);
                if (wide) step_x8((const int8_t *)xr[j].q2, bits, bs, b, g, bk, x2[j]);
                if (MR > 1) px[j] = _mm512_permutexvar_ps(idx, XD[j]);
            }
            for (int i = 0; i < NR; i++) {
                __m512i lo, hi;
                step_codes(codes + (n0 + i) * row_bytes, bits, bs, b, bk, &lo, &hi);
                const __m512 ps = _mm512_permutexvar_ps(idx, S[i]);
                for (int j = 0; j < MR; j++) {
                    const __m512 f = MR == 1 ? ps : _mm512_mul_ps(ps, px[j]);
                    __m512i is = isum8(bits, lo, hi, x[j]);
                    if (wide)
                        is = _mm512_add_epi32(_mm512_slli_epi32(is, 8), isum8(bits, lo, hi, x2[j]));
                    acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), f, acc[i][j]);
                }
            }
            idx = _mm512_add_epi32(idx, step_idx);
        }
    }
    if (NR == 4) {
        for (int j = 0; j < MR; j++)
            _mm_storeu_ps(out[j], hsum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]));
    } else {
        for (int i = 0; i < NR; i++)
            for (int j = 0; j < MR; j++) out[j][i] = _mm512_reduce_add_ps(acc[i][j]);
    }
}

/* bits 4: per group of up to 4 blocks, the low halves (elements 0..15) of its blocks, then
 * the high halves, matching the low / high nibbles of 64 code bytes */
static void arrange4(const void *q, int64_t nb, size_t esz, void *out) {
    const char *src = (const char *)q;
    char *dst = (char *)out;
    for (int64_t g0 = 0; g0 < nb; g0 += 4) {
        const int g = nb - g0 < 4 ? (int)(nb - g0) : 4;
        for (int r = 0; r < g; r++) {
            memcpy(dst + (g0 * 32 + r * 16) * esz, src + ((g0 + r) * 32) * esz, 16 * esz);
            memcpy(dst + (g0 * 32 + g * 16 + r * 16) * esz, src + ((g0 + r) * 32 + 16) * esz,
                   16 * esz);
        }
    }
}
#define GQ_TILED 1
#ifndef GQ_PREFETCH_TILES
#define GQ_PREFETCH_TILES 2  /* prefetch distance in tiles of 4 rows */
#endif
#elif defined(GQ_AVX2)
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static float dot_row(const uint8_t *codes, int bits, int bs, const void *sc, const void *mn,
                     int f32, int64_t row_blocks, const void *qv, int wide, const float *d,
                     const int32_t *s, int64_t nb) {
    /* 32 elements per step: 1 block of 32 or 2 of 16 */
    const int per = 32 / bs;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m256i nib32 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    float macc = 0.0f;
    int64_t steps = nb / per, b = 0;
    for (int64_t t = 0; t < steps; t++, b += per) {
        __m256i isum, isum2 = _mm256_setzero_si256();  /* int32 lane sums (2nd: 2nd block) */
        __m128i c0, c1;  /* the step's 32 codes as bytes, in element order */
        if (bits == 4) {
            __m128i c = _mm_loadu_si128((const __m128i *)(codes + b * 16));
            c0 = _mm_and_si128(c, nib);
            c1 = _mm_and_si128(_mm_srli_epi16(c, 4), nib);
        } else {
            c0 = _mm_loadu_si128((const __m128i *)(codes + b * bs));
            c1 = _mm_loadu_si128((const __m128i *)(codes + b * bs + 16));
        }
        if (wide) {  /* codes widened to int16, vpmaddwd pairs */
            const int16_t *q = (const int16_t *)qv + b * bs;
            __m256i p0 = _mm256_madd_epi16(_mm256_cvtepu8_epi16(c0),
                                           _mm256_loadu_si256((const __m256i *)q));
            __m256i p1 = _mm256_madd_epi16(_mm256_cvtepu8_epi16(c1),
                                           _mm256_loadu_si256((const __m256i *)(q + 16)));
            if (per == 1) isum = _mm256_add_epi32(p0, p1);
            else { isum = p0; isum2 = p1; }
        } else {
            __m256i x = _mm256_loadu_si256((const __m256i *)((const int8_t *)qv + b * bs));
            if (bits == 4) {  /* codes 0..15: maddubs cannot saturate (2 * 15 * 127) */
                __m256i w = _mm256_set_m128i(c1, c0);
                isum = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
            } else {  /* codes 0..255 as 16 * high nibble + low nibble: no maddubs saturates */
                __m256i w = _mm256_set_m128i(c1, c0);
                __m256i lo = _mm256_and_si256(w, nib32);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib32);
                __m256i ilo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x), ones);
                __m256i ihi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x), ones);
                isum = _mm256_add_epi32(_mm256_slli_epi32(ihi, 4), ilo);
            }
            if (per == 2) {  /* lanes 0-3 block b, 4-7 block b + 1 */
                isum2 = _mm256_permute2x128_si256(isum, isum, 0x81);
                isum = _mm256_permute2x128_si256(isum, isum, 0x80);
            }
        }
        for (int g = 0; g < per; g++) {
            float xd = d[b + g];
            float f = xd * ld_scale(sc, f32, row_blocks + b + g);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g ? isum2 : isum), _mm256_set1_ps(f), acc);
            macc += xd * ld_scale(mn, f32, row_blocks + b + g) * (float)s[b + g];
        }
    }
    return hsum256(acc) + macc +
           dot_tail(codes, bits, bs, sc, mn, f32, row_blocks, qv, wide, d, s, b, nb);
}

/* dot_row for MR (1..4) activation rows against one weight row: each step's codes are loaded and
 * unpacked once for all the rows, and each row's arithmetic is dot_row's, in dot_row's order, so
 * every output is bit for bit what dot_row gives (a row's result does not depend on the rows
 * batched with it). Small-M products (batched decode, speculative verify steps) then read and
 * unpack each weight block once per four rows instead of once per row. */
static inline __attribute__((always_inline)) void dot_rows(
    const uint8_t *codes, int bits, int bs, const void *sc, const void *mn, int f32,
    int64_t row_blocks, const char *qv, size_t qstride, int wide, const float *d, int64_t dstride,
    const int32_t *s, int64_t sstride, int64_t nb, const int MR, float *out) {
    const int per = 32 / bs;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m256i nib32 = _mm256_set1_epi8(0x0f);
    __m256 acc[4];
    float macc[4];
    for (int j = 0; j < MR; j++) {
        acc[j] = _mm256_setzero_ps();
        macc[j] = 0.0f;
    }
    int64_t steps = nb / per, b = 0;
    for (int64_t t = 0; t < steps; t++, b += per) {
        __m128i c0, c1;
        if (bits == 4) {
            __m128i c = _mm_loadu_si128((const __m128i *)(codes + b * 16));
            c0 = _mm_and_si128(c, nib);
            c1 = _mm_and_si128(_mm_srli_epi16(c, 4), nib);
        } else {
            c0 = _mm_loadu_si128((const __m128i *)(codes + b * bs));
            c1 = _mm_loadu_si128((const __m128i *)(codes + b * bs + 16));
        }
        __m256i w0, w1;  /* wide: the codes as int16; narrow: bytes (8-bit: low / high nibbles) */
        if (wide) {
            w0 = _mm256_cvtepu8_epi16(c0);
            w1 = _mm256_cvtepu8_epi16(c1);
        } else if (bits == 4) {
            w0 = _mm256_set_m128i(c1, c0);
            w1 = w0;
        } else {
            __m256i w = _mm256_set_m128i(c1, c0);
            w0 = _mm256_and_si256(w, nib32);
            w1 = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib32);
        }
        float ws[2], wm[2];
        for (int g = 0; g < per; g++) {
            ws[g] = ld_scale(sc, f32, row_blocks + b + g);
            wm[g] = ld_scale(mn, f32, row_blocks + b + g);
        }
        for (int j = 0; j < MR; j++) {
            const char *qj = qv + j * qstride;
            __m256i isum, isum2 = _mm256_setzero_si256();
            if (wide) {
                const int16_t *q = (const int16_t *)qj + b * bs;
                __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)q));
                __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(q + 16)));
                if (per == 1) isum = _mm256_add_epi32(p0, p1);
                else { isum = p0; isum2 = p1; }
            } else {
                __m256i x = _mm256_loadu_si256((const __m256i *)((const int8_t *)qj + b * bs));
                if (bits == 4) {
                    isum = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x), ones);
                } else {
                    __m256i ilo = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x), ones);
                    __m256i ihi = _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x), ones);
                    isum = _mm256_add_epi32(_mm256_slli_epi32(ihi, 4), ilo);
                }
                if (per == 2) {
                    isum2 = _mm256_permute2x128_si256(isum, isum, 0x81);
                    isum = _mm256_permute2x128_si256(isum, isum, 0x80);
                }
            }
            const float *dj = d + j * dstride;
            const int32_t *sj = s + j * sstride;
            for (int g = 0; g < per; g++) {
                float xd = dj[b + g];
                float f = xd * ws[g];
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g ? isum2 : isum), _mm256_set1_ps(f),
                                         acc[j]);
                macc[j] += xd * wm[g] * (float)sj[b + g];
            }
        }
    }
    for (int j = 0; j < MR; j++)
        out[j] = hsum256(acc[j]) + macc[j] +
                 dot_tail(codes, bits, bs, sc, mn, f32, row_blocks, qv + j * qstride, wide,
                          d + j * dstride, s + j * sstride, b, nb);
}
#else
static float dot_row(const uint8_t *codes, int bits, int bs, const void *sc, const void *mn,
                     int f32, int64_t row_blocks, const void *q, int wide, const float *d,
                     const int32_t *s, int64_t nb) {
    return dot_tail(codes, bits, bs, sc, mn, f32, row_blocks, q, wide, d, s, 0, nb);
}
#endif

#if defined(GQ_AVX2)
/* gq_linear's product for M >= 2 rows on AVX2: tiles of 16 weight rows, each weight row against
 * four activation rows at a time (dot_rows) */
__attribute__((noinline)) static void rows4_linear(
    const uint8_t *codes, int bits, int bs, const void *sc, const void *mn, int f32,
    const float *bias, void *y, int y_bf16, int64_t N, int64_t M, int64_t K, const char *q,
    int wide, const float *d, int64_t nbp, const int32_t *s, int64_t nb, int64_t row_bytes,
    int nthreads) {
    const size_t esz = wide ? 2 : 1;
    const int64_t tile_n = 16;
    const int64_t ntiles = (N + tile_n - 1) / tile_n;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ntiles; t++) {
        int64_t n0 = t * tile_n, n1 = n0 + tile_n < N ? n0 + tile_n : N;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
            const char *qm = q + m0 * K * esz;
            const float *dm = d + m0 * nbp;
            const int32_t *sm = s + m0 * nb;
            for (int64_t n = n0; n < n1; n++) {
                float o[4];
                const uint8_t *cn = codes + n * row_bytes;
#define GQ_ROWS(MR) dot_rows(cn, bits, bs, sc, mn, f32, n * nb, qm, (size_t)K * esz, wide, dm, \
                             nbp, sm, nb, nb, MR, o)
                switch (mr) {
                case 4: GQ_ROWS(4); break;
                case 3: GQ_ROWS(3); break;
                case 2: GQ_ROWS(2); break;
                default: GQ_ROWS(1); break;
                }
#undef GQ_ROWS
                for (int j = 0; j < mr; j++) {
                    float v = o[j];
                    if (bias) v += bias[n];
                    st(y, y_bf16, (m0 + j) * N + n, v);
                }
            }
        }
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias[N]); x and y fp32 or bf16; activations quantized per block
 * to `abits` 8 or 16 bits; returns 0, or < 0 on bad input. */
int gq_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, int bits,
              int bs, const void *sc, const void *mn, int f32, const float *bias, void *y,
              int y_bf16, int64_t N, int abits, int nthreads) {
    if (K % bs || (bits == 4 && bs != 32) || (bits == 8 && bs != 32 && bs != 16)) return -1;
    if (abits != 8 && abits != 16) return -1;
    const int wide = abits == 16;
    const size_t esz = wide ? 2 : 1;
    const int64_t nb = K / bs, row_bytes = bits == 4 ? K / 2 : K, nbp = nb + 4;
    /* one scratch block: the codes, the block scales and sums, and (tiled builds) the planes;
     * on the stack for decode-sized inputs (malloc / free of six buffers cost ~2 us a call) */
    const size_t qbytes = (size_t)(M * K) * esz, fbytes = sizeof(float) * (size_t)(M * nbp);
    const size_t sbytes = sizeof(int32_t) * (size_t)(M * nb);
    const size_t al = 64, need = 3 * qbytes + 2 * fbytes + sbytes + 6 * al;
    _Alignas(64) char stack_buf[GQ_STACK_BYTES];
    char *heap = need > sizeof(stack_buf) ? (char *)malloc(need) : NULL;
    if (need > sizeof(stack_buf) && !heap) return -2;
    char *cur = heap ? heap : stack_buf;
#define GQ_TAKE(n) (cur += (al - ((uintptr_t)cur % al)) % al, cur += (n), cur - (n))
    char *q = GQ_TAKE(qbytes);
    float *d = (float *)GQ_TAKE(fbytes);
    float *xs = (float *)GQ_TAKE(fbytes);
    int32_t *s = (int32_t *)GQ_TAKE(sbytes);
    memset(d, 0, fbytes);
    memset(xs, 0, fbytes);
    const size_t xstride = (size_t)K * (x_bf16 ? 2 : 4);
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        QUANTIZE_ROW((const char *)x + m * xstride, x_bf16, K, bs, wide, q + m * K * esz,
                     d + m * nbp, s + m * nb);
        for (int64_t b = 0; b < nb; b++) xs[m * nbp + b] = d[m * nbp + b] * (float)s[m * nb + b];
    }
#if defined(GQ_TILED)
    /* int8 planes in the kernels' layout: the codes (int8), or int16 codes' high and low
     * bytes (split16); bits 4 arranges each (arrange4) */
    int8_t *qa = (int8_t *)GQ_TAKE(qbytes);
    int8_t *tmp = wide || bits == 4 ? (int8_t *)GQ_TAKE(qbytes) : NULL;
    for (int64_t m = 0; m < M; m++) {
        int8_t *plane = qa + m * K * esz, *src = (int8_t *)q + m * K * esz;
        if (wide) {
            int8_t *t = tmp + m * K * esz;
            split16((const int16_t *)src, K, t, t + K);
            if (bits == 4) {
                arrange4(t, nb, 1, plane);
                arrange4(t + K, nb, 1, plane + K);
            } else {
                memcpy(plane, t, (size_t)(2 * K));
            }
        } else if (bits == 4) {
            arrange4(src, nb, 1, plane);
        } else {
            memcpy(plane, src, (size_t)K);
        }
    }
    const int64_t ntiles = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t n0 = t * 4;
        const int nr = N - n0 < 4 ? (int)(N - n0) : 4;
        if (n0 + 4 * GQ_PREFETCH_TILES < N) {  /* a later tile's rows, ahead of the streamers */
            const int64_t np = n0 + 4 * GQ_PREFETCH_TILES;
            const int64_t rows = N - np < 4 ? N - np : 4;
            const char *c = (const char *)(codes + np * row_bytes);
            for (int64_t o = 0; o < rows * row_bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
            const int64_t sb = (int64_t)(f32 ? 4 : 2) * nb;
            const char *ps = (const char *)sc + np * sb, *pm = (const char *)mn + np * sb;
            for (int64_t o = 0; o < rows * sb; o += 64) {
                _mm_prefetch(ps + o, _MM_HINT_T0);
                _mm_prefetch(pm + o, _MM_HINT_T0);
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mr = M - m0 < 4 ? (int)(M - m0) : 4;
            arow xr[4];
            for (int j = 0; j < mr; j++)
                xr[j] = (arow){qa + (m0 + j) * K * esz, qa + (m0 + j) * K * esz + K,
                               d + (m0 + j) * nbp, xs + (m0 + j) * nbp};
            float out[4][4];
#define GQ_TILE1(W, NR, MR, N0, XR, O)                                                        \
    do {                                                                                       \
        if (bits == 4) tile(codes, row_bytes, 4, 32, W, sc, mn, f32, nb, N0, XR, NR, MR, O);  \
        else if (bs == 32) tile(codes, row_bytes, 8, 32, W, sc, mn, f32, nb, N0, XR, NR, MR, O); \
        else tile(codes, row_bytes, 8, 16, W, sc, mn, f32, nb, N0, XR, NR, MR, O);            \
    } while (0)
#define GQ_TILE(NR, MR, N0, XR, O)                 \
    do {                                           \
        if (wide) GQ_TILE1(1, NR, MR, N0, XR, O);  \
        else GQ_TILE1(0, NR, MR, N0, XR, O);       \
    } while (0)
            if (nr == 4 && mr == 4) {
                GQ_TILE(4, 4, n0, xr, out);
            } else if (nr == 4) {
                for (int j = 0; j < mr; j++) {
                    float o[4][4];
                    GQ_TILE(4, 1, n0, xr + j, o);
                    for (int i = 0; i < 4; i++) out[j][i] = o[0][i];
                }
            } else {
                for (int i = 0; i < nr; i++)
                    for (int j = 0; j < mr; j++) {
                        float o[4][4];
                        GQ_TILE(1, 1, n0 + i, xr + j, o);
                        out[j][i] = o[0][0];
                    }
            }
#undef GQ_TILE
#undef GQ_TILE1
            for (int j = 0; j < mr; j++)
                for (int i = 0; i < nr; i++) {
                    float v = out[j][i] + (bias ? bias[n0 + i] : 0.0f);
                    st(y, y_bf16, (m0 + j) * N + n0 + i, v);
                }
        }
    }
#else
    const int64_t tile_n = 16;  /* weight rows reused across activation rows */
    const int64_t ntiles = (N + tile_n - 1) / tile_n;
#if defined(GQ_AVX2)
    /* two rows or more: each weight row against four activation rows at a time (rows4 below,
     * its own function: inside this one it slowed the 1-row loop to 0.93-0.97x) */
    if (M > 1) {
        rows4_linear(codes, bits, bs, sc, mn, f32, bias, y, y_bf16, N, M, K, q, wide, d, nbp, s,
                     nb, row_bytes, nthreads);
        free(heap);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ntiles; t++) {
        int64_t n0 = t * tile_n, n1 = n0 + tile_n < N ? n0 + tile_n : N;
        for (int64_t m = 0; m < M; m++) {
            for (int64_t n = n0; n < n1; n++) {
                float v = dot_row(codes + n * row_bytes, bits, bs, sc, mn, f32, n * nb,
                                  q + m * K * esz, wide, d + m * nbp, s + m * nb, nb);
                if (bias) v += bias[n];
                st(y, y_bf16, m * N + n, v);
            }
        }
    }
#endif
#undef GQ_TAKE
    free(heap);
    return 0;
}

/* out[r, K] = the dequantized rows rows[r] of W (rows NULL: rows 0..n_rows-1); fp32 or bf16 */
int gq_dequant(const uint8_t *codes, int bits, int bs, const void *sc, const void *mn, int f32,
               int64_t K, int64_t N, const int64_t *rows, int64_t n_rows, void *out,
               int out_bf16, int nthreads) {
    if (K % bs || (bits == 4 && bs != 32)) return -1;
    if (rows)  /* the rows asked for (token ids, at an embedding lookup) are checked here */
        for (int64_t r = 0; r < n_rows; r++)
            if (rows[r] < 0 || rows[r] >= N) return -3;
    int64_t nb = K / bs, row_bytes = bits == 4 ? K / 2 : K;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n_rows > 8)
    for (int64_t r = 0; r < n_rows; r++) {
        int64_t n = rows ? rows[r] : r;
        const uint8_t *c = codes + n * row_bytes;
        float row[32];
        for (int64_t b = 0; b < nb; b++) {
            float ws = ld_scale(sc, f32, n * nb + b), wm = ld_scale(mn, f32, n * nb + b);
            if (bits == 4) {
                for (int j = 0; j < 16; j++) {
                    row[j] = ws * (float)(c[b * 16 + j] & 0x0f) + wm;
                    row[j + 16] = ws * (float)(c[b * 16 + j] >> 4) + wm;
                }
            } else {
                for (int j = 0; j < bs; j++) row[j] = ws * (float)c[b * bs + j] + wm;
            }
            int64_t o = r * K + b * bs;
            if (out_bf16) {
                for (int j = 0; j < bs; j++) ((uint16_t *)out)[o + j] = f2bf(row[j]);
            } else {
                memcpy((float *)out + o, row, sizeof(float) * (size_t)bs);
            }
        }
    }
    return 0;
}
