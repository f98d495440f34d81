"""Local argument checks, made before any communication.  They return an
error value instead of raising, so that agree.agree can raise the same
exception on every rank."""
import numpy as np
from mpi4py import MPI

from equarx_mpi.call.buffers import FORMS, OPAQUE, is_in_place, message
from equarx_mpi.names import BFLOAT16, QUANTIZED_DTYPES

_OPS = ((MPI.SUM, "sum"), (MPI.MAX, "max"), (MPI.MIN, "min"))
_OTHER_OPS = ("PROD", "LAND", "BAND", "LOR", "BOR", "LXOR", "BXOR",
              "MAXLOC", "MINLOC", "REPLACE", "NO_OP")


def op_name(op):
    """"sum", "max", "min" for the ops the library can quantize, else the
    MPI name ("PROD", ...) or "user-defined op"."""
    for known, name in _OPS:
        if op == known:
            return name
    for name in _OTHER_OPS:
        if op == getattr(MPI, name, None):
            return name
    return "user-defined op"


def _same_memory(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.nbytes == b.nbytes)


def check_buffers(what, sendbuf, recvbuf, op, P, opaque_ok=False):
    """Checks for ``what`` in Allreduce, Reduce_scatter_block (recv = send /
    P) and Allgather (recv = P x send).  The buffers may take any of mpi4py's
    forms (buffers.py); ``None`` or ``MPI.IN_PLACE`` as sendbuf is in place.

    Returns (send or None when in place, recv, meta, error): send and recv
    are flat views of the messages' values; meta is a list of (name, value)
    that every rank must share; count is the whole message (P*m values for
    the two halves).  Shapes need not agree between ranks, only counts (as
    in MPI).  With ``opaque_ok`` a buffer only MPI can read (device memory,
    a derived datatype) gives recv = buffers.OPAQUE instead of an error.
    With an error, recv is the recvbuf's values if they were read before
    it (else None): what the call's path would have been."""
    in_place = is_in_place(sendbuf)
    reduces = what != "Allgather"
    recv = None
    meta = [("op", op_name(op) if isinstance(op, MPI.Op) else "none")]
    try:
        if reduces and not isinstance(op, MPI.Op):
            raise TypeError(f"{what}: op must be an MPI.Op such as MPI.SUM, not {op!r}")
        blocked = what == "Allgather" or (in_place and what == "Reduce_scatter_block")
        recv = message(recvbuf, f"{what}: recvbuf", P if blocked else 1)
        send = None if in_place else message(
            sendbuf, f"{what}: sendbuf", P if what == "Reduce_scatter_block" else 1)
        if recv is OPAQUE or send is OPAQUE:
            if opaque_ok:
                return None, OPAQUE, meta + [("count", "opaque"), ("dtype", "opaque")], None
            raise TypeError(f"{what}: device memory and derived datatypes go to MPI "
                            f"unchanged only through equarx_mpi.wrap(comm); pass {FORMS}")
        dt = recv.dtype
        if send is not None and send.dtype != dt:
            raise TypeError(f"{what}: sendbuf dtype {send.dtype} differs from recvbuf dtype {dt}")
        if dt not in QUANTIZED_DTYPES and dt.kind not in "biufc":
            raise TypeError(f"{what}: unsupported dtype {dt}")
        if not dt.isnative:
            raise TypeError(f"{what}: dtype {dt.str} is not in the machine's byte order")
        if dt == BFLOAT16 and reduces and op_name(op) == "user-defined op":
            raise TypeError(f"{what}: a user-defined op cannot reduce bfloat16 "
                            f"(MPI has no bfloat16 type)")
        if not recv.flags.writeable:
            raise ValueError(f"{what}: recvbuf is read-only")
        if send is not None:
            want = {"Allreduce": send.size, "Allgather": P * send.size,
                    "Reduce_scatter_block": send.size // P}[what]
            if recv.size != want:
                raise ValueError(f"{what}: sendbuf has {send.size} values and recvbuf "
                                 f"{recv.size}; with {P} ranks recvbuf needs {want}")
            if np.may_share_memory(send, recv):
                if what != "Allreduce" or not _same_memory(send, recv):
                    raise ValueError(f"{what}: sendbuf and recvbuf overlap; pass "
                                     f"MPI.IN_PLACE to work in place")
                send = None
        total = send.size if what == "Reduce_scatter_block" and send is not None else (
            recv.size)
        meta += [("count", int(total)), ("dtype", dt)]
        return send, recv, meta, None
    except (TypeError, ValueError) as e:
        meta += [("count", "?"), ("dtype", "?")]
        return None, None if recv is OPAQUE else recv, meta, e
