"""Numba kernels of the shared-window AllReduce (equarx_mpi/shm.py).

Pure functions on contiguous 1-D arrays.  The window is one flat array in
the kernels' element type (float32, float64, or the bits of float16 as int16
and of bfloat16 as uint16, see equarx_mpi/kernels.py); slot k starts at
``k * stride``.  The ``op`` argument is 0 for SUM, 1 for MAX, 2 for MIN.

The reduction of slice [lo, hi) is, for every j in it,

    r[j] = (...((x_0[j] op x_1[j]) op x_2[j]) ... op x_{P-1}[j])

evaluated left to right in the accumulation type (float64 for float64 input,
float32 otherwise) and rounded once to the output type (to nearest even).
The order is fixed, so every rank, every call and every slicing of the work
gives the same bits; MAX and MIN keep a NaN from either side, as numpy's
maximum and minimum do.
"""
import numpy as np
from numba import njit

from .kernels import OP_SUM, _reduce as reduce2, load, store

_CACHE = dict(cache=True, nogil=True)
#: Values per tile of the fused reduction: the accumulator of one tile stays
#: in L1 (16 KiB of float32) while the P slots stream past it once each.
TILE = 4096


@njit(**_CACHE)
def reduce_slots(win, stride, P, lo, hi, op, acc, out, out2):
    """out[:hi-lo] = the reduction of win[k*stride + lo : k*stride + hi] over
    k = 0..P-1 in that order; the same into out2 unless out2 is empty.

    acc is scratch in the accumulation type, TILE values or more.  Each tile
    is read once from every slot and written once: one pass over memory,
    where P numpy additions would make P passes over the output.  Indices
    are uint64 so that numba skips negative-index wraparound (which turns
    vector loads into gathers)."""
    both = out2.size > 0
    T = acc.size
    for t0 in range(lo, hi, T):
        m = min(T, hi - t0)
        base = np.uint64(t0)
        for j in range(m):
            acc[j] = load(win, base + np.uint64(j))
        for k in range(1, P):
            b = base + np.uint64(k * stride)
            if op == OP_SUM:
                for j in range(m):
                    acc[j] = acc[j] + load(win, b + np.uint64(j))
            else:
                for j in range(m):
                    acc[j] = reduce2(op, acc[j], load(win, b + np.uint64(j)))
        o = np.uint64(t0 - lo)
        for j in range(m):
            store(out, o + np.uint64(j), acc[j])
        if both:
            for j in range(m):
                store(out2, o + np.uint64(j), acc[j])


@njit(**_CACHE)
def reduce_pair(win, stride, lo, hi, op, out, out2):
    """reduce_slots for P = 2: one loop per tile, no accumulator.  The copy
    to out2 is a loop of its own over the tile just written (still in L1):
    one loop storing to both arrays ran 3-4x slower."""
    s = np.uint64(stride)
    for t0 in range(lo, hi, TILE):
        m = min(TILE, hi - t0)
        b = np.uint64(t0)
        o = np.uint64(t0 - lo)
        if op == OP_SUM:
            for j in range(m):
                i = b + np.uint64(j)
                store(out, o + np.uint64(j), load(win, i) + load(win, i + s))
        else:
            for j in range(m):
                i = b + np.uint64(j)
                store(out, o + np.uint64(j), reduce2(op, load(win, i), load(win, i + s)))
        if out2.size > 0:
            for j in range(m):
                out2[o + np.uint64(j)] = out[o + np.uint64(j)]


@njit(**_CACHE)
def convert(src, dst):
    """dst = src rounded to dst's type (float32 -> float16/bfloat16 bits)."""
    for i in range(dst.size):
        store(dst, np.uint64(i), load(src, np.uint64(i)))
