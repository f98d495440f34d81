"""Rotation around a quantized schedule (option ``rotate``; docs/FORMAT.md
"Rotation", docs/ERROR.md "Rotated calls").

Each rank rotates its input once into the accumulation type (chunks of
``size``, signs from the seed: the same on every rank), the schedule runs
unchanged on the rotated values (the sum of the rotated inputs is the
rotation of the sum), and the result is rotated back once, into the
caller's output.  A value is rotated with its index in the whole message,
so how a schedule cuts pieces does not matter; a Reduce_scatter_block or
Allgather shard is rotated on its own (its chunks start at the shard).

What the rotation cannot carry goes the exact way, from the caller's own
values: blocks the schedule flags (Inf or NaN spread over the block, or a
rotated value past the accumulation type) and blocks whose rotation back
could overflow the output (``risky``).  Chunks lie inside blocks (size
divides the block), so a block is rotated or exact as a whole.

The bound: with R the exact rotation (orthogonal, |R^T e|_i <= sqrt(S)
max |e| over the chunk), computed rotations carry at most ``rho(M)`` =
gamma_(k+5) sqrt(S) M + 2 eta on values whose chunk's magnitudes are at
most M (k = log2 S butterfly stages, the scale and its rounding; eta for
underflow).  A schedule bound E on the rotated values (each rank's
rounding rho(max |x_r|) entered as its own input's error) becomes
sqrt(S) E + rho(|z|) after the rotation back, plus the rounding into a
16-bit output.
"""
import math

import numpy as np

from equarx_mpi.bounds import bound
from equarx_mpi.kernels import rotate as kernels
from equarx_mpi.names import ROUND_NEAREST, acc_dtype, kernel_dtype, workspace

#: rotate="auto" rotates a call where, on a sample of whole blocks, one
#: quantization through the call's wire loses at least AUTO_GAIN times the
#: squared error as the values are than rotated (summed over the ranks):
#: the L2 error then drops at least sqrt(2)-fold, which pays for the two
#: passes.  Measured, not modelled: a low-bit wire can lose more rotated
#: (a block whose one spike dominates it: its small values round to zero
#: as they are, rotated every value carries the spike's step)
AUTO_GAIN = 2.0
#: values per rank the estimate samples (whole blocks, one from each of
#: evenly spaced strata, at a random place in it: no stride that a layout
#: of channels could alias)
SAMPLE = 1 << 15
#: the sign pattern's key: one rotation per seed (every call and piece is
#: told apart by the values' indices, which the signs depend on)
KEY = 0


