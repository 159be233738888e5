/* Causal extend attention on AMX bf16 tiles over the paged KV pool (`cpu_amx`,
 * plugins/attention/cpu_c/amx.py).
 *
 * For a batch of requests, request b adding n_b new tokens after p_b cached ones (its K/V
 * already written to the pool), new token j of b sits at position p_b + j and attends keys
 * 0 .. p_b + j of b (the last `window` of them when window > 0), read from the pool through
 * b's slot table. Flash attention in blocks:
 *
 * 1. Pack (parallel over (request, KV head, key block of 32)): each key block of each
 *    (request, KV head) is copied once from the pool into a scratch buffer in the tiles'
 *    operand layouts, then read by every query block and every query head of the GQA group:
 *    - K as TDPBF16PS's B operand for S = Q K^T: per key block and 32-dim chunk c, two
 *      tiles (keys 0-15, 16-31) of 16 rows x 16 dword columns; row r, column j holds the
 *      pair (K[j][32c + 2r], K[j][32c + 2r + 1]);
 *    - V as the B operand for O += P V: per key block and 16-dim chunk c, one tile; row r,
 *      column n holds the pair (V[2r][16c + n], V[2r + 1][16c + n]).
 *    Keys past the request's length are zeros.
 * 2. Attend (parallel over (request, query head, query block of 16 rows), the latest query
 *    blocks first: they have the most keys): the block's 16 query rows are copied (zero
 *    padded) into an A tile buffer; for each key block the causal / window ranges leave
 *    visible (fully masked blocks are never touched), two C tiles take S (16 x 32 fp32), the
 *    online softmax (running max and sum per row, fp32, scale then soft-cap then mask) turns
 *    it into P rounded to bf16 (the A tile of P V), O (16 x Dv fp32, in memory) is rescaled
 *    by exp(m_old - m_new) and the P V tiles are added. The row sums add P as rounded, so the
 *    normalisation matches the weights V was multiplied by. Output bf16 (nearest even).
 *
 * The tile primitives are macros: built with -DAMX_EMULATE (or without AMX in the compiler
 * flags), they are plain C over the same bytes (a thread's eight 1 KiB tiles), so the whole
 * algorithm (layouts, masks, softmax) runs and is tested on CPUs without AMX. The softmax and
 * packing loops are plain C that the compiler vectorizes (AVX-512 in the `amx` build).
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if !defined(AMX_EMULATE) && !(defined(__AMX_TILE__) && defined(__AMX_BF16__))
#define AMX_EMULATE 1
#endif

#ifndef AMX_EMULATE
#include <immintrin.h>
#define CAMX_REQUEST /* amx_request_tiles */
#endif
#include "camx.h" /* tile_config */
#include "cexp.h" /* exp_neg */

#ifdef AMX_EMULATE
/* A thread's tiles: 16 rows of 64 bytes each (the only shape this kernel configures). */
static _Thread_local uint8_t emu_tile[8][16 * 64] __attribute__((aligned(64)));

static void emu_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy(emu_tile[t] + r * 64, (const char *)p + r * stride, 64);
}
static void emu_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy((char *)p + r * stride, emu_tile[t] + r * 64, 64);
}
/* TDPBF16PS: C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] (fp32) */
static void emu_dpbf16(int c, int a, int b) {
    float *C = (float *)emu_tile[c];
    const uint16_t *A = (const uint16_t *)emu_tile[a], *B = (const uint16_t *)emu_tile[b];
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc = C[m * 16 + n];
            for (int k = 0; k < 16; k++) {
                acc += bf2f(A[m * 32 + 2 * k]) * bf2f(B[k * 32 + 2 * n]);
                acc += bf2f(A[m * 32 + 2 * k + 1]) * bf2f(B[k * 32 + 2 * n + 1]);
            }
            C[m * 16 + n] = acc;
        }
}
#define TILE_CONFIG(cfg) ((void)(cfg))
#define TILE_RELEASE() ((void)0)
#define TILE_ZERO(t) memset(emu_tile[t], 0, 1024)
#define TILE_LOAD(t, p, stride) emu_load(t, p, stride)
#define TILE_STORE(t, p, stride) emu_store(t, p, stride)
#define TILE_DP(c, a, b) emu_dpbf16(c, a, b)
const char *amx_attn_variant(void) { return "emulated"; }
int amx_attn_init(void) { return 0; }
#else
#define TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_RELEASE() _tile_release()
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
const char *amx_attn_variant(void) { return "amx"; }
/* Ask the kernel for the AMX tile state (Linux grants it per process); 0 when granted. */
int amx_attn_init(void) { return amx_request_tiles(); }
#endif

