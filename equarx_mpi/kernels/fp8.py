"""fp8 blocks (docs/FORMAT.md): e4m3 codes with one scale per block.  Per
block of B values (the last block of a piece may be short), in the
accumulation type A:

    header  a  = max |x|                          in A
    code    c  = e4m3(x * r),  r = 448 / a        round to nearest even, once
                                                  from A (r rounded once,
                                                  exponent unbounded)
    decoded x' = (e4m3_value(c) * k) * a,  k = 1 / 448   (k rounded once)

Codes are the bits of ml_dtypes' float8_e4m3fn: sign, 4 exponent bits
(bias 7), 3 mantissa bits; subnormals m * 2^-9; 448 is the largest finite
value and 0x7F / 0xFF (NaN) never occur.  |x * r| <= 448 (1+u)^2 < 464
rounds to at most 448 (the code saturates anyway).  fl(448 * k) == 1 in
float32 and float64, so the block's largest magnitude decodes exactly and
|x'| <= a (no finite value decodes to Inf).  The sign of a code is the sign
of x * r, so -0.0 keeps its sign in every block.  An all-zero block has
a = 0 (codes +-0); a block holding Inf or NaN is flagged (a = +Inf, codes
0), as in int8.  Directed rounding takes the e4m3 value next above (below)
and then checks the decoded value, as int8 does.

Decoding reads fl(e4m3_value(c) * k) from a 256-entry table in A.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels import common, loops
from equarx_mpi.kernels.common import (
    CACHE,
    HELPER,
    KERNEL,
    abs_bits,
    as_acc,
    f32_as_u32,
    f64_as_u64,
    from_abs_bits,
    store,
    u32_as_f32,
    u64_as_f64,
    wide_tiny_lift,
    wide_vectors,
)

LARGEST = 448
MAX_CODE = 0x7E
_U = np.uint64


def _value(c):
    """The value of e4m3 bits c (a Python float; NaN for 0x7F, 0xFF)."""
    e, m = (c >> 3) & 15, c & 7
    if e == 15 and m == 7:
        return float("nan")
    v = m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
    return -v if c & 0x80 else v


#: e4m3_value(c) (exact) and fl(e4m3_value(c) * fl(1/448)), in float32 and float64
VALUES32, VALUES64 = (np.array([_value(c) for c in range(256)], t)
                      for t in (np.float32, np.float64))
TABLE32, TABLE64 = (v * (v.dtype.type(1) / v.dtype.type(LARGEST)) for v in (VALUES32, VALUES64))


def scaled(like, c):
    """fl(e4m3_value(c) * k) in like's type (a table look-up)."""


@overload(scaled, jit_options=CACHE, inline='always')
def _scaled(like, c):
    if like == types.float32:
        return lambda like, c: TABLE32[c]
    if like == types.float64:
        return lambda like, c: TABLE64[c]


def value(like, c):
    """e4m3_value(c) in like's type."""


@overload(value, jit_options=CACHE, inline='always')
def _value_ov(like, c):
    if like == types.float32:
        return lambda like, c: VALUES32[c]
    if like == types.float64:
        return lambda like, c: VALUES64[c]


def e4m3_bits(y):
    """y (|y| <= 448 (1+u)^2) rounded to nearest even on the e4m3 grid, as
    its bits (uint8); the sign bit is y's (so -0.0 and tiny negatives give
    0x80)."""


@overload(e4m3_bits, jit_options=CACHE)
def _e4m3_bits(y):
    # Normal results: keep 3 of the mantissa bits, rounding half to even by
    # integer addition (the carry rolls into the exponent), then rebias.
    # Results below 2^-6 (the subnormal grid 2^-9): rint(|y| * 2^9), exact
    # scaling.  Both computed, then selected, in signed integers: branch-free
    # code with signed conversions vectorizes (encode 2x faster).
    if y == types.float32:
        def b32(y):
            u = np.int32(f32_as_u32(y))
            s = (u >> np.int32(24)) & np.int32(0x80)
            u = np.int32(u & np.int32(0x7FFFFFFF))
            sub = np.int32(np.rint(u32_as_f32(u) * np.float32(512.0)))
            norm = np.int32(np.int32(u + np.int32(0x7FFFF) + ((u >> np.int32(20)) & np.int32(1)))
                            >> np.int32(20)) - np.int32(120 << 3)
            mag = sub if u < np.int32(121 << 23) else norm
            return np.uint8(s | min(mag, np.int32(MAX_CODE)))
        return b32
    if y == types.float64:
        def b64(y):
            u = np.int64(f64_as_u64(y))
            s = (u >> np.int64(56)) & np.int64(0x80)
            u = u & np.int64(0x7FFFFFFFFFFFFFFF)
            sub = np.int64(np.rint(u64_as_f64(u) * 512.0))
            norm = ((u + np.int64((1 << 48) - 1) + ((u >> np.int64(49)) & np.int64(1)))
                    >> np.int64(49)) - np.int64(1016 << 3)
            mag = sub if u < np.int64(1017 << 52) else norm
            return np.uint8(s | min(mag, np.int64(MAX_CODE)))
        return b64


