"""What QuantizedComm decides in the caller's thread before a call runs
(Setup.prepare): the arguments checked, and agreed across ranks where the
path is the library's own; the method (policy.py); where the error bound
comes from (bound_from.py).  The result is a Call (records.py) for
running.py to run."""
from mpi4py import MPI

from equarx_mpi.bounds import mpi_bound, tolerance
from equarx_mpi.call import bound_from
from equarx_mpi.call.buffers import OPAQUE, is_in_place
from equarx_mpi.call.records import Call
from equarx_mpi.call.validate import check_buffers, op_name


class Setup:
    """A communicator's call setup: ``options`` (resolved), ``size`` ranks,
    ``choose`` (policy.Chooser), ``agree(what, meta, err, most)`` (its
    agreement), ``ctl`` (the agreements' communicator: the error-bounded
    mode's own agreement on M), ``feedback_error(fb, opname, recv,
    method)`` (feedback.check: an ErrorFeedback's error value)."""

    def __init__(self, options, size, choose, agree, ctl, feedback_error):
        self.options, self.size, self.choose, self.agree = options, size, choose, agree
        self.ctl, self.feedback_error = ctl, feedback_error
        self.check = options["check"]
        #: check="all": MPI's own path is agreed too, so it keeps no plan
        self.agree_all = options["check"] == "all"
        self.tolerant = options["abs_tol"] is not None or options["rel_tol"] is not None

    def prepare(self, what, sendbuf, recvbuf, op, exact, opaque_ok=False, persistent=False,
                feedback=None):
        """A Call: the arguments checked and, with check=True, agreed across
        ranks unless it is MPI's own collective with nothing to agree
        (docs/ROBUSTNESS.md), the method chosen, and where its error bound
        comes from (call/bound_from.py).  With opaque_ok (a wrapped communicator)
        a buffer only MPI can read gives a Call with recv OPAQUE, for MPI to
        run unchanged, and auto's exact calls are MPI's own (policy.choose's
        ``wrapped``); ``persistent``: the values come when each Start() runs;
        ``exact``: inside comm.exact()."""
        P = self.size
        send, recv, meta, err = check_buffers(what, sendbuf, recvbuf, op, P, opaque_ok)
        name = "sum" if what == "Allgather" else (
            op_name(op) if isinstance(op, MPI.Op) else None)
        fb = feedback is not None
        if err is None:
            nbytes = dict(meta)["count"] * recv.dtype.itemsize if recv is not OPAQUE else 0
        elif recv is not None and name is not None:     # the path the call would take
            whole = what == "Reduce_scatter_block" and not is_in_place(sendbuf)
            nbytes = recv.size * (P if whole else 1) * recv.dtype.itemsize
        else:
            raise err               # its path unknown here: raised here, as mpi4py does
        method, reason, source, tolerant = self.path(what, name, recv, nbytes, fb, opaque_ok,
                                                     persistent, exact, quiet=err is not None)
        direct = (method in ("mpi", "copy") and not fb
                  and source in (bound_from.FIXED, bound_from.UNKNOWN))
        if err is not None:
            # the others agree exactly where this call's path is the library's own
            if self.check and (not direct or self.agree_all):
                self.agree(what, meta + [("feedback", int(fb)), ("method", method)], err)
            raise err
        known = recv is not OPAQUE
        dtype = recv.dtype if known else None
        if fb:
            err = self.feedback_error(feedback, name, recv, method)
        if tolerant and (persistent or fb) and err is None:
            err = ValueError(tolerance.NOT_PERSISTENT)
        most = None
        if (source == bound_from.AGREED or tolerant) and self.check:
            most = mpi_bound.largest(recv if send is None else send)
        meta = meta + [("feedback", int(fb))]
        c = Call(what, send, recv, op, name, method, reason, nbytes, source, feedback)
        c.direct = direct
        # MPI's own path agrees on nothing (but with check="all"): a rank that
        # kept its plan does not either
        if self.check and (err is not None or not c.direct or self.agree_all):
            most = self.agree(what, meta + [("method", method)], err, most)
        elif err is not None:
            raise err
        if tolerant:          # check=False: its own 8-byte MAX Allreduce finds M
            most = bound_from.settle(self.options, c, P, most, self.ctl)
        if c.bound is None and c.bound_from in bound_from.WHEN_PREPARED:
            c.bound = 0.0 if known and not nbytes else \
                mpi_bound.error_bound(what, name, dtype, P, most)
        return c

    def path(self, what, name, recv, nbytes, fb, opaque_ok, persistent, exact, quiet=False):
        """(method, reason, where its bound comes from, tolerant) of a call
        on ``recv`` (OPAQUE: a buffer only MPI can read) of ``nbytes``;
        ``fb``: with error feedback; ``quiet``: no lossy log line (a call
        refused for its arguments)."""
        P = self.size
        known = recv is not OPAQUE
        if not known:
            method, reason = "mpi", "device memory or a derived datatype: MPI unchanged"
        elif nbytes == 0:
            method, reason = ("copy" if P == 1 else "mpi"), "empty message"
        else:
            method, reason = self.choose(what, name, recv.dtype, nbytes, fb, opaque_ok,
                                         exact > 0, quiet=quiet)
        dtype = recv.dtype if known else None
        tolerant = bool(self.tolerant and nbytes and mpi_bound.sums_floats(what, name, dtype, P))
        source = bound_from.source(what, name, dtype, P, method, nbytes, persistent or fb,
                                   self.check and self.options["exact_bounds"], fb, tolerant)
        return method, reason, source, tolerant
