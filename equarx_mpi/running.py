"""How a QuantizedComm runs a prepared call (call/records.Call): the
method's runner (_RUN) on the library's communicator, with its error
bound and its record; MPI's own calls made by a wrapped communicator
(``by_mpi``); the parts made on first use (the window, the hierarchy)."""
import math
import time

import numpy as np
from mpi4py import MPI

from equarx_mpi.bounds import bound, mpi_bound
from equarx_mpi.call import bound_from
from equarx_mpi.call.records import CallInfo, uncompressed_bytes
from equarx_mpi.collectives import exact, rotation
from equarx_mpi.collectives.background import in_background
from equarx_mpi.collectives.engine import Engine
from equarx_mpi.collectives.registry import SCHEDULES
from equarx_mpi.names import between_nodes


class Runner:
    """A QuantizedComm's part that runs calls (comm.py prepares them) on
    ``comm``, the library's counting communicator, with ``engine``;
    ``record(c, info, rec)`` keeps each call's record, ``queue`` orders
    the records of MPI's own calls after the queued ones."""

    def __init__(self, comm, engine, options, threads, compile_first, record, queue):
        self._comm, self.engine, self.options = comm, engine, options
        self.wire, self.block_size, self.threads = options["wire"], options["block_size"], threads
        self._compile_first, self._record, self._queue = compile_first, record, queue
        self._size = comm.Get_size()
        self._shared = self._hier = self._between = None    # made on first use (collective)

    def free(self):
        """Collective: release the parts made so far."""
        for part in (self._shared, self._between, self._hier):
            if part is not None:
                part.free()
        self.engine.free()

    def execute(self, c):
        """Run a prepared call on the library's communicator; its CallInfo."""
        self._rotate(c)
        fb = c.feedback
        if fb is None:
            return self._run(c)
        rotated = self.engine.rotates(c.name)
        fb.into(self.engine.active if rotated else None)
        if rotated:                 # the engine adds the residual to the rotated input
            return self._run(c)
        # the residual joins the input (not in place any more: the caller's
        # values stay as they are until the result lands in recv); the bound
        # still holds against the caller's values: each rank's input moved
        # by at most e_own
        own = c.recv if c.send is None else c.send
        info = self._run(c.with_input(fb.begin(own)), fb.moved(own))
        fb.end(c.recv)
        return info

    def _rotate(self, c):
        """Whether c travels rotated (option rotate): the engine's ``active``
        rotation for it.  rotate="auto" decides from what a sample of the
        ranks' blocks loses through the wire, as they are and rotated
        (collectives/rotation.py), one 16-byte Allreduce; never for
        fp8, whose per-value exponent already fits heavy tails (rotated it
        loses: docs/FORMAT.md "Rotation")."""
        e = self.engine
        rot = e.rotation if c.quantize and c.name == "sum" else None
        if rot is not None and e.auto:
            if self.wire == "fp8":
                rot = None
            else:
                own = c.recv if c.send is None else c.send
                if c.what == "Allgather" and c.send is None:
                    m = own.size // self._size
                    own = own[self._comm.Get_rank() * m:][:m]
                got = np.array(e.rotation_errors(own))
                self._comm.Allreduce(MPI.IN_PLACE, got, MPI.SUM)
                rot = rot if got[0] > rotation.AUTO_GAIN * got[1] else None
        e.active = rot

    def _run(self, c, e_own=0.0):
        """execute without the feedback's part: the method's runner (_RUN);
        ``e_own`` bounds how far this rank's values are from the caller's."""
        t0 = time.perf_counter()
        comms = (self._comm,) + ((self._hierarchy()[0].inter,)
                                 if c.method == "hierarchical" else ())
        sent0, polite = sum(m.sent for m in comms), in_background()
        for m in comms:
            m.polite = polite
        fixed, err, rec = _RUN[c.method](self, c, e_own)
        sent = sum(m.sent for m in comms) - sent0 if c.quantize else \
            uncompressed_bytes(c.what, c.nbytes, self._size)
        return self._record(c, self.info(c, fixed, sent, time.perf_counter() - t0, err), rec)

    def info(self, c, fixed, sent, seconds, err):
        rotated = c.quantize and self.engine.rotates(c.name)
        return CallInfo(c.what, c.method, self.wire if c.quantize else None, c.reason, fixed,
                        sent, seconds, math.inf if err is None else err,
                        self.engine.active.size if rotated else 0)

    # --- the runners, one per method: (values fixed up, bound, bound.Record) -----
    def _exact_bound(self, c, e_own):
        """An exact call's bound, before it runs (it may overwrite its input)."""
        if c.bound_from == bound_from.AT_RUN:
            return exact.bound_now(self._comm, c.what, c.name, c.send, c.recv, e_own)
        return c.bound

    def _copy(self, c, e_own):
        if c.send is not None:
            c.recv[...] = c.send
        return 0, self._exact_bound(c, e_own), None

    def _mpi(self, c, e_own):
        err = self._exact_bound(c, e_own)
        if c.what == "Allgather":
            exact.gather(self._comm, c.send, c.recv)
        else:
            exact.collective(self._comm, c.what, c.send, c.recv, c.op)
        return 0, err, None

    def _shm(self, c, e_own):
        err = self._exact_bound(c, e_own)
        most = self.window().allreduce(c.send, c.recv, c.op)
        if c.bound_from == bound_from.WINDOW:
            err = mpi_bound.error_bound(c.what, c.name, c.recv.dtype, self._size, most)
        return 0, err, None

    def _schedule(self, c, e_own):
        """A schedule the engine runs, with the call's budget."""
        e = self.engine
        e.budget = c.budget
        if c.what == "Allgather":
            got = e.allgather(c.send, c.recv)
        elif c.what == "Reduce_scatter_block":
            got = e.reduce_scatter(c.method, c.send, c.recv, c.name, c.op)
        else:
            got = e.allreduce(c.method, c.send, c.recv, c.name, c.op, e_own, c.feedback)
        return got + (e.record,)

    def _hierarchical(self, c, e_own):
        self.engine.budget = c.budget
        hier, between = self._hierarchy()
        # the step between nodes rotates as this call does
        between.active = between.rotation if self.engine.active is not None else None
        B = self.block_size

        def across(comm, mine, e_own):
            # flagged blocks are left to the hierarchy: MPI reduces them from
            # every rank's input, not from the node results
            return between.allreduce(between_nodes(self.wire), None,
                                     mine.reshape(-1), c.name, c.op, e_own, fix_up=False)
        err, slices, fixed = hier.allreduce(c.recv if c.send is None else c.send, c.recv, c.op,
                                            across, B)
        rec = bound.Record(c.recv.size, B, [(lo, hi, np.full(-(-(hi - lo) // B), b))
                                            for lo, hi, b in slices if hi > lo])
        return fixed, err, rec

    def by_mpi(self, c, fn):
        """fn(): MPI's own call for c, made by a wrapped communicator with
        the caller's arguments (or a nonblocking one started); recorded like
        any call, after the calls queued before it, so that last_call is the
        last call made once they finish."""
        t0 = time.perf_counter()
        result = fn()
        info = self.info(c, 0, uncompressed_bytes(c.what, c.nbytes, self._size),
                         time.perf_counter() - t0, c.bound)._replace(method="mpi")
        self._queue.note(lambda i: self._record(c, i), info)
        return result

    def window(self):
        """The shared window of the exact one-node method (made on first use)."""
        if self._shared is None:
            from equarx_mpi.collectives.shm import ShmAllreduce
            self._shared = ShmAllreduce(self._comm)
        return self._shared

    def _hierarchy(self):
        """The node-aware schedule and the engine between nodes (made on
        first use)."""
        if self._hier is None:
            from equarx_mpi.collectives.hierarchical import Hierarchy
            self._hier = Hierarchy(self._comm)
            self._between = Engine(self._hier.inter, self.options, False, self._compile_first,
                                   self.threads)
        return self._hier, self._between


#: method -> its runner: the engine for every schedule it runs
_RUN = {"copy": Runner._copy, "mpi": Runner._mpi, "shm": Runner._shm,
        "hierarchical": Runner._hierarchical,
        **{name: Runner._schedule for name, s in SCHEDULES.items() if s.run is not None}}
