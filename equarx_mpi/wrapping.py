"""``equarx_mpi.wrap(comm)``: a drop-in communicator for existing mpi4py code.

The wrapped communicator *is* an mpi4py communicator: an instance of a
subclass of comm's own class (MPI.Intracomm, MPI.Cartcomm, ...) holding the
same MPI handle.  So isinstance checks, ``==``/``Compare`` against comm
(IDENT), passing it to other libraries, and every method not listed below
behave exactly as on comm, and its point-to-point messages and other
collectives match ranks that use comm itself.

Through the library's policy (QuantizedComm; lossy only where asked for):
    Allreduce, Iallreduce, Allreduce_init, Reduce_scatter_block, and
    allreduce for numpy float arrays.  By default only SUM of float arrays
    above the size crossover travels quantized; MAX/MIN (unless lossy_ops
    names them), integers, every other op and dtype, and buffers only MPI
    can read (device memory, derived datatypes) go to comm's own method
    with the caller's arguments unchanged: exact calls give MPI's own bits
    (auto does not take the shared window, which adds in another order;
    algorithm="shm" asks for it, and then it runs there).
    Allgather too, but only with lossy_allgather=True; by default it is
    comm's own.
    allreduce of anything else (scalars, lists, dicts; a Python function as
    op) is mpi4py's pickle-based allreduce.  All ranks of one call must pass
    the same kind: numpy float arrays everywhere, or nowhere.
Dup, Dup_with_info, Clone, Idup, Idup_with_info, Split, Split_type, Create,
Create_group and the topologies (Create_cart, Create_graph,
Create_dist_graph, Create_dist_graph_adjacent, a Cartcomm's Sub) return
wrapped communicators of mpi4py's class for them (a wrapped Cartcomm, ...)
with the same options; COMM_NULL stays COMM_NULL.  Inter-communicators
(Create_intercomm, Spawn, Accept, Connect) are mpi4py's own: the library
reduces on intra-communicators only (wrap an Intercomm's Merge() instead).
Free() and free() also free the library's duplicates; Start() of a
persistent request made before then raises.  free() is safe, as mpi4py's:
on wrap(MPI.COMM_WORLD) or wrap(MPI.COMM_SELF) it frees only those
duplicates, the communicator stays usable and its next reduction makes new
ones (a wrapped clone of the handle, type(w)(w), becomes null as mpi4py's
clone does).  As mpi4py's, a wrapped predefined communicator pickles by
name (loading gives MPI.COMM_WORLD itself if that is wrapped alike, else a
new wrapped one with the same options) and any other raises ValueError;
fromhandle, f2py and fromint of a wrapped class give that wrapped class
(default options), while mpi4py's own (MPI.Comm.fromhandle, its C API) give
mpi4py's classes.  ``last_call`` and ``stats`` report what the
calls did (comm.py CallInfo, Stats), in the order they were made once the
nonblocking ones before have finished; each Start() of MPI's own
persistent request counts as a call (MPI.Prequest.Startall does not record).

Every rank of comm must call wrap() (it is collective); options are those
of QuantizedComm, and EQUARX_MPI_<OPTION> / EQUARX_MPI_DISABLE apply.
"""
import contextlib
import functools
from typing import TYPE_CHECKING, Any, ContextManager, Optional

import numpy as np
from mpi4py import MPI
from numpy.typing import DTypeLike

from equarx_mpi.call.buffers import OPAQUE
from equarx_mpi.call.nonblocking import FREED
from equarx_mpi.call.validate import QUANTIZED_DTYPES
from equarx_mpi.collectives import exact
from equarx_mpi.comm import CallInfo, QuantizedComm, Stats

if TYPE_CHECKING:
    class WrappedComm(MPI.Intracomm):
        """What wrap() gives, to a type checker (no such class at run
        time): an mpi4py Intracomm (in fact of comm's own class) with
        last_call, stats, exact() and crossover() too."""
        @property
        def last_call(self) -> Optional[CallInfo]: ...
        @property
        def stats(self) -> Stats: ...
        def exact(self) -> ContextManager["WrappedComm"]: ...
        def crossover(self, dtype: DTypeLike = ..., what: str = ..., op: MPI.Op = ...,
                      upto: int = ...) -> Optional[int]: ...


