"""The cost model ``algorithm="auto"`` decides with (costmodel.py), the
machine profiles it reads (profiles.py) and the built-in one (builtin.py,
written by ``python -m equarx_mpi.tune builtin``)."""