#define QB 16 /* query rows a block (tile rows) */
#define KB 32 /* keys a block (two score tiles; one P tile's k extent) */

/* cap * tanh(s / cap) through exp_neg: tanh|x| = (1 - e^-2|x|) / (1 + e^-2|x|) */
static inline float soft_cap(float s, float cap) {
    const float x = s / cap, ax = fabsf(x);
    const float e = exp_neg(-2.0f * ax);
    const float t = (1.0f - e) / (1.0f + e);
    return cap * (x < 0.0f ? -t : t);
}

/* fp32 -> bf16 nearest even, for finite values (P and the output; NaN-free here) */
static inline uint16_t to_bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Key block kbi (keys lo + 32 kbi ..) of request slots `sl`, KV head g, into the tile layouts
 * (module comment); keys at L and past are zeros. */
static void pack_block(const uint16_t *kb, const uint16_t *vb, int64_t ks, int64_t vs,
                       const int64_t *sl, int64_t lo, int64_t L, int64_t kbi, int64_t g,
                       int64_t D, int64_t Dv, uint16_t *kp, uint16_t *vp) {
    const int64_t NC = D / 32, NV = Dv / 16, k0 = lo + kbi * KB;
    uint32_t *kp32 = (uint32_t *)kp;
    for (int64_t j = 0; j < KB; j++) {
        const int64_t pos = k0 + j;
        const int t = (int)(j / 16), col = (int)(j % 16);
        const int r2 = (int)(j / 2), e = (int)(j % 2);
        if (pos < L) {
            const uint32_t *kr = (const uint32_t *)(kb + sl[pos] * ks + g * D);
            const uint16_t *vr = vb + sl[pos] * vs + g * Dv;
            for (int64_t c = 0; c < NC; c++) {
                uint32_t *tile = kp32 + (c * 2 + t) * 256;
                for (int r = 0; r < 16; r++) tile[r * 16 + col] = kr[c * 16 + r];
            }
            for (int64_t c = 0; c < NV; c++) {
                uint16_t *tile = vp + c * 512;
                for (int n = 0; n < 16; n++) tile[r2 * 32 + n * 2 + e] = vr[c * 16 + n];
            }
        } else {
            for (int64_t c = 0; c < NC; c++) {
                uint32_t *tile = kp32 + (c * 2 + t) * 256;
                for (int r = 0; r < 16; r++) tile[r * 16 + col] = 0;
            }
            for (int64_t c = 0; c < NV; c++) {
                uint16_t *tile = vp + c * 512;
                for (int n = 0; n < 16; n++) tile[r2 * 32 + n * 2 + e] = 0;
            }
        }
    }
}

/* q [T, H, D] bf16 (requests back to back, request b's rows from starts[b]); kb [S, Hkv, D],
 * vb [S, Hkv, Dv] bf16 pool buffers whose slots are ks / vs elements apart; slots [B, ss]
 * int64; prefix[b] cached and ext[b] new tokens; window > 0 keeps the last `window` keys of
 * each query; cap > 0 soft-caps the scaled scores; out [T, H * Dv] bf16.
 * Returns 0; -1 for a shape it does not take (D not a multiple of 32, Dv of 16, H not a
 * multiple of Hkv); -2 when out of memory. With real tiles, call only after amx_attn_init()
 * returned 0 in this process: a tile instruction without the permission kills it. */
