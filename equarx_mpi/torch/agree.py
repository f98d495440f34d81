"""Every rank raises the same error, or none: a call's local checks give an
error value and a few integers that must be equal on every rank (op,
dtype, element counts, root); one tiny MAX-Allreduce of them and their
negatives tells every rank whether all agree, and only then are the details
gathered to build one message.  The same door as the library's own
(equarx_mpi/call/agree.py), over the group's control communicator, in the
thread that runs the group's calls in order, before any data is sent.
Nonblocking, with a deadline: a rank whose peers never make the call raises
TimeoutError instead of waiting forever."""
import array
import zlib

from mpi4py import MPI

from equarx_mpi.torch.work import wait_until

_INT64 = MPI.INT64_T


#: values compared per call: the first SLOTS - 1 fields, and a hash of the
#: rest, so that every call sends the same message length (a rank in another
#: collective must not be read as a truncation error by MPI)
SLOTS = 8


def agree(comm, what, fields, err, deadline=None):
    """Raise on every rank of ``comm`` if some rank has a local error
    ``err`` (an exception, or None) or some (name, value) pair of
    ``fields`` differs between ranks, the collective's name ``what``
    included; else return None.  TimeoutError if the other ranks have not
    all made the call by ``deadline`` (time.monotonic(); None: never)."""
    if comm.Get_size() == 1:
        if err is not None:
            raise err
        return
    fields = [("collective", what)] + list(fields)
    codes = [_code(v) for _, v in fields]
    values = codes[:SLOTS - 1] + [0] * (SLOTS - 1 - len(codes))
    values.append(_code(tuple(codes[SLOTS - 1:])))
    a = array.array("q", values)
    a.extend(-v for v in values)
    a.append(err is not None)
    _wait(comm.Iallreduce(MPI.IN_PLACE, [a, _INT64], MPI.MAX), deadline)
    # MAX(v) == v and MAX(-v) == -v on every rank exactly when all are equal
    if not a[-1] and a[:SLOTS].tolist() == values and \
            [-x for x in a[SLOTS:2 * SLOTS]] == values:
        return
    everyone = comm.allgather((None if err is None else (type(err).__name__, str(err)),
                               [(n, v if type(v) is int else str(v)) for n, v in fields]))
    raise agreed(what, everyone)


def pairwise(comm, what, send, expect, deadline=None):
    """After ``agree``: raise on every rank unless what each rank sends
    each other (``send[j]`` elements to rank j) is what that rank expects
    (``expect[r]`` from rank r)."""
    theirs = array.array("q", [0] * len(send))
    _wait(comm.Ialltoall([array.array("q", send), _INT64], [theirs, _INT64]), deadline)
    bad = [j for j in range(len(send)) if theirs[j] != expect[j]]
    err = None if not bad else ValueError(
        f"equarx: {what}: rank {comm.Get_rank()} expects {[expect[j] for j in bad]} elements "
        f"from rank(s) {bad}, which send {[theirs[j] for j in bad]}")
    agree(comm, what, [], err, deadline)


#: requests of agreements that timed out: still active, so MPI may still
#: write their buffers (the request keeps them), never released
_STUCK = []


def _wait(req, deadline):
    if not wait_until(req, deadline):
        _STUCK.append(req)
        raise TimeoutError("not every rank of the group made the call in time")


def _code(value):
    """A stable integer for comparing a value across ranks."""
    return value if type(value) is int else zlib.crc32(str(value).encode())


def agreed(what, everyone):
    """The one exception every rank raises, from every rank's (error,
    fields): the lowest rank's error, naming the ranks that had it; else
    the first field that differs, with each rank's value."""
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        kind, text = failed[0][1]
        ranks = [r for r, e in failed if e == failed[0][1]]
        cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        where = "every rank" if len(ranks) == len(everyone) else f"rank(s) {ranks}"
        return cls(f"{text} (on {where})")
    for i in range(max(len(f) for _, f in everyone)):
        seen = [f[i] if i < len(f) else None for _, f in everyone]
        if len(set(seen)) > 1:
            name = next(s[0] for s in seen if s is not None)
            if len({s[0] if s else None for s in seen}) > 1 or name == "collective":
                return ValueError(f"equarx: the ranks made different calls: "
                                  f"{dict(enumerate(f[0][1] for _, f in everyone))}")
            cls = TypeError if name == "dtype" else ValueError
            return cls(f"equarx: {what}: the ranks passed different {name}: "
                       f"{dict(enumerate(s[1] for s in seen))}")
    return RuntimeError(f"equarx: {what}: the ranks disagree")    # a hash collision only
