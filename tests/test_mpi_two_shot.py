"""algorithm="two_shot" under MPI, at any number of ranks: what it alone
does (test_mpi_schedules.py checks it, as every schedule, against its
numpy simulation, reference_two_shot.py).

    mpirun -n 4 python -m pytest --with-mpi tests/test_mpi_two_shot.py
"""
import numpy as np
import pytest
from mpi_helpers import WORLD, everywhere, exact_sum, inputs

from equarx_mpi import QuantizedComm

pytestmark = pytest.mark.mpi(min_size=1)


def test_relative_l2_error_does_not_grow_with_ranks():
    P, r = WORLD.Get_size(), WORLD.Get_rank()
    xs = inputs(P, 1 << 18, np.float32, seed=42)
    with QuantizedComm(WORLD, algorithm="two_shot", min_quantized_bytes=0) as qc:
        out = qc.allreduce(xs[r])
    exact = exact_sum(xs)
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    # measured here: 0.850% / 0.900% / 0.923% / 0.933% / 0.954% at 2 / 3 /
    # 4 / 5 / 8 ranks (2^20 values: docs/results/two-shot-error.txt; the
    # ring 0.85% .. 1.47%).  Two quantizations at most, so it stays below
    # 0.98% (the simulation's value with the owner's share quantized too)
    everywhere(rel <= (0.0 if P == 1 else 0.0105),
               f"relative L2 error {rel:.4%} <= 1.05% at {P} ranks")
