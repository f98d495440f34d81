"""Quantized schedules on one communicator: a format per input type, a route
per message shape, one workspace, the exact fix-up of flagged blocks, and
the error bound of each call (bound.py).  QuantizedComm runs one on its
duplicate of the caller's communicator; the hierarchical schedule one more
on the communicator between nodes."""
import collections
import math

import numpy as np

from equarx_mpi.bounds import bound
from equarx_mpi.bounds.measured import Measured
from equarx_mpi.collectives import exact, rotation
from equarx_mpi.collectives.nodes import in_turn
from equarx_mpi.collectives.pieces import chunks as pieces_per_shard
from equarx_mpi.collectives.pieces import fail
from equarx_mpi.collectives.registry import SCHEDULES
from equarx_mpi.names import (
    KERNEL_OP,
    ROUND_NEAREST,
    ROUND_STOCHASTIC,
    ROUNDING,
    acc_dtype,
    kernel_view,
    rounding,
    workspace,
)
from equarx_mpi.wire import formats
from equarx_mpi.wire.threaded import Threaded
from equarx_mpi.wire.watched import Watched

_ROUTE_CACHE = 8

#: what each schedule the engine runs needs, per kind of collective: the
#: format's kernels its run() calls (the schedules' declarations)
NEEDS = {(name, kind): kernels for name, sched in SCHEDULES.items()
         for kind, kernels in sched.needs.items()}


def warm(fmt, kdtype, algorithm=None, kind=None, P=3, rmodes=None):
    """Compile (or load from numba's cache) the kernels ``algorithm`` runs
    for ``kind`` on P ranks with the roundings ``rmodes``, for one format
    and element type, with the array layouts the schedules use; None:
    every schedule's, and rounding to nearest only (the library's
    defaults quantize only sums, rounded to nearest).  Only what a call
    runs: a kernel signature costs up to a second to compile
    (docs/PERFORMANCE.md "Cold start"); int8's kernels compile rounding to
    nearest apart from the other roundings."""
    if algorithm is None:
        needs = {n for key, ns in NEEDS.items() for n in ns}
        counts = (1, 2)
    else:
        needs = set(NEEDS[algorithm, kind])
        # one received message (2 ranks) gives contiguous header views,
        # more give strided ones: another signature
        counts = (min(P - 1, 2),)
    bound.warm((np.dtype(kdtype),))      # the tally's magnitude pass
    n = 2 * fmt.block + 3
    src = np.zeros(n, kdtype)
    src.flags.writeable = False
    out = np.zeros_like(src)
    w = fmt.views(np.zeros(fmt.nbytes(n), np.uint8), n)
    sum_, nearest = KERNEL_OP["sum"], ROUNDING["sum"]
    # up stands for every rounding but nearest (the same kernels; up needs
    # no stochastic stream)
    rmodes = {nearest if r == nearest else ROUNDING["max"] for r in rmodes or (nearest,)}
    if fmt.name == "mixed":
        rmodes = (nearest,)                   # the mode rounds to nearest only
    for rmode in rmodes:
        fmt.encode(src, w, rmode)
        if "decode_reduce_encode" in needs and hasattr(fmt, "decode_reduce_encode"):
            fmt.decode_reduce_encode(src, w, w, sum_, rmode)
    if "decode" in needs:
        fmt.decode(w, out)
    if "decode_reduce" in needs and hasattr(fmt, "decode_reduce"):   # not "mixed"
        fmt.decode_reduce(src, w, out, sum_)
    fmt.piece_error(w, nearest)
    if "partial" in needs and hasattr(fmt, "decode_reduce"):
        # partial sums in an accumulator (rabenseifner.py), read through a
        # read-only view: for float32/float64 the ring's signatures, for
        # 16-bit input float32's and two of its own
        acc = np.zeros(n, acc_dtype(kdtype))
        ro = acc.view()
        ro.flags.writeable = False
        bound.warm((acc.dtype,))
        fmt.decode_reduce(src, w, acc, sum_)
        fmt.decode_reduce(ro, w, acc, sum_)
        fmt.decode_reduce(ro, w, out, sum_)
        for rmode in rmodes:
            fmt.decode_reduce_encode(ro, w, w, sum_, rmode, at=src)
    for count in counts if hasattr(fmt, "decode_reduce_many") else ():
        stack = fmt.stack_views(np.zeros(count * fmt.nbytes(n), np.uint8), n, count)
        if "decode_reduce_many" in needs:
            fmt.decode_reduce_many(src, 1, stack, out, sum_)
        for rmode in rmodes if "decode_reduce_encode_many" in needs else ():
            fmt.decode_reduce_encode_many(src, 1, stack, w, sum_, rmode)


