"""Randomized property test of every collective under MPI: random dtypes,
block sizes, lengths around block and rank multiples, ops, in place or
not, and adversarial data (values at each type's limits, subnormal block
maxima, signed zeros, NaN with sign and payload, Inf mixes, constant
blocks, masks, outliers, mixed magnitudes across ranks, near-cancellation,
offsets).  Each case is checked against exact answers:

- bitwise identical on every rank;
- equal, bit for bit, to the numpy simulation of the schedule (tests/reference.py);
- within the per-value error bound along the path (half a step per
  quantization plus every rounding), against an exact float64 reduction;
- no non-finite value unless the exact result overflows the type; blocks
  that were reduced exactly (Inf/NaN inside) equal MPI's own Allreduce of
  those values bit for bit;
- MAX and MIN (exact by default) equal MPI's result bit for bit.

Quantized MAX/MIN and their direction are checked in test_mpi_schedules.py.

    mpirun -n 5 python -m pytest --with-mpi tests/test_mpi_property.py

EQUARX_MPI_PROPERTY_CASES (default 60) sets the number of cases per run;
EQUARX_MPI_PROPERTY_SEED changes the seed.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI
from reference import BF16, allgather, ring_allreduce

from equarx_mpi import QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
CASES = int(os.environ.get("EQUARX_MPI_PROPERTY_CASES", "60"))
SEED = int(os.environ.get("EQUARX_MPI_PROPERTY_SEED", "2026"))
DTYPES = [np.float32, np.float64, np.float16, BF16]
BLOCKS = [32, 64, 256, 1024]
KINDS = ["normal", "limits", "smallest-normal", "subnormal-sweep", "signed-zeros", "nan",
         "inf", "constant", "mask", "outliers", "mixed-ranks", "cancel", "offset"]


def type_max(dt):
    return float(np.array(0x7F7F, np.uint16).view(BF16)) if dt == BF16 else float(np.finfo(dt).max)


def type_tiny(dt):
    return 2.0 ** -126 if dt == BF16 else float(np.finfo(dt).tiny)


def make(rng, kind, n, P, dt, block):
    """Every rank's input for one case (the same on every rank)."""
    nb = -(-n // block)
    big, tiny = type_max(dt), type_tiny(dt)
    per_block = lambda v: np.repeat(v, block)[:n]            # noqa: E731
    xs = []
    for r in range(P):
        g = rng.standard_normal(n)
        if kind == "limits":
            g = rng.choice([big, -big, 0.0, big / 3], n) / (P if rng.random() < 0.5 else 1)
        elif kind == "smallest-normal":
            g = g * tiny
        elif kind == "subnormal-sweep":
            g = np.round(g * 2.0 ** rng.integers(0, 20)) * tiny * 2.0 ** -23
        elif kind == "signed-zeros":
            g = np.where(per_block(rng.random(nb) < 0.7), 0.0, g) * rng.choice([-1.0, 1.0], n)
            g = np.where(g == 0, rng.choice([-0.0, 0.0]), g)
        elif kind == "nan":
            i = rng.integers(0, n, max(1, n // 500))
            g[i] = np.array(rng.integers(0x7FC00001, 0x7FFFFFFF, i.size) |
                            (rng.integers(0, 2, i.size) << 31), np.uint32).view(np.float32)
        elif kind == "inf":
            i = rng.integers(0, n, max(1, n // 300))
            g[i] = rng.choice([np.inf, -np.inf], i.size)
        elif kind == "constant":
            g = per_block(rng.choice([0.1, -3.0, 1.0], nb))
        elif kind == "mask":
            g = (rng.random(n) < 0.4).astype(float)
        elif kind == "outliers":
            g[rng.integers(0, n, max(1, n // 200))] *= 1e6
        elif kind == "mixed-ranks":
            g = g * 10.0 ** rng.integers(-8, 8)
        elif kind == "cancel":
            g = (xs[0] if r else g) * (-1.0 if r % 2 else 1.0) + rng.standard_normal(n) * 1e-4
        elif kind == "offset":
            g = 101325.0 + 100 * g
        with np.errstate(over="ignore", invalid="ignore"):
            x = np.asarray(g, np.float64).astype(dt)
        if kind not in ("nan", "inf") and kind != "limits":
            x[~np.isfinite(x.astype(np.float64))] = 0
        xs.append(x)
    return xs


def draw(rng, P):
    dt = np.dtype(DTYPES[rng.integers(len(DTYPES))])
    block = int(rng.choice(BLOCKS))
    unit = block * max(P, 1)
    n = int(max(1, rng.integers(0, 5) * unit + rng.choice([-1, 0, 1, int(rng.integers(1, block))])))
    kind = str(rng.choice(KINDS))
    call = str(rng.choice(["Allreduce"] * 4 + ["Reduce_scatter_block", "Allgather"]))
    op = str(rng.choice(["sum"] * 4 + ["max", "min"])) if call != "Allgather" else "sum"
    if dt == BF16 and kind == "limits" and op == "sum":
        kind = "normal"          # bf16 max * P overflows in float32 too: covered elsewhere
    return dt, block, n, kind, call, op, bool(rng.random() < 0.4)


OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def mpi(call, x, op, out_size=None):
    """MPI's own collective ``call`` on x (float32 for bfloat16, which MPI lacks)."""
    y = x.astype(np.float32) if x.dtype == BF16 else x.copy()
    if call == "Allreduce":
        WORLD.Allreduce(MPI.IN_PLACE, y, OPS[op])
        return y.astype(x.dtype)
    res = np.empty(out_size, y.dtype)
    WORLD.Reduce_scatter_block(y, res, OPS[op])
    return res.astype(x.dtype)


def run_library(qc, call, xs, r, op, in_place, n, P, dt):
    if call == "Allgather":
        out = np.empty(P * n, dt)
        if in_place:
            out[r * n:(r + 1) * n] = xs[r]
            qc.Allgather(MPI.IN_PLACE, out)
        else:
            qc.Allgather(xs[r], out)
        return out
    if call == "Reduce_scatter_block":
        if in_place:
            buf = xs[r].copy()
            qc.Reduce_scatter_block(MPI.IN_PLACE, buf, OPS[op])
            return buf[:n].copy()
        out = np.empty(n, dt)
        qc.Reduce_scatter_block(xs[r], out, OPS[op])
        return out
    out = xs[r].copy() if in_place else np.empty(n, dt)
    qc.Allreduce(MPI.IN_PLACE if in_place else xs[r], out, OPS[op])
    return out


def first_checks(out, xs, call, block, P, r):
    """(every rank's results, checks, done) after gathering the results on
    rank 0 (collective): rank 0's checks every case shares, the same bits
    on every rank, a copy on one rank, an Allgather against its simulation;
    done when no reduction's checks follow (always on other ranks)."""
    outs = WORLD.gather(out)
    if r != 0:
        return outs, [], True
    checks = [("identical on all ranks", call == "Reduce_scatter_block"
               or all(o.tobytes() == outs[0].tobytes() for o in outs))]
    if P == 1:
        return outs, checks + [("copy", out.tobytes() == xs[0].tobytes())], True
    if call == "Allgather":
        ref = allgather(xs, block)
        bad = np.isnan(ref.astype(np.float64))
        raw = np.concatenate(xs)
        return outs, checks + [("simulation", out[~bad].tobytes() == ref[~bad].tobytes()),
                               ("exact blocks", out[bad].tobytes() == raw[bad].tobytes())], True
    return outs, checks, False


def checked_against(outs, xs, call, op, dt, P, ref, bound, flagged, fixed):
    """Rank 0's checks of a quantized reduction's gathered results ``outs``
    against its simulation (ref, per-value bound, flagged values) and MPI's
    exact reduction of the flagged values (``fixed``)."""
    full = np.concatenate(outs) if call == "Reduce_scatter_block" else outs[0]
    x64 = np.array([x.astype(np.float64) for x in xs])
    with np.errstate(invalid="ignore", over="ignore"):
        true = x64.sum(axis=0) if op == "sum" else getattr(np, op)(x64, axis=0)
        slack = P * 2.0 ** -52 * np.abs(x64).sum(axis=0)
        o = full.astype(np.float64)
        ok = ~flagged
        overflow = np.isinf(true.astype(dt))       # the exact result overflows the type
        err_ok = (np.abs(o[ok] - true[ok]) <= bound[ok] + slack[ok]).all()
    return [("simulation", full[ok].tobytes() == ref[ok].tobytes()),
            ("bound", bool(err_ok)),
            ("finite", bool((np.isfinite(o[ok]) | overflow[ok]).all())),
            ("exact blocks", full[flagged].tobytes() == fixed.tobytes())]


def check_case(qcs, rng, P, r):
    """Run one case on every rank; rank 0 gathers every result and checks
    them (the simulation is costly: once is enough).  Returns the failed
    checks, on rank 0."""
    dt, block, n, kind, call, op, in_place = draw(rng, P)
    desc = (dt, block, n, kind, call, op, in_place)
    xs = make(rng, kind, P * n if call == "Reduce_scatter_block" else n, P, dt, block)
    out = run_library(qcs[block], call, xs, r, op, in_place, n, P, dt)
    flagged = None
    if call != "Allgather" and op == "sum" and P > 1:
        # blocks with Inf/NaN go to MPI's Allreduce, on just those values
        # (collective: every rank computes which)
        kind_ = "reduce_scatter" if call == "Reduce_scatter_block" else "allreduce"
        ref, bound, flagged = ring_allreduce(xs, block, op, with_bound=True, kind=kind_)
        fixed = mpi("Allreduce", xs[r][flagged], op)
    elif call != "Allgather" and P > 1:
        want = mpi(call, xs[r], op, n)            # MAX and MIN: exact unless asked otherwise
    outs, checks, done = first_checks(out, xs, call, block, P, r)
    if done:
        return desc, checks
    if flagged is None:
        return desc, checks + [("as MPI", out.tobytes() == want.tobytes())]
    return desc, checks + checked_against(outs, xs, call, op, dt, P, ref, bound, flagged, fixed)


def check_schedule_case(qcs, rng, P, r, simulate, allgather=True):
    """One random case of a quantized schedule (MAX and MIN quantized too)
    whose numpy simulation is simulate(xs, block, op, with_bound=True,
    kind=...); ``allgather=False`` runs an Allreduce where the generator
    drew an Allgather.  Rank 0 checks every rank's result; returns the
    checks there."""
    dt, block, n, kind, call, op, in_place = draw(rng, P)
    if call == "Allgather" and not allgather:
        call = "Allreduce"
    desc = (dt, block, n, kind, call, op, in_place)
    xs = make(rng, kind, P * n if call == "Reduce_scatter_block" else n, P, dt, block)
    out = run_library(qcs[block], call, xs, r, op, in_place, n, P, dt)
    if call != "Allgather" and P > 1:
        kind_ = "reduce_scatter" if call == "Reduce_scatter_block" else "allreduce"
        sim = simulate(xs, block, op, with_bound=True, kind=kind_)
        fixed = mpi("Allreduce", xs[r][sim[2]], op)      # collective: every rank
    outs, checks, done = first_checks(out, xs, call, block, P, r)
    if done:
        return desc, checks
    return desc, checks + checked_against(outs, xs, call, op, dt, P, *sim, fixed)


def run_cases(qcs, seed, cases, check):
    """``cases`` random cases, each check(qcs, rng, P, r), on the
    communicators qcs (by block size; freed after); the same random stream
    on every rank, and every rank asserts rank 0's verdict."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    rng = np.random.default_rng(seed)
    failures = []
    try:
        for case in range(cases):
            desc, checks = check(qcs, rng, P, r)
            bad = [name for name, ok in checks if not ok]
            if bad:
                failures.append((case, desc, bad))
    finally:
        for q in qcs.values():
            q.free()
    failures = WORLD.bcast(failures)
    assert not failures, f"{len(failures)} failing cases, e.g. {failures[:3]}"


def test_random_cases_against_exact_answers():
    qcs = {b: QuantizedComm(WORLD, block_size=b, min_quantized_bytes=0) for b in BLOCKS}
    run_cases(qcs, SEED + WORLD.Get_size(), CASES, check_case)
