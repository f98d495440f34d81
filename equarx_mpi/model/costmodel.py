"""The cost model behind ``algorithm="auto"``: the predicted time of every
method for a call, from a profile of the machine, and the error each
method adds (errors.py, re-exported here).

A profile (profiles.py; ``python -m equarx_mpi.tune`` measures one, see
docs/TUNING.md) holds what the machine does, not what each method took:

- ``cores``: cores per node; ``kernels[wire][dtype][kernel]``: seconds per
  value of each kernel on one core with the other ranks idle (a wire the
  profile did not measure: int8's times SLOWER); ``copy``:
  seconds per byte of one rank's memory copy, alone;
- ``layouts["NxL"]``, one per measured layout (N nodes of L ranks): a
  message between ranks of a node (``p2p``: latency s, s/byte, with every
  rank exchanging at once), between nodes (``net``: the same per link), a
  barrier (``sync``), a copy and a kernel with every rank busy (``copy``,
  ``share``: slowdown over alone), and each method's measured time of a
  float32 SUM Allreduce (``sizes``, ``times[method]``).

The physical model (physical.py, ``_physical``) builds each method's time
from those pieces: messages, copies and kernel passes, with pipelining;
its parameters come from the measured layout nearest to the one asked for,
scaled by ranks per core where the two differ.  Where a method was measured
the prediction is multiplied by measured/physical at that size
(interpolated between measured sizes, held beyond them) from the nearest
measured layout of the same kind (one node or several), so on a measured
layout the model returns the measurements and elsewhere the physical
shape carries them; a method no layout measured takes the correction of
the one it runs like (CORRECTED_LIKE: rabenseifner the ring's).  MPI's own
Allreduce is modelled the same way: the best of a ring, recursive doubling
and Rabenseifner (mpi_parts), times what was measured.

The formulas: each schedule's in its module (collectives/registry.py
lists them), the terms they share and where ranks sit in
collectives/terms.py, the exact methods' in physical.py.

Kernel threads (option ``threads``; ``Model(..., threads=T)``, default 1:
the model without them, bit for bit): a kernel call runs over as many
threads as wire/threaded.py gives it, its time the one-thread time over
thread_speedup (the profile's optional ``threads``: measured speedups;
else Amdahl's law with ASSUMED_PARALLEL), never below its memory traffic
(TRAFFIC) at the node's copy rate (node_copy) shared by its ranks.

Every number a decision uses comes from the profile and the call's agreed
arguments through + - * / and sqrt only (IEEE-exact), so every rank, on
any CPU, decides alike given the same profile; QuantizedComm makes rank 0's
profile everyone's (profiles.agreed).
"""
import math

from equarx_mpi.collectives.pieces import chunks
from equarx_mpi.collectives.registry import SCHEDULES
from equarx_mpi.collectives.terms import ONESHOT_BYTES  # noqa: F401 (the tests')
from equarx_mpi.collectives.terms import variant as _variant  # tune predict's and the tests'
from equarx_mpi.model.errors import E1, STOCHASTIC, error, pow2_floor  # noqa: F401 (the model's)
from equarx_mpi.model.physical import _physical, mpi_parts  # noqa: F401 (tune predict's)
from equarx_mpi.names import between_nodes
from equarx_mpi.wire import formats
from equarx_mpi.wire.threaded import MIN_PART

KERNELS = ("encode", "decode", "decode_reduce", "hop", "many")

# --- arithmetic every rank does alike ---------------------------------------------
def lg(x):
    """log2(x) for x > 0, exact at powers of two and linear between them:
    frexp and arithmetic only, so bitwise the same on every CPU."""
    m, e = math.frexp(x)
    return e + 2 * m - 2


