"""The ring (the default algorithm) and the library's calls around it
under MPI, at any number of ranks: what the ring alone does.
test_mpi_schedules.py checks it, as every schedule, against its numpy
simulation (reference.ring_allreduce) bit for bit, within the bounds.

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_allreduce.py

Every rank builds every rank's input from one seed, so each rank can compute
the exact float64 result and the numpy simulation of the ring itself.
Per-rank checks are combined across ranks before asserting, so a failure on
one rank fails the test everywhere instead of leaving the others waiting.
"""
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import COMMS, everywhere, exact_sum, inputs, make_comm, same_on_all_ranks
from reference import BF16, ring_allreduce

import equarx_mpi
from equarx_mpi import QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)

EPS = {np.dtype(np.float32): 2.0 ** -24, np.dtype(np.float64): 2.0 ** -53,
       np.dtype(np.float16): 2.0 ** -11, BF16: 2.0 ** -8}
OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
# Relative L2 error of the int8 ring (block 256) on standard-normal data; a
# numpy simulation gives 0.85% / 1.10% / 1.48% at 2 / 4 / 8 ranks.
REL_L2_LIMIT = {1: 0.0, 2: 0.0095, 3: 0.011, 4: 0.012, 5: 0.013, 6: 0.014, 7: 0.015, 8: 0.016}


@pytest.fixture(params=COMMS)
def comm(request):
    with make_comm(request.param) as c:
        yield c


def test_relative_l2_error_int8_ring_standard_normal():
    comm = MPI.COMM_WORLD
    P, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(P, 1 << 20, np.float32, seed=42)
    out = equarx_mpi.allreduce(xs[r], comm, min_quantized_bytes=0)
    exact = exact_sum(xs)
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    limit = REL_L2_LIMIT.get(P, 0.0045 * np.log2(P) + 0.0045)
    everywhere(rel <= limit, f"relative L2 error {rel:.4%} <= {limit:.2%} at {P} ranks", comm=comm)
    same_on_all_ranks(out, comm)


def test_max_message_bytes_splits_without_changing_result():
    comm = MPI.COMM_WORLD
    x = inputs(comm.Get_size(), 200000, np.float32, seed=9)[comm.Get_rank()]
    with QuantizedComm(comm, min_quantized_bytes=0, max_message_bytes=4096) as qc:
        got = qc.allreduce(x)
    ref = ring_allreduce(inputs(comm.Get_size(), 200000, np.float32, seed=9), 256)
    everywhere(got.tobytes() == ref.tobytes(), "split messages equal the simulation", comm=comm)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16], ids=lambda d: np.dtype(d).name)
def test_max_min_exact_by_default(comm, op, dtype):
    P, r = comm.Get_size(), comm.Get_rank()
    xs = inputs(P, 300001, dtype, seed=12)
    with QuantizedComm(comm, min_quantized_bytes=0) as qc:
        got = qc.allreduce(xs[r], OPS[op])
        everywhere(qc.last_call.method in ("mpi", "copy"), f"{op} took exact MPI", comm=comm)
    acc = np.float64 if dtype == np.float64 else np.float32
    want = getattr(np, op)(np.stack([x.astype(acc) for x in xs]), axis=0).astype(dtype)
    everywhere(got.tobytes() == want.tobytes(), f"{op} is exact by default", comm=comm)


def test_repeated_calls_identical():
    comm = MPI.COMM_WORLD
    x = inputs(comm.Get_size(), 123457, np.float32, seed=5)[comm.Get_rank()]
    with QuantizedComm(comm, min_quantized_bytes=0) as qc:
        first = qc.allreduce(x)
        for _ in range(5):
            everywhere(qc.allreduce(x).tobytes() == first.tobytes(), "repeat identical", comm=comm)


def test_p1_and_small_messages_are_exact(comm):
    r = comm.Get_rank()
    x = inputs(comm.Get_size(), 1000, np.float32, seed=1)[r]
    with QuantizedComm(comm) as qc:           # default threshold: 4000 B is small
        got = qc.allreduce(x)
    want = np.empty_like(x)
    comm.Allreduce(x, want)
    everywhere(got.tobytes() == want.tobytes(), "small message takes exact MPI", comm=comm)
    with QuantizedComm(MPI.COMM_SELF, min_quantized_bytes=0) as qc:
        everywhere(qc.allreduce(x).tobytes() == x.tobytes(), "P=1 returns the input", comm=comm)


