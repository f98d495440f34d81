"""The int4, fp8 and affine wires through QuantizedComm under MPI, at any
number of ranks.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_formats.py

Every rank builds every rank's input from one seed and runs the numpy
simulation of the ring with the wire's reference codec
(reference_formats.py); per-rank checks are combined across ranks before
asserting.
"""
import numpy as np
import pytest
from mpi4py import MPI
from reference import BF16, allgather, ring_allreduce
from reference_formats import CODECS

from equarx_mpi import QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
DTYPES = [np.float32, np.float64, np.float16, BF16]
WIRES = list(CODECS)
OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
BLOCK = 64


def everywhere(ok, what):
    bad = [r for r, v in enumerate(WORLD.allgather(bool(ok))) if not v]
    assert not bad, f"{what} failed on ranks {bad}"


def same_on_all_ranks(arr):
    ref = WORLD.bcast(arr.tobytes() if WORLD.Get_rank() == 0 else None)
    everywhere(arr.tobytes() == ref, "bitwise identical results")


def inputs(P, n, dtype, seed, offset=0.0):
    rng = np.random.default_rng(seed)
    scale = 1.0 if offset == 0 else offset / 100
    with np.errstate(over="ignore"):
        return [(offset + scale * rng.standard_normal(n)).astype(dtype) for _ in range(P)]


def exact_sum(xs):
    return np.sum([x.astype(np.float64) for x in xs], axis=0)


def sum_slack(xs):
    """What the float64 reference sum itself may be off by."""
    return len(xs) * 2.0 ** -52 * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)


