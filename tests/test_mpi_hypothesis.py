"""Hypothesis property tests of the certified bound (docs/ERROR.md) under
MPI: for random lengths (0, 1, odd, around block and rank multiples, up to
50k), dtypes, block sizes, chunk counts, message limits, wires,
algorithms (named, and "auto"), roundings (nearest, stochastic),
collectives (Allreduce blocking, nonblocking and persistent,
Reduce_scatter_block, Allgather), ops and adversarial data, every finite result
value lies within ``last_error_bound`` and within its block's
``block_bounds()`` of the exact reduction, the bound is the same float on
every rank, and an Allreduce's or Allgather's result is the same bits on
every rank.

Rank 0 runs hypothesis: it draws each case and broadcasts it; every rank
makes its input from the case's seed and its rank, runs the call and
checks it against the exact reduction of all ranks' inputs (allgathered;
tests/exact_check.py decides each value exactly).  The verdicts are
combined, so every rank fails together, and hypothesis shrinks a failure
on rank 0 while the other ranks serve the cases it tries: only rank 0
draws, so nothing in hypothesis (health checks and shrinking limits that
depend on time) can make ranks disagree.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_hypothesis.py
    EQUARX_MPI_FAKE_NODES=2x2 mpirun -n 4 python -m pytest --with-mpi \\
        tests/test_mpi_hypothesis.py                    # hierarchical across nodes
    EQUARX_MPI_HYPOTHESIS_CASES=3000 EQUARX_MPI_HYPOTHESIS_SEED=7 mpirun ... -s

EQUARX_MPI_HYPOTHESIS_CASES (default 150, shared by the algorithms) sets the number of cases;
EQUARX_MPI_HYPOTHESIS_SEED draws another sequence (default: hypothesis'
derandomized one, the same every run); EQUARX_MPI_HYPOTHESIS_VERBOSE=1
prints each case on rank 0 before it runs (with -s: the case of a hang).
With -s rank 0 prints how many cases took each path and the largest
error / bound seen.
"""
import collections
import hashlib
import math
import os
import traceback

import ml_dtypes
import numpy as np
import pytest
from exact_check import errors_above
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import allreduce_as, everywhere, rank0_draws

from equarx_mpi import QuantizedComm
from equarx_mpi.wire import formats

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()
CASES = int(os.environ.get("EQUARX_MPI_HYPOTHESIS_CASES", "150"))
SEED = os.environ.get("EQUARX_MPI_HYPOTHESIS_SEED")
VERBOSE = os.environ.get("EQUARX_MPI_HYPOTHESIS_VERBOSE", "0") not in ("", "0")
MAX_N = 50_000
#: (algorithm, wire) -> its share of the cases (each one a test, so that every
#: path gets cases however few; hypothesis draws the rest).  Hierarchical
#: runs two-shot between nodes; the exact methods do not read the wire.
PATHS = dict([(("ring", w), 0.06) for w in formats.WIRES]
             + [(("two_shot", w), 0.06) for w in formats.WIRES]
             + [(("hierarchical", w), 0.04) for w in ("int8", "bf16", "fp8", "int4-affine")]
             + [(("shm", "int8"), 0.04), (("mpi", "int8"), 0.03), (("auto", "int8"), 0.03)])
DTYPES = ("float32", "float64", "float16", "bfloat16")
#: the first of each is what a failure shrinks towards
KINDS = ("gaussian", "offset", "outliers", "mixed-ranks", "cancel", "constant", "subnormal",
         "near-max", "overflow", "signed-zeros", "nonfinite", "mixed-blocks")
#: kinds whose bound must be finite (all inputs finite, sums far from overflow)
TAME = ("gaussian", "offset", "outliers", "mixed-ranks", "cancel", "constant", "subnormal",
        "signed-zeros")
BLOCKS = (None, 32, 64, 128, 256, 1024, 4096)
OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
EXACT_METHODS = ("copy", "mpi", "shm")


# --- the cases ---------------------------------------------------------------------

