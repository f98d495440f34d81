import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def w():
    """A wrapped COMM_WORLD that quantizes every float SUM's size
    (test_mpi_wrap*.py)."""
    from mpi4py import MPI

    import equarx_mpi
    c = equarx_mpi.wrap(MPI.COMM_WORLD, min_quantized_bytes=0)
    yield c
    c.free()            # frees the library's duplicates; WORLD's own handle stays


def pytest_configure(config):
    config.addinivalue_line("markers", "large: more than 2 GiB per rank")


# The suite tests each schedule by name: the default algorithm ("auto")
# would pick among them by the machine's profile.  Tests of "auto" pass it
# explicitly (test_mpi_auto.py), and every test decides with the built-in
# profile, never one saved on the machine by `python -m equarx_mpi.tune`.
# Subprocesses (mpirun in serial tests, examples) inherit both.
os.environ.setdefault("EQUARX_MPI_ALGORITHM", "ring")
os.environ.setdefault("EQUARX_MPI_PROFILE", "builtin")


# Under mpirun the suite runs at 1, 2, 3, 4 and 8 ranks (run_tests.sh).
# Every test runs at 1 and 2 ranks with all its cases.  At 3, 4 and 8 ranks
# an unparametrized test runs whole, and the cases of a parametrized test
# take turns: its k-th case runs at one of the three, in rotation (the same
# on every rank: collection order is), so every test meets an uneven split,
# a power of two above 2 and the largest size, every case one of them, and
# the default run stays within its time.  The faked node layouts
# (EQUARX_MPI_FAKE_NODES) run every case.  EQUARX_MPI_FULL=1 runs every case
# at every size.
SPREAD = {3: 0, 4: 1, 8: 2}


def pytest_collection_modifyitems(config, items):
    if (os.environ.get("EQUARX_MPI_FULL") == "1" or os.environ.get("EQUARX_MPI_FAKE_NODES")
            or not config.getoption("with_mpi", False)):
        return
    import zlib

    from mpi4py import MPI
    turn = SPREAD.get(MPI.COMM_WORLD.Get_size())
    if turn is None:
        return
    keep, drop, seen = [], [], {}
    for item in items:
        if getattr(item, "callspec", None) is None:
            keep.append(item)
            continue
        fn = f"{item.path}::{item.originalname}"
        k = seen[fn] = seen.get(fn, -1) + 1
        here = (k + zlib.crc32(fn.encode())) % len(SPREAD) == turn
        (keep if here else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
