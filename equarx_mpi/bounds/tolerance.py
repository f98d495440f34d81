"""The error-bounded mode: ``QuantizedComm(comm, abs_tol=...)`` or
``rel_tol=...``.  After every call ``last_error_bound`` (the certified
bound of bound.py, docs/ERROR.md) is at most the call's tolerance, so every
finite value of the result is within it of the exact sum of the inputs.

The tolerance of a call is ``abs_tol``, or ``rel_tol * M`` with M the
largest magnitude of any finite input value on any rank of that call (M
bounds each input; the result's values are at most P*M).  M rides on the
per-call argument agreement (one tiny MAX Allreduce that runs anyway).

The quantized path is two-shot with the "mixed" wire (wire/mixed.py):
each sender quantizes every block in the fewest bits whose bound is at
most ``send``, the owner reduces at full precision and quantizes every
block of the sum in the fewest bits that keep the certified bound of the
finished piece within the tolerance: what the bookkeeping of bound.Tally
will add up (the senders' trailers, the owner's float additions, its own
quantization, the final rounding into a 16-bit output type) is known
before the owner encodes, except two magnitudes, which are bounded a
priori (``_sum_bound``).  So the reported bound is the same Tally's, never
a second system; every rank reads it from the same trailers.

A call whose tolerance is below what the float additions, the output
rounding, or MPI's exact sum of flagged blocks can guarantee (those hold
on every path, exact MPI included) raises ValueError on every rank,
before anything is sent.
"""
import math
from typing import NamedTuple

import numpy as np

from equarx_mpi.bounds import bound
from equarx_mpi.kernels.mixed import SAFE

#: the tolerance is used shrunk by this: the float64 rounding of the sums
#: here and in bound.Tally (a few dozen operations) stays below it
SHRINK = 1.0 - 2.0 ** -30
#: covers the float64 rounding of (1 + u)^k and of the sums of bounds
GROW = 1.0 + 2.0 ** -40
_F64 = np.dtype(np.float64)


class Budget(NamedTuple):
    """One call's budget, the same on every rank."""
    tol: float       #: the tolerance: abs_tol, or rel_tol * scale
    scale: float     #: M, the largest finite input magnitude over all ranks
    u: float         #: unit roundoff of the accumulation type
    cast: tuple      #: (u, eta) of the rounding into a 16-bit output, else (0, 0)
    send: float      #: per-value bound allowed to one sender's quantization
    least: float     #: the smallest tolerance this call could have had

    def target(self):
        """What the bookkeeping's float64 sums must stay under (before
        bound.SLACK)."""
        return self.tol * SHRINK / bound.SLACK


def _adds(k, F, A, u):
    """bound.Tally._adds: the owner's k additions (result at most F, decoded
    inputs' magnitudes summing to at most A)."""
    if 3 * k * u >= 1:
        return math.inf
    with np.errstate(over="ignore"):
        return 2 * u * k * (F + A) / (1 - 3 * k * u)


def _sum_bound(M, A, k, u):
    """A bound on |the owner's computed sum| of own (|x| <= M) and k decoded
    messages whose magnitudes add up to at most A: each addition grows the
    sum of magnitudes by at most a factor 1 + u."""
    with np.errstate(over="ignore"):
        return float(np.float64(M + A) * (1 + u) ** k * GROW)


def owner_room(b, trailers):
    """The per-value room of the owner's quantization of a piece whose
    P-1 messages carry ``trailers`` (rows of bound.TRAILER: pre, total,
    mag), so that bound.Tally's total for the piece, plus the final
    rounding into a 16-bit output, stays within the tolerance.  Negative:
    none (every block then goes raw)."""
    k = len(trailers)
    e = sum(float(t[1]) for t in trailers)
    A = sum(float(t[2]) + (float(t[1]) - float(t[0])) for t in trailers)
    F = _sum_bound(b.scale, A * GROW, k, b.u)
    uc, etac = b.cast
    return b.target() - e * GROW - _adds(k, F, A * GROW, b.u) - uc * F - etac


def _need(what, k, M, s, u, cast):
    """The bookkeeping's sum a priori: k senders each within s, the owner's
    own quantization exact."""
    A = k * (M + s) * GROW
    F = _sum_bound(M, A, k, u)
    uc, etac = cast
    if what == "Allreduce":          # the final pieces: Tally.many + finish
        return k * s * GROW + _adds(k, F, A, u) + uc * F + etac
    # Reduce_scatter_block: Tally.result, the sum stored into the output
    part = (F * (1 + uc) + 2 * etac) / (1 - uc)
    return k * s * GROW + uc * part + etac + _adds(k, part, A, u)


def _up(x):
    """x rounded up to 3 significant digits (for messages)."""
    if not 0 < x < math.inf:
        return x
    e = math.floor(math.log10(x)) - 2
    return math.ceil(x / 10.0 ** e * (1 + 1e-12)) * 10.0 ** e


def budget(opts, what, dtype, P, M):
    """The budget of a float SUM ``what`` ("Allreduce" or
    "Reduce_scatter_block") on P > 1 ranks whose inputs' largest finite
    magnitude is M > 0; ValueError when the tolerance is below what the
    float additions, the output rounding and MPI's sum of flagged blocks
    (exact.py's fix-up, whose bound is at least an exact call's) allow."""
    rel = opts["rel_tol"]
    tol = float(opts["abs_tol"]) if rel is None else float(rel) * M
    dtype = np.dtype(dtype)
    kd = bound.kernel_dtype(dtype)
    u = bound.acc_rounding(kd)[0]
    cast = bound.cast(kd)
    k = P - 1
    # exact.fix_allreduce's bound when every rank's flagged values reach M
    fix = (bound.mpi_sum(dtype, P, bound.sum_of_nonnegatives(P * M * GROW, P, _F64))
           + bound.sum_of_nonnegatives(0.0, P, _F64))
    least = max(_need(what, k, M, 0.0, u, cast) * bound.SLACK / SHRINK, fix)
    if least != least:                  # 0 * Inf beyond float64: no bound
        least = math.inf
    b = Budget(tol, M, u, cast, 0.0, least)
    if not least <= tol:
        name = "abs_tol" if rel is None else "rel_tol"
        acc = "float64" if kd == np.float64 else "float32"
        why = (f"{P} ranks' float additions in {acc}"
               + (f" and the rounding to {dtype.name}" if cast[0] else "")
               + " can guarantee")
        if least == math.inf:
            raise ValueError(f"{name}={opts[name]!r}: no tolerance can be guaranteed, as "
                             f"sums of {P} values up to M={M:.6g} overflow float64")
        need = _up(least if rel is None else least / M)
        raise ValueError(f"{name}={opts[name]!r} is finer than {why} at this call's "
                         f"largest input magnitude M={M:.6g}: need {name} >= {need:.3g}")
    # the senders' share: half of what is left for an Allreduce (the owner
    # gets the rest and whatever the senders did not use), all of it for
    # a Reduce_scatter_block (no owner quantization); need() grows at
    # least by k per unit of s, so this s fits (checked, halved if not)
    left = b.target() - _need(what, k, M, 0.0, u, cast)
    s = left / k / (2.0 if what == "Allreduce" else 1.0) / 1.01 / SAFE
    while s > 0 and _need(what, k, M, s, u, cast) > b.target():
        s /= 2
    return b._replace(send=max(s, 0.0))


NOT_PERSISTENT = ("equarx_mpi: the error-bounded mode (abs_tol/rel_tol) sizes each call's "
                  "budget from its inputs when the call is made: no persistent requests "
                  "(Allreduce_init) and no error feedback; use Allreduce or Iallreduce")
