"""Work objects and the queue behind ``async_op=True``.

torch hands every collective of a process group an options object whose
``asyncOp`` says whether the caller waits at once (``dist.all_reduce(t)``)
or later (``async_op=True``; DDP's gradient buckets, which the C++ reducer
starts with the default options, asyncOp true).  A call waited at once runs
in the caller's thread and returns a finished Work; any other is queued
and returns at once, without a message: one thread per group agrees on
the queued calls and runs them, one at a time, in the order they were
made, so every rank runs them in the same order, and a call made later,
blocking or not, starts only after every earlier one has finished
(program order, as one stream per group gives it).  Nothing an
asynchronous call does waits for a peer in the caller's thread: two groups
whose calls are started in different orders on different ranks, or a
send made after an asynchronous call whose peer receives first, complete
as on gloo.  The thread spends its time in MPI and in numba's kernels,
which leave the GIL, so backward computes while a bucket is on the wire;
it is one of the library's background threads, which wait for the network
politely (equarx_mpi.threads).

A Work's future (``get_future()``) completes in that thread when the data
is there, with the call's output tensors, or with its exception; callbacks
chained with ``then()`` run there too.  A callback may start another call
of the group (PowerSGD's hook does): started from the thread itself, a
blocking one runs at once and an asynchronous one joins the queue.

Needs MPI_THREAD_MULTIPLE (mpi4py's default); without it every call runs
at once, in the caller's thread.
"""
import atexit
import threading

import torch
import torch.distributed as dist
from mpi4py import MPI

from equarx_mpi.collectives.background import OrderedQueue, background_thread


class Work(dist.Work):
    """A call of an equarx group: ``wait()``, ``is_completed()``,
    ``get_future()`` (its value: the call's output tensors), ``result()``.
    ``done``: finished already (a blocking call; its future is made when
    asked for: a blocking call's Work is only waited on)."""

    def __init__(self, result, done=True):
        super().__init__()
        self._result = result
        self._error = None
        if done:
            self._fut = self._done = None
        else:
            self._fut = torch.futures.Future()
            self._done = threading.Event()

    def _finish(self, error):
        self._error = error
        if error is None:
            self._fut.set_result(self._result)
        else:
            self._fut.set_exception(error)
        self._done.set()

    def wait(self, timeout=None):
        if self._done is None:
            return True
        seconds = None if timeout is None else timeout.total_seconds()
        if seconds is not None and seconds <= 0:     # torch's "no timeout"
            seconds = None
        if not self._done.wait(seconds):
            raise RuntimeError(f"equarx: a call did not complete within {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._done is None or self._done.is_set()

    def is_success(self):
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        if self._fut is None:
            self._fut = torch.futures.Future()
            self._fut.set_result(self._result)
        return self._fut

    def result(self):
        self.wait()
        return self._result


class P2PWork(Work):
    """A send or receive: MPI's nonblocking call, completed by ``wait()``
    (or, once asked for a future, by a thread of its own: a peer's matching
    call may come after later calls of this group, which the queue would
    hold up).  ``finish`` runs once the message is there (a receive's copy
    into a non-contiguous tensor).  The group keeps it until MPI is done
    with its memory (``poll``), whether or not the caller keeps it."""

    def __init__(self, result, request, finish=None, keep=()):
        super().__init__(result, done=False)
        self._req, self._then, self._keep = request, finish, keep
        self._status = MPI.Status()
        self._lock = threading.Lock()
        self._waiter = None

    def _complete(self, arrived=False):
        with self._lock:
            if self._done.is_set():
                return
            try:
                if not arrived:
                    self._req.Wait(self._status)
                if self._then is not None:
                    self._then()
                error = None
            except Exception as e:      # noqa: BLE001 - the waiter's to raise
                error = e
            self._keep = ()
            self._finish(error)

    def poll(self):
        """Whether MPI is done with the message, completing the Work if so;
        never waits."""
        with self._lock:
            if self._done.is_set() or self._waiter is not None:
                return self._done.is_set()
            try:
                arrived = self._req.Test(self._status)
            except Exception:           # noqa: BLE001 - wait() raises it
                return False
        if arrived:
            self._complete(arrived=True)
        return arrived

    def wait(self, timeout=None):
        if timeout is None or timeout.total_seconds() <= 0:
            if self._waiter is None:
                self._complete()
        else:
            self.get_future()       # the thread completes it; wait() has a time limit
        return super().wait(timeout)

    def get_future(self):
        with self._lock:
            if self._waiter is None and not self._done.is_set():
                self._waiter = background_thread(self._complete, "equarx p2p")
        return self._fut

    def _source_rank(self):
        """The sender's rank in the group (a receive from any source)."""
        self.wait()
        return self._status.Get_source()

    source_rank = _source_rank


class Executor(OrderedQueue):
    """Runs a group's calls in the order they are made
    (collectives/background.py); ``submit`` returns a Work."""

    def __init__(self):
        super().__init__("equarx queue")

    def submit(self, fn, result):
        """Queue fn(); a Work with ``result`` that completes when it has run."""
        if self.closed:
            raise RuntimeError("equarx: this process group has been shut down")
        work = Work(result, done=False)
        super().submit(fn, lambda _, error: work._finish(error))
        return work

    def close(self):
        """Finish what is queued, then stop the thread."""
        if self.in_thread():
            raise RuntimeError("equarx: a process group cannot be shut down from its own "
                               "callbacks")
        super().close()


#: frees of shut-down groups still waiting for their peers (joined at exit)
_FREEING = []
#: shut-down groups whose communicators MPI may still use (never freed)
KEPT = []


def free_soon(free, threaded):
    """Run ``free()``, a collective release (shared-memory windows), without
    waiting for the other ranks: in a thread of its own, so that ranks may
    release groups in different orders."""
    if not threaded:
        free()
        return
    _FREEING[:] = [t for t in _FREEING if t.is_alive()]
    _FREEING.append(background_thread(free, "equarx free"))


@atexit.register
def _join_frees():
    # before mpi4py's own exit handler (registered earlier, run later)
    # finalizes MPI; a peer that never frees its side is not waited for long
    for t in _FREEING:
        t.join(timeout=10)
