"""Affine blocks (docs/FORMAT.md): for data with an offset.  Per block of B
values (the last block of a piece may be short), in the accumulation type
A, with L = 255 ("int8-affine", one code per byte) or L = 15
("int4-affine", two codes per byte, the even index in the low nibble):

    headers lo = min x, hi = max x       IEEE total order: -0.0 < +0.0
    scale   s  = 1/2   if hi - lo overflows A
                 LIFT  if hi - lo < TINY (L / (hi - lo) would overflow)
                 1     otherwise         (a power of two: scaling is exact)
            base = lo*s,  d = hi*s - base,  r = L / d
    code    t  = rint((x*s - base) * r)  in [0, L] without clamping
    decoded lo for t = 0, hi for t = L, else
            x' = (base + (t * k) * d) * (1/s),  k = 1 / L,  clamped to [lo, hi]

Both extremes decode exactly and no finite value decodes outside
[lo, hi], so nothing finite becomes Inf, not even for blocks spanning
-FLT_MAX..FLT_MAX (computed at scale 1/2).  A block whose values are all
equal (hi - lo == 0) is exact: t = 0, or L for a zero whose sign differs
from lo's (a block holding -0.0 and +0.0 has lo = -0.0, hi = +0.0).  A
block holding Inf or NaN is flagged: lo = -Inf, hi = +Inf, codes 0;
decodes skip it and the library reduces it exactly, as for int8; decodes
into a 16-bit type also skip blocks with max(|lo|, |hi|) beyond its range.

Directed rounding: t = ceil (floor) of the scaled value, then raised
(lowered) while the decoded value is still below (above) x.  Decoded
values rise with t and t = L (0) decodes to hi (lo), so this ends, in
practice after at most one step.
"""
import numpy as np
from numba import njit

from equarx_mpi.kernels import loops
from equarx_mpi.kernels.common import (
    CACHE,
    HELPER,
    KERNEL,
    ROUND_NEAREST,
    ROUND_UP,
    abs_bits,
    acc_block,
    as_acc,
    cast_like,
    from_order_key,
    order_key,
    store,
    wide_tiny_lift,
    wide_vectors,
)

_U = np.uint64


@njit(inline='always', **CACHE)
def _scale(lo, hi):
    """(base, d, 1/s, s) of a block with extremes lo < hi (or hi == lo)."""
    tiny, lift = wide_tiny_lift(lo)
    one = cast_like(lo, 1)
    span = hi - lo
    if span == np.inf:
        s = cast_like(lo, 0.5)
    elif span < tiny:
        s = lift
    else:
        s = one
    base = lo * s
    return base, hi * s - base, one / s, s


@njit(inline='always', **CACHE)
def _dec(t, levels, lo, hi, base, d, inv_s, k):
    """The value of code t (an integer) of a block."""
    v = (base + (cast_like(lo, t) * k) * d) * inv_s
    if v > hi:
        v = hi
    if v < lo:
        v = lo
    if t == 0:
        v = lo
    if t == levels:
        v = hi
    return v


@njit(inline='always', **CACHE)
def _code(x, lo, hi, base, d, inv_s, s, r, k, levels, up):
    """The directed code of x in a block with lo < hi: ceiling (up) or
    floor, then moved while the decoded value is still below (above) x."""
    q = (x * s - base) * r
    if up:
        t = np.int64(min(np.ceil(q), cast_like(q, levels)))
        while t < levels and _dec(t, levels, lo, hi, base, d, inv_s, k) < x:
            t += 1
        return t
    t = np.int64(max(np.floor(q), cast_like(q, 0)))
    while t > 0 and _dec(t, levels, lo, hi, base, d, inv_s, k) > x:
        t -= 1
    return t


@njit(inline='always', **CACHE)
def _levels_into(vals, off, m, scratch, lo, hi, levels, rmode):
    """scratch[:m] = the codes of vals[off:off+m] (as floats), lo < hi."""
    base, d, inv_s, s = _scale(lo, hi)
    lv = cast_like(lo, levels)
    r = lv / d
    if rmode == ROUND_NEAREST:
        for j in range(m):
            scratch[j] = np.rint((vals[_U(off + j)] * s - base) * r)
        return
    k = cast_like(lo, 1) / lv
    up = rmode == ROUND_UP
    for j in range(m):
        scratch[j] = _code(vals[_U(off + j)], lo, hi, base, d, inv_s, s, r, k, levels, up)


@njit(inline='always', **CACHE)
def _put(t, m, codes, at, nibbles):
    """Store the codes t[:m] (floats) from byte ``at``, one or two per byte.
    An odd count is padded with a zero code in t[m] (t holds a whole block
    and blocks are even), so only whole bytes are stored: a separate store
    of the last nibble after the loop was lost when numba inlined this into
    emit and emit into the kernel (numba 0.68; not reduced further)."""
    if nibbles:
        if m & 1:
            t[m] = 0
        for j in range((m + 1) >> 1):
            codes[at + _U(j)] = np.uint8(np.int32(t[2 * j]) | (np.int32(t[2 * j + 1]) << 4))
    else:
        for j in range(m):
            codes[at + _U(j)] = np.uint8(np.int32(t[j]))


