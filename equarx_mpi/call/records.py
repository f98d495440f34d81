"""What QuantizedComm records and runs: CallInfo (``last_call``), Stats
(``stats``) and a prepared Call."""
import math
from typing import NamedTuple, Optional

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


class Call:
    """One checked and agreed call, ready to run (``_prepare``).  ``bound``:
    an exact call's error bound, None when it must be found when the call
    runs (quantized, or a persistent exact sum); ``feedback``: an
    ErrorFeedback or None; ``budget``: the error-bounded mode's
    tolerance.Budget of a quantized call, else None."""
    __slots__ = ("what", "send", "recv", "op", "name", "method", "reason", "nbytes", "bound",
                 "feedback", "budget")

    def __init__(self, what, send, recv, op, name, method, reason, nbytes, bound=None,
                 feedback=None):
        self.what, self.send, self.recv, self.op = what, send, recv, op
        self.name, self.method, self.reason, self.nbytes = name, method, reason, nbytes
        self.bound, self.feedback = bound, feedback
        self.budget = None

    @property
    def quantize(self):
        return self.method not in EXACT