class Engine:
    """Runs the quantized collectives of ``opts`` on ``comm`` (which must not
    carry other traffic of the same tag).  ``compile_first``: this rank
    compiles the kernels before the others of its node read numba's cache.
    ``threads``: how many threads run each kernel (wire/threaded.py).

    Each collective returns (values reduced exactly afterwards, error
    bound): the bound, the same on every rank, holds for every value of the
    result that is finite (docs/ERROR.md); ``record`` (a bound.Record) then
    gives it per block, until the next call."""

    def __init__(self, comm, opts, one_node, compile_first, threads=1):
        self.comm, self.opts, self.one_node = comm, opts, one_node
        self.threads = threads
        self.compile_first = compile_first
        self.P, self.rank = comm.Get_size(), comm.Get_rank()
        self._formats = {}
        #: (algorithm, kind, element type, rounding to nearest) whose
        #: kernels are compiled
        self._warm = set()
        self._routes = collections.OrderedDict()
        self._ws = np.empty(0, np.uint8)
        self._tmp = {}         # the watched formats' workspaces, by accumulation type
        self.record = None
        #: the error-bounded mode's tolerance.Budget of the next call (its
        #: "mixed" format's), set by QuantizedComm
        self.budget = None
        rot, B = opts.get("rotate") or 0, opts["block_size"]
        #: the rotation of SUM calls (option rotate), or None; with
        #: rotate="auto" ``active`` is set per call (running.py), else it is this
        self.rotation = rotation.Rotation(rot if _is_size(rot) else B, opts["seed"],
                                          B) if rot else None
        self.auto = rot == "auto"
        self.active = None if self.auto else self.rotation

    def free(self):
        self._routes.clear()
        self._ws = None
        self._tmp.clear()
        if self.rotation is not None:
            self.rotation.free()

    def rotation_errors(self, x):
        """rotate="auto"'s evidence on x (a rank's input): rotation.errors
        through the wire's format for x's accumulation type."""
        acc = np.dtype(acc_dtype(x.dtype))
        fmt = self._format(acc, None, "allreduce", ROUND_NEAREST, False)
        return rotation.errors(x, fmt, self.rotation)

    def rotates(self, name):
        """Whether a call of op ``name`` runs rotated."""
        return self.active is not None and name == "sum"

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
        if self.rotates(name):
            return self._allreduce_rotated(algorithm, shards, own, recv, op, e_own, feedback,
                                           fix_up)
        ranges, tally = self._run(algorithm, "allreduce", shards, own, recv, name, 0, 0, e_own,
                                  feedback)
        if not fix_up:
            return ranges, self._bound(tally, 0.0, n, 0)
        fixed, fix = exact.fix_allreduce(self.comm, ranges, own, recv, op, e_own)
        return fixed, self._bound(tally, fix, n, 0)

    def _allreduce_rotated(self, algorithm, shards, own, recv, op, e_own, feedback, fix_up):
        """allreduce on the rotated input (collectives/rotation.py): the
        result rotated back into recv; flagged and risky blocks exact, from
        own (the caller's values)."""
        rot, n, B = self.active, recv.size, self.opts["block_size"]
        y = rot.buffer(n, recv.dtype)
        # an error on the input is at most sqrt(S) times larger rotated
        e_y = rot.forward(own, y) + math.sqrt(rot.size) * e_own
        if feedback is not None:
            e_y += feedback.begin_rotated(y, recv.dtype)
        ranges, tally = self._run(algorithm, "allreduce", shards, y, y, "sum", 0, 0, e_y,
                                  feedback, rotated=True)
        e = tally.finish()
        ranges, mags = self._back(y, recv, ranges, 0)
        if feedback is not None:
            feedback.end(y, ranges)
        exact_blocks = _blocks_of(ranges, B, 0)
        x_e = rot.x_bound(e, float(mags.max(initial=0.0)), recv.dtype)
        fixed, fix = 0, 0.0
        if fix_up:
            fixed, fix = exact.fix_allreduce(self.comm, ranges, own, recv, op, e_own)
        self._rotated_record(tally, mags, exact_blocks, fix, n, 0, recv.dtype)
        return (fixed if fix_up else ranges), max(x_e, fix)

    def _back(self, z, out, ranges, lo):
        """out = z (a rotated result: values lo .. lo + z.size) rotated
        back, but the blocks that go exact: those ``ranges`` touch and those
        whose rotation back could overflow, which keep out's values (in
        place, the caller's own, for the fix-up).  Returns (ranges with the
        latter added, z's block magnitudes with the exact blocks' zero)."""
        B, hi = self.opts["block_size"], lo + z.size

        def here(rs):
            return _blocks_of([(max(a, lo), min(b, hi)) for a, b in rs if a < hi and b > lo],
                              B, lo)
        mags, risky = self.active.back(z, out, here(ranges), lo)
        ranges = rotation.add_blocks(ranges, risky, B, z.size, lo)
        mags[here(ranges)] = 0.0
        return ranges, mags

    def _rotated_record(self, tally, mags, exact_blocks, fix, n, offset, dtype):
        """The per-block bounds of a rotated call: the schedule's, on the
        rotated values, carried back (rotation.py); ``fix`` on exact blocks."""
        B, rot = self.opts["block_size"], self.active

        def blocks():
            xb = rot.x_bound(bound.to_blocks(tally.segments(0.0), n, B, offset), mags, dtype)
            xb[exact_blocks] = fix
            return [(offset, offset + n, xb)]
        self.record = bound.Record(n, B, blocks, offset)

    def reduce_scatter(self, algorithm, send, recv, name, op):
        P, r = self.P, self.rank
        own = recv if send is None else send
        m = own.size // P
        # in place the result is staged, so the input survives for a fix-up
        out = recv[:m] if send is not None else np.empty(m, recv.dtype)
        shards = [(s * m, m) for s in range(P)]
        rot = self.active if self.rotates(name) else None
        if rot is None:
            ranges, tally = self._run(algorithm, "reduce_scatter", shards, own, out, name, 0,
                                      r * m)
            local = tally.finish()
        else:
            y, z = rot.buffer(own.size, own.dtype), rot.buffer(m, own.dtype, 1)
            # each shard rotated on its own
            e_y = max((rot.forward(own[lo:lo + m], y[lo:lo + m], lo) for lo, _ in shards),
                      default=0.0)
            ranges, tally = self._run(algorithm, "reduce_scatter", shards, y, z, name, 0,
                                      r * m, e_y, rotated=True)
            ranges, mags = self._back(z, out, ranges, r * m)
            exact_blocks = _blocks_of(ranges, self.opts["block_size"], r * m)
            local = rot.x_bound(tally.finish(), float(mags.max(initial=0.0)), out.dtype)
        # each rank's result is its own: the fix-up's agreement shares the bounds
        fixed, fix, most = exact.fix_reduce_scatter(self.comm, ranges, own, out, op, r, m, local)
        if send is None:
            recv[:m] = out
        if rot is None:
            self._set_record(tally, fix, m, r * m)
        else:
            self._rotated_record(tally, mags, exact_blocks, fix, m, r * m, out.dtype)
        return fixed, max(most, fix)

    def allgather(self, send, recv):
        """Each value is quantized once by its owner: every algorithm forwards
        the bytes around the ring."""
        P, r = self.P, self.rank
        m = recv.size // P
        own = recv[r * m:(r + 1) * m] if send is None else send
        shards = [(s * m, m) for s in range(P)]
        rot = self.active
        if rot is None:
            ranges, tally = self._run("ring", "allgather", shards, own, recv, "sum", r * m, 0)
            # flagged blocks travel exactly (their owner's bits)
            return exact.fix_allgather(self.comm, ranges, own, recv, r), self._bound(
                tally, 0.0, recv.size, 0)
        y, z = rot.buffer(m, own.dtype), rot.buffer(recv.size, own.dtype, 1)
        e_y = rot.forward(own, y, r * m)
        ranges, tally = self._run("ring", "allgather", shards, y, z, "sum", r * m, 0, e_y,
                                  rotated=True)
        mags = []
        for lo, _ in shards:              # each shard rotated back on its own
            ranges, mag = self._back(z[lo:lo + m], recv[lo:lo + m], ranges, lo)
            mags.append(mag)
        mags = np.concatenate(mags) if mags else np.zeros(0)
        fixed = exact.fix_allgather(self.comm, ranges, own, recv, r)
        x_e = rot.x_bound(tally.finish(), float(mags.max(initial=0.0)), recv.dtype)
        # one bound for all (the shards' blocks do not line up with the result's)
        self.record = bound.Record.constant(recv.size, self.opts["block_size"], x_e)
        return fixed, x_e

    def _set_record(self, tally, fix, n, offset):
        """Keep what the per-block bounds of this call need."""
        self.record = bound.Record(n, self.opts["block_size"], lambda: tally.segments(fix),
                                   offset)

    def _bound(self, tally, fix, n, offset):
        """The call's bound: its schedule's and its fix-up's."""
        self._set_record(tally, fix, n, offset)
        return max(tally.finish(), fix)

    def _format(self, kdtype, algorithm, kind, rmode, watched):
        fmt = self._formats.get(kdtype.str)
        if fmt is None:
            wire, block = self.opts["wire"], self.opts["block_size"]
            make = lambda: formats.make_format(wire, block, kdtype)  # noqa: E731
            fmt = (Threaded(make, self.threads) if self.threads > 1
                   and wire != formats.MODE_WIRE else make())
            if wire == formats.MODE_WIRE:
                fmt.place(self.one_node)        # prediction pays across nodes only
            self._formats[kdtype.str] = fmt
        # a watched format (error feedback, measured bounds) decodes what
        # each quantization sent: every kernel
        algorithm = None if watched else algorithm
        key = (algorithm, kind, kdtype.str, rmode == ROUNDING["sum"])
        if key not in self._warm:
            # every rank gets here in the same call: one rank per node
            # compiles what this schedule runs, the others then load it
            in_turn(self.compile_first, self.comm,
                    lambda: (warm(fmt, kdtype, algorithm, kind, self.P, (rmode,)),
                             self.rotation and rotation.warm(acc_dtype(kdtype))))
            self._warm.add(key)
        return fmt

    def _watched(self, fmt, own, out, feedback, rotated):
        """(the format the schedule runs: fmt, shown to error feedback and
        to measured bounds as the call asks (wire/watched.py), the
        bounds.measured.Measured or None)."""
        measured = bool(self.opts["measured_bounds"])
        if not measured and feedback is None:
            return fmt, None
        # pieces and partial sums (rabenseifner's folds) are at most own's length
        k = 2 + measured
        acc = acc_dtype(own.dtype)
        tmp = workspace(self._tmp, acc.str, k * own.size, acc).reshape(k, own.size)
        m = Measured(self.active if rotated else None, own.dtype, tmp[2]) if measured else None
        watchers = (m,) if measured else ()
        if feedback is not None:
            return feedback.format(fmt, own, out, tmp[:2], watchers), m
        return Watched(fmt, tmp[:2], watchers), m

    def _workspace(self, nbytes):
        if self._ws.size < nbytes:
            self._routes.clear()
            self._ws = np.empty(nbytes, np.uint8)
        return self._ws

    def _run(self, algorithm, kind, shards, own, out, name, own_offset, out_offset,
             e_own=0.0, feedback=None, rotated=False):
        """Run a schedule; own and out are the caller's arrays (``rotated``:
        the active rotation's values).  Returns the flagged ranges and the
        bound.Tally."""
        own = kernel_view(own, writable=False)
        out = kernel_view(out, writable=True)
        rmode = rounding(name, self.opts["rounding"])
        fmt = self._format(own.dtype, algorithm, kind, rmode,
                           feedback is not None or self.opts["measured_bounds"])
        biggest = max(length for _, length in shards) * own.dtype.itemsize
        chunks = pieces_per_shard(self.opts, self.one_node, biggest)
        schedule = SCHEDULES[algorithm]
        key = (algorithm, kind, tuple(shards), chunks, own.dtype.str)
        route = self._routes.get(key)
        if route is None:
            route = schedule.Route(kind, fmt, shards, self.rank, chunks, self.opts["block_size"],
                                   self.opts["max_message_bytes"], self._workspace)
            self._routes[key] = route
            while len(self._routes) > _ROUTE_CACHE:
                self._routes.popitem(last=False)
        else:
            self._routes.move_to_end(key)
        if rmode == ROUND_STOCHASTIC:
            fmt.begin_call(self.opts["seed"], self.rank, own, own_offset)
        fmt.budget = self.budget
        watched, measured = self._watched(fmt, own, out, feedback, rotated)
        tally = bound.Tally(fmt, own.dtype, name == "sum", rmode, e_own, measured)
        try:
            ranges = schedule.run(self.comm, route, watched, own, out, KERNEL_OP[name], rmode,
                                  tally, own_offset, out_offset)
        except BaseException as exc:
            # peers wait inside the schedule for this rank's messages
            fail(self.comm, exc)
            raise
        return ranges, tally


def _blocks_of(ranges, block, offset, shard=None):
    """The indices of the blocks (of ``block`` values from ``offset``; with
    ``shard``: blocks counted shard by shard, as an Allgather's) that the
    value ranges touch."""
    out = []
    for lo, hi in ranges:
        lo, hi = lo - offset, hi - offset
        if shard is None:
            out.extend(range(lo // block, -(-hi // block)))
        else:
            per = -(-shard // block)
            s = lo // shard
            out.extend(s * per + b for b in range((lo - s * shard) // block,
                                                  -(-(hi - s * shard) // block)))
    return np.array(sorted(set(out)), np.int64)


def _is_size(rot):
    return not isinstance(rot, (bool, str)) and rot > 0