@njit(**HELPER)
def emit(vals, off, m, max_u, heads, b, codes, lo_i, rmode, stream, levels, tcodes):
    """Quantize vals[off:off+m] (accumulation type) into heads[2b:2b+2] and
    the codes of values lo_i..lo_i+m-1 (lo_i even for nibbles); tcodes
    holds m floats.  max_u at least Inf's bits (a reduced block that is
    not finite) flags the block; the loops' emit (stream unused)."""
    wide_vectors()
    kmin = order_key(as_acc(heads, np.inf))
    kmax = order_key(as_acc(heads, -np.inf))
    for j in range(m):
        key = order_key(vals[_U(off + j)])
        kmin = min(kmin, key)
        kmax = max(kmax, key)
    nibbles = levels < 16
    at = _U(lo_i >> 1) if nibbles else _U(lo_i)
    if (max_u >= abs_bits(as_acc(heads, np.inf)) or kmax >= order_key(as_acc(heads, np.inf))
            or kmin <= order_key(as_acc(heads, -np.inf))):
        heads[2 * b] = -np.inf                    # flagged: Inf or NaN inside
        heads[2 * b + 1] = np.inf
        for j in range((m + 1) >> 1 if nibbles else m):
            codes[at + _U(j)] = 0
        return
    lo, hi = from_order_key(kmin, heads[0]), from_order_key(kmax, heads[0])
    heads[2 * b] = lo
    heads[2 * b + 1] = hi
    if hi - lo == 0:             # constant: exact; a zero of the other sign -> hi
        neg = np.signbit(lo)
        for j in range(m):
            tcodes[j] = 0 if np.signbit(vals[_U(off + j)]) == neg else levels
    else:
        _levels_into(vals, off, m, tcodes, lo, hi, levels, rmode)
    _put(tcodes, m, codes, at, nibbles)


@njit(inline='always', **CACHE)
def _block_head(heads, b, levels):
    """(lo, hi, base, d, 1/s, k) of block b."""
    lo, hi = heads[2 * b], heads[2 * b + 1]
    base, d, inv_s, _ = _scale(lo, hi)
    return lo, hi, base, d, inv_s, cast_like(lo, 1) / cast_like(lo, levels)


@njit(**HELPER)
def decode_block(heads, codes, b, lo_i, m, levels, dst, at_dst):
    """dst[at_dst:at_dst+m] = D(block b), stored in dst's type; the caller
    has checked the block is not flagged."""
    wide_vectors()
    lo, hi, base, d, inv_s, k = _block_head(heads, b, levels)
    if levels < 16:
        at = _U(lo_i >> 1)
        for j in range(m >> 1):
            byte = codes[at + _U(j)]
            store(dst, _U(at_dst + 2 * j),
                  _dec(np.int64(byte & np.uint8(15)), levels, lo, hi, base, d, inv_s, k))
            store(dst, _U(at_dst + 2 * j + 1),
                  _dec(np.int64(byte >> np.uint8(4)), levels, lo, hi, base, d, inv_s, k))
        if m & 1:
            store(dst, _U(at_dst + m - 1),
                  _dec(np.int64(codes[at + _U(m >> 1)]), levels, lo, hi, base, d, inv_s, k))
    else:
        for j in range(m):
            store(dst, _U(at_dst + j),
                  _dec(np.int64(codes[_U(lo_i + j)]), levels, lo, hi, base, d, inv_s, k))


@njit(inline='always', **CACHE)
def _skip(heads, b, limit):
    """Whether block b is flagged, or reaches ``limit`` (out's overflow)."""
    return not max(abs(heads[2 * b]), abs(heads[2 * b + 1])) < limit


@njit(inline='always', **CACHE)
def _acc_values(src, lo, m, scratch):
    """The loops' values: emit finds the extremes itself."""
    vals, off = acc_block(src, lo, m, scratch)
    return vals, off, abs_bits(as_acc(scratch, 0))


@njit(inline='always', **CACHE)
def _head(heads, codes, b, lo_i, m, levels, scratch):
    """Decodes the block into scratch, then the loop reduces: two tight
    loops over a block that stays in cache."""
    decode_block(heads, codes, b, lo_i, m, levels, scratch, np.int64(0))
    return heads[2 * b]


@njit(**HELPER)
def _reduce(own, header, codes, b, lo, m, op, levels, scratch):
    """loops.reduce_block with this format's steps, compiled once for both
    reducing loops."""
    return loops.reduce_block(_skip, _head, loops.scratch_value, own, header, codes, b, lo,
                              m, op, levels, scratch)


@njit(**KERNEL)
def af_encode(src, heads, codes, block, levels, scratch, rmode):
    """(heads, codes) = Q(src); scratch holds 2 * block values."""
    loops.encode(_acc_values, emit, src, heads, codes, block, scratch, rmode, np.uint64(0), levels)


@njit(**KERNEL)
def af_decode(heads, codes, out, block, levels, skipped):
    """loops.decode: out = D(heads, codes)."""
    return loops.decode(_skip, decode_block, heads, codes, out, block, levels, skipped)


@njit(**KERNEL)
def af_decode_reduce(own, heads, codes, out, block, levels, op, scratch, skipped):
    """loops.decode_reduce: out = own (op) D(heads, codes)."""
    return loops.decode_reduce(_reduce, own, heads, codes, out, block, op, levels, scratch, skipped)


@njit(**KERNEL)
def af_decode_reduce_encode(own, h_in, c_in, h_out, c_out, block, levels, op, scratch, rmode):
    """loops.decode_reduce_encode: (h_out, c_out) = Q(own (op) D(h_in,
    c_in)); scratch holds 2 * block values."""
    loops.decode_reduce_encode(_reduce, emit, own, h_in, c_in, h_out, c_out, block, op, levels,
                               scratch,
                               rmode, np.uint64(0))
