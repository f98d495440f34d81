"""int4 blocks (docs/FORMAT.md): int8's format with 7 levels, two codes per
byte.  Per block of B values (B even; the last block of a piece may be
short), in the accumulation type A:

    header  a  = max |x|                     in A
    code    c  = rint(x * r),  r = 7 / a     in [-7, 7], ties to even (r
                                             rounded once, exponent unbounded)
    decoded x' = (c * k) * a,  k = 1 / 7     (k rounded once to A)

Code j of a piece sits in byte j // 2, the low nibble for even j, as a
4-bit two's complement (-8 never occurs); an odd-length piece leaves the
high nibble of its last byte 0.  fl(7 * k) == 1 in float32 and float64, so
code +-7 decodes to exactly +-a: block extremes, constant blocks and 0/1
masks come back exactly and |x'| <= a.  Zeros, flagged blocks, the 16-bit
output limit, directed and stochastic rounding work as in int8
(kernels/int8.py).
"""
import numpy as np
from numba import njit

from equarx_mpi.kernels import loops
from equarx_mpi.kernels.common import (
    CACHE,
    HELPER,
    KERNEL,
    ROUND_NEAREST,
    abs_bits,
    as_acc,
    from_abs_bits,
    sign_code,
    store,
    wide_tiny_lift,
    wide_vectors,
)
from equarx_mpi.kernels.stochastic import symmetric_code as _code

LEVELS = 7
_U = np.uint64


@njit(inline='always', **CACHE)
def _low(b):
    """The signed code in the low nibble of byte b (int8)."""
    return np.int8(b << 4) >> 4


@njit(inline='always', **CACHE)
def _pair(c0, c1):
    return np.int8((np.int32(c0) & 15) | (np.int32(c1) << 4))


@njit(**HELPER)
def emit(vals, off, m, max_u, header, b, codes, lo, rmode, stream, levels, tail):
    """Quantize vals[off:off+m] (accumulation type, largest magnitude bits
    max_u) into header[b] and the nibbles of values lo..lo+m-1 (lo even);
    the loops' emit (levels, tail unused)."""
    wide_vectors()
    zero = as_acc(header, 0)
    at = _U(lo >> 1)
    half = m >> 1
    if max_u >= abs_bits(as_acc(header, np.inf)):
        header[b] = np.inf                       # flagged: Inf or NaN inside
        for j in range((m + 1) >> 1):
            codes[at + _U(j)] = 0
        return
    if max_u == abs_bits(zero):                  # zeros keep their sign: -0.0 -> -1
        for j in range(half):
            codes[at + _U(j)] = _pair(sign_code(vals[_U(off + 2 * j)]),
                                      sign_code(vals[_U(off + 2 * j + 1)]))
        if m & 1:
            codes[at + _U(half)] = _pair(sign_code(vals[_U(off + m - 1)]), 0)
        header[b] = zero
        return
    a = from_abs_bits(max_u, zero)
    tiny, lift = wide_tiny_lift(zero)
    if not a < tiny:
        lift = as_acc(header, 1)
    levels = as_acc(header, LEVELS)
    r = levels / (a * lift)
    k = as_acc(header, 1) / levels
    if rmode == ROUND_NEAREST:
        for j in range(half):
            codes[at + _U(j)] = _pair(np.rint((vals[_U(off + 2 * j)] * lift) * r),
                                      np.rint((vals[_U(off + 2 * j + 1)] * lift) * r))
    else:
        for j in range(half):
            x0, x1 = vals[_U(off + 2 * j)], vals[_U(off + 2 * j + 1)]
            c0 = _code(x0, (x0 * lift) * r, a, k, levels, rmode, stream, lo + 2 * j)
            c1 = _code(x1, (x1 * lift) * r, a, k, levels, rmode, stream, lo + 2 * j + 1)
            codes[at + _U(j)] = _pair(c0, c1)
    if m & 1:
        x0 = vals[_U(off + m - 1)]
        codes[at + _U(half)] = _pair(_code(x0, (x0 * lift) * r, a, k, levels, rmode, stream,
                                           lo + m - 1), 0)
    header[b] = a


@njit(inline='always', **CACHE)
def decode_block(header, codes, b, lo, m, levels, dst, at):
    k = as_acc(header, 1) / as_acc(header, LEVELS)
    a = header[b]
    c = _U(lo >> 1)
    for j in range(m >> 1):
        byte = codes[c + _U(j)]
        store(dst, _U(at + 2 * j), (as_acc(header, _low(byte)) * k) * a)
        store(dst, _U(at + 2 * j + 1), (as_acc(header, byte >> 4) * k) * a)
    if m & 1:
        store(dst, _U(at + m - 1), (as_acc(header, _low(codes[c + _U(m >> 1)])) * k) * a)


@njit(inline='always', **CACHE)
def _head(header, codes, b, lo, m, levels, scratch):
    """Decodes the block into scratch, then the loop reduces: two tight
    loops over a block that stays in cache."""
    decode_block(header, codes, b, lo, m, levels, scratch, np.int64(0))
    return header[b]


@njit(**HELPER)
def _reduce(own, header, codes, b, lo, m, op, levels, scratch):
    """loops.reduce_block with this format's steps, compiled once for both
    reducing loops."""
    return loops.reduce_block(loops.skip_magnitude, _head, loops.scratch_value, own, header, codes,
                              b, lo,
                              m, op, levels, scratch)


@njit(**KERNEL)
def i4_encode(src, header, codes, block, scratch, rmode, stream=np.uint64(0)):
    """(header, codes) = Q(src); ``stream`` keys stochastic rounding."""
    loops.encode(loops.block_values, emit, src, header, codes, block, scratch, rmode, stream,
                 np.int64(0))


@njit(**KERNEL)
def i4_decode(header, codes, out, block, skipped):
    """loops.decode: out = D(header, codes)."""
    return loops.decode(loops.skip_magnitude, decode_block, header, codes, out, block, np.int64(0),
                        skipped)


@njit(**KERNEL)
def i4_decode_reduce(own, header, codes, out, block, op, scratch, skipped):
    """loops.decode_reduce: out = own (op) D(header, codes)."""
    return loops.decode_reduce(_reduce, own, header, codes, out, block, op, np.int64(0), scratch,
                               skipped)


@njit(**KERNEL)
def i4_decode_reduce_encode(own, h_in, c_in, h_out, c_out, block, op, scratch, rmode,
                            stream=np.uint64(0)):
    """loops.decode_reduce_encode: (h_out, c_out) = Q(own (op) D(h_in, c_in))."""
    loops.decode_reduce_encode(_reduce, emit, own, h_in, c_in, h_out, c_out, block, op, np.int64(0),
                               scratch, rmode, stream)
