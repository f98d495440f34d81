"""A call plan per signature: an Allreduce whose path is MPI's own
collective (or, on one rank, a copy) is checked and decided once, on the
first call with its signature; a repeated call with the same signature
only runs its plan, at about MPI's own cost.

The signature is what the decision depends on and what a cheap look at
numpy arrays gives: the op, whether inside comm.exact(),
recvbuf's dtype, size and flags, and sendbuf's (or that it works in
place).  Only calls whose path needs no agreement across ranks get a plan
(QuantizedComm._prepare, docs/ROBUSTNESS.md): whether a rank finds a plan
or prepares the call anew, it ends in the same MPI collective, so ranks
whose caches differ (a view on one rank, an owned array on another) still
meet.  Other buffer forms and the library's own paths are prepared on
every call."""
import numpy as np
from mpi4py import MPI

_IN_PLACE, _ndarray, _may_share = MPI.IN_PLACE, np.ndarray, np.may_share_memory


def signature(sendbuf, recvbuf, op, exact):
    """The key of an Allreduce of numpy arrays, or None (no plan: other
    forms, or buffers that share memory, which the full checks refuse).
    Flat and built from attribute reads only: it is most of a planned
    call's cost."""
    if type(recvbuf) is not _ndarray:
        return None
    if sendbuf is _IN_PLACE or sendbuf is recvbuf or sendbuf is None:
        return id(op), exact, recvbuf.dtype, recvbuf.size, recvbuf.flags.num
    if type(sendbuf) is not _ndarray or ((sendbuf.base is not None or recvbuf.base is not None)
                                         and _may_share(sendbuf, recvbuf)):
        return None
    return (id(op), exact, recvbuf.dtype, recvbuf.size, recvbuf.flags.num,
            sendbuf.dtype, sendbuf.size, sendbuf.flags.num)


def still(key, sendbuf, recvbuf):
    """Whether arrays that own their memory (no views: two such never
    overlap) have the signature ``key`` but for its op and exact() depth:
    the fields of signature(), read afresh on every call, since numpy
    changes an array's dtype, size and flags in place."""
    if (type(recvbuf) is not _ndarray or recvbuf.base is not None or recvbuf.dtype is not key[2]
            or recvbuf.size != key[3] or recvbuf.flags.num != key[4]):
        return False
    if len(key) == 5:       # in place
        return sendbuf is _IN_PLACE or sendbuf is recvbuf or sendbuf is None
    return (type(sendbuf) is _ndarray and sendbuf is not recvbuf and sendbuf.base is None
            and sendbuf.dtype is key[5] and sendbuf.size == key[6]
            and sendbuf.flags.num == key[7])


class Plan:
    """What a repeated call runs and records: ``in_place``, ``copy`` (one
    rank: no message), the CallInfo of every such call but for its time
    (``info``), the bytes it counts, the bound per block for block_bounds,
    and its own tally (``calls``, ``seconds``, ``last``: the last one's
    seconds), which the Ledger adds to its totals.  Holds ``op`` so that
    the signature's id(op) stays this op's."""
    __slots__ = ("in_place", "info", "uncompressed", "blocks", "op", "copy", "desc", "name",
                 "calls", "seconds", "last")

    def __init__(self, c, info, uncompressed, blocks):
        self.in_place, self.info, self.op = c.send is None, info, c.op
        self.uncompressed, self.blocks, self.copy = uncompressed, blocks, c.method == "copy"
        self.desc, self.name = f"{c.nbytes} B {c.recv.dtype.name}", c.name
        self.calls, self.seconds, self.last = 0, 0.0, 0.0
