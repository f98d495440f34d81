"""The error bound of a call MPI runs exactly (docs/ERROR.md): MPI's sum
of P values is off by at most gamma_{P-1} sum |x_r| (bound.mpi_sum), from
the largest finite input magnitude over the ranks; 0 where MPI's result is
exact.  Pure arithmetic: collectives/exact.py and the call layer
communicate what it needs."""
import math

import numpy as np

from equarx_mpi.bounds import bound
from equarx_mpi.names import BFLOAT16

#: ops whose MPI result is exact (no rounding)
_EXACT_OPS = ("max", "min", "MAXLOC", "MINLOC", "LAND", "BAND", "LOR", "BOR", "LXOR", "BXOR",
              "REPLACE", "NO_OP")


def sums_floats(what, opname, dtype, P):
    """Whether an exact call adds floats (its bound needs the inputs'
    largest magnitude)."""
    return (P > 1 and what != "Allgather" and dtype is not None and opname == "sum"
            and _floats(dtype))


def _floats(dtype):
    """Float or complex, bfloat16 included (numpy calls its kind 'V')."""
    return np.dtype(dtype).kind in "fc" or np.dtype(dtype) == BFLOAT16


def error_bound(what, opname, dtype, P, most):
    """The error bound of an exact call: 0 where MPI's result is exact (one
    rank, Allgather, MAX, MIN, integers: exact unless they overflow); for a
    float or complex SUM MPI's own summation bound, from ``most``, the
    largest finite input magnitude on any rank (None: not known, Inf);
    Inf for any other op on floats (PROD, user-defined) or an unknown
    dtype (None)."""
    if P == 1 or what == "Allgather":
        return 0.0
    if dtype is None:
        return math.inf
    if not _floats(dtype) or opname in _EXACT_OPS:
        return 0.0
    if opname != "sum" or most is None:
        return math.inf
    return bound.mpi_sum(dtype, P, P * most)


def largest(a):
    """The largest finite magnitude of a flat float or complex array (its
    components), in one pass."""
    if a.dtype.kind == "c":
        a = a.view(np.dtype(f"f{a.dtype.itemsize // 2}"))
    kd = bound.kernel_dtype(a.dtype)
    if kd in bound.ROUNDING:
        return bound.largest(a.view(kd))
    v = np.abs(a)                       # long double: beyond float64 gives Inf
    return float(v[np.isfinite(v)].max(initial=0))
