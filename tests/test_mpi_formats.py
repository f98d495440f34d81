"""The int4, fp8 and affine wires through QuantizedComm under MPI, at any
number of ranks: what the block wires alone do.  test_mpi_schedules.py
checks them on every schedule against the numpy simulations (the ring's
with the wire's reference codec, reference_formats.py) bit for bit,
within the bounds, for Allreduce, MAX/MIN, Reduce_scatter_block and
Allgather.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_formats.py

Per-rank checks are combined across ranks before asserting.
"""
import numpy as np
import pytest
from mpi_helpers import WORLD, everywhere, exact_sum, inputs, same_on_all_ranks
from reference import ring_allreduce
from reference_formats import CODECS

from equarx_mpi import QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)
WIRES = list(CODECS)
BLOCK = 64


def qcomm(wire, **kw):
    return QuantizedComm(WORLD, wire=wire, block_size=BLOCK, min_quantized_bytes=0, **kw)


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
    xs = inputs(P, 1 << 15, np.float32, seed=8, scale=1013.25, offset=101325.0)
    exact = exact_sum(xs)
    signal = np.linalg.norm(exact - exact.mean())
    errs = {}
    for wire in ("int8", "int8-affine"):
        with QuantizedComm(WORLD, wire=wire, min_quantized_bytes=0) as qc:
            errs[wire] = np.linalg.norm(qc.allreduce(xs[r]) - exact) / signal
    everywhere(P == 1 or errs["int8-affine"] < errs["int8"] / 20, f"anomaly errors {errs}")
    everywhere(errs["int8-affine"] < 0.01 * max(1, np.log2(P)), f"affine error {errs}")
