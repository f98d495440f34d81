"""What QuantizedComm records and runs: CallInfo (``last_call``), Stats
(``stats``), the Ledger that keeps them, and a prepared Call."""
import math
import sys
import threading
from typing import NamedTuple, Optional

from equarx_mpi.call.buffers import OPAQUE
from equarx_mpi.names import EXACT


class CallInfo(NamedTuple):
    """What the last call did (``QuantizedComm.last_call``)."""
    call: str                 #: "Allreduce", "Reduce_scatter_block" or "Allgather"
    #: "mpi" (MPI's own collective), "shm" (exact through a shared window),
    #: "copy" (one rank), or the quantized schedule: "ring", "two_shot",
    #: "hierarchical"
    method: str
    wire: Optional[str]       #: the wire format, None when exact
    reason: str               #: why this path, in words
    exact_values: int = 0     #: values of flagged blocks (Inf/NaN) reduced exactly afterwards
    #: bytes this rank handed to MPI: counted for a schedule; for an exact
    #: call the bandwidth-optimal amount (MPI's own algorithm may send more)
    bytes_sent: int = 0
    seconds: float = 0.0      #: time the call ran (a nonblocking call: from when it started)
    #: a rigorous bound on |result - exact| over the result's finite values,
    #: the same on every rank (QuantizedComm.last_error_bound, docs/ERROR.md)
    error_bound: float = math.inf


class Stats(NamedTuple):
    """Totals over a communicator's calls (``QuantizedComm.stats``)."""
    calls: int = 0
    quantized_calls: int = 0
    bytes_sent: int = 0           #: as CallInfo.bytes_sent, summed
    #: what the same calls would have sent uncompressed in the input's type,
    #: bandwidth-optimally: 2(P-1)/P of the message for an AllReduce,
    #: (P-1)/P for a Reduce_scatter_block or Allgather
    bytes_uncompressed: int = 0
    seconds: float = 0.0


def uncompressed_bytes(what, nbytes, P):
    """Bytes a rank sends in a bandwidth-optimal exact collective on
    ``nbytes`` (the whole message: P*m values for the two halves)."""
    share = 2 * (P - 1) if what == "Allreduce" else P - 1
    return nbytes * share // P


class Ledger:
    """What a communicator's calls did: the last one (a CallInfo), the
    totals (a Stats), what block_bounds needs, and with ``log`` a line per
    call on stderr.  The progress thread records too, hence the lock."""

    def __init__(self, P, log):
        self.P, self.log = P, log
        self.last = None
        #: the last call's bound.Record, or an exact call's (n, its one bound)
        self.blocks = None
        self._totals = [0, 0, 0, 0, 0.0]      # Stats' fields, summed
        self._lock = threading.Lock()

    def stats(self):
        with self._lock:
            return Stats(*self._totals)

    def note(self, c, info, rec=None):
        """Note finished call c: ``info`` its CallInfo, ``rec`` its
        bound.Record (None for an exact call: its one bound, made a Record
        only if asked for).  Returns info."""
        if rec is None:
            n = 0 if c.recv is OPAQUE else (
                c.recv.size // self.P if c.what == "Reduce_scatter_block" and c.send is None
                else c.recv.size)
            rec = (n, info.error_bound)
        with self._lock:
            t = self._totals
            t[0] += 1
            t[1] += bool(c.quantize)
            t[2] += info.bytes_sent
            t[3] += uncompressed_bytes(c.what, c.nbytes, self.P)
            t[4] += info.seconds
            self.last, self.blocks = info, rec
        if self.log:
            what = "?" if c.recv is OPAQUE else f"{c.nbytes} B {c.recv.dtype.name}"
            path = f"{info.method}/{info.wire}" if info.wire else info.method
            op = "" if c.what == "Allgather" else f" {c.name.upper()}"
            sys.stderr.write(f"equarx_mpi: {c.what} {what}{op} -> "
                             f"{path} ({info.reason}), {info.seconds * 1e3:.3f} ms, "
                             f"{info.bytes_sent} B sent\n")
        return info


class Call:
    """One checked and agreed call, ready to run (``_prepare``).
    ``bound_from``: where its error bound comes from (call/plan.py);
    ``bound``: the bound when known at preparation, else None;
    ``feedback``: an ErrorFeedback or None; ``budget``: the error-bounded
    mode's tolerance.Budget of a quantized call, else None."""
    __slots__ = ("what", "send", "recv", "op", "name", "method", "reason", "nbytes", "bound",
                 "bound_from", "feedback", "budget")

    def __init__(self, what, send, recv, op, name, method, reason, nbytes, bound_from,
                 feedback=None):
        self.what, self.send, self.recv, self.op = what, send, recv, op
        self.name, self.method, self.reason, self.nbytes = name, method, reason, nbytes
        self.bound_from, self.feedback = bound_from, feedback
        self.bound = self.budget = None

    def with_input(self, send):
        """The same call reducing ``send`` instead (error feedback's
        adjusted input): everything else, bound and budget included, kept."""
        c = Call.__new__(Call)
        for name in Call.__slots__:
            setattr(c, name, getattr(self, name))
        c.send = send
        return c

    @property
    def quantize(self):
        return self.method not in EXACT
