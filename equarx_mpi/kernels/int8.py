"""int8 blocks (docs/FORMAT.md).  Per block of B values (the last block of
a piece may be short), in the accumulation type A (float64 for float64
input, float32 otherwise):

    header  a  = max |x|                 the block's largest magnitude, in A
    code    c  = rint(x * r),  r = 127 / a     (ties to even; r rounded once
                                                to A, exponent unbounded)
    decoded x' = (c * k) * a,  k = 1 / 127     (k rounded once to A)

Because fl(127 * k) == 1 in float32 and float64, code +-127 decodes to
exactly +-a: a block's largest magnitude, a constant block and a 0/1 mask
come back exactly, and |x'| <= a, so no finite value decodes to Inf.  Every
other value is within half a step (a/127/2) plus a few units in the last
place.  "Exponent unbounded": for a < TINY (where r would overflow) the
values and a are first multiplied by the power of two LIFT, which changes
no rounding.

An all-zero block has a = 0 and codes 0 (+0.0) or -1 (-0.0): decoding gives
(c * k) * 0, so every zero keeps its sign.  A block holding Inf or NaN is
*flagged*: a = +Inf and codes 0.  Decoding skips flagged blocks (they are
left untouched, their indices written to ``skipped``) and the caller
reduces them exactly; a fused hop turns a flagged input block into a
flagged output block, and so does a MAX or MIN hop whose own values hold
Inf or NaN (MIN(+Inf, x) is x: the flag must not fade along the ring, so
every block holding Inf or NaN in any rank's input ends flagged; a SUM
keeps them by itself).  Decoding into a 16-bit type also skips a block
whose largest magnitude rounds to Inf there (common.out_limit).

Directed rounding (ROUND_UP / ROUND_DOWN, for MAX / MIN) takes the ceiling
or floor and then checks the decoded value, so x' >= x (or <= x) always.
Stochastic rounding (ROUND_STOCHASTIC, for SUM when asked for) rounds up
with probability frac(x * r) (stochastic.stochastic_code): E[c] = x * r; value
i of a piece draws its uniform number from ``stream`` + i (common.uniform),
so the codes are a pure function of the values and the stream.
Speed (docs/results/kernels-*.txt): inner loops index with uint64 (numba
then skips negative-index wraparound, which would turn vector loads into
gathers); the per-block helpers are inlined, the large ones by LLVM
(common.HELPER), the small ones in numba's IR (inline='always'), and the
kernels run without reference counting (common.KERNEL) and with the CPU's
widest vectors (common.wide_vectors), so a block costs no call and no
atomic refcount update.  Kernels that call these helpers should do the same.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels import loops
from equarx_mpi.kernels.common import (
    CACHE,
    HELPER,
    KERNEL,
    ROUND_NEAREST,
    ROUND_STOCHASTIC,
    ROUND_UP,
    abs_bits,
    as_acc,
    from_abs_bits,
    sign_code,
    store,
    wide_vectors,
)
from equarx_mpi.kernels.stochastic import stochastic_code

LEVELS = 127
_U = np.uint64
#: the stream of a call without stochastic rounding (any uint64: unused)
_NO_STREAM = np.uint64(0)


def tiny_lift(like):
    """(TINY, LIFT) in like's type: below TINY, 127/a would overflow."""


@overload(tiny_lift, jit_options=CACHE)
def _tiny_lift(like):
    if like == types.float32:
        return lambda like: (np.float32(2.0 ** -120), np.float32(2.0 ** 64))
    if like == types.float64:
        return lambda like: (np.float64(2.0 ** -1000), np.float64(2.0 ** 128))


@njit(inline='always', **CACHE)
def _start(vals, off, m, max_u, header, b, codes, lo):
    """Write block b's header, and the codes of a flagged or all-zero
    block; returns (a, lift, r) for emit's codes, a = 0 when done."""
    zero = as_acc(header, 0)
    if max_u >= abs_bits(as_acc(header, np.inf)):
        header[b] = np.inf                       # flagged: Inf or NaN inside
        for j in range(m):
            codes[_U(lo + j)] = 0
        return zero, zero, zero
    if max_u == abs_bits(zero):
        header[b] = zero
        for j in range(m):
            codes[_U(lo + j)] = sign_code(vals[_U(off + j)])
        return zero, zero, zero
    a = from_abs_bits(max_u, zero)
    header[b] = a
    tiny, lift = tiny_lift(zero)
    levels = as_acc(header, LEVELS)
    if a < tiny:
        r = levels / (a * lift)
    else:
        lift = as_acc(header, 1)
        r = levels / a
    return a, lift, r


