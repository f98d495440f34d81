"""A wire format that shows each of this rank's quantizations to watchers:
error feedback (feedback.py) carries what they lost into the next call, a
measured bound (bounds/measured.py) bounds it.  Both need the same thing,
per piece quantized: the values v it quantized and what they decode to.

Each encode, hop (own + a decoded input, quantized) and two-shot owner's
reduction is run by the format as always, then the piece is decoded again
and every watcher gets ``(D(w) - v, own, w)``: the difference in the
accumulation type, zero in the blocks the format flagged (reduced exactly
afterwards), ``own`` the call's own view (its start tells where the piece
lies in the input; rabenseifner's fused hops pass their accumulator), ``w``
the piece's views (what the bound's Tally reads next, before ``w`` is
quantized again: the measured bound's hand-off).  Every decoded value
a rank reads is bit for bit what ``decode`` gives, so the difference is
what the receivers see.  Everything else (nbytes, views, decode...) is the
format's own.
"""
import numpy as np

from equarx_mpi.names import VALUE_DTYPE

#: the numpy type of each 16-bit kernel element type
WIDE = {kd: d for kd, d in VALUE_DTYPE.items() if kd.itemsize == 2}


class Watched:
    """``fmt`` with its quantizations shown to ``watchers``; ``tmp``: two
    accumulation-type arrays at least as long as any piece (partial sums
    and decoded values)."""

    def __init__(self, fmt, tmp, watchers):
        self._fmt, self._watchers = fmt, tuple(watchers)
        self.block, self.name = fmt.block, fmt.name
        self._v, self._d = tmp
        #: ids of the pieces whose values are sums this rank made (its hops)
        self.reduced = set()

    def __getattr__(self, name):
        return getattr(self._fmt, name)

    def _values(self, src):
        """src (a kernel view) in the accumulation type."""
        if src.dtype == self._v.dtype:
            return src
        v = self._v[:src.size]
        v[...] = src.view(WIDE[src.dtype])
        return v

    def _seen(self, v, w, own):
        d = self._d[:v.size]
        # into the accumulation type: only Inf or NaN flags a block (no
        # 16-bit output limit: a later hop still adds such a block)
        skipped = self._fmt.decode(w, d)
        with np.errstate(invalid="ignore", over="ignore"):   # flagged blocks: zeroed next
            d -= v
        B = self.block
        for b in skipped:
            d[b * B:(b + 1) * B] = 0
        for watch in self._watchers:
            watch(d, own, w)

    def encode(self, src, w, rmode, at=None):
        self._fmt.encode(src, w, rmode, at)
        self._seen(self._values(src), w, src)

    def decode_reduce_encode(self, own, wi, wo, op, rmode, at=None):
        # the partial sum first: wi may be wo (the hop in place)
        v = self._v[:own.size]
        self._fmt.decode_reduce(own, wi, v, op)
        self._fmt.decode_reduce_encode(own, wi, wo, op, rmode, at)
        self.reduced.add(id(wo))
        self._seen(v, wo, own)

    def decode_reduce_encode_many(self, own, pos, ws, wo, op, rmode):
        v = self._v[:own.size]
        self._fmt.decode_reduce_many(own, pos, ws, v, op)
        self._fmt.decode_reduce_encode_many(own, pos, ws, wo, op, rmode)
        self.reduced.add(id(wo))
        self._seen(v, wo, own)
