"""Errors that every rank raises together: local checks produce an error
value, one tiny agreement turns it into the same exception on every rank.
And the hook that ends the whole job on an uncaught exception."""
import array
import functools
import struct
import sys
import traceback
import zlib

import numpy as np
from mpi4py import MPI


def _key(name, value):
    """A stable integer for comparing a call's value across ranks."""
    if type(value) is int:
        return value
    if isinstance(value, np.dtype):   # dtype.str alone can't tell bfloat16 apart
        value = value.str + str(value)
    return zlib.crc32(f"{name}={value}".encode())


@functools.lru_cache(maxsize=256, typed=True)
def _signature(meta):
    """The fields of a call's (name, value) pairs and their negatives, as
    the first part of the agreement's message (a call repeats: cached)."""
    fields = [_key(name, value) for name, value in meta]
    return array.array("q", fields + [-f for f in fields])


def agree(comm, what, meta, err, most=None):
    """Raise the same error on every rank of ``comm`` unless every rank
    made the same call (the same (name, value) pairs in ``meta``) without a
    local error ``err``.  ``most``, a nonnegative float or None, rides
    along: returns its largest value over the ranks (None where this rank
    passed None), e.g. the largest input magnitude for an exact sum's
    error bound."""
    if comm.Get_size() == 1:
        if err is not None:
            raise err
        return most
    # One tiny MAX-Allreduce of (fields, -fields, error flag, most) tells
    # every rank whether all agree; only then are details gathered.
    # (array.array: a numpy array costs more than the message here.)
    try:
        sig = _signature(tuple(meta))
    except TypeError:       # an unhashable value: no cache
        sig = _signature.__wrapped__(tuple(meta))
    a = array.array("q", sig)
    a.append(err is not None)
    # always there, so the message has one length on every rank; a
    # nonnegative float's bits order like its value, -1 stands for None
    a.append(-1 if most is None else _float_bits(most))
    comm.Allreduce(MPI.IN_PLACE, [a, MPI.INT64_T], MPI.MAX)
    # the MAX of every field and of its negative is this rank's own pair
    # exactly when every rank has the same field
    k = len(sig)
    if not a[k] and a[:k] == sig:
        return None if most is None or a[-1] < 0 else _bits_float(a[-1])
    everyone = comm.allgather((None if err is None else (type(err).__name__, str(err)),
                               {name: str(v) for name, v in meta}))
    raise_agreed(what, everyone)


def _float_bits(x):
    return _INT64.unpack(_FLOAT64.pack(x))[0]


def _bits_float(b):
    return _FLOAT64.unpack(_INT64.pack(b))[0]


_INT64, _FLOAT64 = struct.Struct("=q"), struct.Struct("=d")


def raise_agreed(what, everyone):
    """Raise on every rank the same exception, built from every rank's
    (error or None, description) as gathered in rank order."""
    errors = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if errors:
        r, (cls, msg) = errors[0]
        more = f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
        exc = TypeError if cls == "TypeError" else ValueError
        raise exc(f"equarx_mpi: rank {r}: {msg}{more}")
    descs = [d for _, d in everyone]
    for name in descs[0]:
        values = [d.get(name) for d in descs]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"equarx_mpi: {name} differs between ranks ({shown})")


def abort_on_exception():
    """Make an uncaught exception on any rank print its traceback and end the
    whole MPI job (``COMM_WORLD.Abort``), as ``python -m mpi4py`` does.

    Without it, the other ranks wait in their next collective forever.
    QuantizedComm installs it; EQUARX_MPI_ABORT_ON_EXCEPTION=0 opts out."""
    if getattr(sys.excepthook, "_equarx_mpi", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        out = sys.stderr
        if out is not sys.__stderr__ and sys.__stderr__ is not None:
            # a wrapper holds sys.stderr in a buffer until the hooks inside
            # return (torch's init_process_group installs one), which an
            # Abort never does: the traceback goes to the process's own too
            out = sys.__stderr__
            out.write("".join(traceback.format_exception(kind, value, tb)))
        out.write(f"equarx_mpi: uncaught exception on rank "
                  f"{MPI.COMM_WORLD.Get_rank()}, aborting the MPI job\n")
        out.flush()
        MPI.COMM_WORLD.Abort(1)
    hook._equarx_mpi = True
    sys.excepthook = hook
