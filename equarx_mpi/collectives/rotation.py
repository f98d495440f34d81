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
from equarx_mpi.names import acc_dtype, kernel_dtype, workspace

#: rotate="auto" rotates a call whose sampled blocks' largest squares, summed
#: over the ranks, exceed AUTO_SCORE times what Gaussian blocks of the same
#: energy reach (2 ln B times their mean square; Gaussian blocks of 256 score
#: about 0.8): rotated, the L2 error then drops about sqrt(score / 0.8)-fold
AUTO_SCORE = 2.0
#: values per rank the score samples (whole blocks, evenly spread)
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


def outliers(x, block):
    """This rank's (sum of the sampled blocks' largest squares, 2 ln(block)
    / block times the sum of their squares): auto's score, summed over the
    ranks, is their ratio.  About SAMPLE values: a small fraction of a call
    large enough to travel quantized."""
    rows = x[:x.size // block * block].reshape(-1, block)
    v = rows[::max(1, rows.size // SAMPLE)].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):   # Inf or NaN: no rotation
        m = np.abs(v).max(axis=1, initial=0.0)
        return float(m @ m), float(np.vdot(v, v)) * 2 * math.log(block) / block


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
