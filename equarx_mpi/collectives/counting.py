"""The library's own communicators: they count the bytes the schedules
send, and wait politely while one of the library's background threads runs
a call.  The one rule for waiting: a call run by a background thread of
the library (the progress thread, the torch layer's queues) waits for the
network politely, leaving the cores to the caller's computation; a call in
the caller's own thread spins, as MPI does."""
import threading
import time

from mpi4py import MPI

_BACKGROUND = "_equarx_mpi_background"


def background_thread(target, name):
    """A started daemon thread running ``target()``, marked as the library's."""
    t = threading.Thread(target=target, daemon=True, name=name)
    setattr(t, _BACKGROUND, True)
    t.start()
    return t


def in_background():
    """Whether the calling thread is one of the library's background threads."""
    return getattr(threading.current_thread(), _BACKGROUND, False)


class PoliteRequest(MPI.Request):
    """A point-to-point request of a call a background thread runs: its Wait
    polls with growing pauses (10 to 250 us) instead of spinning in
    MPI_Wait, so waiting for the network leaves the cores to the caller's
    computation.  (The socket buffers keep a link busy for longer than a
    pause; a blocking call, in the caller's thread, still spins.)"""

    def Wait(self, status=None):
        pause = 1e-5
        while not self.Test(status):
            time.sleep(pause)
            pause = min(2 * pause, 2.5e-4)
        return True


class Counting(MPI.Intracomm):
    """The library's duplicate communicator; counts the bytes the schedules
    send (whatever the schedule, it sends with Isend).  While a background
    thread runs a call (``polite``), its requests wait without spinning."""
    sent = 0
    polite = False

    def Isend(self, buf, dest, tag=0):
        self.sent += buf.nbytes
        req = super().Isend(buf, dest, tag)
        return PoliteRequest(req) if self.polite else req

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        req = super().Irecv(buf, source, tag)
        return PoliteRequest(req) if self.polite else req
