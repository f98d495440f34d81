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

from equarx_mpi.collectives.background import wait_until

#: values compared one by one: the call's name and its first SLOTS - 2
#: fields; the rest ride as one hash, so that every call sends one message
#: length (a rank in another call must not be read as a truncation by MPI)
SLOTS = 8
_INT64, _FLOAT64 = struct.Struct("=q"), struct.Struct("=d")


def _key(name, value):
    """A stable integer for comparing a call's value across ranks."""
    if type(value) is int:
        return value
    if isinstance(value, np.dtype):   # dtype.str alone can't tell bfloat16 apart
        value = value.str + str(value)
    return zlib.crc32(f"{name}={value}".encode())


@functools.lru_cache(maxsize=256, typed=True)
def _signature(fields):
    """The compared values of a call's (name, value) pairs and their
    negatives: the agreement's message but for its last two values (a
    call repeats: cached)."""
    codes = [_key(name, value) for name, value in fields]
    values = codes[:SLOTS - 1] + [0] * (SLOTS - 1 - len(codes))
    values.append(_key("rest", tuple(codes[SLOTS - 1:])))
    return array.array("q", values + [-v for v in values])


def agree(comm, what, fields, err, most=None, deadline=None, kinds=None):
    """Raise the same error on every rank of ``comm`` unless every rank made
    the same call ``what`` with the same (name, value) pairs ``fields`` and
    no local error ``err`` (an exception or None).  ``most``, a
    nonnegative float or None, rides along: returns its largest value over
    the ranks (None where this rank passed None), e.g. the largest input
    magnitude for an exact sum's error bound.

    ``deadline`` None: one blocking MAX Allreduce.  Else a time.monotonic()
    value (math.inf: none): a nonblocking one, waited for by the library's
    rule (collectives/background.py), and TimeoutError once it passes (the
    torch layer's groups: their calls agree in the caller's thread or in
    the group's queue, and MPI matches a nonblocking collective only with
    nonblocking ones).  ``kinds``: the exception class by field name when
    the ranks differ (ValueError otherwise)."""
    if comm.Get_size() == 1:
        if err is not None:
            raise err
        return most
    fields = (("call", what),) + tuple(fields)
    try:
        sig = _signature(fields)
    except TypeError:       # an unhashable value: no cache
        sig = _signature.__wrapped__(fields)
    # (array.array: a numpy array costs more than the message here)
    a = array.array("q", sig)
    a.append(err is not None)
    # a nonnegative float's bits order like its value; -1 stands for None
    a.append(-1 if most is None else _INT64.unpack(_FLOAT64.pack(most))[0])
    if deadline is None:
        comm.Allreduce(MPI.IN_PLACE, [a, MPI.INT64_T], MPI.MAX)
    else:
        _wait(comm.Iallreduce(MPI.IN_PLACE, [a, MPI.INT64_T], MPI.MAX), deadline)
    # the MAX of every value and of its negative is this rank's own pair
    # exactly when every rank has the same value
    if not a[-2] and a[:-2] == sig:
        return None if most is None or a[-1] < 0 else \
            _FLOAT64.unpack(_INT64.pack(a[-1]))[0]
    everyone = comm.allgather((None if err is None else (type(err).__name__, str(err)),
                               [(name, str(v)) for name, v in fields]))
    raise agreed(everyone, kinds)


def pairwise(comm, what, send, expect, deadline):
    """After ``agree`` (nonblocking, ``deadline``): raise on every rank
    unless what each rank sends each other (``send[j]`` elements to rank
    j) is what that rank expects (``expect[r]`` from rank r)."""
    theirs = array.array("q", [0] * len(send))
    _wait(comm.Ialltoall([array.array("q", send), MPI.INT64_T], [theirs, MPI.INT64_T]),
          deadline)
    bad = [j for j in range(len(send)) if theirs[j] != expect[j]]
    err = None if not bad else ValueError(
        f"{what}: rank {comm.Get_rank()} expects {[expect[j] for j in bad]} elements "
        f"from rank(s) {bad}, which send {[theirs[j] for j in bad]}")
    agree(comm, what, [], err, None, deadline)


#: requests of agreements that timed out: still active, so MPI may still
#: write their buffers (the request keeps them), never released
_STUCK = []


def _wait(req, deadline):
    if not wait_until(req, deadline):
        _STUCK.append(req)
        raise TimeoutError("not every rank made the call in time")


def agreed(everyone, kinds=None):
    """The one exception every rank raises, from every rank's (error or
    None, fields) in rank order: the lowest rank's error, else the first
    field that differs, with each rank's value."""
    errors = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if errors:
        r, (cls, msg) = errors[0]
        more = f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
        exc = {"TypeError": TypeError, "ValueError": ValueError}.get(cls, RuntimeError)
        return exc(f"equarx_mpi: rank {r}: {msg.removeprefix('equarx: ')}{more}")
    calls = [f[0][1] for _, f in everyone]
    if len(set(calls)) > 1:
        return ValueError(f"equarx_mpi: the ranks made different calls ({_each(calls)})")
    for i in range(max(len(f) for _, f in everyone)):
        seen = [tuple(f[i]) if i < len(f) else (None, None) for _, f in everyone]
        if len(set(seen)) == 1:
            continue
        name = seen[0][0]
        if len({n for n, _ in seen}) > 1:
            return ValueError(f"equarx_mpi: {calls[0]}: the ranks passed different "
                              f"arguments ({_each(seen)})")
        return (kinds or {}).get(name, ValueError)(
            f"equarx_mpi: {calls[0]}: {name} differs between ranks "
            f"({_each(v for _, v in seen)})")
    return ValueError(f"equarx_mpi: {calls[0]}: the ranks differ")   # a hash collision only


def _each(values):
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


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