def wrap(comm: MPI.Intracomm, **opts: Any) -> "WrappedComm":
    """A communicator that is ``comm`` (same handle, same class and more) whose
    reduction collectives go through equarx_mpi's policy.  Collective."""
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"wrap needs an mpi4py intra-communicator, not "
                        f"{type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("wrap: comm is MPI.COMM_NULL")
    w = _rewrap(comm, opts, new=True)
    # wrap(MPI.COMM_WORLD) stands for mpi4py's constant: free() leaves it be
    w._eq_const = _named(comm)[1] or getattr(comm, "_eq_const", False)
    w._equarx()      # now: bad options raise here, on every rank
    return w


def _named(comm):
    """(name, constant): mpi4py's name of comm's handle if it is predefined
    ("COMM_WORLD", "COMM_SELF"; else None), and whether comm is mpi4py's
    constant object itself.  mpi4py pickles a predefined handle by name, so
    its own __reduce__ tells: the name for its constant, a reference to the
    constant for any other object holding the handle, ValueError else."""
    try:
        r = MPI.Comm.__reduce__(comm)
    except ValueError:
        return None, False
    if isinstance(r, str):
        return r, True
    return MPI.Comm.__reduce__(r[1][1]), False


def _unpickle(name, opts):
    """A wrapped predefined communicator, as pickled by _Wrapped.__reduce__:
    MPI.<name> itself if that is wrapped alike (a process that replaced
    MPI.COMM_WORLD by its wrap()), else a new wrapped one of that handle."""
    named = getattr(MPI, name)
    if isinstance(named, _Wrapped) and named._eq_opts == opts:
        return named
    w = _rewrap(_mpi_class(type(named))(named), opts, new=True)
    w._eq_const = True
    return w


def _mpi_class(cls):
    """The mpi4py class that cls is or derives from."""
    return next(c for c in cls.__mro__ if c.__module__ == "mpi4py.MPI")


#: the methods (where base has them) whose new communicator is wrapped too.
#: Not the inter-communicators (Create_intercomm, Spawn, Accept, Connect):
#: the library reduces on intra-communicators only.
_MAKERS = ("Dup", "Clone", "Dup_with_info", "Split", "Split_type", "Create", "Create_group",
           "Create_cart", "Create_graph", "Create_dist_graph", "Create_dist_graph_adjacent",
           "Sub")
_NONBLOCKING_MAKERS = ("Idup", "Idup_with_info")      # return (comm, request)


def _maker(method, nonblocking):
    @functools.wraps(method)
    def make(self, *args, **kwargs):
        made = method(self, *args, **kwargs)
        if nonblocking:
            return _rewrap(made[0], self._eq_opts), made[1]
        return _rewrap(made, self._eq_opts)
    return make


@functools.lru_cache(maxsize=None)
def _wrapped_class(base):
    makers = {name: _maker(getattr(base, name), name in _NONBLOCKING_MAKERS)
              for name in _MAKERS + _NONBLOCKING_MAKERS if hasattr(base, name)}
    return type(f"Wrapped{base.__name__}", (_Wrapped, base),
                {"__module__": __name__, "__doc__": __doc__, **makers})


def __getattr__(name):
    # the classes are made on demand (_wrapped_class): pickle finds them here
    base = getattr(MPI, name.removeprefix("Wrapped"), None) if name.startswith("Wrapped") else None
    if isinstance(base, type) and issubclass(base, MPI.Intracomm):
        return _wrapped_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rewrap(comm, opts, new=False):
    """comm as a wrapped communicator with options opts: a new object holding
    the same handle, unless mpi4py just made it of our class (not new)."""
    if comm == MPI.COMM_NULL:
        return comm
    if new or not isinstance(comm, _Wrapped):
        comm = _wrapped_class(_mpi_class(type(comm)))(comm)
    comm._eq_opts, comm._eq_qc = dict(opts), None
    return comm


_IN_PLACE = MPI.IN_PLACE
_ALLREDUCE = MPI.Intracomm.Allreduce      # MPI's own, on a wrapped communicator


