"""Stochastic rounding's generator and code choice, shared by the int8 and
int4 kernels (ROUND_STOCHASTIC in common.py), and ``symmetric_code``: a
symmetric format's code of a value in every rounding mode (int4, lowbit).

A counter-based generator: the uniform number of value i of a piece is a
hash of (stream + i), so any piece can be encoded alone, in any order, by
a vectorized loop.  The hash is splitmix64's output step (Steele, Lea and
Flood, 2014); ``stream`` already mixes the seed, the call and the rank, and
the piece's offset times GOLDEN (wire/base.py: Format._stream), so value i of a
piece draws splitmix64's output for state key + (global index + 1) * GOLDEN.
"""
import numpy as np
from numba import njit, types
from numba.extending import overload

from equarx_mpi.kernels.common import CACHE, ROUND_NEAREST, ROUND_STOCHASTIC, ROUND_UP, cast_like

GOLDEN = 0x9E3779B97F4A7C15


@njit(inline='always', **CACHE)
def mix64(z):
    """splitmix64's finalizer: a bijection of uint64 with full avalanche."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform(stream, i, like):
    """A uniform number in [0, 1) for value i of the piece of ``stream``, in
    the type of the float ``like``: k * 2^-24 (float32) or k * 2^-53
    (float64), k the top bits of mix64(stream + (i + 1) * GOLDEN)."""


@overload(uniform, jit_options=CACHE, inline='always')
def _uniform(stream, i, like):
    if like == types.float32:
        def u32(stream, i, like):
            z = mix64(np.uint64(stream) + (np.uint64(i) + np.uint64(1)) * np.uint64(GOLDEN))
            return np.float32(np.int64(z >> np.uint64(40))) * np.float32(2.0 ** -24)
        return u32
    if like == types.float64:
        def u64(stream, i, like):
            z = mix64(np.uint64(stream) + (np.uint64(i) + np.uint64(1)) * np.uint64(GOLDEN))
            return np.float64(np.int64(z >> np.uint64(11))) * np.float64(2.0 ** -53)
        return u64


@njit(inline='always', **CACHE)
def stochastic_code(x, q, a, levels, stream, i):
    """The code of x (q = x scaled to code units, |q| <= levels up to the
    scale's rounding): floor(q) + 1 with probability frac(q) = q - floor(q),
    else floor(q), so E[code] = q up to U's granularity (frac(q) is exact
    except for q in (-1, 0), where it is within half a unit of 1): the bias
    is below 2^-23 of a step (float32) or 2^-52 (float64).  Clamped to
    +-levels (the rounding of the scale can put q a few units past it) and
    +-a (the block's extremes) mapped to +-levels always, so they decode
    exactly as with nearest rounding.  A q already on a code keeps it."""
    f = np.floor(q)
    c = f + (cast_like(q, 1) if uniform(stream, i, q) < q - f else cast_like(q, 0))
    c = min(max(c, -levels), levels)
    c = levels if x == a else c
    return -levels if x == -a else c


@njit(inline='always', **CACHE)
def symmetric_code(x, q, a, k, levels, rmode, stream, i):
    """The code of x (q = x scaled to code units), value i of its piece, in
    a format decoding code c as (c * k) * a with +-levels decoding to +-a:
    nearest, stochastic, or ceiling / floor corrected so the decoded value
    never falls below / above x (the roundings of the scale and of the
    decode can cross it; the correction never leaves [-levels, levels]).
    All in x's type: a plain integer would promote float32 to float64."""
    if rmode == ROUND_NEAREST:
        return np.rint(q)
    if rmode == ROUND_STOCHASTIC:
        return stochastic_code(x, q, a, levels, stream, i)
    if rmode == ROUND_UP:
        c = min(np.ceil(q), levels)
        if (c * k) * a < x:
            c += 1
        return c
    c = max(np.floor(q), -levels)
    if (c * k) * a > x:
        c -= 1
    return c