def _interp(xs, ys, x):
    """ys at x, piecewise linear in lg(x) between the points, held beyond."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            a, b = lg(xs[i - 1]), lg(xs[i])
            w = (lg(x) - a) / (b - a)
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


def _nearest(layouts, nodes, rpn, keep):
    """(name, layout) of the measured layout nearest to nodes x rpn (in
    log2 steps) among those ``keep`` accepts; ties go to the first name."""
    best = None
    for name in sorted(layouts):
        lay = layouts[name]
        if not keep(lay):
            continue
        d = abs(lg(lay["nodes"]) - lg(nodes)) + abs(lg(lay["rpn"]) - lg(rpn))
        if best is None or d < best[0]:
            best = (d, name, lay)
    return None if best is None else best[1:]


# --- the physical model ------------------------------------------------------------
class Hw:
    """The physical parameters for one layout (see the module docstring)."""

    def __init__(self, profile, nodes, rpn, wire, dtype_name):
        C = profile["cores"]
        lays = profile["layouts"]
        self.nodes, self.rpn = nodes, rpn
        kern = profile["kernels"].get(wire) or _like_int8(profile["kernels"]["int8"], wire)
        self.kern = kern.get(dtype_name) or kern["float32"]
        crowd = lambda L: max(1.0, L / C)      # noqa: E731  (ranks per core)
        _, near = _nearest(lays, nodes, rpn, lambda lay: True)
        scale = crowd(rpn) / crowd(near["rpn"])
        self.share = near["share"] * scale
        self.copy = near["copy"] * scale
        P, Pm = nodes * rpn, near["nodes"] * near["rpn"]
        self.sync = near["sync"] * scale * max(1.0, lg(P)) / max(1.0, lg(Pm))
        _, intra = _nearest(lays, 1, rpn, lambda lay: lay.get("p2p") is not None)
        s = crowd(rpn) / crowd(intra["rpn"])
        self.alpha, self.beta = intra["p2p"][0] * s, intra["p2p"][1] * s
        self.net_alpha = self.net_beta = None
        if nodes > 1:
            _, net = _nearest(lays, nodes, 1, lambda lay: lay.get("net") is not None)
            self.net_alpha, self.net_beta = net["net"]
        #: kernel threads per rank (threaded() sets them)
        self.threads = 1

    def threaded(self, profile, wire, threads, mem, s, w):
        """This layout with each kernel run over ``threads`` threads: its
        speedups from the profile (thread_speedup), no kernel faster than
        its memory traffic at ``mem`` seconds per byte copied (one rank's
        share of the node's copy rate); ``s``, ``w``: input and wire bytes
        per value (the traffic, TRAFFIC)."""
        if threads == 1:
            return self
        floor = {name: (a * s + b * w) / 2 * mem for name, (a, b) in TRAFFIC.items()}
        return _variant(self, threads=threads, floor=floor, _speed={},
                        _measured=thread_rates(profile, wire))

    def changed(self, **changes):
        """A copy of this layout with some parameters changed (tune
        predict's clusters that were not measured)."""
        return _variant(self, **changes)

    def seconds(self, method, v, s, w, chunks, inner="two_shot"):
        """The physical model's time of ``method`` on this layout
        (physical._physical's arguments)."""
        return _physical(method, self, v, s, w, chunks, inner)

    def k(self, name, values=None):
        """Seconds per value of a kernel with every rank computing, in
        calls of ``values`` values (threads as wire/threaded.py cuts them:
        parts of at least MIN_PART values; None: all threads)."""
        t = self.kern[name] * self.share
        if self.threads == 1:
            return t
        T = self.threads if values is None else min(self.threads,
                                                    max(1, int(values) // MIN_PART))
        if T == 1:
            return t
        sp = self._speed.get((name, T))
        if sp is None:
            sp = self._speed[name, T] = thread_speedup(self._measured, name, T)
        return min(t, max(t / sp, self.floor[name]))


# --- kernel threads (option threads, wire/threaded.py) -------------------------------
#: a kernel's parallel fraction f (Amdahl: T threads run it 1/((1 - f) + f/T)
#: times as fast) where the profile measured no thread rates: 1.67x at 2
#: threads, below the 1.7x issue 22 asks of 2 threads, 3.33x at 8
ASSUMED_PARALLEL = 0.8
#: memory traffic of each kernel in copied bytes per value, (a, b): a input
#: bytes and b wire bytes, read or written, counted half (a copy of n bytes
#: reads n and writes n); many: per input
TRAFFIC = {"encode": (1, 1), "decode": (1, 1), "decode_reduce": (2, 1), "hop": (1, 2),
           "many": (1, 1)}
#: the kernel whose measured speedup "many" (two-shot's reduce) takes:
#: bench_threads does not time it, and it is a decode-reduce of each input
THREAD_LIKE = {"many": "decode_reduce"}
#: bytes per value of the kernels' input dtypes
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def thread_rates(profile, wire):
    """{threads: {kernel: measured speedup}} of ``wire`` (else int8's, as
    the kernel times) in ``profile["threads"]``, or {} (none measured)."""
    got = profile.get("threads") or {}
    per = got.get(wire) or got.get("int8") or {}
    return {int(T): ks for T, ks in per.items()}


def _amdahl(s, T0, T):
    """The speedup at T threads of a kernel sped up s times by T0 > 1."""
    f = (1 - 1 / s) / (1 - 1 / T0)
    return 1 / ((1 - f) + f / T)


def thread_speedup(measured, name, T):
    """How many times faster ``T`` threads run kernel ``name``: measured at
    T where measured; else Amdahl's law through the largest measured count
    below T (above T if none), or ASSUMED_PARALLEL where nothing was
    measured; each measurement clamped to [1, its threads]; the running
    maximum over 1..T, so that more threads are never slower."""
    name = THREAD_LIKE.get(name, name)
    pts = {c: min(float(c), max(1.0, ks[name])) for c, ks in measured.items()
           if c > 1 and name in ks}
    best = 1.0
    for t in range(2, T + 1):
        if t in pts:
            s = pts[t]
        elif pts:
            below = [c for c in pts if c < t]
            c = max(below) if below else min(pts)
            s = _amdahl(pts[c], c, t) if pts[c] > 1 else 1.0
        else:
            s = 1 / ((1 - ASSUMED_PARALLEL) + ASSUMED_PARALLEL / t)
        best = max(best, min(float(t), s))
    return best


def node_copy(profile):
    """Seconds per byte of the node's memory copy with every rank at it: the
    fastest of one rank alone and each one-node layout's rate times its
    ranks (the profile's machine)."""
    return min([profile["copy"]] + [lay["copy"] / lay["rpn"] for lay in
                                    profile["layouts"].values()
                                    if lay["nodes"] == 1 and lay.get("copy")])


#: a wire's kernel time over int8's (encode, decode, decode_reduce and many,
#: hop) where a profile has int8's only: each wire's own (formats.REGISTRY)
SLOWER = {name: w.slower for name, w in formats.REGISTRY.items()}


def _like_int8(int8, wire):
    e, d, dr, hop = SLOWER.get(wire, (1.0, 1.0, 1.0, 1.0))
    f = {"encode": e, "decode": d, "decode_reduce": dr, "many": dr, "hop": hop}
    return {dt: {k: t * f[k] for k, t in ks.items()} for dt, ks in int8.items()}


#: where no profile measured a method, its prediction is corrected by the
#: measurements of the one it runs most like (its Schedule's corrected_like)
CORRECTED_LIKE = {name: s.corrected_like for name, s in SCHEDULES.items() if s.corrected_like}


#: one rotation pass (rotate, or rotate back, with its magnitudes), seconds
#: a value on one core (docs/results/rotate-kernels.txt: 1.2-1.9 ns at sizes
#: 32-256, AMD EPYC, idle to loaded; not measured by tune): a rotated call
#: (option rotate) makes two
ROTATE_S = 2.0e-9
#: what measured_bounds adds per value a rank quantizes (about one a value of
#: the call per rank), seconds on one core, rotation back aside (ROTATE_S
#: more when rotated): the values decoded again, their difference and its
#: largest magnitude (docs/results/measured-bounds.txt: the int8 ring at
#: 16 MiB, 4 ranks on 2 cores, took 34 ms more, 4 ns a value a core)
MEASURE_S = 4.0e-9
#: Sizes the model is tabulated at: quarter octaves from 256 B to 28 GiB.
GRID = [(4 + k % 4) << (6 + k // 4) for k in range(4 * 27)]


def _grid_index(n):
    """i with GRID[i] <= n < GRID[i + 1] (GRID[0] < n < GRID[-1])."""
    e = n.bit_length() - 1 if isinstance(n, int) else math.frexp(n)[1] - 1
    i = 4 * (e - 8) + min(3, int((n / (1 << e) - 1) * 4))
    while GRID[i] > n:
        i -= 1
    while GRID[i + 1] <= n:
        i += 1
    return i


def _default_chunks(one_node, shard_bytes):
    return chunks({"chunks": None}, one_node, shard_bytes)


class Model:
    """Predicted seconds of each method for calls on one communicator of
    ``nodes`` x ``rpn`` ranks with these wire options, each rank running
    its kernels over ``threads`` threads (at most the profile's cores per
    rank): ``time(method, nbytes, itemsize, dtype_name)``;
    ``error(method)``."""

    def __init__(self, profile, nodes, rpn, wire, block, chunks=None, threads=1, rotate=False,
                 measured=False):
        self.profile, self.nodes, self.rpn = profile, nodes, rpn
        self.wire, self.block, self.chunks = wire, block, chunks
        #: option rotate: quantized calls pay two rotation passes ("auto": charged
        #: too, as the call may rotate)
        self.rotate = bool(rotate)
        #: option measured_bounds: quantized calls pay MEASURE_S a value, and
        #: rotated one more rotation pass
        self.measured = bool(measured)
        #: threads beyond the cores of a rank's share of the node gain nothing
        self.threads = max(1, min(threads, profile["cores"] // rpn))
        self._hw, self._wire_bytes, self._ratios, self._tables = {}, {}, {}, {}
        #: below the smallest size any layout measured the model only
        #: extrapolates (at 8 B it puts MPI at tens of microseconds, where
        #: MPI's latency-bound algorithms take one or two)
        self.measured_from = min((lay["sizes"][0] for lay in profile["layouts"].values()
                                  if lay.get("sizes")), default=0)

    def hw(self, dtype_name):
        h = self._hw.get(dtype_name)
        if h is None:
            h = Hw(self.profile, self.nodes, self.rpn, self.wire, dtype_name)
            s = ITEMSIZE.get(dtype_name, 4)
            h = self._hw[dtype_name] = h.threaded(
                self.profile, self.wire, self.threads, node_copy(self.profile) * self.rpn, s,
                self.wire_bytes(s))
        return h

    def wire_bytes(self, itemsize):
        """Bytes on the wire per value, headers included."""
        w = self._wire_bytes.get(itemsize)
        if w is None:
            kd = "float64" if itemsize == 8 else "float32"
            fmt = formats.make_format(self.wire, self.block, kd)
            w = self._wire_bytes[itemsize] = fmt.nbytes(1 << 16) / (1 << 16)
        return w

    def pieces(self, method, nbytes):
        """Pieces per shard, as the engine cuts them (pieces.chunks)."""
        if self.chunks is not None:
            return self.chunks
        sched = SCHEDULES.get(method)
        if sched is None:
            return 1
        # a nested schedule's pieces travel between nodes
        return _default_chunks(self.nodes == 1 and not sched.nested,
                               nbytes / (self.rpn * self.nodes))

    def physical(self, method, nbytes, itemsize, dtype_name="float32"):
        """The physical model alone (no correction by measurements)."""
        hw = self.hw(dtype_name)
        v = nbytes / itemsize
        if method == "mpi" and itemsize == 2:
            # MPI has no 16-bit floats: float32 copies, converted there and back
            return _physical("mpi", hw, v, 4, 0, 1) + 3 * nbytes * hw.copy
        return _physical(method, hw, v, itemsize, self.wire_bytes(itemsize),
                         self.pieces(method, nbytes), between_nodes(self.wire))

    def correction(self, method, nbytes):
        """measured / physical for ``method`` at this size on the nearest
        measured layout of the same kind (1 where none measured it or, for
        CORRECTED_LIKE's methods, the method they run like)."""
        r = self._ratios.get(method)
        if r is None:
            r = self._ratios[method] = self._ratio(method) or self._ratio(
                CORRECTED_LIKE.get(method)) or ([1.0], [1.0])
        return _interp(r[0], r[1], nbytes)

    def _ratio(self, method):
        """(sizes, measured / physical) for ``method``, or None."""
        one = self.nodes == 1
        found = method and _nearest(self.profile["layouts"], self.nodes, self.rpn,
                                    lambda lay: ((lay["nodes"] == 1) == one
                                                 and method in lay.get("times", {})))
        if not found:
            return None
        lay = found[1]
        # at the threads the layout was measured with (none before tune
        # recorded them: one)
        ref = Model(self.profile, lay["nodes"], lay["rpn"], lay.get("wire", "int8"),
                    lay.get("block", 256), threads=lay.get("threads", 1))
        return (lay["sizes"], [t / ref.physical(method, n, 4)
                               for n, t in zip(lay["sizes"], lay["times"][method])])

    def time(self, method, nbytes, itemsize, dtype_name="float32"):
        """Predicted seconds of an Allreduce of nbytes per rank: physical
        times correction, made non-decreasing in size (a running maximum
        over GRID, linear between its points, proportional beyond it)."""
        key = (method, itemsize, dtype_name)
        ts = self._tables.get(key)
        if ts is None:
            ts, top = [], 0.0
            for n in GRID:
                top = max(top, self.physical(method, n, itemsize, dtype_name)
                          * self.correction(method, n))
                ts.append(top)
            ts = self._tables[key] = ts
        return self._table(ts, nbytes) + self.rotation(method, nbytes, itemsize)

    @staticmethod
    def _table(ts, nbytes):
        if nbytes <= GRID[0]:
            return ts[0]
        if nbytes >= GRID[-1]:
            return ts[-1] * nbytes / GRID[-1]
        i = _grid_index(nbytes)
        a, b = GRID[i], GRID[i + 1]
        return ts[i] + (nbytes - a) / (b - a) * (ts[i + 1] - ts[i])

    def rotation(self, method, nbytes, itemsize):
        """Seconds rotation and measured bounds add to a quantized method:
        each rank's passes over its values, one core per rank at most."""
        if method not in SCHEDULES:
            return 0.0
        passes = 2 * ROTATE_S * self.rotate + (MEASURE_S + ROTATE_S * self.rotate) * self.measured
        share = max(1.0, self.rpn / self.profile["cores"])     # ranks sharing a core
        return passes * nbytes / itemsize * share

    def error(self, method, rounding="nearest"):
        """Relative L2 error on standard-normal data (module ``error``)."""
        return error(method, self.wire, self.block, self.nodes * self.rpn, self.nodes,
                     rounding)
