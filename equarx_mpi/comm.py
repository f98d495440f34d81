"""The public edge: QuantizedComm.  A call is set up (call/setup.py: its
arguments checked and agreed across ranks, the method chosen, where its
error bound comes from), then run (running.py's Runner: a schedule of
collectives/engine.py, the shared window or MPI's own), in the caller's
thread or, for nonblocking and persistent calls, in the progress thread
(call/nonblocking.py); a repeated call MPI runs takes its plan
(call/plans.py).  wrap() drives it through the internal interface below."""
import contextlib
import os
import sys
from time import perf_counter
from typing import Any, Iterator, Optional, Union

import numpy as np
from mpi4py import MPI
from mpi4py.typing import BufSpec, BufSpecB, InPlace
from numpy.typing import ArrayLike, DTypeLike

from equarx_mpi.bounds import bound
from equarx_mpi.call import options, policy
from equarx_mpi.call.agree import abort_on_exception, agree, agreed
from equarx_mpi.call.nonblocking import FREED, Executor, PersistentRequest
from equarx_mpi.call.plans import Plan, signature
from equarx_mpi.call.records import CallInfo, Ledger, Stats, uncompressed_bytes  # noqa: F401 (public here)
from equarx_mpi.call.setup import Setup
from equarx_mpi.call.validate import op_name
from equarx_mpi.collectives import exact
from equarx_mpi.collectives.counting import Counting
from equarx_mpi.collectives.engine import Engine
from equarx_mpi.collectives.nodes import layout, split_nodes
from equarx_mpi.feedback import ErrorFeedback
from equarx_mpi.feedback import check as feedback_error
from equarx_mpi.model import costmodel, profiles
from equarx_mpi.names import BFLOAT16
from equarx_mpi.running import Runner
from equarx_mpi.threads import check as check_threads
from equarx_mpi.threads import default_threads

_IN_PLACE = MPI.IN_PLACE


