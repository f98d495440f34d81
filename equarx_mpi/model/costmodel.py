"""The cost model behind ``algorithm="auto"``: the predicted time of every
method for a call, from a profile of the machine, and the error each
method adds.

A profile (profiles.py; ``python -m equarx_mpi.tune`` measures one, see
docs/TUNING.md) holds what the machine does, not what each method took:

- ``cores``: cores per node; ``kernels[wire][dtype][kernel]``: seconds per
  value of each kernel on one core with the other ranks idle; ``copy``:
  seconds per byte of one rank's memory copy, alone;
- ``layouts["NxL"]``, one per measured layout (N nodes of L ranks): a
  message between ranks of a node (``p2p``: latency s, s/byte, with every
  rank exchanging at once), between nodes (``net``: the same per link), a
  barrier (``sync``), a copy and a kernel with every rank busy (``copy``,
  ``share``: slowdown over alone), and each method's measured time of a
  float32 SUM Allreduce (``sizes``, ``times[method]``).

The physical model (``_physical``) builds each method's time from those
pieces: messages, copies and kernel passes, with pipelining across nodes;
its parameters come from the measured layout nearest to the one asked for,
scaled by ranks per core where the two differ.  Where a method was measured
the prediction is multiplied by measured/physical at that size
(interpolated between measured sizes, held beyond them) from the nearest
measured layout of the same kind (one node or several), so on a measured
layout the model returns the measurements and elsewhere the physical
shape carries them.  MPI's own Allreduce is modelled the same way: the
better of a ring and recursive doubling, times what was measured.

Every number a decision uses comes from the profile and the call's agreed
arguments through + - * / and sqrt only (IEEE-exact), so every rank, on
any CPU, decides alike given the same profile; QuantizedComm makes rank 0's
profile everyone's (profiles.agreed).
"""
import math

from equarx_mpi.collectives.pieces import chunks
from equarx_mpi.names import between_nodes
from equarx_mpi.wire import formats

#: shm.ONESHOT_BYTES (kept here so the model imports no MPI; a test checks)
ONESHOT_BYTES = 64 << 10
KERNELS = ("encode", "decode", "decode_reduce", "hop", "many")

#: Relative L2 error of ONE quantization of standard-normal float32 values,
#: per wire and block size (docs/TUNING.md "Error model").  A method's error
#: is this times sqrt(the sum of the variances it quantizes / the result's):
#: ring sqrt((P+1)/2), two-shot sqrt(2 - 1/P); measured through the library
#: (docs/ACCURACY.md) within 0.5% of it for int8, fp8 and bf16; int4 lies
#: 10-15% below it (an upper estimate there).
E1 = {
    "int8": {32: 0.005337, 64: 0.005922, 128: 0.006444, 256: 0.00695, 512: 0.007406,
             1024: 0.007865, 2048: 0.008287, 4096: 0.008715},
    "int4": {32: 0.09695, 64: 0.1077, 128: 0.1173, 256: 0.1263, 512: 0.1346, 1024: 0.142,
             2048: 0.1499, 4096: 0.1574},
    "fp8": {32: 0.02398, 64: 0.02506, 128: 0.02571, 256: 0.02612, 512: 0.02629,
            1024: 0.02644, 2048: 0.02646, 4096: 0.02645},
    "int8-affine": {32: 0.004595, 64: 0.005269, 128: 0.005869, 256: 0.006388, 512: 0.0069,
                    1024: 0.007335, 2048: 0.007865, 4096: 0.00823},
    "int4-affine": {32: 0.07826, 64: 0.08951, 128: 0.09965, 256: 0.1092, 512: 0.1173,
                    1024: 0.1248, 2048: 0.1325, 4096: 0.1398},
    "bf16": {b: 0.001664 for b in (32, 64, 128, 256, 512, 1024, 2048, 4096)},
    "fp32": {b: 3e-8 for b in (32, 64, 128, 256, 512, 1024, 2048, 4096)},
}


