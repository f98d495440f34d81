"""The certified error bound (bound.py: MPI's summation bound, the trailers'
bookkeeping, per-block records), the bound of MPI's own calls
(mpi_bound.py) and the error-bounded mode's budget
(tolerance.py).  Arithmetic only: no messages."""