class QuantizedComm:
    """AllReduce and its halves on ``comm``, sending block-quantized data.

    Collective: every rank of ``comm`` creates it with the same options.
    Traffic goes over a duplicate of ``comm``, so it never matches the
    caller's messages.  ``free()`` (or leaving a ``with`` block) releases it.

    Buffers: numpy arrays (C or Fortran order, any shape: only the count
    must agree between ranks) or any of mpi4py's buffer forms (buffers.py):
    array.array, bytearray, memoryview, [buf, MPI.FLOAT], [buf, count,
    MPI.FLOAT], [buf, (count, displ), MPI.FLOAT]; ``MPI.IN_PLACE`` or None
    as sendbuf (or the same buffer twice for Allreduce) works in place.

    Options: keywords, each also settable as EQUARX_MPI_<NAME>; what each
    means and its default: docs/OPTIONS.md.

    After each call ``last_call`` (a CallInfo) says which path it took, what
    it sent and how long it ran; ``stats`` (a Stats) sums all calls.  Rank 0
    logs on stderr each kind of call the first time it travels lossy
    (EQUARX_MPI_LOG=1: every call; 0: none).  ``with comm.exact():`` keeps
    the calls inside exact.  ``last_error_bound`` certifies the last result:
    |result - exact| never exceeds it on a finite result value;
    ``block_bounds()`` gives it per block (docs/ERROR.md).
    """

    def __init__(self, comm: MPI.Comm, **opts: Any) -> None:
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py MPI.Comm, not {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL")
        if comm.Is_inter():
            raise TypeError("QuantizedComm needs an intra-communicator; "
                            "got an inter-communicator")
        try:
            o, err = options.resolve(opts), None
        except (TypeError, ValueError) as e:
            o, err = {}, e
        # EQUARX_MPI_DISABLE too: read once (policy.Chooser), the same everywhere
        mine = [("call", "QuantizedComm")] + [(k, str(v)) for k, v in o.items()] + [
            ("EQUARX_MPI_DISABLE", str(options.disabled()))]
        everyone = comm.allgather((None if err is None else (type(err).__name__, str(err)),
                                   mine))
        if any(e is not None or f != everyone[0][1] for e, f in everyone):
            raise agreed(everyone)
        self.options = o
        self.wire, self.block_size = o["wire"], o["block_size"]
        self.algorithm, self.lossy_ops, self.check = o["algorithm"], o["lossy_ops"], o["check"]
        if os.environ.get("EQUARX_MPI_ABORT_ON_EXCEPTION", "1") != "0":
            abort_on_exception()
        self._comm: Optional[Counting] = Counting(comm).Dup()
        # Agreements go over their own communicator: the caller's thread
        # agrees on a new call while the progress thread may be running
        # earlier ones on _comm.
        self._ctl = self._comm.Dup()
        # one rank per node compiles a kernel first, the others then load it
        # (engine.py); nothing is compiled before a call needs it
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        compile_first = local.Get_rank() == 0
        #: threads per rank running each kernel (option threads)
        self.threads = o["threads"] or default_threads(local.Get_size())
        local.Free()
        node = split_nodes(self._comm)      # the real node, or a faked layout
        #: where the ranks are (the same on every rank)
        self.layout = layout(self._comm, node)[0]
        node.Free()
        if compile_first:       # one warning per node: its first rank
            check_threads(self.layout.ranks_per_node, self.threads)
        #: all ranks on one node (shared memory)
        self.one_node = self.layout.one_node
        #: the profile algorithm="auto" and the crossovers decide with, and
        #: where it came from: rank 0's, so that every rank decides alike
        self.profile, self.profile_source = profiles.agreed(self._comm)
        P = self._comm.Get_size()
        # P // nodes, not this node's size: the same on every rank
        # each rank's own count may differ (its cores, its environment):
        # the model must answer alike everywhere
        model = costmodel.Model(self.profile, self.layout.nodes, P // self.layout.nodes,
                                o["wire"], o["block_size"], o["chunks"],
                                threads=self._comm.allreduce(self.threads, op=MPI.MIN),
                                rotate=o["rotate"], measured=o["measured_bounds"])
        log = options.logging() if self._comm.Get_rank() == 0 else "none"
        self._choose = policy.Chooser(o, P, self.layout, model,
                                      _tell_lossy if log == "lossy" else None)
        self._setup = Setup(o, P, self._choose, self._agree, self._ctl, feedback_error)
        self._size = self._comm.Get_size()
        self._ledger = Ledger(self._size, log)
        self._exec = Executor()
        self._runner = Runner(self._comm, Engine(self._comm, o, self.one_node, compile_first,
                                                 self.threads),
                              o, self.threads, compile_first, self._ledger.note, self._exec)
        self._exact = 0       # depth of exact() blocks

    @property
    def stats(self) -> Stats:
        """Totals over all calls so far (a Stats)."""
        return self._ledger.stats()

    @property
    def last_call(self) -> Optional[CallInfo]:
        """What the last call did (a CallInfo), None before the first."""
        return self._ledger.last

    @property
    def last_error_bound(self) -> Optional[float]:
        """A rigorous upper bound on |result_i - exact_i| over the last
        call's result values i that are finite, exact being the infinitely
        precise reduction of the inputs as given; the same float on every
        rank (for Reduce_scatter_block: over every rank's result).  0 where
        the result is exact (one rank, MAX, MIN, integers, Allgather
        through MPI); Inf where none is known: an exact float SUM through
        MPI unless exact_bounds=True (then check=True computes it), or
        through a wrapped communicator's own persistent request; PROD.
        None before the first call.  docs/ERROR.md derives it."""
        info = self.last_call
        return None if info is None else info.error_bound

    def block_bounds(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The last call's error bound per block of its result: element j
        bounds |result_i - exact_i| for the finite values i in [j*B,
        (j+1)*B), B = block_size, counted from the start of this rank's
        result (Reduce_scatter_block: its m values).  Local (no message);
        valid until the next call, whose workspace it reads.  Fills and
        returns ``out`` (float64, ceil(n/B) values) if given, else a new
        array."""
        rec = self._ledger.blocks
        if rec is None:
            raise ValueError("equarx_mpi: block_bounds needs a finished call first")
        if type(rec) is tuple:      # an exact call's (n, one bound for every block)
            rec = bound.Record.constant(rec[0], self.block_size, rec[1])
        return rec.blocks(out)

    # --- lifetime -----------------------------------------------------------
    def free(self) -> None:
        """Collective: complete queued calls, release the duplicate
        communicators and workspace."""
        if self._comm is not None:
            self._exec.close()
            self._ledger.forget_plans()
            self._runner.free()
            self._ctl.Free()
            self._comm.Free()
            self._comm = None

    def __enter__(self) -> "QuantizedComm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    @contextlib.contextmanager
    def exact(self) -> Iterator["QuantizedComm"]:
        """``with comm.exact(): ...``: every call inside is exact (as with
        accuracy="exact"), whatever the options.  Local: every rank enters
        it around the same calls."""
        self._exact += 1
        try:
            yield self
        finally:
            self._exact -= 1

    # --- public collectives ---------------------------------------------------
    def Allreduce(self, sendbuf: Union[BufSpec, InPlace], recvbuf: BufSpec, op: MPI.Op = MPI.SUM,
                  feedback: Optional[ErrorFeedback] = None) -> None:
        """recvbuf = op over ranks of sendbuf.  ``MPI.IN_PLACE`` as sendbuf (or
        the same array twice) reduces recvbuf in place.  Returns None.
        ``feedback``: an ErrorFeedback (op SUM; ring or two_shot), whose
        residual joins this rank's input and takes up what this call's
        quantizations lose (feedback.py)."""
        if feedback is None:
            # a repeated call runs by its plan (_comm is None once freed: _prepare says so)
            p = self._ledger.plan(sendbuf, recvbuf, op, self._exact)
            if p is not None and self._comm is not None:
                return self._repeat(p, sendbuf, recvbuf, op, self._comm.Allreduce)
            c = self._prepare("Allreduce", sendbuf, recvbuf, op)
            self._keep(sendbuf, recvbuf, op, c)
        else:
            c = self._prepare("Allreduce", sendbuf, recvbuf, op, feedback=feedback)
        self._exec.run(self._runner.execute, c)

    # --- what wrap() drives (wrapping.py): internal, not the API -------------------
    # _prepare(what, sendbuf, recvbuf, op, opaque_ok=True, persistent=...) a
    # Call; then _run_here, _queued or _persistent run it, or _by_mpi records
    # MPI's own call for it; _plan and _repeat a repeated Allreduce by its plan, and
    # _keep its plan; _set_exact the depth of exact() blocks; _closed;
    # _crossover_wrapped.
    def _plan(self, sendbuf, recvbuf, op):
        """The plan of a repeated Allreduce (call/plans.py), or None."""
        return self._ledger.plan(sendbuf, recvbuf, op, self._exact)

    def _repeat(self, p, sendbuf, recvbuf, op, allreduce):
        """Run a repeated Allreduce by its plan p (MPI's own collective,
        ``allreduce(sendbuf, recvbuf, op)``, or a copy) and tally it.
        Its lines, tally inline, are all a repeated call adds to MPI's:
        each method call more cost about 0.2 us (bench calls)."""
        if self._exec.pending:
            self._exec.drain()
        t0 = perf_counter()
        if p.copy:
            if not p.in_place:          # the same size, maybe another shape (as MPI)
                recvbuf.reshape(-1, order="A")[...] = sendbuf.reshape(-1, order="A")
        else:
            allreduce(_IN_PLACE if p.in_place else sendbuf, recvbuf, op)
        p.last = t = perf_counter() - t0
        p.calls += 1
        p.seconds += t
        self._ledger.latest = p

    def _run_here(self, c):
        self._exec.run(self._runner.execute, c)

    def _queued(self, c):
        return self._exec.submit(self._runner.execute, c)

    def _persistent(self, c):
        return PersistentRequest(self._exec, self._runner.execute, c)

    def _by_mpi(self, c, fn):
        return self._runner.by_mpi(c, fn)

    def _set_exact(self, depth):
        self._exact = depth

    @property
    def _closed(self):
        return self._exec.closed

    def _keep(self, sendbuf, recvbuf, op, c, by_mpi=False):
        """Remember the plan of c, an Allreduce of these arguments, if it is
        MPI's own collective (or a copy) with nothing to agree or compute per
        call; ``by_mpi``: a wrapped communicator's, which MPI runs (also a copy)."""
        key = signature(sendbuf, recvbuf, op, self._exact)
        if (key is not None and c.direct and c.recv.dtype not in exact.UPCAST_DTYPES
                and not self._setup.agree_all):
            sent = uncompressed_bytes(c.what, c.nbytes, self._size)
            info = self._runner.info(c, 0, sent, 0.0, c.bound)
            if by_mpi:
                c.method, info = "mpi", info._replace(method="mpi")
            self._ledger.keep(key, Plan(c, info, sent, self._ledger.blocks_of(c, info)))

    def Iallreduce(self, sendbuf: Union[BufSpec, InPlace], recvbuf: BufSpec,
                   op: MPI.Op = MPI.SUM) -> MPI.Request:
        """Nonblocking Allreduce: returns a request (an MPI.Grequest: Wait,
        Test, MPI.Request.Waitall).  The arguments are checked and agreed
        now; the call runs in the progress thread (nonblocking.py).  Leave
        the buffers alone until the request completes."""
        return self._queued(self._prepare("Allreduce", sendbuf, recvbuf, op))

    def Allreduce_init(self, sendbuf: Union[BufSpec, InPlace], recvbuf: BufSpec,
                       op: MPI.Op = MPI.SUM) -> PersistentRequest:
        """Persistent Allreduce: checks, agreement and the choice of path
        happen once, here; each ``Start()`` of the returned request queues
        the call, ``Wait()`` completes it (nonblocking.PersistentRequest)."""
        return PersistentRequest(self._exec, self._runner.execute,
                                 self._prepare("Allreduce", sendbuf, recvbuf, op,
                                               persistent=True))

    def allreduce(self, x: ArrayLike, op: MPI.Op = MPI.SUM,
                  feedback: Optional[ErrorFeedback] = None) -> np.ndarray:
        """A new array with x's shape and dtype holding op over ranks of x."""
        x = np.asarray(x)
        x = np.ascontiguousarray(x).reshape(x.shape)    # keeps 0-d as 0-d
        out = np.empty_like(x)
        self.Allreduce(x, out, op, feedback)
        return out

    def empty(self, shape: Union[int, tuple[int, ...]],
              dtype: DTypeLike = np.float32) -> np.ndarray:
        """Collective: an uninitialised array to reduce with ``algorithm="shm"``.
        On one node it lives in the shared window, so an Allreduce with it as
        sendbuf (or recvbuf, in place) skips the copy in; every call returns
        the same memory (one such buffer at a time), valid until free().
        Elsewhere, or for types the window does not reduce, a plain array."""
        if self._comm is None:
            raise ValueError(FREED)
        dtype = np.dtype(dtype)
        if self.layout.one_node and self._size > 1 and (dtype.kind == "f" or dtype == BFLOAT16) \
                and dtype.itemsize <= 8:
            return self._runner.window().empty(shape, dtype)
        return np.empty(shape, dtype)

    def Reduce_scatter_block(self, sendbuf: Union[BufSpecB, InPlace],
                             recvbuf: Union[BufSpec, BufSpecB], op: MPI.Op = MPI.SUM) -> None:
        """recvbuf (m values) = op over ranks of block ``rank`` of sendbuf
        (P*m values).  With ``MPI.IN_PLACE`` the input is recvbuf (P*m values)
        and the result goes to its first m.  The result is not requantized:
        it is the full-precision reduction of the quantized partial sums."""
        self._exec.run(self._runner.execute,
                       self._prepare("Reduce_scatter_block", sendbuf, recvbuf, op))

    def Allgather(self, sendbuf: Union[BufSpec, InPlace], recvbuf: BufSpecB) -> None:
        """recvbuf (P*m values) = the m values of every rank, quantized once
        by their owner; the owner's own block is the dequantized form too, so
        recvbuf is identical on every rank.  ``MPI.IN_PLACE``: rank r's values
        are read from block r of recvbuf."""
        self._exec.run(self._runner.execute, self._prepare("Allgather", sendbuf, recvbuf, None))

    # --- internals --------------------------------------------------------------
    def _prepare(self, what, sendbuf, recvbuf, op, **how):
        """A Call, checked, agreed and decided (call/setup.py)."""
        if self._comm is None:
            raise ValueError(FREED)
        return self._setup.prepare(what, sendbuf, recvbuf, op, self._exact, **how)

    def _agree(self, what, meta, err, most=None):
        """The call's agreement (call/agree.py); a torch group's QuantizedComm
        agrees through the group's own, once per call (torch/group.py)."""
        return agree(self._ctl, what, meta, err, most)

    def crossover(self, dtype: DTypeLike = np.float32, what: str = "Allreduce",
                  op: MPI.Op = MPI.SUM, upto: int = 1 << 31) -> Optional[int]:
        """The smallest message (bytes per rank) from which calls of this
        kind are quantized, or None if none up to ``upto`` is (local: no
        communication; every rank answers alike)."""
        return self._choose.crossover(what, op_name(op), np.dtype(dtype), upto)

    def _crossover_wrapped(self, dtype, what, op, upto):
        """crossover() of a wrapped communicator's calls (policy's ``wrapped``)."""
        return self._choose.crossover(what, op_name(op), np.dtype(dtype), upto, wrapped=True)


def _tell_lossy(shape, method, reason):
    """The log line of a kind of call's first lossy decision (rank 0)."""
    what, opname, dtype, nbytes = shape[:4]
    sys.stderr.write(f"equarx_mpi: {what} of {nbytes} B {np.dtype(dtype).name} "
                     f"{opname.upper()} travels lossy: {method} ({reason}); "
                     f"comm.exact() or accuracy='exact' keeps it exact, "
                     f"EQUARX_MPI_LOG=0 silences this\n")

