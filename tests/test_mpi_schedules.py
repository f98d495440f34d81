"""What every quantized schedule ("ring", "two_shot", "rabenseifner")
must do, one body per check, parametrized by schedule (mpi4py's arrayimpl
pattern), under MPI at any number of ranks.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_schedules.py
    mpirun -n 5 python -m pytest --with-mpi tests/test_mpi_schedules.py -k rabenseifner

Every rank builds every rank's input from one seed and compares with the
numpy simulation of the schedule (reference.py, reference_two_shot.py,
reference_rabenseifner.py; the ring's block wires through
reference_formats.py): bit for bit, identical on all ranks, within the
per-value error bound against an exact float64 sum and within the
library's own bound.  Per-rank checks are
combined across ranks before asserting.  Each schedule keeps its own cases
(the ring on four communicators, the others on two); what one schedule
alone does stays in its module (test_mpi_allreduce.py: the ring,
test_mpi_two_shot.py, test_mpi_rabenseifner.py, test_mpi_formats.py: the
ring's block wires).  EQUARX_MPI_TWO_SHOT_CASES (default 24) and
EQUARX_MPI_RABENSEIFNER_CASES (default 12) set the number of randomized
cases; EQUARX_MPI_RABENSEIFNER_ALL=1 runs every wire with every type and
length on rabenseifner (slow: each wire and type compiles its kernels).
"""
import os

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import (
    COMMS,
    WORLD,
    case_id,
    everywhere,
    exact_sum,
    inputs,
    make_comm,
    same_on_all_ranks,
    sum_slack,
)
from reference import BF16, INT8, allgather, ring_allreduce, shard_edges
from reference_formats import CODECS
from reference_rabenseifner import rabenseifner_allreduce
from reference_two_shot import two_shot_allreduce
from test_mpi_property import check_schedule_case, mpi, run_cases

from equarx_mpi import QuantizedComm
from equarx_mpi.wire.formats import default_block

pytestmark = pytest.mark.mpi(min_size=1)
DTYPES = [np.float32, np.float64, np.float16, BF16]
OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
WIRES = ["int8", "int4", "fp8", "int8-affine", "int4-affine", "bf16", "fp32", "int3", "int2",
         "int5", "int6"]
RING_BLOCK = 64         # the ring's block wires (CODECS) run on small blocks
ALL = os.environ.get("EQUARX_MPI_RABENSEIFNER_ALL", "0") not in ("", "0")


def simulate(schedule, xs, block, wire="int8", **kw):
    """The schedule's numpy simulation; the ring's takes the wire's codec."""
    if schedule == "ring":
        return ring_allreduce(xs, block, codec=CODECS.get(wire, INT8), **kw)
    sim = two_shot_allreduce if schedule == "two_shot" else rabenseifner_allreduce
    return sim(xs, block, wire=wire, **kw)


def qcomm(comm, schedule, wire="int8", block=None, chunks=None, **kw):
    """QuantizedComm on ``schedule`` (block and chunks: None, the defaults)."""
    opts = dict(kw, block_size=block, chunks=chunks)
    return QuantizedComm(comm, algorithm=schedule, wire=wire, min_quantized_bytes=0,
                         **{k: v for k, v in opts.items() if v is not None})


def library_bound_holds(qc, out, xs, what, comm):
    """|out - exact| within last_error_bound and within block_bounds,
    for the values of kept blocks (flagged ones are MPI's)."""
    err = np.abs(out.astype(np.float64) - exact_sum(xs)) - sum_slack(xs)
    per = np.repeat(qc.block_bounds(), qc.block_size)[:out.size]
    ok = np.isfinite(err)
    everywhere((err[ok] <= qc.last_error_bound).all(), f"{what}: within last_error_bound",
               comm=comm)
    everywhere((err[ok] <= per[ok]).all(), f"{what}: within block_bounds", comm=comm)


RAB_CASES = [(w, np.float32, n) for w in WIRES for n in (1, 257, 4099, 30001)] + \
    [("int8", d, n) for d in (np.float64, np.float16, BF16) for n in (5, 4099, 30001)] + \
    [(w, d, 3001) for w in ("int4", "fp8", "int8-affine", "bf16")
     for d in (np.float16, BF16, np.float64)]
if ALL:
    RAB_CASES = [(w, d, n) for w in WIRES for d in DTYPES
                 for n in (1, 3, 257, 4099, 30001, 100003)]
