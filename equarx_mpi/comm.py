"""The public edge: QuantizedComm.  Arguments are checked (validate.py) and
agreed across ranks (agree.py), the method is chosen (policy.py), then a
schedule (ring.py) or exact MPI (exact.py) runs."""
import collections
import os
from typing import NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from . import exact, formats, options, policy, ring, two_shot
from .agree import abort_on_exception, agree, raise_agreed
from .validate import BFLOAT16, check_buffers, op_name

_PLAN_CACHE = 8


class CallInfo(NamedTuple):
    """What the last call did (``QuantizedComm.last_call``)."""
    call: str                 #: "Allreduce", "Reduce_scatter_block" or "Allgather"
    method: str               #: "mpi" (the exact MPI collective), "copy" (one rank) or the schedule
    wire: Optional[str]       #: the wire format, None when exact
    reason: str               #: why this path, in words
    exact_values: int = 0     #: values of flagged blocks (Inf/NaN) reduced exactly afterwards


def _kernel_view(a, writable):
    """1-D view of a C-contiguous array in the kernels' element type."""
    v = a.reshape(-1)
    if v.dtype == np.float16:
        v = v.view(np.int16)
    elif v.dtype == BFLOAT16:
        v = v.view(np.uint16)
    else:
        v = v.view()
    if not writable:
        v.flags.writeable = False
    return v


