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
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cbf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

const char *gq_amx_variant(void) { return "amx"; }

/* Ask the kernel for the AMX tile state (Linux grants it per process); 0 when granted. */
int gq_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

static void configure_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
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
