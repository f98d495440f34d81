"""The public edge: QuantizedComm.  Arguments are checked (validate.py) and
agreed across ranks (agree.py), the method is chosen (policy.py), then a
schedule (engine.py) or exact MPI (exact.py) runs, in the caller's thread or,
for nonblocking and persistent calls, in the progress thread
(nonblocking.py)."""
import os
import sys
import threading
import time
from typing import NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from . import costmodel, exact, formats, options, policy, profiles
from .agree import abort_on_exception, agree, raise_agreed
from .buffers import OPAQUE
from .engine import Engine
from .nonblocking import Executor, PersistentRequest, PoliteRequest
from .shm import split_nodes
from .validate import BFLOAT16, check_buffers, op_name


class CallInfo(NamedTuple):
    """What the last call did (``QuantizedComm.last_call``)."""
    call: str                 #: "Allreduce", "Reduce_scatter_block" or "Allgather"
    #: "mpi" (MPI's own collective), "shm" (exact through a shared window),
    #: "copy" (one rank), or the quantized schedule: "ring", "two_shot",
    #: "hierarchical"
    method: str
    wire: Optional[str]       #: the wire format, None when exact
    reason: str               #: why this path, in words
    exact_values: int = 0     #: values of flagged blocks (Inf/NaN) reduced exactly afterwards
    #: bytes this rank handed to MPI: counted for a schedule; for an exact
    #: call the bandwidth-optimal amount (MPI's own algorithm may send more)
    bytes_sent: int = 0
    seconds: float = 0.0      #: time the call ran (a nonblocking call: from when it started)


class Stats(NamedTuple):
    """Totals over a communicator's calls (``QuantizedComm.stats``)."""
    calls: int = 0
    quantized_calls: int = 0
    bytes_sent: int = 0           #: as CallInfo.bytes_sent, summed
    #: what the same calls would have sent uncompressed in the input's type,
    #: bandwidth-optimally: 2(P-1)/P of the message for an AllReduce,
    #: (P-1)/P for a Reduce_scatter_block or Allgather
    bytes_uncompressed: int = 0
    seconds: float = 0.0


def uncompressed_bytes(what, nbytes, P):
    """Bytes a rank sends in a bandwidth-optimal exact collective on
    ``nbytes`` (the whole message: P*m values for the two halves)."""
    share = 2 * (P - 1) if what == "Allreduce" else P - 1
    return nbytes * share // P


class _Counting(MPI.Intracomm):
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


