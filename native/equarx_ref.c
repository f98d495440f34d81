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

/* Codes with a meaning of their own in flagged blocks (a block holding Inf
 * or NaN; its scale has the sign bit set). */
#define CODE_POS_INF 127
#define CODE_NEG_INF (-127)
#define CODE_NAN (-128)

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#define INF_BITS 0x7F800000u
static uint32_t abs_bits(float v) { return f2u(v) & 0x7FFFFFFFu; }

static int flagged(float scale) { return (f2u(scale) & 0x80000000u) != 0; }

/* Decoded code c of a flagged block. */
static float dequant_flagged(int8_t c, float s)
{
    if (c == CODE_POS_INF) return INFINITY;
    if (c == CODE_NEG_INF) return -INFINITY;
    if (c == CODE_NAN) return NAN;
    return (float)c * s;
}

/* codes = clamp(rint(v / scale), -127, 127) for a block of finite values.
 * With a normal scale no clamp is needed: the scale is absmax/127 rounded
 * once to float32, so |v / scale| <= 127 (1 + 2^-23) and rint gives at most
 * 127. */
static void quantize(const float *restrict v, int64_t m, float s,
                     int8_t *restrict codes)
{
    if (s >= FLT_MIN) {
        for (int64_t j = 0; j < m; j++)
            codes[j] = (int8_t)(int32_t)rintf(v[j] / s);
    } else if (s == 0.0f) {
        memset(codes, 0, (size_t)m);
    } else {
        /* subnormal scale: clamping before rint is the same as after (rint
         * is monotone and fixes +-127) */
        for (int64_t j = 0; j < m; j++) {
            float q = v[j] / s;
            q = q > -127.0f ? q : -127.0f;
            q = q < 127.0f ? q : 127.0f;
            codes[j] = (int8_t)(int32_t)rintf(q);
        }
    }
}

/* A block holding Inf or NaN: finite values clamp to +-126, the rest take
 * the special codes. */
static void quantize_flagged(const float *v, int64_t m, float s, int8_t *codes)
{
    for (int64_t j = 0; j < m; j++) {
        float x = v[j];
        int c;
        if (fabsf(x) < INFINITY) {
            if (s == 0.0f) {
                c = 0;
            } else {
                float q = x / s;
                q = q > -126.0f ? q : -126.0f;
                q = q < 126.0f ? q : 126.0f;
                c = (int)rintf(q);
            }
        } else if (x > 0) {
            c = CODE_POS_INF;
        } else if (x < 0) {
            c = CODE_NEG_INF;
        } else {
            c = CODE_NAN;
        }
        codes[j] = (int8_t)c;
    }
}

/* One block of values v[:m] (largest magnitude bits max_u) to its scale and
 * codes; returns the scale as sent. */
static float emit_block(const float *restrict v, int64_t m, uint32_t max_u,
                        int8_t *restrict codes)
{
    int finite = max_u < INF_BITS;
    if (!finite) {                       /* the absmax is over finite values */
        max_u = 0;
        for (int64_t j = 0; j < m; j++)
            if (abs_bits(v[j]) < INF_BITS && abs_bits(v[j]) > max_u)
                max_u = abs_bits(v[j]);
    }
    float amax = u2f(max_u);
    float scale = (float)((double)amax / (finite ? 127.0 : 126.0));
    if (scale == 0.0f && amax > 0.0f)
        scale = u2f(1u);                 /* smallest subnormal */
    if (finite) {
        quantize(v, m, scale, codes);
        return scale;
    }
    quantize_flagged(v, m, scale, codes);
    return u2f(f2u(scale) | 0x80000000u);
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
        float s = fabsf(scales[b]);
        if (flagged(scales[b]))
            for (int64_t j = 0; j < m; j++)
                out[lo + j] = dequant_flagged(c[j], s);
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
        float s = fabsf(scales[b]);
        if (flagged(scales[b]))
            for (int64_t j = 0; j < m; j++)
                out[lo + j] = own[lo + j] + dequant_flagged(c[j], s);
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
        float s = fabsf(scales_in[b]);
        uint32_t max_u = 0;
        /* the whole input block is read before any output is written */
        if (flagged(scales_in[b]))
            for (int64_t j = 0; j < m; j++) {
                v[j] = x[j] + dequant_flagged(c[j], s);
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
