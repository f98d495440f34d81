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
lose nothing, and their residual restarts at zero on every rank; so does a
value that is Inf or NaN in a rank's x + e (on that rank), and one whose
sum a plain wire's 16-bit store overflows to Inf (on its owner): a
residual is always finite.  A call that takes an exact path (one rank, a
message below min_quantized_bytes, algorithm "mpi" or "shm") reduces
x + e exactly and so hands the whole residual on (16-bit inputs keep the
rounding of x + e to their type).  Kept negated (``ErrorFeedback``): a
zero residual then leaves -0.0 as it is.

The losses are measured around the schedule, not in it: a proxy of the
wire format (``format``, wire/watched.py) decodes what each encode or hop
produced and compares; the position of a piece is where its ``own`` view
starts in the input.  Works with the ring and two-shot schedules (Allreduce, op SUM);
hierarchical calls raise ValueError.
"""
from typing import Optional

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from equarx_mpi.collectives.registry import SCHEDULES
from equarx_mpi.kernels.gap import max_finite_gap
from equarx_mpi.names import QUANTIZED_DTYPES, acc_dtype, kernel_view
from equarx_mpi.wire.streams import address
from equarx_mpi.wire.watched import WIDE, Watched


class ErrorFeedback:
    """The residual one rank carries from one Allreduce to the next on the
    same buffer: pass it as ``feedback=`` to ``QuantizedComm.Allreduce``
    (op SUM, a float buffer).  Its first call fixes the count and dtype; a
    call with another raises ValueError until ``reset()``.  Not shared
    between buffers or threads: use one per buffer."""

    def __init__(self) -> None:
        self.reset()

    # The residual is kept negated, as what the quantizations gained
    # (D(Q(v)) - v), and the input is x - gain: exact differences and
    # cancellations give +0.0, and x - (+0.0) is x for every x, -0.0 too,
    # where x + (+0.0) would turn -0.0 into +0.0.

    def reset(self) -> None:
        """Drop the residual: the next call starts afresh, with any shape."""
        self._count = self._dtype = None
        self._gain = self._next = self._adj = None
        self._flagged: list[tuple[int, int]] = []
        #: the rotation (collectives/rotation.py) the residual is kept in, or None
        self._rotation = None

    @property
    def residual(self) -> Optional[np.ndarray]:
        """This rank's residual after the last call (a read-only copy,
        float32, or float64 for float64 buffers), or None before the first
        call."""
        if self._gain is None:
            return None
        v = -self._gain
        if self._rotation is not None:        # in the caller's values
            self._rotation.backward(v.copy(), v)
        v.flags.writeable = False
        return v

    def load(self, residual: np.ndarray, dtype: DTypeLike) -> None:
        """Start from ``residual`` (as ``residual`` gives it) for buffers of
        ``dtype``: a residual moved to a new layout of the same values (the
        DDP hook's bucket rebuilds) or restored."""
        self.reset()
        self.begin(np.zeros(len(residual), dtype))      # sizes the buffers
        np.negative(residual, out=self._gain)

    def __repr__(self) -> str:
        if self._gain is None:
            return "ErrorFeedback(empty)"
        return (f"ErrorFeedback({self._count} {self._dtype.name} values, "
                f"max |residual| {float(np.max(np.abs(self._gain), initial=0)):.3g})")

    # --- used by QuantizedComm ---------------------------------------------------
    def into(self, rotation):
        """Keep the residual in ``rotation``'s values (a rotated call's), or
        the caller's (None): it is turned only when the path changes."""
        same = (rotation is None) == (self._rotation is None) and (
            rotation is None or (rotation.size, rotation.seed) == (self._rotation.size,
                                                                   self._rotation.seed))
        if same:
            return
        if self._gain is not None:
            g = self._gain.copy()
            if self._rotation is not None:
                self._rotation.backward(g, self._gain)
            if rotation is not None:
                rotation.forward(self._gain.copy(), self._gain)
        self._rotation = rotation

    def _sized(self, n, dt):
        if self._gain is None:
            acc = acc_dtype(dt)
            self._count, self._dtype = n, dt
            self._gain = np.zeros(n, acc)
            self._next = np.empty(n, acc)
            self._adj = np.empty(n, dt)

    def begin_rotated(self, y, dtype):
        """A rotated call's input (collectives/rotation.py): y, this rank's
        values rotated (accumulation type), plus the residual, in place;
        returns a bound on how far y moved."""
        self._sized(y.size, dtype)
        with np.errstate(over="ignore", invalid="ignore"):   # such blocks go exact
            np.subtract(y, self._gain, out=y)
        self._next.fill(0)
        self._flagged = []
        return float(np.max(np.abs(self._gain), initial=0.0)) * (1 + 2.0 ** -20)

    def begin(self, own):
        """The input of this call: own (the caller's flat values) plus the
        residual, rounded to own's type; the next residual starts as what
        that rounding lost; a value that is Inf or NaN here carries nothing."""
        n, dt = own.size, own.dtype
        acc = acc_dtype(dt)
        self._sized(n, dt)
        adj, nxt, gain = self._adj, self._next, self._gain
        with np.errstate(over="ignore", invalid="ignore"):     # mended below
            if dt == acc:
                np.subtract(own, gain, out=adj)
                nxt.fill(0)
            else:
                s = own.astype(acc)
                s -= gain
                adj[...] = s
                np.subtract(adj.astype(acc), s, out=nxt)
        finite = np.isfinite(adj)
        if not finite.all():
            # past dt's largest value from a finite own: keep the largest,
            # carry the rest; Inf or NaN in own (Inf - Inf would be NaN in
            # every later call): nothing
            bad = ~finite
            over = bad & np.isfinite(own)
            big = float(ml_dtypes.finfo(dt).max)
            adj[over] = np.copysign(big, adj[over].astype(acc)).astype(dt)
            nxt[bad] = 0
            nxt[over] = (adj[over].astype(acc) - own[over].astype(acc)) + gain[over]
        self._flagged = []
        return adj

    def moved(self, own):
        """A bound on how far this call's input (``begin``) is from own, over
        the finite values: the certified bound adds it, so it still holds
        against the caller's values."""
        gap = max_finite_gap(kernel_view(self._adj, False), kernel_view(own, False))
        return float(gap) * (1 + 2.0 ** -50)

    def format(self, fmt, own, out, tmp, watchers=()):
        """The call's wire format, noting each quantization's loss; own and
        out are the kernel views of the call's input (``begin``) and output,
        ``tmp`` and ``watchers`` as wire/watched.py's."""
        return _Losses(fmt, self, own, out, tmp, watchers)

    def end(self, result, exact=()):
        """After the call (``result``: its flat output): flagged blocks, the
        ranges ``exact`` (reduced exactly), and values whose result is Inf
        or NaN (an exact path's sum that overflowed), carry nothing on; the
        new residual becomes current."""
        for lo, hi in list(self._flagged) + list(exact):
            self._next[lo:hi] = 0
        self._next[~np.isfinite(result)] = 0
        self._gain, self._next = self._next, self._gain


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
    if method in SCHEDULES and not SCHEDULES[method].feedback:
        # e.g. rabenseifner requantizes partial sums kept outside the input:
        # the residual would not know their positions
        ok = " or ".join(repr(n) for n, s in SCHEDULES.items() if s.feedback)
        return ValueError(f"Allreduce: feedback= works with algorithm {ok} "
                          f"(and the exact paths); this call would be {method!r}")
    if fb._count is not None and (fb._count, fb._dtype) != (recv.size, recv.dtype):
        return ValueError(f"Allreduce: this ErrorFeedback holds the residual of "
                          f"{fb._count} {fb._dtype.name} values, not {recv.size} "
                          f"{recv.dtype.name}: use one per buffer, or reset() it")
    return None


class _Losses(Watched):
    """A wire format that adds to the residual what each of this rank's
    quantizations loses, at the positions of the values it quantized."""

    def __init__(self, fmt, fb, own, out, tmp, watchers):
        super().__init__(fmt, tmp, (self._lose,) + tuple(watchers))
        self._fb = fb
        self._own, self._item = address(own), own.itemsize
        self._out, self._oitem = address(out), out.itemsize
        self._wide = WIDE.get(out.dtype)       # 16-bit output: the final store rounds

    def _lose(self, d, own, w):
        """gain[at:at+n] += D(w) - v (zero in the blocks w flags)."""
        at = (address(own) - self._own) // self._item
        self._fb._next[at:at + d.size] += d

    def decode(self, w, out):
        n = out.size
        at = (address(out) - self._out) // self._oitem
        final = self._wide is not None and id(w) in self.reduced
        if final:                              # our own finished shard, into 16 bits
            d = self._d[:n]
            self._fmt.decode(w, d)
        skipped = self._fmt.decode(w, out)
        B = self.block
        if final:
            v = self._v[:n]
            v[...] = out.view(self._wide)
            with np.errstate(invalid="ignore"):  # skipped blocks: left out
                np.subtract(v, d, out=d)
            # a sum past the 16-bit maximum is stored as Inf (a plain wire's
            # decode does not flag it): Inf - sum must not be carried on
            np.nan_to_num(d, copy=False, nan=0, posinf=0, neginf=0)
            for b in skipped:
                d[b * B:(b + 1) * B] = 0
            self._fb._next[at:at + n] += d
        self._fb._flagged.extend((at + int(b) * B, min(at + (int(b) + 1) * B, at + n))
                                 for b in skipped)
        return skipped
