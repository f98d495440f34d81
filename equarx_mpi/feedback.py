"""Error feedback: each rank carries what quantization lost on its values
into its next call on the same buffer, so that losses do not pile up.

    ef = equarx_mpi.ErrorFeedback()            # one per buffer, on every rank
    for step in range(steps):
        qc.Allreduce(MPI.IN_PLACE, grad, feedback=ef)

Call t reduces v_t = x_t + e_{t-1} (the rank's input plus its residual) and
keeps as e_t everything this rank's own quantizations lost in the call:
for each piece it encodes, v - D(Q(v)); for each hop, the partial sum
own + D(w_in) minus D(w_out); the value of a quantization lands at the
positions of the values it quantized.  Every decoded value a rank reads is
bit for bit what the rank before it sent, so the result of call t is
sum_r (x_{r,t} + e_{r,t-1} - e_{r,t}) and the results telescope:

    sum_{t<=T} out_t = sum_{t<=T} sum_r x_{r,t} - sum_r e_{r,T}

up to the rounding of the float additions (a unit roundoff each): the
running sum stays within one residual of the exact running sum (about one
quantization step of the partial sums, per rank), whatever T, while a
biased rounding error without feedback adds up T times.  Also kept: for
16-bit inputs, the rounding of x + e to the input type; for 16-bit outputs,
the owner's rounding of its finished shard into the output.  Blocks
reduced exactly (flagged: Inf or NaN, or too large for a 16-bit output)
lose nothing, and their residual restarts at zero.  A call that takes an
exact path (one rank, a message below min_quantized_bytes, algorithm
"mpi" or "shm") reduces x + e exactly and so hands the whole residual on.

The losses are measured around the schedule, not in it: a proxy of the
wire format (``format``) decodes what each encode or hop produced and
compares; the position of a piece is where its ``own`` view starts in the
input.  Works with the ring and two-shot schedules (Allreduce, op SUM);
hierarchical calls raise ValueError.
"""
import ml_dtypes
import numpy as np

from .formats import acc_dtype
from .streams import address
from .validate import BFLOAT16, QUANTIZED_DTYPES

#: the numpy type of each 16-bit kernel element type
_WIDE = {np.dtype(np.int16): np.dtype(np.float16), np.dtype(np.uint16): BFLOAT16}


class ErrorFeedback:
    """The residual one rank carries from one Allreduce to the next on the
    same buffer: pass it as ``feedback=`` to ``QuantizedComm.Allreduce``
    (op SUM, a float buffer).  Its first call fixes the count and dtype; a
    call with another raises ValueError until ``reset()``.  Not shared
    between buffers or threads: use one per buffer."""

    def __init__(self):
        self.reset()

    def reset(self):
        """Drop the residual: the next call starts afresh, with any shape."""
        self._count = self._dtype = None
        self._res = self._next = self._adj = self._tmp = None
        self._flagged = []

    @property
    def residual(self):
        """This rank's residual after the last call (read-only, float32, or
        float64 for float64 buffers), or None before the first call."""
        if self._res is None:
            return None
        v = self._res.view()
        v.flags.writeable = False
        return v

    def __repr__(self):
        if self._res is None:
            return "ErrorFeedback(empty)"
        return (f"ErrorFeedback({self._count} {self._dtype.name} values, "
                f"max |residual| {float(np.max(np.abs(self._res), initial=0)):.3g})")

    # --- used by QuantizedComm ---------------------------------------------------
    def begin(self, own):
        """The input of this call: own (the caller's flat values) plus the
        residual, rounded to own's type; the next residual starts as what
        that rounding lost."""
        n, dt = own.size, own.dtype
        acc = acc_dtype(dt)
        if self._res is None:
            self._count, self._dtype = n, dt
            self._res = np.zeros(n, acc)
            self._next = np.empty(n, acc)
            self._adj = np.empty(n, dt)
        adj, nxt = self._adj, self._next
        if dt == acc:
            np.add(own, self._res, out=adj)
            nxt.fill(0)
            if np.isinf(adj).any():              # own + e overflowed: keep max, carry the rest
                over = np.isinf(adj) & np.isfinite(own)
                adj[over] = np.copysign(np.finfo(dt).max, adj[over])
                nxt[over] = (own[over] - adj[over]) + self._res[over]
        else:
            s = own.astype(acc)
            s += self._res
            adj[...] = s
            if np.isinf(adj).any():              # rounded past the 16-bit maximum
                over = np.isinf(adj) & np.isfinite(s)
                adj[over] = np.copysign(float(ml_dtypes.finfo(dt).max), s[over]).astype(dt)
            np.subtract(s, adj.astype(acc), out=nxt)
        self._flagged = []
        return adj

    def moved(self, own):
        """A bound on how far this call's input (``begin``) is from own, over
        the finite values: the certified bound adds it, so it still holds
        against the caller's values."""
        d = np.abs(self._adj.astype(np.float64) - own.astype(np.float64))
        d = d[np.isfinite(d)]
        return float(d.max()) * (1 + 2.0 ** -50) if d.size else 0.0

    def format(self, fmt, own, out):
        """The call's wire format, noting each quantization's loss; own and
        out are the kernel views of the call's input (``begin``) and output."""
        if self._tmp is None:                    # partial sums and decoded values
            self._tmp = np.empty((2, self._count), self._res.dtype)
        return _Losses(fmt, self, own, out)

    def end(self):
        """After the call: flagged blocks carry nothing on; the new residual
        becomes current."""
        for lo, hi in self._flagged:
            self._next[lo:hi] = 0
        self._res, self._next = self._next, self._res


