"""One AllReduce of more than 2 GiB per rank (no 32-bit count overflow).

    EQUARX_MPI_LARGE=1 mpirun -n 2 python -m pytest --with-mpi tests/test_mpi_large.py

Needs about 4 GiB of memory per rank; run_tests.sh runs it at 2 ranks.
Data is chosen so int8 quantization is exact at every hop (each block holds
a 127 and the ranks add equal values), so the exact result is known.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from equarx_mpi import QuantizedComm

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.large,
              pytest.mark.skipif(os.environ.get("EQUARX_MPI_LARGE") != "1",
                                 reason="set EQUARX_MPI_LARGE=1 (needs ~4 GiB per rank)")]


def test_allreduce_above_2_gib_per_rank():
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    n = (2 << 30) // 4 + 3 * 1024 + 5                  # just over 2 GiB of float32
    x = (np.arange(n, dtype=np.int64) * 7919 % 255 - 127).astype(np.float32)
    x[::256] = 127
    with QuantizedComm(comm) as qc:
        qc.Allreduce(MPI.IN_PLACE, x)
        assert qc._ws.nbytes < 2 ** 31 * 0.6
    expect_bad = 0
    for lo in range(0, n, 1 << 26):                    # check without a second full copy
        i = np.arange(lo, min(n, lo + (1 << 26)), dtype=np.int64)
        want = (i * 7919 % 255 - 127).astype(np.float32)
        want[i % 256 == 0] = 127
        expect_bad += int(np.count_nonzero(x[lo:lo + i.size] != P * want))
    bad = comm.allreduce(expect_bad)
    assert bad == 0, f"{bad} wrong values"
