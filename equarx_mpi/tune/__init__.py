"""The cost model's profiles, ``python -m equarx_mpi.tune [COMMAND]``
(__main__.py holds the command registry): measure.py (the default, under
mpirun), predict.py (predict and check, serial), builtin.py (the built-in
profile, for maintainers).  Importing this package imports nothing.
"""
