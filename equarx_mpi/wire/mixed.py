"""The error-bounded mode's wire format, "mixed" (kernels/mixed.py,
docs/FORMAT.md): each block in the cheapest encoding (none, int4,
int4-affine, int8, int8-affine, int16, raw, or differences on a grid:
kernels/delta.py) whose bound fits the budget, named by a per-block tag.  Sum only, two-shot only (wire/base.py lists the
methods a format offers; this one has no single-input decode_reduce).

Pieces vary in length: a message is the piece's used bytes followed by its
trailer (bound.TRAILER), and a received one has its trailer moved back to
the end of the buffer, where ring.Piece reads it (``message``,
``received``).  The budget (a tolerance.Budget) is set by the engine before
each call: a sender's blocks stay within ``budget.send``; the owner's room
comes from the trailers of the messages it reduces (tolerance.owner_room).
"""
import math

import numpy as np

from equarx_mpi import kernels as K
from equarx_mpi.bounds import bound, tolerance
from equarx_mpi.wire.base import Format, acc_dtype, pad8

T = bound.TRAILER
#: whether blocks may go DELTA (prediction), read when the engine makes a
#: format: None (the default) across nodes only, True always, False never.
#: Prediction spends kernel time to save wire bytes, which on one node
#: did not pay (docs/results/tolerance-kinds-shm.txt).  Tests of the
#: kernels under mpirun set True; ablations (bench tolerance --ablate) both.
PREDICT = None


class Mixed(Format):
    name = "mixed"

    def __init__(self, block, kdtype):
        super().__init__(block, kdtype)
        self.head = acc_dtype(kdtype)
        self.u, self.eta = bound.acc_rounding(self.head)
        self.scratch = np.empty(4 * block, self.head)
        self.qs = np.empty(2 * block, np.int64)      # DELTA's grid indices
        self.predict = np.int64(PREDICT is not False)
        self._heads = np.empty(0, self.head)
        self._cur = np.empty((0, 2), np.int64)
        #: tolerance.Budget of the call; None: every block raw
        self.budget = None

    def place(self, one_node):
        """Where the schedule runs: on one node DELTA is off unless PREDICT
        says otherwise."""
        self.predict = np.int64(PREDICT if PREDICT is not None else not one_node)

    def nbytes(self, n):
        # the most a piece can take: every payload raw (DELTA's is never
        # longer), three headers per block (DELTA's); and room for the trailer behind the used bytes, so that it
        # never overlaps the one at the end of the buffer (``message``)
        nb = -(-n // self.block)
        a = self.head.itemsize
        full, last = divmod(n, self.block)
        return (K.MX_META + pad8(nb) + full * pad8(self.block * a) + pad8(last * a)
                + pad8(K.MX_HEADS * nb * a) + T)

    def views(self, buf, n):
        # the kernels' typed views of the same bytes, and n
        return (buf, buf.view(np.int8), buf.view(np.int16), buf.view(self.head),
                buf.view(np.int64), buf.view(np.float64), n)

    @staticmethod
    def _used(buf):
        return int(buf[:8].view(np.int64)[0])

    def message(self, buf):
        """The bytes to send: the used ones, then the trailer (copied behind
        them from the end of ``buf``)."""
        used = self._used(buf)
        buf[used:used + T] = buf[buf.size - T:].copy()
        return buf[:used + T]

    def received(self, buf):
        """A message arrived in ``buf``: its trailer back to the end."""
        used = self._used(buf)
        buf[buf.size - T:] = buf[used:used + T].copy()

    def _errors(self, w):
        n = w[6]
        nb = -(-n // self.block)
        q, m = np.empty(nb), np.empty(nb)
        K.mx_block_errors(w[0], w[3], w[4], n, self.block, self.u, self.eta, q, m)
        return q, m

    def block_errors(self, w, rmode):
        return self._errors(w)

    def piece_error(self, w, rmode, limit=math.inf):
        q, m = self._errors(w)
        keep = m < limit
        if not keep.all():
            q, m = q[keep], m[keep]
        return (float(q.max()), float(m.max())) if q.size else (0.0, 0.0)

    def _heads_for(self, n):
        nb = -(-n // self.block)
        if self._heads.size < K.MX_HEADS * nb:
            self._heads = np.empty(K.MX_HEADS * nb, self.head)
        return self._heads

    def encode(self, src, w, rmode, at=None):
        room = 0.0 if self.budget is None else self.budget.send
        K.mx_encode(src, *w[:6], self.block, room, self.u, self.eta, self.scratch,
                    self._heads_for(src.size), self.qs, self.predict)

    def decode(self, w, out):
        skipped = self._skip(out.size)
        return skipped[:K.mx_decode(*w[:6], out, self.block, self.scratch, skipped)]

    def stack_views(self, buf, n, count, stride=None):
        """Rows of ``stride`` bytes (default: nbytes(n)); with room for a
        trailer behind each (two_shot.py), its float64 view comes last."""
        size = stride or self.nbytes(n)
        rows = buf[:count * size].reshape(count, size)
        tr = rows[:, size - T:].view(np.float64) if size >= self.nbytes(n) + T else None
        return (rows, rows.view(np.int8), rows.view(np.int16), rows.view(self.head),
                rows.view(np.int64), tr)

    def _cursors(self, count):
        if self._cur.shape[0] < count:
            self._cur = np.empty((count, 2), np.int64)
        return self._cur[:count]

    def decode_reduce_many(self, own, pos, ws, out, op):
        skipped = self._skip(out.size)
        return skipped[:K.mx_decode_reduce_many(own, pos, *ws[:5], out, self.block, self.scratch,
                                                self._cursors(ws[0].shape[0]), skipped)]

    def decode_reduce_encode_many(self, own, pos, ws, wo, op, rmode):
        room = 0.0
        if self.budget is not None and ws[5] is not None:
            room = tolerance.owner_room(self.budget, ws[5])
        K.mx_decode_reduce_encode_many(own, pos, *ws[:5], *wo[:6], self.block, room, self.u,
                                       self.eta, self.scratch, self._heads_for(own.size),
                                       self._cursors(ws[0].shape[0]), self.qs, self.predict)
