"""One AllReduce of more than 2 GiB per rank (no 32-bit count overflow).

    EQUARX_MPI_LARGE=1 mpirun -n 2 python -m pytest --with-mpi tests/test_mpi_large.py

Needs about 4 GiB of memory per rank; run_tests.sh runs it at 2 ranks.
Data is chosen so int8 quantization is exact at every hop: each block holds
only -v, 0 and +v (v differs from block to block) and the ranks add equal
values, so every code is -127, 0 or 127, which decode exactly.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from equarx_mpi import QuantizedComm

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.large,
              pytest.mark.skipif(os.environ.get("EQUARX_MPI_LARGE") != "1",
                                 reason="set EQUARX_MPI_LARGE=1 (needs ~4 GiB per rank)")]


CHUNK = 1 << 26


def pattern(i):
    """-v, 0 or +v, with v = 1..97 chosen per block of 256."""
    v = (i // 256 % 97 + 1).astype(np.float32)
    return ((i * 7919 % 3).astype(np.float32) - 1) * v


def test_allreduce_above_2_gib_per_rank():
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    n = (2 << 30) // 4 + 3 * 1024 + 5                  # just over 2 GiB of float32
    x = np.empty(n, np.float32)
    for lo in range(0, n, CHUNK):                      # no n-sized int64 temporaries
        x[lo:lo + CHUNK] = pattern(np.arange(lo, min(n, lo + CHUNK), dtype=np.int64))
    with QuantizedComm(comm) as qc:
        qc.Allreduce(MPI.IN_PLACE, x)
        assert qc._runner.engine._ws.nbytes < 2 ** 31 * 0.6
    expect_bad = 0
    for lo in range(0, n, CHUNK):                      # check without a second full copy
        want = pattern(np.arange(lo, min(n, lo + CHUNK), dtype=np.int64))
        expect_bad += int(np.count_nonzero(x[lo:lo + want.size] != P * want))
    bad = comm.allreduce(expect_bad)
    assert bad == 0, f"{bad} wrong values"
