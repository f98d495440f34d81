"""Property test of the error-bounded mode under MPI (hypothesis): for
random lengths, dtypes, block sizes, tolerances and adversarial data
(per-block outliers, magnitudes that differ across ranks, near
cancellation, constant blocks, subnormals, values near each dtype's
limits, Inf/NaN; smooth fields with offsets, whose blocks go DELTA), either every rank raises the same ValueError (the
tolerance is finer than the float additions and the output type allow),
or the call's ``last_error_bound`` is at most its tolerance and no finite
result value is further than that bound from the exact sum (math.fsum),
the same on every rank.

Rank 0 runs hypothesis (derandomized, no database): it draws each case
and broadcasts it, every rank runs it, and the verdicts are combined, so
a failure (and hypothesis' shrinking of it, on rank 0) happens on every
rank alike (the pattern of test_mpi_hypothesis.py).

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_tolerance_property.py
    EQUARX_MPI_HYPOTHESIS_CASES=3000 mpirun -n 4 ... -s   # thousands; -s: counts
"""
import collections
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import everywhere, rank0_draws
from reference import BF16
from test_mpi_bound import exact_error

from equarx_mpi import QuantizedComm
from equarx_mpi.wire import mixed

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()
CASES = int(os.environ.get("EQUARX_MPI_HYPOTHESIS_CASES", "150"))
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16]
KINDS = ["normal", "outliers", "ranks", "cancel", "constant", "subnormal", "limits",
         "nonfinite", "smooth", "field", "pressure", "ramp"]
TOLS = [1e-12, 1e-7, 1e-5, 1e-3, 1e-2, 0.1, 0.5]
_COMMS = {}


def qcomm(mode, tol, block, predict):
    """One QuantizedComm per (mode, tolerance, block, prediction): made once,
    collectively (every rank draws the same examples, so the same ones in
    the same order); its format, made at its first call, reads
    mixed.PREDICT then (run_case sets it: on one node it is off by
    default, and the cases test both)."""
    key = (mode, tol, block, predict)
    if key not in _COMMS:
        _COMMS[key] = QuantizedComm(WORLD, block_size=block, min_quantized_bytes=0,
                                    chunks=2, **{mode: tol})
    return _COMMS[key]


def limits(dt):
    if dt == BF16:
        return float(np.array(0x7F7F, np.uint16).view(BF16)), 2.0 ** -133
    f = np.finfo(dt)
    return float(f.max), float(f.smallest_subnormal)