int amx_attn_extend(const uint16_t *q, const uint16_t *kb, const uint16_t *vb, int64_t ks,
                    int64_t vs, const int64_t *slots, int64_t ss, const int64_t *prefix,
                    const int64_t *ext, const int64_t *starts, int64_t B, int64_t H,
                    int64_t Hkv, int64_t D, int64_t Dv, float scale, int64_t window, float cap,
                    uint16_t *out, int nthreads) {
    if (D % 32 || Dv % 16 || D <= 0 || Dv <= 0 || Hkv <= 0 || H % Hkv) return -1;
    if (nthreads < 1) nthreads = 1;
    const int64_t G = H / Hkv, NC = D / 32, NV = Dv / 16;
    /* per request: first visible key, key blocks, first packed block, query blocks */
    int64_t *info = (int64_t *)malloc(sizeof(int64_t) * (size_t)(4 * B + 1));
    if (!info) return -2;
    int64_t *klo = info, *nkb = info + B, *base = info + 2 * B, *nqb = info + 3 * B;
    int64_t blocks = 0, items = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t P = prefix[b], L = P + ext[b];
        klo[b] = window > 0 && P - window + 1 > 0 ? P - window + 1 : 0;
        nkb[b] = ext[b] > 0 ? (L - klo[b] + KB - 1) / KB : 0;
        base[b] = blocks;
        blocks += nkb[b] * Hkv;
        nqb[b] = (ext[b] + QB - 1) / QB;
        items += nqb[b] * H;
    }
    uint16_t *kp = (uint16_t *)aligned_alloc(64, (size_t)(blocks > 0 ? blocks : 1) * KB * D * 2);
    uint16_t *vp = (uint16_t *)aligned_alloc(64, (size_t)(blocks > 0 ? blocks : 1) * KB * Dv * 2);
    int64_t *item = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * (items > 0 ? items : 1)));
    if (!kp || !vp || !item) {
        free(kp), free(vp), free(item), free(info);
        return -2;
    }
    /* work items (request, query block, query head), each request's last blocks first */
    int64_t it = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t qb = nqb[b] - 1; qb >= 0; qb--)
            for (int64_t h = 0; h < H; h++) {
                item[3 * it] = b, item[3 * it + 1] = qb, item[3 * it + 2] = h;
                it++;
            }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        /* phase 1: pack every (request, KV head, key block) once */
