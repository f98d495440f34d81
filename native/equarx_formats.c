/* C reference of the int4, fp8 and affine wire formats, float32 input, SUM,
 * round to nearest (docs/FORMAT.md; equarx_mpi/kernels/int4.py, fp8.py,
 * affine.py): bit for bit the numba kernels' results, written separately.
 *
 *   int4    a = max |x|;  c = rint(x * (7 / a)) in [-7, 7];  (c * (1/7)) * a
 *   fp8     a = max |x|;  c = e4m3(x * (448 / a));  (e4m3(c) * (1/448)) * a
 *   affine  lo, hi = min, max;  t = rint((x*s - lo*s) * (L / (hi*s - lo*s)));
 *           lo (t = 0), hi (t = L), else (lo*s + (t * (1/L)) * (hi*s - lo*s)) / s
 *           clamped to [lo, hi]; s = 1/2 if hi - lo overflows, 2^64 if it is
 *           below 2^-100, else 1
 *
 * Blocks holding Inf or NaN are flagged (a = +Inf, or lo = -Inf and hi =
 * +Inf; codes 0) and skipped by decodes.  For a < 2^-100 the symmetric
 * formats first scale values and a by 2^64 (exact).  Built with
 * -ffp-contract=off, like equarx_ref.c. */
#include <math.h>
#include <string.h>
#include "equarx_formats.h"

#define TINY 0x1p-100f
#define LIFT 0x1p64f
#define INF_BITS 0x7F800000u

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t abs_bits(float v) { return f2u(v) & 0x7FFFFFFFu; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static uint32_t abs_max(const float *v, int64_t m)
{
    uint32_t mx = 0;
    for (int64_t j = 0; j < m; j++)
        mx = abs_bits(v[j]) > mx ? abs_bits(v[j]) : mx;
    return mx;
}

/* --- int4 ------------------------------------------------------------------ */

static uint8_t pack(int32_t c0, int32_t c1)
{
    return (uint8_t)((c0 & 15) | ((c1 & 15) << 4));
}

static int32_t nibble(uint8_t b, int high)
{
    int32_t v = high ? b >> 4 : b & 15;
    return v - ((v & 8) << 1);           /* 4-bit two's complement */
}

static float i4_emit(const float *restrict v, int64_t m, uint32_t max_u,
                     uint8_t *restrict codes)
{
    int64_t half = m / 2;
    if (max_u >= INF_BITS) {
        memset(codes, 0, (size_t)((m + 1) / 2));
        return INFINITY;
    }
    if (max_u == 0) {                    /* a zero block: -0.0 -> code -1 */
        for (int64_t j = 0; j < half; j++)
            codes[j] = pack(-(int32_t)(f2u(v[2 * j]) >> 31), -(int32_t)(f2u(v[2 * j + 1]) >> 31));
        if (m & 1)
            codes[half] = pack(-(int32_t)(f2u(v[m - 1]) >> 31), 0);
        return 0.0f;
    }
    float a = u2f(max_u);
    float lift = a < TINY ? LIFT : 1.0f;
    float r = 7.0f / (a * lift);
    for (int64_t j = 0; j < half; j++)
        codes[j] = pack((int32_t)rintf((v[2 * j] * lift) * r),
                        (int32_t)rintf((v[2 * j + 1] * lift) * r));
    if (m & 1)
        codes[half] = pack((int32_t)rintf((v[m - 1] * lift) * r), 0);
    return a;
}

void eqx_i4_encode_f32(const float *src, int64_t n, int64_t block,
                       float *heads, uint8_t *codes)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        heads[b] = i4_emit(src + lo, m, abs_max(src + lo, m), codes + lo / 2);
    }
}

int64_t eqx_i4_decode_f32(const float *heads, const uint8_t *codes, int64_t n,
                          int64_t block, float *out)
{
    const float k = 1.0f / 7.0f;
    int64_t flagged = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        float a = heads[b];
        if (!(fabsf(a) < INFINITY)) {
            flagged++;
            continue;
        }
        for (int64_t j = 0; j < m; j++)
            out[lo + j] = ((float)nibble(codes[(lo + j) / 2], j & 1) * k) * a;
    }
    return flagged;
}