@njit(**HELPER)
def emit(vals, off, m, max_u, header, b, codes, lo, rmode, stream, levels, tail):
    """Quantize vals[off:off+m] (accumulation type; largest magnitude bits
    max_u) into header[b] and codes[lo:lo+m] (value lo + j of the piece:
    uniform number lo + j of ``stream`` when stochastic); the loops' emit
    (levels, tail unused).  rmode None: rounding to nearest, compiled
    without the other roundings."""
    wide_vectors()
    a, lift, r = _start(vals, off, m, max_u, header, b, codes, lo)
    if a == 0:
        return
    if rmode is None:
        _nearest(vals, off, m, lift, r, codes, lo)
        return
    lv = as_acc(header, LEVELS)
    if rmode == ROUND_NEAREST:
        _nearest(vals, off, m, lift, r, codes, lo)
    elif rmode == ROUND_STOCHASTIC:
        for j in range(m):
            x = vals[_U(off + j)]
            codes[_U(lo + j)] = np.int8(stochastic_code(x, (x * lift) * r, a, lv, stream, lo + j))
    else:
        _directed(vals, off, m, lift, r, a, as_acc(header, 1) / lv, lv, codes, lo,
                  rmode == ROUND_UP)


@njit(inline='always', **CACHE)
def _nearest(vals, off, m, lift, r, codes, lo):
    if lift == 1:
        for j in range(m):
            codes[_U(lo + j)] = np.int8(np.rint(vals[_U(off + j)] * r))
    else:
        for j in range(m):
            codes[_U(lo + j)] = np.int8(np.rint((vals[_U(off + j)] * lift) * r))


@njit(inline='always', **CACHE)
def _directed(vals, off, m, lift, r, a, k, levels, codes, lo, up):
    """Ceiling (up) or floor codes, corrected so the decoded value never
    falls below (above) the value: the roundings of r and of the decode can
    otherwise cross it.  Code +-127 decodes to +-a, so no correction leaves
    the code range.  One loop per direction, and the correction added in A
    (an integer 1 would widen c to float64): both vectorize."""
    one = as_acc(vals, 1)
    if up:
        for j in range(m):
            x = vals[_U(off + j)]
            c = min(np.ceil((x * lift) * r), levels)
            if (c * k) * a < x:
                c += one
            codes[_U(lo + j)] = np.int8(c)
    else:
        for j in range(m):
            x = vals[_U(off + j)]
            c = max(np.floor((x * lift) * r), -levels)
            if (c * k) * a > x:
                c -= one
            codes[_U(lo + j)] = np.int8(c)


# The kernels take rmode None for rounding to nearest (what a SUM runs
# unless asked otherwise): numba then compiles them without the other
# roundings' code, which halves their compile time (docs/PERFORMANCE.md
# "Cold start"); the functions without the leading underscore pass it.

def _mode(rmode):
    return None if rmode == ROUND_NEAREST else rmode


@njit(**KERNEL)
def _encode(src, header, codes, block, scratch, rmode, stream):
    loops.encode(loops.block_values, emit, src, header, codes, block, scratch, rmode, stream,
                 np.int64(0))


def i8_encode(src, header, codes, block, scratch, rmode, stream=_NO_STREAM):
    """(header, codes) = Q(src); ``stream`` keys stochastic rounding."""
    _encode(src, header, codes, block, scratch, _mode(rmode), stream)


@njit(inline='always', **CACHE)
def decode_block(header, codes, b, lo, m, levels, dst, at):
    k = as_acc(header, 1) / as_acc(header, LEVELS)
    a = header[b]
    for j in range(m):
        store(dst, _U(at + j), (as_acc(header, codes[_U(lo + j)]) * k) * a)


@njit(inline='always', **CACHE)
def head(header, codes, b, lo, m, levels, scratch):
    return header[b]


@njit(inline='always', **CACHE)
def value(header, codes, a, i, j, scratch):
    """Value i of the piece, decoded (a: its block's header)."""
    return (as_acc(header, codes[i]) * (as_acc(header, 1) / as_acc(header, LEVELS))) * a


@njit(**HELPER)
def _reduce(own, header, codes, b, lo, m, op, levels, scratch):
    """loops.reduce_block with this format's steps, compiled once for both
    reducing loops."""
    return loops.reduce_block(loops.skip_magnitude, head, value, own, header, codes, b, lo,
                              m, op, levels, scratch)


@njit(**KERNEL)
def i8_decode(header, codes, out, block, skipped):
    """out = D(header, codes); flagged blocks are skipped.  Returns their
    number; their indices are in skipped[:number]."""
    return loops.decode(loops.skip_magnitude, decode_block, header, codes, out, block, np.int64(0),
                        skipped)


@njit(**KERNEL)
def i8_decode_reduce(own, header, codes, out, block, op, scratch, skipped):
    """loops.decode_reduce: out = own (op) D(header, codes)."""
    return loops.decode_reduce(_reduce, own, header, codes, out, block, op, np.int64(0), scratch,
                               skipped)


@njit(**KERNEL)
def _decode_reduce_encode(own, h_in, c_in, h_out, c_out, block, op, scratch, rmode, stream):
    loops.decode_reduce_encode(_reduce, emit, own, h_in, c_in, h_out, c_out, block, op, np.int64(0),
                               scratch, rmode, stream)


def i8_decode_reduce_encode(own, h_in, c_in, h_out, c_out, block, op, scratch, rmode,
                            stream=_NO_STREAM):
    """(h_out, c_out) = Q(own (op) D(h_in, c_in)): the fused ring hop
    (loops.decode_reduce_encode)."""
    _decode_reduce_encode(own, h_in, c_in, h_out, c_out, block, op, scratch, _mode(rmode),
                          stream)