@njit(inline='always', **CACHE)
def _next(c, up):
    """The code next above (up) or below c in value; +-448 stay."""
    mag = c & np.uint8(0x7F)
    grow = min(mag + np.uint8(1), np.uint8(MAX_CODE))
    if (c & np.uint8(0x80)) == (0 if up else 0x80):
        return np.uint8(grow | (c & np.uint8(0x80)))
    if mag == 0:
        return np.uint8(0x81 if not up else 0x01)
    return np.uint8((mag - np.uint8(1)) | (c & np.uint8(0x80)))


@njit(inline='always', **CACHE)
def _directed(x, y, a, rmode):
    """The code of x (y = x scaled) rounded up (down): the e4m3 value next
    above (below) y, corrected once more if the decoded value still falls
    below (above) x.  +-448 decode to +-a, so the correction never leaves
    the finite codes."""
    up = rmode == common.ROUND_UP
    c = e4m3_bits(y)
    v = value(a, c)
    if (v < y) if up else (v > y):
        c = _next(c, up)
    d = scaled(a, c) * a
    if (d < x) if up else (d > x):
        c = _next(c, up)
    return c


@njit(**HELPER)
def emit(vals, off, m, max_u, header, b, codes, lo, rmode, stream, levels, tail):
    """Quantize vals[off:off+m] (accumulation type, largest magnitude bits
    max_u) into header[b] and codes[lo:lo+m]; the loops' emit (stream,
    levels, tail unused)."""
    wide_vectors()
    zero = as_acc(header, 0)
    if max_u >= abs_bits(as_acc(header, np.inf)):
        header[b] = np.inf                       # flagged: Inf or NaN inside
        for j in range(m):
            codes[_U(lo + j)] = 0
        return
    if max_u == abs_bits(zero):                  # zeros keep their sign
        header[b] = zero
        for j in range(m):
            codes[_U(lo + j)] = e4m3_bits(vals[_U(off + j)])
        return
    a = from_abs_bits(max_u, zero)
    header[b] = a
    tiny, lift = wide_tiny_lift(zero)
    if not a < tiny:
        lift = as_acc(header, 1)
    r = as_acc(header, LARGEST) / (a * lift)
    if rmode == common.ROUND_NEAREST:
        for j in range(m):
            codes[_U(lo + j)] = e4m3_bits((vals[_U(off + j)] * lift) * r)
    else:
        for j in range(m):
            x = vals[_U(off + j)]
            codes[_U(lo + j)] = _directed(x, (x * lift) * r, a, rmode)


@njit(inline='always', **CACHE)
def decode_block(header, codes, b, lo, m, levels, dst, at):
    a = header[b]
    for j in range(m):
        store(dst, _U(at + j), scaled(a, codes[_U(lo + j)]) * a)


@njit(inline='always', **CACHE)
def _head(header, codes, b, lo, m, levels, scratch):
    return header[b]


@njit(inline='always', **CACHE)
def _value(header, codes, a, i, j, scratch):
    """Value i of the piece, decoded (a: its block's header)."""
    return scaled(a, codes[i]) * a


@njit(**HELPER)
def _reduce(own, header, codes, b, lo, m, op, levels, scratch):
    """loops.reduce_block with this format's steps, compiled once for both
    reducing loops."""
    return loops.reduce_block(loops.skip_magnitude, _head, _value, own, header, codes, b, lo,
                              m, op, levels, scratch)


@njit(**KERNEL)
def f8_encode(src, header, codes, block, scratch, rmode):
    """(header, codes) = Q(src)."""
    loops.encode(loops.block_values, emit, src, header, codes, block, scratch, rmode, np.uint64(0),
                 np.int64(0))


@njit(**KERNEL)
def f8_decode(header, codes, out, block, skipped):
    """loops.decode: out = D(header, codes)."""
    return loops.decode(loops.skip_magnitude, decode_block, header, codes, out, block, np.int64(0),
                        skipped)


@njit(**KERNEL)
def f8_decode_reduce(own, header, codes, out, block, op, scratch, skipped):
    """loops.decode_reduce: out = own (op) D(header, codes)."""
    return loops.decode_reduce(_reduce, own, header, codes, out, block, op, np.int64(0), scratch,
                               skipped)


@njit(**KERNEL)
def f8_decode_reduce_encode(own, h_in, c_in, h_out, c_out, block, op, scratch, rmode):
    """loops.decode_reduce_encode: (h_out, c_out) = Q(own (op) D(h_in, c_in))."""
    loops.decode_reduce_encode(_reduce, emit, own, h_in, c_in, h_out, c_out, block, op, np.int64(0),
                               scratch, rmode, np.uint64(0))
