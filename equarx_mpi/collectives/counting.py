"""The library's own communicators: they count the bytes the schedules
send, and wait politely while one of the library's background threads runs
a call (the rule: background.py)."""
from mpi4py import MPI

from equarx_mpi.collectives.background import PoliteRequest


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