# schedule, communicator, wire, dtype, n, block, chunks, offset (inputs offset + offset/100 N)
ALLREDUCE_CASES = \
    [("ring", c, "int8", d, n, None, None, 0.0) for c in COMMS for d in DTYPES
     for n in (0, 1, 7, 255, 257, 1000, 4099, 100003)] + \
    [("ring", "world", w, d, n, RING_BLOCK, None, off) for w in CODECS for d in DTYPES
     for n, off in ((1, 0.0), (257, 0.0), (4099, 0.0), (3001, 1000.0))] + \
    [("two_shot", c, "int8", d, n, None, None, 0.0) for c in ("world", "split")
     for d in DTYPES for n in (0, 1, 257, 4099, 100003)] + \
    [("two_shot", "world", w, d, 10001, None, 2, 0.0) for w in WIRES[1:] for d in DTYPES] + \
    [("rabenseifner", c, w, d, n, None, 2, 0.0) for c in ("world", "split")
     for w, d, n in RAB_CASES]


@pytest.mark.parametrize("schedule,comm_kind,wire,dtype,n,block,chunks,offset",
                         ALLREDUCE_CASES, ids=case_id)
def test_allreduce_matches_simulation_bitwise(schedule, comm_kind, wire, dtype, n, block,
                                              chunks, offset):
    block = block or default_block(wire)
    with make_comm(comm_kind) as comm:
        P, r = comm.Get_size(), comm.Get_rank()
        xs = inputs(P, n, dtype, seed=n, scale=offset / 100 or 1.0, offset=offset)
        out, again = np.empty_like(xs[r]), np.empty_like(xs[r])
        with qcomm(comm, schedule, wire, block, chunks) as qc:
            qc.Allreduce(xs[r], out)
            method = qc.last_call.method
            if comm_kind == "world" and P > 1:
                library_bound_holds(qc, out, xs, wire, comm)
            qc.Allreduce(xs[r], again)
        want = "copy" if P == 1 else "mpi" if n == 0 else schedule   # nothing to send: MPI's
        everywhere(method == want, f"took {method}, want {want}", comm=comm)
        ref, bound, _ = simulate(schedule, xs, block, wire, with_bound=True)
        everywhere(out.tobytes() == ref.tobytes(), "equal to the numpy simulation", comm=comm)
        everywhere(again.tobytes() == out.tobytes(), "identical from call to call", comm=comm)
        same_on_all_ranks(out, comm)
        err = np.abs(out.astype(np.float64) - exact_sum(xs))
        everywhere((err <= bound + sum_slack(xs)).all(), "error within the per-value bound",
                   comm=comm)


@pytest.mark.parametrize("schedule,comm_kind,dtype",
                         [("ring", c, d) for c in COMMS for d in DTYPES] +
                         [(s, "world", d) for s in ("two_shot", "rabenseifner") for d in DTYPES],
                         ids=case_id)
def test_in_place_equals_out_of_place(schedule, comm_kind, dtype):
    with make_comm(comm_kind) as comm:
        x = inputs(comm.Get_size(), 5000, dtype, seed=7)[comm.Get_rank()]
        with qcomm(comm, schedule, chunks=3) as qc:
            out = np.empty_like(x)
            qc.Allreduce(x, out)
            a = x.copy()
            qc.Allreduce(MPI.IN_PLACE, a)
            b = x.copy()
            qc.Allreduce(b, b)
        everywhere(a.tobytes() == out.tobytes() and b.tobytes() == out.tobytes(),
                   "in place equals out of place", comm=comm)


@pytest.mark.parametrize("opts", [dict(chunks=1), dict(chunks=2), dict(chunks=5),
                                  dict(chunks=64), dict(max_message_bytes=4096),
                                  dict(chunks=3, max_message_bytes=1000)], ids=str)
@pytest.mark.parametrize("schedule", ["ring", "two_shot", "rabenseifner"])
def test_pieces_do_not_change_result(schedule, opts):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    xs = inputs(P, 70001, np.float32, seed=3)
    with qcomm(WORLD, schedule, **opts) as qc:
        got = qc.allreduce(xs[r])
    everywhere(got.tobytes() == simulate(schedule, xs, 256).tobytes(),
               f"{opts} equals the simulation")


@pytest.mark.parametrize("schedule,dtype,block",
                         [("ring", np.float32, b) for b in (32, 1024, 4096)] +
                         [("two_shot", np.float64, b) for b in (32, 1024, 4096)] +
                         [("rabenseifner", np.float64, b) for b in (32, 1024)], ids=case_id)
