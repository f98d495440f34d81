/* C reference of the int8 block wire format, float32 input (the format is
 * described at the top of equarx_mpi/kernels.py); bit for bit the same
 * results as the numba kernels, and the speed they are measured against.
 *
 * Built with -ffp-contract=off: a fused multiply-add in decode-reduce would
 * round once where the format rounds twice. */
#include <float.h>
#include <math.h>
#include <string.h>
#include "equarx_ref.h"

#define CODE_NONFINITE (-128)

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#define INF_BITS 0x7F800000u
static uint32_t abs_bits(float v) { return f2u(v) & 0x7FFFFFFFu; }

/* Whether codes[:m] holds the reserved code; a byte min vectorizes, and
 * blocks without it decode without a select. */
static int has_reserved(const int8_t *codes, int64_t m)
{
    int8_t cmin = 0;
    for (int64_t j = 0; j < m; j++)
        cmin = codes[j] < cmin ? codes[j] : cmin;
    return cmin == CODE_NONFINITE;
}

/* Decoded value of code c; sp is the block's non-finite value. */
static float dequant(int8_t c, float s, float sp)
{
    float d = (float)c * s;
    return c == CODE_NONFINITE ? sp : d;
}

/* (|scale|, value of the reserved code) of a block */
static float decoder(float scale, float *sp)
{
    uint32_t su = f2u(scale);
    if (su & 0x80000000u)
        *sp = (su & 1u) ? -INFINITY : INFINITY;
    else
        *sp = NAN;
    return fabsf(scale);
}

/* The block's scale; max_u is the largest magnitude bits of v[:m]. */
static float block_scale(const float *v, int64_t m, uint32_t max_u)
{
    int finite = max_u < INF_BITS;
    if (!finite) {                       /* the absmax is over finite values */
        max_u = 0;
        for (int64_t j = 0; j < m; j++)
            if (abs_bits(v[j]) < INF_BITS && abs_bits(v[j]) > max_u)
                max_u = abs_bits(v[j]);
    }
    float amax = u2f(max_u);
    float scale = (float)((double)amax / 127.0);
    if (scale == 0.0f && amax > 0.0f)
        scale = u2f(1u);                 /* smallest subnormal */
    if (!finite) {
        int kinds = 0;                   /* 1: +Inf, 2: -Inf, 4: NaN */
        for (int64_t j = 0; j < m; j++) {
            if (v[j] != v[j]) kinds |= 4;
            else if (v[j] == INFINITY) kinds |= 1;
            else if (v[j] == -INFINITY) kinds |= 2;
        }
        uint32_t su = f2u(scale);
        if (kinds == 1) su = (su & 0xFFFFFFFEu) | 0x80000000u;
        else if (kinds == 2) su |= 0x80000001u;
        scale = u2f(su);
    }
    return scale;
}

/* codes = clamp(rint(v / |scale|), -127, 127), -128 where v is not finite.
 * With a normal scale no clamp is needed: the scale is absmax/127 rounded
 * once to float32, so |v / scale| <= 127 (1 + 2^-23) and rint gives at most
 * 127.  Non-finite lanes divide 0 instead, so every conversion is defined. */
static void quantize(const float *restrict v, int64_t m, float scale,
                     int all_finite, int8_t *restrict codes)
{
    float s = fabsf(scale);
    if (s >= FLT_MIN && all_finite) {
        for (int64_t j = 0; j < m; j++)
            codes[j] = (int8_t)(int32_t)rintf(v[j] / s);
    } else if (s >= FLT_MIN) {
        for (int64_t j = 0; j < m; j++) {
            float x = v[j];
            int fin = fabsf(x) < INFINITY;
            int8_t c = (int8_t)(int32_t)rintf((fin ? x : 0.0f) / s);
            codes[j] = fin ? c : CODE_NONFINITE;
        }
    } else if (s == 0.0f) {
        for (int64_t j = 0; j < m; j++)
            codes[j] = fabsf(v[j]) < INFINITY ? 0 : CODE_NONFINITE;
    } else {
        /* subnormal scale: clamping before rint is the same as after (rint
         * is monotone and fixes +-127); this form also maps NaN to -127 */
        for (int64_t j = 0; j < m; j++) {
            float x = v[j];
            float q = x / s;
            q = q > -127.0f ? q : -127.0f;
            q = q < 127.0f ? q : 127.0f;
            int8_t c = (int8_t)(int32_t)rintf(q);
            codes[j] = fabsf(x) < INFINITY ? c : CODE_NONFINITE;
        }
    }
}

/* One block of values v[:m] to its scale and codes. */
static float emit_block(const float *restrict v, int64_t m, uint32_t max_u,
                        int8_t *restrict codes)
{
    float scale = block_scale(v, m, max_u);
    quantize(v, m, scale, max_u < INF_BITS, codes);
    return scale;
}

void eqx_encode_f32(const float *src, int64_t n, int64_t block,
                    float *scales, int8_t *codes)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = n - lo < block ? n - lo : block;
        const float *v = src + lo;
        uint32_t max_u = 0;
        for (int64_t j = 0; j < m; j++)
            max_u = abs_bits(v[j]) > max_u ? abs_bits(v[j]) : max_u;
        scales[b] = emit_block(v, m, max_u, codes + lo);
    }
}

void eqx_decode_f32(const float *scales, const int8_t *codes, int64_t n,
                    int64_t block, float *out)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = n - lo < block ? n - lo : block;
        const int8_t *c = codes + lo;
        float sp, s = decoder(scales[b], &sp);
        if (has_reserved(c, m))
            for (int64_t j = 0; j < m; j++)
                out[lo + j] = dequant(c[j], s, sp);
        else
            for (int64_t j = 0; j < m; j++)
                out[lo + j] = (float)c[j] * s;
    }
}

void eqx_decode_reduce_sum_f32(const float *own, const float *scales,
                               const int8_t *codes, int64_t n, int64_t block,
                               float *out)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = n - lo < block ? n - lo : block;
        const int8_t *c = codes + lo;
        float sp, s = decoder(scales[b], &sp);
        if (has_reserved(c, m))
            for (int64_t j = 0; j < m; j++)
                out[lo + j] = own[lo + j] + dequant(c[j], s, sp);
        else
            for (int64_t j = 0; j < m; j++)
                out[lo + j] = own[lo + j] + (float)c[j] * s;
    }
}

void eqx_decode_reduce_encode_sum_f32(const float *own, const float *scales_in,
                                      const int8_t *codes_in, float *scales_out,
                                      int8_t *codes_out, int64_t n, int64_t block,
                                      float *scratch)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = n - lo < block ? n - lo : block;
        const int8_t *c = codes_in + lo;
        const float *x = own + lo;
        float *restrict v = scratch;
        float sp, s = decoder(scales_in[b], &sp);
        uint32_t max_u = 0;
        /* the whole input block is read before any output is written */
        if (has_reserved(c, m))
            for (int64_t j = 0; j < m; j++) {
                v[j] = x[j] + dequant(c[j], s, sp);
                max_u = abs_bits(v[j]) > max_u ? abs_bits(v[j]) : max_u;
            }
        else
            for (int64_t j = 0; j < m; j++) {
                v[j] = x[j] + (float)c[j] * s;
                max_u = abs_bits(v[j]) > max_u ? abs_bits(v[j]) : max_u;
            }
        scales_out[b] = emit_block(v, m, max_u, codes_out + lo);
    }
}

void eqx_copy_f32(const float *src, float *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}
