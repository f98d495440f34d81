"""Inf and NaN in any rank's input: every block holding one comes back as
MPI_Allreduce gives it (bit for bit, on every rank), whatever the op, the
schedule, the wire and where the value sits; every other block stays
within the call's error bound.

Each call carries many placements at once, one per block: the same list of
patterns (which ranks hold which special values where in the block) is
laid out once per shard, with a clean block after each, so every pattern
meets every shard owner and every position along the ring.

    mpirun -n 3 python -m pytest --with-mpi tests/test_mpi_nonfinite.py
    EQUARX_MPI_FAKE_NODES=2x2 mpirun -n 4 python -m pytest --with-mpi \\
        tests/test_mpi_nonfinite.py::test_hierarchical_nonfinite_blocks_are_mpis
"""
import hashlib
import math
import os

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere
from reference import BF16

from equarx_mpi import QuantizedComm
from equarx_mpi.collectives.exact import UPCAST_DTYPES
from equarx_mpi.collectives.nodes import parse_nodes

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
B = 32
DTYPES = [np.float32, np.float64, np.float16, BF16]
OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
LOSSY = dict(lossy_ops=("sum", "max", "min"), min_quantized_bytes=0, block_size=B)
#: +Inf, -Inf, quiet NaN, negative NaN with a payload, signalling NaN
SPECIALS = {np.dtype(np.float32): [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC0BEEF, 0x7FA00001],
            np.dtype(np.float64): [0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
                                   0xFFF800000000BEEF, 0x7FF4000000000001],
            np.dtype(np.float16): [0x7C00, 0xFC00, 0x7E00, 0xFE5A, 0x7D01],
            BF16: [0x7F80, 0xFF80, 0x7FC0, 0xFFDA, 0x7FA1]}
PINF, NINF, QNAN, NNAN, SNAN = range(5)
PLAIN = ("bf16", "fp32")
#: every wire on float32, a few on the other types (the kernels convert
#: them the same way for every wire); the first is also run in place
RING_WIRES = {np.dtype(np.float32): ("int8", "int4", "fp8", "int8-affine", "int4-affine",
                                     "bf16", "fp32"),
              np.dtype(np.float64): ("int8", "fp8", "int4-affine", "fp32"),
              np.dtype(np.float16): ("int4", "int8-affine", "bf16"),
              BF16: ("int8-affine", "int4-affine", "fp8", "bf16")}
TWO_SHOT_WIRES = ("int8", "bf16", "fp32")
#: between nodes two-shot for int8, bf16, fp32, the ring for the others
HIERARCHICAL_WIRES = {np.dtype(np.float32): ("int8", "int4", "int8-affine", "fp32"),
                      np.dtype(np.float64): ("int8", "fp8"),
                      np.dtype(np.float16): ("int4", "bf16"),
                      BF16: ("int8-affine", "int8")}


def patterns(P):
    """Per block, the (rank, position, special) it holds: each special on
    each rank alone; pairs of ranks (neighbours, one apart, first and last:
    every pair up to 4 ranks) with opposite infinities, with two NaNs of
    different payloads at one position, with a NaN and an infinity; one
    rank with two specials; every rank with the same one."""
    out = [[(r, (3 * r + s) % B, s)] for s in range(5) for r in range(P)]
    pairs = sorted({(r, r + d) for r in range(P) for d in (1, 2) if r + d < P}
                   | ({(0, P - 1)} if P > 1 else set()))
    for r1, r2 in pairs:
        out += [[(r1, 0, PINF), (r2, B - 1, NINF)],
                [(r1, 7, NNAN), (r2, 7, QNAN)],
                [(r1, 9, SNAN), (r2, 9, NNAN)],
                [(r1, 4, QNAN), (r2, 5, PINF)]]
    out += [[(r, 1, PINF), (r, 2, NINF)] for r in range(P)]
    out += [[(r, 11, s) for r in range(P)] for s in range(5)]
    return out


