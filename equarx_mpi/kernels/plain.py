"""Uncompressed wire formats: bfloat16 (uint16 bits), float16 (int16 bits)
or float32 values, rounded to nearest even at every hop like any 16-bit
ring AllReduce.  The final decodes work in blocks of B values and skip a
block holding Inf or NaN (left untouched, its index written to
``skipped``), as the int8 format does, so the caller reduces it exactly: a finite value that overflowed the
wire type (float32 max on a bfloat16 wire, a large float64 on a float32
wire) never comes back as Inf."""
import numpy as np
from numba import njit

from .common import (CACHE, OP_SUM, abs_bits, as_acc, load, out_limit, reduce2, store,
                     wire_abs_bits, wire_inf_bits)

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
        if mx >= inf:
            skipped[flagged] = lo // block
            flagged += 1
            continue
        for j in range(m):
            store(out, _U(lo + j), scratch[j])
    return flagged


@njit(**CACHE)
def plain_decode_reduce_encode(own, wire_in, wire_out, op):
    if op == OP_SUM:
        for i in range(own.size):
            store(wire_out, _U(i), load(own, _U(i)) + load(wire_in, _U(i)))
    else:
        for i in range(own.size):
            store(wire_out, _U(i), reduce2(op, load(own, _U(i)), load(wire_in, _U(i))))