def inputs(kind, seed, n, dt, block):
    """Every rank's input (the same list on every rank)."""
    rng = np.random.default_rng(seed)
    big, sub = limits(dt)
    nb = -(-n // block)
    xs = []
    for r in range(P):
        g = rng.standard_normal(n)
        if kind == "outliers":                  # one huge value per block
            g[np.minimum(rng.integers(0, block, nb) + np.arange(nb) * block, n - 1)] = 1e4
        elif kind == "ranks":                   # each rank its own magnitude
            g *= 10.0 ** (3 * r - 4)
        elif kind == "cancel":                  # rank 1 nearly cancels rank 0
            g = (xs[0].astype(np.float64) * -1 + 1e-3 * g) if r == 1 else g
        elif kind == "constant":
            g = np.repeat(rng.choice([0.0, -0.0, 1.0, -3.5, 1e-3], nb), block)[:n]
        elif kind == "subnormal":
            g = np.round(g * 8) * sub
        elif kind == "limits":
            g = rng.choice([big, -big, big / P, -big / P, 0.0], n) * rng.choice([1.0, 0.5], n)
        elif kind == "nonfinite":
            g[rng.integers(0, n, max(1, n // 100))] = rng.choice([np.inf, -np.inf, np.nan])
        elif kind == "smooth":
            g = 50.0 + np.sin(np.arange(n) / 40.0 + r) + 1e-3 * g
        # smooth with offsets, where blocks go DELTA (prediction): a
        # temperature, a pressure, a steep ramp with grid indices near 2^24
        elif kind == "field":
            t = np.arange(n) / rng.uniform(5.0, 200.0)
            g = 280.0 + 12.0 * np.sin(t + r) + 3.0 * np.cos(3.1 * t) + 1e-4 * g
        elif kind == "pressure":
            g = 1e5 + 800.0 * np.sin(np.arange(n) / rng.uniform(5.0, 200.0) + r)
        elif kind == "ramp":
            g = 1.6e7 * rng.uniform(-1, 1) + np.arange(n) * rng.uniform(-3, 3) + np.sin(g)
        with np.errstate(over="ignore", invalid="ignore"):
            xs.append(np.asarray(g, np.float64).astype(dt))
    return xs


def run_case(c):
    """Every rank runs case c; (failure in words or None, what happened),
    the same on every rank (the verdicts are combined)."""
    m, dt, block, mode, tol = c["m"], c["dt"], c["block"], c["mode"], c["tol"]
    kind, what, in_place = c["kind"], c["what"], c["in_place"]
    n = m * P
    xs = inputs(kind, c["seed"], n, dt, block)
    qc = qcomm(mode, tol, block, c["predict"])
    mixed.PREDICT = c["predict"]
    try:
        if what == "Allreduce":
            out = xs[RANK].copy() if in_place else np.empty(n, dt)
            qc.Allreduce(MPI.IN_PLACE if in_place else xs[RANK], out)
            parts = np.array(xs, np.float64)
        else:
            buf = xs[RANK].copy()
            out = np.empty(m, dt)
            qc.Reduce_scatter_block(MPI.IN_PLACE if in_place else buf, buf if in_place else out)
            out = buf[:m] if in_place else out
            parts = np.array([x[RANK * m:(RANK + 1) * m] for x in xs], np.float64)
        got = None
    except ValueError as e:
        got = str(e)
    finally:
        mixed.PREDICT = None
    desc = (what, dt.name, kind, mode, tol, block, m, in_place, c["predict"])
    everyone = WORLD.allgather(got)
    if len(set(everyone)) != 1:
        return f"{desc}: outcomes differ between ranks: {everyone}", "?"
    if got is not None:
        ok = P > 1 and ("need " + mode in got or "overflow" in got)
        return (None if ok else f"{desc}: {got}"), "refused: too fine"
    fin = np.abs(np.array(xs, np.float64))
    M = float(fin[np.isfinite(fin)].max(initial=0.0))
    limit = tol if mode == "abs_tol" else tol * M
    b = qc.last_error_bound
    err = exact_error(out, parts, "sum")
    seen = err[~np.isnan(err)]
    worst = float(seen.max()) if seen.size else 0.0
    mine = None if b <= limit and worst <= b else f"error {worst} <= bound {b} <= tol {limit}"
    verdicts = WORLD.allgather((mine, np.float64(b).tobytes()))
    bad = [(r, v) for r, (v, _) in enumerate(verdicts) if v]
    if len({bits for _, bits in verdicts}) != 1:
        bad.append(("bound", "differs between ranks"))
    return (f"{desc}: {bad[:3]}" if bad else None), f"ran: {qc.last_call.method}"


def drawn(seen):
    """Rank 0's hypothesis test: it draws each case, sends it to every rank
    and runs it (mpi_helpers.rank0_draws); ``seen`` counts what happened."""
    @settings(derandomize=True, database=None, deadline=None, max_examples=CASES,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(m=st.integers(1, 700), dt=st.sampled_from(DTYPES),
           block=st.sampled_from([32, 64, 256]), mode=st.sampled_from(["abs_tol", "rel_tol"]),
           tol=st.sampled_from(TOLS), kind=st.sampled_from(KINDS), seed=st.integers(0, 2 ** 31),
           what=st.sampled_from(["Allreduce", "Reduce_scatter_block"]), in_place=st.booleans(),
           predict=st.sampled_from([True, None]))
    def prop(**c):
        WORLD.bcast(c)
        failed, happened = run_case(c)
        seen[happened] += 1
        assert failed is None, failed
    return prop


def test_error_bounded_mode_property():
    seen = collections.Counter()
    failure = rank0_draws(drawn(seen), run_case)
    if RANK == 0:
        print(f"cases at {P} ranks: {dict(seen)}", flush=True)     # with -s
    everywhere(failure is None, f"rank 0's hypothesis run: {failure}")


def teardown_module():
    for qc in _COMMS.values():
        qc.free()
    _COMMS.clear()
