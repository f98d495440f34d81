"""The package as a user installs it: run under mpirun from outside the
source tree with only the built wheel's files on the path (run_tests.sh
builds the wheel and installs it into a scratch folder).  A quantized
Allreduce, a wrapped communicator and the error feedback must work, and the
module must come from the wheel, not the tree.

    mpirun -n 2 python tests/installed_check.py SOURCE_TREE
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import equarx_mpi
from equarx_mpi import ErrorFeedback, QuantizedComm, wrap

tree = os.path.realpath(sys.argv[1])
where = os.path.realpath(equarx_mpi.__file__)
failed = []


def check(ok, what):
    if not MPI.COMM_WORLD.allreduce(bool(ok), MPI.LAND):
        failed.append(what)


check(not where.startswith(tree + os.sep), f"imported from the wheel, not {where}")
r, P = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
x = np.random.default_rng(r).standard_normal(1 << 14).astype(np.float32)
exact = MPI.COMM_WORLD.allreduce(x.astype(np.float64))
with QuantizedComm(MPI.COMM_WORLD, algorithm="ring", min_quantized_bytes=0) as qc:
    out = qc.allreduce(x)
    check(qc.last_call.method == ("ring" if P > 1 else "copy"), "a quantized call")
    check(np.abs(out - exact).max() <= qc.last_error_bound, "within the bound")
    y = x.copy()
    qc.Allreduce(MPI.IN_PLACE, y, feedback=ErrorFeedback())
    check(np.abs(y - exact).max() <= qc.last_error_bound, "with error feedback")
w = wrap(MPI.COMM_WORLD, min_quantized_bytes=0)
z = np.empty_like(x)
w.Allreduce(x, z)
check(np.abs(z - exact).max() <= w.last_call.error_bound, "through wrap()")
w.free()
print(f"installed package {os.path.dirname(where)}: "
      f"{4 - len(failed)} passed, {len(failed)} failed" + "".join(f"\n  {f}" for f in failed))
sys.exit(1 if failed else 0)
