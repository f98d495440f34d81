"""The cost model ``algorithm="auto"`` decides with (costmodel.py: the
profile's corrections; physical.py: the time of each schedule and of an
ideal MPI; errors.py: each method's error), the machine profiles it reads
(profiles.py) and the built-in one (builtin.py, written by
``python -m equarx_mpi.tune builtin``)."""
