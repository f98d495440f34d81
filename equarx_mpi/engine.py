"""Quantized schedules on one communicator: a format per input type, a plan
per message shape, one workspace, the exact fix-up of flagged blocks, and
the error bound of each call (bound.py).  QuantizedComm runs one on its
duplicate of the caller's communicator; the hierarchical schedule one more
on the communicator between nodes."""
import collections
import math

import numpy as np

from . import bound, exact, formats, policy, ring, two_shot
from . import kernels as K
from .validate import BFLOAT16

#: the quantized schedules, by algorithm name
SCHEDULES = {"ring": ring, "two_shot": two_shot}
_PLAN_CACHE = 8


def kernel_view(a, writable):
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


def warm(fmt, kdtype):
    """Compile (or load from numba's cache) every kernel the schedules use
    for one format and element type, with the array layouts they use."""
    src = np.zeros(2 * fmt.block + 3, kdtype)
    src.flags.writeable = False
    out = np.zeros_like(src)
    w = fmt.views(np.zeros(fmt.nbytes(src.size), np.uint8), src.size)
    fmt.encode(src, w, policy.ROUNDING["sum"])
    fmt.decode(w, out)
    if hasattr(fmt, "decode_reduce"):         # not "mixed": two-shot only
        fmt.decode_reduce(src, w, out, policy.KERNEL_OP["sum"])
        fmt.decode_reduce_encode(src, w, w, policy.KERNEL_OP["sum"], policy.ROUNDING["sum"])
    fmt.piece_error(w, policy.ROUNDING["sum"])
    if hasattr(fmt, "decode_reduce_many"):
        two_shot.warm(fmt, kdtype)
    bound.warm()


