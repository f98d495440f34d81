/* C reference of the int4, fp8 and affine wire formats, float32 input, SUM,
 * round to nearest.  Semantics are those of equarx_mpi/kernels/int4.py,
 * fp8.py and affine.py, bit for bit (docs/FORMAT.md).  Same argument order
 * as equarx_ref.h: decodes skip flagged blocks and return their number; in
 * place (codes_in == codes_out) allowed for the fused hop; scratch holds one
 * block of floats.  levels: 255 ("int8-affine") or 15 ("int4-affine"). */
#ifndef EQUARX_FORMATS_H
#define EQUARX_FORMATS_H
#include <stdint.h>

/* int4: one float header per block, two codes per byte (low nibble first) */
void eqx_i4_encode_f32(const float *src, int64_t n, int64_t block,
                       float *heads, uint8_t *codes);
int64_t eqx_i4_decode_f32(const float *heads, const uint8_t *codes, int64_t n,
                          int64_t block, float *out);
int64_t eqx_i4_decode_reduce_sum_f32(const float *own, const float *heads,
                                     const uint8_t *codes, int64_t n, int64_t block,
                                     float *out, float *scratch);
void eqx_i4_decode_reduce_encode_sum_f32(const float *own, const float *heads_in,
                                         const uint8_t *codes_in, float *heads_out,
                                         uint8_t *codes_out, int64_t n, int64_t block,
                                         float *scratch);

/* fp8: one float header per block, one e4m3 code per byte */
void eqx_f8_encode_f32(const float *src, int64_t n, int64_t block,
                       float *heads, uint8_t *codes);
int64_t eqx_f8_decode_f32(const float *heads, const uint8_t *codes, int64_t n,
                          int64_t block, float *out);
int64_t eqx_f8_decode_reduce_sum_f32(const float *own, const float *heads,
                                     const uint8_t *codes, int64_t n, int64_t block,
                                     float *out, float *scratch);
void eqx_f8_decode_reduce_encode_sum_f32(const float *own, const float *heads_in,
                                         const uint8_t *codes_in, float *heads_out,
                                         uint8_t *codes_out, int64_t n, int64_t block,
                                         float *scratch);

/* affine: two float headers (lo, hi) per block, codes one per byte (levels
 * 255) or two per byte (levels 15) */
void eqx_af_encode_f32(const float *src, int64_t n, int64_t block, int32_t levels,
                       float *heads, uint8_t *codes);
int64_t eqx_af_decode_f32(const float *heads, const uint8_t *codes, int64_t n,
                          int64_t block, int32_t levels, float *out);
int64_t eqx_af_decode_reduce_sum_f32(const float *own, const float *heads,
                                     const uint8_t *codes, int64_t n, int64_t block,
                                     int32_t levels, float *out, float *scratch);
void eqx_af_decode_reduce_encode_sum_f32(const float *own, const float *heads_in,
                                         const uint8_t *codes_in, float *heads_out,
                                         uint8_t *codes_out, int64_t n, int64_t block,
                                         int32_t levels, float *scratch);

#endif