def test_block_sizes(schedule, dtype, block):
    xs = inputs(WORLD.Get_size(), 30000, dtype, seed=block)
    with qcomm(WORLD, schedule, block=block) as qc:
        got = qc.allreduce(xs[WORLD.Get_rank()])
    everywhere(got.tobytes() == simulate(schedule, xs, block).tobytes(),
               f"block {block} equals the simulation")


@pytest.mark.parametrize("schedule,comm_kind,wire,block,dtype,op",
                         [("ring", c, "int8", 256, d, op) for c in COMMS
                          for d in (np.float32, np.float64, BF16) for op in ("max", "min")] +
                         [("ring", "world", w, RING_BLOCK, d, op) for w in CODECS
                          for d in (np.float32, np.float64) for op in ("max", "min")] +
                         [("two_shot", "world", "int8", 256, d, op) for d in DTYPES
                          for op in ("max", "min")] +
                         [("rabenseifner", "world", w, default_block(w), d, op)
                          for w in ("int8", "int4", "fp8", "int8-affine")
                          for d in (np.float32, np.float16) for op in ("max", "min")],
                         ids=case_id)
def test_max_min_quantized_when_asked_never_cross(schedule, comm_kind, wire, block, dtype, op):
    with make_comm(comm_kind) as comm:
        P, r = comm.Get_size(), comm.Get_rank()
        xs = inputs(P, 3001, dtype, seed=11)
        with qcomm(comm, schedule, wire, block, lossy_ops=("sum", op)) as qc:
            got = qc.allreduce(xs[r], OPS[op])
            everywhere(P == 1 or qc.last_call.wire == wire, f"{op} travelled quantized",
                       comm=comm)
        ref, bound, _ = simulate(schedule, xs, block, wire, op=op, with_bound=True)
        everywhere(got.tobytes() == ref.tobytes(), f"{op} equals the simulation", comm=comm)
        exact = getattr(np, op)([x.astype(np.float64) for x in xs], axis=0)
        g = got.astype(np.float64)
        everywhere((np.abs(g - exact) <= bound).all(), f"{op} within its bound", comm=comm)
        everywhere((g >= exact).all() if op == "max" else (g <= exact).all(),
                   f"quantized {op} never {'below' if op == 'max' else 'above'} the true {op}",
                   comm=comm)


def nonfinite_inputs(P, n, dtype, op):
    """Inputs with Inf, NaN (sign and payload), overflowing sums and, for
    MAX/MIN, an infinity a quantized reduction could drop (-Inf under MAX
    held by the owner of its shard, as two-shot cuts them)."""
    xs = inputs(P, n, np.float64, seed=5)
    edges = shard_edges(n, P, 256)
    big = float(np.finfo(np.float32).max)
    nan = np.array([0xFFC01234], np.uint32).view(np.float32)[0]
    for r, x in enumerate(xs):
        x[[3, 600 + r]] = [np.inf, big]          # every rank: Inf at 3, max in 600+r's block
        x[1000] = big if op == "sum" else x[1000]
        x[edges[r]] = -np.inf if op == "max" else np.inf     # in the owner's own shard
    xs[-1][1500] = nan
    xs[0][3] = -np.inf                            # Inf + -Inf = NaN
    with np.errstate(over="ignore"):
        return [x.astype(dtype) if dtype != BF16 else x.astype(np.float32).astype(BF16)
                for x in xs]


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("schedule", ["two_shot", "rabenseifner"])
def test_nonfinite_blocks_equal_mpi(schedule, dtype, op):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    xs = nonfinite_inputs(P, 2000, dtype, op)
    with qcomm(WORLD, schedule, lossy_ops=("sum", "max", "min")) as qc:
        out = xs[r].copy()
        qc.Allreduce(MPI.IN_PLACE, out, OPS[op])
        exact_values = qc.last_call.exact_values
    ref, _, flagged = simulate(schedule, xs, 256, op=op, with_bound=True)
    # MPI's own Allreduce of just those values (its summation order may
    # depend on the count)
    want = mpi("Allreduce", xs[r][flagged], op)
    bad = [~np.isfinite(x.astype(np.float64)) for x in xs]
    everywhere(P == 1 or all(flagged[b].all() for b in bad),
               "every block holding Inf/NaN is flagged")
    everywhere(out[flagged].tobytes() == want.tobytes(),
               "flagged blocks equal MPI's Allreduce bit for bit")
    everywhere(out[~flagged].tobytes() == ref[~flagged].tobytes(),
               "the others equal the simulation")
    everywhere(exact_values == (flagged.sum() if P > 1 else 0),
               "last_call counts the values reduced exactly")
    same_on_all_ranks(out)