def _send_arg(c, sendbuf):
    # what MPI gets as sendbuf: in place when the checks found it so (the
    # same array twice is in place for us, an aliasing error for MPI)
    return sendbuf if c.recv is OPAQUE or c.send is not None else MPI.IN_PLACE


def _runs_here(c):
    """Whether the library runs this call: quantized, the exact shared
    window (asked for: algorithm="shm"), or a dtype mpi4py cannot hand to
    MPI (bfloat16); else MPI with the caller's arguments."""
    return c.quantize or c.method == "shm" or (c.recv is not OPAQUE
                                               and c.recv.dtype in exact.UPCAST_DTYPES)


class _RecordedPrequest(MPI.Prequest):
    """MPI's own persistent request of a wrapped communicator's exact
    Allreduce_init: each Start() is recorded (last_call, stats) as a call
    whose error bound is Inf (its values come later).  MPI.Prequest.Startall
    starts it without a record."""

    def Start(self):
        # as the library's own request does; and Open MPI crashes on a
        # persistent collective started after its communicator's Free()
        if self._eq_qc._closed:
            raise ValueError(FREED)
        self._eq_qc._by_mpi(self._eq_call, super().Start)

    def Free(self):
        # as mpi4py's own request, a freed one holds no buffer
        super().Free()
        self._eq_call = None


