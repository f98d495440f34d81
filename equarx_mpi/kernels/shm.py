"""Numba kernels of the shared-window AllReduce (equarx_mpi/shm.py).

Pure functions on contiguous 1-D arrays.  The window is one flat array in
the kernels' element type (float32, float64, or the bits of float16 as int16
and of bfloat16 as uint16, see kernels/common.py); slot k starts at
``k * stride`` and its data ``at[k]`` values into it (each rank says where
its own starts).  The ``op`` argument is 0 for SUM, 1 for MAX, 2 for MIN.

The reduction of slice [lo, hi) is, for every j in it,

    r[j] = (...((x_0[j] op x_1[j]) op x_2[j]) ... op x_{P-1}[j])

evaluated left to right in the accumulation type (float64 for float64 input,
float32 otherwise) and rounded once to the output type (to nearest even).
The order is fixed, so every rank, every call and every slicing of the work
gives the same bits; MAX and MIN keep a NaN from either side, as numpy's
maximum and minimum do.

For SUM the reductions also return the largest finite magnitude among the
values they read (as float64, 0.0 for MAX and MIN): the exact sum's error
bound needs it, and finding it here, on tiles still in L1, saves a pass
over the caller's memory.
"""
import numpy as np
from numba import njit

from equarx_mpi.kernels.common import OP_SUM, load, reduce2, store
from equarx_mpi.kernels.magnitude import absmax_bits, mag_value

_CACHE = dict(cache=True, nogil=True)
#: Values per tile of the fused reduction: the accumulator of one tile stays
#: in L1 (16 KiB of float32) while the P slots stream past it once each.
TILE = 4096


@njit(**_CACHE)
def _load_tile(acc, src, b, m):
    for j in range(m):
        acc[j] = load(src, b + np.uint64(j))


@njit(**_CACHE)
def _reduce_tile(acc, src, b, m, op):
    if op == OP_SUM:
        for j in range(m):
            acc[j] = acc[j] + load(src, b + np.uint64(j))
    else:
        for j in range(m):
            acc[j] = reduce2(op, acc[j], load(src, b + np.uint64(j)))


@njit(**_CACHE)
def _store_tile(acc, out, o, m):
    for j in range(m):
        store(out, o + np.uint64(j), acc[j])


@njit(**_CACHE)
def _absmax_tile(src, b, m, mx):
    """The largest of mx and the finite magnitudes of src[b:b+m], as
    float64.  On the magnitudes' bits: an integer maximum vectorizes, a
    float one that must skip NaN does not; a tile holding Inf or NaN is
    scanned again without them (magnitude.absmax_bits)."""
    v = mag_value(src, absmax_bits(src, b, m, True))
    return v if v > mx else mx


@njit(**_CACHE)
def reduce_slots(win, stride, at, P, me, own, lo, hi, op, acc, out, out2):
    """out[:hi-lo] = the reduction over k = 0..P-1, in that order, of slot
    k's values [lo, hi): win[k*stride + at[k] + lo : k*stride + at[k] + hi],
    except that slot ``me`` is read from own[lo:hi] (the caller's own input,
    which then need not be copied into the window; me = -1: none).  The
    same into out2 unless out2 is empty.  Returns the largest finite
    magnitude read (SUM).

    acc is scratch in the accumulation type (its size is the tile).  Each
    tile is read once from every slot and written once: one pass over
    memory, where P numpy additions would make P passes over the output.
    Indices are uint64 so that numba skips negative-index wraparound (which
    turns vector loads into gathers)."""
    T = acc.size
    mx = 0.0
    for t0 in range(lo, hi, T):
        m = min(T, hi - t0)
        b = np.uint64(t0)
        if me == 0:
            _load_tile(acc, own, b, m)
            if op == OP_SUM:
                mx = _absmax_tile(own, b, m, mx)
        else:
            _load_tile(acc, win, b + np.uint64(at[0]), m)
            if op == OP_SUM:
                mx = _absmax_tile(win, b + np.uint64(at[0]), m, mx)
        for k in range(1, P):
            src, sb = (own, b) if k == me else (win, b + np.uint64(k * stride + at[k]))
            _reduce_tile(acc, src, sb, m, op)
            if op == OP_SUM:
                mx = _absmax_tile(src, sb, m, mx)
        _store_tile(acc, out, np.uint64(t0 - lo), m)
        if out2.size > 0:
            _store_tile(acc, out2, np.uint64(t0 - lo), m)
    return mx


@njit(**_CACHE)
def reduce_pair(x0, b0, x1, b1, m, op, out, out2):
    """out[:m] = x0[b0:b0+m] op x1[b1:b1+m] (P = 2: no accumulator), and the
    same into out2 unless it is empty; returns the largest finite magnitude
    read (SUM).  The copy to out2 is a loop of its
    own over the tile just written (still in L1): one loop storing to both
    arrays ran 3-4x slower."""
    mx = 0.0
    for t0 in range(0, m, TILE):
        tm = min(TILE, m - t0)
        i0 = np.uint64(b0 + t0)
        i1 = np.uint64(b1 + t0)
        o = np.uint64(t0)
        if op == OP_SUM:
            for j in range(tm):
                u = np.uint64(j)
                store(out, o + u, load(x0, i0 + u) + load(x1, i1 + u))
            mx = _absmax_tile(x1, i1, tm, _absmax_tile(x0, i0, tm, mx))
        else:
            for j in range(tm):
                u = np.uint64(j)
                store(out, o + u, reduce2(op, load(x0, i0 + u), load(x1, i1 + u)))
        if out2.size > 0:
            for j in range(tm):
                out2[o + np.uint64(j)] = out[o + np.uint64(j)]
    return mx


@njit(**_CACHE)
def convert(src, dst):
    """dst = src rounded to dst's type (float32 -> float16/bfloat16 bits)."""
    for i in range(dst.size):
        store(dst, np.uint64(i), load(src, np.uint64(i)))


def readonly(a):
    """A read-only view: the kernels then see one array type for every
    caller's input, writable or not (one compiled version, not two)."""
    v = a.view()
    v.flags.writeable = False
    return v


def warm(kd, acc, at):
    """Compile (or load) every kernel for kernel type kd, accumulation type
    acc and the data starts ``at`` (len(at) slots) as equarx_mpi/shm.py
    calls them."""
    P = at.size
    x, f = np.zeros(max(2, P) * 64, kd), np.zeros(64, acc)
    ro = readonly(x)
    for out, out2 in ((x[:1], x[:0]), (f[:1], x[:0]), (x[:1], x[1:2])):
        reduce_pair(ro, 0, x, 64, 1, OP_SUM, out, out2)
        reduce_pair(x, 0, ro, 64, 1, OP_SUM, out, out2)
        reduce_slots(x, 64, at, P, P - 1, ro, 0, 1, OP_SUM, f, out, out2)
    convert(f[:1], x[:1])