/* scratch[:m] = own + D(block); returns the largest magnitude bits (those of
 * Inf for a flagged block) */
static uint32_t i4_reduce(const float *own, float a, const uint8_t *c, int64_t m,
                          float *scratch)
{
    const float k = 1.0f / 7.0f;
    uint32_t max_u = 0;
    if (!(fabsf(a) < INFINITY))
        return INF_BITS;
    for (int64_t j = 0; j < m; j++) {
        scratch[j] = own[j] + ((float)nibble(c[j / 2], j & 1) * k) * a;
        max_u = abs_bits(scratch[j]) > max_u ? abs_bits(scratch[j]) : max_u;
    }
    return max_u;
}

int64_t eqx_i4_decode_reduce_sum_f32(const float *own, const float *heads,
                                     const uint8_t *codes, int64_t n, int64_t block,
                                     float *out, float *scratch)
{
    int64_t flagged = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        if (i4_reduce(own + lo, heads[b], codes + lo / 2, m, scratch) >= INF_BITS) {
            flagged++;
            continue;
        }
        memcpy(out + lo, scratch, (size_t)m * sizeof(float));
    }
    return flagged;
}

void eqx_i4_decode_reduce_encode_sum_f32(const float *own, const float *heads_in,
                                         const uint8_t *codes_in, float *heads_out,
                                         uint8_t *codes_out, int64_t n, int64_t block,
                                         float *scratch)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        uint32_t max_u = i4_reduce(own + lo, heads_in[b], codes_in + lo / 2, m, scratch);
        heads_out[b] = i4_emit(scratch, m, max_u, codes_out + lo / 2);
    }
}

/* --- fp8 (e4m3) ------------------------------------------------------------ */

/* |y| <= 448 (1 + 2^-24)^2 to e4m3 bits, round to nearest even, sign of y */
static uint8_t e4m3_bits(float y)
{
    uint32_t u = f2u(y), s = (u >> 24) & 0x80u, mag;
    u &= 0x7FFFFFFFu;
    if (u < (121u << 23))                /* below 2^-6: the subnormal grid 2^-9 */
        mag = (uint32_t)rintf(u2f(u) * 512.0f);
    else                                 /* keep 3 mantissa bits, then rebias */
        mag = ((u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20) - (120u << 3);
    return (uint8_t)(s | (mag < 0x7Eu ? mag : 0x7Eu));
}

/* fl(e4m3_value(c) * fl(1/448)) */
static const float *f8_table(void)
{
    static float t[256];
    static int ready;
    if (!ready) {
        const float k = 1.0f / 448.0f;
        for (int c = 0; c < 256; c++) {
            int e = (c >> 3) & 15, mant = c & 7;
            float v = e == 0 ? ldexpf((float)mant, -9) : ldexpf((float)(8 + mant), e - 10);
            if (e == 15 && mant == 7)
                v = NAN;
            t[c] = ((c & 0x80) ? -v : v) * k;
        }
        ready = 1;
    }
    return t;
}

static float f8_emit(const float *restrict v, int64_t m, uint32_t max_u,
                     uint8_t *restrict codes)
{
    if (max_u >= INF_BITS) {
        memset(codes, 0, (size_t)m);
        return INFINITY;
    }
    if (max_u == 0) {                    /* codes +-0 keep each zero's sign */
        for (int64_t j = 0; j < m; j++)
            codes[j] = (uint8_t)((f2u(v[j]) >> 24) & 0x80u);
        return 0.0f;
    }
    float a = u2f(max_u);
    float lift = a < TINY ? LIFT : 1.0f;
    float r = 448.0f / (a * lift);
    for (int64_t j = 0; j < m; j++)
        codes[j] = e4m3_bits((v[j] * lift) * r);
    return a;
}

void eqx_f8_encode_f32(const float *src, int64_t n, int64_t block,
                       float *heads, uint8_t *codes)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        heads[b] = f8_emit(src + lo, m, abs_max(src + lo, m), codes + lo);
    }
}

