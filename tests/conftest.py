import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "large: more than 2 GiB per rank")


# The suite tests each schedule by name: the default algorithm ("auto")
# would pick among them by the machine's profile.  Tests of "auto" pass it
# explicitly (test_mpi_auto.py), and every test decides with the built-in
# profile, never one saved on the machine by `python -m equarx_mpi.tune`.
# Subprocesses (mpirun in serial tests, examples) inherit both.
os.environ.setdefault("EQUARX_MPI_ALGORITHM", "ring")
os.environ.setdefault("EQUARX_MPI_PROFILE", "builtin")