def check(fb, opname, recv, method):
    """The error value of an Allreduce with ``feedback=fb``, or None."""
    if not isinstance(fb, ErrorFeedback):
        return TypeError(f"Allreduce: feedback must be an equarx_mpi.ErrorFeedback, "
                         f"not {type(fb).__name__}")
    if opname != "sum":
        return ValueError(f"Allreduce: feedback= needs op SUM, not {str(opname).upper()}")
    if recv.dtype not in QUANTIZED_DTYPES:
        return ValueError(f"Allreduce: feedback= takes float32, float64, float16 or bfloat16 "
                          f"buffers, not {recv.dtype}")
    if method == "hierarchical":
        return ValueError("Allreduce: feedback= works with algorithm 'ring' or 'two_shot' "
                          "(and the exact paths); this call would be 'hierarchical'")
    if fb._count is not None and (fb._count, fb._dtype) != (recv.size, recv.dtype):
        return ValueError(f"Allreduce: this ErrorFeedback holds the residual of "
                          f"{fb._count} {fb._dtype.name} values, not {recv.size} "
                          f"{recv.dtype.name}: use one per buffer, or reset() it")
    return None


class _Losses:
    """A wire format that adds to the residual what each of this rank's
    quantizations loses, at the positions of the values it quantized.
    Everything else (nbytes, views, stack_views...) is the format's own."""

    def __init__(self, fmt, fb, own, out):
        self._fmt, self._fb = fmt, fb
        self.block, self.name = fmt.block, fmt.name
        self._own, self._item = address(own), own.itemsize
        self._out, self._oitem = address(out), out.itemsize
        self._wide = _WIDE.get(out.dtype)      # 16-bit output: the final store rounds
        self._v, self._d = fb._tmp
        self._mine = set()                     # ids of the w this rank quantized into

    def __getattr__(self, name):
        return getattr(self._fmt, name)

    def _at(self, own):
        return (address(own) - self._own) // self._item

    def _values(self, src):
        """src (a kernel view) in the accumulation type."""
        if src.dtype == self._v.dtype:
            return src
        v = self._v[:src.size]
        v[...] = src.view(_WIDE[src.dtype])
        return v

    def _lose(self, v, w, at):
        """residual[at:at+n] += v - D(w), but nothing in blocks w flags."""
        d = self._d[:v.size]
        skipped = self._fmt.decode(w, d)
        np.subtract(v, d, out=d)
        B = self.block
        for b in skipped:
            d[b * B:(b + 1) * B] = 0
        self._fb._next[at:at + v.size] += d

    def encode(self, src, w, rmode):
        self._fmt.encode(src, w, rmode)
        self._lose(self._values(src), w, self._at(src))

    def decode_reduce_encode(self, own, wi, wo, op, rmode):
        # the partial sum first: wi may be wo (the hop in place)
        v = self._v[:own.size]
        self._fmt.decode_reduce(own, wi, v, op)
        self._fmt.decode_reduce_encode(own, wi, wo, op, rmode)
        self._mine.add(id(wo))
        self._lose(v, wo, self._at(own))

    def decode_reduce_encode_many(self, own, pos, ws, wo, op, rmode):
        v = self._v[:own.size]
        self._fmt.decode_reduce_many(own, pos, ws, v, op)
        self._fmt.decode_reduce_encode_many(own, pos, ws, wo, op, rmode)
        self._mine.add(id(wo))
        self._lose(v, wo, self._at(own))

    def decode(self, w, out):
        n = out.size
        at = (address(out) - self._out) // self._oitem
        final = self._wide is not None and id(w) in self._mine
        if final:                              # our own finished shard, into 16 bits
            d = self._d[:n]
            self._fmt.decode(w, d)
        skipped = self._fmt.decode(w, out)
        B = self.block
        if final:
            v = self._v[:n]
            v[...] = out.view(self._wide)
            d -= v
            for b in skipped:
                d[b * B:(b + 1) * B] = 0
            self._fb._next[at:at + n] += d
        self._fb._flagged.extend((at + int(b) * B, min(at + (int(b) + 1) * B, at + n))
                                 for b in skipped)
        return skipped
