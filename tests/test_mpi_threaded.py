"""The option threads under MPI: every schedule and wire gives the same bits
with kernels on 1, 2 and 3 threads, in pieces or not.

    mpirun -n 3 python -m pytest --with-mpi tests/test_mpi_threaded.py
"""
import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import everywhere, raises_everywhere

from equarx_mpi import QuantizedComm
from equarx_mpi.wire import threaded

pytestmark = pytest.mark.mpi(min_size=1)
WORLD = MPI.COMM_WORLD
CASES = [("ring", "int8", "nearest"), ("ring", "int4", "stochastic"), ("ring", "bf16", "nearest"),
         ("two_shot", "int8", "nearest"), ("two_shot", "fp8", "nearest"),
         ("two_shot", "int8-affine", "nearest"), ("two_shot", "int4", "stochastic"),
         ("two_shot", "fp32", "nearest")]


@pytest.mark.parametrize("algorithm,wire,rounding", CASES)
def test_threads_do_not_change_a_bit(algorithm, wire, rounding, monkeypatch):
    # small parts, so that small messages are cut too
    monkeypatch.setattr(threaded, "MIN_PART", 2048)
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    n = 3 * 2048 * max(P, 2) * 3 + 1234          # parts on every rank's shard
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    x[7] = np.inf if r == 0 else 1.0             # a flagged block
    got = {}
    for threads in (1, 2, 3):
        for chunks in (1, 3):
            with QuantizedComm(WORLD, algorithm=algorithm, wire=wire, rounding=rounding,
                               threads=threads, chunks=chunks, min_quantized_bytes=0) as qc:
                everywhere(qc.threads == threads, f"threads {qc.threads}")
                out = qc.allreduce(x)
                rs = np.empty(n // P, np.float32)
                qc.Reduce_scatter_block(x[:rs.size * P], rs)
                got[threads, chunks] = out.tobytes() + rs.tobytes()
    first = got[1, 1]
    everywhere(all(v == first for v in got.values()),
               f"the same bits at 1-3 threads and 1 or 3 pieces: "
               f"{[k for k, v in got.items() if v != first]}")


def test_default_and_bad_values():
    with QuantizedComm(WORLD) as qc:
        everywhere(qc.threads >= 1, f"default {qc.threads}")
    for bad in (0, -1, 1.5, "2", 257):
        msg = raises_everywhere(ValueError, lambda: QuantizedComm(WORLD, threads=bad))
        assert "threads" in msg