#pragma omp for schedule(dynamic, 4)
        for (int64_t blk = 0; blk < blocks; blk++) {
            int64_t b = 0;
            while (b + 1 < B && base[b + 1] <= blk) b++;
            const int64_t rel = blk - base[b], g = rel / nkb[b], kbi = rel % nkb[b];
            pack_block(kb, vb, ks, vs, slots + b * ss, klo[b], prefix[b] + ext[b], kbi, g, D,
                       Dv, kp + blk * KB * D, vp + blk * KB * Dv);
        }
        /* (the implicit barrier of the loop above: every block is packed before use) */
        uint16_t *qt = (uint16_t *)aligned_alloc(64, (size_t)QB * D * 2);
        float *o = (float *)aligned_alloc(64, (size_t)QB * Dv * 4);
        {
            /* a thread without its buffers still takes part in the loop (every thread must
             * meet a worksharing loop), failing its items */
            const int ok = qt && o;
            if (!ok) failed = 1;
            float s[QB * KB] __attribute__((aligned(64)));
            uint16_t pb[QB * KB] __attribute__((aligned(64)));
            float pv[QB * 16] __attribute__((aligned(64)));
            float m[QB], l[QB], alpha[QB];
            tile_config cfg;
            tile_config_16x64(&cfg);
            if (ok) TILE_CONFIG(&cfg);
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < items; w++) {
                if (!ok) continue;
                const int64_t b = item[3 * w], qb = item[3 * w + 1], h = item[3 * w + 2];
                const int64_t g = h / G, P = prefix[b], L = P + ext[b], lo = klo[b];
                const int64_t rows = ext[b] - qb * QB < QB ? ext[b] - qb * QB : QB;
                const int64_t qp0 = P + qb * QB, qlast = qp0 + rows - 1;
                const int64_t t0 = starts[b] + qb * QB;
                for (int64_t i = 0; i < QB; i++) {
                    if (i < rows) memcpy(qt + i * D, q + ((t0 + i) * H + h) * D, (size_t)D * 2);
                    else memset(qt + i * D, 0, (size_t)D * 2);
                    m[i] = -INFINITY;
                    l[i] = 0.0f;
                }
                memset(o, 0, (size_t)QB * Dv * 4);
                /* key blocks holding a key some row of the block sees */
                const int64_t first = window > 0 && qp0 - window + 1 > lo ? qp0 - window + 1 : lo;
                const int64_t kb0 = (first - lo) / KB, kb1 = (qlast - lo) / KB;
                const uint16_t *kbase = kp + (base[b] + g * nkb[b]) * KB * D;
                const uint16_t *vbase = vp + (base[b] + g * nkb[b]) * KB * Dv;
                for (int64_t kbi = kb0; kbi <= kb1; kbi++) {
                    const int64_t k0 = lo + kbi * KB;
                    const uint16_t *kt = kbase + kbi * KB * D;
                    TILE_ZERO(0);
                    TILE_ZERO(1);
                    for (int64_t c = 0; c < NC; c++) {
                        TILE_LOAD(2, qt + c * 32, D * 2);
                        TILE_LOAD(3, kt + c * 1024, 64);
                        TILE_LOAD(4, kt + c * 1024 + 512, 64);
                        TILE_DP(0, 2, 3);
                        TILE_DP(1, 2, 4);
                    }
                    TILE_STORE(0, s, KB * 4);
                    TILE_STORE(1, s + 16, KB * 4);
                    /* a mask only where some key is past a row's position or out of its window */
                    const int masked = k0 + KB - 1 > qp0 ||
                                       (window > 0 && k0 <= qlast - window);
                    for (int64_t i = 0; i < QB; i++) {
                        float *si = s + i * KB;
                        const int64_t qp = qp0 + i;
                        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
                        for (int j = 0; j < KB; j++) {
                            float v = si[j] * scale;
                            if (cap > 0.0f) v = soft_cap(v, cap);
                            if (masked) {
                                const int64_t kp_ = k0 + j;
                                const int vis = kp_ <= qp && kp_ < L &&
                                                (window <= 0 || kp_ > qp - window);
                                v = vis ? v : -INFINITY;
                            }
                            si[j] = v;
                            mx = v > mx ? v : mx;
                        }
                        const float mnew = mx > m[i] ? mx : m[i];
                        uint16_t *pi = pb + i * KB;
                        if (mnew == -INFINITY) { /* nothing visible yet: P = 0, O and l stay 0 */
                            memset(pi, 0, KB * 2);
                            alpha[i] = 1.0f;
                            continue;
                        }
                        alpha[i] = exp_neg(m[i] - mnew);
                        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                        for (int j = 0; j < KB; j++) {
                            const float e = si[j] == -INFINITY ? 0.0f : exp_neg(si[j] - mnew);
                            const uint16_t r = to_bf(e);
                            pi[j] = r;
                            sum += bf2f(r);
                        }
                        l[i] = l[i] * alpha[i] + sum;
                        m[i] = mnew;
                    }
                    for (int64_t i = 0; i < QB; i++) {
                        const float a = alpha[i];
                        if (a == 1.0f) continue; /* the row's max held (the usual case later on) */
                        float *oi = o + i * Dv;
#pragma omp simd
                        for (int64_t d = 0; d < Dv; d++) oi[d] *= a;
                    }
                    TILE_LOAD(6, pb, KB * 2);
                    const uint16_t *vt = vbase + kbi * KB * Dv;
                    for (int64_t c = 0; c < NV; c++) {
                        TILE_ZERO(5);
                        TILE_LOAD(7, vt + c * 512, 64);
                        TILE_DP(5, 6, 7);
                        TILE_STORE(5, pv, 64);
                        for (int64_t i = 0; i < QB; i++) {
                            float *oi = o + i * Dv + c * 16;
                            const float *pvi = pv + i * 16;
#pragma omp simd
                            for (int n = 0; n < 16; n++) oi[n] += pvi[n];
                        }
                    }
                }
                for (int64_t i = 0; i < rows; i++) {
                    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
                    const float *oi = o + i * Dv;
                    uint16_t *dst = out + ((t0 + i) * H + h) * Dv;
#pragma omp simd
                    for (int64_t d = 0; d < Dv; d++) dst[d] = to_bf(oi[d] * inv);
                }
            }
            if (ok) TILE_RELEASE();
        }
        free(qt);
        free(o);
    }
    free(kp), free(vp), free(item), free(info);
    return failed ? -2 : 0;
}
