"""What QuantizedComm records and runs: CallInfo (``last_call``), Stats
(``stats``), the Ledger that keeps them, and a prepared Call."""
import math
import sys
import threading
from typing import NamedTuple, Optional

from equarx_mpi.call.buffers import OPAQUE
from equarx_mpi.call.plans import signature, still
from equarx_mpi.names import EXACT


class CallInfo(NamedTuple):
    """What the last call did (``QuantizedComm.last_call``)."""
    call: str                 #: "Allreduce", "Reduce_scatter_block" or "Allgather"
    #: "mpi" (MPI's own collective), "shm" (exact through a shared window),
    #: "copy" (one rank), or the quantized schedule: "ring", "two_shot",
    #: "rabenseifner", "hierarchical"
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
    #: the rotation's size when the values travelled rotated (option rotate), else 0
    rotation: int = 0


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
    totals (a Stats), what block_bounds needs, and with ``log == "all"`` a
    line per call on stderr.  The progress thread records too, hence the
    lock.  ``plans``: signature -> the Plan a repeated call runs
    (call/plans.py), which tallies itself: the caller's thread does, with
    no call queued, so it needs no lock; its tally joins the totals here."""

    #: plans kept per communicator; past it they are folded into the totals
    MOST_PLANS = 1024

    def __init__(self, P, log):
        self.P, self.log = P, log
        self.latest = None          # a CallInfo, or the Plan a call ran (comm._repeat)
        self._blocks = None        # a bound.Record, or an exact call's (n, its one bound)
        self._totals = [0, 0, 0, 0, 0.0]      # Stats' fields, summed
        self._lock = threading.Lock()
        self.plans = {}
        # the last planned call's (signature, Plan): no reference to the
        # caller's arrays, which would keep them alive and refuse numpy's
        # resize() (a weak reference refuses it too)
        self._recent = None

    def plan(self, sendbuf, recvbuf, op, exact):
        """The Plan of a repeated Allreduce, or None.  Arrays that own their
        memory with the dtype, size and flags of the last planned call's, its
        op and exact() depth, skip building the signature and its lookup,
        most of a small call's cost.  The data address is not part of the
        decision: a plan names MPI's own collective (or a copy), which reads
        the arrays afresh."""
        r = self._recent
        if r is not None and r[1].op is op and r[0][1] == exact and still(r[0], sendbuf,
                                                                           recvbuf):
            return r[1]
        key = signature(sendbuf, recvbuf, op, exact)
        p = self.plans.get(key)
        if p is not None:
            self._recent = (key, p)
        return p

    def keep(self, key, plan):
        if self.log == "all":           # each call logged: no call skips the record
            return
        if len(self.plans) >= self.MOST_PLANS:
            self.forget_plans()
        self.plans[key] = plan

    def forget_plans(self):
        """Fold the plans' tallies into the totals and drop them (a freed
        communicator's next call must meet the full checks)."""
        with self._lock:
            for p in self.plans.values():
                self._add(self._totals, p)
            self.plans.clear()
            self._recent = None

    @staticmethod
    def _add(t, p):
        t[0] += p.calls
        t[2] += p.calls * p.info.bytes_sent
        t[3] += p.calls * p.uncompressed
        t[4] += p.seconds

    def stats(self):
        with self._lock:
            t = list(self._totals)
            for p in list(self.plans.values()):
                self._add(t, p)
            return Stats(*t)

    @property
    def last(self):
        got = self.latest
        if type(got) is not CallInfo and got is not None:     # a Plan: made when asked for
            got = got.info._replace(seconds=got.last)
        return got

    @property
    def blocks(self):
        got = self.latest
        return self._blocks if type(got) is CallInfo or got is None else got.blocks

    def note(self, c, info, rec=None):
        """Note finished call c: ``info`` its CallInfo, ``rec`` its
        bound.Record (None for an exact call: its one bound, made a Record
        only if asked for).  Returns info."""
        if rec is None:
            rec = self.blocks_of(c, info)
        with self._lock:
            t = self._totals
            t[0] += 1
            t[1] += bool(c.quantize)
            t[2] += info.bytes_sent
            t[3] += uncompressed_bytes(c.what, c.nbytes, self.P)
            t[4] += info.seconds
            self.latest, self._blocks = info, rec
        if self.log == "all":
            self._write(info, "?" if c.recv is OPAQUE else f"{c.nbytes} B {c.recv.dtype.name}",
                        c.name)
        return info

    def blocks_of(self, c, info):
        """An exact call's (n values of its result, its one bound)."""
        n = 0 if c.recv is OPAQUE else (
            c.recv.size // self.P if c.what == "Reduce_scatter_block" and c.send is None
            else c.recv.size)
        return n, info.error_bound

    @staticmethod
    def _write(info, what, opname):
        path = f"{info.method}/{info.wire}" if info.wire else info.method
        op = "" if info.call == "Allgather" else f" {opname.upper()}"
        sys.stderr.write(f"equarx_mpi: {info.call} {what}{op} -> "
                         f"{path} ({info.reason}), {info.seconds * 1e3:.3f} ms, "
                         f"{info.bytes_sent} B sent\n")


class Call:
    """One checked and agreed call, ready to run (setup.py).
    ``bound_from``: where its error bound comes from (call/bound_from.py);
    ``bound``: the bound when known at preparation, else None;
    ``feedback``: an ErrorFeedback or None; ``budget``: the error-bounded
    mode's tolerance.Budget of a quantized call, else None; ``direct``: MPI's
    own collective (or a copy) with nothing to agree or compute per call."""
    __slots__ = ("what", "send", "recv", "op", "name", "method", "reason", "nbytes", "bound",
                 "bound_from", "feedback", "budget", "direct")

    def __init__(self, what, send, recv, op, name, method, reason, nbytes, bound_from,
                 feedback=None):
        self.what, self.send, self.recv, self.op = what, send, recv, op
        self.name, self.method, self.reason, self.nbytes = name, method, reason, nbytes
        self.bound_from, self.feedback = bound_from, feedback
        self.bound = self.budget = None
        self.direct = False

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
