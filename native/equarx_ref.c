/* C reference of the int8 block wire format, float32 input (docs/FORMAT.md,
 * equarx_mpi/kernels/int8.py); bit for bit the same results as the numba
 * kernels, and the speed they are measured against.
 *
 *   header a  = max |x| of the block             (float)
 *   code   c  = rint(x * r), r = 127 / a         (ties to even)
 *   decoded   = (c * k) * a,  k = 1 / 127
 *
 * a = 0: codes 0 / -1 keep the sign of each zero.  A block holding Inf or
 * NaN is flagged: a = +Inf, codes 0, and decoding skips it.  For a < 2^-120
 * (r would overflow) values and a are first scaled by 2^64 (exact).
 *
 * Built with -ffp-contract=off: a fused multiply-add would round once where
 * the format rounds twice. */
#include <float.h>
#include <math.h>
#include <string.h>
#include "equarx_ref.h"

#define LEVELS 127.0f
#define TINY 0x1p-120f
#define LIFT 0x1p64f

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t abs_bits(float v) { return f2u(v) & 0x7FFFFFFFu; }

#define INF_BITS 0x7F800000u

/* One block v[:m] (largest magnitude bits max_u) to its codes; returns the
 * header. */
static float emit_block(const float *restrict v, int64_t m, uint32_t max_u,
                        int8_t *restrict codes)
{
    if (max_u >= INF_BITS) {
        memset(codes, 0, (size_t)m);
        return INFINITY;
    }
    if (max_u == 0) {
        for (int64_t j = 0; j < m; j++)
            codes[j] = (int8_t)-(int32_t)(f2u(v[j]) >> 31);
        return 0.0f;
    }
    float a = u2f(max_u);
    if (a >= TINY) {
        float r = LEVELS / a;
        for (int64_t j = 0; j < m; j++)
            codes[j] = (int8_t)(int32_t)rintf(v[j] * r);
    } else {
        float r = LEVELS / (a * LIFT);
        for (int64_t j = 0; j < m; j++)
            codes[j] = (int8_t)(int32_t)rintf((v[j] * LIFT) * r);
    }
    return a;
}

void eqx_encode_f32(const float *src, int64_t n, int64_t block,
                    float *heads, int8_t *codes)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = n - lo < block ? n - lo : block;
        const float *v = src + lo;
        uint32_t max_u = 0;
        for (int64_t j = 0; j < m; j++)
            max_u = abs_bits(v[j]) > max_u ? abs_bits(v[j]) : max_u;
        heads[b] = emit_block(v, m, max_u, codes + lo);
    }
}

int64_t eqx_decode_f32(const float *heads, const int8_t *codes, int64_t n,
                       int64_t block, float *out)
{
    const float k = 1.0f / LEVELS;
    int64_t flagged = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = n - lo < block ? n - lo : block;
        const int8_t *c = codes + lo;
        float a = heads[b];
        if (!(fabsf(a) < INFINITY)) {
            flagged++;
            continue;
        }
        for (int64_t j = 0; j < m; j++)
            out[lo + j] = ((float)c[j] * k) * a;
    }
    return flagged;
}

int64_t eqx_decode_reduce_sum_f32(const float *own, const float *heads,
                                  const int8_t *codes, int64_t n, int64_t block,
                                  float *out, float *scratch)
{
    const float k = 1.0f / LEVELS;
    int64_t flagged = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = n - lo < block ? n - lo : block;
        const int8_t *c = codes + lo;
        float a = heads[b];
        uint32_t max_u = 0;
        if (!(fabsf(a) < INFINITY)) {
            flagged++;
            continue;
        }
        for (int64_t j = 0; j < m; j++) {
            scratch[j] = own[lo + j] + ((float)c[j] * k) * a;
            max_u = abs_bits(scratch[j]) > max_u ? abs_bits(scratch[j]) : max_u;
        }
        if (max_u >= INF_BITS) {
            flagged++;
            continue;
        }
        memcpy(out + lo, scratch, (size_t)m * sizeof(float));
    }
    return flagged;
}

void eqx_decode_reduce_encode_sum_f32(const float *own, const float *heads_in,
                                      const int8_t *codes_in, float *heads_out,
                                      int8_t *codes_out, int64_t n, int64_t block,
                                      float *scratch)
{
    const float k = 1.0f / LEVELS;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = n - lo < block ? n - lo : block;
        const int8_t *c = codes_in + lo;
        const float *x = own + lo;
        float *restrict v = scratch;
        float a = heads_in[b];
        uint32_t max_u = INF_BITS;
        /* the whole input block is read before any output is written */
        if (fabsf(a) < INFINITY) {
            max_u = 0;
            for (int64_t j = 0; j < m; j++) {
                v[j] = x[j] + ((float)c[j] * k) * a;
                max_u = abs_bits(v[j]) > max_u ? abs_bits(v[j]) : max_u;
            }
        }
        heads_out[b] = emit_block(v, m, max_u, codes_out + lo);
    }
}

void eqx_copy_f32(const float *src, float *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}
