"""The library's own communicators: they count the bytes the schedules
send, and wait politely while the progress thread runs a call."""
import time

from mpi4py import MPI


class PoliteRequest(MPI.Request):
    """A point-to-point request of a call the progress thread runs: its Wait
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
    send (whatever the schedule, it sends with Isend).  While the progress
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
