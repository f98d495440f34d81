"""The magnitude bits of kernel elements: unsigned integers that order like
the magnitudes (Inf above every finite value, NaN above Inf), so a largest
magnitude is an integer max() that vectorizes, where a float one that must
skip NaN does not.  Used by the error bound's magnitude pass (block_absmax, for bounds/bound.py),
the shared window's kernels (kernels/shm.py) and the rotation's (kernels/rotate.py)."""
import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels.common import (
    CACHE,
    abs_bits,
    bf16_to_f32,
    f16_to_f32,
    u32_as_f32,
    u64_as_f64,
)


def mag_bits(src, i):
    """The magnitude bits of src[i] (a kernel element: float, or the bits of
    float16/bfloat16) as an unsigned integer of its width: they order like
    the magnitudes, Inf above every finite value and NaN above Inf."""


@overload(mag_bits, jit_options=CACHE)
def _mag_bits(src, i):
    if src.dtype == types.float32 or src.dtype == types.float64:
        return lambda src, i: abs_bits(src[i])
    return lambda src, i: np.uint16(src[i] & 0x7FFF)


def mag_limits(src):
    """(zero, the magnitude bits of Inf) in mag_bits' type."""


@overload(mag_limits, jit_options=CACHE)
def _mag_limits(src):
    dt = src.dtype
    if dt == types.float32:
        return lambda src: (np.uint32(0), np.uint32(0x7F800000))
    if dt == types.float64:
        return lambda src: (np.uint64(0), np.uint64(0x7FF0000000000000))
    inf = 0x7C00 if dt == types.int16 else 0x7F80        # float16, bfloat16
    return lambda src: (np.uint16(0), np.uint16(inf))


def mag_value(src, bits):
    """The magnitude whose bits mag_bits gave, as float64."""


@overload(mag_value, jit_options=CACHE)
def _mag_value(src, bits):
    dt = src.dtype
    if dt == types.float32:
        return lambda src, bits: np.float64(u32_as_f32(bits))
    if dt == types.float64:
        return lambda src, bits: u64_as_f64(bits)
    if dt == types.int16:
        return lambda src, bits: np.float64(f16_to_f32(np.int16(bits)))
    return lambda src, bits: np.float64(bf16_to_f32(bits))


@njit(inline='always', **CACHE)
def absmax_bits(src, lo, m, finite_only):
    """The magnitude bits (mag_bits) of the largest value of src[lo:lo+m]:
    of its finite values only, or at least Inf's if it holds Inf or NaN.
    On the bits, which order like the magnitudes: an integer max()
    vectorizes; a run holding Inf or NaN (rare) is scanned again."""
    zero, inf = mag_limits(src)
    b = np.uint64(lo)
    mx = zero
    for j in range(m):
        mx = max(mx, mag_bits(src, b + np.uint64(j)))
    if mx >= inf and finite_only:
        mx = zero
        for j in range(m):
            x = mag_bits(src, b + np.uint64(j))
            if x < inf and x > mx:
                mx = x
    return mx


@njit(**CACHE)
def block_absmax(values, block, finite_only, out):
    """out[b] = the largest magnitude in block b of ``values`` (a kernel
    view): of its finite values only, or Inf if it holds Inf or NaN."""
    inf = mag_limits(values)[1]
    n = values.size
    for b in range(out.size):
        lo = b * block
        mx = absmax_bits(values, lo, min(lo + block, n) - lo, finite_only)
        out[b] = np.inf if mx >= inf else mag_value(values, mx)
