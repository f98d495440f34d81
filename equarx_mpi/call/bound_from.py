"""Where a call's error bound comes from, decided once when the call is
prepared (QuantizedComm._prepare) and only carried out when it runs.

A quantized call's bound is its schedule's (the trailers, bound.Tally).
An exact call's is MPI's summation bound (mpi_bound.error_bound), which for a
float SUM needs M, the largest finite input magnitude over all ranks:

    FIXED     no M needed: 0 where MPI's result is exact (MAX, MIN,
              integers, Allgather, one rank, an empty message), Inf where
              none is known (PROD, a buffer only MPI can read)
    AGREED    M rides on the call's argument agreement (check=True), or,
              in the error-bounded mode with check=False, on its own
              8-byte MAX Allreduce (settle); the error-bounded mode's
              quantized calls need M too (their budget), the same way
    WINDOW    the shared window finds M on its way (method "shm", the
              inputs as the caller gave them)
    AT_RUN    the values exist only when the call runs (a persistent
              request; error feedback, whose moved inputs the bound
              counts, on any exact path): one MAX Allreduce then
    UNKNOWN   exact_bounds=False (the default) or check=False, outside the
              error-bounded mode: Inf, and the call needs no agreement, so
              MPI's own path costs what MPI's does (call/plans.py)
    SCHEDULE  a quantized call
"""
import numpy as np
from mpi4py import MPI

from equarx_mpi.bounds import bound, mpi_bound
from equarx_mpi.bounds.tolerance import budget
from equarx_mpi.names import EXACT

FIXED, AGREED, WINDOW, AT_RUN, UNKNOWN, SCHEDULE = (
    "fixed", "agreed", "window", "at run", "unknown", "schedule")
#: the sources whose bound is known when the call is prepared
WHEN_PREPARED = (FIXED, AGREED, UNKNOWN)


def source(what, opname, dtype, P, method, nbytes, later, agreed, moved, tolerant):
    """Where the bound of a call comes from (one of the names above).
    ``dtype``: None for a buffer only MPI can read; ``later``: its values
    are known only when it runs; ``agreed``: check and exact_bounds, exact
    calls agree on M; ``moved``: error feedback changes its inputs;
    ``tolerant``: the error-bounded mode applies."""
    if method not in EXACT:
        return SCHEDULE
    if moved:           # each rank's input moved: the bound counts by how much
        return AT_RUN
    if not nbytes or not mpi_bound.sums_floats(what, opname, dtype, P):
        return FIXED
    if tolerant:
        return AGREED
    if method == "shm":
        return WINDOW
    if not agreed:
        return UNKNOWN
    return AT_RUN if later else AGREED


def settle(opts, c, P, M, comm):
    """The error-bounded mode's part of preparing c, a float SUM on P > 1
    ranks whose inputs' largest finite magnitude over all ranks is M (None:
    not agreed, check=False; one 8-byte MAX Allreduce on ``comm`` finds it).
    Sets c.budget for a quantized call; all-zero inputs go exact, bound 0
    (a sum of zeros is exact on any path); ValueError (the same on every
    rank: M is) when the tolerance cannot be met.  Returns M."""
    if M is None:
        m = np.array([bound.to_bits(mpi_bound.largest((c.recv if c.send is None
                                                   else c.send).reshape(-1)))], np.int64)
        comm.Allreduce(MPI.IN_PLACE, m, MPI.MAX)
        M = bound.from_bits(m[0])
    if M == 0:
        c.method, c.reason, c.bound = "mpi", "error-bounded: every finite input is zero", 0.0
        c.bound_from = FIXED
        return M
    b = budget(opts, c.what, c.recv.dtype, P, M)
    if c.quantize:
        c.budget = b
    return M
