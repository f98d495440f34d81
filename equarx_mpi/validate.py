"""Local argument checks, made before any communication.  They return an
error value instead of raising, so that agree.agree can raise the same
exception on every rank."""
import ml_dtypes
import numpy as np
from mpi4py import MPI

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: Float dtypes that may travel quantized; anything else takes exact MPI.
QUANTIZED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BFLOAT16)

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


def check_buffers(what, sendbuf, recvbuf, op, P):
    """Checks for ``what`` in Allreduce, Reduce_scatter_block (recv = send /
    P) and Allgather (recv = P x send).

    Returns (send or None when in place, recv, meta, error): meta is a list
    of (name, value) that every rank must share; count is the whole message
    (P*m values for the two halves)."""
    in_place = sendbuf is MPI.IN_PLACE
    reduces = what != "Allgather"
    meta = [("call", what), ("op", op_name(op) if isinstance(op, MPI.Op) else "none")]
    try:
        if reduces and not isinstance(op, MPI.Op):
            raise TypeError(f"{what}: op must be an MPI.Op such as MPI.SUM, not {op!r}")
        if not isinstance(recvbuf, np.ndarray):
            raise TypeError(f"{what}: recvbuf must be a numpy array, not {type(recvbuf).__name__}")
        if not in_place and not isinstance(sendbuf, np.ndarray):
            raise TypeError(f"{what}: sendbuf must be a numpy array or MPI.IN_PLACE, "
                            f"not {type(sendbuf).__name__}")
        # subclasses (np.matrix, masked arrays) as the plain arrays they hold
        recvbuf = recvbuf.view(np.ndarray)
        send = None if in_place else sendbuf.view(np.ndarray)
        dt = recvbuf.dtype
        if send is not None and send.dtype != dt:
            raise TypeError(f"{what}: sendbuf dtype {send.dtype} differs from recvbuf dtype {dt}")
        if dt not in QUANTIZED_DTYPES and dt.kind not in "biufc":
            raise TypeError(f"{what}: unsupported dtype {dt}")
        if not dt.isnative:
            raise TypeError(f"{what}: dtype {dt.str} is not in the machine's byte order")
        if dt == BFLOAT16 and reduces and op_name(op) == "user-defined op":
            raise TypeError(f"{what}: a user-defined op cannot reduce bfloat16 "
                            f"(MPI has no bfloat16 type)")
        if not recvbuf.flags.c_contiguous:
            raise ValueError(f"{what}: recvbuf must be C-contiguous (shape {recvbuf.shape}, "
                             f"strides {recvbuf.strides})")
        if not recvbuf.flags.writeable:
            raise ValueError(f"{what}: recvbuf is read-only")
        if send is not None:
            if not send.flags.c_contiguous:
                raise ValueError(f"{what}: sendbuf must be C-contiguous (shape {send.shape}, "
                                 f"strides {send.strides})")
            want = {"Allreduce": send.size, "Allgather": P * send.size,
                    "Reduce_scatter_block": send.size // P}[what]
            if recvbuf.size != want or (what == "Reduce_scatter_block" and send.size % P):
                raise ValueError(f"{what}: sendbuf has {send.size} values and recvbuf "
                                 f"{recvbuf.size}; with {P} ranks recvbuf needs {want}"
                                 + (f" and sendbuf a multiple of {P}"
                                    if what == "Reduce_scatter_block" else ""))
            if np.may_share_memory(send, recvbuf):
                if what != "Allreduce" or not _same_memory(send, recvbuf):
                    raise ValueError(f"{what}: sendbuf and recvbuf overlap; pass "
                                     f"MPI.IN_PLACE to work in place")
                send = None
        elif what != "Allreduce" and recvbuf.size % P:
            raise ValueError(f"{what}: in place, recvbuf's {recvbuf.size} values do not split "
                             f"into {P} equal blocks")
        total = send.size if what == "Reduce_scatter_block" and send is not None else (
            recvbuf.size)
        meta += [("count", int(total)), ("dtype", dt), ("shape", recvbuf.shape)]
        return send, recvbuf, meta, None
    except (TypeError, ValueError) as e:
        meta += [("count", "?"), ("dtype", "?"), ("shape", "?")]
        return None, recvbuf, meta, e