int64_t eqx_f8_decode_f32(const float *heads, const uint8_t *codes, int64_t n,
                          int64_t block, float *out)
{
    const float *t = f8_table();
    int64_t flagged = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        float a = heads[b];
        if (!(fabsf(a) < INFINITY)) {
            flagged++;
            continue;
        }
        for (int64_t j = 0; j < m; j++)
            out[lo + j] = t[codes[lo + j]] * a;
    }
    return flagged;
}

static uint32_t f8_reduce(const float *own, float a, const uint8_t *c, int64_t m,
                          float *scratch)
{
    const float *t = f8_table();
    uint32_t max_u = 0;
    if (!(fabsf(a) < INFINITY))
        return INF_BITS;
    for (int64_t j = 0; j < m; j++) {
        scratch[j] = own[j] + t[c[j]] * a;
        max_u = abs_bits(scratch[j]) > max_u ? abs_bits(scratch[j]) : max_u;
    }
    return max_u;
}

int64_t eqx_f8_decode_reduce_sum_f32(const float *own, const float *heads,
                                     const uint8_t *codes, int64_t n, int64_t block,
                                     float *out, float *scratch)
{
    int64_t flagged = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        if (f8_reduce(own + lo, heads[b], codes + lo, m, scratch) >= INF_BITS) {
            flagged++;
            continue;
        }
        memcpy(out + lo, scratch, (size_t)m * sizeof(float));
    }
    return flagged;
}

void eqx_f8_decode_reduce_encode_sum_f32(const float *own, const float *heads_in,
                                         const uint8_t *codes_in, float *heads_out,
                                         uint8_t *codes_out, int64_t n, int64_t block,
                                         float *scratch)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        uint32_t max_u = f8_reduce(own + lo, heads_in[b], codes_in + lo, m, scratch);
        heads_out[b] = f8_emit(scratch, m, max_u, codes_out + lo);
    }
}

/* --- affine ------------------------------------------------------------------ */

/* integers ordered as IEEE totalOrder: -NaN < -Inf < ... < -0 < +0 < ... < +NaN */
static int32_t order_key(float x)
{
    uint32_t u = f2u(x);
    return (int32_t)((u & 0x80000000u) ? u ^ 0x7FFFFFFFu : u);
}

static float from_order_key(int32_t k)
{
    uint32_t u = (uint32_t)k;
    return u2f((u & 0x80000000u) ? u ^ 0x7FFFFFFFu : u);
}

struct block_scale { float lo, hi, base, d, inv_s, s, k; };

static struct block_scale af_scale(float lo, float hi, int32_t levels)
{
    struct block_scale p;
    float span = hi - lo;
    p.s = span == INFINITY ? 0.5f : (span < TINY ? LIFT : 1.0f);
    p.lo = lo;
    p.hi = hi;
    p.base = lo * p.s;
    p.d = hi * p.s - p.base;
    p.inv_s = 1.0f / p.s;
    p.k = 1.0f / (float)levels;
    return p;
}

static float af_dec(int32_t t, int32_t levels, const struct block_scale *p)
{
    float v = (p->base + ((float)t * p->k) * p->d) * p->inv_s;
    v = v > p->hi ? p->hi : v;
    v = v < p->lo ? p->lo : v;
    v = t == 0 ? p->lo : v;
    return t == levels ? p->hi : v;
}

static int32_t af_code_at(const uint8_t *c, int64_t j, int32_t levels)
{
    return levels < 16 ? (c[j / 2] >> ((j & 1) * 4)) & 15 : c[j];
}

static void af_put(uint8_t *c, int64_t j, int32_t t, int32_t levels)
{
    if (levels >= 16)
        c[j] = (uint8_t)t;
    else if (j & 1)
        c[j / 2] = (uint8_t)(c[j / 2] | (t << 4));
    else
        c[j / 2] = (uint8_t)t;           /* the low nibble comes first */
}