#: Stochastic rounding's error over nearest's, per quantization: a value at
#: fraction f of a step rounds off by f or 1 - f with probabilities 1 - f
#: and f, variance f(1 - f) steps^2, which is 1/6 over uniform f against
#: nearest's 1/12 (measured 1.41x, tests/test_mpi_stochastic.py)
STOCHASTIC = math.sqrt(2)


def error(method, wire, block, P, nodes, rounding="nearest"):
    """Relative L2 error of ``method``'s Allreduce on standard-normal data
    (0 for the exact methods) with SUM's codes rounded by ``rounding``.
    Used for the halves too, as an upper bound."""
    if method in ("mpi", "shm", "copy") or P == 1:
        return 0.0
    e1 = E1[wire][block] * (STOCHASTIC if rounding == "stochastic" else 1.0)
    if method == "ring":
        return e1 * math.sqrt((P + 1) / 2)
    if method == "two_shot":
        return e1 * math.sqrt(2 - 1 / P)
    if method == "hierarchical":
        return error(between_nodes(wire), wire, block, nodes, nodes, rounding)
    raise ValueError(f"no method {method!r}")


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
        kern = profile["kernels"].get(wire) or profile["kernels"]["int8"]
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

    def k(self, name):
        """Seconds per value of a kernel with every rank computing."""
        return self.kern[name] * self.share


def _overlap(comm, comp, chunks):
    """A pipelined phase: the longer of the two, plus the part of the
    shorter that the pieces cannot hide."""
    return max(comm, comp) + min(comm, comp) / chunks


def _step(hw, b, chunks):
    """One ring step moving b bytes in ``chunks`` messages: on a node a
    copy between neighbours; across nodes one pair per node crosses the
    link at the same time, the others copy."""
    t = chunks * hw.alpha + b * hw.beta if hw.rpn > 1 else 0.0
    if hw.nodes > 1:
        t = max(t, chunks * hw.net_alpha + b * hw.net_beta)
    return t


def _ring(hw, v, s, w, P, chunks):
    piece = v / P
    comp = piece * (hw.k("encode") + (P - 1) * hw.k("hop") + P * hw.k("decode"))
    comm = 2 * (P - 1) * _step(hw, w * piece, chunks)
    return _overlap(comm, comp, chunks)


def _two_shot(hw, v, s, w, P, chunks):
    piece = v / P
    comp = v * hw.k("encode") + (P - 1) * piece * hw.k("many") + v * hw.k("decode")
    b = w * piece
    scatter = (P - 1) * (chunks * hw.alpha + b * hw.beta) if hw.rpn > 1 else 0.0
    if hw.nodes > 1:
        # every rank of a node sends its pieces for the other nodes' ranks
        # over the node's one link
        away = P - hw.rpn
        scatter = max(scatter, away * chunks * hw.net_alpha + hw.rpn * away * b * hw.net_beta)
    gather = (P - 1) * _step(hw, b, chunks)
    return _overlap(scatter + gather, comp, chunks)


def _shm(hw, n, P):
    if n <= ONESHOT_BYTES:       # copy in, sync, every rank reduces all P slots
        return n * hw.copy + P * n * hw.copy / 2 + hw.sync
    # copy in, reduce (read every slot's slice, write one), copy out
    return 3 * n * hw.copy + 2 * hw.sync


def _mpi(hw, n, P):
    """An exact Allreduce: the better of a ring (reduce-scatter +
    all-gather) and recursive doubling, sums at copy speed."""
    ring = 2 * (P - 1) * _step(hw, n / P, 1) + n * hw.copy
    doubling = max(1.0, lg(P)) * (_step(hw, n, 1) + n * hw.copy)
    return min(ring, doubling)


def _variant(hw, **changes):
    out = Hw.__new__(Hw)
    out.__dict__.update(hw.__dict__, **changes)
    return out


