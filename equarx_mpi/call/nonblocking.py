"""Nonblocking and persistent calls: one progress thread per QuantizedComm.

A nonblocking call is checked and agreed across ranks when it is made
(errors are raised right there, on every rank, as for a blocking call),
then queued.  The communicator's progress thread runs queued calls one at
a time, in the order they were made, on the library's duplicate
communicator, while the caller computes: the thread drives MPI (polling
its requests with short sleeps, PoliteRequest) and runs the numba kernels,
which release the GIL.  A blocking call first waits for the queue to empty,
then runs in the caller's thread; so every rank executes its calls in
program order, and the schedules' messages match.

What overlaps: computation that leaves the GIL and a core to the thread
at each of its steps, such as numpy and BLAS calls on large arrays.  A
pure-Python loop holds the GIL, and many tiny numpy calls hand it back
to the caller first (CPython's GIL favours the running thread for up to
sys.getswitchinterval(), 5 ms), so the thread advances slowly; with more
busy threads than cores it also waits for a core at every step.

Requests are MPI generalized requests (MPI.Grequest), completed by the
thread, so ``MPI.Request.Waitall``/``Testall``/``Waitany`` accept them
mixed with any other MPI request.  ``Wait`` and ``Test`` on our requests
first wait on a thread event, so a waiting caller sleeps instead of spinning.

Persistent requests (``Allreduce_init``) are Python objects with Start,
Wait, Test and Free, as MPI.Prequest has (MPI offers no user-defined
persistent requests): ``waitall``/``testall``/``startall`` here take any
mix of them and MPI requests, and ``.request`` is the MPI request of the
current round.  As in MPI, a round is active from Start() until a Wait or
Test (ours, or MPI's on ``.request``) completes it, and Start() on an
active request raises; so does Start() once the communicator is freed.

Needs MPI_THREAD_MULTIPLE (mpi4py asks for it by default; see
``MPI.Query_thread()``).  Without it a nonblocking call runs to completion
when it is made and returns a completed request: correct, with no overlap.

A failure while a queued call runs (not an argument error: those are
raised when the call is made) cannot be raised on every rank, since peers
are inside the collective: it ends the job with ``Abort``, as a failure
inside a blocking quantized call does.
"""
import atexit
import sys
import threading
import weakref

from mpi4py import MPI

from equarx_mpi.collectives.background import OrderedQueue, in_background

#: the error of a call on a freed communicator (QuantizedComm's own text)
FREED = "equarx_mpi: this QuantizedComm has been freed"


class Request(MPI.Grequest):
    """A nonblocking call in flight: an MPI request completed by the
    progress thread.  ``info`` is the call's CallInfo once complete."""

    def _setup(self):
        self._done = threading.Event()
        self.info = None
        return self

    def Wait(self, status=None):
        self._done.wait()
        return super().Wait(status)

    def Test(self, status=None):
        if not self._done.is_set():
            return False
        return super().Test(status)


class Executor(OrderedQueue):
    """Runs calls one at a time in the order they were made
    (collectives/background.py); ``submit`` returns a Request."""

    def __init__(self):
        # queued calls finish before mpi4py's own exit handler (registered
        # earlier, run later) finalizes MPI
        super().__init__("equarx_mpi progress", at_exit=self._drain_at_exit)

    def _drain_at_exit(self):
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().drain())

    def submit(self, fn, arg):
        """Queue fn(arg); a Request completed when it has run."""
        if self.closed:     # a persistent request's Start() after free(): no comm to run on
            raise ValueError(FREED)
        g = MPI.Grequest.Start()
        req = Request(g)._setup()

        def done(info, exc):
            if exc is not None:
                _failed(exc)
            # g is the thread's own handle object: the caller may be in
            # MPI_Waitall on req (the same MPI request) while this completes it
            req.info = info
            g.Complete()
            req._done.set()
        super().submit(lambda: fn(arg), done)
        return req

    def note(self, fn, arg):
        """fn(arg), bookkeeping with no communication, after every call
        queued before it: now if none is pending, else in the thread."""
        self.after(lambda: fn(arg), lambda _, exc: exc is not None and _failed(exc))


def _failed(exc):
    """A queued call failed: its peers are inside the collective.  (Run at
    once, without MPI_THREAD_MULTIPLE, it is the caller's, as a blocking
    call's.)"""
    if not in_background():
        raise exc
    # COMM_WORLD: the library's communicator may be the cause
    sys.stderr.write(f"equarx_mpi: rank {MPI.COMM_WORLD.Get_rank()}: a queued "
                     f"call failed, aborting the job: {exc!r}\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


class PersistentRequest:
    """The request of ``Allreduce_init``: the call was checked, agreed and
    its path chosen once; each Start() queues it, Wait()/Test() complete it."""

    def __init__(self, executor, fn, call):
        self._exec, self._fn, self._call = executor, fn, call
        self._req = None
        self.info = None

    @property
    def request(self):
        """The MPI request of the current round (MPI.REQUEST_NULL when inactive)."""
        return MPI.REQUEST_NULL if self._req is None else self._req

    def Start(self):
        if self._fn is None:
            raise ValueError("equarx_mpi: Start() on a freed persistent request")
        if self._req is not None:
            # active until a Wait or Test completes it, as in MPI: whether
            # the round has finished by now differs between ranks
            if self._req != MPI.REQUEST_NULL:
                raise ValueError("equarx_mpi: Start() on an active persistent request; "
                                 "Wait() for it first")
            self.Wait()     # completed through .request by MPI's own Waitall or Testall
        self._req = self._exec.submit(self._fn, self._call)

    def Wait(self, status=None):
        if self._req is not None:
            self._req.Wait(status)
            self.info, self._req = self._req.info, None
        return True

    def Test(self, status=None):
        if self._req is None or self._req.Test(status):
            self.Wait()
            return True
        return False

    def Free(self):
        """Completes the current round, if any, and releases the request."""
        self.Wait()
        self._fn = self._call = None


def startall(requests):
    for r in requests:
        r.Start()


def waitall(requests):
    """Wait for every request: ours (plain or persistent) and MPI's, mixed."""
    mpi = []
    for r in requests:
        if isinstance(r, (Request, PersistentRequest)):
            r.Wait()
        else:
            mpi.append(r)
    if mpi:
        MPI.Request.Waitall(mpi)
    return True


def testall(requests):
    """True once every request has completed (completing them all), else False."""
    ours = [r for r in requests if isinstance(r, (Request, PersistentRequest))]
    if not all(r._req is None or r._req._done.is_set() if isinstance(r, PersistentRequest)
               else r._done.is_set() for r in ours):
        return False
    mpi = [r for r in requests if not isinstance(r, (Request, PersistentRequest))]
    if mpi and not MPI.Request.Testall(mpi):
        return False
    return waitall(ours)
