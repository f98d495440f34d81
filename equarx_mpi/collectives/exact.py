"""Exact MPI: the whole collective when a call is not quantized, and the
exact reduction of the blocks that a quantized call could not carry.

A block holding Inf or NaN (in the input, or from an overflowing partial
sum) is flagged on the wire and left untouched by the final decode, so the
caller's input is still there; ``fix_*`` then reduces just those blocks
with the MPI collective.  Such blocks get exactly what MPI gives: Inf and
NaN with their sign and NaN payload, -0.0, finite values exact.  For an
Allreduce or Allgather every rank decoded the same bytes, so every rank
knows the same flagged blocks with no extra message; a Reduce_scatter_block
result is not shared, so it agrees on them with one tiny Allreduce.

Error bounds (docs/ERROR.md): MPI's sum of P values is off by at most
gamma_{P-1} sum |x_r| (bound.mpi_sum).  A fix-up of a SUM bounds the sum of
magnitudes with one more 16-byte Allreduce (only when blocks were flagged):
each rank's largest magnitude among the values it contributes (summed: at
least every position's sum of magnitudes) and the error its input already
carries."""
import numpy as np
from mpi4py import MPI

from equarx_mpi.bounds import bound, mpi_bound
from equarx_mpi.names import BFLOAT16

_HALF_DTYPES = (np.dtype(np.float16), BFLOAT16)
#: Reduced in float32 on the exact path: MPI knows no such type.
UPCAST_DTYPES = (BFLOAT16,) if "e" in MPI._typedict else _HALF_DTYPES


def collective(comm, what, send, recv, op):
    """The exact MPI collective ``what`` (Allreduce or Reduce_scatter_block);
    send None means in place."""
    fn = getattr(comm, what)
    if recv.dtype not in UPCAST_DTYPES:
        return fn(MPI.IN_PLACE if send is None else send, recv, op)
    # MPI has no bfloat16 (and some MPIs no float16): reduce in float32.
    src = (recv if send is None else send).reshape(-1).astype(np.float32)
    if what == "Allreduce":
        fn(MPI.IN_PLACE, src, op)
        res = src
    else:
        res = np.empty(src.size // comm.Get_size(), np.float32)
        fn(src, res, op)
    recv.reshape(-1)[:res.size] = res.astype(recv.dtype)


def gather(comm, send, recv):
    """The exact MPI Allgather; moves the bits of 16-bit floats."""
    r = recv.reshape(-1)
    if r.dtype in _HALF_DTYPES:
        r = r.view(np.uint16)
        send = None if send is None else send.reshape(-1).view(np.uint16)
    comm.Allgather(MPI.IN_PLACE if send is None else send, r)


def _indices(ranges):
    # sorted: each rank decodes its own shard first, so the lists are
    # collected in a different order on every rank
    return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in sorted(ranges)])


def _largest(vals, op):
    """For a SUM, this rank's largest finite magnitude among vals (read
    before the collective overwrites them)."""
    if op != MPI.SUM:
        return 0.0
    v = np.abs(vals.astype(np.float64))
    return float(v[np.isfinite(v)].max(initial=0.0))


def _fix_bound(comm, dtype, op, most, e_own):
    """The bound of MPI's SUM of values of ``dtype`` over the ranks, given
    each rank's largest magnitude among them and the error its input
    already carries: both summed in one 16-byte Allreduce, apart from the
    values so these keep the bits MPI gives for them alone (the sum is at
    least every position's sum of magnitudes).  Only when blocks were
    flagged."""
    if op != MPI.SUM:
        return 0.0
    sums = np.array([most, e_own], np.float64)
    comm.Allreduce(MPI.IN_PLACE, sums, MPI.SUM)
    P, f64 = comm.Get_size(), np.dtype(np.float64)
    S = bound.sum_of_nonnegatives(sums[0], P, f64)
    return bound.mpi_sum(dtype, P, S) + bound.sum_of_nonnegatives(sums[1], P, f64)


def fix_allreduce(comm, ranges, src, out, op, e_own=0.0):
    """out[i] = the MPI reduction of src[i] for every i in ``ranges`` (the
    same list on every rank); src and out are flat and may be the same.
    Returns (values reduced, their error bound); ``e_own`` bounds the
    error src already carries."""
    if not ranges:
        return 0, 0.0
    idx = _indices(ranges)
    vals = src[idx]
    most = _largest(vals, op)
    collective(comm, "Allreduce", None, vals, op)
    out[idx] = vals
    return idx.size, _fix_bound(comm, vals.dtype, op, most, e_own)


def fix_allgather(comm, ranges, own, out, rank):
    """out[i] = the owner's value for every i in ``ranges`` (positions in
    out, the same list on every rank): each owner contributes its bits, the
    others zeros, and a bitwise OR delivers them everywhere."""
    if not ranges:
        return 0
    idx = _indices(ranges)
    m = own.size
    bits = np.dtype(f"u{out.itemsize}")
    vals = np.zeros(idx.size, bits)
    mine = (idx >= rank * m) & (idx < (rank + 1) * m)
    vals[mine] = own.view(bits)[idx[mine] - rank * m]
    comm.Allreduce(MPI.IN_PLACE, vals, MPI.BOR)
    out.view(bits)[idx] = vals
    return idx.size


def fix_reduce_scatter(comm, ranges, src, out, op, rank, m, local):
    """Like fix_allreduce for a Reduce_scatter_block: ``ranges`` are this
    rank's own flagged positions (in src's numbering; this rank's result
    covers src[rank*m:(rank+1)*m] and lives in out[:m]).  ``local`` is the
    error bound of this rank's other values.  Returns (values reduced,
    their bound, the largest ``local`` of any rank)."""
    flag = np.array([len(ranges), bound.to_bits(local)], np.int64)
    comm.Allreduce(MPI.IN_PLACE, flag, MPI.MAX)
    most = bound.from_bits(flag[1])
    if not flag[0]:
        return 0, 0.0, most
    every = sorted({r for ranks in comm.allgather(ranges) for r in ranks})
    idx = _indices(every)
    vals = src[idx]
    largest_here = _largest(vals, op)
    collective(comm, "Allreduce", None, vals, op)
    mine = (idx >= rank * m) & (idx < (rank + 1) * m)
    out[idx[mine] - rank * m] = vals[mine]
    return idx.size, _fix_bound(comm, vals.dtype, op, largest_here, 0.0), most


def bound_now(comm, what, opname, send, recv, e_own=0.0):
    """error_bound of a call whose inputs are only known now (a persistent
    request, error feedback): one MAX Allreduce finds the largest
    magnitude and the largest ``e_own`` (how far a rank's values are from
    its caller's); each rank's moves add up."""
    most = np.array([bound.to_bits(mpi_bound.largest(recv if send is None else send)),
                     bound.to_bits(e_own)], np.int64)
    comm.Allreduce(MPI.IN_PLACE, most, MPI.MAX)
    P = comm.Get_size()
    err = mpi_bound.error_bound(what, opname, recv.dtype, P, bound.from_bits(most[0]))
    moved = bound.from_bits(most[1])
    return err if not moved else (err + P * moved) * bound.SLACK
