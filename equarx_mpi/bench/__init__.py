"""The benchmarks, ``python -m equarx_mpi.bench [COMMAND]`` (__main__.py
holds the command registry), and what the tools share.

Commands, one module each: allreduce.py (the default: every method against
MPI; with overlap.py, report.py and plot.py), shm.py, tolerance.py,
calls.py (the per-call cost of small messages), kernels.py.  Shared, and
free of MPI: common.py (sizes, rates, latencies, the size sweep, the
registry's dispatch), methods.py (the AllReduce methods by name),
native.py (the C reference's loader).  Importing this package
imports nothing.
"""