class Rotation:
    """The rotation of a communicator's calls: ``size`` (a power of two
    dividing the block), signs from ``seed``."""

    def __init__(self, size, seed, block):
        self.size, self.seed, self.block = size, seed, block
        self._k = size.bit_length() - 1
        self._root = math.sqrt(size)
        self._bufs = {}

    def __repr__(self):
        return f"Rotation(size={self.size}, seed={self.seed})"

    def buffer(self, n, dtype, which=0):
        """A workspace of n values of dtype's accumulation type (kept for
        the next call; never the caller's memory)."""
        acc = acc_dtype(dtype)
        return workspace(self._bufs, (acc.str, which), n, acc)

    def free(self):
        self._bufs.clear()

    def forward(self, src, y, start=0):
        """y = the rotation of src (flat, caller's type), values numbered
        from ``start``.  Returns the error that rounding put on y: rho of
        src's largest finite magnitude (blocks holding Inf or NaN go exact),
        which the kernel finds as it reads src."""
        return self.rho(kernels.rotate(src, y, self.size, self.seed, KEY, start), src.dtype)

    def backward(self, z, out, start=0):
        """out = the rotation back of z (accumulation type) into out's type."""
        kernels.unrotate(z, out, self.size, self.seed, KEY, start)

    def rho(self, most, dtype):
        """The rounding of one rotation (either way) of values of magnitude
        at most ``most`` (accumulation type of dtype)."""
        u, eta = bound.acc_rounding(kernel_dtype(dtype))
        with np.errstate(over="ignore", invalid="ignore"):
            return bound.gamma(self._k + 5, u) * self._root * most + 2 * eta

    def back(self, z, out, exact=(), start=0):
        """out = the rotation back of z (a rotated result, values numbered
        from ``start``), block by block, except the blocks ``exact``
        (indices of z's blocks) and those whose rotation back could
        overflow the accumulation type or out's type: they keep out's
        values (in place, the caller's own, for the exact fix-up).
        Returns (per block of z its largest finite magnitude, the risky
        block indices)."""
        grow = 1 + bound.gamma(self._k + 5, bound.acc_rounding(z.dtype)[0])
        top = float(np.finfo(z.dtype).max)
        limit = min(top, bound.out_limit(kernel_dtype(out.dtype)))
        most = min(top / (self.size * grow), limit / (self._root * grow)) * (1 - 2.0 ** -40)
        flags = np.zeros(-(-z.size // self.block), np.uint8)
        flags[np.asarray(exact, np.int64)] = 1
        mags = kernels.unrotate(z, out, self.size, self.seed, KEY, start, self.block, flags, most)
        return mags, np.flatnonzero(flags & kernels.RISKY)

    def x_bound(self, e, mags, dtype):
        """The bound on the caller's values of blocks whose rotated values
        have bound e (float or per block) and magnitudes mags (per block),
        output in dtype."""
        uc, etac = bound.cast(kernel_dtype(dtype))
        with np.errstate(over="ignore", invalid="ignore"):
            rho = self.rho(mags, dtype)
            back = self._root * mags + rho
            return self._root * e + rho + uc * back + etac


def errors(x, fmt, rot):
    """This rank's (squared error, squared error rotated) of one
    quantization to nearest through ``fmt`` (the wire's format for x's
    accumulation type) of about SAMPLE values of x in whole blocks; blocks
    holding Inf or NaN left out (they go the exact way either way).  Both
    errors are in the rotated values' own terms: the rotation is
    orthogonal, so rotated back they are the same."""
    block = rot.block
    nb = x.size // block
    k = min(nb, max(1, SAMPLE // block))
    if k == 0:
        return 0.0, 0.0
    starts = np.arange(k) * nb // k
    widths = np.diff(np.append(starts, nb))
    pick = starts + np.random.default_rng(k).integers(0, widths)
    rows = x[:nb * block].reshape(nb, block)[pick].astype(acc_dtype(x.dtype))
    v = rows[np.isfinite(rows).all(axis=1)].reshape(-1)
    w = fmt.views(np.empty(fmt.nbytes(v.size), np.uint8), v.size)
    out = np.empty_like(v)

    def lost(a):
        fmt.encode(a, w, ROUND_NEAREST)
        out[...] = a                # blocks the decode skips (overflow): no error
        fmt.decode(w, out)
        # values rotated past the type's range (Inf): NaN, which never rotates
        with np.errstate(invalid="ignore", over="ignore"):
            d = out.astype(np.float64) - a
            return float(d @ d)
    y = np.empty_like(v)
    kernels.rotate(v, y, rot.size, rot.seed, KEY)
    return lost(v), lost(y)


def warm(acc):
    """Compile (or load) the rotation kernels for every input type whose
    accumulation type is ``acc``: both ways, into the input's type and the
    accumulation type (error feedback turns its residual)."""
    from equarx_mpi.names import QUANTIZED_DTYPES
    y = np.zeros(9, acc)
    for dt in QUANTIZED_DTYPES:
        if acc_dtype(dt) == acc:
            x = np.zeros(9, dt)
            kernels.rotate(x, y, 4, 0, KEY)
            kernels.unrotate(y, x, 4, 0, KEY)
    kernels.unrotate(y, y.copy(), 4, 0, KEY)


def add_blocks(ranges, blocks, block, n, offset=0):
    """ranges (sorted (lo, hi) value ranges) with the given block indices
    added (blocks of ``block`` values from ``offset``), sorted, merged."""
    if not len(blocks):
        return ranges
    extra = [(offset + int(b) * block, min(offset + (int(b) + 1) * block, offset + n))
             for b in blocks]
    merged = []
    for lo, hi in sorted(list(ranges) + extra):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged
