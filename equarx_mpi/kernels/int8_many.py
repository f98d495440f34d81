"""int8's many-input kernels: the two-shot owner's reduction of its own
values and the P-1 received messages (int8.py has the format)."""
import numpy as np
from numba import njit

from equarx_mpi.kernels.common import (
    HELPER,
    KERNEL,
    OP_SUM,
    abs_bits,
    as_acc,
    keep_or_skip,
    load,
    out_limit,
    readonly,
    reduce2,
    wide_vectors,
)
from equarx_mpi.kernels.int8 import _NO_STREAM, LEVELS, _mode, emit
from equarx_mpi.kernels.loops import fold

_U = np.uint64


# --- many inputs at once (the two-shot owner's reduction) ---------------------
# The P-1 received messages of one piece lie back to back: ``heads`` is their
# headers (one row per message, any layout), ``codes`` their whole bytes as a
# C-contiguous 2-D int8 array whose codes start at column ``h``.  ``pos`` is
# the owner's rank: inputs are reduced in rank order 0..P-1, the owner's own
# raw values ``own`` in place ``pos`` and row t (t - 1 past pos) for the others.

@njit(**HELPER)
def _reduce_many_block(own, pos, heads, codes, h, b, lo, m, op, k, scratch):
    """scratch[:m] = the rank-order reduction of block b of every input;
    returns its largest magnitude bits, or those of Inf (scratch then
    unusable) when an input block is flagged or own holds Inf or NaN (a MAX
    or MIN could otherwise drop an infinity: the block must stay flagged;
    a SUM keeps them)."""
    wide_vectors()
    inf_u = abs_bits(as_acc(scratch, np.inf))
    last = heads.shape[0]
    for t in range(last):
        if not abs(heads[t, b]) < np.inf:
            return inf_u
    mx = abs_bits(as_acc(scratch, 0))
    if op != OP_SUM:
        for j in range(m):
            mx = max(mx, abs_bits(load(own, _U(lo + j))))
        if mx >= inf_u:
            return inf_u
    for t in range(last + 1):
        if t == pos:
            fold(own, t, lo, m, op, scratch)
            continue
        row = t if t < pos else t - 1
        a = heads[row, b]
        at = h + lo
        if t == 0:
            for j in range(m):
                scratch[j] = (as_acc(scratch, codes[row, _U(at + j)]) * k) * a
        elif op == OP_SUM and t == last:     # the common last input: its maximum on the way
            mx = abs_bits(as_acc(scratch, 0))
            for j in range(m):
                v = scratch[j] + (as_acc(scratch, codes[row, _U(at + j)]) * k) * a
                scratch[j] = v
                mx = max(mx, abs_bits(v))
            return mx
        elif op == OP_SUM:
            for j in range(m):
                scratch[j] = scratch[j] + (as_acc(scratch, codes[row, _U(at + j)]) * k) * a
        else:
            for j in range(m):
                v = (as_acc(scratch, codes[row, _U(at + j)]) * k) * a
                scratch[j] = reduce2(op, scratch[j], v)
    mx = abs_bits(as_acc(scratch, 0))
    for j in range(m):
        mx = max(mx, abs_bits(scratch[j]))
    return mx


@njit(**KERNEL)
def _decode_reduce_encode_many(own, pos, heads, codes, h, h_out, c_out, block, op, scratch,
                               rmode, stream):
    wide_vectors()
    n = own.size
    k = as_acc(h_out, 1) / as_acc(h_out, LEVELS)
    for b in range((n + block - 1) // block):
        lo = b * block
        m = min(block, n - lo)
        max_u = _reduce_many_block(readonly(own), pos, heads, codes, h, b, lo, m, op, k, scratch)
        emit(readonly(scratch), np.int64(0), m, max_u, h_out, b, c_out, lo, rmode, stream,
             np.int64(0), scratch[block:])


def i8_decode_reduce_encode_many(own, pos, heads, codes, h, h_out, c_out, block, op,
                                 scratch, rmode, stream=_NO_STREAM):
    """(h_out, c_out) = Q(rank-order reduction of own and the messages),
    one pass per block; a block flagged in any input ends flagged."""
    _decode_reduce_encode_many(own, pos, heads, codes, h, h_out, c_out, block, op, scratch,
                               _mode(rmode), stream)


@njit(**KERNEL)
def i8_decode_reduce_many(own, pos, heads, codes, h, out, block, op, scratch, skipped):
    """out = rank-order reduction of own and the messages, at full
    precision; blocks flagged in any input, holding Inf/NaN in own, or
    whose result does not fit out are skipped (left untouched).  Returns
    their number; their indices are in skipped[:number]."""
    wide_vectors()
    n = own.size
    k = as_acc(scratch, 1) / as_acc(scratch, LEVELS)
    limit_u = abs_bits(out_limit(out))
    flagged = 0
    for b in range((n + block - 1) // block):
        lo = b * block
        m = min(block, n - lo)
        max_u = _reduce_many_block(readonly(own), pos, heads, codes, h, b, lo, m, op, k, scratch)
        flagged = keep_or_skip(out, lo, m, scratch, max_u, limit_u, b, skipped, flagged)
    return flagged
