"""Uncompressed wire formats: bfloat16 (uint16 bits), float16 (int16 bits)
or float32 values, rounded to nearest even at every hop like any 16-bit
ring AllReduce.  The final decodes work in blocks of B values and skip a
block holding Inf or NaN (left untouched, its index written to
``skipped``), as the int8 format does, so the caller reduces it exactly: a finite value that overflowed the
wire type (float32 max on a bfloat16 wire, a large float64 on a float32
wire) never comes back as Inf."""
import numpy as np
from numba import njit

from equarx_mpi.kernels.common import (
    CACHE,
    OP_SUM,
    abs_bits,
    as_acc,
    keep_or_skip,
    load,
    out_limit,
    reduce2,
    store,
    wire_abs_bits,
    wire_inf_bits,
)
from equarx_mpi.kernels.loops import fold

_U = np.uint64


@njit(**CACHE)
def plain_encode(src, wire):
    for i in range(src.size):
        store(wire, _U(i), load(src, _U(i)))


@njit(**CACHE)
def plain_decode(wire, out, block, skipped):
    """out = wire, skipping blocks with a non-finite value; returns their
    number (indices in skipped[:number])."""
    n = out.size
    inf = wire_inf_bits(wire)
    flagged = 0
    for lo in range(0, n, block):
        m = min(block, n - lo)
        mx = _U(0)
        for j in range(m):
            mx = max(mx, wire_abs_bits(wire, _U(lo + j)))
        if mx >= inf:
            skipped[flagged] = lo // block
            flagged += 1
            continue
        for j in range(m):
            store(out, _U(lo + j), load(wire, _U(lo + j)))
    return flagged


@njit(**CACHE)
def plain_decode_reduce(own, wire, out, block, op, scratch, skipped):
    """out = own (op) wire, skipping blocks whose result does not fit out
    (out may be own); returns their number (indices in skipped[:number])."""
    n = out.size
    inf = abs_bits(out_limit(out))
    flagged = 0
    for lo in range(0, n, block):
        m = min(block, n - lo)
        mx = abs_bits(as_acc(scratch, 0))
        for j in range(m):
            i = _U(lo + j)
            v = reduce2(op, load(own, i), load(wire, i))
            scratch[j] = v
            mx = max(mx, abs_bits(v))
        flagged = keep_or_skip(out, lo, m, scratch, mx, inf, lo // block, skipped, flagged)
    return flagged


@njit(**CACHE)
def plain_decode_reduce_encode(own, wire_in, wire_out, op):
    if op == OP_SUM:
        for i in range(own.size):
            store(wire_out, _U(i), load(own, _U(i)) + load(wire_in, _U(i)))
    else:
        for i in range(own.size):
            store(wire_out, _U(i), reduce2(op, load(own, _U(i)), load(wire_in, _U(i))))


# --- many inputs at once (the two-shot owner's reduction) ---------------------
# ``wires`` holds the P-1 received messages of one piece, one per row (C 2-D);
# ``pos`` is the owner's rank: inputs are reduced in rank order 0..P-1, the
# owner's own values ``own`` in place ``pos`` and row t (t - 1 past pos) for
# the others.  Worked in blocks of B values so the partial sums stay in cache.

@njit(**CACHE)
def _reduce_many(own, pos, wires, lo, m, op, scratch):
    """scratch[:m] = the rank-order reduction of values lo..lo+m; returns
    the largest magnitude bits (those of Inf or NaN if one is inside)."""
    for t in range(wires.shape[0] + 1):
        if t == pos:
            fold(own, t, lo, m, op, scratch)
        else:
            fold(wires[t if t < pos else t - 1], t, lo, m, op, scratch)
    mx = abs_bits(as_acc(scratch, 0))
    for j in range(m):
        mx = max(mx, abs_bits(scratch[j]))
    return mx


@njit(**CACHE)
def plain_decode_reduce_encode_many(own, pos, wires, wire_out, block, op, scratch):
    """wire_out = the rank-order reduction of own and the messages, rounded
    once to the wire type."""
    n = own.size
    for lo in range(0, n, block):
        m = min(block, n - lo)
        _reduce_many(own, pos, wires, lo, m, op, scratch)
        for j in range(m):
            store(wire_out, _U(lo + j), scratch[j])


@njit(**CACHE)
def plain_decode_reduce_many(own, pos, wires, out, block, op, scratch, skipped):
    """out = the rank-order reduction of own and the messages, skipping
    blocks whose result does not fit out (Inf or NaN inside); returns their
    number (indices in skipped[:number])."""
    n = own.size
    limit = abs_bits(out_limit(out))
    flagged = 0
    for lo in range(0, n, block):
        m = min(block, n - lo)
        flagged = keep_or_skip(out, lo, m, scratch, _reduce_many(own, pos, wires, lo, m, op, scratch),
                               limit, lo // block, skipped, flagged)
    return flagged