class Engine:
    """Runs the quantized collectives of ``opts`` on ``comm`` (which must not
    carry other traffic of the same tag).  ``compile_first``: this rank
    compiles the kernels before the others of its node read numba's cache.

    Each collective returns (values reduced exactly afterwards, error
    bound): the bound, the same on every rank, holds for every value of the
    result that is finite (docs/ERROR.md); ``record`` (a bound.Record) then
    gives it per block, until the next call.  ``keep_bounds = False`` skips
    the bookkeeping (bound NaN): only to measure what it costs."""
    keep_bounds = True

    def __init__(self, comm, opts, one_node, compile_first):
        self.comm, self.opts, self.one_node = comm, opts, one_node
        self.compile_first = compile_first
        self.P, self.rank = comm.Get_size(), comm.Get_rank()
        self._formats = {}
        self._plans = collections.OrderedDict()
        self._ws = np.empty(0, np.uint8)
        self.record = None
        #: the error-bounded mode's tolerance.Budget of the next call (its
        #: "mixed" format's), set by QuantizedComm
        self.budget = None

    def free(self):
        self._plans.clear()
        self._ws = None

    def allreduce(self, algorithm, send, recv, name, op, e_own=0.0, feedback=None,
                  fix_up=True):
        """recv = op over ranks of send (None: recv's values); flat arrays.
        ``e_own`` bounds the error this rank's input already carries;
        ``feedback`` (an ErrorFeedback) notes what each quantization lost.
        ``fix_up=False`` leaves the flagged blocks as they are, for the
        caller to reduce from other values than send's (the hierarchical
        schedule's): returns (their ranges, the bound of the others)."""
        own = recv if send is None else send
        n, B, P = recv.size, self.opts["block_size"], self.P
        nb = -(-n // B)
        edges = [min(s * nb // P * B, n) for s in range(P + 1)]
        shards = [(edges[s], edges[s + 1] - edges[s]) for s in range(P)]
        ranges, tally = self._run(algorithm, "allreduce", shards, own, recv, name, 0, 0, e_own,
                                  feedback)
        if not fix_up:
            return ranges, self._bound(tally, 0.0, n, 0)
        fixed, fix = exact.fix_allreduce(self.comm, ranges, own, recv, op, e_own)
        return fixed, self._bound(tally, fix, n, 0)

    def reduce_scatter(self, algorithm, send, recv, name, op):
        P, r = self.P, self.rank
        own = recv if send is None else send
        m = own.size // P
        # in place the result is staged, so the input survives for a fix-up
        out = recv[:m] if send is not None else np.empty(m, recv.dtype)
        ranges, tally = self._run(algorithm, "reduce_scatter", [(s * m, m) for s in range(P)],
                                  own, out, name, 0, r * m)
        # each rank's result is its own: the fix-up's agreement shares the bounds
        fixed, fix, most = exact.fix_reduce_scatter(self.comm, ranges, own, out, op, r, m,
                                                    tally.finish() if tally else 0.0)
        if send is None:
            recv[:m] = out
        self._set_record(tally, fix, m, r * m)
        return fixed, math.nan if tally is None else max(most, fix)

    def allgather(self, send, recv):
        """Each value is quantized once by its owner: every algorithm forwards
        the bytes around the ring."""
        P, r = self.P, self.rank
        m = recv.size // P
        own = recv[r * m:(r + 1) * m] if send is None else send
        ranges, tally = self._run("ring", "allgather", [(s * m, m) for s in range(P)], own,
                                  recv, "sum", r * m, 0)
        # flagged blocks travel exactly (their owner's bits)
        return exact.fix_allgather(self.comm, ranges, own, recv, r), self._bound(
            tally, 0.0, recv.size, 0)

    def _set_record(self, tally, fix, n, offset):
        """Keep what the per-block bounds of this call need; whether any."""
        self.record = None if tally is None else bound.Record(
            n, self.opts["block_size"], lambda: tally.segments(fix), offset)
        return tally is not None

    def _bound(self, tally, fix, n, offset):
        """The call's bound: its schedule's and its fix-up's."""
        if not self._set_record(tally, fix, n, offset):
            return math.nan
        return max(tally.finish(), fix)

    def _format(self, kdtype):
        fmt = self._formats.get(kdtype.str)
        if fmt is None:
            fmt = formats.make_format(self.opts["wire"], self.opts["block_size"], kdtype)
            # One rank per node compiles into numba's on-disk cache first, so
            # ranks never write the same cache entries at once.
            if self.compile_first:
                warm(fmt, kdtype)
            self.comm.Barrier()
            if not self.compile_first:
                warm(fmt, kdtype)
            self._formats[kdtype.str] = fmt
        return fmt

    def _workspace(self, nbytes):
        if self._ws.size < nbytes:
            self._plans.clear()
            self._ws = np.empty(nbytes, np.uint8)
        return self._ws

    def _run(self, algorithm, kind, shards, own, out, name, own_offset, out_offset,
             e_own=0.0, feedback=None):
        """Run a schedule; own and out are the caller's arrays.  Returns the
        flagged ranges and the bound.Tally (None without keep_bounds)."""
        own = kernel_view(own, writable=False)
        out = kernel_view(out, writable=True)
        fmt = self._format(own.dtype)
        biggest = max(length for _, length in shards) * own.dtype.itemsize
        chunks = policy.chunks(self.opts, self.one_node, biggest)
        schedule = SCHEDULES[algorithm]
        key = (algorithm, kind, tuple(shards), chunks, own.dtype.str)
        plan = self._plans.get(key)
        if plan is None:
            plan = schedule.Plan(kind, fmt, shards, self.rank, chunks, self.opts["block_size"],
                                 self.opts["max_message_bytes"], self._workspace)
            self._plans[key] = plan
            while len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        rmode = policy.rounding(self.opts, name)
        if rmode == K.ROUND_STOCHASTIC:
            fmt.begin_call(self.opts["seed"], self.rank, own, own_offset)
        fmt.budget = self.budget
        tally = bound.Tally(fmt, own.dtype, name == "sum", rmode, e_own) \
            if self.keep_bounds else None
        if feedback is not None:
            fmt = feedback.format(fmt, own, out)
        ranges = schedule.run(self.comm, plan, fmt, own, out, policy.KERNEL_OP[name], rmode,
                              own_offset, out_offset, tally)
        return ranges, tally
