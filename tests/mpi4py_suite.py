"""mpi4py's own collective buffer tests, their communicators wrapped.

    mpirun -n P python tests/mpi4py_suite.py MPI4PY_TEST_DIR [--quantized] [unittest args: -v, -k NAME]

MPI4PY_TEST_DIR is test/ of the mpi4py sdist of the installed version
(run_tests.sh downloads it).  Before their modules load, MPI.COMM_WORLD and
MPI.COMM_SELF are replaced by equarx_mpi.wrap() of themselves: the tests
build their communicators from those names (``COMM = MPI.COMM_WORLD`` at
class level, ``MPI.COMM_WORLD.Dup()`` in setUp, which returns a wrapped
communicator too), so every call of test_cco_buf.py and test_cco_nb_buf.py
goes through the wrapper, their code unchanged.  unittest runs them (as
mpi4py's own runner, main.py, would; it hides numba from everything, which
the library needs).

--quantized sets algorithm="ring" and min_quantized_bytes=0 (as
EQUARX_MPI_ALGORITHM and EQUARX_MPI_MIN_QUANTIZED_BYTES, the environment
route; "auto", the default, keeps such small messages exact), so their float SUMs of a few values travel as
int8 through every buffer form; their checks allow 1% (assertAlmostEqual),
which int8 meets on their small integers.  Afterwards every rank checks
that the calls went through the library (and, with --quantized, that some
were quantized) and exits non-zero otherwise.
"""
import os
import sys

testdir, quantized = sys.argv[1], "--quantized" in sys.argv[2:]
extra = [a for a in sys.argv[2:] if a != "--quantized"]     # for unittest: -v, -k NAME
if quantized:
    os.environ["EQUARX_MPI_MIN_QUANTIZED_BYTES"] = "0"
    os.environ["EQUARX_MPI_ALGORITHM"] = "ring"
sys.path.insert(0, testdir)

from mpi4py import MPI  # noqa: E402

import equarx_mpi  # noqa: E402

world, self_ = MPI.COMM_WORLD, MPI.COMM_SELF
MPI.COMM_WORLD, MPI.COMM_SELF = equarx_mpi.wrap(world), equarx_mpi.wrap(self_)
wrapped = MPI.COMM_WORLD

# As mpi4py's runner does without --numba: arrayimpl must not see numba
# (its CUDA array backend needs a GPU), while the library keeps using it.
import numba  # noqa: E402

sys.modules["numba"] = None
import arrayimpl  # noqa: E402,F401

sys.modules["numba"] = numba

import unittest  # noqa: E402

argv = [sys.argv[0], *extra, "test_cco_buf", "test_cco_nb_buf"]
status = int(not unittest.main(module=None, argv=argv, exit=False).result.wasSuccessful())

s = wrapped.stats
problems = []
if s.calls == 0:
    problems.append("no call went through the wrapped COMM_WORLD")
if quantized and world.Get_size() > 1 and s.quantized_calls == 0:
    problems.append("--quantized, yet no call was quantized")
print(f"[{world.Get_rank()}] equarx_mpi: {s.calls} reduction calls through the wrapped "
      f"COMM_WORLD, {s.quantized_calls} quantized; tests exit status {status}"
      + "".join(f"; FAILED: {p}" for p in problems), flush=True)
bad = world.allreduce(int(bool(status or problems)))
sys.exit(1 if bad else 0)