class QuantizedComm:
    """AllReduce and its halves on ``comm``, sending block-quantized data.

    Collective: every rank of ``comm`` creates it with the same options.
    Traffic goes over a duplicate of ``comm``, so it never matches the
    caller's messages.  ``free()`` (or leaving a ``with`` block) releases it.

    Options (keywords; each also settable as EQUARX_MPI_<NAME>, see options.py):

    wire: "int8" (dynamic block-wise int8, the product); "int4" (half the
        bytes, about 15x the error), "fp8" (e4m3 codes), "int8-affine" and
        "int4-affine" (codes between each block's minimum and maximum, for
        data with an offset; docs/FORMAT.md); or the uncompressed baselines
        "bf16" (bfloat16; float16 input travels as float16) and "fp32".
        ``bits=4/8/16/32`` is the older spelling.
    block_size: values per block, a power of two from 32 to 4096; None (the
        default): the wire's own, 256 (int4 64, int4-affine 128).
    algorithm: "ring" (pipelined reduce-scatter + all-gather, a value is
        quantized P times) or "two_shot" (every shard sent to its owner,
        reduced there at full precision and all-gathered: twice at most;
        wires int8, bf16 and fp32).
    chunks: pieces per shard for pipelining; None: one piece when all ranks
        share a node, else about 256 KiB of input per piece (at most 8).
    min_quantized_bytes: messages smaller than this (bytes per rank; for the
        two halves, the P*m-value buffer) use the exact MPI collective; None
        takes the measured default: 4 MiB on one node, 256 KiB across nodes.
    lossy_ops: the reductions that may travel quantized, from "sum", "max",
        "min"; default ("sum",): MAX and MIN are exact unless named here,
        and then MAX is never below (MIN never above) the true result.
    check: agree on every call's arguments across ranks first (one tiny
        Allreduce), so mismatched or bad calls raise the same error
        everywhere instead of hanging.  Turn off only if the caller
        guarantees consistent calls.
    max_message_bytes: split messages above this size.

    After each call ``last_call`` (a CallInfo) says which path it took.
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
        self._comm = comm.Dup()
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        self._compile_first = local.Get_rank() == 0
        #: all ranks on one node (shared memory); the same answer on every rank
        self.one_node = local.Get_size() == self._comm.Get_size()
        local.Free()
        self.min_quantized_bytes = policy.min_quantized_bytes(o, self.one_node)
        self.last_call = None
        self._formats = {}
        self._plans = collections.OrderedDict()
        self._ws = np.empty(0, np.uint8)

    # --- lifetime -----------------------------------------------------------
    def free(self):
        """Collective: release the duplicate communicator and workspace."""
        if self._comm is not None:
            self._comm.Free()
            self._comm = None
            self._plans.clear()
            self._ws = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    # --- public collectives ---------------------------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """recvbuf = op over ranks of sendbuf.  ``MPI.IN_PLACE`` as sendbuf (or
        the same array twice) reduces recvbuf in place.  Returns None."""
        send, recv, name = self._begin("Allreduce", sendbuf, recvbuf, op)
        if name is None:
            return
        own = recv if send is None else send
        n, B, P = recv.size, self.block_size, self._comm.Get_size()
        nb = -(-n // B)
        edges = [min(s * nb // P * B, n) for s in range(P + 1)]
        shards = [(edges[s], edges[s + 1] - edges[s]) for s in range(P)]
        ranges = self._run("allreduce", shards, own, recv, name, 0, 0)
        self._exact_after(exact.fix_allreduce(self._comm, ranges, own.reshape(-1),
                                              recv.reshape(-1), op))

    def allreduce(self, x, op=MPI.SUM):
        """A new array with x's shape and dtype holding op over ranks of x."""
        x = np.asarray(x)
        x = np.ascontiguousarray(x).reshape(x.shape)    # keeps 0-d as 0-d
        out = np.empty_like(x)
        self.Allreduce(x, out, op)
        return out

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """recvbuf (m values) = op over ranks of block ``rank`` of sendbuf
        (P*m values).  With ``MPI.IN_PLACE`` the input is recvbuf (P*m values)
        and the result goes to its first m.  The result is not requantized:
        it is the full-precision reduction of the quantized partial sums."""
        send, recv, name = self._begin("Reduce_scatter_block", sendbuf, recvbuf, op)
        if name is None:
            return
        P, r = self._comm.Get_size(), self._comm.Get_rank()
        own = recv if send is None else send
        m = own.size // P
        # in place the result is staged, so the input survives for a fix-up
        out = recv.reshape(-1)[:m] if send is not None else np.empty(m, recv.dtype)
        ranges = self._run("reduce_scatter", [(s * m, m) for s in range(P)], own, out,
                           name, 0, r * m)
        self._exact_after(exact.fix_reduce_scatter(self._comm, ranges, own.reshape(-1),
                                                   out, op, r, m))
        if send is None:
            recv.reshape(-1)[:m] = out

    def Allgather(self, sendbuf, recvbuf):
        """recvbuf (P*m values) = the m values of every rank, quantized once
        by their owner; the owner's own block is the dequantized form too, so
        recvbuf is identical on every rank.  ``MPI.IN_PLACE``: rank r's values
        are read from block r of recvbuf."""
        send, recv, name = self._begin("Allgather", sendbuf, recvbuf, None)
        if name is None:
            return
        P, r = self._comm.Get_size(), self._comm.Get_rank()
        m = recv.size // P
        flat = recv.reshape(-1)
        own = flat[r * m:(r + 1) * m] if send is None else send.reshape(-1)
        ranges = self._run("allgather", [(s * m, m) for s in range(P)], own, recv,
                           "sum", r * m, 0)
        self._exact_after(exact.fix_allgather(self._comm, ranges, own, flat, r))

    # --- internals --------------------------------------------------------------
    def _begin(self, what, sendbuf, recvbuf, op):
        """Checks agreed across ranks, then the choice of path.  Runs the
        exact path (or the one-rank copy) itself and returns name None;
        else (send or None for in place, recv, op name) for a quantized run."""
        if self._comm is None:
            raise ValueError("equarx_mpi: this QuantizedComm has been freed")
        P = self._comm.Get_size()
        send, recv, meta, err = check_buffers(what, sendbuf, recvbuf, op, P)
        name = "sum" if what == "Allgather" else (
            op_name(op) if isinstance(op, MPI.Op) else None)
        quantize, reason = False, ""
        if err is None:
            nbytes = dict(meta)["count"] * recv.dtype.itemsize
            quantize, reason = policy.choose(self.options, what, name, recv.dtype, nbytes,
                                             P, self.one_node)
        if self.check:   # the path too: EQUARX_MPI_DISABLE could differ between ranks
            agree(self._comm, what, meta + [("quantized", int(quantize))], err)
        elif err is not None:
            raise err
        if quantize:
            self.last_call = CallInfo(what, self.algorithm, self.wire, reason)
            return send, recv, name
        self.last_call = CallInfo(what, "copy" if P == 1 else "mpi", None, reason)
        if P == 1:
            if send is not None:
                recv[...] = send.reshape(recv.shape)
        elif what == "Allgather":
            exact.gather(self._comm, send, recv)
        else:
            exact.collective(self._comm, what, send, recv, op)
        return send, recv, None

    def _exact_after(self, count):
        if count:
            self.last_call = self.last_call._replace(exact_values=count)

    def _format(self, kdtype):
        fmt = self._formats.get(kdtype.str)
        if fmt is None:
            fmt = formats.make_format(self.wire, self.block_size, kdtype)
            # One rank per node compiles into numba's on-disk cache first, so
            # ranks never write the same cache entries at once.
            if self._compile_first:
                _warm(fmt, kdtype, self.algorithm)
            self._comm.Barrier()
            if not self._compile_first:
                _warm(fmt, kdtype, self.algorithm)
            self._formats[kdtype.str] = fmt
        return fmt

    def _workspace(self, nbytes):
        if self._ws.size < nbytes:
            self._plans.clear()
            self._ws = np.empty(nbytes, np.uint8)
        return self._ws

    def _run(self, kind, shards, own, out, name, own_offset, out_offset):
        """Run the quantized schedule; own and out are the caller's arrays."""
        own = _kernel_view(own, writable=False)
        out = _kernel_view(out, writable=True)
        fmt = self._format(own.dtype)
        biggest = max(length for _, length in shards) * own.dtype.itemsize
        chunks = policy.chunks(self.options, self.one_node, biggest)
        key = (kind, tuple(shards), chunks, own.dtype.str)
        # Allgather quantizes each value once already: every algorithm
        # forwards it around the ring
        schedule = two_shot if self.algorithm == "two_shot" and kind != "allgather" else ring
        plan = self._plans.get(key)
        if plan is None:
            plan = schedule.Plan(kind, fmt, shards, self._comm.Get_rank(), chunks,
                                 self.block_size, self.options["max_message_bytes"],
                                 self._workspace)
            self._plans[key] = plan
            while len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return schedule.run(self._comm, plan, fmt, own, out, policy.KERNEL_OP[name],
                            policy.ROUNDING[name], own_offset, out_offset)


def _warm(fmt, kdtype, algorithm):
    """Compile (or load from cache) every kernel of a format for one element
    type, with the array layouts the schedule ``algorithm`` uses."""
    src = np.zeros(2 * fmt.block + 3, kdtype)
    src.flags.writeable = False
    out = np.zeros_like(src)
    w = fmt.views(np.zeros(fmt.nbytes(src.size), np.uint8), src.size)
    fmt.encode(src, w, policy.ROUNDING["sum"])
    fmt.decode(w, out)
    fmt.decode_reduce(src, w, out, policy.KERNEL_OP["sum"])
    fmt.decode_reduce_encode(src, w, w, policy.KERNEL_OP["sum"], policy.ROUNDING["sum"])
    if algorithm == "two_shot":
        two_shot.warm(fmt, kdtype)