/* v[:m] to heads lo, hi and the block's codes (c points at its first byte) */
static void af_emit(const float *restrict v, int64_t m, int32_t levels, float *heads,
                    uint8_t *restrict c)
{
    int32_t kmin = order_key(INFINITY), kmax = order_key(-INFINITY);
    for (int64_t j = 0; j < m; j++) {
        int32_t key = order_key(v[j]);
        kmin = key < kmin ? key : kmin;
        kmax = key > kmax ? key : kmax;
    }
    if (kmax >= order_key(INFINITY) || kmin <= order_key(-INFINITY)) {
        heads[0] = -INFINITY;
        heads[1] = INFINITY;
        memset(c, 0, (size_t)(levels < 16 ? (m + 1) / 2 : m));
        return;
    }
    float lo = from_order_key(kmin), hi = from_order_key(kmax);
    heads[0] = lo;
    heads[1] = hi;
    if (hi - lo == 0.0f) {               /* constant; a zero of the other sign -> hi */
        for (int64_t j = 0; j < m; j++)
            af_put(c, j, (signbit(v[j]) != 0) == (signbit(lo) != 0) ? 0 : levels, levels);
        return;
    }
    struct block_scale p = af_scale(lo, hi, levels);
    float r = (float)levels / p.d;
    for (int64_t j = 0; j < m; j++)
        af_put(c, j, (int32_t)rintf((v[j] * p.s - p.base) * r), levels);
}

static int64_t af_code_bytes(int64_t lo, int32_t levels)
{
    return levels < 16 ? lo / 2 : lo;
}

void eqx_af_encode_f32(const float *src, int64_t n, int64_t block, int32_t levels,
                       float *heads, uint8_t *codes)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++)
        af_emit(src + lo, min64(block, n - lo), levels, heads + 2 * b,
                codes + af_code_bytes(lo, levels));
}

static int af_flagged(const float *heads)
{
    return !(fabsf(heads[0]) < INFINITY && fabsf(heads[1]) < INFINITY);
}

int64_t eqx_af_decode_f32(const float *heads, const uint8_t *codes, int64_t n,
                          int64_t block, int32_t levels, float *out)
{
    int64_t flagged = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        const uint8_t *c = codes + af_code_bytes(lo, levels);
        if (af_flagged(heads + 2 * b)) {
            flagged++;
            continue;
        }
        struct block_scale p = af_scale(heads[2 * b], heads[2 * b + 1], levels);
        for (int64_t j = 0; j < m; j++)
            out[lo + j] = af_dec(af_code_at(c, j, levels), levels, &p);
    }
    return flagged;
}

static uint32_t af_reduce(const float *own, const float *heads, const uint8_t *c,
                          int64_t m, int32_t levels, float *scratch)
{
    uint32_t max_u = 0;
    if (af_flagged(heads))
        return INF_BITS;
    struct block_scale p = af_scale(heads[0], heads[1], levels);
    for (int64_t j = 0; j < m; j++) {
        scratch[j] = own[j] + af_dec(af_code_at(c, j, levels), levels, &p);
        max_u = abs_bits(scratch[j]) > max_u ? abs_bits(scratch[j]) : max_u;
    }
    return max_u;
}

int64_t eqx_af_decode_reduce_sum_f32(const float *own, const float *heads,
                                     const uint8_t *codes, int64_t n, int64_t block,
                                     int32_t levels, float *out, float *scratch)
{
    int64_t flagged = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        if (af_reduce(own + lo, heads + 2 * b, codes + af_code_bytes(lo, levels), m, levels,
                      scratch) >= INF_BITS) {
            flagged++;
            continue;
        }
        memcpy(out + lo, scratch, (size_t)m * sizeof(float));
    }
    return flagged;
}

void eqx_af_decode_reduce_encode_sum_f32(const float *own, const float *heads_in,
                                         const uint8_t *codes_in, float *heads_out,
                                         uint8_t *codes_out, int64_t n, int64_t block,
                                         int32_t levels, float *scratch)
{
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t m = min64(block, n - lo);
        int64_t at = af_code_bytes(lo, levels);
        if (af_reduce(own + lo, heads_in + 2 * b, codes_in + at, m, levels, scratch)
            >= INF_BITS)
            scratch[0] = INFINITY;           /* so that af_emit flags the block */
        af_emit(scratch, m, levels, heads_out + 2 * b, codes_out + at);
    }
}
