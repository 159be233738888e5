/* e^x for the plugins' C kernels (softmax numerators). plugins/_kit/cbuild.py puts this directory
 * on the include path and hashes this file into every build's key. */
#ifndef CORE_CEXP_H
#define CORE_CEXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

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
#endif
