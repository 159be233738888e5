/* GGUF block matrices times bf16 activations on AMX tiles (plugins/quant/gguf, `gguf_amx`).
 *
 * y[M, N] = x[M, K] @ W^T (+ bias), W in the kernels' block format (formats.py: w = scale *
 * code + min per block of 32, or 16 for Q6_K; 4-bit codes two per byte, element j low and
 * j + 16 high). The weights stay packed in memory: each thread takes panels of 32 output
 * columns, dequantizes one panel at a time (all of K) into bf16 in the tiles' pair layout
 * (one 1 KiB B tile per 32 k x 16 columns: row r holds k = 2r, 2r + 1 of each column) in a
 * buffer that stays in L2, then streams every row of x past it: two A tiles (rows m..m+31,
 * k..k+31, loaded in place with x's row stride) times two B tiles into four fp32 C tiles.
 * The dequantization is paid once per panel and call, so it is amortised over M rows: this
 * is the prefill / batched-decode path (the VNNI kernels stay faster for a few rows).
 *
 * Numerics: the weight rounded to bf16 once (as the dequantize-then-F.linear path rounds it),
 * bf16 x bf16 products summed in fp32 by the tiles; the sum order differs from oneDNN's.
 * The caller pads M to a multiple of 32 (rows past M are read, never written back).
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CAMX_REQUEST /* amx_request_tiles */
#include "camx.h"   /* tile_config */
#include "cbf16.h"
#include "gq_act.h" /* quantize_row_vec, split16: the activations of gq_amx_q_linear */
#ifdef _OPENMP
#include <omp.h>
#endif

const char *gq_amx_variant(void) { return "amx"; }

/* Ask the kernel for the AMX tile state (Linux grants it per process); 0 when granted. */
int gq_amx_init(void) { return amx_request_tiles(); }

static void configure_tiles(void) {
    tile_config c;
    tile_config_16x64(&c);
    _tile_loadconfig(&c);
}

static inline float scale_at(const void *p, int f32, int64_t i) {
    return f32 ? ((const float *)p)[i] : _cvtsh_ss(((const uint16_t *)p)[i]);
}

/* The 32 weights of row n at k = 32 kb .. 32 kb + 31 as fp32 (two vectors of 16). */
static inline void dequant32(const uint8_t *codes, int bits, int bs, const void *sc,
                             const void *mn, int f32, int64_t n, int64_t K, int64_t kb,
                             __m512 *lo, __m512 *hi) {
    const int64_t nb = K / bs, k0 = kb * 32;
    __m512i a, b;
    if (bits == 4) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(codes + n * (K / 2) + kb * 16));
        __m128i mask = _mm_set1_epi8(0x0f);
        a = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
        b = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    } else {
        const uint8_t *c = codes + n * K + k0;
        a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
        b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16)));
    }
    const int64_t b0 = n * nb + k0 / bs, b1 = n * nb + (k0 + 16) / bs;
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(scale_at(sc, f32, b0)),
                          _mm512_set1_ps(scale_at(mn, f32, b0)));
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_set1_ps(scale_at(sc, f32, b1)),
                          _mm512_set1_ps(scale_at(mn, f32, b1)));
}

/* rows r[0..15] of 16 dwords -> their transpose in place (out[c][i] = in[i][c]): 32-bit then
 * 64-bit interleaves inside 128-bit lanes, then two rounds of lane shuffles. */
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + q], lane L: rows 4i..4i+3 of column 4L + q */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int q = 0; q < 4; q++) {
        __m512i c0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x44);
        __m512i c1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xEE);
        __m512i c2 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x44);
        __m512i c3 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xEE);
        r[q] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + q] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        r[8 + q] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[12 + q] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

/* Columns n0 .. n0 + 31 of W (zeros past N) into `panel`: for each kb, two B tiles of
 * 16 rows x 64 bytes; tile t, row r, column c holds bf16 (w[n0+16t+c][32kb+2r],
 * w[n0+16t+c][32kb+2r+1]). Each column's 32 weights of a kb are one vector of 16 bf16
 * pairs; sixteen of them transposed give a tile's rows. */
