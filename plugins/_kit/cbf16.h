/* fp32 <-> bf16 for the plugins' C kernels (included by their sources; plugins/_kit/cbuild.py puts
 * this directory on the include path and hashes this file into every build's key). */
#ifndef CORE_CBF16_H
#define CORE_CBF16_H
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, a NaN kept a NaN (torch's conversion) */
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* element i of an fp32 (bf 0) or bf16 (bf 1) array, as fp32 */
static inline float ld(const void *p, int bf, int64_t i) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* element i of an fp32 or bf16 array = v (rounded for bf16) */
static inline void st(void *p, int bf, int64_t i, float v) {
    if (bf) ((uint16_t *)p)[i] = f2bf(v);
    else ((float *)p)[i] = v;
}
#endif