def _physical(method, hw, v, s, w, chunks):
    """Seconds for an Allreduce of v values of s bytes, w wire bytes per
    value, on hw's layout, shards cut into ``chunks`` pieces."""
    P = hw.nodes * hw.rpn
    n = v * s
    if method == "mpi":
        return _mpi(hw, n, P)
    if method == "shm":
        return _shm(hw, n, P)
    if method == "ring":
        return _ring(hw, v, s, w, P, chunks)
    if method == "two_shot":
        return _two_shot(hw, v, s, w, P, chunks)
    if method == "hierarchical":
        # exact halves on each node; between them one rank per node runs
        # the two-shot on 1/L of the message, L such groups sharing a link
        inner = _variant(hw, rpn=1, net_beta=hw.net_beta * hw.rpn)
        return (_shm(_variant(hw, nodes=1), n, hw.rpn)
                + _two_shot(inner, v / hw.rpn, s, w, hw.nodes, chunks))
    raise ValueError(f"no method {method!r}")


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
    ``nodes`` x ``rpn`` ranks with these wire options: ``time(method,
    nbytes, itemsize, dtype_name)``; ``error(method)``."""

    def __init__(self, profile, nodes, rpn, wire, block, chunks=None):
        self.profile, self.nodes, self.rpn = profile, nodes, rpn
        self.wire, self.block, self.chunks = wire, block, chunks
        self._hw, self._wire_bytes, self._ratios, self._tables = {}, {}, {}, {}
        #: below the smallest size any layout measured the model only
        #: extrapolates (at 8 B it puts MPI at tens of microseconds, where
        #: MPI's latency-bound algorithms take one or two)
        self.measured_from = min((lay["sizes"][0] for lay in profile["layouts"].values()
                                  if lay.get("sizes")), default=0)

    def hw(self, dtype_name):
        h = self._hw.get(dtype_name)
        if h is None:
            h = self._hw[dtype_name] = Hw(self.profile, self.nodes, self.rpn, self.wire,
                                          dtype_name)
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
        if method == "hierarchical":
            return _default_chunks(False, nbytes / (self.rpn * self.nodes))
        if method in ("ring", "two_shot"):
            return _default_chunks(self.nodes == 1, nbytes / (self.rpn * self.nodes))
        return 1

    def physical(self, method, nbytes, itemsize, dtype_name="float32"):
        """The physical model alone (no correction by measurements)."""
        hw = self.hw(dtype_name)
        v = nbytes / itemsize
        if method == "mpi" and itemsize == 2:
            # MPI has no 16-bit floats: float32 copies, converted there and back
            return _physical("mpi", hw, v, 4, 0, 1) + 3 * nbytes * hw.copy
        return _physical(method, hw, v, itemsize, self.wire_bytes(itemsize),
                         self.pieces(method, nbytes))

    def correction(self, method, nbytes):
        """measured / physical for ``method`` at this size on the nearest
        measured layout of the same kind (1 where none measured it)."""
        r = self._ratios.get(method)
        if r is None:
            one = self.nodes == 1
            found = _nearest(self.profile["layouts"], self.nodes, self.rpn,
                             lambda lay: ((lay["nodes"] == 1) == one
                                          and method in lay.get("times", {})))
            if found is None:
                r = ([1.0], [1.0])
            else:
                lay = found[1]
                ref = Model(self.profile, lay["nodes"], lay["rpn"], lay.get("wire", "int8"),
                            lay.get("block", 256))
                r = (lay["sizes"], [t / ref.physical(method, n, 4)
                                    for n, t in zip(lay["sizes"], lay["times"][method])])
            self._ratios[method] = r
        return _interp(r[0], r[1], nbytes)

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
        if nbytes <= GRID[0]:
            return ts[0]
        if nbytes >= GRID[-1]:
            return ts[-1] * nbytes / GRID[-1]
        i = _grid_index(nbytes)
        a, b = GRID[i], GRID[i + 1]
        return ts[i] + (nbytes - a) / (b - a) * (ts[i + 1] - ts[i])

    def error(self, method, rounding="nearest"):
        """Relative L2 error on standard-normal data (module ``error``)."""
        return error(method, self.wire, self.block, self.nodes * self.rpn, self.nodes,
                     rounding)