@pytest.mark.parametrize("dtype,op", [(np.int32, "sum"), (np.float32, "prod"),
                                      (np.complex128, "sum"), (np.float64, "prod")])
def test_other_ops_and_dtypes_take_exact_mpi(dtype, op):
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.Get_rank())
    x = (rng.standard_normal(100000) + 1).astype(dtype)
    mop = {"sum": MPI.SUM, "prod": MPI.PROD}[op]
    with QuantizedComm(comm, min_quantized_bytes=0) as qc:
        got = qc.allreduce(x, mop)
    want = np.empty_like(x)
    comm.Allreduce(x, want, mop)
    everywhere(got.tobytes() == want.tobytes(), "exact path equals comm.Allreduce", comm=comm)


@pytest.mark.parametrize("dtype", [BF16], ids=lambda d: np.dtype(d).name)
def test_small_half_precision_exact_path(dtype):
    # (float16 goes to MPI natively: test_mpi_robustness.py checks its bits)
    comm = MPI.COMM_WORLD
    xs = inputs(comm.Get_size(), 100, dtype, seed=2)
    got = equarx_mpi.allreduce(xs[comm.Get_rank()], comm)
    want = exact_sum([x.astype(np.float32) for x in xs])
    err = np.abs(got.astype(np.float64) - want)
    everywhere((err <= (comm.Get_size() + 1) * EPS[np.dtype(dtype)] * np.abs(want)
                      + 1e-6).all(), "half precision below threshold is (nearly) exact", comm=comm)


def test_reduce_scatter_block_and_allgather_compose_to_allreduce_ish(comm):
    P, r = comm.Get_size(), comm.Get_rank()
    m = 3000
    xs = inputs(P, P * m, np.float32, seed=21)
    exact = exact_sum(xs)
    with QuantizedComm(comm, min_quantized_bytes=0) as qc:
        mine = np.empty(m, np.float32)
        qc.Reduce_scatter_block(xs[r], mine)
        inplace = xs[r].copy()
        qc.Reduce_scatter_block(MPI.IN_PLACE, inplace)
        full = np.empty(P * m, np.float32)
        qc.Allgather(mine, full)
        full2 = np.zeros(P * m, np.float32)
        full2[r * m:(r + 1) * m] = mine
        qc.Allgather(MPI.IN_PLACE, full2)
    everywhere(inplace[:m].tobytes() == mine.tobytes(), "RSB in place", comm=comm)
    seg = exact[r * m:(r + 1) * m]
    rel = np.linalg.norm(mine - seg) / np.linalg.norm(seg)
    everywhere(rel <= REL_L2_LIMIT.get(P, 0.03), f"RSB error {rel:.4%}", comm=comm)
    everywhere(full.tobytes() == full2.tobytes(), "Allgather in place", comm=comm)
    same_on_all_ranks(full, comm)
    err = np.abs(full[r * m:(r + 1) * m] - mine).max()
    everywhere(err <= np.abs(mine).max() / 254 * 1.0001, "Allgather within half a step", comm=comm)


def test_module_allreduce_caches_one_quantized_comm_per_comm():
    comm = MPI.COMM_WORLD.Dup()
    x = np.ones(100000, np.float32)
    equarx_mpi.allreduce(x, comm)
    equarx_mpi.allreduce(x, comm)
    cached = comm.Get_attr(equarx_mpi.helper._keyval)
    assert len(cached) == 1
    qc = next(iter(cached.values()))
    equarx_mpi.allreduce(x, comm, bits=8)          # the defaults, spelled out
    assert len(comm.Get_attr(equarx_mpi.helper._keyval)) == 1
    got = equarx_mpi.allreduce(x, comm, bits=16)
    assert len(comm.Get_attr(equarx_mpi.helper._keyval)) == 2
    everywhere((got == comm.Get_size()).all(), "sum of ones", comm=comm)
    comm.Free()
    assert qc._comm is None          # freed with its communicator


@pytest.mark.parametrize("bits", [16, 32])
def test_uncompressed_wire_baselines(bits):
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    xs = inputs(P, 50000, np.float32, seed=bits)
    with QuantizedComm(comm, bits=bits, min_quantized_bytes=0) as qc:
        got = qc.allreduce(xs[comm.Get_rank()])
    same_on_all_ranks(got, comm)
    exact = exact_sum(xs)
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    limit = 1e-6 if bits == 32 else 2 ** -8 * P
    everywhere(rel <= limit, f"bits={bits} rel error {rel:.2e}", comm=comm)
