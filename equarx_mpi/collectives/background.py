"""The library's background threads: the one ordered queue that runs calls
off the caller's thread (QuantizedComm's nonblocking and persistent calls,
the torch layer's asynchronous ones) and the one rule for waiting.

The rule: a call run by a background thread of the library waits for the
network politely (it spins SPIN seconds, then polls with growing pauses),
leaving the cores to the caller's computation; a call in the caller's own
thread spins, as MPI's blocking calls do.  Threads made by
``background_thread`` are the library's (and a send's or receive's waiter
in the torch layer).  wire/threaded.py's kernel workers are no queue: they
run parts of one kernel call and send nothing."""
import collections
import threading
import time

from mpi4py import MPI

_BACKGROUND = "_equarx_mpi_background"

#: how long a background thread spins on a request before it sleeps: peers
#: in step answer within it (docs/results/torch-issue36-before-after.txt)
SPIN = 1e-4


def background_thread(target, name):
    """A started daemon thread running ``target()``, marked as the library's."""
    t = threading.Thread(target=target, daemon=True, name=name)
    setattr(t, _BACKGROUND, True)
    t.start()
    return t


def in_background():
    """Whether the calling thread is one of the library's background threads."""
    return getattr(threading.current_thread(), _BACKGROUND, False)


def wait_until(req, deadline=None, spin=SPIN, status=None):
    """Complete MPI request ``req``; False if ``deadline`` (time.monotonic(),
    or None: none) passes first (the request is then still active).  The
    rule above: in a background thread, polite after ``spin`` seconds."""
    polite, pause, n = in_background(), 1e-5, 0
    patient = time.monotonic() + spin
    while not req.Test(status):
        n += 1
        if n % 64 and not (polite and spin == 0):
            continue
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return False
        if polite and now >= patient:
            time.sleep(pause)
            pause = min(2 * pause, 2.5e-4)
    return True


class PoliteRequest(MPI.Request):
    """A point-to-point request of a call a background thread runs: its
    Wait sleeps between polls from the start (10 to 250 us; the socket
    buffers keep a link busy for longer than a pause)."""

    def Wait(self, status=None):
        return wait_until(self, None, 0, status)


class OrderedQueue:
    """Runs work one item at a time, in the order it was given: queued
    items in a background thread of its own (started by the first), the
    others in the caller's thread once everything queued before them has
    run.  So every rank runs its calls in program order, and the messages
    of the schedules match.  Without MPI_THREAD_MULTIPLE (``threaded``
    false) a queued item runs at once, in the caller's thread."""

    def __init__(self, name, at_exit=None):
        self._cv = threading.Condition()
        self._queue = collections.deque()
        self.pending = 0                 # queued or running
        self._thread = None
        self._name, self._at_exit = name, at_exit
        self.closed = False
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def in_thread(self):
        return self._thread is not None and threading.current_thread() is self._thread

    def run(self, fn, *args):
        """fn(*args) here, after every queued item (at once in the thread itself)."""
        if not self.in_thread():
            self.drain()
        return fn(*args)

    def submit(self, fn, done):
        """Queue fn(); then done(value, error) in the thread: (its value,
        None), or (None, the exception it raised)."""
        if not self.threaded:
            _execute(fn, done)
            return
        with self._cv:
            if self._thread is None:
                self._thread = background_thread(self._loop, self._name)
                if self._at_exit is not None:
                    self._at_exit()
            self._queue.append((fn, done))
            self.pending += 1
            self._cv.notify_all()

    def after(self, fn, done):
        """fn() after every item queued before it: now if none is pending
        (done is then not called: fn's exception is the caller's), else as
        ``submit``."""
        with self._cv:
            if self.pending:
                self._queue.append((fn, done))
                self.pending += 1
                self._cv.notify_all()
                return
        fn()

    def drain(self):
        with self._cv:
            while self.pending:
                self._cv.wait()

    def close(self):
        """Finish what is queued, then stop the thread."""
        self.drain()
        self.closed = True
        if self._thread is not None:
            with self._cv:
                self._queue.append(None)
                self._cv.notify_all()
            self._thread.join()
            self._thread = None

    def _loop(self):
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                item = self._queue.popleft()
            if item is None:
                return
            _execute(*item)
            # while it waits for the next item, the thread must not keep this
            # one's buffers alive (numpy's resize() refuses referenced arrays)
            item = None
            with self._cv:
                self.pending -= 1
                self._cv.notify_all()


def _execute(fn, done):
    try:
        value = fn()
    except BaseException as e:      # noqa: BLE001 - done() decides what it means
        done(None, e)
        return
    done(value, None)