def build(dtype, P, r):
    """(this rank's input, per-block mask of the blocks holding a special
    on some rank): the patterns once per shard, a clean block after each,
    padded with clean blocks to a multiple of 6 and P blocks (node slices
    of 2 or 3 ranks and shards then start on block boundaries)."""
    dtype = np.dtype(dtype)
    pats = patterns(P)
    used = 2 * len(pats) * P
    step = math.lcm(6, P)
    nblocks = -(-used // step) * step
    x = np.random.default_rng(1000 + r).standard_normal(nblocks * B).astype(dtype)
    bits = x.view(f"u{dtype.itemsize}")
    dirty = np.zeros(nblocks, bool)
    for c in range(P):
        for j, pat in enumerate(pats):
            b = 2 * (c * len(pats) + j)
            dirty[b] = True
            for rank, pos, s in pat:
                if rank == r:
                    bits[b * B + pos] = SPECIALS[dtype][s]
    return x, dirty


def mpi_allreduce(x, op, dirty):
    """What MPI_Allreduce gives for the values of the dirty blocks alone
    (the library reduces those alone: MPI's result may depend on the count,
    as its algorithm does), in float32 where the library reduces in float32
    (MPI has no bfloat16, perhaps no float16); elsewhere x.  One rank: x
    (the library copies)."""
    if WORLD.Get_size() == 1:
        return x.copy()
    mask = np.repeat(dirty, B)
    y = x[mask].astype(np.float32) if x.dtype in UPCAST_DTYPES else x[mask]
    out = x.copy()
    with np.errstate(all="ignore"):
        WORLD.Allreduce(MPI.IN_PLACE, y, op)
        out[mask] = y.astype(x.dtype)
    return out


def exact(x, name):
    """The exact reduction (float64 is exact enough here: the bounds are
    far larger than its rounding) of every rank's input."""
    with np.errstate(all="ignore"):
        xs = np.array(WORLD.allgather(x.astype(np.float64)))
        return {"sum": xs.sum(axis=0), "max": xs.max(axis=0), "min": xs.min(axis=0)}[name]


def check(qc, got, want, exact_values, dirty, label, bad, offset=0, count=None, shared=True):
    """Compare one call's result (``got``, its blocks' dirty mask) with MPI
    (``want``) and the exact values; note failures in ``bad``.  ``count``:
    the values reduced exactly (default: the dirty blocks'); ``shared``:
    the result is the same on every rank."""
    n = got.size
    mask = np.repeat(dirty, B)[:n]
    digest = hashlib.sha1(got.tobytes()).hexdigest()
    same = len(set(WORLD.allgather(digest))) == 1
    g, w = got.reshape(-1, B), want.reshape(-1, B)
    differ = [int(b) + offset for b in np.flatnonzero(dirty)
              if g[b].tobytes() != w[b].tobytes()]
    info = qc.last_call
    clean = got[~mask].astype(np.float64)
    err = np.abs(clean - exact_values[~mask]).max(initial=0.0)
    P = WORLD.Get_size()
    count = (int(mask.sum()) if count is None else count) if P > 1 else 0
    if shared and not same:
        bad.append(f"{label}: ranks differ")
    if differ:
        bad.append(f"{label}: {len(differ)} of {int(dirty.sum())} blocks with Inf/NaN differ "
                   f"from MPI (blocks {differ[:6]})")
    if not np.isfinite(clean).all() or not err <= info.error_bound:
        bad.append(f"{label}: clean blocks off by {err} > bound {info.error_bound}")
    if info.exact_values != count and not differ:
        bad.append(f"{label}: exact_values {info.exact_values}, want {count}")


def report(bad):
    everywhere(not bad, f"{len(bad)} cases:\n" + "\n".join(bad[:40]))


def wires(algorithm, dtype):
    return RING_WIRES[np.dtype(dtype)] if algorithm == "ring" else TWO_SHOT_WIRES


def ops(wire):
    """The ops a wire carries: MAX and MIN travel only on the wires that
    round up and down (the others leave them to MPI)."""
    return {"sum": MPI.SUM} if wire in PLAIN else OPS


def run_allreduce(algorithm, wires, dtype, bad, in_place_all=False):
    """Every wire's calls; in place for the first wire only (the fix-up is
    the wire's), unless ``in_place_all``."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x, dirty = build(dtype, P, r)
    for wire in wires:
        with QuantizedComm(WORLD, algorithm=algorithm, wire=wire, **LOSSY) as qc:
            for name, op in ops(wire).items():
                for in_place in (False, True) if in_place_all or wire == wires[0] else (False,):
                    got = x.copy()
                    if in_place:
                        qc.Allreduce(MPI.IN_PLACE, got, op)
                    else:
                        got = np.empty_like(x)
                        qc.Allreduce(x, got, op)
                    label = (f"{algorithm} {wire} {np.dtype(dtype).name} {name}"
                             f"{' in place' if in_place else ''}")
                    method = qc.last_call.method
                    if method != ("copy" if P == 1 else algorithm):
                        bad.append(f"{label}: ran {method}")
                    check(qc, got, mpi_allreduce(x, op, dirty), exact(x, name), dirty, label,
                          bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("algorithm", ["ring", "two_shot"])
def test_nonfinite_blocks_are_mpis(algorithm, dtype):
    bad = []
    run_allreduce(algorithm, wires(algorithm, dtype), dtype, bad)
    report(bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("algorithm", ["ring", "two_shot"])
def test_reduce_scatter_nonfinite_blocks_are_mpis(algorithm, dtype):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x, dirty = build(dtype, P, r)
    m, mb = x.size // P, dirty.size // P
    mine = slice(r * m, (r + 1) * m)
    bad = []
    for wire in wires(algorithm, dtype):
        with QuantizedComm(WORLD, algorithm=algorithm, wire=wire, **LOSSY) as qc:
            for name, op in ops(wire).items():
                got = np.empty(m, x.dtype)
                qc.Reduce_scatter_block(x, got, op)
                label = f"{algorithm} {wire} {np.dtype(dtype).name} {name}"
                method = qc.last_call.method
                if method != ("copy" if P == 1 else algorithm):
                    bad.append(f"{label}: ran {method}")
                # the flagged blocks of every rank, reduced together
                want = mpi_allreduce(x, op, dirty)[mine]
                # every rank's result is its own: the bound covers them all
                check(qc, got, want, exact(x, name)[mine], dirty[r * mb:(r + 1) * mb], label,
                      bad, offset=r * mb, count=int(dirty.sum()) * B, shared=False)
    report(bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_allgather_nonfinite_blocks_are_the_owners_bits(dtype):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    x, _ = build(dtype, P, r)
    m = x.size // P
    own = x[r * m:(r + 1) * m]             # each rank's own share of the patterns
    want = np.empty_like(x)
    WORLD.Allgather(own.view(f"u{x.itemsize}"), want.view(f"u{x.itemsize}"))
    with np.errstate(all="ignore"):      # blocks whose owner holds Inf or NaN
        held = ~np.isfinite(want.astype(np.float64).reshape(-1, B)).all(axis=1)
    bad = []
    for wire in wires("ring", dtype):
        with QuantizedComm(WORLD, wire=wire, **LOSSY) as qc:
            got = np.empty_like(x)
            qc.Allgather(own, got)
            check(qc, got, want, want.astype(np.float64), held,
                  f"allgather {wire} {np.dtype(dtype).name}", bad)
    report(bad)


def node_sizes():
    spec = os.environ.get("EQUARX_MPI_FAKE_NODES")
    return parse_nodes(spec, WORLD.Get_size()) if spec else [WORLD.Get_size()]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_hierarchical_nonfinite_blocks_are_mpis(dtype):
    sizes = node_sizes()
    if len(sizes) == 1 or len(set(sizes)) > 1:
        pytest.skip("needs a faked layout of several equal nodes (run_tests.sh sets them)")
    bad = []
    run_allreduce("hierarchical", HIERARCHICAL_WIRES[np.dtype(dtype)], dtype, bad,
                  in_place_all=True)
    report(bad)