static void dequant_panel(const uint8_t *codes, int bits, int bs, const void *sc, const void *mn,
                          int f32, int64_t N, int64_t K, int64_t n0, uint32_t *panel) {
    const int64_t kblocks = K / 32;
    __m512i col[16];
    for (int64_t kb = 0; kb < kblocks; kb++) {
        for (int t = 0; t < 2; t++) {
            for (int j = 0; j < 16; j++) {
                const int64_t n = n0 + 16 * t + j;
                if (n < N) {
                    __m512 lo, hi;
                    dequant32(codes, bits, bs, sc, mn, f32, n, K, kb, &lo, &hi);
                    /* 32 bf16 in k order: dword r = (k 2r, k 2r + 1) */
                    col[j] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                } else {
                    col[j] = _mm512_setzero_si512();
                }
            }
            transpose16(col);
            uint32_t *tile = panel + kb * 512 + t * 256;
            for (int r = 0; r < 16; r++) _mm512_store_si512((__m512i *)(tile + r * 16), col[r]);
        }
    }
}

static inline void write_rows(const float *acc, int64_t m0, int64_t M, int64_t n0, int64_t N,
                              const float *bias, void *y, int out_bf16) {
    const int64_t cols = N - n0 < 32 ? N - n0 : 32;
    const __mmask16 k0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + n0 + 16) : _mm512_setzero_ps();
    for (int64_t i = 0; i < 32 && m0 + i < M; i++) {
        __m512 lo = _mm512_add_ps(_mm512_load_ps(acc + i * 32), b0);
        __m512 hi = _mm512_add_ps(_mm512_load_ps(acc + i * 32 + 16), b1);
        const int64_t o = (m0 + i) * N + n0;
        if (out_bf16) {
            __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* nearest even, as torch */
            _mm512_mask_storeu_epi16((uint16_t *)y + o, ((__mmask32)k1 << 16) | k0, h);
        } else {
            _mm512_mask_storeu_ps((float *)y + o, k0, lo);
            _mm512_mask_storeu_ps((float *)y + o + 16, k1, hi);
        }
    }
}

/* y[M, N] (fp32, or bf16 when out_bf16) = x[Mp, K] (bf16, Mp = M rounded up to 32, the extra
 * rows any finite values) @ W^T + bias (fp32 or NULL). 0 on success; -1 for a shape the
 * kernel does not take (K not a multiple of 32, 4-bit blocks not of 32), -2 when a thread's
 * panel buffer could not be allocated. Call only after gq_amx_init() returned 0: a tile
 * instruction without the permission kills the process. */
int gq_amx_linear(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes, int bits,
                  int bs, const void *sc, const void *mn, int f32, const float *bias, void *y,
                  int out_bf16, int64_t N, int nthreads) {
    if (K % 32 || (bits == 4 && bs != 32) || (bs != 32 && bs != 16)) return -1;
    const int64_t panels = (N + 31) / 32, kblocks = K / 32, Mp = (M + 31) / 32 * 32;
    if (nthreads < 1) nthreads = 1;
    /* x in the A tiles' order (block of 32 rows, then kb, then the two 16-row tiles), so each
     * tile load reads 1 KiB in a row: strided loads of x's rows (one cache line each, from
     * L2) kept the tiles waiting. */
    uint16_t *xa = (uint16_t *)_mm_malloc((size_t)Mp * K * 2, 64);
    if (!xa) return -2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (Mp * K >= 65536)
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        for (int64_t kb = 0; kb < kblocks; kb++) {
            uint16_t *dst = xa + m0 * K + kb * 1024;
            for (int64_t i = 0; i < 32; i++)
                memcpy(dst + i * 32, x + (m0 + i) * K + kb * 32, 64);
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint32_t *panel = (uint32_t *)_mm_malloc((size_t)kblocks * 2 * 1024, 64);
        float acc[32 * 32] __attribute__((aligned(64)));
        if (!panel) {
            failed = 1;
        } else {
            configure_tiles();
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int64_t n0 = p * 32;
                dequant_panel(codes, bits, bs, sc, mn, f32, N, K, n0, panel);
                for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    const uint16_t *a = xa + m0 * K;
                    for (int64_t kb = 0; kb < kblocks; kb++) {
                        _tile_loadd(4, a + kb * 1024, 64);
                        _tile_loadd(5, a + kb * 1024 + 512, 64);
                        _tile_loadd(6, panel + kb * 512, 64);
                        _tile_loadd(7, panel + kb * 512 + 256, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, acc, 128);
                    _tile_stored(1, acc + 16, 128);
                    _tile_stored(2, acc + 16 * 32, 128);
                    _tile_stored(3, acc + 16 * 32 + 16, 128);
                    write_rows(acc, m0, M, n0, N, bias, y, out_bf16);
                }
            }
            _tile_release();
            _mm_free(panel);
        }
    }
    _mm_free(xa);
    return failed ? -2 : 0;
}

