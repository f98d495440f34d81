"""The two-shot owner's many-input reductions for a block format without
fused many-input kernels (int4, fp8, the affine wires): the one-input
kernels applied one message after another into an accumulator of the
accumulation type.

The same rank order and the same full-precision sums as a fused kernel
(int8's), so the same bound (bound.Tally.many) holds; it makes P-1 passes
over a piece instead of one, but compiles nothing new: every call here is
a kernel signature the ring already uses (float16 and bfloat16 inputs
reuse float32's), and compile time is what the cold start pays
(docs/PERFORMANCE.md "Cold start").
"""
import numpy as np

from equarx_mpi.bounds.bound import OUT_LIMIT
from equarx_mpi.names import KERNEL_OP, VALUE_DTYPE, acc_dtype


class ComposedMany:
    """A mixin of wire/base.py's Format: stack_views, decode_reduce_many and
    decode_reduce_encode_many (base.py says what they compute)."""

    def stack_views(self, buf, n, count, stride=None):
        """One piece's views per message, messages ``stride`` bytes apart
        (default: back to back)."""
        size = stride or self.nbytes(n)
        return [self.views(buf[i * size:(i + 1) * size], n) for i in range(count)]

    def part_stack(self, ws, lo, hi):
        return [self.part(w, lo, hi) for w in ws]

    def decode_reduce_many(self, own, pos, ws, out, op):
        acc = self._accumulate(own, pos, ws, op)
        B, n = self.block, acc.size
        nb = -(-n // B)
        mag = np.zeros(nb * B, acc.dtype)
        np.abs(acc, out=mag[:n])
        with np.errstate(invalid="ignore"):      # NaN: a flagged block
            keep = (mag.reshape(nb, B) < OUT_LIMIT.get(out.dtype, np.inf)).all(axis=1)
        skipped = self._skip(n)
        bad = np.flatnonzero(~keep)
        skipped[:bad.size] = bad
        each = np.repeat(keep, B)[:n]
        value = VALUE_DTYPE[out.dtype]
        out.view(value)[each] = acc[each].astype(value)
        return skipped[:bad.size]

    def decode_reduce_encode_many(self, own, pos, ws, wo, op, rmode):
        acc = self._accumulate(own, pos, ws, op)
        ro = acc.view()
        ro.flags.writeable = False
        # stochastic rounding keys each value by its place in the input
        self.encode(ro, wo, rmode, at=own)

    def _accumulate(self, own, pos, ws, op):
        """The reduction of own (in place pos) and the messages ws (in rank
        order around it) in the accumulation type, as a view of a buffer
        reused by the next piece.  Blocks flagged in any message, or whose
        partial result overflows, are NaN, so they end flagged; under MAX
        or MIN so are those where own holds Inf or NaN (MIN(+Inf, x) would
        drop it), as int8's kernel does."""
        n = own.size
        acc_t = acc_dtype(own.dtype)
        if getattr(self, "_acc", None) is None or self._acc.size < n or self._acc.dtype != acc_t:
            self._acc = np.empty(n, acc_t)
        acc = self._acc[:n]
        ro = acc.view()
        ro.flags.writeable = False
        mine = own if own.dtype == acc_t else _widen(own)
        B = self.block
        for t in range(len(ws) + 1):
            if t == pos:
                if t == 0:
                    acc[:] = mine
                else:
                    _reduce(op, acc, mine)
                continue
            w = ws[t if t < pos else t - 1]
            skipped = self.decode(w, acc) if t == 0 else self.decode_reduce(ro, w, acc, op)
            for b in skipped:
                acc[b * B:(b + 1) * B] = np.nan
        if op != KERNEL_OP["sum"]:
            bad = ~np.isfinite(mine)
            if bad.any():
                for b in np.unique(np.flatnonzero(bad) // B):
                    acc[b * B:(b + 1) * B] = np.nan
        return acc


def _widen(own):
    """A 16-bit kernel view's values in float32."""
    if own.dtype == np.uint16:       # bfloat16: the upper half of a float32
        return (own.astype(np.uint32) << 16).view(np.float32)
    return own.view(VALUE_DTYPE[own.dtype]).astype(np.float32)


def _reduce(op, acc, x):
    """acc = acc (op) x as kernels/common.reduce2 does it: a NaN from either
    side, and under MAX the left one of equals (so -0.0 max 0.0 is -0.0,
    where numpy's maximum gives 0.0)."""
    if op == KERNEL_OP["sum"]:
        np.add(acc, x, out=acc)
        return
    with np.errstate(invalid="ignore"):
        pick = np.where(acc >= x, acc, x) if op == KERNEL_OP["max"] else np.where(acc <= x, acc, x)
        acc[:] = np.where(np.isnan(acc) | np.isnan(x), acc + x, pick)
