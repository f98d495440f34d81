"""Every rank raises the same error, or none: a call's local checks give an
error value and a few integers that must be equal on every rank (op,
dtype, element counts, root); one tiny MAX-Allreduce of them and their
negatives tells every rank whether all agree, and only then are the details
gathered to build one message.  The same door as the library's own
(equarx_mpi/call/agree.py), over the group's control communicator, in the
caller's thread, before anything is queued or sent."""
import array
import zlib

from mpi4py import MPI

_INT64 = MPI.INT64_T


def agree(comm, what, fields, err):
    """Raise on every rank of ``comm`` if some rank has a local error
    ``err`` (an exception, or None) or some (name, int) pair of ``fields``
    differs between ranks; else return None.  Every rank must pass the
    same names in the same order."""
    if comm.Get_size() == 1:
        if err is not None:
            raise err
        return
    values = [_code(v) for _, v in fields]
    a = array.array("q", values)
    a.extend(-v for v in values)
    a.append(err is not None)
    comm.Allreduce(MPI.IN_PLACE, [a, _INT64], MPI.MAX)
    k = len(values)
    # MAX(v) == v and MAX(-v) == -v on every rank exactly when all are equal
    if not a[-1] and a[:k].tolist() == values and [-x for x in a[k:2 * k]] == values:
        return
    everyone = comm.allgather((None if err is None else (type(err).__name__, str(err)),
                               [v if type(v) is int else str(v) for _, v in fields]))
    raise agreed(what, [n for n, _ in fields], everyone)


def _code(value):
    """A stable integer for comparing a value across ranks."""
    return value if type(value) is int else zlib.crc32(str(value).encode())


def agreed(what, names, everyone):
    """The one exception every rank raises, from every rank's (error,
    values): the lowest rank's error, naming the ranks that had it; else
    the first field that differs, with each rank's value."""
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        kind, text = failed[0][1]
        ranks = [r for r, e in failed if e == failed[0][1]]
        cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        where = "every rank" if len(ranks) == len(everyone) else f"rank(s) {ranks}"
        return cls(f"{text} (on {where})")
    for i, name in enumerate(names):
        seen = [v[i] for _, v in everyone]
        if len(set(seen)) > 1:
            return ValueError(f"equarx: {what}: the ranks passed different {name}: "
                              f"{dict(enumerate(seen))}")
    return RuntimeError(f"equarx: {what}: the ranks disagree")    # not reached