/* ---- int8 tiles: the gguf kernels' own arithmetic ------------------------------------------
 *
 * gq_amx_q_linear computes what gq_linear (kernels.c) computes with int16 activations: each
 * activation row quantized per block of 32 to int16 (gq_act.h), sum(code * q) per block exact
 * in int32, then scale * xscale * isum + min * xscale * sum(q) summed over the blocks in fp32
 * (in another order than the VNNI kernel's, so the last bits may differ). On the tiles:
 * q = 256 * hi + lo (split16), so a block's sum is 256 * (hi . codes) + (lo . codes), two
 * TDPBSUD (signed activations x unsigned codes) of 16 rows x 16 columns x 32 k. The products
 * of one block leave the tiles after each block, because every block has its own scales:
 * their scaling on AVX-512 (16 rows of 16 columns, accumulated in registers) is the kernel's
 * cost beside the tile products. The codes are copied once per matrix into tile order
 * (gq_amx_q_pack, still 4 bits a weight); per call each thread splits one panel of 16 weight
 * rows (all of K) into the tiles' bytes and streams every block of 16 activation rows past
 * it. Blocks of 32 only (not Q6_K's 16). */

/* The unsigned operand in tile order, made once per matrix (gq_amx_q_pack): per panel of 16
 * weight rows n0..n0+15 (zeros past N) and block b of 32, the codes of k = 32b + 4r ..
 * 32b + 4r + 3 of each row as one dword per row, 16 dwords a tile row (TDPBSUD's layout of its
 * second operand). 8-bit codes: the 8 tile rows as they are (512 bytes). 4-bit codes: 4 rows
 * of bytes (256 bytes) whose low nibbles are tile rows 0..3 (k 0..15) and high nibbles rows
 * 4..7 (k 16..31), because ggml's byte j holds element j low and j + 16 high: the pack moves
 * dwords, the kernel splits nibbles. Scales and mins go to [panel][b][16] in their dtype. */
int gq_amx_q_pack(const uint8_t *codes, int bits, const void *sc, const void *mn, int f32,
                  int64_t N, int64_t K, uint8_t *out, void *osc, void *omn) {
    if (K % 32 || (bits != 4 && bits != 8)) return -1;
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K, panels = (N + 15) / 16;
    const int blk = bits == 4 ? 256 : 512, dw = bits == 4 ? 4 : 8, es = f32 ? 4 : 2;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *t = out + (p * nb + b) * blk;
            for (int c = 0; c < 16; c++) {
                const int64_t n = p * 16 + c, o = (p * nb + b) * 16 + c;
                for (int r = 0; r < dw; r++) {
                    uint32_t v = 0;
                    if (n < N) memcpy(&v, codes + n * row_bytes + b * (bits == 4 ? 16 : 32) + 4 * r, 4);
                    memcpy(t + r * 64 + c * 4, &v, 4);
                }
                if (n < N) {
                    memcpy((char *)osc + o * es, (const char *)sc + (n * nb + b) * es, es);
                    memcpy((char *)omn + o * es, (const char *)mn + (n * nb + b) * es, es);
                } else {
                    memset((char *)osc + o * es, 0, es);
                    memset((char *)omn + o * es, 0, es);
                }
            }
        }
    return 0;
}

static inline __m512 ld16s(const void *p, int f32, int64_t i) {
    return f32 ? _mm512_load_ps((const float *)p + i)
               : _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)((const uint16_t *)p + i)));
}