class _Wrapped:
    """The methods a wrapped communicator overrides (see the module text)."""

    # mpi4py makes objects of our class without __init__ (Dup, Idup): the
    # method that made them sets the options (_rewrap), else the defaults hold.
    _eq_opts: "dict[str, Any]" = {}
    _eq_qc = None
    _eq_exact = 0       # depth of exact() blocks
    _eq_const = False           # wrap() of mpi4py's constant: free() is a no-op
    _eq_past = (Stats(), None)  # stats, last_call from before the last free()

    def __init__(self, comm=None):
        # type(w)(w), as MPI.Intracomm(comm): the same handle, and options
        if isinstance(comm, _Wrapped):
            self._eq_opts = comm._eq_opts

    def __reduce__(self):
        # as mpi4py's: a predefined handle by name (the wrapped one of that
        # name on loading, with these options), any other a ValueError
        name = _named(self)[0]
        if name is None:
            return super().__reduce__()
        return _unpickle, (name, dict(self._eq_opts))

    # mpi4py's classmethods that make an object from a handle make one of
    # the class asked (with the default options)
    @classmethod
    def fromhandle(cls, handle):
        return _rewrap(_mpi_class(cls).fromhandle(handle), {})

    @classmethod
    def f2py(cls, arg):
        return _rewrap(_mpi_class(cls).f2py(arg), {})

    @classmethod
    def fromint(cls, arg):
        return _rewrap(_mpi_class(cls).fromint(arg), {})

    def _equarx(self):
        """The QuantizedComm behind this communicator, made on first use
        (collective: only ever from a collective call)."""
        if self._eq_qc is None:
            self._eq_qc = QuantizedComm(_mpi_class(type(self))(self), **self._eq_opts)
            self._eq_qc._set_exact(self._eq_exact)      # made inside exact(): still exact
        return self._eq_qc

    @property
    def last_call(self):
        """CallInfo of the last reduction call (None before the first)."""
        got = None if self._eq_qc is None else self._eq_qc.last_call
        return self._eq_past[1] if got is None else got

    @property
    def stats(self):
        """Totals over this communicator's reduction calls (comm.Stats),
        also those before a free() of a wrapped COMM_WORLD."""
        past = self._eq_past[0]
        if self._eq_qc is None:
            return past
        now = self._eq_qc.stats
        return now if past.calls == 0 else Stats(*(a + b for a, b in zip(past, now)))

    # --- through the policy ----------------------------------------------------
    def _blocking(self, what, sendbuf, recvbuf, op, mpi_call):
        qc = self._equarx()
        c = qc._prepare(what, sendbuf, recvbuf, op, opaque_ok=True)
        if _runs_here(c):
            qc._run_here(c)
            return None
        qc._by_mpi(c, lambda: mpi_call(_send_arg(c, sendbuf)))
        return c

    @contextlib.contextmanager
    def exact(self):
        """``with comm.exact(): ...``: the calls inside are exact, whatever
        the options (QuantizedComm.exact); every rank enters it.  Local: the
        depth lives here too, so a QuantizedComm made inside (first use, or
        after free() of a wrapped constant) is exact as well."""
        self._eq_exact += 1
        try:
            if self._eq_qc is not None:
                self._eq_qc._set_exact(self._eq_exact)
            yield self
        finally:
            self._eq_exact -= 1
            if self._eq_qc is not None:
                self._eq_qc._set_exact(self._eq_exact)

    def crossover(self, dtype=np.float32, what="Allreduce", op=MPI.SUM, upto=1 << 31):
        """The smallest message (bytes per rank, on QuantizedComm.crossover's
        grid) from which this communicator's calls of this kind travel
        quantized, or None.  Local, but collective the first time on a
        communicator made from a wrapped one (Dup, Split, ...) before its
        first reduction: that makes the library's part."""
        return self._equarx()._crossover_wrapped(dtype, what, op, upto)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        qc = self._eq_qc or self._equarx()
        p = qc._plan(sendbuf, recvbuf, op)
        if p is not None:
            return qc._repeat(p, sendbuf, recvbuf, op, self._mpi_allreduce)
        c = self._blocking("Allreduce", sendbuf, recvbuf, op,   # the first of its kind
                           lambda s: super(_Wrapped, self).Allreduce(s, recvbuf, op))
        if c is not None:
            qc._keep(sendbuf, recvbuf, op, c, by_mpi=True)

    def _mpi_allreduce(self, sendbuf, recvbuf, op):
        _ALLREDUCE(self, sendbuf, recvbuf, op)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        self._blocking("Reduce_scatter_block", sendbuf, recvbuf, op,
                       lambda s: super(_Wrapped, self).Reduce_scatter_block(s, recvbuf, op))

    def Allgather(self, sendbuf, recvbuf):
        if not self._equarx().options["lossy_allgather"]:
            return super().Allgather(sendbuf, recvbuf)
        self._blocking("Allgather", sendbuf, recvbuf, None,
                       lambda s: super(_Wrapped, self).Allgather(s, recvbuf))

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        qc = self._equarx()
        c = qc._prepare("Allreduce", sendbuf, recvbuf, op, opaque_ok=True)
        if _runs_here(c):
            return qc._queued(c)
        return qc._by_mpi(c, lambda: super(_Wrapped, self).Iallreduce(
            _send_arg(c, sendbuf), recvbuf, op))

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL):
        qc = self._equarx()
        c = qc._prepare("Allreduce", sendbuf, recvbuf, op, opaque_ok=True, persistent=True)
        if _runs_here(c):
            return qc._persistent(c)
        req = _RecordedPrequest(super().Allreduce_init(_send_arg(c, sendbuf), recvbuf, op, info))
        req._eq_qc, req._eq_call = qc, c
        return req

    def allreduce(self, sendobj, op=MPI.SUM):
        if not (isinstance(sendobj, np.ndarray) and sendobj.dtype in QUANTIZED_DTYPES
                and isinstance(op, MPI.Op)):
            return super().allreduce(sendobj, op)
        x = np.ascontiguousarray(sendobj).reshape(sendobj.shape)
        out = np.empty_like(x)
        self.Allreduce(x, out, op)
        return out

    # (communicators made from this one: _MAKERS)
    def _eq_release(self):
        qc = self._eq_qc
        if qc is not None:
            qc.free()           # completes queued calls: their records count
            past, last = self._eq_past
            self._eq_past = (Stats(*(a + b for a, b in zip(past, qc.stats))),
                             last if qc.last_call is None else qc.last_call)
            self._eq_qc = None

    def Free(self):
        super().Free()
        self._eq_release()

    def free(self):
        """Release the library's duplicates; then mpi4py's free(): Free()
        unless the handle is null or predefined.  Safe on a wrapped
        constant (wrap(MPI.COMM_WORLD)) as on mpi4py's: it stays usable, and
        its next reduction makes new duplicates."""
        self._eq_release()
        if not self._eq_const:
            super().free()

