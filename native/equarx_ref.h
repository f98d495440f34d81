/* C reference of the equarx_mpi int8 block wire format, float32 input only.
 * Semantics are those of equarx_mpi/kernels/int8.py, bit for bit. */
#ifndef EQUARX_REF_H
#define EQUARX_REF_H
#include <stdint.h>

/* (heads, codes) = Q(src) */
void eqx_encode_f32(const float *src, int64_t n, int64_t block,
                    float *heads, int8_t *codes);
/* out = D(heads, codes), flagged blocks skipped; returns their number */
int64_t eqx_decode_f32(const float *heads, const int8_t *codes, int64_t n,
                       int64_t block, float *out);
/* out = own + D(heads, codes); out may be own; blocks flagged or not finite
 * are skipped and counted; scratch holds block floats */
int64_t eqx_decode_reduce_sum_f32(const float *own, const float *heads,
                                  const int8_t *codes, int64_t n, int64_t block,
                                  float *out, float *scratch);
/* (heads_out, codes_out) = Q(own + D(heads_in, codes_in)); in place allowed;
 * scratch holds block floats */
void eqx_decode_reduce_encode_sum_f32(const float *own, const float *heads_in,
                                      const int8_t *codes_in, float *heads_out,
                                      int8_t *codes_out, int64_t n, int64_t block,
                                      float *scratch);
/* dst = src, the STREAM-like copy that bounds everything above */
void eqx_copy_f32(const float *src, float *dst, int64_t n);

#endif