/* One panel's 4-bit tiles into bt (nb x 512 bytes): the nibbles split. */
static void stage_panel4(const uint8_t *tp, int64_t nb, uint8_t *bt) {
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 4; r++) {
            const __m512i v = _mm512_load_si512((const __m512i *)(tp + b * 256 + r * 64));
            _mm512_store_si512((__m512i *)(bt + b * 512 + r * 64), _mm512_and_si512(v, nib));
            _mm512_store_si512((__m512i *)(bt + b * 512 + (r + 4) * 64),
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
        }
}

static void configure_q_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 4; i++) { /* 0-3: int32 sums, 16 x 16 */
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    for (int i = 4; i < 6; i++) { /* 4, 5: activations' high / low bytes, 16 rows x 32 k */
        c.rows[i] = 16;
        c.colsb[i] = 32;
    }
    for (int i = 6; i < 8; i++) { /* 6, 7: codes, 8 rows of 4 k x 16 columns */
        c.rows[i] = 8;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* Block b's products into tiles c, c + 1: the high and the low bytes of the activations
 * (tiles 4, 5) times the codes (tile 6). */
#define q_products(arow, bt, b, c)                                   \
    do {                                                             \
        const int8_t *a_ = (arow) + (b) * 1024;                      \
        _tile_loadd(4, a_, 32);                                      \
        _tile_loadd(5, a_ + 512, 32);                                \
        _tile_loadd(6, (bt) + (b) * 512, 64);                        \
        if (c) {                                                     \
            _tile_zero(2);                                           \
            _tile_zero(3);                                           \
            _tile_dpbsud(2, 4, 6);                                   \
            _tile_dpbsud(3, 5, 6);                                   \
        } else {                                                     \
            _tile_zero(0);                                           \
            _tile_zero(1);                                           \
            _tile_dpbsud(0, 4, 6);                                   \
            _tile_dpbsud(1, 5, 6);                                   \
        }                                                            \
    } while (0)

/* y[M, N] (fp32, or bf16 when y_bf16) = x[M, K] (fp32, or bf16 when x_bf16) @ W^T + bias (fp32
 * or NULL), W in blocks of 32 (bits 4 or 8) as gq_amx_q_pack left it (tiles, sc, mn). 0 on success; -1 for a shape the kernel does not
 * take; -2 when memory could not be allocated. Call only after gq_amx_init() returned 0. */
int gq_amx_q_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *tiles,
                    int bits, const void *sc, const void *mn, int f32, const float *bias,
                    void *y, int y_bf16, int64_t N, int nthreads) {
    if (K % 32 || (bits != 4 && bits != 8)) return -1;
    const int64_t nb = K / 32, Mp = (M + 15) / 16 * 16, panels = (N + 15) / 16;
    if (nthreads < 1) nthreads = 1;
    /* activations: per block of 16 rows and per block b of 32 k, the 16 x 32 high bytes, then
     * the 16 x 32 low bytes (one 1 KiB run per tile pair); d and d * sum(q) as [Mp / 16][nb][16] */
    int8_t *xa = (int8_t *)_mm_malloc((size_t)Mp * K * 2, 64);
    float *xd = (float *)_mm_malloc(sizeof(float) * (size_t)(Mp * nb), 64);
    float *xsum = (float *)_mm_malloc(sizeof(float) * (size_t)(Mp * nb), 64);
    int failed = !xa || !xd || !xsum;
    const size_t xstride = (size_t)K * (x_bf16 ? 2 : 4);
    if (!failed) {
#pragma omp parallel num_threads(nthreads) reduction(| : failed) if (M * K >= 16384)
        {
            int16_t *q = (int16_t *)malloc(sizeof(int16_t) * (size_t)K + 2 * (size_t)K +
                                           (sizeof(float) + sizeof(int32_t)) * (size_t)nb);
            if (!q) {
                failed = 1;
            } else {
                int8_t *hi = (int8_t *)(q + K), *lo = hi + K;
                float *d = (float *)(lo + K);
                int32_t *s = (int32_t *)(d + nb);
#pragma omp for schedule(static)
                for (int64_t m = 0; m < Mp; m++) {
                    const int64_t mb = m / 16, r = m % 16;
                    if (m < M) {
                        quantize_row_vec((const char *)x + m * xstride, x_bf16, K, 32, 1, q, d, s);
                        split16(q, K, hi, lo);
                    } else {
                        memset(hi, 0, (size_t)(2 * K));
                        memset(d, 0, sizeof(float) * (size_t)nb);
                        memset(s, 0, sizeof(int32_t) * (size_t)nb);
                    }
                    for (int64_t b = 0; b < nb; b++) {
                        int8_t *t = xa + (mb * nb + b) * 1024 + r * 32;
                        memcpy(t, hi + b * 32, 32);
                        memcpy(t + 512, lo + b * 32, 32);
                        xd[(mb * nb + b) * 16 + r] = d[b];
                        xsum[(mb * nb + b) * 16 + r] = d[b] * (float)s[b];
                    }
                }
                free(q);
            }
        }
    }
    if (!failed) {
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
        {
            uint8_t *bt = bits == 4 ? (uint8_t *)_mm_malloc((size_t)nb * 512, 64) : NULL;
            int32_t cb[2][256] __attribute__((aligned(64)));
            if (bits == 4 && !bt) {
                failed = 1;
            } else {
                configure_q_tiles();
#pragma omp for schedule(static)
                for (int64_t p = 0; p < panels; p++) {
                    const int64_t n0 = p * 16;
                    const uint8_t *pt = bt;
                    if (bits == 4) stage_panel4(tiles + p * nb * 256, nb, bt);
                    else pt = tiles + p * nb * 512;
                    const int cols = N - n0 < 16 ? (int)(N - n0) : 16;
                    const __mmask16 km = (__mmask16)((1u << cols) - 1u);
                    const __m512 bv = bias ? _mm512_maskz_loadu_ps(km, bias + n0) : _mm512_setzero_ps();
                    for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
                        const int64_t mb = m0 / 16;
                        __m512 acc[16];
                        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                        /* tiles 0, 1 take even blocks and 2, 3 odd ones: the next block's
                         * products are issued before this block's sums are scaled */
                        const int8_t *arow = xa + mb * nb * 1024;
                        q_products(arow, pt, 0, 0);
                        for (int64_t b = 0; b < nb; b++) {
                            if (b + 1 < nb) {
                                if (b & 1) q_products(arow, pt, b + 1, 0);
                                else q_products(arow, pt, b + 1, 2);
                            }
                            if (b & 1) {
                                _tile_stored(2, cb[0], 64);
                                _tile_stored(3, cb[1], 64);
                            } else {
                                _tile_stored(0, cb[0], 64);
                                _tile_stored(1, cb[1], 64);
                            }
                            const __m512 sw = ld16s(sc, f32, (p * nb + b) * 16);
                            const __m512 mw = ld16s(mn, f32, (p * nb + b) * 16);
                            const float *dr = xd + (mb * nb + b) * 16, *sr = xsum + (mb * nb + b) * 16;
                            for (int r = 0; r < 16; r++) {
                                const __m512i v = _mm512_add_epi32(
                                    _mm512_slli_epi32(_mm512_load_si512(cb[0] + r * 16), 8),
                                    _mm512_load_si512(cb[1] + r * 16));
                                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v),
                                                         _mm512_mul_ps(sw, _mm512_set1_ps(dr[r])), acc[r]);
                                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sr[r]), acc[r]);
                            }
                        }
                        for (int r = 0; r < 16 && m0 + r < M; r++) {
                            const __m512 v = _mm512_add_ps(acc[r], bv);
                            const int64_t o = (m0 + r) * N + n0;
                            if (y_bf16)
                                _mm256_mask_storeu_epi16((uint16_t *)y + o, km,
                                                         (__m256i)_mm512_cvtneps_pbh(v));
                            else
                                _mm512_mask_storeu_ps((float *)y + o, km, v);
                        }
                    }
                }
                _tile_release();
            }
            if (bt) _mm_free(bt);
        }
    }
    _mm_free(xa);
    _mm_free(xd);
    _mm_free(xsum);
    return failed ? -2 : 0;
}