RAB_RS_CASES = [("int8", d) for d in DTYPES] + \
    [(w, np.float32) for w in ("int4", "fp8", "int8-affine", "bf16")]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("schedule,wire,dtype,block,chunks",
                         [("ring", "int8", d, None, None) for d in DTYPES] +
                         [("ring", w, np.float32, RING_BLOCK, None) for w in CODECS] +
                         [("two_shot", "int8", d, None, None) for d in DTYPES] +
                         [("two_shot", w, d, None, 2) for w in WIRES[1:] for d in DTYPES] +
                         [("rabenseifner", w, d, None, 2) for w, d in RAB_RS_CASES],
                         ids=case_id)
def test_reduce_scatter_block(schedule, wire, dtype, block, chunks, in_place):
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    m = 1237
    xs = inputs(P, P * m, dtype, seed=21)
    with qcomm(WORLD, schedule, wire, block, chunks) as qc:
        if in_place:
            buf = xs[r].copy()
            qc.Reduce_scatter_block(MPI.IN_PLACE, buf)
            got = buf[:m]
        else:
            got = np.empty(m, dtype)
            qc.Reduce_scatter_block(xs[r], got)
        method, mine_bound = qc.last_call.method, qc.last_error_bound
    everywhere(method == (schedule if P > 1 else "copy"), f"took {method}")
    ref, bound, _ = simulate(schedule, xs, block or default_block(wire), wire, with_bound=True,
                             kind="reduce_scatter")
    mine = slice(r * m, (r + 1) * m)
    everywhere(got.tobytes() == ref[mine].tobytes(), f"{wire} equal to the simulation")
    err = np.abs(got.astype(np.float64) - exact_sum(xs)[mine]) - sum_slack(xs)[mine]
    everywhere((err <= bound[mine]).all(), "within the simulation's bound")
    everywhere((err <= mine_bound).all(), "within last_error_bound")


@pytest.mark.parametrize("schedule,wire,block",
                         [("ring", "int8", 256)] +
                         [("ring", w, RING_BLOCK) for w in CODECS] +
                         [("two_shot", "int8", 256), ("rabenseifner", "int8", 256)], ids=case_id)
def test_allgather_is_the_ring(schedule, wire, block):
    """Every schedule's Allgather is the ring's: each value quantized once,
    by its owner."""
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    segs = inputs(P, 999, np.float32, seed=8)
    with qcomm(WORLD, schedule, wire, block) as qc:
        out = np.empty(P * 999, np.float32)
        qc.Allgather(segs[r], out)
        method = qc.last_call.method
    everywhere(method == ("ring" if P > 1 else "copy"), f"Allgather took {method}")
    want = allgather(segs, block, codec=CODECS.get(wire, INT8)) if P > 1 else segs[0]
    everywhere(out.tobytes() == want.tobytes(), "each value quantized once by its owner")
    same_on_all_ranks(out)


@pytest.mark.parametrize("schedule,seed,cases,draws_allgather", [
    ("two_shot", 8, int(os.environ.get("EQUARX_MPI_TWO_SHOT_CASES", "24")), True),
    # an Allgather drawn runs as an Allreduce (rabenseifner's Allgather is the ring's)
    ("rabenseifner", 18, int(os.environ.get("EQUARX_MPI_RABENSEIFNER_CASES", "12")), False)])
def test_random_cases_against_exact_answers(schedule, seed, cases, draws_allgather):
    """Random dtypes, blocks, lengths, ops (MAX/MIN quantized too), in place
    or not, and adversarial data (tests/test_mpi_property.py's generator)."""
    qcs = {b: qcomm(WORLD, schedule, block=b, lossy_ops=("sum", "max", "min"))
           for b in (32, 64, 256, 1024)}

    def sim(xs, block, op, **kw):
        return simulate(schedule, xs, block, op=op, **kw)
    run_cases(qcs, seed + WORLD.Get_size(), cases,
              lambda *a: check_schedule_case(*a, sim, allgather=draws_allgather))