def qcomm(wire, **kw):
    return QuantizedComm(WORLD, wire=wire, block_size=BLOCK, min_quantized_bytes=0, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("wire", WIRES)
def test_allreduce_matches_simulation_within_bound(wire, dtype):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    with qcomm(wire) as qc:
        for n, offset in ((1, 0), (257, 0), (4099, 0), (3001, 1000.0)):
            xs = inputs(P, n, dtype, seed=n, offset=offset)
            out = np.empty_like(xs[r])
            qc.Allreduce(xs[r], out)
            ref, bound, _ = ring_allreduce(xs, BLOCK, with_bound=True, codec=CODECS[wire])
            everywhere(np.array_equal(out.view(np.uint8), ref.view(np.uint8)),
                       f"n={n}: equal to the numpy ring simulation")
            same_on_all_ranks(out)
            err = np.abs(out.astype(np.float64) - exact_sum(xs))
            everywhere((err <= bound + sum_slack(xs)).all(), f"n={n}: within the bound")


@pytest.mark.parametrize("wire", WIRES)
def test_flagged_blocks_equal_mpi(wire):
    """Blocks holding Inf or NaN, or whose partial sums overflow, come back
    as MPI_Allreduce gives them; the other blocks as the simulation."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    xs = inputs(P, 1000, np.float32, seed=5)
    big = np.finfo(np.float32).max
    for s, x in enumerate(xs):
        x[70 + s] = [np.inf, -np.inf, np.nan][s % 3]
        x[300:310] = big * 0.9                   # overflows from 2 ranks on
        x[640] = np.array(0xFFC01234, np.uint32).view(np.float32) if s == 0 else 1.0
    with qcomm(wire) as qc:
        got = qc.allreduce(xs[r])
        counted = qc.last_call.exact_values
    want = np.empty_like(got)
    WORLD.Allreduce(xs[r], want)
    ref, _, flagged = ring_allreduce(xs, BLOCK, with_bound=True, codec=CODECS[wire])
    everywhere(flagged[[70, 300, 640]].all() if P > 1 else True, "those blocks are flagged")
    everywhere(np.array_equal(got[flagged].view(np.uint32), want[flagged].view(np.uint32)),
               "flagged blocks equal MPI bit for bit")
    everywhere(np.array_equal(got[~flagged].view(np.uint32), ref[~flagged].view(np.uint32)),
               "other blocks equal the simulation")
    everywhere(P == 1 or counted == flagged.sum(), "exact_values counts them")
    same_on_all_ranks(got)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("wire", WIRES)
def test_max_min_quantized_when_asked_never_cross(wire, op):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    for dtype in (np.float32, np.float64):
        xs = inputs(P, 3001, dtype, seed=11)
        with qcomm(wire, lossy_ops=("sum", op)) as qc:
            got = qc.allreduce(xs[r], OPS[op])
            everywhere(P == 1 or qc.last_call.wire == wire, f"{op} travelled quantized")
        ref, bound, _ = ring_allreduce(xs, BLOCK, op=op, with_bound=True, codec=CODECS[wire])
        everywhere(got.tobytes() == ref.tobytes(), f"{op} equals the simulation")
        exact = getattr(np, op)([x.astype(np.float64) for x in xs], axis=0)
        g = got.astype(np.float64)
        everywhere((np.abs(g - exact) <= bound).all(), f"{op} within its bound")
        everywhere((g >= exact).all() if op == "max" else (g <= exact).all(),
                   f"quantized {op} never {'below' if op == 'max' else 'above'} the true {op}")


@pytest.mark.parametrize("wire", WIRES)
def test_reduce_scatter_block_and_allgather_match_simulation(wire):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    m = 1001
    xs = inputs(P, P * m, np.float32, seed=21)
    with qcomm(wire) as qc:
        mine = np.empty(m, np.float32)
        qc.Reduce_scatter_block(xs[r], mine)
        full = np.empty(P * m, np.float32)
        qc.Allgather(xs[r][:m], full)
    ref = ring_allreduce(xs, BLOCK, kind="reduce_scatter", codec=CODECS[wire])
    everywhere(mine.tobytes() == ref[r * m:(r + 1) * m].tobytes(),
               "Reduce_scatter_block equals the simulation")
    want = allgather([x[:m] for x in xs], BLOCK, codec=CODECS[wire])
    everywhere(P == 1 or full.tobytes() == want.tobytes(), "Allgather equals the simulation")
    same_on_all_ranks(full)


@pytest.mark.parametrize("wire", WIRES)
def test_extremes_exact_and_nothing_finite_becomes_inf(wire):
    """One quantization (Allgather): each block's largest magnitude (affine:
    its minimum and maximum) comes back exactly; +-max of the type and a
    block spanning -max..max stay finite through the whole ring."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    for dtype in (np.float32, np.float64):
        big = np.finfo(dtype).max
        rng = np.random.default_rng(r)
        mine = (101325 + 100 * rng.standard_normal(10 * BLOCK)).astype(dtype)
        full = np.empty(P * mine.size, dtype)
        with qcomm(wire) as qc:
            qc.Allgather(mine, full)
            blocks = full.reshape(-1, BLOCK)
            want = np.concatenate(WORLD.allgather(mine)).reshape(-1, BLOCK)
            if "affine" in wire:
                ok = ((blocks.min(axis=1) == want.min(axis=1))
                      & (blocks.max(axis=1) == want.max(axis=1))).all()
            else:
                ok = (np.abs(blocks).max(axis=1) == np.abs(want).max(axis=1)).all()
            everywhere(ok, f"{dtype.__name__}: block extremes exact")
            span = np.tile(np.r_[-big, np.linspace(-1, 1, BLOCK - 2) * big, big], 4)
            for x in (np.full(1000, big, dtype), np.full(1000, -big, dtype), span.astype(dtype)):
                got = qc.allreduce(x if r == 0 else np.zeros_like(x))
                everywhere(np.isfinite(got).all(), f"{dtype.__name__}: finite stays finite")
                everywhere(got[0] == x[0] and (P > 1 or got.tobytes() == x.tobytes()),
                           f"{dtype.__name__}: the extreme comes back exactly")


def test_affine_on_an_offset_field_beats_symmetric_int8():
    """101325 + 100 N(0,1) Pa: relative to the signal (the anomaly), the
    affine wire's error is a small fraction of symmetric int8's."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    xs = inputs(P, 1 << 15, np.float32, seed=8, offset=101325.0)
    exact = exact_sum(xs)
    signal = np.linalg.norm(exact - exact.mean())
    errs = {}
    for wire in ("int8", "int8-affine"):
        with QuantizedComm(WORLD, wire=wire, min_quantized_bytes=0) as qc:
            errs[wire] = np.linalg.norm(qc.allreduce(xs[r]) - exact) / signal
    everywhere(P == 1 or errs["int8-affine"] < errs["int8"] / 20, f"anomaly errors {errs}")
    everywhere(errs["int8-affine"] < 0.01 * max(1, np.log2(P)), f"affine error {errs}")
