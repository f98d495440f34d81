"""What every wire format shares, and the wires' names.  A wire format: how a piece of values is laid out in a message, and which
kernels turn values into that layout and back.  The one place schedules
go through; they never look inside a format.

A format is bound to the kernel element type of the input (the header of
an int8 block is in the accumulation type, so its size depends on it) and
offers, on pieces (1-D kernel views; ``w`` is what ``views`` returns):

    encode(src, w, rmode)                  w = Q(src)
    decode(w, out) -> skipped              out = D(w)
    decode_reduce(own, w, out, op) -> skipped     out = own (op) D(w)
    decode_reduce_encode(own, wi, wo, op, rmode)  wo = Q(own (op) D(wi)); wi may be wo

and, for a schedule that reduces many messages at once (two_shot.py), on
``count`` messages of one piece lying back to back (``ws`` is what
``stack_views`` returns), reduced in rank order with own in place ``pos``:

    decode_reduce_many(own, pos, ws, out, op) -> skipped
    decode_reduce_encode_many(own, pos, ws, wo, op, rmode)

Decodes skip (leave untouched) the blocks holding Inf or NaN, or whose
values would overflow out's type, and return their indices (valid until
the next decode); the caller reduces those blocks exactly (exact.py).  A piece's bytes are
padded to a multiple of 8 so the next piece's views stay aligned.

Error bounds (bound.py, docs/ERROR.md), from a piece's headers (plain
wires: from one pass over its values):

    piece_error(w, rmode, limit) -> (q, m)   q bounds |x - D(Q(x))| and m
        |x| for every value x of the blocks a decode keeps (finite, below
        ``limit``: out's overflow threshold, for block formats); floats
    block_errors(w, rmode) -> (q, m)         the same per block (arrays;
        m is Inf for a flagged block); None: no bound (Inf)

Stochastic rounding: streams.py says how each piece's random numbers are keyed.
"""
import math

import numpy as np

from equarx_mpi.bounds import bound
from equarx_mpi.names import ROUND_NEAREST, acc_dtype  # noqa: F401 (acc_dtype: the formats' word for it)
from equarx_mpi.wire.streams import Streams


def pad8(n):
    return (n + 7) & ~7


def _largest_below(h, limit):
    """The largest of the nonnegative h below limit (0 if none)."""
    a = float(h.max()) if h.size else 0.0
    if not a < limit:               # a flagged block, or one the decode skips
        h = h[h < limit]
        a = float(h.max()) if h.size else 0.0
    return a


class Format(Streams):
    #: codes two per byte: blocks must then start on a byte
    nibbles = False
    #: whether decoding into a 16-bit output rounds (not for plain 16-bit wires)
    decode_rounds = True
    #: whether the final decode skips blocks beyond a 16-bit output's range
    #: (plain wires skip only blocks holding Inf or NaN)
    skips_overflow = True

    def piece_error(self, w, rmode, limit=math.inf):
        """A format without its own bound reports none (Inf)."""
        return math.inf, math.inf

    def block_errors(self, w, rmode):
        return None

    #: headers per block (the affine wires keep two: minimum and maximum)
    heads_per_block = 1

    def part(self, w, lo, hi):
        """The views of values [lo, hi) of a piece's views w; lo is a
        multiple of the block (wire/threaded.py runs parts on threads)."""
        B, k = self.block, self.heads_per_block
        codes = w[1][lo // 2:(hi + 1) // 2] if self.nibbles else w[1][lo:hi]
        return w[0][k * (lo // B):k * -(-hi // B)], codes

    def part_stack(self, ws, lo, hi):
        """The same for stack_views' views; None: not cut (one thread)."""
        return None

    def message(self, buf):
        """The bytes of a piece's buffer to send (mixed: fewer)."""
        return buf

    def received(self, buf):
        """A message arrived in buf (mixed moves its trailer)."""

    def __init__(self, block, kdtype):
        if self.nibbles and block % 2:
            raise ValueError(f"{self.name} packs two codes per byte: block {block} must be even")
        self.block = block
        self.scratch = np.empty(block, acc_dtype(kdtype))
        self._skipped = np.empty(0, np.int64)
        Streams.__init__(self)

    def _skip(self, n):
        """A buffer for the indices of skipped blocks of an n-value piece."""
        nb = -(-n // self.block)
        if self._skipped.size < nb:
            self._skipped = np.empty(nb, np.int64)
        return self._skipped


class _Symmetric(Format):
    """A block format whose header is the block's largest magnitude ``a``
    and whose quantization error is at most coef * a + eta (docs/FORMAT.md):
    coef from ``_coefs(u)`` = (to nearest, directed)."""

    def __init__(self, block, kdtype):
        super().__init__(block, kdtype)
        self.head = acc_dtype(kdtype)
        u, self._eta = bound.acc_rounding(self.head)
        self._coef = self._coefs(u)

    def block_errors(self, w, rmode):
        a = w[0].astype(np.float64)
        with np.errstate(over="ignore"):    # a float64 block near its maximum: the bound is Inf
            return self._coef[rmode != ROUND_NEAREST] * a + self._eta, a

    def piece_error(self, w, rmode, limit=math.inf):
        a = _largest_below(w[0], limit)
        return self._coef[rmode != ROUND_NEAREST] * a + self._eta, a