@st.composite
def cases(draw, algorithm, wire):
    block = draw(st.sampled_from(BLOCKS))
    B = block or formats.default_block(wire)
    what = draw(st.sampled_from(("Allreduce", "Allreduce", "Reduce_scatter_block", "Allgather")))
    k = min(draw(st.integers(1, 4)), MAX_N // (B * P))        # around k blocks per rank
    n = draw(st.one_of(st.integers(0, 3), st.integers(4, 700),
                       st.integers(-2, 2).map(lambda d: max(0, k * B * P + d)),
                       st.integers(700, MAX_N), st.integers(700, MAX_N)))
    mm = draw(st.sampled_from((None, None, 1, 3)))
    return dict(
        algorithm=algorithm, wire=wire, block=block, what=what, n=n,
        op="sum" if what == "Allgather" else draw(st.sampled_from(("sum", "sum", "max", "min"))),
        rounding=draw(st.sampled_from(("nearest", "stochastic")
                                      if wire in formats.STOCHASTIC_WIRES else ("nearest",))),
        lossy=draw(st.booleans()), in_place=draw(st.booleans()),
        # an Allreduce also nonblocking and persistent (the bound found when it runs)
        form=draw(st.sampled_from(("blocking", "nonblocking", "persistent"))),
        chunks=draw(st.sampled_from((None, 1, 2, 3, 8))),
        # a message limit of a few blocks: messages split
        max_message_bytes=mm and mm * formats.max_block_bytes(wire, B),
        dtype=draw(st.sampled_from(DTYPES)), kind=draw(st.sampled_from(KINDS)),
        scale=draw(st.integers(-30, 30)), seed=draw(st.integers(0, 2 ** 32 - 1)))


def _limits(dt):
    fi = ml_dtypes.finfo(dt)
    return float(fi.max), float(fi.tiny), float(fi.smallest_subnormal)


def values(kind, c, n, B, rng, shared):
    """Rank's values (float64, before the cast to the case's dtype) of one
    kind: ``rng`` is this rank's stream, ``shared`` the same on every rank."""
    big, tiny, sub = _limits(c["dtype"])
    lg = math.log2(big)
    # magnitudes whose sums stay well inside the type
    s = 2.0 ** min(max(c["scale"], math.log2(tiny)), lg - 10 - math.log2(P))
    g = rng.standard_normal(n)
    nb = -(-n // B)
    per_block = lambda v: np.repeat(v, B)[:n]           # noqa: E731
    if kind == "gaussian":
        return g * s
    if kind == "offset":
        return (1000 + g) * min(s, big / (4000 * P))
    if kind == "outliers":                  # one value per block up to 2^16 times the rest
        x = g * min(s, big / (P * 2 ** 20))
        starts = np.arange(0, n, B)
        i = starts + rng.integers(0, np.minimum(B, n - starts))
        x[i] *= 2.0 ** rng.integers(4, 17, i.size)
        return x
    if kind == "mixed-ranks":               # each rank its own magnitude
        lo, hi = max(-200, math.log2(tiny) + 4), min(200, lg - 10 - math.log2(P))
        return g * 2.0 ** rng.integers(int(lo), int(hi) + 1)
    if kind == "cancel":                    # pairs of ranks send x and -x(1 + tiny)
        base = shared.standard_normal((P // 2 + 1, n)) * s
        rel = 2.0 ** -shared.choice([6, 12, 24, 40, 60])
        if RANK % 2 == 0:
            return base[RANK // 2] if RANK + 1 < P else g * s * rel
        return -base[RANK // 2] * (1 + rel * g)
    if kind == "constant":
        return per_block(rng.choice([0.0, -0.0, 1.0, -3.0, 0.1, tiny, -sub, s, big / (2 * P)], nb))
    if kind == "subnormal":
        return rng.integers(-1024, 1025, n) * sub
    if kind == "near-max":                  # |exact sum| <= max, often close to it
        sign = np.where(shared.random(n) < 0.5, shared.choice([-1.0, 1.0], n),
                        rng.choice([-1.0, 1.0], n))
        return sign * big * (1 - rng.random(n) * 2.0 ** -4) / max(P, 1)
    if kind == "overflow":                  # exact sums beyond max in half the blocks
        sign = shared.choice([-1.0, 1.0], n)
        hot = per_block(shared.random(nb) < 0.5)
        return np.where(hot, sign * big * (0.5 + 0.5 * rng.random(n)), g * s)
    if kind == "signed-zeros":              # blocks of +-0, and a few values elsewhere
        x = np.where(per_block(shared.random(nb) < 0.6), 0.0, g * s * (rng.random(n) < 0.2))
        return np.copysign(x, rng.choice([-1.0, 1.0], n))
    if kind == "nonfinite":                 # a sprinkle of Inf and NaN on some ranks
        x = g * s
        if rng.random() < 0.5 and n:
            i = rng.integers(0, n, max(1, n // 500))
            x[i] = rng.choice([np.inf, -np.inf, np.nan], i.size)
        return x
    assert kind == "mixed-blocks"           # each block its own kind (the same on every rank)
    kinds = KINDS[:-1]
    pick = per_block(shared.integers(0, len(kinds), nb))
    x = np.empty(n)
    for j, k in enumerate(kinds):
        v = values(k, c, n, B, rng, shared)
        x[pick == j] = v[pick == j]
    return x


def make_input(c, n, B):
    """This rank's input of n values of the case's dtype."""
    rng = np.random.default_rng([c["seed"], 1, RANK])
    shared = np.random.default_rng([c["seed"], 2])
    with np.errstate(over="ignore", invalid="ignore"):
        return values(c["kind"], c, n, B, rng, shared).astype(ml_dtypes.finfo(c["dtype"]).dtype)


# --- running and checking one case ------------------------------------------------------

class Comms:
    """QuantizedComms by options, the last few kept (every rank makes and
    frees the same ones in the same order: the cases are the same)."""

    def __init__(self, keep=8):
        self.keep, self.comms = keep, collections.OrderedDict()

    def get(self, c):
        key = (c["wire"], c["algorithm"], c["block"], c["chunks"], c["lossy"],
               c["max_message_bytes"], c["rounding"])
        if key in self.comms:
            self.comms.move_to_end(key)
            return self.comms[key]
        if len(self.comms) >= self.keep:
            self.comms.popitem(last=False)[1].free()
        opts = dict(wire=c["wire"], algorithm=c["algorithm"], block_size=c["block"],
                    chunks=c["chunks"], min_quantized_bytes=0, rounding=c["rounding"],
                    lossy_ops=("sum", "max", "min") if c["lossy"] else ("sum",),
                    exact_bounds=True)       # the exact paths' bounds are checked too
        if c["max_message_bytes"]:
            opts["max_message_bytes"] = c["max_message_bytes"]
        self.comms[key] = QuantizedComm(WORLD, **opts)
        return self.comms[key]

    def free(self):
        while self.comms:
            self.comms.popitem()[1].free()


def run_call(qc, c, x, m):
    """This rank's result, and the exact result's terms ((k, size) float64)."""
    what, op, parts = c["what"], c["op"], np.array(WORLD.allgather(x), np.float64)
    if what == "Allgather":
        out = np.empty(P * m, x.dtype)
        if c["in_place"]:
            out[RANK * m:(RANK + 1) * m] = x
            qc.Allgather(MPI.IN_PLACE, out)
        else:
            qc.Allgather(x, out)
        return out, parts.reshape(1, -1)
    if what == "Reduce_scatter_block":
        if c["in_place"]:
            buf = x.copy()
            qc.Reduce_scatter_block(MPI.IN_PLACE, buf, OPS[op])
            out = buf[:m]
        else:
            out = np.empty(m, x.dtype)
            qc.Reduce_scatter_block(x, out, OPS[op])
        parts = parts[:, RANK * m:(RANK + 1) * m]
    else:
        out = x.copy() if c["in_place"] else np.empty_like(x)
        args = (MPI.IN_PLACE if c["in_place"] else x, out, OPS[op])
        allreduce_as(c["form"], qc, *args)
    if op == "sum":
        return out, parts
    with np.errstate(invalid="ignore"):
        return out, (parts.max(axis=0) if op == "max" else parts.min(axis=0))[None]


def check(qc, c):
    """Run case c on every rank; the failed checks, the same list on every
    rank, and (method, wire, bound, largest error)."""
    B = qc.block_size
    n = c["n"]
    m = n // P
    size = {"Allreduce": n, "Reduce_scatter_block": P * m, "Allgather": m}[c["what"]]
    try:
        x, made = make_input(c, size, B), None
    except Exception as e:                  # noqa: BLE001 - a bug here, not a hang
        x, made = None, repr(e)
    everywhere(made is None, f"making the input: {made}")
    out, terms = run_call(qc, c, x, m)
    E, info = qc.last_error_bound, qc.last_call
    blocks = qc.block_bounds()
    err, above = errors_above(out, terms, E)
    per_block = np.repeat(blocks, B)[:out.size]
    _, block_above = errors_above(out, terms, per_block)
    bad = []
    if not (E == info.error_bound and E >= 0):          # NaN fails here too
        bad.append(f"bound {E!r}")
    if above.any():
        i = int(np.flatnonzero(above)[0])
        bad.append(f"{int(above.sum())} errors above the bound {E!r}, e.g. at {i}: "
                   f"{err[i]!r} (out {out[i]!r})")
    if blocks.shape != (-(-out.size // B),) or np.isnan(blocks).any() or (blocks > E).any():
        bad.append(f"block bounds {blocks[:4]}... of shape {blocks.shape}, not all <= {E!r}")
    if block_above.any():
        i = int(np.flatnonzero(block_above)[0])
        bad.append(f"{int(block_above.sum())} errors above their block's bound, e.g. at {i}: "
                   f"{err[i]!r} > {per_block[i]!r}")
    exact_op = c["what"] == "Allgather" or c["op"] != "sum"
    if info.method in EXACT_METHODS and exact_op and E != 0:
        bad.append(f"an exact {info.method} call with bound {E!r}, not 0")
    finite_in = bool(WORLD.allreduce(bool(np.isfinite(x.astype(np.float64)).all()), MPI.LAND))
    if c["kind"] in TAME and finite_in and not E < math.inf:
        bad.append(f"no finite bound ({E!r}) on finite data far from overflow")
    if P == 1 and (E != 0 or (c["what"] != "Reduce_scatter_block"
                              and out.tobytes() != x.tobytes())):
        bad.append(f"one rank: not a copy with bound 0 (bound {E!r})")
    same = WORLD.allgather((np.float64(E).tobytes(), info.method, hashlib.sha1(out).digest()))
    if len({s[:2] for s in same}) != 1:
        bad.append(f"bound or method differ between ranks: {[s[:2] for s in same]}")
    if c["what"] != "Reduce_scatter_block" and len({s[2] for s in same}) != 1:
        bad.append("results differ between ranks")
    everyone = WORLD.allgather(bad)
    worst = float(np.nanmax(err)) if np.isfinite(err).any() else 0.0
    return [f"rank {r}: {b}" for r, bs in enumerate(everyone) for b in bs], \
        (info.method, info.wire, E, worst)


# --- rank 0 draws, every rank runs -------------------------------------------------------

class Tally:
    """What the cases covered (printed by rank 0 with -s)."""

    def __init__(self):
        self.paths = collections.Counter()
        self.ratio = {}

    def add(self, c, method, wire, E, worst):
        path = f"{method}/{wire}" if wire else method
        self.paths[(path, c["what"])] += 1
        self.paths[("kind", c["kind"])] += 1
        self.paths[("dtype", c["dtype"])] += 1
        self.paths[("values", min(10 ** len(str(c["n"])), 10 ** 5))] += 1
        self.paths[("op", c["op"])] += 1
        if c["what"] == "Allreduce":
            self.paths[("form", c["form"])] += 1
        if 0 < E < math.inf:
            self.ratio[path] = max(self.ratio.get(path, 0.0), worst / E)

    def show(self):
        print(f"\n{sum(k for (a, _), k in self.paths.items() if a == 'kind')} "
              f"calls at {P} rank(s)")
        for key, k in sorted(self.paths.items()):
            print(f"  {key[0]:>22} {key[1]:<22} {k}")
        for path, r in sorted(self.ratio.items()):
            print(f"  largest error / bound {path:<18} {r:.3f}")


def run_case(comms, tally, c):
    """Case c on every rank: the failed checks (an exception, raised on
    every rank as the library promises, counts as one)."""
    if VERBOSE and RANK == 0:
        print(f"case {c}", flush=True)
    try:
        failed, (method, wire, E, worst) = check(comms.get(c), c)
    except Exception as e:                  # noqa: BLE001 - reported as the case's failure
        where = traceback.extract_tb(e.__traceback__)[-1]
        return [f"{type(e).__name__}: {e} ({os.path.basename(where.filename)}:{where.lineno})"]
    tally.add(c, method, wire, E, worst)
    return failed


def drawn(comms, tally, path):
    """Rank 0's hypothesis test: it draws the cases, sends each to every
    rank and runs it (mpi_helpers.rank0_draws)."""
    @settings(max_examples=max(1, round(CASES * PATHS[path])),
              derandomize=SEED is None, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], print_blob=True)
    @given(cases(*path))
    def prop(c):
        WORLD.bcast(c)
        failed = run_case(comms, tally, c)
        assert not failed, f"case {c}: " + "; ".join(failed[:6])
    return prop if SEED is None else seed(int(SEED))(prop)


@pytest.mark.parametrize("path", PATHS, ids="/".join)
def test_bound_holds_on_drawn_cases(path):
    comms, tally = Comms(), Tally()
    try:
        failure = rank0_draws(drawn(comms, tally, path), lambda c: run_case(comms, tally, c))
    finally:
        comms.free()
    if RANK == 0:
        tally.show()
    everywhere(failure is None, f"rank 0's hypothesis run: {failure}")