class Call:
    """One checked and agreed call, ready to run (``_prepare``)."""
    __slots__ = ("what", "send", "recv", "op", "name", "method", "reason", "nbytes")

    def __init__(self, what, send, recv, op, name, method, reason, nbytes):
        self.what, self.send, self.recv, self.op = what, send, recv, op
        self.name, self.method, self.reason, self.nbytes = name, method, reason, nbytes

    @property
    def quantize(self):
        return self.method not in policy.EXACT


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

    Options (keywords; each also settable as EQUARX_MPI_<NAME>, see options.py):

    wire: "int8" (dynamic block-wise int8, the product); "int4" (half the
        bytes, about 15x the error), "fp8" (e4m3 codes), "int8-affine" and
        "int4-affine" (codes between each block's minimum and maximum, for
        data with an offset; docs/FORMAT.md); or the uncompressed baselines
        "bf16" (bfloat16; float16 input travels as float16) and "fp32".
        ``bits=4/8/16/32`` is the older spelling.
    block_size: values per block, a power of two from 32 to 4096; None (the
        default): the wire's own, 256 (int4 64, int4-affine 128).
    algorithm: "auto" (the default: per call, the method the cost model
        predicts fastest among those ``accuracy`` and the call allow; a
        profile measured by ``python -m equarx_mpi.tune``, or the built-in
        one: docs/TUNING.md), "ring" (pipelined reduce-scatter + all-gather,
        a value is quantized P times), "two_shot" (every shard sent to its
        owner, reduced there at full precision and all-gathered: twice at
        most; wires int8, bf16 and fp32), "hierarchical" (exact inside each
        node through a shared window, quantized between nodes: error of the
        node count; Allreduce across nodes of equal size, the halves use the
        ring), "shm" (exact, through a shared window, when all ranks share
        a node) or "mpi" (always MPI's own collective).
    accuracy: the error the caller accepts: None (the default: what the
        wire gives), "exact" (only exact methods), or the largest relative
        L2 error on standard-normal data (0.01 = 1%) by costmodel.error; a
        quantized method predicted above it is never taken, by any
        algorithm: the call is exact instead.
    chunks: pieces per shard for pipelining; None: one piece when all ranks
        share a node, else about 256 KiB of input per piece (at most 8).
    min_quantized_bytes: messages smaller than this (bytes per rank; for the
        two halves, the P*m-value buffer) use an exact method; None takes
        the measured default: 4 MiB on one node, 256 KiB across nodes, and
        under "auto" the cost model's crossover (``crossover()``).
    lossy_ops: the reductions that may travel quantized, from "sum", "max",
        "min"; default ("sum",): MAX and MIN are exact unless named here,
        and then MAX is never below (MIN never above) the true result.
    lossy_allgather: whether a wrapped communicator's Allgather may travel
        quantized (default False; QuantizedComm.Allgather, an explicit
        request, always may).
    check: agree on every call's arguments across ranks first (one tiny
        Allreduce), so mismatched or bad calls raise the same error
        everywhere instead of hanging.  Turn off only if the caller
        guarantees consistent calls.
    max_message_bytes: split messages above this size.

    After each call ``last_call`` (a CallInfo) says which path it took, what
    it sent and how long it ran; ``stats`` (a Stats) sums all calls.  With
    EQUARX_MPI_LOG=1 rank 0 logs every call's decision on stderr.
    """

    def __init__(self, comm, **opts):
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
        everyone = comm.allgather((None if err is None else (type(err).__name__, str(err)),
                                   {k: str(v) for k, v in o.items()}))
        raise_agreed("QuantizedComm", everyone)
        self.options = o
        self.wire, self.block_size = o["wire"], o["block_size"]
        self.algorithm, self.lossy_ops, self.check = o["algorithm"], o["lossy_ops"], o["check"]
        if os.environ.get("EQUARX_MPI_ABORT_ON_EXCEPTION", "1") != "0":
            abort_on_exception()
        self._comm = _Counting(comm).Dup()
        # Agreements go over their own communicator: the caller's thread
        # agrees on a new call while the progress thread may be running
        # earlier ones on _comm.
        self._ctl = self._comm.Dup()
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        compile_first = local.Get_rank() == 0
        local.Free()
        node = split_nodes(self._comm)      # the real node, or a faked layout
        sizes = self._comm.allgather(node.Get_size())
        leaders = len(set(self._comm.allgather(node.bcast(self._comm.Get_rank()))))
        #: where the ranks are (the same on every rank)
        self.layout = policy.Layout(leaders, node.Get_size(), len(set(sizes)) == 1)
        node.Free()
        #: all ranks on one node (shared memory)
        self.one_node = self.layout.one_node
        #: the profile algorithm="auto" and the crossovers decide with, and
        #: where it came from: rank 0's, so that every rank decides alike
        self.profile, self.profile_source = profiles.agreed(self._comm)
        P = self._comm.Get_size()
        # P // nodes, not this node's size: the same on every rank
        model = costmodel.Model(self.profile, self.layout.nodes, P // self.layout.nodes,
                                o["wire"], o["block_size"], o["chunks"])
        self._choose = policy.Chooser(o, P, self.layout, model)
        self._engine = Engine(self._comm, o, self.one_node, compile_first)
        self._compile_first = compile_first
        self._shm = self._hier = self._between = None    # made on first use (collective)
        self.last_call = None
        self._size = self._comm.Get_size()
        self._totals = [0, 0, 0, 0, 0.0]      # Stats' fields, summed
        self._lock = threading.Lock()
        self._log = options.logging() and self._comm.Get_rank() == 0
        self._exec = Executor(self._comm)

    @property
    def stats(self):
        """Totals over all calls so far (a Stats)."""
        with self._lock:
            return Stats(*self._totals)

    # --- lifetime -----------------------------------------------------------
    def free(self):
        """Collective: complete queued calls, release the duplicate
        communicators and workspace."""
        if self._comm is not None:
            self._exec.close()
            for part in (self._shm, self._between, self._hier):
                if part is not None:
                    part.free()
            self._engine.free()
            self._ctl.Free()
            self._comm.Free()
            self._comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    # --- public collectives ---------------------------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """recvbuf = op over ranks of sendbuf.  ``MPI.IN_PLACE`` as sendbuf (or
        the same array twice) reduces recvbuf in place.  Returns None."""
        self._exec.run(self._execute, self._prepare("Allreduce", sendbuf, recvbuf, op))

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Nonblocking Allreduce: returns a request (an MPI.Grequest: Wait,
        Test, MPI.Request.Waitall).  The arguments are checked and agreed
        now; the call runs in the progress thread (nonblocking.py).  Leave
        the buffers alone until the request completes."""
        return self._exec.submit(self._execute, self._prepare("Allreduce", sendbuf, recvbuf, op))

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM):
        """Persistent Allreduce: checks, agreement and the choice of path
        happen once, here; each ``Start()`` of the returned request queues
        the call, ``Wait()`` completes it (nonblocking.PersistentRequest)."""
        return PersistentRequest(self._exec, self._execute,
                                 self._prepare("Allreduce", sendbuf, recvbuf, op))

    def allreduce(self, x, op=MPI.SUM):
        """A new array with x's shape and dtype holding op over ranks of x."""
        x = np.asarray(x)
        x = np.ascontiguousarray(x).reshape(x.shape)    # keeps 0-d as 0-d
        out = np.empty_like(x)
        self.Allreduce(x, out, op)
        return out

    def empty(self, shape, dtype=np.float32):
        """Collective: an uninitialised array to reduce with ``algorithm="shm"``.
        On one node it lives in the shared window, so an Allreduce with it as
        sendbuf (or recvbuf, in place) skips the copy in; every call returns
        the same memory (one such buffer at a time), valid until free().
        Elsewhere, or for types the window does not reduce, a plain array."""
        dtype = np.dtype(dtype)
        if self.layout.one_node and self._size > 1 and (dtype.kind == "f" or dtype == BFLOAT16) \
                and dtype.itemsize <= 8:
            return self._window().empty(shape, dtype)
        return np.empty(shape, dtype)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """recvbuf (m values) = op over ranks of block ``rank`` of sendbuf
        (P*m values).  With ``MPI.IN_PLACE`` the input is recvbuf (P*m values)
        and the result goes to its first m.  The result is not requantized:
        it is the full-precision reduction of the quantized partial sums."""
        self._exec.run(self._execute,
                       self._prepare("Reduce_scatter_block", sendbuf, recvbuf, op))

    def Allgather(self, sendbuf, recvbuf):
        """recvbuf (P*m values) = the m values of every rank, quantized once
        by their owner; the owner's own block is the dequantized form too, so
        recvbuf is identical on every rank.  ``MPI.IN_PLACE``: rank r's values
        are read from block r of recvbuf."""
        self._exec.run(self._execute, self._prepare("Allgather", sendbuf, recvbuf, None))

    # --- internals --------------------------------------------------------------
    def _prepare(self, what, sendbuf, recvbuf, op, opaque_ok=False):
        """Checks agreed across ranks, and the choice of path: a Call.
        With opaque_ok (a wrapped communicator) a buffer only MPI can read
        gives a Call with recv OPAQUE, for MPI to run unchanged."""
        if self._comm is None:
            raise ValueError("equarx_mpi: this QuantizedComm has been freed")
        P = self._size
        send, recv, meta, err = check_buffers(what, sendbuf, recvbuf, op, P, opaque_ok)
        name = "sum" if what == "Allgather" else (
            op_name(op) if isinstance(op, MPI.Op) else None)
        method, reason, nbytes = "mpi", "device memory or a derived datatype: MPI unchanged", 0
        if err is None and recv is not OPAQUE:
            nbytes = dict(meta)["count"] * recv.dtype.itemsize
            if nbytes == 0:
                reason = "empty message"
            else:
                method, reason = self._choose(what, name, recv.dtype, nbytes)
        # a window buffer or none, on every rank (shm.py's base); a field for
        # every method, so that a rank whose checks failed (method "mpi")
        # agrees with the same number of fields as the others
        meta = meta + [("window buffer", int(method == "shm" and self._shm is not None and
                                             self._shm.is_window_buffer(
                                                 recv if send is None else send)))]
        if self.check:   # the path too: EQUARX_MPI_DISABLE could differ between ranks
            agree(self._ctl, what, meta + [("method", method)], err)
        elif err is not None:
            raise err
        return Call(what, send, recv, op, name, method, reason, nbytes)

    def crossover(self, dtype=np.float32, what="Allreduce", op=MPI.SUM, upto=1 << 31):
        """The smallest message (bytes per rank) from which calls of this
        kind are quantized, or None if none up to ``upto`` is (local: no
        communication; every rank answers alike)."""
        return self._choose.crossover(what, op_name(op), np.dtype(dtype), upto)

    def _execute(self, c):
        """Run a prepared call on the library's communicator; its CallInfo."""
        t0, sent0, P = time.perf_counter(), self._comm.sent, self._size
        self._comm.polite = self._exec.in_thread()
        if c.quantize:
            fixed = self._quantized(c)
            return self._record(c, CallInfo(c.what, c.method, self.wire, c.reason, fixed,
                                            self._comm.sent - sent0, time.perf_counter() - t0))
        if c.method == "shm":
            self._window().allreduce(c.send, c.recv, c.op)
        elif P == 1:
            if c.send is not None:
                c.recv[...] = c.send
        elif c.what == "Allgather":
            exact.gather(self._comm, c.send, c.recv)
        else:
            exact.collective(self._comm, c.what, c.send, c.recv, c.op)
        return self._record(c, CallInfo(c.what, c.method, None, c.reason, 0,
                                        uncompressed_bytes(c.what, c.nbytes, P),
                                        time.perf_counter() - t0))

    def _timed(self, c, fn):
        """fn(): MPI's own call for c, made by a wrapped communicator with
        the caller's arguments; recorded like any call."""
        t0 = time.perf_counter()
        result = fn()
        self._record(c, CallInfo(c.what, "mpi", None, c.reason, 0,
                                 uncompressed_bytes(c.what, c.nbytes, self._size),
                                 time.perf_counter() - t0))
        return result

    def _record(self, c, info):
        """Note a finished call: last_call, the totals, the log line."""
        with self._lock:
            t = self._totals
            t[0] += 1
            t[1] += bool(c.quantize)
            t[2] += info.bytes_sent
            t[3] += uncompressed_bytes(c.what, c.nbytes, self._size)
            t[4] += info.seconds
            self.last_call = info
        if self._log:
            what = "?" if c.recv is OPAQUE else f"{c.nbytes} B {c.recv.dtype.name}"
            path = f"{info.method}/{info.wire}" if info.wire else info.method
            op = "" if c.what == "Allgather" else f" {c.name.upper()}"
            sys.stderr.write(f"equarx_mpi: {c.what} {what}{op} -> "
                             f"{path} ({info.reason}), {info.seconds * 1e3:.3f} ms, "
                             f"{info.bytes_sent} B sent\n")
        return info

    def _quantized(self, c):
        """Run a quantized call; returns the values reduced exactly after it."""
        e = self._engine
        if c.what == "Allgather":
            return e.allgather(c.send, c.recv)
        if c.what == "Reduce_scatter_block":
            return e.reduce_scatter(c.method, c.send, c.recv, c.name, c.op)
        if c.method != "hierarchical":
            return e.allreduce(c.method, c.send, c.recv, c.name, c.op)
        hier, between = self._hierarchy()
        fixed = [0]

        def across(comm, mine):
            fixed[0] += between.allreduce(_INNER[self.wire in formats.MANY_INPUT_WIRES], None,
                                          mine.reshape(-1), c.name, c.op)
        hier.allreduce(c.recv if c.send is None else c.send, c.recv, c.op, across)
        return fixed[0]

    def _window(self):
        """The shared window of the exact one-node method (made on first use)."""
        if self._shm is None:
            from .shm import ShmAllreduce
            self._shm = ShmAllreduce(self._comm)
        return self._shm

    def _hierarchy(self):
        """The node-aware schedule and the engine between nodes (made on
        first use)."""
        if self._hier is None:
            from .hierarchical import Hierarchy
            self._hier = Hierarchy(self._comm)
            self._between = Engine(self._hier.inter, self.options, False, self._compile_first)
        return self._hier, self._between


#: the schedule between nodes: two-shot where the wire has many-input kernels
_INNER = {True: "two_shot", False: "ring"}
